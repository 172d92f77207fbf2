"""The fast test suite of agentenv.py: a fake bundle, played on the local sandbox.

Every test plays what a user sees: a bundle that loads or is refused (and how the refusal reads),
episodes played against real env processes on the local sandbox, the MCP client against a real
FastMCP server and a scripted SSE one, the ``check`` CLI, and the example bundle
``bundles/notes-v1``. No test here needs a Docker daemon; the OpenEnv and Gym surfaces, faults,
bad input and load have their own suites under tests/.

The ``make_bundle`` fixture writes each test's fake bundle from real files under tests/fake_env/:
``server.py``, a small standard-library MCP env server whose behaviour is switched by its
Dockerfile's ENV lines (FAKE_MODE, TOOL_PREFIX, CARD_NAME: see ENVS), ``plain_server.py`` (a
FastMCP server: no card, SSE answers) and ``check_verifier.py``. Every env process records its pid
in $FAKE_PIDDIR, so each test can check that no env process outlives it (the autouse fixture
``isolated``).

The file goes: the fake bundle, the helpers every section uses, then one section per component, in
the order of agentenv.py's sections. A test goes where what it tests lives:

* Bundle: loading a bundle, its splits, task ids, seeds; each refusal of Bundle.load and how it
  reads; parse_dockerfile.
* Sandbox: choosing one (auto falls back to local); local env processes: their command,
  environment, output, port and scratch folder; the sweep of what a crashed run left; Docker calls
  that need no daemon.
* Env client: the MCP client (McpSession against FastMCP and SSE, long answers); an env coming up,
  or failing its deploy (it exits, never listens, shows another card, lists no tools).
* Verifiers: aggregate_score and response_rows; what a verifier artifact returns or raises, its
  import, its thread, its timeout.
* Episode: turns and their tools; the steps graph (depends_on, fail_task_on_error);
  apply_server_config; failures during a turn (tool timeouts, env crashes, the turn's timeout);
  abandon and teardown.
* Pool and runtime: the pool and its limit, the start gate, closing the runtime.
* Eval: the chat translation, the endpoint's errors told apart, the summary, the rollouts file
  (``eval`` end to end is tests/test_eval.py's).
* TRL: the environment class trl_environment builds (each tool a typed, documented method; the
  tools that can't be, refused), trl_dataset's rows, the settings refused (tests/test_trl.py plays
  it against serve, and trains with TRL).
* CLI: ``check`` and agentenv.main.
* The example bundle notes-v1.

A helper or source that one test alone uses sits beside that test. Each coroutine runs under
tests/harness.py's ``run`` with this suite's deadline of 30 s, unless a test gives its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import aiohttp
import pytest
from aiohttp import web

import agentenv
from agentenv import (AgentEnvError, Bundle, BundleError, EpisodeFailed, McpError, McpSession,
                      Runtime, StartGate, ToolResult, aggregate_score, parse_dockerfile,
                      response_rows, task_id_root)
from tests.harness import (NOTES, REPO, Gym, alive, client, free_port, gone, gym_row,
                           run as run_within)


# ================================================================ the fake bundle

# What a fake bundle is made of: real files, each saying what it is in its docstring.
FAKE_ENV = REPO / "tests" / "fake_env"
# The standard-library MCP env server of every env below but plain, switched by its ENV lines.
FAKE_SERVER = (FAKE_ENV / "server.py").read_text()

# A plain MCP server built with the mcp package: no card, answers with SSE.
PLAIN_SERVER = (FAKE_ENV / "plain_server.py").read_text()


def dockerfile(*env_lines: str) -> str:
    return "FROM python:3.11-slim\nWORKDIR /app\nCOPY server.py .\n" + \
        "".join(f"ENV {line}\n" for line in env_lines) + 'CMD ["python", "server.py"]\n'


ENVS = {   # name -> (Dockerfile, server source)
    "main": (dockerfile(), FAKE_SERVER),
    "other": (dockerfile("TOOL_PREFIX=other_"), FAKE_SERVER),
    "broken": (dockerfile("FAKE_MODE=exit"), FAKE_SERVER),
    "deaf": (dockerfile("FAKE_MODE=deaf"), FAKE_SERVER),
    "imposter": (dockerfile("CARD_NAME=someone-else"), FAKE_SERVER),
    "empty": (dockerfile("FAKE_MODE=notools"), FAKE_SERVER),
    "plain": (dockerfile(), PLAIN_SERVER),
}

# artifacts/check/verify.py: the agent passes if it said "hello" (read through the dump tool).
CHECK_VERIFIER = (FAKE_ENV / "check_verifier.py").read_text()

VERIFIERS = {
    "check": CHECK_VERIFIER,
    "raises": "async def verify(mcp_url):\n    raise RuntimeError('the checker broke')\n",
    "hangs": "import asyncio, os\n\n\nasync def verify(mcp_url):\n"
             "    while not os.path.exists({release!r}):\n        await asyncio.sleep(0.02)\n"
             "    return [{{'id': 'late', 'result': True}}]\n",
    "weighted": "async def verify(mcp_url):\n"
                "    return [{'id': 'a', 'score': 0.5, 'weight': 2}, {'id': 'b', 'result': True}]\n",
    "notalist": "async def verify(mcp_url):\n    return 'yes'\n",
}


def fake_server_with(marker: str, insert: str, source: str = FAKE_SERVER) -> str:
    """The fake env server (or ``source``) with ``insert`` put just before ``marker``, which it must
    hold once."""
    assert source.count(marker) == 1, f"{marker!r} is not in the source exactly once"
    return source.replace(marker, insert + marker, 1)


def custom_env(name: str, source: str) -> dict[str, str]:
    """The ``files`` of make_bundle for an env of its own: a Dockerfile and a server."""
    return {f"envs/{name}/Dockerfile": dockerfile(), f"envs/{name}/server.py": source}


# -- steps, as a task file writes them

def deploy(env="main", id=None, **fields):
    return {"id": id or f"deploy-{env}", "type": "deploy_env", "env_id": env, **fields}


def agent(*envs, id="agent", **fields):
    return {"id": id, "type": "deploy_agent", "env_ids": list(envs), **fields}


def prompt(text="Say hello.", id="turn1", **fields):
    return {"id": id, "type": "prompt_agent", "prompt": text, "prompt_id": id, **fields}


def outcome(artifact="check", env="main", id="check", **fields):
    return {"id": id, "type": "env_outcome_verifier", "env_id": env, "file_artifact_id": artifact,
            **fields}


def contains(*needles, id="answer", prompt_id="turn1", **fields):
    return {"id": id, "type": "agent_prompt_response_verifier", "prompt_id": prompt_id,
            "criteria": [{"type": "response_contains", "needles": list(needles or ["hello"])}],
            **fields}


def config(args, env="main", id="config", uri="urn:fake:config/v1", **fields):
    return {"id": id, "type": "apply_server_config", "env_id": env,
            "directives": [{"service": "*", "uri": uri, "args": args}], **fields}


def simple(env="main", artifact="check", **agent_fields):
    """Deploy one env, one turn, scored by an env_outcome_verifier."""
    return [deploy(env), agent(env, **agent_fields), prompt(), outcome(artifact, env)]


def replied(*needles):
    """Deploy main, one turn, scored by the reply."""
    return [deploy(), agent("main"), prompt(), contains(*needles)]


# -- the fixtures: each test's own folders, and its fake bundles

@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Every test keeps agentenv's state and the env pids in its own folders, and leaves no env
    process behind."""
    monkeypatch.setenv("AGENTENV_STATE_DIR", str(tmp_path / "state"))
    piddir = tmp_path / "pids"
    piddir.mkdir()
    monkeypatch.setenv("FAKE_PIDDIR", str(piddir))
    yield piddir
    (tmp_path / "release").touch()        # frees a hanging verifier's thread
    left = [p.name for p in piddir.iterdir() if not gone(int(p.name), 3)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    assert not left, f"env processes {left} outlived the test"


@pytest.fixture
def make_bundle(tmp_path):
    """Write a fake bundle: ``make_bundle(tasks={name: steps or raw text}, envs=..., ...)``."""
    made = []

    def make(tasks, *, envs=("main",), artifacts=("check",), evals=None,
             readme="# Fake bundle for tests.\n\nMore words.\n", files=None, name=None) -> Path:
        root = tmp_path / (name or ("bundle" if not made else f"bundle{len(made)}"))
        made.append(root)
        for env in envs:
            folder = root / "envs" / env
            folder.mkdir(parents=True)
            docker, source = ENVS[env]
            (folder / "Dockerfile").write_text(docker)
            (folder / "server.py").write_text(source)
        for artifact in artifacts:
            folder = root / "artifacts" / artifact
            folder.mkdir(parents=True)
            (folder / "verify.py").write_text(VERIFIERS[artifact].format(release=str(tmp_path / "release"))
                                              if artifact == "hangs" else VERIFIERS[artifact])
        (root / "tasks").mkdir(parents=True, exist_ok=True)
        for task, steps in tasks.items():
            (root / "tasks" / f"{task}.json").write_text(
                steps if isinstance(steps, str) else json.dumps(steps, indent=2))
        for name_, text in (evals or {}).items():
            (root / "evals").mkdir(exist_ok=True)
            (root / "evals" / f"{name_}.toml").write_text(text)
        if readme is not None:
            (root / "README.md").write_text(readme)
        for rel, text in (files or {}).items():
            path = root / rel
            if text is None:
                path.mkdir(parents=True, exist_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        return root

    return make


# ================================================================ helpers

# The harness's run, with this suite's deadline: 30 s a coroutine (the harness's default is 60),
# unless a test gives its own.
run = functools.partial(run_within, timeout=30)


def local(bundle: Bundle, **options) -> Runtime:
    options = {"sandbox": "local", "deploy_timeout": 10, "verifier_timeout": 10, **options}
    return Runtime(bundle, agentenv.Settings.of(**options))


def refused(root, reward=None) -> list[str]:
    with pytest.raises(BundleError) as caught:
        Bundle.load(root, reward)
    assert str(caught.value).startswith(f"the bundle has {len(caught.value.problems)} problem")
    return caught.value.problems


def problem_with(problems: list[str], *parts: str) -> str:
    """The one problem that has every part; fails, showing them all, if none does."""
    found = [p for p in problems if all(part in p for part in parts)]
    assert found, f"no problem has {parts}; the problems are:\n" + "\n".join(problems)
    return found[0]


async def play(rt: Runtime, task, reply="hello", calls=(), seed=None):
    """Play one episode: make the calls, end the turn with the reply; the outcome once closed."""
    ep = rt.episode(task, seed=seed)
    turn = await ep.next_turn()
    for name, args in calls:
        await turn.call(name, args)
    turn.end(reply)
    result = await ep.result()
    if result.status == "scored":
        assert await ep.next_turn() is None
    else:
        with pytest.raises(EpisodeFailed, match=re.escape(result.failure.reason)):
            await ep.next_turn()
    await ep.closed.wait()
    return result


def assert_torn_down(ep) -> None:
    assert ep.closed.is_set() and ep.phase == "closed"
    assert ep.instances, "the episode launched no env"
    for instance in ep.instances:
        assert instance.proc.returncode is not None, "an env process still runs"
        assert gone(instance.proc.pid), f"env process {instance.proc.pid} still exists"
        assert not instance.record.exists(), "the env's record was left in the state folder"
    assert ep not in ep.context.live


# ================================================================ Values and settings

def test_every_step_type_a_bundle_may_hold_has_a_handler():
    assert set(agentenv.Episode.HANDLERS) == set(agentenv.STEP_FIELDS)


def test_a_gym_config_sets_the_settings_and_the_rest_keep_their_defaults():
    settings = agentenv.Settings.from_config({"tool_timeout": 5, "deploy_timeout": 30.5,
                                              "max_concurrent_envs": 16, "other": "x"}, "here")
    assert settings == agentenv.Settings(tool_timeout=5, deploy_timeout=30.5, max_concurrent_envs=16)
    assert settings.gym_config(bundle=True) == {
        "tool_timeout": 5, "reset_timeout": 600, "idle_timeout": 600, "max_concurrent_envs": 16,
        "deploy_timeout": 30.5, "bash_timeout": 300, "max_env_reply": 2097152, "status_interval": 60}
    assert agentenv.Settings().gym_config(bundle=False) == {
        "tool_timeout": 60, "reset_timeout": 600, "idle_timeout": 600}


@pytest.mark.parametrize("key, value, says", [
    ("tool_timeout", 0, "tool_timeout: 0 in configs/x.yaml: it must be a positive number of seconds, "
                        "such as 60"),
    ("deploy_timeout", "soon", "deploy_timeout: 'soon' in configs/x.yaml: it must be a positive number"),
    ("reset_timeout", float("nan"), "reset_timeout: nan in configs/x.yaml: it must be a positive number"),
    ("max_concurrent_envs", 2.5, "max_concurrent_envs: 2.5 in configs/x.yaml: it must be a whole number "
                                 "of at least 1, such as 8"),
    ("max_concurrent_envs", True, "max_concurrent_envs: True in configs/x.yaml: it must be a whole number"),
    ("max_env_reply", 0, "max_env_reply: 0 in configs/x.yaml: it must be a whole number of at least 1, "
                         "such as 2097152"),
    ("max_env_reply", "1M", "max_env_reply: '1M' in configs/x.yaml: it must be a whole number"),
])
def test_a_bad_setting_in_a_gym_config_says_which_and_the_fix(key, value, says):
    with pytest.raises(AgentEnvError) as caught:
        agentenv.Settings.from_config({key: value}, "configs/x.yaml")
    assert str(caught.value).startswith(says), str(caught.value)


@pytest.mark.parametrize("config, says", [
    ({"ray_address": "head"}, "ray_address: 'head' in configs/x.yaml: it must be the Ray cluster's "
                              "head as HOST:PORT (such as 10.0.0.5:6379"),
    ({"ray_address": 6379}, "ray_address: 6379 in configs/x.yaml: it must be the Ray cluster's head"),
    ({"ray_resource": "CPU"}, "ray_resource: 'CPU' in configs/x.yaml: it must name a custom resource "
                              "that the env nodes declare"),
    ({"ray_resource": "env nodes"}, "ray_resource: 'env nodes' in configs/x.yaml: it must name a "
                                    "custom resource"),
    ({"ray_node_sandbox": "podman"}, "ray_node_sandbox: 'podman' in configs/x.yaml: it must be auto "
                                     "(on each node, the first of docker, local that it can run), "
                                     "docker or local"),
])
def test_a_gym_configs_ray_keys_are_checked_like_the_others(config, says):
    with pytest.raises(AgentEnvError) as caught:
        agentenv.Settings.from_config(config, "configs/x.yaml")
    assert str(caught.value).startswith(says), str(caught.value)
    good = agentenv.Settings.from_config({"ray_address": "ray://10.0.0.5:10001",
                                          "ray_resource": "env_node"}, "here")
    assert (good.ray_address, good.ray_resource) == ("ray://10.0.0.5:10001", "env_node")
    assert good.gym_config(bundle=True)["ray_address"] == "ray://10.0.0.5:10001"
    assert "ray_address" not in agentenv.Settings().gym_config(bundle=True), "unset: not written"


def test_write_gym_writes_the_ray_flags_into_the_config_and_lists_tools_on_that_cluster(
        tmp_path, monkeypatch, capsys):
    """write-gym --sandbox ray --ray-address --ray-resource: the config carries sandbox: ray and
    both keys (so the resources server joins that cluster, on those nodes), and the probe deploys
    that list the tools are told the same cluster. (They run on the local sandbox here: the Ray
    suite plays this sandbox on a real cluster.)"""
    import yaml
    asked = []
    listed = agentenv._toolsets_here

    async def probes(bundle, settings, out=None, runtime=None, who="write-gym"):
        asked.append((settings.sandbox, agentenv.RayOptions.of(settings)))
        return await listed(bundle, agentenv.Settings.of(sandbox="local"), out, runtime, who)
    monkeypatch.setattr(agentenv, "_toolsets_here", probes)
    monkeypatch.setenv("RAY_ADDRESS", "elsewhere:6379")
    root = tmp_path / "gym"
    assert agentenv.main(["write-gym", str(NOTES), str(root), "--sandbox", "ray", "--ray-address",
                          "10.0.0.5:6379", "--ray-resource", "env_node", "--ray-node-sandbox",
                          "docker"]) == 0, capsys.readouterr()
    assert asked == [("ray", agentenv.RayOptions("10.0.0.5:6379", "env_node", node_sandbox="docker"))]
    config = yaml.safe_load((root / "resources_servers/notes_v1/configs/notes_v1.yaml").read_text())
    server = config["notes_v1"]["resources_servers"]["notes_v1"]
    assert (server["sandbox"], server["ray_address"], server["ray_resource"],
            server["ray_node_sandbox"]) == ("ray", "10.0.0.5:6379", "env_node", "docker"), server
    settings = agentenv.Settings.from_config(server, "the written config")
    assert (settings.ray_address, settings.ray_resource, settings.ray_node_sandbox) == \
        ("10.0.0.5:6379", "env_node", "docker")
    assert agentenv.RayOptions.of(settings).node_sandbox == "docker"

    # without the flags nothing is written, so the server joins the cluster Gym names at run time
    assert agentenv.main(["write-gym", str(NOTES), str(root), "--sandbox", "ray"]) == 0
    config = yaml.safe_load((root / "resources_servers/notes_v1/configs/notes_v1.yaml").read_text())
    assert not {"ray_address", "ray_resource", "ray_node_sandbox"} & \
        set(config["notes_v1"]["resources_servers"]["notes_v1"])
    assert asked[-1] == ("ray", agentenv.RayOptions("elsewhere:6379", None))


@pytest.mark.parametrize("argv, says", [
    (["--sandbox", "ray", "--ray-address", "nowhere"], "--ray-address 'nowhere': it must be the Ray "
                                                       "cluster's head as HOST:PORT"),
    (["--sandbox", "ray", "--ray-resource", "memory"], "--ray-resource 'memory': it must name a custom "
                                                       "resource"),
    (["--sandbox", "local", "--ray-address", "10.0.0.5:6379"],
     "--ray-address, --ray-resource and --ray-node-sandbox say where a bundle's envs run on a Ray "
     "cluster, and this server's envs run in the local sandbox; pass them with a bundle folder and "
     "--sandbox ray"),
    (["--sandbox", "docker", "--ray-node-sandbox", "local"],
     "--ray-address, --ray-resource and --ray-node-sandbox say where a bundle's envs run on a Ray "
     "cluster, and this server's envs run in the docker sandbox"),
])
def test_write_gym_refuses_a_bad_ray_flag_before_it_deploys_or_writes(tmp_path, capsys, argv, says):
    assert agentenv.main(["write-gym", str(NOTES), str(tmp_path / "gym"), *argv]) == 1
    assert says in capsys.readouterr().err
    assert not (tmp_path / "gym").exists()


def test_check_serve_and_eval_take_the_same_sandbox_pool_deadline_and_box_flags():
    """One set of flags for where envs run and how long they may take, on every command that
    plays a bundle: each becomes the same Settings."""
    shared = ["--sandbox", "ray", "--ray-address", "10.0.0.5:6379", "--ray-resource", "envs",
              "--ray-node-sandbox", "docker", "--max-concurrent-envs", "3", "--deploy-timeout", "7",
              "--verifier-timeout", "8", "--bash-timeout", "9", "--max-env-reply", "65536"]
    parser = agentenv.command_line()
    made = []
    for command in (["check", str(NOTES)], ["serve", str(NOTES)],
                    ["eval", str(NOTES), "--model-url", "http://127.0.0.1:1/v1", "--model", "m"]):
        settings = agentenv.settings_of(parser.parse_args([*command, *shared]))
        made.append((settings.sandbox, agentenv.RayOptions.of(settings), settings.max_concurrent_envs,
                     settings.deploy_timeout, settings.verifier_timeout, settings.bash_timeout,
                     settings.max_env_reply))
    assert made == [("ray", agentenv.RayOptions("10.0.0.5:6379", "envs", 7.0, "docker"), 3, 7.0, 8.0,
                     9.0, 65536)] * 3


def test_serve_shows_the_settings_defaults_in_its_help(capsys):
    with pytest.raises(SystemExit):
        agentenv.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = agentenv.Settings()
    for flag, value in [("--deploy-timeout", defaults.deploy_timeout),
                        ("--tool-timeout", defaults.tool_timeout),
                        ("--reset-timeout", defaults.reset_timeout),
                        ("--idle-timeout", defaults.idle_timeout),
                        ("--client-timeout", defaults.client_timeout),
                        ("--reply-margin", defaults.reply_margin),
                        ("--status-interval", defaults.status_interval)]:
        after = text.rsplit(flag + " SECONDS", 1)[1]        # the help, not the usage line
        assert f"({value:g}) --" in after.split(" SECONDS", 1)[0] + " --", (flag, after[:200])
    assert f"MAX_CONCURRENT_ENVS, else {defaults.max_concurrent_envs})" in text


@pytest.mark.parametrize("argv, env, says", [
    (["--tool-timeout", "0"], {}, "--tool-timeout 0.0: it must be a positive number of seconds, such as 60"),
    (["--bash-timeout", "-3"], {}, "--bash-timeout -3.0: it must be a positive number of seconds"),
    ([], {"MAX_CONCURRENT_ENVS": "0"}, "--max-concurrent-envs 0 (or MAX_CONCURRENT_ENVS): it must be a "
                                       "whole number of at least 1, such as 8"),
    (["--max-concurrent-envs", "0"], {"MAX_CONCURRENT_ENVS": "16"},
     "--max-concurrent-envs 0 (or MAX_CONCURRENT_ENVS): it must be a whole number of at least 1"),
    (["--warm", "-1"], {}, "--warm -1 is not a whole number of warm envs (0 or more)"),
    (["--warm-env", "main"], {}, "--warm-env: main='' is not a whole number of warm envs"),
])
def test_serve_refuses_a_bad_setting_before_it_starts_saying_the_flag(make_bundle, monkeypatch, capsys,
                                                                     argv, env, says):
    """serve's flags go through the same check as build_app's arguments and a Gym config's keys."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = agentenv.main(["serve", str(make_bundle({"a": simple()})), "--sandbox", "local", *argv])
    assert code == 1
    assert says in capsys.readouterr().err


# ================================================================ Metrics and progress

def test_recent_durations_give_p50_p95_once_and_stay_bounded():
    recent = agentenv.Recent(size=128)
    assert recent.take() is None
    for n in range(101):
        recent.add(n / 100)
    assert recent.take() == (101, 0.5, 0.95)        # under the size: every one kept, exact
    assert recent.take() is None                     # taken: the next line starts afresh
    recent = agentenv.Recent(size=64)
    for n in range(10_000):
        recent.add(n % 100 / 100)
    count, p50, p95 = recent.take()
    assert count == 10_000 and len(recent.values) == 0
    assert 0.3 <= p50 <= 0.7 and 0.8 <= p95 <= 0.99   # a uniform sample of 64, not the last 64


def test_the_status_line_says_what_was_played_and_masked_in_one_sentence():
    metrics = agentenv.Metrics()
    assert metrics.status(0, 0, 8, 60) == "Status: 0 episodes played; 0 live of 8, 0 waiting; masked: none."
    for _ in range(3):
        metrics.ended("scored", "all", 1.0)
    metrics.ended("failed", "all", None)
    metrics.mask("gym", agentenv.Failure("transport_timeout", "slow"))
    metrics.mask("openenv", agentenv.Failure("transport_timeout", "slow"))
    metrics.mask("gym", agentenv.Failure("session_lost", "gone"))
    metrics.deployed("notebook", "local", 0.25)
    metrics.tool_called("write_note", "ok", 0.002)
    metrics.tool_called("(unknown)", "unknown_tool", None)        # not timed: it never ran
    assert metrics.status(2, 1, 8, 60) == (
        "Status: 4 episodes played (3 scored, 1 failed); 2 live of 8, 1 waiting; masked: 2 "
        "transport_timeout, 1 session_lost; over the last 60s: 1 deploy p50 250.0ms, p95 250.0ms; "
        "1 tool call p50 2.0ms, p95 2.0ms.")
    assert metrics.status(0, 0, 8, 60).endswith("masked: 2 transport_timeout, 1 session_lost.")


def test_two_metrics_count_apart_and_the_page_parses():
    from prometheus_client.parser import text_string_to_metric_families

    one, two = agentenv.Metrics(), agentenv.Metrics()
    one.tool_called("write_note", "ok", 0.01)
    one.watch("agentenv_sessions", "Live sessions, by wire", lambda: {"gym": 3}, "wire")
    one.watch("agentenv_sessions", "Live sessions, by wire", lambda: {"gym": 4}, "wire")   # replaced
    page, content_type = one.page(None)
    assert content_type.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(page.decode()) for s in f.samples}
    assert samples[("agentenv_tool_calls_total", (("status", "ok"), ("tool", "write_note")))] == 1
    assert samples[("agentenv_sessions", (("wire", "gym"),))] == 4
    assert b"write_note" not in two.page(None)[0]
    openmetrics, kind = one.page("application/openmetrics-text; version=1.0.0")
    assert kind.startswith("application/openmetrics-text") and openmetrics.endswith(b"# EOF\n")


def test_bucket_quantiles_are_estimated_as_prometheus_does():
    quantile = agentenv.bucket_quantile
    assert quantile(0.5, []) is None and quantile(0.5, [(1.0, 0), (float("inf"), 0)]) is None
    buckets = [(0.1, 2), (0.5, 6), (1.0, 10), (float("inf"), 10)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)   # within (0.1, 0.5]
    assert quantile(0.1, buckets) == pytest.approx(0.05)                      # the first from 0
    assert quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * (9.5 - 6) / 4)
    assert quantile(0.99, [(0.1, 1), (float("inf"), 5)]) == 0.1               # past the bounds


def test_the_numbers_of_a_run_are_what_the_registry_holds():
    metrics = agentenv.Metrics()
    empty = metrics.numbers()
    assert empty["episodes"] == {"played": 0, "scored": 0, "forfeited": 0, "failed": 0, "abandoned": 0,
                                 "live": None, "waiting": None, "limit": None}   # no pool watched
    assert (empty["rewards"], empty["masked"], empty["nodes"], empty["warm"]) == ({}, {}, [], None)
    assert empty["deploys"] == {"count": 0, "failed": 0, "p50": None, "p95": None}
    metrics.watch("agentenv_episodes_live", "live", lambda: 2)
    metrics.watch("agentenv_warm_envs", "warm", lambda: {"ready": 1, "booting": 0, "target": 2}, "state")
    metrics.watch("agentenv_envs_live", "by node", lambda: {"127.0.0.2": 2}, "node")
    for reward in (1.0, 1.0, 0.25, 0.0):
        metrics.ended("scored", "train", reward)
    metrics.ended("failed", "train", None)
    metrics.forfeited()                                  # the 0.0 above: the model broke its box
    metrics.mask("gym", agentenv.Failure("transport_timeout", "slow"))
    metrics.mask("openenv", agentenv.Failure("transport_timeout", "slow"))
    metrics.mask("gym", agentenv.Failure("session_lost", "gone"))
    for node, seconds in (("127.0.0.2", 0.3), ("127.0.0.2", 0.4), ("127.0.0.3", 0.35)):
        metrics.deployed("notebook", "ray", seconds, node)
    metrics.deploy_failed("notebook", "ray", "provider_unavailable")
    metrics.tool_called("write_note", "ok", 0.002)
    metrics.tool_called("(unknown)", "unknown_tool", None)
    numbers = metrics.numbers()
    assert numbers["episodes"] == {"played": 5, "scored": 4, "forfeited": 1, "failed": 1,
                                   "abandoned": 0, "live": 2, "waiting": None, "limit": None}
    assert list(numbers["masked"].items()) == [("transport_timeout", 2), ("session_lost", 1)]
    train = numbers["rewards"]["train"]
    assert (train["count"], train["mean"]) == (4, 0.5625)
    assert train["buckets"] == [[0.0, 1], [0.1, 0], [0.2, 0], [0.3, 1], [0.4, 0], [0.5, 0], [0.6, 0],
                                [0.7, 0], [0.8, 0], [0.9, 0], [1.0, 2]]
    assert numbers["deploys"]["count"] == 3 and numbers["deploys"]["failed"] == 1
    assert 0.25 <= numbers["deploys"]["p50"] <= 0.5 and 0.25 <= numbers["deploys"]["p95"] <= 0.5
    assert numbers["tool_calls"] == {"count": 2, "by_status": {"ok": 1, "unknown_tool": 1},
                                     "p50": pytest.approx(0.00175), "p95": pytest.approx(0.002425)}
    assert numbers["warm"] == {"ready": 1, "booting": 0, "target": 2}
    assert numbers["nodes"] == [{"node": "127.0.0.2", "envs": 2, "deploys": 2},
                                {"node": "127.0.0.3", "envs": 0, "deploys": 1}]
    json.dumps(numbers, allow_nan=False)                 # strict JSON, as the status route sends it


def test_verifier_rows_become_strict_json():
    assert agentenv.json_safe({"score": float("nan"), "rows": ({1, 2}, None, True, 2.5), 3: "x"}) == \
        {"score": "nan", "rows": ["{1, 2}", None, True, 2.5], "3": "x"}


def test_a_token_becomes_a_websocket_subprotocol():
    for token in ("plain", "with spaces/and+signs=", "ünïcödé 🔑"):
        protocol = agentenv.ws_token_protocol(token)
        assert re.fullmatch(r"agentenv\.bearer\.[A-Za-z0-9_-]+", protocol), protocol


def test_progress_says_the_first_and_last_step_and_little_between():
    lines: list[str] = []
    progress = agentenv.Progress("write-gym: listing", 50, lines.append, every=3600)
    for n in range(50):
        progress.step(f"toolset {n}")
    assert lines == ["write-gym: listing: 1/50 (toolset 0)", "write-gym: listing: 50/50 (toolset 49)"]
    lines.clear()
    every = agentenv.Progress("eval", 3, lines.append, every=0)
    for _ in range(3):
        every.step()
    assert lines == ["eval: 1/3", "eval: 2/3", "eval: 3/3"]


# ================================================================ Bundle

# -- loading, splits, ids

def test_a_bundle_loads_with_its_tasks_splits_and_description(make_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    root = make_bundle({"zeta": simple(), "alpha": replied(), "mid": simple()},
                       evals={"smoke": 'tasks = ["zeta", "alpha"]\n', "all-but": 'tasks = ["mid"]\n'})
    bundle = Bundle.load(root)
    assert bundle.name == "bundle"
    assert bundle.description == "Fake bundle for tests."
    assert list(bundle.splits) == ["all", "all-but", "smoke"]     # all first, then evals by file
    assert [t.name for t in bundle.splits["all"]] == ["alpha", "mid", "zeta"]
    assert [t.name for t in bundle.splits["smoke"]] == ["zeta", "alpha"]   # the eval's own order
    assert set(bundle.tasks) == {"alpha", "mid", "zeta"}
    assert bundle.task("smoke", 1).name == "alpha"
    assert list(bundle.envs) == ["main"]
    assert bundle.envs["main"].command == ("python", "server.py")
    zeta = bundle.tasks["zeta"]
    assert zeta.id == "@local/~/bundle/zeta"
    assert zeta.file == "zeta.json"
    assert zeta.reward_step == "check" and zeta.scoring_steps == ("check",)
    assert bundle.tasks["alpha"].reward_step == "answer"
    assert [s.id for s in zeta.turns] == ["turn1"]
    assert zeta.agent == "default-agent" and zeta.toolset.name == "main"


def test_bundle_task_lookup_says_what_exists(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple(), "b": simple()},
                                     evals={"smoke": 'tasks = ["a"]\n'}))
    with pytest.raises(LookupError, match=r"there is no split 'train'; the splits are all, smoke"):
        bundle.task("train", 0)
    with pytest.raises(LookupError, match=r"split 'all' has 2 tasks, so it has no task 2; give an "
                                          r"index from 0 to 1"):
        bundle.task("all", 2)
    for bad in (-1, True, "0"):
        with pytest.raises(LookupError):
            bundle.task("all", bad)
    assert bundle.task("all", 1).name == "b"


def test_description_is_empty_without_a_readme(make_bundle):
    assert Bundle.load(make_bundle({"a": simple()}, readme=None)).description == ""


def test_task_ids_outside_home_use_the_absolute_path(make_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    root = make_bundle({"a": simple()})
    assert task_id_root(root.resolve()) == "@local" + str(root.resolve())
    assert Bundle.load(root).tasks["a"].id == "@local" + str(root.resolve()) + "/a"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert task_id_root(root.resolve()) == "@local/~/bundle"


def test_evals_and_env_ids_may_use_full_ids(make_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    full = "@local/~/bundle/main"
    root = make_bundle({"a": [deploy(full, id="env"), agent(full), prompt(), outcome(env=full)]},
                       evals={"smoke": 'tasks = ["@local/~/bundle/a"]\n'})
    bundle = Bundle.load(root)
    assert [t.name for t in bundle.splits["smoke"]] == ["a"]
    assert bundle.tasks["a"].toolset.name == "main"


def test_tasks_that_share_envs_share_a_toolset(make_bundle):
    root = make_bundle({"a": simple(), "b": replied(),
                        "c": [deploy("main"), deploy("other"), agent("main", "other"), prompt(),
                              outcome()],
                        "d": [deploy("other"), agent("other"), prompt(), contains()],
                        "e": [deploy("main"), agent(), prompt(), contains()]},
                       envs=("main", "other"))
    bundle = Bundle.load(root)
    toolsets = {ts.name: [t.name for t in tasks] for ts, tasks in bundle.toolsets.items()}
    assert toolsets == {"main": ["a", "b"], "main+other": ["c"], "other": ["d"], "(no env)": ["e"]}
    assert bundle.tasks["a"].toolset == bundle.tasks["b"].toolset
    assert bundle.tasks["a"].toolset != bundle.tasks["d"].toolset


def test_reward_picks_the_scoring_step(make_bundle):
    root = make_bundle({"two": [deploy(), agent("main"), prompt(), outcome(), contains()],
                        "also": [deploy(), agent("main"), prompt(), contains(), outcome()]})
    bundle = Bundle.load(root, reward="answer")
    assert bundle.tasks["two"].reward_step == "answer"
    assert bundle.tasks["two"].scoring_steps == ("check", "answer")
    assert Bundle.load(root, reward="check").tasks["also"].reward_step == "check"


def test_seeded_fills_placeholders_in_string_leaves(make_bundle):
    root = make_bundle({"a": [deploy(), agent("main", system_prompt="You are <who>."),
                              config({"greeting": "<word>", "n": 3, "list": ["<word>", 7]}),
                              prompt("Say <word> to <nobody>."), contains("<word>")]})
    task = Bundle.load(root).tasks["a"]
    seeded = task.seeded({"word": "banana", "who": "a parrot"})
    fields = {s.id: s.fields for s in seeded.steps}
    assert fields["turn1"]["prompt"] == "Say banana to <nobody>."     # unknown keys stay
    assert fields["agent"]["system_prompt"] == "You are a parrot."
    assert fields["config"]["directives"][0]["args"] == {"greeting": "banana", "n": 3,
                                                         "list": ["banana", 7]}
    assert fields["answer"]["criteria"][0]["needles"] == ["banana"]
    assert task.steps[3].fields["prompt"] == "Say <word> to <nobody>."   # the task is unchanged
    assert task.seeded(None) is task and task.seeded({}) is task


# -- refusals

STEP_REFUSALS = {
    # case: (steps, parts the problem must have)
    "unknown step type": (
        simple() + [{"id": "run", "type": "snapshot_env", "env_id": "notes"}],
        ["step 'run'", "type 'snapshot_env'", "does not run", "deploy_env, apply_server_config, "
         "deploy_agent, prompt_agent, env_outcome_verifier, agent_prompt_response_verifier, "
         "deploy_sandbox, add_skills, load_artifact, run_code"]),
    "a type that is not text": (
        simple() + [{"id": "run", "type": ["deploy_env"]}, {"id": "run2", "type": {"a": 1}}],
        ["step 'run'", "type ['deploy_env']", "does not run", "deploy_env, apply_server_config"]),
    "unknown field": (
        [deploy(), agent("main"), prompt(temperature=0.2), outcome()],
        ["step 'turn1'", "has the field 'temperature'", "does not support",
         "a prompt_agent step takes agent_name, prompt, prompt_id, system_prompt, timeout_seconds"]),
    "missing required field": (
        [deploy(), agent("main"), prompt(),
         {"id": "check", "type": "env_outcome_verifier", "env_id": "main"}],
        ["step 'check'", "lacks the field 'file_artifact_id'; add it"]),
    "duplicate step id": (
        [deploy(), agent("main"), prompt(), prompt("Again.", id="turn1"), outcome()],
        ["step 'turn1'", "the id is used twice"]),
    "depends_on a later step": (
        [deploy(), agent("main"), prompt(depends_on=["check"]), outcome()],
        ["step 'turn1'", "depends_on names 'check', which is not an earlier step"]),
    "depends_on an unknown step": (
        [deploy(), agent("main"), prompt(depends_on=["nowhere"]), outcome()],
        ["step 'turn1'", "depends_on names 'nowhere'"]),
    "depends_on not a list": (
        [deploy(), agent("main"), prompt(depends_on="agent"), outcome()],
        ["step 'turn1'", "depends_on must be a list of earlier step ids"]),
    "retry_config": (
        [deploy(), agent("main"), prompt(retry_config={"max_attempts": 3}), outcome()],
        ["step 'turn1'", "retry_config can replay a turn played from outside; remove it"]),
    "env_id not in envs/": (
        [deploy("nowhere"), agent("nowhere"), prompt(), contains()],
        ["step 'deploy-nowhere'", "env_id 'nowhere' names no env of the bundle; it has main, other",
         "add envs/nowhere/"]),
    "env deployed twice": (
        [deploy(), deploy(id="again"), agent("main"), prompt(), outcome()],
        ["step 'again'", "deploys 'main' a second time; deploy each env once"]),
    "env_ids naming an undeployed env": (
        [deploy(), agent("main", "other"), prompt(), outcome()],
        ["step 'agent'", "env_ids names 'other', which no earlier deploy_env step of the task "
         "deploys"]),
    "env_ids not a list": (
        [deploy(), {"id": "agent", "type": "deploy_agent", "env_ids": "main"}, prompt(), outcome()],
        ["step 'agent'", "env_ids must be a list of env ids"]),
    "verifier on an undeployed env": (
        [deploy(), agent("main"), prompt(), outcome(env="other")],
        ["step 'check'", "env_id 'other' is not deployed by an earlier deploy_env step"]),
    "prompt_agent for an undeployed agent": (
        [deploy(), agent("main"), prompt(agent_name="ghost"), outcome()],
        ["step 'turn1'", "prompts agent 'ghost', which no earlier deploy_agent step deploys"]),
    "two agents": (
        [deploy(), agent("main"), agent("main", id="agent2", agent_name="critic"), prompt(),
         outcome()],
        ["deploys agents critic, default-agent", "plays one agent from outside", "exactly one"]),
    "the same agent twice": (
        [deploy(), agent("main"), agent("main", id="agent2"), prompt(), outcome()],
        ["step 'agent2'", "deploys agent 'default-agent' a second time"]),
    "no prompt_agent": (
        [deploy(), agent("main"), outcome()],
        ["prompts no agent, so there is no turn to play; add a prompt_agent step"]),
    "empty prompt": (
        [deploy(), agent("main"), prompt("  "), outcome()],
        ["step 'turn1'", "prompt must be non-empty text"]),
    "verifier artifact missing": (
        [deploy(), agent("main"), prompt(), outcome("nope")],
        ["step 'check'", "file_artifact_id 'nope' names no verifier artifact",
         "add artifacts/nope/verify.py with `async def verify(mcp_url)`"]),
    "bad score_aggregator": (
        [deploy(), agent("main"), prompt(), outcome(score_aggregator="median")],
        ["step 'check'", "score_aggregator 'median' is not one of all_pass, any_pass, "
         "weighted_average"]),
    "bad criterion type": (
        [deploy(), agent("main"), prompt(),
         {**contains(), "criteria": [{"type": "response_equals", "value": "hi"}]}],
        ["step 'answer'", "criterion #0 has type 'response_equals'; the types are "
         "response_contains, response_regex_present"]),
    "criteria not a list": (
        [deploy(), agent("main"), prompt(), {**contains(), "criteria": {"type": "x"}}],
        ["step 'answer'", "criteria must be a list"]),
    "empty needles": (
        [deploy(), agent("main"), prompt(),
         {**contains(), "criteria": [{"type": "response_contains", "needles": []}]}],
        ["step 'answer'", "criterion #0 (response_contains) needs a non-empty list of strings"]),
    "bad regex": (
        [deploy(), agent("main"), prompt(),
         {**contains(), "criteria": [{"type": "response_contains", "needles": ["a"]},
                                     {"type": "response_regex_present", "pattern": "(unclosed"}]}],
        ["step 'answer'", "criterion #1 (response_regex_present)", "don't compile",
         "missing ), unterminated subpattern"]),
    "empty regex": (
        [deploy(), agent("main"), prompt(),
         {**contains(), "criteria": [{"type": "response_regex_present", "pattern": ""}]}],
        ["step 'answer'", "criterion #0 (response_regex_present)", "the pattern is empty"]),
    "bad regex flag": (
        [deploy(), agent("main"), prompt(),
         {**contains(), "criteria": [{"type": "response_regex_present", "pattern": "a",
                                      "flags": ["ignorecase"]}]}],
        ["step 'answer'", "'ignorecase' is not a re flag name such as IGNORECASE"]),
    "prompt_id naming no prompt": (
        [deploy(), agent("main"), prompt(), contains(prompt_id="turn9")],
        ["step 'answer'", "prompt_id 'turn9' names no earlier prompt_agent step; give that step "
         "the same prompt_id"]),
    "no scoring step": (
        [deploy(), agent("main"), prompt()],
        ["records no score, so it has no reward; add an env_outcome_verifier or "
         "agent_prompt_response_verifier step"]),
    "several scoring steps without reward": (
        [deploy(), agent("main"), prompt(), outcome(), contains()],
        ["records a score at each of check, answer; name the one that is its reward with "
         "--reward <step id>"]),
    "bad directives": (
        [deploy(), {"id": "config", "type": "apply_server_config", "env_id": "main",
                    "directives": []}, agent("main"), prompt(), outcome()],
        ["step 'config'", "directives must be a non-empty list of {service, uri, args}"]),
    "bad directive": (
        [deploy(), {"id": "config", "type": "apply_server_config", "env_id": "main",
                    "directives": [{"service": "*", "args": {}}]}, agent("main"), prompt(),
         outcome()],
        ["step 'config'", "directive #0 must be"]),
    "timeout not positive": (
        [deploy(), agent("main"), prompt(timeout_seconds=0), outcome()],
        ["step 'turn1'", "timeout_seconds must be a positive number"]),
    "fail_task_on_error not a bool": (
        [deploy(), agent("main"), prompt(), outcome(fail_task_on_error="no")],
        ["step 'check'", "fail_task_on_error must be true or false"]),
    "a field of the wrong type": (
        [deploy(), agent("main", role=7), prompt(), outcome()],
        ["step 'agent'", "role must be a string"]),
    "a step that isn't an object": (
        [deploy(), agent("main"), "prompt", outcome()],
        ["step #2 is not a JSON object"]),
    "a step without id": (
        [{"type": "deploy_env", "env_id": "main"}, agent("main"), prompt(), outcome()],
        ["step #0 has no id; give every step a unique \"id\""]),
}


@pytest.mark.parametrize("case", list(STEP_REFUSALS))
def test_a_task_that_cant_be_played_is_refused_with_a_clear_message(make_bundle, case):
    steps, parts = STEP_REFUSALS[case]
    root = make_bundle({"good": simple(), "t": steps}, envs=("main", "other"))
    problems = refused(root)
    found = problem_with(problems, *parts)
    assert found.startswith("tasks/t.json: ")
    assert not [p for p in problems if "good.json" in p], "the good task was refused too"


def test_two_turns_that_could_be_open_at_once_are_refused(make_bundle):
    steps = [deploy(), agent("main"), prompt(depends_on=["agent"]),
             prompt("Again.", id="turn2", depends_on=["agent"]), outcome()]
    assert refused(make_bundle({"good": simple(), "t": steps})) == [
        "tasks/t.json: task 't' step 'turn2': may open while turn 'turn1' is still open; the agent "
        "plays one turn at a time, so add 'turn1' to its depends_on"]
    ordered = [deploy(), agent("main"), prompt(depends_on=["agent"]),
               prompt("Again.", id="turn2", depends_on=["turn1"]), outcome()]
    assert [t.id for t in Bundle.load(make_bundle({"t": ordered})).tasks["t"].turns] == \
        ["turn1", "turn2"]


def test_reward_naming_a_step_a_task_lacks(make_bundle):
    root = make_bundle({"a": simple(), "b": [deploy(), agent("main"), prompt(), outcome(),
                                             contains()]})
    problems = refused(root, reward="answer")
    assert problems == ["tasks/a.json: task 'a': records no score at step 'answer'; it records "
                        "them at ['check']"]


def test_several_problems_come_in_one_error(make_bundle):
    root = make_bundle({"a": [deploy("nowhere"), agent(), prompt(), contains()],
                        "b": [deploy(), agent("main"), prompt(), outcome(score_aggregator="mean")],
                        "c": "not json"},
                       evals={"smoke": 'tasks = ["a", "zzz"]\n'},
                       files={"agents/helper/agent.toml": "x = 1\n"})
    problems = refused(root)
    assert len(problems) == 5
    assert problems == sorted(problems)
    problem_with(problems, "tasks/a.json", "'nowhere'")
    problem_with(problems, "tasks/b.json", "'mean'")
    problem_with(problems, "tasks/c.json", "is not valid JSON")
    problem_with(problems, "evals/smoke.toml", "'zzz'")
    problem_with(problems, "agents/")
    # an eval listing a task that has problems of its own is not blamed for it
    assert not [p for p in problems if "smoke.toml" in p and "'a'" in p]


def test_a_bundle_path_that_does_not_exist(tmp_path):
    problems = refused(tmp_path / "nope")
    assert problems == [f"{tmp_path / 'nope'}: there is no bundle folder here; pass the folder "
                        "that holds envs/, tasks/ and evals/"]


@pytest.mark.parametrize("text, parts", [
    ("{not json", ["tasks/t.json: is not valid JSON", "a task is a JSON array of step objects"]),
    ('{"id": "x"}', ["tasks/t.json: a task is a non-empty JSON array of step objects"]),
    ("[]", ["tasks/t.json: a task is a non-empty JSON array of step objects"]),
])
def test_a_task_file_that_is_not_a_json_array(make_bundle, text, parts):
    problems = refused(make_bundle({"good": simple(), "t": text}))
    problem_with(problems, *parts)
    assert len(problems) == 1


def test_a_task_folder_or_stray_file_in_tasks(make_bundle):
    root = make_bundle({"good": simple()},
                       files={"tasks/t/task.json": json.dumps(simple()), "tasks/notes.txt": "hi"})
    assert refused(root) == [
        "tasks/notes.txt: a task is a .json file; rename or remove it",
        "tasks/t/: task folders are not supported; write tasks/t.json"]


def test_a_bundle_without_tasks(make_bundle):
    root = make_bundle({})
    assert refused(root) == ["tasks/: there are no tasks; add tasks/<name>.json"]
    shutil.rmtree(root / "tasks")
    assert refused(root) == ["tasks/: the bundle has no tasks folder; add tasks/<name>.json"]


@pytest.mark.parametrize("text, parts", [
    ('tasks = ["a", "ghost"]\n', ["evals/smoke.toml: lists 'ghost', which is not a task of the bundle"]),
    ('tasks = ["a", "a"]\n', ["evals/smoke.toml: lists 'a' twice; an eval lists each task once"]),
    ('tasks = ["a"]\nshuffle = true\n',
     ["evals/smoke.toml: key 'shuffle' is not one an eval takes (tasks, type, id)"]),
    ("tasks = []\n", ["evals/smoke.toml: tasks must be a non-empty list of task names"]),
    ("tasks = [\n", ["smoke.toml: is not valid TOML", "fix the syntax"]),
])
def test_an_eval_that_cant_be_a_split(make_bundle, text, parts):
    problems = refused(make_bundle({"a": simple()}, evals={"smoke": text}))
    problem_with(problems, *parts)
    assert len(problems) == 1


def test_an_eval_named_all(make_bundle):
    assert refused(make_bundle({"a": simple()}, evals={"all": 'tasks = ["a"]\n'})) == [
        "evals/all.toml: eval 'all' has the name of the split that holds every task; rename it"]


def test_an_eval_that_is_not_toml(make_bundle):
    root = make_bundle({"a": simple()}, files={"evals/smoke.yaml": "tasks: [a]\n"})
    assert refused(root) == ["evals/smoke.yaml: an eval is a .toml file with tasks = [...]; rename "
                             "or remove it"]


def test_an_env_without_a_dockerfile(make_bundle):
    root = make_bundle({"a": simple()})
    (root / "envs" / "main" / "Dockerfile").unlink()
    problems = refused(root)
    problem_with(problems, "envs/main: has no Dockerfile", "add envs/main/Dockerfile with the "
                 "command that starts the MCP server")
    # and so the task that deploys it is refused too, naming the env
    problem_with(problems, "tasks/a.json", "env_id 'main' names no env of the bundle")


def test_an_env_whose_dockerfile_has_no_cmd(make_bundle):
    root = make_bundle({"a": simple()})
    (root / "envs" / "main" / "Dockerfile").write_text("FROM python:3.11-slim\nCOPY . .\n")
    problem_with(refused(root), "envs/main/Dockerfile: has no CMD or ENTRYPOINT",
                 'add CMD ["python", "server.py"]')


def test_an_env_whose_cmd_is_bad_json(make_bundle):
    root = make_bundle({"a": simple()})
    (root / "envs" / "main" / "Dockerfile").write_text('FROM x\nCMD ["python", server.py]\n')
    problem_with(refused(root), "envs/main/Dockerfile: CMD", "is not valid JSON")


@pytest.mark.parametrize("toml, parts", [
    ('type = "mcp_server"\nports = [1]\n',
     ["envs/main/env.toml: key 'ports' is not one agentenv.py knows; it knows env_provider_type, "
      "environment_name, id, image, network, type"]),
    ('network = "internet"\n', ["envs/main/env.toml: network = 'internet' is not a network mode; use "
                                "\"isolated\" (the default: no egress, no other episode's containers) "
                                "or \"bridge\""]),
    ('type = "a2a_agent"\n', ["envs/main/env.toml: type 'a2a_agent' is not run here",
                              "runs mcp_server envs"]),
    ('image = "python:3.11"\n', ["envs/main/env.toml: image = 'python:3.11' is not supported"]),
    ("type = \n", ["env.toml: is not valid TOML"]),
])
def test_an_env_toml_that_cant_be_run(make_bundle, toml, parts):
    root = make_bundle({"a": simple()}, files={"envs/main/env.toml": toml})
    problem_with(refused(root), *parts)


def test_env_toml_names_the_env_and_its_dockerfile(make_bundle):
    root = make_bundle({"a": simple()}, files={
        "envs/main/env.toml": 'type = "mcp_server"\nenvironment_name = "fancy"\n'
                              'image = {dockerfile = "Serve.dockerfile"}\n',
        "envs/main/Serve.dockerfile": 'FROM x\nENTRYPOINT ["python"]\nCMD ["server.py", "-v"]\n'})
    env = Bundle.load(root).envs["main"]
    assert env.environment_name == "fancy"
    assert env.dockerfile.name == "Serve.dockerfile"
    assert env.command == ("python", "server.py", "-v")
    assert env.network == "isolated", "an env is isolated unless its env.toml says otherwise"
    (root / "envs" / "main" / "env.toml").write_text('network = "bridge"\n')
    assert Bundle.load(root).envs["main"].network == "bridge"


@pytest.mark.parametrize("stray, parts", [
    ("agents/helper/", ["agents/: agentenv.py plays the agent from outside and runs no agents",
                        "remove the folder"]),
    ("skills/s/", ["skills/s/: has no SKILL.md", "a skill is a folder with its SKILL.md"]),
    ("bundle.toml", ["bundle.toml: reserved", "remove it"]),
])
def test_folders_and_files_agentenv_does_not_run(make_bundle, stray, parts):
    root = make_bundle({"a": simple()}, files={stray.rstrip("/") + ("/x.toml" if stray.endswith("/")
                                                                    else ""): "x = 1\n"})
    problems = refused(root)
    problem_with(problems, *parts)
    assert len(problems) == 1


@pytest.mark.parametrize("source, parts", [
    ("def helper():\n    pass\n", ["has no `async def verify(mcp_url)`", "returns a list of "
                                                                           "{id, result, description} rows"]),
    ("def verify(mcp_url):\n    return []\n", ["has no `async def verify(mcp_url)`"]),
    ("async def verify(mcp_url, extra):\n    return []\n",
     ["verify must take exactly one argument without a default"]),
    ("async def verify(:\n", ["does not parse", "fix it"]),
])
def test_a_verifier_artifact_that_cant_be_called(make_bundle, source, parts):
    root = make_bundle({"a": simple()})
    (root / "artifacts" / "check" / "verify.py").write_text(source)
    problems = refused(root)
    problem_with(problems, "artifacts/check/verify.py: ", *parts)
    # the task that names it is refused as well
    problem_with(problems, "tasks/a.json", "file_artifact_id 'check' names no verifier artifact")


def test_a_verifier_with_an_optional_second_argument_loads(make_bundle):
    root = make_bundle({"a": simple()})
    (root / "artifacts" / "check" / "verify.py").write_text(
        "async def verify(mcp_url, retries=3):\n    return []\n")
    assert "check" in Bundle.load(root).verifiers


def test_a_step_that_does_not_depend_on_the_deploy_of_its_env_is_refused(make_bundle):
    root = make_bundle({"a": [deploy(), config({"greeting": "hi"}, depends_on=[]),
                              agent("main"), prompt(), outcome()]})
    problem_with(refused(root), "tasks/a.json", "step 'config'", "depends_on")


# -- the agent's sandbox: its step types, checked

def boxed(*steps, agent_name="solver"):
    """A task whose agent ``solver`` works in a box: deploy it, ``steps``, a turn, a box check."""
    return [{"id": "agent", "type": "deploy_agent", "agent_name": agent_name}, *steps,
            prompt(agent_name=agent_name),
            {"id": "check", "type": "verify_sandbox", "agent_name": agent_name,
             "criteria": [{"type": "probe_file_exists", "paths": ["x"]}]}]


def load(**fields):
    return {"id": "load", "type": "load_artifact", **fields}


@pytest.mark.parametrize("steps, parts", [
    ([{"id": "i", "type": "install_agent", "sandbox_name": "vm"}],
     ["step 'i' (install_agent): install_agent installs the agent from the network",
      "deploy the agent with deploy_agent, whose box agentenv.py builds offline"]),
    ([load(agent_name="solver", urls=["https://example.com/x.txt"])],
     ["step 'load'", "urls are downloads, and agentenv.py runs without network",
      "load them with artifact_id"]),
    ([load(agent_name="solver", artifact_id="nope")],
     ["step 'load'", "artifact 'nope' names no artifact of the bundle; add artifacts/nope/"]),
    ([load(artifact_id="check")], ["step 'load'", "names where to load: set agent_name"]),
    ([load(agent_name="solver")], ["step 'load'", "names nothing to load; set artifact_id"]),
    ([{"id": "s", "type": "add_skills", "agent_name": "solver",
       "skills": [{"name": "x", "description": "d", "object_url": "s3://b/x"}]}],
     ["step 's'", "skill #0 is fetched from a URL, and boxes here have no network",
      "skills/<name>/SKILL.md"]),
    ([{"id": "s", "type": "add_skills", "agent_name": "solver",
       "skills": [{"name": "Bad Name", "description": "d", "body": "b"}]}],
     ["step 's'", "skill #0: name 'Bad Name' must be 1-64 of a-z, 0-9 and single hyphens"]),
    ([{"id": "s", "type": "add_skills", "agent_name": "solver",
       "skills": [{"skill_artifact_id": "ghost"}]}],
     ["skill_artifact_id 'ghost' names no skill of the bundle"]),
    ([{"id": "vm", "type": "deploy_sandbox", "sandbox_name": "vm", "sandbox_mode": "pod"}],
     ["step 'vm'", "sandbox_mode must be one of ['container', 'vm'], got 'pod'"]),
    ([{"id": "vm", "type": "deploy_sandbox", "sandbox_name": "vm", "sandbox_mode": "container"}],
     ["step 'vm'", "a container-mode sandbox runs an image: set image"]),
    ([{"id": "c", "type": "run_docker_container", "sandbox_name": "vm",
       "docker_context_url": "https://example.com/c.zip"}],
     ["step 'c'", "sandbox_name 'vm' is not deployed by an earlier deploy_sandbox step"]),
    ([{"id": "u", "type": "run_container_unit_tests_verifier", "command": "true",
       "sandbox_name": "vm", "container_name": "c"}],
     ["step 'u'", "sandbox_name 'vm' is not deployed"]),
    ([{"id": "u", "type": "run_container_unit_tests_verifier", "command": "true",
       "agent_name": "solver", "env_vars": {"A-B": "1"}}],
     ["env_vars key 'A-B' is not a POSIX name ([A-Za-z_][A-Za-z0-9_]*)"]),
    ([{"id": "r", "type": "run_code", "agent_name": "solver", "script_artifact_id": "check",
       "script_file": "run.py"}],
     ["step 'r'", "script 'run.py' is not a .py file at the top of artifacts/check/", "verify.py"]),
    ([{"id": "r", "type": "reset_env", "env_id": "ghost"}],
     ["step 'r'", "env_id: there is no env 'ghost' in the bundle"]),
    ([{"id": "t", "type": "aggregate_verifiers", "verifier_ids": ["later"]}],
     ["step 't'", "verifier_ids names 'later', which no earlier scoring step records"]),
    ([{"id": "v", "type": "verify_sandbox", "sandbox_name": "vm", "agent_name": "solver"}],
     ["verify_sandbox: set either `agent_name` or `sandbox_name`, not both"]),
    ([{"id": "vm", "type": "deploy_sandbox", "sandbox_name": "vm", "sandbox_mode": "vm"},
      {"id": "c", "type": "run_docker_container", "sandbox_name": "vm",
       "docker_context_artifact_id": "check", "command_override": "sleep 'infinity"}],
     ["step 'c'", "command_override must be the command as text (AgentEnv's: 'sleep infinity', "
                  "split as a shell splits it) or a list of strings"]),
])
def test_a_sandbox_step_that_cant_run_is_refused_saying_why(make_bundle, steps, parts):
    root = make_bundle({"t": boxed(*steps)}, envs=(), artifacts=("check",))
    problem_with(refused(root, reward="check"), "tasks/t.json", *parts)


def vm(mode="vm", **fields):
    return {"id": "vm", "type": "deploy_sandbox", "sandbox_name": "vm", "sandbox_mode": mode,
            **fields}


def placed(*steps, sandbox=None):
    """A task whose agent ``solver`` is placed on sandbox ``vm`` and works in a box there."""
    return [sandbox or vm(exposed_ports=[8000]), *steps,
            {"id": "agent", "type": "deploy_agent", "agent_name": "solver", "sandbox_name": "vm"},
            prompt(agent_name="solver"),
            {"id": "check", "type": "verify_sandbox", "agent_name": "solver",
             "criteria": [{"type": "probe_file_exists", "paths": ["x"]}]}]


WEB_CONTEXT = {"artifacts/web/Dockerfile": "FROM python:3.11-slim\n"}


@pytest.mark.parametrize("steps, parts", [
    # an agent that works in a box, placed on a sandbox: only a VM-mode one exposing 8000
    (placed(sandbox=vm("container", image="x")),
     ["step 'agent'", "Cannot link agent to sandbox 'vm' (mode='container'); only VM-mode "
      "sandboxes can host an additional agent container"]),
    (placed(sandbox=vm()),
     ["step 'agent'", "Sandbox 'vm' does not expose port 8000; re-deploy it with "
      "exposed_ports=[8000]"]),
    (placed({"id": "c", "type": "run_docker_container", "sandbox_name": "vm",
             "docker_context_artifact_id": "web", "extra_networks": ["host"]}),
     ["step 'c'", "extra_networks names 'host', which is a network mode"]),
    (placed({"id": "c", "type": "run_docker_container", "sandbox_name": "vm",
             "docker_context_artifact_id": "web", "network": 3}),
     ["step 'c'", "network must be a string"]),
    (placed(*[{"id": c, "type": "run_docker_container", "sandbox_name": "vm",
               "docker_context_artifact_id": "web"} for c in ("c", "d")]),
     ["step 'd'", "container 'task-container' already runs on sandbox 'vm'; give each container "
      "of a sandbox its own container_name"]),
    # a step acting where an env runs: a deployed env, and one target
    (boxed({"id": "r", "type": "run_code", "env_id": "main", "agent_name": "solver",
            "script_artifact_id": "check", "script_file": "verify.py"}),
     ["step 'r'", "run_code: set at most one of `env_id`, `sandbox_name` and `agent_name`; got "
      "['env_id', 'agent_name']"]),
    (boxed({"id": "r", "type": "run_code", "env_id": "main", "script_artifact_id": "check",
            "script_file": "verify.py"}),
     ["step 'r'", "env_id 'main' is not deployed by an earlier deploy_env step"]),
    (boxed(load(env_id="main", agent_name="solver", artifact_id="check")),
     ["step 'load'", "names where to load", "env_id (a deployed env), one of them"]),
    (boxed(load(container_name="c", artifact_id="check")),
     ["step 'load'", "names where to load"]),
    (boxed(load(container_name="c", agent_name="solver", artifact_id="check")),
     ["step 'load'", "`container_name` requires `sandbox_name`"]),
])
def test_a_step_placed_on_a_sandbox_or_an_env_that_cant_run_is_refused(make_bundle, steps, parts):
    root = make_bundle({"t": steps}, artifacts=("check",), files=WEB_CONTEXT)
    problem_with(refused(root, reward="check"), "tasks/t.json", *parts)


def test_an_agent_placed_on_a_sandbox_and_steps_where_an_env_runs_load(make_bundle):
    root = make_bundle({"t": [deploy("main"), *placed(
        {"id": "c", "type": "run_docker_container", "sandbox_name": "vm",
         "docker_context_artifact_id": "web", "network": "backend", "extra_networks": ["bridge"]},
        load(env_id="main", artifact_id="check"),
        {"id": "r", "type": "run_code", "env_id": "main", "script_artifact_id": "check",
         "script_file": "verify.py"})]}, artifacts=("check",), files=WEB_CONTEXT)
    task = Bundle.load(root, reward="check").tasks["t"]
    assert task.sandboxed
    # placed only (it works in no box): where it is placed does not matter, as in AgentEnv
    alone = [vm("container", image="x"), {"id": "agent", "type": "deploy_agent",
                                           "agent_name": "solver", "sandbox_name": "vm"},
             prompt(agent_name="solver"), contains()]
    assert not Bundle.load(make_bundle({"t": alone}, envs=()), reward="answer").tasks["t"].sandboxed


def test_command_override_is_agentenvs_text_split_as_a_shell_splits_it_or_a_list():
    assert agentenv._shell_words("sh -c 'sleep infinity'") == ["sh", "-c", "sleep infinity"]
    assert agentenv._shell_words("sleep 'infinity") is None
    sandbox = agentenv.DockerSandbox.__new__(agentenv.DockerSandbox)
    sandbox.owner, sandbox.images = "me", {}
    for given, command in (("sleep infinity", ["sleep", "infinity"]),
                           (["sleep", "infinity"], ["sleep", "infinity"])):
        options = sandbox.box_options("e", "vm/task-container", {"command_override": given}, "img")
        assert options["command"] == command and options["network_mode"] == "none"


def test_sandbox_steps_that_check_load_and_the_turns_offer_bash(make_bundle):
    root = make_bundle({"t": boxed(
        {"id": "vm", "type": "deploy_sandbox", "sandbox_name": "vm", "sandbox_mode": "vm",
         "cpu": 2, "memory_mb": 1024, "network_policy": {"mode": "allow_all"}},
        load(agent_name="solver", artifacts=[{"id": "check"}], destination_path="/app/in"),
        {"id": "run", "type": "run_code", "sandbox_name": "vm", "script_artifact_id": "check",
         "entrypoint": "verify", "args": {"n": 1}},
        {"id": "reset", "type": "reset_env", "env_id": "main"})},
        files={"skills/notes/SKILL.md": "---\nname: notes\ndescription: d\n---\nx\n"})
    loaded = Bundle.load(root)
    task = loaded.tasks["t"]
    assert task.sandboxed and task.toolset == agentenv.Toolset((), True)
    assert task.toolset.name == "bash" and task.reward_step == "check"
    assert set(loaded.skills) == {"notes"} and set(loaded.artifacts) == {"check"}
    reset = next(s for s in task.steps if s.id == "reset")
    assert reset.fail_task_on_error is False                # reset_env is tolerant by default
    assert loaded.boxed


# AgentEnv's rule for when the played agent works in a box, the 12 cases the spec measured.
@pytest.mark.parametrize("steps, sandboxed", [
    ([], False),
    ([{"id": "x", "type": "add_skills", "agent_name": "a", "skills": []}], True),
    ([{"id": "x", "type": "load_artifact", "agent_name": "a", "artifact_id": "check"}], True),
    ([{"id": "vm", "type": "deploy_sandbox", "sandbox_name": "vm", "sandbox_mode": "vm"},
      {"id": "x", "type": "load_artifact", "sandbox_name": "vm", "artifact_id": "check"}], False),
    ([{"id": "x", "type": "run_code", "agent_name": "a", "script_artifact_id": "check",
       "script_file": "verify.py"}], True),
    ([{"id": "x", "type": "verify_sandbox", "agent_name": "a"}], True),
    ([{"id": "vm", "type": "deploy_sandbox", "sandbox_name": "vm", "sandbox_mode": "vm"},
      {"id": "x", "type": "verify_sandbox", "sandbox_name": "vm"}], False),
])
def test_when_the_agent_works_in_a_sandbox(make_bundle, steps, sandboxed):
    task = [{"id": "agent", "type": "deploy_agent", "agent_name": "a"}, *steps, prompt(agent_name="a"),
            contains()]
    root = make_bundle({"t": task}, envs=())
    assert Bundle.load(root, reward="answer").tasks["t"].sandboxed is sandboxed


def test_skills_on_deploy_make_the_agent_work_in_a_box_and_default_names_match_only_themselves():
    step = agentenv.Step
    deploy_ = step("agent", "deploy_agent", (), True, {"agent_name": "a", "skills": [{"name": "s"}]})
    assert agentenv.works_in_sandbox([deploy_], "a")
    placed = step("agent", "deploy_agent", (), True, {"agent_name": "a", "sandbox_name": "vm"})
    assert not agentenv.works_in_sandbox([placed], "a")
    verify = step("v", "verify_sandbox", (), True, {})          # the default agent's box
    assert not agentenv.works_in_sandbox([verify], "a")
    assert agentenv.works_in_sandbox([verify], agentenv.DEFAULT_AGENT)
    run_code = step("r", "run_code", (), True, {"script_artifact_id": "x"})
    assert not agentenv.works_in_sandbox([run_code], "a")


# -- parse_dockerfile

def test_parse_dockerfile_exec_form_and_env():
    command, env = parse_dockerfile(
        "# a comment\nFROM python:3.11-slim\nENV A=1 B=\"two words\"\nENV LEGACY some value\n"
        "cmd [\"python\", \"server.py\"]\n")
    assert command == ("python", "server.py")
    assert env == {"A": "1", "B": "two words", "LEGACY": "some value"}


def test_parse_dockerfile_shell_form():
    assert parse_dockerfile("FROM x\nCMD python server.py --port 1\n")[0] == \
        ("/bin/sh", "-c", "python server.py --port 1")


def test_parse_dockerfile_entrypoint_and_cmd():
    assert parse_dockerfile('FROM x\nENTRYPOINT ["python", "-u"]\nCMD ["server.py"]\n')[0] == \
        ("python", "-u", "server.py")
    assert parse_dockerfile('FROM x\nENTRYPOINT ["python", "server.py"]\n')[0] == ("python", "server.py")
    assert parse_dockerfile('FROM x\nCMD ["a"]\nCMD ["b"]\n')[0] == ("b",)     # the last CMD wins


def test_parse_dockerfile_continuation_lines():
    command, env = parse_dockerfile('FROM x\nENV A=1 \\\n    B=2\nCMD ["python", \\\n     '
                                    '"server.py", \\\r\n "--fast"]\n')
    assert command == ("python", "server.py", "--fast")
    assert env == {"A": "1", "B": "2"}


def test_parse_dockerfile_refuses_no_command_and_bad_json():
    with pytest.raises(ValueError, match="has no CMD or ENTRYPOINT"):
        parse_dockerfile("FROM x\nRUN echo hi\n")
    with pytest.raises(ValueError, match=r"ENTRYPOINT \[python\] is not valid JSON"):
        parse_dockerfile("FROM x\nENTRYPOINT [python]\n")


def test_parse_dockerfile_keeps_a_cmd_set_before_entrypoint_in_the_same_stage():
    assert parse_dockerfile('FROM x\nCMD ["server.py"]\nENTRYPOINT ["python"]\n')[0] == \
        ("python", "server.py")


# ================================================================ Sandbox

# -- choosing one: local, docker, auto

class _ZonedLocal(agentenv.LocalSandbox):
    """A provider added as the module docstring says (one class, its settings declared): local
    processes under another name, with an option of its own, which its connect records."""

    kind = "zoned"
    summary = "local processes, in a zone"
    place = "in a zone"
    settings = (agentenv.Declared("zone_name", None, lambda value, what: str(value),
                                  "with --sandbox zoned: the zone", metavar="ZONE"),)
    zones: list = []

    @classmethod
    async def connect(cls, owner, settings):
        cls.zones.append(settings.zone_name)
        return cls(owner)


@pytest.fixture
def zoned(monkeypatch):
    """The zoned provider in the registry for one test, and its setting declared."""
    monkeypatch.setitem(agentenv.PROVIDERS, "zoned", _ZonedLocal)
    monkeypatch.setitem(agentenv.Settings.DECLARED, "zone_name", _ZonedLocal.settings[0])
    monkeypatch.setattr(_ZonedLocal, "zones", [])
    return _ZonedLocal


def test_the_commands_build_app_and_a_gym_config_read_the_provider_registry(zoned, make_bundle,
                                                                          capsys, tmp_path):
    """--sandbox's choices (check, serve, eval, write-gym), each provider's flags, build_app's
    keywords and a Gym config's keys come from the registry: a provider added there is offered
    everywhere, and plays."""
    root = make_bundle({"a": simple()})
    parser = agentenv.command_line()
    for command in (["check", str(root)], ["serve", str(root)], ["write-gym", str(root), "gym"],
                    ["eval", str(root), "--model-url", "http://127.0.0.1:1/v1", "--model", "m"]):
        args = parser.parse_args([*command, "--sandbox", "zoned", "--zone-name", "z1"])
        assert (args.sandbox, args.zone_name) == ("zoned", "z1"), command
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--sandbox", "cloud"])
        assert "invalid choice: 'cloud' (choose from 'auto', 'docker', 'local', 'ray', 'zoned')" in \
            capsys.readouterr().err, command
    assert agentenv.main(["check", str(root), "--sandbox", "zoned", "--zone-name", "z1"]) == 0
    assert "sandbox: zoned" in capsys.readouterr().out.splitlines()
    assert zoned.zones == ["z1"]
    settings = agentenv.Settings.from_config({"sandbox": "zoned", "zone_name": "z2"}, "here")
    assert (settings.sandbox, settings.zone_name) == ("zoned", "z2")
    assert agentenv.build_app(root, sandbox="zoned", zone_name="z3") is not None
    with pytest.raises(AgentEnvError, match="--zone-name says where a bundle's envs run in a zone, "
                                            "and this server's envs run in the local sandbox"):
        run(agentenv.write_gym(str(root), str(tmp_path),
                               agentenv.Settings.of(sandbox="local", zone_name="z4")))


# -- a provider added in a few lines: the module docstring's promise, checked

@pytest.fixture
def dummy():
    """A provider added as the module docstring says, with ``@provider`` and nothing else: local
    processes under another name, with a setting of its own, a warm pool it keeps by default,
    and boxes of its own memory on a machine whose memory it says. It is registered in copies of
    the registry and of the declared settings that the test's end puts back: no other test sees
    it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(agentenv, "PROVIDERS", dict(agentenv.PROVIDERS))
        patch.setattr(agentenv.Settings, "DECLARED", dict(agentenv.Settings.DECLARED))

        @agentenv.provider
        class DummySandbox(agentenv.LocalSandbox):
            kind = "dummy"
            summary = "local processes, for a test"
            place = "as a test's local processes"
            settings = (agentenv.Declared("dummy_label", None, lambda value, what: str(value),
                                          "with --sandbox dummy: the label its envs carry",
                                          metavar="LABEL"),)
            auto_rank = None            # auto never picks it (it would inherit local's rank)
            box_memory_mb = 768
            memory_of = "the dummy's machine"
            labels: list = []           # each connect's dummy_label

            @classmethod
            def warm_by_default(cls):
                return True, "with the dummy sandbox, whose deploys a test keeps warm"

            @classmethod
            async def connect(cls, owner, settings):
                cls.labels.append(settings.dummy_label)
                return cls(owner)

            async def memory(self):
                return 8 << 30

        yield DummySandbox
    assert "dummy" not in agentenv.PROVIDERS and "dummy_label" not in agentenv.Settings.DECLARED
    assert "dummy" not in agentenv.Settings.DECLARED["sandbox"].help


def test_a_provider_of_a_few_lines_is_offered_everywhere_and_serves_a_bundle(
        dummy, make_bundle, capsys, caplog, tmp_path, monkeypatch):
    """A provider registered with @provider (the class above, a few lines) is a choice of
    --sandbox (check's too) and of --ray-node-sandbox, and its setting a flag of serve --help, a
    build_app keyword and a Gym config key; build_app serves notes-v1 through it to a score,
    keeping the warm pool its provider says it pays for; its boxes' memory is weighed against
    its machine's; and a Ray node's host runs its envs in it when told to."""
    parser = agentenv.command_line()
    for command in (["check", str(NOTES)], ["serve", str(NOTES)]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--sandbox", "cloud"])
        assert "(choose from 'auto', 'docker', 'dummy', 'local', 'ray')" in \
            capsys.readouterr().err, command
    with pytest.raises(SystemExit):
        agentenv.main(["serve", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "--sandbox {auto,docker,dummy,local,ray}" in said
    assert "dummy, local processes, for a test;" in said
    assert "--dummy-label LABEL with --sandbox dummy: the label its envs carry" in said
    assert "--ray-node-sandbox {auto,docker,dummy,local}" in said
    assert "default auto: with the docker or dummy sandbox as many as" in said
    assert agentenv.main(["check", str(NOTES), "--sandbox", "dummy", "--dummy-label", "c"]) == 0
    assert "sandbox: dummy" in capsys.readouterr().out.splitlines()
    settings = agentenv.Settings.from_config({"sandbox": "dummy", "dummy_label": "g"}, "here")
    assert (settings.sandbox, settings.dummy_label) == ("dummy", "g")
    assert settings.gym_config(bundle=True)["dummy_label"] == "g"

    caplog.set_level(logging.INFO, "agentenv")         # (main set it for check)
    app = agentenv.build_app(NOTES, sandbox="dummy", dummy_label="b", max_concurrent_envs=2)
    row = gym_row(NOTES, [t.name for t in Bundle.load(NOTES).splits["all"]].index(
        "save-groceries"))

    async def serve_and_play():
        from aiohttp.test_utils import TestServer
        async with TestServer(app, host="127.0.0.1") as server, client() as http:
            base = str(server.make_url("")).rstrip("/")
            async with http.get(base + "/health") as reply:
                health = await reply.json()
            rollout = Gym(base, row, http, strict=True)
            await rollout.seed()
            wrote = await rollout.call("write_note", title="groceries", text="eggs and milk")
            return health, wrote.text, (await rollout.verify("Saved.")).json()

    health, wrote, verdict = run(serve_and_play())
    assert wrote == "saved note 'groceries'"
    assert (verdict["reward"], verdict["mask_sample"]) == (1.0, False), verdict
    assert health["warm"]["target"] == 2, health
    assert dummy.labels == ["c", "b"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("envs in the dummy sandbox" in m for m in messages), messages
    assert any(m.startswith("Keeping 2 warm env(s) started and ready ahead of demand") and
               "by default with the dummy sandbox, whose deploys a test keeps warm, as many as "
               "the 2 episode slots, so a step's rollouts" in m for m in messages), messages

    steps = [deploy(memory_mb=512), agent("main", agent_name="solver"),
             prompt(agent_name="solver"),
             {"id": "check", "type": "verify_sandbox", "agent_name": "solver",
              "criteria": [{"type": "probe_file_exists", "paths": ["x"]}]}]
    bundle = Bundle.load(make_bundle({"t": steps}))

    async def start():
        async with Runtime(bundle, agentenv.Settings.of(sandbox="dummy", max_concurrent_envs=8)):
            pass

    caplog.clear()
    run(start())
    assert any(r.getMessage().startswith(
        "Up to 8 episodes run at once, and each may hold 1,280 MiB in its boxes and containers "
        "(by the limits of task 't'): 10.0 GiB in all, more than the 8.0 GiB the dummy's "
        "machine has") for r in caplog.records), [r.getMessage() for r in caplog.records]

    monkeypatch.setenv("AGENTENV_STATE_DIR", str(tmp_path / "state"))
    env = Bundle.load(NOTES).envs["notebook"]
    spec = {f.name: getattr(env, f.name) for f in agentenv.dataclasses.fields(env)}
    spec.update(folder="", dockerfile=env.dockerfile.name)
    host = agentenv.EnvHost("127.0.0.1", {"notebook": (spec, agentenv.env_archive(env))}, None, 1,
                            "dummy")
    facts = run(host.prepare())
    assert (facts["sandbox"], facts["place"], facts["why"]) == (
        "dummy", "as a test's local processes", "--ray-node-sandbox dummy"), facts


@pytest.mark.parametrize("capability, call", [
    ("open_image", lambda sandbox: sandbox.open_image("e", "vm", {}, "img")),
    ("run_sibling", lambda sandbox: sandbox.run_sibling("e", "vm/c", {}, "img")),
    ("build_image", lambda sandbox: sandbox.build_image(Path("."), "Dockerfile", "ctx")),
    ("episode_network", lambda sandbox: sandbox.episode_network("e")),
])
def test_a_capability_the_local_sandbox_lacks_is_refused_saying_which_has_it(capability, call):
    with pytest.raises(EpisodeFailed) as caught:
        run(call(agentenv.LocalSandbox("test:1:1")))
    assert caught.value.failure.kind == "provider_unavailable"
    assert str(caught.value).endswith("and the local sandbox can't; serve with --sandbox docker"), \
        str(caught.value)


def test_a_box_on_the_ray_sandbox_is_refused_saying_which_have_them():
    """Ray runs envs, and no box: its refusal names both providers that open boxes."""
    fake_ray = type("ray", (), {"remote": staticmethod(lambda **_: (lambda cls: cls))})
    sandbox = agentenv.RaySandbox("test:1:1", fake_ray, agentenv.RayOptions())
    with pytest.raises(EpisodeFailed) as caught:
        run(sandbox.open_box("e", "solver", {}, agents=True))
    assert caught.value.failure.kind == "provider_unavailable"
    assert str(caught.value) == ("box 'solver' is a box to work in, and the ray sandbox can't; "
                                 "serve with --sandbox docker or local")


def test_a_remote_docker_host_publishes_and_dials_on_its_host_unless_told_an_address(monkeypatch):
    """A daemon elsewhere (tcp://, ssh://) publishes its containers' ports on its own machine, so
    they are published and dialled at DOCKER_HOST's host; --docker-publish says another address,
    checked as an IP address; a local socket's default is 127.0.0.1."""
    for url, address in (("tcp://127.0.0.1:2375", "127.0.0.1"), ("ssh://ci@127.0.0.3", "127.0.0.3"),
                         ("unix:///var/run/docker.sock", None), ("", None)):
        monkeypatch.setenv("DOCKER_HOST", url)
        assert agentenv.remote_daemon_address() == address, url
    assert agentenv.DockerOptions.of(agentenv.Settings.of(docker_publish="10.0.0.5")).publish == \
        "10.0.0.5"
    assert agentenv.DockerOptions.of(agentenv.Settings()).publish is None
    with pytest.raises(AgentEnvError, match="docker_publish='dockerhost': it must be an IP address "
                                            "of the Docker daemon's machine"):
        agentenv.Settings.of(docker_publish="dockerhost")


def test_an_unknown_sandbox_is_refused(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with Runtime(bundle, agentenv.Settings(declared=(("sandbox", "cloud"),))):
            pass

    with pytest.raises(AgentEnvError, match="--sandbox 'cloud' is not a sandbox; use auto, docker, "
                                            "local or ray"):
        run(go())


def test_the_ray_sandbox_without_ray_says_how_to_install_it(make_bundle, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)         # import ray raises ImportError
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with Runtime(bundle, agentenv.Settings.of(sandbox="ray")):
            pass

    with pytest.raises(AgentEnvError, match=r"--sandbox ray needs Ray installed in this Python: "
                                            r"pip install 'agentenv-py\[ray\]'"):
        run(go())


def test_the_ray_address_comes_from_the_flag_then_ray_address_then_gym_then_auto(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = agentenv.RayOptions.address_from
    assert address(None) == "auto"
    assert address(None, "10.0.0.5:6379") == "10.0.0.5:6379"
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert address(None, "10.0.0.5:6379") == "head:6379"
    assert address("other:1") == "other:1"
    args = agentenv.command_line().parse_args(["serve", str(NOTES), "--sandbox", "ray",
                                               "--ray-resource", "envs"])
    assert agentenv.RayOptions.of(agentenv.settings_of(args)) == agentenv.RayOptions("head:6379", "envs")


def test_a_local_env_binds_the_host_it_is_given_and_only_that(tmp_path):
    """What a Ray node's host does: an env bound to 127.0.0.2 answers there, not on 127.0.0.1."""
    env = Bundle.load(NOTES).envs["notebook"]

    async def go():
        sandbox = agentenv.LocalSandbox("test:1:1", host="127.0.0.2", die_with_parent=True)
        instance = await sandbox.launch(env, "episode", {})
        try:
            assert instance.base_url.startswith("http://127.0.0.2:")
            async with aiohttp.ClientSession() as http:
                deployed = await agentenv.wait_ready(http, instance, env, 30)
                assert deployed.mcp_url.startswith("http://127.0.0.2:")
                with pytest.raises(aiohttp.ClientConnectionError):
                    async with http.get(instance.base_url.replace("127.0.0.2", "127.0.0.1") +
                                        "/.well-known/agent-env.json"):
                        pass
        finally:
            await instance.remove()

    run(go())


def test_an_env_started_to_die_with_its_parent_dies_when_its_parent_is_killed(tmp_path):
    """What a Ray node's host asks of its envs: a parent SIGKILLed (no clean-up of its own) takes
    its env along, though the env runs in a session of its own."""
    code = ("import asyncio, agentenv\n"
            "async def go():\n"
            "    env = agentenv.Bundle.load(%r).envs['notebook']\n"
            "    sandbox = agentenv.LocalSandbox('test:1:1', die_with_parent=True)\n"
            "    instance = await sandbox.launch(env, 'episode', {})\n"
            "    print(instance.proc.pid, flush=True)\n"
            "    await asyncio.sleep(600)\n"
            "asyncio.run(go())\n" % str(NOTES))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "AGENTENV_STATE_DIR": str(tmp_path / "state")})
    try:
        env = int(parent.stdout.readline())
        assert not gone(env, 0.5), "the env runs while its parent does"
        assert os.getsid(env) == env, "the env is in a session of its own"
    finally:
        parent.kill()
        parent.wait(10)
    assert gone(env, 5), "the env outlived its parent, SIGKILLed"


@pytest.mark.parametrize("cpus, slots", [(1, 2), (3, 6), (0.25, 2), (64, 128)])
def test_a_ray_nodes_boot_gate_is_sized_by_the_cpus_it_declares_not_its_cores(tmp_path, monkeypatch,
                                                                            cpus, slots):
    """A node's host (run here without Ray) boots two envs per CPU the node declares to Ray, at
    least two, whatever the machine's core count; and says so in what it tells the server."""
    monkeypatch.setenv("AGENTENV_STATE_DIR", str(tmp_path / "state"))
    env = Bundle.load(NOTES).envs["notebook"]
    spec = {f.name: getattr(env, f.name) for f in agentenv.dataclasses.fields(env)}
    spec.update(folder="", dockerfile=env.dockerfile.name)
    host = agentenv.EnvHost("127.0.0.1", {"notebook": (spec, agentenv.env_archive(env))}, None, cpus,
                            "local")

    async def go():
        facts = await host.prepare()
        key, url, its_own = await host.launch("notebook", "episode", {})
        try:
            async with aiohttp.ClientSession() as http, \
                    http.get(url + "/.well-known/agent-env.json") as resp:
                answered = resp.status
        finally:
            await host.remove(key)
        return facts, answered, its_own

    facts, answered, its_own = run(go())
    assert (facts["cpus"], facts["boot_slots"]) == (cpus, slots), facts
    assert facts["cores"] == os.cpu_count() and facts["envs"] == ["notebook"]
    assert (facts["sandbox"], facts["why"]) == ("local", "--ray-node-sandbox local"), facts
    assert answered == 200 and run(host.live()) == 0
    assert its_own, "the host saw the env itself listen: the server need not ask again"


@pytest.mark.parametrize("mode", ["auto", "docker"])
def test_a_ray_node_without_docker_runs_local_envs_in_auto_and_refuses_in_docker(tmp_path,
                                                                                  monkeypatch, mode):
    """A node's host (run here without Ray) whose DOCKER_HOST answers nothing: with
    --ray-node-sandbox auto it runs local envs and says why; with docker it refuses, naming the
    node, the daemon's answer and the fix."""
    monkeypatch.setenv("AGENTENV_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent.sock")
    env = Bundle.load(NOTES).envs["notebook"]
    spec = {f.name: getattr(env, f.name) for f in agentenv.dataclasses.fields(env)}
    spec.update(folder="", dockerfile=env.dockerfile.name)
    host = agentenv.EnvHost("127.0.0.2", {"notebook": (spec, agentenv.env_archive(env))}, None, 1,
                            mode)
    if mode == "docker":
        with pytest.raises(AgentEnvError) as caught:
            run(host.prepare())
        said = str(caught.value)
        assert said.startswith("--ray-node-sandbox docker, and on Ray node 127.0.0.2 no Docker "
                               "daemon answered"), said
        assert "start Docker, set DOCKER_HOST" in said, said
        return
    facts = run(host.prepare())
    assert facts["sandbox"] == "local" and facts["why"].startswith("no Docker daemon answered ("), facts
    assert facts["networks"] == {"notebook": "the host's network: the local sandbox isolates nothing"}

def test_auto_sandbox_without_docker_falls_back_to_local_and_says_why(make_bundle, monkeypatch,
                                                                      caplog):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent")
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with Runtime(bundle, agentenv.Settings.of(deploy_timeout=10)) as rt:
            kind = rt.sandbox.kind
            result = await play(rt, bundle.tasks["a"], calls=[("say", {"text": "hello"})])
        return kind, result

    kind, result = run(go())
    assert kind == "local" and result.reward == 1.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("Envs run in the local sandbox (local processes, isolated from "
                                  "nothing), since no Docker daemon answered"), warnings[0]


# -- local env processes: their command, environment and output

def test_an_env_command_that_cannot_start(make_bundle):
    root = make_bundle({"a": simple()})
    (root / "envs" / "main" / "Dockerfile").write_text('FROM x\nCMD ["./no-such-program"]\n')
    bundle = Bundle.load(root)

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            with pytest.raises(EpisodeFailed, match=r"env 'main' could not start: running "
                                                    r"\./no-such-program in .* failed .*fix the "
                                                    r"Dockerfile's CMD"):
                await ep.next_turn()
            await ep.closed.wait()
            assert ep.instances == [] and ep.outcome.status == "failed"

    run(go())


def test_env_processes_carry_their_owner_and_not_the_servers_token(make_bundle, monkeypatch):
    monkeypatch.setenv("AGENTENV_TOKEN", "the-servers-secret")
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            await ep.next_turn()
            [instance] = ep.instances
            environ = Path(f"/proc/{instance.proc.pid}/environ").read_bytes().split(b"\0")
            await ep.abandon("seen")
            return rt.sandbox.owner, environ

    owner, environ = run(go())
    assert f"AGENTENV_OWNER={owner}".encode() in environ
    assert not any(item.startswith(b"AGENTENV_TOKEN=") for item in environ)


# One line of 200,000 characters, then more output than a pipe holds, then the usual server.
NOISY_SERVER = fake_server_with("\nserver = ThreadingHTTPServer(", r'''
print("x" * 200_000, flush=True)
for n in range(3000):
    print(f"fake: noise {n} " + "y" * 200, flush=True)
''')


def test_an_env_that_prints_a_line_longer_than_64k_plays_and_is_torn_down(make_bundle):
    root = make_bundle({"a": simple("noisy")}, envs=(), files=custom_env("noisy", NOISY_SERVER))
    bundle = Bundle.load(root)

    async def go():
        async with local(bundle, deploy_timeout=5) as rt:
            records = rt.sandbox.records
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            await turn.call("say", {"text": "hello"})
            turn.end("done")
            result = await ep.result()
            await ep.closed.wait()
            assert_torn_down(ep)
            output = await ep.instances[0].output()
        return result, output, records

    result, output, records = run(go())
    assert result == agentenv.Outcome("scored", {"check": 1.0}, 1.0)
    assert "fake: noise 2999" in output and "fake: env noisy listening" in output
    assert not records.exists() or list(records.iterdir()) == [], "a record outlived the Runtime"


# -- ports

def test_an_env_whose_port_another_process_took_is_started_again_and_never_plays_on_the_other(
        make_bundle, monkeypatch):
    """Two servers on one machine: the port the second hands its env is found free, then taken
    by the first's env before it binds. The second env dies on bind; it must never play on the
    other server's env, which answers on that port meanwhile, but start again on another port."""
    bundle = Bundle.load(make_bundle({"a": simple()}))
    real_free_port = agentenv.free_port

    async def go():
        async with local(bundle) as first, local(bundle, deploy_timeout=20) as second:
            theirs = first.episode(bundle.tasks["a"])
            turn = await theirs.next_turn()
            await turn.call("say", {"text": "mine"})
            [instance] = theirs.instances
            ports = iter([instance.port])
            monkeypatch.setattr(agentenv, "free_port", lambda *host: next(ports, None) or real_free_port())
            ours = second.episode(bundle.tasks["a"])
            our_turn = await ours.next_turn()
            [our_instance] = ours.instances              # the one that died is gone from the list
            await our_turn.call("say", {"text": "hello"})
            our_turn.end("hello")
            await turn.call("say", {"text": "still mine"})        # the first plays on, untouched
            turn.end("done")
            return instance.port, our_instance.port, await ours.result(), await theirs.result()

    taken, ours_on, ours, theirs = run(go())
    assert ours_on != taken
    assert ours.reward == 1.0 and theirs.status == "scored"


def test_a_local_env_answers_itself_only_once_linux_says_it_listens(make_bundle):
    """What answered on the env's port a moment ago may have been another server's env that has
    since gone: while nothing listens there, the env is not taken to answer itself."""
    if not agentenv.LINUX_SAYS_WHO_LISTENS:
        pytest.skip("Linux's /proc is not here to say who listens")
    bundle = Bundle.load(make_bundle({"a": simple("deaf")}, envs=("deaf",)))

    async def go():
        sandbox = agentenv.LocalSandbox("test:1:1")
        deaf = await sandbox.launch(bundle.envs["deaf"], "episode", {})
        try:
            return await deaf.answers_itself(), await deaf.lost_its_port()
        finally:
            await deaf.remove()

    assert run(go()) == (False, False)        # alive, listening nowhere: neither ready nor lost


def test_local_env_ports_come_from_below_the_ephemeral_range_where_no_connection_takes_them():
    """A client's connection takes its source port from the kernel's ephemeral range, so an env
    port picked there can be lost before the env binds it; ours come from below it, free."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low - agentenv.LOCAL_PORTS_FROM < 1000:
        pytest.skip(f"this machine's ephemeral range starts at {low}: the kernel picks env ports")
    ports = {agentenv.free_port() for _ in range(50)}
    assert all(agentenv.LOCAL_PORTS_FROM <= port < low for port in ports), sorted(ports)
    assert len(ports) > 40, "the ports are not spread over the range"
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))          # each was free when handed out


# -- scratch folders

# A fake env with one more tool: where its TMPDIR and DATABASE_URL point, and a temp file made there.
SCRATCH_SERVER = fake_server_with('    if base == "dump":', '''    if base == "scratch":
        import tempfile
        fd, made = tempfile.mkstemp()
        os.close(fd)
        return json.dumps({"tmpdir": os.environ.get("TMPDIR"), "made": made,
                           "database_url": os.environ.get("DATABASE_URL")}), False
''', source=fake_server_with('    tool("dump",', '''    tool("scratch", "Where the env keeps its files."),
'''))


def test_each_local_env_has_its_own_scratch_folder_removed_at_teardown(make_bundle):
    assert 'base == "scratch"' in SCRATCH_SERVER
    steps = [deploy("scratchy"), agent("scratchy"), prompt(), contains()]
    bundle = Bundle.load(make_bundle({"a": steps}, envs=(), artifacts=(),
                                     files=custom_env("scratchy", SCRATCH_SERVER)))

    async def one(rt):
        ep = rt.episode(bundle.tasks["a"])
        turn = await ep.next_turn()
        seen = json.loads((await turn.call("scratch", {})).text)
        assert seen["tmpdir"], f"the env got no TMPDIR of its own: {seen}"
        existed = Path(seen["tmpdir"]).is_dir() and Path(seen["made"]).is_file()
        await asyncio.sleep(0.2)              # both episodes are live at once
        turn.end("hello")
        await ep.result()
        await ep.closed.wait()
        assert_torn_down(ep)
        return seen, existed

    async def go():
        async with local(bundle) as rt:
            return await asyncio.gather(one(rt), one(rt))

    (first, first_existed), (second, second_existed) = run(go())
    assert first_existed and second_existed
    assert first["tmpdir"] != second["tmpdir"]
    for seen in (first, second):
        assert Path(seen["made"]).parent == Path(seen["tmpdir"])
        assert seen["database_url"].startswith(f"sqlite:///{seen['tmpdir']}/")
        assert not Path(seen["tmpdir"]).exists(), f"{seen['tmpdir']} outlived its env"
    records = Path(first["tmpdir"]).parent
    assert not records.exists(), f"a clean stop left {records} for the next start to sweep"


# -- the sweep of what a crashed run left

KILLED_ONE = "Killed 1 env process group(s) that an earlier run of agentenv.py left behind"


def start_and_stop(bundle: Bundle) -> None:
    """A local server's start (which sweeps) and stop, with no episode between."""
    async def go():
        async with local(bundle):
            pass
    run(go())


def test_processes_left_by_a_crashed_run_are_killed_at_start(make_bundle, tmp_path, caplog):
    bundle = Bundle.load(make_bundle({"a": simple()}))
    leftover = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        dead_owner = f"{socket.gethostname()}:999999999:1"
        records = agentenv.LocalSandbox(dead_owner).records   # where that run kept its records
        records.mkdir(parents=True)
        (records / str(leftover.pid)).write_text(agentenv._process_start(leftover.pid))

        start_and_stop(bundle)
        assert leftover.wait(timeout=5) == -signal.SIGKILL
        assert not records.exists()
        assert KILLED_ONE in caplog.text
    finally:
        with contextlib.suppress(ProcessLookupError):
            leftover.kill()
        leftover.wait()


def test_the_sweep_returns_once_every_process_it_killed_has_ended():
    """A killed process holds its port and its files until it has ended, which on a loaded
    machine can be after the kill returns: a group of twenty, each killed by the sweep, has
    ended (reaped or a zombie) the moment the sweep returns. Without the wait, most are still
    running then."""
    dead_owner = f"{socket.gethostname()}:999999999:1"
    leftover = subprocess.Popen(["sh", "-c", "for i in $(seq 20); do sleep 60 & done; wait"],
                                start_new_session=True)
    records = agentenv.LocalSandbox(dead_owner).records
    try:
        deadline = time.monotonic() + 30
        while len(members := [pid for pid, _ in agentenv.group_members({leftover.pid})]) < 21:
            assert time.monotonic() < deadline, f"the group started {len(members)} of 21"
            time.sleep(0.02)
        records.mkdir(parents=True)
        (records / str(leftover.pid)).write_text(agentenv._process_start(leftover.pid))
        assert agentenv.LocalSandbox(agentenv.owner_id()).kill_leftovers() == 1
        assert [pid for pid in members if alive(pid)] == []
        assert leftover.wait(timeout=5) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leftover.pid, signal.SIGKILL)
        leftover.wait()
        shutil.rmtree(records, ignore_errors=True)


def test_servers_sharing_a_state_folder_start_together_while_sweeping_the_same_leftovers(
        make_bundle, monkeypatch, caplog):
    """Gym starts its servers at once over one state folder, and each sweeps the same crashed
    run's records: a folder another server removed first must not fail this one's start."""
    bundle = Bundle.load(make_bundle({"a": simple()}))
    host = socket.gethostname()
    swept_first = agentenv.LocalSandbox(f"{host}:999999991:1").records
    still_there = agentenv.LocalSandbox(f"{host}:999999992:1").records
    for records in (swept_first, still_there):
        (records / "scratch-a-x").mkdir(parents=True)
    owner_alive = agentenv.owner_alive

    def another_server_sweeps_first(owner: str):
        # what another server's sweep does between this one's listing and its reading
        if owner == swept_first.name:
            shutil.rmtree(swept_first)
        return owner_alive(owner)
    monkeypatch.setattr(agentenv, "owner_alive", another_server_sweeps_first)
    leftover = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        (still_there / str(leftover.pid)).write_text(agentenv._process_start(leftover.pid))
        start_and_stop(bundle)
        assert leftover.wait(timeout=5) == -signal.SIGKILL
        assert not swept_first.exists() and not still_there.exists()
        assert KILLED_ONE in caplog.text
    finally:
        with contextlib.suppress(ProcessLookupError):
            leftover.kill()
        leftover.wait()


def test_env_processes_a_crashed_run_had_not_recorded_yet_are_killed_at_start(make_bundle, caplog):
    """A server killed between starting an env process and writing its record: the owner in the
    process's environment is enough for the next start to find it, and its children with it."""
    bundle = Bundle.load(make_bundle({"a": simple()}))
    dead_owner = f"{socket.gethostname()}:999999999:1"
    env = {**os.environ, "AGENTENV_OWNER": dead_owner}
    leftover = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True, env=env)
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)    # not marked
    alive = subprocess.Popen(["sleep", "60"], start_new_session=True,        # a live owner's
                             env={**os.environ, "AGENTENV_OWNER": agentenv.owner_id()})
    try:
        start_and_stop(bundle)
        assert leftover.wait(timeout=5) == -signal.SIGKILL
        assert bystander.poll() is None and alive.poll() is None
        assert KILLED_ONE in caplog.text
    finally:
        for proc in (leftover, bystander, alive):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the local box: a work folder, commands run here

def local_box(tmp_path) -> agentenv.LocalBox:
    folder = tmp_path / "box"
    for sub in ("app", "tmp", "home/skills"):
        (folder / sub).mkdir(parents=True)
    return agentenv.LocalBox(folder, "solver", agentenv.owner_id())


def test_a_local_box_stands_its_folder_for_app_and_answers_as_bash_does(tmp_path):
    box = local_box(tmp_path)

    async def go():
        await box.put({"in/notes.txt": b"alpha\n"}, "/app")
        said = {}
        for command in ("cat /app/in/notes.txt; pwd", "echo out; echo err >&2; exit 4",
                        "(sleep 20; echo late) & echo started", "sleep 20", "read x; echo [$x]"):
            started = time.monotonic()
            # 5 s: a deadline a loaded machine keeps for commands that take a second at most
            said[command] = (await agentenv.run_bash(box, {"command": command}, 5),
                             time.monotonic() - started)
        await box.remove()                          # the background job goes with it
        return said
    said = run(go())
    text, took = said["cat /app/in/notes.txt; pwd"]
    assert text == agentenv.ToolResult(f"alpha\n{box.workdir}\n")
    assert said["echo out; echo err >&2; exit 4"][0] == agentenv.ToolResult(
        "out\nerr\nexit code 4", agentenv.TOOL_ERROR)
    started, took = said["(sleep 20; echo late) & echo started"]
    assert started.text == "started\n" and took < 4        # the job holds the pipes: a 1 s grace
    slow, took = said["sleep 20"]
    assert slow.status == agentenv.TOOL_ERROR and slow.text.startswith(
        "error: the command timed out after 5s, so it was killed") and 5 <= took < 8
    assert said["read x; echo [$x]"][0].text == "[]\n"
    assert not box.folder.exists() and not box.running


def test_a_command_reaped_before_its_exit_is_awaited_is_over_though_a_job_holds_its_pipes():
    # The loop's child watcher reaps a command in a thread of its own, and on a loaded machine it
    # can do so before the box looks for the exit: that exit must still be seen at once, not
    # after the background job that holds the pipes (CI saw such a call time out).
    async def go():
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", "(sleep 30; echo late) & echo started", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:      # the loop held while the watcher reaps it
                with contextlib.suppress(ChildProcessError):
                    if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                        time.sleep(0.01)
                        continue
                time.sleep(0.2)                     # exited; the watcher's waitpid follows
                break
            started = time.monotonic()
            code = await asyncio.wait_for(agentenv.process_exit(proc), 20)
            return code, time.monotonic() - started
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.communicate()

    policy = asyncio.get_event_loop_policy()
    if sys.version_info < (3, 12):      # the race is 3.11's: its default watcher is a thread's
        watcher = policy.get_child_watcher()
        policy.set_child_watcher(asyncio.ThreadedChildWatcher())
    try:
        code, took = run(go())
    finally:
        if sys.version_info < (3, 12):
            policy.set_child_watcher(watcher)
    assert code == 0 and took < 5


def test_a_local_box_clears_paths_without_following_links_and_reads_results_to_a_cap(tmp_path):
    """clear removes a file in a read-only folder, a link (never what it leads to), a FIFO and a
    folder made unreadable, and says what it could not remove (a file of /proc); read_result
    reads a regular file only, at most the cap of it with its whole size (a sparse 4 GiB file at
    once), and says why it read nothing (a link, a FIFO, which it never waits on)."""
    box = local_box(tmp_path)
    app = Path(box.workdir)
    (app / "out").mkdir()
    (app / "out" / "reward.txt").write_text("1\n")
    (app / "out").chmod(0o555)
    (tmp_path / "one").write_text("1\n")
    for name in ("link", "link2"):
        (app / name).symlink_to(tmp_path / "one")
    for name in ("fifo", "fifo2"):
        os.mkfifo(app / name)
    (app / "tree" / "shut").mkdir(parents=True)
    (app / "tree" / "shut").chmod(0o000)
    (app / "small").write_text("0.5\n")
    with open(app / "big", "wb") as big:
        big.truncate(4 << 30)

    async def go():
        cleared = await box.clear(["/app/out/reward.txt", "/app/link", "/app/fifo", "/app/tree",
                                   "/app/none/x"])
        stuck = await box.clear(["/proc/version"])
        started = time.monotonic()
        read = {path: await box.read_result(path, 1024) for path in (
            "/app/small", "/app/big", "/app/link2", "/app/fifo2", "/app/none")}
        return cleared, stuck, read, time.monotonic() - started
    cleared, stuck, read, took = run(go())
    assert cleared is None
    assert not any(os.path.lexists(app / name) for name in ("out/reward.txt", "link", "fifo", "tree"))
    assert (tmp_path / "one").read_text() == "1\n"
    assert stuck.startswith("/proc/version (") and stuck.endswith(") still there"), stuck
    assert read == {"/app/small": agentenv.ResultFile(b"0.5\n", 4),
                    "/app/big": agentenv.ResultFile(bytes(1024), 4 << 30),
                    "/app/link2": agentenv.ResultFile(None, why="is a link, not a regular file"),
                    "/app/fifo2": agentenv.ResultFile(None, why="is not a regular file"),
                    "/app/none": agentenv.ResultFile(None)}
    assert took < 5


def test_a_box_without_bash_runs_sh_and_says_so(tmp_path):
    box = local_box(tmp_path)
    box.has_bash = False
    result = run(agentenv.run_bash(box, {"command": "echo $0; [[ 1 == 1 ]] && echo bashism"}, 5))
    assert result.text.startswith("sh\n") and "bashism" not in result.text and result.is_error
    assert agentenv.SH_TOOL["name"] == "bash" and agentenv.SH_TOOL["description"].startswith(
        "Run a command where the agent works, as its user, in its folder, with POSIX sh: this place "
        "has no bash, so bash-only syntax such as [[ ]], arrays or <(...) fails.")


# -- Docker calls (no daemon needed)

def test_a_daemon_that_sends_no_events_is_refused_at_once_saying_why():
    """Docker's event stream failing as it opens: the death watch's start fails with the reason
    and the fix, at once (the refusal was built after the except block's name was gone, so the
    start waited out its 30 s and said nothing)."""
    class Client:
        def events(self, **_: object) -> None:
            raise ConnectionError("the daemon refused /events")

    watch = agentenv.DeathWatch(type("Daemon", (), {"client": Client()})(), "owner")

    async def start() -> float:
        began = time.monotonic()
        with pytest.raises(AgentEnvError, match=r"sends no events \(the daemon refused /events\)"
                                                r".*--docker-publish"):
            await watch.start()
        return time.monotonic() - began
    try:
        assert run_within(start(), 60) < 20
    finally:
        watch.closed.set()


def test_a_docker_call_past_its_deadline_keeps_its_slot_until_its_thread_ends():
    """The cap on Docker operations counts calls still running in their thread after their
    caller gave up: a daemon that is slow to create must not be handed more creations."""
    release = threading.Event()
    started: list[str] = []

    def slow(name: str) -> str:
        started.append(name)
        release.wait(10)
        return name

    async def go():
        sandbox = agentenv.DockerDaemon(client=None, ops=2)
        for name in ("a", "b"):
            with pytest.raises(asyncio.TimeoutError):
                await sandbox.call(slow, name, timeout=0.05)
        third = asyncio.ensure_future(sandbox.call(slow, "c", timeout=10))
        await asyncio.sleep(0.2)
        waited = started == ["a", "b"]          # both slots still held by the late threads
        release.set()
        result = await third
        sandbox.threads.shutdown(wait=True)
        return waited, result, started

    waited, result, started = asyncio.run(go())
    assert waited, f"a third call started while two timed-out calls still ran: {started}"
    assert result == "c" and started == ["a", "b", "c"]


def test_a_kill_or_removal_never_waits_behind_the_slots_and_a_slots_wait_is_in_its_deadline():
    """With every slot held by a slow call: an urgent call (a kill, a removal) runs at once on
    threads of its own, and a call that waits for a slot gives up at its deadline, not later."""
    release = threading.Event()

    async def go():
        sandbox = agentenv.DockerDaemon(client=None, ops=1)
        held = asyncio.ensure_future(sandbox.call(release.wait, 10, timeout=20))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        urgent = await sandbox.urgent(lambda: "killed", timeout=5)
        urgent_took = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await sandbox.call(lambda: "never", timeout=0.3)
        waited = time.monotonic() - started
        release.set()
        await held
        for threads in (sandbox.threads, sandbox.urgent_threads, sandbox.stream_threads):
            threads.shutdown(wait=True)
        return urgent, urgent_took, waited

    urgent, urgent_took, waited = asyncio.run(go())
    assert urgent == "killed" and urgent_took < 1
    assert 0.25 < waited < 2


def test_a_pool_whose_boxes_could_outgrow_the_machine_is_said_at_start(make_bundle, caplog):
    """64 episodes of a task with a 2 GiB box and a 512 MiB env could hold 160 GiB, on a host of
    24: said once, with the fix."""
    steps = [deploy(memory_mb=512), {"id": "agent", "type": "deploy_agent", "agent_name": "solver",
                                     "env_ids": ["main"]},
             prompt(agent_name="solver"),
             {"id": "check", "type": "verify_sandbox", "agent_name": "solver",
              "criteria": [{"type": "probe_file_exists", "paths": ["x"]}]}]
    bundle = Bundle.load(make_bundle({"t": steps}))
    assert agentenv.episode_memory(bundle.tasks["t"], agentenv.DockerSandbox.box_memory_mb) == \
        2048 + 512
    # the Docker sandbox's box memory and words for its host, without a daemon: the runtimes'
    # own, as once started
    docker = agentenv.DockerSandbox.__new__(agentenv.DockerSandbox)
    runtime = local(bundle, max_concurrent_envs=64)
    small = Runtime(bundle, agentenv.Settings.of(sandbox="local", max_concurrent_envs=9))
    runtime.sandbox = small.sandbox = docker
    with caplog.at_level(logging.WARNING):
        runtime._weigh_memory(24 << 30)
        runtime._weigh_memory(None)
        small._weigh_memory(24 << 30)
    [said] = [r.getMessage() for r in caplog.records if "Docker host has" in r.getMessage()]
    assert said.startswith("Up to 64 episodes run at once, and each may hold 2,560 MiB in its boxes "
                           "and containers (by the limits of task 't'): 160.0 GiB in all, more "
                           "than the 24.0 GiB the Docker host has"), said
    assert said.endswith("Lower --max-concurrent-envs (or MAX_CONCURRENT_ENVS) to 9, or give the "
                         "boxes less (the memory_mb of deploy_agent, deploy_sandbox and deploy_env "
                         "steps).")


# ================================================================ Env client

# -- the MCP client

def start_plain_server(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "plain_server.py"
    script.write_text(PLAIN_SERVER)
    port = free_port()
    env = {**os.environ, "MCP_PORT": str(port), "MCP_HOST": "127.0.0.1"}
    env.pop("FAKE_PIDDIR", None)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc, f"http://127.0.0.1:{port}/mcp"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the FastMCP server did not start: {proc.stdout.read().decode()}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fastmcp_url(tmp_path_factory):
    proc, url = start_plain_server(tmp_path_factory.mktemp("fastmcp"))
    yield url
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_mcp_client_against_a_fastmcp_server(fastmcp_url):
    async def go():
        session = McpSession(fastmcp_url)
        info = await session.open()
        assert info["serverInfo"]["name"] == "plain"
        assert session.headers["Mcp-Session-Id"]
        assert session.headers["MCP-Protocol-Version"] == info["protocolVersion"]
        tools = {t["name"]: t for t in await session.list_tools()}
        assert set(tools) == {"add", "fail"}
        assert tools["add"]["description"] == "Add two numbers."
        assert set(tools["add"]["inputSchema"]["properties"]) == {"a", "b"}
        assert await session.call_tool("add", {"a": 2, "b": 3}) == ToolResult("5")
        failed = await session.call_tool("fail", {"why": "boom"})
        assert failed.is_error and "boom" in failed.text
        unknown = await session.call_tool("subtract", {})
        assert unknown.is_error and "subtract" in unknown.text
        invalid = await session.call_tool("add", {"a": "x"})
        assert invalid.is_error and "validation error" in invalid.text
        await session.close()
        with pytest.raises(McpError, match="tools/list was answered HTTP 404"):
            await session.list_tools()      # the session was ended on the server
        session.drop()

    run(go())


async def sse_server(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/mcp", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/mcp"


def test_schema_misfit_tells_bad_arguments_from_a_tool_that_failed():
    schema = {"type": "object", "additionalProperties": False, "required": ["title"],
              "properties": {"title": {"type": "string"}, "count": {"type": ["integer", "null"]},
                             "ratio": {"type": "number"}, "any": {}}}
    fits = agentenv.schema_misfit
    assert fits({"title": "a"}, schema) is None
    assert fits({"title": "a", "count": 2.0, "ratio": 1, "any": [1]}, schema) is None
    assert fits({"title": "a", "count": None}, schema) is None
    assert fits({}, schema) == "missing title"
    assert fits({"title": "a", "z": 1}, schema) == "it takes no z"
    assert fits({"title": 5}, schema) == "title is not string"
    assert fits({"title": "a", "count": True}, schema) == "count is not integer or null"
    assert fits({"title": "a", "count": 1.5}, schema) == "count is not integer or null"
    assert fits({"z": 1}, {"type": "object"}) is None            # open: anything fits
    assert fits({"z": 1}, None) is None


def test_mcp_client_reads_sse_replies_and_refusals():
    async def handler(request: web.Request) -> web.StreamResponse:
        msg = await request.json()
        method, mid = msg.get("method"), msg.get("id")
        if mid is None:
            return web.Response(status=202)
        name = (msg.get("params") or {}).get("name")
        if method == "initialize":
            return web.json_response({"jsonrpc": "2.0", "id": mid, "result": {
                "protocolVersion": "2025-03-26", "serverInfo": {"name": "sse"}}},
                headers={"Mcp-Session-Id": "abc"})
        assert request.headers["Mcp-Session-Id"] == "abc"
        assert request.headers["MCP-Protocol-Version"] == "2025-03-26"
        if name == "refuse":
            return web.json_response({"jsonrpc": "2.0", "id": mid,
                                      "error": {"code": -32602, "message": "Unknown tool: refuse"}})
        if name == "refuse at length":      # the model reads no more of it than of an answer
            return web.json_response({"jsonrpc": "2.0", "id": mid,
                                      "error": {"code": -32602, "message": "no " * 50_000}})
        if name == "http500":
            return web.Response(status=500, text="the server broke")
        if name == "notjson":
            return web.Response(text="<html>", content_type="text/html")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if name == "silent":
            await resp.write(b"event: message\ndata: {\"jsonrpc\": \"2.0\", \"method\": \"x\"}\n\n")
            await resp.write_eof()
            return resp
        if method == "tools/list":
            page = {"tools": [{"name": "t1"}, {"nameless": True}], "nextCursor": "2"} \
                if not (msg.get("params") or {}).get("cursor") else {"tools": [{"name": "t2"}]}
            await resp.write(f"data: {json.dumps({'jsonrpc': '2.0', 'id': mid, 'result': page})}\n\n"
                             .encode())
            await resp.write_eof()
            return resp
        # a notification first, then the answer in two data lines split over chunks, with CRLFs
        await resp.write(b": comment\r\nevent: message\r\ndata: {\"jsonrpc\": \"2.0\", \"method\": "
                         b"\"notifications/progress\"}\r\n\r\n")
        await resp.write(b'data: {"jsonrpc": "2.0", "id": %d,\r\ndata: "result": {"content": '
                         % mid)
        await resp.write(b'[{"type": "text", "text": "hi"}, {"type": "image", "mimeType": '
                         b'"image/png"}]}}\r\n\r\n')
        await resp.write_eof()
        return resp

    async def go():
        runner, url = await sse_server(handler)
        try:
            session = McpSession(url, {"AgentEnv-Role": "x"})
            assert (await session.open())["serverInfo"]["name"] == "sse"
            assert [t["name"] for t in await session.list_tools()] == ["t1", "t2"]
            assert await session.call_tool("echo", {}) == \
                ToolResult("hi\n[image content: image/png]")
            assert await session.call_tool("refuse", {}) == \
                ToolResult("Unknown tool: refuse", agentenv.TOOL_ERROR)
            assert await session.call_tool("refuse at length", {}) == ToolResult(
                "no " * 33_333 + "n\n[output cut: the tool answered 150000 characters; agentenv.py "
                "passes on the first 100000]", agentenv.TOOL_ERROR)
            with pytest.raises(McpError, match="tools/call was answered HTTP 500: the server broke"):
                await session.call_tool("http500", {})
            with pytest.raises(McpError, match="answered with something that is not JSON"):
                await session.call_tool("notjson", {})
            with pytest.raises(McpError, match="the server's event stream ended without an answer"):
                await session.call_tool("silent", {})
            session.drop()
        finally:
            await runner.cleanup()

    run(go())


async def raw_env(serve_one: Callable) -> tuple[asyncio.Server, str]:
    """An env written on bare asyncio streams (``serve_one`` answers each connection), and its
    MCP URL: for replies framed as no HTTP library would frame them."""
    server = await asyncio.start_server(serve_one, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/mcp"


MALFORMED_SAYS = {
    "xchunked": "the env sent Transfer-Encoding 'xchunked': agentenv.py reads chunked alone",
    "gzip first": "Transfer-Encoding 'gzip, chunked'",
    "chunked twice": "Transfer-Encoding 'chunked, chunked'",
    "folded": r"the env folded a header onto a second line, ' Content-Length: 2', which HTTP/1.1 "
              "forbids in a reply",
    "tab folded": "folded a header onto a second line",
    "no field": "a header line that is no NAME: VALUE, 'Content Length: 2'",
    "spaced": "a header line that is no NAME: VALUE, 'Content-Length : 2'",
    "no colon": "a header line that is no NAME: VALUE, 'Content-Length'",
    "interim": r"the env sent more than 64 KiB of interim \(1xx\) replies, and no reply"}


def test_mcp_client_keeps_one_connection_and_reads_every_framing_of_a_reply():
    # An env written on anything: replies by Content-Length, by chunks (with an extension and a
    # trailer), after a 100 Continue, over HTTP/1.0 to the connection's end, and with
    # Connection: close. The session keeps one connection while the env lets it, and opens
    # another when the env closed it (an idle timeout between two calls is no failure).
    connections: list[int] = []
    slow_arrived: asyncio.Event
    MALFORMED = {
        "status": b"HTTP/1.1 2\xb2\xb3 OK\r\nContent-Length: 0\r\n\r\n",
        "chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
        "chunk end": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhello\r\n0\r\n\r\n",
        "length": b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\nx",
        "two lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxy",
        # a coding that only holds the word chunked, one before it, chunked twice (in one field
        # or two), a coding agentenv.py never asked for: none is read as chunks, nor to the end
        "xchunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        "gzip first": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        "chunked twice": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: "
                         b"chunked\r\n\r\n0\r\n\r\n",
        "gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nx",
        # a header folded onto the next line (obs-fold): never read as a header of its own
        "folded": b"HTTP/1.1 200 OK\r\nX-Note: a\r\n Content-Length: 2\r\n\r\nxy",
        "tab folded": b"HTTP/1.1 200 OK\r\nX-Note: a\r\n\tContent-Length: 2\r\n\r\nxy",
        "no field": b"HTTP/1.1 200 OK\r\nContent Length: 2\r\n\r\nxy",
        "spaced": b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nxy",
        "no colon": b"HTTP/1.1 200 OK\r\nContent-Length\r\n\r\nxy",
        # interim replies that never end (each within the head's cap): not read for ever
        "interim": b"HTTP/1.1 100 Continue\r\nX-Pad: %s\r\n\r\n" % (b"x" * 1000) * 70 +
                   b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nxy"}

    def answer(text: str, rid: int) -> bytes:
        return json.dumps({"jsonrpc": "2.0", "id": rid, "result": {
            "content": [{"type": "text", "text": text}]}}).encode()

    async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
                msg = json.loads(await reader.readexactly(length) or b"{}")
                if head.startswith(b"DELETE"):
                    writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                    continue
                rid, how = msg.get("id"), (msg.get("params") or {}).get("name")
                if msg.get("method") == "initialize":
                    body = json.dumps({"jsonrpc": "2.0", "id": rid, "result": {
                        "protocolVersion": "2025-06-18", "serverInfo": {"name": "raw"}}}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nMcp-Session-Id: s1\r\nContent-Type: "
                                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                elif rid is None:
                    writer.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n")
                elif how == "chunked":
                    body = answer("in chunks", rid)
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: "
                                 b"chunked\r\nContent-Type: application/json\r\n\r\n%x;x=1\r\n%s\r\n"
                                 b"%x\r\n%s\r\n0\r\nTrailer: 1\r\n\r\n"
                                 % (5, body[:5], len(body) - 5, body[5:]))
                elif how == "to the end":
                    writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n"
                                 + answer("to the end", rid))
                    break
                elif how == "close":
                    body = answer("then closed", rid)
                    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n"
                                 b"\r\n%s" % (len(body), body))
                    break
                elif how == "idle out":         # answers, then closes as an idle timeout would
                    body = answer("idled out", rid)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))
                    await writer.drain()
                    break
                elif how == "cut":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{\"jsonrpc\"")
                    break
                elif how == "and more":        # a second reply nobody asked for, on its heels
                    body, forged = answer("the first", rid), answer("forged", rid + 1)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%sHTTP/1.1 200 OK"
                                 b"\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body, len(forged), forged))
                elif how == "then 408":        # answers, then times the idle connection out
                    body = answer("before the 408", rid)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
                    break
                elif how == "another id":
                    body = answer("not yours", rid + 7)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))
                elif how in MALFORMED:
                    writer.write(MALFORMED[how])
                    break
                elif how == "Chunked, spaced":   # one coding, as a list may give it
                    body = answer("in chunks too", rid)
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: ,  Chunked \t\r\n\r\n"
                                 b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
                elif how == "slow":
                    slow_arrived.set()
                    await asyncio.sleep(0.5)
                    body = answer("slowly", rid)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))
                else:
                    body = answer(f"called {how}", rid)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go():
        nonlocal slow_arrived
        slow_arrived = asyncio.Event()
        server, url = await raw_env(serve_one)
        session = McpSession(url)
        try:
            await session.open()
            for n in range(5):
                assert await session.call_tool(f"t{n}", {}) == ToolResult(f"called t{n}")
            assert await session.call_tool("chunked", {}) == ToolResult("in chunks")
            assert len(connections) == 1                # kept alive all along
            assert await session.call_tool("to the end", {}) == ToolResult("to the end")
            assert await session.call_tool("close", {}) == ToolResult("then closed")
            assert await session.call_tool("idle out", {}) == ToolResult("idled out")
            deadline = time.monotonic() + 30            # until the client has seen the close
            while any(kept.usable() for kept in session.line._idle):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert await session.call_tool("after", {}) == ToolResult("called after")
            assert len(connections) == 4                # after each close, one more
            with pytest.raises(aiohttp.ClientPayloadError, match="in the middle of its body"):
                await session.call_tool("cut", {})
            assert await session.call_tool("again", {}) == ToolResult("called again")
            # what an env sends beyond its reply is never read as the next call's reply
            assert await session.call_tool("and more", {}) == ToolResult("the first")
            assert await session.call_tool("next", {}) == ToolResult("called next")
            assert await session.call_tool("then 408", {}) == ToolResult("before the 408")
            while any(kept.usable() for kept in session.line._idle):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert await session.call_tool("after the 408", {}) == ToolResult("called after the 408")
            with pytest.raises(McpError, match="answered for another request .* out of step"):
                await session.call_tool("another id", {})
            for how in MALFORMED:               # a malformed reply fails the call, nothing else
                with pytest.raises(McpError if how == "status" else aiohttp.ClientPayloadError,
                                   match=MALFORMED_SAYS.get(how)):
                    await session.call_tool(how, {})
            assert await session.call_tool("Chunked, spaced", {}) == ToolResult("in chunks too")
            session.headers["AgentEnv-Role"] = "a\r\nX-Injected: 1"
            with pytest.raises(McpError, match="holds a line break"):
                await session.call_tool("injected", {})
            del session.headers["AgentEnv-Role"]
            # a call the session's close overtakes does not keep its connection
            slow = asyncio.ensure_future(session.call_tool("slow", {}))
            await slow_arrived.wait()
            await session.close()
            assert await slow == ToolResult("slowly")
            assert session.line._idle == []             # closed, not kept for nobody
        finally:
            await session.close()
            server.close()
            await server.wait_closed()
        assert session.line._idle == []

    run(go())


