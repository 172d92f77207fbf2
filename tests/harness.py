"""harness.py: the one test harness the suites share, each importing what it uses in one
``from tests.harness import ...`` (tests/conftest.py puts the repository root on ``sys.path``, and
``python -m pytest`` run there does for test_agentenv.py: no suite touches ``sys.path``).

What is here, and which suite uses it:

* The paths: ``REPO``, and the example bundles ``NOTES``, ``GRIDSIM`` and ``PYFIX``, defined here
  once; ``load_module(name, path)`` imports a file of the repository by its path (test_gridsim),
  and ``gridsim_battery()`` gridsim's env's battery.py (test_eval, test_gridsim, test_gym_real).

* ``LoopbackNamespace``: a network namespace whose only interface is loopback, where anything that
  starts Ray runs (tests/gym's full-CLI run); ``NamespaceUnavailable`` where none can be made.
* Running things: ``run(coro, timeout)`` (a coroutine to its end on a fresh loop, within a
  deadline: test_docker, test_faults, test_gridsim, test_gym_surface, test_isolation, test_load,
  test_metrics, test_warm, test_web), ``free_port()`` (test_bad_input, test_gym_surface, test_metrics) and
  ``free_ports(n)`` (tests/gym), ``wait_until`` (test_faults, test_gym_surface, test_load,
  test_metrics, test_openenv, test_warm, test_web), ``alive(pid)`` (test_faults, test_load),
  ``gone(pid, within)`` (test_gym_surface), ``processes_with_env`` (a /proc scan: test_gym_real,
  tests/gym) and ``environ(state)`` (a child's environment: test_gym_surface, test_gym_real).
* ``Server``: a server of ours as a subprocess, to start, break and stop (test_bad_input,
  test_faults, test_gym_surface, test_load, test_metrics, test_openenv, test_gym_real, test_web).
  ``Server.serve(bundle, folder, *flags)`` is ``agentenv.py serve``; ``Server.gym(folder, config)``
  the resources server as NeMo Gym starts it (``python app.py`` in a folder write-gym wrote, or
  this repository's ``run_gym_server()``); both take extra env vars (``env=``), the headers every
  request of ours carries (``headers=``: a bearer token) and a state dir to share (``serve``). A
  Server has ``url``/``ws_url``, ``log()`` (stdout and stderr), ``healthy()``, its env processes
  (``env_pids()``, by /proc, and ``records()``, the local sandbox's), ``wait_envs``/``no_envs``,
  ``signal``/``terminate`` (SIGTERM, once)/``kill`` (and its envs), and ``stop()``: SIGTERM, the
  exit code, no env process nor record left. ``running(server)`` stops it at the end of a block,
  having exited 0 (killed if the block fails); ``serving(bundle, folder, *flags)`` is
  ``running(Server.serve(...))``. ``Server.openenv_reference(folder)`` is the reference OpenEnv
  server built with OpenEnv's own create_app (tests/openenv_reference.py: test_openenv_parity).
  test_load subclasses it for its memory and fd figures.
* ``Page`` and ``scrape(url)``: a /metrics page parsed by Prometheus' own parser, its samples by
  name and labels (test_metrics, test_trl).
* HTTP: ``request()``, one request on a fresh connection with bytes as they are (a body, a
  chunked body, a cookie that isn't text), and its ``Reply`` (status, headers, body, text,
  json(), elapsed): test_bad_input, test_gym_surface, test_metrics, test_openenv, test_web, tests/gym.
* ``Gym``: the one NeMo Gym client, a rollout as simple_agent plays it (seed; tools with the
  session cookie, recorded as Responses items; verify; close), async over aiohttp (test_faults,
  test_gym_surface, test_load, test_metrics, test_web); ``SyncGym`` is the same client for code with no event
  loop (test_bad_input). ``client()`` its aiohttp session; ``gym_row``/``gym_rows`` the rows of a
  bundle as write-gym writes them (test_bad_input, test_load, test_metrics, test_web / test_faults,
  test_gym_surface); ``responses(text)`` a Responses object (test_bad_input, test_gym_surface).
* ``Socket``: the one OpenEnv socket client, a raw WebSocket on /ws or WebSocket /mcp, with headers
  or subprotocols: send, recv, ask, closed_with, close, drop (test_bad_input, test_openenv,
  test_faults, test_web).
* ``unavailable(reason, variable)`` and its ``docker_unavailable``, ``ray_unavailable`` and
  ``browser_unavailable`` (test_web): a skip that says why, or a failure where CI requires the part.
* Bundles and files: ``copy_bundle`` (a private copy to change: test_bad_input, test_docker,
  test_faults, test_gym_real, test_gym_surface, test_metrics, test_openenv, test_web), ``patch``
  (test_gym_surface, test_web), ``with_sleep_tool`` (notes-v1's notebook with a ``sleep`` tool: test_faults,
  test_metrics, test_openenv), ``one_turn_task`` and ``resources_config`` (test_faults,
  test_gym_surface, test_metrics), ``read_jsonl`` / ``write_jsonl`` (test_gym_real,
  test_gym_surface, tests/gym), and ``labelled`` / ``remove_quietly`` for Docker containers
  (test_docker, test_faults, test_isolation, test_warm); ``started_here`` (a container's owner is
  this run), ``boxes_of`` (a server's boxes) and ``box_of`` (the box a Gym rollout works in):
  test_agent_sandbox, test_adversary.

A server runs as ``sys.executable`` (signals to pyenv's ``python`` shim never reach the server), in
a session of its own, with its own AGENTENV_STATE_DIR, so its env processes can be found by that
variable in their environment (a /proc scan) even after the server is gone. The Gym venv's own
launching (a process group per run, SIGINT, Ray's leftovers) is tests/gym/harness.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import http.client
import http.cookies
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterable

import aiohttp
import yaml

# The paths every suite uses, defined here once.
REPO = Path(__file__).resolve().parents[1]
NOTES = REPO / "bundles" / "notes-v1"
GRIDSIM = REPO / "bundles" / "gridsim-v1"
PYFIX = REPO / "bundles" / "pyfix-v1"
COOKIE = "agentenv_session"                  # the Gym session's cookie
HOST = "127.0.0.1"


def load_module(name: str, path: Path) -> Any:
    """A Python file of the repository (a bundle's script, an env's module) imported by its path,
    under ``name`` (registered, so code that imports it by that name gets the same module)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def gridsim_battery() -> Any:
    """gridsim-v1's battery.py (its env's rules: the battery, the optimum), imported once."""
    return sys.modules.get("battery") or load_module("battery", GRIDSIM / "envs" / "gridsim" / "battery.py")


