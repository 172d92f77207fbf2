"""The web page ``GET /web`` (play a task by hand, watch the run) and its status route ``GET /web/status``.

* ``test_the_status_route_says_what_metrics_says``: ``serve`` notes-v1 plays episodes over both wires
  (scored, scored 0, a row with other tools than its task, a tool the turn doesn't offer); then
  /web/status holds the numbers /metrics holds (episodes by outcome, the pool's levels, sessions,
  masks by kind, rewards by split and bucket, deploys, tool calls by status, p50/p95 inside the
  bucket Prometheus' estimate falls in, envs by node), and those the test played. The page itself
  is one HTML document with nothing to fetch from elsewhere, under a Content-Security-Policy.
* ``test_the_token_guards_the_page_its_status_and_its_socket``: with ``--token``, /web without it is
  a 401 form that asks for it (not the page), /web/status a 401, and /ws takes the token as the
  page sends it, a subprotocol beside ``agentenv`` (answered ``agentenv``, never the token); a
  wrong one, or one offered alone, is refused. The token is in no log line.
* ``test_play_by_hand_and_watch_the_run``: Debian's chromium, headless, driven by Playwright, on a
  ``serve --token`` of notes-v1 (its notebook given two tools more: ``tally``, with a number, an
  array and a boolean, and ``crash``, which kills the env). Through the page alone: the token
  asked for and given, a reply-graded task (recall-recipe), a tool task (save-groceries, typed
  arguments, a bad JSON argument refused in the form, Enter to call), a two-turn task, and a
  masked failure with its kind and reason; the Run region's numbers rise while a Gym client plays
  rollouts beside it; every request the page made went to the server; screenshots are kept in
  ``$AGENTENV_ARTIFACTS`` (by default ``.ci/artifacts/``): ``playing.png``, mid-turn, and
  ``web.png``, at the end.

* ``test_a_hostile_page_in_a_real_browser_drives_nothing`` (issue 38): the same chromium visits a page of
  another site on this machine (``http://localhost:<another port>``), which tries what any page the
  operator visits could: a WebSocket to ``/ws`` that resets a task, eight blind ``text/plain`` POSTs of
  ``/reset`` and ``/seed_session``, and a read of ``/web/status``; then a page under a domain of its
  own that resolves to 127.0.0.1 (DNS rebinding, by chromium's host resolver rules). Nothing opens a
  session or plays an episode, nothing is read, and the server's own page still plays.

Without chromium or Playwright the browser tests skip, saying why; ``AGENTENV_REQUIRE_BROWSER=1``
(set by .ci/run) makes that a failure.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
from pathlib import Path

import pytest


import agentenv
from tests.harness import (Gym, NOTES, REPO, Server, Socket, browser_unavailable, client,
                           copy_bundle, gym_row, patch, request, run, serving, wait_until)

from prometheus_client.parser import text_string_to_metric_families

TOKEN = "web-test-token"
RECALL, SAVE, TWO_STEP = 0, 1, 2               # notes-v1's tasks in the split "all"
ARTIFACTS = Path(os.environ.get("AGENTENV_ARTIFACTS") or REPO / ".ci" / "artifacts")


# ================================================================ the status route, against /metrics

def metrics_page(server: Server, headers: dict | None = None) -> dict[str, list[tuple[dict, float]]]:
    reply = request(server.url + "/metrics", "GET", headers=headers)
    assert reply.status == 200, reply.text
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def summed(samples: dict, name: str, key: str) -> dict[str, int]:
    """A metric's values summed by one label, zeros left out."""
    found: dict[str, int] = {}
    for labels, value in samples.get(name, []):
        found[labels.get(key, "")] = found.get(labels.get(key, ""), 0) + int(value)
    return {k: n for k, n in found.items() if n}


