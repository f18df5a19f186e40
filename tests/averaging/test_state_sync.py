"""State sync: a newcomer downloads named tensors from several donors, verified.

Pure parts (layout, snapshot, manifest checks, the chunk schedule) are tested without a
loop; the networked parts on loopback with several peers in one loop; the 256 MiB
download with a donor SIGKILLed mid-way with real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from multiaddr import Multiaddr

from averaging.state.donor import StateServer, StateServerConfig
from averaging.state.manifest import (
    CHUNKS_PROTOCOL,
    DIGEST_BYTES,
    MANIFEST_PROTOCOL,
    ChunkRequest,
    ChunkResponse,
    DonorError,
    Layout,
    Manifest,
    ManifestRequest,
    StateSyncError,
    StateSyncTimeout,
    TensorSpec,
    VersionGoneError,
    build_snapshot,
    byte_view,
    layout_from_manifest,
    state_checksum,
)
from averaging.state.records import StateSyncConfig
from averaging.state.schedule import ChunkSchedule
from averaging.state.sync import load_state_from_peers
from peers.dht import DHT, DHTConfig
from peers.errors import RemoteError
from peers.host import Peer
from peers.rpc import CallContext
from peers.runtime import run
from peers.testing import LocalSwarm

TARGETS = Path(__file__).parent / "targets" / "state_sync.py"
CHUNK = 64 * 1024
#: Fast failure detection for tests where a donor misbehaves on purpose.
FAST = StateSyncConfig(chunk_timeout=2.0, manifest_timeout=5.0)


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few MB of mixed dtypes, including a 0-d and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(512, 1024, generator=g),  # 2 MiB float32
        "block.weight": torch.randn(300, 1000, generator=g).to(torch.bfloat16),
        "block.bias": torch.randn(1000, generator=g).to(torch.float16),
        "tokens": torch.randint(-(2**62), 2**62, (5000,), generator=g, dtype=torch.int64),
        "mask": torch.rand(777, generator=g) > 0.5,
        "phase": torch.randn(33, generator=g).to(torch.complex64),
        "empty": torch.empty(0, 7),
        "step": torch.tensor(1234, dtype=torch.int64),
    }


def assert_same_state(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(loaded) == list(expected)
    for name, tensor in expected.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name


# --- pure parts -------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [4096, 5000, 65536, 1 << 22])
def test_layout_segments_cover_every_byte_once(chunk_bytes: int) -> None:
    specs = [
        TensorSpec("a", "float32", [1000, 3]),
        TensorSpec("empty", "int64", [0]),
        TensorSpec("scalar", "int64", []),
        TensorSpec("b", "bfloat16", [4097]),
        TensorSpec("c", "bool", [3]),
    ]
    layout = Layout(specs, chunk_bytes)
    assert layout.total_bytes == 12000 + 0 + 8 + 8194 + 3
    covered = []
    for index in range(layout.num_chunks):
        start, end = layout.chunk_range(index)
        segments = layout.segments(index)
        assert sum(e - s for _, s, e in segments) == end - start
        for tensor, s, e in segments:
            assert 0 <= s < e <= layout.sizes[tensor]
            covered.append((layout.offsets[tensor] + s, layout.offsets[tensor] + e))
    position = 0
    for s, e in covered:  # contiguous, in order, no gap and no overlap
        assert s == position
        position = e
    assert position == layout.total_bytes
    with pytest.raises(IndexError):
        layout.chunk_range(layout.num_chunks)


def test_snapshot_digests_match_parts_and_checksum_ignores_chunk_size() -> None:
    state = make_state()
    small = build_snapshot(3, state, {"step": 3}, chunk_bytes=4096)
    large = build_snapshot(3, state, {"step": 3}, chunk_bytes=1 << 20)
    for index in range(small.layout.num_chunks):
        digest = hashlib.sha256(b"".join(p.tobytes() for p in small.chunk_parts(index)))
        expected = small.manifest.chunk_digests[index * 32 : (index + 1) * 32]
        assert digest.digest() == expected
    assert small.manifest.state_checksum == large.manifest.state_checksum
    assert small.manifest.chunk_digests != large.manifest.chunk_digests
    other_metadata = build_snapshot(3, state, {"step": 4}, chunk_bytes=4096)
    assert other_metadata.manifest.state_checksum != small.manifest.state_checksum
    changed = dict(state, step=torch.tensor(1235))
    assert build_snapshot(3, changed).manifest.state_checksum != small.manifest.state_checksum


def test_snapshot_copies_unless_told_not_to() -> None:
    state = {"w": torch.zeros(10)}
    copied = build_snapshot(0, state)
    shared = build_snapshot(0, state, copy=False)
    state["w"] += 1
    assert copied.tensors[0].sum() == 0
    assert shared.tensors[0].sum() == 10


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"version": -1}, ValueError),
        ({"tensors": {"w": [1.0]}}, TypeError),
        ({"tensors": {"": torch.zeros(1)}}, ValueError),
        ({"metadata": {"blob": b"x" * (2 << 20)}}, ValueError),
        ({"metadata": {"f": object()}}, TypeError),
        ({"chunk_bytes": 10}, ValueError),
    ],
)
def test_build_snapshot_refuses_what_cannot_be_served(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    args: dict[str, Any] = {"version": 1, "tensors": {"w": torch.zeros(3)}, "metadata": None}
    args.update(kwargs)
    version, tensors, metadata = args.pop("version"), args.pop("tensors"), args.pop("metadata")
    with pytest.raises(error):
        build_snapshot(version, tensors, metadata, **args)


def _good_manifest() -> Manifest:
    return build_snapshot(1, make_state(), {"step": 1}, chunk_bytes=CHUNK).manifest


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": -5}, "negative version"),
        ({"chunk_bytes": 1}, "chunk size"),
        ({"chunk_bytes": 1 << 30}, "chunk size"),
        ({"chunk_digests": b"x" * 31}, "chunk digests"),
        ({"state_checksum": b"short"}, "state checksum"),
        ({"metadata": b"\xc1garbage"}, "metadata"),
        ({"metadata": b"\x01\x93\x01\x02\x03"}, "metadata"),  # a list, not a dict
        ({"tensors": [TensorSpec("a", "float32", [2]), TensorSpec("a", "float32", [2])]}, "name"),
        ({"tensors": [TensorSpec("a", "object", [2])]}, "dtype"),
        ({"tensors": [TensorSpec("a", "float32", [-1])]}, "shape"),
        ({"tensors": [TensorSpec("a", "float32", [1] * 40)]}, "shape"),
        ({"tensors": [TensorSpec("a", "float64", [1 << 20, 1 << 20])]}, "more than"),
    ],
)
def test_garbage_manifests_are_the_donors_fault(change: dict[str, Any], message: str) -> None:
    manifest = dataclasses.replace(_good_manifest(), **change)
    with pytest.raises(DonorError, match=message):
        layout_from_manifest(manifest, max_state_bytes=1 << 30)


def test_schedule_hands_out_work_and_requeues_a_failed_donors_chunks() -> None:
    schedule: ChunkSchedule[str] = ChunkSchedule(6)
    for donor in ("a", "b"):
        schedule.add_donor(donor)
    assert [schedule.next_chunk("a"), schedule.next_chunk("a")] == [0, 1]
    assert [schedule.next_chunk("b"), schedule.next_chunk("b")] == [2, 3]
    assert schedule.expected("a") == 0
    schedule.received("a", 0, 10)
    assert schedule.fail("a", "died") == [1]
    assert schedule.next_chunk("a") is None  # a failed donor gets nothing
    assert schedule.next_chunk("b") == 1  # the failed donor's chunk comes first
    with pytest.raises(ValueError):
        schedule.received("a", 1, 10)
    for index in (2, 3, 1):
        schedule.received("b", index, 10)
    assert [schedule.next_chunk("b"), schedule.next_chunk("b"), schedule.next_chunk("b")] == [
        4,
        5,
        None,
    ]
    schedule.received("b", 4, 10)
    schedule.received("b", 5, 10)
    assert schedule.complete and schedule.num_retried == 1
    assert schedule.donors["a"].failure == "died" and schedule.donors["b"].num_chunks == 5
    assert schedule.active_donors == ["b"]


def test_configs_check_themselves() -> None:
    with pytest.raises(ValueError):
        StateSyncConfig(num_parallel_requests=1)
    with pytest.raises(ValueError):
        StateSyncConfig(chunk_timeout=0)
    with pytest.raises(ValueError):
        StateServerConfig(announce_interval_seconds=200, announce_ttl_seconds=100)
    with pytest.raises(ValueError):
        StateServerConfig(chunk_bytes=1 << 30)


# --- one loop, several peers --------------------------------------------------------------


async def _serve(
    stack: contextlib.AsyncExitStack,
    state: dict[str, torch.Tensor],
    *,
    version: int = 5,
    metadata: dict[str, Any] | None = None,
    copy: bool = True,
    dht_peers: list[str] | None = None,
    config: StateServerConfig | None = None,
) -> tuple[Peer, StateServer]:
    peer = await stack.enter_async_context(Peer())
    dht = None
    if dht_peers is not None:
        dht = await stack.enter_async_context(DHT(peer, DHTConfig(initial_peers=tuple(dht_peers))))
    server = await stack.enter_async_context(
        StateServer(
            peer,
            dht=dht,
            prefix="run" if dht else None,
            config=config or StateServerConfig(chunk_bytes=CHUNK),
        )
    )
    await server.set_state(version, state, metadata or {"step": version}, copy=copy)
    return peer, server


def run_with_stack(test: Callable[[contextlib.AsyncExitStack], Awaitable[None]]) -> None:
    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await test(stack)

    run(main())


def _addr(peer: Peer) -> str:
    return str(peer.listen_addrs[0])


@pytest.mark.timeout(60)
def test_three_donors_one_newcomer_exact_copy() -> None:
    state = make_state()

    async def test(stack: contextlib.AsyncExitStack) -> None:
        donors = [await _serve(stack, state, metadata={"step": 5, "epoch": 2}) for _ in range(3)]
        newcomer = await stack.enter_async_context(Peer())
        seen: list[tuple[int, int]] = []
        loaded = await load_state_from_peers(
            newcomer,
            donors=[_addr(p) for p, _ in donors],
            timeout=30,
            on_progress=lambda done, total: seen.append((done, total)),
        )
        assert_same_state(loaded.tensors, state)
        assert loaded.version == 5 and loaded.metadata == {"step": 5, "epoch": 2}
        report = loaded.report
        total = sum(t.numel() * t.element_size() for t in state.values())
        assert report.num_bytes == total == sum(d.num_bytes for d in report.donors)
        assert set(report.donors_used) == {p.peer_id for p, _ in donors}
        assert report.failed_donors == () and report.num_chunks_retried == 0
        assert report.num_chunks == -(-total // CHUNK) == len(seen)
        assert seen[-1] == (total, total)
        expected = build_snapshot(5, state, {"step": 5, "epoch": 2}, chunk_bytes=1 << 20)
        assert loaded.state_checksum == expected.manifest.state_checksum
        served = sum(s.statistics().num_bytes_served for _, s in donors)
        assert served == total

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_discovery_through_the_dht_picks_the_newest_version() -> None:
    old, new = make_state(1), make_state(2)

    async def test(stack: contextlib.AsyncExitStack) -> None:
        first_peer, first = await _serve(stack, new, version=8, dht_peers=[])
        boot = [_addr(first_peer)]
        servers = [first]
        servers.append((await _serve(stack, new, version=8, dht_peers=boot))[1])
        servers.append((await _serve(stack, old, version=7, dht_peers=boot))[1])
        for server in servers:
            assert await server.announce()
        newcomer = await stack.enter_async_context(Peer())
        dht = await stack.enter_async_context(DHT(newcomer, DHTConfig(initial_peers=tuple(boot))))
        loaded = await load_state_from_peers(newcomer, dht=dht, prefix="run", timeout=30)
        assert loaded.version == 8
        assert_same_state(loaded.tensors, new)
        assert set(loaded.report.donors_used) == {servers[0].peer.peer_id, servers[1].peer.peer_id}
        with pytest.raises(StateSyncError, match="no donor found"):
            await load_state_from_peers(newcomer, dht=dht, prefix="other-run", timeout=30)

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_a_donor_serving_corrupted_chunks_is_dropped() -> None:
    state = make_state()

    async def test(stack: contextlib.AsyncExitStack) -> None:
        good = [await _serve(stack, state) for _ in range(2)]
        rotten_state = {k: v.clone() for k, v in state.items()}
        bad_peer, _ = await _serve(stack, rotten_state, copy=False)
        for tensor in rotten_state.values():  # the snapshot now disagrees with its digests
            byte_view(tensor)[::97] ^= 1
        newcomer = await stack.enter_async_context(Peer())
        loaded = await load_state_from_peers(
            newcomer, donors=[_addr(bad_peer)] + [_addr(p) for p, _ in good], timeout=30
        )
        assert_same_state(loaded.tensors, state)
        (bad,) = [d for d in loaded.report.donors if d.peer_id == bad_peer.peer_id]
        assert bad.num_chunks == 0 and bad.failure is not None and "bad checksum" in bad.failure
        assert loaded.report.failed_donors == (bad_peer.peer_id,)
        assert loaded.report.num_chunks_retried >= 1

    run_with_stack(test)


# A rogue donor: the real manifest of the state (or a broken one), and a chunk handler
# that misbehaves in one way.
Rogue = Callable[[Manifest, ChunkRequest], Awaitable[ChunkResponse | None]]


async def _rogue(
    stack: contextlib.AsyncExitStack,
    state: dict[str, torch.Tensor],
    *,
    manifest_change: dict[str, Any] | None = None,
    chunk: Rogue | None = None,
    handler_ended: asyncio.Event | None = None,
) -> Peer:
    snapshot = build_snapshot(5, state, {"step": 5}, chunk_bytes=CHUNK)
    manifest = dataclasses.replace(snapshot.manifest, **(manifest_change or {}))
    peer = await stack.enter_async_context(Peer())

    async def rpc_manifest(request: ManifestRequest, context: CallContext) -> Manifest:
        return manifest

    async def rpc_chunks(
        requests: AsyncIterator[ChunkRequest], context: CallContext
    ) -> AsyncIterator[ChunkResponse]:
        try:
            async for request in requests:
                if chunk is None:
                    yield ChunkResponse(request.index, snapshot.chunk_parts(request.index))
                    continue
                response = await chunk(manifest, request)
                if response is None:
                    return
                yield response
        finally:
            if handler_ended is not None:
                handler_ended.set()

    peer.add_unary_handler(MANIFEST_PROTOCOL, rpc_manifest, ManifestRequest)
    peer.add_stream_handler(CHUNKS_PROTOCOL, rpc_chunks, ChunkRequest)
    return peer


async def _wrong_size(manifest: Manifest, request: ChunkRequest) -> ChunkResponse:
    return ChunkResponse(request.index, [np.zeros(10, dtype=np.uint8)])


async def _wrong_index(manifest: Manifest, request: ChunkRequest) -> ChunkResponse:
    return ChunkResponse(request.index + 1, [])


async def _wrong_dtype(manifest: Manifest, request: ChunkRequest) -> ChunkResponse:
    return ChunkResponse(request.index, [np.zeros(CHUNK // 4, dtype=np.float32)])


async def _hang_up(manifest: Manifest, request: ChunkRequest) -> None:
    return None


async def _stall(manifest: Manifest, request: ChunkRequest) -> None:
    await asyncio.Event().wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("manifest_change", "chunk", "reason"),
    [
        ({"chunk_digests": b"x" * DIGEST_BYTES}, None, "chunk digests"),
        ({"tensors": [TensorSpec("huge", "float64", [1 << 30, 1 << 10])]}, None, "more than"),
        ({"metadata": b"\x00\x00garbage"}, None, "metadata"),
        ({"version": 3}, None, None),  # older: simply not chosen
        (None, _wrong_size, "wrong size"),
        (None, _wrong_dtype, "wrong size or type"),
        (None, _wrong_index, "was due"),
        (None, _hang_up, "closed the stream"),
        (None, _stall, "sent no chunk"),
    ],
    ids=[
        "digests",
        "oversized",
        "metadata",
        "older",
        "wrong-size",
        "wrong-dtype",
        "wrong-index",
        "hang-up",
        "stall",
    ],
)
def test_bad_donor_data_costs_only_that_donor(
    manifest_change: dict[str, Any] | None, chunk: Rogue | None, reason: str | None
) -> None:
    state = make_state()

    async def test(stack: contextlib.AsyncExitStack) -> None:
        rogue = await _rogue(stack, state, manifest_change=manifest_change, chunk=chunk)
        good, _ = await _serve(stack, state)
        newcomer = await stack.enter_async_context(Peer())
        loaded = await load_state_from_peers(
            newcomer, donors=[_addr(rogue), _addr(good)], timeout=30, config=FAST
        )
        assert_same_state(loaded.tensors, state)
        (report,) = [d for d in loaded.report.donors if d.peer_id == rogue.peer_id]
        assert report.num_chunks == 0
        if reason is None:
            assert report.failure is None
        else:
            assert report.failure is not None and reason in report.failure, report.failure
            if chunk is not None:  # it held chunks when it failed: they were fetched again
                assert loaded.report.num_chunks_retried >= 1

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_a_new_round_resumes_with_the_chunks_already_verified() -> None:
    state = make_state()
    snapshot = build_snapshot(5, state, {"step": 5}, chunk_bytes=CHUNK)
    num_served = 0

    async def serve_a_few(manifest: Manifest, request: ChunkRequest) -> ChunkResponse | None:
        nonlocal num_served
        num_served += 1
        if num_served > 6:
            return None  # hangs up, owing chunks
        return ChunkResponse(request.index, snapshot.chunk_parts(request.index))

    async def test(stack: contextlib.AsyncExitStack) -> None:
        quitter = await _rogue(stack, state, chunk=serve_a_few)
        good, _ = await _serve(stack, state)
        newcomer = await stack.enter_async_context(Peer())
        one_at_a_time = dataclasses.replace(FAST, max_donors=1)
        loaded = await load_state_from_peers(
            newcomer, donors=[_addr(quitter), _addr(good)], timeout=30, config=one_at_a_time
        )
        assert_same_state(loaded.tensors, state)
        first, second = loaded.report.donors
        assert first.peer_id == quitter.peer_id and first.num_chunks == 6
        assert first.failure is not None and "closed the stream" in first.failure
        assert second.num_chunks == loaded.report.num_chunks - 6 and second.failure is None

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_an_error_in_the_progress_callback_is_the_callers() -> None:
    state = make_state()

    def progress(done: int, total: int) -> None:
        raise KeyError("caller's bug")

    async def test(stack: contextlib.AsyncExitStack) -> None:
        donor, _ = await _serve(stack, state)
        newcomer = await stack.enter_async_context(Peer())
        with pytest.raises(KeyError, match="caller's bug"):
            await load_state_from_peers(
                newcomer, donors=[_addr(donor)], timeout=30, on_progress=progress
            )

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_no_usable_donor_is_a_clear_error() -> None:
    state = make_state()

    async def test(stack: contextlib.AsyncExitStack) -> None:
        newcomer = await stack.enter_async_context(Peer())
        with pytest.raises(StateSyncError, match="no donor found"):
            await load_state_from_peers(newcomer, donors=[], timeout=10)
        async with Peer() as gone:
            dead = _addr(gone)
        with pytest.raises(StateSyncError, match="DialError"):
            await load_state_from_peers(newcomer, donors=[dead], timeout=10, config=FAST)
        rogues = [await _rogue(stack, state, chunk=_wrong_size) for _ in range(2)]
        with pytest.raises(StateSyncError, match="wrong size") as caught:
            await load_state_from_peers(
                newcomer, donors=[_addr(r) for r in rogues], timeout=10, config=FAST
            )
        assert not isinstance(caught.value, TimeoutError)
        with pytest.raises(ValueError):
            await load_state_from_peers(newcomer)

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_bad_requests_get_remote_errors_and_the_donor_keeps_serving() -> None:
    state = make_state()

    async def test(stack: contextlib.AsyncExitStack) -> None:
        donor, server = await _serve(stack, state, version=5)
        caller = await stack.enter_async_context(Peer())
        await caller.connect(_addr(donor))
        with pytest.raises(RemoteError, match="version 4 is not served") as caught:
            await caller.call_unary(
                donor.peer_id, MANIFEST_PROTOCOL, ManifestRequest(4), Manifest, timeout=10
            )
        assert caught.value.remote_type == "VersionGoneError"
        for request, refusal in (
            (ChunkRequest(5, 10**6), "StateRequestError"),
            (ChunkRequest(5, -1), "StateRequestError"),
            (ChunkRequest(9, 0), "VersionGoneError"),
        ):
            with pytest.raises(RemoteError) as caught:
                async for _ in caller.call_stream(
                    donor.peer_id, CHUNKS_PROTOCOL, [request], ChunkResponse, timeout=10
                ):
                    pass
            assert caught.value.remote_type == refusal
        with pytest.raises(RemoteError):  # not a ChunkRequest at all
            async for _ in caller.call_stream(
                donor.peer_id, CHUNKS_PROTOCOL, ["garbage"], ChunkResponse, timeout=10
            ):
                pass
        # a good request after bad ones on the same stream: answered, then the error
        got = []
        with pytest.raises(RemoteError, match="out of range"):
            async for response in caller.call_stream(
                donor.peer_id,
                CHUNKS_PROTOCOL,
                [ChunkRequest(5, 0), ChunkRequest(5, 10**6)],
                ChunkResponse,
                timeout=10,
            ):
                got.append(response.index)
        assert got == [0]
        loaded = await load_state_from_peers(caller, donors=[_addr(donor)], timeout=30)
        assert_same_state(loaded.tensors, state)
        stats = server.statistics()
        assert stats.num_requests_refused >= 5 and stats.versions == (5,)

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_versions_are_frozen_and_the_oldest_dropped() -> None:
    states = [make_state(seed) for seed in range(3)]

    async def test(stack: contextlib.AsyncExitStack) -> None:
        original = {k: v.clone() for k, v in states[0].items()}
        config = StateServerConfig(chunk_bytes=CHUNK, hold_seconds=0)  # see the next test
        donor, server = await _serve(stack, states[0], version=1, config=config)
        for tensor in states[0].values():  # training goes on: version 1 must not change
            byte_view(tensor)[:] ^= 1
        newcomer = await stack.enter_async_context(Peer())
        loaded = await load_state_from_peers(newcomer, donors=[_addr(donor)], timeout=30)
        assert_same_state(loaded.tensors, original)
        await server.set_state(2, states[1])
        await server.set_state(3, states[2])
        assert server.versions == (2, 3)
        with pytest.raises(ValueError, match="not newer"):
            await server.set_state(3, states[2])
        loaded = await load_state_from_peers(newcomer, donors=[donor.peer_id], version=2)
        assert loaded.version == 2
        assert_same_state(loaded.tensors, states[1])
        with pytest.raises(StateSyncError, match="version 1 is not served"):
            await load_state_from_peers(newcomer, donors=[donor.peer_id], version=1, timeout=10)

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_a_version_a_newcomer_asked_for_is_held_past_newer_ones_up_to_the_cap() -> None:
    """A peer that sets versions faster than a newcomer downloads one (a small model
    trained fast) keeps the version the newcomer is fetching, past ``num_versions_kept``,
    up to ``max_versions_held`` versions in all."""
    states = [make_state(seed) for seed in range(7)]

    async def test(stack: contextlib.AsyncExitStack) -> None:
        donor, server = await _serve(stack, states[1], version=1)
        caller = await stack.enter_async_context(Peer())
        await caller.connect(_addr(donor))

        async def ask(version: int) -> None:
            await caller.call_unary(
                donor.peer_id, MANIFEST_PROTOCOL, ManifestRequest(version), Manifest, timeout=10
            )

        await ask(1)
        for version in (2, 3, 4):
            await server.set_state(version, states[version])
        assert server.versions == (1, 3, 4)  # 2 was never asked for: dropped
        loaded = await load_state_from_peers(caller, donors=[donor.peer_id], version=1)
        assert_same_state(loaded.tensors, states[1])
        await ask(3)
        await ask(4)
        await server.set_state(5, states[5])
        assert server.versions == (1, 3, 4, 5)
        await server.set_state(6, states[6])
        assert server.versions == (3, 4, 5, 6)  # the cap: the oldest held one goes
        with pytest.raises(StateSyncError, match="version 1 is not served"):
            await load_state_from_peers(caller, donors=[donor.peer_id], version=1, timeout=10)

    run_with_stack(test)


def test_bad_hold_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_versions_held"):
        StateServerConfig(num_versions_kept=3, max_versions_held=2)
    with pytest.raises(ValueError, match="max_versions_held"):
        StateServerConfig(max_versions_held=9)
    with pytest.raises(ValueError, match="hold_seconds"):
        StateServerConfig(hold_seconds=-1)


@pytest.mark.timeout(60)
def test_a_donor_that_moves_on_under_a_download_is_asked_again() -> None:
    """A donor answering that the version being downloaded is no longer served has not
    failed: the newcomer asks it again and loads what it serves now. One that moves on
    under every download is dropped after a few, with a clear error."""
    states = [make_state(seed) for seed in range(3)]

    async def test(stack: contextlib.AsyncExitStack) -> None:
        newcomer = await stack.enter_async_context(Peer())
        once = await _moving_donor(stack, states, moves=1)
        loaded = await load_state_from_peers(newcomer, donors=[_addr(once)], timeout=30)
        assert loaded.version == 1 and loaded.report.failed_donors == ()
        assert_same_state(loaded.tensors, states[1])
        always = await _moving_donor(stack, states, moves=100)
        with pytest.raises(StateSyncError, match="VersionGoneError") as caught:
            await load_state_from_peers(newcomer, donors=[_addr(always)], timeout=30)
        assert not isinstance(caught.value, TimeoutError)

    run_with_stack(test)


async def _moving_donor(
    stack: contextlib.AsyncExitStack, states: list[dict[str, torch.Tensor]], *, moves: int
) -> Peer:
    """A donor that sets a new version after each download's first chunk, ``moves``
    times: its manifest names the newest, its chunks only the newest's."""
    snapshots = [build_snapshot(v, s, {"step": v}, chunk_bytes=CHUNK) for v, s in enumerate(states)]
    current = [0]
    peer = await stack.enter_async_context(Peer())

    async def rpc_manifest(request: ManifestRequest, context: CallContext) -> Manifest:
        return snapshots[current[0] % len(snapshots)].manifest

    async def rpc_chunks(
        requests: AsyncIterator[ChunkRequest], context: CallContext
    ) -> AsyncIterator[ChunkResponse]:
        async for request in requests:
            snapshot = snapshots[current[0] % len(snapshots)]
            if request.version != snapshot.manifest.version:
                raise VersionGoneError(f"version {request.version} is not served here")
            yield ChunkResponse(request.index, snapshot.chunk_parts(request.index))
            if current[0] < moves:
                current[0] += 1

    peer.add_unary_handler(MANIFEST_PROTOCOL, rpc_manifest, ManifestRequest)
    peer.add_stream_handler(CHUNKS_PROTOCOL, rpc_chunks, ChunkRequest)
    return peer


