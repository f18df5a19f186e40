"""The ``swarm`` command.

``swarm bootstrap`` hosts a peer and prints its multiaddrs; ``swarm ping`` checks that
a peer is reachable and who it is; ``swarm serve`` hosts experts and ``swarm
serve-stage`` a pipeline stage; ``swarm train`` and
``swarm join`` train a built-in task with a swarm (:mod:`swarm.train_command`); ``swarm
demo`` (also plain ``swarm``) runs a whole local swarm and compares it with one process
(:mod:`swarm.demo`). The commands are thin: options map onto config dataclasses
(:class:`peers.PeerConfig`, :class:`swarm.experts.serve.ServeConfig`,
:class:`swarm.trainer.TrainerConfig`, :class:`swarm.demo.DemoConfig`), logic lives in
packages. Only ``peers`` is imported at start, so the command starts fast; ``serve``,
``serve-stage``, ``train``, ``join`` and ``demo`` import torch when they run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from peers import (
    Peer,
    PeerConfig,
    PeerID,
    PeersError,
    StreamReset,
    parse_multiaddr,
    run,
    with_peer_id,
)
from peers.dht import DHT, DHTConfig
from peers.dht.presence import announce_forever
from peers.dht.status import MIN_STATUS_INTERVAL_SECONDS, ServedStatus
from peers.echo import install_echo
from peers.pnet import SwarmKeyError, missing_key_hint, new_swarm_key, write_swarm_key
from peers.printable import printable
from peers.runtime import keep_freed_memory
from swarm.cli_fields import Flag, add_flags, flag_values
from swarm.cli_usage import (
    OneLineParser,
    UsageError,
    allowed_peers,
    announce_arg,
    exit_usage,
    initial_peer_arg,
    listen_arg,
    load_identity,
    multiaddr_arg,
    package_version,
    peer_id_arg,
    require_torch,
    swarm_key_arg,
)
from swarm.dashboard.command import (
    DASHBOARD_EXAMPLES,
    DASHBOARD_HELP,
    add_dashboard_flags,
    dashboard_command,
)
from swarm.errors import SwarmError
from swarm.status import STATUS_INTERVAL_SECONDS, StatusSources, publishing_status

if TYPE_CHECKING:
    from swarm.experts.serve import ServeConfig
    from swarm.experts.server import ExpertServer
    from swarm.experts.server_config import ServerConfig
    from swarm.metrics import MetricsServer
    from swarm.optim_spec import OptimizerSpec
    from swarm.pipeline import StageServerConfig
    from swarm.trainer import TrainerConfig


async def _bootstrap(args: argparse.Namespace) -> int:
    config, dht_config = _server_peer_config(args)
    stop = _stop_on_signals()
    metrics = _start_metrics(args.metrics)
    async with Peer(config) as peer, DHT(peer, dht_config) as dht, asyncio.TaskGroup() as group:
        install_echo(peer)
        _print_addrs(peer)
        with _metrics_for(metrics, peer, dht):
            announcer = group.create_task(announce_forever(dht, peer.config.agent_version))
            async with publishing_status(dht, StatusSources(), args.status_interval):
                await stop.wait()
            announcer.cancel()
    return 0


@contextlib.contextmanager
def _metrics_for(
    server: MetricsServer | None, peer: Peer, dht: DHT
) -> Iterator[MetricsServer | None]:
    """``--metrics``: this peer's host and DHT on ``server`` while the block runs (the
    caller's event loop is where their statistics are read); closes it after."""
    if server is None:
        yield None
        return
    from swarm.metrics import dht_families, loop_runner, peer_families

    server.add_loop_source(
        loop_runner(asyncio.get_running_loop()),
        lambda: peer_families(peer.statistics()) + dht_families(dht.statistics()),
    )
    try:
        yield server
    finally:
        server.close()


