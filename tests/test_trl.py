"""TRL: a bundle as GRPOTrainer's environment_factory (agentenv.trl_environment), its rows
(trl_dataset) and its reward (trl_reward), against ``serve`` and a bundle folder.

With this environment's python (no TRL needed: the environments are plain classes), against a
``serve`` the harness starts with the local sandbox:

* ``test_a_rollout_holds_a_session_from_reset_to_reward``: resets return at once and overlap, the
  tools play the turn (a tool's error raised, as TRL hands it to the model), end_turn hands over
  a two-turn task's next prompt, trl_reward scores every episode as the server does and closes
  its session; the list_tools the class was built from is no episode in /metrics.
* ``test_a_crashed_or_killed_trainer_leaves_no_session_though_a_forked_child_lives``: a training
  script that raises, or is killed with SIGKILL, while a process it forked (as a DataLoader's
  worker) still runs and holds copies of its connections: the server ends every session at once.
* ``test_at_capacity_a_reset_waits_its_turn_and_says_once_how_to_raise_it`` (another client holds
  a slot, then frees it) and ``test_a_batch_larger_than_the_server_fails_its_extra_resets_at_once``
  (masked at once, saying to raise --max-concurrent-envs, where waiting could never end).
* ``test_a_session_the_server_reaped_is_masked_then_opened_again``: an idle-timeout mid-step.
* ``test_several_toolsets_give_each_row_its_own_tools``: a bundle of two toolsets, as a folder and
  through serve: TRL's mapping of one class per toolset, rows routed by ``environment``.

With the TRL venv (.ci/trl-venv.sh: TRL 1.16.0 on torch 2.13.0's CPU wheel; absent, these skip,
or fail under AGENTENV_REQUIRE_TRL=1), as a user's script (tests/trl/train.py):

* ``test_grpo_trains_through_serve_and_a_bundle_folder``: TRL's real GRPOTrainer on a tiny model
  built locally, a few steps on gridsim-v1 and notes-v1 (reply-graded; two turns) through
  ``serve``, then gridsim-v1 as a folder: every rollout played and scored by the server, TRL's
  logged reward the mean of the server's scores for those episodes, the weights changed, no
  session open once the script has exited; and transformers' own get_json_schema of a class built
  from tools of every JSON type.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


import agentenv
from tests.harness import (GRIDSIM, NOTES, Page, REPO, Socket, alive, copy_bundle, environ,
                           processes_with_env, scrape, serving, unavailable, wait_until)

pytest.importorskip("prometheus_client", reason="the tests read /metrics: pip install -e .")

TRL_VENV = Path(os.environ.get("AGENTENV_TRL_VENV")
                or Path.home() / ".cache" / "agentenv-tests" / "trl-1.16.0")
# notes-v1's tasks in the split "all": the reply that scores 1, and the calls that make it so
RECALL, SAVE, TWO_STEP = 0, 1, 2


def reply(text: str) -> list[dict]:
    """A TRL completion whose last message is the model's reply ``text``."""
    return [{"role": "assistant", "content": text}]


def sessions(server) -> float:
    return scrape(server.url).value("agentenv_sessions", wire="openenv")


class Trainer:
    """trl_environment's class for a test, and the closing of its client at the end (a training
    script's process does it at exit)."""

    def __init__(self, source, **settings):
        self.made = agentenv.trl_environment(str(source), **settings)
        classes = self.made.values() if isinstance(self.made, dict) else [self.made]
        self.client = next(iter(classes))._client

    def __enter__(self):
        return self.made

    def __exit__(self, *exc):
        self.client.close()


# ================================================================ without TRL

