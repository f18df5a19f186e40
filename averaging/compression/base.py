"""The codec interface, the wire form of an encoded tensor, and checks shared by decoders.

A codec turns a tensor into an :class:`EncodedTensor`: plain wire values (the codec's
name, the original dtype and shape, and a payload of numpy arrays and scalars) that
``peers.wire``/``peers.serialization`` carry as a msgpack head plus raw array bytes
(CONTRIBUTING.md, "Wire messages are typed and decoded at the edge"). Decoding is the
receiving edge: every size, dtype and scale a remote claims is checked here *before*
anything is allocated from it, and a decoder never returns NaN or infinity
(docs/design/averaging.md, "Faults").

Whose fault (CONTRIBUTING.md, "Errors say whose fault it is"): :class:`CompressionError`
is the remote's (a payload that is malformed, truncated or inconsistent);
:class:`EncodeError` is ours (we asked a codec to carry a tensor it cannot, such as one
holding infinities or, for float16, values past 65504).

The codec name doubles as the payload's version: a codec whose payload layout or
codebook changes gets a new name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from peers.errors import LocalProtocolError, RemoteProtocolError
from peers.serialization import MAX_ARRAY_DIMS
from peers.serialization import dtype_name as np_dtype_name

#: Most elements one decoded tensor may have (1 GiB as float32). The butterfly splits
#: tensors into parts far smaller than this, and a model's largest single tensor (an
#: embedding of 50k x 4096) fits. It bounds what a payload can make us allocate, which
#: matters most for PowerSGD, whose rank-r payload of (n + m) * r floats claims n * m.
MAX_DECODED_ELEMENTS = 1 << 28

#: Largest magnitude the quantizing codecs (uint8, blockwise8, topk, powersgd) encode in
#: float32: 2**126, a factor 4 below float32's maximum, so that every intermediate
#: (a range max - min, a scale times a code, a low-rank product) stays finite with room
#: to spare. No gradient or parameter comes near it; the casts and "none" do not need it.
MAX_ENCODED_MAGNITUDE = 2.0**126

#: Relative room a decoder allows above a dtype's limit for the rounding of a legitimate
#: encoder (a scale rounded to float32, a product rounded once). 2**-13 is far above
#: those few ulps yet still below float16's overflow threshold (65504 * (1 + 2**-12)) and
#: bfloat16's, so a value that passes stays finite when cast to the original dtype.
DECODE_SLACK = 2.0**-13

#: dtypes a tensor may have on the way in and out. float64 is carried by "none" only
#: (the other codecs compute in float32 and would silently round it).
FLOAT_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
#: The dtypes every lossy codec accepts.
LOSSY_DTYPES = frozenset({"float32", "float16", "bfloat16"})

#: Unit roundoff and the largest rounding error near zero (half the smallest subnormal)
#: of each dtype: a value rounded to it moves by at most ``u * |x| + tiny``.
_ROUNDING: Mapping[str, tuple[float, float]] = {
    "float64": (0.0, 0.0),  # only "none" carries float64, and exactly
    "float32": (2.0**-24, 2.0**-150),
    "float16": (2.0**-11, 2.0**-25),
    "bfloat16": (2.0**-8, 2.0**-134),
}

PayloadValue = np.ndarray | int | float | bytes


class CompressionError(RemoteProtocolError):
    """An encoded tensor from a remote is malformed, truncated or inconsistent."""


class EncodeError(LocalProtocolError, ValueError):
    """We asked a codec to encode a tensor it cannot carry (our caller's fault).

    Raised for non-finite values, values past the codec's range (float16: 65504), and
    dtypes the codec does not take.
    """


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """An encoded tensor as it travels: a ``peers.wire`` message.

    Build it with a codec's ``encode``; send ``peers.wire.to_wire(encoded)``; receive
    with ``peers.wire.from_wire(EncodedTensor, raw)`` (which checks the field types) and
    hand it to the codec's ``decode`` (which checks everything else).
    """

    codec: str
    """Name of the codec that made it (and the payload layout's version)."""
    dtype: str
    """The original tensor's dtype name, e.g. ``"float32"``; decode returns this dtype."""
    shape: list[int]
    """The original tensor's shape; ``[]`` for a 0-d tensor."""
    payload: dict[str, PayloadValue]
    """Codec-specific arrays (sent as raw bytes) and scalars."""


class Codec(ABC):
    """A tensor compression codec: encode, decode, and what it promises.

    Every codec passes the same conformance test
    (CONTRIBUTING.md, "Interfaces come with a conformance test"): for any tensor it
    accepts, ``decode(encode(t))`` differs from ``t`` by at most ``error_bound(t)`` in
    every coordinate, keeps ``t``'s shape and dtype, and the packed payload's size is
    ``compression_ratio(t) * t.nbytes`` plus a header of a few dozen bytes.
    """

    name: ClassVar[str]
    """The wire name, e.g. ``"blockwise8"``."""
    round_safe: ClassVar[bool] = True
    """Whether an all-reduce round may carry it: every coordinate within its bound and
    no state between calls. A round sends each value once, so a codec that drops
    coordinates (top-k) or needs error feedback across calls has no way to catch up:
    the average would end mostly zero."""

    @abstractmethod
    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> EncodedTensor:
        """Encode ``tensor`` (any device, any strides; it is not modified or aliased).

        ``key`` names the tensor across rounds; codecs with per-tensor state (PowerSGD's
        warm-started Q) use it, the others ignore it. Raises :class:`EncodeError` for a
        tensor this codec cannot carry.
        """

    @abstractmethod
    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        """Rebuild a fresh CPU tensor of the original dtype and shape.

        Raises :class:`CompressionError` for a payload that is malformed, truncated,
        inconsistent or would decode to a non-finite value; sizes are checked before
        anything is allocated from them.
        """

    @abstractmethod
    def error_bound(self, tensor: torch.Tensor, *, key: str | None = None) -> float:
        """Largest absolute error of any coordinate of ``decode(encode(tensor))``.

        ``key`` as in :meth:`encode`; reading the bound leaves codec state unchanged.
        """

    @abstractmethod
    def compression_ratio(self, tensor: torch.Tensor) -> float:
        """Payload bytes on the wire per byte of ``tensor`` (headers not counted)."""


# ---------------------------------------------------------------------------------------
# Helpers for encoders


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flat_input(codec: str, tensor: torch.Tensor, dtypes: frozenset[str]) -> torch.Tensor:
    """``tensor`` detached, on the CPU, contiguous and 1-D (possibly a view of it).

    Raises :class:`EncodeError` if its dtype is not one of ``dtypes``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise EncodeError(f"{codec} encodes torch tensors, not {type(tensor).__name__}")
    name = dtype_name(tensor.dtype)
    if name not in dtypes:
        raise EncodeError(f"{codec} cannot encode {name} tensors (it takes {sorted(dtypes)})")
    return tensor.detach().cpu().contiguous().reshape(-1)


def magnitude_limit(dtype: str) -> float:
    """Largest magnitude the quantizing codecs carry for tensors of ``dtype``."""
    return float(torch.finfo(torch.float16).max) if dtype == "float16" else MAX_ENCODED_MAGNITUDE


def check_range(codec: str, low: float, high: float, limit: float) -> None:
    """Raise :class:`EncodeError` unless every value lies in ``[-limit, limit]``.

    ``low`` and ``high`` are the tensor's min and max (NaN if it holds a NaN).
    """
    if not (math.isfinite(low) and math.isfinite(high)):
        raise EncodeError(f"{codec} cannot encode a tensor holding NaN or infinity")
    if max(-low, high) > limit:
        raise EncodeError(
            f"{codec} cannot encode values of magnitude {max(-low, high):.3g} (limit {limit:.3g})"
        )


def min_max(flat: torch.Tensor) -> tuple[float, float]:
    """The min and max of a 1-D tensor (NaN if it holds a NaN; 0, 0 if it is empty)."""
    if flat.numel() == 0:
        return 0.0, 0.0
    low, high = torch.aminmax(flat)
    return float(low), float(high)


def rounding_error(dtype: str, magnitude: float) -> float:
    """The most a value of at most ``magnitude`` moves when rounded to ``dtype``."""
    unit, tiny = _ROUNDING[dtype]
    return unit * magnitude + tiny


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A read-only numpy view of a CPU tensor (a payload is sent, never written); bfloat16
    (which numpy lacks) as its uint16 bits. Read-only also makes a local decode of the
    payload copy it rather than share memory with the encoded tensor."""
    if tensor.dtype == torch.bfloat16:
        array = tensor.view(torch.int16).numpy().view(np.uint16)
    else:
        array = tensor.numpy()
    array.flags.writeable = False
    return array


# ---------------------------------------------------------------------------------------
# Checks for decoders: each names the codec and the field, and raises CompressionError.


def check_header(
    encoded: EncodedTensor, codec: str, dtypes: frozenset[str], max_elements: int
) -> tuple[str, tuple[int, ...], int]:
    """Check the codec name, dtype and shape; returns ``(dtype, shape, numel)``."""
    if not isinstance(encoded, EncodedTensor):
        raise CompressionError(f"{codec}: expected an EncodedTensor, got {type(encoded).__name__}")
    if encoded.codec != codec:
        raise CompressionError(f"{codec} cannot decode a tensor encoded by {encoded.codec!r}")
    if encoded.dtype not in dtypes:
        raise CompressionError(f"{codec}: dtype {encoded.dtype!r} is not one of {sorted(dtypes)}")
    shape = encoded.shape
    if not isinstance(shape, list | tuple) or len(shape) > MAX_ARRAY_DIMS:
        raise CompressionError(f"{codec}: shape {shape!r} is not a list of at most 32 sizes")
    numel = 1
    for size in shape:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CompressionError(f"{codec}: shape {list(shape)!r} holds an invalid size")
        numel *= size
        if numel > max_elements:
            raise CompressionError(
                f"{codec}: shape {list(shape)!r} has more than {max_elements} elements"
            )
    if not isinstance(encoded.payload, dict):
        raise CompressionError(f"{codec}: payload is not a map")
    return encoded.dtype, tuple(shape), numel


def check_keys(encoded: EncodedTensor, codec: str, keys: frozenset[str]) -> None:
    have = set(encoded.payload)
    if have != keys:
        missing, extra = sorted(keys - have), sorted(map(str, have - keys))
        raise CompressionError(
            f"{codec}: payload keys are {sorted(map(str, have))}; missing {missing}, "
            f"unexpected {extra}"
        )


def payload_array(
    encoded: EncodedTensor,
    codec: str,
    key: str,
    dtypes: Sequence[str],
    shape: tuple[int, ...],
) -> np.ndarray:
    """The array under ``key``, checked to have one of ``dtypes`` and exactly ``shape``."""
    value = encoded.payload.get(key)
    if not isinstance(value, np.ndarray):
        raise CompressionError(f"{codec}: payload {key!r} is {type(value).__name__}, not an array")
    if np_dtype_name(value.dtype) not in dtypes:
        raise CompressionError(
            f"{codec}: payload {key!r} has dtype {value.dtype.name}, expected one of {list(dtypes)}"
        )
    if value.shape != shape:
        raise CompressionError(
            f"{codec}: payload {key!r} has shape {list(value.shape)}, expected {list(shape)} "
            f"for a tensor of shape {list(encoded.shape)}"
        )
    return value


def payload_float(encoded: EncodedTensor, codec: str, key: str, low: float, high: float) -> float:
    """The number under ``key``, checked to be finite and in ``[low, high]``."""
    value = encoded.payload.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CompressionError(f"{codec}: payload {key!r} is {type(value).__name__}, not a number")
    number = float(value)
    if not (math.isfinite(number) and low <= number <= high):
        raise CompressionError(
            f"{codec}: payload {key!r} = {number!r} is outside [{low:.3g}, {high:.3g}]"
        )
    return number


def payload_int(encoded: EncodedTensor, codec: str, key: str, low: int, high: int) -> int:
    """The integer under ``key``, checked to be in ``[low, high]``."""
    value = encoded.payload.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CompressionError(f"{codec}: payload {key!r} is {type(value).__name__}, not an int")
    if not low <= value <= high:
        raise CompressionError(f"{codec}: payload {key!r} = {value} is outside [{low}, {high}]")
    return value


def all_finite(values: torch.Tensor) -> bool:
    """True when ``values`` holds no NaN or infinity.

    Fast path: a finite sum proves every value finite (a NaN or an infinity makes the sum
    NaN or infinite). Only when the sum is not finite (which a huge but finite tensor can
    also cause, by overflow) does it check element by element. The sum is one pass with
    no allocation; ``isfinite().all()`` allocates a mask and was far slower, once the
    largest single cost of an all-reduce round (docs/benchmarks.md, "Figures behind constants").
    """
    if values.numel() == 0:
        return True
    if math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(values).all())


def check_finite_output(codec: str, values: torch.Tensor) -> None:
    """Refuse a decoded tensor holding NaN or infinity (a remote sent those bits)."""
    if not all_finite(values):
        raise CompressionError(f"{codec}: payload decodes to NaN or infinity")


def finish(values: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Cast decoded values to the original dtype and shape."""
    return values.to(FLOAT_DTYPES[dtype]).reshape(shape)
