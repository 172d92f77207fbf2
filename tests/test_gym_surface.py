"""Tests of agentenv.py's NeMo Gym side, as a user of the NeMo RL page sees it.

* ``write-gym`` (section 10, and its CLI in section 11): the resources server folder it writes into
  a Gym root from a bundle or from a running ``serve``, its config, its rows, rewrites, refusals.
* The resources server as NeMo Gym runs it (section 9): ``python app.py`` in the written folder with
  ``NEMO_GYM_CONFIG_DICT`` / ``NEMO_GYM_CONFIG_PATH`` / ``PYTHONPATH``, driven here the way Gym's
  ``simple_agent`` drives it: POST the row to /seed_session, keep the reply's Set-Cookie and send it
  with every tool call (a POST to the tool's route, its body the JSON arguments, its reply the text
  the model reads) and with /verify (the row plus the Responses object of the whole rollout).
* Masked rollouts, the deadlines (tool_timeout, reset_timeout, idle_timeout), bad requests, and the
  one pool the OpenEnv and Gym surfaces of ``serve`` share.

Every server runs as a subprocess in the local sandbox with its own AGENTENV_STATE_DIR (a temp
folder), and is shared by the tests of this module where its flags allow. Async code runs with
``asyncio.run`` (no pytest-asyncio). Nothing here reads ../shared.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import subprocess
import sys
import time
import tomllib
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml


import agentenv
from tests.harness import (COOKIE, GRIDSIM, Gym, NOTES, REPO, Reply, Server, client, copy_bundle,
                           Socket, environ, free_port, gone, gym_rows, one_turn_task, patch, read_jsonl,
                           request, resources_config, responses, run, running, serving, wait_until)

AGENTENV = REPO / "agentenv.py"
PY = sys.executable

RECALL_PROMPT = "How many eggs does my 'pancakes' note say I need? Reply with just the number."
TURN2_PROMPT = ("Now save a note titled 'groceries' that lists the ingredients my 'pancakes' note "
                "needs.")
NOTES_SYSTEM = ("You keep a notebook for the user. Use the notebook tools (write_note, read_note, "
                "list_notes) to save and look up notes, and answer briefly.")
PANCAKES = "2 eggs, 1 cup milk, 1 cup flour"
NOTES_TOOLS = ["write_note", "read_note", "list_notes", "end_turn"]
NOTES_ID = agentenv.task_id_root(NOTES)


# ================================================================ processes

def write_gym_cli(source: str, root: str | Path, state: Path, *flags: str, cwd: Path = REPO):
    started = time.monotonic()
    done = subprocess.run([PY, str(AGENTENV), "write-gym", source, str(root), *flags],
                          cwd=cwd, env=environ(state), capture_output=True, text=True, timeout=120)
    done.seconds = time.monotonic() - started
    return done


# what write-gym says of notes-v1's rows, before the line naming the folder it wrote
NOTES_ROWS = "data/all.jsonl: 3 rows; data/smoke.jsonl: 1 row\n"


# ================================================================ files written

def read_rows(folder: Path, split: str) -> list[dict]:
    return read_jsonl(folder / "data" / f"{split}.jsonl")


def row_of(folder: Path, task: str, split: str = "all") -> dict:
    found = [r for r in read_rows(folder, split) if r["task_id"].endswith("/" + task)]
    assert len(found) == 1, f"{task} in {split}: {found}"
    return found[0]


def written_files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def one_turn(env: str, prompt: str, artifact: str = "check_notes") -> list[dict]:
    return one_turn_task(env, prompt, artifact, system_prompt=NOTES_SYSTEM, timeout_seconds=600,
                         verifier_id="check")


def make_trouble_bundle(dest: Path) -> Path:
    """notes-v1 plus trouble: a tool that sleeps 3 s (slow_note), an env that waits 2 s before it
    listens (sluggish), an env that exits at start (broken), and a verifier that raises."""
    root = copy_bundle(dest / "trouble-v1")
    server = root / "envs" / "notebook" / "server.py"
    patch(server, "import threading\n", "import threading\nimport time\n")
    patch(server, "TOOLS = [\n", 'TOOLS = [\n    {"name": "slow_note", "description": "Save a note, '
                                 'slowly.", "inputSchema": _schema("title")},\n')
    patch(server, '    with LOCK:\n        if name == "write_note":',
          '    if name == "slow_note":\n        time.sleep(3)\n        return "slow done", False\n'
          '    with LOCK:\n        if name == "write_note":')
    patch(server, "    server = ThreadingHTTPServer(",
          "    time.sleep(float(os.environ.get('START_DELAY', '0')))\n"
          "    server = ThreadingHTTPServer(")
    shutil.copytree(root / "envs" / "notebook", root / "envs" / "sluggish")
    patch(root / "envs" / "sluggish" / "Dockerfile", "USER 10001\n", "USER 10001\nENV START_DELAY=2\n")
    broken = root / "envs" / "broken"
    broken.mkdir()
    (broken / "Dockerfile").write_text('FROM python:3.11-slim\nCOPY broken.py .\nCMD ["python", "broken.py"]\n')
    (broken / "broken.py").write_text("import sys\nprint('broken: no config at /etc/broken.toml', "
                                      "flush=True)\nsys.exit(3)\n")
    (root / "artifacts" / "raises").mkdir()
    (root / "artifacts" / "raises" / "verify.py").write_text(
        "async def verify(mcp_url):\n    raise RuntimeError('the checker broke')\n")
    tasks = {"slow-call": one_turn("notebook", "Save a note, slowly."),
             "slow-start": one_turn("sluggish", "Save a note titled 'groceries' that lists eggs "
                                                     "and milk."),
             "deploy-fails": one_turn("broken", "Say hello."),
             "verifier-raises": one_turn("notebook", "Save any note.", "raises")}
    for name, steps in tasks.items():
        (root / "tasks" / f"{name}.json").write_text(json.dumps(steps, indent=2))
    return root


# ================================================================ a simple_agent stand-in

AGENT_COOKIE = {"SimpleAgent___notes_v1_simple_agent": "eyJzZXNzaW9uX2lkIjoiMSJ9"}


def simple_agent(http, base: str, row: dict, prefix: str = "") -> Gym:
    """One rollout, played as Gym's simple_agent plays it: the whole row (plus Gym's own _ng_ keys)
    to /seed_session with no cookies; the seed reply's cookies with every tool call and /verify,
    which carries the model server's and the agent's cookies too; each tool's body the JSON
    arguments; /verify gets row | {"response": the rollout}."""
    return Gym(base, {**row, "_ng_task_index": 0, "_ng_rollout_index": 0}, http, prefix=prefix,
               verify_cookies=AGENT_COOKIE)


async def play(base: str, row: dict, calls=(), final: str | None = None) -> tuple[list[Reply], dict]:
    """Seed, make the calls, verify with a final message; the call replies and the verify body."""
    async with client() as http:
        agent = simple_agent(http, base, row)
        seeded = await agent.seed()
        assert seeded.status == 200, seeded.text
        replies = [await agent.call(name, **args) for name, args in calls]
        verified = await agent.verify(final)
        assert verified.status == 200, verified.text
        return replies, json.loads(verified.text)


def assert_scored(body: dict, sent: dict, reward: float) -> None:
    assert body["reward"] == reward
    assert body["mask_sample"] is False
    assert body["failure_kind"] is None and body["failure_reason"] is None
    assert body["responses_create_params"] == sent["responses_create_params"]
    assert body["response"] == sent["response"]


def assert_masked(body: dict, sent: dict, kind: str, reason_starts: str, log: str) -> str:
    """A masked verify reply, as the page says: reward 0, mask_sample (top level and in
    instance_config), failure_kind and failure_reason, the body echoed; and the log line."""
    assert body["reward"] == 0.0
    assert body["mask_sample"] is True
    assert body["instance_config"]["mask_sample"] is True
    assert body["failure_kind"] == kind, body["failure_reason"]
    assert body["failure_reason"].startswith(reason_starts), body["failure_reason"]
    for key, value in sent.items():
        assert body[key] == value, f"{key} was not echoed"
    assert f"rollout masked: {body['failure_reason']}" in log
    return body["failure_reason"]


# ================================================================ fixtures

@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gym")


@pytest.fixture(scope="module")
def written(work):
    """`python agentenv.py write-gym bundles/notes-v1 <root> --sandbox local`, run once."""
    return write_notes_server("bundles/notes-v1", work / "gym-root", work / "state-writer",
                              "--sandbox", "local")


def write_notes_server(source: str, root: Path, state: Path, *flags: str) -> types.SimpleNamespace:
    """Run write-gym for notes-v1 (from its folder or a serving URL) and read what it wrote."""
    done = write_gym_cli(source, root, state, *flags)
    assert done.returncode == 0, done.stderr
    folder = root / "resources_servers" / "notes_v1"
    config = yaml.safe_load((folder / "configs" / "notes_v1.yaml").read_text())
    return types.SimpleNamespace(root=root, folder=folder, done=done, config=config)


@pytest.fixture(scope="module")
def notes_app(written, work):
    """The written server as Gym runs it, with the written config's settings."""
    with running(Server.gym(work / "notes-app", written.config, "notes_v1",
                            app=written.folder)) as app:
        yield app


