"""LocalSwarm targets for the bounded-memory bulk transfer test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import numpy as np

from peers.rpc import CallContext
from peers.testing import Node, peak_rss_bytes, rss_bytes

PROTOCOL = "/test/bulk/1.0.0"
CHUNK_ITEMS = 1 << 20  # 4 MiB of uint32 per frame


async def receiver(node: Node) -> None:
    total_items = int(node.options["num_bytes"]) // 4
    baseline = rss_bytes()
    destination = np.empty(total_items, dtype=np.uint32)

    async def receive(
        requests: AsyncIterator[np.ndarray], context: CallContext
    ) -> AsyncIterator[dict[str, int]]:
        offset = 0
        mismatches = 0
        async for chunk in requests:
            end = offset + len(chunk)
            destination[offset:end] = chunk
            if not np.array_equal(chunk, np.arange(offset, end, dtype=np.uint32)):
                mismatches += 1
            offset = end
        yield {
            "received_items": offset,
            "mismatches": mismatches,
            "baseline_rss": baseline,
            "peak_rss": peak_rss_bytes(),
        }

    node.peer.add_stream_handler(PROTOCOL, receive, np.ndarray)
    node.report({"event": "serving"})


async def sender(node: Node) -> None:
    command = await node.receive()
    total_items = int(command["num_bytes"]) // 4
    baseline = rss_bytes()
    array = np.arange(total_items, dtype=np.uint32)

    def chunks() -> Iterator[np.ndarray]:
        for start in range(0, total_items, CHUNK_ITEMS):
            yield array[start : start + CHUNK_ITEMS]  # views: no copy of the array

    summaries = [
        s
        async for s in node.peer.call_stream(
            command["to"], PROTOCOL, chunks(), dict[str, int], timeout=300
        )
    ]
    node.report(
        {
            "event": "sent",
            "summary": summaries[0],
            "baseline_rss": baseline,
            "peak_rss": peak_rss_bytes(),
        }
    )
