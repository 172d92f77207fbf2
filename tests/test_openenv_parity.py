"""OpenEnv wire parity of ``python agentenv.py serve``, proven against the reference itself.

The reference is a server built with OpenEnv 0.10's own ``create_app`` and ``MCPEnvironment``
(tests/openenv_reference.py: notes-v1's notebook tools as FastMCP tools, an episode per reset, the
task API), run as OpenEnv envs run, under uvicorn. ``serve`` plays notes-v1 on the local sandbox,
whose tools are the same. Both get the same batteries: every /ws message type with good, missing,
extra, mistyped and malformed fields; JSON-RPC on POST /mcp, WebSocket /mcp and inside /ws (bad
versions, ids, params, batches, notifications, unknown methods); binary and oversized frames;
pipelined messages; every HTTP route with good and bad bodies. For each, what a client can tell
apart must agree: the reply's type, its error code, the keys it carries (ours may add keys the
reference doesn't send, never drop one), the HTTP status, and whether the socket stays open.

What differs on purpose is a row of the table "Deliberate deviations from the reference servers" (docs/deviations.md): each
row is a ``test_deviation_*`` here that holds both servers to what the row says, and
``test_the_deviations_page_is_the_deviations_tested`` keeps the table and these tests one list.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus


from tests.harness import (NOTES, REPO, Server, Socket, copy_bundle, request, running, serving,
                           with_sleep_tool)

pytest.importorskip("openenv", reason="the reference server is built with openenv 0.10: "
                                      "pip install -e '.[test]' (openenv==0.10.0)")

SAVE = 1                                      # notes-v1's save-groceries, in the split "all"
TOOLS = ["write_note", "read_note", "list_notes", "end_turn"]
LIMIT = "3"                                   # both servers' session limit


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(reference, ours), each with at most 3 sessions; stopped cleanly at the end."""
    with running(Server.openenv_reference(tmp_path_factory.mktemp("reference"),
                                          env={"MAX_CONCURRENT_ENVS": LIMIT})) as reference, \
            serving(NOTES, tmp_path_factory.mktemp("ours"), "--max-concurrent-envs", LIMIT) as ours:
        yield reference, ours


def both(servers):
    reference, ours = servers
    return {"reference": reference, "ours": ours}


# ================================================================ what a client can tell apart

def keys(value: Any) -> list[str] | None:
    return sorted(value) if isinstance(value, dict) else None


def rpc_shape(reply: Any) -> dict[str, Any]:
    """A JSON-RPC reply as a client tells replies apart: result or error, its code, its keys."""
    if not isinstance(reply, dict):
        return {"not": type(reply).__name__}
    shape: dict[str, Any] = {"keys": keys(reply), "id": reply.get("id")}
    if "error" in reply:
        shape.update(code=reply["error"].get("code"), error=keys(reply["error"]))
    elif isinstance(reply.get("result"), dict) and "tools" in reply["result"]:
        shape["tools"] = [t.get("name") for t in reply["result"]["tools"]]
    elif isinstance(reply.get("result"), dict):
        shape["result"] = keys(reply["result"])
    return shape


def frame_shape(frame: Any) -> dict[str, Any]:
    """A /ws reply as a client tells them apart (reward values aside: see the deviations)."""
    if not isinstance(frame, dict):
        return {"not": type(frame).__name__}
    data = frame.get("data")
    shape: dict[str, Any] = {"type": frame.get("type")}
    if frame.get("type") == "error":
        shape.update(code=data.get("code"), data=keys(data))
    elif frame.get("type") == "observation":
        observation = data.get("observation") or {}
        shape.update(envelope=keys(data), observation=keys(observation), done=data.get("done"),
                     error_type=(observation.get("error") or {}).get("error_type"),
                     result=observation.get("result") is not None)
        if "tools" in observation:
            shape["tools"] = [t["name"] for t in observation["tools"]]
    elif frame.get("type") == "state":
        shape["has"] = sorted({"episode_id", "step_count"} & set(data))
    elif frame.get("type") == "mcp":
        shape["rpc"] = rpc_shape(data)
    return shape


def http_shape(reply) -> dict[str, Any]:
    try:
        body = reply.json()
    except ValueError:
        body = None
    shape: dict[str, Any] = {"status": reply.status}
    if reply.status == 422:
        shape["detail"] = isinstance(body, dict) and isinstance(body.get("detail"), list)
    elif isinstance(body, dict) and {"observation", "done"} <= set(body):
        shape.update(envelope=keys(body), observation=keys(body["observation"]))
    elif isinstance(body, dict) and "jsonrpc" in body:
        shape["rpc"] = rpc_shape(body)
    elif isinstance(body, dict):
        shape["keys"] = keys(body)
    return shape


