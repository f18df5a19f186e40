"""The end-of-round vote (``averaging.allreduce.agreement``): one vote per member, a strict
majority of the whole group decides, split votes are hopeless; copying a voted result
takes held parts that match and checks fetched ones against their digests."""

from __future__ import annotations

import asyncio

import pytest
import torch

from averaging.allreduce.agreement import Adoption, Ballot, check_vote, contradiction
from averaging.allreduce.butterfly import ButterflyRound
from averaging.allreduce.config import AllReduceConfig, AllReduceResult
from averaging.allreduce.records import (
    MAX_SHARE_RATIO,
    PartDigest,
    RoundSpec,
    capped_weights,
    fingerprint_of,
    part_digests,
    values_digest,
)
from averaging.allreduce.service import AllReduceService
from peers.identity import KeyPair, PeerID
from peers.memory_network import MemoryNetwork
from peers.virtual_clock import run_virtual

_IDS = [KeyPair.from_seed(bytes([i + 1]) * 32).peer_id for i in range(6)]
F, G, H = b"f" * 32, b"g" * 32, b"h" * 32


def test_a_strict_majority_of_every_member_decides() -> None:
    ballot = Ballot(_IDS[:4])
    assert ballot.quorum == 3
    assert ballot.cast(_IDS[0], F) and ballot.cast(_IDS[1], F)
    assert ballot.decided is None  # two of four: half is not a majority
    assert ballot.cast(_IDS[2], F)
    assert ballot.decided == F
    assert ballot.voters_for(F) == frozenset(_IDS[:3])


def test_a_member_votes_once_and_strangers_not_at_all() -> None:
    ballot = Ballot(_IDS[:3])
    assert ballot.cast(_IDS[0], F)
    assert not ballot.cast(_IDS[0], G)  # a second vote, even a different one, is ignored
    assert not ballot.cast(_IDS[5], G)  # not a member
    assert ballot.vote_of(_IDS[0]) == F and ballot.num_votes == 1
    assert ballot.cast(_IDS[1], G)
    assert ballot.decided is None


def test_two_halves_never_both_decide_and_a_split_is_hopeless() -> None:
    ballot = Ballot(_IDS[:4])
    for voter, fingerprint in zip(_IDS[:4], (F, F, G, G), strict=True):
        assert not ballot.hopeless
        ballot.cast(voter, fingerprint)
    assert ballot.decided is None and ballot.hopeless


def test_hopeless_only_when_no_fingerprint_can_still_win() -> None:
    ballot = Ballot(_IDS[:5])  # quorum 3
    ballot.cast(_IDS[0], F)
    ballot.cast(_IDS[1], G)
    ballot.cast(_IDS[2], H)
    assert not ballot.hopeless  # F could still get both missing votes
    ballot.cast(_IDS[3], G)
    assert not ballot.hopeless  # G needs one more
    ballot.cast(_IDS[4], H)
    assert ballot.hopeless


def test_leading_prefers_most_votes_then_the_smallest_fingerprint() -> None:
    ballot = Ballot(_IDS[:5])
    assert ballot.leading() is None
    ballot.cast(_IDS[0], G)
    ballot.cast(_IDS[1], F)
    assert ballot.leading() == F  # a tie: the smaller fingerprint
    ballot.cast(_IDS[2], G)
    assert ballot.leading() == G


def test_a_vote_contradicts_mine_only_where_one_origin_gave_other_values() -> None:
    a, b, c = (m.to_bytes() for m in _IDS[:3])
    mine = [PartDigest(0, a, [a, b, c], b"x" * 16), PartDigest(1, b, [a, b, c], b"y" * 16)]
    # Another reducer or other contributors (a fault's work): no contradiction.
    other_reducer = [mine[0], PartDigest(1, c, [a, b, c], b"z" * 16)]
    fewer = [mine[0], PartDigest(1, b, [a, b], b"z" * 16)]
    assert contradiction(mine, other_reducer) is None
    assert contradiction(mine, fewer) is None
    assert contradiction(mine, mine) is None
    # The same reducer over the same members with other values: part 1 (in any order).
    lied = [mine[0], PartDigest(1, b, [c, b, a], b"z" * 16)]
    assert contradiction(mine, lied) == 1


