"""bench.py: agentenv.py's benchmark, every number measured beside a baseline in the same run.

    python bench/bench.py [--parts hop,startup,memory,episodes,throughput,deploys,writegym]
                          [--repeat N] [--json out.json] [options of each part: --help]

It prints a Markdown table per part and, with --json, writes every figure (medians, p95s, the
raw rounds) to a file. Each part reports medians (and p95 where latencies are concerned) beside a
baseline measured in the same run, in interleaved rounds where the two can run at once, and their
ratio: the machine is shared and noisy, so absolute numbers alone mean little.

hop        one tool call, list_notes, made sequentially with one aiohttp client to three servers:
           ours    POST /list_notes with a Gym session cookie to `agentenv.py serve bundles/notes-v1
                   --sandbox local` (the server then makes the MCP call to its notebook env)
           direct  MCP tools/call list_notes straight to a notebook env process we start ourselves
           floor   a bare aiohttp JSON POST handler in its own process
           --repeat interleaved rounds of --calls calls each (the order rotated every round), for
           the shipped notebook and a copy with TCP_NODELAY (--env). Target: ours/direct p50 <= 2.2x.
startup    process start to GET /health answering 200, for `serve bundles/notes-v1` and `serve
           bundles/gridsim-v1` (local sandbox), beside the bare aiohttp server; --repeat runs each.
memory     serve's VmRSS idle, with K (--sessions) Gym sessions on notes-v1 each after one
           list_notes (the env processes are apart, their sum shown), and after closing them; then
           serve of bench/bundles/quiz-v1 (no env) idle and with --noenv-sessions (1,000) live Gym
           sessions. Targets: idle <= 60 MiB, <= 64 KiB a session (no env).
episodes   quiz-v1 (one task, no env: one prompt, an agent_prompt_response_verifier) played over
           OpenEnv's /ws: reset, then the end_turn step that scores it (reward 1.0 checked), by 1,
           8 and 64 concurrent clients (--clients; each its own /ws, episodes back to back on it):
           episodes/s (median of --repeat rounds) and episode / reset / end_turn latencies. Beside
           agentenv-framework 0.9.1364's OpenEnv server (build_app under uvicorn,
           bench/peers/framework_openenv.py, in the bench venv below) on the same bundle, at
           --their-clients (1,8) with few episodes (--their-episodes 5, at least one per client):
           its episode takes seconds. An episode that fails (an error observation) is counted
           and quoted, not timed. Target: ours >= 100x theirs in episodes/s.
throughput tool calls/s with K live Gym sessions (--throughput-sessions 32,256), every session
           calling back to back for --seconds windows in --repeat interleaved rounds: ours
           list_notes through serve notes-v1 --sandbox local (a notebook env per session) beside
           NeMo Gym 0.7's SimpleResourcesServer (bench/peers/gym_counter: a counter, no env, POST
           /add) run in the NeMo Gym venv (~/.cache/agentenv-tests/nemo-gym-0.7 or
           AGENTENV_GYM_VENV, built by bash .ci/gym-venv.sh) as Gym starts a resources server.
           Target: ours >= 2x theirs at both K.
deploys    needs Docker (bash .ci/docker-up.sh). serve notes-v1 --sandbox docker --max-concurrent-
           envs --pool (8): the deploy the user waits for, save-groceries' seed_session to its first
           list_notes answer (Gym) and /ws reset to its reply (OpenEnv), beside a bare `docker run
           -d` (CLI) of the same agentenv/notebook:<digest> image until it first answers HTTP, and
           the same through the Engine API (docker SDK containers.run); 2x--repeat interleaved
           rounds. Target: ours Gym / bare docker run <= 1.2x. Then k = 1,2,4,8,16,32
           (--deploy-levels) Gym episodes started at once through the pool (each seed, first call,
           close), beside k bare docker runs at once, plotted to --plot (bench/deploys.png, with
           matplotlib from the bench venv). Containers: ours carry agentenv.owner (any left by the
           serve process is counted and removed), the bare ones are named agentenv-bench-* and
           labelled agentenv-bench.run, and removed.
writegym   `python agentenv.py write-gym bundles/gridsim-v1 ROOT --sandbox local` (2,200 rows): the
           CLI's wall time, and beside it write_gym() run in-process with Bundle.load,
           Runtime.start/close and Runtime.first_turn_tools (its deploys, one per toolset) timed by
           wrappers: the deploys' share. --repeat runs of each, into fresh temp roots.
metrics    (not in the default --parts) what counting costs: two serves of notes-v1 side by side,
           this agentenv.py (metrics on, /metrics scraped every --scrape-every s meanwhile, far
           more often than Prometheus' default 15 s) and the one at git revision --before (before
           metrics), each with a Gym session per client: the hop (sequential list_notes, one
           session) and calls/s with --metrics-sessions sessions calling back to back, in
           --repeat interleaved rounds (the order swapped every round), and each server's own CPU
           per call over those windows (from /proc, so the least swayed by a loaded machine).
           Reports after/before.
verify     (not in the default --parts) needs Docker. A Gym /verify of an env-backed episode (save-groceries: one notebook env, a
           verifier that reads it), the reply timed from the request to its last byte, beside the
           same with local envs: serve notes-v1 --sandbox docker and --sandbox local, and the same
           two of agentenv.py at git revision --verify-before (the teardown then came before the
           reply), all four at once, each rollout seeded, write_note, then /verify, and the next
           one begun once the server has no live episode (/metrics), so each verify is timed
           alone, not beside the teardown of the one before; --repeat interleaved rounds of
           --verify-rollouts rollouts per server. The servers run --warm 0 (a warm pool's refill
           is a container start beside the next rollout), as one too old for the flag did; a
           fifth, this agentenv.py's Docker serve with its default warm pool, shows what that
           refill costs when rollouts come back to back. Each rollout's verifier time
           (agentenv_verifier_duration_seconds_sum, before and after) is its floor: what the
           reply adds beyond it is reported too. Target: Docker / local <= 1.2x (the reply as
           soon as the score is known, the container removed after it).
hot        (not in the default --parts) the hop and the episode beside their floors, for this
           agentenv.py (after) and the one at git revision --hot-before (before, default 5ae11ea),
           all up at once, in --repeat interleaved rounds of --hot-calls sequential calls each:
           one Gym session's list_notes through serve notes-v1 --sandbox local beside the same
           MCP tools/call straight to a notebook env of our own, and through a bare aiohttp proxy
           to that env (the least any aiohttp proxy of the hop does) and the same proxy with a
           client of a few lines on one kept-alive connection (lean proxy: aiohttp's server and
           the event loop alone); and one /ws playing quiz-v1's
           episode (reset, then the end_turn that scores it) beside the same two frames echoed
           by a bare aiohttp WebSocket server in a process of its own. Target: <= 2.0x each.
           Where the time goes on both paths: bench/hotpath.py (profiles, bench/profile.txt).

idle       (not in the default --parts) what an idle serve weighs: VmRSS of serve notes-v1 after
           start, and idle after --idle-episodes (200) OpenEnv episodes of save-groceries (reset,
           write_note, the end_turn scored 1.0; --idle-clients 8 at once, the pool the same) once
           every env is torn down and --idle-quiet s have passed (serve trims its heap 1 s after a
           drain), on each of --idle-sandboxes (local, docker); and serve gridsim-v1 (2,200 tasks)
           after start. This agentenv.py beside the one at git revision --idle-before, the two
           swapped every round (--repeat), and a bare aiohttp app (the floor) in each round.
           Target: idle after the episodes <= 40 MiB.

The bench venv (--parts episodes, deploys): ~/.cache/agentenv-bench/venv (or
AGENTENV_BENCH_VENV) with agentenv-framework[openenv]==0.9.1364, matplotlib and py-spy, created on
first use with the Python running this script and then only checked; it says what it does.

Every process started is stopped (SIGINT, then SIGKILL), env processes of serve included, and
every container started is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
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
from typing import Awaitable, Callable

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
AGENTENV = ROOT / "agentenv.py"
NOTES = ROOT / "bundles" / "notes-v1"
GRIDSIM = ROOT / "bundles" / "gridsim-v1"
QUIZ = ROOT / "bench" / "bundles" / "quiz-v1"
PEERS = ROOT / "bench" / "peers"
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

_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A free port on 127.0.0.1, never one this run handed out before (ports picked at once for
    containers published later must differ)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


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


def serve(bundle: Path, port: int, *extra: str, sandbox: str = "local") -> Proc:
    # A deploy here is measured cold, against docker run: no warm pool unless a part asks for one
    # (with Docker, serve keeps one by default).
    warm = () if "--warm" in extra else ("--warm", "0")
    return Proc([sys.executable, str(AGENTENV), "serve", str(bundle), "--sandbox", sandbox,
                 "--port", str(port), *warm, *extra])


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
            "first_calls_after_seeding_wall_s": deploy_s,
            "noenv": await memory_noenv(args) if args.noenv_sessions else None}


# ------------------------------------------------------------------ idle: what a server weighs

WRITE_GROCERIES = json.dumps({"type": "step", "data": {
    "type": "call_tool", "tool_name": "write_note",
    "arguments": {"title": "groceries", "text": "eggs and milk"}}})
SAVED = json.dumps({"type": "step", "data": {"type": "call_tool", "tool_name": "end_turn",
                                             "arguments": {"response": "Saved."}}})


async def notes_player(url: str, episodes: int) -> list[str]:
    """One OpenEnv client playing notes-v1's save-groceries `episodes` times on one /ws: reset
    (the env deployed), write_note, then the end_turn its verifier scores 1.0. What each failed
    episode answered."""
    failed = []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url + "/ws", max_msg_size=0) as ws:
            for _ in range(episodes):
                await ws.send_json({"type": "reset", "data": {"split": "all", "index": 1}})
                reset = json.loads((await ws.receive(timeout=300)).data)
                if reset.get("type") != "observation":
                    failed.append(f"reset answered {json.dumps(reset)[:300]}")
                    break                       # an error frame may close the socket
                for step in (WRITE_GROCERIES, SAVED):
                    await ws.send_str(step)
                    reply = json.loads((await ws.receive(timeout=300)).data)
                ended = reply.get("data") or {}
                if not (ended.get("done") is True and ended.get("reward") == 1.0):
                    failed.append(f"end_turn answered {json.dumps(reply)[:300]}")
            await ws.send_json({"type": "close"})
    return failed


async def idle_server(program: Path | None, sandbox: str, bundle: Path, episodes: int,
                      clients: int, quiet: float) -> dict:
    """One server's RSS `quiet` seconds after it answered /health and, once it played `episodes`
    episodes of notes-v1 (by `clients` at once) and stayed quiet `quiet` seconds after the last was
    torn down, its RSS then. ``program`` None is the floor: a bare aiohttp app answering twice as
    many JSON POSTs."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = floor_server(port) if program is None else Proc(
        [sys.executable, str(program), "serve", str(bundle), "--sandbox", sandbox, "--port",
         str(port), "--max-concurrent-envs", str(clients)])
    failed: list[str] = []
    try:
        async with client() as http:
            started = await wait_health(http, url, proc, timeout=600)
            await asyncio.sleep(quiet)
            at_start = rss_kib(proc.pid)
            if program is None:
                for _ in range(2 * episodes):
                    async with http.post(url + "/call", json={"episode": 1}) as resp:
                        await resp.read()
            elif episodes:
                per = [episodes // clients + (i < episodes % clients) for i in range(clients)]
                failed = [f for fs in await asyncio.gather(*(notes_player(url, n) for n in per if n))
                          for f in fs]
                await drained(http, url)
            await asyncio.sleep(quiet)
            after = rss_kib(proc.pid)
    finally:
        proc.stop(grace=60)
    if failed:
        raise RuntimeError(f"{len(failed)} of {episodes} episodes failed on {program} "
                           f"({sandbox}), e.g. {failed[0]}")
    return {"start_to_health_s": started, "rss_at_start": at_start, "rss_after": after}


async def idle(args) -> dict:
    """serve's RSS: of notes-v1 after start and idle after --idle-episodes episodes (each sandbox
    of --idle-sandboxes), and of gridsim-v1 (2,200 tasks) after start, for this agentenv.py beside
    the one at git revision --idle-before, in interleaved rounds; and a bare aiohttp server."""
    sandboxes = [s for s in args.idle_sandboxes.split(",") if s]
    if "docker" in sandboxes:
        try:
            docker("info", "--format", "{{.ServerVersion}}", timeout=20)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"idle on docker needs Docker ({exc}); start it with bash "
                               ".ci/docker-up.sh, or pass --idle-sandboxes local")
    n, clients, quiet = args.idle_episodes, args.idle_clients, args.idle_quiet
    runs_of = [(f"notes-v1, {sandbox}, {n} episodes", sandbox, NOTES, n) for sandbox in sandboxes]
    runs_of.append(("gridsim-v1, local, no episode", "local", GRIDSIM, 0))
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-idle-") as tmp:
        programs = {"ours": AGENTENV, "before": before_agentenv(args.idle_before, Path(tmp))}
        runs: dict[str, dict[str, list[dict]]] = {what: {name: [] for name in programs}
                                                  for what, *_ in runs_of}
        floor: list[dict] = []
        for r in range(args.repeat):
            floor.append(await idle_server(None, "", NOTES, n, clients, quiet))
            for what, sandbox, bundle, episodes in runs_of:
                for name in (list(programs) if r % 2 == 0 else list(programs)[::-1]):
                    say(f"idle: round {r + 1}, {name}: {what}")
                    runs[what][name].append(await idle_server(programs[name], sandbox, bundle,
                                                              episodes, clients, quiet))

    def medians(rounds: list[dict]) -> dict:
        return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    stats = {what: {name: medians(rounds) for name, rounds in by.items()}
             for what, by in runs.items()}
    notes = [what for what, _, bundle, _ in runs_of if bundle == NOTES]
    return {"unit": "KiB", "episodes": n, "clients": clients, "rounds": args.repeat,
            "quiet_s": quiet, "before": args.idle_before, "floor": medians(floor), "stats": stats,
            "raw": {"floor": floor, **runs}, "target_mib": 40,
            "meets_target": {what: stats[what]["ours"]["rss_after"] / 1024 <= 40 for what in notes}}


