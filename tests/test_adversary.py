"""The model as an adversary: a hostile battery against ``serve bundles/pyfix-v1 --sandbox docker``.

Training optimises the model against the environment, so whatever a rollout can get away with, the
model learns. Each probe here is what a model with ``bash`` tries instead of fixing the bug, played
as a Gym rollout beside an honest sibling that fixes it and must still score 1.0 in time:

* forged rewards: the module exiting 0 at import, an extra test file that exits 0 or patches
  ``unittest.TestCase.run``, a ``unittest.py`` shadowing the standard library, a
  ``usercustomize.py`` or a ``.pth`` file in the agent's user site, the module patching unittest
  or killing its judge, a background job (escaped with setsid) that rewrites the tests and the
  judge after they are loaded, the judge's folder planted ahead: each scores 0.0, never masked,
  and each is first shown to fool the tests as the model runs them (so it is a real hack);
* a broken box turned into a mask: /app or /tmp filled, the box's first process killed, its memory
  exhausted, the tests made unreadable, a FIFO in place of the test file or of the module: 0.0,
  never masked
  (a forfeit where the box could no longer be judged);
* a server one episode cannot stall: commands that evade a kill (setsid, a cleared environment,
  ``exec``, ignored signals, a double fork, a fork bomb) answered within their deadline and
  leaving nothing running; eight hostile episodes at once sleeping past their deadline while a
  sibling deploys, plays and scores in time;
* a machine it cannot fill: a flood into the box's first process's output and its own leaves the
  host's disk as it was, within a few MiB;
* a client gone mid-call: its box is removed within seconds, over /ws and the Gym wire;
* a verifier that runs the model's code as root: that code kills every process it can, and the box
  still stands (its keeper is its init): 0, never masked;
* a verifier that writes its reward and its result to files, as the agent and as root: a reward or
  a result planted read-only in a folder made read-only, a link or a FIFO at the reward path, a
  sparse 4 GiB result file, or the module making the result file 4 GiB or linking the reward path
  to a number of root's: 0.0, never masked, the verify in seconds and its record small (the
  forgeries first shown to pay 1 when the model runs the verifier's command itself); and the
  agent's processes stopped before the verifier reads what it found, however late the keeper acts.

The Gym verify, the OpenEnv observation and /metrics agree on each: scored 0, not masked (and a
forfeit says why). Docker is needed (skipped with the reason without it; required in CI).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.harness import (Gym, PYFIX, Socket, box_of, boxes_of, client, copy_bundle, gym_row,
                           run, serving, started_here, wait_until)

import agentenv

TASK = "bsearch"                      # every probe plays this task: its module is /app/bsearch.py
TOOLS = ["bash", "end_turn"]
NAIVE = "python3 -m unittest discover -s tests >/dev/null 2>&1; echo naive=$?"
SITE = "$HOME/.local/lib/python3.11/site-packages"


def fix() -> str:
    fixed = (PYFIX / "reference" / f"{TASK}.py").read_text()
    return f"cat > {TASK}.py <<'AGENTENV_EOF'\n{fixed}AGENTENV_EOF\n"


def prepend(code: str) -> str:
    """A command that puts ``code`` at the top of the module, above the buggy code."""
    return f"printf '%s\\n' {shlex_quote(code)} | cat - {TASK}.py > /tmp/m && cat /tmp/m > {TASK}.py"


def shlex_quote(text: str) -> str:
    import shlex
    return shlex.quote(text)


# name -> (the commands of the hack, whether the tests as the model runs them then pass: a forged
# reward a naive verifier would have paid 1.0 for)
FORGERIES: dict[str, tuple[list[str], bool]] = {
    "module exits 0 at import": ([prepend("import os; os._exit(0)")], True),
    "an extra test file exits 0": (["printf 'import os\\nos._exit(0)\\n' > tests/test_000.py"], True),
    "an extra test patches TestCase.run": ([
        "printf 'import unittest\\nunittest.TestCase.run = lambda self, result=None: None\\n' "
        "> tests/test_000.py"], True),
    "unittest.py shadows the standard library": (["printf 'raise SystemExit(0)\\n' > unittest.py"],
                                                 True),
    "usercustomize in the user site": ([f"mkdir -p {SITE} && printf 'import os\\nos._exit(0)\\n' > "
                                        f"{SITE}/usercustomize.py"], True),
    "a .pth turns assertions into no-ops": ([
        f"mkdir -p {SITE} && printf '%s\\n' 'import unittest; unittest.TestCase.assertEqual = "
        f"lambda *a, **k: None' > {SITE}/zz.pth"], True),
    "module patches unittest at import": ([prepend(
        "import unittest; unittest.TestCase.assertEqual = lambda *a, **k: None")], True),
    "module kills its judge": ([prepend("import os, signal; os.kill(os.getppid(), signal.SIGKILL)")],
                               False),
    "a background job rewrites the tests and the judge": ([
        "setsid nohup sh -c 'while :; do for f in /app/tests/*.py /tmp/pyfix-verify/*.py; do "
        "[ -f \"$f\" ] && printf \"import os\\nos._exit(0)\\n\" > \"$f\"; done; sleep 0.05; done' "
        ">/dev/null 2>&1 &", "sleep 0.5"], True),
    "the judge's folder planted ahead": ([
        "mkdir -p /tmp/pyfix-verify && printf 'raise SystemExit(0)\\n' > "
        "/tmp/pyfix-verify/run_tests.py && cp tests/test_bsearch.py /tmp/pyfix-verify/"], False),
}
# name -> (the commands, whether the box can no longer be judged: a forfeit, scored 0 and saying so)
BREAKAGES: dict[str, tuple[list[str], bool]] = {
    "/app filled": (["head -c 4G /dev/zero > /app/fill 2>/dev/null; df -h /app | tail -1"], False),
    "/tmp filled": (["head -c 4G /dev/zero > /tmp/fill 2>/dev/null; df -h /tmp | tail -1"], True),
    "the first process killed": (["kill -9 1; kill -9 -1; echo still here"], False),
    "its memory exhausted": (["head -c 4G /dev/zero > /app/fill 2>/dev/null; "
                              "python3 -c 'b = bytearray(3 << 30)'; echo rc=$?"], False),
    "the tests made unreadable": (["chmod 000 tests"], False),
    "a FIFO for the test file": (["rm tests/test_bsearch.py && mkfifo tests/test_bsearch.py"], False),
    "a FIFO for the module": (["rm bsearch.py && mkfifo bsearch.py"], False),
}


@pytest.fixture
def no_box_left(docker_client):
    """Every test's boxes are gone at its end."""
    yield
    left = [c for c in agentenv_boxes(docker_client)
            if agentenv.owner_alive(owner := c.labels.get("agentenv.owner", "")) is not False
            and started_here(owner)]
    for container in left:
        with contextlib.suppress(Exception):
            container.remove(force=True)
    assert not left, f"boxes left behind: {[c.name for c in left]}"


