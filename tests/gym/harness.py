"""Run a resources server under the REAL NeMo Gym 0.7 (installed by ``.ci/gym-venv.sh``).

Four things:

* ``gym_venv_problem()``: ``None`` when the Gym venv is ready, else the skip reason (it starts with
  ``SKIP_REASON``); ``skip_unless_gym_venv()`` skips a test with it (fails instead when
  ``AGENTENV_REQUIRE_GYM=1``).
* ``run_lightest(root, name, rows, work_dir=...)``: no CLI, no Ray, no head server. Starts
  ``<root>/resources_servers/<name>/app.py`` and Gym's own ``responses_api_agents/simple_agent/app.py``
  exactly as Gym launches a server (``cd <server dir> && <venv>/bin/python app.py`` with
  ``NEMO_GYM_CONFIG_DICT``, ``NEMO_GYM_CONFIG_PATH``, ``PYTHONPATH=<server dir>``), with the
  scripted fake model as ``policy_model``; POSTs each row to the agent's ``/run`` and returns the
  verify JSONs. Exercises the real simple_agent loop, cookies and ``/verify``.
* ``run_cli(root, name, jsonl, work_dir=...)``: the full CLI. ``gym env start`` (head server, Ray,
  resources server, simple_agent, legacy_agent, openai_model pointed at the fake), then
  ``gym eval run --no-serve``; returns the rollouts, the aggregate metrics and the command lines.
  ``more_servers=[(root, name), ...]`` starts further resources servers in the same run, each row
  then going to its own ``agent_ref``; ``reverify=True`` then runs ``gym eval reverify`` on them.
* ``resources_server(dir, name, work_dir=...)``: one resources server's ``app.py`` alone, as Gym
  starts it (the reference server of tests/test_gym_parity.py, ``REFERENCE_DIR``); yields its URL.

Every child runs in its own session (``start_new_session=True``), is stopped with SIGINT (the only
signal Gym shuts down cleanly on) and, failing that, SIGKILLed. Every child's environment carries a
per-run tag, so whatever survives the stop (even processes Ray re-parented or moved to another
session) is found through ``/proc/*/environ``, killed, and reported in ``run.leftovers``: a clean
run has none.

Typical use in a test (the repository root on ``sys.path``)::

    from tests.gym import harness
    harness.skip_unless_gym_venv()
    server = harness.prepare_root(tmp_path / "root", NAME, SOURCE_DIR,
                                  extra_files={"agentenv.py": harness.REPO / "agentenv.py"}, rows=rows)
    run = harness.run_lightest(tmp_path / "root", NAME, rows, work_dir=tmp_path / "light")
    assert run.result["reward"] == 1.0 and run.leftovers == []
    cli = harness.run_cli(tmp_path / "root", NAME, server / "data/example.jsonl", work_dir=tmp_path / "cli")
    assert [r["reward"] for r in cli.rollouts] == [1.0] and cli.leftovers == []

``python -m tests.gym.selfcheck`` does exactly that with the stand-in server.

What is here is the Gym venv's own: finding it, Gym roots and configs, and a ``ProcessGroup`` of
children (run tags, SIGINT, Ray's leftovers), which ``tests/harness.py``'s ``Server`` (one server
of ours, SIGTERM) is not. Free ports, the /proc scan, JSONL files and HTTP requests are
``tests/harness.py``'s.

Nothing here reads the repository's ``../shared``; the Gym venv is found through
``AGENTENV_GYM_VENV`` (default ``~/.cache/agentenv-tests/nemo-gym-0.7``), as ``.ci/gym-venv.sh``
builds it.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from tests.harness import (HOST, LoopbackNamespace, free_ports, processes_with_env, read_jsonl,  # noqa: F401
                           request, write_jsonl)

REPO = Path(__file__).resolve().parents[2]
STANDIN_DIR = Path(__file__).resolve().parent / "standin"
GYM_VERSION = "0.7.0"
SKIP_REASON = "NeMo Gym 0.7 is not installed for the tests: run bash .ci/gym-venv.sh"
MARKER_NAME = ".agentenv-gym-complete"          # written by .ci/gym-venv.sh once the venv is complete
RUN_TAG_VAR = "AGENTENV_GYM_HARNESS_RUN"       # in every child's environment: finds leftovers


class GymHarnessError(RuntimeError):
    """A Gym run failed; the message carries the tails of the relevant logs."""


# ----------------------------------------------------------------------------- the venv

def gym_venv() -> Path:
    return Path(os.environ.get("AGENTENV_GYM_VENV")
                or Path.home() / ".cache" / "agentenv-tests" / "nemo-gym-0.7")


def site_packages(venv: Path | None = None) -> Path:
    venv = venv or gym_venv()
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise GymHarnessError(f"no lib/python3*/site-packages in {venv}")
    return found[-1]


def simple_agent_dir(venv: Path | None = None) -> Path:
    return site_packages(venv) / "responses_api_agents" / "simple_agent"


def gym_venv_problem(venv: Path | None = None) -> str | None:
    """None when the Gym venv is ready, else why not (starting with SKIP_REASON)."""
    venv = venv or gym_venv()
    if not (venv / MARKER_NAME).is_file():
        return f"{SKIP_REASON} (no complete venv at {venv})"
    for need in (venv / "bin" / "python", venv / "bin" / "gym"):
        if not os.access(need, os.X_OK):
            return f"{SKIP_REASON} ({need} is missing)"
    try:
        agent = simple_agent_dir(venv) / "app.py"
    except GymHarnessError as exc:
        return f"{SKIP_REASON} ({exc})"
    if not agent.is_file():
        return f"{SKIP_REASON} ({agent} is missing)"
    try:
        subprocess.run([str(venv / "bin" / "python"), "-c", "pass"], check=True, timeout=60,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{SKIP_REASON} ({venv}/bin/python does not run: {exc})"
    return None


def skip_unless_gym_venv(venv: Path | None = None) -> None:
    """pytest.skip with the reason when the venv is not ready (pytest.fail when AGENTENV_REQUIRE_GYM=1)."""
    import pytest

    problem = gym_venv_problem(venv)
    if problem is None:
        return
    if os.environ.get("AGENTENV_REQUIRE_GYM") == "1":
        pytest.fail(f"{problem} (AGENTENV_REQUIRE_GYM=1, so this is an error, not a skip)", pytrace=False)
    pytest.skip(problem)


# ----------------------------------------------------------------------------- Gym roots

def prepare_root(root: Path, name: str, source: Path, *, extra_files: dict[str, Any] | None = None,
                 rows: Iterable[dict] | None = None, data_file: str = "data/example.jsonl") -> Path:
    """Copy a server folder into ``<root>/resources_servers/<name>/`` and return that folder.

    ``extra_files`` maps a path relative to the server folder to a source ``Path`` (copied) or to
    ``str``/``bytes`` content (written): e.g. ``{"agentenv.py": REPO / "agentenv.py"}``. ``rows``,
    when given, are written as JSONL to ``data_file`` (relative to the server folder).
    """
    dest = Path(root) / "resources_servers" / name
    shutil.copytree(source, dest, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", ".venv", "*.pyc", ".pytest_cache"))
    for rel, what in (extra_files or {}).items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(what, Path):
            shutil.copy2(what, target)
        elif isinstance(what, bytes):
            target.write_bytes(what)
        else:
            target.write_text(what)
    if rows is not None:
        write_jsonl(dest / data_file, rows)
    return dest


def scripted_row(script: list[dict], user_text: str, *, tools: list[dict] | None = None,
                 agent: str | None = None, **extra: Any) -> dict:
    """A data row whose fake-model script is ``script`` (stored as the JSON string metadata needs)."""
    params: dict[str, Any] = {"input": [{"role": "user", "content": user_text}],
                              "metadata": {"script": json.dumps(script)}}
    if tools:
        params["tools"] = tools
    row: dict[str, Any] = {"responses_create_params": params}
    if agent:
        row["agent_ref"] = {"type": "responses_api_agents", "name": agent}
    return row | extra


def server_config_path(root: Path, name: str) -> Path:
    return Path(root) / "resources_servers" / name / "configs" / f"{name}.yaml"


def _instances(config: dict, server_type: str, impl: str | None = None) -> list[str]:
    return [inst for inst, body in config.items()
            if isinstance(body, dict) and isinstance(body.get(server_type), dict)
            and (impl is None or impl in body[server_type])]


def find_instances(config: dict, name: str) -> tuple[str, str]:
    """(resources server instance, its simple_agent instance) in a server's config."""
    resources = _instances(config, "resources_servers", name)
    if len(resources) != 1:
        raise GymHarnessError(f"the config must declare exactly one resources_servers.{name} instance, "
                              f"found {resources}")
    agents = [inst for inst in _instances(config, "responses_api_agents", "simple_agent")
              if (config[inst]["responses_api_agents"]["simple_agent"].get("resources_server") or {})
              .get("name") == resources[0]]
    if len(agents) != 1:
        raise GymHarnessError(f"the config must declare exactly one simple_agent for {resources[0]}, "
                              f"found {agents}")
    return resources[0], agents[0]


