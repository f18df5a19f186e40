"""Publishing this peer's status record, and reading everyone's.

Every long-running command (``bootstrap``, ``train``, ``join``, ``serve``,
``serve-stage``) runs :func:`publish_status_forever`: every ``interval_seconds`` it
builds a :class:`peers.dht.status.PeerStatus` from what the peer does now (its
reachability, the runs it trains in, what it serves) and stores it, signed, under the
DHT's status key. ``swarm status`` and ``swarm dashboard`` read them back with
:func:`read_statuses` and summarise them (:mod:`swarm.status_view`).

Importing this module does not import torch: a bootstrap peer publishes too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peers.dht import DHT, dht_time
from peers.dht.presence import list_peers
from peers.dht.records import owner_marker
from peers.dht.status import (
    MAX_STATUS_SERVED,
    MIN_STATUS_INTERVAL_SECONDS,
    STATUS_KEY,
    PeerStatus,
    RunStatus,
    ServedStatus,
    StatusError,
    fit,
    status_from_value,
)
from peers.errors import PeersError
from peers.host import Peer
from peers.identity import PeerID
from peers.printable import printable
from peers.reachability import Reachability
from swarm.status_view import Contact, SwarmView, summarize

if TYPE_CHECKING:
    from swarm.collaborative.config import OptimizerStatistics
    from swarm.experts.server import ServerStatistics

logger = logging.getLogger(__name__)

#: How often a peer republishes its status: dashboards refresh every few seconds, and
#: a status older than this is at most one step of a typical run behind.
STATUS_INTERVAL_SECONDS = 10.0
#: A status lives this many intervals: one or two lost publications do not make a peer
#: vanish from ``swarm status``; a peer that left does within half a minute.
STATUS_TTL_INTERVALS = 3.0

RunsSource = Callable[[], Sequence[RunStatus]]
ServedSource = Callable[[], Sequence[ServedStatus]]


def reachability_of(peer: Peer) -> str:
    """How others reach ``peer`` now, as a status record says it
    (:data:`peers.dht.status.REACHABILITIES`)."""
    if peer.circuit_addrs:
        return "relayed"
    verdict = peer.nat.reachability
    if verdict == Reachability.PUBLIC or peer.config.announce_addrs:
        return "public"
    if verdict == Reachability.PRIVATE:
        return "private"
    return "unknown"


def status_of(peer: Peer, runs: Sequence[RunStatus], served: Sequence[ServedStatus]) -> PeerStatus:
    """This peer's record now (at most :data:`MAX_STATUS_SERVED` served modules listed)."""
    return PeerStatus(
        agent=fit(peer.config.agent_version),
        reachability=reachability_of(peer),
        time=dht_time(),
        runs=tuple(runs),
        served=tuple(served[:MAX_STATUS_SERVED]),
        num_served=len(served),
    )


async def publish_status(dht: DHT, status: PeerStatus, ttl_seconds: float) -> bool:
    """Store ``status`` as this peer's record for ``ttl_seconds``; True if a replica took
    it. Raises :class:`StatusError` if it breaks the schema (a bug of ours, not a peer's)."""
    value = status.to_value()  # checks the schema before anything goes out
    subkey = owner_marker(dht.peer.peer_id)
    return await dht.store(STATUS_KEY, value, status.time + ttl_seconds, subkey=subkey)


@dataclass(slots=True)
class StatusSources:
    """What a peer's record says it does, asked each time it publishes (on the event
    loop). The owner may replace either source at any time, e.g. once a server is up."""

    runs: RunsSource = tuple
    served: ServedSource = tuple


async def publish_status_forever(
    dht: DHT, sources: StatusSources, interval_seconds: float = STATUS_INTERVAL_SECONDS
) -> None:
    """Publish this peer's status every ``interval_seconds`` until cancelled. A failed
    publication is logged and retried at the next interval."""
    check_status_interval(interval_seconds)
    ttl = interval_seconds * STATUS_TTL_INTERVALS
    while True:
        try:
            status = status_of(dht.peer, sources.runs(), sources.served())
            if not await publish_status(dht, status, ttl):
                logger.info("no DHT replica took this peer's status yet")
        except (PeersError, StatusError) as e:
            logger.info("publishing this peer's status failed: %s", e)
        await asyncio.sleep(interval_seconds)