def markdown_idle(m: dict) -> list[str]:
    mib = lambda kib: f"{kib / 1024:.1f}"  # noqa: E731
    f = m["floor"]
    out = [f"### idle: serve's RSS (MiB) {m['quiet_s']:g} s after start, and idle {m['quiet_s']:g} s "
           f"after its episodes were torn down (OpenEnv /ws, notes-v1's save-groceries, "
           f"{m['clients']} at once); medians of {m['rounds']} interleaved rounds", "",
           "| serve of | at start: ours / before | after: ours / before | ours / before | ours - "
           "floor | start to /health s: ours / before |", "|---|---:|---:|---:|---:|---:|"]
    for what, by in m["stats"].items():
        o, b = by["ours"], by["before"]
        out.append(f"| {what} | {mib(o['rss_at_start'])} / {mib(b['rss_at_start'])} | "
                   f"{mib(o['rss_after'])} / {mib(b['rss_after'])} | "
                   f"{o['rss_after'] / b['rss_after']:.2f}x | +{mib(o['rss_after'] - f['rss_after'])} | "
                   f"{o['start_to_health_s']:.2f} / {b['start_to_health_s']:.2f} |")
    out += ["", f"before = agentenv.py at {m['before']}; floor = a bare aiohttp app in a process of "
            f"its own: {mib(f['rss_at_start'])} MiB at start, {mib(f['rss_after'])} after "
            f"{2 * m['episodes']} JSON POSTs. Target: idle after the episodes <= 40 MiB: " + ", ".join(
                f"{what} {'met' if ok else 'NOT met'}" for what, ok in m["meets_target"].items()), ""]
    return out


# ------------------------------------------------------------------ shared: venvs, rows, clients

BENCH_VENV = Path(os.environ.get("AGENTENV_BENCH_VENV")
                  or Path.home() / ".cache" / "agentenv-bench" / "venv")
BENCH_REQUIREMENTS = ["agentenv-framework[openenv]==0.9.1364", "matplotlib", "py-spy"]
GYM_VENV = Path(os.environ.get("AGENTENV_GYM_VENV")
                or Path.home() / ".cache" / "agentenv-tests" / "nemo-gym-0.7")


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def bench_venv() -> Path:
    """The benchmark's own venv: agentenv-framework 0.9.1364 (its OpenEnv server, for `episodes`),
    matplotlib (the `deploys` plot) and py-spy (bench/hotpath.py's, when none is on PATH). Created on first use with the Python
    running this script, then only checked (a marker file holds the requirements it was built
    for; changing BENCH_REQUIREMENTS installs again). Says what it does."""
    marker = BENCH_VENV / ".agentenv-bench-complete"
    want = "\n".join(BENCH_REQUIREMENTS)
    python = BENCH_VENV / "bin" / "python"
    if marker.is_file() and marker.read_text().split("\n--\n")[0] == want and python.exists():
        return BENCH_VENV
    base = getattr(sys, "_base_executable", sys.executable)
    if not python.exists():
        say(f"venv: creating {BENCH_VENV} with {base}")
        BENCH_VENV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([base, "-m", "venv", str(BENCH_VENV)], check=True)
    say(f"venv: pip install {' '.join(BENCH_REQUIREMENTS)} into {BENCH_VENV} (the first time "
        "takes a few minutes and ~700 MB)")
    t = time.perf_counter()
    subprocess.run([str(python), "-m", "pip", "install", "-qq", *BENCH_REQUIREMENTS], check=True)
    frozen = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True)
    marker.write_text(want + "\n--\n" + frozen.stdout)
    say(f"venv: ready in {time.perf_counter() - t:.0f}s")
    return BENCH_VENV


def gym_venv() -> Path:
    if not (GYM_VENV / ".agentenv-gym-complete").is_file():
        raise RuntimeError(f"NeMo Gym 0.7's venv is not built at {GYM_VENV}: run bash .ci/gym-venv.sh "
                           "(or set AGENTENV_GYM_VENV)")
    return GYM_VENV


def quiz_row() -> dict:
    """The Gym row of quiz-v1's one task (no env: its only tool is end_turn)."""
    sys.path.insert(0, str(ROOT))
    import agentenv  # noqa: PLC0415
    task = agentenv.Bundle.load(str(QUIZ)).splits["all"][0]
    end_turn = {"type": "function", "name": "end_turn", "description": "End your turn.",
                "strict": False, "parameters": {"type": "object", "properties": {
                    "response": {"type": "string"}}}}
    return {"responses_create_params": {"input": [{"role": "user", "content": "What is 6 * 7?"}],
                                        "tools": [end_turn]},
            "split": "all", "index": 0, "task_id": task.id}


def cookie_header(resp: aiohttp.ClientResponse) -> str:
    return "; ".join(f"{k}={m.value}" for k, m in resp.cookies.items())


async def seed_many(http: aiohttp.ClientSession, url: str, row: dict, k: int,
                    concurrency: int = 16) -> list[str]:
    """Seed k Gym sessions; returns each one's Cookie header (whatever cookies the server set)."""
    sem = asyncio.Semaphore(concurrency)

    async def one() -> str:
        async with sem:
            async with http.post(url + "/seed_session", json=row) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise RuntimeError(f"seed_session answered {resp.status}: {body[:500]}")
                return cookie_header(resp)
    return await asyncio.gather(*(one() for _ in range(k)))


async def post_each(http: aiohttp.ClientSession, url: str, path: str, cookies: list[str],
                    body: dict, concurrency: int = 16) -> list[str]:
    sem = asyncio.Semaphore(concurrency)

    async def one(cookie: str) -> str:
        async with sem:
            async with http.post(url + path, json=body, headers={"Cookie": cookie}) as resp:
                return await resp.text()
    return await asyncio.gather(*(one(c) for c in cookies))


