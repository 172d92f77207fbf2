"""The warm pool in the Docker sandbox: envs started and ready ahead of demand, handed over at once.

What a user sees: a reset that finds a warm env is much faster than a cold deploy, the env handed
over still gets its episode's own set-up (apply_server_config), a warm container that died while it
waited is replaced (said in a log line) and the start goes on, ``/health`` counts the warm envs,
shutdown removes them, and a crash leaves them to the next start's sweep. With Docker a server
keeps a pool by default (as many as its episode slots, within a quarter of the host's memory),
says so at start with how to turn it off, and ``--warm 0`` (``warm=0`` to build_app, ``warm: 0`` in
a Gym config) does; the local sandbox keeps none by default, and says so. Needs a Docker daemon and
``python:3.11-slim`` (``bash .ci/docker-up.sh``); without them the tests skip, or fail with
AGENTENV_REQUIRE_DOCKER=1.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from aiohttp import web

from agentenv import (AUTO, WARM_PER_CORE, Bundle, DockerSandbox, LocalSandbox, RaySandbox,
                      Runtime, Settings, ToolResult, build_app, owner_id, warm_default)
from tests.harness import (NOTES, Server, client, copy_bundle, labelled, patch, remove_quietly,
                           request, resources_config, run, wait_until)

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


# ---------------------------------------------------------------- the default

DEFAULT_SAID = ("beside the {limit} episode slots: by default with the Docker sandbox, {why}, so a "
                "step's rollouts take envs already up instead of each waiting for a cold deploy; "
                "--warm 0 (warm=0 to build_app, warm: 0 in a Gym config) turns it off, --warm N "
                "sets it.")


def test_serve_with_docker_warms_its_slots_by_default_says_so_and_warm_0_turns_it_off(docker_client,
                                                                                    tmp_path):
    servers: list[Server] = []
    try:
        servers.append(default := Server.serve(NOTES, tmp_path / "default", "--max-concurrent-envs",
                                               "3", sandbox="docker"))
        servers.append(off := Server.serve(NOTES, tmp_path / "off", "--max-concurrent-envs", "3",
                                           "--warm", "0", sandbox="docker"))
        assert health_with_warm(default, 3) == {"status": "healthy", "episodes": 0,
                                                "warm": {"ready": 3, "booting": 0, "target": 3}}
        assert len(of_server(docker_client, default)) == 3
        said = [line for line in default.log().splitlines() if "warm env" in line]
        assert said == ["INFO agentenv: Keeping 3 warm env(s) started and ready ahead of demand "
                        "(notebook 3), " + DEFAULT_SAID.format(
                            limit=3, why="as many as the 3 episode slots")], said

        wait_until(lambda: off.healthy(), 60, "the server with --warm 0 answers")
        assert request(off.url + "/health", "GET").json() == {"status": "healthy"}
        assert "warm env" not in off.log()
        assert of_server(docker_client, off) == [], "--warm 0 starts nothing ahead of demand"
        for one in servers:
            assert one.stop() == 0
        assert of_server(docker_client, default) == []
    finally:
        for one in servers:
            if one.proc.poll() is None:
                one.kill()
            remove_quietly(of_server(docker_client, one))


async def app_health(app) -> dict:
    """build_app's app started on a loopback port: its /health once its warm pool (if any) is
    full, and the runtime's warm target."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/health"
        async with client() as http:
            deadline = time.monotonic() + 90
            while True:
                async with http.get(url) as reply:
                    health = await reply.json()
                warm = health.get("warm")
                if warm is None or (warm["ready"], warm["booting"]) == (warm["target"], 0):
                    return health
                assert time.monotonic() < deadline, health
                await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()


