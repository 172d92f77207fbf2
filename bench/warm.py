"""warm.py: how much faster a start is with a warm pool, and that it is never slower without one.

    python bench/warm.py [--sandbox docker|local] [--warm 4] [--samples 15]
                         [--rates 0.5,1,2,4] [--per-rate 12] [--json out.json] [--plot out.png]
    python bench/warm.py --from bench/warm.json --plot bench/warm.png     # plot it again

In one run it starts ``agentenv.py serve bundles/notes-v1`` twice, cold (no pool) and with
``--warm N``, both with ``--max-concurrent-envs 8``, both up at once and measured in turn, round by
round (the machine is shared: interleaving keeps a change in its load from favouring either):

1. *Ahead of demand*: ``--samples`` starts one at a time, each once the pool is full again (the
   cold server: once it is idle), so every warm start finds a ready env. Two starts are timed:
   OpenEnv, a /ws ``reset`` until its observation (the first prompt) arrives; and Gym, a
   ``/seed_session`` until the first tool call's answer (list_notes). The p50 of each, warm against
   cold; the issue's target is warm at most a tenth of cold.
2. *Against arrival rate*: OpenEnv resets arriving as a Poisson process at each of ``--rates`` per
   second, ``--per-rate`` of them, each episode ended (its socket closed) as soon as its first
   prompt arrives. The p50 and p90 reset latency per rate: past the rate the pool refills at,
   demand is above the pool, and warm must be no slower than cold.

Nothing is left running: each server is stopped with SIGINT, and the Docker sandbox removes
what it started (its containers, warm ones too, and its network).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import COOKIE, NOTES, ROOT, Served, gym_row  # noqa: E402

SAVE = 1                                  # save-groceries, in the split "all"


class WarmServed(Served):
    """serve as soak.py starts it, with a warm pool of ``warm`` envs."""

    def __init__(self, sandbox: str, state: Path, warm: int):
        self.warm = warm
        super().__init__(ROOT / "agentenv.py", 8, sandbox, state, ("--warm", str(warm)))

    async def health(self, http: aiohttp.ClientSession) -> dict:
        async with http.get(self.url + "/health") as resp:
            return await resp.json()

    async def settled(self, http: aiohttp.ClientSession, timeout: float = 120) -> None:
        """Wait until no episode is live and the pool (if any) is full and booting nothing."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = await self.health(http)
            warm = health.get("warm", {"ready": 0, "booting": 0, "target": 0})
            if health.get("episodes") == 0 and warm["ready"] == warm["target"] and \
                    not warm["booting"]:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"the server did not settle within {timeout}s: {health}")


async def reset_time(http: aiohttp.ClientSession, url: str) -> float:
    """Seconds from a /ws reset to its first prompt (a reset the server refuses at capacity is
    retried, as OpenEnv's clients do, and the wait counts); the episode is ended at once after."""
    started, delay = time.monotonic(), 0.05
    while True:
        ws = await http.ws_connect(url.replace("http://", "ws://") + "/ws", max_msg_size=2**24)
        try:
            await ws.send_json({"type": "reset", "data": {"split": "all", "index": SAVE}})
            reply = await ws.receive_json(timeout=300)
            took = time.monotonic() - started
        finally:
            await ws.close()
        if reply["type"] == "error" and reply["data"].get("code") == "CAPACITY_REACHED":
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        if reply["type"] != "observation" or reply["data"]["done"]:
            raise RuntimeError(f"the reset failed: {reply}")
        return took