def test_an_answer_is_read_to_max_env_reply_in_every_framing_and_past_it_is_the_models_tool_error():
    # The cap is on what is read of the body, however it comes: by its length, in chunks, to the
    # connection's end, or as an event stream (every event of it: notifications too). An answer
    # of exactly the cap is read; a byte more is a tool error the model reads (it asked for too
    # much: never a mask), the connection it came on is never used again, and the session goes on.
    def framed(how: str, rid: int, size: int) -> tuple[bytes, bytes]:
        """The reply's head and the body counted against the cap."""
        text = "x" * size
        if how == "sse":
            note = json.dumps({"jsonrpc": "2.0", "method": "notifications/message",
                               "params": {"data": "working"}})
            body = b"data: %s\n\ndata: %s\n\n" % (note.encode(), json.dumps({
                "jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": text}]}}
            ).encode())
            return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" \
                % len(body), body
        body = json.dumps({"jsonrpc": "2.0", "id": rid, "result": {
            "content": [{"type": "text", "text": text}]}}).encode()
        if how == "length":
            return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), body
        if how == "chunks":
            return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", body
        return b"HTTP/1.0 200 OK\r\n\r\n", body               # to the end

    async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
                msg = json.loads(await reader.readexactly(length) or b"{}")
                rid, name = msg.get("id"), (msg.get("params") or {}).get("name") or ""
                if msg.get("method") == "initialize" or rid is None:
                    body = json.dumps({"jsonrpc": "2.0", "id": rid, "result": {}}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                    continue
                how, _, size = name.partition(" ")
                if how == "trailers":        # a short answer, then trailers of ``size`` bytes
                    head, body = framed("chunks", rid, 5)
                    writer.write(head + b"%x\r\n%s\r\n0\r\n" % (len(body), body) +
                                 b"X-Pad: %s\r\n" % (b"x" * 990) * (int(size) // 1000) + b"\r\n")
                    continue
                head, body = framed(how, rid, int(size or 5))
                if how == "chunks":          # in pieces of 1000 bytes
                    body = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 1000]), body[i:i + 1000])
                                    for i in range(0, len(body), 1000)) + b"0\r\n\r\n"
                writer.write(head + body)
                if how == "end":
                    break
        writer.close()

    async def go():
        server, url = await raw_env(serve_one)
        session = McpSession(url, max_body=50_000)
        try:
            await session.open()
            for how in ("length", "chunks", "end", "sse"):
                # the size of text whose answer is the cap exactly (its envelope, counted once)
                envelope = len(framed(how, session.next_id + 1, 0)[1])
                exactly = await session.call_tool(f"{how} {50_000 - envelope}", {})
                assert exactly == ToolResult("x" * (50_000 - envelope)), (how, exactly.text[-200:])
                idle = list(session.line._idle)
                past = await session.call_tool(f"{how} {50_001 - envelope}", {})
                assert past == ToolResult(
                    "the answer is longer than the 50,000 bytes agentenv.py reads of an env's answer "
                    "(max_env_reply); ask the tool for less at a time", agentenv.TOOL_ERROR), how
                assert not set(session.line._idle) - set(idle), f"{how}: its connection was kept"
                assert await session.call_tool("length 3", {}) == ToolResult("xxx")
            # trailers count as the body does: an env can't send them past the cap either
            assert await session.call_tool("trailers 40000", {}) == ToolResult("xxxxx")
            assert (await session.call_tool("trailers 60000", {})).status == agentenv.TOOL_ERROR
            session.line.max_body = 2 * 2**20
            assert (await session.call_tool(f"length {3 * 2**20}", {})).text.startswith(
                "the answer is longer than the 2 MiB agentenv.py reads")
        finally:
            session.drop()
            server.close()
            await server.wait_closed()

    run(go())


