"""The vocabulary of matchmaking: its config, bounds, error, the :class:`Group` it
returns, and its wire messages (the DHT declaration and the join RPC).

Kept apart from the search (``averaging.matchmaking.search``, pure) and the networked
driver (``averaging.matchmaking.matchmaker``) so each stays small, and so the all-reduce can import
:class:`Group` without the machinery that forms it
(CONTRIBUTING.md, "Small modules, one folder per subsystem").
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass, field

from peers.dht.protocol import MAX_ADDR_CHARS, MAX_CONTACT_ADDRS
from peers.dht.records import MAX_KEY_BYTES
from peers.errors import IdentityError, PeersError
from peers.identity import PeerID
from peers.wire import WireError

JOIN_PROTOCOL = "/swarmtrain/averaging/join/1.0.0"
#: Bandwidths within this factor of a group's fastest count as the fastest when parts
#: are sized (:attr:`Group.weights`).
RATE_BAND = 1.5
#: Prefix of the DHT key a search declares under, so a caller's key never collides with
#: another subsystem's record of the same name.
DHT_KEY_PREFIX = "swarmtrain/matchmaking/"
#: Longest key a caller may search under: the DHT key bound minus our prefix.
MAX_GROUP_KEY_BYTES = MAX_KEY_BYTES - len(DHT_KEY_PREFIX)
#: Most members of one group. Butterfly all-reduce moves 2(n-1)/n of the vector per peer
#: whatever n is, but every member opens a stream to every other: a few hundred peers
#: is already past what one laptop's connection limits allow. The all-reduce's message
#: bound (MAX_NAMED_MEMBERS = 1024) is larger.
MAX_GROUP_SIZE = 256
#: Joins a leader holds at once. One DHT key holds at most 1024 declarations
#: (peers.dht.records.MAX_SUBKEYS_PER_KEY), so an honest swarm never needs more; each
#: held join costs at most one request frame (MAX_JOIN_REQUEST_BYTES).
MAX_PENDING_JOINS = 1024
#: Opaque per-member bytes a caller attaches (sample counts, a schema hash, a step):
#: a few numbers, not a payload. Bounds a group reply to MAX_GROUP_SIZE * ~6 KiB.
MAX_METADATA_BYTES = 4096
#: Largest join request frame: a key, MAX_CONTACT_ADDRS addresses, the metadata, and
#: msgpack overhead fit several times over; anything larger is refused at the frame.
MAX_JOIN_REQUEST_BYTES = 16 * 1024
#: Largest join reply frame: a group of MAX_GROUP_SIZE members with full metadata and
#: addresses is about 1.6 MiB; a refusal lists at most MAX_PENDING_JOINS + 1 PeerIDs.
MAX_JOIN_RESPONSE_BYTES = 4 * 1024 * 1024
#: Round ids are random tokens of this many bytes (2^-128 collision odds per pair).
ROUND_ID_BYTES = 32
#: Shortest and longest round id accepted from a leader (the all-reduce's bound is 64).
MIN_ROUND_ID_BYTES = 16
MAX_ROUND_ID_BYTES = 64
#: Largest bandwidth a peer may declare: a relative weight, so the scale is the swarm's
#: choice; this only keeps sums of weights finite.
MAX_BANDWIDTH = 1e15


class MatchmakingError(PeersError):
    """No group could be formed under a key by the deadline, or this peer was left out
    of the groups formed; the message says why (too few peers, a leader that vanished,
    a refusal)."""


@dataclass(frozen=True, kw_only=True)
class MatchmakingConfig:
    """How a :class:`~averaging.matchmaking.matchmaker.Matchmaker` forms groups. Peers searching
    under one key should use the same sizes (a member checks only its own minimum)."""

    target_group_size: int = 16
    """Largest group formed. More peers under one key are split into balanced groups of
    at most this size (10 peers, target 4: groups of 4, 3 and 3)."""
    min_group_size: int = 2
    """Smallest group formed; peers that cannot be placed in a group this large get
    :class:`MatchmakingError`."""
    search_timeout: float = 30.0
    """Seconds :meth:`Matchmaker.look_for_group` may take before it raises
    :class:`MatchmakingError` (overridable per call)."""
    gather_timeout: float = 5.0
    """Seconds after its start during which a leader keeps gathering: peers declaring in
    this window count as arriving "at the same time" and are grouped together. No group
    forms before it ends (hivemind's ``min_matchmaking_time`` plays the same role), so it
    is also a round's usual matchmaking latency. Capped at half a call's timeout."""
    request_timeout: float = 5.0
    """Seconds one DHT store or read may take (a join waits for its leader instead)."""
    poll_interval_seconds: float = 0.5
    """Seconds between reads of the DHT key while gathering or leading."""
    form_when_full: bool = False
    """Form a group as soon as ``target_group_size`` peers joined instead of waiting out
    the gather window: lower latency when the caller knows how many peers will come (a
    training swarm sizes its groups from its progress records). With more peers than
    the target, groups may then come out unbalanced (10 with target 4: 4, 4 and 2)."""

    def __post_init__(self) -> None:
        for name in ("target_group_size", "min_group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int")
        if not 1 <= self.min_group_size <= self.target_group_size <= MAX_GROUP_SIZE:
            raise ValueError(
                f"need 1 <= min_group_size <= target_group_size <= {MAX_GROUP_SIZE}, got "
                f"{self.min_group_size} and {self.target_group_size}"
            )
        for name in (
            "search_timeout",
            "gather_timeout",
            "request_timeout",
            "poll_interval_seconds",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        if self.gather_timeout >= self.search_timeout:
            raise ValueError("gather_timeout must be shorter than search_timeout")
        if self.poll_interval_seconds > self.gather_timeout:
            raise ValueError("poll_interval_seconds must not exceed gather_timeout")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A peer searching under the same key, as its declaration (or a redirect) says."""

    peer_id: PeerID
    addrs: tuple[str, ...]
    client_mode: bool

    @property
    def can_lead(self) -> bool:
        """Only a peer others can dial can collect joins."""
        return not self.client_mode and bool(self.addrs)


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What one member brings to its group (from its own join request)."""

    peer_id: PeerID
    addrs: tuple[str, ...]
    client_mode: bool
    bandwidth: float
    metadata: bytes

    def candidate(self) -> Candidate:
        return Candidate(self.peer_id, self.addrs, self.client_mode)


@dataclass(frozen=True)
class Group:
    """A group formed by matchmaking, identical on every member. Member ``i`` is
    ``members[i]``, reachable at ``addrs[i]`` (transport multiaddrs, empty for a
    client-mode member), with ``bandwidths[i]`` and the ``metadata[i]`` it passed."""

    key: str
    round_id: bytes
    members: tuple[PeerID, ...]
    addrs: tuple[tuple[str, ...], ...]
    client_mode: tuple[bool, ...]
    bandwidths: tuple[float, ...]
    metadata: tuple[bytes, ...]

    def __len__(self) -> int:
        return len(self.members)

    def index(self, peer_id: PeerID) -> int:
        """Position of ``peer_id`` in the group; ValueError if it is not a member."""
        return self.members.index(peer_id)

    @property
    def weights(self) -> tuple[float, ...]:
        """Bandwidth weights for a butterfly round (``RoundSpec.weights``): 0 for
        client-mode members, which reduce nothing; a bandwidth within
        :data:`RATE_BAND` of the fastest member's counts as the fastest (measurements of
        like links differ by their noise, and a part sized by noise only slows the
        round down); slower ones keep theirs, so a slow link gets a small part."""
        rates = [0.0 if c else b for c, b in zip(self.client_mode, self.bandwidths, strict=True)]
        fastest = max(rates, default=0.0)
        return tuple(fastest if r * RATE_BAND >= fastest else r for r in rates)

    @classmethod
    def of(cls, key: str, round_id: bytes, members: list[MemberInfo]) -> Group:
        return cls(
            key=key,
            round_id=round_id,
            members=tuple(m.peer_id for m in members),
            addrs=tuple(m.addrs for m in members),
            client_mode=tuple(m.client_mode for m in members),
            bandwidths=tuple(m.bandwidth for m in members),
            metadata=tuple(m.metadata for m in members),
        )

    def member_infos(self) -> list[MemberInfo]:
        return [
            MemberInfo(*fields)
            for fields in zip(
                self.members,
                self.addrs,
                self.client_mode,
                self.bandwidths,
                self.metadata,
                strict=True,
            )
        ]


def rank(key: str, peer_id: PeerID) -> bytes:
    """A peer's place in the leader order of one key: the smallest rank leads. Hashed
    with the key so that leadership moves from key to key (a fixed smallest PeerID
    would lead every round, and a ground PeerID could take every group)."""
    return hashlib.sha256(
        b"swarmtrain-matchmaking\0" + key.encode() + b"\0" + peer_id.to_bytes()
    ).digest()


# --- wire messages ------------------------------------------------------------------


class JoinStatus(enum.Enum):
    PLACED = "placed"
    """Here is your group."""
    REDIRECT = "redirect"
    """A better-ranked leader exists: join it instead."""
    REFUSED = "refused"
    """Not collecting joins under this key (finished, full, cannot lead): try another."""
    NOT_SEARCHING = "not searching"
    """No search under this key here, not yet or not at all: try another, or this one
    again if it is expected to search (a peer older than this status reads it as a
    malformed answer and tries another)."""
    REJECTED = "rejected"
    """The groups were formed without you (too few peers, left over): give up."""


@dataclass(frozen=True)
class Declaration:
    """The DHT value a searching peer stores under the key (subkey: its owner marker)."""

    addrs: list[str]
    client_mode: bool


@dataclass(frozen=True)
class JoinRequest:
    key: str
    addrs: list[str]
    client_mode: bool
    bandwidth: float
    metadata: bytes
    expected_size: int = 0
    """The group size the joiner expects (its ``target_group_size``); with
    ``form_when_full`` a leader waits for the largest expectation among its joiners."""


@dataclass(frozen=True)
class WireMember:
    peer_id: bytes
    addrs: list[str]
    client_mode: bool
    bandwidth: float = 0.0
    metadata: bytes = b""


@dataclass(frozen=True)
class JoinResponse:
    status: str
    reason: str = ""
    round_id: bytes = b""
    members: list[WireMember] = field(default_factory=list)
    """PLACED: the group in order. REDIRECT: the one peer to join instead."""
    finished: list[bytes] = field(default_factory=list)
    """REFUSED: peers already placed in a group under this key (no use joining them)."""


def check_addrs(addrs: list[str]) -> tuple[str, ...]:
    if len(addrs) > MAX_CONTACT_ADDRS:
        raise WireError(f"{len(addrs)} addresses, at most {MAX_CONTACT_ADDRS}")
    for addr in addrs:
        if len(addr) > MAX_ADDR_CHARS:
            raise WireError(f"an address of {len(addr)} characters, at most {MAX_ADDR_CHARS}")
    return tuple(addrs)


def check_member_fields(
    addrs: list[str], client_mode: bool, bandwidth: float, metadata: bytes
) -> tuple[str, ...]:
    """Validate what a member says of itself; raises :class:`WireError` (its fault)."""
    checked = check_addrs(addrs)
    if not client_mode and not checked:
        raise WireError("a peer that is not in client mode must give its addresses")
    if not math.isfinite(bandwidth) or not 0 <= bandwidth <= MAX_BANDWIDTH:
        raise WireError(f"bandwidth {bandwidth} is not in [0, {MAX_BANDWIDTH}]")
    if len(metadata) > MAX_METADATA_BYTES:
        raise WireError(f"metadata has {len(metadata)} bytes, at most {MAX_METADATA_BYTES}")
    return checked


def peer_id_from_wire(raw: bytes) -> PeerID:
    try:
        return PeerID(raw)
    except IdentityError as e:
        raise WireError(f"malformed PeerID: {e}") from e


def member_to_wire(member: MemberInfo) -> WireMember:
    return WireMember(
        member.peer_id.to_bytes(),
        list(member.addrs),
        member.client_mode,
        member.bandwidth,
        member.metadata,
    )


def member_from_wire(wire: WireMember) -> MemberInfo:
    addrs = check_member_fields(wire.addrs, wire.client_mode, wire.bandwidth, wire.metadata)
    return MemberInfo(
        peer_id_from_wire(wire.peer_id), addrs, wire.client_mode, wire.bandwidth, wire.metadata
    )


def group_to_wire(group: Group) -> JoinResponse:
    return JoinResponse(
        JoinStatus.PLACED.value,
        round_id=group.round_id,
        members=[member_to_wire(m) for m in group.member_infos()],
    )


def group_from_wire(key: str, response: JoinResponse) -> Group:
    """The group a leader sent, validated; raises :class:`WireError` (the leader's fault)."""
    if not MIN_ROUND_ID_BYTES <= len(response.round_id) <= MAX_ROUND_ID_BYTES:
        raise WireError(
            f": round id of {len(response.round_id)} bytes, not in "
            f"[{MIN_ROUND_ID_BYTES}, {MAX_ROUND_ID_BYTES}]"
        )
    if not 1 <= len(response.members) <= MAX_GROUP_SIZE:
        raise WireError(f"a group of {len(response.members)} members, at most {MAX_GROUP_SIZE}")
    members = [member_from_wire(m) for m in response.members]
    if len({m.peer_id for m in members}) != len(members):
        raise WireError("a group names a member twice")
    return Group.of(key, response.round_id, members)


def candidate_from_wire(wire: WireMember) -> Candidate:
    addrs = check_addrs(wire.addrs)
    return Candidate(peer_id_from_wire(wire.peer_id), addrs, wire.client_mode)