# ----------------------------------------------------------------------------- processes

def child_env(venv: Path, tag: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a Gym child: this one, minus Python/Gym leftovers, plus the venv on PATH
    (what ``source <venv>/bin/activate`` does), quiet Ray telemetry, and the run tag."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "NEMO_GYM_EXTRA_ROOTS",
            "NEMO_GYM_CONFIG_DICT", "NEMO_GYM_CONFIG_PATH", RUN_TAG_VAR}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYENV_VERSION")}
    env.update({
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "WANDB_MODE": "disabled",
        RUN_TAG_VAR: tag,
    })
    env.update(extra or {})
    return env


def _tagged_pids(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries the run tag."""
    return processes_with_env(RUN_TAG_VAR, tag)


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text[-lines:])


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path


class ProcessGroup:
    """Children of one run: started in their own sessions, stopped with SIGINT, leftovers killed.
    Their home and Ray's temporary folder are the run's own (HOME beside its logs, RAY_TMPDIR a
    short folder of /tmp, for Ray's socket paths), so what Gym's Ray writes (its session, its
    ~/.ray/auth_token) never lands in the user's home."""

    def __init__(self, venv: Path, log_dir: Path):
        self.venv = venv
        self.tag = uuid.uuid4().hex
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.home = self.log_dir.parent / "home"
        self.home.mkdir(exist_ok=True)
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="ae-ray-"))
        self.children: list[Child] = []
        self.leftovers: list[tuple[int, str]] = []

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return child_env(self.venv, self.tag, {"HOME": str(self.home), "RAY_TMPDIR": str(self.ray_tmp),
                                               **(extra or {})})

    def spawn(self, name: str, argv: list[str], *, cwd: Path, env: dict[str, str]) -> Child:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def run(self, name: str, argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> Child:
        """Run a command to completion (SIGINT, then SIGKILL, on timeout); raise on failure."""
        child = self.spawn(name, argv, cwd=cwd, env=env)
        try:
            child.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop(child, grace=20)
            raise GymHarnessError(f"{name} did not finish within {timeout:.0f} s; its log:\n{tail(child.log)}")
        if child.proc.returncode != 0:
            raise GymHarnessError(f"{name} exited with status {child.proc.returncode}; its log:\n"
                                  f"{tail(child.log)}")
        return child

    @staticmethod
    def stop(child: Child, grace: float = 30, whole_group: bool = True) -> None:
        """SIGINT the child (its whole process group unless whole_group=False), SIGKILL after grace."""
        proc = child.proc
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if whole_group:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop_all(self, grace: float = 30, settle: float = 10) -> list[tuple[int, str]]:
        """Stop every child (newest first); then kill, and record, whatever still carries the tag."""
        for child in reversed(self.children):
            self.stop(child, grace)
        deadline = time.monotonic() + settle
        leftovers = _tagged_pids(self.tag)
        while leftovers and time.monotonic() < deadline:   # e.g. Ray winding down after its parent
            time.sleep(0.5)
            leftovers = _tagged_pids(self.tag)
        for pid, _ in leftovers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.leftovers = leftovers
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return leftovers


def http_post_json(url: str, body: Any, timeout: float) -> tuple[int, Any]:
    reply = request(url, body=body, timeout=timeout)
    try:
        return reply.status, reply.json()
    except ValueError:
        return reply.status, reply.text


def wait_http(url: str, child: Child, timeout: float, *, want_200: bool = False) -> float:
    """Poll url until it answers (any HTTP status, or 200 with want_200); seconds waited.
    Raises (with the child's log) if the child exits or time runs out."""
    start = time.monotonic()
    while True:
        if child.proc.poll() is not None:
            raise GymHarnessError(f"{child.name} exited with status {child.proc.returncode} before "
                                  f"{url} answered; its log:\n{tail(child.log)}")
        try:
            status = request(url, "GET", timeout=3).status
            if not want_200 or status == 200:
                return time.monotonic() - start
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() - start > timeout:
            raise GymHarnessError(f"{url} did not answer{' 200' if want_200 else ''} within {timeout:.0f} s; "
                                  f"the log of {child.name}:\n{tail(child.log)}")
        time.sleep(0.25)


def _show(argv: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """A shell line for the README: ``cd DIR && VAR=val ... argv``."""
    parts = []
    if cwd is not None:
        parts.append(f"cd {shlex.quote(str(cwd))} &&")
    parts += [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    parts.append(shlex.join(argv))
    return " ".join(parts)


# ----------------------------------------------------------------------------- lightest variant

@dataclass
class LightestRun:
    results: list[Any]                    # the /run reply of each row (the verify JSON on success)
    statuses: list[int]                   # the HTTP status of each /run
    config: dict                          # the NEMO_GYM_CONFIG_DICT given to both servers
    config_file: Path                     # the same, as YAML on disk
    commands: list[str]                   # shell lines equivalent to what was started
    timings: dict[str, float]
    logs: dict[str, Path]
    leftovers: list[tuple[int, str]] = field(default_factory=list)
    model_requests: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def result(self) -> Any:
        return self.results[0]


def lightest_config(root: Path, name: str, *, resources_port: int, agent_port: int, model_host: str,
                    model_port: int, head_port: int,
                    resources_overrides: dict | None = None) -> tuple[dict, str, str, str]:
    """(config dict, resources instance, agent instance, model instance): the server's own YAML
    reduced to its resources server and simple_agent, with explicit hosts and ports, and the fake
    model declared as the agent's model server."""
    whole = yaml.safe_load(server_config_path(root, name).read_text())
    resources, agent = find_instances(whole, name)
    rs = copy.deepcopy(whole[resources])
    rs["resources_servers"][name].update({"host": HOST, "port": resources_port})
    rs["resources_servers"][name].update(resources_overrides or {})
    ag = copy.deepcopy(whole[agent])
    ag["responses_api_agents"]["simple_agent"].update({"host": HOST, "port": agent_port})
    model = (ag["responses_api_agents"]["simple_agent"].get("model_server") or {}).get("name", "policy_model")
    config = {
        resources: rs,
        agent: ag,
        model: {"responses_api_models": {"fake": {"host": model_host, "port": model_port,
                                                  "entrypoint": "app.py"}}},
        "head_server": {"host": HOST, "port": head_port},
        "dry_run": False,
    }
    return config, resources, agent, model


def run_lightest(root: Path, name: str, rows: list[dict] | dict, *, work_dir: Path,
                 venv: Path | None = None, model_host: str | None = None, model_port: int | None = None,
                 resources_overrides: dict | None = None, ready_timeout: float = 120,
                 run_timeout: float = 300, check: bool = True) -> LightestRun:
    """The §6.3 lightest variant: resources server + Gym's simple_agent + the fake model, no CLI/Ray.

    With no ``model_port`` the fake model runs on a thread of this process for the duration. Rows
    are POSTed to the agent's ``/run`` one after another. With ``check`` (default) a non-200 /run
    raises GymHarnessError with the logs; otherwise it is returned in ``statuses``/``results``.
    """
    from . import fake_model

    venv = Path(venv or gym_venv())
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    rows = [rows] if isinstance(rows, dict) else list(rows)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    own_model = None
    group = ProcessGroup(venv, work_dir / "logs")
    try:
        if model_port is None:
            own_model = fake_model.start()
            model_host, model_port = own_model.host, own_model.port
        resources_port, agent_port, head_port = free_ports(3)
        config, rs_inst, agent_inst, _ = lightest_config(
            root, name, resources_port=resources_port, agent_port=agent_port,
            model_host=model_host or HOST, model_port=model_port, head_port=head_port,
            resources_overrides=resources_overrides)
        config_yaml = yaml.safe_dump(config, sort_keys=False)
        config_file = work_dir / "gym_config.yaml"
        config_file.write_text(config_yaml)

        python = str(venv / "bin" / "python")
        server_dir = Path(root).resolve() / "resources_servers" / name
        agent_dir = simple_agent_dir(venv)
        commands = []
        children = []
        for inst, cwd in ((rs_inst, server_dir), (agent_inst, agent_dir)):
            shown = {"NEMO_GYM_CONFIG_PATH": inst, "PYTHONPATH": str(cwd)}
            env = group.env(shown | {"NEMO_GYM_CONFIG_DICT": config_yaml})
            commands.append(f"cd {shlex.quote(str(cwd))} && "
                            f"NEMO_GYM_CONFIG_DICT=\"$(cat {shlex.quote(str(config_file))})\" "
                            + _show([python, "app.py"], env=shown))
            children.append(group.spawn(inst, [python, "app.py"], cwd=cwd, env=env))
        t_spawn = time.monotonic()
        wait_http(f"http://{HOST}:{resources_port}/", children[0], ready_timeout)
        wait_http(f"http://{HOST}:{agent_port}/", children[1], ready_timeout)
        timings["ready"] = time.monotonic() - t_spawn

        t_run = time.monotonic()
        results, statuses = [], []
        run_url = f"http://{HOST}:{agent_port}/run"
        for i, row in enumerate(rows):
            status, body = http_post_json(run_url, row, timeout=run_timeout)
            if check and status != 200:
                raise GymHarnessError(
                    f"POST {run_url} (row {i}) answered {status}: {str(body)[:2000]}\n"
                    + "".join(f"--- {c.name} log:\n{tail(c.log)}\n" for c in children))
            statuses.append(status)
            results.append(body)
        commands.append(_show(["curl", "-s", "-X", "POST", "-H", "content-type: application/json",
                               "--data-binary", "@row.json", run_url]))
        timings["rollouts"] = time.monotonic() - t_run
    finally:
        t_stop = time.monotonic()
        leftovers = group.stop_all()
        if own_model is not None:
            own_model.stop()
        timings["stop"] = time.monotonic() - t_stop
        timings["total"] = time.monotonic() - t0
    return LightestRun(results=results, statuses=statuses, config=config, config_file=config_file,
                       commands=commands, timings=timings,
                       logs={c.name: c.log for c in group.children}, leftovers=leftovers,
                       model_requests=list(own_model.requests) if own_model else [])


# ----------------------------------------------------------------------------- one server alone

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"


@contextlib.contextmanager
def resources_server(server_dir: Path, name: str, *, work_dir: Path, venv: Path | None = None,
                     ready_timeout: float = 120):
    """A resources server's ``app.py`` started alone, as Gym starts one (its instance config in
    ``NEMO_GYM_CONFIG_DICT``, ``cd <dir> && <venv>/bin/python app.py``), on a free port; yields its
    URL once ``GET /`` answers, and SIGINTs it (and whatever it started) at the end."""
    venv = Path(venv or gym_venv())
    server_dir = Path(server_dir).resolve()
    port, head_port = free_ports(2)
    config = {name: {"resources_servers": {name: {"entrypoint": "app.py", "domain": "agent",
                                                  "host": HOST, "port": port}}},
              "head_server": {"host": HOST, "port": head_port}, "dry_run": False}
    group = ProcessGroup(venv, Path(work_dir) / "logs")
    env = group.env({"NEMO_GYM_CONFIG_PATH": name, "PYTHONPATH": str(server_dir),
                     "NEMO_GYM_CONFIG_DICT": yaml.safe_dump(config, sort_keys=False)})
    try:
        child = group.spawn(name, [str(venv / "bin" / "python"), "app.py"], cwd=server_dir, env=env)
        wait_http(f"http://{HOST}:{port}/", child, ready_timeout)
        yield f"http://{HOST}:{port}"
    finally:
        leftovers = group.stop_all()
        if leftovers:
            raise GymHarnessError(f"{name} left {leftovers} running")


# ----------------------------------------------------------------------------- full CLI variant

@dataclass
class CliRun:
    rollouts: list[dict]                  # rollouts.jsonl, in completion order
    aggregate: Any                        # rollouts_aggregate_metrics.json (None if absent)
    output_dir: Path
    commands: list[str]                   # the two gym command lines, with their environment
    timings: dict[str, float]
    logs: dict[str, Path]
    start_exit_code: int | None           # gym env start's exit status after SIGINT
    leftovers: list[tuple[int, str]] = field(default_factory=list)
    model_requests: list[tuple[str, Any]] = field(default_factory=list)
    model_served: list[tuple[str, float, float]] = field(default_factory=list)   # (path, began, s
    reverified: list[dict] = field(default_factory=list)   # gym eval reverify's output (reverify=True)
    reverify_aggregate: Any = None                         # and its aggregate metrics
    reverify_left: list[tuple[int, str]] = field(default_factory=list)  # servers it left running


VENV_LINKS = (("responses_api_agents", "simple_agent"), ("environment_servers", "legacy_agent"),
              ("responses_api_models", "openai_model"))


def link_venvs(uv_venv_dir: Path, venv: Path, name: str) -> list[Path]:
    """``<uv_venv_dir>/<type>/<impl>/.venv -> venv`` for every server Gym will start, so that
    ``+skip_venv_if_present=true`` finds a venv and never runs uv (which cannot satisfy
    nemo-gym's Requires-Python >=3.13.14 here)."""
    links = []
    for type_, impl in (("resources_servers", name),) + VENV_LINKS:
        link = Path(uv_venv_dir) / type_ / impl / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            if link.is_symlink() and Path(os.readlink(link)) == Path(venv):
                links.append(link)
                continue
            if link.is_symlink():
                link.unlink()
            else:
                raise GymHarnessError(f"{link} exists and is not our symlink")
        link.symlink_to(venv, target_is_directory=True)
        links.append(link)
    return links


def run_cli(root: Path, name: str, jsonl: Path, *, work_dir: Path, venv: Path | None = None,
            model_base_url: str | None = None, head_port: int | None = None, concurrency: int = 4,
            agent: str | None = None, more_servers: Iterable[tuple[Path, str]] = (),
            start_overrides: Iterable[str] = (),
            eval_args: Iterable[str] = (), ready_timeout: float = 300, eval_timeout: float = 600,
            stop_timeout: float = 90, reverify: bool = False) -> CliRun:
    """The §6.2 full-CLI variant: ``gym env start`` then ``gym eval run --no-serve``, SIGINT-stopped.

    ``gym env start`` starts Ray, which contacts outside addresses even on loopback, so the whole
    run (both commands, what they start, the fake model, the readiness probe) happens inside a
    fresh loopback-only network namespace (``LoopbackNamespace``; NamespaceUnavailable where none
    can be made).

    With no ``model_base_url`` the fake model runs on a thread of this process for the duration.
    ``work_dir`` is the cwd of both commands (Hydra writes ``outputs/`` there) and holds the venv
    links (``venvs/``), the logs (``logs/``) and the rollouts (``out/``).

    ``more_servers`` lists further ``(root, name)`` resources servers started by the same
    ``gym env start`` (one ``--config`` each, one ``--search-dir`` per distinct root). With them and
    no ``agent``, ``gym eval run`` gets no ``--agent``: each row goes to its own ``agent_ref``.

    With ``reverify``, once the rollouts are in, ``gym env start`` is stopped and ``gym eval
    reverify`` runs on them (it starts the same servers itself, and verifies every rollout again
    with no session, as reverification does); its lines and aggregate land in the CliRun. Gym
    0.7's reverify exits leaving those servers running: they are SIGINTed (``reverify_left``)
    and given ``stop_timeout`` to end before leftovers are counted.
    """
    from . import fake_model

    venv = Path(venv or gym_venv())
    root = Path(root).resolve()
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    out_dir = work_dir / "out"
    out_dir.mkdir(exist_ok=True)
    uv_venv_dir = work_dir / "venvs"
    servers = [(root, name), *((Path(r).resolve(), n) for r, n in more_servers)]
    config_path = server_config_path(root, name)
    if agent is None and len(servers) == 1:
        agent = find_instances(yaml.safe_load(config_path.read_text()), name)[1]
    for _, server_name in servers:
        link_venvs(uv_venv_dir, venv, server_name)
    configs = [arg for r, n in servers for arg in ("--config", str(server_config_path(r, n)))]
    search_dirs = [arg for r in dict.fromkeys(r for r, _ in servers) for arg in ("--search-dir", str(r))]
    gym = str(venv / "bin" / "gym")
    shown_env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "UV_PYTHON_DOWNLOADS": "never"}

    t0 = time.monotonic()
    timings: dict[str, float] = {}
    own_model = None
    group = ProcessGroup(venv, work_dir / "logs")
    namespace = LoopbackNamespace()
    start_child = None
    rollouts: list[dict] = []
    aggregate = None
    reverified: list[dict] = []
    reverify_aggregate = None
    reverify_left: list[tuple[int, str]] = []
    commands: list[str] = []
    try:
        if model_base_url is None:
            own_model = fake_model.start(enter=namespace.enter)
            model_base_url = own_model.base_url
        head_port = head_port or free_ports(1)[0]
        start_argv = [gym, "env", "start", *configs, *search_dirs,
                      "--model-type", "openai_model", "--model", fake_model.MODEL_ID,
                      "--model-url", model_base_url, "--model-api-key", "dummy",
                      "+skip_venv_if_present=true", f"+uv_venv_dir={uv_venv_dir}",
                      f"+head_server.port={head_port}", *start_overrides]
        rollouts_path = out_dir / "rollouts.jsonl"
        eval_argv = [gym, "eval", "run", "--no-serve", *search_dirs,
                     f"+head_server.port={head_port}", *(("--agent", agent) if agent else ()),
                     "--input", str(Path(jsonl).resolve()),
                     "--output", str(rollouts_path), "--concurrency", str(concurrency), *eval_args]
        env = group.env(shown_env)
        commands = [_show(start_argv, cwd=work_dir, env=shown_env), _show(eval_argv, cwd=work_dir, env=shown_env)]

        start_child = group.spawn("gym-env-start", namespace.argv(start_argv), cwd=work_dir, env=env)
        timings["ready"] = namespace.call(wait_http, f"http://{HOST}:{head_port}/readyz", start_child,
                                          ready_timeout, want_200=True)
        t_eval = time.monotonic()
        try:
            group.run("gym-eval-run", namespace.argv(eval_argv), cwd=work_dir, env=env,
                      timeout=eval_timeout)
        except GymHarnessError as exc:
            raise GymHarnessError(f"{exc}\n--- gym env start log:\n{tail(start_child.log)}") from None
        timings["eval"] = time.monotonic() - t_eval
        if not rollouts_path.is_file():
            raise GymHarnessError(f"gym eval run wrote no {rollouts_path}; its log:\n"
                                  f"{tail(group.log_dir / 'gym-eval-run.log')}")
        rollouts = read_jsonl(rollouts_path)
        agg_path = out_dir / "rollouts_aggregate_metrics.json"
        aggregate = json.loads(agg_path.read_text()) if agg_path.is_file() else None
        if reverify:
            ProcessGroup.stop(start_child, grace=stop_timeout, whole_group=False)
            reverified_path = out_dir / "reverified.jsonl"
            reverify_argv = [gym, "eval", "reverify", *configs, *search_dirs,
                             "--model-type", "openai_model", f"+policy_model_name={fake_model.MODEL_ID}",
                             f"+policy_base_url={model_base_url}", "+policy_api_key=dummy",
                             "+skip_venv_if_present=true", f"+uv_venv_dir={uv_venv_dir}",
                             f"+head_server.port={head_port}",
                             "--inputs", str(out_dir / "rollouts_materialized_inputs.jsonl"),
                             "--rollouts", str(rollouts_path), "--output", str(reverified_path)]
            commands.append(_show(reverify_argv, cwd=work_dir, env=shown_env))
            t_reverify = time.monotonic()
            group.run("gym-eval-reverify", namespace.argv(reverify_argv), cwd=work_dir, env=env,
                      timeout=eval_timeout)
            timings["reverify"] = time.monotonic() - t_reverify
            # gym eval reverify (0.7) exits leaving the servers it started running: SIGINT them,
            # as Gym stops its servers, and let them wind down before anything is counted left.
            reverify_left = _tagged_pids(group.tag)
            for pid, _ in reverify_left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGINT)
            deadline = time.monotonic() + stop_timeout
            while _tagged_pids(group.tag) and time.monotonic() < deadline:
                time.sleep(0.5)
            reverified = read_jsonl(reverified_path)
            agg_path = out_dir / "reverified_aggregate_metrics.json"
            reverify_aggregate = json.loads(agg_path.read_text()) if agg_path.is_file() else None
    finally:
        t_stop = time.monotonic()
        if start_child is not None:
            # SIGINT the orchestrator only: it SIGINTs its servers, stops the head server and Ray.
            ProcessGroup.stop(start_child, grace=stop_timeout, whole_group=False)
        leftovers = group.stop_all()
        if own_model is not None:
            own_model.stop()
        namespace.close()
        timings["stop"] = time.monotonic() - t_stop
        timings["total"] = time.monotonic() - t0
    return CliRun(rollouts=rollouts, aggregate=aggregate, output_dir=out_dir, commands=commands,
                  timings=timings, logs={c.name: c.log for c in group.children},
                  start_exit_code=start_child.proc.returncode if start_child else None,
                  leftovers=leftovers, model_requests=list(own_model.requests) if own_model else [],
                  model_served=list(own_model.served) if own_model else [],
                  reverified=reverified, reverify_aggregate=reverify_aggregate,
                  reverify_left=reverify_left)