@pytest.mark.parametrize("sid", ["abc\x01def", "abc\x7f", "tab\there", "caf\xe9", "x\x1f"])
def test_a_session_id_that_is_not_visible_ascii_is_refused_as_it_arrives(sid):
    # MCP's spec: a session id is visible ASCII (0x21 to 0x7E), and agentenv.py sends it back in
    # a header. One that holds anything else is refused when it comes (on initialize, or on a
    # later answer), never sent back to the env.
    sent = []

    async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                sent.append(head)
                length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
                msg = json.loads(await reader.readexactly(length) or b"{}")
                later = (msg.get("params") or {}).get("name") == "later"
                given = sid if msg.get("method") == "initialize" or later else "s1"
                body = json.dumps({"jsonrpc": "2.0", "id": msg.get("id"), "result": {
                    "content": [{"type": "text", "text": "ok"}]}}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nMcp-Session-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (given.encode("latin-1"), len(body), body))
        writer.close()

    async def go():
        server, url = await raw_env(serve_one)
        try:
            first = McpSession(url)
            with pytest.raises(agentenv.McpBroken, match=re.escape(
                    f"it gave the session id {sid!r}, which holds characters MCP's spec does not "
                    "allow in one (visible ASCII alone, 0x21 to 0x7E)")):
                await first.open()
            first.drop()
            second = McpSession(McpSession(url).url)
            await second.notify("notifications/initialized")        # no session id yet
            second.headers["Mcp-Session-Id"] = "s1"
            assert await second.call_tool("now", {}) == ToolResult("ok")
            with pytest.raises(McpError, match="visible ASCII alone"):
                await second.call_tool("later", {})
            assert second.headers["Mcp-Session-Id"] == "s1"
            second.drop()
        finally:
            server.close()
            await server.wait_closed()
        assert not [head for head in sent if sid.encode("latin-1") in head], "sent back to the env"

    run(go())


