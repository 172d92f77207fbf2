"""Faults: each one costs only its own rollout, masked with a reason a person can act on, while the
rollouts running beside it are scored as usual; and a server that stops, however it stops, leaves
nothing running.

Already covered elsewhere, so not repeated here:

* a tool that misses tool_timeout, masked: tests/test_gym_surface.py::test_a_tool_that_misses_
  tool_timeout_is_masked_with_the_pages_message (and url mode: ::test_url_mode_honours_the_
  resources_servers_tool_timeout); OpenEnv's reply deadline: tests/test_openenv.py::test_a_call_
  that_runs_too_long_answers_timeout_inside_the_client_timeout; the runtime: test_agentenv.py::
  test_a_tool_that_misses_its_timeout_fails_the_episode
* a verifier that raises or hangs: test_gym_surface.py::test_a_verifier_that_raises_is_masked_
  verifier_error; test_agentenv.py::test_a_verifier_that_raises_fails_the_episode_instead_of_
  scoring_0, ::test_a_verifier_that_hangs_misses_the_verifier_timeout, ::test_a_hanging_verifier_
  fails_the_episode_and_frees_its_thread
* a deploy that fails (env exits at start), an env that never listens (the runtime's deploy
  deadline): test_gym_surface.py::test_a_deploy_that_fails_is_masked; test_agentenv.py::test_an_
  env_that_exits_at_start_fails_the_episode_quoting_its_output, ::test_an_env_that_never_listens_
  misses_the_deploy_timeout
* an env that crashes itself mid-turn (the runtime): test_agentenv.py::test_an_env_that_crashes_
  mid_turn_fails_the_episode, ::test_an_env_that_crashes_mid_turn_says_how_it_stopped
* idle_timeout: test_gym_surface.py::test_idle_timeout_ends_a_session_that_never_verifies_and_frees_
  its_slot; test_openenv.py::test_idle_ws_session_is_reaped_and_frees_its_slot (and the /mcp ones)
* reset_timeout on a wait for a slot, the holder scoring: test_gym_surface.py::test_reset_timeout_
  masks_a_rollout_that_waits_too_long_for_a_slot
* the serve behind a url: resources server killed: test_gym_surface.py::test_a_server_that_went_
  away_is_masked_session_lost
* SIGTERM with live episodes (OpenEnv): test_openenv.py::test_sigterm_with_live_episodes_tears_down_
  and_exits_0, ::test_sigterm_closes_open_sockets_and_exits_promptly
* a crashed run's local env processes killed at the next start (a Runtime, a forged record):
  test_agentenv.py::test_processes_left_by_a_crashed_run_are_killed_at_start
* Docker: a Runtime killed with SIGKILL, its container swept at the next start: tests/test_docker.py
  ::test_killed_server_container_swept_at_next_start, ::test_startup_sweep_removes_only_dead_owners_
  containers; abandon or close while a container is being created: test_docker.py::test_abandon_*,
  ::test_close_while_create_in_flight_leaves_no_container

Added here, each through a served surface (``serve``, or the resources server as Gym runs it),
with a sibling rollout scored alongside:

* an env process killed mid-episode (local sandbox), then a tool call, or straight to /verify;
* a container killed mid-episode (``docker kill``, found by its ``agentenv.episode`` label),
  before a tool call, during one, before /verify, or while its verifier reads it: each ends
  within seconds (serve dials containers at their own addresses, and Docker's event of the
  death is what ends a wait on one);
* an env that hangs on a tool (tool_timeout) and an env that never becomes ready (reset_timeout on
  Gym, the reply deadline on OpenEnv), both beside a sibling that scores;
* a client that disconnects mid-tool-call (Gym and OpenEnv /ws alike: the call is cancelled, and
  its episode and env end at once, freeing the slot; the Gym session's /verify is masked);
* serve killed with SIGKILL while episodes are live on both surfaces, then started again: the env
  processes of the first run (by its records) are gone after the new start; the same with Docker
  containers through serve;
* SIGINT while both surfaces are busy (calls in flight): every episode ended, every env torn down,
  every socket closed, exit 0;
* a greedy env: a tool listing whose pages never end (its deploy fails at the page limit, masked
  agentenv:env_failed) and tools that answer 60 MiB (the model's tool error, never a mask), each
  beside a sibling that scores, with the server's peak memory (VmHWM) read before and after.

Bugs these found, fixed since, each test now passing: an env killed between the last tool call and
/verify was masked as the verifier's fault; a /ws client gone mid-step logged an ERROR with a
traceback; a call in flight at SIGINT was answered as if its env had failed; a container removed
while the start-up sweep listed them stopped serve's start; two launches under way at once could be
handed the same port; a failed deploy's output not yet read was not quoted. (Section 7 holds
deterministic repros of what tests/test_load.py met under load.)

Every server runs as a subprocess (``sys.executable``; signals to pyenv's shim never reach the
server) with its own AGENTENV_STATE_DIR; its env processes are found by /proc scan (they inherit
that variable), its containers by their labels. Async code runs with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import aiohttp
import pytest


import agentenv
from tests.harness import (Gym, NOTES, Reply, Server, Socket, alive, client, copy_bundle, gym_rows,
                           labelled, one_turn_task, remove_quietly, resources_config, run, running,
                           wait_until, with_sleep_tool)

try:
    import docker.errors
    DOCKER_NOT_FOUND: type[BaseException] = docker.errors.NotFound
except ImportError:                                  # the Docker tests skip, saying why
    DOCKER_NOT_FOUND = Exception

GROCERIES = {"title": "groceries", "text": "eggs and milk"}


# ================================================================ the faulty bundle

def make_faults_bundle(dest: Path) -> Path:
    """notes-v1 whose notebook also has a ``sleep`` tool; plus an env ``deaf`` that never listens
    and an env ``broken`` that prints why and exits at once, with a one-turn task each."""
    root = with_sleep_tool(copy_bundle(dest / "faults-v1"))
    notebook = root / "envs" / "notebook"
    shutil.copytree(notebook, root / "envs" / "deaf")
    deaf = root / "envs" / "deaf" / "Dockerfile"
    deaf.write_text(deaf.read_text().replace("USER 10001\n", "USER 10001\nENV NEVER_READY=1\n"))
    broken = root / "envs" / "broken"
    broken.mkdir()
    (broken / "Dockerfile").write_text('FROM python:3.11-slim\nCOPY broken.py .\n'
                                       'CMD ["python", "broken.py"]\n')
    (broken / "broken.py").write_text("import sys\nprint('broken: no config at /etc/broken.toml', "
                                      "flush=True)\nsys.exit(3)\n")
    tasks = {"hang": one_turn_task("notebook", "Save a note, slowly."),
             "never-ready": one_turn_task("deaf", "Save a note titled 'groceries' with eggs and milk."),
             "broken": one_turn_task("broken", "Say hello.")}
    for name, steps in tasks.items():
        (root / "tasks" / f"{name}.json").write_text(json.dumps(steps, indent=2))
    return root


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Path:
    return make_faults_bundle(tmp_path_factory.mktemp("bundle"))


def index_of(bundle: Path, name: str) -> int:
    return [t.name for t in agentenv.Bundle.load(bundle).splits["all"]].index(name)


# ================================================================ helpers

async def seeded(http: aiohttp.ClientSession, base: str, row: dict) -> Gym:
    """One Gym rollout as simple_agent plays it, seeded; every reply of it must be a 200."""
    rollout = Gym(base, row, http, strict=True)
    await rollout.seed()
    return rollout


def answer(reply: Reply) -> tuple[str, float]:
    """The text the model reads, and how long it took."""
    return reply.text, reply.elapsed


def assert_scored(body: dict, reward: float = 1.0) -> None:
    assert (body["reward"], body["mask_sample"], body["failure_reason"]) == (reward, False, None), body


def assert_masked(body: dict, kind: str, *parts: str) -> str:
    assert body["reward"] == 0.0 and body["mask_sample"] is True, body
    assert body["instance_config"]["mask_sample"] is True
    assert body["failure_kind"] == kind, body["failure_reason"]
    for part in parts:
        assert part in body["failure_reason"], body["failure_reason"]
    return body["failure_reason"]


# ================================================================ 1. an env killed mid-episode

@pytest.mark.parametrize("then", ["tool call", "verify"])
def test_an_env_process_killed_mid_episode_masks_its_rollout_and_a_sibling_scores(tmp_path, then):
    """Local sandbox: the env process of one of two live rollouts is killed (SIGKILL) from outside.
    Its rollout is masked transport_peer_drop, saying the env stopped and how; the sibling,
    deployed beside it, is scored 1.0; both envs are gone afterwards."""
    with running(Server.serve(NOTES, tmp_path, "--max-concurrent-envs", "4")) as server:
        row = gym_rows(NOTES)["save-groceries"]

        async def go():
            async with client() as http:
                victim = await seeded(http, server.url, row)
                assert (await victim.call("list_notes")).text == "(no notes)"
                [pid] = server.wait_envs(1)
                sibling = await seeded(http, server.url, row)
                assert (await sibling.call("list_notes")).text == "(no notes)"
                server.wait_envs(2)
                os.kill(pid, signal.SIGKILL)
                wait_until(lambda: not alive(pid), 5, "the killed env is dead")
                after = (await victim.call("write_note", **GROCERIES)).text if then == "tool call" \
                    else None
                sib = (await sibling.call("write_note", **GROCERIES)).text
                return after, sib, (await victim.verify()).json(), (await sibling.verify()).json()

        after, sib, masked, scored = run(go())
        stopped = "env 'notebook' stopped: its process exited with code -9"
        if then == "tool call":
            assert after.startswith("error: the environment failed: write_note failed because the "
                                    f"env failed: {stopped}"), after
            assert after.endswith("; the rollout will be masked")
        assert_masked(masked, "transport_peer_drop", stopped)
        assert f"rollout masked: {masked['failure_reason']}" in server.log()
        assert sib == "saved note 'groceries'"
        assert_scored(scored)
        server.no_envs()


# ================================================================ 2. a hang and an env never ready

def test_a_hanging_tool_and_an_env_never_ready_cost_only_their_rollouts_on_gym(tmp_path, faults):
    """The resources server as Gym runs it, tool_timeout 1 s and reset_timeout 3 s: at once, one
    rollout's tool hangs, one rollout's env never becomes ready, and a sibling plays. The first
    two are masked transport_timeout with the setting to raise; the sibling scores 1.0 before the
    never-ready one has even given up; no env process is left."""
    config = resources_config("faults", bundle=str(faults), sandbox="local")
    with running(Server.gym(tmp_path, config, max_concurrent_envs=4, tool_timeout=1,
                            reset_timeout=3, idle_timeout=600)) as server:
        table = gym_rows(faults)

        async def hang(http):
            rollout = await seeded(http, server.url, table["hang"])
            assert (await rollout.call("list_notes")).text == "(no notes)"
            text, took = answer(await rollout.call("sleep", seconds="60"))
            return text, took, (await rollout.verify()).json(), time.monotonic()

        async def never(http):
            rollout = await seeded(http, server.url, table["never-ready"])
            text, took = answer(await rollout.call("write_note", **GROCERIES))
            return text, took, (await rollout.verify()).json(), time.monotonic()

        async def sibling(http):
            rollout = await seeded(http, server.url, table["save-groceries"])
            text, _ = answer(await rollout.call("write_note", **GROCERIES))
            return text, (await rollout.verify()).json(), time.monotonic()

        async def go():
            async with client() as http:
                started = time.monotonic()
                results = await asyncio.gather(hang(http), never(http), sibling(http))
                return started, results

        started, ((hang_text, hang_took, hang_body, _), (never_text, never_took, never_body, never_at),
                  (sib_text, sib_body, sib_at)) = run(go())
        timed_out = ("sleep didn't answer within 1s, and the episode ended, since what the call does "
                     "may still be under way")
        assert hang_text == f"error: {timed_out}" and 0.9 < hang_took < 3, (hang_text, hang_took)
        assert_masked(hang_body, "transport_timeout", timed_out)
        assert never_text.startswith("error: the environment of this rollout failed, so write_note did "
                                     "not run (the episode was not deployed and at its first turn "
                                     "within reset_timeout (3s)"), never_text
        assert 2.5 < never_took < 6, never_took
        assert_masked(never_body, "transport_timeout", "within reset_timeout (3s)",
                      "raise reset_timeout or max_concurrent_envs")
        assert sib_text == "saved note 'groceries'"
        assert_scored(sib_body)
        assert sib_at < never_at, "the sibling waited for the env that never became ready"
        server.no_envs()


def test_an_env_never_ready_meets_the_deploy_deadline_of_the_gym_config(tmp_path, faults):
    """deploy_timeout in the resources server's config bounds the deploy: past it the rollout is
    masked transport_timeout, with the env's last output and the setting to raise, well before
    reset_timeout; the README's fault table says so for the default path (180 s before 600)."""
    config = resources_config("faults", bundle=str(faults), sandbox="local")
    with running(Server.gym(tmp_path, config, max_concurrent_envs=2, deploy_timeout=1.5,
                            reset_timeout=60)) as server:
        async def never(http):
            rollout = await seeded(http, server.url, gym_rows(faults)["never-ready"])
            text, took = answer(await rollout.call("write_note", **GROCERIES))
            return text, took, (await rollout.verify()).json()

        async def go():
            async with client() as http:
                return await never(http)

        text, took, body = run(go())
        assert text.startswith("error: the environment of this rollout failed, so write_note did "
                               "not run (the environment failed: step 'env' (deploy_env) failed: env "
                               "'deaf' was not ready within 1.5s"), text
        assert 1.2 < took < 10, took
        reason = assert_masked(body, "transport_timeout", "was not ready within 1.5s",
                               "the deploy deadline; if it is only slow, raise --deploy-timeout "
                               "(deploy_timeout in a Gym config)")
        assert "waiting for a database that never comes" in reason, reason    # its last output
        server.no_envs()


