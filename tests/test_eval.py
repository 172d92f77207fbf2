"""``python agentenv.py eval``: a model scored on a bundle's split, played against the scripted fake
model (tests/gym/fake_model.py) on both APIs, with the envs in the local sandbox.

* gridsim-v1's eval days: the exact optimum scores 1.0, idling 0.2, a reply with no schedule 0,
  over Chat Completions and over Responses (each found by the probe, the other API left out);
* notes-v1's two-turn task hands its second prompt over through end_turn, and the rollout stops
  at end_turn's last answer;
* the endpoint's faults: 429s and 500s retried, a hang cut by --request-timeout and retried, a
  500 past the retries and a refusal recorded as the model's failures (masked, counted apart),
  malformed tool calls answered as text the model reads; an endpoint that never answers, and a
  run whose every rollout failed, exit non-zero;
* a run killed with SIGKILL and rerun with the same --output plays exactly the rollouts it had
  not finished, and leaves no env process behind; SIGTERM stops a run, its envs torn down.

The fake model runs on a thread of the test process; eval runs in-process (``agentenv.main``) or,
to be killed, as a subprocess.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


import agentenv
from tests.gym import fake_model
from tests.harness import (GRIDSIM, NOTES, PYFIX, REPO, environ, gridsim_battery,
                           processes_with_env, read_jsonl, wait_until)

battery = gridsim_battery()

GROCERIES = {"title": "groceries", "text": "eggs, milk, flour"}


def prompts(bundle: Path, split: str) -> list[str]:
    return [t.first_prompt[0] for t in agentenv.Bundle.load(bundle).splits[split]]


def eval_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``python agentenv.py eval ...`` in this process: its exit code, stdout and stderr."""
    code = agentenv.main(["eval", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def by_task(lines: list[dict]) -> dict[str, dict]:
    return {line["task_id"].rsplit("/", 1)[-1]: line for line in lines}


def items(line: dict, kind: str) -> list[dict]:
    return [i for i in line["response"]["output"] if i.get("type") == kind]


def gridsim_scripts() -> dict[str, list[dict]]:
    """The first three eval days: the exact optimum, an idle day, and a reply with no schedule."""
    days = prompts(GRIDSIM, "eval")[:3]
    day = json.loads(days[0])
    bat, cents = battery.Battery.from_dict(day["battery"]), battery.prices_cents(day["prices_usd_per_mwh"])
    _, plan = battery.optimum(cents, bat)
    idle = json.loads(days[1])
    assert battery.optimum_profit(battery.prices_cents(idle["prices_usd_per_mwh"]),
                                  battery.Battery.from_dict(idle["battery"])) > 0   # idle: exactly 0.2
    return {days[0]: [{"tool": "submit_schedule", "args": {"schedule": plan}}, {"text": "Submitted."}],
            days[1]: [{"tool": "submit_schedule", "args": {"schedule": [0] * 24}}, {"text": "Idle."}],
            days[2]: [{"text": "I would rather not trade today."}]}


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_gridsim_optimal_idle_and_no_schedule(tmp_path, capsys, api):
    out = tmp_path / "rollouts.jsonl"
    with fake_model.start(scripts=gridsim_scripts(), apis=(api,)) as model:
        code, stdout, stderr = eval_cli(capsys, str(GRIDSIM), "--model-url", model.base_url,
                                        "--model", "fake", "--limit", "3", "--sandbox", "local",
                                        "--output", str(out))
    assert code == 0, stderr
    said = "answers the Responses API" if api == "responses" else "has no Responses API, so eval speaks Chat"
    assert said in stdout
    paths = {path for path, _ in model.requests if path != "/v1/models"}
    assert paths == {"/v1/chat/completions" if api == "chat" else "/v1/responses"}
    lines = read_jsonl(out)
    assert len(lines) == 3
    rewards = [line["reward"] for line in sorted(lines, key=lambda line: line["_ng_task_index"])]
    assert rewards == [1.0, pytest.approx(0.2), 0.0]
    for line in lines:
        # NeMo Gym's rollout shape: the row, the conversation, the verdict, Gym's stamps; ours beside
        assert line["mask_sample"] is False and line["failure_kind"] is None
        assert line["split"] == "eval" and line["_ng_rollout_index"] == 0
        assert line["responses_create_params"]["tools"][-1]["name"] == "end_turn"
        assert line["response"]["usage"]["input_tokens"] > 0 and line["response"]["usage"]["output_tokens"] > 0
        assert line["api"] == api and line["model"] == "fake" and line["stop_reason"] == "reply"
        assert line["timings"]["seconds"] >= line["timings"]["model_seconds"] > 0
    best = next(line for line in lines if line["_ng_task_index"] == 0)
    assert [i["type"] for i in best["response"]["output"]] == ["function_call", "function_call_output",
                                                               "message"]
    assert items(best, "function_call_output")[0]["output"].startswith("valid schedule recorded")
    assert "split eval: mean reward 0.400 ± " in stdout and "3 scored of 3" in stdout
    assert "the model's failures: none" in stdout and "masked by the environment: none" in stdout
    assert "eval: 3/3 rollouts" in stderr and "mean reward 0.400" in stderr      # the progress line


def test_notes_two_step_through_end_turn(tmp_path, capsys):
    two_step = prompts(NOTES, "all")[2]
    scripts = {two_step: [{"tool": "list_notes", "args": {}},
                          {"tool": "end_turn", "args": {"response": "You have one note: pancakes."}},
                          {"tool": "write_note", "args": GROCERIES},
                          {"tool": "end_turn", "args": {"response": "Saved your groceries note."}}]}
    out = tmp_path / "rollouts.jsonl"
    with fake_model.start(scripts=scripts) as model:
        code, stdout, stderr = eval_cli(capsys, str(NOTES), "--split", "all", "--model-url", model.base_url,
                                        "--model", "fake", "--api", "chat", "--sandbox", "local",
                                        "--output", str(out))
    assert code == 0, stderr
    line = by_task(read_jsonl(out))["two-step"]
    assert line["reward"] == 1.0 and line["mask_sample"] is False
    answers = [i["output"] for i in items(line, "function_call_output")]
    assert answers[1].startswith("Now save a note titled 'groceries'")      # turn 2's prompt
    assert answers[3] == agentenv.EPISODE_OVER
    assert line["stop_reason"] == "end_turn" and line["model_calls"] == 4   # no call after the end
    chats = [body for path, body in model.requests if path == "/v1/chat/completions"
             and body["messages"][1]["content"] == two_step]
    assert len(chats) == 4
    last = chats[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user"] + ["assistant", "tool"] * 3
    assert last[-1]["content"] == answers[2] and last[-1]["tool_call_id"] == last[-2]["tool_calls"][0]["id"]
    assert any(t["function"]["name"] == "end_turn" for t in chats[0]["tools"])


def test_eval_takes_serves_deadline_flags_and_honours_bash_timeout(tmp_path, capsys):
    """eval takes the sandbox, pool and deadline flags check and serve take: --bash-timeout 2 cuts
    the model's `sleep 30` in its box at 2 s (it reads that the command timed out, and plays on),
    where the default would let it run its 30 s."""
    task = prompts(PYFIX, "eval")[0]
    scripts = {task: [{"tool": "bash", "args": {"command": "sleep 30; echo slept"}},
                      {"text": "I could not fix it."}]}
    out = tmp_path / "rollouts.jsonl"
    started = time.monotonic()
    with fake_model.start(scripts=scripts) as model:
        code, stdout, stderr = eval_cli(capsys, str(PYFIX), "--model-url", model.base_url,
                                        "--model", "fake", "--limit", "1", "--sandbox", "local",
                                        "--bash-timeout", "2", "--output", str(out))
    took = time.monotonic() - started
    assert code == 0, stderr
    [line] = read_jsonl(out)
    said = items(line, "function_call_output")[0]["output"]
    assert said.startswith("error: the command timed out after 2s"), said
    assert "slept" not in said
    assert (line["reward"], line["mask_sample"]) == (0.0, False)     # the bug stands: scored 0
    assert took < 25, f"eval took {took:.1f}s: the command ran past --bash-timeout"


def test_the_endpoints_faults_and_malformed_calls(tmp_path, capsys):
    recall, groceries, two_step = prompts(NOTES, "all")
    scripts = {
        # 429, 500, then the reply; then bad JSON, an unknown tool, the right call and the answer
        recall: [{"tool": "read_note", "raw_args": "{not json", "before": [429, 500]},
                 {"tool": "no_such_tool", "args": {}},
                 {"tool": "read_note", "args": {"title": "pancakes"}}, {"text": "2"}],
        # a hang cut by --request-timeout, then the reply
        groceries: [{"tool": "write_note", "args": GROCERIES, "before": ["hang"]}, {"text": "Saved."}],
        # a 500 on every try: the model's failure, never a reward of 0
        two_step: [{"tool": "list_notes", "args": {}, "before": [500, 500, 500]}],
    }
    out = tmp_path / "rollouts.jsonl"
    with fake_model.start(scripts=scripts) as model:
        started = time.monotonic()
        code, stdout, stderr = eval_cli(capsys, str(NOTES), "--split", "all", "--model-url", model.base_url,
                                        "--model", "fake", "--sandbox", "local", "--retries", "2",
                                        "--request-timeout", "1", "--output", str(out))
        took = time.monotonic() - started
    assert code == 0, stderr
    got = by_task(read_jsonl(out))
    recalled = got["recall-recipe"]
    assert recalled["reward"] == 1.0 and recalled["mask_sample"] is False
    answers = [i["output"] for i in items(recalled, "function_call_output")]
    assert json.loads(answers[0])["error"].startswith("Invalid tool call arguments: JSONDecodeError(")
    assert "no_such_tool" in answers[1] and answers[1].startswith("error")      # the server's text
    assert "2 eggs" in answers[2]
    assert got["save-groceries"]["reward"] == 1.0 and got["save-groceries"]["mask_sample"] is False
    failed = got["two-step"]
    assert failed["mask_sample"] is True and failed["reward"] == 0.0
    assert failed["failure_kind"] == agentenv.MODEL_HTTP_ERROR
    assert "answered /responses with 500" in failed["failure_reason"] and "after 3 tries" in failed["failure_reason"]
    assert failed["stop_reason"] == "model_failed"
    tries = [body for path, body in model.requests if path == "/v1/responses" and body
             and body["input"][1]["content"] == two_step]
    assert len(tries) == 3
    assert "split all: mean reward 1.000" in stdout and "2 scored of 3" in stdout
    assert "the model's failures: model:http_error 1" in stdout
    assert "masked by the environment: none" in stdout
    assert took < 30


def test_a_hang_past_the_retries_and_a_refusal_fail_the_model(tmp_path, capsys):
    recall, groceries, two_step = prompts(NOTES, "all")
    scripts = {recall: [{"tool": "list_notes", "args": {}, "before": ["hang", "hang"]}],
               groceries: [{"refusal": "I can't help with groceries."}],
               two_step: [{"tool": "list_notes", "args": {}}, {"text": "done"}]}
    out = tmp_path / "rollouts.jsonl"
    with fake_model.start(scripts=scripts) as model:
        code, stdout, stderr = eval_cli(capsys, str(NOTES), "--split", "all", "--model-url", model.base_url,
                                        "--model", "fake", "--api", "chat", "--sandbox", "local",
                                        "--retries", "1", "--request-timeout", "1", "--output", str(out))
    assert code == 0, stderr
    got = by_task(read_jsonl(out))
    assert got["recall-recipe"]["failure_kind"] == agentenv.MODEL_TIMEOUT
    assert "--request-timeout (1s), 2 tries" in got["recall-recipe"]["failure_reason"]
    assert got["save-groceries"]["failure_kind"] == agentenv.MODEL_REFUSAL
    assert "groceries" in got["save-groceries"]["failure_reason"]
    assert all(got[t]["mask_sample"] for t in ("recall-recipe", "save-groceries"))
    assert got["two-step"]["mask_sample"] is False
    assert "model:timeout 1" in stdout and "model:refusal 1" in stdout


def test_an_endpoint_that_never_answers_and_a_run_whose_every_rollout_failed_exit_1(tmp_path, capsys):
    """A dead endpoint: the probe says so, or (--api given) every rollout is unreachable; a
    context overflow (a 400, not retried) failing every rollout; a split that isn't there."""
    from tests.harness import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1"
    code, _, stderr = eval_cli(capsys, str(NOTES), "--split", "smoke", "--model-url", dead, "--model", "m",
                               "--sandbox", "local", "--output", str(tmp_path / "a.jsonl"))
    assert code == 1 and f"the model's endpoint {dead} did not answer" in stderr and "--model-url" in stderr
    code, stdout, stderr = eval_cli(capsys, str(NOTES), "--split", "smoke", "--model-url", dead,
                                    "--model", "m", "--api", "chat", "--retries", "0", "--sandbox",
                                    "local", "--output", str(tmp_path / "b.jsonl"))
    assert code == 1 and "never answered" in stderr
    assert read_jsonl(tmp_path / "b.jsonl")[0]["failure_kind"] == agentenv.MODEL_UNREACHABLE
    groceries = prompts(NOTES, "smoke")[0]
    overflow = {"status": 400, "message": "This model's maximum context length is 4096 tokens. "
                                          "However, you requested 5000 tokens."}
    with fake_model.start(scripts={groceries: [{"tool": "list_notes", "args": {}, "before": [overflow]}]}) as model:
        code, stdout, stderr = eval_cli(capsys, str(NOTES), "--split", "smoke", "--model-url",
                                        model.base_url, "--model", "m", "--sandbox", "local",
                                        "--output", str(tmp_path / "c.jsonl"))
    assert code == 1 and "every rollout failed" in stderr
    failed = read_jsonl(tmp_path / "c.jsonl")[0]
    assert failed["failure_kind"] == agentenv.MODEL_CONTEXT_OVERFLOW and failed["mask_sample"] is True
    assert "maximum context length is 4096" in failed["failure_reason"]
    assert "the model's failures: model:context_overflow 1" in stdout
    assert len([b for b in model.response_bodies if b]) == 1          # a 400 is not retried (the probe aside)
    code, _, stderr = eval_cli(capsys, str(NOTES), "--model-url", dead, "--model", "m", "--api", "chat",
                               "--sandbox", "local", "--output", str(tmp_path / "d.jsonl"))
    assert code == 1 and "there is no split 'eval'" in stderr and "all, smoke" in stderr


def test_a_killed_run_resumes_with_exactly_the_unfinished_rollouts(tmp_path):
    recall, groceries, two_step = prompts(NOTES, "all")
    scripts = {recall: [{"tool": "read_note", "args": {"title": "pancakes"}}, {"text": "2"}],
               groceries: [{"tool": "write_note", "args": GROCERIES}, {"text": "Saved."}],
               two_step: [{"tool": "list_notes", "args": {}, "before": ["hang"]}]}
    out, state = tmp_path / "rollouts.jsonl", tmp_path / "state"
    with fake_model.start(scripts=scripts) as model:
        argv = [sys.executable, str(REPO / "agentenv.py"), "eval", str(NOTES), "--split", "all",
                "--model-url", model.base_url, "--model", "fake", "--sandbox", "local",
                "--output", str(out)]
        proc = subprocess.Popen(argv, cwd=REPO, env=environ(state), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: out.is_file() and len(out.read_text().splitlines()) == 2, 60,
                       "two rollouts finished")
            wait_until(lambda: processes_with_env("AGENTENV_STATE_DIR", str(state)), 10,
                       "the hung rollout's env is up")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            proc.stdout.close()
        before = out.read_bytes()
        with open(out, "ab") as f:
            f.write(b'{"split": "all", "task_id": "half a li')            # a line the kill tore
        scripts[two_step] = [{"tool": "list_notes", "args": {}}, {"text": "done"}]
        asked = len(model.response_bodies)
        done = subprocess.run(argv, cwd=REPO, env=environ(state), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "holds 2 of these rollouts, so 1 are left to play" in done.stdout
    replayed = {body["input"][1]["content"] for body in model.response_bodies[asked:] if body}
    assert replayed == {two_step}
    assert out.read_bytes().startswith(before)
    lines = read_jsonl(out)
    assert len(lines) == 3 and sorted(by_task(lines)) == ["recall-recipe", "save-groceries", "two-step"]
    assert by_task(lines)["recall-recipe"]["reward"] == 1.0
    assert "3 rollouts" in done.stdout and "3 scored of 3" in done.stdout
    # the killed run's env was swept by the rerun's start; the rerun left none of its own
    assert processes_with_env("AGENTENV_STATE_DIR", str(state)) == []


def test_eval_plays_a_running_serve_by_its_url(tmp_path, capsys):
    from tests.harness import serving

    groceries = prompts(NOTES, "smoke")[0]
    scripts = {groceries: [{"tool": "write_note", "args": GROCERIES}, {"text": "Saved."}]}
    with serving(NOTES, tmp_path / "serve", "--sandbox", "local") as server, \
            fake_model.start(scripts=scripts) as model:
        code, stdout, stderr = eval_cli(capsys, server.url, "--split", "smoke", "--model-url",
                                        model.base_url, "--model", "fake", "--repeats", "2",
                                        "--output", str(tmp_path / "r.jsonl"))
        assert code == 0, stderr
        server.no_envs()
    lines = read_jsonl(tmp_path / "r.jsonl")
    assert sorted(line["_ng_rollout_index"] for line in lines) == [0, 1]
    assert all(line["reward"] == 1.0 for line in lines)
    assert "pass@2 1.000" in stdout and "mean@2 1.000" in stdout


def test_sigterm_stops_eval_and_tears_its_envs_down(tmp_path):
    groceries = prompts(NOTES, "smoke")[0]
    scripts = {groceries: [{"tool": "list_notes", "args": {}, "before": ["hang"]}]}
    out, state = tmp_path / "rollouts.jsonl", tmp_path / "state"
    with fake_model.start(scripts=scripts) as model:
        proc = subprocess.Popen([sys.executable, str(REPO / "agentenv.py"), "eval", str(NOTES), "--split",
                                 "smoke", "--model-url", model.base_url, "--model", "fake", "--sandbox",
                                 "local", "--output", str(out)],
                                cwd=REPO, env=environ(state), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            wait_until(lambda: processes_with_env("AGENTENV_STATE_DIR", str(state)), 60,
                       "the rollout's env is up")
            wait_until(lambda: len(model.response_bodies) >= 2, 30, "the model is asked")
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 143, stderr
    assert "stopped; the rollouts done are in" in stderr and "Traceback" not in stderr
    assert processes_with_env("AGENTENV_STATE_DIR", str(state)) == []
    assert not [p for p in state.rglob("*") if p.is_file()], "the local sandbox's records were left"
