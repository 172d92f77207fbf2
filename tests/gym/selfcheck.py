"""Prove the Gym harness against the stand-in resources server (tests/gym/standin), both variants.

    python -m tests.gym.selfcheck [--variant lightest|cli|both] [--keep DIR]

(run from the repository root, after ``bash .ci/gym-venv.sh``). Each variant must return a
rollout with reward 1.0 for a row whose script calls ``add`` and then answers in text, and must
leave no process behind. Prints the timings and the command lines used; exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tests.gym import harness

NAME = "standin"
ADD_TOOL = {"type": "function", "name": "add", "description": "Add two numbers.", "strict": True,
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                           "required": ["a", "b"], "additionalProperties": False}}


def rows() -> list[dict]:
    good = harness.scripted_row([{"tool": "add", "args": {"a": 2, "b": 3}}, {"text": "The sum is 5."}],
                                "What is 2 + 3? Use the add tool.", tools=[ADD_TOOL],
                                agent=f"{NAME}_simple_agent", expected_sum=5, case="add_then_text")
    no_tool = harness.scripted_row([{"text": "It is 7."}], "What is 3 + 4? Use the add tool.",
                                   tools=[ADD_TOOL], agent=f"{NAME}_simple_agent", expected_sum=7,
                                   case="text_only")
    return [good, no_tool]


def check_rollout(rollout: dict, where: str) -> list[str]:
    problems = []
    case = rollout.get("case")
    want = {"add_then_text": 1.0, "text_only": 0.0}.get(case)
    if rollout.get("reward") != want:
        problems.append(f"{where}: case {case}: reward {rollout.get('reward')!r}, want {want}")
    kinds = [item.get("type") for item in rollout.get("response", {}).get("output", [])]
    if case == "add_then_text" and kinds != ["function_call", "function_call_output", "message"]:
        problems.append(f"{where}: case {case}: trajectory {kinds}")
    if case == "add_then_text" and not rollout.get("standin_session_seen"):
        problems.append(f"{where}: the seed cookie did not reach /verify")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=("lightest", "cli", "both"), default="both")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = parser.parse_args()
    problem = harness.gym_venv_problem()
    if problem:
        print(problem)
        return 2
    base = args.keep or Path(tempfile.mkdtemp(prefix="agentenv-gym-selfcheck-"))
    root = base / "gym_root"
    harness.prepare_root(root, NAME, harness.STANDIN_DIR, rows=rows())
    jsonl = root / "resources_servers" / NAME / "data" / "example.jsonl"
    problems: list[str] = []

    if args.variant in ("lightest", "both"):
        t = time.monotonic()
        run = harness.run_lightest(root, NAME, rows(), work_dir=base / "lightest")
        print(f"[lightest] {time.monotonic() - t:.1f}s  timings {fmt(run.timings)}")
        for line in run.commands:
            print(f"[lightest]   $ {line}")
        for result in run.results:
            print(f"[lightest]   case {result.get('case')}: reward {result.get('reward')}")
            problems += check_rollout(result, "lightest")
        if run.leftovers:
            problems.append(f"lightest: leftovers {run.leftovers}")

    if args.variant in ("cli", "both"):
        t = time.monotonic()
        run = harness.run_cli(root, NAME, jsonl, work_dir=base / "cli")
        print(f"[cli] {time.monotonic() - t:.1f}s  timings {fmt(run.timings)}  "
              f"gym env start exit {run.start_exit_code}")
        for line in run.commands:
            print(f"[cli]   $ {line}")
        for rollout in run.rollouts:
            print(f"[cli]   case {rollout.get('case')}: reward {rollout.get('reward')}  "
                  f"env server {rollout.get('_ng_environment_server')}")
            problems += check_rollout(rollout, "cli")
        if len(run.rollouts) != len(rows()):
            problems.append(f"cli: {len(run.rollouts)} rollouts, want {len(rows())}")
        print(f"[cli]   aggregate: {json.dumps(run.aggregate)[:400]}")
        if run.leftovers:
            problems.append(f"cli: leftovers {run.leftovers}")

    print(f"work folder: {base}")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


def fmt(timings: dict) -> str:
    return " ".join(f"{k}={v:.1f}s" for k, v in timings.items())


if __name__ == "__main__":
    sys.exit(main())
