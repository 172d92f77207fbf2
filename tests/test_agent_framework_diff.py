"""The agent-sandbox spec's worked examples, played by AgentEnv itself and by agentenv.py's serve.

The tasks of tests/test_agent_sandbox.py that agentenv-framework 0.9.1364 can play on this machine
(its local provider, with no agent container: its proxy image needs a registry) are played through
both with the same scripted model, and must give the same scores, the same turns (prompt, system
prompt, tools), the same tool texts, the same verifier rows and the same run_code results and
errors, but where agentenv.py differs on purpose, which each test says, and the README's tables
list. AgentEnv runs from its own venv (.ci/framework-venv.sh), driven by tests/framework/play.py
through its Episode API (or as ``agent-env run`` for the task that prompts no agent), inside a
network namespace with only loopback: nothing here reaches the network. Without the venv the tests
skip, saying why; with AGENTENV_REQUIRE_FRAMEWORK=1 (CI) they fail instead.

Played: 8.1, 8.2's run_code outcomes, 8.7's unit-test verifiers and the turns of 2.1/8.4. Not: 8.3,
8.4's bash, 8.5, 8.6 and 8.7's episode (the agent's container is AgentEnv's proxy image, which
builds only from a registry), nor 8.2's container-mode sandbox (AgentEnv's local provider pulls its
image from a registry even when this machine's Docker holds it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest


import agentenv
from tests.harness import LoopbackNamespace, NamespaceUnavailable, Socket, run, serving
from tests.test_agent_sandbox import (BOOM, CODE, INPUTS, PROBE, SLOW, TASKBOX,
                                      UNIT_TESTS, UNITS_SCORES, bundle, local_task, units_task)

VERSION = "0.9.1364"
VENV = Path(os.environ.get("AGENTENV_FRAMEWORK_VENV") or
            Path.home() / ".cache" / "agentenv-tests" / f"agentenv-framework-{VERSION}")
MARKER = VENV / ".agentenv-framework-complete"
PLAY = Path(__file__).resolve().parent / "framework" / "play.py"


def framework_unavailable(reason: str) -> None:
    if os.environ.get("AGENTENV_REQUIRE_FRAMEWORK") == "1":
        pytest.fail(f"{reason} (AGENTENV_REQUIRE_FRAMEWORK=1, so this is an error, not a skip)",
                    pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def framework():
    """AgentEnv's python and a loopback-only network namespace to run it in."""
    if not (VENV / "bin" / "python").is_file() or not MARKER.is_file():
        framework_unavailable(f"agentenv-framework {VERSION} is not installed at {VENV} (no "
                              f"{MARKER.name}): build its venv with bash .ci/framework-venv.sh")
    try:
        namespace = LoopbackNamespace()
    except NamespaceUnavailable as exc:
        framework_unavailable(f"no loopback-only network namespace to run AgentEnv in: {exc}")
    with namespace:
        yield namespace


def play_framework(framework: LoopbackNamespace, root: Path, task: str, turns: list[dict],
                   folder: Path, mode: str = "episode", timeout: float = 240) -> dict:
    """What AgentEnv did with ``task`` of the bundle ``root``, its turns played as ``turns`` say
    (tests/framework/play.py); HOME, its state and its local sandboxes in ``folder``."""
    home = folder / "home"
    home.mkdir(parents=True)
    plan = folder / "plan.json"
    plan.write_text(json.dumps({"bundle": str(root), "task": task, "mode": mode, "turns": turns}))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_STATE_HOME": str(home / "state"),
           "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
    ran = subprocess.run(framework.argv([str(VENV / "bin" / "python"), str(PLAY), str(plan)]),
                         cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=timeout)
    (folder / "stderr.txt").write_text(ran.stderr)
    assert ran.returncode == 0 and ran.stdout.strip(), \
        f"AgentEnv's player exited {ran.returncode}:\n{ran.stderr[-4000:]}"
    return json.loads(ran.stdout.strip().splitlines()[-1])


