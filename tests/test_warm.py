"""The warm pool in the Docker sandbox: envs started and ready ahead of demand, handed over at once.

What a user sees: a reset that finds a warm env is much faster than a cold deploy, the env handed
over still gets its episode's own set-up (apply_server_config), a warm container that died while it
waited is replaced (said in a log line) and the start goes on, ``/health`` counts the warm envs,
shutdown removes them, and a crash leaves them to the next start's sweep. Needs a Docker daemon and
``python:3.11-slim`` (``bash .ci/docker-up.sh``); without them the tests skip, or fail with
AGENTENV_REQUIRE_DOCKER=1.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest


from agentenv import Bundle, Runtime, Settings, ToolResult, owner_id
from tests.harness import NOTES, Server, labelled, remove_quietly, request, run, wait_until

KEY = ("notebook", ())             # notes-v1's one env spec: the notebook, no limits


def containers_of(client, owner: str) -> list:
    return labelled(client, f"agentenv.owner={owner}")


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind(docker_client):
    yield
    left = containers_of(docker_client, owner_id())
    remove_quietly(left)
    assert not left, f"the warm tests left {len(left)} container(s) behind (now removed)"


async def warm_ready(rt: Runtime, ready: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (rt.warm.counts["ready"], rt.warm.counts["booting"]) != (ready, 0):
        assert time.monotonic() < deadline, f"the warm pool is at {rt.warm.counts}"
        await asyncio.sleep(0.05)


async def recall(rt: Runtime) -> tuple[float, float]:
    """Play recall-recipe correctly: (seconds from the start to its first turn, its reward)."""
    started = time.monotonic()
    ep = rt.episode(rt.bundle.tasks["recall-recipe"])
    turn = await ep.next_turn()
    took = time.monotonic() - started
    # the task's preload (apply_server_config) reached this episode's env, warm or not
    assert await turn.call("read_note", {"title": "pancakes"}) == \
        ToolResult("2 eggs, 1 cup milk, 1 cup flour")
    turn.end("2")
    return took, (await ep.result()).reward


def test_a_warm_env_is_handed_over_much_faster_than_a_cold_deploy(docker_client):
    async def scenario():
        async with Runtime(Bundle.load(NOTES), Settings.of(sandbox="docker", warm=1)) as rt:
            await warm_ready(rt, 1)
            [waiting] = rt.warm.ready[KEY]
            container = waiting.instance.container
            labels = container.labels
            assert labels["agentenv.owner"] == rt.owner and labels["agentenv.env"] == "notebook"
            assert labels["agentenv.episode"].startswith("warm-")
            assert list(container.attrs["NetworkSettings"]["Networks"]) == [rt.sandbox.network_name()]
            warm = await recall(rt)
            assert rt.warm.counts["ready"] == 0       # its replacement is booting: the next is cold
            cold = await recall(rt)
            await warm_ready(rt, 1)
        return warm, cold

    (warm, warm_reward), (cold, cold_reward) = run(scenario(), timeout=180)
    assert warm_reward == cold_reward == 1.0
    assert warm < cold / 3, f"a warm start took {warm:.3f}s, a cold one {cold:.3f}s"


def test_a_warm_container_killed_while_it_waited_is_replaced_and_the_start_goes_on(docker_client,
                                                                                 caplog):
    caplog.set_level(logging.INFO, "agentenv")

    async def scenario():
        async with Runtime(Bundle.load(NOTES), Settings.of(sandbox="docker", warm=2)) as rt:
            await warm_ready(rt, 2)
            dead, alive = (w.instance.container for w in rt.warm.ready[KEY])
            await asyncio.to_thread(dead.kill)
            took, reward = await recall(rt)          # the dead one first: discarded, the next taken
            await warm_ready(rt, 2)
            now = {w.instance.container.id for w in rt.warm.ready[KEY]}
            assert dead.id not in now and alive.id not in now, "the alive one went to the episode"
            return reward, [c.id for c in containers_of(docker_client, rt.owner)]

    reward, at_close = run(scenario(), timeout=180)
    assert reward == 1.0
    said = [r.getMessage() for r in caplog.records if "died while it waited" in r.getMessage()]
    assert said and said[0].startswith("A warm env of 'notebook' died while it waited (its "
                                       "container exited with code 137); it is discarded"), said
    assert len(at_close) == 2, "two warm envs, and no more, while the runtime was up"
    assert containers_of(docker_client, owner_id()) == [], "close removed the warm envs"


def health_with_warm(server: Server, ready: int) -> dict:
    """The server's /health, once it counts ``ready`` warm envs ready."""
    def answer() -> dict | None:
        health = request(server.url + "/health", "GET").json()
        return health if health.get("warm", {}).get("ready") == ready else None
    return wait_until(answer, 90, f"{ready} warm env(s) ready")


def of_server(client, server: Server) -> list:
    """The containers a server (a subprocess of ours) labelled as their owner."""
    return [c for c in labelled(client, "agentenv.owner")
            if c.labels["agentenv.owner"].split(":")[1] == str(server.pid)]


def test_serve_counts_warm_envs_in_health_removes_them_at_shutdown_and_a_crash_leaves_them_to_the_sweep(
        docker_client, tmp_path):
    servers: list[Server] = []
    try:
        servers.append(server := Server.serve(NOTES, tmp_path / "one", "--warm", "2",
                                              "--max-concurrent-envs", "1", sandbox="docker"))
        assert health_with_warm(server, 2) == {"status": "healthy", "episodes": 0,
                                               "warm": {"ready": 2, "booting": 0, "target": 2}}
        assert len(of_server(docker_client, server)) == 2
        assert "Keeping 2 warm env(s) started and ready ahead of demand (notebook 2), beside the 1 " \
               "episode slots." in server.log()
        assert server.stop() == 0
        assert "removing 2 warm env(s)" in server.log()
        assert of_server(docker_client, server) == [], "shutdown removes the warm envs"

        servers.append(crashed := Server.serve(NOTES, tmp_path / "two", "--warm", "1",
                                               sandbox="docker"))
        health_with_warm(crashed, 1)
        crashed.kill()
        [left] = of_server(docker_client, crashed)      # a killed server leaves its warm env running

        async def next_start():
            async with Runtime(Bundle.load(NOTES), Settings.of(sandbox="docker")):
                return await asyncio.to_thread(of_server, docker_client, crashed)
        assert run(next_start()) == [], "the next start sweeps a crashed server's warm envs"
    finally:
        for one in servers:
            if one.proc.poll() is None:
                one.kill()
            remove_quietly(of_server(docker_client, one))
