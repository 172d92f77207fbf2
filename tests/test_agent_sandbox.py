"""The agent's sandbox: tasks where the model works with bash in a box of its own.

The worked examples of AgentEnv's played-agent spec (agentenv-framework 0.9.1364), rebuilt as test
bundles and played in-process, must give its scores and its texts (where agentenv.py differs on
purpose, the test says how); the repair bundle pyfix-v1 is played end to end over both wires;
and the faults a model can cause (a command past its deadline, a flood of output, a fork bomb)
cost its own rollout only, while a box that dies mid-turn masks it. Boxes run in Docker (the
tests skip, or fail in CI, without a daemon and python:3.11-slim), and some in the local sandbox.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest


import agentenv
from tests.harness import (Gym, NOTES, PYFIX, Socket, box_of, boxes_of, client, gym_row,
                           labelled, remove_quietly, run, serving, started_here)



@pytest.fixture
def no_box_left(docker_client):
    """Every test's boxes are gone at its end (labelled agentenv.box, owned by a live process of
    this run)."""
    yield
    left = [c for c in labelled(docker_client, "agentenv.box")
            if agentenv.owner_alive(owner := c.labels.get("agentenv.owner", "")) is not False
            and started_here(owner)]
    remove_quietly(left)
    assert not left, f"boxes left behind: {[c.name for c in left]}"


def bundle(root: Path, tasks: dict[str, list[dict]], artifacts: dict[str, dict[str, str]] = (),
           skills: dict[str, str] = ()) -> Path:
    """A bundle of ``tasks`` with artifact files (name -> {path: text}) and skills (name -> SKILL.md)."""
    for name, steps in tasks.items():
        (root / "tasks").mkdir(parents=True, exist_ok=True)
        (root / "tasks" / f"{name}.json").write_text(json.dumps(steps))
    for name, files in dict(artifacts).items():
        for rel, text in files.items():
            (root / "artifacts" / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / "artifacts" / name / rel).write_text(text)
    for name, text in dict(skills).items():
        (root / "skills" / name).mkdir(parents=True)
        (root / "skills" / name / "SKILL.md").write_text(text)
    return root


INPUTS = {"notes.txt": "alpha\nbeta\n", "sub/conf.ini": "[x]\n"}
# (on the local sandbox, the path in its args is not the work folder's, as AgentEnv has it)
PROBE = {"probe.py": "import os\n\ndef run(data):\n    base = data['args']['base']\n"
                     "    return {'args': data['args'], 'uid': os.getuid(),\n"
                     "            'listing': sorted(os.listdir(base)) if os.path.isdir(base) else None}\n"}


# ================================================================ 8.1: verify_sandbox, aggregates

def local_task(reward_turn: bool = True) -> list[dict]:
    def exists(paths, **more):
        return {"type": "probe_file_exists", "paths": paths, **more}
    check = [exists(["notes.txt", "sub/conf.ini"]), exists(["notes.txt", "nope.txt"], weight=2),
             {"type": "probe_dir_exists", "paths": ["sub"]},
             {"type": "probe_dir_exists", "paths": ["notes.txt"]},
             {"type": "probe_file_contains", "paths": ["notes.txt"], "expected": "^be.a$"},
             {"type": "probe_file_contains", "paths": ["notes.txt"], "expected": "gamma"},
             {"type": "probe_file_contains", "paths": ["/app/work/notes.txt"], "value": "alpha"},
             {"type": "probe_file_contains", "paths": ["notes.txt"], "expected": "("},
             {"type": "probe_file_contains", "paths": ["nope.txt"], "expected": "x"},
             {"type": "bash_cmd_succeeds",
              "bash_cmd": 'test "$(basename $PWD)" = work && grep -q alpha notes.txt'},
             {"type": "bash_cmd_succeeds", "bash_cmd": "echo oops >&2; exit 3"},
             {"type": "bash_cmd_succeeds", "bash_cmd": "sleep 10"},
             {"type": "bash_cmd_succeeds", "bash_cmd": "true", "weight": -1},
             {"type": "bash_cmd_succeeds", "bash_cmd": "false", "weight": -0.5},
             {"type": "llm_judge", "rubric": "nice"},
             exists([])]
    return [
        {"id": "box", "type": "deploy_sandbox", "sandbox_name": "box", "sandbox_mode": "vm"},
        {"id": "load", "type": "load_artifact", "sandbox_name": "box", "artifact_id": "inputs",
         "destination_path": "/app/work"},
        {"id": "solver", "type": "deploy_agent", "agent_name": "solver",
         "system_prompt": "You are a careful solver."},
        {"id": "ask", "type": "prompt_agent", "agent_name": "solver", "prompt": "Say hello."},
        {"id": "script", "type": "run_code", "sandbox_name": "box", "script_artifact_id": "probe",
         "args": {"base": "/app/work"}},
        {"id": "check", "type": "verify_sandbox", "sandbox_name": "box", "verifier_id": "check-v",
         "base_dir": "/app/work", "score_aggregator": "weighted_average",
         "shell_timeout_seconds": 3, "criteria": check},
        {"id": "check2", "type": "verify_sandbox", "sandbox_name": "box", "verifier_id": "check2-v",
         "criteria": [exists(["/app/work/notes.txt"]),
                      {"type": "bash_cmd_succeeds", "bash_cmd": "grep -q beta /app/work/notes.txt"}]},
        {"id": "check3", "type": "verify_sandbox", "sandbox_name": "box", "verifier_id": "check3-v",
         "score_aggregator": "any_pass", "criteria": [{"type": "llm_judge"}]},
        {"id": "total", "type": "aggregate_verifiers", "verifier_ids": ["check-v", "check2-v"]},
        {"id": "anyof", "type": "aggregate_verifiers", "verifier_ids": ["check-v", "check2-v"],
         "score_aggregator": "all_pass"},
    ]


@pytest.mark.parametrize("sandbox", ["local", "docker"])
def test_verify_sandbox_and_aggregates_give_the_spec_scores(request, tmp_path, sandbox):
    if sandbox == "docker":
        request.getfixturevalue("no_box_left")
    root = bundle(tmp_path / "sbx-local", {"local": local_task()},
                  {"inputs": INPUTS, "probe": PROBE})
    loaded = agentenv.Bundle.load(root, reward="total")
    task = loaded.tasks["local"]
    assert not task.sandboxed and task.toolset.name == "(no env)"   # the agent works in no box

    async def play():
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox=sandbox)) as runtime:
            episode = runtime.episode(task)
            turn = await episode.next_turn()
            assert (turn.prompt, turn.system_prompt, turn.tools) == \
                ("Say hello.", "You are a careful solver.", [])
            assert (await turn.call("bash", {"command": "ls"})).status == agentenv.UNKNOWN_TOOL
            turn.end("Hello from outside.")
            return await episode.result(), episode
    started = time.monotonic()
    outcome, episode = run(play(), 120)
    assert outcome.scores == {"check": 0.25, "check2": 1.0, "check3": 0.0, "total": 0.34375,
                              "anyof": 0.0}, outcome
    assert outcome.reward == 0.34375
    rows = episode.verifications["check-v"]["results"]
    said = [r["justification"] for r in rows]
    assert said[:8] == ["All paths exist", "Missing: ['nope.txt']", "All paths exist",
                        "Missing: ['notes.txt']", "does not contain '^be.a$'",
                        "does not contain 'gamma'", "contains 'alpha'",
                        "invalid regex pattern '(': missing ), unterminated subpattern at position 0"]
    assert said[8].startswith("could not read nope.txt: cat: ")     # the first 100 characters
    assert "No such file" in said[8] or sandbox == "local"           # (of a long local path)
    assert said[9:14] == ["exit=0; stderr=", "exit=3; stderr=oops\n", "timed out after 3s",
                          "exit=0; stderr=", "exit=1; stderr="]
    assert rows[14] == {"type": "llm_judge", "rubric": "nice", "criterion_index": 14, "skipped": True,
                        "justification": "type 'llm_judge' not handled by verify_sandbox"}
    assert said[15] == "no paths specified"
    result = episode.script_results["script"]
    assert result["args"] == {"base": "/app/work"}
    assert result["listing"] == (["notes.txt", "sub"] if sandbox == "docker" else None)
    assert time.monotonic() - started < 60


# ================================================================ 8.2: run_code's outcomes

CODE = {"run.py": "import helper\n\ndef run(data):\n    return {'value': helper.VALUE}\n\n"
                  "def other(data):\n    return {'entry': 'other', 'args': data['args'], "
                  "'before': sorted(data['results'])}\n",
        "helper.py": "VALUE = 42\n"}
BOOM = {"boom.py": "def run(data):\n    raise ValueError('the script blew up')\n"}
SLOW = {"slow.py": "import time\n\ndef run(data):\n    time.sleep(30)\n"}


def test_run_code_results_and_failures(tmp_path):
    def code(sid, artifact, **more):
        return {"id": sid, "type": "run_code", "sandbox_name": "box", "script_artifact_id": artifact,
                "fail_task_on_error": False, "depends_on": ["ask"], **more}
    steps = [{"id": "box", "type": "deploy_sandbox", "sandbox_name": "box", "sandbox_mode": "vm"},
             {"id": "solver", "type": "deploy_agent", "agent_name": "solver"},
             {"id": "ask", "type": "prompt_agent", "agent_name": "solver", "prompt": "Hi."},
             code("multi", "code"), code("other", "code", entrypoint="other", args={"n": 1},
                                         depends_on=["multi"]),
             code("boom", "boom"), code("missing-entry", "boom", entrypoint="nope"),
             code("slow", "slow", timeout_seconds=2),
             {"id": "check", "type": "verify_sandbox", "sandbox_name": "box", "depends_on": ["ask"],
              "criteria": [{"type": "bash_cmd_succeeds", "bash_cmd": "true"}]}]
    loaded = agentenv.Bundle.load(bundle(tmp_path / "sbx-code", {"code": steps},
                                         {"code": CODE, "boom": BOOM, "slow": SLOW}))

    async def play():
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox="local")) as runtime:
            episode = runtime.episode(loaded.tasks["code"])
            (await episode.next_turn()).end("ok")
            return await episode.result(), episode
    started = time.monotonic()
    outcome, episode = run(play(), 60)
    assert outcome.scores == {"check": 1.0} and outcome.status == "scored"
    assert episode.script_results == {"multi": {"value": 42},
                                      "other": {"entry": "other", "args": {"n": 1}, "before": ["multi"]}}
    boom = episode.errors["boom"]
    assert boom.startswith("run_code 'boom': exited 1: ") and "Traceback" in boom
    assert boom.endswith("/boom/script.py\", line 2, in run\n    raise ValueError('the script blew "
                         "up')\nValueError: the script blew up\n")     # staged as script.py
    assert "AttributeError: module 'agent_env_user_script' has no attribute 'nope'" in \
        episode.errors["missing-entry"]
    assert episode.errors["slow"] == "run_code 'slow': timed out after 2s"
    assert time.monotonic() - started < 20


# ================================================================ 8.3: bash in a sandboxed agent

AGENT_TASK = [
    {"id": "solver", "type": "deploy_agent", "agent_name": "solver",
     "system_prompt": "You work in a sandbox.",
     "skills": [{"name": "greeter", "description": "Greets people.", "body": "Say hello first."}]},
    {"id": "load", "type": "load_artifact", "agent_name": "solver", "artifact_id": "inputs",
     "destination_path": "/app/inputs"},
    {"id": "skills", "type": "add_skills", "agent_name": "solver", "skills": [
        {"skill_artifact_id": "notes"},
        {"name": "inline-one", "description": "An inline skill.", "body": "Do the thing.",
         "license": "MIT"}]},
    {"id": "ask", "type": "prompt_agent", "agent_name": "solver",
     "prompt": "Copy inputs/notes.txt to answer.txt, upper-cased."},
    {"id": "grade", "type": "run_code", "agent_name": "solver", "script_artifact_id": "grade"},
    {"id": "check", "type": "verify_sandbox", "agent_name": "solver", "verifier_id": "check-v",
     "criteria": [{"type": "probe_file_exists", "paths": ["answer.txt"]},
                  {"type": "probe_file_contains", "paths": ["answer.txt"], "expected": "ALPHA"},
                  {"type": "bash_cmd_succeeds", "bash_cmd": "test $(wc -l < answer.txt) -eq 2"}]},
    {"id": "total", "type": "aggregate_verifiers", "verifier_ids": ["check-v"],
     "score_aggregator": "all_pass"},
]
GRADE = {"grade.py": "import os, getpass\n\ndef run(data):\n    return {'answer': open('/app/answer.txt')"
                     ".read(), 'cwd': os.getcwd(), 'user': getpass.getuser()}\n"}
NOTES_SKILL = "---\nname: notes\ndescription: How to read the notes file.\n---\nRead notes.txt line by line.\n"

# command -> (text, is an error), as the spec measured them (docker box)
BASH_TABLE = [
    ("tr a-z A-Z < inputs/notes.txt > answer.txt && cat answer.txt", "ALPHA\nBETA\n", False),
    ("echo to-out; echo to-err >&2; exit 7", "to-out\nto-err\nexit code 7", True),
    ("exit 1", "exit code 1", True),
    ("echo only-err >&2", "only-err\n", False),
    ("ls /nonexistent", "ls: cannot access '/nonexistent': No such file or directory\nexit code 2",
     True),
    ("printf 'no newline'", "no newline", False),
    ("printf 'two\\n\\n'; exit 2", "two\n\nexit code 2", True),
    ("printf '\\xff\\xfe bad utf8\\n'", "\ufffd\ufffd bad utf8\n", False),
    ("cd /tmp && pwd", "/tmp\n", False),
    ("pwd; export FOO=1", "/app\n", False),
    ("echo FOO=${FOO:-unset}; [[ 1 == 1 ]] && echo bashism-ok; echo $0", "FOO=unset\nbashism-ok\nbash\n",
     False),
    ("(sleep 30; echo late) & echo started-bg", "started-bg\n", False),
    ("read x; echo got=[$x]", "got=[]\n", False),
    ("echo o1; echo e1 >&2; echo o2; echo e2 >&2", "o1\no2\ne1\ne2\n", False),
    ("", "", False),
]


def test_bash_in_the_agents_box_answers_as_the_spec_measured(tmp_path, no_box_left, docker_client):
    root = bundle(tmp_path / "sbx-agent", {"agent": AGENT_TASK}, {"inputs": INPUTS, "grade": GRADE},
                  {"notes": NOTES_SKILL})
    loaded = agentenv.Bundle.load(root, reward="total")
    task = loaded.tasks["agent"]
    assert task.sandboxed and task.toolset.name == "bash"

    async def play():
        # 8 s: a docker exec on a loaded machine (load 30) took past 3 s to run a background job
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox="docker", bash_timeout=8)) as runtime:
            episode = runtime.episode(task)
            turn = await episode.next_turn()
            assert turn.system_prompt == "You work in a sandbox."
            assert turn.tool_specs == [{"name": "bash", "description": agentenv.BASH_TOOL["description"],
                                        "input_schema": agentenv.BASH_SCHEMA}]
            assert agentenv.BASH_TOOL["description"] == (
                "Run a bash command where the agent works, as its user, in its folder; returns its "
                "stdout, then its stderr.")
            who = await turn.call("bash", {"command": "pwd; whoami; id; echo HOME=$HOME; ls -la"})
            lines = who.text.splitlines()
            assert lines[:4] == ["/app", "agent", "uid=1000(agent) gid=1000(agent) groups=1000(agent)",
                                 "HOME=/home/agent"], who.text
            # loaded files are the agent's (so it can edit what it is given): a deviation
            assert any(line.endswith("inputs") and " agent agent " in line for line in lines)
            skills = await turn.call("bash", {"command": "ls ~/skills; cat ~/skills/*/SKILL.md"})
            assert skills.text == (
                "greeter\ninline-one\nnotes\n---\nname: greeter\ndescription: Greets people.\n---\n\n"
                "Say hello first.---\nname: inline-one\ndescription: An inline skill.\nlicense: MIT\n"
                "---\n\nDo the thing." + NOTES_SKILL), skills.text
            for command, text, error in BASH_TABLE:
                result = await turn.call("bash", {"command": command})
                assert (result.text, result.is_error) == (text, error), command
            big = await turn.call("bash", {"command": "seq 1 200000"})
            assert len(big.text) < agentenv.MAX_TOOL_OUTPUT + 300 and not big.is_error
            assert big.text.startswith("1\n2\n3\n") and "[output cut: the command printed 1288895 " \
                   "bytes; agentenv.py passes on the first 100000 characters" in big.text
            assert (await turn.call("bash", {"command": 3})) == agentenv.ToolResult(
                "tool 'bash' takes a command string, not 3", agentenv.BAD_ARGUMENTS)
            assert (await turn.call("bash", {})).text == "tool 'bash' takes a command string, not None"
            extra = await turn.call("bash", {"command": "echo extra", "timeout": 5})
            assert extra.text == "extra\n"
            # past 128 KiB, an argument Linux refuses: the command goes on stdin, and runs as with -c
            long = await turn.call("bash", {"command": "x='" + "a" * 300_000 + "'; echo ${#x} $0; "
                                                       "read y; echo [$y]\n\n"})
            assert long.text == "300000 bash\n[]\n", long.text[:200]
            killed = await turn.call("bash", {"command": "kill -9 $$"})
            assert killed.text == "exit code 137" and killed.is_error    # Docker's code for -9
            started = time.monotonic()
            slow = await turn.call("bash", {"command": "sleep 41 & sleep 42; echo never"})
            assert time.monotonic() - started < 15
            assert slow.status == agentenv.TOOL_ERROR and slow.text.startswith(
                "error: the command timed out after 8s, so every process of yours in the box was "
                "stopped: the command, all it started, and anything left running in the background")
            left = await turn.call("bash", {"command": "ls /proc | grep -c '^[0-9]'; "
                                                       "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"})
            assert "sleep 41" not in left.text and "sleep 42" not in left.text, left.text
            assert episode.outcome is None           # a timed-out command is answered: it goes on
            turn.end("Done: answer.txt written.")
            return await episode.result(), episode
    outcome, episode = run(play(), 180)
    assert outcome.scores == {"check": 1.0, "total": 1.0}, outcome
    assert episode.script_results["grade"] == {"answer": "ALPHA\nBETA\n", "cwd": "/app", "user": "root"}
    assert [r["justification"] for r in episode.verifications["check-v"]["results"]] == \
        ["All paths exist", "contains 'ALPHA'", "exit=0; stderr="]


def test_a_root_command_past_its_deadline_is_killed_with_its_tree_and_nothing_else(no_box_left,
                                                                                   docker_client):
    """A command of the bundle's (as root, so not the agent's: its stop kills by the call's marker,
    from this machine, each process held by a pidfd) past its deadline is killed with everything
    it started, a setsid escapee too; a process another call left running is not touched."""
    loaded = agentenv.Bundle.load(NOTES)

    async def play() -> tuple[agentenv.Ran, list[str]]:
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox="docker")) as runtime:
            box = await runtime.sandbox.open_box("kill-test", "box", {}, agents=True)
            try:
                left = await box.run(["sh", "-c", "sleep 997 >/dev/null 2>&1 &"], 30, root=True)
                assert left.exit_code == 0, left
                ran = await box.run(["sh", "-c", "sleep 998 & setsid sleep 999 & sleep 1000"], 3,
                                    root=True)
                top = await asyncio.to_thread(box.container.top, ps_args="-eo pid,args")
                return ran, [row[1] for row in top.get("Processes") or []]
            finally:
                await box.remove()
    ran, processes = run(play(), 120)
    assert ran.timed_out and ran.stopped == "it was killed, with every process it started", ran
    assert not [p for p in processes if p.startswith("sleep 99") and p != "sleep 997"
                or p == "sleep 1000"], processes
    assert "sleep 997" in processes, processes


def test_a_command_silent_past_the_docker_clients_timeout_runs_to_its_end(no_box_left, docker_client,
                                                                         monkeypatch):
    """The docker SDK's client times out a call (120 s in serve; 3 s here), and that timeout was
    the exec stream's too: a command that printed nothing for that long was read as ended, with
    no exit code, while it ran on. It runs to its end now, its own deadline the only one."""
    import docker
    made = docker.from_env
    monkeypatch.setattr(docker, "from_env", lambda **kwargs: made(**{**kwargs, "timeout": 3}))
    loaded = agentenv.Bundle.load(NOTES)

    async def play() -> tuple[agentenv.Ran, float]:
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox="docker")) as runtime:
            box = await runtime.sandbox.open_box("silent-test", "box", {}, agents=True)
            try:
                started = time.monotonic()
                ran = await box.run(["sh", "-c", "sleep 8; echo finished"], 60)
                return ran, time.monotonic() - started
            finally:
                await box.remove()
    ran, took = run(play(), 120)
    assert (ran.exit_code, ran.stdout, ran.timed_out) == (0, b"finished\n", False), ran
    assert took >= 8, took


def test_two_turns_share_the_box_and_checks_run_as_the_agent(tmp_path, no_box_left, docker_client):
    """... and a model that fills the disk fills only its box's share (memory_mb 256: /app 128 MiB)."""
    steps = [{"id": "solver", "type": "deploy_agent", "agent_name": "solver", "memory_mb": 256},
             {"id": "first", "type": "prompt_agent", "agent_name": "solver", "prompt": "Write turn1.txt."},
             {"id": "second", "type": "prompt_agent", "agent_name": "solver", "prompt": "Write turn2.txt.",
              "system_prompt": "Second system prompt."},
             {"id": "check", "type": "verify_sandbox", "agent_name": "solver", "criteria": [
                 {"type": "probe_file_exists", "paths": ["turn1.txt", "turn2.txt"]},
                 {"type": "bash_cmd_succeeds", "bash_cmd": "test $(whoami) = agent"},
                 {"type": "bash_cmd_succeeds", "bash_cmd": "test $PWD = /app"}]}]
    loaded = agentenv.Bundle.load(bundle(tmp_path / "sbx-turns", {"turns": steps}))

    async def play():
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox="docker")) as runtime:
            episode = runtime.episode(loaded.tasks["turns"])
            turn = await episode.next_turn()
            assert turn.system_prompt is None and turn.route == {"bash": None}
            assert (await turn.call("bash", {"command": "echo one > turn1.txt"})).text == ""
            full = await turn.call("bash", {"command": "head -c 200000000 /dev/zero > big; "
                                                       "du -m big; rm big; touch /etc/x"})
            assert "No space left on device" in full.text and "128\tbig" in full.text, full.text
            assert "Read-only file system" in full.text and full.is_error
            turn.end("Turn one done.")
            turn = await episode.next_turn()
            assert (turn.id, turn.system_prompt) == ("second", "Second system prompt.")
            assert (await turn.call("bash", {"command": "cat turn1.txt; echo $FOO"})).text == "one\n\n"
            await turn.call("bash", {"command": "echo two > turn2.txt"})
            turn.end("")
            return await episode.result()
    assert run(play(), 120).scores == {"check": 1.0}


