"""Docker integration tests: notes-v1 episodes played in real containers on the local daemon.

Each test plays what a user does (open a Runtime with ``sandbox="docker"``, play episodes, abandon
them, kill the server) and checks what the user sees: rewards, failures and their reasons, and the
containers left (or not) on the daemon. They need a Docker daemon and a local ``python:3.11-slim``
image (``bash .ci/docker-up.sh``); without them they skip, or fail with AGENTENV_REQUIRE_DOCKER=1.

Async code runs with ``asyncio.run`` per test (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest


import agentenv
from agentenv import Bundle, EpisodeFailed, Runtime, ToolResult, owner_id
from tests.harness import (NOTES, REPO, Gym, Server, client, copy_bundle, gym_row, labelled,
                           remove_quietly, run, running, scrape)

ENV_PORT = f"{agentenv.ENV_PORT}/tcp"

# Containers this session makes by hand carry this label, so the leak check at the end finds them.
SESSION_LABEL = "agentenv-tests.session"
SESSION = uuid.uuid4().hex
# Owners (besides this process) under which this session had containers made: the killed child.
OTHER_OWNERS: set[str] = set()


# ---------------------------------------------------------------- helpers

def episode_containers(client, episode_id: str) -> list:
    return labelled(client, f"agentenv.episode={episode_id}")


def owned_containers(client, owner: str) -> list:
    return labelled(client, f"agentenv.owner={owner}")


async def wait_no_episode_container(client, episode_id: str, timeout: float = 10) -> None:
    """Wait until no container of the episode exists; fail naming the ones that stay."""
    deadline = time.monotonic() + timeout
    while left := await asyncio.to_thread(episode_containers, client, episode_id):
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(left)} container(s) of episode {episode_id} still exist "
                                 f"{timeout:g}s later: {[(c.short_id, c.status) for c in left]}")
        await asyncio.sleep(0.1)


def copy_notes(tmp_path: Path) -> Path:
    """A private copy of notes-v1 to change (same folder name, so the same bundle name)."""
    return copy_bundle(tmp_path / "bundle" / "notes-v1")


def notes_tag() -> str:
    """The image tag of the example bundle's env, as DockerSandbox names it."""
    return f"agentenv/notebook:{Bundle.load(NOTES).envs['notebook'].digest}"


@pytest.fixture
def built_images(docker_client):
    """Tags of images a test built from a changed copy of the bundle: removed afterwards (never
    the image of notes-v1 itself, which other tests and sessions share)."""
    tags: list[str] = []
    yield tags
    keep = notes_tag()
    for tag in tags:
        if tag != keep:
            with contextlib.suppress(Exception):
                docker_client.images.remove(tag, force=True)


@pytest.fixture(scope="module", autouse=True)
def no_container_left_behind(docker_client):
    """After every test of this module: no container this session created still exists."""
    yield
    mine = {owner_id()} | OTHER_OWNERS
    left = [c for c in labelled(docker_client, "agentenv.owner")
            if c.labels.get("agentenv.owner") in mine or c.labels.get(SESSION_LABEL) == SESSION]
    remove_quietly(left)
    assert not left, (f"the Docker tests left {len(left)} container(s) behind (now removed): "
                      f"{[(c.short_id, c.labels) for c in left]}")


# The correct and the wrong play of each notes-v1 task, as a trained model would make them.

async def play(ep, task: str, correct: bool, client) -> agentenv.Outcome:
    turn = await ep.next_turn()
    assert {t["name"] for t in turn.tools} == {"write_note", "read_note", "list_notes"}, \
        "dump_notes is hidden, so the agent isn't offered it"
    # The episode really runs in a container of the daemon, and it is running.
    [container] = await asyncio.to_thread(episode_containers, client, ep.id)
    assert container.status == "running"
    assert [i.container.id for i in ep.instances] == [container.id]

    if task == "save-groceries":
        assert "groceries" in turn.prompt
        text = "eggs, milk" if correct else "bread, butter"
        assert await turn.call("write_note", {"title": "groceries", "text": text}) == \
            ToolResult("saved note 'groceries'")
        turn.end("Saved your groceries note.")
    elif task == "recall-recipe":
        # the preload (apply_server_config) reached the env in the container
        assert await turn.call("read_note", {"title": "pancakes"}) == \
            ToolResult("2 eggs, 1 cup milk, 1 cup flour")
        turn.end("2" if correct else "3")
    elif task == "two-step":
        assert await turn.call("list_notes", {}) == ToolResult("pancakes")
        turn.end("You have one note: pancakes.")
        turn2 = await ep.next_turn()
        assert turn2 is not turn and "groceries" in turn2.prompt
        text = "2 eggs, 1 cup milk, 1 cup flour" if correct else "1 cup flour"
        assert await turn2.call("write_note", {"title": "groceries", "text": text}) == \
            ToolResult("saved note 'groceries'")
        turn2.end("Saved.")
    else:
        raise AssertionError(f"no play for task {task}")
    assert await ep.next_turn() is None, "the task has no more turns"
    return await ep.result()


# ---------------------------------------------------------------- 1. full episodes

@pytest.mark.parametrize("task, scoring_step", [("save-groceries", "check"),
                                                ("recall-recipe", "answer"),
                                                ("two-step", "check")])
def test_episode_in_container_scores_and_leaves_nothing(docker_client, task, scoring_step):
    bundle = Bundle.load(NOTES)

    async def go():
        async with Runtime(bundle, agentenv.Settings.of(sandbox="docker", max_concurrent_envs=8, deploy_timeout=180)) as rt:
            assert rt.sandbox.kind == "docker" and rt.sandbox.owner == owner_id()
            for correct, reward in ((True, 1.0), (False, 0.0)):
                ep = rt.episode(bundle.tasks[task])
                outcome = await play(ep, task, correct, docker_client)
                assert (outcome.status, outcome.reward, outcome.failure) == ("scored", reward, None), \
                    f"{'correct' if correct else 'wrong'} play of {task}: {outcome}"
                assert outcome.scores == {scoring_step: reward}
                async with asyncio.timeout(30):
                    await ep.closed.wait()
                assert await asyncio.to_thread(episode_containers, docker_client, ep.id) == [], \
                    "an episode's container is removed once it is torn down"
        return rt.sandbox.owner

    owner = run(go())
    assert owned_containers(docker_client, owner) == [], "no container of the runtime outlives it"


# ---------------------------------------------------------------- 2. container settings

LIMITED_TASK = [
    {"id": "env", "type": "deploy_env", "env_id": "notebook", "cpu": 0.5, "memory_mb": 128},
    {"id": "agent", "type": "deploy_agent", "agent_name": "writer", "env_ids": ["notebook"]},
    {"id": "turn1", "type": "prompt_agent", "agent_name": "writer", "prompt_id": "turn1",
     "prompt": "Save a note titled 'groceries' that lists eggs and milk."},
    {"id": "check", "type": "env_outcome_verifier", "env_id": "notebook",
     "file_artifact_id": "check_notes", "score_aggregator": "all_pass"},
]


