"""page_run.py: the NeMo RL page's GridSim run, replayed without GPUs, to put a number on the
environment's share of a GRPO step.

    python bench/page_run.py [--steps 40] [--val-rows 200] [--train-seconds 30] [--warm N]
                             [--max-concurrent-envs 64] [--json bench/page_run.json]

What runs is what the page runs, but the model:

* ``python agentenv.py serve bundles/gridsim-v1 --sandbox docker --max-concurrent-envs 64`` (the
  page's serve.py: build_app at 64), its warm pool left at its default unless ``--warm`` is given;
* ``python agentenv.py write-gym http://127.0.0.1:PORT ROOT``: the resources server the page writes
  (url: mode), with its rows (data/train.jsonl, data/eval.jsonl);
* that server's app.py and NeMo Gym's own ``simple_agent`` (``max_steps: 4``, as the page's config),
  each started as Gym starts a server (tests/gym/harness.py, the Gym 0.7 venv of .ci/gym-venv.sh),
  and every rollout a POST of its row to simple_agent's ``/run``, as ``gym eval run`` and NeMo RL's
  environment server play rows;
* the model: a scripted OpenAI Responses server on loopback, here in this process, that takes about
  a second a reply (0.8 to 1.2 s) and plays a day as a policy part-way trained would: it submits the
  exact optimum of the day's prices seen through noise (a schedule that is always valid, scoring
  between 0 and 1, and 1 only when the noise happens not to matter), then replies in text, which
  ends simple_agent's loop and sends ``/verify``.

The run: ``--steps`` GRPO-shaped steps (default the page's 40) of 32 rollouts, 4 train days x 8,
posted at once as Gym seeds a step; between steps ``--train-seconds`` of nothing, standing for the
trainer's own work (default 30: the page's steps spent about 30 s outside generation, and the warm
pool refills in it); and validations of the ``--val-rows`` eval days (default 200), one rollout each, all posted
at once, at the start and every 20 steps (val_at_start, val_period 20: 3 in a full run).

Reported, as the page reports: masked rollouts (mask_sample from /verify, and any /run that failed)
out of all; and per step the wall time from the first /run posted to the last answered, against
the model's own time on the step's critical path (the most model time any one rollout of the step
spent, since its rollouts run at once), so the environment's share of a step, ``wall - model``, is
a number. Also each rollout's own share (its wall less its model time), p50 and max, and the mean
reward; the warm envs serve had ready as the step began; and from serve's /metrics, the step's
deploys (an episode's cold ones and the warm pool's) and the mean seconds of a deploy, a tool call
and a verifier run; and from /proc, where the machine's CPU went during the step (CpuShares: serve,
Gym's servers, this process, Docker's own processes, the envs in their containers, the rest). The
load average is read at the start, the end and at every step.

Nothing is left running: serve is stopped with SIGINT (it removes its containers, warm ones too),
the Gym servers as tests/gym/harness.py stops them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
GRIDSIM = ROOT / "bundles" / "gridsim-v1"
NAME = "gridsim_v1"
for path in (ROOT, GRIDSIM / "envs" / "gridsim"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import battery  # noqa: E402
from tests.gym import harness  # noqa: E402
from tests.harness import HOST, free_ports, read_jsonl  # noqa: E402

ROLLOUTS_PER_PROMPT, PROMPTS_PER_STEP, VAL_PERIOD = 8, 4, 20


# ---------------------------------------------------------------- the model

class Model:
    """A scripted OpenAI Responses endpoint that takes about a second a reply. A rollout is named
    by its row's ``metadata.rollout``; its first reply submits a schedule, its second ends the
    turn in text. Every reply's seconds are kept by rollout."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.spent: dict[str, float] = {}
        self.replies = 0

    def schedule(self, rollout: str, day: dict) -> list[int]:
        """The optimum of the day's prices as a part-trained policy sees them: each price off by
        a noise of its own, the rollout's noise level drawn from 0 to 60%."""
        rng = random.Random(f"{self.seed}:{rollout}")
        cents = battery.prices_cents(day["prices_usd_per_mwh"])
        sigma = rng.uniform(0.0, 0.6)
        seen = [int(c + abs(c) * rng.gauss(0.0, sigma)) for c in cents]
        return battery.optimum(seen, battery.Battery.from_dict(day["battery"]))[1]

    async def responses(self, request: web.Request) -> web.Response:
        began = time.monotonic()
        body = await request.json()
        rollout = (body.get("metadata") or {}).get("rollout", "?")
        items = body.get("input") if isinstance(body.get("input"), list) else []
        n = self.replies = self.replies + 1
        if any(isinstance(i, dict) and i.get("type") == "function_call" for i in items):
            item = {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "Submitted today's schedule.",
                                 "annotations": []}]}
        else:
            user = next(i["content"] for i in items if isinstance(i, dict) and i.get("role") == "user")
            day = json.loads(user if isinstance(user, str) else user[0]["text"])
            plan = await asyncio.to_thread(self.schedule, rollout, day)
            item = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}",
                    "name": "submit_schedule", "arguments": json.dumps({"schedule": plan}),
                    "status": "completed"}
        # about a second a reply, as a model generating a schedule takes
        await asyncio.sleep(max(0.0, random.uniform(0.8, 1.2) - (time.monotonic() - began)))
        reply = web.json_response({
            "id": f"resp_{n}", "object": "response", "created_at": int(time.time()),
            "model": body.get("model") or "scripted", "status": "completed",
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "output": [item],
            "usage": {"input_tokens": 1000, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": 100, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": 1100}})
        self.spent[rollout] = self.spent.get(rollout, 0.0) + time.monotonic() - began
        return reply

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model",
                                                              "created": 0, "owned_by": "bench"}]})

    async def start(self) -> tuple[web.AppRunner, int]:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/", lambda r: web.json_response({"status": "ok"}))
        for prefix in ("/v1", ""):
            app.router.add_get(f"{prefix}/models", self.models)
            app.router.add_post(f"{prefix}/responses", self.responses)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]


