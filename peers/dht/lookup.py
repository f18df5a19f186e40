"""The iterative node lookup of Maymounkov & Mazières 2002, "Kademlia", §2.3.

A pure state machine: it says whom to ask next (:meth:`Lookup.next_queries`), learns
from answers (:meth:`Lookup.on_response`) and timeouts (:meth:`Lookup.on_failure`), and
says when it is :attr:`Lookup.done`. The caller sends the FIND_NODE (or FIND_VALUE)
RPCs, enforces their deadlines and decides when a found value ends the lookup early.

As in §2.3, at most alpha queries are in flight, each going to the closest candidate
not yet asked among the k closest known; the lookup ends when the k closest candidates
that have not failed have all answered and nothing is in flight.

One change for a swarm of strangers: a lookup's result holds at most ``max_per_source``
nodes of one network (the caller names each answer's source,
:func:`peers.subnets.source_group` of the connection it came over). Node ids are cheap
to grind (docs/benchmarks.md, "Figures behind constants"), networks are not: without the
limit, one machine with a few dozen ids ground near a key becomes all the key's closest
nodes, where its records are stored and looked up (an eclipse of that key). With it, a
network's ids past the closest ``max_per_source`` are crowded out of the ranking as they
answer, and the next closest, other networks' nodes, take their places.
"""

from __future__ import annotations

import enum
from bisect import insort
from collections.abc import Iterable
from dataclasses import dataclass, fields

from peers.dht.ids import Contact, NodeID, distance
from peers.dht.routing import K
from peers.identity import PeerID

#: Kademlia's alpha (§2.3): queries in flight at once. The paper's 3 saves a few
#: requests; on internet links each wave of them costs a round trip, and a get or store
#: must hear from the 8 closest nodes (``DHTConfig.num_replicas``): with 8 in flight a
#: lookup takes about half the round trips for about 1.5x the requests (the trade-off,
#: measured, is in docs/design/dht.md).
ALPHA = 8
#: Candidates not yet asked are kept only among the closest ``CANDIDATE_FACTOR * k``
#: known: spares for the k closest if many of them fail (2k of them), and a bound on
#: the memory a hostile responder can make us spend (an answer adds at most k more
#: before the excess is dropped).
CANDIDATE_FACTOR = 3
#: Disjoint paths a lookup follows by default (:class:`DisjointLookup`). One: each path
#: costs about its own lookup and its own stores, which a swarm of strangers on many
#: networks may want to pay (``DHTConfig.disjoint_paths``; docs/design/dht.md has the
#: figures both ways), and the per-network limits already stop one machine's ids.
DISJOINT_PATHS = 1
#: Nodes of one network (``peers.subnets`` source) a lookup's result may hold, as a
#: routing table's bucket may (``routing.MAX_PER_SOURCE_PER_BUCKET``).
MAX_RESULTS_PER_SOURCE = 2


class _State(enum.Enum):
    CANDIDATE = enum.auto()
    IN_FLIGHT = enum.auto()
    RESPONDED = enum.auto()


class _Candidate:
    __slots__ = ("contact", "state")

    def __init__(self, contact: Contact) -> None:
        self.contact = contact
        self.state = _State.CANDIDATE


@dataclass(frozen=True, slots=True)
class LookupStatistics:
    num_queried: int
    num_responded: int
    num_failed: int
    num_in_flight: int
    num_candidates: int
    num_crowded_out: int
    """Nodes that answered but were dropped from the result: their network already had
    ``max_per_source`` closer ones in it."""