def check_status_interval(interval_seconds: float) -> None:
    """Raises ValueError, naming the bound, for an interval replicas would refuse."""
    if not interval_seconds >= MIN_STATUS_INTERVAL_SECONDS:
        raise ValueError(
            f"the status interval must be at least {MIN_STATUS_INTERVAL_SECONDS} s "
            f"(DHT replicas refuse faster updates), not {interval_seconds}"
        )


@contextlib.asynccontextmanager
async def publishing_status(
    dht: DHT, sources: StatusSources, interval_seconds: float = STATUS_INTERVAL_SECONDS
) -> AsyncIterator[StatusSources]:
    """Publish this peer's status while the block runs (:func:`publish_status_forever`
    in a task this context owns: cancelled and awaited on exit). The block's own
    exceptions pass through unchanged; the publisher's (a bug) is raised on a clean exit."""
    task = asyncio.create_task(publish_status_forever(dht, sources, interval_seconds))
    try:
        yield sources
    finally:
        task.cancel()
        await asyncio.wait([task])
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error


async def read_statuses(dht: DHT) -> dict[PeerID, PeerStatus]:
    """Every live status record, by its owner. Records were checked by the replicas
    and again on arrival (:func:`peers.dht.records.validate`); any that still do not
    parse are skipped."""
    found = await dht.get(STATUS_KEY)
    if not isinstance(found, dict):
        return {}
    out: dict[PeerID, PeerStatus] = {}
    for subkey, entry in found.items():
        owner = subkey.decode(errors="replace").removeprefix("[owner:").removesuffix("]")
        try:
            peer_id = PeerID.from_base58(owner)
            out[peer_id] = status_from_value(entry.value)
        except (PeersError, StatusError, ValueError) as e:
            logger.info("skipping a status record of %s: %s", printable(owner, 60), e)
    return out


class RunBoard:
    """The runs a training thread reports, read by the event loop that publishes them.
    :meth:`update` is called from the training thread after each step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: tuple[RunStatus, ...] = ()

    def update(self, run_id: str, stats: OptimizerStatistics, loss: float) -> None:
        run = RunStatus(
            run_id=fit(run_id),
            epoch=stats.epoch,
            samples=stats.local_samples,
            samples_per_second=max(0.0, stats.samples_per_second),
            loss=loss if loss == loss and abs(loss) != float("inf") and loss >= 0 else None,
            num_peers=stats.num_peers,
            num_rounds=stats.num_rounds,
            num_rounds_failed=stats.num_rounds_not_agreed + stats.num_rounds_without_group,
        )
        with self._lock:
            self._runs = (run,)

    def runs(self) -> tuple[RunStatus, ...]:
        with self._lock:
            return self._runs


def served_experts(stats: ServerStatistics) -> list[ServedStatus]:
    """What an expert server serves, for its status record."""
    return [
        ServedStatus(
            kind="expert",
            name=fit(uid),
            stage=0,
            num_stages=0,
            queued=stats.queued_samples.get(uid, 0),
            num_batches=module.num_batches,
        )
        for uid, module in sorted(stats.modules.items())
    ]


def served_stage(
    uid_prefix: str, num_stages: int, stage: int | None, stats: ServerStatistics | None
) -> list[ServedStatus]:
    """The stage a stage server serves now (none between stages), for its status record."""
    if stage is None or stats is None:
        return []
    uid = f"{uid_prefix}.{stage}"
    module = stats.modules.get(uid)
    return [
        ServedStatus(
            kind="stage",
            name=fit(uid_prefix),
            stage=stage,
            num_stages=num_stages,
            queued=stats.queued_samples.get(uid, 0),
            num_batches=0 if module is None else module.num_batches,
        )
    ]


async def gather_view(dht: DHT) -> SwarmView:
    """The swarm as seen from ``dht`` now: every status record, every announced peer
    (:mod:`peers.dht.presence`) and every peer in our routing table."""
    statuses = await read_statuses(dht)
    now_wall, now_mono = dht_time(), asyncio.get_running_loop().time()  # as routing ages
    contacts = [
        Contact(p.peer_id, p.addrs, max(0.0, now_wall - p.last_seen), p.agent)
        for p in await list_peers(dht)
    ]
    for contact in dht.routing.contacts():  # answered us; may not announce
        heard = dht.routing.last_seen(contact.peer_id)
        contacts.append(
            Contact(
                contact.peer_id,
                tuple(f"{a}/p2p/{contact.peer_id}" for a in contact.addrs),
                None if heard is None else max(0.0, now_mono - heard),
            )
        )
    return summarize(statuses, contacts, now_wall)
