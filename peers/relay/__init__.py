"""Circuit relay v2 (libp2p specs, relay/circuit-v2.md): the pure layers.

:mod:`~peers.relay.messages` holds the hop and stop wire messages,
:mod:`~peers.relay.voucher` the signed reservation vouchers and
:mod:`~peers.relay.resources` what a relay grants (reservations, circuits, limits).
None of them does I/O or reads a clock.
"""

from peers.relay.messages import (
    HOP_PROTOCOL_ID,
    MAX_ADDRS_PER_PEER,
    MAX_CIRCUIT_MESSAGE_BYTES,
    STOP_PROTOCOL_ID,
    HopMessage,
    HopType,
    Limit,
    PeerInfo,
    RelayProtocolError,
    Reservation,
    Status,
    StopMessage,
    StopType,
    decode_hop_message,
    decode_stop_message,
    encode_hop_message,
    encode_stop_message,
)
from peers.relay.resources import (
    CircuitGrant,
    RelayResourceConfig,
    RelayResources,
    RelayResourceStatistics,
    ReservationGrant,
)
from peers.relay.voucher import (
    VOUCHER_DOMAIN,
    VOUCHER_PAYLOAD_TYPE,
    Voucher,
    VoucherError,
    decode_voucher,
    make_voucher,
    verify_voucher,
)

__all__ = [
    "HOP_PROTOCOL_ID",
    "MAX_ADDRS_PER_PEER",
    "MAX_CIRCUIT_MESSAGE_BYTES",
    "STOP_PROTOCOL_ID",
    "VOUCHER_DOMAIN",
    "VOUCHER_PAYLOAD_TYPE",
    "CircuitGrant",
    "HopMessage",
    "HopType",
    "Limit",
    "PeerInfo",
    "RelayProtocolError",
    "RelayResourceConfig",
    "RelayResourceStatistics",
    "RelayResources",
    "Reservation",
    "ReservationGrant",
    "Status",
    "StopMessage",
    "StopType",
    "Voucher",
    "VoucherError",
    "decode_hop_message",
    "decode_stop_message",
    "decode_voucher",
    "encode_hop_message",
    "encode_stop_message",
    "make_voucher",
    "verify_voucher",
]
