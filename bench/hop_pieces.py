"""hop_pieces.py: two pieces of serve's hop timed alone, in-process, this agentenv.py beside a git
revision's, where a cut of a few microseconds is lost in the noise of a whole hop.

    python bench/hop_pieces.py --before d024bba [--rounds 7] [--json bench/hop-pieces.json]

route  aiohttp's router finding the route of a Gym tool call, POST /list_notes, in the app
       build_app makes of bundles/notes-v1 (the least of 5 runs of 20,000 resolves).
call   McpSession.call_tool("list_notes") to a canned env in the same process (an asyncio
       protocol that answers every request at once with a reply as the notebook env's): the env
       client's CPU a call, with the canned env's little (the least of 5 runs of 3,000 calls).

Each version runs in a child process of its own, the two taking turns for --rounds rounds; the
figures are the medians over rounds of each round's least, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PIECES = r"""
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
import agentenv
from aiohttp.test_utils import make_mocked_request

BODY = json.dumps({"jsonrpc": "2.0", "id": None, "result": {
    "content": [{"type": "text", "text": "pancakes"}], "isError": False}}).encode()
REPLY = (b"HTTP/1.1 200 OK\r\nServer: BaseHTTP/0.6 Python/3.11.7\r\nDate: Sat, 05 Dec 2026 03:00:00 "
         b"GMT\r\nContent-Type: application/json\r\nmcp-session-id: 0123456789abcdef\r\n"
         b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))

class CannedEnv(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
    def data_received(self, data):
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            self.transport.write(REPLY)

async def least(work, runs, n, clock):
    for _ in range(n // 5):
        await work()
    best = float("inf")
    for _ in range(runs):
        started = clock()
        for _ in range(n):
            await work()
        best = min(best, (clock() - started) / n * 1e6)
    return best

async def main():
    app = agentenv.build_app(sys.argv[2], sandbox="local")
    request = make_mocked_request("POST", "/list_notes", app=app)
    assert (await app.router.resolve(request)).route.method == "POST"
    route = await least(lambda: app.router.resolve(request), 5, 20_000, time.perf_counter)
    server = await asyncio.get_running_loop().create_server(CannedEnv, "127.0.0.1", 0)
    session = agentenv.McpSession(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/mcp")
    session.headers["Mcp-Session-Id"] = "0123456789abcdef"
    assert (await session.call_tool("list_notes", {})).text == "pancakes"
    call = await least(lambda: session.call_tool("list_notes", {}), 5, 3_000, time.process_time)
    session.drop()
    server.close()
    print(json.dumps({"route_us": route, "call_us": call}))

asyncio.run(main())
"""


def measure(program_dir: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", PIECES, str(program_dir),
                           str(ROOT / "bundles" / "notes-v1")], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the pieces of {program_dir} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the git revision to measure beside")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-pieces-") as tmp:
        before = Path(tmp)
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.before}:agentenv.py"],
                               capture_output=True, text=True)
        if shown.returncode != 0:
            sys.exit(f"git show {args.before}:agentenv.py failed: {shown.stderr.strip()}")
        (before / "agentenv.py").write_text(shown.stdout)
        rounds: dict[str, list[dict[str, float]]] = {"after": [], "before": []}
        for _ in range(args.rounds):
            rounds["after"].append(measure(ROOT))
            rounds["before"].append(measure(before))
    result = {which: {piece: statistics.median(r[piece] for r in runs)
                      for piece in ("route_us", "call_us")} for which, runs in rounds.items()}
    print(f"hop_pieces.py: medians of {args.rounds} rounds' least, in microseconds "
          f"(after: this agentenv.py; before: git {args.before})\n")
    print("| piece | after | before | after - before |\n|---|---:|---:|---:|")
    for piece, name in (("route_us", "route: resolve POST /list_notes"),
                        ("call_us", "call: McpSession.call_tool, CPU with a canned env")):
        after, before_ = result["after"][piece], result["before"][piece]
        print(f"| {name} | {after:.2f} | {before_:.2f} | {after - before_:+.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"before": args.before, "rounds": rounds,
                                               "medians": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