def test_arguments_nested_past_what_json_writes_are_the_models_bad_arguments(fastmcp_url):
    # A wire reads a model's arguments where the stack is shallower than where the env client
    # writes them: nested nearly as deep as json reads, they can't be written again (json raises
    # RecursionError, which came out of serve as a 500 and a traceback). The model reads why.
    # (100,000 deep: Python 3.13's json writes 5,000, where 3.11's and 3.12's stop near 1,000.)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]

    async def go():
        session = McpSession(fastmcp_url)
        try:
            await session.open()
            assert await session.call_tool("add", {"a": deep, "b": 1}) == ToolResult(
                "the arguments of add nest deeper than agentenv.py writes; send them nested less "
                "deep", agentenv.BAD_ARGUMENTS)
            assert await session.call_tool("add", {"a": 2, "b": 3}) == ToolResult("5")
        finally:
            await session.close()

    run(go())


def test_a_card_or_an_initialize_past_max_env_reply_is_broken_not_asked_again():
    # What a deploy reads before any tool: past the cap (or, a card, nested past MAX_NESTING),
    # McpBroken, which fails the deploy at once; what is read of it is never more than the cap.
    kind = "fits"

    async def card(request: web.Request) -> web.StreamResponse:
        if kind == "deep":
            return web.Response(text='{"name": "x", "a": %s}' % ("[" * 70 + "]" * 70),
                                content_type="application/json")
        response = web.StreamResponse()         # chunked: its length unknown until its end
        await response.prepare(request)
        await response.write(b'{"name": "x", "pad": "' + b"x" * (1000 if kind == "fits" else 5000))
        await response.write(b'"}')
        return response

    async def mcp(request: web.Request) -> web.Response:
        msg = await request.json()
        version = {"fits": agentenv.MCP_PROTOCOL, "number": 20250618}.get(kind, "2025\x01")
        return web.json_response({"jsonrpc": "2.0", "id": msg.get("id"), "result": {
            "protocolVersion": version, "serverInfo": {"name": "x" * (5000 if kind == "long" else 5)}}})

    async def go():
        nonlocal kind
        app = web.Application()
        app.router.add_get("/.well-known/agent-env.json", card)
        app.router.add_post("/mcp", mcp)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        session = McpSession(base + "/mcp", max_body=2000)
        try:
            async with aiohttp.ClientSession() as http:
                assert (await agentenv._read_card(http, base, 2000))["name"] == "x"
                kind = "long"
                with pytest.raises(agentenv.McpBroken, match="its card is longer than the 2,000 bytes "
                                                             "agentenv.py reads of an answer"):
                    await agentenv._read_card(http, base, 2000)
                kind = "deep"
                with pytest.raises(agentenv.McpBroken, match="its card nests more than 64 levels"):
                    await agentenv._read_card(http, base, 2000)
            kind = "long"
            with pytest.raises(agentenv.McpBroken, match=r"its answer to initialize is longer than "
                                                         r"the 2,000 bytes agentenv.py reads of an "
                                                         r"answer \(max_env_reply\)"):
                await session.open()
            # a protocol version that is no version is not sent back in a header either
            for kind, said in (("number", "20250618"), ("control", "'2025\\x01'")):
                with pytest.raises(agentenv.McpBroken, match=re.escape(
                        f"it answered initialize with the protocolVersion {said}, which is no MCP "
                        "version (such as '2025-06-18'); fix its initialize")):
                    await session.open()
            kind = "fits"
            assert (await session.open())["protocolVersion"] == agentenv.MCP_PROTOCOL
        finally:
            session.drop()
            await runner.cleanup()

    run(go())


