"""The expert server: hosts modules under uids, batches requests, trains, announces.

``async with ExpertServer(peer, backends, config, dht=dht)`` registers the experts
protocol on ``peer``, starts one :class:`ModuleWorker` per module and (with a DHT)
announces the modules once, then every ``announce_interval``: a
:class:`peers.service.Service`, whose tasks live in a TaskGroup it owns. Every request is checked
against the module's schema before it is decoded or queued; a bad one costs only its
caller a :class:`BadExpertRequest`. Each request is queued as its caller's (the remote
peer's), within that caller's share of the module's queue, and a backward from a peer
outside ``ServerConfig.allowed_trainers`` is refused with :class:`TrainingNotAllowed`
before anything else (docs/experts-trust.md). A pipeline stage is hosted the same way as
an expert: a module under a uid such as ``stage.2``. The modules' ``nn.Linear`` layers
compute with oneDNN where a probe finds it faster than torch's kernels
(``linear_kernels`` in :class:`ServerConfig`; :mod:`swarm.experts.kernels`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from peers.dht import DHT
from peers.host import Peer
from peers.identity import PeerID
from peers.rpc import CallContext
from peers.runtime import keep_freed_memory
from peers.serialization import MAX_FRAME_BYTES
from peers.service import Service
from peers.traffic import CallLatency, LatencyHistogram
from swarm.experts.announce import Announcement, ExpertLocation, declare_experts
from swarm.experts.backend import BackendStatistics, KeptForward, ModuleBackend
from swarm.experts.batching import Batcher
from swarm.experts.errors import BadExpertRequest, TrainingNotAllowed
from swarm.experts.kept import KeptStore
from swarm.experts.kernels import use_linear_kernels
from swarm.experts.schema import ExpertInfo, TensorSpec, check_batch, check_values
from swarm.experts.server_config import ServerConfig
from swarm.experts.wire import (
    BACKWARD_PROTOCOL,
    FORWARD_PROTOCOL,
    INFO_PROTOCOL,
    BackwardRequest,
    BackwardResponse,
    ForwardRequest,
    ForwardResponse,
    InfoRequest,
    WireTensor,
    check_codec,
    check_finite,
    decode,
    encode,
)
from swarm.experts.worker import ModuleWorker

logger = logging.getLogger(__name__)

#: Room in a frame for the msgpack head and tensor descriptors of a maximal request.
FRAME_SLACK_BYTES = 64 * 1024
#: Hosted uids a "no such expert" error lists (a server may host thousands).
MAX_LISTED_UIDS = 8


@dataclass(frozen=True, slots=True)
class ServerStatistics:
    modules: dict[str, BackendStatistics]
    queued_samples: dict[str, int]
    throughput: dict[str, float]
    num_announcements: int
    num_refused_trainings: int
    """Backward calls refused because their peer is not in ``allowed_trainers``."""
    linear_kernels: str
    """Which kernels the hosted modules' Linear layers use: ``"onednn"`` or ``"torch"``."""
    latency: Mapping[tuple[str, str], CallLatency] = field(default_factory=dict)
    """Requests by ``(uid, "forward" or "backward")``, from their arrival in the queue to
    their result: queueing and compute, as callers feel it (a refused one as a failure)."""


