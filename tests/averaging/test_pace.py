"""A round's pace (averaging/allreduce/pace.py): the timeouts that follow the group's
announced rates, and a peer's refusal of rounds its own link cannot finish."""

from __future__ import annotations

import random

import pytest

from averaging.allreduce.config import AllReduceConfig, AllReduceError
from averaging.allreduce.pace import (
    MAX_SLOWDOWN,
    MIN_FRAMES_TIMED,
    SLACK,
    carried_rate,
    check_own_pace,
    paced,
    transfer_seconds,
)
from averaging.allreduce.records import RoundSpec
from averaging.compression import Float16Codec
from peers.identity import KeyPair

IDS = tuple(KeyPair.from_seed(bytes([i + 1]) * 32).peer_id for i in range(4))
MB = 1e6
ELEMENTS = 16 << 20  # 64 MiB of float32


def spec(rates: tuple[float, ...], elements: int = ELEMENTS) -> RoundSpec:
    return RoundSpec(
        round_id=b"\x01" * 16,
        members=IDS[: len(rates)],
        weights=rates,
        total_elements=elements,
        chunk_elements=1 << 18,
        me=IDS[0],
    )


def test_transfer_time_is_the_slowest_members_traffic_at_its_rate() -> None:
    # Equal parts of 4: a member moves its vector less its part, plus its part to 3
    # others: 1.5 vectors each way.
    equal = spec((10 * MB,) * 4)
    assert transfer_seconds(equal, equal.weights, 4.0) == pytest.approx(1.5 * ELEMENTS * 4 / 10e6)
    # A member at a fifth of the others' rate gets a fifth of their part, and is slowest.
    slow = spec((10 * MB, 10 * MB, 10 * MB, 2 * MB))
    part = ELEMENTS / 16  # weights 5:5:5:1
    expected = (ELEMENTS - part + 3 * part) * 4 / (2 * MB)
    assert transfer_seconds(slow, slow.weights, 4.0) == pytest.approx(expected, rel=1e-4)


def test_fast_links_keep_the_configured_timeouts() -> None:
    config = AllReduceConfig()
    assert paced(config, spec((100 * MB,) * 4)) is config


def test_a_slow_link_stretches_the_round_to_what_it_needs() -> None:
    config = AllReduceConfig()
    slow = spec((12.5 * MB, 12.5 * MB, 12.5 * MB, 2.5 * MB))
    stretched = paced(config, slow)
    needed = transfer_seconds(slow, slow.weights, 4.0)  # 30 s
    # The butterfly gets round_timeout - reducer_timeout: 40 s by default, too tight.
    assert config.round_timeout - config.reducer_timeout < SLACK * needed
    assert stretched.round_timeout - stretched.reducer_timeout == pytest.approx(SLACK * needed)
    assert stretched.sender_timeout < stretched.reducer_timeout < stretched.round_timeout
    # The codec's bytes count: float16 needs about half as long.
    halved = paced(AllReduceConfig(codec=Float16Codec()), slow)
    assert halved.round_timeout < 0.6 * stretched.round_timeout


def test_a_trickle_claim_stretches_no_further_than_the_floor_and_the_cap() -> None:
    config = AllReduceConfig()
    floor = 10 * MB / MAX_SLOWDOWN
    trickle = paced(config, spec((10 * MB, 10 * MB, 10 * MB, 1.0)))  # 1 byte/s, claimed
    at_floor = paced(config, spec((10 * MB, 10 * MB, 10 * MB, floor)))
    assert trickle.sender_timeout == at_floor.sender_timeout
    # (The trickle gets no part, so it moves less than a member at the floor would.)
    assert config.round_timeout < trickle.round_timeout <= at_floor.round_timeout
    capped = paced(AllReduceConfig(max_round_timeout=100.0), spec((10 * MB,) * 3 + (floor,)))
    assert capped.round_timeout == 100.0
    assert capped.sender_timeout < capped.reducer_timeout < capped.round_timeout


def test_a_peer_whose_own_link_cannot_finish_a_round_refuses_naming_the_fixes() -> None:
    config = AllReduceConfig(max_round_timeout=600.0)
    check_own_pace(config, ELEMENTS, 12.5 * MB)  # 3 x 5.4 s: fine
    with pytest.raises(AllReduceError, match="float16 or 8-bit codec") as refused:
        check_own_pace(config, ELEMENTS, 0.1 * MB)  # 3 x 671 s
    assert "max_round_timeout (600 s)" in str(refused.value)
    assert "0.1 MB/s" in str(refused.value)


