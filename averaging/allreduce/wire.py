"""Wire messages of a networked butterfly round (``/swarmtrain/averaging/allreduce/4.0.0``).

A round runs over one stream per pair of members (:func:`link_opener` says which side
opens it), its first lane; on a long round trip the opener may add further lanes, each
a stream on another connection to the same member, which carry chunks only (chunk,
averaged and copy messages; every other message travels on the first lane). Each
lane's first frame is a :class:`Hello` naming the round, the digest of its spec and the
lane; the accepting end answers a further lane's Hello with the same Hello before it is
used. After that both sides send any of the other messages, each frame a msgpack array
``[tag, body]``:

- :class:`ChunkMessage` a sender's encoded chunk of a part the receiver reduces;
- :class:`AveragedMessage` a reducer's encoded, averaged chunk, with its contributors;
- :class:`NoticeMessage` signed accusations: members excluded, each accusation by its
  author (``averaging.allreduce.accusations``); every member relays each one it has not seen
  (the flood of butterfly rule 4), so a relayer cannot accuse in another's name;
- :class:`EchoMessage` a member's signed echo of an accuser's first accusation, relayed
  like accusations (a first accusation counts alone once a quorum echoed it);
- :class:`VoteMessage` a member's one vote (``averaging.allreduce.agreement``): the fingerprint
  and part digests of the result it holds, signed by the voter; every member relays
  each vote it has not seen to its other links, so votes cross cut links and reach
  client-mode members, and checks the signature first (a relayer cannot forge one);
- :class:`FetchMessage` asks a voter for one part of the result it voted for, which it
  answers with that part's exact float32 values as :class:`CopyMessage` chunks;
- :class:`HaveMessage` the sender now holds the decided result (it copied it), so its
  voters need not wait for its fetches any longer;
- :class:`SuspectMessage` members whose link to the sender failed or stalled while the
  sender is the end of that link that yields (it does not exclude them yet): a member
  that suspects one of them too excludes it at once, since two links failing at one
  member is that member's fault, not one link's.

Decoded once here, at the edge; the state machine validates the rest
(CONTRIBUTING.md, "Wire messages are typed and decoded at the edge").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from averaging.allreduce.accusations import Accusation, Echo
from averaging.allreduce.records import PartDigest, RoundSpec
from averaging.compression import EncodedTensor
from peers.errors import IdentityError, RemoteProtocolError
from peers.identity import PeerID
from peers.wire import WireError, from_wire, to_wire

ALLREDUCE_PROTOCOL = "/swarmtrain/averaging/allreduce/4.0.0"

#: Streams one link may run on (its first and further lanes, each on its own
#: connection): as many as a peer keeps connections to one other by default.
MAX_LANES = 4
#: The lane the member that did not open a link opens to the one that did, so that it
#: can send its chunks at once rather than after the link's first stream reaches it
#: (half a round trip later): after the opener's lanes, ``0 .. MAX_LANES - 1``.
REVERSE_LANE = MAX_LANES

#: Members one message may name: a group is at most this large (matchmaking's bound).
MAX_NAMED_MEMBERS = 1024


@dataclass(frozen=True)
class Hello:
    round_id: bytes
    spec_digest: bytes
    lane: int = 0
    """0 for a link's first stream; 1.. for a further stream on another connection to
    the same member (a lane, :data:`MAX_LANES` at most), which the accepting end
    confirms by sending the same Hello back before either end sends chunks on it.
    A peer that predates lanes ignores the field and refuses such a stream as a second
    link, and the opener then carries on with one. :data:`REVERSE_LANE`: the stream
    the other member opens to the link's opener (confirmed the same way; to a member
    that confirmed one lately, chunks follow the Hello before the answer)."""


@dataclass(frozen=True)
class ChunkMessage:
    part_index: int
    chunk_index: int
    weight: float
    tensor: EncodedTensor


@dataclass(frozen=True)
class AveragedMessage:
    part_index: int
    chunk_index: int
    contributors: list[bytes]
    tensor: EncodedTensor


@dataclass(frozen=True)
class AccusationWire:
    accused: bytes
    accuser: bytes
    seq: int
    signature: bytes


@dataclass(frozen=True)
class NoticeMessage:
    accusations: list[AccusationWire]


@dataclass(frozen=True)
class EchoMessage:
    accuser: bytes
    accused: bytes
    echoer: bytes
    signature: bytes


@dataclass(frozen=True)
class VoteMessage:
    voter: bytes
    fingerprint: bytes
    parts: list[PartDigest]
    signature: bytes


@dataclass(frozen=True)
class FetchMessage:
    fingerprint: bytes
    part_index: int


@dataclass(frozen=True)
class CopyMessage:
    fingerprint: bytes
    part_index: int
    chunk_index: int
    tensor: EncodedTensor


@dataclass(frozen=True)
class HaveMessage:
    fingerprint: bytes


@dataclass(frozen=True)
class SuspectMessage:
    suspected: list[bytes]


Message = (
    ChunkMessage
    | AveragedMessage
    | NoticeMessage
    | VoteMessage
    | FetchMessage
    | CopyMessage
    | HaveMessage
    | SuspectMessage
    | EchoMessage
)

_TAGS: dict[type[Any], int] = {
    ChunkMessage: 1,
    AveragedMessage: 2,
    NoticeMessage: 3,
    VoteMessage: 5,
    FetchMessage: 6,
    CopyMessage: 7,
    HaveMessage: 8,
    SuspectMessage: 9,
    EchoMessage: 10,
}
_TYPES: dict[int, type[Any]] = {tag: cls for cls, tag in _TAGS.items()}


def encode_message(message: Message) -> list[Any]:
    """The frame for ``message``."""
    return [_TAGS[type(message)], to_wire(message)]


def decode_message(frame: object) -> Message:
    """The message in a frame; raises :class:`WireError` for anything else."""
    if not isinstance(frame, list) or len(frame) != 2 or frame[0] not in _TYPES:
        raise WireError("an allreduce frame must be [tag, body] with a known tag")
    message: Message = from_wire(_TYPES[frame[0]], frame[1])
    return message


def decode_hello(frame: object) -> Hello:
    """The first frame of a link; raises :class:`WireError` if it is not a Hello, or
    names a lane outside ``0 .. REVERSE_LANE``."""
    if not isinstance(frame, list) or len(frame) != 2 or frame[0] != 0:
        raise WireError("a link must start with a Hello frame")
    hello = from_wire(Hello, frame[1])
    if not 0 <= hello.lane <= REVERSE_LANE:
        raise WireError(f"a Hello names lane {hello.lane}, outside 0..{REVERSE_LANE}")
    return hello


def encode_hello(spec: RoundSpec, lane: int = 0) -> list[Any]:
    """The first frame of a link's ``lane`` in ``spec``'s round: its id, and the
    digest of what every member's spec shares (a member given another spec is
    refused)."""
    return [0, to_wire(Hello(spec.round_id, spec.digest(), lane))]


def peer_ids(raw: list[bytes]) -> frozenset[PeerID]:
    """Member ids from the wire; raises :class:`RemoteProtocolError` for too many or
    malformed ones."""
    if len(raw) > MAX_NAMED_MEMBERS:
        raise RemoteProtocolError(f"a message names more than {MAX_NAMED_MEMBERS} members")
    try:
        return frozenset(PeerID(b) for b in raw)
    except IdentityError as e:
        raise RemoteProtocolError(f"malformed member id: {e}") from e


def accusations_of(message: NoticeMessage) -> list[Accusation]:
    """A notice's accusations; raises :class:`RemoteProtocolError` for too many or
    malformed ones (signatures are checked by the caller)."""
    if len(message.accusations) > MAX_NAMED_MEMBERS:
        raise RemoteProtocolError(f"a notice holds more than {MAX_NAMED_MEMBERS} accusations")
    try:
        return [
            Accusation(PeerID(a.accused), PeerID(a.accuser), a.seq, a.signature)
            for a in message.accusations
        ]
    except IdentityError as e:
        raise RemoteProtocolError(f"malformed member id: {e}") from e


def echo_from_wire(message: EchoMessage) -> Echo:
    """An echo's fields as member ids; :class:`RemoteProtocolError` if malformed."""
    try:
        return Echo(
            PeerID(message.accuser),
            PeerID(message.accused),
            PeerID(message.echoer),
            message.signature,
        )
    except IdentityError as e:
        raise RemoteProtocolError(f"malformed member id: {e}") from e


def echo_to_wire(echo: Echo) -> EchoMessage:
    return EchoMessage(
        echo.accuser.to_bytes(), echo.accused.to_bytes(), echo.echoer.to_bytes(), echo.signature
    )


def notice_of(accusations: list[Accusation]) -> NoticeMessage:
    return NoticeMessage(
        [
            AccusationWire(a.accused.to_bytes(), a.accuser.to_bytes(), a.seq, a.signature)
            for a in accusations
        ]
    )


def link_opener(a: PeerID, a_reachable: bool, b: PeerID, b_reachable: bool) -> PeerID | None:
    """Which of two members opens the stream between them: a member that cannot accept
    connections (client mode) dials one that can; between two that can, the smaller id
    dials, so exactly one stream links them. ``None`` when neither can be dialed: two
    client-mode members exchange nothing (neither reduces a part)."""
    if a_reachable and b_reachable:
        return min(a, b)
    if a_reachable:
        return b
    if b_reachable:
        return a
    return None
