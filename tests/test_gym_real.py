"""End to end under the REAL NeMo Gym 0.7: the resources server ``write-gym`` writes, played by Gym's
own ``simple_agent`` and CLI, with a scripted fake model (``tests/gym/``).

The Gym roots are written as a user writes them, ``python agentenv.py write-gym BUNDLE ROOT --sandbox
local --max-concurrent-envs 4`` in a subprocess, for ``bundles/gridsim-v1``, ``bundles/notes-v1`` and
a copy of notes-v1 whose env is broken after its rows were written (its Dockerfile's CMD now exits 3
at start). The rows are the written ones, with the fake model's script added to
``responses_create_params.metadata["script"]``; their tools are left as written except in the one
row that shows the mismatch:

* gridsim, an eval day: the exact optimum (battery.py's DP over the row's own prices and battery),
  then a text reply -> reward 1.0; another day, an all-idle schedule -> reward 0.2; a third, a
  reply with no schedule -> reward 0;
* notes ``two-step``: list_notes, end_turn (its output, the second turn's prompt, reaches the
  model), write_note groceries with eggs and milk, then text -> reward 1.0;
* notes ``save-groceries`` with read_note dropped from the row's tools -> masked, reason naming the
  tools, reward 0.0;
* the broken copy's ``save-groceries`` -> masked, reason quoting the env's exit, reward 0.0.

Each resources server runs once through the lightest variant (our ``app.py`` started as Gym starts
it, Gym's ``simple_agent``, the fake model), and all of them together once through the full CLI
(``gym env start`` + ``gym eval run --no-serve``). Nothing may be left running: the harness's
leftovers, the local sandbox's records under this module's ``AGENTENV_STATE_DIR``, and any process
carrying that state dir in its environment (every env process the servers start does) must all be
none. ``agentenv.py eval`` then plays the same rows with the same scripted model (by their
prompts), and its rewards and conversations must be Gym's, row for row. Skipped when the Gym venv isn't built (``bash .ci/gym-venv.sh``); an error instead with
``AGENTENV_REQUIRE_GYM=1``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest


from tests.gym import harness
from tests.harness import (GRIDSIM, NOTES, NamespaceUnavailable, REPO, Server, copy_bundle, environ,
                           gridsim_battery, processes_with_env, read_jsonl, running, write_jsonl)

battery = gridsim_battery()

BROKEN_CMD = '["python", "-c", "import sys; print(\'no config\'); sys.exit(3)"]'
TOL = 1e-9
RESULT_KEYS = ("reward", "mask_sample", "failure_kind", "failure_reason")


# ----------------------------------------------------------------------------- writing the roots

def write_gym(bundle: Path, root: Path, state: Path) -> Path:
    """``python agentenv.py write-gym BUNDLE ROOT --sandbox local --max-concurrent-envs 4``."""
    argv = [sys.executable, str(REPO / "agentenv.py"), "write-gym", str(bundle), str(root),
            "--sandbox", "local", "--max-concurrent-envs", "4"]
    proc = subprocess.run(argv, cwd=REPO, env=environ(state), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}"
    target = Path(proc.stdout.strip().splitlines()[-1].removeprefix("wrote "))
    assert target.parent == root.resolve() / "resources_servers", proc.stdout
    return target


def scripted(row: dict, case: str, script: list[dict], *, drop_tool: str | None = None) -> dict:
    """A written row with the fake model's script (and a ``case`` tag that rides along)."""
    row = json.loads(json.dumps(row))
    params = row["responses_create_params"]
    params.setdefault("metadata", {})["script"] = json.dumps(script)
    if drop_tool:
        params["tools"] = [t for t in params["tools"] if t["name"] != drop_tool]
    row["case"] = case
    return row


def day_of(row: dict) -> tuple[battery.Battery, list[int]]:
    """The battery and prices (cents) of a gridsim row, from its user message's JSON."""
    user = next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")
    day = json.loads(user)
    return battery.Battery.from_dict(day["battery"]), battery.prices_cents(day["prices_usd_per_mwh"])


def by_task(rows: list[dict], stem: str) -> dict:
    found = [r for r in rows if r["task_id"].rsplit("/", 1)[-1] == stem]
    assert len(found) == 1, f"no single row for {stem} in {[r['task_id'] for r in rows]}"
    return found[0]


GROCERIES = {"title": "groceries", "text": "eggs, milk, flour"}
TWO_STEP_HANDOVER = "Now save a note titled 'groceries'"


