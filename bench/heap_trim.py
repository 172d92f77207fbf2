"""heap_trim.py: what serve's heap trim (HeapTrim: malloc_trim(0) once the pool has drained) costs
and gives back, in waves of notes-v1 episodes played in one process, each wave drained.

    python bench/heap_trim.py [--waves 6] [--per-wave 48]

Each wave plays ``--per-wave`` episodes at once on the local sandbox (write a note, end the turn,
score), waits until the runtime's trim after the drain has run, and prints how long it took (in
its worker thread), what it gave back and the RSS after. The result is the median and the worst.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import agentenv  # noqa: E402


async def waves(count: int, per_wave: int) -> list[float]:
    bundle = agentenv.Bundle.load(ROOT / "bundles" / "notes-v1")
    task = bundle.tasks["save-groceries"]
    took = []
    async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="local", max_concurrent_envs=per_wave)) as runtime:
        heap = runtime.heap

        async def one(n: int) -> None:
            episode = runtime.episode(task)
            turn = await episode.next_turn()
            await turn.call("write_note", {"title": "groceries", "text": f"eggs and milk {n}"})
            turn.end("Saved.")
            await episode.result()
            await episode.closed.wait()

        for wave in range(count):
            trims, took_s, returned = heap.trims, heap.took_s, heap.returned_mib
            await asyncio.gather(*(one(wave * per_wave + i) for i in range(per_wave)))
            while heap.trims == trims:          # the trim comes heap.quiet seconds after the drain
                await asyncio.sleep(0.1)
            took.append((heap.took_s - took_s) * 1000)
            print(f"wave {wave}: the trim took {took[-1]:.2f} ms and gave back "
                  f"{heap.returned_mib - returned:.2f} MiB; RSS {agentenv.resident_mib():.1f} MiB",
                  flush=True)
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waves", type=int, default=6)
    parser.add_argument("--per-wave", type=int, default=48)
    args = parser.parse_args()
    took = asyncio.run(waves(args.waves, args.per_wave))
    print(f"heap trim: median {statistics.median(took):.2f} ms, worst {max(took):.2f} ms over "
          f"{len(took)} drains")
    return 0


if __name__ == "__main__":
    sys.exit(main())
