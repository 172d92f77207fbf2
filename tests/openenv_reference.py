"""openenv_reference.py: the reference OpenEnv server the parity suite (test_openenv_parity.py)
holds ``serve`` against, built with OpenEnv 0.10's own parts and nothing of ours.

``python tests/openenv_reference.py --port P`` serves, with ``openenv.core.env_server``'s
``create_app`` (``CallToolAction`` / ``CallToolObservation``, as OpenEnv's MCP envs are built), an
``MCPEnvironment`` whose FastMCP tools are notes-v1's notebook (``write_note``, ``read_note``,
``list_notes``; with REFERENCE_TOOL_TIMEOUT set, also ``sleep``, and OpenEnv's tool deadline
that many seconds) and its ``end_turn``, which ends the episode with a score;
``reset(split, index)`` opens a task of a small task list that the task API (splits, tasks,
num_tasks, task, task_range) serves. A tool raises on a missing
note, as a Python tool does, and FastMCP checks the arguments against the signature.

It runs under uvicorn until SIGTERM, like an OpenEnv env's ``server/app.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server import mcp_environment
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State

NAME = "notes-v1"
TASKS = {"all": [{"id": "t0", "name": "recall-recipe", "prompt": "How many eggs?"},
                 {"id": "t1", "name": "save-groceries", "prompt": "Save a groceries note."},
                 {"id": "t2", "name": "two-step", "prompt": "List, then save."}]}
TASKS["smoke"] = [TASKS["all"][1]]


class NotesEnv(MCPEnvironment):
    """One session's notebook: an episode per reset, its tools over FastMCP."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("notebook")
        self.notes: dict[str, str] = {}
        self._state = State(episode_id=None, step_count=0)

        @mcp.tool()
        def write_note(title: str, text: str) -> str:
            """Save a note under a title (overwrites a note with that title)."""
            self.notes[title] = text
            return f"saved note '{title}'"

        @mcp.tool()
        def read_note(title: str) -> str:
            """Read the text of the note with this title."""
            if title not in self.notes:
                raise ValueError(f"no note titled '{title}'")
            return self.notes[title]

        @mcp.tool()
        def list_notes() -> str:
            """List the titles of all notes, one per line."""
            return "\n".join(sorted(self.notes)) or "(no notes)"

        if os.environ.get("REFERENCE_TOOL_TIMEOUT"):    # the notebook of with_sleep_tool
            @mcp.tool()
            def sleep(seconds: float) -> str:
                """Sleep for some seconds."""
                time.sleep(seconds)
                return "slept"

        @mcp.tool()
        def end_turn(response: str = "") -> dict:
            """End your turn with your reply."""
            return {"done": True, "reward": self.score(), "scores": {"check": self.score()}}

        super().__init__(mcp)

    def score(self) -> float:
        return 1.0 if "groceries" in self.notes else 0.0

    def ended(self, observation: Observation) -> Observation:
        """end_turn ends the episode with its score, as a task's last turn does."""
        if getattr(observation, "tool_name", None) == "end_turn" and observation.error is None:
            observation.done, observation.reward = True, self.score()
            observation.metadata = {"scores": {"check": self.score()}}
        return observation

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              split: str | None = None, index: int | None = None, **kwargs: Any) -> Observation:
        self.notes.clear()
        self._state = State(episode_id=episode_id, step_count=0)
        try:
            task = TASKS[split or "all"][index or 0]
        except (KeyError, IndexError, TypeError):
            return Observation(done=True, reward=None,
                               metadata={"status": "error", "error": f"no task {split}/{index}"})
        return Observation(done=False, reward=None, metadata={"prompt": task["prompt"],
                                                              "task": {**task, "split": split}})

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": "unknown action"})

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        return self.ended(super().step(action, timeout_s, **kwargs))

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any,
                         ) -> Observation:
        self._state.step_count += 1
        return self.ended(await super().step_async(action, timeout_s, **kwargs))

    @property
    def state(self) -> State:
        return self._state

    # -- the task API

    def list_splits(self) -> list[str]:
        return list(TASKS)

    def _split(self, split: str) -> list[dict]:
        if split not in TASKS:
            raise IndexError(split)
        return TASKS[split]

    def list_tasks(self, split: str) -> list[dict]:
        return [{**t, "index": i} for i, t in enumerate(self._split(split))]

    def num_tasks(self, split: str) -> int:
        return len(self._split(split))

    def get_task(self, split: str, index: int) -> dict:
        if index < 0:
            raise IndexError(index)
        return {**self._split(split)[index], "index": index}

    def get_task_range(self, split: str, start: int | None, stop: int | None) -> list[dict]:
        start = start or 0
        return [{**t, "index": start + i} for i, t in enumerate(self._split(split)[start:stop])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    os.environ.pop("ENABLE_WEB_INTERFACE", None)        # the plain FastAPI app, no Gradio
    # OpenEnv's own tool deadline (30 s), shorter where a test waits for it
    mcp_environment.MCP_TOOL_CALL_TIMEOUT = float(os.environ.get("REFERENCE_TOOL_TIMEOUT", "30"))
    app = create_app(NotesEnv, CallToolAction, CallToolObservation, env_name=NAME,
                     max_concurrent_envs=int(os.environ.get("MAX_CONCURRENT_ENVS", "8")))
    import uvicorn
    # uvicorn raises the SIGTERM it caught again once it has shut down: exit 0 then, as serve does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
