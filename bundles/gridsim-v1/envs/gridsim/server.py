"""gridsim: the GridSim AgentEnv MCP env server, standard library only.

One process plays one operating day of one battery. It serves:
  GET    /.well-known/agent-env.json  the env card
  POST   /agentenv/ext/day            the extension urn:gridsim:day/v1: sets the day
  POST   /mcp                         MCP streamable HTTP (JSON-RPC 2.0, plain JSON replies)
  DELETE /mcp                         ends an MCP session

Tools: ``submit_schedule`` (the model's) and the hidden ``grade`` (the verifier's). The rules,
the optimum and the score are those of battery.py, beside this file.
"""

import json
import os
import signal
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import battery

NAME = os.environ.get("ENVIRONMENT_NAME", "gridsim")
HOST = os.environ.get("MCP_HOST", "0.0.0.0")
PORT = int(os.environ.get("MCP_PORT", "18765"))
PROTOCOL_VERSIONS = ("2025-06-18", "2025-03-26", "2024-11-05", "2025-11-25")
DAY_URI = "urn:gridsim:day/v1"
DAY_ENDPOINT = "/agentenv/ext/day"
HIDDEN = {"agentenv.io/hiddenByDefault": True}

# --- state ---------------------------------------------------------------------------
LOCK = threading.Lock()
SESSIONS: set = set()   # live Mcp-Session-Id values
DAY: dict = {}          # set by the day extension: task_id, hub, date, battery, cents, optimum
PLAY: dict = {"last_valid": None, "profit": None, "submissions": 0, "invalid": 0}


def set_day(args):
    """Check and store the day; returns what to answer. ValueError says what is wrong."""
    if not isinstance(args, dict):
        raise ValueError("the body must be a JSON object")
    for key in ("task_id", "hub", "date"):
        if not isinstance(args.get(key), str) or not args[key]:
            raise ValueError(f"{key} must be a non-empty string")
    bat = battery.Battery.from_dict(args.get("battery"))
    cents = battery.prices_cents(args.get("prices_usd_per_mwh"))
    best, plan = battery.optimum(cents, bat)
    with LOCK:
        DAY.clear()
        DAY.update(task_id=args["task_id"], hub=args["hub"], date=args["date"], battery=bat,
                   cents=cents, optimum=best, optimal_schedule=plan)
        PLAY.update(last_valid=None, profit=None, submissions=0, invalid=0)
    print(f"gridsim: day {args['task_id']} set; optimum profit {battery.dollars(best)}",
          file=sys.stderr, flush=True)
    return {"ok": True, "task_id": args["task_id"]}


# --- tools -----------------------------------------------------------------------------
SUBMIT_DESCRIPTION = (
    "Submit the battery's schedule for the day: exactly 24 integers, one action per hour, hour 1 "
    "first. An action a > 0 charges a MWh from the grid (you pay a x price); a < 0 discharges |a| "
    "MWh and sells |a| x efficiency MWh (you earn that x price); 0 idles. Every action is in [-P, P] "
    "and the charge must stay in [0, E] after every hour. Answers with the schedule's profit, or, "
    "for a schedule that breaks a rule, the hour and the rule. You may submit again: your last "
    "valid schedule is the one scored.")

TOOLS = [
    {"name": "submit_schedule", "description": SUBMIT_DESCRIPTION,
     "inputSchema": {"type": "object", "properties": {"schedule": {
         "type": "array", "items": {"type": "integer"}, "minItems": 24, "maxItems": 24,
         "description": "24 integer actions in MWh, hour 1 (00:00-01:00) first"}},
         "required": ["schedule"], "additionalProperties": False}},
    {"name": "grade", "description": "The day's score as JSON: score, profit, optimum profit and "
     "whether a valid schedule was submitted. For verifiers.",
     "inputSchema": {"type": "object", "properties": {}, "additionalProperties": False},
     "_meta": HIDDEN},
]
TOOL_NAMES = [t["name"] for t in TOOLS]


