"""What a peer's streams carried and how long its calls took, by protocol.

A :class:`TrafficBook` per peer: the payload bytes each protocol's streams received and
sent (after protocol negotiation; yamux and Noise framing not counted), and latency
histograms, per protocol, of the unary calls this peer made and of its streaming calls
(from the call to the end of the response stream), with their failures.
:class:`LatencyHistogram` is the histogram, for other latencies to reuse (a training
peer's averaging rounds, a pipeline client's stage calls).
``Peer.statistics().traffic`` is a snapshot; ``swarm.metrics`` exports it as Prometheus
counters and histograms.

Protocol names come from our own handlers (an inbound stream gets a protocol only if
we serve it) and our own calls, so the labels are few; past
:data:`MAX_PROTOCOLS` distinct names, the rest count under ``"other"``.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Upper bounds, in seconds, of the call-latency histogram's buckets (and +Inf).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: Distinct protocols counted by name; more count as ``"other"``.
MAX_PROTOCOLS = 256
OTHER = "other"


@dataclass(frozen=True, slots=True)
class ProtocolTraffic:
    """Payload bytes of one protocol's streams."""

    bytes_received: int = 0
    bytes_sent: int = 0


@dataclass(frozen=True, slots=True)
class CallLatency:
    """Unary calls of one protocol: a cumulative histogram of their durations."""

    bucket_counts: tuple[int, ...]
    """Calls that took at most ``LATENCY_BUCKETS[i]`` seconds (cumulative), then all."""
    count: int
    sum_seconds: float
    failures: int
    """Calls that raised (timeouts, remote errors, broken streams)."""


EMPTY_LATENCY = CallLatency((0,) * (len(LATENCY_BUCKETS) + 1), 0, 0.0, 0)


@dataclass(frozen=True, slots=True)
class TrafficSnapshot:
    protocols: Mapping[str, ProtocolTraffic] = field(default_factory=dict)
    calls: Mapping[str, CallLatency] = field(default_factory=dict)
    stream_calls: Mapping[str, CallLatency] = field(default_factory=dict)
    """Streaming calls: from the call to the end of its response stream. A call whose
    caller stopped reading early is not counted (nor is a cancelled one)."""


class LatencyHistogram:
    """Durations in :data:`LATENCY_BUCKETS`, their sum and the failures; one thread's."""

    __slots__ = ("count", "counts", "failures", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.count = 0
        self.total = 0.0
        self.failures = 0

    def record(self, seconds: float, *, failed: bool = False) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.count += 1
        self.total += seconds
        self.failures += failed

    def snapshot(self) -> CallLatency:
        cumulative, running = [], 0
        for count in self.counts:
            running += count
            cumulative.append(running)
        return CallLatency(tuple(cumulative), self.count, self.total, self.failures)


class TrafficBook:
    """Counts as streams and calls go; every method returns at once. One event loop's."""

    def __init__(self) -> None:
        self._traffic: dict[str, list[int]] = {}  # protocol -> [received, sent]
        self._calls: dict[str, LatencyHistogram] = {}
        self._stream_calls: dict[str, LatencyHistogram] = {}

    def _slot(self, protocol: str) -> list[int]:
        slot = self._traffic.get(protocol)
        if slot is None:
            if len(self._traffic) >= MAX_PROTOCOLS:
                return self._traffic.setdefault(OTHER, [0, 0])
            slot = self._traffic[protocol] = [0, 0]
        return slot

    def received(self, protocol: str, num_bytes: int) -> None:
        self._slot(protocol)[0] += num_bytes

    def sent(self, protocol: str, num_bytes: int) -> None:
        self._slot(protocol)[1] += num_bytes

    def call_ended(self, protocol: str, seconds: float, *, failed: bool) -> None:
        _histogram(self._calls, protocol).record(seconds, failed=failed)

    def stream_call_ended(self, protocol: str, seconds: float, *, failed: bool) -> None:
        _histogram(self._stream_calls, protocol).record(seconds, failed=failed)

    def snapshot(self) -> TrafficSnapshot:
        protocols = {p: ProtocolTraffic(r, s) for p, (r, s) in self._traffic.items()}
        calls = {p: h.snapshot() for p, h in self._calls.items()}
        streams = {p: h.snapshot() for p, h in self._stream_calls.items()}
        return TrafficSnapshot(protocols, calls, streams)  # fresh dicts: a snapshot is its own


def _histogram(table: dict[str, LatencyHistogram], protocol: str) -> LatencyHistogram:
    histogram = table.get(protocol)
    if histogram is None:
        if len(table) >= MAX_PROTOCOLS:
            protocol = OTHER
        histogram = table.setdefault(protocol, LatencyHistogram())
    return histogram
