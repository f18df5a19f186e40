"""The ``swarm`` command.

``swarm bootstrap`` hosts a peer and prints its multiaddrs; ``swarm ping`` checks that
a peer is reachable and who it is; ``swarm demo`` runs a local two-peer exchange. The
commands are thin: options map onto :class:`peers.PeerConfig`, logic lives in packages.
Only ``peers`` is imported here, so the command starts fast and needs no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Sequence

from peers import (
    KeyPair,
    Peer,
    PeerConfig,
    PeersError,
    RemoteError,
    parse_multiaddr,
    run,
)
from peers.dht import DHT, DHTConfig, dht_time
from peers.dht.presence import announce_forever, list_peers
from peers.echo import install_echo

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"


async def _bootstrap(args: argparse.Namespace) -> int:
    identity = KeyPair.load_or_create(args.identity) if args.identity else None
    config = PeerConfig(
        identity=identity,
        listen_addrs=tuple(args.listen or [DEFAULT_LISTEN]),
        announce_addrs=tuple(args.announce or []),
    )
    dht_config = DHTConfig(initial_peers=tuple(args.initial_peers or ()), client_mode=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Peer(config) as peer, DHT(peer, dht_config) as dht, asyncio.TaskGroup() as group:
        install_echo(peer)
        for addr in peer.listen_addrs:
            print(addr, flush=True)
        announcer = group.create_task(announce_forever(dht, peer.config.agent_version))
        await stop.wait()
        announcer.cancel()
    return 0


async def _status(args: argparse.Namespace) -> int:
    """Join as a client, list every peer that can be found, and leave."""
    dht_config = DHTConfig(
        initial_peers=tuple(args.initial_peers), client_mode=True, bootstrap_timeout=args.timeout
    )
    async with Peer(PeerConfig(listen_addrs=())) as peer, DHT(peer, dht_config) as dht:
        announced = {p.peer_id: p for p in await list_peers(dht)}
        now_wall, now_mono = dht_time(), time.monotonic()
        rows: list[tuple[str, str, str]] = []
        for presence in announced.values():
            seconds = max(0.0, now_wall - presence.last_seen)
            rows.append((str(presence.peer_id), f"{seconds:.0f} s ago", " ".join(presence.addrs)))
        for contact in dht.routing.contacts():  # answered us but did not announce
            if contact.peer_id not in announced:
                heard = dht.routing.last_seen(contact.peer_id)
                ago = "now" if heard is None else f"{max(0.0, now_mono - heard):.0f} s ago"
                full = " ".join(f"{a}/p2p/{contact.peer_id}" for a in contact.addrs)
                rows.append((str(contact.peer_id), ago, full))
    print(f"{len(rows)} peers")
    print(f"{'PEER ID':54}  {'LAST SEEN':>10}  ADDRESSES")
    for peer_id, last_seen, addrs in rows:
        print(f"{peer_id:54}  {last_seen:>10}  {addrs}")
    return 0


async def _ping(args: argparse.Namespace) -> int:
    try:
        target = parse_multiaddr(args.maddr)
    except PeersError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    async with Peer(PeerConfig(listen_addrs=(), dial_timeout=args.timeout)) as peer:
        try:
            remote = await peer.connect(target)
            info = await peer.identify(remote)
            print(f"peer:      {remote}")
            print(f"agent:     {info.agent_version}")
            print(f"protocols: {', '.join(info.protocols)}")
            for i in range(args.count):
                rtt = await asyncio.wait_for(peer.ping(remote), args.timeout)
                print(f"ping {i + 1}: {rtt * 1000:.3f} ms", flush=True)
        except (PeersError, TimeoutError, OSError) as e:
            print(f"error: cannot ping {args.maddr}: {e}", file=sys.stderr)
            return 1
    return 0


async def _demo(args: argparse.Namespace) -> int:
    """Start a bootstrap peer process and talk to it from this one, narrating."""
    from peers.testing import LocalSwarm

    with LocalSwarm() as local:
        print("starting a bootstrap peer process ...", flush=True)
        (boot,) = local.start(1, target="peers.echo:serve_echo")
        print(f"  bootstrap peer {boot.peer_id} (pid {boot.pid}) listens on {boot.maddr}")
        async with Peer() as peer:
            print(f"this peer is {peer.peer_id}")
            started = time.perf_counter()
            remote = await peer.connect(boot.maddr)
            print(
                "connected (TCP + Noise XX + yamux) in "
                f"{(time.perf_counter() - started) * 1000:.1f} ms"
            )
            info = await peer.identify(remote)
            print(f"identify: agent {info.agent_version}, protocols {', '.join(info.protocols)}")
            for i in range(3):
                print(f"ping {i + 1}: {await peer.ping(remote) * 1000:.3f} ms")
            reply = await peer.call_unary(
                remote, "/swarmtrain/echo/1.0.0", "hello from the demo", str, timeout=5
            )
            print(f"unary echo: sent 'hello from the demo', got {reply!r}")
            import numpy as np

            chunks = [np.full(1 << 18, i, dtype=np.float32) for i in range(16)]
            started = time.perf_counter()
            received = [
                c
                async for c in peer.call_stream(
                    remote, "/swarmtrain/echo-stream/1.0.0", chunks, np.ndarray, timeout=30
                )
            ]
            elapsed = time.perf_counter() - started
            ok = all(np.array_equal(a, b) for a, b in zip(chunks, received, strict=True))
            size_mib = sum(c.nbytes for c in chunks) / 2**20
            print(
                f"streaming echo: {len(received)} arrays, {size_mib:.0f} MiB each way "
                f"in {elapsed:.2f} s, all equal: {ok}"
            )
            try:
                await peer.call_unary(
                    remote, "/swarmtrain/echo/1.0.0", {"not": "a string"}, str, timeout=5
                )
            except RemoteError as e:
                print(f"a malformed request is refused with a clear remote error: {e}")
        print(f"stopping the bootstrap peer (pid {boot.pid})")
    return 0 if ok else 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm", description="swarmtrain: train together, peer to peer."
    )
    sub = parser.add_subparsers(dest="command")

    boot = sub.add_parser("bootstrap", help="host a bootstrap peer and print its multiaddrs")
    boot.add_argument(
        "--listen",
        action="append",
        metavar="MADDR",
        help=f"listen address (default {DEFAULT_LISTEN}); repeatable",
    )
    boot.add_argument(
        "--announce",
        action="append",
        metavar="MADDR",
        help="address to announce instead of the bound ones; repeatable",
    )
    boot.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="join an existing swarm through these peers (any one that answers suffices)",
    )
    boot.add_argument(
        "--identity",
        metavar="PATH",
        help="key file (libp2p protobuf); created with mode 0600 if missing",
    )

    ping = sub.add_parser("ping", help="dial a peer, identify it and ping it")
    ping.add_argument("maddr", metavar="MADDR", help="e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...")
    ping.add_argument("--count", type=_positive_int, default=3, help="number of pings (default 3)")
    ping.add_argument(
        "--timeout", type=_positive_float, default=10.0, help="seconds per step (default 10)"
    )

    status = sub.add_parser("status", help="join as a client and list the peers of a swarm")
    status.add_argument("--initial-peers", nargs="+", metavar="MADDR", required=True)
    status.add_argument(
        "--timeout", type=_positive_float, default=10.0, help="seconds to reach them (default 10)"
    )

    sub.add_parser("demo", help="run a local bootstrap peer and exchange messages with it")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    command = args.command or "demo"
    try:
        if command == "bootstrap":
            return run(_bootstrap(args))
        if command == "ping":
            return run(_ping(args))
        if command == "status":
            return run(_status(args))
        return run(_demo(args))
    except PeersError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
