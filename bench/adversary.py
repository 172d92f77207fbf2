"""adversary.py: what the guards against a hostile model cost, and how well a sibling is served.

    python bench/adversary.py [--samples 20] [--hostile 8] [--json bench/adversary.json]

In-process, on ``bundles/pyfix-v1`` in Docker boxes (a daemon must answer), it measures:

1. *A turn's end*: the time the runtime takes to stop every process of the agent's in its box
   (the keeper's kill(-1), then ``docker top`` to confirm), with nothing left running and with a
   background job left running; beside it, one ``bash`` call of ``true`` in the same box, the cost
   of the cheapest thing a model does.
2. *A command past its deadline* (``bash_timeout`` 2 s), for each way of evading a kill: how long
   after the deadline the model's answer comes, and that nothing of the agent's is left.
3. *A sibling beside hostile episodes*: one episode's bash calls (``true``) timed with no other
   episode live, then while ``--hostile`` episodes each run a command that outlives its 20 s
   deadline (half ``sleep 120``, half ``exec env -u AGENTENV_CALL sleep 100000``), measured in the
   same run, interleaved so a change in the machine's load favours neither.

Medians, p90s and maxima, with the ratio to the baseline measured in the same run. The JSON keeps
every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agentenv  # noqa: E402

PYFIX = ROOT / "bundles" / "pyfix-v1"
EVADERS = {
    "plain sleep": "sleep 1000",
    "setsid": "setsid nohup sleep 1000 >/dev/null 2>&1 & sleep 1000",
    "cleared environment, exec": "exec env -u AGENTENV_CALL sleep 100000",
    "ignored signals": "trap '' TERM INT HUP QUIT; sleep 1000",
    "double fork": "(setsid sh -c 'sleep 1000 & sleep 1000' &); sleep 1000",
    "fork bomb": ":(){ :|:& };: ; sleep 1000",
}


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"n": len(ordered), "p50": statistics.median(ordered),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "max": ordered[-1]}


def ms(value: float) -> str:
    return f"{value * 1000:.1f} ms"


async def timed(coro) -> float:
    started = time.monotonic()
    await coro
    return time.monotonic() - started


async def turn_ends(runtime, task, samples: int) -> dict:
    """stop_all with nothing running, and with a background job; a bash ``true`` beside them."""
    episode = runtime.episode(task)
    turn = await episode.next_turn()
    box = episode.agent_box
    empty, busy, call = [], [], []
    for _ in range(samples):
        call.append(await timed(turn.call("bash", {"command": "true"})))
        empty.append(await timed(box.stop_all()))
        await turn.call("bash", {"command": "setsid nohup sleep 1000 >/dev/null 2>&1 &"})
        busy.append(await timed(box.stop_all()))
        assert not await box._agents_processes()
    await episode.abandon("measured")
    return {"stop_all, nothing running": empty, "stop_all, a background job": busy,
            "bash true": call}


async def deadlines(runtime, task) -> dict:
    episode = runtime.episode(task)
    turn = await episode.next_turn()
    box = episode.agent_box
    late = {}
    for name, command in EVADERS.items():
        started = time.monotonic()
        said = await turn.call("bash", {"command": command})
        late[name] = time.monotonic() - started - runtime.settings.bash_timeout
        assert said.text.startswith("error: the command timed out"), said
        assert not await box._agents_processes(), name
    await episode.abandon("measured")
    return late


async def sibling(runtime, task, hostile: int, samples: int) -> dict:
    """A sibling's bash calls, alone and beside ``hostile`` stalling episodes, interleaved."""
    me = runtime.episode(task)
    turn = await me.next_turn()
    alone, crowded = [], []
    for _ in range(2):                                   # two rounds: alone, crowded, alone, crowded
        for _ in range(samples // 2):
            alone.append(await timed(turn.call("bash", {"command": "true"})))
        others = [runtime.episode(task) for _ in range(hostile)]
        turns = [await e.next_turn() for e in others]
        stalls = [asyncio.ensure_future(t.call("bash", {"command": "sleep 120" if n % 2 else
                                                        EVADERS["cleared environment, exec"]}))
                  for n, t in enumerate(turns)]
        await asyncio.sleep(1)                           # every one of them mid-command
        for _ in range(samples // 2):
            crowded.append(await timed(turn.call("bash", {"command": "true"})))
        await asyncio.gather(*stalls)
        await asyncio.gather(*(e.abandon("measured") for e in others))
    await me.abandon("measured")
    return {"alone": alone, "beside hostile": crowded}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--hostile", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bundle = agentenv.Bundle.load(PYFIX)
    task = bundle.tasks["bsearch"]
    out: dict = {"command": "python bench/adversary.py " + " ".join(sys.argv[1:])}
    async with agentenv.Runtime(bundle, agentenv.Settings.of(
            sandbox="docker", bash_timeout=2, max_concurrent_envs=args.hostile + 2)) as runtime:
        out["turn_end"] = await turn_ends(runtime, task, args.samples)
        out["past_the_deadline"] = await deadlines(runtime, task)
    async with agentenv.Runtime(bundle, agentenv.Settings.of(
            sandbox="docker", bash_timeout=20, max_concurrent_envs=args.hostile + 2)) as runtime:
        out["sibling"] = await sibling(runtime, task, args.hostile, args.samples)
    print("1. a turn's end (the agent's processes stopped and confirmed), beside a bash `true`:")
    for name, samples in out["turn_end"].items():
        s = summary(samples)
        print(f"   {name:<28} p50 {ms(s['p50'])}, p90 {ms(s['p90'])}, max {ms(s['max'])}")
    print("2. a command past its 2 s deadline: answered this long after it (nothing left running):")
    for name, late in out["past_the_deadline"].items():
        print(f"   {name:<28} {ms(late)}")
    alone, crowded = (summary(out["sibling"][k]) for k in ("alone", "beside hostile"))
    print(f"3. a sibling's bash `true`: alone p50 {ms(alone['p50'])} (p90 {ms(alone['p90'])}); beside "
          f"{args.hostile} hostile episodes p50 {ms(crowded['p50'])} (p90 {ms(crowded['p90'])}, max "
          f"{ms(crowded['max'])}): {crowded['p50'] / alone['p50']:.2f}x at p50")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
