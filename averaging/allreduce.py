"""The networked butterfly all-reduce: moves a :class:`~averaging.butterfly.ButterflyRound`'s
chunks between real peers and turns its deadlines into failures.

One stream links each pair of members (``allreduce_wire.link_opener``); every message
between the two travels on it, both ways. A writer task per link encodes what the round
has for that member just before it goes out (memory stays at one chunk per link); a
reader task per link decodes what arrives and feeds the state machine, which reduces
each chunk as it arrives, so reduction overlaps the transfer of the next chunks.

Failures (DESIGN.md, averaging): a link that breaks, or a member silent past
``sender_timeout`` (as a sender) or ``reducer_timeout`` (as a reducer), is excluded;
the state machine reassigns its parts, and every exclusion is told to every member,
the excluded one included (it withdraws rather than exclude us in return). A link is
never reset on exclusion, for the same reason.

Agreement: survivors hold identical tensors when they end with the same failure set.
So a peer holding every part sends each member a :class:`DoneMessage` (its result's
fingerprint and failure set) and returns once every live member has sent a matching
one; a notice that arrives meanwhile reopens the round. A member whose link breaks after
this peer is done is no longer waited for (it sent everything it had to). At
``round_timeout`` whatever is missing is left at the peer's own value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from averaging.allreduce_config import (
    AllReduceConfig,
    AllReduceError,
    AllReduceResult,
    TransferStatistics,
)
from averaging.allreduce_wire import (
    ALLREDUCE_PROTOCOL,
    AveragedMessage,
    ChunkMessage,
    DoneMessage,
    Message,
    NoticeMessage,
    decode_message,
    encode_hello,
    encode_message,
    link_opener,
    peer_ids,
)
from averaging.butterfly import ButterflyRound
from averaging.butterfly_records import (
    Outgoing,
    PartReady,
    PartReassigned,
    PeerExcluded,
    RoundEvent,
    RoundResult,
    RoundSpec,
    Withdrawn,
)
from averaging.compression import EncodedTensor, EncodeError, NoneCodec, decode_tensor
from averaging.partition import chunk_ranges
from peers.connection import Stream
from peers.errors import PeersError, RemoteProtocolError
from peers.host import Peer
from peers.identity import PeerID
from peers.rpc import FramedStream
from peers.serialization import frame_buffers

logger = logging.getLogger(__name__)

#: Seconds a finished round waits for its writers to flush what they hold (its Done, a
#: late averaged chunk) before closing the links; bounded by ``round_timeout`` too.
FLUSH_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class _AveragedRef:
    to: PeerID
    part_index: int
    chunk_index: int
    contributors: frozenset[PeerID]


_Item = Outgoing | _AveragedRef | NoticeMessage | DoneMessage


@dataclass(eq=False)
class _Link:
    peer_id: PeerID
    opened_by_me: bool
    framed: FramedStream | None = None
    outbox: deque[_Item] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    dead: bool = False
    ignored: bool = False
    writer: asyncio.Task[None] | None = None

    def send(self, item: _Item) -> None:
        if not self.dead and not self.finished.is_set():
            self.outbox.append(item)
            self.wake.set()


class RoundRunner:
    """Runs one round at one peer. Built by :class:`AllReduceService.run_round`."""

    def __init__(
        self,
        peer: Peer,
        spec: RoundSpec,
        local: torch.Tensor,
        weight: float,
        config: AllReduceConfig,
    ) -> None:
        self.peer = peer
        self.spec = spec
        self.config = config
        self.round = ButterflyRound(spec, local, weight)
        self._me = spec.me
        reachable = {m: w > 0 for m, w in zip(spec.members, spec.weights, strict=True)}
        self.links: dict[PeerID, _Link] = {}
        for m in spec.members:
            opener = link_opener(self._me, reachable[self._me], m, reachable[m])
            if m != self._me and opener is not None:
                self.links[m] = _Link(m, opener == self._me)
        self._changed = asyncio.Event()
        self._started = time.monotonic()
        self._last_heard = dict.fromkeys(spec.members, self._started)
        self._encoded: dict[int, list[EncodedTensor]] = {}
        self._done_from: dict[PeerID, tuple[bytes, frozenset[PeerID]]] = {}
        self._departed: set[PeerID] = set()
        self._my_done: tuple[bytes, frozenset[PeerID]] | None = None
        self._result: RoundResult | None = None
        self._bytes_sent = 0
        self._bytes_received = 0
        self._tasks: asyncio.TaskGroup | None = None
        self._link_tasks: list[asyncio.Task[None]] = []

    # --- the round --------------------------------------------------------------------

    async def run(self) -> AllReduceResult:
        deadline = self._started + self.config.round_timeout
        agreed = False
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            for link in self.links.values():
                if link.opened_by_me:
                    self._link_tasks.append(tasks.create_task(self._open(link)))
            self._handle(self._initial_events())
            try:
                agreed = await self._drive(deadline)
            finally:
                await self._close_links()
        if not agreed or self._result is None:
            # What was announced may predate a late exclusion that reopened the round
            # (then settled at the deadline): report the round as it ended.
            self._result = self.round.result()
        # Drop what the round held (chunks, encodings, links) now rather than when the
        # cyclic garbage collector gets to it: a 64M-element round holds gigabytes.
        self._encoded.clear()
        self._link_tasks.clear()
        self.links.clear()
        transfer = TransferStatistics(
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            seconds=time.monotonic() - self._started,
            # Alone (everyone else failed) is no agreement: nothing was averaged.
            agreed=agreed
            and not self.round.excluded_by
            and len(self.round.failed) < len(self.spec.members) - 1,
        )
        return AllReduceResult(self._result, transfer)

    def _initial_events(self) -> list[RoundEvent]:
        for item in self.round.outgoing_chunks():
            self.links[item.to].send(item)
        # A member whose only part is mine, or a one-member round, may be final at once.
        return [PartReady(i) for i in sorted(self.round.ready_parts())]

    async def _drive(self, deadline: float) -> bool:
        """Until agreement or the deadline: check stalls, announce Done, wait."""
        while True:
            self._changed.clear()
            now = time.monotonic()
            if self.round.excluded_by:
                return False
            if not self.round.is_done():
                self._my_done = None
                self._fail_dead_links()
                self._fail_stalled(now)
            if self.round.is_done() and not self.round.excluded_by:
                if self._my_done is None:
                    self._announce_done()
                if self._agreed():
                    return True
            if now >= deadline:
                self._give_up()
                return False
            timeout = min(deadline, self._next_stall_check(now)) - now
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(timeout, 0.0)):
                    await self._changed.wait()

    def _fail_dead_links(self) -> None:
        for m in self._departed:
            if m not in self.round.failed:
                self._handle(self.round.on_reducer_failed(m, "link closed"))
        self._departed.clear()

    def _fail_stalled(self, now: float) -> None:
        for m in self.round.missing_senders():
            if now - self._last_heard[m] >= self.config.sender_timeout:
                self._handle(self.round.on_sender_failed(m, "stalled as a sender"))
        for m in self.round.missing_reducers():
            if now - self._last_heard[m] >= self.config.reducer_timeout:
                self._handle(self.round.on_reducer_failed(m, "stalled as a reducer"))

    def _next_stall_check(self, now: float) -> float:
        checks = [now + 3600.0]
        for m in self.round.missing_senders():
            checks.append(self._last_heard[m] + self.config.sender_timeout)
        for m in self.round.missing_reducers():
            checks.append(self._last_heard[m] + self.config.reducer_timeout)
        return min(checks)

    def _announce_done(self) -> None:
        self._result = self.round.result()
        failed = frozenset(self.round.failed)
        self._my_done = (self._result.fingerprint(), failed)
        message = DoneMessage(self._my_done[0], sorted(m.to_bytes() for m in failed))
        for m, link in self.links.items():
            if m not in failed:
                link.send(message)

    def _agreed(self) -> bool:
        failed = self.round.failed
        return all(
            self._done_from.get(m) == self._my_done
            for m in self.links
            if m not in failed and m not in self._departed
        )

    def _give_up(self) -> None:
        """At the deadline: exclude senders my parts still lack, leave undelivered parts
        at my own value."""
        if self.round.is_done() or self.round.excluded_by:
            return
        self._handle(self.round.give_up("still missing at the round deadline"))

    # --- events from the state machine ------------------------------------------------

    def _handle(self, events: list[RoundEvent]) -> None:
        for event in events:
            if isinstance(event, PartReady):
                self._publish(event.part_index)
            elif isinstance(event, PeerExcluded):
                logger.info("round %s: excluded %s: %s", self._tag, event.peer, event.reason)
                link = self.links.get(event.peer)
                if link is not None:
                    link.ignored = True
                notice = NoticeMessage([event.peer.to_bytes()])
                for m, other in self.links.items():
                    if m not in self.round.failed or m == event.peer:
                        other.send(notice)
            elif isinstance(event, PartReassigned):
                now = time.monotonic()
                if event.new_reducer == self._me:
                    self._last_heard = dict.fromkeys(self._last_heard, now)
                else:
                    self._last_heard[event.new_reducer] = now
                    for item in event.outgoing:
                        self.links[item.to].send(item)
            elif isinstance(event, Withdrawn):
                logger.info("round %s: withdrew, excluded by %s", self._tag, event.excluded_by)
        self._changed.set()

    @property
    def _tag(self) -> str:
        return self.spec.round_id.hex()[:8]

    def _publish(self, part_index: int) -> None:
        part = self.round.reduced_part(part_index)
        codec = self.config.codec
        encoded = []
        for start, end in chunk_ranges(part.start, part.end, self.spec.chunk_elements):
            encoded.append(self._encode_values(part.values[start - part.start : end - part.start]))
        if codec.name != "none":  # hold what the receivers will decode (results identical)
            decoded = torch.cat([decode_tensor(e).to(torch.float32) for e in encoded])
            self.round.set_published_part(part_index, decoded)
        self._encoded[part_index] = encoded
        for item in self.round.published_chunks(part_index):
            ref = _AveragedRef(item.to, item.part_index, item.chunk_index, item.contributors)
            self.links[item.to].send(ref)

    # --- messages from members --------------------------------------------------------

    def _receive(self, sender: PeerID, message: Message) -> None:
        round_id = self.spec.round_id
        if isinstance(message, ChunkMessage):
            values = _decode(message.tensor)
            self._handle(
                self.round.on_chunk(
                    sender,
                    round_id,
                    message.part_index,
                    message.chunk_index,
                    values,
                    message.weight,
                )
            )
        elif isinstance(message, AveragedMessage):
            values = _decode(message.tensor)
            contributors = peer_ids(message.contributors)
            self._handle(
                self.round.on_averaged_chunk(
                    sender,
                    round_id,
                    message.part_index,
                    message.chunk_index,
                    values,
                    contributors,
                )
            )
        elif isinstance(message, NoticeMessage):
            excluded = peer_ids(message.excluded)
            self._handle(self.round.on_exclusion_notice(sender, round_id, excluded))
        else:
            self._done_from[sender] = (message.fingerprint, peer_ids(message.failed))
            self._changed.set()

    def _link_failed(self, link: _Link, error: BaseException) -> None:
        if link.dead:
            return
        link.dead = True
        link.wake.set()
        if link.peer_id in self.round.failed or self.round.excluded_by:
            return
        logger.info("round %s: link to %s failed: %r", self._tag, link.peer_id, error)
        if self.round.is_done():
            self._departed.add(link.peer_id)  # it sent what it had to; do not wait for it
        else:
            self._handle(self.round.on_reducer_failed(link.peer_id, f"link failed: {error!r}"))
        self._changed.set()

    # --- links ------------------------------------------------------------------------

    async def _open(self, link: _Link) -> None:
        try:
            stream = await self.peer.new_stream(link.peer_id, ALLREDUCE_PROTOCOL)
            framed = FramedStream(stream)
            await framed.write_frame(encode_hello(self.spec.round_id))
        except (PeersError, OSError) as e:
            self._link_failed(link, e)
            return
        self._attach(link, framed)

    async def accept(self, remote: PeerID, framed: FramedStream) -> None:
        """Serve a link another member opened; returns when the round is done with it.
        Raises :class:`AllReduceError` for a remote that should not open one."""
        link = self.links.get(remote)
        if link is None or link.opened_by_me or link.framed is not None or link.dead:
            raise AllReduceError(f"{remote} does not open a link to this peer in this round")
        self._attach(link, framed)
        await link.finished.wait()

    def _attach(self, link: _Link, framed: FramedStream) -> None:
        assert self._tasks is not None
        if link.finished.is_set():  # the round ended while this link was being opened
            framed.stream.reset()
            return
        link.framed = framed
        self._link_tasks.append(self._tasks.create_task(self._read(link)))
        link.writer = self._tasks.create_task(self._write(link))
        self._link_tasks.append(link.writer)

    async def _read(self, link: _Link) -> None:
        assert link.framed is not None
        try:
            while not link.finished.is_set():
                frame = await link.framed.read_frame()
                if link.finished.is_set():
                    break  # the round is over: nothing may change it now
                if frame is None:
                    raise EOFError("the member closed the link")
                if link.ignored:
                    continue
                self._last_heard[link.peer_id] = time.monotonic()
                self._receive(link.peer_id, decode_message(frame))
        except (PeersError, OSError, EOFError) as e:
            if not link.finished.is_set():
                self._garbage_or_failure(link, e)

    def _garbage_or_failure(self, link: _Link, error: BaseException) -> None:
        if isinstance(error, RemoteProtocolError) and not self.round.excluded_by:
            if link.peer_id not in self.round.failed:
                reason = f"sent garbage: {error}"
                self._handle(self.round.on_sender_failed(link.peer_id, reason))
            link.dead = True
            return
        self._link_failed(link, error)

    async def _write(self, link: _Link) -> None:
        assert link.framed is not None
        try:
            while True:
                while link.outbox:
                    frame = self._encode(link.outbox.popleft())
                    buffers = frame_buffers(frame)
                    self._bytes_sent += sum(len(b) for b in buffers)
                    await link.framed.stream.write_many(buffers)
                if link.finished.is_set() or link.dead:
                    return
                link.wake.clear()
                await link.wake.wait()
        except (PeersError, OSError) as e:
            self._link_failed(link, e)

    def _encode_values(self, values: torch.Tensor) -> EncodedTensor:
        if self.config.codec.name != "none" or values.dtype != torch.float32:
            try:
                return self.config.codec.encode(values)
            except EncodeError as e:
                # Our own values do not fit the codec (float16 above 65504): this chunk
                # travels exact. It costs this chunk's compression, never a peer (the
                # receivers decode by the codec each chunk names).
                logger.info("round %s: a chunk goes uncompressed: %s", self._tag, e)
                values = values.to(torch.float32)
        # Exact values need no codec work: our vector was checked finite when the round
        # began and stays unchanged until it ends, so a view of it goes out as it is
        # (the codec would check its range and copy it first).
        array = values.contiguous().numpy()
        return EncodedTensor("none", "float32", [values.numel()], {"values": array})

    def _encode(self, item: _Item) -> list[object]:
        if isinstance(item, Outgoing):
            encoded = self._encode_values(item.values)
            return encode_message(
                ChunkMessage(item.part_index, item.chunk_index, item.weight, encoded)
            )
        if isinstance(item, _AveragedRef):
            contributors = sorted(m.to_bytes() for m in item.contributors)
            encoded = self._encoded[item.part_index][item.chunk_index]
            return encode_message(
                AveragedMessage(item.part_index, item.chunk_index, contributors, encoded)
            )
        return encode_message(item)

    async def _close_links(self) -> None:
        """Let writers flush (bounded), then close every link and stop its tasks."""
        for link in self.links.values():
            link.finished.set()
            link.wake.set()
        writers = [link.writer for link in self.links.values() if link.writer is not None]
        if writers:  # each writer returns once its outbox is flushed
            await asyncio.wait(writers, timeout=FLUSH_SECONDS)
        # All at once: one slow or dead remote must not hold the others' closes (and
        # the round's return) for FLUSH_SECONDS each.
        await asyncio.gather(
            *(_close_stream(link.framed.stream) for link in self.links.values() if link.framed)
        )
        for task in self._link_tasks:
            task.cancel()
        for link in self.links.values():
            if link.framed is not None:
                self._bytes_received += link.framed.bytes_read


async def _close_stream(stream: Stream) -> None:
    """Close ``stream`` (its remote sees the end), waiting at most FLUSH_SECONDS, then
    reset whatever is left of it."""
    with contextlib.suppress(TimeoutError, PeersError, OSError):
        async with asyncio.timeout(FLUSH_SECONDS):
            await stream.close()
    stream.reset()


_NONE = NoneCodec()


def _decode(encoded: EncodedTensor) -> torch.Tensor:
    """A received chunk's values. Uncompressed ones skip the codec's finiteness pass:
    ``ButterflyRound`` checks every value it is given (one pass, not two)."""
    if isinstance(encoded, EncodedTensor) and encoded.codec == _NONE.name:
        return _NONE.decode(encoded, check_finite=False)
    return decode_tensor(encoded)