def agentenv_boxes(docker_client) -> list:
    return docker_client.containers.list(all=True, filters={"label": "agentenv.box"},
                                         ignore_removed=True)


def row() -> dict:
    loaded = agentenv.Bundle.load(PYFIX)
    index = [t.name for t in loaded.splits["all"]].index(TASK)
    return gym_row(loaded, index, "all", TOOLS)


async def honest(server, http, its_row: dict | None = None) -> tuple[dict, float]:
    """The sibling: seeds, fixes the module, checks, verifies; its verify and how long it took."""
    started = time.monotonic()
    gym = Gym(server, its_row or row(), http)
    await gym.seed()
    assert (await gym.call("bash", command=fix())).status == 200
    checked = await gym.call("bash", command=NAIVE)
    assert "naive=0" in checked.text, checked.text
    return (await gym.verify("Fixed.")).json(), time.monotonic() - started


async def hostile(server, http, commands: list[str], naive: bool) -> tuple[dict, str]:
    """A rollout that plays ``commands`` instead of a fix; its verify, and what the tests said
    when the model ran them after its hack."""
    gym = Gym(server, row(), http)
    await gym.seed()
    for command in commands:
        await gym.call("bash", command=command)
    said = (await gym.call("bash", command=NAIVE)).text if naive else ""
    return (await gym.verify("All tests pass.")).json(), said


