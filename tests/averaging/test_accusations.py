"""Signed accusations (issue: averaging agreement, P5 "forged notices rejected"): one
member's word evicts at most one other member, a relayer cannot accuse in another's
name, and a member that spends its one solo accusation twice is caught."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

from averaging import AllReduceConfig, AllReduceService, RoundSpec
from averaging.allreduce.accusations import (
    Accusation,
    AccusationBook,
    Added,
    Echo,
    accusation_signed,
    echo_quorum,
    echo_signed,
    sign_accusation,
    sign_echo,
)
from averaging.allreduce.wire import ALLREDUCE_PROTOCOL, encode_hello, encode_message, notice_of
from peers import KeyPair, Peer
from peers.rpc import FramedStream

Run = Callable[[Coroutine[Any, Any, Any]], Any]
ROUND = b"r" * 16
KEYS = [KeyPair.generate() for _ in range(5)]
A, B, C, D, E = (k.peer_id for k in KEYS)
MEMBERS = (A, B, C, D, E)


def accuse(key: KeyPair, accused: Any, seq: int) -> Accusation:
    return sign_accusation(key, ROUND, accused, seq)


def echo(key: KeyPair, accuser: Any, accused: Any) -> Echo:
    return sign_echo(key, ROUND, accuser, accused)


def test_a_first_accusation_counts_alone_once_a_quorum_echoed_it() -> None:
    book = AccusationBook(MEMBERS)
    assert echo_quorum(len(MEMBERS)) == 4  # more than (5 + 1) / 2
    first = book.add(accuse(KEYS[0], B, 0))
    assert first.new and first.echo and first.counted is None
    for k in (0, 2, 3):
        assert book.add_echo(echo(KEYS[k], A, B)).counted is None
    assert book.add_echo(echo(KEYS[3], A, B)) == Added(new=False)  # seen: not relayed
    assert book.add_echo(echo(KEYS[1], A, B)).counted == B  # the accused echoes too
    assert B in book.counted


def test_a_later_accusation_counts_once_a_second_member_accuses_too() -> None:
    book = AccusationBook(MEMBERS)
    alone = book.add(accuse(KEYS[0], C, 1))
    assert alone.new and not alone.echo and alone.counted is None
    corroborated = book.add(accuse(KEYS[3], C, 3))  # D's fourth accusation
    assert corroborated.counted == C
    assert book.add(accuse(KEYS[0], C, 1)) == Added(new=False)
    assert book.next_seq(A) == 1 and book.next_seq(E) == 0
    assert {a.accuser for a in book.against(C)} == {A, D}


def test_an_accuser_that_equivocates_gets_at_most_one_first_accusation_counted() -> None:
    """A tells B's accusation to some members and C's to others, and echoes both: the
    honest members each echo the first they saw, so at most one can reach the quorum."""
    book = AccusationBook(MEMBERS)
    book.add(accuse(KEYS[0], B, 0))
    caught = book.add(accuse(KEYS[0], C, 0))  # the proof: two firsts, both signed
    assert caught.new and caught.equivocator == A and C not in book.counted
    book.add_echo(echo(KEYS[0], A, B))
    book.add_echo(echo(KEYS[0], A, C))  # its second echo is ignored
    for k, accused in ((2, C), (3, C), (4, B), (1, B)):
        assert book.add_echo(echo(KEYS[k], A, accused)).counted is None
    assert book.counted == frozenset()
    # An equivocator's accusations no longer corroborate anyone either.
    book.add(accuse(KEYS[4], D, 2))
    assert book.add(accuse(KEYS[0], D, 1)).counted is None and D not in book.counted


def test_signatures_bind_accuser_accused_round_and_seq() -> None:
    good = accuse(KEYS[0], B, 0)
    assert accusation_signed(good, ROUND)
    assert not accusation_signed(good, b"another round...")
    for forged in (
        Accusation(C, A, 0, good.signature),  # another accused
        Accusation(B, A, 1, good.signature),  # another seq
        Accusation(B, E, 0, good.signature),  # in another member's name
        Accusation(B, A, -1, good.signature),
    ):
        assert not accusation_signed(forged, ROUND)
    relayed = echo(KEYS[2], A, B)
    assert echo_signed(relayed, ROUND)
    assert not echo_signed(Echo(A, C, C, relayed.signature), ROUND)
    assert not echo_signed(Echo(A, B, D, relayed.signature), ROUND)
    with pytest.raises(ValueError, match="itself"):
        AccusationBook(MEMBERS).add(accuse(KEYS[0], A, 0))
    with pytest.raises(ValueError, match="non-member"):
        AccusationBook(MEMBERS).add(accuse(KEYS[0], KeyPair.generate().peer_id, 0))


HONEST = 5
CONFIG = AllReduceConfig(
    sender_timeout=2.0, reducer_timeout=4.0, round_timeout=8.0, chunk_elements=1000
)


async def _accuser_round(mode: str) -> list[Any]:
    """Five honest members and an accuser that cannot be dialed (bandwidth 0). On its
    link to each honest member it sends one notice, then nothing: ``"all"`` accuses all
    five, signed; ``"forge"`` the same, signed by a stranger's key in its name;
    ``"equivocate"`` accuses each honest member, with seq 0, on that member's link."""
    async with contextlib.AsyncExitStack() as stack:
        honest = [await stack.enter_async_context(Peer()) for _ in range(HONEST)]
        liar = await stack.enter_async_context(Peer())
        services = [await stack.enter_async_context(AllReduceService(p, CONFIG)) for p in honest]
        everyone = [*honest, liar]
        for p in everyone:
            for q in everyone:
                if p is not q:
                    p.add_addresses(q.peer_id, q.listen_addrs)
        members = tuple(p.peer_id for p in everyone)
        round_id = os.urandom(16)
        specs = [
            RoundSpec(
                round_id=round_id,
                members=members,
                weights=(1.0,) * HONEST + (0.0,),
                total_elements=HONEST * 1000,
                chunk_elements=1000,
                me=p.peer_id,
            )
            for p in everyone
        ]
        rounds = [
            asyncio.ensure_future(s.run_round(spec, torch.full((HONEST * 1000,), float(i)), 1.0))
            for i, (s, spec) in enumerate(zip(services, specs, strict=False))
        ]
        signer = KeyPair.generate() if mode == "forge" else liar.identity
        accusations = [
            sign_accusation(signer, round_id, p.peer_id, seq) for seq, p in enumerate(honest)
        ]
        if mode == "forge":
            accusations = [
                Accusation(a.accused, liar.peer_id, a.seq, a.signature) for a in accusations
            ]
        for target in honest:
            stream = await liar.new_stream(target.peer_id, ALLREDUCE_PROTOCOL)
            framed = FramedStream(stream)
            await framed.write_frame(encode_hello(specs[0]))
            sent = accusations
            if mode == "equivocate":
                sent = [sign_accusation(signer, round_id, target.peer_id, 0)]
            await framed.write_frame(encode_message(notice_of(sent)))
        return list(await asyncio.gather(*rounds))


