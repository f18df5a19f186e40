"""LocalSwarm targets for state sync: donors of a 256 MiB state made from a seed, and a
newcomer that downloads it and SIGKILLs one donor part-way through."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal

import torch

from averaging.state.donor import StateServer
from averaging.state.sync import load_state_from_peers
from peers.testing import Node, peak_rss_bytes, rss_bytes


def make_state(seed: int) -> dict[str, torch.Tensor]:
    """256 MiB (and a few bytes) of model and optimizer state, the same for one seed."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.rand(8192, 4096, generator=g),  # 128 MiB float32
        "block.weight": torch.rand(8192, 4096, generator=g, dtype=torch.bfloat16),  # 64 MiB
        "block.bias": torch.rand(4096, generator=g),
        "optimizer.exp_avg": torch.rand(4096, 4096, generator=g),  # 64 MiB
        "optimizer.step": torch.tensor(1000, dtype=torch.int64),
        "tokens_seen": torch.arange(16, dtype=torch.int64) * seed,
    }


def digest_of(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order (not the library's)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


async def donor(node: Node) -> None:
    state = make_state(int(node.options["state_seed"]))
    async with StateServer(node.peer) as server:
        # The generated tensors are never modified: serve them without a second copy.
        manifest = await server.set_state(7, state, {"step": 7}, copy=False)
        node.report(
            {
                "event": "serving",
                "pid": os.getpid(),
                "state_checksum": manifest.state_checksum.hex(),
                "digest": digest_of(state),
                "num_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            }
        )
        await asyncio.Event().wait()  # serve until the test stops us


async def newcomer(node: Node) -> None:
    command = await node.receive()
    kill_pid = int(command["kill_pid"])
    kill_at = float(command["kill_at_fraction"])
    killed_at: list[float] = []

    def on_progress(done: int, total: int) -> None:
        if not killed_at and done >= kill_at * total:
            os.kill(kill_pid, signal.SIGKILL)  # mid-download, with chunks in flight
            killed_at.append(done / total)

    baseline = rss_bytes()
    loaded = await load_state_from_peers(
        node.peer, donors=command["donors"], timeout=120, on_progress=on_progress
    )
    extra = peak_rss_bytes() - baseline - loaded.report.num_bytes
    report = loaded.report
    node.report(
        {
            "event": "loaded",
            "digest": digest_of(loaded.tensors),
            "state_checksum": loaded.state_checksum.hex(),
            "num_bytes": report.num_bytes,
            "seconds": report.seconds,
            "failed_donors": [str(p) for p in report.failed_donors],
            "num_chunks_retried": report.num_chunks_retried,
            "bytes_by_donor": {str(d.peer_id): d.num_bytes for d in report.donors if d.num_bytes},
            "killed_at_fraction": killed_at[0] if killed_at else 0.0,
            "extra_rss_bytes": extra,
        }
    )