def still_open(sock: Socket) -> bool:
    try:
        return sock.ask({"type": "state"}, timeout=20)["type"] == "state"
    except Exception:                                        # noqa: BLE001 - closed, one way or another
        return False


def call(name: str, **arguments: Any) -> dict:
    return {"type": "call_tool", "tool_name": name, "arguments": arguments}


def rpc(method: str, params: Any = None, rid: Any = 1, **extra: Any) -> dict:
    message = {"jsonrpc": "2.0", "id": rid, "method": method, **extra}
    if params is not None:
        message["params"] = params
    return message


def mismatches(answers: dict[str, dict[str, Any]]) -> list[str]:
    return [f"{label}:\n  reference {answers['reference'][label]}\n  ours      {answers['ours'][label]}"
            for label in answers["reference"] if answers["reference"][label] != answers["ours"][label]]


# ================================================================ the batteries

# Sent in turn on one /ws socket after a reset of save-groceries; each is followed by a state
# message, to see that the socket stayed open.
WS_BATTERY: list[tuple[str, Any]] = [
    ("state", {"type": "state"}),
    ("list_tools", {"type": "step", "data": {"type": "list_tools"}}),
    ("list_tools with metadata", {"type": "step", "data": {"type": "list_tools", "metadata": {}}}),
    ("call_tool", {"type": "step", "data": call("list_notes")}),
    ("call_tool, no type", {"type": "step", "data": {"tool_name": "list_notes"}}),
    ("call_tool, no arguments", {"type": "step", "data": {"type": "call_tool", "tool_name": "list_notes"}}),
    ("a tool's argument missing", {"type": "step", "data": call("write_note", title="x")}),
    ("a tool's argument extra", {"type": "step", "data": call("write_note", title="x", text="y", z=1)}),
    ("a tool that fails", {"type": "step", "data": call("read_note", title="nothing")}),
    ("an unknown tool", {"type": "step", "data": call("nope")}),
    ("a typo'd action type", {"type": "step", "data": {"type": "cal_tool", "tool_name": "list_notes"}}),
    ("call_tool, no tool_name", {"type": "step", "data": {"type": "call_tool"}}),
    ("tool_name not text", {"type": "step", "data": {"type": "call_tool", "tool_name": 5}}),
    ("arguments null", {"type": "step", "data": {"type": "call_tool", "tool_name": "list_notes",
                                                 "arguments": None}}),
    ("arguments a list", {"type": "step", "data": {"type": "call_tool", "tool_name": "list_notes",
                                                   "arguments": [1]}}),
    ("an action's extra field", {"type": "step", "data": {"type": "list_tools", "zz": 1}}),
    ("step, no data", {"type": "step"}),
    ("step, data null", {"type": "step", "data": None}),
    ("step, data a list", {"type": "step", "data": []}),
    ("step, data a string", {"type": "step", "data": "list_tools"}),
    ("step, extra field", {"type": "step", "data": {"type": "list_tools"}, "zz": 1}),
    ("state with data", {"type": "state", "data": {}}),
    ("close with data", {"type": "close", "data": {}}),
    ("reset data null", {"type": "reset", "data": None}),
    ("reset data a list", {"type": "reset", "data": [1]}),
    ("no type", {}),
    ("type not text", {"type": 5}),
    ("unknown type", {"type": "dance"}),
    ("not JSON", "{not json"),
    ("mcp, no data", {"type": "mcp"}),
    ("mcp, data a list", {"type": "mcp", "data": [rpc("tools/list")]}),
    ("mcp, data not JSON-RPC", {"type": "mcp", "data": {}}),
    ("mcp tools/list", {"type": "mcp", "data": rpc("tools/list")}),
    ("mcp tools/call", {"type": "mcp", "data": rpc("tools/call", {"name": "list_notes"})}),
    ("mcp tools/call, no name", {"type": "mcp", "data": rpc("tools/call", {})}),
    ("mcp tools/call, a tool that fails", {"type": "mcp", "data": rpc(
        "tools/call", {"name": "read_note", "arguments": {"title": "nothing"}})}),
    ("mcp tools/call, an unknown tool", {"type": "mcp", "data": rpc("tools/call", {"name": "nope"})}),
    ("mcp session/create", {"type": "mcp", "data": rpc("openenv/session/create")}),
    ("mcp session/close, no id", {"type": "mcp", "data": rpc("openenv/session/close")}),
    ("mcp session/close, unknown id", {"type": "mcp", "data": rpc("openenv/session/close",
                                                                  {"session_id": "nobody"})}),
    ("mcp unknown method", {"type": "mcp", "data": rpc("resources/list")}),
    ("mcp version 1.0", {"type": "mcp", "data": {**rpc("tools/list"), "jsonrpc": "1.0"}}),
    ("mcp id a fraction", {"type": "mcp", "data": rpc("tools/list", rid=1.5)}),
    ("mcp id an object", {"type": "mcp", "data": rpc("tools/list", rid={"a": 1})}),
    ("mcp id text", {"type": "mcp", "data": rpc("tools/list", rid="seven")}),
    ("mcp notification", {"type": "mcp", "data": {"jsonrpc": "2.0", "method": "tools/list"}}),
    ("mcp params null", {"type": "mcp", "data": {**rpc("tools/list"), "params": None}}),
    ("mcp params a list", {"type": "mcp", "data": rpc("tools/list", [])}),
    ("mcp extra field", {"type": "mcp", "data": rpc("tools/list", zz=1)}),
    ("mcp method not text", {"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": 5}}),
    ("end_turn", {"type": "step", "data": call("end_turn", response="done")}),
    ("after the last turn: list_tools", {"type": "step", "data": {"type": "list_tools"}}),
    ("reset", {"type": "reset", "data": {"split": "all", "index": SAVE}}),
    ("reset with seed and episode_id", {"type": "reset", "data": {"split": "all", "index": SAVE,
                                                                  "seed": 3, "episode_id": "e1"}}),
    ("close", {"type": "close"}),
]


