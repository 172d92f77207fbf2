"""baseline.py: pyfix-v1's honest baseline, played in-process with agentenv.py's runtime.

Two scripted players, each on every task of a split: ``nothing`` ends its turn at once (the
reward is 0: the bug is still there), and ``reference`` writes the reference fix over the module
with one bash call, runs the tests, then ends its turn (the reward is 1).

    python bundles/pyfix-v1/baseline.py [--split eval] [--sandbox docker]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))          # this checkout's agentenv.py

import agentenv  # noqa: E402


async def play(runtime: agentenv.Runtime, task: agentenv.Task, player: str) -> float | None:
    episode = runtime.episode(task)
    try:
        turn = await episode.next_turn()
        if player == "reference":
            fixed = (HERE / "reference" / f"{task.name}.py").read_text()
            write = f"cat > {task.name}.py <<'AGENTENV_EOF'\n{fixed}AGENTENV_EOF\n"
            await turn.call("bash", {"command": write}, 60)
            await turn.call("bash", {"command": "python3 -m unittest discover -s tests"}, 60)
        turn.end("Done.")
        outcome = await episode.result()
        return outcome.reward
    finally:
        await episode.abandon("the baseline is done")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="all")
    parser.add_argument("--sandbox", default="auto", choices=sorted(agentenv.PROVIDERS))
    args = parser.parse_args()
    bundle = agentenv.Bundle.load(HERE)
    async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox=args.sandbox, max_concurrent_envs=4)) as runtime:
        for player in ("nothing", "reference"):
            started = time.monotonic()
            rewards = await asyncio.gather(*(play(runtime, t, player)
                                             for t in bundle.splits[args.split]))
            scored = [r for r in rewards if r is not None]
            print(f"{player:>9}: mean reward {sum(scored) / max(1, len(scored)):.3f} over "
                  f"{len(scored)} of {len(rewards)} tasks ({args.split}, {runtime.sandbox.kind} "
                  f"sandbox), {time.monotonic() - started:.1f}s")


if __name__ == "__main__":
    asyncio.run(main())
