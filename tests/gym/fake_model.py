"""A scripted fake model server speaking the OpenAI Responses and Chat Completions APIs, for the
NeMo Gym tests and for ``agentenv.py eval``'s.

A script is a list of steps, each one of

* ``{"tool": NAME, "args": {...}}``  -> one function call (arguments = ``json.dumps(args)``);
* ``{"tool": NAME, "raw_args": "..."}`` -> the same with the arguments string sent verbatim (bad JSON);
* ``{"text": "..."}``               -> one assistant message (this ends simple_agent's loop);
* ``{"refusal": "..."}``            -> a refusal (Responses: a refusal part; chat: ``refusal`` and
  ``finish_reason`` content_filter).

A step may carry ``"before": [...]``: faults answered, one per request, before the step is: a
status (``429`` comes with ``Retry-After: 0``), ``{"status": S, "message": M}`` (an OpenAI error
body), or ``"hang"`` (no answer until the client gives up, or the fake stops). Their count is kept
per script and step, for the fake's lifetime.

The script of a request is ``responses_create_params.metadata["script"]`` (a JSON *string*, as
Responses metadata is a string -> string map: the data row drives it) or, for a request with none,
``scripts[first user message]`` given to the fake (``start(scripts=...)``; the dict may be changed
while it runs). The step taken is the number of function calls already in the request (Responses
``function_call`` items in ``input``, chat ``tool_calls`` of assistant messages). Past the end of
the script it answers the text ``(fake model: script exhausted)``. A request without a script, or
with one that does not parse, gets a 400 that says so (simple_agent turns it into a 500 from
``/run`` that quotes it).

Routes: ``GET /v1/models`` (and ``/models``, for Gym's model-endpoint probe), ``POST /v1/responses``
(and ``/responses``), ``POST /v1/chat/completions`` (and ``/chat/completions``), ``GET /``
(readiness). ``apis=("chat",)`` leaves the Responses routes out (an endpoint with chat alone).

Use it

* from a test: ``model = start()`` (any free port; ``start(port=P)`` for a fixed one) runs it on a
  thread with its own event loop; ``model.base_url`` is ``http://127.0.0.1:<port>/v1``,
  ``model.requests`` lists every ``(path, body)`` received, ``model.served`` every model reply's
  ``(path, when it began, seconds spent on it)`` by time.monotonic, ``model.stop()`` (or ``stop(model)``) stops it. ``FakeModel`` is
  also a context manager;
* as a process: ``python -m tests.gym.fake_model --port P`` (from the repo root) or
  ``python tests/gym/fake_model.py --port P``; it prints ``fake model listening on <base_url>`` and
  serves until SIGINT or SIGTERM. ``--port 0`` picks a free port (read it from that line).

Only the standard library and aiohttp are used, so it runs in the project's Python or in the Gym venv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


def first_user_text(body: dict) -> str | None:
    """The text of the first user message of a Responses ``input`` or chat ``messages``."""
    items = body.get("input") if "input" in body else body.get("messages")
    if isinstance(items, str):
        return items
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and item.get("role") == "user" and item.get("type", "message") == "message":
            content = item.get("content")
            if isinstance(content, list):
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return str(content)
    return None


def parse_script(body: dict, scripts: dict | None = None) -> list[dict]:
    """The list of steps from ``body["metadata"]["script"]`` (a JSON string), else from
    ``scripts`` by the first user message, checked."""
    metadata = body.get("metadata") or {}
    if (not isinstance(metadata, dict) or "script" not in metadata) and scripts \
            and first_user_text(body) in scripts:
        metadata = {"script": json.dumps(scripts[first_user_text(body)])}
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
            or isinstance(step.get("refusal"), str)
            or (isinstance(step.get("tool"), str)
                and (isinstance(step.get("args", {}), dict) or "raw_args" in step)))
        if not ok:
            raise ScriptError(f"fake model: script step {i} is neither {{\"tool\": name, \"args\": {{...}}}} "
                              f"nor {{\"text\": \"...\"}}: {step!r}")
    return script


def count_function_calls(body: dict) -> int:
    """The function calls the conversation holds so far (Responses items, or chat tool_calls)."""
    if isinstance(body.get("messages"), list):
        return sum(len(m.get("tool_calls") or []) for m in body["messages"]
                   if isinstance(m, dict) and m.get("role") == "assistant")
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
    if "refusal" in step:
        return {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                "content": [{"type": "refusal", "refusal": step["refusal"]}]}
    return {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": step["text"], "annotations": []}]}


def step_of(body: dict, scripts: dict | None = None) -> tuple[dict, int]:
    """The step a request takes, and its index (raises ScriptError)."""
    script = parse_script(body, scripts)
    index = count_function_calls(body)
    return (script[index] if index < len(script) else {"text": "(fake model: script exhausted)"}), index


def respond(body: dict, scripts: dict | None = None) -> dict:
    """The Responses object answering one ``POST /v1/responses`` body (raises ScriptError)."""
    step, index = step_of(body, scripts)
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


def respond_chat(body: dict, scripts: dict | None = None) -> dict:
    """The chat completion answering one ``POST /v1/chat/completions`` body (raises ScriptError)."""
    step, index = step_of(body, scripts)
    n = next(_ids)
    message: dict[str, Any] = {"role": "assistant", "content": None}
    finish = "stop"
    if "tool" in step:
        arguments = step["raw_args"] if "raw_args" in step else json.dumps(step.get("args", {}))
        message["tool_calls"] = [{"id": f"call_{index}_{n}", "type": "function",
                                  "function": {"name": step["tool"], "arguments": arguments}}]
        finish = "tool_calls"
    elif "refusal" in step:
        message["refusal"], finish = step["refusal"], "content_filter"
    else:
        message["content"] = step["text"]
    prompt_tokens = max(1, len(json.dumps(body.get("messages", ""))) // 4)
    completion_tokens = max(1, len(json.dumps(message)) // 4)
    return {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or MODEL_ID,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def make_app(requests: list | None = None, scripts: dict | None = None,
             apis: tuple[str, ...] = ("responses", "chat"), served: list | None = None,
             released: Any = None) -> web.Application:
    """The aiohttp app; every ``(path, parsed body)`` received is appended to ``requests``, every
    model reply's ``(path, began, seconds)`` to ``served`` (by time.monotonic); a hang waits for
    ``released`` (an asyncio.Event), else an hour."""
    log = requests if requests is not None else []
    spent = served if served is not None else []
    faults_seen: dict[str, int] = {}

    async def fault(body: dict) -> web.Response | None:
        """The fault this request meets before its step, if any is left."""
        try:
            step, index = step_of(body, scripts)
        except ScriptError:
            return None
        before = step.get("before") or []
        key = json.dumps([first_user_text(body), (body.get("metadata") or {}).get("script"), index])
        seen = faults_seen.get(key, 0)
        if seen >= len(before):
            return None
        faults_seen[key] = seen + 1
        what = before[seen]
        if what == "hang":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(released.wait() if released else asyncio.sleep(3600), 3600)
            return web.json_response({"error": {"message": "fake model: released from a hang"}},
                                     status=503)
        status, words = (what.get("status", 500), what.get("message")) if isinstance(what, dict) \
            else (int(what), None)
        return web.json_response({"error": {"message": words or f"fake model: a scripted {status}",
                                            "type": "server_error"}}, status=status,
                                 headers={"Retry-After": "0"} if status == 429 else None)

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
        started = time.monotonic()
        try:
            faulted = await fault(body)
            if faulted is not None:
                return faulted
            return web.json_response((respond_chat if request.path.endswith("/chat/completions")
                                      else respond)(body, scripts))
        except ScriptError as exc:
            return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error"}},
                                     status=400)
        finally:
            spent.append((request.path, started, time.monotonic() - started))

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/", root)
    for prefix in ("/v1", ""):
        app.router.add_get(f"{prefix}/models", models)
        if "responses" in apis:
            app.router.add_post(f"{prefix}/responses", responses)
        if "chat" in apis:
            app.router.add_post(f"{prefix}/chat/completions", responses)
    return app


class FakeModel:
    """The fake on a background thread with its own event loop."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", enter: Any = None,
                 scripts: dict | None = None, apis: tuple[str, ...] = ("responses", "chat")):
        self.host, self.port, self.enter = host, port, enter    # enter: a namespace to listen in
        self.scripts, self.apis = scripts if scripts is not None else {}, apis
        self.served: list[tuple[str, float, float]] = []
        self._released: asyncio.Event | None = None
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
        return [body for path, body in self.requests
                if path.endswith(("/responses", "/chat/completions"))]

    def start(self) -> "FakeModel":
        ready = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            self._released = asyncio.Event()
            self._runner = web.AppRunner(make_app(self.requests, self.scripts, self.apis, self.served,
                                                  self._released), access_log=None)
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
            if self._released is not None:
                self._loop.call_soon_threadsafe(self._released.set)     # a hang ends now
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        self._thread = None

    def __enter__(self) -> "FakeModel":
        return self if self._thread else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start(port: int = 0, host: str = "127.0.0.1", enter: Any = None, scripts: dict | None = None,
          apis: tuple[str, ...] = ("responses", "chat")) -> FakeModel:
    """Start the fake on a thread; ``port=0`` picks a free port (see ``.port``). ``enter`` moves
    the thread into a network namespace first (LoopbackNamespace.enter); ``scripts`` are the
    scripts by first user message, ``apis`` the APIs it speaks."""
    return FakeModel(port, host, enter, scripts, apis).start()


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
