"""Configuration and outcome records of a networked butterfly round."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from averaging.allreduce.records import RoundResult
from averaging.compression import Codec, NoneCodec
from peers.errors import LocalProtocolError

#: Seconds a finished round waits for its writers to flush what they hold (a vote, a
#: copy, a late averaged chunk), and then again for its links to close: a round returns
#: within ``round_timeout + 2 * FLUSH_SECONDS`` (:attr:`AllReduceConfig.return_bound`).
FLUSH_SECONDS = 2.0
#: The most ``AllReduceConfig.connections_per_member`` may ask (a link runs on at most
#: ``wire.MAX_LANES`` connections whatever it asks).
MAX_CONNECTIONS_PER_MEMBER = 64


class AllReduceError(LocalProtocolError):
    """A round could not be run as asked (our caller's fault): a config whose timeouts
    do not fit together, a round id already running here, a tensor that does not match
    the round. A remote's failure never raises: it excludes that remote."""


@dataclass(frozen=True, kw_only=True)
class AllReduceConfig:
    """Timeouts and wire format of a round. Every member should use the same values; the
    chunk size must match (it is part of the averaging key in :class:`Averager`)."""

    sender_timeout: float = 10.0
    """Seconds a reducer waits without hearing from a sender whose chunks it still lacks
    before excluding it (restarted when a failed peer's part moves to this reducer)."""
    reducer_timeout: float = 20.0
    """Seconds a member waits without hearing from a reducer whose averaged part it still
    lacks before excluding it. Longer than ``sender_timeout``: a reducer is legitimately
    silent while it waits for the slowest sender; the config checks the order
    (CONTRIBUTING.md, "Timeouts are scopes, in seconds")."""
    round_timeout: float = 60.0
    """Bound on a round, from its start to the closing of its links (then at most
    ``2 * FLUSH_SECONDS`` more: :attr:`return_bound`). The butterfly gives up
    ``reducer_timeout`` before it (what is missing then is left at this peer's own
    value, the report says how much); the rest is for votes and copies."""
    max_round_timeout: float = 1800.0
    """Longest ``round_timeout`` the averager may stretch to when the members' measured
    rates say a round needs longer (:func:`averaging.allreduce.pace.paced`); a peer
    whose own link cannot finish a round within it refuses to average, saying why."""
    join_timeout: float = 5.0
    """Seconds a link from another member waits for its round to start here (members
    leave matchmaking a little apart)."""
    chunk_elements: int = 1 << 18
    """float32 elements per chunk (1 MiB): small enough that reduction overlaps the
    transfer of the next chunk, large enough that per-chunk costs (a message, a
    state-machine step) stay small, and one chunk fits one 2 MiB Noise frame between our
    peers (a view all the way to the reduction, never joined). Smaller chunks cost more
    CPU per round, larger ones saved none (docs/benchmarks.md, "Figures behind
    constants"). In a process running several peers, set ``torch.set_num_threads(1)``:
    chunks this size are split over torch's thread pool, which oversubscribes shared
    cores."""
    codec: Codec = field(default_factory=NoneCodec)
    """How chunks and averaged parts are encoded on the wire. Must be round-safe
    (``Codec.round_safe``: stateless, no coordinate dropped; top-k and PowerSGD are
    refused). Lossy codecs are fine: every member holds what the others decoded, so
    results stay identical."""
    connections_per_member: int = 2
    """TCP connections a member's links of a round run on together, at least, when their
    round trip is at least ``pooled_round_trip`` (1: one per link, always). On a long
    fat pipe one connection carries what its window allows per round trip, less than
    the link can; a member's links share its access link, so with ``k`` links each runs
    on ``ceil(connections_per_member / k)`` connections (in a pair, 2 each by default;
    in a larger group one each, already as many). The opener of a link adds further
    lanes on further connections (``Peer.new_pooled_stream``), and chunks go out on
    whichever lane is free first. A member that cannot be dialed again (behind a NAT,
    through a relay) keeps one. At most ``wire.MAX_LANES`` per link, and
    :data:`MAX_CONNECTIONS_PER_MEMBER`."""
    pooled_round_trip: float = 0.05
    """Seconds of round trip (TCP's own measure of the link's first connection) from
    which ``connections_per_member`` applies. Below it one window covers what a link of
    half a gigabit or less carries, and a further connection only costs its handshake
    (docs/design/averaging.md, "Long fat pipes")."""
    reverse_lane: bool = True
    """On such a round trip, the member that does not open a link opens a lane back to
    the one that does (``wire.REVERSE_LANE``, on the connection they share), so that it
    sends its chunks at once instead of half a round trip later, when the opener's
    stream reaches it: at once to a member that took one lately, otherwise from the
    second round with it on (docs/design/averaging.md, "The reverse lane"). False: it
    waits for the opener's stream."""

    def __post_init__(self) -> None:
        for name in (
            "sender_timeout",
            "reducer_timeout",
            "round_timeout",
            "max_round_timeout",
            "join_timeout",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise AllReduceError(f"{name} must be a positive number of seconds")
        if self.reducer_timeout <= self.sender_timeout:
            raise AllReduceError("reducer_timeout must be longer than sender_timeout")
        if self.round_timeout <= self.reducer_timeout:
            raise AllReduceError("round_timeout must be longer than reducer_timeout")
        if self.max_round_timeout < self.round_timeout:
            raise AllReduceError("max_round_timeout must be at least round_timeout")
        if (
            isinstance(self.connections_per_member, bool)
            or not isinstance(self.connections_per_member, int)
            or not 1 <= self.connections_per_member <= MAX_CONNECTIONS_PER_MEMBER
        ):
            raise AllReduceError(
                f"connections_per_member must be an int in 1..{MAX_CONNECTIONS_PER_MEMBER}"
            )
        if (
            not isinstance(self.pooled_round_trip, int | float)
            or not math.isfinite(self.pooled_round_trip)
            or self.pooled_round_trip < 0
        ):
            raise AllReduceError("pooled_round_trip must be a non-negative number of seconds")
        if not isinstance(self.reverse_lane, bool):
            raise AllReduceError("reverse_lane must be True or False")
        if not isinstance(self.chunk_elements, int) or self.chunk_elements <= 0:
            raise AllReduceError("chunk_elements must be a positive int")
        if not isinstance(self.codec, Codec):
            raise AllReduceError("codec must be an averaging.compression.Codec")
        if not self.codec.round_safe:
            raise AllReduceError(
                f"the {self.codec.name!r} codec cannot carry a round (it sends each value "
                "once, with no error feedback to catch up what the codec drops): use "
                "NoneCodec, Float16Codec, BFloat16Codec, Uniform8BitCodec or "
                "Blockwise8BitCodec"
            )

    @property
    def return_bound(self) -> float:
        """Seconds within which ``run_round`` returns, whatever the other members and
        the network do."""
        return self.round_timeout + 2 * FLUSH_SECONDS


@dataclass(frozen=True, slots=True)
class TransferStatistics:
    """What one round moved, as seen by one peer."""

    bytes_sent: int
    """Payload bytes of every frame this peer wrote (chunks, averaged parts, notices)."""
    bytes_received: int
    """Payload bytes of every frame this peer read."""
    seconds: float
    """From the round's start to its return."""
    agreed: bool
    """This peer holds the result a strict majority of the members voted for (its own or
    one it copied): every peer reporting agreement holds the same tensor, bit for bit.
    False when no result won a majority by ``round_timeout``, or this peer could not
    copy the one that did."""
    carried_bytes_per_second: float | None = None
    """The highest download rate this peer's link demonstrably carried the contributions
    to the parts it reduces at (:func:`~averaging.allreduce.pace.carried_rate`); None when
    too few came (a small part, or none)."""


@dataclass(frozen=True, slots=True)
class AllReduceResult:
    """The round's result and report (:class:`RoundResult`) plus transfer figures."""

    result: RoundResult
    transfer: TransferStatistics

    @property
    def received_bytes_per_second(self) -> float:
        """This peer's download rate over the whole round."""
        return self.transfer.bytes_received / max(self.transfer.seconds, 1e-9)

    @property
    def link_bytes_per_second(self) -> float:
        """What this round says of this peer's link: the rate it demonstrably carried,
        or the whole round's where too few frames came. The bandwidth it announces for
        the next round's partition."""
        carried = self.transfer.carried_bytes_per_second
        return self.received_bytes_per_second if carried is None else carried
