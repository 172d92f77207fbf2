"""check_notes: is there a 'groceries' note that mentions eggs and milk?

Reads every note through the notebook's hidden `dump_notes` tool over MCP streamable HTTP.
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
            # SSE: each `data:` line holds a JSON-RPC message; take the reply to our request.
            for line in body.splitlines():
                if line.startswith("data:"):
                    reply = json.loads(line[5:])
                    if reply.get("id") == message["id"]:
                        return session_id, reply
            raise RuntimeError(f"no reply to request {message['id']} in the event stream")
        return session_id, json.loads(body)


def _dump_notes(mcp_url):
    """Open an MCP session, call dump_notes, end the session; returns {title: text}."""
    sid, _ = _post(mcp_url, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
        "clientInfo": {"name": "check_notes", "version": "1.0"}}})
    _post(mcp_url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, sid)
    _, reply = _post(mcp_url, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                               "params": {"name": "dump_notes", "arguments": {}}}, sid)
    try:  # end the session; not fatal if the server doesn't allow it
        urllib.request.urlopen(urllib.request.Request(
            mcp_url, headers={"Mcp-Session-Id": sid}, method="DELETE"), timeout=10).close()
    except OSError:
        pass
    result = reply.get("result")
    if not result or result.get("isError"):
        raise RuntimeError(f"dump_notes failed: {reply}")
    return json.loads(result["content"][0]["text"])


async def verify(mcp_url):
    notes = await asyncio.to_thread(_dump_notes, mcp_url)
    text = notes.get("groceries", "").lower()
    return [
        {"id": "groceries_exists", "result": "groceries" in notes,
         "description": "a note titled 'groceries' exists"},
        {"id": "mentions_eggs_and_milk", "result": "egg" in text and "milk" in text,
         "description": "its text mentions eggs and milk"},
    ]