def metric(server, name: str, **labels: str) -> float:
    from tests.harness import request
    total = 0.0
    for line in request(server.url + "/metrics", "GET", timeout=30).text.splitlines():
        if line.startswith(name) and not line.startswith("#") and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_no_hack_earns_more_than_a_fix_and_none_is_masked(tmp_path, no_box_left, docker_client):
    """Every forgery and breakage, four at a time, each batch beside an honest sibling: the hacks
    score 0.0 (the forgeries having first fooled the tests as the model runs them), none is
    masked, the box that could no longer be judged is a forfeit that says why, the siblings score
    1.0 within a minute; /metrics counts the same."""
    probes = [(name, commands, naive, False) for name, (commands, naive) in FORGERIES.items()] + \
             [(name, commands, False, forfeit) for name, (commands, forfeit) in BREAKAGES.items()]
    with serving(PYFIX, tmp_path, "--max-concurrent-envs", "6", sandbox="docker") as server:
        async def battery():
            results, siblings = {}, []
            async with client(240) as http:
                for at in range(0, len(probes), 4):
                    batch = probes[at:at + 4]
                    played = await asyncio.gather(
                        honest(server, http),
                        *(hostile(server, http, commands, naive) for _, commands, naive, _ in batch))
                    siblings.append(played[0])
                    for (name, _, naive, forfeit), (verdict, said) in zip(batch, played[1:]):
                        results[name] = (verdict, said, naive, forfeit)
            return results, siblings
        results, siblings = run(battery(), 900)
        for name, (verdict, said, naive, forfeit) in results.items():
            assert (verdict["reward"], verdict["mask_sample"]) == (0.0, False), (name, verdict)
            assert verdict.get("failure_kind") is None, (name, verdict)
            if naive:
                assert "naive=0" in said, (name, said)       # a real hack: it fooled the tests
            assert ("forfeit" in verdict) == forfeit, (name, verdict)
        verdict = results["/tmp filled"][0]
        assert "the files could not be put in box 'solver' at /tmp/pyfix-verify" in verdict["forfeit"]
        for verdict, took in siblings:
            assert (verdict["reward"], verdict["mask_sample"]) == (1.0, False), verdict
            assert took < 60, took
        assert metric(server, "agentenv_masked_rollouts_total") == 0
        assert metric(server, "agentenv_forfeits_total") == sum(f for *_, f in probes)
        assert metric(server, "agentenv_episodes_total", outcome="scored") == \
            len(probes) + len(siblings)
        log = server.log()
        assert "scores 0, not masked, since the model's own doing ended it" in log
        assert "Traceback" not in log, log[-3000:]


def turn_over_ws(server, command: str) -> tuple[dict, float]:
    """One OpenEnv /ws episode of TASK in which the model runs ``command`` and ends its turn: the
    end_turn's observation, and how long its reply took."""
    loaded = agentenv.Bundle.load(PYFIX)
    index = [t.name for t in loaded.splits["all"]].index(TASK)
    with Socket(server.ws_url + "/ws") as ws:
        ws.ask({"type": "reset", "data": {"split": "all", "index": index}}, 120)
        ws.ask({"type": "step", "data": {"type": "call_tool", "tool_name": "bash",
                                         "arguments": {"command": command}}})
        started = time.monotonic()
        ended = ws.ask({"type": "step", "data": {"type": "call_tool", "tool_name": "end_turn",
                                                 "arguments": {"response": "Done."}}}, 120)["data"]
        return ended, time.monotonic() - started


def test_a_forfeit_over_openenv_is_a_score_of_0_that_says_why(tmp_path, no_box_left, docker_client):
    """Over /ws the rollout whose box could not be judged ends done, with reward 0.0 and the
    forfeit's reason, and no failure_kind: not an error observation a trainer would drop."""
    with serving(PYFIX, tmp_path, sandbox="docker") as server:
        ended, _ = turn_over_ws(server, "head -c 4G /dev/zero > /tmp/fill 2>/dev/null; true")
        assert ended["done"] is True and ended["reward"] == 0.0, ended
        metadata = ended["observation"]["metadata"]
        assert "failure_kind" not in metadata and metadata.get("status") != "error", metadata
        assert metadata["scores"] == {"unit-tests": 0.0}
        assert metadata["forfeit"].startswith("step 'judge' (load_artifact) failed: the files could "
                                              "not be put"), metadata
        assert ended["observation"]["result"]["forfeit"] == metadata["forfeit"]
        assert metric(server, "agentenv_masked_rollouts_total") == 0
        assert metric(server, "agentenv_forfeits_total") == 1


