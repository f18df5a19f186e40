"""``swarm dashboard``: join as a client, read the swarm every few seconds, serve the page.

:func:`add_dashboard_flags` gives the command its flags in ``swarm``'s parser, and
:func:`dashboard_command` runs it: it serves the page (:mod:`.server`), joins the swarm
as a DHT client (no open port on the swarm's side), and :func:`follow_swarm` reads
every status record each refresh, keeps their history (:mod:`.history`) and hands the
result to the server, until SIGINT or SIGTERM. Nothing here imports torch: a bootstrap
machine may run the dashboard.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import dataclass

from peers import Peer, PeerConfig, PeersError
from peers.dht import DHT, DHTConfig
from swarm.cli_usage import UsageError, initial_peer_arg, swarm_key_arg
from swarm.dashboard.history import History
from swarm.dashboard.server import DEFAULT_DASHBOARD_HOST, DashboardServer, is_loopback
from swarm.status import gather_view

logger = logging.getLogger(__name__)

#: Seconds between two reads of the swarm's status records by default: peers publish
#: every 10 s by default (2 s at the fastest), so faster reads mostly see the same records.
DEFAULT_REFRESH_SECONDS = 2.0
#: Fastest refresh: each read asks the DHT for every record and every announced peer,
#: and no status record changes more often than every 2 s.
MIN_REFRESH_SECONDS = 0.5
DEFAULT_DASHBOARD_PORT = 8080
#: Seconds to reach the initial peers by default (as ``swarm status``).
DEFAULT_JOIN_TIMEOUT = 10.0

_PEER = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
#: ``swarm dashboard --help``'s example (``EXAMPLES["dashboard"]`` in :mod:`swarm.cli`).
DASHBOARD_EXAMPLES = (
    f"swarm dashboard --initial-peers {_PEER} --port 8080   # then open http://127.0.0.1:8080/",
    "ssh -L 8080:127.0.0.1:8080 HOST   # to see, here, a dashboard that runs on HOST",
)
DASHBOARD_HELP = (
    "serve a live page of the swarm on this machine: peers and their reachability, "
    "runs' loss and throughput over time, stage and expert coverage, recent rounds"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DashboardConfig:
    """Where the page is served and how often the swarm is read."""

    host: str = DEFAULT_DASHBOARD_HOST
    """Address to serve on; loopback by default (the page names peers and addresses)."""
    port: int = DEFAULT_DASHBOARD_PORT
    """Port to serve on (0: any free one)."""
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS
    """Seconds between two reads of the swarm; at least :data:`MIN_REFRESH_SECONDS`."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"must be a port in [0, 65535], got {self.port}")
        if not self.refresh_seconds >= MIN_REFRESH_SECONDS:
            raise ValueError(
                f"must be at least {MIN_REFRESH_SECONDS:g} s, got {self.refresh_seconds}"
            )


def _port(text: str) -> int:
    try:
        return DashboardConfig(port=int(text)).port
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _refresh(text: str) -> float:
    try:
        return DashboardConfig(refresh_seconds=float(text)).refresh_seconds
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _timeout(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def add_dashboard_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``swarm dashboard``."""
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        type=initial_peer_arg,
        metavar="MADDR",
        required=True,
        help="join the swarm through these peers (any one that answers suffices)",
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_DASHBOARD_PORT,
        help=f"port to serve the page on (default {DEFAULT_DASHBOARD_PORT}; 0: any free one)",
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_DASHBOARD_HOST,
        help=f"address to serve on (default {DEFAULT_DASHBOARD_HOST}: this machine only; "
        "0.0.0.0: everyone who can reach it, with a warning)",
    )
    parser.add_argument(
        "--refresh",
        type=_refresh,
        default=DEFAULT_REFRESH_SECONDS,
        metavar="SECONDS",
        help=f"seconds between reads of the swarm (default {DEFAULT_REFRESH_SECONDS:g}, "
        f"at least {MIN_REFRESH_SECONDS:g})",
    )
    parser.add_argument(
        "--timeout",
        type=_timeout,
        default=DEFAULT_JOIN_TIMEOUT,
        help=f"seconds to reach the initial peers (default {DEFAULT_JOIN_TIMEOUT:g})",
    )
    parser.add_argument(
        "--swarm-key",
        metavar="PATH",
        help="a private network: encrypt every connection with this shared key (libp2p "
        "pnet); peers without it cannot connect (`swarm swarm-key PATH` makes one)",
    )


async def dashboard_command(args: argparse.Namespace) -> int:
    """Run ``swarm dashboard`` until SIGINT or SIGTERM; returns 0. Raises
    :class:`UsageError` for a swarm key that cannot be read or an address it cannot
    listen on (before joining anything), and :class:`PeersError` if the swarm cannot be
    joined."""
    config = DashboardConfig(host=args.host, port=args.port, refresh_seconds=args.refresh)
    peer_config = PeerConfig(listen_addrs=(), swarm_key=swarm_key_arg(args.swarm_key))
    dht_config = DHTConfig(
        initial_peers=tuple(args.initial_peers), client_mode=True, bootstrap_timeout=args.timeout
    )
    server = DashboardServer()
    try:
        port = server.start(config.host, config.port)
    except OSError as e:
        raise UsageError(f"--host {config.host} --port {config.port}: cannot listen: {e}") from e
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        shown = f"[{config.host}]" if ":" in config.host else config.host
        print(f"dashboard: http://{shown}:{port}/", flush=True)
        if not is_loopback(config.host):
            print(
                f"warning: serving on {config.host}: anyone who can reach it sees the swarm's "
                "peers, addresses and runs (keep 127.0.0.1 and use ssh -L to see it elsewhere)",
                file=sys.stderr,
                flush=True,
            )
        async with Peer(peer_config) as peer, DHT(peer, dht_config) as dht:
            through = str(args.initial_peers[0])
            await follow_swarm(dht, server, stop, config.refresh_seconds, through)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await asyncio.to_thread(server.close)
    return 0


async def follow_swarm(
    dht: DHT,
    server: DashboardServer,
    stop: asyncio.Event,
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
    through: str = "",
) -> None:
    """Read the swarm through ``dht`` every ``refresh_seconds`` and publish each view,
    with its history, to ``server`` until ``stop`` is set. A read that fails is logged
    and the page keeps the previous view. Cancellation stops it at once."""
    history = History()
    while not stop.is_set():
        try:
            view = await gather_view(dht)
        except (PeersError, TimeoutError) as e:
            logger.warning("reading the swarm failed: %s", e)
        else:
            history.update(view, view.time)
            server.publish(
                {
                    "view": view.to_json(),
                    "history": history.to_json(),
                    "refresh_seconds": refresh_seconds,
                    "through": through,
                }
            )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(refresh_seconds):
                await stop.wait()
