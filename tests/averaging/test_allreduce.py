"""The networked butterfly round, in one event loop: real peers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from averaging import AllReduceConfig, AllReduceService, RoundSpec
from averaging.allreduce.agreement import sign_vote, vote_signed_by
from averaging.allreduce.config import AllReduceError
from averaging.allreduce.network import RoundRunner, _Lane, _Link
from averaging.allreduce.records import PartDigest, fingerprint_of
from averaging.allreduce.wire import (
    ALLREDUCE_PROTOCOL,
    AccusationWire,
    ChunkMessage,
    EchoMessage,
    NoticeMessage,
    SuspectMessage,
    VoteMessage,
    encode_hello,
    encode_message,
)
from averaging.compression import (
    Codec,
    EncodedTensor,
    Float16Codec,
    PowerSGDCodec,
    TopKCodec,
    Uniform8BitCodec,
)
from peers import KeyPair, Peer, PeersError
from peers.rpc import FramedStream

Run = Callable[[Coroutine[Any, Any, Any]], Any]

FAST = AllReduceConfig(
    sender_timeout=2.0, reducer_timeout=4.0, round_timeout=8.0, chunk_elements=1000
)


def _specs(
    peers: Sequence[Peer], total: int, weights: Sequence[float] | None = None, chunk: int = 1000
) -> list[RoundSpec]:
    members = tuple(p.peer_id for p in peers)
    round_id = os.urandom(16)
    bandwidths = tuple(weights or [1.0] * len(peers))
    return [
        RoundSpec(
            round_id=round_id,
            members=members,
            weights=bandwidths,
            total_elements=total,
            chunk_elements=chunk,
            me=p.peer_id,
        )
        for p in peers
    ]


async def _meet(peers: Sequence[Peer]) -> None:
    for p in peers:
        for q in peers:
            if p is not q:
                p.add_addresses(q.peer_id, q.listen_addrs)


async def _average(
    n: int,
    tensors: list[torch.Tensor],
    weights: list[float],
    config: AllReduceConfig = FAST,
    bandwidths: Sequence[float] | None = None,
) -> list[Any]:
    async with contextlib.AsyncExitStack() as stack:
        peers = [await stack.enter_async_context(Peer()) for _ in range(n)]
        services = [await stack.enter_async_context(AllReduceService(p, config)) for p in peers]
        await _meet(peers)
        specs = _specs(peers, tensors[0].numel(), bandwidths, config.chunk_elements)
        return list(
            await asyncio.gather(
                *(
                    s.run_round(spec, t, w)
                    for s, spec, t, w in zip(services, specs, tensors, weights, strict=True)
                )
            )
        )


def test_four_peers_hold_the_exact_weighted_mean(arun: Run) -> None:
    seed = 1234
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(10_007, generator=gen) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    results = arun(_average(4, tensors, weights))
    expected = sum(w * t.double() for w, t in zip(weights, tensors, strict=True)) / sum(weights)
    first = results[0].result.averaged
    for r in results:
        assert r.transfer.agreed
        assert r.result.report.failed == {}
        assert r.result.report.fraction_averaged == 1.0
        assert torch.equal(r.result.averaged, first)  # bitwise identical on every member
        assert r.transfer.bytes_sent > 0 and r.transfer.bytes_received > 0
    assert torch.allclose(first.double(), expected, atol=1e-6)


def test_a_huge_sample_weight_claim_buys_at_most_four_times_the_median(arun: Run) -> None:
    """Issue 21's "one member decides the averaged gradient": a member that claims 2**60
    samples was the whole mean. Each reducer counts it as 4x the median weight of its
    part's senders, and every member holds that mean."""
    tensors = [torch.full((8_000,), v) for v in (0.0, 1.0, 2.0, 1000.0)]
    weights = [1.0, 1.0, 1.0, 2.0**60]
    results = arun(_average(4, tensors, weights))
    expected = (0.0 + 1.0 + 2.0 + 4.0 * 1000.0) / 7.0
    first = results[0].result.averaged
    for r in results:
        assert r.transfer.agreed and r.result.report.failed == {}
        assert torch.equal(r.result.averaged, first)
    assert torch.allclose(first, torch.full((8_000,), expected))