def client(limit: int = 0) -> aiohttp.ClientSession:
    """One client for many sessions: cookies go by hand (a Cookie header per request)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 cookie_jar=aiohttp.DummyCookieJar(),
                                 timeout=aiohttp.ClientTimeout(total=600))


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


# ------------------------------------------------------------------ episodes

RESET = json.dumps({"type": "reset", "data": {"split": "all", "index": 0}})
ANSWER = json.dumps({"type": "step", "data": {"type": "call_tool", "tool_name": "end_turn",
                                               "arguments": {"response": "42"}}})


async def ws_player(url: str, episodes: int) -> tuple[list[tuple[float, float]], list[str]]:
    """One OpenEnv client: one /ws, `episodes` episodes of quiz-v1 on it, each a reset (which
    answers with the first turn's prompt) and the end_turn that scores it. Returns per episode
    scored 1.0 (reset seconds, end_turn seconds), and what each failed episode answered."""
    out, failed = [], []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url + "/ws", max_msg_size=0, autoping=True) as ws:
            for _ in range(episodes):
                t0 = time.perf_counter()
                await ws.send_str(RESET)
                reset = json.loads((await ws.receive(timeout=300)).data)
                t1 = time.perf_counter()
                obs = (reset.get("data") or {}).get("observation") or {}
                if reset.get("type") != "observation" or "prompt" not in (obs.get("metadata") or {}):
                    failed.append(f"reset answered {json.dumps(reset)[:300]}")
                    if reset.get("type") == "error":
                        break                   # an error frame may close the socket
                    continue
                await ws.send_str(ANSWER)
                ended = json.loads((await ws.receive(timeout=300)).data)
                t2 = time.perf_counter()
                data = ended.get("data") or {}
                if not (data.get("done") is True and data.get("reward") == 1.0):
                    failed.append(f"end_turn answered {json.dumps(ended)[:300]}")
                    continue
                out.append((t1 - t0, t2 - t1))
            await ws.send_str(json.dumps({"type": "close"}))
    return out, failed


async def play_episodes(url: str, clients: int, per_client: int) -> dict:
    t = time.perf_counter()
    runs = await asyncio.gather(*(ws_player(url, per_client) for _ in range(clients)))
    wall = time.perf_counter() - t
    done = [e for run, _ in runs for e in run]
    failed = [f for _, fails in runs for f in fails]
    return {"clients": clients, "episodes": len(done), "failed": len(failed),
            "failures": failed[:3], "wall_s": wall, "episodes_per_s": len(done) / wall,
            "reset_ms": [r * 1e3 for r, _ in done], "end_turn_ms": [e * 1e3 for _, e in done],
            "episode_ms": [(r + e) * 1e3 for r, e in done]}


def framework_server(port: int, limit: int, state: Path) -> Proc:
    """agentenv-framework 0.9.1364's build_app(quiz-v1) under uvicorn, in the bench venv, with its
    stores (XDG_STATE_HOME) and home in a scratch folder."""
    venv = bench_venv()
    (state / "home").mkdir(parents=True, exist_ok=True)
    return Proc([str(venv / "bin" / "python"), str(PEERS / "framework_openenv.py"), str(QUIZ),
                 str(port), str(limit)],
                env={"HOME": str(state / "home"), "XDG_STATE_HOME": str(state / "xdg"),
                     "AGENT_ENV_LOCAL_SANDBOX_DIR": str(state / "sandboxes"),
                     "PYTHONUNBUFFERED": "1"}, cwd=state)


async def episodes(args) -> dict:
    """quiz-v1 episodes over /ws: ours (serve) and agentenv-framework's build_app, side by side."""
    levels = [int(c) for c in args.clients.split(",")]
    theirs_at = {int(c) for c in args.their_clients.split(",") if c.strip()}
    limit = max(levels) + 8
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-fw-") as tmp:
        try:
            p_ours, p_theirs = free_port(), free_port()
            ours = serve(QUIZ, p_ours, "--max-concurrent-envs", str(limit))
            procs.append(ours)
            urls = {"ours": f"http://127.0.0.1:{p_ours}"}
            start_s = {}
            async with aiohttp.ClientSession() as probe:
                start_s["ours"] = await wait_health(probe, urls["ours"], ours)
                if theirs_at:
                    theirs = framework_server(p_theirs, limit, Path(tmp))
                    procs.append(theirs)
                    urls["theirs"] = f"http://127.0.0.1:{p_theirs}"
                    start_s["theirs"] = await wait_health(probe, urls["theirs"], theirs, timeout=180)
            await asyncio.sleep(1.0)
            rss_idle = {"ours": rss_kib(ours.pid)}
            if theirs_at:
                rss_idle["theirs"] = rss_kib(theirs.pid)
            say("episodes: warming up (ours 20 episodes, theirs 1)")
            await play_episodes(urls["ours"], 1, 20)
            if theirs_at:
                await play_episodes(urls["theirs"], 1, 1)
            runs: dict[str, dict[int, list[dict]]] = {"ours": {c: [] for c in levels},
                                                     "theirs": {c: [] for c in levels}}
            for r in range(args.repeat):
                for c in levels:
                    who = ["ours", "theirs"] if r % 2 == 0 else ["theirs", "ours"]
                    for name in who:
                        if name == "theirs" and c not in theirs_at:
                            continue
                        per_client = (max(1, args.episodes // c) if name == "ours"
                                      else max(1, -(-args.their_episodes // c)))
                        got = await play_episodes(urls[name], c, per_client)
                        say(f"episodes: round {r + 1}, {name}, {c} client(s): {got['episodes']} "
                            f"episodes, {got['episodes_per_s']:.1f}/s"
                            + (f"; {got['failed']} FAILED, e.g. {got['failures'][0]}"
                               if got["failed"] else ""))
                        runs[name][c].append(got)
            rss_after = {name: rss_kib(p.pid) for name, p in zip(("ours", "theirs"), procs)}
        finally:
            for p in procs:
                p.stop()

    def level(name: str, c: int) -> dict | None:
        got = runs[name][c]
        if not got:
            return None
        cat = lambda key: [x for g in got for x in g[key]] or [float("nan")]  # noqa: E731
        return {"rounds": len(got), "episodes_per_round": got[0]["episodes"] + got[0]["failed"],
                "failed": sum(g["failed"] for g in got),
                "failures": [f for g in got for f in g["failures"]][:3],
                "episodes_per_s": summary([g["episodes_per_s"] for g in got]),
                "episode_ms": summary(cat("episode_ms")), "reset_ms": summary(cat("reset_ms")),
                "end_turn_ms": summary(cat("end_turn_ms"))}
    out: dict = {"bundle": "bench/bundles/quiz-v1", "levels": {}, "start_to_health_s": start_s,
                 "rss_idle_kib": rss_idle, "rss_after_kib": rss_after, "target_ratio": 100}
    for c in levels:
        ours_c, theirs_c = level("ours", c), level("theirs", c)
        row = {"ours": ours_c, "theirs": theirs_c}
        if theirs_c:
            # all of theirs failing gives no ratio (None): infinitely better, but not measured
            row["ratio_eps"] = ratio(ours_c["episodes_per_s"]["p50"], theirs_c["episodes_per_s"]["p50"])
            row["ratio_episode_p50"] = theirs_c["episode_ms"]["p50"] / ours_c["episode_ms"]["p50"]
            row["meets_target"] = row["ratio_eps"] is None or row["ratio_eps"] >= 100
        out["levels"][str(c)] = row
    return out


# ------------------------------------------------------------------ throughput

def gym_counter_server(port: int) -> Proc:
    """bench/peers/gym_counter (a SimpleResourcesServer) started as Gym starts a resources server."""
    venv = gym_venv()
    folder = PEERS / "gym_counter"
    config = {"gym_counter": {"resources_servers": {"gym_counter": {
                  "entrypoint": "app.py", "domain": "other", "host": "127.0.0.1", "port": port}}},
              "head_server": {"host": "127.0.0.1", "port": free_port()}, "dry_run": False}
    return Proc([str(venv / "bin" / "python"), "app.py"], cwd=folder,
                env={"NEMO_GYM_CONFIG_DICT": json.dumps(config),
                     "NEMO_GYM_CONFIG_PATH": "gym_counter", "PYTHONPATH": str(folder),
                     "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"})


async def hammer(http: aiohttp.ClientSession, url: str, tool: str, body: dict,
                 cookies: list[str], seconds: float, expect: Callable[[str], bool]) -> dict:
    """Every session calls the tool back to back (one call in flight per session, as a rollout
    does) for `seconds`; returns calls/s over the window and each call's latency."""
    stop = time.perf_counter() + seconds
    bad: list[str] = []

    async def worker(cookie: str) -> list[float]:
        got = []
        headers = {"Cookie": cookie}
        while time.perf_counter() < stop:
            t = time.perf_counter()
            async with http.post(url + "/" + tool, json=body, headers=headers) as resp:
                text = await resp.text()
                if resp.status != 200 or not expect(text):
                    bad.append(f"{resp.status} {text[:200]}")
            got.append((time.perf_counter() - t) * 1e3)
        return got
    t0 = time.perf_counter()
    lat = [x for w in await asyncio.gather(*(worker(c) for c in cookies)) for x in w]
    wall = time.perf_counter() - t0
    if bad:
        raise RuntimeError(f"{len(bad)} {tool} calls answered unexpectedly, e.g. {bad[0]}")
    return {"calls": len(lat), "wall_s": wall, "calls_per_s": len(lat) / wall, "latency_ms": lat}


async def throughput(args) -> dict:
    """Gym tool calls/s with K live sessions: ours (list_notes through serve to a local notebook env
    per session) and NeMo Gym's SimpleResourcesServer (a counter, no env), side by side."""
    ks = [int(k) for k in args.throughput_sessions.split(",")]
    procs: list[Proc] = []
    out: dict = {"window_s": args.seconds, "levels": {}, "target_ratio": 2}
    try:
        p_ours, p_theirs = free_port(), free_port()
        ours = serve(NOTES, p_ours, "--max-concurrent-envs", str(max(ks) + 8))
        theirs = gym_counter_server(p_theirs)
        procs = [ours, theirs]
        u_ours, u_theirs = f"http://127.0.0.1:{p_ours}", f"http://127.0.0.1:{p_theirs}"
        async with aiohttp.ClientSession() as probe:
            await wait_health(probe, u_ours, ours)
            out["theirs_start_s"] = await wait_health(probe, u_theirs, theirs, timeout=120, path="/")
        row = notes_row(NOTES, 0)
        calls = {"ours": (u_ours, "list_notes", {}, lambda t: t == "pancakes"),
                 "theirs": (u_theirs, "add", {"amount": 1}, lambda t: t.startswith('{"total":'))}
        for k in ks:
            async with client() as http:
                say(f"throughput: seeding {k} sessions on each (ours deploys {k} notebook envs)")
                t = time.perf_counter()
                cookies = {"ours": await seed_many(http, u_ours, row, k),
                           "theirs": await seed_many(http, u_theirs, {"responses_create_params": {
                               "input": "count"}}, k)}
                first = await post_each(http, u_ours, "/list_notes", cookies["ours"], {})
                if any(a != "pancakes" for a in first):
                    raise RuntimeError(f"ours' first calls answered e.g. {first[0]!r}")
                deploy_s = time.perf_counter() - t
                for name, (url, tool, body, ok) in calls.items():     # warm up
                    await hammer(http, url, tool, body, cookies[name], min(1.0, args.seconds), ok)
                got: dict[str, list[dict]] = {"ours": [], "theirs": []}
                for r in range(args.repeat):
                    for name in (["ours", "theirs"] if r % 2 == 0 else ["theirs", "ours"]):
                        url, tool, body, ok = calls[name]
                        got[name].append(await hammer(http, url, tool, body, cookies[name],
                                                      args.seconds, ok))
                    say(f"throughput: {k} sessions, round {r + 1}: ours "
                        f"{got['ours'][-1]['calls_per_s']:.0f}/s, theirs "
                        f"{got['theirs'][-1]['calls_per_s']:.0f}/s")
                rss = {"ours": rss_kib(ours.pid), "theirs": rss_kib(theirs.pid)}
                await post_each(http, u_ours, "/close_session", cookies["ours"], {})
                await post_each(http, u_theirs, "/verify", cookies["theirs"], {
                    "responses_create_params": {"input": "count"},
                    "response": {"id": "r", "created_at": 0, "model": "m", "object": "response",
                                 "output": [], "parallel_tool_calls": True, "tool_choice": "auto",
                                 "tools": []}})
            level = {name: {"calls_per_s": summary([g["calls_per_s"] for g in runs]),
                            "latency_ms": summary([x for g in runs for x in g["latency_ms"]]),
                            "calls_per_round": [g["calls"] for g in runs], "rss_kib": rss[name]}
                     for name, runs in got.items()}
            level["ours_seed_and_deploy_s"] = deploy_s
            level["ratio"] = (level["ours"]["calls_per_s"]["p50"]
                              / level["theirs"]["calls_per_s"]["p50"])
            level["meets_target"] = level["ratio"] >= 2
            out["levels"][str(k)] = level
            await asyncio.sleep(1.0)
    finally:
        for p in procs:
            p.stop()
    return out


# ------------------------------------------------------------------ metrics: before and after

def before_agentenv(rev: str, tmp: Path) -> Path:
    """agentenv.py as of git revision ``rev``, in a folder of its own."""
    done = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:agentenv.py"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git show {rev}:agentenv.py failed: {done.stderr.strip()}")
    path = tmp / "before" / "agentenv.py"
    path.parent.mkdir(parents=True)
    path.write_text(done.stdout)
    return path


async def metrics_cost(args) -> dict:
    """The hop and throughput of serve with metrics (scraped meanwhile) beside serve before them."""
    procs: list[Proc] = []
    k = args.metrics_sessions
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-") as tmp:
        try:
            ports = {"after": free_port(), "before": free_port()}
            programs = {"after": AGENTENV, "before": before_agentenv(args.before, Path(tmp))}
            servers = {name: Proc([sys.executable, str(programs[name]), "serve", str(NOTES),
                                   "--sandbox", "local", "--port", str(port),
                                   "--max-concurrent-envs", str(k + 8)])
                       for name, port in ports.items()}
            procs = list(servers.values())
            urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
            async with aiohttp.ClientSession() as probe:
                for name in servers:
                    await wait_health(probe, urls[name], servers[name])
            row, pancakes = notes_row(NOTES, 0), (lambda t: t == "pancakes")
            scrapes: list[float] = []
            stop_scraping = asyncio.Event()

            async def scraper(http: aiohttp.ClientSession) -> None:
                while not stop_scraping.is_set():
                    t = time.perf_counter()
                    async with http.get(urls["after"] + "/metrics") as resp:
                        if resp.status != 200:
                            raise RuntimeError(f"/metrics answered {resp.status}")
                        await resp.read()
                    scrapes.append((time.perf_counter() - t) * 1e3)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop_scraping.wait(), args.scrape_every)

            async with client() as http:
                say(f"metrics: seeding 1 + {k} sessions on each serve")
                cookies = {name: await seed_many(http, urls[name], row, k + 1) for name in urls}
                for name in urls:
                    first = await post_each(http, urls[name], "/list_notes", cookies[name], {})
                    if any(a != "pancakes" for a in first):
                        raise RuntimeError(f"{name}'s first calls answered e.g. {first[0]!r}")
                scraping = asyncio.create_task(scraper(http))
                hop: dict[str, list[float]] = {"after": [], "before": []}
                rate: dict[str, list[float]] = {"after": [], "before": []}
                cpu = {name: {"ticks": 0, "calls": 0} for name in urls}
                for r in range(args.repeat):
                    for name in (["after", "before"] if r % 2 == 0 else ["before", "after"]):
                        one = await hammer(http, urls[name], "list_notes", {}, cookies[name][:1],
                                           args.seconds, pancakes)
                        hop[name] += one["latency_ms"]
                        ticks = sum(cpu_ticks(servers[name].pid))
                        many = await hammer(http, urls[name], "list_notes", {}, cookies[name][1:],
                                            args.seconds, pancakes)
                        cpu[name]["ticks"] += sum(cpu_ticks(servers[name].pid)) - ticks
                        cpu[name]["calls"] += many["calls"]
                        rate[name].append(many["calls_per_s"])
                    say(f"metrics: round {r + 1}: hop p50 after {statistics.median(hop['after']):.3f}"
                        f" / before {statistics.median(hop['before']):.3f} ms; {k} sessions: after "
                        f"{rate['after'][-1]:.0f}/s, before {rate['before'][-1]:.0f}/s")
                stop_scraping.set()
                await scraping
                for name in urls:
                    await post_each(http, urls[name], "/close_session", cookies[name], {})
        finally:
            for proc in procs:
                proc.stop()
    hz = os.sysconf("SC_CLK_TCK")
    stats = {name: {"hop_ms": summary(hop[name]), "calls_per_s": summary(rate[name]),
                    "cpu_us_per_call": cpu[name]["ticks"] / hz / max(cpu[name]["calls"], 1) * 1e6}
             for name in hop}
    return {"before": args.before, "sessions": k, "window_s": args.seconds, "rounds": args.repeat,
            "scrape_every_s": args.scrape_every, "scrape_ms": summary(scrapes), "stats": stats,
            "ratio_after_before": {
                "hop_p50": stats["after"]["hop_ms"]["p50"] / stats["before"]["hop_ms"]["p50"],
                "hop_p95": stats["after"]["hop_ms"]["p95"] / stats["before"]["hop_ms"]["p95"],
                "calls_per_s_p50": (stats["after"]["calls_per_s"]["p50"]
                                    / stats["before"]["calls_per_s"]["p50"]),
                "cpu_per_call": (stats["after"]["cpu_us_per_call"]
                                 / stats["before"]["cpu_us_per_call"])}}


def markdown_metrics(m: dict) -> list[str]:
    a, b, r = m["stats"]["after"], m["stats"]["before"], m["ratio_after_before"]
    return [f"### metrics: serve with metrics (scraped every {m['scrape_every_s']:g} s) beside serve "
            f"at {m['before']}, {m['rounds']} interleaved rounds of {m['window_s']:g} s windows", "",
            "| measure | with metrics | before | after / before |", "|---|---:|---:|---:|",
            f"| hop p50 / p95 (ms, one session) | {a['hop_ms']['p50']:.3f} / {a['hop_ms']['p95']:.3f} "
            f"| {b['hop_ms']['p50']:.3f} / {b['hop_ms']['p95']:.3f} | {r['hop_p50']:.2f}x / "
            f"{r['hop_p95']:.2f}x |",
            f"| calls/s, {m['sessions']} sessions (median of rounds) | "
            f"{a['calls_per_s']['p50']:.0f} | {b['calls_per_s']['p50']:.0f} | "
            f"{r['calls_per_s_p50']:.2f}x |",
            f"| server CPU per call (us, {m['sessions']} sessions) | {a['cpu_us_per_call']:.0f} | "
            f"{b['cpu_us_per_call']:.0f} | {r['cpu_per_call']:.2f}x |", "",
            f"A scrape of /metrics took p50 {m['scrape_ms']['p50']:.2f} ms, p95 "
            f"{m['scrape_ms']['p95']:.2f} ms ({m['scrape_ms']['n']} scrapes).", ""]


# ------------------------------------------------------------------ memory, no env

async def memory_noenv(args) -> dict:
    """serve quiz-v1 (no env): VmRSS idle, with N live Gym sessions (each an episode at its first
    turn), and after closing them."""
    n = args.noenv_sessions
    port = free_port()
    proc = serve(QUIZ, port, "--max-concurrent-envs", str(n + 8))
    url = f"http://127.0.0.1:{port}"
    try:
        async with client() as http:
            await wait_health(http, url, proc)
            await asyncio.sleep(1.0)
            idle = rss_kib(proc.pid)
            t = time.perf_counter()
            cookies = await seed_many(http, url, quiz_row(), n)
            seed_s = time.perf_counter() - t
            await asyncio.sleep(1.0)
            loaded = rss_kib(proc.pid)
            # one session scored, to show they are live episodes at their first turn
            async with http.post(url + "/end_turn", json={"response": "42"},
                                 headers={"Cookie": cookies[0]}) as resp:
                ended = await resp.text()
            await post_each(http, url, "/close_session", cookies, {})
            await asyncio.sleep(1.0)
            closed = rss_kib(proc.pid)
    finally:
        proc.stop()
    return {"unit": "KiB", "bundle": "bench/bundles/quiz-v1", "sessions": n, "idle_rss": idle,
            "rss_with_sessions": loaded, "per_session_kib": (loaded - idle) / n,
            "rss_after_close": closed, "seed_s": seed_s, "first_session_end_turn": ended[:200],
            "targets": {"idle_mib": 60, "per_session_kib": 64},
            "meets_target": idle / 1024 <= 60 and (loaded - idle) / n <= 64}


# ------------------------------------------------------------------ deploys

def docker(*argv: str, timeout: float = 120) -> str:
    done = subprocess.run(["docker", *argv], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(argv)} failed: {done.stderr.strip()[:500]}")
    return done.stdout


async def until_http(url: str, timeout: float = 60) -> None:
    """Until anything at url answers HTTP (any status)."""
    deadline = time.perf_counter() + timeout
    async with aiohttp.ClientSession() as http:
        while time.perf_counter() < deadline:
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    await resp.read()
                    return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                await asyncio.sleep(0.005)
    raise RuntimeError(f"{url} did not answer in {timeout}s")


PLOT = r'''
import json, statistics, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
data = json.load(open(sys.argv[1]))
levels = sorted(int(k) for k in data["levels"])
fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
for k in levels:
    ys = data["levels"][str(k)]
    ax.scatter([k] * len(ys), ys, s=10, color="tab:blue", alpha=0.35, zorder=2)
def q(ys, p):
    ys = sorted(ys)
    if p == 50:
        return statistics.median(ys)
    return ys[max(0, min(len(ys) - 1, round(p / 100 * len(ys) + 0.5) - 1))]
for p, style in ((50, "o-"), (95, "s--"), (100, "^:")):
    ax.plot(levels, [q(data["levels"][str(k)], p) for k in levels], style,
            label={50: "ours: median", 95: "ours: p95", 100: "ours: max"}[p], zorder=3)
ax.plot(levels, [q(data["bare_levels"][str(k)], 50) for k in levels], "x-", color="grey",
        label="k bare docker runs at once, no pool: median", zorder=3)
ax.axhline(data["bare_p50_s"], color="grey", lw=1, ls="-.",
           label=f"one bare docker run to HTTP (median {data['bare_p50_s']:.2f}s)")
ax.set_xscale("log", base=2)
ax.set_xticks(levels); ax.set_xticklabels([str(k) for k in levels])
ax.set_xlabel("episodes started at once, k (ours: Gym seed_session, pool of %d)" % data["pool"])
ax.set_ylabel("seed to first tool answer (s)")
ax.set_title("agentenv.py serve --sandbox docker, notes-v1: deploy latency")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.text(0.01, 0.01, data["note"], fontsize=6, color="grey")
fig.tight_layout(rect=(0, 0.03, 1, 1))
fig.savefig(sys.argv[2])
'''


async def deploys(args) -> dict:
    """Docker deploys: ours (seed to the first turn's first tool answer, and OpenEnv reset) beside
    a bare `docker run` of the same image until it answers HTTP; then the pool at --pool with
    1..32 episodes started at once, plotted."""
    try:
        docker("info", "--format", "{{.ServerVersion}}", timeout=20)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"deploys needs Docker ({exc}); start it with bash .ci/docker-up.sh")
    run_id = f"{os.getpid()}-{int(time.time())}"
    port = free_port()
    ours = serve(NOTES, port, "--max-concurrent-envs", str(args.pool), sandbox="docker")
    url = f"http://127.0.0.1:{port}"
    bare_names: list[str] = []
    out: dict = {"pool": args.pool, "target_ratio": 1.2}
    try:
        async with aiohttp.ClientSession() as probe:
            out["serve_start_s"] = await wait_health(probe, url, ours, timeout=900)
        sys.path.insert(0, str(ROOT))
        import agentenv  # noqa: PLC0415
        env = agentenv.Bundle.load(str(NOTES)).envs["notebook"]
        image = f"agentenv/notebook:{env.digest}"
        out["image"] = image
        row = notes_row(NOTES, 1)         # save-groceries: deploy_env, deploy_agent, one turn

        async def ours_gym(http: aiohttp.ClientSession) -> float:
            t = time.perf_counter()
            async with http.post(url + "/seed_session", json=row) as resp:
                cookie = cookie_header(resp)
                await resp.read()
            async with http.post(url + "/list_notes", json={}, headers={"Cookie": cookie}) as resp:
                text = await resp.text()
            took = time.perf_counter() - t
            async with http.post(url + "/close_session", json={},
                                 headers={"Cookie": cookie}) as resp:
                await resp.read()
            if text != "(no notes)":
                raise RuntimeError(f"list_notes after a docker deploy answered {text!r}")
            return took

        async def ours_openenv(http: aiohttp.ClientSession) -> float:
            async with http.ws_connect(url + "/ws") as ws:
                t = time.perf_counter()
                await ws.send_json({"type": "reset", "data": {"split": "all", "index": 1}})
                reset = json.loads((await ws.receive(timeout=300)).data)
                took = time.perf_counter() - t
                await ws.send_json({"type": "close"})
            if "prompt" not in (reset["data"]["observation"].get("metadata") or {}):
                raise RuntimeError(f"reset answered {json.dumps(reset)[:500]}")
            return took

        async def bare(http: aiohttp.ClientSession) -> float:
            for attempt in range(3):           # a port another process took meanwhile: again
                name = f"agentenv-bench-{run_id}-{len(bare_names)}"
                bare_names.append(name)
                host_port = free_port()
                t = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(
                    "docker", "run", "-d", "--name", name, "--label",
                    f"agentenv-bench.run={run_id}", "-p", f"127.0.0.1:{host_port}:18765",
                    "-e", "ENVIRONMENT_NAME=notebook", "-e", "MCP_HOST=0.0.0.0",
                    "--security-opt", "no-new-privileges", image,
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
                _, err = await proc.communicate()
                if proc.returncode == 0:
                    break
                await asyncio.to_thread(subprocess.run, ["docker", "rm", "-f", name],
                                        capture_output=True)
                if "already allocated" not in err.decode() or attempt == 2:
                    raise RuntimeError(f"docker run failed: {err.decode()[:500]}")
            await until_http(f"http://127.0.0.1:{host_port}/.well-known/agent-env.json")
            took = time.perf_counter() - t
            await asyncio.to_thread(docker, "rm", "-f", name)
            return took

        import docker as docker_sdk  # noqa: PLC0415 - agentenv.py's own dependency
        api = docker_sdk.from_env(timeout=120)

        async def bare_api(http: aiohttp.ClientSession) -> float:
            """The same container through the Engine API (the docker SDK, as serve drives it)."""
            name = f"agentenv-bench-{run_id}-{len(bare_names)}"
            bare_names.append(name)
            host_port = free_port()
            t = time.perf_counter()
            await asyncio.to_thread(
                api.containers.run, image, detach=True, name=name,
                labels={"agentenv-bench.run": run_id}, ports={"18765/tcp": ("127.0.0.1", host_port)},
                environment={"ENVIRONMENT_NAME": "notebook", "MCP_HOST": "0.0.0.0"},
                security_opt=["no-new-privileges"])
            await until_http(f"http://127.0.0.1:{host_port}/.well-known/agent-env.json")
            took = time.perf_counter() - t
            await asyncio.to_thread(docker, "rm", "-f", name)
            return took

        one = {"ours_gym": ours_gym, "ours_openenv": ours_openenv, "bare": bare,
               "bare_api": bare_api}
        times: dict[str, list[float]] = {k: [] for k in one}
        async with client() as http:
            for f in one.values():                   # warm up (page cache, the daemon)
                await f(http)
            order = list(one)
            for r in range(args.repeat * 2):
                for name in order[r % len(order):] + order[:r % len(order)]:
                    times[name].append(await one[name](http))
            say("deploys: single deploys done " + ", ".join(
                f"{k} {statistics.median(v):.2f}s" for k, v in times.items()))
            single = {k: summary([x * 1e3 for x in v]) for k, v in times.items()}
            out["single_ms"] = single
            out["ratio_gym_vs_bare"] = single["ours_gym"]["p50"] / single["bare"]["p50"]
            out["ratio_openenv_vs_bare"] = single["ours_openenv"]["p50"] / single["bare"]["p50"]
            out["ratio_gym_vs_bare_api"] = single["ours_gym"]["p50"] / single["bare_api"]["p50"]
            out["ratio_openenv_vs_bare_api"] = (single["ours_openenv"]["p50"]
                                                / single["bare_api"]["p50"])
            out["meets_target"] = out["ratio_gym_vs_bare"] <= 1.2
            out["meets_target_vs_api"] = out["ratio_gym_vs_bare_api"] <= 1.2

            levels: dict[str, list[float]] = {}
            bare_levels: dict[str, list[float]] = {}
            for k in [int(x) for x in args.deploy_levels.split(",")]:
                levels[str(k)], bare_levels[str(k)] = [], []
                for r in range(args.repeat):
                    for who in (("ours", "bare") if r % 2 == 0 else ("bare", "ours")):
                        if who == "ours":
                            levels[str(k)] += await asyncio.gather(*(ours_gym(http)
                                                                     for _ in range(k)))
                        else:
                            bare_levels[str(k)] += await asyncio.gather(*(bare(http)
                                                                          for _ in range(k)))
                        await asyncio.sleep(0.5)
                say(f"deploys: {k} at once, pool {args.pool}: median "
                    f"{statistics.median(levels[str(k)]):.2f}s, max {max(levels[str(k)]):.2f}s; "
                    f"{k} bare docker runs at once: median "
                    f"{statistics.median(bare_levels[str(k)]):.2f}s")
            out["pool_levels_ms"] = {k: summary([x * 1e3 for x in v]) for k, v in levels.items()}
            out["bare_levels_ms"] = {k: summary([x * 1e3 for x in v])
                                     for k, v in bare_levels.items()}
        plot = {"levels": levels, "bare_levels": bare_levels, "pool": args.pool,
                "bare_p50_s": single["bare"]["p50"] / 1e3,
                "note": f"each point: one Gym session, seed_session to its first list_notes answer; "
                        f"{args.repeat} round(s) per level; {os.cpu_count()} cores; "
                        f"{time.strftime('%Y-%m-%d %H:%M')}"}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(plot, f)
        try:
            subprocess.run([str(bench_venv() / "bin" / "python"), "-c", PLOT, f.name, args.plot],
                           check=True, timeout=120)
            out["plot"] = args.plot
        finally:
            os.unlink(f.name)
    finally:
        ours.stop(grace=60)
        for name in bare_names:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentenv-bench.run={run_id}"],
                              capture_output=True, text=True).stdout.split()
        if left:
            subprocess.run(["docker", "rm", "-f", *left], capture_output=True)
        # ours: containers whose owner label names the serve process (host:pid:start)
        listed = subprocess.run(["docker", "ps", "-a", "--filter", "label=agentenv.owner", "--format",
                                 '{{.ID}} {{.Label "agentenv.owner"}}'],
                                capture_output=True, text=True).stdout.splitlines()
        mine = [line.split()[0] for line in listed
                if len(line.split()) == 2 and line.split()[1].split(":")[1:2] == [str(ours.pid)]]
        if mine:
            say(f"deploys: serve left {len(mine)} container(s) behind; removing them")
            subprocess.run(["docker", "rm", "-f", *mine], capture_output=True)
        out["containers_left_by_serve"] = len(mine)
    return out


# ------------------------------------------------------------------ verify: the reply before the teardown

async def verify_latency(args) -> dict:
    """/verify of a Docker-backed rollout beside a local one, for this agentenv.py (after) and the
    one at --verify-before (before), four serves at once, interleaved rounds."""
    try:
        docker("info", "--format", "{{.ServerVersion}}", timeout=20)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"verify needs Docker ({exc}); start it with bash .ci/docker-up.sh")
    row = notes_row(NOTES, 1)                 # save-groceries: deploy_env, one turn, a verifier
    names = [(version, sandbox) for version in ("after", "before") for sandbox in ("docker", "local")]
    names.append(("after", "docker-warm"))
    times: dict[tuple[str, str], list[float]] = {name: [] for name in names}
    verifier: dict[tuple[str, str], list[float]] = {name: [] for name in names}
    procs: dict[tuple[str, str], Proc] = {}
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-") as tmp:
        programs = {"after": AGENTENV, "before": before_agentenv(args.verify_before, Path(tmp))}
        urls = {}
        try:
            # no warm pool (its refill is a container start beside the next rollout), where a
            # version has one to turn off
            knows_warm = {v: "--warm" in program.read_text() for v, program in programs.items()}
            for version, sandbox in names:
                port = free_port()
                warm = ["--warm", "0"] if sandbox != "docker-warm" and knows_warm[version] else []
                procs[version, sandbox] = Proc([sys.executable, str(programs[version]), "serve",
                                                str(NOTES), "--sandbox", sandbox.split("-")[0],
                                                "--port", str(port), "--max-concurrent-envs", "4",
                                                *warm])
                urls[version, sandbox] = f"http://127.0.0.1:{port}"
            async with client() as http:
                for name in names:
                    await wait_health(http, urls[name], procs[name], timeout=900)

                async def rollout(url: str) -> tuple[float, float]:
                    ran = await verifier_sum(http, url)
                    cookie = {"Cookie": f"{COOKIE}={await seed(http, url, row)}"}
                    async with http.post(url + "/write_note", headers=cookie,
                                         json={"title": "groceries", "text": "eggs and milk"}) as resp:
                        if (said := await resp.text()) != "saved note 'groceries'":
                            raise RuntimeError(f"write_note answered {said!r}")
                    body = {**row, "response": {
                        "id": "resp_bench", "object": "response", "created_at": 0, "model": "bench",
                        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                        "output": [{"type": "message", "role": "assistant", "content": [
                            {"type": "output_text", "text": "Saved."}]}]}}
                    t = time.perf_counter()
                    async with http.post(url + "/verify", headers=cookie, json=body) as resp:
                        verdict = await resp.json()
                    took = time.perf_counter() - t
                    if verdict.get("reward") != 1.0 or verdict.get("mask_sample"):
                        raise RuntimeError(f"/verify answered {json.dumps(verdict)[:500]}")
                    await drained(http, url)
                    return took, await verifier_sum(http, url) - ran

                for name in names:                   # warm up: page cache, the daemon, the env
                    await rollout(urls[name])
                for r in range(args.repeat):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        for _ in range(args.verify_rollouts):
                            took, ran = await rollout(urls[name])
                            times[name].append(took)
                            verifier[name].append(ran)
                    say("verify: round %d: p50 ms %s" % (r + 1, ", ".join(
                        f"{v} {s} {statistics.median(times[v, s]) * 1e3:.0f}" for v, s in names)))
        finally:
            for proc in procs.values():
                proc.stop(grace=60)
    ms = {f"{v}_{s}": summary([t * 1e3 for t in times[v, s]]) for v, s in names}
    verifier_ms = {f"{v}_{s}": summary([t * 1e3 for t in verifier[v, s]]) for v, s in names}
    beyond_ms = {f"{v}_{s}": summary([(t - u) * 1e3 for t, u in zip(times[v, s], verifier[v, s])])
                 for v, s in names}
    ratio = {v: ms[f"{v}_docker"]["p50"] / ms[f"{v}_local"]["p50"] for v in ("after", "before")}
    beyond = {v: beyond_ms[f"{v}_docker"]["p50"] / beyond_ms[f"{v}_local"]["p50"]
              for v in ("after", "before")}
    return {"before": args.verify_before, "rollouts_per_round": args.verify_rollouts,
            "rounds": args.repeat, "ms": ms, "verifier_ms": verifier_ms, "beyond_ms": beyond_ms,
            "ratio_docker_local": ratio, "ratio_beyond_verifier": beyond,
            "warm_docker_local": ms["after_docker-warm"]["p50"] / ms["after_local"]["p50"],
            "meets_target": ratio["after"] <= 1.2}


async def verifier_sum(http: aiohttp.ClientSession, url: str) -> float:
    """The seconds the server's verifiers have run in all (its /metrics)."""
    async with http.get(url + "/metrics") as resp:
        page = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("agentenv_verifier_duration_seconds_sum"))


