"""Metrics in every long-running peer: Prometheus text format on ``--metrics [HOST:]PORT``.

Nothing is counted twice: every subsystem already keeps its statistics
(:class:`peers.PeerStatistics`, :class:`peers.dht.DHTStatistics`, the optimizer's
:class:`swarm.collaborative.config.OptimizerStatistics`, an expert server's
:class:`swarm.experts.server.ServerStatistics`), and a scrape turns a snapshot of them
into metric families (the ``*_families`` functions, pure). Snapshots are taken on the
thread that owns the statistics: the event loop's for a peer and its DHT (through
:class:`LoopCollector`), the training thread's for training progress (it publishes
each step into a :class:`TrainingSnapshot`). The HTTP server is prometheus-client's, in
a thread of its own, bound to loopback unless told otherwise.

The same :class:`prometheus_client.CollectorRegistry` is readable from Python
(``registry.get_sample_value(name, labels)``), which is how the tests read it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from peers.config import PeerStatistics
from peers.traffic import LATENCY_BUCKETS, CallLatency, TrafficSnapshot

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from peers.dht.config import DHTStatistics

#: Seconds a scrape waits for the event loop to hand over a snapshot.
SCRAPE_TIMEOUT = 5.0
#: Where ``--metrics PORT`` listens without a host: this machine only.
DEFAULT_METRICS_HOST = "127.0.0.1"

Families = list["Metric"]
Snapshot = Callable[[], Families]
#: Runs a snapshot on the event loop that owns its statistics, waiting a bounded time.
LoopRunner = Callable[[Snapshot], Families]
__all__ = [
    "DEFAULT_METRICS_HOST",
    "LoopCollector",
    "MetricsServer",
    "TrainingSnapshot",
    "as_coroutine",
    "dht_families",
    "loop_runner",
    "parse_metrics_address",
    "peer_families",
    "pipeline_families",
    "server_families",
    "traffic_families",
    "training_families",
]


def parse_metrics_address(text: str) -> tuple[str, int]:
    """``PORT`` (loopback), ``HOST:PORT`` or ``[IPV6]:PORT``; ValueError naming the
    form for anything else."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = DEFAULT_METRICS_HOST, text
    host = host.removeprefix("[").removesuffix("]")
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535 or not host:
        raise ValueError(f"{text!r} is not PORT or HOST:PORT (e.g. 9100 or 0.0.0.0:9100)")
    return host, port


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def peer_families(stats: PeerStatistics) -> Families:
    """The host's connections, streams and refusals."""
    return [
        _gauge("swarm_peer_connections", "Open connections.", stats.num_connections),
        _gauge(
            "swarm_peer_relayed_connections",
            "Open connections through a circuit relay.",
            stats.num_relayed_connections,
        ),
        _gauge("swarm_peer_streams", "Open streams, on all connections.", stats.num_streams),
        _counter(
            "swarm_peer_handshake_failures",
            "Inbound connections whose handshake failed.",
            stats.num_handshake_failures,
        ),
        _counter(
            "swarm_peer_inbound_refused",
            "Inbound connections refused (limits, rates).",
            stats.num_inbound_connections_refused,
        ),
        _counter(
            "swarm_peer_not_allowed",
            "Connections refused, or dials not made, for peers outside the allow-list.",
            stats.num_not_allowed,
        ),
        _counter("swarm_peer_streams_refused", "Streams refused.", stats.num_streams_refused),
        _counter(
            "swarm_peer_idle_closed",
            "Idle inbound connections closed to make room.",
            stats.num_idle_closed,
        ),
        _counter(
            "swarm_peer_addresses_refused",
            "Addresses learned from peers that we will not dial.",
            stats.num_addresses_refused,
        ),
        *traffic_families(stats.traffic),
    ]