# ================================================================ 8.7: containers and unit tests

# (its own command exits at once: the step's command_override keeps it running)
# (AgentEnv reads a folder with a Dockerfile as a docker_image unless its artifact.toml says so)
TASKBOX = {"Dockerfile": "FROM python:3.11-slim\nRUN mkdir -p /work /logs\nWORKDIR /work\n"
                         "CMD [\"python3\", \"-c\", \"raise SystemExit(3)\"]\n",
           "artifact.toml": 'type = "file_artifact_universe"\n'}
UNIT_TESTS = {
    "pass.sh": 'echo "user=$(whoami) pwd=$PWD greeting=$GREETING mode=${MODE:-unset}"\n',
    "reward.sh": "echo 0.5 > /logs/reward.txt\nexit 1\n",
    "env.sh": 'cat /work/setup.txt\necho "mode=$MODE user=$(whoami)"\necho warning on stderr >&2\n'
              'echo \'{"passed": 3, "failed": 1}\' > /work/result.json\n',
}


def unit(sid: str, command: str, **more) -> dict:
    return {"id": sid, "type": "run_container_unit_tests_verifier", "sandbox_name": "vm",
            "container_name": "task-container", "command": command, "fail_task_on_error": False,
            **more}


def units_task(played: bool = True) -> list[dict]:
    """The spec's ``units``: five tolerated unit-test verifiers in a VM sandbox's container, each
    after the one before (no depends_on: after every earlier step), and a weighted total over all
    five. ``played``: with the agent our model plays (placed on the sandbox only, so it works in no
    box); AgentEnv runs it without (agent-env run), as the spec measured it."""
    agent = [{"id": "solver", "type": "deploy_agent", "agent_name": "solver", "sandbox_name": "vm"},
             {"id": "ask", "type": "prompt_agent", "agent_name": "solver", "prompt": "Nothing to do."}]
    return [
        {"id": "vm", "type": "deploy_sandbox", "sandbox_name": "vm", "sandbox_mode": "vm"},
        {"id": "box", "type": "run_docker_container", "sandbox_name": "vm",
         "docker_context_artifact_id": "taskbox", "env_vars": {"GREETING": "hi"},
         "command_override": "sleep infinity",
         "ready_command": "test -d /work"},
        {"id": "tests", "type": "load_artifact", "sandbox_name": "vm", "container_name":
         "task-container", "artifact_id": "tests", "destination_path": "/tests"},
        *(agent if played else []),
        unit("unit-pass", "bash /tests/pass.sh"),
        unit("unit-reward", "bash /tests/reward.sh", reward_path="/logs/reward.txt"),
        unit("unit-env", "bash /tests/env.sh", env_vars={"MODE": "strict"},
             setup_commands=["echo setup-ran > /work/setup.txt"],
             # (a relative path is read from the container's root, as AgentEnv's docker cp has it)
             result_paths=["/work/setup.txt", "/work/result.json", "/work/missing.json",
                           "setup.txt"]),
        unit("unit-fail", "echo bad >&2; exit 3"),
        unit("unit-timeout", "sleep 20", timeout_sec=2),
        {"id": "total", "type": "aggregate_verifiers",
         "verifier_ids": ["unit-pass", "unit-reward", "unit-env", "unit-fail", "unit-timeout"]},
    ]


