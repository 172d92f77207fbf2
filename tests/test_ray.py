"""The Ray sandbox (``--sandbox ray``, section 3): envs placed across a real Ray cluster.

A cluster of three nodes on this one machine: the head on 127.0.0.1, workers on 127.0.0.2 and
127.0.0.3, one CPU each, so an env bound to 127.0.0.1 where its node is .2 fails, and a fourth
env at once must wait for a placement. Ray's processes contact addresses outside the machine
even when bound to loopback, so this module runs only inside a fresh network namespace whose
only interface is loopback: run from the host, its one test re-executes the module there
(``LoopbackNamespace``) and reports what it found. It skips, saying why, where Ray is not
installed or no namespace can be made; with AGENTENV_REQUIRE_RAY=1 (CI) it fails instead.

Inside, the cluster and one ``serve --sandbox ray`` start once for the module: rows of notes-v1
play on both wires with envs on every node, more episodes than the cluster's CPUs wait and all
score, ``check`` prints the nodes and where its probe ran, and the faults (a host actor killed, an
env killed, a placement no node can meet, an unreachable cluster, and last a worker's raylet
killed) are each masked or refused with a reason; at the end nothing is left: no env process, no
host actor, no placement group. The whole module takes about two minutes here.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest


from tests.harness import (GRIDSIM, Gym, LoopbackNamespace, NOTES, NamespaceUnavailable,
                           NodeDockers, NodeDockersUnavailable, REPO, RayCluster, Server, alive,
                           client, copy_bundle, docker_unavailable, gym_rows, in_namespace,
                           ray_unavailable, resources_config, run, running, scrape, wait_until)

import agentenv

AGENTENV = REPO / "agentenv.py"
INSIDE = "AGENTENV_RAY_NAMESPACE"          # set in the namespace's run of this module
NODES = {"127.0.0.1", "127.0.0.2", "127.0.0.3"}
GROCERIES = {"title": "groceries", "text": "eggs and milk"}


if os.environ.get(INSIDE) != "1":
    def test_the_ray_suite_in_a_loopback_only_namespace(tmp_path):
        """Re-run this module inside a fresh loopback-only namespace, where Ray may run."""
        import importlib.util
        if importlib.util.find_spec("ray") is None:
            ray_unavailable("Ray is not installed: these tests need it; pip install -e '.[ray]'")
        try:
            namespace = LoopbackNamespace()
        except NamespaceUnavailable as exc:
            ray_unavailable(f"no loopback-only network namespace can be made here ({exc}): Ray "
                            "runs only in one; run the tests as root where unshare --net works")
        # Ray's state (its sessions, any auth token it writes) in folders of this test's own, never
        # the user's home; RAY_TMPDIR short, for Ray's socket paths
        home, ray_tmp = tmp_path / "home", Path(tempfile.mkdtemp(prefix="ae-ray-"))
        home.mkdir()
        try:
            argv = namespace.argv([sys.executable, "-m", "pytest", __file__, "-x", "-q", "-s", "-ra",
                                   "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inside'}"])
            started = time.monotonic()
            done = subprocess.run(argv, cwd=REPO, env={**os.environ, INSIDE: "1",
                                                       "RAY_USAGE_STATS_ENABLED": "0",
                                                       "HOME": str(home), "RAY_TMPDIR": str(ray_tmp)},
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=1200)
            print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
            print(f"the Ray suite ran in the namespace in {time.monotonic() - started:.1f}s")
            left = namespace.processes()
        finally:
            namespace.close()
            shutil.rmtree(ray_tmp, ignore_errors=True)
        assert done.returncode == 0, f"the Ray suite failed in its namespace:\n{done.stdout[-8000:]}"
        assert not left, f"processes left in the namespace after the suite: {left}"

else:
    # ============================================================ the cluster and the server

    @pytest.fixture(scope="module")
    def cluster(tmp_path_factory):
        # A Docker daemon per node first, each node's DOCKER_HOST its own; where none can be
        # started, a socket that does not exist, so no node reaches the host's daemon (whose
        # ports publish in another namespace than this one).
        started = time.monotonic()
        try:
            dockers, why_not = NodeDockers(3), ""
            print(f"3 node Docker daemons answered in {time.monotonic() - started:.1f}s")
        except NodeDockersUnavailable as exc:
            dockers, why_not = None, f"no Docker daemon could be started per Ray node: {exc}"
        hosts = {n: {"DOCKER_HOST": dockers.host(n) if dockers else "unix:///nonexistent.sock"}
                 for n in range(3)}
        started = time.monotonic()
        try:
            nodes = RayCluster(tmp_path_factory.mktemp("ray"), workers=2, cpus=1, node_env=hosts)
        except BaseException:
            if dockers:
                dockers.close()
            raise
        nodes.dockers, nodes.why_no_dockers = dockers, why_not
        print(f"the 3-node cluster started in {time.monotonic() - started:.1f}s")
        saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=nodes.env["RAY_AUTH_TOKEN"])
        yield nodes
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        killed = nodes.close()
        print(f"stopping the cluster, {len(killed)} process(es) of Ray had to be killed")
        if dockers:
            dockers.close()

    def ray_serve(cluster, bundle: Path, folder: Path, *flags: str) -> Server:
        """serve --sandbox ray on the cluster; its nodes run envs as local processes unless
        ``flags`` say --ray-node-sandbox."""
        node_sandbox = () if "--ray-node-sandbox" in flags else ("--ray-node-sandbox", "local")
        return Server([sys.executable, str(AGENTENV), "serve", str(bundle), "--sandbox", "ray",
                       "--ray-address", cluster.address, "--port", "{port}", *node_sandbox,
                       *flags], folder, ready_within=300)

    @pytest.fixture(scope="module")
    def server(cluster, tmp_path_factory):
        started = time.monotonic()
        with running(ray_serve(cluster, NOTES, tmp_path_factory.mktemp("serve"),
                               "--max-concurrent-envs", "8")) as served:
            print(f"serve --sandbox ray answered in {time.monotonic() - started:.1f}s")
            yield served
        assert_nothing_left(cluster, served)

    def hosts(server: Server) -> dict[int, str]:
        """The server's env processes and the address each is bound to (its node's)."""
        found = {}
        for pid in server.env_pids():
            try:
                environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ")
                               .read_bytes().decode(errors="replace").split("\0") if "=" in item)
            except OSError:
                continue
            found[pid] = environ.get("MCP_HOST", "")
        return found

    def host_actors(cluster) -> list[int]:
        return [pid for pid in in_namespace(cluster.inode)
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::EnvHost")]

    def placement_groups(cluster) -> dict[str, int]:
        """The cluster's placement groups by state, as a driver of its own reads them."""
        code = ("import collections, json, ray; ray.init(address=%r, log_to_driver=False); "
                "print(json.dumps(collections.Counter(g['state'] for g in "
                "ray.util.placement_group_table().values())))" % cluster.address)
        done = subprocess.run([sys.executable, "-c", code], env=cluster.env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def assert_nothing_left(cluster, served: Server, others: set[int] = frozenset()) -> None:
        """No env process (running() checked the records), no host actor (but ``others``, the
        hosts of a server still running), no live placement."""
        wait_until(lambda: set(host_actors(cluster)) <= others, 30, "every host actor has ended")
        groups = placement_groups(cluster)
        assert set(groups) <= {"REMOVED"}, groups

    async def gym_play(base: str, row: dict, http, before_verify=None) -> dict:
        rollout = Gym(base, row, http, strict=True)
        await rollout.seed()
        if before_verify:
            await before_verify(rollout)
        assert (await rollout.call("write_note", **GROCERIES)).text == "saved note 'groceries'"
        return (await rollout.verify()).json()

    async def ws_play(ws_url: str, index: int, http, split: str = "all", tool: str = "write_note",
                      arguments: dict = GROCERIES) -> dict:
        """A /ws session of ``split[index]``: reset, one call of ``tool``, end_turn; the last
        observation's data."""
        async with http.ws_connect(ws_url) as ws:
            await ws.send_json({"type": "reset", "data": {"split": split, "index": index}})
            reset = await ws.receive_json(timeout=120)
            assert not reset["data"]["done"], reset
            await ws.send_json({"type": "step", "data": {"type": "call_tool", "tool_name": tool,
                                                         "arguments": arguments}})
            await ws.receive_json(timeout=60)
            await ws.send_json({"type": "step", "data": {"type": "call_tool", "tool_name":
                                                         "end_turn", "arguments": {"response": "ok"}}})
            last = await ws.receive_json(timeout=120)
            await ws.send_json({"type": "close"})
            return last["data"]

    def save_at() -> int:
        return [t.name for t in agentenv.Bundle.load(NOTES).splits["all"]].index("save-groceries")

    # ============================================================ playing

    def test_rows_play_on_both_wires_with_envs_on_every_node(server):
        """Three Gym rollouts and three /ws sessions of notes-v1's save-groceries, three at a time
        (the cluster's three CPUs): each wave's envs are bound one to each node's own address,
        and every rollout is scored 1.0."""
        row = gym_rows(NOTES)["save-groceries"]
        seen: list[set[str]] = []

        async def wave_gym(http):
            rollouts = [Gym(server.url, row, http, strict=True) for _ in range(3)]
            await asyncio.gather(*(r.seed() for r in rollouts))
            # a seed answers at once; the first call waits for the deploy
            for reply in await asyncio.gather(*(r.call("list_notes") for r in rollouts)):
                assert reply.text == "(no notes)", reply.text
            seen.append(set(hosts(server).values()))
            for r in rollouts:
                assert (await r.call("write_note", **GROCERIES)).text == "saved note 'groceries'"
            return [(await r.verify()).json() for r in rollouts]

        async def go():
            async with client(180) as http:
                gym = await wave_gym(http)
                ws = await asyncio.gather(*(ws_play(server.ws_url + "/ws", save_at(), http)
                                            for _ in range(3)))
                return gym, ws

        gym, ws = run(go(), 300)
        assert seen == [NODES], f"the envs of one wave were bound to {seen}, not one per node"
        for body in gym:
            assert (body["reward"], body["mask_sample"]) == (1.0, False), body
        for data in ws:
            assert data["done"] is True and data["reward"] == 1.0, data
        placed = {line.split(" placed on Ray node ")[1].split(" ")[0]
                  for line in server.log().splitlines() if " placed on Ray node " in line}
        assert placed == NODES, placed

        async def scrape():
            async with client(30) as http, http.get(server.url + "/metrics") as resp:
                return await resp.text()
        from prometheus_client.parser import text_string_to_metric_families
        counted = {sample.labels["node"] for family in text_string_to_metric_families(run(scrape(), 60))
                   for sample in family.samples if sample.name == "agentenv_deploys_total"}
        assert counted >= NODES, f"/metrics counts deploys on the nodes {counted}, not on {NODES}"
        server.no_envs(30)

    def test_more_episodes_than_the_clusters_cpus_wait_and_none_fails(server):
        """Seven rollouts at once on three CPUs: Ray holds the placements past three, none fails,
        every one scores 1.0, and no more than three envs ever run at once."""
        row = gym_rows(NOTES)["save-groceries"]
        most = [0]

        async def watch(stop: asyncio.Event):
            while not stop.is_set():
                most[0] = max(most[0], len(server.env_pids()))
                await asyncio.sleep(0.1)

        async def go():
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop))
            async with client(300) as http:
                bodies = await asyncio.gather(*(gym_play(server.url, row, http) for _ in range(7)))
            stop.set()
            await watcher
            return bodies

        started = time.monotonic()
        bodies = run(go(), 400)
        print(f"7 rollouts on 3 CPUs in {time.monotonic() - started:.1f}s")
        assert [(b["reward"], b["mask_sample"]) for b in bodies] == [(1.0, False)] * 7, bodies
        assert 1 <= most[0] <= 3, f"{most[0]} envs ran at once on a cluster of 3 CPUs"
        server.no_envs(30)

    # ============================================================ faults

    def test_a_host_actor_killed_masks_its_rollouts_within_5s_and_its_node_serves_again(server):
        """SIGKILL the host actor of an env's node: the env dies with it (it had a parent-death
        signal), the rollout's next call is masked within 5 s of the kill, and the node's host,
        restarted by Ray, deploys the next rollouts there again."""
        row = gym_rows(NOTES)["save-groceries"]

        async def go():
            async with client(180) as http:
                victim = Gym(server.url, row, http, strict=True)
                await victim.seed()
                assert (await victim.call("list_notes")).text == "(no notes)"
                [(env, address)] = hosts(server).items()
                actor = int(Path(f"/proc/{env}/stat").read_text().rsplit(")", 1)[1].split()[1])
                assert Path(f"/proc/{actor}/cmdline").read_bytes().startswith(b"ray::EnvHost")
                os.kill(actor, signal.SIGKILL)
                killed = time.monotonic()
                wait_until(lambda: not alive(env), 5, "the env died with its host actor")
                after = (await victim.call("write_note", **GROCERIES)).text
                masked = (await victim.verify()).json()
                took = time.monotonic() - killed
                # the victim's teardown comes after its reply, and its placement holds the node's
                # CPU until it is done: the three may find that node free only after that
                wait_until(lambda: scrape(server.url).value("agentenv_episodes_live") == 0, 60,
                           "the victim's episode was torn down")
                # Three at once on three 1-CPU nodes take every node that is free. Ray hears of a
                # freed group's CPU a moment after its removal, so a burst may still find the
                # victim's node taken: up to three bursts, each after the one before is torn down.
                bursts = []
                for _ in range(3):
                    seen = len(server.log().splitlines())
                    bursts.append(await asyncio.gather(*(gym_play(server.url, row, http)
                                                         for _ in range(3))))
                    placed = [line for line in server.log().splitlines()[seen:]
                              if " placed on Ray node " in line]
                    if any(f" placed on Ray node {address} " in line for line in placed):
                        break
                    wait_until(lambda: scrape(server.url).value("agentenv_episodes_live") == 0, 60,
                               "the burst's episodes were torn down")
                return address, after, masked, took, bursts, placed

        address, after, masked, took, bursts, placed = run(go(), 300)
        assert after.startswith("error: the environment failed: write_note failed because the env "
                                "failed"), after
        assert masked["mask_sample"] is True and masked["failure_kind"] == "transport_peer_drop", masked
        assert took < 5, f"the rollout was masked {took:.1f}s after its host actor was killed"
        for again in bursts:
            assert [(b["reward"], b["mask_sample"]) for b in again] == [(1.0, False)] * 3, again
        assert any(f" placed on Ray node {address} " in line for line in placed), \
            f"none of {len(bursts)} bursts of 3 was placed on the killed host's node {address}: {placed}"
        print(f"the killed host's node served again in burst {len(bursts)} of 3")
        server.no_envs(30)

    def test_an_env_killed_masks_its_rollout_and_its_sibling_scores(server):
        row = gym_rows(NOTES)["save-groceries"]

        async def go():
            async with client(180) as http:
                victim, sibling = Gym(server.url, row, http, strict=True), \
                    Gym(server.url, row, http, strict=True)
                await victim.seed()
                assert (await victim.call("list_notes")).text == "(no notes)"
                [env] = hosts(server)
                await sibling.seed()
                assert (await sibling.call("list_notes")).text == "(no notes)"
                os.kill(env, signal.SIGKILL)
                wait_until(lambda: not alive(env), 5, "the killed env is dead")
                after = (await victim.call("write_note", **GROCERIES)).text
                assert (await sibling.call("write_note", **GROCERIES)).text == "saved note 'groceries'"
                return after, (await victim.verify()).json(), (await sibling.verify()).json()

        after, masked, scored = run(go(), 200)
        stopped = "env 'notebook' stopped: its process exited with code -9"
        assert stopped in after, after
        assert masked["failure_kind"] == "transport_peer_drop" and stopped in masked["failure_reason"]
        assert (scored["reward"], scored["mask_sample"]) == (1.0, False), scored
        server.no_envs(30)

    def test_a_placement_no_node_can_meet_fails_after_the_deploy_deadline(cluster, tmp_path):
        """A deploy_env step asking 64 CPUs of a cluster of 1-CPU nodes: its rollout is masked
        provider_unavailable after the deploy deadline (3 s), saying what it asked, what the
        nodes have and what to change; a rollout of another task meanwhile scores."""
        bundle = copy_bundle(tmp_path / "greedy-v1")
        task = json.loads((bundle / "tasks" / "save-groceries.json").read_text())
        task[0]["cpu"] = 64
        (bundle / "tasks" / "greedy.json").write_text(json.dumps(task))
        rows = gym_rows(bundle)
        with running(ray_serve(cluster, bundle, tmp_path / "serve", "--deploy-timeout", "3")) as served:
            async def go():
                async with client(180) as http:
                    started = time.monotonic()
                    greedy = Gym(served.url, rows["greedy"], http)
                    seeded, fine = await asyncio.gather(
                        greedy.post("/seed_session", greedy.row, cookie=None),
                        gym_play(served.url, rows["save-groceries"], http))
                    masked = (await greedy.verify()).json()
                    return seeded, time.monotonic() - started, fine, masked

            seeded, took, fine, masked = run(go(), 200)
            assert (fine["reward"], fine["mask_sample"]) == (1.0, False), fine
            assert masked["mask_sample"] is True, masked
            assert masked["failure_kind"] == "provider_unavailable", masked
            reason = masked["failure_reason"]
            for part in ("asks a Ray node for CPU 64", "127.0.0.2: CPU 1", "within 3s (the deploy "
                         "deadline)", "lower the deploy_env step's cpu or memory_mb"):
                assert part in reason, reason
            assert 3 <= took < 30, took
            served.no_envs(30)

    def test_an_unreachable_cluster_is_refused_at_start_naming_the_address_and_the_fix(tmp_path):
        started = time.monotonic()
        done = subprocess.run([sys.executable, str(AGENTENV), "serve", str(NOTES), "--sandbox", "ray",
                               "--ray-address", "127.0.0.1:1", "--port", "0"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert "no Ray cluster answers at 127.0.0.1:1" in done.stderr, done.stderr
        assert "ray start --head" in done.stderr and "--ray-address" in done.stderr, done.stderr
        assert time.monotonic() - started < 30
        checked = subprocess.run([sys.executable, str(AGENTENV), "check", str(NOTES), "--sandbox",
                                  "ray"], cwd=REPO, capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
        assert checked.returncode == 1 and "no Ray cluster answers at 127.0.0.1:1" in checked.stderr, \
            checked.stderr

    def test_check_prints_the_nodes_and_where_each_probe_ran(cluster, tmp_path):
        done = subprocess.run([sys.executable, str(AGENTENV), "check", str(NOTES), "--sandbox", "ray",
                               "--ray-address", cluster.address], cwd=REPO, capture_output=True,
                              text=True, timeout=300,
                              env={**os.environ, "AGENTENV_STATE_DIR": str(tmp_path / "state")})
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        assert f"nodes of the Ray cluster at {cluster.address}:" in lines, done.stdout
        for address in NODES:
            assert any(line.startswith(f"  {address}  ") and "CPU 1" in line for line in lines), \
                done.stdout
        [probe] = [line for line in lines if line.startswith("  notebook (3 tasks), played with ")]
        assert any(f" on notebook at {address} in " in probe for address in NODES), probe
        assert lines[-1] == "ok: every toolset deployed, and every env was torn down"

    def test_the_gym_resources_server_with_sandbox_ray_joins_the_cluster_gym_names(cluster, tmp_path):
        """The resources server as NeMo Gym starts it, in bundle: mode with sandbox: ray and no
        RAY_ADDRESS: it joins the cluster at the ray_head_node_address of Gym's config, and a
        rollout scores 1.0 on an env placed on a node of it."""
        config = resources_config("notes_v1", bundle=str(NOTES), sandbox="ray")
        config["ray_head_node_address"] = cluster.address          # as Gym passes it, top level
        assert "RAY_ADDRESS" not in os.environ
        with running(Server.gym(tmp_path, config)) as served:
            async def go():
                async with client(180) as http:
                    return await gym_play(served.url, gym_rows(NOTES)["save-groceries"], http)

            body = run(go(), 200)
            assert (body["reward"], body["mask_sample"]) == (1.0, False), body
            assert "envs in the ray sandbox" in served.log()
            assert any(f" placed on Ray node {address} " in served.log() for address in NODES)
            served.no_envs(30)


    # ============================================================ Docker on every node

    def node_dockers(cluster) -> NodeDockers:
        if cluster.dockers is None:
            docker_unavailable(cluster.why_no_dockers)
        return cluster.dockers

    def gridsim_plays():
        """Three eval tasks of gridsim-v1 with room to charge, each as a Gym row, its index in
        the eval split, and the optimal schedule (its baseline) for it."""
        import importlib.util
        spec = importlib.util.spec_from_file_location("gridsim_baselines", GRIDSIM / "baselines.py")
        baselines = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baselines)
        bundle = agentenv.Bundle.load(GRIDSIM)
        rows = gym_rows(bundle, "eval")
        plays = []
        for index, task in enumerate(bundle.splits["eval"]):
            prompt = json.loads(task.first_prompt[0])
            if prompt["battery"]["initial_charge_mwh"] < prompt["battery"]["capacity_mwh"]:
                plays.append((rows[task.name], index, baselines.optimal(prompt)))
            if len(plays) == 3:
                return plays
        raise AssertionError("gridsim-v1's eval split has fewer than 3 tasks with room to charge")

    async def gridsim_gym(base: str, play, http, deployed) -> dict:
        row, _, schedule = play
        rollout = Gym(base, row, http, strict=True)
        await rollout.seed()
        reply = await rollout.call("submit_schedule", schedule=schedule)
        assert "valid schedule recorded" in reply.text, reply.text
        await deployed()
        return (await rollout.verify()).json()

    async def notes_gym(base: str, row: dict, http, deployed) -> dict:
        rollout = Gym(base, row, http, strict=True)
        await rollout.seed()
        assert (await rollout.call("list_notes")).text == "(no notes)"
        await deployed()
        assert (await rollout.call("write_note", **GROCERIES)).text == "saved note 'groceries'"
        return (await rollout.verify()).json()

    def bundle_waves() -> dict[Path, tuple]:
        """For notes-v1 and gridsim-v1: how one Gym rollout (told when its env is up) and one /ws
        session of a row play, the i-th of a wave of three."""
        notes_at = save_at()
        notes_row = gym_rows(NOTES)["save-groceries"]
        grid = gridsim_plays()
        return {NOTES: (lambda url, i, http, deployed: notes_gym(url, notes_row, http, deployed),
                        lambda url, i, http: ws_play(url, notes_at, http)),
                GRIDSIM: (lambda url, i, http, deployed: gridsim_gym(url, grid[i], http, deployed),
                          lambda url, i, http: ws_play(url, grid[i][1], http, "eval",
                                                       "submit_schedule", {"schedule": grid[i][2]}))}

    def play_waves(cluster, bundle: Path, folder: Path, node_sandbox: str, runs_there: str,
                   envs_by_node) -> None:
        """serve ``bundle`` with --ray-node-sandbox ``node_sandbox``: each node says at start
        that its envs run ``runs_there``; three Gym rollouts play at once, and once each has
        its env ``envs_by_node(served)`` must count one on each node; then three /ws sessions;
        every one scores 1.0, envs were placed on every node, and no host is left after."""
        on_gym, on_ws = bundle_waves()[bundle]
        others = set(host_actors(cluster))           # the module's own server's
        started = time.monotonic()
        with running(ray_serve(cluster, bundle, folder, "--ray-node-sandbox", node_sandbox)) as served:
            print(f"{bundle.name}: serve with --ray-node-sandbox {node_sandbox} answered in "
                  f"{time.monotonic() - started:.1f}s")
            for address in NODES:
                [line] = [x for x in served.log().splitlines()
                          if f"Ray node {address} (1 CPUs, " in x]
                assert f"envs run there {runs_there}" in line and f"reached at {address}," in line, line
            counted: list[dict[str, int]] = []

            async def go():
                # the Gym rollouts wait, once each has its env, until the envs are counted
                ready, resume = asyncio.Barrier(4), asyncio.Barrier(4)

                async def deployed():
                    await ready.wait()
                    await resume.wait()

                async def count():
                    await ready.wait()
                    counted.append(await asyncio.to_thread(envs_by_node, served))
                    await resume.wait()

                async with client(240) as http:
                    *gym, _ = await asyncio.wait_for(asyncio.gather(
                        *(on_gym(served.url, i, http, deployed) for i in range(3)), count()), 300)
                    ws = await asyncio.gather(*(on_ws(served.ws_url + "/ws", i, http)
                                                for i in range(3)))
                    return gym, ws

            gym, ws = run(go(), 400)
            for body in gym:
                assert (body["reward"], body["mask_sample"]) == (1.0, False), body
            for data in ws:
                assert data["done"] is True and data["reward"] == 1.0, data
            assert counted == [dict.fromkeys(sorted(NODES), 1)], \
                f"{bundle.name}: the wave's envs by node were {counted}, not one on each"
            placed = {line.split(" placed on Ray node ")[1].split(" ")[0]
                      for line in served.log().splitlines() if " placed on Ray node " in line}
            assert placed == NODES, placed
        assert_nothing_left(cluster, served, others)

    def test_gridsim_rows_play_on_both_wires_with_local_envs_on_every_node(cluster, tmp_path):
        """gridsim-v1's rows as notes-v1's play above: local env processes, one bound to each
        node's address in a wave, every rollout scored 1.0 with the optimal schedule."""
        def bound(served: Server) -> dict[str, int]:
            return dict(collections.Counter(sorted(hosts(served).values())))
        play_waves(cluster, GRIDSIM, tmp_path, "local", "as local processes (--ray-node-sandbox "
                   "local)", bound)

    def test_docker_on_every_node_plays_both_bundles_on_both_wires(cluster, tmp_path):
        """A Docker daemon per node and --ray-node-sandbox auto: every node says at start that
        its envs run in containers of its own daemon; rows of notes-v1 and of gridsim-v1 play
        on both wires three at a time, each wave's containers one on each node's daemon and
        reached at that node's address, and all score 1.0; no container is left on any node."""
        dockers = node_dockers(cluster)

        def containers(served: Server) -> dict[str, int]:
            return {f"127.0.0.{n + 1}": len(dockers.containers(n, "agentenv.env")) for n in range(3)}
        for bundle in (NOTES, GRIDSIM):
            play_waves(cluster, bundle, tmp_path / bundle.name, "auto",
                       "in Docker containers", containers)
            assert [dockers.containers(n) for n in range(3)] == [[], [], []]

    def test_a_serve_killed_takes_its_containers_along_on_every_node(cluster, tmp_path):
        """SIGKILL a serve whose Docker envs live on all three nodes: its host actors end with
        its connection to the cluster, and each host's reaper removes that node's containers,
        within 30 s, with nothing of ours doing it."""
        dockers = node_dockers(cluster)
        others = set(host_actors(cluster))           # the module's own server's
        served = ray_serve(cluster, NOTES, tmp_path / "serve", "--ray-node-sandbox", "docker")
        try:
            row = gym_rows(NOTES)["save-groceries"]

            async def deployed():
                async with client(240) as http:
                    rollouts = [Gym(served.url, row, http, strict=True) for _ in range(3)]
                    await asyncio.gather(*(r.seed() for r in rollouts))
                    return [r.text for r in await asyncio.gather(*(r.call("list_notes")
                                                                   for r in rollouts))]

            assert run(deployed(), 300) == ["(no notes)"] * 3
            assert [len(dockers.containers(n)) for n in range(3)] == [1, 1, 1]
        finally:
            served.kill()
        killed = time.monotonic()
        wait_until(lambda: not any(dockers.containers(n) for n in range(3)), 30,
                   "every node's containers are removed after serve was killed")
        print(f"the killed serve's containers were gone from every node after "
              f"{time.monotonic() - killed:.1f}s")
        wait_until(lambda: set(host_actors(cluster)) <= others, 30, "every host actor has ended")


    def test_a_worker_raylet_killed_masks_only_its_rollouts_within_15s(cluster, server, monkeypatch):
        """SIGKILL the raylet of the node at 127.0.0.3 while a rollout lives on each node: that
        node's rollout is masked within 15 s (its host actor and env go with the node), the two on
        the other nodes score 1.0, and a rollout started afterwards scores on a node still up.
        (The last test of the module: the cluster has two nodes after it.)"""
        row = gym_rows(NOTES)["save-groceries"]

        async def go():
            async with client(180) as http:
                rollouts = [Gym(server.url, row, http, strict=True) for _ in range(3)]
                await asyncio.gather(*(r.seed() for r in rollouts))
                for reply in await asyncio.gather(*(r.call("list_notes") for r in rollouts)):
                    assert reply.text == "(no notes)", reply.text
                assert set(hosts(server).values()) == NODES
                by_host = {address: pid for pid, address in hosts(server).items()}
                [raylet] = [pid for pid in cluster.node_pids(2)
                            if b"/raylet" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]]
                os.kill(raylet, signal.SIGKILL)
                killed = time.monotonic()
                wait_until(lambda: not alive(by_host["127.0.0.3"]), 15, "the env on the dead node died")
                outcomes = await asyncio.gather(*(r.call("write_note", **GROCERIES) for r in rollouts))
                bodies = [(await r.verify()).json() for r in rollouts]
                took = time.monotonic() - killed
                after = await gym_play(server.url, row, http)
                return outcomes, bodies, took, after

        outcomes, bodies, took, after = run(go(), 300)
        masked = [b for b in bodies if b["mask_sample"]]
        scored = [b for b in bodies if not b["mask_sample"]]
        assert len(masked) == 1 and masked[0]["failure_kind"] == "transport_peer_drop", bodies
        assert [b["reward"] for b in scored] == [1.0, 1.0], bodies
        assert sum(o.text == "saved note 'groceries'" for o in outcomes) == 2, [o.text for o in outcomes]
        assert took < 15, f"the rollout on the dead node was masked {took:.1f}s after its raylet died"
        assert (after["reward"], after["mask_sample"]) == (1.0, False), after
        # (a live host removes its env's record a moment after the env's process has gone)
        wait_until(lambda: not server.env_pids() and all(
            agentenv.owner_alive(r.parent.name) is False for r in server.records().values()), 30,
            "no env process of the server is left, nor a record a live node host keeps")
        # The dead node's host could not remove its env's record; the next host on that node
        # sweeps it at its start, as here (on one machine the nodes share the state folder).
        left = server.records()
        assert len(left) == 1 and all(agentenv.owner_alive(r.parent.name) is False
                                      for r in left.values()), left
        monkeypatch.setenv("AGENTENV_STATE_DIR", str(server.state))
        agentenv.LocalSandbox(agentenv.owner_id()).kill_leftovers()
        assert not server.records()