async def drained(http: aiohttp.ClientSession, url: str, timeout: float = 120) -> None:
    """Wait until the server's /metrics says no episode is live (its last one torn down), so the
    next rollout's verify is timed alone, not beside the teardown of the one before."""
    deadline = time.monotonic() + timeout
    while True:
        async with http.get(url + "/metrics") as resp:
            page = await resp.text()
        if "\nagentenv_episodes_live 0.0\n" in page:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} still has live episodes {timeout:g}s after its last verify")
        await asyncio.sleep(0.02)


def markdown_verify(v: dict) -> list[str]:
    ms, r, b = v["ms"], v["ratio_docker_local"], v.get("ratio_beyond_verifier")
    cell = lambda name: f"{ms[name]['p50']:.1f} / {ms[name]['p95']:.1f} ({ms[name]['n']})"  # noqa: E731
    part = lambda which, name: (f"{v[which][name]['p50']:.1f}"              # noqa: E731
                                if which in v and name in v[which] else "-")
    rows = [("local", "after_local", "before_local"), ("docker", "after_docker", "before_docker"),
            ("docker, default warm pool", "after_docker-warm", None)]
    out = [f"### verify: Gym /verify of save-groceries (one env, its verifier), Docker envs beside "
           f"local, this agentenv.py and the one at {v['before']}; {v['rounds']} interleaved "
           f"rounds of {v['rollouts_per_round']} rollouts per server", "",
           "| envs | after: p50 / p95 ms (n) | its verifier p50 ms | the rest p50 ms "
           "| before: p50 / p95 ms (n) |", "|---|---:|---:|---:|---:|"]
    for label, after, before in rows:
        if after in ms:
            out.append(f"| {label} | {cell(after)} | {part('verifier_ms', after)} | "
                       f"{part('beyond_ms', after)} | {cell(before) if before else '-'} |")
    rest = f"{b['after']:.2f}x" if b else "-"
    out.append(f"| docker / local p50 (target <= 1.2x) | {r['after']:.2f}x "
               f"({'met' if v['meets_target'] else 'NOT met'}) | | {rest} | {r['before']:.2f}x |")
    return out + [""]


