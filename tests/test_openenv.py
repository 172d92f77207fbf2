"""OpenEnv conformance of ``python agentenv.py serve``: the real OpenEnv clients against a real server.

Every server here is started as a user starts it: ``python agentenv.py serve BUNDLE --sandbox local
--port P [flags]`` in a subprocess with its own ``AGENTENV_STATE_DIR`` (tests/harness.py's
``Server``), ready once it answers, and stopped with SIGTERM, after which it must have exited 0 and
left no env process (nor record of one) behind. An env process of a server is found by its
environment (it inherits the server's state dir).

* the clients of ``openenv`` 0.10 (``pip install -e '.[test]'``): ``GenericEnvClient`` (sync and
  async), ``MCPToolClient`` (POST /mcp + /ws?session_id=), the ``openenv validate --url`` CLI and
  the runtime contract graders;
* the older ``openenv-core`` 0.3 clients, which can't share a venv with 0.10 (same module name): a
  venv of its own is built once under ``~/.cache/agentenv-tests/`` and a driver script runs there;
  the test skips, saying why, where that venv can't be built.

Scores seen over the wire are compared with what ``agentenv.Runtime`` computes in-process for the
same play. Async code runs with ``asyncio.run`` (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest


import agentenv
from tests.harness import (GRIDSIM, NOTES, Server, Socket, copy_bundle, request, run, serving,
                           wait_until, with_sleep_tool)

pytest.importorskip("openenv", reason="these tests drive the server with the real OpenEnv clients: "
                                      "pip install -e '.[test]' (openenv==0.10.0)")

# The notes-v1 tasks, as the split "all" orders them (by name).
RECALL, SAVE, TWO_STEP = 0, 1, 2
ENDED = "the episode has ended; call reset"


@pytest.fixture(scope="session")
def oe():
    """The openenv 0.10 client classes (imported once: the import takes seconds, for gradio)."""
    from openenv.core.generic_client import GenericEnvClient
    from openenv.core.mcp_client import MCPToolClient
    return types.SimpleNamespace(GenericEnvClient=GenericEnvClient, MCPToolClient=MCPToolClient)


# ================================================================ servers and processes

def http(url: str, method: str = "GET", body: Any = None, raw: bytes | None = None,
         timeout: float = 60) -> tuple[int, Any]:
    """(status, parsed JSON body) of one request; HTTP errors are answers too."""
    reply = request(url, method, raw if raw is not None else body,
                    {"Content-Type": "application/json"}, timeout=timeout)
    return reply.status, json.loads(reply.body or b"null")


@pytest.fixture(scope="module")
def notes(tmp_path_factory):
    """One notes-v1 server with default flags, shared by the tests that need nothing special."""
    with serving(NOTES, tmp_path_factory.mktemp("notes-server")) as server:
        yield server


def rpc(url: str, method: str, params: dict | None = None, rid: int = 1) -> dict:
    status, body = http(url + "/mcp", "POST", {"jsonrpc": "2.0", "id": rid, "method": method,
                                              "params": params or {}})
    assert status == 200, body
    return body


# ================================================================ plays, on the wire and in-process

def call(name: str, **arguments: Any) -> dict:
    return {"type": "call_tool", "tool_name": name, "arguments": arguments}


# A play: the task, and per turn the tool calls then the reply that ends it.
PLAYS = {
    "two-step": (TWO_STEP, [([("list_notes", {})], "You have one note: pancakes."),
                            ([("read_note", {"title": "pancakes"}),
                              ("write_note", {"title": "groceries",
                                              "text": "2 eggs, 1 cup milk, 1 cup flour"})],
                             "Saved.")], 1.0),
    "save-groceries right": (SAVE, [([("write_note", {"title": "groceries",
                                                      "text": "eggs and milk"})], "Saved.")], 1.0),
    "save-groceries wrong": (SAVE, [([("write_note", {"title": "shopping", "text": "bread"})],
                                     "Saved.")], 0.0),
}


def task_at(index: int) -> agentenv.Task:
    return agentenv.Bundle.load(NOTES).splits["all"][index]


def check_steps(index: int, turns: list, replies: list[dict]) -> None:
    """What a client sees along a play: each turn's prompt, each tool's answer, no early done."""
    task = task_at(index)
    prompts = [t.get("prompt") for t in task.turns]
    reset, *rest = replies
    assert reset["done"] is False and reset["reward"] is None
    assert reset["observation"]["metadata"]["prompt"] == prompts[0]
    assert reset["observation"]["metadata"]["system_prompt"] == task.system_prompt
    assert reset["observation"]["metadata"]["task"] == {"id": task.id, "name": task.name,
                                                        "split": "all", "index": index}
    position = 0
    for number, (calls, _reply) in enumerate(turns):
        for name, _args in calls:
            answer = rest[position]
            position += 1
            observation = answer["observation"]
            assert answer["done"] is False and observation["tool_name"] == name
            assert observation["error"] is None and observation["result"]["is_error"] is False
            assert observation["result"]["content"][0]["text"] == observation["result"]["data"]
        ended = rest[position]
        position += 1
        assert ended["observation"]["tool_name"] == "end_turn"
        if number + 1 < len(turns):
            assert ended["done"] is False and ended["reward"] == 0.0   # no score until the last end_turn
            assert ended["observation"]["result"] == {"prompt": prompts[number + 1],
                                                     "system_prompt": task.system_prompt}


def play_sync(oe, url: str, index: int, turns: list) -> tuple[list[dict], Any]:
    """Play with GenericEnvClient used synchronously (no running loop); every reply, and state."""
    replies = []
    with oe.GenericEnvClient(base_url=url) as env:
        def keep(result):
            replies.append({"observation": result.observation, "reward": result.reward,
                            "done": result.done, "metadata": result.metadata})
        keep(env.reset(split="all", index=index))
        for calls, reply in turns:
            for name, args in calls:
                keep(env.step(call(name, **args)))
            keep(env.step(call("end_turn", response=reply)))
        return replies, env.state()


async def play_async(oe, url: str, index: int, turns: list) -> tuple[list[dict], Any]:
    replies = []
    async with oe.GenericEnvClient(base_url=url) as env:
        def keep(result):
            replies.append({"observation": result.observation, "reward": result.reward,
                            "done": result.done, "metadata": result.metadata})
        keep(await env.reset(split="all", index=index))
        for calls, reply in turns:
            for name, args in calls:
                keep(await env.step(call(name, **args)))
            keep(await env.step(call("end_turn", response=reply)))
        return replies, await env.state()


async def play_in_process(index: int, turns: list) -> agentenv.Outcome:
    """The same play on agentenv.Runtime directly: what the runtime itself scores."""
    bundle = agentenv.Bundle.load(NOTES)
    async with asyncio.timeout(60):
        async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="local")) as runtime:
            episode = runtime.episode(bundle.splits["all"][index])
            for calls, reply in turns:
                turn = await episode.next_turn()
                assert turn is not None
                for name, args in calls:
                    result = await turn.call(name, args)
                    assert not result.is_error, result.text
                turn.end(reply)
            assert await episode.next_turn() is None
            return await episode.result()


# ================================================================ 1. GenericEnvClient

@pytest.mark.parametrize("play", list(PLAYS))
def test_generic_client_sync_plays_and_scores_as_the_runtime_does(oe, notes, play):
    index, turns, expected = PLAYS[play]
    replies, state = play_sync(oe, notes.url, index, turns)
    check_steps(index, turns, replies)
    final = replies[-1]
    direct = asyncio.run(play_in_process(index, turns))
    assert direct.status == "scored" and direct.reward == expected
    assert final["done"] is True
    assert final["reward"] == direct.reward == expected
    assert final["observation"]["metadata"]["scores"] == direct.scores
    assert final["metadata"]["scores"] == direct.scores          # 0.10: metadata repeated on top
    assert final["observation"]["metadata"]["task"]["index"] == index
    steps = sum(len(calls) + 1 for calls, _ in turns)
    task = task_at(index)
    assert state["step_count"] == steps and state["done"] is True
    assert (state["task_id"], state["task_name"], state["split"], state["index"]) == \
        (task.id, task.name, "all", index)
    notes.no_envs()                              # the client closed: its episode is torn down


def test_generic_client_async_plays_two_step_with_list_tools(oe, notes):
    index, turns, expected = PLAYS["two-step"]

    async def main():
        async with oe.GenericEnvClient(base_url=notes.url) as env:
            first = await env.reset(split="all", index=index, episode_id="ep-two-step")
            listed = await env.step({"type": "list_tools"})
            tools = listed.observation["tools"]
            assert listed.done is False and listed.reward == 0.0
            assert [t["name"] for t in tools] == ["write_note", "read_note", "list_notes", "end_turn"]
            assert tools[-1] == {"name": "end_turn", "description": agentenv.END_TURN["description"],
                                 "input_schema": agentenv.END_TURN["input_schema"]}
            assert all(set(t) == {"name", "description", "input_schema"} for t in tools)
            state = await env.state()
            assert state["episode_id"] == "ep-two-step" and state["step_count"] == 1
            assert state["turn"] == "turn1" and state["done"] is False
            return first
    first = asyncio.run(main())
    assert first.done is False
    replies, _ = asyncio.run(play_async(oe, notes.url, index, turns))
    check_steps(index, turns, replies)
    assert replies[-1]["reward"] == expected and replies[-1]["done"] is True
    assert replies[-1]["observation"]["metadata"]["scores"] == {"check": expected}
    notes.no_envs()


# ================================================================ 2. MCPToolClient

def test_mcp_tool_client_production_mode_plays_save_groceries(oe, notes):
    async def main():
        async with oe.MCPToolClient(base_url=notes.url) as tools:
            session = tools._production_session_id
            assert session                                    # POST /mcp openenv/session/create
            reset = await tools.reset(split="all", index=SAVE)   # over /ws?session_id=
            assert reset.done is False
            assert reset.observation.metadata["prompt"] == task_at(SAVE).turns[0].get("prompt")
            listed = await tools.list_tools()
            names = [t.name for t in listed]
            assert names == ["write_note", "read_note", "list_notes", "end_turn"]
            assert "dump_notes" not in names                  # hidden by its _meta flag
            assert listed[0].input_schema["required"] == ["title", "text"]
            assert await tools.call_tool("list_notes") == "(no notes)"
            with pytest.raises(RuntimeError, match="no tool 'dump_notes'"):
                await tools.call_tool("dump_notes")
            assert await tools.call_tool("write_note", title="groceries",
                                         text="eggs and milk") == "saved note 'groceries'"
            assert await tools.call_tool("read_note", title="groceries") == "eggs and milk"
            state = await tools.state()
            assert state.step_count == 4               # every tools/call is a step of the episode
            assert len(notes.env_pids()) == 1
            done = await tools.call_tool("end_turn", response="Saved it.")
            assert done == {"done": True, "reward": 1.0, "scores": {"check": 1.0}}
            with pytest.raises(RuntimeError, match=ENDED):
                await tools.call_tool("list_notes")
            return session
    session = asyncio.run(main())
    # close() detached the socket, then closed the session: it is gone, and so is its env
    assert rpc(notes.url, "tools/list", {"session_id": session})["error"]["code"] == -32602
    notes.no_envs()


def test_mcp_tool_client_sync_two_turns_and_a_wrong_answer(oe, notes):
    with oe.MCPToolClient(base_url=notes.url).sync() as tools:
        tools.reset(split="all", index=TWO_STEP)
        assert tools.call_tool("list_notes") == "pancakes"
        nxt = tools.call_tool("end_turn", response="pancakes")
        assert nxt["prompt"] == task_at(TWO_STEP).turns[1].get("prompt")
        tools.call_tool("write_note", title="groceries", text="flour only")
        assert tools.call_tool("end_turn", response="ok") == \
            {"done": True, "reward": 0.0, "scores": {"check": 0.0}}
    notes.no_envs()


def test_http_mcp_sessions_attach_and_deferred_close(notes):
    session = rpc(notes.url, "openenv/session/create")["result"]["session_id"]
    with Socket(f"{notes.ws_url}/ws?session_id=bogus") as bogus:
        error = bogus.recv()
        assert error["type"] == "error" and error["data"]["code"] == "SESSION_ERROR"
    with Socket(f"{notes.ws_url}/ws?session_id={session}") as attached:
        reset = attached.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        assert reset["data"]["done"] is False
        with Socket(f"{notes.ws_url}/ws?session_id={session}") as second:
            error = second.recv()
            assert error["data"]["code"] == "SESSION_ERROR" and "already attached" in \
                error["data"]["message"]
        listed = rpc(notes.url, "tools/list", {"session_id": session})["result"]["tools"]
        assert [t["name"] for t in listed][-1] == "end_turn" and "inputSchema" in listed[0]
        called = rpc(notes.url, "tools/call", {"session_id": session, "name": "list_notes"})
        assert called["result"]["data"] == "(no notes)"
        closing = rpc(notes.url, "openenv/session/close", {"session_id": session})["result"]
        assert closing == {"session_id": session, "closed": False, "closing": True}
        assert len(notes.env_pids()) == 1                 # deferred while the socket is attached
    notes.no_envs()                                       # ... and done once it detached
    assert rpc(notes.url, "openenv/session/close", {"session_id": session})["error"]["code"] == -32602


def test_mcp_message_inside_ws(tmp_path):
    server = Server.serve(NOTES, tmp_path)    # its own server: the deadlock would pin a shared one
    try:
        with Socket(server.ws_url + "/ws") as raw:
            raw.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
            inside = raw.ask({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                                                      "params": {"name": "list_notes"}}}, timeout=3)
            assert inside == {"type": "mcp", "data": {"jsonrpc": "2.0", "id": 7, "result": {
                "content": [{"type": "text", "text": "(no notes)"}], "structured_content": None,
                "meta": None, "data": "(no notes)", "is_error": False}}}
            listed = raw.ask({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 8,
                                                      "method": "tools/list"}}, timeout=5)
            assert [t["name"] for t in listed["data"]["result"]["tools"]][-1] == "end_turn"
        server.no_envs()
    except BaseException:
        server.kill()                         # SIGKILL, and its env processes with it
        raise
    assert server.stop() == 0


def test_websocket_mcp_is_one_session_per_connection(notes):
    with Socket(notes.ws_url + "/mcp") as mcp:
        listed = mcp.ask({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, timeout=60)
        assert [t["name"] for t in listed["result"]["tools"]] == \
            ["write_note", "read_note", "list_notes", "end_turn"]      # no episode: a reset's tools
        answer = mcp.ask({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                          "params": {"name": "list_notes"}})
        assert answer["error"]["code"] == -32603 and ENDED in answer["error"]["message"]
        assert mcp.ask("{nope")["error"]["code"] == -32700


# ================================================================ 3. openenv validate and graders

def openenv_cli() -> str:
    beside = Path(sys.executable).parent / "openenv"
    found = str(beside) if beside.exists() else shutil.which("openenv")
    assert found, "the openenv CLI is not installed: pip install -e '.[test]'"
    return found


def test_openenv_validate_url_passes(notes):
    run = subprocess.run([openenv_cli(), "validate", "--url", notes.url, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["passed"] is True and report["standard_profile"] == "openenv-http/1.x"
    assert report["mode"] == "simulation"
    assert {c["id"]: c["passed"] for c in report["criteria"]} == {
        "openapi_version_available": True, "health_endpoint": True, "metadata_endpoint": True,
        "schema_endpoint": True, "mcp_endpoint": True, "mode_endpoint_consistency": True}


GRADED = [{"type": "list_tools"}, call("write_note", title="groceries", text="eggs, milk"),
          call("end_turn", response="done")]


def collect_evidence(url: str, actions: list[dict] | None = None):
    """One episode as OpenEnv 0.10's runtime validator collects it: raw frames over /ws, playing
    ``actions`` (by default GRADED) after a reset of save-groceries."""
    import warnings
    warnings.filterwarnings("ignore", "connect\\(\\) must be used as a context manager",
                            DeprecationWarning)          # openenv's collector, on websockets 17
    from openenv.validation.runtime.collector import collect_runtime_evidence
    from openenv.validation.runtime.contracts import RuntimePlan
    plan = RuntimePlan.model_validate({
        "plan_schema_version": "1",
        "reset": {"episode_id": "grader-1", "seed": 3, "options": {"split": "all", "index": SAVE}},
        "actions": actions or GRADED})
    evidence = collect_runtime_evidence(url, plan, episode_timeout_s=60)
    assert evidence.failure_reason is None, evidence.failure_reason
    return types.SimpleNamespace(runtime_evidence=evidence, manifest=types.SimpleNamespace(
        reward=types.SimpleNamespace(range=(0.0, 1.0))))


def test_runtime_graders_observation_schema_and_state_contract(notes):
    from openenv.validation.graders.runtime.basic import ObservationSchemaGrader, StateContractGrader
    subject = collect_evidence(notes.url)
    assert len(subject.runtime_evidence.exchanges) == 8       # reset, state, 3 x (step, state)
    for grader in (ObservationSchemaGrader(), StateContractGrader()):
        result = grader.run(subject)
        assert result.status.value == "pass", (grader.check_id, result.evidence)
    last = json.loads(subject.runtime_evidence.exchanges[-2].response_json)["data"]
    assert last["done"] is True and last["reward"] == 1.0
    notes.no_envs()


def test_runtime_grader_reward_well_formed(notes):
    from openenv.validation.graders.runtime.basic import RewardWellFormedGrader
    result = RewardWellFormedGrader().run(collect_evidence(notes.url))
    notes.no_envs()
    assert result.status.value == "pass", result.evidence


def test_runtime_graders_with_bad_actions_mid_episode(notes):
    """Arguments that don't fit, an unknown tool, a tool that fails and an action with no type
    mid-episode: each an observation with a number reward, and the episode still scores."""
    from openenv.validation.graders.runtime.basic import (ObservationSchemaGrader,
                                                          RewardWellFormedGrader, StateContractGrader)
    subject = collect_evidence(notes.url, [
        {"type": "list_tools"}, call("write_note", title="groceries"), call("nope"),
        call("read_note", title="nothing"), {"tool_name": "list_notes"},
        call("write_note", title="groceries", text="eggs, milk"), call("end_turn", response="done")])
    for grader in (ObservationSchemaGrader(), StateContractGrader(), RewardWellFormedGrader()):
        result = grader.run(subject)
        assert result.status.value == "pass", (grader.check_id, result.evidence)
    steps = [json.loads(e.response_json)["data"] for e in subject.runtime_evidence.exchanges
             if e.operation == "step"]
    assert [(s["observation"].get("error") or {}).get("error_type") for s in steps[1:5]] == \
        ["invalid_args", "tool_not_found", "execution_error", None]
    assert steps[-1]["done"] is True and steps[-1]["reward"] == 1.0
    notes.no_envs()


# ================================================================ 4. capacity

def test_capacity_refusals_over_ws_and_mcp_then_a_slot_frees(oe, tmp_path):
    with serving(NOTES, tmp_path, "--max-concurrent-envs", "2") as server:
        first = oe.GenericEnvClient(base_url=server.url).sync()
        second = oe.GenericEnvClient(base_url=server.url).sync()
        with first, second:
            assert first.reset(split="all", index=SAVE).done is False
            assert second.reset(split="all", index=RECALL).done is False
            for _ in range(3):
                with pytest.raises(RuntimeError) as refused:
                    with oe.GenericEnvClient(base_url=server.url) as third:
                        third.reset(split="all", index=SAVE)
                message = str(refused.value)
                assert "CAPACITY_REACHED" in message
                assert "Server at capacity: 2/2 sessions active" in message
                assert "temporary" in message and "--max-concurrent-envs" in message
                assert "MAX_CONCURRENT_ENVS" in message
            with Socket(server.ws_url + "/ws") as raw:            # the frame itself
                frame = raw.recv()
                assert frame["type"] == "error" and frame["data"]["code"] == "CAPACITY_REACHED"
                assert (frame["data"]["active_sessions"], frame["data"]["max_sessions"]) == (2, 2)
            created = rpc(server.url, "openenv/session/create")
            assert created["error"]["code"] == -32000 and "temporary" in created["error"]["message"]
            assert created["error"]["data"]["active_sessions"] == 2
            assert created["error"]["data"]["max_sessions"] == 2
            with Socket(server.ws_url + "/mcp") as mcp:
                assert mcp.recv()["error"]["code"] == -32000
            with pytest.raises(RuntimeError, match="Failed to create MCP session: Server at capacity"):
                with oe.MCPToolClient(base_url=server.url).sync() as tools:
                    tools.list_tools()
            assert len(server.env_pids()) == 2                  # refusals deployed nothing
            second.close()
            server.wait_envs(1)

            def third_plays():
                try:
                    with oe.GenericEnvClient(base_url=server.url) as third:
                        return third.reset(split="all", index=SAVE).done is False
                except RuntimeError as exc:
                    assert "CAPACITY_REACHED" in str(exc)
                    return False
            wait_until(third_plays, 10, "a new client gets in once one has closed", interval=0.2)
        server.no_envs()
        log = server.log()
    assert log.count("at its limit") == 1, log
    assert "--max-concurrent-envs" in log.split("at its limit", 1)[1].splitlines()[0]


# ================================================================ 5. errors

def test_reset_errors_are_observations(oe, notes):
    with oe.GenericEnvClient(base_url=notes.url) as env:
        step = env.step(call("list_notes"))                        # before any reset
        assert step.done is True and step.reward == 0.0
        assert step.observation["metadata"]["error"] == ENDED
        listed = env.step({"type": "list_tools"})                 # the tools a reset would offer
        assert listed.done is False and [t["name"] for t in listed.observation["tools"]][-1] == \
            "end_turn"
        notes.no_envs()                                           # found by a deploy, torn down
        only = env.reset(split="all")
        assert only.done is True and only.reward is None
        assert only.observation["metadata"]["status"] == "error"
        assert "split and index go together" in only.observation["metadata"]["error"]
        assert "split and index go together" in env.reset(index=1).observation["metadata"]["error"]
        bad = env.reset(split="train", index=0).observation["metadata"]["error"]
        assert "there is no split 'train'" in bad and "all, smoke" in bad
        far = env.reset(split="all", index=7).observation["metadata"]["error"]
        assert "has 3 tasks" in far and "no task 7" in far and "from 0 to 2" in far
        assert "has 1 tasks" in env.reset(split="smoke", index=1).observation["metadata"]["error"]
        assert env.step(call("list_notes")).observation["metadata"]["error"] == ENDED
        assert not notes.env_pids()                                 # none of these deployed
        neither = env.reset()                                       # neither: the first task
        assert neither.done is False
        assert neither.observation["metadata"]["task"]["name"] == "recall-recipe"
    notes.no_envs()


def test_step_errors_tools_and_frames(oe, notes):
    with oe.GenericEnvClient(base_url=notes.url) as env:
        env.reset(split="all", index=SAVE)
        for name in ("nope", "dump_notes"):                         # unknown, and hidden
            missing = env.step(call(name))
            assert missing.done is False
            assert missing.observation["error"]["error_type"] == "tool_not_found"
            assert f"no tool {name!r}" in missing.observation["error"]["message"]
            assert "write_note, read_note, list_notes" in missing.observation["error"]["message"]
        wrong = env.step(call("read_note", title="nothing"))       # the tool's own error
        assert wrong.done is False and wrong.reward == 0.0 and wrong.observation["result"] is None
        assert wrong.observation["error"] == {"error_type": "execution_error",
                                              "message": "no note titled 'nothing'; the notes are: "}
        missing = env.step(call("write_note", title="groceries"))   # arguments that don't fit
        assert missing.observation["error"]["error_type"] == "invalid_args"
        assert "'text' is required" in missing.observation["error"]["message"]
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            env.step({"type": "dance"})
        assert env.step({"tool_name": "list_notes"}).observation["result"]["data"] == "(no notes)"
        assert env.step(call("list_notes")).done is False           # the episode goes on
    with Socket(notes.ws_url + "/ws") as raw:
        broken = raw.ask("{not json")
        assert broken["type"] == "error" and broken["data"]["code"] == "INVALID_JSON"
        unknown = raw.ask({"type": "dance"})
        assert unknown == {"type": "error", "data": {
            "message": "Unknown message type: dance; send reset, step, state, mcp or close",
            "code": "UNKNOWN_TYPE"}}
        assert raw.ask({"type": "state"})["type"] == "state"          # still open after errors
    notes.no_envs()


def test_reset_abandons_the_live_episode_and_close_tears_down(notes):
    with Socket(notes.ws_url + "/ws") as raw:
        raw.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        before = notes.wait_envs(1)
        again = raw.ask({"type": "reset", "data": {"split": "all", "index": RECALL}})
        assert again["data"]["observation"]["metadata"]["task"]["name"] == "recall-recipe"
        after = notes.wait_envs(1)
        assert before.isdisjoint(after)               # the first episode's env is gone already
        # the new episode plays: the preload of recall-recipe is there, and it scores
        listed = raw.ask({"type": "step", "data": call("list_notes")})
        assert listed["data"]["observation"]["result"]["data"] == "pancakes"
        ended = raw.ask({"type": "step", "data": call("end_turn", response="2")})
        assert ended["data"]["reward"] == 1.0 and ended["data"]["done"] is True
        raw.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        notes.wait_envs(1)
        assert raw.ask({"type": "state"})["data"]["done"] is False
    notes.no_envs()                                   # the socket closed: its episode is torn down
    with Socket(notes.ws_url + "/ws") as raw:          # {"type": "close"} ends it too
        raw.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        notes.wait_envs(1)
        raw.send({"type": "close"})
        notes.no_envs()


# ================================================================ 6. task API and HTTP routes

def test_task_api(notes):
    bundle = agentenv.Bundle.load(NOTES)
    env = "notes-v1"
    assert http(notes.url + "/list_environments") == (200, [env])
    assert http(f"{notes.url}/{env}/splits") == (200, [{"name": "all", "type": "validation"},
                                                      {"name": "smoke", "type": "validation"}])
    post = lambda route, body: http(f"{notes.url}/{env}/{route}", "POST", body)  # noqa: E731
    assert post("num_tasks", {"split": "all"}) == (200, {"num_tasks": 3})
    assert post("num_tasks", {"split": "smoke"}) == (200, {"num_tasks": 1})
    status, listed = post("tasks", {"split": "all"})
    assert status == 200 and listed["env_name"] == env
    assert [r["name"] for r in listed["tasks"]] == ["recall-recipe", "save-groceries", "two-step"]
    for index, row in enumerate(listed["tasks"]):
        task = bundle.splits["all"][index]
        assert row["index"] == index and row["id"] == task.id and row["agent"] == "writer"
        assert row["prompt"] == task.turns[0].get("prompt") and row["system_prompt"] == task.system_prompt
    assert post("task", {"split": "smoke", "index": 0}) == \
        (200, {"task": {**listed["tasks"][SAVE], "index": 0}})
    status, ranged = post("task_range", {"split": "all", "start": 1, "stop": 3})
    assert status == 200 and ranged == {"tasks": listed["tasks"][1:3]}
    assert post("task_range", {"split": "all", "start": 2}) == (200, {"tasks": listed["tasks"][2:]})
    status, body = post("task", {"split": "all", "index": 3})
    assert status == 400 and body["detail"].startswith("Invalid task index")
    assert "has 3 tasks" in body["detail"] and "from 0 to 2" in body["detail"]
    status, body = post("num_tasks", {"split": "train"})
    assert status == 400 and body["detail"].startswith("Invalid task index")
    assert "the splits are all, smoke" in body["detail"]
    assert http(notes.url + "/notes/splits")[0] == 404
    status, body = http(notes.url + "/notes-v2/num_tasks", "POST", {"split": "all"})
    assert status == 404 and "this server serves 'notes-v1'" in body["detail"]


def test_metadata_schema_openapi_and_mcp_probe(notes):
    status, meta = http(notes.url + "/metadata")
    assert status == 200 and meta["name"] == "notes-v1"
    assert meta["description"] == (NOTES / "README.md").read_text().splitlines()[0]
    assert meta["readme_content"] == (NOTES / "README.md").read_text()
    assert isinstance(meta["version"], str)
    status, schema = http(notes.url + "/schema")
    assert status == 200
    for key in ("action", "observation", "state", "reset_observation"):
        assert isinstance(schema[key], dict) and schema[key]["type"] == "object"
    assert schema["action"]["properties"]["type"]["enum"] == ["list_tools", "call_tool"]
    status, spec = http(notes.url + "/openapi.json")
    assert status == 200 and spec["info"]["version"] == "1.0.0"
    assert {"/reset", "/step", "/state", "/mcp", "/ws", "/health"} <= set(spec["paths"])
    assert http(notes.url + "/mcp", "POST", {}) == (200, {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32600, "data": None,
        "message": "Invalid Request: jsonrpc: Field required; method: Field required; send "
                   "{\"jsonrpc\": \"2.0\", \"method\": ..., \"params\": {...}, \"id\": ...}"}})
    status, parse = http(notes.url + "/mcp", "POST", raw=b"{nope")
    assert status == 200 and parse["error"]["code"] == -32700
    assert rpc(notes.url, "resources/list")["error"]["code"] == -32601
    listed = rpc(notes.url, "tools/list")["result"]["tools"]          # before any reset too
    assert [t["name"] for t in listed] == ["write_note", "read_note", "list_notes", "end_turn"]


def test_stateless_http_reset_step_state(notes):
    status, reset = http(notes.url + "/reset", "POST", {"split": "all", "index": SAVE})
    assert status == 200 and reset["done"] is False and reset["reward"] is None
    assert reset["observation"]["metadata"]["task"]["name"] == "save-groceries"
    assert reset["metadata"] == reset["observation"]["metadata"]
    notes.no_envs()                                         # stateless: its episode ended
    status, step = http(notes.url + "/step", "POST", {"action": call("list_notes")})
    assert status == 200 and step["done"] is True and step["observation"]["metadata"]["error"] == ENDED
    assert step["reward"] == 0.0 and "metadata" in step
    status, step = http(notes.url + "/step", "POST", {"action": {"type": "list_tools"}})
    assert status == 200 and step["done"] is False and step["metadata"] is None
    assert [t["name"] for t in step["observation"]["tools"]][-1] == "end_turn"
    status, missing = http(notes.url + "/step", "POST", {})
    assert status == 422 and missing["detail"][0]["loc"] == ["body", "action"]
    status, state = http(notes.url + "/state")
    assert status == 200 and state["episode_id"] is None and state["step_count"] == 0
    status, only = http(notes.url + "/reset", "POST", {"split": "all"})
    assert status == 200 and "go together" in only["observation"]["metadata"]["error"]
    assert http(notes.url + "/reset", "POST", raw=b"[1")[0] == 422


def test_gridsim_task_api_and_an_idle_day(oe, tmp_path):
    with serving(GRIDSIM, tmp_path) as server:
        env = "gridsim-v1"
        assert http(f"{server.url}/{env}/splits") == (200, [
            {"name": "all", "type": "validation"}, {"name": "eval", "type": "validation"},
            {"name": "train", "type": "train"}])
        for split, count in (("all", 2200), ("train", 2000), ("eval", 200)):
            assert http(f"{server.url}/{env}/num_tasks", "POST", {"split": split}) == \
                (200, {"num_tasks": count})
        status, tail = http(f"{server.url}/{env}/task_range", "POST",
                            {"split": "eval", "start": 198, "stop": 400})
        assert status == 200 and [r["index"] for r in tail["tasks"]] == [198, 199]
        status, body = http(f"{server.url}/{env}/task", "POST", {"split": "eval", "index": 200})
        assert status == 400 and "has 200 tasks" in body["detail"]
        with oe.GenericEnvClient(base_url=server.url) as client:
            reset = client.reset(split="eval", index=199)
            assert reset.done is False
            assert reset.observation["metadata"]["task"]["name"] == tail["tasks"][1]["name"]
            tools = [t["name"] for t in client.step({"type": "list_tools"}).observation["tools"]]
            assert tools == ["submit_schedule", "end_turn"]
            client.step(call("submit_schedule", schedule=[0] * 24))
            done = client.step(call("end_turn", response="idle"))
        assert done.done is True and done.reward == pytest.approx(0.2)   # idling scores 0.2
        server.no_envs()


# ================================================================ 7. deadlines

@pytest.fixture
def slow_bundle(tmp_path) -> Path:
    """notes-v1 whose notebook also has a ``sleep`` tool."""
    return with_sleep_tool(copy_bundle(tmp_path / "slow-v1"))


def test_a_call_that_runs_too_long_answers_timeout_inside_the_client_timeout(oe, tmp_path, slow_bundle):
    with serving(slow_bundle, tmp_path / "server", "--client-timeout", "3",
                 "--reply-margin", "1") as server:
        with oe.GenericEnvClient(base_url=server.url, message_timeout_s=3) as env:
            assert env.reset(split="all", index=SAVE).done is False
            tools = [t["name"] for t in env.step({"type": "list_tools"}).observation["tools"]]
            assert "sleep" in tools
            assert env.step(call("sleep", seconds="0.2")).observation["result"]["data"] == "slept"
            started = time.monotonic()
            slow = env.step(call("sleep", seconds="30"))
            took = time.monotonic() - started
            assert 1.8 <= took < 2.9, took                  # 3 s client timeout - 1 s margin
            assert slow.done is True and slow.reward == 0.0            # a step's: a number
            assert slow.observation["error"]["error_type"] == "timeout"
            assert "didn't answer within 2s" in slow.observation["error"]["message"]
            server.no_envs()                                # the episode ended: env torn down
            assert env.step(call("list_notes")).observation["metadata"]["error"] == ENDED
            assert env.reset(split="all", index=SAVE).done is False   # the socket still works
        with oe.MCPToolClient(base_url=server.url, message_timeout_s=3).sync() as tools:
            tools.reset(split="all", index=SAVE)
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="didn't answer within 2s"):
                tools.call_tool("sleep", seconds="30")
            assert time.monotonic() - started < 2.9
        server.no_envs()



def test_a_long_step_keeps_answering_the_clients_pings(tmp_path, slow_bundle):
    """A step that runs 4 s on a socket whose client pings every 0.5 s and gives up on a pong
    after 1 s (websockets, as OpenEnv's clients use it, at 20 s each by default): the pings are
    answered while the step runs, so the socket stays up and the step's reply arrives. (Before,
    aiohttp answered a ping only between frames, and a reset or step past 40 s lost its socket.)"""
    import websockets

    async def go(url: str):
        async with websockets.connect(url + "/ws", ping_interval=0.5, ping_timeout=1,
                                      open_timeout=30) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {"split": "all", "index": SAVE}}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 120))["data"]["done"] is False
            started = time.monotonic()
            await ws.send(json.dumps({"type": "step", "data": call("sleep", seconds="4")}))
            reply = json.loads(await asyncio.wait_for(ws.recv(), 60))
            return reply, time.monotonic() - started

    with serving(slow_bundle, tmp_path / "server") as server:
        reply, took = run(go(server.ws_url), 180)
    assert reply["data"]["observation"]["result"]["data"] == "slept", reply
    assert took >= 4, took

def test_unit_tests_that_could_outlast_the_reply_are_said_at_start(tmp_path):
    """A task whose tests may run past the reply OpenEnv clients wait for (pyfix-v1's bsearch
    given 60 s, where clients are answered within 55 s) is said at start, with the fix; the
    bundle as shipped (40 s) and a client timeout raised as said are not."""
    from tests.harness import PYFIX
    bundle = copy_bundle(tmp_path / "pyfix-v1", PYFIX)
    task = bundle / "tasks" / "bsearch.json"
    steps = json.loads(task.read_text())
    next(s for s in steps if s["type"] == "run_container_unit_tests_verifier")["timeout_sec"] = 60
    task.write_text(json.dumps(steps))
    said = ("1 task(s) of pyfix-v1 (such as bsearch) run unit tests for up to 60s after end_turn, "
            "but OpenEnv clients are answered within 55s (--client-timeout 60 less --reply-margin "
            "5): over OpenEnv a rollout whose tests hang would be masked for the missed reply "
            "instead of scored 0, and a model could learn to hang them. Start serve with "
            "--client-timeout 80 and give clients as long")
    for source, flags, warned in ((bundle, (), True), (bundle, ("--client-timeout", "80"), False),
                                  (PYFIX, (), False)):
        with serving(source, tmp_path / f"server-{len(flags)}-{warned}", *flags) as server:
            pass
        assert (said in server.log()) is warned, server.log()


# ================================================================ 8. idle reaping

@pytest.fixture
def idle_server(tmp_path):
    with serving(NOTES, tmp_path, "--idle-timeout", "1", "--max-concurrent-envs", "1") as server:
        yield server


def test_idle_ws_session_is_reaped_and_frees_its_slot(oe, idle_server):
    server = idle_server
    silent = oe.GenericEnvClient(base_url=server.url).sync()
    with silent:
        assert silent.reset(split="all", index=SAVE).done is False
        server.wait_envs(1)
        server.no_envs(timeout=5)                       # silent for > 1 s: reaped, env gone
        with oe.GenericEnvClient(base_url=server.url) as other:     # the only slot is free
            assert other.reset(split="all", index=SAVE).done is False
            assert other.step(call("write_note", title="groceries", text="eggs, milk")).done is False
            assert other.step(call("end_turn", response="ok")).reward == 1.0
        ended = silent.step(call("list_notes"))          # the silent client comes back
        assert ended.done is True and ended.observation["metadata"]["error"] == ENDED
    assert "no request for 1s (--idle-timeout)" in server.log()


def test_idle_http_mcp_session_is_reaped_with_its_episode(idle_server):
    server = idle_server
    session = rpc(server.url, "openenv/session/create")["result"]["session_id"]
    with Socket(f"{server.ws_url}/ws?session_id={session}") as attached:
        assert attached.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})["data"]["done"] \
            is False
    # detached without openenv/session/close: the session and its episode live on, for now
    assert len(server.env_pids()) == 1
    server.no_envs(timeout=5)
    gone = rpc(server.url, "tools/list", {"session_id": session})
    assert gone["error"]["code"] == -32602
    assert "session_id" in rpc(server.url, "openenv/session/create")["result"]    # slot is free


def test_a_reaped_ws_session_does_not_play_outside_the_limit(idle_server):
    server = idle_server
    with Socket(server.ws_url + "/ws") as raw:
        raw.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        server.wait_envs(1)
        server.no_envs(timeout=5)                            # reaped
        try:
            again = raw.ask({"type": "reset", "data": {"split": "all", "index": SAVE}}, timeout=10)
        except Exception:                                    # noqa: BLE001 - closed: also right
            return
        if again["type"] == "error" or again["data"]["done"]:
            return                                           # refused: right
        # it plays: then it must hold the only slot
        assert len(server.env_pids()) == 1
        created = rpc(server.url, "openenv/session/create")
        assert "error" in created, ("a second session was admitted at --max-concurrent-envs 1 while "
                                    f"the reaped socket plays: {created}")


# ================================================================ 9. SIGTERM

def test_sigterm_with_live_episodes_tears_down_and_exits_0(tmp_path):
    server = Server.serve(NOTES, tmp_path)
    clients = [Socket(server.ws_url + "/ws") for _ in range(2)]
    try:
        for raw, index in zip(clients, (SAVE, TWO_STEP)):
            assert raw.ask({"type": "reset", "data": {"split": "all", "index": index}})["data"]["done"] \
                is False
        server.wait_envs(2)
        assert len(server.records()) == 2
        server.terminate()
        server.no_envs(timeout=10)                      # every env torn down at once
    finally:
        for raw in clients:                             # (see the next test: it waits for these)
            raw.close()
    assert server.stop(timeout=15) == 0
    assert not server.records()                         # and, by its exit, their records
    log = server.log()
    assert "Shutting down: ending 2 live episode(s)" in log, log


def test_sigterm_closes_open_sockets_and_exits_promptly(tmp_path):
    server = Server.serve(NOTES, tmp_path)
    raw = Socket(server.ws_url + "/ws")
    try:
        raw.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        server.terminate()
        server.no_envs(timeout=10)
        try:
            raw.recv(timeout=3)
            closed = False
        except TimeoutError:
            closed = False
        except Exception:                               # noqa: BLE001 - ConnectionClosed
            closed = True
        assert closed, "the server didn't close the client's socket within 3 s of SIGTERM"
        assert server.proc.wait(10) == 0
        assert "Traceback" not in server.log(), server.log()
    finally:
        raw.close()
        assert server.stop() == 0


# ================================================================ 10. openenv-core 0.3 clients

CORE03 = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentenv-tests" / \
    "openenv-core-0.3"
CORE03_PACKAGES = ["fastapi", "pydantic", "uvicorn", "websockets", "httpx", "requests", "fastmcp"]


def _core03_works(python: Path) -> bool:
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                            "from openenv.core import GenericEnvClient, MCPToolClient; "
                            "print(m.version('openenv-core'))"],
                           capture_output=True, text=True, timeout=120)
    return probe.returncode == 0 and probe.stdout.strip() == "0.3.0"


def core03_python() -> Path:
    """A venv with openenv-core 0.3.0's clients (it can't share one with openenv 0.10), built once:
    openenv-core without its dependencies (gradio, openai, ...), then what its clients import."""
    python = CORE03 / "bin" / "python"
    if (CORE03 / ".complete").exists() and _core03_works(python):
        return python
    build = CORE03.with_name(f"{CORE03.name}.build-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    build.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    pip = [str(build / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    try:
        for command in ([sys.executable, "-m", "venv", str(build)],
                        [*pip, "--no-deps", "openenv-core==0.3.0"], [*pip, *CORE03_PACKAGES]):
            run = subprocess.run(command, capture_output=True, text=True, timeout=900)
            if run.returncode:
                lines = [ln for ln in (run.stderr or run.stdout).splitlines() if "is ignored" not in ln]
                pytest.skip(f"a venv with openenv-core 0.3.0 could not be built under {CORE03.parent} "
                            f"({' '.join(command[-3:])} failed: {' '.join(lines[-3:])[:300]})")
        if not _core03_works(build / "bin" / "python"):
            pytest.skip("the venv built for openenv-core 0.3.0 can't import its clients")
        (build / ".complete").write_text(f"built in {time.monotonic() - started:.0f}s\n")
        shutil.rmtree(CORE03, ignore_errors=True)
        try:
            os.replace(build, CORE03)
        except OSError:                    # another run put its own there meanwhile: use that
            if not _core03_works(python):
                raise
    except subprocess.TimeoutExpired as exc:
        pytest.skip(f"building the openenv-core 0.3.0 venv took over {exc.timeout:g}s")
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return python


DRIVER03 = textwrap.dedent('''\
    import json, sys
    from openenv.core import GenericEnvClient, MCPToolClient
    from openenv.core.env_server.mcp_types import CallToolAction

    url, out = sys.argv[1], {}
    def call(name, **arguments):
        return {"type": "call_tool", "tool_name": name, "arguments": arguments}

    with GenericEnvClient(base_url=url).sync() as env:          # 0.3: sync only through .sync()
        r = env.reset(split="all", index=2)
        out["reset"] = [r.done, r.reward, r.observation["metadata"]["prompt"]]
        out["tools"] = [t["name"] for t in env.step({"type": "list_tools"}).observation["tools"]]
        out["list_notes"] = env.step(call("list_notes")).observation["result"]["data"]
        r = env.step(call("end_turn", response="pancakes"))
        out["turn2"] = [r.done, r.observation["result"]["prompt"]]
        env.step(call("write_note", title="groceries", text="2 eggs, 1 cup milk, 1 cup flour"))
        r = env.step(call("end_turn", response="saved"))
        out["final"] = [r.done, r.reward, r.observation["metadata"]["scores"]]
        out["state"] = env.state()

    with MCPToolClient(base_url=url).sync() as tools:            # 0.3: /ws step messages
        r = tools.reset(split="all", index=1)
        out["mcp_reset"] = [r.done, r.observation.metadata["task"]["name"]]
        out["mcp_tools"] = [t.name for t in tools.list_tools()]
        try:
            tools.call_tool("dump_notes")
        except RuntimeError as exc:
            out["mcp_hidden"] = str(exc)
        out["mcp_write"] = tools.call_tool("write_note", title="groceries", text="eggs and milk")
        out["mcp_read"] = tools.call_tool("read_note", title="groceries")
        r = tools.step(CallToolAction(tool_name="end_turn", arguments={"response": "saved"}))
        out["mcp_final"] = [r.done, r.reward, r.observation.metadata["scores"]]
    print(json.dumps(out))
''')


def test_openenv_core_03_clients_in_their_own_venv(notes, tmp_path):
    python = core03_python()
    driver = tmp_path / "driver03.py"
    driver.write_text(DRIVER03)
    run = subprocess.run([str(python), str(driver), notes.url], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    two_step = task_at(TWO_STEP)
    assert out["reset"] == [False, None, two_step.turns[0].get("prompt")]
    assert out["tools"] == ["write_note", "read_note", "list_notes", "end_turn"]
    assert out["list_notes"] == "pancakes"
    assert out["turn2"] == [False, two_step.turns[1].get("prompt")]
    assert out["final"] == [True, 1.0, {"check": 1.0}]          # 0.3 drops top-level metadata,
    assert out["state"]["step_count"] == 5 and out["state"]["done"] is True   # not observation's
    assert out["mcp_reset"] == [False, "save-groceries"]
    assert out["mcp_tools"] == ["write_note", "read_note", "list_notes", "end_turn"]
    assert "tool_not_found" in out["mcp_hidden"]
    assert out["mcp_write"] == "saved note 'groceries'" and out["mcp_read"] == "eggs and milk"
    assert out["mcp_final"] == [True, 1.0, {"check": 1.0}]
    notes.no_envs()