def play_serve(root: Path, turns: list[dict], folder: Path, sandbox: str = "local",
               reward: str | None = None) -> dict:
    """What ``serve`` did with the bundle's one task, played over OpenEnv's /ws with the same
    turns: each call's text and whether it is an error, each turn's prompt and tools, and the
    scores its last end_turn reports (``reward``: the step whose score is the reward)."""
    out: dict = {"turns": [], "scores": None, "error": None}
    flags = ("--reward", reward) if reward else ()
    with serving(root, folder, *flags, sandbox=sandbox) as server, \
            Socket(server.ws_url + "/ws") as ws:
        reset = ws.ask({"type": "reset", "data": {"split": "all", "index": 0}}, 180)["data"]
        seen_turn = reset["observation"]["metadata"]
        for planned in turns:
            listed = ws.ask({"type": "step", "data": {"type": "list_tools"}})["data"]
            seen = {"prompt": seen_turn["prompt"], "system_prompt": seen_turn["system_prompt"],
                    "tools": [t["name"] for t in listed["observation"]["tools"]
                              if t["name"] != "end_turn"], "calls": []}
            for name, arguments in planned["calls"]:
                step = ws.ask({"type": "step", "data": {"type": "call_tool", "tool_name": name,
                                                        "arguments": arguments}}, 120)["data"]
                observation = step["observation"]
                assert not step["done"], observation
                if observation["error"] is not None:
                    seen["calls"].append({"text": observation["error"]["message"], "is_error": True,
                                          "error_type": observation["error"]["error_type"]})
                else:
                    seen["calls"].append({"text": observation["result"]["data"],
                                          "is_error": observation["result"]["is_error"]})
            out["turns"].append(seen)
            ended = ws.ask({"type": "step", "data": {"type": "call_tool", "tool_name": "end_turn",
                                                     "arguments": {"response": planned["reply"]}}},
                           240)["data"]
            if ended["done"]:
                metadata = ended["observation"]["metadata"]
                out["scores"], out["error"] = metadata.get("scores"), metadata.get("error")
                break
            seen_turn = ended["observation"]["result"]
    return out


def records_of_ours(root: Path, turns: list[dict], sandbox: str = "local",
                    reward: str | None = None) -> dict:
    """The records behind serve's scores, which its wires don't carry: the same runtime serve runs,
    in this process, the turns played with no calls (these records don't depend on them)."""
    loaded = agentenv.Bundle.load(root, reward=reward)
    (task,) = loaded.tasks.values()

    async def play():
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox=sandbox)) as runtime:
            episode = runtime.episode(task)
            for planned in turns:
                (await episode.next_turn()).end(planned["reply"])
            outcome = await episode.result()
            return {"scores": outcome.scores, "verifications": episode.verifications,
                    "script_results": episode.script_results, "failed_steps": episode.errors}
    return run(play(), 240)


def paired(theirs: dict, ours: dict) -> list[tuple[str, dict, dict]]:
    """The verifications of each, paired by key. A step without a verifier_id records under a
    random id in AgentEnv and under its step id here: those (aggregates) are paired by content."""
    shared = sorted(set(theirs) & set(ours))
    rest = [sorted((json.dumps(v, sort_keys=True) for k, v in side.items() if k not in shared))
            for side in (theirs, ours)]
    assert rest[0] == rest[1], rest
    return [(key, theirs[key], ours[key]) for key in shared]


def the_same_error(theirs: str, ours: str) -> None:
    """A failed step's error, the same but for where each stages a script and its runner's own
    frame of a traceback (the lines naming runner.py and the one after it)."""
    def plain(text: str) -> list[str]:
        lines, kept = text.splitlines(), []
        for i, line in enumerate(lines):
            if "runner.py" in line or (i and "runner.py" in lines[i - 1]) or set(line.strip()) <= {"^"}:
                continue
            kept.append(re.sub(r'File "[^"]*/([^/"]+/[^/"]+)"', r'File "…/\1"', line))
        return kept
    assert plain(ours) == plain(theirs), (theirs, ours)
    assert ours.endswith("\n") == theirs.endswith("\n")


# ================================================================ 8.1: verify_sandbox and aggregates