def _start_metrics(address: tuple[str, int] | None) -> MetricsServer | None:
    """A metrics server listening on ``address`` (``--metrics``; None: none), started
    before anything else so a port in use is a usage error; says where on stderr."""
    if address is None:
        return None
    from swarm.metrics import MetricsServer

    server = MetricsServer()
    host, port = address
    try:
        bound = server.start(host, port)
    except OSError as e:
        raise UsageError(f"--metrics {host}:{port}: cannot listen: {e.strerror or e}") from e
    shown = f"[{host}]" if ":" in host else host
    print(f"metrics: http://{shown}:{bound}/metrics", file=sys.stderr, flush=True)
    return server


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig the flags of ``swarm serve`` describe."""
    from swarm.experts.serve import ServeConfig
    from swarm.experts.uids import grid_uids

    try:
        uids = [*(args.uids or ()), *(u for p in args.expert_pattern or () for u in grid_uids(p))]
        trainers = allowed_peers(
            args.allow_trainer, args.allow_trainer_file, file_option="--allow-trainer-file"
        )
        return ServeConfig(
            uids=tuple(uids),
            **flag_values(args, ServeConfig, (*_serve_flags(), *_server_flags())),
            optimizer=_optimizer(args),
            server=_server_config(args, allowed_trainers=trainers),
        )
    except ValueError as e:
        raise UsageError(str(e)) from e


async def _serve(args: argparse.Namespace) -> int:
    """Host experts: build the modules a ServeConfig names, announce them, serve."""
    from swarm.experts.errors import ModuleFactoryError
    from swarm.experts.serve import serve

    config = _serve_config(args)
    uids = config.uids
    peer_config, dht_config = _server_peer_config(args)
    stop = _stop_on_signals()

    metrics = _start_metrics(args.metrics)

    sources = StatusSources()

    def ready(server: ExpertServer) -> None:
        from swarm.status import served_experts

        sources.served = lambda: served_experts(server.statistics())
        for addr in peer.listen_addrs:
            print(addr, flush=True)
        print(f"serving {len(uids)} experts: {' '.join(uids[:8])}", flush=True)
        if metrics is not None:
            from swarm.metrics import loop_runner, server_families

            runner = loop_runner(asyncio.get_running_loop())
            metrics.add_loop_source(runner, lambda: server_families(server.statistics()))

    async with Peer(peer_config) as peer, DHT(peer, dht_config) as dht:
        try:
            with _metrics_for(metrics, peer, dht):
                async with publishing_status(dht, sources, args.status_interval):
                    await serve(peer, dht, config, stop, ready)
        except ModuleFactoryError as e:  # the user's factory, called before `ready`
            raise UsageError(f"--module: {e}") from e
    return 0


def _print_addrs(peer: Peer) -> None:
    """The addresses to give others: the announced ones, or every address we listen on
    (loopback too, for peers on this machine). Reachability is not known yet at start;
    a peer behind NAT is reached through relays once AutoNAT has found it private."""
    addrs = (
        peer.listen_addrs
        if peer.config.announce_addrs
        else [with_peer_id(a, peer.peer_id) for a in peer.bound_addrs()]
    )
    for addr in addrs:
        print(addr, flush=True)
    if addrs and all(str(a).startswith(("/ip4/127.", "/ip6/::1/")) for a in addrs):
        print(
            "warning: only loopback addresses: peers on other machines cannot reach this "
            "one; listen on this machine's address (e.g. --listen /ip4/0.0.0.0/tcp/31337) "
            "or give --announce",
            file=sys.stderr,
            flush=True,
        )


def _add_reachability_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reachability",
        choices=["auto", "public", "private"],
        default="auto",
        help="whether others can dial us: found out with AutoNAT (auto), or said",
    )
    parser.add_argument(
        "--no-relay",
        action="store_true",
        help="neither serve as a circuit relay for peers behind NAT nor use relays",
    )


def _metrics_address(text: str) -> tuple[str, int]:
    from swarm.metrics import parse_metrics_address

    try:
        return parse_metrics_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_metrics_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics",
        type=_metrics_address,
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (HOST: 127.0.0.1 unless "
        "given; 0.0.0.0 for all interfaces); off by default",
    )


def _add_status_interval_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--status-interval",
        type=_status_interval,
        default=STATUS_INTERVAL_SECONDS,
        metavar="SECONDS",
        help="publish this peer's signed status record (what `swarm status` and `swarm "
        f"dashboard` show) every SECONDS (default {STATUS_INTERVAL_SECONDS:g}, at least "
        f"{MIN_STATUS_INTERVAL_SECONDS:g})",
    )


def _status_interval(text: str) -> float:
    from swarm.status import check_status_interval

    value = _positive_float(text)
    try:
        check_status_interval(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _add_swarm_key_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--swarm-key",
        metavar="PATH",
        help="a private network: encrypt every connection with this shared key (libp2p "
        "pnet); peers without it cannot connect (`swarm swarm-key PATH` makes one)",
    )


def _add_private_swarm_options(parser: argparse.ArgumentParser) -> None:
    _add_swarm_key_option(parser)
    _add_allow_options(parser)


def _add_allow_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow",
        action="append",
        type=peer_id_arg,
        metavar="PEERID",
        help="a private swarm: talk only to these peers (ours is always allowed); repeatable",
    )
    parser.add_argument(
        "--allow-file",
        metavar="PATH",
        help="a private swarm: peer IDs allowed, one per line (# comments); with --allow, both",
    )


def _join_config(args: argparse.Namespace) -> dict[str, Any]:
    """The JoinConfig fields ``args`` give, key files checked now, so that a bad path is
    a usage error before anything starts."""
    from swarm.join_config import JoinConfig

    values = flag_values(args, JoinConfig, _join_flags())
    if values.get("identity") is not None:
        load_identity(str(values["identity"]))
    if values.get("swarm_key") is not None:
        swarm_key_arg(str(values["swarm_key"]))
    values["allowed_peers"] = allowed_peers(args.allow, args.allow_file)
    return values


def _server_peer_config(args: argparse.Namespace) -> tuple[PeerConfig, DHTConfig]:
    from swarm.join_config import JoinConfig

    try:
        join = JoinConfig(**_join_config(args))
    except SwarmError as e:
        raise UsageError(str(e)) from e
    return join.peer_config(), DHTConfig(initial_peers=join.initial_peers, client_mode=False)


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _stage_config(args: argparse.Namespace) -> StageServerConfig:
    """The StageServerConfig the flags of ``swarm serve-stage`` describe."""
    from swarm.pipeline import ReplicaConfig, StageServerConfig, pipeline_model

    try:
        return StageServerConfig(
            model=pipeline_model(args.model),
            **flag_values(args, StageServerConfig, (*_stage_flags(), *_server_flags())),
            optimizer=_optimizer(args),
            server=_server_config(args),
            replicas=ReplicaConfig(**flag_values(args, ReplicaConfig, REPLICA_FLAGS)),
        )
    except ValueError as e:
        raise UsageError(str(e)) from e


async def _serve_stage(args: argparse.Namespace) -> int:
    """Host one stage of a pipeline (chosen, or the most under-served one) until stopped."""
    from swarm.pipeline import StageServer

    config = _stage_config(args)
    model = config.model
    peer_config, dht_config = _server_peer_config(args)
    stop = _stop_on_signals()
    metrics = _start_metrics(args.metrics)
    announced = False
    sources = StatusSources()

    def ready(server: StageServer) -> None:
        nonlocal announced
        from swarm.status import served_stage

        def served() -> list[ServedStatus]:
            stats = server.statistics()
            return served_stage(args.uid_prefix, model.num_stages, stats.stage, stats.server)

        sources.served = served
        if not announced:
            _print_addrs(peer)
            announced = True
            if metrics is not None:
                from swarm.metrics import loop_runner, server_families

                def snapshot() -> list[Any]:
                    stats = server.statistics()
                    if stats.server is None:  # between stages
                        return []
                    stage = -1 if stats.stage is None else stats.stage
                    return server_families(stats.server, stage)

                metrics.add_loop_source(loop_runner(asyncio.get_running_loop()), snapshot)
        stage = server.statistics().stage
        print(f"serving {args.uid_prefix}.{stage} of {model.num_stages} stages", flush=True)

    async with Peer(peer_config) as peer, DHT(peer, dht_config) as dht:
        with _metrics_for(metrics, peer, dht):
            async with publishing_status(dht, sources, args.status_interval):
                await StageServer(dht, config).run(stop, ready)
    return 0


async def _status(args: argparse.Namespace) -> int:
    """Join as a client, read the swarm's status records, print them, leave."""
    from swarm.status import gather_view

    dht_config = DHTConfig(
        initial_peers=tuple(args.initial_peers), client_mode=True, bootstrap_timeout=args.timeout
    )
    config = PeerConfig(listen_addrs=(), swarm_key=swarm_key_arg(args.swarm_key))
    async with Peer(config) as peer, DHT(peer, dht_config) as dht:
        view = await gather_view(dht)
    if args.json:
        print(json.dumps(view.to_json()))
    else:
        print("\n".join(view.lines()))
    return 0


