"""check_schedule: how good is the battery schedule the model submitted?

Calls the gridsim env's hidden `grade` tool over MCP streamable HTTP and returns one row whose score
is the day's score (0 for no valid schedule, 0.2 for idling, 1 for the optimum; see the bundle's
README). The task's verifier step aggregates it with `weighted_average`, so the reward is the score.
Standard library only; the blocking HTTP runs in a worker thread.
"""

import asyncio
import json
import urllib.request

PROTOCOL_VERSION = "2025-06-18"


def _post(url, message, session_id=None):
    """POST one JSON-RPC message; returns (session id, the JSON-RPC response or None)."""
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": PROTOCOL_VERSION}
    if session_id:
        headers["Mcp-Session-Id"] = session_id
    request = urllib.request.Request(url, json.dumps(message).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        session_id = response.headers.get("Mcp-Session-Id") or session_id
        body = response.read().decode()
        if "id" not in message:  # a notification: 202, no body
            return session_id, None
        if response.headers.get_content_type() == "text/event-stream":
            # SSE: an event's `data:` lines hold a JSON-RPC message; take the reply to our request.
            for event in body.replace("\r\n", "\n").split("\n\n"):
                data = "\n".join(line[5:].lstrip(" ") for line in event.split("\n")
                                 if line.startswith("data:"))
                if not data:
                    continue
                try:
                    reply = json.loads(data)
                except ValueError:
                    continue
                if isinstance(reply, dict) and reply.get("id") == message["id"]:
                    return session_id, reply
            raise RuntimeError(f"no reply to request {message['id']} in the event stream")
        return session_id, json.loads(body)


def _grade(mcp_url):
    """Open an MCP session, call grade, end the session; returns the grade as a dict."""
    sid, _ = _post(mcp_url, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
        "clientInfo": {"name": "check_schedule", "version": "1.0"}}})
    _post(mcp_url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, sid)
    _, reply = _post(mcp_url, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                               "params": {"name": "grade", "arguments": {}}}, sid)
    try:  # end the session; not fatal if the server doesn't allow it
        urllib.request.urlopen(urllib.request.Request(
            mcp_url, headers={"Mcp-Session-Id": sid}, method="DELETE"), timeout=10).close()
    except OSError:
        pass
    result = reply.get("result")
    if not result or result.get("isError"):
        raise RuntimeError(f"grade failed: {reply}")
    return json.loads(result["content"][0]["text"])


async def verify(mcp_url):
    grade = await asyncio.to_thread(_grade, mcp_url)
    score = float(grade["score"])
    if grade["valid_submission"]:
        description = (f"the last valid schedule made ${grade['profit']:.4f} against the day's "
                       f"optimum of ${grade['optimum_profit']:.4f}: score {score:.4f} "
                       "(0.2 + 0.8 x profit / optimum; a loss scores below 0.2)")
    else:
        description = (f"no valid schedule was submitted ({grade['submissions']} submission(s), all "
                       f"invalid): score 0")
    return [{"id": "schedule_score", "result": score >= 0.999, "score": score,
             "description": description}]
