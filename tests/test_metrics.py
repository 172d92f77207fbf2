"""Watching a run: ``GET /metrics`` on each wire, and serve's status line.

* ``test_gym_metrics_count_what_the_rollouts_did``: the Gym resources server as NeMo Gym starts it
  (``run_gym_server``, notes-v1 with a ``sleep`` tool, the local sandbox, the pool at 8,
  tool_timeout 1, idle_timeout 6) plays a load of rollouts at once: scored ones (one of which
  also calls a tool the turn does not offer), one whose tool call misses tool_timeout, one whose
  row offers other tools than its task, a verify with no session, and one left idle until it is
  reaped. /metrics is scraped while they are live (the pool full, the rest waiting) and after:
  every counter equals what the rollouts did (episodes by outcome, masks by kind, tool calls by
  tool and status, deploys, verifier runs, rewards, idle reaps), and the whole page parses with
  Prometheus' own parser.
* ``test_openenv_metrics_count_what_the_sessions_did``: the same over ``serve``'s OpenEnv /ws,
  behind ``--token`` (a scrape without it is refused 401, as every route).
* ``test_the_status_line_is_logged_while_episodes_are_live_and_quiet_when_idle``: an in-process
  Server with ``status_interval`` at 0.1 s logs the line while an episode is live (waited for as a
  log record, not slept for), none while idle, and one at shutdown.
* ``test_a_list_tools_before_any_reset_is_a_deploy_but_no_episode``: what OpenEnv's clients (and
  TRL's environments) ask first deploys the first task to find its tools, and /metrics counts that
  deploy, not an episode.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest


import agentenv
from tests.harness import (Gym, NOTES, Page, Server, Socket, client, copy_bundle, free_port,
                           gym_row, request, resources_config, run, running, scrape, serving,
                           wait_until, with_sleep_tool)

pytest.importorskip("prometheus_client", reason="agentenv.py serves /metrics with prometheus-client: "
                                                "pip install -e .")

SAVE = 1                                           # save-groceries, in the split "all"
TOOLS = ["write_note", "read_note", "list_notes", "sleep", "end_turn"]
POOL = 8
TOKEN = "metrics-test-token"


# ================================================================ reading a page

def check_page(page: Page) -> None:
    """What every page holds: each family documented and typed, the process collector's."""
    for family in page.families.values():
        assert family.documentation, family.name
        assert family.type in ("counter", "gauge", "histogram", "info"), (family.name, family.type)
    assert page.value("process_resident_memory_bytes") > 10 * 2**20
    assert page.value("process_open_fds") > 0
    assert page.value("agentenv_info", version=agentenv.__version__) == 1
    for name in ("agentenv_episodes", "agentenv_tool_calls", "agentenv_masked_rollouts",
                 "agentenv_deploys", "agentenv_idle_reaps", "agentenv_verifier_failures"):
        assert page.families[name].type == "counter", name
    for name in ("agentenv_deploy_duration_seconds", "agentenv_tool_call_duration_seconds",
                 "agentenv_verifier_duration_seconds", "agentenv_reward"):
        assert page.families[name].type == "histogram", name


def check_totals(page: Page, *, scored: int, failed: int, abandoned: int, wire: str,
                 masked: dict[str, int], calls: dict[tuple[str, str], int], deploys: int,
                 reaped: int) -> None:
    """The counters of a page against what the test did."""
    assert page.by("agentenv_episodes_total", "outcome") == {
        k: v for k, v in {("scored",): scored, ("failed",): failed,
                          ("abandoned",): abandoned}.items() if v}
    assert page.by("agentenv_masked_rollouts_total", "wire", "kind") == {
        (wire, kind): n for kind, n in masked.items()}
    assert page.by("agentenv_tool_calls_total", "tool", "status") == calls
    timed = {}                          # a call that reached the env is timed, by its tool
    for (tool, status), n in calls.items():
        if status not in ("unknown_tool", "bad_arguments"):
            timed[(tool,)] = timed.get((tool,), 0) + n
    assert page.by("agentenv_tool_call_duration_seconds_count", "tool") == timed
    assert page.by("agentenv_deploys_total", "env", "sandbox") == {("notebook", "local"): deploys}
    assert page.by("agentenv_deploy_duration_seconds_count", "env", "sandbox") == \
        {("notebook", "local"): deploys}
    assert page.by("agentenv_deploy_failures_total", "env", "sandbox", "kind") == {}
    assert page.by("agentenv_verifier_duration_seconds_count", "verifier") == {("check_notes",): scored}
    assert page.by("agentenv_verifier_failures_total", "verifier") == {}
    assert page.by("agentenv_reward_count", "split") == {("all",): scored}
    assert page.value("agentenv_reward_sum", split="all") == scored          # each scored 1.0
    assert page.value("agentenv_reward_bucket", split="all", le="0.9") == 0
    assert page.by("agentenv_idle_reaps_total", "wire") == ({(wire,): reaped} if reaped else {})