def nested_tool(name: str, levels: int) -> dict:
    """A tool whose JSON nests ``levels`` deep: itself, then its input schema's arrays of arrays."""
    schema: dict = {"type": "string"}
    for _ in range(levels - 2):
        schema = {"type": "array", "items": schema}
    return {"name": name, "inputSchema": schema}


@pytest.mark.parametrize("lister, says", [
    ("endless", "its tools/list gave a next cursor on page 100, the most agentenv.py reads (100 "
                "tools so far), so its pages may never end; give none after the last page"),
    ("repeats", "its tools/list gave the cursor 'same' a second time, on page 2, so its pages "
                "would never end"),
    ("crowded", "it lists more than 1000 tools (1100 in 11 pages), past what agentenv.py takes"),
    ("long", "its tool listing, 3 pages of it, is longer than the 50,000 bytes agentenv.py reads of "
             "an answer (max_env_reply; the pages of a listing count as one answer"),
    ("slow", "its tools/list took longer than 1s, "),
    ("deep", "its tool 'deep' nests 65 levels of JSON deep, past the 64 agentenv.py takes"),
    ("number cursor", "its tools/list gave the nextCursor 2, which is no string"),
    ("not a list", "it answered tools/list with tools that are dict, not a list"),
])
def test_a_tool_listing_past_its_limits_is_refused_saying_which_and_the_fix(lister, says):
    # One tools/list, every page of it, is one answer: within one deadline, max_env_reply's bytes,
    # MAX_LIST_PAGES pages and MAX_TOOLS tools, each cursor once and no tool nested past
    # MAX_NESTING. Within them, a listing is read whole (the last one, at each limit exactly).
    def page(cursor: int) -> dict:
        if lister == "endless" or (lister == "at the limits" and cursor < 99):
            return {"tools": [{"name": f"t{cursor}"}], "nextCursor": str(cursor + 1)}
        if lister == "repeats":
            return {"tools": [{"name": f"t{cursor}"}], "nextCursor": "same"}
        if lister == "crowded":
            return {"tools": [{"name": f"t{cursor}_{n}"} for n in range(100)],
                    "nextCursor": str(cursor + 1)}
        if lister == "long":
            return {"tools": [{"name": f"t{cursor}", "description": "x" * 20_000}],
                    "nextCursor": str(cursor + 1)}
        if lister == "slow":
            return {"tools": [], "nextCursor": str(cursor + 1)}
        if lister == "deep":
            return {"tools": [nested_tool("fine", 64), nested_tool("deep", 65)]}
        if lister == "number cursor":
            return {"tools": [{"name": "t"}], "nextCursor": 2}
        if lister == "not a list":
            return {"tools": {"name": "t"}}
        # at the limits: the last of 100 pages, 1000 tools in all, one nested 64 deep
        return {"tools": [{"name": f"u{n}"} for n in range(900)] + [nested_tool("deepest", 64)]}

    async def handler(request: web.Request) -> web.Response:
        msg = await request.json()
        if msg.get("id") is None:
            return web.Response(status=202)
        if msg["method"] == "initialize":
            return web.json_response({"jsonrpc": "2.0", "id": msg["id"], "result": {}})
        if lister == "slow":
            await asyncio.sleep(0.1)
        given = str((msg.get("params") or {}).get("cursor") or 0)
        cursor = int(given) if given.isdigit() else 1
        return web.json_response({"jsonrpc": "2.0", "id": msg["id"], "result": page(cursor)})

    async def go():
        runner, url = await sse_server(handler)
        session = McpSession(url, max_body=50_000 if lister == "long" else 2 * 2**20)
        try:
            await session.open()
            if lister == "at the limits":
                tools = await session.list_tools()
                assert len(tools) == agentenv.MAX_TOOLS and tools[-1]["name"] == "deepest"
                return
            with pytest.raises(agentenv.McpBroken, match=re.escape(says)):
                await session.list_tools(timeout=1 if lister == "slow" else agentenv.LIST_TIMEOUT)
        finally:
            session.drop()
            await runner.cleanup()

    run(go())


def test_a_tool_listing_within_its_limits_is_read_whole():
    test_a_tool_listing_past_its_limits_is_refused_saying_which_and_the_fix("at the limits", "")


def test_a_first_page_of_tools_that_never_comes_is_a_timeout_as_any_answer_is():
    # Not an env past a limit (it may be starting up): a deploy asks again, to its deadline.
    asked = asyncio.Event()
    released = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        msg = await request.json()
        if msg.get("method") == "tools/list":
            asked.set()
            await released.wait()               # no answer until the test is over
        return web.json_response({"jsonrpc": "2.0", "id": msg.get("id"), "result": {}})

    async def go():
        runner, url = await sse_server(handler)
        session = McpSession(url)
        try:
            await session.open()
            with pytest.raises(TimeoutError):
                await session.list_tools(timeout=0.5)
            assert asked.is_set()
        finally:
            session.drop()
            released.set()
            await runner.cleanup()

    run(go())


def test_an_answer_nested_past_what_python_reads_fails_the_call_not_the_server():
    # JSON nested deeper than the stack allows: json raises RecursionError, which must come out
    # as an env's malformed answer (McpError), never as an error of agentenv.py's own.
    deep = "[" * 100_000 + "]" * 100_000

    async def handler(request: web.Request) -> web.Response:
        msg = await request.json()
        name = (msg.get("params") or {}).get("name")
        if msg.get("id") is None:
            return web.Response(status=202)
        if msg.get("method") == "initialize":
            return web.json_response({"jsonrpc": "2.0", "id": msg["id"], "result": {}})
        if name == "body":
            return web.Response(text=deep, content_type="application/json")
        if name == "event":
            return web.Response(text=f"data: {deep}\n\n", content_type="text/event-stream")
        # an id nested as deep as json reads, but too deep for repr() in the message
        return web.Response(text='{"jsonrpc": "2.0", "id": %s, "result": {}}' % ("[" * 900 + "]" * 900),
                            content_type="application/json")

    async def go():
        runner, url = await sse_server(handler)
        session = McpSession(url)
        try:
            await session.open()
            with pytest.raises(McpError, match="not JSON .*nests arrays or objects deeper"):
                await session.call_tool("body", {})
            with pytest.raises(McpError, match="the server's event stream ended without an answer"):
                await session.call_tool("event", {})
            with pytest.raises(McpError, match=r"answered for another request \(id \[\[\[\[\[\[\[\.\.\.\]\]"):
                await session.call_tool("id", {})
        finally:
            session.drop()
            await runner.cleanup()

    run(go())


def test_an_env_known_stopped_ends_every_call_on_it_at_once():
    # A container dialled at its own address that dies answers nothing more: a call waiting on
    # it would wait out its timeout. Once its sandbox says it stopped (Instance.stopped), a call
    # in flight ends as if the env reset it, an idle connection is closed, no new one is opened,
    # and a verifier reading it is cancelled, masked PEER_DROP.
    arrived: asyncio.Event
    connections: list[asyncio.StreamReader] = []

    async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(reader)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
                msg = json.loads(await reader.readexactly(length) or b"{}")
                if (msg.get("params") or {}).get("name") == "hang":
                    arrived.set()         # and no answer, as from a container that died
                    continue
                result = {"protocolVersion": "2025-06-18"} if msg.get("method") == "initialize" \
                    else {"content": [{"type": "text", "text": "quick"}]}
                body = json.dumps({"jsonrpc": "2.0", "id": msg.get("id"), "result": result}).encode()
                status = b"200 OK" if msg.get("id") is not None else b"202 Accepted"
                writer.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body))
        writer.close()

    async def go():
        nonlocal arrived
        arrived = asyncio.Event()
        server, url = await raw_env(serve_one)
        stopped = asyncio.get_running_loop().create_future()
        session = McpSession(url, stopped=stopped)
        try:
            await session.open()
            hanging = asyncio.ensure_future(session.call_tool("hang", {}, timeout=600))
            await arrived.wait()
            assert await session.call_tool("quick", {}) == ToolResult("quick")  # a second line
            assert len(connections) == 2 and len(session.line._idle) == 1
            verifying = asyncio.ensure_future(asyncio.sleep(600))          # a verifier reading
            reading = asyncio.ensure_future(agentenv.while_running(
                verifying, stopped, "env 'notebook' stopped as its verifier read it"))
            await asyncio.sleep(0)
            stopped.set_result("its container exited with code 137")
            async with asyncio.timeout(10):
                with pytest.raises(aiohttp.ServerDisconnectedError):
                    await hanging
                with pytest.raises(EpisodeFailed) as failed:
                    await reading
                # the env's side of both connections sees them closed
                for reader in connections:
                    await reader.read()
            assert failed.value.failure.kind == agentenv.PEER_DROP
            assert str(failed.value.failure.reason) == \
                "env 'notebook' stopped as its verifier read it: its container exited with code 137"
            assert verifying.cancelled()
            with pytest.raises(aiohttp.ClientOSError, match=r"stopped \(its container exited"):
                await session.call_tool("after", {})
            assert len(connections) == 2 and not session.line._idle and not session.line._busy
            # a wait that ends first is its own result, and the future is left as it was
            other = asyncio.get_running_loop().create_future()
            assert await agentenv.while_running(asyncio.sleep(0, "rows"), other, "x") == "rows"
            assert not other.done() and not other._callbacks
            assert await agentenv.while_running(asyncio.sleep(0, "rows"), None, "x") == "rows"
        finally:
            session.drop()
            server.close()
            await server.wait_closed()

    run(go())


def test_env_addresses_go_round_the_subnet_and_come_back_only_when_given_back():
    # The daemon would give a dead env's address to the next env at once; serve gives each its
    # own, in turn, and one is taken again only once its container was removed and it was given
    # back, after every other free one.
    addresses = agentenv.EnvAddresses("10.9.8.0/29")      # .1 the gateway, .2 to .6 for envs
    assert addresses.gateway == "10.9.8.1"
    taken = [addresses.take() for _ in range(4)]
    assert taken == ["10.9.8.2", "10.9.8.3", "10.9.8.4", "10.9.8.5"]
    addresses.give_back("10.9.8.3")
    assert addresses.take() == "10.9.8.6"         # the freed one waits its turn
    assert addresses.take() == "10.9.8.3"
    with pytest.raises(EpisodeFailed, match="every one of the 5 addresses .* lower "
                                            "--max-concurrent-envs") as full:
        addresses.take()
    assert full.value.failure.kind == agentenv.PROVIDER_UNAVAILABLE


def test_a_long_tool_answer_is_cut_and_says_so():
    text = agentenv.tool_text({"content": [{"type": "text", "text": "x" * 100_050}]})
    assert text.startswith("x" * 100_000 + "\n[output cut: the tool answered 100050 characters")
    assert agentenv.tool_text({"content": [], "structuredContent": {"a": 1}}) == '{"a": 1}'
    assert agentenv.tool_text({"content": [{"type": "resource", "resource": {"text": "r"}}]}) == "r"


# -- FastMCP envs (no card, SSE answers)

def test_an_episode_on_a_fastmcp_env_without_a_card(make_bundle):
    steps = [deploy("plain"), agent("plain"), prompt("Add 2 and 3."), contains("5")]
    bundle = Bundle.load(make_bundle({"a": steps}, envs=("plain",), artifacts=()))

    async def go():
        async with local(bundle, deploy_timeout=30) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            assert ep.envs["plain"].card is None
            assert ep.envs["plain"].mcp_url.endswith("/mcp")
            assert [t["name"] for t in turn.tools] == ["add", "fail"]
            assert await turn.call("add", {"a": 2, "b": 3}) == ToolResult("5")
            failed = await turn.call("fail", {"why": "nope"})
            assert failed.is_error and "nope" in failed.text
            turn.end("5")
            result = await ep.result()
            await ep.closed.wait()
            assert_torn_down(ep)
            return result

    assert run(go(), timeout=60) == agentenv.Outcome("scored", {"answer": 1.0}, 1.0)


def test_concurrent_calls_on_one_turn_of_a_fastmcp_env_get_their_own_answers(make_bundle):
    steps = [deploy("plain"), agent("plain"), prompt("Add."), contains("done")]
    bundle = Bundle.load(make_bundle({"a": steps}, envs=("plain",), artifacts=()))

    async def go():
        async with local(bundle, deploy_timeout=30) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            answers = await asyncio.gather(*(turn.call("add", {"a": n, "b": 1000})
                                             for n in range(4)))
            turn.end("done")
            result = await ep.result()
            await ep.closed.wait()
            assert_torn_down(ep)
            return answers, result

    answers, result = run(go(), timeout=60)
    assert answers == [ToolResult(str(1000 + n)) for n in range(4)]
    assert result == agentenv.Outcome("scored", {"answer": 1.0}, 1.0)


# -- readiness: envs that fail their deploy

def test_an_env_that_exits_at_start_fails_the_episode_quoting_its_output(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple("broken")}, envs=("broken",)))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            with pytest.raises(EpisodeFailed) as caught:
                await ep.next_turn()
            result = await ep.result()
            await ep.closed.wait()
            assert_torn_down(ep)
            return str(caught.value), result

    message, result = run(go())
    assert message.startswith("step 'deploy-broken' (deploy_env) failed: env 'broken' did not come "
                              "up: its process exited with code 4. Its last output:")
    assert "fake: cannot start env broken: FAKE_MODE=exit" in message
    assert result.status == "failed" and result.failure.reason == message
    assert result.failure.kind == "provider_unavailable"     # the README's fault table


def test_an_env_that_never_listens_misses_the_deploy_timeout(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple("deaf")}, envs=("deaf",)))

    async def go():
        # 2.5 s: long enough for the env's first line to be printed on a loaded machine
        async with local(bundle, deploy_timeout=2.5) as rt:
            ep = rt.episode(bundle.tasks["a"])
            started = time.monotonic()
            with pytest.raises(EpisodeFailed) as caught:
                await ep.next_turn()
            took = time.monotonic() - started
            await ep.closed.wait()
            assert_torn_down(ep)
            return str(caught.value), took, caught.value.failure.kind

    message, took, kind = run(go())
    assert "env 'deaf' was not ready within 2.5s (last: ClientConnectorError" in message
    assert "fake: started, but never listening" in message
    assert 2.2 < took < 4.5        # it gives up once the next poll would pass the deadline
    # The README's fault table: an env never ready is a timeout, and the message names the knob.
    assert kind == "transport_timeout"
    assert "the deploy deadline; if it is only slow, raise --deploy-timeout" in message


def test_the_deploy_deadline_fires_before_gyms_reset_timeout_by_default(make_bundle):
    """On Gym's default path a never-ready env meets the deploy deadline (transport_timeout, the
    env's last output quoted) before reset_timeout (the same kind, with no output to quote)."""
    defaults = agentenv.Settings()
    assert defaults.deploy_timeout < defaults.reset_timeout
    runtime = Runtime(Bundle.load(make_bundle({"a": simple()})))
    assert runtime.settings.deploy_timeout == defaults.deploy_timeout


@pytest.mark.parametrize("env, part", [
    ("imposter", "env 'imposter' answers with the card of 'someone-else', not 'imposter'; set "
                 "environment_name in envs/imposter/env.toml"),
    ("empty", "env 'empty' lists no tools; an env offers at least one"),
])
def test_an_env_that_answers_wrongly_fails_the_deploy_at_once(make_bundle, env, part):
    bundle = Bundle.load(make_bundle({"a": [deploy(env), agent(env), prompt(), contains()]},
                                     envs=(env,)))

    async def go():
        async with local(bundle, deploy_timeout=20) as rt:
            started = time.monotonic()
            ep = rt.episode(bundle.tasks["a"])
            with pytest.raises(EpisodeFailed, match=re.escape(part)):
                await ep.next_turn()
            await ep.closed.wait()
            assert_torn_down(ep)
            return time.monotonic() - started

    assert run(go()) < 5      # not the deploy timeout


# An env that lists a tool of its own named end_turn; one whose session ids hold a control character.
END_TURN_SERVER = fake_server_with('    tool("dump",', '    tool("end_turn", "End the turn, the env '
                                                       'thinks."),\n')
SESSION_SERVER = FAKE_SERVER.replace('"fake-session"', '"fake\\x01session"')


@pytest.mark.parametrize("env, server, part", [
    ("endless", dockerfile("FAKE_MODE=endless"),
     "env 'endless' can't be played as it is: its tools/list gave a next cursor on page 100, the "
     "most agentenv.py reads (6 tools so far), so its pages may never end; give none after the last "
     "page, or list more tools a page"),
    ("sessions", SESSION_SERVER, "env 'sessions' can't be played as it is: it gave the session id "
                                 "'fake\\x01session', which holds characters MCP's spec does not allow"),
    ("reserved", END_TURN_SERVER,
     "env 'reserved' offers a tool named 'end_turn', the name of the tool that every wire adds to a "
     "turn to end it, so a call to the env's would never reach it; rename that tool in the env"),
], ids=["endless", "sessions", "reserved"])
def test_an_env_that_breaks_mcp_beyond_a_retry_fails_at_once_masked_env_failed(make_bundle, env,
                                                                                server, part):
    # Not asked again until the deploy deadline (20 s here), and the failure is the env's, with
    # what to fix: its listing that never ends, its session id, its tool named as ours.
    files = {f"envs/{env}/Dockerfile": server, f"envs/{env}/server.py": FAKE_SERVER} \
        if server.startswith("FROM") else custom_env(env, server)
    bundle = Bundle.load(make_bundle({"a": [deploy(env), agent(env), prompt(), contains()]},
                                     envs=(), files=files))

    async def go():
        async with local(bundle, deploy_timeout=20) as rt:
            started = time.monotonic()
            ep = rt.episode(bundle.tasks["a"])
            with pytest.raises(EpisodeFailed, match=re.escape(part)) as failed:
                await ep.next_turn()
            await ep.closed.wait()
            assert_torn_down(ep)
            assert failed.value.failure.kind == agentenv.ENV_FAILED
            assert ep.outcome.failure == failed.value.failure
            return time.monotonic() - started

    assert run(go()) < 10     # not the deploy timeout


# ================================================================ Verifiers

# -- aggregate_score, response_rows

@pytest.mark.parametrize("rows, aggregator, expected", [
    ([{"score": 0.5, "weight": 2}, {"result": True}], "weighted_average", 2 / 3),
    ([{"result": True, "weight": 1}, {"result": False, "weight": -0.5}], "weighted_average", 0.5),
    ([{"score": 2.0}], "weighted_average", 1.0),
    ([{"result": False, "weight": 1}, {"result": False, "weight": -1}], "weighted_average", 0.0),
    ([{"result": True, "weight": 0}, {"result": False}], "weighted_average", 0.0),
    ([{"result": True, "weight": -1}], "weighted_average", 0.0),      # no positive weight
    ([{"result": True}, {"score": 0.25}], "weighted_average", 0.625),
    ([], "weighted_average", 0.0),
    ([{"result": True}, {"result": True}], "all_pass", 1.0),
    ([{"result": True}, {"result": "yes"}], "all_pass", 0.0),         # strictly True
    ([{"result": True}, {"result": 1}], "all_pass", 0.0),
    ([{"result": True}, {"result": False}], "all_pass", 0.0),
    ([], "all_pass", 0.0),
    ([{"result": False}, {"result": True}], "any_pass", 1.0),
    ([{"result": False}, {"result": "yes"}], "any_pass", 0.0),
    ([], "any_pass", 0.0),
])
def test_aggregate_score_uses_agentenvs_formulas(rows, aggregator, expected):
    assert aggregate_score(rows, aggregator) == pytest.approx(expected, abs=1e-4)


def test_aggregate_score_known_value_to_four_places():
    assert round(aggregate_score([{"score": .5, "weight": 2}, {"result": True}],
                                 "weighted_average"), 4) == 0.6667


def test_response_rows_contains_every_needle_case_sensitively():
    criteria = [{"type": "response_contains", "needles": ["eggs", "milk"]}]
    rows = response_rows(criteria, "Buy eggs and milk.")
    assert rows[0]["result"] is True and rows[0]["score"] == 1.0 and rows[0]["criterion_index"] == 0
    assert rows[0]["justification"] == "all needles present"       # AgentEnv's words
    rows = response_rows(criteria, "Buy Eggs and milk.")
    assert rows[0]["result"] is False and rows[0]["score"] == 0.0
    assert rows[0]["justification"] == "missing: ['eggs']"