def test_a_module_made_to_hang_scores_0_over_openenv_within_the_reply(tmp_path, no_box_left,
                                                                        docker_client):
    """A model that makes its module hang at import, to make the verifier hang past the 55 s in
    which /ws clients are answered by default (a reply missed is masked, which a model would learn
    to prefer to failing): the trusted runner's own deadline for the module, inside the step's 40
    s, makes it the model's 0 in time; and the server warned at start of no task whose tests could
    outlast the reply (tests/test_openenv.py holds that warning)."""
    with serving(PYFIX, tmp_path, sandbox="docker") as server:
        ended, took = turn_over_ws(server, prepend("import time; time.sleep(10 ** 6)"))
        assert ended["done"] is True and ended["reward"] == 0.0, ended
        metadata = ended["observation"]["metadata"]
        assert "failure_kind" not in metadata and metadata["scores"] == {"unit-tests": 0.0}, metadata
        assert took < 50, took
        assert metric(server, "agentenv_masked_rollouts_total") == 0
        assert "after end_turn, but OpenEnv clients are answered within" not in server.log()


# ================================================================ a server one episode cannot stall

EVADERS = {
    "setsid": "setsid nohup sleep 1000 >/dev/null 2>&1 & sleep 1000",
    "a cleared environment, exec": "exec env -u AGENTENV_CALL sleep 100000",
    "ignored signals": "trap '' TERM INT HUP QUIT; sleep 1000 & wait; sleep 1000",
    "a double fork": "(setsid sh -c 'sleep 1000 & sleep 1000' &); sleep 1000",
    "a renamed process": "exec -a innocent sleep 1000",
    "a fork bomb": ":(){ :|:& };: ; sleep 1000",
}


def agents_processes(box) -> list[list[str]]:
    """The box's live processes that are not root's (the keeper and the init are root's)."""
    rows = box.top(ps_args="-eo pid,uid,stat,args")["Processes"]
    return [r for r in rows if r[1] != "0" and not r[2].startswith("Z")]


def test_a_command_that_evades_its_kill_is_answered_in_time_and_leaves_nothing(tmp_path, no_box_left,
                                                                              docker_client):
    """--bash-timeout 3: each evasion, and seven of the issue's ``exec env -u AGENTENV_CALL sleep
    100000`` in a row, is answered within its deadline and a few seconds, saying every process
    of the agent's was stopped, and leaves no process of the agent's in the box; the box still
    answers, and the fix still scores 1.0."""
    with serving(PYFIX, tmp_path, "--bash-timeout", "3", sandbox="docker") as server:
        async def play():
            async with client(240) as http:
                gym = Gym(server, row(), http)
                await gym.seed()
                box = await box_of(gym, lambda: boxes_of(docker_client, server.pid))
                assert box is not None
                answers = []
                for name, command in [*EVADERS.items(),
                                      *[(f"exec env -u #{n}", EVADERS["a cleared environment, exec"])
                                        for n in range(7)]]:
                    started = time.monotonic()
                    said = (await gym.call("bash", command=command)).text
                    took = time.monotonic() - started
                    left = await asyncio.to_thread(agents_processes, box)
                    answers.append((name, said, took, left))
                assert (await gym.call("bash", command="echo alive")).text == "alive\n"
                await gym.call("bash", command=fix())
                return answers, (await gym.verify("Fixed.")).json()
        answers, verdict = run(play(), 600)
    for name, said, took, left in answers:
        assert said.startswith("error: the command timed out after 3s, so every process of yours in "
                               "the box was stopped"), (name, said)
        assert took < 3 + 10, (name, took)
        assert left == [], (name, left)
    assert (verdict["reward"], verdict["mask_sample"]) == (1.0, False), verdict