def notes_with_sleep(tmp_path: Path) -> Path:
    return with_sleep_tool(copy_bundle(tmp_path / "notes-v1"))


# ================================================================ the Gym wire

def test_gym_metrics_count_what_the_rollouts_did(tmp_path):
    bundle = notes_with_sleep(tmp_path)
    config = resources_config("notes_v1", bundle=str(bundle), sandbox="local",
                              max_concurrent_envs=POOL, tool_timeout=1, idle_timeout=6)
    scored_n = 12
    with running(Server.gym(tmp_path / "gym", config)) as server:
        before = scrape(server.url)
        check_page(before)
        assert before.by("agentenv_episodes_total", "outcome") == {}
        assert before.value("agentenv_episodes_limit") == POOL
        row, mismatched = gym_row(bundle, SAVE, tools=TOOLS), gym_row(bundle, SAVE, tools=["other"])

        async def go():
            async with client(timeout=300, limit=0) as http:
                scored = [Gym(server.url, row, http, strict=True) for _ in range(scored_n)]
                slow, odd = Gym(server.url, row, http), Gym(server.url, mismatched, http)
                everyone = [*scored, slow, odd]
                await asyncio.gather(*(g.seed() for g in everyone))
                # every episode has started; the first POOL hold the pool, the rest wait
                during = scrape(server.url)

                async def play(gym: Gym, n: int) -> dict:
                    if n == 0:
                        await gym.call("no_such_tool")
                    await gym.call("write_note", title="groceries", text=f"eggs and milk, for {n}")
                    read = await gym.call("read_note", title="groceries")
                    assert read.text == f"eggs and milk, for {n}", read.text
                    return (await gym.verify("Saved.")).json()

                async def too_slow() -> dict:
                    text = (await slow.call("sleep", seconds="3")).text
                    assert "didn't answer within 1s" in text, text
                    return (await slow.verify("Saved.")).json()

                async def mismatched_row() -> dict:
                    return (await odd.verify("Saved.")).json()

                verified = await asyncio.gather(*(play(g, n) for n, g in enumerate(scored)),
                                                too_slow(), mismatched_row())
                lost = Gym(server.url, row, http)           # a verify with no session behind it
                lost.cookies["agentenv_session"] = "never-seeded"
                verified.append((await lost.verify("Saved.")).json())
                idle = Gym(server.url, row, http)           # reaped once idle past idle_timeout
                await idle.seed()
                await idle.call("list_notes")
                return during, verified

        during, verified = run(go(), 300)
        assert [v["mask_sample"] for v in verified] == [False] * scored_n + [True] * 3
        assert [v["failure_kind"] for v in verified[scored_n:]] == \
            ["transport_timeout", "agentenv:tools_mismatch", "session_lost"]

        check_page(during)
        assert during.value("agentenv_episodes_live") == POOL
        assert during.value("agentenv_episodes_waiting") == scored_n + 2 - POOL
        assert during.value("agentenv_sessions", wire="gym") == scored_n + 2
        assert during.value("agentenv_sessions", wire="openenv") == 0
        assert during.by("agentenv_episodes_total", "outcome") == {}
        assert during.by("agentenv_tool_calls_total", "tool", "status") == {}

        # the idle rollout is reaped after idle_timeout; then every episode is torn down
        wait_until(lambda: scrape(server.url).value("agentenv_idle_reaps_total", wire="gym") == 1,
                   30, "the idle Gym session is reaped")
        wait_until(lambda: scrape(server.url).value("agentenv_episodes_live") == 0, 30,
                   "every episode is torn down")
        after = scrape(server.url)
        check_page(after)
        check_totals(after, scored=scored_n, failed=1, abandoned=2, wire="gym",
                     masked={"transport_timeout": 1, "agentenv:tools_mismatch": 1, "session_lost": 1},
                     calls={("write_note", "ok"): scored_n, ("read_note", "ok"): scored_n,
                            ("(unknown)", "unknown_tool"): 1, ("sleep", "timeout"): 1,
                            ("list_notes", "ok"): 1},
                     deploys=scored_n + 3, reaped=1)
        assert after.value("agentenv_sessions", wire="gym") == 0
        assert after.value("agentenv_episodes_waiting") == 0