def test_a_hanging_tool_and_an_env_never_ready_cost_only_their_sessions_on_openenv(tmp_path, faults):
    """serve with replies due within 3 s (--client-timeout 4 --reply-margin 1), three /ws sessions
    at once: the hanging tool call answers OpenEnv's timeout error, the reset of the env that never
    becomes ready answers an error observation naming the flag to raise, and the sibling is done
    with reward 1.0; no env process is left."""
    with running(Server.serve(faults, tmp_path, "--max-concurrent-envs", "4", "--client-timeout", "4",
                              "--reply-margin", "1")) as server:
        ws_url = server.ws_url + "/ws"
        hang_at, never_at, save_at = (index_of(faults, n) for n in ("hang", "never-ready", "save-groceries"))

        async def session(http, index, calls):
            async with http.ws_connect(ws_url) as ws:
                await ws.send_json({"type": "reset", "data": {"split": "all", "index": index}})
                replies = [await ws.receive_json(timeout=30)]
                for name, arguments in calls:
                    if replies[-1]["data"]["done"]:
                        break
                    await ws.send_json({"type": "step", "data": {"type": "call_tool", "tool_name": name,
                                                                 "arguments": arguments}})
                    replies.append(await ws.receive_json(timeout=30))
                await ws.send_json({"type": "close"})
                return replies, time.monotonic()

        async def go():
            async with client() as http:
                return await asyncio.gather(
                    session(http, hang_at, [("sleep", {"seconds": "60"})]),
                    session(http, never_at, [("write_note", GROCERIES)]),
                    session(http, save_at, [("write_note", GROCERIES), ("end_turn", {"response": "ok"})]))

        (hang, _), (never, never_done), (save, save_done) = run(go())
        slept = hang[-1]["data"]
        assert slept["done"] is True and slept["observation"]["error"]["error_type"] == "timeout", slept
        assert "sleep didn't answer within 3s" in slept["observation"]["error"]["message"]
        [reset] = never
        meta = reset["data"]["observation"]["metadata"]
        assert reset["data"]["done"] is True and meta["status"] == "error", reset
        assert meta["failure_kind"] == "transport_timeout"
        assert meta["error"].startswith("the deploy and the opening of the turn took longer than 3s"), meta
        assert "--client-timeout" in meta["error"]
        assert save[-1]["data"]["done"] is True and save[-1]["data"]["reward"] == 1.0, save[-1]
        assert save_done < never_done
        server.no_envs()