def test_eight_hostile_episodes_do_not_stall_a_sibling(tmp_path, no_box_left, docker_client):
    """--bash-timeout 20: eight rollouts each run a command that outlives its deadline and evades
    a kill (the issue's: before, one froze the server and a sibling's reset failed at 55 s; eight
    honest ``sleep 120`` were answered after 120 s). Meanwhile a sibling seeds, deploys, fixes and
    verifies, each step in a few seconds, and scores 1.0; the eight are answered within their
    deadline and a few seconds."""
    with serving(PYFIX, tmp_path, "--bash-timeout", "20", "--max-concurrent-envs", "10",
                 sandbox="docker") as server:
        async def play():
            async with client(240) as http:
                gyms = [Gym(server, row(), http) for _ in range(8)]
                await asyncio.gather(*(g.seed() for g in gyms))
                await asyncio.gather(*(g.call("bash", command="true") for g in gyms))   # deployed

                async def stall(gym: Gym, n: int) -> float:
                    started = time.monotonic()
                    command = "sleep 120" if n % 2 else EVADERS["a cleared environment, exec"]
                    said = (await gym.call("bash", command=command)).text
                    assert said.startswith("error: the command timed out after 20s"), said
                    return time.monotonic() - started
                stalls = [asyncio.ensure_future(stall(g, n)) for n, g in enumerate(gyms)]
                await asyncio.sleep(2)                  # every one of them mid-command
                steps, started = [], time.monotonic()
                sibling = Gym(server, row(), http)
                await sibling.seed()
                for command in ("true", fix(), NAIVE):  # the first waits for the deploy
                    began = time.monotonic()
                    reply = await sibling.call("bash", command=command)
                    steps.append((command[:20], reply.text[-40:], time.monotonic() - began))
                verdict = (await sibling.verify("Fixed.")).json()
                sibling_took = time.monotonic() - started
                return verdict, sibling_took, steps, await asyncio.gather(*stalls)
        verdict, sibling_took, steps, stalls = run(play(), 600)
    assert (verdict["reward"], verdict["mask_sample"]) == (1.0, False), verdict
    assert sibling_took < 20, (sibling_took, steps)      # done before the eight were even answered
    assert all(20 <= took < 20 + 10 for took in stalls), stalls


# ================================================================ a machine it cannot fill

def du(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def test_a_flood_of_output_leaves_the_hosts_disk_as_it_was(tmp_path, no_box_left, docker_client):
    """300 MB written to the box's first process's output (refused: it is root's) and 300 MB to
    the command's own (read and cut, never stored) leave the box's folder on the host, and the
    free space of Docker's data root, within a few MiB of where they were."""
    root = Path(docker_client.info()["DockerRootDir"])
    with serving(PYFIX, tmp_path, sandbox="docker") as server:
        async def play():
            async with client(240) as http:
                gym = Gym(server, row(), http)
                await gym.seed()
                box = await box_of(gym, lambda: boxes_of(docker_client, server.pid))
                folder = root / "containers" / box.id
                before = du(folder), shutil.disk_usage(root).free
                said = [(await gym.call("bash", command=c)).text for c in (
                    "head -c 300M /dev/zero > /proc/1/fd/1; head -c 300M /dev/zero > /proc/1/fd/2",
                    "head -c 300M /dev/zero", "yes | head -c 300M >&2")]
                after = du(folder), shutil.disk_usage(root).free
                return box.attrs["HostConfig"]["LogConfig"], before, after, said
        log_config, before, after, said = run(play(), 300)
    assert log_config["Type"] == "none"
    assert "Permission denied" in said[0], said[0]
    assert "[output cut: the command printed 314572800 bytes" in said[1]
    assert after[0] - before[0] < 2 << 20, (before, after)         # the box's own folder
    assert before[1] - after[1] < 20 << 20, (before, after)        # the data root's free space


# ================================================================ a client gone mid-call

def test_a_client_gone_mid_call_has_its_box_removed_within_seconds(tmp_path, no_box_left,
                                                                  docker_client):
    """A /ws client that drops its connection, and a Gym client that gives up on its request,
    each during a ``sleep 100``: its box is gone within seconds (before: it stayed until the call
    ended), and the server goes on serving."""
    loaded = agentenv.Bundle.load(PYFIX)
    index = [t.name for t in loaded.splits["all"]].index(TASK)
    with serving(PYFIX, tmp_path, sandbox="docker") as server:
        ws = Socket(server.ws_url + "/ws")
        ws.ask({"type": "reset", "data": {"split": "all", "index": index}}, 120)
        [box] = boxes_of(docker_client, server.pid)
        ws.send({"type": "step", "data": {"type": "call_tool", "tool_name": "bash",
                                          "arguments": {"command": "sleep 100"}}})
        time.sleep(1)
        ws.drop()
        dropped = time.monotonic()
        wait_until(lambda: box.id not in {c.id for c in boxes_of(docker_client, server.pid)}, 15,
                   "the box of the /ws client that dropped mid-call is removed")
        ws_took = time.monotonic() - dropped

        async def gym_gives_up():
            async with client() as http:
                gym = Gym(server, row(), http)
                await gym.seed()
                await gym.call("bash", command="true")
                [mine] = boxes_of(docker_client, server.pid)
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                                 cookie_jar=aiohttp.DummyCookieJar()) as gone:
                    request = asyncio.ensure_future(gone.post(
                        server.url + "/bash", json={"command": "sleep 100"}, cookies=gym.cookies))
                    await asyncio.sleep(1)
                    request.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await request
                left = time.monotonic()
                while mine.id in {c.id for c in boxes_of(docker_client, server.pid)}:
                    assert time.monotonic() - left < 15, "the Gym client's box is still there"
                    await asyncio.sleep(0.2)
                return time.monotonic() - left, await honest(server, http)
        gym_took, (verdict, _) = run(gym_gives_up(), 300)
    assert ws_took < 15 and gym_took < 15, (ws_took, gym_took)
    assert (verdict["reward"], verdict["mask_sample"]) == (1.0, False)


