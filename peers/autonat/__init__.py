"""AutoNAT v1 (libp2p specs, autonat/autonat-v1.md): the pure layers.

:mod:`~peers.autonat.messages` holds the wire messages, :mod:`~peers.autonat.policy`
what a server may dial back and how often it serves. No I/O, no clock reads.
"""

from peers.autonat.messages import (
    AUTONAT_PROTOCOL_ID,
    MAX_AUTONAT_MESSAGE_BYTES,
    AutoNATMessage,
    AutoNATProtocolError,
    Dial,
    DialResponse,
    MessageType,
    ResponseStatus,
    decode_autonat_message,
    encode_autonat_message,
)
from peers.autonat.policy import (
    MAX_DIAL_BACK_ADDRS,
    DialRateLimiter,
    check_dial_request,
    dial_back_addresses,
)

__all__ = [
    "AUTONAT_PROTOCOL_ID",
    "MAX_AUTONAT_MESSAGE_BYTES",
    "MAX_DIAL_BACK_ADDRS",
    "AutoNATMessage",
    "AutoNATProtocolError",
    "Dial",
    "DialRateLimiter",
    "DialResponse",
    "MessageType",
    "ResponseStatus",
    "check_dial_request",
    "decode_autonat_message",
    "dial_back_addresses",
    "encode_autonat_message",
]
