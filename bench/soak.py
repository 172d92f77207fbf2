"""soak.py: serve's memory, threads and fds over a long run of episodes, as a training run plays them.

    python bench/soak.py [--surface gym|openenv] [--episodes 50000] [--concurrency 64]
                         [--pool 64] [--every 1000] [--sandbox local|docker]
                         [--agentenv PATH] [--json out.json] [--plot out.png]
    python bench/soak.py --from a.json b.json --plot out.png      # plot earlier runs together

It starts ``agentenv.py serve bundles/notes-v1 --sandbox local --max-concurrent-envs POOL`` with no
environment variable of its own (MALLOC_ARENA_MAX and the like are removed), and keeps
``--concurrency`` rollouts in flight: on Gym seed, write_note (a text no other rollout writes),
read_note, verify; on OpenEnv a /ws reset, the same two calls, end_turn. Every ``--every``
episodes it stops starting new ones, lets those in flight finish, waits until the server runs no
env process, and reads the server's VmRSS, its peak (VmHWM), threads, open fds and live children
from /proc, with the most envs seen live since the last sample (child processes; with
``--sandbox docker``, the containers carrying serve's owner label). RSS is read twice: 0.3 s into the
idle (``rss_untrimmed_mib``), and 2 s in (``rss_mib``), after serve's heap trim (``HeapTrim``:
1 s after its pool drains, glibc's free arena memory goes back to the OS). "In flight" is rollouts, not live
envs: starts wait on the boot gate, so fewer envs than rollouts are live at once, and how many
depends on how busy the machine is.

The result: every sample, the slope of RSS over the second half (least squares, MiB per 10,000
episodes, of the samples after ``--warm-up`` episodes; ``--whole`` takes all of them), the growth
of RSS, threads, fds and children after warm-up, and how many rollouts scored 1.0, were masked or failed. ``--agentenv`` runs another
copy of agentenv.py (an older commit, say) as the baseline of the same run. Nothing is left
running: the server is stopped with SIGINT and its env processes are checked gone.

The issue's target: after a 1,000-episode warm-up, at most 2 MiB per 10,000 further episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
NOTES = ROOT / "bundles" / "notes-v1"
COOKIE = "agentenv_session"
SAVE = 1                                  # save-groceries, in the split "all"
TOOLS = ["write_note", "read_note", "list_notes", "end_turn"]


# ------------------------------------------------------------------ the server

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served:
    """serve as a subprocess of its own session, and what /proc says of it."""

    def __init__(self, agentenv: Path, pool: int, sandbox: str, state: Path, flags: tuple = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MALLOC_", "PYTHONMALLOC", "MAX_CONCURRENT_ENVS", "AGENTENV_"))}
        env.update(AGENTENV_STATE_DIR=str(state), PYTHONUNBUFFERED="1")
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, str(agentenv), "serve", str(NOTES), "--sandbox", sandbox, "--port",
             str(self.port), "--max-concurrent-envs", str(pool), *flags], cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.pid = self.proc.pid
        self.sandbox = sandbox

    def live_envs(self) -> int:
        """The server's envs live now: its child processes (local), or the containers that carry
        its owner label (docker), each env's own."""
        if self.sandbox != "docker":
            return self.children()
        start = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        done = subprocess.run(["docker", "ps", "-q", "--filter",
                               f"label=agentenv.owner={socket.gethostname()}:{self.pid}:{start}"],
                              capture_output=True, text=True, timeout=60)
        return len(done.stdout.split())

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    async def wait_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"serve exited {self.proc.returncode}:\n{self.output()}")
                try:
                    async with http.get(self.url + "/health") as resp:
                        if resp.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"serve did not answer in {timeout}s:\n{self.output()}")

    def status(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise RuntimeError(f"no {key} for {self.pid}")

    def children(self) -> int:
        found = set()
        for task in os.listdir(f"/proc/{self.pid}/task"):
            try:
                found.update(Path(f"/proc/{self.pid}/task/{task}/children").read_text().split())
            except OSError:
                pass
        live = 0
        for pid in found:
            try:
                live += Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            except (OSError, IndexError):
                pass
        return live

    def sample(self, episodes: int, started: float, live_peak: int = 0) -> dict:
        # VmHWM, the most RSS the server ever held, beside the idle RSS: an idle step that follows
        # a step of the peak is freed memory glibc keeps after a busier stretch, not a leak.
        return {"episodes": episodes, "rss_mib": round(self.status("VmRSS") / 1024, 2),
                "peak_rss_mib": round(self.status("VmHWM") / 1024, 2),
                "live_envs_peak": live_peak,
                "threads": self.status("Threads"), "fds": len(os.listdir(f"/proc/{self.pid}/fd")),
                "children": self.children(), "wall_s": round(time.monotonic() - started, 1)}

    async def idle(self, timeout: float = 60) -> float:
        """Wait until the server runs no env (its episodes all torn down), and past the
        second after which serve trims its heap once the pool has drained. The RSS before that
        trim is returned, so each sample shows what the trim gave back."""
        deadline = time.monotonic() + timeout
        while await asyncio.to_thread(self.live_envs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)           # the last replies and teardowns settle
        untrimmed = round(self.status("VmRSS") / 1024, 2)
        await asyncio.sleep(1.7)           # serve's HeapTrim waits 1 s of an empty pool
        return untrimmed

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


# ------------------------------------------------------------------ rollouts

def gym_row() -> dict:
    sys.path.insert(0, str(ROOT))
    import agentenv  # noqa: PLC0415
    task = agentenv.Bundle.load(NOTES).splits["all"][SAVE]
    tools = [{"type": "function", "name": n, "description": n, "strict": False,
              "parameters": {"type": "object", "properties": {}}} for n in TOOLS]
    return {"responses_create_params": {"input": [{"role": "user", "content": task.first_prompt[0]}],
                                        "tools": tools},
            "split": "all", "index": SAVE, "task_id": task.id}


def response(text: str) -> dict:
    return {"id": "resp", "object": "response", "created_at": 0, "model": "policy",
            "status": "completed", "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "output": [{"type": "message", "id": "msg", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}]}


async def gym_rollout(http: aiohttp.ClientSession, url: str, row: dict, n: int) -> str:
    """One Gym rollout; "scored", "masked" or "failed"."""
    async with http.post(url + "/seed_session", json=row) as resp:
        if resp.status != 200:
            return "failed"
        cookies = {COOKIE: resp.cookies[COOKIE].value}
    text = f"eggs and milk, for rollout {n}"
    for name, args in (("write_note", {"title": "groceries", "text": text}),
                       ("read_note", {"title": "groceries"})):
        async with http.post(f"{url}/{name}", json=args, cookies=cookies) as resp:
            answer = await resp.text()
    async with http.post(url + "/verify", json={**row, "response": response("Saved.")},
                         cookies=cookies) as resp:
        body = await resp.json()
    if body.get("mask_sample"):           # the environment failed it, and said so
        return "masked"
    # scored only on an env of its own: its note read back as written
    return "scored" if body.get("reward") == 1.0 and answer == text else "failed"


async def openenv_rollout(http: aiohttp.ClientSession, url: str, row: dict, n: int) -> str:
    """One OpenEnv rollout over /ws; at the server's capacity it retries, as OpenEnv's clients do."""
    delay = 0.05
    while True:
        ws = await http.ws_connect(url + "/ws", max_msg_size=2**24)
        await ws.send_json({"type": "reset", "data": {"split": "all", "index": SAVE}})
        reply = await ws.receive_json(timeout=300)
        if reply["type"] != "error" or reply["data"].get("code") != "CAPACITY_REACHED":
            break
        await ws.close()
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
    try:
        if reply["type"] != "observation" or reply["data"]["done"]:
            return "masked"
        text = f"eggs and milk, for session {n}"
        for name, args in (("write_note", {"title": "groceries", "text": text}),
                           ("read_note", {"title": "groceries"}),
                           ("end_turn", {"response": "Saved."})):
            await ws.send_json({"type": "step", "data": {"type": "call_tool", "tool_name": name,
                                                         "arguments": args}})
            reply = await ws.receive_json(timeout=300)
            if name == "read_note" and (reply["data"]["observation"].get("result") or {}).get(
                    "data") != text:
                return "failed"
        data = reply["data"]
        if data["done"] and data["reward"] == 1.0:
            return "scored"
        return "masked" if (data["observation"].get("metadata") or {}).get("failure_kind") else "failed"
    finally:
        await ws.close()


# ------------------------------------------------------------------ the run

def slope_per_10k(samples: list[dict], warm_up: int, whole: bool = False,
                  key: str = "rss_mib") -> float | None:
    """Least-squares slope of RSS (MiB) against episodes, per 10,000 episodes: over the second
    half of the samples after ``warm_up`` episodes, or over all of them (``whole``)."""
    after = [s for s in samples if s["episodes"] >= warm_up and key in s]
    half = after if whole or len(after) < 4 else after[len(after) // 2:]
    if len(half) < 2:
        return None
    xs, ys = [s["episodes"] for s in half], [s[key] for s in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return None if den == 0 else round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den * 1e4, 3)


async def soak(args: argparse.Namespace) -> dict:
    state = Path(tempfile.mkdtemp(prefix="agentenv-soak-"))
    # no warm pool (with Docker serve keeps one by default): the envs counted are the episodes'
    served = Served(Path(args.agentenv).resolve(), args.pool, args.sandbox, state, ("--warm", "0"))
    tallies = {"scored": 0, "masked": 0, "failed": 0}
    samples: list[dict] = []
    most_envs = 0
    try:
        await served.wait_up()
        row = gym_row()
        play = gym_rollout if args.surface == "gym" else openenv_rollout
        url = served.url if args.surface == "gym" else served.url.replace("http://", "ws://")
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     cookie_jar=aiohttp.DummyCookieJar(),
                                     timeout=aiohttp.ClientTimeout(total=900))
        started = time.monotonic()
        samples.append(served.sample(0, started))
        done = 0
        async with http:
            while done < args.episodes:
                batch = min(args.every, args.episodes - done)
                gate = asyncio.Semaphore(args.concurrency)

                async def one(n: int) -> None:
                    async with gate:
                        try:
                            tallies[await play(http, url, row, n)] += 1
                        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                            tallies["failed"] += 1

                peak = 0

                async def watch() -> None:
                    nonlocal peak
                    while True:
                        peak = max(peak, await asyncio.to_thread(served.live_envs))
                        await asyncio.sleep(0.5)
                watcher = asyncio.create_task(watch())
                await asyncio.gather(*(one(done + i) for i in range(batch)))
                watcher.cancel()
                most_envs = max(most_envs, peak)
                done += batch
                untrimmed = await served.idle()
                sample = {**served.sample(done, started, peak), "rss_untrimmed_mib": untrimmed}
                samples.append(sample)
                if args.signal:
                    os.kill(served.pid, getattr(signal, "SIG" + args.signal.upper().removeprefix("SIG")))
                    await asyncio.sleep(5)        # the profiler's dump, before the next batch
                print(f"soak: {done} episodes, RSS {sample['rss_mib']} MiB (before the "
                      f"trim {untrimmed}, peak "
                      f"{sample['peak_rss_mib']}, {peak} envs live at most), threads "
                      f"{sample['threads']}, fds {sample['fds']}, live envs {sample['children']}, "
                      f"{tallies}", flush=True)
                summary(args, tallies, most_envs, samples, done=False)
    finally:
        served.stop()
    return summary(args, tallies, most_envs, samples, done=True)


def summary(args: argparse.Namespace, tallies: dict, most_envs: int, samples: list[dict],
            done: bool) -> dict:
    """The result so far; with --json it is written after every sample, so a run stopped early
    keeps what it measured (``"finished": false``)."""
    first = next((s for s in samples if s["episodes"] >= args.warm_up), samples[-1])
    last = samples[-1]
    result = {"command": " ".join([sys.executable, *sys.argv]), "surface": args.surface,
              "agentenv": str(args.agentenv), "episodes": args.episodes,
              "finished": done, "episodes_played": last["episodes"],
              "concurrency": args.concurrency, "pool": args.pool, "sandbox": args.sandbox,
              "tallies": dict(tallies), "most_live_envs": most_envs, "samples": samples,
              "warm_up": args.warm_up, "slope_over": "the whole run after warm-up" if args.whole
              else "the second half after warm-up",
              "slope_mib_per_10k": slope_per_10k(samples, args.warm_up, args.whole),
              # the same, read 0.3 s into the idle, before serve's heap trim
              "slope_untrimmed_mib_per_10k": slope_per_10k(samples, args.warm_up, args.whole,
                                                           "rss_untrimmed_mib"),
              "growth_after_warm_up": {k: round(last[k] - first[k], 2)
                                       for k in ("rss_mib", "threads", "fds", "children")},
              "wall_s": last["wall_s"]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result

def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("soak.py: --plot needs matplotlib: pip install matplotlib (the results are written)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for result in results:
        xs = [s["episodes"] for s in result["samples"]]
        ys = [s["rss_mib"] for s in result["samples"]]
        ax.plot(xs, ys, marker=".", label=f"{result['surface']}, {result.get('sandbox', 'local')} "
                                          f"sandbox, {Path(result['agentenv']).name}: "
                                          f"{result['slope_mib_per_10k']} MiB / 10k")
    ax.set_xlabel("episodes")
    ax.set_ylabel("serve RSS, MiB (idle)")
    ax.set_title("serve bundles/notes-v1: RSS over a soak")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--surface", choices=("gym", "openenv"), default="gym")
    parser.add_argument("--episodes", type=int, default=50_000)
    parser.add_argument("--concurrency", type=int, default=64, help="rollouts in flight")
    parser.add_argument("--pool", type=int, default=64, help="serve's --max-concurrent-envs")
    parser.add_argument("--every", type=int, default=1000, help="episodes between samples")
    parser.add_argument("--warm-up", type=int, default=1000,
                        help="episodes before the samples that count (1000)")
    parser.add_argument("--whole", action="store_true",
                        help="the slope over every sample after warm-up, not the second half")
    parser.add_argument("--sandbox", choices=("local", "docker"), default="local")
    parser.add_argument("--agentenv", default=str(ROOT / "agentenv.py"),
                        help="the agentenv.py to serve with (another copy is a baseline)")
    parser.add_argument("--json", help="write the result here (after every sample too)")
    parser.add_argument("--signal", metavar="NAME",
                        help="send the server this signal (USR1, say) at every sample, while it is "
                             "idle: for a profiler the server is wrapped in (see --agentenv)")
    parser.add_argument("--plot", help="plot RSS against episodes here (needs matplotlib)")
    parser.add_argument("--from", dest="results", nargs="+", metavar="JSON",
                        help="no run: plot (--plot) the results these --json files hold")
    args = parser.parse_args()
    if args.results:
        if not args.plot:
            parser.error("--from plots earlier results: give --plot too")
        plot([json.loads(Path(path).read_text()) for path in args.results], args.plot)
        return 0
    # Stopped early (a shell's job started with & ignores SIGINT), the run still stops its
    # server and keeps the samples written so far.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("soak.py: stopped by SIGTERM"))
    result = asyncio.run(soak(args))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.plot:
        plot([result], args.plot)
    return 0 if result["tallies"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
