"""A round's links on several connections each (lanes): on a long round trip the
opener of a link adds further streams on further connections, and chunks travel on
whichever is free. Real peers on loopback, with the round-trip threshold at 0 so that
loopback counts as long."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

from averaging import AllReduceConfig, AllReduceService, RoundSpec
from averaging.allreduce import service as service_module
from averaging.allreduce.config import FLUSH_SECONDS, MAX_CONNECTIONS_PER_MEMBER, AllReduceError
from averaging.allreduce.network import LaneMemo, RoundRunner, _Lane, _Link
from averaging.allreduce.wire import ALLREDUCE_PROTOCOL, REVERSE_LANE, Hello, decode_hello
from peers import Peer, PeerConfig, PeersError
from peers.identity import KeyPair
from peers.memory_network import MemoryNetwork, run_virtual
from peers.rpc import FramedStream
from tests.averaging.test_allreduce import _meet, _specs

Run = Callable[[Coroutine[Any, Any, Any]], Any]

POOLED = AllReduceConfig(
    sender_timeout=3.0,
    reducer_timeout=6.0,
    round_timeout=12.0,
    chunk_elements=1 << 16,
    connections_per_member=6,  # 3 links each: 2 connections per link
    pooled_round_trip=0.0,
    reverse_lane=False,  # (the opener's lanes alone: the reverse lane's tests are below)
)
NUM_PEERS = 4
ELEMENTS = 2_000_000


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(ELEMENTS, generator=gen) for _ in range(NUM_PEERS)]


async def _round(
    config: AllReduceConfig,
    during: Callable[[list[Peer]], Coroutine[Any, Any, None]] | None = None,
    peer_config: PeerConfig | None = None,
) -> tuple[list[Any], list[list[int]]]:
    """Run one round; returns the results and, per peer, the data bytes each of its
    connections received (first connection to each peer, then further ones)."""
    async with contextlib.AsyncExitStack() as stack:
        peers = [await stack.enter_async_context(Peer(peer_config)) for _ in range(NUM_PEERS)]
        services = [await stack.enter_async_context(AllReduceService(p, config)) for p in peers]
        await _meet(peers)
        # Connected beforehand, as matchmaking leaves them: TCP has measured a round trip.
        await asyncio.gather(
            *(p.connect(q.listen_addrs[0]) for i, p in enumerate(peers) for q in peers[i + 1 :])
        )
        specs = _specs(peers, ELEMENTS, chunk=config.chunk_elements)
        rounds = [
            s.run_round(spec, t, 1.0)
            for s, spec, t in zip(services, specs, _tensors(), strict=True)
        ]
        extra = [during(peers)] if during is not None else []
        results = await asyncio.gather(*rounds, *extra)
        further = [
            [
                c.session_statistics().num_data_bytes_received
                for q in peers
                if q is not p
                for c in p.direct_connections(q.peer_id)[1:]
            ]
            for p in peers
        ]
        return list(results[:NUM_PEERS]), further


def _check_agreed_mean(results: list[Any]) -> None:
    expected = torch.stack(_tensors()).double().mean(0)
    first = results[0].result.averaged
    for r in results:
        assert r.transfer.agreed
        assert r.result.report.failed == {}
        assert r.result.report.fraction_averaged == 1.0
        assert torch.equal(r.result.averaged, first)
    assert torch.allclose(first.double(), expected, atol=1e-6)


def test_each_link_gains_a_lane_on_a_further_connection_and_the_result_is_the_mean(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loopback carries a round faster than a further connection is dialed, so the
    lanes carry little here (the lab test at 80 ms and the window-capped test below
    show them carrying chunks): every link still gains one, on its own connection."""
    attached = _spy_on_lanes(monkeypatch)
    results, further = arun(_round(POOLED))
    _check_agreed_mean(results)
    assert sorted(attached) == [0] * 12 + [1] * 12  # 6 links, both ends, 2 lanes each
    for received in further:
        assert len(received) == NUM_PEERS - 1  # one further connection to each member
        assert all(n > 0 for n in received)  # (a lane's Hello at least)


