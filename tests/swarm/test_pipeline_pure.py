"""Pure parts of pipelines: stochastic wiring, rebalancing decisions, stage models,
configs, and the checks on downloaded optimizer state (no network, no loop)."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from peers.identity import KeyPair
from swarm.experts import Announcement, ExpertLocation
from swarm.experts.backend import DEFAULT_CLIP_GRAD_NORM
from swarm.pipeline import (
    MLPStages,
    PipelineConfig,
    StageLoad,
    StageServer,
    StageServerConfig,
    StageStateError,
    Wiring,
    WiringConfig,
    pressures,
    stage_to_join,
    stage_to_move,
)
from swarm.pipeline.replicas import ReplicaConfig, _optimizer_state

torch.set_num_threads(1)


def _announcements(*throughputs: float, load: int = 0) -> list[Announcement]:
    out = []
    for t in throughputs:
        peer_id = KeyPair.generate().peer_id
        out.append(Announcement(ExpertLocation("stage.1", peer_id), load=load, throughput=t))
    return out


class _FixedRandom(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


# --- wiring ------------------------------------------------------------------------------


def test_choice_is_proportional_to_throughput_with_a_seeded_rng() -> None:
    seed = 1234
    print("seed", seed)
    wiring = Wiring()
    slow, fast = _announcements(10.0, 30.0)
    wiring.update([slow, fast], now=0.0)
    rng = random.Random(seed)
    picks = [wiring.choose(8, 0.0, rng) for _ in range(20_000)]
    share = sum(p == fast.location for p in picks) / len(picks)
    assert abs(share - 0.75) < 0.015, share
    # the draw walks the weights in order: a point below 1/4 of the total is the first
    assert wiring.choose(8, 0.0, _FixedRandom(0.24)) == slow.location
    assert wiring.choose(8, 0.0, _FixedRandom(0.26)) == fast.location


def test_queue_counted_in_micro_batches_lowers_the_odds() -> None:
    wiring = Wiring()
    a, b = _announcements(10.0, 10.0)
    wiring.update([a, b], now=0.0)
    wiring.on_start(a.location.peer_id, 16)  # one micro-batch of 16 in flight at a
    weights = wiring.weights(16, now=0.0)
    assert weights[a.location.peer_id] == pytest.approx(5.0)  # 10 / (1 + 16/16)
    assert weights[b.location.peer_id] == pytest.approx(10.0)
    wiring.on_success(a.location.peer_id, 16, None, now=0.1)
    assert wiring.weights(16, now=0.1)[a.location.peer_id] == pytest.approx(10.0)


def test_measurements_replace_announcements_and_newcomers_get_the_mean() -> None:
    wiring = Wiring(WiringConfig(smoothing=0.5))
    a, b = _announcements(1000.0, 1000.0)
    wiring.update([a, b], now=0.0)
    wiring.on_start(a.location.peer_id, 10)
    wiring.on_success(a.location.peer_id, 10, 0.1, now=0.1)  # 100 samples/s end to end
    wiring.on_start(a.location.peer_id, 10)
    wiring.on_success(a.location.peer_id, 10, 0.05, now=0.2)  # 200: smoothed to 150
    weights = wiring.weights(10, now=0.2)
    assert weights[a.location.peer_id] == pytest.approx(150.0)
    # b was never measured: it gets the stage's measured mean, not its announcement
    assert weights[b.location.peer_id] == pytest.approx(150.0)
    (c,) = _announcements(5.0)
    wiring.update([a, b, c], now=0.3)  # a newcomer keeps the others' measurements
    assert wiring.weights(10, now=0.3)[c.location.peer_id] == pytest.approx(150.0)


def test_a_failed_server_is_banned_until_the_ban_expires_and_retries_go_elsewhere() -> None:
    wiring = Wiring(WiringConfig(ban_seconds=10.0, busy_seconds=1.0))
    a, b = _announcements(10.0, 10.0)
    wiring.update([a, b], now=0.0)
    rng = random.Random(7)
    wiring.on_start(a.location.peer_id, 4)
    wiring.on_failure(a.location.peer_id, 4, now=1.0, busy=False)
    # the retry (and every choice for 10 s) picks the other one
    assert {wiring.choose(4, 1.0 + i / 10, rng) for i in range(90)} == {b.location}
    assert wiring.is_banned(a.location.peer_id, 10.9)
    # the DHT still listing it does not lift the ban
    wiring.update([a, b], now=5.0)
    assert wiring.live(5.0) == [b.location]
    assert not wiring.is_banned(a.location.peer_id, 11.0)
    assert a.location in {wiring.choose(4, 11.0, rng) for _ in range(50)}
    # busy: a short ban
    wiring.on_failure(b.location.peer_id, 4, now=20.0, busy=True)
    assert wiring.is_banned(b.location.peer_id, 20.5)
    assert not wiring.is_banned(b.location.peer_id, 21.0)
    # everyone banned: nothing to choose (the client then waits, then raises)
    wiring.on_failure(a.location.peer_id, 4, now=30.0, busy=False)
    wiring.on_failure(b.location.peer_id, 4, now=30.0, busy=False)
    assert wiring.choose(4, 30.0, rng) is None
    (record,) = [r for r in wiring.statistics(30.0) if r.peer_id == a.location.peer_id]
    assert record.banned and record.num_failures == 2 and record.num_calls == 1


def test_servers_that_leave_the_listing_are_forgotten() -> None:
    wiring = Wiring()
    a, b = _announcements(10.0, 10.0)
    wiring.update([a, b], now=0.0)
    wiring.update([b], now=1.0)
    assert wiring.live(1.0) == [b.location] and wiring.num_listed == 1
    wiring.update([], now=2.0)
    assert wiring.choose(1, 2.0, random.Random(0)) is None


def test_wiring_config_is_validated() -> None:
    with pytest.raises(ValueError, match="ban_seconds"):
        WiringConfig(ban_seconds=-1)
    with pytest.raises(ValueError, match="smoothing"):
        WiringConfig(smoothing=0)


# --- rebalancing ---------------------------------------------------------------------------


def test_a_newcomer_joins_the_stage_with_the_highest_pressure() -> None:
    # equal modules: the stage with fewest servers
    assert stage_to_join([StageLoad(2, (100, 100)), StageLoad(1, (100,)), StageLoad(2)]) == 1
    # a stage nobody serves comes first
    assert stage_to_join([StageLoad(1, (10,)), StageLoad(0), StageLoad(3)]) == 1
    # a heavy stage with more servers can still be the bottleneck: 1/10/3 > 1/100/1
    assert stage_to_join([StageLoad(1, (100,)), StageLoad(3, (10, 10, 9))]) == 1
    # the cost is the median of the servers' figures: one noisy server does not decide
    assert stage_to_join([StageLoad(2, (100, 1)), StageLoad(2, (50, 50))]) == 1
    # ties: fewest servers, then the first stage, or a random one: a fresh swarm spreads
    assert stage_to_join([StageLoad(2), StageLoad(2)]) == 0
    fresh = [StageLoad(0)] * 3
    rng = random.Random(3)
    assert {stage_to_join(fresh, rng) for _ in range(50)} == {0, 1, 2}
    # unknown throughput takes the median of the known stages
    assert pressures([StageLoad(1, (10,)), StageLoad(2, (0, 0))]) == [0.1, 0.05]
    with pytest.raises(ValueError):
        stage_to_join([])


def test_a_server_moves_only_when_it_lowers_the_bottleneck_beyond_hysteresis() -> None:
    loads = [StageLoad(3, (100, 100, 100)), StageLoad(1, (100,))]
    assert stage_to_move(loads, current=0, hysteresis=0.2) == 1  # 1/100 -> 1/200
    assert stage_to_move(loads, current=1, hysteresis=0.2) is None  # its last server
    balanced = [StageLoad(2, (100, 100)), StageLoad(2, (100, 100))]
    assert stage_to_move(balanced, current=0, hysteresis=0.0) is None  # 1/200 -> 1/100
    # 5 and 3 servers of equal stages: moving one lowers the bottleneck by a third
    uneven = [StageLoad(5, (100,) * 5), StageLoad(3, (100,) * 3)]
    assert stage_to_move(uneven, current=0, hysteresis=0.2) == 1
    assert stage_to_move(uneven, current=0, hysteresis=0.5) is None  # not enough
    # 4 and 3: moving would only swap which stage is the bottleneck
    assert stage_to_move([StageLoad(4), StageLoad(3)], current=0, hysteresis=0.0) is None
    assert stage_to_move([StageLoad(2), StageLoad(0)], current=0, hysteresis=5.0) == 1
    with pytest.raises(ValueError):
        stage_to_move(loads, current=2, hysteresis=0.2)


# --- stage models, configs, downloaded state ---------------------------------------------


def test_mlp_stages_build_the_local_model_stage_by_stage() -> None:
    model = MLPStages(widths=((6, 8), (8, 12, 8), (8, 3)), seed=5)
    local = model.build_local()
    x = torch.randn(4, 6)
    h = x
    for i in range(model.num_stages):
        stage, inputs = model.build_stage(i)
        assert inputs[0].shape == [model.widths[i][0]]
        h = stage(h)
    assert torch.equal(h, local(x))  # equal initialisation, whoever builds a stage
    assert isinstance(local[2][-1], torch.nn.Linear)  # no ReLU after the logits
    assert isinstance(local[1][-1], torch.nn.ReLU)
    with pytest.raises(ValueError, match="stage 1 takes 7"):
        MLPStages(widths=((6, 8), (7, 3)))
    with pytest.raises(ValueError, match="at least one layer"):
        MLPStages(widths=((6,),))
    with pytest.raises(ValueError):
        model.build_stage(3)


def test_configs_are_validated_on_construction() -> None:
    with pytest.raises(ValueError, match="num_stages"):
        PipelineConfig(num_stages=0)
    with pytest.raises(ValueError, match="max_attempts"):
        PipelineConfig(num_stages=2, max_attempts=0)
    with pytest.raises(ValueError):
        PipelineConfig(num_stages=2, uid_prefix="not a name")
    assert PipelineConfig(num_stages=2).uids == ["stage.0", "stage.1"]
    model = MLPStages(widths=((2, 2), (2, 2)))
    with pytest.raises(ValueError, match="outside"):
        StageServerConfig(model=model, stage=2)
    with pytest.raises(ValueError, match="rebalance_interval"):
        StageServerConfig(model=model, rebalance_interval_seconds=0)
    with pytest.raises(ValueError, match="run_id"):
        ReplicaConfig(run_id="a/b")
    with pytest.raises(ValueError, match="clip_grad_norm"):
        StageServerConfig(model=model, clip_grad_norm=0.0)


def test_a_stage_clips_each_callers_gradient_by_default() -> None:
    """A stage server trains on strangers' backward calls, as an expert server does, so
    it clips each caller's contribution and each step by default (docs/experts-trust.md);
    ``None`` turns clipping off for callers one trusts."""
    model = MLPStages(widths=((2, 2), (2, 2)))
    config = StageServerConfig(model=model)
    assert config.clip_grad_norm == DEFAULT_CLIP_GRAD_NORM == 1.0
    backend = StageServer._build(cast(StageServer, SimpleNamespace(config=config)), 0)
    assert backend.clip_grad_norm == DEFAULT_CLIP_GRAD_NORM
    unclipped = StageServerConfig(model=model, clip_grad_norm=None)
    server = cast(StageServer, SimpleNamespace(config=unclipped))
    assert StageServer._build(server, 0).clip_grad_norm is None


def test_downloaded_optimizer_state_must_fit_our_parameters() -> None:
    params = {"0.weight": torch.zeros(3, 2), "0.bias": torch.zeros(3)}
    good = {
        "extra/param/0.weight": torch.ones(3, 2),
        "extra/opt/0.weight/momentum_buffer": torch.ones(3, 2),
        "extra/opt/0.bias/step": torch.tensor(4.0),
    }
    assert set(_optimizer_state(good, params)) == {
        ("0.weight", "momentum_buffer"),
        ("0.bias", "step"),
    }
    for bad in (
        {"extra/opt/1.weight/momentum_buffer": torch.ones(3, 2)},  # not our parameter
        {"extra/opt/0.weight/momentum_buffer": torch.ones(2, 3)},  # wrong shape
        {"extra/opt/0.weight/not a key": torch.ones(3, 2)},
        {"extra/opt/0.bias/step": torch.tensor(4)},  # an integer tensor
    ):
        with pytest.raises(StageStateError):
            _optimizer_state(bad, params)