def cumulative(samples: dict, name: str, **only: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets, summed over its other labels."""
    buckets: dict[float, float] = {}
    for labels, value in samples.get(name + "_bucket", []):
        if all(labels.get(k) == v for k, v in only.items()):
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0) + value
    return sorted(buckets.items())


def bucket_of(q: float, buckets: list[tuple[float, float]]) -> tuple[float, float]:
    """The bounds of the bucket the q-quantile's rank falls in (the highest finite bound, past them)."""
    rank, lower = q * buckets[-1][1], 0.0
    for upper, count in buckets:
        if count >= rank:
            return (lower, lower) if upper == float("inf") else (lower, upper)
        lower = upper
    raise AssertionError(buckets)


def test_the_status_route_says_what_metrics_says(tmp_path):
    with serving(NOTES, tmp_path / "serve") as server:
        before = request(server.url + "/web/status", "GET")
        assert before.status == 200 and before.content_type == "application/json", before.text
        assert before.json()["episodes"] == {"played": 0, "scored": 0, "forfeited": 0, "failed": 0,
                                             "abandoned": 0, "live": 0, "waiting": 0, "limit": 8}
        assert (before.json()["bundle"], before.json()["sandbox"]) == ("notes-v1", "local")

        async def go():
            async with client() as http:
                for n in range(2):                            # two scored Gym rollouts
                    gym = Gym(server.url, gym_row(NOTES, SAVE), http, strict=True)
                    await gym.seed()
                    await gym.call("write_note", title="groceries", text="eggs and milk")
                    await gym.call("read_note", title="groceries")
                    assert (await gym.verify("Saved.")).json()["reward"] == 1.0
                odd = Gym(server.url, gym_row(NOTES, SAVE, tools=["other"]), http)
                await odd.seed()
                masked = (await odd.verify("Saved.")).json()
                assert masked["failure_kind"] == "agentenv:tools_mismatch", masked
                for reply, reward in (("2", 1.0), ("3", 0.0)):   # OpenEnv: recall-recipe
                    async with http.ws_connect(server.ws_url + "/ws") as ws:
                        await ws.send_json({"type": "reset", "data": {"split": "all", "index": RECALL}})
                        assert not (await ws.receive_json(timeout=60))["data"]["done"]
                        await ws.send_json({"type": "step", "data": {"tool_name": "no_such_tool"}})
                        await ws.receive_json(timeout=60)
                        await ws.send_json({"type": "step", "data": {
                            "tool_name": "end_turn", "arguments": {"response": reply}}})
                        final = (await ws.receive_json(timeout=60))["data"]
                        assert final["reward"] == reward, final
                        rows = final["observation"]["metadata"]["verifications"]["answer"]["results"]
                        assert rows[0]["justification"] == ("pattern matched" if reward else
                                                            "no match for pattern '\\\\b2\\\\b'"), rows

        run(go(), 120)
        wait_until(lambda: request(server.url + "/web/status", "GET").json()["episodes"]["live"] == 0,
                   30, "every episode is torn down")
        status = request(server.url + "/web/status", "GET").json()
        page = metrics_page(server)

        # what the test played
        assert status["episodes"] == {"played": 5, "scored": 4, "forfeited": 0, "failed": 0,
                                      "abandoned": 1, "live": 0, "waiting": 0, "limit": 8}
        assert status["masked"] == {"agentenv:tools_mismatch": 1}
        assert status["rewards"]["all"]["count"] == 4 and status["rewards"]["all"]["mean"] == 0.75
        assert status["tool_calls"]["by_status"] == {"ok": 4, "unknown_tool": 2}
        assert status["deploys"] == {**status["deploys"], "count": 5, "failed": 0}
        assert status["nodes"] == [{"node": "", "envs": 0, "deploys": 5}]
        assert status["warm"] is None

        # the same numbers as /metrics
        assert {k: v for k, v in status["episodes"].items()
                if k in ("scored", "failed", "abandoned") and v} == \
            summed(page, "agentenv_episodes_total", "outcome")
        for level in ("live", "waiting", "limit"):
            assert status["episodes"][level] == page[f"agentenv_episodes_{level}"][0][1]
        assert status["episodes"]["forfeited"] == page["agentenv_forfeits_total"][0][1]
        assert status["sessions"] == {labels["wire"]: int(v) for labels, v in page["agentenv_sessions"]}
        assert status["masked"] == summed(page, "agentenv_masked_rollouts_total", "kind")
        assert status["tool_calls"]["by_status"] == summed(page, "agentenv_tool_calls_total", "status")
        assert status["tool_calls"]["count"] == sum(status["tool_calls"]["by_status"].values())
        assert status["deploys"]["count"] == sum(summed(page, "agentenv_deploys_total", "env").values())
        for split, reward in status["rewards"].items():
            count = summed(page, "agentenv_reward_count", "split")[split]
            total = next(v for labels, v in page["agentenv_reward_sum"] if labels["split"] == split)
            assert (reward["count"], reward["mean"]) == (count, total / count)
            buckets = cumulative(page, "agentenv_reward", split=split)
            assert reward["buckets"] == [[upper, int(n - below)] for (upper, n), below in
                                         zip(buckets, [0, *(n for _, n in buckets)]) if upper != float("inf")]
        assert status["rewards"]["all"]["buckets"][0] == [0.0, 1]       # the reply "3" scored 0
        assert status["rewards"]["all"]["buckets"][-1] == [1.0, 3]
        for key, name in (("deploys", "agentenv_deploy_duration_seconds"),
                          ("tool_calls", "agentenv_tool_call_duration_seconds")):
            buckets = cumulative(page, name)
            for q in (0.5, 0.95):
                lower, upper = bucket_of(q, buckets)
                assert lower <= status[key][f"p{round(q * 100)}"] <= upper, (key, q, status[key], buckets)

        # the page: one document, nothing to fetch from anywhere else
        html = request(server.url + "/web", "GET")
        assert html.status == 200 and html.content_type == "text/html"
        assert 'id="split"' in html.text and 'id="run-title"' in html.text
        assert not re.search(r"\b(https?|wss?)://|\burl\(|@import|\b(src|href|action)=\"(?!data:)", html.text,
                             re.I), "the page names a resource to fetch"
        policy = html.headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy
        assert "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy
        assert html.headers["Cache-Control"] == "no-store"
    # the status line at shutdown says the same
    assert "Status: 5 episodes played (4 scored, 1 abandoned)" in server.log()


# ================================================================ the token

def test_the_token_guards_the_page_its_status_and_its_socket(tmp_path):
    from websockets.exceptions import InvalidStatus

    auth = {"Authorization": f"Bearer {TOKEN}"}
    offered = agentenv.ws_token_protocol(TOKEN)
    with serving(NOTES, tmp_path / "serve", "--token", TOKEN, headers=auth) as server:
        locked = request(server.url + "/web", "GET")
        assert locked.status == 401 and locked.content_type == "text/html"
        assert locked.headers["WWW-Authenticate"].startswith("Bearer")
        assert '<label for="token">Token</label>' in locked.text and 'id="split"' not in locked.text
        assert "Content-Security-Policy" in locked.headers
        wrong = request(server.url + "/web", "GET", headers={"Authorization": "Bearer guess"})
        assert wrong.status == 401 and 'id="split"' not in wrong.text
        assert 'id="split"' in request(server.url + "/web", "GET", headers=auth).text

        refused = request(server.url + "/web/status", "GET")
        assert refused.status == 401 and "bearer token" in refused.json()["detail"]
        assert request(server.url + "/web/status", "GET", headers=auth).json()["bundle"] == "notes-v1"
        # a subprotocol is a token only on a WebSocket upgrade
        assert request(server.url + "/web/status", "GET", headers={
            "Sec-WebSocket-Protocol": f"agentenv, {offered}"}).status == 401

        # /ws as the page opens it: the token a subprotocol beside "agentenv", answered "agentenv"
        with Socket(server.ws_url + "/ws", protocols=["agentenv", offered]) as ws:
            assert ws.ws.subprotocol == "agentenv"
            reply = ws.ask({"type": "reset", "data": {"split": "all", "index": RECALL}})
            assert reply["data"]["observation"]["metadata"]["prompt"].startswith("How many eggs")
            ws.send({"type": "close"})
        for protocols in (["agentenv", agentenv.ws_token_protocol("guess")], [offered], ["agentenv"]):
            with pytest.raises(InvalidStatus) as caught:
                Socket(server.ws_url + "/ws", protocols=protocols)
            assert caught.value.response.status_code == 401, protocols
        # a client that sends the header and offers no subprotocol is answered none, as before
        with Socket(server.ws_url + "/ws", headers=auth) as ws:
            assert ws.ws.subprotocol is None
    assert TOKEN not in server.log() and offered not in server.log()


# ================================================================ the page, in a real browser

# notes-v1's notebook with two tools more: tally (typed arguments) and crash (the env dies).
TYPED = '''\
"""The notebook env of notes-v1 with a tool of typed arguments and one that kills the env."""
import json
import os
import sys

import server as notebook

notebook.TOOLS += [
    {"name": "tally", "description": "Count some tags, a number of times.", "inputSchema": {
        "type": "object", "required": ["times", "tags"], "additionalProperties": False,
        "properties": {"times": {"type": "integer", "description": "How many times."},
                       "tags": {"type": "array", "items": {"type": "string"},
                                "description": "The tags."},
                       "loud": {"type": "boolean"}}}},
    {"name": "crash", "description": "Stop the env at once.",
     "inputSchema": {"type": "object", "properties": {}}},
]
_call_tool = notebook.call_tool


def call_tool(name, args, role):
    if name == "tally":
        return json.dumps(args, sort_keys=True), False
    if name == "crash":
        print("notebook: crashing, as asked", file=sys.stderr, flush=True)
        os._exit(3)
    return _call_tool(name, args, role)


notebook.call_tool = call_tool
notebook.main()
'''

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--disable-extensions", "--disable-quic",
                  "--disable-domain-reliability", "--no-pings", "--disable-breakpad",
                  "--disable-client-side-phishing-detection",
                  "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication"]


