"""run_tests.py: pyfix-v1's trusted test runner, the one judge of a fix.

    python3 -I -S run_tests.py MODULE.py TESTS.py

It exits 0 only if every test that TESTS.py defines ran and passed, judged in this process, which
the code under test never runs in: the module is imported, and its functions called, in a child
process (``python3 -I -S``: no user site, no PYTHON* variables, no folder of the agent's on its
path), and only the values they return come back, as Python literals. So the module cannot exit
for the runner (``os._exit(0)``), patch its ``unittest``, shadow its standard library, or plant
startup hooks for it; all it can do is return values, and a value is right only if it is right.
A module that recognises the tests' inputs and returns their answers is out of this runner's
reach: only better tests catch that.

The runner runs as the agent's user (the box has no other it could hand the child), so it makes
itself undumpable first: a process of that user can then neither trace it nor read its memory or
its open files. All the module can still do to it is kill or stop it, which exits non-zero or
runs out the verifier's deadline: a score of 0 either way.
"""

import ast
import builtins
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import types
import unittest

CALL_DEADLINE = 10.0          # seconds for the module to import, and for each call to return
REPLY_CAP = 1 << 20           # bytes of one reply: a value past it fails its test

# The child: imports the module by its path (nothing else of the agent's folder is importable),
# says what it holds, then answers calls, one JSON line each, on a descriptor of its own (what the
# module prints goes to stderr).
CHILD = r"""
import ast, importlib.util, json, os, sys
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
def send(**reply):
    replies.write(json.dumps(reply) + "\n"); replies.flush()
try:
    spec = importlib.util.spec_from_file_location(sys.argv[2], sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    sys.modules[sys.argv[2]] = module
    spec.loader.exec_module(module)
except BaseException as exc:
    send(error=f"{type(exc).__name__}: {exc}"); raise SystemExit(1)
names = {}
for name, value in vars(module).items():
    if name.startswith("__"):
        continue
    if callable(value):
        names[name] = None
    else:
        try:
            ast.literal_eval(repr(value)); names[name] = repr(value)
        except Exception:
            pass
send(names=names)
for line in sys.stdin:
    name, args, kwargs = ast.literal_eval(line)
    try:
        send(value=repr(getattr(module, name)(*args, **kwargs)))
    except Exception as exc:
        send(raised=type(exc).__name__, message=str(exc)[:500])
"""


class Unjudgeable(Exception):
    """The module answered with something that is not a value of its own (or did not answer)."""


class Child:
    """The module under test, in a process of its own, asked for values one call at a time."""

    def __init__(self, module_path: str, name: str):
        self.home = tempfile.mkdtemp(prefix="pyfix-child-")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", CHILD, module_path, name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=self.home, env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": self.home,
                                "LANG": "C.UTF-8"},
            close_fds=True, start_new_session=True)
        self.pending = b""
        hello = self.reply()
        if "names" not in hello:
            raise Unjudgeable(hello.get("error") or "the module did not import")
        self.names = hello["names"]

    def reply(self) -> dict:
        """The child's next line, within CALL_DEADLINE and REPLY_CAP."""
        out = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([out], [], [], CALL_DEADLINE)
            if not ready:
                raise Unjudgeable(f"the module did not answer within {CALL_DEADLINE:g}s")
            chunk = os.read(out, 65536)
            if not chunk:
                raise Unjudgeable("the module's process ended")
            self.pending += chunk
            if len(self.pending) > REPLY_CAP:
                raise Unjudgeable(f"the module answered more than {REPLY_CAP} bytes")
        line, self.pending = self.pending.split(b"\n", 1)
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise Unjudgeable("the module's answer is not one of the child's")
        return reply

    def call(self, name: str, args: tuple, kwargs: dict):
        try:
            self.proc.stdin.write(repr((name, args, kwargs)).encode() + b"\n")
            self.proc.stdin.flush()
            reply = self.reply()
        except (OSError, ValueError) as exc:
            raise Unjudgeable(f"the module's process did not take the call: {exc}") from None
        if "value" in reply:
            try:
                return ast.literal_eval(reply["value"])
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise Unjudgeable(f"{name} returned something that is not a plain value") from None
        kind = getattr(builtins, str(reply.get("raised")), None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(reply.get("message", ""))
        raise Unjudgeable(f"{name} raised {reply.get('raised')}: {reply.get('message')}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()


def stand_in(child: Child, name: str) -> types.ModuleType:
    """A module for the tests to import in the module's place: its values as the child gave them,
    its functions calls to the child."""
    module = types.ModuleType(name)
    for attr, value in child.names.items():
        if value is None:
            setattr(module, attr, lambda *a, _attr=attr, **k: child.call(_attr, a, k))
        else:
            setattr(module, attr, ast.literal_eval(value))
    return module


def undumpable() -> None:
    """PR_SET_DUMPABLE 0: no process of this user may trace this one or open its /proc files."""
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 3
    module_path, tests_path = sys.argv[1], sys.argv[2]
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                   signal.SIGUSR2, signal.SIGALRM):
        signal.signal(number, signal.SIG_IGN)
    undumpable()
    with open(tests_path, encoding="utf-8") as file:       # read before the module ever runs
        source = file.read()
    name = os.path.splitext(os.path.basename(module_path))[0]
    try:
        child = Child(module_path, name)
    except Unjudgeable as exc:
        print(f"0 tests passed: {exc}")
        return 1
    try:
        sys.modules[name] = stand_in(child, name)
        tests = types.ModuleType(os.path.splitext(os.path.basename(tests_path))[0])
        exec(compile(source, tests_path, "exec"), vars(tests))
        suite = unittest.defaultTestLoader.loadTestsFromModule(tests)
        expected = suite.countTestCases()
        result = unittest.TestResult()
        suite.run(result)
    finally:
        child.stop()
    trouble = [*result.errors, *result.failures]
    passed = result.testsRun - len(trouble) - len(result.skipped)
    ok = (expected > 0 and result.testsRun == expected and passed == expected
          and not result.expectedFailures and not result.unexpectedSuccesses)
    print(f"{passed} of {expected} expected tests passed")
    for test, said in trouble[:5]:
        print(f"--- {test.id()}\n{said[-1500:]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