# ================================================================ 3. a client that goes mid-call

def test_a_gym_client_gone_mid_call_ends_its_episode_at_once(tmp_path, faults):
    """serve --max-concurrent-envs 1 --idle-timeout 600: a rollout's client gives up on a tool call
    (its request cancelled, the connection closed) while the call runs. What the call does may
    still be under way, so its episode ends then, not when the call would have: its env goes within
    seconds, and the one slot with it, so a second rollout deploys and scores without waiting for
    the idle sweep (600 s). The first session's next call says its rollout failed, and its /verify
    is masked session_lost. The server logs no traceback."""
    with running(Server.serve(faults, tmp_path, "--max-concurrent-envs", "1",
                              "--idle-timeout", "600")) as server:
        table = gym_rows(faults)

        async def go():
            async with client() as http:
                first = await seeded(http, server.url, table["save-groceries"])
                assert (await first.call("list_notes")).text == "(no notes)"
                [pid] = server.env_pids()
                # a client of its own, closed with the request still under way
                async with aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(force_close=True),
                        cookie_jar=aiohttp.DummyCookieJar()) as gone:
                    request = asyncio.ensure_future(gone.post(server.url + "/sleep", json={"seconds": "30"},
                                                              cookies=first.cookies))
                    await asyncio.sleep(0.5)
                    request.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await request
                left = time.monotonic()
                wait_until(lambda: not alive(pid), 10, "the env of the episode whose client left")
                env_gone = time.monotonic() - left
                second = await seeded(http, server.url, table["save-groceries"])
                waited_text, waited = answer(await second.call("write_note", **GROCERIES))
                after = (await first.call("write_note", **GROCERIES)).text
                return env_gone, waited_text, waited, after, (await second.verify()).json(), \
                    (await first.verify()).json()

        env_gone, waited_text, waited, after, second, late = run(go())
        assert env_gone < 10
        assert waited_text == "saved note 'groceries'"
        assert waited < 30, waited                        # a deploy, not the call's 30 s nor idle
        assert after.startswith("error: ") and "masked" in after, after
        assert_scored(second)
        assert_masked(late, "session_lost", "its client went away during a call to sleep")
        server.no_envs()
        log = server.log()
        assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def gone_mid_step(tmp_path_factory, faults):
    """serve --max-concurrent-envs 1: a /ws client drops its connection (no close frame) while a
    tool call runs (a 2 s sleep). What follows: whether its env was torn down, the final reply of a
    new session that waited for the one slot, and the server's log."""
    with running(Server.serve(faults, tmp_path_factory.mktemp("gone"), "--max-concurrent-envs",
                              "1")) as server:
        ws_url = server.ws_url + "/ws"
        save_at = index_of(faults, "save-groceries")
        ws = Socket(ws_url)
        try:
            assert ws.ask({"type": "reset", "data": {"split": "all", "index": save_at}},
                          timeout=30)["data"]["done"] is False
            server.wait_envs(1)
            ws.send({"type": "step", "data": {"type": "call_tool", "tool_name": "sleep",
                                              "arguments": {"seconds": "30"}}})
            time.sleep(0.5)
        finally:
            ws.drop()                                   # gone: no close frame
        started = time.monotonic()
        server.no_envs(timeout=10)
        torn_down_in = time.monotonic() - started

        async def again():
            async with client() as http:
                for _ in range(100):
                    async with http.ws_connect(ws_url) as socket_:
                        await socket_.send_json({"type": "reset", "data": {"split": "all",
                                                                           "index": save_at}})
                        reply = await socket_.receive_json(timeout=30)
                        if reply["type"] == "error":         # CAPACITY_REACHED: not free yet
                            await asyncio.sleep(0.1)
                            continue
                        await socket_.send_json({"type": "step", "data": {
                            "type": "call_tool", "tool_name": "write_note", "arguments": GROCERIES}})
                        await socket_.receive_json(timeout=30)
                        await socket_.send_json({"type": "step", "data": {
                            "type": "call_tool", "tool_name": "end_turn", "arguments": {"response": "ok"}}})
                        return await socket_.receive_json(timeout=30)
                raise AssertionError("the slot of the gone client was never freed")

        final = run(again())
        server.no_envs()
    yield torn_down_in, final, server.log()