@pytest.fixture(scope="module")
def trouble(work) -> Path:
    return make_trouble_bundle(work / "bundles")


def trouble_config(**where) -> dict:
    return resources_config("trouble_v1", description="trouble", **where, tool_timeout=1,
                            reset_timeout=600, idle_timeout=600)


@pytest.fixture(scope="module")
def trouble_app(written, work, trouble):
    """A server of the trouble bundle (written by hand: write-gym refuses a bundle one of whose
    envs won't deploy), with tool_timeout: 1."""
    config = trouble_config(bundle=str(trouble), sandbox="local", max_concurrent_envs=8)
    with running(Server.gym(work / "trouble-app", config, app=written.folder)) as app:
        yield app


@pytest.fixture(scope="module")
def serve1(work):
    """`serve bundles/notes-v1 --max-concurrent-envs 1`, its OpenEnv replies due within 3 s."""
    with serving(NOTES, work / "serve1", "--max-concurrent-envs", "1", "--client-timeout", "4",
                 "--reply-margin", "1") as serve:
        yield serve


@pytest.fixture(scope="module")
def url_written(serve1, work):
    return write_notes_server(serve1.url, work / "gym-root-url", work / "state-url-writer")


@pytest.fixture(scope="module")
def url_app(url_written, work):
    with running(Server.gym(work / "url-app", url_written.config, "notes_v1",
                            app=url_written.folder)) as app:
        yield app


# ================================================================ 1. write-gym from a bundle

def test_write_gym_cli_writes_the_server_folder_the_page_lists(written):
    folder, done = written.folder, written.done
    assert done.stdout == NOTES_ROWS + f"wrote {written.root.resolve()}/resources_servers/notes_v1\n"
    # how far the deploys have got goes to stderr: one toolset, one line
    assert re.fullmatch(r"write-gym: listing each toolset's tools: 1/1 \(notebook: deployed "
                        r"recall-recipe in \d+\.\d\ds\)\n", done.stderr), done.stderr
    assert written_files(folder) == {"app.py", "agentenv.py", "pyproject.toml",
                                     "configs/notes_v1.yaml", "data/all.jsonl", "data/smoke.jsonl"}
    # Gym takes a folder with pyproject.toml or requirements.txt, and refuses one with both
    assert not (folder / "requirements.txt").exists()
    app = (folder / "app.py").read_text()
    assert "import agentenv" in app
    assert 'if __name__ == "__main__":\n    agentenv.run_gym_server()' in app
    assert (folder / "agentenv.py").read_bytes() == AGENTENV.read_bytes()
    project = tomllib.loads((folder / "pyproject.toml").read_text())
    deps = {d.split(">")[0].split("=")[0].strip().lower() for d in project["project"]["dependencies"]}
    assert deps == {"aiohttp", "pyyaml", "docker", "prometheus-client"}
    assert project["project"]["name"] and project["project"]["version"] == agentenv.__version__
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"
    assert set(project["tool"]["setuptools"]["py-modules"]) == {"agentenv", "app"}
    assert done.seconds < 30


def test_the_config_has_the_pages_shape_with_the_bundle_and_the_default_settings(written):
    config, name = written.config, "notes_v1"
    assert list(config) == ["notes_v1", "notes_v1_simple_agent", "notes_v1_environment_server"]
    server = config[name]["resources_servers"][name]
    assert list(server)[:3] == ["entrypoint", "domain", "description"]
    assert server["description"].startswith("notes-v1's tasks, served by ")
    assert {k: v for k, v in server.items() if k != "description"} == {
        "entrypoint": "app.py", "domain": "agent", "bundle": str(NOTES), "max_concurrent_envs": 8,
        "sandbox": "local", "tool_timeout": 60, "reset_timeout": 600, "idle_timeout": 600,
        "deploy_timeout": 180, "bash_timeout": 300, "max_env_reply": 2097152, "status_interval": 60}
    assert Path(server["bundle"]).is_absolute()
    assert config["notes_v1_simple_agent"] == {"responses_api_agents": {"simple_agent": {
        "entrypoint": "app.py", "resources_server": {"type": "resources_servers", "name": name},
        "model_server": {"type": "responses_api_models", "name": "policy_model"}}}}
    assert config["notes_v1_environment_server"] == {"environment_servers": {"legacy_agent": {
        "entrypoint": "app.py",
        "agent_server": {"type": "responses_api_agents", "name": "notes_v1_simple_agent"}}}}
    defaults = agentenv.Settings()
    assert (defaults.tool_timeout, defaults.reset_timeout, defaults.idle_timeout) == (60, 600, 600)


def test_the_rows_name_the_task_and_offer_its_tools_as_responses_function_tools(written):
    rows, smoke = read_rows(written.folder, "all"), read_rows(written.folder, "smoke")
    assert [r["task_id"].rsplit("/", 1)[1] for r in rows] == ["recall-recipe", "save-groceries",
                                                              "two-step"]
    assert [(r["split"], r["index"]) for r in rows] == [("all", 0), ("all", 1), ("all", 2)]
    assert len(smoke) == 1 and (smoke[0]["split"], smoke[0]["index"]) == ("smoke", 0)
    assert smoke[0]["task_id"] == rows[1]["task_id"] == f"{NOTES_ID}/save-groceries"
    for row in rows + smoke:
        assert set(row) == {"responses_create_params", "agent_ref", "split", "index", "task_id"}
        assert row["agent_ref"] == {"type": "responses_api_agents", "name": "notes_v1_simple_agent"}
        params = row["responses_create_params"]
        assert set(params) == {"input", "tools"}          # Gym's model forbids other keys
        assert params["input"][0] == {"role": "system", "content": NOTES_SYSTEM}
        assert params["input"][1]["role"] == "user" and len(params["input"]) == 2
        tools = params["tools"]
        assert [t["name"] for t in tools] == NOTES_TOOLS     # end_turn last, dump_notes hidden
        for tool in tools:
            assert set(tool) == {"type", "name", "description", "parameters", "strict"}
            assert tool["type"] == "function" and tool["strict"] is False
            assert tool["description"] and tool["parameters"]["type"] == "object"
        assert tools[0]["parameters"]["required"] == ["title", "text"]
        assert tools[-1]["parameters"]["properties"]["response"]["type"] == "string"
    assert rows[0]["responses_create_params"]["input"][1]["content"] == RECALL_PROMPT


def test_write_gym_in_process_writes_the_same_rows(written, tmp_path):
    lines: list[str] = []
    target = run(agentenv.write_gym(str(NOTES), str(tmp_path / "root"), agentenv.Settings.of(
                                    max_concurrent_envs=16, sandbox="local"), out=lines.append))
    assert target == (tmp_path / "root").resolve() / "resources_servers" / "notes_v1"
    assert lines == [NOTES_ROWS.strip(), f"wrote {target}"]
    for rel in ("data/all.jsonl", "data/smoke.jsonl", "app.py", "agentenv.py", "pyproject.toml"):
        assert (target / rel).read_text() == (written.folder / rel).read_text(), rel
    server = yaml.safe_load((target / "configs/notes_v1.yaml").read_text())["notes_v1"]
    assert server["resources_servers"]["notes_v1"]["max_concurrent_envs"] == 16


