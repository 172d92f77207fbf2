"""ray_bench.py: envs placed across a Ray cluster (serve --sandbox ray) beside the local sandbox.

    python bench/ray_bench.py [--rounds 10] [--at-once 6] [--episodes 24] [--spread 120]
                              [--json bench/ray.json]

Ray's processes contact addresses outside the machine even when every node is bound to loopback,
so this script re-executes itself inside a fresh network namespace whose only interface is
loopback (``unshare --net``, then ``ip link set lo up``) and starts every Ray process there. It
stops each cluster's nodes by the pids of their ``ray start`` and then kills what is left of Ray
in that namespace, where nothing runs but what this run started. It needs root (unshare) and Ray
(pip install -e '.[ray]'). (Not bench/ray.py: run as a script, that name would shadow Ray itself.)

In one run, two clusters on this machine, one after the other, each declaring 6 CPUs in all:

1 node   the head on 127.0.0.1, declaring 6 CPUs;
3 nodes  the head on 127.0.0.1 and workers on 127.0.0.2 and 127.0.0.3, declaring 1, 2 and 3 CPUs.

Against each, ``agentenv.py serve bundles/notes-v1 --sandbox ray`` and, up at the same time,
``serve bundles/notes-v1 --sandbox local`` (both --max-concurrent-envs 16), measured in
interleaved rounds (the machine is shared: a change in its load then favours neither):

deploy    the deploy a Gym user waits for: save-groceries' /seed_session to its first tool call's
          answer (list_notes), then /close_session, each round once both servers are idle again;
          --rounds single deploys each, and --rounds rounds of --at-once deploys started together.
          p50/p95 of each, and ray / local at p50 (target: at most 1.5x).
episodes  --episodes whole rollouts (seed, list_notes, write_note, /verify scoring 1.0), --at-once
          at a time: episodes/s. The nodes share this machine's cores, so this is reported, not
          targeted.
spread    (3 nodes) --spread rollouts with twice the cluster's CPUs in flight, so Ray always holds
          placements back and places each as a CPU frees: deploys by node as serve's /metrics
          counts them (agentenv_deploys_total by node, the difference across the phase) beside
          each node's share of the CPUs declared (target: every node within 10% of its share).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTES = ROOT / "bundles" / "notes-v1"
INSIDE = "AGENTENV_BENCH_RAY_NAMESPACE"          # set in the namespace's run of this script
GROCERIES = {"title": "groceries", "text": "eggs and milk"}
LAYOUTS = {"1 node": [6], "3 nodes": [1, 2, 3]}   # CPUs each node declares
TARGET = 1.5


def in_loopback_namespace(argv: list[str]) -> int:
    """Run this script again inside a fresh loopback-only network namespace; its exit code."""
    if importlib.util.find_spec("ray") is None:
        sys.exit("ray_bench.py needs Ray in this Python: pip install -e '.[ray]'")
    if shutil.which("unshare") is None:
        sys.exit("ray_bench.py needs unshare (util-linux), run as root: Ray runs only in a "
                 "loopback-only network namespace")
    return subprocess.run(
        ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable,
         str(Path(__file__).resolve()), *argv],
        env={**os.environ, INSIDE: "1", "RAY_USAGE_STATS_ENABLED": "0"}, stdin=subprocess.DEVNULL,
    ).returncode


sys.path.insert(0, str(ROOT))
from tests.harness import (Gym, RayCluster, Server, client, gym_rows, in_namespace,  # noqa: E402
                           loopback_only)


class Cluster(RayCluster):
    """The harness's cluster on one machine, each node declaring its own number of CPUs. On a
    loaded machine a raylet can take longer than Ray's 30 s to register: its own wait is raised
    (RAY_raylet_start_wait_time_s), and the harness tries a node again where ``ray start``'s
    (hard-coded) one is missed."""

    def __init__(self, folder: Path, cpus: list[int]):
        self.each = cpus
        os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__(folder, workers=len(cpus) - 1, cpus=cpus[0], start_within=300)

    def _argv(self, n: int) -> list[str]:
        return [f"--num-cpus={self.each[n]}" if a.startswith("--num-cpus=") else a
                for a in super()._argv(n)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(seconds: list[float]) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {"n": len(ms), "p50": statistics.median(ms), "p95": pct(ms, 95), "min": min(ms),
            "max": max(ms)}


async def deploy(http, url: str, row: dict) -> float:
    """Seconds from /seed_session to the first tool call's answer (the env deployed)."""
    rollout = Gym(url, row, http, strict=True)
    started = time.perf_counter()
    await rollout.seed()
    reply = await rollout.call("list_notes")
    took = time.perf_counter() - started
    assert reply.text == "(no notes)", reply.text
    await rollout.close()
    return took