UNITS_SCORES = {"unit-pass": 1.0, "unit-reward": 0.5, "unit-env": 1.0, "unit-fail": 0.0,
                "unit-timeout": 0.0, "total": 0.5}


def test_unit_test_verifiers_in_a_sandboxs_container(tmp_path, no_box_left, docker_client):
    """... and the steps after a tolerated failure run, as AgentEnv runs them: the total over all
    five is the spec's 0.5."""
    steps = units_task()
    root = bundle(tmp_path / "sbx-container", {"units": steps},
                  {"taskbox": TASKBOX, "tests": UNIT_TESTS})
    loaded = agentenv.Bundle.load(root, reward="total")
    assert not loaded.tasks["units"].sandboxed       # placed on a sandbox only: no bash

    async def play():
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox="docker")) as runtime:
            episode = runtime.episode(loaded.tasks["units"])
            turn = await episode.next_turn()
            assert turn.tools == []
            turn.end("ok")
            return await episode.result(), episode
    outcome, episode = run(play(), 240)
    assert outcome.scores == UNITS_SCORES, (outcome, episode.errors)
    assert outcome.reward == 0.5 and outcome.status == "scored"
    assert set(episode.errors) == {"unit-fail", "unit-timeout"}
    seen = episode.verifications
    assert seen["unit-pass"]["stdout_head"] == "user=root pwd=/work greeting=hi mode=unset\n"
    assert seen["unit-pass"]["results"] == [{"id": "exit_code", "score": 1.0, "result": True,
                                             "message": "exit_code=0 timed_out=False"}]
    assert seen["unit-reward"]["results"] == [{"id": "reward", "score": 0.5, "result": False,
                                               "message": "reward=0.5 (exit_code=1 timed_out=False)"}]
    assert seen["unit-env"]["stdout_head"] == "setup-ran\nmode=strict user=root\n"
    assert seen["unit-env"]["stderr_head"] == "warning on stderr\n"
    assert seen["unit-env"]["extracted_files"] == {
        "/work/setup.txt": "setup-ran\n", "/work/missing.json": None,
        "/work/result.json": {"passed": 3, "failed": 1}, "setup.txt": None}
    assert episode.errors["unit-fail"].endswith("Verifier 'unit-fail' exited 3; stderr (last 1500 "
                                                "chars):\nbad\n")
    assert episode.errors["unit-timeout"].endswith("Verifier 'unit-timeout' timed out after 2s")
    assert seen["unit-timeout"]["timed_out"] is True


