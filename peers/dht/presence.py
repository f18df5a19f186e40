"""Presence: every serving peer announces itself under one well-known DHT key.

Each peer stores, under ``PRESENCE_KEY``, a subkey that names it as owner (so only it
can write it, signed), holding its addresses and the time it last announced. Anyone can
then list the swarm with one ``get``: this is what ``swarm status`` prints.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from peers.dht.node import DHT, ValueWithExpiration, dht_time
from peers.dht.records import owner_marker
from peers.errors import PeersError
from peers.identity import PeerID

logger = logging.getLogger(__name__)

PRESENCE_KEY = b"swarmtrain/presence/v1"
#: How long an announcement lives: a peer that vanishes drops off the list within this.
PRESENCE_TTL_SECONDS = 180.0
#: How often a peer re-announces: several times per TTL, so one lost round is harmless.
PRESENCE_INTERVAL_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class PeerPresence:
    peer_id: PeerID
    addrs: tuple[str, ...]
    agent: str
    last_seen: float  # wall-clock time of its latest announcement


async def announce(dht: DHT, agent: str) -> bool:
    """Announce this peer once; True if a replica accepted it."""
    now = dht_time()
    value = {"addrs": [str(a) for a in dht.peer.advertised_addrs], "agent": agent, "time": now}
    return await dht.store(
        PRESENCE_KEY, value, now + PRESENCE_TTL_SECONDS, subkey=owner_marker(dht.peer.peer_id)
    )


async def announce_forever(dht: DHT, agent: str) -> None:
    """Re-announce every ``PRESENCE_INTERVAL_SECONDS`` until cancelled."""
    while True:
        try:
            await announce(dht, agent)
        except PeersError as e:
            logger.info("presence announcement failed: %s", e)
        await asyncio.sleep(PRESENCE_INTERVAL_SECONDS)


async def list_peers(dht: DHT) -> list[PeerPresence]:
    """Every peer whose announcement is live, most recently seen first. Entries that do
    not parse are skipped (records were validated and signed; their content is still
    the announcer's to get wrong)."""
    found = await dht.get(PRESENCE_KEY)
    if not isinstance(found, dict):
        return []
    out = []
    for subkey, entry in found.items():
        parsed = _parse(subkey, entry)
        if parsed is not None:
            out.append(parsed)
    return sorted(out, key=lambda p: -p.last_seen)


def _parse(subkey: bytes, entry: ValueWithExpiration) -> PeerPresence | None:
    value = entry.value
    try:
        peer_id = PeerID.from_base58(subkey.decode().removeprefix("[owner:").removesuffix("]"))
        addrs = tuple(str(a) for a in value["addrs"])[:8]
        return PeerPresence(peer_id, addrs, str(value.get("agent", ""))[:64], float(value["time"]))
    except (PeersError, KeyError, TypeError, ValueError, AttributeError, UnicodeDecodeError):
        return None
