"""hotpath.py: where serve's time goes on the two per-call paths a rollout takes, profiled.

    python bench/hotpath.py [--before REV] [--seconds 10] [--out bench/profile.txt]

The two paths (each on a serve of its own, driven by one client, one call at a time, as the
hop and episode rows of bench.py measure them):

hop      a Gym tool call: POST /list_notes with a session cookie to `serve bundles/notes-v1
         --sandbox local`, which makes the MCP tools/call to the session's notebook env.
episode  a no-env OpenEnv episode: on one /ws, reset quiz-v1 (its prompt back), then the
         end_turn step that scores it (reward 1.0 checked).

Each is measured three ways, for --seconds each: (1) serve's own CPU per call or episode from
/proc, unprofiled; (2) cProfile of serve's event loop thread (timer: that thread's CPU time),
switched on by SIGUSR1 and dumped by SIGUSR2 once the workload is warm; (3) py-spy --nonblocking
samples of that thread, if py-spy is on PATH or in bench.py's venv (--no-py-spy skips). With
--before REV, serve as of git revision REV (its agentenv.py alone, in a folder of its own) is
profiled the same way first, and the summary shows both. Writes the summary to --out, and the raw
pstats and py-spy stacks beside it (*.pstats, *.folded: git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pstats
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import (AGENTENV, ANSWER, BENCH_VENV, COOKIE, NOTES, QUIZ, RESET, ROOT, Proc,
                   before_agentenv, cpu_ticks, free_port, notes_row, run_to_the_end, say, seed,
                   wait_health)

# serve, as `python agentenv.py serve ...` runs it (agentenv.py as __main__ from its folder), with
# a cProfile of the event loop's thread (timer: that thread's CPU time) switched on by SIGUSR1 and
# dumped by SIGUSR2.
PROFILED_SERVE = r'''
import cProfile, runpy, signal, sys, time
program, stats = sys.argv[1], sys.argv[2]
prof = cProfile.Profile(time.thread_time)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
def dump(*_):
    prof.disable()
    prof.dump_stats(stats)
signal.signal(signal.SIGUSR2, dump)
sys.argv = [program, *sys.argv[3:]]
sys.path.insert(0, str(__import__("pathlib").Path(program).parent))
runpy.run_path(program, run_name="__main__")
'''


def code_of(path: str, name: str) -> str:
    """Which code a profiled function is in, by its file (or, for a C function, its name)."""
    if path.endswith("agentenv.py"):
        return "agentenv.py"
    for part in ("/aiohttp/client", "/aiohttp/connector.py", "/aiohttp/cookiejar.py"):
        if part in path:
            return "aiohttp client (the MCP call to the env)"
    for part, kind in (("/aiohttp/_websocket", "aiohttp websocket"),
                       ("/aiohttp/web_ws", "aiohttp websocket"),
                       ("/aiohttp/", "aiohttp server and shared"),
                       ("/yarl/", "aiohttp (yarl, multidict)"),
                       ("/multidict/", "aiohttp (yarl, multidict)"), ("/json/", "json"),
                       ("/asyncio/", "asyncio"), ("selectors.py", "asyncio"),
                       ("/http/", "stdlib http (cookies)"), ("/logging/", "logging"),
                       ("/prometheus_client/", "prometheus-client")):
        if part in path:
            return kind
    if path == "~":
        if "socket" in name or "epoll" in name:
            return "socket and epoll calls (C)"
        if "json" in name or "scanner" in name or "encode" in name:
            return "json"
        return "other C built-ins"
    return "other Python"


def frame_code(frame: str) -> str:
    """code_of for a py-spy frame, "function (path:line)" with the path relative to sys.path."""
    where = frame.rsplit("(", 1)[-1]
    return code_of("/" + where.split(":")[0], frame.split(" (")[0])


def top(counter: collections.Counter, total: float, n: int) -> dict[str, float]:
    return {k: round(v / total, 4) for k, v in counter.most_common(n)}


def py_spy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    venv = BENCH_VENV / "bin" / "py-spy"
    return str(venv) if venv.exists() else None


# ------------------------------------------------------------------ the two workloads

class Hop:
    """One Gym session on notes-v1 calling list_notes back to back."""

    name, unit, bundle = "hop", "call", NOTES

    async def open(self, url: str) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        cookie = await seed(self.http, url, notes_row(NOTES, 0))
        self.http.cookie_jar.update_cookies({COOKIE: cookie})
        self.url = url + "/list_notes"

    async def once(self) -> None:
        async with self.http.post(self.url, json={}) as resp:
            text = await resp.text()
            if resp.status != 200 or text != "pancakes":
                raise RuntimeError(f"/list_notes answered {resp.status}: {text[:300]}")

    async def close(self) -> None:
        await self.http.close()


class Episode:
    """One /ws on quiz-v1 playing episodes back to back: reset, then the end_turn that scores it."""

    name, unit, bundle = "episode", "episode", QUIZ

    async def open(self, url: str) -> None:
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(url + "/ws", max_msg_size=0)

    async def once(self) -> None:
        await self.ws.send_str(RESET)
        reset = json.loads((await self.ws.receive(timeout=60)).data)
        if reset.get("type") != "observation":
            raise RuntimeError(f"reset answered {json.dumps(reset)[:300]}")
        await self.ws.send_str(ANSWER)
        ended = json.loads((await self.ws.receive(timeout=60)).data)
        if (ended.get("data") or {}).get("reward") != 1.0:
            raise RuntimeError(f"end_turn answered {json.dumps(ended)[:300]}")

    async def close(self) -> None:
        await self.ws.close()
        await self.http.close()


async def for_seconds(work, seconds: float) -> int:
    n, stop = 0, time.perf_counter() + seconds
    while time.perf_counter() < stop:
        await work.once()
        n += 1
    return n


async def profile_one(work, program: Path, which: str, out: Path, seconds: float,
                      spy: str | None) -> dict:
    """Serve (``program``) under the profiler, driven by ``work``: the three measures."""
    port = free_port()
    stats_path = out.with_name(f"{out.stem}-{work.name}-{which}.pstats")
    folded = stats_path.with_suffix(".folded")
    proc = Proc([sys.executable, "-c", PROFILED_SERVE, str(program), str(stats_path), "serve",
                 str(work.bundle), "--sandbox", "local", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as probe:
            await wait_health(probe, url, proc)
        await work.open(url)
        try:
            await for_seconds(work, 2.0)                              # warm up
            before, t = cpu_ticks(proc.pid), time.perf_counter()
            n = await for_seconds(work, seconds)
            wall, after = time.perf_counter() - t, cpu_ticks(proc.pid)
            hz = os.sysconf("SC_CLK_TCK")
            cpu = {"user_ms": (after[0] - before[0]) / hz * 1e3 / n,
                   "system_ms": (after[1] - before[1]) / hz * 1e3 / n, "per_s": n / wall,
                   "wall_ms": wall * 1e3 / n}
            sampled = None
            if spy:
                record = await asyncio.create_subprocess_exec(
                    spy, "record", "--pid", str(proc.pid), "--duration", str(round(seconds)),
                    "--rate", "250", "--format", "raw", "--function", "--nonblocking",
                    "--output", str(folded),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                await for_seconds(work, seconds + 1)
                spy_out, _ = await record.communicate()
                if record.returncode != 0:
                    raise RuntimeError(f"py-spy failed: {spy_out.decode()[-1000:]}")
                sampled = folded
            proc.popen.send_signal(signal.SIGUSR1)
            await asyncio.sleep(0.2)
            profiled = await for_seconds(work, seconds)
            proc.popen.send_signal(signal.SIGUSR2)
            for _ in range(100):
                if stats_path.exists():
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
        finally:
            await work.close()
    finally:
        proc.stop()
    return {"cpu_unprofiled": cpu, **read_cprofile(stats_path, profiled),
            **(read_py_spy(sampled) if sampled else {})}


def read_cprofile(path: Path, n: int) -> dict:
    """cProfile's stats: self time by code, the top functions by self time, agentenv.py's by
    cumulative time, all as shares of the total self time; and the profiled CPU per call."""
    stats = pstats.Stats(str(path)).stats
    total = sum(tt for (_, _, tt, _, _) in stats.values()) or 1.0
    by_code, self_time, ours_cum = collections.Counter(), collections.Counter(), collections.Counter()
    calls_per = collections.Counter()
    turns = 0                  # the event loop's iterations (each a select, then the callbacks)
    for (file, line, name), (_, calls, tt, ct, _) in stats.items():
        if name == "_run_once" and file.endswith("base_events.py"):
            turns += calls
        label = f"{name} ({Path(file).name if file != '~' else 'C'}:{line})"
        by_code[code_of(file, name)] += tt
        self_time[label] += tt
        calls_per[label] += calls
        if file.endswith("agentenv.py") and name not in ("main", "serve", "<module>"):
            ours_cum[label] = max(ours_cum[label], ct)
    return {"cprofile": {"n": n, "cpu_ms_per_op": total * 1e3 / n,
                         "python_calls_per_op": sum(calls_per.values()) / n,
                         "loop_iterations_per_op": turns / n,
                         "by_code": top(by_code, total, 14), "top_self": top(self_time, total, 25),
                         "agentenv_cumulative": top(ours_cum, total, 20)}}


def read_py_spy(folded: Path) -> dict:
    """py-spy's samples of the event loop thread (those under agentenv's main), less its waits."""
    busy, idle = 0, 0
    inner, code = collections.Counter(), collections.Counter()
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if " (" in f]
        if not frames or not any(f.startswith("main (") for f in frames):
            continue
        n = int(count)
        if frames[-1].startswith("EpollSelector.select"):
            idle += n
            continue
        busy += n
        inner[frames[-1]] += n
        code[frame_code(frames[-1])] += n
    return {"py_spy": {"busy": busy, "idle": idle, "by_code": top(code, busy or 1, 12),
                       "top_inner": top(inner, busy or 1, 12)}}


# ------------------------------------------------------------------ the summary

def lines_of(label: str, r: dict, unit: str) -> list[str]:
    pct = lambda d: [f"    {v * 100:5.1f}%  {k}" for k, v in d.items()]  # noqa: E731
    c, cpu = r["cprofile"], r["cpu_unprofiled"]
    out = [f"  {label}:",
           f"  1. unprofiled, {cpu['per_s']:.0f} {unit}s/s ({cpu['wall_ms']:.3f} ms a {unit}): "
           f"serve used {cpu['user_ms']:.3f} ms user + {cpu['system_ms']:.3f} ms system CPU per "
           f"{unit}",
           f"  2. cProfile, event loop thread CPU: {c['cpu_ms_per_op']:.3f} ms per {unit} "
           f"(inflated by the profiler's cost per Python call; {c['python_calls_per_op']:.0f} "
           f"function calls and {c['loop_iterations_per_op']:.1f} event loop iterations per "
           f"{unit})", "", "   self time by code:", *pct(c["by_code"]), "",
           "   top functions by self time:", *pct(c["top_self"]), "",
           "   agentenv.py functions by cumulative time (share of all self time):",
           *pct(c["agentenv_cumulative"]), ""]
    if "py_spy" in r:
        s = r["py_spy"]
        out += [f"  3. py-spy --nonblocking: {s['busy']} busy samples of the event loop thread "
                f"({s['idle']} more in its epoll wait, left out); innermost frame by code:",
                *pct(s["by_code"]), "", "   top innermost frames:", *pct(s["top_inner"]), ""]
    return out


def summary_text(cmd: str, seconds: float, results: dict, load: tuple[str, str]) -> str:
    out = [f"bench/hotpath.py: serve's hot paths profiled ({cmd})",
           f"load average before / after: {load[0]} / {load[1]}; {os.cpu_count()} cores; "
           f"{seconds:g} s per measure", "",
           "hop:     one Gym session, POST /list_notes back to back (serve notes-v1 --sandbox local,"
           " a notebook env)",
           "episode: one /ws on quiz-v1 (no env), reset + end_turn back to back", ""]
    for work, unit in (("hop", "call"), ("episode", "episode")):
        if work not in results:
            continue
        out.append(f"== {work} " + "=" * 80)
        ran = results[work]
        if "before" in ran:
            a, b = ran["after"]["cpu_unprofiled"], ran["before"]["cpu_unprofiled"]
            ca, cb = ran["after"]["cprofile"], ran["before"]["cprofile"]
            out += [f"  before / after: serve's CPU per {unit} (unprofiled) "
                    f"{b['user_ms'] + b['system_ms']:.3f} / {a['user_ms'] + a['system_ms']:.3f} ms;"
                    f" profiled {cb['cpu_ms_per_op']:.3f} / {ca['cpu_ms_per_op']:.3f} ms; Python "
                    f"function calls {cb['python_calls_per_op']:.0f} / "
                    f"{ca['python_calls_per_op']:.0f} per {unit}; event loop iterations "
                    f"{cb['loop_iterations_per_op']:.1f} / {ca['loop_iterations_per_op']:.1f} per "
                    f"{unit}", ""]
        for which in ("before", "after"):
            if which in ran:
                out += lines_of(f"{which} ({ran[which]['program']})", ran[which], unit)
    return "\n".join(out) + "\n"


async def main_async(args) -> int:
    out = Path(args.out)
    spy = None if args.no_py_spy else py_spy()
    if not args.no_py_spy and spy is None:
        say("hotpath: py-spy not found (PATH or the bench venv): cProfile and /proc only")
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="agentenv-hotpath-") as tmp:
        programs = {"after": AGENTENV}
        if args.before:
            programs = {"before": before_agentenv(args.before, Path(tmp)), **programs}
        for work in (Hop(), Episode()):
            if work.name not in args.paths.split(","):
                continue
            results[work.name] = {}
            for which, program in programs.items():
                say(f"hotpath: {work.name}, {which} ...")
                got = await profile_one(work, program, which, out, args.seconds, spy)
                got["program"] = (f"git {args.before}" if which == "before"
                                  else str(program.relative_to(ROOT)))
                results[work.name][which] = got
    load1 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cmd = " ".join(["python", "bench/hotpath.py", *sys.argv[1:]])
    text = summary_text(cmd, args.seconds, results, (load0, load1))
    out.write_text(text)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "load": [load0, load1],
                                               "results": results}, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", help="also profile agentenv.py as of this git revision")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per measure")
    parser.add_argument("--paths", default="hop,episode", help="hop and/or episode")
    parser.add_argument("--out", default=str(ROOT / "bench" / "profile.txt"),
                        help="the summary (default bench/profile.txt)")
    parser.add_argument("--json", help="also write every figure here")
    parser.add_argument("--no-py-spy", action="store_true", help="cProfile and /proc only")
    return run_to_the_end(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
