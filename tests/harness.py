"""harness.py: the one test harness every suite shares (``from tests.harness import ...``).

What is here: ``run`` (a coroutine to its end, within a deadline), ``free_port``, ``wait_until``,
and ``Server``: a server of ours as a subprocess, for the suites that start, load, break and stop
it.

A server runs as ``sys.executable`` (signals to pyenv's ``python`` shim never reach the server),
with its own AGENTENV_STATE_DIR, so its env processes can be found by that variable in their
environment (a /proc scan) even after the server is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def run(coro, timeout: float = 60):
    """Run one coroutine to its end on a fresh event loop, within a deadline."""
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro
    return asyncio.run(bounded())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


class Server:
    """A server of ours as a subprocess: ``serve`` or the Gym resources server (run_gym_server);
    its log, its state dir, its env processes."""

    def __init__(self, argv: list[str], folder: Path, state: Path | None = None, **extra_env: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.state = state or folder / "state"
        self.port = int(extra_env.pop("PORT", 0)) or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / f"server-{self.port}.log"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("NEMO_GYM_", "MAX_CONCURRENT_ENVS", "AGENTENV_TOKEN"))}
        env.update(AGENTENV_STATE_DIR=str(self.state), PYTHONUNBUFFERED="1", **extra_env)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([arg.replace("{port}", str(self.port)) for arg in argv],
                                     cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=2):
                    break
            except urllib.error.HTTPError:
                break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the server did not answer in 90s:\n{self.log()}")
            time.sleep(0.05)

    @classmethod
    def serve(cls, bundle: Path, folder: Path, *flags: str, sandbox: str = "local",
              state: Path | None = None) -> Server:
        return cls([sys.executable, str(REPO / "agentenv.py"), "serve", str(bundle), "--sandbox",
                    sandbox, "--port", "{port}", *flags], folder, state)

    @classmethod
    def gym(cls, bundle: Path, folder: Path, **settings) -> Server:
        """The resources server as NeMo Gym runs it, its settings in NEMO_GYM_CONFIG_DICT."""
        port = free_port()
        config = {"faults": {"resources_servers": {"faults": {
            "entrypoint": "app.py", "domain": "agent", "bundle": str(bundle), "sandbox": "local",
            "host": "127.0.0.1", "port": port, **settings}}}}
        return cls([sys.executable, "-c", "import agentenv; agentenv.run_gym_server()"], folder,
                   PORT=str(port), NEMO_GYM_CONFIG_DICT=yaml.safe_dump(config),
                   NEMO_GYM_CONFIG_PATH="faults", PYTHONPATH=str(REPO))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def env_pids(self) -> set[int]:
        """Live processes with this server's state dir in their environment: its env processes,
        found even once the server is gone."""
        marker = f"AGENTENV_STATE_DIR={self.state}".encode()
        found = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in (self.pid, os.getpid()):
                continue
            try:
                if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") and \
                        alive(int(entry)):
                    found.add(int(entry))
            except OSError:
                continue
        return found

    def records(self) -> dict[int, Path]:
        """The local sandbox's records of the env processes it started: pid -> record file."""
        root = self.state / "local"
        return {int(p.name): p for p in root.glob("*/*") if p.name.isdigit()} if root.is_dir() else {}

    def wait_envs(self, count: int, timeout: float = 20) -> set[int]:
        def counted() -> set[int] | None:
            pids = self.env_pids()
            return pids if len(pids) == count else None
        return wait_until(counted, timeout, f"{count} env process(es) of the server")

    def no_envs(self, timeout: float = 15) -> None:
        wait_until(lambda: not self.env_pids() and not self.records(), timeout,
                   "every env process of the server is gone, and its record")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 45) -> int:
        """SIGTERM (once), the exit code; nothing of the server may be left running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not exit within {timeout:g}s:\n{self.log()}")
        self._log.close()
        leftover = self.env_pids()
        self.reap()
        assert not leftover, f"env processes {leftover} outlived the server"
        return code

    def kill(self) -> None:
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
    try:
        yield server
    except BaseException:
        server.kill()
        raise
    assert server.stop() == 0, server.log()[-3000:]