# ------------------------------------------------------------------ write-gym

WRITEGYM_PROBE = r'''
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
import agentenv
spent = {"bundle_load": 0.0, "runtime_start": 0.0, "first_turn_tools": 0.0, "runtime_close": 0.0}
deploys = []
load, start, close, first = (agentenv.Bundle.load.__func__, agentenv.Runtime.start,
                             agentenv.Runtime.close, agentenv.Runtime.first_turn_tools)
def timed_load(cls, *a, **k):
    t = time.perf_counter()
    try:
        return load(cls, *a, **k)
    finally:
        spent["bundle_load"] += time.perf_counter() - t
def timed_async(key, fn):
    async def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return await fn(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t
            if key == "first_turn_tools":
                deploys.append(time.perf_counter() - t)
    return wrapper
agentenv.Bundle.load = classmethod(timed_load)
agentenv.Runtime.start = timed_async("runtime_start", start)
agentenv.Runtime.close = timed_async("runtime_close", close)
agentenv.Runtime.first_turn_tools = timed_async("first_turn_tools", first)
t = time.perf_counter()
target = asyncio.run(agentenv.write_gym(sys.argv[2], sys.argv[3], agentenv.Settings.of(sandbox="local"), out=lambda s: None))
total = time.perf_counter() - t
rows = sum(1 for _ in open(target / "data" / "all.jsonl"))
print(json.dumps({"total_s": total, "rows_all": rows, "deploys": deploys, **spent}))
'''


