"""Bad input (issue 6), as a user of ``python agentenv.py serve`` sees it.

Every mistake a caller can make is answered with a clear error (a 4xx whose message says what to
do; OpenEnv's error frames on /ws; JSON-RPC error codes on /mcp), and never at the cost of anyone
else: each test that sends bad input to the server does so inside ``survivor(server)``, which
starts a Gym rollout and an OpenEnv /ws episode on the same server *before* the bad request, and
after it plays both to the end and checks that they score 1.0, that /health answers, and that the
server logged no traceback meanwhile.

One server (``serve bundles/notes-v1 --sandbox local``, a subprocess) is shared by the module,
fuzzers included. Tests of what happens before a server exists (Bundle.load, write-gym) have no
survivor.

Where each case is covered (E = an existing test elsewhere, H = here):

  malformed JSON       /seed_session /verify /close_session /aggregate_metrics (+ /ng-rollout/ prefix)
                         E test_gym_surface.py::test_a_body_that_is_not_json_is_422
                       /{tool}   E test_gym_surface.py::test_a_tool_call_whose_body_is_not_a_json_object_answers_text
                       /reset    E test_openenv.py::test_stateless_http_reset_step_state (b"[1")
                       POST /mcp E test_openenv.py::test_metadata_schema_openapi_and_mcp_probe (-32700)
                       /ws       E test_openenv.py::test_step_errors_tools_and_frames (INVALID_JSON)
                       WS /mcp   E test_openenv.py::test_websocket_mcp_is_one_session_per_connection (-32700)
                       /step, the task API                 H test_malformed_json_is_422
                       deeply nested JSON, every route     H test_deeply_nested_json_*
  non-object JSON      /{tool} ([1, 2])  E test_gym_surface.py::test_a_tool_call_whose_body_is_not_a_json_object_answers_text
                       POST /mcp ({})    E test_openenv.py::test_metadata_schema_openapi_and_mcp_probe
                       every other route, /ws, WS /mcp     H test_non_object_json_bodies, test_ws_bad_messages,
                                                             test_mcp_ws_bad_messages
  wrong types          H test_seed_wrong_types, test_verify_wrong_types, test_verify_a_malformed_responses_object,
                         test_close_session_and_aggregate_wrong_types, test_reset_wrong_types,
                         test_reset_a_split_that_is_empty_or_false, ..._an_array_or_object,
                         test_step_action_not_an_object, test_task_api_a_split_that_is_an_array,
                         test_task_api_wrong_types_and_missing_fields, test_mcp_post_bad_requests,
                         test_ws_bad_messages; a tool's own argument errors
                         E test_gym_surface.py::test_a_models_bad_calls_are_text_it_reads_and_not_masked
  missing fields       seed (no split/index)  E test_gym_surface.py::test_a_row_naming_no_task_here_is_refused_listing_what_exists
                       verify (no row/response) E test_gym_surface.py::test_verify_without_the_row_or_the_response_is_422
                       /step (no action)      E test_openenv.py::test_stateless_http_reset_step_state
                       /reset (split xor index) E test_openenv.py::test_reset_errors_are_observations
                       task API, /mcp, /ws    H (the wrong-types tests above)
  unknown tools        Gym  E test_gym_surface.py::test_a_models_bad_calls_are_text_it_reads_and_not_masked,
                            ::test_the_url_mode_server_answers_an_unknown_tool_as_bundle_mode_does
                       /ws  E test_openenv.py::test_step_errors_tools_and_frames
                       JSON-RPC, and Gym tools named like the server's routes  H test_unknown_tools
  cookies              missing (tool, verify)  E test_gym_surface.py::test_calls_without_a_session_cookie_are_400
                       unknown on verify       E test_gym_surface.py::test_verify_with_an_unknown_cookie_is_masked_session_lost
                       forged / odd / long / doubled, on a tool and on verify  H test_forged_cookies
  verify before seed   E test_gym_surface.py::test_calls_without_a_session_cookie_are_400 (no cookie: 400)
  verify twice, a tool after verify   H (spec of ccb7799) test_verify_twice_*, test_a_tool_after_verify_is_409
  split/index range    Gym  E test_gym_surface.py::test_a_row_naming_no_task_here_is_refused_listing_what_exists
                       /ws  E test_openenv.py::test_reset_errors_are_observations; task API /task
                            E test_openenv.py::test_task_api
                       HTTP /reset, task_range  H test_out_of_range, test_out_of_range_task_range_negative_start
  task_id vs split/index  E test_gym_surface.py::test_a_row_whose_task_id_is_not_its_split_and_index_is_refused
                       another bundle's task_id, the task_data form   H test_a_task_id_of_another_bundle_is_refused
  huge bodies / frames H test_a_17_mib_body_is_413 (every POST route; chunked too), test_huge_frames_close_1009
  non-UTF-8            H test_non_utf8_bytes_in_json_bodies, test_non_utf8_bytes_in_tool_arguments,
                         test_a_lone_surrogate_in_tool_arguments_*, test_invalid_utf8_text_frames_close_1007
  garbage frames       H test_ws_bad_messages, test_mcp_ws_bad_messages, test_binary_frames_are_answered,
                         test_invalid_utf8_text_frames_close_1007, test_huge_frames_close_1009,
                         test_deeply_nested_json_frames_are_answered
  oversized tool output H test_oversized_tool_output_is_cut_and_says_so
  hostile names        H test_eval_entries_that_leave_tasks_are_refused, test_a_dockerfile_outside_the_env_folder_*,
                         test_an_environment_name_with_a_path_*, test_references_with_dot_dot_name_nothing,
                         test_odd_characters_in_file_names_load_and_play, test_write_gym_*
  bearer token         H (spec of ccb7799) test_token_*; a token file, bad header bytes (issue 38)
                         H test_token_file_*, test_bad_header_bytes_are_401_never_500
  a browser's page     (issue 38) a cross-origin upgrade, a body that is not JSON, a foreign Host, a
                       cross-site fetch, a session table flooded cross-site, --allow-host
                         H test_a_web_page_*, test_a_foreign_host_is_421_*, test_allow_host_*;
                       a real browser's hostile page  E test_web.py::test_a_hostile_page_in_a_real_browser_*
  property-based       H test_fuzz_* (hypothesis: Gym HTTP, OpenEnv HTTP, /ws frames, /mcp frames)

Async code runs with ``asyncio.run`` (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.cookies
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, InvalidStatus


import agentenv
from tests.harness import (COOKIE, NOTES, Reply, Server, Socket, SyncGym, copy_bundle, free_port,
                           request, responses, serving, gym_row as harness_row)

BUNDLE = agentenv.Bundle.load(NOTES)
ENV = "notes-v1"
RECALL, SAVE, TWO_STEP = 0, 1, 2
NOTES_TOOLS = ["write_note", "read_note", "list_notes", "end_turn"]
MAX_BODY = 16 * 2**20               # the server's client_max_size and WebSocket max_msg_size
TOOL_CAP = 100_000                  # characters of a tool's text passed on (agentenv.MAX_TOOL_OUTPUT)
TOKEN = "s3cret"
ENDED = "the episode has ended; call reset"

# ================================================================ the server and its clients

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The one server of this module (fuzzers included), with room for many sessions at once."""
    with serving(NOTES, tmp_path_factory.mktemp("bad-input"), "--max-concurrent-envs", "32") as served:
        yield served


def gym_row(index: int) -> dict:
    """The row write-gym writes for the task at all[index] (its tools as Responses tools)."""
    return harness_row(BUNDLE, index, tools=NOTES_TOOLS)


def gym_rollout(server: Server, index: int = SAVE) -> SyncGym:
    """One Gym rollout of the task at all[index], as simple_agent plays it."""
    return SyncGym(server, gym_row(index))


def step_call(name: str, **arguments: Any) -> dict:
    return {"type": "step", "data": {"type": "call_tool", "tool_name": name, "arguments": arguments}}


def tool_data(frame: dict) -> Any:
    """What a /ws step frame says a tool answered."""
    assert frame["type"] == "observation", frame
    result = frame["data"]["observation"].get("result")
    assert result is not None, frame
    return result["data"]


# ================================================================ the survivor

def server_errors(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if "Traceback" in line or "Error handling request" in line or "Unhandled exception" in line]


@contextlib.contextmanager
def survivor(server: Server) -> Iterator[Any]:
    """Another user of the same server, started before the bad request: a Gym rollout and an
    OpenEnv /ws episode of save-groceries, each with a note written. After the block both play
    on to the end and score 1.0, /health answers, and the server logged no error meanwhile."""
    mark = len(server.log())
    gym = gym_rollout(server, SAVE)
    gym.seed()                          # answers at once; its env deploys beside the /ws one
    oe = Socket(server.ws_url + "/ws", server.headers)
    try:
        reset = oe.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        assert reset["type"] == "observation" and reset["data"]["done"] is False, reset
        saved = gym.call("write_note", title="groceries", text="eggs and milk")
        assert (saved.status, saved.text) == (200, "saved note 'groceries'")
        assert tool_data(oe.ask(step_call("write_note", title="groceries", text="milk, eggs"))) == \
            "saved note 'groceries'"
        yield
        assert server.healthy(), f"the server no longer answers /health:\n{server.log()[-3000:]}"
        read = gym.call("read_note", title="groceries")
        assert (read.status, read.text) == (200, "eggs and milk"), "the Gym rollout lost its state"
        with ThreadPoolExecutor(1) as pool:           # both score at once
            verifying = pool.submit(gym.verify, "Saved.")
            assert tool_data(oe.ask(step_call("list_notes"))) == "groceries"
            ended = oe.ask(step_call("end_turn", response="Saved."))
            assert (ended["data"]["done"], ended["data"]["reward"]) == (True, 1.0), ended
            verified = verifying.result(timeout=60)
        assert verified.status == 200, verified.text
        body = verified.json()
        assert (body["reward"], body["mask_sample"], body["failure_kind"]) == (1.0, False, None), body
        logged = server.log()[mark:]
        assert not server_errors(logged), "the server logged errors:\n" + logged[-3000:]
    finally:
        oe.close()
        with contextlib.suppress(Exception):
            gym.close()


def assert_422(reply: Reply, kind: str) -> str:
    """A 422 in FastAPI's shape, as OpenEnv's own server answers a bad body; its message."""
    assert reply.status == 422, (reply.status, reply.text)
    assert reply.headers.get_content_type() == "application/json"
    detail = reply.json()["detail"]
    assert detail[0]["type"] == kind and detail[0]["loc"] == ["body"], detail
    return detail[0]["msg"]


