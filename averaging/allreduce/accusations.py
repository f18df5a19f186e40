"""Signed accusations: who may exclude whom from a round (pure; no I/O, no clock).

A member that excludes another on its own observation (a broken or stalled link, a bad
chunk, a forged vote) accuses it: it signs ``(round, accused, seq)``, where ``seq``
counts its own accusations in the round from 0, and sends the accusation to its links;
every member relays each accusation it has not seen, after checking its signature. So
an accusation names its true author, whoever carries it.

Before, an exclusion notice was its sender's word, and one member could evict every
other member of a round by naming them all. Now :class:`AccusationBook` decides which
accusations count:

- an accusation counts once **two** members accuse the same peer: a dead peer is
  accused by every member linked to it, and one member alone cannot make two;
- a member's **first** accusation (``seq`` 0) may count alone, since a cut link or a
  stalled peer is seen by one end only, and must cost the round at once (P3: a cut link
  costs at most one of its two ends). But the accuser could send a different "first"
  accusation to each member (an equivocation), and each member would then exclude
  another peer. So a first accusation counts alone only once a quorum of members
  echoed it: each member signs an :class:`Echo` of the first ``seq``-0 accusation it
  sees from each accuser, and never of a second one. The quorum is more than
  ``(n + 1) / 2`` of the ``n`` members, so two different first accusations of one
  accuser can never both reach it, even if the accuser echoes both: either every
  member that counts a solo accusation counts the same one, or none counts one.
- two different ``seq``-0 accusations signed by one accuser prove that it equivocated:
  its accusations stop counting, and the member that sees the proof excludes it.

A member that names many peers alone thus evicts at most one, and the same one for
every member.
"""

from __future__ import annotations

from dataclasses import dataclass

from peers.identity import KeyPair, PeerID

#: Domain of an accusation's signature: it cannot be replayed as a vote or anything else.
ACCUSATION_SIGNATURE_DOMAIN = b"swarmtrain/averaging/accusation\0"
#: Domain of an echo's signature.
ECHO_SIGNATURE_DOMAIN = b"swarmtrain/averaging/echo\0"
#: Accusations one member may sign in a round: no more than the members it could accuse.
MAX_SEQ = 1024


@dataclass(frozen=True, slots=True)
class Accusation:
    """``accuser`` excludes ``accused`` from the round, its ``seq``-th accusation there."""

    accused: PeerID
    accuser: PeerID
    seq: int
    signature: bytes


def accusation_payload(round_id: bytes, accused: PeerID, seq: int) -> bytes:
    return ACCUSATION_SIGNATURE_DOMAIN + round_id + seq.to_bytes(4, "big") + accused.to_bytes()


def sign_accusation(identity: KeyPair, round_id: bytes, accused: PeerID, seq: int) -> Accusation:
    """``identity``'s accusation of ``accused`` in round ``round_id``."""
    signature = identity.sign(accusation_payload(round_id, accused, seq))
    return Accusation(accused, identity.peer_id, seq, signature)


def accusation_signed(accusation: Accusation, round_id: bytes) -> bool:
    """True if the accusation carries its accuser's signature for round ``round_id``."""
    if not 0 <= accusation.seq < MAX_SEQ:
        return False
    key = accusation.accuser.inline_public_key()
    payload = accusation_payload(round_id, accusation.accused, accusation.seq)
    return key is not None and key.verify(accusation.signature, payload)


@dataclass(frozen=True, slots=True)
class Echo:
    """``echoer`` saw ``accuser``'s first accusation (``seq`` 0) name ``accused``."""

    accuser: PeerID
    accused: PeerID
    echoer: PeerID
    signature: bytes


def echo_payload(round_id: bytes, accuser: PeerID, accused: PeerID) -> bytes:
    return ECHO_SIGNATURE_DOMAIN + round_id + accuser.to_bytes() + b"\0" + accused.to_bytes()


def sign_echo(identity: KeyPair, round_id: bytes, accuser: PeerID, accused: PeerID) -> Echo:
    signature = identity.sign(echo_payload(round_id, accuser, accused))
    return Echo(accuser, accused, identity.peer_id, signature)