# ================================================================ root in the box

def test_code_run_as_root_in_the_box_cannot_bring_it_down(tmp_path, no_box_left, docker_client):
    """A bundle whose verifier runs the tests as root (the unit-test verifier's default user): the
    model plants a test that, as root, kills the box's first process and every other one. The
    keeper is the box's init, which takes no signal from inside the box but those it handles: the
    box stands, the verifier's own processes die, and the rollout scores 0, not masked."""
    root = tmp_path / "pyfix-root"
    shutil.copytree(PYFIX, root, ignore=shutil.ignore_patterns("__pycache__"))
    task = root / "tasks" / f"{TASK}.json"
    steps = [s for s in json.loads(task.read_text()) if s["id"] != "judge"]
    steps[-1].update(user="root", command="python3 -m unittest discover -s tests")
    task.write_text(json.dumps(steps))
    loaded = agentenv.Bundle.load(root)
    index = [t.name for t in loaded.splits["all"]].index(TASK)
    with serving(root, tmp_path / "served", sandbox="docker") as server:
        async def play():
            async with client(240) as http:
                gym = Gym(server, gym_row(loaded, index, "all", TOOLS), http)
                await gym.seed()
                await gym.call("bash", command="printf 'import os\\nos.kill(1, 9)\\nos.system(\"kill -9 -1\")\\n'"
                                               " > tests/test_000.py")
                return (await gym.verify("Done.")).json(), (await honest(server, http, gym.row))[0]
        verdict, sibling = run(play(), 300)
    assert (verdict["reward"], verdict["mask_sample"], verdict.get("failure_kind")) == (0.0, False, None)
    assert (sibling["reward"], sibling["mask_sample"]) == (1.0, False), sibling


# ================================================================ a verifier's output paths

OUT, VERDICT = "/tmp/out", "/tmp/verdict"
RESULT, REWARD = f"{OUT}/result.json", f"{VERDICT}/reward.txt"
# bsearch judged as many bundles judge: the judge's exit code into a result file, and the reward
# worked out from that file into a file of its own; each folder made by the verifier, in /tmp,
# where root (who may override no permission in the box) can write too, and so can the model
JUDGE_TO_FILES = (
    f"mkdir -p {OUT} {VERDICT}; python3 -I -S /tmp/pyfix-verify/run_tests.py /app/{TASK}.py "
    f"/tmp/pyfix-verify/test_{TASK}.py >/dev/null 2>&1; printf '{{\"exit\": %d}}\\n' $? > {RESULT}; "
    f"if head -c 64 {RESULT} | grep -qx '{{\"exit\": 0}}'; then echo 1; else echo 0; fi > {REWARD}")


def read_only(path: str, plant: str) -> str:
    """The model's commands: ``plant`` at ``path``, then its folder made read-only."""
    folder = path.rsplit("/", 1)[0]
    return f"mkdir -p {folder} && {plant} && chmod 555 {folder}"


