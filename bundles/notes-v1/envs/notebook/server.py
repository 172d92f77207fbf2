"""notebook: a tiny AgentEnv MCP env server, standard library only.

It serves:
  GET    /.well-known/agent-env.json  the env card
  POST   /agentenv/ext/preload        the preload extension: {"notes": {title: text}}
  POST   /mcp                         MCP streamable HTTP (JSON-RPC 2.0, plain JSON replies)
  DELETE /mcp                         ends an MCP session

The notebook lives in this process and is shared by every MCP session.
"""

import json
import os
import signal
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = os.environ.get("ENVIRONMENT_NAME", "notebook")
HOST = os.environ.get("MCP_HOST", "0.0.0.0")
PORT = int(os.environ.get("MCP_PORT", "18765"))
PROTOCOL_VERSIONS = ("2025-06-18", "2025-03-26", "2024-11-05", "2025-11-25")
PRELOAD_URI = "urn:notes-v1:preload/v1"
HIDDEN = {"agentenv.io/hiddenByDefault": True}

# --- state ---------------------------------------------------------------------------
LOCK = threading.Lock()
NOTES: dict[str, str] = {}    # title -> text
AUTHORS: dict[str, str] = {}  # title -> AgentEnv-Role of the last writer, when one was sent
SESSIONS: set[str] = set()    # live Mcp-Session-Id values


# --- tools -----------------------------------------------------------------------------
def _schema(*names):
    props = {n: {"type": "string"} for n in names}
    return {"type": "object", "properties": props, "required": list(names), "additionalProperties": False}


TOOLS = [
    {"name": "write_note", "description": "Save a note under a title (overwrites a note with that title).",
     "inputSchema": _schema("title", "text")},
    {"name": "read_note", "description": "Read the text of the note with this title.",
     "inputSchema": _schema("title")},
    {"name": "list_notes", "description": "List the titles of all notes, one per line.",
     "inputSchema": _schema()},
    {"name": "dump_notes", "description": "All notes as JSON {title: text}. For verifiers.",
     "inputSchema": _schema(), "_meta": HIDDEN},
]
SCHEMAS = {t["name"]: t["inputSchema"] for t in TOOLS}


def call_tool(name, args, role):
    """Run a tool; returns (text, is_error)."""
    if name not in SCHEMAS:
        return f"unknown tool '{name}'; the tools are: {', '.join(SCHEMAS)}", True
    schema = SCHEMAS[name]
    if not isinstance(args, dict):
        return f"{name}: arguments must be an object", True
    for key in args:
        if key not in schema["properties"]:
            return f"{name}: unexpected argument '{key}'", True
    for key in schema["required"]:
        if not isinstance(args.get(key), str):
            return f"{name}: argument '{key}' is required and must be a string", True
    with LOCK:
        if name == "write_note":
            NOTES[args["title"]] = args["text"]
            if role:
                AUTHORS[args["title"]] = role
                print(f"notebook: role {role!r} wrote {args['title']!r}", file=sys.stderr, flush=True)
            return f"saved note '{args['title']}'", False
        if name == "read_note":
            if args["title"] in NOTES:
                return NOTES[args["title"]], False
            return f"no note titled '{args['title']}'; the notes are: {', '.join(sorted(NOTES))}", True
        if name == "list_notes":
            return "\n".join(sorted(NOTES)) or "(no notes)", False
        return json.dumps(NOTES, sort_keys=True), False  # dump_notes


CARD = {
    "name": NAME, "protocolVersion": "1.0", "url": "/agentenv", "preferredTransport": "JSONRPC",
    "additionalInterfaces": [{"url": "/mcp", "transport": "mcp"}],
    "capabilities": {
        "extensions": [{"uri": PRELOAD_URI, "description": "Preload notes before the agent's turn.",
                        "params": {"endpoint": "/agentenv/ext/preload"}}],
        # The card lists every tool, hidden ones too, without the _meta flag.
        "tools": [{k: t[k] for k in ("name", "description", "inputSchema")} for t in TOOLS],
        "operations": [],
    },
    "children_environments": None,
}


# --- MCP JSON-RPC ----------------------------------------------------------------------
def rpc_error(msg_id, code, message):
    return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}


