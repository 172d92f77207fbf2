"""A scripted fake model server speaking the OpenAI Responses API, for NeMo Gym tests.

The data row drives it: ``responses_create_params.metadata["script"]`` is a JSON *string* (Responses
metadata is a string -> string map) holding a list of steps, each one of

* ``{"tool": NAME, "args": {...}}``  -> one ``function_call`` item (arguments = ``json.dumps(args)``);
* ``{"tool": NAME, "raw_args": "..."}`` -> the same with the arguments string sent verbatim (bad JSON);
* ``{"text": "..."}``               -> one assistant ``message`` item (this ends simple_agent's loop).

The step taken is the number of ``function_call`` items already in the request's ``input``. Past
the end of the script it answers the text ``(fake model: script exhausted)``. A request without a
script, or with one that does not parse, gets a 400 that says so (simple_agent turns it into a 500
from ``/run`` that quotes it).

Routes: ``GET /v1/models`` (and ``/models``, for Gym's model-endpoint probe), ``POST /v1/responses``
(and ``/responses``), ``GET /`` (readiness).

Use it

* from a test: ``model = start()`` (any free port; ``start(port=P)`` for a fixed one) runs it on a
  thread with its own event loop; ``model.base_url`` is ``http://127.0.0.1:<port>/v1``,
  ``model.requests`` lists every ``(path, body)`` received, ``model.stop()`` (or ``stop(model)``)
  stops it. ``FakeModel`` is also a context manager;
* as a process: ``python -m tests.gym.fake_model --port P`` (from the repo root) or
  ``python tests/gym/fake_model.py --port P``; it prints ``fake model listening on <base_url>`` and
  serves until SIGINT or SIGTERM. ``--port 0`` picks a free port (read it from that line).

Only the standard library and aiohttp are used, so it runs in the project's Python or in the Gym venv.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import threading
import time
from typing import Any

from aiohttp import web

MODEL_ID = "fake"
_ids = itertools.count(1)


class ScriptError(ValueError):
    """The request carries no usable script."""


def parse_script(body: dict) -> list[dict]:
    """The list of steps from ``body["metadata"]["script"]`` (a JSON string), checked."""
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or "script" not in metadata:
        raise ScriptError('fake model: the request has no metadata["script"] (a JSON string holding a '
                          'list of {"tool": name, "args": {...}} or {"text": "..."} steps)')
    raw = metadata["script"]
    if not isinstance(raw, str):
        raise ScriptError('fake model: metadata["script"] must be a JSON string (Responses metadata '
                          f"values are strings), got {type(raw).__name__}")
    try:
        script = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ScriptError(f'fake model: metadata["script"] is not JSON: {exc}') from None
    if not isinstance(script, list):
        raise ScriptError('fake model: metadata["script"] must hold a JSON list of steps')
    for i, step in enumerate(script):
        ok = isinstance(step, dict) and (
            (isinstance(step.get("text"), str) and "tool" not in step)
            or (isinstance(step.get("tool"), str)
                and (isinstance(step.get("args", {}), dict) or "raw_args" in step)))
        if not ok:
            raise ScriptError(f"fake model: script step {i} is neither {{\"tool\": name, \"args\": {{...}}}} "
                              f"nor {{\"text\": \"...\"}}: {step!r}")
    return script


def count_function_calls(body: dict) -> int:
    items = body.get("input")
    if not isinstance(items, list):
        return 0
    return sum(1 for item in items if isinstance(item, dict) and item.get("type") == "function_call")


def output_item(step: dict, index: int) -> dict:
    n = next(_ids)
    if "tool" in step:
        arguments = step["raw_args"] if "raw_args" in step else json.dumps(step.get("args", {}))
        return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{index}_{n}",
                "name": step["tool"], "arguments": arguments, "status": "completed"}
    return {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": step["text"], "annotations": []}]}


def respond(body: dict) -> dict:
    """The Responses object answering one ``POST /v1/responses`` body (raises ScriptError)."""
    script = parse_script(body)
    index = count_function_calls(body)
    step = script[index] if index < len(script) else {"text": "(fake model: script exhausted)"}
    item = output_item(step, index)
    input_tokens = max(1, len(json.dumps(body.get("input", ""))) // 4)
    output_tokens = max(1, len(json.dumps(item)) // 4)
    return {
        "id": f"resp_{next(_ids)}", "object": "response", "created_at": int(time.time()),
        "model": body.get("model") or MODEL_ID, "status": "completed",
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "output": [item],
        "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": input_tokens + output_tokens},
    }


def make_app(requests: list | None = None) -> web.Application:
    """The aiohttp app; every ``(path, parsed body)`` received is appended to ``requests``."""
    log = requests if requests is not None else []

    async def root(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        log.append((request.path, None))
        return web.json_response({"object": "list", "data": [
            {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "agentenv-tests"}]})

    async def responses(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "fake model: the body is not JSON",
                                                "type": "invalid_request_error"}}, status=400)
        log.append((request.path, body))
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "fake model: the body is not an object",
                                                "type": "invalid_request_error"}}, status=400)
        try:
            return web.json_response(respond(body))
        except ScriptError as exc:
            return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error"}},
                                     status=400)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/", root)
    for prefix in ("/v1", ""):
        app.router.add_get(f"{prefix}/models", models)
        app.router.add_post(f"{prefix}/responses", responses)
    return app


class FakeModel:
    """The fake on a background thread with its own event loop."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", enter: Any = None):
        self.host, self.port, self.enter = host, port, enter    # enter: a namespace to listen in
        self.requests: list[tuple[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def response_bodies(self) -> list[dict]:
        return [body for path, body in self.requests if path.endswith("/responses")]

    def start(self) -> "FakeModel":
        ready = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            self._runner = web.AppRunner(make_app(self.requests), access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]    # the real one when port=0

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                if self.enter is not None:
                    self.enter()            # this thread (and every socket it opens) moves there
                self._loop.run_until_complete(serve())
            except BaseException as exc:                             # noqa: BLE001 - reported below
                failure.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name=f"fake-model-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the fake model did not start within 30 s")
        if failure:
            raise RuntimeError(f"the fake model could not listen on {self.host}:{self.port}: {failure[0]}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        self._thread = None

    def __enter__(self) -> "FakeModel":
        return self if self._thread else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start(port: int = 0, host: str = "127.0.0.1", enter: Any = None) -> FakeModel:
    """Start the fake on a thread; ``port=0`` picks a free port (see ``.port``). ``enter`` moves
    the thread into a network namespace first (LoopbackNamespace.enter)."""
    return FakeModel(port, host, enter).start()


def stop(model: FakeModel) -> None:
    model.stop()


async def _serve_forever(host: str, port: int) -> None:
    runner = web.AppRunner(make_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"fake model listening on http://{host}:{port}/v1", flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    try:
        await done.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Scripted fake OpenAI Responses model server.")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0 = any free port)")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    asyncio.run(_serve_forever(args.host, args.port))


if __name__ == "__main__":
    main()
