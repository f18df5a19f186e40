"""Built-in tasks: bundled data, deterministic disjoint shards, baselines that learn."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm.baseline import BaselineConfig, run_baseline
from swarm.errors import TaskError
from swarm.optim_spec import OptimizerSpec
from swarm.tasks import (
    TASKS,
    CharLMTask,
    DigitsTask,
    SampleStream,
    Task,
    get_task,
    load_digits,
    peer_positions,
    stdlib_corpus,
)

ROOT = Path(__file__).resolve().parents[2]
DIGITS_SHA256 = "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"
"""Of images.tobytes() + labels.tobytes(): the exact data scikit-learn ships."""


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Results compared across runs are computed with one thread (see swarm.baseline)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits() -> DigitsTask:
    return DigitsTask()


@pytest.fixture(scope="module")
def charlm() -> CharLMTask:
    return CharLMTask()


# -- data -------------------------------------------------------------------------------


def test_digits_ship_with_the_package_and_are_the_optdigits_set() -> None:
    images, labels = load_digits()
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest() == DIGITS_SHA256
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert (ROOT / "swarm" / "data" / "digits.npz").stat().st_size < 100_000
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "data/*" in package_data["package-data"]["swarm"]


def test_digits_split_is_fixed_and_disjoint(digits: DigitsTask) -> None:
    assert digits.num_train == 1437 and len(digits.test_targets) == 360
    again = DigitsTask()
    assert torch.equal(digits.test_inputs, again.test_inputs)
    train = {row.numpy().tobytes() for row in digits.train_inputs}
    # optdigits has a few duplicate images; the split is by index, so allow those only
    overlap = sum(row.numpy().tobytes() in train for row in digits.test_inputs)
    assert overlap <= 3


def test_stdlib_corpus_is_ascii_deterministic_and_big_enough() -> None:
    corpus = stdlib_corpus()
    assert len(corpus.train) > 500_000 and len(corpus.test) > 50_000
    assert max(corpus.train) < 128 and max(corpus.test) < 128
    assert b"\r\n" not in corpus.train
    assert b"def " in corpus.train and b"class " in corpus.test
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import hashlib; from swarm.tasks.corpus import stdlib_corpus as s; c = s(); "
            "print(hashlib.sha256(c.train + c.test).hexdigest())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == hashlib.sha256(corpus.train + corpus.test).hexdigest()


def test_a_python_without_sources_is_told_so() -> None:
    with pytest.raises(TaskError, match=r"without \.py sources"):
        stdlib_corpus(("no_such_module_anywhere", "sys"))  # sys is built in: no source


# -- the sample stream and the shards -------------------------------------------------------


def test_the_stream_is_one_permutation_per_epoch_and_depends_only_on_the_seed() -> None:
    stream = SampleStream(10, seed=3)
    first = stream.indices(0, 30)
    for epoch in range(3):
        assert sorted(first[epoch * 10 : (epoch + 1) * 10].tolist()) == list(range(10))
    assert not np.array_equal(first[:10], first[10:20])
    assert np.array_equal(SampleStream(10, seed=3).indices(7, 23), first[7:23])
    assert not np.array_equal(SampleStream(10, seed=4).indices(0, 30), first)
    assert stream.indices(5, 5).size == 0


@pytest.mark.parametrize(("num_peers", "batch_size"), [(1, 7), (2, 32), (3, 5), (4, 100)])
def test_peer_batches_are_disjoint_and_together_form_the_single_process_batch(
    digits: DigitsTask, num_peers: int, batch_size: int
) -> None:
    seed, num_steps = 11, 12
    peers = [
        list(islice(digits.batches(rank, num_peers, batch_size, seed), num_steps))
        for rank in range(num_peers)
    ]
    single = list(islice(digits.batches(0, 1, num_peers * batch_size, seed), num_steps))
    for step in range(num_steps):
        inputs = torch.cat([peers[rank][step][0] for rank in range(num_peers)])
        targets = torch.cat([peers[rank][step][1] for rank in range(num_peers)])
        assert torch.equal(inputs, single[step][0]) and torch.equal(targets, single[step][1])
    # positions are owned by exactly one (peer, step): within the first epoch, disjoint
    owned = [
        p
        for rank in range(num_peers)
        for step in range(num_steps)
        for p in range(*peer_positions(step, rank, num_peers, batch_size))
    ]
    assert len(owned) == len(set(owned))
    indices = SampleStream(digits.num_train, seed).indices(0, digits.num_train)
    first_epoch = [int(indices[p]) for p in owned if p < digits.num_train]
    assert len(first_epoch) == len(set(first_epoch))


def test_batches_are_deterministic_and_resume_at_a_step(charlm: CharLMTask) -> None:
    a = list(islice(charlm.batches(1, 3, 4, seed=5), 6))
    b = list(islice(charlm.batches(1, 3, 4, seed=5), 6))
    resumed = next(charlm.batches(1, 3, 4, seed=5, start_step=4))
    for (x, y), (u, v) in zip(a, b, strict=True):
        assert torch.equal(x, u) and torch.equal(y, v)
    assert torch.equal(resumed[0], a[4][0])
    x, y = a[0]
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


@pytest.mark.parametrize(
    "args",
    [(3, 3, 4, 0), (-1, 2, 4, 0), (0, 0, 4, 0), (0, 2, 0, 0), (0, 2, 4, -1), (0, 2, 4, 2**63)],
)
def test_bad_batch_arguments_are_task_errors(digits: DigitsTask, args: tuple[int, ...]) -> None:
    with pytest.raises(TaskError):
        digits.batches(*args)  # at the call, not at the first batch


# -- models and evaluation ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TASKS))
def test_models_depend_only_on_the_seed_and_leave_the_global_rng_alone(name: str) -> None:
    task = get_task(name)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = task.make_model(0), task.make_model(0), task.make_model(1)
    assert torch.equal(torch.rand(3), expected_next)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert any(
        not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True)
    )


def test_evaluate_reports_metrics_and_restores_training_mode(
    digits: DigitsTask, charlm: CharLMTask
) -> None:
    model = digits.make_model(0)
    metrics = digits.evaluate(model)
    assert set(metrics) == {"loss", "accuracy"} and model.training
    assert metrics["accuracy"] < 0.3  # untrained: about chance
    lm = charlm.make_model(0)
    metrics = charlm.evaluate(lm)
    assert set(metrics) == {"loss", "bits_per_char", "accuracy"} and lm.training
    assert 6.0 < metrics["bits_per_char"] < 8.5  # untrained: about log2(128) = 7


def test_registry() -> None:
    assert set(TASKS) == {"digits", "charlm"}
    assert isinstance(get_task("digits"), Task)
    with pytest.raises(TaskError, match=r"unknown task 'mnist'.*charlm, digits"):
        get_task("mnist")


# -- the baseline ---------------------------------------------------------------------------


def test_digits_baseline_reaches_high_accuracy_and_is_deterministic(digits: DigitsTask) -> None:
    config = BaselineConfig.from_recipe("digits", seed=0, eval_every_steps=100)
    result = run_baseline(config, task=digits)
    print(f"digits: {result.metrics} after {result.num_samples} samples")
    assert result.metrics["accuracy"] > 0.9
    assert result.num_steps == len(result.loss_curve) == config.num_samples // config.batch_size
    assert [step for step, _ in result.eval_curve] == [100, 200, 300, result.num_steps]
    again = run_baseline(config, task=digits)
    assert again.loss_curve == result.loss_curve and again.metrics == result.metrics


def test_charlm_baseline_loss_falls(charlm: CharLMTask) -> None:
    config = dataclasses.replace(BaselineConfig.from_recipe("charlm"), num_samples=32 * 60)
    before = charlm.evaluate(charlm.make_model(config.seed))
    result = run_baseline(config, task=charlm)
    print(f"charlm: {before} -> {result.metrics}")
    assert result.metrics["bits_per_char"] < before["bits_per_char"] - 2.0
    assert np.mean(result.loss_curve[-10:]) < result.loss_curve[0] - 1.5


def test_the_baseline_uses_floor_steps_and_refuses_bad_configs(digits: DigitsTask) -> None:
    spec = OptimizerSpec(kind="adam", lr=1e-3)
    result = run_baseline(
        BaselineConfig(task="digits", batch_size=10, num_samples=35, optimizer=spec), task=digits
    )
    assert result.num_steps == 3 and result.num_samples == 30
    with pytest.raises(TaskError):
        BaselineConfig(task="digits", batch_size=10, num_samples=5, optimizer=spec)
    with pytest.raises(TaskError, match="charlm"):
        run_baseline(
            BaselineConfig(task="charlm", batch_size=1, num_samples=1, optimizer=spec), task=digits
        )


def test_optimizer_specs_validate_and_round_trip() -> None:
    spec = OptimizerSpec(kind="sgd", lr=0.1, momentum=0.9, nesterov=True)
    assert OptimizerSpec.from_dict(spec.to_dict()) == spec
    assert isinstance(
        OptimizerSpec(kind="adamw", lr=1e-3).build([torch.nn.Parameter(torch.ones(1))]),
        torch.optim.AdamW,
    )
    for bad in [
        {"kind": "lion", "lr": 1e-3},
        {"kind": "sgd", "lr": 0.0},
        {"kind": "sgd", "lr": 0.1, "nesterov": True},
        {"kind": "adam", "lr": 1e-3, "betas": [0.9, 1.0]},
        {"kind": "adam", "lr": 1e-3, "colour": "blue"},
        {"lr": 1e-3},
    ]:
        with pytest.raises(TaskError):
            OptimizerSpec.from_dict(bad)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_adam_specs_build_the_fused_update_and_it_matches_the_plain_one(kind: str) -> None:
    spec = OptimizerSpec(kind=kind, lr=1e-2, weight_decay=0.1)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 32, generator=gen), torch.randn(32, generator=gen)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(5)]
    fused_params = [torch.nn.Parameter(t.clone()) for t in start]
    fused = spec.build(fused_params)
    assert fused.param_groups[0]["fused"] is True
    plain_params = [torch.nn.Parameter(t.clone()) for t in start]
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    plain = cls(plain_params, lr=1e-2, weight_decay=0.1)
    for step_grads in grads:
        for optimizer, params in ((fused, fused_params), (plain, plain_params)):
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
    for a, b, s in zip(fused_params, plain_params, start, strict=True):
        assert not torch.equal(a, s)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # What the fused kernels do not take gets the plain implementation, which then steps.
    odd = [
        torch.nn.Parameter(torch.ones(2)),
        torch.nn.Parameter(torch.ones(2, dtype=torch.complex64)),
    ]
    plain_fallback = spec.build(odd)
    assert not plain_fallback.param_groups[0]["fused"]
    for p in odd:
        p.grad = torch.ones_like(p)
    plain_fallback.step()
    assert float(odd[0].detach()[0]) < 1.0


def test_importing_swarm_does_not_load_torch() -> None:
    code = "import sys, swarm, swarm.errors; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