def test_response_rows_regex_flags():
    dotall = [{"type": "response_regex_present", "pattern": "a.b"}]
    assert response_rows(dotall, "a\nb")[0]["result"] is True          # no flags: DOTALL
    ignorecase = [{"type": "response_regex_present", "pattern": "a.b", "flags": ["IGNORECASE"]}]
    assert response_rows(ignorecase, "A-B")[0]["result"] is True
    assert response_rows(ignorecase, "A\nB")[0]["result"] is False     # flags given: only those
    none = [{"type": "response_regex_present", "pattern": "a.b", "flags": []}]
    assert response_rows(none, "a\nb")[0] == {**none[0], "criterion_index": 0, "score": 0.0,
                                               "result": False,
                                               "justification": "no match for pattern 'a.b'"}
    assert response_rows(none, "a-b")[0]["justification"] == "pattern matched"
    both = [{"type": "response_regex_present", "pattern": "^b", "flags": ["MULTILINE"]},
            {"type": "response_contains", "needles": ["zzz"]}]
    rows = response_rows(both, "a\nb")
    assert [r["result"] for r in rows] == [True, False]
    assert [r["criterion_index"] for r in rows] == [0, 1]
    assert aggregate_score(rows, "all_pass") == 0.0 and aggregate_score(rows, "any_pass") == 1.0


# -- what a verifier returns or raises

def test_a_verifier_that_raises_fails_the_episode_instead_of_scoring_0(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple(artifact="raises")}, artifacts=("raises",)))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            (await ep.next_turn()).end("hello")
            with pytest.raises(EpisodeFailed, match="the checker broke"):
                await ep.next_turn()
            result = await ep.result()
            await ep.closed.wait()
            assert_torn_down(ep)
            return result

    result = run(go())
    assert result.status == "failed" and result.reward is None and result.scores == {}
    assert result.failure.reason == ("step 'check' (env_outcome_verifier) failed: the verifier "
                              "artifacts/raises raised RuntimeError: the checker broke")


def test_a_verifier_that_returns_no_rows_fails_the_episode(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple(artifact="notalist")}, artifacts=("notalist",)))

    async def go():
        async with local(bundle) as rt:
            return await play(rt, bundle.tasks["a"])

    result = run(go())
    assert result.status == "failed"
    assert "the verifier artifacts/notalist returned str; verify returns a list of {id, result, " \
           "description} rows" in result.failure.reason


def test_a_verifiers_score_aggregator_is_applied(make_bundle):
    bundle = Bundle.load(make_bundle({
        "w": simple(artifact="weighted")[:3] + [outcome("weighted", score_aggregator="weighted_average")],
        "all": simple(artifact="weighted"), "any": simple(artifact="weighted")[:3] + [
            outcome("weighted", score_aggregator="any_pass")]}, artifacts=("weighted",)))

    async def go():
        async with local(bundle) as rt:
            return await asyncio.gather(*(play(rt, bundle.tasks[n]) for n in ("w", "all", "any")))

    weighted, all_pass, any_pass = run(go())
    assert weighted.reward == pytest.approx(2 / 3) and weighted.scores == {"check": weighted.reward}
    assert all_pass.reward == 0.0       # row a has no result True
    assert any_pass.reward == 1.0


# -- imports, threads, timeouts

def test_a_verifier_that_hangs_misses_the_verifier_timeout(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple(artifact="hangs")}, artifacts=("hangs",)))

    async def go():
        async with local(bundle, verifier_timeout=0.5) as rt:
            ep = rt.episode(bundle.tasks["a"])
            (await ep.next_turn()).end("hello")
            started = time.monotonic()
            result = await ep.result()
            took = time.monotonic() - started
            await ep.closed.wait()
            assert_torn_down(ep)
            return result, took

    result, took = run(go())
    assert result.status == "failed" and result.reward is None
    assert result.failure.reason == ("step 'check' (env_outcome_verifier) failed: the verifier "
                              "artifacts/hangs did not finish within 0.5s")
    assert took < 3


SLEEPER_VERIFIER = "import asyncio\n\n\nasync def verify(mcp_url):\n    await asyncio.sleep(3600)\n"


def running_verifier(path: Path) -> list[str]:
    """The live verifier worker threads that are running a verifier (or this file's code)."""
    frames = sys._current_frames()
    busy = []
    for thread in threading.enumerate():
        if not thread.name.startswith("verifier_") or thread.ident not in frames:
            continue
        frame = frames[thread.ident]
        while frame is not None:
            if frame.f_code.co_name == "run_verify" or frame.f_code.co_filename == str(path):
                busy.append(thread.name)
                break
            frame = frame.f_back
    return busy


def test_a_hanging_verifier_fails_the_episode_and_frees_its_thread(make_bundle):
    root = make_bundle({"a": simple(artifact="sleeper")}, artifacts=(),
                       files={"artifacts/sleeper/verify.py": SLEEPER_VERIFIER})
    bundle = Bundle.load(root)
    path = root / "artifacts" / "sleeper" / "verify.py"

    async def go():
        async with local(bundle, verifier_timeout=1) as rt:
            ep = rt.episode(bundle.tasks["a"])
            (await ep.next_turn()).end("hello")
            started = time.monotonic()
            result = await ep.result()
            took = time.monotonic() - started
            deadline = time.monotonic() + 2
            while running_verifier(path) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            busy = running_verifier(path)
            await ep.closed.wait()
            return result, took, busy

    result, took, busy = run(go())
    assert result.status == "failed" and result.reward is None
    assert result.failure.kind == "verifier_error"
    assert result.failure.reason == ("step 'check' (env_outcome_verifier) failed: the verifier "
                              "artifacts/sleeper did not finish within 1s")
    assert took < 4
    assert busy == [], f"the threads {busy} still run the verifier"


def test_a_slow_verifier_import_does_not_stall_the_loop_and_happens_once(make_bundle, tmp_path):
    imports = tmp_path / "imports.txt"
    source = (f"import time\nwith open({str(imports)!r}, 'a') as f:\n    f.write('imported\\n')\n"
              "time.sleep(0.5)\n\n\nasync def verify(mcp_url):\n"
              "    return [{'id': 'ok', 'result': True}]\n")
    bundle = Bundle.load(make_bundle({"a": simple(artifact="slow")}, artifacts=(),
                                     files={"artifacts/slow/verify.py": source}))

    async def go():
        async with local(bundle) as rt:
            episodes = [rt.episode(bundle.tasks["a"]) for _ in range(2)]
            turns = [await ep.next_turn() for ep in episodes]
            gaps: list[float] = []
            stop = asyncio.Event()

            async def tick():
                last = time.monotonic()
                while not stop.is_set():
                    await asyncio.sleep(0.05)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            ticker = asyncio.create_task(tick())
            await asyncio.sleep(0.1)
            for turn in turns:
                turn.end("done")
            results = await asyncio.gather(*(ep.result() for ep in episodes))
            stop.set()
            await ticker
            for ep in episodes:
                await ep.closed.wait()
            return results, gaps

    results, gaps = run(go())
    assert [r.reward for r in results] == [1.0, 1.0]
    assert max(gaps) < 0.3, f"the loop stalled for {max(gaps):.2f}s"
    assert imports.read_text() == "imported\n", "the verifier was not imported exactly once"


# ================================================================ Episode

# -- turns