def play_ws_battery(server: Server) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    sock = Socket(server.ws_url + "/ws")
    try:
        sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        for label, message in WS_BATTERY:
            sock.send(message)
            try:
                reply = frame_shape(sock.recv(timeout=30))
            except Exception as exc:                         # noqa: BLE001 - a close is an answer
                reply = {"closed": type(exc).__name__ != "TimeoutError"}
            opened = still_open(sock)
            answers[label] = {**reply, "open": opened}
            if not opened:                                   # a new socket, a new episode
                sock.close()
                sock = Socket(server.ws_url + "/ws")
                sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
    finally:
        sock.close()
    return answers


def test_every_ws_message_type_good_and_bad(servers):
    answers = {name: play_ws_battery(server) for name, server in both(servers).items()}
    assert not mismatches(answers), "\n".join(mismatches(answers))
    ours = answers["ours"]
    # what the issue found, made equal: no type is call_tool; malformed actions are refused
    assert ours["call_tool, no type"]["result"] and ours["call_tool, no type"]["error_type"] is None
    for label in ("a typo'd action type", "call_tool, no tool_name", "step, data null",
                  "step, data a list", "step, data a string", "step, no data"):
        assert ours[label]["code"] == "VALIDATION_ERROR" and ours[label]["open"], label
    assert ours["a tool's argument missing"]["error_type"] == "invalid_args"
    assert ours["a tool that fails"]["error_type"] == "execution_error"
    assert ours["close"] == {"closed": True, "open": False}
    servers[1].no_envs()


def test_list_tools_and_session_create_before_any_reset(servers):
    """No episode yet: the tools a reset would offer, and the socket's own session."""
    for name, server in both(servers).items():
        with Socket(server.ws_url + "/ws") as sock:
            listed = sock.ask({"type": "step", "data": {"type": "list_tools"}}, timeout=60)
            assert frame_shape(listed)["tools"] == TOOLS, (name, listed)
            inside = sock.ask({"type": "mcp", "data": rpc("tools/list")}, timeout=60)
            assert rpc_shape(inside["data"])["tools"] == TOOLS, (name, inside)
            first = sock.ask({"type": "mcp", "data": rpc("openenv/session/create")})["data"]
            again = sock.ask({"type": "mcp", "data": rpc("openenv/session/create", rid=2)})["data"]
            assert first["result"]["session_id"] == again["result"]["session_id"], name
            own = sock.ask({"type": "mcp", "data": rpc("openenv/session/close",
                                                       {"session_id": first["result"]["session_id"]})})
            assert own["data"]["error"]["code"] == -32600, (name, own)     # not by a message
        with Socket(server.ws_url + "/mcp") as mcp:
            assert rpc_shape(mcp.ask(rpc("tools/list"), timeout=60))["tools"] == TOOLS, name
        reply = request(server.url + "/mcp", "POST", rpc("tools/list"), timeout=60)
        assert rpc_shape(reply.json())["tools"] == TOOLS, name
        reply = request(server.url + "/step", "POST", {"action": {"type": "list_tools"}}, timeout=60)
        assert [t["name"] for t in reply.json()["observation"]["tools"]] == TOOLS, name
    servers[1].no_envs()                       # ours deployed once to find them, and tore it down