def test_an_openenv_client_gone_mid_step_is_reclaimed_at_once(gone_mid_step):
    """Its session ends and its env is torn down at once: not once the 30 s call under way would
    have returned, nor after idle_timeout; and the one slot is free for a new session, which plays
    and scores."""
    torn_down_in, final, _ = gone_mid_step
    assert torn_down_in < 5, torn_down_in
    assert final["data"]["done"] is True and final["data"]["reward"] == 1.0, final


def test_an_openenv_client_gone_mid_step_logs_no_traceback(gone_mid_step):
    _, _, log = gone_mid_step
    assert "Traceback" not in log, log


# ================================================================ 4. serve killed, and started again

def test_serve_killed_with_sigkill_its_env_processes_are_gone_after_the_next_start(tmp_path):
    """Local sandbox: serve killed with SIGKILL while two Gym rollouts and an OpenEnv session are
    live leaves their env processes running (orphans, by the run's records). serve started again on
    the same state dir kills every one of them before it answers, removes the records, says so,
    serves a new rollout, and masks a rollout of the killed run session_lost."""
    state = tmp_path / "state"
    first = Server.serve(NOTES, tmp_path / "first", state=state)
    row = gym_rows(NOTES)["save-groceries"]
    try:
        async def live():
            async with client() as http:
                rollouts = [await seeded(http, first.url, row) for _ in range(2)]
                for rollout in rollouts:
                    assert (await rollout.call("list_notes")).text == "(no notes)"
                ws = await http.ws_connect(first.ws_url + "/ws")
                await ws.send_json({"type": "reset", "data": {"split": "all", "index": 0}})
                assert (await ws.receive_json(timeout=30))["data"]["done"] is False
                first.wait_envs(3)
                records = first.records()
                first.signal(signal.SIGKILL)
                assert first.proc.wait(10) == -signal.SIGKILL
                await ws.close()
                return rollouts[0].cookies, records

        cookies, records = run(live())
        assert len(records) == 3
        assert all(alive(pid) for pid in records), "a SIGKILLed serve leaves its envs running"
        owner_folder = {p.parent for p in records.values()}
        assert len(owner_folder) == 1

        with running(Server.serve(NOTES, tmp_path / "second", state=state)) as second:
            # it answers only once its start-up sweep is done
            assert not [pid for pid in records if alive(pid)], "env processes of the killed run live on"
            assert not any(folder.exists() for folder in owner_folder)
            assert "left behind when it stopped without tearing down" in second.log()

            async def after():
                async with client() as http:
                    fresh = await seeded(http, second.url, row)
                    assert (await fresh.call("write_note", **GROCERIES)).text == "saved note 'groceries'"
                    orphan = Gym(second.url, row, http, strict=True)
                    orphan.cookies = cookies
                    return (await fresh.verify()).json(), (await orphan.verify()).json()

            fresh, orphan = run(after())
            assert_scored(fresh)
            assert_masked(orphan, "session_lost", "the server restarted")
            second.no_envs()
    finally:
        first.kill()
        for pid in first.records():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


# ================================================================ 5. SIGINT, both surfaces busy