@pytest.mark.timeout(60)
def test_donors_that_disagree_are_outvoted() -> None:
    state, other = make_state(1), make_state(2)

    async def test(stack: contextlib.AsyncExitStack) -> None:
        odd, _ = await _serve(stack, other)
        agreeing = [await _serve(stack, state) for _ in range(2)]
        newcomer = await stack.enter_async_context(Peer())
        donors = [_addr(odd)] + [_addr(p) for p, _ in agreeing]
        loaded = await load_state_from_peers(newcomer, donors=donors, timeout=30)
        assert_same_state(loaded.tensors, state)
        assert odd.peer_id not in loaded.report.donors_used

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_a_lone_newer_state_needs_a_quorum_and_may_not_run_ahead() -> None:
    """One donor offering a newer state (a volunteer claiming it is far ahead) against
    two that agree: with a quorum of 2 the two win; ``max_version`` refuses the newer
    one outright, and says why."""
    state, lone = make_state(1), make_state(2)

    async def test(stack: contextlib.AsyncExitStack) -> None:
        ahead, _ = await _serve(stack, lone, version=10**9)
        agreeing = [await _serve(stack, state, version=5) for _ in range(2)]
        newcomer = await stack.enter_async_context(Peer())
        donors = [_addr(ahead)] + [_addr(p) for p, _ in agreeing]
        loaded = await load_state_from_peers(newcomer, donors=donors, quorum=2, timeout=30)
        assert loaded.version == 5 and ahead.peer_id not in loaded.report.donors_used
        assert_same_state(loaded.tensors, state)
        loaded = await load_state_from_peers(newcomer, donors=donors, max_version=6, timeout=30)
        assert loaded.version == 5 and loaded.report.failed_donors == (ahead.peer_id,)
        (report,) = [d for d in loaded.report.donors if d.peer_id == ahead.peer_id]
        assert report.failure is not None and "ahead of the 6" in report.failure
        # without either, the newest wins: the behaviour a run must not rely on
        loaded = await load_state_from_peers(newcomer, donors=donors, timeout=30)
        assert loaded.version == 10**9
        with pytest.raises(StateSyncError, match="none is offered by 3 distinct"):
            await load_state_from_peers(newcomer, donors=donors, quorum=3, timeout=30)

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_a_state_that_does_not_fit_costs_only_its_donor() -> None:
    state = make_state()
    misfit = {**state, "embed.weight": torch.zeros(3, 3)}

    def check(version: int, specs: Any, metadata: dict[str, Any]) -> str | None:
        shapes = {s.name: tuple(s.shape) for s in specs}
        want = tuple(state["embed.weight"].shape)
        return None if shapes.get("embed.weight") == want else "embed.weight has a wrong shape"

    async def test(stack: contextlib.AsyncExitStack) -> None:
        bad, bad_server = await _serve(stack, misfit, version=9)
        good, _ = await _serve(stack, state, version=5)
        newcomer = await stack.enter_async_context(Peer())
        loaded = await load_state_from_peers(
            newcomer, donors=[_addr(bad), _addr(good)], check=check, timeout=30
        )
        assert loaded.version == 5 and loaded.report.failed_donors == (bad.peer_id,)
        assert bad_server.statistics().num_bytes_served == 0  # refused on its manifest
        with pytest.raises(StateSyncError, match=r"does not fit: embed\.weight"):
            await load_state_from_peers(newcomer, donors=[_addr(bad)], check=check, timeout=30)

    run_with_stack(test)