def test_build_app_warms_by_default_with_docker_and_warm_0_turns_it_off(docker_client, caplog):
    caplog.set_level(logging.INFO, "agentenv")
    default = run(app_health(build_app(NOTES, sandbox="docker", max_concurrent_envs=2)), 180)
    assert default == {"status": "healthy", "episodes": 0,
                       "warm": {"ready": 2, "booting": 0, "target": 2}}
    assert any(DEFAULT_SAID.format(limit=2, why="as many as the 2 episode slots") in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    assert run(app_health(build_app(NOTES, sandbox="docker", max_concurrent_envs=2, warm=0)),
               180) == {"status": "healthy"}
    assert not [r for r in caplog.records if "warm env" in r.getMessage()]
    assert run(app_health(build_app(NOTES, sandbox="docker", max_concurrent_envs=2, warm=AUTO)),
               180)["warm"]["target"] == 2
    assert containers_of(docker_client, owner_id()) == []


def test_the_local_sandbox_keeps_no_warm_envs_by_default_and_says_so(caplog):
    caplog.set_level(logging.INFO, "agentenv")
    assert run(app_health(build_app(NOTES, sandbox="local", max_concurrent_envs=2))) == \
        {"status": "healthy"}
    [said] = [r.getMessage() for r in caplog.records if "warm env" in r.getMessage()]
    assert said == ("Keeping no warm envs by default: the local sandbox gains too little from one "
                    "to keep it by default (--warm N, warm=N to build_app or warm: N in a Gym config "
                    "keeps N).")


def test_a_gym_config_warms_by_default_with_docker_and_warm_0_turns_it_off(docker_client, tmp_path):
    servers: list[Server] = []
    try:
        servers.append(default := Server.gym(tmp_path / "default", resources_config(
            "notes_v1", bundle=str(NOTES), sandbox="docker", max_concurrent_envs=2)))
        servers.append(off := Server.gym(tmp_path / "off", resources_config(
            "notes_v1", bundle=str(NOTES), sandbox="docker", max_concurrent_envs=2, warm=0)))
        assert health_with_warm(default, 2)["warm"]["target"] == 2
        assert DEFAULT_SAID.format(limit=2, why="as many as the 2 episode slots") in default.log()
        wait_until(lambda: off.healthy(), 60, "the server with warm: 0 answers")
        assert request(off.url + "/health", "GET").json() == {"status": "healthy"}
        assert of_server(docker_client, off) == [] and "warm env" not in off.log()
    finally:
        for one in servers:
            if one.proc.poll() is None:
                one.stop()
            remove_quietly(of_server(docker_client, one))


def test_the_default_is_bounded_by_a_quarter_of_the_hosts_memory(docker_client, tmp_path, caplog):
    """An env whose deploy_env asks for an eighth of the Docker host's memory: with 2 episode
    slots the pool's episodes may hold a quarter of it, and a quarter of the rest holds one warm
    env, not 2; the log says which bound set it."""
    caplog.set_level(logging.INFO, "agentenv")
    host_mib = docker_client.info()["MemTotal"] >> 20
    bundle = copy_bundle(tmp_path / "notes-v1")
    for task in (bundle / "tasks").glob("*.json"):
        patch(task, '"env_id": "notebook"\n  },', f'"env_id": "notebook",\n    "memory_mb": '
              f'{host_mib // 8}\n  }},')
    health = run(app_health(build_app(bundle, sandbox="docker", max_concurrent_envs=2)), 180)
    assert health["warm"]["target"] == 1, health
    assert any("as many as a quarter of the Docker host's" in r.getMessage() and
               f"at {host_mib // 8} MiB an env" in r.getMessage() for r in caplog.records)
    assert containers_of(docker_client, owner_id()) == []


@pytest.mark.parametrize("limit", [1, 2, 8, 32, 64, 256, 1024])
@pytest.mark.parametrize("machine_gib", [None, 1, 4, 24, 384])
@pytest.mark.parametrize("cores", [1, 2, 48])
def test_the_default_never_exceeds_the_pool_the_memory_or_the_cores(limit, machine_gib, cores):
    for episode_mib, env_mib in ((0, 64), (2048, 64), (0, 4096)):
        count, why = warm_default(DockerSandbox, limit, machine_gib and machine_gib << 30,
                                  episode_mib, env_mib, cores)
        assert 0 <= count <= limit and count <= WARM_PER_CORE * cores, (count, why)
        if machine_gib:
            assert count * env_mib <= (max(0, (machine_gib << 10) - episode_mib * limit)) / 4, why
        assert why
    assert warm_default(LocalSandbox, limit, 24 << 30, 0, 64, cores)[0] == 0
    assert warm_default(RaySandbox, limit, 24 << 30, 0, 64, cores)[0] == 0


def test_warm_is_auto_unless_given_and_0_is_given():
    assert Settings().warm == AUTO and Settings.of().warm == AUTO
    assert Settings.of(warm=0).warm == 0 and Settings.of(warm="auto").warm == AUTO
    assert Settings.from_config({"warm": 0}, "x.yaml").warm == 0
    assert Settings.from_config({}, "x.yaml").warm == AUTO
    assert "warm" not in Settings().gym_config(bundle=True)
    assert Settings.of(warm=0).gym_config(bundle=True)["warm"] == 0