@pytest.fixture(scope="module")
def sigint_busy(tmp_path_factory, faults):
    """serve, then SIGINT while a Gym rollout and an OpenEnv session are each mid-call (a 30 s
    sleep), and another of each holds a live env. What the clients got, the exit code, how long
    the server took to exit, what it left, and its log."""
    server = Server.serve(faults, tmp_path_factory.mktemp("sigint"), "--max-concurrent-envs", "8")
    table = gym_rows(faults)
    ws_url = server.ws_url + "/ws"
    save_at = index_of(faults, "save-groceries")

    async def until_closed(ws) -> list:
        frames = []
        while not frames or frames[-1].type == aiohttp.WSMsgType.TEXT:
            frames.append(await ws.receive(timeout=20))
        return frames

    async def go():
        async with client() as http:
            idle_gym = await seeded(http, server.url, table["save-groceries"])
            busy_gym = await seeded(http, server.url, table["save-groceries"])
            for rollout in (idle_gym, busy_gym):
                assert (await rollout.call("list_notes")).text == "(no notes)"
            sockets = [await http.ws_connect(ws_url) for _ in range(2)]
            for ws in sockets:
                await ws.send_json({"type": "reset", "data": {"split": "all", "index": save_at}})
                assert (await ws.receive_json(timeout=30))["data"]["done"] is False
            server.wait_envs(4)
            in_flight = asyncio.ensure_future(busy_gym.call("sleep", seconds="30"))
            await sockets[1].send_json({"type": "step", "data": {
                "type": "call_tool", "tool_name": "sleep", "arguments": {"seconds": "30"}}})
            await asyncio.sleep(0.5)
            server.signal(signal.SIGINT)
            started = time.monotonic()
            [gym_answer] = await asyncio.gather(in_flight, return_exceptions=True)
            if isinstance(gym_answer, Reply):
                gym_answer = answer(gym_answer)
            frames = [await until_closed(ws) for ws in sockets]
            code = await asyncio.to_thread(server.proc.wait, 20)
            took = time.monotonic() - started
            return gym_answer, frames, code, took

    try:
        gym_answer, frames, code, took = run(go())
        left = (server.env_pids(), server.records())
    finally:
        server.kill()
    yield gym_answer, frames, code, took, left, server.log()


def test_sigint_with_both_surfaces_busy_ends_every_episode_and_exits_0(sigint_busy):
    """The server ends all four episodes, tears every env down, answers the calls in flight (none
    hangs), closes every socket, exits 0 well before the sleeps would end, and logs no traceback."""
    gym_answer, frames, code, took, (pids, records), log = sigint_busy
    assert code == 0, log
    assert took < 15, took
    assert not pids and not records, (pids, records)
    # the Gym call in flight is answered with its text: the episode ended under it
    assert isinstance(gym_answer, tuple) and gym_answer[0].startswith("error: "), gym_answer
    # the idle socket is closed (going away); the busy one gets its step's answer, then is closed
    idle, busy = frames
    assert [f.type for f in idle] == [aiohttp.WSMsgType.CLOSE] and idle[0].data == 1001, idle
    assert [f.type for f in busy] == [aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.CLOSE], busy
    step = json.loads(busy[0].data)["data"]
    assert step["done"] is True and step["observation"]["metadata"]["status"] == "error", step
    assert "Shutting down: ending 4 live episode(s)" in log, log
    assert "Traceback" not in log, log


def test_a_call_in_flight_at_sigint_says_the_server_shut_down(sigint_busy):
    gym_answer, frames, *_ = sigint_busy
    error = json.loads(frames[1][0].data)["data"]["observation"]["metadata"]["error"]
    for text in (gym_answer[0], error):
        assert "shut down" in text and "env failed" not in text, text


# ================================================================ 6. Docker, through serve

def owned_containers(docker_client, server: Server) -> list:
    """The containers of a serve process, by their agentenv.owner label (host:pid:start)."""
    found = labelled(docker_client, "agentenv.owner")
    return [c for c in found if c.labels["agentenv.owner"].split(":")[1] == str(server.pid)]


SLOW_VERIFIER = (NOTES / "artifacts" / "check_notes" / "verify.py").read_text().replace(
    "    notes = await asyncio.to_thread(_dump_notes, mcp_url)",
    "    await asyncio.to_thread(_sleep_in_the_env, mcp_url)\n"
    "    notes = await asyncio.to_thread(_dump_notes, mcp_url)") + '''

def _sleep_in_the_env(mcp_url):
    """A verifier that takes its time reading the env: the env's sleep tool, for 600 s."""
    sid, _ = _post(mcp_url, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
        "clientInfo": {"name": "check_slowly", "version": "1.0"}}})
    _post(mcp_url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, sid)
    _post(mcp_url, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                    "params": {"name": "sleep", "arguments": {"seconds": "600"}}}, sid)
'''