def test_no_message_takes_a_slot_it_does_not_give_back(servers):
    """openenv/session/create over /ws and WebSocket /mcp answers the socket's own session: with
    a limit of 3, two sockets sending three each leave one slot, for one HTTP session."""
    outcomes = {}
    for name, server in both(servers).items():
        with Socket(server.ws_url + "/ws") as ws, Socket(server.ws_url + "/mcp") as mcp:
            ws_ids = {ws.ask({"type": "mcp", "data": rpc("openenv/session/create", rid=i)})
                      ["data"]["result"]["session_id"] for i in range(3)}
            mcp_ids = {mcp.ask(rpc("openenv/session/create", rid=i))["result"]["session_id"]
                       for i in range(3)}
            assert len(ws_ids) == len(mcp_ids) == 1 and ws_ids != mcp_ids, name
            third = request(server.url + "/mcp", "POST", rpc("openenv/session/create")).json()
            fourth = request(server.url + "/mcp", "POST", rpc("openenv/session/create")).json()
            closed = request(server.url + "/mcp", "POST", rpc(
                "openenv/session/close", {"session_id": third["result"]["session_id"]})).json()
            outcomes[name] = (sorted(third["result"]), fourth["error"]["code"],
                              sorted(fourth["error"]["data"]), closed["result"]["closed"])
    assert outcomes["ours"][:2] == outcomes["reference"][:2] == (["session_id"], -32000)
    assert set(outcomes["reference"][2]) <= set(outcomes["ours"][2])       # ours adds retry_after_s
    assert outcomes["ours"][3] is outcomes["reference"][3] is True


MCP_BATTERY: list[tuple[str, Any]] = [
    ("tools/list", rpc("tools/list")),
    ("tools/list, id text", rpc("tools/list", rid="seven")),
    ("tools/list, id a fraction", rpc("tools/list", rid=2.5)),
    ("tools/list, id whole as a float", rpc("tools/list", rid=3.0)),
    ("notification", {"jsonrpc": "2.0", "method": "tools/list"}),
    ("version 1.0", {**rpc("tools/list"), "jsonrpc": "1.0"}),
    ("no version", {"id": 1, "method": "tools/list"}),
    ("no method", {"jsonrpc": "2.0", "id": 1}),
    ("method not text", {"jsonrpc": "2.0", "id": 1, "method": ["tools/list"]}),
    ("unknown method", rpc("prompts/list")),
    ("params null", {**rpc("tools/list"), "params": None}),
    ("params a list", rpc("tools/list", [1])),
    ("params text", rpc("tools/list", "x")),
    ("extra field", rpc("tools/list", zz=1)),
    ("tools/call, no name", rpc("tools/call", {})),
    ("tools/call, empty name", rpc("tools/call", {"name": ""})),
    ("session/create", rpc("openenv/session/create")),
    ("session/close, no id", rpc("openenv/session/close", {})),
    ("session/close, unknown id", rpc("openenv/session/close", {"session_id": "nobody"})),
    ("tools/list, unknown session", rpc("tools/list", {"session_id": "nobody"})),
    ("not JSON", "{not json"),
    ("a number", "7"),                      # on WebSocket /mcp: a deviation, tested there
    ("null", "null"),
]
NOT_OBJECTS = ("a number", "null")


def play_mcp(server: Server, websocket: bool) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    sock = Socket(server.ws_url + "/mcp") if websocket else None
    try:
        for label, message in MCP_BATTERY:
            if sock is None:
                body = message.encode() if isinstance(message, str) else message
                answers[label] = rpc_shape(request(server.url + "/mcp", "POST", body, timeout=60).json())
                if label == "session/create":     # give the slot back
                    sid = request(server.url + "/mcp", "POST", rpc("openenv/session/create")).json()
                    request(server.url + "/mcp", "POST", rpc("openenv/session/close", {
                        "session_id": sid["result"]["session_id"]}))
                continue
            if label in NOT_OBJECTS:
                continue
            answers[label] = rpc_shape(sock.ask(message, timeout=60))
            answers[label]["open"] = rpc_shape(sock.ask(rpc("tools/list", rid=99), timeout=60)) \
                .get("tools") == TOOLS
    finally:
        if sock:
            sock.close()
    return answers


@pytest.mark.parametrize("websocket", [False, True], ids=["POST /mcp", "WebSocket /mcp"])
def test_json_rpc_bodies(servers, websocket):
    answers = {name: play_mcp(server, websocket) for name, server in both(servers).items()}
    assert not mismatches(answers), "\n".join(mismatches(answers))


