"""agentenv.py: serve a bundle of agent tasks as training environments, in one file.

A *bundle* is a folder in the AgentEnv layout: ``envs/<name>/`` (an MCP env server's Docker build
context), ``artifacts/<name>/`` (verifier code), ``tasks/<name>.json`` (a task: a JSON array of
steps) and ``evals/<name>.toml`` (``tasks = [...]``). A trainer plays a task as an *episode*: the
task's envs are deployed fresh in a *sandbox*, the task's agent is played from outside (the model
takes its *turns*, calling the env's tools), and the task's own *verifier* scores what it did.

The file reads top to bottom in the order data flows; a section uses only the sections above it:

1. Values, errors      the shapes every layer passes on: a Failure (kind, reason), a ToolResult
                        with its status, the Settings with every default, errors that say the fix.
2. Bundle               loading and checking a bundle: envs, tasks, steps, splits, toolsets, reward.
3. Sandbox              where an env runs: a Docker container, a local process, or a local
                        process on the Ray node a placement group picked.
4. Env client           an MCP client on aiohttp, readiness, and the env's card and extensions.
5. Verifiers            the two verifier kinds and AgentEnv's score aggregators.
6. Episode              one play of a task: its steps as a graph (a handler per step type), its
                        turns, its outcome.
7. Pool and runtime     the semaphore that bounds live episodes, the boot gate, the runtime.
8. Plumbing             what both wires share: HTTP helpers, the JSON reader, the bearer token,
                        the sessions table both wires count against the pool, the idle sweep.
9. OpenEnv surface      sessions over /ws and /mcp, the stateless routes, the task API: each
                        renders the play's values as observations or JSON-RPC.
10. Gym surface         NeMo Gym's resources-server routes, rendering the same values as the text
                        a model reads and as masked verifies; url: mode through an OpenEnv client.
11. The app             the one aiohttp application of both surfaces, and Gym's entry point.
12. Writer              ``write-gym``: a resources server and its rows, written into a Gym root.
13. CLI                 ``python agentenv.py check|serve|write-gym ...``.

A Gym tool call, for instance, goes: the route (10) → the session → its rollout → the episode's
open turn (6) → the env's MCP session (4) → the env; the ToolResult it gives comes back up
unchanged, and only the route renders it.

Only the standard library, aiohttp, the docker SDK (for the Docker sandbox) and PyYAML (for Gym's
YAML) are used at run time, the last two imported only where needed. Blocking calls (the docker
SDK, verifier code) run in threads so the event loop never stalls.
"""

from __future__ import annotations

import abc
import argparse
import ast
import asyncio
import collections
import contextlib
import copy
import dataclasses
import gc
import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import aiohttp

__version__ = "0.1.0"

log = logging.getLogger("agentenv")


# ================================================================ 1. Values, errors and defaults

class AgentEnvError(Exception):
    """A failure a user can act on. Its message says what happened, why, and what to do."""


class BundleError(AgentEnvError):
    """A bundle that can't be played, with every problem found in it at once."""

    def __init__(self, problems: list[str]):
        self.problems = sorted(set(problems))
        count = len(self.problems)
        head = f"the bundle has {count} problem{'s' if count != 1 else ''}:"
        super().__init__("\n  - ".join([head, *self.problems]))


# The kinds of failure, in NeMo Gym's registered vocabulary where it has a word for one, else as
# agentenv:<kind>. Both wires carry them, and a trainer masks the rollout instead of scoring it 0.
PROVIDER_UNAVAILABLE = "provider_unavailable"   # the sandbox could not provide an env
TRANSPORT_TIMEOUT = "transport_timeout"         # a deploy, a call or a turn missed its deadline
PEER_DROP = "transport_peer_drop"               # the env died under a call
VERIFIER_ERROR = "verifier_error"               # the verifier raised, hung or gave no score
SESSION_LOST = "session_lost"                   # the episode was ended from outside, or is gone
ENV_FAILED = "agentenv:env_failed"              # the env failed in a way with no word of its own
TOOLS_MISMATCH = "agentenv:tools_mismatch"      # a row offers other tools than its task
INTERNAL_ERROR = "agentenv:internal_error"      # a bug of agentenv.py's own


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why an episode was not scored: its kind (above) and a reason that says what to do.

    The one shape of a failure: an episode's outcome holds it, EpisodeFailed carries it, and each
    wire renders it (Gym as a masked verify, OpenEnv as an error observation)."""

    kind: str
    reason: str

    def __str__(self) -> str:
        return self.reason

    def told(self, preface: str) -> Failure:
        """The same failure, its reason introduced as a surface tells it."""
        return Failure(self.kind, preface + self.reason)


class EpisodeFailed(AgentEnvError):
    """The environment failed the episode (a deploy, an env, a verifier), not the model."""

    def __init__(self, reason: str | Failure, kind: str = ENV_FAILED):
        self.failure = reason if isinstance(reason, Failure) else Failure(kind, reason)
        super().__init__(self.failure.reason)


# A tool call's status. The model's own mistakes and the tool's own errors are answers it reads
# and learns from, and the episode goes on; a timeout ends the episode (what the call does may
# still be under way), so it fails the rollout.
OK = "ok"
TOOL_ERROR = "tool_error"            # the tool answered with an error, or its server refused the call
UNKNOWN_TOOL = "unknown_tool"        # the turn offers no tool of that name
BAD_ARGUMENTS = "bad_arguments"      # the arguments are not a JSON object
NO_TURN = "no_turn"                  # the episode has no open turn to call tools in
TIMEOUT = "timeout"                  # the call missed its deadline, and the episode ended


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """A tool call's answer: its text and its status. Each wire only renders it."""

    text: str
    status: str = OK

    @property
    def is_error(self) -> bool:
        return self.status != OK

    @property
    def failure(self) -> Failure | None:
        """The episode's failure, when the call ended it."""
        return Failure(TRANSPORT_TIMEOUT, self.text) if self.status == TIMEOUT else None


def missed(name: str, timeout: float) -> str:
    """The reason a tool call that missed its deadline gives, in the trainer's page's words."""
    return (f"{name} didn't answer within {timeout:g}s, and the episode ended, since what the call "
            "does may still be under way")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every deadline and size a user sets, each with its one default: ``serve``'s flags show
    these, the Gym resources server reads them from its config, and ``write-gym`` writes them."""

    max_concurrent_envs: int = 8      # episodes live at once; past it, new ones wait
    deploy_timeout: float = 180.0     # an env's launch until it answers
    tool_timeout: float = 60.0        # one Gym tool call
    reset_timeout: float = 600.0      # Gym: deploy + first turn, each end_turn, the wait for a slot
    idle_timeout: float = 600.0       # a session with no request is ended, freeing its slot
    client_timeout: float = 60.0      # how long OpenEnv clients wait for a reply
    reply_margin: float = 5.0         # every OpenEnv reply comes this long before that
    verifier_timeout: float = 300.0   # a verifier's run

    # The keys a Gym config carries, with the resources server serving the bundle (bundle:) or
    # playing on a running serve (url:).
    GYM_KEYS = ("tool_timeout", "reset_timeout", "idle_timeout")
    BUNDLE_KEYS = ("max_concurrent_envs", "deploy_timeout")

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str) -> Settings:
        """The settings a Gym config gives, the others at their defaults; a bad value says so."""
        given = {}
        for key in (*cls.GYM_KEYS, *cls.BUNDLE_KEYS):
            if config.get(key) is None:
                continue
            value, whole = config[key], key == "max_concurrent_envs"
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value <= 0 or (whole and not float(value).is_integer()):
                what = "whole number of at least 1" if whole else "positive number of seconds"
                raise AgentEnvError(f"{key}: {value!r} in {where} is not a {what}; set it to one, "
                                    f"such as {getattr(cls, key):g}")
            given[key] = int(value) if whole else float(value)
        return cls(**given)

    def gym_config(self, bundle: bool) -> dict[str, Any]:
        """The settings as a Gym config writes them."""
        keys = self.GYM_KEYS + (self.BUNDLE_KEYS if bundle else ())
        return {key: _plain(getattr(self, key)) for key in keys}


def _plain(value: float) -> float | int:
    """A whole number of seconds as an int, so a written config reads 600, not 600.0."""
    return int(value) if float(value).is_integer() else value


def at_its_limit(who: str, limit: int, what: str, then: str, knob: str) -> str:
    """The one sentence every part says the first time it is full."""
    return (f"{who} is at its limit of {limit} {what} at once, so {then}: {knob} to run more at once")


def short(text: str, limit: int = 2000) -> str:
    """Clip text for a message, keeping the end, which is where tracebacks say what went wrong."""
    text = text.strip()
    return text if len(text) <= limit else "…" + text[-limit:]


# ================================================================ 2. Bundle

# The step types agentenv.py runs, with the fields each takes beyond the common ones. A field in
# IGNORED_FIELDS is accepted and has no effect here (the trainer's model plays the agent, and the
# server picks the sandbox); any other field is refused, so a typo never passes silently.
COMMON_FIELDS = {"id", "type", "version", "depends_on", "fail_task_on_error"}
STEP_FIELDS: dict[str, tuple[set[str], set[str]]] = {
    # type: (required fields, optional fields)
    "deploy_env": ({"env_id"}, {"cpu", "memory_mb"}),
    "apply_server_config": ({"env_id", "directives"}, {"timeout_seconds", "tolerate_unadvertised"}),
    "deploy_agent": (set(), {"agent_name", "env_ids", "role", "system_prompt"}),
    "prompt_agent": ({"prompt"}, {"agent_name", "prompt_id", "system_prompt", "timeout_seconds"}),
    "env_outcome_verifier": ({"env_id", "file_artifact_id"},
                             {"verifier_id", "prompt_id", "score_aggregator"}),
    "agent_prompt_response_verifier": ({"prompt_id", "criteria"},
                                       {"verifier_id", "score_aggregator"}),
}
IGNORED_FIELDS = {
    "deploy_env": {"env_version", "ttl_seconds", "disk_size_gb", "gateway_mode", "sandbox_type",
                   "env_state_type", "metadata"},
    "deploy_agent": {"a2a_agent_id", "ttl_seconds", "cpu", "memory_mb", "sandbox_type", "env_vars"},
    "prompt_agent": {"poll_interval_seconds", "model", "model_params", "max_turns"},
}
SCORE_AGGREGATORS = ("all_pass", "any_pass", "weighted_average")
CRITERION_TYPES = ("response_contains", "response_regex_present")
DEFAULT_AGENT = "default-agent"
PLACEHOLDER = re.compile(r"<([A-Za-z_][A-Za-z0-9_.-]*)>")


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a task: its id, type, the steps it waits for, and its own fields."""

    id: str
    type: str
    depends_on: tuple[str, ...]
    fail_task_on_error: bool
    fields: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """An env of the bundle: its build context, its image's command, and how it names itself."""

    name: str
    folder: Path
    dockerfile: Path
    environment_name: str
    command: tuple[str, ...]          # the image's ENTRYPOINT + CMD, as a local process runs it
    image_env: dict[str, str]         # the image's ENV lines
    digest: str                       # a hash of the build context: one image per content


@dataclasses.dataclass(frozen=True)
class Toolset:
    """The envs whose tools a task's turns offer. Tasks that deploy the same envs share one."""

    envs: tuple[str, ...]

    @property
    def name(self) -> str:
        return "+".join(self.envs) if self.envs else "(no env)"


@dataclasses.dataclass(frozen=True)
class Task:
    """A task of the bundle, checked: its steps, the agent played from outside, its toolset."""

    id: str
    name: str
    steps: tuple[Step, ...]
    agent: str                        # the played agent's name
    toolset: Toolset
    reward_step: str                  # the scoring step whose score is the reward

    @property
    def file(self) -> str:
        return f"{self.name}.json"

    @property
    def scoring_steps(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.steps if s.type.endswith("verifier"))

    @property
    def turns(self) -> list[Step]:
        return [s for s in self.steps if s.type == "prompt_agent"]

    @property
    def first_prompt(self) -> tuple[str, str | None]:
        turn = self.turns[0]
        return turn.get("prompt"), turn.get("system_prompt") or self.system_prompt

    @property
    def system_prompt(self) -> str | None:
        for step in self.steps:
            if step.type == "deploy_agent":
                return step.get("system_prompt")
        return None

    def seeded(self, seed: dict[str, Any] | None) -> Task:
        """This task with every ``<key>`` in its string fields replaced by ``seed[key]``."""
        if not seed:
            return self

        def fill(value: Any) -> Any:
            if isinstance(value, str):
                return PLACEHOLDER.sub(lambda m: str(seed[m[1]]) if m[1] in seed else m[0], value)
            if isinstance(value, list):
                return [fill(v) for v in value]
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            return value

        steps = tuple(dataclasses.replace(s, fields=fill(copy.deepcopy(s.fields))) for s in self.steps)
        return dataclasses.replace(self, steps=steps)


class Bundle:
    """A loaded bundle: its envs, artifacts, tasks and splits. Loading checks everything at once.

    ``Bundle.load(folder, reward=None)`` raises BundleError listing every problem, each naming the
    file and the step and saying what to do, so that a bundle that loads is one that will play.
    """

    def __init__(self, root: Path, name: str, description: str, envs: dict[str, EnvSpec],
                 verifiers: dict[str, Path], tasks: dict[str, Task], splits: dict[str, list[Task]]):
        self.root, self.name, self.description = root, name, description
        self.envs, self.verifiers, self.tasks, self.splits = envs, verifiers, tasks, splits

    @property
    def toolsets(self) -> dict[Toolset, list[Task]]:
        found: dict[Toolset, list[Task]] = {}
        for task in self.splits["all"]:
            found.setdefault(task.toolset, []).append(task)
        return found

    def task(self, split: str, index: int) -> Task:
        """The task at ``index`` of ``split``; a LookupError that lists what exists otherwise."""
        if not isinstance(split, str) or split not in self.splits:
            raise LookupError(f"there is no split {split!r}; the splits are {', '.join(self.splits)}")
        tasks = self.splits[split]
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(tasks):
            raise LookupError(f"split {split!r} has {len(tasks)} tasks, so it has no task {index!r}; "
                              f"give an index from 0 to {len(tasks) - 1}")
        return tasks[index]

    @classmethod
    def load(cls, folder: str | Path, reward: str | None = None) -> Bundle:
        # Loading keeps tens of thousands of dicts and lists (2,000+ tasks), none of them in a
        # cycle: the cyclic collector would only walk them again and again as they pile up, at
        # ~15% of the load's time.
        with gc_paused():
            return cls._load(folder, reward)

    @classmethod
    def _load(cls, folder: str | Path, reward: str | None) -> Bundle:
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise BundleError([f"{folder}: there is no bundle folder here; pass the folder that holds "
                               "envs/, tasks/ and evals/"])
        root = root.resolve()
        problems: list[str] = []
        for stray in ("bundle.toml",):
            if (root / stray).exists():
                problems.append(f"{stray}: reserved: a bundle takes its name from the folder and its "
                                "description from README.md; remove it")
        for kind in ("agents", "skills"):
            if (root / kind).is_dir():
                problems.append(f"{kind}/: agentenv.py plays the agent from outside and runs no "
                                f"{kind}; remove the folder, or run this bundle with agent-env itself")
        envs = _load_envs(root, problems)
        verifiers = _load_verifiers(root, problems)
        id_root = task_id_root(root)
        tasks: dict[str, Task] = {}
        task_dir = root / "tasks"
        if not task_dir.is_dir():
            problems.append("tasks/: the bundle has no tasks folder; add tasks/<name>.json")
        else:
            with os.scandir(task_dir) as listing:      # one pass, types included: 2,000+ tasks
                entries = sorted(listing, key=lambda e: e.name)
            for entry in entries:
                if entry.name.startswith(".") or entry.name == "__pycache__":
                    continue
                if entry.is_dir():
                    problems.append(f"tasks/{entry.name}/: task folders are not supported; "
                                    f"write tasks/{entry.name}.json")
                elif not entry.name.endswith(".json"):
                    problems.append(f"tasks/{entry.name}: a task is a .json file; rename or remove it")
                else:
                    # strings, not a Path per file: a Path, its name and its stem cost ~3 us
                    name = entry.name.removesuffix(".json")
                    task = _load_task(entry.path, name, f"{id_root}/{name}", envs, verifiers,
                                      reward, problems)
                    if task:
                        tasks[task.name] = task
            if not any(e.name.endswith(".json") for e in entries):
                problems.append("tasks/: there are no tasks; add tasks/<name>.json")
        splits = {"all": [tasks[n] for n in sorted(tasks)]}
        splits.update(_load_evals(root, tasks, id_root, problems))
        if problems:
            raise BundleError(problems)
        readme = root / "README.md"
        description = ""
        if readme.is_file():
            lines = [ln.strip().lstrip("#").strip() for ln in readme.read_text().splitlines()]
            description = next((ln for ln in lines if ln), "")
        return cls(root, root.name, description, envs, verifiers, tasks, splits)


@contextlib.contextmanager
def gc_paused() -> Any:
    """Hold the cyclic garbage collector off for a while (if it was on), then let it run again."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def read_bytes(path: str) -> bytes:
    """A file's bytes, read with the os calls themselves: Path.read_bytes's file objects cost ~8 us
    more a file, ~15 ms on a bundle of 2,000+ tasks."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def task_id_root(root: Path) -> str:
    """AgentEnv's id root for a folder bundle: ``@local/<absolute path>``, ``~`` for the home folder."""
    with contextlib.suppress(ValueError, RuntimeError):
        return "@local/~/" + root.relative_to(Path.home().resolve()).as_posix()
    return "@local/" + "/".join(root.parts[1:])


