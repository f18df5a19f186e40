"""Bounds on what a remote peer controls, each with the reason for its value
(CONTRIBUTING.md, "Bound everything a peer controls").

Breaking one is the remote's fault and costs only that stream or connection. The
per-peer defaults live in :class:`peers.host.PeerConfig` so tests and operators can
tighten them; these are the defaults.
"""

from __future__ import annotations

#: Connections we keep to one PeerID. We reuse one connection per peer; a second may
#: appear when both sides dial at the same moment, a few more during reconnects. More
#: than this from one identity is a peer trying to multiply its share of our resources.
MAX_CONNECTIONS_PER_PEER = 4

#: Inbound connections from one IP address (an IPv6 /64 counts as one), handshaking or
#: established. A local test swarm runs dozens of peers on 127.0.0.1, so this is
#: generous; on the internet one host running hundreds of identities is an eclipse
#: attempt, and the subnet bound below binds first for public addresses.
MAX_CONNECTIONS_PER_IP = 128

#: Inbound connections from one public IPv4 /24 or IPv6 /48. Sixteen such networks are
#: needed to take all of MAX_CONNECTIONS; a household or a university lab of
#: volunteers needs a few each.
MAX_CONNECTIONS_PER_SUBNET = 64

#: Inbound handshakes one host (not loopback) may start per second, after a burst of
#: HANDSHAKE_BURST_PER_IP. A peer connects to us once and keeps the connection; a few
#: volunteers behind one NAT starting at once fit in the burst. Each handshake costs us
#: a key generation, three Diffie-Hellmans and a signature check, so one host can take
#: at most a few percent of a core (docs/benchmarks.md, "Figures behind constants").
HANDSHAKE_RATE_PER_IP = 10.0
HANDSHAKE_BURST_PER_IP = 40

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

#: Seconds an inbound connection may go without a stream before it is the first to go
#: when all MAX_CONNECTIONS are taken. Peers keep connections to those they talk to, and
#: a DHT contact or an averaging partner opens a stream every few seconds to a minute;
#: one that opened nothing for this long is cheap to reconnect later.
IDLE_CONNECTION_SECONDS = 30.0
#: A connection that received nothing for this long is pinged (a yamux ping: 12 bytes),
#: and closed if nothing at all comes back within KEEPALIVE_TIMEOUT_SECONDS: its path
#: died silently (a home router dropped the NAT mapping, a laptop slept, a cable was
#: pulled), and TCP alone would keep retransmitting into it for about fifteen minutes
#: while every call on it timed out. Closed, the next call dials afresh. go-libp2p's
#: yamux pings every 30 s and gives a write 10 s.
KEEPALIVE_INTERVAL_SECONDS = 15.0
KEEPALIVE_TIMEOUT_SECONDS = 10.0

#: At most this many idle connections are closed to make room for one new one: enough
#: that a full peer takes newcomers in again, few enough that a burst of connections
#: cannot clear out every idle peer at once.
MAX_IDLE_CLOSED_PER_ACCEPT = 4