async def writegym(args) -> dict:
    """write-gym of gridsim-v1 (local sandbox): the CLI's wall time, and in-process how much of
    write_gym is its deploys (Runtime.first_turn_tools, one per toolset), side by side."""
    cli, probes = [], []
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-gym-") as tmp:
        for r in range(args.repeat):
            root = Path(tmp) / f"cli-{r}"
            t = time.perf_counter()
            done = await asyncio.to_thread(subprocess.run, [
                sys.executable, str(AGENTENV), "write-gym", str(GRIDSIM), str(root),
                "--sandbox", "local"], capture_output=True, text=True, cwd=ROOT, timeout=600)
            took = time.perf_counter() - t
            if done.returncode != 0:
                raise RuntimeError(f"write-gym failed: {done.stderr[-1500:]}")
            rows = sum(1 for _ in open(root / "resources_servers" / "gridsim_v1" / "data" / "all.jsonl"))
            cli.append({"wall_s": took, "rows_all": rows})
            done = await asyncio.to_thread(subprocess.run, [
                sys.executable, "-c", WRITEGYM_PROBE, str(ROOT), str(GRIDSIM),
                str(Path(tmp) / f"probe-{r}")], capture_output=True, text=True, cwd=ROOT, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"the write-gym probe failed: {done.stderr[-1500:]}")
            probes.append(json.loads(done.stdout.strip().splitlines()[-1]))
            say(f"writegym: round {r + 1}: CLI {took:.2f}s, in-process {probes[-1]['total_s']:.2f}s "
                f"of which deploys {probes[-1]['first_turn_tools']:.2f}s")
    med = lambda key: statistics.median(p[key] for p in probes)  # noqa: E731
    total = med("total_s")
    return {"bundle": "bundles/gridsim-v1", "sandbox": "local", "runs": args.repeat,
            "rows_all": cli[0]["rows_all"], "toolsets_deployed": len(probes[0]["deploys"]),
            "cli_wall_s": summary([c["wall_s"] for c in cli]),
            "in_process_s": summary([p["total_s"] for p in probes]),
            "deploys_s": summary([p["first_turn_tools"] for p in probes]),
            "bundle_load_s": med("bundle_load"), "runtime_start_s": med("runtime_start"),
            "runtime_close_s": med("runtime_close"),
            "deploy_share_in_process": med("first_turn_tools") / total,
            "deploy_share_of_cli_wall": med("first_turn_tools") / statistics.median(
                c["wall_s"] for c in cli)}


# ------------------------------------------------------------------ CPU

def cpu_ticks(pid: int) -> tuple[int, int]:
    """(user, system) CPU clock ticks a process has used, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])



# ------------------------------------------------------------------ report

def markdown_new(results: dict) -> list[str]:
    out: list[str] = []
    if "episodes" in results:
        e = results["episodes"]
        st = e["start_to_health_s"]
        out += ["### episodes: quiz-v1 (no env, one prompt, a response verifier) over OpenEnv /ws, "
                "reset + the end_turn that scores it", "",
                "| clients | ours episodes/s | theirs episodes/s | ratio (target >= 100x) | ours "
                "episode p50 / p95 ms | theirs episode p50 / p95 ms | ours reset / end_turn p50 ms | "
                "theirs reset / end_turn p50 ms |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c, row in e["levels"].items():
            o, t = row["ours"], row["theirs"]
            cells = [c, f"{o['episodes_per_s']['p50']:.0f} ({o['episodes_per_round']}/round)"]
            if o["failed"]:
                cells[1] += f", {o['failed']} FAILED"
            if t:
                cells += [f"{t['episodes_per_s']['p50']:.2f} ({t['episodes_per_round']}/round"
                          + (f", {t['failed']} failed" if t["failed"] else "") + ")",
                          (f"{row['ratio_eps']:.0f}x" if row["ratio_eps"] else "(theirs all failed)")
                          + f" ({'met' if row['meets_target'] else 'NOT met'})"]
            else:
                cells += ["(not run)", ""]
            cells.append(f"{o['episode_ms']['p50']:.2f} / {o['episode_ms']['p95']:.2f}")
            cells.append(f"{t['episode_ms']['p50']:.0f} / {t['episode_ms']['p95']:.0f}" if t else "")
            cells.append(f"{o['reset_ms']['p50']:.2f} / {o['end_turn_ms']['p50']:.2f}")
            cells.append(f"{t['reset_ms']['p50']:.0f} / {t['end_turn_ms']['p50']:.0f}" if t else "")
            out.append("| " + " | ".join(cells) + " |")
        rss = e["rss_idle_kib"]
        for c, row in e["levels"].items():
            for who in ("ours", "theirs"):
                if row[who] and row[who]["failed"]:
                    out += ["", f"{who}, {c} clients: {row[who]['failed']} episodes failed, e.g. "
                            f"`{row[who]['failures'][0][:300]}`"]
        out += ["", "theirs = agentenv-framework 0.9.1364 `build_app` under uvicorn (bench venv). "
                f"Start to /health: ours {st['ours']:.2f}s" + (f", theirs {st['theirs']:.1f}s" if
                "theirs" in st else "") + f". RSS idle: ours {rss['ours'] / 1024:.1f} MiB" +
                (f", theirs {rss['theirs'] / 1024:.0f} MiB; after the runs: ours "
                 f"{e['rss_after_kib']['ours'] / 1024:.1f} MiB, theirs "
                 f"{e['rss_after_kib']['theirs'] / 1024:.0f} MiB" if "theirs" in rss else ""), ""]
    if "throughput" in results:
        tp = results["throughput"]
        out += [f"### throughput: Gym tool calls/s, K live sessions each calling back to back "
                f"({tp['window_s']:g}s windows, interleaved rounds)", "",
                "| K | ours calls/s | theirs calls/s | ratio (target >= 2x) | ours p50 / p95 ms | "
                "theirs p50 / p95 ms | RSS ours / theirs |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for k, lv in tp["levels"].items():
            o, t = lv["ours"], lv["theirs"]
            out.append(f"| {k} | {o['calls_per_s']['p50']:.0f} | {t['calls_per_s']['p50']:.0f} | "
                       f"{lv['ratio']:.2f}x ({'met' if lv['meets_target'] else 'NOT met'}) | "
                       f"{o['latency_ms']['p50']:.1f} / {o['latency_ms']['p95']:.1f} | "
                       f"{t['latency_ms']['p50']:.1f} / {t['latency_ms']['p95']:.1f} | "
                       f"{o['rss_kib'] / 1024:.0f} / {t['rss_kib'] / 1024:.0f} MiB |")
        out += ["", "ours = serve notes-v1 --sandbox local, list_notes (an MCP call to the "
                "session's own notebook env process); theirs = NeMo Gym 0.7 SimpleResourcesServer "
                "counter (bench/peers/gym_counter, no env), POST /add. One aiohttp client process "
                "drives both.", ""]
    if (results.get("memory") or {}).get("noenv"):
        m = results["memory"]["noenv"]
        out += [f"### memory, no env: serve quiz-v1, {m['sessions']} live Gym sessions", "",
                "| idle RSS | with sessions | per session | after closing | targets |",
                "|---:|---:|---:|---:|---|",
                f"| {m['idle_rss'] / 1024:.1f} MiB | {m['rss_with_sessions'] / 1024:.1f} MiB | "
                f"{m['per_session_kib']:.1f} KiB | {m['rss_after_close'] / 1024:.1f} MiB | idle <= 60 "
                f"MiB, <= 64 KiB/session: {'met' if m['meets_target'] else 'NOT met'} |", ""]
    if "deploys" in results:
        d = results["deploys"]
        s = d["single_ms"]
        out += [f"### deploys: Docker, notes-v1 save-groceries, image {d['image']}", "",
                "| measure | p50 ms | p95 ms | n | vs bare docker run |", "|---|---:|---:|---:|---:|",
                "| ours, Gym: seed_session to the first list_notes answer | "
                f"{s['ours_gym']['p50']:.0f} | "
                f"{s['ours_gym']['p95']:.0f} | {s['ours_gym']['n']} | {d['ratio_gym_vs_bare']:.2f}x "
                f"(target <= 1.2x: {'met' if d['meets_target'] else 'NOT met'}) |",
                f"| ours, OpenEnv: /ws reset to its reply (first turn ready) | "
                f"{s['ours_openenv']['p50']:.0f} | {s['ours_openenv']['p95']:.0f} | "
                f"{s['ours_openenv']['n']} | {d['ratio_openenv_vs_bare']:.2f}x |",
                f"| bare: `docker run -d` (CLI) of the same image until it answers HTTP | "
                f"{s['bare']['p50']:.0f} | {s['bare']['p95']:.0f} | {s['bare']['n']} | 1.00x |",
                f"| bare, Engine API: containers.run (docker SDK) until it answers HTTP | "
                f"{s['bare_api']['p50']:.0f} | {s['bare_api']['p95']:.0f} | {s['bare_api']['n']} | "
                f"{s['bare_api']['p50'] / s['bare']['p50']:.2f}x (ours Gym / this: "
                f"{d['ratio_gym_vs_bare_api']:.2f}x) |", "",
                f"Pool at {d['pool']}, k episodes started at once (each: seed, first list_notes, "
                f"close_session), beside k bare `docker run`s at once (no pool); plot: "
                f"{d.get('plot')}", "",
                "| k | n | ours p50 s | p95 s | max s | bare p50 s | max s | p50 ours / bare |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for k, lv in d["pool_levels_ms"].items():
            b = d["bare_levels_ms"][k]
            out.append(f"| {k} | {lv['n']} | {lv['p50'] / 1e3:.2f} | {lv['p95'] / 1e3:.2f} | "
                       f"{lv['max'] / 1e3:.2f} | {b['p50'] / 1e3:.2f} | {b['max'] / 1e3:.2f} | "
                       f"{lv['p50'] / b['p50']:.2f}x |")
        out += ["", f"containers serve left behind (removed by the bench): "
                f"{d['containers_left_by_serve']}", ""]
    if "writegym" in results:
        w = results["writegym"]
        out += [f"### writegym: `python agentenv.py write-gym bundles/gridsim-v1 ROOT --sandbox "
                f"local`, {w['rows_all']} rows in all.jsonl, {w['runs']} runs", "",
                "| measure | p50 s | min | max |", "|---|---:|---:|---:|",
                f"| CLI wall (interpreter start to exit) | {w['cli_wall_s']['p50']:.2f} | "
                f"{w['cli_wall_s']['min']:.2f} | {w['cli_wall_s']['max']:.2f} |",
                f"| in-process write_gym() | {w['in_process_s']['p50']:.2f} | "
                f"{w['in_process_s']['min']:.2f} | {w['in_process_s']['max']:.2f} |",
                f"| its deploys: Runtime.first_turn_tools x {w['toolsets_deployed']} toolset(s) | "
                f"{w['deploys_s']['p50']:.2f} | {w['deploys_s']['min']:.2f} | "
                f"{w['deploys_s']['max']:.2f} |", "",
                f"Deploy share: {w['deploy_share_in_process'] * 100:.0f}% of write_gym(), "
                f"{w['deploy_share_of_cli_wall'] * 100:.0f}% of the CLI's wall; Bundle.load "
                f"{w['bundle_load_s']:.2f}s, Runtime start {w['runtime_start_s']:.2f}s, close "
                f"{w['runtime_close_s']:.2f}s (medians).", ""]
    return out



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
    out += markdown_new(results)
    if "bash" in results:
        b = results["bash"]
        out += [f"### bash: `true` in the agent's box, {b['calls']} calls each, interleaved (ms)", "",
                "| target | p50 | p95 | p50 / direct |", "|---|---:|---:|---:|",
                f"| ours: serve Gym POST /bash | {b['ours_ms']['p50']:.1f} | {b['ours_ms']['p95']:.1f} | "
                f"{b['ratio_p50']:.2f}x (target <= 1.5x: {'met' if b['meets_target'] else 'NOT met'}) |",
                f"| direct: docker exec to the box | {b['direct_ms']['p50']:.1f} | "
                f"{b['direct_ms']['p95']:.1f} | 1.00x |", "",
                "| start to first turn (OpenEnv reset) | p50 s | p95 s |", "|---|---:|---:|"]
        for name, st in b["start_to_first_turn_s"].items():
            out.append(f"| {name} | {st['p50']:.2f} | {st['p95']:.2f} |")
        out.append("")
    if "metrics" in results:
        out += markdown_metrics(results["metrics"])
    if "verify" in results:
        out += markdown_verify(results["verify"])
    if "idle" in results:
        out += markdown_idle(results["idle"])
    if "hot" in results:
        out += markdown_hot(results["hot"])
    return "\n".join(out)


# ------------------------------------------------------------------ hot: the hop and the episode

ECHO_SERVER = r"""
import sys
from aiohttp import web, WSMsgType
async def ws(request):
    socket_ = web.WebSocketResponse()
    await socket_.prepare(request)
    async for message in socket_:
        if message.type == WSMsgType.TEXT:
            await socket_.send_str(message.data)
    return socket_
