"""Play one task of a bundle through agentenv-framework 0.9.1364 with a scripted model.

Run by tests/test_agent_framework_diff.py with the framework venv's own python (see
.ci/framework-venv.sh), inside a network namespace that has only loopback, with HOME and
XDG_STATE_HOME in a scratch folder: ``python play.py PLAN.json``. It prints one JSON line, what
the framework did:

    {"scores": {step id: score}, "error": "Type: text" or null, "failed_steps": {step id: error},
     "turns": [{"step_id", "prompt", "system_prompt", "tools": [names], "calls": [...]}],
     "verifications": {verifier id: record}, "script_results": {result id: value}}

The plan says what to play: ``{"bundle": path, "task": name, "mode": "episode" or "run",
"turns": [{"calls": [[tool, arguments], ...], "reply": text}]}``. In ``episode`` mode the task
is played as the framework's Episode API plays an outside agent (prepare_bundle(played=True),
EpisodeSpec.from_task, start(sandbox="local"), then each planned turn: tools(), the calls,
end(reply)); a call's answer is ``{"text", "is_error"}``, or ``{"raised": "Type: text"}`` when the
driver refused it. ``run`` mode runs the task as ``agent-env run --sandbox local`` does, for a
task that prompts no agent. Only the framework's public API is driven; the run's record (its
verifications, script results, failed steps) is read from the context it kept.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


def said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def record(context) -> dict:
    meta = context.metadata
    return {"failed_steps": {f["step_id"]: f["error"] for f in meta.get("failed_steps") or []},
            "verifications": meta.get("verifications") or {},
            "script_results": meta.get("script_results") or {}}


async def play_episode(plan: dict) -> dict:
    from agent_env.bundle.run import prepare_bundle
    from agent_env.store.routing import namespace_routing
    from agent_env.task.episode import EpisodeSpec

    out: dict = {"turns": [], "error": None, "scores": None}
    with namespace_routing():
        prepared = prepare_bundle(plan["bundle"], tasks=[plan["task"]], played=True)
        (_, task), = prepared.tasks
        spec = EpisodeSpec.from_task(task)
        episode = await spec.start(sandbox="local")
        try:
            for planned in plan["turns"]:
                turn = await episode.next_turn()
                if turn is None:
                    break
                seen = {"step_id": turn.step_id, "prompt": turn.prompt,
                        "system_prompt": turn.system_prompt, "calls": []}
                async with turn.tools() as tools:
                    seen["tools"] = [tool.name for tool in tools.list()]
                    for name, arguments in planned["calls"]:
                        try:
                            result = await tools.call(name, arguments)
                            seen["calls"].append({"text": result.text, "is_error": bool(result.isError)})
                        except Exception as exc:                  # noqa: BLE001 - what the caller sees
                            seen["calls"].append({"raised": said(exc)})
                await turn.end(planned.get("reply"))
                out["turns"].append(seen)
            if await episode.next_turn() is not None:
                out["error"] = "the run opened a turn the plan did not play"
            out["scores"] = await episode.result()
        except Exception as exc:                                  # noqa: BLE001 - reported, not raised
            out["error"] = said(exc)
        finally:
            await episode.abandon("the player is done")
        out.update(record(episode._context))
    return out


def play_run(plan: dict) -> dict:
    from agent_env.bundle.run import run_bundle

    result = run_bundle(plan["bundle"], tasks=[plan["task"]], sandbox="local")
    (ran,) = result.runs
    return {"turns": [], "scores": ran.scores, "error": said(ran.error) if ran.error else None,
            **record(ran.context)}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    out = asyncio.run(play_episode(plan)) if plan["mode"] == "episode" else play_run(plan)
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