def test_pipelined_messages_are_answered_in_order(servers):
    burst = [{"type": "state"}, {"type": "step", "data": {"type": "list_tools"}}, {"type": "dance"},
             "{not json", {"type": "step", "data": call("list_notes")},
             {"type": "step", "data": {"type": "cal_tool"}}, {"type": "mcp", "data": rpc("tools/list")},
             {"type": "state"}]
    seen = {}
    for name, server in both(servers).items():
        with Socket(server.ws_url + "/ws") as sock:
            sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
            for message in burst:                            # all sent before any is read
                sock.send(message)
            seen[name] = [frame_shape(sock.recv(timeout=60)) for _ in burst]
            assert still_open(sock), name
    assert seen["ours"] == seen["reference"]
    assert [s["type"] for s in seen["ours"]] == ["state", "observation", "error", "error",
                                                 "observation", "error", "mcp", "state"]
    servers[1].no_envs()


def test_an_oversized_frame_closes_with_1009(servers):
    for name, server in both(servers).items():
        with Socket(server.ws_url + "/ws") as sock:
            sock.send(json.dumps({"type": "state", "pad": "x" * (17 * 2**20)}))
            assert sock.closed_with(30) == 1009, name
        with Socket(server.ws_url + "/ws") as sock:                        # the server goes on
            assert sock.ask({"type": "state"})["type"] == "state", name


HTTP_BATTERY: list[tuple[str, str, str, Any]] = [
    ("health", "GET", "/health", None), ("metadata", "GET", "/metadata", None),
    ("schema", "GET", "/schema", None), ("openapi", "GET", "/openapi.json", None),
    ("state", "GET", "/state", None),
    ("reset, no body", "POST", "/reset", None), ("reset", "POST", "/reset", {"split": "all", "index": 1}),
    ("reset, not JSON", "POST", "/reset", b"[1"), ("reset, a list", "POST", "/reset", []),
    ("reset, seed below 0", "POST", "/reset", {"seed": -1}),
    ("reset, seed text", "POST", "/reset", {"seed": "x"}),
    ("reset, episode_id a number", "POST", "/reset", {"episode_id": 5}),
    ("reset, episode_id too long", "POST", "/reset", {"episode_id": "e" * 256}),
    ("step, no action", "POST", "/step", {}), ("step, action a list", "POST", "/step", {"action": []}),
    ("step, list_tools", "POST", "/step", {"action": {"type": "list_tools"}}),
    ("step, a typo'd type", "POST", "/step", {"action": {"type": "dance"}}),
    ("step, no tool_name", "POST", "/step", {"action": {"type": "call_tool"}}),
    ("step, extra in the action", "POST", "/step", {"action": {"type": "list_tools", "zz": 1}}),
    ("step, timeout_s 0", "POST", "/step", {"action": {"type": "list_tools"}, "timeout_s": 0}),
    ("step, timeout_s text", "POST", "/step", {"action": {"type": "list_tools"}, "timeout_s": "x"}),
    ("step, request_id a number", "POST", "/step", {"action": {"type": "list_tools"}, "request_id": 1}),
    ("step, extra in the body", "POST", "/step", {"action": {"type": "list_tools"}, "render": True}),
    ("step, not JSON", "POST", "/step", b"{"),
    ("mcp, empty object", "POST", "/mcp", {}),
    ("GET /reset", "GET", "/reset", None), ("GET /ws/x", "GET", "/ws/x", None),
    ("list_environments", "GET", "/list_environments", None),
    ("splits", "GET", "/notes-v1/splits", None), ("splits, any case", "GET", "/NOTES-V1/splits", None),
    ("splits, another env", "GET", "/notes-v2/splits", None),
    ("tasks", "POST", "/notes-v1/tasks", {"split": "all"}),
    ("tasks, unknown split", "POST", "/notes-v1/tasks", {"split": "train"}),
    ("tasks, no split", "POST", "/notes-v1/tasks", {}),
    ("tasks, split a number", "POST", "/notes-v1/tasks", {"split": 1}),
    ("tasks, extra field", "POST", "/notes-v1/tasks", {"split": "all", "zz": 1}),
    ("tasks, not JSON", "POST", "/notes-v1/tasks", b"{"),
    ("tasks, another env", "POST", "/notes-v2/tasks", {"split": "all"}),
    ("num_tasks", "POST", "/notes-v1/num_tasks", {"split": "smoke"}),
    ("num_tasks, unknown split", "POST", "/notes-v1/num_tasks", {"split": "train"}),
    ("task", "POST", "/notes-v1/task", {"split": "all", "index": 2}),
    ("task, past the end", "POST", "/notes-v1/task", {"split": "all", "index": 3}),
    ("task, no index", "POST", "/notes-v1/task", {"split": "all"}),
    ("task, index text", "POST", "/notes-v1/task", {"split": "all", "index": "a"}),
    ("task_range", "POST", "/notes-v1/task_range", {"split": "all", "start": 1, "stop": 3}),
    ("task_range, open", "POST", "/notes-v1/task_range", {"split": "all"}),
    ("task_range, start text", "POST", "/notes-v1/task_range", {"split": "all", "start": "a"}),
    ("task_range, stop a list", "POST", "/notes-v1/task_range", {"split": "all", "stop": []}),
]


