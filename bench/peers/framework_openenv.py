"""agentenv-framework 0.9.1364's OpenEnv server, as its docs serve it: build_app under uvicorn.

bench/bench.py's `episodes` part runs this in the benchmark's own venv (bench_venv() in bench.py):

    python framework_openenv.py BUNDLE PORT MAX_CONCURRENT_ENVS

It serves the bundle folder's tasks over OpenEnv (/health, /ws, ...) on 127.0.0.1:PORT until SIGINT.
"""

import sys
from pathlib import Path

import uvicorn
from agent_env.openenv import build_app

bundle, port, limit = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
app = build_app(bundle, max_concurrent_envs=limit)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