def test_max_round_timeout_below_round_timeout_is_refused() -> None:
    with pytest.raises(AllReduceError, match="max_round_timeout"):
        AllReduceConfig(round_timeout=60.0, max_round_timeout=30.0)


def test_a_client_mode_members_rate_paces_the_round_and_one_huge_claim_cannot_unpace_it() -> None:
    config = AllReduceConfig()
    round_spec = spec((12.5 * MB, 12.5 * MB, 12.5 * MB, 0.0))  # the last is client-mode
    # Its link (2.5 MB/s, behind NAT) still carries its vector and the average.
    slow_client = paced(config, round_spec, (12.5 * MB, 12.5 * MB, 12.5 * MB, 2.5 * MB))
    assert slow_client.round_timeout > paced(config, round_spec).round_timeout
    # A claim of 1e15 in a group of two does not lift the floor over the real rate.
    pair = spec((1e15, 1 * MB))
    assert paced(config, pair).round_timeout > config.round_timeout


def test_the_carried_rate_tells_a_fast_link_from_the_round_it_waited_through() -> None:
    """A member on a fast link gets its bytes in bursts at its link's rate, then waits
    for the slowest member: its round average is the slowest's pace, the prefix that
    ends with its burst its own link's."""
    burst = [(0.01 * i, 100_000) for i in range(1, 41)]  # 4 MB at 10 MB/s, by 0.4 s
    trickle = [(0.4 + 0.1 * i, 100_000) for i in range(1, 41)]  # then 4 MB at 1 MB/s
    arrivals = [(0.0, 100), *burst, *trickle]
    rate = carried_rate(arrivals, start=0.0)
    assert rate is not None and rate == pytest.approx(10 * MB, rel=1e-4)
    average = sum(n for _, n in arrivals) / arrivals[-1][0]
    assert average < 2 * MB
    steady = [(0.1 * i, 100_000) for i in range(1, 41)]  # 1 MB/s throughout
    assert carried_rate(steady, start=0.0) == pytest.approx(1 * MB, rel=1e-9)


def test_bursts_of_reads_never_read_above_the_link() -> None:
    """Bytes arrive at 1 MB/s, but are read in bursts: held back for up to two seconds
    (a hole TCP fills after a loss, a process starved of CPU), then read within a
    millisecond. The busiest stretch anywhere in the round times such bursts above the
    link; the carried rate stays at or below it, and near it. Twenty draws."""
    over = 0
    for seed in range(20):
        rng = random.Random(seed)
        arrivals: list[tuple[float, int]] = []
        held = 0.0  # bytes that came before this are read at this time
        for i in range(1, 81):  # 100 kB every 0.1 s: 1 MB/s
            came = 0.1 * i
            if came >= held:
                held = came + (rng.uniform(0.5, 2.0) if rng.random() < 0.2 else 0.0)
            arrivals.append((max(came, held) + 1e-4 * i, 100_000))
        over += busiest_stretch(arrivals) > 1.5 * MB
        rate = carried_rate(arrivals, start=0.0)
        assert rate is not None and 0.6 * MB < rate <= 1.0 * MB, seed
    assert over >= 10  # the hazard is real


def busiest_stretch(arrivals: list[tuple[float, int]]) -> float:
    """The rate of the shortest stretch that brought a quarter of the bytes."""
    total = sum(n for _, n in arrivals[1:])
    best = 0.0
    for i in range(len(arrivals)):
        got = 0
        for j in range(i + 1, len(arrivals)):
            got += arrivals[j][1]
            if got >= total / 4 and arrivals[j][0] > arrivals[i][0]:
                best = max(best, got / (arrivals[j][0] - arrivals[i][0]))
                break
    return best


def test_too_few_frames_or_no_time_give_no_rate() -> None:
    assert carried_rate([(0.1 * i, 1000) for i in range(MIN_FRAMES_TIMED - 1)], 0.0) is None
    assert carried_rate([(1.0, 1000)] * (2 * MIN_FRAMES_TIMED), start=1.0) is None
    assert carried_rate([], start=0.0) is None