def test_every_http_route_good_and_bad_bodies(servers):
    answers: dict[str, dict[str, Any]] = {"reference": {}, "ours": {}}
    for name, server in both(servers).items():
        for label, method, path, body in HTTP_BATTERY:
            reply = request(server.url + path, method, body, timeout=60)
            answers[name][label] = http_shape(reply)
            if label == "state":       # ours adds the task's fields to OpenEnv's two
                assert {"episode_id", "step_count"} <= set(reply.json()), name
                answers[name][label] = {"status": reply.status}
    assert not mismatches(answers), "\n".join(mismatches(answers))
    servers[1].no_envs()


def test_mcp_tool_client_lists_tools_before_reset_and_keeps_them(servers):
    from openenv.core.mcp_client import MCPToolClient

    for name, server in both(servers).items():
        with MCPToolClient(base_url=server.url).sync() as tools:
            before = [t.name for t in tools.list_tools()]
            tools.reset(split="all", index=SAVE)
            after = [t.name for t in tools.list_tools()]
            assert before == after == TOOLS, (name, before, after)
            with pytest.raises(RuntimeError):                # arguments that don't fit: raises
                tools.call_tool("write_note", title="groceries")
            with pytest.raises(RuntimeError):                # a tool that fails: raises
                tools.call_tool("read_note", title="nothing")
            assert tools.call_tool("write_note", title="groceries", text="eggs and milk") == \
                "saved note 'groceries'"
    servers[1].no_envs()


# ================================================================ the deliberate deviations

def frames_then_open(server: Server, message: Any) -> tuple[dict, bool]:
    with Socket(server.ws_url + "/ws") as sock:
        sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        sock.send(message)
        return sock.recv(timeout=30), still_open(sock)


def test_deviation_ws_frame_not_an_object(servers):
    reference, ours = servers
    for message in ("[1]", '"state"', "7", "null"):
        frame, opened = frames_then_open(reference, message)
        assert (frame["data"]["code"], opened) == ("SESSION_ERROR", False), message
        frame, opened = frames_then_open(ours, message)
        assert (frame["data"]["code"], opened) == ("VALIDATION_ERROR", True), message
        assert "message object" in frame["data"]["message"]
    ours.no_envs()


def test_deviation_ws_binary_frame(servers):
    reference, ours = servers
    frame, opened = frames_then_open(reference, b'{"type": "state"}')
    assert (frame["data"]["code"], opened) == ("SESSION_ERROR", False)
    frame, opened = frames_then_open(ours, b'{"type": "state"}')
    assert (frame["data"]["code"], opened) == ("INVALID_JSON", True)
    assert "binary frame" in frame["data"]["message"]
    ours.no_envs()


def test_deviation_mcp_websocket_frame_not_an_object(servers):
    reference, ours = servers
    for frame in ([rpc("tools/list")], 7, None):               # a batch, a number, null
        with Socket(reference.ws_url + "/mcp") as sock:
            assert sock.ask(json.dumps(frame))["error"]["code"] == -32000
            assert sock.closed_with(10) is not None
        with Socket(ours.ws_url + "/mcp") as sock:
            assert sock.ask(json.dumps(frame))["error"]["code"] == -32700
            assert rpc_shape(sock.ask(rpc("tools/list"), timeout=60))["tools"] == TOOLS   # open
        for server in servers:                               # what POST /mcp answers, on both
            assert request(server.url + "/mcp", "POST", frame if frame is not None else b"null"
                           ).json()["error"]["code"] == -32700


