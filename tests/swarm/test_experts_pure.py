"""Pure parts of remote experts: no loop, no network
(CONTRIBUTING.md, "How tests are organised")."""

from __future__ import annotations

import random
from collections.abc import Collection

import pytest
import torch

from averaging.compression import Float16Codec
from peers import KeyPair, PeerID
from peers.dht import ValueWithExpiration
from swarm.experts import Batch, Batcher, ServerBusy, TensorSpec
from swarm.experts.announce import (
    Announcement,
    ExpertLocation,
    by_uid,
    dht_key,
    parse_level,
    records,
)
from swarm.experts.beam_search import BeamSearch
from swarm.experts.dispatch import Quorum, plan_calls
from swarm.experts.kept import KeptStore
from swarm.experts.schema import check_batch
from swarm.experts.uids import grid_uids, is_valid_uid, levels, split_uid

PEERS = [KeyPair.from_seed(bytes([i]) * 32).peer_id for i in range(3)]


# --- batcher ------------------------------------------------------------------------


def test_batcher_runs_a_lone_request_at_once_and_groups_those_that_wait() -> None:
    b: Batcher[int] = Batcher(max_batch_size=8, max_queued_samples=32)
    assert b.next_batch(0.0) is None
    b.submit(1, "forward", 3, now=0.0)
    assert b.next_batch(0.0) == Batch("forward", (1,), 3)
    # while the worker computes, requests pile up; the next batch takes all that fit
    for ticket, size in ((2, 4), (3, 2), (4, 3), (5, 1)):
        b.submit(ticket, "forward", size, now=1.0)
    assert b.next_batch(1.0) == Batch("forward", (2, 3, 5), 7)  # 4 (3 samples) did not fit
    assert b.next_batch(1.0) == Batch("forward", (4,), 3)
    assert b.num_queued == 0 and b.num_queued_samples == 0


def test_batcher_keeps_kinds_apart_oldest_first() -> None:
    b: Batcher[str] = Batcher(max_batch_size=8, max_queued_samples=32)
    b.submit("f1", "forward", 1, now=0.0)
    b.submit("b1", "backward", 1, now=0.1)
    b.submit("f2", "forward", 1, now=0.2)
    assert b.next_batch(1.0) == Batch("forward", ("f1", "f2"), 2)
    assert b.next_batch(1.0) == Batch("backward", ("b1",), 1)


def test_batcher_waits_for_min_batch_size_until_max_wait() -> None:
    b: Batcher[int] = Batcher(
        max_batch_size=8, max_queued_samples=32, min_batch_size=4, max_wait_seconds=0.5
    )
    b.submit(1, "forward", 1, now=10.0)
    assert b.next_batch(10.1) == 10.5
    b.submit(2, "forward", 3, now=10.2)
    assert b.next_batch(10.2) == Batch("forward", (1, 2), 4)  # enough: no more waiting
    b.submit(3, "forward", 1, now=11.0)
    assert b.next_batch(11.5) == Batch("forward", (3,), 1)  # waited long enough


def test_batcher_bounds_its_queue_and_forgets_cancelled_requests() -> None:
    b: Batcher[int] = Batcher(max_batch_size=4, max_queued_samples=8)
    b.submit(1, "forward", 4, now=0)
    b.submit(2, "forward", 4, now=0)
    with pytest.raises(ServerBusy, match="8 samples are queued"):
        b.submit(3, "forward", 1, now=0)
    with pytest.raises(ValueError):
        b.submit(4, "forward", 5, now=0)  # larger than a batch
    assert b.cancel(1) and not b.cancel(1)
    b.submit(3, "backward", 1, now=0)
    assert b.next_batch(0) == Batch("forward", (2,), 4)
    assert b.next_batch(0) == Batch("backward", (3,), 1)


def test_batcher_random_workload_conserves_requests() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    b: Batcher[int] = Batcher(max_batch_size=16, max_queued_samples=64)
    queued: dict[int, int] = {}
    served: set[int] = set()
    for ticket in range(500):
        if rng.random() < 0.6:
            size = rng.randint(1, 16)
            try:
                b.submit(ticket, rng.choice(["forward", "backward"]), size, now=ticket)
                queued[ticket] = size
            except ServerBusy:
                assert sum(queued.values()) + size > 64
        elif rng.random() < 0.2 and queued:
            victim = rng.choice(list(queued))
            assert b.cancel(victim)
            del queued[victim]
        else:
            batch = b.next_batch(ticket)
            if isinstance(batch, Batch):
                assert 1 <= batch.num_samples <= 16
                assert batch.num_samples == sum(queued.pop(t) for t in batch.tickets)
                served.update(batch.tickets)
        assert b.num_queued_samples == sum(queued.values())


# --- uids and schema ------------------------------------------------------------------