def with_typed_tools(root: Path) -> Path:
    notebook = root / "envs" / "notebook"
    (notebook / "typed.py").write_text(TYPED)
    patch(notebook / "Dockerfile", "COPY server.py .", "COPY server.py typed.py .")
    patch(notebook / "Dockerfile", 'CMD ["python", "server.py"]', 'CMD ["python", "typed.py"]')
    return root


def chromium() -> str:
    """Debian's chromium (or $AGENTENV_CHROMIUM), and Playwright to drive it; else a skip saying why."""
    found = os.environ.get("AGENTENV_CHROMIUM") or shutil.which("chromium")
    if not found or not os.access(found, os.X_OK):
        browser_unavailable(f"no chromium {'at ' + found if found else 'on PATH'}: the browser test "
                            "drives Debian's; apt-get install chromium (or set AGENTENV_CHROMIUM to "
                            "a Chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        browser_unavailable("Playwright's Python package is not installed: pip install -e '.[test]'")
    return found


class Rollouts(threading.Thread):
    """Gym rollouts of save-groceries played beside the page, on a thread of their own: all seeded,
    then (once ``go`` is set) played and verified."""

    def __init__(self, server: Server, bundle: Path, count: int):
        super().__init__(daemon=True)
        self.server, self.bundle, self.count = server, bundle, count
        self.seeded, self.go = threading.Event(), threading.Event()
        self.rewards: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.rewards = run(self._play(), 120)
        except BaseException as exc:                # noqa: BLE001 - raised in the test's thread
            self.error = exc
            self.seeded.set()

    async def _play(self) -> list[float]:
        async with client() as http:
            gyms = [Gym(self.server, gym_row(self.bundle, SAVE), http, strict=True)
                    for _ in range(self.count)]
            await asyncio.gather(*(gym.seed() for gym in gyms))
            self.seeded.set()
            await asyncio.to_thread(self.go.wait, 60)

            async def play(gym: Gym) -> float:
                await gym.call("write_note", title="groceries", text="eggs and milk")
                return (await gym.verify("Saved.")).json()["reward"]
            return await asyncio.gather(*(play(gym) for gym in gyms))


def test_play_by_hand_and_watch_the_run(tmp_path):
    executable = chromium()
    from playwright.sync_api import expect, sync_playwright

    bundle = with_typed_tools(copy_bundle(tmp_path / "notes-v1"))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving(bundle, tmp_path / "serve", "--token", TOKEN, headers=auth) as server, \
            sync_playwright() as playwright:
        # its profile, crash reports and caches in a home of the test's own, not the user's
        home = tmp_path / "chromium-home"
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
            env={**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                 "XDG_CACHE_HOME": str(home / ".cache")})
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(60_000)            # a deploy on a loaded machine
        expect.set_options(timeout=60_000)
        asked: list[str] = []
        page.on("request", lambda r: asked.append(r.url))
        page.on("websocket", lambda ws: asked.append(ws.url))
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            # the token: asked for, refused when wrong, and then the page
            first = page.goto(server.url + "/web")
            assert first is not None and first.status == 401
            expect(page.get_by_label("Split")).to_have_count(0)
            page.get_by_label("Token").fill("guess")
            page.get_by_role("button", name="Open").click()
            expect(page.get_by_role("alert")).to_have_text("The server refused that token.")
            page.get_by_label("Token").fill(TOKEN)
            page.get_by_role("button", name="Open").click()
            expect(page.get_by_label("Split")).to_be_visible()
            expect(page.get_by_label("Task", exact=True).locator("option")).to_have_count(3)
            run_region = page.get_by_role("region", name="Run")
            transcript = page.get_by_role("list", name="Transcript")
            outcome = page.get_by_role("region", name="Outcome")

            def start(task: str) -> None:
                page.get_by_label("Split").select_option("all")
                page.get_by_label("Task", exact=True).select_option(label=task)
                page.get_by_role("button", name="Start").click()
                expect(page.get_by_role("button", name="Call write_note")).to_be_enabled()

            def tool(name: str):
                return page.get_by_role("group", name=name)

            def end_turn(reply: str) -> None:
                page.get_by_label("Reply").fill(reply)
                page.get_by_role("button", name="End turn").click()

            # a reply-graded task
            start("recall-recipe (notebook)")
            expect(page.locator("#system-prompt")).to_contain_text("You keep a notebook")
            expect(transcript).to_contain_text("How many eggs does my 'pancakes' note say I need?")
            tool("read_note").get_by_label("title").fill("pancakes")
            page.get_by_role("button", name="Call read_note").click()
            expect(transcript).to_contain_text("2 eggs, 1 cup milk, 1 cup flour")
            end_turn("2")
            expect(outcome.locator("#reward")).to_have_text("1")
            rows = outcome.get_by_role("table", name="Verifier rows")
            expect(rows).to_contain_text("response_regex_present")
            expect(rows).to_contain_text("pattern matched")
            expect(outcome.get_by_role("table", name="Scores")).to_contain_text("answer")

            # a tool task: typed arguments, a bad one refused in the form, Enter to call
            start("save-groceries (notebook)")
            tally = tool("tally")
            expect(tally.get_by_label("times")).to_have_attribute("type", "number")
            tally.get_by_label("times").fill("3")
            tally.get_by_label("tags").fill('["eggs", "milk"')
            page.get_by_role("button", name="Call tally").click()
            expect(tally.get_by_role("alert")).to_contain_text("tags is not JSON")
            tally.get_by_label("tags").fill('["eggs", "milk"]')
            tally.get_by_label("loud").select_option(label="true")
            page.get_by_role("button", name="Call tally").click()
            expect(transcript).to_contain_text('{"loud": true, "tags": ["eggs", "milk"], "times": 3}')
            tool("write_note").get_by_label("title").fill("groceries")
            tool("write_note").get_by_label("text").fill("eggs and milk")
            tool("write_note").get_by_label("text").press("Enter")
            expect(transcript).to_contain_text("saved note 'groceries'")
            end_turn("Saved.")
            expect(outcome.locator("#reward")).to_have_text("1")
            expect(outcome).to_contain_text("a note titled 'groceries' exists")
            expect(outcome).to_contain_text("mentions_eggs_and_milk")

            # a two-turn task: the next turn's prompt comes with end_turn
            start("two-step (notebook)")
            end_turn("You have a note titled pancakes.")
            expect(transcript).to_contain_text("Turn 2: the prompt")
            expect(transcript).to_contain_text("Now save a note titled 'groceries'")
            tool("write_note").get_by_label("title").fill("groceries")
            tool("write_note").get_by_label("text").fill("2 eggs, 1 cup milk, 1 cup flour")
            page.get_by_role("button", name="Call write_note").click()
            expect(transcript).to_contain_text("saved note 'groceries'")
            page.get_by_label("Reply").fill("Saved the ingredients.")
            page.screenshot(path=str(tmp_path / "playing.png"), full_page=True)
            end_turn("Saved the ingredients.")
            expect(outcome.locator("#reward")).to_have_text("1")

            # a masked failure: the env dies under a call
            start("save-groceries (notebook)")
            page.get_by_role("button", name="Call crash").click()
            expect(outcome).to_contain_text("Masked")
            expect(outcome).to_contain_text("transport_peer_drop")
            expect(outcome).to_contain_text("crash failed because the env failed")
            expect(outcome).to_contain_text("crashing, as asked")
            expect(page.get_by_role("button", name="End turn")).to_be_hidden()

            # the Run region counts the page's episodes, and rises as a Gym client plays beside it
            expect(run_region.locator("#played")).to_have_text("4 (3 scored, 1 failed)")
            expect(run_region.locator("#masked")).to_have_text("1 transport_peer_drop")
            expect(run_region.locator("#rewards")).to_contain_text("mean 1.000 · 3 scored")
            rollouts = Rollouts(server, bundle, 3)
            rollouts.start()
            assert rollouts.seeded.wait(60) and rollouts.error is None, rollouts.error
            expect(run_region.locator("#live")).to_have_text("3 of 8")
            expect(run_region.locator("#sessions")).to_contain_text("3 NeMo Gym")
            rollouts.go.set()
            rollouts.join(90)
            assert rollouts.error is None and rollouts.rewards == [1.0] * 3, rollouts.error
            expect(run_region.locator("#played")).to_have_text("7 (6 scored, 1 failed)")
            expect(run_region.locator("#live")).to_have_text("0 of 8")
            expect(run_region.locator("#rewards")).to_contain_text("mean 1.000 · 6 scored")
            expect(run_region.locator("#tool-calls")).to_contain_text(" · p95 ")
            page.screenshot(path=str(tmp_path / "web.png"), full_page=True)
        finally:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            for shot in ("web.png", "playing.png"):
                if (tmp_path / shot).exists():
                    shutil.copy(tmp_path / shot, ARTIFACTS / shot)
            browser.close()
        assert not errors, errors
        elsewhere = [url for url in asked if not url.startswith((server.url + "/", server.ws_url + "/"))]
        assert not elsewhere, f"the page asked another host: {elsewhere}"
        assert {url.split("?")[0] for url in asked} >= {
            server.url + "/web", server.url + "/web/status", server.ws_url + "/ws"}
    assert TOKEN not in server.log()