async def rollout(http, url: str, row: dict) -> None:
    """One whole rollout of save-groceries, which must score 1.0."""
    played = Gym(url, row, http, strict=True)
    await played.seed()
    assert (await played.call("list_notes")).text == "(no notes)"
    assert (await played.call("write_note", **GROCERIES)).text == "saved note 'groceries'"
    body = (await played.verify()).json()
    assert (body["reward"], body["mask_sample"]) == (1.0, False), body


async def scrape(http, url: str) -> dict[tuple[str, str], float]:
    """A server's /metrics as {(metric, labels as key=value,...): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def idle(http, url: str, within: float = 60) -> None:
    """Wait until no episode holds a slot of the server's pool (every teardown done)."""
    deadline = time.monotonic() + within
    while (await scrape(http, url)).get(("agentenv_episodes_live", ""), 0) > 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"episodes still live at {url} after {within:g}s")
        await asyncio.sleep(0.05)


def deploys_by_node(metrics: dict[tuple[str, str], float]) -> dict[str, float]:
    counted: dict[str, float] = {}
    for (name, labels), value in metrics.items():
        if name == "agentenv_deploys_total" and "sandbox=ray" in labels.split(","):
            node = dict(item.split("=", 1) for item in labels.split(","))["node"]
            counted[node] = counted.get(node, 0) + value
    return counted


async def measure(servers: dict[str, Server], cpus: list[int], args) -> dict:
    row = gym_rows(NOTES)["save-groceries"]
    urls = {name: server.url for name, server in servers.items()}
    single: dict[str, list[float]] = {name: [] for name in urls}
    together: dict[str, list[float]] = {name: [] for name in urls}
    async with client(600, limit=0) as http:
        for url in urls.values():                       # a first deploy each, not counted
            await deploy(http, url, row)
            await idle(http, url)
        for n in range(args.rounds):
            order = list(urls) if n % 2 == 0 else list(urls)[::-1]
            for name in order:
                single[name].append(await deploy(http, urls[name], row))
                await idle(http, urls[name])
            for name in order:
                together[name] += await asyncio.gather(*(deploy(http, urls[name], row)
                                                         for _ in range(args.at_once)))
                await idle(http, urls[name])
        rates = {}
        for name in urls:
            gate = asyncio.Semaphore(args.at_once)

            async def limited() -> None:
                async with gate:
                    await rollout(http, urls[name], row)
            started = time.perf_counter()
            await asyncio.gather(*(limited() for _ in range(args.episodes)))
            rates[name] = args.episodes / (time.perf_counter() - started)
            await idle(http, urls[name])
        spread = None
        if len(cpus) > 1 and args.spread:
            before = deploys_by_node(await scrape(http, urls["ray"]))
            gate = asyncio.Semaphore(2 * sum(cpus))

            async def held() -> None:
                async with gate:
                    await rollout(http, urls["ray"], row)
            started = time.perf_counter()
            await asyncio.gather(*(held() for _ in range(args.spread)))
            took = time.perf_counter() - started
            after = deploys_by_node(await scrape(http, urls["ray"]))
            counted = {node: after.get(node, 0) - before.get(node, 0) for node in after}
            spread = {"rollouts": args.spread, "in_flight": 2 * sum(cpus), "seconds": took,
                      "nodes": {}}
            for n, declared in enumerate(cpus):
                node = f"127.0.0.{n + 1}"
                share = declared / sum(cpus)
                got = counted.get(node, 0) / args.spread
                spread["nodes"][node] = {"cpus": declared, "share": share, "deploys":
                                         counted.get(node, 0), "got": got,
                                         "off_by": got / share - 1}
            spread["meets_target"] = all(abs(v["off_by"]) <= 0.10
                                         for v in spread["nodes"].values())
    result = {"single_ms": {k: summary(v) for k, v in single.items()},
              "at_once_ms": {k: summary(v) for k, v in together.items()},
              "episodes_per_s": rates, "spread": spread}
    for what in ("single_ms", "at_once_ms"):
        ratio = result[what]["ray"]["p50"] / result[what]["local"]["p50"]
        result[what]["ratio_p50"] = ratio
        result[what]["meets_target"] = ratio <= TARGET
    return result