def test_uids_parse_and_expand() -> None:
    assert split_uid("ffn.3.7") == ("ffn", (3, 7))
    assert levels("ffn.3.7") == [("ffn", 3), ("ffn.3", 7)]
    assert grid_uids("ffn.[0:2].4") == ["ffn.0.4", "ffn.1.4"]
    for bad in ("ffn", "ffn.", "ffn.03", "3.ffn", "ffn.-1", "ffn.a", "x" * 200 + ".1", 7):
        assert not is_valid_uid(bad), bad
    with pytest.raises(ValueError, match="invalid expert uid"):
        split_uid("ffn")


def test_check_batch_names_the_first_mismatch() -> None:
    specs = [TensorSpec(shape=[4], dtype="float32"), TensorSpec(shape=[2, 3], dtype="int64")]
    good = [torch.zeros(5, 4), torch.zeros(5, 2, 3, dtype=torch.int64)]
    assert check_batch("inputs", good, specs, max_batch_size=8) == 5
    cases = [
        ([good[0]], "expected 2 tensors, got 1"),
        ([good[0].double(), good[1]], r"inputs\[0\]: expected dtype float32, got float64"),
        ([torch.zeros(5, 3), good[1]], r"expected shape \['batch', 4\], got \[5, 3\]"),
        ([good[0], torch.zeros(4, 2, 3, dtype=torch.int64)], "batch size 4 differs from 5"),
        ([torch.zeros(0, 4), torch.zeros(0, 2, 3, dtype=torch.int64)], "empty batch"),
        ([torch.zeros(9, 4), torch.zeros(9, 2, 3, dtype=torch.int64)], "max_batch_size 8"),
    ]
    for items, message in cases:
        with pytest.raises(ValueError, match=message):
            check_batch("inputs", items, specs, max_batch_size=8)
    # an encoded tensor is checked by what it claims, before it is decoded
    encoded = Float16Codec().encode(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="expected shape"):
        check_batch("inputs", [encoded], [TensorSpec(shape=[5], dtype="float32")], 8)


def test_tensor_spec_refuses_bad_dtypes_and_shapes() -> None:
    for shape, dtype in (([4], "complex64"), ([0], "float32"), ([1 << 20, 1 << 20], "float32")):
        with pytest.raises(ValueError):
            TensorSpec(shape=shape, dtype=dtype)


# --- announcements and beam search ---------------------------------------------------


def _announce(uid: str, peer: int, load: int = 0, throughput: float = 100.0) -> Announcement:
    return Announcement(ExpertLocation(uid, PEERS[peer], ("/ip4/1.2.3.4/tcp/5",)), load, throughput)


def _dht_view(announcements: list[Announcement]) -> dict[str, dict[bytes, ValueWithExpiration]]:
    """What ``dht.get`` of each prefix key would return after these announcements."""
    view: dict[str, dict[bytes, ValueWithExpiration]] = {}
    for (key, subkey), value in records(announcements).items():
        view.setdefault(key.removeprefix(dht_key("")), {})[subkey] = ValueWithExpiration(
            value, 1e12
        )
    return view


def test_announcement_records_round_trip_and_skip_forgeries() -> None:
    anns = [_announce("ffn.3.7", 0, load=5), _announce("ffn.3.8", 0), _announce("ffn.3.7", 1)]
    view = _dht_view(anns)
    assert set(view) == {"ffn", "ffn.3"}
    level = parse_level("ffn.3", view["ffn.3"])
    assert sorted(level) == [7, 8]
    assert {a.location.peer_id for a in level[7]} == {PEERS[0], PEERS[1]}
    assert by_uid({"ffn.3": level}, "ffn.3.7")[0].location.peer_id == PEERS[1]  # less loaded
    assert list(parse_level("ffn", view["ffn"])) == [3]
    forged = dict(view["ffn.3"])
    forged[b"9[owner:" + PEERS[2].to_base58().encode() + b"]"] = ValueWithExpiration(
        {"uid": "ffn.4.1", "addrs": [], "load": 0, "throughput": 1.0}, 1e12
    )  # a uid outside this prefix
    forged[b"x[owner:nobody]"] = ValueWithExpiration({"uid": "ffn.3.1"}, 1e12)
    assert sorted(parse_level("ffn.3", forged)) == [7, 8]


def _search(
    anns: list[Announcement],
    scores: list[list[list[float]]],
    k: int,
    exclude: Collection[tuple[str, PeerID]] = (),
    exclude_peers: Collection[PeerID] = (),
) -> list[list[str]]:
    view = _dht_view(anns)
    search = BeamSearch("ffn", [len(d) for d in scores[0]], scores, k, exclude, exclude_peers)
    rounds = 0
    while not search.done:
        wanted = search.wanted()
        search.advance({p: parse_level(p, view[p]) for p in wanted if p in view})
        rounds += 1
    assert rounds == len(scores[0])
    return [[a.location.uid for a in row] for row in search.result()]


