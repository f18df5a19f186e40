"""A round's pace: timeouts that follow the members' measured rates
(docs/design/averaging.md, "Rounds on slow links"). Pure: rates and sizes in, configs out.

A round's default timeouts suit links of tens of megabytes per second. A member on a
slow link (or a large vector) needs longer, and the rates the group's members announced
(what each measured in its last round) say how much: :func:`paced` stretches the
timeouts to fit, every member computing the same from the same group record.
:func:`check_own_pace` is a peer's refusal to join rounds its own link cannot finish.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

import torch

from averaging.allreduce.config import AllReduceConfig, AllReduceError
from averaging.allreduce.records import RoundSpec

#: A round may take this many times what its members' rates predict before a timeout
#: cuts it: rates vary between rounds (shared links, TCP's ramp after idle), and a round
#: cut short wastes all it moved.
SLACK = 3.0
#: Rates this many times below the group's median count as that much when pacing.
MAX_SLOWDOWN = 10.0


#: The rate a member announces is the highest its link demonstrably carried in its last
#: round: over every prefix of the round's arrivals that brought at least this share of
#: their bytes (:func:`carried_rate`).
CARRIED_SHARE = 0.25
#: A round that brought fewer frames than this has too few to time (a quarter of them, a
#: few frames, can come in one read): its average rate stands.
MIN_FRAMES_TIMED = 16


def carried_rate(
    arrivals: Sequence[tuple[float, int]], start: float, share: float = CARRIED_SHARE
) -> float | None:
    """The highest rate, in bytes per second, at which ``arrivals`` (``(time, bytes)``
    per frame read, in time order) must have come since ``start`` (the round's): over
    every prefix that brought at least ``share`` of their bytes, those bytes over the
    time since ``start``. None when there are fewer than :data:`MIN_FRAMES_TIMED`
    frames or no prefix takes time.

    A round's average download rate is the same at every member (each waits for the
    slowest one), so it cannot tell a fast link from a slow one. A fast member gets most
    of its bytes early, at its own link's rate, and then waits for the slowest: the
    prefix that ends with its early bytes shows its link. The runner times the
    contributions to the parts a member reduces, not the averages it receives: those
    come at the pace of each part's slowest contributor, and a member with a small part,
    which receives mostly averages, would measure its link as slow and keep its small
    part.

    Why prefixes from the round's start, and not the busiest stretch anywhere in the
    round: reads come in bursts (a hole TCP fills after a loss releases what queued
    behind it; a process starved of CPU reads its backlog at once), and a short stretch
    that starts just before a burst times bytes that had been arriving for a while (3-5x
    a 20 Mbit/s link in the lab). Bytes read by a time had arrived by then, and none
    before the round began, so a prefix's rate is at most the link's, however the reads
    bunch: a member never claims more than its link carried. The price: a fast link
    reads low by the share of the prefix that the first chunk's latency takes."""
    if len(arrivals) < MIN_FRAMES_TIMED:
        return None
    target = share * sum(n for _, n in arrivals)
    best: float | None = None
    received = 0
    for at, n in arrivals:
        received += n
        if received >= target and received and at > start:
            rate = received / (at - start)
            best = rate if best is None else max(best, rate)
    return best


def wire_bytes_per_element(config: AllReduceConfig) -> float:
    """Payload bytes the round's codec sends per float32 element."""
    sample = torch.zeros(config.chunk_elements, dtype=torch.float32)
    return config.codec.compression_ratio(sample) * sample.element_size()


def transfer_seconds(spec: RoundSpec, rates: Sequence[float], bytes_per_element: float) -> float:
    """Seconds the slowest member needs to move its traffic at its rate (``rates[i]``,
    bytes per second; 0 for a member whose rate is unknown, which is left out): member
    ``i`` sends its vector less its own part, and its part's average to the others, and
    receives as much. 0.0 when no rate is known."""
    sizes = [0] * len(spec.members)
    for (start, end), owner in zip(spec.parts(), spec.owners, strict=True):
        sizes[owner] += end - start
    n = len(spec.members)
    slowest = 0.0
    for size, rate in zip(sizes, rates, strict=True):
        if rate > 0:
            elements = spec.total_elements - size + (n - 1) * size
            slowest = max(slowest, elements * bytes_per_element / rate)
    return slowest


