"""Finding the top-k live experts of a grid for each sample: beam search over the DHT.

:class:`BeamSearch` is the pure part
(CONTRIBUTING.md, "Protocols are pure state machines"): it says which prefix keys it
needs (:meth:`BeamSearch.wanted`), and a caller hands it what the DHT holds under them
(:meth:`BeamSearch.advance`). Per sample, the beam starts at the grid's name; at grid
dimension ``d`` every prefix in the beam is extended by its live next coordinates,
scored by the sum of the sample's gate scores along the way, and the best ``beam_size``
survive (hivemind's ``MoEBeamSearcher``). The prefixes all samples need at one dimension
are fetched once, so a batch costs one DHT round per dimension. :class:`ExpertFinder`
drives it against a DHT, with a short-lived cache of prefixes.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Collection, Iterable, Mapping, Sequence

from peers.dht import DHT
from peers.identity import PeerID
from swarm.experts.announce import Announcement, Level, best_first, fetch_levels
from swarm.experts.uids import DELIMITER, MAX_GRID_DIMS, check_name

#: Prefix levels an :class:`ExpertFinder` keeps: a 2-d grid of 256 x 256 has 257.
MAX_CACHED_PREFIXES = 4096

Scores = Sequence[Sequence[float]]  # one sample: a score per coordinate, per dimension


class BeamSearch:
    """One batch's search. ``scores[i][d][c]`` is sample i's score of coordinate c along
    dimension d. Recent failures are passed over: ``exclude`` holds (uid, server) pairs,
    ``exclude_peers`` servers whose every entry is ignored (at every level, so a beam
    never narrows onto a part of the grid that only a dead server announced)."""

    def __init__(
        self,
        name: str,
        grid_size: Sequence[int],
        scores: Sequence[Scores],
        beam_size: int,
        exclude: Collection[tuple[str, PeerID]] = (),
        exclude_peers: Collection[PeerID] = (),
    ) -> None:
        check_name(name)
        if not 1 <= len(grid_size) <= MAX_GRID_DIMS or min(grid_size) < 1 or beam_size < 1:
            raise ValueError(f"bad grid {list(grid_size)} or beam size {beam_size}")
        for sample in scores:
            if [len(s) for s in sample] != list(grid_size):
                raise ValueError(f"scores of shape {[len(s) for s in sample]} for grid {grid_size}")
        self.grid_size = list(grid_size)
        self.scores = scores
        self.beam_size = beam_size
        self.exclude = exclude
        self.exclude_peers = exclude_peers
        self._dim = 0
        self._beams: list[list[tuple[float, str]]] = [[(0.0, name)] for _ in scores]
        self._found: list[list[Announcement]] = [[] for _ in scores]

    @property
    def done(self) -> bool:
        return self._dim == len(self.grid_size)

    def wanted(self) -> set[str]:
        """The prefix keys the next :meth:`advance` needs."""
        return {prefix for beam in self._beams for _, prefix in beam}

    def advance(self, levels: Mapping[str, Level]) -> None:
        """Extend every beam by one dimension with what the DHT holds (a prefix missing
        from ``levels`` has no live coordinates)."""
        dim, last = self._dim, self._dim == len(self.grid_size) - 1
        for i, beam in enumerate(self._beams):
            candidates: list[tuple[float, str, Announcement | None]] = []
            for score, prefix in beam:
                for coord, entries in levels.get(prefix, {}).items():
                    entries = [a for a in entries if a.location.peer_id not in self.exclude_peers]
                    if not entries or not 0 <= coord < self.grid_size[dim]:
                        continue
                    uid = f"{prefix}{DELIMITER}{coord}"
                    best: Announcement | None = None
                    if last:
                        live = [a for a in best_first(uid, entries) if not self._excluded(a)]
                        if not live:
                            continue
                        best = live[0]
                    candidates.append((score + float(self.scores[i][dim][coord]), uid, best))
            top = heapq.nsmallest(self.beam_size, candidates, key=lambda c: (-c[0], c[1]))
            self._beams[i] = [(score, uid) for score, uid, _ in top]
            if last:
                self._found[i] = [a for _, _, a in top if a is not None]
        self._dim += 1

    def _excluded(self, a: Announcement) -> bool:
        return (a.location.uid, a.location.peer_id) in self.exclude

    def result(self) -> list[list[Announcement]]:
        """Per sample, up to ``beam_size`` experts, best score first."""
        if not self.done:
            raise RuntimeError("the search has not reached the last dimension")
        return self._found


class ExpertFinder:
    """Runs beam searches against a DHT, caching each prefix level ``cache_seconds``."""

    def __init__(self, dht: DHT, cache_seconds: float) -> None:
        self.dht = dht
        self.cache_seconds = cache_seconds
        self._cache: dict[str, tuple[float, Level]] = {}

    async def find(
        self,
        name: str,
        grid_size: Sequence[int],
        scores: Sequence[Scores],
        beam_size: int,
        exclude: Collection[tuple[str, PeerID]] = (),
        exclude_peers: Collection[PeerID] = (),
    ) -> list[list[Announcement]]:
        search = BeamSearch(name, grid_size, scores, beam_size, exclude, exclude_peers)
        while not search.done:
            search.advance(await self._levels(search.wanted()))
        return search.result()

    async def _levels(self, prefixes: Iterable[str]) -> dict[str, Level]:
        now = time.monotonic()
        wanted = set(prefixes)
        stale = [p for p in wanted if now - self._cache.get(p, (-1e18, {}))[0] > self.cache_seconds]
        if stale:
            for prefix, level in (await fetch_levels(self.dht, stale)).items():
                self._cache[prefix] = (now, level)
            for prefix in sorted(self._cache, key=lambda p: self._cache[p][0])[
                : max(0, len(self._cache) - MAX_CACHED_PREFIXES)
            ]:
                del self._cache[prefix]
        return {p: self._cache[p][1] for p in wanted if p in self._cache}

    def forget(self) -> None:
        """Drop the cache (e.g. after experts failed: read the DHT afresh next time)."""
        self._cache.clear()