@pytest.mark.parametrize("codec", [Float16Codec(), Uniform8BitCodec()], ids=lambda c: c.name)
def test_lossy_codec_keeps_members_identical_within_its_bound(arun: Run, codec: Any) -> None:
    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randn(50_000, generator=gen) for _ in range(3)]
    config = AllReduceConfig(
        sender_timeout=2.0,
        reducer_timeout=4.0,
        round_timeout=8.0,
        chunk_elements=4096,
        codec=codec,
    )
    results = arun(_average(3, tensors, [1.0, 1.0, 1.0], config))
    mean = torch.stack(tensors).mean(0)
    first = results[0].result.averaged
    # Two encodings: each sender's chunk, then the reducer's averaged part.
    bound = max(2.0 * codec.error_bound(t) for t in tensors) * 2 + 1e-6
    for r in results:
        assert r.transfer.agreed
        assert torch.equal(r.result.averaged, first)
    assert float((first - mean).abs().max()) <= bound


def test_a_value_float16_cannot_carry_costs_that_chunk_its_compression_not_a_peer(
    arun: Run,
) -> None:
    """A member's gradient with a value above 65504 made its float16 encode fail, which
    failed its link to the reducer, then to each heir in turn. Now that chunk (and the
    averaged chunk holding its mean) travels exact; nobody is excluded."""
    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randn(20_000, generator=gen) for _ in range(3)]
    tensors[1][12_345] = 1e6  # in the second member's part, far above float16's range
    config = dataclasses.replace(FAST, chunk_elements=4096, codec=Float16Codec())
    results = arun(_average(3, tensors, [1.0, 1.0, 1.0], config))
    first = results[0].result.averaged
    for r in results:
        assert r.transfer.agreed and not r.result.report.failed
        assert torch.equal(r.result.averaged, first)
    mean = torch.stack(tensors).mean(0)
    assert float(first[12_345]) == pytest.approx(float(mean[12_345]), rel=1e-6)
    assert float((first - mean).abs().max()) <= 4 * Float16Codec().error_bound(mean) + 1e-3


def test_uneven_bandwidth_gives_uneven_parts_and_a_zero_weight_member_reduces_nothing(
    arun: Run,
) -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(9000, generator=gen) for _ in range(3)]
    results = arun(_average(3, tensors, [1.0, 1.0, 1.0], bandwidths=[2.0, 1.0, 0.0]))
    parts = results[0].result.report.parts
    sizes = [p.end - p.start for p in parts]
    assert sizes == [6000, 3000, 0]
    mean = torch.stack(tensors).mean(0)
    for r in results:
        assert r.transfer.agreed
        assert torch.allclose(r.result.averaged, mean, atol=1e-6)


def test_a_member_that_never_starts_is_excluded_and_the_rest_agree(arun: Run) -> None:
    async def main() -> list[Any]:
        async with contextlib.AsyncExitStack() as stack:
            peers = [await stack.enter_async_context(Peer()) for _ in range(4)]
            services = [
                await stack.enter_async_context(AllReduceService(p, FAST)) for p in peers[:3]
            ]
            await _meet(peers)
            tensors = [torch.full((5000,), float(i)) for i in range(4)]
            specs = _specs(peers, 5000)
            return list(
                await asyncio.gather(
                    *(
                        s.run_round(spec, t, 1.0)
                        for s, spec, t in zip(services, specs[:3], tensors[:3], strict=True)
                    )
                )
            )

    results = arun(main())
    first = results[0].result.averaged
    for r in results:
        assert len(r.result.report.failed) == 1
        assert r.result.report.fraction_averaged == 1.0
        assert torch.equal(r.result.averaged, first)
        assert r.transfer.agreed
    assert torch.allclose(first, torch.full((5000,), 1.0))  # mean of 0, 1, 2