def test_container_settings_and_limits(docker_client, tmp_path):
    root = copy_notes(tmp_path)
    (root / "tasks" / "limited.json").write_text(json.dumps(LIMITED_TASK, indent=2))
    bundle = Bundle.load(root)

    async def inspect(ep) -> dict:
        turn = await ep.next_turn()
        [instance] = ep.instances
        assert isinstance(instance, agentenv.DockerInstance)
        await asyncio.to_thread(instance.container.reload)
        attrs = instance.container.attrs
        uid = await asyncio.to_thread(instance.container.exec_run,
                                      ["python", "-c", "import os; print(os.getuid(), os.geteuid())"])
        caps = await asyncio.to_thread(  # the env server's own effective capabilities
            instance.container.exec_run,
            ["python", "-c", "print(*[l for l in open('/proc/1/status') if l.startswith('CapEff')])"])
        assert await turn.call("write_note", {"title": "groceries", "text": "eggs and milk"}) == \
            ToolResult("saved note 'groceries'")
        turn.end("done")
        assert (await ep.result()).reward == 1.0
        return {"attrs": attrs, "uid": uid, "caps": caps, "base_url": instance.base_url}

    async def go():
        async with Runtime(bundle, agentenv.Settings.of(sandbox="docker")) as rt:
            plain = rt.episode(bundle.tasks["save-groceries"])
            limited = rt.episode(bundle.tasks["limited"])
            seen = await asyncio.gather(inspect(plain), inspect(limited))
            return rt.sandbox.owner, plain.id, seen

    owner, plain_id, (plain, limited) = run(go())
    host = plain["attrs"]["HostConfig"]
    # this host's daemon: nothing published (no port proxy relaying each call), the env dialled
    # at its own address on its network
    assert not host.get("PortBindings") and not host.get("PublishAllPorts")
    assert not plain["attrs"]["NetworkSettings"]["Ports"]
    [network] = plain["attrs"]["NetworkSettings"]["Networks"].values()
    assert plain["base_url"] == f"http://{network['IPAddress']}:{agentenv.ENV_PORT}"
    # labelled for the sweep, and for the user
    labels = plain["attrs"]["Config"]["Labels"]
    assert labels["agentenv.owner"] == owner == owner_id()
    assert labels["agentenv.episode"] == plain_id
    assert labels["agentenv.env"] == "notebook"
    # confined: no new privileges, the Dockerfile's USER 10001, not privileged
    assert "no-new-privileges" in (host.get("SecurityOpt") or [])
    assert host.get("Privileged") is False
    # no capabilities at all, no host mounts, a bound on processes (a fork bomb stays inside)
    assert host.get("CapDrop") == ["ALL"] and not host.get("CapAdd")
    assert not host.get("Binds") and not plain["attrs"].get("Mounts")
    assert host.get("PidsLimit") == agentenv.DOCKER_PIDS_LIMIT
    assert plain["caps"].exit_code == 0 and plain["caps"].output.decode().split() == \
        ["CapEff:", "0000000000000000"]
    assert plain["attrs"]["Config"]["User"] == "10001"
    assert plain["uid"].exit_code == 0 and plain["uid"].output.decode().split() == ["10001", "10001"]
    # no limit unless the deploy_env step asks for one; then its cpu and memory_mb
    assert (host.get("NanoCpus") or 0, host.get("Memory") or 0) == (0, 0)
    limits = limited["attrs"]["HostConfig"]
    assert limits["NanoCpus"] == 500_000_000
    assert limits["Memory"] == 128 * 1024 * 1024
    assert owned_containers(docker_client, owner) == []


def test_a_sandbox_told_an_address_publishes_its_envs_there_only(docker_client):
    """The Docker sandbox a Ray node's host opens is told the node's address (here 127.0.0.2):
    an env's port is published on that address alone, and the env answers there, not on
    127.0.0.1."""
    bundle = Bundle.load(NOTES)
    env = bundle.envs["notebook"]

    async def go():
        sandbox = await agentenv.DockerSandbox.reached(owner_id(), publish="127.0.0.2")
        try:
            await sandbox.prepare([env])
            instance = await sandbox.launch(env, "published-on-127-0-0-2", {})
            try:
                deadline = time.monotonic() + 60
                while not await agentenv.http_answers(instance.base_url):
                    assert time.monotonic() < deadline, await instance.output()
                    await asyncio.sleep(0.1)
                port = instance.base_url.rsplit(":", 1)[1]
                elsewhere = await agentenv.http_answers(f"http://127.0.0.1:{port}")
                await asyncio.to_thread(instance.container.reload)
                return instance.base_url, instance.container.attrs, elsewhere
            finally:
                await instance.remove()
        finally:
            await sandbox.close()

    base_url, attrs, elsewhere = run(go())
    assert attrs["HostConfig"]["PortBindings"] == {ENV_PORT: [{"HostIp": "127.0.0.2", "HostPort": ""}]}
    published = attrs["NetworkSettings"]["Ports"][ENV_PORT]
    assert base_url == f"http://127.0.0.2:{published[0]['HostPort']}"
    assert not elsewhere, "the env answered on 127.0.0.1 too"
    assert owned_containers(docker_client, owner_id()) == []

def test_an_env_containers_death_is_told_at_once_even_across_a_broken_event_stream(docker_client):
    """A daemon in the server's network namespace: envs are dialled at addresses the server gives
    them, and a container's death is learnt from Docker's event stream. The stream breaks (as
    when the daemon restarts): it is read again from where it stopped, so a container killed
    while it was down is told once it is back, and one killed after, at once; a container the
    server removes itself is never told as a death. A dead env's address is not given to the
    next env (the daemon would give it at once) while the dead one is not yet removed."""
    bundle = Bundle.load(NOTES)
    env = bundle.envs["notebook"]

    async def go():
        sandbox = await agentenv.DockerSandbox.reached(owner_id())
        instances = []
        try:
            assert sandbox.direct and sandbox.deaths is not None
            await sandbox.prepare([env])
            for n in range(3):
                instances.append(await sandbox.launch(env, f"death-told-{n}", {}))
            killed, later, removed = instances
            assert all(i.stopped is not None and not i.stopped.done() for i in instances)
            broken = sandbox.deaths.stream
            await asyncio.to_thread(broken.close)
            await asyncio.to_thread(killed.container.kill)      # while the stream is down
            told = await asyncio.wait_for(asyncio.shield(killed.stopped), 30)
            assert sandbox.deaths.stream is not broken           # read again
            removed_stopped = removed.stopped
            await removed.remove()
            await asyncio.to_thread(later.container.kill)
            later_told = await asyncio.wait_for(asyncio.shield(later.stopped), 10)
            instances.append(await sandbox.launch(env, "death-told-3", {}))
            urls = [i.base_url for i in instances]
            return told, later_told, removed_stopped, urls
        finally:
            for instance in instances:
                await instance.remove()
            await sandbox.close()

    told, later, removed, urls = run(go())
    assert told == later == "its container exited with code 137"
    # its removal's death came before the later kill's, which was told: it was not taken for one
    assert removed.result() == "its container was removed by the server"
    # the next env is at an address none of the others had, though the daemon freed two
    assert len(set(urls)) == 4, urls
    assert owned_containers(docker_client, owner_id()) == []


