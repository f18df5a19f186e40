"""Tensor compression codecs behind one interface (docs/design/averaging.md,
"Compression on the wire").

- :class:`Codec`: ``encode`` a tensor into an :class:`EncodedTensor` (plain wire values),
  ``decode`` it back, and declare ``error_bound`` and ``compression_ratio``.
- Codecs: ``none``, ``float16``, ``bfloat16`` (casts, module ``casts``); ``uint8`` and
  ``blockwise8`` (module ``quantization``); ``topk`` (``sparse``); ``powersgd``.
- :class:`ErrorFeedback` carries what a lossy codec dropped into the next round.
- :func:`choose_codec` picks one by size and role; :func:`decode_tensor` decodes by name.

Errors: :class:`CompressionError` (a remote's bad payload), :class:`EncodeError` (a tensor
we cannot encode).
"""

from averaging.compression.adaptive import (
    DECODERS,
    MIN_COMPRESSED_ELEMENTS,
    MIN_QUANTIZED_ELEMENTS,
    ROLES,
    Role,
    choose_codec,
    decode_tensor,
)
from averaging.compression.base import (
    MAX_DECODED_ELEMENTS,
    MAX_ENCODED_MAGNITUDE,
    Codec,
    CompressionError,
    EncodedTensor,
    EncodeError,
)
from averaging.compression.casts import BFloat16Codec, Float16Codec, NoneCodec
from averaging.compression.feedback import (
    ErrorFeedback,
    ErrorFeedbackConfig,
    ErrorFeedbackStatistics,
)
from averaging.compression.powersgd import PowerSGDCodec, PowerSGDConfig, PowerSGDStatistics
from averaging.compression.quantization import Blockwise8BitCodec, Uniform8BitCodec
from averaging.compression.sparse import TopKCodec

__all__ = [
    "DECODERS",
    "MAX_DECODED_ELEMENTS",
    "MAX_ENCODED_MAGNITUDE",
    "MIN_COMPRESSED_ELEMENTS",
    "MIN_QUANTIZED_ELEMENTS",
    "ROLES",
    "BFloat16Codec",
    "Blockwise8BitCodec",
    "Codec",
    "CompressionError",
    "EncodeError",
    "EncodedTensor",
    "ErrorFeedback",
    "ErrorFeedbackConfig",
    "ErrorFeedbackStatistics",
    "Float16Codec",
    "NoneCodec",
    "PowerSGDCodec",
    "PowerSGDConfig",
    "PowerSGDStatistics",
    "Role",
    "TopKCodec",
    "Uniform8BitCodec",
    "choose_codec",
    "decode_tensor",
]