# ---------------------------------------------------------------- the servers

class Serve:
    """``python agentenv.py serve bundles/gridsim-v1 --sandbox docker`` in a session of its own."""

    def __init__(self, work: Path, pool: int, warm: str | None):
        self.port = free_ports(1)[0]
        self.url = f"http://{HOST}:{self.port}"
        self.argv = [sys.executable, str(ROOT / "agentenv.py"), "serve", str(GRIDSIM), "--sandbox",
                     "docker", "--port", str(self.port), "--max-concurrent-envs", str(pool),
                     *(("--warm", warm) if warm is not None else ())]
        self.log = work / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTENV_", "MAX_CONC"))}
        env.update(AGENTENV_STATE_DIR=str(work / "state"), PYTHONUNBUFFERED="1")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    async def ready(self, http: aiohttp.ClientSession, timeout: float = 600) -> dict:
        """/health once it answers and its warm pool (if any) is full."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                async with http.get(self.url + "/health") as reply:
                    health = await reply.json()
                warm = health.get("warm")
                if warm is None or (warm["ready"], warm["booting"]) == (warm["target"], 0):
                    return health
            except (aiohttp.ClientError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"serve was not ready within {timeout:.0f} s:\n{self.log.read_text()}")
            await asyncio.sleep(0.25)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)


def write_gym(url: str, root: Path) -> Path:
    """``python agentenv.py write-gym URL ROOT``: the server's folder."""
    argv = [sys.executable, str(ROOT / "agentenv.py"), "write-gym", url, str(root)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{shlex.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1].removeprefix("wrote "))