class Lookup:
    """One iterative lookup of ``target``; see the module docstring."""

    def __init__(
        self,
        target: NodeID,
        initial: Iterable[Contact],
        *,
        local_peer_id: PeerID | None = None,
        k: int = K,
        alpha: int = ALPHA,
        max_per_source: int | None = None,
        claims: dict[PeerID, int] | None = None,
        path: int = 0,
    ) -> None:
        """Start from ``initial`` (usually the routing table's k nearest to ``target``).
        ``k`` and ``alpha`` are the paper's k (result size) and alpha (parallelism).
        ``local_peer_id`` is never queried, wherever it shows up. ``max_per_source``:
        answers of one source kept at most (None: no limit; see the module docstring).
        ``claims`` (shared by the paths of a :class:`DisjointLookup`, this one being
        ``path``): who queried each node; a node another path queried is never queried
        here."""
        if k < 1 or alpha < 1:
            raise ValueError("k and alpha must be positive")
        if max_per_source is not None and max_per_source < 1:
            raise ValueError("max_per_source must be None or positive")
        self.max_per_source = max_per_source
        self._claims = claims
        self._path = path
        self.target = target
        self.k = k
        self.alpha = alpha
        self._local_peer_id = local_peer_id
        self._max_candidates = CANDIDATE_FACTOR * k
        # Non-failed candidates by distance to target: distances are unique, since the
        # XOR metric is injective for a fixed target and node ids are distinct.
        self._by_distance: dict[int, _Candidate] = {}
        self._order: list[int] = []  # the keys of _by_distance, ascending
        self._failed: set[PeerID] = set()
        self._crowded: set[PeerID] = set()  # answered, but their network had enough
        self._taken: set[PeerID] = set()  # queried by another path
        self._responded_by_source: dict[str, list[int]] = {}  # distances, ascending
        self._num_in_flight = 0
        self._num_queried = 0
        self._num_responded = 0
        self._add(initial)

    def next_queries(self) -> list[Contact]:
        """The contacts to query now, marked in flight: the closest not yet asked among
        the k closest non-failed candidates, as many as keep at most alpha in flight.
        Empty when nothing more should be sent until an answer or failure arrives."""
        chosen: list[Contact] = []
        index = 0
        while index < min(self.k, len(self._order)) and self._num_in_flight < self.alpha:
            d = self._order[index]
            candidate = self._by_distance[d]
            index += 1
            if candidate.state is not _State.CANDIDATE:
                continue
            if self._claims is not None:
                owner = self._claims.setdefault(candidate.contact.peer_id, self._path)
                if owner != self._path:  # another path's: gone from this one
                    del self._by_distance[d]
                    self._order.remove(d)
                    self._taken.add(candidate.contact.peer_id)
                    index -= 1
                    continue
            candidate.state = _State.IN_FLIGHT
            self._num_in_flight += 1
            self._num_queried += 1
            chosen.append(candidate.contact)
        return chosen

    def on_response(
        self, contact: Contact, closer: Iterable[Contact], *, source: str | None = None
    ) -> None:
        """``contact`` answered with ``closer``, the contacts it knows nearest the target;
        ``source`` is the network its answer came from (None: unknown, not limited).

        Only the first k of ``closer`` are read (more is the remote's fault); the local
        peer, known and failed contacts among them are skipped. An answer that arrives
        after :meth:`on_failure` for the same contact, and a second answer, are ignored.
        Past ``max_per_source`` answers of one source, its farthest answered node is
        crowded out of the ranking. Raises ValueError for a contact this lookup never
        asked."""
        candidate = self._find(contact)
        if candidate is None and (
            contact.peer_id in self._failed or contact.peer_id in self._crowded
        ):
            return
        if candidate is None or candidate.state is _State.CANDIDATE:
            raise ValueError(f"{contact.peer_id} answered a lookup that never asked it")
        if candidate.state is _State.RESPONDED:
            return
        candidate.state = _State.RESPONDED
        self._num_in_flight -= 1
        self._num_responded += 1
        limited: list[Contact] = []
        for item in closer:
            if len(limited) >= self.k:
                break
            limited.append(item)
        self._add(limited)
        if source is not None and self.max_per_source is not None:
            self._limit_source(source, distance(contact.node_id, self.target))

    def _limit_source(self, source: str, d: int) -> None:
        mine = self._responded_by_source.setdefault(source, [])
        insort(mine, d)
        while len(mine) > (self.max_per_source or len(mine)):
            farthest = mine.pop()
            crowded = self._by_distance.pop(farthest)
            self._order.remove(farthest)
            self._crowded.add(crowded.contact.peer_id)

    def on_failure(self, contact: Contact) -> None:
        """The query to ``contact`` timed out or failed: it is never among the answered,
        and never asked again. Raises ValueError for a contact not in flight."""
        candidate = self._find(contact)
        if candidate is None or candidate.state is not _State.IN_FLIGHT:
            raise ValueError(f"{contact.peer_id} has no query in flight in this lookup")
        d = distance(contact.node_id, self.target)
        del self._by_distance[d]
        self._order.remove(d)
        self._failed.add(contact.peer_id)
        self._num_in_flight -= 1

    @property
    def done(self) -> bool:
        """True when nothing is in flight and the k closest non-failed candidates have all
        answered (so also when every candidate has been asked, or none was known)."""
        if self._num_in_flight:
            return False
        counted = 0
        for d in self._order:
            if counted == self.k:
                break
            candidate = self._by_distance[d]
            if self._claimed_elsewhere(candidate.contact.peer_id):
                continue  # not this path's to ask (next_queries drops it)
            if candidate.state is not _State.RESPONDED:
                return False
            counted += 1
        return True

    def _claimed_elsewhere(self, peer_id: PeerID) -> bool:
        return self._claims is not None and self._claims.get(peer_id, self._path) != self._path

    def closest_responded(self) -> list[Contact]:
        """Up to k contacts that answered, closest to the target first."""
        answered = (self._by_distance[d] for d in self._order)
        return [c.contact for c in answered if c.state is _State.RESPONDED][: self.k]

    @property
    def num_queried(self) -> int:
        return self._num_queried

    @property
    def num_responded(self) -> int:
        return self._num_responded

    @property
    def num_failed(self) -> int:
        return len(self._failed)

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def statistics(self) -> LookupStatistics:
        return LookupStatistics(
            num_queried=self._num_queried,
            num_responded=self._num_responded,
            num_failed=len(self._failed),
            num_in_flight=self._num_in_flight,
            num_candidates=len(self._order),
            num_crowded_out=len(self._crowded),
        )

    def _find(self, contact: Contact) -> _Candidate | None:
        candidate = self._by_distance.get(distance(contact.node_id, self.target))
        return candidate if candidate is not None and candidate.contact == contact else None

    def _add(self, contacts: Iterable[Contact]) -> None:
        for contact in contacts:
            if contact.peer_id == self._local_peer_id or contact.peer_id in self._failed:
                continue
            if contact.peer_id in self._crowded or contact.peer_id in self._taken:
                continue
            d = distance(contact.node_id, self.target)
            if d not in self._by_distance:
                self._by_distance[d] = _Candidate(contact)
                insort(self._order, d)
        # Candidates not yet asked that rank past the bound are dropped; asked ones stay,
        # as the lookup still needs their answers (and there is one per query at most).
        for index in range(len(self._order) - 1, self._max_candidates - 1, -1):
            d = self._order[index]
            if self._by_distance[d].state is _State.CANDIDATE:
                del self._by_distance[d]
                del self._order[index]