def test_servers_starting_together_each_make_an_envs_network_of_a_subnet_of_its_own(docker_client):
    """The envs' network is made with the subnet the daemon chooses, given back to it explicitly
    (so the server may give each env its address). Four servers starting at once (as Gym starts
    them) each get a network, of four subnets; a subnet another took in between is tried again."""
    async def go():
        sandboxes = await asyncio.gather(*(agentenv.DockerSandbox.reached(owner_id())
                                           for _ in range(4)))
        try:
            names = await asyncio.gather(*(s.episode_network("") for s in sandboxes))
            subnets = [agentenv.ipv4_subnet((await asyncio.to_thread(
                docker_client.networks.get, name)).attrs) for name in names]
            return subnets, [s.addresses for s in sandboxes]
        finally:
            for sandbox in sandboxes:
                await sandbox.close()

    subnets, addresses = run(go())
    assert len(set(subnets)) == 4 and all(subnets), subnets
    assert all(a is not None for a in addresses)
    assert [f"{a.gateway.rsplit('.', 1)[0]}" for a in addresses] == \
        [s.split("/")[0].rsplit(".", 1)[0] for s in subnets]
    left = docker_client.networks.list(filters={"label": f"agentenv.owner={owner_id()}"})
    assert not left, [n.name for n in left]     # the probes too


# ---------------------------------------------------------------- 3. image built once per content

def test_image_built_once_per_content(docker_client, tmp_path, monkeypatch, built_images, caplog):
    from docker.models.images import ImageCollection

    caplog.set_level(logging.INFO, logger="agentenv.build")

    def said() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if r.name == "agentenv.build"]
        caplog.clear()
        return lines

    builds: list[str] = []
    real_build = ImageCollection.build

    def counting_build(self, **kwargs):
        builds.append(kwargs.get("tag"))
        return real_build(self, **kwargs)

    monkeypatch.setattr(ImageCollection, "build", counting_build)
    root = copy_notes(tmp_path)
    server = root / "envs" / "notebook" / "server.py"
    # content no earlier run built, so the first Runtime must build it
    server.write_text(server.read_text() + f"\n# test build {uuid.uuid4().hex}\n")

    async def open_and_play(expect_saved: str) -> tuple[str, str]:
        bundle = Bundle.load(root)
        async with Runtime(bundle, agentenv.Settings.of(sandbox="docker")) as rt:
            tag = rt.sandbox.images["notebook"]
            built_images.append(tag)
            ep = rt.episode(bundle.tasks["save-groceries"])
            turn = await ep.next_turn()
            image = ep.instances[0].container.attrs["Config"]["Image"]
            result = await turn.call("write_note", {"title": "groceries", "text": "eggs, milk"})
            assert result == ToolResult(f"{expect_saved} note 'groceries'")
            turn.end("ok")
            assert (await ep.result()).reward == 1.0
        return tag, image

    tag1, used1 = run(open_and_play("saved"))
    assert tag1.startswith("agentenv/notebook:") and used1 == tag1
    assert builds == [tag1], "the first Runtime builds the env's image"
    id1 = docker_client.images.get(tag1).id
    # the build says which image, how far, how long, and when all are ready
    lines = said()
    assert lines[0] == (f"Building the image of env 'notebook' as {tag1}, image 1 of 1 (once per "
                        "content of envs/notebook).")
    assert re.fullmatch(rf"Built {re.escape(tag1)} in \d+\.\ds\.", lines[-2]), lines
    assert re.fullmatch(r"The images of 1 env\(s\) are ready \(1 built, 0 already there\) after "
                        r"\d+\.\ds\.", lines[-1]), lines
    assert all(line.startswith(f"Still building {tag1}: ") for line in lines[1:-2]), lines

    tag2, used2 = run(open_and_play("saved"))
    assert builds == [tag1], "a second Runtime on the same content builds nothing"
    assert said() == [], "and says nothing of images"
    assert (tag2, used2) == (tag1, tag1)
    assert docker_client.images.get(tag1).id == id1, "the image is the very same one"

    server.write_text(server.read_text().replace('f"saved note', 'f"stored note'))
    tag3, used3 = run(open_and_play("stored"))
    assert tag3 != tag1 and tag3.startswith("agentenv/notebook:") and used3 == tag3
    assert builds == [tag1, tag3], "changed content builds a new image, once"
    assert docker_client.images.get(tag3).id != id1
    assert docker_client.images.get(tag1).id == id1, "the old image stays for the old content"


# ---------------------------------------------------------------- 4. a deploy that fails

BOOM = 'CMD ["python", "-c", "import sys; print(\'boom: no config\'); sys.exit(4)"]'
# the same, exiting within a millisecond or two of its start
BOOM_AT_ONCE = 'CMD ["sh", "-c", "echo \'boom: no config\'; exit 4"]'


def broken_notes(tmp_path: Path, cmd: str) -> Bundle:
    """A copy of notes-v1 whose notebook env runs ``cmd`` instead of its server."""
    root = copy_notes(tmp_path)
    (root / "envs" / "notebook" / "Dockerfile").write_text(
        f"FROM python:3.11-slim\n# test {uuid.uuid4().hex}\n{cmd}\n")
    return Bundle.load(root)


async def fail_deploys(client, bundle: Bundle, built_images: list[str], tasks: list[str]) -> list:
    """Start an episode of each task at once; each must fail: (raised, outcome, seconds, left)."""
    async with Runtime(bundle, agentenv.Settings.of(sandbox="docker", deploy_timeout=180)) as rt:
        built_images.append(rt.sandbox.images["notebook"])

        async def one(task: str):
            started = time.monotonic()
            ep = rt.episode(bundle.tasks[task])
            with pytest.raises(EpisodeFailed) as failed:
                await ep.next_turn()
            elapsed = time.monotonic() - started
            outcome = await ep.result()
            async with asyncio.timeout(30):
                await ep.closed.wait()
            left = await asyncio.to_thread(episode_containers, client, ep.id)
            return str(failed.value), outcome, elapsed, left

        results = await asyncio.gather(*(one(t) for t in tasks))
    assert owned_containers(client, rt.sandbox.owner) == []
    return results


def test_failed_deploy_fails_fast_and_leaves_nothing(docker_client, tmp_path, built_images):
    bundle = broken_notes(tmp_path, BOOM)
    results = run(fail_deploys(docker_client, bundle, built_images, ["save-groceries"]))
    [(raised, outcome, elapsed, left)] = results
    assert outcome.status == "failed" and outcome.reward is None and outcome.scores == {}
    assert outcome.failure.reason == raised, "next_turn raises the outcome's reason"
    assert elapsed < 30, f"the failure took {elapsed:.1f}s though the container exited at once " \
                         "(the deploy deadline is 180s)"
    assert left == [], "the failed env's container is removed"


def test_failed_deploy_reason_quotes_output_and_exit_code(docker_client, tmp_path, built_images):
    bundle = broken_notes(tmp_path, BOOM)
    tasks = ["save-groceries", "recall-recipe", "two-step"] * 2   # each must say why, every time
    results = run(fail_deploys(docker_client, bundle, built_images, tasks))
    reasons = [outcome.failure.reason for _, outcome, _, _ in results]
    for reason in reasons:
        assert "agentenv.py failed" not in reason, reasons
        assert "step 'env' (deploy_env) failed: env 'notebook'" in reason, reasons
        assert "exited with code 4" in reason, reasons
        assert "boom: no config" in reason, reasons


