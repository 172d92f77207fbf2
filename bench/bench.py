"""bench.py: agentenv.py's benchmark, every number measured beside a baseline in the same run.

    python bench/bench.py [--parts hop,startup,memory] [--repeat N] [--calls N] [--sessions K]
                          [--json out.json]

Parts (each reports medians and p95 beside a baseline measured in this run, and their ratio; the
machine is shared and noisy, so absolute numbers alone mean little):

hop      one tool call, list_notes, made sequentially with one aiohttp client to three servers:
         ours    POST /list_notes with a Gym session cookie to `agentenv.py serve bundles/notes-v1
                 --sandbox local` (the server then makes the MCP call to its notebook env)
         direct  MCP tools/call list_notes straight to a notebook env process we start ourselves
         floor   a bare aiohttp JSON POST handler in its own process
         The three are measured in interleaved rounds (--repeat rounds of --calls calls each, the
         order rotated every round), so load on the machine hits them alike. Target: ours/direct
         p50 <= 2.2x.
startup  process start to GET /health answering 200, for `serve bundles/notes-v1` and `serve
         bundles/gridsim-v1` (local sandbox), beside the bare aiohttp server; --repeat runs each,
         interleaved.
memory   the serve process's VmRSS idle after start, then after seeding K (--sessions) Gym sessions
         and playing one list_notes call in each, and after closing them. The env processes are
         separate processes and are not in the serve process's RSS (their sum is shown apart).

Every process started is stopped (SIGINT, then SIGKILL), env processes of serve included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
AGENTENV = ROOT / "agentenv.py"
NOTES = ROOT / "bundles" / "notes-v1"
GRIDSIM = ROOT / "bundles" / "gridsim-v1"
COOKIE = "agentenv_session"
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}

FLOOR_SERVER = r'''
import os, sys
from aiohttp import web
async def handler(request):
    body = await request.json()
    return web.json_response({"ok": True, "echo": len(body)})
async def health(request):
    return web.json_response({"status": "healthy"})
app = web.Application()
app.router.add_post("/call", handler)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
'''


# ------------------------------------------------------------------ processes

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children_of(pid: int) -> set[int]:
    """Every live descendant of pid (by /proc/<pid>/stat's ppid)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Proc:
    """A subprocess we own; stop() ends it and every descendant it was seen to have."""

    live: list["Proc"] = []

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT):
        self.argv = argv
        self.log = tempfile.TemporaryFile()
        self.t0 = time.perf_counter()
        self.popen = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {})},
                                      stdin=subprocess.DEVNULL, stdout=self.log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.popen.pid
        self.seen: dict[int, str | None] = {}       # descendant pid -> its start time
        Proc.live.append(self)

    def track(self) -> set[int]:
        kids = children_of(self.pid)
        for kid in kids:
            self.seen.setdefault(kid, start_time(kid))
        return kids

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def stop(self, grace: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.track()
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with_kill(self.pid, pgroup=True)
                self.popen.wait(5)
        # Descendants that outlived their parent (each env runs in its own session).
        deadline = time.monotonic() + grace
        for kid, started in self.seen.items():
            while start_time(kid) == started and started is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            if start_time(kid) == started and started is not None:
                with_kill(kid, pgroup=False)
        if self in Proc.live:
            Proc.live.remove(self)
        self.log.close()


def with_kill(pid: int, pgroup: bool) -> None:
    try:
        if pgroup:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def wait_health(http: aiohttp.ClientSession, url: str, proc: Proc, timeout: float = 60.0,
                      path: str = "/health") -> float:
    """Seconds from the process's start to url+path answering 200."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{shlex.join(proc.argv)} exited {proc.popen.returncode}:\n"
                               f"{proc.output()}")
        try:
            async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                if resp.status == 200:
                    return time.perf_counter() - proc.t0
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        await asyncio.sleep(0.005)
    raise RuntimeError(f"{shlex.join(proc.argv)} did not answer {path} in {timeout}s:\n"
                       f"{proc.output()}")


async def wait_port(port: int, proc: Proc, timeout: float = 30.0) -> float:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{shlex.join(proc.argv)} exited:\n{proc.output()}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return time.perf_counter() - proc.t0
        except OSError:
            await asyncio.sleep(0.005)
    raise RuntimeError(f"{shlex.join(proc.argv)} did not listen on {port} in {timeout}s")


def serve(bundle: Path, port: int, *extra: str) -> Proc:
    return Proc([sys.executable, str(AGENTENV), "serve", str(bundle), "--sandbox", "local",
                 "--port", str(port), *extra])


def floor_server(port: int) -> Proc:
    return Proc([sys.executable, "-c", FLOOR_SERVER, str(port)])


# ------------------------------------------------------------------ stats

def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50": statistics.median(values), "p95": pct(values, 95),
            "min": min(values), "max": max(values)}


# ------------------------------------------------------------------ hop

def nodelay_bundle(tmp: Path) -> Path:
    """A copy of notes-v1 whose notebook sets TCP_NODELAY (http.server's disable_nagle_algorithm).

    The shipped notebook writes a reply's headers and body in two send()s; with Nagle on, the body
    waits for the client's delayed ACK of the headers (~40 ms on Linux), which swamps every other
    cost in a hop. The copy differs by that one line, so both variants are measured."""
    copy = tmp / "notes-v1"
    shutil.copytree(NOTES, copy)
    server = copy / "envs" / "notebook" / "server.py"
    text = server.read_text()
    assert "\ndef main():" in text
    server.write_text(text.replace("\ndef main():", "\nHandler.disable_nagle_algorithm = True  "
                                   "# bench: TCP_NODELAY\n\n\ndef main():", 1))
    return copy


def notes_row(bundle: Path = NOTES, index: int = 0) -> dict:
    """A Gym row for notes-v1's all[index], built by hand as write-gym writes it."""
    sys.path.insert(0, str(ROOT))
    import agentenv  # noqa: PLC0415
    task = agentenv.Bundle.load(str(bundle)).splits["all"][index]

    def tool(name: str, props: dict) -> dict:
        return {"type": "function", "name": name, "description": name, "strict": False,
                "parameters": {"type": "object", "properties": props,
                               "required": list(props), "additionalProperties": False}}
    s = {"type": "string"}
    tools = [tool("write_note", {"title": s, "text": s}), tool("read_note", {"title": s}),
             tool("list_notes", {}), tool("end_turn", {"response": s})]
    return {"responses_create_params": {
                "input": [{"role": "system", "content": "You keep a notebook."},
                          {"role": "user", "content": "How many eggs?"}],
                "tools": tools},
            "split": "all", "index": index, "task_id": task.id}


async def seed(http: aiohttp.ClientSession, url: str, row: dict) -> str:
    async with http.post(url + "/seed_session", json=row) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"seed_session answered {resp.status}: {body}")
        return resp.cookies[COOKIE].value


async def mcp_open(http: aiohttp.ClientSession, url: str) -> str:
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "bench", "version": "0"}}}
    async with http.post(url, json=init, headers=MCP_HEADERS) as resp:
        sid = resp.headers["Mcp-Session-Id"]
        await resp.read()
    async with http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                         headers={**MCP_HEADERS, "Mcp-Session-Id": sid}) as resp:
        await resp.read()
    return sid