def start_gym(root: Path, model_port: int, group: harness.ProcessGroup) -> tuple[str, list[int]]:
    """The written resources server and Gym's simple_agent (max_steps 4, as the page's config),
    started as Gym starts them; simple_agent's URL once both answer, and their pids."""
    resources_port, agent_port, head_port = free_ports(3)
    config, rs_inst, agent_inst, _ = harness.lightest_config(
        root, NAME, resources_port=resources_port, agent_port=agent_port, model_host=HOST,
        model_port=model_port, head_port=head_port)
    config[agent_inst]["responses_api_agents"]["simple_agent"]["max_steps"] = 4
    text = yaml.safe_dump(config, sort_keys=False)
    children: list[harness.Child] = []
    for inst, cwd in ((rs_inst, root.resolve() / "resources_servers" / NAME),
                      (agent_inst, harness.simple_agent_dir(group.venv))):
        env = group.env({"NEMO_GYM_CONFIG_PATH": inst, "PYTHONPATH": str(cwd),
                         "NEMO_GYM_CONFIG_DICT": text})
        children.append(group.spawn(inst, [str(group.venv / "bin" / "python"), "app.py"], cwd=cwd,
                                    env=env))
    harness.wait_http(f"http://{HOST}:{resources_port}/", children[0], 180)
    harness.wait_http(f"http://{HOST}:{agent_port}/", children[1], 180)
    return f"http://{HOST}:{agent_port}", [c.proc.pid for c in children]


# ---------------------------------------------------------------- the run

def load() -> float:
    return round(os.getloadavg()[0], 2)


TICK = os.sysconf("SC_CLK_TCK")
SHIMS = ("containerd-shim", "containerd-shim-runc-v2", "docker-containerd-shim")   # (comm: 15 chars)
DOCKER = ("dockerd", "docker-proxy", "containerd")


class CpuShares:
    """Where the machine's CPU went during a step, in CPU-seconds: serve (and its children),
    Gym's two servers, this process (the scripted model and the rollouts' clients), Docker's own
    processes (dockerd, its port proxies, containerd), the envs in their containers (the processes
    under containerd's shims), and the rest (the kernel, and processes that came and went, such
    as a container removed during the step). Read from /proc at the step's start and end."""

    def __init__(self, serve_pid: int, gym_pids: list[int]):
        self.roots = {serve_pid: "serve", os.getpid(): "bench", **dict.fromkeys(gym_pids, "gym")}

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / TICK      # all but idle and iowait

    def snapshot(self) -> dict:
        """Each process's CPU so far and whose it is, and the machine's busy CPU."""
        procs: dict[int, tuple[str, int, float]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1:raw.rindex(")")]
            rest = raw[raw.rindex(")") + 2:].split()
            # utime stime cutime cstime: a reaped child's time counts for its parent
            procs[int(entry.name)] = (comm, int(rest[1]), sum(map(int, rest[11:15])) / TICK)
        kinds: dict[int, tuple[str, float]] = {}
        for pid, (comm, ppid, cpu) in procs.items():
            kind, at, seen = None, pid, 0
            while at in procs and seen < 64:
                name = procs[at][0]
                if at in self.roots:
                    kind = self.roots[at]
                elif name in SHIMS:
                    kind = "envs" if at != pid else "docker:shims"
                elif name in DOCKER and at == pid:
                    kind = f"docker:{name}"
                if kind:
                    break
                at, seen = procs[at][1], seen + 1
            if kind and not (kind == "bench" and pid != os.getpid()):
                kinds[pid] = (kind, cpu)
        return {"procs": kinds, "all": self._busy()}

    @staticmethod
    def spent(before: dict, after: dict) -> dict[str, float]:
        """CPU-seconds by whose between two snapshots: a process that ended between them is
        counted in ``rest`` (with the kernel), one that began, whole."""
        out = dict.fromkeys(("serve", "gym", "bench", "docker", "envs"), 0.0)
        docker: dict[str, float] = {}
        for pid, (kind, cpu) in after["procs"].items():
            earlier = before["procs"].get(pid)
            used = cpu - (earlier[1] if earlier and earlier[0] == kind else 0.0)
            if kind.startswith("docker:"):
                docker[kind[7:]] = docker.get(kind[7:], 0.0) + used
                kind = "docker"
            out[kind] += used
        out = {k: round(v, 2) for k, v in out.items()}
        out["all"] = round(after["all"] - before["all"], 2)
        out["rest"] = round(max(0.0, out["all"] - sum(v for k, v in out.items() if k != "all")), 2)
        out["docker_by_process"] = {k: round(v, 2) for k, v in sorted(docker.items())}
        return out


SCRAPED = ("agentenv_tool_call_duration_seconds", "agentenv_verifier_duration_seconds",
           "agentenv_deploy_duration_seconds")