def test_beam_search_finds_the_best_live_experts_per_sample() -> None:
    anns = [_announce(f"ffn.{i}.{j}", 0) for i in range(3) for j in range(3) if (i, j) != (2, 2)]
    scores = [
        [[0.0, 1.0, 5.0], [3.0, 0.0, 4.0]],  # best would be ffn.2.2, which is not live
        [[9.0, 0.0, 0.0], [0.0, 1.0, 0.5]],
    ]
    found = _search(anns, scores, k=2)
    assert found == [["ffn.2.0", "ffn.1.2"], ["ffn.0.1", "ffn.0.2"]]


def test_beam_search_skips_excluded_experts_and_out_of_grid_coordinates() -> None:
    anns = [_announce("ffn.0.0", 0), _announce("ffn.0.1", 0), _announce("ffn.0.7", 0)]
    scores = [[[1.0], [0.0, 2.0]]]  # a 1 x 2 grid: ffn.0.7 is outside it
    assert _search(anns, scores, k=3) == [["ffn.0.1", "ffn.0.0"]]
    assert _search(anns, scores, k=3, exclude={("ffn.0.1", PEERS[0])}) == [["ffn.0.0"]]


def test_beam_search_passes_over_unreachable_servers_at_every_level() -> None:
    # ffn.1.* lives only on server 1: once it is unreachable, a beam of 1 must not narrow
    # onto ffn.1 (and find nothing there) but go to ffn.0.
    anns = [_announce("ffn.0.0", 0), _announce("ffn.1.0", 1), _announce("ffn.1.1", 1)]
    scores = [[[0.0, 9.0], [1.0, 0.0]]]
    assert _search(anns, scores, k=1) == [["ffn.1.0"]]
    assert _search(anns, scores, k=1, exclude_peers={PEERS[1]}) == [["ffn.0.0"]]


def test_beam_search_matches_brute_force_on_random_grids() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(20):
        grid = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        cells: list[list[int]] = [[]]
        for size in grid:
            cells = [[*c, i] for c in cells for i in range(size)]
        live = [c for c in cells if rng.random() < 0.6]
        anns = [_announce("ffn." + ".".join(map(str, c)), 0) for c in live]
        scores = [[[rng.random() for _ in range(size)] for size in grid]]
        k = max(len(cells), 1)  # a beam as wide as the grid: beam search is exact
        expected = sorted(live, key=lambda c: -sum(scores[0][d][x] for d, x in enumerate(c)))
        assert _search(anns, scores, k) == [["ffn." + ".".join(map(str, c)) for c in expected]]


# --- dispatch ---------------------------------------------------------------------------


def test_plan_calls_groups_samples_by_expert() -> None:
    a, b = _announce("ffn.0.0", 0), _announce("ffn.0.1", 1)
    plan = plan_calls([[a, b], [b], [a]])
    assert plan == {a.location: [(0, 0), (2, 0)], b.location: [(0, 1), (1, 0)]}


def test_quorum_waits_for_stragglers_only_after_k_min() -> None:
    q = Quorum(
        {"a": [0, 1], "b": [0], "c": [1]}, 1, start=0.0, timeout=10.0, timeout_after_k_min=2.0
    )
    assert q.deadline == 10.0 and not q.finished(1.0)
    q.on_done("b", True, now=1.0)
    assert q.deadline == 10.0  # sample 1 has no answer yet
    q.on_done("c", True, now=3.0)
    assert q.deadline == 5.0 and not q.finished(4.0) and q.finished(5.0)
    assert q.short_samples() == []


def test_quorum_gives_up_when_a_sample_cannot_reach_k_min() -> None:
    q = Quorum({"a": [0], "b": [0, 1]}, 1, start=0.0, timeout=10.0, timeout_after_k_min=2.0)
    q.on_done("a", True, now=1.0)
    assert not q.finished(1.0)
    q.on_done("b", False, now=2.0)
    assert q.hopeless and q.finished(2.0) and q.short_samples() == [1]
    # a sample with fewer experts than k_min is hopeless from the start
    assert Quorum({"a": [0]}, 2, start=0.0, timeout=1.0, timeout_after_k_min=0.0).hopeless


# --- kept forwards ---------------------------------------------------------------------


def test_kept_store_is_per_caller_bounded_and_expires() -> None:
    store: KeptStore[str] = KeptStore(max_entries=2, ttl_seconds=10.0)
    a = store.put(PEERS[0], "a", now=0.0)
    b = store.put(PEERS[0], "b", now=1.0)
    assert store.take(PEERS[1], a, now=2.0) is None  # someone else's token
    c = store.put(PEERS[1], "c", now=2.0)  # evicts the oldest, "a"
    assert len(store) == 2 and store.take(PEERS[0], a, now=2.0) is None
    assert store.take(PEERS[0], b, now=2.0) == "b" and store.take(PEERS[0], b, now=2.0) is None
    assert store.take(PEERS[1], c, now=12.5) is None  # expired
    assert KeptStore[str](max_entries=0, ttl_seconds=1.0).put(PEERS[0], "x", now=0.0) == 0
