"""eval_overhead.py: ``agentenv.py eval``'s overhead per rollout, beside NeMo Gym's ``gym eval run`` on
the same rows and the same scripted model, in the same run.

    python bench/eval_overhead.py [--rows 12] [--json bench/eval-overhead.json]

Two sets of rows, as ``write-gym`` writes them (the local sandbox): ``gridsim``, the first --rows
eval days of bundles/gridsim-v1 (an env deployed per rollout, one tool call), and ``quiz``, the one
task of bench/bundles/quiz-v1 (no env: a prompt and a verifier of the reply) --rows times: there
what is measured is the harness alone. The model is tests/gym/fake_model.py, scripted to submit
each day's exact optimum and then reply, or to answer the quiz (so every rollout scores 1.0,
checked), answering at once. Both sides play one rollout at a time (concurrency 1), and both are
measured the same way, from the model's side: the span from a set's first model request to its
last reply, minus the time the model spent on its replies, over the set's rollouts. What is left
is everything a rollout costs but the model: the seed and its deploy, the tool calls, the verify,
and the harness between rollouts.

* ours: ``python agentenv.py eval bundles/gridsim-v1 --split eval --limit N --concurrency 1
  --api responses --sandbox local`` and ``python agentenv.py eval bench/bundles/quiz-v1 --split
  all --repeats N ...`` (subprocesses; the bundle served in-process), run before and after Gym's
  to show the machine's drift; also the mean of each rollout's own ``seconds - model_seconds``
  from its rollouts.jsonl;
* Gym: both written resources servers under one ``gym env start`` (head server, Ray, simple_agent,
  legacy_agent, openai_model pointed at the fake) and all the rows in one ``gym eval run --no-serve
  --concurrency 1``, through tests/gym/harness.py's run_cli (in a loopback-only network namespace:
  it needs root and the Gym venv, ``bash .ci/gym-venv.sh``); also ``gym eval run``'s whole wall
  time over the rows.

About four minutes on a 2-core machine, most of it Gym's start.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
GRIDSIM = ROOT / "bundles" / "gridsim-v1"
QUIZ = ROOT / "bench" / "bundles" / "quiz-v1"
QUIZ_SCRIPT = [{"text": "42"}]
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
    """The span of the model's replies minus its own time, per rollout, in ms."""
    replies = [(began, seconds) for path, began, seconds in served]
    span = max(b + s for b, s in replies) - min(b for b, _ in replies)
    model = sum(s for _, s in replies)
    return {"model_calls": len(replies), "span_s": round(span, 3), "model_s": round(model, 3),
            "overhead_ms_per_rollout": round(1000 * (span - model) / rollouts, 1)}


def replies(served: list, requests: list, user_text: Callable[[str], bool]) -> list:
    """The model's replies to the requests of one set of rows (one at a time: in order)."""
    asked = [body for path, body in requests if path.endswith("/responses")]
    return [s for s, body in zip([s for s in served if s[0].endswith("/responses")], asked)
            if user_text(fake_model.first_user_text(body) or "")]


def ours(bundle: Path, scripts: dict, work: Path, n: int, tag: str) -> dict:
    out = work / f"ours-{bundle.name}-{tag}.jsonl"
    rows = ["--split", "eval", "--limit", str(n)] if bundle == GRIDSIM else \
        ["--split", "all", "--repeats", str(n)]
    with fake_model.start(scripts=scripts) as model:
        argv = [sys.executable, str(ROOT / "agentenv.py"), "eval", str(bundle), *rows,
                "--concurrency", "1", "--api", "responses", "--sandbox", "local",
                "--model-url", model.base_url, "--model", "fake", "--output", str(out)]
        started = time.monotonic()
        proc = subprocess.run(argv, cwd=ROOT, env=environ(work / "state"), capture_output=True,
                              text=True, timeout=600)
        wall = time.monotonic() - started
        served = [s for s in model.served if s[0].endswith("/responses")]     # --api given: no probe
    if proc.returncode != 0:
        sys.exit(f"eval failed:\n{proc.stdout}\n{proc.stderr}")
    lines = read_jsonl(out)
    assert len(lines) == n and all(line["reward"] == 1.0 for line in lines), \
        [line.get("reward") for line in lines]
    own = [line["timings"]["seconds"] - line["timings"]["model_seconds"] for line in lines]
    return {**model_side(served, n), "command_wall_s": round(wall, 2),
            "own_timings_ms_per_rollout": round(1000 * sum(own) / n, 1)}


