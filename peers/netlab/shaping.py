"""Bandwidth caps with a token bucket filter (``tc qdisc ... tbf``): the arguments to
shape one interface's egress. Pure: building the argv runs nothing.

A link is capped in both directions by shaping the egress of each of its two ends (the
node's uplink interface, and the bridge port facing it in the upstream namespace);
tbf only shapes what leaves an interface.
"""

from __future__ import annotations

import math

#: Seconds of traffic at the capped rate the bucket may hold. The kernel refills tokens
#: once per timer tick, and a bucket smaller than one tick's worth of bytes (10 ms at
#: HZ=100) caps the link below its rate; 10 ms is also short enough that a burst
#: barely shows in a transfer lasting a second.
BURST_SECONDS = 0.010
#: The smallest bucket, in bytes: it must hold at least one full packet (a 64 KiB GSO
#: segment is split by tbf, but a bucket under a few MTUs stalls slow links).
MIN_BURST_BYTES = 32 * 1024
#: How long a packet may wait in the queue before tbf drops it, in milliseconds. A
#: home uplink buffers tens of milliseconds (and often far more); 50 ms keeps TCP near
#: the cap without the seconds of bufferbloat that would make tests slow.
QUEUE_LATENCY_MS = 50
BITS_PER_BYTE = 8


def burst_bytes(rate_mbit: float) -> int:
    """The bucket size for a cap of ``rate_mbit`` megabits per second."""
    return max(MIN_BURST_BYTES, math.ceil(rate_mbit * 1e6 / BITS_PER_BYTE * BURST_SECONDS))


def tbf_args(interface: str, rate_mbit: float) -> list[str]:
    """The ``tc`` arguments (after ``tc`` and its options) that cap ``interface``'s
    egress at ``rate_mbit`` megabits per second, replacing any earlier cap. Raises
    ``ValueError`` for a rate that is not positive."""
    if not rate_mbit > 0:
        raise ValueError(f"rate_mbit must be positive, not {rate_mbit}")
    rate_kbit = max(1, round(rate_mbit * 1000))
    return [
        "qdisc",
        "replace",
        "dev",
        interface,
        "root",
        "tbf",
        "rate",
        f"{rate_kbit}kbit",
        "burst",
        str(burst_bytes(rate_mbit)),
        "latency",
        f"{QUEUE_LATENCY_MS}ms",
    ]