class DisjointLookup:
    """``paths`` lookups of one target over disjoint sets of nodes (Baumgart and Mies,
    "S/Kademlia", 2007, §4.4): the initial contacts are dealt among the paths, each
    path runs as a :class:`Lookup`, and no node is queried by two paths (the first to
    query it owns it). A hostile node on a path can steer that path only: its answers
    reach no other. The result merges the paths' answered nodes, nearest first, at most
    ``max_per_source`` of one source and ``k`` in all. One path is a plain lookup."""

    def __init__(
        self,
        target: NodeID,
        initial: Iterable[Contact],
        *,
        paths: int,
        local_peer_id: PeerID | None = None,
        k: int = K,
        alpha: int = ALPHA,
        max_per_source: int | None = None,
    ) -> None:
        if paths < 1:
            raise ValueError("paths must be at least 1")
        self.target = target
        self.k = k
        self.max_per_source = max_per_source
        unique = {c.peer_id: c for c in initial}.values()
        ordered = sorted(unique, key=lambda c: distance(c.node_id, target))
        claims: dict[PeerID, int] = {}
        self.paths = [
            Lookup(
                target,
                ordered[i::paths],
                local_peer_id=local_peer_id,
                k=k,
                alpha=alpha,
                max_per_source=max_per_source,
                claims=claims if paths > 1 else None,
                path=i,
            )
            for i in range(paths)
        ]
        self._sources: dict[PeerID, str] = {}

    def next_queries(self) -> list[tuple[int, Contact]]:
        """Each path's next queries, with the path's index."""
        return [(i, c) for i, path in enumerate(self.paths) for c in path.next_queries()]

    def on_response(
        self, path: int, contact: Contact, closer: Iterable[Contact], *, source: str | None = None
    ) -> None:
        """As :meth:`Lookup.on_response`, for the path that asked."""
        if source is not None:
            self._sources[contact.peer_id] = source
        self.paths[path].on_response(contact, closer, source=source)

    def on_failure(self, path: int, contact: Contact) -> None:
        """As :meth:`Lookup.on_failure`, for the path that asked."""
        self.paths[path].on_failure(contact)

    @property
    def done(self) -> bool:
        return all(path.done for path in self.paths)

    def closest_responded(self) -> list[Contact]:
        """Up to k contacts that answered on any path, closest first, at most
        ``max_per_source`` of one source."""
        answered = {c.peer_id: c for p in self.paths for c in p.closest_responded()}
        ordered = sorted(answered.values(), key=lambda c: distance(c.node_id, self.target))
        kept: list[Contact] = []
        per_source: dict[str, int] = {}
        for contact in ordered:
            source = self._sources.get(contact.peer_id)
            if source is not None and self.max_per_source is not None:
                if per_source.get(source, 0) >= self.max_per_source:
                    continue
                per_source[source] = per_source.get(source, 0) + 1
            kept.append(contact)
        return kept[: self.k]

    def closest_on_each_path(self) -> list[Contact]:
        """Every path's own closest answered nodes (up to k each, its per-source limit
        applied), without repeats, closest first: where a store goes. Nodes ground near
        a key rank first in any merged list; apart, each path also names the nearest
        nodes it reached without them."""
        found = {c.peer_id: c for p in self.paths for c in p.closest_responded()}
        return sorted(found.values(), key=lambda c: distance(c.node_id, self.target))

    def statistics(self) -> LookupStatistics:
        parts = [p.statistics() for p in self.paths]
        return LookupStatistics(
            *(sum(getattr(s, f.name) for s in parts) for f in fields(LookupStatistics))
        )