# ================================================================ the OpenEnv wire

class Session:
    """One OpenEnv session over a raw /ws with the bearer token."""

    def __init__(self, http: aiohttp.ClientSession, server: Server):
        self.http, self.url, self.headers = http, server.ws_url + "/ws", server.headers
        self.ws: aiohttp.ClientWebSocketResponse | None = None

    async def ask(self, message: dict) -> dict:
        assert self.ws is not None
        await self.ws.send_json(message)
        return await self.ws.receive_json(timeout=120)

    async def reset(self) -> dict:
        self.ws = await self.http.ws_connect(self.url, headers=self.headers)
        reply = await self.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
        assert reply["type"] == "observation" and not reply["data"]["done"], reply
        return reply

    async def tool(self, name: str, **arguments) -> dict:
        return (await self.ask({"type": "step", "data": {
            "type": "call_tool", "tool_name": name, "arguments": arguments}}))["data"]

    async def close(self) -> None:
        assert self.ws is not None
        await self.ws.send_json({"type": "close"})
        await self.ws.close()


def test_openenv_metrics_count_what_the_sessions_did(tmp_path):
    bundle = notes_with_sleep(tmp_path)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    scored_n = POOL - 2                  # with the slow one and the idle one: every session slot
    with serving(bundle, tmp_path / "serve", "--max-concurrent-envs", str(POOL), "--token", TOKEN,
                 "--client-timeout", "11", "--reply-margin", "1", "--idle-timeout", "6",
                 headers=auth) as server:
        refused = request(server.url + "/metrics", "GET")
        assert refused.status == 401 and "bearer token" in refused.json()["detail"]
        check_page(scrape(server.url, auth))

        async def go():
            async with client(timeout=300, limit=0) as http:
                sessions = [Session(http, server) for _ in range(POOL)]
                await asyncio.gather(*(s.reset() for s in sessions))
                during = scrape(server.url, auth)
                *scored, slow, idle = sessions

                async def play(session: Session, n: int) -> dict:
                    if n == 0:
                        unknown = await session.tool("no_such_tool")
                        assert unknown["observation"]["error"]["error_type"] == "tool_not_found"
                    await session.tool("write_note", title="groceries", text=f"eggs and milk, for {n}")
                    read = await session.tool("read_note", title="groceries")
                    assert read["observation"]["result"]["data"] == f"eggs and milk, for {n}", read
                    final = await session.tool("end_turn", response="Saved.")
                    await session.close()
                    return final

                async def too_slow() -> dict:
                    timed_out = await slow.tool("sleep", seconds="11")
                    await slow.close()
                    return timed_out

                finals = await asyncio.gather(*(play(s, n) for n, s in enumerate(scored)), too_slow())
                # the idle session, its socket still open, is reaped after idle_timeout
                await asyncio.to_thread(
                    wait_until, lambda: scrape(server.url, auth).value(
                        "agentenv_idle_reaps_total", wire="openenv") == 1,
                    30, "the idle OpenEnv session is reaped")
                assert idle.ws is not None
                closed = await idle.ws.receive(timeout=10)
                assert closed.type == aiohttp.WSMsgType.CLOSE and \
                    closed.data == aiohttp.WSCloseCode.GOING_AWAY, closed
                return during, finals

        during, finals = run(go(), 300)
        assert [f["reward"] for f in finals[:-1]] == [1.0] * scored_n
        assert finals[-1]["done"] and finals[-1]["observation"]["metadata"]["failure_kind"] == \
            "transport_timeout", finals[-1]

        check_page(during)
        assert during.value("agentenv_episodes_live") == POOL
        assert during.value("agentenv_episodes_waiting") == 0
        assert during.value("agentenv_sessions", wire="openenv") == POOL
        assert during.by("agentenv_episodes_total", "outcome") == {}
        assert during.by("agentenv_deploys_total", "env", "sandbox") == {("notebook", "local"): POOL}

        wait_until(lambda: scrape(server.url, auth).value("agentenv_episodes_live") == 0, 30,
                   "every episode is torn down")
        after = scrape(server.url, auth)
        check_page(after)
        check_totals(after, scored=scored_n, failed=1, abandoned=1, wire="openenv",
                     masked={"transport_timeout": 1},
                     calls={("write_note", "ok"): scored_n, ("read_note", "ok"): scored_n,
                            ("(unknown)", "unknown_tool"): 1, ("sleep", "timeout"): 1},
                     deploys=POOL, reaped=1)
        assert after.value("agentenv_sessions", wire="openenv") == 0
    assert "Status: " in server.log()          # the line at shutdown, as episodes were played