def _spec(me: PeerID, total: int = 40, chunk: int = 4) -> RoundSpec:
    return RoundSpec(
        round_id=b"round",
        members=tuple(_IDS[:3]),
        weights=(1.0, 1.0, 1.0),
        total_elements=total,
        chunk_elements=chunk,
        me=me,
    )


def _finished_result(spec: RoundSpec) -> tuple[torch.Tensor, list[PartDigest], bytes]:
    """A voter's result: every member's part reduced over everyone (one machine each)."""
    vectors = [torch.arange(spec.total_elements, dtype=torch.float32) * (i + 1) for i in range(3)]
    mean = sum(vectors, torch.zeros(spec.total_elements)) / 3
    rounds = {m: ButterflyRound(_spec(m), vectors[i], 1.0) for i, m in enumerate(_IDS[:3])}
    for sender, machine in rounds.items():
        for item in list(machine.outgoing_chunks()):
            rounds[item.to].on_chunk(
                sender, b"round", item.part_index, item.chunk_index, item.values, 1.0
            )
    for reducer, machine in rounds.items():
        for part in machine.ready_parts():
            for item in machine.published_chunks(part):
                rounds[item.to].on_averaged_chunk(
                    reducer,
                    b"round",
                    item.part_index,
                    item.chunk_index,
                    item.values,
                    item.contributors,
                )
    result = rounds[spec.me].result()
    assert torch.allclose(result.averaged, mean)
    digests = list(part_digests(result))
    return result.averaged.clone(), digests, fingerprint_of(b"round", digests)


def test_a_copy_takes_matching_held_parts_and_fetches_the_rest() -> None:
    spec = _spec(_IDS[1])
    values, digests, fingerprint = _finished_result(_spec(_IDS[0]))
    parts = spec.parts()
    # I hold part 0 as the voter does, part 1 differently (a re-reduction), part 2 not.
    held_values = {0: values[parts[0][0] : parts[0][1]], 1: torch.zeros(parts[1][1] - parts[1][0])}

    def held(i: int) -> tuple[PeerID, frozenset[PeerID], torch.Tensor] | None:
        if i not in held_values:
            return None
        return _IDS[i], frozenset(_IDS[:3]), held_values[i]

    adoption = Adoption(spec, fingerprint, digests, held)
    assert adoption.missing_parts == {1, 2}
    for part in (1, 2):
        outcomes = []
        for c in range(adoption.num_chunks(part)):
            span = adoption.chunk_range(part, c)
            assert span is not None
            outcomes.append(adoption.on_copy(part, c, values[span[0] : span[1]]))
        assert outcomes[-1] is True and all(o is None for o in outcomes[:-1])
        assert adoption.chunk_range(part, 0) is None  # nothing more awaited
    result = adoption.result({})
    assert torch.equal(result.averaged, values)
    assert fingerprint_of(b"round", part_digests(result)) == fingerprint


def test_a_copy_that_fails_its_digest_is_forgotten_and_fetched_again() -> None:
    spec = _spec(_IDS[2])
    values, digests, fingerprint = _finished_result(_spec(_IDS[0]))
    adoption = Adoption(spec, fingerprint, digests, lambda i: None)
    start, end = spec.parts()[0]
    forged = values[start:end].clone()
    forged[0] += 1.0
    outcome = None
    for c in range(adoption.num_chunks(0)):
        span = adoption.chunk_range(0, c)
        assert span is not None
        outcome = adoption.on_copy(0, c, forged[span[0] - start : span[1] - start])
    assert outcome is False and 0 in adoption.missing_parts
    assert adoption.chunk_range(0, 0) == (start, min(start + 4, end))  # awaited again
    with pytest.raises(ValueError):
        adoption.on_copy(0, 0, torch.zeros(1))  # the wrong shape
    assert values_digest(forged) != digests[0].values


