"""NeMo Gym wire parity, proven beside a reference: the same batteries of requests to a resources
server built the way NeMo Gym 0.7 teaches (tests/gym/reference/app.py: ``SimpleResourcesServer``
under Gym's own ``run_webserver``, in the Gym venv) and to ``agentenv.py serve``'s Gym routes, both
playing notes-v1's ``save-groceries``. For every request the two answers are compared by HTTP
status, body kind (a JSON object, a JSON value, text) and the top-level keys of a JSON object;
``/aggregate_metrics`` replies are compared whole, number by number, since the reference's is
Gym's own reward profiler (``compute_aggregate_metrics``) on the same verify replies.

Every difference left is a deliberate deviation: it is listed in ``DEVIATIONS`` with exactly what
each side answers, and a row of the README's table "Deliberate deviations from the reference
servers" (first cell ``gym:<case>``) says why. The test fails on a difference not listed, on a listed one that no
longer happens as listed, and on a README row with no case here (or a case with no row).

Skipped when the Gym venv isn't built (``bash .ci/gym-venv.sh``); an error instead with
``AGENTENV_REQUIRE_GYM=1``.
"""

from __future__ import annotations

import http.cookies
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import pytest


from tests.gym import harness
from tests.harness import NOTES, REPO, Server, gym_row, request, responses, running, tool_items

REFERENCE = "notes_reference"
TASK = "save-groceries"
GROCERIES = {"title": "groceries", "text": "eggs, milk"}


@dataclass(frozen=True)
class Seen:
    """What a reply is, as the batteries compare it."""

    status: int
    kind: str                 # "object", "value" (JSON other than an object) or "text"
    keys: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.status} {self.kind}" + (f" {list(self.keys)}" if self.keys else "")


def seen(reply) -> tuple[Seen, Any]:
    try:
        body = json.loads(reply.body)
    except ValueError:
        return Seen(reply.status, "text"), reply.text
    if isinstance(body, dict):
        return Seen(reply.status, "object", tuple(sorted(body))), body
    return Seen(reply.status, "value"), body


class Side:
    """One of the two servers: its URL, its row, and a rollout's cookies once seeded."""

    def __init__(self, name: str, url: str, row: dict):
        self.name, self.url, self.row = name, url, row

    def seed(self) -> dict[str, str]:
        reply = request(self.url + "/seed_session", body=self.row)
        assert reply.status == 200, (self.name, reply.status, reply.text)
        return cookies_of(reply)

    def send(self, method: str, path: str, body: Any, cookies: dict[str, str] | None):
        headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())} if cookies else {}
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body, allow_nan=True).encode()
        return request(self.url + path, method, body=body, headers=headers, timeout=120)


# ----------------------------------------------------------------------------- the battery

def good_response(text: str = "Saved.", calls: tuple = ()) -> dict:
    return responses(text, [item for n, (name, args, out) in enumerate(calls)
                            for item in tool_items(n, name, args, out)])


def without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def verify_body(row: dict, **changes: Any) -> dict:
    return {**row, "response": good_response(), **changes}


def verified(task: int, repeat: int, reward: float, *, masked: bool = False, **more: Any) -> dict:
    """A verify reply as Gym's collector sends it to /aggregate_metrics (response cut to usage)."""
    return {"_ng_task_index": task, "_ng_rollout_index": repeat, "reward": reward,
            "mask_sample": masked, "failure_kind": "session_lost" if masked else None,
            "split": "all", "index": task, "response": {"usage": {
                "input_tokens": 100 + 7 * task + repeat, "output_tokens": 20 + repeat,
                "total_tokens": 120 + 7 * task + 2 * repeat,
                "input_tokens_details": {"cached_tokens": 0}}}, **more}


PERF = {"num_turns": 3, "prompt_tokens": 120, "completion_tokens": 40, "cached_prompt_tokens": 0,
        "total_latency_ms": 850.5, "token_observability_coverage": 1.0}