HOSTILE_PAGE = """<!doctype html><title>a page the operator visits</title><script>
const target = "TARGET", results = window.results = {};
(async () => {
  results.socket = await new Promise(done => {
    const socket = new WebSocket(target.replace("http:", "ws:") + "/ws");
    socket.onopen = () => {
      socket.send(JSON.stringify({type: "reset", data: {split: "all", index: 1}}));
      socket.onmessage = event => done("answered: " + event.data);
    };
    socket.onerror = () => done("refused");
  });
  const blind = route => fetch(target + route, {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "text/plain"}, body: JSON.stringify({split: "all", index: 1})})
    .then(() => "sent", () => "failed");
  results.posts = await Promise.all([..."12345678"].map(() => blind("/reset")).concat(
    [..."1234"].map(() => blind("/seed_session"))));
  results.read = await fetch(target + "/web/status").then(r => r.text(), () => "unreadable");
  results.done = true;
})();
</script>"""


def test_a_hostile_page_in_a_real_browser_drives_nothing(tmp_path):
    import http.server
    executable = chromium()
    from playwright.sync_api import expect, sync_playwright
    from tests.harness import free_port

    with serving(NOTES, tmp_path / "serve") as server, sync_playwright() as playwright:
        page_html = HOSTILE_PAGE.replace("TARGET", server.url).encode()

        class Hostile(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.end_headers()
                self.wfile.write(page_html)

            def log_message(self, *args) -> None:
                pass

        hostile = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Hostile)
        threading.Thread(target=hostile.serve_forever, daemon=True).start()
        home = tmp_path / "chromium-home"
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True,
            args=[*CHROMIUM_FLAGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"],
            env={**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                 "XDG_CACHE_HOME": str(home / ".cache")})
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"http://localhost:{hostile.server_address[1]}/")
            page.wait_for_function("window.results && window.results.done === true", timeout=60_000)
            results = page.evaluate("window.results")
            assert results["socket"] == "refused", results
            assert results["read"] == "unreadable", results
            status = request(server.url + "/web/status", "GET").json()
            assert status["sessions"] == {"openenv": 0, "gym": 0}, status
            assert status["episodes"]["played"] == 0, status
            # a domain of the attacker's that resolves to 127.0.0.1: the page, and what it would read
            for route in ("/web", "/web/status"):
                answered = page.goto(f"http://rebind.test:{server.port}{route}")
                assert answered is not None and answered.status == 421, route
                assert "notes-v1" not in page.content()
            # the server's own page still plays, reached by either of its names
            for name in ("127.0.0.1", "localhost"):
                own = page.goto(f"http://{name}:{server.port}/web")
                assert own is not None and own.status == 200
                expect(page.get_by_label("Task", exact=True).locator("option")).to_have_count(3)
            page.get_by_label("Split").select_option("all")
            page.get_by_label("Task", exact=True).select_option(label="recall-recipe (notebook)")
            page.get_by_role("button", name="Start").click()
            expect(page.get_by_role("button", name="Call read_note")).to_be_enabled()
        finally:
            browser.close()
            hostile.shutdown()
        assert request(server.url + "/web/status", "GET").json()["sessions"]["openenv"] in (0, 1)