# ================================================================ a VM-mode sandbox's network

# A tiny web server's build context: it serves /srv, where hello.txt says whose it is.
WEB = {"Dockerfile": "FROM python:3.11-slim\nRUN mkdir -p /srv && echo \"hello from web\" > "
                     "/srv/hello.txt\nWORKDIR /srv\nCMD [\"python3\", \"-m\", \"http.server\", "
                     "\"8080\"]\n"}
GET = ("python3 -c \"import sys, urllib.request; print(urllib.request.urlopen('http://' + "
       "sys.argv[1], timeout=3).read().decode(), end='')\"")
LISTENS = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1)\""


def web(sid: str, name: str, **more) -> dict:
    return {"id": sid, "type": "run_docker_container", "sandbox_name": "vm", "container_name": name,
            "docker_context_artifact_id": "web", "ready_command": LISTENS.format(port=8080), **more}


BOX_IMAGE = f"agentenv-box/agent:{hashlib.sha256(agentenv.BOX_DOCKERFILE.encode()).hexdigest()[:16]}"
VM_TASK = [
    {"id": "vm", "type": "deploy_sandbox", "sandbox_name": "vm", "sandbox_mode": "vm",
     "exposed_ports": [8000]},
    {"id": "cbox", "type": "deploy_sandbox", "sandbox_name": "cbox", "sandbox_mode": "container",
     "image": BOX_IMAGE},                                   # on no network
    web("web", "web"),
    web("db", "db", network="backend"),                     # a network of its own
    web("side", "side", network="host", command_override=["python3", "-m", "http.server", "9090"],
        ready_command=LISTENS.format(port=9090)),          # in the VM box's own network
    web("both", "both", extra_networks=["backend"]),
    {"id": "solver", "type": "deploy_agent", "agent_name": "solver", "sandbox_name": "vm"},
    {"id": "in", "type": "load_artifact", "agent_name": "solver", "artifact_id": "inputs",
     "destination_path": "/app/in"},
    {"id": "ask", "type": "prompt_agent", "agent_name": "solver", "prompt": "Fetch web's hello."},
    {"id": "host-view", "type": "verify_sandbox", "sandbox_name": "vm", "criteria": [
        {"type": "bash_cmd_succeeds", "bash_cmd": f"{GET} web:8080/hello.txt | grep -q web"},
        {"type": "bash_cmd_succeeds", "bash_cmd": f"{GET} db:8080/hello.txt"},
        {"type": "bash_cmd_succeeds", "bash_cmd": f"{GET} 127.0.0.1:9090/hello.txt"},
        {"type": "bash_cmd_succeeds", "bash_cmd": f"{GET} solver:1/ 2>&1 | grep -q refused"}]},
    {"id": "agent-view", "type": "verify_sandbox", "agent_name": "solver", "criteria": [
        {"type": "probe_file_exists", "paths": ["in/notes.txt"]},
        {"type": "bash_cmd_succeeds", "bash_cmd": f"{GET} web:8080/hello.txt"},
        {"type": "bash_cmd_succeeds", "bash_cmd": f"{GET} both:8080/hello.txt"},
        {"type": "bash_cmd_succeeds", "bash_cmd": f"! {GET} db:8080/hello.txt"}]},
]


