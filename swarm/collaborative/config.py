"""Configuration and statistics of :class:`swarm.collaborative.optimizer.CollaborativeOptimizer`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from averaging import (
    REDUCERS_PER_PART,
    AllReduceConfig,
    CenteredClipConfig,
    MatchmakingConfig,
    NoneCodec,
)
from peers.identity import KeyPair, PeerID
from peers.traffic import EMPTY_LATENCY, CallLatency
from swarm.errors import SwarmError


class OptimizerError(SwarmError):
    """The collaborative optimizer was configured or used wrongly."""


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    """DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
    Language Models"): ``inner_steps`` local steps, then an outer Nesterov step on the
    swarm's averaged parameter change."""

    inner_steps: int = 50
    """H in the paper: local optimizer steps between two synchronisations."""
    outer_lr: float = 0.7
    """The outer optimizer's learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """The outer optimizer's Nesterov momentum (the paper's 0.9)."""
    codec: str = "float16"
    """How the parameter change travels: "none", "float16" or "uint8"."""
    overlap: bool = False
    """Average each outer step's parameter change in the background while the next
    inner steps run, and apply the swarm's average when the round ends (at the latest
    at the next outer step), keeping the local steps taken meanwhile: the round's time
    hides behind computation, and the outer update arrives up to one outer step late
    (one-step-delayed DiLoCo). Every peer of a run must choose the same."""

    def __post_init__(self) -> None:
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise OptimizerError("inner_steps must be a positive int")
        if not 0 < self.outer_lr < math.inf or not 0 <= self.outer_momentum < 1:
            raise OptimizerError("need outer_lr > 0 and 0 <= outer_momentum < 1")
        if self.codec not in ("none", "float16", "uint8"):
            raise OptimizerError("codec must be 'none', 'float16' or 'uint8'")
        if not isinstance(self.overlap, bool):
            raise OptimizerError("overlap must be True or False")


def _default_matchmaking() -> MatchmakingConfig:
    # Training swarms know how many peers to expect (their progress records), so groups
    # form as soon as everyone joined; the gather window only waits for stragglers.
    return MatchmakingConfig(
        target_group_size=64,
        min_group_size=2,
        search_timeout=10.0,
        # How long a leader waits for expected peers that have not joined (a dead peer
        # not yet expired, or one whose declaration is slow to show in the DHT): forming
        # early would split the swarm into groups that step apart.
        gather_timeout=3.0,
        request_timeout=3.0,
        poll_interval_seconds=0.05,
        form_when_full=True,
    )


def _default_allreduce() -> AllReduceConfig:
    return AllReduceConfig(sender_timeout=5.0, reducer_timeout=10.0, round_timeout=20.0)


@dataclass(frozen=True, kw_only=True)
class CollaborativeConfig:
    """How a peer trains with the swarm."""

    run_id: str
    """Name of the training run: peers with the same run id train one model together."""
    target_batch_size: int
    """Samples the whole swarm accumulates per optimizer step (the global batch). Ignored
    in DiLoCo mode, which synchronises every ``diloco.inner_steps`` local steps."""
    diloco: DiLoCoConfig | None = None
    """DiLoCo mode; ``None`` averages gradients every global batch."""
    matchmaking: MatchmakingConfig = field(default_factory=_default_matchmaking)
    """Groups for each averaging round (sizes come from the progress records)."""
    allreduce: AllReduceConfig = field(default_factory=_default_allreduce)
    """Round timeouts and chunking of the averaging rounds."""
    aggregation: CenteredClipConfig | None = None
    """CenteredClip instead of the mean in every round (``CenteredClipConfig()``: the
    spread rule picks each part's radius), so that one peer's gradient (or DiLoCo
    parameter change) moves the step by a bounded amount whatever it sends. Every peer
    of a run must choose the same (it is part of the averaging schema). None: the
    sample-weighted mean, which one peer can move anywhere."""
    reducers_per_part: int = 1
    """Distinct peers that reduce each coordinate of a round (1, 3 or 5; every peer of a
    run must choose the same): with 3, a peer that publishes a wrong average of the
    part it reduces moves nothing (the median of the three copies is taken), at three
    times a round's traffic (``AveragerConfig.reducers_per_part``). With
    ``aggregation``, this closes the reducer's side of the attack CenteredClip closes
    for senders."""
    progress_interval: float = 0.05
    """Seconds between reads of everyone's progress while this peer waits for the others
    (its share of the batch is done, or it waits for a round or for the run to start),
    and the shortest time between two publications of a changed record of its own."""
    refresh_interval: float = 0.5
    """Seconds between reads of everyone's progress while this peer is busy with its own
    samples, and between republications of an unchanged record. Polling at
    ``progress_interval`` all the time cost a small model's peer most of a CPU core."""
    progress_expiration: float = 10.0
    """A peer whose last progress record is older than this is counted as gone."""
    max_wait_seconds: float = 2.0
    """Seconds a peer that has its share of the global batch waits for the others before
    it goes on accumulating (a fast peer in a slow swarm: its extra samples still count)."""
    state_timeout: float = 30.0
    """Seconds a late joiner or a peer that fell behind may spend downloading state."""
    batch_size_per_step: int = 0
    """Samples one call of ``step()`` without a batch size stands for (a training loop
    written for torch optimizers calls ``optimizer.step()``); 0: ``step`` must be told."""
    error_feedback: bool = False
    """Carry what the lossy codec leaves out of each round (``allreduce.codec`` for
    gradients, ``diloco.codec`` for DiLoCo's parameter changes) into the next round, so
    rounding errors cancel over steps instead of adding up (``AveragerConfig``'s). Local
    to this peer; needs a lossy codec."""

    run_key: KeyPair | None = field(default=None, repr=False)
    """The run's operator key (:mod:`averaging.state.signing`): this peer signs every
    state it serves with it, and trusts states signed with it. Give it to the
    operator's own peers only."""
    trusted_run_keys: frozenset[PeerID] = frozenset()
    """Run keys by PeerID: when any are given (or ``run_key``), this peer loads only
    states one of them signed, from any single donor; a quorum of strangers' networks
    no longer suffices. Empty: states offered by a quorum of networks."""

    def run_keys(self) -> frozenset[PeerID]:
        """Every run key whose signed states this peer loads."""
        own = {self.run_key.peer_id} if self.run_key is not None else set()
        return self.trusted_run_keys | own

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id or "/" in self.run_id:
            raise OptimizerError("run_id must be a non-empty string without '/'")
        if not isinstance(self.target_batch_size, int) or self.target_batch_size < 1:
            raise OptimizerError("target_batch_size must be a positive int")
        for name in (
            "progress_interval",
            "refresh_interval",
            "progress_expiration",
            "max_wait_seconds",
            "state_timeout",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise OptimizerError(f"{name} must be a positive number of seconds")
        if self.aggregation is not None and not isinstance(self.aggregation, CenteredClipConfig):
            raise OptimizerError("aggregation must be None or an averaging.CenteredClipConfig")
        if self.reducers_per_part not in REDUCERS_PER_PART:
            raise OptimizerError(f"reducers_per_part must be one of {REDUCERS_PER_PART}")
        size = self.batch_size_per_step
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise OptimizerError(f"batch_size_per_step must be an int >= 0, got {size!r}")
        if self.diloco is not None and not isinstance(self.allreduce.codec, NoneCodec):
            raise OptimizerError(
                "in DiLoCo mode parameter changes travel with diloco.codec "
                f"({self.diloco.codec!r}); leave allreduce.codec at NoneCodec"
            )
        lossy = self.diloco.codec != "none" if self.diloco else self.allreduce.codec.name != "none"
        if self.error_feedback and not lossy:
            raise OptimizerError("error_feedback needs a lossy codec (float16 or 8-bit)")
        if self.run_key is not None and not isinstance(self.run_key, KeyPair):
            raise OptimizerError("run_key must be None or a peers.KeyPair")
        keys: object = self.trusted_run_keys
        if not isinstance(keys, frozenset) or not all(isinstance(k, PeerID) for k in keys):
            raise OptimizerError("trusted_run_keys must be a frozenset of PeerIDs")
        if self.refresh_interval < self.progress_interval:
            raise OptimizerError("refresh_interval must be at least progress_interval")
        if self.progress_expiration <= 2 * self.refresh_interval:
            raise OptimizerError(
                "progress_expiration must exceed two refresh intervals (a live peer's "
                "record would expire between two of its publications)"
            )


@dataclass(frozen=True, slots=True)
class OptimizerStatistics:
    """Counters of one peer's collaborative training
    (CONTRIBUTING.md, "Objects worth debugging have statistics()")."""

    epoch: int
    """Global optimizer steps (outer steps in DiLoCo mode) this peer has taken part in."""
    local_steps: int
    local_samples: int
    num_rounds: int
    """Averaging rounds that formed a group."""
    num_rounds_alone: int
    """Steps taken alone (no group formed in time)."""
    num_state_loads: int
    """Times this peer downloaded state (joining late or falling behind)."""
    num_splits: int
    """Times this peer found it had stepped apart from most of the swarm (and followed
    the majority's state)."""
    bytes_sent: int
    """Bytes this peer sent in averaging rounds."""
    num_peers: int
    """Peers in the swarm's current epoch, as last seen."""
    samples_per_second: float
    """This peer's measured training throughput."""
    num_rounds_not_agreed: int = 0
    """Rounds that formed a group but did not end with the group's agreed result (this
    peer then resynced from the swarm)."""
    num_rounds_without_group: int = 0
    """Steps where peers were there but no group formed in time (this peer resynced)."""
    round_seconds: float = 0.0
    """Seconds spent in rounds that formed a group, matchmaking and all-reduce."""
    matchmaking_seconds: float = 0.0
    """Of ``round_seconds``, forming the groups."""
    allreduce_seconds: float = 0.0
    """Of ``round_seconds``, the all-reduces (from a group's forming to its result)."""
    wait_seconds: float = 0.0
    """Seconds the training loop waited for the others' samples (gradient mode: this
    peer had its share of the global batch; DiLoCo: the others' inner steps), outside
    the rounds."""
    late_round_seconds: float = 0.0
    """DiLoCo with ``overlap``: seconds the training loop waited for a round in flight
    (at the next outer step, or when the swarm took it in first): the round's time
    that the inner steps did not hide."""
    round_latency: CallLatency = EMPTY_LATENCY
    """Each round that formed a group (matchmaking and all-reduce), as a histogram in
    ``peers.traffic.LATENCY_BUCKETS``: ``round_seconds`` split by duration."""
    reducer_spread: float = 0.0
    """With several reducers per part, the largest difference between two reducers'
    averages of one coordinate in the last round (``AveragingStep.spread``): rounding
    when they are honest, the size of the lie when one lies (and is outvoted)."""