def _toml(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        problems.append(f"{path.parent.name}/{path.name}: is not valid TOML ({exc}); fix the syntax")
        return None


def plain_name(name: Any) -> bool:
    """Whether ``name`` can name a file in a folder without reaching out of it."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(
        c in name for c in "/\\\0")


def _load_envs(root: Path, problems: list[str]) -> dict[str, EnvSpec]:
    envs: dict[str, EnvSpec] = {}
    env_dir = root / "envs"
    if not env_dir.is_dir():
        return envs
    for folder in sorted(env_dir.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        where = f"envs/{folder.name}"
        config: dict[str, Any] = {}
        if (folder / "env.toml").is_file():
            config = _toml(folder / "env.toml", problems) or {}
        known = {"type", "id", "image", "environment_name", "env_provider_type"}
        for key in sorted(set(config) - known):
            problems.append(f"{where}/env.toml: key {key!r} is not one agentenv.py knows; "
                            f"it knows {', '.join(sorted(known))}")
        if config.get("type", "mcp_server") != "mcp_server":
            problems.append(f"{where}/env.toml: type {config['type']!r} is not run here; agentenv.py "
                            "runs mcp_server envs (an MCP server in a Docker build context)")
        image = config.get("image", {})
        dockerfile = folder / "Dockerfile"
        if isinstance(image, dict) and set(image) <= {"dockerfile"}:
            given = image.get("dockerfile", "Dockerfile")
            dockerfile = folder / str(given)
            if not isinstance(given, str) or Path(given).is_absolute() or \
                    not dockerfile.resolve().is_relative_to(folder.resolve()):
                problems.append(f"{where}/env.toml: dockerfile = {given!r} is not a file of the env's "
                                "folder, its Docker build context; name one inside it")
                continue
        else:
            problems.append(f"{where}/env.toml: image = {image!r} is not supported; agentenv.py builds "
                            "each env from a Dockerfile in its folder (image = {dockerfile = \"...\"})")
        if not dockerfile.is_file():
            problems.append(f"{where}: has no {dockerfile.name}; an env is a Docker build context, so "
                            f"add {where}/{dockerfile.name} with the command that starts the MCP server")
            continue
        try:
            command, image_env = parse_dockerfile(dockerfile.read_text())
        except ValueError as exc:
            problems.append(f"{where}/{dockerfile.name}: {exc}")
            continue
        name = config.get("environment_name") or folder.name
        if not plain_name(name):
            problems.append(f"{where}/env.toml: environment_name = {name!r} is not a plain name (it "
                            "names the env's database file, so no '/' or '\\'); give a plain name")
            continue
        envs[folder.name] = EnvSpec(folder.name, folder, dockerfile, str(name), command, image_env,
                                    _digest(folder))
    return envs


def parse_dockerfile(text: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The command an image runs (ENTRYPOINT then CMD) and its ENV, read from a Dockerfile."""
    text = re.sub(r"\\\r?\n", " ", text)
    entrypoint: list[str] = []
    cmd: list[str] = []
    cmd_set = False                      # whether this stage wrote its own CMD
    env: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":               # a new stage: only the last one's settings count
            entrypoint, cmd, cmd_set, env = [], [], False, {}
        elif word in ("CMD", "ENTRYPOINT"):
            if rest.startswith("["):
                try:
                    argv = json.loads(rest)
                except json.JSONDecodeError:
                    raise ValueError(f"{word} {rest} is not valid JSON; write {word} [\"prog\", \"arg\"]")
            else:
                argv = ["/bin/sh", "-c", rest]
            if word == "CMD":
                cmd, cmd_set = argv, True
            else:
                entrypoint = argv        # Docker drops an inherited CMD here, not the stage's own
                cmd = cmd if cmd_set else []
        elif word == "ENV":
            if "=" in rest.split(" ")[0]:
                for pair in shlex.split(rest):
                    key, _, value = pair.partition("=")
                    env[key] = value
            else:
                key, _, value = rest.partition(" ")
                env[key] = value.strip()
    command = tuple(entrypoint + cmd)
    if not command:
        raise ValueError("has no CMD or ENTRYPOINT; add CMD [\"python\", \"server.py\"] (the command "
                         "that starts the env's MCP server)")
    return command, env


def _digest(folder: Path) -> str:
    """A hash of a build context's files, so an image is built once per content."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
            digest.update(rel.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _load_verifiers(root: Path, problems: list[str]) -> dict[str, Path]:
    """Each artifact that holds verifier code: its Python file, checked (not run) for ``verify``."""
    found: dict[str, Path] = {}
    art_dir = root / "artifacts"
    if not art_dir.is_dir():
        return found
    for folder in sorted(art_dir.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        py = [p for p in folder.glob("*.py")]
        path = folder / "verify.py" if (folder / "verify.py").is_file() else (py[0] if len(py) == 1 else None)
        if path is None:
            continue  # an artifact of data files; only a verifier step naming it needs Python
        where = f"artifacts/{folder.name}/{path.name}"
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (SyntaxError, UnicodeDecodeError) as exc:
            problems.append(f"{where}: does not parse ({exc}); fix it")
            continue
        verify = next((n for n in tree.body if isinstance(n, (ast.AsyncFunctionDef, ast.FunctionDef))
                       and n.name == "verify"), None)
        if not isinstance(verify, ast.AsyncFunctionDef):
            problems.append(f"{where}: has no `async def verify(mcp_url)`; an env_outcome_verifier's "
                            "artifact defines it and returns a list of {id, result, description} rows")
            continue
        args = verify.args
        positional = args.posonlyargs + args.args
        if len(positional) - len(args.defaults) != 1 or any(d is None for d in args.kw_defaults):
            problems.append(f"{where}: verify must take exactly one argument without a default (the "
                            "env's MCP URL); agentenv.py calls verify(mcp_url)")
            continue
        found[folder.name] = path
    return found


def _load_task(path: str, name: str, task_id: str, envs: dict[str, EnvSpec],
               verifiers: dict[str, Path], reward: str | None, problems: list[str]) -> Task | None:
    """Load and check the task ``name``, the file ``path`` (tasks/<name>.json)."""
    where = f"tasks/{name}.json"
    try:
        raw = json.loads(read_bytes(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problems.append(f"{where}: is not valid JSON ({exc}); a task is a JSON array of step objects")
        return None
    if not isinstance(raw, list) or not raw:
        problems.append(f"{where}: a task is a non-empty JSON array of step objects")
        return None
    before = len(problems)
    steps: list[Step] = []
    seen: set[str] = set()
    for n, item in enumerate(raw):
        step = _load_step(item, n, where, name, seen, problems)
        if step:
            steps.append(step)
            seen.add(step.id)
    if len(problems) > before:
        return None
    return _check_task(name, task_id, steps, envs, verifiers, reward, problems)


# What a step of each type may hold, worked out once rather than for each of a bundle's thousands
# of steps. type: (required fields, every field it accepts, its fields as a message lists them)
STEP_RULES: dict[str, tuple[set[str], set[str], str]] = {
    stype: (required, required | optional | IGNORED_FIELDS.get(stype, set()) | COMMON_FIELDS,
            ", ".join(sorted(required | optional)))
    for stype, (required, optional) in STEP_FIELDS.items()}
# The fields of a step that must be text, and those that must be positive numbers.
TEXT_FIELDS = {"prompt", "system_prompt", "prompt_id", "agent_name", "role", "env_id",
               "file_artifact_id", "verifier_id"}
POSITIVE_FIELDS = {"timeout_seconds", "cpu", "memory_mb"}


def _load_step(item: Any, n: int, where: str, task: str, seen: set[str],
               problems: list[str]) -> Step | None:
    if not isinstance(item, dict):
        problems.append(f"{where}: step #{n} is not a JSON object")
        return None
    sid, stype = item.get("id"), item.get("type")
    if not isinstance(sid, str) or not sid:
        problems.append(f"{where}: step #{n} has no id; give every step a unique \"id\"")
        return None
    at = f"{where}: task {task!r} step {sid!r}"
    if sid in seen:
        problems.append(f"{at}: the id is used twice; step ids are unique within a task")
        return None
    if not isinstance(stype, str) or stype not in STEP_RULES:
        problems.append(f"{at} has type {stype!r}, which agentenv.py does not run; it runs: "
                        f"{', '.join(STEP_FIELDS)}. Rewrite the step with those, or run this task "
                        "with agent-env itself")
        return None
    required, accepted, takes = STEP_RULES[stype]
    for key in sorted(required.difference(item)):
        problems.append(f"{at} ({stype}) lacks the field {key!r}; add it")
    if not accepted.issuperset(item):       # asked first: the set of the rest costs more to make
        for key in sorted(set(item) - accepted):
            problems.append(f"{at} ({stype}) has the field {key!r}, which agentenv.py does not "
                            f"support; a {stype} step takes {takes}")
    if "retry_config" in item:
        problems.append(f"{at}: retry_config can replay a turn played from outside; remove it")
    deps = item.get("depends_on")
    if deps is None:
        deps = sorted(seen)      # AgentEnv's rule: no depends_on means every step before this one
    elif not (isinstance(deps, list) and all(isinstance(d, str) for d in deps)):
        problems.append(f"{at}: depends_on must be a list of earlier step ids")
        deps = []
    for dep in deps:
        if dep not in seen:
            problems.append(f"{at}: depends_on names {dep!r}, which is not an earlier step of the task")
    fail = item.get("fail_task_on_error", True)
    if not isinstance(fail, bool):
        problems.append(f"{at}: fail_task_on_error must be true or false")
    # One pass over the step's own fields, typing those that have a type (a step holds a few of
    # the eleven typed fields, so asking after each of the eleven would cost more).
    fields: dict[str, Any] = {}
    for key, value in item.items():
        if key in COMMON_FIELDS:
            continue
        fields[key] = value
        if key in TEXT_FIELDS and not isinstance(value, str):
            problems.append(f"{at}: {key} must be a string")
        elif key in POSITIVE_FIELDS and (not isinstance(value, (int, float))
                                         or isinstance(value, bool) or value <= 0):
            problems.append(f"{at}: {key} must be a positive number")
    return Step(sid, stype, tuple(deps), fail is not False, fields)


# What a step uses, by its kind, as a message names it.
USED = {"env": "env", "agent": "agent", "prompt": "the reply to prompt"}


def _check_task(name: str, task_id: str, steps: list[Step], envs: dict[str, EnvSpec],
                verifiers: dict[str, Path], reward: str | None, problems: list[str]) -> Task | None:
    """Check how a task's steps refer to each other, its envs and its artifacts."""
    before = len(problems)
    at = f"tasks/{name}.json: task {name!r}"
    deployed: dict[str, str] = {}        # env_id as written -> env folder name
    agents: dict[str, Step] = {}
    prompt_ids: set[str] = set()
    made_by: dict[tuple[str, str], str] = {}    # (kind, name) -> the step that makes it
    last_turn: str | None = None
    ancestors: dict[str, set[str]] = {}

    def needs(step: Step, sat: str, kind: str, thing: Any) -> None:
        # A step may use only what a step it waits for (directly or not) has made. (Defined once
        # a task, and its message's words made only for a problem: a bundle has 10,000+ steps.)
        maker = made_by.get((kind, thing))
        if maker is not None and maker not in ancestors[step.id]:
            problems.append(f"{sat}: uses {USED[kind]} {thing!r}, made by step {maker!r}, without "
                            f"waiting for it; add {maker!r} to its depends_on")
    for step in steps:
        sat = f"{at} step {step.id!r}"
        ancestors[step.id] = waits_for = set(step.depends_on)     # directly or not
        for dep in step.depends_on:
            waits_for |= ancestors[dep]
        if step.type == "deploy_env":
            env_id = step.get("env_id")
            env = _resolve_env(env_id, envs, task_id)
            if env is None:
                problems.append(f"{sat}: env_id {env_id!r} names no env of the bundle; it has "
                                f"{', '.join(envs) or 'none'} (add envs/{env_id}/)")
            elif env_id in deployed:
                problems.append(f"{sat}: deploys {env_id!r} a second time; deploy each env once")
            else:
                deployed[env_id] = env
                made_by[("env", env_id)] = step.id
        elif step.type in ("apply_server_config", "env_outcome_verifier"):
            if step.get("env_id") not in deployed:
                problems.append(f"{sat}: env_id {step.get('env_id')!r} is not deployed by an earlier "
                                "deploy_env step of the task")
            needs(step, sat, "env", step.get("env_id"))
        if step.type == "apply_server_config":
            _check_directives(step, sat, problems)
        elif step.type == "deploy_agent":
            agent = step.get("agent_name", DEFAULT_AGENT)
            if agent in agents:
                problems.append(f"{sat}: deploys agent {agent!r} a second time")
            agents[agent] = step
            made_by[("agent", agent)] = step.id
            env_ids = step.get("env_ids", [])
            if not isinstance(env_ids, list) or not all(isinstance(e, str) for e in env_ids):
                problems.append(f"{sat}: env_ids must be a list of env ids")
            else:
                for env_id in env_ids:
                    if env_id not in deployed:
                        problems.append(f"{sat}: env_ids names {env_id!r}, which no earlier deploy_env "
                                        "step of the task deploys")
                    needs(step, sat, "env", env_id)
        elif step.type == "prompt_agent":
            agent = step.get("agent_name", DEFAULT_AGENT)
            if agent not in agents:
                problems.append(f"{sat}: prompts agent {agent!r}, which no earlier deploy_agent step "
                                "deploys")
            needs(step, sat, "agent", agent)
            if not isinstance(step.get("prompt"), str) or not step.get("prompt").strip():
                problems.append(f"{sat}: prompt must be non-empty text")
            if step.get("prompt_id"):
                prompt_ids.add(step.get("prompt_id"))
                made_by[("prompt", step.get("prompt_id"))] = step.id
            if last_turn is not None and last_turn not in ancestors[step.id]:
                problems.append(f"{sat}: may open while turn {last_turn!r} is still open; the agent "
                                f"plays one turn at a time, so add {last_turn!r} to its depends_on")
            last_turn = step.id
        elif step.type == "env_outcome_verifier":
            artifact = step.get("file_artifact_id")
            if artifact not in verifiers:
                problems.append(f"{sat}: file_artifact_id {artifact!r} names no verifier artifact; "
                                f"add artifacts/{artifact}/verify.py with `async def verify(mcp_url)`")
        if step.type.endswith("verifier"):
            agg = step.get("score_aggregator", "all_pass")
            if agg not in SCORE_AGGREGATORS:
                problems.append(f"{sat}: score_aggregator {agg!r} is not one of "
                                f"{', '.join(SCORE_AGGREGATORS)}")
        if step.type == "agent_prompt_response_verifier":
            if step.get("prompt_id") not in prompt_ids:
                problems.append(f"{sat}: prompt_id {step.get('prompt_id')!r} names no earlier "
                                "prompt_agent step; give that step the same prompt_id")
            needs(step, sat, "prompt", step.get("prompt_id"))
            _check_criteria(step, sat, problems)
    if len(agents) > 1:
        problems.append(f"{at}: deploys agents {', '.join(sorted(agents))}; agentenv.py plays one "
                        "agent from outside, so a task deploys exactly one")
    turns = [s for s in steps if s.type == "prompt_agent"]
    if not turns:
        problems.append(f"{at}: prompts no agent, so there is no turn to play; add a prompt_agent step")
    scoring = tuple(s.id for s in steps if s.type.endswith("verifier"))
    reward_step = _choose_reward(at, scoring, reward, problems)
    if len(problems) > before:
        return None
    agent_name, agent_step = next(iter(agents.items()))
    toolset = Toolset(tuple(sorted({deployed[e] for e in agent_step.get("env_ids", [])})))
    return Task(task_id, name, tuple(steps), agent_name, toolset, reward_step)


def _resolve_env(env_id: Any, envs: dict[str, EnvSpec], task_id: str) -> str | None:
    """An env_id is an env folder's name, or its full id ``<id root>/<name>``."""
    if not isinstance(env_id, str):
        return None
    if env_id in envs:
        return env_id
    root = task_id.rsplit("/", 1)[0]
    if env_id.startswith(root + "/") and env_id[len(root) + 1:] in envs:
        return env_id[len(root) + 1:]
    return None


def _check_directives(step: Step, at: str, problems: list[str]) -> None:
    directives = step.get("directives")
    if not isinstance(directives, list) or not directives:
        problems.append(f"{at}: directives must be a non-empty list of {{service, uri, args}}")
        return
    for n, d in enumerate(directives):
        if not isinstance(d, dict) or not isinstance(d.get("uri"), str) or \
                not isinstance(d.get("service", d.get("environment", "*")), str) or \
                not isinstance(d.get("args", {}), dict):
            problems.append(f"{at}: directive #{n} must be {{\"service\": <card name or \"*\">, "
                            "\"uri\": <extension URI>, \"args\": {...}}")


def _check_criteria(step: Step, at: str, problems: list[str]) -> None:
    criteria = step.get("criteria")
    if not isinstance(criteria, list):
        problems.append(f"{at}: criteria must be a list")
        return
    for n, c in enumerate(criteria):
        kind = c.get("type") if isinstance(c, dict) else None
        if kind not in CRITERION_TYPES:
            problems.append(f"{at}: criterion #{n} has type {kind!r}; the types are "
                            f"{', '.join(CRITERION_TYPES)}")
        elif kind == "response_contains" and not (
                isinstance(c.get("needles"), list) and c["needles"]
                and all(isinstance(x, str) for x in c["needles"])):
            problems.append(f"{at}: criterion #{n} (response_contains) needs a non-empty list of "
                            "strings as needles")
        elif kind == "response_regex_present":
            pattern, flags = c.get("pattern"), c.get("flags", [])
            try:
                if not isinstance(pattern, str) or not pattern:
                    raise re.error("the pattern is empty")
                re.compile(pattern, _regex_flags(flags))
            except (re.error, AttributeError, TypeError) as exc:
                problems.append(f"{at}: criterion #{n} (response_regex_present) has a pattern or "
                                f"flags that don't compile ({exc})")


def _regex_flags(names: list[str] | None) -> int:
    """AgentEnv's rule: no flags means DOTALL; given flags, exactly those, OR-ed."""
    if not names:
        return re.DOTALL
    flags = 0
    for name in names:
        flags |= getattr(re, name) if isinstance(name, str) and name.isupper() else _bad_flag(name)
    return flags


def _bad_flag(name: Any) -> int:
    raise AttributeError(f"{name!r} is not a re flag name such as IGNORECASE")


def _choose_reward(at: str, scoring: tuple[str, ...], reward: str | None,
                   problems: list[str]) -> str:
    if reward is not None:
        if reward not in scoring:
            problems.append(f"{at}: records no score at step {reward!r}; it records them at "
                            f"{list(scoring)}")
        return reward
    if len(scoring) == 1:
        return scoring[0]
    if not scoring:
        problems.append(f"{at}: records no score, so it has no reward; add an env_outcome_verifier "
                        "or agent_prompt_response_verifier step")
    else:
        problems.append(f"{at}: records a score at each of {', '.join(scoring)}; name the one that "
                        "is its reward with --reward <step id>")
    return ""


def _load_evals(root: Path, tasks: dict[str, Task], id_root: str,
                problems: list[str]) -> dict[str, list[Task]]:
    splits: dict[str, list[Task]] = {}
    eval_dir = root / "evals"
    if not eval_dir.is_dir():
        return splits
    for path in sorted(eval_dir.iterdir()):
        if path.name.startswith("."):
            continue
        where = f"evals/{path.name}"
        if path.is_dir() or path.suffix != ".toml":
            problems.append(f"{where}: an eval is a .toml file with tasks = [...]; rename or remove it")
            continue
        if path.stem == "all":
            problems.append(f"{where}: eval 'all' has the name of the split that holds every task; "
                            "rename it")
            continue
        config = _toml(path, problems)
        if config is None:
            continue
        for key in sorted(set(config) - {"tasks", "type", "id"}):
            problems.append(f"{where}: key {key!r} is not one an eval takes (tasks, type, id)")
        names = config.get("tasks")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            problems.append(f"{where}: tasks must be a non-empty list of task names")
            continue
        split: list[Task] = []
        listed: set[str] = set()
        for name in names:
            stem = name[len(id_root) + 1:] if name.startswith(id_root + "/") else name
            if stem not in tasks:
                if "/" not in stem and "\\" not in stem and not stem.startswith(".") and \
                        (root / "tasks" / f"{stem}.json").is_file():
                    continue   # the task itself has problems, reported where it is loaded
                problems.append(f"{where}: lists {name!r}, which is not a task of the bundle; list "
                                "tasks by name (the file name under tasks/ without .json) or by id")
            elif stem in listed:
                problems.append(f"{where}: lists {name!r} twice; an eval lists each task once")
            else:
                listed.add(stem)
                split.append(tasks[stem])
        splits[path.stem] = split
    return splits


# ================================================================ 3. Sandbox

DOCKER_PIDS_LIMIT = 1024          # processes and threads in one env container (a fork bomb stops)
ENV_PORT = 18765                  # the port an env's MCP server listens on in its container
OUTPUT_LINES = 40                 # how much of an env's last output a failure quotes


def owner_id() -> str:
    """Who owns what this process starts: host, pid and the pid's start time (pids get reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_process_start(os.getpid())}"


def _process_start(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]     # field 22: start time in clock ticks
    except (OSError, IndexError):
        return ""


def owner_alive(owner: str) -> bool | None:
    """Whether the server that labelled something still runs; None when it ran on another host."""
    host, _, rest = owner.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    now = _process_start(int(pid))
    return bool(now) and (now == started or not started)


class Instance(abc.ABC):
    """One env running for an episode: where it answers, whether it still runs, and its removal."""

    base_url: str

    @abc.abstractmethod
    async def exited(self, settle: float = 0.0) -> str | None:
        """None while the env runs; once it has stopped, a sentence saying how. ``settle`` is how
        long to wait for an exit that a dropped connection suggests is under way."""

    @abc.abstractmethod
    async def output(self) -> str:
        """The env's last lines of output, for a failure to quote."""

    @abc.abstractmethod
    async def remove(self) -> None:
        """Stop the env and remove what it ran in."""

    async def answers_itself(self) -> bool:
        """Whether what answers at ``base_url`` is this env and not another's (a port taken)."""
        return True


class Sandbox(abc.ABC):
    """Where envs run. ``prepare`` once at start-up, ``launch`` per env per episode, then ``close``."""

    kind = ""
    gates_its_boots = False     # True where the sandbox bounds its own envs' boots (Ray: per node)

    def __init__(self, owner: str):
        self.owner = owner

    async def prepare(self, envs: list[EnvSpec]) -> None:
        """Remove what a crashed earlier run left, and make every env ready to launch."""

    @abc.abstractmethod
    async def launch(self, env: EnvSpec, episode: str, limits: dict[str, Any]) -> Instance:
        """Start an env for an episode (not yet ready: see wait_ready)."""

    async def close(self) -> None:
        """Wait for removals under way, and let go of what the sandbox holds."""


async def guarded(awaitable: Any, undo: Callable[[Any], None]) -> Any:
    """Await something that creates a resource; if the waiter gives up first (a deadline, an
    abandoned episode), undo the resource as soon as it appears, so nothing is left running."""
    future = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(future)
    except BaseException:
        def later(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                undo(done.result())
        if future.done():
            later(future)
        else:
            future.add_done_callback(later)
        raise


def state_dir() -> Path:
    """Where agentenv.py records the local processes it starts, so a restart can clean them up."""
    base = os.environ.get("AGENTENV_STATE_DIR") or Path(
        os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "agentenv"
    return Path(base)


class LocalInstance(Instance):
    """An env run as a host process in its own process group, with a scratch folder of its own
    (its TMPDIR and database); its output kept in a ring."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, record: Path, scratch: Path,
                 release: Callable[[], None] = lambda: None, host: str = "127.0.0.1"):
        self.proc, self.port, self.record, self.scratch = proc, port, record, scratch
        self.release = release
        self.base_url = f"http://{host}:{port}"
        self.lines: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        # Chunks, not readline: a line of any length must never stop the reader, or the pipe
        # fills and the env blocks on its next print.
        assert self.proc.stdout
        partial = b""
        while chunk := await self.proc.stdout.read(65536):
            *lines, partial = (partial + chunk).split(b"\n")
            self.lines.extend(line.decode(errors="replace").rstrip()[:2000] for line in lines)
            partial = partial[-2000:]
        if partial:
            self.lines.append(partial.decode(errors="replace").rstrip())

    async def exited(self, settle: float = 0.0) -> str | None:
        if settle and self.proc.returncode is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), settle)
        code = self.proc.returncode
        return None if code is None else f"its process exited with code {code}"

    async def output(self) -> str:
        if self.proc.returncode is not None:       # its last words may still be in the pipe
            await asyncio.wait([self.reader], timeout=1)
        return "\n".join(self.lines)

    async def answers_itself(self) -> bool:
        # A port found free can be taken by another process before the env binds it; then the
        # env dies on bind while the other answers in its place. Linux says who listens.
        # (a few small reads from Linux: no thread for it)
        return listens(self.proc.pid, self.port) is not False

    async def remove(self) -> None:
        try:
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(self.proc.wait(), 3)
                except asyncio.TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.proc.wait(), 5)
            # the group may hold children of the env's process: end them too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await asyncio.wait([self.reader], timeout=1)
            self.reader.cancel()
        finally:
            self.release()
            self.record.unlink(missing_ok=True)
            shutil.rmtree(self.scratch, ignore_errors=True)


class LocalSandbox(Sandbox):
    """Runs each env's image command as a host process, in the env's folder, on a free port.

    It is the embedded default where no Docker daemon answers: no isolation, but the same wire.
    Every process is recorded under the state folder, so the next start kills what a crash left.
    ``host`` is the address envs bind (a Ray node's own, say); with ``die_with_parent`` each env
    is killed by Linux the moment the thread that started it ends (a Ray host actor killed).
    """

    kind = "local"

    def __init__(self, owner: str, host: str = "127.0.0.1", die_with_parent: bool = False):
        super().__init__(owner)
        self.host, self.die_with_parent = host, die_with_parent
        self.records = state_dir() / "local" / owner
        self.ports: set[int] = set()        # handed to envs still running: never handed twice

    async def prepare(self, envs: list[EnvSpec]) -> None:
        killed = await asyncio.to_thread(self._sweep)
        if killed:
            log.warning("Killed %d env process group(s) that an earlier run of agentenv.py left "
                        "behind when it stopped without tearing down.", killed)

    def _sweep(self) -> int:
        """Kill, once each, the process groups of env processes whose server is gone: those its
        records name, and (Linux's /proc) any with a dead owner in their environment, which finds
        one whose record a crash kept from being written."""
        groups: set[int] = set()
        root = self.records.parent
        for folder in root.iterdir() if root.is_dir() else []:
            if not folder.is_dir() or folder == self.records or owner_alive(folder.name) is not False:
                continue
            for record in folder.iterdir():     # a pid file per env process; scratch folders
                if record.is_file() and record.name.isdigit():
                    started = record.read_text().strip()
                    if started and _process_start(int(record.name)) == started:
                        groups.add(int(record.name))
            shutil.rmtree(folder, ignore_errors=True)
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if not entry.isdigit():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:                     # gone, or another user's
                continue
            marker = environ.find(b"AGENTENV_OWNER=")
            if marker < 0 or (marker and environ[marker - 1] != 0):
                continue
            owner = environ[marker + 15:].split(b"\0", 1)[0].decode(errors="replace")
            if owner_alive(owner) is False:
                with contextlib.suppress(OSError):
                    groups.add(os.getpgid(int(entry)))
        killed = 0
        for group in groups - {os.getpgrp()}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
                killed += 1
        return killed

    async def launch(self, env: EnvSpec, episode: str, limits: dict[str, Any]) -> Instance:
        port = free_port(self.host)
        while port in self.ports:             # the kernel hands a closed port out again at once
            port = free_port(self.host)
        self.ports.add(port)                  # taken now: another launch may be under way
        try:
            return await self._launch(env, port)
        except BaseException:
            self.ports.discard(port)
            raise

    async def _launch(self, env: EnvSpec, port: int) -> Instance:
        command = list(env.command)
        if Path(command[0]).name in ("python", "python3"):
            command[0] = sys.executable      # "python" in an image's command means this interpreter
        # The env's scratch folder lives beside its record, so a crashed run's are swept with them.
        self.records.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"scratch-{env.name}-", dir=self.records))
        # The owner marks the process and all it starts, so a sweep finds even one whose record
        # a crash kept from being written; the server's own token stays with the server.
        environ = {**{k: v for k, v in os.environ.items() if k != "AGENTENV_TOKEN"}, **env.image_env,
                   "AGENTENV_OWNER": self.owner,
                   "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
                   "ENVIRONMENT_NAME": env.environment_name, "MCP_HOST": self.host,
                   "MCP_PORT": str(port), "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch),
                   "DATABASE_URL": f"sqlite:///{scratch}/{env.environment_name}.sqlite"}
        spawn = asyncio.create_subprocess_exec(
            *command, cwd=env.folder, env=environ, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent if self.die_with_parent else None)

        def kill(proc: asyncio.subprocess.Process) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc = await guarded(spawn, kill)
        except OSError as exc:
            shutil.rmtree(scratch, ignore_errors=True)
            raise EpisodeFailed(f"env {env.name!r} could not start: running {shlex.join(command)} in "
                                f"{env.folder} failed ({exc}); fix the Dockerfile's CMD",
                                PROVIDER_UNAVAILABLE) from None
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        record = self.records / str(proc.pid)
        record.write_text(_process_start(proc.pid))
        return LocalInstance(proc, port, record, scratch, lambda: self.ports.discard(port), self.host)


def die_with_parent() -> None:
    """In a child between fork and exec: have Linux SIGKILL it when the thread that started it
    ends. An env in a session of its own escapes its parent's process group, so this is what
    ties it to its parent's life."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_for_children_by_pidfd() -> None:
    """Have the event loop wait for env processes through Linux's pidfds. Python 3.11 waits for
    each child in a thread of its own, and a server that starts thousands of envs then churns
    thousands of threads, and RSS grows with the allocator's per-thread arenas (+71.5 MiB over
    5,000 episodes; +47.7 with pidfds). 3.12 uses pidfds itself; without them the threads stay."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:                      # a kernel or seccomp profile without pidfds
        return
    asyncio.get_event_loop_policy().set_child_watcher(asyncio.PidfdChildWatcher())


LOCAL_PORTS_FROM = 20000          # local envs listen from here up to the ephemeral range


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` that nothing holds, below the kernel's ephemeral range where it can.

    The kernel takes a connection's source port from the ephemeral range, so a port picked there
    can be taken by any client's connection before the env binds it (6 of 30,000 deploys failed
    so with two servers busy on one machine); below the range only a listener can take it."""
    with contextlib.suppress(OSError, ValueError):
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        for _ in range(64) if ephemeral - LOCAL_PORTS_FROM >= 1000 else ():
            port = random.randrange(LOCAL_PORTS_FROM, ephemeral)
            with socket.socket() as sock, contextlib.suppress(OSError):
                sock.bind((host, port))
                return port
    with socket.socket() as sock:                 # no such range here: the kernel's choice
        sock.bind((host, 0))
        return sock.getsockname()[1]


def listens(pid: int, port: int) -> bool | None:
    """Whether the process ``pid`` or one of its descendants holds the socket listening on
    ``port``; None where Linux can't say (not Linux, or no such listener yet)."""
    inodes = listening_sockets(port)
    if not inodes:
        return None
    family, seen = [pid], set()
    while family:
        member = family.pop()
        seen.add(member)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{member}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{member}/fd/{fd}") in inodes:
                        return True
        with contextlib.suppress(OSError, ValueError):
            children = Path(f"/proc/{member}/task/{member}/children").read_text().split()
            family.extend(int(c) for c in children if int(c) not in seen)
    return False


# Linux's sock_diag over netlink: asked for TCP sockets in the LISTEN state only, it answers the
# few listeners, where /proc/net/tcp lists every socket of the host (thousands in TIME_WAIT under
# load, several hundred KB a read, a heap of garbage per deploy).
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLMSG_DONE, NLMSG_ERROR = 4, 20, 3, 2
TCP_LISTEN = 10


def listening_sockets(port: int) -> set[str]:
    """The sockets (as /proc's fd links name them) listening on TCP ``port`` of this namespace."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as link:
            return {f"socket:[{inode}]" for family in (socket.AF_INET, socket.AF_INET6)
                    for inode in _listeners(link, family, port)}
    except (OSError, AttributeError):        # no netlink here (not Linux, or a seccomp profile)
        return _listening_sockets_from_proc(port)


def _listeners(link: socket.socket, family: int, port: int) -> list[int]:
    # struct inet_diag_req_v2: family, protocol, ext, pad, states; then a zeroed inet_diag_sockid
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN) + bytes(48)
    link.send(struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, 0x301, 1, 0) + request)
    inodes = []
    while True:
        data, at = link.recv(65536), 0
        while at + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, at)
            if kind == NLMSG_DONE:
                return inodes
            if kind == NLMSG_ERROR:
                raise OSError("sock_diag refused the request")
            # struct inet_diag_msg: family, state, timer, retrans, then the sockid (sport first,
            # big-endian), expires, rqueue, wqueue, uid, inode
            if struct.unpack_from(">H", data, at + 20)[0] == port:
                inodes.append(struct.unpack_from("=I", data, at + 16 + 68)[0])
            at += (length + 3) & ~3
        if not data:
            return inodes


def _listening_sockets_from_proc(port: int) -> set[str]:
    inodes = set()
    # search the bytes for the listener's line rather than split thousands of lines
    needles = [f":{port:04X} {'0' * width}:0000 0A ".encode() for width in (8, 32)]
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            data = Path(table).read_bytes()
        except OSError:
            continue
        for needle in needles:
            at = data.find(needle)
            while at >= 0:
                line = data[data.rfind(b"\n", 0, at) + 1:data.find(b"\n", at)].split()
                inodes.add(f"socket:[{line[9].decode()}]")
                at = data.find(needle, at + 1)
    return inodes


class DockerInstance(Instance):
    """An env's container, published on a random port of 127.0.0.1."""

    def __init__(self, sandbox: DockerSandbox, container: Any, port: str):
        self.sandbox, self.container = sandbox, container
        self.base_url = f"http://127.0.0.1:{port}"
        self._checked = 0.0

    async def exited(self, settle: float = 0.0) -> str | None:
        if not settle and time.monotonic() - self._checked < 0.5:   # a daemon call twice a second
            return None
        self._checked = time.monotonic()
        import docker.errors
        try:
            await self.sandbox.call(self.container.reload, timeout=10)
        except docker.errors.NotFound:
            return "its container is gone (removed from outside)"
        except Exception as exc:                        # noqa: BLE001 - a busy daemon is not a dead env
            log.info("Could not inspect container %s (%s); taking it to be still up.",
                     self.container.short_id, exc)
            return None
        state = self.container.attrs.get("State", {})
        if state.get("Status") in ("exited", "dead"):
            return (f"its container exited with code {state.get('ExitCode')}"
                    + (" (killed for running out of memory)" if state.get("OOMKilled") else ""))
        return None

    async def output(self) -> str:
        try:
            raw = await self.sandbox.call(self.container.logs, tail=OUTPUT_LINES, timeout=10)
            return raw.decode(errors="replace")
        except Exception as exc:                        # noqa: BLE001
            return f"(its logs could not be read: {exc})"

    async def remove(self) -> None:
        await self.sandbox.remove(self.container)


class DockerSandbox(Sandbox):
    """Runs each env as a container on the user's Docker, from an image built once per content.

    Containers carry labels naming their owner (this server) and episode before they exist, so a
    sweep at start-up removes what a killed earlier run left, and a container created after its
    episode gave up is removed the moment it appears. Every daemon call runs in a thread with a
    deadline, and at most ``ops`` of them at once, so a slow daemon never stalls the event loop.
    """

    kind = "docker"

    def __init__(self, owner: str, client: Any, ops: int = 8):
        super().__init__(owner)
        from concurrent.futures import ThreadPoolExecutor
        self.client = client
        self.images: dict[str, str] = {}
        self.limit = asyncio.Semaphore(ops)
        self.threads = ThreadPoolExecutor(max_workers=ops + 4, thread_name_prefix="docker")
        self.removals: set[asyncio.Task] = set()
        self.creating: set[asyncio.Future] = set()

    @classmethod
    async def connect(cls, owner: str) -> DockerSandbox:
        try:
            import docker
        except ImportError:
            raise AgentEnvError("the docker sandbox needs the docker package: pip install docker") from None
        try:
            client = await asyncio.wait_for(asyncio.to_thread(
                lambda: docker.from_env(timeout=120)), 10)
            await asyncio.wait_for(asyncio.to_thread(client.ping), 10)
        except Exception as exc:                        # noqa: BLE001 - docker raises many kinds
            raise AgentEnvError(f"no Docker daemon answered ({short(str(exc), 300)}); start Docker, "
                                "set DOCKER_HOST, or pass --sandbox local") from None
        return cls(owner, client)

    async def start(self, fn: Callable, *args: Any, **kwargs: Any) -> asyncio.Future:
        """Start a blocking docker SDK call in a thread, once one of the ``ops`` slots is free.

        The slot is given back when the thread ends, not when its caller stops waiting: a call
        past its deadline still loads the daemon, so it still counts against the cap."""
        await self.limit.acquire()
        loop = asyncio.get_running_loop()

        def give_back(_: Any) -> None:
            with contextlib.suppress(RuntimeError):        # the loop has closed: nothing waits
                loop.call_soon_threadsafe(self.limit.release)
        try:
            job = self.threads.submit(fn, *args, **kwargs)
        except BaseException:
            self.limit.release()
            raise
        job.add_done_callback(give_back)
        return asyncio.wrap_future(job)

    async def call(self, fn: Callable, *args: Any, timeout: float = 60, **kwargs: Any) -> Any:
        """Run a blocking docker SDK call in a thread, with a deadline."""
        return await asyncio.wait_for(await self.start(fn, *args, **kwargs), timeout)

    async def prepare(self, envs: list[EnvSpec]) -> None:
        await self.sweep()
        for env in envs:
            self.images[env.name] = await self.build(env)

    async def sweep(self) -> None:
        # sparse: the list as the daemon gave it, with no inspect of each container, which fails
        # for one removed meanwhile (by another server's sweep, say)
        containers = await self.call(self.client.containers.list, all=True, sparse=True,
                                     filters={"label": "agentenv.owner"})
        stale = [c for c in containers
                 if owner_alive((c.attrs.get("Labels") or {}).get("agentenv.owner", "")) is False]
        await asyncio.gather(*(self.remove(c) for c in stale))
        if stale:
            log.warning("Removed %d container(s) that an earlier run of agentenv.py left behind when "
                        "it stopped without tearing down.", len(stale))

    async def build(self, env: EnvSpec) -> str:
        tag = f"agentenv/{re.sub(r'[^a-z0-9_.-]', '-', env.name.lower())}:{env.digest}"
        import docker.errors
        try:
            await self.call(self.client.images.get, tag, timeout=30)
            return tag
        except docker.errors.ImageNotFound:
            pass
        log.info("Building the image of env %r as %s (once per content of envs/%s).",
                 env.name, tag, env.name)
        started = time.monotonic()
        try:
            await self.call(self.client.images.build, path=str(env.folder),
                            dockerfile=env.dockerfile.name, tag=tag, rm=True, forcerm=True,
                            labels={"agentenv.env": env.name}, timeout=1800)
        except docker.errors.BuildError as exc:
            lines = "".join(str(c.get("stream", c.get("error", ""))) for c in exc.build_log)
            raise AgentEnvError(f"the image of env {env.name!r} did not build: {exc.msg}\n"
                                f"{short(lines, 1500)}\nFix envs/{env.name}/{env.dockerfile.name}; "
                                "with no registry reachable, its FROM image must exist locally") from None
        except docker.errors.APIError as exc:
            raise AgentEnvError(f"the image of env {env.name!r} did not build: {exc}") from None
        log.info("Built %s in %.1fs.", tag, time.monotonic() - started)
        return tag

    async def launch(self, env: EnvSpec, episode: str, limits: dict[str, Any]) -> Instance:
        options: dict[str, Any] = dict(
            image=self.images.get(env.name) or await self.build(env), detach=True,
            ports={f"{ENV_PORT}/tcp": ("127.0.0.1", None)},
            environment={"ENVIRONMENT_NAME": env.environment_name, "MCP_HOST": "0.0.0.0",
                         "DATABASE_URL": f"sqlite:////tmp/{env.environment_name}.sqlite"},
            labels={"agentenv.owner": self.owner, "agentenv.episode": episode,
                    "agentenv.env": env.name},
            # unprivileged: no capabilities, no privilege gain, no host mounts, bounded processes
            security_opt=["no-new-privileges"], cap_drop=["ALL"], pids_limit=DOCKER_PIDS_LIMIT)
        if limits.get("cpu"):
            options["nano_cpus"] = int(float(limits["cpu"]) * 1e9)
        if limits.get("memory_mb"):
            options["mem_limit"] = f"{int(limits['memory_mb'])}m"

        def create_and_start() -> tuple[Any, str]:
            container = self.client.containers.create(**options)
            try:
                container.start()
                for _ in range(100):    # the published port shows once the daemon has bound it
                    container.reload()
                    ports = (container.attrs.get("NetworkSettings") or {}).get("Ports") or {}
                    if ports.get(f"{ENV_PORT}/tcp"):
                        return container, ports[f"{ENV_PORT}/tcp"][0]["HostPort"]
                    state = container.attrs.get("State") or {}
                    if state.get("Status") in ("exited", "dead"):
                        output = container.logs(tail=OUTPUT_LINES).decode(errors="replace")
                        raise RuntimeError(f"its container exited with code {state.get('ExitCode')} "
                                           f"as it started. Its last output:\n{short(output)}")
                    time.sleep(0.02)
                raise RuntimeError("the daemon published no port for its container within 2s")
            except BaseException:
                container.remove(force=True)
                raise

        def undo(created: tuple[Any, str]) -> None:
            task = asyncio.get_running_loop().create_task(self.remove(created[0]))
            self.removals.add(task)
            task.add_done_callback(self.removals.discard)

        # The thread's own future is kept until the thread ends, so neither a deadline nor an
        # abandoned episode nor close() can lose a container that is still being created; and
        # a creation past its deadline holds its slot until it ends, capping those in flight.
        job = await self.start(create_and_start)
        self.creating.add(job)
        job.add_done_callback(self.creating.discard)
        try:
            container, port = await asyncio.wait_for(guarded(job, undo), 120)
        except asyncio.TimeoutError:
            raise EpisodeFailed(f"env {env.name!r}: the Docker daemon did not create and start "
                                "its container within 120s; it may be overloaded (lower "
                                "--max-concurrent-envs)", PROVIDER_UNAVAILABLE) from None
        except Exception as exc:                    # noqa: BLE001 - docker raises many kinds
            raise EpisodeFailed(f"env {env.name!r} did not come up: {short(str(exc), 2500)}",
                                PROVIDER_UNAVAILABLE) from None
        return DockerInstance(self, container, port)

    async def remove(self, container: Any) -> None:
        """Force-remove a container; retried, and reported if it still stands."""
        import docker.errors
        for attempt in range(3):
            try:
                await self.call(container.remove, force=True, timeout=30)
                return
            except docker.errors.NotFound:
                return
            except Exception as exc:                    # noqa: BLE001
                error = exc
        log.error("Could not remove container %s (%s); remove it with docker rm -f %s.",
                  container.short_id, error, container.short_id)

    async def close(self) -> None:
        """Wait for containers still being created (they are removed as they appear), then for
        every removal under way."""
        if self.creating:
            await asyncio.wait(set(self.creating), timeout=150)
            await asyncio.sleep(0)          # let their done-callbacks schedule the removals
        if self.removals:
            await asyncio.gather(*set(self.removals), return_exceptions=True)
        self.threads.shutdown(wait=False)


# -- Ray: envs placed across a cluster
#
# Ray places, nothing of ours schedules: each episode's env gets a placement group sized by its
# deploy_env step, Ray picks a node with room (or queues it while the cluster is full), and the
# node's host actor (one per node, long-lived, no CPU of its own) starts the env there as a local
# process bound to the node's address. Tool calls then go straight to that address; only the
# env's liveness and output go through the actor. Docker on each node is for a later change.

RAY_INSTALL = "pip install 'agentenv-py[ray]' (or: pip install 'ray[default]>=2.50,<3')"
RAY_ENV_CPU = 1.0                 # a deploy_env step's cpu when it names none: Ray's task default
RAY_ENV_MEMORY_MB = 256           # its memory_mb when it names none (placement bookkeeping only)
RAY_RESOURCE_SHARE = 0.001        # of --ray-resource each env asks, so declaring 1 marks a node
RAY_CONNECT_TIMEOUT = 30.0        # joining the cluster at start-up
RAY_CALL_TIMEOUT = 10.0           # a call to a host actor (output, a port's owner)
RAY_LIVENESS_TIMEOUT = 2.0        # a host's answer whether an env still runs (else: taken as up)
RAY_BOOT_HOLD = 10.0              # a boot stops counting against its node's gate after this


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """Where the Ray sandbox finds its cluster and nodes: the cluster's address, the custom
    resource that marks env nodes (none: any node with CPUs), and the deploy deadline a placement
    no node can ever meet is given before it fails."""

    address: str = "auto"
    resource: str | None = None
    deploy_timeout: float = Settings.deploy_timeout

    @staticmethod
    def address_from(given: str | None, gym: str | None = None) -> str:
        """``--ray-address``, else RAY_ADDRESS, else the ray_head_node_address Gym passes, else
        ``auto`` (the cluster this machine's ``ray start`` made)."""
        return given or os.environ.get("RAY_ADDRESS") or gym or "auto"


def env_archive(env: EnvSpec) -> bytes:
    """An env's folder as a gzipped tar, for a node that may not share this machine's files."""
    import io
    import tarfile
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(env.folder, arcname=".", filter=lambda i: None if "__pycache__" in i.name else i)
    return buffer.getvalue()


def node_env(env: dict[str, Any], archive: bytes) -> EnvSpec:
    """On a node: an env's spec, its folder unpacked once per content under the state folder."""
    import io
    import tarfile
    folder = state_dir() / "ray-envs" / f"{env['name']}-{env['digest']}"
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        unpacking = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=folder.parent))
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            tar.extractall(unpacking, filter="data")
        try:
            unpacking.rename(folder)
        except OSError:                       # another host on this machine unpacked it first
            shutil.rmtree(unpacking, ignore_errors=True)
    return EnvSpec(**{**env, "folder": folder, "dockerfile": folder / env["dockerfile"]})


class EnvHost:
    """A node's host actor, run by Ray on that node: the local sandbox there, its envs by key, and
    the node's boot gate (sized by the node's cores, held until an env listens).

    Ray runs it from this file's own text (``host_actor``), so a node needs Ray, not agentenv.py;
    it lives as long as the server's connection to the cluster, and its envs die with it."""

    def __init__(self, address: str, envs: dict[str, tuple[dict[str, Any], bytes]],
                 state: str | None):
        if state:
            os.environ["AGENTENV_STATE_DIR"] = state
        self.address, self.cores = address, os.cpu_count() or 2
        self.sandbox = LocalSandbox(owner_id(), host=address, die_with_parent=True)
        swept = self.sandbox._sweep()          # what a host of an earlier run left on this node
        if swept:
            log.warning("Killed %d env process group(s) that an earlier host on node %s left.",
                        swept, address)
        self.envs = {name: node_env(spec, archive) for name, (spec, archive) in envs.items()}
        self.instances: dict[str, LocalInstance] = {}
        self.boot_slots = 2 * self.cores     # as the runtime's own gate is sized on one machine
        self.gate = asyncio.Semaphore(self.boot_slots)

    async def node(self) -> dict[str, Any]:
        """What the node is: its address, its cores, its boot gate, the envs it can start."""
        return {"address": self.address, "cores": self.cores, "boot_slots": self.boot_slots,
                "pid": os.getpid(), "envs": sorted(self.envs)}

    async def launch(self, env: str, episode: str, limits: dict[str, Any]) -> tuple[str, str]:
        """Start an env; its key and base URL, once it listens (or has had the gate's hold)."""
        async with self.gate:
            instance = await self.sandbox.launch(self.envs[env], episode, limits)
            key = uuid.uuid4().hex
            self.instances[key] = instance
            deadline = time.monotonic() + RAY_BOOT_HOLD
            while time.monotonic() < deadline and instance.proc.returncode is None and \
                    not listens(instance.proc.pid, instance.port):
                await asyncio.sleep(0.02)     # polling: a port being bound sends no event
        return key, instance.base_url

    async def exited(self, key: str, settle: float = 0.0) -> str | None:
        instance = self.instances.get(key)
        if instance is None:
            return "its node's host actor restarted, and the envs it ran went with the old one"
        return await instance.exited(settle)

    async def output(self, key: str) -> str:
        instance = self.instances.get(key)
        return await instance.output() if instance else ""

    async def answers_itself(self, key: str) -> bool:
        instance = self.instances.get(key)
        return instance is not None and await instance.answers_itself()

    async def remove(self, key: str) -> None:
        if instance := self.instances.pop(key, None):
            await instance.remove()

    async def live(self) -> int:
        return len(self.instances)


def host_actor(ray: Any) -> Any:
    """EnvHost as a Ray actor class that runs this file's text on its node: nodes need not have
    agentenv.py (or the same copy), and the class pickles by value. No CPU of its own; restarted
    in place if its process dies, on that node only."""
    source = Path(__file__).read_text()

    class NodeHost:
        def __init__(self, *args: Any) -> None:
            import types
            module = types.ModuleType("agentenv_node")
            module.__file__ = "agentenv.py"
            sys.modules[module.__name__] = module      # dataclasses look their module up
            exec(compile(source, "agentenv.py", "exec"), module.__dict__)
            self.host = module.EnvHost(*args)

    for name in ("node", "launch", "exited", "output", "answers_itself", "remove", "live"):
        async def forward(self: Any, *args: Any, _name: str = name) -> Any:
            return await getattr(self.host, _name)(*args)
        forward.__name__ = name
        setattr(NodeHost, name, forward)
    NodeHost.__name__ = NodeHost.__qualname__ = "EnvHost"
    return ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(NodeHost)


@dataclasses.dataclass
class RayNode:
    """A node of the cluster as the sandbox sees it: its id, address, resources, its host."""

    id: str
    address: str
    resources: dict[str, float]
    host: Any = None
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)


class RayInstance(Instance):
    """An env on a Ray node: reached straight at the node's address; its liveness, output and
    removal asked of the node's host actor, each within a deadline; its placement group freed
    with it."""

    def __init__(self, sandbox: RaySandbox, node: RayNode, key: str, base_url: str, group: Any):
        self.sandbox, self.node, self.key, self.group = sandbox, node, key, group
        self.base_url = base_url
        self._checked = 0.0
        self._gone: str | None = None         # why the env's host is gone, once it is

    async def exited(self, settle: float = 0.0) -> str | None:
        if self._gone:
            return self._gone
        if not settle and time.monotonic() - self._checked < 0.25:   # an actor call 4 times a second
            return None
        self._checked = time.monotonic()
        try:
            return await self.sandbox.ask(self.node.host.exited.remote(self.key, settle),
                                          settle + RAY_LIVENESS_TIMEOUT)
        except asyncio.TimeoutError:
            log.info("The host actor of node %s did not answer within %gs; taking its env to be "
                     "still up.", self.node.address, settle + RAY_LIVENESS_TIMEOUT)
            return None
        except Exception as exc:                        # noqa: BLE001 - Ray raises many kinds
            self._gone = f"the host actor of node {self.node.address} is gone " \
                         f"({type(exc).__name__}), and its envs with it"
            return self._gone

    async def output(self) -> str:
        if self._gone:                   # its output went with it; a restarting host is slow to ask
            return "(its output went with its host actor)"
        try:
            return await self.sandbox.ask(self.node.host.output.remote(self.key), RAY_CALL_TIMEOUT)
        except Exception as exc:                        # noqa: BLE001
            return f"(its output could not be read from node {self.node.address}: " \
                   f"{type(exc).__name__})"

    async def answers_itself(self) -> bool:
        try:
            return await self.sandbox.ask(self.node.host.answers_itself.remote(self.key),
                                          RAY_CALL_TIMEOUT)
        except Exception:                               # noqa: BLE001 - a busy host is not a taken port
            return True

    async def remove(self) -> None:
        try:
            await self.sandbox.ask(self.node.host.remove.remote(self.key), 30)
        except Exception as exc:                        # noqa: BLE001 - a dead host took its envs along
            log.info("Node %s's host could not remove env %s (%s); its envs die with it.",
                     self.node.address, self.key[:8], type(exc).__name__)
        finally:
            await self.sandbox.release(self.group)


class RaySandbox(Sandbox):
    """Runs envs across a Ray cluster: a host actor per node, a placement group per env.

    Ray queues a placement while the cluster is full; one no live node could ever meet fails
    after the deploy deadline. The actors are not detached, so they (and their envs) end with
    this server's connection to the cluster, even on SIGKILL."""

    kind = "ray"
    gates_its_boots = True

    def __init__(self, owner: str, ray: Any, options: RayOptions):
        super().__init__(owner)
        self.ray, self.options = ray, options
        self.nodes: dict[str, RayNode] = {}
        self.envs: Any = None                 # the env folders, in the object store once
        self.Host = host_actor(ray)
        self._view: tuple[float, list[dict[str, Any]]] = (0.0, [])
        self._hosting: dict[str, asyncio.Future] = {}
        # where the latest envs landed (episode, env, node address), for check to say
        self.placed: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=256)

    @classmethod
    async def connect(cls, owner: str, options: RayOptions) -> RaySandbox:
        try:
            import ray
        except ImportError:
            raise AgentEnvError(f"--sandbox ray needs Ray installed in this Python: {RAY_INSTALL}"
                                ) from None
        address = options.address
        fix = ("start the cluster (ray start --head on one machine, ray start --address=HEAD:PORT "
               "on the others), or pass its address with --ray-address (or RAY_ADDRESS)")
        if address != "auto" and not await _answers(address):
            raise AgentEnvError(f"no Ray cluster answers at {address}: nothing listens there; {fix}")
        try:
            await asyncio.wait_for(in_daemon_thread(lambda: ray.init(
                address=address, log_to_driver=False, logging_level=logging.WARNING,
                configure_logging=False)), RAY_CONNECT_TIMEOUT)
        except asyncio.TimeoutError:
            raise AgentEnvError(f"the Ray cluster at {address} did not let this server join within "
                                f"{RAY_CONNECT_TIMEOUT:g}s (with token auth on, RAY_AUTH_TOKEN or "
                                f"~/.ray/auth_token must hold the cluster's token); {fix}") from None
        except Exception as exc:                        # noqa: BLE001 - Ray raises many kinds
            raise AgentEnvError(f"could not join the Ray cluster at {address} "
                                f"({short(str(exc), 300)}); {fix}") from None
        return cls(owner, ray, options)

    async def ask(self, ref: Any, timeout: float) -> Any:
        """A Ray call's result, within a deadline."""
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)

    async def cluster(self, fresh: bool = False) -> list[dict[str, Any]]:
        """The live nodes, as Ray lists them; asked at most once a second."""
        at, nodes = self._view
        if fresh or time.monotonic() - at > 1.0:
            nodes = [n for n in await asyncio.to_thread(self.ray.nodes) if n.get("Alive")]
            self._view = (time.monotonic(), nodes)
        return nodes

    def env_node(self, node: dict[str, Any]) -> bool:
        resources = node.get("Resources") or {}
        wanted = self.options.resource
        return resources.get("CPU", 0) > 0 and (not wanted or resources.get(wanted, 0) > 0)

    async def prepare(self, envs: list[EnvSpec]) -> None:
        """Put the env folders in the object store, start a host on every env node, and say
        what each node runs."""
        archives = {}
        for env in envs:
            spec = {f.name: getattr(env, f.name) for f in dataclasses.fields(env)}
            spec.update(folder="", dockerfile=env.dockerfile.name)
            archives[env.name] = (spec, await asyncio.to_thread(env_archive, env))
        self.envs = await asyncio.to_thread(self.ray.put, archives)
        nodes = [n for n in await self.cluster(fresh=True) if self.env_node(n)]
        if not nodes:
            wanted = f" that declares the resource {self.options.resource!r}" \
                if self.options.resource else " with CPUs"
            raise AgentEnvError(f"the Ray cluster at {self.options.address} has no live node"
                                f"{wanted}; start one (ray start --address=HEAD:PORT"
                                f"{' --resources=' + json.dumps({self.options.resource: 1}) if self.options.resource else ''})")
        await asyncio.gather(*(self.host(n) for n in nodes))

    async def host(self, node: dict[str, Any]) -> RayNode:
        """The node's host, started (once) the first time the node is needed."""
        node_id = node["NodeID"]
        if node_id not in self._hosting:
            self._hosting[node_id] = asyncio.ensure_future(self._start_host(node))
        try:
            return await asyncio.shield(self._hosting[node_id])
        except Exception:
            self._hosting.pop(node_id, None)           # the next episode there tries again
            raise

    async def _start_host(self, node: dict[str, Any]) -> RayNode:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        address = node["NodeManagerAddress"]
        state = os.environ.get("AGENTENV_STATE_DIR")
        actor = self.Host.options(
            name=f"agentenv-host-{node['NodeID'][:12]}-{os.getpid()}",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote(address, self.envs, state)
        try:
            facts = await self.ask(actor.node.remote(), 120)
        except Exception as exc:                        # noqa: BLE001
            self.ray.kill(actor)
            raise EpisodeFailed(f"the host actor of Ray node {address} did not start within 120s "
                                f"({type(exc).__name__}: {short(str(exc), 300)})",
                                PROVIDER_UNAVAILABLE) from None
        found = RayNode(node["NodeID"], address, dict(node.get("Resources") or {}), actor, facts)
        self.nodes[found.id] = found
        log.info("Ray node %s (%g CPUs, %d cores): envs run there as local processes bound to "
                 "%s, up to %d booting at once (Docker per node is not supported yet).", address,
                 found.resources.get("CPU", 0), facts["cores"], address, facts["boot_slots"])
        return found

    def demand(self, limits: dict[str, Any]) -> dict[str, float]:
        """What one env's placement asks of a node."""
        want = {"CPU": float(limits.get("cpu") or RAY_ENV_CPU),
                "memory": float(limits.get("memory_mb") or RAY_ENV_MEMORY_MB) * 2**20}
        if self.options.resource:
            want[self.options.resource] = RAY_RESOURCE_SHARE
        return want

    async def launch(self, env: EnvSpec, episode: str, limits: dict[str, Any]) -> Instance:
        from ray.util.placement_group import placement_group
        want = self.demand(limits)
        group = await asyncio.to_thread(placement_group, [want], strategy="STRICT_PACK",
                                        name=f"agentenv-{episode[:12]}-{env.name}")
        try:
            node = await self._placed(env, group, want)
            key, url = await self.ask(node.host.launch.remote(env.name, episode, limits), 120)
        except BaseException:
            await self.release(group)
            raise
        log.info("Episode %s: env %r placed on Ray node %s at %s.", episode[:8], env.name,
                 node.address, url)
        self.placed.append((episode, env.name, node.address))
        return RayInstance(self, node, key, url, group)

    async def _placed(self, env: EnvSpec, group: Any, want: dict[str, float]) -> RayNode:
        """Wait for Ray to place the group (as long as the cluster could ever meet it) and
        answer the node it chose."""
        from ray.util.placement_group import placement_group_table
        ready = asyncio.wrap_future(group.ready().future())
        hopeless_since: float | None = None
        while not ready.done():
            await asyncio.wait({ready}, timeout=1.0)
            if ready.done():
                break
            nodes = await self.cluster()
            if any(all((n.get("Resources") or {}).get(k, 0) >= v for k, v in want.items())
                   for n in nodes):
                hopeless_since = None
                continue
            hopeless_since = hopeless_since or time.monotonic()
            if time.monotonic() - hopeless_since >= self.options.deploy_timeout:
                offered = "; ".join(f"{n['NodeManagerAddress']}: " + ", ".join(
                    f"{k} {_amount(k, v)}" for k, v in sorted((n.get("Resources") or {}).items())
                    if k in want) for n in nodes) or "no live node"
                asked = ", ".join(f"{k} {_amount(k, v)}" for k, v in want.items())
                raise EpisodeFailed(
                    f"env {env.name!r} asks a Ray node for {asked}, which no live node of the "
                    f"cluster has ({offered}), so it could not be placed within "
                    f"{self.options.deploy_timeout:g}s (the deploy deadline); lower the deploy_env "
                    "step's cpu or memory_mb, or add a node that has them", PROVIDER_UNAVAILABLE)
        ready.result()
        table = await asyncio.to_thread(placement_group_table, group)
        node_id = table["bundles_to_node_id"][0]
        if node_id in self.nodes:
            return self.nodes[node_id]
        node = next((n for n in await self.cluster(fresh=True) if n["NodeID"] == node_id), None)
        if node is None:
            raise EpisodeFailed(f"Ray placed env {env.name!r} on node {node_id[:12]}, which is gone",
                                PROVIDER_UNAVAILABLE)
        return await self.host(node)              # a node that joined after start-up

    async def release(self, group: Any) -> None:
        from ray.util.placement_group import remove_placement_group
        with contextlib.suppress(Exception):     # a cluster going away takes its groups along
            await asyncio.wait_for(asyncio.to_thread(remove_placement_group, group), 30)

    async def close(self) -> None:
        """End every host (their envs die with them) and leave the cluster."""
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.ray.kill, node.host)
        self.nodes.clear()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.to_thread(self.ray.shutdown), 30)