def test_write_gym_prints_the_root_as_the_user_gave_it(tmp_path):
    done = write_gym_cli(str(NOTES), "gym-root", tmp_path / "state", "--sandbox", "local", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == NOTES_ROWS + "wrote gym-root/resources_servers/notes_v1\n"


def test_gridsim_writes_2200_2000_200_rows_with_one_deploy(tmp_path, monkeypatch):
    launched: list[str] = []
    launch = agentenv.LocalSandbox.launch

    async def counting(self, env, episode, limits):
        launched.append(env.name)
        return await launch(self, env, episode, limits)

    monkeypatch.setattr(agentenv.LocalSandbox, "launch", counting)
    started = time.monotonic()
    target = run(agentenv.write_gym(str(GRIDSIM), str(tmp_path), agentenv.Settings.of(sandbox="local"),
                                    out=lambda _: None))
    seconds = time.monotonic() - started
    assert launched == ["gridsim"], "one toolset, so one deploy"
    assert seconds < 30, f"write-gym of gridsim-v1 took {seconds:.1f}s"
    assert target.name == "gridsim_v1"
    counts = {split: len(read_rows(target, split)) for split in ("all", "train", "eval")}
    assert counts == {"all": 2200, "train": 2000, "eval": 200}
    assert sorted(p.name for p in (target / "data").iterdir()) == ["all.jsonl", "eval.jsonl",
                                                                   "train.jsonl"]
    first = read_rows(target, "train")[0]
    assert (first["split"], first["index"]) == ("train", 0)
    assert first["agent_ref"] == {"type": "responses_api_agents", "name": "gridsim_v1_simple_agent"}
    assert first["task_id"].startswith("@local/") and "/gridsim-v1/dam-v1-" in first["task_id"]
    assert [m["role"] for m in first["responses_create_params"]["input"]] == ["system", "user"]
    assert [t["name"] for t in first["responses_create_params"]["tools"]] == ["submit_schedule",
                                                                               "end_turn"]
    config = yaml.safe_load((target / "configs" / "gridsim_v1.yaml").read_text())
    assert list(config) == ["gridsim_v1", "gridsim_v1_simple_agent", "gridsim_v1_environment_server"]


def test_writing_again_overwrites_every_file(written, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(written.root, root)
    folder = root / "resources_servers" / "notes_v1"
    rows = read_rows(folder, "all")
    rows[0]["responses_create_params"]["input"][1]["content"] = "EDITED"
    (folder / "data" / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "configs" / "notes_v1.yaml").write_text("stale: true\n")
    (folder / "agentenv.py").write_text("# an old copy\n")
    done = write_gym_cli(str(NOTES), root, tmp_path / "state", "--sandbox", "local")
    assert done.returncode == 0, done.stderr
    for rel in ("data/all.jsonl", "data/smoke.jsonl", "configs/notes_v1.yaml", "agentenv.py", "app.py"):
        assert (folder / rel).read_text() == (written.folder / rel).read_text(), rel
    assert not list(folder.rglob("*.partial"))


def _edit_prompt(folder: Path, split: str, text: str) -> None:
    rows = read_rows(folder, split)
    rows[0]["responses_create_params"]["input"][1]["content"] = text
    (folder / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_keep_prompts_keeps_an_edited_prompt(written, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(written.root, root)
    folder = root / "resources_servers" / "notes_v1"
    _edit_prompt(folder, "all", "How many eggs? Just the number, please.")
    done = write_gym_cli(str(NOTES), root, tmp_path / "state", "--sandbox", "local", "--keep-prompts")
    assert done.returncode == 0, done.stderr
    rows = read_rows(folder, "all")
    assert rows[0]["responses_create_params"]["input"][1]["content"] == \
        "How many eggs? Just the number, please."
    assert rows[0]["responses_create_params"]["tools"] == \
        read_rows(written.folder, "all")[0]["responses_create_params"]["tools"]
    assert rows[1:] == read_rows(written.folder, "all")[1:]


def test_keep_prompts_keeps_an_edit_made_in_an_eval_split(written, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(written.root, root)
    folder = root / "resources_servers" / "notes_v1"
    _edit_prompt(folder, "smoke", "Save 'groceries': eggs and milk.")
    done = write_gym_cli(str(NOTES), root, tmp_path / "state", "--sandbox", "local", "--keep-prompts")
    assert done.returncode == 0, done.stderr
    assert read_rows(folder, "smoke")[0]["responses_create_params"]["input"][1]["content"] == \
        "Save 'groceries': eggs and milk."


def test_a_folder_holding_a_server_write_gym_did_not_write_is_refused(tmp_path):
    folder = tmp_path / "root" / "resources_servers" / "notes_v1"
    folder.mkdir(parents=True)
    (folder / "app.py").write_text("# my own resources server\n")
    done = write_gym_cli(str(NOTES), tmp_path / "root", tmp_path / "state", "--sandbox", "local")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(f"agentenv.py write-gym: {folder} holds a resources server that "
                                  "write-gym did not write; move it away or write into another Gym root")
    assert written_files(folder) == {"app.py"}
    assert (folder / "app.py").read_text() == "# my own resources server\n"


@pytest.mark.parametrize("name, fix", [
    ("verify", "has the name of one of the resources server's own routes, which Gym would call "
               "instead; rename it in the env"),
    ("a/b", "is not one path segment, and Gym calls a tool at the route of its name; rename it in "
            "the env (letters, digits, _ . ~ -)"),
])
def test_a_tool_gym_cant_route_to_is_refused_with_the_fix(tmp_path, name, fix):
    bundle = copy_bundle(tmp_path / "badtools-v1")
    patch(bundle / "envs" / "notebook" / "server.py", '{"name": "list_notes"', f'{{"name": "{name}"')
    with pytest.raises(agentenv.AgentEnvError) as caught:
        run(agentenv.write_gym(str(bundle), str(tmp_path / "root"), agentenv.Settings.of(sandbox="local"),
                               out=print))
    assert str(caught.value) == (f"the rows can't be written:\n  - toolset notebook: the tool "
                                 f"{name!r} {fix}")
    assert not (tmp_path / "root").exists()
    if name == "verify":            # and from the CLI: exit 1, the message on stderr
        done = write_gym_cli(str(bundle), tmp_path / "root", tmp_path / "state", "--sandbox", "local")
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.endswith(f"\nagentenv.py write-gym: {caught.value}\n")


# ================================================================ 2. write-gym from a URL

def test_write_gym_from_a_url_names_the_url_and_writes_the_same_rows(url_written, written, serve1):
    assert url_written.done.stdout == NOTES_ROWS + f"wrote {url_written.folder}\n"
    server = url_written.config["notes_v1"]["resources_servers"]["notes_v1"]
    assert server["url"] == serve1.url
    assert "bundle" not in server and "max_concurrent_envs" not in server
    assert {k: server[k] for k in ("entrypoint", "domain", "tool_timeout", "reset_timeout",
                                   "idle_timeout")} == {
        "entrypoint": "app.py", "domain": "agent", "tool_timeout": 60, "reset_timeout": 600,
        "idle_timeout": 600}
    assert {k: v for k, v in url_written.config.items() if k != "notes_v1"} == \
        {k: v for k, v in written.config.items() if k != "notes_v1"}
    assert written_files(url_written.folder) == written_files(written.folder)
    for split in ("all", "smoke"):
        assert read_rows(url_written.folder, split) == read_rows(written.folder, split)


# ================================================================ 3. the resources server as Gym runs it

def test_seed_answers_at_once_with_a_cookie_and_a_tool_answers_its_text(notes_app, written):
    row = row_of(written.folder, "save-groceries")

    async def go():
        async with client() as http:
            agent = simple_agent(http, notes_app.url, row)
            before = set(notes_app.records())
            seeded = await agent.seed()
            assert seeded.status == 200 and json.loads(seeded.text) == {}
            assert seeded.elapsed < 0.5
            assert any(c.startswith(f"{COOKIE}=") for c in seeded.set_cookie), seeded.set_cookie
            assert list(agent.cookies) == [COOKIE]
            listed = await agent.call("list_notes")
            assert (listed.status, listed.text, listed.content_type) == (200, "(no notes)", "text/plain")
            env_pids = set(notes_app.records()) - before
            assert len(env_pids) == 1
            saved = await agent.call("write_note", title="groceries", text="eggs and milk")
            assert (saved.status, saved.text) == (200, "saved note 'groceries'")
            read = await agent.call("read_note", title="groceries")
            assert read.text == "eggs and milk"
            verified = await agent.verify("Saved.")
            sent = verified.sent
            assert verified.status == 200
            body = json.loads(verified.text)
            assert_scored(body, sent, 1.0)
            assert body["split"] == "all" and body["task_id"] == row["task_id"]
            assert body["_ng_rollout_index"] == 0          # the row's other keys come back too
            assert body["scores"] == {"check": 1.0}
            # the episode is torn down once verify has answered
            assert gone(env_pids.pop(), 3)
    run(go())


def test_a_model_that_writes_nothing_scores_0_unmasked(notes_app, written):
    row = row_of(written.folder, "save-groceries")
    _, body = run(play(notes_app.url, row, [("list_notes", {})], "I did nothing."))
    assert body["reward"] == 0.0 and body["mask_sample"] is False and body["failure_kind"] is None


def test_verify_ends_the_turn_with_the_models_last_message(notes_app, written):
    row = row_of(written.folder, "recall-recipe")
    replies, body = run(play(notes_app.url, row, [("read_note", {"title": "pancakes"})], "2"))
    assert replies[0].text == PANCAKES
    assert body["reward"] == 1.0 and body["mask_sample"] is False
    _, body = run(play(notes_app.url, row, [], "3"))
    assert body["reward"] == 0.0 and body["mask_sample"] is False


def test_end_turn_answers_the_next_prompt_and_verify_ends_the_last_turn(notes_app, written):
    row = row_of(written.folder, "two-step")

    async def go():
        async with client() as http:
            agent = simple_agent(http, notes_app.url, row)
            await agent.seed()
            assert (await agent.call("list_notes")).text == "pancakes"
            nxt = await agent.call("end_turn", response="You have one note: pancakes.")
            assert (nxt.status, nxt.text) == (200, TURN2_PROMPT)
            await agent.call("write_note", title="groceries", text=PANCAKES)
            verified = await agent.verify("Saved your groceries.")
            sent = verified.sent
            assert_scored(json.loads(verified.text), sent, 1.0)
    run(go())


def test_verify_ends_every_turn_left_open(notes_app, written):
    """The model never calls end_turn: its last message ends turn 1, and verify ends turn 2."""
    row = row_of(written.folder, "two-step")
    _, body = run(play(notes_app.url, row, [("write_note", {"title": "groceries", "text": PANCAKES})],
                       "pancakes"))
    assert body["reward"] == 1.0 and body["mask_sample"] is False


def test_end_turn_on_the_last_turn_ends_the_episode(notes_app, written):
    row = row_of(written.folder, "recall-recipe")

    async def go():
        async with client() as http:
            agent = simple_agent(http, notes_app.url, row)
            await agent.seed()
            ended = await agent.call("end_turn", response="2")
            assert ended.text == "Your turn is over, and so is the episode: it is being scored."
            after = await agent.call("list_notes")
            assert after.status == 200 and after.text.startswith("error: the episode has ended")
            verified = await agent.verify("2")
            sent = verified.sent
            assert_scored(json.loads(verified.text), sent, 1.0)
    run(go())


def test_a_models_bad_calls_are_text_it_reads_and_not_masked(notes_app, written):
    row = row_of(written.folder, "recall-recipe")
    calls = [("delete_note", {"title": "pancakes"}), ("read_note", {}),
             ("read_note", {"title": "pancakes", "page": 2}), ("read_note", {"title": "waffles"}),
             ("read_note", {"title": "pancakes"})]
    replies, body = run(play(notes_app.url, row, calls, "2"))
    assert [r.status for r in replies] == [200] * 5
    assert replies[0].text == ("error: there is no tool 'delete_note'; the tools are: write_note, "
                               "read_note, list_notes")
    assert replies[1].text == "error: read_note: argument 'title' is required and must be a string"
    assert replies[2].text == "error: read_note: unexpected argument 'page'"
    assert replies[3].text == "error: no note titled 'waffles'; the notes are: pancakes"
    assert replies[4].text == PANCAKES
    assert body["reward"] == 1.0 and body["mask_sample"] is False and body["failure_kind"] is None


def test_a_hidden_tool_is_not_callable_by_the_model(notes_app, written):
    row = row_of(written.folder, "recall-recipe")
    replies, body = run(play(notes_app.url, row, [("dump_notes", {})], "2"))
    assert replies[0].status == 200 and replies[0].text.startswith("error: there is no tool 'dump_notes'")
    assert body["mask_sample"] is False


def test_rollouts_run_at_once_each_in_its_own_episode(notes_app, written):
    rows = [row_of(written.folder, "save-groceries")] * 3

    async def go():
        plays = [play(notes_app.url, row, [("write_note", {"title": "groceries", "text": text})], "ok")
                 for row, text in zip(rows, ["eggs and milk", "just bread", "milk, eggs"])]
        return await asyncio.gather(*plays)

    results = run(go())
    assert [body["reward"] for _, body in results] == [1.0, 0.0, 1.0]


def test_close_session_answers_closed_then_already_closed(notes_app, written):
    row = row_of(written.folder, "save-groceries")

    async def go():
        async with client() as http:
            agent = simple_agent(http, notes_app.url, row)
            before = set(notes_app.records())
            await agent.seed()
            await agent.call("list_notes")
            env_pids = set(notes_app.records()) - before
            assert len(env_pids) == 1
            first, second = await agent.close(), await agent.close()
            assert gone(env_pids.pop(), 3), "close_session left the episode's env running"
            assert (first.status, json.loads(first.text)) == (200, {"status": "closed"})
            assert (second.status, json.loads(second.text)) == (200, {"status": "already_closed"})
            late = await agent.call("list_notes")
            assert late.status == 400 and late.text.startswith("error: no session")
    run(go())


def test_environment_servers_session_protocol(notes_app, written):
    """Gym's environment servers name the session (resources_session_id) and retry a seed whose
    reply was lost: the same seed is the same session (one env), another payload under the id is a
    409, close is idempotent with Gym's typed reply, and a closed id (or one closed before it was
    ever seeded, or verified) stays closed."""
    row = row_of(written.folder, "save-groceries")

    def seed_body(rid: str, attempt: int = 0) -> dict:
        return {"resources_session_id": rid, "episode_id": {"rollout_id": "r", "attempt": attempt},
                "task_id": {"taskset": "notes", "task_id": row["task_id"]}, "task_data": row}

    async def go():
        async with client() as http:
            agent = simple_agent(http, notes_app.url, row)
            before = set(notes_app.records())
            first = await agent.post("/seed_session", seed_body("s1"), cookie=None)
            again = await agent.post("/seed_session", seed_body("s1"), cookie=None)  # reply lost
            assert (first.status, json.loads(first.text)) == (200, {"resources_session_id": "s1"})
            assert (again.status, json.loads(again.text)) == (200, {"resources_session_id": "s1"})
            assert first.set_cookie == again.set_cookie and first.set_cookie
            written_ = await agent.call("write_note", title="groceries", text="eggs and milk")
            assert written_.status == 200
            envs = set(notes_app.records()) - before
            assert len(envs) == 1                                           # one session, one env
            other = await agent.post("/seed_session", seed_body("s1", attempt=1), cookie=None)
            assert other.status == 409 and "seeded already" in json.loads(other.text)["detail"]
            closes = [await agent.post("/close_session", {"resources_session_id": "s1",
                                                          "episode_id": {"rollout_id": "r"}},
                                  cookie=None)
                      for _ in range(2)]
            assert [(c.status, json.loads(c.text)) for c in closes] == \
                [(200, {"resources_session_id": "s1"})] * 2
            assert gone(envs.pop(), 5), "close_session left the session's env running"
            late = await agent.post("/seed_session", seed_body("s1"), cookie=None)
            assert late.status == 409 and "was closed" in json.loads(late.text)["detail"]
            # a close that overtook its seed: the seed must not create the session afterwards
            early = await agent.post("/close_session", {"resources_session_id": "s2"}, cookie=None)
            assert (early.status, json.loads(early.text)) == (200, {"resources_session_id": "s2"})
            assert (await agent.post("/seed_session", seed_body("s2"), cookie=None)).status == 409
            # verified, then seeded again: the id is spent too
            fresh = simple_agent(http, notes_app.url, row)
            fresh.row = seed_body("s3")
            assert (await fresh.seed()).status == 200
            await fresh.call("write_note", title="groceries", text="eggs and milk")
            fresh.row = {**row, "_ng_task_index": 0}
            reply = await fresh.verify("Saved.")
            assert json.loads(reply.text)["reward"] == 1.0
            assert (await agent.post("/seed_session", seed_body("s3"), cookie=None)).status == 409
            bad = await agent.post("/seed_session", {**seed_body("x"), "resources_session_id": ""},
                                   cookie=None)
            assert bad.status == 400 and "non-empty text" in json.loads(bad.text)["detail"]
    run(go())


def test_aggregate_metrics_answers_gyms_shape(notes_app):
    results = [{"_ng_task_index": 0, "_ng_rollout_index": i, **result} for i, result in enumerate(
        [{"reward": 1.0, "mask_sample": False, "response": {"usage": {}}},
         {"reward": 0.0, "mask_sample": False}, {"reward": 0.0, "mask_sample": True}])]
    with urllib.request.urlopen(urllib.request.Request(
            notes_app.url + "/aggregate_metrics", json.dumps({"verify_responses": results}).encode(),
            {"Content-Type": "application/json"})) as resp:
        body = json.loads(resp.read())
    assert set(body) == {"group_level_metrics", "agent_metrics", "key_metrics", "perf_summary",
                         "repeat_level_metrics"}
    assert isinstance(body["group_level_metrics"], list) and isinstance(body["repeat_level_metrics"], list)
    assert body["perf_summary"] is None or isinstance(body["perf_summary"], dict)
    coverage = {"coverage/measured_rollouts": 2, "coverage/masked_rollouts": 1,
                "coverage/measured_tasks": 1, "coverage/fully_masked_tasks": 0}
    assert body["key_metrics"] == {"mean/reward": 0.5, **coverage}
    assert {k: body["agent_metrics"][k] for k in ("mean/reward", "min/reward", "max/reward",
                                                  "median/reward", "num_repeats")} == \
        {"mean/reward": 0.5, "min/reward": 0.0, "max/reward": 1.0, "median/reward": 0.5,
         "num_repeats": 3}
    assert body["agent_metrics"]["std/reward"] == pytest.approx(0.5 ** 0.5)


def test_the_written_server_serves_its_metrics_in_prometheus_format(notes_app, url_app):
    """The resources server write-gym wrote answers GET /metrics (tests/test_metrics.py checks
    what it counts): in bundle mode with the pool's gauges, in url: mode with its own counters."""
    from prometheus_client.parser import text_string_to_metric_families

    for app, pooled in ((notes_app, True), (url_app, False)):
        with urllib.request.urlopen(app.url + "/metrics") as resp:
            assert resp.headers.get_content_type() == "text/plain"
            names = {f.name for f in text_string_to_metric_families(resp.read().decode())}
        assert {"agentenv_sessions", "agentenv_masked_rollouts", "process_resident_memory_bytes",
                "agentenv_info"} <= names
        assert ("agentenv_episodes_live" in names) is pooled
        assert ("agentenv_deploys" in names) is True        # declared, at 0 until a deploy


def test_ng_rollout_prefixed_routes_play_a_rollout(notes_app, written):
    row = row_of(written.folder, "save-groceries")

    async def go():
        async with client() as http:
            agent = simple_agent(http, notes_app.url, row, prefix="/ng-rollout/rollout-7")
            assert (await agent.seed()).status == 200
            saved = await agent.call("write_note", title="groceries", text="eggs, milk")
            assert saved.text == "saved note 'groceries'"
            verified = await agent.verify("Done.")
            sent = verified.sent
            assert_scored(json.loads(verified.text), sent, 1.0)
            async with http.get(notes_app.url + "/") as resp:
                assert resp.status == 200
    run(go())


def test_num_workers_above_1_is_refused_with_the_reason(written, tmp_path):
    config = copy.deepcopy(written.config)
    config["notes_v1"]["resources_servers"]["notes_v1"].update(num_workers=2, host="127.0.0.1",
                                                               port=free_port())
    done = subprocess.run([PY, "app.py"], cwd=written.folder, capture_output=True, text=True, timeout=30,
                          env=environ(tmp_path, NEMO_GYM_CONFIG_DICT=yaml.safe_dump(config),
                                      NEMO_GYM_CONFIG_PATH="notes_v1", PYTHONPATH=str(written.folder)))
    assert done.returncode != 0
    assert "num_workers is 2" in done.stderr
    assert "runs with one worker; remove num_workers from its config" in done.stderr


def test_an_app_started_without_gyms_config_says_how_to_start_it(written, tmp_path):
    done = subprocess.run([PY, "app.py"], cwd=written.folder, capture_output=True, text=True, timeout=30,
                          env=environ(tmp_path, PYTHONPATH=str(written.folder)))
    assert done.returncode == 1
    assert "NEMO_GYM_CONFIG_DICT and NEMO_GYM_CONFIG_PATH" in done.stderr
    assert "gym env start --config configs/<name>.yaml" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_app_whose_config_names_no_source_says_so(written, tmp_path):
    config = {"x": {"resources_servers": {"x": {"entrypoint": "app.py", "domain": "agent"}}}}
    done = subprocess.run([PY, "app.py"], cwd=written.folder, capture_output=True, text=True, timeout=30,
                          env=environ(tmp_path, NEMO_GYM_CONFIG_DICT=yaml.safe_dump(config),
                                      NEMO_GYM_CONFIG_PATH="x", PYTHONPATH=str(written.folder)))
    assert done.returncode == 1
    assert "names neither url:" in done.stderr and "nor bundle:" in done.stderr


def test_the_url_mode_server_plays_through_the_running_serve(url_app, url_written):
    row = row_of(url_written.folder, "recall-recipe")
    replies, body = run(play(url_app.url, row, [("read_note", {"title": "pancakes"}),
                                                ("read_note", {})], "2"))
    assert replies[0].text == PANCAKES
    assert replies[1].status == 200
    assert replies[1].text == "error: read_note: argument 'title' is required and must be a string"
    assert body["reward"] == 1.0 and body["mask_sample"] is False
    row = row_of(url_written.folder, "two-step")
    replies, body = run(play(url_app.url, row, [("end_turn", {"response": "pancakes"}),
                                                ("write_note", {"title": "groceries",
                                                                "text": PANCAKES})], "Saved."))
    assert replies[0].text == TURN2_PROMPT and replies[1].text == "saved note 'groceries'"
    assert body["reward"] == 1.0 and body["mask_sample"] is False


def test_url_mode_rollouts_past_the_serves_limit_wait_and_it_says_so_once(url_app, url_written,
                                                                        serve1):
    row = row_of(url_written.folder, "save-groceries")

    async def go():
        return await asyncio.gather(*(
            play(url_app.url, row, [("write_note", {"title": "groceries", "text": "eggs, milk"})], "ok")
            for _ in range(3)))

    results = run(go())
    assert [(body["reward"], body["mask_sample"]) for _, body in results] == [(1.0, False)] * 3
    warning = (f"WARNING agentenv.gym: the server at {serve1.url} is at its limit of 1 sessions at "
               "once, so rollouts wait their turn: serve the bundle with a higher MAX_CONCURRENT_ENVS "
               "(or --max-concurrent-envs) to run more at once\n")
    assert url_app.log().count(warning) == 1


def test_the_url_mode_server_answers_an_unknown_tool_as_bundle_mode_does(url_app, url_written):
    row = row_of(url_written.folder, "recall-recipe")
    replies, body = run(play(url_app.url, row, [("nope", {})], "2"))
    assert body["mask_sample"] is False
    assert replies[0].status == 200
    assert replies[0].text == "error: there is no tool 'nope'; the tools are: write_note, read_note, " \
                              "list_notes"


# ================================================================ 4. masked rollouts

def test_a_deploy_that_fails_is_masked(trouble_app, trouble):
    row = gym_rows(trouble)["deploy-fails"]

    async def go():
        async with client() as http:
            agent = simple_agent(http, trouble_app.url, row)
            assert (await agent.seed()).status == 200
            call = await agent.call("write_note", title="a", text="b")
            assert call.status == 200
            assert call.text.startswith("error: the environment of this rollout failed, so write_note "
                                        "did not run (the environment failed: ")
            assert call.text.endswith("; the rollout will be masked")
            verified = await agent.verify("hello")
            sent = verified.sent
            return json.loads(verified.text), sent

    body, sent = run(go())
    reason = assert_masked(body, sent, "provider_unavailable",
                           "the environment failed: step 'env' (deploy_env) failed: env 'broken' did "
                           "not come up: its process exited with code 3", trouble_app.log())
    assert "broken: no config at /etc/broken.toml" in reason


def test_a_tool_that_misses_tool_timeout_is_masked_with_the_pages_message(trouble_app, trouble):
    row = gym_rows(trouble)["slow-call"]

    async def go():
        async with client() as http:
            agent = simple_agent(http, trouble_app.url, row)
            await agent.seed()
            assert (await agent.call("list_notes")).text == "(no notes)"
            slow = await agent.call("slow_note", title="x")
            assert slow.status == 200
            assert 0.9 < slow.elapsed < 2.5
            message_ = ("slow_note didn't answer within 1s, and the episode ended, since what the call "
                        "does may still be under way")
            assert slow.text == f"error: {message_}"
            after = await agent.call("list_notes")
            assert after.text.startswith("error: the environment of this rollout failed")
            verified = await agent.verify("done")
            sent = verified.sent
            return json.loads(verified.text), sent, message_

    body, sent, message_ = run(go())
    assert_masked(body, sent, "transport_timeout", message_, trouble_app.log())
    assert body["failure_reason"] == message_
    assert f"WARNING agentenv.gym: rollout masked: {message_}\n" in trouble_app.log()


def test_a_verifier_that_raises_is_masked_verifier_error(trouble_app, trouble):
    row = gym_rows(trouble)["verifier-raises"]

    async def go():
        async with client() as http:
            agent = simple_agent(http, trouble_app.url, row)
            await agent.seed()
            await agent.call("write_note", title="groceries", text="eggs and milk")
            verified = await agent.verify("Saved.")
            sent = verified.sent
            return json.loads(verified.text), sent

    body, sent = run(go())
    reason = assert_masked(body, sent, "verifier_error", "the environment failed: ", trouble_app.log())
    assert "RuntimeError: the checker broke" in reason


def test_seed_answers_before_the_deploy_and_the_first_call_waits_for_it(trouble_app, trouble):
    row = gym_rows(trouble)["slow-start"]             # its env listens 2 s after it starts

    async def go():
        async with client() as http:
            agent = simple_agent(http, trouble_app.url, row)
            seeded = await agent.seed()
            assert seeded.status == 200 and seeded.elapsed < 0.5
            first = await agent.call("write_note", title="groceries", text="eggs and milk")
            assert first.text == "saved note 'groceries'"
            assert first.elapsed > 1.5
            verified = await agent.verify("Saved.")
            sent = verified.sent
            assert_scored(json.loads(verified.text), sent, 1.0)
    run(go())


def test_a_row_whose_tools_differ_from_its_tasks_is_masked(notes_app, written):
    row = copy.deepcopy(row_of(written.folder, "save-groceries"))
    tools = row["responses_create_params"]["tools"]
    row["responses_create_params"]["tools"] = [t for t in tools if t["name"] != "read_note"]

    async def go():
        async with client() as http:
            agent = simple_agent(http, notes_app.url, row)
            assert (await agent.seed()).status == 200
            call = await agent.call("write_note", title="groceries", text="eggs and milk")
            assert call.text.startswith("error: the environment of this rollout failed")
            verified = await agent.verify("Saved.")
            sent = verified.sent
            return json.loads(verified.text), sent

    body, sent = run(go())
    assert_masked(body, sent, "agentenv:tools_mismatch",
                  "the row offers the tools ['end_turn', 'list_notes', 'write_note'], but its task "
                  "offers ['end_turn', 'list_notes', 'read_note', 'write_note']; write the rows again "
                  "with write-gym", notes_app.log())


def test_a_server_that_went_away_is_masked_session_lost(written, work, tmp_path):
    serve = Server.serve(NOTES, tmp_path / "serve-gone")
    config = resources_config("notes_v1", url=serve.url)
    app = Server.gym(tmp_path / "url-gone", config, app=written.folder)
    row = row_of(written.folder, "save-groceries")
    try:
        async def go():
            async with client() as http:
                agent = simple_agent(http, app.url, row)
                await agent.seed()
                saved = await agent.call("write_note", title="groceries", text="eggs and milk")
                assert saved.text == "saved note 'groceries'"
                serve.kill()                                      # mid-rollout
                lost = await agent.call("list_notes")
                assert lost.status == 200
                assert lost.text.startswith(f"error: the environment failed: the server at {serve.url}")
                assert lost.text.endswith("; the rollout will be masked")
                verified = await agent.verify("Saved.")
                sent = verified.sent
                return json.loads(verified.text), sent

        body, sent = run(go())
        assert_masked(body, sent, "session_lost", f"the environment failed: the server at {serve.url} ",
                      app.log())
    finally:
        app.stop()
        serve.kill()


# ================================================================ url mode: the resources server's settings

@pytest.fixture(scope="module")
def trouble_remote(written, work, trouble):
    """`serve` of the trouble bundle, and a url: resources server on it with tool_timeout: 1."""
    with serving(trouble, work / "serve-trouble") as serve, \
            running(Server.gym(work / "url-trouble", trouble_config(url=serve.url),
                               app=written.folder)) as app:
        yield types.SimpleNamespace(serve=serve, app=app)


def test_url_mode_masks_a_failed_deploy_and_a_raising_verifier(trouble_remote, trouble):
    rows, app = gym_rows(trouble), trouble_remote.app
    _, body = run(play(app.url, rows["deploy-fails"], [("list_notes", {})], "hi"))
    sent = {"responses_create_params": rows["deploy-fails"]["responses_create_params"]}
    assert_masked(body, sent, "provider_unavailable", "the environment failed: ", app.log())
    assert "did not come up: its process exited with code 3" in body["failure_reason"]
    _, body = run(play(app.url, rows["verifier-raises"], [("write_note", {"title": "a", "text": "b"})],
                       "ok"))
    sent = {"responses_create_params": rows["verifier-raises"]["responses_create_params"]}
    assert_masked(body, sent, "verifier_error", "the environment failed: ", app.log())
    assert "RuntimeError: the checker broke" in body["failure_reason"]


def test_url_mode_honours_the_resources_servers_tool_timeout(trouble_remote, trouble):
    app = trouble_remote.app
    row = gym_rows(trouble)["slow-call"]

    async def go():
        async with client() as http:
            agent = simple_agent(http, app.url, row)
            await agent.seed()
            slow = await agent.call("slow_note", title="x")
            verified = await agent.verify("done")
            sent = verified.sent
            return slow, json.loads(verified.text), sent

    slow, body, sent = run(go())
    message_ = ("slow_note didn't answer within 1s, and the episode ended, since what the call does "
                "may still be under way")
    assert slow.text == f"error: {message_}"
    assert_masked(body, sent, "transport_timeout", message_, app.log())


def test_url_mode_waits_the_resources_servers_reset_timeout_not_the_serves_reply_deadline(
        written, work, trouble):
    """A serve whose OpenEnv replies are due within 1 s (--client-timeout 2 --reply-margin 1), and
    the slow-start task, whose env listens only after 2 s. A bare OpenEnv reset misses that
    deadline; one that says at reset how long its client waits (timeout_s) gets its prompt; a
    url: resources server (reset_timeout 600) says so itself, so its rollout scores 1.0 instead of
    being masked for the serve's deadline. A timeout_s that is no number is refused, saying what it
    is, and the session goes on."""
    slow_at = [t.name for t in agentenv.Bundle.load(trouble).splits["all"]].index("slow-start")
    reset = {"type": "reset", "data": {"split": "all", "index": slow_at}}
    with serving(trouble, work / "serve-trouble-short", "--client-timeout", "2",
                 "--reply-margin", "1") as serve, \
            running(Server.gym(work / "url-trouble-short", trouble_config(url=serve.url),
                               app=written.folder)) as app:
        bare = Socket(serve.ws_url + "/ws")
        missed = bare.ask(reset)["data"]
        assert missed["observation"]["metadata"]["failure_kind"] == "transport_timeout", missed
        assert "took longer than 1s" in missed["observation"]["metadata"]["error"]
        assert "give timeout_s at reset" in missed["observation"]["metadata"]["error"]
        refused = bare.ask({"type": "reset", "data": {**reset["data"], "timeout_s": "soon"}})["data"]
        assert refused["observation"]["metadata"]["error"].startswith(
            "timeout_s is how long the client waits for the reset's reply and each end_turn's, in "
            "seconds: a number above 0 and at most 86400 (not 'soon')"), refused
        waited = bare.ask({"type": "reset", "data": {**reset["data"], "timeout_s": 60}})["data"]
        assert waited["done"] is False and "groceries" in \
            waited["observation"]["metadata"]["prompt"], waited
        bare.send({"type": "close"})

        _, body = run(play(app.url, gym_rows(trouble)["slow-start"],
                           [("write_note", {"title": "groceries", "text": "eggs and milk"})], "Saved."))
        assert body["reward"] == 1.0 and body["mask_sample"] is False, body


# ================================================================ 5. reset_timeout and idle_timeout

def test_idle_timeout_ends_a_session_that_never_verifies_and_frees_its_slot(written, tmp_path):
    app = Server.gym(tmp_path / "idle-app", written.config, "notes_v1", app=written.folder,
                     idle_timeout=1, max_concurrent_envs=1)
    try:
        async def go():
            async with client() as http:
                abandoned = simple_agent(http, app.url, row_of(written.folder, "two-step"))
                await abandoned.seed()
                assert (await abandoned.call("list_notes")).text == "pancakes"
                pids = list(app.records())
                assert len(pids) == 1
                started = time.monotonic()
                while app.records() and time.monotonic() - started < 5:
                    await asyncio.sleep(0.1)
                assert not app.records(), "the idle session's env was not torn down"
                assert gone(pids[0], 3), "the idle session's env process still runs"
                assert time.monotonic() - started < 4
                # the one slot is free again: a second rollout completes
                _, body = await play(app.url, row_of(written.folder, "save-groceries"),
                                     [("write_note", {"title": "groceries", "text": "eggs, milk"})], "ok")
                assert body["reward"] == 1.0 and body["mask_sample"] is False
                # and the abandoned rollout, verified late, has no session any more
                late = await abandoned.verify("pancakes")
                sent = late.sent
                return json.loads(late.text), sent

        body, sent = run(go())
        assert "Ended a NeMo Gym session with no request for 1s (idle_timeout), freeing its episode." in app.log()
        assert_masked(body, sent, "session_lost", "this server holds no session for the rollout",
                      app.log())
    finally:
        app.stop()


def test_reset_timeout_masks_a_rollout_that_waits_too_long_for_a_slot(written, tmp_path):
    app = Server.gym(tmp_path / "reset-app", written.config, "notes_v1", app=written.folder,
                     reset_timeout=1, max_concurrent_envs=1)
    try:
        async def go():
            async with client() as http:
                holder = simple_agent(http, app.url, row_of(written.folder, "save-groceries"))
                await holder.seed()
                assert (await holder.call("list_notes")).text == "(no notes)"      # holds the slot
                waiter = simple_agent(http, app.url, row_of(written.folder, "recall-recipe"))
                seeded = await waiter.seed()
                assert seeded.status == 200 and seeded.elapsed < 0.5
                call = await waiter.call("read_note", title="pancakes")
                assert call.status == 200 and 0.8 < call.elapsed < 3
                assert call.text.startswith(
                    "error: the environment of this rollout failed, so read_note did not run (the "
                    "episode was not deployed and at its first turn within reset_timeout (1s)")
                verified = await waiter.verify("2")
                sent = verified.sent
                masked_ = json.loads(verified.text), sent
                # the slot's holder plays on, unharmed
                await holder.call("write_note", title="groceries", text="eggs and milk")
                done = await holder.verify("Saved.")
                return masked_, json.loads(done.text)

        (body, sent), held = run(go())
        assert_masked(body, sent, "transport_timeout",
                      "the episode was not deployed and at its first turn within reset_timeout (1s): ",
                      app.log())
        assert "raise reset_timeout or max_concurrent_envs" in body["failure_reason"]
        assert held["reward"] == 1.0 and held["mask_sample"] is False
    finally:
        app.stop()


def test_the_wait_warning_of_a_bundle_mode_server_names_its_config_setting(written, tmp_path):
    app = Server.gym(tmp_path / "wait-app", written.config, "notes_v1", app=written.folder,
                     max_concurrent_envs=1, reset_timeout=1)
    try:
        async def go():
            async with client() as http:
                holder = simple_agent(http, app.url, row_of(written.folder, "save-groceries"))
                await holder.seed()
                await holder.call("list_notes")
                waiter = simple_agent(http, app.url, row_of(written.folder, "recall-recipe"))
                await waiter.seed()
                await waiter.call("list_notes")                  # waits past reset_timeout
                await waiter.close()
                await holder.close()
        run(go())
        warning = [line for line in app.log().splitlines() if "episodes at once, so new episodes wait" in line]
        assert len(warning) == 1, app.log()
        assert "max_concurrent_envs" in warning[0] and "MAX_CONCURRENT_ENVS" not in warning[0], warning
    finally:
        app.stop()


# ================================================================ 6. bad requests

def _post(url: str, body: bytes, cookie: str | None = None) -> tuple[int, str, str]:
    reply = request(url, body=body, cookie=cookie)
    return reply.status, reply.content_type, reply.text


def test_a_row_whose_task_id_is_not_its_split_and_index_is_refused(notes_app, written):
    row = {**row_of(written.folder, "save-groceries"), "index": 0}
    status, kind, text = _post(notes_app.url + "/seed_session", json.dumps(row).encode())
    assert (status, kind) == (400, "application/json")
    assert json.loads(text)["detail"] == (
        f"the row's task_id '{NOTES_ID}/save-groceries' is not the task at all[0], which is "
        f"'{NOTES_ID}/recall-recipe'; write the rows again with write-gym")


@pytest.mark.parametrize("split, index, detail", [
    ("all", 3, "split 'all' has 3 tasks, so it has no task 3; give an index from 0 to 2"),
    ("smoke", -1, "split 'smoke' has 1 tasks, so it has no task -1; give an index from 0 to 0"),
    ("train", 0, "there is no split 'train'; the splits are all, smoke"),
    (None, None, "the row needs split (text) and index (a whole number) naming the task to play; "
                 "write the rows with python agentenv.py write-gym"),
])
def test_a_row_naming_no_task_here_is_refused_listing_what_exists(notes_app, written, split, index,
                                                                  detail):
    row = {**row_of(written.folder, "save-groceries"), "split": split, "index": index}
    row.pop("task_id")
    status, _, text = _post(notes_app.url + "/seed_session", json.dumps(row).encode())
    # a row that names no task at all is unprocessable, as Gym's own servers answer it
    assert status == (422 if split is None else 400) and json.loads(text) == {"detail": detail}


def test_a_row_from_the_same_bundle_in_another_folder_plays(notes_app, written):
    row = {**row_of(written.folder, "save-groceries"), "task_id": "@local/elsewhere/notes-v1/save-groceries"}
    _, body = run(play(notes_app.url, row, [("write_note", {"title": "groceries", "text": "eggs milk"})],
                       "ok"))
    assert body["reward"] == 1.0


def test_a_call_without_a_session_is_400_and_a_verify_is_replayed(notes_app, written):
    status, _, text = _post(notes_app.url + "/write_note", b'{"title": "a", "text": "b"}')
    assert status == 400
    assert text == "error: no session: POST /seed_session with the row first, then call write_note " \
                   "with its cookie"
    row = row_of(written.folder, "save-groceries")
    body = json.dumps({**row, "response": responses("hi")}).encode()
    status, _, text = _post(notes_app.url + "/verify", body)     # gym eval reverify's: replayed
    assert status == 200 and json.loads(text)["reward"] == 0.0 and not json.loads(text)["mask_sample"]


def test_verify_with_an_unknown_cookie_is_masked_session_lost(notes_app, written):
    row = row_of(written.folder, "save-groceries")
    sent = {**row, "response": responses("hi")}
    status, _, text = _post(notes_app.url + "/verify", json.dumps(sent).encode(), cookie="nope")
    assert status == 200
    assert_masked(json.loads(text), sent, "session_lost",
                  "this server holds no session for the rollout (it was closed, ended after "
                  "idle_timeout, or the server restarted)", notes_app.log())


@pytest.mark.parametrize("route", ["/seed_session", "/verify", "/close_session", "/aggregate_metrics",
                                   "/ng-rollout/r1/seed_session"])
def test_a_body_that_is_not_json_is_422(notes_app, route):
    status, _, text = _post(notes_app.url + route, b"{not json", cookie="whatever")
    assert status == 422
    assert json.loads(text)["detail"][0]["type"] == "json_invalid"


def test_verify_without_the_row_or_the_response_is_422(notes_app, written):
    row = row_of(written.folder, "save-groceries")
    status, _, text = _post(notes_app.url + "/verify", json.dumps(row).encode(), cookie="x")
    assert status == 422 and "responses_create_params and the model's response" in text


def test_a_tool_call_whose_body_is_not_a_json_object_answers_text(notes_app, written):
    """Gym never sends one (it parses the model's arguments first); the answer is still text."""
    async def go():
        async with client() as http:
            agent = simple_agent(http, notes_app.url, row_of(written.folder, "save-groceries"))
            await agent.seed()
            bad = await agent.post("/write_note", b"{oops")
            listed = await agent.post("/write_note", [1, 2])
            await agent.close()
            return bad, listed

    bad, listed = run(go())
    assert bad.status == 400 and bad.text.startswith("error: the arguments of write_note are not JSON")
    assert listed.status == 400 and listed.text == "error: the arguments of write_note must be a JSON object"


# ================================================================ 7. both surfaces of serve share one pool

def test_a_gym_rollout_and_an_openenv_session_share_serves_pool(serve1, written):
    """serve --max-concurrent-envs 1: a Gym rollout on serve's own /seed_session holds the one
    episode, so an OpenEnv /ws is refused with CAPACITY_REACHED (which OpenEnv's clients know to
    retry), and once the Gym rollout closes, a new /ws plays."""
    row = row_of(written.folder, "save-groceries")

    async def go():
        async with client() as http:
            gym = simple_agent(http, serve1.url, row)
            assert (await gym.seed()).status == 200
            assert (await gym.call("list_notes")).text == "(no notes)"      # holds the one episode
            refused = await http.ws_connect(serve1.url + "/ws")
            frame = await refused.receive_json(timeout=20)
            await refused.close()
            closed = await gym.close()
            socket_ = await http.ws_connect(serve1.url + "/ws")
            await socket_.send_json({"type": "reset", "data": {"split": "all", "index": 0}})
            played = await socket_.receive_json(timeout=20)
            await socket_.send_json({"type": "close"})
            await socket_.close()
            return frame, json.loads(closed.text), played

    frame, closed, played = run(go())
    assert frame["type"] == "error" and frame["data"]["code"] == "CAPACITY_REACHED", frame
    assert frame["data"]["active_sessions"] == 1 and frame["data"]["max_sessions"] == 1
    assert "This is temporary" in frame["data"]["message"]
    assert closed == {"status": "closed"}
    assert played["type"] == "observation"
    assert played["data"]["observation"]["metadata"]["prompt"] == RECALL_PROMPT


# ================================================================ a served URL behind a bearer token

def test_a_token_protected_serve_is_reachable_by_write_gym_and_a_url_app_given_the_token(
        written, tmp_path):
    """serve with AGENTENV_TOKEN asks every request for it; write-gym from its URL and the
    resources server written for it send AGENTENV_TOKEN from their environment, and say what to
    do when it is missing."""
    token = "a-token-for-the-test"
    serve = Server.serve(NOTES, tmp_path / "serve-token", env={"AGENTENV_TOKEN": token})
    app = None                                       # (it answered: here a 401)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(serve.url + "/health", timeout=5)
        assert refused.value.code == 401
        assert refused.value.headers["WWW-Authenticate"].startswith("Bearer")

        without = write_gym_cli(serve.url, tmp_path / "root-none", tmp_path / "state-w1")
        assert without.returncode == 1
        assert f"the server at {serve.url} asks for a bearer token, and none was sent; set " \
               "AGENTENV_TOKEN to the token serve was given" in without.stderr

        done = subprocess.run([PY, str(AGENTENV), "write-gym", serve.url, str(tmp_path / "root")],
                              cwd=REPO, env=environ(tmp_path / "state-w2", AGENTENV_TOKEN=token),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        folder = tmp_path / "root" / "resources_servers" / "notes_v1"
        config = yaml.safe_load((folder / "configs" / "notes_v1.yaml").read_text())
        app = Server.gym(tmp_path / "url-token", config, "notes_v1", app=folder,
                         env={"AGENTENV_TOKEN": token})
        row = row_of(folder, "save-groceries")
        replies, body = run(play(app.url, row, [("write_note", {"title": "groceries",
                                                                "text": "eggs and milk"})], "ok"))
        assert replies[0].text == "saved note 'groceries'"
        assert body["reward"] == 1.0 and body["mask_sample"] is False
    finally:
        if app:
            app.stop()
        serve.stop()


def test_serving_without_a_token_warns_saying_who_can_drive_it(tmp_path):
    serve = Server.serve(NOTES, tmp_path / "serve-open", "--host", "0.0.0.0")
    serve.stop()
    said = ("WARNING agentenv: Serving with no token: any user or program on this machine, and anyone "
            f"who can reach 0.0.0.0:{serve.port}, can play the bundle's tasks and run what their tools "
            "and boxes run, from the web page or any client (web pages cannot: the server answers "
            "only its own). Start serve with --token-file PATH (or AGENTENV_TOKEN set) so every "
            "request must carry the token, and enter it at /web.")
    assert said in serve.log()
    loopback = Server.serve(NOTES, tmp_path / "serve-loopback")
    loopback.stop()
    assert "Serving with no token: any user or program on this machine can play" in loopback.log()
    assert "anyone who can reach" not in loopback.log()
    locked = Server.serve(NOTES, tmp_path / "serve-locked", env={"AGENTENV_TOKEN": "t"},
                          headers={"Authorization": "Bearer t"})
    locked.stop()
    assert "no token" not in locked.log()


def test_warm_in_the_gym_config_keeps_envs_ready_and_a_rollout_takes_one(written, work):
    """``warm: N`` beside ``bundle:`` in the Gym config: the resources server keeps N envs ready
    (counted in /health, apart from the episodes), and a rollout's seed takes one and plays."""
    config = resources_config("notes_v1", bundle=str(NOTES), sandbox="local", warm=2)
    row = row_of(written.folder, "save-groceries")
    with running(Server.gym(work / "warm-app", config)) as app:
        def warm_ready() -> dict | None:
            health = request(app.url + "/health", "GET").json()
            return health if health.get("warm", {}).get("ready") == 2 else None
        assert wait_until(warm_ready, 30, "two warm envs") == {
            "status": "healthy", "episodes": 0, "warm": {"ready": 2, "booting": 0, "target": 2}}
        waiting = set(app.records())
        assert len(waiting) == 2

        async def go():
            async with client() as http:
                agent = simple_agent(http, app.url, row)
                assert (await agent.seed()).status == 200
                saved = await agent.call("write_note", title="groceries", text="eggs and milk")
                assert saved.text == "saved note 'groceries'"
                body = json.loads((await agent.verify("Saved.")).text)
                assert body["reward"] == 1.0 and body["mask_sample"] is False
        run(go())
        assert "Keeping 2 warm env(s) started and ready ahead of demand (notebook 2)" in app.log()
        # the rollout played on one of the warm envs (gone with its episode); the pool refilled
        wait_until(lambda: len(waiting - set(app.records())) == 1 and len(app.records()) == 2,
                   30, "one warm env used and replaced")
