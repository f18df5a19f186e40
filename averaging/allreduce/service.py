"""Serving the all-reduce protocol on a peer: routes each incoming link to the round it
names, and runs rounds.

Members leave matchmaking a little apart, so a link may arrive before its round starts
here: it waits (``join_timeout``) for the round to be registered. Links naming a round
that already ended, or that never starts, are refused with a reset; a bounded number
wait at once (CONTRIBUTING.md, "Bound everything a peer controls").
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import torch

from averaging.allreduce.config import AllReduceConfig, AllReduceError, AllReduceResult
from averaging.allreduce.feedback import RoundErrors
from averaging.allreduce.network import LaneMemo, RoundRunner
from averaging.allreduce.records import RoundSpec
from averaging.allreduce.wire import ALLREDUCE_PROTOCOL, decode_hello
from peers.errors import PeersError
from peers.identity import PeerID
from peers.rpc import FramedStream
from peers.service import Service
from peers.stream_api import StreamHost, StreamLike

logger = logging.getLogger(__name__)

#: Links that may wait at once for a round not started here yet: a group is at most
#: ~1000 members, and a peer is in few rounds at a time.
MAX_WAITING_LINKS = 1024
#: Ended rounds remembered, so that a late link to one is refused at once.
REMEMBERED_ROUNDS = 256
#: Seconds a link may take to send its Hello.
HELLO_TIMEOUT = 10.0


class AllReduceService(Service):
    """Runs butterfly rounds on ``peer`` (an async context manager that registers the
    protocol's handler). Several rounds may run at once, each under its own round id."""

    def __init__(self, peer: StreamHost, config: AllReduceConfig | None = None) -> None:
        super().__init__()
        self.peer = peer
        self.config = config or AllReduceConfig()
        self._rounds: dict[bytes, RoundRunner] = {}
        self._started: dict[bytes, asyncio.Event] = {}
        self._ended: OrderedDict[bytes, None] = OrderedDict()
        self._num_waiting = 0
        self._lane_memo = LaneMemo()
        self._reverse_memo = LaneMemo()  # members that took a reverse lane lately

    async def _start(self) -> None:
        self._serve(
            lambda: self.peer.set_stream_handler(ALLREDUCE_PROTOCOL, self._on_stream),
            lambda: self.peer.remove_stream_handler(ALLREDUCE_PROTOCOL),
        )

    def remember_reverse_lane(self, member: PeerID) -> None:
        """Treat ``member`` as having taken a reverse lane lately (as a round with it
        leaves it): the next round's reverse lane to it sends at once. For tools that
        check rounds from that state, such as the fault checker."""
        self._reverse_memo.add(member)

    def running(self, round_id: bytes) -> RoundRunner | None:
        """The round ``round_id`` while it runs here (for tools that inspect or drive it,
        such as the fault checker)."""
        return self._rounds.get(round_id)

    async def run_round(
        self,
        spec: RoundSpec,
        local: torch.Tensor,
        weight: float,
        config: AllReduceConfig | None = None,
        errors: RoundErrors | None = None,
    ) -> AllReduceResult:
        """Average ``local`` (a flat float32 tensor, left unchanged) with the members of
        ``spec``, weighting it by ``weight`` (e.g. its sample count). Members must know
        each other's addresses (``peer.add_addresses``).

        Returns within ``config.return_bound`` whatever the others and the network do,
        and never raises for their faults; the result says who failed, what fraction
        was averaged, and whether this peer holds the result a majority agreed on. Raises
        :class:`AllReduceError` for a round id already running here, and
        :class:`~averaging.allreduce.records.RoundError` for a tensor or weight that does
        not fit ``spec``. Cancellation closes every link of the round.

        ``errors`` (from :meth:`~averaging.allreduce.feedback.RoundFeedback.round`) records
        what a lossy codec leaves out of this round and applies it when the round ends;
        ``local`` should then be the compensated vector.
        """
        if spec.me != self.peer.peer_id:
            raise AllReduceError("spec.me must be this peer")
        if spec.round_id in self._rounds or spec.round_id in self._ended:
            raise AllReduceError(f"round {spec.round_id.hex()} already ran here")
        runner = RoundRunner(
            self.peer,
            spec,
            local,
            weight,
            config or self.config,
            errors,
            self._lane_memo,
            self._reverse_memo,
        )
        self._rounds[spec.round_id] = runner
        self._started.setdefault(spec.round_id, asyncio.Event()).set()
        try:
            return await runner.run()
        finally:
            del self._rounds[spec.round_id]
            self._started.pop(spec.round_id, None)
            self._ended[spec.round_id] = None
            while len(self._ended) > REMEMBERED_ROUNDS:
                self._ended.popitem(last=False)

    async def _on_stream(self, stream: StreamLike) -> None:
        framed: FramedStream[StreamLike] = FramedStream(stream)
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                frame = await framed.read_frame()
            hello = decode_hello(frame)
            runner = await self._wait_for_round(hello.round_id)
            await runner.accept(stream.remote_peer_id, framed, hello.spec_digest, hello.lane)
        except (TimeoutError, PeersError) as e:
            logger.info("allreduce link from %s refused: %r", stream.remote_peer_id, e)
            stream.reset()

    async def _wait_for_round(self, round_id: bytes) -> RoundRunner:
        runner = self._rounds.get(round_id)
        if runner is not None:
            return runner
        if round_id in self._ended:
            raise AllReduceError(f"round {round_id.hex()} has ended here")
        if self._num_waiting >= MAX_WAITING_LINKS:
            raise AllReduceError("too many links waiting for rounds to start")
        started = self._started.setdefault(round_id, asyncio.Event())
        self._num_waiting += 1
        try:
            async with asyncio.timeout(self.config.join_timeout):
                await started.wait()
        finally:
            self._num_waiting -= 1
            if not started.is_set() and self._num_waiting == 0:
                self._started.pop(round_id, None)
        runner = self._rounds.get(round_id)
        if runner is None:
            raise AllReduceError(f"round {round_id.hex()} ended before the link arrived")
        return runner
