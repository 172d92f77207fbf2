"""Network isolation in the Docker sandbox: what an env's container can reach, and what not.

Every test uses only containers it made and loopback: a listener container stands in for "another
episode's env" or for "somewhere outside" (a container on Docker's default bridge, reached through
the host's routing, as the internet would be), and another container tries to connect to it. No
packet is sent to any address outside this machine. Needs a Docker daemon and ``python:3.11-slim``
(``bash .ci/docker-up.sh``); without them the tests skip, or fail with AGENTENV_REQUIRE_DOCKER=1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest


import agentenv
from agentenv import Bundle, Runtime, owner_id
from tests.harness import (LoopbackNamespace, NOTES, NamespaceUnavailable, REPO, Socket,
                           copy_bundle, docker_unavailable, environ, labelled, remove_quietly, run)

SESSION_LABEL = "agentenv-tests.session"
SESSION = uuid.uuid4().hex
IMAGE = "python:3.11-slim"
LISTEN = ("import http.server, socketserver; socketserver.TCPServer.allow_reuse_address = True; "
          "http.server.HTTPServer(('0.0.0.0', 8080), http.server.SimpleHTTPRequestHandler)"
          ".serve_forever()")
CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()\n"
           "    print('connected')\n"
           "except OSError as exc:\n"
           "    print('refused', type(exc).__name__, exc)\n")


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind(docker_client):
    """After the module: no container nor network of this process, or made by hand here, exists."""
    yield
    mine = owner_id()
    left = [c for c in labelled(docker_client, "agentenv.owner")
            if c.labels.get("agentenv.owner") == mine] + labelled(docker_client,
                                                                 f"{SESSION_LABEL}={SESSION}")
    remove_quietly(left)
    networks = [n for n in docker_client.networks.list(filters={"label": "agentenv.owner"})
                if (n.attrs.get("Labels") or {}).get("agentenv.owner") == mine]
    for network in networks:
        network.remove()
    assert not left and not networks, (f"left behind (now removed): containers "
                                       f"{[c.short_id for c in left]}, networks "
                                       f"{[n.name for n in networks]}")


def plain(client, *, network: str | None = None, command: list[str] | None = None):
    """A plain container of ours (python:3.11-slim), running until removed."""
    container = client.containers.run(
        IMAGE, command or ["python", "-c", LISTEN], detach=True, network=network,
        labels={SESSION_LABEL: SESSION}, stop_signal="SIGKILL")
    container.reload()
    return container


def address(container, network: str | None = None) -> str:
    container.reload()
    networks = container.attrs["NetworkSettings"]["Networks"]
    return networks[network or next(iter(networks))]["IPAddress"]


def connects(client_container, host: str, port: int = 8080) -> str:
    """What a connection from inside ``client_container`` to host:port gives: connected/refused."""
    code, out = client_container.exec_run(["python", "-c", CONNECT, host, str(port)])
    return out.decode().strip()


def listening(container, port: int = 8080, within: float = 15) -> None:
    """Wait until the listener answers from inside its own container."""
    deadline = time.monotonic() + within
    while connects(container, "127.0.0.1", port) != "connected":
        assert time.monotonic() < deadline, f"the listener did not listen:\n{container.logs()}"
        time.sleep(0.1)


def env_container(client, episode):
    [container] = labelled(client, f"agentenv.episode={episode.id}")
    return container


def with_bridge(tmp_path: Path) -> Path:
    """notes-v1 whose notebook says in its env.toml that its task needs the network."""
    root = copy_bundle(tmp_path / "notes-v1")
    (root / "envs" / "notebook" / "env.toml").write_text('network = "bridge"\n')
    return root


# ---------------------------------------------------------------- one episode's env vs another's

def test_an_env_can_not_reach_another_episodes_env_but_the_server_reaches_both(docker_client):
    async def scenario():
        async with Runtime(Bundle.load(NOTES), agentenv.Settings.of(sandbox="docker")) as runtime:
            sandbox = runtime.sandbox
            network = docker_client.networks.get(sandbox.network_name())
            options = network.attrs["Options"]
            assert options["com.docker.network.bridge.enable_icc"] == "false"
            assert options["com.docker.network.bridge.enable_ip_masquerade"] == "false"
            assert network.attrs["Labels"]["agentenv.owner"] == runtime.owner
            task = runtime.bundle.tasks["save-groceries"]
            first, second = runtime.episode(task), runtime.episode(task)
            # the server reached each env at its address on the envs' network (the host's
            # bridge): each listed its tools
            for episode in (first, second):
                turn = await episode.next_turn()
                assert "write_note" in {t["name"] for t in turn.tools}
            one, other = env_container(docker_client, first), env_container(docker_client, second)
            for episode, container in ((first, one), (second, other)):
                assert episode.envs["notebook"].instance.base_url == \
                    f"http://{address(container)}:{agentenv.ENV_PORT}"
            assert list(one.attrs["NetworkSettings"]["Networks"]) == [sandbox.network_name()]
            # each env answers itself inside its container, and no other can reach it
            port = agentenv.ENV_PORT
            assert await asyncio.to_thread(connects, one, "127.0.0.1", port) == "connected"
            said = await asyncio.to_thread(connects, other, address(one), port)
            assert said.startswith("refused"), f"an env reached another episode's env: {said}"
            for episode in (first, second):
                await episode.abandon("the test is done")
            return sandbox.network_name()
    name = run(scenario(), timeout=120)
    assert not docker_client.networks.list(names=[name]), "the envs' network outlived the server"


# ---------------------------------------------------------------- egress, and the opt-in bridge

def test_an_isolated_env_has_no_egress_and_one_marked_for_the_network_gets_the_bridge(
        docker_client, tmp_path):
    # Somewhere outside the env's network, reached only through the host's routing, as the
    # internet would be: a container of ours on Docker's default bridge.
    outside = plain(docker_client)
    listening(outside)
    bridged = Bundle.load(with_bridge(tmp_path))
    assert bridged.envs["notebook"].network == "bridge"
    try:
        async def reach(bundle: Bundle) -> tuple[str, list[str], str]:
            async with Runtime(bundle, agentenv.Settings.of(sandbox="docker")) as runtime:
                episode = runtime.episode(bundle.tasks["save-groceries"])
                await episode.next_turn()
                container = env_container(docker_client, episode)
                said = await asyncio.to_thread(connects, container, address(outside))
                await episode.abandon("the test is done")
                return (said, list(container.attrs["NetworkSettings"]["Networks"]),
                        runtime.sandbox.network_name())
        said, networks, ours = run(reach(Bundle.load(NOTES)), timeout=120)
        assert said.startswith("refused"), f"an isolated env reached outside its network: {said}"
        assert networks == [ours]
        said, networks, _ = run(reach(bridged), timeout=180)
        assert networks == ["bridge"]
        assert said == "connected", f"the env marked network = \"bridge\" could not reach out: {said}"
    finally:
        remove_quietly([outside])
        tag = f"agentenv/notebook:{bridged.envs['notebook'].digest}"
        if tag != f"agentenv/notebook:{Bundle.load(NOTES).envs['notebook'].digest}":
            docker_client.images.remove(tag, force=True)


# ---------------------------------------------------------------- a network of one episode alone

def test_the_containers_of_one_episode_share_its_network_and_no_other_episode_reaches_them(
        docker_client):
    async def scenario():
        sandbox = await agentenv.DockerSandbox.connect(owner_id(), agentenv.Settings())
        made = []
        try:
            ours = await sandbox.episode_network("episode-a")
            assert await sandbox.episode_network("episode-a") == ours, "one network per episode"
            theirs = await sandbox.episode_network("episode-b")
            assert ours != theirs
            labels = docker_client.networks.get(ours).attrs["Labels"]
            assert labels == {"agentenv.owner": sandbox.owner, "agentenv.episode": "episode-a"}
            listener = await asyncio.to_thread(plain, docker_client, network=ours)
            sibling = await asyncio.to_thread(plain, docker_client, network=ours)
            stranger = await asyncio.to_thread(plain, docker_client, network=theirs)
            made += [listener, sibling, stranger]
            await asyncio.to_thread(listening, listener)
            here = address(listener, ours)
            assert await asyncio.to_thread(connects, sibling, here) == "connected"
            said = await asyncio.to_thread(connects, stranger, here)
            assert said.startswith("refused"), f"another episode's container reached in: {said}"
            await asyncio.to_thread(remove_quietly, made)
            await sandbox.end_episode("episode-a")
            assert not docker_client.networks.list(names=[ours]), "the episode's network stayed"
            assert docker_client.networks.list(names=[theirs]), "another episode's went with it"
        finally:
            await asyncio.to_thread(remove_quietly, made)
            await sandbox.close()
        assert not docker_client.networks.list(names=[theirs]), "close left a network"
    run(scenario(), timeout=120)


def test_networks_a_crashed_server_left_are_swept_at_start(docker_client):
    dead = f"{socket.gethostname()}:999999999:1"      # a pid no process has
    left = docker_client.networks.create(f"agentenv-test-{SESSION[:8]}", driver="bridge",
                                         labels={"agentenv.owner": dead, "agentenv.episode": "x"})
    try:
        async def scenario():
            sandbox = await agentenv.DockerSandbox.connect(owner_id(), agentenv.Settings())
            await sandbox.daemon.sweep()
            await sandbox.close()
        run(scenario())
        assert not docker_client.networks.list(names=[left.name]), "a stale network was not swept"
    finally:
        if docker_client.networks.list(names=[left.name]):
            left.remove()


def test_check_prints_each_envs_network(docker_client, tmp_path, capsys):
    root = with_bridge(tmp_path)
    (root / "envs" / "second").mkdir()
    for name in ("Dockerfile", "server.py"):
        (root / "envs" / "second" / name).write_bytes((NOTES / "envs" / "notebook" / name).read_bytes())
    bundle = Bundle.load(root)
    try:
        lines: list[str] = []
        run(agentenv.check(str(root), agentenv.Settings.of(sandbox="docker"), None, out=lines.append),
            timeout=240)
        at = lines.index("networks:")
        assert lines[at + 1].startswith("  notebook: bridge: Docker's default bridge, with egress")
        assert lines[at + 2].startswith("  second: isolated: on agentenv-")
        assert "no egress" in lines[at + 2]
    finally:
        for env in bundle.envs.values():
            tag = f"agentenv/{env.name}:{env.digest}"
            if tag != f"agentenv/notebook:{Bundle.load(NOTES).envs['notebook'].digest}":
                with contextlib.suppress(Exception):
                    docker_client.images.remove(tag, force=True)


def test_why_not_an_internal_network_docker_publishes_no_port_on_one(docker_client):
    """The design's premise: on an ``internal`` network (which would drop egress outright) Docker
    publishes no port, so the server could not reach an env on 127.0.0.1; hence a network of our
    own with icc and masquerading off. Should a Docker publish ports there, this fails, and the
    envs' network can become internal."""
    name = f"agentenv-test-internal-{SESSION[:8]}"
    network = docker_client.networks.create(name, driver="bridge", internal=True,
                                            labels={SESSION_LABEL: SESSION})
    container = None
    try:
        container = docker_client.containers.run(
            IMAGE, ["python", "-c", LISTEN], detach=True, network=name,
            ports={"8080/tcp": ("127.0.0.1", None)}, labels={SESSION_LABEL: SESSION})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            container.reload()
            if container.attrs["NetworkSettings"]["Ports"]:
                break
            time.sleep(0.1)
        assert not container.attrs["NetworkSettings"]["Ports"], \
            "Docker published a port on an internal network"
    finally:
        if container is not None:
            remove_quietly([container])
        network.remove()