# ================================================================ running things

def run(coro, timeout: float = 120):
    """Run one coroutine to its end on a fresh event loop, within a deadline."""
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro
    return asyncio.run(bounded())


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together while choosing)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket())
            sock.bind((HOST, 0))
            ports.append(sock.getsockname()[1])
        return ports


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not so after {timeout:g}s")
        time.sleep(interval)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def gone(pid: int, within: float = 2.0) -> bool:
    """Whether the process is gone altogether (reaped too) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def processes_with_env(name: str, value: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process but this one whose environment has name=value."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            if not alive(int(entry.name)):
                continue                                    # a zombie: already dead
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found.append((int(entry.name), cmd))
    return found


def environ(state: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child of ours: its own AGENTENV_STATE_DIR, and no Gym or
    agentenv settings (a token, a pool size) leaking in from the caller's shell."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NEMO_GYM_", "MAX_CONCURRENT_ENVS", "AGENTENV_TOKEN"))}
    env.update(AGENTENV_STATE_DIR=str(state), PYTHONUNBUFFERED="1", **extra)
    return env


# ================================================================ a loopback-only network namespace

class NamespaceUnavailable(RuntimeError):
    """No network namespace could be made here (unshare needs root, or a kernel that allows it)."""


class LoopbackNamespace:
    """A fresh network namespace whose only interface is loopback, for anything that starts Ray:
    Ray's processes contact addresses outside the machine even when bound to 127.0.0.1, and on
    these machines nothing may leave loopback. A holder process keeps the namespace; ``argv``
    runs a command in it (nsenter), and ``call`` runs a function of this process in it (a thread
    that setns()es first: every socket it opens lives in the namespace). Closing it kills the
    holder, and with it the namespace once nothing else runs there."""

    def __init__(self) -> None:
        try:
            self.holder = subprocess.Popen(
                ["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec sleep 86400"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True)
        except OSError as exc:
            raise NamespaceUnavailable(f"unshare could not run ({exc})") from None
        said = self.holder.stdout.readline().decode(errors="replace").strip()
        if said != "up":
            self.holder.wait(10)
            raise NamespaceUnavailable(f"unshare --net did not make a namespace: {said or 'no output'}"
                                       f"{(' ' + self.holder.stdout.read().decode(errors='replace')).rstrip()}")
        self.path = f"/proc/{self.holder.pid}/ns/net"
        self.inode = os.readlink(self.path)      # the namespace, even once its holder is gone

    def argv(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net={self.path}", "--", *argv]

    def enter(self) -> None:
        """Move the calling thread into the namespace (only that thread)."""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000) != 0:                   # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns into the namespace failed")
        finally:
            os.close(fd)

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` run in the namespace, on a thread of its own; its result."""
        import threading
        outcome: list = []

        def inside() -> None:
            try:
                self.enter()
                outcome.append((True, fn(*args, **kwargs)))
            except BaseException as exc:                           # noqa: BLE001 - raised below
                outcome.append((False, exc))
        thread = threading.Thread(target=inside, name="in-namespace", daemon=True)
        thread.start()
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def processes(self) -> list[int]:
        """Every live process in the namespace but its holder (all of them ours: we made it)."""
        return [pid for pid in in_namespace(self.inode) if pid != self.holder.pid]

    def sweep(self) -> list[int]:
        """SIGKILL every process left in the namespace (Ray's, say); the pids it killed."""
        return kill_namespace(self.inode)

    def close(self) -> None:
        self.sweep()
        if self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(10)
        self.holder.stdout.close()

    def __enter__(self) -> LoopbackNamespace:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def in_namespace(inode: str) -> list[int]:
    """The live processes whose network namespace is ``inode`` (as /proc/PID/ns/net reads)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and alive(int(entry.name)):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/net") == inode:
                    found.append(int(entry.name))
    return found


def loopback_only(pid: int | str = "self") -> bool:
    """Whether the network namespace of a process has no interface but loopback."""
    lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    return {line.split(":")[0].strip() for line in lines} == {"lo"}


def kill_namespace(inode: str, spare: Iterable[int] = ()) -> list[int]:
    """SIGKILL every process of a namespace of our own but ``spare``; never in a namespace with
    any interface but loopback (the host's), where other processes than ours run."""
    pids = set(in_namespace(inode)) - set(spare) - {os.getpid()}
    if any(not loopback_only(pid) for pid in list(pids)[:1]):
        raise AssertionError("refusing to sweep a network namespace with more than loopback")
    killed = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


# ================================================================ a Ray cluster on loopback addresses

def unavailable(reason: str, required_by: str) -> None:
    """Skip a test that needs a part this machine lacks, saying why; fail instead when the
    variable ``required_by`` is 1 (CI sets one for each part it must run)."""
    import pytest
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{reason} ({required_by}=1, so this is an error, not a skip)", pytrace=False)
    pytest.skip(reason)


def ray_unavailable(reason: str) -> None:
    """A test that needs Ray (or its namespace) cannot run: AGENTENV_REQUIRE_RAY says how."""
    unavailable(reason, "AGENTENV_REQUIRE_RAY")


def docker_unavailable(reason: str) -> None:
    """A test that needs Docker cannot run: AGENTENV_REQUIRE_DOCKER says how."""
    unavailable(reason, "AGENTENV_REQUIRE_DOCKER")


def browser_unavailable(reason: str) -> None:
    """A test that needs a browser (Debian's chromium and Playwright) cannot run:
    AGENTENV_REQUIRE_BROWSER says how."""
    unavailable(reason, "AGENTENV_REQUIRE_BROWSER")


class RayCluster:
    """A Ray cluster on one machine: the head on 127.0.0.1, workers on 127.0.0.2, 127.0.0.3...,
    each ``ray start --block`` with its own temp dir and ports and ``cpus`` CPUs, all sharing a
    fresh auth token (RAY_AUTH_MODE=token: no node takes one of ~/.ray). Only ever made inside a
    loopback-only namespace (it refuses the host's), where every process is ours: ``close``
    stops the nodes and then kills whatever of Ray is left in the namespace."""

    STARTED = "Ray runtime started"

    def __init__(self, folder: Path, workers: int = 2, cpus: int = 1, resources: dict | None = None,
                 start_within: float = 120, node_env: dict[int, dict[str, str]] | None = None):
        self.inode = os.readlink("/proc/self/ns/net")
        if not loopback_only():
            raise AssertionError("a Ray cluster runs only inside a loopback-only network namespace")
        import secrets
        self.folder, self.cpus = folder, cpus
        self.port = 6379
        self.address = f"{HOST}:{self.port}"
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16)}
        self.nodes: list[tuple[str, subprocess.Popen, Path]] = []
        self.resources = resources or {}
        self.node_env = node_env or {}         # what node n's processes have in their environment
        try:
            for n in range(workers + 1):      # one at a time: together they load the machine more
                self._start(n, start_within)
        except BaseException:
            self.close()
            raise

    def _argv(self, n: int) -> list[str]:
        base = 30000 + 100 * n
        argv = [str(Path(sys.executable).with_name("ray")), "start", "--block",
                f"--node-ip-address=127.0.0.{n + 1}", f"--num-cpus={self.cpus}",
                f"--temp-dir=/tmp/ae-ray-{os.getpid()}-{n}",
                f"--dashboard-agent-listen-port={base + 1}", f"--dashboard-agent-grpc-port={base + 2}",
                f"--runtime-env-agent-port={base + 3}", f"--metrics-export-port={base + 4}",
                f"--node-manager-port={base + 5}", f"--object-manager-port={base + 6}",
                f"--min-worker-port={base + 10}", f"--max-worker-port={base + 90}"]
        if n in self.resources:
            argv.append("--resources=" + json.dumps(self.resources[n]))
        if n == 0:
            return argv + ["--head", f"--port={self.port}", "--include-dashboard=false",
                           f"--ray-client-server-port={base + 7}"]
        return argv + [f"--address={self.address}"]

    def _spawn(self, n: int) -> None:
        log = self.folder / f"ray-node-{n}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(self._argv(n), env={**self.env, **self.node_env.get(n, {})},
                                    stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes.append((f"127.0.0.{n + 1}", proc, log))

    def _ready(self, n: int, within: float) -> bool:
        """Wait for node n's ``ray start`` to say it started; False if it exited first."""
        _, proc, log = self.nodes[n]
        deadline = time.monotonic() + within
        while self.STARTED not in log.read_text(errors="replace"):
            if proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise AssertionError(f"Ray node {n} did not start within {within:g}s:\n"
                                     f"{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        return True

    def _start(self, n: int, within: float) -> None:
        """Node n, tried up to five times: on a loaded machine a node may miss Ray's own 30 s
        start-up deadline (hard-coded in Ray 2.60), and then its ``ray start`` exits."""
        for attempt in range(5):
            self._spawn(n)
            if self._ready(n, within):
                return
            tail = self.nodes[n][2].read_text(errors="replace")[-2000:]
            self.nodes.pop()
            for pid in self.node_pids(n):     # what the failed start left of the node
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(f"/tmp/ae-ray-{os.getpid()}-{n}", ignore_errors=True)
        raise AssertionError(f"Ray node {n} did not start in five tries:\n{tail}")

    @staticmethod
    def _ancestors() -> set[int]:
        pids, pid = set(), os.getpid()
        while pid > 1:
            pids.add(pid)
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        return pids

    def node_pids(self, n: int) -> list[int]:
        """The processes of node n (by its temp dir on their command line)."""
        marker = f"/tmp/ae-ray-{os.getpid()}-{n}".encode()
        found = []
        for pid in in_namespace(self.inode):
            with contextlib.suppress(OSError):
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
        return found

    def close(self, spare: Iterable[int] = ()) -> list[int]:
        """Stop every node (SIGTERM to each ``ray start``, which stops its node), then SIGKILL
        what is left of Ray in the namespace; the pids that had to be killed."""
        for _, proc, _ in self.nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
        killed = kill_namespace(self.inode, spare={*spare, *self._ancestors()})
        for n in range(len(self.nodes) + 3):
            shutil.rmtree(f"/tmp/ae-ray-{os.getpid()}-{n}", ignore_errors=True)
        return killed


class NodeDockersUnavailable(RuntimeError):
    """No Docker daemon can be started per Ray node here (no dockerd, no host daemon to load
    images from, or a daemon that did not answer); the message says which."""


class NodeDockers:
    """A Docker daemon per Ray node, inside the loopback-only namespace the Ray suite runs in.

    Each has its own socket, data, exec root and pidfile, and runs with ``--bridge=none`` and no
    iptables: a bridge would add an interface to the namespace Ray runs in (Ray may only ever
    see loopback), and a daemon with no bridge in a namespace of its own touches nothing of the
    host's daemon (only in the host's namespace does ``--bridge=none`` delete its docker0). So
    their containers share the namespace's loopback, each env bound to its node's address: the
    Docker sandbox's no-bridge mode. The images envs build FROM are copied from the host's daemon
    (``docker save | docker load``). ``close`` removes every container and stops each daemon."""

    def __init__(self, count: int, images: Iterable[str] = ("python:3.11-slim",),
                 answer_within: float = 60):
        if not loopback_only():
            raise AssertionError("node daemons run only inside a loopback-only network namespace")
        self.dockerd, self.docker = shutil.which("dockerd"), shutil.which("docker")
        if not self.dockerd or not self.docker:
            raise NodeDockersUnavailable("dockerd and the docker client are not on PATH")
        self.roots = [Path(f"/tmp/ae-dk-{os.getpid()}-{n}") for n in range(count)]
        self.procs: list[subprocess.Popen] = []
        try:
            for root in self.roots:
                self._start(root)
            for root, proc in zip(self.roots, self.procs):
                self._answers(root, proc, answer_within)
            for image in images:
                self._copy(image)
        except BaseException:
            self.close()
            raise

    def host(self, n: int) -> str:
        """Node n's DOCKER_HOST."""
        return f"unix://{self.roots[n]}/docker.sock"

    def _start(self, root: Path) -> None:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        with open(root / "dockerd.log", "w") as out:
            self.procs.append(subprocess.Popen(
                [self.dockerd, f"--host=unix://{root}/docker.sock", f"--data-root={root}/data",
                 f"--exec-root={root}/exec", f"--pidfile={root}/docker.pid", "--bridge=none",
                 "--iptables=false", "--ip-masq=false", "--ip-forward=false",
                 "--userland-proxy=false"], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True))

    def _answers(self, root: Path, proc: subprocess.Popen, within: float) -> None:
        deadline = time.monotonic() + within
        while subprocess.run([self.docker, "-H", f"unix://{root}/docker.sock", "version"],
                             capture_output=True).returncode:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise NodeDockersUnavailable(
                    f"the node daemon of {root} did not answer within {within:g}s:\n"
                    + (root / "dockerd.log").read_text(errors="replace")[-2000:])
            time.sleep(0.2)

    def _copy(self, image: str) -> None:
        saved = subprocess.run([self.docker, "save", image], capture_output=True)
        if saved.returncode:
            raise NodeDockersUnavailable(f"the host's daemon could not save {image} for the node "
                                         f"daemons: {saved.stderr.decode(errors='replace')[-500:]}")
        for n in range(len(self.roots)):
            loaded = subprocess.run([self.docker, "-H", self.host(n), "load"], input=saved.stdout,
                                    capture_output=True)
            assert loaded.returncode == 0, loaded.stderr.decode(errors="replace")[-2000:]

    def containers(self, n: int, label: str = "agentenv.owner") -> list[str]:
        """The ids of node n's containers that carry ``label``."""
        done = subprocess.run([self.docker, "-H", self.host(n), "ps", "-aq", "--filter",
                               f"label={label}"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    def close(self) -> None:
        for n, proc in enumerate(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(Exception):
                    ids = subprocess.run([self.docker, "-H", self.host(n), "ps", "-aq"],
                                         capture_output=True, text=True, timeout=60).stdout.split()
                    if ids:
                        subprocess.run([self.docker, "-H", self.host(n), "rm", "-f", *ids],
                                       capture_output=True, timeout=120)
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for root in self.roots:
            unmount_under(root)
            shutil.rmtree(root, ignore_errors=True)


def unmount_under(root: Path) -> None:
    """Unmount what a daemon left mounted at or under ``root`` (its data root bound on itself,
    the nsfs of its namespace, which would keep the namespace alive), deepest first, lazily."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted((p for p in points if p == str(root) or p.startswith(f"{root}/")),
                        key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


# ================================================================ HTTP

@dataclasses.dataclass
class Reply:
    """An HTTP answer: status, headers (an http.client.HTTPMessage), the body as bytes, how long it
    took, and (from Gym.verify) the body that was sent."""
    status: int
    headers: Any
    body: bytes
    elapsed: float = 0.0
    sent: Any = None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def content_type(self) -> str:
        return self.headers.get_content_type()

    @property
    def set_cookie(self) -> list[str]:
        return self.headers.get_all("Set-Cookie") or []


def request(url: str, method: str = "POST", body: Any = None, headers: dict | None = None,
            cookie: str | bytes | None = None, timeout: float = 60) -> Reply:
    """One HTTP request on a fresh connection: bytes as they are, an iterator of chunks sent
    chunked, anything else as JSON; ``cookie`` the Gym session's (bytes as they are, too)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    sent: dict[str, Any] = {}
    chunked = hasattr(body, "__next__")            # an iterator of chunks: sent chunked
    if body is not None:
        if not chunked and not isinstance(body, (bytes, bytearray)):
            body = json.dumps(body).encode()
        sent["Content-Type"] = "application/json"
    if cookie is not None:
        sent["Cookie"] = (COOKIE.encode() + b"=" + cookie) if isinstance(cookie, bytes) \
            else f"{COOKIE}={cookie}"
    sent.update(headers or {})
    started = time.monotonic()
    try:
        conn.request(method, target, body=body, headers=sent, encode_chunked=chunked)
        resp = conn.getresponse()
        return Reply(resp.status, resp.headers, resp.read(), time.monotonic() - started)
    finally:
        conn.close()


def _message_of(headers: Any) -> http.client.HTTPMessage:
    """aiohttp's headers as an http.client.HTTPMessage (what request() answers), repeats kept."""
    message = http.client.HTTPMessage()
    for key, value in headers.items():
        message[key] = value
    return message


# ================================================================ /metrics

class Page:
    """A scraped /metrics page (or its text), parsed whole by prometheus_client's parser: its
    families by name, and each sample's value by name and labels."""

    def __init__(self, text: str):
        from prometheus_client.parser import text_string_to_metric_families

        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for f in self.families.values() for s in f.samples}

    def value(self, name: str, **labels: str) -> float:
        """A sample's value; 0 for a labelled series never recorded (as Prometheus reads it)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def by(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        """Every sample of ``name`` by the values of ``keys``, zeros left out."""
        return {tuple(dict(labels)[k] for k in keys): v for (n, labels), v in self.samples.items()
                if n == name and v}


def scrape(base: str, headers: dict | None = None) -> Page:
    """GET base/metrics, parsed."""
    reply = request(base + "/metrics", "GET", headers=headers)
    assert reply.status == 200, reply.text
    assert reply.content_type == "text/plain"
    return Page(reply.text)


# ================================================================ the server, as a process

class Server:
    """A server of ours as a subprocess: ``serve`` or the Gym resources server; its log (stdout and
    stderr), its state dir, its env processes. Ready once it answers ``GET /`` at all."""

    def __init__(self, argv: list[str], folder: Path, *, state: Path | None = None,
                 cwd: Path = REPO, env: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None, port: int | None = None,
                 ready_within: float = 90):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.state = state or folder / "state"
        self.port = port or free_port()
        self.url, self.ws_url = f"http://{HOST}:{self.port}", f"ws://{HOST}:{self.port}"
        self.headers = headers or {}           # what every request of ours carries (a token)
        self.log_path = folder / f"server-{self.port}.log"
        self.terminated = False                # SIGTERM sent: never twice
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([arg.replace("{port}", str(self.port)) for arg in argv],
                                     cwd=cwd, env=environ(self.state, **(env or {})),
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + ready_within
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=2):
                    break
            except urllib.error.HTTPError:
                break                          # any answer (Gym counts a 404 or a 401 as ready)
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the server did not answer in {ready_within:g}s:\n{self.log()}")
            time.sleep(0.05)

    @classmethod
    def serve(cls, bundle: Path, folder: Path, *flags: str, sandbox: str = "local",
              state: Path | None = None, env: dict[str, str] | None = None,
              headers: dict[str, str] | None = None) -> Server:
        """``python agentenv.py serve BUNDLE --sandbox SANDBOX --port P FLAGS``."""
        return cls([sys.executable, str(REPO / "agentenv.py"), "serve", str(bundle), "--sandbox",
                    sandbox, "--port", "{port}", *flags], folder, state=state, env=env,
                   headers=headers)

    @classmethod
    def openenv_reference(cls, folder: Path, env: dict[str, str] | None = None) -> Server:
        """The reference OpenEnv server (tests/openenv_reference.py: OpenEnv 0.10's own
        ``create_app`` and ``MCPEnvironment``, notes-v1's tools) that test_openenv_parity holds
        ``serve`` against; ``env`` e.g. MAX_CONCURRENT_ENVS or REFERENCE_TOOL_TIMEOUT."""
        return cls([sys.executable, str(REPO / "tests" / "openenv_reference.py"), "--port", "{port}"],
                   folder, env=env, ready_within=120)

    @classmethod
    def gym(cls, folder: Path, config: dict, instance: str | None = None, *,
            app: Path | None = None, env: dict[str, str] | None = None, **settings: Any) -> Server:
        """The resources server as NeMo Gym starts it: ``config`` as YAML in NEMO_GYM_CONFIG_DICT,
        with host and port (and ``settings``) added under the resources server of ``instance``
        (the config's first by default), that name in NEMO_GYM_CONFIG_PATH; ``python app.py`` in
        ``app`` (a folder write-gym wrote) with PYTHONPATH set to it, or with no ``app``
        ``agentenv.run_gym_server()`` of this repository."""
        port = free_port()
        config = copy.deepcopy(config)
        instance = instance or next(iter(config))
        server = next(iter(config[instance]["resources_servers"].values()))
        server.update(host=HOST, port=port, **settings)
        argv = [sys.executable, "app.py"] if app else \
            [sys.executable, "-c", "import agentenv; agentenv.run_gym_server()"]
        return cls(argv, folder, cwd=app or REPO, port=port, env={
            "NEMO_GYM_CONFIG_DICT": yaml.safe_dump(config), "NEMO_GYM_CONFIG_PATH": instance,
            "PYTHONPATH": str(app or REPO), **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        return self.proc.poll() is None and request(self.url + "/health", "GET",
                                                    headers=self.headers, timeout=10).status == 200

    def env_pids(self) -> set[int]:
        """Live processes with this server's state dir in their environment: its env processes,
        found even once the server is gone."""
        return {pid for pid, _ in processes_with_env("AGENTENV_STATE_DIR", str(self.state))
                if pid != self.pid}

    def records(self) -> dict[int, Path]:
        """The local sandbox's records of the env processes it started: pid -> record file."""
        root = self.state / "local"
        return {int(p.name): p for p in root.glob("*/*") if p.name.isdigit()} if root.is_dir() else {}

    def wait_envs(self, count: int, timeout: float = 20) -> set[int]:
        """The server's env processes, once there are ``count`` of them."""
        def counted() -> set[int] | None:
            pids = self.env_pids()
            return pids if len(pids) == count else None
        return wait_until(counted, timeout, f"{count} env process(es) of the server")

    def no_envs(self, timeout: float = 15) -> None:
        wait_until(lambda: not self.env_pids() and not self.records(), timeout,
                   "every env process of the server is gone, and its record")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def terminate(self) -> None:
        """SIGTERM, once: a second one is never sent."""
        if self.proc.poll() is None and not self.terminated:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 45) -> int:
        """SIGTERM (once), the exit code; nothing of the server may be left running, nor recorded."""
        self.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not exit within {timeout:g}s:\n{self.log()}")
        finally:
            self._log.close()
        leftover = self.env_pids()
        self.reap()                              # ours: never left running, whatever happens
        assert not leftover, f"env processes {leftover} outlived the server"
        assert not self.records(), f"records left in the state dir: {self.records()}"
        # its own folder (a Ray node's hosts on this machine keep theirs, as long as they live)
        own = list((self.state / "local").glob(f"*:{self.pid}:*"))
        assert not own, f"a stopped server left {own} for the next start to sweep"
        return code

    def kill(self) -> None:
        """SIGKILL, and then its env processes (their records stay, as a crash leaves them)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()
        self.reap()

    def reap(self) -> None:
        for pid in self.env_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def running(server: Server):
    """The server for a block: killed if the block fails, else stopped, having exited 0."""
    try:
        yield server
    except BaseException:
        server.kill()
        raise
    code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.log()[-3000:]}"


@contextlib.contextmanager
def serving(bundle: Path, folder: Path, *flags: str, **kwargs: Any):
    """``running(Server.serve(bundle, folder, *flags, ...))``."""
    with running(Server.serve(bundle, folder, *flags, **kwargs)) as server:
        yield server


# ================================================================ NeMo Gym: rows, Responses, the client

def gym_row(bundle: Any, index: int, split: str = "all", tools: Iterable[str] | None = None) -> dict:
    """The row of the task at ``split[index]`` as write-gym writes it, in short: its first prompt
    as the user's message, ``tools`` (names) as Responses function tools (with none, the server
    checks no tools), agent_ref, split, index and task_id. ``bundle``: a folder or a Bundle."""
    import agentenv

    loaded = bundle if isinstance(bundle, agentenv.Bundle) else agentenv.Bundle.load(bundle)
    task = loaded.splits[split][index]
    params: dict[str, Any] = {"input": [{"role": "user", "content": task.first_prompt[0]}]}
    if tools:
        params["tools"] = [{"type": "function", "name": n, "description": "", "strict": False,
                            "parameters": {"type": "object", "properties": {}}} for n in tools]
    return {"responses_create_params": params,
            "agent_ref": {"type": "responses_api_agents",
                          "name": f"{agentenv.gym_name(loaded.name)}_simple_agent"},
            "split": split, "index": index, "task_id": task.id}


def gym_rows(bundle: Any, split: str = "all", tools: Iterable[str] | None = None) -> dict[str, dict]:
    """A row (gym_row) per task of the split, by task name."""
    import agentenv

    loaded = bundle if isinstance(bundle, agentenv.Bundle) else agentenv.Bundle.load(bundle)
    return {task.name: gym_row(loaded, i, split, tools) for i, task in enumerate(loaded.splits[split])}


def message(text: str) -> dict:
    """The assistant's message in a Responses object's output."""
    return {"type": "message", "id": "msg_final", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def tool_items(n: int, name: str, arguments: dict, output: str) -> list[dict]:
    """A tool call and its answer, as items of a Responses object's output."""
    return [{"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": name,
             "arguments": json.dumps(arguments), "status": "completed"},
            {"type": "function_call_output", "call_id": f"call_{n}", "output": output}]


def responses(text: str | None = None, output: Iterable[dict] = ()) -> dict:
    """A Responses object as Gym's simple_agent sends it to /verify: the items of the rollout, then
    the model's final message ``text`` (none when None)."""
    return {"id": "resp_1", "object": "response", "created_at": 0, "model": "policy_model",
            "status": "completed",
            "output": [*output, *([message(text)] if text is not None else [])],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def client(timeout: float = 120, limit: int = 100) -> aiohttp.ClientSession:
    """An aiohttp session as Gym's own client is: no cookie jar (cookies travel by hand)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 cookie_jar=aiohttp.DummyCookieJar(),
                                 timeout=aiohttp.ClientTimeout(total=timeout))


MINE = object()                                  # Gym.post's cookie: the rollout's own


class Gym:
    """One rollout on a Gym surface, as Gym's simple_agent plays it: the row to /seed_session with
    no cookie; the cookies it sets with every tool call (a POST of the JSON arguments to the tool's
    route, answered with the text the model reads), with /verify (the row and the Responses object
    of the rollout: its calls and the final message) and /close_session. Every method answers a
    Reply (``strict``: every reply must be a 200); ``seed`` must be a 200.

    ``http``: the aiohttp session to use (``client()``); without one, each request opens its own.
    ``base``: a URL, or a Server (whose headers every request then carries)."""

    def __init__(self, base: str | Server, row: dict, http: aiohttp.ClientSession | None = None, *,
                 headers: dict | None = None, prefix: str = "", strict: bool = False,
                 verify_cookies: dict[str, str] | None = None):
        if isinstance(base, Server):
            headers, base = {**base.headers, **(headers or {})}, base.url
        self.base, self.row, self.http = base.rstrip("/") + prefix, row, http
        self.headers, self.strict = dict(headers or {}), strict
        self.verify_cookies = verify_cookies or {}     # more cookies on /verify (Gym's agent's)
        self.cookies: dict[str, str] = {}
        self.output: list[dict] = []                   # the rollout's tool calls, as Responses items

    @property
    def cookie(self) -> str | None:
        return self.cookies.get(COOKIE)

    async def post(self, route: str, body: Any = None, cookie: Any = MINE) -> Reply:
        """POST ``body`` (bytes as they are, else as JSON) with ``cookie``: the rollout's own, none,
        a value of the session cookie, or a dict of cookies."""
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = bytes(body) if isinstance(body, (bytes, bytearray)) else json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        jar = self.cookies if cookie is MINE else {COOKIE: cookie} if isinstance(cookie, str) \
            else cookie or {}
        if jar:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in jar.items())
        async with contextlib.AsyncExitStack() as stack:
            http_ = self.http or await stack.enter_async_context(client(60))
            started = time.monotonic()
            async with http_.post(self.base + route, data=data, headers=headers) as resp:
                reply = Reply(resp.status, _message_of(resp.headers), await resp.read(),
                              time.monotonic() - started)
                self.cookies.update({k: m.value for k, m in resp.cookies.items()})
        return reply

    def _checked(self, reply: Reply) -> Reply:
        if self.strict:
            assert reply.status == 200, (reply.status, reply.text)
        return reply

    async def seed(self) -> Reply:
        reply = await self.post("/seed_session", self.row, cookie=None)
        assert reply.status == 200, reply.text
        return reply

    async def call(self, name: str, **arguments: Any) -> Reply:
        reply = await self.post(f"/{name}", arguments)
        self.output += tool_items(len(self.output) // 2, name, arguments, reply.text)
        return self._checked(reply)

    async def verify(self, final: str | None = "Saved.", response: Any = None) -> Reply:
        body = {**self.row, "response": response or responses(final, self.output)}
        reply = await self.post("/verify", body, cookie={**self.cookies, **self.verify_cookies})
        reply.sent = body
        return self._checked(reply)

    async def close(self) -> Reply:
        return self._checked(await self.post("/close_session", {}))


class SyncGym:
    """Gym for code with no event loop (a thread of its own will do): each method runs Gym's on a
    loop of its own, a request on a connection of its own. Takes Gym's arguments."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.aio = Gym(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.aio, name)
        if asyncio.iscoroutinefunction(found):
            return lambda *args, **kwargs: run(found(*args, **kwargs), 90)
        return found


# ================================================================ OpenEnv: the socket client

class Socket:
    """A raw WebSocket (/ws or /mcp): frames out, JSON frames back."""

    def __init__(self, url: str, headers: dict | None = None, protocols: list[str] | None = None):
        from websockets.sync.client import connect

        self.ws = connect(url, proxy=None, open_timeout=10, close_timeout=2, max_size=2**25,
                          additional_headers=headers or {},
                          subprotocols=protocols).__enter__()  # (websockets warns otherwise)

    def send(self, message: Any) -> None:
        self.ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))

    def recv(self, timeout: float = 60) -> dict:
        return json.loads(self.ws.recv(timeout=timeout))

    def ask(self, message: Any, timeout: float = 60) -> dict:
        self.send(message)
        return self.recv(timeout)

    def closed_with(self, timeout: float = 10) -> int | None:
        """The code of the close frame the server sent (None: dropped without one)."""
        from websockets.exceptions import ConnectionClosed

        try:
            while True:
                self.ws.recv(timeout=timeout)
        except ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd is not None else None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()

    def drop(self) -> None:
        """Go away as a client that vanished: the connection shut, no close frame."""
        with contextlib.suppress(OSError):
            self.ws.socket.shutdown(socket.SHUT_RDWR)
        self.ws.socket.close()

    def __enter__(self) -> Socket:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ================================================================ bundles and files

def copy_bundle(dest: Path, source: Path = NOTES) -> Path:
    """A private copy of a bundle to change, at ``dest`` (its folder name is the bundle's name)."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    return dest


def patch(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not in {path} once"
    path.write_text(text.replace(old, new))


SLEEPY = '''\
"""The notebook env of notes-v1 with a sleep tool; with NEVER_READY set, it never listens."""
import os
import sys
import time

if os.environ.get("NEVER_READY"):
    print("sleepy: started, but waiting for a database that never comes", file=sys.stderr, flush=True)
    time.sleep(3600)
    sys.exit(1)

import server as notebook

notebook.TOOLS.append({"name": "sleep", "description": "Sleep for some seconds.",
                       "inputSchema": notebook._schema("seconds")})
notebook.SCHEMAS["sleep"] = notebook.TOOLS[-1]["inputSchema"]
_call_tool = notebook.call_tool


def call_tool(name, args, role):
    if name == "sleep" and isinstance(args, dict) and isinstance(args.get("seconds"), str):
        print(f"sleepy: sleeping {args['seconds']}s", file=sys.stderr, flush=True)
        time.sleep(float(args["seconds"]))
        return "slept", False
    return _call_tool(name, args, role)


notebook.call_tool = call_tool
notebook.main()
'''


def with_sleep_tool(root: Path) -> Path:
    """Give the notebook env of a copy of notes-v1 a ``sleep`` tool (seconds, as text); with
    NEVER_READY in its environment the env never listens."""
    import agentenv

    notebook = root / "envs" / "notebook"
    (notebook / "sleepy.py").write_text(SLEEPY)
    patch(notebook / "Dockerfile", "COPY server.py .", "COPY server.py sleepy.py ./")
    patch(notebook / "Dockerfile", 'CMD ["python", "server.py"]', 'CMD ["python", "sleepy.py"]')
    assert "sleepy.py" in agentenv.Bundle.load(root).envs["notebook"].command[-1]
    return root


def one_turn_task(env: str, prompt: str, artifact: str = "check_notes", **agent: Any) -> list[dict]:
    """A task of one turn on ``env``, scored by ``artifact``; ``agent``: more keys of its
    deploy_agent step (system_prompt), and ``timeout_seconds`` / ``verifier_id`` of its steps."""
    timeout = agent.pop("timeout_seconds", None)
    verifier = agent.pop("verifier_id", None)
    return [{"id": "env", "type": "deploy_env", "env_id": env},
            {"id": "agent", "type": "deploy_agent", "agent_name": "writer", "env_ids": [env],
             "role": "writer", **agent},
            {"id": "turn1", "type": "prompt_agent", "agent_name": "writer", "prompt_id": "turn1",
             "prompt": prompt, **({"timeout_seconds": timeout} if timeout is not None else {})},
            {"id": "check", "type": "env_outcome_verifier", "env_id": env,
             "file_artifact_id": artifact, **({"verifier_id": verifier} if verifier else {}),
             "score_aggregator": "all_pass"}]


def resources_config(name: str, **server: Any) -> dict:
    """A Gym config of one resources server ``name`` (entrypoint app.py, domain agent, ``server``)."""
    return {name: {"resources_servers": {name: {"entrypoint": "app.py", "domain": "agent", **server}}}}


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def labelled(docker_client: Any, label: str) -> list:
    """The containers (running or not) that carry a label (``key`` or ``key=value``)."""
    return docker_client.containers.list(all=True, filters={"label": label}, ignore_removed=True)


def remove_quietly(containers: Iterable[Any]) -> None:
    for container in containers:
        with contextlib.suppress(Exception):
            container.remove(force=True)


def started_here(owner: str) -> bool:
    """Whether a container's owner (``host:pid:start``) is this test process or a process it
    started (a serve of a test): other runs on the machine have boxes of their own, never ours to
    judge."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    seen = int(pid)
    while seen > 1:
        if seen == os.getpid():
            return True
        try:
            seen = int(Path(f"/proc/{seen}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def boxes_of(docker_client: Any, pid: int) -> list:
    """The boxes a server of ours (its pid) labelled, alive or not: other runs' boxes left out."""
    return [c for c in labelled(docker_client, "agentenv.box")
            if c.labels.get("agentenv.owner", "").split(":")[1:2] == [str(pid)]]


async def box_of(gym: Gym, boxes: Any) -> Any:
    """The box a Gym rollout works in, of ``boxes`` (or of what ``boxes()`` lists once the
    rollout's bash has run, so its box exists): the one where a marker its bash writes shows up
    (None if none)."""
    marker = f"mark-{time.monotonic_ns()}"
    await gym.call("bash", command=f"echo {marker} > /tmp/marker")
    for box in (boxes() if callable(boxes) else boxes):
        try:
            ran = await asyncio.to_thread(box.exec_run, ["cat", "/tmp/marker"])
        except Exception:                   # noqa: BLE001 - a box already removed
            continue
        if ran.output.decode().strip() == marker:
            return box
    return None