def traffic_families(traffic: TrafficSnapshot) -> Families:
    """Payload bytes by protocol, and this peer's unary and streaming calls by protocol:
    latency histograms and the failures."""
    received = CounterMetricFamily(
        "swarm_peer_protocol_bytes_received",
        "Payload bytes received on streams, by protocol.",
        labels=["protocol"],
    )
    sent = CounterMetricFamily(
        "swarm_peer_protocol_bytes_sent",
        "Payload bytes sent on streams, by protocol.",
        labels=["protocol"],
    )
    for protocol, counts in sorted(traffic.protocols.items()):
        received.add_metric([protocol], counts.bytes_received)
        sent.add_metric([protocol], counts.bytes_sent)
    calls = sorted(traffic.calls.items())
    streams = sorted(traffic.stream_calls.items())
    return [
        received,
        sent,
        latency_family(
            "swarm_peer_call_seconds", "Unary calls this peer made, by protocol.", calls
        ),
        _failures_family(
            "swarm_peer_call_failures",
            "Unary calls that failed (timeouts, remote errors, broken streams), by protocol.",
            calls,
        ),
        latency_family(
            "swarm_peer_stream_call_seconds",
            "Streaming calls this peer made, from the call to the end of the responses, "
            "by protocol.",
            streams,
        ),
        _failures_family(
            "swarm_peer_stream_call_failures",
            "Streaming calls that failed, by protocol.",
            streams,
        ),
    ]


def latency_family(
    name: str,
    doc: str,
    items: Iterable[tuple[str | tuple[str, ...], CallLatency]],
    labels: Sequence[str] = ("protocol",),
) -> HistogramMetricFamily:
    """A Prometheus histogram of :class:`peers.traffic.CallLatency` records, one per
    label value (a string for one label, a tuple for several)."""
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    for key, latency in items:
        values = [key] if isinstance(key, str) else list(key)
        buckets = [
            (repr(bound), count)
            for bound, count in zip(LATENCY_BUCKETS, latency.bucket_counts[:-1], strict=True)
        ]
        buckets.append(("+Inf", latency.count))
        family.add_metric(values, buckets, sum_value=latency.sum_seconds)
    return family


def _failures_family(
    name: str, doc: str, items: Iterable[tuple[str, CallLatency]]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["protocol"])
    for protocol, latency in items:
        family.add_metric([protocol], latency.failures)
    return family


def dht_families(stats: DHTStatistics) -> Families:
    """The DHT node's table, records, and RPCs by kind and outcome."""
    families: Families = [
        _gauge("swarm_dht_contacts", "Contacts in the routing table.", stats.num_contacts),
        _gauge("swarm_dht_records", "Records held.", stats.num_records),
        _counter(
            "swarm_dht_stores_refused_far",
            "Stores refused: the key's nearest nodes are elsewhere.",
            stats.num_stores_refused_far,
        ),
        _counter(
            "swarm_dht_contacts_refused_by_source",
            "Contacts refused: their network had its share of the table.",
            stats.num_contacts_refused_by_source,
        ),
    ]
    for name, doc, table in (
        ("swarm_dht_rpcs_served", "DHT requests served, by kind.", stats.rpcs_served),
        ("swarm_dht_rpcs_sent", "DHT requests sent, by kind.", stats.rpcs_sent),
        ("swarm_dht_rpcs_failed", "DHT requests sent that failed, by kind.", stats.rpcs_failed),
    ):
        family = CounterMetricFamily(name, doc, labels=["rpc"])
        for rpc, count in sorted(table.items()):
            family.add_metric([rpc], count)
        families.append(family)
    return families


