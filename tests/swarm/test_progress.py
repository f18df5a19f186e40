"""The swarm's progress as one peer sees it: absurd claims cannot end an epoch."""

from __future__ import annotations

import contextlib
import time

from peers import KeyPair, PeerID
from peers.dht import BlockingDHT, dht_time
from peers.dht.records import owner_marker
from swarm.collaborative.driver import _parse_records
from swarm.collaborative.progress import PeerProgress, split_winner, summarize


def _ids(n: int) -> list[PeerID]:
    return [KeyPair.generate().peer_id for _ in range(n)]


def _view(claims: list[int], mine: int = 16, target: int = 64) -> object:
    me, *others = _ids(len(claims) + 1)
    now = 1000.0
    records = {p: PeerProgress(3, c, 100.0, now) for p, c in zip(others, claims, strict=True)}
    return summarize(
        records, me, PeerProgress(3, mine, 100.0, now), target, now=now, expiration_seconds=5
    )


def test_honest_peers_fill_the_batch() -> None:
    view = _view([16, 16, 16])
    assert view.samples == 64 and view.ready and view.num_peers == 4  # type: ignore[attr-defined]
    assert view.eta_seconds == 0.0  # type: ignore[attr-defined]


def test_the_eta_follows_the_swarm_throughput() -> None:
    view = _view([8, 8, 8], mine=8)  # 32 of 64 samples, 4 peers at 100 samples/s each
    assert view.samples_per_second == 400.0  # type: ignore[attr-defined]
    assert view.eta_seconds == (64 - 32) / 400.0  # type: ignore[attr-defined]


def test_an_absurd_claim_cannot_end_the_epoch_by_itself() -> None:
    view = _view([10**12, 0, 0], mine=0)
    assert not view.ready  # type: ignore[attr-defined]
    view = _view([10**12, 8, 8], mine=8)
    assert view.samples < 64 and not view.ready  # type: ignore[attr-defined]
    # ... and in a pair, one liar is no majority either
    assert not _view([10**12], mine=4).ready  # type: ignore[attr-defined]


def test_stale_and_malformed_records_are_ignored() -> None:
    me, other = _ids(2)
    now = 1000.0
    view = summarize(
        {other: PeerProgress(9, 500, 1.0, now - 60)},
        me,
        PeerProgress(3, 8, 1.0, now),
        64,
        now=now,
        expiration_seconds=5,
    )
    assert view.epoch == 3 and view.num_peers == 1
    good = [1, 2, 1.0, now, False, b"", 3]
    assert PeerProgress.from_wire(good) == PeerProgress(1, 2, 1.0, now, False, b"", 3)
    # An older version's record has no contact: not said, which is not "cannot lead".
    assert PeerProgress.from_wire(good).contact is None  # type: ignore[union-attr]
    addrs = ["/ip4/198.18.0.2/tcp/4001", "/ip4/198.18.0.2/tcp/4001/p2p/Qm/p2p-circuit"]
    told = PeerProgress.from_wire([*good, addrs])
    assert told == PeerProgress(1, 2, 1.0, now, False, b"", 3, tuple(addrs))
    assert PeerProgress.from_wire(told.to_wire()) == told  # type: ignore[union-attr]
    assert PeerProgress.from_wire([*good, []]).contact == ()  # type: ignore[union-attr]
    # A later version's record, with fields appended, reads as what this one knows.
    assert PeerProgress.from_wire([*good, addrs, True, "later"]) == told
    for garbage in (
        None,
        [1, 2, 3],
        good[:6],
        [*good, *[0] * 26],  # more fields than any version may add
        [1, -5, 0.0, now, False, b"", 1],
        [1, 2, float("nan"), now, False, b"", 1],
        [True, 2, 1.0, now, False, b"", 1],
        [1, 2, 1.0, now, "yes", b"", 1],
        [1, 2, 1.0, now, False, b"x" * 33, 1],
        [1, 2, 1.0, now, False, b"", 0],
        [1, 2, 1.0, now, False, b"", 10**6],  # would make joiners wait for a crowd
        [1, 2, 1.0, now, False, b"", True],
    ):
        assert PeerProgress.from_wire(garbage) is None, garbage
    # A malformed contact costs only itself: the progress counts, the contact is unsaid.
    for contact in (
        "/ip4/198.18.0.2/tcp/4001",  # a contact is a list of addresses
        [b"/ip4/198.18.0.2/tcp/4001"],
        [""],
        ["/ip4/" + "1" * 300],
        ["/ip4/198.18.0.2/tcp/4001"] * 9,
        True,
    ):
        assert PeerProgress.from_wire([*good, contact]) == PeerProgress.from_wire(good), contact


