"""trl_resets.py: what running TRL's resets ahead saves, measured with TRL's real GRPOTrainer.

TRL resets the environments of a generation batch one at a time before it generates. Without
resets run ahead each reset waits for its deploy, so a step spends the sum of the deploys there;
trl_environment's reset returns at once, and the deploys overlap while TRL goes on. This bench
trains the same warmed tiny model (tests/trl/train.py, in the TRL venv of .ci/trl-venv.sh) on
gridsim-v1 through ``serve``, both ways, and reports per step: the time TRL spent in reset() and
the step's whole time. With Docker (when a daemon answers) the deploys are slower, and so is
what overlapping them saves.

    python bench/trl_resets.py [--steps 5] [--rounds 2] [--sandbox local,docker] [--json bench/trl-resets.json]

Each sandbox's serve gets one training script: a run to warm TRL up, then --rounds runs of each
way, interleaved (which goes first alternates), each of --steps steps; a run's first step is left
out too. The machine is shared: read the medians, and rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("AGENTENV_TRL_VENV") or Path.home() / ".cache" / "agentenv-tests" / "trl-1.16.0")


def serve(sandbox: str, folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(folder / f"serve-{sandbox}.log", "w")
    proc = subprocess.Popen([sys.executable, str(REPO / "agentenv.py"), "serve",
                             str(REPO / "bundles" / "gridsim-v1"), "--sandbox", sandbox, "--port",
                             str(port), "--max-concurrent-envs", "16", "--warm", "0"],
                            stdout=log, stderr=log,
                            env={**os.environ, "AGENTENV_STATE_DIR": str(folder / f"state-{sandbox}")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300                 # Docker builds the env's image first
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve --sandbox {sandbox} did not start: see {log.name}")
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each way, interleaved")
    parser.add_argument("--sandbox", default="local,docker")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    python = VENV / "bin" / "python"
    if not (VENV / ".agentenv-trl-complete").is_file():
        raise SystemExit(f"no TRL venv at {VENV}: bash .ci/trl-venv.sh builds it")
    report = {"command": " ".join(["python", "bench/trl_resets.py", *sys.argv[1:]]),
              "steps": args.steps, "batch": 8, "sandboxes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for sandbox in args.sandbox.split(","):
            proc, url = serve(sandbox, folder)
            try:
                out = folder / f"{sandbox}.json"
                done = subprocess.run([str(python), str(REPO / "tests" / "trl" / "train.py"), "--out",
                                       str(out), "--run", f"gridsim={url}", "--steps", str(args.steps),
                                       "--compare-resets", str(args.rounds)], cwd=REPO, capture_output=True, text=True,
                                      env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
                if done.returncode:
                    raise SystemExit(done.stderr[-4000:])
            finally:
                proc.terminate()
                proc.wait(60)
            runs = json.loads(out.read_text())["runs"][1:]      # the first warms TRL up
            row = {}
            for way in ("ahead", "serial"):
                steps, resets = [], []
                for run in (r for r in runs if r["serial_resets"] == (way == "serial")):
                    steps += run["step_seconds"][1:]             # a run's first step warms it up
                    resets += [sum(run["reset_seconds"][i * 8:(i + 1) * 8])
                               for i in range(1, len(run["step_seconds"]))]
                row[way] = {"steps": len(steps), "step_s_mean": statistics.mean(steps),
                            "step_s_median": statistics.median(steps),
                            "resets_s_per_step_mean": statistics.mean(resets)}
            row["step_saved_s"] = row["serial"]["step_s_median"] - row["ahead"]["step_s_median"]
            report["sandboxes"][sandbox] = row
            print(f"{sandbox}: TRL's 8 resets a step took {row['serial']['resets_s_per_step_mean']:.3f}s "
                  f"waiting for each deploy and {row['ahead']['resets_s_per_step_mean']:.3f}s run ahead; "
                  f"a step's median {row['serial']['step_s_median']:.2f}s -> "
                  f"{row['ahead']['step_s_median']:.2f}s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