def _swarm_key(args: argparse.Namespace) -> int:
    """Write a new swarm key to a new file (mode 0600)."""
    try:
        write_swarm_key(args.path, new_swarm_key())
    except SwarmKeyError as e:
        raise UsageError(f"{e}; give a path where no file exists") from e
    print(f"wrote a new swarm key to {args.path}")
    print("give it to every peer of the swarm, and to nobody else; each then runs with")
    print(f"  --swarm-key {args.path}")
    return 0


async def _ping(args: argparse.Namespace) -> int:
    target = parse_multiaddr(args.maddr)  # checked by multiaddr_arg
    identity = load_identity(args.identity) if args.identity else None
    config = PeerConfig(
        identity=identity,
        listen_addrs=(),
        dial_timeout=args.timeout,
        swarm_key=swarm_key_arg(args.swarm_key),
    )
    async with Peer(config) as peer:
        try:
            remote = await peer.connect(target)
            try:
                info = await peer.identify(remote)
            except StreamReset as e:  # Noise completed, then the remote hung up on us
                raise StreamReset(
                    f"{e}: {remote} closed the connection right after the handshake; a "
                    "private swarm that does not allow our peer ID does that (--identity "
                    f"KEY pings as a member; ours is {peer.peer_id})"
                ) from e
            print(f"peer:      {remote}")
            # what the remote says of itself is escaped: it could hold terminal escapes
            print(f"agent:     {printable(info.agent_version)}")
            print(f"protocols: {', '.join(printable(p, 100) for p in info.protocols)}")
            connection = peer.connection_to(remote)
            if connection is not None:
                print(f"security:  {connection.security_protocol}")
            for i in range(args.count):
                rtt = await asyncio.wait_for(peer.ping(remote), args.timeout)
                print(f"ping {i + 1}: {rtt * 1000:.3f} ms", flush=True)
        except (PeersError, TimeoutError, OSError) as e:
            hint = missing_key_hint(e, args.swarm_key is not None)
            print(f"error: cannot ping {args.maddr}: {e}{hint}", file=sys.stderr)
            return 1
    return 0


