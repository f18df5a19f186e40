"""Matchmaking through the DHT: peers that want to average under the same key form
groups, with no coordinator.

:class:`Matchmaker` is the asyncio edge around the pure
:class:`~averaging.matchmaking.search.GroupSearch` (the protocol is described there and
in docs/averaging-matchmaking.md): it stores the declaration, reads the key, makes and
serves the join calls, and enforces the deadline. Use it as ``async with
Matchmaker(dht, config) as matchmaker`` and call :meth:`Matchmaker.look_for_group`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic

from averaging.matchmaking.records import (
    DHT_KEY_PREFIX,
    JOIN_PROTOCOL,
    MAX_BANDWIDTH,
    MAX_GROUP_KEY_BYTES,
    MAX_GROUP_SIZE,
    MAX_JOIN_REQUEST_BYTES,
    MAX_JOIN_RESPONSE_BYTES,
    MAX_METADATA_BYTES,
    MAX_PENDING_JOINS,
    Candidate,
    Declaration,
    Group,
    JoinRequest,
    JoinResponse,
    JoinStatus,
    MatchmakingConfig,
    MatchmakingError,
    MemberInfo,
    candidate_from_wire,
    check_addrs,
    check_member_fields,
    group_from_wire,
    group_to_wire,
    member_to_wire,
    peer_id_from_wire,
)
from averaging.matchmaking.search import (
    Failed,
    Formed,
    GroupSearch,
    Join,
    JoinAnswer,
    Placed,
    Poll,
    Redirect,
    Refused,
    Rejected,
)
from peers.addresses import parse_multiaddr, split_peer_id
from peers.dht.node import DHT, ValueWithExpiration
from peers.dht.protocol import MAX_ADDR_CHARS, MAX_CONTACT_ADDRS
from peers.dht.records import RecordError, owner_marker, owner_of
from peers.errors import PeersError
from peers.identity import PeerID
from peers.rpc import CallContext, call_unary
from peers.service import Service
from peers.stream_api import ReachableHostT
from peers.wire import WireError, from_wire, to_wire

logger = logging.getLogger(__name__)


#: Keys whose finished groups we remember, so that a late joiner learns who is already
#: placed (and stops trying them) instead of only "not searching". A peer runs one or a
#: few searches at a time; 256 covers minutes of gossip rounds.
MAX_RECENT_KEYS = 256
#: Longest refusal or rejection text kept from a remote.
MAX_REASON_CHARS = 1024
#: Shortest time a DHT read is given, even close to a deadline (a read cut shorter
#: than this cannot finish, and the deadline is enforced around it anyway).
MIN_OPERATION_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class MatchmakingStatistics:
    num_searches: int
    num_groups_formed: int
    num_failures: int
    num_joins_served: int
    num_joins_held: int
    """Joins held right now, over every search in progress."""


@dataclass
class _Active:
    search: GroupSearch
    waiters: dict[PeerID, asyncio.Future[JoinAnswer]] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Counters:
    searches: int = 0
    formed: int = 0
    failures: int = 0
    joins_served: int = 0


def dht_key(key: str) -> bytes:
    return (DHT_KEY_PREFIX + key).encode()


def check_key(key: str) -> None:
    """Raises ValueError for a key that cannot be searched under (our caller's fault)."""
    if not isinstance(key, str) or not key:
        raise ValueError("a matchmaking key is a non-empty str")
    if len(key.encode()) > MAX_GROUP_KEY_BYTES:
        raise ValueError(f"a matchmaking key has at most {MAX_GROUP_KEY_BYTES} bytes")
    if "[owner:" in key:
        raise ValueError("a matchmaking key cannot name an owner")


def parse_declarations(
    key: str, found: ValueWithExpiration | dict[bytes, ValueWithExpiration] | None
) -> list[Candidate]:
    """Declarations under ``key`` as candidates. Only subkeys that are exactly an owner
    marker count (the DHT checked the owner's signature, so nobody can declare for
    someone else); values that do not parse are skipped (their owner's fault)."""
    if not isinstance(found, dict):
        return []
    raw_key = dht_key(key)
    out = []
    for subkey, entry in found.items():
        try:
            owner = owner_of(raw_key, subkey)
            if owner is None or subkey != owner_marker(owner):
                continue
            declaration = from_wire(Declaration, entry.value)
            addrs = check_addrs(declaration.addrs)
        except (RecordError, WireError) as e:
            logger.debug("skipping a declaration under %r: %s", key, e)
            continue
        out.append(Candidate(owner, addrs, declaration.client_mode))
    return out


def _expected_candidates(expected: Mapping[PeerID, Sequence[str]]) -> list[Candidate]:
    """Expected peers as candidates (a peer without addresses cannot lead). Addresses
    come from other peers' records: malformed ones drop that peer's entry."""
    out = []
    for peer_id, addrs in list(expected.items())[:MAX_GROUP_SIZE]:
        if not isinstance(peer_id, PeerID) or not isinstance(addrs, Sequence):
            continue
        if isinstance(addrs, str) or not all(isinstance(a, str) for a in addrs):
            continue
        try:
            checked = check_addrs(list(addrs))
        except WireError:
            continue
        out.append(Candidate(peer_id, checked, client_mode=not checked))
    return out


def _following(search: GroupSearch, leader: PeerID) -> bool:
    return search.leader is not None and search.leader.peer_id == leader


def answer_to_wire(answer: JoinAnswer) -> JoinResponse:
    if isinstance(answer, Placed):
        return group_to_wire(answer.group)
    if isinstance(answer, Redirect):
        to = answer.to
        return JoinResponse(
            JoinStatus.REDIRECT.value,
            members=[member_to_wire(MemberInfo(to.peer_id, to.addrs, to.client_mode, 0.0, b""))],
        )
    if isinstance(answer, Refused):
        return JoinResponse(
            (JoinStatus.NOT_SEARCHING if answer.not_searching else JoinStatus.REFUSED).value,
            reason=answer.reason,
            finished=[p.to_bytes() for p in answer.finished],
        )
    return JoinResponse(JoinStatus.REJECTED.value, reason=answer.reason)


def answer_from_wire(key: str, response: JoinResponse) -> JoinAnswer:
    """Decode a leader's answer; raises :class:`WireError` if it is malformed."""
    try:
        status = JoinStatus(response.status)
    except ValueError as e:
        raise WireError(f"unknown join status {response.status[:64]!r}") from e
    reason = response.reason[:MAX_REASON_CHARS]
    if status is JoinStatus.PLACED:
        return Placed(group_from_wire(key, response))
    if status is JoinStatus.REDIRECT:
        if len(response.members) != 1:
            raise WireError("a redirect names exactly one peer")
        return Redirect(candidate_from_wire(response.members[0]))
    if status is JoinStatus.REFUSED:
        if len(response.finished) > MAX_PENDING_JOINS + 1:
            raise WireError("a refusal lists more peers than a leader can place")
        return Refused(reason, tuple(peer_id_from_wire(p) for p in response.finished))
    if status is JoinStatus.NOT_SEARCHING:
        return Refused(reason, not_searching=True)
    return Rejected(reason)


class Matchmaker(Service, Generic[ReachableHostT]):
    """Forms averaging groups through ``dht``. Use ``async with Matchmaker(dht)``.

    Entering registers the join handler on the DHT's peer; leaving removes it and
    refuses the joins still held. Searches run in their callers' tasks.
    """

    def __init__(self, dht: DHT[ReachableHostT], config: MatchmakingConfig | None = None) -> None:
        super().__init__()
        self.dht = dht
        self.peer: ReachableHostT = dht.peer
        self.config = config or MatchmakingConfig()
        self._searches: dict[str, _Active] = {}
        self._recent: OrderedDict[str, tuple[PeerID, ...]] = OrderedDict()
        self._counters = _Counters()
        self._open = False

    async def _start(self) -> None:
        self._serve_unary(
            self.peer,
            JOIN_PROTOCOL,
            self.rpc_join,
            JoinRequest,
            max_frame_bytes=MAX_JOIN_REQUEST_BYTES,
        )
        self._open = True

    async def _stop(self) -> None:
        self._open = False
        for active in self._searches.values():
            self._release(active, "the matchmaker is closing")

    def _reachable(self) -> bool:
        """Whether others can send us work: we are no DHT client, or we are behind a NAT
        that hole punching gets through (reached through a relay, then directly)."""
        return not self.dht.client_mode or self.peer.nat.punchable

    def contact(self) -> tuple[str, ...]:
        """Where others reach this peer's searches: the addresses its declarations carry,
        empty when it cannot lead (nobody can dial it). A caller that tells others of its
        coming searches (a training swarm's progress record) publishes these, and they
        pass them back as ``expected``."""
        return self._my_addrs()

    def _my_addrs(self) -> tuple[str, ...]:
        if not self._reachable():
            return ()
        # Relayed addresses after the direct ones: a peer behind NAT is dialed there.
        addrs = [str(split_peer_id(a)[0]) for a in self.peer.advertised_addrs]
        # One address too long for the wire would make the whole declaration (and the
        # progress record carrying it) unreadable: it is left out, as the DHT does.
        return tuple([a for a in addrs if len(a) <= MAX_ADDR_CHARS][:MAX_CONTACT_ADDRS])

    # --- searching ----------------------------------------------------------------

    async def look_for_group(
        self,
        key: str,
        *,
        bandwidth: float = 1.0,
        metadata: bytes = b"",
        timeout: float | None = None,
        target_group_size: int | None = None,
        expected: Mapping[PeerID, Sequence[str]] | None = None,
    ) -> Group:
        """Find a group among the peers searching under ``key`` now.

        ``bandwidth`` is this peer's relative weight (its share of a butterfly round's
        reduction); ``metadata`` travels to every member as ``Group.metadata[i]``.
        ``target_group_size`` overrides the config's for this search (e.g. the number of
        peers a training swarm expects). ``expected`` maps peers known to search under
        ``key`` now or shortly to their :meth:`contact` addresses (empty: it cannot
        lead), as a training swarm's progress records say: they count as declared
        before any read of the key, so with the whole group expected the search joins
        its leader at once. Entries with malformed addresses are skipped (their
        declarations still count). Returns within ``timeout`` seconds (default
        ``config.search_timeout``), or raises
        :class:`MatchmakingError` saying why no group was formed (too few peers, left
        over, a leader that vanished). Raises ValueError for a bad argument or a search
        under ``key`` already running here. Cancelling the call stops the search and
        answers the joins it held with a refusal.
        """
        if not self._open:
            raise ValueError("use the Matchmaker inside `async with`")
        check_key(key)
        if not isinstance(metadata, bytes) or len(metadata) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata must be bytes, at most {MAX_METADATA_BYTES}")
        if not isinstance(bandwidth, int | float) or not 0 <= bandwidth <= MAX_BANDWIDTH:
            raise ValueError(f"bandwidth must be a number in [0, {MAX_BANDWIDTH}]")
        timeout = self.config.search_timeout if timeout is None else timeout
        if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError("timeout must be a positive number of seconds")
        if key in self._searches:
            raise ValueError(f"already looking for a group under key {key!r}")
        loop = asyncio.get_running_loop()
        client_mode = not self._reachable()
        me = MemberInfo(
            self.peer.peer_id, self._my_addrs(), client_mode, float(bandwidth), metadata
        )
        config = self.config
        if target_group_size is not None:  # validated by the config
            size = min(target_group_size, MAX_GROUP_SIZE)
            config = dataclasses.replace(
                config, target_group_size=size, min_group_size=min(config.min_group_size, size)
            )
        search = GroupSearch(
            key=key,
            me=me,
            config=config,
            now=loop.time(),
            timeout=timeout,
            expected=_expected_candidates(expected or {}),
        )
        active = _Active(search)
        self._searches[key] = active
        self._counters.searches += 1
        try:
            try:
                async with asyncio.timeout_at(search.deadline):
                    group = await self._declare_and_drive(search, active)
            except TimeoutError:  # the deadline struck inside a DHT operation or a call
                action = search.next_action(max(loop.time(), search.deadline))
                if not isinstance(action, Formed):
                    assert isinstance(action, Failed)
                    raise MatchmakingError(f"no group under key {key!r}: {action.reason}") from None
                group = action.group
        except MatchmakingError:
            self._counters.failures += 1
            raise
        finally:
            del self._searches[key]
            self._release(active, "stopped searching")
            if search.placed:
                self._recent[key] = search.placed
                while len(self._recent) > MAX_RECENT_KEYS:
                    self._recent.popitem(last=False)
        self._counters.formed += 1
        for i, member in enumerate(group.members):
            if member != self.peer.peer_id:
                self._remember_addrs(member, group.addrs[i])
        return group

    async def _declare_and_drive(self, search: GroupSearch, active: _Active) -> Group:
        """Store our declaration, and search: the search waits for the store at most half
        a poll interval (a store is a lookup and then the store itself, two round trips,
        and the search needs neither to read the key and join a leader, who learns of
        us by our join), then runs beside it. Stored before our first read, the
        declarations of peers that start together are all there when each reads: at
        once concurrent, the first reads missed them and the group formed a poll
        interval later (docs/averaging-matchmaking.md). Once the search ends, a store still
        under way is abandoned (we are placed)."""
        declaring = asyncio.create_task(self._declare(search))
        try:
            # A store that is quick (loopback, a LAN, most internet links) lands before our
            # first read, so peers that start together see each other at once; waiting
            # for a slow one would cost its two round trips, and the search goes ahead.
            await asyncio.wait([declaring], timeout=self.config.poll_interval_seconds / 2)
            return await self._drive(active)
        finally:
            declaring.cancel()
            await asyncio.wait([declaring])

    async def _declare(self, search: GroupSearch) -> None:
        """Store our declaration until the search's deadline. A failed store is not
        fatal: we can still see and join others, who then learn of us by our join."""
        loop = asyncio.get_running_loop()
        me = search.me
        value = to_wire(Declaration(list(me.addrs), me.client_mode))
        expiration = self.dht.clock() + (search.deadline - loop.time())
        try:
            async with asyncio.timeout(self.config.request_timeout):
                stored = await self.dht.store(
                    dht_key(search.key), value, expiration, subkey=owner_marker(me.peer_id)
                )
            if not stored:
                logger.info("no DHT replica accepted our declaration under %r", search.key)
        except (PeersError, TimeoutError) as e:
            logger.info("declaring under %r failed: %r", search.key, e)

    async def _drive(self, active: _Active) -> Group:
        search = active.search
        loop = asyncio.get_running_loop()
        while True:
            active.wake.clear()  # before deciding: a join arriving after it wakes us
            action = search.next_action(loop.time())
            self._deliver(active)
            if isinstance(action, Formed):
                return action.group
            if isinstance(action, Failed):
                raise MatchmakingError(f"no group under key {search.key!r}: {action.reason}")
            if isinstance(action, Poll):
                await self._poll(search, action.until)
            elif isinstance(action, Join):
                await self._join(search, action.leader)
            else:
                delay = action.until - loop.time()
                if delay > 0:
                    try:
                        async with asyncio.timeout(delay):
                            await active.wake.wait()
                    except TimeoutError:
                        pass
            self._deliver(active)

    async def _poll(self, search: GroupSearch, until: float) -> None:
        loop = asyncio.get_running_loop()
        budget = max(MIN_OPERATION_SECONDS, min(self.config.request_timeout, until - loop.time()))
        try:
            async with asyncio.timeout(budget):
                found = await self.dht.get(dht_key(search.key), latest=True)
        except (PeersError, TimeoutError) as e:
            search.on_poll_failed(loop.time(), repr(e))
            return
        search.on_declarations(parse_declarations(search.key, found), loop.time())

    async def _join(self, search: GroupSearch, leader: Candidate) -> None:
        loop = asyncio.get_running_loop()
        self._remember_addrs(leader.peer_id, leader.addrs)
        me = search.me
        request = JoinRequest(
            search.key,
            list(me.addrs),
            me.client_mode,
            me.bandwidth,
            me.metadata,
            search.config.target_group_size,
        )
        call = asyncio.ensure_future(
            call_unary(
                self.peer,
                leader.peer_id,
                JOIN_PROTOCOL,
                request,
                JoinResponse,
                timeout=max(MIN_OPERATION_SECONDS, search.deadline - loop.time()),
                max_frame_bytes=MAX_JOIN_RESPONSE_BYTES,
            )
        )
        try:
            if not search.confirmed(leader.peer_id):
                await self._confirm_during(search, leader.peer_id, call)
                if not call.done() and not _following(search, leader.peer_id):
                    return  # given up, or a read changed the leader: `finally` hangs up
            response = await call
            answer = answer_from_wire(search.key, response)
        except (PeersError, TimeoutError) as e:
            search.on_join_result(leader.peer_id, None, loop.time(), str(e) or type(e).__name__)
            return
        finally:
            call.cancel()
        search.on_join_result(leader.peer_id, answer, loop.time())

    async def _confirm_during(
        self, search: GroupSearch, leader: PeerID, call: asyncio.Future[JoinResponse]
    ) -> None:
        """Our join went to a leader we only expect (a record said it comes), not one we
        saw searching: read the key while the join is out, until the join is answered,
        a read shows the leader's declaration, or the search follows someone else. Past
        the gather window, after at least one read during this join, the leader is
        given up (:meth:`GroupSearch.on_leader_unconfirmed`): an expected peer that went
        silent (died, cut off) would otherwise hold the join until the search's end."""
        loop = asyncio.get_running_loop()
        reads = 0
        while not call.done() and _following(search, leader) and not search.confirmed(leader):
            if reads and loop.time() >= search.gather_deadline:
                search.on_leader_unconfirmed(leader, loop.time())
                return
            read = asyncio.ensure_future(self._poll(search, search.deadline))
            pending: list[asyncio.Future[object]] = [call, read]  # type: ignore[list-item]
            try:
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            finally:
                read.cancel()
                await asyncio.wait([read])  # (_poll turns a failed read into on_poll_failed)
            error = None if read.cancelled() else read.exception()
            if error is not None:
                raise error  # a bug in the read, not a failed read: not ours to hide
            reads += 1
            if not call.done() and _following(search, leader) and not search.confirmed(leader):
                pause = min(
                    self.config.poll_interval_seconds,
                    max(0.0, search.gather_deadline - loop.time()),
                )
                await asyncio.wait([call], timeout=pause)

    def _deliver(self, active: _Active) -> None:
        for peer_id, answer in active.search.take_answers():
            waiter = active.waiters.pop(peer_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(answer)

    def _release(self, active: _Active, reason: str) -> None:
        """Answer every join still held by a search that is ending."""
        self._deliver(active)
        for waiter in active.waiters.values():
            if not waiter.done():
                waiter.set_result(Refused(f"{reason} under key {active.search.key!r}"))
        active.waiters.clear()

    def _remember_addrs(self, peer_id: PeerID, addrs: tuple[str, ...]) -> None:
        """Tell the peer's address book where ``peer_id`` is; one bad address costs
        only itself."""
        good = []
        for addr in addrs:
            try:
                good.append(split_peer_id(parse_multiaddr(addr))[0])
            except PeersError:
                continue
        if good:
            self.peer.add_addresses(peer_id, good)

    # --- serving ------------------------------------------------------------------

    async def rpc_join(self, request: JoinRequest, context: CallContext) -> JoinResponse:
        """A peer asks to join our group under ``request.key``: answered at once (a
        redirect or a refusal), or held until we form the groups. Raises
        :class:`WireError` (the caller's fault) for a malformed request."""
        self._counters.joins_served += 1
        if len(request.key.encode()) > MAX_GROUP_KEY_BYTES:
            raise WireError(f"a matchmaking key has at most {MAX_GROUP_KEY_BYTES} bytes")
        addrs = check_member_fields(
            request.addrs, request.client_mode, request.bandwidth, request.metadata
        )
        peer_id = context.remote_peer_id
        member = MemberInfo(
            peer_id, addrs, request.client_mode, request.bandwidth, request.metadata
        )
        active = self._searches.get(request.key)
        if active is None:
            placed = self._recent.get(request.key)
            if placed is not None:
                reason = f"already formed groups under key {request.key!r}"
                return answer_to_wire(Refused(reason, placed))
            return answer_to_wire(
                Refused(f"not looking for a group under key {request.key!r}", not_searching=True)
            )
        loop = asyncio.get_running_loop()
        expected = request.expected_size if 0 < request.expected_size <= MAX_GROUP_SIZE else 0
        answer = active.search.on_join(member, loop.time(), context.timeout, expected)
        if answer is None:
            previous = active.waiters.pop(peer_id, None)
            if previous is not None and not previous.done():
                previous.set_result(Refused("superseded by a newer join from the same peer"))
            waiter: asyncio.Future[JoinAnswer] = loop.create_future()
            active.waiters[peer_id] = waiter
            active.wake.set()
            try:
                answer = await waiter
            finally:
                if not waiter.done():  # the caller hung up, or the deadline struck
                    waiter.cancel()
                    if active.waiters.get(peer_id) is waiter:
                        del active.waiters[peer_id]
                        active.search.on_join_abandoned(peer_id, loop.time())
                        active.wake.set()
        return answer_to_wire(answer)

    def statistics(self) -> MatchmakingStatistics:
        return MatchmakingStatistics(
            num_searches=self._counters.searches,
            num_groups_formed=self._counters.formed,
            num_failures=self._counters.failures,
            num_joins_served=self._counters.joins_served,
            num_joins_held=sum(a.search.num_held for a in self._searches.values()),
        )
