"""agentenv.py: serve a bundle of agent tasks as training environments, in one file.

A *bundle* is a folder in the AgentEnv layout: ``envs/<name>/`` (an MCP env server's Docker build
context), ``artifacts/<name>/`` (verifier code), ``tasks/<name>.json`` (a task: a JSON array of
steps) and ``evals/<name>.toml`` (``tasks = [...]``). A trainer plays a task as an *episode*: the
task's envs are deployed fresh in a *sandbox*, the task's agent is played from outside (the model
takes its *turns*, calling the env's tools), and the task's own *verifier* scores what it did.

The file reads top to bottom in the order data flows; a section uses only the sections above it:

1. Values, errors      the shapes every layer passes on: a Failure (kind, reason), a ToolResult
                        with its status, the Settings with every default (``Settings.checked``
                        the one way in; the sandboxes' settings Declared by section 3), errors
                        that say the fix; the Metrics every section records into (and reads back
                        as numbers for the web page), and a Progress line for long work.
2. Bundle               loading and checking a bundle: envs, artifacts, skills, tasks, steps (a
                        check per step type), splits, toolsets, reward.
3. Sandbox providers    where an env runs, one class per provider in one registry (PROVIDERS):
                        local processes; Docker (its daemon apart from its sandbox: containers
                        on a network that reaches nothing it should not); either of those on the
                        Ray node a placement group picked; and auto, the first that connects in
                        the providers' own order. Each has its settings, its options,
                        ``connect``, ``describe``, its capabilities and what the server decides
                        by it (its warm pool, its boxes' memory, auto, Ray's nodes: nothing else
                        decides by a provider's name); and the boxes the agent works in with
                        bash (a container of its own, whose keeper stops every process of the
                        agent's at a turn's end and a command's deadline; or a work folder).
4. Env client           an MCP client on kept-alive HTTP/1.1 connections of its own (EnvLine),
                        readiness, the env's card and extensions; bash.
5. Verifiers            the verifier kinds (an env's outcome, a reply, a box's state, unit tests),
                        their execution under a deadline (Verifiers, unit_tests) with one failure
                        kind per cause, and AgentEnv's score aggregators.
6. Episode              one play of a task, given an EpisodeContext (what it uses, not the
                        runtime), in three parts: the play (Episode: its phase, turns and
                        outcome), its steps (Steps: run as a graph, a handler per step type) and
                        its teardown (Teardown: what the steps made removed, in order, and tried
                        again while a removal fails); what the model does to its own box is its 0
                        (a Forfeit), never a mask.
7. Pool and runtime     the semaphore that bounds live episodes, the boot gate, the warm pool
                        of envs ready ahead of demand (by default as the sandbox's provider
                        says), and Runtime(bundle, settings).
8. Plumbing             what both wires share: HTTP helpers, the JSON reader, the browser guard
                        (no page but the server's own, no Host but its names: BrowserGuard), the
                        bearer token (a header, or a browser's WebSocket subprotocol), the
                        sessions table both wires count against the pool, the idle sweep.
9. OpenEnv surface      sessions over /ws and /mcp, the stateless routes, the task API: each
                        renders the play's values as observations or JSON-RPC.
10. Gym surface         NeMo Gym's resources-server routes, rendering the same values as the text
                        a model reads and as masked verifies, reverification as a replay, and the
                        aggregate metrics Gym's reward profiler computes; url: mode through an
                        OpenEnv client.
11. The app             build_app: the one aiohttp application of both surfaces (serve runs it),
                        Gym's entry point, and /web: the page on which a person plays a task by
                        hand and watches the run, with its status route.
12. Writer              ``write-gym``: a resources server and its rows, written into a Gym root.
13. Trainers and eval  ``eval``: those rows played against an OpenAI-compatible model through the
                        Gym surface, as NeMo Gym's simple_agent plays them, and scored; TRL's
                        GRPOTrainer: a bundle as its environment_factory (trl_environment), its
                        rows (trl_dataset) and its reward (trl_reward), on a loop of their own.
14. CLI                 ``python agentenv.py check|serve|write-gym|eval ...`` (the program runs
                        main() of the module agentenv: see the top of the file).

A Gym tool call, for instance, goes: the route (10) → the session → its rollout → the episode's
open turn (6) → the env's MCP session (4) → the env; the ToolResult it gives comes back up
unchanged, and only the route renders it. A setting goes: a flag, a Gym config key or a build_app
keyword → ``Settings.checked`` (1) → ``Runtime(bundle, settings)`` (7) → the provider's options (3).

To add a sandbox provider (say Kubernetes), write one class in section 3 and a line of the README,
nothing else: subclass ``Sandbox`` with ``@provider``; give it a ``kind`` (its name, which
``--sandbox``, ``build_app(sandbox=...)``, a Gym config's ``sandbox:`` and ``check`` then offer),
a ``summary`` and ``place`` (what ``--help`` and errors say of it), and its ``settings`` (each a
``Declared``: a name such as ``k8s_namespace``, which becomes a flag of every command, a
build_app keyword and a Gym config key, with its check and help), read into an options dataclass
in ``connect(owner, settings)``; ``connect`` reaches the provider and checks that what it starts
can be reached from where calls come from. Then ``launch`` (an ``Instance`` per env: its URL,
liveness, output, removal), and whichever capabilities it has (``open_box``, ``open_image``,
``run_sibling``, ``build_image``, ``episode_network``): the others refuse, provider_unavailable,
saying which provider has them. ``describe`` and ``network_mode`` say what ``check`` prints. And it
says what the server decides by it, each with a default for one that says nothing, since nothing
outside the providers decides by a provider's name: ``warm_by_default`` (whether a warm pool pays
off, and why, in the start-up line's words; by default one does), ``box_memory_mb``, ``memory`` and
``memory_of`` (what the warm pool's bound and the memory warning weigh), ``auto_rank`` (its place
in auto's order; by default auto never picks it), ``serves_ray_nodes`` with ``on_ray_node`` (a Ray
node's host running its envs, which ``--ray-node-sandbox`` then offers), ``env_boxes``,
``gates_its_boots`` and ``paced_teardown``.

Only the standard library, aiohttp, prometheus-client (for /metrics), the docker SDK (for the
Docker sandbox), PyYAML (for Gym's YAML) and, with ``--sandbox ray`` only, Ray (an optional extra)
are used at run time, the last three imported only where needed (as is statistics, for Gym's
aggregate metrics): a serve of the local sandbox holds little more than aiohttp itself does
(bench/README.md says what, and why). Blocking calls (the docker SDK, verifier code) run in
threads so the event loop never stalls.
"""

from __future__ import annotations

# Run as a program (python agentenv.py ...), this file is compiled at every start, and Python
# keeps the compiler's syntax tree of it (26 MiB) until the program ends: for a server, its whole
# life, and no heap trim can return it. So the program hands the code it was compiled to, through
# a memory file, to a fresh interpreter in the same process (exec: the same pid, flags, signals,
# output and exit code), which makes of it the module ``agentenv`` as importing this path would,
# and runs its main(). That leaves no tree behind and one module, never a __main__ copy beside an
# ``agentenv`` one (Ray, isinstance and write-gym's server see the same classes). Nothing else of
# the file runs in the program. Where there is no exec or memory file (not Linux), or the file is
# run from other Python code (runpy, python -m), the same module is made in place.
if __name__ == "__main__":
    import os as _os
    import sys as _sys

    _AS_AGENTENV = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('agentenv', path)\n"
        "agentenv = sys.modules['agentenv'] = importlib.util.module_from_spec(spec)\n"
        "exec(code, agentenv.__dict__)\n"
        "sys.exit(agentenv.main())\n"
    )
    _code, _path = _sys._getframe().f_code, _os.path.abspath(__file__)
    if (
        _sys._getframe().f_back is None
        and _sys.executable
        and hasattr(_os, "memfd_create")
        and hasattr(_os, "execv")
    ):
        import marshal as _marshal

        _handed = _os.memfd_create("agentenv.py code", 0)  # inherited across the exec
        _os.write(_handed, _marshal.dumps(_code))
        _os.lseek(_handed, 0, _os.SEEK_SET)
        _flags = _sys.orig_argv[1 : len(_sys.orig_argv) - len(_sys.argv)]  # -X, -W, -u ...
        try:
            _os.execv(
                _sys.executable,
                [
                    _sys.executable,
                    *_flags,
                    "-c",
                    "import marshal, os, sys\n"
                    "handed, path = int(sys.argv[1]), sys.argv[2]\n"
                    "del sys.argv[:3]         # -c, and the two above\n"
                    "with os.fdopen(handed, 'rb') as memory:\n    code = marshal.load(memory)\n"
                    "if sys.path[0] == '':      # as the program had it: its own folder\n"
                    "    sys.path[0] = os.path.dirname(os.path.realpath(path))\n" + _AS_AGENTENV,
                    str(_handed),
                    _path,
                    *_sys.argv,
                ],
            )
        except OSError:  # no exec here: in place, then
            _os.close(_handed)
    exec(_AS_AGENTENV, {"code": _code, "path": _path})

import abc
import argparse
import ast
import asyncio
import atexit
import base64
import collections
import collections.abc
import concurrent.futures
import contextlib
import copy
import dataclasses
import errno
import functools
import gc
import hashlib
import importlib.util
import inspect
import itertools
import json
import logging
import math
import os
import random
import re
import reprlib
import secrets
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import types
import urllib.parse
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Literal, Union, cast

import aiohttp
import yarl  # aiohttp's own URLs

if TYPE_CHECKING:  # aiohttp's server is imported where it is used: most runs serve nothing
    from aiohttp import web

__version__ = "0.1.0"

log = logging.getLogger("agentenv")


# ================================================================ 1. Values, errors, metrics


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
PROVIDER_UNAVAILABLE = "provider_unavailable"  # the sandbox could not provide an env
TRANSPORT_TIMEOUT = "transport_timeout"  # a deploy, a call or a turn missed its deadline
PEER_DROP = "transport_peer_drop"  # the env died under a call
VERIFIER_ERROR = "verifier_error"  # the verifier raised, hung or gave no score
SESSION_LOST = "session_lost"  # the episode was ended from outside, or is gone
ENV_FAILED = "agentenv:env_failed"  # the env failed in a way with no word of its own
TOOLS_MISMATCH = "agentenv:tools_mismatch"  # a row offers other tools than its task
REPLAY_DIVERGED = "agentenv:replay_diverged"  # a reverified rollout's calls answered otherwise
INTERNAL_ERROR = "agentenv:internal_error"  # a bug of agentenv.py's own


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


class Forfeit(AgentEnvError):
    """The model's own doing ended the episode, or failed a step, before its reward was recorded:
    its box broken, filled or made unreadable, its tests failing or hanging. The rollout scores 0
    and is never masked: a mask would teach the model to break what it cannot solve."""


# A tool call's status. The model's own mistakes and the tool's own errors are answers it reads
# and learns from, and the episode goes on; a timeout ends the episode (what the call does may
# still be under way), so it fails the rollout.
OK = "ok"
TOOL_ERROR = "tool_error"  # the tool answered with an error, or its server refused the call
UNKNOWN_TOOL = "unknown_tool"  # the turn offers no tool of that name
BAD_ARGUMENTS = (
    "bad_arguments"  # the arguments don't fit the tool's input schema (or aren't an object)
)
NO_TURN = "no_turn"  # the episode has no open turn to call tools in
TIMEOUT = "timeout"  # the call missed its deadline, and the episode ended


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
    return (
        f"{name} didn't answer within {timeout:g}s, and the episode ended, since what the call "
        "does may still be under way"
    )


@dataclasses.dataclass(frozen=True)
class Declared:
    """A setting that section 3 declares beside Settings' own: which sandbox provider, and each
    provider's options (Ray's cluster, Docker's publish address). Like every setting it has one
    name, which is build_app's keyword, a Gym config's key and the flag ``--NAME`` of the
    commands; its default; its check (the value as given and how the user wrote it, to the value,
    or AgentEnvError saying the fix); and what ``--help`` says of it."""

    name: str
    default: Any
    check: Callable[[Any, str], Any]
    help: str
    metavar: str = "NAME"
    choices: Callable[[], tuple[str, ...]] | None = None  # what argparse offers, read when asked
    written: bool = True  # write-gym writes it into a bundle's Gym config, when it was given
    gym_global: bool = False  # a Gym config gives it at its top (Gym's own key), not the server's


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every deadline and size a user sets, each with its one default: ``serve``'s flags show
    these, the Gym resources server reads them from its config, and ``write-gym`` writes them.
    The settings of sandboxes (which provider, and each provider's options) are declared by
    section 3 (``DECLARED``), kept in ``declared`` and read as attributes all the same."""

    max_concurrent_envs: int = 8  # episodes live at once; past it, new ones wait
    deploy_timeout: float = 180.0  # an env's launch until it answers
    tool_timeout: float = 60.0  # one Gym tool call
    reset_timeout: float = 600.0  # Gym: deploy + first turn, each end_turn, the wait for a slot
    idle_timeout: float = 600.0  # a session with no request is ended, freeing its slot
    client_timeout: float = 60.0  # how long OpenEnv clients wait for a reply
    reply_margin: float = 5.0  # every OpenEnv reply comes this long before that
    verifier_timeout: float = 300.0  # a verifier's run
    request_timeout: float = 300.0  # eval: one request to the model's endpoint
    model_retries: int = 4  # eval: retries of a model request after a 429, 5xx or timeout
    eval_concurrency: int = 8  # eval: rollouts played at once
    max_steps: int = 32  # eval: model calls in one rollout (simple_agent's max_steps)
    warm: int | str = "auto"  # envs kept started and ready ahead of demand, split among
    # the bundle's env specs by how many tasks use each; "auto":
    # a server keeps what warm_default says for its sandbox
    warm_env: tuple[tuple[str, int], ...] = ()  # (env, count): those envs warmed, the split aside
    bash_timeout: float = 300.0  # one bash command in the agent's box (within the call's own)
    # Bytes of an env's answer read (a tool's, and its tool listing, all pages, as one): past them a
    # tool's answer is the model's tool error, and a listing fails the deploy. The model sees at
    # most MAX_TOOL_OUTPUT (100,000) characters of an answer, and they come JSON-escaped: as
    # \uXXXX, 6 bytes a character (12 past the BMP, a surrogate pair), 600 KB for 100,000, and
    # twice that from an MCP server that also gives the result as structuredContent, as FastMCP
    # does for a typed return. 2 MiB holds that (all but such a server's characters past the BMP,
    # 2.4 MB), and an answer costs a few times that in memory at most, not its own size.
    max_env_reply: int = 2 * 2**20
    status_interval: float = 60.0  # how often serve logs its status line while episodes are live
    allow_host: tuple[str, ...] = ()  # names beside loopback's and this machine's the server
    # answers to (a reverse proxy's): see BrowserGuard
    declared: tuple[tuple[str, Any], ...] = ()  # the declared settings given, by name

    # The settings section 3 declares, by name, as it declares each provider: filled at import.
    DECLARED = {}  # type: dict[str, Declared]

    # The keys a Gym config carries, with the resources server serving the bundle (bundle:) or
    # playing on a running serve (url:); the declared ones only where they were given.
    GYM_KEYS = ("tool_timeout", "reset_timeout", "idle_timeout")
    BUNDLE_KEYS = (
        "max_concurrent_envs",
        "deploy_timeout",
        "bash_timeout",
        "max_env_reply",
        "status_interval",
        "warm",
        "warm_env",
    )
    # eval's own settings: how it plays a model, not how a bundle is served
    EVAL_KEYS = ("request_timeout", "model_retries", "eval_concurrency", "max_steps")

    # The settings counted in whole numbers (of which some may be 0: no retries, no step limit);
    # every other number is seconds.
    WHOLE_KEYS = (
        "max_concurrent_envs",
        "max_env_reply",
        "model_retries",
        "eval_concurrency",
        "max_steps",
    )
    ZERO_KEYS = ("model_retries", "max_steps")

    def __getattr__(self, name: str) -> Any:
        """A declared setting (``sandbox``, ``ray_address``, ...): as given, else its default."""
        if (declared := Settings.DECLARED.get(name)) is None:
            raise AttributeError(f"there is no setting {name!r}")
        return dict(self.declared).get(name, declared.default)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every setting's name: Settings' own, then the declared ones."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "declared") + tuple(
            cls.DECLARED
        )

    @classmethod
    def served(cls) -> tuple[str, ...]:
        """The settings of a served bundle: every one but eval's own and those Gym alone gives."""
        return tuple(
            key
            for key in cls.names()
            if key not in cls.EVAL_KEYS and not getattr(cls.DECLARED.get(key), "gym_global", False)
        )

    @classmethod
    def checked(cls, given: dict[str, Any], said: Callable[[str, Any], str]) -> Settings:
        """Settings from the values a user gave (None: not given), the others at their defaults.
        Every way in (the commands' flags, build_app's arguments, a Gym config, eval, TRL) checks
        them here, and a bad one raises AgentEnvError naming it as the user wrote it:
        ``said(key, value)`` (value None: the name alone)."""
        values: dict[str, Any] = {}
        declared: dict[str, Any] = {}
        for key, value in given.items():
            if key not in cls.names():
                raise AgentEnvError(
                    f"{said(key, None)} is not a setting; the settings are {', '.join(cls.names())}"
                )
            if value is None:
                continue
            if key in cls.DECLARED:
                declared[key] = cls.DECLARED[key].check(value, said(key, value))
            elif key == "warm":
                values[key] = AUTO if value == AUTO else warm_count(value, said(key, value))
            elif key == "warm_env":  # its messages quote the value
                values[key] = warm_envs(value, said(key, None))
            elif key == "allow_host":
                values[key] = host_names(value, said(key, value))
            else:
                whole, least = key in cls.WHOLE_KEYS, 0 if key in cls.ZERO_KEYS else 1
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                    or (value < least if whole else value <= 0)
                    or (whole and not float(value).is_integer())
                ):
                    what = (
                        f"a whole number of at least {least}"
                        if whole
                        else "a positive number of seconds"
                    )
                    raise AgentEnvError(
                        f"{said(key, value)}: it must be {what}, such as "
                        f"{_plain(getattr(cls, key))}"
                    )
                values[key] = int(value) if whole else float(value)
        return cls(
            **values, declared=tuple((k, declared[k]) for k in cls.DECLARED if k in declared)
        )

    @classmethod
    def keywords(
        cls, given: dict[str, Any], who: str, allowed: tuple[str, ...] | None = None
    ) -> Settings:
        """Settings given as keywords by their names (build_app's, trl_environment's), checked; a
        name that is no setting of ``who``'s (``allowed``: those it takes, else all) refused by
        name."""
        takes = cls.names() if allowed is None else allowed
        if unknown := [key for key in given if key not in takes]:
            raise AgentEnvError(
                f"{who} takes no setting {unknown[0]!r}; it takes {', '.join(takes)}"
            )
        return cls.checked(given, lambda key, value: key if value is None else f"{key}={value!r}")

    @classmethod
    def of(cls, **given: Any) -> Settings:
        """Settings by their names, checked: ``Settings.of(sandbox="docker", bash_timeout=30)``."""
        return cls.keywords(given, "Settings.of")

    @classmethod
    def from_config(
        cls, config: dict[str, Any], where: str, gym: dict[str, Any] | None = None
    ) -> Settings:
        """The settings a Gym config gives (its server's block ``config``; the keys Gym itself
        sets at the top of ``gym``), the others at their defaults; a bad value says so."""
        served = [key for key in cls.names() if key not in cls.EVAL_KEYS]
        given = {key: config.get(key) for key in served}
        for key, declared in cls.DECLARED.items():
            if declared.gym_global and gym is not None:
                given[key] = gym.get(key)
        return cls.checked(
            given,
            lambda key, value: (
                f"{key} in {where}" if value is None else f"{key}: {value!r} in {where}"
            ),
        )

    def gym_config(self, bundle: bool) -> dict[str, Any]:
        """The settings as a Gym config writes them (the warm pool only where it was given, so
        an unwritten one stays "auto"; a declared setting only where it was given)."""
        keys = self.GYM_KEYS + (self.BUNDLE_KEYS if bundle else ())
        config: dict[str, Any] = {
            key: _plain(getattr(self, key)) for key in keys if not key.startswith("warm")
        }
        if bundle and self.warm != AUTO:
            config["warm"] = self.warm
        if bundle and self.warm_env:
            config["warm_env"] = dict(self.warm_env)
        for key, value in self.declared if bundle else ():
            if self.DECLARED[key].written:
                config[key] = value
        return config


AUTO = "auto"  # a setting the server works out for itself (the warm pool: warm_default)


def warm_count(value: Any, what: str) -> int:
    """A warm pool's size as a user gave it: a whole number, 0 (no pool) or more (``--warm``'s
    text is read as a number by warm_flag)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or not float(value).is_integer()
    ):
        raise AgentEnvError(
            f"{what} is not a whole number of warm envs (0 or more) nor auto; set "
            "it to one, such as 4, to 0 for no warm pool, or leave it out (auto)"
        )
    return int(value)


def warm_flag(text: str) -> int | str:
    """``--warm``'s text: auto, or a number as a number (so its message says --warm -1, not '-1');
    warm_count checks it."""
    with contextlib.suppress(ValueError):
        return int(text)
    return text


def warm_envs(value: Any, what: str) -> tuple[tuple[str, int], ...]:
    """``--warm-env NAME=N`` flags (a list) or a Gym config's ``warm_env: {NAME: N}``, as pairs."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        pairs = [v.partition("=")[::2] for v in value]
    else:
        raise AgentEnvError(
            f"{what}: {value!r} is not a mapping of env names to counts; write it as {{NAME: N}}"
        )
    named: dict[str, int] = {}
    for name, count in pairs:
        if isinstance(count, str):
            count = int(count) if count.strip().isdigit() else count
        if not isinstance(name, str) or not name or name in named:
            raise AgentEnvError(
                f"{what}: {name!r} is not an env name given once; name each env of "
                "the bundle's envs/ folder once, as NAME=N"
            )
        named[name] = warm_count(count, f"{what}: {name}={count!r}")
    return tuple(named.items())


# A host name as a Host header or a URL names it: labels of letters, digits and hyphens.
HOST_NAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
    r"(\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def host_names(value: Any, what: str) -> tuple[str, ...]:
    """``--allow-host NAME`` flags (a list), a Gym config's ``allow_host: [NAME, ...]`` or a
    build_app keyword (a name, or names): each a bare host name, in lower case."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise AgentEnvError(
            f"{what} is not a list of host names; give names such as ['rl.example.com']"
        )
    for name in names:
        if not HOST_NAME.fullmatch(name.rstrip(".")):
            raise AgentEnvError(
                f"{what}: {name!r} is not a host name; give the name a browser or "
                "proxy reaches this server by, without a scheme, port or path, "
                "such as rl.example.com"
            )
    return tuple(dict.fromkeys(n.rstrip(".").lower() for n in names))


def _plain(value: float) -> float | int:
    """A whole number of seconds as an int, so a written config reads 600, not 600.0."""
    return int(value) if float(value).is_integer() else value


def at_its_limit(who: str, limit: int | None, what: str, then: str, knob: str) -> str:
    """The one sentence every part says the first time it is full (``limit`` None: a server that
    did not say its own)."""
    return f"{who} is at its limit of {limit} {what} at once, so {then}: {knob} to run more at once"


def current_task() -> asyncio.Task:
    """The task running this coroutine (there is one: it is awaited in one)."""
    task = asyncio.current_task()
    assert task is not None
    return task


def settle(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Give a future its result (or ``error``), unless it has one already: for a callback that
    may come after another has settled it."""
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def short(text: str, limit: int = 2000) -> str:
    """Clip text for a message, keeping the end, which is where tracebacks say what went wrong."""
    text = text.strip()
    return text if len(text) <= limit else "…" + text[-limit:]


# The split a probe is played from: an episode deployed only to find the tools a toolset's turns
# offer (what a list_tools before any reset asks), which /metrics does not count as an episode.
PROBE = "(probe)"

# Prometheus' histogram buckets: durations from a fast tool call to a slow deploy, and rewards.
DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    180.0,
    600.0,
)
REWARD_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
UNKNOWN_TOOL_LABEL = "(unknown)"  # a name the model made up: never a label of its own
# A tool call's status in the metrics, beside a ToolResult's: its env failed it, or its episode
# was ended under it.
ENV_FAILED_CALL = "env_failed"
CANCELLED_CALL = "cancelled"


class Recent:
    """Durations since the status line last took them, for its p50 and p95: a uniform sample of
    at most ``size`` of them (reservoir sampling), so a busy minute costs no more memory than a
    quiet one."""

    def __init__(self, size: int = 1024):
        self.size = size
        self.count = 0
        self.values: list[float] = []

    def add(self, seconds: float) -> None:
        self.count += 1
        if len(self.values) < self.size:
            self.values.append(seconds)
        elif (slot := random.randrange(self.count)) < self.size:
            self.values[slot] = seconds

    def take(self) -> tuple[int, float, float] | None:
        """How many there were, their p50 and p95 (None if none); then start afresh."""
        count, values = self.count, sorted(self.values)
        self.count, self.values = 0, []
        if not values:
            return None
        return (
            count,
            values[round(0.5 * (len(values) - 1))],
            values[round(0.95 * (len(values) - 1))],
        )


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f}ms" if value < 1 else f"{value:.2f}s"


def _many(count: int, what: str) -> str:
    return f"{count:,} {what}" + ("" if count == 1 else "s")


class Metrics:
    """What a server counts, for ``GET /metrics`` in Prometheus' text format and for the status
    line. It owns a CollectorRegistry of its own, never the library's global one, so two servers in
    one process (or the tests) count apart; counters start at zero with the process, as Prometheus
    expects. Each part records where the thing happens, once: a deploy and an episode's end in the
    episode, a tool call in its turn, a verifier's run in the runtime, a mask where a wire renders
    the failure, an idle reap in the sweep; the levels (live, waiting, sessions) are read at
    scrape time from whoever holds them (``watch``)."""

    def __init__(self) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise AgentEnvError(
                "agentenv.py counts what it serves with prometheus-client, which is "
                "not installed: pip install prometheus-client"
            ) from None
        self.registry = registry = prom.CollectorRegistry(auto_describe=True)
        prom.ProcessCollector(registry=registry)
        prom.Info("agentenv", "The version of agentenv.py serving", registry=registry).info(
            {"version": __version__}
        )
        self.episodes = prom.Counter(
            "agentenv_episodes",
            "Episodes ended, by outcome: scored, failed (the environment "
            "failed it, and a trainer masks it) or abandoned (its caller ended it)",
            ["outcome"],
            registry=registry,
        )
        self.deploys = prom.Counter(
            "agentenv_deploys",
            "Envs deployed and answering, by env, sandbox and node (a Ray "
            "node's address; empty for this machine)",
            ["env", "sandbox", "node"],
            registry=registry,
        )
        self.deploy_seconds = prom.Histogram(
            "agentenv_deploy_duration_seconds",
            "From an env's launch until it answers, by env, sandbox and node",
            ["env", "sandbox", "node"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.deploy_failures = prom.Counter(
            "agentenv_deploy_failures",
            "Deploys that failed, by env, sandbox and failure kind",
            ["env", "sandbox", "kind"],
            registry=registry,
        )
        self.tool_calls = prom.Counter(
            "agentenv_tool_calls",
            "Tool calls, by tool and status: ok; tool_error (the tool "
            "answered with an error); the model's own mistakes unknown_tool and bad_arguments; "
            "the env's failures timeout and env_failed; cancelled (its episode was ended under it)",
            ["tool", "status"],
            registry=registry,
        )
        self.tool_seconds = prom.Histogram(
            "agentenv_tool_call_duration_seconds",
            "How long a tool call took, by tool",
            ["tool"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.verifier_seconds = prom.Histogram(
            "agentenv_verifier_duration_seconds",
            "How long a verifier's run took, by verifier artifact",
            ["verifier"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.verifier_failures = prom.Counter(
            "agentenv_verifier_failures",
            "Verifier runs that raised, hung or gave no rows, by verifier artifact",
            ["verifier"],
            registry=registry,
        )
        self.rewards = prom.Histogram(
            "agentenv_reward",
            "The rewards of scored episodes, by split",
            ["split"],
            buckets=REWARD_BUCKETS,
            registry=registry,
        )
        self.forfeits = prom.Counter(
            "agentenv_forfeits",
            "Episodes scored 0, not masked, because the model's own doing "
            "ended them before a verifier scored them (its box broken, filled or made unreadable; "
            "its tests failing with fail_task_on_error set)",
            registry=registry,
        )
        self.masked = prom.Counter(
            "agentenv_masked_rollouts",
            "Rollouts answered as failed by the environment (Gym: a "
            "masked verify; OpenEnv: an error observation with its failure_kind), by wire and "
            "failure kind",
            ["wire", "kind"],
            registry=registry,
        )
        self.idle_reaps = prom.Counter(
            "agentenv_idle_reaps",
            "Sessions ended for having no request past idle_timeout, by wire",
            ["wire"],
            registry=registry,
        )
        self.teardown_failures = prom.Counter(
            "agentenv_teardown_failures",
            "Envs and boxes whose removal failed when their episode "
            "ended (after its reply: the outcome stands, and is never masked for it); each is "
            "tried again until it is gone, its episode's slot held meanwhile",
            registry=registry,
        )
        self.recent_deploys, self.recent_tool_calls = Recent(), Recent()
        self._readings: dict[str, Any] = {}
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def _of(self, metric: Any, *labels: str) -> Any:
        """The series of ``metric`` with these label values, looked up once: the library checks
        the values on every lookup, which would be half of what recording a tool call costs."""
        key = (metric, labels)
        if (child := self._children.get(key)) is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # -- recording, where things happen

    def deployed(self, env: str, sandbox: str, seconds: float, node: str = "") -> None:
        self._of(self.deploys, env, sandbox, node).inc()
        self._of(self.deploy_seconds, env, sandbox, node).observe(seconds)
        self.recent_deploys.add(seconds)

    def deploy_failed(self, env: str, sandbox: str, kind: str) -> None:
        self._of(self.deploy_failures, env, sandbox, kind).inc()

    def tool_called(self, tool: str, status: str, seconds: float | None) -> None:
        self._of(self.tool_calls, tool, status).inc()
        if seconds is not None:
            self._of(self.tool_seconds, tool).observe(seconds)
            self.recent_tool_calls.add(seconds)

    def verified(self, verifier: str, seconds: float, failed: bool) -> None:
        self._of(self.verifier_seconds, verifier).observe(seconds)
        if failed:
            self._of(self.verifier_failures, verifier).inc()

    def ended(self, outcome: str, split: str, reward: float | None) -> None:
        if split == PROBE:  # no one's episode: a deploy to list a toolset's tools
            return
        self._of(self.episodes, outcome).inc()
        if isinstance(reward, (int, float)) and math.isfinite(reward):
            self._of(self.rewards, split).observe(reward)

    def forfeited(self) -> None:
        self.forfeits.inc()

    def mask(self, wire: str, failure: Failure) -> None:
        self._of(self.masked, wire, failure.kind).inc()

    def reaped(self, wire: str) -> None:
        self._of(self.idle_reaps, wire).inc()

    def teardown_failed(self, parts: int) -> None:
        self.teardown_failures.inc(parts)

    def watch(
        self,
        name: str,
        doc: str,
        read: Callable[[], float | collections.abc.Mapping[str, float]],
        label: str | None = None,
    ) -> None:
        """A gauge read at scrape time: ``read()`` gives the value, or (with ``label``) the value
        of each label. Watching a name again replaces the reading."""
        if name in self._readings:
            self.registry.unregister(self._readings.pop(name))
        self._readings[name] = Reading(name, doc, read, label)
        self.registry.register(self._readings[name])

    # -- reading

    def page(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics in the format the scraper asks for (Accept), and its content type."""
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def totals(self, counter: Any) -> dict[tuple[str, ...], float]:
        """A counter's values by label values (from the library's public collect())."""
        return {
            tuple(s.labels.values()): s.value
            for family in counter.collect()
            for s in family.samples
            if s.name.endswith("_total")
        }

    def numbers(self) -> dict[str, Any]:
        """What the registry holds, read as a scrape reads it (so the same numbers as /metrics),
        in the shape the web page and scripts read from ``GET /web/status``: episodes by outcome
        (and the scored ones forfeited) and the levels of the pool, sessions by wire, masked
        rollouts by kind, rewards by split (count, mean, and each bucket's count), deploys and tool
        calls with their p50/p95 over
        the run (estimated from the histograms as Prometheus' histogram_quantile does), warm
        envs, and by node the envs up and deployed. A level nobody watches (a Gym server in url:
        mode has no pool) is None."""
        samples: dict[str, list[tuple[dict[str, str], float]]] = collections.defaultdict(list)
        for family in self.registry.collect():
            for sample in family.samples:
                samples[sample.name].append((sample.labels, sample.value))

        def by(name: str, key: str, zeros: bool = False) -> dict[str, int]:
            found: collections.Counter[str] = collections.Counter()
            for labels, value in samples.get(name, []):
                found[labels.get(key, "")] += int(value)
            return {k: n for k, n in found.most_common() if n or zeros}

        def level(name: str) -> int | None:
            return int(samples[name][0][1]) if samples.get(name) else None

        def timed(name: str) -> dict[str, Any]:
            buckets = _buckets(samples.get(name + "_bucket", []))
            return {"p50": bucket_quantile(0.5, buckets), "p95": bucket_quantile(0.95, buckets)}

        played = by("agentenv_episodes_total", "outcome")
        rewards = {}
        for split, count in by("agentenv_reward_count", "split").items():
            total = sum(
                v for labels, v in samples["agentenv_reward_sum"] if labels["split"] == split
            )
            cumulative = _buckets(
                [
                    (labels, v)
                    for labels, v in samples["agentenv_reward_bucket"]
                    if labels["split"] == split
                ]
            )
            rewards[split] = {
                "count": count,
                "mean": total / count,
                "buckets": [
                    [upper, int(n - below)]
                    for (_, below), (upper, n) in itertools.pairwise([(0.0, 0.0), *cumulative])
                    if math.isfinite(upper)
                ],
            }
        deployed, up = by("agentenv_deploys_total", "node"), by("agentenv_envs_live", "node")
        warm = (
            by("agentenv_warm_envs", "state", zeros=True)
            if "agentenv_warm_envs" in samples
            else None
        )
        return {
            "episodes": {
                "played": sum(played.values()),
                "scored": played.get("scored", 0),
                "forfeited": level("agentenv_forfeits_total") or 0,
                "failed": played.get("failed", 0),
                "abandoned": played.get("abandoned", 0),
                "live": level("agentenv_episodes_live"),
                "waiting": level("agentenv_episodes_waiting"),
                "limit": level("agentenv_episodes_limit"),
            },
            "sessions": by("agentenv_sessions", "wire", zeros=True),
            "masked": by("agentenv_masked_rollouts_total", "kind"),
            "rewards": rewards,
            "deploys": {
                "count": sum(deployed.values()),
                "failed": sum(by("agentenv_deploy_failures_total", "kind").values()),
                **timed("agentenv_deploy_duration_seconds"),
            },
            "tool_calls": {
                "count": sum(by("agentenv_tool_calls_total", "status").values()),
                "by_status": by("agentenv_tool_calls_total", "status"),
                **timed("agentenv_tool_call_duration_seconds"),
            },
            "warm": warm,
            "nodes": [
                {"node": node, "envs": up.get(node, 0), "deploys": deployed.get(node, 0)}
                for node in sorted(set(deployed) | set(up))
            ],
        }

    def status(self, live: int, waiting: int, limit: int, interval: float) -> str:
        """The status line: episodes played, live, waiting, masked by kind, and the deploy and
        tool-call p50/p95 of the last ``interval`` seconds (whose durations it then forgets)."""
        numbers = self.numbers()
        played = numbers["episodes"]
        outcomes = ", ".join(
            f"{played[o]:,} {o}" for o in ("scored", "failed", "abandoned") if played.get(o)
        )
        masks = ", ".join(f"{n:,} {kind}" for kind, n in numbers["masked"].items()) or "none"
        line = (
            f"Status: {_many(played['played'], 'episode')} played"
            + (f" ({outcomes})" if outcomes else "")
            + f"; {live} live of {limit}, {waiting} waiting; masked: {masks}"
        )
        timings = []
        for what, recent in (
            ("deploy", self.recent_deploys),
            ("tool call", self.recent_tool_calls),
        ):
            if taken := recent.take():
                count, p50, p95 = taken
                timings.append(f"{_many(count, what)} p50 {_seconds(p50)}, p95 {_seconds(p95)}")
        return (
            line
            + (f"; over the last {interval:g}s: " + "; ".join(timings) if timings else "")
            + "."
        )


def _buckets(samples: list[tuple[dict[str, str], float]]) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets summed over its other labels: [(upper bound, count)]."""
    summed: dict[float, float] = collections.defaultdict(float)
    for labels, value in samples:
        summed[float(labels["le"])] += value
    return sorted(summed.items())


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram from its cumulative buckets, as Prometheus'
    histogram_quantile() estimates it: linear within the bucket the rank falls in, and the
    highest finite bound when it falls past them. None when nothing was observed."""
    if not buckets or not buckets[-1][1]:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return (
                lower + (upper - lower) * (rank - below) / (count - below)
                if count > below
                else upper
            )
        lower, below = upper, count
    return lower


class Reading:
    """A gauge whose value is read from its holder at scrape time (a collector, in
    prometheus-client's terms), so a level such as the live episodes is never kept twice."""

    def __init__(
        self,
        name: str,
        doc: str,
        read: Callable[[], float | collections.abc.Mapping[str, float]],
        label: str | None,
    ):
        self.name, self.doc, self.read, self.label = name, doc, read, label

    def describe(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        return [GaugeMetricFamily(self.name, self.doc, labels=[self.label] if self.label else None)]

    def collect(self) -> list[Any]:
        (family,) = self.describe()
        value = self.read()
        for key, each in value.items() if isinstance(value, dict) else [(None, value)]:
            family.add_metric([key] if key is not None else [], each)
        return [family]


class Progress:
    """How far a long job has got (write-gym's deploys, eval's rows), told on stderr, apart from
    the job's result on stdout: on a terminal one bar rewritten in place; elsewhere (or to
    ``out``) a line for the first step, the last, and at most one every ``every`` seconds between,
    so a log gets a few lines, not a wall."""

    BAR = 24

    def __init__(
        self, what: str, total: int, out: Callable[[str], None] | None = None, every: float = 10.0
    ):
        self.what, self.total, self.every = what, total, every
        self.out = out or (lambda line: print(line, file=sys.stderr, flush=True))
        self.tty = out is None and sys.stderr.isatty()
        self.done = 0
        self._said = time.monotonic()

    def step(self, detail: str = "") -> None:
        """One more done; ``detail`` says which."""
        self.done += 1
        now = time.monotonic()
        line = f"{self.what}: {self.done}/{self.total}" + (f" ({detail})" if detail else "")
        if self.tty:
            filled = self.BAR * self.done // max(self.total, 1)
            sys.stderr.write(
                f"\r\033[K{self.what}: [{'#' * filled}{'.' * (self.BAR - filled)}] "
                f"{self.done}/{self.total} {detail}"[:200]
            )
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif self.done in (1, self.total) or now - self._said >= self.every:
            self.out(line)
            self._said = now


# ================================================================ 2. Bundle

# The step types agentenv.py runs, with the fields each takes beyond the common ones. A field in
# IGNORED_FIELDS is accepted and has no effect here (the trainer's model plays the agent, and the
# server picks the sandbox); any other field is refused, so a typo never passes silently.
COMMON_FIELDS = {"id", "type", "version", "depends_on", "fail_task_on_error"}
STEP_FIELDS: dict[str, tuple[set[str], set[str]]] = {
    # type: (required fields, optional fields)
    "deploy_env": ({"env_id"}, {"cpu", "memory_mb"}),
    "apply_server_config": ({"env_id", "directives"}, {"timeout_seconds", "tolerate_unadvertised"}),
    "deploy_agent": (
        set(),
        {
            "agent_name",
            "env_ids",
            "role",
            "system_prompt",
            "skills",
            "sandbox_name",
            "cpu",
            "memory_mb",
        },
    ),
    "prompt_agent": ({"prompt"}, {"agent_name", "prompt_id", "system_prompt", "timeout_seconds"}),
    "env_outcome_verifier": (
        {"env_id", "file_artifact_id"},
        {"verifier_id", "prompt_id", "score_aggregator"},
    ),
    "agent_prompt_response_verifier": (
        {"prompt_id", "criteria"},
        {"verifier_id", "score_aggregator"},
    ),
    # the agent's sandbox: a box of its own where it works with bash (section 3)
    "deploy_sandbox": ({"sandbox_name", "sandbox_mode"}, {"image", "cpu", "memory_mb", "env_vars"}),
    "add_skills": ({"skills"}, {"agent_name"}),
    "load_artifact": (
        set(),
        {
            "artifacts",
            "artifact_id",
            "artifact_version",
            "destination_path",
            "agent_name",
            "sandbox_name",
            "container_name",
            "env_id",
            "urls",
        },
    ),
    "run_code": (
        {"script_artifact_id"},
        {
            "script_artifact_version",
            "script_file",
            "entrypoint",
            "args",
            "result_id",
            "timeout_seconds",
            "agent_name",
            "sandbox_name",
            "env_id",
        },
    ),
    "verify_sandbox": (
        set(),
        {
            "criteria",
            "agent_name",
            "sandbox_name",
            "base_dir",
            "shell_timeout_seconds",
            "score_aggregator",
            "verifier_id",
        },
    ),
    "aggregate_verifiers": (set(), {"verifier_ids", "score_aggregator", "verifier_id"}),
    "run_docker_container": (
        {"sandbox_name"},
        {
            "docker_context_artifact_id",
            "dockerfile_path",
            "container_name",
            "env_vars",
            "command_override",
            "ready_command",
            "docker_context_url",
            "network",
            "extra_networks",
        },
    ),
    "run_container_unit_tests_verifier": (
        {"command"},
        {
            "sandbox_name",
            "container_name",
            "agent_name",
            "verifier_id",
            "setup_commands",
            "user",
            "timeout_sec",
            "env_vars",
            "result_paths",
            "reward_path",
        },
    ),
    "reset_env": ({"env_id"}, set()),
}
IGNORED_FIELDS = {
    "deploy_env": {
        "env_version",
        "ttl_seconds",
        "disk_size_gb",
        "gateway_mode",
        "sandbox_type",
        "env_state_type",
        "metadata",
    },
    # a box has no way out (no network, or an internal one of its episode), so a network policy
    # has nothing left to allow
    "deploy_agent": {
        "a2a_agent_id",
        "a2a_agent_version",
        "agent_description",
        "ttl_seconds",
        "sandbox_type",
        "env_vars",
        "disk_size_gb",
        "network_policy",
        "metadata",
        "litellm_base_url",
    },
    "prompt_agent": {"poll_interval_seconds", "model", "model_params", "max_turns"},
    # (and a box publishes no port: nothing outside reaches it)
    "deploy_sandbox": {
        "disk_size_gb",
        "ttl_seconds",
        "boot_mode",
        "sandbox_type",
        "network_policy",
        "metadata",
        "port",
        "exposed_ports",
    },
    "load_artifact": {"snapshot_after_load"},
}
# Step types AgentEnv has that an episode here can't run, with why and what to write instead.
REFUSED_TYPES = {
    "install_agent": "install_agent installs the agent from the network (its install fetches uv "
    "from GitHub), and boxes here have no network; deploy the agent with "
    "deploy_agent, whose box agentenv.py builds offline",
}
SCORE_AGGREGATORS = ("all_pass", "any_pass", "weighted_average")
CRITERION_TYPES = ("response_contains", "response_regex_present")
SANDBOX_CRITERIA = (
    "probe_file_exists",
    "probe_dir_exists",
    "probe_file_contains",
    "bash_cmd_succeeds",
)
# The steps that record a score (as AgentEnv's verifications).
SCORING_TYPES = {
    "env_outcome_verifier",
    "agent_prompt_response_verifier",
    "verify_sandbox",
    "aggregate_verifiers",
    "run_container_unit_tests_verifier",
}
# The steps that act in a box (its commands and copies).
BOX_STEPS = {
    "load_artifact",
    "run_code",
    "verify_sandbox",
    "add_skills",
    "run_container_unit_tests_verifier",
}
POSIX_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SKILL_NAME = re.compile(r"(?!-)(?!.*--)[a-z0-9-]{1,64}(?<!-)")
DEFAULT_AGENT = "default-agent"
# Environment variables a seed never sets for a unit-test verifier: those its shell relies on.
RESERVED_ENV = {
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "PWD",
    "OLDPWD",
    "HOSTNAME",
    "TERM",
    "LANG",
    "LC_ALL",
    "SHLVL",
    "IFS",
    "PS4",
    "BASH_ENV",
    "ENV",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "PYTHONHOME",
    "AGENTENV_CALL",
}
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

    @property
    def limits(self) -> dict[str, Any]:
        """A deploy_env step's limits (cpu, memory_mb) as the sandbox takes them."""
        return {k: self.fields[k] for k in ("cpu", "memory_mb") if self.fields.get(k)}


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """An env of the bundle: its build context, its image's command, and how it names itself."""

    name: str
    folder: Path
    dockerfile: Path
    environment_name: str
    command: tuple[str, ...]  # the image's ENTRYPOINT + CMD, as a local process runs it
    image_env: dict[str, str]  # the image's ENV lines
    digest: str  # a hash of the build context: one image per content
    network: str = "isolated"  # "isolated" (no egress, no other env) or "bridge" (env.toml)


@dataclasses.dataclass(frozen=True)
class Toolset:
    """The envs whose tools a task's turns offer. Tasks that deploy the same envs share one."""

    envs: tuple[str, ...]
    bash: bool = False  # the turns offer bash first, in the agent's box

    @property
    def name(self) -> str:
        parts = ("bash",) * self.bash + self.envs
        return "+".join(parts) if parts else "(no env)"


@dataclasses.dataclass(frozen=True)
class Task:
    """A task of the bundle, checked: its steps, the agent played from outside, its toolset."""

    id: str
    name: str
    steps: tuple[Step, ...]
    agent: str  # the played agent's name
    toolset: Toolset
    reward_step: str  # the scoring step whose score is the reward
    sandboxed: bool = False  # the agent works in a box of its own, with bash

    @property
    def file(self) -> str:
        return f"{self.name}.json"

    @property
    def scoring_steps(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.steps if s.type in SCORING_TYPES)

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

        steps = tuple(
            dataclasses.replace(s, fields=fill(copy.deepcopy(s.fields))) for s in self.steps
        )
        return dataclasses.replace(self, steps=steps)


class Bundle:
    """A loaded bundle: its envs, artifacts, tasks and splits. Loading checks everything at once.

    ``Bundle.load(folder, reward=None)`` raises BundleError listing every problem, each naming the
    file and the step and saying what to do, so that a bundle that loads is one that will play.
    """

    def __init__(
        self,
        root: Path,
        name: str,
        description: str,
        envs: dict[str, EnvSpec],
        verifiers: dict[str, Path],
        tasks: dict[str, Task],
        splits: dict[str, list[Task]],
        artifacts: dict[str, Path] | None = None,
        skills: dict[str, Path] | None = None,
    ):
        self.root, self.name, self.description = root, name, description
        self.envs, self.verifiers, self.tasks, self.splits = envs, verifiers, tasks, splits
        self.artifacts = artifacts or {}  # every artifact's folder, by name (load_artifact ...)
        self.skills = skills or {}  # skills/<name>/, each holding a SKILL.md

    @property
    def boxed(self) -> bool:
        """Whether some task runs a box (the agent's sandbox, or a deploy_sandbox)."""
        return any(
            t.sandboxed or any(s.type == "deploy_sandbox" for s in t.steps)
            for t in self.tasks.values()
        )

    @property
    def toolsets(self) -> dict[Toolset, list[Task]]:
        found: dict[Toolset, list[Task]] = {}
        for task in self.splits["all"]:
            found.setdefault(task.toolset, []).append(task)
        return found

    def task(self, split: Any, index: Any) -> Task:
        """The task at ``index`` of ``split`` (as a client sent them: checked here); a LookupError
        that lists what exists otherwise."""
        if not isinstance(split, str) or split not in self.splits:
            raise LookupError(
                f"there is no split {split!r}; the splits are {', '.join(self.splits)}"
            )
        tasks = self.splits[split]
        if not isinstance(index, int) or isinstance(index, bool):
            raise LookupError(
                f"index {index!r} is not a whole number; give the task's place in its "
                f"split as one, from 0 to {len(tasks) - 1}"
            )
        if not 0 <= index < len(tasks):
            raise LookupError(
                f"split {split!r} has {len(tasks)} tasks, so it has no task {index!r}; "
                f"give an index from 0 to {len(tasks) - 1}"
            )
        return tasks[index]

    @classmethod
    def of_splits(cls, bundles: dict[str, Bundle]) -> Bundle:
        """Several bundles served as one, each one's tasks a split of it (a train bundle and a
        held-out one), with the split 'all' of every task. Envs and verifiers are shared by name,
        so two bundles with different contents under one name are refused, saying which."""
        problems: list[str] = []
        # by name: each env's EnvSpec, each verifier's folder (Any: one loop below checks both)
        envs: dict[str, Any] = {}
        verifiers: dict[str, Any] = {}
        owners: dict[str, str] = {}
        splits: dict[str, list[Task]] = {}
        for split, bundle in bundles.items():
            for kind, mine, theirs, same in (
                ("envs", bundle.envs, envs, lambda a, b: a.digest == b.digest),
                (
                    "artifacts",
                    bundle.verifiers,
                    verifiers,
                    lambda a, b: _digest(a.parent) == _digest(b.parent),
                ),
            ):
                for name, part in mine.items():
                    if name in theirs and not same(theirs[name], part):
                        problems.append(
                            f"{kind}/{name}: the bundles of the splits {owners[kind + name]!r} "
                            f"and {split!r} both have one of that name, with other "
                            "contents; rename it in one of them"
                        )
                    theirs.setdefault(name, part)
                    owners.setdefault(kind + name, split)
            splits[split] = bundle.splits["all"]
        if problems:
            raise BundleError(problems)
        every = list({t.id: t for tasks in splits.values() for t in tasks}.values())
        first = next(iter(bundles.values()))
        name = "+".join(dict.fromkeys(b.name for b in bundles.values()))
        return cls(
            first.root,
            name,
            first.description,
            envs,
            verifiers,
            {t.id: t for t in every},
            {"all": every, **splits},
        )

    @classmethod
    def load(cls, folder: str | os.PathLike, reward: str | None = None) -> Bundle:
        # Loading keeps tens of thousands of dicts and lists (2,000+ tasks), none of them in a
        # cycle: the cyclic collector would only walk them again and again as they pile up, at
        # ~15% of the load's time.
        with gc_paused():
            return cls._load(folder, reward)

    @classmethod
    def _load(cls, folder: str | os.PathLike, reward: str | None) -> Bundle:
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise BundleError(
                [
                    f"{folder}: there is no bundle folder here; pass the folder that holds "
                    "envs/, tasks/ and evals/"
                ]
            )
        root = root.resolve()
        problems: list[str] = []
        for stray in ("bundle.toml",):
            if (root / stray).exists():
                problems.append(
                    f"{stray}: reserved: a bundle takes its name from the folder and its "
                    "description from README.md; remove it"
                )
        if (root / "agents").is_dir():
            problems.append(
                "agents/: agentenv.py plays the agent from outside and runs no "
                "agents; remove the folder, or run this bundle with agent-env itself"
            )
        envs = _load_envs(root, problems)
        broken: dict[str, str] = {}
        verifiers = _load_verifiers(root, broken)
        artifacts = _load_artifacts(root)
        skills = _load_skills(root, problems)
        shelf = Shelf(envs, verifiers, broken, artifacts, skills)
        id_root = task_id_root(root)
        tasks: dict[str, Task] = {}
        task_dir = root / "tasks"
        if not task_dir.is_dir():
            problems.append("tasks/: the bundle has no tasks folder; add tasks/<name>.json")
        else:
            with os.scandir(task_dir) as listing:  # one pass, types included: 2,000+ tasks
                entries = sorted(listing, key=lambda e: e.name)
            texts: dict[str, str] = {}  # the tasks' strings, each kept once
            for entry in entries:
                if entry.name.startswith(".") or entry.name == "__pycache__":
                    continue
                if entry.is_dir():
                    problems.append(
                        f"tasks/{entry.name}/: task folders are not supported; "
                        f"write tasks/{entry.name}.json"
                    )
                elif not entry.name.endswith(".json"):
                    problems.append(
                        f"tasks/{entry.name}: a task is a .json file; rename or remove it"
                    )
                else:
                    # strings, not a Path per file: a Path, its name and its stem cost ~3 us
                    name = entry.name.removesuffix(".json")
                    task = _load_task(
                        entry.path, name, f"{id_root}/{name}", shelf, reward, problems, texts
                    )
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
        return cls(root, root.name, description, envs, verifiers, tasks, splits, artifacts, skills)


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
    """AgentEnv's id root for a folder bundle: ``@local/<absolute path>``, ``~`` for the home
    folder."""
    with contextlib.suppress(ValueError, RuntimeError):
        return "@local/~/" + root.relative_to(Path.home().resolve()).as_posix()
    return "@local/" + "/".join(root.parts[1:])


def _toml(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        problems.append(
            f"{path.parent.name}/{path.name}: is not valid TOML ({exc}); fix the syntax"
        )
        return None


def plain_name(name: Any) -> bool:
    """Whether ``name`` can name a file in a folder without reaching out of it."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )


# An env's network in the Docker sandbox, as its env.toml's ``network`` names it.
ENV_NETWORKS = ("isolated", "bridge")


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
        known = {"type", "id", "image", "environment_name", "env_provider_type", "network"}
        for key in sorted(set(config) - known):
            problems.append(
                f"{where}/env.toml: key {key!r} is not one agentenv.py knows; "
                f"it knows {', '.join(sorted(known))}"
            )
        if config.get("type", "mcp_server") != "mcp_server":
            problems.append(
                f"{where}/env.toml: type {config['type']!r} is not run here; agentenv.py "
                "runs mcp_server envs (an MCP server in a Docker build context)"
            )
        image = config.get("image", {})
        dockerfile = folder / "Dockerfile"
        if isinstance(image, dict) and set(image) <= {"dockerfile"}:
            given = image.get("dockerfile", "Dockerfile")
            dockerfile = folder / str(given)
            if (
                not isinstance(given, str)
                or Path(given).is_absolute()
                or not dockerfile.resolve().is_relative_to(folder.resolve())
            ):
                problems.append(
                    f"{where}/env.toml: dockerfile = {given!r} is not a file of the env's "
                    "folder, its Docker build context; name one inside it"
                )
                continue
        else:
            problems.append(
                f"{where}/env.toml: image = {image!r} is not supported; agentenv.py builds "
                'each env from a Dockerfile in its folder (image = {dockerfile = "..."})'
            )
        if not dockerfile.is_file():
            problems.append(
                f"{where}: has no {dockerfile.name}; an env is a Docker build context, so "
                f"add {where}/{dockerfile.name} with the command that starts the MCP server"
            )
            continue
        try:
            command, image_env = parse_dockerfile(dockerfile.read_text())
        except ValueError as exc:
            problems.append(f"{where}/{dockerfile.name}: {exc}")
            continue
        name = config.get("environment_name") or folder.name
        if not plain_name(name):
            problems.append(
                f"{where}/env.toml: environment_name = {name!r} is not a plain name (it "
                "names the env's database file, so no '/' or '\\'); give a plain name"
            )
            continue
        network = config.get("network", "isolated")
        if network not in ENV_NETWORKS:
            problems.append(
                f"{where}/env.toml: network = {network!r} is not a network mode; use "
                '"isolated" (the default: no egress, no other episode\'s containers) or '
                '"bridge" (Docker\'s ordinary bridge, for a task that needs the network)'
            )
            continue
        envs[folder.name] = EnvSpec(
            folder.name, folder, dockerfile, str(name), command, image_env, _digest(folder), network
        )
    return envs


def parse_dockerfile(text: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The command an image runs (ENTRYPOINT then CMD) and its ENV, read from a Dockerfile."""
    text = re.sub(r"\\\r?\n", " ", text)
    entrypoint: list[str] = []
    cmd: list[str] = []
    cmd_set = False  # whether this stage wrote its own CMD
    env: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":  # a new stage: only the last one's settings count
            entrypoint, cmd, cmd_set, env = [], [], False, {}
        elif word in ("CMD", "ENTRYPOINT"):
            if rest.startswith("["):
                try:
                    argv = json.loads(rest)
                except json.JSONDecodeError:
                    raise ValueError(
                        f'{word} {rest} is not valid JSON; write {word} ["prog", "arg"]'
                    ) from None
            else:
                argv = ["/bin/sh", "-c", rest]
            if word == "CMD":
                cmd, cmd_set = argv, True
            else:
                entrypoint = argv  # Docker drops an inherited CMD here, not the stage's own
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
        raise ValueError(
            'has no CMD or ENTRYPOINT; add CMD ["python", "server.py"] (the command '
            "that starts the env's MCP server)"
        )
    return command, env


def _digest(folder: Path) -> str:
    """A hash of a build context's files, so an image is built once per content."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
            digest.update(rel.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _load_verifiers(root: Path, problems: dict[str, str]) -> dict[str, Path]:
    """Each artifact that holds verifier code: its Python file, checked (not run) for ``verify``.
    An artifact whose Python isn't a verifier has its problem kept by name (``problems``): it is
    one only for a step that names it as a verifier (a run_code script is Python too)."""
    found: dict[str, Path] = {}
    art_dir = root / "artifacts"
    if not art_dir.is_dir():
        return found
    for folder in sorted(art_dir.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        py = [p for p in folder.glob("*.py")]
        path = (
            folder / "verify.py"
            if (folder / "verify.py").is_file()
            else (py[0] if len(py) == 1 else None)
        )
        if path is None:
            continue  # an artifact of data files; only a verifier step naming it needs Python
        where = f"artifacts/{folder.name}/{path.name}"
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (SyntaxError, UnicodeDecodeError) as exc:
            problems[folder.name] = f"{where}: does not parse ({exc}); fix it"
            continue
        verify = next(
            (
                n
                for n in tree.body
                if isinstance(n, (ast.AsyncFunctionDef, ast.FunctionDef)) and n.name == "verify"
            ),
            None,
        )
        if not isinstance(verify, ast.AsyncFunctionDef):
            problems[folder.name] = (
                f"{where}: has no `async def verify(mcp_url)`; an "
                "env_outcome_verifier's artifact defines it and returns a "
                "list of {id, result, description} rows"
            )
            continue
        args = verify.args
        positional = args.posonlyargs + args.args
        if len(positional) - len(args.defaults) != 1 or any(d is None for d in args.kw_defaults):
            problems[folder.name] = (
                f"{where}: verify must take exactly one argument without a "
                "default (the env's MCP URL); agentenv.py calls verify(mcp_url)"
            )
            continue
        found[folder.name] = path
    return found


def _load_artifacts(root: Path) -> dict[str, Path]:
    """Every artifact's folder by name: what load_artifact, run_code and run_docker_container
    use."""
    art_dir = root / "artifacts"
    return (
        {
            f.name: f
            for f in sorted(art_dir.iterdir())
            if f.is_dir() and not f.name.startswith(".") and f.name != "__pycache__"
        }
        if art_dir.is_dir()
        else {}
    )


def artifact_files(folder: Path) -> dict[str, Path]:
    """An artifact's files by their path inside it (its artifact.toml and hidden files left out)."""
    return {
        p.relative_to(folder).as_posix(): p
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and p.name != "artifact.toml"
        and not any(
            part.startswith(".") or part == "__pycache__" for part in p.relative_to(folder).parts
        )
    }


def artifact_bytes(folder: Path) -> dict[str, bytes]:
    """An artifact's files as artifact_files finds them, read (blocking: call it in a thread)."""
    return {rel: path.read_bytes() for rel, path in artifact_files(folder).items()}


def _load_skills(root: Path, problems: list[str]) -> dict[str, Path]:
    """skills/<name>/SKILL.md: a skill add_skills (skill_artifact_id) gives the agent's box."""
    found: dict[str, Path] = {}
    skill_dir = root / "skills"
    for folder in sorted(skill_dir.iterdir()) if skill_dir.is_dir() else []:
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        if not (folder / "SKILL.md").is_file():
            problems.append(
                f"skills/{folder.name}/: has no SKILL.md; a skill is a folder with its "
                "SKILL.md (a --- name/description --- header, then its text)"
            )
        else:
            found[folder.name] = folder
    return found


@dataclasses.dataclass(frozen=True)
class Shelf:
    """What a bundle holds that its tasks' steps name: envs, verifiers (and artifacts that aren't
    verifiers, with why), artifacts and skills."""

    envs: dict[str, EnvSpec]
    verifiers: dict[str, Path]
    broken: dict[str, str]
    artifacts: dict[str, Path]
    skills: dict[str, Path]


def shared(value: Any, texts: dict[str, str]) -> Any:
    """A parsed JSON ``value`` with each of its strings replaced by the equal one ``texts`` holds
    (added there when new). A bundle's tasks repeat their prompts, names and keys, and each file
    parsed makes them anew: gridsim-v1's 2,200 tasks hold 12.7 MiB of strings, 1.7 of them
    different, for as long as the server lives."""
    if isinstance(value, str):
        return texts.setdefault(value, value)
    if isinstance(value, list):
        return [shared(v, texts) for v in value]
    if isinstance(value, dict):
        return {texts.setdefault(k, k): shared(v, texts) for k, v in value.items()}
    return value


def _load_task(
    path: str,
    name: str,
    task_id: str,
    shelf: Shelf,
    reward: str | None,
    problems: list[str],
    texts: dict[str, str],
) -> Task | None:
    """Load and check the task ``name``, the file ``path`` (tasks/<name>.json), its strings
    shared with the bundle's other tasks through ``texts``."""
    where = f"tasks/{name}.json"
    try:
        raw = shared(json.loads(read_bytes(path)), texts)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problems.append(
            f"{where}: is not valid JSON ({exc}); a task is a JSON array of step objects"
        )
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
    return _check_task(name, task_id, steps, shelf, reward, problems)


# What a step of each type may hold, worked out once rather than for each of a bundle's thousands
# of steps. type: (required fields, every field it accepts, its fields as a message lists them)
STEP_RULES: dict[str, tuple[set[str], set[str], str]] = {
    stype: (
        required,
        required | optional | IGNORED_FIELDS.get(stype, set()) | COMMON_FIELDS,
        ", ".join(sorted(required | optional)),
    )
    for stype, (required, optional) in STEP_FIELDS.items()
}
# The fields of a step that must be text, and those that must be positive numbers.
TEXT_FIELDS = {
    "prompt",
    "system_prompt",
    "prompt_id",
    "agent_name",
    "role",
    "env_id",
    "file_artifact_id",
    "verifier_id",
    "sandbox_name",
    "sandbox_mode",
    "image",
    "container_name",
    "destination_path",
    "artifact_id",
    "script_artifact_id",
    "script_file",
    "entrypoint",
    "result_id",
    "base_dir",
    "command",
    "user",
    "reward_path",
    "docker_context_artifact_id",
    "dockerfile_path",
    "ready_command",
    "network",
}
POSITIVE_FIELDS = {"timeout_seconds", "cpu", "memory_mb", "shell_timeout_seconds", "timeout_sec"}
TEXT_LISTS = {"setup_commands", "result_paths", "verifier_ids", "extra_networks"}


def _shell_words(text: str) -> list[str] | None:
    """``text`` split into words as a shell splits them (a command_override given as text); None
    when it can't be (an unclosed quote)."""
    try:
        return shlex.split(text)
    except ValueError:
        return None


def _load_step(
    item: Any, n: int, where: str, task: str, seen: set[str], problems: list[str]
) -> Step | None:
    if not isinstance(item, dict):
        problems.append(f"{where}: step #{n} is not a JSON object")
        return None
    sid, stype = item.get("id"), item.get("type")
    if not isinstance(sid, str) or not sid:
        problems.append(f'{where}: step #{n} has no id; give every step a unique "id"')
        return None
    at = f"{where}: task {task!r} step {sid!r}"
    if sid in seen:
        problems.append(f"{at}: the id is used twice; step ids are unique within a task")
        return None
    if isinstance(stype, str) and stype in REFUSED_TYPES:
        problems.append(f"{at} ({stype}): {REFUSED_TYPES[stype]}")
        return None
    if not isinstance(stype, str) or stype not in STEP_RULES:
        problems.append(
            f"{at} has type {stype!r}, which agentenv.py does not run; it runs: "
            f"{', '.join(STEP_FIELDS)}. Rewrite the step with those, or run this task "
            "with agent-env itself"
        )
        return None
    required, accepted, takes = STEP_RULES[stype]
    for key in sorted(required.difference(item)):
        problems.append(f"{at} ({stype}) lacks the field {key!r}; add it")
    if not accepted.issuperset(item):  # asked first: the set of the rest costs more to make
        for key in sorted(set(item) - accepted):
            problems.append(
                f"{at} ({stype}) has the field {key!r}, which agentenv.py does not "
                f"support; a {stype} step takes {takes}"
            )
    if "retry_config" in item:
        problems.append(f"{at}: retry_config can replay a turn played from outside; remove it")
    deps = item.get("depends_on")
    if deps is None:
        deps = sorted(seen)  # AgentEnv's rule: no depends_on means every step before this one
    elif not (isinstance(deps, list) and all(isinstance(d, str) for d in deps)):
        problems.append(f"{at}: depends_on must be a list of earlier step ids")
        deps = []
    for dep in deps:
        if dep not in seen:
            problems.append(
                f"{at}: depends_on names {dep!r}, which is not an earlier step of the task"
            )
    fail = item.get("fail_task_on_error", stype != "reset_env")  # AgentEnv's defaults
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
        elif key in TEXT_LISTS and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            problems.append(f"{at}: {key} must be a list of strings")
        elif key == "command_override" and not (
            isinstance(value, str)
            and _shell_words(value)
            or isinstance(value, list)
            and value
            and all(isinstance(v, str) for v in value)
        ):
            problems.append(
                f"{at}: command_override must be the command as text (AgentEnv's: "
                "'sleep infinity', split as a shell splits it) or a list of strings"
            )
        elif key in ("env_vars", "args") and not (
            isinstance(value, dict)
            and all(isinstance(v, (str, int, float, bool)) or key == "args" for v in value.values())
        ):
            problems.append(
                f"{at}: {key} must be an object" + (" of strings" * (key == "env_vars"))
            )
        elif key in POSITIVE_FIELDS and (
            not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0
        ):
            problems.append(f"{at}: {key} must be a positive number")
    return Step(sid, stype, tuple(deps), fail is not False, fields)


# What a step uses, by its kind, as a message names it.
USED = {"env": "env", "agent": "agent", "prompt": "the reply to prompt", "sandbox": "sandbox"}


def works_in_sandbox(steps: list[Step], agent: str) -> bool:
    """AgentEnv's rule for when the played agent works in a box of its own (and its turns offer
    bash): some step puts something in its box, checks it, or gives it skills."""
    for step in steps:
        named = step.get("agent_name")
        if step.type in ("run_code", "add_skills", "verify_sandbox") and not step.get(
            "sandbox_name"
        ):
            named = named or DEFAULT_AGENT
        if named != agent:
            continue
        if step.type in (
            "load_artifact",
            "run_code",
            "add_skills",
            "verify_sandbox",
            "run_container_unit_tests_verifier",
        ) or (step.type == "deploy_agent" and step.get("skills")):
            return True
    return False


class TaskCheck:
    """How one task's steps refer to each other and to what the bundle holds: one method per step
    type (CHECKS, below), each adding a problem per thing wrong, naming the step and the fix."""

    def __init__(self, name: str, task_id: str, shelf: Shelf, problems: list[str]):
        self.name, self.task_id, self.shelf, self.problems = name, task_id, shelf, problems
        self.at = f"tasks/{name}.json: task {name!r}"
        self.deployed: dict[str, str] = {}  # env_id as written -> env folder name
        self.agents: dict[str, Step] = {}
        self.sandboxes: dict[str, Step] = {}  # deploy_sandbox steps by sandbox_name
        self.containers: set[tuple[str, str]] = (
            set()
        )  # (sandbox, container) run_docker_container runs
        self.prompt_ids: set[str] = set()
        self.verifier_ids: set[str] = set()
        self.made_by: dict[tuple[str, str], str] = {}  # (kind, name) -> the step that makes it
        self.last_turn: str | None = None
        self.ancestors: dict[str, set[str]] = {}

    def problem(self, step: Step, text: str) -> None:
        self.problems.append(f"{self.at} step {step.id!r}: {text}")

    def needs(self, step: Step, kind: str, thing: Any) -> None:
        # A step may use only what a step it waits for (directly or not) has made. (Its message's
        # words made only for a problem: a bundle has 10,000+ steps.)
        maker = self.made_by.get((kind, thing))
        if maker is not None and maker not in self.ancestors[step.id]:
            self.problem(
                step,
                f"uses {USED[kind]} {thing!r}, made by step {maker!r}, without "
                f"waiting for it; add {maker!r} to its depends_on",
            )

    def check(self, steps: list[Step]) -> None:
        for step in steps:
            self.ancestors[step.id] = waits_for = set(step.depends_on)  # directly or not
            for dep in step.depends_on:
                waits_for |= self.ancestors[dep]
            self.CHECKS[step.type](self, step)
            if step.type in SCORING_TYPES:
                agg = step.get(
                    "score_aggregator",
                    "weighted_average" if step.type == "aggregate_verifiers" else "all_pass",
                )
                if agg not in SCORE_AGGREGATORS:
                    self.problem(
                        step,
                        f"score_aggregator {agg!r} is not one of {', '.join(SCORE_AGGREGATORS)}",
                    )
                default = step.id if step.type != "verify_sandbox" else None
                if step.get("verifier_id", default):
                    self.verifier_ids.add(step.get("verifier_id", default))

    # -- what a step uses

    def env(self, step: Step) -> None:
        if step.get("env_id") not in self.deployed:
            self.problem(
                step,
                f"env_id {step.get('env_id')!r} is not deployed by an earlier "
                "deploy_env step of the task",
            )
        self.needs(step, "env", step.get("env_id"))

    def agent(self, step: Step, default: str | None = DEFAULT_AGENT) -> None:
        agent = step.get("agent_name", default)
        if agent not in self.agents:
            self.problem(step, f"names agent {agent!r}, which no earlier deploy_agent step deploys")
        self.needs(step, "agent", agent)

    def sandbox(self, step: Step, mode: str | None = None) -> None:
        name = step.get("sandbox_name")
        made = self.sandboxes.get(name)
        if made is None:
            self.problem(
                step,
                f"sandbox_name {name!r} is not deployed by an earlier deploy_sandbox "
                "step of the task",
            )
        elif mode and made.get("sandbox_mode") != mode:
            self.problem(
                step,
                f"sandbox {name!r} is in {made.get('sandbox_mode')} mode; this step "
                f"needs one in {mode} mode",
            )
        self.needs(step, "sandbox", name)

    def box(self, step: Step, default_agent: str | None = DEFAULT_AGENT) -> None:
        """A step acting in a box: the agent's (agent_name), a deploy_sandbox's, or where a
        deployed env runs (env_id); one of them."""
        named = [k for k in ("env_id", "sandbox_name", "agent_name") if step.get(k)]
        if len(named) > 1:
            self.problem(
                step,
                f"{step.type}: set at most one of `env_id`, `sandbox_name` and "
                f"`agent_name`; got {named}",
            )
        elif step.get("env_id"):
            self.env(step)
        elif step.get("sandbox_name"):
            self.sandbox(step)
        else:
            self.agent(step, default_agent)

    def artifact(self, step: Step, key: str, name: Any) -> Path | None:
        folder = self.shelf.artifacts.get(name) if isinstance(name, str) else None
        if folder is None:
            self.problem(
                step,
                f"{key} {name!r} names no artifact of the bundle; add "
                f"artifacts/{name}/ with its files",
            )
        return folder

    def skills(self, step: Step, skills: Any) -> None:
        if not isinstance(skills, list):
            self.problem(step, "skills must be a list of skill objects")
            return
        for n, skill in enumerate(skills):
            where = f"skill #{n}"
            if not isinstance(skill, dict):
                self.problem(step, f"{where} must be an object")
                continue
            if skill.get("object_url") or skill.get("s3_url") or skill.get("skill_s3_url"):
                self.problem(
                    step,
                    f"{where} is fetched from a URL, and boxes here have no network; "
                    "put it in skills/<name>/SKILL.md and name it with "
                    "skill_artifact_id",
                )
            elif "skill_artifact_id" in skill:
                if skill["skill_artifact_id"] not in self.shelf.skills:
                    self.problem(
                        step,
                        f"{where}: skill_artifact_id {skill['skill_artifact_id']!r} "
                        "names no skill of the bundle; add skills/<name>/SKILL.md",
                    )
                if extra := sorted(
                    set(skill)
                    & {
                        "body",
                        "license",
                        "compatibility",
                        "metadata",
                        "allowed_tools",
                        "skill_md",
                        "content",
                    }
                ):
                    self.problem(
                        step,
                        f"{where}: a skill with skill_artifact_id must not have {'/'.join(extra)}",
                    )
            else:
                body = skill.get("body", skill.get("skill_md", skill.get("content")))
                name = skill.get("name")
                if not isinstance(body, str):
                    self.problem(
                        step, f"{where} names no source; set body (its text) or skill_artifact_id"
                    )
                elif not isinstance(name, str) or not SKILL_NAME.fullmatch(name):
                    self.problem(
                        step, f"{where}: name {name!r} must be 1-64 of a-z, 0-9 and single hyphens"
                    )
                elif (
                    not isinstance(skill.get("description"), str)
                    or not 0 < len(skill["description"]) <= 1024
                ):
                    self.problem(step, f"{where}: description must be text of 1 to 1024 characters")

    # -- the checks, one per step type

    def _deploy_env(self, step: Step) -> None:
        env_id = step.get("env_id")
        env = _resolve_env(env_id, self.shelf.envs, self.task_id)
        if env is None:
            self.problem(
                step,
                f"env_id {env_id!r} names no env of the bundle; it has "
                f"{', '.join(self.shelf.envs) or 'none'} (add envs/{env_id}/)",
            )
        elif env_id in self.deployed:
            self.problem(step, f"deploys {env_id!r} a second time; deploy each env once")
        else:
            self.deployed[env_id] = env
            self.made_by[("env", env_id)] = step.id

    def _apply_server_config(self, step: Step) -> None:
        self.env(step)
        _check_directives(step, f"{self.at} step {step.id!r}", self.problems)

    def _deploy_agent(self, step: Step) -> None:
        agent = step.get("agent_name", DEFAULT_AGENT)
        if agent in self.agents:
            self.problem(step, f"deploys agent {agent!r} a second time")
        self.agents[agent] = step
        self.made_by[("agent", agent)] = step.id
        env_ids = step.get("env_ids", [])
        if not isinstance(env_ids, list) or not all(isinstance(e, str) for e in env_ids):
            self.problem(step, "env_ids must be a list of env ids")
        else:
            for env_id in env_ids:
                if env_id not in self.deployed:
                    self.problem(
                        step,
                        f"env_ids names {env_id!r}, which no earlier deploy_env step "
                        "of the task deploys",
                    )
                self.needs(step, "env", env_id)
        if "skills" in step.fields:
            self.skills(step, step.get("skills"))
        if step.get("sandbox_name"):
            self.sandbox(step)  # its mode matters only where the agent works there (below)

    def placed(self, agent: Step) -> None:
        """An agent that works in a box, placed on a sandbox (deploy_agent's sandbox_name): as
        AgentEnv, only on a VM-mode one that exposes the port it reaches an agent on."""
        name = agent.get("sandbox_name")
        made = self.sandboxes.get(name)
        if made is None:
            return
        if made.get("sandbox_mode") != "vm":
            self.problem(
                agent,
                f"Cannot link agent to sandbox {name!r} "
                f"(mode={made.get('sandbox_mode')!r}); only VM-mode sandboxes can "
                "host an additional agent container",
            )
        elif 8000 not in (ports if isinstance(ports := made.get("exposed_ports"), list) else []):
            self.problem(
                agent,
                f"Sandbox {name!r} does not expose port 8000; re-deploy it with "
                "exposed_ports=[8000] (AgentEnv reaches an agent placed on a "
                "sandbox there; agentenv.py publishes nothing, but keeps the task "
                "as AgentEnv runs it)",
            )

    def _prompt_agent(self, step: Step) -> None:
        agent = step.get("agent_name", DEFAULT_AGENT)
        if agent not in self.agents:
            self.problem(
                step, f"prompts agent {agent!r}, which no earlier deploy_agent step deploys"
            )
        self.needs(step, "agent", agent)
        if not isinstance(step.get("prompt"), str) or not step.get("prompt").strip():
            self.problem(step, "prompt must be non-empty text")
        if step.get("prompt_id"):
            self.prompt_ids.add(step.get("prompt_id"))
            self.made_by[("prompt", step.get("prompt_id"))] = step.id
        if self.last_turn is not None and self.last_turn not in self.ancestors[step.id]:
            self.problem(
                step,
                f"may open while turn {self.last_turn!r} is still open; the agent "
                f"plays one turn at a time, so add {self.last_turn!r} to its depends_on",
            )
        self.last_turn = step.id

    def _env_outcome_verifier(self, step: Step) -> None:
        self.env(step)
        artifact = step.get("file_artifact_id")
        if artifact in self.shelf.broken:
            self.problems.append(self.shelf.broken[artifact])
        if artifact not in self.shelf.verifiers:
            self.problem(
                step,
                f"file_artifact_id {artifact!r} names no verifier artifact; add "
                f"artifacts/{artifact}/verify.py with `async def verify(mcp_url)`",
            )

    def _agent_prompt_response_verifier(self, step: Step) -> None:
        if step.get("prompt_id") not in self.prompt_ids:
            self.problem(
                step,
                f"prompt_id {step.get('prompt_id')!r} names no earlier prompt_agent "
                "step; give that step the same prompt_id",
            )
        self.needs(step, "prompt", step.get("prompt_id"))
        _check_criteria(step, f"{self.at} step {step.id!r}", self.problems)

    def _deploy_sandbox(self, step: Step) -> None:
        name, mode = step.get("sandbox_name"), step.get("sandbox_mode")
        if mode not in ("container", "vm"):
            self.problem(step, f"sandbox_mode must be one of ['container', 'vm'], got {mode!r}")
        elif mode == "container" and not step.get("image"):
            self.problem(
                step,
                "a container-mode sandbox runs an image: set image (one this "
                "machine's Docker holds; nothing is pulled)",
            )
        if name in self.sandboxes:
            self.problem(
                step,
                f"sandbox {name!r} is already deployed by step "
                f"{self.made_by[('sandbox', name)]!r}; give each sandbox its own name",
            )
        self.sandboxes[name] = step
        self.made_by[("sandbox", name)] = step.id

    def _add_skills(self, step: Step) -> None:
        self.agent(step)
        self.skills(step, step.get("skills"))

    def _load_artifact(self, step: Step) -> None:
        if step.get("urls"):
            self.problem(
                step,
                "urls are downloads, and agentenv.py runs without network; put the "
                "files in artifacts/<name>/ and load them with artifact_id",
            )
        targets = [k for k in ("agent_name", "sandbox_name", "env_id") if step.get(k)]
        if len(targets) != 1:
            self.problem(
                step,
                "names where to load: set agent_name (the agent's box), "
                "sandbox_name (a deploy_sandbox box, and container_name for a "
                "container it runs) or env_id (a deployed env), one of them",
            )
        elif step.get("container_name") and not step.get("sandbox_name"):
            self.problem(
                step,
                "`container_name` requires `sandbox_name`: the sandbox whose "
                "run_docker_container step runs it",
            )
        else:
            self.box(step, None)
        if step.get("container_name"):
            where = (step.get("sandbox_name"), step.get("container_name"))
            if where not in self.containers:
                self.problem(
                    step,
                    f"Container {where[1]!r} not found on sandbox {where[0]!r}: no "
                    "earlier run_docker_container step runs it",
                )
        listed = step.get("artifacts")
        names = (
            [a.get("id") if isinstance(a, dict) else None for a in listed]
            if isinstance(listed, list)
            else None
        )
        if listed is not None and names is None:
            self.problem(step, "artifacts must be a list of {id, version}")
        elif not names and not step.get("artifact_id") and not step.get("urls"):
            self.problem(step, "names nothing to load; set artifact_id, or artifacts: [{id}]")
        for name in names or ([step.get("artifact_id")] if step.get("artifact_id") else []):
            self.artifact(step, "artifact", name)

    def _run_code(self, step: Step) -> None:
        self.box(step)
        folder = self.artifact(step, "script_artifact_id", step.get("script_artifact_id"))
        if folder is None:
            return
        scripts = [n for n in artifact_files(folder) if n.endswith(".py") and "/" not in n]
        entry = step.get("script_file") or (scripts[0] if len(scripts) == 1 else "run.py")
        if entry not in scripts:
            self.problem(
                step,
                f"script {entry!r} is not a .py file at the top of "
                f"artifacts/{folder.name}/ (it has {scripts}); set script_file",
            )
        if not isinstance(step.get("entrypoint", "run"), str):
            self.problem(step, "entrypoint must be the name of the function to call")

    def _verify_sandbox(self, step: Step) -> None:
        if step.get("sandbox_name"):
            if step.get("agent_name") not in (None, DEFAULT_AGENT):
                self.problem(
                    step, "verify_sandbox: set either `agent_name` or `sandbox_name`, not both"
                )
            self.sandbox(step)
        else:
            self.agent(step)
        criteria = step.get("criteria", [])
        if not isinstance(criteria, list) or not all(isinstance(c, dict) for c in criteria):
            self.problem(step, "criteria must be a list of criterion objects")
            return
        for n, c in enumerate(criteria):
            kind = c.get("type")
            if kind in ("probe_file_exists", "probe_dir_exists", "probe_file_contains") and not (
                isinstance(c.get("paths", []), list)
                and all(isinstance(x, str) for x in c.get("paths", []))
            ):
                self.problem(step, f"criterion #{n} ({kind}): paths must be a list of paths")
            elif kind == "bash_cmd_succeeds" and not isinstance(c.get("bash_cmd", ""), str):
                self.problem(
                    step, f"criterion #{n} (bash_cmd_succeeds): bash_cmd must be a command"
                )
            if not isinstance(c.get("weight", 1.0), (int, float)) or isinstance(
                c.get("weight"), bool
            ):
                self.problem(step, f"criterion #{n}: weight must be a number")

    def _aggregate_verifiers(self, step: Step) -> None:
        for vid in step.get("verifier_ids", []):
            if vid not in self.verifier_ids:
                self.problem(
                    step,
                    f"verifier_ids names {vid!r}, which no earlier scoring step "
                    f"records; they record {sorted(self.verifier_ids)} (a step's "
                    "verifier_id, or its id)",
                )

    def _run_docker_container(self, step: Step) -> None:
        self.sandbox(step, "vm")
        if step.get("docker_context_url"):
            self.problem(
                step,
                "docker_context_url is a download, and agentenv.py runs without "
                "network; put the build context in artifacts/<name>/ and name it "
                "with docker_context_artifact_id",
            )
        elif not step.get("docker_context_artifact_id"):
            self.problem(
                step,
                "names no build context; set docker_context_artifact_id to an "
                "artifact holding a Dockerfile",
            )
        else:
            folder = self.artifact(
                step, "docker_context_artifact_id", step.get("docker_context_artifact_id")
            )
            dockerfile = step.get("dockerfile_path", "Dockerfile")
            if folder is not None and not (folder / dockerfile).is_file():
                self.problem(
                    step,
                    f"artifacts/{folder.name}/ has no {dockerfile}; add it, or set dockerfile_path",
                )
        for extra in step.get("extra_networks") or []:
            if extra in ("host", "none"):
                self.problem(
                    step,
                    f"extra_networks names {extra!r}, which is a network mode, not a "
                    "network to join besides; set it as network",
                )
        where = (step.get("sandbox_name"), step.get("container_name", "task-container"))
        if where in self.containers:
            self.problem(
                step,
                f"container {where[1]!r} already runs on sandbox {where[0]!r}; give "
                "each container of a sandbox its own container_name",
            )
        self.containers.add(where)

    def _run_container_unit_tests_verifier(self, step: Step) -> None:
        if step.get("agent_name"):
            if step.get("sandbox_name") or step.get("container_name"):
                self.problem(
                    step,
                    "runs in the agent's box (agent_name) or in a container of a "
                    "sandbox (sandbox_name, container_name), not both",
                )
            self.agent(step)
        elif not step.get("sandbox_name") or not step.get("container_name"):
            self.problem(
                step,
                "names where the tests run: agent_name (the agent's box), or "
                "sandbox_name and container_name (a run_docker_container container)",
            )
        else:
            self.sandbox(step)
            where = (step.get("sandbox_name"), step.get("container_name"))
            if where not in self.containers:
                self.problem(
                    step,
                    f"Container {where[1]!r} not found on sandbox {where[0]!r}: no "
                    "earlier run_docker_container step runs it",
                )
        for key in step.get("env_vars", {}) if isinstance(step.get("env_vars"), dict) else []:
            if not POSIX_NAME.fullmatch(key):
                self.problem(
                    step, f"env_vars key {key!r} is not a POSIX name ([A-Za-z_][A-Za-z0-9_]*)"
                )

    def _reset_env(self, step: Step) -> None:
        if _resolve_env(step.get("env_id"), self.shelf.envs, self.task_id) is None:
            self.problem(
                step,
                f"env_id: there is no env {step.get('env_id')!r} in the bundle; add "
                f"envs/{step.get('env_id')}/",
            )

    CHECKS: dict[str, Callable[[TaskCheck, Step], None]] = {
        "deploy_env": _deploy_env,
        "apply_server_config": _apply_server_config,
        "deploy_agent": _deploy_agent,
        "prompt_agent": _prompt_agent,
        "env_outcome_verifier": _env_outcome_verifier,
        "agent_prompt_response_verifier": _agent_prompt_response_verifier,
        "deploy_sandbox": _deploy_sandbox,
        "add_skills": _add_skills,
        "load_artifact": _load_artifact,
        "run_code": _run_code,
        "verify_sandbox": _verify_sandbox,
        "aggregate_verifiers": _aggregate_verifiers,
        "run_docker_container": _run_docker_container,
        "run_container_unit_tests_verifier": _run_container_unit_tests_verifier,
        "reset_env": _reset_env,
    }


def _check_task(
    name: str,
    task_id: str,
    steps: list[Step],
    shelf: Shelf,
    reward: str | None,
    problems: list[str],
) -> Task | None:
    """Check how a task's steps refer to each other, its envs and its artifacts."""
    before = len(problems)
    checked = TaskCheck(name, task_id, shelf, problems)
    checked.check(steps)
    at = checked.at
    agents = checked.agents
    if len(agents) > 1:
        problems.append(
            f"{at}: deploys agents {', '.join(sorted(agents))}; agentenv.py plays one "
            "agent from outside, so a task deploys exactly one"
        )
    turns = [s for s in steps if s.type == "prompt_agent"]
    if not turns:
        problems.append(
            f"{at}: prompts no agent, so there is no turn to play; add a prompt_agent step"
        )
    scoring = tuple(s.id for s in steps if s.type in SCORING_TYPES)
    reward_step = _choose_reward(at, scoring, reward, problems)
    if len(problems) > before:
        return None
    agent_name, agent_step = next(iter(agents.items()))
    sandboxed = works_in_sandbox(steps, agent_name)
    if sandboxed and agent_step.get("sandbox_name"):
        checked.placed(agent_step)
        if len(problems) > before:
            return None
    toolset = Toolset(
        tuple(sorted({checked.deployed[e] for e in agent_step.get("env_ids", [])})), sandboxed
    )
    return Task(task_id, name, tuple(steps), agent_name, toolset, reward_step, sandboxed)


def _resolve_env(env_id: Any, envs: dict[str, EnvSpec], task_id: str) -> str | None:
    """An env_id is an env folder's name, or its full id ``<id root>/<name>``."""
    if not isinstance(env_id, str):
        return None
    if env_id in envs:
        return env_id
    root = task_id.rsplit("/", 1)[0]
    if env_id.startswith(root + "/") and env_id[len(root) + 1 :] in envs:
        return env_id[len(root) + 1 :]
    return None


def _check_directives(step: Step, at: str, problems: list[str]) -> None:
    directives = step.get("directives")
    if not isinstance(directives, list) or not directives:
        problems.append(f"{at}: directives must be a non-empty list of {{service, uri, args}}")
        return
    for n, d in enumerate(directives):
        if (
            not isinstance(d, dict)
            or not isinstance(d.get("uri"), str)
            or not isinstance(d.get("service", d.get("environment", "*")), str)
            or not isinstance(d.get("args", {}), dict)
        ):
            problems.append(
                f'{at}: directive #{n} must be {{"service": <card name or "*">, '
                '"uri": <extension URI>, "args": {...}}'
            )


def _check_criteria(step: Step, at: str, problems: list[str]) -> None:
    criteria = step.get("criteria")
    if not isinstance(criteria, list):
        problems.append(f"{at}: criteria must be a list")
        return
    for n, c in enumerate(criteria):
        kind = c.get("type") if isinstance(c, dict) else None
        if kind not in CRITERION_TYPES:
            problems.append(
                f"{at}: criterion #{n} has type {kind!r}; the types are "
                f"{', '.join(CRITERION_TYPES)}"
            )
        elif kind == "response_contains" and not (
            isinstance(c.get("needles"), list)
            and c["needles"]
            and all(isinstance(x, str) for x in c["needles"])
        ):
            problems.append(
                f"{at}: criterion #{n} (response_contains) needs a non-empty list of "
                "strings as needles"
            )
        elif kind == "response_regex_present":
            pattern, flags = c.get("pattern"), c.get("flags")
            try:
                if not isinstance(pattern, str) or not pattern:
                    raise re.error("the pattern is empty")
                re.compile(pattern, _regex_flags(flags))
            except (re.error, AttributeError, TypeError) as exc:
                problems.append(
                    f"{at}: criterion #{n} (response_regex_present) has a pattern or "
                    f"flags that don't compile ({exc})"
                )


def _regex_flags(names: list[str] | None) -> int:
    """AgentEnv's rule: no flags (None) means DOTALL; given flags, exactly those, OR-ed (an empty
    list: none)."""
    if names is None:
        return re.DOTALL
    flags = 0
    for name in names:
        flags |= getattr(re, name) if isinstance(name, str) and name.isupper() else _bad_flag(name)
    return flags


def _bad_flag(name: Any) -> int:
    raise AttributeError(f"{name!r} is not a re flag name such as IGNORECASE")


def _choose_reward(
    at: str, scoring: tuple[str, ...], reward: str | None, problems: list[str]
) -> str:
    if reward is not None:
        if reward not in scoring:
            problems.append(
                f"{at}: records no score at step {reward!r}; it records them at {list(scoring)}"
            )
        return reward
    if len(scoring) == 1:
        return scoring[0]
    if not scoring:
        problems.append(
            f"{at}: records no score, so it has no reward; add an env_outcome_verifier "
            "or agent_prompt_response_verifier step"
        )
    else:
        problems.append(
            f"{at}: records a score at each of {', '.join(scoring)}; name the one that "
            "is its reward with --reward <step id>"
        )
    return ""


def _load_evals(
    root: Path, tasks: dict[str, Task], id_root: str, problems: list[str]
) -> dict[str, list[Task]]:
    splits: dict[str, list[Task]] = {}
    eval_dir = root / "evals"
    if not eval_dir.is_dir():
        return splits
    for path in sorted(eval_dir.iterdir()):
        if path.name.startswith("."):
            continue
        where = f"evals/{path.name}"
        if path.is_dir() or path.suffix != ".toml":
            problems.append(
                f"{where}: an eval is a .toml file with tasks = [...]; rename or remove it"
            )
            continue
        if path.stem == "all":
            problems.append(
                f"{where}: eval 'all' has the name of the split that holds every task; rename it"
            )
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
            stem = name[len(id_root) + 1 :] if name.startswith(id_root + "/") else name
            if stem not in tasks:
                if (
                    "/" not in stem
                    and "\\" not in stem
                    and not stem.startswith(".")
                    and (root / "tasks" / f"{stem}.json").is_file()
                ):
                    continue  # the task itself has problems, reported where it is loaded
                problems.append(
                    f"{where}: lists {name!r}, which is not a task of the bundle; list "
                    "tasks by name (the file name under tasks/ without .json) or by id"
                )
            elif stem in listed:
                problems.append(f"{where}: lists {name!r} twice; an eval lists each task once")
            else:
                listed.add(stem)
                split.append(tasks[stem])
        splits[path.stem] = split
    return splits


# ================================================================ 3. Sandbox

# Image builds say how far they have got to every command (check and write-gym build at start
# too, and otherwise log only trouble).
build_log = logging.getLogger("agentenv.build")

DOCKER_PIDS_LIMIT = 1024  # processes and threads in one env container (a fork bomb stops)
BOX_MEMORY_MB = 2048  # a box's memory when its step sets no memory_mb
ENV_PORT = 18765  # the port an env's MCP server listens on in its container
OUTPUT_LINES = 40  # how much of an env's last output a failure quotes
# An env's log on the host: two files of 1 MiB at most (its last output is what a failure quotes).
ENV_LOG = {"type": "json-file", "config": {"max-size": "1m", "max-file": "2"}}
URGENT_THREADS = 16  # threads for kills, removals and fault inspections (no slot)
STREAM_THREADS = 1024  # threads reading commands' output (one per command running)


def owner_id() -> str:
    """Who owns what this process starts: host, pid and the pid's start time (pids get reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_process_start(os.getpid())}"


def _process_stat(pid: int) -> list[str]:
    """A process's /proc stat from its third field on (state, parent, group, ...): after its name,
    which may hold spaces and parentheses. OSError if it is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _process_start(pid: int) -> str:
    try:
        return _process_stat(pid)[19]  # field 22: start time in clock ticks
    except (OSError, IndexError):
        return ""


def group_members(groups: set[int]) -> list[tuple[int, int]]:
    """The running processes (Linux's /proc; zombies left out) of these process groups, each as
    its pid and its group."""
    members = []
    for entry in os.listdir("/proc") if groups and os.path.isdir("/proc") else []:
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                state, _, group = _process_stat(int(entry))[:3]
                if state != "Z" and int(group) in groups:
                    members.append((int(entry), int(group)))
    return members


def pidfd(pid: int) -> int | None:
    """A file descriptor of a running process that polls readable once it has ended (Linux 5.3
    and later); None if it is gone, or the system has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def has_ended(held: int) -> bool:
    """Whether the process of a pidfd has ended (its pid may be another's by now)."""
    return bool(select.select([held], [], [], 0)[0])


def still_running(pidfds: list[int], timeout: float) -> int:
    """Wait until the processes of these pidfds have ended, ``timeout`` seconds at most: how many
    have not."""
    poller, waiting = select.poll(), set(pidfds)
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while waiting and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            waiting.discard(fd)
    return len(waiting)


def owner_alive(owner: str) -> bool | None:
    """Whether the server that labelled something still runs; None when it ran on another host."""
    host, _, rest = owner.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    now = _process_start(int(pid))
    return bool(now) and (now == started or not started)


class RemovalFailed(AgentEnvError):
    """An env or box whose removal failed: it may still stand (and run). Its episode's teardown
    tries again until it is gone, holding the slot meanwhile (see ``Teardown``)."""


class Instance(abc.ABC):
    """One env running for an episode: where it answers, whether it still runs, and its removal."""

    base_url: str
    # Set, with how it ended, once the sandbox sees the env stop, for an env whose connections
    # would not end with it (a container dialled at its own address); None where they do.
    stopped: asyncio.Future[str] | None = None
    # How long, once a connection to it dropped, the env is given to be seen stopped (``exited``'s
    # settle): a process is reaped within milliseconds.
    drop_settle = 0.5

    @abc.abstractmethod
    async def exited(self, settle: float = 0.0) -> str | None:
        """None while the env runs; once it has stopped, a sentence saying how. ``settle`` is how
        long to wait for an exit that a dropped connection suggests is under way."""

    @abc.abstractmethod
    async def output(self) -> str:
        """The env's last lines of output, for a failure to quote."""

    @abc.abstractmethod
    async def remove(self) -> None:
        """Stop the env and remove what it ran in; RemovalFailed if it may still stand. Removing
        it again is harmless (what is gone stays gone)."""

    async def answers_itself(self) -> bool:
        """Whether what answers at ``base_url`` is this env and not another's (a port taken)."""
        return True

    async def lost_its_port(self) -> bool:
        """Whether the env stopped because another process took its port before it bound it:
        then starting it again on another port is all it takes."""
        return False

    async def up(self) -> bool | None:
        """Polled while the env boots: True once it answers and is known to be the env itself;
        False once it answers but may be another's, or has exited; None while it boots."""
        return None

    @property
    def where(self) -> str:
        """The node it runs on, where there are several (a Ray node's address); else empty."""
        return ""

    @property
    def inner_url(self) -> str:
        """``base_url`` as code run where the env runs reaches it (see ``box``)."""
        return self.base_url

    def box(self, name: str) -> Box:
        """Where the env runs, as a box the bundle's steps act in (load_artifact and run_code
        with env_id): the env's own container, or its folder. It goes with the env."""
        raise EpisodeFailed(
            f"env {name!r} runs where agentenv.py runs no bundle code, so a step "
            "can't load files into it or run code by it; serve with "
            + serve_with(providers_that(lambda able: able.env_boxes)),
            PROVIDER_UNAVAILABLE,
        )


class Sandbox(abc.ABC):
    """A sandbox provider: where envs run, and the boxes an episode works in. One class per
    provider, registered by its name (``provider``, below): the commands' ``--sandbox``, build_app's
    ``sandbox=``, a Gym config's ``sandbox:`` and ``check`` read the registry. Its ``settings`` are
    the settings it declares, which its ``Options`` (a dataclass) are read from.

    ``connect`` once at start-up (reaching the provider, and checking that what it starts can be
    reached from here), then ``prepare``, ``launch`` per env per episode, and ``close``. Its
    capabilities (a box, a box from an image, a sibling container, an image built, an episode's
    network) are refused here, by default: provider_unavailable, saying which sandbox has them.

    Every choice the server makes by its sandbox is the provider's to say, here: the policies
    below (its warm pool, its boxes' memory, auto's order, Ray's nodes), each with the default
    a provider that says nothing gets; nothing outside the providers decides by one's name."""

    kind = ""  # its name: --sandbox KIND
    summary = ""  # what --help says it is
    place = ""  # where it runs envs, in a phrase: "run {place}"
    settings: tuple[Declared, ...] = ()  # the settings it declares, its options' names
    gates_its_boots = False  # True where the sandbox bounds its own envs' boots (Ray: per node)
    paced_teardown = False  # True where a removal costs this machine (Docker's): TeardownGate
    # auto tries the providers that have a rank, lowest first, and runs the first that connects
    # (None: auto never picks it); so does a Ray node's host, among those that serve Ray's nodes.
    auto_rank: int | None = None
    serves_ray_nodes = False  # True where a Ray node's host can run its envs in it: on_ray_node
    env_boxes = False  # True where its envs run where bundle code can act (Instance.box)
    box_memory_mb = 0  # a box's memory when its step sets none (0: unbounded, or no box)
    memory_of = "the machine"  # what ``memory`` measures, in the words a warning says it in

    def __init__(self, owner: str):
        self.owner = owner

    @classmethod
    def warm_by_default(cls) -> tuple[bool, str]:
        """Whether a warm pool (envs booted ahead of demand) pays off with this provider, so a
        server keeps one when ``warm`` is left auto (``warm_default`` sizes it); and the words its
        start-up line says that in: what the pool's size follows ("with the docker sandbox", then
        the bound), or why it keeps none. A pool pays wherever a deploy costs more than a
        rollout's first reply hides, as it does unless the provider says otherwise."""
        return True, f"with the {cls.kind} sandbox"

    @classmethod
    async def on_ray_node(cls, owner: str, address: str) -> Sandbox:
        """The sandbox a Ray node's host (``EnvHost``, of server ``owner``) runs its envs in, for
        a provider that ``serves_ray_nodes``, reached there (the host prepares it): its envs
        reached at the node's ``address``, each ending with the host's process however that
        ends. AgentEnvError, saying why, if it can't be had on that node: auto then tries the
        next."""
        raise AgentEnvError(
            f"the {cls.kind} sandbox can't run a Ray node's envs; pass "
            + serve_with(ray_node_sandboxes()[1:], "--ray-node-sandbox")
        )

    @classmethod
    async def connect(cls, owner: str, settings: Settings) -> Sandbox:
        """The provider reached (its daemon, its cluster) for the server ``owner``, with its
        options read from ``settings``: AgentEnvError, saying the fix, if it can't be."""
        return cls(owner)

    def describe(self, envs: list[EnvSpec]) -> list[str]:
        """What ``check`` prints of the sandbox: its name, and what each env can reach."""
        return [
            f"sandbox: {self.kind}",
            "networks:",
            *(f"  {env.name}: {self.network_mode(env)}" for env in envs),
        ]

    async def prepare(self, envs: list[EnvSpec]) -> None:
        """Remove what a crashed earlier run left, and make every env ready to launch."""

    @abc.abstractmethod
    async def launch(self, env: EnvSpec, episode: str, limits: dict[str, Any]) -> Instance:
        """Start an env for an episode (not yet ready: see wait_ready)."""

    def network_mode(self, env: EnvSpec) -> str:
        """What the env can reach from where it runs, in a phrase ``check`` prints."""
        return f"the host's network: the {self.kind} sandbox isolates nothing"

    async def memory(self) -> int | None:
        """The memory of the machine its boxes share, in bytes, where one machine holds them all
        (None: unknown, or several)."""
        return None

    async def end_episode(self, episode: str) -> None:
        """Let go of what the sandbox holds for an episode whose envs are all removed."""

    async def close(self) -> None:
        """Wait for removals under way, and let go of what the sandbox holds."""

    # -- capabilities, refused unless the provider has them

    def unable(self, what: str, capability: str) -> EpisodeFailed:
        """The refusal of a capability this provider lacks: what was asked, and where it is had."""
        able = providers_that(
            lambda able: getattr(able, capability) is not getattr(Sandbox, capability)
        )
        return EpisodeFailed(
            f"{what}, and the {self.kind} sandbox can't; serve with " + serve_with(able),
            PROVIDER_UNAVAILABLE,
        )

    async def prepare_box(self) -> None:
        """Make the agent's box ready to open (its image built), for a bundle whose tasks use
        one."""

    async def open_box(
        self,
        episode: str,
        name: str,
        limits: dict[str, Any],
        network: dict[str, tuple[str, ...]] | None = None,
        agents: bool = False,
    ) -> Box:
        """Open a box of our own for an episode: the agent's (``agents``), or a VM-mode
        deploy_sandbox's. With no ``network`` it is on none; else on those segments of its
        episode's network ("" the first), by those names."""
        raise self.unable(f"box {name!r} is a box to work in", "open_box")

    async def open_image(self, episode: str, name: str, limits: dict[str, Any], image: str) -> Box:
        """Open a box that runs a bundle's image (a deploy_sandbox in container mode), on no
        network."""
        raise self.unable(f"box {name!r} runs the image {image!r}", "open_image")

    async def run_sibling(
        self,
        episode: str,
        name: str,
        limits: dict[str, Any],
        image: str,
        network: dict[str, tuple[str, ...]] | None = None,
        share: Box | None = None,
    ) -> Box:
        """Run a container beside an episode's box (run_docker_container): on those segments of
        the episode's network, or in the network of box ``share``, or on none."""
        raise self.unable(f"container {name!r} runs beside its sandbox's box", "run_sibling")

    async def build_image(self, folder: Path, dockerfile: str, name: str) -> str:
        """An image of a bundle artifact's build context, built once per content: its tag."""
        raise self.unable(f"the image of artifacts/{name} is to be built", "build_image")

    async def episode_network(self, episode: str, segment: str = "") -> str:
        """The name of a network of this episode alone, for containers of one episode that talk to
        each other (made on first ask, removed by ``end_episode``); ``segment`` names another of
        its networks, for containers that a task puts on a network of their own."""
        raise self.unable("the episode's containers need a network of their own", "episode_network")


# The sandbox providers by name: the one registry that the commands' --sandbox, build_app's
# sandbox=, a Gym config's sandbox: and check read. A provider joins it by ``@provider``, which
# declares its settings beside Settings' own.
PROVIDERS: dict[str, Any] = {}


def provider(cls: Any) -> Any:
    """Register a sandbox provider under its ``kind``, and declare its settings (and ``sandbox``
    again, once declared, so that its --help names a provider added after it)."""
    PROVIDERS[cls.kind] = cls
    for declared in cls.settings:
        Settings.DECLARED[declared.name] = declared
    if "sandbox" in Settings.DECLARED:
        Settings.DECLARED["sandbox"] = sandbox_setting()
    return cls


def providers_that(has: Callable[[Any], bool]) -> list[str]:
    """The names of the providers (auto aside) that have something, in the order the commands
    offer them: what a refusal names as able."""
    return [
        kind
        for kind in sorted(PROVIDERS)
        if issubclass(PROVIDERS[kind], Sandbox) and has(PROVIDERS[kind])
    ]


def serve_with(kinds: list[str] | tuple[str, ...], flag: str = "--sandbox") -> str:
    """The fix a refusal says: the providers that can, else that none registered can."""
    return (
        f"{flag} {' or '.join(kinds)}"
        if kinds
        else "a sandbox provider that can (none of those agentenv.py has can)"
    )


def auto_order(has: Callable[[Any], bool] = lambda able: True) -> list[str]:
    """The providers auto may pick (those with an ``auto_rank``, and ``has``), in the order it
    tries them."""
    return sorted(
        providers_that(lambda able: able.auto_rank is not None and has(able)),
        key=lambda kind: PROVIDERS[kind].auto_rank,
    )


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
    base = (
        os.environ.get("AGENTENV_STATE_DIR")
        or Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "agentenv"
    )
    return Path(base)


class LocalInstance(Instance):
    """An env run as a host process in its own process group, with a scratch folder of its own
    (its TMPDIR and database); its output kept in a ring."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        port: int,
        record: Path,
        scratch: Path,
        release: Callable[[], None] = lambda: None,
        host: str = "127.0.0.1",
        owner: str = "",
    ):
        self.proc, self.port, self.record, self.scratch = proc, port, record, scratch
        self.release, self.owner = release, owner
        self._box: LocalBox | None = None
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
        if self.proc.returncode is not None:  # its last words may still be in the pipe
            await asyncio.wait([self.reader], timeout=1)
        return "\n".join(self.lines)

    def box(self, name: str) -> Box:
        # the env's scratch folder: /app, /tmp and /home/agent there, other paths this machine's
        if self._box is None:
            folder = self.scratch / "box"
            for sub in ("app", "tmp", "home"):
                (folder / sub).mkdir(parents=True, exist_ok=True)
            self._box = LocalBox(folder, name, self.owner)
        return self._box

    async def answers_itself(self) -> bool:
        # A port found free can be taken by another process before the env binds it; then the
        # env dies on bind while the other answers in its place. Linux says who listens.
        # (a few small reads from Linux: no thread for it). Where Linux says nothing listens, what
        # answered a moment ago was another's env that has since gone: not this one either.
        found = listens(self.proc.pid, self.port)
        return found is True or (found is None and not LINUX_SAYS_WHO_LISTENS)

    async def up(self) -> bool | None:
        if listens(self.proc.pid, self.port):
            return True
        return False if self.proc.returncode is not None else None

    async def lost_its_port(self) -> bool:
        if self.proc.returncode is None:
            return False
        if listens(self.proc.pid, self.port) is False:  # the other holds it still
            return True
        return says_port_taken(await self.output())  # or held it, and has gone since

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


@provider
class LocalSandbox(Sandbox):
    """Runs each env's image command as a host process, in the env's folder, on a free port.

    It is the embedded default where no Docker daemon answers: no isolation, but the same wire.
    Every process is recorded under the state folder, so the next start kills what a crash left.
    ``host`` is the address envs bind (a Ray node's own, say); with ``die_with_parent`` each env
    is killed by Linux the moment the thread that started it ends (a Ray host actor killed).
    """

    kind = "local"
    summary = "local processes, isolated from nothing"
    place = "as local processes"
    auto_rank = 2  # auto's last resort: it always connects
    serves_ray_nodes = env_boxes = True
    KILL_WAIT = 10.0  # seconds the start-up sweep waits for what it killed to have ended

    def __init__(self, owner: str, host: str = "127.0.0.1", die_with_parent: bool = False):
        super().__init__(owner)
        self.host, self.die_with_parent = host, die_with_parent
        self.records = state_dir() / "local" / owner
        self.ports: set[int] = set()  # handed to envs still running: never handed twice

    @classmethod
    def warm_by_default(cls) -> tuple[bool, str]:
        # A deploy is a process start (0.18 s measured on 2 busy cores, against 0.02 s warm),
        # which a Gym rollout's first reply hides.
        return False, f"the {cls.kind} sandbox gains too little from one to keep it by default"

    @classmethod
    async def on_ray_node(cls, owner: str, address: str) -> Sandbox:
        # Its envs bind the node's address, and Linux kills each when the host's thread ends.
        return cls(owner, host=address, die_with_parent=True)

    async def prepare(self, envs: list[EnvSpec]) -> None:
        killed = await asyncio.to_thread(self.kill_leftovers)
        if killed:
            log.warning(
                "Killed %d env process group(s) that an earlier run of agentenv.py left "
                "behind when it stopped without tearing down.",
                killed,
            )

    async def close(self) -> None:
        # Its envs and boxes are gone with their records: a clean stop leaves no folder for the
        # next start to sweep. One still holding a record (a removal that failed) is left to it.
        with contextlib.suppress(OSError):
            self.records.rmdir()

    def kill_leftovers(self) -> int:
        """Kill, once each, the process groups of env processes whose server is gone: those its
        records name, and (Linux's /proc) any with a dead owner in their environment, which finds
        one whose record a crash kept from being written; and wait for them to have ended."""
        groups: set[int] = set()
        root = self.records.parent
        for folder in root.iterdir() if root.is_dir() else []:
            if folder == self.records or owner_alive(folder.name) is not False:
                continue
            # Servers sharing a state folder (Gym starts several at once) sweep the same dead
            # run's leftovers together: a folder or record another removed first is just gone.
            with contextlib.suppress(OSError):
                for record in folder.iterdir():  # a pid file per env process; scratch
                    if record.name.isdigit():
                        with contextlib.suppress(OSError):
                            started = record.read_text().strip()
                            if started and _process_start(int(record.name)) == started:
                                groups.add(int(record.name))
            shutil.rmtree(folder, ignore_errors=True)
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if not entry.isdigit():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:  # gone, or another user's
                continue
            marker = environ.find(b"AGENTENV_OWNER=")
            if marker < 0 or (marker and environ[marker - 1] != 0):
                continue
            owner = environ[marker + 15 :].split(b"\0", 1)[0].decode(errors="replace")
            if owner_alive(owner) is False:
                with contextlib.suppress(OSError):
                    groups.add(os.getpgid(int(entry)))
        groups.discard(os.getpgrp())
        # A killed process holds its port and files until it has ended, which takes a loaded
        # machine a while: the sweep waits for that, so that what it killed is gone (by pidfds
        # opened before the kill, so that a pid used again meanwhile is never waited on).
        opened: dict[int, list[int]] = {}
        for pid, group in group_members(groups):
            if (fd := pidfd(pid)) is not None:
                opened.setdefault(group, []).append(fd)
        killed, ending = 0, []
        try:
            for group in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
                    killed += 1
                    ending += opened.get(group, [])  # a group not killed is not waited on
            if running := still_running(ending, self.KILL_WAIT):
                log.warning(
                    "%d process(es) that an earlier run of agentenv.py left, killed, had "
                    "not ended %gs later; they may hold a port or a file a while longer.",
                    running,
                    self.KILL_WAIT,
                )
        finally:
            for fd in (fd for fds in opened.values() for fd in fds):
                os.close(fd)
        return killed

    async def launch(self, env: EnvSpec, episode: str, limits: dict[str, Any]) -> Instance:
        port = reserve_port(self.host, self.ports)
        try:
            return await self._launch(env, port)
        except BaseException:
            self.ports.discard(port)
            raise

    async def _launch(self, env: EnvSpec, port: int) -> Instance:
        command = list(env.command)
        if Path(command[0]).name in ("python", "python3"):
            command[0] = sys.executable  # "python" in an image's command means this interpreter
        if self.die_with_parent:
            # Not a preexec_fn: with one, Python forks without vfork and this process's event loop
            # waits until the child has run Python code and exec'd. In a process of a Ray worker's
            # size (200 MB, 20 threads) on a loaded machine that took ~190 ms a spawn against
            # under 1 ms, and envs booting at once on a node waited on each other. A launcher
            # exec'd at once asks for the signal instead.
            command = [
                sys.executable,
                "-I",
                "-S",
                "-c",
                DIE_WITH_PARENT,
                str(os.getpid()),
                *command,
            ]
        # The env's scratch folder lives beside its record, so a crashed run's are swept with them.
        self.records.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"scratch-{env.name}-", dir=self.records))
        # The owner marks the process and all it starts, so a sweep finds even one whose record
        # a crash kept from being written; the server's own token stays with the server.
        environ = {
            **{k: v for k, v in os.environ.items() if k != "AGENTENV_TOKEN"},
            **env.image_env,
            "AGENTENV_OWNER": self.owner,
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "ENVIRONMENT_NAME": env.environment_name,
            "MCP_HOST": self.host,
            "MCP_PORT": str(port),
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(scratch),
            "DATABASE_URL": f"sqlite:///{scratch}/{env.environment_name}.sqlite",
        }
        spawn = asyncio.create_subprocess_exec(
            *command,
            cwd=env.folder,
            env=environ,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )

        def kill(proc: asyncio.subprocess.Process) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        try:
            proc = await guarded(spawn, kill)
        except OSError as exc:
            shutil.rmtree(scratch, ignore_errors=True)
            raise EpisodeFailed(
                f"env {env.name!r} could not start: running {shlex.join(command)} in "
                f"{env.folder} failed ({exc}); fix the Dockerfile's CMD",
                PROVIDER_UNAVAILABLE,
            ) from None
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        record = self.records / str(proc.pid)
        record.write_text(_process_start(proc.pid))
        return LocalInstance(
            proc, port, record, scratch, lambda: self.ports.discard(port), self.host, self.owner
        )

    async def prepare_box(self) -> None:
        log.warning(
            "The agent's boxes are work folders on this machine (--sandbox local): its "
            "bash commands and the bundle's code run here, as this user, isolated from "
            "nothing, and a model can forge its reward. Serve only bundles and models you "
            "trust so (a scripted baseline), or use --sandbox docker to train."
        )

    async def open_box(
        self,
        episode: str,
        name: str,
        limits: dict[str, Any],
        network: dict[str, tuple[str, ...]] | None = None,
        agents: bool = False,
    ) -> Box:
        # (a folder on this machine: on its network, as everything here)
        # beside the records, so a crashed run's folders are swept with them
        self.records.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f"box-{plain_slug(name)}-", dir=self.records))
        (folder / "app").mkdir()
        (folder / "tmp").mkdir()
        (folder / "home" / "skills").mkdir(parents=True)
        return LocalBox(folder, name, self.owner)


# An env's command run by this launcher (python -c DIE_WITH_PARENT PARENT_PID COMMAND...) has Linux
# SIGKILL it when the thread that started it ends: an env in a session of its own escapes its
# parent's process group, so this is what ties it to its parent's life. The signal outlives the
# exec; a parent gone before it was asked for means the env must not start at all.
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or os._exit(1); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def plain_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9_.-]", "-", name.lower())[:40] or "box"


def wait_for_children_by_pidfd() -> None:
    """Have the event loop wait for env processes through Linux's pidfds. Python 3.11 waits for
    each child in a thread of its own, and a server that starts thousands of envs then churns
    thousands of threads, and RSS grows with the allocator's per-thread arenas (+71.5 MiB over
    5,000 episodes; +47.7 with pidfds). 3.12 uses pidfds itself; without them the threads stay."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # a kernel or seccomp profile without pidfds
        return
    asyncio.get_event_loop_policy().set_child_watcher(asyncio.PidfdChildWatcher())


LOCAL_PORTS_FROM = 20000  # local envs listen from here up to the ephemeral range
PORT_TRIES = 3  # launches of an env whose port another process took first


def reserve_port(host: str, reserved: set[int]) -> int:
    """A free port of ``host`` that no launch under way holds, added to ``reserved`` (the kernel
    hands a closed port out again at once, so a port found free may be another launch's)."""
    port = free_port(host)
    while port in reserved:
        port = free_port(host)
    reserved.add(port)
    return port


def says_port_taken(output: str) -> bool:
    """Whether an env's last output says its port was another's when it tried to bind it."""
    said = output.lower()
    return "address already in use" in said or "eaddrinuse" in said


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
    with socket.socket() as sock:  # no such range here: the kernel's choice
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


LINUX_SAYS_WHO_LISTENS = Path("/proc/net/tcp").exists()


def listening_sockets(port: int) -> set[str]:
    """The sockets (as /proc's fd links name them) listening on TCP ``port`` of this namespace."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as link:
            return {
                f"socket:[{inode}]"
                for family in (socket.AF_INET, socket.AF_INET6)
                for inode in _listeners(link, family, port)
            }
    except (OSError, AttributeError):  # no netlink here (not Linux, or a seccomp profile)
        return _listening_sockets_from_proc(port)


def _listeners(link: socket.socket, family: int, port: int) -> list[int]:
    # struct inet_diag_req_v2: family, protocol, ext, pad, states; then a zeroed inet_diag_sockid
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN) + bytes(48)
    link.send(struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, 0x301, 1, 0) + request)
    inodes: list[int] = []
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
                line = data[data.rfind(b"\n", 0, at) + 1 : data.find(b"\n", at)].split()
                inodes.add(f"socket:[{line[9].decode()}]")
                at = data.find(needle, at + 1)
    return inodes


# The Docker networks agentenv.py makes. Envs share one per server with traffic between its
# containers off (icc) and no masquerading: a packet out leaves with the container's private
# address, which nothing answers, so no connection out is made, while the host keeps its address
# on the bridge, where the server dials each env (or the daemon publishes its port on 127.0.0.1,
# for a daemon elsewhere; an internal network drops egress outright, but Docker publishes no
# port on one). An episode's own networks (a VM-mode sandbox's box and the containers it runs)
# publish nothing, so they are internal, and the host takes no address on their bridge: their
# containers reach each other by name and nothing else, and nothing else reaches them (the host
# has no route in; it works in them by docker exec). The bridge of each is named ae-..., so one
# DOCKER-USER rule can drop what they send.
ENVS_NETWORK_OPTIONS = {
    "com.docker.network.bridge.enable_icc": "false",
    "com.docker.network.bridge.enable_ip_masquerade": "false",
}
EPISODE_NETWORK_OPTIONS = {
    "com.docker.network.bridge.enable_ip_masquerade": "false",
    "com.docker.network.bridge.inhibit_ipv4": "true",
}
BRIDGE_PREFIX = "ae-"


class DockerDaemon:
    """The user's Docker daemon, as the Docker sandbox and its boxes call it: its client, and
    every call in a thread with a deadline, at most ``ops`` of them at once, so a slow daemon never
    stalls the event loop; the sweep of what a killed earlier run left; and the image builds.
    Containers being created and removed are kept until their threads end, so none is lost to a
    deadline or a shutdown (one created after its waiter gave up is removed the moment it
    appears)."""

    def __init__(self, client: Any, ops: int = 8, bridged: bool = True):
        from concurrent.futures import ThreadPoolExecutor

        self.client = client
        self.bridged = bridged  # False: it runs with --bridge=none (no networks of its own)
        self.limit = asyncio.Semaphore(ops)
        self.threads = ThreadPoolExecutor(max_workers=ops + 4, thread_name_prefix="docker")
        # Three lanes, so no episode waits behind another's long work: ``call`` takes one of the
        # ``ops`` slots (creations, builds, execs' starts); ``urgent`` (kills, removals, the
        # inspections that decide a rollout's fate) and the reading of a command's output for as
        # long as it runs take none, each on threads of their own.
        self.urgent_threads = ThreadPoolExecutor(
            max_workers=URGENT_THREADS, thread_name_prefix="docker-urgent"
        )
        self.stream_threads = ThreadPoolExecutor(
            max_workers=STREAM_THREADS, thread_name_prefix="docker-stream"
        )
        self.removals: set[asyncio.Future] = set()
        self.creating: set[asyncio.Future] = set()
        self.unremoved: dict[str, Any] = {}  # containers a removal left standing, by id

    @classmethod
    async def reach(cls) -> DockerDaemon:
        """The daemon DOCKER_HOST names (else the default socket), once it answers."""
        try:
            import docker
        except ImportError:
            raise AgentEnvError(
                "the docker sandbox needs the docker package: pip install docker"
            ) from None
        try:
            client = await asyncio.wait_for(
                asyncio.to_thread(lambda: docker.from_env(timeout=120)), 10
            )
            await asyncio.wait_for(asyncio.to_thread(client.ping), 10)
            bridged = await asyncio.wait_for(
                asyncio.to_thread(client.networks.list, names=["bridge"]), 10
            )
        except Exception as exc:  # noqa: BLE001 - docker raises many kinds
            raise AgentEnvError(
                f"no Docker daemon answered ({short(str(exc), 300)}); start Docker, "
                "set DOCKER_HOST, or pass --sandbox local"
            ) from None
        return cls(client, bridged=bool(bridged))

    # -- calls, in three lanes

    async def start(self, fn: Callable, *args: Any, **kwargs: Any) -> asyncio.Future:
        """Start a blocking docker SDK call in a thread, once one of the ``ops`` slots is free.

        The slot is given back when the thread ends, not when its caller stops waiting: a call
        past its deadline still loads the daemon, so it still counts against the cap."""
        await self.limit.acquire()
        loop = asyncio.get_running_loop()

        def give_back(_: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing waits
                loop.call_soon_threadsafe(self.limit.release)

        try:
            job = self.threads.submit(fn, *args, **kwargs)
        except BaseException:
            self.limit.release()
            raise
        job.add_done_callback(give_back)
        return asyncio.wrap_future(job)

    async def call(self, fn: Callable, *args: Any, timeout: float = 60, **kwargs: Any) -> Any:
        """Run a blocking docker SDK call in a thread, with a deadline that covers its wait for a
        slot too."""
        async with asyncio.timeout(timeout):
            return await (await self.start(fn, *args, **kwargs))

    async def urgent(self, fn: Callable, *args: Any, timeout: float = 30, **kwargs: Any) -> Any:
        """A blocking docker SDK call that must not queue behind other work (a kill, a removal,
        the inspection that decides whose fault a failure was): threads of its own, no slot, a
        deadline all the same."""
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(
            loop.run_in_executor(self.urgent_threads, lambda: fn(*args, **kwargs)), timeout
        )

    def streamed(self, fn: Callable, *args: Any) -> asyncio.Future:
        """A blocking read of a command's output, on a thread of its own for as long as the
        command runs, holding no slot."""
        return asyncio.get_running_loop().run_in_executor(self.stream_threads, fn, *args)

    # -- containers

    async def created(
        self,
        create_and_start: Callable[[], Any],
        container_of: Callable[[Any], Any],
        what: str,
        failed: str,
        gone: Callable[[], None] = lambda: None,
    ) -> Any:
        """Create and start a container in a thread, within 120 s: what ``create_and_start``
        gives, or EpisodeFailed saying what the daemon did (``what`` names the env or box).

        The thread's own future is kept until the thread ends, so neither a deadline nor an
        abandoned episode nor close() can lose a container that is still being created (one that
        appears after its waiter gave up is removed at once); and a creation past its deadline
        holds its slot until it ends, capping those in flight. ``gone`` is called once no
        container of this creation can stand: it never started, it failed (``create_and_start``
        removes what it made), or the one that came too late was removed."""

        async def undone(made: Any) -> None:
            await self.remove(container_of(made))  # RemovalFailed: it may stand, kept
            gone()

        def undo(made: Any) -> None:
            self.removing(asyncio.get_running_loop().create_task(undone(made)))

        try:
            job = await self.start(create_and_start)
        except BaseException:
            gone()
            raise
        self.creating.add(job)
        job.add_done_callback(self.creating.discard)
        job.add_done_callback(
            lambda done: None if done.cancelled() or done.exception() is None else gone()
        )
        try:
            return await asyncio.wait_for(guarded(job, undo), 120)
        except asyncio.TimeoutError:
            raise EpisodeFailed(
                f"{what}: the Docker daemon did not create and start its container "
                "within 120s; it may be overloaded (lower --max-concurrent-envs)",
                PROVIDER_UNAVAILABLE,
            ) from None
        except Exception as exc:  # noqa: BLE001 - docker raises many kinds
            raise EpisodeFailed(
                f"{what} {failed}: {short(str(exc), 2500)}", PROVIDER_UNAVAILABLE
            ) from None

    def removing(self, task: asyncio.Future) -> None:
        """Keep a removal (or a kill) under way until it ends: ``settle`` waits for it. Nobody
        reads its result: a removal that failed has said so, and left its container to
        ``settle``."""
        self.removals.add(task)
        task.add_done_callback(self.removals.discard)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def exited(self, container: Any) -> str | None:
        """None while a container runs (or the daemon is too busy to say); once it has stopped,
        a sentence saying how: an env's or a box's, read the same way."""
        import docker.errors

        try:
            await self.urgent(container.reload, timeout=10)
        except docker.errors.NotFound:
            return "its container is gone (removed from outside)"
        except Exception as exc:  # noqa: BLE001 - a busy daemon is not a dead env
            log.info(
                "Could not inspect container %s (%s); taking it to be still up.",
                container.short_id,
                exc,
            )
            return None
        state = container.attrs.get("State", {})
        if state.get("Status") in ("exited", "dead"):
            return f"its container exited with code {state.get('ExitCode')}" + (
                " (killed for running out of memory)" if state.get("OOMKilled") else ""
            )
        return None

    async def remove(self, container: Any) -> None:
        """Force-remove a container, three tries; RemovalFailed if it may still stand, which
        keeps it among the ``unremoved`` that ``settle`` tries again at the end."""
        import docker.errors

        error: Exception | None = None
        for _ in range(3):
            try:
                await self.urgent(container.remove, force=True, timeout=30)
                error = None
                break
            except docker.errors.NotFound:
                error = None
                break
            except docker.errors.APIError as exc:
                error = exc
                in_progress = exc.status_code == 409 and "in progress" in str(exc)
                if in_progress and await self.gone(container):
                    error = None
                    break
            except Exception as exc:  # noqa: BLE001
                error = exc
        if error is None:
            self.unremoved.pop(container.id, None)
            return
        self.unremoved[container.id] = container
        raise RemovalFailed(
            f"the Docker daemon did not remove container {container.short_id} "
            f"({type(error).__name__}: {short(str(error), 300)})"
        )

    async def gone(self, container: Any) -> bool:
        """Whether a container another removal is taking down (another server's sweep: Gym
        starts several servers at once) is gone once that removal ends, within 30 s."""
        import docker.errors

        try:
            await self.urgent(lambda: container.wait(condition="removed", timeout=30), timeout=35)
        except docker.errors.NotFound:  # gone before the wait began
            return True
        except Exception:  # noqa: BLE001 - the other removal failed, or hangs
            return False
        return True

    async def remove_network(self, network: Any) -> Any:
        """Remove a network; the network back if it still stands (a container still on it)."""
        import docker.errors

        try:
            await self.call(network.remove, timeout=30)
        except docker.errors.NotFound:
            pass
        except Exception as exc:  # noqa: BLE001
            log.info("Could not remove network %s yet (%s).", network.name, short(str(exc), 200))
            return network
        return None

    async def sweep(self) -> None:
        """Remove the containers and networks of servers that are gone (by their owner label)."""
        # sparse: the list as the daemon gave it, with no inspect of each container, which fails
        # for one removed meanwhile (by another server's sweep, say)
        containers = await self.call(
            self.client.containers.list, all=True, sparse=True, filters={"label": "agentenv.owner"}
        )
        stale = [
            c
            for c in containers
            if owner_alive((c.attrs.get("Labels") or {}).get("agentenv.owner", "")) is False
        ]
        removed = [
            c
            for c, failed in zip(
                stale,
                await asyncio.gather(*(self.remove(c) for c in stale), return_exceptions=True),
                strict=True,
            )
            if failed is None
        ]
        if removed:
            log.warning(
                "Removed %d container(s) that an earlier run of agentenv.py left behind when "
                "it stopped without tearing down.",
                len(removed),
            )
        for container in stale:
            if container.id in self.unremoved:
                log.error(
                    "Could not remove container %s, which an earlier run of agentenv.py left "
                    "behind; remove it with docker rm -f %s (the next start tries again).",
                    container.short_id,
                    container.short_id,
                )
        # networks after containers: a network with a container on it can't be removed
        networks = await self.call(self.client.networks.list, filters={"label": "agentenv.owner"})
        stale = [
            n
            for n in networks
            if owner_alive((n.attrs.get("Labels") or {}).get("agentenv.owner", "")) is False
        ]
        left = [n for n in await asyncio.gather(*(self.remove_network(n) for n in stale)) if n]
        if len(stale) > len(left):
            log.warning(
                "Removed %d network(s) that an earlier run of agentenv.py left behind when "
                "it stopped without tearing down.",
                len(stale) - len(left),
            )
        for network in left:
            # with its containers gone, what holds it is an endpoint Docker kept of a container
            # killed while it was being removed; the next start tries again
            log.warning(
                "Network %s, which an earlier run of agentenv.py left behind, could not be "
                "removed: Docker still counts an endpoint on it, of a container that is "
                "gone. Restarting the Docker daemon lets go of it; then remove it with "
                "docker network rm %s (the next start also tries).",
                network.name,
                network.name,
            )

    # -- images

    BUILD_NEWS = 30.0  # seconds between the lines that say a build is still going

    async def build_env(self, env: EnvSpec, which: str = "") -> tuple[str, bool]:
        """The env's image tag, built first if no image of its content exists; and whether it was
        built now."""
        tag = f"agentenv/{re.sub(r'[^a-z0-9_.-]', '-', env.name.lower())}:{env.digest}"
        import docker.errors

        try:
            await self.call(self.client.images.get, tag, timeout=30)
            return tag, False
        except docker.errors.ImageNotFound:
            pass
        build_log.info(
            "Building the image of env %r as %s%s (once per content of envs/%s).",
            env.name,
            tag,
            f", image {which}" if which else "",
            env.name,
        )
        started = time.monotonic()
        building = asyncio.ensure_future(
            self.call(
                self.client.images.build,
                path=str(env.folder),
                dockerfile=env.dockerfile.name,
                tag=tag,
                rm=True,
                forcerm=True,
                labels={"agentenv.env": env.name},
                timeout=1800,
            )
        )
        try:
            while not (await asyncio.wait({building}, timeout=self.BUILD_NEWS))[0]:
                build_log.info("Still building %s: %.0fs so far.", tag, time.monotonic() - started)
        except BaseException:  # cancelled: the build's thread runs on, unwaited
            building.cancel()
            raise
        try:
            building.result()
        except docker.errors.BuildError as exc:
            lines = "".join(str(c.get("stream", c.get("error", ""))) for c in exc.build_log)
            raise AgentEnvError(
                f"the image of env {env.name!r} did not build: {exc.msg}\n"
                f"{short(lines, 1500)}\nFix envs/{env.name}/{env.dockerfile.name}; "
                "with no registry reachable, its FROM image must exist locally"
            ) from None
        except docker.errors.APIError as exc:
            raise AgentEnvError(f"the image of env {env.name!r} did not build: {exc}") from None
        build_log.info("Built %s in %.1fs.", tag, time.monotonic() - started)
        return tag, True

    async def build_context(self, folder: Path, dockerfile: str, name: str) -> str:
        """An image of a bundle artifact's build context (run_docker_container), once per
        content."""
        tag = f"agentenv-box/{plain_slug(name)}:{_digest(folder)}"
        import docker.errors

        with contextlib.suppress(docker.errors.ImageNotFound):
            await self.call(self.client.images.get, tag, timeout=30)
            return tag
        try:
            await self.call(
                self.client.images.build,
                path=str(folder),
                dockerfile=dockerfile,
                tag=tag,
                rm=True,
                forcerm=True,
                labels={"agentenv.box": name},
                timeout=1800,
            )
        except (docker.errors.BuildError, docker.errors.APIError) as exc:
            raise EpisodeFailed(
                f"the image of artifacts/{name} did not build: {exc}; with no "
                "registry reachable, its FROM image must exist locally",
                PROVIDER_UNAVAILABLE,
            ) from None
        return tag

    async def box_image(self) -> str:
        """The agent's box image, built once per content from BOX_BASE: bash, coreutils, a user
        ``agent`` and /app. Its tag is agentenv-box/, never an env's agentenv/<env>."""
        tag = f"agentenv-box/agent:{hashlib.sha256(BOX_DOCKERFILE.encode()).hexdigest()[:16]}"
        import io

        import docker.errors

        try:
            await self.call(self.client.images.get, tag, timeout=30)
            return tag
        except docker.errors.ImageNotFound:
            pass
        log.info("Building the agent's box image as %s, FROM %s.", tag, BOX_BASE)
        try:
            await self.call(
                self.client.images.build,
                fileobj=io.BytesIO(BOX_DOCKERFILE.encode()),
                tag=tag,
                rm=True,
                forcerm=True,
                labels={"agentenv.box": "agent"},
                timeout=600,
            )
        except (docker.errors.BuildError, docker.errors.APIError) as exc:
            raise AgentEnvError(
                f"the agent's box image did not build FROM {BOX_BASE}: {exc}; with "
                f"no registry reachable, {BOX_BASE} must exist on this machine's "
                "Docker (the bundles' envs build FROM it too)"
            ) from None
        return tag

    async def memory(self) -> int | None:
        """The memory of the Docker host, in bytes (None if the daemon does not say)."""
        with contextlib.suppress(Exception):
            return int((await self.call(self.client.info, timeout=30)).get("MemTotal") or 0) or None
        return None

    # -- the end

    async def settle(self) -> None:
        """Wait for containers still being created (they are removed as they appear), then for
        every removal under way; then try once more to remove the containers a removal left
        standing, and say which still stand."""
        if self.creating:
            await asyncio.wait(set(self.creating), timeout=150)
            await asyncio.sleep(0)  # let their done-callbacks schedule the removals
        if self.removals:
            await asyncio.gather(*set(self.removals), return_exceptions=True)
        await asyncio.gather(
            *(self.remove(c) for c in list(self.unremoved.values())), return_exceptions=True
        )
        for container in self.unremoved.values():
            log.error(
                "Could not remove container %s as the server stopped; remove it with docker "
                "rm -f %s (the next start's sweep removes it too).",
                container.short_id,
                container.short_id,
            )

    def close(self) -> None:
        for threads in (self.threads, self.urgent_threads, self.stream_threads):
            threads.shutdown(wait=False)


class EnvAddresses:
    """The addresses of the envs' network, handed out by this server rather than the daemon,
    for envs it dials at their own addresses.

    The daemon gives a dead container's address to the next container it starts, at once (four
    containers in a row all got 172.24.0.2 here). serve learns of a death a few tens of
    milliseconds after the daemon freed the address, so a call, or a verifier, still dialling a
    dead env could reach another episode's env in that window: one rollout writing into another's
    env, or scored by it. So each env is started at an address taken here, in turn round the
    subnet, and an address is taken again only once serve has removed its container."""

    def __init__(self, subnet: str):
        import ipaddress

        network = ipaddress.ip_network(subnet)
        self.gateway = str(network.network_address + 1)
        self.first = int(network.network_address) + 2
        self.last = int(network.broadcast_address) - 1
        self.cursor = self.first
        self.held: set[int] = set()

    def take(self) -> str:
        import ipaddress

        for _ in range(self.last - self.first + 1):
            address, self.cursor = (
                self.cursor,
                (self.first if self.cursor >= self.last else self.cursor + 1),
            )
            if address not in self.held:
                self.held.add(address)
                return str(ipaddress.ip_address(address))
        raise EpisodeFailed(
            f"every one of the {len(self.held)} addresses of the envs' network is "
            "held by an env; lower --max-concurrent-envs",
            PROVIDER_UNAVAILABLE,
        )

    def give_back(self, address: str) -> None:
        import ipaddress

        self.held.discard(int(ipaddress.ip_address(address)))


class DeathWatch:
    """The daemon's word that one of this server's env containers died, passed on to the env at
    once: one thread reads Docker's event stream of the owner's containers dying, and each
    watched container's ``stopped`` future is set when its death comes.

    It is what a published port gave for nothing. Docker's port proxy closes a dead container's
    connections, so a call on one fails at once. A container dialled at its own address resets
    only the connections open as its process dies; a new one waits for an answer nothing at that
    address will send, so the next call on a killed env waited out the 60 s tool timeout, and its
    verify 35 s (tests/test_faults.py), where the proxy failed them in 1.7 s. A model that can get
    its env killed (an out-of-memory under ``memory_mb``) would hold its rollout that long. When
    the stream broke (the daemon restarting), it is read again from where it stopped, and every
    container watched is inspected too, since the daemon keeps only so many events (none across a
    restart); a death before a container is watched is for its deploy to see (it inspects the
    container before it reports it up)."""

    def __init__(self, daemon: DockerDaemon, owner: str):
        self.daemon, self.owner = daemon, owner
        self.watched: dict[str, asyncio.Future[str]] = {}
        self.stream: Any = None
        self.closed = threading.Event()

    async def start(self) -> None:
        """Read the stream from now on, once the daemon has begun to send it (a container started
        after this returns has its death told)."""
        loop = asyncio.get_running_loop()
        listening = loop.create_future()
        threading.Thread(
            target=self._read, args=(loop, listening), name="docker-deaths", daemon=True
        ).start()
        await asyncio.wait_for(listening, 30)

    def watch(self, container_id: str) -> asyncio.Future[str]:
        """A future set, with how it ended, when the container dies."""
        future = self.watched[container_id] = asyncio.get_running_loop().create_future()
        return future

    def forget(self, container_id: str) -> None:
        """No longer watched, since the server removes it (its death is ours, not the env's):
        its ``stopped`` says so, and nothing dials it from now on (a call that outlived its
        episode)."""
        self._died(container_id, "its container was removed by the server")

    def _died(self, container_id: str, how: str) -> None:
        future = self.watched.pop(container_id, None)
        if future is not None and not future.done():
            future.set_result(how)

    def _read(self, loop: asyncio.AbstractEventLoop, listening: asyncio.Future) -> None:
        def tell(call: Callable, *args: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the server's loop has closed
                loop.call_soon_threadsafe(call, *args)

        since, read_before = None, False
        while not self.closed.is_set():
            try:
                self.stream = self.daemon.client.events(
                    decode=True,
                    since=since,
                    filters={
                        "type": "container",
                        "event": "die",
                        "label": f"agentenv.owner={self.owner}",
                    },
                )
                if self.closed.is_set():  # closed while it was opened
                    self.stream.close()
                    return
                since = since or int(time.time())
                if read_before:
                    self._inspect_watched(tell)
                else:
                    read_before = True
                    tell(settle, listening)
                for event in self.stream:
                    since = event.get("time", since)
                    code = ((event.get("Actor") or {}).get("Attributes") or {}).get("exitCode", "?")
                    tell(self._died, event.get("id", ""), f"its container exited with code {code}")
            except Exception as exc:  # noqa: BLE001 - docker raises many kinds
                if self.closed.is_set():
                    return
                if not read_before:
                    # made here: the except block's name is gone by the time the loop calls it
                    refusal = AgentEnvError(
                        f"the Docker daemon sends no events ({short(str(exc), 200)}); serve "
                        "needs them to tell a dead env at once, or pass --docker-publish "
                        "127.0.0.1 to reach envs through published ports"
                    )
                    tell(settle, listening, None, refusal)
                    return
                log.warning(
                    "Docker's event stream broke (%s); reading it again from where it stopped.",
                    short(str(exc), 200),
                )
            self.closed.wait(1)  # a stream that ended or broke is opened again, not spun on

    def _inspect_watched(self, tell: Callable) -> None:
        """After the stream was down: every watched container that is no longer running."""
        import docker.errors

        for container_id in list(self.watched):
            try:
                state = self.daemon.client.api.inspect_container(container_id).get("State") or {}
            except docker.errors.NotFound:
                tell(self._died, container_id, "its container is gone (removed from outside)")
                continue
            except Exception:  # noqa: BLE001 - the stream says the rest
                continue
            if state.get("Status") in ("exited", "dead"):
                tell(
                    self._died,
                    container_id,
                    f"its container exited with code {state.get('ExitCode')}",
                )

    def close(self) -> None:
        self.closed.set()
        if self.stream is not None:
            with contextlib.suppress(Exception):
                self.stream.close()


def ipv4_subnet(attrs: dict[str, Any]) -> str:
    """A network's IPv4 subnet (its inspection's IPAM), or "" if it has none."""
    return next(
        (
            c["Subnet"]
            for c in (attrs.get("IPAM") or {}).get("Config") or []
            if c.get("Subnet") and ":" not in c["Subnet"]
        ),
        "",
    )


def own_subnet_network(client: Any, name: str, **create: Any) -> Any:
    """Make (in a thread) a network whose subnet this server gave, so that it may give each
    container its address (the daemon takes one only on a subnet its user gave): the subnet the
    daemon chooses, read off a network made and removed first. Another network taking it in
    between is tried again."""
    import ipaddress

    import docker

    tries = 8
    for attempt in range(tries):
        # the probe has a name and a bridge of its own, so one left standing blocks nothing (it
        # carries the owner's label: a sweep removes it)
        probe = {
            **create,
            "options": {
                **create["options"],
                "com.docker.network.bridge.name": BRIDGE_PREFIX + secrets.token_hex(6),
            },
        }
        chosen = client.networks.create(f"{name}-probe-{secrets.token_hex(3)}", **probe)
        try:
            subnet = ipv4_subnet(chosen.attrs)
        finally:
            chosen.remove()
        if not subnet:
            raise RuntimeError(f"the daemon gave the network {name} no IPv4 subnet")
        pool = docker.types.IPAMPool(
            subnet=subnet, gateway=str(ipaddress.ip_network(subnet).network_address + 1)
        )
        try:
            return client.networks.create(
                name, ipam=docker.types.IPAMConfig(pool_configs=[pool]), **create
            )
        except docker.errors.APIError as exc:
            if attempt == tries - 1 or "overlap" not in str(exc).lower():
                raise
        # another server took the subnet in between (several starting at once): a little later
        time.sleep(random.uniform(0.05, 0.3))
    raise AssertionError("the tries either return or raise")


def network_address(settings: dict[str, Any]) -> str:
    """A container's IPv4 address on its network (its NetworkSettings); "" before it has one."""
    return next(
        (n["IPAddress"] for n in (settings.get("Networks") or {}).values() if n.get("IPAddress")),
        "",
    )


def started_env(
    client: Any, options: dict[str, Any], publish: str, own_port: int = 0
) -> tuple[Any, str, int]:
    """Create and start a container that listens on ENV_PORT (in a thread): it, and the address
    and port it is reached at. That is the port the daemon publishes on ``publish``, once bound;
    or ``own_port`` of ``publish``, on the daemon's network (no bridge); or, with nothing to
    publish (``publish`` empty: the daemon's bridges are this host's), ENV_PORT at the
    container's own address on its network."""
    container = client.containers.create(**options)
    try:
        container.start()
        if own_port:
            return container, publish, own_port
        for _ in range(100):  # a published port shows once the daemon has bound it
            container.reload()
            settings = container.attrs.get("NetworkSettings") or {}
            if publish and (bound := (settings.get("Ports") or {}).get(f"{ENV_PORT}/tcp")):
                return container, publish, int(bound[0]["HostPort"])
            if not publish and (address := network_address(settings)):
                return container, address, ENV_PORT
            state = container.attrs.get("State") or {}
            if state.get("Status") in ("exited", "dead"):
                output = container.logs(tail=OUTPUT_LINES).decode(errors="replace")
                raise RuntimeError(
                    f"its container exited with code {state.get('ExitCode')} "
                    f"as it started. Its last output:\n{short(output)}"
                )
            time.sleep(0.02)
        raise RuntimeError(
            f"the daemon gave its container no {'port' if publish else 'address'} within 2s"
        )
    except BaseException:
        container.remove(force=True)
        raise


class DockerInstance(Instance):
    """An env's container: dialled at the address this server gave it on the envs' network,
    where the daemon's bridges are this host's (its death told by ``deaths``, its address given
    back by ``vacate`` once it is removed); else on a random port the daemon publishes on the
    sandbox's address (a Ray node's own, say); or, on a daemon with no bridge, listening on a
    port of that address itself."""

    def __init__(
        self,
        daemon: DockerDaemon,
        container: Any,
        base_url: str,
        own_port: int = 0,
        release: Callable[[], None] = lambda: None,
        deaths: DeathWatch | None = None,
        vacate: Callable[[], None] = lambda: None,
    ):
        self.daemon, self.container, self.own_port = daemon, container, own_port
        self.base_url, self.release, self.deaths, self.vacate = base_url, release, deaths, vacate
        if deaths is not None:
            self.stopped = deaths.watch(container.id)
            # its dying process resets its connections, and the daemon tells of the death after
            # (20 to 60 ms here, at a load of 6 too)
            self.drop_settle = 3.0
        self._checked = 0.0
        self._box: DockerBox | None = None

    @property
    def inner_url(self) -> str:
        return self.base_url if self.own_port else f"http://127.0.0.1:{ENV_PORT}"

    def box(self, name: str) -> Box:
        # its container, as its image made it: the image's user and folder, root for steps
        if self._box is None:
            self._box = DockerBox(self.daemon, self.container, name, None)
        return self._box

    async def exited(self, settle: float = 0.0) -> str | None:
        if not settle and time.monotonic() - self._checked < 0.5:  # a daemon call twice a second
            return None
        if settle and self.stopped is not None:
            # dialled at its own address, its dying process reset the connection before the
            # daemon knew: its word of the death is waited for
            await asyncio.wait((self.stopped,), timeout=settle)
        self._checked = time.monotonic()
        why = await self.daemon.exited(self.container)
        if why is None and self.stopped is not None and self.stopped.done():
            return self.stopped.result()
        return why

    async def output(self) -> str:
        try:
            raw = await self.daemon.call(self.container.logs, tail=OUTPUT_LINES, timeout=10)
            return raw.decode(errors="replace")
        except Exception as exc:  # noqa: BLE001
            return f"(its logs could not be read: {exc})"

    async def up(self) -> bool | None:
        if await http_answers(self.base_url):
            # a published port is Docker's own for the container; one of the daemon's own ports
            # (no bridge) may have been taken by another first
            return not self.own_port
        return False if await self.exited() is not None else None

    async def lost_its_port(self) -> bool:
        # only an env bound to a port of its own (no bridge) can find it taken by another
        if not self.own_port or await self.exited(settle=0.1) is None:
            return False
        return says_port_taken(await self.output())

    async def remove(self) -> None:
        if self.deaths is not None:
            self.deaths.forget(self.container.id)
        try:
            await self.daemon.remove(self.container)
        finally:
            self.release()
        # its address only once it is gone, and once: another env may hold it next
        vacate, self.vacate = self.vacate, lambda: None
        vacate()


@dataclasses.dataclass(frozen=True)
class DockerOptions:
    """Where the Docker sandbox's envs are reached: the address their ports are published on,
    which is the address this server dials (None: for a daemon in this network namespace, each
    env at its own address on the envs' network, nothing published; DOCKER_HOST's host for a
    daemon elsewhere; else 127.0.0.1)."""

    publish: str | None = None

    @classmethod
    def of(cls, settings: Settings) -> DockerOptions:
        return cls(settings.docker_publish)


def remote_daemon_address() -> str | None:
    """The address of DOCKER_HOST's host, where the daemon runs elsewhere (tcp://, ssh://): a
    daemon publishes its containers' ports on its own machine, so they are dialled there."""
    parts = urllib.parse.urlsplit(os.environ.get("DOCKER_HOST") or "")
    if parts.scheme not in ("tcp", "ssh", "http", "https") or not parts.hostname:
        return None
    try:
        return str(socket.getaddrinfo(parts.hostname, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return parts.hostname


def daemon_shares_network() -> bool:
    """Whether the Docker daemon at a local socket runs in this process's network namespace, as its
    pid file beside the socket says (False where that can't be told: then a probe tells)."""
    url = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if not url.startswith("unix://"):
        return False
    try:
        pid = int(Path(url[len("unix://") :]).with_suffix(".pid").read_text().strip())
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    except (OSError, ValueError):
        return False


PROBE_DEADLINE = 10.0  # seconds for a probe container's port to answer from here
PROBE_REPLY = b"agentenv-probe"
# A probe container's listener (run by BOX_BASE's python): it answers each connection with
# PROBE_REPLY, so what answers is known to be the probe, not a port proxy nor another's server.
PROBE_SERVER = (
    "import socket, sys\n"
    "host, port = sys.argv[1], int(sys.argv[2])\n"
    "s = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET)\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((host, port))\n"
    "s.listen()\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.sendall(b'agentenv-probe')\n"
    "    c.close()\n"
)


async def probe_answers(host: str, port: int, within: float) -> str | None:
    """None once the probe answers at host:port (tried again while it starts); else what dialling
    it gave, in a phrase, when ``within`` seconds have passed."""
    deadline, said = time.monotonic() + within, "nothing"
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), max(0.1, min(2.0, deadline - time.monotonic()))
            )
        except (OSError, asyncio.TimeoutError) as exc:
            said = (
                "no answer"
                if isinstance(exc, asyncio.TimeoutError)
                else (os.strerror(exc.errno) if exc.errno else str(exc)).lower()
            )
        else:
            try:
                if await asyncio.wait_for(reader.read(len(PROBE_REPLY)), 2) == PROBE_REPLY:
                    return None
                said = "a connection that the probe did not answer"
            except (OSError, asyncio.TimeoutError):
                said = "a connection that the probe did not answer"
            finally:
                writer.close()
        await asyncio.sleep(0.1)  # polling: a port that starts to answer sends no event
    return said


def publish_address(value: Any, what: str) -> str:
    """``--docker-publish`` as a user gave it: an IP address (v4 or v6)."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(str(value).strip().strip("[]")))
    except ValueError:
        raise AgentEnvError(
            f"{what}: it must be an IP address of the Docker daemon's machine that "
            "this server reaches, such as 127.0.0.1 (the default) or 10.0.0.5"
        ) from None


# Run by a node's Docker host, it forks at once into a session of its own and its first process
# exits: Ray kills a worker's children when the worker ends, not their children. It then waits
# for its stdin to close, which happens when the host's process ends however it ends, and removes
# every container the host labelled as its own.
DOCKER_REAPER = """
import os, sys
if os.fork():
    os._exit(0)
os.setsid()
sys.stdin.buffer.read()
import docker
client = docker.from_env(timeout=60)
for container in client.containers.list(all=True, sparse=True,
                                        filters={"label": "agentenv.owner=" + sys.argv[1]}):
    try:
        container.remove(force=True)
    except Exception:
        pass
"""


def start_reaper(owner: str) -> int:
    """Start DOCKER_REAPER for the containers ``owner`` labels; the end of its stdin pipe that
    this process holds (never written, never inherited: it closes only when this process ends)."""
    read, write = os.pipe()
    try:
        first = subprocess.Popen(
            [sys.executable, "-c", DOCKER_REAPER, owner],
            stdin=read,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("AGENTENV_")},
        )
        first.wait(30)  # it exits as soon as it has forked the reaper
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return write


@provider
class DockerSandbox(Sandbox):
    """Runs each env as a container on the user's Docker daemon, from an image built once per
    content, and the boxes as containers of their own.

    Containers carry labels naming their owner (this server) and episode before they exist, so a
    sweep at start-up removes what a killed earlier run left. Envs share a network of this
    sandbox's; an episode's boxes get networks of the episode's own.
    """

    kind = "docker"
    summary = "containers of the Docker daemon DOCKER_HOST names (else the default socket)"
    place = "in Docker containers"
    paced_teardown = True
    auto_rank = 1  # auto's first choice: isolation, where a daemon answers
    serves_ray_nodes = env_boxes = True
    box_memory_mb = BOX_MEMORY_MB
    memory_of = "the Docker host"
    settings = (
        Declared(
            "docker_publish",
            None,
            publish_address,
            "with --sandbox docker: the address of the daemon's machine the envs' ports "
            "are published on and dialled at (default: none for a daemon in this "
            "network namespace, each env dialled at its own address on its network; "
            "DOCKER_HOST's host for a daemon elsewhere, else 127.0.0.1); checked at "
            "start",
            metavar="ADDRESS",
        ),
    )

    def __init__(
        self, owner: str, daemon: DockerDaemon, publish: str = "127.0.0.1", direct: bool = False
    ):
        super().__init__(owner)
        self.daemon = daemon
        # Where envs are reached: their ports published on this address; or, where the daemon
        # has no bridge (node_network), each container on the daemon's own network, its env
        # bound to a free port of this address as a local env would be; or (direct), where the
        # daemon's bridges are this host's, each at its own address on its network, with no
        # port published: a published port is a userland proxy, a process per port relaying
        # every byte (0.1 to 0.2 ms a call here, and more on each new connection).
        self.publish, self.node_network = publish, not daemon.bridged
        self.direct = direct and daemon.bridged
        self.deaths = DeathWatch(daemon, owner) if self.direct else None
        self.addresses: EnvAddresses | None = None  # once the envs' network is made (direct)
        self.ports: set[int] = set()
        # in this sandbox's network names: its own, since two sandboxes of one process (two
        # runtimes, or the hosts of nodes in one test) would otherwise make networks of one name
        self.tag = hashlib.sha1(f"{owner}/{secrets.token_hex(4)}".encode()).hexdigest()[:10]
        self.images: dict[str, str] = {}
        # the networks made, by episode ("" for the envs' shared one), each as its creation
        self.networks: dict[str, asyncio.Future] = {}
        self.unremoved: list[Any] = []  # networks a removal left standing: retried at close
        self.reaper: int | None = None  # on a Ray node: the pipe whose closing starts it

    @classmethod
    def warm_by_default(cls) -> tuple[bool, str]:
        # A cold deploy (a container created, started and answering: 0.3 s quiet, seconds under
        # load) is otherwise waited for by each rollout's first tool call.
        return True, "with the Docker sandbox"

    @classmethod
    async def connect(cls, owner: str, settings: Settings) -> DockerSandbox:
        return await cls.reached(owner, DockerOptions.of(settings).publish)

    @classmethod
    async def on_ray_node(cls, owner: str, address: str) -> Sandbox:
        # The node's own daemon, its envs' ports published on the node's address.
        sandbox = await cls.reached(owner, publish=address)
        # before any env's container exists: it removes this host's containers once the host is
        # gone (Docker's settings it keeps; ours it has no use for, and it is no env of ours)
        sandbox.reaper = await asyncio.to_thread(start_reaper, owner)
        return sandbox

    @classmethod
    async def reached(cls, owner: str, publish: str | None = None) -> DockerSandbox:
        """The sandbox on the daemon DOCKER_HOST names, its envs reached at ``publish`` (None: at
        their own addresses for a daemon in this network namespace, on DOCKER_HOST's host for a
        daemon elsewhere, else on 127.0.0.1), once that is checked."""
        daemon = await DockerDaemon.reach()
        # an address given is where envs are dialled; with none, a daemon in this network
        # namespace has its bridges here, and its envs are dialled on them
        direct = not publish and await asyncio.to_thread(daemon_shares_network)
        publish = publish or await asyncio.to_thread(remote_daemon_address) or "127.0.0.1"
        if not daemon.bridged:
            log.warning(
                "The Docker daemon at %s has no bridge network (it runs with "
                "--bridge=none), so env containers share its host's network, each env "
                "bound to a port of %s: isolated in files, processes and users, not in "
                "network.",
                os.environ.get("DOCKER_HOST") or "the default socket",
                publish,
            )
        sandbox = cls(owner, daemon, publish, direct)
        try:
            if sandbox.deaths is not None:
                await sandbox.deaths.start()
            await sandbox.check_reachable()
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def check_reachable(self) -> None:
        """Check that what the daemon publishes can be reached from here, where calls to envs
        come from: a probe container listens as an env does, and this process dials it. A daemon
        in this process's own network (its pid file says so) needs no probe."""
        if await asyncio.to_thread(daemon_shares_network):
            return
        daemon = os.environ.get("DOCKER_HOST") or "the default socket"
        try:
            await self.daemon.call(self.daemon.client.images.get, BOX_BASE, timeout=30)
        except Exception as exc:  # noqa: BLE001 - docker raises many kinds
            log.warning(
                "Could not check that the Docker daemon's envs can be reached from here: "
                "the probe runs %s, which the daemon at %s lacks (%s); an env that can't "
                "be reached fails at the deploy deadline.",
                BOX_BASE,
                daemon,
                short(str(exc), 200),
            )
            return
        own_port = reserve_port(self.publish, self.ports) if self.node_network else 0
        options: dict[str, Any] = dict(
            image=BOX_BASE,
            detach=True,
            labels={"agentenv.owner": self.owner, "agentenv.episode": "(probe)"},
            command=[
                "python3",
                "-c",
                PROBE_SERVER,
                self.publish if own_port else "0.0.0.0",
                str(own_port or ENV_PORT),
            ],
            security_opt=["no-new-privileges"],
            cap_drop=["ALL"],
            log_config={"type": "none"},
            **(
                {"network_mode": "host"}
                if own_port
                else {"ports": {f"{ENV_PORT}/tcp": (self.publish, None)}}
            ),
        )
        fix = (
            "pass --docker-publish with an address of the daemon's machine that this server "
            "reaches (for a daemon elsewhere, DOCKER_HOST's host is the default), or "
            "--sandbox local"
        )
        try:
            container, _, port = await self.daemon.created(
                lambda: started_env(self.daemon.client, options, self.publish, own_port),
                lambda made: made[0],
                "the probe of whether envs can be reached",
                "did not start",
            )
        except EpisodeFailed as exc:
            self.ports.discard(own_port)
            raise AgentEnvError(
                f"the Docker daemon at {daemon} could not publish a port on "
                f"{self.publish} ({exc}); {fix}"
            ) from None
        try:
            said = await probe_answers(self.publish, port, PROBE_DEADLINE)
        finally:
            self.daemon.removing(asyncio.ensure_future(self.daemon.remove(container)))
            self.ports.discard(own_port)
        if said is not None:
            raise AgentEnvError(
                f"the Docker daemon at {daemon} answers, but its envs can't be reached from here: "
                f"it published a probe container's port on {self.publish}:{port} of its own "
                f"machine, and dialling {self.publish}:{port} from here gave {said} within "
                f"{PROBE_DEADLINE:g}s (the daemon runs in another network namespace, or on another "
                f"machine); {fix}"
            )

    async def prepare(self, envs: list[EnvSpec]) -> None:
        await self.daemon.sweep()
        started, built = time.monotonic(), 0
        for n, env in enumerate(envs, 1):
            self.images[env.name], fresh = await self.daemon.build_env(env, f"{n} of {len(envs)}")
            built += fresh
        if built:
            build_log.info(
                "The images of %d env(s) are ready (%d built, %d already there) after %.1fs.",
                len(envs),
                built,
                len(envs) - built,
                time.monotonic() - started,
            )
        if any(env.network == "isolated" for env in envs) and not self.node_network:
            try:
                await self._network("")
            except EpisodeFailed as exc:
                raise AgentEnvError(str(exc)) from None

    async def memory(self) -> int | None:
        return await self.daemon.memory()

    # -- networks

    def network_name(self, episode: str = "", segment: str = "") -> str:
        """The name of this server's network for its envs (or for one episode's containers, or
        for a segment of them)."""
        return (
            f"agentenv-{self.tag}-"
            + (episode[:16] if episode else "envs")
            + (
                f"-{plain_slug(segment)[:24]}-{hashlib.sha1(segment.encode()).hexdigest()[:6]}"
                if segment
                else ""
            )
        )

    def network_mode(self, env: EnvSpec) -> str:
        if self.node_network:
            return (
                f"the host's: its daemon has no bridge, so its container shares the host's "
                f"network, its env bound to {self.publish}"
            )
        if env.network == "bridge":
            return (
                "bridge: Docker's default bridge, with egress and other bridge containers in "
                'reach (network = "bridge" in its env.toml)'
            )
        return (
            f"isolated: on {self.network_name()}, no egress, no other env's container in reach, "
            + (
                "dialled at its address there, no port published"
                if self.direct
                else f"its port published on {self.publish} only"
            )
        )

    async def episode_network(self, episode: str, segment: str = "") -> str:
        return await self._network(episode, segment)

    async def _network(self, episode: str, segment: str = "") -> str:
        """Make (once) the envs' network or an episode's, labelled so a sweep finds it."""
        name = self.network_name(episode, segment)
        if self.node_network:
            raise EpisodeFailed(
                "this episode's containers need a network of their own, and the "
                "Docker daemon has no bridge to make one on (it runs with "
                "--bridge=none); run it with bridging on",
                PROVIDER_UNAVAILABLE,
            )
        key = f"{episode}/{segment}" if segment else episode
        if key not in self.networks:
            labels = {"agentenv.owner": self.owner, "agentenv.episode": episode or "(envs)"}
            options = EPISODE_NETWORK_OPTIONS if episode else ENVS_NETWORK_OPTIONS
            bridge = BRIDGE_PREFIX + secrets.token_hex(6)  # at most 15 characters
            create = dict(
                driver="bridge",
                labels=labels,
                internal=bool(episode),
                options={**options, "com.docker.network.bridge.name": bridge},
            )
            client = self.daemon.client
            self.networks[key] = asyncio.ensure_future(
                self.daemon.call(own_subnet_network, client, name, timeout=60, **create)
                if self.direct and not episode
                else self.daemon.call(client.networks.create, name, timeout=60, **create)
            )
        try:
            network = await asyncio.shield(self.networks[key])
            if self.direct and not episode and self.addresses is None:
                self.addresses = EnvAddresses(ipv4_subnet(network.attrs))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - docker raises many kinds
            self.networks.pop(key, None)
            raise EpisodeFailed(
                f"the Docker network {name} could not be made ({short(str(exc), 300)}); if the "
                "daemon has run out of address pools, remove unused networks (docker network "
                "prune) or give it more (default-address-pools in daemon.json)",
                PROVIDER_UNAVAILABLE,
            ) from None
        return name

    async def end_episode(self, episode: str) -> None:
        keys = [
            k for k in self.networks if episode and (k == episode or k.startswith(episode + "/"))
        ]
        for made in [self.networks.pop(k) for k in keys]:
            with contextlib.suppress(Exception):
                if network := await made:
                    if await self.daemon.remove_network(network):
                        self.unremoved.append(network)

    # -- envs

    async def launch(self, env: EnvSpec, episode: str, limits: dict[str, Any]) -> Instance:
        options: dict[str, Any] = dict(
            image=self.images.get(env.name) or (await self.daemon.build_env(env))[0],
            detach=True,
            ports={f"{ENV_PORT}/tcp": (self.publish, None)},
            environment={
                "ENVIRONMENT_NAME": env.environment_name,
                "MCP_HOST": "0.0.0.0",
                "DATABASE_URL": f"sqlite:////tmp/{env.environment_name}.sqlite",
            },
            labels={
                "agentenv.owner": self.owner,
                "agentenv.episode": episode,
                "agentenv.env": env.name,
            },
            # unprivileged: no capabilities, no privilege gain, no host mounts, bounded processes,
            # and a log on the host of a few MiB at most, whatever a tool call makes the env print
            security_opt=["no-new-privileges"],
            cap_drop=["ALL"],
            pids_limit=DOCKER_PIDS_LIMIT,
            log_config=ENV_LOG,
        )
        own_port, address = 0, ""
        if self.node_network:  # no bridge: on the daemon's network, on a port of its own
            own_port = reserve_port(self.publish, self.ports)
            del options["ports"]
            options.update(
                network_mode="host",
                environment={
                    **options["environment"],
                    "MCP_HOST": self.publish,
                    "MCP_PORT": str(own_port),
                },
            )
        elif env.network == "isolated":
            options["network"] = network = await self._network("")
            if self.addresses is not None:  # dialled at an address this server gives it
                address = self.addresses.take()
                del options["ports"]
                options["networking_config"] = {
                    network: self.daemon.client.api.create_endpoint_config(ipv4_address=address)
                }
        # (an env on Docker's default bridge, which takes no address given, is published)
        if limits.get("cpu"):
            options["nano_cpus"] = int(float(limits["cpu"]) * 1e9)
        if limits.get("memory_mb"):
            options["mem_limit"] = f"{int(limits['memory_mb'])}m"

        addresses = self.addresses
        # its address comes back once no container of this creation can stand, never before
        vacate = (lambda: addresses.give_back(address)) if address and addresses else lambda: None
        try:
            container, reached, port = await self.daemon.created(
                lambda: started_env(
                    self.daemon.client, options, "" if address else self.publish, own_port
                ),
                lambda made: made[0],
                f"env {env.name!r}",
                "did not come up",
                vacate,
            )
        except BaseException:
            self.ports.discard(own_port)
            raise
        if not address:
            return DockerInstance(
                self.daemon,
                container,
                f"http://{reached}:{port}",
                own_port,
                lambda: self.ports.discard(own_port),
            )
        instance = DockerInstance(
            self.daemon, container, f"http://{address}:{port}", deaths=self.deaths, vacate=vacate
        )
        if reached != address:  # never dial an address the daemon gave another container
            await instance.remove()
            raise EpisodeFailed(
                f"env {env.name!r}: the Docker daemon gave its container the "
                f"address {reached}, not {address} as asked",
                PROVIDER_UNAVAILABLE,
            )
        return instance

    # -- boxes

    async def prepare_box(self) -> None:
        self.images[""] = await self.daemon.box_image()

    async def build_image(self, folder: Path, dockerfile: str, name: str) -> str:
        return await self.daemon.build_context(folder, dockerfile, name)

    async def open_box(
        self,
        episode: str,
        name: str,
        limits: dict[str, Any],
        network: dict[str, tuple[str, ...]] | None = None,
        agents: bool = False,
    ) -> Box:
        image = self.images[""] = self.images.get("") or await self.daemon.box_image()
        return await self._box(episode, name, limits, image, network, None, agents, own=True)

    async def open_image(self, episode: str, name: str, limits: dict[str, Any], image: str) -> Box:
        return await self._box(episode, name, limits, image)

    async def run_sibling(
        self,
        episode: str,
        name: str,
        limits: dict[str, Any],
        image: str,
        network: dict[str, tuple[str, ...]] | None = None,
        share: Box | None = None,
    ) -> Box:
        if share is not None and not isinstance(share, DockerBox):
            raise EpisodeFailed(
                f"container {name!r} is to share the network of box {share.name!r}, "
                "which is no container",
                PROVIDER_UNAVAILABLE,
            )
        return await self._box(episode, name, limits, image, network, share)

    def box_options(
        self,
        episode: str,
        name: str,
        limits: dict[str, Any],
        image: str,
        network: str | None = None,
        aliases: tuple[str, ...] = (),
        share: DockerBox | None = None,
    ) -> dict[str, Any]:
        """How a box's container is made: the one place its isolation is chosen. No network, or
        one of its episode's internal networks (reached there by ``aliases``), or the network
        namespace of box ``share``."""
        memory = int(limits.get("memory_mb") or self.box_memory_mb)
        # Our own box: a read-only root, and its writable places tmpfs mounts of bounded sizes
        # (within its memory), so a command that fills the disk fills only its box's share.
        own = (
            {}
            if image != self.images.get("")
            else dict(
                read_only=True,
                tmpfs={
                    "/app": f"size={memory // 2}m,uid=1000,gid=1000,mode=0755",
                    "/home/agent": f"size={max(16, memory // 16)}m,uid=1000,gid=1000,mode=0755",
                    "/tmp": f"size={max(16, memory // 8)}m,mode=1777",
                    "/var/tmp": f"size={max(16, memory // 32)}m,mode=1777",
                },
            )
        )
        # Our own box's first process is its keeper, root's and the box's init (so nothing in the
        # box can kill it, not even root, nor write to its output), with the one capability it
        # needs to stop the agent's; it reaps the orphans, as an init does.
        if own:
            own.update(
                user="0",
                command=["bash", "-c", BOX_KEEPER, KEEPER_NAME],
                stdin_open=True,
                cap_add=["KILL"],
                init=False,
            )
        if share is not None:
            where: dict[str, Any] = {"network_mode": f"container:{share.container.id}"}
        elif network:
            # Names not of the network resolve nowhere: Docker's DNS asks loopback for them, so
            # even a Docker that forwards an internal network's lookups from the host's
            # namespace (before 26) sends no query off this machine.
            where = {
                "network": network,
                "hostname": "box",
                "dns": ["127.0.0.1"],
                "networking_config": {
                    network: self.daemon.client.api.create_endpoint_config(aliases=list(aliases))
                },
            }
        else:
            where = {"network_mode": "none", "hostname": "box"}
        return dict(
            **{"init": True, **own},
            **where,
            image=image,
            detach=True,
            labels={
                "agentenv.owner": self.owner,
                "agentenv.episode": episode,
                "agentenv.box": name,
            },
            # no log on the host: nothing a box prints can fill its disk
            log_config={"type": "none"},
            security_opt=["no-new-privileges"],
            cap_drop=["ALL"],
            pids_limit=BOX_PIDS_LIMIT,
            mem_limit=f"{memory}m",
            memswap_limit=f"{memory}m",
            nano_cpus=int(float(limits.get("cpu") or 1.0) * 1e9),
            environment=dict(limits.get("env_vars") or {}),
            **(
                {"command": _shell_words(command) if isinstance(command, str) else list(command)}
                if (command := limits.get("command_override")) and not own
                else {}
            ),
        )

    async def _box(
        self,
        episode: str,
        name: str,
        limits: dict[str, Any],
        image: str,
        network: dict[str, tuple[str, ...]] | None = None,
        share: DockerBox | None = None,
        agents: bool = False,
        own: bool = False,
    ) -> Box:
        """A box's container, created and started: our own box (``own``: its user the agent),
        or one of a bundle's image (its image's user)."""
        # its networks, by name, with the names it is reached by on each (the first at creation)
        joins = [
            (await self.episode_network(episode, segment), aliases)
            for segment, aliases in (network or {}).items()
        ]
        first, aliases = joins[0] if joins else (None, ())
        options = self.box_options(episode, name, limits, image, first, aliases, share)
        api = self.daemon.client.api

        def create_and_start() -> Any:
            container = self.daemon.client.containers.create(**options)
            try:
                for more, named in joins[1:]:
                    api.connect_container_to_network(container.id, more, aliases=list(named))
                container.start()
                container.reload()  # its State.Pid: its first process, as the host sees it
                return container
            except BaseException:
                container.remove(force=True)
                raise

        container = await self.daemon.created(
            create_and_start, lambda made: made, f"box {name!r}", "did not start"
        )
        return DockerBox(self.daemon, container, name, "agent" if own else None, agents)

    async def close(self) -> None:
        """Wait for containers still being created and removals under way, then remove the
        networks, once no container of this server is on them."""
        await self.daemon.settle()
        made = await asyncio.gather(*self.networks.values(), return_exceptions=True)
        self.networks.clear()
        networks = [n for n in made if not isinstance(n, BaseException)] + self.unremoved
        self.unremoved = []
        for network in await asyncio.gather(*(self.daemon.remove_network(n) for n in networks)):
            if network is not None:
                log.error(
                    "Could not remove network %s; remove it with docker network rm %s.",
                    network.name,
                    network.name,
                )
        if self.deaths is not None:
            self.deaths.close()
        self.daemon.close()


# -- boxes: where the played agent works with bash, and where bundle code runs

BOX_BASE = "python:3.11-slim"  # the image the bundles' envs build FROM: a box is built on it too
BOX_PIDS_LIMIT = 256  # processes and threads in one box (a fork bomb stops there)
BOX_DOCKERFILE = f"""FROM {BOX_BASE}
RUN useradd --create-home --uid 1000 --user-group --shell /bin/bash agent \\
 && mkdir -p /app /home/agent/skills && chown agent:agent /app /home/agent/skills
WORKDIR /app
USER agent
CMD ["sleep", "infinity"]
"""
# The first process of our own box, its init, root's, with CAP_KILL and nothing else: on SIGUSR1
# (Docker's kill, from outside) it stops every other process of the box with one kill(-1), which the
# kernel makes atomic against forks (a fork bomb can't outrun it), with nothing forked (a box out of
# processes can't refuse it). As the init of its pid namespace it takes no signal from inside it but
# those it handles, so not even root there can kill it. It waits on a stdin no one writes to.
KEEPER_NAME = "agentenv-keeper"
BOX_KEEPER = r"""trap 'kill -KILL -1' USR1
trap '' TERM INT HUP QUIT PIPE
while :; do read -r _ || { sleep 3600 & wait $!; }; done"""
STOP_DEADLINE = 10.0  # seconds for the agent's processes in a box to be stopped
KILL_GRACE = 5.0  # seconds for a stopped command's output to end, before it is cut
# A command run with nothing the agent planted on the way in: a fresh, empty HOME (and, by the
# environment, no user site), so no startup file or hook of the agent's is read.
CLEAN_START = 'HOME=$(mktemp -d /tmp/.home.XXXXXXXX) && export HOME && exec "$@"'
# Kills every process of one call, found by the marker in its environment, group and all: run as
# the call's own user (in a box of a bundle's image, root has no CAP_KILL). Rounds, for a tree that
# forks meanwhile.
BOX_KILLER = r"""m="AGENTENV_CALL=$0"
for round in 1 2 3 4 5 6 7 8; do
  found=
  for d in /proc/[0-9]*; do
    grep -qzx "$m" "$d/environ" 2>/dev/null || continue
    s=$(cat "$d/stat" 2>/dev/null) || continue
    s=${s##*) }; set -- $s
    kill -9 "-$3" 2>/dev/null; kill -9 "${d#/proc/}" 2>/dev/null; found=1
  done
  [ -z "$found" ] && exit 0
done"""
# Clears paths: where a step loads files again, and where a verifier writes what it found. Run as
# the agent first (it may have made what it owns unreadable, or its folder read-only), then as root
# for what root put there: no user in the box may override permissions, so each works on what it
# owns. Every folder on the way is made searchable, and the path's own folder writable, by its
# owner; a link is removed, never followed. Prints each path still there (NUL-ended), or in a
# folder it can't search, so can't tell, and then exits 1.
CLEAR_PATHS = r"""left=0
for p; do
  a=; rest=${p#/}
  while case $rest in */*) true;; *) false;; esac; do
    a=$a/${rest%%/*}; rest=${rest#*/}
    [ -d "$a" ] && [ -O "$a" ] && chmod u+x -- "$a" 2>/dev/null
  done
  d=${p%/*}; d=${d:-/}
  [ -d "$d" ] && [ -O "$d" ] && chmod u+wx -- "$d" 2>/dev/null
  [ -d "$p" ] && [ ! -L "$p" ] && chmod -R u+rwX -- "$p" 2>/dev/null
  rm -rf -- "$p"
  if [ -e "$p" ] || [ -L "$p" ] || { [ -d "$d" ] && [ ! -x "$d" ]; }; then
    printf '%s\0' "$p"; left=1
  fi
done
exit $left"""
# Reads a verifier's result file, as root: a regular file only (never a link, which may lead to a
# file of root's, nor a FIFO or a device, which may never end), its size first, then its first
# bytes up to a cap, so a sparse file of gigabytes is never streamed. Prints the size on a line of
# its own, then the bytes; or exits 3, saying why it read nothing (nothing at all: it is missing).
READ_RESULT = r"""p=$1
if [ -L "$p" ]; then echo "is a link, not a regular file"; exit 3; fi
[ -e "$p" ] || exit 3
if [ ! -f "$p" ]; then echo "is not a regular file"; exit 3; fi
size=$(stat -c %s -- "$p") || exit 4
echo "$size"
exec head -c "$2" -- "$p"
"""


class BoxGone(AgentEnvError):
    """The box stopped (or was removed) under a command or a copy."""


class BoxFailed(EpisodeFailed):
    """A step's command or copy in a box failed on what the box holds (a folder full or made
    unreadable, a command that hangs or exits non-zero) or on the bundle's own mistake. In the
    agent's box once its turn has begun, that is the model's doing (Steps._run_step)."""


@dataclasses.dataclass(frozen=True)
class Ran:
    """A command's run in a box: its exit code (None when killed at its deadline), its stdout and
    stderr (each kept up to a cap), how many bytes it printed in all, and, past its deadline, what
    stopping it stopped."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    printed: int = 0
    stopped: str = ""

    @property
    def output(self) -> str:
        return (self.stdout + self.stderr).decode(errors="replace")


@dataclasses.dataclass(frozen=True)
class ResultFile:
    """A verifier's result file as read from a box: its first bytes (up to a cap) and its whole
    size; or, when nothing was read, why (none said: it is missing)."""

    head: bytes | None
    size: int = 0
    why: str = ""


class Box(abc.ABC):
    """A box an episode works in: the played agent's (its bash runs there) or a deploy_sandbox's.
    Commands run as its user ``agent`` in ``/app`` (or as root for the bundle's own steps),
    files are put in, and it is removed with its episode. Every command has a deadline, past
    which every process it started is killed."""

    kind = ""
    user, home, workdir = "agent", "/home/agent", "/app"
    has_bash = True

    def __init__(self, name: str):
        self.name = name

    @abc.abstractmethod
    async def run(
        self,
        argv: list[str],
        timeout: float,
        *,
        root: bool = False,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        cap: int = 1 << 20,
        stdin: bytes | None = None,
        clean: bool = False,
    ) -> Ran:
        """Run a command to its end or its deadline; BoxGone if the box is gone. ``stdin`` is
        what it reads (else nothing); ``clean`` runs it with nothing the agent planted on the way
        in: a fresh, empty HOME and no Python user site."""

    @abc.abstractmethod
    async def put(
        self, files: dict[str, bytes], dest: str, agent_owns: bool = True, replace: bool = False
    ) -> None:
        """Write files (path inside ``dest`` -> bytes), making folders as needed; with
        ``replace``, whatever stood at ``dest`` is removed first (loaded again, not merged)."""

    @abc.abstractmethod
    async def clear(self, paths: list[str]) -> str | None:
        """Remove whatever stands at each of ``paths`` (a folder, a file, a FIFO, a link, which is
        never followed), its folders made searchable and its own folder writable by whoever owns
        them: None once nothing does; else which paths are still there, and why, in a phrase."""

    async def replace_at(self, dest: str) -> None:
        """Clear ``dest`` before a step loads files there again (``put``'s ``replace``)."""
        if why := await self.clear([dest]):
            raise BoxFailed(
                f"{dest} in box {self.name!r} could not be cleared to load it again: {why}"
            )

    @abc.abstractmethod
    async def read_result(self, path: str, cap: int) -> ResultFile:
        """A verifier's result file at ``path``, as root reads it: a regular file only (not a
        link, a FIFO, a device or a folder), its size first, then at most ``cap`` bytes of it."""

    @abc.abstractmethod
    async def stop_all(self) -> None:
        """Stop every process of the agent's in the box, its background jobs too; EpisodeFailed
        (the machine's fault) if some could not be stopped."""

    @abc.abstractmethod
    async def fault(self) -> str | None:
        """After a command or copy failed: None when the box stands as the model's commands left
        it (or died of the memory they took), so the failure is the model's doing; else the
        machine's fault, in a sentence."""

    @abc.abstractmethod
    async def stopped(self) -> str | None:
        """None while the box runs; once it has stopped, a sentence saying how."""

    @abc.abstractmethod
    async def remove(self) -> None:
        """Remove the box and every process in it."""

    def path(self, path: str, base: str | None = None) -> str:
        """A path in the box: absolute as given, else under ``base`` (the working folder)."""
        return path if path.startswith("/") else f"{(base or self.workdir).rstrip('/')}/{path}"


def box_tar(files: dict[str, bytes], dest: str, uid: int) -> bytes:
    """Files as a tar rooted at /, for Docker's put_archive, owned by ``uid``; the folders inside
    ``dest`` made. ``dest`` and those above it are left to the extraction: an entry for /tmp would
    set its mode, and the agent could no longer write there."""
    import io
    import tarfile

    buffer = io.BytesIO()
    made: set[str] = set()
    base = dest.strip("/").count("/") + 1 if dest.strip("/") else 0
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for rel, data in files.items():
            full = (dest.rstrip("/") + "/" + rel).lstrip("/")
            parts = full.split("/")
            for n in range(base + 1, len(parts)):
                folder = "/".join(parts[:n])
                if folder not in made:
                    made.add(folder)
                    info = tarfile.TarInfo(folder)
                    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, uid, uid
                    tar.addfile(info)
            info = tarfile.TarInfo(full)
            info.size, info.mode, info.uid, info.gid = len(data), 0o644, uid, uid
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class ExecSocket:
    """The socket a docker exec is attached on, as the docker SDK hands it back, with the calls
    read_exec makes. A TLS daemon's is a socket already, and an SSH one's a channel with a
    socket's calls; a Unix socket's or plain TCP's comes wrapped for reading alone
    (socket.SocketIO), so a socket is made of a copy of its file descriptor, to write stdin to,
    half-close and cut. The wrapper is closed only with the socket: closing it hands its HTTP
    connection back to the SDK's pool, and the next call to the daemon would be written into the
    exec's stream."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.raw = (
            socket.socket(fileno=os.dup(stream.fileno()))
            if isinstance(stream, socket.SocketIO)
            else stream
        )
        # No timeout of the SDK's (its 120 s a call, which as the descriptor's non-blocking mode
        # the copy shares): a command that prints nothing for minutes is still running, and its
        # own deadline ends it (shut_stream), not a read given up as if it had ended.
        self.raw.settimeout(None)

    def sendall(self, data: bytes) -> None:
        self.raw.sendall(data)

    def recv(self, size: int) -> bytes:
        return self.raw.recv(size)

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        try:
            self.raw.close()
        finally:
            if self.raw is not self.stream:
                self.stream.close()


def read_exec(raw: Any, stdin: bytes | None, cap: int) -> tuple[bytes, bytes, int]:
    """A docker exec's output, read from its attached socket (ExecSocket) until the command and
    everything holding its output are gone: stdout and stderr, each kept up to ``cap`` bytes, and
    how many it printed in all. ``stdin`` is written first, then closed. (Docker frames the
    output: one byte for the stream, three of padding, four of size, then the bytes.)"""
    kept = {1: bytearray(), 2: bytearray()}
    printed, buffer = 0, bytearray()
    try:
        if stdin is not None:
            raw.sendall(stdin)
            raw.shutdown(socket.SHUT_WR)
        while chunk := raw.recv(65536):
            buffer += chunk
            while len(buffer) >= 8 and len(buffer) >= 8 + (
                size := int.from_bytes(buffer[4:8], "big")
            ):
                out = kept.get(buffer[0], kept[1])
                printed += size
                if len(out) < cap:
                    out += buffer[8 : 8 + min(size, cap - len(out))]
                del buffer[: 8 + size]
    except OSError:  # cut by a caller that stopped waiting (shut_stream)
        pass
    finally:
        with contextlib.suppress(OSError):
            raw.close()
    return bytes(kept[1]), bytes(kept[2]), printed


def shut_stream(raw: Any) -> None:
    """Cut a command's output stream (an ExecSocket), so the thread reading it (read_exec) ends."""
    with contextlib.suppress(OSError):
        raw.shutdown(socket.SHUT_RDWR)


class DockerBox(Box):
    """A box that is a container of its own: no network, every capability dropped, bounded
    processes and memory; each command a ``docker exec``, its output read as it comes on a thread
    of its own (holding none of the daemon's slots). Our own box (not a bundle's image) has a
    keeper for its first process, which in the agent's box stops every process of the agent's at
    once."""

    kind = "docker"

    def __init__(
        self,
        daemon: DockerDaemon,
        container: Any,
        name: str,
        user: str | None = "agent",
        agents: bool = False,
    ):
        super().__init__(name)
        self.daemon, self.container = daemon, container
        self.user = user or "root"
        self.exec_user = user  # None: the image's own user, in its own working folder
        # the played agent's box (our own image, with its keeper): a deadline of its user's
        # commands stops every process of the agent's, and so does the end of a turn
        self.agents = agents and user is not None
        self.opening: set[asyncio.Future] = set()  # commands the daemon is starting
        if user is None:
            self.workdir = ((container.attrs or {}).get("Config") or {}).get("WorkingDir") or "/"

    async def run(
        self,
        argv: list[str],
        timeout: float,
        *,
        root: bool = False,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        cap: int = 1 << 20,
        stdin: bytes | None = None,
        clean: bool = False,
    ) -> Ran:
        import docker.errors

        marker = uuid.uuid4().hex
        user = "0" if root else self.exec_user
        environment = {**(env or {}), "AGENTENV_CALL": marker}
        if clean and not root:
            argv, environment["PYTHONNOUSERSITE"] = ["sh", "-c", CLEAN_START, "sh", *argv], "1"
        workdir = cwd or (self.workdir if self.exec_user else None)
        # (docker runs each exec as a session leader of its own: its group is the call's)
        opened = asyncio.ensure_future(
            self.daemon.call(
                self._open,
                argv,
                user or "",
                workdir,
                environment,
                stdin is not None,
                timeout=timeout + 5,
            )
        )
        self.opening.add(opened)
        opened.add_done_callback(self.opening.discard)
        reading: asyncio.Future | None = None
        stream: Any = None
        try:
            async with asyncio.timeout(timeout):
                exec_id, stream = await asyncio.shield(opened)
                reading = self.daemon.streamed(read_exec, stream, stdin, cap)
                out, err, printed = await asyncio.shield(reading)
            return Ran(await self._exit_code(exec_id), out, err, False, printed)
        except asyncio.TimeoutError:
            if reading is None:  # the daemon never started it: the machine's fault
                self._abandon(opened, marker)
                if why := await self.stopped():
                    raise BoxGone(f"box {self.name!r} stopped: {why}") from None
                raise EpisodeFailed(
                    f"the Docker daemon did not start a command in box "
                    f"{self.name!r} within {timeout:g}s; it may be overloaded "
                    "(lower --max-concurrent-envs)",
                    PROVIDER_UNAVAILABLE,
                ) from None
            stopped = await self._stop(marker, root, reading, stream)
            return Ran(None, b"", b"", True, 0, stopped)
        except asyncio.CancelledError:  # its caller gave up (the turn closed, the client left)
            if reading is not None:
                await asyncio.shield(self._stop(marker, root, reading, stream))
            else:
                self._abandon(opened, marker)
            raise
        except docker.errors.APIError as exc:
            if gone := await self._gone(exc):
                raise gone from None
            return Ran(
                126, b"", f"error: the command couldn't start: {short(str(exc), 300)}\n".encode()
            )
        except AgentEnvError:
            raise
        except Exception as exc:  # noqa: BLE001 - the daemon's stream broke
            why = await self.stopped() or f"{type(exc).__name__}: {short(str(exc), 300)}"
            raise BoxGone(f"box {self.name!r} failed under a command: {why}") from None

    def _open(
        self,
        argv: list[str],
        user: str,
        workdir: str | None,
        environment: dict[str, str],
        stdin: bool,
    ) -> tuple[str, Any]:
        """Create an exec and start it, attached: its id and its socket (ExecSocket)."""
        api = self.daemon.client.api
        made = api.exec_create(
            self.container.id,
            argv,
            stdout=True,
            stderr=True,
            stdin=stdin,
            user=user,
            workdir=workdir,
            environment=environment,
        )
        return made["Id"], ExecSocket(api.exec_start(made["Id"], socket=True))

    async def _exit_code(self, exec_id: str) -> int | None:
        """An exec's exit code, once the daemon has seen its process exit: its output may end a
        moment before, and the daemon sends no event of it to wait on, so it is asked again, a
        little later each time, for a second at most."""
        pause = 0.005
        for _ in range(8):
            inspected = await self.daemon.urgent(
                self.daemon.client.api.exec_inspect, exec_id, timeout=10
            )
            if inspected.get("ExitCode") is not None or not inspected.get("Running"):
                return inspected.get("ExitCode")
            await asyncio.sleep(pause)
            pause *= 2
        return inspected.get("ExitCode")

    def _abandon(self, opened: asyncio.Future, marker: str) -> None:
        """A command whose caller stopped waiting before it started: once the daemon has started
        it (if ever), it is killed and its output cut."""

        def undo(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                shut_stream(done.result()[1])
                self.daemon.removing(asyncio.ensure_future(self._kill(marker)))

        opened.add_done_callback(undo)

    async def _stop(self, marker: str, root: bool, reading: asyncio.Future, stream: Any) -> str:
        """Stop a command past its deadline, or whose caller gave up, with its whole tree: for
        the agent's commands in our own box, every process of the agent's (however it was
        started, nothing can escape that); else the processes that carry the call's marker. Then
        let its output end, or cut it. What was stopped, in a phrase the model reads."""
        if self.agents and not root:
            await self.stop_all()
            said = (
                "every process of yours in the box was stopped: the command, all it started, "
                "and anything left running in the background"
            )
        else:
            said = (
                "it was killed, with every process it started"
                if await self._kill(marker)
                else "it could not be killed, and runs on until the episode ends"
            )
        if not (await asyncio.wait({reading}, timeout=KILL_GRACE))[0]:
            shut_stream(stream)
        return said

    async def stop_all(self) -> None:
        """Stop every process of the agent's: the keeper kills all but itself and the init, again
        while ``docker top`` still shows one of the agent's, within STOP_DEADLINE. The keeper is
        signalled again, and this returns, only once it has done as it was told (the signal no
        longer pending, the keeper waiting again): a kill of its that came later would land on
        the next command, a verifier's reading what it found."""
        if not self.agents:  # no box of the agent's: it has no processes there
            return
        import docker.errors

        left: list[str] = []
        try:
            async with asyncio.timeout(STOP_DEADLINE):
                if self.opening:  # a command the daemon is starting now is stopped too
                    await asyncio.wait(set(self.opening))
                while True:
                    await self.daemon.urgent(self.container.kill, signal="SIGUSR1", timeout=10)
                    pause = 0.002  # (the host tells nothing when the keeper is done)
                    while not (seen := await self._top())[0]:
                        await asyncio.sleep(pause)
                        pause = min(2 * pause, 0.1)
                    if not (left := seen[1]):
                        return
        except docker.errors.APIError as exc:
            if gone := await self._gone(exc):
                raise gone from None
            raise EpisodeFailed(
                f"the agent's processes in box {self.name!r} could not be stopped: "
                f"the Docker daemon said {short(str(exc), 300)}",
                PROVIDER_UNAVAILABLE,
            ) from None
        except asyncio.TimeoutError:
            raise EpisodeFailed(
                f"{len(left) or 'some'} process(es) of the agent's in box "
                f"{self.name!r} still ran after {STOP_DEADLINE:g}s of stopping "
                "them (or the daemon did not answer)",
                ENV_FAILED,
            ) from None

    async def _gone(self, exc: Exception) -> BoxGone | None:
        """The daemon's error as the box's end, when it came of the box being gone or stopped."""
        import docker.errors

        if isinstance(exc, docker.errors.NotFound):
            return BoxGone(f"box {self.name!r} is gone: its container was removed")
        if why := await self.stopped():
            return BoxGone(f"box {self.name!r} stopped: {why}")
        return None

    async def _agents_processes(self) -> list[str]:
        """The box's live processes that are not root's (the keeper and the init are, and the
        agent can never be), as the host sees them."""
        return (await self._top())[1]

    async def _top(self) -> tuple[bool, list[str]]:
        """The box as the host sees it: whether its first process, the keeper, waits with no
        SIGUSR1 pending (done with every one it was sent), and _agents_processes."""
        top = await self.daemon.urgent(
            self.container.top, ps_args="-eo pid,uid,stat,pending", timeout=10
        )
        rows = top.get("Processes") or []
        first = str(((self.container.attrs or {}).get("State") or {}).get("Pid", ""))
        keeper = next((row for row in rows if row[0] == first), None)
        pending = int(keeper[3], 16) if keeper and re.fullmatch(r"[0-9a-fA-F]+", keeper[3]) else 0
        idle = keeper is None or (
            not keeper[2].startswith("R") and not pending >> (signal.SIGUSR1 - 1) & 1
        )
        root = keeper[1] if keeper else "0"
        return idle, [pid for pid, uid, stat, _ in rows if uid != root and not stat.startswith("Z")]

    async def _kill(self, marker: str) -> bool:
        """Kill every process of the call marked ``marker``: from this machine when the daemon
        runs here (no process of the box is needed, so a box out of processes can't refuse
        it), else with a killer run in the box; within seconds either way. False if neither
        could."""
        with contextlib.suppress(Exception):
            if await self.daemon.urgent(self._kill_from_host, marker, timeout=10):
                return True
        with contextlib.suppress(Exception):
            await self.daemon.urgent(
                self.container.exec_run,
                ["sh", "-c", BOX_KILLER, marker],
                user=self.exec_user or "",
                timeout=10,
            )
            return True
        log.warning(
            "Could not kill a command in box %r past its deadline (the box may be out of "
            "processes); it runs on until its episode ends.",
            self.name,
        )
        return False

    def _kill_from_host(self, marker: str) -> bool:
        """The box's processes as this machine sees them (docker top), those with the marker in
        their environment killed, group and all; False where this machine can't see them, or
        can't hold them by pidfd. Each is held by a pidfd opened before its environment is read,
        and killed only while that pidfd's process still runs: a pid the kernel has given to
        another process meanwhile (a box's processes come and go by the thousand) is never
        signalled."""
        needle = f"AGENTENV_CALL={marker}".encode()
        for _ in range(10):  # rounds, for a tree that forks meanwhile
            found = 0
            for row in self.container.top(ps_args="-eo pid").get("Processes") or []:
                pid = int(row[0])
                if (held := pidfd(pid)) is None:
                    if os.path.exists(f"/proc/{pid}"):  # no pidfds on this system
                        return False
                    continue  # gone already
                try:
                    try:
                        environ = Path(f"/proc/{pid}/environ").read_bytes()
                        group = int(_process_stat(pid)[2])
                    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                        continue
                    except OSError:  # not ours to read: another user's daemon
                        return False
                    if needle in environ.split(b"\0") and not has_ended(held):
                        found += 1
                        with contextlib.suppress(OSError):
                            os.killpg(group, signal.SIGKILL)
                        with contextlib.suppress(OSError):
                            signal.pidfd_send_signal(held, signal.SIGKILL)
                finally:
                    os.close(held)
            if not found:
                return True
        return True

    async def put(
        self, files: dict[str, bytes], dest: str, agent_owns: bool = True, replace: bool = False
    ) -> None:
        if replace:
            await self.replace_at(dest)
        data = box_tar(files, dest, 1000 if agent_owns and self.exec_user else 0)
        if self.exec_user is None:  # an image of the bundle's: its disk, as it is
            try:
                await self.daemon.call(self.container.put_archive, "/", data, timeout=120)
            except Exception as exc:  # noqa: BLE001 - docker raises many kinds
                if gone := await self._gone(exc):
                    raise gone from None
                raise BoxFailed(
                    f"files could not be put in box {self.name!r} at {dest}: {short(str(exc), 300)}"
                ) from None
            return
        # Our own box's root is read-only, its writable places bounded tmpfs mounts, where
        # Docker's archive API can't reach: tar reads the files from its stdin. Root (with no
        # capability but KILL) may write only in /tmp; elsewhere the agent owns the files.
        root = not agent_owns and (dest == "/tmp" or dest.startswith("/tmp/"))
        ran = await self.run(
            ["tar", "-x", "-m", "--no-same-owner", "-C", "/"], 120, root=root, stdin=data
        )
        if ran.timed_out or ran.exit_code != 0:
            said = (
                "it did not finish within 120s"
                if ran.timed_out
                else short(ran.output.strip() or f"tar exited {ran.exit_code}", 500)
            )
            raise BoxFailed(f"the files could not be put in box {self.name!r} at {dest}: {said}")

    async def clear(self, paths: list[str]) -> str | None:
        said, left = [], list(paths)
        for root in (False, True) if self.exec_user else (True,):
            ran = await self.run(["sh", "-c", CLEAR_PATHS, "sh", *left], 60, root=root)
            if ran.exit_code == 0:
                return None
            if ran.exit_code == 1:
                left = [p for p in ran.stdout.decode(errors="replace").split("\0") if p] or left
            said.append(
                f"as {'root' if root else self.user}: "
                + (
                    "it did not finish within 60s"
                    if ran.timed_out
                    else short(
                        ran.stderr.decode(errors="replace") or f"exit code {ran.exit_code}", 300
                    )
                )
            )
        return f"{', '.join(left)} still there ({'; '.join(said)})"

    async def read_result(self, path: str, cap: int) -> ResultFile:
        ran = await self.run(
            ["sh", "-c", READ_RESULT, "sh", path, str(cap)], 60, root=True, cap=cap + 32
        )
        if ran.timed_out:
            return ResultFile(None, why="could not be read within 60s")
        if ran.exit_code == 3:
            return ResultFile(None, why=ran.stdout.decode(errors="replace").strip())
        size, _, head = ran.stdout.partition(b"\n")
        if ran.exit_code != 0 or not size.isdigit():
            return ResultFile(
                None,
                why="could not be read: "
                + short(ran.stderr.decode(errors="replace") or f"exit code {ran.exit_code}", 300),
            )
        return ResultFile(head, int(size))

    async def fault(self) -> str | None:
        import docker.errors

        try:
            await self.daemon.urgent(self.container.reload, timeout=10)
        except docker.errors.NotFound:
            return f"box {self.name!r} is gone: its container was removed from outside"
        except Exception as exc:  # noqa: BLE001 - docker raises many kinds
            return (
                f"the Docker daemon did not answer about box {self.name!r} ({short(str(exc), 200)})"
            )
        state = self.container.attrs.get("State") or {}
        if state.get("Status") == "running" or state.get("OOMKilled"):
            return None
        return f"box {self.name!r} stopped: its container exited with code {state.get('ExitCode')}"

    async def stopped(self) -> str | None:
        return await self.daemon.exited(self.container)

    async def remove(self) -> None:
        await self.daemon.remove(self.container)


async def process_exit(proc: asyncio.subprocess.Process) -> int:
    """A child's exit code once it exits, whether or not its pipes are still held open: Linux's
    pidfd says when, and the loop's child watcher then records the code."""
    if proc.returncode is None:
        loop = asyncio.get_running_loop()
        try:
            fd: int | None = os.pidfd_open(proc.pid)
        except ProcessLookupError:  # it exited and the watcher's thread reaped it already
            fd = None
        except (AttributeError, OSError):  # no pidfds: the pipes' closing must do
            return await proc.wait()
        if fd is not None:
            try:  # reaped, its pid may be another's already: only a child of ours answers
                os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                os.close(fd)
                fd = None
            except (AttributeError, OSError):  # a kernel without P_PIDFD: the pidfd as is
                pass
        if fd is not None:
            try:
                exited = loop.create_future()
                loop.add_reader(fd, settle, exited)
                try:
                    await exited
                finally:
                    loop.remove_reader(fd)
                # the code read without reaping the child (the loop's watcher still does): its
                # thread may be slow to run on a loaded machine, and proc.wait() would wait for
                # the pipes
                with contextlib.suppress(AttributeError, OSError):
                    info = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOWAIT)
                    if info is not None and proc.returncode is None:
                        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            finally:
                os.close(fd)
        for _ in range(500):  # reaped already: the watcher records it soon
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.002)
    return proc.returncode if proc.returncode is not None else await proc.wait()


class LocalBox(Box):
    """A box that is a work folder on this machine: commands run here, as this server's user,
    with the folder for ``/app``. It isolates nothing; it is for bundles the user trusts."""

    kind = "local"

    def __init__(self, folder: Path, name: str, owner: str):
        super().__init__(name)
        self.folder, self.owner = folder, owner
        self.workdir, self.home = str(folder / "app"), str(folder / "home")
        self.has_bash = shutil.which("bash") is not None
        # the commands whose group may still run (under way, or a background job holding their
        # pipes): killed, group and all, when the box is removed
        self.running: dict[int, asyncio.subprocess.Process] = {}

    def here(self, path: str) -> str:
        """A box path on this machine: /app and /home/agent are the work folder's."""
        for box, local in (
            ("/app", self.workdir),
            ("/home/agent", self.home),
            ("/tmp", str(self.folder / "tmp")),
        ):
            if path == box or path.startswith(box + "/"):
                return local + path[len(box) :]
        return path

    def _script(self, argv: list[str]) -> list[str]:
        # the script of a `bash -c`: its /app and /home/agent paths are the work folder's too
        if len(argv) >= 3 and argv[1] == "-c" and Path(argv[0]).name in ("bash", "sh"):
            script = re.sub(
                r"(?<![\w.-])(/app|/home/agent|/tmp)(?=/|\b|$)", lambda m: self.here(m[1]), argv[2]
            )
            return [argv[0], "-c", script, *argv[3:]]
        return [self.here(a) if a.startswith("/") else a for a in argv]

    async def run(
        self,
        argv: list[str],
        timeout: float,
        *,
        root: bool = False,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        cap: int = 1 << 20,
        stdin: bytes | None = None,
        clean: bool = False,
    ) -> Ran:
        home = self.home
        if clean:  # a fresh, empty HOME in the box's tmp, and no user site
            home = await asyncio.to_thread(tempfile.mkdtemp, prefix=".home.", dir=self.here("/tmp"))
        environ = {
            **{k: v for k, v in os.environ.items() if k != "AGENTENV_TOKEN"},
            "HOME": home,
            "PWD": self.here(cwd or "/app"),
            "AGENTENV_OWNER": self.owner,
            **({"PYTHONNOUSERSITE": "1"} if clean else {}),
            **(env or {}),
        }
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._script(argv),
                cwd=self.here(cwd or "/app"),
                env=environ,
                stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            return Ran(126, b"", f"error: the command couldn't start: {exc}\n".encode())
        self.running[proc.pid] = proc
        if stdin is not None:
            assert proc.stdin is not None  # (a pipe: asked for above)
            proc.stdin.write(stdin)
            with contextlib.suppress(ConnectionError):
                await proc.stdin.drain()
            proc.stdin.close()
        printed = 0
        out, err = bytearray(), bytearray()

        async def drain(stream: asyncio.StreamReader, kept: bytearray) -> None:
            nonlocal printed
            while chunk := await stream.read(65536):
                printed += len(chunk)
                if len(kept) < cap:
                    kept += chunk[: cap - len(kept)]

        assert proc.stdout is not None and proc.stderr is not None  # (pipes, as asked)
        readers = [
            asyncio.ensure_future(drain(s, k)) for s, k in ((proc.stdout, out), (proc.stderr, err))
        ]
        try:
            try:
                # its exit, not its pipes' closing (proc.wait() waits for both): a background
                # job may hold them long after
                code = await asyncio.wait_for(process_exit(proc), timeout)
            except asyncio.TimeoutError:
                self._kill(proc.pid)
                await proc.wait()
                await asyncio.wait(readers, timeout=1)
                return Ran(
                    None,
                    b"",
                    b"",
                    True,
                    printed,
                    "it was killed, with every process of its group (what left the group, a "
                    "local box can't reach)",
                )
            # a background job that holds the pipes: read them a second longer, then let go
            await asyncio.wait(readers, timeout=1)
            return Ran(code, bytes(out), bytes(err), False, printed)
        except asyncio.CancelledError:
            self._kill(proc.pid)
            raise
        finally:
            if all(r.done() for r in readers):  # nothing of it holds its pipes: it is over
                self.running.pop(proc.pid, None)
            for reader in readers:
                reader.cancel()

    @staticmethod
    def _kill(group: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)

    async def put(
        self, files: dict[str, bytes], dest: str, agent_owns: bool = True, replace: bool = False
    ) -> None:
        if replace:
            await self.replace_at(dest)

        def write() -> None:
            for rel, data in files.items():
                path = Path(self.here(dest.rstrip("/") + "/" + rel))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            raise BoxFailed(
                f"the files could not be put in box {self.name!r} at {dest}: {exc}"
            ) from None

    async def clear(self, paths: list[str]) -> str | None:
        def remove() -> str | None:
            left = []
            for path in paths:
                try:
                    self._remove(Path(self.here(path)))
                except OSError as exc:
                    left.append(f"{path} ({exc.strerror or exc})")
            return f"{', '.join(left)} still there" if left else None

        return await asyncio.to_thread(remove)

    @classmethod
    def _remove(cls, where: Path) -> None:
        """Remove what stands at ``where`` (a link, never followed), its folder made writable if
        that is what kept it."""
        if not where.is_symlink() and not where.exists():
            return
        try:
            cls._unlink(where)
        except PermissionError:
            os.chmod(where.parent, where.parent.stat().st_mode & 0o7777 | 0o300)
            cls._unlink(where)

    @staticmethod
    def _unlink(where: Path) -> None:
        if where.is_symlink() or not where.is_dir():
            where.unlink()
            return
        os.chmod(where, 0o700)  # and each folder in it, before it is walked
        for folder, folders, _ in os.walk(where):
            for name in folders:
                if not os.path.islink(inner := os.path.join(folder, name)):
                    with contextlib.suppress(OSError):
                        os.chmod(inner, 0o700)
        shutil.rmtree(where)

    async def read_result(self, path: str, cap: int) -> ResultFile:
        def read() -> ResultFile:
            import stat

            try:  # (a FIFO opened without blocking, then refused)
                fd = os.open(self.here(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except (FileNotFoundError, NotADirectoryError):
                return ResultFile(None)
            except OSError as exc:
                return ResultFile(
                    None,
                    why="is a link, not a regular file"
                    if exc.errno == errno.ELOOP
                    else f"could not be read: {exc}",
                )
            try:
                found = os.fstat(fd)
                if not stat.S_ISREG(found.st_mode):
                    return ResultFile(None, why="is not a regular file")
                head = b""
                while len(head) < cap and (more := os.read(fd, cap - len(head))):
                    head += more
                return ResultFile(head, found.st_size)
            finally:
                os.close(fd)

        return await asyncio.to_thread(read)

    async def stop_all(self) -> None:
        # what left its process group (setsid, a double fork) is out of reach here: a local box
        # isolates nothing, and its rewards are only as sound as the bundle's trust in the model
        for group in self.running:
            self._kill(group)

    async def fault(self) -> str | None:
        return None  # a work folder: nothing but the model's commands breaks it

    async def stopped(self) -> str | None:
        return None if self.folder.is_dir() else "its work folder is gone"

    async def remove(self) -> None:
        for group in self.running:
            self._kill(group)
        if self.running:  # their pipes close once their jobs are dead
            await asyncio.wait(
                [asyncio.ensure_future(p.wait()) for p in self.running.values()], timeout=5
            )
        self.running.clear()
        await asyncio.to_thread(shutil.rmtree, self.folder, True)


# -- Ray: envs placed across a cluster
#
# Ray places, nothing of ours schedules: each episode's env gets a placement group sized by its
# deploy_env step, Ray picks a node with room (or queues it while the cluster is full), and the
# node's host actor (one per node, long-lived, no CPU of its own) starts the env there as a local
# process bound to the node's address, or as a container of the node's own Docker daemon
# published on that address. Tool calls then go straight to that address; only the env's
# liveness and output go through the actor.

RAY_INSTALL = "pip install 'agentenv-py[ray]' (or: pip install 'ray[default]>=2.50,<3')"
RAY_ENV_CPU = 1.0  # a deploy_env step's cpu when it names none: Ray's task default
RAY_ENV_MEMORY_MB = 256  # its memory_mb when it names none (placement bookkeeping only)
RAY_RESOURCE_SHARE = 0.001  # of --ray-resource each env asks, so declaring 1 marks a node
RAY_CONNECT_TIMEOUT = 30.0  # joining the cluster at start-up
RAY_CALL_TIMEOUT = 10.0  # a call to a host actor (output, a port's owner)
RAY_PREPARE_TIMEOUT = 1800.0  # a node's host asking its daemon and building the env images
RAY_LIVENESS_TIMEOUT = 2.0  # a host's answer whether an env still runs (else: taken as up)
RAY_BOOT_HOLD = 10.0  # a boot stops counting against its node's gate after this


RAY_OWN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def ray_node_sandboxes() -> tuple[str, ...]:
    """What --ray-node-sandbox offers: auto, then the providers that serve Ray's nodes."""
    return (AUTO, *providers_that(lambda able: able.serves_ray_nodes))


def ray_address(value: Any, what: str) -> str:
    """A Ray cluster's address as a user gave it: auto, HOST:PORT or ray://HOST:PORT."""
    text = value.strip() if isinstance(value, str) else ""
    host, _, port = text.removeprefix("ray://").rpartition(":")
    if text != "auto" and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise AgentEnvError(
            f"{what}: it must be the Ray cluster's head as HOST:PORT (such as "
            "10.0.0.5:6379, the address ray start --head printed), "
            "ray://HOST:PORT, or auto (the cluster ray start made on this "
            "machine)"
        )
    return text


def ray_resource(value: Any, what: str) -> str:
    """The custom resource Ray's env nodes declare, as a user gave it."""
    text = value.strip() if isinstance(value, str) else ""
    if (
        not text
        or any(c.isspace() for c in text)
        or text in RAY_OWN_RESOURCES
        or text.startswith("node:")
    ):
        raise AgentEnvError(
            f"{what}: it must name a custom resource that the env nodes declare "
            "(ray start --resources='{\"env_node\": 1}'), such as env_node, not "
            "one of Ray's own (CPU, GPU, memory, node:...)"
        )
    return text


def ray_node_sandbox(value: Any, what: str) -> str:
    """What runs envs on each Ray node, as a user gave it."""
    text = value.strip() if isinstance(value, str) else ""
    if text not in (offered := ray_node_sandboxes()):
        ranked = auto_order(lambda able: able.serves_ray_nodes)
        raise AgentEnvError(
            f"{what}: it must be "
            + ", ".join(
                [
                    f"auto (on each node, the first of {', '.join(ranked)} that it can run)",
                    *offered[1:-1],
                ]
            )
            + f" or {offered[-1]}"
        )
    return text


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """Where the Ray sandbox finds its cluster and nodes: the cluster's address, the custom
    resource that marks env nodes (none: any node with CPUs), the deploy deadline a placement no
    node can ever meet is given before it fails, and the sandbox each node runs its envs in
    (auto: Docker where the node's daemon answers, else local processes)."""

    address: str = "auto"
    resource: str | None = None
    deploy_timeout: float = Settings.deploy_timeout
    node_sandbox: str = "auto"  # what runs envs on each node: auto, docker or local

    @classmethod
    def of(cls, settings: Settings) -> RayOptions:
        """The Ray sandbox's options, read from checked settings."""
        return cls(
            cls.address_from(settings.ray_address, settings.ray_head_node_address),
            settings.ray_resource,
            settings.deploy_timeout,
            settings.ray_node_sandbox or "auto",
        )

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
        except OSError:  # another host on this machine unpacked it first
            shutil.rmtree(unpacking, ignore_errors=True)
    return EnvSpec(**{**env, "folder": folder, "dockerfile": folder / env["dockerfile"]})


class EnvHost:
    """A node's host actor, run by Ray on that node: the node's sandbox (the first provider that
    serves Ray's nodes and can be had there, in auto's order: Docker where its daemon answers,
    else local processes; unless told which), its envs by key, and the node's boot gate (sized
    by the CPUs the node declares to Ray, held until an env answers).

    Ray runs it from this file's own text (``host_actor``), so a node needs Ray (and the docker
    package, for Docker), not agentenv.py; it lives as long as the server's connection to the
    cluster, and its envs die with it: local ones by Linux's parent-death signal, containers by a
    reaper process that removes them the moment the host's process is gone."""

    def __init__(
        self,
        address: str,
        envs: dict[str, tuple[dict[str, Any], bytes]],
        state: str | None,
        cpus: float,
        sandbox: str = "auto",
    ):
        if state:
            os.environ["AGENTENV_STATE_DIR"] = state
        self.address, self.cores, self.cpus, self.mode = address, os.cpu_count() or 2, cpus, sandbox
        self.owner = owner_id()
        self.sandbox: Sandbox | None = None  # once prepared
        self.why = ""  # why the node's sandbox is not auto's first choice, if not
        self.envs = {name: node_env(spec, archive) for name, (spec, archive) in envs.items()}
        self.instances: dict[str, Instance] = {}
        self._preparing: asyncio.Future | None = None
        # Two per CPU, as the runtime's own gate is sized on one machine, but per CPU the node
        # declares: a node that lends Ray 2 of its 64 cores boots envs on those 2 (and one that
        # declares more than it has is taken at its word, as Ray takes it).
        self.boot_slots = max(2, math.ceil(2 * cpus))
        self.gate = asyncio.Semaphore(self.boot_slots)

    async def prepare(self) -> dict[str, Any]:
        """Choose the node's sandbox and make its envs ready (images built), once; a host Ray
        restarts in place does it again on its first launch. What the node is, after."""
        if self._preparing is None:
            self._preparing = asyncio.ensure_future(self._prepare())
        try:
            await asyncio.shield(self._preparing)
        except BaseException:
            self._preparing = None
            raise
        return await self.node()

    async def _prepare(self) -> None:
        ranked = auto_order(lambda able: able.serves_ray_nodes)
        told = self.mode != AUTO
        if told and self.mode not in ray_node_sandboxes():
            raise AgentEnvError(
                f"--ray-node-sandbox {self.mode}, and Ray node {self.address} has "
                "no such sandbox; pass one of " + ", ".join(ray_node_sandboxes())
            )
        tried: list[str] = []
        for kind in [self.mode] if told else ranked:
            try:
                sandbox = await PROVIDERS[kind].on_ray_node(self.owner, self.address)
            except AgentEnvError as exc:
                if told:
                    raise AgentEnvError(
                        f"--ray-node-sandbox {kind}, and on Ray node {self.address} {exc}"
                    ) from None
                tried.append(str(exc).split(";")[0])  # "no Docker daemon answered (...)"
                continue
            await sandbox.prepare(list(self.envs.values()))
            self.sandbox = sandbox
            self.why = (
                f"--ray-node-sandbox {kind}"
                if told and ranked[:1] != [kind]
                else ", and ".join(tried)
            )
            return
        raise AgentEnvError(
            f"on Ray node {self.address} no sandbox could run envs: " + "; ".join(tried)
        )

    async def node(self) -> dict[str, Any]:
        """What the node is: its address, the CPUs it declares and its cores, its boot gate, its
        sandbox once prepared (where it runs envs, and why when not auto's first choice), the
        envs it can start."""
        sandbox = self.sandbox
        return {
            "address": self.address,
            "cpus": self.cpus,
            "cores": self.cores,
            "boot_slots": self.boot_slots,
            "pid": os.getpid(),
            "envs": sorted(self.envs),
            "sandbox": sandbox.kind if sandbox else "",
            "why": self.why,
            "place": sandbox.place if sandbox else "",
            "networks": {name: sandbox.network_mode(env) for name, env in self.envs.items()}
            if sandbox
            else {},
        }

    async def launch(self, env: str, episode: str, limits: dict[str, Any]) -> tuple[str, str, bool]:
        """Start an env; its key, its base URL, and whether it is known to be the env itself
        that answers there, once it answers (or has had the gate's hold)."""
        await self.prepare()
        assert self.sandbox is not None  # prepared
        async with self.gate:
            instance = await self.sandbox.launch(self.envs[env], episode, limits)
            key = uuid.uuid4().hex
            self.instances[key] = instance
            its_own = await self._booted(instance)
        return key, instance.base_url, its_own

    async def _booted(self, instance: Instance) -> bool:
        """Hold the gate until the env answers, has exited, or has had RAY_BOOT_HOLD; whether
        it is known to be the env itself that answers."""
        deadline = time.monotonic() + RAY_BOOT_HOLD
        while time.monotonic() < deadline:  # polling: a port being bound sends no event
            if (up := await instance.up()) is not None:
                return up
            await asyncio.sleep(0.02)
        return False

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

    async def lost_its_port(self, key: str) -> bool:
        instance = self.instances.get(key)
        return instance is not None and await instance.lost_its_port()

    async def remove(self, key: str) -> None:
        if instance := self.instances.pop(key, None):
            await instance.remove()

    async def live(self) -> int:
        return len(self.instances)


async def http_answers(base_url: str, timeout: float = 1.0) -> bool:
    """Whether an HTTP server answers at ``base_url``: a reply's first bytes, not only an
    accepted connection (Docker's port proxy accepts for a container that does not listen yet)."""
    host, _, port = base_url.split("//", 1)[1].rpartition(":")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(b"GET / HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
        await writer.drain()
        return (await asyncio.wait_for(reader.read(5), timeout)) == b"HTTP/"
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        writer.close()


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
            sys.modules[module.__name__] = module  # dataclasses look their module up
            exec(compile(source, "agentenv.py", "exec"), module.__dict__)
            self.host = module.EnvHost(*args)

    for name in (
        "prepare",
        "node",
        "launch",
        "exited",
        "output",
        "answers_itself",
        "lost_its_port",
        "remove",
        "live",
    ):

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

    def __init__(
        self,
        sandbox: RaySandbox,
        node: RayNode,
        key: str,
        base_url: str,
        group: Any,
        its_own: bool = False,
    ):
        self.sandbox, self.node, self.key, self.group = sandbox, node, key, group
        self.base_url = base_url
        # The host answered the launch having seen the env itself listen on its port: the env is
        # up and the port its own, and a deploy need not ask the host again (two round trips).
        self._its_own = its_own
        self._checked = time.monotonic() if its_own else 0.0
        self._gone: str | None = None  # why the env's host is gone, once it is

    @property
    def where(self) -> str:
        return self.node.address

    async def exited(self, settle: float = 0.0) -> str | None:
        if self._gone:
            return self._gone
        if not settle and time.monotonic() - self._checked < 0.25:  # an actor call 4 times a second
            return None
        self._checked = time.monotonic()
        try:
            return await self.sandbox.ask(
                self.node.host.exited.remote(self.key, settle), settle + RAY_LIVENESS_TIMEOUT
            )
        except asyncio.TimeoutError:
            log.info(
                "The host actor of node %s did not answer within %gs; taking its env to be "
                "still up.",
                self.node.address,
                settle + RAY_LIVENESS_TIMEOUT,
            )
            return None
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds
            self._gone = (
                f"the host actor of node {self.node.address} is gone "
                f"({type(exc).__name__}), and its envs with it"
            )
            return self._gone

    async def output(self) -> str:
        if self._gone:  # its output went with it; a restarting host is slow to ask
            return "(its output went with its host actor)"
        try:
            return await self.sandbox.ask(self.node.host.output.remote(self.key), RAY_CALL_TIMEOUT)
        except Exception as exc:  # noqa: BLE001
            return (
                f"(its output could not be read from node {self.node.address}: "
                f"{type(exc).__name__})"
            )

    async def answers_itself(self) -> bool:
        if self._its_own:
            return True
        try:
            return await self.sandbox.ask(
                self.node.host.answers_itself.remote(self.key), RAY_CALL_TIMEOUT
            )
        except Exception:  # noqa: BLE001 - a busy host is not a taken port
            return True

    async def lost_its_port(self) -> bool:
        try:
            return await self.sandbox.ask(
                self.node.host.lost_its_port.remote(self.key), RAY_CALL_TIMEOUT
            )
        except Exception:  # noqa: BLE001 - a gone host: not a port
            return False

    async def remove(self) -> None:
        try:
            await self.sandbox.ask(self.node.host.remove.remote(self.key), 30)
        except Exception as exc:  # noqa: BLE001 - a dead host took its envs along
            log.info(
                "Node %s's host could not remove env %s (%s); its envs die with it.",
                self.node.address,
                self.key[:8],
                type(exc).__name__,
            )
        finally:
            # The group holds the node's CPU: the episode's slot is free only once it is gone, or
            # the next deploy would queue at Ray behind a slot the pool counts as free.
            await self.sandbox.release(self.group)


@provider
class RaySandbox(Sandbox):
    """Runs envs across a Ray cluster: a host actor per node, a placement group per env.

    Ray queues a placement while the cluster is full; one no live node could ever meet fails
    after the deploy deadline. The actors are not detached, so they (and their envs) end with
    this server's connection to the cluster, even on SIGKILL."""

    kind = "ray"
    summary = "placed across a Ray cluster, in Docker or local processes on its nodes"
    place = "on a Ray cluster"
    settings = (
        Declared(
            "ray_address",
            None,
            ray_address,
            "with --sandbox ray: the cluster's address (default: RAY_ADDRESS, else the "
            "ray_head_node_address NeMo Gym passes, else auto, the cluster ray start made on "
            "this machine)",
            metavar="HOST:PORT",
        ),
        Declared(
            "ray_resource",
            None,
            ray_resource,
            "with --sandbox ray: place envs only on nodes declaring this custom resource "
            f"(each env asks {RAY_RESOURCE_SHARE:g} of it), keeping them off trainer nodes; an "
            f"env asks a node for its deploy_env step's cpu ({RAY_ENV_CPU:g}) and memory_mb "
            f"({RAY_ENV_MEMORY_MB}) where the step names none",
        ),
        Declared(
            "ray_node_sandbox",
            None,
            ray_node_sandbox,
            "with --sandbox ray: what runs envs on each node: docker (the node's own daemon, "
            "from DOCKER_HOST there; its ports published on the node's address), local "
            "processes, or auto (Docker on each node whose daemon answers, else local; said "
            "per node at start)",
            choices=ray_node_sandboxes,
        ),
        # NeMo Gym's own key, at the top of its config: the cluster Gym started
        Declared("ray_head_node_address", None, ray_address, "", written=False, gym_global=True),
    )
    gates_its_boots = True

    @classmethod
    def warm_by_default(cls) -> tuple[bool, str]:
        # Each node boots its own envs, and no pool's gain is measured there.
        return False, f"the {cls.kind} sandbox gains too little from one to keep it by default"

    def __init__(self, owner: str, ray: Any, options: RayOptions):
        super().__init__(owner)
        self.ray, self.options = ray, options
        self.nodes: dict[str, RayNode] = {}
        self.envs: Any = None  # the env folders, in the object store once
        self.Host = host_actor(ray)
        self._view: tuple[float, list[dict[str, Any]]] = (0.0, [])
        self._hosting: dict[str, asyncio.Future] = {}
        self._releasing: set[asyncio.Task] = set()

    @classmethod
    async def connect(cls, owner: str, settings: Settings) -> RaySandbox:
        try:
            import ray
        except ImportError:
            raise AgentEnvError(
                f"--sandbox ray needs Ray installed in this Python: {RAY_INSTALL}"
            ) from None
        options = RayOptions.of(settings)
        address = options.address
        fix = (
            "start the cluster (ray start --head on one machine, ray start --address=HEAD:PORT "
            "on the others), or pass its address with --ray-address (or RAY_ADDRESS)"
        )
        if address != "auto" and not await _answers(address):
            raise AgentEnvError(
                f"no Ray cluster answers at {address}: nothing listens there; {fix}"
            )
        try:
            await asyncio.wait_for(
                in_daemon_thread(
                    lambda: ray.init(
                        address=address,
                        log_to_driver=False,
                        logging_level=logging.WARNING,
                        configure_logging=False,
                    )
                ),
                RAY_CONNECT_TIMEOUT,
            )
        except asyncio.TimeoutError:
            raise AgentEnvError(
                f"the Ray cluster at {address} did not let this server join within "
                f"{RAY_CONNECT_TIMEOUT:g}s (with token auth on, RAY_AUTH_TOKEN or "
                f"~/.ray/auth_token must hold the cluster's token); {fix}"
            ) from None
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds
            raise AgentEnvError(
                f"could not join the Ray cluster at {address} ({short(str(exc), 300)}); {fix}"
            ) from None
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
            wanted = (
                f" that declares the resource {self.options.resource!r}"
                if self.options.resource
                else " with CPUs"
            )
            resource = self.options.resource
            resources = f" --resources={json.dumps({resource: 1})}" if resource else ""
            raise AgentEnvError(
                f"the Ray cluster at {self.options.address} has no live node"
                f"{wanted}; start one (ray start --address=HEAD:PORT"
                f"{resources})"
            )
        await asyncio.gather(*(self.host(n) for n in nodes))

    async def host(self, node: dict[str, Any]) -> RayNode:
        """The node's host, started (once) the first time the node is needed."""
        node_id = node["NodeID"]
        if node_id not in self._hosting:
            self._hosting[node_id] = asyncio.ensure_future(self._start_host(node))
        try:
            return await asyncio.shield(self._hosting[node_id])
        except Exception:
            self._hosting.pop(node_id, None)  # the next episode there tries again
            raise

    async def _start_host(self, node: dict[str, Any]) -> RayNode:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        address = node["NodeManagerAddress"]
        state = os.environ.get("AGENTENV_STATE_DIR")
        actor = self.Host.options(
            name=f"agentenv-host-{node['NodeID'][:12]}-{os.getpid()}",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote(
            address,
            self.envs,
            state,
            float((node.get("Resources") or {}).get("CPU", 0)),
            self.options.node_sandbox,
        )
        try:
            await self.ask(actor.node.remote(), 120)
        except Exception as exc:  # noqa: BLE001
            self.ray.kill(actor)
            raise EpisodeFailed(
                f"the host actor of Ray node {address} did not start within 120s "
                f"({type(exc).__name__}: {short(str(exc), 300)})",
                PROVIDER_UNAVAILABLE,
            ) from None
        try:  # its daemon asked, its images built (once per content)
            facts = await self.ask(actor.prepare.remote(), RAY_PREPARE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001
            self.ray.kill(actor)
            said = getattr(exc, "cause", None) or exc  # a RayTaskError carries the host's own
            raise EpisodeFailed(
                f"Ray node {address} could not make its envs ready: {short(str(said), 1500)}",
                PROVIDER_UNAVAILABLE,
            ) from None
        found = RayNode(node["NodeID"], address, dict(node.get("Resources") or {}), actor, facts)
        self.nodes[found.id] = found
        where = facts["place"] + (f" ({facts['why']})" if facts["why"] else "")
        log.info(
            "Ray node %s (%g CPUs, %d cores): envs run there %s, reached at %s, up to %d "
            "booting at once.",
            address,
            found.resources.get("CPU", 0),
            facts["cores"],
            where,
            address,
            facts["boot_slots"],
        )
        return found

    def describe(self, envs: list[EnvSpec]) -> list[str]:
        return [
            *super().describe(envs),
            f"nodes of the Ray cluster at {self.options.address}:",
            *(
                f"  {node.address}  "
                + ", ".join(
                    f"{k} {_amount(k, v)}"
                    for k, v in sorted(node.resources.items())
                    if not k.startswith(("node:", "object_store"))
                )
                for node in self.nodes.values()
            ),
        ]

    def network_mode(self, env: EnvSpec) -> str:
        said = {
            node.address: node.facts.get("networks", {}).get(env.name, "?")
            for node in self.nodes.values()
        }
        if len(set(said.values())) == 1:
            return f"on every node, {next(iter(said.values()))}"
        return "; ".join(f"on node {address}, {mode}" for address, mode in sorted(said.items()))

    def demand(self, limits: dict[str, Any]) -> dict[str, float]:
        """What one env's placement asks of a node."""
        want = {
            "CPU": float(limits.get("cpu") or RAY_ENV_CPU),
            "memory": float(limits.get("memory_mb") or RAY_ENV_MEMORY_MB) * 2**20,
        }
        if self.options.resource:
            want[self.options.resource] = RAY_RESOURCE_SHARE
        return want

    async def launch(self, env: EnvSpec, episode: str, limits: dict[str, Any]) -> Instance:
        from ray.util.placement_group import placement_group

        want = self.demand(limits)
        group = await asyncio.to_thread(
            placement_group,
            [want],
            strategy="STRICT_PACK",
            name=f"agentenv-{episode[:12]}-{env.name}",
        )
        try:
            node = await self._placed(env, group, want)
            key, url, its_own = await self._start_env(node, env, episode, limits)
        except BaseException:
            self.let_go(group)
            raise
        log.info(
            "Episode %s: env %r placed on Ray node %s at %s.",
            episode[:8],
            env.name,
            node.address,
            url,
        )
        return RayInstance(self, node, key, url, group, its_own)

    async def _start_env(
        self, node: RayNode, env: EnvSpec, episode: str, limits: dict[str, Any]
    ) -> tuple[str, str, bool]:
        """The node's host starts the env. A host that Ray is restarting (its process died) is
        waited for, within the deploy deadline; what the host raised is said as the node's."""
        deadline = time.monotonic() + self.options.deploy_timeout
        while True:
            try:
                return await self.ask(node.host.launch.remote(env.name, episode, limits), 120)
            except asyncio.TimeoutError:
                raise EpisodeFailed(
                    f"the host actor of Ray node {node.address} did not start env "
                    f"{env.name!r} within 120s",
                    PROVIDER_UNAVAILABLE,
                ) from None
            except Exception as exc:  # noqa: BLE001 - Ray raises many kinds
                if type(exc).__name__ == "ActorUnavailableError" and time.monotonic() < deadline:
                    await asyncio.sleep(0.25)  # polling: Ray says nothing when a host is back
                    continue
                said = getattr(exc, "cause", None) or exc  # a RayTaskError: the host's own
                failure = getattr(said, "failure", None)
                raise EpisodeFailed(
                    f"on Ray node {node.address}: "
                    + (
                        failure.reason
                        if failure
                        else f"its host actor could not start env "
                        f"{env.name!r} ({type(said).__name__}: {short(str(said), 1500)})"
                    ),
                    failure.kind if failure else PROVIDER_UNAVAILABLE,
                ) from None

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
            if any(
                all((n.get("Resources") or {}).get(k, 0) >= v for k, v in want.items())
                for n in nodes
            ):
                hopeless_since = None
                continue
            hopeless_since = hopeless_since or time.monotonic()
            if time.monotonic() - hopeless_since >= self.options.deploy_timeout:
                offered = (
                    "; ".join(
                        f"{n['NodeManagerAddress']}: "
                        + ", ".join(
                            f"{k} {_amount(k, v)}"
                            for k, v in sorted((n.get("Resources") or {}).items())
                            if k in want
                        )
                        for n in nodes
                    )
                    or "no live node"
                )
                asked = ", ".join(f"{k} {_amount(k, v)}" for k, v in want.items())
                raise EpisodeFailed(
                    f"env {env.name!r} asks a Ray node for {asked}, which no live node of the "
                    f"cluster has ({offered}), so it could not be placed within "
                    f"{self.options.deploy_timeout:g}s (the deploy deadline); lower the deploy_env "
                    "step's cpu or memory_mb, or add a node that has them",
                    PROVIDER_UNAVAILABLE,
                )
        ready.result()
        table = await asyncio.to_thread(placement_group_table, group)
        node_id = table["bundles_to_node_id"][0]
        if node_id in self.nodes:
            return self.nodes[node_id]
        node = next((n for n in await self.cluster(fresh=True) if n["NodeID"] == node_id), None)
        if node is None:
            raise EpisodeFailed(
                f"Ray placed env {env.name!r} on node {node_id[:12]}, which is gone",
                PROVIDER_UNAVAILABLE,
            )
        return await self.host(node)  # a node that joined after start-up

    async def release(self, group: Any) -> None:
        """Remove a placement group: on a thread of its own, so a release never queues behind
        other blocking calls (a deadline that ran out in the queue would drop it unsaid)."""
        from ray.util.placement_group import remove_placement_group

        try:
            await asyncio.wait_for(
                in_daemon_thread(lambda: remove_placement_group(group), "ray-release"), 30
            )
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds
            # a cluster going away takes its groups along; one that stays keeps the CPU held
            log.warning(
                "A Ray placement group could not be removed (%s: %s); the cluster frees "
                "it when this server leaves.",
                type(exc).__name__,
                short(str(exc), 300),
            )

    def let_go(self, group: Any) -> None:
        """Free the placement group of an env that never started, without the failed deploy
        waiting for the cluster's answer (close waits for those under way)."""
        task = asyncio.ensure_future(self.release(group))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def close(self) -> None:
        """Free the placement groups still being freed, end every host (their envs die with
        them) and leave the cluster."""
        await asyncio.gather(*self._releasing, return_exceptions=True)
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
        return True  # not HOST:PORT (ray://...): let Ray say
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), 5)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


def in_daemon_thread(fn: Callable[[], Any], name: str = "ray-connect") -> asyncio.Future:
    """Run a blocking call that may never return on a daemon thread: a deadline can give up on
    it, and the process can still exit (the default executor's threads are waited for)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result: Any = (True, fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            result = (False, exc)

        def settle() -> None:
            if not future.done():
                future.set_result(result[1]) if result[0] else future.set_exception(result[1])

        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing waits
            loop.call_soon_threadsafe(settle)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class AutoSandbox:
    """``auto``, the default: the providers with an ``auto_rank``, tried in its order, the first
    that connects run (the Docker sandbox where a daemon answers and its envs can be reached from
    here, else local processes); a fall past the first is said in one log line, with why."""

    kind = "auto"
    summary = (
        "docker when a daemon answers and its envs can be reached from here, else local "
        "(the default)"
    )
    settings: tuple[Declared, ...] = ()

    @staticmethod
    def chooses() -> tuple[str, ...]:
        """The providers whose options apply to it: its own, and those it may pick."""
        return (AUTO, *auto_order())

    @classmethod
    async def connect(cls, owner: str, settings: Settings) -> Sandbox:
        ranked, tried = auto_order(), []
        for kind in ranked:
            try:
                sandbox = await PROVIDERS[kind].connect(owner, settings)
            except AgentEnvError as exc:
                if kind == ranked[-1]:
                    raise
                tried.append(str(exc).split(";")[0])
                continue
            if tried:
                log.warning(
                    "Envs run in the %s sandbox (%s), since %s.",
                    kind,
                    PROVIDERS[kind].summary,
                    ", and ".join(tried),
                )
            return sandbox
        raise AgentEnvError(
            "no sandbox provider may be picked by auto; pass --sandbox "
            + " or ".join(sandbox_names()[1:])
        )


provider(AutoSandbox)


def sandbox_named(value: Any, what: str) -> str:
    """The sandbox a user named, one of the providers'."""
    if value not in PROVIDERS:
        raise AgentEnvError(
            f"{what} is not a sandbox agentenv.py runs envs in; pass "
            + ", ".join(repr(k) for k in sandbox_names() if k != "auto")
            + ", or None or 'auto' (the first of "
            + ", ".join(auto_order())
            + " that can be reached)"
        )
    return value


def sandbox_names() -> tuple[str, ...]:
    """The providers' names, as the commands offer them: auto first."""
    return tuple(sorted(PROVIDERS, key=lambda kind: (kind != "auto", kind)))


def sandbox_setting() -> Declared:
    """The setting ``sandbox``: which provider, one of the registry's (each with its summary)."""
    return Declared(
        "sandbox",
        "auto",
        sandbox_named,
        "where envs run: "
        + "; ".join(f"{kind}, {PROVIDERS[kind].summary}" for kind in sandbox_names()),
        choices=sandbox_names,
        written=False,
    )


Settings.DECLARED["sandbox"] = sandbox_setting()


def options_apart(settings: Settings, remote: bool) -> None:
    """Refuse a provider's options given where they can't apply: with another sandbox, or with a
    served URL (whose server runs its envs where it runs them)."""
    picked = PROVIDERS.get(settings.sandbox)
    chooses = getattr(picked, "chooses", None)
    chosen = chooses() if chooses is not None else (settings.sandbox,)
    for kind, cls in PROVIDERS.items():
        names = [d.name for d in cls.settings if not d.gym_global]
        if any(name in dict(settings.declared) for name in names) and (
            remote or kind not in chosen
        ):
            flags = [f"--{name.replace('_', '-')}" for name in names]
            one = len(flags) == 1
            raise AgentEnvError(
                (flags[0] if one else ", ".join(flags[:-1]) + " and " + flags[-1])
                + f" say{'s' if one else ''} where a bundle's envs run {cls.place}, and this "
                "server's envs "
                + (
                    "run where the served URL runs them"
                    if remote
                    else f"run in the {settings.sandbox} sandbox"
                )
                + f"; pass {'it' if one else 'them'} with a bundle folder and --sandbox {kind}, or "
                f"leave {'it' if one else 'them'} out"
            )


async def open_sandbox(owner: str, settings: Settings) -> Sandbox:
    """The sandbox the settings name, connected."""
    kind = settings.sandbox
    if kind not in PROVIDERS:
        raise AgentEnvError(
            f"--sandbox {kind!r} is not a sandbox; use "
            + ", ".join(sandbox_names()[:-1])
            + f" or {sandbox_names()[-1]}"
        )
    return await PROVIDERS[kind].connect(owner, settings)


# ================================================================ 4. Env client

MCP_PROTOCOL = "2025-06-18"
HIDDEN_META = "agentenv.io/hiddenByDefault"
ROLE_HEADER = "AgentEnv-Role"
MAX_TOOL_OUTPUT = 100_000  # characters of a tool's answer passed on to the model
# An env's tool listing, every page of it, is read as one answer: within max_env_reply's bytes, one
# deadline, and these counts. An env that pages forever fails its deploy, not the server's memory.
LIST_TIMEOUT = 30.0  # seconds for the whole tools/list
MAX_LIST_PAGES = 100
MAX_TOOLS = 1000  # far past any model's use: each is in every prompt of its turn
# How deep an env's tool (or card) may nest, in JSON objects and arrays. Every wire writes a tool
# out again, deeper in the stack than it was read, and Python's json writes no deeper than the
# stack allows there; no schema a model can use comes near this.
MAX_NESTING = 64


class McpError(AgentEnvError):
    """An env's MCP server refused a request or answered something that isn't MCP."""


class McpRefusal(McpError):
    """A JSON-RPC error the server answered on purpose (unknown tool, bad params)."""


class McpTooLong(McpError):
    """A reply longer than the env client reads (max_env_reply). A tool call's is the model's
    doing (it asked for that much), so the model reads it as a tool error; never a mask, which
    would let a model escape a poor score by asking a tool for too much."""


class McpBroken(McpError):
    """An env that breaks MCP in a way no second try mends: a session id it can't be sent back, a
    tool listing past its limits, an answer to initialize past max_env_reply. The deploy (or the
    turn) fails at once, masked env_failed, instead of asking again until the deploy deadline."""


def env_broke(env: str, exc: McpBroken) -> EpisodeFailed:
    """The episode's failure for an env that broke MCP so."""
    return EpisodeFailed(f"env {env!r} can't be played as it is: {exc}", ENV_FAILED)


def bytes_said(size: int) -> str:
    return f"{size // 2**20} MiB" if size % 2**20 == 0 else f"{size:,} bytes"


def nesting(value: Any) -> int:
    """How deep JSON objects and arrays nest in ``value`` (0: a scalar), found level by level:
    a recursive walk would stop where the stack does, which is what this guards against."""
    depth, level = 0, [value]
    while level := [v for v in level if isinstance(v, (dict, list))]:
        depth += 1
        level = [item for v in level for item in (v.values() if isinstance(v, dict) else v)]
    return depth


# A reply's framing, read strictly: anything else is a malformed reply, never a guess.
STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\r\n]*)?")
# A header field's name is a token, right before its colon. The names an env sends are few and
# the same on every reply, so each is checked once on a line and remembered there with its lower
# case (up to FIELD_NAMES_KEPT): a reply's usual fields cost a lookup, not a regex. A value is read
# as it is: the fields read (a length, the coding, a session id) are checked as what they are.
FIELD_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
FIELD_NAMES_KEPT = 64
DECIMAL = re.compile(r"[0-9]{1,18}")
CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})(?:[ \t]*;[^\r\n]*)?\r\n")
VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")  # what MCP's spec allows in a session id


class EnvConnection(asyncio.Protocol):
    """One connection to an env, read as asyncio's StreamReader reads one (``readuntil``,
    ``readexactly``, ``read``, failing as it fails) and written through its transport, with the
    bytes that came and were not read yet its own to count (``unread``): a connection holding any
    once its reply was read whole is out of step with its env, and is never used again
    (``usable``; StreamReader keeps them private). Past ``limit`` bytes unread, the env is read no
    more until a read wants them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.ended = False  # the env closed its end, or the connection was lost
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    @classmethod
    async def open(cls, host: str, port: int, limit: int) -> EnvConnection:
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: cls(limit), host, port
        )
        return connection

    # -- what asyncio calls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > 2 * self.limit and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # and close: HTTP/1.1 writes no more

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended, self.error = True, exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _more(self) -> None:
        """Wait for more bytes, or the end; the error the connection was lost with, raised."""
        if self.error is not None:
            raise self.error
        if self.ended:
            return
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def _take(self, size: int) -> bytes:
        taken = bytes(self.buffer[:size])
        del self.buffer[:size]
        return taken

    # -- reads, as StreamReader's

    async def readuntil(self, separator: bytes) -> bytes:
        start = 0
        while True:
            if (found := self.buffer.find(separator, start)) >= 0:
                if found > self.limit:
                    raise asyncio.LimitOverrunError("the separator came past the limit", found)
                return self._take(found + len(separator))
            if len(self.buffer) > self.limit:
                raise asyncio.LimitOverrunError("no separator within the limit", len(self.buffer))
            if self.ended:
                raise asyncio.IncompleteReadError(self._take(len(self.buffer)), None)
            start = max(0, len(self.buffer) - len(separator) + 1)
            await self._more()

    async def readexactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if self.ended:
                raise asyncio.IncompleteReadError(self._take(len(self.buffer)), size)
            await self._more()
        return self._take(size)

    async def read(self, most: int) -> bytes:
        while not self.buffer and not self.ended:
            await self._more()
        return self._take(most)

    # -- the connection

    def usable(self) -> bool:
        """Whether the connection can carry another request: open at both ends, nothing unread."""
        return not (
            self.ended or self.buffer or self.transport is None or self.transport.is_closing()
        )

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Cut it at once: a read waiting on it ends as if the env reset it."""
        if self.transport is not None:
            self.transport.abort()


class EnvLine:
    """Kept-alive HTTP/1.1 connections to one env's MCP endpoint (EnvConnection), of its own:
    the client of the hop, where every tool call goes.

    An MCP session posts small JSON bodies to one URL, one after another. aiohttp's client made a
    request and a response object, a connector lookup, a timer and a payload stream for each,
    and that was a fifth of serve's CPU on a tool call (bench/README.md, "The hop and the
    episode"). This writes a request's bytes itself and reads the reply by its status line, its
    headers, and its body by Content-Length, by chunks, or to the connection's end. A connection
    is used again only once its reply was read whole, the env keeps it open and nothing more
    came on it; a cancel, a timeout, a reply left unread or a malformed one closes it, and so
    does a call that ends after the line was closed. Nothing is retried: a tool call may have
    run though its reply was lost. Failures are aiohttp's (``ClientOSError``,
    ``ServerDisconnectedError``, ``ClientPayloadError``), as for a call made with aiohttp, so
    every caller tells them apart as it did. A reply's body past ``max_body`` (max_env_reply:
    at most that much of an answer is ever held) fails as McpTooLong.

    Given the env's ``stopped`` (Instance.stopped), the line cuts every connection the moment
    the env is known dead, in flight or idle, and opens none after: the call fails as one whose
    env reset it would, instead of waiting for an answer nothing will send."""

    MAX_HEAD = 64 * 1024  # bytes of a reply's status line and headers

    def __init__(
        self,
        url: yarl.URL,
        stopped: asyncio.Future[str] | None = None,
        max_body: int = Settings.max_env_reply,
    ):
        self.host, self.port = url.raw_host or "", url.port or 80
        self.max_body = max_body
        self.field_names: dict[str, str] = {}  # header names checked, with their lower case
        self.target = (url.raw_path_qs or "/").encode()
        authority = f"[{self.host}]" if ":" in self.host else self.host
        if url.explicit_port:
            authority += f":{url.explicit_port}"
        self._host = f"Host: {authority}\r\n".encode()
        self._idle: list[EnvConnection] = []
        self._busy: set[EnvConnection] = set()  # connections a call holds
        self.closed = False
        self.stopped = stopped
        if stopped is not None:
            stopped.add_done_callback(self._cut)

    @staticmethod
    def handles(url: yarl.URL) -> bool:
        return url.scheme == "http" and bool(url.host)

    def exchange(
        self, method: bytes, headers: dict[str, str], body: bytes = b"", cap: int | None = None
    ) -> "EnvReply":
        """A request, and its reply read within ``cap`` bytes (``max_body`` when None)."""
        head = [method, b" ", self.target, b" HTTP/1.1\r\n", self._host]
        for name, value in headers.items():
            line = f"{name}: {value}\r\n"
            if "\n" in value or "\r" in value:
                raise McpError(f"the header {name} holds a line break, which HTTP does not allow")
            head.append(line.encode("utf-8"))
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        return EnvReply(self, b"".join(head) + body, self.max_body if cap is None else cap)

    async def connection(self) -> EnvConnection:
        if self.stopped is not None and self.stopped.done():
            raise self._refused()
        while self._idle:  # the newest first; one the env closed meanwhile goes
            kept = self._idle.pop()
            if kept.usable():
                self._busy.add(kept)
                return kept
            kept.close()
        opening = EnvConnection.open(self.host, self.port, self.MAX_HEAD)
        try:
            if self.stopped is None:
                connection = await opening
            else:  # a connect to an address nobody holds any more waits: not for long
                connection = await while_running(opening, self.stopped, "")
        except OSError as exc:
            raise aiohttp.ClientOSError(
                exc.errno,
                f"cannot connect to the env at {self.host}:{self.port}: {exc.strerror or exc}",
            ) from exc
        except EpisodeFailed:
            raise self._refused() from None
        if self.stopped is not None and self.stopped.done():
            connection.abort()
            raise self._refused()
        self._busy.add(connection)
        return connection

    def _refused(self) -> aiohttp.ClientOSError:
        assert self.stopped is not None
        return aiohttp.ClientOSError(
            errno.ECONNRESET,
            f"the env at {self.host}:{self.port} stopped ({self.stopped.result()})",
        )

    def give_back(self, connection: EnvConnection, keep: bool = True) -> None:
        """A connection a call is done with: kept for the next, or (``keep`` False: its reply was
        not read whole) closed."""
        self._busy.discard(connection)
        # closed too: a call that outlived its session, or a connection out of step with its env
        if not keep or self.closed or not connection.usable():
            connection.close()
        else:
            self._idle.append(connection)
        if self.closed and not self._busy:
            self._unwatch()

    def _cut(self, _: Any) -> None:
        for connection in [*self._busy, *self._idle]:
            connection.abort()  # a read waiting on it ends as if the env reset it
        self._idle.clear()

    def _unwatch(self) -> None:
        if self.stopped is not None:
            self.stopped.remove_done_callback(self._cut)

    def close(self) -> None:
        self.closed = True
        if not self._busy:  # a call still under way is cut too, if its env dies
            self._unwatch()
        for connection in self._idle:
            connection.close()
        self._idle.clear()


def _field_name(line: str, name: str, colon: str, known: dict[str, str]) -> str:
    """A header line's field name in lower case, checked the first time it comes on a line (then
    it is remembered in ``known``, the line's); a line that is no field, a folded one (obs-fold,
    which HTTP/1.1 forbids in a reply) included, is a malformed reply."""
    if line[:1] in (" ", "\t"):
        raise aiohttp.ClientPayloadError(
            f"the env folded a header onto a second line, "
            f"{short(repr(line), 80)}, which HTTP/1.1 forbids in a reply"
        )
    if not colon or not FIELD_NAME.fullmatch(name):
        raise aiohttp.ClientPayloadError(
            f"the env sent a header line that is no NAME: VALUE, {short(repr(line), 80)}"
        )
    key = name.lower()
    if len(known) < FIELD_NAMES_KEPT:
        known[name] = key
    return key


class EnvReply:
    """One request on an EnvLine and its reply, as ``async with``: inside it, ``status``,
    ``headers`` (names in lower case) and ``content_type`` are read, and the body is read with
    ``read()`` or piece by piece with ``chunks()``, never past ``left`` bytes (the body's cap, less
    what was read of it: McpTooLong). On leaving, the connection goes back to the line if the body
    was read whole and the env keeps it open, and is closed otherwise."""

    def __init__(self, line: EnvLine, request: bytes, cap: int):
        self.line, self.request, self.left = line, request, cap
        self.status, self.headers = 0, dict[str, str]()
        self._connection: EnvConnection | None = None
        self._done = self._keep = False

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    async def __aenter__(self) -> "EnvReply":
        self._connection = reader = await self.line.connection()
        try:
            reader.write(self.request)
            interim = 0  # bytes of 1xx replies (100 Continue), before the real one
            while True:
                head = await self._read(reader.readuntil(b"\r\n\r\n"), "its headers")
                status_line, _, fields = head[:-4].partition(b"\r\n")
                if not (status := STATUS_LINE.fullmatch(status_line)):
                    raise McpError(
                        f"the env answered {short(repr(status_line), 100)}, not HTTP/1.x"
                    )
                self.status = int(status.group(2))
                if self.status >= 200:
                    break
                if (interim := interim + len(head)) > self.line.MAX_HEAD:
                    raise aiohttp.ClientPayloadError(
                        f"the env sent more than {self.line.MAX_HEAD // 1024} KiB of interim (1xx) "
                        "replies, and no reply"
                    )
            headers, known = self.headers, self.line.field_names
            for line in fields.decode("latin-1").split("\r\n") if fields else ():
                name, colon, value = line.partition(":")
                if not colon or (key := known.get(name)) is None:
                    key = _field_name(line, name, colon, known)
                value = value.strip(" \t")
                # A field sent twice (its first value kept is another string: one the same, as
                # a 1-character value is, changes nothing).
                if (kept := headers.setdefault(key, value)) is not value:
                    if key == "content-length" and kept != value:
                        raise aiohttp.ClientPayloadError("the env sent two Content-Lengths")
                    headers[key] = f"{kept}, {value}" if key == "transfer-encoding" else value
            if (coding := headers.get("transfer-encoding")) is not None:
                codings = [c for c in (c.strip(" \t").lower() for c in coding.split(",")) if c]
                if codings != ["chunked"]:
                    raise aiohttp.ClientPayloadError(
                        f"the env sent Transfer-Encoding {short(repr(coding), 80)}: agentenv.py "
                        "reads chunked alone, and asks for no other coding"
                    )
            connection = headers.get("connection", "").lower()
            self._keep = "close" not in connection and (
                status.group(1) == b"1" or "keep-alive" in connection
            )
        except BaseException:
            self.line.give_back(reader, keep=False)
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._connection is not None
        self.line.give_back(
            self._connection, keep=self._done and self._keep and exc_info[0] is None
        )

    async def read(self) -> bytes:
        if (length := self._length()) is not None:  # the usual reply: at once, no generator
            return await self._whole(length)
        return b"".join([chunk async for chunk in self.chunks()])

    async def text(self) -> str:
        return (await self.read()).decode("utf-8", "replace")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; its end read, ``_done`` is set."""
        reader, headers = self._connection, self.headers
        assert reader is not None
        if self.status in (204, 304):  # no body; one sent anyway keeps the connection unused
            self._done = True
            return
        if (length := self._length()) is not None:
            if body := await self._whole(length):
                yield body
        elif "transfer-encoding" in headers:  # chunked: __aenter__ refused any other coding
            if "content-length" in headers:  # both: chunks count, and the line is not kept
                self._keep = False
            while True:
                size_line = await self._read(reader.readuntil(b"\r\n"), "a chunk's size")
                if not (size := CHUNK_SIZE.fullmatch(size_line)):
                    raise aiohttp.ClientPayloadError(
                        f"the env sent a chunk size that is not one: {short(repr(size_line), 80)}"
                    )
                if (length := int(size.group(1), 16)) == 0:  # the last; trailers to a blank line
                    while (
                        line := await self._read(reader.readuntil(b"\r\n"), "its trailers")
                    ) != b"\r\n":
                        self.left -= len(line)  # trailers count as the body does
                        if self.left < 0:
                            raise McpTooLong(self._too_long())
                    self._done = True
                    return
                self.left -= length
                if self.left < 0:
                    raise McpTooLong(self._too_long())
                chunk = await self._read(reader.readexactly(length + 2), "a chunk")
                if chunk[-2:] != b"\r\n":
                    raise aiohttp.ClientPayloadError("the env sent a chunk longer than it said")
                yield chunk[:-2]
        else:  # no length: the body ends with the connection
            self._keep = False
            while chunk := await self._read(reader.read(65536), "its body"):
                self.left -= len(chunk)
                if self.left < 0:
                    raise McpTooLong(self._too_long())
                yield chunk
            self._done = True

    async def _whole(self, length: int) -> bytes:
        """A body of ``length`` bytes, read to its end."""
        assert self._connection is not None
        body = await self._read(self._connection.readexactly(length), "its body") if length else b""
        self._done = True
        self.left -= length
        return body

    def _length(self) -> int | None:
        """The body's length, when its Content-Length says where it ends: not for a reply that has
        no body (204, 304), comes in chunks, or ends with the connection."""
        headers = self.headers
        if (
            self.status in (204, 304)
            or "transfer-encoding" in headers
            or (field := headers.get("content-length")) is None
        ):
            return None
        if not DECIMAL.fullmatch(field):
            raise aiohttp.ClientPayloadError(f"the env sent Content-Length {field!r}")
        if (length := int(field)) > self.left:
            raise McpTooLong(self._too_long())
        return length

    def _too_long(self) -> str:
        return (
            f"the answer is longer than the {bytes_said(self.line.max_body)} agentenv.py reads "
            "of an env's answer (max_env_reply)"
        )

    async def _read(self, reading: Awaitable[bytes], what: str) -> bytes:
        try:
            return await reading
        except asyncio.IncompleteReadError as exc:
            if not exc.partial and what == "its headers":
                raise aiohttp.ServerDisconnectedError(
                    "the env closed the connection without answering"
                ) from None
            raise aiohttp.ClientPayloadError(
                f"the env closed the connection in the middle of {what}"
            ) from None
        except asyncio.LimitOverrunError:
            raise aiohttp.ClientPayloadError(
                f"the env sent more than {self.line.MAX_HEAD // 1024} KiB of {what}"
            ) from None
        except OSError as exc:
            raise aiohttp.ClientOSError(
                exc.errno, f"the connection to the env failed: {exc}"
            ) from None


class McpSession:
    """One MCP session with an env server over streamable HTTP, on an EnvLine of its own.

    It speaks JSON-RPC over POST, takes a reply as JSON or as an SSE stream (reading the stream
    only until its own answer arrives), and carries ``Mcp-Session-Id`` once the server assigns one.
    ``close()`` ends it on the server and closes its connections. Given the env's ``stopped``,
    its calls end the moment the env is known dead (see EnvLine). No answer is read past
    ``max_body`` bytes (max_env_reply), a tool listing's pages together included.
    """

    def __init__(
        self,
        url: str,
        headers: dict[str, str] | None = None,
        stopped: asyncio.Future[str] | None = None,
        max_body: int = Settings.max_env_reply,
    ):
        self.url = url
        self.headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            **(headers or {}),
        }
        self.next_id = 0
        self.left = 0  # of the last answer's cap, what its body left unread
        target = yarl.URL(url)
        if not EnvLine.handles(target):
            raise McpError(f"an env is reached at an http:// address, not {url!r}")
        self.line = EnvLine(target, stopped, max_body)

    async def open(self, timeout: float = 30) -> dict[str, Any]:
        try:
            result = await self.request(
                "initialize",
                {
                    "protocolVersion": MCP_PROTOCOL,
                    "capabilities": {},
                    "clientInfo": {"name": "agentenv.py", "version": __version__},
                },
                timeout,
            )
        except McpTooLong:
            raise McpBroken(
                f"its answer to initialize is longer than the "
                f"{bytes_said(self.line.max_body)} agentenv.py reads of an answer "
                "(max_env_reply); answer it in a few KiB"
            ) from None
        version = result.get("protocolVersion", MCP_PROTOCOL)
        if not isinstance(version, str) or not VISIBLE_ASCII.fullmatch(version):
            raise McpBroken(
                f"it answered initialize with the protocolVersion "
                f"{reprlib.repr(version)}, which is no MCP version (such as "
                f"{MCP_PROTOCOL!r}); fix its initialize"
            )
        self.headers["MCP-Protocol-Version"] = version
        await self.notify("notifications/initialized", timeout)
        return result

    async def list_tools(self, timeout: float = LIST_TIMEOUT) -> list[dict[str, Any]]:
        """Every tool the env lists (those with a name), over every page it gives, as one answer:
        within ``timeout`` for them all, max_env_reply's bytes for them all, MAX_LIST_PAGES pages
        and MAX_TOOLS tools, no cursor given twice, and no tool nested past MAX_NESTING. An env
        past one is McpBroken, saying which and the fix; a first page that never comes is a
        timeout, as any answer that never comes."""
        tools: list[dict[str, Any]] = []
        cursors: set[str] = set()
        cursor, left, pages, cap = None, self.line.max_body, 0, bytes_said(self.line.max_body)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        result = await self.request(
                            "tools/list", {"cursor": cursor} if cursor else {}, None, left
                        )
                    except McpTooLong:
                        raise McpBroken(
                            f"its tool listing, {pages + 1} page{'s' if pages else ''} of it, is "
                            f"longer than the {cap} agentenv.py reads of an answer (max_env_reply; "
                            "the pages of a listing count as one answer, since a model is shown "
                            "every tool of its turn); list fewer tools, or shorter descriptions "
                            "and "
                            "schemas, or raise --max-env-reply (max_env_reply in a Gym "
                            "config)"
                        ) from None
                    pages, left = pages + 1, self.left
                    listed = result.get("tools", [])
                    if not isinstance(listed, list):
                        raise McpBroken(
                            f"it answered tools/list with tools that are "
                            f"{type(listed).__name__}, not a list; fix its tools/list"
                        )
                    for tool in listed:
                        if not (
                            isinstance(tool, dict)
                            and isinstance(tool.get("name"), str)
                            and tool["name"]
                        ):
                            continue
                        if (depth := nesting(tool)) > MAX_NESTING:
                            raise McpBroken(
                                f"its tool {short(tool['name'], 80)!r} nests {depth} levels of "
                                "JSON "
                                f"deep, past the {MAX_NESTING} agentenv.py takes (every wire "
                                "writes "
                                "a tool out again, and so does TRL's environment class); flatten "
                                "its schema, naming its parts in $defs and reaching them by $ref"
                            )
                        tools.append(tool)
                    if len(tools) > MAX_TOOLS:
                        raise McpBroken(
                            f"it lists more than {MAX_TOOLS} tools ({len(tools)} in {pages} "
                            f"page{'s' if pages > 1 else ''}), past what agentenv.py takes: a "
                            "model "
                            "is offered every tool of its turn, in every prompt; offer fewer, or "
                            "split them among the task's envs or turns"
                        )
                    cursor = result.get("nextCursor")
                    if cursor is None or cursor == "":
                        return tools
                    if not isinstance(cursor, str):
                        raise McpBroken(
                            f"its tools/list gave the nextCursor {reprlib.repr(cursor)}, "
                            "which is no string (MCP's cursors are opaque strings); "
                            "fix its tools/list"
                        )
                    if cursor in cursors:
                        raise McpBroken(
                            f"its tools/list gave the cursor {short(cursor, 80)!r} a second time, "
                            f"on page {pages}, so its pages would never end; give each page a "
                            "cursor of its own, and none after the last page"
                        )
                    if pages == MAX_LIST_PAGES:
                        raise McpBroken(
                            f"its tools/list gave a next cursor on page {pages}, the most "
                            f"agentenv.py reads ({len(tools)} tools so far), so its pages may "
                            "never "
                            "end; give none after the last page, or list more tools a page"
                        )
                    cursors.add(cursor)
        except TimeoutError:
            if not pages:  # no answer at all: a timeout, as any other
                raise
            raise McpBroken(
                f"its tools/list took longer than {timeout:g}s, {pages} pages and "
                f"{len(tools)} tools of it, the most agentenv.py waits for a tool "
                "listing; answer each page at once, and give no cursor after the "
                "last page"
            ) from None

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any],
        timeout: float | None = None,
    ) -> ToolResult:
        try:
            result = await self.request(
                "tools/call", {"name": name, "arguments": arguments}, timeout
            )
        except McpRefusal as exc:  # the call itself was refused: the model sees why
            return ToolResult(clipped(str(exc)), TOOL_ERROR)
        except McpTooLong as exc:  # the model asked for that much: it reads so
            return ToolResult(f"{exc}; ask the tool for less at a time", TOOL_ERROR)
        except RecursionError:  # the model's arguments, nested past what json writes
            return ToolResult(
                f"the arguments of {name} nest deeper than agentenv.py writes; send "
                "them nested less deep",
                BAD_ARGUMENTS,
            )
        return ToolResult(tool_text(result), TOOL_ERROR if result.get("isError") else OK)

    async def close(self) -> None:
        """End the session on the server (best effort, since the env may already be gone), and
        close the connections."""
        try:
            if "Mcp-Session-Id" in self.headers:
                with contextlib.suppress(aiohttp.ClientError, McpError, asyncio.TimeoutError):
                    async with asyncio.timeout(5):
                        async with self.line.exchange(b"DELETE", self.headers) as reply:
                            await reply.read()
        finally:
            self.drop()

    def drop(self) -> None:
        """Close the connections, leaving the session on the server as it is."""
        self.line.close()

    async def notify(self, method: str, timeout: float | None = 30) -> None:
        body = json.dumps({"jsonrpc": "2.0", "method": method}).encode()
        async with asyncio.timeout(timeout):
            async with self.line.exchange(b"POST", self.headers, body) as reply:
                text = await reply.text()
        if reply.status >= 400:
            raise McpError(f"{method} was answered HTTP {reply.status}: {short(text, 300)}")

    async def request(
        self,
        method: str,
        params: dict[str, Any],
        timeout: float | None = 30,
        cap: int | None = None,
    ) -> dict:
        """A request's result, its answer read within ``cap`` bytes (max_env_reply when None)."""
        self.next_id += 1
        rid = self.next_id  # this request's id, whatever later requests take
        body = json.dumps(
            {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}
        ).encode()
        if timeout is None:  # a tool call: its turn keeps the deadline
            message = await self._exchange(method, rid, body, cap)
        else:
            async with asyncio.timeout(timeout):
                message = await self._exchange(method, rid, body, cap)
        if not isinstance(message, dict):
            raise McpError(
                f"{method} was answered with {type(message).__name__}, not a JSON-RPC reply"
            )
        if isinstance(error := message.get("error"), dict):
            said = error.get("message")
            raise McpRefusal(said if isinstance(said, str) else reprlib.repr(error))
        result = message.get("result")
        if not isinstance(result, dict):
            raise McpError(f"{method} was answered without a result")
        return result

    async def _exchange(self, method: str, rid: int, body: bytes, cap: int | None) -> Any:
        async with self.line.exchange(b"POST", self.headers, body, cap) as reply:
            if (session := reply.headers.get("mcp-session-id")) and session != self.headers.get(
                "Mcp-Session-Id"
            ):
                if not VISIBLE_ASCII.fullmatch(session):
                    raise McpBroken(
                        f"it gave the session id {short(repr(session), 80)}, which holds "
                        "characters MCP's spec does not allow in one (visible ASCII "
                        "alone, 0x21 to 0x7E), and agentenv.py would send it back in a "
                        "header; make its session ids of those characters"
                    )
                self.headers["Mcp-Session-Id"] = session
            if reply.status >= 400:
                raise McpError(
                    f"{method} was answered HTTP {reply.status}: {short(await reply.text(), 300)}"
                )
            if reply.content_type == "text/event-stream":
                message = await self._from_stream(reply, rid)
            else:
                try:
                    message = loads(await reply.read())
                except ValueError as exc:
                    raise McpError(
                        f"{method} was answered with something that is not JSON "
                        f"({short(str(exc), 200)})"
                    ) from None
            self.left = reply.left
        if isinstance(message, dict) and message.get("id") not in (None, rid):
            raise McpError(
                f"{method} was answered for another request (id "
                f"{reprlib.repr(message['id'])}, not {rid}): the env's connection is "
                "out of step"
            )
        return message

    @staticmethod
    async def _from_stream(reply: "EnvReply", wanted: int) -> Any:
        pending: list[bytes] = []  # a line's pieces until its end comes
        data: list[bytes] = []
        async for chunk in reply.chunks():
            if b"\n" not in chunk:
                pending.append(chunk)
                continue
            *lines, rest = b"".join([*pending, chunk]).split(b"\n")  # each byte joined once
            pending = [rest]
            for line in lines:
                line = line.rstrip(b"\r")
                if line.startswith(b"data:"):
                    data.append(line[5:].lstrip(b" "))
                elif not line and data:  # a blank line ends an event
                    with contextlib.suppress(ValueError):
                        message = loads(b"\n".join(data))
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
        elif (
            item.get("type") == "resource"
            and isinstance(item.get("resource"), dict)
            and "text" in item["resource"]
        ):
            parts.append(str(item["resource"]["text"]))
        else:
            parts.append(
                f"[{item.get('type', 'unknown')} content: {item.get('mimeType', 'no type')}]"
            )
    if not parts and result.get("structuredContent") is not None:
        parts.append(json.dumps(result["structuredContent"]))
    return clipped("\n".join(parts))


def clipped(text: str) -> str:
    """A tool's text as the model reads it: at most MAX_TOOL_OUTPUT characters, and the cut said."""
    if len(text) > MAX_TOOL_OUTPUT:
        text = (
            text[:MAX_TOOL_OUTPUT] + f"\n[output cut: the tool answered {len(text)} characters; "
            f"agentenv.py passes on the first {MAX_TOOL_OUTPUT}]"
        )
    return text


# The agent's own tool when it works in a box: AgentEnv's descriptor, word for word.
BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string", "description": "The command."}},
    "required": ["command"],
}
BASH_TOOL = {
    "name": "bash",
    "inputSchema": BASH_SCHEMA,
    "description": "Run a bash command where the agent works, as its user, in its folder; "
    "returns its stdout, then its stderr.",
}
SH_TOOL = {
    "name": "bash",
    "inputSchema": BASH_SCHEMA,
    "description": "Run a command where the agent works, as its user, in its folder, with "
    "POSIX sh: this place has no bash, so bash-only syntax such as [[ ]], "
    "arrays or <(...) fails. Returns its stdout, then its stderr.",
}


LONG_COMMAND = 100_000  # bytes of a bash command past which it goes on stdin, not argv
# Reads the command from stdin (its trailing newlines kept), then runs it with stdin empty.
FROM_STDIN = 'c=$(cat; echo .); c=${c%.}; exec </dev/null; eval "$c"'


async def run_bash(box: Box, arguments: dict[str, Any], timeout: float) -> ToolResult:
    """One bash call in the agent's box: a fresh shell in its folder as its user, stdin empty;
    stdout then stderr, and ``exit code N`` after a failure, as AgentEnv's proxy answers. Past
    ``timeout`` every process of the call is killed and the model reads that it timed out."""
    command = arguments.get("command")
    if not isinstance(command, str):
        return ToolResult(f"tool 'bash' takes a command string, not {command!r}", BAD_ARGUMENTS)
    shell = "bash" if box.has_bash else "sh"
    text = command.encode("utf-8", "replace")
    # A long command goes on stdin (an argument has at most 128 KiB), and runs as it would in -c.
    ran = await (
        box.run([shell, "-c", command], timeout, cap=MAX_TOOL_OUTPUT)
        if len(text) <= LONG_COMMAND
        else box.run([shell, "-c", FROM_STDIN], timeout, cap=MAX_TOOL_OUTPUT, stdin=text)
    )
    if ran.timed_out:
        return ToolResult(
            f"error: the command timed out after {timeout:g}s, so {ran.stopped}; "
            "the files are as it left them. Run long jobs in steps",
            TOOL_ERROR,
        )
    out = ran.output
    if ran.printed > len(ran.stdout) + len(ran.stderr):
        out = out[:MAX_TOOL_OUTPUT] + (
            f"\n[output cut: the command printed {ran.printed} bytes; "
            f"agentenv.py passes on the first {MAX_TOOL_OUTPUT} "
            "characters of its stdout, then of its stderr]\n"
        )
    if ran.exit_code == 0:
        return ToolResult(out)
    out = out[:-1] if out.endswith("\n") else out
    return ToolResult(
        f"{out}\nexit code {ran.exit_code}" if out else f"exit code {ran.exit_code}", TOOL_ERROR
    )


JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (
        isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def schema_misfit(arguments: dict[str, Any], schema: Any) -> str | None:
    """How arguments break a tool's input schema at its top level (a required one missing, one it
    doesn't take, one of another JSON type), or None: what tells bad arguments from a tool that
    failed, when the env's answer is only an error text."""
    if not isinstance(schema, dict):
        return None
    properties = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    missing = [k for k in schema.get("required") or [] if isinstance(k, str) and k not in arguments]
    if missing:
        return f"missing {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        if extra := [k for k in arguments if k not in properties]:
            return f"it takes no {', '.join(extra)}"
    for key, value in arguments.items():
        kinds = (
            properties.get(key, {}).get("type") if isinstance(properties.get(key), dict) else None
        )
        kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
        known = [JSON_TYPES[k] for k in kinds if k in JSON_TYPES]
        if known and not any(fits(value) for fits in known):
            return f"{key} is not {' or '.join(kinds)}"
    return None


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

    async def apply(
        self,
        http: aiohttp.ClientSession,
        uri: str,
        args: dict[str, Any],
        timeout: float,
        tolerate: bool,
    ) -> None:
        """Post one apply_server_config directive to the extension the env's card advertises."""
        extensions = ((self.card or {}).get("capabilities") or {}).get("extensions") or []
        extension = next(
            (e for e in extensions if isinstance(e, dict) and e.get("uri") == uri), None
        )
        if extension is None:
            if tolerate:
                log.info(
                    "Env %r advertises no extension %s; skipped (tolerate_unadvertised).",
                    self.spec.name,
                    uri,
                )
                return
            offered = [e.get("uri") for e in extensions if isinstance(e, dict)]
            raise EpisodeFailed(
                f"env {self.spec.name!r} advertises no extension {uri!r} on its card "
                f"(it advertises {offered}); fix the directive's uri or the env's card"
            )
        params = extension.get("params") or {}
        methods = [m for m in (params.get("methods") or {}).values() if isinstance(m, dict)]
        endpoint = (methods[0].get("endpoint") if methods else None) or params.get("endpoint")
        verb = str((methods[0].get("method") if methods else None) or "POST").upper()
        if not endpoint:
            raise EpisodeFailed(f"env {self.spec.name!r} advertises {uri!r} with no endpoint")
        url = self.instance.base_url + "/" + str(endpoint).lstrip("/")
        request = (
            http.get(url, params={k: str(v) for k, v in args.items()})
            if verb == "GET"
            else http.request(verb, url, json=args)
        )
        try:
            async with asyncio.timeout(timeout):
                async with request as resp:
                    if resp.status >= 300:  # what it says, not all it may send
                        said = (await resp.content.read(4096)).decode("utf-8", "replace")
                        raise EpisodeFailed(
                            f"env {self.spec.name!r} refused {uri!r} with HTTP "
                            f"{resp.status}: {short(said, 300)}"
                        )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EpisodeFailed(
                f"env {self.spec.name!r} did not take {uri!r} within {timeout:g}s "
                f"({type(exc).__name__}: {exc})"
            ) from None


async def while_running(
    work: Awaitable[Any], stopped: asyncio.Future[str] | None, what: str
) -> Any:
    """``work``'s result, unless the env's ``stopped`` comes first: ``work`` is then cancelled
    (a verifier's reads of a dead env would wait for answers nothing sends) and EpisodeFailed
    says ``what`` and how the env ended."""
    if stopped is None:
        return await work
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise EpisodeFailed(f"{what}: {stopped.result()}", PEER_DROP)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # its end, not its error: ours is raised
        if not task.cancelled():
            task.exception()  # read, so that none is logged as never read


async def wait_ready(
    http: aiohttp.ClientSession,
    instance: Instance,
    env: EnvSpec,
    timeout: float,
    deadline: float | None = None,
    max_body: int = Settings.max_env_reply,
) -> DeployedEnv:
    """Wait until a launched env answers: its card with its name (or, with no card, MCP
    ``initialize``), and a tools list with at least one tool and no name twice, each answer read
    within ``max_body`` bytes (max_env_reply).

    It fails at once when the env stops, and on every failure quotes the env's last output: the
    sandbox could not provide the env (provider_unavailable), or it missed ``timeout`` (which
    ends at ``deadline`` when earlier tries of the same deploy used some of it). An env that
    breaks MCP so that no second try mends it (McpBroken: a listing that never ends, say) fails
    at once, masked env_failed.
    """
    deadline = deadline or time.monotonic() + timeout
    delay, last = 0.01, "it did not answer"
    while True:
        if why := await instance.exited():
            raise EpisodeFailed(
                f"env {env.name!r} did not come up: {why}. Its last output:\n"
                f"{short(await instance.output())}",
                PROVIDER_UNAVAILABLE,
            )
        try:
            card = await _read_card(http, instance.base_url, max_body)
            if card is not None and card.get("name") != env.environment_name:
                await _answers_itself(instance)  # another's env, with its card, holds the port
                raise EpisodeFailed(
                    f"env {env.name!r} answers with the card of {reprlib.repr(card.get('name'))}, "
                    "not "
                    f"{env.environment_name!r}; set environment_name in envs/{env.name}/env.toml, "
                    "or "
                    "make the server take its name from ENVIRONMENT_NAME",
                    PROVIDER_UNAVAILABLE,
                )
            mcp_url = instance.base_url + "/" + _mcp_path(card).lstrip("/")
            session = McpSession(mcp_url, stopped=instance.stopped, max_body=max_body)
            try:
                await session.open(timeout=5)
                tools = await session.list_tools()
                await session.close()
            finally:
                session.drop()  # a session that failed is not ended on the server
            if not tools:
                raise EpisodeFailed(
                    f"env {env.name!r} lists no tools; an env offers at least one",
                    PROVIDER_UNAVAILABLE,
                )
            listed = collections.Counter(t["name"] for t in tools)
            if dupes := sorted(name for name, count in listed.items() if count > 1):
                raise EpisodeFailed(
                    f"env {env.name!r} lists the tools {dupes} twice; tool names are unique",
                    PROVIDER_UNAVAILABLE,
                )
            await _answers_itself(instance)
            return DeployedEnv(env, instance, mcp_url, card, tools)
        except McpBroken as exc:
            raise env_broke(env.name, exc) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, McpError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise EpisodeFailed(
                f"env {env.name!r} was not ready within {timeout:g}s (last: {last}), "
                "the deploy deadline; if it is only slow, raise --deploy-timeout "
                "(deploy_timeout in a Gym config). Its last output:\n"
                f"{short(await instance.output())}",
                TRANSPORT_TIMEOUT,
            )
        # polling: a server that isn't listening yet sends no event to wait for
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)


async def _answers_itself(instance: Instance) -> None:
    """Raise McpError (keep waiting) while what answers on the env's port is not the env: its
    port was taken before it bound it, and it is expected to fail to bind it and exit."""
    if not await instance.answers_itself():
        raise McpError(
            f"another process answers on {instance.base_url}, which the env was to "
            "listen on; the env is expected to fail to bind it"
        )


async def _read_card(
    http: aiohttp.ClientSession, base_url: str, max_body: int = Settings.max_env_reply
) -> dict[str, Any] | None:
    """The env's card, or None when the server has none (a plain MCP server); one longer than
    ``max_body`` or nested past MAX_NESTING is McpBroken."""
    async with http.get(
        base_url + "/.well-known/agent-env.json", timeout=aiohttp.ClientTimeout(total=5)
    ) as resp:
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise McpError(f"its card answered HTTP {resp.status}")
        raw = bytearray()
        while chunk := await resp.content.read(max_body + 1 - len(raw)):
            raw += chunk
            if len(raw) > max_body:
                raise McpBroken(
                    f"its card is longer than the {bytes_said(max_body)} agentenv.py "
                    "reads of an answer (max_env_reply); make it shorter"
                )
    card = loads(bytes(raw))
    if not isinstance(card, dict) or not card.get("name"):
        raise McpError("its card has no name yet")
    if nesting(card) > MAX_NESTING:
        raise McpBroken(
            f"its card nests more than {MAX_NESTING} levels of JSON deep, past what "
            "agentenv.py takes; flatten it"
        )
    return card


def _mcp_path(card: dict[str, Any] | None) -> str:
    for interface in (card or {}).get("additionalInterfaces") or []:
        if (
            isinstance(interface, dict)
            and interface.get("transport") == "mcp"
            and interface.get("url")
        ):
            return str(interface["url"])
    return "/mcp"


# ================================================================ 5. Verifiers
#
# What scores an episode, and how each verifier's failures are told apart, the same on every kind:
# - a check that ran and failed (a criterion not met or timed out, tests that exit non-zero or
#   hang, a reward file that says 0), and, in the model's box, an output path of a unit-test
#   verifier that still held what the model left there after it was cleared, is the model's: a
#   score of 0, or, where the step fails its task, a Forfeit, scored 0, never masked;
# - a verifier that raised, hung, or gave what can't be scored (its code, its setup commands in a
#   box the model never had, a user its box lacks, an aggregate over a verifier that gave nothing)
#   is VERIFIER_ERROR, masked;
# - the env or the box under it that died is the machine's (PEER_DROP), masked; what the model's
#   commands did to its own box is its doing (the episode tells which).


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
            why = "all needles present" if passed else f"missing: {missing}"  # AgentEnv's words
        else:
            pattern = criterion["pattern"]
            passed = re.search(pattern, response, _regex_flags(criterion.get("flags"))) is not None
            why = "pattern matched" if passed else f"no match for pattern {pattern!r}"
        rows.append(
            {
                **criterion,
                "criterion_index": n,
                "score": 1.0 if passed else 0.0,
                "result": passed,
                "justification": why,
            }
        )
    return rows


async def sandbox_rows(
    box: Box, criteria: list[dict[str, Any]], base_dir: str, timeout: float, clean: bool = False
) -> list[dict[str, Any]]:
    """Check a box against verify_sandbox criteria, one row per criterion, as AgentEnv does:
    probes of paths and reads as root, shell checks as the box's user in ``base_dir`` (``clean``:
    with nothing the agent planted on the way in)."""
    rows = []
    for n, criterion in enumerate(criteria):
        kind = criterion.get("type")
        row = {**criterion, "criterion_index": n}
        if kind not in SANDBOX_CRITERIA:
            rows.append(
                {
                    **row,
                    "skipped": True,
                    "justification": f"type {kind!r} not handled by verify_sandbox",
                }
            )
            continue
        passed, why = await _criterion(box, criterion, base_dir, timeout, clean)
        rows.append(
            {
                **row,
                "score": 1.0 if passed else 0.0,
                "result": passed,
                "justification": why,
                "skipped": False,
            }
        )
    return rows


async def _criterion(
    box: Box, criterion: dict[str, Any], base_dir: str, timeout: float, clean: bool
) -> tuple[bool, str]:
    kind, paths = criterion["type"], criterion.get("paths") or []
    if kind in ("probe_file_exists", "probe_dir_exists"):
        if not paths:
            return False, "no paths specified"
        missing = []
        for path in paths:
            ran = await box.run(
                ["test", "-e" if kind == "probe_file_exists" else "-d", box.path(path, base_dir)],
                timeout,
                root=True,
            )
            if ran.timed_out:
                return False, f"timed out checking {path} after {timeout:g}s"
            if ran.exit_code != 0:
                missing.append(path)
        return (False, f"Missing: {missing}") if missing else (True, "All paths exist")
    if kind == "probe_file_contains":
        if not paths:
            return False, "no path"
        pattern = str(criterion.get("expected", criterion.get("value", "")))
        ran = await box.run(["cat", box.path(paths[0], base_dir)], timeout, root=True)
        if ran.timed_out:
            return False, f"timed out reading {paths[0]} after {timeout:g}s"
        if ran.exit_code != 0:
            return False, f"could not read {paths[0]}: {ran.stderr.decode(errors='replace')[:100]}"
        try:
            found = re.search(pattern, ran.stdout.decode(errors="replace")) is not None
        except re.error as exc:
            return False, f"invalid regex pattern {pattern!r}: {exc}"
        return found, f"{'contains' if found else 'does not contain'} {pattern!r}"
    command = criterion.get("bash_cmd")
    if not command:
        return False, "no bash_cmd"
    ran = await box.run(["bash", "-c", command], timeout, cwd=box.path(base_dir), clean=clean)
    if ran.timed_out:
        return False, f"timed out after {timeout:g}s"
    return (
        ran.exit_code == 0,
        f"exit={ran.exit_code}; stderr={ran.stderr.decode(errors='replace')[:200]}",
    )


TIMED_OUT_EXIT = 124  # the exit code of a unit-test command killed at its deadline, as timeout(1)'s
# Bytes of a unit-test verifier's result file read, and kept in its record: the record goes to
# clients, where a byte of a binary file may take six (a JSON escape), twice (OpenEnv's metadata).
RESULT_FILE_CAP = 16 << 10


def unit_test_rows(
    ran: Ran, reward_path: str | None, reward: Any, unread: str = ""
) -> tuple[list[dict[str, Any]], float]:
    """The row and score of a run_container_unit_tests_verifier: the exit code, or the reward file
    (``unread``: why it gave nothing to read, when it is there but was not read)."""
    status = f"exit_code={ran.exit_code} timed_out={ran.timed_out}"
    if not reward_path:
        passed = ran.exit_code == 0 and not ran.timed_out
        return [
            {"id": "exit_code", "score": float(passed), "result": passed, "message": status}
        ], float(passed)
    value = None
    if not isinstance(reward, bool):
        with contextlib.suppress(TypeError, ValueError):
            value = float(reward)
    if value is None or not math.isfinite(value):
        said = unread or "missing or non-numeric"
        return [
            {
                "id": "reward",
                "score": 0.0,
                "result": False,
                "message": f"reward file {reward_path!r} {said} ({status})",
            }
        ], 0.0
    value = min(1.0, max(0.0, value))
    return [
        {
            "id": "reward",
            "score": value,
            "result": value >= 1.0,
            "message": f"reward={value} ({status})",
        }
    ], value


# run_code's runner: stdlib only, run in the box with the step's folder, entry function and script.
RUN_CODE_RUNNER = """import importlib.util, json, os, sys
folder, entry, script = sys.argv[1:4]
path = os.path.join(folder, script)
sys.path[:0] = [os.path.dirname(path), folder]
spec = importlib.util.spec_from_file_location("agent_env_user_script", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
with open(os.path.join(folder, "input.json")) as f:
    given = json.load(f)
result = getattr(module, entry)(given)
with open(os.path.join(folder, "output.json"), "w") as f:
    json.dump(result, f)
"""
RUN_CODE_RESULT_CAP = 50 * 2**20


def load_verifier(path: Path) -> Callable:
    """Import an artifact's verifier module and return its ``verify``. Bundle code is trusted
    code."""
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

        def done(_: Any) -> None:  # when the run ends on its loop, not when its waiter stops
            with contextlib.suppress(RuntimeError):  # the server's loop has closed
                here.call_soon_threadsafe(self._ended, n)

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)

    def _ended(self, n: int) -> None:
        if n < len(self.busy):
            self.busy[n] -= 1

    def close(self) -> None:
        """Stop the loops; one a verifier still blocks is left to end with the process."""
        for loop, thread in zip(self.loops, self.threads, strict=True):
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=1)
            if not thread.is_alive():
                loop.close()
        self.blocking.shutdown(wait=False)
        self.loops, self.busy, self.threads = [], [], []


def check_rows(rows: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise EpisodeFailed(
            f"{where} returned {type(rows).__name__}; verify returns a list of "
            "{id, result, description} rows",
            VERIFIER_ERROR,
        )
    return rows


class Verifiers:
    """A bundle's verifier code (env_outcome_verifier's artifacts), run: each artifact's
    ``verify(mcp_url)`` imported once (in a thread: bundle code may be slow), then run on a
    verifier loop within the verifier deadline; what it raised, a hang, or rows that are no rows
    are VERIFIER_ERROR. Each run is counted, by artifact."""

    def __init__(self, artifacts: dict[str, Path], timeout: float, metrics: Metrics):
        self.artifacts, self.timeout, self.metrics = artifacts, timeout, metrics
        self._loaded: dict[str, asyncio.Future] = {}
        self._loops = VerifierLoops()

    async def run(self, artifact: str, mcp_url: str) -> list[dict[str, Any]]:
        """The rows artifact ``artifact``'s verify gives for the env at ``mcp_url``."""
        where = f"the verifier artifacts/{artifact}"
        loop = asyncio.get_running_loop()
        if artifact not in self._loaded:
            self._loaded[artifact] = loop.run_in_executor(
                None, load_verifier, self.artifacts[artifact]
            )
        try:
            verify = await asyncio.shield(self._loaded[artifact])
        except Exception as exc:  # noqa: BLE001 - bundle code may raise anything
            raise EpisodeFailed(
                f"{where} did not import: {type(exc).__name__}: {exc}", VERIFIER_ERROR
            ) from None
        job = self._loops.run(verify, mcp_url, self.timeout)
        started = time.monotonic()
        failed: bool | None = True  # None: cancelled (its episode ended)
        try:
            # the loop's own deadline comes first; this one is for a verifier that blocks it
            rows = check_rows(await asyncio.wait_for(job, self.timeout + 5), where)
            failed = False
            return rows
        except asyncio.TimeoutError:
            raise EpisodeFailed(
                f"{where} did not finish within {self.timeout:g}s", VERIFIER_ERROR
            ) from None
        except (EpisodeFailed, asyncio.CancelledError) as exc:
            failed = None if isinstance(exc, asyncio.CancelledError) else True
            raise
        except Exception as exc:  # noqa: BLE001 - bundle code may raise anything
            raise EpisodeFailed(
                f"{where} raised {type(exc).__name__}: {exc}", VERIFIER_ERROR
            ) from None
        finally:
            if failed is not None:
                self.metrics.verified(artifact, time.monotonic() - started, failed)

    def close(self) -> None:
        self._loops.close()


@dataclasses.dataclass(frozen=True)
class UnitTestRun:
    """What a unit-test verifier found: its rows and score, the record AgentEnv keeps of its run,
    and, when its tests failed or hung (the model's doing), why: its step then fails, scored."""

    rows: list[dict[str, Any]]
    score: float
    record: dict[str, Any]
    failed: str | None = None


async def unit_tests(
    box: Box,
    name: str,
    command: str,
    setup: list[str],
    *,
    user: str,
    env: dict[str, str],
    timeout: float,
    reward_path: str | None,
    result_paths: list[str],
    clean: bool,
) -> UnitTestRun:
    """Run a run_container_unit_tests_verifier in a box as AgentEnv does: its setup commands (one
    that fails is the verifier's failure, BoxFailed as VERIFIER_ERROR, unless the box is the
    model's), its command, then the result files read (regular files only, each to a cap); its
    rows from the exit code or the reward file. ``clean``, in the model's box: the paths it
    writes its results to are cleared before anything of it runs (what the model left there that
    could not be cleared is its 0, and the verifier does not run), it runs with nothing the agent
    planted on the way in, and what the tested code started is stopped before the results are
    read."""
    if user not in ("root", box.user):
        raise EpisodeFailed(
            f"user {user!r} is not one box {box.name!r} has; use root or {box.user}", VERIFIER_ERROR
        )
    root = user == "root"
    # A relative result path is read from the container's root, not its working folder, as
    # AgentEnv's `docker cp` reads it, so a bundle's score is the one AgentEnv gives it.
    outputs = {
        path: box.path(path, "/")
        for path in [*result_paths, *([reward_path] if reward_path else [])]
    }
    if clean and outputs and (standing := await box.clear(list(outputs.values()))):
        return not_cleared(name, reward_path, standing)
    for each in setup:
        ran = await box.run(["bash", "-c", each], timeout, root=root, env=env, clean=clean)
        if ran.timed_out or ran.exit_code != 0:
            raise BoxFailed(
                f"Verifier {name!r}: setup command {each!r} "
                f"{'timed out' if ran.timed_out else f'exited {ran.exit_code}'}: "
                f"{short(ran.output, 1500)}",
                VERIFIER_ERROR,
            )
    if reward_path and (setup or not clean):  # AgentEnv's own removal, after the setup
        await box.run(["rm", "-f", outputs[reward_path]], 30, root=root)
    ran = await box.run(["bash", "-c", command], timeout, root=root, env=env, clean=clean)
    if ran.timed_out:  # recorded as AgentEnv's `timeout` reports it
        ran = dataclasses.replace(ran, exit_code=TIMED_OUT_EXIT)
    if clean:  # nothing the tested code started, as the agent or as root, writes on
        await box.stop_all()
    extracted, unread = await read_results(box, outputs)
    rows, score = unit_test_rows(
        ran, reward_path, extracted.get(reward_path or ""), unread.get(reward_path or "", "")
    )
    record = {
        "exit_code": ran.exit_code,
        "timed_out": ran.timed_out,
        "stdout_head": ran.stdout[:500].decode(errors="replace"),
        "stderr_head": ran.stderr[:500].decode(errors="replace"),
        "extracted_files": extracted,
    }
    # The tests that failed or hung are the model's doing wherever they ran: a 0, never a mask.
    failed = None
    if ran.timed_out:
        failed = f"Verifier {name!r} timed out after {timeout:g}s"
    elif ran.exit_code != 0 and not reward_path:
        failed = (
            f"Verifier {name!r} exited {ran.exit_code}; stderr (last 1500 chars):\n"
            f"{ran.stderr.decode(errors='replace')[-1500:]}"
        )
    return UnitTestRun(rows, score, record, failed)


def not_cleared(name: str, reward_path: str | None, standing: str) -> UnitTestRun:
    """A unit-test verifier in the model's box whose output paths still held what the model left
    there after they were cleared: it is not run, and the step fails scored 0, saying so."""
    why = (
        f"Verifier {name!r} did not run: what the model left at its output paths could not be "
        f"cleared, so a result read there would be the model's, not the verifier's: {standing}"
    )
    row = {
        "id": "reward" if reward_path else "exit_code",
        "score": 0.0,
        "result": False,
        "message": why,
    }
    record: dict[str, Any] = {
        "exit_code": None,
        "timed_out": False,
        "stdout_head": "",
        "stderr_head": "",
        "extracted_files": {},
    }
    return UnitTestRun([row], 0.0, record, why)


async def read_results(box: Box, outputs: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each result file as the record keeps it (as JSON where it is JSON, else as text; None where
    nothing was read; cut at RESULT_FILE_CAP, and saying so), and why those there gave nothing."""
    found = await asyncio.gather(
        *(box.read_result(where, RESULT_FILE_CAP) for where in outputs.values())
    )
    extracted: dict[str, Any] = {}
    unread: dict[str, str] = {}
    for path, got in zip(outputs, found, strict=True):
        if got.head is None:
            extracted[path] = None
            if got.why:
                unread[path] = got.why
        elif got.size > RESULT_FILE_CAP:
            extracted[path] = got.head.decode(errors="replace") + (
                f"\n[cut: the file holds {got.size} bytes; the record keeps its first "
                f"{RESULT_FILE_CAP}]"
            )
            unread[path] = f"holds {got.size} bytes, more than a result file may hold"
        else:
            text = got.head.decode(errors="replace")
            try:
                extracted[path] = json.loads(text)
            except ValueError:
                extracted[path] = text
    return extracted, unread


# ================================================================ 6. Episode

TEARDOWN_RETRY = (1.0, 30.0)  # seconds between a failed teardown's tries: first, and at most


@dataclasses.dataclass(frozen=True)
class EpisodeContext:
    """What an episode plays on, and all it uses of the runtime that holds it (section 7 makes
    one as it starts): the bundle, the sandbox, the HTTP client, the metrics, the verifiers and
    the deadlines; and the runtime's pool, start gate, warm envs and set of live episodes, by the
    few calls an episode makes of them."""

    bundle: Bundle
    sandbox: Sandbox
    http: aiohttp.ClientSession
    metrics: Metrics
    verifiers: Verifiers
    deploy_timeout: float
    bash_timeout: float
    max_env_reply: int  # bytes of an env's answer read
    enter: Callable[[], Awaitable[None]]  # a slot of the pool, once one is free
    leave: Callable[[], None]  # the slot given back
    starting: Callable[[], contextlib.AbstractAsyncContextManager[None]]  # a start slot: a launch
    warm: Callable[[EnvSpec, dict[str, Any]], Awaitable[DeployedEnv | None]]  # a warm env, if ready
    live: set[Episode]  # the live episodes, which it joins and leaves
    closing: asyncio.Event  # set as the runtime closes: teardowns stop retrying
    clearing: Callable[
        [asyncio.Event], contextlib.AbstractAsyncContextManager[None]
    ]  # a teardown's turn
    settled: Callable[[], None]  # told as an episode ends: background work may go


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How an episode ended: ``scored`` (its scores and reward), or ``failed`` (the environment
    failed it: a trainer masks the rollout) or ``abandoned`` (its caller ended it), with why."""

    status: str  # "scored", "failed" or "abandoned"
    scores: dict[str, float]
    reward: float | None = None
    failure: Failure | None = None
    forfeit: str | None = None  # scored 0 because the model's doing ended it: why
    # what each verifier said, row by row (verifier_id -> {results, score}): why the scores are so
    verifications: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)


class Turn:
    """One turn of the played agent: its prompt and tools, open until ``end`` hands its reply
    back."""

    def __init__(
        self,
        episode: Episode,
        step: Step,
        prompt: str,
        system_prompt: str | None,
        tools: list[dict[str, Any]],
        route: dict[str, McpSession | None],
        box: Box | None = None,
    ):
        self.episode, self.step = episode, step
        self.prompt, self.system_prompt = prompt, system_prompt
        self.tools, self.route = tools, route
        self.box = box  # the agent's box, where its bash runs (route None)
        self.commands: set[asyncio.Task] = set()  # its bash commands under way
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    @property
    def id(self) -> str:
        return self.step.id

    @property
    def is_open(self) -> bool:
        return not self.ended.done() and not self.episode.over

    @property
    def tool_specs(self) -> list[dict[str, Any]]:
        """The turn's tools as a model is shown them: name, description, input schema."""
        return [
            {
                "name": t["name"],
                "description": t.get("description") or "",
                "input_schema": t.get("inputSchema") or {"type": "object", "properties": {}},
            }
            for t in self.tools
        ]

    async def call(self, name: str, arguments: Any, timeout: float | None = None) -> ToolResult:
        """Call a tool of this turn. The model's mistakes and the tool's errors come back as results
        it can learn from; past ``timeout`` the episode ends and the result says so (TIMEOUT); an
        env that fails fails the episode (EpisodeFailed). Every call is counted, by its status."""
        if not self.is_open:
            raise AgentEnvError(f"turn {self.id!r} has ended; call the tools of the current turn")
        metrics = self.episode.context.metrics
        session = self.route.get(name)
        if session is None and not (name == "bash" and self.box is not None):
            offered = ", ".join(t["name"] for t in self.tools) or "none"
            metrics.tool_called(UNKNOWN_TOOL_LABEL, UNKNOWN_TOOL, None)
            return ToolResult(f"there is no tool {name!r}; the tools are: {offered}", UNKNOWN_TOOL)
        if not isinstance(arguments, dict):
            metrics.tool_called(name, BAD_ARGUMENTS, None)
            return ToolResult(
                f"the arguments of {name} must be a JSON object, not {type(arguments).__name__}",
                BAD_ARGUMENTS,
            )
        started, status = time.monotonic(), CANCELLED_CALL
        try:
            result = await (
                self._bash(arguments, timeout)
                if session is None
                else self._call(session, name, arguments, timeout)
            )
            status = result.status
            return result
        except EpisodeFailed as exc:
            status = CANCELLED_CALL if exc.failure.kind == SESSION_LOST else ENV_FAILED_CALL
            raise
        except asyncio.CancelledError:
            # Its caller gave up mid-call (its client went away): what the call does may still be
            # under way, so the episode ends, and its env and box go at once.
            self.episode.end(f"its client went away during a call to {name}")
            raise
        finally:
            metrics.tool_called(name, status, time.monotonic() - started)

    async def _call(
        self, session: McpSession, name: str, arguments: dict[str, Any], timeout: float | None
    ) -> ToolResult:
        try:
            async with asyncio.timeout(timeout):
                result = await session.call_tool(name, arguments)
            if result.status == TOOL_ERROR and schema_misfit(arguments, self._schema(name)):
                return ToolResult(result.text, BAD_ARGUMENTS)  # the env's words, our status
            return result
        except asyncio.TimeoutError:
            result = ToolResult(missed(name, timeout or 0), TIMEOUT)
            self.episode.end(Failure(TRANSPORT_TIMEOUT, result.text))
            return result
        except (aiohttp.ClientError, McpError) as exc:
            if stopped := self.episode.stopped:  # ended from outside, its env torn down
                raise EpisodeFailed(
                    f"{name} was cut short: the episode was ended, since {stopped.reason}",
                    SESSION_LOST,
                ) from None
            failure = Failure(
                PEER_DROP,
                f"{name} failed because the env failed: "
                f"{await self.episode.steps.env_trouble(exc)}",
            )
            self.episode.end(failure)
            raise EpisodeFailed(failure) from None

    async def _bash(self, arguments: Any, timeout: float | None) -> ToolResult:
        """A bash call in the agent's box, within ``bash_timeout`` and inside the call's own
        deadline (with room to kill it first): a command that runs too long is the model's
        doing, answered as a tool error, and the episode goes on. A box that fails fails it."""
        assert self.box is not None
        if not isinstance(arguments, dict):
            return ToolResult(
                'the arguments of bash must be a JSON object such as {"command": "ls"}',
                BAD_ARGUMENTS,
            )
        limit = self.episode.context.bash_timeout
        if timeout:
            limit = min(limit, max(0.5, timeout - min(5.0, timeout / 5)))
        # the command in a task of the turn's, so that the turn's end stops it (stop_commands)
        command = asyncio.ensure_future(run_bash(self.box, arguments, limit))
        self.commands.add(command)
        command.add_done_callback(self.commands.discard)
        try:
            return await command
        except asyncio.CancelledError:
            if command.cancelled() and not current_task().cancelling():
                return ToolResult(
                    "error: the turn ended while this command ran, so it was stopped", TOOL_ERROR
                )
            raise
        except BoxGone as exc:
            if stopped := self.episode.stopped:
                raise EpisodeFailed(
                    f"bash was cut short: the episode was ended, since {stopped.reason}",
                    SESSION_LOST,
                ) from None
            if fault := await self.box.fault():
                failure = Failure(
                    PEER_DROP, f"bash failed because the agent's box failed: {exc}; {fault}"
                )
                self.episode.end(failure)
                raise EpisodeFailed(failure) from None
            # the box died of what the model's commands did (its memory): the model's 0
            self.episode.forfeit(f"the agent's box died under a bash command: {exc}")
            return ToolResult(
                f"error: your box died under this command ({exc}), so the episode "
                "has ended, and scores 0",
                TOOL_ERROR,
            )

    def _schema(self, name: str) -> Any:
        return next((t.get("inputSchema") for t in self.tools if t.get("name") == name), None)

    async def stop_commands(self) -> None:
        """Stop the bash commands still under way (the turn has ended: none starts after)."""
        for command in self.commands:
            command.cancel()
        await asyncio.gather(*self.commands, return_exceptions=True)

    def end(self, response: str | None) -> None:
        """End the turn with the agent's reply; the episode goes on to its next step."""
        if not self.ended.done():
            self.ended.set_result(response or "")


class Steps:
    """The steps of an episode's task, each done by its handler: a method per step type
    (``HANDLERS``, below). They run as AgentEnv runs them: each after the steps it depends on (by
    default every step before it), several at once where the graph allows. What they make (the
    envs, the agent and its box, the sandboxes' boxes and containers) and what they record (the
    replies, run_code's results, the scores and verifications, why tolerated steps failed) are
    kept here: the play scores the episode from them, and the teardown removes what they made.
    A prompt_agent step opens a turn of the play (``Episode.open_turn``) and waits for its end."""

    def __init__(self, episode: Episode, task: Task, seed: dict[str, Any] | None):
        self.episode, self.context, self.task = episode, episode.context, episode.task
        self.seed = dict(seed or {})
        self.unseeded = {step.id: step for step in task.steps} if seed else {}
        self.envs: dict[str, DeployedEnv] = {}  # by env_id as the task writes it
        self.instances: list[Instance] = []  # every env launched, ready or not
        self.agent: Step | None = None
        self.boxes: dict[str, Box] = {}  # deploy_sandbox boxes, by sandbox_name
        self.agent_box: Box | None = None  # the played agent's, when it works in one
        self.containers: dict[
            tuple[str, str], Box
        ] = {}  # run_docker_container's, by (sandbox, name)
        self.skills: set[str] = set()  # the names of the skills in the agent's box
        self.verifications: dict[str, dict[str, Any]] = {}  # verifier_id -> {results, score}
        self.script_results: dict[str, Any] = {}  # run_code's results, by result_id
        self.replies: dict[str, str] = {}  # prompt_id -> reply
        self.scores: dict[str, float] = {}
        self.errors: dict[str, str] = {}  # step id -> why it failed (tolerated steps)
        self.system_prompt: str | None = None  # the agent's, as its deploy or a prompt last set it
        self.played = False  # a turn has opened: the agent's box is the model's
        self.forfeits: list[str] = []  # the model's doing that failed tolerated steps

    async def run(self) -> None:
        """Run the steps as a graph: each once the steps it depends on are done. A tolerated
        failure (``fail_task_on_error: false``) counts as done, so the steps after it run, as
        AgentEnv runs them (an aggregate over a failed verifier then fails itself, saying which
        is missing); any other failure ends the episode."""
        steps = self.task.steps
        if all(before.id in step.depends_on for before, step in itertools.pairwise(steps)):
            # A chain (each step waits for the one before it, as steps do by default) runs in
            # order in the driver itself: no task per step to start, wake and gather.
            for step in steps:
                await self._run_tolerated(step)
            return
        done = {step.id: asyncio.Event() for step in steps}

        async def run(step: Step) -> None:
            for dep in step.depends_on:
                await done[dep].wait()
            await self._run_tolerated(step)
            done[step.id].set()

        tasks = [asyncio.create_task(run(step)) for step in steps]
        try:
            await _first_error(tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_tolerated(self, step: Step) -> None:
        """Run a step; its failure ends the episode unless the step tolerates it, which is then
        noted (``errors``, and ``forfeits`` if the model's doing) and passed over."""
        try:
            await self._run_step(step)
        except (EpisodeFailed, Forfeit) as exc:
            if step.fail_task_on_error:  # its dependents never start: the episode ends
                if isinstance(exc, Forfeit):
                    raise Forfeit(f"step {step.id!r} ({step.type}) failed: {exc}") from None
                raise EpisodeFailed(
                    exc.failure.told(f"step {step.id!r} ({step.type}) failed: ")
                ) from None
            if isinstance(exc, Forfeit):
                self.forfeits.append(f"step {step.id!r} ({step.type}) failed: {exc}")
            self.errors[step.id] = str(exc)
            log.info(
                "Episode %s: step %r (%s) failed: %s; going on (fail_task_on_error is false).",
                self.episode.id[:8],
                step.id,
                step.type,
                str(exc).rstrip(),
            )

    async def _run_step(self, step: Step) -> None:
        try:
            try:
                await self.HANDLERS[step.type](self, step)
            except (BoxFailed, BoxGone) as exc:
                # Once a turn has begun, the agent's box is the model's: what fails there on what
                # its commands left is its doing, scored 0; a box the machine lost is masked.
                if self.played and self._target(step) is self.agent_box is not None:
                    if fault := await self.agent_box.fault():
                        raise EpisodeFailed(f"{exc}; {fault}", PEER_DROP) from None
                    raise Forfeit(f"{exc} (in the agent's box, as its commands left it)") from None
                raise
        except asyncio.TimeoutError:  # before OSError, of which it is a kind
            raise EpisodeFailed(
                "a call to its env got no answer within its deadline; the env may "
                "be stuck or overloaded (its output may say which)",
                TRANSPORT_TIMEOUT,
            ) from None
        except (aiohttp.ClientError, McpError, OSError) as exc:
            raise EpisodeFailed(await self.env_trouble(exc), PEER_DROP) from None
        except BoxGone as exc:
            raise EpisodeFailed(str(exc), PEER_DROP) from None

    async def env_trouble(self, exc: BaseException) -> str:
        """Why a call to an env failed: an env that stopped says so, with its last output. Every
        env of the episode is asked at once, given its ``drop_settle`` to be seen stopped after a
        connection dropped (half a second at most after a reply that is no MCP: it answered)."""
        envs = list(self.envs.values())
        whys = await asyncio.gather(
            *(
                env.instance.exited(
                    settle=min(0.5, env.instance.drop_settle)
                    if isinstance(exc, McpError)
                    else env.instance.drop_settle
                )
                for env in envs
            )
        )
        for env, why in zip(envs, whys, strict=True):
            if why:
                return (
                    f"env {env.spec.name!r} stopped: {why}. Its last output:\n"
                    f"{short(await env.instance.output(), 1000)}"
                )
        return f"{type(exc).__name__}: {exc}"

    # -- the step handlers, one per step type (HANDLERS, below)

    async def _deploy_env(self, step: Step) -> None:
        envs = self.context.bundle.envs
        name = _resolve_env(step.get("env_id"), envs, self.task.id)
        assert name is not None  # (a bundle whose env_id names no env is refused at its load)
        env = envs[name]
        limits = step.limits
        metrics, sandbox = self.context.metrics, self.context.sandbox
        started = time.monotonic()
        try:
            # A warm env of the same spec, when there is one: booted and ready, so the deploy is
            # done; what the task sets up in it (apply_server_config) still follows, for this
            # episode.
            if warm := await self.context.warm(env, limits):
                self.instances.append(warm.instance)
                self.envs[step.get("env_id")] = warm
            else:
                async with self.context.starting():
                    self.envs[step.get("env_id")] = await self._launch(env, limits)
        except EpisodeFailed as exc:
            metrics.deploy_failed(env.name, sandbox.kind, exc.failure.kind)
            raise
        except (aiohttp.ClientError, McpError, OSError) as exc:  # as _run_step tells them
            metrics.deploy_failed(
                env.name,
                sandbox.kind,
                TRANSPORT_TIMEOUT if isinstance(exc, asyncio.TimeoutError) else PEER_DROP,
            )
            raise
        metrics.deployed(
            env.name,
            sandbox.kind,
            time.monotonic() - started,
            self.envs[step.get("env_id")].instance.where,
        )

    async def _launch(self, env: EnvSpec, limits: dict[str, Any]) -> DeployedEnv:
        """Launch an env and wait until it answers, within the deploy deadline. A port found
        free can be taken by another server's env before ours binds it (two servers on one
        machine); an env that died of that is started again on another port, a few times."""
        deadline, tries = time.monotonic() + self.context.deploy_timeout, 1
        while True:
            instance = await self.context.sandbox.launch(env, self.episode.id, limits)
            self.instances.append(instance)
            try:
                return await wait_ready(
                    self.context.http,
                    instance,
                    env,
                    self.context.deploy_timeout,
                    deadline,
                    self.context.max_env_reply,
                )
            except EpisodeFailed:
                if tries == PORT_TRIES or not await instance.lost_its_port():
                    raise
            log.info(
                "Env %r of episode %s lost its port to another process before binding it; "
                "starting it again on another port.",
                env.name,
                self.episode.id[:8],
            )
            with contextlib.suppress(RemovalFailed):  # then it stays, for the teardown to remove
                await instance.remove()
                self.instances.remove(instance)
            tries += 1

    async def _apply_server_config(self, step: Step) -> None:
        env = self.envs[step.get("env_id")]
        timeout = float(step.get("timeout_seconds", 30))
        for directive in step.get("directives"):
            service = directive.get("service", directive.get("environment", "*"))
            if service not in ("*", env.card_name):
                raise EpisodeFailed(
                    f"a directive names service {service!r}, but env "
                    f'{step.get("env_id")!r} serves {env.card_name!r}; use that or "*"'
                )
            await env.apply(
                self.context.http,
                directive["uri"],
                directive.get("args", {}),
                timeout,
                bool(step.get("tolerate_unadvertised", False)),
            )

    async def _deploy_agent(self, step: Step) -> None:
        self.agent = step
        if self.task.sandboxed:
            name, vm = step.get("agent_name", DEFAULT_AGENT), step.get("sandbox_name")
            # Placed on a VM-mode sandbox, its box is a container there, beside the sandbox's
            # own: on the sandbox's network, where it reaches the sandbox and its containers.
            self.agent_box = await self._open_box(
                step,
                lambda sandbox, limits: sandbox.open_box(
                    self.episode.id, name, limits, {"": (name,)} if vm else None, agents=True
                ),
            )
            for skill in step.get("skills") or []:
                await self._add_skill(skill)

    async def _open_box(
        self, step: Step, opening: Callable[[Sandbox, dict[str, Any]], Awaitable[Box]]
    ) -> Box:
        """A box the sandbox opens (``opening``, with the step's limits), under a start slot."""
        limits = {
            k: step.get(k)
            for k in ("cpu", "memory_mb", "env_vars", "command_override")
            if step.get(k)
        }
        async with self.context.starting():
            return await opening(self.context.sandbox, limits)

    def _segments(self, step: Step) -> list[str]:
        """The networks of its VM-mode sandbox a run_docker_container step's container joins:
        "" for the sandbox's own (Docker's default bridge on a VM: unset, "bridge", "default"),
        else one of the episode's by its name; none for network "none" or "host"."""
        chosen = step.get("network") or "bridge"
        names = ([] if chosen in ("none", "host") else [chosen]) + list(
            step.get("extra_networks") or []
        )
        return list(dict.fromkeys("" if n in ("bridge", "default") else n for n in names))

    def _vm_network(self, name: str) -> dict[str, tuple[str, ...]] | None:
        """A VM-mode sandbox's networks, with its box on each as ``name`` (the VM's host reaches
        every network on it): those its containers join, and its own where an agent is placed
        on it. None (no network at all) where nothing is run on it."""
        segments: set[str] = set()
        for step in self.task.steps:
            if step.get("sandbox_name") != name:
                continue
            if step.type == "run_docker_container":
                segments.update(self._segments(step))
            elif step.type == "deploy_agent" and self.task.sandboxed:
                segments.add("")
        return {s: (name,) for s in sorted(segments)} or None

    def _target(self, step: Step) -> Box | None:
        """The box a step acts in, if any: a sandbox's container (container_name, or a unit-test
        verifier's without agent_name), where its env runs (env_id), a deploy_sandbox's
        (sandbox_name), else the agent's; a turn's is the agent's."""
        if step.type == "prompt_agent":
            return self.agent_box
        if step.type not in BOX_STEPS:
            return None
        if step.get("container_name") or (
            step.type == "run_container_unit_tests_verifier" and not step.get("agent_name")
        ):
            return self.containers.get((step.get("sandbox_name"), step.get("container_name")))
        if step.get("env_id"):
            env = self.envs.get(step.get("env_id"))
            return env.instance.box(step.get("env_id")) if env else None
        if step.get("sandbox_name"):
            return self.boxes.get(step.get("sandbox_name"))
        return self.agent_box

    def _box_of(self, step: Step, default_agent: str | None = DEFAULT_AGENT) -> Box:
        """The box a step acts in (``_target``), which must be there."""
        if (box := self._target(step)) is None:
            raise EpisodeFailed(f"agent {step.get('agent_name', default_agent)!r} works in no box")
        return box

    def _the_models(self, box: Box) -> bool:
        """Whether a step's commands and copies in ``box`` meet what the model's may have left:
        the agent's box once a turn has begun. There, what a step loads replaces what stood at
        its destination, and its commands run with nothing the agent planted on the way in."""
        return self.played and box is self.agent_box

    async def _add_skill(self, skill: dict[str, Any]) -> None:
        """Put a skill in the agent's box at ~/skills/<name>/: its SKILL.md (written from an
        inline skill as AgentEnv renders one) or the bundle's skills/<name>/ folder."""
        assert self.agent_box is not None
        if "skill_artifact_id" in skill:
            name = skill["skill_artifact_id"]
            folder = self.context.bundle.skills[name]
            files = {rel: path.read_bytes() for rel, path in artifact_files(folder).items()}
        else:
            name = skill["name"]
            lines = ["---", f"name: {name}", f"description: {skill['description']}"]
            for key, label in (("license", "license"), ("compatibility", "compatibility")):
                if skill.get(key):
                    lines.append(f"{label}: {skill[key]}")
            if isinstance(skill.get("metadata"), dict) and skill["metadata"]:
                lines.append("metadata:")
                lines += [f'  {k}: "{v}"' for k, v in skill["metadata"].items()]
            if skill.get("allowed_tools"):
                lines.append(f"allowed-tools: {skill['allowed_tools']}")
            body = skill.get("body", skill.get("skill_md", skill.get("content", "")))
            files = {"SKILL.md": "\n".join([*lines, "---", "", body]).encode()}
        if name in self.skills:
            raise EpisodeFailed(f"skill {name!r} is already added; give each skill its own name")
        self.skills.add(name)
        await self.agent_box.put(
            files, f"{self.agent_box.home}/skills/{name}", replace=self._the_models(self.agent_box)
        )

    async def _deploy_sandbox(self, step: Step) -> None:
        mode, name = step.get("sandbox_mode"), step.get("sandbox_name")
        if mode == "container":  # a container of its own, on no network
            self.boxes[name] = await self._open_box(
                step,
                lambda sandbox, limits: sandbox.open_image(
                    self.episode.id, name, limits, step.get("image")
                ),
            )
        else:
            self.boxes[name] = await self._open_box(
                step,
                lambda sandbox, limits: sandbox.open_box(
                    self.episode.id, name, limits, self._vm_network(name)
                ),
            )

    async def _add_skills(self, step: Step) -> None:
        self._box_of(step)
        for skill in step.get("skills"):
            await self._add_skill(skill)

    async def _load_artifact(self, step: Step) -> None:
        box = self._box_of(step, None)
        to_agent = not step.get("sandbox_name") and not step.get("env_id")
        dest = box.path(
            step.get("destination_path") or ("/tmp/file_artifacts" if to_agent else "/loaded")
        )
        names = [a["id"] for a in step.get("artifacts") or []] or [step.get("artifact_id")]
        replace = self._the_models(box)  # once, before the step's first artifact
        for name in names:
            folder = self.context.bundle.artifacts[name]
            files = await asyncio.to_thread(artifact_bytes, folder)
            # The agent owns what it is given, so it can edit the repository it is to repair.
            await box.put(files, dest, agent_owns=to_agent, replace=replace)
            replace = False

    async def _run_code(self, step: Step) -> None:
        box = self._box_of(step)
        folder = self.context.bundle.artifacts[step.get("script_artifact_id")]
        files = artifact_files(folder)
        scripts = {
            rel: path.read_bytes()
            for rel, path in files.items()
            if rel.endswith(".py") and "/" not in rel
        }
        script = step.get("script_file") or (next(iter(scripts)) if len(scripts) == 1 else "run.py")
        if len(files) == 1 and not step.get("script_file"):
            # a single-file artifact runs as script.py, as AgentEnv stages it (tracebacks say so)
            scripts, script = {"script.py": scripts[script]}, "script.py"
        run_dir = f"/tmp/agent_env_run_code/{step.id}"
        given = {"args": step.get("args") or {}, "results": self.script_results}
        if env_id := step.get("env_id"):  # run where the env runs: its address as seen there
            env = self.envs[env_id]
            inner = env.instance.inner_url
            given["env"] = {
                "id": env_id,
                "url": inner,
                "mcp_url": inner + env.mcp_url[len(env.instance.base_url) :],
            }
        models = self._the_models(box)
        await box.put(
            {
                **scripts,
                "runner.py": RUN_CODE_RUNNER.encode(),
                "input.json": json.dumps(given).encode(),
            },
            run_dir,
            agent_owns=False,
            replace=models,
        )
        timeout = float(step.get("timeout_seconds", 600))
        where = f"run_code {step.id!r}"
        ran = await box.run(
            ["python3", f"{run_dir}/runner.py", run_dir, step.get("entrypoint", "run"), script],
            timeout,
            root=True,
            clean=models,
        )
        if ran.timed_out:
            raise BoxFailed(f"{where}: timed out after {timeout:g}s")
        if ran.exit_code != 0:
            said = ran.stderr.decode(errors="replace")  # its tail, as the script ended it
            raise BoxFailed(
                f"{where}: exited {ran.exit_code}: "
                f"{said if len(said) <= 4000 else '…' + said[-4000:]}"
            )
        out = await box.run(
            ["cat", f"{run_dir}/output.json"], 60, root=True, cap=RUN_CODE_RESULT_CAP + 1
        )
        if out.exit_code != 0:
            raise BoxFailed(f"{where}: wrote no result file: {out.stderr.decode(errors='replace')}")
        if len(out.stdout) > RUN_CODE_RESULT_CAP:
            raise BoxFailed(f"{where}: result exceeds {RUN_CODE_RESULT_CAP}-byte cap")
        try:
            self.script_results[step.get("result_id", step.id)] = json.loads(out.stdout)
        except ValueError as exc:
            raise BoxFailed(f"{where}: result is not valid JSON: {exc}") from None

    async def _verify_sandbox(self, step: Step) -> None:
        box = self._box_of(step)
        rows = await sandbox_rows(
            box,
            step.get("criteria", []),
            step.get("base_dir", "/app"),
            float(step.get("shell_timeout_seconds", 120)),
            self._the_models(box),
        )
        self._record(step, [r for r in rows if not r.get("skipped")], rows)

    async def _aggregate_verifiers(self, step: Step) -> None:
        wanted = step.get("verifier_ids", [])
        if missing := [v for v in wanted if v not in self.verifications]:
            raise EpisodeFailed(
                f"AggregateVerifiers: verifier_id(s) not found in the verifications: "
                f"{missing}. Available: {sorted(self.verifications)}",
                VERIFIER_ERROR,
            )
        rows = [
            r
            for v in wanted
            for r in self.verifications[v].get("results", [])
            if not r.get("skipped")
        ]
        self._record(step, rows, None, "weighted_average")
        # an aggregate adds no rows to an aggregate of it, only its score
        self.verifications[step.get("verifier_id") or step.id] = {
            "score": self.scores[step.id],
            "source_verifier_ids": wanted,
        }

    async def _run_docker_container(self, step: Step) -> None:
        name = step.get("container_name", "task-container")
        artifact = step.get("docker_context_artifact_id")
        image = await self.context.sandbox.build_image(
            self.context.bundle.artifacts[artifact],
            step.get("dockerfile_path", "Dockerfile"),
            artifact,
        )
        # a container of the sandbox: on its networks, reached there by its name; with network
        # "host", in the sandbox box's own network (as on the VM's host); with "none", on none
        vm = step.get("sandbox_name")
        box = await self._open_box(
            step,
            lambda sandbox, limits: sandbox.run_sibling(
                self.episode.id,
                f"{vm}/{name}",
                limits,
                image,
                {s: (name,) for s in self._segments(step)} or None,
                self.boxes[vm] if step.get("network") == "host" else None,
            ),
        )
        self.containers[(step.get("sandbox_name"), name)] = box
        if ready := step.get("ready_command"):
            for _ in range(60):
                if (await box.run(["sh", "-c", ready], 30, root=True)).exit_code == 0:
                    return
                await asyncio.sleep(2)  # polling, as AgentEnv does: a container sends no event
            raise EpisodeFailed(f"container {name!r} was not ready: {ready!r} failed for 120s")

    async def _run_container_unit_tests_verifier(self, step: Step) -> None:
        box = self._box_of(step)
        name = step.get("verifier_id", step.id)
        env = {k: str(v) for k, v in (step.get("env_vars") or {}).items()}
        verdict = await unit_tests(
            box,
            name,
            self._quoted(step, "command"),
            self._quoted(step, "setup_commands"),
            user=step.get("user", "root"),
            env={**self._seed_env(env), **env},
            timeout=float(step.get("timeout_sec", 300)),
            reward_path=step.get("reward_path"),
            result_paths=step.get("result_paths", []),
            clean=self._the_models(box),
        )
        self.scores[step.id] = verdict.score
        self.verifications[name] = {
            "results": verdict.rows,
            "score": verdict.score,
            "command": step.get("command"),
            **verdict.record,
        }
        # Its score is kept; the step fails as AgentEnv's does, scored, never masked.
        if verdict.failed:
            raise Forfeit(verdict.failed)

    def _seed_env(self, env: dict[str, str]) -> dict[str, str]:
        """The episode's seed as environment variables for a unit-test verifier, as AgentEnv
        gives them: each key upper-cased, its value as text (JSON for what isn't a string);
        keys that are no POSIX name, that the step's env_vars set, or that a shell relies on
        are skipped."""
        given = {}
        for key, value in self.seed.items():
            name = str(key).upper()
            if POSIX_NAME.fullmatch(name) and name not in env and name not in RESERVED_ENV:
                given[name] = value if isinstance(value, str) else json.dumps(value)
        return given

    def _quoted(self, step: Step, key: str) -> Any:
        """A unit-test verifier's command (or setup commands) with each ``<seed key>`` replaced
        by its value quoted for the shell, as AgentEnv does for a command."""
        if not self.seed or step.id not in self.unseeded:
            return step.get(key, [] if key == "setup_commands" else None)

        def fill(text: str) -> str:
            return PLACEHOLDER.sub(
                lambda m: (
                    shlex.quote(
                        self.seed[m[1]]
                        if isinstance(self.seed[m[1]], str)
                        else json.dumps(self.seed[m[1]])
                    )
                    if m[1] in self.seed
                    else m[0]
                ),
                text,
            )

        plain = self.unseeded[step.id].get(key, [] if key == "setup_commands" else None)
        return [fill(c) for c in plain] if isinstance(plain, list) else fill(plain)

    async def _reset_env(self, step: Step) -> None:
        env_id = step.get("env_id")
        if env_id not in self.envs:
            log.warning("reset_env: no deployed env %r in this episode; skipping.", env_id)
        else:
            log.info("reset_env: env %r does not support reset; skipping.", env_id)

    async def _prompt_agent(self, step: Step) -> None:
        agent = self.agent
        assert agent is not None
        role = agent.get("role")
        headers = {ROLE_HEADER: role} if role else {}
        sessions: list[McpSession] = []
        box = self.agent_box
        # bash first, where the agent works in a box; then each env's tools
        tools: list[dict[str, Any]] = [BASH_TOOL if box.has_bash else SH_TOOL] if box else []
        route: dict[str, McpSession | None] = {"bash": None} if box else {}
        try:
            for env_id in agent.get("env_ids", []):  # one MCP session per env per turn
                env = self.envs[env_id]
                session = McpSession(
                    env.mcp_url, headers, env.instance.stopped, self.context.max_env_reply
                )
                sessions.append(session)
                try:
                    await session.open()
                    listed = await session.list_tools()
                except McpBroken as exc:
                    raise env_broke(env.spec.name, exc) from None
                for tool in listed:
                    if is_hidden(tool):
                        continue
                    if tool["name"] == "end_turn":
                        raise EpisodeFailed(
                            f"env {env.spec.name!r} offers a tool named 'end_turn', the name of "
                            "the "
                            "tool that every wire adds to a turn to end it, so a call to the env's "
                            "would never reach it; rename that tool in the env"
                        )
                    if tool["name"] in route:
                        twice = (
                            "the agent's box and an env"
                            if route[tool["name"]] is None
                            else "two envs"
                        )
                        raise EpisodeFailed(
                            f"the tool {tool['name']!r} is offered by {twice} of "
                            "the turn; tool names are unique within a turn"
                        )
                    route[tool["name"]] = session
                    tools.append(tool)
            # a prompt's own system prompt stays the agent's for the turns after it, as in AgentEnv
            self.system_prompt = (
                step.get("system_prompt") or self.system_prompt or agent.get("system_prompt")
            )
            turn = Turn(
                self.episode, step, step.get("prompt"), self.system_prompt, tools, route, box
            )
            self.played = True
            self.episode.open_turn(turn)
            timeout = float(step.get("timeout_seconds", 600))
            try:
                # Awaited directly: a cancel or the timeout cancels ``ended``, which closes the
                # turn as end() would.
                async with asyncio.timeout(timeout):
                    reply = await turn.ended
            except asyncio.TimeoutError:
                turn.end(None)  # over for the caller too, even if the task goes on
                raise EpisodeFailed(
                    f"turn {step.id!r} was not ended within {timeout:g}s (its "
                    "prompt_agent step's timeout_seconds)"
                ) from None
            # Once the turn ends, nothing of the agent's runs on: not a background job, nor one
            # that would rewrite what the steps after it load or check.
            if box is not None:
                await turn.stop_commands()
                await box.stop_all()
            self.replies[step.get("prompt_id") or step.id] = reply
        finally:
            await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)

    async def _env_outcome_verifier(self, step: Step) -> None:
        env = self.envs[step.get("env_id")]
        try:
            rows = await while_running(
                self.context.verifiers.run(step.get("file_artifact_id"), env.mcp_url),
                env.instance.stopped,
                f"env {env.spec.name!r} stopped as its verifier read it",
            )
        except EpisodeFailed:
            # A verifier fails when the env it reads has died: the env's fault, not the verifier's.
            if why := await env.instance.exited(settle=env.instance.drop_settle):
                raise EpisodeFailed(
                    f"env {env.spec.name!r} stopped: {why}. "
                    f"Its last output:\n{short(await env.instance.output(), 1000)}",
                    PEER_DROP,
                ) from None
            raise
        self._record(step, rows)

    async def _agent_prompt_response_verifier(self, step: Step) -> None:
        reply = self.replies.get(step.get("prompt_id"), "")
        self._record(step, response_rows(step.get("criteria"), reply))

    HANDLERS: dict[str, Callable[[Steps, Step], Any]] = {
        "deploy_env": _deploy_env,
        "apply_server_config": _apply_server_config,
        "deploy_agent": _deploy_agent,
        "prompt_agent": _prompt_agent,
        "env_outcome_verifier": _env_outcome_verifier,
        "agent_prompt_response_verifier": _agent_prompt_response_verifier,
        "deploy_sandbox": _deploy_sandbox,
        "add_skills": _add_skills,
        "load_artifact": _load_artifact,
        "run_code": _run_code,
        "verify_sandbox": _verify_sandbox,
        "aggregate_verifiers": _aggregate_verifiers,
        "run_docker_container": _run_docker_container,
        "run_container_unit_tests_verifier": _run_container_unit_tests_verifier,
        "reset_env": _reset_env,
    }

    # -- scoring

    def _record(
        self,
        step: Step,
        rows: list[dict[str, Any]],
        kept: list[dict[str, Any]] | None = None,
        aggregator: str = "all_pass",
    ) -> None:
        """Score a verifier's rows; the score is recorded under the step's id, and the rows (or
        ``kept``, skipped rows too) under its verifier_id, for aggregate_verifiers to read."""
        try:
            score = aggregate_score(rows, step.get("score_aggregator", aggregator))
        except (TypeError, ValueError) as exc:
            raise EpisodeFailed(
                f"its rows can't be scored ({exc}); a row's score and weight are numbers",
                VERIFIER_ERROR,
            ) from None
        if score != score:
            raise EpisodeFailed(
                "its score is not a number (NaN); check the rows' scores", VERIFIER_ERROR
            )
        self.scores[step.id] = score
        self.verifications[step.get("verifier_id") or step.id] = {
            "results": rows if kept is None else kept,
            "score": score,
        }


class Teardown:
    """The end of an episode: every env its steps launched and every box they opened removed,
    then what the sandbox held for the episode (its network). It runs after the outcome is
    settled, so no reply waits for it, and the episode's slot is given back only once it ends.
    The boxes (the agent's own, and those steps opened) go at once, whatever plays: what the
    model left running there must not outlive its episode. With Docker the envs' removal waits
    its turn at the runtime's TeardownGate, so the removals of a burst's first rollouts to end do
    not take the cores from those still playing.

    A removal that fails is not the rollout's failure (its reward stands, unmasked): it is said
    once, counted, and tried again at growing intervals (TEARDOWN_RETRY) until what it removes is
    gone, holding the slot meanwhile (a slot is free only when its env is); once the runtime
    closes, what is left is the sandbox's (its close tries once more, the next start's sweep
    after that)."""

    def __init__(self, episode: Episode):
        self.episode = episode

    async def run(self) -> None:
        """Tear the episode down, to the end even if its driver is cancelled again meanwhile."""
        made = self.episode.steps
        if made.instances or made.boxes or made.containers or made.agent_box:
            teardown = asyncio.ensure_future(self._tear_down())
            while not teardown.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(teardown)
        else:  # nothing launched: no task to start and wake for no removal
            await self._tear_down()

    async def _tear_down(self) -> None:
        """The boxes at once, then the envs at their turn, then the episode's network; what
        failed, tried again until it is gone or the runtime closes."""
        episode, made, context = self.episode, self.episode.steps, self.episode.context
        failed = await self._removed(
            [
                *made.boxes.values(),
                *made.containers.values(),
                *([made.agent_box] if made.agent_box else []),
            ]
        )
        if made.instances:
            async with context.clearing(episode.awaited):
                failed |= await self._removed(list(made.instances))
        if failed:
            context.metrics.teardown_failed(len(failed))
            log.warning(
                "Episode %s of task %r ended %s, but its teardown failed: %s. Its slot "
                "stays taken until what is left is gone, which is tried again every "
                "%g-%gs; the outcome stands.",
                episode.id[:8],
                episode.task.name,
                episode.outcome.status if episode.outcome else "",
                "; ".join(str(exc) for exc in failed.values()),
                *TEARDOWN_RETRY,
            )
        delay, closing = TEARDOWN_RETRY[0], context.closing
        while failed and not closing.is_set():
            with contextlib.suppress(asyncio.TimeoutError):  # a timer, cut short by the close
                await asyncio.wait_for(closing.wait(), delay)
            if not (failed := await self._removed(list(failed))):
                log.info(
                    "Episode %s's teardown succeeded on a later try; its slot is free.",
                    episode.id[:8],
                )
            delay = min(delay * 2, TEARDOWN_RETRY[1])
        with contextlib.suppress(Exception):
            await context.sandbox.end_episode(episode.id)

    @staticmethod
    async def _removed(parts: list[Instance | Box]) -> dict[Instance | Box, Exception]:
        """Remove the parts at once: those whose removal failed, with why."""
        results = await asyncio.gather(*(part.remove() for part in parts), return_exceptions=True)
        return {
            part: result
            for part, result in zip(parts, results, strict=True)
            if isinstance(result, Exception)
        }


class Episode:
    """One play of a task, as trainers and surfaces drive it: it waits for a slot, has its steps
    run (Steps), hands each turn to the caller, settles the outcome, and is torn down (Teardown).
    Ending it at any point tears it down too.

    The caller drives it with ``next_turn`` → ``turn.call`` / ``turn.end`` → ... → ``result``,
    and ``end`` (or ``abandon``, which waits for the teardown) is the one way to stop it early.
    What the model does to its own box stops it scored 0 (``forfeit``), never masked.

    The outcome is settled before the teardown begins, so whoever waits for it (``result``: a
    Gym /verify, OpenEnv's last end_turn) answers at once while the envs and boxes are removed
    in the background; the episode stays among the runtime's live ones, holding its slot, until
    they are gone (``closed``), so the pool's bound counts what really runs.
    """

    HANDLERS = Steps.HANDLERS  # the step types it plays, each by its handler in Steps

    def __init__(
        self,
        context: EpisodeContext,
        task: Task,
        seed: dict[str, Any] | None = None,
        split: str = "all",
    ):
        self.context, self.task, self.split = context, task.seeded(seed), split
        self.id = uuid.uuid4().hex
        self.turn: Turn | None = None
        self.outcome: Outcome | None = None
        self.closed = asyncio.Event()
        self.awaited = asyncio.Event()  # someone waits for the teardown (abandon)
        self._changed = asyncio.Event()
        self._ending: Outcome | None = None  # how it was ended from outside, if it was
        self._holds_slot = False
        self._driver: asyncio.Task | None = None
        self.steps = Steps(self, task, seed)
        self.teardown = Teardown(self)

    # -- what its steps made and recorded, as surfaces read them (Steps keeps them)

    @property
    def envs(self) -> dict[str, DeployedEnv]:
        return self.steps.envs

    @property
    def instances(self) -> list[Instance]:
        return self.steps.instances

    @property
    def agent_box(self) -> Box | None:
        return self.steps.agent_box

    @property
    def verifications(self) -> dict[str, dict[str, Any]]:
        return self.steps.verifications

    @property
    def script_results(self) -> dict[str, Any]:
        return self.steps.script_results

    @property
    def errors(self) -> dict[str, str]:
        return self.steps.errors

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

    @property
    def over(self) -> bool:
        """Whether the episode has ended, or been ended (scored, failed, forfeited or abandoned)."""
        return self.outcome is not None or self._ending is not None

    def start(self) -> Episode:
        self._driver = asyncio.create_task(self._drive(), name=f"episode {self.id}")
        self._driver.add_done_callback(self._closed)
        self.context.live.add(self)
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
                raise AgentEnvError(
                    f"turn {self.turn.id!r} isn't ended, so the episode can't be "
                    "scored yet; end it first"
                )
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

    def forfeit(self, reason: str) -> None:
        """Stop the episode wherever it is, scored 0: the model's own doing broke it (Forfeit)."""
        if self.outcome is None and self._ending is None and self._driver is not None:
            self._ending = self._forfeited(reason)
            self._driver.cancel()

    async def abandon(self, reason: str) -> None:
        """End the episode (as ``end``) and wait until it is torn down: a teardown someone waits
        for waits for no episode playing."""
        self.awaited.set()
        self.end(reason)
        await self.closed.wait()

    def let_go(self, reason: str) -> None:
        """End the episode if it isn't over (as ``end``) and wait for nothing: its teardown is the
        runtime's, which holds its slot until it is done and waits for it when it closes."""
        self.end(reason)

    def open_turn(self, turn: Turn) -> None:
        """Hand a turn to the caller (its prompt_agent step opened it): ``next_turn`` returns it."""
        self.turn = turn
        self._signal()

    async def _wait_change(self) -> None:
        changed = self._changed
        await changed.wait()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _settle(self, outcome: Outcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.context.metrics.ended(outcome.status, self.split, outcome.reward)
            if outcome.status == "failed":
                log.warning(
                    "Episode %s of task %r failed: %s", self.id[:8], self.task.name, outcome.failure
                )
            if outcome.forfeit:
                self.context.metrics.forfeited()
                log.info(
                    "Episode %s of task %r scores 0, not masked, since the model's own doing "
                    "ended it: %s",
                    self.id[:8],
                    self.task.name,
                    outcome.forfeit,
                )
            self._signal()
            self.context.settled()

    def _closed(self, driver: asyncio.Task) -> None:
        # The one place an episode closes: after its driver ran its teardown, or was cancelled
        # before its first step, when there was nothing to tear down and no slot taken.
        if self.outcome is None:
            self._settle(self._ended_outcome("the episode was cancelled"))
        self.context.live.discard(self)
        self.closed.set()
        self._signal()

    def _ended_outcome(self, reason: str) -> Outcome:
        ending = self._ending or Outcome("abandoned", {}, None, Failure(SESSION_LOST, reason))
        return (
            ending
            if ending.forfeit
            else dataclasses.replace(ending, scores=dict(self.steps.scores))
        )

    def _forfeited(self, reason: str) -> Outcome:
        """The outcome of an episode the model's own doing ended: its reward 0, never masked."""
        scores = {**self.steps.scores, self.task.reward_step: 0.0}
        return Outcome("scored", scores, 0.0, None, reason)

    def _score(self) -> Outcome:
        """The outcome of an episode whose steps all ran: the reward step's score."""
        step, made = self.task.reward_step, self.steps
        if step not in made.scores and made.forfeits:  # the model's doing kept it from a score
            return self._forfeited(made.forfeits[0])
        if step not in made.scores:
            why = made.errors.get(step, "it did not run")
            return Outcome(
                "failed",
                dict(made.scores),
                None,
                Failure(
                    VERIFIER_ERROR, f"no reward: the run recorded no score at step {step!r} ({why})"
                ),
            )
        return Outcome(
            "scored", dict(made.scores), made.scores[step], verifications=dict(made.verifications)
        )

    # -- the driver

    async def _drive(self) -> None:
        try:
            await self.context.enter()
            self._holds_slot = True
            await self.steps.run()
            self._settle(self._score())
        except asyncio.CancelledError:
            self._settle(self._ended_outcome("the episode was cancelled"))
        except Forfeit as exc:
            self._settle(self._forfeited(str(exc)))
        except EpisodeFailed as exc:
            self._settle(Outcome("failed", dict(self.steps.scores), None, exc.failure))
        except Exception as exc:  # noqa: BLE001 - a bug must not leak an env
            log.exception(
                "Episode %s of task %r hit an unexpected error.", self.id[:8], self.task.name
            )
            self._settle(
                Outcome(
                    "failed",
                    dict(self.steps.scores),
                    None,
                    Failure(INTERNAL_ERROR, f"agentenv.py failed: {type(exc).__name__}: {exc}"),
                )
            )
        finally:
            if self.turn is not None:
                self.turn.end(None)
            await self.teardown.run()
            if self._holds_slot:
                self.context.leave()


async def _first_error(tasks: list[asyncio.Task]) -> None:
    """Wait for every task; as soon as one fails, raise its error (the caller cancels the rest).
    Of failures that land together, the earliest task's is raised, so the report is stable."""
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and (error := task.exception()) is not None:
                raise error


# ================================================================ 7. Pool and runtime

SERVE_KNOB = "--max-concurrent-envs (or MAX_CONCURRENT_ENVS)"
SERVE_FIX = "serve the bundle with a higher MAX_CONCURRENT_ENVS (or --max-concurrent-envs)"


class Pool:
    """The bound on live episodes: one semaphore. Past it, an episode waits its turn, and the
    first time that happens the server says so once, with how to raise the limit."""

    def __init__(self, limit: int, knob: str = SERVE_KNOB, trim: HeapTrim | None = None):
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise AgentEnvError(
                f"{knob.split(' ')[0]} must be a whole number of at least 1, not {limit!r}"
            )
        self.limit, self.knob = limit, knob
        self.in_use = self.waiting = 0
        self._free = asyncio.Semaphore(limit)
        self._warned = False
        self.trim = trim
        self.on_wait: Callable[[], None] = lambda: None  # told when an episode must wait

    async def acquire(self) -> None:
        if self.trim is not None:
            self.trim.busy()
        if self._free.locked() and not self._warned:
            self._warned = True
            log.warning(
                at_its_limit(
                    "The server",
                    self.limit,
                    "episodes",
                    "new episodes wait their turn",
                    f"raise {self.knob}",
                )
                + "."
            )
        self.waiting += 1
        if self._free.locked():
            self.on_wait()  # a teardown holding a slot should go now
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1
        self.in_use += 1

    def release(self) -> None:
        self.in_use -= 1
        self._free.release()
        if self.trim is not None and not self.in_use and not self.waiting:
            self.trim.drained()


class HeapTrim:
    """Hands the C allocator's free memory back to the OS once the pool has drained and stayed
    empty for ``quiet`` seconds, as it does between a training run's steps.

    glibc keeps what a thread frees in that thread's arena for reuse, and after a busy stretch
    the arenas hold megabytes nothing uses: a long run's RSS climbed in steps while the memory in
    use stayed flat (bench/soak.py measured both). ``malloc_trim(0)`` returns it. A trim takes a
    few milliseconds, in a worker thread, only while no episode is live, and never twice without
    an episode in between. Where the C library is not glibc there is nothing to call and nothing
    is done."""

    quiet = 1.0

    def __init__(self) -> None:
        import ctypes

        try:
            self._malloc_trim: Callable[[int], int] | None = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):  # musl, macOS: no such call
            self._malloc_trim = None
        self._timer: asyncio.TimerHandle | None = None
        self._trimming: asyncio.Task | None = None
        self.trims, self.returned_mib, self.took_s = 0, 0.0, 0.0

    def drained(self) -> None:
        if self._malloc_trim is not None and self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.quiet, self._start)

    def busy(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _start(self) -> None:
        self._timer = None
        if self._trimming is None or self._trimming.done():
            self._trimming = asyncio.ensure_future(self._trim())

    async def _trim(self) -> None:
        before, started = resident_mib(), time.monotonic()
        assert self._malloc_trim is not None  # (only then is a trim started)
        await asyncio.to_thread(self._malloc_trim, 0)
        took, returned = time.monotonic() - started, max(0.0, before - resident_mib())
        self.trims, self.returned_mib, self.took_s = (
            self.trims + 1,
            self.returned_mib + returned,
            self.took_s + took,
        )
        log.debug(
            "The pool drained, so the allocator gave %.1f MiB back to the OS in %.1f ms.",
            returned,
            took * 1000,
        )

    async def close(self) -> None:
        self.busy()
        if self._trimming is not None:
            await asyncio.gather(self._trimming, return_exceptions=True)


def resident_mib() -> float:
    """This process's resident memory now, in MiB (0 where /proc is not there to say)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


BACKGROUND_PATIENCE = 5.0  # seconds a warm boot or a teardown waits for the episodes playing


class Deferred:
    """Background work (a warm boot, a teardown) waiting for the episodes playing: the waiters in
    the order they came, with when each began, and one timer that looks again (``look_again``)
    once the oldest has waited ``patience`` seconds. Work that waited that long may go, one at a
    time, so a server where some episode always plays (TRL's, an eval's) still refills its warm
    pool and frees its slots."""

    def __init__(self, patience: float | None, look_again: Callable[[], None]):
        self.patience = BACKGROUND_PATIENCE if patience is None else patience
        self.look_again = look_again
        self._queue: collections.deque[tuple[asyncio.Future, float]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return sum(not granted.done() for granted, _ in self._queue)

    def add(self) -> asyncio.Future:
        granted = asyncio.get_running_loop().create_future()
        self._queue.append((granted, time.monotonic()))
        self.arm()
        return granted

    def _head(self) -> float | None:
        """When the oldest still waiting began (None: none waits)."""
        while self._queue and self._queue[0][0].done():  # gave up waiting
            self._queue.popleft()
        return self._queue[0][1] if self._queue else None

    def due(self) -> bool:
        """Whether the oldest waiter has waited its patience."""
        since = self._head()
        return since is not None and time.monotonic() - since >= self.patience

    def grant(self) -> bool:
        """Give the oldest waiter its turn; False if none waits."""
        while self._queue:
            granted, _ = self._queue.popleft()
            if not granted.done():
                granted.set_result(None)
                return True
        return False

    def arm(self) -> None:
        """Look again when the oldest waiter's patience runs out. One whose patience has run out
        and still waits is held by work under way, whose end looks again: no timer then."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        since = self._head()
        if since is not None and (left := since + self.patience - time.monotonic()) > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self.look_again)


class StartGate:
    """The bound on envs starting at once (launched, not yet answering). A booting env is all
    CPU; hundreds booting together on a few cores starve the server itself (a /health took 11 s
    with 256 at once) and boot no faster. A start that takes longer than ``hold`` seconds stops
    counting, so an env that never comes up holds back the others only that long.

    Episodes come first: a ``background`` start (a warm env) gets a slot only when no episode is
    starting an env or waiting to, so warming never takes CPU from a deploy. While episodes play
    (``playing``), one warm start at a time; and where a boot costs this machine (``paced``:
    Docker, about 0.4 CPU-seconds of the daemon's, the kernel's and the env's own, where a refill
    booting beside a step's last rollouts took half a 2-core machine from them), a warm start
    waits for the episodes: it goes once none plays, at full width, or, if some episode always
    plays, once it has waited ``patience`` seconds, one at a time. The runtime calls ``wake`` when
    an episode ends."""

    def __init__(
        self,
        size: int = 2 * (os.cpu_count() or 2),
        hold: float = 10.0,
        patience: float | None = None,
        paced: bool = False,
    ):
        self.size, self.hold, self.paced = max(size, 2), hold, paced
        self.free = self.size
        self.episodes = 0  # slots episodes hold
        self._episodes: collections.deque[asyncio.Future] = collections.deque()
        self._background = Deferred(patience, self._hand_on)
        self.playing: Callable[[], bool] = lambda: False  # whether episodes play: the runtime's

    @property
    def waiting(self) -> int:
        """Episodes waiting for a start slot."""
        return sum(not f.done() for f in self._episodes)

    @property
    def warming(self) -> int:
        """Warm envs waiting for a start slot."""
        return len(self._background)

    def wake(self) -> None:
        """Look at the waiters again (an episode has ended: perhaps none plays now)."""
        self._hand_on()

    @contextlib.asynccontextmanager
    async def slot(self, background: bool = False) -> AsyncIterator[None]:
        await self._acquire(background)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.free += 1
                self.episodes -= not background
                self._hand_on()

        timer = asyncio.get_running_loop().call_later(self.hold, release)
        try:
            yield
        finally:
            timer.cancel()
            release()

    def _open_to(self, background: bool) -> bool:
        if background:  # (one arriving has not waited: not due)
            return not (self.episodes or self.waiting or self.warming) and self._warm_room()
        return not self.waiting

    def _warm_room(self) -> bool:
        """Whether the oldest warm start waiting may begin: beside any others while no episode
        plays; while episodes play, only when no start is under way, and where a boot costs this
        machine (``paced``: Docker) once it has waited its patience."""
        if not self.playing():
            return True
        return self.free == self.size and (not self.paced or self._background.due())

    async def _acquire(self, background: bool) -> None:
        if self.free and self._open_to(background):
            self.free -= 1
            self.episodes += not background
            return
        if background:
            granted = self._background.add()
        else:
            granted = asyncio.get_running_loop().create_future()
            self._episodes.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # handed a slot as it gave up
                self.free += 1
                self.episodes -= not background
                self._hand_on()
            raise

    def _hand_on(self) -> None:
        """Give free slots to the waiters: every episode first, then warm envs, once no episode
        is starting one."""
        while self.free and self._episodes:
            granted = self._episodes.popleft()
            if not granted.done():
                self.free -= 1
                self.episodes += 1  # counted at once: a warm start must not slip in
                granted.set_result(None)
        while self.free and not self.episodes and self._background and self._warm_room():
            if self._background.grant():
                self.free -= 1
        self._background.arm()


class TeardownGate:
    """The episodes' teardowns under way at once. Removing a container costs the Docker daemon
    and the kernel about a tenth of a CPU-second (its kill: the processes, namespaces, cgroup and
    published port), and a step's rollouts end within a few seconds of each other: the teardowns
    of the first to end took from the rollouts still playing, and the step waits for its slowest.

    So where the sandbox's removals cost this machine (``paced``: Docker), a teardown waits while
    episodes play, its slot held (a slot is free only when its env is gone). Those waiting go when
    none plays or when an episode waits for a slot of the pool, ``width`` at a time (one per core:
    the removals are the daemon's and the kernel's CPU, so more at once end no sooner, and 32 at
    once starved the reply of the step's last rollout for seconds); all at once as the runtime
    closes; and if some episode always plays, one at a time once it has waited ``patience``
    seconds. The runtime calls ``wake`` when an episode ends, an episode starts to wait for a
    slot, or it closes. A teardown someone waits for (``awaited`` is set: a probe's reply, a
    reaped session's closing frame) does not wait for the episodes playing, whether it was
    awaited before it came or while it waited, but goes one per core at a time as ever, ahead
    of the others. (An episode's boxes, where the model's commands ran, never wait.)"""

    def __init__(
        self,
        paced: bool,
        playing: Callable[[], bool],
        slot_awaited: Callable[[], bool],
        closing: asyncio.Event,
        patience: float | None = None,
        width: int = os.cpu_count() or 2,
    ):
        self.paced, self.playing, self.slot_awaited, self.closing = (
            paced,
            playing,
            slot_awaited,
            closing,
        )
        self.width = max(width, 1)
        self.running = 0
        self._waiting = Deferred(patience, self._hand_on)
        self._hurried: collections.deque[asyncio.Future] = collections.deque()  # awaited, waiting

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def wake(self) -> None:
        self._hand_on()

    def _may_go(self) -> bool:
        """Whether the oldest teardown waiting may go now."""
        if not self.paced or self.closing.is_set():  # (a shutdown waits for every teardown)
            return True
        if self.running >= self.width:
            return False
        return (
            not self.playing() or self.slot_awaited() or (not self.running and self._waiting.due())
        )

    @contextlib.asynccontextmanager
    async def turn(self, awaited: asyncio.Event | None = None) -> AsyncIterator[None]:
        self._hand_on()
        if (not self._waiting and self._may_go()) or (
            awaited is not None and awaited.is_set() and self._has_room()
        ):
            self.running += 1  # (one arriving has not waited: not due)
        else:
            granted = self._waiting.add()
            hurry = None
            if awaited is not None:
                hurry = asyncio.ensure_future(awaited.wait())
                hurry.add_done_callback(
                    lambda done: None if done.cancelled() else self._hurry(granted)
                )
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():  # handed its turn as it gave up
                    self.running -= 1
                    self._hand_on()
                raise
            finally:
                if hurry is not None:
                    hurry.cancel()
        try:
            yield
        finally:
            self.running -= 1
            self._hand_on()

    def _hurry(self, granted: asyncio.Future) -> None:
        if not granted.done():
            self._hurried.append(granted)
            self._hand_on()

    def _has_room(self) -> bool:
        return not self.paced or self.closing.is_set() or self.running < self.width

    def _hand_on(self) -> None:
        while self._hurried and self._has_room():
            granted = self._hurried.popleft()
            if not granted.done():
                granted.set_result(None)
                self.running += 1
        while self._waiting and self._may_go():
            if self._waiting.grant():
                self.running += 1
        self._waiting.arm()


WarmKey = tuple[str, tuple[tuple[str, Any], ...]]  # an env and its deploy_env limits


def env_specs(bundle: Bundle) -> collections.Counter[WarmKey]:
    """Each env spec the bundle's tasks deploy (an env and its deploy_env limits), with how many
    deploys use it."""
    uses: collections.Counter[WarmKey] = collections.Counter()
    for task in bundle.tasks.values():
        for step in task.steps:
            if step.type == "deploy_env":
                env = _resolve_env(step.get("env_id"), bundle.envs, task.id)
                if env is not None:
                    uses[(env, tuple(sorted(step.limits.items())))] += 1
    return uses


def warm_plan(bundle: Bundle, warm: int, named: tuple[tuple[str, int], ...]) -> dict[WarmKey, int]:
    """How many warm envs to keep of each env spec (an env and its deploy_env limits): ``warm``
    split among the specs of the envs not ``named``, and each named env's count among its own
    specs, each by how many deploys of the bundle's tasks use it (largest remainder)."""
    uses = env_specs(bundle)
    if unknown := [name for name, _ in named if name not in bundle.envs]:
        raise AgentEnvError(
            f"--warm-env (warm_env) names {', '.join(map(repr, unknown))}, which the "
            "bundle has no env of; its envs are "
            f"{', '.join(sorted(bundle.envs)) or '(none)'}"
        )
    plan: dict[WarmKey, int] = {}
    shares = [(warm, [k for k in uses if k[0] not in dict(named)])]
    shares += [(count, [k for k in uses if k[0] == name]) for name, count in named]
    for total, keys in shares:
        if not total or not keys:
            continue
        weight = sum(uses[k] for k in keys)
        exact = {k: total * uses[k] / weight for k in keys}
        given = {k: int(exact[k]) for k in keys}
        for k in sorted(keys, key=lambda k: (given[k] - exact[k], -uses[k], k[0]))[
            : total - sum(given.values())
        ]:
            given[k] += 1
        plan.update({k: n for k, n in given.items() if n})
    return plan


class WarmPool:
    """Envs started and ready ahead of demand: up to a target of each env spec, so a deploy of
    that spec takes one at once instead of booting. It can only make a start faster: a deploy
    that finds none deploys cold, as without a pool.

    A warm env boots as an episode's does (the same sandbox, labels, readiness and deploy
    deadline) but under a background slot of the boot gate, so only when no episode is starting
    an env or waiting to; it holds no episode slot. A deploy that finds none ready but one
    launched and booting claims that one, which is up sooner than a cold start would be. Each is
    handed to one episode and torn down with it, never reused; one found dead at hand-over is
    discarded and replaced. The pool's envs are removed at shutdown, and a crash leaves them to
    the sandbox's sweep, like any env.
    """

    RETRY = (1.0, 60.0)  # the wait after a failed warm boot, doubling up to the second

    def __init__(self, runtime: Runtime, plan: dict[WarmKey, int]):
        self.runtime, self.target = runtime, plan
        self.ready: dict[WarmKey, collections.deque[DeployedEnv]] = {
            key: collections.deque() for key in plan
        }
        self.booting = dict.fromkeys(plan, 0)
        self._wake = {key: asyncio.Event() for key in plan}
        self._retry = dict.fromkeys(plan, 0.0)
        self._keepers: list[asyncio.Task] = []
        self._boots: set[asyncio.Task] = set()
        self._removals: set[asyncio.Task] = set()
        # launched boots not yet ready, each as the future an episode may claim it by (FIFO)
        self._launched: dict[WarmKey, collections.deque[asyncio.Future]] = {
            key: collections.deque() for key in plan
        }

    @property
    def counts(self) -> dict[str, int]:
        return {
            "ready": sum(map(len, self.ready.values())),
            "booting": sum(self.booting.values()),
            "target": sum(self.target.values()),
        }

    @property
    def live(self) -> int:
        """Warm envs started: ready, or booting."""
        return sum(map(len, self.ready.values())) + sum(self.booting.values())

    def describe(self) -> str:
        """The plan in a phrase for the logs: which envs, how many of each."""
        per: collections.Counter[str] = collections.Counter()
        for (env, _), count in self.target.items():
            per[env] += count
        return ", ".join(f"{env} {count}" for env, count in sorted(per.items()))

    def start(self) -> None:
        self._keepers = [
            asyncio.create_task(self._keep(key), name=f"warm {key[0]}") for key in self.target
        ]

    async def take(self, env: EnvSpec, limits: dict[str, Any]) -> DeployedEnv | None:
        """A ready warm env of this spec, checked alive, or None (then the caller deploys cold)."""
        key = (env.name, tuple(sorted(limits.items())))
        queue = self.ready.get(key)
        while queue:
            warm = queue.popleft()
            self._wake[key].set()  # boot its replacement
            try:
                # settle > 0 asks the sandbox now, not a state it read a moment ago
                why = await warm.instance.exited(settle=0.01)
            except BaseException:
                self._remove(warm.instance)
                raise
            if why is None:
                return warm
            log.warning(
                "A warm env of %r died while it waited (%s); it is discarded, and another "
                "boots in its place.",
                env.name,
                why,
            )
            self._remove(warm.instance)
        # None ready, but one launched and booting: it comes up sooner than a cold one would, so
        # the episode claims it (demand above the pool then costs no extra boot, and no time).
        if launched := self._launched.get(key):
            try:
                return await launched.popleft()  # cancelled: the boot goes back to the pool
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - it failed (logged): go cold
                return None
        return None

    async def _keep(self, key: WarmKey) -> None:
        """Keep the spec's ready and booting envs at its target; woken by a take or a boot's end.
        After a failed boot, one boot at a time tries again, until one comes up."""
        while True:
            while len(self.ready[key]) + self.booting[key] < self.target[key] and not (
                self._retry[key] and self.booting[key]
            ):
                self.booting[key] += 1
                boot = asyncio.create_task(self._boot(key))
                self._boots.add(boot)
                boot.add_done_callback(self._boots.discard)
            await self._wake[key].wait()
            self._wake[key].clear()

    async def _boot(self, key: WarmKey) -> None:
        runtime, env = self.runtime, self.runtime.bundle.envs[key[0]]
        instance: Instance | None = None
        claim: asyncio.Future = asyncio.get_running_loop().create_future()
        offered = False  # its claim offered to deploys: one may be waiting on it
        try:
            if self._retry[key]:
                await asyncio.sleep(self._retry[key])  # a failed boot: not again at once
            assert runtime.sandbox is not None  # (the pool warms once the runtime started)
            async with runtime.starting.slot(background=True):
                instance = await runtime.sandbox.launch(
                    env, f"warm-{uuid.uuid4().hex}", dict(key[1])
                )
                self._launched[key].append(claim)
                offered = True
                assert runtime.http is not None
                warm = await wait_ready(
                    runtime.http,
                    instance,
                    env,
                    runtime.settings.deploy_timeout,
                    max_body=runtime.settings.max_env_reply,
                )
            self._retry[key] = 0.0
            if claim in self._launched[key] or claim.cancelled():  # unclaimed, or its claimer left
                self.ready[key].append(warm)
            else:
                claim.set_result(warm)
            instance = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a warm boot may fail any way
            self._retry[key] = min(max(self._retry[key] * 2, self.RETRY[0]), self.RETRY[1])
            log.warning(
                "A warm env of %r did not come up (%s); the pool tries again in %gs, and "
                "its episodes deploy cold meanwhile.",
                env.name,
                short(str(exc), 500),
                self._retry[key],
            )
            if claim not in self._launched[key] and not claim.done():
                claim.set_exception(exc)  # its claimer deploys cold
        finally:
            if claim in self._launched[key]:
                self._launched[key].remove(claim)
            elif offered and not claim.done():  # claimed, and the pool is closing
                claim.set_exception(EpisodeFailed("the server shut down", SESSION_LOST))
            if instance is not None:
                self._remove(instance)
            self.booting[key] -= 1
            self._wake[key].set()

    def _remove(self, instance: Instance) -> None:
        removal = asyncio.ensure_future(instance.remove())
        self._removals.add(removal)
        removal.add_done_callback(self._removals.discard)
        removal.add_done_callback(self._removed)

    @staticmethod
    def _removed(removal: asyncio.Future) -> None:
        if not removal.cancelled() and (exc := removal.exception()) is not None:
            log.warning(
                "Removing a warm env failed: %s; the sandbox tries again as the server stops.", exc
            )

    def stop(self) -> None:
        """Stop warming: no refill begins and no boot goes on (``close`` removes what is up)."""
        for task in (*self._keepers, *self._boots):
            task.cancel()

    async def close(self) -> None:
        """Stop warming, and remove every warm env: ready, booting, or being removed."""
        self.stop()
        await asyncio.gather(*self._keepers, *self._boots, return_exceptions=True)
        for queue in self.ready.values():
            while queue:
                self._remove(queue.popleft().instance)
        await asyncio.gather(*set(self._removals), return_exceptions=True)


MIB = 1 << 20
WARM_ENV_MIB = 64  # what the default pool counts a warm env to hold when its step sets no limit
WARM_PER_CORE = 16  # the most warm envs the default keeps per core: a refill's boots, in spare CPU


def warm_default(
    sandbox: Sandbox | type[Sandbox],
    limit: int,
    machine: int | None,
    episode_mib: int,
    env_mib: int,
    cores: int = os.cpu_count() or 2,
) -> tuple[int, str]:
    """How many warm envs a server keeps when ``warm`` is left "auto", and why, in a phrase.

    None where the sandbox's provider says a pool gains it too little (``warm_by_default``: a
    local process starts as fast as a rollout's first reply hides). Else as many as the pool's
    ``limit``: a trainer sizes the pool to a step (Gym seeds a step's rollouts in a burst; TRL
    resets its generation batch one at a time), and a cold deploy is otherwise waited for by each
    rollout's first tool call. Never more than the machine can hold: the warm envs may take a
    quarter of the memory of the sandbox's machine (``memory``, where it says) that the full
    pool's episodes leave (each counted at its deploy_env's memory_mb, else WARM_ENV_MIB), and
    at most WARM_PER_CORE per core, since every one taken is booted again in spare CPU."""
    pays, said = sandbox.warm_by_default()
    if not pays:
        return 0, said
    count, why = limit, f"as many as the {limit} episode slots"
    by_cpu = WARM_PER_CORE * cores
    if by_cpu < count:
        count, why = by_cpu, f"{WARM_PER_CORE} for each of this machine's {cores} cores"
    if machine:
        spare = max(0, machine // MIB - episode_mib * limit) // 4
        if spare // env_mib < count:
            count, why = (
                spare // env_mib,
                (
                    f"as many as a quarter of {sandbox.memory_of}'s "
                    f"{machine / (1 << 30):.1f} GiB holds beside the pool, "
                    f"at {env_mib} MiB an env"
                ),
            )
    return count, f"{said}, {why}" + ("" if count else ", which is none")


def episode_memory(task: Task, box_mib: int) -> int:
    """The most memory (MiB) one episode of a task may hold, by its limits: its boxes' (a step's
    memory_mb, else ``box_mib``, what the sandbox gives a box) and its envs' where a deploy_env
    sets one."""
    total = 0
    for step in task.steps:
        boxed = step.type in ("deploy_sandbox", "run_docker_container") or (
            step.type == "deploy_agent" and task.sandboxed
        )
        if boxed or (step.type == "deploy_env" and step.get("memory_mb")):
            total += int(step.get("memory_mb") or box_mib)
    return total


class Runtime:
    """What every episode of a served bundle shares: the bundle, its settings, the sandbox, the
    pool, one HTTP client, the loaded verifiers, and the set of live episodes (so shutdown can end
    them all). Every way in (the commands, build_app, a Gym config, eval, TRL) builds it from
    checked Settings, whole; ``knob`` says how its user raises the pool."""

    def __init__(
        self,
        bundle: Bundle,
        settings: Settings = Settings(),
        *,
        knob: str = SERVE_KNOB,
        metrics: Metrics | None = None,
        serving: bool = False,
    ):
        self.bundle, self.settings = bundle, settings
        # A server's runtime works out warm="auto" at start (warm_default); a command's own
        # (check, write-gym's probe) and a bare Runtime keep no pool unless told a number.
        self.serving = serving
        self.warm_why: str | None = None  # why the default pool is the size it is
        self.heap = HeapTrim()
        self.pool = Pool(settings.max_concurrent_envs, knob, self.heap)
        self.metrics = metrics or Metrics()
        pool = self.pool
        self.metrics.watch(
            "agentenv_episodes_live",
            "Episodes holding a slot of the pool "
            "(deploying, playing, scoring, or being torn down after their reply)",
            lambda: pool.in_use,
        )
        self.metrics.watch(
            "agentenv_episodes_waiting",
            "Episodes waiting for a slot of the pool",
            lambda: pool.waiting,
        )
        self.metrics.watch(
            "agentenv_episodes_limit",
            "Episodes live at once at most (max_concurrent_envs)",
            lambda: pool.limit,
        )
        self.metrics.watch(
            "agentenv_envs_live",
            "Envs up for live episodes, by node (a Ray node's address; empty for this machine)",
            self._envs_by_node,
            "node",
        )
        self.owner = owner_id()
        self.live: set[Episode] = set()  # until torn down, scored or not
        self.closing = asyncio.Event()
        self.sandbox: Sandbox | None = None  # once started
        self.http: aiohttp.ClientSession | None = None
        self.context: EpisodeContext | None = None  # what its episodes play on, once started
        self.verifiers = Verifiers(bundle.verifiers, settings.verifier_timeout, self.metrics)
        self.starting = self._gate(StartGate())
        self.clearing = TeardownGate(False, self.playing, lambda: pool.waiting > 0, self.closing)
        self.pool.on_wait = self.clearing.wake
        self.metrics.watch(
            "agentenv_teardowns_waiting",
            "Ended episodes whose envs wait their turn "
            "to be removed (with Docker, while other episodes play)",
            lambda: self.clearing.waiting,
        )
        # (a name warm_env gives that the bundle has no env of stops it here, before any start)
        self.warm = WarmPool(
            self,
            warm_plan(
                bundle, 0 if settings.warm == AUTO else int(settings.warm), settings.warm_env
            ),
        )
        self._toolset_tools: dict[Toolset, asyncio.Future] = {}

    def _gate(self, gate: StartGate) -> StartGate:
        gate.playing = self.playing
        return gate

    def playing(self) -> bool:
        """Whether any episode is under way (not yet scored or ended)."""
        return any(episode.outcome is None for episode in self.live)

    def wake_background(self) -> None:
        """Let the gates look again at the background work waiting for the episodes playing (one
        has ended, one waits for a slot, or the runtime closes)."""
        self.starting.wake()
        self.clearing.wake()

    def _envs_by_node(self) -> dict[str, float]:
        return dict(
            collections.Counter(
                env.instance.where for episode in self.live for env in episode.envs.values()
            )
        )

    async def start(self) -> Runtime:
        """Open the sandbox (sweeping what a crashed run left, building images) and the client."""
        self.sandbox = await open_sandbox(self.owner, self.settings)
        if self.sandbox.gates_its_boots:  # each node gates its own boots: only the pool bounds
            self.starting = self._gate(StartGate(self.pool.limit))
        self.clearing.paced = self.starting.paced = self.sandbox.paced_teardown
        # Every env is prepared now, never inside an episode: a deploy then only starts a process.
        await self.sandbox.prepare(list(self.bundle.envs.values()))
        if self.bundle.boxed:
            await self.sandbox.prepare_box()
        machine = await self.sandbox.memory()
        self._weigh_memory(machine)
        if self.serving and self.settings.warm == AUTO and not self.settings.warm_env:
            self._warm_by_default(machine)
        if self.warm.target:
            self.metrics.watch(
                "agentenv_warm_envs",
                "Warm envs started ahead of demand: ready, booting, and the pool's target",
                lambda: self.warm.counts,
                "state",
            )
        # MCP keeps its session in a header; a cookie jar would only cost every call its upkeep.
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        # (the start gate read when asked: a sandbox that gates its own boots replaces it)
        self.context = EpisodeContext(
            self.bundle,
            self.sandbox,
            self.http,
            self.metrics,
            self.verifiers,
            self.settings.deploy_timeout,
            self.settings.bash_timeout,
            self.settings.max_env_reply,
            self.pool.acquire,
            self.pool.release,
            lambda: self.starting.slot(),
            self.warm.take,
            self.live,
            self.closing,
            self.clearing.turn,
            self.wake_background,
        )
        self.warm.start()
        # What starting freed (the bundle's files read, images built, the sweep's listings) goes
        # back too, as after a drain: the pool is as empty now.
        self.heap.drained()
        return self

    async def __aenter__(self) -> Runtime:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _warm_by_default(self, machine: int | None) -> None:
        """warm="auto": the pool warm_default sizes for this sandbox, machine and pool (the
        server says it at start, with how to turn it off)."""
        specs = env_specs(self.bundle)
        if not specs:  # no task deploys an env: nothing to warm
            return
        env_mib = max(int(dict(limits).get("memory_mb") or WARM_ENV_MIB) for _, limits in specs)
        assert self.sandbox is not None  # (opened first, in start)
        box_mib = self.sandbox.box_memory_mb
        episode_mib = max(episode_memory(t, box_mib) for t in self.bundle.tasks.values())
        count, why = warm_default(self.sandbox, self.pool.limit, machine, episode_mib, env_mib)
        self.warm_why = why
        if count:
            self.warm = WarmPool(self, warm_plan(self.bundle, count, ()))

    def _weigh_memory(self, machine: int | None) -> None:
        """Say once, at start, when the pool's episodes may together hold more memory in their
        boxes and containers (by their limits) than the sandbox's machine has (the Docker
        host): past it, the host's OOM killer picks among them, not each one's own limit."""
        if not machine:
            return
        assert self.sandbox is not None  # it said the machine's memory
        need, task = max(
            (episode_memory(t, self.sandbox.box_memory_mb), t.name)
            for t in self.bundle.tasks.values()
        )
        total = need * self.pool.limit
        if total * MIB > machine:
            fits = max(1, machine // (need * MIB))
            log.warning(
                "Up to %d episodes run at once, and each may hold %s MiB in its boxes and "
                "containers (by the limits of task %r): %.1f GiB in all, more than the "
                "%.1f GiB %s has, so a full pool can run the host out of memory. Lower "
                "%s to %d, or give the boxes less (the memory_mb of deploy_agent, "
                "deploy_sandbox and deploy_env steps).",
                self.pool.limit,
                f"{need:,}",
                task,
                total / 1024,
                machine / (1 << 30),
                self.sandbox.memory_of,
                self.pool.knob,
                fits,
            )

    def episode(
        self, task: Task, seed: dict[str, Any] | None = None, split: str = "all"
    ) -> Episode:
        """Start an episode of a task (played from ``split``); it waits for a slot, then deploys."""
        if self.context is None:
            raise AgentEnvError(
                "the runtime has not started; start it (async with Runtime(...)) "
                "before playing an episode"
            )
        return Episode(self.context, task, seed, split).start()

    async def first_turn_tools(
        self, task: Task, why: str, where: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Play a task as far as its first turn and list the tools that turn offers; then end it.
        A task's tools exist only once its envs are deployed: they answer tools/list, nothing else.
        It is a probe, not an episode anyone played: /metrics counts its deploy, not the episode.
        ``where`` is given, by env, the node each env ran on (where there are several)."""
        episode = self.episode(task, split=PROBE)
        try:
            turn = await episode.next_turn()
            assert turn is not None  # a task that loads has a turn
            if where is not None:
                where.update(
                    {
                        env.spec.name: env.instance.where
                        for env in episode.envs.values()
                        if env.instance.where
                    }
                )
            return turn.tool_specs
        finally:
            await episode.abandon(why)

    async def toolset_tools(self, toolset: Toolset, why: str) -> list[dict[str, Any]]:
        """The tools a toolset's turns offer, found by playing its first task as far as its first
        turn (one deploy) the first time they are asked for, and kept for every later ask; a probe
        that failed is tried again on the next."""
        probe = self._toolset_tools.get(toolset)
        if probe is None or (probe.done() and (probe.cancelled() or probe.exception())):
            task = self.bundle.toolsets[toolset][0]
            probe = self._toolset_tools[toolset] = asyncio.ensure_future(
                self.first_turn_tools(task, why)
            )
            probe.add_done_callback(
                lambda done: done.cancelled() or done.exception()
            )  # read: no warning
        return list(await asyncio.shield(probe))

    def begin_closing(self) -> None:
        """The first move of a shutdown, made before the wires end their sessions: warming stops
        (no refill boots as the episodes end), and every teardown goes at once, waiting neither
        for the episodes still playing nor to retry a failed removal (the sandbox's close tries
        once more), so the sessions' ends come back promptly."""
        if not self.closing.is_set():
            self.closing.set()
            self.warm.stop()
            self.wake_background()

    async def close(self, reason: str = "the server shut down") -> None:
        """Abandon every live episode and wait for their teardowns (those of episodes already
        scored and answered too: they are live until their envs are gone), remove the warm envs,
        and close the sandbox (which tries once more what a teardown failed to remove)."""
        self.begin_closing()
        await asyncio.gather(*(e.abandon(reason) for e in list(self.live)), return_exceptions=True)
        await self.warm.close()
        await self.heap.close()
        if self.sandbox is not None:
            await self.sandbox.close()
        if self.http is not None:
            await self.http.close()
        self.verifiers.close()


# ================================================================ 8. Plumbing

# What both wires share: the HTTP helpers and the JSON reader, the bearer token, the sessions
# table that counts both wires against the one pool, the idle sweep, and the /metrics route.

MAX_BODY = 16 * 2**20  # a request body or WebSocket frame past this is refused (413 / close)
MAX_CLIENT_WAIT = 86400.0  # the longest wait a client may state at reset (timeout_s), a day
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


async def read_body(request: web.Request) -> bytes:
    """A request's body; past MAX_BODY, a 413 that says what to do."""
    from aiohttp import web

    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise web.HTTPRequestEntityTooLarge(
            max_size=MAX_BODY,
            actual_size=request.content_length or MAX_BODY + 1,
            text=json.dumps(
                {
                    "detail": f"the body is larger than this server reads "
                    f"({MAX_BODY // 2**20} MiB); send less, such as a tool's "
                    "arguments without the data it can read itself"
                }
            ),
            content_type="application/json",
        ) from None


async def json_body(request: web.Request, allow_empty: bool = False) -> tuple[dict[str, Any], Any]:
    """A request's JSON object body, or the 422 that says what is wrong with it."""
    raw = await read_body(request)
    if not raw.strip() and allow_empty:
        return {}, None
    try:
        data = loads(raw)
    except ValueError as exc:
        return {}, json_reply(
            {
                "detail": [
                    {"type": "json_invalid", "loc": ["body"], "msg": f"the body is not JSON: {exc}"}
                ]
            },
            422,
        )
    if not isinstance(data, dict):
        return {}, json_reply(
            {
                "detail": [
                    {
                        "type": "model_attributes_type",
                        "loc": ["body"],
                        "msg": "the body must be a JSON object",
                    }
                ]
            },
            422,
        )
    return data, None


# The subprotocol /ws and /mcp answer to a client that offers it: a browser's WebSocket can
# carry no header, so the web page offers its token as a second subprotocol beside this one
# (ws_token_protocol); the server answers with this one alone, never echoing the token.
WS_PROTOCOL = "agentenv"
WS_TOKEN_PREFIX = "agentenv.bearer."


def ws_token_protocol(token: str) -> str:
    """The token as a WebSocket subprotocol: base64url, the characters a subprotocol may hold."""
    return WS_TOKEN_PREFIX + base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")


async def accept_socket(request: web.Request) -> Any:
    from aiohttp import web

    # Pings every 20 s find a socket whose far end has gone without closing it.
    socket_ = web.WebSocketResponse(heartbeat=20, max_msg_size=MAX_BODY, protocols=(WS_PROTOCOL,))
    await socket_.prepare(request)
    return socket_


class Inbox(asyncio.Queue):
    """A socket's frames as read_ahead reads them (None once it closes), and the handler's task
    while it answers one (``while_open``), for the socket's close to cancel."""

    def __init__(self, backlog: int):
        super().__init__(backlog)
        self.closed = False
        self.answering: asyncio.Task | None = None

    async def while_open(self, answer: Any) -> Any:
        """Answer a frame unless the socket closes first: a client gone mid-call cancels the
        handler then, as aiohttp cancels one whose connection is lost, so the call stops and the
        session ends at once, instead of holding its box and slot until the call would have
        ended."""
        if self.closed:
            answer.close()
            raise ConnectionResetError("the client closed its socket before its reply")
        self.answering = task = asyncio.current_task()
        try:
            return await answer
        except asyncio.CancelledError:
            if self.closed and task.uncancel() == 0:  # the close's cancel, not the handler's own
                raise ConnectionResetError("the client closed its socket during a call") from None
            raise
        finally:
            self.answering = None

    def close(self) -> None:
        self.closed = True
        if self.answering is not None:
            self.answering.cancel()


@contextlib.asynccontextmanager
async def read_ahead(socket_: Any, backlog: int = 16) -> AsyncIterator[Inbox]:
    """A socket's frames in an Inbox, read by a task of their own: while its handler is busy
    with one frame (a reset that deploys for a minute), the client's pings are still answered
    and its close still seen, as OpenEnv's own server does. aiohttp answers a ping only inside
    ``receive``; without this, a websockets client (20 s pings, 20 s to answer) drops a session
    whose reset outlasts 40 s."""
    inbox = Inbox(backlog)  # a client that floods waits, as before

    async def read() -> None:
        try:
            async for message in socket_:
                await inbox.put(message)
        finally:
            inbox.close()
            await inbox.put(None)

    reader = asyncio.create_task(read())
    try:
        yield inbox
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


def as_sent(header: str) -> bytes:
    """A header's value as the bytes it came in: aiohttp decodes headers as UTF-8, keeping any
    other byte as a lone surrogate, which a plain encode() refuses (a 500 anyone could cause)."""
    return header.encode("utf-8", "surrogateescape")


def bearer_token(token: str, locked: Callable[[Any], Any] | None = None) -> Any:
    """Middleware that asks every request, WebSocket upgrades included, for the bearer token: in
    the Authorization header, or (an upgrade only, from a browser, which can't set a socket's
    headers) as the subprotocol ws_token_protocol(token) offered beside WS_PROTOCOL. A request
    without it is refused 401: ``locked(request)``'s answer where it has one (the web page's
    form that asks for the token), else JSON that says what to send."""
    from aiohttp import web

    expected = f"Bearer {token}".encode()
    protocol = ws_token_protocol(token).encode()

    def offers_token(request: web.Request) -> bool:
        if request.method != "GET" or request.headers.get("Upgrade", "").lower() != "websocket":
            return False
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        # beside WS_PROTOCOL only: offered alone, aiohttp would log the protocols it can't answer
        return WS_PROTOCOL in offered and any(
            secrets.compare_digest(as_sent(p), protocol) for p in offered
        )

    @web.middleware
    async def require_token(request: web.Request, handler: Callable) -> Any:
        # compare_digest: the time taken says nothing about how much of a guess was right
        if not (
            secrets.compare_digest(as_sent(request.headers.get("Authorization", "")), expected)
            or offers_token(request)
        ):
            if locked is not None and (page := locked(request)) is not None:
                return page
            return web.json_response(
                {
                    "detail": "this server asks for a bearer token: send the header Authorization: "
                    "Bearer <token>, with the token serve was given (--token or "
                    "AGENTENV_TOKEN)"
                },
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="agentenv.py"'},
            )
        return await handler(request)

    return require_token


def json_errors() -> Any:
    """Middleware that answers a path no route has, or a method its route doesn't take, as NeMo
    Gym's and OpenEnv's servers do: a JSON ``detail`` (and the Allow header of a 405)."""
    from aiohttp import web

    @web.middleware
    async def as_json(request: web.Request, handler: Callable) -> Any:
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
            if exc.content_type == "application/json":
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
            return web.json_response({"detail": exc.reason}, status=exc.status, headers=allow)

    return as_json


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or "" (every interface): assume it reaches out


def host_and_port(authority: str) -> tuple[str, int | None] | None:
    """A Host header's (or an Origin's) name in lower case, without a final dot or an IPv6
    literal's brackets, and its port if it gives one; None for what names no host."""
    name, port = authority, None
    if authority.startswith("["):  # [::1]:8000
        name, bracket, rest = authority[1:].partition("]")
        if not bracket or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return None
        port = int(rest[1:]) if rest else None
    elif authority.count(":") == 1:  # 127.0.0.1:8000
        name, _, given = authority.partition(":")
        if not given.isdigit():
            return None
        port = int(given)
    name = name.rstrip(".").lower()
    return (name, port) if name else None


def is_address(name: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class BrowserGuard:
    """Keeps browsers from driving the server on anyone's behalf but its own page's (/web).

    Any page the operator visits can send requests to a server on 127.0.0.1, and a token stops
    them only where one is set; so, with a token or without, the server answers only to the Host
    names it is reached by (421 otherwise: a DNS-rebinding page names its own domain, though it
    resolves to 127.0.0.1), refuses an Origin that is not its own (403: browsers let any page
    open a WebSocket to any server, and send its Origin), refuses what a browser marks as sent
    from another site (Sec-Fetch-Site) unless it is a person's navigation to a page, and reads a
    request's body only as application/json (415: a page can send another origin a text/plain
    or form POST without asking first, never a JSON one without the CORS preflight this server
    never answers). A client that is not a browser sends no Origin or Sec-Fetch-Site, and JSON.

    The names answered to are loopback's (localhost and its subdomains), any IP address (a
    rebinding page cannot make a browser send one as the Host of its own origin), this
    machine's name, the address serve binds, and ``allow_host`` (a reverse proxy's)."""

    ALLOWED_SITES = ("same-origin", "none")  # none: typed in, or a bookmark

    def __init__(self, bound: str | None, allow_host: tuple[str, ...] = ()):
        self.proxies = frozenset(allow_host)
        self.names = frozenset(
            n.rstrip(".").lower()
            for n in ("localhost", socket.gethostname(), bound or "", *allow_host)
            if n
        )
        self._answered: set[str] = set()  # Host values let in before: one lookup a request

    def answers_to(self, host: str) -> bool:
        if host in self._answered:
            return True
        parsed = host_and_port(host)
        known = parsed is not None and (
            parsed[0] in self.names or parsed[0].endswith(".localhost") or is_address(parsed[0])
        )
        if known and len(self._answered) < 256:
            self._answered.add(host)
        return known

    def own_origin(self, origin: str, host: str | None) -> bool:
        """Whether a page at ``origin`` is the server's own: the origin the request was sent to
        (its Host), or a name of ``allow_host``'s (a proxy in front, which may rewrite Host)."""
        scheme, colon, authority = origin.partition("://")
        default = {"http": 80, "https": 443}.get(scheme.lower())
        page = host_and_port(authority) if colon and default else None
        if page is None:  # null, a file: page, nonsense
            return False
        if page[0] in self.proxies:
            return True
        sent_to = host_and_port(host) if host is not None else None
        return (
            sent_to is not None
            and sent_to[0] == page[0]
            and (sent_to[1] or default) == (page[1] or default)
        )

    def refusal(self, request: web.Request) -> Any:
        """The answer to a request a browser must not make here (None: it may)."""
        headers = request.headers
        host = headers.get("Host")
        if host is not None and not self.answers_to(host):
            proxies = "".join(", " + name for name in sorted(self.proxies))
            return json_reply(
                {
                    "detail": (
                        "this server answers to the names it is reached by (localhost, an IP "
                        "address, "
                        f"this machine's name{proxies}), not {short(host, 100)!r}: a web page can "
                        "reach a server on this machine under "
                        "a name of its own (DNS rebinding), so other names are refused. Reached "
                        "through a "
                        "proxy or by a name of its own, start it with --allow-host NAME "
                        "(allow_host= to "
                        "build_app, allow_host: in a Gym config)"
                    )
                },
                421,
            )
        origin = headers.get("Origin")
        if origin is not None and not self.own_origin(origin, host):
            return json_reply(
                {
                    "detail": (
                        f"a web page at {short(origin, 100)!r} may not call this server: only its "
                        "own page "
                        "(/web) may, so that no page you visit can drive it on your behalf. "
                        "Clients that "
                        "are not browsers send no Origin; a page of yours behind a proxy: start "
                        "the server "
                        "with --allow-host and the proxy's name"
                    )
                },
                403,
            )
        site = headers.get("Sec-Fetch-Site")
        if (
            site is not None
            and site not in self.ALLOWED_SITES
            and not (
                request.method in ("GET", "HEAD") and headers.get("Sec-Fetch-Mode") == "navigate"
            )
        ):
            return json_reply(
                {
                    "detail": (
                        f"the browser says this request comes from another site (Sec-Fetch-Site: "
                        f"{short(site, 40)}); only the server's own page (/web) may call it, so "
                        "that no "
                        "page you visit can drive it on your behalf"
                    )
                },
                403,
            )
        if request.method not in ("GET", "HEAD", "OPTIONS") and request.body_exists:
            kind = headers.get("Content-Type", "")
            media = kind.partition(";")[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                return json_reply(
                    {
                        "detail": (
                            "this server reads a request's body as JSON only, and this one was "
                            "sent as "
                            f"{short(kind, 80)!r}: send it with Content-Type: application/json "
                            "(which a "
                            "web page cannot send to another site's server without asking first, "
                            "so no "
                            "page can drive this one)"
                            if kind
                            else "this server reads a request's body as "
                            "JSON only, and this one was sent with no Content-Type: send it with "
                            "Content-Type: application/json"
                        )
                    },
                    415,
                )
        return None

    def middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def guard(request: web.Request, handler: Callable) -> Any:
            refused = self.refusal(request)
            return refused if refused is not None else await handler(request)

        return guard


def client_headers() -> dict[str, str]:
    """The headers a client of a running ``serve`` sends: its bearer token, if AGENTENV_TOKEN
    holds one."""
    token = os.environ.get("AGENTENV_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


class Lease:
    """What a served session shares with every other: a lock its requests take in turn, how many
    are under way, and when the last one ended, so an idle sweep never ends a busy session.
    ``async with lease.using():`` holds it (a context manager of its own: every request takes one,
    and a generator-based one costs several times as much)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.busy = 0
        self.last_used = time.monotonic()

    def using(self) -> Lease:
        return self

    async def __aenter__(self) -> Lease:
        self.busy += 1
        try:
            await self.lock.acquire()
        except BaseException:
            self._done()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.lock.release()
        self._done()

    def _done(self) -> None:
        self.busy -= 1
        self.last_used = time.monotonic()


async def sweep_idle(
    what: str,
    knob: str,
    sessions: dict[str, Any],
    idle_timeout: float,
    end: Callable[[Any, str], Any],
    metrics: Metrics,
    wire: str,
) -> None:
    """End sessions with no request for ``idle_timeout``: one timer for all, never a busy one.
    Each end is a task of its own: one that waits long for its episode's teardown (with Docker it
    waits its turn while other episodes play, and a failed removal is retried until it goes)
    holds up neither the other ends nor the next sweep."""
    period = max(0.05, min(idle_timeout / 4, 30.0))
    reason = f"the session was idle past {idle_timeout:g}s"
    ending: dict[int, asyncio.Task] = {}  # by id(session), until its end has run

    def forget(held: int, _: asyncio.Future) -> None:
        ending.pop(held, None)

    def idle(session: Any) -> bool:
        lease = session.lease
        return not lease.busy and time.monotonic() - lease.last_used > idle_timeout

    async def reap(key: str, session: Any) -> None:
        # looked at again as the end begins: a request may have come since the sweep, or the
        # session been ended otherwise (closed, or the server stopping)
        if sessions.get(key) is not session or not idle(session):
            return
        log.info(
            "Ended %s session with no request for %gs (%s), freeing its episode.",
            what,
            idle_timeout,
            knob,
        )
        metrics.reaped(wire)
        try:
            await end(session, reason)
        except Exception:  # noqa: BLE001 - one failure must not stop reaping
            log.exception("Ending %s session that was idle failed.", what)

    try:
        while True:
            await asyncio.sleep(period)  # a timer: an idle session sends no event
            for key, session in list(sessions.items()):
                if (held := id(session)) not in ending and idle(session):
                    task = ending[held] = asyncio.ensure_future(reap(key, session))
                    task.add_done_callback(functools.partial(forget, held))
    finally:  # a stopped sweep lets the ends under way finish
        await asyncio.gather(*ending.values(), return_exceptions=True)


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

    def by_wire(self) -> dict[str, float]:
        return {"openenv": len(self.openenv), "gym": len(self.gym)}


def metrics_route(metrics: Metrics) -> Callable:
    """GET /metrics: the server's metrics in Prometheus' text format (or OpenMetrics, if the
    scraper asks for it), behind the bearer token like every route."""
    from aiohttp import web

    async def scrape(request: web.Request) -> Any:
        body, content_type = metrics.page(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return scrape


# ================================================================ 9. OpenEnv surface

END_TURN = {
    "name": "end_turn",
    "description": "End your turn with your reply. The episode goes on to your next turn, "
    "or ends and is scored.",
    "input_schema": {
        "type": "object",
        "properties": {"response": {"type": "string", "description": "Your reply."}},
    },
}
RESERVED_TOOLS = {"reset", "step", "state", "close", "end_turn"}
ENDED = "the episode has ended; call reset"
SPLIT_TYPES = {"train", "validation", "test"}


# What OpenEnv 0.10's pydantic models let a message hold: per /ws message, action, JSON-RPC request
# and task-API body, each field's JSON types and whether it must be there. A message that breaks
# its shape is refused as OpenEnv refuses it (VALIDATION_ERROR on /ws, 422 over HTTP, -32600 in
# JSON-RPC), with every problem listed as pydantic lists them (type, loc, msg, input).
Shape = dict[str, tuple[tuple[str, ...], bool]]
OBJECT, TEXT, WHOLE, NULL = ("object",), ("string",), ("integer",), ("null",)
WS_MESSAGES: dict[str, Shape] = {
    "reset": {"type": (TEXT, True), "data": (OBJECT, False)},
    "step": {"type": (TEXT, True), "data": (OBJECT, True)},
    "state": {"type": (TEXT, True)},
    "close": {"type": (TEXT, True)},
    "mcp": {"type": (TEXT, True), "data": (OBJECT, True)},
}
ACTIONS: dict[str, Shape] = {  # a missing type is call_tool, as CallToolAction's schema has it
    "list_tools": {"type": (TEXT, False), "metadata": (OBJECT, False)},
    "call_tool": {
        "type": (TEXT, False),
        "tool_name": (TEXT, True),
        "arguments": (OBJECT, False),
        "metadata": (OBJECT, False),
    },
}
RPC_REQUEST: Shape = {
    "jsonrpc": (TEXT, True),
    "method": (TEXT, True),
    "params": (OBJECT, False),
    "id": (TEXT + WHOLE + NULL, False),
}
TASK_BODIES: dict[str, Shape] = {
    "tasks": {"split": (TEXT, True)},
    "num_tasks": {"split": (TEXT, True)},
    "task": {"split": (TEXT, True), "index": (WHOLE, True)},
    "task_range": {
        "split": (TEXT, True),
        "start": (WHOLE + NULL, False),
        "stop": (WHOLE + NULL, False),
    },
}
PYDANTIC_WORDS = {
    "object": ("dict_type", "Input should be a valid dictionary"),
    "string": ("string_type", "Input should be a valid string"),
    "integer": ("int_type", "Input should be a valid integer"),
    "number": ("float_type", "Input should be a valid number"),
}


def shape_problems(
    value: dict[str, Any], shape: Shape, open_: bool = False
) -> list[dict[str, Any]]:
    """How a JSON object breaks a shape: fields missing, of another type, or (unless ``open_``)
    not in it; [] when it fits."""
    problems = []
    for key, (kinds, required) in shape.items():
        if key not in value:
            if required:
                problems.append(
                    {"type": "missing", "loc": [key], "msg": "Field required", "input": value}
                )
            continue
        item = value[key]
        for kind in kinds:  # a loop, not any(): every message of both wires comes here
            if JSON_TYPES[kind](item):
                break
        else:
            code, msg = PYDANTIC_WORDS[kinds[0]]
            problems.append({"type": code, "loc": [key], "msg": msg, "input": item})
    if not open_:
        problems += [
            {
                "type": "extra_forbidden",
                "loc": [key],
                "msg": "Extra inputs are not permitted",
                "input": value[key],
            }
            for key in value
            if key not in shape
        ]
    return problems


def action_problems(action: Any) -> list[dict[str, Any]]:
    """How an action breaks OpenEnv's ListToolsAction / CallToolAction; [] when it fits."""
    if not isinstance(action, dict):
        return [
            {
                "type": "model_type",
                "loc": [],
                "input": action,
                "msg": 'Input should be an action object, such as {"type": "list_tools"}',
            }
        ]
    kind = action.get("type", "call_tool")
    if kind not in ACTIONS:
        return [
            {
                "type": "literal_error",
                "loc": ["type"],
                "input": kind,
                "msg": "Input should be 'list_tools' or 'call_tool'",
            }
        ]
    return shape_problems(action, ACTIONS[kind])


def told(problems: list[dict[str, Any]]) -> str:
    """Problems in a sentence: where each is, and what it should be."""
    return "; ".join(
        f"{'.'.join(str(p) for p in problem['loc']) or 'the value'}: {problem['msg']}"
        for problem in problems
    )


def invalid_frame(problems: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenEnv's VALIDATION_ERROR frame, its message saying what to fix."""
    return {
        "type": "error",
        "data": {
            "message": f"Invalid message: {told(problems)}",
            "code": "VALIDATION_ERROR",
            "errors": problems,
        },
    }


def unprocessable(problems: list[dict[str, Any]]) -> Any:
    """FastAPI's 422 for a body that breaks its shape."""
    return json_reply({"detail": [{**p, "loc": ["body", *p["loc"]]} for p in problems]}, 422)


# What each refused tool call is on OpenEnv's wire: its observation's error_type, and its
# JSON-RPC code (JSON-RPC's "Invalid params" for arguments that don't fit, else "Internal error").
TOOL_ERRORS = {
    UNKNOWN_TOOL: ("tool_not_found", -32603),
    BAD_ARGUMENTS: ("invalid_args", -32602),
    TOOL_ERROR: ("execution_error", -32603),
    TIMEOUT: ("timeout", -32603),
}


def envelope(
    observation: dict[str, Any],
    reward: float | None = None,
    done: bool = False,
) -> dict[str, Any]:
    """An OpenEnv observation as the wire carries it: reward and done at the top, metadata twice."""
    body: dict[str, Any] = {"observation": observation, "reward": reward, "done": done}
    if observation.get("metadata"):
        body["metadata"] = observation["metadata"]
    return body


_PLAIN_JSON = {str, int, bool}


def json_safe(value: Any) -> Any:
    """Bundle code's values (a verifier's rows) as strict JSON, which every client parses: a
    number that is not finite as text, and anything JSON has no word for as its repr."""
    if value is None or type(value) in _PLAIN_JSON:  # most of them: as they are
        return value
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if value is None or isinstance(value, (str, int, float, bool)) else repr(value)


def rpc_error(rid: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    """A JSON-RPC error as OpenEnv sends one: ``data`` always there, null when there is none."""
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message, "data": data}}


class Capacity(AgentEnvError):
    """Every session slot is taken: a temporary refusal, with how to raise the limit."""

    def __init__(self, active: int, limit: int):
        self.active, self.limit = active, limit
        super().__init__(
            f"Server at capacity: {active}/{limit} sessions active. Cannot accept new "
            "connections. This is temporary: retry when a session closes, or serve "
            "with a higher --max-concurrent-envs (MAX_CONCURRENT_ENVS)."
        )

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
    as JSON-RPC, and a failure is always a reply, never a crash. A client that waits longer than
    most for the play (a Gym resources server in ``url:`` mode waits its reset_timeout) says so at
    reset with ``timeout_s``, and the deploy and each end_turn then get that long, less the margin.
    """

    def __init__(self, runtime: Runtime, deadline: float, sid: str | None = None):
        self.runtime, self.deadline = runtime, deadline
        self.play_deadline = deadline  # for a reset's play and each end_turn
        self.id = sid or uuid.uuid4().hex
        self.episode: Episode | None = None
        self.task: Task | None = None  # the task played last, if any
        self.where: dict[str, Any] | None = None
        self.episode_id: str | None = None  # the id the caller gave at reset, if any
        self.step_count = 0
        self.lease = Lease()
        self.attached = False  # a /ws?session_id= socket is on it
        self.socket: Any = None  # the WebSocket it is played over, if any
        self.close_asked = False
        self.ended_by: str | None = None  # why the server ended the session, once it has

    @property
    def live(self) -> bool:
        """Whether a turn is there to play: an episode not yet over, past its deploy."""
        episode = self.episode
        return episode is not None and episode.outcome is None and episode.turn is not None

    # -- the wire

    async def reset(self, data: dict[str, Any]) -> dict[str, Any]:
        return self._observation(await self._reset(data))

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        """Play an action that fits OpenEnv's schema (``action_problems`` found nothing wrong)."""
        if action.get("type", "call_tool") == "list_tools":
            if not self.live:
                offered = await self._offered()
                if isinstance(offered, str):  # as OpenEnv's MCPEnvironment says so
                    return envelope(
                        {
                            "tools": [],
                            "metadata": {"error": offered, "error_type": "list_tools_failed"},
                        },
                        0.0,
                    )
                return envelope({"tools": offered, "metadata": {}}, 0.0)
            self.step_count += 1
            return envelope({"tools": self._tools(), "metadata": {}}, 0.0)
        if not self.live:
            return self._error(self._ended(), step=True)
        self.step_count += 1
        name = action["tool_name"]
        return self._observation(await self._call(name, action.get("arguments", {})), name)

    async def mcp(self, method: str, params: dict[str, Any], rid: Any) -> dict[str, Any]:
        """tools/list and tools/call on this session's episode, as JSON-RPC."""
        if method == "tools/list":
            offered = self._tools() if self.live else await self._offered()
            if isinstance(offered, str):
                return rpc_error(rid, -32603, offered)
            tools = [
                {
                    "name": t["name"],
                    "description": t["description"],
                    "inputSchema": t["input_schema"],
                }
                for t in offered
            ]
            return {"jsonrpc": "2.0", "id": rid, "result": {"tools": tools}}
        name = params.get("name")
        if not name:
            return rpc_error(rid, -32602, "tools/call needs params.name, the tool to call")
        if not isinstance(name, str):
            return rpc_error(
                rid,
                -32603,
                f"there is no tool {name!r}: a tool's name is a string",
                {"error_type": "tool_not_found", "message": f"no tool {name!r}"},
            )
        if not self.live:
            return rpc_error(rid, -32603, self._ended())
        self.step_count += 1
        return self._rpc(rid, await self._call(name, params.get("arguments") or {}))

    def _ended(self) -> str:
        """Why there is no episode to play: it ended, or the server ended the session itself (a
        frame read before its socket closed is answered so)."""
        if self.ended_by is None:
            return ENDED
        return (
            f"the episode has ended: the server ended this session ({self.ended_by}); open a "
            "new session and reset"
        )

    def state(self) -> dict[str, Any]:
        episode, where = self.episode, self.where or {}
        return {
            "episode_id": self.episode_id or (episode.id if episode else None),
            "step_count": self.step_count,
            "task_id": where.get("id"),
            "task_name": where.get("name"),
            "split": where.get("split"),
            "index": where.get("index"),
            "turn": episode.turn.id if episode and episode.turn else None,
            "done": episode is None or episode.outcome is not None,
        }

    async def close(self, reason: str = "the session closed") -> None:
        if self.episode is not None:
            episode, self.episode = self.episode, None
            await episode.abandon(reason)

    def let_go(self, reason: str) -> None:
        """End the episode, if any, and wait for nothing: its teardown is the runtime's, which
        holds its slot until it is done, so a reply needn't wait for it."""
        if self.episode is not None:
            episode, self.episode = self.episode, None
            episode.let_go(reason)

    # -- the play, as values

    async def _reset(self, data: dict[str, Any]) -> Played:
        self.let_go("reset")
        split, index = data.get("split"), data.get("index")
        self.step_count, self.where = 0, None
        self.episode_id = (
            data.get("episode_id") if isinstance(data.get("episode_id"), str) else None
        )
        if (split is None) != (index is None):
            return "split and index go together: give both, or neither for the first task served"
        waits = data.get("timeout_s", None)
        if waits is not None and (
            isinstance(waits, bool)
            or not isinstance(waits, (int, float))
            or not 0 < waits <= MAX_CLIENT_WAIT
        ):
            return (
                f"timeout_s is how long the client waits for the reset's reply and each "
                f"end_turn's, in seconds: a number above 0 and at most {MAX_CLIENT_WAIT:g} "
                f"(not {waits!r}); leave it out to get the server's --client-timeout"
            )
        self.play_deadline = (
            self.deadline if waits is None else max(1.0, waits - self.runtime.settings.reply_margin)
        )
        try:
            if split is None:
                split, index = "all", 0
            task = self.runtime.bundle.task(split, index)
        except LookupError as exc:
            return str(exc)
        self.where = {"id": task.id, "name": task.name, "split": split, "index": index}
        self.task = task
        self.episode = self.runtime.episode(task, split=split)
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
            async with asyncio.timeout(self.play_deadline):
                turn = await episode.next_turn()
                if turn is None:
                    return await episode.result()
        except EpisodeFailed as exc:
            return exc.failure
        except asyncio.TimeoutError:
            failure = Failure(
                TRANSPORT_TIMEOUT,
                (
                    f"{what} took longer than {self.play_deadline:g}s, so the episode was ended to "
                    "answer inside the client's timeout; raise the client's message_timeout_s and "
                    "serve "
                    "with a higher --client-timeout (or give timeout_s at reset)"
                ),
            )
            episode.end(failure)  # teardown goes on in the background, holding the slot
            return failure
        if reserved := sorted(RESERVED_TOOLS & set(turn.route)):
            await episode.abandon("the env offers reserved tool names")
            return (
                f"the env offers tools OpenEnv reserves: {', '.join(reserved)}; rename them in "
                "the env"
            )
        return turn

    def _tools(self) -> list[dict[str, Any]]:
        assert self.episode is not None and self.episode.turn is not None
        return [*self.episode.turn.tool_specs, END_TURN]

    async def _offered(self) -> list[dict[str, Any]] | str:
        """The tools a reset would offer, listed with no episode live (OpenEnv's clients list
        tools before they reset, and keep what they got): those of the toolset of the task played
        last, or before any reset of the first task (what a reset with neither split nor index
        plays). The runtime deploys each toolset once to find them, and keeps them; the reason,
        when they could not be found."""
        task = self.task or self.runtime.bundle.splits["all"][0]
        try:
            async with asyncio.timeout(self.deadline):
                tools = await self.runtime.toolset_tools(
                    task.toolset, "its tools were listed before a reset"
                )
        except asyncio.TimeoutError:
            return (
                f"listing the tools deploys {task.name}'s envs once, and that took longer than "
                f"{self.deadline:g}s; ask again shortly (the deploy goes on), or reset first"
            )
        except AgentEnvError as exc:
            return (
                f"the tools could not be listed: playing {task.name} to its first turn failed: "
                f"{exc}"
            )
        return [*tools, END_TURN]

    # -- rendering

    def _counted(self, played: Played) -> Played:
        """What the play gave, a failure of the environment counted as a masked rollout (what a
        trainer does with the error observation that carries it)."""
        failure = (
            played
            if isinstance(played, Failure)
            else played.failure
            if isinstance(played, (Outcome, ToolResult))
            else None
        )
        if failure is not None:
            self.runtime.metrics.mask("openenv", failure)
        return played

    def _observation(self, played: Played, tool_name: str | None = None) -> dict[str, Any]:
        """What the play gave, as an OpenEnv observation: a reset's or a step's."""
        self._counted(played)
        called = {"tool_name": tool_name, "error": None} if tool_name else {}
        if isinstance(played, ToolResult):
            error_type = TOOL_ERRORS.get(played.status, ("execution_error", -32603))[0]
            if played.failure:  # the episode ended with the call
                timed_out = self._error(played.failure, tool_name)
                timed_out["observation"]["error"] = {
                    "error_type": error_type,
                    "message": played.text,
                }
                return timed_out
            if played.is_error:  # the episode goes on: the model reads why
                return envelope(
                    {
                        **called,
                        "result": None,
                        "metadata": {},
                        "error": {"error_type": error_type, "message": played.text},
                    },
                    0.0,
                )
            return envelope({**called, "metadata": {}, "result": tool_content(played)}, 0.0)
        if isinstance(played, Turn):
            prompt = {"prompt": played.prompt, "system_prompt": played.system_prompt}
            if tool_name:
                return envelope({**called, "result": prompt, "metadata": {}}, 0.0)
            return envelope({"metadata": {**prompt, "task": self.where}})
        if isinstance(played, Outcome) and played.failure is None:
            # The score in the result too: a client that reads only call_tool's result sees it.
            result = (
                {
                    "done": True,
                    "reward": played.reward,
                    "scores": played.scores,
                    **forfeit_of(played),
                }
                if tool_name
                else None
            )
            return envelope(
                {
                    **called,
                    "result": result,
                    "metadata": {
                        "scores": played.scores,
                        "verifications": json_safe(played.verifications),
                        "task": self.where,
                        **forfeit_of(played),
                    },
                },
                played.reward,
                True,
            )
        return self._error(played.failure if isinstance(played, Outcome) else played, tool_name)

    def _rpc(self, rid: Any, played: Played) -> dict[str, Any]:
        """What the play gave, as the JSON-RPC reply to tools/call."""
        self._counted(played)
        if isinstance(played, ToolResult):
            if played.is_error:
                error_type, code = TOOL_ERRORS.get(played.status, ("execution_error", -32603))
                return rpc_error(
                    rid, code, played.text, {"error_type": error_type, "message": played.text}
                )
            return {"jsonrpc": "2.0", "id": rid, "result": tool_content(played)}
        data: dict[str, Any]
        if isinstance(played, Turn):
            data = {"prompt": played.prompt, "system_prompt": played.system_prompt}
            return {"jsonrpc": "2.0", "id": rid, "result": {"data": data}}
        if isinstance(played, Outcome) and played.failure is None:
            data = {
                "done": True,
                "reward": played.reward,
                "scores": played.scores,
                **forfeit_of(played),
            }
            return {"jsonrpc": "2.0", "id": rid, "result": {"data": data}}
        return rpc_error(
            rid, -32603, str(played.failure if isinstance(played, Outcome) else played)
        )

    def _error(
        self, why: str | Failure | None, tool_name: str | None = None, step: bool = False
    ) -> dict[str, Any]:
        """An error observation, which ends the episode: its failure (with its kind, for a
        resources server playing over /ws), or a refusal of what was asked. A step's carries the
        reward 0.0, as every step's does (OpenEnv's graders want a number); a reset's none."""
        observation: dict[str, Any] = {
            "metadata": {"status": "error", "error": str(why), "task": self.where}
        }
        if isinstance(why, Failure):
            observation["metadata"]["failure_kind"] = why.kind
        if tool_name:
            observation.update(tool_name=tool_name, result=None, error=None)
        return envelope(observation, 0.0 if tool_name or step else None, True)


# What a play of an OpenEnv session gives: a tool's result, the next turn, the scored outcome, the
# environment's failure, or a refusal of what was asked (a caller's mistake, in words).
Played = ToolResult | Turn | Outcome | Failure | str


def forfeit_of(outcome: Outcome) -> dict[str, str]:
    """Why a scored episode's reward is 0 when the model's own doing ended it, for each wire to
    carry beside the score (nothing for any other)."""
    return {"forfeit": outcome.forfeit} if outcome.forfeit else {}


def tool_content(result: ToolResult) -> dict[str, Any]:
    """A tool's result as OpenEnv's CallToolObservation carries it."""
    return {
        "content": [{"type": "text", "text": result.text}],
        "structured_content": None,
        "meta": None,
        "data": result.text,
        "is_error": result.is_error,
    }


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
                log.warning(
                    at_its_limit(
                        "The server",
                        limit,
                        "sessions",
                        "new sessions are refused until one closes",
                        SERVE_FIX,
                    )
                    + "."
                )
            raise Capacity(active, limit)
        session = OpenEnvSession(self.runtime, self.deadline)
        self.sessions[session.id] = session
        return session

    async def end_session(self, session: OpenEnvSession, reason: str, wait: bool = True) -> None:
        """End a session: its episode, and the socket it is played over (a reaped or shut-down
        session must not go on playing outside the limit). With ``wait``, once its episode is
        torn down; else at once, its teardown the runtime's (its slot held until done): a client
        that closes its socket gets the closing frame without waiting for a container's removal
        (the Gym resources server in url: mode closes its socket before it answers /verify)."""
        self.sessions.pop(session.id, None)
        session.ended_by = session.ended_by or reason
        socket_, session.socket = session.socket, None
        if wait:
            await session.close(reason)
        else:
            session.let_go(reason)
        if socket_ is not None and not socket_.closed:
            await socket_.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=reason.encode()[:120])

    async def start(self) -> None:
        self._warn_of_tests_past_the_reply()
        self._sweeper = asyncio.create_task(
            sweep_idle(
                "an OpenEnv",
                "--idle-timeout",
                self.sessions,
                self.idle_timeout,
                self.end_session,
                self.runtime.metrics,
                "openenv",
            )
        )

    def _warn_of_tests_past_the_reply(self) -> None:
        """Say once, at start, when a task's unit tests may run longer after end_turn than OpenEnv
        clients wait for its reply by default: a rollout whose tests hang (the model's doing, a
        0) would then be masked for the missed reply instead, and a model could learn to make its
        tests hang rather than fail them."""
        slow: dict[str, float] = {}
        for task in self.runtime.bundle.tasks.values():
            for step in task.steps:
                if step.type == "run_container_unit_tests_verifier" and step.get("agent_name"):
                    runs = 1 + len(step.get("setup_commands") or [])
                    slow[task.name] = max(
                        slow.get(task.name, 0.0), runs * float(step.get("timeout_sec", 300))
                    )
        late = {name: seconds for name, seconds in slow.items() if seconds >= self.deadline}
        if late:
            worst = max(late, key=late.__getitem__)
            settings = self.runtime.settings
            log.warning(
                "%d task(s) of %s (such as %s) run unit tests for up to %gs after end_turn, but "
                "OpenEnv clients are answered within %gs (--client-timeout %g less --reply-margin "
                "%g): over OpenEnv a rollout whose tests hang would be masked for the missed reply "
                "instead of scored 0, and a model could learn to hang them. Start serve with "
                "--client-timeout %d and give clients as long (message_timeout_s, or timeout_s at "
                "reset), or lower the step's timeout_sec.",
                len(late),
                self.runtime.bundle.name,
                worst,
                late[worst],
                self.deadline,
                settings.client_timeout,
                settings.reply_margin,
                math.ceil(late[worst] + settings.reply_margin + 15),
            )

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        await asyncio.gather(
            *(self.end_session(s, "the server shut down") for s in list(self.sessions.values())),
            return_exceptions=True,
        )

    # -- HTTP routes

    async def health(self, request: web.Request) -> Any:
        warm = self.runtime.warm.counts
        # OpenEnv's own answer; with a warm pool, its envs beside the episodes (they hold no slot)
        return json_reply(
            {
                "status": "healthy",
                **({"episodes": len(self.runtime.live), "warm": warm} if warm["target"] else {}),
            }
        )

    async def metadata(self, request: web.Request) -> Any:
        bundle = self.runtime.bundle
        readme = bundle.root / "README.md"
        return json_reply(
            {
                "name": self.env_name,
                "description": bundle.description or bundle.name,
                "readme_content": readme.read_text() if readme.is_file() else None,
                "version": __version__,
                "author": None,
                "documentation_url": None,
            }
        )

    async def schema(self, request: web.Request) -> Any:
        return json_reply(OPENENV_SCHEMA)

    async def openapi(self, request: web.Request) -> Any:
        return json_reply(openapi_document())

    @staticmethod
    def _over_http(body: dict[str, Any]) -> dict[str, Any]:
        """An observation as OpenEnv's HTTP routes send it: metadata on top even when empty
        (null)."""
        return {**body, "metadata": body.get("metadata")}

    async def http_reset(self, request: web.Request) -> Any:
        """Stateless, as OpenEnv has it: a fresh session, reset (a full deploy), then closed."""
        data, problem = await json_body(request, allow_empty=True)
        if problem:
            return problem
        if problems := reset_problems(data):
            return unprocessable(problems)
        session = OpenEnvSession(self.runtime, self.deadline)
        try:
            return json_reply(self._over_http(await session.reset(data or {})))
        finally:
            session.let_go("a stateless /reset ends its episode")

    async def http_step(self, request: web.Request) -> Any:
        data, problem = await json_body(request)
        if problem:
            return problem
        if problems := shape_problems(data, STEP_BODY, open_=True) + step_problems(data):
            return unprocessable(problems)
        if problems := action_problems(data["action"]):  # loc within the action, as OpenEnv's
            return json_reply({"detail": problems}, 422)
        return json_reply(
            self._over_http(await OpenEnvSession(self.runtime, self.deadline).step(data["action"]))
        )

    async def http_state(self, request: web.Request) -> Any:
        return json_reply(OpenEnvSession(self.runtime, self.deadline).state())

    # -- the task API

    async def list_environments(self, request: web.Request) -> Any:
        return json_reply([self.env_name])

    def _not_ours(self, request: web.Request) -> Any:
        """The 404 for a task-API path naming another environment, or None when it names ours
        (in any case, as OpenEnv matches it)."""
        if request.match_info["env"].lower() == self.env_name.lower():
            return None
        return json_reply(
            {
                "detail": f"no environment {request.match_info['env']!r}; this server "
                f"serves {self.env_name!r}"
            },
            404,
        )

    async def splits(self, request: web.Request) -> Any:
        if wrong := self._not_ours(request):
            return wrong
        return json_reply(
            [
                {"name": s, "type": s if s in SPLIT_TYPES else "validation"}
                for s in self.runtime.bundle.splits
            ]
        )

    async def task_api(self, request: web.Request) -> Any:
        if wrong := self._not_ours(request):
            return wrong
        data, problem = await json_body(request)
        if problem:
            return problem
        route = request.path.rsplit("/", 1)[1]
        if problems := shape_problems(data, TASK_BODIES[route]):
            return unprocessable(problems)
        bundle, split = self.runtime.bundle, data["split"]
        if split not in bundle.splits:
            return json_reply(
                {
                    "detail": f"Invalid task index: there is no split {split!r}; the "
                    f"splits are {', '.join(bundle.splits)}"
                },
                400,
            )
        tasks = bundle.splits[split]
        if route == "num_tasks":
            return json_reply({"num_tasks": len(tasks)})
        if route == "tasks":
            return json_reply(
                {"tasks": [task_row(t, i) for i, t in enumerate(tasks)], "env_name": self.env_name}
            )
        if route == "task":
            try:
                index = int(data["index"])
                return json_reply({"task": task_row(bundle.task(split, index), index)})
            except LookupError as exc:
                return json_reply({"detail": f"Invalid task index: {exc}"}, 400)
        start, stop = data.get("start"), data.get("stop")
        start = 0 if start is None else int(start)
        stop = None if stop is None else int(stop)
        if start < 0:
            return json_reply({"detail": "Invalid task index: start is a whole number from 0"}, 400)
        return json_reply(
            {"tasks": [task_row(t, start + i) for i, t in enumerate(tasks[start:stop])]}
        )

    # -- JSON-RPC on POST /mcp and WebSocket /mcp

    async def mcp_http(self, request: web.Request) -> Any:
        try:
            message = loads(await read_body(request))
        except ValueError as exc:
            return json_reply(rpc_error(None, -32700, f"Parse error: {exc}"))
        return json_reply(await self.rpc(message, None))

    async def rpc(
        self,
        message: Any,
        owned: OpenEnvSession | None,
        held: bool = False,
    ) -> dict[str, Any]:
        """Answer one JSON-RPC request; ``owned`` is the session of the socket it came on, whose
        lock the caller already ``held`` when it came inside a /ws message."""
        if not isinstance(message, dict):  # a batch too: OpenEnv reads one request at a time
            return rpc_error(
                None,
                -32700,
                'Parse error: a request is one JSON object, {"jsonrpc": '
                '"2.0", "method": ..., "params": {...}, "id": ...} '
                "(batches are not read)",
            )
        problems = shape_problems(message, RPC_REQUEST)
        if not problems and message["jsonrpc"] != "2.0":
            problems = [
                {
                    "type": "literal_error",
                    "loc": ["jsonrpc"],
                    "msg": "Input should be '2.0'",
                    "input": message["jsonrpc"],
                }
            ]
        if problems:
            return rpc_error(
                None,
                -32600,
                f'Invalid Request: {told(problems)}; send {{"jsonrpc": '
                '"2.0", "method": ..., "params": {...}, "id": ...}',
            )
        rid, method, params = message.get("id"), message["method"], message.get("params", {})
        rid = int(rid) if isinstance(rid, float) else rid  # 1.0 is the id 1, as pydantic reads it
        if method == "openenv/session/create":
            if owned is not None:  # a socket's session is the one its messages play on
                return {"jsonrpc": "2.0", "id": rid, "result": {"session_id": owned.id}}
            try:
                return {
                    "jsonrpc": "2.0",
                    "id": rid,
                    "result": {"session_id": self.open_session().id},
                }
            except Capacity as exc:
                return rpc_error(rid, -32000, str(exc), exc.data)
        if method == "openenv/session/close":
            if not params.get("session_id"):
                return rpc_error(
                    rid, -32602, "Invalid params: session_id is required, the session to close"
                )
            if owned is not None and params["session_id"] == owned.id:
                return rpc_error(
                    rid,
                    -32600,
                    "this socket's own session closes with the socket: "
                    'close the socket (or send {"type": "close"})',
                )
            session = self.sessions.get(str(params.get("session_id")))
            if session is None:
                return rpc_error(rid, -32602, f"no session {params.get('session_id')!r}")
            if session.attached:
                session.close_asked = True
                return {
                    "jsonrpc": "2.0",
                    "id": rid,
                    "result": {"session_id": session.id, "closed": False, "closing": True},
                }
            await self.end_session(session, "openenv/session/close", wait=False)
            return {
                "jsonrpc": "2.0",
                "id": rid,
                "result": {"session_id": session.id, "closed": True},
            }
        if method not in ("tools/list", "tools/call"):
            return rpc_error(
                rid,
                -32601,
                f"Method not found: {method}; this server answers "
                "tools/list, tools/call, openenv/session/create and "
                "openenv/session/close",
            )
        session = owned  # a socket's calls play on its own session, whatever they name
        if owned is None and params.get("session_id") is not None:
            session = self.sessions.get(str(params["session_id"]))
            if session is None:
                return rpc_error(
                    rid,
                    -32602,
                    f"no session {params['session_id']!r}; create one with openenv/session/create",
                )
        if session is None:  # no session: a throwaway env, which has no episode
            session = OpenEnvSession(self.runtime, self.deadline)
        if held and session is owned:
            return await session.mcp(method, params, rid)
        async with session.lease.using():
            return await session.mcp(method, params, rid)

    async def mcp_ws(self, request: web.Request) -> Any:
        socket_ = await accept_socket(request)
        try:
            session = self.open_session()
        except Capacity as exc:
            await socket_.send_json(rpc_error(None, -32000, str(exc), exc.data))
            await socket_.close()
            return socket_
        session.socket = socket_
        try:
            async with read_ahead(socket_) as inbox:
                while (message := await inbox.get()) is not None:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        await socket_.send_json(rpc_error(None, -32700, BINARY_FRAME))
                    elif message.type == aiohttp.WSMsgType.TEXT:
                        try:
                            request_ = loads(message.data)
                        except ValueError as exc:
                            await socket_.send_json(rpc_error(None, -32700, f"Parse error: {exc}"))
                            continue
                        await socket_.send_json(await inbox.while_open(self.rpc(request_, session)))
        except ConnectionError:  # the client left before a reply: frames are read
            pass  # ahead, so before any of them, not only a call's
        finally:
            await self.end_session(session, "the session closed", wait=False)
        return socket_

    # -- the WebSocket session /ws

    async def ws(self, request: web.Request) -> Any:
        socket_ = await accept_socket(request)
        attach = request.query.get("session_id")
        owns = attach is None
        if attach is not None:
            session = self.sessions.get(attach)
            if session is None or session.attached:
                why = "is already attached to a socket" if session else "does not exist"
                await socket_.send_json(
                    {
                        "type": "error",
                        "data": {
                            "message": f"session {attach!r} {why}; create one with "
                            "openenv/session/create",
                            "code": "SESSION_ERROR",
                        },
                    }
                )
                await socket_.close()
                return socket_
            session.attached = True
        else:
            try:
                session = self.open_session()
            except Capacity as exc:
                await socket_.send_json(
                    {
                        "type": "error",
                        "data": {"message": str(exc), "code": "CAPACITY_REACHED", **exc.data},
                    }
                )
                await socket_.close()
                return socket_
        session.socket = socket_
        try:
            async with read_ahead(socket_) as inbox:
                while (message := await inbox.get()) is not None:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        await socket_.send_json(
                            {
                                "type": "error",
                                "data": {"message": BINARY_FRAME, "code": "INVALID_JSON"},
                            }
                        )
                        continue
                    if message.type != aiohttp.WSMsgType.TEXT:
                        continue
                    async with session.lease.using():
                        reply = await inbox.while_open(self._answer(session, message.data))
                    if reply is None:
                        break
                    await socket_.send_json(reply)
        except (
            ConnectionError
        ):  # the client left before a reply (to any frame: they are read ahead)
            log.info("An OpenEnv client left before its reply; ending its session.")
        finally:
            session.attached = False
            if session.socket is socket_:
                session.socket = None
            if owns or session.close_asked:
                await self.end_session(session, "the session closed", wait=False)
        return socket_

    async def _answer(self, session: OpenEnvSession, text: str) -> dict[str, Any] | None:
        try:
            message = loads(text)
        except ValueError as exc:
            return {
                "type": "error",
                "data": {"message": f"Invalid JSON: {exc}", "code": "INVALID_JSON"},
            }
        if not isinstance(message, dict):  # (OpenEnv drops the session for this; we answer)
            return invalid_frame(
                [
                    {
                        "type": "model_type",
                        "loc": [],
                        "input": message,
                        "msg": 'Input should be a message object, such as {"type": "state"}',
                    }
                ]
            )
        kind, data = message.get("type", ""), message.get("data", {})
        if not isinstance(kind, str) or kind not in WS_MESSAGES:
            return {
                "type": "error",
                "data": {
                    "message": f"Unknown message type: {kind}; send reset, "
                    "step, state, mcp or close",
                    "code": "UNKNOWN_TYPE",
                },
            }
        problems = shape_problems(message, WS_MESSAGES[kind])
        if kind == "step" and not problems:
            problems = action_problems(data)
        if problems:
            return invalid_frame(problems)
        if kind == "reset":
            return {"type": "observation", "data": await session.reset(data)}
        if kind == "step":
            return {"type": "observation", "data": await session.step(data)}
        if kind == "state":
            return {"type": "state", "data": session.state()}
        if kind == "mcp":
            return {"type": "mcp", "data": await self.rpc(data, session, held=True)}
        return None  # close

    ROUTES = [
        ("GET", "/health", health),
        ("GET", "/metadata", metadata),
        ("GET", "/schema", schema),
        ("GET", "/openapi.json", openapi),
        ("GET", "/ws", ws),
        ("GET", "/mcp", mcp_ws),
        ("POST", "/mcp", mcp_http),
        ("POST", "/reset", http_reset),
        ("POST", "/step", http_step),
        ("GET", "/state", http_state),
        ("GET", "/list_environments", list_environments),
        ("GET", "/{env}/splits", splits),
        ("POST", "/{env}/tasks", task_api),
        ("POST", "/{env}/num_tasks", task_api),
        ("POST", "/{env}/task", task_api),
        ("POST", "/{env}/task_range", task_api),
    ]


STEP_BODY: Shape = {
    "action": (OBJECT, True),
    "timeout_s": (("number", "null"), False),
    "request_id": (TEXT + NULL, False),
}


def step_problems(body: dict[str, Any]) -> list[dict[str, Any]]:
    """What OpenEnv's StepRequest bounds beyond types: timeout_s above 0, request_id ≤255."""
    problems = []
    if (
        isinstance(body.get("timeout_s"), (int, float))
        and not isinstance(body["timeout_s"], bool)
        and not body["timeout_s"] > 0
    ):
        problems.append(
            {
                "type": "greater_than",
                "loc": ["timeout_s"],
                "msg": "Input should be greater than 0",
                "input": body["timeout_s"],
            }
        )
    if isinstance(body.get("request_id"), str) and len(body["request_id"]) > 255:
        problems.append(
            {
                "type": "string_too_long",
                "loc": ["request_id"],
                "msg": "String should have at most 255 characters",
                "input": body["request_id"],
            }
        )
    return problems


def reset_problems(body: dict[str, Any]) -> list[dict[str, Any]]:
    """How a stateless reset's body breaks OpenEnv's ResetRequest (any other keys are the reset's):
    seed a whole number from 0, episode_id text of at most 255 characters."""
    problems = shape_problems(
        body, {"seed": (WHOLE + NULL, False), "episode_id": (TEXT + NULL, False)}, open_=True
    )
    if not problems and body.get("seed") is not None and body["seed"] < 0:
        problems.append(
            {
                "type": "greater_than_equal",
                "loc": ["seed"],
                "msg": "Input should be greater than or equal to 0",
                "input": body["seed"],
            }
        )
    if not problems and isinstance(body.get("episode_id"), str) and len(body["episode_id"]) > 255:
        problems.append(
            {
                "type": "string_too_long",
                "loc": ["episode_id"],
                "msg": "String should have at most 255 characters",
                "input": body["episode_id"],
            }
        )
    return problems


def task_row(task: Task, index: int) -> dict[str, Any]:
    """A task as OpenEnv's task API describes it."""
    prompt, system_prompt = task.first_prompt
    return {
        "id": task.id,
        "name": task.name,
        "index": index,
        "prompt": prompt,
        "system_prompt": system_prompt,
        "agent": task.agent,
        "toolset": task.toolset.name,
    }


_OPEN_OBJECT = {"type": "object", "additionalProperties": True}
OPENENV_SCHEMA = {
    "action": {
        "title": "CallToolAction",
        "type": "object",
        "additionalProperties": True,
        "properties": {
            "type": {"type": "string", "enum": ["list_tools", "call_tool"]},
            "tool_name": {"type": "string"},
            "arguments": {"type": "object"},
            "metadata": {"type": "object"},
        },
        "required": ["type"],
    },
    "observation": {
        "title": "CallToolObservation",
        "type": "object",
        "additionalProperties": True,
        "properties": {
            "done": {"type": "boolean"},
            "reward": {"type": ["number", "null"]},
            "metadata": _OPEN_OBJECT,
            "tool_name": {"type": ["string", "null"]},
            "result": {},
            "error": {"type": ["object", "null"]},
            "tools": {"type": "array", "items": _OPEN_OBJECT},
        },
    },
    "reset_observation": {
        "title": "Observation",
        "type": "object",
        "additionalProperties": True,
        "properties": {
            "done": {"type": "boolean"},
            "reward": {"type": ["number", "null"]},
            "metadata": _OPEN_OBJECT,
        },
    },
    "state": {
        "title": "State",
        "type": "object",
        "additionalProperties": True,
        "properties": {
            "episode_id": {"type": ["string", "null"]},
            "step_count": {"type": "integer"},
        },
    },
}


def openapi_document() -> dict[str, Any]:
    """An OpenAPI document of the routes this server answers."""

    def op(summary: str, body: bool = False) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": {}}}}
            },
        }
        if body:
            spec["requestBody"] = {"content": {"application/json": {"schema": {"type": "object"}}}}
        return spec

    paths = {
        "/health": {"get": op("Whether the server is up")},
        "/metadata": {"get": op("The bundle served: name, description, README")},
        "/schema": {"get": op("JSON schemas of the action, observation and state")},
        "/reset": {
            "post": op("Stateless: play a task's first turn in a fresh episode, then end it", True)
        },
        "/step": {"post": op("Stateless: always answers that the episode has ended", True)},
        "/state": {"get": op("Stateless: a fresh session's state")},
        "/mcp": {
            "post": op("JSON-RPC: tools/list, tools/call, openenv/session/create and close", True),
            "get": op("WebSocket JSON-RPC, one session per connection"),
        },
        "/ws": {"get": op("WebSocket OpenEnv session: reset, step, state, mcp, close")},
        "/list_environments": {"get": op("The environment served")},
        "/metrics": {
            "get": op("Prometheus metrics: episodes, deploys, tool calls, masks, process")
        },
        "/web": {"get": op("The web page: play a task by hand, watch the run")},
        "/web/status": {
            "get": op(
                "The run's numbers as JSON, the same as /metrics: episodes, "
                "masks, rewards by split, deploy and tool-call p50/p95"
            )
        },
        "/{env}/splits": {"get": op("The splits: all, and one per eval")},
        "/{env}/tasks": {"post": op("The tasks of a split", True)},
        "/{env}/num_tasks": {"post": op("How many tasks a split has", True)},
        "/{env}/task": {"post": op("One task of a split", True)},
        "/{env}/task_range": {"post": op("A range of a split's tasks", True)},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "agentenv.py",
            "version": "1.0.0",
            "description": f"agentenv.py {__version__}",
        },
        "paths": paths,
        "components": {"schemas": {}},
        "tags": [
            {"name": "Environment Control"},
            {"name": "State Management"},
            {"name": "Environment Info"},
            {"name": "Schema"},
            {"name": "Health"},
            {"name": "Task API"},
        ],
    }


# ================================================================ 10. Gym surface

gym_log = logging.getLogger("agentenv.gym")
GYM_COOKIE = "agentenv_session"
# A Cookie header that is the session's cookie alone, as Gym's clients send it: read without
# parsing (every tool call has one); any other header goes to aiohttp's parser.
LONE_SESSION_COOKIE = re.compile(GYM_COOKIE + r"=([A-Za-z0-9_-]+)")


def session_cookie(request: web.Request) -> str | None:
    """The Gym session's token a request carries in its cookie, if any."""
    if (lone := LONE_SESSION_COOKIE.fullmatch(request.headers.get("Cookie", ""))) is not None:
        return lone.group(1)
    return request.cookies.get(GYM_COOKIE)


# What end_turn answers on the last turn (eval stops there, the episode being scored)
EPISODE_OVER = "Your turn is over, and so is the episode: it is being scored."


class OpenEnvClient:
    """One OpenEnv session on a running ``serve``, over its /ws, as a client plays it: the Gym
    resources server in ``url:`` mode, and ``write-gym`` listing a running server's tools. The
    replies come back as this file's values: a prompt, a ToolResult, an Outcome, or EpisodeFailed
    carrying the server's Failure. At the server's capacity ``reset`` waits, and says so once; or
    ``full``, given the data of the server's CAPACITY_REACHED, says so its own way, or raises
    EpisodeFailed to stop waiting."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        deadline: float,
        warned: set[str] | None = None,
        full: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.http, self.url, self.deadline = http, url, deadline
        self.warned = warned if warned is not None else set()  # servers said to be at their limit
        self.full = full or self._wait_said_once
        self.socket: aiohttp.ClientWebSocketResponse | None = None

    async def reset(self, split: str, index: int) -> str:
        """Start the task at ``split[index]``; its first prompt, once its first turn is open."""
        # it waits self.deadline for the reply (reset_timeout, for Gym), and says so (timeout_s)
        data = await self._session(
            {
                "type": "reset",
                "data": {
                    "split": split,
                    "index": index,
                    "timeout_s": min(self.deadline, MAX_CLIENT_WAIT),
                },
            }
        )
        return str(((data.get("observation") or {}).get("metadata") or {}).get("prompt", ""))

    async def offered(self) -> list[dict[str, Any]]:
        """The tools (without end_turn) a reset with neither split nor index would offer, listed
        before any reset, as OpenEnv's clients list them: the server finds them once, with a
        deploy that is not an episode of anyone's."""
        return self._tools(await self._session({"type": "step", "data": {"type": "list_tools"}}))

    async def _session(self, first: dict[str, Any]) -> dict[str, Any]:
        """Open a session with its first message, waiting while the server is at capacity; the
        data of the reply."""
        delay = 0.1
        while True:
            try:
                self.socket = await self.http.ws_connect(
                    self.url.rstrip("/") + "/ws", heartbeat=20, max_msg_size=MAX_BODY
                )
            except (aiohttp.ClientError, OSError) as exc:
                raise EpisodeFailed(
                    f"the server at {self.url} did not answer ({exc}); start it with "
                    "python agentenv.py serve BUNDLE",
                    SESSION_LOST,
                ) from None
            reply = await self._ask(first)
            data = reply.get("data") or {}
            if reply.get("type") != "error" or data.get("code") != "CAPACITY_REACHED":
                break
            await self.socket.close()
            self.full(data)
            await asyncio.sleep(delay)  # no event tells a client that a slot has freed
            delay = min(delay * 2, 2.0)
        if reply.get("type") == "error":
            raise EpisodeFailed(
                f"the server at {self.url} refused the session: {data.get('message')}"
            )
        self._raise_failure(data)
        return data

    def _wait_said_once(self, data: dict[str, Any]) -> None:
        if self.url not in self.warned:
            self.warned.add(self.url)
            gym_log.warning(
                at_its_limit(
                    f"the server at {self.url}",
                    data.get("max_sessions"),
                    "sessions",
                    "rollouts wait their turn",
                    SERVE_FIX,
                )
            )

    async def list_tools(self) -> list[dict[str, Any]]:
        """The open turn's tools (without end_turn), as the model is shown them."""
        data = (await self._ask({"type": "step", "data": {"type": "list_tools"}})).get("data") or {}
        self._raise_failure(data)
        return self._tools(data)

    @staticmethod
    def _tools(data: dict[str, Any]) -> list[dict[str, Any]]:
        observation = data.get("observation") or {}
        if (observation.get("metadata") or {}).get("error_type") == "list_tools_failed":
            raise EpisodeFailed(str(observation["metadata"].get("error")))
        tools = observation.get("tools") or []
        return [t for t in tools if isinstance(t, dict) and t.get("name") != "end_turn"]

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        data = (
            await self._ask(
                {
                    "type": "step",
                    "data": {"type": "call_tool", "tool_name": name, "arguments": arguments},
                }
            )
        ).get("data") or {}
        observation = data.get("observation") or {}
        error = observation.get("error") or {}
        if error.get("error_type") == "timeout":
            return ToolResult(str(error.get("message", missed(name, self.deadline))), TIMEOUT)
        if error:
            return ToolResult(
                str(error.get("message")),
                UNKNOWN_TOOL if error.get("error_type") == "tool_not_found" else TOOL_ERROR,
            )
        self._raise_failure(data)
        if data.get("done"):
            raise EpisodeFailed("the episode ended on the server")
        result = observation.get("result") or {}
        return ToolResult(str(result.get("data", "")), TOOL_ERROR if result.get("is_error") else OK)

    async def end_turn(self, reply: str) -> str | Outcome:
        """End the turn: the next turn's prompt, or the scored outcome."""
        data = (
            await self._ask(
                {
                    "type": "step",
                    "data": {
                        "type": "call_tool",
                        "tool_name": "end_turn",
                        "arguments": {"response": reply},
                    },
                }
            )
        ).get("data") or {}
        self._raise_failure(data)
        observation = data.get("observation") or {}
        if data.get("done"):
            return Outcome(
                "scored",
                (observation.get("metadata") or {}).get("scores") or {},
                data.get("reward"),
            )
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
            raise EpisodeFailed(
                f"the server at {self.url} went away ({type(exc).__name__}: {exc}); "
                "check that it still runs",
                SESSION_LOST,
            ) from None
        if frame.type != aiohttp.WSMsgType.TEXT:
            said = frame.extra if frame.type == aiohttp.WSMsgType.CLOSE and frame.extra else ""
            raise EpisodeFailed(
                f"the server at {self.url} closed the session"
                + (f" ({said})" if said else "; check that it still runs"),
                SESSION_LOST,
            )
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
    async def close(self, reason: str, wait: bool = True) -> None:
        """End the episode, scored or not, and let go of it: with ``wait``, once it is torn down;
        else at once, its teardown left to whoever runs it (holding its slot until done)."""


class LocalRollout(Rollout):
    """A rollout played on this server's own runtime."""

    def __init__(self, runtime: Runtime, task: Task, split: str = "all"):
        self.episode = runtime.episode(task, split=split)

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

    async def close(self, reason: str, wait: bool = True) -> None:
        if wait:
            await self.episode.abandon(reason)
        else:
            self.episode.let_go(reason)


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
            await self.client.close()  # the server ends the episode with its socket
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

    async def close(self, reason: str, wait: bool = True) -> None:
        await self.client.close()  # the server ends the episode with its socket


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
        return LocalRollout(self.runtime, self.runtime.bundle.task(split, index), split)


class RemoteRollouts(Rollouts):
    """Rollouts played on a running ``serve`` at ``url``, each over a socket of its own."""

    def __init__(self, url: str, settings: Settings):
        self.url, self.settings = url, settings
        self.warned: set[str] = set()  # the servers already said to be at their limit
        self.http: aiohttp.ClientSession | None = None
        self.env_name = ""

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), headers=client_headers()
        )
        self.env_name = await environment_at(self.http, self.url)

    async def stop(self) -> None:
        if self.http:
            await self.http.close()

    async def task_id(self, split: str, index: int) -> str:
        assert self.http is not None
        async with self.http.post(
            f"{self.url.rstrip('/')}/{self.env_name}/task", json={"split": split, "index": index}
        ) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise LookupError(str(body.get("detail")))
            return body["task"]["id"]

    def rollout(self, split: str, index: int) -> Rollout:
        assert self.http is not None
        client = OpenEnvClient(self.http, self.url, self.settings.reset_timeout, self.warned)
        return RemoteRollout(client, split, index)


class RowShapeError(ValueError):
    """A row that names no task at all (no split or index of the right type): a body NeMo Gym's
    servers refuse as unprocessable (422), where a task that doesn't exist is a bad request
    (400)."""


class GymSession:
    """One Gym rollout, by cookie: the row's task as an episode, the model's tool calls, and the
    verify that scores it. The deploy starts at seed and the first tool call waits for it; a
    rollout the environment failed is answered masked, with its Failure."""

    def __init__(self, token: str, row: dict[str, Any], rollout: Rollout, settings: Settings):
        self.token, self.row, self.rollout, self.settings = token, row, rollout, settings
        self.failure: Failure | None = None
        self.tools: list[str] = []
        self.finished = False  # the episode is over (scored)
        self.resources_id: str | None = None  # the id an environment server gave the session
        self.seeded_with = ""  # a digest of that seed, to tell a retry apart
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
            self.fail(
                Failure(
                    TRANSPORT_TIMEOUT,
                    (
                        f"the episode was not deployed and at its first turn within reset_timeout "
                        f"({self.settings.reset_timeout:g}s): a deploy that slow, or a wait for a "
                        "free "
                        "episode that long; raise reset_timeout or max_concurrent_envs in the "
                        "resources "
                        "server's config"
                    ),
                )
            )
            return
        except EpisodeFailed as exc:
            self.fail(exc.failure.told("the environment failed: "))
            return
        except Exception as exc:  # noqa: BLE001 - e.g. a garbled url: reply
            gym_log.exception("Opening a rollout failed unexpectedly.")
            self.fail(Failure(INTERNAL_ERROR, f"agentenv.py failed: {type(exc).__name__}: {exc}"))
            return
        offered = row_tools(self.row)
        if offered is not None and set(offered) != {*self.tools, "end_turn"}:
            self.fail(
                Failure(
                    TOOLS_MISMATCH,
                    (
                        f"the row offers the tools {sorted(offered)}, but its task offers "
                        f"{sorted({*self.tools, 'end_turn'})}; write the rows again with write-gym"
                    ),
                )
            )

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """A tool call, answered with the text the model reads."""
        return gym_text(await self.play(name, arguments))

    async def play(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """A tool call (end_turn's too: the next prompt, or that the episode is over), as the
        ToolResult a wire renders; a call that could not run as asked has an error status."""
        await asyncio.shield(self.opened)
        if self.failure:
            return ToolResult(
                f"the environment of this rollout failed, so {name} did not run "
                f"({self.failure}); the rollout will be masked",
                TOOL_ERROR,
            )
        if self.finished:
            return ToolResult("the episode has ended; there are no more turns to play", NO_TURN)
        try:
            if name == "end_turn":
                reply = arguments.get("response", "")
                async with asyncio.timeout(self.settings.reset_timeout):
                    prompt = await self.rollout.end_turn(
                        reply if isinstance(reply, str) else json.dumps(reply)
                    )
                if prompt is None:
                    self.finished = True
                    return ToolResult(EPISODE_OVER)
                return ToolResult(prompt)
            result = await self.rollout.call(name, arguments, self.settings.tool_timeout)
        except asyncio.TimeoutError:
            self.fail(
                Failure(
                    TRANSPORT_TIMEOUT,
                    f"end_turn did not hand over the next turn within "
                    f"reset_timeout ({self.settings.reset_timeout:g}s)",
                )
            )
            return ToolResult(str(self.failure), TIMEOUT)
        except EpisodeFailed as exc:
            self.fail(exc.failure.told("the environment failed: "))
            return ToolResult(f"{self.failure}; the rollout will be masked", TOOL_ERROR)
        if result.failure:
            self.fail(result.failure)
        return result

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
            self.fail(
                Failure(
                    TRANSPORT_TIMEOUT,
                    f"ending the turns and scoring took longer than "
                    f"reset_timeout ({self.settings.reset_timeout:g}s)",
                )
            )
            return None
        except EpisodeFailed as exc:
            self.fail(exc.failure.told("the environment failed: "))
            return None
        if outcome.failure is not None:
            self.fail(outcome.failure)
            return None
        reward = outcome.reward
        if (
            not isinstance(reward, (int, float))
            or isinstance(reward, bool)
            or not math.isfinite(reward)
            or not 0.0 <= reward <= 1.0
        ):
            self.fail(
                Failure(
                    VERIFIER_ERROR,
                    f"the verifier's reward {reward!r} is not a finite number from 0 to 1",
                )
            )
            return None
        return outcome

    async def replay(self, response: dict[str, Any]) -> Outcome | None:
        """Play a rollout's recorded tool calls again, in order, and score it as verify does: how
        ``gym eval reverify`` recomputes a reward on a fresh episode. A call that answers other
        than it did in the rollout ends the replay, masked: that env does not replay."""
        items = [i for i in response["output"] if isinstance(i, dict)]
        recorded = {
            i.get("call_id"): i.get("output")
            for i in items
            if i.get("type") == "function_call_output"
        }
        for item in items:
            if item.get("type") != "function_call":
                continue
            try:
                arguments = loads(item["arguments"])
            except ValueError:
                continue  # simple_agent sent no call for arguments that aren't JSON
            if not isinstance(arguments, dict):
                continue  # which the tool's route refused: nothing ran
            text = await self.call(item["name"], arguments)
            if self.failure:
                return None
            was = recorded.get(item.get("call_id"))
            if isinstance(was, str) and was != text:
                self.fail(
                    Failure(
                        REPLAY_DIVERGED,
                        (
                            f"replayed, the call of {item['name']} answered {short(text, 300)!r}, "
                            "but in the "
                            f"rollout it answered {short(was, 300)!r}; an env that does not answer "
                            "the same "
                            "calls the same way cannot have its rollouts reverified"
                        ),
                    )
                )
                return None
        return await self.verify(last_reply(response))

    async def close(self, reason: str, wait: bool = True) -> None:
        """End the rollout's episode and let go of it: with ``wait``, once it is torn down."""
        self.opened.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.opened
        await self.rollout.close(reason, wait)


def gym_text(result: ToolResult) -> str:
    """A tool's result as the model reads it on Gym: its text, and an error said to be one."""
    if result.status == OK or result.text.startswith("error"):  # an env's text may say so itself
        return result.text
    return f"error: {result.text}"


VERDICTS_KEPT = 2048
SPENT_IDS_KEPT = 65_536  # closed resources_session_ids remembered, so a late seed can't revive one


def digest(text: str) -> str:
    """A short fingerprint of a request's text, to tell a retry from a different request."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclasses.dataclass
class Verdict:
    """What /verify answered for a rollout, kept small: the reply is rebuilt around the request."""

    digest: str  # of the model's last reply, to tell a retry apart
    fields: dict[str, Any]  # reward, mask_sample, failure_kind, ... (scored)
    failure: Failure | None = None  # of a masked rollout

    @classmethod
    def of(cls, reply: str, outcome: Outcome | None, failure: Failure | None) -> Verdict:
        if outcome is None:
            assert failure is not None
            gym_log.warning("rollout masked: %s", failure)
            return cls(digest(reply), {}, failure)
        assert outcome.reward is not None  # (a scored outcome's)
        return cls(
            digest(reply),
            {
                "reward": float(outcome.reward),
                "mask_sample": False,
                "failure_kind": None,
                "failure_reason": None,
                "scores": outcome.scores,
                **forfeit_of(outcome),
            },
        )

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
            return (
                "".join(
                    p["text"]
                    for p in parts
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
                if isinstance(parts, list)
                else ""
            )
    return ""


# -- aggregate metrics: the keys NeMo Gym's reward profiler computes, without importing Gym

TASK_INDEX, ROLLOUT_INDEX = "_ng_task_index", "_ng_rollout_index"  # Gym stamps every rollout
PROFILE_STATS = ("mean", "max", "min", "median", "std")
# Gym summarizes across repeats the means of a repeat only, and of those not these (bounds,
# spreads).
NOT_ACROSS_REPEATS_ENDS = (
    "/max",
    "/min",
    "/median",
    "/p5",
    "/p25",
    "/p75",
    "/p95",
    "/ci_low_95",
    "/ci_high_95",
    "/ci_lower",
    "/ci_upper",
    "_ci_lower",
    "_ci_upper",
    "_ci95_lower",
    "_ci95_upper",
    "/_ng_attempt_index",
    "/std_dev_across_runs",
    "/std_err_across_runs",
    "/avg_sample_std_dev",
)
PERF_TOKEN_FIELDS = (
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
)


class MetricsError(ValueError):
    """verify_responses the profile cannot be computed from; the message says which and why."""


def _number(value: Any) -> float | int | None:
    """A value the profile counts: a finite number (a bool as 0 or 1); None for anything else."""
    if isinstance(value, bool):
        return int(value)
    return value if _finite(value) else None


def _finite(value: Any) -> bool:
    """A number JSON can carry and statistics can use (a whole number past a float's range
    isn't)."""
    try:
        return isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        return False


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between the closest ranks (pandas' default)."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (at - low))


def _sample_std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _t_quantile(p: float, dof: int) -> float:
    """Student's t distribution's p-quantile (p > 0.5), by bisection on its CDF."""

    def upper_tail(t: float) -> float:  # P(T > t) = I_x(dof/2, 1/2) / 2, x = dof/(dof + t^2)
        return _incomplete_beta(dof / (dof + t * t), dof / 2, 0.5) / 2

    low, high = 0.0, 1.0
    while upper_tail(high) > 1 - p:
        high *= 2
    while high - low > 1e-13 * high:
        mid = (low + high) / 2
        if upper_tail(mid) > 1 - p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1 - _incomplete_beta(1 - x, b, a)
    front = (
        math.exp(
            math.lgamma(a + b)
            - math.lgamma(a)
            - math.lgamma(b)
            + a * math.log(x)
            + b * math.log(1 - x)
        )
        / a
    )
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(300):  # Lentz's method
        m = i // 2
        if i == 0:
            step = 1.0
        elif i % 2 == 0:
            step = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            step = -((a + m) * (a + b + m) * x) / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + step * d
        d = 1 / (d if abs(d) > tiny else tiny)
        c = 1 + step / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1 - c * d) < 1e-15:
            break
    return front * (f - 1)


def _interval(mean: float, sem: float, n: int) -> tuple[float, float] | None:
    """The 95% t-interval of a mean, as Gym gives it: none for one value, a point for no spread."""
    if n <= 1:
        return None
    if sem == 0:
        return mean, mean
    half = _t_quantile(0.975, n - 1) * sem
    return mean - half, mean + half


def _describe(rows: list[dict[str, float]], columns: list[str]) -> dict[str, float]:
    """mean/max/min/median/std of each column over the rows that have it (a sample's std; 0 for
    a lone row), keyed ``stat/column``, as the profiler describes a group."""
    import statistics

    found = {c: [r[c] for r in rows if c in r] for c in columns}
    std = {c: _sample_std(v) for c, v in found.items() if len(v) > 1}
    if not std:  # no column has a spread: those every row has get 0, as Gym reads it
        std = {c: 0.0 for c, v in found.items() if v and len(v) == len(rows)}
    stats: dict[str, float] = {}
    for name in PROFILE_STATS:
        for column, values in found.items():
            if not values:
                continue
            if name == "std":
                if column in std:
                    stats[f"std/{column}"] = std[column]
                continue
            of: dict[str, Callable[[list[float]], float]] = {
                "mean": lambda v: sum(v) / len(v),
                "max": max,
                "min": min,
                "median": lambda v: float(statistics.median(v)),
            }
            stats[f"{name}/{column}"] = of[name](values)
    return stats


def _measured(result: dict[str, Any]) -> dict[str, float]:
    """A verify reply's measurements: its numbers, and its response's usage counts."""
    usage = _usage(result)
    out = {}
    for key, value in {**result, **usage}.items():
        number = _number(value)
        if number is not None and not key.startswith("_"):
            out[key] = number
    return out


def _usage(result: dict[str, Any]) -> dict[str, Any]:
    response = result.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    return usage if isinstance(usage, dict) else {}


def _rollout_info(result: dict[str, Any]) -> dict[str, Any]:
    task, repeat = result.get(TASK_INDEX, 0), result.get(ROLLOUT_INDEX, 0)
    info: dict[str, Any] = {
        "rollout_id": f"{task}:{repeat}",
        TASK_INDEX: task,
        ROLLOUT_INDEX: repeat,
    }
    if "reward" in result:
        info["reward"] = result["reward"]
    for key, value in (*_usage(result).items(), *result.items()):
        number = _number(value)
        if number is not None and not key.startswith("_") and key not in ("reward", "response"):
            info[key] = number
    return info


def _across_repeats(repeats: list[dict[str, Any]]) -> dict[str, float]:
    """Each repeat's mean of a measurement, summarized over the repeats."""
    import statistics

    names = list(dict.fromkeys(k for r in repeats for k in r))
    out: dict[str, float] = {}
    for name in names:
        if (
            not name.startswith("mean/")
            or name.endswith(NOT_ACROSS_REPEATS_ENDS)
            or "_across_repeats/" in name
        ):
            continue
        values = [r[name] for r in repeats if name in r]
        n, mean = len(values), sum(values) / len(values)
        std = _sample_std(values) if n > 1 else 0.0
        out.update(
            {
                f"mean_across_repeats/{name}": mean,
                f"median_across_repeats/{name}": float(statistics.median(values)),
                f"std_across_repeats/{name}": std,
                f"min_across_repeats/{name}": float(min(values)),
                f"max_across_repeats/{name}": float(max(values)),
                f"se_across_repeats/{name}": std / math.sqrt(n),
            }
        )
        if interval := _interval(mean, std / math.sqrt(n), n):
            out[f"ci_low_95_across_repeats/{name}"], out[f"ci_high_95_across_repeats/{name}"] = (
                interval
            )
    return out


def _per_repeat(measured: list[tuple[Any, Any, dict[str, float]]]) -> list[dict[str, Any]]:
    """A task played more than once: each repeat's (rollout index's) statistics over the tasks."""
    import statistics

    repeats = sorted({r for _, r, _ in measured})
    if len(repeats) < 2:
        return []
    columns = sorted({c for _, _, fields in measured for c in fields})
    all_tasks = len({t for t, _, _ in measured})
    out = []
    for repeat in repeats:
        mine = [(t, fields) for t, r, fields in measured if r == repeat]
        present = len({t for t, _ in mine})
        entry: dict[str, Any] = {
            ROLLOUT_INDEX: int(repeat),
            "sample_count": present,
            "missing_count": all_tasks - present,
        }
        for column in columns:
            values = [fields[column] for _, fields in mine if column in fields]
            if not values:
                continue
            n, mean = len(values), sum(values) / len(values)
            std = _sample_std(values) if n > 1 else 0.0
            sem = std / math.sqrt(n)
            entry.update(
                {
                    f"mean/{column}": mean,
                    f"median/{column}": float(statistics.median(values)),
                    f"std/{column}": std,
                    f"sem/{column}": sem,
                    f"min/{column}": float(min(values)),
                    f"max/{column}": float(max(values)),
                    f"p25/{column}": _quantile(values, 0.25),
                    f"p75/{column}": _quantile(values, 0.75),
                }
            )
            if interval := _interval(mean, sem, n):
                entry[f"ci_low_95/{column}"], entry[f"ci_high_95/{column}"] = interval
        out.append(entry)
    return out


def perf_summary(records: list[dict[str, Any]], total: int) -> dict[str, Any] | None:
    """The rollouts' ng_perf stamps (Gym's observability), summarized; None when none has one."""
    import statistics

    if total <= 0 or not records:
        return None

    def values(key: str) -> list[float]:
        return [r[key] for r in records if _finite(r.get(key))]

    def stat(name: str, v: list[float]) -> float:
        if name.startswith("p"):
            return _quantile(v, int(name[1:]) / 100)
        of: dict[str, Callable[[list[float]], float]] = {
            "mean": statistics.fmean,
            "median": statistics.median,
            "total": sum,
            "std": statistics.pstdev,
            "min": min,
            "max": max,
        }
        return of[name](v)

    summary: dict[str, Any] = {
        "overall_observability_coverage": len(records) / total,
        "token_observability_coverage": sum(
            1
            for r in records
            if _finite(r.get("token_observability_coverage"))
            and r["token_observability_coverage"] > 0
        )
        / total,
    }
    for field in PERF_TOKEN_FIELDS:
        if found := values(field):
            summary.update(
                {f"{name}_{field}": stat(name, found) for name in ("mean", "median", "total")}
            )
    if turns := values("num_turns"):
        summary.update(
            {
                f"{name}_num_turns": stat(name, turns)
                for name in ("mean", "median", "std", "min", "p90", "max")
            }
        )
    per_turn = [
        r["completion_tokens"] / r["num_turns"]
        for r in records
        if _finite(r.get("completion_tokens"))
        and _finite(r.get("num_turns"))
        and r["num_turns"] > 0
    ]
    if per_turn:
        summary["mean_tokens_per_turn"] = stat("mean", per_turn)
        summary["median_tokens_per_turn"] = stat("median", per_turn)
    if latency := values("total_latency_ms"):
        summary.update(
            {
                f"total_latency_{name}_ms": stat(name, latency)
                for name in ("p50", "p90", "p99", "mean")
            }
        )
    return summary


def aggregate_metrics(results: list[dict[str, Any]]) -> dict[str, Any]:
    """/aggregate_metrics' reply for the verify replies of a run, with the keys NeMo Gym 0.7's
    reward profiler gives them: per task (``group_level_metrics``), over the run (``agent_metrics``:
    mean/max/min/median/std of every measurement, the reward and the usage counts among them), per
    repeat when a task was played more than once, the headline means (``key_metrics``), coverage
    when some rollouts were masked, and ``perf_summary`` from ng_perf stamps. Masked rollouts are
    counted, never measured. MetricsError for replies that cannot be told apart."""
    reply: dict[str, Any] = {
        "group_level_metrics": [],
        "agent_metrics": {},
        "key_metrics": {},
        "perf_summary": None,
        "repeat_level_metrics": [],
    }
    if not results:
        return reply
    for i, result in enumerate(results):
        for key in (TASK_INDEX, ROLLOUT_INDEX):
            value = result.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool):
                raise MetricsError(
                    f"verify_responses[{i}] has {key} {value!r}: it must be a whole "
                    "number, as Gym stamps it"
                )
    scored = [r for r in results if not r.get("mask_sample")]
    masked = len(results) - len(scored)
    coverage = (
        {}
        if not masked
        else {
            "coverage/measured_rollouts": len(scored),
            "coverage/masked_rollouts": masked,
            "coverage/measured_tasks": len({r.get(TASK_INDEX, 0) for r in scored}),
            "coverage/fully_masked_tasks": len(
                {r.get(TASK_INDEX, 0) for r in results} - {r.get(TASK_INDEX, 0) for r in scored}
            ),
        }
    )
    reply["perf_summary"] = perf_summary(
        [r["ng_perf"] for r in results if isinstance(r.get("ng_perf"), dict)], len(results)
    )
    if not scored:
        reply["agent_metrics"], reply["key_metrics"] = dict(coverage), dict(coverage)
        return reply
    keys = collections.Counter((r.get(TASK_INDEX, 0), r.get(ROLLOUT_INDEX, 0)) for r in results)
    if repeated := [key for key, count in keys.items() if count > 1]:
        raise MetricsError(
            f"verify_responses holds more than one rollout {repeated[0][1]} of task "
            f"{repeated[0][0]} ({TASK_INDEX}, {ROLLOUT_INDEX}); send each rollout once"
        )
    every, results = results, [{k: v for k, v in r.items() if k != "mask_sample"} for r in scored]
    measured = [(r.get(TASK_INDEX, 0), r.get(ROLLOUT_INDEX, 0), _measured(r)) for r in results]
    columns = list(dict.fromkeys(c for _, _, fields in measured for c in fields))
    by_task: dict[int, list[tuple[dict[str, Any], dict[str, float]]]] = {}
    for result, (task, _, fields) in zip(results, measured, strict=True):
        by_task.setdefault(task, []).append((result, fields))
    for task, mine in sorted(by_task.items()):
        group = {
            TASK_INDEX: task,
            **_describe([f for _, f in mine], columns),
            "sample": {"agent_ref": {"name": "agent"}},
            "num_rollouts": len(mine),
            "expected_num_rollouts": len(mine),
            "missing_num_rollouts": 0,
            "reward_profile_completion_pct": 100.0,
            "rollout_infos": sorted(
                (_rollout_info(res) for res, _ in mine), key=lambda info: info[ROLLOUT_INDEX]
            ),
        }
        reply["group_level_metrics"].append(group)
    repeats = _per_repeat(measured)
    agent = {
        **_describe([f for _, _, f in measured], columns),
        **_across_repeats(repeats),
        **coverage,
        "num_repeats": len({r.get(ROLLOUT_INDEX, 0) for r in every}),
    }
    reply["agent_metrics"] = agent
    reply["key_metrics"] = {**{k: v for k, v in agent.items() if k.startswith("mean/")}, **coverage}
    reply["repeat_level_metrics"] = repeats
    return reply


RESPONSE_KEYS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "created_at": (int, float),
    "model": str,
    "object": str,
    "output": list,
    "parallel_tool_calls": bool,
    "tool_choice": (str, dict),
    "tools": list,
}


def response_problem(response: Any) -> str | None:
    """What makes a /verify's ``response`` something other than the Responses object simple_agent
    sends (the fields NeMo Gym requires, and the items this server reads), or None."""
    if not isinstance(response, dict):
        return "it is not a JSON object"
    for key, kind in RESPONSE_KEYS.items():
        if key not in response:
            return f"it has no {key}"
        if not isinstance(response[key], kind) or (
            kind is not bool and isinstance(response[key], bool)
        ):
            return f"its {key} is {type(response[key]).__name__}"
    for i, item in enumerate(response["output"]):
        at = f"output[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            return f"{at} is not an item with a type"
        kind = item["type"]
        if kind == "message":
            parts = item.get("content")
            if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                return f"{at} is a message whose content is not a list of parts"
            if any(
                p.get("type") == "output_text" and not isinstance(p.get("text"), str) for p in parts
            ):
                return f"{at} is a message with an output_text whose text is not text"
        elif kind == "function_call":
            for key in ("name", "arguments", "call_id"):
                if not isinstance(item.get(key), str):
                    return f"{at} is a function_call whose {key} is not text"
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(
                item.get("output"), (str, list)
            ):
                return f"{at} is a function_call_output without a call_id and an output"
    return None


def verify_problem(body: dict[str, Any]) -> str | None:
    """Why a /verify body is not a row with the model's response, or None."""
    params = body.get("responses_create_params")
    if (
        not isinstance(params, dict)
        or not isinstance(params.get("input"), (str, list))
        or "response" not in body
    ):
        return "verify takes the row with responses_create_params and the model's response"
    if problem := response_problem(body["response"]):
        return (
            f"the response is not a Responses object: {problem}; send the rollout's final "
            "Responses object, as NeMo Gym's simple_agent does"
        )
    return None


class GymSurface:
    """NeMo Gym's resources-server routes: /seed_session, a route per tool, /verify,
    /close_session and /aggregate_metrics, by a session cookie, each answering within its bound.
    Its rollouts are played where ``rollouts`` plays them; its sessions count in ``sessions``."""

    def __init__(
        self, rollouts: Rollouts, sessions: Sessions, settings: Settings, metrics: Metrics
    ):
        self.rollouts, self.settings, self.metrics = rollouts, settings, metrics
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
            sweep_idle(
                "a NeMo Gym",
                "idle_timeout",
                self.sessions,
                self.settings.idle_timeout,
                lambda session, why: self._end(session, why, wait=False),
                self.metrics,
                "gym",
            )
        )

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        await asyncio.gather(
            *(self._end(s, "the server shut down") for s in list(self.sessions.values())),
            return_exceptions=True,
        )
        await self.rollouts.stop()

    async def _end(self, session: GymSession, reason: str, wait: bool = True) -> None:
        """End a session; with ``wait``, once its episode is torn down (a verify answers first:
        the teardown then goes on in the background, its slot held until it is done)."""
        self.sessions.pop(session.token, None)
        if session.resources_id is not None:
            self.by_resources_id.pop(session.resources_id, None)
            self._spend(session.resources_id)
        await session.close(reason, wait)

    def _spend(self, resources_id: str) -> None:
        self.spent[resources_id] = None
        self.spent.move_to_end(resources_id)
        while len(self.spent) > SPENT_IDS_KEPT:
            self.spent.popitem(last=False)

    async def _task_of(self, row: dict[str, Any]) -> tuple[str, int, Any]:
        """The row's split and index, checked against its task_id; raises ValueError."""
        split, index, task_id = row.get("split"), row.get("index"), row.get("task_id")
        if not isinstance(split, str) or not isinstance(index, int) or isinstance(index, bool):
            raise RowShapeError(
                "the row needs split (text) and index (a whole number) naming the task "
                "to play; write the rows with python agentenv.py write-gym"
            )
        try:
            task_id_here = await self.rollouts.task_id(split, index)
        except LookupError as exc:
            raise ValueError(str(exc)) from None
        if task_id is not None and not same_task(str(task_id), task_id_here):
            raise ValueError(
                f"the row's task_id {task_id!r} is not the task at {split}[{index}], "
                f"which is {task_id_here!r}; write the rows again with write-gym"
            )
        return split, index, task_id_here

    def _session(self, request: web.Request) -> GymSession | None:
        token = session_cookie(request)
        return self.sessions.get(token) if token else None

    # -- routes

    async def alive(self, request: web.Request) -> Any:
        return json_reply({"status": "ok"})

    async def seed(self, request: web.Request) -> Any:
        body, problem = await json_body(request)
        if problem:
            return problem
        # Gym's environment servers name the session themselves, and seed again when a reply is
        # lost.
        resources_id = body.get("resources_session_id")
        if resources_id is not None and not (isinstance(resources_id, str) and resources_id):
            return json_reply(
                {
                    "detail": "resources_session_id names the session: send it as non-empty "
                    "text, or leave it out and use the session cookie"
                },
                400,
            )
        row: dict[str, Any] = body["task_data"] if isinstance(body.get("task_data"), dict) else body
        try:
            split, index, _ = await self._task_of(row)
        except ValueError as exc:
            return json_reply({"detail": str(exc)}, 422 if isinstance(exc, RowShapeError) else 400)
        # No await from here until the session is registered: a duplicate seed finds it.
        if resources_id is not None:
            seeded_with = digest(json.dumps(body, sort_keys=True))
            earlier = self.sessions.get(self.by_resources_id.get(resources_id, ""))
            if earlier is not None and earlier.seeded_with == seeded_with:
                return self._seeded(earlier)  # a retried seed: the same session
            if earlier is not None:
                return json_reply(
                    {
                        "detail": f"resources_session_id {resources_id!r} was seeded already, "
                        "with another episode or task; give each session an id of "
                        "its own"
                    },
                    409,
                )
            if resources_id in self.spent:
                return json_reply(
                    {
                        "detail": f"resources_session_id {resources_id!r} was closed; a closed "
                        "id stays closed, so seed the new session with a new id"
                    },
                    409,
                )
        token = secrets.token_urlsafe(24)
        session = self.sessions[token] = GymSession(
            token, row, self.rollouts.rollout(split, index), self.settings
        )
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

    async def tool(self, request: web.Request) -> Any:
        from aiohttp import web

        name = request.match_info["tool"]
        if f"/{name}" in self.GET_PATHS:
            raise web.HTTPMethodNotAllowed("POST", ["GET", "HEAD"])  # a GET route, never a tool
        session = self._session(request)
        if session is None:
            if session_cookie(request) in self.verdicts:
                return web.Response(
                    status=409,
                    text=f"error: this rollout was verified already, so "
                    f"{name} cannot run; seed a new session for a "
                    "new rollout",
                )
            return web.Response(
                status=400,
                text=f"error: no session: POST /seed_session with the "
                f"row first, then call {name} with its cookie",
            )
        try:
            arguments = loads(await read_body(request) or b"{}")
        except ValueError as exc:
            return web.Response(
                status=400, text=f"error: the arguments of {name} are not JSON ({exc})"
            )
        if not isinstance(arguments, dict):
            return web.Response(
                status=400, text=f"error: the arguments of {name} must be a JSON object"
            )
        async with session.lease.using():
            text = await session.call(name, arguments)
        # A lone surrogate (JSON's "\ud800" escape, echoed back by the env) cannot be UTF-8.
        return web.Response(
            body=text.encode("utf-8", "replace"), content_type="text/plain", charset="utf-8"
        )

    async def verify(self, request: web.Request) -> Any:
        body, problem = await json_body(request)
        if problem:
            return problem
        if problem := verify_problem(body):
            return json_reply({"detail": problem}, 422)
        token = request.cookies.get(GYM_COOKIE)
        if token is None:
            return await self._reverify(body)
        reply, session = last_reply(body.get("response")), self.sessions.get(token)
        if session is not None:
            async with session.lease.using():  # a second verify waits for the first's verdict
                if token not in self.verdicts:
                    outcome = await session.verify(reply)
                    verdict = self.verdicts[token] = Verdict.of(reply, outcome, session.failure)
                    if verdict.failure is not None:
                        self.metrics.mask("gym", verdict.failure)
                    while len(self.verdicts) > VERDICTS_KEPT:
                        self.verdicts.popitem(last=False)
                    # the reply now; the envs and boxes go after it, their slot with them
                    await self._end(session, "verified", wait=False)
        kept = self.verdicts.get(token)
        if kept is None:
            lost = Failure(
                SESSION_LOST,
                "this server holds no session for the rollout (it was "
                "closed, ended after idle_timeout, or the server restarted)",
            )
            self.metrics.mask("gym", lost)
            return json_reply(masked(body, lost))
        if kept.digest != digest(reply):
            return json_reply(
                {
                    "detail": "this rollout was verified already, with another response; a "
                    "session scores once: seed a new session for a new rollout"
                },
                409,
            )
        return json_reply(kept.reply(body))

    async def _reverify(self, body: dict[str, Any]) -> Any:
        """A /verify with no session is ``gym eval reverify``'s: the rollout is replayed on an
        episode of its own (GymSession.replay), which takes a slot as any rollout does."""
        try:
            split, index, _ = await self._task_of(body)
        except ValueError as exc:
            return json_reply(
                {
                    "detail": f"{exc}; a /verify without a session cookie replays the "
                    "rollout, so its row must name the task (or POST "
                    "/seed_session first, and send its cookie)"
                },
                422 if isinstance(exc, RowShapeError) else 400,
            )
        token = secrets.token_urlsafe(24)
        session = self.sessions[token] = GymSession(
            token, body, self.rollouts.rollout(split, index), self.settings
        )
        reply = last_reply(body["response"])
        try:
            async with session.lease.using():
                outcome = await session.replay(body["response"])
        finally:
            await self._end(session, "reverified", wait=False)
        return json_reply(Verdict.of(reply, outcome, session.failure).reply(body))

    async def reverify_mode(self, request: web.Request) -> Any:
        # Replayed (see _reverify), a verify needs nothing but its body: Gym's "stateless".
        return json_reply("stateless")

    async def close(self, request: web.Request) -> Any:
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
                await self._end(session, "close_session", wait=False)
            except Exception as exc:  # noqa: BLE001
                return json_reply(
                    {
                        "resources_session_id": resources_id,
                        "detail": f"the session's env could not be released ({exc})",
                    },
                    500,
                )
            return json_reply({"resources_session_id": resources_id})
        session = self.sessions.get(token) if token else None
        if session is None:
            return json_reply({"status": "already_closed"})
        try:
            await self._end(session, "close_session", wait=False)
        except Exception as exc:  # noqa: BLE001
            return json_reply({"status": "release_failed", "detail": str(exc)})
        return json_reply({"status": "closed"})

    async def aggregate(self, request: web.Request) -> Any:
        body, problem = await json_body(request)
        if problem:
            return problem
        given = body.get("verify_responses")
        if not isinstance(given, list) or not all(isinstance(r, dict) for r in given):
            return json_reply(
                {
                    "detail": [
                        {
                            "type": "list_type",
                            "loc": ["body", "verify_responses"],
                            "msg": "verify_responses must be a list of the verify "
                            "replies, each a JSON object",
                        }
                    ]
                },
                422,
            )
        try:  # a run of thousands of rollouts: its arithmetic off the event loop
            return json_reply(await asyncio.to_thread(aggregate_metrics, given))
        except MetricsError as exc:
            return json_reply({"detail": str(exc)}, 422)

    # Gym's servers answer liveness at / and these; OpenEnv's surface owns /health.
    ROUTES = [
        ("GET", "/", alive),
        ("GET", "/healthz", alive),
        ("GET", "/livez", alive),
        ("GET", "/readyz", alive),
        ("POST", "/seed_session", seed),
        ("POST", "/verify", verify),
        ("POST", "/close_session", close),
        ("POST", "/aggregate_metrics", aggregate),
        ("GET", "/reverify_mode", reverify_mode),
    ]
    GET_PATHS = frozenset(path for method, path, _ in ROUTES if method == "GET")
    # Gym calls a tool at the route of its name: a catch-all, matched after every fixed route.
    TOOL_ROUTE = ("POST", "/{tool}", tool)


async def environment_at(http: aiohttp.ClientSession, url: str) -> str:
    """The name of the environment a running server serves; AgentEnvError if none answers."""
    try:
        async with http.get(
            url.rstrip("/") + "/list_environments", timeout=aiohttp.ClientTimeout(total=30)
        ) as resp:
            if resp.status == 401:
                raise AgentEnvError(
                    f"the server at {url} asks for a bearer token, and "
                    + (
                        "AGENTENV_TOKEN is not the one it was given"
                        if client_headers()
                        else "none was sent"
                    )
                    + "; set AGENTENV_TOKEN to the token serve was given"
                )
            return str((await resp.json(content_type=None))[0])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, LookupError, TypeError) as exc:
        raise AgentEnvError(
            f"no agentenv.py server answered at {url} ({type(exc).__name__}: "
            f"{exc}); start it with python agentenv.py serve BUNDLE, or pass the "
            "bundle's folder instead of a URL"
        ) from None


def same_task(given: str, here: str) -> bool:
    """Whether a row's task_id names this task: the same id, or (a bundle served from another
    folder) the same bundle and task names."""
    return given == here or given.split("/")[-2:] == here.split("/")[-2:]


def masked(body: dict[str, Any], failure: Failure, quiet: bool = False) -> dict[str, Any]:
    """A complete verify reply for a rollout the environment failed: NeMo RL leaves it out."""
    if not quiet:
        gym_log.warning("rollout masked: %s", failure)
    config = body["instance_config"] if isinstance(body.get("instance_config"), dict) else {}
    return {
        **body,
        "reward": 0.0,
        "mask_sample": True,
        "failure_kind": failure.kind,
        "failure_reason": failure.reason,
        "instance_config": {**config, "mask_sample": True},
    }


# ================================================================ 11. The app

# Names a tool can't take, since Gym would call a route of the app instead: the first segment of
# every fixed route of both surfaces, and the routes NeMo Gym's own servers answer.
GYM_OWN_ROUTES = {
    "docs",
    "redoc",
    "openapi.json",
    "health",
    "healthz",
    "livez",
    "readyz",
    "stats",
    "reverify_mode",
    "mcp",
    "ng-rollout",
}
RESERVED_NAMES = frozenset(
    {
        path.split("/")[1]
        for _, path, _ in (*OpenEnvSurface.ROUTES, *GymSurface.ROUTES)
        if path != "/" and not path.startswith("/{")
    }
    | GYM_OWN_ROUTES
    | {"web"}
)  # the web page's routes (WebPage, below)


class Server:
    """The one aiohttp application: OpenEnv's and NeMo Gym's routes side by side on one runtime
    and its pool, so both kinds of trainer share one pool of episodes (or, for a Gym resources
    server in url: mode, Gym's routes alone, playing on a running serve). The app's start-up
    starts the runtime and the surfaces; its shutdown ends every session and tears down. It
    serves the runtime's metrics at /metrics (a Gym server in url: mode keeps metrics of its own),
    and while episodes are live it logs a status line every ``status_interval`` seconds."""

    def __init__(
        self,
        runtime: Runtime | None,
        settings: Settings = Settings(),
        *,
        url: str | None = None,
        host: str | None = "127.0.0.1",
        port: int | None = 8000,
        token: str | None = None,
    ):
        from aiohttp import web

        self.runtime, self.settings, self.host, self.port = runtime, settings, host, port
        self.metrics = runtime.metrics if runtime else Metrics()
        # the page plays over OpenEnv's /ws, which only a server with a runtime has
        self.web = WebPage(runtime, self.metrics) if runtime else None
        # A request whose client goes away is cancelled (however the app is run): a call under
        # way stops, and its episode ends, instead of holding its box and slot to the end.
        self.guard = BrowserGuard(host, settings.allow_host)
        self.app = web.Application(
            client_max_size=MAX_BODY,
            middlewares=[
                json_errors(),
                self.guard.middleware(),
                *([bearer_token(token, self.web.locked if self.web else None)] if token else []),
            ],
            handler_args={"handler_cancellation": True},
        )
        sessions = Sessions(runtime.pool.limit if runtime else settings.max_concurrent_envs)
        self.metrics.watch("agentenv_sessions", "Live sessions, by wire", sessions.by_wire, "wire")
        self.openenv = OpenEnvSurface(runtime, sessions, settings) if runtime else None
        rollouts: Rollouts = (
            LocalRollouts(runtime) if runtime else RemoteRollouts(str(url), settings)
        )
        self.gym = GymSurface(rollouts, sessions, settings, self.metrics)
        self.surfaces = [s for s in (self.openenv, self.gym) if s is not None]
        self._status: asyncio.Task | None = None
        router = self.app.router
        _add_route(router, "GET", "/metrics", metrics_route(self.metrics))
        for method, path, page in WebPage.ROUTES if self.web else ():
            _add_route(router, method, path, page.__get__(self.web))
        routes = [
            (method, path, handler.__get__(surface))
            for surface in self.surfaces
            for method, path, handler in surface.ROUTES
        ]
        # aiohttp matches routes in the order they were added: the fixed routes of both surfaces
        # (and Gym's prefixed twins) come before the tool catch-all, which would take them. Routes
        # with a part of their own ({env}) come after it: a tool's path of one part never matches
        # OpenEnv's /{env}/..., and aiohttp would try each of them first on every tool call.
        for method, path, handler in routes:
            if "{" not in path:
                _add_route(router, method, path, handler)
        for method, path, handler in self.gym.ROUTES:
            _add_route(router, method, "/ng-rollout/{rollout_id}" + path, handler.__get__(self.gym))
        for prefix in ("", "/ng-rollout/{rollout_id}"):
            method, path, handler = self.gym.TOOL_ROUTE
            _add_route(router, method, prefix + path, handler.__get__(self.gym))
        for method, path, handler in routes:
            if "{" in path:
                _add_route(router, method, path, handler)
        self.app.on_startup.append(self._start)
        self.app.on_shutdown.append(self._shutdown)

    async def _start(self, app: Any) -> None:
        if self.runtime is not None:
            await self.runtime.start()
        for surface in self.surfaces:
            await surface.start()
        if self.runtime is not None:
            # build_app's app learns where it listens only from its runner: it names the routes
            bundle = self.runtime.bundle
            url = f"http://{self.host}:{self.port}" if self.host is not None else ""
            log.info(
                "Serving %s: %d tasks in the splits %s, up to %d episodes at once, envs in the "
                "%s sandbox, %s(OpenEnv: %s/ws; NeMo Gym: %s/seed_session; metrics: "
                "%s/metrics; web page: %s/web).",
                bundle.name,
                len(bundle.tasks),
                ", ".join(bundle.splits),
                self.runtime.pool.limit,
                self.runtime.sandbox.kind if self.runtime.sandbox else "",
                f"at {url} " if url else "",
                url,
                url,
                url,
                url,
            )
            warm, why = self.runtime.warm.counts["target"], self.runtime.warm_why
            if warm:
                log.info(
                    "Keeping %d warm env(s) started and ready ahead of demand (%s), beside the "
                    "%d episode slots%s.",
                    warm,
                    self.runtime.warm.describe(),
                    self.runtime.pool.limit,
                    ""
                    if why is None
                    else (
                        f": by default {why}, so a step's rollouts "
                        "take envs already up instead of each waiting for a cold deploy; "
                        "--warm 0 (warm=0 to build_app, warm: 0 in a Gym config) turns it "
                        "off, --warm N sets it"
                    ),
                )
            elif why is not None:
                log.info(
                    "Keeping no warm envs by default: %s (--warm N, warm=N to build_app or "
                    "warm: N in a Gym config keeps N).",
                    why,
                )
            self._status = asyncio.create_task(self._status_lines(self.runtime))

    async def _status_lines(self, runtime: Runtime) -> None:
        """Every status_interval, while episodes are live or waiting, one sentence of how the run
        goes; quiet when idle (the durations of a quiet interval are dropped all the same)."""
        while True:
            await asyncio.sleep(self.settings.status_interval)  # a clock: nothing else ticks
            pool = runtime.pool
            line = self.metrics.status(
                pool.in_use, pool.waiting, pool.limit, self.settings.status_interval
            )
            if pool.in_use or pool.waiting:
                log.info(line)

    async def _shutdown(self, app: Any) -> None:
        if self._status is not None:
            self._status.cancel()
        if self.runtime is not None:
            pool = self.runtime.pool
            if self.metrics.totals(self.metrics.episodes) or pool.in_use or pool.waiting:
                log.info(
                    self.metrics.status(
                        pool.in_use, pool.waiting, pool.limit, self.settings.status_interval
                    )
                )
            warm = self.runtime.warm
            log.info(
                "Shutting down: ending %d live episode(s) and tearing their envs down%s.",
                len(self.runtime.live),
                f", and removing {warm.live} warm env(s)" if warm.target else "",
            )
            self.runtime.begin_closing()
        for surface in reversed(self.surfaces):
            await surface.stop()
        if self.runtime is not None:
            await self.runtime.close()


def build_app(
    bundle: str | os.PathLike | collections.abc.Mapping[str, str | os.PathLike],
    *,
    reward: str | None = None,
    token: str | None = None,
    **settings: Any,
) -> Any:
    """The aiohttp application that serves a bundle on both wires (OpenEnv's and NeMo Gym's) out
    of one pool of episodes; run it with ``aiohttp.web.run_app(app, host=..., port=...)`` or any
    aiohttp runner. Its start-up opens the sandbox and builds the envs' images; its shutdown ends
    every live episode and tears its envs down.

    ``bundle`` is a bundle's folder, or a mapping of split name to bundle folder (each bundle's
    tasks one split, and 'all' every task). ``reward``: the scoring step whose score is the
    reward. ``token``: every request must carry ``Authorization: Bearer TOKEN``. Every other
    keyword is a setting by its name, as ``serve``'s flag --NAME sets it (``Settings.names()``:
    ``sandbox``, ``max_concurrent_envs``, the deadlines in seconds, ``warm``, ``warm_env``
    ({env: count}), each provider's options); a name that is no setting is refused by name. A
    bad argument raises AgentEnvError, saying the fix, before anything starts."""
    checked = Settings.keywords(
        {k: dict(v) if isinstance(v, collections.abc.Mapping) else v for k, v in settings.items()},
        "build_app",
        Settings.served(),
    )
    return _server(bundle, reward=reward, token=token, settings=checked).app


def _server(
    bundle: Any,
    *,
    reward: str | None,
    token: str | None,
    settings: Settings,
    host: str | None = None,
    port: int | None = None,
    knob: str | None = None,
) -> Server:
    """build_app's Server (serve's too, which knows where it listens; a trainer's in-process one,
    whose pool ``knob`` raises): checked, loaded, unstarted."""
    if token is not None and (not isinstance(token, str) or not token):
        raise AgentEnvError(
            "token must be non-empty text (what clients send as Authorization: "
            "Bearer TOKEN), or None for no token"
        )
    if isinstance(bundle, collections.abc.Mapping):
        if not bundle:
            raise AgentEnvError(
                "the mapping of splits to bundle folders is empty; give at least "
                "one, such as {'train': 'bundles/train', 'eval': 'bundles/eval'}"
            )
        for split in bundle:
            if not isinstance(split, str) or not split.strip() or split == "all":
                raise AgentEnvError(
                    f"{split!r} cannot name a split: name each bundle's split with "
                    "text other than 'all' (which holds every task)"
                )
        loaded = Bundle.of_splits(
            {split: Bundle.load(folder, reward) for split, folder in bundle.items()}
        )
    elif isinstance(bundle, (str, os.PathLike)):
        loaded = Bundle.load(bundle, reward)
    else:
        raise AgentEnvError(
            f"bundle must be a bundle's folder, or a mapping of split name to folder, "
            f"not {type(bundle).__name__}"
        )
    runtime = Runtime(
        loaded,
        settings,
        knob=knob or ("build_app's max_concurrent_envs" if host is None else SERVE_KNOB),
        serving=True,
    )
    return Server(runtime, settings, host=host, port=port, token=token)


def _add_route(router: Any, method: str, path: str, handler: Callable) -> None:
    # add_get answers HEAD too, as a GET route should
    if method == "GET":
        router.add_get(path, handler)
    else:
        router.add_route(method, path, handler)


def run_gym_server() -> None:
    """Run as NeMo Gym runs a resources server: ``python app.py`` in its folder, with its host,
    port and settings in ``NEMO_GYM_CONFIG_DICT`` under the instance ``NEMO_GYM_CONFIG_PATH``."""
    import yaml
    from aiohttp import web

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        full = yaml.safe_load(os.environ["NEMO_GYM_CONFIG_DICT"])
        instance = os.environ["NEMO_GYM_CONFIG_PATH"]
        servers = full[instance]["resources_servers"]
        config = dict(next(iter(servers.values())))
    except (KeyError, TypeError, StopIteration, yaml.YAMLError) as exc:
        sys.exit(
            f"agentenv.py: this resources server runs under NeMo Gym, which passes its config in "
            f"NEMO_GYM_CONFIG_DICT and NEMO_GYM_CONFIG_PATH ({type(exc).__name__}: {exc}); start "
            "it with gym env start --config configs/<name>.yaml"
        )
    if int(config.get("num_workers") or 1) > 1:
        sys.exit(
            f"agentenv.py: num_workers is {config['num_workers']}, but a rollout's session lives "
            "in its server's process, so the resources server runs with one worker; remove "
            "num_workers from its config"
        )
    host = config.get("host") or full.get("default_host") or "127.0.0.1"
    port = int(config.get("port") or 8000)
    where = f"the resources server's config (configs/{instance}.yaml)"
    try:
        settings = Settings.from_config(config, where, gym=full)
        if config.get("url"):
            server = Server(None, settings, url=str(config["url"]), host=host, port=port)
        elif config.get("bundle"):
            bundle = Bundle.load(Path(str(config["bundle"])).expanduser(), config.get("reward"))
            runtime = Runtime(
                bundle, settings, knob=f"max_concurrent_envs in {where}", serving=True
            )
            server = Server(runtime, settings, host=host, port=port)
        else:
            sys.exit(
                "agentenv.py: the resources server's config names neither url: (a running "
                "python agentenv.py serve) nor bundle: (a bundle folder); add one"
            )
    except AgentEnvError as exc:
        sys.exit(f"agentenv.py: {exc}")
    wait_for_children_by_pidfd()
    try:
        web.run_app(
            server.app, host=host, port=port, print=None, access_log=None, shutdown_timeout=30
        )
    except AgentEnvError as exc:
        sys.exit(f"agentenv.py: {exc}")


# ---------------------------------------------------------------- the web page


class WebPage:
    """``GET /web``: one page, with no build step and nothing fetched from anywhere else, on
    which a person plays any task by hand and watches the run; and ``GET /web/status``, the
    numbers it shows (``Metrics.numbers``: the same as /metrics), for scripts too.

    The page is an ordinary client of the server's own wires: the task API for the splits and
    tasks, an OpenEnv session over /ws to play (so its episodes count like any other), and
    /web/status every second. Behind a token, a browser's first ask (a navigation carries no
    header) is refused 401 with a small form that asks for the token; the form fetches the page
    with it as a bearer token and keeps it in the tab's sessionStorage, and the page sends it on
    every fetch, and on /ws as a subprotocol (a browser's WebSocket takes no header): never in
    a URL, so never in a log, the history or a Referer. Both are served with a
    Content-Security-Policy that lets them run their own script and reach their own origin
    only."""

    def __init__(self, runtime: Runtime, metrics: Metrics):
        self.runtime, self.metrics = runtime, metrics

    @staticmethod
    def _html(text: str, status: int = 200, **headers: str) -> Any:
        from aiohttp import web

        return web.Response(
            text=text, status=status, content_type="text/html", headers={**WEB_HEADERS, **headers}
        )

    def locked(self, request: web.Request) -> Any:
        """What a request for the page without the token is answered (None: not the page)."""
        if request.method in ("GET", "HEAD") and request.path == "/web":
            return self._html(WEB_LOCKED, 401, **{"WWW-Authenticate": 'Bearer realm="agentenv.py"'})
        return None

    async def page(self, request: web.Request) -> Any:
        return self._html(WEB_PAGE)

    async def status(self, request: web.Request) -> Any:
        return json_reply(
            {
                "bundle": self.runtime.bundle.name,
                "sandbox": self.runtime.sandbox.kind if self.runtime.sandbox else None,
                "version": __version__,
                **self.metrics.numbers(),
            }
        )

    ROUTES = [("GET", "/web", page), ("GET", "/web/status", status)]


def _document(title: str, body: str, script: str) -> str:
    """A document of the page's: the head and style both share, its body, its script last."""
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<link rel="icon" href="data:,">\n<title>{title}</title>\n<style>{WEB_STYLE}</style>\n'
        f"</head>\n<body>\n{body}<script>{script}</script>\n</body>\n</html>\n"
    )


def _csp_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


WEB_STYLE = r""":root { --ink: #1d232b; --muted: #5d6776; --line: #dce1e8; --bg: #f3f5f8; --accent: #2e5bcc;
  --good: #1b7343; --bad: #b3261e; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
header { display: flex; flex-wrap: wrap; align-items: baseline; gap: 4px 14px; padding: 10px 20px;
  background: var(--ink); color: #fff; }
header h1 { margin: 0; font-size: 17px; }
header span { color: #b4bdca; }
main { display: grid; grid-template-columns: minmax(0, 1fr) 370px; gap: 16px; padding: 16px 20px;
  align-items: start; }
main.lock { display: block; max-width: 420px; margin: 60px auto; }
@media (max-width: 900px) { main { grid-template-columns: minmax(0, 1fr); } }
section, form.card { background: #fff; border: 1px solid var(--line); border-radius: 8px;
  padding: 14px 16px; }
section section { border: 0; padding: 0; }
h2 { margin: 0 0 10px; font-size: 15px; }
h3 { margin: 16px 0 6px; font-size: 12px; letter-spacing: .04em; text-transform: uppercase;
  color: var(--muted); }
label { font-weight: 600; }
input, select, textarea, button { font: inherit; color: inherit; }
input, select, textarea { border: 1px solid #c5ccd6; border-radius: 5px; padding: 4px 7px;
  background: #fff; max-width: 100%; }
textarea { width: 100%; resize: vertical; }
button { border: 1px solid var(--accent); border-radius: 5px; padding: 4px 12px;
  background: var(--accent); color: #fff; cursor: pointer; }
button:disabled { opacity: .4; cursor: default; }
:focus-visible { outline: 2px solid var(--accent); outline-offset: 1px; }
.row { display: flex; flex-wrap: wrap; align-items: center; gap: 6px 8px; }
.row label:not(:first-child) { margin-left: 8px; }
.spread { justify-content: space-between; }
pre { margin: 0; white-space: pre-wrap; overflow-wrap: anywhere;
  font: 13px/1.45 ui-monospace, "DejaVu Sans Mono", monospace; }
.prompt { padding: 6px 10px; border-left: 3px solid var(--accent); background: #f6f8fc; }
.muted, .hint { color: var(--muted); }
.hint { margin: 0; font-size: 12px; }
.alert { margin: 4px 0 0; color: var(--bad); font-size: 12px; }
.tools { display: grid; grid-template-columns: repeat(auto-fill, minmax(240px, 1fr)); gap: 10px; }
fieldset { margin: 0; padding: 6px 10px 10px; border: 1px solid var(--line); border-radius: 6px; }
fieldset:disabled { opacity: .6; }
legend { padding: 0 4px; font: 600 13px ui-monospace, "DejaVu Sans Mono", monospace; }
.field { display: grid; gap: 2px; margin: 6px 0; }
ol.log { display: grid; gap: 6px; margin: 0; padding: 0; list-style: none; }
ol.log li { padding: 6px 10px; border: 1px solid var(--line); border-radius: 6px; }
ol.log li.reply { border-color: #bcdcc7; background: #f2f8f4; }
ol.log li.error, .failed { border-color: #eab6b1; background: #fdf3f2; }
.who { font-size: 12px; font-weight: 600; color: var(--muted); }
#outcome { margin-top: 14px; padding: 10px 12px; border: 1px solid #bcdcc7; border-radius: 6px;
  background: #f2f8f4; }
#outcome.failed { border-color: #eab6b1; background: #fdf3f2; }
#outcome h3 { margin-top: 10px; }
#outcome h3:first-child { margin-top: 0; }
.big { margin: 0; font-size: 26px; font-weight: 700; }
table { width: 100%; border-collapse: collapse; }
th, td { padding: 3px 6px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { font-size: 12px; font-weight: 600; color: var(--muted); }
.pass { color: var(--good); font-weight: 600; }
.fail { color: var(--bad); font-weight: 600; }
dl { display: grid; grid-template-columns: auto minmax(0, 1fr); gap: 5px 12px; margin: 0; }
dt { color: var(--muted); }
dd { margin: 0; font-variant-numeric: tabular-nums; }
meter { display: block; width: 100%; height: 10px; }
.split { margin: 6px 0 10px; }
.bars { display: flex; align-items: flex-end; gap: 2px; height: 40px; border-bottom: 1px solid #c5ccd6; }
.bars span { flex: 1; min-height: 1px; border-radius: 2px 2px 0 0; background: var(--accent); }
.axis { font-size: 11px; }
"""  # noqa: E501 - the page's own CSS or JavaScript, served as written

# The form a browser is answered without the token.
WEB_LOCKED_SCRIPT = r""""use strict";
{
// The page is fetched with the token as a bearer header, kept for this tab (sessionStorage:
// gone when the tab closes, never in a URL), and written over this one.
const form = document.getElementById("unlock"), said = document.getElementById("said");

async function unlock(token) {
  let response;
  try {
    response = await fetch("/web", {headers: {Authorization: "Bearer " + token}});
  } catch (error) {
    said.textContent = "The token could not be sent: " + error.message;
    return;
  }
  if (!response.ok) {
    sessionStorage.removeItem("agentenv-token");
    said.textContent = response.status === 401 ? "The server refused that token." :
      "The server answered " + response.status + ".";
    return;
  }
  sessionStorage.setItem("agentenv-token", token);
  const page = await response.text();
  document.open();
  document.write(page);
  document.close();
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  unlock(document.getElementById("token").value);
});
const kept = sessionStorage.getItem("agentenv-token");
if (kept) unlock(kept);
}
"""  # noqa: E501 - the page's own CSS or JavaScript, served as written

WEB_LOCKED = _document(
    "agentenv.py: token",
    r"""<header><h1>agentenv.py</h1></header>
<main class="lock">
<form id="unlock" class="card">
  <h2>This server asks for its token</h2>
  <p class="muted">The token serve was given (--token-file, --token or AGENTENV_TOKEN). This tab keeps it until it closes, and sends it as a bearer token.</p>
  <div class="field"><label for="token">Token</label><input id="token" type="password" autocomplete="off" required></div>
  <div class="row"><button>Open</button></div>
  <p id="said" class="alert" role="alert"></p>
</form>
</main>
""",  # noqa: E501 - the page's own HTML, served as written
    WEB_LOCKED_SCRIPT,
)

# The page: play by hand on the left, the run on the right.
WEB_SCRIPT = r""""use strict";
{
// The token the form of the locked page was given (none when the server asks for none).
const TOKEN = sessionStorage.getItem("agentenv-token");
const AUTH = TOKEN ? {Authorization: "Bearer " + TOKEN} : {};
const $ = (id) => document.getElementById(id);

// An element; its children's text goes in as text, never as markup (prompts, tool results and
// verifier rows come from the bundle, its envs and the player).
function el(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes || {})) {
    if (value === false || value == null) continue;
    if (key === "class") node.className = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.filter((child) => child != null)
    .map((child) => child instanceof Node ? child : String(child)));
  return node;
}

function refused() {     // a token the server no longer takes: the locked page asks again
  sessionStorage.removeItem("agentenv-token");
  location.reload();
}

async function api(path, body) {
  const response = await fetch(path, body === undefined ? {headers: AUTH} : {method: "POST",
    headers: {...AUTH, "Content-Type": "application/json"}, body: JSON.stringify(body)});
  if (response.status === 401) refused();
  const data = await response.json();
  if (!response.ok) throw new Error(path + " answered " + response.status + ": " + JSON.stringify(data.detail));
  return data;
}

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

// ---- one OpenEnv session over /ws, as any client plays one: one reply per message, in order

const session = {
  socket: null, opened: null, pending: [], said: "",
  open() {
    if (this.socket) return this.opened;
    // A browser's WebSocket takes no headers: the token goes as a subprotocol beside "agentenv".
    const protocols = ["agentenv", ...(TOKEN ? ["agentenv.bearer." + base64url(TOKEN)] : [])];
    const socket = this.socket = new WebSocket(location.origin.replace(/^http/, "ws") + "/ws", protocols);
    this.opened = new Promise((resolve, reject) => {
      socket.onopen = resolve;
      socket.onerror = () => reject(new Error("the server's /ws did not open"));
    });
    socket.onmessage = (event) => {
      const reply = JSON.parse(event.data), next = this.pending.shift();
      if (next) next.resolve(reply);
      else if (reply.type === "error") this.said = reply.data.message;    // a refusal, then a close
    };
    socket.onclose = (event) => {
      this.socket = null;
      const why = new Error("the session ended: " + (event.reason || this.said || "its socket closed"));
      for (const next of this.pending.splice(0)) next.reject(why);
      if (!episode.over) { over(); say(why.message + ". Start again to play on.", true); }
    };
    return this.opened;
  },
  async ask(message) {
    await this.open();
    return new Promise((resolve, reject) => {
      this.pending.push({resolve, reject});
      this.socket.send(JSON.stringify(message));
    });
  },
};

// ---- playing a task by hand

const episode = {turn: 0, over: true, busy: false};

function say(text, bad) {
  $("phase").textContent = text;
  $("phase").className = bad ? "alert" : "muted";
}

function settle() {     // what can be pressed: nothing while a message is out; no turn once over
  $("start").disabled = episode.busy;
  for (const control of document.querySelectorAll("#turn fieldset, #turn button")) {
    control.disabled = episode.busy || episode.over;
  }
}

function over() {
  episode.over = true;
  $("turn").hidden = true;
  settle();
}

async function act(work) {
  episode.busy = true;
  settle();
  try {
    await work();
  } catch (error) {
    over();
    say(error.message, true);
  } finally {
    episode.busy = false;
    settle();
  }
}

function observed(reply) {     // an observation's data; an error frame (a refused message) throws
  if (reply.type === "error") throw new Error(reply.data.message);
  return reply.data;
}

function logged(kind, who, text) {
  $("transcript").append(el("li", {class: kind}, el("div", {class: "who"}, who), el("pre", {}, text)));
}

function failed(data) {      // shows the episode's failure or a refusal, if the observation is one
  const meta = data.observation.metadata || {};
  if (meta.status !== "error") return false;
  over();
  const box = $("outcome");
  box.hidden = false;
  box.className = "failed";
  if (meta.failure_kind) {
    box.replaceChildren(el("h3", {}, "Masked"), el("p", {class: "big"}, meta.failure_kind),
      el("p", {}, "The environment failed this episode, not the player: a trainer masks the rollout."),
      el("pre", {}, meta.error));
    say("The episode failed, masked " + meta.failure_kind + ".", true);
  } else {
    box.replaceChildren(el("h3", {}, "Refused"), el("pre", {}, meta.error));
    say("The server refused: " + meta.error, true);
  }
  return true;
}

function scored(data) {
  over();
  const meta = data.observation.metadata, box = $("outcome");
  const rows = [];
  for (const [verifier, verification] of Object.entries(meta.verifications || {})) {
    for (const row of verification.results || []) {
      const result = row.result === true ? "pass" : row.result === false ? "fail" : "";
      rows.push(el("tr", {}, el("td", {}, verifier),
        el("td", {}, row.id ?? row.type ?? "#" + row.criterion_index),
        el("td", {class: result}, result), el("td", {}, row.score ?? ""),
        el("td", {}, row.justification ?? row.message ?? row.description ?? "")));
    }
  }
  box.hidden = false;
  box.className = meta.forfeit ? "failed" : "";
  box.replaceChildren(el("h3", {}, "Reward"), el("p", {class: "big", id: "reward"}, data.reward),
    ...(meta.forfeit ? [el("h3", {}, "Forfeited"), el("pre", {}, meta.forfeit),
      el("p", {}, "The player's own doing ended the episode before a verifier scored it: 0, not masked.")] : []),
    el("h3", {}, "Scores"),
    el("table", {"aria-label": "Scores"}, el("tr", {}, el("th", {}, "step"), el("th", {}, "score")),
      ...Object.entries(meta.scores).map(([step, score]) => el("tr", {}, el("td", {}, step), el("td", {}, score)))),
    el("h3", {}, "What the verifiers said"),
    el("table", {"aria-label": "Verifier rows"}, el("tr", {}, ...["verifier", "row", "result", "score", "why"]
      .map((head) => el("th", {}, head))), ...rows));
  say(meta.forfeit ? "Forfeited: reward 0." : "Scored: reward " + data.reward + ".");
}

function kindOf(spec) {       // how an argument is typed in: text, a number, a choice, or JSON
  const types = [].concat(spec.type ?? []).filter((type) => type !== "null");
  if (types.length !== 1) return "json";
  if (types[0] === "string") return Array.isArray(spec.enum) ? "choice" : "text";
  return {integer: "number", number: "number", boolean: "choice"}[types[0]] || "json";
}

function toolForm(tool, n) {
  const schema = tool.input_schema || {}, required = new Set(schema.required || []);
  const box = el("fieldset", {}, el("legend", {}, tool.name));
  if (tool.description) box.append(el("p", {class: "hint"}, tool.description));
  const fields = Object.entries(schema.properties || {}).map(([name, spec], m) => {
    const id = "arg-" + n + "-" + m, kind = kindOf(spec);
    const type = [].concat(spec.type ?? "any JSON").join(" or ");
    let input;
    if (kind === "choice") {
      const choices = type === "boolean" ? [true, false] : spec.enum;
      input = el("select", {id}, el("option", {value: ""}, "(not sent)"),
        ...choices.map((choice) => el("option", {value: JSON.stringify(choice)}, choice)));
    } else if (kind === "number") {
      input = el("input", {id, type: "number", step: type === "integer" ? "1" : "any"});
    } else if (kind === "text") {
      input = el("input", {id, type: "text", autocomplete: "off"});
    } else {
      input = el("textarea", {id, rows: 2, spellcheck: "false", placeholder: type === "array" ? "[ ]" : "{ }"});
    }
    const hint = el("p", {class: "hint", id: id + "-hint"},
      [required.has(name) ? "required" : "optional", kind === "json" ? type + ", as JSON" : type,
       spec.description].filter(Boolean).join(" · "));
    input.setAttribute("aria-describedby", hint.id);
    box.append(el("div", {class: "field"}, el("label", {for: id}, name), input, hint));
    return {name, kind, input};
  });
  const alert = el("p", {class: "alert", role: "alert"});
  box.append(el("div", {class: "row"}, el("button", {type: "submit"}, "Call " + tool.name)), alert);
  const form = el("form", {novalidate: true}, box);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    call(tool.name, fields, alert);
  });
  return form;
}

function argumentsOf(fields, alert) {     // what the form holds; an empty field is not sent
  const args = {}, problems = [];
  for (const {name, kind, input} of fields) {
    const text = input.value;
    if (text.trim() === "") continue;
    if (kind === "text") args[name] = text;
    else if (kind === "number") args[name] = Number(text);
    else {
      try {
        args[name] = JSON.parse(text);
      } catch (error) {
        problems.push(name + " is not JSON (" + error.message + ")");
      }
    }
  }
  alert.textContent = problems.join("; ");
  return problems.length ? null : args;
}

async function call(name, fields, alert) {
  const args = argumentsOf(fields, alert);
  if (!args) return;
  await act(async () => {
    const data = observed(await session.ask({type: "step",
      data: {type: "call_tool", tool_name: name, arguments: args}}));
    const seen = data.observation, who = name + " " + JSON.stringify(args);
    if (seen.error) logged("error", who, seen.error.error_type + ": " + seen.error.message);
    else if (seen.result) logged("call", who, seen.result.data ?? JSON.stringify(seen.result));
    else logged("error", who, "no answer: the call ended the episode");
    failed(data);
  });
}

async function openTurn(prompt) {
  episode.turn += 1;
  logged("prompt", "Turn " + episode.turn + ": the prompt", prompt);
  const data = observed(await session.ask({type: "step", data: {type: "list_tools"}}));
  const tools = data.observation.tools.filter((tool) => tool.name !== "end_turn");
  $("tools").replaceChildren(...tools.map(toolForm));
  if (!tools.length) $("tools").append(el("p", {class: "hint"}, "This turn offers no tools."));
  say("Turn " + episode.turn + ": call tools as you like, then end the turn with your reply.");
}

$("pick").addEventListener("submit", (event) => {
  event.preventDefault();
  const split = $("split").value, index = Number($("task").value);
  episode.turn = 0;
  episode.over = false;
  $("episode").hidden = false;
  $("turn").hidden = false;
  $("outcome").hidden = true;
  $("transcript").replaceChildren();
  $("tools").replaceChildren();
  $("system-prompt").textContent = "";
  say("Deploying the envs of " + $("task").selectedOptions[0].textContent + " and opening its first turn…");
  act(async () => {
    const data = observed(await session.ask({type: "reset", data: {split, index}}));
    if (failed(data)) return;
    $("system-prompt").textContent = data.observation.metadata.system_prompt || "(none)";
    await openTurn(data.observation.metadata.prompt);
  });
});

$("reply-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const response = $("reply").value;
  say("Ending the turn: the task's next steps run (after the last turn, its verifiers)…");
  act(async () => {
    const data = observed(await session.ask({type: "step",
      data: {type: "call_tool", tool_name: "end_turn", arguments: {response}}}));
    logged("reply", "Your reply", response || "(empty)");
    $("reply").value = "";
    if (failed(data)) return;
    if (data.done) return scored(data);
    await openTurn(data.observation.result.prompt);
  });
});

let served = "";
async function tasks() {
  const {tasks} = await api("/" + encodeURIComponent(served) + "/tasks", {split: $("split").value});
  $("task").replaceChildren(...tasks.map((task) =>
    el("option", {value: task.index}, task.name + " (" + task.toolset + ")")));
}

async function splits() {
  [served] = await api("/list_environments");
  const found = await api("/" + encodeURIComponent(served) + "/splits");
  $("split").replaceChildren(...found.map((split) => el("option", {value: split.name}, split.name)));
  await tasks();
  settle();
}

$("split").addEventListener("change", () => tasks().catch((error) => say(error.message, true)));

// ---- watching the run: /web/status every second

function seconds(value) {
  if (value == null) return "–";
  return value < 1 ? (value * 1000).toFixed(value < 0.1 ? 1 : 0) + " ms" : value.toFixed(2) + " s";
}

function listed(counts, unit) {
  return Object.entries(counts).map(([name, n]) => n + " " + (unit ? unit[name] || name : name)).join(", ");
}

function timing(timed) {
  return timed.count + (timed.p50 == null ? "" : " · p50 " + seconds(timed.p50) + " · p95 " + seconds(timed.p95));
}

function rewards(splits) {
  const parts = Object.entries(splits).map(([split, reward]) => {
    const most = Math.max(1, ...reward.buckets.map(([, n]) => n));
    const bars = el("div", {class: "bars", role: "img", "aria-label": "rewards of " + split + " by bucket: " +
      reward.buckets.filter(([, n]) => n).map(([upper, n]) => n + " up to " + upper).join(", ")});
    for (const [upper, n] of reward.buckets) {
      const bar = el("span", {title: "up to " + upper + ": " + n});
      bar.style.height = (100 * n / most) + "%";
      bar.style.opacity = n ? 1 : 0.2;
      bars.append(bar);
    }
    return el("div", {class: "split"},
      el("div", {class: "row spread"}, el("strong", {}, split),
        el("span", {}, "mean " + reward.mean.toFixed(3) + " · " + reward.count + " scored")),
      bars, el("div", {class: "row spread axis muted"}, el("span", {}, "0"), el("span", {}, "1")));
  });
  $("rewards").replaceChildren(...(parts.length ? parts : [el("p", {class: "muted"}, "No episode scored yet.")]));
}

function show(status) {
  const played = status.episodes;
  $("served").textContent = status.bundle + " · " + status.sandbox + " sandbox · agentenv.py " + status.version;
  const outcomes = ["scored", "failed", "abandoned"].filter((outcome) => played[outcome]);
  $("played").textContent = played.played + (outcomes.length ? " (" + outcomes.map((o) => played[o] + " " + o).join(", ") + ")" : "") +
    (played.forfeited ? "; " + played.forfeited + " of the scored forfeited" : "");
  $("live").textContent = played.live + " of " + played.limit;
  $("live-meter").max = played.limit;
  $("live-meter").value = played.live;
  $("waiting").textContent = played.waiting;
  $("sessions").textContent = listed(status.sessions, {openenv: "OpenEnv", gym: "NeMo Gym"});
  $("masked").textContent = listed(status.masked) || "none";
  $("deploys").textContent = timing(status.deploys) + (status.deploys.failed ? " · " + status.deploys.failed + " failed" : "");
  $("tool-calls").textContent = timing(status.tool_calls);
  $("envs").textContent = status.nodes.reduce((sum, node) => sum + node.envs, 0);
  $("warm").textContent = status.warm ? status.warm.ready + " ready, " + status.warm.booting + " booting, of " + status.warm.target : "none kept";
  rewards(status.rewards);
  const nodes = status.nodes.filter((node) => node.node);      // Ray's nodes; "" is this machine
  $("nodes-part").hidden = !nodes.length;
  $("nodes").replaceChildren(el("tr", {}, el("th", {}, "node"), el("th", {}, "envs up"), el("th", {}, "deployed")),
    ...nodes.map((node) => el("tr", {}, el("td", {}, node.node), el("td", {}, node.envs), el("td", {}, node.deploys))));
}

async function watch() {
  try {
    show(await api("/web/status"));
    $("updated").textContent = "Updated " + new Date().toLocaleTimeString() + "; every second.";
  } catch (error) {
    $("updated").textContent = "The status did not come: " + error.message;
  }
  setTimeout(watch, 1000);
}

settle();
splits().catch((error) => say(error.message, true));
watch();
}
"""  # noqa: E501 - the page's own CSS or JavaScript, served as written

WEB_PAGE = _document(
    "agentenv.py",
    r"""<header><h1>agentenv.py</h1><span id="served"></span></header>
<main>
<section aria-labelledby="play-title">
  <h2 id="play-title">Play by hand</h2>
  <form id="pick" class="row">
    <label for="split">Split</label><select id="split"></select>
    <label for="task">Task</label><select id="task"></select>
    <button id="start">Start</button>
  </form>
  <p id="phase" class="muted" role="status">Start a task to play it as a model would: its envs are deployed for you, and its verifiers score what you did.</p>
  <div id="episode" hidden>
    <h3>System prompt</h3>
    <pre id="system-prompt" class="prompt"></pre>
    <h3>Transcript</h3>
    <ol id="transcript" class="log" aria-label="Transcript"></ol>
    <div id="turn">
      <h3>Tools</h3>
      <p class="hint">An argument left empty is not sent; arrays and objects are written as JSON.</p>
      <div id="tools" class="tools"></div>
      <form id="reply-form">
        <h3><label for="reply">Reply</label></h3>
        <textarea id="reply" rows="3" placeholder="The turn's final message, as the model's reply"></textarea>
        <div class="row"><button>End turn</button></div>
      </form>
    </div>
    <section id="outcome" aria-label="Outcome" aria-live="polite" hidden></section>
  </div>
</section>
<section aria-labelledby="run-title">
  <h2 id="run-title">Run</h2>
  <dl>
    <dt>Episodes played</dt><dd id="played">–</dd>
    <dt>Live</dt><dd><span id="live">–</span><meter id="live-meter" min="0" max="1" value="0" aria-label="Live episodes against the limit"></meter></dd>
    <dt>Waiting</dt><dd id="waiting">–</dd>
    <dt>Sessions</dt><dd id="sessions">–</dd>
    <dt>Masked</dt><dd id="masked">–</dd>
    <dt>Deploys</dt><dd id="deploys">–</dd>
    <dt>Tool calls</dt><dd id="tool-calls">–</dd>
    <dt>Envs up</dt><dd id="envs">–</dd>
    <dt>Warm envs</dt><dd id="warm">–</dd>
  </dl>
  <h3>Reward by split</h3>
  <div id="rewards"></div>
  <div id="nodes-part" hidden>
    <h3>Envs by node</h3>
    <table id="nodes" aria-label="Envs by node"></table>
  </div>
  <p id="updated" class="hint"></p>
</section>
</main>
""",  # noqa: E501 - the page's own HTML, served as written
    WEB_SCRIPT,
)

# Both documents run only their own script and style, reach only their own origin (fetches and
# /ws), and can't be framed; the form's document is written over with the page, so one policy
# lets both scripts run.
WEB_HEADERS = {
    "Content-Security-Policy": (
        f"default-src 'none'; script-src {_csp_source(WEB_LOCKED_SCRIPT)} "
        f"{_csp_source(WEB_SCRIPT)}; "
        f"style-src {_csp_source(WEB_STYLE)}; connect-src 'self'; img-src data:; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


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
                problems.append(
                    f"toolset {toolset}: the tool {name!r} is not one path segment, and "
                    "Gym calls a tool at the route of its name; rename it in the env "
                    "(letters, digits, _ . ~ -)"
                )
            elif name in RESERVED_NAMES or name == "end_turn":
                problems.append(
                    f"toolset {toolset}: the tool {name!r} has the name of one of the "
                    "resources server's own routes, which Gym would call instead; rename "
                    "it in the env"
                )
    if problems:
        raise AgentEnvError("the rows can't be written:\n  - " + "\n  - ".join(problems))


def function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as a Responses function tool."""
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description") or "",
        "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
        "strict": False,
    }


async def _toolsets_here(
    bundle: Bundle,
    settings: Settings,
    out: Callable[[str], None] | None = None,
    runtime: Runtime | None = None,
    who: str = "write-gym",
) -> dict[str, list[dict[str, Any]]]:
    """The tools each toolset's first turn offers (one probe episode each, as far as that turn,
    cached by the runtime), on ``runtime`` when given, else on a runtime of its own, in the
    sandbox ``settings`` name; saying how far it has got."""
    toolsets: dict[str, list[dict[str, Any]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        if runtime is None:
            runtime = await stack.enter_async_context(Runtime(bundle, settings))
        progress = Progress(f"{who}: listing each toolset's tools", len(bundle.toolsets), out)
        for toolset, tasks in bundle.toolsets.items():
            started = time.monotonic()
            toolsets[toolset.name] = await runtime.toolset_tools(toolset, "the tools were listed")
            progress.step(
                f"{toolset.name}: deployed {tasks[0].name} in {time.monotonic() - started:.2f}s"
            )
    return toolsets


async def _catalog_there(
    url: str,
    out: Callable[[str], None] | None = None,
    who: str = "write-gym",
) -> tuple[str, dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """A running server's bundle name, its splits' task rows, and the tools of each toolset (one
    task of each played there as far as its first turn, saying how far it has got)."""
    async with aiohttp.ClientSession(headers=client_headers()) as http:
        env, rows = await _rows_there(http, url)
        toolsets: dict[str, list[dict[str, Any]]] = {}
        progress = Progress(
            f"{who}: listing each toolset's tools at {url}",
            len({row.get("toolset", "(all)") for row in rows["all"]}),
            out,
        )
        for row in rows["all"]:
            key = row.get("toolset", "(all)")
            if key in toolsets:
                continue
            client = OpenEnvClient(http, url, Settings.reset_timeout)
            started = time.monotonic()
            try:
                if row["index"] == 0:  # what a session lists before any reset: no episode
                    toolsets[key] = await client.offered()
                else:
                    await client.reset("all", row["index"])
                    toolsets[key] = await client.list_tools()
            except EpisodeFailed as exc:
                raise AgentEnvError(
                    f"the server at {url} could not play {row['name']}: {exc}"
                ) from None
            finally:
                await client.close()
            progress.step(f"{key}: played {row['name']} in {time.monotonic() - started:.2f}s")
    return env, rows, toolsets


async def _rows_there(
    http: aiohttp.ClientSession,
    url: str,
) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """A running server's bundle name and its splits' task rows, from its task API."""
    base = url.rstrip("/")
    env = await environment_at(http, url)
    async with http.get(f"{base}/{env}/splits") as resp:
        splits = [s["name"] for s in await resp.json()]
    rows = {}
    for split in splits:
        async with http.post(f"{base}/{env}/tasks", json={"split": split}) as resp:
            rows[split] = (await resp.json())["tasks"]
    return env, rows


def _bundle_rows(bundle: Bundle) -> dict[str, list[dict[str, Any]]]:
    return {
        split: [task_row(task, i) for i, task in enumerate(tasks)]
        for split, tasks in bundle.splits.items()
    }


async def write_gym(
    source: str,
    gym_root: str,
    settings: Settings = Settings(),
    *,
    reward: str | None = None,
    keep_prompts: bool = False,
    out: Callable[[str], None] = print,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write ``GYM_ROOT/resources_servers/<name>/``: app.py, a copy of agentenv.py, the venv's
    pyproject.toml, configs/<name>.yaml and data/<split>.jsonl for every split. What it wrote goes
    to ``out``; how far its deploys have got to ``progress`` (stderr by default). From a bundle,
    the config carries its sandbox and the settings (a provider's options where they were given),
    and the deploys that list the tools run in that sandbox too."""
    remote = source.startswith(("http://", "https://"))
    options_apart(settings, remote)
    if remote:
        bundle_name, rows, toolsets = await _catalog_there(source, progress)
        where: dict[str, Any] = {"url": source}
    else:
        bundle = Bundle.load(source, reward)
        bundle_name, rows = bundle.name, _bundle_rows(bundle)
        _writable(gym_root, gym_name(bundle_name))  # refused before a deploy, if it is not
        toolsets = await _toolsets_here(bundle, settings, progress)
        where = {
            "bundle": str(bundle.root),
            "sandbox": settings.sandbox,
            **({"reward": reward} if reward else {}),
        }
    check_tool_names(toolsets)
    name = gym_name(bundle_name)
    target = _writable(gym_root, name)
    kept = _prompts_in(target / "data") if keep_prompts else {}
    files = _server_files(name, bundle_name, {**where, **settings.gym_config(bundle=not remote)})
    for split, split_rows in rows.items():
        if not plain_name(split):
            raise AgentEnvError(
                f"the split {split!r} cannot name a file of rows (data/<split>.jsonl) "
                "inside the server's folder; a split is named after its eval file, "
                "so rename the eval"
            )
        lines = [
            json.dumps(_gym_row(name, split, row, toolsets, kept), ensure_ascii=False)
            for row in split_rows
        ]
        files[f"data/{split}.jsonl"] = "\n".join(lines) + "\n"
    for rel, text in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text)
        partial.replace(path)  # a file is replaced whole, never left half written
    out(
        "; ".join(
            f"data/{split}.jsonl: {len(split_rows):,} row{'s' if len(split_rows) != 1 else ''}"
            for split, split_rows in rows.items()
        )
    )
    out(f"wrote {Path(gym_root) / 'resources_servers' / name}")  # last: scripts read the path
    return target


def _writable(gym_root: str, name: str) -> Path:
    """The resources server's folder, unless it holds one write-gym did not write."""
    target = Path(gym_root).expanduser().resolve() / "resources_servers" / name
    if (target / "app.py").exists() and WRITTEN_BY not in (target / "app.py").read_text():
        raise AgentEnvError(
            f"{target} holds a resources server that write-gym did not write; move "
            "it away or write into another Gym root"
        )
    return target


def _server_files(name: str, bundle_name: str, server: dict[str, Any]) -> dict[str, str]:
    """The resources server's files but its rows: app.py, agentenv.py, pyproject.toml and its Gym
    config (the server with ``server``'s keys, its simple_agent and its environment server)."""
    config = {
        name: {
            "resources_servers": {
                name: {
                    "entrypoint": "app.py",
                    "domain": "agent",
                    "description": f"{bundle_name}'s tasks, served by agentenv.py",
                    **server,
                }
            }
        },
        f"{name}_simple_agent": {
            "responses_api_agents": {
                "simple_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": name},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                }
            }
        },
        f"{name}_environment_server": {
            "environment_servers": {
                "legacy_agent": {
                    "entrypoint": "app.py",
                    "agent_server": {
                        "type": "responses_api_agents",
                        "name": f"{name}_simple_agent",
                    },
                }
            }
        },
    }
    return {
        "app.py": f'"""NeMo Gym resources server for the bundle {bundle_name}, {WRITTEN_BY}.\n\n'
        f"Gym runs it as `python app.py` in this folder; its settings are in "
        f'configs/{name}.yaml.\n"""\n\nimport agentenv\n\n'
        'if __name__ == "__main__":\n    agentenv.run_gym_server()\n',
        "agentenv.py": Path(__file__).read_text(),
        "pyproject.toml": f'[project]\nname = "{name.replace("_", "-")}-resources-server"\n'
        f'version = "{__version__}"\nrequires-python = ">=3.11"\n'
        'dependencies = ["aiohttp>=3.9", "pyyaml>=6.0", "docker>=7.0", '
        '"prometheus-client>=0.17"]\n\n'
        '[build-system]\nrequires = ["setuptools>=68"]\n'
        'build-backend = "setuptools.build_meta"\n\n'
        '[tool.setuptools]\npy-modules = ["agentenv", "app"]\n',
        f"configs/{name}.yaml": _yaml(config),
    }


def _gym_row(
    name: str,
    split: str,
    row: dict[str, Any],
    toolsets: dict[str, list[dict[str, Any]]],
    kept: dict[tuple[str, str], Any],
) -> dict[str, Any]:
    """A task's row of data/<split>.jsonl: its prompt (or the one kept) and its tools."""
    tools = [function_tool(t) for t in toolsets.get(row.get("toolset", "(all)"), [])]
    messages = [{"role": "user", "content": row["prompt"]}]
    if row.get("system_prompt"):
        messages.insert(0, {"role": "system", "content": row["system_prompt"]})
    return {
        "responses_create_params": {
            "input": kept.get((split, row["id"]), messages),
            "tools": [*tools, function_tool(END_TURN)],
        },
        "agent_ref": {"type": "responses_api_agents", "name": f"{name}_simple_agent"},
        "split": split,
        "index": row["index"],
        "task_id": row["id"],
    }


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


# ================================================================ 13. Trainers and eval

eval_log = logging.getLogger("agentenv.eval")

# The model's failures, apart from the environment's: the rollout is masked, never scored 0, and
# counted as the model's. Gym has no word for them, so they are namespaced as its vocabulary asks.
MODEL_HTTP_ERROR = "model:http_error"  # the endpoint answered an error, past the retries
MODEL_TIMEOUT = "model:timeout"  # no answer within --request-timeout, past them
MODEL_UNREACHABLE = "model:unreachable"  # no connection to the endpoint, past them
MODEL_REFUSAL = "model:refusal"  # the model refused (a refusal, a content filter)
MODEL_CONTEXT_OVERFLOW = "model:context_overflow"  # the conversation outgrew the model's context
MODEL_BAD_REPLY = "model:bad_reply"  # a reply that is not the API's shape
RETRIED_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
CONTEXT_WORDS = re.compile(
    r"context.{0,20}(length|window|limit)|too many tokens|maximum.{0,20}tokens"
    r"|prompt is too long|context_length_exceeded",
    re.I,
)
PROGRESS_EVERY = 10.0  # seconds between progress lines when the terminal is not a TTY
SLOWEST_SHOWN = 5


def is_model_failure(kind: str | None) -> bool:
    return bool(kind) and str(kind).startswith("model:")


class ModelFailed(AgentEnvError):
    """The model's endpoint failed a rollout (past its retries): the rollout is the model's
    failure."""

    def __init__(self, kind: str, reason: str):
        self.failure = Failure(kind, reason)
        super().__init__(reason)


@dataclasses.dataclass
class ModelReply:
    """One answer of the model, as Responses items whichever API it spoke."""

    response: dict[str, Any]  # the Responses object (output: this call's items)
    seconds: float  # the request's time, its retries included

    @property
    def output(self) -> list[dict[str, Any]]:
        output = self.response.get("output")
        return (
            [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []
        )


class ModelEndpoint:
    """An OpenAI-compatible endpoint (vLLM, SGLang, a hosted API), spoken to as Chat Completions or
    Responses; either way a reply comes back as Responses items, as NeMo Gym's model servers hand
    them to simple_agent. A request that meets a 429, a 5xx or the timeout is retried with
    backoff, a bounded number of times; then ModelFailed says what the endpoint did."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        model: str,
        api: str,
        settings: Settings,
        api_key: str | None = None,
        sampling: dict[str, Any] | None = None,
    ):
        self.http, self.url, self.model, self.api = http, url.rstrip("/"), model, api
        self.settings, self.retries = settings, settings.model_retries
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.sampling = sampling or {}  # temperature, max_tokens: None leaves the row's
        self.answered = False  # the endpoint answered a request at least once

    async def detect(self) -> str:
        """Which API to speak when none was named: Responses where the endpoint has the route, else
        Chat Completions. An empty body costs no generation: a server with the route refuses it
        (400 or 422), one without answers 404 or 405."""
        try:
            async with self.http.post(
                f"{self.url}/responses",
                json={},
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=30),
            ) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise AgentEnvError(
                f"the model's endpoint {self.url} did not answer ({type(exc).__name__}: "
                f"{exc}); check --model-url (it ends in /v1, as "
                "http://127.0.0.1:8001/v1) and that the server runs"
            ) from None
        if status in (401, 403):
            raise AgentEnvError(
                f"the model's endpoint {self.url} refused the key ({status}); set "
                "the variable --api-key-env names to a key it takes"
            )
        self.api = "chat" if status in (404, 405) else "responses"
        return self.api

    async def reply(self, params: dict[str, Any], conversation: list[dict[str, Any]]) -> ModelReply:
        """The model's next reply to a row's ``responses_create_params`` with ``conversation``
        (the row's input and every item since) as its input."""
        if self.api == "responses":
            body = {
                **{k: v for k, v in params.items() if v is not None},
                "input": conversation,
                "model": self.model,
            }
            if self.sampling.get("temperature") is not None:
                body["temperature"] = self.sampling["temperature"]
            if self.sampling.get("max_tokens") is not None:
                body["max_output_tokens"] = self.sampling["max_tokens"]
            answer, seconds = await self._post("/responses", body)
            return ModelReply(self._checked(answer), seconds)
        body = chat_request(params, conversation, self.model, self.sampling)
        answer, seconds = await self._post("/chat/completions", body)
        return ModelReply(responses_of_chat(answer, params), seconds)

    def _checked(self, answer: Any) -> dict[str, Any]:
        if not isinstance(answer, dict) or not isinstance(answer.get("output"), list):
            raise ModelFailed(
                MODEL_BAD_REPLY,
                f"the endpoint's reply is not a Responses object "
                f"(no output list): {short(json.dumps(answer), 300)}",
            )
        for item in answer["output"]:
            for part in (item.get("content") or []) if isinstance(item, dict) else []:
                if isinstance(part, dict) and part.get("type") == "refusal":
                    raise ModelFailed(
                        MODEL_REFUSAL, f"the model refused: {short(str(part.get('refusal')), 300)}"
                    )
        return answer

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[Any, float]:
        """POST with the retries; the JSON answer and the seconds it took, waits included."""
        started, delay = time.monotonic(), 1.0
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                async with self.http.post(
                    self.url + path,
                    json=body,
                    headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout),
                ) as resp:
                    text = await resp.text(errors="replace")
                    self.answered = True
                    if resp.status == 200:
                        try:
                            return json.loads(text), time.monotonic() - started
                        except ValueError:
                            raise ModelFailed(
                                MODEL_BAD_REPLY,
                                f"the endpoint answered {path} with no JSON: {short(text, 300)}",
                            ) from None
                    failure = self._http_failure(path, resp.status, text)
                    if resp.status not in RETRIED_STATUSES or last:
                        raise ModelFailed(
                            failure.kind,
                            failure.reason + (f", after {attempt + 1} tries" if attempt else ""),
                        )
                    wait = _retry_after(resp.headers.get("Retry-After"), delay)
            except asyncio.TimeoutError:
                if last:
                    raise ModelFailed(
                        MODEL_TIMEOUT,
                        (
                            f"the endpoint did not answer {path} within --request-timeout "
                            f"({self.settings.request_timeout:g}s), {attempt + 1} tries; raise it "
                            "for "
                            "long generations, or check the server's load"
                        ),
                    ) from None
                wait = delay
            except (aiohttp.ClientError, OSError) as exc:
                if last:
                    raise ModelFailed(
                        MODEL_UNREACHABLE,
                        (
                            f"the endpoint at {self.url} could not be reached "
                            f"({type(exc).__name__}: "
                            f"{exc}), {attempt + 1} tries; check that it still runs"
                        ),
                    ) from None
                wait = delay
            eval_log.info(
                "The model's endpoint failed a request to %s; trying again in %.1fs.", path, wait
            )
            await asyncio.sleep(wait)  # a backoff: no event says the endpoint recovered
            delay = min(delay * 2, 30.0)
        raise AssertionError("unreachable")

    @staticmethod
    def _http_failure(path: str, status: int, text: str) -> Failure:
        said = text
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            error = json.loads(text).get("error")
            said = str(error.get("message") if isinstance(error, dict) else error or text)
        if status in (400, 413) and CONTEXT_WORDS.search(said):
            return Failure(
                MODEL_CONTEXT_OVERFLOW,
                f"the conversation outgrew the model's context: "
                f"{short(said, 300)}; raise the server's "
                "--max-model-len, or lower --max-steps",
            )
        return Failure(
            MODEL_HTTP_ERROR, f"the endpoint answered {path} with {status}: {short(said, 300)}"
        )


def _retry_after(header: str | None, default: float) -> float:
    """The wait a 429 or 503 asks for (Retry-After in seconds), at most a minute; else
    ``default``."""
    with contextlib.suppress(TypeError, ValueError):
        return min(max(float(header), 0.0), 60.0)  # type: ignore[arg-type]
    return default


def chat_request(
    params: dict[str, Any], conversation: list[dict[str, Any]], model: str, sampling: dict[str, Any]
) -> dict[str, Any]:
    """A Chat Completions body for a row's Responses params and the conversation so far."""
    body: dict[str, Any] = {"model": model, "messages": chat_messages(conversation, params)}
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object"},
            },
        }
        for t in params.get("tools") or []
        if isinstance(t, dict) and t.get("type") == "function"
    ]
    if tools:
        body["tools"] = tools
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_tokens"),
        ("metadata", "metadata"),
        ("tool_choice", "tool_choice"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ):
        if params.get(ours) is not None and (
            ours != "tool_choice" or isinstance(params[ours], str)
        ):
            body[theirs] = params[ours]
    for key in ("temperature", "max_tokens"):
        if sampling.get(key) is not None:
            body[key] = sampling[key]
    return body


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content or [] if isinstance(p, dict))


def chat_messages(items: list[dict[str, Any]], params: dict[str, Any]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: a message as itself, the function calls of one reply
    as one assistant message's tool_calls, a function call's output as a tool message."""
    messages: list[dict[str, Any]] = []
    if params.get("instructions"):
        messages.append({"role": "system", "content": str(params["instructions"])})
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            messages.append({"role": role, "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last.setdefault("content", None)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": str(item.get("output", "")),
                }
            )
        # reasoning items stay out: a chat endpoint takes no reasoning back
    return messages


def responses_of_chat(answer: Any, params: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completions answer as the Responses object NeMo Gym's model servers would make of
    it."""
    try:
        choice = answer["choices"][0]
        message = choice["message"]
        assert isinstance(message, dict)
    except (KeyError, IndexError, TypeError, AssertionError):
        raise ModelFailed(
            MODEL_BAD_REPLY,
            "the endpoint's reply is not a chat completion (no "
            f"choices[0].message): {short(json.dumps(answer), 300)}",
        ) from None
    reason = choice.get("finish_reason")
    if message.get("refusal") or reason == "content_filter":
        raise ModelFailed(
            MODEL_REFUSAL,
            "the model refused: "
            + short(
                str(message.get("refusal") or "its reply was stopped by the content filter"), 300
            ),
        )
    rid = str(answer.get("id") or "chatcmpl")
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{rid}",
                "summary": [{"type": "summary_text", "text": str(message["reasoning_content"])}],
            }
        )
    if message.get("content"):
        output.append(
            {
                "type": "message",
                "id": f"msg_{rid}",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": str(message["content"]), "annotations": []}
                ],
            }
        )
    for n, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {} if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{rid}_{n}",
                "call_id": str(call.get("id") or f"call_{rid}_{n}"),
                "name": str(function.get("name", "")),
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                "status": "completed",
            }
        )
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else None
    return {
        "id": rid,
        "object": "response",
        "created_at": answer.get("created") or 0,
        "model": answer.get("model"),
        "status": "incomplete" if reason == "length" else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": params.get("tools") or [],
        "usage": None
        if usage is None
        else {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                or 0
            },
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {
                "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get(
                    "reasoning_tokens", 0
                )
                or 0
            },
            "total_tokens": usage.get("total_tokens", 0),
        },
    }


def add_usage(total: dict[str, Any] | None, more: Any) -> dict[str, Any] | None:
    """Usage summed over a rollout's model calls, as simple_agent sums it."""
    if not isinstance(more, dict):
        return total
    total = copy.deepcopy(total) if total else {}
    for key, value in more.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            total[key] = total.get(key, 0) + value
        elif isinstance(value, dict):
            total[key] = add_usage(total.get(key), value)
    return total


class GymRoutes:
    """The Gym surface's routes as simple_agent calls them: the row to /seed_session with no
    cookie; its cookies with each tool call (the JSON arguments POSTed to the tool's route, the
    answer's text whatever its status) and with /verify; /close_session for a rollout left
    unverified."""

    def __init__(self, http: aiohttp.ClientSession, url: str):
        self.http, self.url = http, url.rstrip("/")
        self.headers = client_headers()

    async def _post(
        self, route: str, body: Any, cookies: dict[str, str]
    ) -> tuple[int, str, dict[str, str]]:
        headers = dict(self.headers)
        if cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
        try:
            async with self.http.post(self.url + route, json=body, headers=headers) as resp:
                text = await resp.text(errors="replace")
                return resp.status, text, {k: m.value for k, m in resp.cookies.items()}
        except (aiohttp.ClientError, OSError) as exc:
            raise EpisodeFailed(
                f"the environment's server at {self.url} went away ({type(exc).__name__}: "
                f"{exc}); check that it still runs",
                SESSION_LOST,
            ) from None

    async def seed(self, row: dict[str, Any]) -> dict[str, str]:
        status, text, cookies = await self._post("/seed_session", row, {})
        if status != 200:
            raise EpisodeFailed(f"/seed_session answered {status}: {short(text, 500)}")
        return cookies

    async def call(self, name: str, arguments: Any, cookies: dict[str, str]) -> str:
        _, text, more = await self._post(f"/{name}", arguments, cookies)
        cookies.update(more)
        return text

    async def verify(self, body: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        status, text, _ = await self._post("/verify", body, cookies)
        try:
            verdict = json.loads(text) if status == 200 else None
        except ValueError:
            verdict = None
        if not isinstance(verdict, dict):
            raise EpisodeFailed(f"/verify answered {status}: {short(text, 500)}")
        return verdict

    async def close(self, cookies: dict[str, str]) -> None:
        with contextlib.suppress(AgentEnvError):
            await self._post("/close_session", {}, cookies)


@dataclasses.dataclass(frozen=True)
class Planned:
    """One rollout to play: a row, its place in the split's rows, and which repeat it is."""

    row: dict[str, Any]
    task_index: int
    repeat: int

    @property
    def key(self) -> tuple[str, str, int]:
        return rollout_key(self.row, self.repeat)


def rollout_key(row: dict[str, Any], repeat: Any) -> tuple[str, str, int]:
    """What names a rollout in rollouts.jsonl, to skip it on a resumed run."""
    return (
        str(row.get("split")),
        str(row.get("task_id")),
        int(repeat) if isinstance(repeat, int) else -1,
    )


class Player:
    """Plays a row as NeMo Gym's simple_agent plays it: seed; call the model with the row's input
    and every item since; run each of its function calls in order, handing the answers back
    (arguments that are not JSON get simple_agent's own error text, and no call is made); stop at
    a reply that calls no tool, at end_turn's last answer, at a cut-off reply or at max_steps;
    verify. Its answer is the rollout's line of rollouts.jsonl."""

    def __init__(self, model: ModelEndpoint, routes: GymRoutes, max_steps: int):
        self.model, self.routes, self.max_steps = model, routes, max_steps

    async def play(self, planned: Planned) -> dict[str, Any]:
        row = {
            **planned.row,
            "_ng_task_index": planned.task_index,
            "_ng_rollout_index": planned.repeat,
        }
        params = row["responses_create_params"]
        started = time.monotonic()
        model_seconds, calls, usage, stop = 0.0, 0, None, "reply"
        conversation = list(params.get("input") or [])
        if isinstance(params.get("input"), str):
            conversation = [{"role": "user", "content": params["input"]}]
        outputs: list[dict[str, Any]] = []
        response: dict[str, Any] = {}
        cookies: dict[str, str] = {}
        seeded = False
        try:
            cookies = await self.routes.seed(row)
            seeded = True
            while True:
                reply = await self.model.reply(params, conversation + outputs)
                calls += 1
                model_seconds += reply.seconds
                response = reply.response
                usage = add_usage(usage, response.get("usage"))
                outputs += reply.output
                if response.get("incomplete_details"):
                    stop = "length"
                    break
                function_calls = [i for i in reply.output if i.get("type") == "function_call"]
                if not function_calls:
                    stop = (
                        "reply"
                        if any(i.get("type") == "message" for i in reply.output)
                        else "empty"
                    )
                    break
                over = False
                for call in function_calls:
                    try:
                        # (a call with no arguments is refused as simple_agent refuses it)
                        arguments = json.loads(cast(str, call.get("arguments")))
                    except (ValueError, TypeError) as exc:
                        text = json.dumps({"error": f"Invalid tool call arguments: {exc!r}"})
                    else:
                        text = await self.routes.call(str(call.get("name")), arguments, cookies)
                        over = over or (call.get("name") == "end_turn" and text == EPISODE_OVER)
                    outputs.append(
                        {
                            "type": "function_call_output",
                            "call_id": call.get("call_id"),
                            "output": text,
                        }
                    )
                if over:
                    stop = "end_turn"
                    break
                if self.max_steps and calls >= self.max_steps:
                    stop = "max_steps"
                    break
            final = {**response, "output": outputs, "usage": usage}
            line = await self.routes.verify({**row, "response": final}, cookies)
            line.update({k: v for k, v in row.items() if k.startswith("_ng_")})
        except Exception as exc:  # noqa: BLE001 - each kind is told below
            if seeded:
                await self.routes.close(cookies)
            if isinstance(exc, ModelFailed):
                failure = exc.failure
            elif isinstance(exc, EpisodeFailed):
                failure = exc.failure.told("the environment failed: ")
            else:  # a bug of ours: that rollout alone fails
                eval_log.exception("Playing a rollout failed unexpectedly.")
                failure = Failure(
                    INTERNAL_ERROR, f"agentenv.py failed: {type(exc).__name__}: {exc}"
                )
            # masked as the Gym surface masks a rollout the environment failed (NeMo RL reads
            # instance_config too), never scored 0
            line = masked(
                {**row, "response": {**response, "output": outputs, "usage": usage}},
                failure,
                quiet=True,
            )
            stop = (
                "model_failed"
                if isinstance(exc, ModelFailed)
                else "env_failed"
                if isinstance(exc, EpisodeFailed)
                else "internal_error"
            )
        seconds = time.monotonic() - started
        line.update(
            {
                "model": self.model.model,
                "api": self.model.api,
                "model_calls": calls,
                "stop_reason": stop,
                "timings": {
                    "seconds": round(seconds, 4),
                    "model_seconds": round(model_seconds, 4),
                    "env_seconds": round(max(seconds - model_seconds, 0.0), 4),
                },
            }
        )
        return line


class RolloutsFile:
    """rollouts.jsonl: one line per rollout, appended whole as it finishes (a killed run loses
    nothing done); read back on a rerun, so the rollouts it holds are not played again. A rollout
    the model failed is played again: its line is dropped first."""

    def __init__(self, path: Path, model: str):
        self.path, self.model = path, model
        self.lines: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.retried = 0
        self._fd: int | None = None

    def open(self) -> None:
        kept, torn = [], False
        if self.path.exists():
            raw = self.path.read_bytes()
            torn = bool(raw) and not raw.endswith(b"\n")
            texts = raw.decode("utf-8", "replace").splitlines()
            for n, text in enumerate(texts, 1):
                try:
                    line = json.loads(text)
                    key = rollout_key(line, line["_ng_rollout_index"])
                except (ValueError, KeyError, TypeError):
                    if n == len(texts) and torn:
                        continue  # the half line a killed run left: played again
                    raise AgentEnvError(
                        f"{self.path} line {n} is not a rollout of eval; pass another "
                        "--output, or move the file away"
                    ) from None
                if line.get("model") not in (None, self.model):
                    raise AgentEnvError(
                        f"{self.path} holds rollouts of the model {line.get('model')!r}, "
                        f"not {self.model!r}; pass another --output to measure this one"
                    )
                if is_model_failure(line.get("failure_kind")):
                    self.retried += 1
                    continue
                self.lines[key] = line
                kept.append(text)
            if torn or self.retried:  # rewritten whole, never left half written
                partial = self.path.with_name(self.path.name + ".partial")
                partial.write_text("".join(t + "\n" for t in kept))
                partial.replace(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def add(self, line: dict[str, Any]) -> None:
        assert self._fd is not None
        self.lines[rollout_key(line, line.get("_ng_rollout_index"))] = line
        os.write(self._fd, (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8", "replace"))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class EvalProgress:
    """eval's live progress line: done/total, rate, ETA, mean reward and masked so far (more than
    Progress, section 1, says for a plain job). On a TTY it is
    rewritten in place; elsewhere it is a line every PROGRESS_EVERY seconds, and at the end."""

    def __init__(self, total: int, stream: Any = None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.done, self.masked, self.model_failed = total, 0, 0, 0
        self.rewards: list[float] = []
        self.started = self.shown = time.monotonic()

    def add(self, line: dict[str, Any]) -> None:
        self.done += 1
        if is_model_failure(line.get("failure_kind")):
            self.model_failed += 1
        elif line.get("mask_sample"):
            self.masked += 1
        else:
            self.rewards.append(float(line.get("reward") or 0.0))
        if self.tty or time.monotonic() - self.shown >= PROGRESS_EVERY:
            self.show()

    def text(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else float("nan")
        mean = f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "-"
        return (
            f"eval: {self.done}/{self.total} rollouts, {rate:.2f}/s, ETA {_duration(eta)}, "
            f"mean reward {mean}, masked {self.masked}, model failures {self.model_failed}"
        )

    def show(self, final: bool = False) -> None:
        self.shown = time.monotonic()
        if self.tty:
            self.stream.write("\r\x1b[K" + self.text() + ("\n" if final else ""))
        else:
            self.stream.write(self.text() + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
        if seconds >= 60
        else f"{seconds}s"
    )


def mean_interval(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% interval (normal approximation; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, 1.96 * math.sqrt(var / n)


def summary(lines: list[dict[str, Any]], repeats: int) -> list[str]:
    """What eval prints at the end: the mean reward with its 95% interval, by split (and, with
    repeats, pass@k and mean@k), the masked rollouts by failure kind, the model's failures apart,
    and the slowest tasks."""
    out = [f"{len(lines)} rollouts"]
    splits = sorted({str(line.get("split")) for line in lines})
    for split in splits:
        mine = [line for line in lines if str(line.get("split")) == split]
        scored = [float(line["reward"]) for line in mine if not line.get("mask_sample")]
        if not scored:
            out.append(f"split {split}: no rollout was scored ({len(mine)} played)")
            continue
        mean, half = mean_interval(scored)
        out.append(
            f"split {split}: mean reward {mean:.3f} ± {half:.3f} (95% interval), "
            f"{len(scored)} scored of {len(mine)}"
        )
        if repeats > 1:
            by_task: dict[str, list[float]] = collections.defaultdict(list)
            for line in mine:
                if not line.get("mask_sample"):
                    by_task[str(line.get("task_id"))].append(float(line["reward"]))
            full = [r for r in by_task.values() if len(r) == repeats]
            if full:
                best = mean_interval([max(r) for r in full])
                avg = mean_interval([sum(r) / len(r) for r in full])
                out.append(
                    f"  over {repeats} repeats of {len(full)} tasks: pass@{repeats} "
                    f"{best[0]:.3f} ± {best[1]:.3f} (a task's best reward), mean@{repeats} "
                    f"{avg[0]:.3f} ± {avg[1]:.3f}"
                )
    env = collections.Counter(
        str(line.get("failure_kind"))
        for line in lines
        if line.get("mask_sample") and not is_model_failure(line.get("failure_kind"))
    )
    model = collections.Counter(
        str(line.get("failure_kind"))
        for line in lines
        if is_model_failure(line.get("failure_kind"))
    )
    out.append(
        "masked by the environment: "
        + (", ".join(f"{k} {v}" for k, v in env.most_common()) or "none")
    )
    out.append(
        "the model's failures: " + (", ".join(f"{k} {v}" for k, v in model.most_common()) or "none")
    )
    timed = sorted(lines, key=lambda line: -float((line.get("timings") or {}).get("seconds") or 0))
    if timed:
        slowest = []
        for line in timed[:SLOWEST_SHOWN]:
            name = str(line.get("task_id")).rsplit("/", 1)[-1]
            repeat = f" #{line.get('_ng_rollout_index')}" if repeats > 1 else ""
            slowest.append(
                f"{name}{repeat} {float((line.get('timings') or {}).get('seconds') or 0):.1f}s"
            )
        out.append("slowest: " + ", ".join(slowest))
    return out


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """What one ``eval`` measures: the source, the model, and how to play its rows."""

    source: str
    model_url: str
    model: str
    api: str = "auto"  # chat, responses, or auto: what the endpoint answers
    splits: tuple[str, ...] = ("eval",)
    limit: int | None = None
    repeats: int = 1
    temperature: float | None = None
    max_tokens: int | None = None
    api_key_env: str = "OPENAI_API_KEY"
    output: str = "rollouts.jsonl"
    reward: str | None = None
    settings: Settings = Settings()  # the sandbox, the pool, the deadlines, the concurrency, ...


@dataclasses.dataclass(frozen=True)
class Served:
    """What a trainer plays: a running serve's URL, and the bundle it serves: its name, its
    splits' task rows (as the task API gives them), and the tools each toolset's turns offer."""

    url: str
    bundle: str
    rows: dict[str, list[dict[str, Any]]]
    toolsets: dict[str, list[dict[str, Any]]]  # by toolset name; end_turn not among them


@contextlib.asynccontextmanager
async def served(
    source: str,
    settings: Settings,
    *,
    reward: str | None = None,
    knob: str,
    who: str,
    out: Callable[[str], None] | None = None,
) -> AsyncIterator[Served]:
    """A running serve's URL and what it serves: ``source`` itself when it is a URL, else the
    bundle at ``source`` served in-process on a loopback port (one pool, as ``serve``), torn down
    when the block ends. ``knob`` is what raises its pool; ``who`` says who lists the tools."""
    from aiohttp import web

    if source.startswith(("http://", "https://")):
        yield Served(source, *await _catalog_there(source, out, who))
        return
    server = _server(
        source, reward=reward, token=None, settings=settings, host="127.0.0.1", port=0, knob=knob
    )
    runner = web.AppRunner(server.app, access_log=None, shutdown_timeout=30)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]  # (host, port) of the one site, bound
        assert server.runtime is not None
        bundle = server.runtime.bundle
        toolsets = await _toolsets_here(bundle, settings, out, runtime=server.runtime, who=who)
        yield Served(f"http://127.0.0.1:{port}", bundle.name, _bundle_rows(bundle), toolsets)
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def surface_for(
    source: str, plan: EvalPlan
) -> AsyncIterator[tuple[str, dict[str, list[dict[str, Any]]]]]:
    """The Gym surface's URL and the rows write-gym writes, for a bundle (served in-process, one
    pool as ``serve``) or a running serve's URL."""
    async with served(
        source, plan.settings, reward=plan.reward, knob="--max-concurrent-envs", who="eval"
    ) as there:
        check_tool_names(there.toolsets)
        name = gym_name(there.bundle)
        yield (
            there.url,
            {
                split: [_gym_row(name, split, row, there.toolsets, {}) for row in rows]
                for split, rows in there.rows.items()
            },
        )


async def evaluate(
    plan: EvalPlan, out: Callable[[str], None] = print, stream: Any = None
) -> list[dict[str, Any]]:
    """Play the plan's rows against the model, write each rollout to the output as it finishes,
    and print the summary; the rollouts of the plan (those already in the output too)."""
    api_key = os.environ.get(plan.api_key_env) or None
    # SIGTERM stops eval as SIGINT does: the episodes live end, their envs are torn down
    with contextlib.suppress(NotImplementedError, RuntimeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, current_task().cancel)
    file = RolloutsFile(Path(plan.output).expanduser(), plan.model)
    file.open()
    timeout = aiohttp.ClientTimeout(total=None)
    try:
        async with aiohttp.ClientSession(
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0),
        ) as http:
            sampling = {"temperature": plan.temperature, "max_tokens": plan.max_tokens}
            model = ModelEndpoint(
                http, plan.model_url, plan.model, plan.api, plan.settings, api_key, sampling
            )
            if plan.api == "auto":
                await model.detect()
                out(
                    f"eval: the endpoint {plan.model_url} answers the Responses API, so eval "
                    "speaks it "
                    "(--api chat for Chat Completions)"
                    if model.api == "responses"
                    else f"eval: the endpoint {plan.model_url} has no Responses API, so eval "
                    "speaks Chat Completions"
                )
            async with surface_for(plan.source, plan) as (url, rows):
                missing = [s for s in plan.splits if s not in rows]
                if missing:
                    raise AgentEnvError(
                        f"there is no split {', '.join(map(repr, missing))}: the splits are "
                        f"{', '.join(rows)}; pass one with --split"
                    )
                planned = [
                    Planned(row, i, k)
                    for split in plan.splits
                    for i, row in enumerate(rows[split][: plan.limit])
                    for k in range(plan.repeats)
                ]
                todo = [p for p in planned if p.key not in file.lines]
                out(
                    f"eval: {len(planned)} rollouts ({', '.join(plan.splits)}: "
                    f"{len(planned) // plan.repeats} rows x {plan.repeats}) of {plan.source} "
                    "against "
                    f"{plan.model} over "
                    f"{'Chat Completions' if model.api == 'chat' else 'Responses'}, "
                    f"{plan.settings.eval_concurrency} at once, into {plan.output}"
                )
                if len(todo) < len(planned) or file.retried:
                    out(
                        f"eval: {plan.output} holds {len(planned) - len(todo)} of these rollouts, "
                        "so "
                        f"{len(todo)} are left to play"
                        + (
                            f" ({file.retried} the model failed, played again)"
                            if file.retried
                            else ""
                        )
                    )
                await play_all(
                    Player(model, GymRoutes(http, url), plan.settings.max_steps),
                    todo,
                    file,
                    plan.settings.eval_concurrency,
                    stream,
                )
    finally:
        file.close()
    done = [file.lines[p.key] for p in planned if p.key in file.lines]
    for text in summary(done, plan.repeats):
        out(text)
    if todo and not model.answered:
        raise AgentEnvError(
            f"the model's endpoint {plan.model_url} never answered; check "
            "--model-url and that the server runs"
        )
    if done and all(line.get("mask_sample") for line in done):
        raise AgentEnvError(f"every rollout failed (see {plan.output}'s failure_reason)")
    return done


async def play_all(
    player: Player, todo: list[Planned], file: RolloutsFile, concurrency: int, stream: Any = None
) -> None:
    """Play the rollouts, ``concurrency`` at once, each written to the file as it finishes."""
    progress = EvalProgress(len(todo), stream)
    queue = collections.deque(todo)

    async def worker() -> None:
        while queue:
            line = await player.play(queue.popleft())
            file.add(line)
            progress.add(line)

    async def tick() -> None:  # the rate and ETA move between finishes too
        while True:
            await asyncio.sleep(1.0 if progress.tty else PROGRESS_EVERY)
            progress.show()

    ticker = asyncio.create_task(tick())
    try:
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(todo))))))
    finally:
        ticker.cancel()
    if todo:
        progress.show(final=True)


# -- TRL: a bundle as GRPOTrainer's environment_factory, its rows, and its reward

trl_log = logging.getLogger("agentenv.trl")
TRL_NAMES = ("reset", "get_reward")  # what TRL calls on an environment itself: no tool's name
TRL_CLIENT_KEYS = ("reset_timeout", "tool_timeout")  # the client's: for a URL too
TRL_KNOB = "trl_environment's max_concurrent_envs"
JSON_HINTS: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "null": type(None),
    "array": list,
    "object": dict,
}
DOCSTRING_WORDS = re.compile(r"\b(Args|Returns|Raises):")  # what ends a description in a docstring
NEUTRAL = r"\1 -"  # the same words, no longer heading a docstring's section


def type_hint(schema: Any) -> tuple[Any, dict[str, Any]]:
    """A JSON schema as the Python type hint that transformers turns back into a schema (its
    types, items, enum, unions and nulls), and the rest of the schema, which no hint carries (its
    bounds, patterns, an object's properties): a tool's docstring says that rest in JSON."""
    if not isinstance(schema, dict):
        return Any, {}
    rest = {k: v for k, v in schema.items() if k not in ("description", "title")}
    scalar = (str, int, float, bool, type(None))
    if "const" in rest and isinstance(rest["const"], scalar):
        rest.pop("type", None)
        return Literal[rest.pop("const")], rest
    if (
        isinstance(rest.get("enum"), list)
        and rest["enum"]
        and all(isinstance(v, scalar) for v in rest["enum"])
    ):
        rest.pop("type", None)
        return Literal[tuple(rest.pop("enum"))], rest
    for key in ("anyOf", "oneOf"):
        if isinstance(rest.get(key), list) and rest[key] and "type" not in rest:
            options = [type_hint(option) for option in rest[key]]
            if not any(left for _, left in options):
                rest.pop(key)
            return Union[tuple(hint for hint, _ in options)], rest
    kinds = rest.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if not kinds or not all(isinstance(k, str) and k in JSON_HINTS for k in kinds):
        return Any, rest
    rest.pop("type")
    hints = []
    for kind in kinds:
        hint = JSON_HINTS[kind]
        if kind == "array" and isinstance(rest.get("items"), dict):
            item, left = type_hint(rest.pop("items"))
            hint = types.GenericAlias(list, (item,))
            if left:
                rest["items"] = left
        elif (
            kind == "object"
            and isinstance(rest.get("additionalProperties"), dict)
            and not rest.get("properties")
        ):
            value, left = type_hint(rest.pop("additionalProperties"))
            hint = types.GenericAlias(dict, (str, value))
            if left:
                rest["additionalProperties"] = left
        hints.append(hint)
    return (hints[0] if len(hints) == 1 else Union[tuple(hints)]), rest


def trl_tool_problems(toolset: str, tools: list[dict[str, Any]]) -> list[str]:
    """Why tools of a toolset can't be methods of TRL's environment, one sentence each: a name no
    method can have, an input schema whose arguments no parameters can be, or one nested deeper
    than its type hints are built (a hint per level) and its JSON written out again."""
    problems = []
    for tool in tools:
        name = tool.get("name")
        shown = reprlib.repr(name)
        why = _not_a_name(name)
        if why is None and str(name).startswith("_"):
            why = "it starts with an underscore, and TRL offers the model no method that does"
        if why is None and name in TRL_NAMES:
            why = f"TRL calls an environment's {name}() itself, so it can't be a tool"
        if why:
            problems.append(
                f"toolset {toolset}: the tool {shown} can't be a method of TRL's "
                f"environment: {why}; rename it in the env"
            )
        schema = tool.get("input_schema") or {}
        properties = (schema.get("properties") or {}) if isinstance(schema, dict) else {}
        if (depth := nesting(schema)) > MAX_NESTING:
            problems.append(
                f"toolset {toolset}: the input schema of {shown} nests {depth} levels "
                f"of JSON deep, past the {MAX_NESTING} TRL's environment class is built "
                "from (a type hint per level); flatten it in the env, naming its parts "
                "in $defs and reaching them by $ref"
            )
        if not isinstance(properties, dict):
            problems.append(
                f"toolset {toolset}: the input schema of {shown} gives its properties "
                f"as {type(properties).__name__}, not an object of each argument's "
                "schema, so its arguments can't be a Python method's parameters; fix "
                "its schema in the env"
            )
            continue
        for argument in properties:
            if why := _not_a_name(argument):
                problems.append(
                    f"toolset {toolset}: the argument {reprlib.repr(argument)} of {shown} "
                    f"can't be a parameter of a Python method (TRL calls a tool by its "
                    f"method, and describes it from its parameters): {why}; rename it in "
                    "the env"
                )
    return problems


def _not_a_name(name: Any) -> str | None:
    import keyword

    if not isinstance(name, str) or not name.isidentifier():
        return (
            f"{reprlib.repr(name)} is not a Python identifier (letters, digits and _, not "
            "starting with a digit)"
        )
    if keyword.iskeyword(name):
        return f"{name!r} is a Python keyword"
    return None


def trl_method(tool: dict[str, Any]) -> Callable[..., str]:
    """A tool as a method of TRL's environment: its name, its description and each argument's
    (with the part of its schema no type hint carries, in JSON) as a Google-style docstring, and
    the arguments as typed keyword parameters, the optional ones defaulting to None. TRL (through
    transformers' get_json_schema) rebuilds the tool's schema from these; the server still checks
    the arguments against the whole schema, and the model reads what it refuses."""
    name = tool["name"]
    schema = tool["input_schema"] if isinstance(tool.get("input_schema"), dict) else {}
    properties = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    required = (
        {r for r in schema.get("required") or [] if isinstance(r, str)}
        if isinstance(schema.get("required"), list)
        else set()
    )
    receiver = "self"
    while receiver in properties:  # an argument called self is the tool's
        receiver = "_" + receiver
    parameters = [inspect.Parameter(receiver, inspect.Parameter.POSITIONAL_ONLY)]
    annotations: dict[str, Any] = {}
    described = []
    for argument, spec in properties.items():
        hint, rest = type_hint(spec)
        annotations[argument] = hint
        parameters.append(
            inspect.Parameter(
                argument,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=hint,
                default=inspect.Parameter.empty if argument in required else None,
            )
        )
        words = spec.get("description") if isinstance(spec, dict) else None
        said = " ".join(str(words).split()) if words else f"The {argument}."
        if rest:
            said += f" (JSON schema: {json.dumps(rest, ensure_ascii=False)})"
        described.append(f"    {argument}: {DOCSTRING_WORDS.sub(NEUTRAL, said)}")

    def call(environment: TrlEnvironment, /, **arguments: Any) -> str:
        return environment._call(name, arguments)

    description = DOCSTRING_WORDS.sub(NEUTRAL, str(tool.get("description") or f"The {name} tool."))
    call.__name__ = call.__qualname__ = name
    call.__doc__ = description + ("\n\nArgs:\n" + "\n".join(described) if described else "")
    call.__annotations__ = annotations
    call.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return call


class TrlToolError(AgentEnvError):
    """A tool call that did not run as asked (the tool's error, a refused call, an environment
    that failed): TRL gives the model its text as the call's error, and counts it as a failure."""


class TrlEnvironment:
    """One of TRL's environments, as GRPOTrainer's environment_factory makes them (one per rollout
    of a generation batch, kept for the trainer's life). ``reset(**row)`` starts the row's task on
    the server in the background, and returns at once: TRL resets its environments one at a time,
    and so their deploys overlap, each tool call waiting for its own. The class trl_environment
    builds adds a method per tool of the task's turns (end_turn among them); every other name is
    private, since TRL offers the model each public method as a tool. trl_reward scores the
    episode and closes its session."""

    _client: TrlClient
    _toolset: str

    def __init__(self) -> None:
        self._session: GymSession | None = None
        self._row: dict[str, Any] | None = None
        self._client.adopt(self)

    def reset(self, **row: Any) -> None:
        """Start playing the row's task: a row of trl_dataset (its split and index), as TRL
        passes it. The row's prompt is the task's, so TRL appends nothing to it."""
        self._client.reset(self, row)

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        result = self._client.call(self, name, arguments)
        if result.is_error:
            raise TrlToolError(result.text)
        return result.text

    def __repr__(self) -> str:
        row, session = self._row or {}, self._session
        where = f"{row.get('split')}[{row.get('index')}]" if row else "not reset"
        state = (
            ""
            if session is None
            else f", failed: {session.failure}"
            if session.failure
            else ", scored"
            if session.finished
            else ", playing"
        )
        return f"<{type(self).__name__} {where}{state}>"


class TrlClient:
    """What the environments of one trl_environment share: an event loop on a thread of its own
    (TRL calls its environments from plain code), one HTTP client of the running serve (or of the
    bundle served in-process), each environment's Gym session (a rollout as NeMo Gym plays it,
    over /ws), and what TRL's batch has taught it about the server's capacity.

    Every session is closed by a close the server sees: once its rollout is scored, and at the
    process's exit (atexit: a crash too). A process forked from this one (a DataLoader's worker)
    lets go of its copies of the server's connections at once, so even a process killed outright
    leaves none open: its own are closed by the OS."""

    def __init__(self, source: str, settings: Settings, reward: str | None):
        self.source, self.settings, self.reward = source, settings, reward
        self.pid = os.getpid()
        self.closed = False
        self.live: set[GymSession] = set()  # sessions open on the server, or opening
        self.environments: weakref.WeakSet[TrlEnvironment] = weakref.WeakSet()
        self.warned: set[str] = set()
        self.peers: set[tuple[str, int]] = set()  # the server's addresses, for a forked child
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run_loop, name="agentenv-trl", daemon=True)
        self.thread.start()
        self._stack = contextlib.AsyncExitStack()
        try:
            self.served: Served = self.run(self._start())
        except BaseException:
            self.close()
            raise
        _TRL_CLIENTS.add(self)
        atexit.register(self.close)

    # -- the loop, and calls into it from TRL's thread

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the client's loop and wait for its result."""
        if os.getpid() != self.pid or self.closed:
            coro.close()
            raise AgentEnvError(
                "this environment was forked from the trainer's process, and its sessions stay "
                "the parent's: create environments in the process that trains"
                if os.getpid() != self.pid
                else "the environments' client has closed (the process is exiting)"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> Served:
        there = await self._stack.enter_async_context(
            served(
                self.source,
                self.settings,
                reward=self.reward,
                knob=TRL_KNOB,
                who="trl_environment",
                out=trl_log.info,
            )
        )
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),
            headers=client_headers(),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._stack.push_async_callback(self.http.close)
        parts = urllib.parse.urlsplit(there.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        for *_, address in await self.loop.getaddrinfo(
            parts.hostname, port, type=socket.SOCK_STREAM
        ):
            self.peers.add((str(address[0]), port))
        return there

    # -- what the environments ask

    def adopt(self, environment: TrlEnvironment) -> None:
        self.environments.add(environment)

    def reset(self, environment: TrlEnvironment, row: dict[str, Any]) -> None:
        split, index = row.get("split"), row.get("index")
        rows = self.served.rows.get(split) if isinstance(split, str) else None
        if (
            rows is None
            or isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < len(rows)
        ):
            raise AgentEnvError(
                "reset got the row "
                f"{short(repr({k: v for k, v in row.items() if k != 'prompt'}), 300)},"
                " which names no task: give GRPOTrainer the rows of agentenv.trl_dataset(source, "
                f"split), whose split ({', '.join(self.served.rows)}) and index name the task"
            )
        toolset = rows[index].get("toolset", environment._toolset)
        if toolset != environment._toolset:
            raise AgentEnvError(
                f"the task {rows[index].get('name')} ({split}[{index}]) plays the toolset "
                f"{toolset}, not this environment's {environment._toolset}: pass GRPOTrainer "
                "trl_environment(source) itself as environment_factory (with several toolsets, a "
                "mapping by toolset), and the rows of trl_dataset, whose environment routes each"
            )
        environment._row = {"split": split, "index": index}
        self.run(self._open(environment, split, index))

    async def _open(self, environment: TrlEnvironment, split: Any, index: Any) -> None:
        if environment._session is not None:
            await self._let_go(environment, "TRL reset its environment for another rollout")
        rollout = RemoteRollout(
            OpenEnvClient(
                self.http, self.served.url, self.settings.reset_timeout, self.warned, self._full
            ),
            split,
            index,
        )
        session = GymSession(
            uuid.uuid4().hex, {"split": split, "index": index}, rollout, self.settings
        )
        environment._session = session
        self.live.add(session)

    def call(self, environment: TrlEnvironment, name: str, arguments: dict[str, Any]) -> ToolResult:
        if environment._session is None:
            return ToolResult(
                "there is no episode to call tools in: TRL resets an environment "
                "before its rollout",
                NO_TURN,
            )
        return self.run(environment._session.play(name, arguments))

    async def finish(self, environment: TrlEnvironment, reply: str) -> tuple[float | None, str]:
        """Score the environment's episode (its open turns ended with the model's last reply,
        then with none) and close its session: the reward, or None and why the environment
        failed it."""
        session = environment._session
        if session is None:
            return None, "the environment was never reset"
        try:
            outcome = await session.verify(reply)
        finally:
            await self._let_go(environment, "its rollout was scored")
        if outcome is None:
            return None, str(session.failure)
        assert outcome.reward is not None  # (verify gives a scored outcome, or None)
        return float(outcome.reward), ""

    async def _let_go(self, environment: TrlEnvironment, reason: str) -> None:
        session, environment._session = environment._session, None
        if session is not None:
            self.live.discard(session)
            await session.close(reason)

    def _full(self, data: dict[str, Any]) -> None:
        """The server is at capacity: wait, saying so once; but where this trainer's own sessions
        fill it, no slot frees before their rollouts are scored, after every reset of the batch,
        so the reset fails at once instead of waiting out reset_timeout."""
        limit = data.get("max_sessions")
        held = sum(1 for s in self.live if s.opened.done() and s.failure is None)
        fix = (
            "serve with a higher --max-concurrent-envs N (MAX_CONCURRENT_ENVS)"
            if self.source.startswith(("http://", "https://"))
            else "pass trl_environment a higher max_concurrent_envs=N"
        )
        if isinstance(limit, int) and held >= limit:
            raise EpisodeFailed(
                f"the server at {self.served.url} plays at most {limit} sessions at once, and this "
                f"trainer holds {held} of them until their rollouts are scored, after TRL has "
                "reset "
                f"every environment of its batch: {fix}, N at least GRPOConfig's "
                "generation_batch_size",
                PROVIDER_UNAVAILABLE,
            )
        if self.served.url not in self.warned:
            self.warned.add(self.served.url)
            trl_log.warning(
                at_its_limit(
                    f"the server at {self.served.url}",
                    limit,
                    "sessions",
                    "TRL's resets wait their turn",
                    f"{fix}, N at least GRPOConfig's generation_batch_size and room for its other "
                    "clients,",
                )
            )

    # -- the end

    def close(self) -> None:
        """Close every session and stop (at exit; again, it does nothing)."""
        if self.closed or os.getpid() != self.pid:
            return
        try:
            if self.loop.is_running():
                self.run(self._close(), timeout=180)
        except Exception as exc:  # noqa: BLE001 - at exit: say it, go on
            trl_log.warning(
                "Closing the TRL environments' sessions failed: %s: %s", type(exc).__name__, exc
            )
        finally:
            self.closed = True
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    async def _close(self) -> None:
        await asyncio.gather(
            *(
                self._let_go(e, "the trainer's process is exiting")
                for e in list(self.environments)
                if e._session is not None
            ),
            return_exceptions=True,
        )
        await asyncio.gather(
            *(s.close("the trainer's process is exiting") for s in list(self.live)),
            return_exceptions=True,
        )
        await self._stack.aclose()

    def release_in_child(self) -> None:
        """In a forked child: let go of the child's copies of every connection to the server (each
        fd then points at /dev/null), so the parent's sessions end with the parent."""
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            for name in os.listdir("/proc/self/fd"):
                fd = int(name)
                with contextlib.suppress(OSError):
                    if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                        continue
                    with socket.socket(fileno=os.dup(fd)) as copy_:
                        peer = copy_.getpeername()
                    if isinstance(peer, tuple) and (peer[0], peer[1]) in self.peers:
                        os.dup2(devnull, fd)
        finally:
            os.close(devnull)


_TRL_CLIENTS: weakref.WeakSet[TrlClient] = weakref.WeakSet()


def _trl_forked() -> None:
    for client in list(_TRL_CLIENTS):
        with contextlib.suppress(Exception):  # a child must start, whatever this meets
            client.release_in_child()


os.register_at_fork(after_in_child=_trl_forked)


def trl_environment(
    source: str | os.PathLike, *, reward: str | None = None, **settings: Any
) -> Any:
    """GRPOTrainer's ``environment_factory`` for a bundle: a class whose instances play the rows
    of trl_dataset, one method per tool of the task's turns (with end_turn, which hands over a
    task's next prompt, or ends its episode); with several toolsets, TRL's mapping of environment
    name (the toolset's) to such a class, each row then offered its own task's tools.

    ``source``: a running serve's URL (AGENTENV_TOKEN is sent as its bearer token), or a bundle's
    folder, then served in-process on a loopback port. Settings by their names, as build_app takes
    them: ``reset_timeout`` (a deploy and the wait for a free session; each end_turn) and
    ``tool_timeout`` (one call) for either; for a folder also every setting of a served bundle
    (``sandbox``, ``max_concurrent_envs``, at least GRPOConfig's generation_batch_size, the
    deadlines, ``warm``, ``warm_env``, a provider's options). It lists each toolset's tools at
    once (a deploy the server does not count as an episode); a tool TRL can't offer as a method
    is refused, saying which and why."""
    source = str(source)
    remote = source.startswith(("http://", "https://"))
    takes = TRL_CLIENT_KEYS + tuple(k for k in Settings.served() if k not in TRL_CLIENT_KEYS)
    if remote and (reward is not None or "sandbox" in settings):
        raise AgentEnvError(
            f"sandbox and reward say how to serve a bundle's folder, and {source} "
            "is served already: pass them to serve there (--sandbox, --reward)"
        )
    for key in (k for k in settings if remote and k in takes and k not in TRL_CLIENT_KEYS):
        raise AgentEnvError(
            f"{key} is the served bundle's setting, and {source} is served "
            f"already: pass it to serve there (--{key.replace('_', '-')})"
        )
    checked = Settings.keywords(settings, "trl_environment", takes)
    client = TrlClient(source, checked, reward)
    there = client.served
    problems = [
        p for toolset, tools in there.toolsets.items() for p in trl_tool_problems(toolset, tools)
    ]
    if problems:
        client.close()
        raise AgentEnvError("the bundle's tools can't be TRL's:\n  - " + "\n  - ".join(problems))
    several = len(there.toolsets) > 1
    classes = {
        toolset: trl_class(there.bundle, toolset, tools, client, named=several)
        for toolset, tools in there.toolsets.items()
    }
    return next(iter(classes.values())) if len(classes) == 1 else classes


def trl_class(
    bundle: str,
    toolset: str,
    tools: list[dict[str, Any]],
    client: TrlClient | None,
    named: bool = False,
) -> type[TrlEnvironment]:
    """The environment class of a toolset: TrlEnvironment with a method per tool, and end_turn;
    named after the bundle (and the toolset, when ``named``: a bundle has several)."""
    words = re.split(r"[^A-Za-z0-9]+", f"{bundle} {toolset}" if named else bundle)
    name = "".join(word[:1].upper() + word[1:] for word in words if word) or "Bundle"
    namespace: dict[str, Any] = {
        "__module__": __name__,
        "_client": client,
        "_toolset": toolset,
        "__doc__": f"The tasks of {bundle} (toolset {toolset}) as TRL's environment: reset(**row), "
        "then a method per tool.",
    }
    for tool in [*tools, END_TURN]:
        namespace[tool["name"]] = trl_method(tool)
    return type(name if name[0].isalpha() else f"Bundle{name}", (TrlEnvironment,), namespace)


def trl_dataset(source: str | os.PathLike, split: str = "train") -> list[dict[str, Any]]:
    """The rows GRPOTrainer trains on (``Dataset.from_list`` them), one per task of the split, in
    its order: ``prompt`` (the task's system prompt and first prompt, as chat messages), ``split``
    and ``index`` (the task reset plays), ``task`` (its name) and, in a bundle of several toolsets,
    ``environment`` (its toolset, by which TRL picks the row's environment class). ``source``: a
    running serve's URL, or a bundle's folder."""
    source = str(source)

    async def rows_of() -> dict[str, list[dict[str, Any]]]:
        if not source.startswith(("http://", "https://")):
            return _bundle_rows(Bundle.load(source))
        async with aiohttp.ClientSession(headers=client_headers()) as http:
            return (await _rows_there(http, source))[1]

    with concurrent.futures.ThreadPoolExecutor(1) as thread:  # the caller's loop may be running
        rows = thread.submit(asyncio.run, rows_of()).result()
    if split not in rows:
        raise AgentEnvError(
            f"there is no split {split!r} in {source}: the splits are {', '.join(rows)}"
        )
    several = len({row.get("toolset") for row in rows["all"]}) > 1
    return [
        {
            "prompt": (
                [{"role": "system", "content": row["system_prompt"]}]
                if row.get("system_prompt")
                else []
            )
            + [{"role": "user", "content": row["prompt"]}],
            "split": split,
            "index": row["index"],
            "task": row["name"],
            **({"environment": row["toolset"]} if several else {}),
        }
        for row in rows[split]
    ]


def trl_reward(
    completions: list[Any],
    environments: list[Any] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    **_: Any,
) -> list[float | None]:
    """GRPOTrainer's reward function for trl_environment's environments: each rollout's episode
    score, as the server's verifier gave it. An episode the model left open is ended with its
    last reply (a task graded on the reply is graded on it), the turns after with none. A rollout
    the environment failed is None, which TRL leaves out of the rewards and their baseline (its
    advantage is 0), and said in a warning and as agentenv/masked_rollouts in TRL's metrics; an
    environment of another kind is None too. Every session is closed once scored."""
    if environments is None:
        raise AgentEnvError(
            "trl_reward scores the episodes of agentenv's environments, and TRL "
            "passed none: give GRPOTrainer environment_factory="
            "agentenv.trl_environment(source)"
        )
    rewards: list[float | None] = [None] * len(environments)
    failed: list[str] = []
    by_client: dict[TrlClient, list[int]] = {}
    for i, environment in enumerate(environments):
        if isinstance(environment, TrlEnvironment):
            by_client.setdefault(environment._client, []).append(i)
    for client, indices in by_client.items():

        async def finish_all(indices: list[int] = indices, client: TrlClient = client) -> list[Any]:
            return await asyncio.gather(
                *(client.finish(environments[i], _last_reply(completions[i])) for i in indices)
            )

        for i, (reward, why) in zip(indices, client.run(finish_all()), strict=True):
            rewards[i] = reward
            if reward is None:
                failed.append(f"{environments[i]._row}: {why}")
    if failed:
        trl_log.warning(
            "%d of %d rollouts left out of the reward, the environment having failed "
            "them (not the model): %s",
            len(failed),
            len(environments),
            "; ".join(failed[:3]) + ("; ..." if len(failed) > 3 else ""),
        )
    if log_metric is not None:
        log_metric("agentenv/masked_rollouts", float(len(failed)))
    return rewards


def _last_reply(completion: Any) -> str:
    """The text of the model's last message in a TRL completion (chat messages, or plain text)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion if isinstance(completion, list) else []):
        if isinstance(message, dict) and message.get("role") == "assistant":
            return _text_of(message.get("content"))
    return ""


# ================================================================ 14. CLI


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise AgentEnvError(
            f"{name}={value!r} is not a whole number; set it to one, such as 8"
        ) from None


CHECK_TASKS_SHOWN = 20
# The flags of the settings in seconds, with what each bounds; the defaults come from Settings.
# check, serve and eval take these, with the sandbox's and the pool's:
DEADLINES = {
    "deploy_timeout": "how long an env may take from its launch until it answers; past it the "
    "episode fails, masked transport_timeout",
    "verifier_timeout": "one run of a verifier's code (an env_outcome_verifier); past it the "
    "episode fails, masked verifier_error",
    "bash_timeout": "one bash command in the agent's box (and within the call's own deadline); "
    "past it every process it started is killed, and the model reads it timed out",
}
# NeMo Gym's, which serve and eval (which plays through Gym's routes) take:
GYM_DEADLINES = {
    "tool_timeout": "NeMo Gym: one tool call; past it the episode ends, masked",
    "reset_timeout": "NeMo Gym: the deploy and first turn, each end_turn, and a rollout's wait for "
    "a free episode",
}
# serve's alone:
SERVE_DEADLINES = {
    "idle_timeout": "end a session with no request for this long, to free its slot",
    "client_timeout": "how long OpenEnv clients wait for a reply (their message_timeout_s); every "
    "reply comes --reply-margin before it",
    "reply_margin": "how long before the client's timeout a call still running is ended with a "
    "timeout error",
    "status_interval": "log a status line this often while episodes are live (and one at shutdown)",
}
# The flags whose names are not the setting's own.
FLAGS = {"eval_concurrency": "--concurrency", "model_retries": "--retries"}


def flag(key: str) -> str:
    """The command-line flag of a setting."""
    return FLAGS.get(key, "--" + key.replace("_", "-"))


def settings_of(args: argparse.Namespace, **given: Any) -> Settings:
    """The settings a command's flags give (those it has), with ``given`` (what the command
    works out itself), checked as every way in is: a bad one says its flag."""
    flags = {key: getattr(args, key) for key in Settings.names() if hasattr(args, key)}
    return Settings.checked(
        {**flags, **given},
        lambda key, value: (
            flag(key)
            + ("" if value is None else f" {value!r}" if isinstance(value, str) else f" {value}")
            + (" (or MAX_CONCURRENT_ENVS)" if key == "max_concurrent_envs" else "")
        ),
    )


async def check(
    folder: str, settings: Settings, reward: str | None, out: Callable[[str], None] = print
) -> None:
    """Load a bundle, show its splits, tasks and toolsets, and play one episode per toolset as far
    as its first turn to list the tools that turn offers; then tear down."""
    bundle = Bundle.load(folder, reward)
    out(f"bundle {bundle.name}: {bundle.description or '(no README.md description)'}")
    out(
        "splits: "
        + ", ".join(
            f"{name} ({len(tasks)} task{'s' if len(tasks) != 1 else ''})"
            for name, tasks in bundle.splits.items()
        )
    )
    shown = bundle.splits["all"][:CHECK_TASKS_SHOWN]
    width = max(len(t.name) for t in shown)
    out("tasks:")
    for task in shown:
        out(
            f"  {task.name:<{width}}  toolset {task.toolset.name}  turns {len(task.turns)}  "
            f"reward {task.reward_step}"
        )
    if len(bundle.tasks) > len(shown):
        out(f"  ... and {len(bundle.tasks) - len(shown)} more")
    async with Runtime(bundle, settings) as runtime:
        assert runtime.sandbox is not None  # (opened as the runtime started)
        for line in runtime.sandbox.describe(list(bundle.envs.values())):
            out(line)
        out("toolsets:")
        failed = []
        count = len(bundle.toolsets)
        for n, (toolset, tasks) in enumerate(bundle.toolsets.items(), 1):
            started, where = time.monotonic(), dict[str, str]()
            # with many toolsets each line says how far check has got
            at = f"[{n}/{count}] " if count > 1 else ""
            try:
                tools = await runtime.first_turn_tools(tasks[0], "check is done", where)
                names = ", ".join(t["name"] for t in tools) or "(none)"
                placed = (
                    " on " + ", ".join(f"{env} at {node}" for env, node in where.items())
                    if where
                    else ""
                )
                out(
                    f"  {at}{toolset.name} ({len(tasks)} task{'s' if len(tasks) != 1 else ''}), "
                    f"played with {tasks[0].name}{placed} in {time.monotonic() - started:.2f}s: "
                    f"{names}"
                )
            except EpisodeFailed as exc:
                failed.append(toolset.name)
                out(f"  {at}{toolset.name}: the episode of {tasks[0].name} failed: {exc}")
        if failed:
            raise AgentEnvError(f"the toolsets {', '.join(failed)} did not play; see above")
        out("ok: every toolset deployed, and every env was torn down")


def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    settings = settings_of(
        args,
        max_concurrent_envs=pool_size(args.max_concurrent_envs),
        warm_env=args.warm_env or None,
    )
    token = served_token(args)
    if not token:
        log.warning(
            "Serving with no token: any user or program on this machine%s can play the "
            "bundle's tasks and run what their tools and boxes run, from the web page or "
            "any client (web pages cannot: the server answers only its own). Start serve "
            "with --token-file PATH (or AGENTENV_TOKEN set) so every request must carry "
            "the token, and enter it at /web.",
            ""
            if is_loopback(args.host)
            else f", and anyone who can reach {args.host or 'every interface'}:{args.port},",
        )
    hide_from_other_processes()
    server = _server(
        args.bundle,
        reward=args.reward,
        token=token,
        settings=settings,
        host=args.host,
        port=args.port,
    )
    wait_for_children_by_pidfd()
    web.run_app(
        server.app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=30
    )


def served_token(args: argparse.Namespace) -> str | None:
    """The token serve asks for: --token, else the first line of --token-file, else
    AGENTENV_TOKEN, else none."""
    if args.token is not None and args.token_file is not None:
        raise AgentEnvError(
            "--token and --token-file both name a token; give one (--token-file keeps it out of ps)"
        )
    if args.token is not None:
        if not args.token:
            raise AgentEnvError("--token is empty; give the token clients send, or leave it out")
        return args.token
    if args.token_file is None:
        return os.environ.get("AGENTENV_TOKEN") or None
    import stat

    path = Path(args.token_file).expanduser()
    try:  # not blocking: a FIFO given by mistake must not hang the start
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise AgentEnvError(
                    f"--token-file {args.token_file} is not a regular file; write the token in one"
                )
            first = file.read(4096).decode("utf-8").partition("\n")[0].strip()
    except UnicodeDecodeError:
        raise AgentEnvError(
            f"--token-file {args.token_file} does not hold UTF-8 text; write the "
            "token in it as text"
        ) from None
    except OSError as exc:
        raise AgentEnvError(
            f"--token-file {args.token_file} could not be read "
            f"({exc.strerror or exc}); give a file this user can read, holding "
            "the token"
        ) from None
    if not first:
        raise AgentEnvError(
            f"--token-file {args.token_file} holds no token on its first line; "
            'write one there, such as the output of: python -c "import secrets; '
            'print(secrets.token_urlsafe(32))"'
        )
    if mode & 0o077:
        log.warning(
            "The token file %s can be read by other users (mode %o); chmod 600 it so only you can.",
            path,
            mode & 0o777,
        )
    return first


def hide_from_other_processes() -> None:
    """Make this process undumpable (Linux's PR_SET_DUMPABLE 0): a process of the same user
    without CAP_SYS_PTRACE, such as an env or a box command of the local sandbox, can then read
    neither its environment (AGENTENV_TOKEN, a cloud key) nor its memory through /proc. What a
    process runs is dumpable again (exec resets it), so envs are as they were. Its command line
    stays readable by every user, as ps shows it: hence --token-file."""
    with contextlib.suppress(Exception):  # not Linux, no libc: nothing to hide from
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def pool_size(flag: int | None, default: int = Settings.max_concurrent_envs) -> int:
    """--max-concurrent-envs as given (0 included: Settings refuses it, saying so), else
    MAX_CONCURRENT_ENVS, else ``default``."""
    return flag if flag is not None else _env_int("MAX_CONCURRENT_ENVS", default)


def eval_plan(args: argparse.Namespace) -> EvalPlan:
    """eval's flags as its plan, each checked."""
    for name in ("limit", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise AgentEnvError(f"--{name} must be a whole number of at least 1, not {value}")
    # The bundle's pool holds at least as many episodes as eval plays at once, and room for the
    # ones tearing down, unless told otherwise.
    settings = settings_of(
        args,
        max_concurrent_envs=pool_size(
            args.max_concurrent_envs, max(args.eval_concurrency, Settings.max_concurrent_envs)
        ),
        warm=0,
    )  # eval plays rows at a steady concurrency, and keeps no warm pool
    return EvalPlan(
        source=args.source,
        model_url=args.model_url,
        model=args.model,
        api=args.api,
        splits=tuple(s for s in args.split.split(",") if s),
        limit=args.limit,
        repeats=args.repeats,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        api_key_env=args.api_key_env,
        output=args.output,
        reward=args.reward,
        settings=settings,
    )


def main(argv: list[str] | None = None) -> int:
    args = command_line().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # serve narrates what it does; check prints its own report and logs only trouble
    logging.getLogger("agentenv").setLevel(
        logging.INFO if args.verbose or args.command == "serve" else logging.WARNING
    )
    build_log.setLevel(logging.INFO)
    if args.verbose:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        if args.command == "check":
            asyncio.run(check(args.bundle, settings_of(args), args.reward))
        elif args.command == "serve":
            serve(args)
        elif args.command == "write-gym":
            settings = settings_of(args, max_concurrent_envs=pool_size(args.max_concurrent_envs))
            asyncio.run(
                write_gym(
                    args.source,
                    args.gym_root,
                    settings,
                    reward=args.reward,
                    keep_prompts=args.keep_prompts,
                )
            )
        elif args.command == "eval":
            if not args.verbose:  # the summary counts masked rollouts by kind; no line each
                logging.getLogger("agentenv.gym").setLevel(logging.ERROR)
            plan = eval_plan(args)
            try:
                asyncio.run(evaluate(plan))
            except asyncio.CancelledError:  # SIGTERM
                print(
                    f"agentenv.py eval: stopped; the rollouts done are in {plan.output}, and the "
                    "same command resumes",
                    file=sys.stderr,
                )
                return 143
    except AgentEnvError as exc:
        print(f"agentenv.py {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def sandbox_flags(cmd: argparse.ArgumentParser, written: bool = False) -> None:
    """--sandbox and each provider's options, from the registry (check, serve, eval, write-gym:
    ``written`` into its config)."""
    said = "; written into the config when given" if written else ""
    for name in sorted(Settings.DECLARED, key=lambda name: name != "sandbox"):
        declared = Settings.DECLARED[name]
        if declared.gym_global:
            continue
        choices = declared.choices() if declared.choices else None
        cmd.add_argument(
            flag(name),
            default=None,
            choices=choices,
            metavar=None if choices else declared.metavar,
            help=declared.help + (said if name != "sandbox" else ""),
        )


def pool_flag(cmd: argparse.ArgumentParser, default: str) -> None:
    cmd.add_argument(
        "--max-concurrent-envs",
        type=int,
        default=None,
        metavar="N",
        help=f"episodes live at once; past it, new ones wait (default: {default})",
    )


def reply_flag(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--max-env-reply",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes of an env's answer read: past them a tool's answer is the model's "
        "tool error (it asked for too much), and a tool listing (every page) "
        f"fails the deploy ({Settings.max_env_reply})",
    )


def seconds_flags(cmd: argparse.ArgumentParser, deadlines: dict[str, str]) -> None:
    for key, help_ in deadlines.items():
        cmd.add_argument(
            flag(key),
            type=float,
            default=None,
            metavar="SECONDS",
            help=f"{help_} ({getattr(Settings, key):g})",
        )


def command_line() -> argparse.ArgumentParser:
    """The commands, their flags, and what each says in --help. check, serve and eval take the
    same sandbox, pool, deadline and box flags; the sandbox's come from the provider registry."""
    parser = argparse.ArgumentParser(
        prog="agentenv.py", description="Serve a bundle of agent tasks as training environments."
    )
    parser.add_argument("--version", action="version", version=f"agentenv.py {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what every episode does")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pool_default = f"MAX_CONCURRENT_ENVS, else {Settings.max_concurrent_envs}"

    def bundle_options(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument("bundle", metavar="BUNDLE", help="the bundle's folder")
        sandbox_flags(cmd)
        cmd.add_argument(
            "--reward",
            metavar="STEP",
            default=None,
            help="the scoring step whose score is the reward, for tasks with several",
        )

    check_cmd = commands.add_parser(
        "check",
        help="load a bundle and deploy one episode per toolset",
        description="Load a bundle, print its splits, tasks and toolsets, deploy one episode per "
        "toolset, print the tools each offers, and tear everything down.",
    )
    bundle_options(check_cmd)
    pool_flag(check_cmd, pool_default)
    seconds_flags(check_cmd, DEADLINES)
    reply_flag(check_cmd)
    serve_cmd = commands.add_parser(
        "serve",
        help="serve a bundle's tasks as OpenEnv envs",
        description="Serve every task of a bundle from one aiohttp app: the OpenEnv wire (/health, "
        "/metadata, WebSocket /ws), with the splits 'all' and one per eval, out of one "
        "pool of episodes. SIGINT or SIGTERM tears every live episode down and exits.",
    )
    bundle_options(serve_cmd)
    serve_cmd.add_argument("--host", default="127.0.0.1", help="the address to bind (127.0.0.1)")
    serve_cmd.add_argument("--port", type=int, default=8000, help="the port (8000)")
    pool_flag(serve_cmd, pool_default)
    seconds_flags(serve_cmd, {**DEADLINES, **GYM_DEADLINES, **SERVE_DEADLINES})
    reply_flag(serve_cmd)
    serve_cmd.add_argument(
        "--warm",
        default=None,
        metavar="N",
        type=warm_flag,
        help="keep N envs started and ready ahead of demand, split among the "
        "bundle's envs by how many tasks use each; a deploy takes one at "
        "once, or deploys cold when none is ready; 0: none (default "
        f"{Settings.warm}: with the "
        + " or ".join(providers_that(lambda able: able.warm_by_default()[0]))
        + " sandbox as many as --max-concurrent-envs, within the machine's "
        "memory; else none)",
    )
    serve_cmd.add_argument(
        "--warm-env",
        action="append",
        default=None,
        metavar="NAME=N",
        help="keep N warm envs of the env NAME (instead of a share of --warm); "
        "give it once per env",
    )
    serve_cmd.add_argument(
        "--token",
        default=None,
        metavar="TOKEN",
        help="ask every request for the header Authorization: Bearer TOKEN "
        "(default: --token-file's, else AGENTENV_TOKEN, else none); every "
        "user of this machine sees it in ps, so prefer --token-file; "
        "clients of a served URL (write-gym, a Gym server with url:) send "
        "AGENTENV_TOKEN",
    )
    serve_cmd.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="the token, on the first line of this file (readable by you "
        "alone: chmod 600), instead of --token",
    )
    serve_cmd.add_argument(
        "--allow-host",
        dest="allow_host",
        action="append",
        default=None,
        metavar="NAME",
        help="answer to requests for this host name too, beside localhost, "
        "IP addresses and this machine's name (a reverse proxy's name); "
        "give it once per name; other names are refused 421, as DNS "
        "rebinding would send them",
    )
    writer = commands.add_parser(
        "write-gym",
        help="write a NeMo Gym resources server for a bundle into a Gym root",
        description="Write GYM_ROOT/resources_servers/<name>/: app.py, a copy of agentenv.py, the "
        "venv's pyproject.toml, configs/<name>.yaml and data/<split>.jsonl rows for the "
        "split 'all' and every eval. From a URL, the resources server plays its rollouts "
        "on that running server; from a bundle folder, it serves the bundle itself, in "
        "the sandbox its flags name (the tools are listed there too). It plays one task "
        "of each toolset to list the tools its rows offer.",
    )
    writer.add_argument(
        "source",
        metavar="URL_OR_BUNDLE",
        help="a running server's URL (http://127.0.0.1:8000) or a bundle's folder",
    )
    writer.add_argument("gym_root", metavar="GYM_ROOT", help="the Gym checkout (or extra root)")
    writer.add_argument(
        "--max-concurrent-envs",
        type=int,
        default=None,
        metavar="N",
        help="with a bundle: episodes the resources server runs at once "
        f"({Settings.max_concurrent_envs})",
    )
    sandbox_flags(writer, written=True)
    writer.add_argument(
        "--reward",
        metavar="STEP",
        default=None,
        help="with a bundle: the scoring step whose score is the reward",
    )
    writer.add_argument(
        "--keep-prompts",
        action="store_true",
        help="keep the prompts of rows already written (your edits) when writing "
        "the server again; without it every file is written anew",
    )
    evaluator = commands.add_parser(
        "eval",
        help="score an OpenAI-compatible model on a bundle's split",
        description="Play the rows write-gym writes for a split against a model behind an "
        "OpenAI-compatible endpoint (vLLM, SGLang, a hosted API), exactly as NeMo Gym's "
        "simple_agent plays them, and score them: each rollout is appended to --output "
        "as it finishes (a rerun with the same --output resumes), with a live progress "
        "line and a summary at the end. From a bundle folder it serves the bundle "
        "in-process, with the sandbox, pool and deadline flags serve takes; from a URL "
        "it plays a running serve.",
    )
    evaluator.add_argument(
        "source",
        metavar="BUNDLE_OR_URL",
        help="a bundle's folder, or a running serve's URL (http://127.0.0.1:8000)",
    )
    evaluator.add_argument(
        "--model-url",
        required=True,
        metavar="URL",
        help="the endpoint's base URL, ending in /v1 (http://127.0.0.1:8001/v1)",
    )
    evaluator.add_argument("--model", required=True, metavar="NAME", help="the model's name there")
    evaluator.add_argument(
        "--api",
        choices=("auto", "chat", "responses"),
        default="auto",
        help="Chat Completions or Responses (default: Responses where the "
        "endpoint has it, else Chat Completions; said at start)",
    )
    evaluator.add_argument(
        "--split",
        default=",".join(EvalPlan.splits),
        metavar="SPLIT[,SPLIT...]",
        help=f"the split(s) to play ({','.join(EvalPlan.splits)})",
    )
    evaluator.add_argument(
        "--limit", type=int, default=None, metavar="N", help="the first N rows of each split (all)"
    )
    evaluator.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="K",
        help="rollouts per row; past 1 the summary gives pass@K and mean@K (1)",
    )
    evaluator.add_argument(
        "--concurrency",
        dest="eval_concurrency",
        type=int,
        default=Settings.eval_concurrency,
        metavar="C",
        help=f"rollouts played at once ({Settings.eval_concurrency})",
    )
    evaluator.add_argument(
        "--max-steps",
        type=int,
        default=Settings.max_steps,
        metavar="M",
        help="model calls in one rollout, as simple_agent's max_steps; 0 for no "
        f"limit ({Settings.max_steps})",
    )
    evaluator.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="the sampling temperature (default: the row's, else the server's)",
    )
    evaluator.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="T",
        help="tokens the model may write per reply (default: the server's)",
    )
    evaluator.add_argument(
        "--api-key-env",
        default=EvalPlan.api_key_env,
        metavar="VAR",
        help="the environment variable holding the endpoint's key, sent as a "
        f"bearer token when set ({EvalPlan.api_key_env})",
    )
    evaluator.add_argument(
        "--request-timeout",
        type=float,
        default=Settings.request_timeout,
        metavar="SECONDS",
        help=f"one model request; past it the request is retried ({Settings.request_timeout:g})",
    )
    evaluator.add_argument(
        "--retries",
        dest="model_retries",
        type=int,
        default=Settings.model_retries,
        metavar="N",
        help="retries of a model request after a 429, a 5xx or a timeout, with "
        "backoff; then the rollout is the model's failure "
        f"({Settings.model_retries})",
    )
    evaluator.add_argument(
        "--output",
        default=EvalPlan.output,
        metavar="FILE",
        help="the rollouts, one JSON line each, in NeMo Gym's shape; rerun with "
        f"the same file to resume ({EvalPlan.output})",
    )
    sandbox_flags(evaluator)
    evaluator.add_argument(
        "--reward",
        metavar="STEP",
        default=None,
        help="with a bundle: the scoring step whose score is the reward",
    )
    pool_flag(
        evaluator,
        f"MAX_CONCURRENT_ENVS, else --concurrency or {Settings.max_concurrent_envs}, the larger",
    )
    seconds_flags(evaluator, {**DEADLINES, **GYM_DEADLINES})
    reply_flag(evaluator)
    return parser


# python agentenv.py runs main() of the module agentenv: see the top of the file.
