"""A NeMo Gym 0.7 SimpleResourcesServer with no env behind it: a counter per session.

bench/bench.py's `throughput` part runs it in the NeMo Gym venv (~/.cache/agentenv-tests/nemo-gym-0.7,
built by .ci/gym-venv.sh) exactly as Gym launches a resources server: `cd` here, then
`<venv>/bin/python app.py` with NEMO_GYM_CONFIG_DICT (the config, host and port included),
NEMO_GYM_CONFIG_PATH (the instance name) and PYTHONPATH set to this folder.

Routes: POST /seed_session (the row; starts the session's counter at 0), POST /add {"amount": n}
(the tool: adds to the counter, answers {"total": n}), POST /verify (reward 1.0 when the counter
is above 0), and the rest SimpleResourcesServer brings. The session is Gym's own cookie.
"""

from typing import Dict

from fastapi import Request
from pydantic import BaseModel, Field

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY


class AddRequest(BaseModel):
    amount: int = 1


class AddResponse(BaseModel):
    total: int


class CounterServer(SimpleResourcesServer):
    ray_enabled = False
    config: BaseResourcesServerConfig
    counters: Dict[str, int] = Field(default_factory=dict)

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/add")(self.add)
        return app

    async def seed_session(self, request: Request, body: BaseSeedSessionRequest) -> BaseSeedSessionResponse:
        self.counters[request.session[SESSION_ID_KEY]] = 0
        return BaseSeedSessionResponse()

    async def add(self, request: Request, body: AddRequest) -> AddResponse:
        session = request.session[SESSION_ID_KEY]
        self.counters[session] = self.counters.get(session, 0) + body.amount
        return AddResponse(total=self.counters[session])

    async def verify(self, request: Request, body: BaseVerifyRequest) -> BaseVerifyResponse:
        total = self.counters.pop(request.session[SESSION_ID_KEY], 0)
        return BaseVerifyResponse(**body.model_dump(), reward=1.0 if total > 0 else 0.0)


if __name__ == "__main__":
    CounterServer.run_webserver()