# name -> (the model's commands, whether the verifier's own command, as the model runs it after
# them, leaves a reward of 1 or more: a forgery a verifier that reads what stands there would pay)
OUTPUT_HACKS: dict[str, tuple[list[str], bool]] = {
    "a reward planted, read-only in a read-only folder": (
        [read_only(REWARD, f"echo 1 > {REWARD} && chmod 444 {REWARD}")], True),
    "a result planted, read-only in a read-only folder": (
        [read_only(RESULT, f"printf '{{\"exit\": 0}}\\n' > {RESULT} && chmod 444 {RESULT}")], True),
    "a link at the reward path to a file that holds 1": (
        [read_only(REWARD, f"echo 1 > /app/one && chmod 444 /app/one && ln -s /app/one {REWARD}")],
        True),
    "a link at the reward path to a number of root's": (
        [read_only(REWARD, f"ln -s /etc/debian_version {REWARD}")], True),
    "a FIFO at the reward path": ([read_only(REWARD, f"mkfifo {REWARD}")], False),
    "a sparse 4 GiB result file": (
        [read_only(RESULT, f"truncate -s 4G {RESULT} && chmod 444 {RESULT}")], False),
    # the code under test, run by the verifier, as its user: what it leaves is read as it stands
    "the module makes the result file 4 GiB": ([prepend(
        f"import os; open({RESULT!r}, 'a').close(); os.truncate({RESULT!r}, 4 << 30); "
        f"os.chmod({RESULT!r}, 0o444)")], False),
    "the module links the reward path to a number of root's": ([prepend(
        f"import os; os.symlink('/etc/debian_version', {REWARD!r})")], False),
}


def outputs_bundle(folder: Path) -> Path:
    """pyfix-v1 with bsearch judged to files (JUDGE_TO_FILES, reward_path and result_paths), run
    as the agent, and as root in the task bsearch-root."""
    root = copy_bundle(folder / "pyfix-outputs", PYFIX)
    task = root / "tasks" / f"{TASK}.json"
    steps = json.loads(task.read_text())
    steps[-1].update(command=JUDGE_TO_FILES, reward_path=REWARD, result_paths=[RESULT])
    task.write_text(json.dumps(steps))
    steps[-1].update(user="root")
    (root / "tasks" / f"{TASK}-root.json").write_text(json.dumps(steps))
    return root


def played_over_ws(server, index: int, commands: list[str]) -> tuple[list[str], dict, float, int]:
    """A rollout of the task at ``index`` over /ws: ``commands`` with bash, then end_turn. What
    each command answered, the last step's data, how long the end_turn (the verify) took and the
    size of the frame that carried it."""
    with Socket(server.ws_url + "/ws") as ws:
        ws.ask({"type": "reset", "data": {"split": "all", "index": index}}, 120)
        said = []
        for command in commands:
            observation = ws.ask({"type": "step", "data": {
                "type": "call_tool", "tool_name": "bash", "arguments": {"command": command}}},
                120)["data"]["observation"]
            said.append((observation.get("result") or {}).get("data") or
                        (observation.get("error") or {}).get("message", ""))
        started = time.monotonic()
        ws.send({"type": "step", "data": {"type": "call_tool", "tool_name": "end_turn",
                                          "arguments": {"response": "Done."}}})
        frame = ws.ws.recv(timeout=240)
        return said, json.loads(frame)["data"], time.monotonic() - started, len(frame)


