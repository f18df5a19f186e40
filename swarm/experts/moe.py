"""``RemoteMixtureOfExperts``: a gate scores an expert grid; the top-k live experts run.

For each sample the gate (one linear layer) scores every coordinate of every grid
dimension; beam search through the DHT finds the ``k_best`` live experts with the
highest summed scores; each chosen expert is called once with all its samples; the
answers are averaged with softmax weights of the experts' scores over those that
answered. Gradients reach the gate (through the weights) and the experts (their
servers train on the backward). Experts that fail or are late are skipped (see
:mod:`swarm.experts.mixture_call`) and avoided for ``ban_seconds``; if a sample still
lacks ``k_min`` answers, the forward is retried once without the failed experts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from peers.dht import DHT, BlockingDHT
from peers.identity import PeerID
from swarm.experts.announce import Announcement, ExpertLocation
from swarm.experts.beam_search import ExpertFinder
from swarm.experts.calls import ExpertCallConfig, call_info
from swarm.experts.dispatch import plan_calls
from swarm.experts.errors import NotEnoughExperts
from swarm.experts.mixture_call import MixtureCall, RemoteCallMany
from swarm.experts.remote import DUMMY, run_blocking
from swarm.experts.schema import ExpertInfo
from swarm.experts.uids import DELIMITER, MAX_GRID_DIMS, check_name

#: Experts asked for their schema before giving up (the first ones may be dead).
MAX_INFO_ATTEMPTS = 3


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A mixture's grid, routing and fault tolerance."""

    uid_prefix: str
    """The grid's name: experts are ``{uid_prefix}.{i}.{j}...``."""
    grid_size: tuple[int, ...]
    """Coordinates per dimension, e.g. ``(4, 4)`` for ``ffn.0.0`` ... ``ffn.3.3``."""
    k_best: int
    """Experts each sample is sent to (the beam size of the search)."""
    k_min: int = 1
    """Answers each sample needs in the forward; fewer fail (and retry) the call."""
    backward_k_min: int = 1
    """Answers each sample needs in the backward."""
    timeout_after_k_min: float = 1.0
    """Seconds stragglers get once every sample has ``k_min`` answers."""
    calls: ExpertCallConfig = field(default_factory=ExpertCallConfig)
    """Deadlines and compression of each expert call."""
    cache_seconds: float = 5.0
    """How long beam search reuses what the DHT said about a prefix."""
    ban_seconds: float = 30.0
    """How long an expert that failed (or a server that could not be reached) is left
    out of beam search."""
    max_attempts: int = 2
    """Forwards tried (each after banning the previous one's failed experts)."""

    def __post_init__(self) -> None:
        check_name(self.uid_prefix)
        if not 1 <= len(self.grid_size) <= MAX_GRID_DIMS or min(self.grid_size) < 1:
            raise ValueError(f"grid_size must have 1 to {MAX_GRID_DIMS} positive sizes")
        if not 1 <= self.k_best or not 0 <= self.k_min <= self.k_best:
            raise ValueError(
                f"need k_best >= 1 and 0 <= k_min <= k_best, got {self.k_min}, {self.k_best}"
            )
        if not 0 <= self.backward_k_min <= self.k_best or self.max_attempts < 1:
            raise ValueError("need 0 <= backward_k_min <= k_best and max_attempts >= 1")
        for name in ("timeout_after_k_min", "cache_seconds", "ban_seconds"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be finite and >= 0")


@dataclass(frozen=True, slots=True)
class MoEStatistics:
    num_forwards: int
    num_retries: int
    """Forwards tried again without the experts that failed the previous try."""
    num_expert_failures: int
    """Expert calls that failed or were too late, forward and backward."""
    banned: tuple[str, ...]
    """Experts left out of beam search now (``uid@server``), and servers (``*@server``)."""
    last_experts: tuple[str, ...]
    """Uids that answered the last forward."""


def async_dht(dht: BlockingDHT) -> DHT:
    """The async node under a BlockingDHT (used only on its own loop)."""
    return dht.node


class RemoteMixtureOfExperts(nn.Module):
    """Mixture of remote experts over ``dht``; input ``[batch, ..., in_features]``."""

    def __init__(self, *, in_features: int, dht: BlockingDHT, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.dht = dht
        self.proj = nn.Linear(in_features, sum(config.grid_size))
        self.finder = ExpertFinder(async_dht(dht), config.cache_seconds)
        self._banned: dict[tuple[str, PeerID], float] = {}
        self._banned_peers: dict[PeerID, float] = {}
        self._info: ExpertInfo | None = None
        self._num_forwards = self._num_retries = self._num_failures = 0
        self._last_experts: tuple[str, ...] = ()

    def forward(
        self, x: torch.Tensor, *extra: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The weighted average of the chosen experts' outputs. Raises
        :class:`NotEnoughExperts` if some sample lacks ``k_min`` answers after
        ``max_attempts`` tries, or no expert of the grid can be found."""
        gate_input = x if x.ndim == 2 else x.mean(dim=tuple(range(1, x.ndim - 1)))
        grid_scores = self.proj(gate_input).split(list(self.config.grid_size), dim=-1)
        scores = torch.stack([s.detach().float() for s in _pad(grid_scores)], dim=1).tolist()
        for attempt in range(self.config.max_attempts):
            chosen = self._search(scores)
            call = self._call(chosen)
            try:
                results = RemoteCallMany.apply(DUMMY, call, x, *extra)  # type: ignore[no-untyped-call]
                mask, *outputs = results
            except NotEnoughExperts:
                if attempt + 1 == self.config.max_attempts:
                    raise
                self._num_retries += 1
                continue
            break
        self._num_forwards += 1
        self._last_experts = tuple(
            sorted({loc.uid for loc in call.plan} - {loc.uid for loc in call.failed})
        )
        logits = self._expert_logits(grid_scores, chosen)
        # A sample no expert answered (possible only with k_min = 0) gets zero weights:
        # its logits are replaced by constants so no NaN reaches the gate's gradient.
        answered = mask.any(dim=1, keepdim=True)
        masked = logits.masked_fill(~mask, -math.inf).masked_fill(~answered, 0.0)
        weights = torch.softmax(masked, dim=1) * mask
        mixed = [
            (weights.view(*weights.shape, *[1] * (t.ndim - 2)) * t).sum(dim=1) for t in outputs
        ]
        return mixed[0] if len(mixed) == 1 else tuple(mixed)

    def _search(self, scores: list[list[list[float]]]) -> list[list[Announcement]]:
        now = time.monotonic()
        self._banned = {key: until for key, until in self._banned.items() if until > now}
        self._banned_peers = {p: until for p, until in self._banned_peers.items() if until > now}
        # A sample's row holds each dimension's scores padded to the longest; trim them.
        trimmed = [
            [dim[:size] for dim, size in zip(row, self.config.grid_size, strict=True)]
            for row in scores
        ]
        coro = self.finder.find(
            self.config.uid_prefix,
            self.config.grid_size,
            trimmed,
            self.config.k_best,
            set(self._banned),
            set(self._banned_peers),
        )
        chosen = run_blocking(self.dht.peer, coro)
        if not any(chosen):
            raise NotEnoughExperts(
                f"no live expert of grid {self.config.uid_prefix} {list(self.config.grid_size)} "
                "found in the DHT: are its servers up and announcing?"
            )
        return chosen

    def _call(self, chosen: list[list[Announcement]]) -> MixtureCall:
        return MixtureCall(
            peer=self.dht.peer,
            plan=plan_calls(chosen),
            info=self._expert_info(chosen),
            num_slots=self.config.k_best,
            calls=self.config.calls,
            k_min=self.config.k_min,
            backward_k_min=self.config.backward_k_min,
            timeout_after_k_min=self.config.timeout_after_k_min,
            keep=torch.is_grad_enabled(),
            on_failure=self._on_failure,
        )

    def _expert_info(self, chosen: list[list[Announcement]]) -> ExpertInfo:
        """The schema every expert of the grid shares, asked once of a chosen one."""
        if self._info is None:
            candidates = list(dict.fromkeys(a.location for row in chosen for a in row))
            error: Exception | None = None
            for location in candidates[:MAX_INFO_ATTEMPTS]:
                coro = call_info(
                    self.dht.peer.peer, location, timeout=self.config.calls.info_timeout
                )
                try:
                    self._info = run_blocking(self.dht.peer, coro)
                    break
                except Exception as e:  # a dead expert: ask the next one
                    error = e
            if self._info is None:
                raise NotEnoughExperts(f"no chosen expert told its schema: {error!r}")
        return self._info

    def _on_failure(self, location: ExpertLocation, unreachable: bool) -> None:
        """Leave a failed expert (or its whole server, if unreachable) out of beam
        search for ``ban_seconds``, and read the DHT afresh next time."""
        until = time.monotonic() + self.config.ban_seconds
        self._num_failures += 1
        self._banned[(location.uid, location.peer_id)] = until
        if unreachable:
            self._banned_peers[location.peer_id] = until
        self.finder.forget()

    def statistics(self) -> MoEStatistics:
        return MoEStatistics(
            num_forwards=self._num_forwards,
            num_retries=self._num_retries,
            num_expert_failures=self._num_failures,
            banned=tuple(
                sorted(
                    [f"{uid}@{peer}" for uid, peer in self._banned]
                    + [f"*@{peer}" for peer in self._banned_peers]
                )
            ),
            last_experts=self._last_experts,
        )

    def _expert_logits(
        self, grid_scores: tuple[torch.Tensor, ...], chosen: list[list[Announcement]]
    ) -> torch.Tensor:
        """``[batch, k_best]``: each chosen expert's summed gate scores (differentiable);
        -inf in empty slots."""
        rows, slots, coords = [], [], []
        for i, row in enumerate(chosen):
            for j, a in enumerate(row):
                rows.append(i)
                slots.append(j)
                coords.append([int(c) for c in a.location.uid.split(DELIMITER)[1:]])
        batch = grid_scores[0].shape[0]
        logits = torch.full((batch, self.config.k_best), -math.inf, dtype=grid_scores[0].dtype)
        if rows:
            index = torch.tensor(rows)
            by_dim = torch.tensor(coords).T
            flat = sum(s[index, by_dim[d]] for d, s in enumerate(grid_scores))
            logits = logits.index_put((index, torch.tensor(slots)), torch.as_tensor(flat))
        return logits.to(grid_scores[0].device)


def _pad(grid_scores: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Each dimension's scores padded to the longest, so they stack into one tensor."""
    longest = max(s.shape[-1] for s in grid_scores)
    return [nn.functional.pad(s, (0, longest - s.shape[-1])) for s in grid_scores]