async def health(request):
    return web.json_response({"status": "healthy"})
app = web.Application()
app.router.add_get("/ws", ws)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


# What both bare proxies of the hop share: the MCP messages they send, and their app (health, the
# tool route, started and stopped with the env's session).
PROXY_COMMON = r"""
import asyncio, json, sys
from aiohttp import web
INIT = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "proxy", "version": "0"}}}
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}
async def read_call(request):
    arguments = json.loads(await request.read() or b"{}")
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": request.match_info["tool"], "arguments": arguments}}).encode()
def answer(reply):
    return web.Response(text="\n".join(c["text"] for c in json.loads(reply)["result"]["content"]))
"""
PROXY_APP = r"""
async def health(request):
    return web.json_response({"status": "healthy"})
app = web.Application()
app.on_startup.append(start)
app.on_cleanup.append(stop)
app.router.add_post("/{tool}", tool)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

# The least any aiohttp proxy of the hop does: the tool's arguments read from a POST, the MCP
# tools/call made to the env with aiohttp's client, the text of its result answered. No session,
# no turn, no deadline, no metrics: what serve adds beyond this is agentenv.py's own.
PROXY_SERVER = PROXY_COMMON + r"""
import aiohttp
ENV = sys.argv[2] + "/mcp"
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
async def start(app):
    app["http"] = http = aiohttp.ClientSession()
    async with http.post(ENV, json=INIT, headers=HEADERS) as resp:
        app["headers"] = {**HEADERS, "Mcp-Session-Id": resp.headers["Mcp-Session-Id"]}
        await resp.read()
    async with http.post(ENV, json=INITIALIZED, headers=app["headers"]) as resp:
        await resp.read()
async def stop(app):
    await app["http"].close()
async def tool(request):
    body = await read_call(request)
    async with request.app["http"].post(ENV, data=body, headers=request.app["headers"]) as resp:
        return answer(await resp.read())