# ================================================================ 1. HTTP bodies: malformed, non-object, non-UTF-8, deep

TASK_API = [f"/{ENV}/{route}" for route in ("tasks", "num_tasks", "task", "task_range")]
JSON_BODY_ROUTES = ["/seed_session", "/verify", "/close_session", "/aggregate_metrics", "/reset",
                    "/step", *TASK_API]


def test_malformed_json_is_422(server):
    with survivor(server):
        for route in ["/step", *TASK_API]:
            for raw in (b"{not json", b'{"split": "all",}', b"[1", b"'single'", b'{"a": 1} trailing'):
                message = assert_422(request(server.url + route, body=raw), "json_invalid")
                assert message.startswith("the body is not JSON: "), (route, raw)


def test_non_object_json_bodies(server):
    """422 on the JSON routes, text on a tool's route ([1, 2] is covered elsewhere), -32700 on
    POST /mcp as OpenEnv answers it (a batch too: the server takes one request at a time)."""
    with survivor(server):
        for route in JSON_BODY_ROUTES:
            for raw in (b"[1, 2]", b'"split"', b"null", b"5", b"true", b"[]"):
                message = assert_422(request(server.url + route, body=raw, cookie="whatever"),
                                     "model_attributes_type")
                assert message == "the body must be a JSON object", (route, raw)
        rollout = gym_rollout(server, RECALL)
        rollout.seed()
        for raw in (b"null", b'"title"', b"7", b"false"):
            reply = rollout.post("/read_note", raw)
            assert (reply.status, reply.text) == \
                (400, "error: the arguments of read_note must be a JSON object")
        assert rollout.call("read_note", title="pancakes").text == "2 eggs, 1 cup milk, 1 cup flour"
        rollout.close()
        for raw in (b"[]", b"null", b'"tools/list"', b"3",
                    b'[{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}]'):
            reply = request(server.url + "/mcp", body=raw)
            assert reply.status == 200            # JSON-RPC over HTTP: always 200, the error inside
            assert reply.json()["error"]["code"] == -32700
            assert reply.json()["error"]["message"].startswith("Parse error: a request is one JSON "
                                                               "object")


NON_UTF8 = [b'{"split": "\xff\xfe", "index": 0}', b'{"title": "caf\xe9"}', b"\xc3\x28",
            b'{"a": "\xc0\xaf"}']          # the last: an overlong encoding of "/"


def test_non_utf8_bytes_in_json_bodies(server):
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        for route in JSON_BODY_ROUTES + ["/mcp", "/write_note"]:
            for raw in NON_UTF8:
                reply = request(server.url + route, body=raw, cookie=rollout.cookie)
                if route == "/mcp":
                    assert reply.status == 200 and reply.json()["error"]["code"] == -32700
                    assert "utf-8" in reply.json()["error"]["message"]
                elif route == "/write_note":
                    assert reply.status == 400
                    assert reply.text.startswith("error: the arguments of write_note are not JSON (")
                    assert "utf-8" in reply.text
                else:
                    assert "'utf-8' codec can't decode" in assert_422(reply, "json_invalid"), route
        assert rollout.call("list_notes").text == "(no notes)"     # nothing was written
        rollout.close()


DEEP = b"[" * 100_000


def test_deeply_nested_json_is_refused_not_500(server):
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        answers = {route: request(server.url + route, body=DEEP, cookie=rollout.cookie)
                   for route in JSON_BODY_ROUTES + ["/mcp", "/write_note"]}
        rollout.close()
        wrong = {route: reply.status for route, reply in answers.items()
                 if not (400 <= reply.status < 500 or route == "/mcp" and reply.status == 200)}
        assert not wrong, f"answered 5xx (or worse) to JSON nested 100000 deep: {wrong}"
        assert answers["/mcp"].json()["error"]["code"] in (-32700, -32600)


def test_deeply_nested_json_frames_are_answered(server):
    def answer(path: str) -> Any:
        with Socket(server.ws_url + path) as sock:
            sock.send(DEEP.decode())
            try:
                return sock.recv(timeout=10)
            except ConnectionClosed as exc:
                return f"closed {exc.rcvd.code if exc.rcvd else 'without a close frame'}"

    with survivor(server):
        on_ws, on_mcp = answer("/ws"), answer("/mcp")
        assert isinstance(on_ws, dict) and on_ws["type"] == "error" and \
            on_ws["data"]["code"] in ("INVALID_JSON", "VALIDATION_ERROR"), on_ws
        assert isinstance(on_mcp, dict) and on_mcp["error"]["code"] in (-32700, -32600), on_mcp


# ================================================================ 2. wrong types and missing fields

def test_seed_wrong_types(server):
    needs = ("the row needs split (text) and index (a whole number) naming the task to play; "
             "write the rows with python agentenv.py write-gym")
    with survivor(server):
        for fields in ({"index": "1"}, {"index": True}, {"index": 1.0}, {"index": None},
                       {"split": 0}, {"split": ["all"]}, {"split": None}, {"index": [1]}):
            row = {**gym_row(SAVE), **fields}
            row.pop("task_id")
            reply = request(server.url + "/seed_session", body=row)
            assert (reply.status, reply.json()) == (422, {"detail": needs}), fields
            assert "Set-Cookie" not in reply.headers            # no session was made
        # the newer environment servers' form: the row under task_data, checked the same way
        reply = request(server.url + "/seed_session",
                        body={"task_data": {"split": "all", "index": "0"}, "resources_session_id": "r"})
        assert (reply.status, reply.json()) == (422, {"detail": needs})


def test_verify_wrong_types(server):
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        for params in ([], "input", None, 5):
            body = {**rollout.row, "responses_create_params": params,
                    "response": responses("hi")}
            reply = rollout.post("/verify", body)
            assert reply.status == 422
            assert reply.json() == {"detail": "verify takes the row with responses_create_params "
                                              "and the model's response"}
        # none of those ended the rollout: it still plays and scores
        rollout.call("write_note", title="groceries", text="eggs, milk")
        assert rollout.verify().json()["reward"] == 1.0


def test_verify_a_malformed_responses(server):
    """A Responses object Gym would never send: refused (422 naming the response) or read as no
    final message; never a 500."""
    with survivor(server):
        for response in ({"output": 5}, {"output": [{"type": "message", "content": 5}]},
                         {"output": [{"type": "message",
                                      "content": [{"type": "output_text", "text": 5}]}]}):
            rollout = gym_rollout(server, SAVE)
            rollout.seed()
            reply = rollout.verify(response=response)
            rollout.close()
            assert reply.status in (200, 422), (response, reply.status, reply.text)
            if reply.status == 422:
                assert "response" in json.dumps(reply.json()["detail"])
            else:
                assert "reward" in reply.json()


def test_close_session_and_aggregate_wrong_types(server):
    with survivor(server):
        for rid in (5, None, ["r"], {"a": 1}):
            reply = request(server.url + "/close_session", body={"resources_session_id": rid})
            assert reply.status == 200 and reply.json()["status"] == "already_closed"
        # an empty body is allowed on close_session (Gym sends none)
        assert request(server.url + "/close_session", body=b"").json() == {"status": "already_closed"}
        # what Gym's own server refuses (422), and a reward that isn't a number, not measured
        for results in ("ab", {"a": 1}, [1, "x", None], None):
            reply = request(server.url + "/aggregate_metrics", body={"verify_responses": results})
            assert reply.status == 422, (results, reply.text)
            assert "verify_responses" in json.dumps(reply.json()["detail"])
        reply = request(server.url + "/aggregate_metrics", body={"verify_responses": [{"reward": "high"}]})
        assert reply.status == 200 and "mean/reward" not in reply.json()["agent_metrics"]


def test_aggregate_metrics_with_a_number_of_results(server):
    with survivor(server):
        reply = request(server.url + "/aggregate_metrics", body={"verify_responses": 5})
        assert reply.status in (200, 422), (reply.status, reply.text)


def reset_refused(reply: Reply, *words: str) -> str:
    """/reset refuses a reset either as a 4xx with a detail or, as the server does, as an error
    observation (200, done, metadata.status "error"); the message, which must hold ``words``."""
    if 400 <= reply.status < 500:
        message = json.dumps(reply.json()["detail"])
    else:
        assert reply.status == 200, (reply.status, reply.text)
        body = reply.json()
        assert body["done"] is True and body["reward"] is None, body
        assert body["observation"]["metadata"]["status"] == "error", body
        message = body["observation"]["metadata"]["error"]
    for word in words:
        assert word in message, (word, message)
    return message


def test_reset_wrong_types(server):
    with survivor(server):
        before = set(server.records())
        for data, words in (({"split": "all", "index": "0"}, ("index '0' is not a whole number",
                                                               "from 0 to 2")),
                            ({"split": "all", "index": True}, ("index True is not a whole number",
                                                               "from 0 to 2")),
                            ({"split": "all", "index": 1.5}, ("index 1.5 is not a whole number",
                                                              "from 0 to 2")),
                            ({"split": "all", "index": [0]}, ("from 0 to 2",)),
                            ({"split": 7, "index": 0}, ("no split 7", "all, smoke")),
                            ({"split": "all"}, ("split and index go together",)),
                            ({"index": 0}, ("split and index go together",))):
            reset_refused(request(server.url + "/reset", body=data), *words)
        assert set(server.records()) <= before, "a refused reset deployed an env"


def refuse_reset_everywhere(server: Server, splits: list[Any]) -> None:
    """A reset naming each split (with index 0) is refused, naming the splits, over HTTP and /ws."""
    for split in splits:
        data = {"split": split, "index": 0}
        reset_refused(request(server.url + "/reset", body=data), "all, smoke")
        with Socket(server.ws_url + "/ws") as sock:
            frame = sock.ask({"type": "reset", "data": data})
            assert frame["type"] == "observation", (split, frame)
            meta = frame["data"]["observation"]["metadata"]
            assert meta.get("status") == "error" and "all, smoke" in meta["error"], (split, meta)


def test_reset_a_split_that_is_empty_or_false(server):
    """A split that isn't a split's name is refused, naming the splits; it never plays 'all'."""
    with survivor(server):
        refuse_reset_everywhere(server, ["", 0, False, [], {}])


def test_reset_a_split_that_is_an_array_or_object(server):
    with survivor(server):
        refuse_reset_everywhere(server, [["all"], {"name": "all"}])