def test_a_liar_on_the_dht_does_not_make_an_honest_peer_ready() -> None:
    """A real peer publishes a billion samples under the run's progress key; the honest
    peer reads it through the DHT and still waits for its batch."""
    with contextlib.ExitStack() as stack:
        honest = stack.enter_context(BlockingDHT())
        addr = f"{honest.peer.listen_addrs[0]}/p2p/{honest.peer.peer_id}"
        liar = stack.enter_context(BlockingDHT([addr]))
        key = "run/progress"
        claim = PeerProgress(0, 10**9, 1e9, dht_time())
        assert liar.store(key, claim.to_wire(), ttl=30, subkey=owner_marker(liar.peer.peer_id))
        found: object = None
        deadline = time.monotonic() + 10
        while not found and time.monotonic() < deadline:
            found = honest.get(key)
        assert isinstance(found, dict)
        records = _parse_records(found)
        assert list(records) == [liar.peer.peer_id]
        mine = PeerProgress(0, 16, 100.0, dht_time())
        view = summarize(
            records, honest.peer.peer_id, mine, 1024, now=dht_time(), expiration_seconds=10
        )
        assert not view.ready and view.samples <= 2 * 16 * 4


def test_a_split_swarm_follows_the_majority_branch() -> None:
    me, a, b, c = _ids(4)
    now = 1000.0

    def rec(fp: bytes, epoch: int = 5) -> PeerProgress:
        return PeerProgress(epoch, 0, 1.0, now, False, fp)

    mine = rec(b"x")
    assert (
        split_winner({a: rec(b"x"), b: rec(b"x")}, me, mine, now=now, expiration_seconds=5) is None
    )
    winner = split_winner(
        {a: rec(b"y"), b: rec(b"y"), c: rec(b"y")}, me, mine, now=now, expiration_seconds=5
    )
    assert winner is not None and winner[0] == b"y" and set(winner[1]) == {a, b, c}
    # two against two: the smaller fingerprint ("x", mine) stays
    assert (
        split_winner(
            {a: rec(b"y"), b: rec(b"y"), c: rec(b"x")}, me, mine, now=now, expiration_seconds=5
        )
        is None
    )
    # a tie goes to the smaller fingerprint, the same choice on both sides
    tie = split_winner({a: rec(b"a")}, me, mine, now=now, expiration_seconds=5)
    assert tie is not None and tie[0] == b"a"
    assert split_winner({a: rec(b"z")}, me, mine, now=now, expiration_seconds=5) is None
    # other epochs and stale records do not count
    assert split_winner({a: rec(b"a", epoch=4)}, me, mine, now=now, expiration_seconds=5) is None


def test_the_swarm_epoch_is_what_half_the_peers_reached_not_the_largest_claim() -> None:
    me, a, b, liar = _ids(4)
    now = 1000.0

    def view(records: dict[PeerID, int], mine: int) -> object:
        return summarize(
            {p: PeerProgress(e, 0, 1.0, now) for p, e in records.items()},
            me,
            PeerProgress(mine, 0, 1.0, now),
            64,
            now=now,
            expiration_seconds=5,
        )

    # one liar far ahead moves nothing, and is not counted in this epoch's round
    honest = view({a: 7, b: 7, liar: 10**9}, mine=7)
    assert honest.epoch == 7 and honest.num_peers == 3  # type: ignore[attr-defined]
    # a newcomer is behind the honest majority, not behind the liar
    assert view({a: 7, b: 7, liar: 10**9}, mine=0).epoch == 7  # type: ignore[attr-defined]
    # a peer that missed a round half the swarm took is behind (it resyncs) ...
    assert view({a: 8, b: 8}, mine=7).epoch == 8  # type: ignore[attr-defined]
    assert view({a: 8}, mine=7).epoch == 8  # type: ignore[attr-defined]
    # ... one that stepped alone is a minority: the other two step, and the split
    # rule makes the one follow the two
    assert view({a: 8, b: 7}, mine=7).epoch == 7  # type: ignore[attr-defined]
    # a peer ahead of the others stays in its own epoch
    assert view({a: 7, b: 7}, mine=8).epoch == 8  # type: ignore[attr-defined]


def test_an_averaging_flag_alone_does_not_make_a_one_sample_step() -> None:
    me, liar = _ids(2)
    now = 1000.0

    def ready(mine: int) -> bool:
        view = summarize(
            {liar: PeerProgress(3, 0, 1.0, now, averaging=True)},
            me,
            PeerProgress(3, mine, 1.0, now),
            64,
            now=now,
            expiration_seconds=5,
        )
        return view.ready

    assert not ready(1)
    assert not ready(31)
    assert ready(32)  # half the batch: the flag may bring the step forward
