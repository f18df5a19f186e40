"""Bounds on what a remote peer controls, each with the reason for its value (STYLE.md 7).

Breaking one is the remote's fault and costs only that stream or connection. The
per-peer defaults live in :class:`peers.host.PeerConfig` so tests and operators can
tighten them; these are the defaults.
"""

from __future__ import annotations

#: Connections we keep to one PeerID. We reuse one connection per peer; a second may
#: appear when both sides dial at the same moment, a few more during reconnects. More
#: than this from one identity is a peer trying to multiply its share of our resources.
MAX_CONNECTIONS_PER_PEER = 4

#: Inbound connections from one IP address, handshaking or established. A local test
#: swarm runs dozens of peers on 127.0.0.1, so this is generous; on the internet one
#: host running hundreds of identities is an eclipse attempt.
MAX_CONNECTIONS_PER_IP = 128

#: All connections (both directions). Each costs two tasks and some buffers; a bootstrap
#: peer on a 1 GiB VPS can afford this many.
MAX_CONNECTIONS = 1024

#: Concurrent yamux streams on one connection. A DHT lookup or all-reduce round opens a
#: few dozen at once; 256 leaves room while bounding per-connection task count.
MAX_STREAMS_PER_CONNECTION = 256

#: Seconds a new TCP connection has to finish multistream-select, Noise and the muxer
#: negotiation. A real peer needs three round trips; slowloris holders get cut off.
HANDSHAKE_TIMEOUT_SECONDS = 10.0

#: Seconds an inbound stream has to name its protocol before we reset it.
STREAM_NEGOTIATION_TIMEOUT_SECONDS = 10.0

#: Largest identify message we read (listen addresses and protocol names; go-libp2p caps
#: it at 2 KiB of addresses plus protocols, so 64 KiB is ample).
MAX_IDENTIFY_BYTES = 64 * 1024