def test_launch_of_env_exiting_at_once_reports_code_and_output(docker_client, tmp_path, built_images):
    bundle = broken_notes(tmp_path, BOOM_AT_ONCE)
    env = bundle.envs["notebook"]
    episode = f"test-{uuid.uuid4().hex}"

    async def go() -> str:
        async with Runtime(bundle, agentenv.Settings.of(sandbox="docker")) as rt:
            built_images.append(rt.sandbox.images["notebook"])
            try:
                instance = await rt.sandbox.launch(env, episode, {})
            except EpisodeFailed as exc:
                # no container of it stands: its address is free for the next env
                assert not rt.sandbox.addresses.held
                return str(exc)
            try:
                for _ in range(50):
                    if why := await instance.exited():
                        return f"{why}: {await instance.output()}"
                    await asyncio.sleep(0.1)
                return "the container did not exit"
            finally:
                await instance.remove()
                assert not rt.sandbox.addresses.held

    try:
        said = run(go())
        assert "exited with code 4" in said and "boom: no config" in said, said
    finally:
        remove_quietly(episode_containers(docker_client, episode))
    assert episode_containers(docker_client, episode) == []


# ---------------------------------------------------------------- 5. abandon while deploying

@contextlib.asynccontextmanager
async def runtime_closed_within(bundle, seconds: float = 10, **kwargs):
    """A docker Runtime whose close must finish within ``seconds``; if it hangs, the test fails
    (after closing the sandbox and HTTP client by hand) instead of hanging the suite."""
    rt = await Runtime(bundle, agentenv.Settings.of(sandbox="docker", **kwargs)).start()
    failed = False
    try:
        yield rt
    except BaseException:
        failed = True
        raise
    finally:
        try:
            async with asyncio.timeout(seconds):
                await rt.close()
        except TimeoutError:
            await rt.sandbox.close()
            await rt.http.close()
            if not failed:      # else the test's own failure says more
                raise AssertionError(f"Runtime.close() did not return within {seconds:g}s") from None


def test_abandon_right_after_episode_starts(docker_client):
    bundle = Bundle.load(NOTES)

    async def go():
        async with runtime_closed_within(bundle, 3) as rt:
            ep = rt.episode(bundle.tasks["save-groceries"])
            # no await in between: what a trainer does when it drops a rollout at once
            try:
                async with asyncio.timeout(3):
                    await ep.abandon("the trainer dropped this rollout")
            except TimeoutError:
                raise AssertionError("abandon() right after rt.episode() did not return within 3s "
                                     f"(outcome {ep.outcome}, driver {ep._driver})") from None
            assert ep.outcome.status == "abandoned"
            assert ep.outcome.failure.reason == "the trainer dropped this rollout"
            return ep.id, rt.owner

    episode, owner = run(go(), timeout=30)
    assert episode_containers(docker_client, episode) == []
    assert owned_containers(docker_client, owner) == []


class CreateSpy:
    """Watches the docker SDK's container create calls (optionally slowing each down by `delay`
    seconds first): when one is in flight, and when every one has returned. It also counts the
    sandbox's daemon calls not yet done (from the moment one is asked for, before its thread
    starts), so `settled` can't be true while a create is queued but not begun."""

    def __init__(self):
        self.delay = 0.0
        self.lock = threading.Lock()
        self.started = self.returned = 0
        self.calls = 0                  # DockerDaemon.call coroutines asked for and not done
        self.in_flight = threading.Event()
        self.created: list = []

    def wrap_call(self, real_call):
        def call(sandbox, fn, *args, **kwargs):
            with self.lock:
                self.calls += 1
            inner = real_call(sandbox, fn, *args, **kwargs)

            async def counted():
                try:
                    return await inner
                finally:
                    with self.lock:
                        self.calls -= 1
            return counted()
        return call

    def wrap(self, real_create):
        def create(collection, *args, **kwargs):
            with self.lock:
                self.started += 1
            self.in_flight.set()
            time.sleep(self.delay)
            try:
                container = real_create(collection, *args, **kwargs)
                self.created.append(container)
                return container
            finally:
                with self.lock:
                    self.returned += 1
        return create

    @property
    def settled(self) -> bool:
        with self.lock:
            return self.calls == 0 and self.started == self.returned

    async def wait_in_flight(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.in_flight.is_set():
            assert time.monotonic() < deadline, "no container create call started"
            await asyncio.sleep(0.002)

    def wait_settled(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.settled:
            assert time.monotonic() < deadline, "a container create call did not return"
            time.sleep(0.01)


@pytest.fixture
def create_spy(monkeypatch):
    from docker.models.containers import ContainerCollection

    spy = CreateSpy()
    monkeypatch.setattr(ContainerCollection, "create", spy.wrap(ContainerCollection.create))
    monkeypatch.setattr(agentenv.DockerDaemon, "call", spy.wrap_call(agentenv.DockerDaemon.call))
    yield spy
    spy.wait_settled()      # no create of this test may still be running in a thread


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3, 1.0])
def test_abandon_while_deploying_leaves_no_container(docker_client, create_spy, delay):
    bundle = Bundle.load(NOTES)

    async def go():
        async with runtime_closed_within(bundle) as rt:
            ep = rt.episode(bundle.tasks["save-groceries"])
            await asyncio.sleep(delay)
            phase = ep.phase
            started = time.monotonic()
            await ep.abandon("the trainer dropped this rollout")
            took = time.monotonic() - started
            assert ep.closed.is_set() and ep not in rt.live
            assert ep.outcome.status == "abandoned" and ep.outcome.reward is None
            assert ep.outcome.failure.reason == "the trainer dropped this rollout"
            with pytest.raises(EpisodeFailed, match="the trainer dropped this rollout"):
                await ep.next_turn()
            # a create the episode gave up on may still be running: once it returns, its
            # container goes at once (the runtime stays open meanwhile)
            await asyncio.to_thread(create_spy.wait_settled)
            await wait_no_episode_container(docker_client, ep.id)
            return ep.id, rt.owner, phase, took

    episode, owner, phase, took = run(go(), timeout=60)
    assert phase in ("waiting", "deploying", "playing"), phase
    assert took < 10, f"abandon took {took:.1f}s"
    assert episode_containers(docker_client, episode) == []
    assert owned_containers(docker_client, owner) == []


def test_abandon_while_create_in_flight_removes_late_container(docker_client, create_spy):
    create_spy.delay = 0.6          # widen the window: the episode gives up mid-create
    bundle = Bundle.load(NOTES)

    async def go():
        async with runtime_closed_within(bundle) as rt:
            ep = rt.episode(bundle.tasks["save-groceries"])
            await create_spy.wait_in_flight()
            await ep.abandon("gave up while the container was being created")
            assert not create_spy.settled, "the test meant to give up mid-create"
            assert ep.outcome.status == "abandoned"
            # the container appears only now, after the episode gave up ...
            await asyncio.to_thread(create_spy.wait_settled)
            assert create_spy.created, "the daemon created the container"
            # ... and is removed at once, with the runtime still open
            await wait_no_episode_container(docker_client, ep.id, timeout=10)
            return ep.id, rt.owner

    episode, owner = run(go(), timeout=60)
    assert episode_containers(docker_client, episode) == []
    assert owned_containers(docker_client, owner) == []