def test_a_link_for_an_unknown_round_is_refused_and_the_service_keeps_serving(
    arun: Run,
) -> None:
    async def main() -> list[Any]:
        config = AllReduceConfig(
            sender_timeout=2.0,
            reducer_timeout=4.0,
            round_timeout=8.0,
            join_timeout=0.5,
            chunk_elements=1000,
        )
        async with (
            Peer() as a,
            Peer() as b,
            Peer() as intruder,
            AllReduceService(a, config) as sa,
            AllReduceService(b, config) as sb,
        ):
            stream = await intruder.new_stream(
                a.listen_addrs[0].encapsulate(f"/p2p/{a.peer_id}"), ALLREDUCE_PROTOCOL
            )
            framed = FramedStream(stream)
            stranger = dataclasses.replace(_specs([a, b], 3000)[0], round_id=b"no such round")
            await framed.write_frame(encode_hello(stranger))
            with pytest.raises(PeersError):  # the refusal: a reset
                await framed.read_frame()
            await _meet([a, b])
            specs = _specs([a, b], 3000)
            tensors = [torch.zeros(3000), torch.ones(3000)]
            return list(
                await asyncio.gather(
                    sa.run_round(specs[0], tensors[0], 1.0),
                    sb.run_round(specs[1], tensors[1], 1.0),
                )
            )

    for r in arun(main()):
        assert r.transfer.agreed
        assert torch.allclose(r.result.averaged, torch.full((3000,), 0.5))


async def _liar_round(
    frames: Sequence[list[Any]] | Callable[[bytes, RoundSpec], Sequence[list[Any]]],
    keepalive: float = 0.0,
) -> list[Any]:
    """Two honest members and a liar that cannot be dialed (bandwidth 0), so it opens
    its links itself: to honest member i (who reduces part i) it sends a valid Hello,
    then ``frames[i]`` (``frames`` may be a function of the liar's id and the spec), and
    then, every ``keepalive`` seconds if set, an empty notice until the round ends."""
    config = AllReduceConfig(
        sender_timeout=2.0, reducer_timeout=4.0, round_timeout=8.0, chunk_elements=1000
    )
    async with contextlib.AsyncExitStack() as stack:
        honest = [await stack.enter_async_context(Peer()) for _ in range(2)]
        liar = await stack.enter_async_context(Peer())
        services = [await stack.enter_async_context(AllReduceService(p, config)) for p in honest]
        await _meet([*honest, liar])
        specs = _specs([*honest, liar], 3000, [1.0, 1.0, 0.0], chunk=1000)
        rounds = [
            asyncio.ensure_future(s.run_round(spec, torch.full((3000,), float(i)), 1.0))
            for i, (s, spec) in enumerate(zip(services, specs, strict=False))
        ]
        sent = frames(liar.peer_id.to_bytes(), specs[0]) if callable(frames) else frames
        links = []
        for target, frame in zip(honest, sent, strict=True):
            stream = await liar.new_stream(target.peer_id, ALLREDUCE_PROTOCOL)
            framed = FramedStream(stream)
            await framed.write_frame(encode_hello(specs[0]))
            await framed.write_frame(frame)
            links.append(framed)
        done = asyncio.gather(*rounds)
        while keepalive and not done.done():  # bounded: the rounds end by their deadline
            await asyncio.wait([done], timeout=keepalive)
            for framed in links:
                with contextlib.suppress(PeersError):
                    await framed.write_frame(encode_message(NoticeMessage([])))
        return list(await done)


def _liar_excluded(results: list[Any]) -> list[str]:
    """Checks the honest two agree on the exact mean without the liar; its exclusion
    reasons as each of them recorded it."""
    first = results[0].result.averaged
    reasons = []
    for r in results:
        assert len(r.result.report.failed) == 1  # the liar, and only it
        assert r.transfer.agreed and r.result.report.fraction_averaged == 1.0
        assert torch.equal(r.result.averaged, first)
        reasons += r.result.report.failed.values()
    assert torch.allclose(first, torch.full((3000,), 0.5))
    return reasons


def test_a_member_sending_garbage_on_its_link_is_excluded_and_the_rest_agree(arun: Run) -> None:
    """A frame that is no message at all, and one with a bad tensor."""
    garbage = ([99, {"not": "a message"}], [1, [0, 0, 1.0, ["none", "float32"]]])
    _liar_excluded(arun(_liar_round(garbage)))