def test_a_turn_scored_by_the_env_outcome_verifier(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with local(bundle) as rt:
            assert rt.sandbox.kind == "local"
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            assert ep.phase == "playing"
            assert turn.prompt == "Say hello." and turn.system_prompt is None
            assert turn.id == "turn1"
            result = await turn.call("say", {"text": "hello"})
            assert result == ToolResult("said 'hello'")
            turn.end("I said hello.")
            assert await ep.next_turn() is None
            good = await ep.result()
            await ep.closed.wait()
            assert_torn_down(ep)
            bad = await play(rt, bundle.tasks["a"], calls=[("say", {"text": "goodbye"})])
            return good, bad

    good, bad = run(go())
    assert good == agentenv.Outcome("scored", {"check": 1.0}, 1.0, None)
    assert bad.status == "scored" and bad.reward == 0.0 and bad.failure is None


def test_a_turn_scored_by_the_reply(make_bundle):
    steps = [deploy(), agent("main", system_prompt="Be brief."), prompt(),
             {**contains(), "criteria": [{"type": "response_contains", "needles": ["hello"]},
                                         {"type": "response_regex_present", "pattern": r"\bworld\b",
                                          "flags": ["IGNORECASE"]}],
              "score_aggregator": "weighted_average"}]
    bundle = Bundle.load(make_bundle({"a": steps}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            assert turn.system_prompt == "Be brief."
            turn.end("hello WORLD")
            full = await ep.result()
            half = await play(rt, bundle.tasks["a"], reply="hello there")
            none = await play(rt, bundle.tasks["a"], reply="")
            return full, half, none

    full, half, none = run(go())
    assert (full.status, full.reward) == ("scored", 1.0)
    assert (half.status, half.reward) == ("scored", 0.5)
    assert (none.status, none.reward) == ("scored", 0.0)


def test_two_turns_hand_over_the_second_prompt_after_the_first_ends(make_bundle):
    steps = [deploy(), agent("main", system_prompt="Agent prompt."),
             prompt("First, say hello."),
             prompt("Now say goodbye.", id="turn2", system_prompt="Turn prompt."),
             contains("goodbye", prompt_id="turn2")]
    bundle = Bundle.load(make_bundle({"a": steps}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            first = await ep.next_turn()
            assert first.id == "turn1" and first.prompt == "First, say hello."
            assert first.system_prompt == "Agent prompt."
            await first.call("say", {"text": "hello"})
            with pytest.raises(AgentEnvError, match="isn't ended, so the episode can't be scored"):
                await ep.result()
            assert await ep.next_turn() is first        # still open
            first.end("hello")
            with pytest.raises(AgentEnvError, match="turn 'turn1' has ended; call the tools of the "
                                                    "current turn"):
                await first.call("say", {"text": "late"})
            second = await ep.next_turn()
            assert second.id == "turn2" and second.prompt == "Now say goodbye."
            assert second.system_prompt == "Turn prompt."
            assert (await second.call("dump", {})).is_error
            second.end("goodbye")
            return await ep.result()

    assert run(go()) == agentenv.Outcome("scored", {"answer": 1.0}, 1.0)


def test_a_hidden_tool_is_not_offered_but_the_verifier_uses_it(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            names = [t["name"] for t in turn.tools]
            assert names == ["say", "whoami", "get_config", "sleep", "crash"]
            say = turn.tool_specs[0]
            assert say == {"name": "say", "description": "Say something; the verifier hears it.",
                           "input_schema": {"type": "object", "properties": {"text": {"type": "string"}},
                                            "required": ["text"]}}
            refused_call = await turn.call("dump", {})
            assert refused_call.is_error and refused_call.status == agentenv.UNKNOWN_TOOL
            assert refused_call.text == ("there is no tool 'dump'; the tools are: say, whoami, "
                                         "get_config, sleep, crash")
            bad_args = await turn.call("say", ["hello"])
            assert bad_args == ToolResult("the arguments of say must be a JSON object, not list",
                                          agentenv.BAD_ARGUMENTS)
            env_error = await turn.call("say", {})     # the env's words; its schema says why
            assert env_error == ToolResult("say: text must be a string", agentenv.BAD_ARGUMENTS)
            wrong_type = await turn.call("say", {"text": 5})
            assert wrong_type.status == agentenv.BAD_ARGUMENTS
            await turn.call("say", {"text": "hello"})
            turn.end("done")
            return await ep.result()

    assert run(go()).reward == 1.0      # the verifier read the state through the hidden tool


def test_the_agents_role_reaches_the_env(make_bundle):
    bundle = Bundle.load(make_bundle({"critic": simple(role="critic"), "plain": simple()}))

    async def go():
        async with local(bundle) as rt:
            seen = {}
            for name in ("critic", "plain"):
                ep = rt.episode(bundle.tasks[name])
                turn = await ep.next_turn()
                seen[name] = (await turn.call("whoami", {})).text
                await ep.abandon("seen enough")
            return seen

    assert run(go()) == {"critic": "critic", "plain": "(no role)"}


def test_a_seed_reaches_the_prompt_the_env_and_the_verifier(make_bundle):
    steps = [deploy(), config({"greeting": "<word>"}), agent("main"), prompt("Say <word>."),
             contains("<word>")]
    bundle = Bundle.load(make_bundle({"a": steps}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"], seed={"word": "banana"})
            turn = await ep.next_turn()
            assert turn.prompt == "Say banana."
            assert json.loads((await turn.call("get_config", {})).text) == {"greeting": "banana"}
            turn.end("banana!")
            right = await ep.result()
            wrong = await play(rt, bundle.tasks["a"], reply="<word>", seed={"word": "apple"})
            return right, wrong

    right, wrong = run(go())
    assert right.reward == 1.0 and wrong.reward == 0.0


def test_a_turn_offers_the_tools_of_every_env_of_the_agent(make_bundle):
    steps = [deploy("main"), deploy("other"), agent("main", "other", role="r"), prompt(), outcome()]
    bundle = Bundle.load(make_bundle({"a": steps}, envs=("main", "other")))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            names = [t["name"] for t in turn.tools]
            await turn.call("other_say", {"text": "hello"})    # said in the other env only
            turn.end("done")
            result = await ep.result()
            await ep.closed.wait()
            assert_torn_down(ep)
            assert len(ep.instances) == 2
            return names, result

    names, result = run(go())
    assert names == ["say", "whoami", "get_config", "sleep", "crash",
                     "other_say", "other_whoami", "other_get_config", "other_sleep", "other_crash"]
    assert result.reward == 0.0        # the verifier reads the main env, where nothing was said


def test_two_envs_offering_the_same_tool_fail_the_episode(make_bundle):
    root = make_bundle({"a": [deploy("main"), deploy("other"), agent("main", "other"), prompt(),
                              outcome()]}, envs=("main", "other"))
    (root / "envs" / "other" / "Dockerfile").write_text(dockerfile())    # no prefix: same names
    bundle = Bundle.load(root)

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            with pytest.raises(EpisodeFailed, match="the tool 'say' is offered by two envs of the turn"):
                await ep.next_turn()
            await ep.closed.wait()
            assert_torn_down(ep)

    run(go())


# -- the steps graph

def test_depends_on_graph_with_a_tolerated_failing_verifier(make_bundle, caplog):
    caplog.set_level(logging.INFO, logger="agentenv")
    steps = [deploy(), agent("main"), prompt(),
             outcome("raises", id="flaky", fail_task_on_error=False),
             contains(id="after", depends_on=["flaky"]),
             contains(id="answer", depends_on=["turn1"])]
    root = make_bundle({"a": steps}, artifacts=("raises",))

    async def go(reward):
        bundle = Bundle.load(root, reward=reward)
        async with local(bundle) as rt:
            return await play(rt, bundle.tasks["a"])

    # a tolerated failure counts as done: the steps after it run, as AgentEnv runs them
    after = run(go("after"))
    assert after == agentenv.Outcome("scored", {"after": 1.0, "answer": 1.0}, 1.0)
    assert any("step 'flaky' (env_outcome_verifier) failed: " in r.getMessage() and
               r.getMessage().endswith("going on (fail_task_on_error is false).")
               for r in caplog.records)
    failed = run(go("flaky"))
    assert failed.status == "failed"
    assert failed.failure.reason.startswith("no reward: the run recorded no score at step 'flaky' (the "
                                     "verifier artifacts/raises raised RuntimeError: the checker "
                                     "broke)")
    scored = run(go("answer"))
    assert scored == agentenv.Outcome("scored", {"answer": 1.0, "after": 1.0}, 1.0)


def test_a_prompts_system_prompt_stays_the_agents_for_the_turns_after_it(make_bundle):
    """AgentEnv's rule (its spec, 2.1): deploy S0, prompts with none / S1 / none -> S0, S1, S1."""
    steps = [agent(system_prompt="S0"), prompt(id="p1"), prompt(id="p2", system_prompt="S1"),
             prompt(id="p3"), contains(prompt_id="p3")]
    bundle = Bundle.load(make_bundle({"a": steps}, envs=(), artifacts=()))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            seen = []
            while (turn := await ep.next_turn()) is not None:
                seen.append((turn.id, turn.system_prompt))
                turn.end("hello")
            return seen, await ep.result()
    seen, result = run(go())
    assert seen == [("p1", "S0"), ("p2", "S1"), ("p3", "S1")] and result.reward == 1.0


class _LatestFirst(set):
    """A set that iterates the latest-created task first: one order a set may have."""

    def __iter__(self):
        def created(task):
            found = re.fullmatch(r"Task-(\d+)", task.get_name()) if isinstance(task, asyncio.Task) \
                else None
            return int(found[1]) if found else -1
        return iter(sorted(set.__iter__(self), key=created, reverse=True))


def test_a_failing_step_with_dependents_fails_with_its_own_reason(make_bundle, monkeypatch):
    """The steps that depend on a step that failed the episode never start, and the failure is
    the step's own, whatever order the finished steps are looked at in."""
    steps = [agent(), prompt(timeout_seconds=0.05)] + \
        [contains(id=f"after{n}", depends_on=["turn1"]) for n in range(3)]
    bundle = Bundle.load(make_bundle({"a": steps}, envs=(), artifacts=()), reward="after0")
    real_wait = asyncio.wait

    async def wait(fs, **options):      # asyncio.wait, its done set in a legal, adversarial order
        done, pending = await real_wait(fs, **options)
        return _LatestFirst(done), pending

    monkeypatch.setattr(asyncio, "wait", wait)

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            await ep.closed.wait()
            return ep.outcome

    result = run(go())
    assert result.status == "failed" and result.scores == {}
    assert result.failure.reason.startswith("step 'turn1' (prompt_agent) failed: turn 'turn1' was not "
                                     "ended within 0.05s"), result.failure


def test_a_tolerated_turn_timeout_closes_the_turn(make_bundle, tmp_path):
    steps = [deploy(), agent("main"), prompt(timeout_seconds=1, fail_task_on_error=False),
             outcome("hangs", depends_on=["agent"])]      # waits for the release file
    bundle = Bundle.load(make_bundle({"a": steps}, artifacts=("hangs",)))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            await asyncio.sleep(1.5)                    # past the turn's timeout_seconds
            waiting = asyncio.ensure_future(ep.next_turn())
            await asyncio.sleep(0.2)
            handed_back = waiting.done() and waiting.result() is turn
            with pytest.raises(AgentEnvError, match="turn 'turn1' has ended"):
                await turn.call("say", {"text": "too late"})
            (tmp_path / "release").touch()              # the verifier finishes
            after = await waiting
            result = await ep.result()
            await ep.closed.wait()
            assert_torn_down(ep)
            return handed_back, after, result

    handed_back, after, result = run(go())
    assert not handed_back, "next_turn() handed back the turn that timed out"
    assert after is None
    assert result == agentenv.Outcome("scored", {"check": 1.0}, 1.0)


# -- apply_server_config

def test_apply_server_config_reaches_the_env(make_bundle):
    steps = [deploy(), config({"greeting": "ahoy", "level": 3}), agent("main"), prompt(), outcome()]
    bundle = Bundle.load(make_bundle({"a": steps}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            text = (await turn.call("get_config", {})).text
            await ep.abandon("done")
            return text

    assert json.loads(run(go())) == {"greeting": "ahoy", "level": 3}


@pytest.mark.parametrize("step, parts", [
    (config({"x": 1}, uri="urn:fake:nope/v1"),
     ["step 'config' (apply_server_config) failed", "env 'main' advertises no extension "
      "'urn:fake:nope/v1' on its card (it advertises ['urn:fake:config/v1'])"]),
    (config({"bad": 1}), ["env 'main' refused 'urn:fake:config/v1' with HTTP 400",
                          "bad is not a setting"]),
    ({**config({"x": 1}), "directives": [{"service": "billing", "uri": "urn:fake:config/v1"}]},
     ["a directive names service 'billing', but env 'main' serves 'main'; use that or \"*\""]),
])
def test_apply_server_config_failures_fail_the_episode(make_bundle, step, parts):
    bundle = Bundle.load(make_bundle({"a": [deploy(), step, agent("main"), prompt(), outcome()]}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            with pytest.raises(EpisodeFailed) as caught:
                await ep.next_turn()
            await ep.closed.wait()
            assert_torn_down(ep)
            return str(caught.value), await ep.result()

    message, result = run(go())
    for part in parts:
        assert part in message
    assert result.status == "failed" and result.reward is None and result.failure.reason == message


def test_an_unadvertised_extension_is_skipped_with_tolerate_unadvertised(make_bundle):
    steps = [deploy(), config({"x": 1}, uri="urn:fake:nope/v1", tolerate_unadvertised=True),
             agent("main"), prompt(), contains()]
    bundle = Bundle.load(make_bundle({"a": steps}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            applied = (await turn.call("get_config", {})).text
            turn.end("hello")
            return applied, await ep.result()

    applied, result = run(go())
    assert applied == "{}" and result.reward == 1.0


# -- failures during a turn: tool timeouts, env crashes, the turn's timeout

def test_a_tool_that_misses_its_timeout_fails_the_episode(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            assert (await turn.call("sleep", {"seconds": 0.05}, timeout=5)).text == "slept"
            started = time.monotonic()
            timed_out = await turn.call("sleep", {"seconds": 10}, timeout=0.3)
            assert time.monotonic() - started < 2
            assert timed_out.status == agentenv.TIMEOUT and timed_out.is_error
            await ep.closed.wait()
            assert_torn_down(ep)
            with pytest.raises(EpisodeFailed):
                await ep.next_turn()
            return timed_out.text, await ep.result()

    message, result = run(go())
    assert message == ("sleep didn't answer within 0.3s, and the episode ended, since what the call "
                       "does may still be under way")
    assert result == agentenv.Outcome("failed", {}, None, agentenv.Failure("transport_timeout", message))


def test_the_outcome_is_ready_as_soon_as_a_tool_timeout_is_raised(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            assert (await turn.call("sleep", {"seconds": 10}, timeout=0.2)).status == agentenv.TIMEOUT
            with pytest.raises(EpisodeFailed, match="didn't answer within"):
                await ep.next_turn()
            return await ep.result()

    assert run(go()).status == "failed"


def test_an_env_that_crashes_mid_turn_fails_the_episode(make_bundle):
    bundle = Bundle.load(make_bundle({"a": [deploy("main"), deploy("other"), agent("main", "other"),
                                            prompt(), outcome()]}, envs=("main", "other")))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            with pytest.raises(EpisodeFailed) as caught:
                await turn.call("crash", {})
            await ep.closed.wait()
            assert_torn_down(ep)          # the other env is torn down too
            return str(caught.value), await ep.result()

    message, result = run(go())
    assert message.startswith("crash failed because the env failed: ")
    assert result.status == "failed" and result.reward is None and result.failure.reason == message


def test_an_env_that_crashes_mid_turn_says_how_it_stopped(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def crash(rt):
        ep = rt.episode(bundle.tasks["a"])
        turn = await ep.next_turn()
        with pytest.raises(EpisodeFailed) as caught:
            await turn.call("crash", {})
        await ep.closed.wait()
        return str(caught.value)

    async def go():
        async with local(bundle) as rt:
            return await asyncio.gather(*(crash(rt) for _ in range(3)))

    for message in run(go()):
        assert message.startswith("crash failed because the env failed: env 'main' stopped: its "
                                  "process exited with code 3. Its last output:"), message
        assert "fake: crashing on purpose" in message


def test_a_turn_not_ended_within_its_timeout_fails_the_episode(make_bundle):
    bundle = Bundle.load(make_bundle({"a": [deploy(), agent("main"), prompt(timeout_seconds=0.3),
                                            outcome()]}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            await ep.closed.wait()
            assert_torn_down(ep)
            with pytest.raises(AgentEnvError, match="has ended"):
                await turn.call("say", {"text": "too late"})
            return await ep.result()

    result = run(go())
    assert result.status == "failed"
    assert result.failure.reason == ("step 'turn1' (prompt_agent) failed: turn 'turn1' was not ended "
                              "within 0.3s (its prompt_agent step's timeout_seconds)")


# -- teardown and abandon

def test_abandon_during_a_turn_tears_everything_down(make_bundle):
    bundle = Bundle.load(make_bundle({"a": [deploy("main"), deploy("other"), agent("main", "other"),
                                            prompt(), outcome()]}, envs=("main", "other")))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            await ep.abandon("the trainer moved on")
            assert_torn_down(ep)
            assert turn.ended.done()
            with pytest.raises(EpisodeFailed, match="the trainer moved on"):
                await ep.next_turn()
            await ep.abandon("again")           # a second abandon changes nothing
            return await ep.result()

    assert run(go()) == agentenv.Outcome("abandoned", {}, None, agentenv.Failure("session_lost", "the trainer moved on"))


def test_abandon_while_deploying(make_bundle, isolated):
    bundle = Bundle.load(make_bundle({"a": simple("deaf")}, envs=("deaf",)))

    async def go():
        async with local(bundle, deploy_timeout=60) as rt:
            ep = rt.episode(bundle.tasks["a"])
            while not (ep.instances and list(isolated.iterdir())):     # the process runs
                await asyncio.sleep(0.02)
            assert ep.phase == "deploying"
            started = time.monotonic()
            await ep.abandon("no time")
            assert time.monotonic() - started < 5
            assert_torn_down(ep)
            return await ep.result()

    assert run(go()) == agentenv.Outcome("abandoned", {}, None, agentenv.Failure("session_lost", "no time"))


def test_abandon_at_any_moment_of_the_launch_leaves_no_process(make_bundle, isolated):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with local(bundle) as rt:
            outcomes = []
            for ticks in range(1, 9):     # 0 ticks: test_abandon_right_after_the_episode_starts
                ep = rt.episode(bundle.tasks["a"])
                for _ in range(ticks):
                    await asyncio.sleep(0)
                await ep.abandon(f"after {ticks} ticks")
                outcomes.append(ep.outcome.status)
            await asyncio.sleep(1.0)            # a leaked process would have written its pid
            assert rt.live == set()
            return outcomes

    assert run(go()) == ["abandoned"] * 8
    for pidfile in isolated.iterdir():
        assert gone(int(pidfile.name)), f"env process {pidfile.name} was left running"


def test_abandon_right_after_the_episode_starts(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        rt = await local(bundle).start()
        try:
            ep = rt.episode(bundle.tasks["a"])
            async with asyncio.timeout(3):       # (not wait_for: its new task would let the
                await ep.abandon("at once")      # driver run first) before the driver ever ran
            return ep.outcome, set(rt.live)
        finally:
            rt.live.clear()         # an episode whose abandon hung would hang close() too
            await rt.close()

    assert run(go()) == (agentenv.Outcome("abandoned", {}, None, agentenv.Failure("session_lost", "at once")), set())


# -- the model's doing, scored: the agent's box once its turn has begun is the model's

REPO_FILES = {"artifacts/repo/tests/test_x.py": "x = 1\n", "artifacts/repo/mod.py": "y = 2\n",
              "artifacts/tests/test_x.py": "x = 1\n"}


def played_in_a_box(*after, before=()):
    """A task whose agent works in a box: the repo loaded into /app, ``before``, the turn,
    ``after`` (the steps that load, check and score), as pyfix-v1's tasks go."""
    return [{"id": "agent", "type": "deploy_agent", "agent_name": "solver"},
            {"id": "repo", "type": "load_artifact", "agent_name": "solver", "artifact_id": "repo",
             "destination_path": "/app"}, *before, prompt(agent_name="solver"), *after]


def unit_tests(command, **fields):
    return {"id": "tests-ran", "type": "run_container_unit_tests_verifier", "agent_name": "solver",
            "command": command, "user": "agent", "timeout_sec": 20, **fields}


def play_box(bundle, commands, task="t"):
    """Play ``task`` with bash ``commands`` in the turn; the outcome and the metrics' page."""
    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks[task])
            turn = await ep.next_turn()
            for command in commands:
                await turn.call("bash", {"command": command})
            turn.end("done")
            outcome = await ep.result()
            await ep.closed.wait()
            return outcome, rt.metrics.page(None)[0].decode()
    return run(go())


def test_a_step_the_models_box_fails_after_its_turn_scores_0_not_masked(make_bundle):
    """The turn put a file where the tests are loaded again: the load fails on what the model
    left, so the rollout forfeits: scored 0 (never masked, which would teach the model to break
    what it can't solve), the reason said, and counted. The same step failing before any turn is
    the environment's, as before."""
    reload = {"id": "tests", "type": "load_artifact", "agent_name": "solver",
              "artifact_id": "tests", "destination_path": "/app/tests/more"}
    bundle = Bundle.load(make_bundle({"t": played_in_a_box(reload, unit_tests("true"))},
                                     envs=(), artifacts=(), files=REPO_FILES))
    outcome, page = play_box(bundle, ["rm -rf /app/tests && echo not-a-folder > /app/tests"])
    assert (outcome.status, outcome.reward, outcome.failure) == ("scored", 0.0, None)
    assert outcome.scores == {"tests-ran": 0.0}
    assert outcome.forfeit.startswith("step 'tests' (load_artifact) failed: the files could not be "
                                      "put in box 'solver' at /app/tests/more"), outcome.forfeit
    assert outcome.forfeit.endswith("(in the agent's box, as its commands left it)")
    assert "agentenv_forfeits_total 1.0" in page
    assert 'agentenv_episodes_total{outcome="scored"} 1.0' in page

    early = Bundle.load(make_bundle({"t": played_in_a_box(
        unit_tests("true"), before=[{**reload, "id": "early", "destination_path": "/app/mod.py/x"}])},
        envs=(), artifacts=(), files=REPO_FILES))
    with pytest.raises(EpisodeFailed, match="step 'early' .* could not be put"):
        run(_first_turn(early))


async def _first_turn(bundle):
    async with local(bundle) as rt:
        await rt.episode(bundle.tasks["t"]).next_turn()


def test_tests_that_fail_or_hang_score_0_not_masked_even_with_fail_task_on_error(make_bundle):
    """A unit-test verifier whose tests fail (fail_task_on_error left true, as AgentEnv's default)
    ends the episode, as AgentEnv's does, but scored 0 with its reason: a failing test is the
    model's, never the environment's."""
    bundle = Bundle.load(make_bundle({"t": played_in_a_box(unit_tests("echo nope >&2; exit 3"))},
                                     envs=(), artifacts=(), files=REPO_FILES))
    outcome, _ = play_box(bundle, [])
    assert (outcome.status, outcome.reward, outcome.failure) == ("scored", 0.0, None)
    assert outcome.forfeit.startswith("step 'tests-ran' (run_container_unit_tests_verifier) "
                                      "failed: Verifier 'tests-ran' exited 3"), outcome.forfeit


def test_after_the_turn_a_load_replaces_what_stood_and_checks_run_with_nothing_planted(make_bundle):
    """The turn added a test file and planted a home for the verifier (a marker, a user site):
    the tests folder loaded after the turn is exactly the artifact's, and the verifier's commands
    run with a fresh, empty HOME and no user site."""
    reload = {"id": "tests", "type": "load_artifact", "agent_name": "solver",
              "artifact_id": "tests", "destination_path": "/app/tests"}
    check = ('test "$(ls /app/tests)" = test_x.py && test ! -e "$HOME/marker" && '
             'test "$PYTHONNOUSERSITE" = 1 && test "$HOME" != /home/agent')
    bundle = Bundle.load(make_bundle({"t": played_in_a_box(reload, unit_tests(check))},
                                     envs=(), artifacts=(), files=REPO_FILES))
    outcome, _ = play_box(bundle, ["echo 'import os; os._exit(0)' > /app/tests/test_000.py",
                                   "touch $HOME/marker", "chmod 000 /app/tests"])
    assert (outcome.status, outcome.scores, outcome.forfeit) == ("scored", {"tests-ran": 1.0}, None)


OUTPUTS = {"reward_path": "/app/out/reward.txt", "result_paths": ["/app/out/result.json"]}


def test_what_the_model_left_where_a_verifier_writes_is_cleared_before_it_runs(make_bundle):
    """The turn planted a reward of 1 and a result where the unit-test verifier writes them, read-
    only in a folder made read-only: both are cleared before the verifier runs, so a verifier that
    writes nothing scores 0, its files missing, never what the model planted."""
    bundle = Bundle.load(make_bundle({"t": played_in_a_box(unit_tests("true", **OUTPUTS))},
                                     envs=(), artifacts=(), files=REPO_FILES))
    outcome, _ = play_box(bundle, [
        "mkdir -p /app/out && echo 1 > /app/out/reward.txt && echo '{\"passed\": 9}' > "
        "/app/out/result.json && chmod 444 /app/out/* && chmod 555 /app/out"])
    assert (outcome.status, outcome.scores, outcome.forfeit) == ("scored", {"tests-ran": 0.0}, None)
    seen = outcome.verifications["tests-ran"]
    assert seen["extracted_files"] == {"/app/out/result.json": None, "/app/out/reward.txt": None}
    assert seen["results"][0]["message"] == ("reward file '/app/out/reward.txt' missing or "
                                             "non-numeric (exit_code=0 timed_out=False)")


def test_a_verifiers_result_files_are_read_as_regular_files_and_to_a_cap(make_bundle):
    """The verifier's command leaves a link to a file holding 1 at its reward path, a FIFO and a
    sparse 4 GiB file at its result paths: neither the link nor the FIFO is read (the reward is
    0, saying why), the record keeps the sparse file's first RESULT_FILE_CAP bytes and says so,
    and the verify ends at once."""
    command = ("mkdir -p /app/out && cd /app/out && echo 1 > one && ln -s one reward.txt && "
               "mkfifo fifo && truncate -s 4G result.json")
    bundle = Bundle.load(make_bundle({"t": played_in_a_box(unit_tests(
        command, reward_path="/app/out/reward.txt",
        result_paths=["/app/out/fifo", "/app/out/result.json"]))},
        envs=(), artifacts=(), files=REPO_FILES))
    started = time.monotonic()
    outcome, _ = play_box(bundle, [])
    took = time.monotonic() - started
    assert (outcome.status, outcome.scores) == ("scored", {"tests-ran": 0.0})
    seen = outcome.verifications["tests-ran"]
    assert seen["results"][0]["message"] == ("reward file '/app/out/reward.txt' is a link, not a "
                                             "regular file (exit_code=0 timed_out=False)")
    cap = agentenv.RESULT_FILE_CAP
    assert seen["extracted_files"] == {
        "/app/out/fifo": None, "/app/out/reward.txt": None,
        "/app/out/result.json": "\0" * cap + f"\n[cut: the file holds {4 << 30} bytes; the record "
                                             f"keeps its first {cap}]"}
    assert took < 15


def test_a_verifier_whose_output_paths_cannot_be_cleared_does_not_run_and_scores_0(make_bundle):
    """A reward path nothing can clear (a file of /proc; in the agent's box, what the model's
    commands made so): the verifier does not run, and its step fails scored 0, saying why; never
    a reward read there, never a mask."""
    bundle = Bundle.load(make_bundle({"t": played_in_a_box(unit_tests(
        "touch /app/ran", reward_path="/proc/version"))}, envs=(), artifacts=(), files=REPO_FILES))
    outcome, _ = play_box(bundle, [])
    assert (outcome.status, outcome.reward, outcome.failure) == ("scored", 0.0, None)
    assert outcome.forfeit.startswith(
        "step 'tests-ran' (run_container_unit_tests_verifier) failed: Verifier 'tests-ran' did not "
        "run: what the model left at its output paths could not be cleared, so a result read "
        "there would be the model's, not the verifier's: /proc/version ("), outcome.forfeit
    assert outcome.scores == {"tests-ran": 0.0}


def test_a_command_under_way_when_its_turn_ends_is_stopped_and_said_so(make_bundle):
    """The turn ends while a bash command runs (its caller still waiting): the command is stopped
    before any step after the turn, and its caller reads why; the episode is scored."""
    bundle = Bundle.load(make_bundle({"t": played_in_a_box(unit_tests("true"))},
                                     envs=(), artifacts=(), files=REPO_FILES))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["t"])
            turn = await ep.next_turn()
            call = asyncio.ensure_future(turn.call("bash", {"command": "sleep 30"}))
            await asyncio.sleep(0.5)
            started = time.monotonic()
            turn.end("done")
            said = await call
            return said, time.monotonic() - started, await ep.result()
    said, took, outcome = run(go())
    assert said == agentenv.ToolResult("error: the turn ended while this command ran, so it was "
                                       "stopped", agentenv.TOOL_ERROR)
    assert took < 5 and outcome.scores == {"tests-ran": 1.0}


def test_a_call_whose_caller_gives_up_ends_its_episode_at_once(make_bundle):
    """The caller of a bash call is cancelled mid-call (its client went away): the command is
    killed, and the episode ends then, abandoned, saying so, its slot free."""
    bundle = Bundle.load(make_bundle({"t": played_in_a_box(unit_tests("true"))},
                                     envs=(), artifacts=(), files=REPO_FILES))

    async def go():
        async with local(bundle, max_concurrent_envs=1) as rt:
            ep = rt.episode(bundle.tasks["t"])
            turn = await ep.next_turn()
            call = asyncio.ensure_future(turn.call("bash", {"command": "sleep 60"}))
            await asyncio.sleep(0.5)
            started = time.monotonic()
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            async with asyncio.timeout(10):
                await ep.closed.wait()
            return ep.outcome, time.monotonic() - started, rt.pool.in_use
    outcome, took, in_use = run(go())
    assert outcome.status == "abandoned" and took < 5 and in_use == 0
    assert outcome.failure == agentenv.Failure(agentenv.SESSION_LOST,
                                               "its client went away during a call to bash")


# ================================================================ Pool and runtime

# -- the pool

def test_an_episode_waits_for_a_free_slot_and_the_warning_is_said_once(make_bundle, caplog):
    bundle = Bundle.load(make_bundle({"a": simple()}))
    task = bundle.tasks["a"]

    async def go():
        async with local(bundle, max_concurrent_envs=1) as rt:
            assert rt.pool.limit == 1
            first = rt.episode(task)
            turn = await first.next_turn()
            assert rt.pool.in_use == 1 and rt.pool.waiting == 0
            second = rt.episode(task)
            await asyncio.sleep(0.2)
            assert second.phase == "waiting" and second.instances == []
            assert rt.pool.waiting == 1 and rt.pool.in_use == 1
            third, fourth = rt.episode(task), rt.episode(task)
            await asyncio.sleep(0.05)
            assert rt.pool.waiting == 3
            await fourth.abandon("not needed")                 # abandoned while waiting
            assert fourth.outcome.status == "abandoned" and rt.pool.waiting == 2
            await turn.call("say", {"text": "hello"})
            turn.end("hello")
            assert (await first.result()).reward == 1.0
            for ep in (second, third):
                next_turn = await ep.next_turn()
                assert rt.pool.in_use == 1
                await next_turn.call("say", {"text": "hello"})
                next_turn.end("hello")
                assert (await ep.result()).reward == 1.0
                await ep.closed.wait()
            assert rt.pool.in_use == 0 and rt.pool.waiting == 0 and rt.live == set()

    run(go())
    warnings = [r for r in caplog.records if "episodes at once, so new episodes wait" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert warnings[0].getMessage() == (
        "The server is at its limit of 1 episodes at once, so new episodes wait their turn: raise "
        "--max-concurrent-envs (or MAX_CONCURRENT_ENVS) to run more at once.")


def test_the_heap_is_trimmed_once_the_pool_drains_and_stays_empty(make_bundle):
    """glibc's free arena memory goes back to the OS between busy stretches, never while an
    episode is live, and once per drain."""
    bundle = Bundle.load(make_bundle({"a": simple()}))
    task = bundle.tasks["a"]

    async def play(rt):
        ep = rt.episode(task)
        turn = await ep.next_turn()
        await turn.call("say", {"text": "hello"})
        turn.end("hello")
        assert (await ep.result()).reward == 1.0
        await ep.closed.wait()

    async def trims(rt, n):
        for _ in range(200):
            if rt.heap.trims >= n:
                return rt.heap.trims
            await asyncio.sleep(0.01)
        return rt.heap.trims

    async def go():
        async with local(bundle) as rt:
            if rt.heap._malloc_trim is None:
                pytest.skip("the C library here has no malloc_trim (not glibc)")
            rt.heap.quiet = 0.2
            await play(rt)
            await play(rt)                        # within the quiet time: the first drain's timer ends
            assert rt.heap.trims == 0
            assert await trims(rt, 1) == 1 and rt.heap.took_s > 0
            await asyncio.sleep(0.4)
            assert rt.heap.trims == 1             # no second trim without an episode in between
            ep = rt.episode(task)
            await ep.next_turn()
            await asyncio.sleep(0.4)
            assert rt.heap.trims == 1             # never while an episode is live
            await ep.abandon("done")
            await ep.closed.wait()
            assert await trims(rt, 2) == 2

    run(go())


def test_many_episodes_at_once_are_all_scored_within_the_limit(make_bundle, caplog):
    bundle = Bundle.load(make_bundle({"a": simple()}))
    peak = 0

    async def one(rt, n):
        nonlocal peak
        ep = rt.episode(bundle.tasks["a"])
        turn = await ep.next_turn()
        peak = max(peak, rt.pool.in_use)
        await turn.call("say", {"text": "hello" if n % 2 == 0 else "hi"})
        turn.end("done")
        result = await ep.result()
        await ep.closed.wait()
        return result

    async def go():
        async with local(bundle, max_concurrent_envs=5) as rt:
            results = await asyncio.gather(*(one(rt, n) for n in range(20)))
            assert rt.pool.in_use == 0 and rt.live == set()
            return results

    results = run(go(), timeout=50)
    assert [r.status for r in results] == ["scored"] * 20
    assert [r.reward for r in results] == [1.0, 0.0] * 10
    assert peak == 5
    assert len([r for r in caplog.records if "episodes at once, so new episodes wait" in r.getMessage()]) == 1


def test_the_pool_limit_is_a_whole_number_of_at_least_1(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple()}))
    for bad in (0, -1, 2.5):
        with pytest.raises(AgentEnvError, match="--max-concurrent-envs must be a whole number of at "
                                                "least 1"):
            Runtime(bundle, agentenv.Settings(max_concurrent_envs=bad))


def test_an_idle_sweep_ends_each_session_on_its_own_and_spares_one_a_request_reached():
    """The ends of a, b and c each wait for the next one to begin, as teardowns waiting their
    turn would: run one after another, the first would never return. b's end fails and c's hangs
    until the test is done; neither stops a, nor e, which comes as a ends and is idle only a
    second later, whose end a later sweep runs while c's still hangs. d was idle when the sweep found it, but a request reached
    it before its end began (a's end makes it busy): it is spared."""
    started: dict[str, asyncio.Event] = {}
    ended, order = [], ["a", "b", "c"]
    release = None

    class Idle:
        def __init__(self, name, idle_for):
            self.name, self.lease = name, agentenv.Lease()
            self.lease.last_used -= idle_for

    async def end(session, reason):
        sessions.pop(session.name)                     # as the wires' ends do, before any wait
        if session.name == "a":
            sessions["d"].lease.busy = 1               # a request reaches d now
            sessions["e"] = Idle("e", 0)               # idle past 1 s only a second from now
        if session.name in order:
            started[session.name].set()
            following = order[(order.index(session.name) + 1) % len(order)]
            await started[following].wait()
        if session.name == "b":
            raise RuntimeError("the end failed")
        if session.name == "c":
            await release.wait()
        ended.append((session.name, reason))

    sessions = {name: Idle(name, 10) for name in [*order, "d", "busy"]}
    sessions["busy"].lease.busy = 1                    # a session mid-request is never ended

    async def go():
        nonlocal release
        release = asyncio.Event()
        started.update({name: asyncio.Event() for name in order})
        metrics = agentenv.Metrics()
        sweep = asyncio.create_task(agentenv.sweep_idle("a test", "--idle-timeout", sessions, 1.0,
                                                        end, metrics, "openenv"))
        while len(ended) < 2:
            await asyncio.sleep(0.05)
        release.set()
        while len(ended) < 3:
            await asyncio.sleep(0.05)
        sweep.cancel()
        await asyncio.gather(sweep, return_exceptions=True)
        return metrics

    metrics = run(go(), timeout=20)
    why = "the session was idle past 1s"
    assert ended == [("a", why), ("e", why), ("c", why)], ended
    assert metrics.registry.get_sample_value("agentenv_idle_reaps_total", {"wire": "openenv"}) == 4


# -- the start gate

def test_envs_start_a_few_at_a_time_and_every_episode_is_scored(make_bundle):
    """Envs boot at most StartGate.size at once (launched, not yet answering): hundreds booting
    together would starve the server on a few cores. Every episode still gets its env."""
    bundle = Bundle.load(make_bundle({"a": simple()}))
    peak = 0

    async def watch(rt):
        nonlocal peak
        while True:
            peak = max(peak, sum(len(ep.instances) - len(ep.envs) for ep in rt.live))
            await asyncio.sleep(0.002)

    async def one(rt, n):
        ep = rt.episode(bundle.tasks["a"])
        turn = await ep.next_turn()
        await turn.call("say", {"text": "hello"})
        turn.end("done")
        return await ep.result()

    async def go():
        async with local(bundle, max_concurrent_envs=8) as rt:
            rt.starting = StartGate(size=2)
            watcher = asyncio.create_task(watch(rt))
            results = await asyncio.gather(*(one(rt, n) for n in range(8)))
            watcher.cancel()
            return results

    results = run(go(), timeout=60)
    assert [r.reward for r in results] == [1.0] * 8
    assert peak == 2


def test_a_start_that_takes_too_long_stops_holding_its_slot():
    """An env that never comes up holds a start slot for ``hold`` seconds only."""
    async def go():
        gate = StartGate(size=2, hold=0.2)
        order: list[str] = []
        stuck = asyncio.Event()

        async def never_ready(name):
            async with gate.slot():
                order.append(name)
                await stuck.wait()

        async def quick():
            async with gate.slot():
                order.append("quick")

        blockers = [asyncio.create_task(never_ready(n)) for n in ("a", "b")]
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await asyncio.wait_for(quick(), 5)           # waits for a stuck start's hold to end
        waited = time.monotonic() - started
        stuck.set()
        await asyncio.gather(*blockers)
        async with gate.slot(), gate.slot():          # every slot came back, none twice
            assert gate.free == 0
        return order, waited

    order, waited = run(go())
    assert order == ["a", "b", "quick"]
    assert 0.1 <= waited < 2


def test_a_warm_boot_gets_a_start_slot_only_when_no_episode_waits_for_one():
    async def go():
        gate = StartGate(size=2)
        order: list[str] = []
        hold = asyncio.Event()

        async def start(name, background=False):
            async with gate.slot(background=background):
                order.append(name)
                await hold.wait()

        first = [asyncio.create_task(start(n)) for n in ("a", "b")]       # the gate is full
        await asyncio.sleep(0.01)
        warm = asyncio.create_task(start("warm", background=True))
        await asyncio.sleep(0.01)
        later = [asyncio.create_task(start(n)) for n in ("c", "d")]        # came after the warm one
        await asyncio.sleep(0.01)
        assert (gate.waiting, gate.warming) == (2, 1)
        hold.set()
        await asyncio.gather(*first, warm, *later)
        return order

    order = run(go())
    assert order[:2] == ["a", "b"] and order[-1] == "warm", order


def test_warm_boots_wait_while_episodes_play_then_boot_all_at_once_or_one_at_a_time_after_patience():
    """A burst of rollouts takes the warm envs; with Docker their refill waits for the rollouts
    still playing (a boot costs the machine 0.4 CPU-seconds) and boots at the gate's full width
    once none plays. If some episode always plays, a boot that has waited its patience goes, one
    at a time. Unpaced (local, Ray), one boots at a time while episodes play."""
    async def go(ends: bool, paced: bool = True):
        gate = StartGate(size=4, patience=2.0, paced=paced)
        playing = {"now": True}
        gate.playing = lambda: playing["now"]
        holds = [asyncio.Event() for _ in range(4)]
        inside: list[int] = []

        async def boot(n):
            async with gate.slot(background=True):
                inside.append(n)
                await holds[n].wait()

        boots = [asyncio.create_task(boot(n)) for n in range(4)]
        await asyncio.sleep(0.1)
        at_first = (list(inside), gate.warming)
        async with gate.slot():                     # an episode's start is not held back by them
            pass
        if ends:
            playing["now"] = False
            gate.wake()                             # as the runtime does when an episode ends
            await asyncio.sleep(0.05)
            later = (sorted(inside), gate.warming)
        else:
            await asyncio.sleep(2.5)                # past the patience: one, and only one
            later = (sorted(inside), gate.warming)
            holds[inside[0]].set()                  # it ends: the next has waited long enough
            await asyncio.sleep(0.05)
            later = (later, (sorted(inside), gate.warming))
        for hold in holds:
            hold.set()
        await asyncio.gather(*boots)
        return at_first, later

    at_first, later = run(go(ends=True))
    assert at_first == ([], 4)
    assert later == ([0, 1, 2, 3], 0)
    at_first, later = run(go(ends=False))
    assert at_first == ([], 4)
    assert later == (([0], 3), ([0, 1], 2))
    # where a boot costs this machine nothing worth pacing (local, Ray), one at a time at once
    at_first, later = run(go(ends=True, paced=False))
    assert at_first == ([0], 3)
    assert later == ([0, 1, 2, 3], 0)


def test_teardowns_wait_while_episodes_play_and_all_go_when_a_slot_is_awaited_or_none_plays():
    """With Docker, the envs of a burst's first rollouts to end wait to be removed while the
    others play (a removal costs the machine a tenth of a CPU-second), their slots held; all go
    as soon as an episode waits for a slot, once none plays, or as the runtime closes, one per
    core at a time; one at a time after their patience if some episode always plays; and where
    removals cost nothing (local processes), at once."""
    async def go(paced: bool, opener: str, width: int = 4):
        state = {"playing": True, "awaited": False}
        closing = asyncio.Event()
        gate = agentenv.TeardownGate(paced, lambda: state["playing"], lambda: state["awaited"],
                                     closing, patience=2.0, width=width)
        holds = [asyncio.Event() for _ in range(4)]
        inside: list[int] = []

        async def teardown(n):
            async with gate.turn():
                inside.append(n)
                await holds[n].wait()

        tasks = [asyncio.create_task(teardown(n)) for n in range(4)]
        await asyncio.sleep(0.1)
        while_playing = (sorted(inside), gate.waiting)
        if opener == "closing":
            closing.set()
        elif opener == "patience":
            await asyncio.sleep(2.5)
        else:
            state["awaited" if opener == "slot" else "playing"] = opener == "slot"
        gate.wake()                                 # as the runtime does
        await asyncio.sleep(0.05)
        after = (sorted(inside), gate.waiting)
        for hold in holds:
            hold.set()
        await asyncio.gather(*tasks)
        return while_playing, after, gate.running

    for opener in ("slot", "no one plays", "closing"):
        while_playing, after, running = run(go(True, opener))
        assert while_playing == ([], 4), opener
        assert after == ([0, 1, 2, 3], 0), opener
        assert running == 0
    while_playing, after, _ = run(go(True, "patience"))
    assert (while_playing, after) == (([], 4), ([0], 3))
    # never more than one per core at once: a removal is the daemon's and the kernel's CPU
    while_playing, after, _ = run(go(True, "no one plays", width=2))
    assert (while_playing, after) == (([], 4), ([0, 1], 2))
    while_playing, after, _ = run(go(True, "closing", width=2))      # a shutdown waits for all
    assert (while_playing, after) == (([], 4), ([0, 1, 2, 3], 0))
    while_playing, _, _ = run(go(False, "slot", width=2))
    assert while_playing == ([0, 1, 2, 3], 0)


def test_a_teardown_someone_waits_for_does_not_wait_for_the_episodes_playing():
    """A probe's reply or a reaped session's closing frame waits for its episode's teardown: that
    one does not wait for the episodes playing, whether it was awaited before it came to the
    gate or while it waited there; it still goes one per core at a time (here one), ahead of
    those nobody waits for, which keep waiting."""
    async def go():
        gate = agentenv.TeardownGate(True, lambda: True, lambda: False, asyncio.Event(),
                                     patience=600.0, width=1)
        awaited = [asyncio.Event() for _ in range(3)]
        holds = [asyncio.Event() for _ in range(3)]
        awaited[0].set()                            # awaited before it came to the gate
        inside: list[int] = []

        async def teardown(n):
            async with gate.turn(awaited[n]):
                inside.append(n)
                await holds[n].wait()

        tasks = [asyncio.create_task(teardown(n)) for n in range(3)]
        await asyncio.sleep(0.1)
        seen = [(list(inside), gate.waiting, gate.running)]
        awaited[2].set()                            # awaited while it waits: no room yet
        await asyncio.sleep(0.1)
        seen.append((list(inside), gate.waiting, gate.running))
        holds[0].set()                              # the one removal under way ends
        await asyncio.sleep(0.1)
        seen.append((list(inside), gate.waiting, gate.running))
        holds[2].set()
        await asyncio.sleep(0.1)
        seen.append((list(inside), gate.waiting, gate.running))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return seen, gate.running

    seen, running = run(go())
    assert seen == [([0], 2, 1), ([0], 2, 1), ([0, 2], 1, 1), ([0, 2], 1, 0)], seen
    assert running == 0


# -- the warm pool

def test_the_warm_pool_is_split_among_env_specs_by_how_many_tasks_use_each(make_bundle):
    bundle = Bundle.load(make_bundle({
        "a": simple(), "b": simple(), "c": simple(),
        "small": [deploy(memory_mb=256), agent("main"), prompt(), outcome()],
        "d": simple("other", "check"), "e": simple("other", "check")}, envs=("main", "other")))
    main, small, other = ("main", ()), ("main", (("memory_mb", 256),)), ("other", ())
    assert agentenv.warm_plan(bundle, 6, ()) == {main: 3, small: 1, other: 2}
    assert agentenv.warm_plan(bundle, 2, ()) == {main: 1, other: 1}
    assert agentenv.warm_plan(bundle, 0, ()) == {}
    # named: the count among that env's specs; --warm among the rest
    assert agentenv.warm_plan(bundle, 3, (("main", 4),)) == {main: 3, small: 1, other: 3}
    assert agentenv.warm_plan(bundle, 0, (("other", 2),)) == {other: 2}
    with pytest.raises(AgentEnvError, match=r"^--warm-env \(warm_env\) names 'nope', which the "
                                            r"bundle has no env of; its envs are main, other$"):
        agentenv.warm_plan(bundle, 0, (("nope", 1),))


def test_warm_settings_from_a_gym_config_and_the_command_line(make_bundle):
    settings = agentenv.Settings.from_config({"warm": 4, "warm_env": {"main": 2}}, "here")
    assert (settings.warm, settings.warm_env) == (4, (("main", 2),))
    assert settings.gym_config(bundle=True)["warm"] == 4
    assert settings.gym_config(bundle=True)["warm_env"] == {"main": 2}
    assert "warm" not in agentenv.Settings().gym_config(bundle=True), "no pool, no key"
    assert agentenv.warm_envs(["main=2", "other=0"], "--warm-env") == (("main", 2), ("other", 0))
    for bad, says in [({"warm": -1}, "warm: -1 in here is not a whole number of warm envs (0 or "
                                     "more) nor auto; set it to one, such as 4"),
                      ({"warm": 1.5}, "warm: 1.5 in here is not a whole number"),
                      ({"warm_env": ["main"]}, "warm_env in here: main='' is not a whole number"),
                      ({"warm_env": 3}, "warm_env in here: 3 is not a mapping of env names")]:
        with pytest.raises(AgentEnvError) as caught:
            agentenv.Settings.from_config(bad, "here")
        assert str(caught.value).startswith(says), str(caught.value)
    root = make_bundle({"a": simple()})
    assert agentenv.main(["serve", str(root), "--sandbox", "local", "--warm-env", "nope=1"]) == 1


async def warm_ready(rt: Runtime, ready: int, timeout: float = 15) -> None:
    """Wait until the pool holds ``ready`` ready envs and boots no more."""
    deadline = time.monotonic() + timeout
    while (rt.warm.counts["ready"], rt.warm.counts["booting"]) != (ready, 0):
        assert time.monotonic() < deadline, f"the warm pool is at {rt.warm.counts}"
        await asyncio.sleep(0.02)


def test_an_episode_takes_a_warm_env_and_the_pool_refills(make_bundle, isolated):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with local(bundle, warm=2, max_concurrent_envs=1) as rt:
            await warm_ready(rt, 2)
            assert rt.pool.in_use == 0, "warm envs hold no episode slot"
            waiting = [w.instance for w in rt.warm.ready[("main", ())]]
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            assert ep.instances == [waiting[0]], "the episode took the first warm env"
            await turn.call("say", {"text": "hello"})
            turn.end("done")
            outcome = await ep.result()
            await ep.closed.wait()
            assert waiting[0].proc.returncode is not None, "a warm env is torn down with its episode"
            await warm_ready(rt, 2)
            assert waiting[1] in [w.instance for w in rt.warm.ready[("main", ())]]
            pool = [w.instance for w in rt.warm.ready[("main", ())]]
        return outcome, pool

    outcome, pool = run(go())
    assert outcome.reward == 1.0
    assert all(i.proc.returncode is not None for i in pool), "close removes the warm envs"
    assert not any((isolated.parent / "state").rglob("[0-9]*")), "no record left"


def test_a_warm_env_that_died_while_it_waited_is_replaced_and_the_start_goes_on(make_bundle, caplog):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with local(bundle, warm=1) as rt:
            await warm_ready(rt, 1)
            [dead] = [w.instance for w in rt.warm.ready[("main", ())]]
            os.killpg(dead.proc.pid, signal.SIGKILL)
            await dead.proc.wait()
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            assert dead not in ep.instances, "the dead warm env was handed over"
            await turn.call("say", {"text": "hello"})
            turn.end("done")
            outcome = await ep.result()
            await warm_ready(rt, 1)
            assert dead not in [w.instance for w in rt.warm.ready[("main", ())]]
            return outcome

    outcome = run(go())
    assert outcome.reward == 1.0
    said = [r.getMessage() for r in caplog.records if "died while it waited" in r.getMessage()]
    assert said and said[0].startswith("A warm env of 'main' died while it waited (its process "
                                       "exited with code -9); it is discarded, and another boots")


def test_a_deploy_that_finds_none_ready_claims_a_warm_env_already_booting(make_bundle):
    """Demand above the pool costs no extra boot: a deploy with no ready env of its spec takes one
    launched and booting (up sooner than a cold start); given up, that env goes back to the pool."""
    bundle = Bundle.load(make_bundle({"a": simple()}))
    key = ("main", ())

    async def go():
        async with local(bundle, warm=1) as rt:
            launched: list = []
            launch = rt.sandbox.launch

            async def counted(*args, **kwargs):
                launched.append(await launch(*args, **kwargs))
                return launched[-1]

            async def booting_one() -> None:
                """Send the ready warm env away, and wait until its replacement is launched."""
                await warm_ready(rt, 1)
                launched.clear()
                rt.warm._remove(rt.warm.ready[key].popleft().instance)
                rt.warm._wake[key].set()
                while not rt.warm._launched[key]:
                    await asyncio.sleep(0.001)

            rt.sandbox.launch = counted
            await booting_one()
            gave_up = rt.episode(bundle.tasks["a"])
            while rt.warm._launched[key]:                  # claimed
                await asyncio.sleep(0.001)
            await gave_up.abandon("the caller left")       # while its claimed env still boots
            await warm_ready(rt, 1)
            assert [w.instance for w in rt.warm.ready[key]] == launched, \
                "the abandoned claim's env went back to the pool, and no other was launched"
            await booting_one()
            ep = rt.episode(bundle.tasks["a"])
            turn = await ep.next_turn()
            assert ep.instances == launched[:1], "the episode took the booting warm env"
            await turn.call("say", {"text": "hello"})
            turn.end("done")
            return (await ep.result()).reward

    assert run(go()) == 1.0


def test_a_warm_env_that_can_not_boot_never_fails_a_start(make_bundle, caplog):
    """A spec whose warm boots fail leaves its episodes to deploy cold, as without a pool."""
    bundle = Bundle.load(make_bundle({"a": simple(), "b": simple("broken")},
                                     envs=("main", "broken")))

    async def go():
        async with local(bundle, warm_env={"broken": 1}) as rt:
            deadline = time.monotonic() + 10
            while not any("did not come up" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            return await play(rt, bundle.tasks["a"], calls=[("say", {"text": "hello"})])

    outcome = run(go())
    assert outcome.reward == 1.0
    said = next(r.getMessage() for r in caplog.records if "did not come up" in r.getMessage())
    assert said.startswith("A warm env of 'broken' did not come up (env 'broken' did not come up: "
                           "its process exited with code 4")
    assert "the pool tries again in 1s, and its episodes deploy cold meanwhile." in said


# -- closing the runtime

def test_closing_the_runtime_abandons_live_episodes(make_bundle):
    bundle = Bundle.load(make_bundle({"a": simple()}))

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(bundle.tasks["a"])
            await ep.next_turn()
            assert rt.live == {ep}
        assert_torn_down(ep)
        return ep.outcome

    assert run(go()) == agentenv.Outcome("abandoned", {}, None, agentenv.Failure("session_lost", "the server shut down"))


def test_a_toolsets_tools_are_found_once_and_listed_before_a_reset(make_bundle):
    """What OpenEnv's list_tools answers with no episode live: the tools of the toolset of the
    task played last, or before any reset of the first task's; each toolset deployed once."""
    root = make_bundle({"a": simple(), "d": [deploy("other"), agent("other"), prompt(), contains()]},
                       envs=("main", "other"))
    bundle = Bundle.load(root)

    async def go():
        async with local(bundle) as rt:
            played = []
            probe = rt.first_turn_tools

            async def counted(task, why):           # the real probe, counted
                played.append(task.name)
                return await probe(task, why)
            rt.first_turn_tools = counted
            main = bundle.tasks["a"].toolset
            first = await rt.toolset_tools(main, "a test listed them")
            assert await rt.toolset_tools(main, "a test listed them") == first
            assert played == ["a"] and not rt.live            # probed once, torn down
            session = agentenv.OpenEnvSession(rt, deadline=20)
            listed = (await session.step({"type": "list_tools"}))["observation"]["tools"]
            assert [t["name"] for t in listed] == [t["name"] for t in first] + ["end_turn"]
            assert not any(t["name"].startswith("other_") for t in listed)
            reset = await session.reset({"split": "all", "index": 1})        # d: the other toolset
            assert reset["done"] is False
            await session.close()
            listed = (await session.step({"type": "list_tools"}))["observation"]["tools"]
            assert [t["name"] for t in listed][-1] == "end_turn"
            assert all(t["name"].startswith("other_") for t in listed[:-1]) and listed[:-1]
            assert played == ["a", "d"]
            assert (await session.step({"type": "list_tools"}))["observation"]["tools"] == listed
            assert played == ["a", "d"] and not rt.live
    run(go(), timeout=60)


# ================================================================ The app: build_app

@pytest.mark.parametrize("given, says", [
    ({"bundle": "no/such/folder"}, "there is no bundle folder here"),
    ({"max_concurrent_envs": 0}, "max_concurrent_envs=0: it must be a whole number of at least 1"),
    ({"max_concurrent_envs": "8"}, "max_concurrent_envs='8': it must be a whole number"),
    ({"max_concurrent_envs": True}, "max_concurrent_envs=True: it must be a whole number"),
    ({"tool_timeout": -1}, "tool_timeout=-1: it must be a positive number of seconds, such as 60"),
    ({"idle_timeout": float("inf")}, "idle_timeout=inf: it must be a positive number of seconds"),
    ({"sandbox": "cloud"}, "sandbox='cloud' is not a sandbox agentenv.py runs envs in; pass 'docker', "
                           "'local', 'ray', or None"),
    ({"token": ""}, "token must be non-empty text"),
    ({"bundle": {}}, "the mapping of splits to bundle folders is empty"),
    ({"bundle": {"all": "x"}}, "'all' cannot name a split"),
    ({"bundle": 5}, "bundle must be a bundle's folder, or a mapping of split name to folder, not int"),
    ({"bash_timeot": 5}, "build_app takes no setting 'bash_timeot'; it takes max_concurrent_envs, "
                         "deploy_timeout"),
    ({"max_steps": 5}, "build_app takes no setting 'max_steps'"),          # eval's, not a server's
    ({"ray_address": "head"}, "ray_address='head': it must be the Ray cluster's head as HOST:PORT"),
])
def test_build_app_refuses_a_bad_argument_before_anything_starts(make_bundle, given, says):
    root = make_bundle({"a": simple()})
    with pytest.raises(AgentEnvError) as caught:
        agentenv.build_app(**{"bundle": root, **given})
    assert says in str(caught.value)


def test_build_app_serves_a_mapping_of_bundles_each_a_split(make_bundle):
    train = make_bundle({"a": simple(), "b": simple()}, name="train")
    held_out = make_bundle({"a": simple()}, name="held-out")
    app = agentenv.build_app({"train": train, "eval": held_out}, sandbox="local",
                             max_concurrent_envs=2)
    assert isinstance(app, web.Application)

    async def go():
        from aiohttp.test_utils import TestServer
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as http:
            async with http.get(server.make_url("/reverify_mode")) as resp:
                assert await resp.json() == "stateless"
            name = (await (await http.get(server.make_url("/list_environments"))).json())[0]
            found = {}
            for split in ("all", "train", "eval"):
                async with http.post(server.make_url(f"/{name}/tasks"), json={"split": split}) as resp:
                    found[split] = resp.status, await resp.json()
            return name, found

    name, found = run(go())
    assert name == "train+held-out"
    ids = {split: [t["id"] for t in body["tasks"]] for split, (_, body) in found.items()}
    assert [i.rsplit("/", 2)[-2:] for i in ids["train"]] == [["train", "a"], ["train", "b"]]
    assert [i.rsplit("/", 2)[-2:] for i in ids["eval"]] == [["held-out", "a"]]
    assert ids["all"] == ids["train"] + ids["eval"]


def test_build_app_refuses_two_bundles_with_different_envs_of_one_name(make_bundle):
    train = make_bundle({"a": simple()}, name="train")
    other = make_bundle({"a": simple()}, name="other")
    (other / "envs" / "main" / "server.py").write_text(FAKE_SERVER + "\n# another env\n")
    with pytest.raises(BundleError) as caught:
        agentenv.build_app({"train": train, "eval": other})
    assert "envs/main: the bundles of the splits 'train' and 'eval' both have one of that name, " \
           "with other contents; rename it in one of them" in str(caught.value)


# ================================================================ Eval

def test_eval_speaks_chat_as_responses_items():
    """A conversation of Responses items as chat messages (one reply's calls in one assistant
    message), and a chat completion back as the Responses object simple_agent would get."""
    params = {"instructions": "Be brief.", "max_output_tokens": 64, "tool_choice": {"type": "function"},
              "tools": [agentenv.function_tool({"name": "read_note", "description": "Read.",
                                                "input_schema": {"type": "object"}})]}
    conversation = [{"role": "system", "content": "You keep notes."},
                    {"role": "user", "content": [{"type": "input_text", "text": "Eggs?"}]},
                    {"type": "reasoning", "summary": []},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
                    {"type": "function_call", "call_id": "c1", "name": "read_note", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "list_notes", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "2 eggs"},
                    {"type": "function_call_output", "call_id": "c2", "output": "pancakes"}]
    body = agentenv.chat_request(params, conversation, "m", {"temperature": 0.5, "max_tokens": None})
    assert body["model"] == "m" and body["temperature"] == 0.5 and body["max_tokens"] == 64
    assert "tool_choice" not in body                         # a Responses-shaped choice stays out
    assert body["tools"] == [{"type": "function", "function": {"name": "read_note", "description": "Read.",
                                                               "parameters": {"type": "object"}}}]
    assert [(m["role"], m.get("content")) for m in body["messages"]] == [
        ("system", "Be brief."), ("system", "You keep notes."), ("user", "Eggs?"),
        ("assistant", "Let me look."), ("tool", "2 eggs"), ("tool", "pancakes")]
    assert [c["id"] for c in body["messages"][3]["tool_calls"]] == ["c1", "c2"]
    answer = {"id": "x", "created": 5, "model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                                               "total_tokens": 10},
              "choices": [{"finish_reason": "length", "message": {
                  "content": "Two.", "reasoning_content": "hmm",
                  "tool_calls": [{"id": "c3", "function": {"name": "read_note", "arguments": {"title": "x"}}}]}}]}
    response = agentenv.responses_of_chat(answer, params)
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][2]["call_id"] == "c3" and json.loads(response["output"][2]["arguments"]) == {"title": "x"}
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["input_tokens"] == 7 and response["usage"]["output_tokens"] == 3
    with pytest.raises(agentenv.ModelFailed) as refused:
        agentenv.responses_of_chat({"choices": [{"finish_reason": "content_filter", "message": {}}]}, params)
    assert refused.value.failure.kind == agentenv.MODEL_REFUSAL
    with pytest.raises(agentenv.ModelFailed) as garbled:
        agentenv.responses_of_chat({"error": "no"}, params)
    assert garbled.value.failure.kind == agentenv.MODEL_BAD_REPLY and "choices[0].message" in str(garbled.value)
    summed = agentenv.add_usage(agentenv.add_usage(None, response["usage"]), response["usage"])
    assert summed["total_tokens"] == 20 and summed["input_tokens_details"]["cached_tokens"] == 0


def test_eval_tells_the_endpoints_errors_apart():
    overflow = agentenv.ModelEndpoint._http_failure(
        "/chat/completions", 400, json.dumps({"error": {"message": "maximum context length is 4096 tokens"}}))
    assert overflow.kind == agentenv.MODEL_CONTEXT_OVERFLOW and "--max-model-len" in overflow.reason
    other = agentenv.ModelEndpoint._http_failure("/responses", 401, "bad key")
    assert other.kind == agentenv.MODEL_HTTP_ERROR and "answered /responses with 401: bad key" in other.reason
    assert agentenv._retry_after("2", 9.0) == 2.0 and agentenv._retry_after(None, 9.0) == 9.0
    assert agentenv._retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 1.0) == 1.0
    assert agentenv.is_model_failure("model:timeout") and not agentenv.is_model_failure("session_lost")


def _line(task: str, reward: float, repeat: int = 0, kind: str | None = None, seconds: float = 1.0) -> dict:
    return {"split": "eval", "task_id": f"@local/b/{task}", "_ng_rollout_index": repeat, "reward": reward,
            "mask_sample": kind is not None, "failure_kind": kind, "timings": {"seconds": seconds}}


def test_eval_summary_reads_as_a_user_wants_it():
    lines = [_line("a", 1.0, 0), _line("a", 0.0, 1, seconds=9.0), _line("b", 0.0, 0), _line("b", 0.0, 1),
             _line("c", 0.0, 0, "provider_unavailable"), _line("c", 0.0, 1, "model:timeout")]
    out = agentenv.summary(lines, repeats=2)
    assert out[0] == "6 rollouts"
    assert out[1] == "split eval: mean reward 0.250 ± 0.490 (95% interval), 4 scored of 6"
    assert out[2].startswith("  over 2 repeats of 2 tasks: pass@2 0.500 ± 0.980") and "mean@2 0.250" in out[2]
    assert out[3] == "masked by the environment: provider_unavailable 1"
    assert out[4] == "the model's failures: model:timeout 1"
    assert out[5].startswith("slowest: a #1 9.0s, ")
    assert agentenv.mean_interval([0.5]) == (0.5, 0.0)


def test_eval_rollouts_file_resumes_and_drops_what_must_be_played_again(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    done, failed = _line("a", 1.0), _line("b", 0.0, kind="model:http_error")
    path.write_text(json.dumps({**done, "model": "m"}) + "\n" + json.dumps(failed) + "\n" + '{"split": "ev')
    file = agentenv.RolloutsFile(path, "m")
    file.open()
    file.add({**_line("c", 0.2), "model": "m"})
    file.close()
    assert sorted(file.lines) == [("eval", "@local/b/a", 0), ("eval", "@local/b/c", 0)] and file.retried == 1
    assert [json.loads(t)["task_id"] for t in path.read_text().splitlines()] == ["@local/b/a", "@local/b/c"]
    with pytest.raises(AgentEnvError, match="holds rollouts of the model 'm', not 'n'"):
        agentenv.RolloutsFile(path, "n").open()
    path.write_text("not json\n")
    with pytest.raises(AgentEnvError, match="line 1 is not a rollout of eval"):
        agentenv.RolloutsFile(path, "m").open()


# ================================================================ Trainers and eval: TRL's environment class

EVERY_TYPE = {"type": "object", "required": ["text", "hours"], "additionalProperties": False,
              "properties": {
                  "text": {"type": "string", "description": "Some\n   text.", "minLength": 1},
                  "count": {"type": "integer"}, "ratio": {"type": "number"}, "flag": {"type": "boolean"},
                  "nothing": {"type": "null"},
                  "hours": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 24},
                  "point": {"type": "object", "properties": {"x": {"type": "number"}}},
                  "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
                  "drink": {"enum": ["tea", "coffee"]}, "size": {"type": "integer", "enum": [1, 2]},
                  "maybe": {"type": ["string", "null"]}, "fixed": {"const": "x"},
                  "either": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
                  "self": {"type": "string"}, "anything": {}}}


class Recorder:
    """What a tool method hands its environment: the tool's name and the model's arguments."""

    def __init__(self):
        self.calls = []

    def _call(self, name, arguments):
        self.calls.append((name, arguments))
        return "ok"


def test_trl_method_types_each_argument_and_documents_the_rest_of_its_schema():
    from typing import Any, Literal, Union

    method = agentenv.trl_method({"name": "every", "description": "Every type. Returns: a word.",
                                  "input_schema": EVERY_TYPE})
    signature = inspect.signature(method)
    receiver, *parameters = signature.parameters.values()
    assert receiver.name == "_self" and receiver.kind is inspect.Parameter.POSITIONAL_ONLY
    assert [p.name for p in parameters] == list(EVERY_TYPE["properties"])
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)
    required = {p.name for p in parameters if p.default is inspect.Parameter.empty}
    assert required == {"text", "hours"}
    assert all(p.default is None for p in parameters if p.name not in required)   # optional
    assert method.__annotations__ == {
        "text": str, "count": int, "ratio": float, "flag": bool, "nothing": type(None),
        "hours": list[int], "point": dict, "counts": dict[str, int],
        "drink": Literal["tea", "coffee"], "size": Literal[1, 2], "maybe": Union[str, None],
        "fixed": Literal["x"], "either": Union[str, int], "self": str, "anything": Any}
    assert method.__name__ == "every"
    doc = method.__doc__
    assert doc.startswith("Every type. Returns - a word.\n\nArgs:\n")      # no Returns: section
    assert '    text: Some text. (JSON schema: {"minLength": 1})\n' in doc
    assert '    hours: The hours. (JSON schema: {"minItems": 24, "items": {"minimum": 0}})\n' in doc
    assert '    point: The point. (JSON schema: {"properties": {"x": {"type": "number"}}})\n' in doc
    assert "    count: The count.\n" in doc and "    drink: The drink.\n" in doc
    recorder = Recorder()
    assert method(recorder, self="me", hours=[0] * 24) == "ok"    # an argument named self is the tool's
    assert recorder.calls == [("every", {"self": "me", "hours": [0] * 24})]


def test_trl_class_offers_the_tools_and_end_turn_and_nothing_else():
    tools = [{"name": "read_note", "description": "Read a note.", "input_schema": {
        "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}},
             {"name": "list_notes", "description": "", "input_schema": {}}]
    cls = agentenv.trl_class("notes-v1", "notebook", tools, None)
    assert cls.__name__ == "NotesV1" and issubclass(cls, agentenv.TrlEnvironment)
    assert agentenv.trl_class("notes-v1", "notebook", tools, None, named=True).__name__ == "NotesV1Notebook"
    # what TRL offers the model: every public function of the class but reset and get_reward
    offered = [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]
    assert offered == ["end_turn", "list_notes", "read_note", "reset"]
    assert inspect.signature(cls.end_turn).parameters["response"].default is None
    assert cls.list_notes.__doc__ == "The list_notes tool."
    recorder = Recorder()
    assert cls.read_note(recorder, title="soup") == "ok" and recorder.calls == [("read_note", {"title": "soup"})]


def test_trl_tools_that_cant_be_methods_are_refused_saying_which_and_why():
    def tool(name, *arguments):
        return {"name": name, "description": "", "input_schema": {
            "type": "object", "properties": {a: {"type": "string"} for a in arguments}}}

    problems = agentenv.trl_tool_problems("notebook", [
        tool("read_note", "title"), tool("read-note"), tool("class"), tool("_hidden"), tool("reset"),
        tool("get_reward"), tool("save", "from", "2x", "ok")])
    assert problems == [
        "toolset notebook: the tool 'read-note' can't be a method of TRL's environment: 'read-note' "
        "is not a Python identifier (letters, digits and _, not starting with a digit); rename it in the env",
        "toolset notebook: the tool 'class' can't be a method of TRL's environment: 'class' is a "
        "Python keyword; rename it in the env",
        "toolset notebook: the tool '_hidden' can't be a method of TRL's environment: it starts "
        "with an underscore, and TRL offers the model no method that does; rename it in the env",
        "toolset notebook: the tool 'reset' can't be a method of TRL's environment: TRL calls an "
        "environment's reset() itself, so it can't be a tool; rename it in the env",
        "toolset notebook: the tool 'get_reward' can't be a method of TRL's environment: TRL calls "
        "an environment's get_reward() itself, so it can't be a tool; rename it in the env",
        "toolset notebook: the argument 'from' of 'save' can't be a parameter of a Python method "
        "(TRL calls a tool by its method, and describes it from its parameters): 'from' is a Python "
        "keyword; rename it in the env",
        "toolset notebook: the argument '2x' of 'save' can't be a parameter of a Python method "
        "(TRL calls a tool by its method, and describes it from its parameters): '2x' is not a "
        "Python identifier (letters, digits and _, not starting with a digit); rename it in the env"]


def test_trl_schemas_that_would_break_the_class_builder_are_refused_saying_the_fix():
    # What a hostile (or careless) env may list: a schema nested past what the builder's type
    # hints take (it raised RecursionError), properties that are no object (TypeError), a
    # required list of what no set holds, names that are no strings. Each is a problem said with
    # its fix, before any class is built; what the builder then builds holds no surprise.
    def deep(levels):                    # an input schema of arrays of arrays, ``levels`` deep
        schema = {"type": "string"}
        for _ in range(levels - 3):
            schema = {"type": "array", "items": schema}
        return {"type": "object", "properties": {"grid": schema}}

    problems = agentenv.trl_tool_problems("notebook", [
        {"name": "fine", "input_schema": deep(64)},
        {"name": "deep", "input_schema": deep(65)},
        {"name": "deeper", "input_schema": deep(2000)},
        {"name": "listed", "input_schema": {"type": "object", "properties": [{"a": {}}]}},
        {"name": "counted", "input_schema": {"type": "object", "properties": 5}},
        {"name": ["not", "a", "name"], "input_schema": {}},
        {"name": "x" * 500 + "-", "input_schema": {}}])
    assert problems == [
        "toolset notebook: the input schema of 'deep' nests 65 levels of JSON deep, past the 64 "
        "TRL's environment class is built from (a type hint per level); flatten it in the env, "
        "naming its parts in $defs and reaching them by $ref",
        "toolset notebook: the input schema of 'deeper' nests 2000 levels of JSON deep, past the 64 "
        "TRL's environment class is built from (a type hint per level); flatten it in the env, "
        "naming its parts in $defs and reaching them by $ref",
        "toolset notebook: the input schema of 'listed' gives its properties as list, not an object "
        "of each argument's schema, so its arguments can't be a Python method's parameters; fix its "
        "schema in the env",
        "toolset notebook: the input schema of 'counted' gives its properties as int, not an object "
        "of each argument's schema, so its arguments can't be a Python method's parameters; fix its "
        "schema in the env",
        "toolset notebook: the tool ['not', 'a', 'name'] can't be a method of TRL's environment: "
        "['not', 'a', 'name'] is not a Python identifier (letters, digits and _, not starting with "
        "a digit); rename it in the env",
        "toolset notebook: the tool 'xxxxxxxxxxxx...xxxxxxxxxxxx-' can't be a method of TRL's "
        "environment: 'xxxxxxxxxxxx...xxxxxxxxxxxx-' is not a Python identifier (letters, digits and "
        "_, not starting with a digit); rename it in the env"]
    # what passes is built, 64 levels deep included, and a required list of anything is no crash
    method = agentenv.trl_method({"name": "fine", "input_schema": {
        **deep(64), "required": ["grid", ["a"], {"b": 1}, 3]}})
    assert inspect.signature(method).parameters["grid"].default is inspect.Parameter.empty
    with pytest.raises(RecursionError):        # what the refusal above keeps the builder from
        agentenv.trl_method({"name": "deeper", "input_schema": deep(2000)})


def test_trl_environment_refuses_settings_it_cant_use_before_connecting():
    url = f"http://127.0.0.1:{free_port()}"          # nothing listens: nothing is asked of it
    for settings, words in [
            ({"max_concurrent_envs": 4}, "max_concurrent_envs is the served bundle's setting, and "
                                         f"{url} is served already: pass it to serve there "
                                         "(--max-concurrent-envs)"),
            ({"sandbox": "local"}, "sandbox and reward say how to serve a bundle's folder"),
            ({"tool_timout": 5}, "trl_environment takes no setting 'tool_timout'; it takes "
                                 "reset_timeout, tool_timeout, max_concurrent_envs"),
            ({"reset_timeout": 0}, "reset_timeout=0: it must be a positive number of seconds")]:
        with pytest.raises(AgentEnvError, match=re.escape(words)):
            agentenv.trl_environment(url, **settings)
    with pytest.raises(AgentEnvError, match=f"no agentenv.py server answered at {re.escape(url)}"):
        agentenv.trl_environment(url)
    with pytest.raises(AgentEnvError, match="sandbox='vm' is not a sandbox"):
        agentenv.trl_environment(NOTES, sandbox="vm")


def test_trl_dataset_rows_are_the_splits_tasks_in_order():
    rows = agentenv.trl_dataset(NOTES, "all")
    assert [(r["split"], r["index"], r["task"]) for r in rows] == \
        [("all", 0, "recall-recipe"), ("all", 1, "save-groceries"), ("all", 2, "two-step")]
    assert rows[0]["prompt"] == [
        {"role": "system", "content": agentenv.Bundle.load(NOTES).tasks["recall-recipe"].system_prompt},
        {"role": "user", "content": "How many eggs does my 'pancakes' note say I need? Reply with "
                                    "just the number."}]
    assert all("environment" not in r for r in rows)           # one toolset: one class
    assert [r["task"] for r in agentenv.trl_dataset(NOTES, "smoke")] == ["save-groceries"]
    with pytest.raises(AgentEnvError, match="there is no split 'train' in .*: the splits are all, smoke"):
        agentenv.trl_dataset(NOTES)


def test_trl_reward_reads_the_last_reply_and_refuses_without_environments():
    assert agentenv.trl_reward([[]], [object()]) == [None]        # another kind of environment
    with pytest.raises(AgentEnvError, match="give GRPOTrainer environment_factory="):
        agentenv.trl_reward([[]])
    last = agentenv._last_reply
    assert last("plain text") == "plain text"
    assert last([{"role": "assistant", "content": "", "tool_calls": []},
                 {"role": "tool", "name": "read_note", "content": "2 eggs"},
                 {"role": "assistant", "content": [{"type": "text", "text": "2"}]}]) == "2"
    assert last([{"role": "tool", "content": "x"}]) == ""


# ================================================================ CLI: check

def test_check_prints_the_bundle_and_each_toolsets_tools(make_bundle, isolated):
    root = make_bundle({"a": simple(), "b": replied(),
                        "c": [deploy("main"), deploy("other"), agent("main", "other"), prompt(),
                              outcome()]},
                       envs=("main", "other"), evals={"smoke": 'tasks = ["b"]\n'})
    lines: list[str] = []
    run(agentenv.check(str(root), agentenv.Settings.of(sandbox="local"), None, out=lines.append))
    assert lines[0] == "bundle bundle: Fake bundle for tests."
    assert lines[1] == "splits: all (3 tasks), smoke (1 task)"
    assert lines[2:6] == ["tasks:",
                          "  a  toolset main  turns 1  reward check",
                          "  b  toolset main  turns 1  reward answer",
                          "  c  toolset main+other  turns 1  reward check"]
    assert lines[6:11] == ["sandbox: local", "networks:",
                           "  main: the host's network: the local sandbox isolates nothing",
                           "  other: the host's network: the local sandbox isolates nothing",
                           "toolsets:"]
    # with more than one toolset, each line says how far check has got
    assert re.fullmatch(r"  \[1/2\] main \(2 tasks\), played with a in \d+\.\d\ds: say, whoami, "
                        r"get_config, sleep, crash", lines[11])
    assert re.fullmatch(r"  \[2/2\] main\+other \(1 task\), played with c in \d+\.\d\ds: say, .*, "
                        r"other_crash", lines[12])
    assert lines[13:] == ["ok: every toolset deployed, and every env was torn down"]
    assert len(list(isolated.iterdir())) == 3 and all(gone(int(p.name)) for p in isolated.iterdir())


def test_check_raises_when_a_toolset_fails(make_bundle):
    root = make_bundle({"a": simple(), "z": simple("broken")}, envs=("main", "broken"))
    lines: list[str] = []
    with pytest.raises(AgentEnvError, match=r"^the toolsets broken did not play; see above$"):
        run(agentenv.check(str(root), agentenv.Settings.of(sandbox="local"), None, out=lines.append))
    assert any(line.startswith("  [1/2] main (1 task), played with a in ") for line in lines)
    failed = [line for line in lines if line.startswith("  [2/2] broken: the episode of z failed: ")]
    assert failed and "its process exited with code 4" in failed[0]
    assert "FAKE_MODE=exit" in failed[0]
    assert not any(line.startswith("ok:") for line in lines)


def test_check_says_a_tool_named_end_turn_is_the_envs_to_rename(make_bundle):
    root = make_bundle({"a": simple("reserved")}, envs=(),
                       files=custom_env("reserved", END_TURN_SERVER))
    lines: list[str] = []
    with pytest.raises(AgentEnvError, match=r"^the toolsets reserved did not play; see above$"):
        run(agentenv.check(str(root), agentenv.Settings.of(sandbox="local"), None, out=lines.append))
    assert "  reserved: the episode of a failed: step 'turn1' (prompt_agent) failed: env 'reserved' " \
           "offers a tool named 'end_turn', the " \
           "name of the tool that every wire adds to a turn to end it, so a call to the env's would " \
           "never reach it; rename that tool in the env" in lines, lines


def test_cli_check_exit_codes(make_bundle, capsys):
    good = make_bundle({"a": simple()})
    assert agentenv.main(["check", str(good), "--sandbox", "local"]) == 0
    out, err = capsys.readouterr()
    assert "bundle bundle: Fake bundle for tests." in out
    assert "ok: every toolset deployed, and every env was torn down" in out
    assert err == ""

    bad = make_bundle({"a": [deploy(), agent("main"), prompt()]})
    assert agentenv.main(["check", str(bad), "--sandbox", "local"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("agentenv.py check: the bundle has 1 problem:\n  - tasks/a.json: task 'a': records "
                   "no score, so it has no reward; add an env_outcome_verifier or "
                   "agent_prompt_response_verifier step\n")

    broken = make_bundle({"z": simple("broken")}, envs=("broken",))
    assert agentenv.main(["check", str(broken), "--sandbox", "local"]) == 1
    out, err = capsys.readouterr()
    assert "  broken: the episode of z failed: " in out
    assert err == "agentenv.py check: the toolsets broken did not play; see above\n"

    assert agentenv.main(["check", str(good.parent / "missing"), "--sandbox", "local"]) == 1
    assert "there is no bundle folder here" in capsys.readouterr().err


def test_cli_reward_option(make_bundle, capsys):
    root = make_bundle({"a": [deploy(), agent("main"), prompt(), outcome(), contains()]})
    assert agentenv.main(["check", str(root), "--sandbox", "local"]) == 1
    assert "records a score at each of check, answer" in capsys.readouterr().err
    assert agentenv.main(["check", str(root), "--sandbox", "local", "--reward", "answer"]) == 0
    assert "  a  toolset main  turns 1  reward answer" in capsys.readouterr().out


def test_cli_refuses_an_unknown_sandbox(make_bundle, capsys):
    with pytest.raises(SystemExit) as caught:
        agentenv.main(["check", str(make_bundle({"a": simple()})), "--sandbox", "cloud"])
    assert caught.value.code == 2
    assert "invalid choice: 'cloud'" in capsys.readouterr().err


# ================================================================ the example bundle notes-v1

def test_notes_v1_loads():
    bundle = Bundle.load(NOTES)
    assert bundle.description == ("A tiny notebook env whose three tasks show every feature of the "
                                  "AgentEnv bundle format.")
    assert list(bundle.splits) == ["all", "smoke"]
    assert [t.name for t in bundle.splits["all"]] == ["recall-recipe", "save-groceries", "two-step"]
    assert [t.name for t in bundle.splits["smoke"]] == ["save-groceries"]
    assert {ts.name: len(tasks) for ts, tasks in bundle.toolsets.items()} == {"notebook": 3}
    assert {t.name: t.reward_step for t in bundle.tasks.values()} == {
        "recall-recipe": "answer", "save-groceries": "check", "two-step": "check"}
    assert {t.name: len(t.turns) for t in bundle.tasks.values()} == {
        "recall-recipe": 1, "save-groceries": 1, "two-step": 2}
    assert all(t.agent == "writer" for t in bundle.tasks.values())


async def _save_groceries(turns, right):
    turn = await turns()
    await turn.call("write_note", {"title": "groceries",
                                   "text": "eggs and milk" if right else "bread"})
    turn.end("Saved.")


async def _recall_recipe(turns, right):
    turn = await turns()
    assert (await turn.call("read_note", {"title": "pancakes"})).text == \
        "2 eggs, 1 cup milk, 1 cup flour"
    turn.end("2" if right else "3")


async def _two_step(turns, right):
    turn = await turns()
    assert (await turn.call("list_notes", {})).text == "pancakes"
    turn.end("You have one note: pancakes.")
    turn = await turns()
    assert turn.prompt.startswith("Now save a note titled 'groceries'")
    recipe = (await turn.call("read_note", {"title": "pancakes"})).text
    if right:
        await turn.call("write_note", {"title": "groceries", "text": recipe})
    else:
        missing = await turn.call("read_note", {"title": "groceries"})
        assert missing == ToolResult("no note titled 'groceries'; the notes are: pancakes",
                                     agentenv.TOOL_ERROR)
    turn.end("Done.")


NOTES_PLAYS = {"save-groceries": _save_groceries, "recall-recipe": _recall_recipe,
               "two-step": _two_step}


@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
@pytest.mark.parametrize("name", list(NOTES_PLAYS))
def test_notes_v1_plays_each_task(name, right):
    bundle = Bundle.load(NOTES)
    task = bundle.tasks[name]

    async def go():
        async with local(bundle) as rt:
            ep = rt.episode(task)
            first = await ep.next_turn()
            assert [t["name"] for t in first.tools] == ["write_note", "read_note", "list_notes"]
            assert first.system_prompt.startswith("You keep a notebook for the user.")
            await NOTES_PLAYS[name](ep.next_turn, right)
            result = await ep.result()
            await ep.closed.wait()
            assert_torn_down(ep)
            return result, await ep.instances[0].output()

    result, output = run(go())
    assert result.status == "scored"
    assert result.reward == (1.0 if right else 0.0)
    assert result.scores == {task.reward_step: result.reward}
    if right and name != "recall-recipe":       # the writer's role reached the env
        assert "notebook: role 'writer' wrote 'groceries'" in output