# name -> (method, path, body (a function of the row), cookie: "none", "own" (a seeded
# rollout's) or "bogus")
CASES: dict[str, tuple[str, str, Any, str]] = {
    "alive": ("GET", "/", None, "none"),
    "healthz": ("GET", "/healthz", None, "none"),
    "livez": ("GET", "/livez", None, "none"),
    "readyz": ("GET", "/readyz", None, "none"),
    "reverify_mode": ("GET", "/reverify_mode", None, "none"),
    "reverify_mode_post": ("POST", "/reverify_mode", lambda row: {}, "none"),
    "seed": ("POST", "/seed_session", lambda row: row, "none"),
    "seed_prefixed": ("POST", "/ng-rollout/r-1/seed_session", lambda row: row, "none"),
    "seed_get": ("GET", "/seed_session", None, "none"),
    "seed_not_json": ("POST", "/seed_session", lambda row: b"{", "none"),
    "seed_empty_body": ("POST", "/seed_session", lambda row: b"", "none"),
    "seed_a_list": ("POST", "/seed_session", lambda row: [row], "none"),
    "seed_no_task": ("POST", "/seed_session", lambda row: without(without(row, "split"), "index"),
                     "none"),
    "seed_index_not_a_number": ("POST", "/seed_session", lambda row: {**row, "index": "first"},
                                "none"),
    "tool": ("POST", "/write_note", lambda row: GROCERIES, "own"),
    "tool_prefixed": ("POST", "/ng-rollout/r-1/write_note", lambda row: GROCERIES, "own"),
    "tool_no_session": ("POST", "/write_note", lambda row: GROCERIES, "none"),
    "tool_not_json": ("POST", "/write_note", lambda row: b"{", "own"),
    "tool_arguments_a_list": ("POST", "/write_note", lambda row: [GROCERIES], "own"),
    "tool_missing_argument": ("POST", "/write_note", lambda row: {"title": "groceries"}, "own"),
    "tool_unknown": ("POST", "/no_such_tool", lambda row: {}, "own"),
    "get_unknown_path": ("GET", "/no_such_tool", None, "none"),
    "verify": ("POST", "/verify", lambda row: verify_body(row), "own"),
    "verify_without_session": ("POST", "/verify", lambda row: verify_body(row, response=good_response(
        calls=(("write_note", GROCERIES, "saved note 'groceries'"),))), "none"),
    "verify_not_json": ("POST", "/verify", lambda row: b"{", "own"),
    "verify_empty_body": ("POST", "/verify", lambda row: b"", "own"),
    "verify_no_response": ("POST", "/verify", lambda row: row, "own"),
    "verify_no_params": ("POST", "/verify", lambda row: without(verify_body(row),
                                                                  "responses_create_params"), "own"),
    "verify_params_no_input": ("POST", "/verify", lambda row: verify_body(
        row, responses_create_params={"tools": []}), "own"),
    "verify_params_unknown_key": ("POST", "/verify", lambda row: verify_body(
        row, responses_create_params={**row["responses_create_params"], "colour": "blue"}), "own"),
    "verify_response_a_number": ("POST", "/verify", lambda row: verify_body(row, response=5), "own"),
    "verify_response_no_id": ("POST", "/verify", lambda row: verify_body(
        row, response=without(good_response(), "id")), "own"),
    "verify_response_output_a_number": ("POST", "/verify", lambda row: verify_body(
        row, response={**good_response(), "output": 5}), "own"),
    "verify_response_item_without_type": ("POST", "/verify", lambda row: verify_body(
        row, response={**good_response(), "output": [{"text": "hi"}]}), "own"),
    "verify_response_message_content_a_number": ("POST", "/verify", lambda row: verify_body(
        row, response={**good_response(), "output": [{
            "type": "message", "id": "m", "role": "assistant", "status": "completed",
            "content": 5}]}), "own"),
    "verify_response_call_without_arguments": ("POST", "/verify", lambda row: verify_body(
        row, response={**good_response(), "output": [{
            "type": "function_call", "call_id": "c", "name": "write_note"}]}), "own"),
    "close_typed": ("POST", "/close_session", lambda row: {
        "resources_session_id": "r-1", "episode_id": {"rollout_id": "e-1"}}, "none"),
    "close_not_json": ("POST", "/close_session", lambda row: b"{", "none"),
    "close_empty_body": ("POST", "/close_session", lambda row: b"", "own"),
    "close_without_id": ("POST", "/close_session", lambda row: {}, "own"),
    "aggregate": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": [
        verified(0, 0, 1.0), verified(0, 1, 0.5), verified(1, 0, 0.2), verified(1, 1, 0.0, masked=True),
        verified(2, 0, 0.0, masked=True), verified(3, 0, 0.75, case="x", ng_perf=PERF),
        verified(3, 1, 1.0, ng_perf={**PERF, "num_turns": 5}), verified(4, 2, 0.3)]}, "none"),
    "aggregate_one_repeat": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": [
        verified(0, 0, 1.0), verified(1, 0, 0.0), verified(2, 0, 0.4, ok=True)]}, "none"),
    "aggregate_all_masked": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": [
        verified(0, 0, 0.0, masked=True), verified(1, 0, 0.0, masked=True, ng_perf=PERF)]}, "none"),
    "aggregate_unstamped": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": [
        {"reward": 1.0}, {"reward": 0.0, "mask_sample": True}]}, "none"),
    "aggregate_unstamped_one": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": [
        {"reward": 0.5, "response": {}}]}, "none"),
    "aggregate_no_results": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": []},
                             "none"),
    "aggregate_reward_text": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": [
        {"reward": "high"}]}, "none"),
    "aggregate_not_a_list": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": 5},
                             "none"),
    "aggregate_items_not_objects": ("POST", "/aggregate_metrics", lambda row: {
        "verify_responses": [1, "x"]}, "none"),
    "aggregate_no_key": ("POST", "/aggregate_metrics", lambda row: {}, "none"),
    "aggregate_empty_body": ("POST", "/aggregate_metrics", lambda row: b"", "none"),
    "aggregate_repeated_rollout": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": [
        verified(0, 0, 1.0), verified(0, 0, 0.0)]}, "none"),
    "aggregate_text_task_index": ("POST", "/aggregate_metrics", lambda row: {"verify_responses": [
        {"_ng_task_index": "a", "reward": 1.0}]}, "none"),
    "aggregate_infinite_reward": ("POST", "/aggregate_metrics",
                                  lambda row: b'{"verify_responses": [{"reward": Infinity}]}', "none"),
}