def test_step_action_not_an_object(server):
    with survivor(server):
        for action in ("list_tools", [], 5, None):
            reply = request(server.url + "/step", body={"action": action})
            assert reply.status == 422
            detail = reply.json()["detail"][0]
            assert detail["loc"] == ["body", "action"]
            assert (detail["type"], detail["msg"]) == ("dict_type", "Input should be a valid dictionary")


def test_task_api_wrong_types_and_missing_fields(server):
    url = f"{server.url}/{ENV}"
    with survivor(server):
        for route in ("tasks", "num_tasks", "task", "task_range"):       # as FastAPI: 422
            for data in ({}, {"split": None}, {"split": 3}, {"index": 0}):
                reply = request(f"{url}/{route}", body=data)
                assert reply.status == 422, (route, data, reply.text)
                assert ["body", "split"] in [d["loc"] for d in reply.json()["detail"]]
            reply = request(f"{url}/{route}", body={"split": "nope", "index": 0})
            if route != "task":                                       # a field they don't take
                assert reply.status == 422 and reply.json()["detail"][0]["type"] == "extra_forbidden"
            else:                                                     # no such split: 400
                assert reply.status == 400 and "the splits are all, smoke" in reply.json()["detail"]
        for data in ({"split": "all"}, {"split": "all", "index": "1"}, {"split": "all", "index": None},
                     {"split": "all", "index": True}, {"split": "all", "index": 1.5}):
            reply = request(f"{url}/task", body=data)
            assert reply.status == 422, (data, reply.text)
            assert reply.json()["detail"][0]["loc"] == ["body", "index"]
        reply = request(f"{url}/task", body={"split": "all", "index": 1.0})   # pydantic's 1
        assert reply.status == 200 and reply.json()["task"]["index"] == 1
        reply = request(f"{url}/task", body={"split": "all", "index": 3})
        assert reply.status == 400 and "give an index from 0 to 2" in reply.json()["detail"]
        for data in ({"split": "all", "start": "a"}, {"split": "all", "stop": "2"},
                     {"split": "all", "start": 1.5}, {"split": "all", "start": [0]}):
            reply = request(f"{url}/task_range", body=data)
            assert reply.status == 422, (data, reply.text)
        reply = request(f"{url}/task_range", body={"split": "all", "start": -1})
        assert reply.json() == {"detail": "Invalid task index: start is a whole number from 0"}
        # another environment's name: 404, naming ours
        reply = request(f"{server.url}/notes-v9/task", body={"split": "all", "index": 0})
        assert reply.status == 404 and "this server serves 'notes-v1'" in reply.json()["detail"]


def test_task_api_a_split_that_is_an_array(server):
    with survivor(server):
        for route in TASK_API:
            reply = request(server.url + route, body={"split": ["all"], "index": 0})
            assert reply.status == 422, (route, reply.status, reply.text)
            assert {"type": "string_type", "loc": ["body", "split"], "input": ["all"],
                    "msg": "Input should be a valid string"} in reply.json()["detail"]


def test_mcp_post_bad_requests(server):
    def invalid(problems: str) -> str:
        return (f"Invalid Request: {problems}; send {{\"jsonrpc\": \"2.0\", \"method\": ..., "
                "\"params\": {...}, \"id\": ...}")
    cases = [       # a request that is not one answers id null, as OpenEnv does (JSON-RPC too)
        ({"jsonrpc": "2.0", "id": 1}, -32600, invalid("method: Field required")),
        ({"jsonrpc": "2.0", "id": 2, "method": 5}, -32600,
         invalid("method: Input should be a valid string")),
        ({"jsonrpc": "1.0", "id": 3, "method": "tools/list"}, -32600,
         invalid("jsonrpc: Input should be '2.0'")),
        ({"id": 4, "method": "tools/list"}, -32600, invalid("jsonrpc: Field required")),
        ({"jsonrpc": "2.0", "id": 5, "method": "tools/list", "params": "x"}, -32600,
         invalid("params: Input should be a valid dictionary")),
        ({"jsonrpc": "2.0", "id": 6, "method": "tools/call", "params": {}}, -32602,
         "tools/call needs params.name, the tool to call"),
        ({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": 5}}, -32603,
         "there is no tool 5: a tool's name is a string"),
        ({"jsonrpc": "2.0", "id": 8, "method": "tools/call",
          "params": {"name": "list_notes", "session_id": "forged"}}, -32602,
         "no session 'forged'; create one with openenv/session/create"),
        ({"jsonrpc": "2.0", "id": 9, "method": "tools/list", "params": {"session_id": ["x"]}},
         -32602, "no session ['x']; create one with openenv/session/create"),
        ({"jsonrpc": "2.0", "id": 10, "method": "openenv/session/close",
          "params": {"session_id": {"a": 1}}}, -32602, "no session {'a': 1}"),
    ]
    with survivor(server):
        for message, code, text in cases:
            reply = request(server.url + "/mcp", body=message)
            assert reply.status == 200
            body = reply.json()
            rid = None if code == -32600 else message.get("id")
            assert body["jsonrpc"] == "2.0" and body["id"] == rid, body
            assert (body["error"]["code"], body["error"]["message"]) == (code, text), body


# ================================================================ 3. unknown tools, forged cookies

def test_unknown_tools(server):
    with survivor(server), Socket(server.ws_url + "/ws") as sock:
        sock.ask({"type": "reset", "data": {"split": "all", "index": RECALL}})
        for name in ("nope", "dump_notes", "../read_note", ""):
            frame = sock.ask({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                                      "params": {"name": name}}})
            error = frame["data"]["error"]
            if name == "":
                assert error["code"] == -32602, error
                continue
            assert error["code"] == -32603, error
            assert error["message"] == f"there is no tool {name!r}; the tools are: write_note, " \
                                       "read_note, list_notes"
            assert error["data"]["error_type"] == "tool_not_found"
        assert tool_data(sock.ask(step_call("read_note", title="pancakes"))) == \
            "2 eggs, 1 cup milk, 1 cup flour"                                # the episode goes on
        # a Gym tool named after one of the server's GET routes is still a tool call: text
        rollout = gym_rollout(server, RECALL)
        rollout.seed()
        for name in ("health", "metadata", "state", "ws", "schema", "list_environments", "%FF"):
            reply = rollout.post(f"/{name}", {})
            assert reply.status == 200, (name, reply.text)
            assert reply.text.startswith("error: there is no tool "), reply.text
            assert reply.text.endswith("; the tools are: write_note, read_note, list_notes")
        rollout.close()


def forged_cookies(real: str) -> list[Any]:
    return [real[:-1] + ("A" if real[-1] != "A" else "B"),     # one character off
            real + "x", real[:8], "x" * 4000, "..%2F..%2Fetc", "a b;c=d",
            b"\xff\xfe\xe2\x82\xac"]                          # not even text


def test_forged_cookies(server):
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        for cookie in forged_cookies(rollout.cookie):
            reply = request(server.url + "/write_note", body={"title": "x", "text": "y"}, cookie=cookie)
            assert reply.status == 400, (cookie, reply.text)
            assert reply.text == ("error: no session: POST /seed_session with the row first, then "
                                  "call write_note with its cookie")
        # two cookies of that name, the real one second: never someone else's session
        reply = request(server.url + "/list_notes", body={},
                        headers={"Cookie": f"{COOKIE}=forged; {COOKIE}={rollout.cookie}"})
        assert reply.status in (200, 400)
        assert rollout.call("list_notes").text == "(no notes)"        # the real one wrote nothing
        # on verify, a cookie the server doesn't hold is a rollout it lost: masked, session_lost
        rollout.call("write_note", title="groceries", text="eggs and milk")
        for cookie in forged_cookies(rollout.cookie):
            body = {**rollout.row, "response": responses("Saved.")}
            reply = request(server.url + "/verify", body=body, cookie=cookie)
            assert reply.status == 200, reply.text
            got = reply.json()
            assert (got["reward"], got["mask_sample"], got["failure_kind"]) == (0.0, True,
                                                                                "session_lost")
            assert got["instance_config"]["mask_sample"] is True
        # the real rollout was untouched by those: it scores
        assert rollout.verify().json()["reward"] == 1.0


# ================================================================ 4. out of range, task_id

def test_out_of_range(server):
    with survivor(server):
        for data, words in (({"split": "all", "index": 3}, ("has 3 tasks", "from 0 to 2")),
                            ({"split": "all", "index": -1}, ("no task -1", "from 0 to 2")),
                            ({"split": "smoke", "index": 1}, ("has 1 tasks", "from 0 to 0")),
                            ({"split": "all", "index": 10**30}, ("from 0 to 2",)),
                            ({"split": "train", "index": 0}, ("no split 'train'", "all, smoke"))):
            reset_refused(request(server.url + "/reset", body=data), *words)
        for start, stop in ((3, None), (5, 9), (2, 1), (10**30, None)):
            reply = request(f"{server.url}/{ENV}/task_range",
                            body={"split": "all", "start": start, "stop": stop})
            assert (reply.status, reply.json()) == (200, {"tasks": []}), (start, stop)


def test_out_of_range_task_range_negative_start(server):
    """Every row task_range lists is one /task gives at that index, or the request is refused."""
    with survivor(server):
        reply = request(f"{server.url}/{ENV}/task_range", body={"split": "all", "start": -1})
        if reply.status == 400:
            return
        assert reply.status == 200
        for row in reply.json()["tasks"]:
            one = request(f"{server.url}/{ENV}/task", body={"split": "all", "index": row["index"]})
            assert (one.status, one.json()) == (200, {"task": row}), row


def test_a_task_id_of_another_bundle_is_refused(server):
    here = BUNDLE.splits["all"][SAVE].id
    with survivor(server):
        for task_id in ("@local/elsewhere/notes-v2/save-groceries", "save-groceries",
                        here.replace("save-groceries", "two-step"), "", 17):
            for body in ({**gym_row(SAVE), "task_id": task_id},
                         {"task_data": {**gym_row(SAVE), "task_id": task_id}}):
                reply = request(server.url + "/seed_session", body=body)
                assert reply.status == 400, (task_id, reply.text)
                assert reply.json()["detail"] == (
                    f"the row's task_id {task_id!r} is not the task at all[1], which is {here!r}; "
                    "write the rows again with write-gym")


# ================================================================ 5. huge bodies and frames