def test_verify_sandbox_and_aggregates_score_as_agentenv_does(framework, tmp_path):
    root = bundle(tmp_path / "sbx-local", {"local": local_task()}, {"inputs": INPUTS, "probe": PROBE})
    turns = [{"calls": [["bash", {"command": "ls"}]], "reply": "Hello from outside."}]
    theirs = play_framework(framework, root, "local", turns, tmp_path / "agentenv")
    ours = play_serve(root, turns, tmp_path / "serve", reward="total")

    assert theirs["error"] is None and ours["error"] is None, (theirs["error"], ours["error"])
    assert theirs["scores"] == {"check": 0.25, "check2": 1.0, "check3": 0.0, "total": 0.34375,
                                "anyof": 0.0}
    assert ours["scores"] == theirs["scores"]
    (their_turn,), (our_turn,) = theirs["turns"], ours["turns"]
    for key in ("prompt", "system_prompt", "tools"):
        assert our_turn[key] == their_turn[key], key
    assert their_turn["tools"] == []
    # a tool the turn doesn't offer: AgentEnv's driver raises to its caller; serve answers the
    # model, which reads that there is no such tool (README: the agent's box, deviations)
    assert their_turn["calls"] == [{"raised": "EpisodeError: turn 'ask' offers no tool 'bash'; "
                                              "it offers []"}]
    (refused,) = our_turn["calls"]
    assert refused["error_type"] == "tool_not_found" and refused["text"].startswith(
        "there is no tool 'bash'")

    records = records_of_ours(root, turns, reward="total")
    assert records["scores"] == theirs["scores"]
    assert records["failed_steps"] == theirs["failed_steps"] == {}
    pairs = paired(theirs["verifications"], records["verifications"])
    assert [key for key, _, _ in pairs] == ["check-v", "check2-v", "check3-v"]
    for key, their_record, our_record in pairs:
        assert our_record["score"] == their_record["score"], key
        for mine, their_row in zip(our_record["results"], their_record["results"], strict=True):
            if their_row["justification"].startswith("could not read nope.txt: cat: "):
                # the first 100 characters of cat's error, which name each one's work folder
                assert mine["justification"].startswith("could not read nope.txt: cat: ")
                mine, their_row = ({k: v for k, v in r.items() if k != "justification"}
                                   for r in (mine, their_row))
            assert mine == their_row, key
    # the /app path in its args is not rewritten to the work folder, in either (the spec, 6.6)
    assert records["script_results"] == theirs["script_results"] == {
        "script": {"args": {"base": "/app/work"}, "uid": 0, "listing": None}}


# ================================================================ 8.2: run_code's outcomes

SHAPE = {"shape.py": "def run(data):\n    return {'empty_list': [], 'empty_dict': {}, 'none': None,"
                     " 'empty_str': '', 'n': 1, 'nested': {'keep': 1, 'gone': []}}\n\n"
                     "def again(data):\n    return {'keys': sorted(data['results']), "
                     "'shape': data['results']['shape']}\n"}


def code_task() -> list[dict]:
    def code(sid, artifact, **more):
        return {"id": sid, "type": "run_code", "sandbox_name": "box", "script_artifact_id": artifact,
                "fail_task_on_error": False, **more}
    return [{"id": "box", "type": "deploy_sandbox", "sandbox_name": "box", "sandbox_mode": "vm"},
            {"id": "solver", "type": "deploy_agent", "agent_name": "solver"},
            {"id": "ask", "type": "prompt_agent", "agent_name": "solver", "prompt": "Hi."},
            code("multi", "code"), code("other", "code", entrypoint="other", args={"n": 1}),
            code("shape", "shape"), code("shape2", "shape", entrypoint="again"),
            code("boom", "boom"), code("missing-entry", "boom", entrypoint="nope"),
            code("slow", "slow", timeout_seconds=2),
            {"id": "check", "type": "verify_sandbox", "sandbox_name": "box",
             "criteria": [{"type": "bash_cmd_succeeds", "bash_cmd": "true"}]}]


def test_run_code_outcomes_match_agentenvs(framework, tmp_path):
    root = bundle(tmp_path / "sbx-code", {"code": code_task()},
                  {"code": CODE, "boom": BOOM, "slow": SLOW, "shape": SHAPE})
    turns = [{"calls": [], "reply": "ok"}]
    theirs = play_framework(framework, root, "code", turns, tmp_path / "agentenv")
    ours = play_serve(root, turns, tmp_path / "serve")
    assert theirs["error"] is None and ours["error"] is None, (theirs["error"], ours["error"])
    assert theirs["scores"] == ours["scores"] == {"check": 1.0}
    records = records_of_ours(root, turns)
    assert records["scores"] == theirs["scores"]
    # empty lists and objects in a result are kept, and later scripts see every earlier result
    assert theirs["script_results"]["shape2"]["keys"] == ["multi", "other", "shape"]
    assert records["script_results"] == theirs["script_results"]
    assert set(records["failed_steps"]) == set(theirs["failed_steps"]) == \
        {"boom", "missing-entry", "slow"}
    for step, error in theirs["failed_steps"].items():
        the_same_error(error, records["failed_steps"][step])


# ================================================================ 8.7: unit-test verifiers