VERIFY_KEYS = ("failure_kind", "failure_reason", "mask_sample", "reward")


def row_keys(row: dict, *more: str) -> tuple[str, ...]:
    return tuple(sorted({*row, *more}))


AGGREGATE = ("200 object ['agent_metrics', 'group_level_metrics', 'key_metrics', 'perf_summary', "
             "'repeat_level_metrics']")


# case -> (what the reference answers, what serve answers). Each has a README row saying why.
def deviations(row: dict) -> dict[str, tuple[str, str]]:
    gyms = f"200 object {sorted(['responses_create_params', 'response', *VERIFY_KEYS])}"
    ours = f"200 object {list(row_keys(row, 'response', 'scores', *VERIFY_KEYS))}"
    return {
        "tool": ("200 value", "200 text"),
        "tool_prefixed": ("200 value", "200 text"),
        "tool_no_session": ("200 value", "400 text"),
        "tool_not_json": ("422 object ['detail']", "400 text"),
        "tool_arguments_a_list": ("422 object ['detail']", "400 text"),
        "tool_missing_argument": ("422 object ['detail']", "200 text"),
        "tool_unknown": ("404 object ['detail']", "200 text"),
        "get_unknown_path": ("404 object ['detail']", "405 object ['detail']"),
        "verify": (gyms, ours),
        "verify_without_session": (gyms, ours),
        "verify_params_unknown_key": ("422 object ['detail']", ours),
        "close_empty_body": ("422 object ['detail']", "200 object ['status']"),
        "close_without_id": ("422 object ['detail']", "200 object ['status']"),
        "aggregate_unstamped": ("500 value", "422 object ['detail']"),
        "aggregate_repeated_rollout": ("500 value", "422 object ['detail']"),
        "aggregate_text_task_index": (AGGREGATE, "422 object ['detail']"),
        "aggregate_infinite_reward": ("500 value", AGGREGATE),
    }