@pytest.mark.parametrize("then", ["tool call", "call in flight", "verify", "verifier reading"])
def test_a_container_killed_mid_episode_masks_its_rollout_at_once_and_a_sibling_scores(
        docker_client, tmp_path, then):
    """Docker sandbox: ``docker kill`` of one rollout's container (found by its agentenv.episode
    label) mid-episode: before its next call, while a call of it sleeps in the env, before its
    verify, or while its verifier waits on the env. The call, or the verify, says the env's
    container exited with code 137 within seconds, not after the 60 s tool timeout or the
    verifier's; masked transport_peer_drop; the sibling's container plays on and scores 1.0; no
    container of the server is left. serve dials a container at its own address: a connection
    open as it dies is reset by its dying process, but a new one to an address nobody holds
    waits for an answer that never comes, so only Docker's word of the death (serve reads its
    event stream) ends the next call and the verify at once (without it: 60 s and 35 s)."""
    bundle = with_sleep_tool(copy_bundle(tmp_path / "bundle"))
    slowly = bundle / "artifacts" / "check_slowly"
    slowly.mkdir()
    (slowly / "verify.py").write_text(SLOW_VERIFIER.replace("timeout=30", "timeout=900"))
    (bundle / "tasks" / "check-slowly.json").write_text(json.dumps(one_turn_task(
        "notebook", "Save a note titled 'groceries' with eggs and milk.", "check_slowly")))
    # no warm pool (the Docker default keeps one): the server's containers are its rollouts'
    server = Server.serve(bundle, tmp_path, "--max-concurrent-envs", "4", "--warm", "0",
                          sandbox="docker")
    try:
        with running(server):
            row = gym_rows(bundle)["save-groceries"]

            async def go():
                async with client() as http:
                    victim = await seeded(http, server.url, gym_rows(bundle)["check-slowly"]
                                          if then == "verifier reading" else row)
                    assert (await victim.call("list_notes")).text == "(no notes)"
                    [container] = await asyncio.to_thread(owned_containers, docker_client, server)
                    episode = container.labels["agentenv.episode"]
                    sibling = await seeded(http, server.url, row)
                    assert (await sibling.call("list_notes")).text == "(no notes)"
                    [target] = docker_client.containers.list(
                        filters={"label": f"agentenv.episode={episode}"})
                    asleep = verifying = after = None
                    if then == "call in flight":
                        asleep = asyncio.ensure_future(victim.call("sleep", seconds="600"))
                    if then == "verifier reading":
                        verifying = asyncio.ensure_future(victim.verify())
                    if asleep or verifying:
                        await asyncio.to_thread(wait_until, lambda: b"sleepy: sleeping" in
                                                target.logs(), 30, "the env sleeps in the call")
                    started = time.monotonic()
                    await asyncio.to_thread(target.kill)
                    if asleep is not None:
                        after = answer(await asleep)
                    elif then == "tool call":
                        after = answer(await victim.call("write_note", **GROCERIES))
                    sib = (await sibling.call("write_note", **GROCERIES)).text
                    if verifying is None:
                        started = time.monotonic()
                        verifying = asyncio.ensure_future(victim.verify())
                    masked = (await verifying).json()
                    return after, sib, masked, time.monotonic() - started, \
                        (await sibling.verify()).json()

            after, sib, masked, verified_in, scored = run(go())
            stopped = "env 'notebook' stopped: its container exited with code 137"
            if after is not None:
                text, took = after
                assert text.startswith("error: the environment failed: ") and stopped in text, text
                assert took < 30, f"the call waited {took:.1f}s for a dead env"
            assert_masked(masked, "transport_peer_drop", stopped)
            assert verified_in < 30, f"the verify waited {verified_in:.1f}s for a dead env"
            assert sib == "saved note 'groceries'"
            assert_scored(scored)
            wait_until(lambda: not owned_containers(docker_client, server), 20,
                       "every container of the server is removed")
    finally:
        remove_quietly(owned_containers(docker_client, server))


def test_docker_serve_killed_with_sigkill_its_containers_are_removed_at_the_next_start(docker_client,
                                                                                       tmp_path):
    """Docker sandbox: serve killed with SIGKILL with a Gym rollout and an OpenEnv session live
    leaves their containers running; serve started again removes them before it answers, and
    says so."""
    first = Server.serve(NOTES, tmp_path / "first", "--max-concurrent-envs", "4", "--warm", "0",
                         sandbox="docker")
    left: list = []
    try:
        async def live():
            async with client() as http:
                rollout = await seeded(http, first.url, gym_rows(NOTES)["save-groceries"])
                assert (await rollout.call("list_notes")).text == "(no notes)"
                ws = await http.ws_connect(first.ws_url + "/ws")
                await ws.send_json({"type": "reset", "data": {"split": "all", "index": 0}})
                assert (await ws.receive_json(timeout=60))["data"]["done"] is False
                first.signal(signal.SIGKILL)
                assert first.proc.wait(10) == -signal.SIGKILL
                await ws.close()

        run(live())
        left = owned_containers(docker_client, first)
        assert len(left) == 2 and all(c.status == "running" for c in left), \
            [(c.short_id, c.status) for c in left]
        with running(Server.serve(NOTES, tmp_path / "second", "--warm", "0",
                                  sandbox="docker")) as second:
            assert owned_containers(docker_client, first) == [], "the killed serve's containers live on"
            assert "Removed 2 container(s) that an earlier run of agentenv.py left behind" in second.log()
    finally:
        first.kill()
        remove_quietly(left)


def test_a_container_removed_during_the_start_up_sweep_does_not_stop_the_start(docker_client,
                                                                             monkeypatch):
    """A container is listed by the start-up sweep and removed before the sweep inspects it (here:
    the daemon's listing names one that no longer exists). The runtime must start all the same."""
    import docker.api.client

    listed = docker.api.client.APIClient.containers

    def with_one_gone(self, *args, **kwargs):
        found = listed(self, *args, **kwargs)
        if (kwargs.get("filters") or {}).get("label") == "agentenv.owner":
            found = [*found, {"Id": "0" * 64}]         # removed since the daemon listed it
        return found
    monkeypatch.setattr(docker.api.client.APIClient, "containers", with_one_gone)

    async def go():
        async with agentenv.Runtime(agentenv.Bundle.load(NOTES), agentenv.Settings.of(sandbox="docker")) as runtime:
            return runtime.sandbox.kind

    assert run(go(), 120) == "docker"


# ================================================================ 7. sandbox races met under load

@pytest.fixture
def same_port_twice(monkeypatch):
    """agentenv.free_port() answers one port twice (as the kernel may), then as it would."""
    port = agentenv.free_port()
    picks = iter([port, port])
    real = agentenv.free_port
    monkeypatch.setattr(agentenv, "free_port", lambda *host: next(picks, None) or real(*host))