class ExpertServer(Service):
    """Serves ``backends`` on ``peer``; announces them in ``dht`` if one is given.

    Constructing one tunes the process's allocator to keep freed memory
    (:func:`peers.runtime.keep_freed_memory`; ``SWARMTRAIN_KEEP_FREED_MEMORY=0`` opts
    out): threads started afterwards, as the loop's executor starts them for the
    modules' work, then reuse the gradients' memory instead of faulting it in again on
    every backward. A process that calls it before it starts its peer's loop thread
    gets that thread too, as ``swarm serve`` (through :func:`peers.run`) does."""

    def __init__(
        self,
        peer: Peer,
        backends: Sequence[ModuleBackend],
        config: ServerConfig | None = None,
        *,
        dht: DHT | None = None,
    ) -> None:
        super().__init__()
        keep_freed_memory()  # before the executor threads the modules compute in start
        self.peer = peer
        self.config = config or ServerConfig()
        self.dht = dht
        self.workers: dict[str, ModuleWorker] = {}
        for backend in backends:
            if backend.uid in self.workers:
                raise ValueError(f"uid {backend.uid} is hosted twice")
            max_batch = backend.info.max_batch_size
            queued = self.config.max_queued_batches
            per_caller = min(self.config.max_queued_batches_per_caller, queued)
            batcher: Batcher[int] = Batcher(
                max_batch_size=max_batch,
                max_queued_samples=queued * max_batch,
                max_queued_samples_per_caller=per_caller * max_batch,
                min_batch_size=min(self.config.min_batch_size, max_batch),
                max_wait_seconds=self.config.max_wait_seconds,
            )
            kept: KeptStore[KeptForward] = KeptStore(
                max_entries=self.config.max_kept_forwards,
                ttl_seconds=self.config.kept_forward_seconds,
            )
            self.workers[backend.uid] = ModuleWorker(backend, batcher, kept)
        kernels = self.config.linear_kernels
        self.uses_onednn = any([use_linear_kernels(b.module, kernels) for b in backends])
        """Whether the Linear layers compute with oneDNN (:mod:`swarm.experts.kernels`)."""
        largest = max((w.backend.info.max_request_bytes for w in self.workers.values()), default=0)
        self.max_frame_bytes = max(MAX_FRAME_BYTES, largest + FRAME_SLACK_BYTES)
        self._num_announcements = 0
        self._num_refused_trainings = 0
        self.step_guard: Callable[[str, int, str], None] | None = None
        """Called with a request's uid, step (-1: none named) and kind (``forward``,
        ``backward``) before it is queued; raises to refuse it (a synchronous pipeline
        stage at another step)."""
        # hosted uids only: a request names one before it is timed
        self._latency: dict[tuple[str, str], LatencyHistogram] = {}

    async def _start(self) -> None:
        self._serve_unary(self.peer, INFO_PROTOCOL, self.rpc_info, InfoRequest)
        self._serve_unary(
            self.peer,
            FORWARD_PROTOCOL,
            self.rpc_forward,
            ForwardRequest,
            max_frame_bytes=self.max_frame_bytes,
        )
        self._serve_unary(
            self.peer,
            BACKWARD_PROTOCOL,
            self.rpc_backward,
            BackwardRequest,
            max_frame_bytes=self.max_frame_bytes,
        )
        for worker in self.workers.values():
            self._spawn(worker.run())
        if self.dht is not None:
            await self.announce()  # findable as soon as the body runs
            self._spawn(self._announce_forever())

    # --- handlers ------------------------------------------------------------------

    def _may_train(self, caller: PeerID) -> bool:
        allowed = self.config.allowed_trainers
        return allowed is None or caller in allowed

    def _worker(self, uid: str) -> ModuleWorker:
        worker = self.workers.get(uid)
        if worker is None:
            hosted = sorted(self.workers)[:MAX_LISTED_UIDS]
            raise BadExpertRequest(f"no expert {uid[:128]!r} here; this server hosts {hosted}")
        return worker

    @contextlib.contextmanager
    def _timed(self, uid: str, direction: str) -> Iterator[None]:
        """Time a request from its arrival in the queue to its result (or failure)."""
        histogram = self._latency.setdefault((uid, direction), LatencyHistogram())
        started = time.monotonic()
        try:
            yield
        except Exception:
            histogram.record(time.monotonic() - started, failed=True)
            raise
        histogram.record(time.monotonic() - started)

    async def rpc_info(self, request: InfoRequest, context: CallContext) -> ExpertInfo:
        return self._worker(request.uid).backend.info

    async def rpc_forward(self, request: ForwardRequest, context: CallContext) -> ForwardResponse:
        worker = self._worker(request.uid)
        self._check_step(request.uid, request.step, "forward")
        info = worker.backend.info
        codec = _codec(request.reply_codec)
        inputs, batch = _decode(
            f"forward {info.uid}: inputs", request.inputs, info.inputs, info.max_batch_size
        )
        caller = context.remote_peer_id
        keep = request.keep and self._may_train(caller)  # no graph for a refused backward
        with self._timed(request.uid, "forward"):
            outputs, kept = await worker.submit(
                "forward", (inputs,), batch, keep=keep, caller=caller
            )
        token = 0
        if kept is not None:
            token = worker.kept.put(context.remote_peer_id, kept, time.monotonic())
        return ForwardResponse([encode(t, codec) for t in outputs if t is not None], token)

    async def rpc_backward(
        self, request: BackwardRequest, context: CallContext
    ) -> BackwardResponse:
        worker = self._worker(request.uid)
        caller = context.remote_peer_id
        if not self._may_train(caller):
            self._num_refused_trainings += 1
            raise TrainingNotAllowed(
                f"backward refused: this server trains {request.uid[:128]!r} only on the "
                f"gradients of its allowed trainers, and {caller} is not one of them; "
                "forward calls are open to you"
            )
        self._check_step(request.uid, request.step, "backward")
        info = worker.backend.info
        codec = _codec(request.reply_codec)
        what = f"backward {info.uid}"
        inputs, batch = _decode(f"{what}: inputs", request.inputs, info.inputs, info.max_batch_size)
        grads, _ = _decode(
            f"{what}: grad_outputs", request.grad_outputs, info.outputs, info.max_batch_size, batch
        )
        kept = None
        if request.forward_token:
            kept = worker.kept.take(caller, request.forward_token, time.monotonic())
            if kept is not None and kept.leaves[0].shape[0] != batch:
                kept = None  # not this batch's graph: recompute
        tag = (caller, request.step, request.pass_id) if request.pass_id else None
        with self._timed(request.uid, "backward"):
            grad_inputs, _ = await worker.submit(
                "backward", (inputs, grads), batch, kept=kept, caller=caller, tag=tag
            )
        return BackwardResponse([None if g is None else encode(g, codec) for g in grad_inputs])

    def _check_step(self, uid: str, step: int, kind: str) -> None:
        if self.step_guard is not None:
            self.step_guard(uid, step, kind)

    # --- announcing ----------------------------------------------------------------

    def announcements(self) -> list[Announcement]:
        # Relayed addresses too: a server behind NAT (a GPU at home) is reached through
        # its relays, and hole punching makes the connection direct where it can.
        addrs = tuple(str(a) for a in self.peer.advertised_addrs)
        return [
            Announcement(
                ExpertLocation(uid, self.peer.peer_id, addrs),
                load=w.batcher.num_queued_samples,
                throughput=w.throughput,
            )
            for uid, w in self.workers.items()
        ]

    async def announce(self) -> int:
        """Announce every hosted module once; entries stored (see ``declare_experts``)."""
        assert self.dht is not None
        expiration = self.dht.clock() + self.config.announce_ttl
        stored = await declare_experts(self.dht, self.announcements(), expiration)
        self._num_announcements += 1
        return stored

    async def _announce_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.announce_interval)
            await self.announce()

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(
            modules={uid: w.backend.statistics() for uid, w in self.workers.items()},
            queued_samples={uid: w.batcher.num_queued_samples for uid, w in self.workers.items()},
            throughput={uid: w.throughput for uid, w in self.workers.items()},
            num_announcements=self._num_announcements,
            num_refused_trainings=self._num_refused_trainings,
            latency={key: h.snapshot() for key, h in sorted(self._latency.items())},
            linear_kernels="onednn" if self.uses_onednn else "torch",
        )


def _codec(name: str) -> str:
    try:
        return check_codec(name)
    except ValueError as e:
        raise BadExpertRequest(str(e)) from None


def _decode(
    what: str,
    items: list[WireTensor],
    specs: list[TensorSpec],
    max_batch_size: int,
    batch_size: int | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Check headers, then decode, then check values; BadExpertRequest on any failure."""
    try:
        batch = check_batch(what, items, specs, max_batch_size, batch_size)
        tensors = [decode(item) for item in items]
        check_finite(what, tensors)
        check_values(what, tensors, specs)
    except ValueError as e:
        raise BadExpertRequest(str(e)) from None
    return tensors, batch
