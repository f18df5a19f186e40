"""The configuration of an :class:`swarm.experts.ExpertServer`."""

from __future__ import annotations

from dataclasses import dataclass

from peers.identity import PeerID
from swarm.experts.kernels import LinearKernels, check_linear_kernels


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How a server batches requests, whom it lets train, and how it announces its
    experts."""

    min_batch_size: int = 1
    """A batch smaller than this waits for more requests (up to ``max_wait_seconds``).
    The default 1 runs a lone request at once: batching then only groups the requests
    that arrive while the module is busy, and costs no latency."""
    max_wait_seconds: float = 0.0
    """Longest a request waits for company when its batch is below ``min_batch_size``."""
    max_queued_batches: int = 8
    """Queue bound per module, in maximal batches: past ``max_queued_batches *
    max_batch_size`` queued samples a request is refused with ``ServerBusy`` (so a flood
    costs memory for a bounded queue, and callers learn to go elsewhere)."""
    max_queued_batches_per_caller: int = 4
    """Queue bound per module and caller (remote peer), in maximal batches: past
    ``max_queued_batches_per_caller * max_batch_size`` samples of its own queued, a
    caller's next request is refused with ``ServerBusy`` (its own, and only its, to
    retry). The default 4, half of ``max_queued_batches``, leaves half the queue to the
    others whatever one caller sends, and room for a pipeline client that keeps all its
    micro-batches in flight at once. Requests in flight are bounded too, per peer and
    for every protocol together, by :data:`peers.rpc.MAX_CALLS_IN_FLIGHT_PER_PEER`.
    A value over ``max_queued_batches`` means no bound of its own."""
    allowed_trainers: frozenset[PeerID] | None = None
    """The peers whose backward calls train the hosted modules; ``None``: anyone. A
    backward from any other peer is refused with ``TrainingNotAllowed`` before its
    tensors are checked, queued or computed with, and touches no gradient. Forward
    calls are served to everyone (a forward from a peer that may not train keeps no
    graph for a backward)."""
    max_kept_forwards: int = 16
    """Forward graphs kept per module for their callers' backward passes (saving the
    recomputation). Each holds one request's activations (the ``ffn`` of width 1024 at
    batch 256: about 30 MB), so this bounds the memory a module spends on them."""
    kept_forward_seconds: float = 60.0
    """How long a kept graph waits for its backward."""
    announce_interval: float = 30.0
    """Seconds between announcements of the hosted experts in the DHT."""
    announce_ttl: float = 90.0
    """Seconds an announcement lives: a server that vanishes drops out of beam search
    within this. Must exceed ``announce_interval`` so a live server never flickers."""
    linear_kernels: LinearKernels = "auto"
    """How hosted modules compute their ``nn.Linear`` layers on the CPU
    (:mod:`swarm.experts.kernels`): ``"auto"`` with oneDNN where a probe finds it clearly
    faster than torch's kernels (2.2x on AMD's AVX-512 CPUs), ``"onednn"`` always,
    ``"torch"`` never. The server changes its modules' Linear layers in place (their
    class, not their parameters)."""

    def __post_init__(self) -> None:
        if self.min_batch_size < 1 or self.max_queued_batches < 1:
            raise ValueError("min_batch_size and max_queued_batches must be at least 1")
        if self.max_queued_batches_per_caller < 1:
            raise ValueError(
                "max_queued_batches_per_caller must be at least 1, "
                f"got {self.max_queued_batches_per_caller}"
            )
        if self.allowed_trainers is not None and not (
            isinstance(self.allowed_trainers, frozenset)
            and all(isinstance(p, PeerID) for p in self.allowed_trainers)
        ):
            raise ValueError(
                "allowed_trainers must be a frozenset of PeerIDs (or None: anyone), "
                f"got {type(self.allowed_trainers).__name__}"
            )
        if self.max_wait_seconds < 0 or self.kept_forward_seconds < 0:
            raise ValueError("max_wait_seconds and kept_forward_seconds must be >= 0")
        check_linear_kernels(self.linear_kernels)
        if self.max_kept_forwards < 0:
            raise ValueError("max_kept_forwards must be >= 0")
        if not 0 < self.announce_interval < self.announce_ttl:
            raise ValueError(
                f"need 0 < announce_interval ({self.announce_interval}) < announce_ttl "
                f"({self.announce_ttl}), or a live server's entries would expire between rounds"
            )