def test_two_episodes_given_the_same_port_one_after_the_other_never_share_an_env(same_port_twice):
    """free_port() hands the port of a live env out again (the kernel does, once the probe socket
    is closed): the second episode must not be played on the first one's env (seen under load in
    tests/test_load.py before 0a2c4e2: its writes landed in the first's notebook). The first, which
    wrote nothing, scores 0."""
    bundle = agentenv.Bundle.load(NOTES)
    task = bundle.tasks["save-groceries"]

    async def go():
        async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="local")) as runtime:
            first = runtime.episode(task)
            first_turn = await first.next_turn()
            second = runtime.episode(task)
            try:
                second_turn = await second.next_turn()
                await second_turn.call("write_note", dict(GROCERIES))
                listed = await first_turn.call("list_notes", {})
            except agentenv.EpisodeFailed:
                listed = None                     # the second failed: it shares nothing
            first_turn.end("I wrote nothing.")
            outcome = await first.result()
            await second.abandon("done")
            return listed and listed.text, outcome.status, outcome.reward

    listed, status, reward = run(go(), 60)
    # The second's env died binding the port the first holds; it was started again on another.
    assert listed == "(no notes)", f"the first episode's env lists the second's note, or the " \
                                   f"second was not started again on another port: {listed!r}"
    assert (status, reward) == ("scored", 0.0), (status, reward)


def test_an_env_whose_port_another_servers_env_took_first_is_started_again_elsewhere(
        monkeypatch, caplog):
    """Two servers on one machine: another server's env (a card of another name) binds the port
    ours was handed before ours binds it. Ours must not take that env for a misnamed one of its
    own: it dies on bind, is started again on another port, and the episode plays."""
    from aiohttp import web
    bundle = agentenv.Bundle.load(NOTES)
    task = bundle.tasks["save-groceries"]
    port = agentenv.free_port()
    picks, real = iter([port]), agentenv.free_port
    monkeypatch.setattr(agentenv, "free_port", lambda *host: next(picks, None) or real(*host))

    async def go():
        async def card(request):
            return web.json_response({"name": "other"})
        foreign = web.Application()
        foreign.router.add_get("/.well-known/agent-env.json", card)
        runner = web.AppRunner(foreign)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="local")) as runtime:
                episode = runtime.episode(task)
                turn = await episode.next_turn()
                await turn.call("write_note", dict(GROCERIES))
                turn.end("Saved.")
                return (await episode.result()).reward, episode.instances[0].port
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.INFO, logger="agentenv"):
        reward, played_on = run(go(), 60)
    assert reward == 1.0 and played_on != port, (reward, played_on, port)
    assert any("lost its port to another process before binding it; starting it again on another "
               "port." in r.getMessage() for r in caplog.records)


def test_two_launches_at_once_are_never_handed_the_same_port(same_port_twice):
    """Two episodes started together, both launches under way when free_port() gives the same port
    twice (as the kernel does for two probes a moment apart): both must deploy, each on its own
    env, and each see only its own note."""
    bundle = agentenv.Bundle.load(NOTES)
    task = bundle.tasks["save-groceries"]

    async def play(episode, title):
        try:
            turn = await episode.next_turn()
        except agentenv.EpisodeFailed as exc:
            return f"failed: {exc}"
        await turn.call("write_note", {"title": title, "text": "eggs and milk"})
        return (await turn.call("list_notes", {})).text

    async def go():
        async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="local")) as runtime:
            episodes = [runtime.episode(task), runtime.episode(task)]        # at once
            listed = await asyncio.gather(play(episodes[0], "first"), play(episodes[1], "second"))
            for episode in episodes:
                await episode.abandon("done")
            return listed

    listed = run(go(), 60)
    assert listed == ["first", "second"], listed


def test_a_failed_deploy_quotes_the_envs_output_even_when_its_reader_lags(faults, monkeypatch):
    """The env prints why it can't start and exits; the reader of its output lags (as it does on
    a loaded machine: here it starts 0.5 s late). The deploy's failure must still quote that line."""
    read = agentenv.LocalInstance._read

    async def lagging(self):
        await asyncio.sleep(0.5)
        await read(self)
    monkeypatch.setattr(agentenv.LocalInstance, "_read", lagging)
    bundle = agentenv.Bundle.load(faults)

    async def go():
        async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="local")) as runtime:
            episode = runtime.episode(bundle.tasks["broken"])
            with pytest.raises(agentenv.EpisodeFailed) as failed:
                await episode.next_turn()
            return str(failed.value)

    message = run(go(), 60)
    assert "did not come up: its process exited with code 3" in message, message
    assert "broken: no config at /etc/broken.toml" in message, message


# ================================================================ 8. a greedy env: endless tool pages, a 60 MiB answer

GREEDY = '''\
"""The notebook env of notes-v1, greedy, as GREEDY in its environment says: "pages" lists its
tools in pages that never end (each a new cursor and five more tools of a KiB); "flood" adds the
tools flood and flood_chunks, which answer 60 MiB of text: the first with its length said up front,
the second in chunks of 64 KiB, its length unknown until its end."""
import json
import os

import server as notebook

MODE = os.environ.get("GREEDY", "")
FLOOD = "x" * (60 * 2**20)
if MODE == "flood":
    for name in ("flood", "flood_chunks"):
        notebook.TOOLS.append({"name": name, "description": "Answer a great deal of text.",
                               "inputSchema": notebook._schema()})
        notebook.SCHEMAS[name] = notebook.TOOLS[-1]["inputSchema"]
_handle_rpc, _reply = notebook.handle_rpc, notebook.Handler.reply


def handle_rpc(msg, role):
    params = msg.get("params") or {}
    if MODE == "pages" and msg["method"] == "tools/list":
        page = int(params.get("cursor") or 0)
        more = [{"name": f"tool_{page}_{n}", "description": "x" * 1024,
                 "inputSchema": notebook._schema()} for n in range(5)]
        return {"jsonrpc": "2.0", "id": msg["id"], "result": {
            "tools": (notebook.TOOLS if page == 0 else []) + more, "nextCursor": str(page + 1)}}
    if MODE == "flood" and msg["method"] == "tools/call" and params.get("name", "").startswith("flood"):
        return {"jsonrpc": "2.0", "id": msg["id"], "chunks": params["name"] == "flood_chunks",
                "result": {"content": [{"type": "text", "text": FLOOD}], "isError": False}}
    return _handle_rpc(msg, role)


def reply(self, status, body=None, headers=None):
    if not (isinstance(body, dict) and body.pop("chunks", False)):
        return _reply(self, status, body, headers)
    data = json.dumps(body).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Transfer-Encoding", "chunked")
    self.end_headers()
    try:
        for at in range(0, len(data), 65536):
            self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data[at:at + 65536]), data[at:at + 65536]))
        self.wfile.write(b"0\\r\\n\\r\\n")
    except ConnectionError:          # the client read what it reads, and hung up
        self.close_connection = True


notebook.handle_rpc = handle_rpc
notebook.Handler.reply = reply
notebook.main()
'''