def test_a_malformed_vote_is_named() -> None:
    spec = _spec(_IDS[0])
    _, digests, fingerprint = _finished_result(spec)
    assert check_vote(spec, fingerprint, digests) is None
    assert check_vote(spec, b"x" * 32, digests) is not None  # fingerprint of something else
    assert check_vote(spec, fingerprint, digests[:2]) is not None
    stranger = PartDigest(0, _IDS[5].to_bytes(), [], digests[0].values)
    assert check_vote(spec, fingerprint, [stranger, *digests[1:]]) is not None
    reordered = [digests[1], digests[0], digests[2]]
    assert check_vote(spec, fingerprint_of(b"round", reordered), reordered) is not None


def test_one_bandwidth_claim_cannot_buy_a_member_the_vector() -> None:
    """Finding 6: part sizes followed claimed bandwidth (1e15 was accepted), so one
    claim could own nearly every coordinate of a 16-member round. A weight is capped at
    MAX_SHARE_RATIO times the median positive weight."""
    members = tuple(KeyPair.from_seed(bytes([i + 40]) * 32).peer_id for i in range(16))
    weights = (1e15, *([1.0] * 14), 0.0)
    spec = RoundSpec(
        round_id=b"r",
        members=members,
        weights=weights,
        total_elements=18_000,
        chunk_elements=100,
        me=members[0],
    )
    sizes = [end - start for start, end in spec.parts()]
    assert sizes[0] == 18_000 * MAX_SHARE_RATIO / (MAX_SHARE_RATIO + 14) == 4000
    assert sizes[-1] == 0  # client mode still reduces nothing
    assert capped_weights([2.0, 1.0, 1.0]) == [2.0, 1.0, 1.0]  # honest spreads untouched


def test_members_given_different_specs_for_one_round_never_mix() -> None:
    """Finding 6: Hello named only the round id, so a leader could give members
    different specs. Links now carry the spec's digest: the member given another spec
    is refused by the others, the three that share one agree, and nobody raises."""

    async def main() -> list[AllReduceResult]:
        network = MemoryNetwork(3)
        peers = [network.add_peer() for _ in range(4)]
        members = tuple(p.peer_id for p in peers)
        config = AllReduceConfig(sender_timeout=1.0, reducer_timeout=2.0, round_timeout=6.0)
        services = [AllReduceService(p, config) for p in peers]
        for service in services:
            await service.__aenter__()

        def spec(i: int) -> RoundSpec:
            weights = (1.0, 1.0, 1.0, 1.0) if i < 3 else (1.0, 1.0, 1.0, 9.0)
            return RoundSpec(
                round_id=b"one id",
                members=members,
                weights=weights,
                total_elements=64,
                chunk_elements=8,
                me=members[i],
            )

        rounds = [
            services[i].run_round(spec(i), torch.full((64,), float(i)), 1.0) for i in range(4)
        ]
        results = list(await asyncio.gather(*rounds))
        await network.aclose()
        return results

    results = run_virtual(main())
    honest = results[:3]
    assert all(r.transfer.agreed for r in honest)
    assert all(torch.equal(r.result.averaged, torch.ones(64)) for r in honest)  # mean of 0,1,2
    assert not results[3].transfer.agreed
    assert (
        results[3].transfer.seconds
        <= AllReduceConfig(sender_timeout=1.0, reducer_timeout=2.0, round_timeout=6.0).return_bound
    )


def test_a_part_that_arrives_from_its_reducer_meanwhile_is_not_fetched() -> None:
    """A member a little behind the majority: the decided result is copied, but a part
    its butterfly then completes is taken from there when it matches the vote."""
    spec = _spec(_IDS[2])
    values, digests, fingerprint = _finished_result(_spec(_IDS[0]))
    adoption = Adoption(spec, fingerprint, digests, lambda i: None)
    start, end = spec.parts()[1]
    everyone = frozenset(_IDS[:3])
    wrong = torch.zeros(end - start)
    assert not adoption.offer(1, _IDS[1], everyone, wrong)  # not what was voted
    assert not adoption.offer(1, _IDS[0], everyone, values[start:end])  # another reducer
    assert adoption.offer(1, _IDS[1], everyone, values[start:end])
    assert adoption.missing_parts == {0, 2}
    assert not adoption.offer(1, _IDS[1], everyone, values[start:end])  # taken already
