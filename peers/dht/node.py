"""The DHT node: Kademlia (Maymounkov & Mazières 2002) over our RPC.

The pure parts decide: :class:`RoutingTable` (who we know), :class:`Lookup` (whom to ask
next), :class:`RecordStore` (what we keep). This module moves their decisions over the
network, enforces timeouts, and owns the background work (bucket refresh, republish,
re-bootstrap, pinging stale contacts) as a :class:`peers.service.Service` entered with
``async with``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from peers.addresses import parse_multiaddr, split_peer_id
from peers.dht.config import (
    DHTConfig,
    DHTStatistics,
    ValueWithExpiration,
    dht_time,
)
from peers.dht.ids import Contact, NodeID, distance, key_id, node_id_of
from peers.dht.lookup import MAX_RESULTS_PER_SOURCE, DisjointLookup
from peers.dht.protocol import (
    FIND_NODE_PROTOCOL,
    FIND_VALUE_PROTOCOL,
    MAX_DHT_FRAME_BYTES,
    MAX_DHT_VALUE_ITEMS,
    MAX_FIND_VALUE_PAGES,
    MAX_RECORDS_PER_MESSAGE,
    MAX_REPLY_RECORD_BYTES,
    MAX_STORE_REQUEST_BYTES,
    PING_PROTOCOL,
    STORE_PROTOCOL,
    FindNodeRequest,
    FindNodeResponse,
    FindValueRequest,
    FindValueResponse,
    PingRequest,
    PingResponse,
    SenderInfo,
    StoreRequest,
    StoreResponse,
    contact_to_wire,
    contacts_from_wire,
    record_from_wire,
    record_to_wire,
    record_wire_bytes,
    sender_addrs,
)
from peers.dht.records import Record, RecordError, owner_of, validate
from peers.dht.routing import RoutingTable
from peers.dht.storage import OWN_SOURCE, RecordStore, StoreResult, record_cost
from peers.errors import PeersError, StreamReset
from peers.host import Peer
from peers.identity import PeerID
from peers.pnet import missing_key_hint
from peers.rpc import CallContext, call_unary
from peers.serialization import SerializationError, pack, unpack
from peers.service import Service
from peers.stream_api import AddressedHost
from peers.subnets import source_group
from peers.wire import WireError

__all__ = [
    "DHT",
    "DHTConfig",
    "DHTError",
    "DHTStatistics",
    "ValueWithExpiration",
    "dht_time",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
if TYPE_CHECKING:
    # The host a DHT runs on: a Peer unless said otherwise (an in-memory peer in tests,
    # peers.memory_network), so a bare ``DHT`` annotation keeps ``dht.peer`` a Peer.
    # PEP 696 defaults are for the type checker only, as in peers.rpc.
    from typing_extensions import TypeVar as DefaultTypeVar

    H = DefaultTypeVar("H", bound=AddressedHost, default=Peer)
else:
    H = TypeVar("H", bound=AddressedHost)

#: Every DHT protocol's frame bounds, both ways (``peers.dht.protocol``).
_DHT_FRAMES: dict[str, Any] = {
    "max_frame_bytes": MAX_DHT_FRAME_BYTES,
    "max_value_items": MAX_DHT_VALUE_ITEMS,
}

#: Contacts whose addresses we remember having handed to the address book; past this
#: the memory is dropped (it only saves repeated parsing).
MAX_ADDRESS_MEMORY = 4096


class DHTError(PeersError):
    """The DHT cannot do what was asked (no initial peer answered, a record is invalid)."""


@dataclass
class _Published:
    record: Record
    last_stored: float


@dataclass
class _Counters:
    served: Counter[str] = field(default_factory=Counter)
    sent: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    stores_refused_far: int = 0


def _as_key(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


class DHT(Service, Generic[H]):
    """A Kademlia node on a :class:`peers.Peer` (or any
    :class:`peers.stream_api.AddressedHost`). Use ``async with DHT(peer, config)``."""

    def __init__(
        self, peer: H, config: DHTConfig | None = None, *, clock: Callable[[], float] = dht_time
    ) -> None:
        super().__init__()
        self.peer = peer
        #: The shared wall clock that records' expirations are read against:
        #: :func:`dht_time`, or in in-memory tests one that follows the virtual loop.
        self.clock = clock
        self.config = config or DHTConfig()
        self.node_id = node_id_of(peer.peer_id)
        self.routing = RoutingTable(self.node_id, k=self.config.k)
        self.store_ = RecordStore()
        self._published: dict[tuple[bytes, bytes | None], _Published] = {}
        self._counters = _Counters()
        self._pinging: set[PeerID] = set()
        self._sender_info: SenderInfo | None = None
        self._addrs_told: dict[PeerID, tuple[str, ...]] = {}

    @staticmethod
    def _now() -> float:
        """The loop's clock: ``time.monotonic()`` on a real loop, the virtual one in
        in-memory tests (:mod:`peers.virtual_clock`), so routing and republishing age
        with the protocol's own timers."""
        return asyncio.get_running_loop().time()

    @property
    def client_mode(self) -> bool:
        if self.config.client_mode is not None:
            return self.config.client_mode
        return not self.peer.listen_addrs

    def _sender(self) -> SenderInfo:
        """Who we are, as every request says it (computed once: addresses are fixed)."""
        if self._sender_info is None:
            if self.client_mode:
                self._sender_info = SenderInfo([], True)
            else:
                addrs = [str(split_peer_id(a)[0]) for a in self.peer.listen_addrs]
                self._sender_info = SenderInfo(addrs, False)
        return self._sender_info

    # --- lifecycle ---------------------------------------------------------------

    async def _start(self) -> None:
        if not self.client_mode:
            for protocol, handler, request_type in (
                (PING_PROTOCOL, self.rpc_ping, PingRequest),
                (FIND_NODE_PROTOCOL, self.rpc_find_node, FindNodeRequest),
                (FIND_VALUE_PROTOCOL, self.rpc_find_value, FindValueRequest),
                (STORE_PROTOCOL, self.rpc_store, StoreRequest),
            ):
                self._serve_unary(self.peer, protocol, handler, request_type, **_DHT_FRAMES)
        if self.config.initial_peers:
            await self.bootstrap()
        self._spawn(self._maintain())

    async def bootstrap(self) -> int:
        """Join through the initial peers; the number that answered.

        Logs a warning naming each unreachable one; raises :class:`DHTError` if none
        answers. Then looks up our own id, which fills our buckets, and an id at each
        distance farther than the nearest node found (§2.3 "joining").
        """
        addrs = self.config.initial_peers
        results = await asyncio.gather(*(self._ping_addr(a) for a in addrs), return_exceptions=True)
        reached = 0
        for addr, result in zip(addrs, results, strict=True):
            if isinstance(result, StreamReset):  # it took our handshake, then hung up
                logger.warning(
                    "initial peer %s closed the connection right after the handshake (%s): a "
                    "private swarm that does not allow our peer ID %s does that",
                    addr,
                    result,
                    self.peer.peer_id,
                )
            elif isinstance(result, BaseException):
                have_key = isinstance(self.peer, Peer) and self.peer.config.swarm_key is not None
                hint = missing_key_hint(result, have_key)
                why = str(result) or type(result).__name__  # a timeout has no message
                logger.warning("initial peer %s did not answer: %s%s", addr, why, hint)
            else:
                reached += 1
        if addrs and not reached:
            raise DHTError(f"none of the {len(addrs)} initial peers answered: {', '.join(addrs)}")
        await self.find_nearest(self.node_id)
        # §2.3's second step; ids drawn from our own, so an in-memory run repeats.
        targets = self.routing.join_targets(random.Random(self.node_id))
        await asyncio.gather(*(self._refresh(t) for t in targets))
        return reached

    async def _refresh(self, target: NodeID) -> None:
        await self.find_nearest(target)
        self.routing.mark_bucket_refreshed(target, self._now())

    async def _ping_addr(self, addr: str) -> None:
        async with asyncio.timeout(self.config.bootstrap_timeout):
            peer_id = await self.peer.connect(addr)
            transport = split_peer_id(parse_multiaddr(addr))[0]
            await self._call(
                Contact(peer_id, (str(transport),)),
                PING_PROTOCOL,
                PingRequest(self._sender()),
                PingResponse,
            )

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintenance_interval)
            try:
                await self.maintain_once()
            except PeersError as e:
                logger.info("DHT maintenance pass failed: %s", e)

    async def maintain_once(self) -> None:
        """One maintenance pass: re-bootstrap if alone, refresh idle buckets, republish
        our records, purge expired ones. Runs every ``maintenance_interval`` seconds."""
        now = self._now()
        if not len(self.routing) and self.config.initial_peers:
            with contextlib.suppress(DHTError):
                await self.bootstrap()
        for target in self.routing.buckets_to_refresh(now, self.config.refresh_interval):
            await self._refresh(target)
        wall = self.clock()
        for slot, published in list(self._published.items()):
            if published.record.expiration_time <= wall:
                del self._published[slot]
            elif now - published.last_stored >= self.config.republish_interval:
                await self._store_record(published.record)
                published.last_stored = now
        self.store_.purge_expired(wall)

    def _records_for(self, key: bytes, now: float) -> list[Record]:
        held = self.store_.get(key, now)
        if held is None:
            return []
        return ([held.plain] if held.plain is not None else []) + list(held.subkeys.values())

    # --- serving (rpc_*) ---------------------------------------------------------

    def _heard_from(self, peer_id: PeerID, sender: SenderInfo) -> None:
        """A peer called us: remember it, unless it is a client (§2.2: every message
        updates the bucket). A full bucket's oldest contact gets pinged, not evicted."""
        if sender.client_mode:
            return
        addrs = sender_addrs(sender)
        if not addrs:
            return
        self._learn(Contact(peer_id, addrs))

    def _learn(self, contact: Contact) -> None:
        stale = self.routing.update(contact, self._now(), source=self._source_of(contact))
        self._remember_addrs(contact)
        if stale is not None and stale.peer_id not in self._pinging and self._group is not None:
            self._pinging.add(stale.peer_id)
            self._spawn(self._ping_stale(stale, contact))

    def _is_near(self, key: bytes) -> bool:
        """Whether a record under ``key`` belongs here: fewer than k of the nodes we know
        are closer to it than we are. Records live at the ``num_replicas`` closest nodes,
        so an honest store meets this with room to spare for our stale contacts; a
        stranger cannot make far nodes hold its records."""
        target = key_id(key)
        mine = distance(self.node_id, target)
        closer = self.routing.nearest(target, self.config.k)
        return len(closer) < self.config.k or distance(closer[-1].node_id, target) > mine

    def _source_of(self, contact: Contact) -> str | None:
        """The network ``contact`` reaches us from (``peers.subnets``): its connection's
        remote address, never an address it claims. None without a connection."""
        conn = self.peer.connection_to(contact.peer_id)
        return None if conn is None else source_group(conn.remote_address, contact.peer_id)

    async def _ping_stale(self, stale: Contact, newcomer: Contact) -> None:
        try:
            await self._call(stale, PING_PROTOCOL, PingRequest(self._sender()), PingResponse)
        except (PeersError, TimeoutError):
            self.routing.remove(stale.peer_id)
            self.routing.update(newcomer, self._now(), source=self._source_of(newcomer))
        finally:
            self._pinging.discard(stale.peer_id)

    def _remember_addrs(self, contact: Contact) -> None:
        """Tell the peer's address book where ``contact`` is (once per change of addrs)."""
        if not contact.addrs or self._addrs_told.get(contact.peer_id) == contact.addrs:
            return
        if len(self._addrs_told) >= MAX_ADDRESS_MEMORY:
            self._addrs_told.clear()
        self._addrs_told[contact.peer_id] = contact.addrs
        good = []
        for addr in contact.addrs:
            try:
                good.append(parse_multiaddr(addr))
            except PeersError:
                continue
        if good:
            self.peer.add_addresses(contact.peer_id, good)

    async def rpc_ping(self, request: PingRequest, context: CallContext) -> PingResponse:
        self._counters.served["ping"] += 1
        self._heard_from(context.remote_peer_id, request.sender)
        return PingResponse()

    async def rpc_find_node(
        self, request: FindNodeRequest, context: CallContext
    ) -> FindNodeResponse:
        self._counters.served["find_node"] += 1
        if len(request.target) != 32:
            raise WireError("a find-node target has 32 bytes")
        self._heard_from(context.remote_peer_id, request.sender)
        nearest = self.routing.nearest(
            int.from_bytes(request.target, "big"), self.config.k, exclude=(context.remote_peer_id,)
        )
        return FindNodeResponse([contact_to_wire(c) for c in nearest])

    async def rpc_find_value(
        self, request: FindValueRequest, context: CallContext
    ) -> FindValueResponse:
        self._counters.served["find_value"] += 1
        self._heard_from(context.remote_peer_id, request.sender)
        records, more = _page(self._records_for(request.key, self.clock()), request.after)
        nearest = self.routing.nearest(
            key_id(request.key), self.config.k, exclude=(context.remote_peer_id,)
        )
        return FindValueResponse(
            [record_to_wire(r) for r in records], [contact_to_wire(c) for c in nearest], more
        )

    async def rpc_store(self, request: StoreRequest, context: CallContext) -> StoreResponse:
        self._counters.served["store"] += 1
        if len(request.records) > MAX_RECORDS_PER_MESSAGE:
            raise WireError(f"more than {MAX_RECORDS_PER_MESSAGE} records in one store")
        self._heard_from(context.remote_peer_id, request.sender)
        # Quotas count by network, not identity (``peers.subnets``): identities are cheap.
        conn = self.peer.connection_to(context.remote_peer_id)
        source = source_group(conn and conn.remote_address, context.remote_peer_id)
        accepted = []
        now = self.clock()
        for wire in request.records:
            if not self._is_near(wire.key):
                self._counters.stores_refused_far += 1
                accepted.append(False)
                continue
            try:
                result = self.store_.store(record_from_wire(wire), source=source, now=now)
            except RecordError as e:
                logger.info("refused a record from %s: %s", context.remote_peer_id, e)
                accepted.append(False)
            else:
                accepted.append(result is StoreResult.ACCEPTED)
        return StoreResponse(accepted)

    # --- calling (call_*) --------------------------------------------------------

    async def _call(
        self, contact: Contact, protocol: str, request: object, response_type: type[T]
    ) -> T:
        name = protocol.split("/")[3]
        self._counters.sent[name] += 1
        self._remember_addrs(contact)
        try:
            response = await call_unary(
                self.peer,
                contact.peer_id,
                protocol,
                request,
                response_type,
                timeout=self.config.rpc_timeout,
                **_DHT_FRAMES,
            )
        except (PeersError, TimeoutError):
            self._counters.failed[name] += 1
            self.routing.record_failure(contact.peer_id, self._now())
            raise
        if contact.addrs:
            self._learn(contact)
        return response

    async def call_find_node(self, contact: Contact, target: NodeID) -> list[Contact]:
        response = await self._call(
            contact,
            FIND_NODE_PROTOCOL,
            FindNodeRequest(self._sender(), target.to_bytes(32, "big")),
            FindNodeResponse,
        )
        return contacts_from_wire(response.contacts)

    async def call_find_value(
        self, contact: Contact, key: bytes
    ) -> tuple[list[Record], list[Contact]]:
        """``contact``'s records under ``key`` (every page of them, at most
        ``MAX_FIND_VALUE_PAGES``) and the contacts it knows nearest to it."""
        records: list[Record] = []
        contacts: list[Contact] = []
        after: bytes | None = None
        for page in range(MAX_FIND_VALUE_PAGES):
            request = FindValueRequest(self._sender(), key, after)
            response = await self._call(contact, FIND_VALUE_PROTOCOL, request, FindValueResponse)
            if len(response.records) > MAX_RECORDS_PER_MESSAGE:
                raise WireError("too many records in one response")
            got = [record_from_wire(r) for r in response.records]
            records += got
            if page == 0:
                contacts = contacts_from_wire(response.contacts)
            last = got[-1].subkey if got else None
            # A page must move on: a server that says "more" without a later subkey
            # (an older or a hostile one) has said all it will.
            if not response.more or last is None or (after is not None and last <= after):
                break
            after = last
        return records, contacts

    async def call_store(self, contact: Contact, records: list[Record]) -> list[bool]:
        """Store ``records`` at ``contact``, in requests of at most
        ``MAX_STORE_REQUEST_BYTES`` and ``MAX_RECORDS_PER_MESSAGE`` records each; one
        accepted flag per record."""
        accepted: list[bool] = []
        for batch in _store_batches(records):
            response = await self._call(
                contact,
                STORE_PROTOCOL,
                StoreRequest(self._sender(), [record_to_wire(r) for r in batch]),
                StoreResponse,
            )
            if len(response.accepted) != len(batch):
                raise WireError("a store response must answer every record")
            accepted += response.accepted
        return accepted

    # --- lookups -----------------------------------------------------------------

    async def _run_lookup(
        self,
        target: NodeID,
        query: Callable[[Contact], Awaitable[list[Contact]]],
        num_closest: int | None = None,
        enough: Callable[[], bool] | None = None,
    ) -> DisjointLookup:
        """Drive a :class:`DisjointLookup` (``disjoint_paths`` paths): at most alpha
        queries in flight on each path, each bounded by
        ``rpc_timeout``, until the ``num_closest`` (default k) closest have answered
        (§2.3), or until ``enough()`` says so. Stores and gets converge on the
        ``num_replicas`` closest only: that is where records live, and it halves the
        requests of a lookup."""
        k = num_closest or self.config.k
        paths = self.config.disjoint_paths
        lookup = DisjointLookup(
            target,
            # Each path starts from its share of our nearest (S/Kademlia: k each).
            self.routing.nearest(target, paths * max(k, self.config.alpha)),
            paths=paths,
            local_peer_id=self.peer.peer_id,
            k=k,
            alpha=self.config.alpha,
            max_per_source=MAX_RESULTS_PER_SOURCE,
        )
        running: dict[asyncio.Task[list[Contact]], tuple[int, Contact]] = {}
        try:
            while not lookup.done and not (enough is not None and enough()):
                for path, contact in lookup.next_queries():
                    running[asyncio.ensure_future(query(contact))] = (path, contact)
                if not running:
                    break
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    path, contact = running.pop(task)
                    if task.exception() is None:
                        source = self._source_of(contact)  # the network it answered from
                        lookup.on_response(path, contact, task.result(), source=source)
                    else:
                        lookup.on_failure(path, contact)
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running)
        return lookup

    async def find_nearest(self, target: NodeID, count: int | None = None) -> list[Contact]:
        """The ``count`` (default k) closest live nodes to ``target`` (iterative FIND_NODE)."""
        lookup = await self._run_lookup(target, lambda c: self.call_find_node(c, target), count)
        return lookup.closest_responded()

    # --- the API -----------------------------------------------------------------

    async def store(
        self,
        key: str | bytes,
        value: object,
        expiration_time: float,
        *,
        subkey: str | bytes | None = None,
    ) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time`` (a wall-clock
        time on the DHT's :attr:`clock`, e.g. ``dht.clock() + 60``) at the closest replicas.

        If the key or subkey names us as owner (``records.owner_marker``), the record is
        signed. True if at least one replica (possibly this node) accepted it. Raises
        :class:`RecordError` if the record itself is invalid (too large, expired...).
        The record is republished every ``republish_interval`` until it expires.
        """
        record = Record(
            key=_as_key(key),
            subkey=None if subkey is None else _as_key(subkey),
            value=pack(value),
            expiration_time=float(expiration_time),
        )
        if owner_of(record.key, record.subkey) == self.peer.peer_id:
            record = record.sign(self.peer.identity)
        validate(record, self.clock())
        self._published[(record.key, record.subkey)] = _Published(record, self._now())
        return await self._store_record(record)

    async def _store_record(self, record: Record) -> bool:
        target = key_id(record.key)
        replicas = self.config.num_replicas
        # The store goes at once to the nearest we know, beside the lookup rather than
        # after it: where the routing table already holds the nearest nodes (a small or
        # settled swarm), the store takes one round trip instead of two. The lookup
        # still decides the replicas; a guess it did not confirm only holds a copy.
        early = {
            c.peer_id: asyncio.ensure_future(self.call_store(c, [record]))
            for c in self.routing.nearest(target, replicas)
        }
        try:
            lookup = await self._run_lookup(
                target, lambda c: self.call_find_node(c, target), replicas
            )
            # Each path's nearest (one path: Kademlia's replicas); the merged list would
            # be all ids ground near the key if an attacker had enough of them.
            nearest = lookup.closest_on_each_path()
            merged = lookup.closest_responded()
            accepted = 0
            if not self.client_mode and (
                len(merged) < replicas
                or distance(self.node_id, target) < distance(merged[-1].node_id, target)
            ):
                stored = self.store_.store(record, source=OWN_SOURCE, now=self.clock())
                if stored is StoreResult.ACCEPTED:
                    accepted += 1
            stores = [
                early.get(c.peer_id) or asyncio.ensure_future(self.call_store(c, [record]))
                for c in nearest
            ]
            results = await asyncio.gather(*stores, return_exceptions=True)
            accepted += sum(1 for r in results if isinstance(r, list) and r and r[0])
            return accepted > 0
        finally:
            # A guess the lookup did not confirm is left to finish on its own time only
            # while we wait for the replicas; then it is cancelled (bounded either way).
            for task in early.values():
                task.cancel()
            await asyncio.gather(*early.values(), return_exceptions=True)

    async def get(
        self, key: str | bytes, *, latest: bool = True
    ) -> ValueWithExpiration | dict[bytes, ValueWithExpiration] | None:
        """The value stored under ``key``: with ``latest`` (the default) the freshest
        among its closest nodes and ours; without, the first live value found (Kademlia's
        FIND_VALUE, which stops at the first node holding one: faster, possibly older).

        A plain value comes back as :class:`ValueWithExpiration`; a key holding subkeys
        as ``{subkey: ValueWithExpiration}``; ``None`` if nothing live is stored.
        Records from peers are validated (expiry, size, owner signatures) before use.
        """
        raw_key = _as_key(key)
        now = self.clock()
        best: dict[bytes | None, Record] = {}
        holders: dict[PeerID, set[bytes | None]] = {}

        def consider(records: Iterable[Record], holder: PeerID | None) -> None:
            for record in records:
                if record.key != raw_key:
                    continue
                try:
                    record = validate(record, now)
                except RecordError as e:
                    logger.info("dropping an invalid record from %s: %s", holder, e)
                    continue
                held = best.get(record.subkey)
                if held is None or record.expiration_time > held.expiration_time:
                    best[record.subkey] = record
                if holder is not None:
                    holders.setdefault(holder, set()).add(record.subkey)

        consider(self._records_for(raw_key, now), None)
        if best and not latest:
            return self._as_result(best)

        async def query(contact: Contact) -> list[Contact]:
            records, closer = await self.call_find_value(contact, raw_key)
            consider(records, contact.peer_id)
            return closer

        enough = None if latest else (lambda: bool(best))
        lookup = await self._run_lookup(key_id(raw_key), query, self.config.num_replicas, enough)
        if not best and self.config.k > self.config.num_replicas:
            # Nothing at the replicas' place: look wider before answering "absent" (a
            # store made while the swarm was forming may sit a little off its place).
            lookup = await self._run_lookup(key_id(raw_key), query)
        if not best:
            return None
        await self._cache_along_path(lookup, best, holders)
        return self._as_result(best)

    @staticmethod
    def _as_result(
        best: dict[bytes | None, Record],
    ) -> ValueWithExpiration | dict[bytes, ValueWithExpiration] | None:
        entries: dict[bytes | None, ValueWithExpiration] = {}
        for s, r in best.items():
            try:
                entries[s] = ValueWithExpiration(unpack(r.value), r.expiration_time)
            except SerializationError:
                # One undecodable record (any peer may store under a shared key) must not
                # hide the others under that key; it is skipped.
                logger.info("skipping an undecodable value under subkey %r", s)
        if not entries:
            return None
        if list(entries) == [None]:
            return entries[None]
        return {s: v for s, v in entries.items() if s is not None}

    async def _cache_along_path(
        self,
        lookup: DisjointLookup,
        best: dict[bytes | None, Record],
        holders: dict[PeerID, set[bytes | None]],
    ) -> None:
        """§2.3: store the value at the closest node that answered without it."""
        for contact in lookup.closest_responded():
            missing = [
                r
                for s, r in best.items()
                if r.expiration_time > 0 and s not in holders.get(contact.peer_id, set())
            ]
            if missing:
                with contextlib.suppress(PeersError, TimeoutError):
                    await self.call_store(contact, missing)
                return

    def statistics(self) -> DHTStatistics:
        return DHTStatistics(
            num_contacts=len(self.routing),
            num_records=len(self.store_),
            client_mode=self.client_mode,
            rpcs_served=dict(self._counters.served),
            rpcs_sent=dict(self._counters.sent),
            rpcs_failed=dict(self._counters.failed),
            num_stores_refused_far=self._counters.stores_refused_far,
            num_contacts_refused_by_source=self.routing.num_refused_by_source,
        )


def _store_batches(records: list[Record]) -> list[list[Record]]:
    """``records`` in order, cut into store requests of bounded size."""
    batches: list[list[Record]] = []
    size = 0
    for record in records:
        cost = record_cost(record)
        if not batches or size + cost > MAX_STORE_REQUEST_BYTES:
            batches.append([])
            size = 0
        if len(batches[-1]) >= MAX_RECORDS_PER_MESSAGE:
            batches.append([])
            size = 0
        batches[-1].append(record)
        size += cost
    return batches


def _page(records: list[Record], after: bytes | None) -> tuple[list[Record], bool]:
    """One find-value reply's records: the plain value (first page only), then subkeys
    in order after ``after``, up to ``MAX_REPLY_RECORD_BYTES`` (at least one); and
    whether any are left."""
    plain = [r for r in records if r.subkey is None] if after is None else []
    keyed = sorted(
        (r for r in records if r.subkey is not None and (after is None or r.subkey > after)),
        key=lambda r: r.subkey or b"",
    )
    page: list[Record] = []
    size = 0
    candidates = [*plain, *keyed]
    for record in candidates:
        cost = record_wire_bytes(record)
        if page and (size + cost > MAX_REPLY_RECORD_BYTES or len(page) >= MAX_RECORDS_PER_MESSAGE):
            break
        page.append(record)
        size += cost
    return page, len(page) < len(candidates)
