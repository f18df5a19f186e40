"""Partitioning: exact, deterministic splits; chunking; flatten and unflatten.

Randomised tests print their seed; set SWARMTRAIN_TEST_SEED to replay one.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from fractions import Fraction

import pytest
import torch

from averaging import PartitionError, chunk_ranges, flatten, split_parts, unflatten


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("SWARMTRAIN_TEST_SEED", random.randrange(2**32)))
    print(f"seed={value} (replay with SWARMTRAIN_TEST_SEED={value})")
    return value


def _check_split(total: int, weights: list[float]) -> list[tuple[int, int]]:
    parts = split_parts(total, weights)
    assert len(parts) == len(weights)
    assert parts[0][0] == 0 and parts[-1][1] == total
    for (_, end), (start, _) in itertools.pairwise(parts):
        assert end == start  # contiguous, in member order
    exact = [Fraction(w) for w in weights]
    for (start, end), w in zip(parts, exact, strict=True):
        share = total * w / sum(exact)
        assert end >= start and abs((end - start) - share) < 1  # within one of its share
        if w == 0:
            assert end == start  # client-mode peers reduce nothing
    return parts


def test_split_sizes_are_exact_shares(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(1, 20)
        weights = [rng.choice([0.0, rng.random(), rng.uniform(1, 1e9)]) for _ in range(n)]
        if not any(weights):
            weights[rng.randrange(n)] = 1.0
        _check_split(rng.choice([0, 1, 7, rng.randint(0, 10**7)]), weights)


def test_split_known_values() -> None:
    assert split_parts(10, [1, 1, 1]) == [(0, 4), (4, 7), (7, 10)]  # tie: lower index
    assert split_parts(10, [1, 0, 3]) == [(0, 3), (3, 3), (3, 10)]  # 2.5 -> 3, 7.5 -> 7
    assert split_parts(0, [1, 2]) == [(0, 0), (0, 0)]
    assert split_parts(5, [0, 0, 2]) == [(0, 0), (0, 0), (0, 5)]
    assert split_parts(2**40 + 3, [1.0]) == [(0, 2**40 + 3)]


def test_split_is_deterministic_and_scale_free(seed: int) -> None:
    rng = random.Random(seed)
    weights = [rng.uniform(0.1, 100.0) for _ in range(16)]
    first = split_parts(123_457, weights)
    assert split_parts(123_457, tuple(weights)) == first
    # Exact arithmetic: scaling every weight by a power of two changes nothing at all.
    assert split_parts(123_457, [w * 1024 for w in weights]) == first


@pytest.mark.parametrize(
    "weights",
    [[], [1.0, -1.0], [math.nan, 1.0], [math.inf, 1.0], [0.0, 0.0]],
    ids=["empty", "negative", "nan", "inf", "all-zero"],
)
def test_split_rejects_bad_weights(weights: list[float]) -> None:
    with pytest.raises(PartitionError):
        split_parts(10, weights)


def test_split_rejects_bad_total() -> None:
    with pytest.raises(PartitionError):
        split_parts(-1, [1.0])
    with pytest.raises(PartitionError):
        split_parts(True, [1.0])
    assert issubclass(PartitionError, ValueError)


def test_chunk_ranges() -> None:
    assert chunk_ranges(3, 3, 4) == []
    assert chunk_ranges(3, 13, 4) == [(3, 7), (7, 11), (11, 13)]
    assert chunk_ranges(0, 8, 4) == [(0, 4), (4, 8)]
    assert chunk_ranges(5, 6, 100) == [(5, 6)]
    for bad in [(4, 3, 1), (-1, 3, 1), (0, 3, 0)]:
        with pytest.raises(PartitionError):
            chunk_ranges(*bad)


def test_flatten_round_trip(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(3, 4, generator=g),
        torch.randn(5, generator=g).to(torch.float16),
        torch.randn(2, 2, 2, generator=g).to(torch.bfloat16),
        torch.randn((), generator=g),
        torch.zeros(0, 7),
    ]
    flat = flatten(tensors)
    assert flat.dtype == torch.float32 and flat.shape == (12 + 5 + 8 + 1,)
    back = unflatten(flat, tensors)
    for original, restored in zip(tensors, back, strict=True):
        assert restored.dtype == original.dtype and restored.shape == original.shape
        assert torch.equal(restored, original)
    flat[0] = 42.0  # a float32 piece is a view of the flat vector
    assert back[0][0, 0] == 42.0 and tensors[0][0, 0] != 42.0


def test_flatten_edges() -> None:
    assert flatten([]).shape == (0,) and unflatten(torch.zeros(0), []) == []
    with pytest.raises(PartitionError):
        flatten([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(PartitionError):
        unflatten(torch.zeros(5), [torch.zeros(2, 2)])
    with pytest.raises(PartitionError):
        unflatten(torch.zeros(2, 2), [torch.zeros(2, 2)])