def test_close_while_create_in_flight_leaves_no_container(docker_client, create_spy):
    bundle = Bundle.load(NOTES)
    episode = ""

    async def go():
        nonlocal episode
        async with runtime_closed_within(bundle) as rt:
            ep = rt.episode(bundle.tasks["save-groceries"])
            episode = ep.id
            await create_spy.wait_in_flight()
        # the runtime closed while the create was in flight, as a server shutting down mid-deploy
        assert ep.outcome.status == "abandoned"
        assert ep.outcome.failure.reason == "the server shut down"

    try:
        run(go(), timeout=60)
        create_spy.wait_settled()
        time.sleep(1.0)
        left = episode_containers(docker_client, episode)
        assert left == [], (f"{len(left)} container(s) of the episode exist after Runtime.close(): "
                            f"{[(c.short_id, c.status) for c in left]}")
    finally:
        create_spy.wait_settled()
        remove_quietly(episode_containers(docker_client, episode) if episode else [])


# ---------------------------------------------------------------- 6. the crash sweep

def unused_pid() -> int:
    """A pid no process has: the owner of a server that is gone."""
    return next(p for p in range(999_999, 0, -1) if not Path(f"/proc/{p}").exists())


def test_startup_sweep_removes_only_dead_owners_containers(docker_client):
    bundle = Bundle.load(NOTES)
    host = socket.gethostname()
    image = run(_ensure_image(bundle))
    assert image == notes_tag()

    sleeper = subprocess.Popen(["sleep", "60"])
    made = []
    try:
        started = agentenv._process_start(sleeper.pid)
        assert started, "the sleeper's start time is readable"
        me = agentenv._process_start(os.getpid())
        dead_pid = unused_pid()
        owners = {
            "dead": f"{host}:{dead_pid}:123",
            "reused pid": f"{host}:{os.getpid()}:{int(me) + 1}",   # this pid, another start time
            "live": f"{host}:{sleeper.pid}:{started}",
            "other host": f"{host}-elsewhere.example:{dead_pid}:123",
        }
        containers = {}
        for what, owner in owners.items():
            c = docker_client.containers.run(
                image, detach=True,
                labels={"agentenv.owner": owner, "agentenv.episode": f"handmade-{uuid.uuid4().hex}",
                        "agentenv.env": "notebook", SESSION_LABEL: SESSION})
            made.append(c)
            containers[what] = c

        async def go():
            async with Runtime(bundle, agentenv.Settings.of(sandbox="docker")):
                # right after start-up, before any episode
                return {what: bool(await asyncio.to_thread(
                            labelled, docker_client, f"agentenv.owner={owner}"))
                        for what, owner in owners.items()}

        exists = run(go())
        assert exists == {"dead": False, "reused pid": False, "live": True, "other host": True}, \
            "the sweep removes the containers of dead servers on this host, and only those"
        assert containers["live"].id in {c.id for c in labelled(docker_client, SESSION_LABEL)}
    finally:
        sleeper.kill()
        sleeper.wait()
        remove_quietly(made)


def test_servers_starting_together_sweep_a_dead_runs_containers_without_false_alarms(
        docker_client, caplog):
    """Gym starts several servers at once on one daemon: each sweeps the same dead run's
    containers and network, and what another server is removing is gone, not a failure to tell
    the user of."""
    bundle = Bundle.load(NOTES)
    image = run(_ensure_image(bundle))
    dead_pid = unused_pid()
    dead = f"{socket.gethostname()}:{dead_pid}:123"
    network = docker_client.networks.create(f"agentenv-test-{uuid.uuid4().hex[:10]}", driver="bridge",
                                            labels={"agentenv.owner": dead, "agentenv.episode": "x"})
    made = [docker_client.containers.run(
                image, detach=True, network=network.name,
                labels={"agentenv.owner": dead, "agentenv.episode": f"handmade-{uuid.uuid4().hex}",
                        "agentenv.env": "notebook", SESSION_LABEL: SESSION})
            for _ in range(4)]
    try:
        async def start():
            async with Runtime(bundle, agentenv.Settings.of(sandbox="docker")):
                pass

        async def together():
            await asyncio.gather(*(start() for _ in range(3)))

        run(together(), timeout=120)
        assert labelled(docker_client, f"agentenv.owner={dead}") == []
        assert not docker_client.networks.list(names=[network.name]), "the dead run's network stands"
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                and "an earlier run of agentenv.py left behind" in r.getMessage()
                and not r.getMessage().startswith("Removed ")]
        assert said == [], said
    finally:
        remove_quietly(made)
        if docker_client.networks.list(names=[network.name]):
            network.remove()


async def _ensure_image(bundle):
    async with Runtime(bundle, agentenv.Settings.of(sandbox="docker")) as rt:
        return rt.sandbox.images["notebook"]


def test_second_runtime_spares_live_episodes(docker_client):
    """A second server starting in the same process (a live owner) leaves the first one's
    running episode alone."""
    bundle = Bundle.load(NOTES)

    async def go():
        async with Runtime(bundle, agentenv.Settings.of(sandbox="docker")) as first:
            ep = first.episode(bundle.tasks["save-groceries"])
            turn = await ep.next_turn()
            async with Runtime(bundle, agentenv.Settings.of(sandbox="docker")):
                pass
            assert await turn.call("write_note", {"title": "groceries", "text": "eggs, milk"}) == \
                ToolResult("saved note 'groceries'")
            turn.end("ok")
            return await ep.result()

    assert run(go()).reward == 1.0


# ---------------------------------------------------------------- 7. concurrency

def test_concurrent_episodes_bounded_by_max_concurrent_envs(docker_client):
    bundle = Bundle.load(NOTES)
    task = bundle.tasks["save-groceries"]
    limit, count = 3, 6

    async def go():
        async with Runtime(bundle, agentenv.Settings.of(sandbox="docker", max_concurrent_envs=limit)) as rt:
            owner = rt.sandbox.owner
            samples: list[int] = []
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    samples.append(len(owned_containers(docker_client, owner)))
                    time.sleep(0.02)

            sampler = asyncio.create_task(asyncio.to_thread(sample))
            first_batch, release = asyncio.Event(), asyncio.Event()
            ready = 0

            async def one(ep):
                nonlocal ready
                turn = await ep.next_turn()
                ready += 1
                if ready == limit:
                    first_batch.set()
                await release.wait()
                await turn.call("write_note", {"title": "groceries", "text": "eggs, milk"})
                turn.end("saved")
                return await ep.result()

            eps = [rt.episode(task) for _ in range(count)]
            plays = asyncio.gather(*(one(ep) for ep in eps))
            async with asyncio.timeout(60):
                await first_batch.wait()
            # the first `limit` episodes hold their turns open: the rest wait for a slot
            at_limit = len(await asyncio.to_thread(owned_containers, docker_client, owner))
            waiting = sorted(ep.phase for ep in eps)
            release.set()
            outcomes = await plays
            for ep in eps:
                await ep.closed.wait()
            stop.set()
            await sampler
            after = await asyncio.to_thread(owned_containers, docker_client, owner)
            return outcomes, samples, at_limit, waiting, after

    outcomes, samples, at_limit, phases, after = run(go(), timeout=120)
    assert [o.reward for o in outcomes] == [1.0] * count, outcomes
    assert at_limit == limit
    assert phases == ["playing"] * limit + ["waiting"] * (count - limit)
    assert samples and max(samples) <= limit, f"more than {limit} containers at once: {max(samples)}"
    assert after == []