async def scrape(http: aiohttp.ClientSession, serve: Serve) -> dict[str, float]:
    """serve's /metrics: each SCRAPED histogram's sum and count (over its labels), and its warm
    envs ready."""
    async with http.get(serve.url + "/metrics") as reply:
        text = await reply.text()
    found = dict.fromkeys([f"{n}_{p}" for n in SCRAPED for p in ("sum", "count")], 0.0)
    found["warm_ready"] = 0.0
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
        elif name == "agentenv_warm_envs" and 'state="ready"' in line:
            found["warm_ready"] = float(line.rsplit(" ", 1)[1])
    return found


def means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | int]:
    """What serve did during a step: its deploys (an episode's or a warm boot's) and the mean
    seconds of a deploy, a tool call and a verifier run."""
    out: dict[str, float | int] = {}
    for name, short in zip(SCRAPED, ("tool_call", "verifier", "deploy")):
        count = after[f"{name}_count"] - before[f"{name}_count"]
        total = after[f"{name}_sum"] - before[f"{name}_sum"]
        out[f"{short}_mean_s"] = round(total / count, 3) if count else None
        if short == "deploy":
            out["deploys"] = int(count)
    return out


async def play(http: aiohttp.ClientSession, agent: str, model: Model, rows: list[dict],
               label: str, serve: Serve, cpu: CpuShares) -> dict:
    """Post every row to simple_agent's /run at once; the step's figures (with the warm envs
    serve had ready as it began, and what its metrics say of the step)."""
    at_start = await scrape(http, serve)
    names = [f"{label}:{i}" for i in range(len(rows))]
    ended: dict[str, float] = {}
    results: dict[str, dict] = {}

    async def one(name: str, row: dict) -> None:
        row = json.loads(json.dumps(row))
        row["responses_create_params"].setdefault("metadata", {})["rollout"] = name
        try:
            async with http.post(agent + "/run", json=row) as reply:
                body = await reply.json(content_type=None) if reply.status == 200 else \
                    {"status": reply.status, "text": (await reply.text())[:500]}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            body = {"status": None, "text": f"{type(exc).__name__}: {exc}"}
        ended[name] = time.monotonic()
        results[name] = body

    before = load()
    cpu_start = cpu.snapshot()
    started = time.monotonic()
    await asyncio.gather(*(one(n, r) for n, r in zip(names, rows)))
    wall = max(ended.values()) - started
    cpu_s = CpuShares.spent(cpu_start, cpu.snapshot())
    served = means(at_start, await scrape(http, serve))
    model_s = max(model.spent.get(n, 0.0) for n in names)
    own = [ended[n] - started - model.spent.get(n, 0.0) for n in names]
    failed = [r for r in results.values() if "reward" not in r]
    masked = [r for r in results.values() if r.get("mask_sample")]
    rewards = [r["reward"] for r in results.values() if "reward" in r and not r.get("mask_sample")]
    return {"step": label, "rollouts": len(rows), "wall_s": round(wall, 3),
            "model_s": round(model_s, 3), "env_s": round(wall - model_s, 3),
            "rollout_env_p50_s": round(statistics.median(own), 3),
            "rollout_env_max_s": round(max(own), 3),
            "masked": len(masked), "failed": len(failed),
            "reasons": sorted({str(r.get("failure_reason") or r.get("text"))[:300]
                               for r in masked + failed}),
            "mean_reward": round(statistics.fmean(rewards), 4) if rewards else None,
            "warm_ready": int(at_start["warm_ready"]), **served, "load": before, "cpu_s": cpu_s}


def progress(args: argparse.Namespace, steps: list[dict]) -> None:
    """A step's line; and the steps so far in --json, so a run stopped early (a machine that got
    busy) keeps them."""
    print(json.dumps(steps[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"partial": True, "steps": steps}, indent=1) + "\n")