@pytest.mark.parametrize("mode", ["all", "equivocate"])
def test_a_member_accusing_everyone_evicts_at_most_one_and_the_rest_agree(
    arun: Run, mode: str
) -> None:
    """Before (protocol 3), a notice was its sender's word: one notice naming all five
    honest members withdrew every one of them, and no round agreed. Now the accuser's
    first accusation (or, when it tells each member a different "first" one, the one
    that reached the echo quorum first, if any) evicts one member, the same one for
    everybody."""
    results = arun(_accuser_round(mode))
    liar = results[0].result.report.members[-1]
    agreed = [r for r in results if r.transfer.agreed]
    assert len(agreed) >= HONEST - 1
    assert all(torch.equal(r.result.averaged, agreed[0].result.averaged) for r in agreed)
    lost = set().union(*(r.result.report.excluded_by for r in results))
    assert lost <= {liar}  # only the accuser excluded anyone for good
    views = {frozenset(r.result.report.failed) - {liar} for r in agreed if r.result.report.failed}
    assert len(views) == 1 and all(len(v) <= 1 for v in views), views


def test_accusations_in_another_members_name_exclude_their_sender(arun: Run) -> None:
    """Accusations signed by another key are their sender's fault, whoever they name."""
    results = arun(_accuser_round("forge"))
    liar = results[0].result.report.members[-1]
    for r in results:
        assert r.transfer.agreed
        assert set(r.result.report.failed) == {liar}
        assert r.result.report.fraction_averaged == 1.0
    mean = (HONEST - 1) / 2
    assert torch.allclose(results[0].result.averaged, torch.full((HONEST * 1000,), mean))
