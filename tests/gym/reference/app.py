"""The reference resources server of tests/test_gym_parity.py: a notes server written the way NeMo
Gym 0.7 teaches (``SimpleResourcesServer``, a pydantic model per route, state by Gym's session
cookie), run under Gym's own ``run_webserver`` (its liveness routes, exception and validation
handling, uvicorn), so every reply that isn't about notes is Gym's framework's own.

It plays what notes-v1's ``save-groceries`` asks: the row names its task (``split``, ``index``),
``write_note`` saves a note, ``list_notes`` lists them, and ``/verify`` scores 1.0 when a note
titled "groceries" was saved in the rollout's session, 0.0 otherwise. Reverification is declared
stateless, as agentenv.py's is (it replays the rollout), so ``GET /reverify_mode`` is comparable.
"""

from __future__ import annotations

from typing import ClassVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from nemo_gym.base_resources_server import (BaseResourcesServerConfig, BaseSeedSessionRequest,
                                            BaseVerifyRequest, BaseVerifyResponse, ReverifyMode,
                                            SimpleResourcesServer)
from nemo_gym.server_utils import SESSION_ID_KEY


class NotesConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS


class SeedRow(BaseSeedSessionRequest):
    model_config = ConfigDict(extra="allow")
    split: str
    index: int


class WriteNote(BaseModel):
    title: str
    text: str


class NoArguments(BaseModel):
    pass


class Verified(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")


class NotesServer(SimpleResourcesServer):
    config: NotesConfig
    ray_enabled: ClassVar[bool] = False
    notes: dict = {}

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/write_note")(self.write_note)
        app.post("/list_notes")(self.list_notes)
        return app

    async def seed_session(self, request: Request, body: SeedRow) -> dict:
        self.notes[request.session[SESSION_ID_KEY]] = {}
        return {}

    async def write_note(self, request: Request, body: WriteNote) -> str:
        self.notes.setdefault(request.session[SESSION_ID_KEY], {})[body.title] = body.text
        return f"saved note {body.title!r}"

    async def list_notes(self, request: Request, body: NoArguments) -> str:
        return ", ".join(sorted(self.notes.get(request.session[SESSION_ID_KEY], {}))) or "no notes"

    async def verify(self, request: Request, body: BaseVerifyRequest) -> Verified:
        saved = self.notes.pop(request.session.get(SESSION_ID_KEY), {})
        return Verified(**body.model_dump(), reward=1.0 if "groceries" in saved else 0.0)


if __name__ == "__main__":
    NotesServer.run_webserver()