def notes_rows(rows: list[dict]) -> list[dict]:
    two_step = scripted(by_task(rows, "two-step"), "notes_two_step", [
        {"tool": "list_notes", "args": {}},
        {"tool": "end_turn", "args": {"response": "You have one note: pancakes."}},
        {"tool": "write_note", "args": GROCERIES},
        {"text": "Saved your groceries note."}])
    mismatch = scripted(by_task(rows, "save-groceries"), "notes_tools_mismatch", [
        {"tool": "write_note", "args": GROCERIES}, {"text": "Saved."}], drop_tool="read_note")
    return [two_step, mismatch]


@pytest.fixture(scope="module")
def gym(tmp_path_factory) -> dict[str, Any]:
    """The three resources servers written with write-gym, their scripted rows, and the state dir
    every server of this module records its env processes under."""
    harness.skip_unless_gym_venv()
    base = tmp_path_factory.mktemp("gym-real")
    state = base / "agentenv-state"
    # the notes bundle, copied under another name, whose env is broken once its rows are written
    broken_bundle = base / "bundles" / "notes-broken"
    copy_bundle(broken_bundle)

    t0 = time.monotonic()
    servers = {
        "gridsim": write_gym(GRIDSIM, base / "gridsim-root", state),
        "notes": write_gym(NOTES, base / "notes-root", state),
        "broken": write_gym(broken_bundle, base / "broken-root", state),
    }
    write_seconds = time.monotonic() - t0
    dockerfile = broken_bundle / "envs" / "notebook" / "Dockerfile"
    text = dockerfile.read_text()
    assert 'CMD ["python", "server.py"]' in text
    dockerfile.write_text(text.replace('CMD ["python", "server.py"]', f"CMD {BROKEN_CMD}"))

    written = {"gridsim": read_jsonl(servers["gridsim"] / "data" / "eval.jsonl"),
               "notes": read_jsonl(servers["notes"] / "data" / "all.jsonl"),
               "broken": read_jsonl(servers["broken"] / "data" / "all.jsonl")}

    optimal_row, idle_row, none_row = written["gridsim"][:3]
    bat, cents = day_of(optimal_row)
    best, plan = battery.optimum(cents, bat)
    assert best > 0 and battery.score(battery.profit(plan, cents, bat), best) == 1.0
    idle_bat, idle_cents = day_of(idle_row)
    assert battery.optimum_profit(idle_cents, idle_bat) > 0      # so idling scores exactly 0.2
    rows = {
        "gridsim": [
            scripted(optimal_row, "gridsim_optimal", [
                {"tool": "submit_schedule", "args": {"schedule": plan}}, {"text": "Submitted."}]),
            scripted(idle_row, "gridsim_idle", [
                {"tool": "submit_schedule", "args": {"schedule": [0] * 24}}, {"text": "Idle today."}]),
            scripted(none_row, "gridsim_none", [{"text": "I would rather not trade today."}]),
        ],
        "notes": notes_rows(written["notes"]),
        "broken": [scripted(by_task(written["broken"], "save-groceries"), "broken_env_exits", [
            {"tool": "write_note", "args": GROCERIES}, {"text": "Saved."}])],
    }
    return {"base": base, "state": state, "servers": servers, "written": written, "rows": rows,
            "plan": plan, "write_seconds": write_seconds}


def root_and_name(server: Path) -> tuple[Path, str]:
    return server.parents[1], server.name


@pytest.fixture(scope="module")
def lightest(gym) -> dict[str, harness.LightestRun]:
    """Each resources server once through the lightest variant, all its rows in that run."""
    runs = {}
    for key in ("gridsim", "notes", "broken"):
        root, name = root_and_name(gym["servers"][key])
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AGENTENV_STATE_DIR", str(gym["state"]))
            runs[key] = harness.run_lightest(root, name, gym["rows"][key],
                                             work_dir=gym["base"] / f"lightest-{key}")
        print(f"\n[lightest {key}] timings "
              + " ".join(f"{k}={v:.1f}s" for k, v in runs[key].timings.items()))
    return runs