# ================================================================ the status line

class Lines(logging.Handler):
    """The status lines agentenv logs, each one also an event a test can wait for."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.new = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Status: "):
            self.lines.append(record.getMessage())
            self.new.set()

    async def next(self, timeout: float = 10) -> str:
        self.new.clear()
        await asyncio.wait_for(self.new.wait(), timeout)
        return self.lines[-1]


def test_a_list_tools_before_any_reset_is_a_deploy_but_no_episode(tmp_path):
    with serving(NOTES, tmp_path) as server:
        with Socket(server.ws_url + "/ws") as ws:
            listed = ws.ask({"type": "step", "data": {"type": "list_tools"}})
            assert [t["name"] for t in listed["data"]["observation"]["tools"]] == \
                ["write_note", "read_note", "list_notes", "end_turn"]
        wait_until(lambda: scrape(server.url).value("agentenv_episodes_live") == 0, 30,
                   "the deploy is torn down")
        page = scrape(server.url)
        check_page(page)
        assert page.by("agentenv_episodes_total", "outcome") == {}
        assert page.by("agentenv_deploys_total", "env", "sandbox") == {("notebook", "local"): 1}
        assert page.value("agentenv_sessions", wire="openenv") == 0


def test_the_status_line_is_logged_while_episodes_are_live_and_quiet_when_idle(tmp_path, monkeypatch):
    from aiohttp import web

    monkeypatch.setenv("AGENTENV_STATE_DIR", str(tmp_path / "state"))
    interval = 0.1
    logger = logging.getLogger("agentenv")

    async def go():
        lines = Lines()
        logger.addHandler(lines)
        level = logger.level
        logger.setLevel(logging.INFO)
        runtime = agentenv.Runtime(agentenv.Bundle.load(NOTES), agentenv.Settings.of(sandbox="local"))
        server = agentenv.Server(runtime, agentenv.Settings(status_interval=interval))
        runner = web.AppRunner(server.app, access_log=None)
        try:
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            # idle: several intervals pass with no line (an absence: there is no event to wait for)
            await asyncio.sleep(5 * interval)
            assert lines.lines == []
            async with client() as http:
                gym = Gym(f"http://127.0.0.1:{port}", gym_row(NOTES, SAVE), http, strict=True)
                await gym.seed()
                await gym.call("write_note", title="groceries", text="eggs and milk")
                live = await lines.next()
                assert live.startswith("Status: 0 episodes played; 1 live of 8, 0 waiting; "
                                       "masked: none"), live
                # each duration lands in the first line after it (which may have come while the
                # call's reply was on its way), and in no other
                said = " | ".join(lines.lines)
                assert said.count("1 deploy p50 ") == 1 and said.count("1 tool call p50 ") == 1, said
                before = len(lines.lines)
                await gym.call("read_note", title="groceries")
                await lines.next()
                said = " | ".join(lines.lines[before:])
                assert "deploy" not in said and said.count("1 tool call p50 ") == 1, said
                assert (await gym.verify("Saved.")).json()["reward"] == 1.0
            while runtime.live:
                await next(iter(runtime.live)).closed.wait()
            seen = len(lines.lines)                  # a line may have come as the episode closed
            await asyncio.sleep(5 * interval)
            assert len(lines.lines) == seen, lines.lines[seen:]
        finally:
            await runner.cleanup()
            logger.removeHandler(lines)
            logger.setLevel(level)
        return lines.lines[-1]

    last = run(go(), 120)
    assert last.startswith("Status: 1 episode played (1 scored); 0 live of 8, 0 waiting; "
                           "masked: none"), last