def paced(
    config: AllReduceConfig, spec: RoundSpec, rates: Sequence[float] | None = None
) -> AllReduceConfig:
    """``config`` with its timeouts stretched to what the round needs at the members'
    rates (``rates``, bytes per second, by default ``spec.weights``: the rates the
    averager announces): a chunk crossing the slowest link may take ``SLACK`` times its
    share of that link before its sender or reducer counts as silent, and the butterfly
    ``SLACK`` times the whole transfer. Never shorter than ``config``'s own timeouts,
    never longer than its ``max_round_timeout``. A rate is its member's own claim: rates
    more than :data:`MAX_SLOWDOWN` times below the group's median count as that (a
    member that claims a trickle cannot make the others wait for it without end)."""
    given = tuple(spec.weights if rates is None else rates)
    if len(given) != len(spec.members):
        raise AllReduceError(f"{len(given)} rates for {len(spec.members)} members")
    positive = [r for r in given if r > 0]
    if not positive:
        return config
    # The lower median: one huge claim in a small group cannot lift the floor.
    floor = statistics.median_low(positive) / MAX_SLOWDOWN
    floored = [max(r, floor) if r > 0 else 0.0 for r in given]
    per_element = wire_bytes_per_element(config)
    # A chunk is at most a part long; a member sends one to each reducer at once, each
    # getting its share of the member's link.
    largest_part = max(end - start for start, end in spec.parts())
    chunk_elements = max(1, min(config.chunk_elements, largest_part))
    reducers = max(1, sum(1 for w in spec.weights if w > 0))
    chunk = SLACK * chunk_elements * per_element * reducers / max(min(positive), floor)
    sender = max(config.sender_timeout, chunk)
    reducer = sender + (config.reducer_timeout - config.sender_timeout)
    # The butterfly gives up ``reducer`` seconds before the round's end (what is left is
    # for votes and copies): the transfer must fit before that.
    needed = SLACK * transfer_seconds(spec, floored, per_element)
    round_timeout = min(config.max_round_timeout, max(config.round_timeout, reducer + needed))
    if round_timeout <= reducer:  # the cap binds: leave the butterfly half of it
        reducer = max(config.reducer_timeout, round_timeout / 2)
        sender = max(config.sender_timeout, reducer / 2)
    if (sender, reducer, round_timeout) == (
        config.sender_timeout,
        config.reducer_timeout,
        config.round_timeout,
    ):
        return config
    return replace(
        config, sender_timeout=sender, reducer_timeout=reducer, round_timeout=round_timeout
    )


def own_round_seconds(config: AllReduceConfig, total_elements: int, rate: float) -> float:
    """Seconds a round needs at least at our own measured ``rate`` (bytes per second),
    whatever part we get: our vector out and the average back, ``SLACK`` times."""
    return SLACK * total_elements * wire_bytes_per_element(config) / rate


def check_own_pace(config: AllReduceConfig, total_elements: int, rate: float) -> None:
    """Raise :class:`AllReduceError`, naming the remedies, when our own link at its
    measured ``rate`` cannot finish a round within ``config.max_round_timeout``."""
    needed = own_round_seconds(config, total_elements, rate)
    if needed > config.max_round_timeout:
        megabytes = total_elements * wire_bytes_per_element(config) / 1e6
        raise AllReduceError(
            f"a round would take this peer about {needed:.0f} s ({megabytes:.3g} MB of "
            f"{config.codec.name} values each way at the {rate / 1e6:.3g} MB/s it measured), "
            f"over max_round_timeout ({config.max_round_timeout:.0f} s): compress (a float16 "
            "or 8-bit codec), average fewer parameters, or raise max_round_timeout"
        )