def handle_rpc(msg, role):
    """Answer one JSON-RPC request (never a notification): a response object."""
    method, params, msg_id = msg["method"], msg.get("params") or {}, msg["id"]
    if not isinstance(params, dict):
        return rpc_error(msg_id, -32602, "Invalid params: params must be an object")
    if method == "initialize":
        asked = params.get("protocolVersion")
        result = {"protocolVersion": asked if asked in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[0],
                  "capabilities": {"tools": {"listChanged": False}},
                  "serverInfo": {"name": NAME, "version": "1.0"}}
    elif method == "ping":
        result = {}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        text, is_error = call_tool(params.get("name"), params.get("arguments", {}), role)
        result = {"content": [{"type": "text", "text": text}], "isError": is_error}
    else:
        return rpc_error(msg_id, -32601, f"Method not found: {method}")
    return {"jsonrpc": "2.0", "id": msg_id, "result": result}


# --- HTTP ------------------------------------------------------------------------------
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every reply sets Content-Length
    # Headers and body go out in two writes; without this, Nagle's algorithm holds the body
    # back until the client's delayed ACK, about 40 ms a reply.
    disable_nagle_algorithm = True

    def log_message(self, *args):  # keep stderr to the one "listening" line
        pass

    def reply(self, status, body=None, headers=None):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                data += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()  # the blank line after the last chunk
            return data
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self):
        if self.path == "/.well-known/agent-env.json":
            self.reply(200, CARD)
        elif self.path == "/mcp":  # no server-initiated SSE stream
            self.reply(405, {"error": "GET is not supported; POST JSON-RPC to /mcp"}, {"Allow": "POST, DELETE"})
        else:
            self.reply(404, {"error": f"no route {self.path}"})

    def do_DELETE(self):
        if self.path != "/mcp":
            return self.reply(404, {"error": f"no route {self.path}"})
        sid = self.headers.get("Mcp-Session-Id")
        with LOCK:
            known = sid in SESSIONS
            SESSIONS.discard(sid)
        self.reply(200 if known else 404, {"ok": known})

    def do_POST(self):
        raw = self.body()
        if self.path == "/agentenv/ext/preload":
            self.preload(raw)
        elif self.path == "/mcp":
            self.mcp(raw)
        else:
            self.reply(404, {"error": f"no route {self.path}"})

    def preload(self, raw):
        try:
            notes = json.loads(raw)["notes"]
            assert isinstance(notes, dict) and all(isinstance(v, str) for v in notes.values())
        except (ValueError, KeyError, TypeError, AssertionError):
            return self.reply(400, {"error": 'the body must be {"notes": {"<title>": "<text>", ...}}'})
        with LOCK:
            NOTES.update(notes)
        self.reply(200, {"ok": True, "count": len(notes)})

    def mcp(self, raw):
        try:
            msg = json.loads(raw)
        except ValueError:
            return self.reply(400, rpc_error(None, -32700, "Parse error"))
        if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0" or not isinstance(msg.get("method"), str):
            return self.reply(400, rpc_error(msg.get("id") if isinstance(msg, dict) else None,
                                             -32600, "Invalid Request: one JSON-RPC 2.0 message expected"))
        headers = {}
        if msg["method"] == "initialize":
            headers["Mcp-Session-Id"] = sid = uuid.uuid4().hex
            with LOCK:
                SESSIONS.add(sid)
        else:
            sid = self.headers.get("Mcp-Session-Id")
            if not sid:
                return self.reply(400, rpc_error(msg.get("id"), -32600, "Bad Request: Missing session ID"))
            with LOCK:
                known = sid in SESSIONS
            if not known:
                return self.reply(404, rpc_error(msg.get("id"), -32600, "Session not found"))
        if "id" not in msg:  # a notification (e.g. notifications/initialized): accepted, no reply
            return self.reply(202, None, headers)
        self.reply(200, handle_rpc(msg, self.headers.get("AgentEnv-Role")), headers)


def main():
    server = ThreadingHTTPServer((HOST, PORT), Handler)
    # serve_forever() runs in this (main) thread, so shut it down from another one.
    stop = lambda *_: threading.Thread(target=server.shutdown).start()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"notebook: env '{NAME}' listening on http://{HOST}:{PORT}", file=sys.stderr, flush=True)
    server.serve_forever()
    server.server_close()


if __name__ == "__main__":
    main()
