"""baselines.py: play a split of GridSim through a running agentenv.py server with fixed policies.

    python agentenv.py serve bundles/gridsim-v1 --sandbox local --port 8765 --max-concurrent-envs 8
    python bundles/gridsim-v1/baselines.py --url ws://127.0.0.1:8765/ws --split eval --concurrency 8

Each episode goes over the OpenEnv WebSocket ``/ws`` as a trainer's would: ``reset`` to the task
(split, index), read the user message from the observation's ``metadata.prompt``, call
``submit_schedule`` once with the policy's schedule, then ``end_turn``, whose answer carries the
reward. The policies:

* ``idle``: 24 zeros (a valid schedule with profit 0: the score is 0.2 on every day).
* ``greedy``: a plain rule, not tuned: with n = the battery's duration in hours, charge at full power
  in the n cheapest hours and discharge at full power in the n dearest hours, each as far as the
  charge allows (no more than fills the battery, no more than it holds), and idle otherwise.
* ``optimal``: the exact optimum from battery.py's dynamic program (the score is 1.0 on every day).

It prints each policy's mean reward over the split. Needs aiohttp (agentenv.py's dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import tomllib
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "envs" / "gridsim"))
import battery  # noqa: E402


def _day(prompt: dict) -> tuple[battery.Battery, list[float]]:
    return battery.Battery.from_dict(prompt["battery"]), prompt["prices_usd_per_mwh"]


def idle(prompt: dict) -> list[int]:
    return [0] * battery.HOURS


def greedy(prompt: dict) -> list[int]:
    bat, prices = _day(prompt)
    n = bat.duration_h
    by_price = sorted(range(battery.HOURS), key=lambda h: prices[h])
    cheap, dear = set(by_price[:n]), set(by_price[-n:])
    charge, schedule = bat.initial_charge_mwh, []
    for hour in range(battery.HOURS):
        if hour in cheap:
            action = min(bat.power_mw, bat.capacity_mwh - charge)
        elif hour in dear:
            action = -min(bat.power_mw, charge)
        else:
            action = 0
        charge += action
        schedule.append(action)
    return schedule


def optimal(prompt: dict) -> list[int]:
    bat, prices = _day(prompt)
    return battery.optimum(battery.prices_cents(prices), bat)[1]


POLICIES = {"idle": idle, "greedy": greedy, "optimal": optimal}


class Trouble(Exception):
    pass


async def _send(ws: aiohttp.ClientWebSocketResponse, message: dict, timeout: float) -> dict:
    await ws.send_json(message)
    reply = await ws.receive_json(timeout=timeout)
    if reply.get("type") != "observation":
        raise Trouble(f"the server answered {reply}")
    data = reply["data"]
    meta = data.get("observation", {}).get("metadata") or {}
    if meta.get("status") == "error":
        raise Trouble(meta.get("error", "an error"))
    return data


async def play(ws: aiohttp.ClientWebSocketResponse, split: str, index: int, policy,
               timeout: float) -> float:
    """One episode: reset, submit the policy's schedule, end the turn; returns the reward."""
    data = await _send(ws, {"type": "reset", "data": {"split": split, "index": index}}, timeout)
    prompt = json.loads(data["observation"]["metadata"]["prompt"])
    schedule = policy(prompt)
    data = await _send(ws, {"type": "step", "data": {
        "type": "call_tool", "tool_name": "submit_schedule", "arguments": {"schedule": schedule}}},
        timeout)
    result = data["observation"].get("result") or {}
    if result.get("is_error"):
        raise Trouble(f"{prompt['task_id']}: submit_schedule refused the schedule: {result.get('data')}")
    data = await _send(ws, {"type": "step", "data": {
        "type": "call_tool", "tool_name": "end_turn", "arguments": {"response": "done"}}}, timeout)
    if not data.get("done") or data.get("reward") is None:
        raise Trouble(f"{prompt['task_id']}: the episode ended without a reward: {data}")
    return float(data["reward"])


async def run_policy(url: str, split: str, count: int, name: str, concurrency: int,
                     timeout: float) -> dict:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(count):
        queue.put_nowait(index)
    rewards: dict[int, float] = {}
    failures: list[str] = []

    async def worker(http: aiohttp.ClientSession) -> None:
        async with http.ws_connect(url, max_msg_size=16 * 2**20, heartbeat=20) as ws:
            while not queue.empty():
                index = queue.get_nowait()
                try:
                    rewards[index] = await play(ws, split, index, POLICIES[name], timeout)
                except (Trouble, asyncio.TimeoutError, KeyError, ValueError) as exc:
                    failures.append(f"{split}[{index}]: {type(exc).__name__}: {exc}")
            await ws.send_json({"type": "close"})

    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(worker(http) for _ in range(max(1, min(concurrency, count)))))
    values = [rewards[i] for i in sorted(rewards)]
    return {"policy": name, "split": split, "episodes": len(values), "failed": len(failures),
            "mean_reward": statistics.fmean(values) if values else None,
            "min": min(values, default=None), "max": max(values, default=None),
            "seconds": round(time.monotonic() - started, 1), "failures": failures[:5]}


def split_size(split: str) -> int:
    path = HERE / "evals" / f"{split}.toml"
    if split == "all":
        return len(list((HERE / "tasks").glob("*.json")))
    try:
        return len(tomllib.loads(path.read_text())["tasks"])
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"baselines.py: can't read the size of split {split!r} from {path} ({exc}); "
                         "pass --count") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/ws", help="the server's OpenEnv /ws")
    parser.add_argument("--split", default="eval", help="the split to play (default eval)")
    parser.add_argument("--count", type=int, default=None,
                        help="play indexes 0..count-1 (default: the whole split, from evals/)")
    parser.add_argument("--policies", default="idle,greedy,optimal",
                        help=f"comma-separated, from {', '.join(POLICIES)}")
    parser.add_argument("--concurrency", type=int, default=8, help="connections at once (8)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per message (120)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if unknown := [n for n in names if n not in POLICIES]:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    count = args.count if args.count is not None else split_size(args.split)
    failed = False
    for name in names:
        report = asyncio.run(run_policy(args.url, args.split, count, name, args.concurrency,
                                        args.timeout))
        mean = report["mean_reward"]
        shown = "none" if mean is None else f"{mean:.4f} ({mean!r})"
        spread = "" if mean is None else f"min {report['min']:.4f}, max {report['max']:.4f}, "
        print(f"{name:8s} mean reward {shown} over {report['episodes']} {args.split} episodes "
              f"({spread}{report['failed']} failed, {report['seconds']}s)", flush=True)
        for line in report["failures"]:
            print(f"  failed: {line}", flush=True)
        failed = failed or bool(report["failed"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