""" + PROXY_APP

# The same proxy with the least client: the tools/call written as bytes on one kept-alive
# connection and its reply read by Content-Length (all the notebook env sends), as serve's env
# client (EnvLine) does without its other framings, its checks and its pool. What is left of the
# hop's time here is aiohttp's server and the event loop's.
LEAN_PROXY_SERVER = PROXY_COMMON + r"""
HOST, PORT = sys.argv[2].rsplit("//", 1)[1].split(":")
async def post(app, body, session=b""):
    reader, writer = app["line"]
    writer.write(b"POST /mcp HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
                 b"Accept: application/json, text/event-stream\r\n%sContent-Length: %d\r\n\r\n%s"
                 % (HOST.encode(), PORT.encode(), session, len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
    headers = {k.lower(): v for k, v in headers.items()}
    return headers, await reader.readexactly(int(headers.get(b"content-length", b"0")))
async def start(app):
    app["line"] = await asyncio.open_connection(HOST, int(PORT))
    headers, _ = await post(app, json.dumps(INIT).encode())
    app["session"] = b"Mcp-Session-Id: " + headers[b"mcp-session-id"] + b"\r\n"
    await post(app, json.dumps(INITIALIZED).encode(), app["session"])
async def stop(app):
    app["line"][1].close()
async def tool(request):
    _, reply = await post(request.app, await read_call(request), request.app["session"])
    return answer(reply)
""" + PROXY_APP


async def hot(args) -> dict:
    """The two per-call paths beside their floors, for this agentenv.py and the one at git
    revision --hot-before, all up at once and measured in interleaved rounds:

    hop      one Gym session's list_notes through serve notes-v1 --sandbox local (after, before)
             beside the same MCP tools/call straight to a notebook env of our own (direct), and
             through a bare aiohttp proxy to that env (proxy: PROXY_SERVER, the least an aiohttp
             proxy does, so hop/proxy is what agentenv.py's own work adds).
    episode  one /ws on serve bench/bundles/quiz-v1 (after, before): reset, then the end_turn
             that scores it, beside two WebSocket round trips (the same two frames, echoed) to a
             bare aiohttp echo server in a process of its own (echo)."""
    procs: list[Proc] = []
    notebook = NOTES / "envs" / "notebook" / "server.py"
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-hot-") as tmp:
        before = before_agentenv(args.hot_before, Path(tmp))
        programs = {"after": AGENTENV, "before": before}
        ports = {k: free_port() for k in ("hop after", "hop before", "episode after",
                                          "episode before", "direct", "proxy", "lean proxy",
                                          "echo")}
        try:
            servers = {}
            for which, program in programs.items():
                for path, bundle in (("hop", NOTES), ("episode", QUIZ)):
                    servers[f"{path} {which}"] = Proc([
                        sys.executable, str(program), "serve", str(bundle), "--sandbox", "local",
                        "--port", str(ports[f"{path} {which}"])])
            env = Proc([sys.executable, str(notebook)],
                       env={"MCP_PORT": str(ports["direct"]), "MCP_HOST": "127.0.0.1",
                            "ENVIRONMENT_NAME": "notebook", "PYTHONUNBUFFERED": "1"},
                       cwd=notebook.parent)
            echo = Proc([sys.executable, "-c", ECHO_SERVER, str(ports["echo"])])
            procs = [*servers.values(), env, echo]
            url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
            await wait_port(ports["direct"], env)
            proxy = Proc([sys.executable, "-c", PROXY_SERVER, str(ports["proxy"]), url["direct"]])
            lean = Proc([sys.executable, "-c", LEAN_PROXY_SERVER, str(ports["lean proxy"]),
                         url["direct"]])
            procs += [proxy, lean]
            async with aiohttp.ClientSession() as probe:
                for name, proc in servers.items():
                    await wait_health(probe, url[name], proc)
                await wait_health(probe, url["echo"], echo)
                await wait_health(probe, url["proxy"], proxy)
                await wait_health(probe, url["lean proxy"], lean)
            calls, closers = await hot_targets(url)
            try:
                for name, f in calls.items():                    # warm up, and check answers
                    for _ in range(100):
                        await f()
                # whose CPU each target spends: the server it calls, and the env behind serve's hop
                envs = {f"hop {w}": list(servers[f"hop {w}"].track()) for w in programs}
                spenders = {**{k: {"server": [p.pid]} for k, p in servers.items()},
                            **{k: {"server": [p.pid], "env": envs[k]} for k, p in servers.items()
                               if k in envs},
                            "direct": {"env": [env.pid]}, "echo": {"server": [echo.pid]},
                            "proxy": {"server": [proxy.pid], "env": [env.pid]},
                            "lean proxy": {"server": [lean.pid], "env": [env.pid]}}
                ticks = {k: collections.Counter() for k in calls}
                times: dict[str, list[float]] = {k: [] for k in calls}
                round_p50: dict[str, list[float]] = {k: [] for k in calls}
                order = list(calls)
                for r in range(args.repeat):
                    k = r % len(order)
                    for name in order[k:] + order[:k]:          # rotate who goes first
                        f, got = calls[name], []
                        cpu0 = {who: sum(sum(cpu_ticks(p)) for p in pids)
                                for who, pids in spenders[name].items()}
                        for _ in range(args.hot_calls):
                            t = time.perf_counter()
                            await f()
                            got.append((time.perf_counter() - t) * 1e3)
                        for who, pids in spenders[name].items():
                            ticks[name][who] += sum(sum(cpu_ticks(p)) for p in pids) - cpu0[who]
                        times[name] += got
                        round_p50[name].append(statistics.median(got))
                    say(f"hot: round {r + 1}/{args.repeat}: " + ", ".join(
                        f"{n} {round_p50[n][-1]:.3f}" for n in order) + " ms")
            finally:
                for close in closers:
                    await close()
        finally:
            for p in procs:
                p.stop()
    stats = {k: summary(v) for k, v in times.items()}
    hz, n = os.sysconf("SC_CLK_TCK"), args.repeat * args.hot_calls
    cpu_us = {k: {who: t / hz / n * 1e6 for who, t in c.items()} for k, c in ticks.items()}

    def versus(a: str, b: str) -> dict:
        return {"p50": stats[a]["p50"] / stats[b]["p50"], "p95": stats[a]["p95"] / stats[b]["p95"],
                "per_round_p50": [x / y for x, y in zip(round_p50[a], round_p50[b])]}
    ratios = {"hop after / direct": versus("hop after", "direct"),
              "hop before / direct": versus("hop before", "direct"),
              "proxy / direct": versus("proxy", "direct"),
              "lean proxy / direct": versus("lean proxy", "direct"),
              "hop after / proxy": versus("hop after", "proxy"),
              "hop after / lean proxy": versus("hop after", "lean proxy"),
              "episode after / echo": versus("episode after", "echo"),
              "episode before / echo": versus("episode before", "echo"),
              "hop after / before": versus("hop after", "hop before"),
              "episode after / before": versus("episode after", "episode before")}
    return {"unit": "ms", "before": args.hot_before, "rounds": args.repeat,
            "calls_per_round": args.hot_calls, "stats": stats, "ratios": ratios, "target": 2.0,
            "cpu_us_per_call": cpu_us,
            "meets_target": {"hop": ratios["hop after / direct"]["p50"] <= 2.0,
                             "episode": ratios["episode after / echo"]["p50"] <= 2.0}}


async def hot_targets(url: dict[str, str]) -> tuple[dict[str, Callable], list[Callable]]:
    """One client per target, each opened as hot() measures it: its call, and how to close it."""
    conn = lambda: aiohttp.TCPConnector(limit=1)  # noqa: E731
    calls: dict[str, Callable] = {}
    closers: list[Callable] = []
    row = notes_row(NOTES, 0)
    for which in ("after", "before"):
        http = aiohttp.ClientSession(connector=conn())
        closers.append(http.close)
        cookie = await seed(http, url[f"hop {which}"], row)
        http.cookie_jar.update_cookies({COOKIE: cookie})

        async def call(http=http, to=url[f"hop {which}"] + "/list_notes") -> None:
            async with http.post(to, json={}) as resp:
                text = await resp.text()
                if resp.status != 200 or text != "pancakes":
                    raise RuntimeError(f"/list_notes answered {resp.status}: {text[:300]}")
        calls[f"hop {which}"] = call

    direct = aiohttp.ClientSession(connector=conn())
    closers.append(direct.close)
    async with direct.post(url["direct"] + "/agentenv/ext/preload",
                           json={"notes": {"pancakes": "2 eggs, 1 cup milk, 1 cup flour"}}) as resp:
        await resp.read()
    sid = await mcp_open(direct, url["direct"] + "/mcp")
    headers = {**MCP_HEADERS, "Mcp-Session-Id": sid}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "list_notes", "arguments": {}}}

    async def call_direct() -> None:
        async with direct.post(url["direct"] + "/mcp", json=body, headers=headers) as resp:
            text = (await resp.json())["result"]["content"][0]["text"]
            if text != "pancakes":
                raise RuntimeError(f"the env's list_notes answered {text[:300]}")
    calls["direct"] = call_direct

    for proxy in ("proxy", "lean proxy"):                   # the two bare proxies, alike
        proxied = aiohttp.ClientSession(connector=conn())
        closers.append(proxied.close)

        async def call_proxy(proxied=proxied, proxy=proxy) -> None:
            async with proxied.post(url[proxy] + "/list_notes", json={}) as resp:
                text = await resp.text()
                if resp.status != 200 or text != "pancakes":
                    raise RuntimeError(f"the {proxy}'s /list_notes answered {resp.status}: "
                                       f"{text[:300]}")
        calls[proxy] = call_proxy

    for which in ("after", "before"):
        http = aiohttp.ClientSession()
        ws = await http.ws_connect(url[f"episode {which}"] + "/ws", max_msg_size=0)
        closers += [ws.close, http.close]

        async def episode(ws=ws) -> None:
            await ws.send_str(RESET)
            reset = json.loads((await ws.receive(timeout=60)).data)
            if reset.get("type") != "observation":
                raise RuntimeError(f"reset answered {json.dumps(reset)[:300]}")
            await ws.send_str(ANSWER)
            ended = json.loads((await ws.receive(timeout=60)).data)
            if (ended.get("data") or {}).get("reward") != 1.0:
                raise RuntimeError(f"end_turn answered {json.dumps(ended)[:300]}")
        calls[f"episode {which}"] = episode

    http = aiohttp.ClientSession()
    ws_echo = await http.ws_connect(url["echo"] + "/ws", max_msg_size=0)
    closers += [ws_echo.close, http.close]

    async def echo() -> None:
        for frame in (RESET, ANSWER):
            await ws_echo.send_str(frame)
            if json.loads((await ws_echo.receive(timeout=60)).data) != json.loads(frame):
                raise RuntimeError("the echo server answered something else")
    calls["echo"] = echo
    return calls, closers


def markdown_hot(h: dict) -> list[str]:
    s, r = h["stats"], h["ratios"]
    out = [f"### hot: the hop and the episode beside their floors, this agentenv.py (after) and git "
           f"{h['before']} (before); {h['rounds']} interleaved rounds x {h['calls_per_round']} "
           "sequential calls (ms)", "",
           "| target | n | p50 | p95 | CPU per call (µs, from /proc) |", "|---|---:|---:|---:|---|"]
    for name, st in s.items():
        cpu = ", ".join(f"{who} {us:.0f}" for who, us in h["cpu_us_per_call"][name].items())
        out.append(f"| {name} | {st['n']} | {st['p50']:.3f} | {st['p95']:.3f} | {cpu} |")
    out += ["", "| ratio | p50 | p95 | per-round p50 |", "|---|---:|---:|---:|"]
    for name, v in r.items():
        pr = v["per_round_p50"]
        out.append(f"| {name} | {v['p50']:.2f}x | {v['p95']:.2f}x | {min(pr):.2f}x..{max(pr):.2f}x |")
    out += ["", f"target <= 2.0x: hop {'met' if h['meets_target']['hop'] else 'NOT met'}, episode "
            f"{'met' if h['meets_target']['episode'] else 'NOT met'}", ""]
    return out


# ------------------------------------------------------------------ bash (the agent's box)

PYFIX = ROOT / "bundles" / "pyfix-v1"


async def box_start(url: str, split: str) -> float:
    """Seconds from an OpenEnv reset to its first turn (a deploy, box or env), then closed."""
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url + "/ws", max_msg_size=0) as ws:
            t0 = time.perf_counter()
            await ws.send_str(json.dumps({"type": "reset", "data": {"split": split, "index": 0}}))
            reply = json.loads((await ws.receive(timeout=300)).data)
            took = time.perf_counter() - t0
            assert "prompt" in reply["data"]["observation"]["metadata"], reply
            await ws.send_str(json.dumps({"type": "close"}))
    return took


async def bash(args) -> dict:
    """A bash call through serve (Gym POST /bash) beside the same command run straight to the box
    with docker exec (the SDK, as agent in /app); and box start to first turn beside an env deploy."""
    import docker as docker_sdk
    sys.path.insert(0, str(ROOT))
    import agentenv  # noqa: PLC0415
    task = agentenv.Bundle.load(str(PYFIX)).splits["eval"][0]
    row = {"responses_create_params": {"input": [{"role": "user", "content": "fix it"}]},
           "split": "eval", "index": 0, "task_id": task.id}
    client_ = docker_sdk.from_env()
    port, notes_port = free_port(), free_port()
    ours, direct, starts = [], [], {"box (pyfix-v1)": [], "env (notes-v1)": []}
    servers = [serve(PYFIX, port, sandbox="docker"), serve(NOTES, notes_port, sandbox="docker")]
    try:
        async with client() as http:
            for proc, p in zip(servers, (port, notes_port)):
                await wait_health(http, f"http://127.0.0.1:{p}", proc, timeout=180)
            cookie = await seed(http, f"http://127.0.0.1:{port}", row)
            headers = {"Cookie": f"{COOKIE}={cookie}"}
            async with http.post(f"http://127.0.0.1:{port}/bash", json={"command": "true"},
                                 headers=headers) as resp:       # waits for the box
                await resp.read()
            box = next(c for c in client_.containers.list(filters={"label": "agentenv.box"})
                       if c.labels["agentenv.owner"].split(":")[1] == str(servers[0].pid))

            def exec_direct() -> None:
                made = client_.api.exec_create(box.id, ["bash", "-c", "true"], user="agent",
                                               workdir="/app")
                for _ in client_.api.exec_start(made["Id"], stream=True, demux=True):
                    pass
                client_.api.exec_inspect(made["Id"])
            for _ in range(args.repeat):
                for _ in range(args.bash_calls):
                    t0 = time.perf_counter()
                    async with http.post(f"http://127.0.0.1:{port}/bash", json={"command": "true"},
                                         headers=headers) as resp:
                        await resp.read()
                    ours.append((time.perf_counter() - t0) * 1e3)
                    t0 = time.perf_counter()
                    await asyncio.to_thread(exec_direct)
                    direct.append((time.perf_counter() - t0) * 1e3)
            for _ in range(args.repeat):
                starts["box (pyfix-v1)"].append(await box_start(f"http://127.0.0.1:{port}", "eval"))
                starts["env (notes-v1)"].append(await box_start(f"http://127.0.0.1:{notes_port}",
                                                                "all"))
    finally:
        for proc in servers:
            proc.stop(grace=30)
        client_.close()
    o, d = summary(ours), summary(direct)
    return {"calls": len(ours), "ours_ms": o, "direct_ms": d, "ratio_p50": o["p50"] / d["p50"],
            "meets_target": o["p50"] / d["p50"] <= 1.5,
            "start_to_first_turn_s": {k: summary(v) for k, v in starts.items()}}


PARTS = {"hop": hop, "startup": startup, "memory": memory, "episodes": episodes,
         "throughput": throughput, "deploys": deploys, "writegym": writegym,
         "bash": bash,
         "metrics": metrics_cost,
         "verify": verify_latency,
         "idle": idle, "hot": hot}


async def main_async(args) -> int:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        sys.exit(f"unknown parts {sorted(unknown)}; the parts are {', '.join(PARTS)}")
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
        say(f"{part} ...")
        results[part] = await PARTS[part](args)
    meta["loadavg_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta["wall_s"] = round(time.perf_counter() - t, 1)
    print(markdown(cmd, meta, results))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "meta": meta, "results": results},
                                              indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="hop,startup,memory,episodes,throughput,deploys,writegym",
                        help=f"comma-separated, of: {', '.join(PARTS)} (default: all but bash, "
                             "metrics, verify, idle and hot)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="hop: interleaved rounds; startup: runs per target; episodes, "
                             "throughput: interleaved rounds; deploys: rounds per level (single "
                             "deploys get twice as many); writegym: runs (default 5)")
    parser.add_argument("--calls", type=int, default=300, help="hop: calls per target per round")
    parser.add_argument("--bash-calls", type=int, default=20,
                        help="bash: calls per target per round (needs Docker; default 20)")
    parser.add_argument("--sessions", type=int, default=50, help="memory: K Gym sessions on notes-v1")
    parser.add_argument("--noenv-sessions", type=int, default=1000,
                        help="memory: Gym sessions on the no-env quiz-v1 (0 skips; default 1000)")
    parser.add_argument("--env", default="nodelay,shipped",
                        help="hop: notebook variants, nodelay and/or shipped (default both)")
    parser.add_argument("--clients", default="1,8,64",
                        help="episodes: concurrent /ws clients, per level (default 1,8,64)")
    parser.add_argument("--their-clients", default="1,8",
                        help="episodes: the levels agentenv-framework also plays ('' for none; "
                             "default 1,8: its episodes take seconds)")
    parser.add_argument("--episodes", type=int, default=400,
                        help="episodes: ours' episodes per level per round (default 400)")
    parser.add_argument("--their-episodes", type=int, default=5,
                        help="episodes: theirs' episodes per level per round, at least one per "
                             "client (default 5)")
    parser.add_argument("--throughput-sessions", default="32,256",
                        help="throughput: live Gym sessions, per level (default 32,256)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="throughput: seconds per measuring window (default 3)")
    parser.add_argument("--pool", type=int, default=8, help="deploys: serve's --max-concurrent-envs")
    parser.add_argument("--deploy-levels", default="1,2,4,8,16,32",
                        help="deploys: episodes started at once, per level (default 1,2,4,8,16,32)")
    parser.add_argument("--plot", default=str(ROOT / "bench" / "deploys.png"),
                        help="deploys: the PNG written (default bench/deploys.png)")
    parser.add_argument("--before", default="5cb72ae",
                        help="metrics: the git revision whose agentenv.py is the baseline (default "
                             "5cb72ae, the last before metrics)")
    parser.add_argument("--metrics-sessions", type=int, default=32,
                        help="metrics: live Gym sessions calling at once (default 32)")
    parser.add_argument("--scrape-every", type=float, default=1.0,
                        help="metrics: seconds between scrapes of /metrics (default 1)")
    parser.add_argument("--verify-rollouts", type=int, default=10,
                        help="verify: rollouts per server per round (default 10)")
    parser.add_argument("--verify-before", default="6a5ee9a",
                        help="verify: the git revision whose agentenv.py is the baseline (default "
                             "6a5ee9a, the last whose /verify waited for the teardown)")
    parser.add_argument("--idle-episodes", type=int, default=200,
                        help="idle: episodes each server plays before its idle RSS (default 200)")
    parser.add_argument("--idle-clients", type=int, default=8,
                        help="idle: OpenEnv clients at once, and serve's pool (default 8)")
    parser.add_argument("--idle-sandboxes", default="local,docker",
                        help="idle: the sandboxes, of local and docker (default both)")
    parser.add_argument("--idle-before", default="6a5ee9a",
                        help="idle: the git revision whose agentenv.py is the baseline (default "
                             "6a5ee9a, the last before the script ran as the module)")
    parser.add_argument("--idle-quiet", type=float, default=3.0,
                        help="idle: seconds of quiet before each RSS is read (default 3; serve "
                             "trims its heap 1 s after its pool drains)")
    parser.add_argument("--hot-before", default="5ae11ea",
                        help="hot: the git revision whose agentenv.py is the baseline (default "
                             "5ae11ea, the last before issue 27's cuts of the hop and the episode)")
    parser.add_argument("--hot-calls", type=int, default=300,
                        help="hot: sequential calls (or episodes) per target per round (default 300)")
    parser.add_argument("--json", help="write the results here as JSON")
    return run_to_the_end(main_async(parser.parse_args()))


def run_to_the_end(main_async: Awaitable[int]) -> int:
    """Run a bench's main coroutine, then stop every process it started, however it ended."""
    try:
        return asyncio.run(main_async)
    finally:
        for proc in list(Proc.live):
            proc.stop(grace=10)


if __name__ == "__main__":
    sys.exit(main())