# --- training: swarm train / swarm join / swarm demo ----------------------------------
# These import torch (through swarm.train_command and swarm.demo) only when they run.


def _trainer_config(args: argparse.Namespace) -> TrainerConfig:
    """The TrainerConfig the flags of ``swarm train``/``swarm join`` describe."""
    from swarm.collaborative.config import DiLoCoConfig, OptimizerError
    from swarm.trainer import TrainerConfig

    flags = _train_flags(args.command)
    values = {**flag_values(args, TrainerConfig, flags), **_join_config(args)}
    if values["run_key"] is not None:
        load_identity(str(values["run_key"]), option="--run-key")
    diloco = None
    if args.overlap and args.inner_steps is None:
        raise OptimizerError("--diloco-overlap needs --diloco H")
    if args.inner_steps is not None:
        diloco = DiLoCoConfig(**flag_values(args, DiLoCoConfig, _diloco_flags()))
    return TrainerConfig(**values, diloco=diloco)


def _train(args: argparse.Namespace) -> int:
    """Join a swarm (or start one) and train a built-in task or the user's own."""
    from swarm.tasks import get_task
    from swarm.train_command import run_train, sigterm_as_interrupt, stop_when_stdin_closes

    try:
        config = _trainer_config(args)
        get_task(config.task)  # a factory of the user's that fails is a usage error too
    except SwarmError as e:
        raise UsageError(str(e)) from e
    sigterm_as_interrupt()
    if args.stop_when_stdin_closes:
        stop_when_stdin_closes()
    # This process averages: its rounds' chunks are freed and reused, as in the commands
    # that peers.run starts; before its peers' threads start, so they share the heap.
    keep_freed_memory()
    metrics = _start_metrics(args.metrics)
    try:
        run_train(config, progress=args.progress, num_threads=args.num_threads, metrics=metrics)
    except SwarmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: left the swarm", file=sys.stderr)
        return 130
    finally:
        if metrics is not None:
            metrics.close()
    return 0


