"""The Averager: named tensors averaged with peers on request (docs/design/averaging.md,
"One step of the Averager").

One object per run and peer. It owns the services a peer needs to average: matchmaking
(groups through the DHT), butterfly rounds (:class:`AllReduceService`) and a state
server (newcomers download its tensors). A step is: find a group under
``{prefix}/{schema}/{round_key}``, average the flattened tensors with it, write the
result back in place. ``schema`` hashes the tensors' names, shapes and dtypes and the
wire settings, so only peers that can average together ever meet.

The bandwidth a peer announces (its share of the reduction in the next round) is what
it measured in its last rounds: bytes received per second, smoothed. The group's
announced rates also set the round's timeouts (:mod:`averaging.allreduce.pace`): a slow
link gets the time it needs (up to ``AllReduceConfig.max_round_timeout``), and a peer
whose own link cannot finish a round within that refuses to average, saying why.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic

import torch

from averaging.allreduce.config import AllReduceConfig, AllReduceError, AllReduceResult
from averaging.allreduce.feedback import RoundFeedback
from averaging.allreduce.pace import check_own_pace, paced
from averaging.allreduce.partition import flatten
from averaging.allreduce.records import DEFAULT_MAX_WEIGHT_RATIO, REDUCERS_PER_PART, RoundSpec
from averaging.allreduce.replicated import fold, replicate
from averaging.allreduce.robust import CenteredClipConfig
from averaging.allreduce.service import AllReduceService
from averaging.matchmaking.matchmaker import Matchmaker
from averaging.matchmaking.records import Group, MatchmakingConfig, MatchmakingError
from averaging.state.donor import StateServer
from averaging.state.manifest import DTYPES, TensorSpec
from averaging.state.records import LoadedState, StateSyncConfig
from averaging.state.sync import StateCheck, load_state_from_peers
from peers.dht.node import DHT
from peers.errors import LocalProtocolError
from peers.identity import KeyPair, PeerID
from peers.service import Service
from peers.stream_api import ReachableHostT

#: Bandwidth (bytes/s) a peer announces before it has measured its own: a common
#: broadband figure, so a newcomer takes an ordinary share of the first round. A round
#: is paced for this rate at the newcomer: on a slow link its first round may end
#: partly averaged, and the next is paced by what it measured.
INITIAL_BANDWIDTH = 1e8
#: Weight of the newest measurement in the smoothed bandwidth.
BANDWIDTH_SMOOTHING = 0.5


class AveragerError(LocalProtocolError):
    """The Averager was used wrongly (our caller's fault): tensors it cannot average,
    state that does not fit them, a step outside ``async with``."""


@dataclass(frozen=True, kw_only=True)
class AveragerConfig:
    """How an :class:`Averager` finds groups and averages with them."""

    prefix: str
    """Name of the run: peers average only with peers using the same prefix."""
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    """Group sizes and matchmaking timeouts."""
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    """Round timeouts, chunk size and codec (part of the schema: peers must agree)."""
    aggregation: CenteredClipConfig | None = None
    """CenteredClip instead of the weighted mean (part of the schema)."""
    max_weight_ratio: float | None = DEFAULT_MAX_WEIGHT_RATIO
    """A sample weight counts at most this many times the median weight of a part's
    senders (``RoundSpec.max_weight_ratio``; part of the schema); None: no cap."""
    state_sync: StateSyncConfig = field(default_factory=StateSyncConfig)
    """How :meth:`Averager.load_state_from_peers` downloads (and which run keys' signed
    states it trusts: ``trusted_signers``)."""
    state_signer: KeyPair | None = field(default=None, repr=False)
    """A run key (:mod:`averaging.state.signing`): sign every state this peer serves
    with it. Peers whose ``state_sync.trusted_signers`` name it then load its states
    from it alone."""
    error_feedback: bool = False
    """Carry what the lossy codec (``allreduce.codec``) leaves out of each round into
    the next (:mod:`averaging.allreduce.feedback`), so rounding errors cancel over rounds
    instead of adding up. Local to this peer: members need not agree on it. Needs a
    lossy codec; costs two float32 vectors the size of the tensors."""
    reducers_per_part: int = 1
    """How many distinct members reduce each coordinate (1, 3 or 5; part of the schema).
    3: one member that publishes a wrong average of its part moves nothing, at three
    times the traffic of a round (:mod:`averaging.allreduce.replicated`). Matchmaking
    then forms groups of at least that many members, and a group with fewer members able
    to reduce (not client-mode) does not average: falling back to one reducer per part
    would hand a liar in a small group the whole of its part."""

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix or "/" in self.prefix:
            raise AveragerError("prefix must be a non-empty string without '/'")
        ratio = self.max_weight_ratio
        if ratio is not None and not (
            isinstance(ratio, int | float) and math.isfinite(ratio) and ratio >= 1
        ):
            raise AveragerError("max_weight_ratio must be None or a finite number >= 1")
        if self.error_feedback and self.allreduce.codec.name == "none":
            raise AveragerError("error_feedback needs a lossy codec (allreduce.codec)")
        if self.reducers_per_part not in REDUCERS_PER_PART:
            raise AveragerError(f"reducers_per_part must be one of {REDUCERS_PER_PART}")


@dataclass(frozen=True, slots=True)
class AveragingStep:
    """What one :meth:`Averager.step` did."""

    group: Group
    outcome: AllReduceResult
    matchmaking_seconds: float
    allreduce_seconds: float
    reducers_per_part: int = 1
    """Distinct reducers of each coordinate in this round: the config's, or 1 when the
    group had fewer members able to reduce."""
    spread: float = 0.0
    """With several reducers per part, the largest difference between two reducers'
    averages of one coordinate (:class:`~averaging.allreduce.replicated.Folded`)."""

    @property
    def num_peers(self) -> int:
        return len(self.group)


class Averager(Service, Generic[ReachableHostT]):
    """Averages ``tensors`` (name -> CPU tensor, kept by reference and updated in place)
    with peers. Use ``async with Averager(dht, tensors, config)``."""

    def __init__(
        self, dht: DHT[ReachableHostT], tensors: Mapping[str, torch.Tensor], config: AveragerConfig
    ) -> None:
        super().__init__()
        if not tensors:
            raise AveragerError("give at least one tensor")
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise AveragerError(f"{name!r} must be a floating-point torch.Tensor")
            if tensor.device.type != "cpu":
                raise AveragerError(f"{name!r} must be on the CPU")
        self.dht = dht
        self.peer = dht.peer
        self.tensors = dict(tensors)
        self.config = config
        self.bandwidth = INITIAL_BANDWIDTH
        self._rate_measured = False  # self.bandwidth is still INITIAL_BANDWIDTH
        self.schema = _schema(self.tensors, config)
        self._matchmaker: Matchmaker[ReachableHostT] | None = None
        self._service: AllReduceService | None = None
        self._state: StateServer | None = None
        self._feedback: dict[int, RoundFeedback] = {}  # by reducers per part

    async def _start(self) -> None:
        self._matchmaker = await self._enter(Matchmaker(self.dht, _matchmaking(self.config)))
        self._service = await self._enter(AllReduceService(self.peer, self.config.allreduce))
        self._state = await self._enter(
            StateServer(
                self.peer,
                dht=self.dht,
                prefix=self._state_prefix,
                signer=self.config.state_signer,
            )
        )

    @property
    def _state_prefix(self) -> str:
        return f"{self.config.prefix}.{self.schema[:16]}"

    def contact(self) -> tuple[str, ...]:
        """Where others reach this peer's group searches (empty: it cannot lead one);
        peers told of it pass it back as ``expected`` to :meth:`step`."""
        if self._matchmaker is None:
            raise AveragerError("use the Averager inside `async with`")
        return self._matchmaker.contact()

    def key(self, round_key: str | int) -> str:
        """The matchmaking key of round ``round_key`` for this run and schema."""
        return f"{self.config.prefix}/{self.schema[:16]}/{round_key}"

    async def step(
        self,
        round_key: str | int,
        *,
        weight: float = 1.0,
        timeout: float | None = None,
        target_group_size: int | None = None,
        expected: Mapping[PeerID, Sequence[str]] | None = None,
    ) -> AveragingStep:
        """Average the tensors with the peers stepping under the same ``round_key`` now
        (e.g. the global step number), weighting ours by ``weight`` (e.g. its sample
        count); the result is written into the tensors in place.

        Do not modify the tensors until it returns. Raises
        :class:`~averaging.matchmaking.records.MatchmakingError` if no group forms
        within the matchmaking timeout (``timeout`` overrides it), or the group formed has
        fewer members able to reduce than ``reducers_per_part``; the tensors are then
        unchanged. A round that loses members still returns (see the report).
        ``target_group_size`` overrides the matchmaking config's for this step;
        ``expected`` maps peers known to step under ``round_key`` now or shortly to their
        :meth:`contact` (:meth:`Matchmaker.look_for_group`).
        """
        if self._matchmaker is None or self._service is None:
            raise AveragerError("use the Averager inside `async with`")
        started = time.monotonic()
        copies = self.config.reducers_per_part
        if self._rate_measured:
            elements = sum(t.numel() for t in self.tensors.values()) * copies
            try:
                check_own_pace(self.config.allreduce, elements, self.bandwidth)
            except AllReduceError:
                # Refuse this step, not every later one: a rate measured in a round
                # that lost a member (or was cut) is low, so measure afresh next time.
                self.bandwidth, self._rate_measured = INITIAL_BANDWIDTH, False
                raise
        group = await self._matchmaker.look_for_group(
            self.key(round_key),
            bandwidth=self.bandwidth,
            timeout=timeout,
            target_group_size=None if target_group_size is None else max(target_group_size, copies),
            expected=expected,
        )
        matched = time.monotonic()
        reducers = sum(1 for w in group.weights if w > 0)
        if reducers < copies:
            raise MatchmakingError(
                f"a group of {len(group.members)} with {reducers} members able to reduce: "
                f"{copies} reducers per part need {copies}; not averaged"
            )
        flat = flatten([t.detach() for t in self.tensors.values()]).to(torch.float32)
        flat = replicate(flat, copies)
        errors = None
        if self.config.error_feedback:
            feedback = self._feedback.setdefault(copies, RoundFeedback(flat.numel()))
            flat = feedback.compensate(flat)
            errors = feedback.round()
        spec = RoundSpec(
            round_id=group.round_id,
            members=group.members,
            weights=group.weights,
            total_elements=flat.numel(),
            chunk_elements=self.config.allreduce.chunk_elements,
            me=self.peer.peer_id,
            aggregation=self.config.aggregation,
            max_weight_ratio=self.config.max_weight_ratio,
            reducers_per_part=copies,
        )
        # Every member paces the round alike: from the group record's rates (all of
        # them: a client-mode member reduces nothing, but its link still carries its
        # vector and the average).
        config = paced(self.config.allreduce, spec, group.bandwidths)
        outcome = await self._service.run_round(spec, flat, weight, config, errors=errors)
        folded = fold(outcome.result.averaged, copies)
        self._write_back(folded.values)
        self._measured(outcome)
        return AveragingStep(
            group,
            outcome,
            matched - started,
            time.monotonic() - matched,
            reducers_per_part=copies,
            spread=folded.spread,
        )

    def _write_back(self, averaged: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for tensor in self.tensors.values():
                n = tensor.numel()
                tensor.copy_(averaged[offset : offset + n].view_as(tensor))
                offset += n

    def _measured(self, outcome: AllReduceResult) -> None:
        rate = outcome.link_bytes_per_second
        if outcome.transfer.bytes_received > 0 and math.isfinite(rate) and rate > 0:
            if self._rate_measured:
                rate = BANDWIDTH_SMOOTHING * rate + (1 - BANDWIDTH_SMOOTHING) * self.bandwidth
            self.bandwidth = rate  # the first measurement replaces the guess outright
            self._rate_measured = True

    # --- state for newcomers ----------------------------------------------------------

    async def share_state(
        self,
        version: int,
        metadata: Mapping[str, Any] | None = None,
        extra: Mapping[str, torch.Tensor] | None = None,
        *,
        include_averaged: bool = True,
    ) -> None:
        """Serve a copy of the tensors (unless ``include_averaged`` is False) plus
        ``extra`` (e.g. parameters and optimizer state) as ``version`` to newcomers, and
        announce it in the DHT. Versions must increase."""
        if self._state is None:
            raise AveragerError("use the Averager inside `async with`")
        tensors: dict[str, torch.Tensor] = {}
        if include_averaged:
            tensors.update({f"averaged/{k}": v for k, v in self.tensors.items()})
        tensors.update({f"extra/{k}": v for k, v in (extra or {}).items()})
        await self._state.set_state(version, tensors, dict(metadata or {}))

    async def load_state_from_peers(
        self,
        *,
        timeout: float | None = None,
        apply: bool = True,
        donors: Sequence[PeerID] | None = None,
        max_version: int | None = None,
        quorum: int = 1,
        check: StateCheck | None = None,
    ) -> LoadedState:
        """Download the newest state peers agree on (in parallel from several donors,
        verified) and copy the averaged tensors into ours; the result also holds the
        ``extra`` tensors and metadata. Raises
        :class:`~averaging.state.manifest.StateSyncError` if none can be had. A donor
        whose state does not fit our tensors (or that ``check`` rejects) is dropped
        before anything is downloaded, so ours never change for a state that does not
        fit. With ``apply`` False our tensors are left alone (the caller uses
        ``extra``); ``donors`` restricts the download to those peers; ``max_version``
        and ``quorum`` are :func:`~averaging.state.sync.load_state_from_peers`'s.
        """

        def fits(version: int, specs: Sequence[TensorSpec], metadata: dict[str, Any]) -> str | None:
            if apply:
                offered = {s.name: s for s in specs}
                for name, tensor in self.tensors.items():
                    spec = offered.get(f"averaged/{name}")
                    if spec is None:
                        return f"it has no tensor {name!r}"
                    if (
                        tuple(spec.shape) != tuple(tensor.shape)
                        or DTYPES[spec.dtype] != tensor.dtype
                    ):
                        return f"its tensor {name!r} is {spec.dtype}{tuple(spec.shape)}"
            return check(version, specs, metadata) if check is not None else None

        loaded = await load_state_from_peers(
            self.peer,
            donors=list(donors) if donors else None,  # else found in the DHT
            dht=self.dht,
            prefix=self._state_prefix,
            max_version=max_version,
            quorum=quorum,
            check=fits,
            timeout=timeout,
            config=self.config.state_sync,
        )
        if apply:
            with torch.no_grad():
                for name, tensor in self.tensors.items():
                    tensor.copy_(loaded.tensors[f"averaged/{name}"])
        return loaded


def _schema(tensors: Mapping[str, torch.Tensor], config: AveragerConfig) -> str:
    digest = hashlib.sha256(b"swarmtrain-averager-v1\0")
    for name, tensor in tensors.items():
        digest.update(f"{name}\0{tuple(tensor.shape)}\0{tensor.dtype}\0".encode())
    allreduce = config.allreduce
    digest.update(f"{allreduce.chunk_elements}\0{allreduce.codec.name}\0".encode())
    # Timeouts too: a member that excludes a sender after 2 s meeting one that waits 20 s
    # ends rounds with one side's deadline passing while the other still waits.
    timeouts = (
        allreduce.sender_timeout,
        allreduce.reducer_timeout,
        allreduce.round_timeout,
        allreduce.max_round_timeout,
        allreduce.join_timeout,
    )
    digest.update(repr(tuple(float(t) for t in timeouts)).encode())
    digest.update(repr(config.aggregation).encode())
    digest.update(repr(config.max_weight_ratio).encode())
    if config.reducers_per_part != 1:  # (schemas of runs with one stay what they were)
        digest.update(f"reducers per part {config.reducers_per_part}\0".encode())
    return digest.hexdigest()


def _matchmaking(config: AveragerConfig) -> MatchmakingConfig:
    """The matchmaking config, its group sizes raised to ``reducers_per_part``: a smaller
    group cannot give each coordinate that many reducers."""
    copies = config.reducers_per_part
    matchmaking = config.matchmaking
    if matchmaking.min_group_size >= copies:
        return matchmaking
    return replace(
        matchmaking,
        min_group_size=copies,
        target_group_size=max(matchmaking.target_group_size, copies),
    )