def test_a_rollout_holds_a_session_from_reset_to_reward(tmp_path):
    with serving(NOTES, tmp_path) as server, Trainer(server.url) as Env:
        assert sessions(server) == 0
        names = sorted(n for n in vars(Env) if not n.startswith("_"))
        assert names == ["end_turn", "list_notes", "read_note", "write_note"]
        rows = agentenv.trl_dataset(server.url, "all")
        assert [(r["split"], r["index"], r["task"]) for r in rows] == \
            [("all", 0, "recall-recipe"), ("all", 1, "save-groceries"), ("all", 2, "two-step")]
        assert rows[RECALL]["prompt"][0]["role"] == "system" and "eggs" in rows[RECALL]["prompt"][1]["content"]

        envs = [Env() for _ in range(4)]
        started = time.monotonic()
        for env, row in zip(envs, [*rows, rows[RECALL]]):
            assert env.reset(**row) is None             # TRL appends nothing: the prompt is the row's
        assert time.monotonic() - started < 1.0, "the resets waited for their deploys"
        recall, save, two, wrong = envs
        assert recall.read_note(title="pancakes") == "2 eggs, 1 cup milk, 1 cup flour"
        with pytest.raises(agentenv.TrlToolError, match="no note titled 'soup'"):
            wrong.read_note(title="soup")               # the model's mistake: it reads the error
        assert save.write_note(title="groceries", text="eggs and milk") == "saved note 'groceries'"
        assert two.list_notes() == "pancakes"
        assert "save a note titled 'groceries'" in two.end_turn(response="pancakes")
        assert two.write_note(title="groceries", text="2 eggs, milk, flour") == "saved note 'groceries'"
        assert sessions(server) == 4

        metrics: list = []
        rewards = agentenv.trl_reward([reply("2"), reply("Saved."), reply("Saved."), reply("3")],
                                      envs, log_metric=lambda *m: metrics.append(m))
        assert rewards == [1.0, 1.0, 1.0, 0.0]
        assert metrics == [("agentenv/masked_rollouts", 0.0)]
        page = scrape(server.url)
        assert page.value("agentenv_sessions", wire="openenv") == 0
        assert page.by("agentenv_episodes_total", "outcome") == {("scored",): 4}   # no probe
        assert page.value("agentenv_reward_sum", split="all") == 3.0