@pytest.fixture(scope="module")
def cli(gym) -> harness.CliRun:
    """All three resources servers in one ``gym env start``, all rows in one ``gym eval run``."""
    all_rows = [row for key in ("gridsim", "notes", "broken") for row in gym["rows"][key]]
    jsonl = write_jsonl(gym["base"] / "cli-input.jsonl", all_rows)
    (root, name), *more = [root_and_name(gym["servers"][k]) for k in ("gridsim", "notes", "broken")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTENV_STATE_DIR", str(gym["state"]))
        try:
            run = harness.run_cli(root, name, jsonl, work_dir=gym["base"] / "cli", more_servers=more,
                                  reverify=True)
        except NamespaceUnavailable as exc:
            why = (f"gym env start starts Ray, which runs only inside a loopback-only network "
                   f"namespace here, and none could be made ({exc}); run the tests as root")
            if os.environ.get("AGENTENV_REQUIRE_GYM") == "1":
                pytest.fail(f"{why} (AGENTENV_REQUIRE_GYM=1, so this is an error, not a skip)",
                            pytrace=False)
            pytest.skip(why)
    print("\n[cli] timings " + " ".join(f"{k}={v:.1f}s" for k, v in run.timings.items())
          + f"; gym env start exited {run.start_exit_code}")
    print("[cli] the command lines:")
    for line in run.commands:
        print(f"  $ {line}")
    return run


def results(run_results: list[dict]) -> dict[str, dict]:
    out = {}
    for result in run_results:
        assert isinstance(result, dict), f"not a verify JSON: {result!r}"
        out[result["case"]] = result
    return out


def show(case: str, result: dict) -> str:
    return f"{case}: " + json.dumps({k: result.get(k) for k in RESULT_KEYS})


def outputs(result: dict) -> list[dict]:
    return result["response"]["output"]


def tool_outputs(result: dict) -> dict[str, str]:
    """What each function call of the rollout answered, by tool name (the last call of a name)."""
    items = outputs(result)
    names = {i["call_id"]: i["name"] for i in items if i.get("type") == "function_call"}
    return {names[i["call_id"]]: i["output"] for i in items if i.get("type") == "function_call_output"}


# ----------------------------------------------------------------------------- the checks

def check_scored(result: dict, want: float, case: str) -> None:
    assert result.get("mask_sample") is False, show(case, result)
    assert result.get("failure_reason") is None, show(case, result)
    assert abs(float(result["reward"]) - want) <= TOL, show(case, result)


def check_masked(result: dict, case: str, *needles: str) -> None:
    assert result.get("mask_sample") is True, show(case, result)
    assert result.get("reward") == 0.0, show(case, result)
    assert (result.get("instance_config") or {}).get("mask_sample") is True, show(case, result)
    reason = result.get("failure_reason") or ""
    for needle in needles:
        assert needle in reason, f"{case}: {needle!r} not in the failure_reason {reason!r}"


def check_gridsim(got: dict[str, dict], plan: list[int]) -> None:
    optimal, idle = got["gridsim_optimal"], got["gridsim_idle"]
    check_scored(optimal, 1.0, "gridsim_optimal")
    check_scored(idle, 0.2, "gridsim_idle")
    check_scored(got["gridsim_none"], 0.0, "gridsim_none")
    assert [i["type"] for i in outputs(optimal)] == ["function_call", "function_call_output", "message"]
    assert json.loads(outputs(optimal)[0]["arguments"]) == {"schedule": plan}
    assert tool_outputs(optimal)["submit_schedule"].startswith("valid schedule recorded")
    assert "profit $0.0000" in tool_outputs(idle)["submit_schedule"]


def check_two_step(result: dict) -> None:
    check_scored(result, 1.0, "notes_two_step")
    called = [i["name"] for i in outputs(result) if i.get("type") == "function_call"]
    assert called == ["list_notes", "end_turn", "write_note"]
    answered = tool_outputs(result)
    assert "pancakes" in answered["list_notes"]
    assert answered["end_turn"].startswith(TWO_STEP_HANDOVER), answered["end_turn"]   # turn 2's prompt


def check_mismatch(result: dict) -> None:
    check_masked(result, "notes_tools_mismatch", "the row offers the tools", "read_note",
                 "write the rows again with write-gym")
    assert result.get("failure_kind") == "agentenv:tools_mismatch", show("notes_tools_mismatch", result)


def check_broken(result: dict) -> None:
    check_masked(result, "broken_env_exits", "the environment failed", "exited with code 3",
                 "no config")


def model_saw_handover(requests: list[tuple[str, Any]]) -> bool:
    """Whether a request of the two-step row showed the model end_turn's output (turn 2's prompt)."""
    for path, body in requests:
        if not path.endswith("/responses") or not isinstance(body, dict):
            continue
        for item in body.get("input") or []:
            if isinstance(item, dict) and item.get("type") == "function_call_output" \
                    and str(item.get("output", "")).startswith(TWO_STEP_HANDOVER):
                return True
    return False


# ----------------------------------------------------------------------------- tests

def test_written_rows_keep_their_tools(gym):
    """The rows played are write-gym's, tools and all (but the one row that drops a tool)."""
    for key in ("gridsim", "notes"):
        written = {r["task_id"]: r["responses_create_params"]["tools"] for r in gym["written"][key]}
        for row in gym["rows"][key]:
            tools = row["responses_create_params"]["tools"]
            if row["case"] == "notes_tools_mismatch":
                assert len(tools) == len(written[row["task_id"]]) - 1
            else:
                assert tools == written[row["task_id"]]
    names = [t["name"] for t in gym["rows"]["gridsim"][0]["responses_create_params"]["tools"]]
    assert names == ["submit_schedule", "end_turn"]
    print(f"\n[write-gym] 3 roots written in {gym['write_seconds']:.1f}s")


def test_lightest_gridsim_rewards(gym, lightest):
    got = results(lightest["gridsim"].results)
    for case, result in got.items():
        print(f"[lightest] {show(case, result)}")
    check_gridsim(got, gym["plan"])


def test_lightest_notes_two_step_through_end_turn(lightest):
    got = results(lightest["notes"].results)
    print(f"[lightest] {show('notes_two_step', got['notes_two_step'])}")
    check_two_step(got["notes_two_step"])
    assert model_saw_handover(lightest["notes"].model_requests)


def test_lightest_row_whose_tools_differ_is_masked(lightest):
    got = results(lightest["notes"].results)
    print(f"[lightest] {show('notes_tools_mismatch', got['notes_tools_mismatch'])}")
    check_mismatch(got["notes_tools_mismatch"])


def test_lightest_env_that_exits_at_start_is_masked(lightest):
    got = results(lightest["broken"].results)
    print(f"[lightest] {show('broken_env_exits', got['broken_env_exits'])}")
    check_broken(got["broken_env_exits"])


def test_cli_rollouts(gym, cli):
    rows = [row for key in ("gridsim", "notes", "broken") for row in gym["rows"][key]]
    assert sorted(r["case"] for r in cli.rollouts) == sorted(r["case"] for r in rows)
    for rollout in cli.rollouts:
        print(f"[cli] {show(rollout['case'], rollout)}")
        for key in ("reward", "mask_sample", "failure_reason"):
            assert key in rollout, f"{rollout['case']}: no {key} in the rollout line"
    got = results(cli.rollouts)
    check_gridsim(got, gym["plan"])
    check_two_step(got["notes_two_step"])
    assert model_saw_handover(cli.model_requests)
    check_mismatch(got["notes_tools_mismatch"])
    check_broken(got["broken_env_exits"])


def test_cli_aggregate_metrics(cli):
    assert (cli.output_dir / "rollouts_aggregate_metrics.json").is_file(), \
        sorted(p.name for p in cli.output_dir.iterdir())
    assert cli.aggregate is not None
    print(f"[cli] aggregate metrics: {json.dumps(cli.aggregate)[:600]}")


def test_cli_reverify_recomputes_every_reward(cli):
    """``gym eval reverify`` on the run's rollouts, against the servers write-gym wrote: it asks
    GET /reverify_mode (stateless, so no --force), and each /verify, with no session, replays the
    rollout on a fresh episode: the same rewards and the same masks, for the same reasons."""
    log = cli.logs["gym-eval-reverify"].read_text(errors="replace")
    assert "reverify_mode=UNSUPPORTED" not in log
    again = {r["case"]: r for r in cli.reverified}
    assert sorted(again) == sorted(r["case"] for r in cli.rollouts), log[-3000:]
    for rollout in cli.rollouts:
        redone = again[rollout["case"]]
        print(f"[reverify] {show(rollout['case'], redone)}")
        assert (redone["reward"], redone["mask_sample"], redone.get("failure_kind")) == \
            (rollout["reward"], rollout["mask_sample"], rollout.get("failure_kind")), rollout["case"]
    check_two_step(again["notes_two_step"])
    check_mismatch(again["notes_tools_mismatch"])
    assert cli.reverify_aggregate, "gym eval reverify wrote no aggregate metrics"
    print(f"[reverify] it left {len(cli.reverify_left)} servers running, SIGINTed")
    keys = {k for entry in cli.reverify_aggregate for k in entry["agent_metrics"]}
    assert {"mean/reward", "std/reward", "coverage/masked_rollouts"} <= keys


def gym_unregistered(kinds: list[str]) -> list[str]:
    """The kinds Gym 0.7's own ``nemo_gym.failure_kinds`` neither registers nor takes as namespaced."""
    code = ("import json, sys; from nemo_gym.failure_kinds import is_registered, is_namespaced; "
            "print(json.dumps([k for k in json.loads(sys.argv[1]) "
            "if not (is_registered(k) or is_namespaced(k))]))")
    proc = subprocess.run([str(harness.gym_venv() / "bin" / "python"), "-c", code, json.dumps(kinds)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_cli_failure_kinds_are_in_gyms_vocabulary(cli):
    kinds = sorted({r["failure_kind"] for r in cli.rollouts if r.get("failure_kind")})
    assert kinds, "no masked rollout carried a failure_kind"
    log = cli.logs["gym-env-start"].read_text(errors="replace")
    warned = sorted(set(re.findall(r"unregistered failure_kind '([^']*)'", log)))
    print(f"[cli] failure kinds {kinds}; Gym warned about {warned}")
    assert gym_unregistered(kinds) == []
    assert warned == []


def test_gyms_own_session_contract_check_passes(tmp_path):
    """NeMo Gym 0.7's check_resources_session_contract (keeps_state=True), run in the Gym venv
    against serve's Gym routes: a repeated seed is the same session, close is idempotent with
    Gym's typed reply, and no seed after a close creates the session again."""
    harness.skip_unless_gym_venv()
    venv = harness.gym_venv()
    with running(Server.serve(NOTES, tmp_path)) as server:
        proc = subprocess.run(
            [str(venv / "bin" / "python"), str(REPO / "tests" / "gym" / "session_contract.py"),
             server.url, json.dumps({"split": "all", "index": 1})],
            env=harness.child_env(venv, "session-contract"), capture_output=True, text=True,
            timeout=300)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
        assert "contract holds" in proc.stdout
        server.no_envs()


def _processes_with_state(state: Path) -> list[tuple[int, str]]:
    """Live processes whose environment carries AGENTENV_STATE_DIR=state: our servers' envs."""
    return processes_with_env("AGENTENV_STATE_DIR", str(state))


def test_nothing_left_running(gym, lightest, cli):
    for key, run in lightest.items():
        assert run.leftovers == [], f"lightest {key} left {run.leftovers}"
    assert cli.leftovers == [], f"the CLI run left {cli.leftovers}"
    assert cli.start_exit_code is not None
    records = [p for p in gym["state"].rglob("*") if p.is_file()] if gym["state"].exists() else []
    assert records == [], f"local env processes still recorded: {records}"
    assert _processes_with_state(gym["state"]) == []


DIFFERENTIAL = ("gridsim_optimal", "gridsim_idle", "gridsim_none", "notes_two_step")


def conversation(line: dict) -> list[tuple]:
    """A rollout's conversation, without the ids each side makes up."""
    shown = []
    for item in line["response"]["output"]:
        if item.get("type") == "function_call":
            shown.append(("call", item["name"], json.loads(item["arguments"])))
        elif item.get("type") == "function_call_output":
            shown.append(("output", item["output"]))
        elif item.get("type") == "message":
            shown.append(("message", "".join(p.get("text", "") for p in item["content"])))
    return shown


def test_eval_scores_the_rows_as_simple_agent_does(gym, cli, tmp_path):
    """agentenv.py eval over the same rows and scripted model as the CLI run: the same rewards and
    the same conversations, row for row."""
    import agentenv
    from tests.gym import fake_model

    rows = {row["case"]: row for key in ("gridsim", "notes") for row in gym["rows"][key]}
    scripts = {}
    for case in DIFFERENTIAL:
        params = rows[case]["responses_create_params"]
        user = next(m["content"] for m in params["input"] if m["role"] == "user")
        scripts[user] = json.loads(params["metadata"]["script"])
    ours = {}
    with fake_model.start(scripts=scripts) as model:
        for bundle, split, limit in ((GRIDSIM, "eval", 3), (NOTES, "all", None)):
            plan = agentenv.EvalPlan(source=str(bundle), model_url=model.base_url, model="fake",
                                     api="responses", splits=(split,), limit=limit,
                                     settings=agentenv.Settings.of(sandbox="local"),
                                     output=str(tmp_path / f"{bundle.name}.jsonl"))
            for line in asyncio.run(agentenv.evaluate(plan)):
                ours[line["task_id"]] = line
    theirs = results(cli.rollouts)
    for case in DIFFERENTIAL:
        mine, gyms = ours[rows[case]["task_id"]], theirs[case]
        print(f"[eval] {show(case, mine)}  [gym] {show(case, gyms)}")
        assert (mine["reward"], mine["mask_sample"]) == (gyms["reward"], gyms["mask_sample"]), case
        assert conversation(mine) == conversation(gyms), case