# ---------------------------------------------------------------- 8. a killed server's containers

CHILD = r"""
import asyncio, sys
import agentenv

async def main():
    bundle = agentenv.Bundle.load(sys.argv[2])
    rt = await agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="docker")).start()
    ep = rt.episode(bundle.tasks["save-groceries"])
    await ep.next_turn()
    print("ready", agentenv.owner_id(), ep.id, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_killed_server_container_swept_at_next_start(docker_client):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO), str(NOTES)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []

    def until_ready() -> list[str]:
        for line in child.stdout:
            output.append(line.rstrip())
            if line.startswith("ready "):
                return line.split()
        raise AssertionError("the child exited before its turn:\n" + "\n".join(output))

    episode = ""
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                _, owner, episode = pool.submit(until_ready).result(timeout=90)
            except concurrent.futures.TimeoutError:
                child.kill()
                raise AssertionError("the child never got its turn:\n" + "\n".join(output)) from None
            OTHER_OWNERS.add(owner)
            [container] = episode_containers(docker_client, episode)
            assert container.labels["agentenv.owner"] == owner
            assert owner.split(":")[1] == str(child.pid)

            child.send_signal(signal.SIGKILL)           # no teardown, no finally
            assert child.wait(10) == -signal.SIGKILL

        container.reload()
        assert container.status == "running", "a killed server leaves its container running"

        def its_networks() -> list[str]:
            return [n.name for n in docker_client.networks.list(filters={"label": "agentenv.owner"})
                    if (n.attrs.get("Labels") or {}).get("agentenv.owner") == owner]
        assert its_networks(), "the killed server's envs ran on a network of its own"

        async def go():
            async with Runtime(Bundle.load(NOTES), agentenv.Settings.of(sandbox="docker")):
                return await asyncio.to_thread(episode_containers, docker_client, episode)

        assert run(go()) == [], "the next Runtime.start() removes what the killed server left"
        assert its_networks() == [], "the next Runtime.start() removes the killed server's network"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        if episode:
            remove_quietly(episode_containers(docker_client, episode))


# ---------------------------------------------------------------- 9. the reply first, the teardown after
#
# A Gym /verify, OpenEnv's last end_turn (and eval, which verifies through the Gym routes) answer
# as soon as the score is known; the envs are removed after, each episode holding its slot until
# its container is gone. The daemon's removals are gated (``removals``): held until the test lets
# them go, or failed as a daemon fails them; everything else is the real daemon and real containers.

SAVE = 1                                            # save-groceries, in the split "all"


class Removals:
    """Container.remove as the server calls it (in its threads), gated: while ``held`` is clear
    each removal of an episode's container waits; while ``failing`` is set each fails as a daemon
    fails one. Counts what was asked and what was done, by container id."""

    def __init__(self, real):
        self.real, self.lock = real, threading.Lock()
        self.open, self.failing = threading.Event(), threading.Event()
        self.open.set()
        self.asked: list[str] = []
        self.failed: list[str] = []
        self.done: list[str] = []

    def wrap(self):
        import docker.errors

        def remove(container, *args, **kwargs):
            if container.labels.get("agentenv.episode", "(probe)").startswith("("):
                return self.real(container, *args, **kwargs)      # the sandbox's own probe
            with self.lock:
                self.asked.append(container.id)
            self.open.wait(120)
            if self.failing.is_set():
                with self.lock:
                    self.failed.append(container.id)
                raise docker.errors.APIError("injected: the daemon failed this removal")
            self.real(container, *args, **kwargs)
            with self.lock:
                self.done.append(container.id)
        return remove

    def hold(self) -> None:
        self.open.clear()

    def let_go(self) -> None:
        self.open.set()

    async def until(self, what, timeout: float = 60) -> None:
        """Wait until ``what()`` is true (polled: the removals run in the server's threads)."""
        async with asyncio.timeout(timeout):
            while not what():
                await asyncio.sleep(0.02)


@pytest.fixture
def removals(monkeypatch):
    from docker.models.containers import Container

    gate = Removals(Container.remove)
    monkeypatch.setattr(Container, "remove", gate.wrap())
    yield gate
    gate.failing.clear()
    gate.let_go()


@contextlib.asynccontextmanager
async def served_here(**settings):
    """build_app(notes-v1, sandbox docker, **settings) served on a loopback port of this loop, as
    a user's aiohttp runner serves it; its URL. Its shutdown (what SIGTERM runs) ends the block."""
    from aiohttp import web
    # no warm pool unless a test asks (Docker's default keeps one): these tests count the
    # containers of their own rollouts, and a warm env is a container too
    app = agentenv.build_app(NOTES, sandbox="docker", **{"warm": 0, **settings})
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def scraped(url: str):
    return await asyncio.to_thread(scrape, url)


async def drained(url: str, timeout: float = 60) -> None:
    """Wait until /metrics says no episode is live: every teardown done, every slot free."""
    async with asyncio.timeout(timeout):
        while (await scraped(url)).value("agentenv_episodes_live"):
            await asyncio.sleep(0.05)


async def mine(client) -> list:
    """This process's containers (the tests of this module run one at a time)."""
    return await asyncio.to_thread(owned_containers, client, owner_id())


async def save_groceries(url: str, http) -> dict:
    """A Gym rollout of save-groceries played right: its verify's reply."""
    gym = Gym(url, gym_row(NOTES, SAVE), http)
    await gym.seed()
    saved = await gym.call("write_note", title="groceries", text="eggs and milk")
    assert saved.text == "saved note 'groceries'", saved.text
    verified = await gym.verify("Saved.")
    assert verified.status == 200, verified.text
    return verified.json()


def test_the_reply_comes_before_the_teardown_on_both_wires(docker_client, removals):
    """With every removal held, a Gym /verify, OpenEnv's last end_turn on /ws and a tools/call of
    end_turn on /mcp each answer with the score while their episode's container still stands;
    the episodes stay live (their slots taken) until the removals are let go, and then nothing
    is left."""

    async def go():
        async with served_here(max_concurrent_envs=4) as url, client() as http:
            removals.hold()
            body = await asyncio.wait_for(save_groceries(url, http), 90)
            assert (body["reward"], body["mask_sample"]) == (1.0, False), body
            async with http.ws_connect(url.replace("http", "ws") + "/ws") as ws:
                await ws.send_json({"type": "reset", "data": {"split": "all", "index": SAVE}})
                await ws.receive_json(timeout=90)
                for action in ({"type": "call_tool", "tool_name": "write_note",
                                "arguments": {"title": "groceries", "text": "eggs and milk"}},
                               {"type": "call_tool", "tool_name": "end_turn",
                                "arguments": {"response": "Saved."}}):
                    await ws.send_json({"type": "step", "data": action})
                    answer = await ws.receive_json(timeout=90)
                assert (answer["data"]["reward"], answer["data"]["done"]) == (1.0, True), answer
            async with http.ws_connect(url.replace("http", "ws") + "/ws") as ws:
                await ws.send_json({"type": "reset", "data": {"split": "all", "index": SAVE}})
                await ws.receive_json(timeout=90)
                for n, (name, arguments) in enumerate((
                        ("write_note", {"title": "groceries", "text": "eggs and milk"}),
                        ("end_turn", {"response": "Saved."}))):
                    await ws.send_json({"type": "mcp", "data": {
                        "jsonrpc": "2.0", "id": n, "method": "tools/call",
                        "params": {"name": name, "arguments": arguments}}})
                    answer = await ws.receive_json(timeout=90)
                assert answer["data"]["result"]["data"]["reward"] == 1.0, answer
            # three replies, and not one of the three containers removed
            await removals.until(lambda: len(removals.asked) == 3)
            assert removals.done == [] and len(await mine(docker_client)) == 3
            page = await scraped(url)
            assert page.value("agentenv_episodes_live") == 3, "a slot is held until its env is gone"
            assert page.by("agentenv_episodes_total", "outcome") == {("scored",): 3}
            removals.let_go()
            await removals.until(lambda: len(removals.done) == 3)
            await drained(url)
            assert await mine(docker_client) == []

    run(go(), timeout=300)


def test_a_reset_on_a_live_episode_answers_before_its_teardown(docker_client, removals):
    """With every removal held, a second reset on one /ws socket abandons the first episode and
    answers with the new prompt while the first episode's container still stands; that episode
    keeps its slot (two live) until its removal is let go. A stateless POST /reset, whose episode
    ends with the request, answers while its container stands too. Then nothing is left."""

    async def go():
        async with served_here(max_concurrent_envs=2) as url, client() as http:
            removals.hold()
            async with http.ws_connect(url.replace("http", "ws") + "/ws") as ws:
                for _ in range(2):
                    await ws.send_json({"type": "reset", "data": {"split": "all", "index": SAVE}})
                    answer = await ws.receive_json(timeout=90)
                    assert answer["data"]["done"] is False, answer
                    assert "groceries" in answer["data"]["observation"]["metadata"]["prompt"]
                await removals.until(lambda: len(removals.asked) == 1)
                assert removals.done == [] and len(await mine(docker_client)) == 2
                page = await scraped(url)
                assert page.value("agentenv_episodes_live") == 2, "a slot is held until its env is gone"
                removals.let_go()
                await removals.until(lambda: len(removals.done) == 1)
            await drained(url)
            removals.hold()
            async with http.post(url + "/reset", json={"split": "all", "index": SAVE}) as resp:
                answer = await resp.json()
            assert resp.status == 200 and answer["done"] is False, answer
            await removals.until(lambda: len(removals.asked) == 3)
            assert len(await mine(docker_client)) == 1
            removals.let_go()
            await drained(url)
            assert await mine(docker_client) == []

    run(go(), timeout=300)


def test_a_closed_sockets_teardown_waits_while_another_episode_plays_and_goes_when_a_slot_is_needed(
        docker_client, monkeypatch):
    """On a pool of two, episode A plays while B's client closes its /ws session (a close message,
    then the socket, as OpenEnv's clients and the url: resources server before its /verify reply
    do): B's client gets the closing frame at once (code 1000, not a timeout), while B's container
    stands, its teardown waiting for A (a removal would take the cores from it) and its slot
    held. A third client's reset needs that slot: B's teardown goes, and C gets its prompt. Once
    A ends too, nothing is left. The patience after which a teardown goes anyway is set past the
    test, so only these rules free the slot."""
    monkeypatch.setattr(agentenv, "BACKGROUND_PATIENCE", 600.0)
    reset = {"type": "reset", "data": {"split": "all", "index": SAVE}}

    async def go():
        async with served_here(max_concurrent_envs=2) as url, client() as http:
            ws_url = url.replace("http", "ws") + "/ws"
            async with http.ws_connect(ws_url) as a:
                await a.send_json(reset)
                assert (await a.receive_json(timeout=90))["data"]["done"] is False
                b = await http.ws_connect(ws_url)
                await b.send_json(reset)
                assert (await b.receive_json(timeout=90))["data"]["done"] is False
                await b.send_json({"type": "close"})    # as OpenEnv's clients close a session
                async with asyncio.timeout(30):         # the server has ended B's episode
                    while not (page := await scraped(url)).value("agentenv_teardowns_waiting"):
                        await asyncio.sleep(0.05)
                async with asyncio.timeout(30):
                    await b.close()
                assert b.close_code == 1000, "B's close was answered, not timed out"
                page = await scraped(url)
                assert (page.value("agentenv_teardowns_waiting"), page.value("agentenv_episodes_live"),
                        len(await mine(docker_client))) == (1, 2, 2)
                async with http.ws_connect(ws_url) as c:
                    await c.send_json(reset)
                    answer = await c.receive_json(timeout=120)
                    assert answer["data"]["done"] is False, answer
                    page = await scraped(url)
                    assert (page.value("agentenv_teardowns_waiting"),
                            page.value("agentenv_episodes_live")) == (0, 2)
                    assert len(await mine(docker_client)) == 2, "B's container went for C's"
            await drained(url)
            assert await mine(docker_client) == []

    run(go(), timeout=300)


async def playing_on_both_wires(url: str, http):
    """An OpenEnv episode reset on a /ws (its socket, left open) and a Gym rollout seeded and
    called: two episodes playing, each with its container."""
    ws = await http.ws_connect(url.replace("http", "ws") + "/ws")
    await ws.send_json({"type": "reset", "data": {"split": "all", "index": SAVE}})
    assert (await ws.receive_json(timeout=90))["data"]["done"] is False
    gym = Gym(url, gym_row(NOTES, SAVE), http)
    await gym.seed()
    assert (await gym.call("list_notes")).text == "(no notes)"
    return ws


def test_a_shutdown_tears_down_at_once_though_episodes_still_play(docker_client, monkeypatch):
    """A shutdown ends one wire's sessions before the other's: here Gym's rollout, while an
    OpenEnv episode still plays on its /ws. Its teardown must not wait for that episode, as a
    teardown during a run does (the patience after which one goes anyway is set past the test):
    the shutdown comes back well inside a supervisor's grace period, and nothing is left."""
    monkeypatch.setattr(agentenv, "BACKGROUND_PATIENCE", 600.0)

    async def go():
        async with client() as http:
            async with served_here(max_concurrent_envs=3) as url:
                ws = await playing_on_both_wires(url, http)
                assert len(await mine(docker_client)) == 2
                shutdown = time.monotonic()
            took = time.monotonic() - shutdown
            print(f"the shutdown took {took:.1f}s")
            assert took < 20, f"the shutdown took {took:.0f}s: its teardowns waited for the episode"
            assert ws.closed or (await ws.receive(timeout=30)).type.name in ("CLOSE", "CLOSED")
            assert await mine(docker_client) == []

    run(go(), timeout=300)


def test_a_shutdown_ends_though_the_daemon_keeps_failing_its_removals(docker_client, removals,
                                                                      caplog):
    """The daemon fails every removal as the server shuts down, a Gym rollout and an OpenEnv
    episode playing: a teardown that fails is retried until the runtime closes, and the shutdown
    says it closes before either wire ends its sessions, so it comes back (the containers left to
    the sandbox's close and the next start's sweep, which this test stands in for) instead of
    retrying for as long as the daemon fails."""
    caplog.set_level(logging.INFO, logger="agentenv")

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(client())
            url = await stack.enter_async_context(served_here(max_concurrent_envs=3))
            await playing_on_both_wires(url, http)
            removals.failing.set()
            shutdown = asyncio.ensure_future(stack.aclose())
            try:
                await asyncio.wait_for(asyncio.shield(shutdown), 60)
            finally:
                removals.failing.clear()
                await shutdown
            return set(removals.failed)

    try:
        failed = run(go(), timeout=300)
        assert len(failed) == 2, "both containers' removals failed, and the shutdown came back"
        said = [r.getMessage() for r in caplog.records if r.name == "agentenv"]
        assert any("its teardown failed" in m for m in said), said
    finally:
        for container in owned_containers(docker_client, owner_id()):
            container.remove(force=True)
        for network in docker_client.networks.list(filters={"label": f"agentenv.owner={owner_id()}"}):
            network.remove()


def test_a_burst_at_the_limit_never_has_more_envs_than_the_limit(docker_client, removals):
    """Six Gym rollouts at once on a pool of two, every removal held: the first two are answered
    (scored) while their containers stand, and the other four wait for a slot, no third env
    started; as the removals are let go they play in turn. Containers counted all along never
    number more than two."""
    limit, count = 2, 6

    async def go():
        async with served_here(max_concurrent_envs=limit) as url, client() as http:
            samples: list[int] = []
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    samples.append(len(owned_containers(docker_client, owner_id())))
                    time.sleep(0.02)

            sampler = asyncio.ensure_future(asyncio.to_thread(sample))
            removals.hold()
            plays = [asyncio.ensure_future(save_groceries(url, http)) for _ in range(count)]
            answered: set = set()
            async with asyncio.timeout(120):
                while len(answered) < limit:
                    done, _ = await asyncio.wait(set(plays) - answered,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    answered |= done
            await removals.until(lambda: len(removals.asked) == limit)
            page = await scraped(url)
            at_limit = (page.value("agentenv_episodes_live"), page.value("agentenv_episodes_waiting"),
                        len(await mine(docker_client)), removals.done[:])
            removals.let_go()
            bodies = await asyncio.gather(*plays)
            await drained(url)
            stop.set()
            await sampler
            return at_limit, bodies, samples, await mine(docker_client)

    at_limit, bodies, samples, after = run(go(), timeout=400)
    assert at_limit == (limit, count - limit, limit, []), \
        "two rollouts answered, their removals held: two slots taken, four waiting, two containers"
    assert [(b["reward"], b["mask_sample"]) for b in bodies] == [(1.0, False)] * count, bodies
    assert samples and max(samples) <= limit, f"{max(samples)} containers at once, past {limit}"
    assert after == []


def test_a_teardown_that_fails_after_the_reply_is_retried_and_never_masks(docker_client, removals,
                                                                           caplog):
    """The daemon fails every removal of a scored rollout's container for a while: the verify has
    already answered 1.0, unmasked, and stays so; /metrics counts one teardown failure, no masked
    rollout and one scored episode, still live (its slot held while its container stands); the
    log says so in a sentence. Once the daemon removes again, the retry removes the container and
    the slot is free."""
    caplog.set_level(logging.INFO, logger="agentenv")

    async def go():
        async with served_here(max_concurrent_envs=2) as url, client() as http:
            removals.failing.set()
            body = await asyncio.wait_for(save_groceries(url, http), 90)
            # the daemon's three tries fail, then the episode's own retry, a second later
            await removals.until(lambda: len(removals.failed) >= 4)
            page = await scraped(url)
            during = (page.value("agentenv_teardown_failures_total"),
                      page.by("agentenv_masked_rollouts_total", "kind"),
                      page.by("agentenv_episodes_total", "outcome"),
                      page.value("agentenv_episodes_live"), len(await mine(docker_client)))
            removals.failing.clear()
            await drained(url)
            return body, during, await mine(docker_client)

    body, during, after = run(go(), timeout=300)
    assert (body["reward"], body["mask_sample"], body["failure_kind"]) == (1.0, False, None), body
    assert during == (1.0, {}, {("scored",): 1}, 1, 1), during
    assert after == [], "the retry removed the container once the daemon did again"
    said = [r.getMessage() for r in caplog.records if r.name == "agentenv"]
    assert any("ended scored, but its teardown failed: the Docker daemon did not remove container"
               in m and "the outcome stands" in m for m in said), said
    assert any("teardown succeeded on a later try; its slot is free" in m for m in said), said


def test_the_shutdown_waits_for_teardowns_under_way(docker_client, removals):
    """A rollout answered, its removal held as the server shuts down: the shutdown does not end
    before the removal is done, so it leaves no container."""

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            url = await stack.enter_async_context(served_here(max_concurrent_envs=2))
            http = await stack.enter_async_context(client())
            removals.hold()
            body = await asyncio.wait_for(save_groceries(url, http), 90)
            await removals.until(lambda: len(removals.asked) == 1)
            await http.close()
            shutdown = asyncio.ensure_future(stack.aclose())
            await asyncio.sleep(0.5)        # the shutdown under way, meeting the held removal
            assert not shutdown.done(), "the shutdown ended with a teardown under way"
            removals.let_go()
            await shutdown
            return body, removals.done[:], await mine(docker_client)

    body, done, after = run(go(), timeout=300)
    assert body["reward"] == 1.0 and len(done) == 1 and after == []


def test_sigterm_right_after_verify_leaves_no_container(docker_client, tmp_path):
    """serve --sandbox docker: rollouts verified, then SIGTERM at once, their teardowns under
    way; serve exits 0 and no container of its remains."""
    with running(Server.serve(NOTES, tmp_path, "--max-concurrent-envs", "4",
                              sandbox="docker")) as server:
        owner = f"agentenv.owner={socket.gethostname()}:{server.pid}:"

        async def go():
            async with client() as http:
                return await asyncio.gather(*(save_groceries(server.url, http) for _ in range(3)))

        bodies = run(go(), timeout=300)
        server.terminate()
        assert server.proc.wait(60) == 0, server.log()[-3000:]
    assert [b["reward"] for b in bodies] == [1.0] * 3
    left = [c for c in labelled(docker_client, "agentenv.owner")
            if c.labels["agentenv.owner"].startswith(owner.split("=", 1)[1])]
    remove_quietly(left)
    assert not left, f"serve left {len(left)} container(s) behind"