def test_support_counts_networks_not_identities() -> None:
    """Three identities behind one public /24 support a state once; two LAN hosts and
    two loopback processes count twice."""
    from averaging.state.sync import _choose_group, _Offer
    from peers import KeyPair
    from peers.subnets import source_group

    def offer(seed: int, version: int, addr: str) -> _Offer:
        manifest = build_snapshot(version, make_state(seed), {}, chunk_bytes=CHUNK).manifest
        layout = layout_from_manifest(manifest, max_state_bytes=1 << 30)
        peer_id = KeyPair.generate().peer_id
        return _Offer(peer_id, manifest, layout, source_group(Multiaddr(addr), peer_id))

    sybils = [offer(1, 9, f"/ip4/93.184.216.{i}/tcp/4001") for i in (5, 6, 7)]
    honest = [offer(2, 8, "/ip4/151.101.1.9/tcp/1"), offer(2, 8, "/ip6/2a00:1450:1::1/tcp/1")]
    assert _choose_group([*sybils, *honest], quorum=2) == honest
    assert _choose_group([*sybils, *honest], quorum=3) == []
    assert _choose_group([*sybils, *honest]) == sybils  # quorum 1: the newest
    lan = [offer(3, 7, "/ip4/192.168.1.2/tcp/1"), offer(3, 7, "/ip4/192.168.1.3/tcp/1")]
    local = [offer(4, 7, "/ip4/127.0.0.1/tcp/1"), offer(4, 7, "/ip4/127.0.0.1/tcp/2")]
    assert _choose_group([*sybils, *lan], quorum=2) == lan
    assert _choose_group([*sybils, *local], quorum=2) == local
    one = KeyPair.generate().peer_id
    relayed = "/ip4/93.184.216.1/tcp/1/p2p/{}/p2p-circuit"
    assert source_group(Multiaddr(relayed.format(one)), one) == "net/93.184.216.0/24"
    assert source_group(Multiaddr("/ip6/2a00:1450:5:6::1/tcp/1"), one) == "net/2a00:1450:5::/48"
    assert source_group(None, one) == f"peer/{one.to_base58()}"


