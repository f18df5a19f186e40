"""The msgpack allocation bomb (issue 21, finding 6): one 16 MiB frame of empty arrays.

Decodes the same frame three times, each in a fresh process: with hivemind's
``MSGPackSerializer.loads`` (msgpack's defaults: what every hivemind message goes
through), as msgpack decodes it with our options but no item limit (what
``peers.serialization.unpack`` did before ``MAX_VALUE_ITEMS``), and with ``unpack`` as
it is. Figures: peak RSS growth and the seconds the decode held the thread (on a peer:
its event loop).

    .venv/bin/python benchmarks/bench_msgpack_bomb.py           # full: 16 MiB frame
    .venv/bin/python benchmarks/bench_msgpack_bomb.py --quick   # 1 MiB frame
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
from _common import emit_result, print_table

CHILD = r"""
import json, sys, time
import msgpack
from peers.serialization import SerializationError, unpack
from peers.testing import peak_rss_bytes
from peers.varint import encode_uvarint
size, mode = int(sys.argv[1]), sys.argv[2]
inner = 8192
count = size // (inner + 5)
inner_array = b"\xdd" + inner.to_bytes(4, "big") + b"\x90" * inner
head = b"\xdd" + count.to_bytes(4, "big") + inner_array * count
body = encode_uvarint(len(head)) + head
before = peak_rss_bytes()
started = time.perf_counter()
refused = False
try:
    if mode == "hivemind":
        from hivemind.utils.serializer import MSGPackSerializer
        MSGPackSerializer.loads(head)
    elif mode == "unlimited":
        msgpack.unpackb(head, use_list=True, raw=False, strict_map_key=False)
    else:
        unpack(body)
except SerializationError:
    refused = True
seconds = time.perf_counter() - started
grown = peak_rss_bytes() - before
record = {"seconds": seconds, "rss_MiB": grown / 2**20, "refused": refused}
print(json.dumps({**record, "frame_MiB": len(body) / 2**20}))
"""


def measure(size: int, mode: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(size), mode],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 1 MiB frame")
    args = parser.parse_args()
    size = (1 if args.quick else 16) * 2**20 - 64
    runs = {mode: measure(size, mode) for mode in ("hivemind", "unlimited", "ours")}
    names = {
        "hivemind": "hivemind MSGPackSerializer.loads",
        "unlimited": "ours before the item limit",
        "ours": "peers.serialization.unpack",
    }
    rows = [["decode", "peak RSS growth (MiB)", "seconds", "refused"]]
    for mode, run in runs.items():
        refused = "yes" if run["refused"] else "no"
        rows.append([names[mode], f"{run['rss_MiB']:.1f}", f"{run['seconds']:.4f}", refused])
    print_table(f"one {runs['ours']['frame_MiB']:.1f} MiB frame of empty arrays", rows)
    figures = runs
    hivemind, ours = runs["hivemind"], runs["ours"]
    ratios = {
        "memory_vs_hivemind": hivemind["rss_MiB"] / max(ours["rss_MiB"], 1.0),
        "stall_vs_hivemind": hivemind["seconds"] / max(ours["seconds"], 1e-4),
    }
    emit_result("msgpack_bomb", figures, ratios)


if __name__ == "__main__":
    main()