CRASHING = '''
import json, os, signal, sys, time
import agentenv

url, how = sys.argv[1], sys.argv[2]
Env = agentenv.trl_environment(url)
envs = [Env() for _ in range(3)]
for env, row in zip(envs, agentenv.trl_dataset(url, "all")):
    env.reset(**row)
for env in envs:
    env.list_notes()                      # each session open, its episode at its first turn
child = os.fork()                         # as a DataLoader's worker: it holds copies of them all
if child == 0:
    time.sleep(120)
    os._exit(0)
print(json.dumps({"child": child}), flush=True)
if how == "crash":
    raise RuntimeError("the trainer crashed")
os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.mark.parametrize("how", ["crash", "kill"])
def test_a_crashed_or_killed_trainer_leaves_no_session_though_a_forked_child_lives(tmp_path, how):
    script = tmp_path / "train.py"
    script.write_text(CRASHING)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with serving(NOTES, tmp_path / "serve") as server:
        with open(out, "w") as stdout, open(err, "w") as stderr:     # the child holds no pipe
            done = subprocess.run([sys.executable, str(script), server.url, how], stdout=stdout,
                                  stderr=stderr, timeout=120,
                                  env=environ(tmp_path / "state", PYTHONPATH=str(REPO)))
        child = json.loads(out.read_text().splitlines()[0])["child"]
        try:
            if how == "crash":
                assert done.returncode == 1 and "the trainer crashed" in err.read_text(), err.read_text()
            else:
                assert done.returncode == -signal.SIGKILL, err.read_text()
            # the child keeps running, and its copies of the connections open, but not the sessions
            wait_until(lambda: sessions(server) == 0, 10, "the server ends the trainer's sessions")
            assert alive(child), "the forked child is gone: the test proves nothing"
            page = scrape(server.url)
            assert page.value("agentenv_episodes_live") in (0, 1, 2, 3)
            wait_until(lambda: scrape(server.url).value("agentenv_episodes_live") == 0, 30,
                       "every episode is torn down")
        finally:
            os.kill(child, signal.SIGKILL)


def test_at_capacity_a_reset_waits_its_turn_and_says_once_how_to_raise_it(tmp_path, caplog):
    with serving(NOTES, tmp_path, "--max-concurrent-envs", "2") as server, \
            Trainer(server.url) as Env:
        rows = agentenv.trl_dataset(server.url, "all")
        other = Socket(server.ws_url + "/ws")                 # another client holds one slot
        other.ask({"type": "reset", "data": {"split": "all", "index": 0}})
        mine, waiting = Env(), Env()
        mine.reset(**rows[RECALL])
        assert mine.read_note(title="pancakes").startswith("2 eggs")
        waiting.reset(**rows[SAVE])                          # at capacity: it waits its turn
        threading.Timer(2.0, other.close).start()
        started = time.monotonic()
        assert waiting.list_notes() == "(no notes)"
        assert time.monotonic() - started > 1.0, "the reset did not wait for a slot"
        said = [r.getMessage() for r in caplog.records if r.name == "agentenv.trl"]
        assert len(said) == 1 and "at its limit of 2 sessions" in said[0] and \
            "--max-concurrent-envs" in said[0] and "generation_batch_size" in said[0], said
        assert agentenv.trl_reward([reply("2"), reply("")], [mine, waiting]) == [1.0, 0.0]


def test_a_batch_larger_than_the_server_fails_its_extra_resets_at_once(tmp_path, caplog):
    with serving(NOTES, tmp_path, "--max-concurrent-envs", "2") as server, \
            Trainer(server.url) as Env:
        rows = agentenv.trl_dataset(server.url, "all")
        envs = [Env() for _ in range(3)]
        for env in envs:
            env.reset(**rows[RECALL])
        started, answers = time.monotonic(), []
        for env in envs:
            try:
                answers.append(env.read_note(title="pancakes"))
            except agentenv.TrlToolError as exc:
                answers.append(exc)
        failed = [a for a in answers if isinstance(a, Exception)]
        assert len(failed) == 1, answers
        assert time.monotonic() - started < 30, "the reset waited out reset_timeout"
        assert "plays at most 2 sessions at once, and this trainer holds 2" in str(failed[0])
        assert "--max-concurrent-envs" in str(failed[0]) and "the rollout will be masked" in str(failed[0])
        rewards = agentenv.trl_reward([reply("2")] * 3, envs)
        assert sorted(rewards, key=lambda r: r is None) == [1.0, 1.0, None]
        assert any("1 of 3 rollouts left out of the reward" in r.getMessage() for r in caplog.records)
        assert scrape(server.url).by("agentenv_episodes_total", "outcome") == {("scored",): 2}


def test_a_session_the_server_reaped_is_masked_then_opened_again(tmp_path, caplog):
    with serving(NOTES, tmp_path, "--idle-timeout", "1") as server, Trainer(server.url) as Env:
        row = agentenv.trl_dataset(server.url, "all")[RECALL]
        env = Env()
        env.reset(**row)
        assert env.read_note(title="pancakes").startswith("2 eggs")
        wait_until(lambda: scrape(server.url).value("agentenv_idle_reaps_total", wire="openenv") == 1,
                   30, "the idle session is reaped")          # as TRL generates for its batch
        with pytest.raises(agentenv.TrlToolError, match="was idle past 1s"):
            env.read_note(title="pancakes")
        assert agentenv.trl_reward([reply("2")], [env]) == [None]
        assert any("left out of the reward" in r.getMessage() and "idle" in r.getMessage()
                   for r in caplog.records)
        env.reset(**row)                                      # the next step: a session anew
        assert env.read_note(title="pancakes").startswith("2 eggs")
        assert agentenv.trl_reward([reply("2")], [env]) == [1.0]
        assert sessions(server) == 0


def two_toolsets(root: Path) -> Path:
    """notes-v1 with one GridSim day beside it: the toolsets notebook and gridsim."""
    copy_bundle(root)
    shutil.copytree(GRIDSIM / "envs" / "gridsim", root / "envs" / "gridsim")
    shutil.copytree(GRIDSIM / "artifacts" / "check_schedule", root / "artifacts" / "check_schedule")
    day = sorted((GRIDSIM / "tasks").glob("*.json"))[0]
    shutil.copy(day, root / "tasks" / "z-day.json")
    return root


def test_several_toolsets_give_each_row_its_own_tools(tmp_path):
    bundle = two_toolsets(tmp_path / "mixed-v1")
    rows = agentenv.trl_dataset(bundle, "all")
    assert [r["environment"] for r in rows] == ["notebook", "notebook", "notebook", "gridsim"]
    with serving(bundle, tmp_path / "serve") as server:
        assert agentenv.trl_dataset(server.url, "all") == rows
        for source, settings in ((bundle, {"sandbox": "local"}), (server.url, {})):
            with Trainer(source, **settings) as classes:
                assert sorted(classes) == ["gridsim", "notebook"]
                tools = {name: sorted(n for n in vars(cls) if not n.startswith("_"))
                         for name, cls in classes.items()}
                assert tools == {"gridsim": ["end_turn", "submit_schedule"],
                                 "notebook": ["end_turn", "list_notes", "read_note", "write_note"]}
                day, note = classes["gridsim"](), classes["notebook"]()
                day.reset(**rows[3])
                assert "profit" in day.submit_schedule(schedule=[0] * 24)
                with pytest.raises(agentenv.AgentEnvError, match="plays the toolset gridsim, not "
                                                                 "this environment's notebook"):
                    note.reset(**rows[3])
                note.reset(**rows[RECALL])
                assert agentenv.trl_reward([reply("done"), reply("2")], [day, note]) == [0.2, 1.0]


# ================================================================ with TRL's GRPOTrainer

def trl_python() -> str:
    """The TRL venv's python, once .ci/trl-venv.sh has built it whole."""
    python = TRL_VENV / "bin" / "python"
    if not (TRL_VENV / ".agentenv-trl-complete").is_file() or not python.is_file():
        unavailable(f"TRL's venv is not built at {TRL_VENV} (TRL 1.16.0 on torch 2.13.0's CPU "
                    "wheel): bash .ci/trl-venv.sh builds it", "AGENTENV_REQUIRE_TRL")
    return str(python)


EVERY_TYPE = [
    {"name": "every", "description": "Every JSON type. Returns: nothing.", "input_schema": {
        "type": "object", "required": ["text", "count"], "additionalProperties": False,
        "properties": {
            "text": {"type": "string", "description": "Some text.", "minLength": 1},
            "count": {"type": "integer"}, "ratio": {"type": "number", "maximum": 1},
            "flag": {"type": "boolean"}, "nothing": {"type": "null"},
            "hours": {"type": "array", "items": {"type": "integer", "minimum": 0},
                      "minItems": 24, "maxItems": 24, "description": "One a\n  line."},
            "point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
            "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
            "drink": {"enum": ["tea", "coffee"]}, "maybe": {"type": ["string", "null"]},
            "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "self": {"type": "string"},
            "anything": {}}}},
    {"name": "bare", "description": "", "input_schema": {"type": "object", "properties": {}}},
]


def test_grpo_trains_through_serve_and_a_bundle_folder(tmp_path):
    python = trl_python()
    out, tools = tmp_path / "result.json", tmp_path / "tools.json"
    tools.write_text(json.dumps(EVERY_TYPE))
    state = tmp_path / "state"
    # twice TRL's batch: a step's resets never wait for the last step's episodes to be torn down
    room = ("--max-concurrent-envs", "16")
    with serving(GRIDSIM, tmp_path / "gridsim", *room) as grid, \
            serving(NOTES, tmp_path / "notes", *room) as notes:
        started = time.monotonic()
        done = subprocess.run(
            [python, str(REPO / "tests" / "trl" / "train.py"), "--out", str(out), "--schemas",
             str(tools), "--run", f"gridsim={grid.url}", "--run", f"notes={notes.url}",
             "--run", f"gridsim={GRIDSIM}"],
            cwd=REPO, capture_output=True, text=True, timeout=900,
            env=environ(state, TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false"))
        took = time.monotonic() - started
        assert done.returncode == 0, done.stderr[-6000:]
        result = json.loads(out.read_text())
        print(f"train.py took {took:.1f}s: {json.dumps(result['timings'])}")
        gridsim, notes_run, folder = result["runs"]
        for run in (gridsim, notes_run, folder):
            print(f"{run['name']} from {run['source']}: rewards by step {run['logged_rewards']}, "
                  f"step times {[round(t, 2) for t in run['step_seconds']]} s, TRL's "
                  f"{len(run['reset_seconds'])} resets {sum(run['reset_seconds']):.3f} s in all")
            scored = check_run(run)
            server = {id(gridsim): grid, id(notes_run): notes}.get(id(run))
            page = scrape(server.url) if server else Page(run["metrics"])
            split = "train" if run["name"] == "gridsim" else "all"
            # every rollout played and scored by the server, and nothing else counted as an episode
            assert page.by("agentenv_episodes_total", "outcome") == {("scored",): len(scored)}
            assert page.value("agentenv_reward_count", split=split) == len(scored)
            assert page.value("agentenv_reward_sum", split=split) == pytest.approx(sum(scored))
            assert page.value("agentenv_sessions", wire="openenv") == 0
        # the script has exited: no session of its is open anywhere, no env of its runs
        assert sessions(grid) == 0 and sessions(notes) == 0
        assert not processes_with_env("AGENTENV_STATE_DIR", str(state))
    check_schemas(result["schemas"])


def check_run(run: dict) -> list[float]:
    """What held in one GRPO run; the rewards trl_reward gave, every one the server's score."""
    calls = run["returned"]
    assert len(calls) == len(run["logged_rewards"]) == len(run["step_seconds"]) >= 2
    rewards = [[reward for reward, _ in call] for call in calls]
    assert all(len(call) == 8 and None not in call for call in rewards), (rewards, run["said"])
    for logged, call in zip(run["logged_rewards"], rewards):
        assert logged == pytest.approx(statistics.mean(call), abs=1e-6), (logged, call)
    assert any(len(set(call)) > 1 for call in rewards), f"no step's rewards varied: {rewards}"
    assert run["changed_tensors"] > 0, f"no weight moved in {run['tensors']} tensors"
    assert len(run["reset_seconds"]) == 8 * len(calls) and run["pool"] == 8
    return [r for call in rewards for r in call]


def check_schemas(schemas: dict) -> None:
    """transformers' get_json_schema of the class trl_class builds: what the model is shown."""
    every = schemas["every"]["function"]
    assert every["description"] == "Every JSON type. Returns - nothing."
    parameters = every["parameters"]
    assert parameters["required"] == ["text", "count"]
    props = parameters["properties"]
    assert props["text"] == {"type": "string",
                             "description": 'Some text. (JSON schema: {"minLength": 1})'}
    assert props["count"] == {"type": "integer", "description": "The count."}
    assert props["ratio"] == {"type": "number", "description": 'The ratio. (JSON schema: {"maximum": 1})'}
    assert props["flag"]["type"] == "boolean" and props["nothing"]["type"] == "null"
    assert props["hours"] == {"type": "array", "items": {"type": "integer"}, "description":
                              'One a line. (JSON schema: {"minItems": 24, "maxItems": 24, '
                              '"items": {"minimum": 0}})'}
    assert props["point"]["type"] == "object" and '"required": ["x"]' in props["point"]["description"]
    assert props["counts"] == {"type": "object", "additionalProperties": {"type": "integer"},
                               "description": "The counts."}
    assert props["drink"] == {"type": "string", "enum": ["tea", "coffee"], "description": "The drink."}
    assert props["maybe"] == {"type": "string", "nullable": True, "description": "The maybe."}
    assert props["either"]["type"] == ["integer", "string"]
    assert props["self"]["type"] == "string" and props["anything"] == {"description": "The anything."}
    assert schemas["bare"]["function"] == {"name": "bare", "description": "The bare tool.",
                                           "parameters": {"type": "object", "properties": {}}}
    assert schemas["end_turn"]["function"]["parameters"] == {
        "type": "object", "properties": {"response": {"type": "string", "description": "Your reply."}}}