def _demo(args: argparse.Namespace) -> int:
    """A whole local swarm trains a small model, then meets the single-process baseline."""
    from swarm.demo import DemoConfig, DemoError, run_demo, speed_config
    from swarm.tasks import get_task
    from swarm.train_command import sigterm_as_interrupt

    try:
        if args.speed:
            config = speed_config(args.num_peers, args.seed, args.timeout)
            if args.num_samples:
                config = dataclasses.replace(config, num_samples=args.num_samples)
        else:
            values = flag_values(args, DemoConfig, _demo_flags())
            if values["num_peers"] is None:
                del values["num_peers"]  # the config's own default
            config = DemoConfig(**values)
        get_task(config.task)  # a factory of the user's that fails is a usage error too
    except SwarmError as e:
        raise UsageError(str(e)) from e
    sigterm_as_interrupt()
    try:
        run_demo(config)
    except (DemoError, SwarmError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopped the demo's peers", file=sys.stderr)
        return 130
    return 0


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _peer_id(text: str) -> PeerID:
    return PeerID.from_base58(peer_id_arg(text))


def _train_flags(command: str) -> tuple[Flag, ...]:
    """The flags of ``swarm train`` and ``swarm join``: :class:`swarm.trainer.TrainerConfig`
    fields (their defaults and help are the config's), how it joins included."""
    join = command == "join"
    peers_help = "peers of the swarm to join through" + (
        "" if join else " (none: host a new swarm's bootstrap peer here)"
    )
    initial, *joining = _join_flags()
    initial = dataclasses.replace(initial, required=join, help=peers_help)
    return (
        initial,
        Flag("task"),
        Flag("run_id"),
        Flag("num_peers", _positive_int),
        Flag("local_batch_size", _non_negative_int),
        Flag("target_batch_size", _non_negative_int),
        Flag("num_samples", _non_negative_int),
        Flag("seed", _non_negative_int),
        Flag("centered_clip"),
        Flag("reducers_per_part", int, choices=(1, 3, 5)),
        Flag("checkpoint", metavar="PATH"),
        Flag("checkpoint_every", _non_negative_int, "N"),
        Flag("eval_every", _non_negative_int, "N"),
        *joining,
        Flag("run_key", metavar="PATH"),
        Flag("trusted_run_keys", _peer_id, "PEERID", name="--trust-run-key"),
    )


def _diloco_flags() -> tuple[Flag, ...]:
    """``--diloco H`` turns DiLoCo on (:class:`DiLoCoConfig`); the outer optimizer's
    flags apply then."""
    return (
        Flag(
            "inner_steps",
            _positive_int,
            "H",
            name="--diloco",
            optional=True,
            help="DiLoCo: H local steps between synchronisations (default: average "
            "gradients every global batch)",
        ),
        Flag("outer_lr", _positive_float),
        Flag("outer_momentum", float),
        Flag(
            "overlap",
            name="--diloco-overlap",
            help="DiLoCo: average each outer step's change while the next inner steps "
            "run, and apply it when the round ends (up to one outer step late); every "
            "peer of a run must choose the same",
        ),
    )


def _add_train_parser(parser: argparse.ArgumentParser, command: str) -> None:
    from swarm.collaborative.config import DiLoCoConfig
    from swarm.trainer import TrainerConfig

    add_flags(parser, TrainerConfig, _train_flags(command))
    add_flags(parser, DiLoCoConfig, _diloco_flags())
    _add_allow_options(parser)
    _add_metrics_option(parser)
    parser.add_argument(
        "--progress",
        choices=["auto", "bar", "lines", "json", "none"],
        default="auto",
        help="bar on a terminal, plain lines otherwise (auto); json for programs",
    )
    parser.add_argument(
        "--num-threads", type=_positive_int, default=0, help="torch threads (torch's default)"
    )
    parser.add_argument("--stop-when-stdin-closes", action="store_true", help=argparse.SUPPRESS)


def _demo_flags() -> tuple[Flag, ...]:
    """``swarm demo``'s flags: :class:`swarm.demo.DemoConfig` fields."""
    return (
        Flag(
            "num_peers",
            _positive_int,
            optional=True,  # the config's default counts this machine's cores
            help="trainer processes (default: two per CPU core, from 2 to 4)",
        ),
        Flag("task"),
        Flag("num_samples", _non_negative_int),
        Flag("seed", _non_negative_int),
        Flag("timeout", _positive_float),
    )


def _add_demo_flags(demo: argparse.ArgumentParser) -> None:
    from swarm.demo import DemoConfig

    add_flags(demo, DemoConfig, _demo_flags())
    demo.add_argument(
        "--speed",
        action="store_true",
        help="show a speed-up instead: the charlm transformer with a global batch of 1024, "
        "one trainer per core against one process, one thread each (--task is ignored)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _stage(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a stage index or auto, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a stage index (>= 0) or auto, got {value}")
    return value


def _clip_grad_norm(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"must be a finite positive number, or none for no clipping; got {text!r}"
        )
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _server_flags() -> tuple[Flag, ...]:
    """What ``swarm serve`` and ``swarm serve-stage`` share: fields of ``ServeConfig`` and
    ``StageServerConfig`` alike."""
    return (
        Flag("clip_grad_norm", _clip_grad_norm, "NORM"),
        Flag("max_batch_size", _positive_int),
    )


#: ``ServerConfig``'s fields the hosting commands take.
SERVER_CONFIG_FLAGS = (
    Flag("linear_kernels"),
    Flag("announce_interval", help="seconds between DHT announcements; they live 3x this"),
)


def _add_server_options(parser: argparse.ArgumentParser, config: type) -> None:
    """What every hosting command takes: batching, training, announcing, addresses;
    ``config`` is the command's config (``ServeConfig`` or ``StageServerConfig``)."""
    from swarm.experts.server_config import ServerConfig
    from swarm.optim_spec import default_optimizer

    add_flags(parser, config, _server_flags())
    default = default_optimizer()
    parser.add_argument(
        "--optimizer",
        choices=["adam", "adamw", "sgd", "none"],
        default=default.kind,
        help=f"how the hosted modules train on their backward passes (default {default.kind})",
    )
    parser.add_argument(
        "--lr",
        type=_positive_float,
        default=default.lr,
        help=f"learning rate (default {default.lr:g})",
    )
    add_flags(parser, ServerConfig, SERVER_CONFIG_FLAGS)
    _add_join_options(parser)


def _optimizer(args: argparse.Namespace) -> OptimizerSpec | None:
    from swarm.optim_spec import OptimizerSpec

    return None if args.optimizer == "none" else OptimizerSpec(kind=args.optimizer, lr=args.lr)


def _server_config(args: argparse.Namespace, **fields: Any) -> ServerConfig:
    from swarm.experts.server_config import ServerConfig

    values = flag_values(args, ServerConfig, SERVER_CONFIG_FLAGS)
    announce_ttl = 3 * values["announce_interval"]
    return ServerConfig(**values, announce_ttl=announce_ttl, **fields)


#: ``ServeConfig``'s fields ``swarm serve`` takes (besides the shared server flags).
def _serve_flags() -> tuple[Flag, ...]:
    return (
        Flag("module"),
        Flag("hidden_dim", _positive_int),
        Flag("seed", int),
    )


def _add_serve_flags(serve: argparse.ArgumentParser) -> None:
    from swarm.experts.serve import ServeConfig

    serve.add_argument("--uids", nargs="+", metavar="UID", help="uids to host, e.g. ffn.0.3")
    serve.add_argument(
        "--expert-pattern",
        action="append",
        metavar="PATTERN",
        help="host every uid of a grid pattern, e.g. 'ffn.[0:4].[0:4]'; repeatable",
    )
    add_flags(serve, ServeConfig, _serve_flags())
    serve.add_argument(
        "--allow-trainer",
        action="append",
        type=peer_id_arg,
        metavar="PEERID",
        help="train only on backward calls of these peers (forward stays open); repeatable",
    )
    serve.add_argument(
        "--allow-trainer-file",
        metavar="PATH",
        help="trainers' peer IDs, one per line (# comments); with --allow-trainer, both",
    )
    _add_server_options(serve, ServeConfig)


def _stage_flags() -> tuple[Flag, ...]:
    """``StageServerConfig``'s fields ``swarm serve-stage`` takes."""
    return (
        Flag("stage", _stage, help="stage index, or auto: the most under-served stage at start"),
        Flag("uid_prefix"),
        Flag(
            "synchronous",
            name="--asynchronous",
            help="step on every backward served and average with the stage's other servers "
            "every --average-interval, instead of stepping with them once per client step",
        ),
        Flag("rebalance_interval_seconds", _positive_float, "SECONDS", name="--rebalance-interval"),
    )


#: ``ReplicaConfig``'s fields ``swarm serve-stage`` takes.
REPLICA_FLAGS = (
    Flag("run_id"),
    Flag(
        "interval_seconds",
        _positive_float,
        "SECONDS",
        name="--average-interval",
        help="seconds between averaging rounds with the stage's other servers",
    ),
)


def _add_serve_stage_flags(stage: argparse.ArgumentParser) -> None:
    from swarm.pipeline import ReplicaConfig, StageServerConfig

    stage.add_argument(
        "--model",
        default="digits",
        help="built-in pipeline model (digits, charlm) or package.module:attribute "
        "(default digits)",
    )
    add_flags(stage, StageServerConfig, _stage_flags())
    add_flags(stage, ReplicaConfig, REPLICA_FLAGS)
    _add_server_options(stage, StageServerConfig)


def _join_flags() -> tuple[Flag, ...]:
    """How a long-running peer joins (:class:`swarm.join_config.JoinConfig`): the flags
    of ``bootstrap``, ``serve``, ``serve-stage``, ``train`` and ``join``."""
    return (
        Flag("initial_peers", initial_peer_arg, "MADDR", nargs=True),
        Flag("listen", listen_arg, "MADDR"),
        Flag("announce", announce_arg, "MADDR"),
        Flag("reachability", choices=("auto", "public", "private")),
        Flag("relay", help="neither serve as a circuit relay for peers behind NAT nor use relays"),
        Flag("identity", metavar="PATH"),
        Flag("swarm_key", metavar="PATH"),
        Flag("status_interval", _status_interval, "SECONDS"),
    )


def _add_join_options(parser: argparse.ArgumentParser) -> None:
    from swarm.join_config import JoinConfig

    add_flags(parser, JoinConfig, _join_flags())
    _add_allow_options(parser)
    _add_metrics_option(parser)


def _add_bootstrap_flags(boot: argparse.ArgumentParser) -> None:
    _add_join_options(boot)


def _add_ping_flags(ping: argparse.ArgumentParser) -> None:
    ping.add_argument(
        "maddr",
        type=multiaddr_arg,
        metavar="MADDR",
        help="e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...",
    )
    ping.add_argument("--count", type=_positive_int, default=3, help="number of pings (default 3)")
    ping.add_argument(
        "--identity", metavar="PATH", help="ping as this key (e.g. a private swarm's member)"
    )
    ping.add_argument(
        "--timeout", type=_positive_float, default=10.0, help="seconds per step (default 10)"
    )
    _add_swarm_key_option(ping)


def _add_status_flags(status: argparse.ArgumentParser) -> None:
    status.add_argument(
        "--initial-peers", nargs="+", type=initial_peer_arg, metavar="MADDR", required=True
    )
    status.add_argument(
        "--timeout", type=_positive_float, default=10.0, help="seconds to reach them (default 10)"
    )
    status.add_argument(
        "--json", action="store_true", help="print one JSON object (for programs) instead of text"
    )
    _add_swarm_key_option(status)


def _add_swarm_key_flags(key: argparse.ArgumentParser) -> None:
    key.add_argument("path", metavar="PATH", help="file to create (never overwritten)")


@dataclasses.dataclass(frozen=True)
class Command:
    """One ``swarm`` subcommand."""

    summary: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    needs_torch: bool = False
    """Imports torch to build its flags and to run (checked for first, with the install
    command in the error)."""


def _train_command(command: str) -> Command:
    summaries = {
        "train": "train a task (built in or your own) with a swarm; with no --initial-peers, "
        "start one",
        "join": "join a running swarm through --initial-peers and train with it",
    }
    return Command(
        summaries[command], lambda p: _add_train_parser(p, command), _train, needs_torch=True
    )


COMMANDS: dict[str, Command] = {
    "bootstrap": Command(
        "host a bootstrap peer and print its multiaddrs",
        _add_bootstrap_flags,
        lambda args: run(_bootstrap(args)),
    ),
    "ping": Command(
        "dial a peer, identify it and ping it", _add_ping_flags, lambda args: run(_ping(args))
    ),
    "status": Command(
        "join as a client and show the swarm: peers and their reachability, runs, experts "
        "and pipeline stages",
        _add_status_flags,
        lambda args: run(_status(args)),
    ),
    "dashboard": Command(
        DASHBOARD_HELP, add_dashboard_flags, lambda args: run(dashboard_command(args))
    ),
    "swarm-key": Command(
        "make a new key for a private network (give it to every peer)",
        _add_swarm_key_flags,
        _swarm_key,
    ),
    "serve": Command(
        "host experts (torch modules) for others to call",
        _add_serve_flags,
        lambda args: run(_serve(args)),
        needs_torch=True,
    ),
    "serve-stage": Command(
        "serve one stage of a pipeline (SWARM parallelism) for others",
        _add_serve_stage_flags,
        lambda args: run(_serve_stage(args)),
        needs_torch=True,
    ),
    "train": _train_command("train"),
    "join": _train_command("join"),
    "demo": Command(
        "a local swarm trains a small model, then meets one process (the default)",
        _add_demo_flags,
        _demo,
        needs_torch=True,
    ),
}


def build_parser(flags_of: Collection[str] | None = None) -> argparse.ArgumentParser:
    """``swarm``'s parser. Every command is listed; only those in ``flags_of`` (None:
    all) get their flags, so that ``swarm ping`` or ``swarm --help`` builds no torch
    command's flags (their configs import torch)."""
    parser = OneLineParser(prog="swarm", description="swarmtrain: train together, peer to peer.")
    parser.add_argument("--version", action="version", version=f"swarm {package_version()}")
    sub = parser.add_subparsers(dest="command")
    for name, command in COMMANDS.items():
        examples = DASHBOARD_EXAMPLES if name == "dashboard" else EXAMPLES[name]
        p = sub.add_parser(
            name,
            help=command.summary,
            description=f"{command.summary}.",
            epilog="example:\n" + "\n".join(f"  {line}" for line in examples),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if flags_of is None or name in flags_of:
            command.add_flags(p)
    return parser


_PEER = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
#: One example per command, shown by ``swarm COMMAND --help``.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "bootstrap": ("swarm bootstrap --listen /ip4/0.0.0.0/tcp/31337 --identity boot.key",),
    "ping": (f"swarm ping {_PEER}",),
    "status": (
        f"swarm status --initial-peers {_PEER}",
        f"swarm status --initial-peers {_PEER} --json",
    ),
    "dashboard": DASHBOARD_EXAMPLES,
    "swarm-key": ("swarm swarm-key team.key   # then every peer runs with --swarm-key team.key",),
    "serve": (
        "swarm serve --expert-pattern 'ffn.[0:4].[0:4]' --hidden-dim 1024 --optimizer adam \\",
        f"    --lr 1e-3 --listen /ip4/0.0.0.0/tcp/31338 --initial-peers {_PEER}",
        "swarm serve --uids ffn.0.0 --allow-trainer-file trainers.txt   # only they train it",
    ),
    "serve-stage": (
        f"swarm serve-stage --model digits --stage auto --lr 1e-3 --initial-peers {_PEER}",
    ),
    "train": (
        "swarm train --listen /ip4/0.0.0.0/tcp/31337 --num-peers 2   # prints the join command",
        "swarm train --task my_task:make_task   # your own swarm.tasks.Task (MODULE:FACTORY)",
    ),
    "join": (f"swarm join --initial-peers {_PEER} --task digits --run-id demo",),
    "demo": (
        "swarm demo --num-peers 4",
        "swarm demo --speed   # the same model, faster than one process",
    ),
}


#: The environment variable that sets what ``swarm`` logs: ``warning`` (the default:
#: warnings and errors, one line each), ``info`` (also what each layer decides: rounds,
#: relays, hole punches, slots taken over) or ``debug``.
LOG_LEVEL_ENV = "SWARM_LOG_LEVEL"
_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def log_level() -> int:
    """The level :data:`LOG_LEVEL_ENV` names (UsageError for another word)."""
    raw = os.environ.get(LOG_LEVEL_ENV, "warning")
    level = _LOG_LEVELS.get(raw.strip().lower())
    if level is None:
        raise UsageError(f"{LOG_LEVEL_ENV}={raw[:40]!r}: give one of {', '.join(_LOG_LEVELS)}")
    return level


def _start_logging() -> None:
    level = log_level()
    if level >= logging.WARNING:
        logging.basicConfig(level=level, format="warning: %(message)s")
        return
    # A log to read after the fact: when, how bad, and which layer said it. Only our own
    # packages go below warning (a dependency's debug lines would bury ours).
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for package in ("peers", "averaging", "swarm"):
        logging.getLogger(package).setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names; returns its exit code: 0, 1 for a failure while
    it ran, 2 for a bad command line (one line on stderr, before anything else), 130
    after Ctrl-C."""
    words = list(sys.argv[1:] if argv is None else argv)
    if not words:  # plain `swarm`: the demo
        print(
            "swarm: no command given, so running the demo (swarm demo); "
            "swarm --help lists the commands",
            file=sys.stderr,
            flush=True,
        )
        words = ["demo"]
    name = words[0] if words[0] in COMMANDS else None
    if name is not None and COMMANDS[name].needs_torch:
        try:
            require_torch(name)
        except UsageError as e:
            return exit_usage(e, name)
    args = build_parser(() if name is None else (name,)).parse_args(words)
    try:
        _start_logging()
    except UsageError as e:
        return exit_usage(e, args.command)
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as e:
        return exit_usage(e, args.command)
    except PeersError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