def readme_cases() -> set[str]:
    """The cases of the deviation rows for the Gym wire (first cell `gym:<case>`), in
    docs/deviations.md, the page the README links for them."""
    text = (REPO / "docs" / "deviations.md").read_text()
    return set(re.findall(r"^\|\s*`gym:([a-z_]+)`\s*\|", text, re.M))


def same_numbers(a: Any, b: Any, at: str = "") -> list[str]:
    """Where two JSON values differ, numbers compared to 1e-9 (relative)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{at}: only in the reference: {sorted(set(a) - set(b))}"] if set(a) - set(b) else []
        out += [f"{at}: only in serve's: {sorted(set(b) - set(a))}"] if set(b) - set(a) else []
        return out + [d for k in sorted(set(a) & set(b)) for d in same_numbers(a[k], b[k], f"{at}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{at}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same_numbers(x, y, f"{at}[{i}]")]
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return [] if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) else [f"{at}: {a!r} != {b!r}"]
    return [] if a == b else [f"{at}: {a!r} != {b!r}"]


# ----------------------------------------------------------------------------- the run

@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    harness.skip_unless_gym_venv()
    base = tmp_path_factory.mktemp("gym-parity")
    import agentenv
    index = [t.name for t in agentenv.Bundle.load(NOTES).splits["all"]].index(TASK)
    row = gym_row(NOTES, index)
    with harness.resources_server(harness.REFERENCE_DIR, REFERENCE, work_dir=base / "reference") as ref, \
            running(Server.serve(NOTES, base / "serve")) as ours:
        yield Side("reference", ref, row), Side("serve", ours.url, row), ours


def cookies_of(reply) -> dict[str, str]:
    jar = http.cookies.SimpleCookie()
    for line in reply.set_cookie:
        jar.load(line)
    return {k: m.value for k, m in jar.items()}


def play(side: Side, case: str) -> tuple[Seen, Any]:
    """One case on one side; the rollout it seeded (or a seed it sent made) is closed after."""
    method, path, body, cookie = CASES[case]
    cookies = side.seed() if cookie == "own" else {"agentenv_session": "bogus"} \
        if cookie == "bogus" else None
    if cookie == "own" and path == "/verify":
        side.send("POST", "/write_note", GROCERIES, cookies)
    reply = side.send(method, path, body(side.row) if body else None, cookies)
    for jar in (cookies, cookies_of(reply) if path.endswith("/seed_session") else None):
        if jar:
            side.send("POST", "/close_session", {}, jar)
    return seen(reply)


@pytest.fixture(scope="module")
def answers(sides):
    reference, ours, server = sides
    got = {case: (play(reference, case), play(ours, case)) for case in CASES}
    server.no_envs()                     # no case left an episode behind
    return got, reference.row


def test_every_difference_is_a_listed_deviation(answers):
    got, row = answers
    listed = deviations(row)
    wrong = []
    for case, ((ref, _), (mine, _)) in got.items():
        print(f"{case:45} reference {ref}  |  serve {mine}")
        if case in listed:
            if (str(ref), str(mine)) != listed[case]:
                wrong.append(f"{case}: listed as {listed[case]}, answered ({ref}, {mine})")
        elif ref != mine:
            wrong.append(f"{case}: the reference answers {ref}, serve {mine}, and this is not listed")
    assert wrong == []


def test_the_deviations_page_lists_exactly_these_deviations(answers):
    _, row = answers
    assert readme_cases() == set(deviations(row))


def test_aggregate_metrics_are_gyms_own(answers):
    """/aggregate_metrics against Gym's compute_aggregate_metrics (the reference's route) on the
    same verify replies: every key, every number."""
    got, _ = answers
    compared = 0
    for case, ((ref, ref_body), (mine, my_body)) in got.items():
        if case.startswith("aggregate") and ref.status == 200 and mine.status == 200:
            assert same_numbers(ref_body, my_body) == [], case
            compared += 1
    assert compared >= 6
    agent = got["aggregate"][1][1]["agent_metrics"]
    for key in ("mean/reward", "min/reward", "max/reward", "median/reward", "std/reward",
                "coverage/masked_rollouts", "ci_low_95_across_repeats/mean/reward", "num_repeats"):
        assert key in agent, key


def test_aggregate_metrics_of_served_verify_replies_are_gyms_own(sides, answers):
    """serve's own verify replies (a scored and a replayed rollout), stripped and stamped as Gym's
    collector sends them, three repeats each: both servers' /aggregate_metrics agree."""
    reference, ours, _ = sides
    got, _ = answers
    replies = [got["verify"][1][1], got["verify_without_session"][1][1]]
    assert all(r["reward"] == 1.0 for r in replies)
    results = []
    for task, reply in enumerate(replies):
        for repeat in range(3):
            entry = {k: v for k, v in reply.items() if k not in ("response", "responses_create_params")}
            entry.update({"_ng_task_index": task, "_ng_rollout_index": repeat,
                          "response": {"usage": reply["response"]["usage"]},
                          "reward": reply["reward"] - 0.25 * repeat * task})
            results.append(entry)
    body = {"verify_responses": results}
    (ref, ref_body), (mine, my_body) = (seen(side.send("POST", "/aggregate_metrics", body, None))
                                        for side in (reference, ours))
    assert ref.status == mine.status == 200
    assert same_numbers(ref_body, my_body) == []
    assert len(my_body["repeat_level_metrics"]) == 3