def echo_signed(echo: Echo, round_id: bytes) -> bool:
    """True if the echo carries its echoer's signature for round ``round_id``."""
    key = echo.echoer.inline_public_key()
    payload = echo_payload(round_id, echo.accuser, echo.accused)
    return key is not None and key.verify(echo.signature, payload)


def echo_quorum(num_members: int) -> int:
    """Echoes a first accusation needs to count alone: more than ``(n + 1) / 2``."""
    return (num_members + 1) // 2 + 1


@dataclass(frozen=True, slots=True)
class Added:
    """What one accusation changed in a book."""

    new: bool
    """Not seen before: relay it."""
    counted: PeerID | None = None
    """The accused now counts as excluded (it did not before)."""
    equivocator: PeerID | None = None
    """The accuser signed two accusations with this one's ``seq``: it equivocated."""
    echo: bool = False
    """The first ``seq``-0 accusation seen from its accuser: echo it (once)."""


class AccusationBook:
    """The accusations one member has seen in one round, and which of them count."""

    def __init__(self, members: tuple[PeerID, ...]) -> None:
        self._members = frozenset(members)
        self._by_accuser: dict[PeerID, dict[int, Accusation]] = {}
        self._accusers_of: dict[PeerID, set[PeerID]] = {}
        self._counted: set[PeerID] = set()
        self._equivocators: set[PeerID] = set()
        # (accuser, accused) -> who echoed that accuser's first accusation naming it,
        # and each echoer's one echo per accuser (its first).
        self._echoes: dict[tuple[PeerID, PeerID], set[PeerID]] = {}
        self._echoed: dict[tuple[PeerID, PeerID], Echo] = {}  # (accuser, echoer) -> echo
        self._quorum = echo_quorum(len(self._members))

    @property
    def counted(self) -> frozenset[PeerID]:
        return frozenset(self._counted)

    def next_seq(self, accuser: PeerID) -> int:
        """The ``seq`` of ``accuser``'s next accusation."""
        return len(self._by_accuser.get(accuser, {}))

    def against(self, accused: PeerID) -> list[Accusation]:
        """Every accusation of ``accused`` seen (to relay)."""
        return [
            a for byseq in self._by_accuser.values() for a in byseq.values() if a.accused == accused
        ]

    def add(self, accusation: Accusation) -> Added:
        """Take a signed accusation (check it with :func:`accusation_signed` first).
        Raises ValueError for one naming a non-member or accusing its own author."""
        accuser, accused = accusation.accuser, accusation.accused
        if accuser not in self._members or accused not in self._members:
            raise ValueError("an accusation names a non-member")
        if accuser == accused:
            raise ValueError("a member accuses itself")
        byseq = self._by_accuser.setdefault(accuser, {})
        held = byseq.get(accusation.seq)
        if held is not None:
            if held.accused == accused:
                return Added(new=False)
            if accuser in self._equivocators:
                return Added(new=False)
            self._equivocators.add(accuser)
            return Added(new=True, equivocator=accuser)
        byseq[accusation.seq] = accusation
        accusers = self._accusers_of.setdefault(accused, set())
        accusers.add(accuser)
        echo = accusation.seq == 0
        if accused in self._counted or accuser in self._equivocators:
            return Added(new=True, echo=echo)
        if len(accusers - self._equivocators) >= 2:
            self._counted.add(accused)
            return Added(new=True, counted=accused, echo=echo)
        return Added(new=True, echo=echo)

    def add_echo(self, echo: Echo) -> Added:
        """Take a signed echo (check it with :func:`echo_signed` first). Raises
        ValueError for one naming a non-member."""
        if not {echo.accuser, echo.accused, echo.echoer} <= self._members:
            raise ValueError("an echo names a non-member")
        if echo.accuser == echo.accused:
            raise ValueError("an echo of a member accusing itself")
        if (echo.accuser, echo.echoer) in self._echoed:
            return Added(new=False)  # seen, or a second echo of one accuser: ignored
        self._echoed[(echo.accuser, echo.echoer)] = echo
        echoers = self._echoes.setdefault((echo.accuser, echo.accused), set())
        echoers.add(echo.echoer)
        accused = echo.accused
        if (
            accused not in self._counted
            and echo.accuser not in self._equivocators
            and len(echoers) >= self._quorum
        ):
            self._counted.add(accused)
            return Added(new=True, counted=accused)
        return Added(new=True)