def test_a_17_mib_body_is_413(server):
    big = b'{"title": "' + b"a" * (17 * 2**20) + b'"}'
    under = b'{"x": "' + b"a" * (MAX_BODY - 100) + b'"}'
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        for route in JSON_BODY_ROUTES + ["/mcp", "/write_note", "/ng-rollout/r1/seed_session"]:
            reply = request(server.url + route, body=big, cookie=rollout.cookie)
            assert reply.status == 413, (route, reply.status, reply.text[:300])
            assert reply.json() == {"detail": "the body is larger than this server reads (16 MiB); "
                                              "send less, such as a tool's arguments without the "
                                              "data it can read itself"}
            assert server.healthy()
        for route in ("/write_note", "/reset"):                  # sent chunked, with no length
            chunks = iter([big[i:i + 2**20] for i in range(0, len(big), 2**20)])
            reply = request(server.url + route, body=chunks, cookie=rollout.cookie)
            assert reply.status == 413, (route, reply.status, reply.text[:300])
        # just under the limit is read (and answered for what it says, not for its size)
        for route in ("/mcp", "/write_note"):
            assert request(server.url + route, body=under, cookie=rollout.cookie).status != 413
        assert rollout.call("list_notes").status == 200
        rollout.close()


def test_huge_frames_close_1009(server):
    """A frame past 16 MiB closes the socket with 1009 (message too big); a frame under it plays."""
    async def too_big(path: str) -> tuple[Any, Any]:
        async with aiohttp.ClientSession() as http_:
            sock = await http_.ws_connect(server.url + path)
            sending = asyncio.create_task(sock.send_str('{"type": "state", "x": "' +
                                                        "a" * (17 * 2**20) + '"}'))
            frame = await sock.receive(timeout=20)
            with contextlib.suppress(Exception):
                await sending
            await sock.close()
            return frame.type, frame.data

    with survivor(server):
        for path in ("/ws", "/mcp"):
            kind, code = asyncio.run(too_big(path))
            assert (kind, code) == (aiohttp.WSMsgType.CLOSE, aiohttp.WSCloseCode.MESSAGE_TOO_BIG)
        with Socket(server.ws_url + "/ws") as sock:
            under = sock.ask({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": "pad",
                                                      "params": {"pad": "a" * (MAX_BODY - 300)}}})
            assert under["type"] == "mcp" and under["data"]["error"]["code"] == -32601


# ================================================================ 6. non-UTF-8 in tool arguments

def test_non_utf8_bytes_in_tool_arguments(server):
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        for raw in (b'{"title": "groceries", "text": "eggs \xff milk"}', b'{"title": "\xc0\xaf"}'):
            reply = rollout.post("/write_note", raw)
            assert reply.status == 400
            assert reply.text.startswith("error: the arguments of write_note are not JSON (")
        # text the env is fine with: any Unicode, escaped or not
        text = "eggs (œufs 🥚) and milk \u0000 \u2028 \U0010ffff"
        saved = rollout.call("write_note", title="groceries", text=text)
        assert (saved.status, saved.text) == (200, "saved note 'groceries'")
        assert rollout.call("read_note", title="groceries").text == text
        assert rollout.verify().json()["reward"] == 1.0


def test_a_lone_surrogate_in_tool_arguments_over_gym(server):
    """JSON lets a model write "\\ud800" (a lone surrogate); the env keeps it and echoes it. The
    model must read an answer (the surrogate replaced or escaped), never a 500."""
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        try:
            saved = rollout.post("/write_note", b'{"title": "groceries", "text": "eggs \\ud800 milk"}')
            assert (saved.status, saved.text) == (200, "saved note 'groceries'")
            read = rollout.call("read_note", title="groceries")
            assert read.status == 200, read.text
            assert read.text.startswith("eggs ") and read.text.endswith(" milk")
            titled = rollout.post("/write_note", b'{"title": "x\\udc80", "text": "y"}')
            assert titled.status == 200, titled.text
            # the same surrogate as raw bytes: not UTF-8, yet json.loads takes it (surrogatepass)
            raw = rollout.post("/write_note", b'{"title": "z", "text": "\xed\xa0\x80"}')
            assert raw.status in (200, 400), raw.text
            assert rollout.call("list_notes").status == 200
        finally:
            rollout.close()


def test_a_lone_surrogate_in_tool_arguments_over_ws(server):
    with survivor(server), Socket(server.ws_url + "/ws") as sock:
        sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        sock.send('{"type": "step", "data": {"type": "call_tool", "tool_name": "write_note", '
                  '"arguments": {"title": "groceries", "text": "eggs \\ud800 milk"}}}')
        assert tool_data(sock.recv()) == "saved note 'groceries'"
        read = tool_data(sock.ask(step_call("read_note", title="groceries")))
        assert read.startswith("eggs ") and read.endswith(" milk")
        ended = sock.ask(step_call("end_turn", response="Saved."))
        assert (ended["data"]["done"], ended["data"]["reward"]) == (True, 1.0)


def test_invalid_utf8_text_frames_close_1007(server):
    with survivor(server):
        for path in ("/ws", "/mcp"):
            with Socket(server.ws_url + path) as sock:
                sock.ws.send(b'{"type": "state", "x": "\xff"}', text=True)
                assert sock.closed_with() == 1007, path        # invalid frame payload data


# ================================================================ 7. garbage WebSocket frames

def test_ws_bad_messages(server):
    """OpenEnv's codes: INVALID_JSON, VALIDATION_ERROR, UNKNOWN_TYPE; the session goes on."""
    with survivor(server), Socket(server.ws_url + "/ws") as sock:
        sock.ask({"type": "reset", "data": {"split": "all", "index": RECALL}})
        for text in ("[1, 2]", "[]", '"reset"', "null", "42", '[{"type": "state"}]'):
            frame = sock.ask(text)
            assert frame["data"]["code"] == "VALIDATION_ERROR", text
            assert frame["data"]["message"] == ('Invalid message: the value: Input should be a '
                                                'message object, such as {"type": "state"}')
            assert frame["data"]["errors"][0]["input"] == json.loads(text)
        for text in ("", "   ", "{", "reset", "{'type': 'state'}"):
            frame = sock.ask(text)
            assert frame["type"] == "error" and frame["data"]["code"] == "INVALID_JSON", text
            assert frame["data"]["message"].startswith("Invalid JSON: ")
        for message in ({}, {"type": None}, {"type": 5}, {"type": ["step"]}, {"type": "RESET"},
                        {"data": {"type": "list_tools"}}):
            frame = sock.ask(message)
            assert frame["type"] == "error" and frame["data"]["code"] == "UNKNOWN_TYPE", message
            assert frame["data"]["message"] == \
                f"Unknown message type: {message.get('type', '')}; send reset, step, state, mcp or close"
        frame = sock.ask({"type": "reset", "data": "all"})
        assert frame == {"type": "error", "data": {
            "message": "Invalid message: data: Input should be a valid dictionary",
            "code": "VALIDATION_ERROR", "errors": [{"type": "dict_type", "loc": ["data"],
                                                    "msg": "Input should be a valid dictionary",
                                                    "input": "all"}]}}
        for data in (None, [1], "list_tools", 3):                     # a step that is no action
            frame = sock.ask({"type": "step", "data": data})
            assert frame["data"]["code"] == "VALIDATION_ERROR"
            assert frame["data"]["errors"][0]["loc"] == ["data"]
        frame = sock.ask({"type": "step", "data": {"type": "list_tool"}})
        assert frame["data"]["message"] == \
            "Invalid message: type: Input should be 'list_tools' or 'call_tool'"
        assert sock.ask({"type": "state"})["data"]["done"] is False    # the episode is still there
        for data in (None, [1], "tools/list"):                         # mcp that is no object
            frame = sock.ask({"type": "mcp", "data": data})
            assert frame["type"] == "error" and frame["data"]["code"] == "VALIDATION_ERROR", frame
        frame = sock.ask({"type": "mcp", "data": {"method": "tools/list"}})   # no JSON-RPC
        assert frame["type"] == "mcp" and frame["data"]["error"]["code"] == -32600, frame
        # after all that, the episode reset before it plays on and scores
        assert tool_data(sock.ask(step_call("read_note", title="pancakes"))) == \
            "2 eggs, 1 cup milk, 1 cup flour"
        ended = sock.ask(step_call("end_turn", response="2"))
        assert (ended["data"]["done"], ended["data"]["reward"]) == (True, 1.0)


def test_mcp_ws_bad_messages(server):
    invalid = ("Parse error: a request is one JSON object, {\"jsonrpc\": \"2.0\", \"method\": ..., "
               "\"params\": {...}, \"id\": ...} (batches are not read)")
    with survivor(server), Socket(server.ws_url + "/mcp") as sock:
        for text in ("[]", "[1, 2]", "null", '"tools/list"', "7",
                     '[{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}]'):
            assert sock.ask(text) == {"jsonrpc": "2.0", "id": None,
                                      "error": {"code": -32700, "message": invalid, "data": None}}, text
        for text in ("", "{", "tools/list"):
            assert sock.ask(text)["error"]["code"] == -32700, text
        for message, code in (({"jsonrpc": "2.0", "id": 1, "method": "reset"}, -32601),
                              ({"jsonrpc": "2.0", "id": 2, "method": "step"}, -32601),
                              ({"jsonrpc": "2.0", "id": 3, "method": None}, -32600),
                              ({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                                "params": []}, -32600),
                              ({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                                "params": {"name": ""}}, -32602),
                              ({"type": "reset"}, -32600)):      # a /ws message on /mcp
            reply = sock.ask(message)
            rid = None if code == -32600 else message.get("id")
            assert reply["error"]["code"] == code and reply["id"] == rid, reply
        listed = sock.ask({"jsonrpc": "2.0", "id": 9, "method": "tools/list"}, timeout=60)
        assert listed["id"] == 9 and listed["result"]["tools"][-1]["name"] == "end_turn"   # answering


def binary_frame_answer(server: Server, path: str) -> Any:
    """What a binary frame on ``path`` is answered with within 1.5 s: a frame, a close code, or
    None (a reply to {"type": "state"} takes milliseconds)."""
    with Socket(server.ws_url + path) as sock:
        sock.send(json.dumps({"type": "state"}).encode())              # JSON, but binary
        try:
            return sock.recv(timeout=1.5)
        except ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd is not None else "dropped"
        except TimeoutError:
            return None