def test_deviation_arguments_that_do_not_fit_are_invalid_params(servers):
    reference, ours = servers
    codes = {}
    for name, server in (("reference", reference), ("ours", ours)):
        with Socket(server.ws_url + "/ws") as sock:
            sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
            step = sock.ask({"type": "step", "data": call("write_note", title="x")})
            assert step["data"]["observation"]["error"]["error_type"] == "invalid_args", name
            codes[name] = [sock.ask({"type": "mcp", "data": rpc("tools/call", {
                "name": "write_note", "arguments": arguments})})["data"]["error"]["code"]
                for arguments in ({"title": "x"}, [1])]
            failed = sock.ask({"type": "mcp", "data": rpc("tools/call", {
                "name": "read_note", "arguments": {"title": "nothing"}})})["data"]["error"]["code"]
            assert failed == -32603, name                     # a tool that failed: the same
    assert codes == {"reference": [-32603, -32603], "ours": [-32602, -32602]}
    ours.no_envs()


def test_deviation_tools_run_only_in_an_episode(servers):
    reference, ours = servers
    with Socket(reference.ws_url + "/ws") as sock:            # no reset: the tool runs
        step = sock.ask({"type": "step", "data": call("list_notes")})["data"]
        assert step["done"] is False and step["observation"]["result"]["data"] == "(no notes)"
    reply = request(reference.url + "/mcp", "POST", rpc("tools/call", {"name": "list_notes"})).json()
    assert reply["result"]["data"] == "(no notes)"
    with Socket(ours.ws_url + "/ws") as sock:
        step = sock.ask({"type": "step", "data": call("list_notes")})["data"]
        assert step["done"] is True and step["reward"] == 0.0
        assert step["observation"]["metadata"]["error"] == "the episode has ended; call reset"
        assert sock.ask({"type": "step", "data": {"type": "list_tools"}})["data"]["done"] is False
    reply = request(ours.url + "/mcp", "POST", rpc("tools/call", {"name": "list_notes"})).json()
    assert reply["error"]["code"] == -32603 and "call reset" in reply["error"]["message"]
    ours.no_envs()


def test_deviation_every_step_carries_a_number_reward(servers):
    """The reference's tool steps carry reward null, which OpenEnv's own reward_well_formed grader
    fails; ours carry 0.0 until the score (errors too), and reset null as both do."""
    from openenv.validation.graders.runtime.basic import RewardWellFormedGrader
    from tests.test_openenv import collect_evidence

    reference, ours = servers
    actions = [{"type": "list_tools"}, call("write_note", title="groceries"), call("nope"),
               call("read_note", title="nothing"), {"tool_name": "list_notes"},
               call("write_note", title="groceries", text="eggs, milk"), call("end_turn", response="ok")]
    rewards = {}
    for name, server in (("reference", reference), ("ours", ours)):
        subject = collect_evidence(server.url, actions)
        steps = [json.loads(e.response_json)["data"] for e in subject.runtime_evidence.exchanges
                 if e.operation in ("reset", "step")]
        rewards[name] = [s["reward"] for s in steps]
        result = RewardWellFormedGrader().run(subject)
        assert result.status.value == ("pass" if name == "ours" else "fail"), (name, result.evidence)
    assert rewards["reference"][0] is None and rewards["ours"][0] is None          # reset
    assert None in rewards["reference"][1:]
    assert rewards["ours"][1:] == [0.0] * (len(actions) - 1) + [1.0]
    ours.no_envs()


def test_deviation_one_segment_paths_are_gym_tool_routes(servers):
    reference, ours = servers
    for method, path in (("GET", "/nothing"), ("POST", "/health"), ("POST", "/nothing")):
        assert request(reference.url + path, method).status == (404 if path == "/nothing" else 405)
    # Gym's POST /{tool} route is there: GET answers 405, POST Gym's own refusal of the call
    nothing = request(ours.url + "/nothing", "GET")
    assert nothing.status == 405 and nothing.json() == {"detail": "Method Not Allowed"}
    assert "POST" in nothing.headers["Allow"]
    for path in ("/health", "/nothing"):
        called = request(ours.url + path, "POST", {})
        assert called.status == 400 and "seed_session" in called.text, called.text
    assert request(ours.url + "/nothing/deeper", "GET").json() == {"detail": "Not Found"}


def test_deviation_a_tool_timeout_ends_the_episode(tmp_path):
    slow = with_sleep_tool(copy_bundle(tmp_path / "slow-v1"))
    with running(Server.openenv_reference(tmp_path / "reference",
                                          env={"REFERENCE_TOOL_TIMEOUT": "2"})) as reference, \
            serving(slow, tmp_path / "ours", "--client-timeout", "3", "--reply-margin", "1") as ours:
        seen = {}
        for name, server, seconds in (("reference", reference, 30), ("ours", ours, "30")):
            with Socket(server.ws_url + "/ws") as sock:
                sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
                started = time.monotonic()
                slow_step = sock.ask({"type": "step", "data": call("sleep", seconds=seconds)},
                                     timeout=60)["data"]
                took = time.monotonic() - started
                after = sock.ask({"type": "step", "data": call("list_notes")}, timeout=60)["data"]
                seen[name] = (slow_step["observation"]["error"]["error_type"], slow_step["done"],
                              after["done"], took < 2.9)
                if name == "ours":
                    assert slow_step["observation"]["metadata"]["failure_kind"] == "transport_timeout"
                    assert after["observation"]["metadata"]["status"] == "error"
        assert seen == {"reference": ("timeout", False, False, True), "ours": ("timeout", True, True, True)}
        ours.no_envs()