async def hop(args) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-") as tmp:
        for variant in args.env.split(","):
            bundle = {"shipped": NOTES, "nodelay": None}[variant] or nodelay_bundle(Path(tmp))
            print(f"[bench] hop, {variant} notebook ...", file=sys.stderr, flush=True)
            out[variant] = await hop_one(args, bundle)
    return out


async def hop_one(args, bundle: Path) -> dict:
    procs: list[Proc] = []
    notebook = bundle / "envs" / "notebook" / "server.py"
    try:
        p_ours, p_env, p_floor = free_port(), free_port(), free_port()
        ours = serve(bundle, p_ours)
        env = Proc([sys.executable, str(notebook)],
                   env={"MCP_PORT": str(p_env), "MCP_HOST": "127.0.0.1",
                        "ENVIRONMENT_NAME": "notebook", "PYTHONUNBUFFERED": "1"},
                   cwd=notebook.parent)
        floor = floor_server(p_floor)
        procs = [ours, env, floor]
        conn = dict(limit=1, force_close=False)
        clients = {k: aiohttp.ClientSession(connector=aiohttp.TCPConnector(**conn))
                   for k in ("ours", "direct", "floor")}
        try:
            u_ours, u_env, u_floor = (f"http://127.0.0.1:{p}" for p in (p_ours, p_env, p_floor))
            async with aiohttp.ClientSession() as probe:
                await wait_health(probe, u_ours, ours)
                await wait_health(probe, u_floor, floor)
            await wait_port(p_env, env)

            # ours: a Gym session on notes-v1's all[0] (recall-recipe: one note preloaded)
            cookie = await seed(clients["ours"], u_ours, notes_row(bundle, 0))
            c_ours = clients["ours"]
            c_ours.cookie_jar.update_cookies({COOKIE: cookie})

            # direct: an MCP session on our own notebook, preloaded with the same note
            c_direct = clients["direct"]
            async with c_direct.post(u_env + "/agentenv/ext/preload",
                                     json={"notes": {"pancakes": "2 eggs, 1 cup milk, 1 cup flour"}}
                                     ) as resp:
                await resp.read()
            sid = await mcp_open(c_direct, u_env + "/mcp")
            direct_headers = {**MCP_HEADERS, "Mcp-Session-Id": sid}
            call_body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                         "params": {"name": "list_notes", "arguments": {}}}
            c_floor = clients["floor"]

            async def call_ours() -> str:
                async with c_ours.post(u_ours + "/list_notes", json={}) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise RuntimeError(f"/list_notes answered {resp.status}: {text}")
                    return text

            async def call_direct() -> str:
                async with c_direct.post(u_env + "/mcp", json=call_body,
                                         headers=direct_headers) as resp:
                    body = await resp.json()
                    return body["result"]["content"][0]["text"]

            async def call_floor() -> str:
                async with c_floor.post(u_floor + "/call", json={"name": "list_notes"}) as resp:
                    return json.dumps(await resp.json())

            calls = {"ours": call_ours, "direct": call_direct, "floor": call_floor}
            answers = {k: await f() for k, f in calls.items()}   # also waits for ours' deploy
            if answers["ours"] != "pancakes" or answers["direct"] != "pancakes":
                raise RuntimeError(f"unexpected list_notes answers: {answers}")
            for f in calls.values():                              # warm up
                for _ in range(min(50, args.calls)):
                    await f()

            times: dict[str, list[float]] = {k: [] for k in calls}
            round_p50: dict[str, list[float]] = {k: [] for k in calls}
            order = list(calls)
            for r in range(args.repeat):
                for name in order[r % 3:] + order[:r % 3]:       # rotate who goes first
                    f, got = calls[name], []
                    for _ in range(args.calls):
                        t = time.perf_counter()
                        await f()
                        got.append((time.perf_counter() - t) * 1e3)
                    times[name] += got
                    round_p50[name].append(statistics.median(got))
        finally:
            for c in clients.values():
                await c.close()
        stats = {k: summary(v) for k, v in times.items()}
        per_round = [o / d for o, d in zip(round_p50["ours"], round_p50["direct"])]
        return {"unit": "ms", "calls_per_round": args.calls, "rounds": args.repeat,
                "stats": stats,
                "ratio_ours_direct": {"p50": stats["ours"]["p50"] / stats["direct"]["p50"],
                                      "p95": stats["ours"]["p95"] / stats["direct"]["p95"],
                                      "per_round_p50": per_round},
                "ratio_direct_floor": {"p50": stats["direct"]["p50"] / stats["floor"]["p50"],
                                       "p95": stats["direct"]["p95"] / stats["floor"]["p95"]},
                "ratio_ours_floor": {"p50": stats["ours"]["p50"] / stats["floor"]["p50"],
                                     "p95": stats["ours"]["p95"] / stats["floor"]["p95"]},
                "target_ours_direct_p50": 2.2,
                "meets_target": stats["ours"]["p50"] / stats["direct"]["p50"] <= 2.2}
    finally:
        for p in procs:
            p.stop()