def server_families(stats: Any, stage: int | None = None) -> Families:
    """An expert or stage server's modules, from its ``ServerStatistics`` (duck-typed):
    samples served, optimizer steps, clipped contributions, queues and request
    latencies, by module; with
    ``stage``, the pipeline stage served (-1 between stages)."""
    families: Families = []
    per_module = (
        ("swarm_server_forward_samples", "Forward samples served.", "num_forward_samples"),
        ("swarm_server_backward_samples", "Backward samples served.", "num_backward_samples"),
        ("swarm_server_optimizer_steps", "Optimizer steps taken.", "num_optimizer_steps"),
        ("swarm_server_compute_seconds", "Seconds spent computing.", "compute_seconds"),
        (
            "swarm_server_clipped_contributions",
            "Callers' gradients clipped to clip_grad_norm.",
            "num_clipped_contributions",
        ),
    )
    for name, doc, attr in per_module:
        family = CounterMetricFamily(name, doc, labels=["module"])
        for uid, module in sorted(stats.modules.items()):
            family.add_metric([uid], getattr(module, attr))
        families.append(family)
    queued = GaugeMetricFamily("swarm_server_queued_samples", "Samples waiting.", labels=["module"])
    throughput = GaugeMetricFamily(
        "swarm_server_samples_per_second", "Samples served per second.", labels=["module"]
    )
    for uid, count in sorted(stats.queued_samples.items()):
        queued.add_metric([uid], count)
    for uid, rate in sorted(stats.throughput.items()):
        throughput.add_metric([uid], rate)
    families += [queued, throughput]
    families.append(
        latency_family(
            "swarm_server_call_seconds",
            "Requests from their arrival in the queue to their result, by module and direction.",
            [(key, latency) for key, latency in getattr(stats, "latency", {}).items()],
            labels=("module", "direction"),
        )
    )
    families.append(
        _counter(
            "swarm_server_refused_trainings",
            "Backward calls refused: their peer is not an allowed trainer.",
            stats.num_refused_trainings,
        )
    )
    if stage is not None:
        families.append(_gauge("swarm_stage", "Pipeline stage served (-1: none).", stage))
    return families


def pipeline_families(stats: Any) -> Families:
    """A pipeline client's (``swarm.pipeline.PipelineClient.statistics()``): its
    micro-batches, failed stage calls (retried elsewhere), and each stage's call
    latency by direction."""
    latencies = [
        ((str(stage), direction), latency)
        for (stage, direction), latency in stats.call_latency.items()
    ]
    return [
        _counter(
            "swarm_pipeline_forwards", "Micro-batches sent through every stage.", stats.num_forwards
        ),
        _counter(
            "swarm_pipeline_backwards",
            "Micro-batches back-propagated through every stage.",
            stats.num_backwards,
        ),
        _counter(
            "swarm_pipeline_failed_calls",
            "Stage calls that failed and were retried on another server (or gave up).",
            stats.num_failed_calls,
        ),
        latency_family(
            "swarm_pipeline_call_seconds",
            "Stage calls of this client, by stage and direction (forward or backward).",
            latencies,
            labels=("stage", "direction"),
        ),
    ]


@dataclass
class TrainingSnapshot:
    """The training loop's latest step, published by the training thread and read by
    scrapes (a lock keeps the pair consistent)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stats: Any = None
    _loss: float = float("nan")

    def publish(self, stats: Any, loss: float) -> None:
        """``stats``: an ``OptimizerStatistics``; ``loss``: the last local batch's."""
        with self._lock:
            self._stats, self._loss = stats, float(loss)

    def families(self) -> Families:
        with self._lock:
            stats, loss = self._stats, self._loss
        return [] if stats is None else training_families(stats, loss)


