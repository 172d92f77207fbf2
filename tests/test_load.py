"""Load: many episodes at once, and thousands in a row, through both surfaces of ``serve``.

Every server here is ``python agentenv.py serve bundles/notes-v1 --sandbox local --port P
--max-concurrent-envs N`` in a subprocess (``sys.executable``: signals to pyenv's shim would not
reach the server) with its own ``AGENTENV_STATE_DIR``. Every rollout plays the task
``save-groceries``: deploy its notebook env, ``write_note`` a groceries note with a text no other
rollout writes, ``read_note`` it back (so each rollout shows its env is its own), end the turn,
and be scored 1.0 by the bundle's own verifier (``check_notes``, which reads the env over MCP).

* ``test_*_live_at_once``: AGENTENV_LOAD_LIVE (256) rollouts seeded (Gym) or reset (OpenEnv, with
  openenv 0.10's GenericEnvClient) together, each holding a live env at the same moment (counted
  after every one has written and none has verified: the server's child processes, and the local
  sandbox's records), then each reads back and is scored, unmasked. Meanwhile /health is asked
  every 0.25 s and must answer within 8 s: 256 envs booting at once once starved the server 11 s.
* ``test_*_episodes_in_waves_*``: AGENTENV_LOAD_EPISODES rollouts with the pool at 64, sent in
  waves of 128 (so half of every wave waits for a slot; OpenEnv over raw /ws, at most 64 sessions
  at once), each scored; at most 64 env processes at any moment (sampled every 0.1 s); afterwards
  the server's RSS and open fds back at their level after a warm-up wave of 128, and no env
  process left (by the server's children and by a /proc scan for its state dir).

What "back at its level" means (the tolerance, and why):
* fds: equal. Every socket to an env, every pipe from one, and every client connection is closed
  once its rollout is; the client of this test closes its own connections before the count.
* RSS, measured with the server idle after a warm-up wave of 128: a leak grows with the episodes,
  so the bound that catches one is on the second half of the run: at most SECOND_HALF_MIB (8 MiB),
  which over the 2,500 episodes of the full scale is 3.3 KiB an episode, less than any one of an
  episode's objects (its Episode, Turn, tool list, tasks, subprocess transport) holds. The whole
  run may add up to LEAK_TOLERANCE_MIB (32 MiB): RSS climbs after the warm-up and then levels off
  (what the allocator keeps of its high-water mark, and the last 2,048 Gym verdicts the server
  keeps on purpose for retried /verify). Measured at 5,000: +13.0 then +1.5 MiB (Gym), +22.5 then
  +2.0 MiB (OpenEnv), while tracemalloc in the server counts only +1 MB of Python objects over
  1,500 episodes. At the default 500 episodes the second-half bound is 33 KiB an episode: run the
  full scale to catch less.

Measured on this 2-core machine (shared with other test runs, so somewhat slow), full scale,
agentenv.py as of 0a2c4e2 (the live rows since envs boot a few at a time):

    test                                   wall      episodes/s  RSS MiB                        fds
    gym, 256 live at once                  20 s      12.9        48.1 idle, 74.8 live           7
    openenv, 256 live at once (client)     17 s      14.7        48.2 idle, 107.0 live          7
    gym, 5,000 in waves (pool 64)          433 s     11.5        65.4 -> 78.4 (mid) -> 79.9     7 -> 7
    openenv, 5,000 in waves (pool 64)      465 s     10.8        62.5 -> 85.0 (mid) -> 87.0     7 -> 7

Since then the wave rows changed: see README "Reliability and security" (at 5,000 episodes RSS
now grows past the bounds above from glibc's per-thread malloc arenas, unless serve runs with
MALLOC_ARENA_MAX=2; at the default 500 the bounds hold).

The cost is an env process start (a fresh CPython) per episode. So the full scale (16 min) is over
the CI budget, and the defaults keep the module at about 3 min:

    AGENTENV_LOAD_EPISODES   episodes per wave test (default 500; the issue's figure is 5,000)
    AGENTENV_LOAD_LIVE       rollouts live at once (default 256)

The full-scale run:

    AGENTENV_LOAD_EPISODES=5000 python -m pytest tests/test_load.py -q -s

Each test prints its figures (one ``load:`` line: episodes, outcomes, wall time, episodes/s, RSS
and fds before and after, peak env processes); run pytest with ``-s`` to see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest


from tests.harness import Gym, NOTES, REPO, Server, alive, client, gym_row, run, running, wait_until

SAVE = 1                                          # save-groceries, in the split "all"
NOTES_TOOLS = ["write_note", "read_note", "list_notes", "end_turn"]

LIVE = int(os.environ.get("AGENTENV_LOAD_LIVE") or 256)
EPISODES = int(os.environ.get("AGENTENV_LOAD_EPISODES") or 500)
POOL = 64
WAVE = 2 * POOL
WARM_UP = WAVE
LEAK_TOLERANCE_MIB = 32
SECOND_HALF_MIB = 8


# ================================================================ the server, as a process

class Serve(Server):
    """``agentenv.py serve`` (local sandbox) as a subprocess, with its memory, fds and env processes
    (its child processes, found through /proc/<pid>/task/*/children)."""

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def children(self) -> set[int]:
        """The server's live child processes (its env processes; zombies left out)."""
        found: set[int] = set()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{self.pid}/task"):
                with contextlib.suppress(OSError):
                    found.update(int(p) for p in
                                 Path(f"/proc/{self.pid}/task/{task}/children").read_text().split())
        return {pid for pid in found if alive(pid)}

    def idle(self, timeout: float = 30) -> None:
        """Wait until the server runs no env process and holds no record of one."""
        wait_until(lambda: not self.children() and not self.records(), timeout,
                   "every env process of the server is torn down")

    def steady_fds(self, still: float = 1.0, timeout: float = 20) -> int:
        """The server's fd count once it has not changed for ``still`` seconds."""
        deadline = time.monotonic() + timeout
        count, since = self.fds(), time.monotonic()
        while time.monotonic() - since < still and time.monotonic() < deadline:
            time.sleep(0.1)
            if (now := self.fds()) != count:
                count, since = now, time.monotonic()
        return count

    def settled(self, fds: int, timeout: float = 20) -> int:
        """The server's fd count, once it is back to ``fds`` (or what it is after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self.fds() != fds and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.fds()


def serving(folder: Path, *flags: str):
    return running(Serve.serve(NOTES, folder, *flags))


class Peak:
    """Samples the server's env processes in a thread while a run goes on: the most at once."""

    def __init__(self, server: Serve, period: float = 0.1):
        self.server, self.period = server, period
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, len(self.server.children()))
            self._stop.wait(self.period)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Heartbeat:
    """Asks the server's /health every 0.25 s in a thread while a run goes on: the slowest answer.
    A client's connect must not time out (openenv's client gives up after 10 s) while envs boot."""

    BOUND_S = 8.0                 # below the 10 s openenv's client waits to connect

    def __init__(self, server: Serve):
        self.server, self.slowest = server, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            started = time.monotonic()
            with urllib.request.urlopen(self.server.url + "/health", timeout=120) as answer:
                answer.read()
            self.slowest = max(self.slowest, time.monotonic() - started)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        assert self.slowest < self.BOUND_S, \
            f"/health took {self.slowest:.1f}s to answer while envs booted: the server starved"


def report(test: str, **figures) -> None:
    """One line of figures, for the README (shown with pytest -s)."""
    print(f"\nload: {test}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


# ================================================================ rollouts

def save_row() -> dict:
    """The row of save-groceries, its tools offered."""
    row = gym_row(NOTES, SAVE, tools=NOTES_TOOLS)
    assert row["task_id"].rsplit("/", 1)[1] == "save-groceries"
    return row


# Every client here has no connection limit (every rollout at once) and no cookie jar: cookies
# travel by hand, as Gym's do.
UNLIMITED = {"timeout": 900, "limit": 0}


class GymRollout(Gym):
    """One rollout on the Gym surface: seed; write its own groceries note (a text no other rollout
    writes) and read it back, which shows the env is its own; verify."""

    count = 0

    def __init__(self, http: aiohttp.ClientSession, base: str, row: dict):
        super().__init__(base, row, http, strict=True)
        GymRollout.count += 1
        self.text = f"eggs and milk, for rollout {GymRollout.count}"
        self.isolated: bool | None = None          # its note read back as written

    async def write(self) -> str:
        return (await self.call("write_note", title="groceries", text=self.text)).text

    async def read(self) -> None:
        text = (await self.call("read_note", title="groceries")).text
        self.isolated = None if text.startswith("error") else text == self.text

    async def verified(self) -> dict:
        return {**(await self.verify("Saved.")).json(), "isolated": self.isolated}

    async def play(self) -> dict:
        await self.seed()
        written = await self.write()
        await self.read()
        verified = await self.verified()
        if not verified["mask_sample"]:
            assert written == "saved note 'groceries'", written
        return verified


def scored(verified: dict) -> bool:
    return verified["reward"] == 1.0 and verified["mask_sample"] is False and \
        verified["failure_reason"] is None


# Two launches under way at once were once handed the same port (the env binding second died,
# or, before 0a2c4e2, its rollout played on the other's env). Fixed: a port is reserved before the
# spawn. A rollout failing that way ("port race") is counted apart so a return of the bug is named,
# and is never tolerated; a rollout played on another's env ("shared env") neither.


def port_race(failure: str | None) -> bool:
    """A failure the port race made: the env's bind failed."""
    return bool(failure) and "did not come up" in failure and (
        "Address already in use" in failure or
        failure.rstrip().endswith("its process exited with code 1. Its last output:"))


class OpenEnvRollout:
    """One rollout on the OpenEnv surface over a raw /ws: reset; step write_note (its own text) and
    read_note; step end_turn, which answers the reward."""

    refused = 0                        # CAPACITY_REACHED answers seen (and retried), all rollouts
    count = 0

    def __init__(self, http: aiohttp.ClientSession, base: str):
        self.http, self.ws_url = http, base.replace("http://", "ws://") + "/ws"
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        OpenEnvRollout.count += 1
        self.text = f"eggs and milk, for session {OpenEnvRollout.count}"

    async def ask(self, message: dict) -> dict:
        assert self.ws is not None
        await self.ws.send_json(message)
        return await self.ws.receive_json(timeout=120)

    async def reset(self) -> dict:
        delay = 0.05
        while True:
            self.ws = await self.http.ws_connect(self.ws_url, max_msg_size=2**24)
            reply = await self.ask({"type": "reset", "data": {"split": "all", "index": SAVE}})
            if reply["type"] != "error" or reply["data"].get("code") != "CAPACITY_REACHED":
                break
            # the slot of a session just closed frees a moment after its socket has: OpenEnv's
            # clients retry, as this one does (and the count is reported)
            OpenEnvRollout.refused += 1
            await self.ws.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        assert reply["type"] == "observation", reply
        return reply

    async def tool(self, name: str, **arguments) -> dict:
        return (await self.ask({"type": "step", "data": {
            "type": "call_tool", "tool_name": name, "arguments": arguments}}))["data"]

    async def play(self) -> dict:
        reset = await self.reset()
        assert self.ws is not None
        if reset["data"]["done"]:                   # the deploy failed: the episode is over
            await self.ws.close()
            return reset["data"]
        written = await self.tool("write_note", title="groceries", text=self.text)
        read = await self.tool("read_note", title="groceries")
        final = await self.tool("end_turn", response="Saved.")
        await self.ws.send_json({"type": "close"})
        await self.ws.close()
        if final.get("done") and final.get("reward") == 1.0:
            assert written["observation"]["result"]["data"] == "saved note 'groceries'", written
        text = (read["observation"].get("result") or {}).get("data")
        return {**final, "isolated": None if text is None else text == self.text}


def outcome_of(result: dict) -> str:
    """'scored' (reward 1.0, not failed, on an env of its own), 'port race' (the known bug above)
    or 'failed', for a Gym verify reply or an OpenEnv final observation."""
    if "mask_sample" in result:                                       # Gym
        good, failure = scored(result), result["failure_reason"]
    else:
        metadata = (result.get("observation") or {}).get("metadata") or result.get("metadata") or {}
        good = result.get("done") is True and result.get("reward") == 1.0 and \
            metadata.get("status") != "error"
        failure = metadata.get("error")
    if result.get("isolated") is False:           # its env was another rollout's too
        return "failed"
    if good:
        return "scored"
    return "port race" if port_race(failure) else "failed"


def tally(results: list[dict]) -> dict[str, int]:
    """How many rollouts of each outcome; "shared env" counts those (in "failed") whose note read
    back was another rollout's."""
    counts = {"scored": 0, "port race": 0, "failed": 0, "shared env": 0}
    for result in results:
        counts[outcome_of(result)] += 1
        counts["shared env"] += result.get("isolated") is False
    return counts


def check_tally(counts: dict[str, int], results: list[dict]) -> None:
    failed = [r for r in results if outcome_of(r) == "failed"]
    assert not failed, f"{len(failed)} rollouts not scored, e.g. {failed[:2]}"
    assert counts["port race"] == 0, f"envs were handed a port already taken: {counts}"


# ================================================================ 1. many live at once

def test_gym_rollouts_live_at_once_each_scored(tmp_path):
    """AGENTENV_LOAD_LIVE rollouts seeded at once on serve's Gym surface, all holding a live env
    at the same moment (each has written its note, none has verified), then each reads its note
    back and is verified: every one scored 1.0, unmasked, on an env of its own."""
    with serving(tmp_path, "--max-concurrent-envs", str(LIVE)) as server:
        rss0, fds0 = server.rss_kib(), server.fds()
        row = save_row()

        async def go():
            async with client(**UNLIMITED) as http:
                rollouts = [GymRollout(http, server.url, row) for _ in range(LIVE)]
                started = time.monotonic()
                await asyncio.gather(*(r.seed() for r in rollouts))
                seeded = time.monotonic() - started
                written = await asyncio.gather(*(r.write() for r in rollouts))
                called = time.monotonic() - started
                # every rollout has deployed and written, and none has verified: all live now
                live, records = len(server.children()), len(server.records())
                rss_live = server.rss_kib()
                await asyncio.gather(*(r.read() for r in rollouts))
                verified = await asyncio.gather(*(r.verified() for r in rollouts))
                return seeded, called, time.monotonic() - started, written, live, records, \
                    rss_live, verified

        with Heartbeat(server) as heartbeat:
            seeded, called, wall, written, live, records, rss_live, verified = run(go(), 600)
        counts = tally(verified)
        check_tally(counts, verified)
        deployed = sum(w == "saved note 'groceries'" for w in written)
        assert all(w == "saved note 'groceries'" for w, v in zip(written, verified)
                   if outcome_of(v) == "scored")
        # (an env hit by the port race is dead, or is another rollout's: it is not counted live)
        assert LIVE - counts["port race"] <= live <= records <= deployed, (live, records, deployed)
        server.idle()
        report("gym live at once", episodes=LIVE, scored=counts["scored"],
               port_race=counts["port race"], shared_env=counts["shared env"],
               live_envs_at_once=live,
               seed_s=f"{seeded:.1f}", all_deployed_and_written_s=f"{called:.1f}",
               wall_s=f"{wall:.1f}", episodes_per_s=f"{LIVE / wall:.1f}",
               rss_mib_idle=f"{rss0 / 1024:.1f}", rss_mib_live=f"{rss_live / 1024:.1f}",
               fds_idle=fds0, slowest_health_s=f"{heartbeat.slowest:.2f}")


def test_openenv_sessions_live_at_once_each_scored(tmp_path):
    """AGENTENV_LOAD_LIVE OpenEnv sessions reset at once with openenv 0.10's GenericEnvClient
    (async), all holding a live env at the same moment (each has written its note), then each
    reads its note back and ends its turn: every one done with reward 1.0, on an env of its own."""
    pytest.importorskip("openenv", reason="this test drives serve with openenv 0.10's client: "
                                          "pip install -e '.[test]'")
    from openenv.core.generic_client import GenericEnvClient

    def step(name: str, **arguments) -> dict:
        return {"type": "call_tool", "tool_name": name, "arguments": arguments}

    with serving(tmp_path, "--max-concurrent-envs", str(LIVE)) as server:
        rss0, fds0 = server.rss_kib(), server.fds()

        def final(result, isolated=None) -> dict:
            return {"done": result.done, "reward": result.reward, "observation": result.observation,
                    "isolated": isolated}

        async def go():
            clients = [GenericEnvClient(base_url=server.url, message_timeout_s=120)
                       for _ in range(LIVE)]
            texts = [f"eggs and milk, for client {n}" for n in range(LIVE)]
            try:
                started = time.monotonic()
                resets = await asyncio.gather(*(c.reset(split="all", index=SAVE) for c in clients))
                reset_s = time.monotonic() - started
                playing = [(c, t) for c, t, r in zip(clients, texts, resets) if r.done is False]
                failed = [final(r) for r in resets if r.done is not False]   # deploys that failed
                writes = await asyncio.gather(*(c.step(step("write_note", title="groceries", text=t))
                                                for c, t in playing))
                # every session has reset and written, and none has ended its turn: all live now
                live, records = len(server.children()), len(server.records())
                rss_live = server.rss_kib()
                reads = await asyncio.gather(*(c.step(step("read_note", title="groceries"))
                                               for c, _ in playing))
                ends = await asyncio.gather(*(c.step(step("end_turn", response="Saved."))
                                              for c, _ in playing))
                read = [(r.observation.get("result") or {}).get("data") for r in reads]
                isolated = [None if text is None else text == t for text, (_, t) in zip(read, playing)]
                return reset_s, time.monotonic() - started, writes, live, records, rss_live, \
                    [final(e, i) for e, i in zip(ends, isolated)] + failed
            finally:
                await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

        with Heartbeat(server) as heartbeat:
            reset_s, wall, writes, live, records, rss_live, finals = run(go(), 600)
        counts = tally(finals)
        check_tally(counts, finals)
        assert all(w.observation["result"]["data"] == "saved note 'groceries'" for w in writes)
        assert LIVE - counts["port race"] <= live <= records <= len(writes), \
            (live, records, len(writes))
        server.idle()
        report("openenv live at once", episodes=LIVE, scored=counts["scored"],
               port_race=counts["port race"], shared_env=counts["shared env"],
               live_envs_at_once=live,
               all_reset_s=f"{reset_s:.1f}", wall_s=f"{wall:.1f}",
               episodes_per_s=f"{LIVE / wall:.1f}", rss_mib_idle=f"{rss0 / 1024:.1f}",
               rss_mib_live=f"{rss_live / 1024:.1f}", fds_idle=fds0,
               slowest_health_s=f"{heartbeat.slowest:.2f}")


# ================================================================ 2. thousands in a row

def waves(server: Serve, play, label: str) -> None:
    """A warm-up wave, then EPISODES rollouts in waves of WAVE on a pool of POOL; checks every
    reward, the peak of env processes, and RSS, fds and env processes after the run."""
    async def wave(http: aiohttp.ClientSession, size: int) -> list[dict]:
        return await asyncio.gather(*(play(http) for _ in range(size)))

    async def warm() -> list[dict]:
        async with client(**UNLIMITED) as http:
            return await wave(http, WARM_UP)

    warm_up = run(warm(), 300)
    check_tally(tally(warm_up), warm_up)
    server.idle()
    fds0 = server.steady_fds()
    rss0 = server.rss_kib()
    samples: list[tuple[int, int]] = []           # (episodes so far, RSS KiB) after each wave

    async def go() -> tuple[int, list]:
        done, results = 0, []
        async with client(**UNLIMITED) as http:
            while done < EPISODES:
                size = min(WAVE, EPISODES - done)
                results += await wave(http, size)
                done += size
                samples.append((done, server.rss_kib()))
        return done, results

    with Peak(server) as peak:
        started = time.monotonic()
        done, results = run(go(), 3600)
        wall = time.monotonic() - started
    counts = tally(results)
    server.idle()
    leftover = server.env_pids()
    fds1 = server.settled(fds0)
    rss1 = server.rss_kib()
    mid = next(rss for n, rss in samples if n >= EPISODES // 2)
    report(label, episodes=EPISODES, scored=counts["scored"], port_race=counts["port race"],
           shared_env=counts["shared env"], failed=counts["failed"], pool=POOL, wave=WAVE,
           wall_s=f"{wall:.1f}",
           episodes_per_s=f"{EPISODES / wall:.1f}", peak_env_processes=peak.most,
           rss_mib_after_warm_up=f"{rss0 / 1024:.1f}", rss_mib_mid=f"{mid / 1024:.1f}",
           rss_mib_after=f"{rss1 / 1024:.1f}", fds_after_warm_up=fds0, fds_after=fds1,
           capacity_retries=OpenEnvRollout.refused)
    assert done == len(results) == EPISODES
    check_tally(counts, results)
    assert not leftover, f"env processes left after the run: {leftover}"
    assert 0 < peak.most <= POOL, peak.most
    assert fds1 == fds0, f"the server holds {fds1} fds after the run, {fds0} before it"
    assert rss1 - rss0 <= LEAK_TOLERANCE_MIB * 1024, \
        f"RSS grew by {(rss1 - rss0) / 1024:.1f} MiB over {EPISODES} episodes"
    assert rss1 - mid <= SECOND_HALF_MIB * 1024, \
        f"RSS grew by {(rss1 - mid) / 1024:.1f} MiB over the second half of the run"


def test_gym_episodes_in_waves_leave_no_trace(tmp_path):
    """AGENTENV_LOAD_EPISODES Gym rollouts (seed, write_note, read_note, verify) in waves of 128
    on a pool of 64: every one scored; RSS and fds back at their level; no env process left."""
    row = save_row()
    with serving(tmp_path, "--max-concurrent-envs", str(POOL)) as server:
        waves(server, lambda http: GymRollout(http, server.url, row).play(), "gym waves")


def test_openenv_episodes_in_waves_leave_no_trace(tmp_path):
    """AGENTENV_LOAD_EPISODES OpenEnv episodes over raw /ws (reset, step write_note and read_note,
    step end_turn) with at most 64 sessions at once: every one done with reward 1.0; RSS and fds
    back at their level; no env process left. A session refused at capacity (its slot frees a
    moment after its socket closes) is retried, as OpenEnv's clients retry."""
    OpenEnvRollout.refused = 0
    with serving(tmp_path, "--max-concurrent-envs", str(POOL)) as server:
        gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

        async def play(http):
            # at most POOL sessions at once (past it a new /ws is refused): of a wave of WAVE,
            # POOL play while the rest wait for one of them to end
            gate = gates.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(POOL))
            async with gate:
                return await OpenEnvRollout(http, server.url).play()

        waves(server, play, "openenv waves")


# ================================================================ 3. memory by slope

SLOPE_EPISODES = int(os.environ.get("AGENTENV_SLOPE_EPISODES") or 6000)
SLOPE_WARM_UP = 2000
SLOPE_BOUND = 12.0            # MiB per 10,000 episodes


def test_gym_memory_stays_flat_by_slope(tmp_path):
    """bench/soak.py's Gym run, short: 64 rollouts in flight on notes-v1 (seed, write_note,
    read_note, verify), RSS read with the server idle every 500 episodes. After 2,000 episodes of
    warm-up (the kept verdicts fill up at 2,048) the least-squares slope of RSS stays under 12 MiB
    per 10,000 episodes, and threads, fds and live envs stay flat. Measured on this machine over
    the same window: 36 MiB per 10,000 before the verifiers got loops of their own and readiness
    stopped reading the whole socket table (a thread and a loop per verification), 3 after.
    AGENTENV_SLOPE_EPISODES sets the run's length."""
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), "--episodes", str(SLOPE_EPISODES),
         "--every", "500", "--warm-up", str(SLOPE_WARM_UP), "--whole", "--json", str(out)],
        capture_output=True, text=True, timeout=3600, cwd=REPO)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    growth = result["growth_after_warm_up"]
    report("gym memory by slope", episodes=SLOPE_EPISODES, warm_up=SLOPE_WARM_UP,
           slope_mib_per_10k=result["slope_mib_per_10k"], rss_growth_mib=growth["rss_mib"],
           threads=growth["threads"], fds=growth["fds"], most_live_envs=result["most_live_envs"],
           wall_s=result["wall_s"])
    assert result["tallies"] == {"scored": SLOPE_EPISODES, "masked": 0, "failed": 0}, result["tallies"]
    assert result["slope_mib_per_10k"] <= SLOPE_BOUND, \
        f"RSS grows {result['slope_mib_per_10k']} MiB per 10,000 episodes after warm-up: " \
        f"{[(s['episodes'], s['rss_mib']) for s in result['samples']]}"
    assert growth["threads"] <= 1 and growth["fds"] == 0 and growth["children"] == 0, growth