@pytest.mark.timeout(60)
def test_deadline_raises_and_cancellation_stops_the_donors_handlers() -> None:
    state = make_state()

    async def test(stack: contextlib.AsyncExitStack) -> None:
        staller = await _rogue(stack, state, chunk=_stall)
        newcomer = await stack.enter_async_context(Peer())
        with pytest.raises(StateSyncTimeout, match="0 of"):
            await load_state_from_peers(newcomer, donors=[_addr(staller)], timeout=1.0)

        asked, ended = asyncio.Event(), asyncio.Event()

        async def stall_once_asked(manifest: Manifest, request: ChunkRequest) -> None:
            asked.set()
            await asyncio.Event().wait()

        donor = await _rogue(stack, state, chunk=stall_once_asked, handler_ended=ended)
        task = asyncio.ensure_future(
            load_state_from_peers(newcomer, donors=[_addr(donor)], timeout=30)
        )
        async with asyncio.timeout(20):
            await asked.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with asyncio.timeout(10):  # the call's stream was reset: the handler stops
            await ended.wait()

    run_with_stack(test)


def test_whole_state_checksum_covers_layout() -> None:
    views = [np.zeros(8, dtype=np.uint8)]
    a = state_checksum(Layout([TensorSpec("a", "int64", [1])], 4096), b"", views)
    b = state_checksum(Layout([TensorSpec("a", "float64", [1])], 4096), b"", views)
    assert a != b