# ------------------------------------------------------------------ startup

async def startup(args) -> dict:
    targets = {"bare aiohttp": floor_server, "serve notes-v1": lambda p: serve(NOTES, p),
               "serve gridsim-v1": lambda p: serve(GRIDSIM, p)}
    times: dict[str, list[float]] = {k: [] for k in targets}
    names = list(targets)
    async with aiohttp.ClientSession() as http:
        for r in range(args.repeat):
            for name in names[r % 3:] + names[:r % 3]:
                port = free_port()
                proc = targets[name](port)
                try:
                    times[name].append(await wait_health(http, f"http://127.0.0.1:{port}", proc))
                finally:
                    proc.stop()
    stats = {k: summary([t * 1e3 for t in v]) for k, v in times.items()}
    base = stats["bare aiohttp"]["p50"]
    return {"unit": "ms", "runs": args.repeat, "stats": stats,
            "ratio_vs_bare_p50": {k: s["p50"] / base for k, s in stats.items()}}


# ------------------------------------------------------------------ memory

async def memory(args) -> dict:
    k = args.sessions
    port = free_port()
    proc = serve(NOTES, port, "--max-concurrent-envs", str(k))
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await wait_health(http, url, proc)
            await asyncio.sleep(1.0)
            idle = rss_kib(proc.pid)
            row = notes_row(NOTES, 0)
            cookies = [await seed(http, url, row) for _ in range(k)]
            sem = asyncio.Semaphore(8)

            async def play(cookie: str) -> str:
                async with sem:
                    async with aiohttp.ClientSession(cookies={COOKIE: cookie}) as one:
                        async with one.post(url + "/list_notes", json={}) as resp:
                            return await resp.text()
            t = time.perf_counter()
            answers = await asyncio.gather(*(play(c) for c in cookies))
            deploy_s = time.perf_counter() - t
            bad = [a for a in answers if a != "pancakes"]
            if bad:
                raise RuntimeError(f"{len(bad)} sessions answered unexpectedly, e.g. {bad[0]!r}")
            await asyncio.sleep(1.0)
            loaded = rss_kib(proc.pid)
            envs = proc.track()
            env_rss = sum(rss_kib(p) for p in envs if Path(f"/proc/{p}").exists())

            async def close(cookie: str) -> None:
                async with aiohttp.ClientSession(cookies={COOKIE: cookie}) as one:
                    async with one.post(url + "/close_session", json={}) as resp:
                        await resp.read()
            for c in cookies:
                await close(c)
            await asyncio.sleep(1.0)
            closed = rss_kib(proc.pid)
            envs_left = len(children_of(proc.pid))
    finally:
        proc.stop()
    return {"unit": "KiB", "sessions": k, "idle_rss": idle, "rss_with_sessions": loaded,
            "per_session_delta": (loaded - idle) / k, "rss_after_close": closed,
            "env_processes": len(envs), "env_processes_rss_sum": env_rss,
            "env_processes_left_after_close": envs_left,
            "first_calls_after_seeding_wall_s": deploy_s}