@pytest.mark.parametrize(
    "bad",
    [
        "stranger_vote",
        "malformed_voter",
        "short_vote",
        "suspicion",
        "stranger_echo",
        "forged_echo",
        "malformed_accusation",
    ],
)
def test_a_member_sending_a_bad_agreement_message_is_excluded_and_the_rest_agree(
    arun: Run, bad: str
) -> None:
    """Well-formed votes, suspicions, echoes and accusations that name what they must
    not: a voter outside the round, a voter id that is no PeerID, a vote without one
    digest per part, a suspicion of a non-member, an echo naming strangers or signed
    by someone else than its echoer, an accusation naming no PeerID. Each is the
    sender's fault (it is excluded), costs the others nothing, and is refused before it
    reaches the ballot or the accusation book."""
    stranger = KeyPair.generate().peer_id.to_bytes()
    message = {
        "stranger_vote": VoteMessage(stranger, bytes(32), [], b""),
        "malformed_voter": VoteMessage(b"\x00\x01", bytes(32), [], b""),
        "short_vote": None,  # filled in below: it needs the liar's own id
        "suspicion": SuspectMessage([stranger]),
        "stranger_echo": EchoMessage(stranger, stranger, stranger, b""),
        "forged_echo": None,  # below: an echo in the liar's name, signed by nobody
        "malformed_accusation": NoticeMessage([AccusationWire(b"\x00\x01", stranger, 0, b"")]),
    }[bad]
    expected = {
        "stranger_vote": "a vote from a non-member",
        "malformed_voter": "a vote names a malformed voter",
        "short_vote": "one digest per part",
        "suspicion": "a suspicion names a non-member",
        "stranger_echo": "an echo names a non-member",
        "forged_echo": "an echo whose signature is not its echoer's",
        "malformed_accusation": "malformed member id",
    }[bad]

    def frames(liar: bytes, spec: RoundSpec) -> list[list[Any]]:
        frame: Any = message
        if bad == "short_vote":
            frame = VoteMessage(liar, bytes(32), [], b"")
        elif bad == "forged_echo":
            honest = spec.members[0].to_bytes()
            frame = EchoMessage(liar, honest, liar, bytes(64))
        return [encode_message(frame)] * 2

    reasons = _liar_excluded(arun(_liar_round(frames)))
    assert any(expected in reason for reason in reasons), reasons


def test_a_member_that_only_keeps_its_links_alive_is_excluded_before_the_give_up(
    arun: Run,
) -> None:
    """Finding 4: a member that sends no chunks, only an empty notice every half second,
    is never silent for ``sender_timeout``; it used to hold the round until the
    butterfly gave up (``round_timeout - reducer_timeout``, 4 s here). A sender that,
    at its rate so far, cannot finish before that is excluded once it has had
    ``sender_timeout`` (2 s) to show its rate."""
    results = arun(_liar_round([encode_message(NoticeMessage([]))] * 2, keepalive=0.5))
    reasons = _liar_excluded(results)  # one finds it too slow, and tells the other
    assert any("too slow" in reason for reason in reasons), reasons


def test_a_relayed_vote_must_carry_its_voters_signature(arun: Run) -> None:
    """The liar relays a vote in the other honest member's name: well formed (one digest
    per part, its fingerprint matching them, members only) and for a result nobody
    holds, but signed by the liar, not by the voter it names. Counted, it would be
    one of the two votes a three-member round needs. It is refused, the liar is
    excluded for it, and the honest two agree on their mean."""

    def frames(liar: bytes, spec: RoundSpec) -> list[list[Any]]:
        members = [m.to_bytes() for m in spec.members]
        digests = [PartDigest(i, m, members, bytes(16)) for i, m in enumerate(members)]
        fingerprint = fingerprint_of(spec.round_id, digests)
        forger = KeyPair.generate()  # any key but the voter's

        def vote_of(voter: bytes) -> list[Any]:
            signature = sign_vote(forger, fingerprint)
            return encode_message(VoteMessage(voter, fingerprint, digests, signature))

        return [vote_of(members[1]), vote_of(members[0])]  # to each, the other's "vote"

    reasons = _liar_excluded(arun(_liar_round(frames)))
    assert any("signature is not its voter's" in reason for reason in reasons), reasons