def test_a_peer_that_keeps_one_connection_per_peer_averages_on_one(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_connections_per_peer=1`` leaves no room for a lane: the pooled stream is
    refused at once (LimitExceeded, nothing dialed), and the round runs on one."""
    attached = _spy_on_lanes(monkeypatch)
    results, further = arun(_round(POOLED, peer_config=PeerConfig(max_connections_per_peer=1)))
    _check_agreed_mean(results)
    assert attached and set(attached) == {0}
    assert further == [[]] * NUM_PEERS


def _spy_on_lanes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The index of every lane attached from now on, at either end of a link."""
    attached: list[int] = []
    attach = RoundRunner._attach

    def spy(self: RoundRunner, link: _Link, lane: _Lane) -> bool:
        attached.append(lane.index)
        return attach(self, link, lane)

    monkeypatch.setattr(RoundRunner, "_attach", spy)
    return attached


@pytest.mark.parametrize(
    ("round_trip", "per_member"),
    [(1.0, 6), (0.0, 3)],
    ids=["the round trip is short", "a member's links are as many as it asks"],
)
def test_one_connection_per_link_when_that_is_enough(
    arun: Run, round_trip: float, per_member: int
) -> None:
    config = dataclasses.replace(
        POOLED, pooled_round_trip=round_trip, connections_per_member=per_member
    )
    results, further = arun(_round(config))
    _check_agreed_mean(results)
    assert further == [[]] * NUM_PEERS


def test_a_member_that_predates_lanes_refuses_them_and_the_round_runs_on_one(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer of a version before lanes ignores the Hello's lane field: it takes a
    further lane for a second link and refuses it. The opener keeps the link it has."""

    def as_before_lanes(frame: object) -> Hello:
        hello = decode_hello(frame)
        return Hello(hello.round_id, hello.spec_digest)

    monkeypatch.setattr(service_module, "decode_hello", as_before_lanes)
    attached = _spy_on_lanes(monkeypatch)
    results, _ = arun(_round(POOLED))
    _check_agreed_mean(results)
    assert attached and set(attached) == {0}


def test_a_remembered_member_that_refuses_an_early_lane_is_forgotten_and_the_round_runs(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a round whose lanes the member took, the opener's service remembers it and
    opens the next round's lane at once; a member that refuses it then (here: every
    lane past the first) leaves that round on one lane, with the mean, and is forgotten
    (its next lanes wait for its first answer again)."""
    config = dataclasses.replace(POOLED, connections_per_member=2)

    accept = RoundRunner.accept

    async def refusing_lanes(self: RoundRunner, remote: Any, framed: Any, *args: Any) -> None:
        lane = args[1] if len(args) > 1 else 0
        if lane > 0:
            raise AllReduceError("no lanes here")
        await accept(self, remote, framed, *args)

    def second() -> None:
        monkeypatch.setattr(RoundRunner, "accept", refusing_lanes)

    attached = _spy_on_lanes(monkeypatch)
    outcomes, remembered = arun(_two_rounds_of_a_pair(config, second, "_lane_memo"))
    expected = torch.stack(_tensors()[:2]).double().mean(0)
    for results in outcomes:
        for r in results:
            assert r.transfer.agreed and r.result.report.fraction_averaged == 1.0
            assert torch.allclose(r.result.averaged.double(), expected, atol=1e-6)
    assert sorted(remembered[0]) == [False, True]  # the opener's service remembers
    assert remembered[1] == [False, False]
    assert sorted(attached) == [0, 0, 0, 0, 1, 1]  # round 2: no lane attached


async def _two_rounds_of_a_pair(
    config: AllReduceConfig, second: Callable[[], None], memo: str
) -> tuple[list[list[Any]], list[list[bool]]]:
    """Two rounds of a pair connected beforehand, ``second()`` called before the second:
    each round's results, and after each whether each service's ``memo`` (the name of
    its LaneMemo) holds the other member."""
    outcomes: list[list[Any]] = []
    remembered: list[list[bool]] = []
    async with contextlib.AsyncExitStack() as stack:
        peers = [await stack.enter_async_context(Peer()) for _ in range(2)]
        services = [await stack.enter_async_context(AllReduceService(p, config)) for p in peers]
        await _meet(peers)
        await peers[0].connect(peers[1].listen_addrs[0])
        for index in range(2):
            if index:
                second()
            specs = _specs(peers, ELEMENTS, chunk=config.chunk_elements)
            rounds = [
                s.run_round(spec, t, 1.0)
                for s, spec, t in zip(services, specs, _tensors()[:2], strict=True)
            ]
            outcomes.append(list(await asyncio.gather(*rounds)))
            remembered.append(
                [
                    other.peer_id in getattr(s, memo)
                    for s, other in zip(services, peers[::-1], strict=True)
                ]
            )
    return outcomes, remembered


def test_a_lane_memo_keeps_the_latest_members_and_forgets_a_refusing_one() -> None:
    ids = [KeyPair.generate().peer_id for _ in range(3)]
    memo = LaneMemo(capacity=2)
    for member in ids:
        memo.add(member)
    assert ids[0] not in memo and ids[1] in memo and ids[2] in memo and len(memo) == 2
    memo.add(ids[1])  # taken again: now the latest
    memo.add(ids[0])
    assert ids[2] not in memo and ids[1] in memo and ids[0] in memo
    memo.discard(ids[1])
    memo.discard(ids[1])  # not there: nothing to do
    assert ids[1] not in memo and len(memo) == 1
    with pytest.raises(ValueError, match="at least one"):
        LaneMemo(capacity=0)


def _virtual_round(
    connections: int,
    num_members: int = 2,
    during: Callable[[], Coroutine[Any, Any, None]] | None = None,
    latency: float = 0.1,
    durations: list[float] | None = None,
    num_rounds: int = 1,
    **changes: float,
) -> tuple[list[Any], float]:
    """Members 200 ms apart on the in-memory network, whose streams have yamux's first
    window (256 KiB) and no more: one stream carries 256 KiB per round trip, as a TCP
    connection's window caps it on a long fat pipe. Returns the results and the round's
    duration on the virtual clock; ``during`` runs beside the round. With
    ``num_rounds``, the same services run that many rounds one after another (the last
    one's results returned, every round's duration appended to ``durations``)."""
    config = dataclasses.replace(
        POOLED,
        sender_timeout=10.0,
        reducer_timeout=20.0,
        round_timeout=40.0,
        connections_per_member=connections,
        pooled_round_trip=0.1,
    )
    config = dataclasses.replace(config, **changes)

    async def main() -> tuple[list[Any], float]:
        network = MemoryNetwork(11, latency_seconds=latency)
        peers = [network.add_peer() for _ in range(num_members)]
        for i, a in enumerate(peers):
            for b in peers[i + 1 :]:
                network.set_bandwidth(a, b, 50e6)
        services = [AllReduceService(p, config) for p in peers]
        for service in services:
            await service.__aenter__()
        for index in range(num_rounds):
            results, elapsed = await one_round(services, f"lanes{index}".encode())
            if durations is not None:
                durations.append(elapsed)
        await network.aclose()
        return results, elapsed

    async def one_round(
        services: list[AllReduceService], round_id: bytes
    ) -> tuple[list[Any], float]:
        members = tuple(s.peer.peer_id for s in services)
        specs = [
            RoundSpec(
                round_id=round_id,
                members=members,
                weights=(1.0,) * num_members,
                total_elements=ELEMENTS,
                chunk_elements=config.chunk_elements,
                me=m,
            )
            for m in members
        ]
        loop = asyncio.get_running_loop()
        start = loop.time()
        tensors = _tensors()[:num_members]
        rounds = [
            s.run_round(spec, t, 1.0) for s, spec, t in zip(services, specs, tensors, strict=True)
        ]
        extra = [during()] if during is not None else []
        results = list(await asyncio.gather(*rounds, *extra))[:num_members]
        return results, loop.time() - start

    results: tuple[list[Any], float] = run_virtual(main())
    return results


def test_on_a_window_capped_link_two_lanes_carry_a_round_faster_with_the_same_result() -> None:
    one, one_seconds = _virtual_round(1)
    two, two_seconds = _virtual_round(2)
    for results in (one, two):
        assert all(r.transfer.agreed for r in results)
        assert all(r.result.report.fraction_averaged == 1.0 for r in results)
    expected = torch.stack(_tensors()[:2]).double().mean(0)
    assert torch.allclose(two[0].result.averaged.double(), expected, atol=1e-6)
    assert torch.equal(one[0].result.averaged, two[0].result.averaged)
    # Deterministic (a virtual clock): the second lane nearly doubles what the link
    # carries per round trip.
    print(f"one lane {one_seconds:.2f} s, two lanes {two_seconds:.2f} s (virtual)")
    assert two_seconds < 0.75 * one_seconds


def test_a_member_that_took_a_lane_gets_its_lanes_at_once_in_the_next_round() -> None:
    """The first round opens the link's further lane once the member has answered on
    the first (a round trip in); the service remembers that the member took it, and the
    next round's lane opens with the first, so that round is shorter on the virtual
    clock by about that round trip (200 ms), with the same result."""
    durations: list[float] = []
    results, _ = _virtual_round(2, durations=durations, num_rounds=3)
    assert all(r.transfer.agreed and r.result.report.fraction_averaged == 1.0 for r in results)
    expected = torch.stack(_tensors()[:2]).double().mean(0)
    assert torch.allclose(results[0].result.averaged.double(), expected, atol=1e-6)
    first, second, third = durations
    print(f"rounds {first:.3f}, {second:.3f}, {third:.3f} s (virtual)")
    assert second < first - 0.15
    assert abs(third - second) < 0.05  # the memo holds: every later round alike


def test_a_lane_that_breaks_mid_round_fails_its_link_and_the_others_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A further connection that breaks while it carries chunks fails its link as a
    broken first one does: one end of that link is excluded, the other members agree,
    nothing waits past the round's bound."""
    lanes: list[_Lane] = []
    attach = RoundRunner._attach

    def keep(self: RoundRunner, link: _Link, lane: _Lane) -> bool:
        lanes.append(lane)
        return attach(self, link, lane)

    monkeypatch.setattr(RoundRunner, "_attach", keep)
    broken: list[int] = []

    async def break_a_lane() -> None:
        for _ in range(400):  # bounded: 400 x 10 ms of virtual time
            busy = [lane for lane in lanes if lane.index > 0 and lane.framed.bytes_read > 500_000]
            if busy:
                busy[0].framed.stream.reset()
                broken.append(busy[0].framed.bytes_read)
                return
            await asyncio.sleep(0.01)

    results, seconds = _virtual_round(4, num_members=3, during=break_a_lane)  # 2 per link
    assert broken, "no further lane carried 500 kB"
    failed = {m for r in results for m in r.result.report.failed}
    assert len(failed) == 1  # one end of the broken link
    survivors = [r for r in results if r.transfer.agreed]
    assert len(survivors) >= 2
    assert all(torch.equal(r.result.averaged, survivors[0].result.averaged) for r in survivors)
    assert all(r.result.report.fraction_averaged == 1.0 for r in survivors)
    assert seconds <= 40.0 + 2 * FLUSH_SECONDS  # the virtual rounds' return_bound


def test_a_lane_whose_answer_comes_after_the_join_timeout_is_still_used() -> None:
    """Members 6 s apart (virtual): the member answers a lane a round trip after the
    opener asked, past ``join_timeout`` (5 s), and has been sending chunks on it since.
    The opener waits for the answer (the round's end bounds the wait); giving up on it
    after ``join_timeout`` reset a lane the member used, and that failed the link."""
    results, _ = _virtual_round(
        2, latency=3.0, sender_timeout=60.0, reducer_timeout=120.0, round_timeout=240.0
    )
    for r in results:
        assert r.transfer.agreed
        assert r.result.report.failed == {}
        assert r.result.report.fraction_averaged == 1.0
    assert torch.equal(results[0].result.averaged, results[1].result.averaged)


@pytest.mark.parametrize(
    "lane",
    [REVERSE_LANE + 1, -1, "x", True, 1.5],
    ids=["too high", "negative", "str", "bool", "float"],
)
def test_a_hello_naming_a_bad_lane_is_refused_and_the_service_keeps_serving(
    arun: Run, lane: object
) -> None:
    async def main() -> list[Any]:
        async with contextlib.AsyncExitStack() as stack:
            a, b, intruder = [await stack.enter_async_context(Peer()) for _ in range(3)]
            services = [
                await stack.enter_async_context(AllReduceService(p, POOLED)) for p in (a, b)
            ]
            await _meet([a, b])
            specs = _specs([a, b], 3000, chunk=1000)
            intruder.add_addresses(a.peer_id, a.listen_addrs)
            framed = FramedStream(await intruder.new_stream(a.peer_id, ALLREDUCE_PROTOCOL))
            await framed.write_frame([0, [specs[0].round_id, specs[0].digest(), lane]])
            with pytest.raises(PeersError):  # the refusal: a reset
                await framed.read_frame()
            rounds = [
                s.run_round(spec, torch.full((3000,), float(i)), 1.0)
                for i, (s, spec) in enumerate(zip(services, specs, strict=True))
            ]
            return list(await asyncio.gather(*rounds))

    results = arun(main())
    for r in results:
        assert r.transfer.agreed and r.result.report.fraction_averaged == 1.0
        assert torch.equal(r.result.averaged, torch.full((3000,), 0.5))


def test_a_config_asking_for_no_or_too_many_connections_is_refused() -> None:
    for bad in (0, MAX_CONNECTIONS_PER_MEMBER + 1, True, 2.0):
        with pytest.raises(AllReduceError, match="connections_per_member must be an int"):
            AllReduceConfig(connections_per_member=bad)  # type: ignore[arg-type]
    for bad_seconds in (-0.1, float("nan"), "0.05"):
        with pytest.raises(AllReduceError, match="pooled_round_trip must be"):
            AllReduceConfig(pooled_round_trip=bad_seconds)  # type: ignore[arg-type]
    for flag in (1, "yes", None):
        with pytest.raises(AllReduceError, match="reverse_lane must be True or False"):
            AllReduceConfig(reverse_lane=flag)  # type: ignore[arg-type]


# --- the reverse lane ------------------------------------------------------------------


def test_the_member_that_did_not_open_a_link_sends_at_once_on_a_reverse_lane() -> None:
    """A pair 200 ms apart (virtual), one connection per link. Without the reverse lane,
    the member that does not open the link waits for the opener's stream, half a round
    trip, before it sends. With it, the first round opens the lane once the opener's
    stream is there (and the two streams' windows carry more); every later round opens
    it at once and sends on it before the opener's answer: the same result, each round
    sooner than the first (on this network each stream also brings its own window)."""
    before: list[float] = []
    after: list[float] = []
    plain, _ = _virtual_round(1, durations=before, num_rounds=3)
    reversed_, _ = _virtual_round(1, durations=after, num_rounds=3, reverse_lane=True)
    expected = torch.stack(_tensors()[:2]).double().mean(0)
    for results in (plain, reversed_):
        for r in results:
            assert r.transfer.agreed and r.result.report.fraction_averaged == 1.0
            assert r.result.report.failed == {}
        assert torch.allclose(results[0].result.averaged.double(), expected, atol=1e-6)
    assert torch.equal(plain[0].result.averaged, reversed_[0].result.averaged)
    print("without", [f"{d:.3f}" for d in before], "with", [f"{d:.3f}" for d in after])
    assert after[0] < before[0]  # a second stream's window from B to A
    assert after[1] < after[0] - 0.05  # and from the second round on, no wait
    assert abs(after[2] - after[1]) < 0.02  # the memo holds


def test_a_member_that_refuses_an_early_reverse_lane_gets_its_chunks_on_the_link(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second round with a member opens the reverse lane at once and sends chunks
    on it before the member answers. A member that refuses it then (a version without
    reverse lanes, restarted; here: a refusal 50 ms after the Hello) has them sent
    again on the link's first stream: the round averages everything, no one is
    excluded, and the member is forgotten (its next reverse lane waits for its answer)."""
    config = dataclasses.replace(POOLED, connections_per_member=1, reverse_lane=True)
    accept = RoundRunner.accept
    refused = RoundRunner._refused
    resent: list[int] = []

    async def refusing_reverse(self: RoundRunner, remote: Any, framed: Any, *args: Any) -> None:
        if (args[1] if len(args) > 1 else 0) == REVERSE_LANE:
            await asyncio.sleep(0.05)
            raise AllReduceError("no reverse lanes here")
        await accept(self, remote, framed, *args)

    def counting(self: RoundRunner, link: _Link, lane: _Lane, error: BaseException) -> None:
        resent.append(len(lane.unsure or []))
        refused(self, link, lane, error)

    def second() -> None:
        monkeypatch.setattr(RoundRunner, "accept", refusing_reverse)
        monkeypatch.setattr(RoundRunner, "_refused", counting)

    attached = _spy_on_lanes(monkeypatch)
    outcomes, remembered = arun(_two_rounds_of_a_pair(config, second, "_reverse_memo"))
    expected = torch.stack(_tensors()[:2]).double().mean(0)
    for results in outcomes:
        for r in results:
            assert r.transfer.agreed and r.result.report.fraction_averaged == 1.0
            assert r.result.report.failed == {}
            assert torch.allclose(r.result.averaged.double(), expected, atol=1e-6)
    assert sorted(remembered[0]) == [False, True]  # the member that did not open
    assert remembered[1] == [False, False]  # forgotten after the refusal
    assert len(resent) == 1 and resent[0] >= 1, resent  # chunks sent again
    # Round 1: lane 0 and the reverse lane at both ends; round 2: lane 0 at both ends
    # and the early reverse lane at its opener's only.
    assert sorted(attached) == [0, 0, 0, 0] + [REVERSE_LANE] * 3


def test_a_reverse_lane_from_the_links_opener_is_refused_and_the_round_runs(arun: Run) -> None:
    """Only the member that did not open a link opens its reverse lane: the opener
    sending one (a confused or hostile peer) is refused with a reset, and the round
    averages as before."""

    async def main() -> list[Any]:
        async with contextlib.AsyncExitStack() as stack:
            a, b = [await stack.enter_async_context(Peer()) for _ in range(2)]
            config = dataclasses.replace(POOLED, reverse_lane=True)
            services = [
                await stack.enter_async_context(AllReduceService(p, config)) for p in (a, b)
            ]
            await _meet([a, b])
            specs = _specs([a, b], 3000, chunk=1000)
            opener, other = (a, b) if min(a.peer_id, b.peer_id) == a.peer_id else (b, a)
            framed = FramedStream(await opener.new_stream(other.peer_id, ALLREDUCE_PROTOCOL))
            spec = specs[0]
            await framed.write_frame([0, [spec.round_id, spec.digest(), REVERSE_LANE]])
            rounds = [
                s.run_round(spec, torch.full((3000,), float(i)), 1.0)
                for i, (s, spec) in enumerate(zip(services, specs, strict=True))
            ]
            results = list(await asyncio.gather(*rounds))
            with pytest.raises(PeersError):  # the refusal: a reset
                await framed.read_frame()
            return results

    results = arun(main())
    for r in results:
        assert r.transfer.agreed and r.result.report.fraction_averaged == 1.0
        assert torch.equal(r.result.averaged, torch.full((3000,), 0.5))