def gym(rows: list[dict], servers: list[Path], quiz: str, work: Path, n: int) -> dict:
    jsonl = write_jsonl(work / "gym-input.jsonl", rows)
    (first, *more) = [(s.parents[1], s.name) for s in servers]
    run = harness.run_cli(*first, jsonl, work_dir=work / "gym-cli", concurrency=1, more_servers=more)
    assert len(run.rollouts) == 2 * n and all(r["reward"] == 1.0 for r in run.rollouts), \
        [r.get("reward") for r in run.rollouts]
    assert run.leftovers == [], run.leftovers
    figures = {name: model_side(replies(run.model_served, run.model_requests, pick), n)
               for name, pick in (("gridsim", lambda text: text != quiz), ("quiz", lambda text: text == quiz))}
    return {**figures, "eval_run_wall_s": round(run.timings["eval"], 2),
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
        servers = []
        for bundle in (GRIDSIM, QUIZ):
            written = subprocess.run([sys.executable, str(ROOT / "agentenv.py"), "write-gym", str(bundle),
                                      str(work / f"root-{bundle.name}"), "--sandbox", "local",
                                      "--max-concurrent-envs", "4"],
                                     cwd=ROOT, env=environ(work / "state"), capture_output=True, text=True,
                                     timeout=300)
            if written.returncode != 0:
                sys.exit(written.stderr)
            servers.append(Path(written.stdout.strip().splitlines()[-1].removeprefix("wrote ")))
        rows = read_jsonl(servers[0] / "data" / "eval.jsonl")[:args.rows]
        scripts = {}
        for row in rows:
            script = optimal_script(row)
            scripts[row["responses_create_params"]["input"][-1]["content"]] = script
            row["responses_create_params"]["metadata"] = {"script": json.dumps(script)}
        quiz_row = read_jsonl(servers[1] / "data" / "all.jsonl")[0]
        quiz = quiz_row["responses_create_params"]["input"][-1]["content"]
        quiz_row["responses_create_params"]["metadata"] = {"script": json.dumps(QUIZ_SCRIPT)}
        figures: dict = {"rows": args.rows, "concurrency": 1}
        for tag in ("before", "after"):
            if tag == "after":
                figures["gym"] = gym(rows + [quiz_row] * args.rows, servers, quiz, work, args.rows)
            for bundle, given in ((GRIDSIM, scripts), (QUIZ, {quiz: QUIZ_SCRIPT})):
                figures[f"ours_{bundle.name}_{tag}"] = ours(bundle, given, work, args.rows, tag)
    print("| per rollout, one at a time, local sandbox | agentenv.py eval (before / after) | gym eval run "
          "| Gym / ours |")
    print("|---|---|---|---|")
    for part, bundle in (("gridsim", GRIDSIM), ("quiz", QUIZ)):
        mine = [figures[f"ours_{bundle.name}_{t}"]["overhead_ms_per_rollout"] for t in ("before", "after")]
        theirs = figures["gym"][part]["overhead_ms_per_rollout"]
        figures[f"ratio_{part}"] = round(theirs / (sum(mine) / 2), 2)
        own = [figures[f"ours_{bundle.name}_{t}"]["own_timings_ms_per_rollout"] for t in ("before", "after")]
        print(f"| {bundle.name}: overhead (model-side span minus the model's time) | {mine[0]:.0f} / "
              f"{mine[1]:.0f} ms (its own timings: {own[0]:.0f} / {own[1]:.0f} ms) | {theirs:.0f} ms "
              f"| {figures[f'ratio_{part}']}x |")
    walls = [figures[f"ours_{b.name}_{t}"]["command_wall_s"] for t in ("before", "after") for b in (GRIDSIM, QUIZ)]
    print(f"| the commands' wall time over all {2 * args.rows} rollouts | {walls[0] + walls[1]:.1f} / "
          f"{walls[2] + walls[3]:.1f} s | {figures['gym']['eval_run_wall_s']:.1f} s, after gym env start "
          f"was ready in {figures['gym']['env_start_ready_s']:.0f} s | |")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
