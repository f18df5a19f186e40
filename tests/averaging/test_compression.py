"""Compression codecs: one conformance test for every codec
(CONTRIBUTING.md, "Interfaces come with a conformance test"), error feedback, hostile
payloads, and the adaptive choice.

Randomised tests print their seed; set SWARMTRAIN_TEST_SEED to replay one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from averaging import (
    DECODERS,
    BFloat16Codec,
    Blockwise8BitCodec,
    Codec,
    CompressionError,
    EncodedTensor,
    EncodeError,
    ErrorFeedback,
    ErrorFeedbackConfig,
    Float16Codec,
    NoneCodec,
    PowerSGDCodec,
    PowerSGDConfig,
    TopKCodec,
    Uniform8BitCodec,
    choose_codec,
    decode_tensor,
)
from averaging.compression.quantization import CODEBOOK, CODEBOOK_HALF_GAP, nearest_codes
from peers.errors import LocalProtocolError, RemoteProtocolError
from peers.serialization import pack, unpack
from peers.wire import from_wire, to_wire

CODECS: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "float16": Float16Codec,
    "bfloat16": BFloat16Codec,
    "uint8": Uniform8BitCodec,
    "blockwise8": Blockwise8BitCodec,
    "topk": TopKCodec,
    "powersgd": PowerSGDCodec,
}
#: What the msgpack head of an encoded tensor may add to the declared payload bytes:
#: codec and dtype names, the shape, and per payload entry a key and a descriptor.
HEADER_BYTES = 128
FLOAT16_MAX = 65504.0


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Results do not depend on threads; one keeps the many small matmuls here fast on a
    busy machine, where two BLAS threads waking for a 96 x 80 product cost milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("SWARMTRAIN_TEST_SEED", random.randrange(2**32)))
    print(f"seed={value} (replay with SWARMTRAIN_TEST_SEED={value})")
    return value


def _mixed(g: torch.Generator) -> torch.Tensor:
    """Magnitudes from 1e-8 to 1e4 with random signs, and a last, partial block."""
    n = 3 * 4096 + 5
    exponents = torch.rand(n, generator=g) * 12 - 8
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return signs * 10.0**exponents


def _float16_extremes(g: torch.Generator) -> torch.Tensor:
    edges = torch.tensor([FLOAT16_MAX, -FLOAT16_MAX, 6e-8, -6e-8, 0.0, 1.0])
    return torch.cat([edges, torch.randn(994, generator=g)]).half()


def _outlier(g: torch.Generator) -> torch.Tensor:
    tensor = torch.randn(8192, generator=g)
    tensor[1234] = 1e6
    return tensor


CASES: dict[str, Callable[[torch.Generator], torch.Tensor]] = {
    "normal_1m": lambda g: torch.randn(1024, 1024, generator=g),
    "zeros": lambda g: torch.zeros(64, 32),
    "one": lambda g: torch.randn(1, generator=g),
    "three": lambda g: torch.randn(3, generator=g),
    "scalar": lambda g: torch.randn((), generator=g),
    "empty": lambda g: torch.zeros(0),
    "empty_2d": lambda g: torch.zeros(3, 0),
    "huge": lambda g: torch.randn(100, 50, generator=g) * 1e30,
    "mixed_magnitudes": _mixed,
    "subnormal": lambda g: torch.randn(64, generator=g) * 1e-40,
    "constant": lambda g: torch.full((80, 80), 3.25),
    "outlier": _outlier,
    "transposed": lambda g: torch.randn(96, 64, generator=g).T,
    "strided": lambda g: torch.randn(128, 96, generator=g)[::2, 1::3],
    "3d": lambda g: torch.randn(8, 16, 40, generator=g),
    "float16": lambda g: torch.randn(256, 64, generator=g).half(),
    "float16_extremes": _float16_extremes,
    "bfloat16": lambda g: torch.randn(256, 64, generator=g).bfloat16(),
    "bfloat16_huge": lambda g: (torch.randn(64, 64, generator=g) * 1e30).bfloat16(),
}


def _max_abs(tensor: torch.Tensor) -> float:
    return float(tensor.double().abs().max()) if tensor.numel() else 0.0


def _through_the_wire(encoded: EncodedTensor) -> tuple[EncodedTensor, int]:
    wire = pack(to_wire(encoded))
    return from_wire(EncodedTensor, unpack(wire)), len(wire)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(CODECS))
def test_codec_conformance(name: str, case: str, seed: int) -> None:
    """Round trip through the wire within the declared bound; real size as declared."""
    codec = CODECS[name]()
    tensor = CASES[case](torch.Generator().manual_seed(seed))
    before = tensor.clone()
    if name == "float16" and _max_abs(tensor) > FLOAT16_MAX:
        with pytest.raises(EncodeError, match="float16 cannot encode values of magnitude"):
            codec.encode(tensor)
        return
    bound = codec.error_bound(tensor)
    ratio = codec.compression_ratio(tensor)
    encoded = codec.encode(tensor)
    received, wire_bytes = _through_the_wire(encoded)
    tensor_bytes = tensor.numel() * tensor.element_size()
    with torch.no_grad():
        tensor.add_(1)  # the encoding must be a snapshot, not a view of the input
    decoded = codec.decode(received)

    assert decoded.shape == before.shape and decoded.dtype == before.dtype
    assert bool(torch.isfinite(decoded).all())
    error = _max_abs(decoded.double() - before.double())
    assert error <= bound, f"{name} on {case}: error {error} > declared bound {bound}"
    if case == "normal_1m":  # the bound is not vacuous either
        assert error >= bound / 4, f"{name}: error {error} is far below the bound {bound}"
    assert abs(wire_bytes - ratio * tensor_bytes) <= HEADER_BYTES, (
        f"{name} on {case}: {wire_bytes} bytes on the wire, declared {ratio} x {tensor_bytes}"
    )
    assert torch.equal(codec.decode(encoded), decoded)  # the local copy, after the add_
    assert torch.equal(decode_tensor(received), decoded)


def test_declared_ratios_for_a_large_float32_tensor() -> None:
    tensor = torch.zeros(1024, 1024)
    expected = {
        "none": 1.0,
        "float16": 0.5,
        "bfloat16": 0.5,
        "uint8": 0.25,
        "blockwise8": 0.25 + 1 / 4096,
        "topk": 0.02,
        "powersgd": 2048 * 4 / (1024 * 1024),
    }
    for name, make in CODECS.items():
        assert math.isclose(make().compression_ratio(tensor), expected[name], rel_tol=1e-3), name


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_our_error(name: str, bad: float) -> None:
    tensor = torch.randn(64, 80)
    tensor[3, 7] = bad
    with pytest.raises(EncodeError, match="NaN or infinity"):
        CODECS[name]().encode(tensor)


@pytest.mark.parametrize("name", list(CODECS))
def test_unsupported_dtypes_are_our_error(name: str) -> None:
    codec = CODECS[name]()
    with pytest.raises(EncodeError, match="cannot encode int64"):
        codec.encode(torch.arange(10))
    if name != "none":
        with pytest.raises(EncodeError, match="cannot encode float64"):
            codec.encode(torch.zeros(3, dtype=torch.float64))
    assert issubclass(EncodeError, LocalProtocolError) and issubclass(EncodeError, ValueError)
    assert issubclass(CompressionError, RemoteProtocolError)


def test_none_carries_float64_exactly() -> None:
    tensor = torch.randn(10, dtype=torch.float64) * 1e300
    received, _ = _through_the_wire(NoneCodec().encode(tensor))
    assert torch.equal(NoneCodec().decode(received), tensor)


# ---------------------------------------------------------------------------------------
# Hostile payloads: every malformed field is the remote's error, caught before allocation.

_WRONG_DTYPE = {
    "float32": np.float64,
    "float64": np.float32,
    "float16": np.float32,
    "uint8": np.int8,
    "uint16": np.int16,
    "int32": np.uint32,
    "int64": np.uint64,
}


def _replace(encoded: EncodedTensor, **payload: object) -> EncodedTensor:
    return dataclasses.replace(encoded, payload={**encoded.payload, **payload})  # type: ignore[dict-item]


def _mutations(encoded: EncodedTensor) -> Iterator[tuple[str, EncodedTensor]]:
    """Every way we know to break a valid encoding, each of which decode must refuse."""
    shape = encoded.shape
    yield "unknown codec name", dataclasses.replace(encoded, codec="bogus")
    other = "none" if encoded.codec != "none" else "float16"
    yield "another codec's name", dataclasses.replace(encoded, codec=other)
    yield "integer dtype", dataclasses.replace(encoded, dtype="int64")
    yield "unknown dtype", dataclasses.replace(encoded, dtype="float128")
    yield "2**40 elements", dataclasses.replace(encoded, shape=[2**20, 2**20])
    yield "one 2**40 size", dataclasses.replace(encoded, shape=[2**40])
    yield "negative size", dataclasses.replace(encoded, shape=[-shape[0], *shape[1:]])
    if encoded.codec == "topk":  # sparse: any shape at least as large as the indices fits
        yield "fewer elements than indices", dataclasses.replace(encoded, shape=[1])
    else:
        yield (
            "one row more than the payload",
            dataclasses.replace(encoded, shape=[shape[0] + 1, *shape[1:]]),
        )
    yield "40 dimensions", dataclasses.replace(encoded, shape=[1] * 40)
    yield "a fractional size", dataclasses.replace(encoded, shape=[1.5, *shape[1:]])  # type: ignore[list-item]
    yield "an extra key", _replace(encoded, junk=1)
    for key, value in encoded.payload.items():
        yield (
            f"no {key!r}",
            dataclasses.replace(
                encoded, payload={k: v for k, v in encoded.payload.items() if k != key}
            ),
        )
        yield f"{key!r} as a string", _replace(encoded, **{key: "x"})
        if isinstance(value, np.ndarray):
            yield f"{key!r} truncated", _replace(encoded, **{key: value[:-1]})
            yield (
                f"{key!r} one longer",
                _replace(encoded, **{key: np.concatenate([value, value[:1]])}),
            )
            wrong = _WRONG_DTYPE[value.dtype.name]
            yield (
                f"{key!r} as {np.dtype(wrong).name}",
                _replace(encoded, **{key: value.astype(wrong)}),
            )
            yield f"{key!r} as bool", _replace(encoded, **{key: value.astype(bool)})
            for label, bad in _bad_elements(value):
                broken = value.copy()
                broken.reshape(-1)[0] = bad
                yield f"{key!r} holding {label}", _replace(encoded, **{key: broken})
            if value.dtype.kind == "i" and value.size > 1:
                yield f"{key!r} reversed", _replace(encoded, **{key: value[::-1].copy()})
                broken = value.copy()
                broken[-1] = math.prod(shape)
                yield f"{key!r} past the end", _replace(encoded, **{key: broken})
        elif isinstance(value, float):
            for bad in (math.nan, math.inf, -math.inf, 1e300):
                yield f"{key!r} = {bad}", _replace(encoded, **{key: bad})
        elif isinstance(value, int):
            for bad_int in (-1, 0, 2**62):
                yield f"{key!r} = {bad_int}", _replace(encoded, **{key: bad_int})


def _bad_elements(array: np.ndarray) -> list[tuple[str, object]]:
    if array.dtype.kind == "f":
        return [("NaN", np.nan), ("infinity", np.inf)]
    if array.dtype.name == "uint16":  # bfloat16 bits
        return [("NaN", 0x7FC0), ("infinity", 0xFF80)]
    if array.dtype.kind == "i":
        return [("a negative index", -1)]
    return []  # uint8 codes: every value is a valid code


def _sample(name: str) -> torch.Tensor:
    """A tensor each codec encodes in its main (compressed) form."""
    return torch.randn(64, 96, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", list(CODECS))
def test_malformed_payloads_are_the_remotes_error(name: str) -> None:
    codec = CODECS[name]()
    encoded = codec.encode(_sample(name))
    if name == "powersgd":
        assert set(encoded.payload) == {"p", "q", "scale"}
    count = 0
    for label, broken in _mutations(encoded):
        with pytest.raises(CompressionError) as caught:
            codec.decode(broken)
        message = str(caught.value)
        assert name in message or "bogus" in message, f"{label}: unclear message {message!r}"
        count += 1
    assert count >= 15


def test_blockwise_rejects_a_block_size_that_disagrees_with_its_scales() -> None:
    codec = Blockwise8BitCodec()
    encoded = codec.encode(torch.randn(10_000))
    for size in (2048, 8192, 1):
        with pytest.raises(CompressionError, match="absmax"):
            codec.decode(_replace(encoded, block_size=size))


def test_uniform_rejects_a_grid_past_the_dtype() -> None:
    codec = Uniform8BitCodec()
    encoded = dataclasses.replace(codec.encode(torch.randn(100)), dtype="float16")
    with pytest.raises(CompressionError, match="grid top"):
        codec.decode(_replace(encoded, minimum=60000.0, scale=100.0))
    decoded = codec.decode(_replace(encoded, minimum=-65504.0, scale=2 * 65504 / 255))
    assert bool(torch.isfinite(decoded).all())


def test_powersgd_rejects_factors_that_could_overflow() -> None:
    codec = PowerSGDCodec()
    encoded = codec.encode(_sample("powersgd"))
    p = encoded.payload["p"]
    assert isinstance(p, np.ndarray)
    with pytest.raises(CompressionError, match="too large"):
        codec.decode(_replace(encoded, p=p * 1e30))
    with pytest.raises(CompressionError, match="not an n x r matrix"):
        codec.decode(_replace(encoded, p=np.zeros((64, 0), np.float32)))
    with pytest.raises(CompressionError, match="low-rank payload"):
        codec.decode(dataclasses.replace(encoded, shape=[64 * 96]))


def test_decode_tensor_refuses_unknown_codecs() -> None:
    encoded = NoneCodec().encode(torch.ones(3))
    with pytest.raises(CompressionError, match="unknown codec 'lz4'"):
        decode_tensor(dataclasses.replace(encoded, codec="lz4"))
    assert set(DECODERS) == set(CODECS)


@pytest.mark.parametrize("name", list(CODECS))
def test_corrupted_wire_bytes_never_decode_to_garbage(name: str, seed: int) -> None:
    """Random byte damage: a remote-fault error, or a finite tensor of the claimed shape."""
    rng = random.Random(seed)
    codec = CODECS[name]()
    wire = bytearray(pack(to_wire(codec.encode(_sample(name)))))
    outcomes = {"refused": 0, "decoded": 0}
    for _ in range(300):
        damaged = bytearray(wire)
        for _ in range(rng.randint(1, 3)):
            position = rng.randrange(len(damaged) if rng.random() < 0.5 else 120)
            damaged[position] = rng.randrange(256)
        if rng.random() < 0.2:
            damaged = damaged[: rng.randrange(len(damaged))]
        try:
            received = from_wire(EncodedTensor, unpack(bytes(damaged)))
            decoded = codec.decode(received)
        except RemoteProtocolError:
            outcomes["refused"] += 1
            continue
        outcomes["decoded"] += 1
        assert list(decoded.shape) == received.shape
        assert bool(torch.isfinite(decoded).all())
    assert outcomes["refused"] > 0 and outcomes["decoded"] > 0, outcomes


# ---------------------------------------------------------------------------------------
# Error feedback: nothing is lost, only delayed, and the residual stays bounded.


def _contraction_limit(delta: float) -> float:
    """sup_T ||e_T|| / ||t|| for a codec with ||x - C(x)||^2 <= (1 - delta) ||x||^2 fed a
    fixed t: the geometric series sum_{i>=1} sqrt(1 - delta)^i."""
    shrink = math.sqrt(1 - delta)
    return shrink / (1 - shrink)


@pytest.mark.parametrize(
    ("name", "make", "shape", "delta"),
    [
        # top-k keeps the k largest of n: at least k/n of the squared norm.
        ("topk", lambda: TopKCodec(fraction=0.05), (64, 64), math.ceil(0.05 * 4096) / 4096),
        # an exact rank-r truncation keeps at least r/min(n, m) of it; one warm-started
        # power iteration per round must do as well on a fixed matrix.
        ("powersgd", lambda: PowerSGDCodec(PowerSGDConfig(rank=4)), (96, 80), 4 / 80),
    ],
)
def test_error_feedback_accumulates_the_true_sum(
    name: str, make: Callable[[], Codec], shape: tuple[int, int], delta: float, seed: int
) -> None:
    tensor = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    feedback = ErrorFeedback(make())
    limit = _contraction_limit(delta) * float(tensor.norm())
    sent = torch.zeros(shape, dtype=torch.float64)
    rounds = 300
    mean_errors = []
    for round_ in range(1, rounds + 1):
        received, _ = _through_the_wire(feedback.encode(tensor, key="w"))
        sent += feedback.decode(received).double()
        residual = feedback.residual("w")
        assert residual is not None
        assert float(residual.norm()) <= limit, f"round {round_}: the residual grew past {limit}"
        # Nothing is lost: what was sent plus what is held is every round's tensor.
        total = sent + residual.double()
        assert float((total - round_ * tensor.double()).abs().max()) <= 1e-5 * round_ * (
            1 + _max_abs(tensor)
        )
        mean_errors.append(float((sent / round_ - tensor.double()).norm() / tensor.norm()))
    assert mean_errors[-1] <= limit / float(tensor.norm()) / rounds
    assert mean_errors[-1] < 0.25 * mean_errors[0], mean_errors[:: rounds // 10]


def test_error_feedback_state_is_bounded() -> None:
    feedback = ErrorFeedback(TopKCodec(), ErrorFeedbackConfig(max_keys=3))
    for i in range(5):
        feedback.encode(torch.randn(100), key=f"k{i}")
    stats = feedback.statistics()
    assert (stats.num_keys, stats.num_evictions, stats.residual_bytes) == (3, 2, 3 * 400)
    assert feedback.residual("k0") is None and feedback.residual("k4") is not None

    by_bytes = ErrorFeedback(TopKCodec(), ErrorFeedbackConfig(max_residual_bytes=1000))
    for i in range(4):
        by_bytes.encode(torch.randn(100), key=f"k{i}")
    assert by_bytes.statistics().num_keys == 2
    by_bytes.encode(torch.randn(1000), key="big")  # 4000 bytes: too big to keep at all
    assert by_bytes.residual("big") is None

    by_bytes.encode(torch.randn(10, 10), key="k3")  # a new shape restarts the residual
    assert by_bytes.statistics().num_resets == 1
    by_bytes.reset()
    assert by_bytes.statistics().num_keys == 0


def test_error_feedback_keeps_16_bit_tensors_in_their_dtype() -> None:
    feedback = ErrorFeedback(Blockwise8BitCodec())
    tensor = torch.randn(5000).half()
    encoded = feedback.encode(tensor, key="h")
    assert encoded.dtype == "float16" and feedback.decode(encoded).dtype == torch.float16
    residual = feedback.residual("h")
    assert residual is not None and residual.dtype == torch.float32


def test_powersgd_warm_start_improves_and_its_state_is_bounded(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    low_rank = torch.randn(200, 4, generator=g) @ torch.randn(4, 150, generator=g)
    matrix = low_rank + 0.01 * torch.randn(200, 150, generator=g)
    codec = PowerSGDCodec(PowerSGDConfig(rank=4, max_state_keys=2))
    cold = codec.error_bound(matrix, key="m")
    for _ in range(3):
        codec.encode(matrix, key="m")
    warm = codec.error_bound(matrix, key="m")
    # Warm-started power iterations reach the best rank-4 approximation (the SVD's),
    # whose error is the floor; a cold start can already be near it, so "at most half of
    # cold" held for most seeds but is not a property.
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    floor = float((matrix - (u[:, :4] * s[:4]) @ vh[:4]).abs().max())
    assert warm <= 1.01 * floor and warm < cold, (cold, warm, floor)
    assert codec.error_bound(matrix) == cold  # no key: no state, the same first Q
    for key in ("a", "b", "c"):
        codec.encode(matrix, key=key)
    assert codec.statistics().num_state_keys == 2
    assert codec.statistics().state_bytes == 2 * 150 * 4 * 4


# ---------------------------------------------------------------------------------------
# The blockwise codebook and its table-driven encoder.


def test_dynamic_codebook_shape() -> None:
    values = CODEBOOK[:255].astype(np.float64)
    assert CODEBOOK.shape == (256,) and CODEBOOK.dtype == np.float32
    assert bool(np.all(np.diff(values) > 0))
    assert values[0] == -1 and values[127] == 0 and values[254] == 1 and CODEBOOK[255] == 0
    assert bool(np.all(values[128:] == -values[126::-1]))  # symmetric
    assert values[128] == pytest.approx(1e-6)  # six decades below the block's absmax
    assert CODEBOOK_HALF_GAP == pytest.approx(0.9 / 64 / 2, rel=1e-5)


def test_blockwise_picks_nearest(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = CODEBOOK[:255].astype(np.float64)
    mids = (values[:-1] + values[1:]) / 2
    at_mids = mids.astype(np.float32)
    probes = np.concatenate(
        [
            rng.uniform(-1, 1, 200_000),
            rng.choice([-1, 1], 200_000) * 10.0 ** rng.uniform(-9, 0, 200_000),
            at_mids,
            np.nextafter(at_mids, np.float32(np.inf)),
            np.nextafter(at_mids, np.float32(-np.inf)),
            CODEBOOK,
            [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45],
        ]
    ).astype(np.float32)
    codes = nearest_codes(probes)
    distance = np.abs(CODEBOOK[codes].astype(np.float64) - probes)
    best = np.min(np.abs(values[None, :] - probes[:2000, None].astype(np.float64)), axis=1)
    assert np.array_equal(distance[:2000], best)
    # On all probes: no code is farther than the nearest one (ties either way).
    nearest = np.searchsorted(mids, probes.astype(np.float64))
    assert np.array_equal(distance, np.abs(values[nearest] - probes.astype(np.float64)))


# ---------------------------------------------------------------------------------------
# The adaptive choice.


@pytest.mark.parametrize(
    ("role", "numel", "dtype", "scale", "expected"),
    [
        ("gradient", 100, torch.float32, 1.0, "none"),
        ("gradient", 10_000, torch.float32, 1.0, "float16"),
        ("gradient", 10_000, torch.float32, 1e6, "bfloat16"),
        ("gradient", 100_000, torch.float32, 1.0, "blockwise8"),
        ("delta", 100_000, torch.float32, 1.0, "blockwise8"),
        ("delta", 10_000, torch.bfloat16, 1.0, "bfloat16"),
        ("parameter", 100_000, torch.float32, 1.0, "float16"),
        ("parameter", 100_000, torch.float32, 1e5, "bfloat16"),
        ("parameter", 100_000, torch.float16, 1.0, "float16"),
        ("parameter", 100_000, torch.bfloat16, 1.0, "bfloat16"),
        ("optimizer_state", 100_000, torch.float32, 1e-6, "bfloat16"),
        ("optimizer_state", 10, torch.float32, 1.0, "none"),
        ("parameter", 100_000, torch.float64, 1.0, "none"),
    ],
)
def test_choose_codec(
    role: str, numel: int, dtype: torch.dtype, scale: float, expected: str
) -> None:
    tensor = (torch.randn(numel) * scale).to(dtype)
    codec = choose_codec(tensor, role)  # type: ignore[arg-type]
    assert codec.name == expected
    decoded = codec.decode(codec.encode(tensor))  # what it picks can carry the tensor
    assert _max_abs(decoded.double() - tensor.double()) <= codec.error_bound(tensor)


def test_choose_codec_refuses_unknown_roles() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        choose_codec(torch.zeros(3), "weights")  # type: ignore[arg-type]


def test_configs_are_validated_and_keyword_only() -> None:
    with pytest.raises(ValueError, match="block_size"):
        Blockwise8BitCodec(block_size=0)
    with pytest.raises(ValueError, match="fraction"):
        TopKCodec(fraction=0.0)
    with pytest.raises(ValueError, match="rank"):
        PowerSGDConfig(rank=0)
    with pytest.raises(ValueError, match="max_keys"):
        ErrorFeedbackConfig(max_keys=0)
    with pytest.raises(TypeError):
        Blockwise8BitCodec(4096)  # type: ignore[call-arg]
