"""agentenv.py run as a program (``python agentenv.py ...``), as a user sees the process.

The program hands the code it was compiled to over to a fresh interpreter in the same process,
which runs it as the module ``agentenv`` (see the top of agentenv.py): so the exit codes and
messages must be the CLI's, the interpreter's own flags must reach the program, a serve must
answer and stop as the process it was started as, and it must import only what its run uses (a
serve of the local sandbox: neither the docker SDK nor PyYAML). Elsewhere: SIGTERM and SIGINT to
a serve (tests/test_openenv.py, tests/test_faults.py), a written Gym server importing agentenv
(tests/test_gym_surface.py -k write), Ray's workers (tests/test_ray.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.harness import NOTES, REPO, Server, SyncGym, gym_row, running

AGENTENV = REPO / "agentenv.py"


def program(*argv: str, cwd: Path = REPO, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def imported(importtime: str) -> set[str]:
    """The modules ``python -X importtime`` says were imported (its lines on stderr)."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def test_the_programs_exit_codes_and_messages_are_the_clis(tmp_path):
    version = program(str(AGENTENV), "--version", cwd=tmp_path)
    assert (version.returncode, version.stdout, version.stderr) == (0, "agentenv.py 0.1.0\n", "")
    bare = program("agentenv.py")                       # a path relative to the folder it is in
    assert bare.returncode == 2 and bare.stdout == ""
    assert bare.stderr.startswith("usage: agentenv.py [-h] [--version] [-v] COMMAND ...\n")
    assert "the following arguments are required: COMMAND" in bare.stderr
    missing = program(str(AGENTENV), "check", str(tmp_path / "nothing"), cwd=tmp_path)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == (f"agentenv.py check: the bundle has 1 problem:\n  - {tmp_path / 'nothing'}"
                              ": there is no bundle folder here; pass the folder that holds envs/, "
                              "tasks/ and evals/\n")
    # as a module (python -m) and isolated (-I: no script folder on sys.path) alike
    assert program("-m", "agentenv", "--version").stdout == "agentenv.py 0.1.0\n"
    isolated = program(str(AGENTENV), "--version", flags=("-I",), cwd=tmp_path)
    assert (isolated.returncode, isolated.stdout) == (0, "agentenv.py 0.1.0\n")


def test_the_interpreters_flags_reach_the_program():
    """-X importtime lists the program's own imports: aiohttp's, made only once the code runs as
    the module agentenv in the interpreter the flags were given to."""
    timed = program(str(AGENTENV), "--version", flags=("-X", "importtime"))
    assert timed.returncode == 0 and timed.stdout == "agentenv.py 0.1.0\n"
    assert {"aiohttp", "argparse"} <= imported(timed.stderr)


def test_a_served_local_sandbox_imports_neither_the_docker_sdk_nor_yaml(tmp_path):
    """serve --sandbox local, started as a program with -X importtime, plays a Gym episode to its
    reward and stops with exit 0; in all that its imports (on its stderr) hold aiohttp and
    prometheus_client, which it uses, and neither docker nor yaml, which it does not."""
    server = Server([sys.executable, "-X", "importtime", str(AGENTENV), "serve", str(NOTES),
                     "--sandbox", "local", "--port", "{port}"], tmp_path)
    with running(server):
        rollout = SyncGym(server, gym_row(NOTES, 1), strict=True)
        rollout.seed()
        assert rollout.call("write_note", title="groceries", text="eggs and milk").text == \
            "saved note 'groceries'"
        assert rollout.verify().json()["reward"] == 1.0
    modules = imported(server.log())
    assert {"aiohttp.web", "prometheus_client"} <= modules
    assert not {m for m in modules if m.split(".")[0] in ("docker", "yaml")}, \
        sorted(m for m in modules if m.split(".")[0] in ("docker", "yaml"))