# --- real processes -----------------------------------------------------------------------

STATE_SEED = 1234
NUM_DONORS = 3
KILL_AT_FRACTION = 0.3


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_256_mib_from_three_donor_processes_survives_a_sigkill() -> None:
    with LocalSwarm() as swarm:
        donors = swarm.start(
            NUM_DONORS, target=f"{TARGETS}:donor", options={"state_seed": STATE_SEED}
        )
        (newcomer,) = swarm.start(1, target=f"{TARGETS}:newcomer")
        serving = [d.wait_report("serving", 120) for d in donors]
        assert len({s["state_checksum"] for s in serving}) == 1
        victim = donors[0]
        newcomer.send(
            {
                "donors": [d.maddr for d in donors],
                "kill_pid": serving[0]["pid"],
                "kill_at_fraction": KILL_AT_FRACTION,
            }
        )
        loaded = newcomer.wait_report("loaded", 120)
        victim.popen.wait(10)
        assert victim.popen.returncode == -signal.SIGKILL
    assert loaded["killed_at_fraction"] >= KILL_AT_FRACTION
    assert loaded["digest"] == serving[1]["digest"]  # hashed independently on both sides
    assert loaded["state_checksum"] == serving[1]["state_checksum"]
    assert loaded["num_bytes"] == serving[1]["num_bytes"] >= 256 * 2**20
    assert loaded["failed_donors"] == [victim.peer_id]
    assert loaded["num_chunks_retried"] >= 1
    survivors = {d.peer_id for d in donors[1:]}
    assert survivors <= set(loaded["bytes_by_donor"])  # the victim may have sent nothing yet
    seconds = loaded["seconds"]
    print(
        f"256 MiB from {NUM_DONORS} donors, one killed at {loaded['killed_at_fraction']:.0%}: "
        f"{seconds:.2f} s, {loaded['num_bytes'] / seconds / 1e6:.0f} MB/s; retried "
        f"{loaded['num_chunks_retried']} chunks; extra memory "
        f"{loaded['extra_rss_bytes'] / 2**20:.0f} MiB"
    )
    #: Beyond the state itself: the yamux windows of three streams (<= 16 MiB each), the
    #: frames being decoded, allocator slack. A download that buffered the state twice
    #: would be 256 MiB over.
    assert loaded["extra_rss_bytes"] < 160 * 2**20