def test_binary_frames_are_answered(server):
    """One frame in, one frame out: a binary frame gets an error frame (or a 1003 close), never
    silence, which the client can only sit out until its timeout."""
    with survivor(server):
        on_ws, on_mcp = binary_frame_answer(server, "/ws"), binary_frame_answer(server, "/mcp")
        assert on_ws == 1003 or isinstance(on_ws, dict) and on_ws["type"] == "error" and \
            on_ws["data"]["code"] in ("INVALID_JSON", "VALIDATION_ERROR"), on_ws
        assert on_mcp == 1003 or isinstance(on_mcp, dict) and \
            on_mcp["error"]["code"] in (-32700, -32600), on_mcp


# ================================================================ 8. oversized tool output

def test_oversized_tool_output_is_cut_and_says_so(server):
    """notes-v1 keeps any note; one of 150,000 characters read back reaches the model cut to the
    first 100,000, with a line that says so, over Gym, /ws and JSON-RPC. The verifier still reads
    the whole note (straight from the env), so the rollout scores."""
    text = ("eggs and milk " * 11_000)[:150_000]
    cut = re.compile(r"\n\[output cut: the tool answered 150000 characters; agentenv.py passes on "
                     r"the first 100000\]$")

    def check(answer: str) -> None:
        assert answer.startswith(text[:TOOL_CAP]), answer[:100]
        assert cut.search(answer[TOOL_CAP:]), answer[TOOL_CAP:]
        assert len(answer) < TOOL_CAP + 200

    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        assert rollout.call("write_note", title="groceries", text=text).text == "saved note 'groceries'"
        read = rollout.call("read_note", title="groceries")
        assert read.status == 200
        check(read.text)
        assert rollout.verify().json()["reward"] == 1.0
        with Socket(server.ws_url + "/ws") as sock:
            sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
            sock.ask(step_call("write_note", title="groceries", text=text))
            frame = sock.ask(step_call("read_note", title="groceries"))
            check(tool_data(frame))
            result = frame["data"]["observation"]["result"]
            assert result["is_error"] is False and result["content"][0]["text"] == tool_data(frame)
            rpc = sock.ask({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                                    "params": {"name": "read_note",
                                                               "arguments": {"title": "groceries"}}}})
            check(rpc["data"]["result"]["data"])
            ended = sock.ask(step_call("end_turn", response="Saved."))
            assert (ended["data"]["done"], ended["data"]["reward"]) == (True, 1.0)


# ================================================================ 9. hostile names in bundles

@pytest.fixture
def bundle_copy(tmp_path) -> Path:
    return copy_bundle(tmp_path / "bundles" / "hostile-v1")


def load_or_refusal(root: Path) -> agentenv.Bundle | str:
    try:
        return agentenv.Bundle.load(root)
    except agentenv.BundleError as exc:
        return str(exc)


@pytest.mark.parametrize("entry, task", [("{outside}/loose", None), ("../loose", None),
                                         ("../tasks/save-groceries", "save-groceries"),
                                         ("./save-groceries", "save-groceries"),
                                         ("../evals/../tasks/two-step", "two-step")])
def test_eval_entries_that_leave_tasks_are_refused(bundle_copy, entry, task):
    """An eval entry is a task's name: one that leads out of tasks/ is refused; one that is a
    roundabout path to a task of the bundle is refused or read as that task; never dropped."""
    (bundle_copy.parent / "loose.json").write_text("[]")           # .json files out of tasks/
    (bundle_copy / "loose.json").write_text("[]")
    entry = entry.format(outside=bundle_copy.parent)
    (bundle_copy / "evals" / "smoke.toml").write_text(f"tasks = [{json.dumps(entry)}]\n")
    loaded = load_or_refusal(bundle_copy)
    if isinstance(loaded, str):
        assert f"evals/smoke.toml: lists {entry!r}, which is not a task of the bundle" in loaded
    else:
        assert task is not None, f"loaded {entry!r}, the split smoke: {loaded.splits['smoke']}"
        assert [t.name for t in loaded.splits["smoke"]] == [task], "the entry was dropped"


@pytest.mark.parametrize("kind", ["env_id", "file_artifact_id", "eval"])
@pytest.mark.parametrize("name", ["..", "../notebook", "/etc", "notebook/..", "~", "",
                                  # paths that reach a real file of the bundle: still no name
                                  "../tasks/save-groceries", "./save-groceries",
                                  "../evals/../tasks/two-step", "./notebook",
                                  "../artifacts/check_notes"])
def test_references_with_dot_dot_name_nothing(bundle_copy, kind, name):
    """A task's env_id or file_artifact_id, or an eval's entry, is a name, never a path."""
    if kind == "eval":
        (bundle_copy / "evals" / "smoke.toml").write_text(f"tasks = [{json.dumps(name)}]\n")
        expected = f"evals/smoke.toml: lists {name!r}, which is not a task of the bundle"
    else:
        steps = json.loads((bundle_copy / "tasks" / "save-groceries.json").read_text())
        target = steps[0] if kind == "env_id" else steps[3]
        target[kind] = name
        (bundle_copy / "tasks" / "save-groceries.json").write_text(json.dumps(steps))
        expected = f"{kind} {name!r} names no " + ("env of the bundle" if kind == "env_id"
                                                   else "verifier artifact")
    loaded = load_or_refusal(bundle_copy)
    assert isinstance(loaded, str) and expected in loaded, loaded


@pytest.mark.parametrize("where", ["../../../elsewhere/Dockerfile", "{abs}"])
def test_a_dockerfile_outside_the_env_folder_is_refused(bundle_copy, where):
    elsewhere = bundle_copy.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "Dockerfile").write_text('FROM python:3.11-slim\nCMD ["python", "-c", "print(1)"]\n')
    where = where.format(abs=elsewhere / "Dockerfile")
    (bundle_copy / "envs" / "notebook" / "env.toml").write_text(
        f"image = {{dockerfile = {json.dumps(where)}}}\n")
    loaded = load_or_refusal(bundle_copy)
    assert isinstance(loaded, str), f"loaded: the env runs {loaded.envs['notebook'].command}"
    assert "envs/notebook/env.toml" in loaded


def test_an_environment_name_with_a_path_is_refused_or_contained(bundle_copy):
    (bundle_copy / "envs" / "notebook" / "env.toml").write_text(
        'environment_name = "../../escape"\n')
    loaded = load_or_refusal(bundle_copy)
    if isinstance(loaded, str):
        assert "environment_name" in loaded
        return
    env = dataclasses.replace(loaded.envs["notebook"], command=(
        sys.executable, "-c", "import os; print(os.environ['DATABASE_URL'], flush=True)"))

    async def launch() -> tuple[str, Path]:
        sandbox = agentenv.LocalSandbox(agentenv.owner_id())
        instance = await sandbox.launch(env, "probe", {})
        await instance.exited(settle=10)
        out, scratch = await instance.output(), instance.scratch
        await instance.remove()
        return out, scratch

    out, scratch = asyncio.run(launch())
    database = Path(out.strip().removeprefix("sqlite:///"))
    assert database.resolve().is_relative_to(scratch.resolve()), (database, scratch)


def test_odd_characters_in_file_names_load_and_play(tmp_path):
    """Spaces, quotes, $( ), ;, a leading dash and non-ASCII in the bundle's, an env's, an
    artifact's, a task's and an eval's names: the bundle loads, the task plays and scores, and
    write-gym keeps every file in its folder."""
    root = copy_bundle(tmp_path / "bundles" / "odd ü;$(x)'-v1")
    env, artifact, task_name, eval_name = "-note book ü", "check 'notes' $(x)", "sa ve;ü'\"$(x)", "smo ke ü"
    (root / "envs" / "notebook").rename(root / "envs" / env)
    (root / "artifacts" / "check_notes").rename(root / "artifacts" / artifact)
    for path in (root / "tasks").glob("*.json"):
        steps = json.loads(path.read_text())
        for step in steps:
            for key in ("env_id",):
                if step.get(key) == "notebook":
                    step[key] = env
            if step.get("env_ids") == ["notebook"]:
                step["env_ids"] = [env]
            if step.get("file_artifact_id") == "check_notes":
                step["file_artifact_id"] = artifact
        path.write_text(json.dumps(steps))
    (root / "tasks" / "save-groceries.json").rename(root / "tasks" / f"{task_name}.json")
    (root / "evals" / "smoke.toml").rename(root / "evals" / f"{eval_name}.toml")
    (root / "evals" / f"{eval_name}.toml").write_text(f"tasks = [{json.dumps(task_name)}]\n")
    bundle = agentenv.Bundle.load(root)
    assert [t.name for t in bundle.splits[eval_name]] == [task_name]
    assert bundle.splits[eval_name][0].id.endswith("/" + task_name)

    async def play() -> agentenv.Outcome:
        async with asyncio.timeout(60):
            async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="local")) as runtime:
                episode = runtime.episode(bundle.splits[eval_name][0])
                turn = await episode.next_turn()
                assert not (await turn.call("write_note", {"title": "groceries",
                                                           "text": "eggs, milk"})).is_error
                turn.end("Saved.")
                assert await episode.next_turn() is None
                return await episode.result()

    outcome = asyncio.run(play())
    assert (outcome.status, outcome.reward) == ("scored", 1.0)
    gym_root = tmp_path / "gym root"
    target = asyncio.run(agentenv.write_gym(str(root), str(gym_root),
                                            agentenv.Settings.of(sandbox="local"), out=lambda _: None))
    assert target.parent == gym_root.resolve() / "resources_servers"
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", target.name), target.name
    written = {p.relative_to(gym_root).as_posix() for p in gym_root.rglob("*") if p.is_file()}
    assert all(w.startswith(f"resources_servers/{target.name}/") for w in written), written
    assert f"resources_servers/{target.name}/data/{eval_name}.jsonl" in written


# ================================================================ 10. write-gym's target