def training_families(stats: Any, loss: float) -> Families:
    """Training progress from an ``OptimizerStatistics`` (duck-typed: this module does
    not import torch) and the last local batch's loss."""
    return [
        _gauge("swarm_train_epoch", "The swarm's epoch (global steps taken).", stats.epoch),
        _counter("swarm_train_local_samples", "Samples this peer trained on.", stats.local_samples),
        _counter("swarm_train_local_steps", "Local optimizer steps.", stats.local_steps),
        _counter(
            "swarm_train_rounds", "Averaging rounds this peer took part in.", stats.num_rounds
        ),
        _counter(
            "swarm_train_rounds_alone",
            "Global steps taken without anyone to average with.",
            stats.num_rounds_alone,
        ),
        _counter("swarm_train_state_loads", "States loaded from peers.", stats.num_state_loads),
        _counter(
            "swarm_train_splits", "Times this peer followed the swarm's majority.", stats.num_splits
        ),
        _counter("swarm_train_bytes_sent", "Bytes sent in averaging rounds.", stats.bytes_sent),
        _counter(
            "swarm_train_rounds_not_agreed",
            "Rounds that formed a group but ended without its agreed result.",
            stats.num_rounds_not_agreed,
        ),
        _counter(
            "swarm_train_rounds_without_group",
            "Steps where peers were there but no group formed in time.",
            stats.num_rounds_without_group,
        ),
        _counter(
            "swarm_train_round_seconds",
            "Seconds in rounds that formed a group (matchmaking and all-reduce).",
            stats.round_seconds,
        ),
        _counter(
            "swarm_train_matchmaking_seconds",
            "Of the round seconds, forming groups.",
            stats.matchmaking_seconds,
        ),
        _counter(
            "swarm_train_allreduce_seconds",
            "Of the round seconds, all-reduces (from a group's forming to its result).",
            stats.allreduce_seconds,
        ),
        _counter(
            "swarm_train_wait_seconds",
            "Seconds the training loop waited for the other peers' samples, outside rounds.",
            stats.wait_seconds,
        ),
        latency_family(
            "swarm_train_round_duration_seconds",
            "Rounds that formed a group (matchmaking and all-reduce), by duration.",
            [((), stats.round_latency)],
            labels=(),
        ),
        _gauge(
            "swarm_train_reducer_spread",
            "Largest difference between two reducers' copies of one coordinate, last round.",
            stats.reducer_spread,
        ),
        _gauge("swarm_train_peers", "Live peers of the run.", stats.num_peers),
        _gauge(
            "swarm_train_samples_per_second",
            "The swarm's training throughput.",
            stats.samples_per_second,
        ),
        _gauge("swarm_train_loss", "Loss of this peer's last local batch.", loss),
    ]


class LoopCollector(Collector):
    """Collects where the statistics live: a scrape, on the HTTP server's thread, has
    ``run`` execute ``snapshot()`` on the owning event loop and waits for it (``run``
    bounds the wait; a stopped or stuck loop yields nothing, never a hung scrape)."""

    def __init__(self, run: LoopRunner, snapshot: Snapshot) -> None:
        self._run = run
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._run(self._snapshot)
        except (TimeoutError, RuntimeError, concurrent.futures.CancelledError):
            return


async def as_coroutine(snapshot: Snapshot) -> Families:
    """``snapshot()``, as a coroutine to hand to a loop."""
    return snapshot()


def loop_runner(loop: asyncio.AbstractEventLoop) -> LoopRunner:
    """A :class:`LoopCollector` runner for ``loop``: from another thread, through the
    loop; on the loop's own thread (a test reading the registry), directly."""

    def run(snapshot: Snapshot) -> Families:
        try:
            if asyncio.get_running_loop() is loop:
                return snapshot()
        except RuntimeError:  # no loop running in this thread: the usual case
            pass
        if loop.is_closed():
            return []
        future = asyncio.run_coroutine_threadsafe(as_coroutine(snapshot), loop)
        try:
            return future.result(timeout=SCRAPE_TIMEOUT)
        finally:
            future.cancel()

    return run


class _CallCollector(Collector):
    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families()


class MetricsServer:
    """A registry and, once :meth:`start` is called, the HTTP server exposing it
    (``/metrics``). Stop it with :meth:`close`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def add_loop_source(self, run: LoopRunner, snapshot: Snapshot) -> None:
        """Metric families that ``snapshot()`` builds on an event loop, which ``run``
        reaches (:func:`loop_runner`, or a ``BlockingPeer``'s ``run`` with a timeout)."""
        self.registry.register(LoopCollector(run, snapshot))

    def add_source(self, families: Callable[[], Iterable[Metric]]) -> None:
        """Metric families built on the scraping thread (thread-safe sources only)."""
        self.registry.register(_CallCollector(families))

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (port 0: any free one); the port bound."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_port)
        return self.port

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value, read as a scrape would (None if absent)."""
        value: float | None = self.registry.get_sample_value(name, labels)
        return value

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def samples(families: Iterable[Metric]) -> list[Sample]:
    """Every sample of ``families`` (for tests and ``swarm status``)."""
    return [s for family in families for s in family.samples]