async def seed_time(http: aiohttp.ClientSession, url: str, row: dict) -> float:
    """Seconds from a Gym /seed_session to its first tool's answer; the session closed after."""
    started = time.monotonic()
    async with http.post(url + "/seed_session", json=row) as resp:
        assert resp.status == 200, await resp.text()
        cookies = {COOKIE: resp.cookies[COOKIE].value}
    async with http.post(url + "/list_notes", json={}, cookies=cookies) as resp:
        answer = await resp.text()
    took = time.monotonic() - started
    assert answer == "(no notes)", answer
    async with http.post(url + "/close_session", json={}, cookies=cookies) as resp:
        await resp.read()
    return took


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def rate_run(http: aiohttp.ClientSession, served: WarmServed, rate: float, count: int,
                   seed: int) -> list[float]:
    """``count`` resets arriving as a Poisson process of ``rate`` per second: their latencies."""
    await served.settled(http)
    rng, tasks = random.Random(seed), []
    for _ in range(count):
        tasks.append(asyncio.create_task(reset_time(http, served.url)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def measure(args: argparse.Namespace) -> list[dict]:
    """Both servers up at once, the cold one and the warm one, measured in turn, round by round
    (the machine is shared: interleaving keeps a change in its load from favouring either)."""
    servers = [WarmServed(args.sandbox, Path(tempfile.mkdtemp(prefix="agentenv-warm-")), warm)
               for warm in (0, args.warm)]
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 cookie_jar=aiohttp.DummyCookieJar(),
                                 timeout=aiohttp.ClientTimeout(total=600))
    results: list[dict] = [{"warm": s.warm, "reset_s": [], "seed_s": [], "rates": {}}
                           for s in servers]
    try:
        for served in servers:
            await served.wait_up()
        row = gym_row()
        for _ in range(args.samples):
            for served, result in zip(servers, results):
                await served.settled(http)
                result["reset_s"].append(await reset_time(http, served.url))
                await served.settled(http)
                result["seed_s"].append(await seed_time(http, served.url, row))
        for result in results:
            result["reset_p50"] = statistics.median(result["reset_s"])
            result["seed_p50"] = statistics.median(result["seed_s"])
        for n, rate in enumerate(args.rates):
            for served, result in zip(servers, results):
                times = await rate_run(http, served, rate, args.per_rate, seed=n)
                result["rates"][str(rate)] = {"p50": statistics.median(times),
                                              "p90": quantile(times, 0.9), "s": times}
                print(f"  warm={served.warm} rate {rate}/s: p50 {statistics.median(times):.3f}s "
                      f"p90 {quantile(times, 0.9):.3f}s", flush=True)
    finally:
        await http.close()
        for served in servers:
            served.stop()
    return results


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: pip install --target /tmp/mpl matplotlib, then PYTHONPATH=/tmp/mpl",
              file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for result, color in zip(results, ("tab:blue", "tab:green")):
        rates = [float(r) for r in result["rates"]]
        label = f"--warm {result['warm']}" if result["warm"] else "cold (no pool)"
        ax.plot(rates, [v["p50"] for v in result["rates"].values()], "o-", color=color,
                label=label + ", p50")
        ax.plot(rates, [v["p90"] for v in result["rates"].values()], "o--", color=color,
                alpha=0.45, label=label + ", p90")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("OpenEnv resets arriving per second (Poisson)")
    ax.set_ylabel("reset to first prompt (s)")
    ax.set_title("notes-v1, Docker sandbox, 2 cores: reset latency against arrival rate")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sandbox", default="docker", choices=("docker", "local"))
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--rates", default="0.5,1,2,4")
    parser.add_argument("--per-rate", type=int, default=12)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--from", dest="source", default=None, metavar="JSON",
                        help="plot an earlier run's --json instead of measuring")
    args = parser.parse_args()
    if args.source:
        plot(json.loads(Path(args.source).read_text())["runs"], args.plot or "bench/warm.png")
        return
    args.rates = [float(r) for r in args.rates.split(",")]
    print(f"serve {NOTES.name} --sandbox {args.sandbox}, and the same with --warm {args.warm}",
          flush=True)
    results = await measure(args)
    cold, warm = results
    summary = {"sandbox": args.sandbox, "warm": args.warm,
               "reset_p50": {"cold": cold["reset_p50"], "warm": warm["reset_p50"],
                             "ratio": warm["reset_p50"] / cold["reset_p50"]},
               "seed_first_tool_p50": {"cold": cold["seed_p50"], "warm": warm["seed_p50"],
                                       "ratio": warm["seed_p50"] / cold["seed_p50"]},
               "runs": results}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    asyncio.run(main())