def test_reverify_mode_is_stateless(answers):
    got, _ = answers
    assert got["reverify_mode"][0][1] == got["reverify_mode"][1][1] == "stateless"


def test_verify_without_a_session_replays_the_rollout(answers):
    got, _ = answers
    (_, ref), (_, mine) = got["verify_without_session"]
    assert ref["reward"] == 0.0                  # the reference's verify keeps no rollout
    assert mine["reward"] == 1.0 and mine["mask_sample"] is False   # replayed: the note is saved


def test_a_malformed_response_is_422_never_a_reward(answers):
    got, _ = answers
    for case in [c for c in CASES if c.startswith("verify_response_")] + ["verify_no_response",
                                                                          "verify_params_no_input"]:
        (_, _), (mine, body) = got[case]
        assert mine.status == 422 and "reward" not in body, case


def test_a_replay_whose_call_answers_otherwise_is_masked(sides):
    """A reverified rollout whose recorded tool output is not what the env answers now: masked
    agentenv:replay_diverged, quoting both, never a reward recomputed from another rollout."""
    _, ours, server = sides
    body = verify_body(ours.row, response=good_response(calls=(
        ("write_note", GROCERIES, "saved note 'shopping'"),)))
    reply = ours.send("POST", "/verify", body, None)
    verdict = reply.json()
    assert reply.status == 200 and verdict["mask_sample"] is True and verdict["reward"] == 0.0
    assert verdict["failure_kind"] == "agentenv:replay_diverged"
    assert "answered \"saved note 'groceries'\", but in the rollout it answered \"saved note " \
           "'shopping'\"" in verdict["failure_reason"]
    assert "rollout masked: replayed, the call of write_note" in server.log()
    server.no_envs()


def test_a_replay_of_a_row_that_names_no_task_is_refused(sides):
    _, ours, _ = sides
    reply = ours.send("POST", "/verify", without(verify_body(ours.row), "split"), None)
    assert reply.status == 422
    assert "a /verify without a session cookie replays the rollout, so its row must name the task" \
        in reply.json()["detail"]