def test_unit_test_verifiers_and_tolerated_failures_score_as_agentenv_does(framework, tmp_path,
                                                                           docker_client):
    """AgentEnv can't play this one as an episode here (the spec, 5.9: an ``@local`` episode's
    unit-test verifier can't write its output), so it runs the task as ``agent-env run`` does,
    without the agent; serve plays it with the agent our model plays. The steps after the tolerated
    failures run in both, so the total over all five verifiers is 0.5 in both."""
    artifacts = {"taskbox": TASKBOX, "tests": UNIT_TESTS}
    theirs_root = bundle(tmp_path / "agentenv-bundle" / "sbx-container",
                         {"units": units_task(played=False)}, artifacts)
    ours_root = bundle(tmp_path / "sbx-container", {"units": units_task()}, artifacts)
    theirs = play_framework(framework, theirs_root, "units", [], tmp_path / "agentenv", mode="run")
    ours = play_serve(ours_root, [{"calls": [], "reply": "ok"}], tmp_path / "serve", sandbox="docker",
                      reward="total")
    assert theirs["scores"] == UNITS_SCORES, theirs
    assert ours["scores"] == theirs["scores"], ours
    records = records_of_ours(ours_root, [{"reply": "ok"}], sandbox="docker", reward="total")
    assert records["scores"] == theirs["scores"]
    assert records["failed_steps"] == theirs["failed_steps"]
    pairs = paired(theirs["verifications"], records["verifications"])
    assert len(pairs) == 5
    for key, their_record, our_record in pairs:
        # AgentEnv also stores each command's stdout and stderr as artifacts of its object
        # store: agentenv.py keeps their heads only (README: the step types)
        assert their_record.pop("stdout_artifact") and their_record.pop("stderr_artifact")
        assert our_record == their_record, key


# ================================================================ 2.1 and 8.4: turns, system prompts, replies

def turns_task() -> list[dict]:
    """Three turns of an agent in no box: the system prompt of the deploy, then a prompt's own, kept
    by the next (the spec, 2.1: S0 / S1 / S1); their replies graded."""
    def prompt(sid, **more):
        return {"id": sid, "type": "prompt_agent", "agent_name": "solver", "prompt": f"hi {sid}",
                "prompt_id": sid, **more}

    def graded(sid, prompt_id, *criteria, **more):
        return {"id": sid, "type": "agent_prompt_response_verifier", "prompt_id": prompt_id,
                "verifier_id": f"{sid}-v", "criteria": list(criteria), **more}
    return [{"id": "solver", "type": "deploy_agent", "agent_name": "solver", "system_prompt": "S0"},
            prompt("p1"), prompt("p2", system_prompt="S1"), prompt("p3"),
            graded("g1", "p1", {"type": "response_contains", "needles": ["alpha", "beta"]},
                   {"type": "response_contains", "needles": ["alpha", "zeta"]}),
            graded("g2", "p2", {"type": "response_regex_present", "pattern": "^$"},
                   {"type": "response_contains", "needles": ["x"]}, score_aggregator="any_pass"),
            graded("g3", "p3", {"type": "response_regex_present", "pattern": "GAM+A"},
                   {"type": "response_regex_present", "pattern": "GAM+A", "flags": ["IGNORECASE"]},
                   {"type": "response_regex_present", "pattern": "one.two"},
                   {"type": "response_regex_present", "pattern": "one.two", "flags": []},
                   score_aggregator="weighted_average"),
            {"id": "total", "type": "aggregate_verifiers", "verifier_ids": ["g1-v", "g2-v", "g3-v"]}]


def test_turns_system_prompts_and_graded_replies_match_agentenvs(framework, tmp_path):
    root = bundle(tmp_path / "sbx-turns", {"turns": turns_task()})
    turns = [{"calls": [], "reply": "alpha beta"}, {"calls": [], "reply": ""},
             {"calls": [], "reply": "gamma\none\ntwo"}]
    theirs = play_framework(framework, root, "turns", turns, tmp_path / "agentenv")
    ours = play_serve(root, turns, tmp_path / "serve", reward="total")
    assert theirs["error"] is None and ours["error"] is None, (theirs["error"], ours["error"])
    assert [(t["prompt"], t["system_prompt"], t["tools"]) for t in theirs["turns"]] == \
        [("hi p1", "S0", []), ("hi p2", "S1", []), ("hi p3", "S1", [])]
    assert [(t["prompt"], t["system_prompt"], t["tools"]) for t in ours["turns"]] == \
        [(t["prompt"], t["system_prompt"], t["tools"]) for t in theirs["turns"]]
    assert ours["scores"] == theirs["scores"], (ours["scores"], theirs["scores"])
    records = records_of_ours(root, turns, reward="total")
    for key, their_record, our_record in paired(theirs["verifications"], records["verifications"]):
        assert our_record == their_record, key