class HostileServer:
    """A server at a URL that answers write-gym with names built to escape: its environment
    '../../evil', and splits '../../../../escape' and an absolute path."""

    def __init__(self, env: str, splits: list[str]):
        self.env, self.splits = env, splits

    async def __aenter__(self) -> str:
        from aiohttp import web
        row = {"id": "@local/x/evil/t", "name": "t", "index": 0, "prompt": "Say hi.",
               "system_prompt": None, "agent": "writer", "toolset": "notebook"}

        async def environments(request):
            return web.json_response([self.env])

        async def splits(request):
            return web.json_response([{"name": s, "type": "validation"} for s in self.splits])

        async def tasks(request):
            return web.json_response({"tasks": [row], "env_name": self.env})

        async def ws(request):
            sock = web.WebSocketResponse()
            await sock.prepare(request)
            async for message in sock:
                kind = json.loads(message.data).get("type")
                if kind == "reset":
                    await sock.send_json({"type": "observation", "data": {
                        "observation": {"metadata": {"prompt": "Say hi."}}, "done": False}})
                elif kind == "step":
                    await sock.send_json({"type": "observation", "data": {"observation": {
                        "tools": [{"name": "write_note", "description": "",
                                   "input_schema": {"type": "object"}}]}, "done": False}})
                else:
                    break
            return sock

        app = web.Application()
        app.router.add_get("/list_environments", environments)
        app.router.add_get("/{env}/splits", splits)
        app.router.add_post("/{env}/tasks", tasks)
        app.router.add_get("/ws", ws)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: Any) -> None:
        await self.runner.cleanup()


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


def test_write_gym_a_hostile_environment_name_stays_in_resources_servers(tmp_path):
    async def go() -> Path:
        async with HostileServer("../../evil", ["all"]) as url:
            return await agentenv.write_gym(url, str(tmp_path / "gym"), out=lambda _: None)

    target = asyncio.run(go())
    gym = (tmp_path / "gym").resolve()
    assert target.parent == gym / "resources_servers" and target.name == "evil"
    assert all(p.is_relative_to(target) for p in files_under(tmp_path)), files_under(tmp_path)
    for odd in ("..", ".", "/", "-", "..."):                  # never an empty or dotted folder
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", agentenv.gym_name(odd)), odd


def test_write_gym_hostile_split_names_stay_in_the_servers_folder(tmp_path):
    outside = tmp_path / "abs-split"

    async def go() -> Path | str:
        async with HostileServer("evil", ["all", "../../../../escape", str(outside)]) as url:
            try:
                return await agentenv.write_gym(url, str(tmp_path / "sub" / "gym"),
                                                out=lambda _: None)
            except agentenv.AgentEnvError as exc:      # refusing such a split is right too
                return str(exc)

    result = asyncio.run(go())
    if isinstance(result, Path):
        stray = [p for p in files_under(tmp_path) if not p.is_relative_to(result)]
        assert not stray, f"write-gym wrote outside {result}: {stray}"
    else:
        assert not files_under(tmp_path), "refused, yet wrote files"


# ================================================================ 11. property-based fuzzing

# Values a caller might plausibly send, so that generated requests get past the first checks.
MEANINGFUL = ["all", "smoke", "train", "", 0, 1, 2, 3, -1, True, None, {}, [], "list_tools",
              "call_tool", "write_note", "read_note", "list_notes", "dump_notes", "end_turn", "2.0",
              "tools/list", "tools/call", "openenv/session/create", "openenv/session/close",
              "reset", "step", "state", "mcp", "close", "groceries", "pancakes", "message",
              "output_text", "\ud800", 1e308, float("nan")]
KEYS = ["split", "index", "task_id", "type", "data", "tool_name", "arguments", "response",
        "responses_create_params", "jsonrpc", "method", "params", "id", "name", "session_id",
        "start", "stop", "action", "episode_id", "seed", "resources_session_id", "task_data",
        "verify_responses", "reward", "mask_sample", "title", "text", "output", "content", "tools",
        "input", "instance_config"]
keys = st.sampled_from(KEYS) | st.text(max_size=6)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=16)
    | st.sampled_from(MEANINGFUL),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=16)
objects = st.dictionaries(keys, json_values, max_size=7)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()       # NaN and Infinity too, as Python's json writes them


def _spliced(parts: tuple[bytes, int, bytes]) -> bytes:
    text, at, junk = parts
    at %= len(text) + 1
    return text[:at] + junk + text[at:]


bodies = st.one_of(
    objects.map(_dumps), objects.map(_dumps), json_values.map(_dumps),
    st.binary(max_size=64),
    st.tuples(objects.map(_dumps), st.integers(0, 2**16), st.binary(min_size=1, max_size=3)).map(_spliced),
    st.text(max_size=32).map(str.encode))


RELEASING = ThreadPoolExecutor(4)     # closes run beside the fuzzing (a teardown takes ~0.5 s)


def release(server: Server, reply: Any, cookie_header: str | None = None) -> None:
    """Close what a fuzzed request opened, so the fuzzers never fill the server: a Gym session
    (its Set-Cookie) and any MCP session a JSON-RPC result names."""
    if cookie_header and COOKIE in cookie_header:
        token = http.cookies.SimpleCookie(cookie_header)[COOKIE].value
        RELEASING.submit(request, server.url + "/close_session", body={}, cookie=token,
                         headers=server.headers)
    found: list[str] = []

    def walk(value: Any, in_result: bool = False) -> None:
        if isinstance(value, dict):
            if in_result and isinstance(value.get("session_id"), str):
                found.append(value["session_id"])
            for key, item in value.items():
                walk(item, in_result or key == "result")
        elif isinstance(value, list):
            for item in value:
                walk(item, in_result)
    walk(reply)
    for sid in found:
        request(server.url + "/mcp", body={"jsonrpc": "2.0", "id": 0, "method": "openenv/session/close",
                                           "params": {"session_id": sid}}, headers=server.headers)


# The survivor's WebSocket client draws ping payloads from `random` in its own thread, which
# Hypothesis takes for a strategy using `random`.
QUIET_RANDOM = pytest.mark.filterwarnings("ignore:Do not use the `random` module")
def drain() -> None:
    """Wait for the closes still running (the survivor then checks the server logged no error)."""
    global RELEASING
    RELEASING.shutdown(wait=True)
    RELEASING = ThreadPoolExecutor(4)


FUZZ = settings(max_examples=100, deadline=10_000, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TOOL_ROUTES = ["write_note", "read_note", "list_notes", "end_turn", "dump_notes", "nope"]
GYM_FUZZ_ROUTES = ["/seed_session", "/verify", "/close_session", "/aggregate_metrics",
                   *[f"/{t}" for t in TOOL_ROUTES], "/ng-rollout/r1/seed_session",
                   "/ng-rollout/r1/verify", "/ng-rollout/r1/write_note"]
OPENENV_FUZZ_ROUTES = ["/reset", "/step", "/mcp", *TASK_API, "/notes-v2/task"]


def check_http(server: Server, route: str, reply: Reply, body: bytes) -> None:
    assert server.proc.poll() is None, f"the server died:\n{server.log()[-3000:]}"
    assert reply.status < 500, f"{route} answered {reply.status} to {body[:300]!r}:\n" \
                               f"{server.log()[-2000:]}"
    assert 200 <= reply.status
    if reply.status >= 400:
        assert reply.body.strip(), f"{route} answered {reply.status} with no message"
    if reply.headers.get_content_type() == "application/json":
        reply.json()


@QUIET_RANDOM
def test_fuzz_gym_routes(server):
    """Any body, any cookie (none, garbage, or a live rollout's) on every Gym route: never a 5xx, never a dropped connection, the server alive, and the survivor scores."""
    victim = gym_rollout(server, SAVE)

    @FUZZ
    @given(route=st.sampled_from(GYM_FUZZ_ROUTES), body=bodies,
           cookie=st.none() | st.just("victim") | st.text(
               alphabet="abcdefghijklmnopqrstuvwxyzABC0123456789-_", max_size=32))
    def fuzz(route: str, body: bytes, cookie: str | None) -> None:
        sent = victim.cookie if cookie == "victim" else cookie
        reply = request(server.url + route, body=body, cookie=sent)
        release(server, None, reply.headers.get("Set-Cookie"))
        check_http(server, route, reply, body)

    with survivor(server):
        victim.seed()
        fuzz()
        victim.close()
        drain()


@QUIET_RANDOM
def test_fuzz_openenv_routes(server):
    @settings(FUZZ, max_examples=80)
    @given(route=st.sampled_from(OPENENV_FUZZ_ROUTES), body=bodies)
    def fuzz(route: str, body: bytes) -> None:
        reply = request(server.url + route, body=body)
        if reply.status < 500 and reply.headers.get_content_type() == "application/json":
            release(server, reply.json())
        check_http(server, route, reply, body)
        if route == "/mcp":
            assert reply.status == 200 and reply.json()["jsonrpc"] == "2.0"

    with survivor(server):
        fuzz()
        drain()


frames = st.one_of(
    objects.map(lambda o: json.dumps(o)),
    st.fixed_dictionaries({"type": st.sampled_from(["reset", "step", "state", "mcp", "close", "x"])},
                          optional={"data": json_values | objects}).map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=40),
    st.binary(max_size=40),                                   # sent as a binary frame
    st.binary(min_size=1, max_size=40).map(lambda b: ("text", b)))   # bytes in a text frame

WS_CLOSES = {1000, 1001, 1003, 1007, 1009}        # the closes a client can act on


def closes(path: str, frame: Any) -> bool:
    """Whether the server ends the socket on this frame (so sending on would race its close):
    a text frame that isn't UTF-8 (1007), and {"type": "close"} on /ws (with any other field it is
    refused, VALIDATION_ERROR, and the socket stays open, as OpenEnv's own server answers it)."""
    if isinstance(frame, tuple):
        try:
            frame[1].decode("utf-8")
        except UnicodeDecodeError:
            return True
        frame = frame[1].decode("utf-8")
    if path != "/ws" or not isinstance(frame, str):
        return False
    with contextlib.suppress(ValueError, RecursionError):
        message = json.loads(frame)
        return isinstance(message, dict) and message == {"type": "close"}
    return False


def fuzz_socket(server: Server, path: str, sent: list[Any], sentinel: dict,
                is_sentinel_reply: Any, check_reply: Any) -> None:
    """Send the frames and then the sentinel; read until the sentinel's reply or a close."""
    with Socket(server.ws_url + path) as sock:
        closing = False
        try:
            for frame in sent:
                if isinstance(frame, tuple):
                    sock.ws.send(frame[1], text=True)
                else:
                    sock.send(frame)
                if closes(path, frame):
                    closing = True          # read the replies owed, then the close
                    break
            if not closing:
                sock.send(sentinel)
            while True:
                reply = json.loads(sock.ws.recv(timeout=15))
                release(server, reply)
                check_reply(reply)
                if not closing and is_sentinel_reply(reply):
                    break
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            assert code in WS_CLOSES, f"{path} dropped the connection (close {code}) after {sent!r}"
    assert server.proc.poll() is None, f"the server died:\n{server.log()[-3000:]}"