def _amount(resource: str, value: float) -> str:
    return f"{value / 2**20:g} MiB" if resource == "memory" else f"{value:g}"


async def _answers(address: str) -> bool:
    """Whether anything listens at HOST:PORT."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return True                            # not HOST:PORT (ray://...): let Ray say
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), 5)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


def in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run a blocking call that may never return on a daemon thread: a deadline can give up on
    it, and the process can still exit (the default executor's threads are waited for)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result: Any = (True, fn())
        except BaseException as exc:                    # noqa: BLE001 - handed to the waiter
            result = (False, exc)

        def settle() -> None:
            if not future.done():
                future.set_result(result[1]) if result[0] else future.set_exception(result[1])
        with contextlib.suppress(RuntimeError):         # the loop has closed: nothing waits
            loop.call_soon_threadsafe(settle)
    threading.Thread(target=run, name="ray-connect", daemon=True).start()
    return future


async def open_sandbox(kind: str, owner: str, ray: RayOptions | None = None) -> Sandbox:
    """The sandbox ``--sandbox`` names; ``auto`` is Docker when a daemon answers, else local;
    ``ray`` places envs across the Ray cluster ``ray`` names."""
    if kind == "local":
        return LocalSandbox(owner)
    if kind == "docker":
        return await DockerSandbox.connect(owner)
    if kind == "ray":
        return await RaySandbox.connect(owner, ray or RayOptions())
    if kind != "auto":
        raise AgentEnvError(f"--sandbox {kind!r} is not a sandbox; use auto, docker, local or ray")
    try:
        return await DockerSandbox.connect(owner)
    except AgentEnvError as exc:
        log.warning("Envs run as local processes (--sandbox local), with no isolation, since %s.",
                    str(exc).split(";")[0])
        return LocalSandbox(owner)


# ================================================================ 4. Env client

MCP_PROTOCOL = "2025-06-18"
HIDDEN_META = "agentenv.io/hiddenByDefault"
ROLE_HEADER = "AgentEnv-Role"
MAX_TOOL_OUTPUT = 100_000        # characters of a tool's answer passed on to the model


class McpError(AgentEnvError):
    """An env's MCP server refused a request or answered something that isn't MCP."""


class McpRefusal(McpError):
    """A JSON-RPC error the server answered on purpose (unknown tool, bad params)."""


class McpSession:
    """One MCP session with an env server over streamable HTTP, written on aiohttp.

    It speaks JSON-RPC over POST, takes a reply as JSON or as an SSE stream (reading the stream
    only until its own answer arrives), and carries ``Mcp-Session-Id`` once the server assigns one.
    """

    def __init__(self, http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None):
        self.http, self.url = http, url
        self.headers = {"Content-Type": "application/json",
                        "Accept": "application/json, text/event-stream", **(headers or {})}
        self.next_id = 0

    async def open(self, timeout: float = 30) -> dict[str, Any]:
        result = await self.request("initialize", {
            "protocolVersion": MCP_PROTOCOL, "capabilities": {},
            "clientInfo": {"name": "agentenv.py", "version": __version__}}, timeout)
        self.headers["MCP-Protocol-Version"] = str(result.get("protocolVersion", MCP_PROTOCOL))
        await self.notify("notifications/initialized", timeout)
        return result

    async def list_tools(self, timeout: float = 30) -> list[dict[str, Any]]:
        tools: list[dict[str, Any]] = []
        cursor = None
        while True:
            result = await self.request("tools/list", {"cursor": cursor} if cursor else {}, timeout)
            tools.extend(t for t in result.get("tools", []) if isinstance(t, dict) and t.get("name"))
            cursor = result.get("nextCursor")
            if not cursor:
                return tools

    async def call_tool(self, name: str, arguments: dict[str, Any], timeout: float | None = None,
                        ) -> ToolResult:
        try:
            result = await self.request("tools/call", {"name": name, "arguments": arguments}, timeout)
        except McpRefusal as exc:       # the server refused the call itself: the model sees why
            return ToolResult(str(exc), TOOL_ERROR)
        return ToolResult(tool_text(result), TOOL_ERROR if result.get("isError") else OK)

    async def close(self) -> None:
        """End the session on the server; best effort, since the env may already be gone."""
        if "Mcp-Session-Id" in self.headers:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.http.delete(self.url, headers=self.headers,
                                            timeout=aiohttp.ClientTimeout(total=5)):
                    pass

    async def notify(self, method: str, timeout: float | None = 30) -> None:
        body = {"jsonrpc": "2.0", "method": method}
        async with self.http.post(self.url, json=body, headers=self.headers,
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status >= 400:
                raise McpError(f"{method} was answered HTTP {resp.status}: "
                               f"{short(await resp.text(), 300)}")

    async def request(self, method: str, params: dict[str, Any], timeout: float | None = 30) -> dict:
        self.next_id += 1
        rid = self.next_id                  # this request's id, whatever later requests take
        body = {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}
        async with self.http.post(self.url, json=body, headers=self.headers,
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if session := resp.headers.get("Mcp-Session-Id"):
                self.headers["Mcp-Session-Id"] = session
            if resp.status >= 400:
                raise McpError(f"{method} was answered HTTP {resp.status}: "
                               f"{short(await resp.text(errors='replace'), 300)}")
            if resp.content_type == "text/event-stream":
                message = await self._from_stream(resp, rid)
            else:
                try:
                    message = json.loads(await resp.read())
                except ValueError:
                    raise McpError(f"{method} was answered with something that is not JSON") from None
        if not isinstance(message, dict):
            raise McpError(f"{method} was answered with {type(message).__name__}, not a JSON-RPC reply")
        if isinstance(message.get("error"), dict):
            raise McpRefusal(str(message["error"].get("message", message["error"])))
        result = message.get("result")
        if not isinstance(result, dict):
            raise McpError(f"{method} was answered without a result")
        return result

    @staticmethod
    async def _from_stream(resp: aiohttp.ClientResponse, wanted: int) -> Any:
        buffer, data = b"", []
        async for chunk in resp.content.iter_any():
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                line = line.rstrip(b"\r")
                if line.startswith(b"data:"):
                    data.append(line[5:].lstrip(b" "))
                elif not line and data:       # a blank line ends an event
                    with contextlib.suppress(ValueError):
                        message = json.loads(b"\n".join(data))
                        if isinstance(message, dict) and message.get("id") == wanted:
                            return message
                    data = []
        raise McpError("the server's event stream ended without an answer")


def tool_text(result: dict[str, Any]) -> str:
    """The text of a tools/call result, as a model sees it; capped, and the cap said."""
    parts = []
    for item in result.get("content") or []:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "text":
            parts.append(str(item.get("text", "")))
        elif item.get("type") == "resource" and isinstance(item.get("resource"), dict) \
                and "text" in item["resource"]:
            parts.append(str(item["resource"]["text"]))
        else:
            parts.append(f"[{item.get('type', 'unknown')} content: {item.get('mimeType', 'no type')}]")
    if not parts and result.get("structuredContent") is not None:
        parts.append(json.dumps(result["structuredContent"]))
    text = "\n".join(parts)
    if len(text) > MAX_TOOL_OUTPUT:
        text = (text[:MAX_TOOL_OUTPUT] + f"\n[output cut: the tool answered {len(text)} characters; "
                f"agentenv.py passes on the first {MAX_TOOL_OUTPUT}]")
    return text


def is_hidden(tool: dict[str, Any]) -> bool:
    return isinstance(tool.get("_meta"), dict) and tool["_meta"].get(HIDDEN_META) is True


@dataclasses.dataclass
class DeployedEnv:
    """An env deployed for an episode and ready: its MCP URL, its card, the tools it lists."""

    spec: EnvSpec
    instance: Instance
    mcp_url: str
    card: dict[str, Any] | None
    tools: list[dict[str, Any]]

    @property
    def card_name(self) -> str:
        return (self.card or {}).get("name", self.spec.environment_name)

    async def apply(self, http: aiohttp.ClientSession, uri: str, args: dict[str, Any],
                    timeout: float, tolerate: bool) -> None:
        """Post one apply_server_config directive to the extension the env's card advertises."""
        extensions = ((self.card or {}).get("capabilities") or {}).get("extensions") or []
        extension = next((e for e in extensions if isinstance(e, dict) and e.get("uri") == uri), None)
        if extension is None:
            if tolerate:
                log.info("Env %r advertises no extension %s; skipped (tolerate_unadvertised).",
                         self.spec.name, uri)
                return
            offered = [e.get("uri") for e in extensions if isinstance(e, dict)]
            raise EpisodeFailed(f"env {self.spec.name!r} advertises no extension {uri!r} on its card "
                                f"(it advertises {offered}); fix the directive's uri or the env's card")
        params = extension.get("params") or {}
        methods = [m for m in (params.get("methods") or {}).values() if isinstance(m, dict)]
        endpoint = (methods[0].get("endpoint") if methods else None) or params.get("endpoint")
        verb = str((methods[0].get("method") if methods else None) or "POST").upper()
        if not endpoint:
            raise EpisodeFailed(f"env {self.spec.name!r} advertises {uri!r} with no endpoint")
        url = self.instance.base_url + "/" + str(endpoint).lstrip("/")
        request = http.get(url, params={k: str(v) for k, v in args.items()}) if verb == "GET" else \
            http.request(verb, url, json=args)
        try:
            async with asyncio.timeout(timeout):
                async with request as resp:
                    if resp.status >= 300:
                        raise EpisodeFailed(f"env {self.spec.name!r} refused {uri!r} with HTTP "
                                            f"{resp.status}: {short(await resp.text(), 300)}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EpisodeFailed(f"env {self.spec.name!r} did not take {uri!r} within {timeout:g}s "
                                f"({type(exc).__name__}: {exc})") from None