def on_networks(container) -> dict[str, str]:
    container.reload()
    return {name: net["IPAddress"]
            for name, net in container.attrs["NetworkSettings"]["Networks"].items()}


def test_a_vm_sandboxs_containers_are_reached_from_it_by_name_and_from_nothing_else(
        tmp_path, no_box_left, docker_client):
    root = bundle(tmp_path / "sbx-net", {"net": VM_TASK}, {"web": WEB, "inputs": INPUTS})
    loaded = agentenv.Bundle.load(root, reward="agent-view")
    task = loaded.tasks["net"]
    assert task.sandboxed                     # (by its load_artifact and verify_sandbox)

    async def play():
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox="docker")) as runtime:
            first, second = runtime.episode(task), runtime.episode(task)
            turn, other = await first.next_turn(), await second.next_turn()
            # the agent placed on the VM: a box of its own there (its files, its user), on the
            # sandbox's network, where it reaches the sandbox's containers by their names
            here = await turn.call("bash", {"command": f"whoami; ls in; {GET} web:8080/hello.txt"})
            assert here.text == "agent\nnotes.txt\nsub\nhello from web\n", here.text
            # (db is on the network "backend" only, which the VM's box joins and the agent not)
            apart = await turn.call("bash", {"command": f"{GET} db:8080/hello.txt"})
            assert apart.is_error and ("Name or service not known" in apart.text or
                                       "Temporary failure in name resolution" in apart.text), \
                apart.text
            boxes = {c.labels["agentenv.box"]: c for c in
                     labelled(docker_client, f"agentenv.episode={first.id}")}
            assert set(boxes) == {"vm", "vm/web", "vm/db", "vm/side", "vm/both", "solver", "cbox"}
            assert boxes["cbox"].attrs["HostConfig"]["NetworkMode"] == "none"
            ours = runtime.sandbox.network_name(first.id)
            backend = runtime.sandbox.network_name(first.id, "backend")
            assert set(on_networks(boxes["vm"])) == {ours, backend}
            assert set(on_networks(boxes["vm/web"])) == {ours}
            assert set(on_networks(boxes["vm/db"])) == {backend}
            assert set(on_networks(boxes["vm/both"])) == {ours, backend}
            assert set(on_networks(boxes["solver"])) == {ours}
            assert boxes["vm/side"].attrs["HostConfig"]["NetworkMode"] == \
                f"container:{boxes['vm'].id}"
            # another episode's agent can't reach this one's containers, even by their address
            # (its packets find no one: its network's gateway address is nobody's)
            address = on_networks(boxes["vm/web"])[ours]
            tried = await other.call("bash", {"command": f"{GET} {address}:8080/hello.txt"})
            assert tried.is_error and ("timed out" in tried.text or "unreachable" in tried.text), \
                tried.text
            # nor can the host: nothing published, and the networks are internal, with no
            # address of the host on their bridges (so no route in; no packet is sent to see)
            for name in (ours, backend):
                network = docker_client.networks.get(name)
                assert network.attrs["Internal"] is True
                assert network.attrs["Labels"]["agentenv.episode"] == first.id
                bridge = network.attrs["Options"]["com.docker.network.bridge.name"]
                shown = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", bridge],
                                       capture_output=True, text=True, check=True)
                assert shown.stdout == "", f"the host has an address on {bridge}: {shown.stdout}"
            assert all(not c.attrs["NetworkSettings"]["Ports"] for c in boxes.values())
            turn.end("Fetched.")
            other.end("")
            return await first.result(), await second.result(), [ours, backend], first.id
    (outcome, again, networks, episode) = run(play(), 300)
    assert outcome.scores == {"host-view": 1.0, "agent-view": 1.0}, outcome
    assert again.scores == outcome.scores
    assert not labelled(docker_client, f"agentenv.episode={episode}"), "a container stayed"
    assert not [n for n in networks if docker_client.networks.list(names=[n])], "a network stayed"


