"""Announcing hosted experts in the DHT, and reading the announcements back.

Layout (hivemind's, with owned subkeys): for a uid ``ffn.3.7`` a server stores under
the key of each prefix (``ffn``, ``ffn.3``) a subkey naming the next coordinate and
itself as owner (``3[owner:ID]``, ``7[owner:ID]``), so only it can write or refresh its
own entries (they are signed) and several servers may host the same uid side by side.
The value says which uid lies below, where the server listens, its load (samples
queued) and throughput (samples per second of compute). One ``get`` of a prefix key
lists its live next coordinates: that is one step of beam search. A uid's servers are
the entries of its parent prefix whose value names that exact uid.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from peers.dht import DHT, ValueWithExpiration, owner_marker
from peers.errors import IdentityError, PeersError
from peers.identity import PeerID
from swarm.experts.uids import DELIMITER, is_valid_uid, levels

logger = logging.getLogger(__name__)

KEY_PREFIX = "swarmtrain/experts/v1/"
#: Addresses kept per announcement: a peer has a few (IPv4, IPv6, relayed); more are
#: noise and a way to bloat the value.
MAX_ANNOUNCED_ADDRS = 8
#: DHT stores in flight while announcing: a server with many experts must not open
#: hundreds of lookups at once.
MAX_CONCURRENT_STORES = 8
#: Entries parsed per prefix key (the DHT holds at most 1024 subkeys per key anyway).
MAX_ENTRIES_PER_LEVEL = 1024


@dataclass(frozen=True, slots=True)
class ExpertLocation:
    """Where to call an expert: its uid, its server's PeerID and addresses."""

    uid: str
    peer_id: PeerID
    addrs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Announcement:
    """One server's announcement of one expert."""

    location: ExpertLocation
    load: int
    """Samples queued at the module when announced."""
    throughput: float
    """Samples per second of compute, smoothed."""

    def cost(self) -> float:
        """Seconds the queue would take to drain: lower is better."""
        return (self.load + 1) / max(self.throughput, 1e-3)


#: What one prefix key holds: next coordinate -> announcements (an example uid below it).
Level = dict[int, list[Announcement]]


def dht_key(prefix: str) -> str:
    return KEY_PREFIX + prefix


def records(announcements: Iterable[Announcement]) -> dict[tuple[str, bytes], dict[str, Any]]:
    """The ``(key, subkey) -> value`` entries that announce these experts (pure)."""
    out: dict[tuple[str, bytes], dict[str, Any]] = {}
    for a in announcements:
        value = {
            "uid": a.location.uid,
            "addrs": list(a.location.addrs[:MAX_ANNOUNCED_ADDRS]),
            "load": int(a.load),
            "throughput": float(a.throughput),
        }
        marker = owner_marker(a.location.peer_id)
        for prefix, coord in levels(a.location.uid):
            key = (dht_key(prefix), str(coord).encode() + marker)
            # The uid's own entry (the last level) wins over an example from a deeper uid.
            if key not in out or out[key]["uid"] != f"{prefix}{DELIMITER}{coord}":
                out[key] = value
    return out


async def declare_experts(
    dht: DHT, announcements: Sequence[Announcement], expiration_time: float
) -> int:
    """Store the announcements; the number of entries at least one replica accepted.
    Failures are logged, not raised (the next round tries again)."""
    semaphore = asyncio.Semaphore(MAX_CONCURRENT_STORES)

    async def store(key: str, subkey: bytes, value: dict[str, Any]) -> bool:
        async with semaphore:
            try:
                return await dht.store(key, value, expiration_time, subkey=subkey)
            except (PeersError, TimeoutError) as e:
                logger.info("announcing %s failed: %s", key, e)
                return False

    entries = records(announcements)
    results = await asyncio.gather(*(store(k, s, v) for (k, s), v in entries.items()))
    return sum(results)


def parse_level(prefix: str, found: object) -> Level:
    """The live entries of one prefix key as ``dht.get`` returned them. Entries that do
    not parse, name a uid outside this prefix, or a coordinate that does not match
    their uid are skipped (the DHT checked their signatures, not their content)."""
    level: Level = {}
    if not isinstance(found, dict):
        return level
    for subkey, entry in list(found.items())[:MAX_ENTRIES_PER_LEVEL]:
        parsed = _parse_entry(prefix, subkey, entry)
        if parsed is not None:
            level.setdefault(parsed[0], []).append(parsed[1])
    return level


def _parse_entry(prefix: str, subkey: object, entry: object) -> tuple[int, Announcement] | None:
    if not isinstance(subkey, bytes) or not isinstance(entry, ValueWithExpiration):
        return None
    coord_text, _, owner = subkey.partition(b"[owner:")
    value = entry.value
    try:
        coord = int(coord_text.decode("ascii"))
        peer_id = PeerID.from_base58(owner.removesuffix(b"]").decode("ascii"))
        uid, addrs = value["uid"], value["addrs"]
        load, throughput = int(value["load"]), float(value["throughput"])
    except (IdentityError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    head = f"{prefix}{DELIMITER}{coord}"
    if (
        not is_valid_uid(uid)
        or not (uid == head or uid.startswith(head + DELIMITER))
        or not isinstance(addrs, list)
        or not all(isinstance(a, str) and len(a) < 512 for a in addrs)
        or load < 0
        or not (math.isfinite(throughput) and throughput >= 0)
    ):
        return None
    location = ExpertLocation(uid, peer_id, tuple(addrs[:MAX_ANNOUNCED_ADDRS]))
    return coord, Announcement(location, load, throughput)


async def fetch_levels(dht: DHT, prefixes: Iterable[str]) -> dict[str, Level]:
    """One ``get`` per prefix key, concurrently; a prefix that fails reads as empty."""

    async def one(prefix: str) -> tuple[str, Level]:
        try:
            return prefix, parse_level(prefix, await dht.get(dht_key(prefix)))
        except (PeersError, TimeoutError) as e:
            logger.info("reading expert prefix %s failed: %s", prefix, e)
            return prefix, {}

    return dict(await asyncio.gather(*(one(p) for p in set(prefixes))))


async def find_experts(dht: DHT, uids: Sequence[str]) -> dict[str, list[Announcement]]:
    """Every live server of each uid, least loaded first (an empty list if none).
    ValueError for an invalid uid."""
    parents = {uid: levels(uid)[-1] for uid in uids}
    found = await fetch_levels(dht, (prefix for prefix, _ in parents.values()))
    return {uid: best_first(uid, found[p].get(c, [])) for uid, (p, c) in parents.items()}


def best_first(uid: str, entries: Sequence[Announcement]) -> list[Announcement]:
    """The announcements of exactly ``uid``, lowest :meth:`Announcement.cost` first."""
    return sorted((a for a in entries if a.location.uid == uid), key=Announcement.cost)


def by_uid(levels_found: Mapping[str, Level], uid: str) -> list[Announcement]:
    prefix, coord = levels(uid)[-1]
    return best_first(uid, levels_found.get(prefix, {}).get(coord, []))
