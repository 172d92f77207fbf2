"""``agentenv.build_app`` as the README's ``serve.py`` uses it: a script of its own that builds the
app and runs it with ``aiohttp.web.run_app``, in a subprocess, on the local sandbox.

* One bundle (notes-v1): a NeMo Gym rollout scores 1.0 and an OpenEnv reset opens the task over
  /ws, from the one app and its one pool; SIGTERM ends the live episode, tears its env down and
  exits 0.
* A mapping of two bundles, ``{"train": notes-v1, "eval": a copy}``: each bundle's tasks are one
  split (and 'all' every task), a rollout of the held-out split plays its own bundle's task, and
  the status line names the splits.
* A bad argument (a folder that isn't there) ends the script with the AgentEnvError, before the
  app starts: no port is bound, no env is started.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


from tests.harness import (NOTES, REPO, Server, Socket, SyncGym, copy_bundle, environ, gym_row,
                           request, running)

# The README's serve.py, with the folders and port the test gives it.
SERVE_PY = """\
import logging
import sys

from aiohttp import web

from agentenv import build_app

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
bundle = {bundle}
app = build_app(bundle, sandbox="local", max_concurrent_envs=4)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]))
"""


def serve_py(folder: Path, bundle: object) -> Server:
    """serve.py with ``bundle`` (a folder, or a mapping of split to folder), run as a user runs it."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "serve.py"
    script.write_text(SERVE_PY.format(bundle=repr(bundle)))
    return Server([sys.executable, str(script), "{port}"], folder, cwd=folder,
                  env={"PYTHONPATH": str(REPO)})


def index_of(bundle: Path, name: str) -> int:
    import agentenv
    return [t.name for t in agentenv.Bundle.load(bundle).splits["all"]].index(name)


def groceries(server: Server, row: dict) -> dict:
    rollout = SyncGym(server, row)
    rollout.seed()
    assert rollout.call("write_note", title="groceries", text="eggs, milk").text == \
        "saved note 'groceries'"
    return rollout.verify("Saved.").json()


def test_serve_py_serves_one_bundle_on_both_wires(tmp_path):
    with running(serve_py(tmp_path / "one", str(NOTES))) as server:
        verdict = groceries(server, gym_row(NOTES, index_of(NOTES, "save-groceries")))
        assert (verdict["reward"], verdict["mask_sample"]) == (1.0, False)
        with Socket(server.ws_url + "/ws") as socket:
            reply = socket.ask({"type": "reset", "data": {"split": "all", "index": 0}})
            assert reply["type"] == "observation", reply
            assert reply["data"]["observation"]["metadata"]["prompt"]
            server.wait_envs(1)
        log = server.log()
    assert "Serving notes-v1: 3 tasks in the splits all, " in log
    assert "(OpenEnv: /ws; NeMo Gym: /seed_session; metrics: /metrics; web page: /web)" in log


def test_serve_py_serves_a_mapping_of_two_bundles_each_a_split(tmp_path):
    held_out = copy_bundle(tmp_path / "bundles" / "notes-eval")
    with running(serve_py(tmp_path / "two", {"train": str(NOTES), "eval": str(held_out)})) as server:
        env = request(server.url + "/list_environments", "GET").json()[0]
        tasks = {split: request(server.url + f"/{env}/tasks", body={"split": split}).json()["tasks"]
                 for split in ("all", "train", "eval")}
        assert [t["id"].split("/")[-2] for t in tasks["train"]] == ["notes-v1"] * 3
        assert [t["id"].split("/")[-2] for t in tasks["eval"]] == ["notes-eval"] * 3
        assert tasks["all"] == tasks["train"] + [{**t, "index": t["index"] + 3} for t in tasks["eval"]]
        row = {**gym_row(held_out, index_of(held_out, "save-groceries")), "split": "eval"}
        verdict = groceries(server, row)
        assert (verdict["reward"], verdict["mask_sample"]) == (1.0, False)
        assert verdict["task_id"].split("/")[-2:] == ["notes-eval", "save-groceries"]
    assert "Serving notes-v1+notes-eval: 6 tasks in the splits all, train, eval" in server.log()


def test_serve_py_with_a_bundle_that_is_not_there_stops_before_starting(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "serve.py").write_text(SERVE_PY.format(bundle=repr(str(tmp_path / "nowhere"))))
    proc = subprocess.run([sys.executable, "serve.py", "1"], cwd=folder, capture_output=True,
                          text=True, timeout=60, env=environ(tmp_path / "state", PYTHONPATH=str(REPO)))
    assert proc.returncode == 1
    assert "agentenv.BundleError: the bundle has 1 problem" in proc.stderr
    assert "there is no bundle folder here; pass the folder that holds envs/, tasks/ and evals/" \
        in proc.stderr
    assert "Running on" not in proc.stdout + proc.stderr