# ================================================================ bundle code where an env runs

ENV_PROBE = {"probe.py": (
    "import json, os, urllib.request\n\ndef run(data):\n"
    "    card = json.load(urllib.request.urlopen(data['env']['url'] + "
    "'/.well-known/agent-env.json', timeout=5))\n"
    "    return {'env': data['env'], 'notes': open('seed/notes.txt').read(),\n"
    "            'card': card.get('name'), 'uid': os.getuid()}\n")}
ENV_TASK = [
    {"id": "notes", "type": "deploy_env", "env_id": "notebook"},
    {"id": "seed", "type": "load_artifact", "env_id": "notebook", "artifact_id": "inputs",
     "destination_path": "/app/seed"},       # (its folder: the script reads seed/notes.txt)
    {"id": "probe", "type": "run_code", "env_id": "notebook", "script_artifact_id": "probe"},
    {"id": "solver", "type": "deploy_agent", "agent_name": "solver", "env_ids": ["notebook"]},
    {"id": "ask", "type": "prompt_agent", "agent_name": "solver", "prompt": "Say ok.",
     "prompt_id": "ask"},
    {"id": "answer", "type": "agent_prompt_response_verifier", "prompt_id": "ask",
     "criteria": [{"type": "response_contains", "needles": ["ok"]}]},
]