@QUIET_RANDOM
def test_fuzz_ws_frames(server):
    def check(reply: Any) -> None:
        assert isinstance(reply, dict) and reply.get("type") in ("observation", "state", "error",
                                                                "mcp"), reply

    @settings(FUZZ, max_examples=60)
    @given(sent=st.lists(frames, min_size=1, max_size=3))
    def fuzz(sent: list[Any]) -> None:
        fuzz_socket(server, "/ws", sent, {"type": "state"},
                    lambda r: r.get("type") == "state", check)

    mark = len(server.log())
    with survivor(server):
        fuzz()
        drain()
    assert not server_errors(server.log()[mark:]), server.log()[mark:][-3000:]


@QUIET_RANDOM
def test_fuzz_mcp_frames(server):
    def check(reply: Any) -> None:
        assert isinstance(reply, dict) and reply.get("jsonrpc") == "2.0", reply
        assert ("result" in reply) != ("error" in reply), reply
        if "error" in reply:
            assert reply["error"]["code"] in (-32700, -32600, -32601, -32602, -32603, -32000), reply

    @settings(FUZZ, max_examples=60)
    @given(sent=st.lists(frames, min_size=1, max_size=3))
    def fuzz(sent: list[Any]) -> None:
        fuzz_socket(server, "/mcp", sent, {"jsonrpc": "2.0", "id": "sentinel", "method": "tools/list"},
                    lambda r: r.get("id") == "sentinel", check)

    with survivor(server):
        fuzz()
        drain()


# ================================================================ 12. verify twice, a tool after verify
# Written to the spec of a change to agentenv.py made alongside (issue 6; it landed as ccb7799).

def test_verify_twice_with_the_same_body_replays_the_reply(server):
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        rollout.call("write_note", title="groceries", text="eggs and milk")
        first, again = rollout.verify("Saved."), rollout.verify("Saved.")
        assert (first.status, again.status) == (200, 200), again.text
        assert first.json()["reward"] == 1.0 and again.json() == first.json()


def test_verify_twice_with_another_response_is_409(server):
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        rollout.call("write_note", title="groceries", text="eggs and milk")
        assert rollout.verify("Saved.").json()["reward"] == 1.0
        other = rollout.verify("Something else entirely.")
        assert other.status == 409, other.text
        assert other.headers.get_content_type() == "application/json"
        assert "verified already" in other.json()["detail"]
        assert rollout.verify("Saved.").json()["reward"] == 1.0      # the first reply still replays


def test_a_tool_after_verify_is_409(server):
    with survivor(server):
        rollout = gym_rollout(server, SAVE)
        rollout.seed()
        rollout.call("write_note", title="groceries", text="eggs and milk")
        assert rollout.verify().status == 200
        for name, args in (("list_notes", {}), ("write_note", {"title": "a", "text": "b"}),
                           ("end_turn", {"response": "x"})):
            late = rollout.call(name, **args)
            assert late.status == 409, late.text
            assert late.text.startswith("error:") and "verified already" in late.text
            assert "seed a new session" in late.text


# ================================================================ 13. in flight: the bearer token
# With a token (serve --token, AGENTENV_TOKEN, Server(..., token=)), every route answers 401 with
# WWW-Authenticate: Bearer unless the request carries Authorization: Bearer <token>. Written to
# the spec of a change made alongside (it landed as ccb7799); they fail on an agentenv.py without it.

AUTH = {"Authorization": f"Bearer {TOKEN}"}
LOCKED_ROUTES = [("GET", "/health"), ("GET", "/metadata"), ("GET", "/schema"), ("GET", "/openapi.json"),
                 ("GET", "/state"), ("GET", "/list_environments"), ("GET", f"/{ENV}/splits"),
                 ("GET", "/"), ("POST", "/reset"), ("POST", "/step"), ("POST", "/mcp"),
                 *[("POST", r) for r in TASK_API], ("POST", "/seed_session"), ("POST", "/verify"),
                 ("POST", "/close_session"), ("POST", "/aggregate_metrics"), ("POST", "/list_notes"),
                 ("POST", "/ng-rollout/r1/seed_session"), ("GET", "/metrics"), ("GET", "/nowhere")]


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    with serving(NOTES, tmp_path_factory.mktemp("locked"), "--token", TOKEN, headers=AUTH) as served:
        yield served


def assert_401(reply: Reply, what: str) -> None:
    assert reply.status == 401, (what, reply.status, reply.text)
    assert reply.headers.get("WWW-Authenticate", "").startswith("Bearer"), (what, reply.headers)
    assert "Authorization" in reply.text and "Bearer" in reply.text, reply.text   # what to send


