"""A stand-in NeMo Gym resources server written WITHOUT nemo_gym (aiohttp + PyYAML only).

It proves the Gym test harness (tests/gym/harness.py) before the project's own server exists, by
owing Gym exactly what a third-party server owes it:

* host and port from ``NEMO_GYM_CONFIG_DICT`` (the YAML of the whole config) at the instance
  ``NEMO_GYM_CONFIG_PATH``: ``<instance>.resources_servers.<impl>.{host, port}``;
* ``GET /`` (Gym's readiness probe) and the other liveness routes;
* ``POST /seed_session``: the whole row; starts a session and sets the cookie ``standin_session``;
* ``POST /add`` (the one tool): ``{"a": number, "b": number}`` -> ``{"sum": a + b}``, remembered
  in the session (an unknown or missing session is a 400 the model sees as text);
* ``POST /verify``: the row plus ``response``; echoes the body with ``reward`` 1.0 when the session
  computed the row's ``expected_sum`` with ``add`` AND the last assistant message contains it,
  else 0.0; it also returns ``standin_adds`` (the sums of the session) and ``standin_session_seen``;
* ``POST /aggregate_metrics``: ``{"verify_responses": [...]}`` -> Gym's AggregateMetrics shape;
* any route also answers under an ``/ng-rollout/<id>`` prefix (Gym's observability mode).

Stopped by SIGINT (aiohttp's run_app turns it into a clean shutdown).
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import yaml
from aiohttp import web

COOKIE = "standin_session"
SESSIONS: dict[str, dict] = {}


def load_config() -> tuple[str, dict]:
    """(instance name, this instance's resources_servers.<impl> mapping)."""
    try:
        instance = os.environ["NEMO_GYM_CONFIG_PATH"]
        whole = yaml.safe_load(os.environ["NEMO_GYM_CONFIG_DICT"])
    except KeyError as exc:
        sys.exit(f"standin: {exc.args[0]} is not set (Gym sets it when it launches app.py)")
    entry = (whole.get(instance) or {}).get("resources_servers") or {}
    if len(entry) != 1:
        sys.exit(f"standin: {instance}.resources_servers must hold exactly one implementation, got {entry!r}")
    (impl, cfg), = entry.items()
    return instance, cfg


def json_response(data, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def seed_session(request: web.Request) -> web.Response:
    row = await request.json()
    sid = uuid.uuid4().hex
    SESSIONS[sid] = {"adds": [], "expected_sum": row.get("expected_sum")}
    response = json_response({})
    response.set_cookie(COOKIE, sid, path="/", httponly=True)
    return response


def session_of(request: web.Request) -> dict | None:
    return SESSIONS.get(request.cookies.get(COOKIE, ""))


async def add(request: web.Request) -> web.Response:
    session = session_of(request)
    if session is None:
        return json_response({"error": "no session: call /seed_session first and send its cookie"}, 400)
    try:
        args = await request.json()
        total = args["a"] + args["b"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return json_response({"error": f"add takes {{\"a\": number, \"b\": number}}: {exc!r}"}, 422)
    session["adds"].append(total)
    return json_response({"sum": total})


def last_assistant_text(response: dict) -> str:
    text = ""
    for item in response.get("output") or []:
        if item.get("type") == "message" and item.get("role") == "assistant":
            text = "".join(part.get("text", "") for part in item.get("content") or []
                           if isinstance(part, dict))
    return text


async def verify(request: web.Request) -> web.Response:
    body = await request.json()
    session = session_of(request)
    adds = session["adds"] if session else []
    expected = body.get("expected_sum")
    answered = last_assistant_text(body.get("response") or {})
    ok = expected is not None and expected in adds and str(expected) in answered
    return json_response(body | {"reward": 1.0 if ok else 0.0, "standin_adds": adds,
                                 "standin_session_seen": session is not None})


async def aggregate_metrics(request: web.Request) -> web.Response:
    body = await request.json()
    rewards = [float(r.get("reward", 0.0)) for r in body.get("verify_responses") or []]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    metrics = {"mean/reward": mean, "count": len(rewards)}
    return json_response({"group_level_metrics": [], "agent_metrics": metrics, "key_metrics": metrics,
                          "perf_summary": None, "repeat_level_metrics": []})


def make_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    for prefix in ("", "/ng-rollout/{rollout_id}"):
        for path in ("/", "/health", "/healthz", "/livez", "/readyz"):
            app.router.add_get(prefix + path if prefix else path, health)
        app.router.add_post(prefix + "/seed_session", seed_session)
        app.router.add_post(prefix + "/add", add)
        app.router.add_post(prefix + "/verify", verify)
        app.router.add_post(prefix + "/aggregate_metrics", aggregate_metrics)
    return app


if __name__ == "__main__":
    instance, cfg = load_config()
    host, port = cfg.get("host", "127.0.0.1"), int(cfg["port"])
    print(f"standin: {instance} listening on {host}:{port}", flush=True)
    web.run_app(make_app(), host=host, port=port, print=None, access_log=None)
