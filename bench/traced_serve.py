"""traced_serve.py: agentenv.py serve under tracemalloc, for finding where a long run's memory goes.

    python bench/soak.py --agentenv bench/traced_serve.py --signal USR1 --json traced.json ...

soak.py starts it as it would start agentenv.py (``traced_serve.py serve BUNDLE ...``). At every
SIGUSR1 (soak.py's --signal sends one at each sample, with the server idle) it writes, into
$TRACED_DIR (default: a folder named traced-<pid> in the temp folder), snap-NNN.pickle (a
tracemalloc snapshot, 12 frames deep: compare two with Snapshot.compare_to), and objs-NNN.json
(the traced total, the 60 commonest object types, and glibc's mallinfo2: in use, free held, arena).
"""

import collections
import ctypes
import gc
import json
import os
import signal
import sys
import tempfile
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("TRACED_DIR") or Path(tempfile.gettempdir()) / f"traced-{os.getpid()}")


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def dump(*_: object) -> None:
    dump.n += 1
    gc.collect()
    tracemalloc.take_snapshot().dump(str(OUT / f"snap-{dump.n:03d}.pickle"))
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    info = libc.mallinfo2()
    (OUT / f"objs-{dump.n:03d}.json").write_text(json.dumps({
        "n": dump.n, "traced_bytes": tracemalloc.get_traced_memory()[0],
        "types": collections.Counter(type(o).__name__ for o in gc.get_objects()).most_common(60),
        "mallinfo2": {name: getattr(info, name) for name, _ in Mallinfo2._fields_}}))


dump.n = 0

if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"traced_serve.py: snapshots go to {OUT}", flush=True)
    tracemalloc.start(12)
    signal.signal(signal.SIGUSR1, dump)
    import agentenv
    sys.exit(agentenv.main(sys.argv[1:]))