def test_token_every_http_route_is_401_without_it(locked):
    row = gym_row(SAVE)
    with survivor(locked):
        for method, route in LOCKED_ROUTES:
            body = row if method == "POST" else None
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN},
                            {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"bearer  {TOKEN}x"}):
                assert_401(request(locked.url + route, method, body=body, headers=headers),
                           f"{method} {route} {headers}")
        for method, route in LOCKED_ROUTES:           # with it, each answers as it would unlocked
            reply = request(locked.url + route, method, body=row if method == "POST" else None,
                            headers=AUTH)
            assert reply.status != 401, (method, route, reply.text)
            release(locked, None, reply.headers.get("Set-Cookie"))
        drain()
        assert request(locked.url + "/health", "GET", headers=AUTH).status == 200
        reply = request(locked.url + "/mcp", body={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                        headers=AUTH)
        assert [t["name"] for t in reply.json()["result"]["tools"]] == \
            ["write_note", "read_note", "list_notes", "end_turn"]


@pytest.mark.parametrize("path", ["/ws", "/mcp"])
def test_token_websockets_are_401_without_it(locked, path):
    with survivor(locked):
        for headers in ({}, {"Authorization": "Bearer nope"}):
            with pytest.raises(InvalidStatus) as refused:
                Socket(locked.ws_url + path, headers)
            assert refused.value.response.status_code == 401
            assert refused.value.response.headers.get("WWW-Authenticate", "").startswith("Bearer")
        with Socket(locked.ws_url + path, AUTH) as sock:
            if path == "/ws":
                assert sock.ask({"type": "state"})["type"] == "state"
            else:
                listed = sock.ask({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, timeout=60)
                assert listed["result"]["tools"][-1]["name"] == "end_turn"


def test_token_from_agentenv_token(tmp_path):
    with serving(NOTES, tmp_path, env={"AGENTENV_TOKEN": TOKEN}, headers=AUTH) as served:
        assert_401(request(served.url + "/health", "GET"), "/health")
        assert request(served.url + "/health", "GET", headers=AUTH).status == 200


def test_token_given_to_server_in_process(tmp_path):
    async def go() -> tuple[int, int]:
        from aiohttp import web
        runtime = agentenv.Runtime(BUNDLE, agentenv.Settings.of(sandbox="local"))
        app = agentenv.Server(runtime, token=TOKEN).app
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as http_:
                async with http_.get(f"http://127.0.0.1:{port}/health") as bare:
                    assert bare.headers.get("WWW-Authenticate", "").startswith("Bearer")
                async with http_.get(f"http://127.0.0.1:{port}/health", headers=AUTH) as authed:
                    return bare.status, authed.status
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == (401, 200)


# ================================================================ a browser on the operator's machine (issue 38)
#
# The operator opens /web in a browser on the machine serve runs on, and so any page that browser
# visits can send requests to 127.0.0.1. A browser marks what it sends (Origin, Sec-Fetch-Site, a
# Host of the page's own name); a client that is not a browser sends none of that, and JSON.

ELSEWHERE = "http://evil.example"            # any page the operator visits


def open_sessions(server: Server) -> dict[str, int]:
    return request(server.url + "/web/status", "GET", headers=server.headers).json()["sessions"]


@pytest.mark.parametrize("path", ["/ws", "/mcp"])
def test_a_web_page_cannot_open_a_socket(server, path):
    with survivor(server):
        before = open_sessions(server)
        for origin in (ELSEWHERE, "null", "http://127.0.0.1:1", f"http://127.0.0.1:{server.port}.evil.example",
                       f"http://localhost:{server.port}", "file://", "not a url"):
            with pytest.raises(InvalidStatus) as refused:
                Socket(server.ws_url + path, {"Origin": origin})
            assert refused.value.response.status_code == 403, origin
            assert "only its own page (/web) may" in refused.value.response.body.decode(), origin
        assert open_sessions(server) == before
        # the server's own page (its origin, default port or not), and a client with no Origin
        for headers in ({"Origin": server.url}, {"Origin": server.url.replace("http:", "https:")}, {}):
            with Socket(server.ws_url + path, headers) as sock:
                if path == "/ws":
                    assert sock.ask({"type": "state"})["type"] == "state"
                else:
                    listed = sock.ask({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
                    assert listed["result"]["tools"][-1]["name"] == "end_turn"


def test_a_web_page_cannot_post_a_body_that_is_not_json(server):
    """A page may POST text/plain, a form or multipart to any server without asking first: every
    route refuses a body that is not JSON, 415, saying what to send; JSON and no body still play."""
    row = json.dumps(gym_row(SAVE)).encode()
    with survivor(server):
        before = open_sessions(server)
        for route in [*JSON_BODY_ROUTES, "/mcp", "/write_note", "/ng-rollout/r1/seed_session"]:
            for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/jsonp", ""):
                reply = request(server.url + route, body=row, headers={"Content-Type": kind})
                assert reply.status == 415, (route, kind, reply.status, reply.text[:300])
                assert "Content-Type: application/json" in reply.json()["detail"], reply.text
        assert open_sessions(server) == before
        for kind in ("application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
                     "application/vnd.api+json"):
            reply = request(server.url + "/reset", body=b"{}", headers={"Content-Type": kind})
            assert reply.status == 200, (kind, reply.text[:300])
        assert request(server.url + "/reset", body=None).status == 200       # no body at all


def test_a_web_page_cannot_fetch_across_sites(server):
    """What a browser marks as sent from another site is refused 403, whatever its body; a person
    following a link to /web (a navigation) still gets the page."""
    with survivor(server):
        for site in ("cross-site", "same-site"):
            for method, route in (("GET", "/web/status"), ("GET", "/metrics"), ("POST", "/reset"),
                                  ("POST", "/seed_session")):
                reply = request(server.url + route, method, body=gym_row(SAVE) if method == "POST" else None,
                                headers={"Sec-Fetch-Site": site, "Sec-Fetch-Mode": "no-cors"})
                assert reply.status == 403, (site, route, reply.status, reply.text[:200])
                assert "comes from another site" in reply.json()["detail"]
        followed = request(server.url + "/web", "GET", headers={
            "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"})
        assert followed.status == 200 and followed.content_type == "text/html"
        for site in ("same-origin", "none"):
            own = request(server.url + "/web/status", "GET", headers={"Sec-Fetch-Site": site,
                                                                      "Origin": server.url})
            assert own.status == 200, own.text


def test_a_foreign_host_is_421_so_dns_rebinding_reads_nothing(server):
    """A page of a domain that resolves to 127.0.0.1 reaches the server under its own name: the
    server answers only to loopback's names, IP addresses and this machine's name."""
    import socket as socket_
    with survivor(server):
        for host in ("evil.example", f"evil.example:{server.port}", "localhost.evil.example", "",
                     "127.0.0.1.nip.io", "[::1", "a b"):
            for route in ("/web", "/web/status", "/health", "/metrics"):
                reply = request(server.url + route, "GET", headers={"Host": host})
                assert reply.status == 421, (host, route, reply.status)
                assert "--allow-host" in reply.json()["detail"]
                assert "bundle" not in reply.text and "notes" not in reply.text
        for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "LOCALHOST.", "127.0.0.2",
                     "[::1]:1", "web.localhost", socket_.gethostname()):
            reply = request(server.url + "/web/status", "GET", headers={"Host": host})
            assert reply.status == 200, (host, reply.text[:200])


def test_a_session_table_flooded_cross_site_leaves_the_trainer_its_slots(tmp_path):
    """At 23ac7e2 eight blind cross-site POSTs filled a server of 8 sessions, and the trainer's
    own /ws was then refused for the idle timeout. A page's POSTs and sockets open nothing now."""
    with serving(NOTES, tmp_path, "--max-concurrent-envs", "2") as served:
        async def flood() -> list[int]:
            async with aiohttp.ClientSession() as http_:
                async def post(route: str) -> int:
                    async with http_.post(served.url + route, data=b'{"split": "all", "index": 1}',
                                          headers={"Content-Type": "text/plain", "Origin": ELSEWHERE,
                                                   "Sec-Fetch-Site": "cross-site"}) as reply:
                        return reply.status

                async def socket_(path: str) -> int:
                    try:
                        async with http_.ws_connect(served.ws_url + path, origin=ELSEWHERE):
                            return 101
                    except aiohttp.WSServerHandshakeError as exc:
                        return exc.status
                return await asyncio.gather(*[post(r) for r in ("/reset", "/seed_session", "/mcp") * 8],
                                            *[socket_(p) for p in ("/ws", "/mcp") * 8])
        assert set(asyncio.run(flood())) == {403}
        assert open_sessions(served) == {"openenv": 0, "gym": 0}
        trainers = [Socket(served.ws_url + "/ws") for _ in range(2)]
        try:
            for n, sock in enumerate(trainers):
                reset = sock.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
                assert reset["type"] == "observation" and reset["data"]["done"] is False, (n, reset)
        finally:
            for sock in trainers:
                sock.close()


def test_allow_host_answers_a_proxys_name_and_its_pages(tmp_path):
    with serving(NOTES, tmp_path, "--allow-host", "rl.example.com", "--allow-host", "Lab.Example.") as served:
        for host in ("rl.example.com", "rl.example.com:443", "lab.example"):
            assert request(served.url + "/health", "GET", headers={"Host": host}).status == 200, host
        assert request(served.url + "/health", "GET", headers={"Host": "other.example.com"}).status == 421
        # a page the proxy serves (its own origin, whatever Host the proxy forwards) may call it
        with Socket(served.ws_url + "/ws", {"Origin": "https://rl.example.com"}) as sock:
            assert sock.ask({"type": "state"})["type"] == "state"
        with pytest.raises(InvalidStatus):
            Socket(served.ws_url + "/ws", {"Origin": "https://other.example.com"})
    for bad in ("https://rl.example.com", "rl.example.com:8000", "rl.example.com/x", "-x.example", ""):
        code, out = run_cli(tmp_path / "state", "serve", str(NOTES), f"--allow-host={bad}")
        assert code == 1 and "--allow-host" in out and "not a host name" in out, (bad, out)


def run_cli(state: Path, *argv: str) -> tuple[int, str]:
    """``python agentenv.py ARGV``, with a state dir of the test's: its exit code and output."""
    import subprocess
    from tests.harness import REPO, environ
    done = subprocess.run([sys.executable, str(REPO / "agentenv.py"), *argv], capture_output=True,
                          text=True, timeout=60, env=environ(state))
    return done.returncode, done.stdout + done.stderr


def test_token_file_is_read_and_its_mistakes_are_refused(tmp_path):
    import os
    token = tmp_path / "token"
    token.write_text(f"{TOKEN}\nsecond line ignored\n")
    token.chmod(0o600)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving(NOTES, tmp_path / "served", "--token-file", str(token), headers=auth) as served:
        assert_401(request(served.url + "/health", "GET"), "/health")
        assert request(served.url + "/health", "GET", headers=auth).status == 200
        assert "chmod 600" not in served.log()
    empty, fifo = tmp_path / "empty", tmp_path / "fifo"
    empty.write_text("\n  \n")
    os.mkfifo(fifo)
    for argv, said in ((["--token-file", str(tmp_path / "missing")], "could not be read"),
                       (["--token-file", str(empty)], "holds no token on its first line"),
                       (["--token-file", str(fifo)], "is not a regular file"),
                       (["--token-file", str(tmp_path)], "could not be read (Is a directory)"),
                       (["--token", "x", "--token-file", str(token)], "give one"),
                       (["--token", ""], "--token is empty")):
        code, out = run_cli(tmp_path / "state", "serve", str(NOTES), "--port", str(free_port()), *argv)
        assert code == 1 and said in out, (argv, out)
    token.chmod(0o644)               # readable by others: said, and served all the same
    with serving(NOTES, tmp_path / "shared", "--token-file", str(token), headers=auth) as served:
        assert request(served.url + "/health", "GET", headers=auth).status == 200
        assert "can be read by other users (mode 644); chmod 600 it" in served.log()
    code, out = run_cli(tmp_path / "state", "serve", "--help")
    assert "ps" in out and "--token-file" in out


def test_bad_header_bytes_are_401_never_500(locked):
    """Header values that are not UTF-8 (a token, a subprotocol, an Origin, a Host) are refused
    as any wrong value is, without a traceback; anyone could send them, token or not."""
    import socket as socket_
    upgrade = (b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
    host = f"Host: 127.0.0.1:{locked.port}\r\n".encode()

    def status_of(head: bytes) -> int:
        with socket_.create_connection(("127.0.0.1", locked.port), timeout=30) as conn:
            conn.sendall(head + b"\r\n")
            answer = b""
            while b"\r\n" not in answer and (got := conn.recv(4096)):
                answer += got
        return int(answer.split(b" ")[1])

    with survivor(locked):
        mark = len(locked.log())
        for head, status in (
                (b"GET /health HTTP/1.1\r\n" + host + b"Authorization: Bearer \xff\xfe" + TOKEN.encode()
                 + b"\r\n", 401),
                (b"GET /health HTTP/1.1\r\n" + host + b"Authorization: \xc3\r\n", 401),
                (b"GET /ws HTTP/1.1\r\n" + host + upgrade + b"Sec-WebSocket-Protocol: agentenv, \xff\xfe\r\n", 401),
                (b"GET /mcp HTTP/1.1\r\n" + host + upgrade + b"Sec-WebSocket-Protocol: \x80\r\n", 401),
                (b"GET /health HTTP/1.1\r\nHost: 127.0.0.\xff1\r\n", 421),
                (b"GET /ws HTTP/1.1\r\n" + host + upgrade + b"Origin: http://\xff\xfe\r\n", 403)):
            assert status_of(head) == status, head
        assert not server_errors(locked.log()[mark:]), locked.log()[mark:][-3000:]


def test_a_local_model_cannot_read_the_token_from_proc(tmp_path):
    """In the local sandbox the model's bash runs as serve's own user. It can read every process's
    command line (so the token is given in a file, not with --token), and, had serve not made
    itself undumpable, its environment (AGENTENV_TOKEN). serve runs here without CAP_SYS_PTRACE,
    CAP_SYS_ADMIN and CAP_PERFMON, as a user's serve runs: root with them reads any process."""
    import shutil
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed: it drops serve's capabilities here")
    from tests.harness import PYFIX, REPO, running
    secret = "t0ken-" + "x" * 24
    token = tmp_path / "token"
    token.write_text(secret + "\n")
    token.chmod(0o600)
    auth = {"Authorization": f"Bearer {secret}"}
    argv = ["setpriv", "--bounding-set=-sys_ptrace,-sys_admin,-perfmon", "--inh-caps=-all",
            sys.executable, str(REPO / "agentenv.py"), "serve", str(PYFIX), "--sandbox", "local",
            "--port", "{port}", "--token-file", str(token)]
    with running(Server(argv, tmp_path / "served", env={"AGENTENV_TOKEN": secret}, headers=auth)) as served:
        row = harness_row(agentenv.Bundle.load(PYFIX), 0, tools=["bash", "end_turn"])
        gym = SyncGym(served, row)
        gym.seed()
        own = gym.call("bash", command=f"cat /proc/{served.pid}/environ; echo; echo exit=$?")
        assert own.status == 200 and "Permission denied" in own.text, own.text
        # every process's environment and command line, searched in the box (the pattern is
        # written so that the search's own command line does not hold the token)
        everyone = gym.call("bash", command="for p in /proc/[0-9]*; do cat $p/environ $p/cmdline; "
                                            "done 2>/dev/null | tr '\\0' '\\n' > /tmp/seen-$$; "
                                            "grep -c AGENTENV_STATE_DIR /tmp/seen-$$; "
                                            f"grep -c '{secret[:5]}[{secret[5]}]{secret[6:]}' /tmp/seen-$$; "
                                            "rm /tmp/seen-$$")
        assert everyone.status == 200, everyone.text
        found, tokens = everyone.text.split()[:2]
        assert int(found) > 0 and int(tokens) == 0, everyone.text
        assert gym.call("bash", command="echo still here").text.strip().endswith("still here")
        assert gym.verify("").json()["mask_sample"] is False