async def wait_ready(http: aiohttp.ClientSession, instance: Instance, env: EnvSpec,
                     timeout: float) -> DeployedEnv:
    """Wait until a launched env answers: its card with its name (or, with no card, MCP
    ``initialize``), and a tools list with at least one tool and no name twice.

    It fails at once when the env stops, and on every failure quotes the env's last output: the
    sandbox could not provide the env (provider_unavailable), or it missed ``timeout``.
    """
    deadline = time.monotonic() + timeout
    delay, last = 0.01, "it did not answer"
    while True:
        if why := await instance.exited():
            raise EpisodeFailed(f"env {env.name!r} did not come up: {why}. Its last output:\n"
                                f"{short(await instance.output())}", PROVIDER_UNAVAILABLE)
        try:
            card = await _read_card(http, instance.base_url)
            if card is not None and card.get("name") != env.environment_name:
                raise EpisodeFailed(
                    f"env {env.name!r} answers with the card of {card.get('name')!r}, not "
                    f"{env.environment_name!r}; set environment_name in envs/{env.name}/env.toml, or "
                    "make the server take its name from ENVIRONMENT_NAME", PROVIDER_UNAVAILABLE)
            mcp_url = instance.base_url + "/" + _mcp_path(card).lstrip("/")
            session = McpSession(http, mcp_url)
            await session.open(timeout=5)
            tools = await session.list_tools(timeout=10)
            await session.close()
            names = [t["name"] for t in tools]
            if not tools:
                raise EpisodeFailed(f"env {env.name!r} lists no tools; an env offers at least one",
                                    PROVIDER_UNAVAILABLE)
            if dupes := sorted({n for n in names if names.count(n) > 1}):
                raise EpisodeFailed(f"env {env.name!r} lists the tools {dupes} twice; tool names are "
                                    "unique", PROVIDER_UNAVAILABLE)
            if not await instance.answers_itself():
                raise McpError(f"another process answers on {instance.base_url}, which the env "
                               "was to listen on; the env is expected to fail to bind it")
            return DeployedEnv(env, instance, mcp_url, card, tools)
        except (aiohttp.ClientError, asyncio.TimeoutError, McpError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise EpisodeFailed(f"env {env.name!r} was not ready within {timeout:g}s (last: {last}), "
                                "the deploy deadline; if it is only slow, raise --deploy-timeout "
                                "(deploy_timeout in a Gym config). Its last output:\n"
                                f"{short(await instance.output())}", TRANSPORT_TIMEOUT)
        # polling: a server that isn't listening yet sends no event to wait for
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)


async def _read_card(http: aiohttp.ClientSession, base_url: str) -> dict[str, Any] | None:
    """The env's card, or None when the server has none (a plain MCP server)."""
    async with http.get(base_url + "/.well-known/agent-env.json",
                        timeout=aiohttp.ClientTimeout(total=5)) as resp:
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise McpError(f"its card answered HTTP {resp.status}")
        card = json.loads(await resp.read())
        if not isinstance(card, dict) or not card.get("name"):
            raise McpError("its card has no name yet")
        return card


def _mcp_path(card: dict[str, Any] | None) -> str:
    for interface in (card or {}).get("additionalInterfaces") or []:
        if isinstance(interface, dict) and interface.get("transport") == "mcp" and interface.get("url"):
            return str(interface["url"])
    return "/mcp"


# ================================================================ 5. Verifiers

def aggregate_score(rows: list[dict[str, Any]], aggregator: str) -> float:
    """AgentEnv's score aggregators, formula for formula."""
    if not rows:
        return 0.0
    if aggregator == "all_pass":
        return 1.0 if all(r.get("result") is True for r in rows) else 0.0
    if aggregator == "any_pass":
        return 1.0 if any(r.get("result") is True for r in rows) else 0.0
    num = den = penalty = 0.0
    for row in rows:
        score = float(row.get("score", 1.0 if row.get("result") else 0.0))
        weight = float(row.get("weight", 1.0))
        if weight > 0:
            num, den = num + score * weight, den + weight
        elif weight < 0:
            penalty += (1 - score) * abs(weight)
    return 0.0 if den == 0 else min(1.0, max(0.0, (num - penalty) / den))


def response_rows(criteria: list[dict[str, Any]], response: str) -> list[dict[str, Any]]:
    """Grade a reply against agent_prompt_response_verifier criteria, one row per criterion."""
    rows = []
    for n, criterion in enumerate(criteria):
        if criterion["type"] == "response_contains":
            missing = [x for x in criterion["needles"] if x not in response]
            passed = not missing
            why = "the reply contains every needle" if passed else f"the reply lacks {missing}"
        else:
            passed = re.search(criterion["pattern"], response,
                               _regex_flags(criterion.get("flags"))) is not None
            why = f"the pattern {'matches' if passed else 'does not match'} the reply"
        rows.append({**criterion, "criterion_index": n, "score": 1.0 if passed else 0.0,
                     "result": passed, "justification": why})
    return rows


def load_verifier(path: Path) -> Callable:
    """Import an artifact's verifier module and return its ``verify``. Bundle code is trusted code."""
    name = "agentenv_verifier_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.verify


async def run_verify(verify: Callable, mcp_url: str, timeout: float) -> Any:
    """An artifact's ``verify(mcp_url)``, cancelled at its deadline (on a verifier loop)."""
    return await asyncio.wait_for(verify(mcp_url), timeout)


class VerifierLoops:
    """Where verifiers run: a few threads, each with an event loop of its own for as long as the
    runtime lives. Bundle code that blocks stalls its own loop, never the server's; each run goes
    to the loop with the fewest under way, so a loop a verifier has stuck is passed over. The
    loops share one small executor for the blocking work verifiers hand to ``asyncio.to_thread``.
    No thread and no loop is made per run: a fresh loop (and its executor's threads) per
    verification churned glibc's per-thread arenas, and the server's memory grew with them."""

    def __init__(self, size: int = 4):
        from concurrent.futures import ThreadPoolExecutor
        self.size = size
        self.loops: list[asyncio.AbstractEventLoop] = []
        self.busy: list[int] = []
        self.threads: list[threading.Thread] = []
        self.blocking = ThreadPoolExecutor(max_workers=size, thread_name_prefix="verifier_io")

    def _open(self) -> None:
        for n in range(self.size):
            loop = asyncio.new_event_loop()
            loop.set_default_executor(self.blocking)
            thread = threading.Thread(target=loop.run_forever, name=f"verifier_{n}", daemon=True)
            thread.start()
            self.loops.append(loop)
            self.busy.append(0)
            self.threads.append(thread)

    async def run(self, verify: Callable, mcp_url: str, timeout: float) -> Any:
        if not self.loops:
            self._open()
        n = min(range(self.size), key=self.busy.__getitem__)
        here = asyncio.get_running_loop()
        self.busy[n] += 1
        job = asyncio.run_coroutine_threadsafe(run_verify(verify, mcp_url, timeout), self.loops[n])

        def done(_: Any) -> None:       # when the run ends on its loop, not when its waiter stops
            with contextlib.suppress(RuntimeError):          # the server's loop has closed
                here.call_soon_threadsafe(self._ended, n)
        job.add_done_callback(done)
        return await asyncio.wrap_future(job)

    def _ended(self, n: int) -> None:
        if n < len(self.busy):
            self.busy[n] -= 1

    def close(self) -> None:
        """Stop the loops; one a verifier still blocks is left to end with the process."""
        for loop, thread in zip(self.loops, self.threads):
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=1)
            if not thread.is_alive():
                loop.close()
        self.blocking.shutdown(wait=False)
        self.loops, self.busy, self.threads = [], [], []