@pytest.mark.parametrize("sandbox", ["local", "docker"])
def test_load_artifact_and_run_code_act_where_an_env_runs(request, tmp_path, sandbox):
    if sandbox == "docker":
        request.getfixturevalue("no_box_left")
    root = bundle(tmp_path / "sbx-env", {"env": ENV_TASK}, {"inputs": INPUTS, "probe": ENV_PROBE})
    shutil.copytree(NOTES / "envs", root / "envs")
    loaded = agentenv.Bundle.load(root)
    assert not loaded.tasks["env"].sandboxed

    async def play():
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox=sandbox)) as runtime:
            episode = runtime.episode(loaded.tasks["env"])
            turn = await episode.next_turn()
            env = episode.envs["notebook"]
            turn.end("ok")
            return await episode.result(), episode, env.instance.base_url, env.mcp_url
    outcome, episode, base_url, mcp_url = run(play(), 180)
    assert outcome.scores == {"answer": 1.0}
    got = episode.script_results["probe"]
    # its files and its script where the env runs (its container, or its folder here), the env's
    # address as it is reached from there, and the card the env answers with at it
    inner = f"http://127.0.0.1:{agentenv.ENV_PORT}" if sandbox == "docker" else base_url
    assert got == {"env": {"id": "notebook", "url": inner,
                           "mcp_url": inner + mcp_url[len(base_url):]},
                   "notes": "alpha\nbeta\n", "card": "notebook", "uid": 0}, got


# ================================================================ seeds for a unit-test verifier

SEEDED = [
    {"id": "solver", "type": "deploy_agent", "agent_name": "solver"},
    {"id": "ask", "type": "prompt_agent", "agent_name": "solver", "prompt": "Fix <repo>."},
    {"id": "unit", "type": "run_container_unit_tests_verifier", "agent_name": "solver",
     "env_vars": {"N": "from-step"}, "setup_commands": ["printf '%s|' <pick> > /tmp/setup.txt"],
     "command": "printf '%s|' <pick> \"$REPO\" \"$N\" \"$FLAGS\" \"${PICK}\"; cat /tmp/setup.txt; "
                "test \"$PATH\" != /nowhere && test -z \"${REPO_NAME:-}\""},
]


@pytest.mark.parametrize("sandbox", ["local", "docker"])
def test_a_unit_test_verifier_reads_the_seed_in_its_environment(request, tmp_path, sandbox):
    if sandbox == "docker":
        request.getfixturevalue("no_box_left")
    loaded = agentenv.Bundle.load(bundle(tmp_path / "sbx-seed", {"seeded": SEEDED}))
    task = loaded.tasks["seeded"]
    assert task.sandboxed                      # the verifier runs in the agent's box
    seed = {"repo": "a b", "n": 3, "pick": "x y", "flags": ["-q", 2], "path": "/nowhere",
            "repo-name": "skipped"}

    async def play():
        async with agentenv.Runtime(loaded, agentenv.Settings.of(sandbox=sandbox)) as runtime:
            episode = runtime.episode(task, seed)
            turn = await episode.next_turn()
            assert turn.prompt == "Fix a b."
            turn.end("")
            return await episode.result(), episode
    outcome, episode = run(play(), 120)
    assert outcome.scores == {"unit": 1.0}, (outcome, episode.errors)
    # each seed key upper-cased, its value text (JSON if not a string); a placeholder in the
    # commands is the value quoted for the shell; the step's own env_vars win, and a name the
    # shell relies on (PATH) or that is no name (repo-name) is not set
    assert episode.verifications["unit"]["stdout_head"] == \
        'x y|a b|from-step|["-q", 2]|x y|x y|'


# ================================================================ pyfix-v1, end to end

def fix_command(name: str) -> str:
    fixed = (PYFIX / "reference" / f"{name}.py").read_text()
    return f"cat > {name}.py <<'AGENTENV_EOF'\n{fixed}AGENTENV_EOF\n"


def test_pyfix_over_openenv_fix_scores_1_nothing_0_and_a_slow_command_is_answered(tmp_path,
                                                                                   no_box_left,
                                                                                   docker_client):
    loaded = agentenv.Bundle.load(PYFIX)
    name = loaded.splits["eval"][0].name
    with serving(PYFIX, tmp_path, "--bash-timeout", "2", sandbox="docker") as server:
        with Socket(server.ws_url + "/ws") as ws:
            reset = ws.ask({"type": "reset", "data": {"split": "eval", "index": 0}}, 120)["data"]
            assert name in reset["observation"]["metadata"]["prompt"]
            tools = ws.ask({"type": "step", "data": {"type": "list_tools"}})["data"]["observation"]["tools"]
            assert [t["name"] for t in tools] == ["bash", "end_turn"]

            def bash(command: str) -> dict:
                return ws.ask({"type": "step", "data": {"type": "call_tool", "tool_name": "bash",
                                                        "arguments": {"command": command}}})["data"]
            # a command that fails is the tool's error on OpenEnv's wire (execution_error, as the
            # reference answers an MCP result flagged isError); the model reads its output there
            failing = bash("python3 -m unittest discover -s tests")["observation"]["error"]
            assert failing["error_type"] == "execution_error" and "FAILED" in failing["message"]
            slow = bash("sleep 30")
            assert not slow["done"] and slow["observation"]["error"]["error_type"] == "execution_error"
            assert slow["observation"]["error"]["message"].startswith("error: the command timed out after 2s")
            fixed = bash(fix_command(name))["observation"]
            assert fixed["error"] is None and fixed["result"], fixed
            ended = ws.ask({"type": "step", "data": {"type": "call_tool", "tool_name": "end_turn",
                                                     "arguments": {"response": "Fixed."}}}, 120)["data"]
            assert ended["done"] is True and ended["reward"] == 1.0
            ws.ask({"type": "reset", "data": {"split": "eval", "index": 0}}, 120)
            ended = ws.ask({"type": "step", "data": {"type": "call_tool", "tool_name": "end_turn",
                                                     "arguments": {"response": "No."}}}, 120)["data"]
            assert ended["done"] is True and ended["reward"] == 0.0