def one_layout(name: str, cpus: list[int], folder: Path, args) -> dict:
    started = time.monotonic()
    cluster = Cluster(folder / "ray", cpus)
    took_cluster = time.monotonic() - started
    env = {k: cluster.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED")}
    servers: dict[str, Server] = {}
    try:
        started = time.monotonic()
        servers["ray"] = Server([sys.executable, str(ROOT / "agentenv.py"), "serve", str(NOTES),
                                 "--sandbox", "ray", "--ray-address", cluster.address, "--port",
                                 "{port}", "--max-concurrent-envs", "16"], folder / "ray-serve",
                                env=env, ready_within=300)
        took_serve = time.monotonic() - started
        servers["local"] = Server.serve(NOTES, folder / "local-serve", "--max-concurrent-envs", "16")
        print(f"{name}: cluster up in {took_cluster:.1f}s, serve --sandbox ray in {took_serve:.1f}s",
              file=sys.stderr)
        result = asyncio.run(asyncio.wait_for(measure(servers, cpus, args), 900))
        result.update(cpus=cpus, cluster_start_s=took_cluster, ray_serve_start_s=took_serve)
        return result
    finally:
        for server in servers.values():
            server.stop()
        killed = cluster.close()
        print(f"{name}: stopped; {len(killed)} process(es) of Ray had to be killed", file=sys.stderr)


def markdown(cmd: str, meta: dict, results: dict) -> str:
    out = [f"Rerun: `{cmd}`", "",
           f"{meta['nproc']} cores, loadavg {meta['loadavg_before']} -> {meta['loadavg_after']}, "
           f"git {meta['git']}, Ray {meta['ray']}, {meta['wall_s']:.0f}s", "",
           "| cluster | measure | ray p50 / p95 ms | local p50 / p95 ms | ray / local p50 |",
           "|---|---|---:|---:|---:|"]
    for name, r in results.items():
        if "error" in r:
            out.append(f"| {name} ({'+'.join(map(str, r['cpus']))} CPUs) | not measured: "
                       f"{r['error'].splitlines()[0][:120]} | | | |")
            continue
        for what, label in (("single_ms", "one deploy at a time"),
                            ("at_once_ms", f"{meta['at_once']} deploys at once")):
            m = r[what]
            out.append(f"| {name} ({'+'.join(map(str, r['cpus']))} CPUs) | {label} | "
                       f"{m['ray']['p50']:.0f} / {m['ray']['p95']:.0f} | "
                       f"{m['local']['p50']:.0f} / {m['local']['p95']:.0f} | "
                       f"{m['ratio_p50']:.2f}x ({'met' if m['meets_target'] else 'NOT met'}: "
                       f"<= {TARGET}x) |")
        e = r["episodes_per_s"]
        out.append(f"| {name} | episodes/s, {meta['at_once']} at a time | {e['ray']:.1f} | "
                   f"{e['local']:.1f} | {e['ray'] / e['local']:.2f}x (reported) |")
    for name, r in results.items():
        s = r.get("spread")
        if not s:
            continue
        out += ["", f"Spread on {name}: {s['rollouts']} rollouts, {s['in_flight']} in flight, in "
                f"{s['seconds']:.0f}s; deploys by node from serve's /metrics "
                f"(agentenv_deploys_total by node): "
                f"{'met' if s['meets_target'] else 'NOT met'} (each within 10% of its share)", "",
                "| node | CPUs declared | share | deploys | got | off by |", "|---|---:|---:|---:|---:|---:|"]
        for node, v in s["nodes"].items():
            out.append(f"| {node} | {v['cpus']} | {v['share']:.1%} | {v['deploys']:.0f} | "
                       f"{v['got']:.1%} | {v['off_by']:+.1%} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10,
                        help="deploy: single deploys, and rounds of --at-once, per server (10)")
    parser.add_argument("--at-once", type=int, default=6,
                        help="deploys started together, and rollouts at a time for episodes/s (6)")
    parser.add_argument("--episodes", type=int, default=24, help="rollouts per server for episodes/s")
    parser.add_argument("--spread", type=int, default=120,
                        help="rollouts for the spread on 3 nodes (0: none; default 120)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"which clusters, of: {', '.join(LAYOUTS)} (default both)")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    if os.environ.get(INSIDE) != "1":
        return in_loopback_namespace(sys.argv[1:])
    assert loopback_only(), "the namespace has an interface other than loopback"
    import ray
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "agentenv.py"],
                           capture_output=True, text=True).stdout.strip()
    cmd = shlex.join(["python", "bench/ray_bench.py", *sys.argv[1:]])
    meta = {"nproc": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__,
            "git": git + ("+dirty" if dirty else ""), "at_once": args.at_once,
            "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    results = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentenv-ray-bench-") as tmp:
        for name in [n.strip() for n in args.layouts.split(",") if n.strip()]:
            try:
                results[name] = one_layout(name, LAYOUTS[name], Path(tmp) / name.replace(" ", "-"),
                                           args)
            except AssertionError as exc:     # a cluster that could not start on a loaded machine
                results[name] = {"cpus": LAYOUTS[name], "error": str(exc)[:2000]}
                print(f"{name}: not measured: {str(exc)[:300]}", file=sys.stderr)
    inode = os.readlink("/proc/self/ns/net")
    left = [pid for pid in in_namespace(inode) if pid != os.getpid()]
    meta.update(wall_s=time.monotonic() - started, left_in_namespace=left,
                loadavg_after=" ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(markdown(cmd, meta, results))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "meta": meta, "results": results},
                                              indent=2) + "\n")
    if left:
        print(f"processes left in the namespace: {left}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