def check_rows(rows: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise EpisodeFailed(f"{where} returned {type(rows).__name__}; verify returns a list of "
                            "{id, result, description} rows", VERIFIER_ERROR)
    return rows


# ================================================================ 6. Episode

@dataclasses.dataclass(frozen=True)
class Outcome:
    """How an episode ended: ``scored`` (its scores and reward), or ``failed`` (the environment
    failed it: a trainer masks the rollout) or ``abandoned`` (its caller ended it), with why."""

    status: str                          # "scored", "failed" or "abandoned"
    scores: dict[str, float]
    reward: float | None = None
    failure: Failure | None = None


class Turn:
    """One turn of the played agent: its prompt and tools, open until ``end`` hands its reply back."""

    def __init__(self, episode: Episode, step: Step, prompt: str, system_prompt: str | None,
                 tools: list[dict[str, Any]], route: dict[str, McpSession]):
        self.episode, self.step = episode, step
        self.prompt, self.system_prompt = prompt, system_prompt
        self.tools, self.route = tools, route
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    @property
    def id(self) -> str:
        return self.step.id

    @property
    def is_open(self) -> bool:
        return not self.ended.done() and self.episode.stopped is None

    @property
    def tool_specs(self) -> list[dict[str, Any]]:
        """The turn's tools as a model is shown them: name, description, input schema."""
        return [{"name": t["name"], "description": t.get("description") or "",
                 "input_schema": t.get("inputSchema") or {"type": "object", "properties": {}}}
                for t in self.tools]

    async def call(self, name: str, arguments: Any, timeout: float | None = None) -> ToolResult:
        """Call a tool of this turn. The model's mistakes and the tool's errors come back as results
        it can learn from; past ``timeout`` the episode ends and the result says so (TIMEOUT); an
        env that fails fails the episode (EpisodeFailed)."""
        if not self.is_open:
            raise AgentEnvError(f"turn {self.id!r} has ended; call the tools of the current turn")
        session = self.route.get(name)
        if session is None:
            offered = ", ".join(self.route) or "none"
            return ToolResult(f"there is no tool {name!r}; the tools are: {offered}", UNKNOWN_TOOL)
        if not isinstance(arguments, dict):
            return ToolResult(f"the arguments of {name} must be a JSON object, not "
                              f"{type(arguments).__name__}", BAD_ARGUMENTS)
        try:
            async with asyncio.timeout(timeout):
                return await session.call_tool(name, arguments)
        except asyncio.TimeoutError:
            result = ToolResult(missed(name, timeout or 0), TIMEOUT)
            self.episode.end(result.failure)
            return result
        except (aiohttp.ClientError, McpError) as exc:
            if stopped := self.episode.stopped:      # ended from outside, its env torn down
                raise EpisodeFailed(f"{name} was cut short: the episode was ended, since "
                                    f"{stopped.reason}", SESSION_LOST) from None
            failure = Failure(PEER_DROP, f"{name} failed because the env failed: "
                                         f"{await self.episode.env_trouble(exc)}")
            self.episode.end(failure)
            raise EpisodeFailed(failure) from None

    def end(self, response: str | None) -> None:
        """End the turn with the agent's reply; the episode goes on to its next step."""
        if not self.ended.done():
            self.ended.set_result(response or "")


class Episode:
    """One play of a task: it waits for a slot, runs the task's steps, hands each turn to the
    caller, scores, and tears everything down. Ending it at any point tears it down too.

    Steps run as AgentEnv runs them: each after the steps it depends on (by default every step
    before it), several at once where the graph allows, each by its handler in ``HANDLERS``. The
    caller drives it with ``next_turn`` → ``turn.call`` / ``turn.end`` → ... → ``result``, and
    ``end`` (or ``abandon``, which waits for the teardown) is the one way to stop it early.
    """

    def __init__(self, runtime: Runtime, task: Task, seed: dict[str, Any] | None = None):
        self.runtime, self.task = runtime, task.seeded(seed)
        self.id = uuid.uuid4().hex
        self.envs: dict[str, DeployedEnv] = {}    # by env_id as the task writes it
        self.instances: list[Instance] = []       # every env launched, ready or not
        self.agent: Step | None = None
        self.turn: Turn | None = None
        self.replies: dict[str, str] = {}         # prompt_id -> reply
        self.scores: dict[str, float] = {}
        self.errors: dict[str, str] = {}          # step id -> why it failed (tolerated steps)
        self.outcome: Outcome | None = None
        self.closed = asyncio.Event()
        self._changed = asyncio.Event()
        self._ending: Outcome | None = None        # how it was ended from outside, if it was
        self._holds_slot = False
        self._driver: asyncio.Task | None = None

    # -- the caller's side

    @property
    def phase(self) -> str:
        """Where the episode is: waiting (for a slot), deploying, playing, scoring, closed."""
        if self.closed.is_set():
            return "closed"
        if not self._holds_slot:
            return "waiting"
        if self.turn is None:
            return "deploying"
        return "playing" if self.turn.is_open else "scoring"

    @property
    def stopped(self) -> Failure | None:
        """Why the episode was ended from outside, once it was."""
        return self._ending.failure if self._ending else None

    def start(self) -> Episode:
        self._driver = asyncio.create_task(self._drive(), name=f"episode {self.id}")
        self._driver.add_done_callback(self._closed)
        self.runtime.live.add(self)
        return self

    async def next_turn(self) -> Turn | None:
        """The open turn, once the steps before it have run; None once the episode is scored.
        Raises EpisodeFailed if the environment failed it, or it was ended."""
        while True:
            if self.turn is not None and self.turn.is_open:
                return self.turn
            if self.outcome is not None:
                if self.outcome.failure is None:
                    return None
                raise EpisodeFailed(self.outcome.failure)
            await self._wait_change()

    async def result(self) -> Outcome:
        """The outcome, once the steps after the last turn (the verifiers) have run."""
        while self.outcome is None:
            if self.turn is not None and self.turn.is_open:
                raise AgentEnvError(f"turn {self.turn.id!r} isn't ended, so the episode can't be "
                                    "scored yet; end it first")
            await self._wait_change()
        return self.outcome

    def end(self, why: str | Failure) -> None:
        """Stop the episode wherever it is, unscored; its teardown follows in the background. A
        Failure says the environment failed it (``failed``); a reason, that its caller ended it
        (``abandoned``)."""
        if self.outcome is None and self._ending is None and self._driver is not None:
            if isinstance(why, Failure):
                self._ending = Outcome("failed", {}, None, why)
            else:
                self._ending = Outcome("abandoned", {}, None, Failure(SESSION_LOST, why))
            self._driver.cancel()

    async def abandon(self, reason: str) -> None:
        """End the episode (as ``end``) and wait until it is torn down."""
        self.end(reason)
        await self.closed.wait()

    async def env_trouble(self, exc: BaseException) -> str:
        """Why a call to an env failed: an env that stopped says so, with its last output."""
        for env in self.envs.values():
            if why := await env.instance.exited(settle=0.5):
                return f"env {env.spec.name!r} stopped: {why}. Its last output:\n" \
                       f"{short(await env.instance.output(), 1000)}"
        return f"{type(exc).__name__}: {exc}"

    async def _wait_change(self) -> None:
        changed = self._changed
        await changed.wait()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _settle(self, outcome: Outcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
            if outcome.status == "failed":
                log.warning("Episode %s of task %r failed: %s", self.id[:8], self.task.name,
                            outcome.failure)
            self._signal()

    def _closed(self, driver: asyncio.Task) -> None:
        # The one place an episode closes: after its driver ran its teardown, or was cancelled
        # before its first step, when there was nothing to tear down and no slot taken.
        self._settle(self._ended_outcome("the episode was cancelled"))
        self.runtime.live.discard(self)
        self.closed.set()
        self._signal()

    def _ended_outcome(self, reason: str) -> Outcome:
        ending = self._ending or Outcome("abandoned", {}, None, Failure(SESSION_LOST, reason))
        return dataclasses.replace(ending, scores=dict(self.scores))

    # -- the driver

    async def _drive(self) -> None:
        try:
            await self.runtime.pool.acquire()
            self._holds_slot = True
            await self._run_steps()
            self._settle(self._score())
        except asyncio.CancelledError:
            self._settle(self._ended_outcome("the episode was cancelled"))
        except EpisodeFailed as exc:
            self._settle(Outcome("failed", dict(self.scores), None, exc.failure))
        except Exception as exc:                        # noqa: BLE001 - a bug must not leak an env
            log.exception("Episode %s of task %r hit an unexpected error.", self.id[:8], self.task.name)
            self._settle(Outcome("failed", dict(self.scores), None, Failure(
                INTERNAL_ERROR, f"agentenv.py failed: {type(exc).__name__}: {exc}")))
        finally:
            # Teardown runs to its end even if the episode is cancelled again meanwhile.
            if self.turn is not None:
                self.turn.end(None)
            teardown = asyncio.ensure_future(asyncio.gather(
                *(i.remove() for i in self.instances), return_exceptions=True))
            while not teardown.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(teardown)
            if self._holds_slot:
                self.runtime.pool.release()

    async def _run_steps(self) -> None:
        """Run the steps as a graph: each once the steps it depends on are done."""
        status: dict[str, str] = {}
        done = {step.id: asyncio.Event() for step in self.task.steps}

        async def run(step: Step) -> None:
            for dep in step.depends_on:
                await done[dep].wait()
            try:
                if blocked := [d for d in step.depends_on if status[d] != "ok"]:
                    status[step.id] = "skipped"
                    log.info("Episode %s skips step %r: it depends on %s, which did not succeed.",
                             self.id[:8], step.id, blocked)
                    return
                try:
                    await self._run_step(step)
                    status[step.id] = "ok"
                except EpisodeFailed as exc:
                    status[step.id] = "failed"
                    if step.fail_task_on_error:
                        raise EpisodeFailed(exc.failure.told(
                            f"step {step.id!r} ({step.type}) failed: ")) from None
                    self.errors[step.id] = str(exc)
                    log.info("Episode %s: step %r (%s) failed: %s; going on (fail_task_on_error is "
                             "false).", self.id[:8], step.id, step.type, exc)
            finally:
                done[step.id].set()

        tasks = [asyncio.create_task(run(step)) for step in self.task.steps]
        try:
            await _first_error(tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_step(self, step: Step) -> None:
        try:
            await self.HANDLERS[step.type](self, step)
        except asyncio.TimeoutError:        # before OSError, of which it is a kind
            raise EpisodeFailed("a call to its env got no answer within its deadline; the env may "
                                "be stuck or overloaded (its output may say which)",
                                TRANSPORT_TIMEOUT) from None
        except (aiohttp.ClientError, McpError, OSError) as exc:
            raise EpisodeFailed(await self.env_trouble(exc), PEER_DROP) from None

    # -- the step handlers, one per step type (HANDLERS, below)

    async def _deploy_env(self, step: Step) -> None:
        env = self.runtime.bundle.envs[_resolve_env(step.get("env_id"), self.runtime.bundle.envs,
                                                    self.task.id)]
        limits = {k: step.get(k) for k in ("cpu", "memory_mb") if step.get(k)}
        async with self.runtime.starting.slot():
            instance = await self.runtime.sandbox.launch(env, self.id, limits)
            self.instances.append(instance)
            self.envs[step.get("env_id")] = await wait_ready(
                self.runtime.http, instance, env, self.runtime.deploy_timeout)

    async def _apply_server_config(self, step: Step) -> None:
        env = self.envs[step.get("env_id")]
        timeout = float(step.get("timeout_seconds", 30))
        for directive in step.get("directives"):
            service = directive.get("service", directive.get("environment", "*"))
            if service not in ("*", env.card_name):
                raise EpisodeFailed(f"a directive names service {service!r}, but env "
                                    f"{step.get('env_id')!r} serves {env.card_name!r}; use that or \"*\"")
            await env.apply(self.runtime.http, directive["uri"], directive.get("args", {}), timeout,
                            bool(step.get("tolerate_unadvertised", False)))

    async def _deploy_agent(self, step: Step) -> None:
        self.agent = step

    async def _prompt_agent(self, step: Step) -> None:
        agent = self.agent
        assert agent is not None
        role = agent.get("role")
        headers = {ROLE_HEADER: role} if role else {}
        sessions: list[McpSession] = []
        tools: list[dict[str, Any]] = []
        route: dict[str, McpSession] = {}
        try:
            for env_id in agent.get("env_ids", []):     # one MCP session per env per turn
                env = self.envs[env_id]
                session = McpSession(self.runtime.http, env.mcp_url, headers)
                sessions.append(session)
                await session.open()
                for tool in await session.list_tools():
                    if is_hidden(tool):
                        continue
                    if tool["name"] in route:
                        raise EpisodeFailed(f"the tool {tool['name']!r} is offered by two envs of "
                                            "the turn; tool names are unique within a turn")
                    route[tool["name"]] = session
                    tools.append(tool)
            turn = Turn(self, step, step.get("prompt"), step.get("system_prompt") or
                        agent.get("system_prompt"), tools, route)
            self.turn = turn
            self._signal()
            timeout = float(step.get("timeout_seconds", 600))
            try:
                reply = await asyncio.wait_for(asyncio.shield(turn.ended), timeout)
            except asyncio.TimeoutError:
                turn.end(None)       # over for the caller too, even if the task goes on
                raise EpisodeFailed(f"turn {step.id!r} was not ended within {timeout:g}s (its "
                                    "prompt_agent step's timeout_seconds)") from None
            self.replies[step.get("prompt_id") or step.id] = reply
        finally:
            await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)

    async def _env_outcome_verifier(self, step: Step) -> None:
        env = self.envs[step.get("env_id")]
        try:
            rows = await self.runtime.verify(step.get("file_artifact_id"), env.mcp_url)
        except EpisodeFailed:
            # A verifier fails when the env it reads has died: the env's fault, not the verifier's.
            if why := await env.instance.exited(settle=0.5):
                raise EpisodeFailed(f"env {env.spec.name!r} stopped: {why}. "
                                    f"Its last output:\n{short(await env.instance.output(), 1000)}",
                                    PEER_DROP) from None
            raise
        self._record(step, rows)

    async def _agent_prompt_response_verifier(self, step: Step) -> None:
        reply = self.replies.get(step.get("prompt_id"), "")
        self._record(step, response_rows(step.get("criteria"), reply))

    HANDLERS: dict[str, Callable[[Episode, Step], Any]] = {
        "deploy_env": _deploy_env,
        "apply_server_config": _apply_server_config,
        "deploy_agent": _deploy_agent,
        "prompt_agent": _prompt_agent,
        "env_outcome_verifier": _env_outcome_verifier,
        "agent_prompt_response_verifier": _agent_prompt_response_verifier,
    }

    # -- scoring

    def _record(self, step: Step, rows: list[dict[str, Any]]) -> None:
        try:
            score = aggregate_score(rows, step.get("score_aggregator", "all_pass"))
        except (TypeError, ValueError) as exc:
            raise EpisodeFailed(f"its rows can't be scored ({exc}); a row's score and weight are "
                                "numbers", VERIFIER_ERROR) from None
        if score != score:
            raise EpisodeFailed("its score is not a number (NaN); check the rows' scores",
                                VERIFIER_ERROR)
        self.scores[step.id] = score

    def _score(self) -> Outcome:
        step = self.task.reward_step
        if step not in self.scores:
            why = self.errors.get(step, "it did not run")
            return Outcome("failed", dict(self.scores), None, Failure(
                VERIFIER_ERROR, f"no reward: the run recorded no score at step {step!r} ({why})"))
        return Outcome("scored", dict(self.scores), self.scores[step])


async def _first_error(tasks: list[asyncio.Task]) -> None:
    """Wait for every task; as soon as one fails, raise its error (the caller cancels the rest).
    Of failures that land together, the earliest task's is raised, so the report is stable."""
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()


# ================================================================ 7. Pool and runtime

SERVE_KNOB = "--max-concurrent-envs (or MAX_CONCURRENT_ENVS)"
SERVE_FIX = "serve the bundle with a higher MAX_CONCURRENT_ENVS (or --max-concurrent-envs)"


class Pool:
    """The bound on live episodes: one semaphore. Past it, an episode waits its turn, and the
    first time that happens the server says so once, with how to raise the limit."""

    def __init__(self, limit: int, knob: str = SERVE_KNOB):
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise AgentEnvError(f"{knob.split(' ')[0]} must be a whole number of at least 1, not "
                                f"{limit!r}")
        self.limit, self.knob = limit, knob
        self.in_use = self.waiting = 0
        self._free = asyncio.Semaphore(limit)
        self._warned = False

    async def acquire(self) -> None:
        if self._free.locked() and not self._warned:
            self._warned = True
            log.warning(at_its_limit("The server", self.limit, "episodes",
                                     "new episodes wait their turn", f"raise {self.knob}") + ".")
        self.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1
        self.in_use += 1

    def release(self) -> None:
        self.in_use -= 1
        self._free.release()


class StartGate:
    """The bound on envs starting at once (launched, not yet answering). A booting env is all
    CPU; hundreds booting together on a few cores starve the server itself (a /health took 11 s
    with 256 at once) and boot no faster. A start that takes longer than ``hold`` seconds stops
    counting, so an env that never comes up holds back the others only that long."""

    def __init__(self, size: int = 2 * (os.cpu_count() or 2), hold: float = 10.0):
        self.size, self.hold = max(size, 2), hold
        self._free = asyncio.Semaphore(self.size)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self._free.acquire()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._free.release()
        timer = asyncio.get_running_loop().call_later(self.hold, release)
        try:
            yield
        finally:
            timer.cancel()
            release()


class Runtime:
    """What every episode of a served bundle shares: the bundle, the sandbox, the pool, one HTTP
    client, the loaded verifiers, and the set of live episodes (so shutdown can end them all)."""

    def __init__(self, bundle: Bundle, sandbox: str = "auto",
                 max_concurrent_envs: int = Settings.max_concurrent_envs,
                 deploy_timeout: float = Settings.deploy_timeout,
                 verifier_timeout: float = Settings.verifier_timeout, knob: str = SERVE_KNOB,
                 ray: RayOptions | None = None):
        self.bundle, self.sandbox_kind = bundle, sandbox
        self.ray = dataclasses.replace(ray or RayOptions(RayOptions.address_from(None)),
                                       deploy_timeout=deploy_timeout)
        self.pool = Pool(max_concurrent_envs, knob)
        self.deploy_timeout, self.verifier_timeout = deploy_timeout, verifier_timeout
        self.owner = owner_id()
        self.live: set[Episode] = set()
        self.sandbox: Sandbox = LocalSandbox(self.owner)
        self.http: aiohttp.ClientSession | None = None
        self._verifiers: dict[str, asyncio.Future] = {}
        self._verifier_loops = VerifierLoops()
        self.starting = StartGate()

    async def start(self) -> Runtime:
        """Open the sandbox (sweeping what a crashed run left, building images) and the client."""
        self.sandbox = await open_sandbox(self.sandbox_kind, self.owner, self.ray)
        if self.sandbox.gates_its_boots:      # each node gates its own boots: only the pool bounds
            self.starting = StartGate(self.pool.limit)
        # Every env is prepared now, never inside an episode: a deploy then only starts a process.
        await self.sandbox.prepare(list(self.bundle.envs.values()))
        # MCP keeps its session in a header; a cookie jar would only cost every call its upkeep.
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                          cookie_jar=aiohttp.DummyCookieJar(),
                                          timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aenter__(self) -> Runtime:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def episode(self, task: Task, seed: dict[str, Any] | None = None) -> Episode:
        """Start an episode of a task; it waits for a slot, then deploys."""
        return Episode(self, task, seed).start()

    async def first_turn_tools(self, task: Task, why: str) -> list[dict[str, Any]]:
        """Play a task as far as its first turn and list the tools that turn offers; then end it.
        A task's tools exist only once its envs are deployed: they answer tools/list, nothing else."""
        episode = self.episode(task)
        try:
            turn = await episode.next_turn()
            assert turn is not None          # a task that loads has a turn
            return turn.tool_specs
        finally:
            await episode.abandon(why)

    async def verify(self, artifact: str, mcp_url: str) -> list[dict[str, Any]]:
        """Run an artifact's ``verify(mcp_url)`` on a verifier loop, within the verifier deadline."""
        where = f"the verifier artifacts/{artifact}"
        loop = asyncio.get_running_loop()
        if artifact not in self._verifiers:     # imported once, in a thread: bundle code may be slow
            self._verifiers[artifact] = loop.run_in_executor(
                None, load_verifier, self.bundle.verifiers[artifact])
        try:
            verify = await asyncio.shield(self._verifiers[artifact])
        except Exception as exc:                        # noqa: BLE001 - bundle code may raise anything
            raise EpisodeFailed(f"{where} did not import: {type(exc).__name__}: {exc}",
                                VERIFIER_ERROR) from None
        job = self._verifier_loops.run(verify, mcp_url, self.verifier_timeout)
        try:
            # the loop's own deadline comes first; this one is for a verifier that blocks it
            rows = await asyncio.wait_for(job, self.verifier_timeout + 5)
        except asyncio.TimeoutError:
            raise EpisodeFailed(f"{where} did not finish within {self.verifier_timeout:g}s",
                                VERIFIER_ERROR) from None
        except Exception as exc:                        # noqa: BLE001 - bundle code may raise anything
            raise EpisodeFailed(f"{where} raised {type(exc).__name__}: {exc}", VERIFIER_ERROR) from None
        return check_rows(rows, where)

    async def close(self, reason: str = "the server shut down") -> None:
        """Abandon every live episode, wait for their teardown, and close the sandbox."""
        await asyncio.gather(*(e.abandon(reason) for e in list(self.live)), return_exceptions=True)
        await self.sandbox.close()
        if self.http is not None:
            await self.http.close()
        self._verifier_loops.close()


# ================================================================ 8. Plumbing

# What both wires share: the HTTP helpers and the JSON reader, the bearer token, the sessions
# table that counts both wires against the one pool, and the idle sweep.

MAX_BODY = 16 * 2**20          # a request body or WebSocket frame past this is refused (413 / close)
BINARY_FRAME = "a binary frame was sent; this socket reads JSON text frames only"


def json_reply(body: Any, status: int = 200) -> Any:
    from aiohttp import web
    return web.json_response(body, status=status)


def loads(raw: bytes | str) -> Any:
    """JSON a client sent; a ValueError saying why for anything else, nesting too deep to read
    included (json raises RecursionError for that, which must not become a 500)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("it nests arrays or objects deeper than this server reads") from None


async def read_body(request: Any) -> bytes:
    """A request's body; past MAX_BODY, a 413 that says what to do."""
    from aiohttp import web
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise web.HTTPRequestEntityTooLarge(
            max_size=MAX_BODY, actual_size=request.content_length or MAX_BODY + 1,
            text=json.dumps({"detail": f"the body is larger than this server reads "
                                       f"({MAX_BODY // 2**20} MiB); send less, such as a tool's "
                                       "arguments without the data it can read itself"}),
            content_type="application/json") from None


async def json_body(request: Any, allow_empty: bool = False) -> tuple[dict[str, Any], Any]:
    """A request's JSON object body, or the 422 that says what is wrong with it."""
    raw = await read_body(request)
    if not raw.strip() and allow_empty:
        return {}, None
    try:
        data = loads(raw)
    except ValueError as exc:
        return {}, json_reply({"detail": [{"type": "json_invalid", "loc": ["body"],
                                           "msg": f"the body is not JSON: {exc}"}]}, 422)
    if not isinstance(data, dict):
        return {}, json_reply({"detail": [{"type": "model_attributes_type", "loc": ["body"],
                                           "msg": "the body must be a JSON object"}]}, 422)
    return data, None


async def accept_socket(request: Any) -> Any:
    from aiohttp import web
    # Pings every 20 s find a socket whose far end has gone without closing it.
    socket_ = web.WebSocketResponse(heartbeat=20, max_msg_size=MAX_BODY)
    await socket_.prepare(request)
    return socket_


def bearer_token(token: str) -> Any:
    """Middleware that asks every request, WebSocket upgrades included, for the bearer token."""
    from aiohttp import web
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def require_token(request: Any, handler: Callable) -> Any:
        # compare_digest: the time taken says nothing about how much of a guess was right
        if not secrets.compare_digest(request.headers.get("Authorization", "").encode(), expected):
            return web.json_response(
                {"detail": "this server asks for a bearer token: send the header Authorization: "
                           "Bearer <token>, with the token serve was given (--token or "
                           "AGENTENV_TOKEN)"},
                status=401, headers={"WWW-Authenticate": 'Bearer realm="agentenv.py"'})
        return await handler(request)
    return require_token


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False                    # a name or "" (every interface): assume it reaches out


def client_headers() -> dict[str, str]:
    """The headers a client of a running ``serve`` sends: its bearer token, if AGENTENV_TOKEN
    holds one."""
    token = os.environ.get("AGENTENV_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


class Lease:
    """What a served session shares with every other: a lock its requests take in turn, how many
    are under way, and when the last one ended, so an idle sweep never ends a busy session."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.busy = 0
        self.last_used = time.monotonic()

    @contextlib.asynccontextmanager
    async def using(self) -> Any:
        self.busy += 1
        try:
            async with self.lock:
                yield self
        finally:
            self.busy -= 1
            self.last_used = time.monotonic()


async def sweep_idle(what: str, knob: str, sessions: dict[str, Any], idle_timeout: float,
                     end: Callable[[Any, str], Any]) -> None:
    """End sessions with no request for ``idle_timeout``: one timer for all, never a busy one."""
    period = max(0.05, min(idle_timeout / 4, 30.0))
    while True:
        await asyncio.sleep(period)          # a timer: an idle session sends no event
        now = time.monotonic()
        for session in list(sessions.values()):
            if not session.lease.busy and now - session.lease.last_used > idle_timeout:
                log.info("Ended %s session with no request for %gs (%s), freeing its episode.",
                         what, idle_timeout, knob)
                try:
                    await end(session, f"the session was idle past {idle_timeout:g}s")
                except Exception:                    # noqa: BLE001 - one failure must not stop reaping
                    log.exception("Ending %s session that was idle failed.", what)


class Sessions:
    """The live sessions of both wires, by wire, counted against the one pool: each surface is
    handed this table, so what one opens the other sees."""

    def __init__(self, limit: int):
        self.limit = limit
        self.openenv: dict[str, OpenEnvSession] = {}
        self.gym: dict[str, GymSession] = {}

    @property
    def active(self) -> int:
        return len(self.openenv) + len(self.gym)


# ================================================================ 9. OpenEnv surface

END_TURN = {"name": "end_turn",
            "description": "End your turn with your reply. The episode goes on to your next turn, "
                           "or ends and is scored.",
            "input_schema": {"type": "object", "properties": {
                "response": {"type": "string", "description": "Your reply."}}}}
RESERVED_TOOLS = {"reset", "step", "state", "close", "end_turn"}
ENDED = "the episode has ended; call reset"
SPLIT_TYPES = {"train", "validation", "test"}


def envelope(observation: dict[str, Any], reward: float | None = None, done: bool = False,
             ) -> dict[str, Any]:
    """An OpenEnv observation as the wire carries it: reward and done at the top, metadata twice."""
    body: dict[str, Any] = {"observation": observation, "reward": reward, "done": done}
    if observation.get("metadata"):
        body["metadata"] = observation["metadata"]
    return body


def rpc_error(rid: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": rid, "error": error}


class Capacity(AgentEnvError):
    """Every session slot is taken: a temporary refusal, with how to raise the limit."""

    def __init__(self, active: int, limit: int):
        self.active, self.limit = active, limit
        super().__init__(f"Server at capacity: {active}/{limit} sessions active. Cannot accept new "
                         "connections. This is temporary: retry when a session closes, or serve "
                         "with a higher --max-concurrent-envs (MAX_CONCURRENT_ENVS).")

    @property
    def data(self) -> dict[str, Any]:
        return {"active_sessions": self.active, "max_sessions": self.limit, "retry_after_s": 1}


class OpenEnvSession:
    """One OpenEnv session: one episode at a time, reset by split and index.

    It maps a bundle onto OpenEnv as AgentEnv does: ``reset`` plays a task, ``list_tools`` and
    ``call_tool`` play its turn, and the added ``end_turn`` tool hands over the next prompt or,
    after the last turn, the reward and the scores. Every reply comes within ``deadline`` seconds,
    inside the clients' own timeout. The play gives values (a ToolResult, the next Turn, the
    Outcome, a Failure, or a refusal's text); ``step`` renders them as observations and ``mcp``
    as JSON-RPC, and a failure is always a reply, never a crash.
    """

    def __init__(self, runtime: Runtime, deadline: float, sid: str | None = None):
        self.runtime, self.deadline = runtime, deadline
        self.id = sid or uuid.uuid4().hex
        self.episode: Episode | None = None
        self.where: dict[str, Any] | None = None
        self.episode_id: str | None = None         # the id the caller gave at reset, if any
        self.step_count = 0
        self.lease = Lease()
        self.attached = False                      # a /ws?session_id= socket is on it
        self.socket: Any = None                    # the WebSocket it is played over, if any
        self.close_asked = False

    @property
    def live(self) -> bool:
        """Whether a turn is there to play: an episode not yet over, past its deploy."""
        episode = self.episode
        return episode is not None and episode.outcome is None and episode.turn is not None

    # -- the wire

    async def reset(self, data: dict[str, Any]) -> dict[str, Any]:
        return self._observation(await self._reset(data))

    async def step(self, action: Any) -> dict[str, Any]:
        if not isinstance(action, dict):      # a malformed step leaves a live episode as it was
            return self._error('a step\'s data is an action such as {"type": "list_tools"}',
                               done=not self.live)
        if not self.live:
            return self._error(ENDED)
        self.step_count += 1
        kind = action.get("type")
        if kind == "list_tools":
            return envelope({"tools": self._tools(), "metadata": {}}, 0.0)
        if kind != "call_tool":
            return self._error(f"unknown action type {kind!r}; use list_tools or call_tool",
                               done=False)
        name = action.get("tool_name")
        return self._observation(await self._call(name, action.get("arguments") or {}), name)

    async def mcp(self, method: str, params: dict[str, Any], rid: Any) -> dict[str, Any]:
        """tools/list and tools/call on this session's episode, as JSON-RPC."""
        if method == "tools/list":
            tools = [{"name": t["name"], "description": t["description"],
                      "inputSchema": t["input_schema"]} for t in self._tools()] if self.live else []
            return {"jsonrpc": "2.0", "id": rid, "result": {"tools": tools}}
        name = params.get("name")
        if not isinstance(name, str) or not name:
            return rpc_error(rid, -32602, "tools/call needs params.name, the tool to call")
        if not self.live:
            return rpc_error(rid, -32603, ENDED)
        self.step_count += 1
        return self._rpc(rid, await self._call(name, params.get("arguments") or {}))

    def state(self) -> dict[str, Any]:
        episode, where = self.episode, self.where or {}
        return {"episode_id": self.episode_id or (episode.id if episode else None),
                "step_count": self.step_count, "task_id": where.get("id"),
                "task_name": where.get("name"), "split": where.get("split"),
                "index": where.get("index"),
                "turn": episode.turn.id if episode and episode.turn else None,
                "done": episode is None or episode.outcome is not None}

    async def close(self, reason: str = "the session closed") -> None:
        if self.episode is not None:
            episode, self.episode = self.episode, None
            await episode.abandon(reason)

    # -- the play, as values

    async def _reset(self, data: dict[str, Any]) -> Played:
        await self.close("reset")
        split, index = data.get("split"), data.get("index")
        self.step_count, self.where = 0, None
        self.episode_id = data.get("episode_id") if isinstance(data.get("episode_id"), str) else None
        if (split is None) != (index is None):
            return ("split and index go together: give both, or neither for the first task "
                    "served")
        try:
            if split is None:
                split, index = "all", 0
            task = self.runtime.bundle.task(split, index)
        except LookupError as exc:
            return str(exc)
        self.where = {"id": task.id, "name": task.name, "split": split, "index": index}
        self.episode = self.runtime.episode(task)
        return await self._advance("the deploy and the opening of the turn")

    async def _call(self, name: Any, arguments: Any) -> Played:
        assert self.episode is not None and self.episode.turn is not None
        turn = self.episode.turn
        if name == "end_turn":
            response = arguments.get("response", "") if isinstance(arguments, dict) else ""
            turn.end(response if isinstance(response, str) else json.dumps(response))
            return await self._advance("the next turn or the score")
        try:
            return await turn.call(name, arguments, self.deadline)
        except EpisodeFailed as exc:
            return exc.failure
        except AgentEnvError as exc:
            return str(exc)

    async def _advance(self, what: str) -> Played:
        """Wait (within the deadline) for the next turn or the outcome."""
        episode = self.episode
        assert episode is not None
        try:
            async with asyncio.timeout(self.deadline):
                turn = await episode.next_turn()
                if turn is None:
                    return await episode.result()
        except EpisodeFailed as exc:
            return exc.failure
        except asyncio.TimeoutError:
            failure = Failure(TRANSPORT_TIMEOUT, (
                f"{what} took longer than {self.deadline:g}s, so the episode was ended to answer "
                "inside the client's timeout; raise the client's message_timeout_s and serve with a "
                "higher --client-timeout"))
            episode.end(failure)       # teardown goes on in the background, holding the slot
            return failure
        if reserved := sorted(RESERVED_TOOLS & set(turn.route)):
            await episode.abandon("the env offers reserved tool names")
            return f"the env offers tools OpenEnv reserves: {', '.join(reserved)}; rename them in the env"
        return turn

    def _tools(self) -> list[dict[str, Any]]:
        assert self.episode is not None and self.episode.turn is not None
        return [*self.episode.turn.tool_specs, END_TURN]

    # -- rendering

    def _observation(self, played: Played, tool_name: str | None = None) -> dict[str, Any]:
        """What the play gave, as an OpenEnv observation: a reset's or a step's."""
        called = {"tool_name": tool_name, "error": None} if tool_name else {}
        if isinstance(played, ToolResult):
            if played.status == UNKNOWN_TOOL:
                return envelope({**called, "result": None, "metadata": {}, "error": {
                    "error_type": "tool_not_found", "message": played.text}}, 0.0)
            if played.failure:
                timed_out = self._error(played.failure, tool_name)
                timed_out["observation"]["error"] = {"error_type": "timeout", "message": played.text}
                return timed_out
            return envelope({**called, "metadata": {}, "result": tool_content(played)}, 0.0)
        if isinstance(played, Turn):
            prompt = {"prompt": played.prompt, "system_prompt": played.system_prompt}
            if tool_name:
                return envelope({**called, "result": prompt, "metadata": {}}, 0.0)
            return envelope({"metadata": {**prompt, "task": self.where}})
        if isinstance(played, Outcome) and played.failure is None:
            # The score in the result too: a client that reads only call_tool's result sees it.
            result = {"done": True, "reward": played.reward, "scores": played.scores} \
                if tool_name else None
            return envelope({**called, "result": result,
                             "metadata": {"scores": played.scores, "task": self.where}},
                            played.reward, True)
        return self._error(played.failure if isinstance(played, Outcome) else played, tool_name)

    def _rpc(self, rid: Any, played: Played) -> dict[str, Any]:
        """What the play gave, as the JSON-RPC reply to tools/call."""
        if isinstance(played, ToolResult):
            if played.status == UNKNOWN_TOOL or played.failure:
                error = {"error_type": "tool_not_found" if played.status == UNKNOWN_TOOL else "timeout",
                         "message": played.text}
                return rpc_error(rid, -32603, played.text, error)
            return {"jsonrpc": "2.0", "id": rid, "result": tool_content(played)}
        if isinstance(played, Turn):
            data = {"prompt": played.prompt, "system_prompt": played.system_prompt}
            return {"jsonrpc": "2.0", "id": rid, "result": {"data": data}}
        if isinstance(played, Outcome) and played.failure is None:
            data = {"done": True, "reward": played.reward, "scores": played.scores}
            return {"jsonrpc": "2.0", "id": rid, "result": {"data": data}}
        return rpc_error(rid, -32603, str(played.failure if isinstance(played, Outcome) else played))

    def _error(self, why: str | Failure | None, tool_name: str | None = None,
               done: bool = True) -> dict[str, Any]:
        """An error observation: the episode's failure (with its kind, for a resources server
        playing over /ws), or a refusal of what was asked."""
        observation: dict[str, Any] = {"metadata": {"status": "error", "error": str(why),
                                                    "task": self.where}}
        if isinstance(why, Failure):
            observation["metadata"]["failure_kind"] = why.kind
        if tool_name:
            observation.update(tool_name=tool_name, result=None, error=None)
        return envelope(observation, None, done)


# What a play of an OpenEnv session gives: a tool's result, the next turn, the scored outcome, the
# environment's failure, or a refusal of what was asked (a caller's mistake, in words).
Played = ToolResult | Turn | Outcome | Failure | str


def tool_content(result: ToolResult) -> dict[str, Any]:
    """A tool's result as OpenEnv's CallToolObservation carries it."""
    return {"content": [{"type": "text", "text": result.text}], "structured_content": None,
            "meta": None, "data": result.text, "is_error": result.is_error}


class OpenEnvSurface:
    """OpenEnv's routes: /ws, /mcp, the stateless HTTP routes, schema and task API.

    Its sessions count with the other wire's in the shared table, capped at the pool's limit: past
    it a new one is refused, as OpenEnv's clients expect, and the server says once how to raise
    it. WebSocket pings find half-open sockets, and one sweep ends sessions idle past
    ``idle_timeout``, so capacity never silts up with sessions whose client has gone.
    """

    def __init__(self, runtime: Runtime, sessions: Sessions, settings: Settings):
        self.runtime, self.shared, self.idle_timeout = runtime, sessions, settings.idle_timeout
        self.deadline = max(1.0, settings.client_timeout - settings.reply_margin)
        self.sessions = sessions.openenv
        self.env_name = runtime.bundle.name.replace(".", "-")
        self._warned = False
        self._sweeper: asyncio.Task | None = None

    # -- sessions

    def open_session(self) -> OpenEnvSession:
        limit, active = self.shared.limit, self.shared.active
        if active >= limit:
            if not self._warned:
                self._warned = True
                log.warning(at_its_limit("The server", limit, "sessions",
                                         "new sessions are refused until one closes", SERVE_FIX) + ".")
            raise Capacity(active, limit)
        session = OpenEnvSession(self.runtime, self.deadline)
        self.sessions[session.id] = session
        return session

    async def end_session(self, session: OpenEnvSession, reason: str) -> None:
        """End a session: its episode, and the socket it is played over (a reaped or shut-down
        session must not go on playing outside the limit)."""
        self.sessions.pop(session.id, None)
        socket_, session.socket = session.socket, None
        await session.close(reason)
        if socket_ is not None and not socket_.closed:
            await socket_.close(code=aiohttp.WSCloseCode.GOING_AWAY,
                                message=reason.encode()[:120])

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(
            sweep_idle("an OpenEnv", "--idle-timeout", self.sessions, self.idle_timeout,
                       self.end_session))

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        await asyncio.gather(*(self.end_session(s, "the server shut down")
                               for s in list(self.sessions.values())), return_exceptions=True)

    # -- HTTP routes

    async def health(self, request: Any) -> Any:
        return json_reply({"status": "healthy"})

    async def metadata(self, request: Any) -> Any:
        bundle = self.runtime.bundle
        readme = bundle.root / "README.md"
        return json_reply({"name": self.env_name, "description": bundle.description or bundle.name,
                           "readme_content": readme.read_text() if readme.is_file() else None,
                           "version": __version__, "author": None, "documentation_url": None})

    async def schema(self, request: Any) -> Any:
        return json_reply(OPENENV_SCHEMA)

    async def openapi(self, request: Any) -> Any:
        return json_reply(openapi_document())

    async def http_reset(self, request: Any) -> Any:
        """Stateless, as OpenEnv has it: a fresh session, reset (a full deploy), then closed."""
        data, problem = await json_body(request, allow_empty=True)
        if problem:
            return problem
        session = OpenEnvSession(self.runtime, self.deadline)
        try:
            return json_reply(await session.reset(data or {}))
        finally:
            await session.close("a stateless /reset ends its episode")

    async def http_step(self, request: Any) -> Any:
        data, problem = await json_body(request)
        if problem:
            return problem
        if "action" not in data:
            return json_reply({"detail": [{"type": "missing", "loc": ["body", "action"],
                                           "msg": "Field required: the action to take"}]}, 422)
        if not isinstance(data["action"], dict):
            return json_reply({"detail": [{"type": "model_attributes_type", "loc": ["body", "action"],
                                           "msg": 'the action is an object, such as {"type": '
                                                  '"list_tools"}'}]}, 422)
        return json_reply(await OpenEnvSession(self.runtime, self.deadline).step(data["action"]))

    async def http_state(self, request: Any) -> Any:
        return json_reply(OpenEnvSession(self.runtime, self.deadline).state())

    # -- the task API

    async def list_environments(self, request: Any) -> Any:
        return json_reply([self.env_name])

    def _not_ours(self, request: Any) -> Any:
        """The 404 for a task-API path naming another environment, or None when it names ours."""
        if request.match_info["env"] == self.env_name:
            return None
        return json_reply({"detail": f"no environment {request.match_info['env']!r}; this server "
                                     f"serves {self.env_name!r}"}, 404)

    async def splits(self, request: Any) -> Any:
        if wrong := self._not_ours(request):
            return wrong
        return json_reply([{"name": s, "type": s if s in SPLIT_TYPES else "validation"}
                           for s in self.runtime.bundle.splits])

    async def task_api(self, request: Any) -> Any:
        if wrong := self._not_ours(request):
            return wrong
        data, problem = await json_body(request)
        if problem:
            return problem
        route = request.path.rsplit("/", 1)[1]
        bundle, split = self.runtime.bundle, data.get("split")
        if not isinstance(split, str) or split not in bundle.splits:
            return json_reply({"detail": f"Invalid task index: there is no split {split!r}; the "
                                         f"splits are {', '.join(bundle.splits)}"}, 400)
        tasks = bundle.splits[split]
        if route == "num_tasks":
            return json_reply({"num_tasks": len(tasks)})
        if route == "tasks":
            return json_reply({"tasks": [task_row(t, i) for i, t in enumerate(tasks)],
                               "env_name": self.env_name})
        if route == "task":
            try:
                return json_reply({"task": task_row(bundle.task(split, data.get("index")),
                                                    data.get("index"))})
            except LookupError as exc:
                return json_reply({"detail": f"Invalid task index: {exc}"}, 400)
        start, stop = data.get("start"), data.get("stop")
        start = 0 if start is None else start
        if not isinstance(start, int) or isinstance(start, bool) or start < 0 or \
                (stop is not None and (not isinstance(stop, int) or isinstance(stop, bool))):
            return json_reply({"detail": "start is a whole number from 0, and stop a whole number or "
                                         "null"}, 400)
        return json_reply({"tasks": [task_row(t, start + i) for i, t in enumerate(tasks[start:stop])]})

    # -- JSON-RPC on POST /mcp and WebSocket /mcp

    async def mcp_http(self, request: Any) -> Any:
        try:
            message = loads(await read_body(request))
        except ValueError as exc:
            return json_reply(rpc_error(None, -32700, f"Parse error: {exc}"))
        return json_reply(await self.rpc(message, None))

    async def rpc(self, message: Any, owned: OpenEnvSession | None, held: bool = False,
                  ) -> dict[str, Any]:
        """Answer one JSON-RPC request; ``owned`` is the session of the socket it came on, whose
        lock the caller already ``held`` when it came inside a /ws message."""
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0" or \
                not isinstance(message.get("method"), str):
            rid = message.get("id") if isinstance(message, dict) else None
            return rpc_error(rid, -32600, "Invalid Request: send {\"jsonrpc\": \"2.0\", \"method\": "
                                          "..., \"params\": {...}, \"id\": ...}")
        rid, method, params = message.get("id"), message["method"], message.get("params") or {}
        if not isinstance(params, dict):
            return rpc_error(rid, -32602, "params must be an object")
        if method == "openenv/session/create":
            try:
                return {"jsonrpc": "2.0", "id": rid, "result": {"session_id": self.open_session().id}}
            except Capacity as exc:
                return rpc_error(rid, -32000, str(exc), exc.data)
        if method == "openenv/session/close":
            session = self.sessions.get(str(params.get("session_id")))
            if session is None:
                return rpc_error(rid, -32602, f"no session {params.get('session_id')!r}")
            if session.attached:
                session.close_asked = True
                return {"jsonrpc": "2.0", "id": rid,
                        "result": {"session_id": session.id, "closed": False, "closing": True}}
            await self.end_session(session, "openenv/session/close")
            return {"jsonrpc": "2.0", "id": rid, "result": {"session_id": session.id, "closed": True}}
        if method not in ("tools/list", "tools/call"):
            return rpc_error(rid, -32601, f"Method not found: {method}; this server answers "
                                          "tools/list, tools/call, openenv/session/create and "
                                          "openenv/session/close")
        session = owned
        if params.get("session_id") is not None:
            session = self.sessions.get(str(params["session_id"]))
            if session is None:
                return rpc_error(rid, -32602, f"no session {params['session_id']!r}; create one "
                                              "with openenv/session/create")
        if session is None:       # no session: a throwaway env, which has no episode
            session = OpenEnvSession(self.runtime, self.deadline)
        if held and session is owned:
            return await session.mcp(method, params, rid)
        async with session.lease.using():
            return await session.mcp(method, params, rid)

    async def mcp_ws(self, request: Any) -> Any:
        socket_ = await accept_socket(request)
        try:
            session = self.open_session()
        except Capacity as exc:
            await socket_.send_json(rpc_error(None, -32000, str(exc), exc.data))
            await socket_.close()
            return socket_
        session.socket = socket_
        try:
            async for message in socket_:
                if message.type == aiohttp.WSMsgType.BINARY:
                    await socket_.send_json(rpc_error(None, -32700, BINARY_FRAME))
                elif message.type == aiohttp.WSMsgType.TEXT:
                    try:
                        request_ = loads(message.data)
                    except ValueError as exc:
                        await socket_.send_json(rpc_error(None, -32700, f"Parse error: {exc}"))
                        continue
                    answer = await self.rpc(request_, session)
                    try:
                        await socket_.send_json(answer)
                    except ConnectionError:     # the client left while its call ran
                        break
        finally:
            await self.end_session(session, "the session closed")
        return socket_

    # -- the WebSocket session /ws

    async def ws(self, request: Any) -> Any:
        socket_ = await accept_socket(request)
        attach = request.query.get("session_id")
        owns = attach is None
        if attach is not None:
            session = self.sessions.get(attach)
            if session is None or session.attached:
                why = "is already attached to a socket" if session else "does not exist"
                await socket_.send_json({"type": "error", "data": {
                    "message": f"session {attach!r} {why}; create one with openenv/session/create",
                    "code": "SESSION_ERROR"}})
                await socket_.close()
                return socket_
            session.attached = True
        else:
            try:
                session = self.open_session()
            except Capacity as exc:
                await socket_.send_json({"type": "error", "data": {
                    "message": str(exc), "code": "CAPACITY_REACHED", **exc.data}})
                await socket_.close()
                return socket_
        session.socket = socket_
        try:
            async for message in socket_:
                if message.type == aiohttp.WSMsgType.BINARY:
                    await socket_.send_json({"type": "error", "data": {"message": BINARY_FRAME,
                                                                       "code": "INVALID_JSON"}})
                    continue
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                async with session.lease.using():
                    reply = await self._answer(session, message.data)
                if reply is None:
                    break
                try:
                    await socket_.send_json(reply)
                except ConnectionError:         # the client left while its step ran
                    log.info("An OpenEnv client left before its reply; ending its session.")
                    break
        finally:
            session.attached = False
            if session.socket is socket_:
                session.socket = None
            if owns or session.close_asked:
                await self.end_session(session, "the session closed")
        return socket_

    async def _answer(self, session: OpenEnvSession, text: str) -> dict[str, Any] | None:
        try:
            message = loads(text)
        except ValueError as exc:
            return {"type": "error", "data": {"message": f"Invalid JSON: {exc}", "code": "INVALID_JSON"}}
        if not isinstance(message, dict):
            return {"type": "error", "data": {"message": "Invalid message: send a JSON object with "
                                                         "a type", "code": "VALIDATION_ERROR"}}
        kind, data = message.get("type"), message.get("data")
        try:
            if kind == "reset":
                if data is not None and not isinstance(data, dict):
                    raise TypeError("reset's data is an object of keyword arguments")
                return {"type": "observation", "data": await session.reset(data or {})}
            if kind == "step":
                return {"type": "observation", "data": await session.step(data)}
            if kind == "state":
                return {"type": "state", "data": session.state()}
            if kind == "mcp":
                return {"type": "mcp", "data": await self.rpc(data, session, held=True)}
            if kind == "close":
                return None
        except TypeError as exc:
            return {"type": "error", "data": {"message": f"Invalid message: {exc}",
                                              "code": "VALIDATION_ERROR"}}
        return {"type": "error", "data": {"message": f"Unknown message type: {kind}",
                                          "code": "UNKNOWN_TYPE"}}

    ROUTES = [("GET", "/health", health), ("GET", "/metadata", metadata), ("GET", "/schema", schema),
              ("GET", "/openapi.json", openapi), ("GET", "/ws", ws), ("GET", "/mcp", mcp_ws),
              ("POST", "/mcp", mcp_http), ("POST", "/reset", http_reset), ("POST", "/step", http_step),
              ("GET", "/state", http_state), ("GET", "/list_environments", list_environments),
              ("GET", "/{env}/splits", splits), ("POST", "/{env}/tasks", task_api),
              ("POST", "/{env}/num_tasks", task_api), ("POST", "/{env}/task", task_api),
              ("POST", "/{env}/task_range", task_api)]


def task_row(task: Task, index: int) -> dict[str, Any]:
    """A task as OpenEnv's task API describes it."""
    prompt, system_prompt = task.first_prompt
    return {"id": task.id, "name": task.name, "index": index, "prompt": prompt,
            "system_prompt": system_prompt, "agent": task.agent, "toolset": task.toolset.name}


_OPEN_OBJECT = {"type": "object", "additionalProperties": True}
OPENENV_SCHEMA = {
    "action": {"title": "CallToolAction", "type": "object", "additionalProperties": True,
               "properties": {"type": {"type": "string", "enum": ["list_tools", "call_tool"]},
                              "tool_name": {"type": "string"},
                              "arguments": {"type": "object"}, "metadata": {"type": "object"}},
               "required": ["type"]},
    "observation": {"title": "CallToolObservation", "type": "object", "additionalProperties": True,
                    "properties": {"done": {"type": "boolean"},
                                   "reward": {"type": ["number", "null"]},
                                   "metadata": _OPEN_OBJECT, "tool_name": {"type": ["string", "null"]},
                                   "result": {}, "error": {"type": ["object", "null"]},
                                   "tools": {"type": "array", "items": _OPEN_OBJECT}}},
    "reset_observation": {"title": "Observation", "type": "object", "additionalProperties": True,
                          "properties": {"done": {"type": "boolean"},
                                         "reward": {"type": ["number", "null"]},
                                         "metadata": _OPEN_OBJECT}},
    "state": {"title": "State", "type": "object", "additionalProperties": True,
              "properties": {"episode_id": {"type": ["string", "null"]},
                             "step_count": {"type": "integer"}}},
}


def openapi_document() -> dict[str, Any]:
    """An OpenAPI document of the routes this server answers."""
    def op(summary: str, body: bool = False) -> dict[str, Any]:
        spec: dict[str, Any] = {"summary": summary, "responses": {"200": {
            "description": "OK", "content": {"application/json": {"schema": {}}}}}}
        if body:
            spec["requestBody"] = {"content": {"application/json": {"schema": {"type": "object"}}}}
        return spec
    paths = {
        "/health": {"get": op("Whether the server is up")},
        "/metadata": {"get": op("The bundle served: name, description, README")},
        "/schema": {"get": op("JSON schemas of the action, observation and state")},
        "/reset": {"post": op("Stateless: play a task's first turn in a fresh episode, then end it", True)},
        "/step": {"post": op("Stateless: always answers that the episode has ended", True)},
        "/state": {"get": op("Stateless: a fresh session's state")},
        "/mcp": {"post": op("JSON-RPC: tools/list, tools/call, openenv/session/create and close", True),
                 "get": op("WebSocket JSON-RPC, one session per connection")},
        "/ws": {"get": op("WebSocket OpenEnv session: reset, step, state, mcp, close")},
        "/list_environments": {"get": op("The environment served")},
        "/{env}/splits": {"get": op("The splits: all, and one per eval")},
        "/{env}/tasks": {"post": op("The tasks of a split", True)},
        "/{env}/num_tasks": {"post": op("How many tasks a split has", True)},
        "/{env}/task": {"post": op("One task of a split", True)},
        "/{env}/task_range": {"post": op("A range of a split's tasks", True)},
    }
    return {"openapi": "3.1.0", "info": {"title": "agentenv.py", "version": "1.0.0",
                                         "description": f"agentenv.py {__version__}"},
            "paths": paths}


# ================================================================ 10. Gym surface

gym_log = logging.getLogger("agentenv.gym")
GYM_COOKIE = "agentenv_session"


class OpenEnvClient:
    """One OpenEnv session on a running ``serve``, over its /ws, as a client plays it: the Gym
    resources server in ``url:`` mode, and ``write-gym`` listing a running server's tools. The
    replies come back as this file's values: a prompt, a ToolResult, an Outcome, or EpisodeFailed
    carrying the server's Failure. At the server's capacity ``reset`` waits, and says so once."""

    def __init__(self, http: aiohttp.ClientSession, url: str, deadline: float,
                 warned: set[str] | None = None):
        self.http, self.url, self.deadline = http, url, deadline
        self.warned = warned if warned is not None else set()   # servers said to be at their limit
        self.socket: aiohttp.ClientWebSocketResponse | None = None

    async def reset(self, split: str, index: int) -> str:
        """Start the task at ``split[index]``; its first prompt, once its first turn is open."""
        delay = 0.1
        while True:
            try:
                self.socket = await self.http.ws_connect(self.url.rstrip("/") + "/ws", heartbeat=20,
                                                         max_msg_size=MAX_BODY)
            except (aiohttp.ClientError, OSError) as exc:
                raise EpisodeFailed(f"the server at {self.url} did not answer ({exc}); start it with "
                                    "python agentenv.py serve BUNDLE", SESSION_LOST) from None
            reply = await self._ask({"type": "reset", "data": {"split": split, "index": index}})
            data = reply.get("data") or {}
            if reply.get("type") != "error" or data.get("code") != "CAPACITY_REACHED":
                break
            await self.socket.close()
            if self.url not in self.warned:
                self.warned.add(self.url)
                gym_log.warning(at_its_limit(f"the server at {self.url}", data.get("max_sessions"),
                                             "sessions", "rollouts wait their turn", SERVE_FIX))
            await asyncio.sleep(delay)        # no event tells a client that a slot has freed
            delay = min(delay * 2, 2.0)
        if reply.get("type") == "error":
            raise EpisodeFailed(f"the server at {self.url} refused the session: {data.get('message')}")
        self._raise_failure(data)
        return str(((data.get("observation") or {}).get("metadata") or {}).get("prompt", ""))

    async def list_tools(self) -> list[dict[str, Any]]:
        """The open turn's tools (without end_turn), as the model is shown them."""
        data = (await self._ask({"type": "step", "data": {"type": "list_tools"}})).get("data") or {}
        self._raise_failure(data)
        tools = (data.get("observation") or {}).get("tools") or []
        return [t for t in tools if isinstance(t, dict) and t.get("name") != "end_turn"]

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        data = (await self._ask({"type": "step", "data": {
            "type": "call_tool", "tool_name": name, "arguments": arguments}})).get("data") or {}
        observation = data.get("observation") or {}
        error = observation.get("error") or {}
        if error.get("error_type") == "timeout":
            return ToolResult(str(error.get("message", missed(name, self.deadline))), TIMEOUT)
        if error:
            return ToolResult(str(error.get("message")), UNKNOWN_TOOL
                              if error.get("error_type") == "tool_not_found" else TOOL_ERROR)
        self._raise_failure(data)
        if data.get("done"):
            raise EpisodeFailed("the episode ended on the server")
        result = observation.get("result") or {}
        return ToolResult(str(result.get("data", "")), TOOL_ERROR if result.get("is_error") else OK)

    async def end_turn(self, reply: str) -> str | Outcome:
        """End the turn: the next turn's prompt, or the scored outcome."""
        data = (await self._ask({"type": "step", "data": {
            "type": "call_tool", "tool_name": "end_turn", "arguments": {"response": reply}}})
                ).get("data") or {}
        self._raise_failure(data)
        observation = data.get("observation") or {}
        if data.get("done"):
            return Outcome("scored", (observation.get("metadata") or {}).get("scores") or {},
                           data.get("reward"))
        return str((observation.get("result") or {}).get("prompt", ""))

    async def close(self) -> None:
        if self.socket is not None and not self.socket.closed:
            with contextlib.suppress(Exception):
                await self.socket.send_json({"type": "close"})
            await self.socket.close()

    async def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.socket is not None
        try:
            await self.socket.send_json(message)
            frame = await self.socket.receive(timeout=self.deadline + 30)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise EpisodeFailed(f"the server at {self.url} went away ({type(exc).__name__}: {exc}); "
                                "check that it still runs", SESSION_LOST) from None
        if frame.type != aiohttp.WSMsgType.TEXT:
            raise EpisodeFailed(f"the server at {self.url} closed the session; check that it still "
                                "runs", SESSION_LOST)
        reply = json.loads(frame.data)
        return reply if isinstance(reply, dict) else {}

    @staticmethod
    def _raise_failure(data: dict[str, Any]) -> None:
        """An error observation, read back into the server's Failure (its kind on the wire)."""
        meta = (data.get("observation") or {}).get("metadata") or {}
        if meta.get("status") == "error":
            raise EpisodeFailed(str(meta.get("error")), meta.get("failure_kind") or ENV_FAILED)


class Rollout(abc.ABC):
    """What a Gym session plays: an episode here, or one on another server (``url:``)."""

    @abc.abstractmethod
    async def open(self) -> tuple[str, list[str]]:
        """Wait for the first turn: its prompt, and the names of the tools it offers."""

    @abc.abstractmethod
    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> ToolResult:
        """Call a tool of the open turn; a TIMEOUT result past ``timeout``."""

    @abc.abstractmethod
    async def end_turn(self, reply: str) -> str | None:
        """End the turn: the next turn's prompt, or None once the episode is scored."""

    @abc.abstractmethod
    async def outcome(self) -> Outcome:
        """The scored outcome, once the last turn has ended."""

    @abc.abstractmethod
    async def close(self, reason: str) -> None:
        """End the episode, scored or not, and let go of it."""


class LocalRollout(Rollout):
    """A rollout played on this server's own runtime."""

    def __init__(self, runtime: Runtime, task: Task):
        self.episode = runtime.episode(task)

    async def open(self) -> tuple[str, list[str]]:
        turn = await self.episode.next_turn()
        if turn is None:
            raise EpisodeFailed("the episode ended before its first turn")
        return turn.prompt, list(turn.route)

    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> ToolResult:
        turn = await self.episode.next_turn()
        if turn is None:
            return ToolResult("the episode has ended; there is no turn to call tools in", NO_TURN)
        return await turn.call(name, arguments, timeout)

    async def end_turn(self, reply: str) -> str | None:
        turn = await self.episode.next_turn()
        if turn is not None:
            turn.end(reply)
        turn = await self.episode.next_turn()
        return None if turn is None else turn.prompt

    async def outcome(self) -> Outcome:
        return await self.episode.result()

    async def close(self, reason: str) -> None:
        await self.episode.abandon(reason)


class RemoteRollout(Rollout):
    """A rollout played on a running ``serve`` over OpenEnv's /ws (``url:``): the resources server
    is then one of its clients."""

    def __init__(self, client: OpenEnvClient, split: str, index: int):
        self.client, self.split, self.index = client, split, index
        self.result: Outcome | None = None

    async def open(self) -> tuple[str, list[str]]:
        prompt = await self.client.reset(self.split, self.index)
        return prompt, [t["name"] for t in await self.client.list_tools()]

    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> ToolResult:
        try:
            async with asyncio.timeout(timeout):
                return await self.client.call(name, arguments)
        except asyncio.TimeoutError:
            await self.client.close()       # the server ends the episode with its socket
            return ToolResult(missed(name, timeout), TIMEOUT)

    async def end_turn(self, reply: str) -> str | None:
        answer = await self.client.end_turn(reply)
        if isinstance(answer, Outcome):
            self.result = answer
            return None
        return answer

    async def outcome(self) -> Outcome:
        if self.result is None:
            raise EpisodeFailed("the episode was not scored")
        return self.result

    async def close(self, reason: str) -> None:
        await self.client.close()


class Rollouts(abc.ABC):
    """Where the Gym surface plays its rollouts: this server's runtime, or a running serve."""

    async def start(self) -> None:
        """Get ready to play (a url: source finds the server)."""

    async def stop(self) -> None:
        """Let go of what playing holds."""

    @abc.abstractmethod
    async def task_id(self, split: str, index: int) -> str:
        """The id of the task at ``split[index]``; LookupError, saying what exists, otherwise."""

    @abc.abstractmethod
    def rollout(self, split: str, index: int) -> Rollout:
        """Start playing the task at ``split[index]``."""


class LocalRollouts(Rollouts):
    """Rollouts played on this server's own runtime and pool."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    async def task_id(self, split: str, index: int) -> str:
        return self.runtime.bundle.task(split, index).id

    def rollout(self, split: str, index: int) -> Rollout:
        return LocalRollout(self.runtime, self.runtime.bundle.task(split, index))


class RemoteRollouts(Rollouts):
    """Rollouts played on a running ``serve`` at ``url``, each over a socket of its own."""

    def __init__(self, url: str, settings: Settings):
        self.url, self.settings = url, settings
        self.warned: set[str] = set()      # the servers already said to be at their limit
        self.http: aiohttp.ClientSession | None = None
        self.env_name = ""

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                          headers=client_headers())
        self.env_name = await environment_at(self.http, self.url)

    async def stop(self) -> None:
        if self.http:
            await self.http.close()

    async def task_id(self, split: str, index: int) -> str:
        assert self.http is not None
        async with self.http.post(f"{self.url.rstrip('/')}/{self.env_name}/task",
                                  json={"split": split, "index": index}) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise LookupError(str(body.get("detail")))
            return body["task"]["id"]

    def rollout(self, split: str, index: int) -> Rollout:
        assert self.http is not None
        client = OpenEnvClient(self.http, self.url, self.settings.reset_timeout, self.warned)
        return RemoteRollout(client, split, index)


class GymSession:
    """One Gym rollout, by cookie: the row's task as an episode, the model's tool calls, and the
    verify that scores it. The deploy starts at seed and the first tool call waits for it; a
    rollout the environment failed is answered masked, with its Failure."""

    def __init__(self, token: str, row: dict[str, Any], rollout: Rollout, settings: Settings):
        self.token, self.row, self.rollout, self.settings = token, row, rollout, settings
        self.failure: Failure | None = None
        self.tools: list[str] = []
        self.finished = False          # the episode is over (scored)
        self.resources_id: str | None = None     # the id an environment server gave the session
        self.seeded_with = ""                    # a digest of that seed, to tell a retry apart
        self.lease = Lease()
        self.opened = asyncio.create_task(self._open())

    def fail(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure

    async def _open(self) -> None:
        try:
            async with asyncio.timeout(self.settings.reset_timeout):
                _, self.tools = await self.rollout.open()
        except asyncio.TimeoutError:
            self.fail(Failure(TRANSPORT_TIMEOUT, (
                f"the episode was not deployed and at its first turn within reset_timeout "
                f"({self.settings.reset_timeout:g}s): a deploy that slow, or a wait for a free "
                "episode that long; raise reset_timeout or max_concurrent_envs in the resources "
                "server's config")))
            return
        except EpisodeFailed as exc:
            self.fail(exc.failure.told("the environment failed: "))
            return
        except Exception as exc:                        # noqa: BLE001 - e.g. a garbled url: reply
            gym_log.exception("Opening a rollout failed unexpectedly.")
            self.fail(Failure(INTERNAL_ERROR, f"agentenv.py failed: {type(exc).__name__}: {exc}"))
            return
        offered = row_tools(self.row)
        if offered is not None and set(offered) != {*self.tools, "end_turn"}:
            self.fail(Failure(TOOLS_MISMATCH, (
                f"the row offers the tools {sorted(offered)}, but its task offers "
                f"{sorted({*self.tools, 'end_turn'})}; write the rows again with write-gym")))

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """A tool call, answered with the text the model reads."""
        await asyncio.shield(self.opened)
        if self.failure:
            return (f"error: the environment of this rollout failed, so {name} did not run "
                    f"({self.failure}); the rollout will be masked")
        if self.finished:
            return "error: the episode has ended; there are no more turns to play"
        try:
            if name == "end_turn":
                reply = arguments.get("response", "")
                async with asyncio.timeout(self.settings.reset_timeout):
                    prompt = await self.rollout.end_turn(reply if isinstance(reply, str) else
                                                         json.dumps(reply))
                if prompt is None:
                    self.finished = True
                    return "Your turn is over, and so is the episode: it is being scored."
                return prompt
            result = await self.rollout.call(name, arguments, self.settings.tool_timeout)
        except asyncio.TimeoutError:
            self.fail(Failure(TRANSPORT_TIMEOUT, f"end_turn did not hand over the next turn within "
                                                 f"reset_timeout ({self.settings.reset_timeout:g}s)"))
            return f"error: {self.failure}"
        except EpisodeFailed as exc:
            self.fail(exc.failure.told("the environment failed: "))
            return f"error: {self.failure}; the rollout will be masked"
        if result.failure:
            self.fail(result.failure)
        return gym_text(result)

    async def verify(self, last_reply: str) -> Outcome | None:
        """End the turns the model left open (its last reply ends the first), and score."""
        await asyncio.shield(self.opened)
        if self.failure:
            return None
        try:
            reply = last_reply
            while not self.finished:
                async with asyncio.timeout(self.settings.reset_timeout):
                    if await self.rollout.end_turn(reply) is None:
                        self.finished = True
                reply = ""
            outcome = await self.rollout.outcome()
        except asyncio.TimeoutError:
            self.fail(Failure(TRANSPORT_TIMEOUT, f"ending the turns and scoring took longer than "
                                                 f"reset_timeout ({self.settings.reset_timeout:g}s)"))
            return None
        except EpisodeFailed as exc:
            self.fail(exc.failure.told("the environment failed: "))
            return None
        if outcome.failure is not None:
            self.fail(outcome.failure)
            return None
        reward = outcome.reward
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or \
                not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
            self.fail(Failure(VERIFIER_ERROR, f"the verifier's reward {reward!r} is not a finite "
                                              "number from 0 to 1"))
            return None
        return outcome

    async def close(self, reason: str) -> None:
        self.opened.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.opened
        await self.rollout.close(reason)


def gym_text(result: ToolResult) -> str:
    """A tool's result as the model reads it on Gym: its text, and an error said to be one."""
    if result.status == OK or result.text.startswith("error"):   # an env's text may say so itself
        return result.text
    return f"error: {result.text}"


VERDICTS_KEPT = 2048
SPENT_IDS_KEPT = 65_536      # closed resources_session_ids remembered, so a late seed can't revive one


def digest(text: str) -> str:
    """A short fingerprint of a request's text, to tell a retry from a different request."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclasses.dataclass
class Verdict:
    """What /verify answered for a rollout, kept small: the reply is rebuilt around the request."""

    digest: str                             # of the model's last reply, to tell a retry apart
    fields: dict[str, Any]                  # reward, mask_sample, failure_kind, ... (scored)
    failure: Failure | None = None          # of a masked rollout

    @classmethod
    def of(cls, reply: str, outcome: Outcome | None, failure: Failure | None) -> Verdict:
        if outcome is None:
            assert failure is not None
            gym_log.warning("rollout masked: %s", failure)
            return cls(digest(reply), {}, failure)
        return cls(digest(reply), {"reward": float(outcome.reward), "mask_sample": False,
                                   "failure_kind": None, "failure_reason": None,
                                   "scores": outcome.scores})

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        return masked(body, self.failure, quiet=True) if self.failure else {**body, **self.fields}


def row_tools(row: dict[str, Any]) -> list[str] | None:
    """The tool names a dataset row offers the model, or None when it names none."""
    params = row.get("responses_create_params")
    tools = params.get("tools") if isinstance(params, dict) else None
    if not isinstance(tools, list):
        return None
    return [str(t.get("name")) for t in tools if isinstance(t, dict) and t.get("name")]


def last_reply(response: Any) -> str:
    """The text of the model's last message in a Responses object (its final reply)."""
    output = response.get("output") if isinstance(response, dict) else None
    for item in reversed(output if isinstance(output, list) else []):
        if isinstance(item, dict) and item.get("type") == "message":
            parts = item.get("content")
            return "".join(p["text"] for p in parts if isinstance(p, dict)
                           and isinstance(p.get("text"), str)) if isinstance(parts, list) else ""
    return ""


class GymSurface:
    """NeMo Gym's resources-server routes: /seed_session, a route per tool, /verify,
    /close_session and /aggregate_metrics, by a session cookie, each answering within its bound.
    Its rollouts are played where ``rollouts`` plays them; its sessions count in ``sessions``."""

    def __init__(self, rollouts: Rollouts, sessions: Sessions, settings: Settings):
        self.rollouts, self.settings = rollouts, settings
        self.sessions = sessions.gym
        self.by_resources_id: dict[str, str] = {}
        # Ids of sessions that ended (or were closed before any seed): a seed naming one is refused,
        # so a seed that lost a race with its close never brings the session back.
        self.spent: collections.OrderedDict[str, None] = collections.OrderedDict()
        # The verdicts of the last rollouts verified, by cookie, so a retried /verify (its reply
        # lost on the way) gets the same answer; bounded, as Gym retries within seconds.
        self.verdicts: collections.OrderedDict[str, Verdict] = collections.OrderedDict()
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        await self.rollouts.start()
        # Gym never verifies a rollout whose run failed or was cancelled: the sweep frees it.
        self._sweeper = asyncio.create_task(
            sweep_idle("a NeMo Gym", "idle_timeout", self.sessions, self.settings.idle_timeout,
                       self._end))

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        await asyncio.gather(*(self._end(s, "the server shut down") for s in list(self.sessions.values())),
                             return_exceptions=True)
        await self.rollouts.stop()

    async def _end(self, session: GymSession, reason: str) -> None:
        self.sessions.pop(session.token, None)
        if session.resources_id is not None:
            self.by_resources_id.pop(session.resources_id, None)
            self._spend(session.resources_id)
        await session.close(reason)

    def _spend(self, resources_id: str) -> None:
        self.spent[resources_id] = None
        self.spent.move_to_end(resources_id)
        while len(self.spent) > SPENT_IDS_KEPT:
            self.spent.popitem(last=False)

    async def _task_of(self, row: dict[str, Any]) -> tuple[str, int, Any]:
        """The row's split and index, checked against its task_id; raises ValueError."""
        split, index, task_id = row.get("split"), row.get("index"), row.get("task_id")
        if not isinstance(split, str) or not isinstance(index, int) or isinstance(index, bool):
            raise ValueError("the row needs split (text) and index (a whole number) naming the task "
                             "to play; write the rows with python agentenv.py write-gym")
        try:
            task_id_here = await self.rollouts.task_id(split, index)
        except LookupError as exc:
            raise ValueError(str(exc)) from None
        if task_id is not None and not same_task(str(task_id), task_id_here):
            raise ValueError(f"the row's task_id {task_id!r} is not the task at {split}[{index}], "
                             f"which is {task_id_here!r}; write the rows again with write-gym")
        return split, index, task_id_here

    def _session(self, request: Any) -> GymSession | None:
        token = request.cookies.get(GYM_COOKIE)
        return self.sessions.get(token) if token else None

    # -- routes

    async def alive(self, request: Any) -> Any:
        return json_reply({"status": "ok"})

    async def seed(self, request: Any) -> Any:
        body, problem = await json_body(request)
        if problem:
            return problem
        # Gym's environment servers name the session themselves, and seed again when a reply is lost.
        resources_id = body.get("resources_session_id")
        if resources_id is not None and not (isinstance(resources_id, str) and resources_id):
            return json_reply({"detail": "resources_session_id names the session: send it as non-empty "
                                         "text, or leave it out and use the session cookie"}, 400)
        row = body.get("task_data") if isinstance(body.get("task_data"), dict) else body
        try:
            split, index, _ = await self._task_of(row)
        except ValueError as exc:
            return json_reply({"detail": str(exc)}, 400)
        # No await from here until the session is registered: a duplicate seed finds it.
        if resources_id is not None:
            seeded_with = digest(json.dumps(body, sort_keys=True))
            earlier = self.sessions.get(self.by_resources_id.get(resources_id, ""))
            if earlier is not None and earlier.seeded_with == seeded_with:
                return self._seeded(earlier)                 # a retried seed: the same session
            if earlier is not None:
                return json_reply({"detail": f"resources_session_id {resources_id!r} was seeded already, "
                                             "with another episode or task; give each session an id of "
                                             "its own"}, 409)
            if resources_id in self.spent:
                return json_reply({"detail": f"resources_session_id {resources_id!r} was closed; a closed "
                                             "id stays closed, so seed the new session with a new id"}, 409)
        token = secrets.token_urlsafe(24)
        session = self.sessions[token] = GymSession(token, row, self.rollouts.rollout(split, index),
                                                    self.settings)
        if resources_id is not None:
            session.resources_id, session.seeded_with = resources_id, seeded_with
            self.by_resources_id[resources_id] = token
        return self._seeded(session)

    @staticmethod
    def _seeded(session: GymSession) -> Any:
        from aiohttp import web
        reply = {"resources_session_id": session.resources_id} if session.resources_id else {}
        response = web.json_response(reply)
        response.set_cookie(GYM_COOKIE, session.token, httponly=True, samesite="Lax")
        return response

    async def tool(self, request: Any) -> Any:
        from aiohttp import web
        name = request.match_info["tool"]
        session = self._session(request)
        if session is None:
            if request.cookies.get(GYM_COOKIE) in self.verdicts:
                return web.Response(status=409, text=f"error: this rollout was verified already, so "
                                                     f"{name} cannot run; seed a new session for a "
                                                     "new rollout")
            return web.Response(status=400, text=f"error: no session: POST /seed_session with the "
                                                 f"row first, then call {name} with its cookie")
        try:
            arguments = loads(await read_body(request) or b"{}")
        except ValueError as exc:
            return web.Response(status=400, text=f"error: the arguments of {name} are not JSON ({exc})")
        if not isinstance(arguments, dict):
            return web.Response(status=400, text=f"error: the arguments of {name} must be a JSON "
                                                 "object")
        async with session.lease.using():
            text = await session.call(name, arguments)
        # A lone surrogate (JSON's "\ud800" escape, echoed back by the env) cannot be UTF-8.
        return web.Response(body=text.encode("utf-8", "replace"), content_type="text/plain",
                            charset="utf-8")

    async def verify(self, request: Any) -> Any:
        body, problem = await json_body(request)
        if problem:
            return problem
        if not isinstance(body.get("responses_create_params"), dict) or "response" not in body:
            return json_reply({"detail": "verify takes the row with responses_create_params and the "
                                         "model's response"}, 422)
        token = request.cookies.get(GYM_COOKIE)
        if token is None:
            return json_reply({"detail": "no session cookie: POST /seed_session with the row first, and "
                                         "send its cookie with /verify"}, 400)
        reply, session = last_reply(body.get("response")), self.sessions.get(token)
        if session is not None:
            async with session.lease.using():        # a second verify waits for the first's verdict
                if token not in self.verdicts:
                    outcome = await session.verify(reply)
                    self.verdicts[token] = Verdict.of(reply, outcome, session.failure)
                    while len(self.verdicts) > VERDICTS_KEPT:
                        self.verdicts.popitem(last=False)
                    await self._end(session, "verified")
        verdict = self.verdicts.get(token)
        if verdict is None:
            return json_reply(masked(body, Failure(SESSION_LOST, (
                "this server holds no session for the rollout (it was closed, ended after "
                "idle_timeout, or the server restarted)"))))
        if verdict.digest != digest(reply):
            return json_reply({"detail": "this rollout was verified already, with another response; a "
                                         "session scores once: seed a new session for a new rollout"}, 409)
        return json_reply(verdict.reply(body))

    async def close(self, request: Any) -> Any:
        body, problem = await json_body(request, allow_empty=True)
        if problem:
            return problem
        token = request.cookies.get(GYM_COOKIE)
        resources_id = body.get("resources_session_id")
        if isinstance(resources_id, str) and resources_id:
            # Gym's typed reply (ResourcesCloseSessionResponse) is the id alone; closing an id never
            # seeded spends it too, so a seed that arrives after its close can't create it.
            session = self.sessions.get(self.by_resources_id.get(resources_id, ""))
            if session is None:
                self._spend(resources_id)
                return json_reply({"resources_session_id": resources_id})
            try:
                await self._end(session, "close_session")
            except Exception as exc:                    # noqa: BLE001
                return json_reply({"resources_session_id": resources_id,
                                   "detail": f"the session's env could not be released ({exc})"}, 500)
            return json_reply({"resources_session_id": resources_id})
        session = self.sessions.get(token) if token else None
        if session is None:
            return json_reply({"status": "already_closed"})
        try:
            await self._end(session, "close_session")
        except Exception as exc:                        # noqa: BLE001
            return json_reply({"status": "release_failed", "detail": str(exc)})
        return json_reply({"status": "closed"})

    async def aggregate(self, request: Any) -> Any:
        body, problem = await json_body(request, allow_empty=True)
        if problem:
            return problem
        given = body.get("verify_responses")
        results = [r for r in given if isinstance(r, dict)] if isinstance(given, list) else []
        scored = [float(r["reward"]) for r in results if not r.get("mask_sample")
                  and isinstance(r.get("reward"), (int, float))]
        metrics = {"mean/reward": sum(scored) / len(scored) if scored else None,
                   "rollouts": len(results), "masked": len(results) - len(scored)}
        return json_reply({"group_level_metrics": [], "agent_metrics": metrics, "key_metrics": metrics,
                           "perf_summary": None, "repeat_level_metrics": []})

    ROUTES = [("GET", "/", alive), ("POST", "/seed_session", seed), ("POST", "/verify", verify),
              ("POST", "/close_session", close), ("POST", "/aggregate_metrics", aggregate)]
    # Gym calls a tool at the route of its name: a catch-all, matched after every fixed route.
    TOOL_ROUTE = ("POST", "/{tool}", tool)


async def environment_at(http: aiohttp.ClientSession, url: str) -> str:
    """The name of the environment a running server serves; AgentEnvError if none answers."""
    try:
        async with http.get(url.rstrip("/") + "/list_environments",
                            timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status == 401:
                raise AgentEnvError(f"the server at {url} asks for a bearer token, and "
                                    + ("AGENTENV_TOKEN is not the one it was given"
                                       if client_headers() else "none was sent")
                                    + "; set AGENTENV_TOKEN to the token serve was given")
            return str((await resp.json(content_type=None))[0])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, LookupError, TypeError) as exc:
        raise AgentEnvError(f"no agentenv.py server answered at {url} ({type(exc).__name__}: "
                            f"{exc}); start it with python agentenv.py serve BUNDLE, or pass the "
                            "bundle's folder instead of a URL") from None


def same_task(given: str, here: str) -> bool:
    """Whether a row's task_id names this task: the same id, or (a bundle served from another
    folder) the same bundle and task names."""
    return given == here or given.split("/")[-2:] == here.split("/")[-2:]


def masked(body: dict[str, Any], failure: Failure, quiet: bool = False) -> dict[str, Any]:
    """A complete verify reply for a rollout the environment failed: NeMo RL leaves it out."""
    if not quiet:
        gym_log.warning("rollout masked: %s", failure)
    config = body.get("instance_config") if isinstance(body.get("instance_config"), dict) else {}
    return {**body, "reward": 0.0, "mask_sample": True, "failure_kind": failure.kind,
            "failure_reason": failure.reason, "instance_config": {**config, "mask_sample": True}}


# ================================================================ 11. The app

# Names a tool can't take, since Gym would call a route of the app instead: the first segment of
# every fixed route of both surfaces, and the routes NeMo Gym's own servers answer.
GYM_OWN_ROUTES = {"docs", "redoc", "openapi.json", "health", "healthz", "livez", "readyz", "stats",
                  "reverify_mode", "mcp", "ng-rollout"}
RESERVED_NAMES = frozenset({path.split("/")[1] for _, path, _ in
                            (*OpenEnvSurface.ROUTES, *GymSurface.ROUTES)
                            if path != "/" and not path.startswith("/{")} | GYM_OWN_ROUTES)


class Server:
    """The one aiohttp application: OpenEnv's and NeMo Gym's routes side by side on one runtime
    and its pool, so both kinds of trainer share one pool of episodes (or, for a Gym resources
    server in url: mode, Gym's routes alone, playing on a running serve). The app's start-up
    starts the runtime and the surfaces; its shutdown ends every session and tears down."""

    def __init__(self, runtime: Runtime | None, settings: Settings = Settings(), *,
                 url: str | None = None, host: str = "127.0.0.1", port: int = 8000,
                 token: str | None = None):
        from aiohttp import web
        self.runtime, self.settings, self.host, self.port = runtime, settings, host, port
        self.app = web.Application(client_max_size=MAX_BODY,
                                   middlewares=[bearer_token(token)] if token else [])
        sessions = Sessions(runtime.pool.limit if runtime else settings.max_concurrent_envs)
        self.openenv = OpenEnvSurface(runtime, sessions, settings) if runtime else None
        rollouts: Rollouts = LocalRollouts(runtime) if runtime else RemoteRollouts(str(url), settings)
        self.gym = GymSurface(rollouts, sessions, settings)
        self.surfaces = [s for s in (self.openenv, self.gym) if s is not None]
        router = self.app.router
        for surface in self.surfaces:
            for method, path, handler in surface.ROUTES:
                _add_route(router, method, path, handler.__get__(surface))
        # Gym may prefix a rollout's routes; aiohttp matches routes in the order they were added,
        # so the tool catch-all comes after every fixed route of both surfaces.
        for method, path, handler in self.gym.ROUTES:
            _add_route(router, method, "/ng-rollout/{rollout_id}" + path, handler.__get__(self.gym))
        for prefix in ("", "/ng-rollout/{rollout_id}"):
            method, path, handler = self.gym.TOOL_ROUTE
            _add_route(router, method, prefix + path, handler.__get__(self.gym))
        self.app.on_startup.append(self._start)
        self.app.on_shutdown.append(self._shutdown)

    async def _start(self, app: Any) -> None:
        if self.runtime is not None:
            await self.runtime.start()
        for surface in self.surfaces:
            await surface.start()
        if self.runtime is not None:
            bundle, url = self.runtime.bundle, f"http://{self.host}:{self.port}"
            log.info("Serving %s: %d tasks in the splits %s, up to %d episodes at once, envs in the "
                     "%s sandbox, at %s (OpenEnv: %s/ws; NeMo Gym: %s/seed_session).", bundle.name,
                     len(bundle.tasks), ", ".join(bundle.splits), self.runtime.pool.limit,
                     self.runtime.sandbox.kind, url, url, url)

    async def _shutdown(self, app: Any) -> None:
        if self.runtime is not None:
            log.info("Shutting down: ending %d live episode(s) and tearing their envs down.",
                     len(self.runtime.live))
        for surface in reversed(self.surfaces):
            await surface.stop()
        if self.runtime is not None:
            await self.runtime.close()


def _add_route(router: Any, method: str, path: str, handler: Callable) -> None:
    # add_get answers HEAD too, as a GET route should
    if method == "GET":
        router.add_get(path, handler)
    else:
        router.add_route(method, path, handler)


def run_gym_server() -> None:
    """Run as NeMo Gym runs a resources server: ``python app.py`` in its folder, with its host,
    port and settings in ``NEMO_GYM_CONFIG_DICT`` under the instance ``NEMO_GYM_CONFIG_PATH``."""
    from aiohttp import web
    import yaml
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        full = yaml.safe_load(os.environ["NEMO_GYM_CONFIG_DICT"])
        instance = os.environ["NEMO_GYM_CONFIG_PATH"]
        servers = full[instance]["resources_servers"]
        config = dict(next(iter(servers.values())))
    except (KeyError, TypeError, StopIteration, yaml.YAMLError) as exc:
        sys.exit(f"agentenv.py: this resources server runs under NeMo Gym, which passes its config in "
                 f"NEMO_GYM_CONFIG_DICT and NEMO_GYM_CONFIG_PATH ({type(exc).__name__}: {exc}); start "
                 "it with gym env start --config configs/<name>.yaml")
    if int(config.get("num_workers") or 1) > 1:
        sys.exit(f"agentenv.py: num_workers is {config['num_workers']}, but a rollout's session lives "
                 "in its server's process, so the resources server runs with one worker; remove "
                 "num_workers from its config")
    host = config.get("host") or full.get("default_host") or "127.0.0.1"
    port = int(config.get("port") or 8000)
    where = f"the resources server's config (configs/{instance}.yaml)"
    try:
        settings = Settings.from_config(config, where)
        if config.get("url"):
            server = Server(None, settings, url=str(config["url"]), host=host, port=port)
        elif config.get("bundle"):
            bundle = Bundle.load(Path(str(config["bundle"])).expanduser(), config.get("reward"))
            ray = RayOptions(RayOptions.address_from(config.get("ray_address"),
                                                     full.get("ray_head_node_address")),
                             config.get("ray_resource") or None)
            runtime = Runtime(bundle, sandbox=str(config.get("sandbox", "auto")),
                              max_concurrent_envs=settings.max_concurrent_envs,
                              deploy_timeout=settings.deploy_timeout,
                              knob=f"max_concurrent_envs in {where}", ray=ray)
            server = Server(runtime, settings, host=host, port=port)
        else:
            sys.exit("agentenv.py: the resources server's config names neither url: (a running "
                     "python agentenv.py serve) nor bundle: (a bundle folder); add one")
    except AgentEnvError as exc:
        sys.exit(f"agentenv.py: {exc}")
    wait_for_children_by_pidfd()
    try:
        web.run_app(server.app, host=host, port=port, print=None, access_log=None, shutdown_timeout=30)
    except AgentEnvError as exc:
        sys.exit(f"agentenv.py: {exc}")


# ================================================================ 12. Writer

TOOL_NAME = re.compile(r"[A-Za-z0-9_.~-]+")
WRITTEN_BY = "written by agentenv.py write-gym"


def gym_name(bundle: str) -> str:
    """The resources server's name for a bundle: gridsim-v1 -> gridsim_v1."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", bundle).strip("_")
    return name if name and not name[0].isdigit() else f"bundle_{name}"


def check_tool_names(toolsets: dict[str, list[dict[str, Any]]]) -> None:
    problems = []
    for toolset, tools in toolsets.items():
        for tool in tools:
            name = tool["name"]
            if not TOOL_NAME.fullmatch(name) or name in (".", ".."):
                problems.append(f"toolset {toolset}: the tool {name!r} is not one path segment, and "
                                "Gym calls a tool at the route of its name; rename it in the env "
                                "(letters, digits, _ . ~ -)")
            elif name in RESERVED_NAMES or name == "end_turn":
                problems.append(f"toolset {toolset}: the tool {name!r} has the name of one of the "
                                "resources server's own routes, which Gym would call instead; rename "
                                "it in the env")
    if problems:
        raise AgentEnvError("the rows can't be written:\n  - " + "\n  - ".join(problems))


def function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as a Responses function tool."""
    return {"type": "function", "name": tool["name"], "description": tool.get("description") or "",
            "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
            "strict": False}


async def _toolsets_here(bundle: Bundle, sandbox: str) -> dict[str, list[dict[str, Any]]]:
    """Play one task of each toolset as far as its first turn, to list the tools it offers."""
    async with Runtime(bundle, sandbox=sandbox) as runtime:
        return {toolset.name: await runtime.first_turn_tools(tasks[0], "write-gym listed the tools")
                for toolset, tasks in bundle.toolsets.items()}


async def _catalog_there(url: str) -> tuple[str, dict[str, list[dict[str, Any]]],
                                            dict[str, list[dict[str, Any]]]]:
    """A running server's bundle name, its splits' task rows, and the tools of each toolset."""
    base = url.rstrip("/")
    async with aiohttp.ClientSession(headers=client_headers()) as http:
        env = await environment_at(http, url)
        async with http.get(f"{base}/{env}/splits") as resp:
            splits = [s["name"] for s in await resp.json()]
        rows = {}
        for split in splits:
            async with http.post(f"{base}/{env}/tasks", json={"split": split}) as resp:
                rows[split] = (await resp.json())["tasks"]
        toolsets: dict[str, list[dict[str, Any]]] = {}
        for row in rows["all"]:
            key = row.get("toolset", "(all)")
            if key in toolsets:
                continue
            client = OpenEnvClient(http, url, Settings.reset_timeout)
            try:
                await client.reset("all", row["index"])
                toolsets[key] = await client.list_tools()
            except EpisodeFailed as exc:
                raise AgentEnvError(f"the server at {url} could not play {row['name']}: {exc}") from None
            finally:
                await client.close()
    return env, rows, toolsets


def _bundle_rows(bundle: Bundle) -> dict[str, list[dict[str, Any]]]:
    return {split: [task_row(task, i) for i, task in enumerate(tasks)]
            for split, tasks in bundle.splits.items()}


async def write_gym(source: str, gym_root: str,
                    max_concurrent_envs: int = Settings.max_concurrent_envs, sandbox: str = "auto",
                    reward: str | None = None, keep_prompts: bool = False,
                    out: Callable[[str], None] = print) -> Path:
    """Write ``GYM_ROOT/resources_servers/<name>/``: app.py, a copy of agentenv.py, the venv's
    pyproject.toml, configs/<name>.yaml and data/<split>.jsonl for every split."""
    remote = source.startswith(("http://", "https://"))
    if remote:
        bundle_name, rows, toolsets = await _catalog_there(source)
        where: dict[str, Any] = {"url": source}
    else:
        bundle = Bundle.load(source, reward)
        bundle_name, rows = bundle.name, _bundle_rows(bundle)
        toolsets = await _toolsets_here(bundle, sandbox)
        where = {"bundle": str(bundle.root), "sandbox": sandbox, **({"reward": reward} if reward else {})}
    check_tool_names(toolsets)
    name = gym_name(bundle_name)
    target = Path(gym_root).expanduser().resolve() / "resources_servers" / name
    if (target / "app.py").exists() and WRITTEN_BY not in (target / "app.py").read_text():
        raise AgentEnvError(f"{target} holds a resources server that write-gym did not write; move "
                            "it away or write into another Gym root")
    kept = _prompts_in(target / "data") if keep_prompts else {}
    settings = Settings(max_concurrent_envs=max_concurrent_envs).gym_config(bundle=not remote)
    files = _server_files(name, bundle_name, {**where, **settings})
    for split, split_rows in rows.items():
        if not plain_name(split):
            raise AgentEnvError(f"the split {split!r} cannot name a file of rows (data/<split>.jsonl) "
                                "inside the server's folder; a split is named after its eval file, "
                                "so rename the eval")
        lines = [json.dumps(_gym_row(name, split, row, toolsets, kept), ensure_ascii=False)
                 for row in split_rows]
        files[f"data/{split}.jsonl"] = "\n".join(lines) + "\n"
    for rel, text in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text)
        partial.replace(path)      # a file is replaced whole, never left half written
    out(f"wrote {Path(gym_root) / 'resources_servers' / name}")
    return target


def _server_files(name: str, bundle_name: str, server: dict[str, Any]) -> dict[str, str]:
    """The resources server's files but its rows: app.py, agentenv.py, pyproject.toml and its Gym
    config (the server with ``server``'s keys, its simple_agent and its environment server)."""
    config = {
        name: {"resources_servers": {name: {
            "entrypoint": "app.py", "domain": "agent",
            "description": f"{bundle_name}'s tasks, served by agentenv.py", **server}}},
        f"{name}_simple_agent": {"responses_api_agents": {"simple_agent": {
            "entrypoint": "app.py",
            "resources_server": {"type": "resources_servers", "name": name},
            "model_server": {"type": "responses_api_models", "name": "policy_model"}}}},
        f"{name}_environment_server": {"environment_servers": {"legacy_agent": {
            "entrypoint": "app.py",
            "agent_server": {"type": "responses_api_agents", "name": f"{name}_simple_agent"}}}},
    }
    return {
        "app.py": f'"""NeMo Gym resources server for the bundle {bundle_name}, {WRITTEN_BY}.\n\n'
                  f"Gym runs it as `python app.py` in this folder; its settings are in "
                  f"configs/{name}.yaml.\n\"\"\"\n\nimport agentenv\n\n"
                  "if __name__ == \"__main__\":\n    agentenv.run_gym_server()\n",
        "agentenv.py": Path(__file__).read_text(),
        "pyproject.toml": f'[project]\nname = "{name.replace("_", "-")}-resources-server"\n'
                          f'version = "{__version__}"\nrequires-python = ">=3.11"\n'
                          'dependencies = ["aiohttp>=3.9", "pyyaml>=6.0", "docker>=7.0"]\n\n'
                          '[build-system]\nrequires = ["setuptools>=68"]\n'
                          'build-backend = "setuptools.build_meta"\n\n'
                          '[tool.setuptools]\npy-modules = ["agentenv", "app"]\n',
        f"configs/{name}.yaml": _yaml(config),
    }


def _gym_row(name: str, split: str, row: dict[str, Any], toolsets: dict[str, list[dict[str, Any]]],
             kept: dict[tuple[str, str], Any]) -> dict[str, Any]:
    """A task's row of data/<split>.jsonl: its prompt (or the one kept) and its tools."""
    tools = [function_tool(t) for t in toolsets.get(row.get("toolset", "(all)"), [])]
    messages = [{"role": "user", "content": row["prompt"]}]
    if row.get("system_prompt"):
        messages.insert(0, {"role": "system", "content": row["system_prompt"]})
    return {"responses_create_params": {"input": kept.get((split, row["id"]), messages),
                                        "tools": [*tools, function_tool(END_TURN)]},
            "agent_ref": {"type": "responses_api_agents", "name": f"{name}_simple_agent"},
            "split": split, "index": row["index"], "task_id": row["id"]}


def _prompts_in(data: Path) -> dict[tuple[str, str], Any]:
    """The prompts of rows already written, by split and task id, to keep a user's edits
    (--keep-prompts): each split keeps its own."""
    kept: dict[tuple[str, str], Any] = {}
    for path in sorted(data.glob("*.jsonl")) if data.is_dir() else []:
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                row = json.loads(line)
                kept[(path.stem, row["task_id"])] = row["responses_create_params"]["input"]
    return kept


def _yaml(data: dict[str, Any]) -> str:
    import yaml
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


# ================================================================ 13. CLI

def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise AgentEnvError(f"{name}={value!r} is not a whole number; set it to one, such as 8") from None


CHECK_TASKS_SHOWN = 20
# serve's flags for the settings in seconds, with what each bounds; the defaults come from Settings.
SERVE_SETTINGS = {
    "deploy_timeout": "how long an env may take from its launch until it answers; past it the "
                      "episode fails, masked transport_timeout",
    "tool_timeout": "NeMo Gym: one tool call; past it the episode ends, masked",
    "reset_timeout": "NeMo Gym: the deploy and first turn, each end_turn, and a rollout's wait for "
                     "a free episode",
    "idle_timeout": "end a session with no request for this long, to free its slot",
    "client_timeout": "how long OpenEnv clients wait for a reply (their message_timeout_s); every "
                      "reply comes --reply-margin before it",
    "reply_margin": "how long before the client's timeout a call still running is ended with a "
                    "timeout error",
}


async def check(folder: str, sandbox: str, reward: str | None, out: Callable[[str], None] = print,
                ray: RayOptions | None = None) -> None:
    """Load a bundle, show its splits, tasks and toolsets, and play one episode per toolset as far
    as its first turn to list the tools that turn offers; then tear down."""
    bundle = Bundle.load(folder, reward)
    out(f"bundle {bundle.name}: {bundle.description or '(no README.md description)'}")
    out("splits: " + ", ".join(f"{name} ({len(tasks)} task{'s' if len(tasks) != 1 else ''})"
                               for name, tasks in bundle.splits.items()))
    shown = bundle.splits["all"][:CHECK_TASKS_SHOWN]
    width = max(len(t.name) for t in shown)
    out("tasks:")
    for task in shown:
        out(f"  {task.name:<{width}}  toolset {task.toolset.name}  turns {len(task.turns)}  "
            f"reward {task.reward_step}")
    if len(bundle.tasks) > len(shown):
        out(f"  ... and {len(bundle.tasks) - len(shown)} more")
    async with Runtime(bundle, sandbox=sandbox, ray=ray) as runtime:
        out(f"sandbox: {runtime.sandbox.kind}")
        placed = getattr(runtime.sandbox, "placed", None)
        if isinstance(runtime.sandbox, RaySandbox):
            out(f"nodes of the Ray cluster at {runtime.sandbox.options.address}:")
            for node in runtime.sandbox.nodes.values():
                out(f"  {node.address}  " + ", ".join(
                    f"{k} {_amount(k, v)}" for k, v in sorted(node.resources.items())
                    if not k.startswith(("node:", "object_store"))))
        out("toolsets:")
        failed = []
        for toolset, tasks in bundle.toolsets.items():
            started, before = time.monotonic(), len(placed or ())
            try:
                tools = await runtime.first_turn_tools(tasks[0], "check is done")
                shown = ", ".join(t["name"] for t in tools) or "(none)"
                where = "" if placed is None else " on " + ", ".join(
                    f"{env} at {address}" for _, env, address in list(placed)[before:])
                out(f"  {toolset.name} ({len(tasks)} task{'s' if len(tasks) != 1 else ''}), played "
                    f"with {tasks[0].name}{where} in {time.monotonic() - started:.2f}s: {shown}")
            except EpisodeFailed as exc:
                failed.append(toolset.name)
                out(f"  {toolset.name}: the episode of {tasks[0].name} failed: {exc}")
        if failed:
            raise AgentEnvError(f"the toolsets {', '.join(failed)} did not play; see above")
        out("ok: every toolset deployed, and every env was torn down")


def serve(args: argparse.Namespace) -> None:
    from aiohttp import web
    settings = Settings(
        max_concurrent_envs=args.max_concurrent_envs or _env_int(
            "MAX_CONCURRENT_ENVS", Settings.max_concurrent_envs),
        **{key: getattr(args, key) for key in SERVE_SETTINGS})
    for key in SERVE_SETTINGS:
        if not getattr(settings, key) > 0:
            raise AgentEnvError(f"--{key.replace('_', '-')} must be a positive number of seconds, not "
                                f"{getattr(settings, key)!r}")
    bundle = Bundle.load(args.bundle, args.reward)
    token = args.token or os.environ.get("AGENTENV_TOKEN") or None
    if not is_loopback(args.host) and not token:
        log.warning("Serving on %s with no token: anyone who can reach this port can run the "
                    "bundle's envs and tools. Pass --token (or set AGENTENV_TOKEN) so every request "
                    "must carry it, or bind 127.0.0.1.", args.host or "every interface")
    runtime = Runtime(bundle, sandbox=args.sandbox, max_concurrent_envs=settings.max_concurrent_envs,
                      deploy_timeout=settings.deploy_timeout, ray=ray_options(args))
    server = Server(runtime, settings, host=args.host, port=args.port, token=token)
    wait_for_children_by_pidfd()
    web.run_app(server.app, host=args.host, port=args.port, print=None, access_log=None,
                shutdown_timeout=30)


def ray_options(args: argparse.Namespace) -> RayOptions:
    """The Ray cluster and env nodes ``--ray-address`` and ``--ray-resource`` name."""
    return RayOptions(RayOptions.address_from(args.ray_address), args.ray_resource or None)


def main(argv: list[str] | None = None) -> int:
    args = command_line().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # serve narrates what it does; check prints its own report and logs only trouble
    logging.getLogger("agentenv").setLevel(
        logging.INFO if args.verbose or args.command == "serve" else logging.WARNING)
    if args.verbose:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        if args.command == "check":
            asyncio.run(check(args.bundle, args.sandbox, args.reward, ray=ray_options(args)))
        elif args.command == "serve":
            serve(args)
        elif args.command == "write-gym":
            asyncio.run(write_gym(args.source, args.gym_root,
                                  args.max_concurrent_envs or _env_int("MAX_CONCURRENT_ENVS",
                                                                       Settings.max_concurrent_envs),
                                  args.sandbox, args.reward, args.keep_prompts))
    except AgentEnvError as exc:
        print(f"agentenv.py {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def command_line() -> argparse.ArgumentParser:
    """The commands, their flags, and what each says in --help."""
    parser = argparse.ArgumentParser(
        prog="agentenv.py", description="Serve a bundle of agent tasks as training environments.")
    parser.add_argument("--version", action="version", version=f"agentenv.py {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what every episode does")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def bundle_options(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument("bundle", metavar="BUNDLE", help="the bundle's folder")
        cmd.add_argument("--sandbox", choices=("auto", "docker", "local", "ray"), default="auto",
                         help="where envs run: docker, local processes, auto (docker when a "
                              "daemon answers, else local; the default), or ray (placed across "
                              "a Ray cluster, as local processes on its nodes)")
        cmd.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                         help="with --sandbox ray: the cluster's address (default: RAY_ADDRESS, "
                              "else auto, the cluster ray start made on this machine)")
        cmd.add_argument("--ray-resource", default=None, metavar="NAME",
                         help="with --sandbox ray: place envs only on nodes declaring this custom "
                              f"resource (each env asks {RAY_RESOURCE_SHARE:g} of it), keeping "
                              "them off trainer nodes; an env asks a node for its deploy_env "
                              f"step's cpu ({RAY_ENV_CPU:g}) and memory_mb ({RAY_ENV_MEMORY_MB}) "
                              "where the step names none")
        cmd.add_argument("--reward", metavar="STEP", default=None,
                         help="the scoring step whose score is the reward, for tasks with several")

    check_cmd = commands.add_parser(
        "check", help="load a bundle and deploy one episode per toolset",
        description="Load a bundle, print its splits, tasks and toolsets, deploy one episode per "
                    "toolset, print the tools each offers, and tear everything down.")
    bundle_options(check_cmd)
    serve_cmd = commands.add_parser(
        "serve", help="serve a bundle's tasks as OpenEnv envs",
        description="Serve every task of a bundle from one aiohttp app: the OpenEnv wire (/health, "
                    "/metadata, WebSocket /ws), with the splits 'all' and one per eval, out of one "
                    "pool of episodes. SIGINT or SIGTERM tears every live episode down and exits.")
    bundle_options(serve_cmd)
    serve_cmd.add_argument("--host", default="127.0.0.1", help="the address to bind (127.0.0.1)")
    serve_cmd.add_argument("--port", type=int, default=8000, help="the port (8000)")
    serve_cmd.add_argument("--max-concurrent-envs", type=int, default=None, metavar="N",
                           help="episodes live at once; past it, new ones wait (default: "
                                f"MAX_CONCURRENT_ENVS, else {Settings.max_concurrent_envs})")
    for key, help_ in SERVE_SETTINGS.items():
        serve_cmd.add_argument("--" + key.replace("_", "-"), type=float, default=getattr(Settings, key),
                               metavar="SECONDS", help=f"{help_} ({getattr(Settings, key):g})")
    serve_cmd.add_argument("--token", default=None, metavar="TOKEN",
                           help="ask every request for the header Authorization: Bearer TOKEN "
                                "(default: AGENTENV_TOKEN, else none); clients of a served URL "
                                "(write-gym, a Gym server with url:) send AGENTENV_TOKEN")
    writer = commands.add_parser(
        "write-gym", help="write a NeMo Gym resources server for a bundle into a Gym root",
        description="Write GYM_ROOT/resources_servers/<name>/: app.py, a copy of agentenv.py, the "
                    "venv's pyproject.toml, configs/<name>.yaml and data/<split>.jsonl rows for the "
                    "split 'all' and every eval. From a URL, the resources server plays its rollouts "
                    "on that running server; from a bundle folder, it serves the bundle itself. It "
                    "plays one task of each toolset to list the tools its rows offer.")
    writer.add_argument("source", metavar="URL_OR_BUNDLE",
                        help="a running server's URL (http://127.0.0.1:8000) or a bundle's folder")
    writer.add_argument("gym_root", metavar="GYM_ROOT", help="the Gym checkout (or extra root)")
    writer.add_argument("--max-concurrent-envs", type=int, default=None, metavar="N",
                        help="with a bundle: episodes the resources server runs at once "
                             f"({Settings.max_concurrent_envs})")
    writer.add_argument("--sandbox", choices=("auto", "docker", "local", "ray"), default="auto",
                        help="with a bundle: where its envs run")
    writer.add_argument("--reward", metavar="STEP", default=None,
                        help="with a bundle: the scoring step whose score is the reward")
    writer.add_argument("--keep-prompts", action="store_true",
                        help="keep the prompts of rows already written (your edits) when writing "
                             "the server again; without it every file is written anew")
    return parser


if __name__ == "__main__":
    sys.exit(main())