# ---------------------------------------------------------------- envs reached from where calls come from

def recall_played(port: int) -> float:
    """In the namespace: wait for serve at ``port`` to answer, then play recall-recipe over /ws
    as a trainer does (a tool call, the reply); its reward."""
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "serve did not answer within 90s"
            time.sleep(0.1)
    with Socket(f"ws://127.0.0.1:{port}/ws") as ws:
        ws.ask({"type": "reset", "data": {"split": "all", "index": 0}}, 90)
        listed = ws.ask({"type": "step", "data": {"type": "call_tool", "tool_name": "list_notes",
                                                  "arguments": {}}})
        assert listed["data"]["observation"]["result"]["data"] == "pancakes", listed
        ended = ws.ask({"type": "step", "data": {"type": "call_tool", "tool_name": "end_turn",
                                                 "arguments": {"response": "2"}}})
        return ended["data"]["reward"]


def probes_of(docker_client, pids: set[int]) -> list:
    """The reachability probes that the servers ``pids`` started and left."""
    return [c for c in labelled(docker_client, "agentenv.episode=(probe)")
            if int(c.labels["agentenv.owner"].split(":")[1]) in pids]


def test_a_daemon_not_known_to_share_this_network_is_probed_and_its_envs_found_reachable(
        docker_client, monkeypatch):
    """Where the daemon's pid file can't tell (another user's daemon, a socket mounted from
    elsewhere), a probe container decides: here it answers, so the sandbox connects, within
    seconds, and the probe is gone."""
    monkeypatch.setattr(agentenv, "daemon_shares_network", lambda: False)

    async def go():
        started = time.monotonic()
        sandbox = await agentenv.DockerSandbox.connect(owner_id(), agentenv.Settings())
        took = time.monotonic() - started
        await sandbox.close()
        return took
    took = run(go())
    assert took < 30, f"the probe took {took:.1f}s"
    assert probes_of(docker_client, {os.getpid()}) == []