def test_deviation_numbers_given_as_text_are_refused(servers):
    """The reference's pydantic models coerce text that reads as a number; ours take the JSON
    type given and say what is wrong (an error observation, as for any task that isn't there),
    and the socket goes on."""
    reference, ours = servers
    reset = {"type": "reset", "data": {"split": "all", "index": str(SAVE)}}
    with Socket(reference.ws_url + "/ws") as sock:
        assert sock.ask(reset, timeout=60)["type"] == "observation"
    with Socket(ours.ws_url + "/ws") as sock:
        reply = sock.ask(reset)["data"]
        assert reply["done"] is True and reply["observation"]["metadata"]["error"] == (
            "index '1' is not a whole number; give the task's place in its split as one, from 0 to 2")
        again = sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}}, timeout=60)
        assert again["type"] == "observation" and again["data"]["done"] is False, again
    body = {"split": "all", "index": str(SAVE)}
    assert request(reference.url + "/reset", "POST", body, timeout=60).status == 200
    reply = request(ours.url + "/reset", "POST", body, timeout=60)
    assert reply.status == 200 and "is not a whole number" in reply.json()["observation"][
        "metadata"]["error"], reply.text
    ours.no_envs()


def test_deviation_what_a_browser_sends_for_another_site_is_refused(servers):
    """OpenEnv's server answers any Origin and any Host, so any page the operator visits can play
    its tasks over a WebSocket, and it refuses a text/plain body as a body of no fields (422).
    Ours refuses the page (403), the Host (421) and the body's type (415, saying to send JSON); a
    client that is not a browser sends none of them, and is answered as the reference answers."""
    reference, ours = servers
    body = json.dumps({"split": "all", "index": SAVE}).encode()
    plain = {"Content-Type": "text/plain"}
    assert request(reference.url + "/reset", "POST", body, headers=plain, timeout=60).status == 422
    assert request(ours.url + "/reset", "POST", body, headers=plain, timeout=60).status == 415
    for headers, status in (({"Origin": "http://evil.example"}, 403), ({"Host": "evil.example"}, 421)):
        assert request(reference.url + "/health", "GET", headers=headers).status == 200
        assert request(ours.url + "/health", "GET", headers=headers).status == status
    with Socket(reference.ws_url + "/ws", {"Origin": "http://evil.example"}) as sock:
        assert sock.ask({"type": "state"})["type"] == "state"
    with pytest.raises(InvalidStatus) as refused:
        Socket(ours.ws_url + "/ws", {"Origin": "http://evil.example"})
    assert refused.value.response.status_code == 403
    for server in servers:                  # what is not a browser's is answered alike
        assert request(server.url + "/reset", "POST", body, timeout=60).status == 200
    ours.no_envs()


DEVIATION_TESTS = {
    "ws-frame-not-an-object": test_deviation_ws_frame_not_an_object,
    "ws-binary-frame": test_deviation_ws_binary_frame,
    "mcp-websocket-frame-not-an-object": test_deviation_mcp_websocket_frame_not_an_object,
    "invalid-params": test_deviation_arguments_that_do_not_fit_are_invalid_params,
    "tools-need-an-episode": test_deviation_tools_run_only_in_an_episode,
    "step-reward-a-number": test_deviation_every_step_carries_a_number_reward,
    "one-segment-paths-are-gym-tool-routes": test_deviation_one_segment_paths_are_gym_tool_routes,
    "tool-timeout-ends-the-episode": test_deviation_a_tool_timeout_ends_the_episode,
    "numbers-as-text": test_deviation_numbers_given_as_text_are_refused,
    "a-browser-for-another-site": test_deviation_what_a_browser_sends_for_another_site_is_refused,
}


def test_the_deviations_page_is_the_deviations_tested():
    page = (REPO / "docs" / "deviations.md").read_text()
    section = page.split("# Deliberate deviations from the reference servers", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|.*\| `(test_deviation_\w+)` \|$", section, re.M)
    assert {row: test for row, test in rows} == \
        {row: test.__name__ for row, test in DEVIATION_TESTS.items()}
