"""Run NeMo Gym's own session-contract check against a running ``agentenv.py serve``.

    <gym venv>/bin/python tests/gym/session_contract.py URL ROW_JSON

Gym 0.7's ``check_resources_session_contract`` drives a FastAPI app in process; this one hands
every request to the server at URL as it came (body and cookie) and its answer back as it came
(status, body, Set-Cookie), so the check judges agentenv.py's own routes: seed, repeated seed,
close, repeated close, close of an id never seeded, and seeds after those closes. Exits 0 and
prints one line when the contract holds; an AssertionError names the broken rule otherwise.
"""

from __future__ import annotations

import json
import sys

import httpx
from fastapi import FastAPI, Request, Response
from nemo_gym.base_resources_server import ResourcesSeedSessionRequest
from nemo_gym.episode_types import EpisodeId, TaskId
from nemo_gym.testing.session_conformance import check_resources_session_contract


def forwarding_app(base: str) -> FastAPI:
    app = FastAPI()

    @app.post("/{route:path}")
    async def forward(route: str, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "cookie")}
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.post(f"{base}/{route}", content=await request.body(), headers=headers)
        response = Response(answer.content, answer.status_code,
                            media_type=answer.headers.get("content-type"))
        for cookie in answer.headers.get_list("set-cookie"):
            response.headers.append("set-cookie", cookie)
        return response

    return app


def main() -> None:
    base, row = sys.argv[1].rstrip("/"), json.loads(sys.argv[2])
    seed = ResourcesSeedSessionRequest(
        resources_session_id="contract-session", episode_id=EpisodeId(rollout_id="rollout"),
        task_id=TaskId(taskset="agentenv", task_id=str(row.get("task_id", "task"))), task_data=row)
    check_resources_session_contract(forwarding_app(base), seed, keeps_state=True)
    print("NeMo Gym's resources-session contract holds")


if __name__ == "__main__":
    main()