def submit_schedule(args):
    if set(args) != {"schedule"}:
        extra = sorted(set(args) - {"schedule"})
        if extra:
            return f"submit_schedule: unexpected argument(s) {extra}; it takes only 'schedule'", True
        return "submit_schedule: the argument 'schedule' (a list of 24 integers) is required", True
    with LOCK:
        if not DAY:
            return "no day is set in this env yet, so there is nothing to schedule", True
        bat, cents = DAY["battery"], DAY["cents"]
        PLAY["submissions"] += 1
        try:
            schedule = battery.validate(args["schedule"], bat)
        except battery.InvalidSchedule as exc:
            PLAY["invalid"] += 1
            kept = ("your last valid schedule still counts" if PLAY["last_valid"] is not None
                    else "no valid schedule has been submitted yet")
            return f"invalid schedule, not recorded: {exc}. ({kept})", True
        value = battery.profit(schedule, cents, bat)
        PLAY.update(last_valid=schedule, profit=value)
        end = battery.charges(schedule, bat)[-1]
    return (f"valid schedule recorded: profit {battery.dollars(value)} for the day; charge at the "
            f"end of hour 24: {end} MWh. This is now your submitted schedule (the last valid one "
            "counts); you may submit again."), False


def grade():
    with LOCK:
        if not DAY:
            return "no day is set in this env, so there is nothing to grade", True
        best, got = DAY["optimum"], PLAY["profit"]
        result = {
            "task_id": DAY["task_id"],
            "score": battery.score(got, best),
            "profit": None if got is None else battery.to_float(got),
            "optimum_profit": battery.to_float(best),
            "profit_units": got, "optimum_units": best,
            "valid_submission": got is not None,
            "submissions": PLAY["submissions"], "invalid_submissions": PLAY["invalid"],
            "schedule": PLAY["last_valid"],
        }
    return json.dumps(result), False


def call_tool(name, args):
    """Run a tool; returns (text, is_error)."""
    if name not in TOOL_NAMES:
        return f"unknown tool {name!r}; the tools are: submit_schedule", True
    if not isinstance(args, dict):
        return f"{name}: arguments must be an object", True
    if name == "submit_schedule":
        return submit_schedule(args)
    if args:
        return f"grade: takes no arguments, got {sorted(args)}", True
    return grade()


CARD = {
    "name": NAME, "protocolVersion": "1.0", "url": "/agentenv", "preferredTransport": "JSONRPC",
    "additionalInterfaces": [{"url": "/mcp", "transport": "mcp"}],
    "capabilities": {
        "extensions": [{"uri": DAY_URI,
                        "description": "Set the operating day: task_id, hub, date, battery "
                                       "{power_mw, duration_h, capacity_mwh, round_trip_efficiency, "
                                       "initial_charge_mwh} and the 24 prices_usd_per_mwh.",
                        "params": {"endpoint": DAY_ENDPOINT}}],
        # The card lists every tool, hidden ones too, without the _meta flag.
        "tools": [{k: t[k] for k in ("name", "description", "inputSchema")} for t in TOOLS],
        "operations": [],
    },
    "children_environments": None,
}


# --- MCP JSON-RPC ----------------------------------------------------------------------
def rpc_error(msg_id, code, message):
    return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}


def handle_rpc(msg):
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
        text, is_error = call_tool(params.get("name"), params.get("arguments") or {})
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

    def log_message(self, *args):  # keep stderr to the lines this server prints itself
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
        if self.path == DAY_ENDPOINT:
            self.day(raw)
        elif self.path == "/mcp":
            self.mcp(raw)
        else:
            self.reply(404, {"error": f"no route {self.path}"})

    def day(self, raw):
        try:
            self.reply(200, set_day(json.loads(raw)))
        except ValueError as exc:   # json.JSONDecodeError is a ValueError too
            self.reply(400, {"error": f"{DAY_URI}: {exc}"})

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
        self.reply(200, handle_rpc(msg), headers)


def main():
    server = ThreadingHTTPServer((HOST, PORT), Handler)
    # serve_forever() runs in this (main) thread, so shut it down from another one.
    stop = lambda *_: threading.Thread(target=server.shutdown).start()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"gridsim: env '{NAME}' listening on http://{HOST}:{PORT}", file=sys.stderr, flush=True)
    server.serve_forever()
    server.server_close()


if __name__ == "__main__":
    main()