async def replay(args: argparse.Namespace, work: Path) -> dict:
    model = Model()
    runner, model_port = await model.start()
    group = harness.ProcessGroup(harness.gym_venv(), work / "logs")
    serve = Serve(work, args.max_concurrent_envs, args.warm)
    steps: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=1800)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout) as http:
            health = await serve.ready(http)
            root = await asyncio.to_thread(write_gym, serve.url, work / "gym-root")
            train = read_jsonl(root / "data" / "train.jsonl")
            evals = read_jsonl(root / "data" / "eval.jsonl")[:args.val_rows]
            agent, gym_pids = await asyncio.to_thread(start_gym, work / "gym-root", model_port, group)
            cpu = CpuShares(serve.proc.pid, gym_pids)
            await serve.ready(http)               # its pool full again after write-gym's probe
            random.Random(0).shuffle(train)
            print(f"serve, write-gym and Gym's servers up; load {load()}", flush=True)
            for step in range(args.steps + 1):
                if step % VAL_PERIOD == 0 and args.val_rows:
                    steps.append(await play(http, agent, model, evals, f"val@{step}", serve, cpu))
                    progress(args, steps)
                    await asyncio.sleep(args.train_seconds)
                if step == args.steps:
                    break
                prompts = train[step * PROMPTS_PER_STEP:(step + 1) * PROMPTS_PER_STEP]
                rows = [row for row in prompts for _ in range(ROLLOUTS_PER_PROMPT)]
                steps.append(await play(http, agent, model, rows, f"train@{step + 1}", serve, cpu))
                progress(args, steps)
                await asyncio.sleep(args.train_seconds)
    finally:
        left = group.stop_all()
        code = serve.stop()
        await runner.cleanup()
    said = [line for line in serve.log.read_text().splitlines() if "warm env" in line]
    return {"steps": steps, "serve_exit": code, "gym_leftovers": left, "warm_said": said,
            "health_at_start": health}


def summary(args: argparse.Namespace, run: dict, loads: tuple[float, float]) -> dict:
    train = [s for s in run["steps"] if s["step"].startswith("train")]
    val = [s for s in run["steps"] if s["step"].startswith("val")]
    every = run["steps"]
    out = {
        "command": "python bench/page_run.py " + " ".join(sys.argv[1:]),
        "load_start_end": loads, "cores": os.cpu_count(),
        "serve": f"serve bundles/gridsim-v1 --sandbox docker --max-concurrent-envs "
                 f"{args.max_concurrent_envs}" + (f" --warm {args.warm}" if args.warm else ""),
        "warm_said": run["warm_said"],
        "rollouts": sum(s["rollouts"] for s in every),
        "masked": sum(s["masked"] for s in every), "failed": sum(s["failed"] for s in every),
    }
    if train:
        env = [s["env_s"] for s in train]
        out["train"] = {"steps": len(train), "wall_p50_s": statistics.median(s["wall_s"] for s in train),
                        "model_p50_s": statistics.median(s["model_s"] for s in train),
                        "env_p50_s": statistics.median(env), "env_max_s": max(env),
                        "env_under_2s": sum(e < 2.0 for e in env),
                        "cpu_s_p50": {k: statistics.median(s["cpu_s"][k] for s in train)
                                      for k in ("all", "serve", "gym", "bench", "docker", "envs",
                                                "rest")},
                        "mean_reward": round(statistics.fmean(s["mean_reward"] or 0 for s in train), 4)}
    if val:
        out["validations"] = [{k: s[k] for k in ("step", "rollouts", "wall_s", "model_s", "env_s",
                                                  "masked", "failed", "mean_reward")} for s in val]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps of 32 rollouts (40)")
    parser.add_argument("--val-rows", type=int, default=200,
                        help="eval days each validation plays (200; 0: no validations)")
    parser.add_argument("--train-seconds", type=float, default=30.0,
                        help="the pause between steps, for the trainer's own work (30, as the page's)")
    parser.add_argument("--warm", default=None, help="serve's --warm (default: its own default)")
    parser.add_argument("--max-concurrent-envs", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if (problem := harness.gym_venv_problem()) is not None:
        raise SystemExit(problem)
    start = load()
    with tempfile.TemporaryDirectory(prefix="agentenv-page-run-") as folder:
        run = asyncio.run(replay(args, Path(folder)))
    result = {"summary": summary(args, run, (start, load())), **run}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
