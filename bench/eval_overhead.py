"""eval_overhead.py: ``agentenv.py eval``'s overhead per rollout, beside NeMo Gym's ``gym eval run`` on
the same rows and the same scripted model, in the same run.

    python bench/eval_overhead.py [--rows 12] [--json bench/eval-overhead.json]

The rows are the first --rows eval days of bundles/gridsim-v1 as ``write-gym`` writes them (the
local sandbox); the model is tests/gym/fake_model.py, scripted to submit each day's exact optimum
and then reply (so every rollout scores 1.0, checked), answering at once. Both sides play one
rollout at a time (concurrency 1), and both are measured the same way, from the model's side: the
span from the first model request's arrival to the last reply, minus the time the model spent on
its replies, over the rollouts. What is left is everything a rollout costs but the model: the
seed and its deploy, the tool calls, the verify, and the harness between rollouts.

* ours: ``python agentenv.py eval bundles/gridsim-v1 --split eval --limit N --concurrency 1
  --api responses --sandbox local`` (a subprocess; the bundle served in-process), run before and
  after Gym's to show the machine's drift; also the mean of each rollout's own ``seconds -
  model_seconds`` from its rollouts.jsonl;
* Gym: the written resources server under ``gym env start`` (head server, Ray, simple_agent,
  legacy_agent, openai_model pointed at the fake) and ``gym eval run --no-serve --concurrency 1``,
  through tests/gym/harness.py's run_cli (in a loopback-only network namespace: it needs root and
  the Gym venv, ``bash .ci/gym-venv.sh``); also ``gym eval run``'s whole wall time over the rows.

About three minutes on a 2-core machine, most of it Gym's start.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRIDSIM = ROOT / "bundles" / "gridsim-v1"
for path in (ROOT, GRIDSIM / "envs" / "gridsim"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import battery  # noqa: E402
from tests.gym import fake_model, harness  # noqa: E402
from tests.harness import environ, read_jsonl, write_jsonl  # noqa: E402


def optimal_script(row: dict) -> list[dict]:
    user = next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")
    day = json.loads(user)
    _, plan = battery.optimum(battery.prices_cents(day["prices_usd_per_mwh"]),
                              battery.Battery.from_dict(day["battery"]))
    return [{"tool": "submit_schedule", "args": {"schedule": plan}}, {"text": "Submitted."}]


def model_side(served: list[tuple[str, float, float]], rollouts: int) -> dict:
    """The span of the model's requests minus its own time, per rollout, in ms."""
    replies = [(began, seconds) for path, began, seconds in served if path.endswith("/responses")]
    span = max(b + s for b, s in replies) - min(b for b, _ in replies)
    model = sum(s for _, s in replies)
    return {"model_calls": len(replies), "span_s": round(span, 3), "model_s": round(model, 3),
            "overhead_ms_per_rollout": round(1000 * (span - model) / rollouts, 1)}


def ours(rows: list[dict], scripts: dict, work: Path, n: int, tag: str) -> dict:
    out = work / f"ours-{tag}.jsonl"
    with fake_model.start(scripts=scripts) as model:
        argv = [sys.executable, str(ROOT / "agentenv.py"), "eval", str(GRIDSIM), "--split", "eval",
                "--limit", str(n), "--concurrency", "1", "--api", "responses", "--sandbox", "local",
                "--model-url", model.base_url, "--model", "fake", "--output", str(out)]
        started = time.monotonic()
        proc = subprocess.run(argv, cwd=ROOT, env=environ(work / "state"), capture_output=True,
                              text=True, timeout=600)
        wall = time.monotonic() - started
        served = list(model.served)
    if proc.returncode != 0:
        sys.exit(f"eval failed:\n{proc.stdout}\n{proc.stderr}")
    lines = read_jsonl(out)
    assert len(lines) == n and all(line["reward"] == 1.0 for line in lines), \
        [line.get("reward") for line in lines]
    own = [line["timings"]["seconds"] - line["timings"]["model_seconds"] for line in lines]
    return {**model_side(served, n), "command_wall_s": round(wall, 2),
            "own_timings_ms_per_rollout": round(1000 * sum(own) / n, 1)}


def gym(rows: list[dict], root: Path, name: str, work: Path, n: int) -> dict:
    jsonl = write_jsonl(work / "gym-input.jsonl", rows)
    run = harness.run_cli(root, name, jsonl, work_dir=work / "gym-cli", concurrency=1)
    assert len(run.rollouts) == n and all(r["reward"] == 1.0 for r in run.rollouts), \
        [r.get("reward") for r in run.rollouts]
    assert run.leftovers == [], run.leftovers
    return {**model_side(run.model_served, n), "eval_run_wall_s": round(run.timings["eval"], 2),
            "env_start_ready_s": round(run.timings["ready"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=12, help="eval days played by each side (12)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    problem = harness.gym_venv_problem()
    if problem:
        sys.exit(problem)
    with tempfile.TemporaryDirectory(prefix="eval-overhead-") as tmp:
        work = Path(tmp)
        written = subprocess.run([sys.executable, str(ROOT / "agentenv.py"), "write-gym", str(GRIDSIM),
                                  str(work / "root"), "--sandbox", "local", "--max-concurrent-envs", "4"],
                                 cwd=ROOT, env=environ(work / "state"), capture_output=True, text=True,
                                 timeout=300)
        if written.returncode != 0:
            sys.exit(written.stderr)
        server = Path(written.stdout.strip().splitlines()[-1].removeprefix("wrote "))
        rows = read_jsonl(server / "data" / "eval.jsonl")[:args.rows]
        scripts = {}
        for row in rows:
            script = optimal_script(row)
            scripts[row["responses_create_params"]["input"][-1]["content"]] = script
            row["responses_create_params"]["metadata"] = {"script": json.dumps(script)}
        figures = {"rows": args.rows, "concurrency": 1}
        figures["ours_before"] = ours(rows, scripts, work, args.rows, "before")
        figures["gym"] = gym(rows, server.parents[1], server.name, work, args.rows)
        figures["ours_after"] = ours(rows, scripts, work, args.rows, "after")
    mine = [figures[k]["overhead_ms_per_rollout"] for k in ("ours_before", "ours_after")]
    theirs = figures["gym"]["overhead_ms_per_rollout"]
    figures["ratio_gym_over_ours"] = round(theirs / (sum(mine) / 2), 2)
    print("| per rollout (gridsim-v1, local sandbox, concurrency 1) | agentenv.py eval | gym eval run |")
    print("|---|---|---|")
    print(f"| overhead: model-side span minus the model's time | {mine[0]:.0f} / {mine[1]:.0f} ms "
          f"(before / after) | {theirs:.0f} ms |")
    print(f"| the command's wall time over {args.rows} rollouts | "
          f"{figures['ours_before']['command_wall_s']:.1f} / {figures['ours_after']['command_wall_s']:.1f} s "
          f"| {figures['gym']['eval_run_wall_s']:.1f} s (after gym env start, ready in "
          f"{figures['gym']['env_start_ready_s']:.0f} s) |")
    print(f"| eval's own timings: seconds - model_seconds | "
          f"{figures['ours_before']['own_timings_ms_per_rollout']:.0f} / "
          f"{figures['ours_after']['own_timings_ms_per_rollout']:.0f} ms | |")
    print(f"Gym's overhead / ours: {figures['ratio_gym_over_ours']}x")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