def test_a_vote_signature_binds_voter_and_fingerprint() -> None:
    alice, bob = KeyPair.generate(), KeyPair.generate()
    fingerprint = bytes(range(32))
    signature = sign_vote(alice, fingerprint)
    assert vote_signed_by(alice.peer_id, fingerprint, signature)
    assert not vote_signed_by(bob.peer_id, fingerprint, signature)
    assert not vote_signed_by(alice.peer_id, bytes(32), signature)
    assert not vote_signed_by(alice.peer_id, fingerprint, b"")
    # what else a peer signs is never a vote: the signature covers a domain tag
    assert not vote_signed_by(alice.peer_id, fingerprint, alice.sign(fingerprint))


@pytest.mark.parametrize("bad", ["nan", "inf", "dtype", "shape"])
def test_a_member_sending_a_bad_chunk_is_excluded_and_the_rest_agree(arun: Run, bad: str) -> None:
    """Well-formed chunk messages with bad values (NaN, infinity, float64, a wrong
    length), sent by a member that reduces nothing to the two that reduce a part each."""
    values = {
        "nan": np.full(1000, np.nan, dtype=np.float32),
        "inf": np.full(1000, np.inf, dtype=np.float32),
        "dtype": np.zeros(1000, dtype=np.float64),
        "shape": np.zeros(999, dtype=np.float32),
    }[bad]
    dtype = "float64" if bad == "dtype" else "float32"
    tensor = EncodedTensor("none", dtype, [len(values)], {"values": values})
    chunks = [encode_message(ChunkMessage(part, 0, 1.0, tensor)) for part in range(2)]
    reasons = _liar_excluded(arun(_liar_round(chunks)))
    # Excluded for what it sent (a member may learn of it from the other's notice), not
    # for falling silent: its other chunks never come, which would exclude it too, later.
    expected = "non-finite values" if bad in ("nan", "inf") else "not a float32 tensor"
    assert any(expected in reason for reason in reasons), reasons


@pytest.mark.parametrize("codec", [TopKCodec(), PowerSGDCodec()])
def test_a_codec_that_drops_coordinates_cannot_carry_a_round(codec: Codec) -> None:
    """Top-k in a round averaged 1% of coordinates and left the rest at zero (a round
    sends each value once; there is no error feedback to catch up)."""
    with pytest.raises(AllReduceError, match=r"cannot carry a round.*Float16Codec"):
        AllReduceConfig(codec=codec)


class _SlowCloseStream:
    """A stream whose close waits until every stream of the round is closing (or 2 s)."""

    def __init__(self, closing: list[int], everyone: asyncio.Event, count: int) -> None:
        self.closing, self.everyone, self.count = closing, everyone, count
        self.reset_called = False

    async def close(self) -> None:
        self.closing[0] += 1
        self.closing[1] = max(self.closing[1], self.closing[0])
        if self.closing[1] == self.count:
            self.everyone.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await self.everyone.wait()
        self.closing[0] -= 1

    def reset(self) -> None:
        self.reset_called = True


def test_a_rounds_links_are_closed_at_once_not_one_after_another(arun: Run) -> None:
    """Each close may wait for its remote up to FLUSH_SECONDS; closing one after
    another made a round with several slow remotes return that many times later."""

    async def main() -> tuple[list[int], list[_SlowCloseStream]]:
        closing, everyone = [0, 0], asyncio.Event()
        streams = [_SlowCloseStream(closing, everyone, 4) for _ in range(4)]
        runner = object.__new__(RoundRunner)
        runner.links = {}
        for i, stream in enumerate(streams):
            framed = object.__new__(FramedStream)
            framed.stream = stream
            framed.bytes_read = 0
            peer_id = KeyPair.from_seed(bytes([i + 1]) * 32).peer_id
            runner.links[peer_id] = _Link(peer_id, opened_by_me=True, lanes={0: _Lane(0, framed)})
        runner._link_tasks = []
        runner._bytes_received = 0
        await runner._close_links()
        return closing, streams

    closing, streams = arun(main())
    assert closing[1] == 4  # all four were closing together
    assert all(s.reset_called for s in streams)