def test_pyfix_over_gym_and_a_dead_box_masks_only_its_rollout(tmp_path, no_box_left, docker_client):
    loaded = agentenv.Bundle.load(PYFIX)
    names = [t.name for t in loaded.splits["eval"]]
    with serving(PYFIX, tmp_path, "--tool-timeout", "4", sandbox="docker") as server:
        async def rollouts():
            async with client() as http:
                fixed, idle, dead, bomb = (Gym(server, gym_row(loaded, i, "eval", ["bash", "end_turn"]),
                                               http) for i in range(4))
                for gym in (fixed, idle, dead, bomb):
                    await gym.seed()
                assert (await fixed.call("bash", command="sleep 30")).text.startswith(
                    "error: the command timed out after 3.2s")           # inside tool_timeout 4
                assert (await fixed.call("bash", command=fix_command(names[0]))).status == 200
                flood = await bomb.call("bash", command="yes | head -c 5000000")
                assert "[output cut: the command printed 5000000 bytes" in flood.text
                assert len(flood.text) < agentenv.MAX_TOOL_OUTPUT + 300
                await bomb.call("bash", command=":(){ :|:& };:")
                await dead.call("bash", command="true")
                victims = [c for c in labelled(docker_client, "agentenv.box=solver")
                           if started_here(c.labels.get("agentenv.owner", ""))]
                assert len(victims) == 4
                for gym, words in ((fixed, "fixed"), (idle, "idle"), (bomb, "bomb")):
                    assert (await gym.call("bash", command=f"echo {words}")).status == 200
                # the box of `dead` dies: its rollout is masked, the others go on
                await bomb.close()
                box = await box_of(dead, victims)
                box.kill()
                gone = await dead.call("bash", command="echo still there?")
                assert "the rollout will be masked" in gone.text, gone.text
                verdicts = [(await g.verify("Done.")).json() for g in (fixed, idle, dead)]
                return verdicts
        fixed, idle, dead = run(rollouts(), 300)
    assert (fixed["reward"], fixed["mask_sample"]) == (1.0, False)
    assert (idle["reward"], idle["mask_sample"]) == (0.0, False)
    assert dead["mask_sample"] is True and dead["failure_kind"] == agentenv.PEER_DROP


# ================================================================ write-gym rows, and Gym's own simple_agent

def test_write_gym_rows_offer_bash_first_and_gyms_simple_agent_plays_pyfix(tmp_path, no_box_left,
                                                                           docker_client):
    """The rows write-gym writes offer bash (the spec's descriptor) before end_turn; Gym 0.7's real
    simple_agent with a scripted model plays them on the written resources server: the fix scores
    1.0, nothing 0.0, and a command past its deadline is answered and the rollout goes on."""
    from tests.gym import harness as gym_harness

    gym_harness.skip_unless_gym_venv()
    target = run(agentenv.write_gym(str(PYFIX), str(tmp_path / "root"),
                                    agentenv.Settings.of(sandbox="docker"), out=lambda _: None), 180)
    rows = [json.loads(line) for line in (target / "data" / "eval.jsonl").read_text().splitlines()]
    tools = rows[0]["responses_create_params"]["tools"]
    assert [t["name"] for t in tools] == ["bash", "end_turn"]
    assert tools[0] == {"type": "function", "name": "bash", "strict": False,
                        "description": agentenv.BASH_TOOL["description"],
                        "parameters": agentenv.BASH_SCHEMA}
    name = rows[0]["task_id"].rsplit("/", 1)[-1]

    def scripted(row: dict, script: list[dict]) -> dict:
        row = json.loads(json.dumps(row))
        row["responses_create_params"].setdefault("metadata", {})["script"] = json.dumps(script)
        return row
    fix = {"tool": "bash", "args": {"command": fix_command(name)}}
    played = gym_harness.run_lightest(tmp_path / "root", agentenv.gym_name("pyfix-v1"), [
        scripted(rows[0], [fix, {"text": "Fixed."}]),
        scripted(rows[0], [{"text": "Nothing to fix."}]),
        scripted(rows[0], [{"tool": "bash", "args": {"command": "sleep 60"}}, fix, {"text": "Done."}]),
    ], work_dir=tmp_path / "gym", resources_overrides={"tool_timeout": 6})
    assert played.leftovers == []
    fixed, nothing, slow = played.results
    assert (fixed["reward"], fixed["mask_sample"]) == (1.0, False), fixed
    assert (nothing["reward"], nothing["mask_sample"]) == (0.0, False), nothing
    assert (slow["reward"], slow["mask_sample"]) == (1.0, False), slow
    answered = [i["output"] for i in slow["response"]["output"] if i["type"] == "function_call_output"]
    assert answered[0].startswith("error: the command timed out after 4.8s"), answered


def test_boxes_go_with_their_episode_and_a_killed_servers_boxes_are_swept(tmp_path, no_box_left,
                                                                          docker_client):
    from tests.harness import Server, running

    first = Server.serve(PYFIX, tmp_path / "first", sandbox="docker")
    try:
        with Socket(first.ws_url + "/ws") as ws:
            ws.ask({"type": "reset", "data": {"split": "eval", "index": 1}}, 120)
            mine = boxes_of(docker_client, first.pid)
            assert len(mine) == 1 and mine[0].attrs["HostConfig"]["NetworkMode"] == "none"
            host = mine[0].attrs["HostConfig"]
            assert host["CapDrop"] == ["ALL"] and host["PidsLimit"] == agentenv.BOX_PIDS_LIMIT
            # its keeper is its init, root's, with CAP_KILL alone; the agent has no capability
            assert host["CapAdd"] == ["KILL"] and not host["Init"] and host["ReadonlyRootfs"]
            assert host["LogConfig"]["Type"] == "none"
            assert mine[0].attrs["Config"]["User"] == "0"
            agents = mine[0].exec_run(["grep", "Cap", "/proc/self/status"], user="agent").output.decode()
            assert "CapEff:\t0000000000000000" in agents and "CapPrm:\t0000000000000000" in agents
            assert host["Memory"] == agentenv.BOX_MEMORY_MB * 2**20
            assert mine[0].image.tags[0].startswith("agentenv-box/agent:")
            first.kill()                            # SIGKILL: no teardown
    finally:
        first.kill()
    assert [c.id for c in boxes_of(docker_client, first.pid)] == [mine[0].id]
    with running(Server.serve(PYFIX, tmp_path / "second", sandbox="docker")) as second:
        assert boxes_of(docker_client, first.pid) == [], second.log()    # swept at start
        with Socket(second.ws_url + "/ws") as ws:
            ws.ask({"type": "reset", "data": {"split": "eval", "index": 1}}, 120)
            assert len(boxes_of(docker_client, second.pid)) == 1
            ws.ask({"type": "reset", "data": {"split": "eval", "index": 2}}, 120)   # the first goes
            assert len(boxes_of(docker_client, second.pid)) == 1
    assert boxes_of(docker_client, second.pid) == []     # and the last with the server