def test_from_a_namespace_that_cant_reach_the_daemons_ports_docker_refuses_and_auto_serves_locally(
        docker_client, tmp_path):
    """The host's Docker socket, seen from a loopback-only network namespace (as a Ray node in a
    namespace of its own sees it): the daemon answers, but publishes its containers' ports in the
    host's namespace, which this one can't reach. ``serve --sandbox docker`` refuses within
    seconds, naming the address it dialled, where the daemon published and the fixes; ``serve``
    (auto) says why its envs are local processes instead, and plays."""
    try:
        namespace = LoopbackNamespace()
    except NamespaceUnavailable as exc:
        docker_unavailable(f"no loopback-only network namespace can be made here ({exc}): this "
                           "test serves from one; run the tests as root where unshare --net works")
    port = 18000                                   # the namespace is fresh: nothing holds a port
    serve = [sys.executable, str(REPO / "agentenv.py"), "serve", str(NOTES), "--port", str(port)]
    with namespace:
        started = time.monotonic()
        refusing = subprocess.Popen(namespace.argv([*serve, "--sandbox", "docker"]),
                                    env=environ(tmp_path / "docker"), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        _, said = refusing.communicate(timeout=120)
        took = time.monotonic() - started
        assert refusing.returncode == 1, said
        assert re.search(r"the Docker daemon at (the default socket|\S+) answers, but its envs can't be reached "
                         r"from here: it published a probe container's port on 127\.0\.0\.1:(\d+) "
                         r"of its own machine, and dialling 127\.0\.0\.1:\2 from here gave "
                         r"connection refused within 10s", said), said
        assert said.rstrip().endswith("pass --docker-publish with an address of the daemon's "
                                      "machine that this server reaches (for a daemon elsewhere, "
                                      "DOCKER_HOST's host is the default), or --sandbox local"), said
        assert took < 60, f"the refusal took {took:.1f}s"

        log = tmp_path / "auto.log"
        with open(log, "w") as out:
            auto = subprocess.Popen(namespace.argv(serve), env=environ(tmp_path / "auto"),
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            reward = namespace.call(recall_played, port)
        finally:
            auto.terminate()
            auto.wait(60)
        text = log.read_text()
        assert reward == 1.0, text
        assert auto.returncode == 0, text
        assert "Envs run in the local sandbox (local processes, isolated from nothing), since " \
               "the Docker daemon at the default socket answers, but its envs can't be reached " \
               "from here" in text, text
        assert "envs in the local sandbox" in text, text
    assert probes_of(docker_client, {refusing.pid, auto.pid}) == [], "a probe container was left"