# ------------------------------------------------------------------ report

def markdown(cmd: str, meta: dict, results: dict) -> str:
    out = [f"Rerun: `{cmd}`", "",
           f"{meta['nproc']} cores, Python {meta['python']}, loadavg {meta['loadavg_before']} -> "
           f"{meta['loadavg_after']}, git {meta['git']}", ""]
    for variant, h in results.get("hop", {}).items():
        what = {"shipped": "the shipped notebook env",
                "nodelay": "the notebook env with TCP_NODELAY (a temp copy of notes-v1, one line "
                           "added)"}[variant]
        out += [f"### hop, {variant}: list_notes to {what}; sequential, {h['rounds']} interleaved "
                f"rounds x {h['calls_per_round']} calls (ms)", "",
                "| target | n | p50 | p95 | p50 / direct | p95 / direct | p50 / floor |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        d, f = h["stats"]["direct"], h["stats"]["floor"]
        label = {"ours": "ours: serve Gym POST /list_notes", "direct": "direct: env MCP tools/call",
                 "floor": "floor: bare aiohttp JSON POST"}
        for name in ("ours", "direct", "floor"):
            s = h["stats"][name]
            out.append(f"| {label[name]} | {s['n']} | {s['p50']:.3f} | {s['p95']:.3f} | "
                       f"{s['p50'] / d['p50']:.2f}x | {s['p95'] / d['p95']:.2f}x | "
                       f"{s['p50'] / f['p50']:.2f}x |")
        pr = h["ratio_ours_direct"]["per_round_p50"]
        out += ["", f"ours/direct p50 = {h['ratio_ours_direct']['p50']:.2f}x (target <= 2.2x: "
                f"{'met' if h['meets_target'] else 'NOT met'}); per-round p50 ratios "
                f"{min(pr):.2f}x..{max(pr):.2f}x", ""]
    if "startup" in results:
        st = results["startup"]
        out += [f"### startup: process start to /health 200, {st['runs']} runs each (ms)", "",
                "| target | p50 | p95 | min | max | p50 / bare |", "|---|---:|---:|---:|---:|---:|"]
        for name, s in st["stats"].items():
            out.append(f"| {name} | {s['p50']:.0f} | {s['p95']:.0f} | {s['min']:.0f} | "
                       f"{s['max']:.0f} | {st['ratio_vs_bare_p50'][name]:.2f}x |")
        out.append("")
    if "memory" in results:
        m = results["memory"]
        mib = lambda kib: f"{kib / 1024:.1f} MiB"  # noqa: E731
        out += [f"### memory: serve notes-v1 VmRSS, K={m['sessions']} Gym sessions", "",
                "| state | serve RSS | vs idle |", "|---|---:|---:|",
                f"| idle after start | {mib(m['idle_rss'])} | 1.00x |",
                f"| {m['sessions']} sessions, one list_notes each | {mib(m['rss_with_sessions'])} | "
                f"{m['rss_with_sessions'] / m['idle_rss']:.2f}x |",
                f"| after close_session on all | {mib(m['rss_after_close'])} | "
                f"{m['rss_after_close'] / m['idle_rss']:.2f}x |", "",
                f"per-session delta: {m['per_session_delta']:.0f} KiB; not counted above: "
                f"{m['env_processes']} env processes, {mib(m['env_processes_rss_sum'])} RSS summed "
                f"({m['env_processes_rss_sum'] / max(1, m['env_processes']) / 1024:.1f} MiB each); "
                f"{m['env_processes_left_after_close']} left after close; the first calls (after all seeds) "
                f"took {m['first_calls_after_seeding_wall_s']:.1f}s", ""]
    return "\n".join(out)


async def main_async(args) -> int:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"hop", "startup", "memory"}
    if unknown:
        sys.exit(f"unknown parts {sorted(unknown)}; the parts are hop, startup, memory")
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "agentenv.py"],
                           capture_output=True, text=True).stdout.strip()
    meta = {"nproc": os.cpu_count(), "python": platform.python_version(),
            "aiohttp": aiohttp.__version__, "git": git + ("+dirty" if dirty else ""),
            "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    cmd = shlex.join(["python", "bench/bench.py", *sys.argv[1:]])
    results: dict = {}
    t = time.perf_counter()
    for part in parts:
        print(f"[bench] {part} ...", file=sys.stderr, flush=True)
        results[part] = await {"hop": hop, "startup": startup, "memory": memory}[part](args)
    meta["loadavg_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta["wall_s"] = round(time.perf_counter() - t, 1)
    print(markdown(cmd, meta, results))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "meta": meta, "results": results},
                                              indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="hop,startup,memory")
    parser.add_argument("--repeat", type=int, default=5,
                        help="hop: interleaved rounds; startup: runs per target (default 5)")
    parser.add_argument("--calls", type=int, default=300, help="hop: calls per target per round")
    parser.add_argument("--sessions", type=int, default=50, help="memory: K Gym sessions")
    parser.add_argument("--env", default="nodelay,shipped",
                        help="hop: notebook variants, nodelay and/or shipped (default both)")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    try:
        return asyncio.run(main_async(args))
    finally:
        for proc in list(Proc.live):
            proc.stop(grace=10)


if __name__ == "__main__":
    sys.exit(main())
