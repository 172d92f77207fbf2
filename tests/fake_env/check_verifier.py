"""check: the fake bundle's verifier artifact (artifacts/check/verify.py), for agentenv.py's tests.

It reads what was said in the env through its hidden tool ``dump``: the agent passes if it said
"hello".
"""
import json
import urllib.request


def rpc(url, method, params):
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json",
                                                 "Accept": "application/json, text/event-stream"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


async def verify(mcp_url):
    rpc(mcp_url, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                "clientInfo": {"name": "check", "version": "1"}})
    reply = rpc(mcp_url, "tools/call", {"name": "dump", "arguments": {}})
    state = json.loads(reply["result"]["content"][0]["text"])
    return [{"id": "said_hello", "result": "hello" in state["said"],
             "description": "the agent said hello"}]