def test_a_verifiers_output_paths_are_the_runtimes(tmp_path, no_box_left, docker_client):
    """A verifier that writes its reward and its result to files, run as the agent and as root:
    the model plants a reward or a result (read-only, in a folder it made read-only, so neither a
    removal nor the verifier's own write can touch it), a link or a FIFO at the reward path, a
    sparse 4 GiB result file; or its module, run by the verifier, makes the result file 4 GiB or
    links the reward path to a number of root's. Each scores 0.0, never masked, its verify well
    within the verifier's 60 s, its record at most RESULT_FILE_CAP of any file; each forgery is
    first shown to leave a reward of 1 or more when the model runs the verifier's command itself.
    The honest siblings (one as the agent, one as root, beside each batch) score 1.0 in time."""
    root = outputs_bundle(tmp_path)
    loaded = agentenv.Bundle.load(root)
    names = [t.name for t in loaded.splits["all"]]
    as_agent, as_root = names.index(TASK), names.index(f"{TASK}-root")
    show = f"bash -c {shlex_quote(JUDGE_TO_FILES)}; echo reward=$(cat {REWARD})"
    probes = [(f"{name} (as {who})", index, [*commands, *[show][:shown]], shown)
              for name, (commands, forged) in OUTPUT_HACKS.items()
              for who, index in (("agent", as_agent), ("root", as_root))
              for shown in [forged and who == "agent"]]   # (root's command the model can't run)
    cap = agentenv.RESULT_FILE_CAP
    with serving(root, tmp_path / "served", "--max-concurrent-envs", "6", sandbox="docker") as server:
        async def battery():
            results, siblings = {}, []
            for at in range(0, len(probes), 4):
                batch = probes[at:at + 4]
                played = await asyncio.gather(
                    *(asyncio.to_thread(played_over_ws, server, index, [fix()])
                      for index in (as_agent, as_root)),
                    *(asyncio.to_thread(played_over_ws, server, index, commands)
                      for _, index, commands, _ in batch))
                siblings += played[:2]
                results.update({probe[0]: (probe, outcome) for probe, outcome in zip(batch, played[2:])})
            return results, siblings
        results, siblings = run(battery(), 1200)
        masked = metric(server, "agentenv_masked_rollouts_total")
        log = server.log()
    for name, ((_, _, _, forged), (said, ended, took, size)) in results.items():
        metadata = ended["observation"]["metadata"]
        assert (ended["done"], ended["reward"]) == (True, 0.0), (name, ended)
        assert "failure_kind" not in metadata and metadata.get("status") != "error", (name, metadata)
        if forged:                          # a real forgery: the verifier's command pays it
            assert float(said[-1].split("reward=")[1].split()[0]) >= 1, (name, said)
        assert took < 30, (name, took)      # within half the verifier's deadline, at load 8 too
        # (a NUL is six characters of JSON, and OpenEnv's frame carries the metadata twice)
        assert size < 16 * cap, (name, size)
        for path, kept in metadata["verifications"]["unit-tests"]["extracted_files"].items():
            assert kept is None or isinstance(kept, (int, float, dict)) or \
                len(kept) <= cap + 100, (name, path, len(kept))
    cut = results["the module makes the result file 4 GiB (as agent)"][1][1]
    kept = cut["observation"]["metadata"]["verifications"]["unit-tests"]["extracted_files"][RESULT]
    assert kept.endswith(f"[cut: the file holds {4 << 30} bytes; the record keeps its first {cap}]")
    linked = results["the module links the reward path to a number of root's (as agent)"][1][1]
    assert linked["observation"]["metadata"]["verifications"]["unit-tests"]["results"][0][
        "message"].startswith(f"reward file {REWARD!r} is a link, not a regular file")
    for name, (_, (_, ended, _, _)) in results.items():    # every file read that stood there
        message = ended["observation"]["metadata"]["verifications"]["unit-tests"]["results"][0]
        assert "could not be read" not in message["message"], (name, message)
    for _, ended, took, _ in siblings:
        assert (ended["done"], ended["reward"]) == (True, 1.0), ended
        assert ended["observation"]["metadata"]["verifications"]["unit-tests"][
            "extracted_files"] == {RESULT: {"exit": 0}, REWARD: 1}, ended
        assert took < 60, took
    assert masked == 0
    assert "Traceback" not in log, log[-3000:]


# ================================================================ the agent's processes, stopped

def test_the_agents_processes_are_stopped_before_the_next_command_starts(tmp_path, no_box_left,
                                                                        docker_client):
    """The box's keeper is slow to act on the signal that stops every process of the agent's
    (held stopped from the host, as a loaded machine may leave it unscheduled): stopping them does
    not end until the keeper has acted, so its kill never lands on the command that follows (a
    verifier reading what it found, as root: before, killed, and its result lost)."""
    loaded = agentenv.Bundle.load(PYFIX)

    async def play():
        settings = agentenv.Settings.of(sandbox="docker")
        async with agentenv.Runtime(loaded, settings) as runtime:
            episode = runtime.episode(loaded.tasks[TASK])
            await episode.next_turn()
            box = episode.agent_box
            keeper = box.container.attrs["State"]["Pid"]

            async def read_after(stopping: asyncio.Future) -> agentenv.Ran:
                await stopping
                return await box.run(["sh", "-c", "sleep 3; echo read"], 30, root=True)
            os.kill(keeper, signal.SIGSTOP)
            try:
                stopping = asyncio.ensure_future(box.stop_all())
                reading = asyncio.ensure_future(read_after(stopping))
                await asyncio.sleep(1)
                waited = not stopping.done()
            finally:
                os.kill(keeper, signal.SIGCONT)
            after = await reading
            await episode.abandon("done")
            return waited, after
    waited, after = run(play(), 120)
    assert (after.exit_code, after.stdout) == (0, b"read\n"), after
    assert waited