@pytest.fixture(scope="module")
def greedy(tmp_path_factory) -> Path:
    """notes-v1 with two greedy copies of its notebook env (GREEDY above): ``pager``, whose tool
    listing never ends, and ``flooder``, whose flood tool answers 60 MiB; a one-turn task each
    (``pages``, ``flood``), scored as save-groceries is."""
    root = copy_bundle(tmp_path_factory.mktemp("bundle") / "greedy-v1")
    for name, mode in (("pager", "pages"), ("flooder", "flood")):
        env = root / "envs" / name
        shutil.copytree(root / "envs" / "notebook", env)
        (env / "greedy.py").write_text(GREEDY)
        (env / "Dockerfile").write_text(f'FROM python:3.11-slim\nWORKDIR /app\nCOPY server.py greedy.py ./\n'
                                        f'ENV GREEDY={mode}\nCMD ["python", "greedy.py"]\n')
        task = one_turn_task(name, "Save a note titled 'groceries' with eggs and milk.")
        (root / "tasks" / f"{'pages' if mode == 'pages' else 'flood'}.json").write_text(json.dumps(task))
    return root


def memory(pid: int) -> dict[str, float]:
    """A process's resident memory now (VmRSS) and at its peak (VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def peak_from_here(pid: int) -> float:
    """The process's resident memory now, after which its peak (VmHWM) counts from there: Linux
    resets it when told 5 in clear_refs. Where it can't, the peak so far stays, and the growth a
    test reads from it can only be smaller than it was."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    return memory(pid)["VmRSS"]


def test_an_env_whose_tool_listing_never_ends_fails_its_deploy_and_the_server_does_not_notice(
        tmp_path, greedy):
    """The pager lists five tools a page, each page with a new cursor, for ever. Its deploy fails
    at the 100th page, masked agentenv:env_failed with what it did and the fix, and the server's
    peak memory grows by a few MiB at most (it grew by 60 MiB a second, without end, when only
    each page had a deadline); a sibling rollout beside it scores 1.0."""
    with running(Server.serve(greedy, tmp_path, "--max-concurrent-envs", "4",
                              "--reset-timeout", "120")) as server:
        table = gym_rows(greedy)

        async def go():
            async with client() as http:
                sibling = await seeded(http, server.url, table["save-groceries"])
                assert (await sibling.call("list_notes")).text == "(no notes)"
                before = peak_from_here(server.pid)
                pager = await seeded(http, server.url, table["pages"])
                text, _ = answer(await pager.call("list_notes"))
                grew = memory(server.pid)["VmHWM"] - before
                sib = (await sibling.call("write_note", **GROCERIES)).text
                return text, grew, (await pager.verify()).json(), sib, (await sibling.verify()).json()

        text, grew, masked, sib, scored = run(go())
        endless = ("env 'pager' can't be played as it is: its tools/list gave a next cursor on page "
                   "100, the most agentenv.py reads (504 tools so far), so its pages may never end; "
                   "give none after the last page, or list more tools a page")
        assert text.startswith("error: the environment of this rollout failed, so list_notes did "
                               "not run") and endless in text, text
        assert_masked(masked, "agentenv:env_failed", endless)
        assert grew < 20, f"the server's peak grew by {grew:.1f} MiB"
        assert sib == "saved note 'groceries'"
        assert_scored(scored)
        server.no_envs()


def test_a_60_mib_tool_answer_is_the_models_tool_error_and_costs_the_server_little(tmp_path, greedy):
    """The flooder's tools answer 60 MiB (the model asked for it), one with its length said up
    front, two at once in chunks. The model reads a tool error saying the answer is past
    max_env_reply and to ask for less, its rollout goes on and scores 1.0 (never masked: the
    model's doing), a sibling's call beside them answers as usual, and the server's peak memory
    grows by far less than one answer (by 120 MiB for one, when it read up to 64 MiB of it)."""
    with running(Server.serve(greedy, tmp_path, "--max-concurrent-envs", "4")) as server:
        table = gym_rows(greedy)

        async def go():
            async with client() as http:
                sibling = await seeded(http, server.url, table["save-groceries"])
                flooded = await seeded(http, server.url, table["flood"])
                for rollout in (sibling, flooded):
                    assert (await rollout.call("list_notes")).text == "(no notes)"
                before = peak_from_here(server.pid)
                floods = [flooded.call(name) for name in ("flood", "flood_chunks", "flood_chunks")]
                texts = await asyncio.gather(*floods, sibling.call("write_note", **GROCERIES))
                grew = memory(server.pid)["VmHWM"] - before
                saved = (await flooded.call("write_note", **GROCERIES)).text
                return [t.text for t in texts], grew, saved, (await flooded.verify()).json(), \
                    (await sibling.verify()).json()

        (*floods, sib), grew, saved, flooded, scored = run(go())
        for text in floods:
            assert text == ("error: the answer is longer than the 2 MiB agentenv.py reads of an env's "
                            "answer (max_env_reply); ask the tool for less at a time"), text[:300]
        assert grew < 20, f"the server's peak grew by {grew:.1f} MiB for three 60 MiB answers"
        assert sib == saved == "saved note 'groceries'"
        assert_scored(flooded)                 # the model's doing: never masked
        assert_scored(scored)
        server.no_envs()
