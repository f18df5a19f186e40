"""DCUtR, direct connection upgrade through relay (libp2p specs, relay/DCUtR.md): the
wire messages. No I/O, no clock reads.
"""

from peers.dcutr.messages import (
    DCUTR_PROTOCOL_ID,
    MAX_HOLE_PUNCH_ADDRS,
    MAX_HOLE_PUNCH_MESSAGE_BYTES,
    HolePunch,
    HolePunchProtocolError,
    HolePunchType,
    decode_hole_punch,
    direct_addresses,
    encode_hole_punch,
)

__all__ = [
    "DCUTR_PROTOCOL_ID",
    "MAX_HOLE_PUNCH_ADDRS",
    "MAX_HOLE_PUNCH_MESSAGE_BYTES",
    "HolePunch",
    "HolePunchProtocolError",
    "HolePunchType",
    "decode_hole_punch",
    "direct_addresses",
    "encode_hole_punch",
]
