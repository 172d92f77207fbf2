"""fake: a small AgentEnv MCP env server for agentenv.py's tests (standard library only).

The fast suite (test_agentenv.py) writes this file as envs/<env>/server.py of each fake bundle it
makes; the env's Dockerfile switches what it does with ENV lines:

* FAKE_MODE: ``serve`` (the default), ``exit`` (says why and exits with code 4 at start), ``deaf``
  (starts and never listens), ``notools`` (lists no tools), ``endless`` (lists its tools on the
  first page of a tools/list whose pages never end).
* TOOL_PREFIX: put before every tool's name (two envs of one turn need different names).
* CARD_NAME: the name on its card, when it is not the env's own (ENVIRONMENT_NAME).
* FAKE_PIDDIR: a folder where it records its pid, so a test can tell that no env outlived it.

It serves the card at /.well-known/agent-env.json, MCP at /mcp and the extension
urn:fake:config/v1 at /ext/config. Some tests patch this source (``fake_server_with`` in
test_agentenv.py inserts code before a line of it: the line that makes the server, the dump tool's
spec, the dump tool's branch in call()), so keep those lines as they are.
"""
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = os.environ.get("ENVIRONMENT_NAME", "fake")
MODE = os.environ.get("FAKE_MODE", "serve")
PREFIX = os.environ.get("TOOL_PREFIX", "")
if os.environ.get("FAKE_PIDDIR"):
    open(os.path.join(os.environ["FAKE_PIDDIR"], str(os.getpid())), "w").close()
if MODE == "exit":
    print(f"fake: cannot start env {NAME}: FAKE_MODE=exit", flush=True)
    sys.exit(4)
if MODE == "deaf":
    print("fake: started, but never listening", flush=True)
    time.sleep(3600)

LOCK = threading.Lock()
STATE = {"config": {}, "said": [], "roles": []}


def tool(name, description, hidden=False, **props):
    spec = {"name": PREFIX + name, "description": description,
            "inputSchema": {"type": "object", "properties": props, "required": list(props)}}
    if hidden:
        spec["_meta"] = {"agentenv.io/hiddenByDefault": True}
    return spec


TOOLS = [] if MODE == "notools" else [
    tool("say", "Say something; the verifier hears it.", text={"type": "string"}),
    tool("whoami", "The AgentEnv-Role the call came with."),
    tool("get_config", "The config that apply_server_config set."),
    tool("sleep", "Sleep for a while.", seconds={"type": "number"}),
    tool("crash", "Crash the env."),
    tool("dump", "Everything that was said, as JSON. For verifiers.", hidden=True),
]
CARD = {"name": os.environ.get("CARD_NAME", NAME),
        "additionalInterfaces": [{"url": "/mcp", "transport": "mcp"}],
        "capabilities": {"extensions": [{"uri": "urn:fake:config/v1",
                                         "params": {"endpoint": "/ext/config"}}]}}


def call(name, args, role):
    base = name[len(PREFIX):] if isinstance(name, str) and name.startswith(PREFIX) else None
    if base == "say":
        if not isinstance(args.get("text"), str):
            return "say: text must be a string", True
        with LOCK:
            STATE["said"].append(args["text"])
            STATE["roles"].append(role)
        return f"said {args['text']!r}", False
    if base == "whoami":
        return role or "(no role)", False
    if base == "get_config":
        return json.dumps(STATE["config"], sort_keys=True), False
    if base == "sleep":
        time.sleep(float(args.get("seconds", 0)))
        return "slept", False
    if base == "crash":
        print("fake: crashing on purpose", flush=True)
        os._exit(3)
    if base == "dump":
        return json.dumps(STATE, sort_keys=True), False
    return f"unknown tool {name!r}", True


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body=None, headers=()):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/.well-known/agent-env.json":
            return self.reply(200, CARD)
        self.reply(404, {"error": "no route"})

    def do_DELETE(self):
        self.reply(200, {})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/ext/config":
            args = json.loads(raw or b"{}")
            if "bad" in args:
                return self.reply(400, {"error": "bad is not a setting"})
            with LOCK:
                STATE["config"].update(args)
            return self.reply(200, {"ok": True})
        if self.path != "/mcp":
            return self.reply(404, {"error": "no route"})
        msg = json.loads(raw)
        if "id" not in msg:
            return self.reply(202)
        method, params = msg["method"], msg.get("params") or {}
        if method == "initialize":
            result = {"protocolVersion": params.get("protocolVersion"),
                      "capabilities": {"tools": {}}, "serverInfo": {"name": NAME, "version": "1"}}
        elif method == "tools/list":
            page = int(params.get("cursor") or 0)
            result = {"tools": TOOLS if page == 0 else []}
            if MODE == "endless":
                result["nextCursor"] = str(page + 1)
        elif method == "tools/call":
            text, error = call(params.get("name"), params.get("arguments") or {},
                               self.headers.get("AgentEnv-Role"))
            result = {"content": [{"type": "text", "text": text}], "isError": error}
        else:
            return self.reply(200, {"jsonrpc": "2.0", "id": msg["id"],
                                    "error": {"code": -32601, "message": f"no method {method}"}})
        self.reply(200, {"jsonrpc": "2.0", "id": msg["id"], "result": result},
                   [("Mcp-Session-Id", "fake-session")])


server = ThreadingHTTPServer(
    (os.environ.get("MCP_HOST", "127.0.0.1"), int(os.environ["MCP_PORT"])), Handler)
server.daemon_threads = True
print(f"fake: env {NAME} listening", flush=True)
server.serve_forever()
