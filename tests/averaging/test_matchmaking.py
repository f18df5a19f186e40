"""Matchmaking: the pure decisions, a simulated swarm of searches (no loop), then real
peers on loopback in one process (groups, a lone peer, cancellation, hostile joins)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from averaging.matchmaking.matchmaker import Matchmaker, check_key
from averaging.matchmaking.records import (
    JOIN_PROTOCOL,
    MAX_METADATA_BYTES,
    Candidate,
    Group,
    JoinRequest,
    JoinResponse,
    JoinStatus,
    MatchmakingConfig,
    MatchmakingError,
    MemberInfo,
    rank,
)
from averaging.matchmaking.search import (
    Failed,
    Formed,
    GroupSearch,
    Join,
    JoinAnswer,
    Placed,
    Poll,
    Redirect,
    Refused,
    Rejected,
    Role,
    Sleep,
    balanced_sizes,
    choose_leader,
    plan_groups,
)
from peers import Peer, PeerConfig, RemoteError
from peers.dht.node import DHT, DHTConfig
from peers.identity import KeyPair, PeerID

Run = Callable[[Coroutine[Any, Any, Any]], Any]


def _member(peer_id: PeerID, *, client: bool = False, metadata: bytes = b"") -> MemberInfo:
    addrs = () if client else (f"/ip4/127.0.0.1/tcp/{1000 + peer_id.to_bytes()[-1]}",)
    return MemberInfo(peer_id, addrs, client, 1.0, metadata)


def _ids(n: int) -> list[PeerID]:
    return [KeyPair.generate().peer_id for _ in range(n)]


# --- pure decisions ---------------------------------------------------------------------


def test_leader_is_the_smallest_rank_that_can_lead() -> None:
    ids = _ids(6)
    cands = [Candidate(p, ("/ip4/127.0.0.1/tcp/1",), False) for p in ids]
    best = min(ids, key=lambda p: rank("k", p))
    assert choose_leader("k", cands) == Candidate(best, ("/ip4/127.0.0.1/tcp/1",), False)
    # client-mode peers (or peers without addresses) never lead
    demoted = [Candidate(c.peer_id, (), c.peer_id == best) for c in cands]
    assert choose_leader("k", demoted) is None
    others = [c if c.peer_id != best else Candidate(best, (), True) for c in cands]
    leader = choose_leader("k", others)
    assert leader is not None and leader.peer_id != best
    # the order depends on the key: leadership moves from round to round
    assert len({choose_leader(f"round-{i}", cands) for i in range(20)}) > 1


@pytest.mark.parametrize(
    ("n", "target", "minimum", "sizes", "left"),
    [
        (10, 4, 2, [4, 3, 3], 0),
        (8, 8, 2, [8], 0),
        (9, 8, 2, [5, 4], 0),
        (5, 4, 3, [4], 1),
        (10, 4, 4, [4, 4], 2),
        (7, 4, 3, [4, 3], 0),
        (1, 4, 2, [], 1),
        (1, 4, 1, [1], 0),
        (3, 3, 3, [3], 0),
    ],
)
def test_plan_groups_balanced(
    n: int, target: int, minimum: int, sizes: list[int], left: int
) -> None:
    members = [_member(p) for p in _ids(n)]
    groups, left_over = plan_groups(members, target, minimum)
    assert [len(g) for g in groups] == sizes
    assert len(left_over) == left
    assert left_over == members[n - left :]  # the last arrivals are left over
    if groups:
        assert groups[0][0] == members[0]  # the leader is always placed


def test_plan_groups_properties() -> None:
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    ids = _ids(40)
    for _ in range(300):
        n = rng.randint(1, 40)
        target = rng.randint(1, 12)
        minimum = rng.randint(1, target)
        members = [_member(p, client=i > 0 and rng.random() < 0.3) for i, p in enumerate(ids[:n])]
        groups, left_over = plan_groups(members, target, minimum)
        placed = [m for g in groups for m in g]
        assert sorted(m.peer_id for m in placed + left_over) == sorted(m.peer_id for m in members)
        sizes = [len(g) for g in groups]
        assert all(minimum <= s <= target for s in sizes)
        assert not sizes or max(sizes) - min(sizes) <= 1
        assert all(any(not m.client_mode for m in g) for g in groups)
        hosts = sum(1 for m in members if not m.client_mode)
        # nobody is left over if the rules allowed placing them
        if n // minimum >= -(-n // target) and hosts >= -(-n // target):
            assert not left_over
    assert balanced_sizes(10, 3) == [4, 3, 3]


def test_the_first_reads_come_sooner_than_the_poll_interval() -> None:
    """A peer whose first read came before the others' declarations landed sees them at
    its second read, an eighth of the interval later, not a whole interval later (on
    loopback, 2 of every 3 four-peer steps used to wait that interval); the gaps then
    double up to the interval. With ``form_when_full``, the group forms as soon as the
    late reader joins."""
    config = replace(CONFIG, target_group_size=4, min_group_size=4, form_when_full=True)
    interval = config.poll_interval_seconds
    me, *others = [_member(p) for p in _ids(4)]
    search = GroupSearch(key="k", me=me, config=config, now=0.0, timeout=10.0)
    assert search.next_action(0.0) == Poll(until=search.deadline)
    search.on_declarations([], 0.0)  # read before anyone else's store landed
    reads = [0.0]
    for _ in range(5):
        action = search.next_action(reads[-1])
        assert isinstance(action, Sleep)
        assert isinstance(search.next_action(action.until), Poll)
        reads.append(action.until)
        search.on_declarations([], action.until)
    gaps = [b - a for a, b in itertools.pairwise(reads)]
    assert gaps == pytest.approx([interval * f for f in (1 / 8, 1 / 4, 1 / 2, 1, 1)])
    # The others' declarations are there at the second read: a full view, a leader.
    late = GroupSearch(key="k", me=me, config=config, now=0.0, timeout=10.0)
    late.on_declarations([], 0.0)
    second = interval / 8
    assert late.next_action(second) == Poll(until=late.deadline)
    late.on_declarations([o.candidate() for o in others], second)
    action = late.next_action(second)
    best = choose_leader("k", [m.candidate() for m in (me, *others)])
    assert best is not None
    if best.peer_id == me.peer_id:
        assert late.role is Role.LEADING
    else:
        assert action == Join(best)


# --- a simulated swarm of searches: pure, with a simulated clock ------------------------

CONFIG = MatchmakingConfig(
    target_group_size=8,
    min_group_size=2,
    search_timeout=10.0,
    gather_timeout=2.0,
    request_timeout=1.0,
    poll_interval_seconds=0.25,
)


@dataclass
class SimPeer:
    search: GroupSearch
    start: float
    dead: bool = False
    waiting_on: PeerID | None = None
    outcome: Formed | Failed | None = None
    finished_at: float | None = None


@dataclass
class Sim:
    """Searches that see every declaration ``lag`` seconds after it is made, and whose
    joins arrive at once (a held join is answered when the leader decides)."""

    key: str
    config: MatchmakingConfig
    lag: float = 0.3
    peers: dict[PeerID, SimPeer] = field(default_factory=dict)
    now: float = 0.0
    round_ids: itertools.count[int] = field(default_factory=itertools.count)
    num_redirects: int = 0

    def add(
        self, member: MemberInfo, start: float = 0.0, expected: Sequence[MemberInfo] = ()
    ) -> None:
        search = GroupSearch(
            key=self.key,
            me=member,
            config=self.config,
            now=start,
            timeout=self.config.search_timeout,
            expected=[m.candidate() for m in expected],
            new_round_id=lambda: next(self.round_ids).to_bytes(16, "big"),
        )
        self.peers[member.peer_id] = SimPeer(search, start)

    def _answer(self, joiner: PeerID, leader: PeerID, answer: JoinAnswer | None) -> None:
        peer = self.peers[joiner]
        if peer.dead:
            return
        peer.waiting_on = None
        self.num_redirects += isinstance(answer, Redirect)
        peer.search.on_join_result(leader, answer, self.now, "" if answer else "dead")

    def _read_during_join(self, peer_id: PeerID, declared: list[Candidate]) -> None:
        """``Matchmaker._confirm_during``: a join held by a leader we only expect gets
        reads of the key beside it, and is given up past the gather window if none
        showed the leader (or a read made us follow someone else)."""
        peer = self.peers[peer_id]
        leader, search = peer.waiting_on, peer.search
        if leader is None or search.confirmed(leader):
            return
        search.on_declarations(declared, self.now)
        if search.confirmed(leader) and search.leader and search.leader.peer_id == leader:
            return
        if self.now >= search.gather_deadline:
            search.on_leader_unconfirmed(leader, self.now)
        if not (search.leader and search.leader.peer_id == leader):
            peer.waiting_on = None  # we hang up
            self.peers[leader].search.on_join_abandoned(peer_id, self.now)
            self._flush(leader)

    def step(self) -> None:
        declared = [
            p.search.me.candidate() for p in self.peers.values() if p.start <= self.now - self.lag
        ]
        for peer_id, peer in self.peers.items():
            if peer.waiting_on and not peer.dead:
                self._read_during_join(peer_id, declared)
            if peer.dead or peer.start > self.now or peer.waiting_on or peer.outcome:
                continue
            for _ in range(10):  # act until the peer waits
                action = peer.search.next_action(self.now)
                self._flush(peer_id)
                if isinstance(action, Formed | Failed):
                    peer.outcome, peer.finished_at = action, self.now
                    break
                if isinstance(action, Poll):
                    peer.search.on_declarations(declared, self.now)
                elif isinstance(action, Join):
                    leader = self.peers[action.leader.peer_id]
                    if leader.dead:
                        self._answer(peer_id, action.leader.peer_id, None)
                        continue
                    if leader.start > self.now:  # alive, not searching yet
                        refused = Refused("not looking", not_searching=True)
                        self._answer(peer_id, action.leader.peer_id, refused)
                        continue
                    left = peer.search.deadline - self.now
                    answer = leader.search.on_join(peer.search.me, self.now, left)
                    if answer is None:
                        peer.waiting_on = action.leader.peer_id
                        break
                    self._answer(peer_id, action.leader.peer_id, answer)
                else:
                    assert isinstance(action, Sleep)
                    break

    def _flush(self, leader: PeerID) -> None:
        for joiner, answer in self.peers[leader].search.take_answers():
            if self.peers[joiner].waiting_on == leader:
                self._answer(joiner, leader, answer)

    def run(self, until: float = 15.0, dt: float = 0.05) -> None:
        while self.now < until and not all(p.outcome or p.dead for p in self.peers.values()):
            self.step()
            for peer_id, peer in self.peers.items():
                if peer.dead:  # joins held by a dead peer fail for their callers
                    for other_id, other in self.peers.items():
                        if other.waiting_on == peer_id:
                            self._answer(other_id, peer_id, None)
            self.now = round(self.now + dt, 6)

    def groups(self) -> dict[bytes, Group]:
        found: dict[bytes, Group] = {}
        for peer in self.peers.values():
            if isinstance(peer.outcome, Formed):
                group = peer.outcome.group
                assert found.setdefault(group.round_id, group) == group  # identical copies
        return found


def _sim(
    n: int, config: MatchmakingConfig = CONFIG, *, seed: int, skew: float = 0.5, lag: float = 0.3
) -> Sim:
    """``n`` peers starting within ``skew`` seconds; identities and starts from ``seed``."""
    rng = random.Random(seed)
    sim = Sim("key", config, lag=lag)
    for _ in range(n):
        peer_id = KeyPair.from_seed(rng.randbytes(32)).peer_id
        sim.add(_member(peer_id), start=round(rng.uniform(0, skew), 2))
    return sim


@pytest.mark.parametrize("seed", range(5))
def test_sim_peers_starting_together_form_one_group(seed: int) -> None:
    sim = _sim(8, seed=seed)
    sim.run()
    groups = sim.groups()
    assert len(groups) == 1
    (group,) = groups.values()
    assert set(group.members) == set(sim.peers)
    for peer in sim.peers.values():  # formed right after the gather window
        assert peer.finished_at is not None and peer.finished_at < 4.0


@pytest.mark.parametrize("seed", range(5))
def test_sim_expected_peers_join_their_leader_without_reading_the_dht(seed: int) -> None:
    """A training swarm's peers know from their progress records who averages this step
    and who can lead: each joins the leader as soon as it starts, even one that has not
    started yet (answered "not searching", asked again), so the group forms within two
    poll intervals of the last start, though no declaration is ever readable. Two of the
    six accept no connections (behind NAT): never taken for leaders."""
    rng = random.Random(seed)
    config = replace(CONFIG, target_group_size=6, form_when_full=True)
    members = [
        _member(KeyPair.from_seed(rng.randbytes(32)).peer_id, client=i < 2) for i in range(6)
    ]
    starts = [round(rng.uniform(0, 0.5), 2) for _ in members]
    # The DHT's lag is longer than the whole search: nobody's declaration is ever read.
    hinted, unhinted = Sim("key", config, lag=30.0), Sim("key", config, lag=30.0)
    for member, start in zip(members, starts, strict=True):
        hinted.add(member, start, expected=[m for m in members if m is not member])
        unhinted.add(member, start)
    hinted.run()
    (group,) = hinted.groups().values()
    assert set(group.members) == set(hinted.peers)
    for peer in hinted.peers.values():
        assert peer.finished_at is not None
        assert peer.finished_at <= max(starts) + 2 * config.poll_interval_seconds
    # Without them, and no declaration readable, nobody finds anyone.
    unhinted.run()
    assert not unhinted.groups()


def test_sim_an_expected_peer_that_never_searches_costs_the_gather_window() -> None:
    """An expected peer that is alive but never searches (it saw another epoch) is asked
    again until the gather window ends, then dropped like any refusing leader."""
    config = replace(CONFIG, target_group_size=3, form_when_full=True)
    ids = sorted(_ids(3), key=lambda p: rank("key", p))
    absent, a, b = (_member(p) for p in ids)  # the absent one ranks best: it would lead
    sim = Sim("key", config, lag=0.3)
    sim.add(a, 0.0, expected=[absent, b])
    sim.add(b, 0.0, expected=[absent, a])
    sim.add(absent, 100.0)  # starts long after everyone's deadline
    sim.run(until=12.0)
    (group,) = sim.groups().values()
    assert set(group.members) == {a.peer_id, b.peer_id}
    for peer in (sim.peers[a.peer_id], sim.peers[b.peer_id]):
        assert peer.finished_at is not None
        assert config.gather_timeout <= peer.finished_at <= config.gather_timeout + 1.0


@pytest.mark.parametrize("seed", range(8))
def test_sim_an_expected_leader_that_starts_late_never_splits_the_group(seed: int) -> None:
    """The best-ranked expected peer starts after some peers' gather windows: they give
    it up and gather around the next best, while a later peer still waits on it. Given
    up means forgotten, not gone: once its declaration shows, the leader they gathered
    around hands over to it. One group forms, never two (marked gone, it split the
    swarm in two pairs); the late peer is in it unless it came after every window."""
    rng = random.Random(seed)
    config = replace(CONFIG, target_group_size=4, form_when_full=True)
    late, a, b, c = (_member(p) for p in sorted(_ids(4), key=lambda p: rank("key", p)))
    members = [late, a, b, c]
    starts = {a: 0.0, b: 0.0, c: round(rng.uniform(0.3, 0.6), 2), late: 2.1}
    sim = Sim("key", config, lag=0.3)
    for member, start in starts.items():
        sim.add(member, start, expected=[m for m in members if m is not member])
    sim.run()
    groups = list(sim.groups().values())
    assert len(groups) == 1, [g.members for g in groups]
    assert {a.peer_id, b.peer_id, c.peer_id} <= set(groups[0].members)


def _expecting(
    me: MemberInfo, config: MatchmakingConfig, expected: Sequence[MemberInfo]
) -> GroupSearch:
    """A search under "key" from time 0 (10 s) told to expect ``expected``."""
    return GroupSearch(
        key="key",
        me=me,
        config=config,
        now=0.0,
        timeout=10.0,
        expected=[m.candidate() for m in expected],
    )


def test_a_follower_chooses_again_when_a_read_shows_its_leader_cannot_lead() -> None:
    """A record said the leader could lead; its declaration says it cannot now (its NAT
    turned out not punchable): the follower leaves it for the next best."""
    config = replace(CONFIG, target_group_size=3, form_when_full=True)
    first, second, me = sorted(_ids(3), key=lambda p: rank("key", p))
    search = _expecting(_member(me), config, [_member(first), _member(second)])
    assert search.next_action(0.0) == Join(_member(first).candidate())
    search.on_declarations([_member(first, client=True).candidate()], 0.1)
    assert search.leader == _member(second).candidate()


def test_a_leader_chosen_from_expected_peers_reads_the_key_before_forming() -> None:
    """Records lag: a peer that expects only ``b`` leads and ``b`` joins at once, but a
    better-ranked peer ``c`` is searching too. The leader forms nothing before its first
    read of the key; the read shows ``c``, and both go to it. Without that read the two
    would have stepped as a pair, and ``c`` apart."""
    config = replace(CONFIG, target_group_size=2, form_when_full=True)
    c, a, b = (_member(p) for p in sorted(_ids(3), key=lambda p: rank("key", p)))
    search = _expecting(a, config, [b])
    assert isinstance(search.next_action(0.0), Poll)  # leading, reading the key
    assert search.role is Role.LEADING
    assert search.on_join(b, 0.01, 9.0, expected_size=2) is None  # held
    assert not isinstance(search.next_action(0.02), Formed)  # no read came back yet
    search.on_declarations([c.candidate(), b.candidate()], 0.08)
    assert search.take_answers() == [(b.peer_id, Redirect(c.candidate()))]
    assert search.next_action(0.08) == Join(c.candidate())
    # Had the read shown nobody new, the pair forms right after it.
    pair = _expecting(a, config, [b])
    pair.next_action(0.0)
    pair.on_join(b, 0.01, 9.0, expected_size=2)
    pair.on_declarations([b.candidate()], 0.08)
    assert isinstance(pair.next_action(0.08), Formed)


def test_expected_peers_that_cannot_lead_are_seen_but_never_joined() -> None:
    """An expected peer whose record gives no address (behind NAT, not punchable) counts
    toward the group, but a search never joins it, even when it ranks best."""
    config = replace(CONFIG, target_group_size=3, form_when_full=True)
    best, a, b = sorted(_ids(3), key=lambda p: rank("key", p))
    natted = _member(best, client=True)
    search = _expecting(_member(b), config, [natted, _member(a)])
    assert search.next_action(0.0) == Join(_member(a).candidate())


@pytest.mark.parametrize("seed", range(5))
def test_sim_ten_peers_target_four_split_balanced(seed: int) -> None:
    config = MatchmakingConfig(
        target_group_size=4,
        min_group_size=2,
        search_timeout=10.0,
        gather_timeout=2.0,
        poll_interval_seconds=0.25,
    )
    sim = _sim(10, config, seed=seed)
    sim.run()
    groups = sim.groups()
    assert sorted(len(g) for g in groups.values()) == [3, 3, 4]
    placed = [m for g in groups.values() for m in g.members]
    assert sorted(placed) == sorted(sim.peers)


def test_sim_views_that_differ_converge() -> None:
    """Peers starting up to 1.5 s apart with a 0.3 s DHT lag, target 4: each leaves the
    gather phase as soon as it sees 4 peers, so they choose leaders on different views;
    redirects and handovers still give balanced groups of everyone, every time."""
    num_redirects = 0
    for seed in range(8):
        sim = _sim(10, replace(CONFIG, target_group_size=4), seed=seed, skew=1.5)
        sim.run()
        num_redirects += sim.num_redirects
        groups = sim.groups()
        assert sorted(len(g) for g in groups.values()) == [3, 3, 4], f"seed {seed}"
        assert sorted(m for g in groups.values() for m in g.members) == sorted(sim.peers)
    assert num_redirects > 0  # the redirect paths were exercised


def test_sim_dead_leader_is_replaced() -> None:
    sim = _sim(6, replace(CONFIG, target_group_size=6), seed=1, skew=0.0)
    leader = min(sim.peers, key=lambda p: rank("key", p))
    sim.run(until=1.0)  # everyone saw all 6 and joined the leader, which holds the joins
    assert sim.peers[leader].search.num_held == 5
    sim.peers[leader].dead = True
    sim.run()
    groups = sim.groups()
    assert len(groups) == 1
    (group,) = groups.values()
    assert set(group.members) == set(sim.peers) - {leader}


def test_sim_client_mode_peers_join_but_never_lead() -> None:
    sim = Sim("key", CONFIG)
    ids = sorted(_ids(4), key=lambda p: rank("key", p))
    sim.add(_member(ids[0], client=True))  # the best rank, but cannot be dialed
    for peer_id in ids[1:]:
        sim.add(_member(peer_id))
    sim.run()
    (group,) = sim.groups().values()
    assert set(group.members) == set(ids)
    assert group.client_mode[group.index(ids[0])] is True
    assert group.weights[group.index(ids[0])] == 0.0


def test_sim_lone_peer_fails_with_a_reason() -> None:
    sim = Sim("key", CONFIG)
    (peer_id,) = _ids(1)
    sim.add(_member(peer_id))
    sim.run()
    outcome = sim.peers[peer_id].outcome
    assert isinstance(outcome, Failed)
    assert "only 1 peer(s) joined" in outcome.reason
    finished = sim.peers[peer_id].finished_at
    assert finished is not None and finished <= CONFIG.search_timeout


def test_sim_lone_client_fails_at_the_deadline() -> None:
    sim = Sim("key", CONFIG)
    ids = _ids(2)
    for peer_id in ids:
        sim.add(_member(peer_id, client=True))
    sim.run()
    for peer_id in ids:
        outcome = sim.peers[peer_id].outcome
        assert isinstance(outcome, Failed)
        assert "no peer that accepts connections" in outcome.reason


def test_leftover_peers_are_rejected() -> None:
    config = MatchmakingConfig(
        target_group_size=4, min_group_size=4, search_timeout=10.0, gather_timeout=2.0
    )
    sim = _sim(6, config, seed=3, skew=0.0)
    sim.run()
    groups = sim.groups()
    assert [len(g) for g in groups.values()] == [4]
    rejected = [p for p in sim.peers.values() if isinstance(p.outcome, Failed)]
    assert len(rejected) == 2
    assert all("left over" in p.outcome.reason for p in rejected if isinstance(p.outcome, Failed))


def test_search_answers_and_redirects() -> None:
    ids = sorted(_ids(3), key=lambda p: rank("key", p))
    best, middle, worst = (_member(p) for p in ids)
    search = GroupSearch(key="key", me=middle, config=CONFIG, now=0.0, timeout=10.0)
    # gathering, no better peer known: a join is held
    assert search.on_join(worst, 0.1, 5.0) is None
    # a better-ranked peer shows up: we follow it, and the held join is redirected
    search.on_declarations([best.candidate(), worst.candidate()], 0.2)
    action = search.next_action(3.0)
    assert isinstance(action, Join) and action.leader.peer_id == best.peer_id
    assert search.take_answers() == [(worst.peer_id, Redirect(best.candidate()))]
    assert search.on_join(worst, 3.0, 5.0) == Redirect(best.candidate())
    # a redirect to a worse rank is a protocol violation: that leader is dropped
    search.on_join_result(best.peer_id, Redirect(worst.candidate()), 3.1)
    assert search.role is Role.LEADING
    # a group that does not hold us is refused
    search2 = GroupSearch(key="key", me=worst, config=CONFIG, now=0.0, timeout=10.0)
    search2.on_declarations([best.candidate()], 0.0)
    assert isinstance(search2.next_action(2.5), Join)
    other = Group.of("key", b"r" * 16, [best, middle])
    search2.on_join_result(best.peer_id, Placed(other), 2.6)
    outcome = search2.next_action(2.6)
    assert isinstance(outcome, Failed) and "exactly once" in outcome.reason
    # rejected: give up with the leader's reason
    search3 = GroupSearch(key="key", me=worst, config=CONFIG, now=0.0, timeout=10.0)
    search3.on_declarations([best.candidate()], 0.0)
    assert isinstance(search3.next_action(2.5), Join)
    search3.on_join_result(best.peer_id, Rejected("too few"), 2.6)
    outcome = search3.next_action(2.6)
    assert isinstance(outcome, Failed) and "too few" in outcome.reason
    # refused, with the list of peers already placed: try the next best
    search4 = GroupSearch(key="key", me=worst, config=CONFIG, now=0.0, timeout=10.0)
    search4.on_declarations([best.candidate(), middle.candidate()], 0.0)
    assert isinstance(search4.next_action(2.5), Join)
    search4.on_join_result(best.peer_id, Refused("finished", (best.peer_id,)), 2.6)
    action = search4.next_action(2.6)
    assert isinstance(action, Join) and action.leader.peer_id == middle.peer_id


def test_a_better_ranked_joiner_is_held_not_sent_to_itself() -> None:
    ids = sorted(_ids(2), key=lambda p: rank("key", p))
    better, me = _member(ids[0]), _member(ids[1])
    search = GroupSearch(key="key", me=me, config=CONFIG, now=0.0, timeout=10.0)
    search.on_declarations([better.candidate()], 0.0)
    assert search.on_join(better, 0.1, 5.0) is None  # it chose to follow us
    assert isinstance(search.next_action(2.5), Formed)
    ((peer_id, answer),) = search.take_answers()
    assert peer_id == better.peer_id and isinstance(answer, Placed) and len(answer.group) == 2


def test_a_leader_expecting_fewer_forms_one_group_of_the_size_its_joiners_wait_for() -> None:
    # The collaborative optimizer sets each peer's target to the peers it expects in the
    # round. A leader whose view lagged expects 3 of 5; its joiners expect all 5, so it
    # waits for them, and must then place them in one group: two groups would be two
    # rounds, each averaging alone, and the swarm would split.
    config = replace(CONFIG, target_group_size=3, form_when_full=True)
    ids = sorted(_ids(5), key=lambda p: rank("key", p))
    leader, *joiners = (_member(p) for p in ids)
    search = GroupSearch(key="key", me=leader, config=config, now=0.0, timeout=10.0)
    search.on_declarations([m.candidate() for m in joiners], 0.0)
    for i, joiner in enumerate(joiners[:2]):
        assert search.on_join(joiner, 0.1 + i / 10, 8.0, expected_size=5) is None
    assert not isinstance(search.next_action(0.5), Formed)  # 3 joined, 5 are expected
    for i, joiner in enumerate(joiners[2:]):
        assert search.on_join(joiner, 0.6 + i / 10, 8.0, expected_size=5) is None
    formed = search.next_action(0.8)
    assert isinstance(formed, Formed) and len(formed.group) == 5
    answers = search.take_answers()
    assert len(answers) == 4 and all(a == Placed(formed.group) for _, a in answers)


def test_keys_are_checked() -> None:
    check_key("a/normal-key.round-3")
    for bad in ("", "x" * 300, "[owner:12D3KooW]"):
        with pytest.raises(ValueError):
            check_key(bad)


# --- real peers on loopback, in one process --------------------------------------------

FAST = MatchmakingConfig(
    target_group_size=8,
    min_group_size=2,
    search_timeout=15.0,
    gather_timeout=1.5,
    request_timeout=3.0,
    poll_interval_seconds=0.25,
)


@contextlib.asynccontextmanager
async def matchmakers(
    num_peers: int, config: MatchmakingConfig = FAST, *, num_clients: int = 0
) -> AsyncIterator[list[Matchmaker]]:
    """``num_peers`` peers with a DHT and a matchmaker each (the last ``num_clients`` of
    them in client mode: no listen address)."""
    async with contextlib.AsyncExitStack() as stack:
        out: list[Matchmaker] = []
        initial: tuple[str, ...] = ()
        for i in range(num_peers):
            client = i >= num_peers - num_clients
            peer = await stack.enter_async_context(
                Peer(PeerConfig(listen_addrs=() if client else ("/ip4/127.0.0.1/tcp/0",)))
            )
            dht = await stack.enter_async_context(
                DHT(
                    peer,
                    DHTConfig(initial_peers=initial, rpc_timeout=2.0, maintenance_interval=3600.0),
                )
            )
            if not initial:
                initial = (str(peer.listen_addrs[0]),)
            out.append(await stack.enter_async_context(Matchmaker(dht, config)))
        for m in out:  # a second round of lookups, now that everyone is there
            await m.dht.find_nearest(m.dht.node_id)
        yield out


async def _search_all(
    mms: list[Matchmaker], key: str, **kwargs: Any
) -> list[Group | BaseException]:
    return list(
        await asyncio.gather(
            *(
                m.look_for_group(key, metadata=f"meta-{i}".encode(), bandwidth=i + 1.0, **kwargs)
                for i, m in enumerate(mms)
            ),
            return_exceptions=True,
        )
    )


@pytest.mark.timeout(60)
def test_peers_on_loopback_form_one_group(arun: Run) -> None:
    async def main() -> None:
        async with matchmakers(5, num_clients=1) as mms:
            results = await _search_all(mms, "round-1")
            assert all(isinstance(r, Group) for r in results), results
            groups = [r for r in results if isinstance(r, Group)]
            assert all(g == groups[0] for g in groups)
            group = groups[0]
            assert set(group.members) == {m.peer.peer_id for m in mms}
            for i, m in enumerate(mms):
                j = group.index(m.peer.peer_id)
                assert group.metadata[j] == f"meta-{i}".encode()
                assert group.bandwidths[j] == i + 1.0
                assert group.client_mode[j] == (i == 4)
                assert bool(group.addrs[j]) == (i != 4)
            assert len(group.round_id) == 32
            # a second round under a new key gets a new round id
            again = await _search_all(mms, "round-2")
            assert all(isinstance(r, Group) and r.round_id != group.round_id for r in again)
            assert sum(m.statistics().num_groups_formed for m in mms) == 10

    arun(main())


@pytest.mark.timeout(60)
def test_peers_told_who_comes_form_one_group_and_skip_malformed_hints(arun: Run) -> None:
    """``expected`` as a training swarm passes it: every other peer with its
    ``contact()`` (the client's is empty: it cannot lead), plus entries a hostile record
    could hold (too many addresses, an address too long, not a list of strings). The
    malformed ones are skipped, the search goes on, and the four form one group."""
    config = replace(FAST, target_group_size=4, form_when_full=True)

    async def main() -> None:
        async with matchmakers(4, config, num_clients=1) as mms:
            contacts = {m.peer.peer_id: m.contact() for m in mms}
            assert contacts[mms[3].peer.peer_id] == ()
            assert all(contacts[m.peer.peer_id] for m in mms[:3])
            junk: dict[PeerID, Any] = {
                KeyPair.generate().peer_id: ["/ip4/127.0.0.1/tcp/1"] * 9,
                KeyPair.generate().peer_id: ["/ip4/" + "1" * 300],
                KeyPair.generate().peer_id: "/ip4/127.0.0.1/tcp/1",
                KeyPair.generate().peer_id: [7],
            }

            async def search(m: Matchmaker) -> Group:
                others = {p: a for p, a in contacts.items() if p != m.peer.peer_id}
                return await m.look_for_group("told", expected={**others, **junk})

            groups = await asyncio.gather(*(search(m) for m in mms))
            assert all(g == groups[0] for g in groups)
            assert set(groups[0].members) == set(contacts)

    arun(main())


@pytest.mark.timeout(60)
def test_lone_peer_gets_an_error_by_its_deadline(arun: Run) -> None:
    async def main() -> None:
        async with matchmakers(1) as (mm,):
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(MatchmakingError, match="only 1 peer"):
                await mm.look_for_group("alone", timeout=3.0)
            print(f"raised after {loop.time() - started:.2f} s (timeout 3.0)")
            assert mm.statistics().num_failures == 1

    arun(main())


@pytest.mark.timeout(60)
def test_concurrent_searches_under_different_keys(arun: Run) -> None:
    async def main() -> None:
        async with matchmakers(3) as mms:
            first, second = await asyncio.gather(
                _search_all(mms, "gossip-a"), _search_all(mms, "gossip-b")
            )
            for results in (first, second):
                assert all(isinstance(r, Group) and len(r) == 3 for r in results), results
            first_search = asyncio.ensure_future(mms[0].look_for_group("same", timeout=2.0))
            await asyncio.sleep(0)
            with pytest.raises(ValueError, match="already looking"):
                await mms[0].look_for_group("same", timeout=2.0)
            first_search.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first_search

    arun(main())


@pytest.mark.timeout(60)
def test_cancellation_propagates_and_frees_the_key(arun: Run) -> None:
    async def main() -> None:
        async with matchmakers(2) as mms:
            task = asyncio.ensure_future(mms[0].look_for_group("k", timeout=10.0))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            results = await _search_all(mms, "k", timeout=10.0)
            assert all(isinstance(r, Group) and len(r) == 2 for r in results), results

    arun(main())


@pytest.mark.timeout(60)
def test_hostile_joins_get_clear_errors_and_the_leader_keeps_serving(arun: Run) -> None:
    async def main() -> None:
        async with matchmakers(4) as mms:
            key = "hostile"
            honest, attacker = mms[:3], mms[3]
            leader = min(honest, key=lambda m: rank(key, m.peer.peer_id))
            searches = asyncio.ensure_future(_search_all(honest, key))
            await asyncio.sleep(0.3)
            target = leader.peer.listen_addrs[0]
            addrs = [str(a) for a in attacker.peer.listen_addrs]

            async def call(request: object) -> JoinResponse:
                return await attacker.peer.call_unary(
                    target, JOIN_PROTOCOL, request, JoinResponse, timeout=5.0
                )

            oversized = JoinRequest(key, addrs, False, 1.0, b"x" * (MAX_METADATA_BYTES + 1))
            with pytest.raises(RemoteError, match="metadata has 4097 bytes"):
                await call(oversized)
            huge = JoinRequest(key, addrs, False, 1.0, b"x" * 100_000)
            with pytest.raises(RemoteError, match="frame"):
                await call(huge)
            with pytest.raises(RemoteError, match="WireError"):
                await call(["garbage", 1, 2])
            with pytest.raises(RemoteError, match="bandwidth"):
                await call(JoinRequest(key, addrs, False, float("nan"), b""))
            with pytest.raises(RemoteError, match="addresses"):
                await call(JoinRequest(key, [], False, 1.0, b""))
            wrong = await call(JoinRequest("some other key", addrs, False, 1.0, b""))
            assert wrong.status == JoinStatus.NOT_SEARCHING.value
            assert "not looking for a group under key 'some other key'" in wrong.reason
            results = await searches
            assert all(isinstance(r, Group) and len(r) == 3 for r in results), results
            assert attacker.peer.peer_id not in results[0].members  # type: ignore[union-attr]
            late = await call(JoinRequest(key, addrs, False, 1.0, b""))
            assert late.status == JoinStatus.REFUSED.value and "already formed" in late.reason

    arun(main())


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="min_group_size"):
        MatchmakingConfig(target_group_size=2, min_group_size=3)
    with pytest.raises(ValueError, match="gather_timeout"):
        MatchmakingConfig(search_timeout=2.0, gather_timeout=5.0)
    with pytest.raises(ValueError, match="request_timeout"):
        MatchmakingConfig(request_timeout=0)
    with pytest.raises(ValueError, match="poll_interval"):
        MatchmakingConfig(gather_timeout=1.0, poll_interval_seconds=2.0)


def test_part_weights_count_like_links_alike_and_keep_a_slow_one_apart() -> None:
    ids = _ids(5)
    group = Group(
        key="key",
        round_id=b"\x01" * 16,
        members=tuple(ids),
        addrs=((),) * 5,
        client_mode=(False, False, False, False, True),
        bandwidths=(13.8e6, 11.0e6, 11.3e6, 3.0e6, 50e6),
        metadata=(b"",) * 5,
    )
    # Within 1.5x of the fastest member that reduces: the fastest's weight; the 3 MB/s
    # link keeps its own; the client-mode member reduces nothing whatever it measured.
    assert group.weights == (13.8e6, 13.8e6, 13.8e6, 3.0e6, 0.0)
