"""Status records: what each peer says about itself, for ``swarm status`` and dashboards.

Every long-running peer publishes one record under :data:`STATUS_KEY`, in a subkey that
names it as owner (so it is signed, and nobody writes another peer's record): its
software, how others reach it, the training runs it takes part in and what it serves.
There is no central server to ask, so the swarm's view is the union of these records.

This module is the record's schema and nothing else (no I/O, no DHT): every DHT node
checks a record under :data:`STATUS_KEY` against it before storing it
(:func:`peers.dht.records.validate`), so a malformed or oversized record is refused by
the replicas, costs them one decode of at most :data:`MAX_STATUS_BYTES`, and never
reaches a reader. Records are small and flat: strings are bounded and printable, numbers
finite, lists short. A peer may replace its record at most every
:data:`MIN_STATUS_INTERVAL_SECONDS` (by the record's own clock; replicas refuse sooner
updates, :func:`too_soon`), so one peer cannot make the replicas re-store and re-verify
its record in a loop.

Everything in a record is the publisher's claim: readers show it as such (escaped, and
never summed into anything that steers training).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from peers.printable import printable
from peers.serialization import pack
from peers.varint import VarintError, decode_uvarint

STATUS_KEY = b"swarmtrain/status/v1"
#: Largest serialized record. The largest record the schema allows (every string at its
#: longest, every count at 2**63) is about 2.5 KiB, as a test checks, so only a broken
#: record meets this cap; a full key (``MAX_SUBKEYS_PER_KEY`` records) is then at most
#: 4 MiB, sent in pages.
MAX_STATUS_BYTES = 4096
#: A publisher may replace its record at most this often (by the records' ``time``):
#: dashboards refresh every few seconds, so faster updates show nothing new.
MIN_STATUS_INTERVAL_SECONDS = 2.0
#: Longest string in a record, in UTF-8 bytes (a run id, an expert uid, an agent version).
MAX_STATUS_STRING = 64
#: Runs one peer reports (a peer trains in one run; a few leave room for experiments).
MAX_STATUS_RUNS = 4
#: Served modules one peer reports: an expert server may host hundreds; the record lists
#: the first ones and ``num_served`` says how many there are.
MAX_STATUS_SERVED = 16
#: The schema version a reader understands; a newer one is refused, not misread.
STATUS_VERSION = 1

REACHABILITIES = ("public", "private", "relayed", "unknown")
"""How others reach a peer: ``public`` (dialed back by others), ``private`` (behind a
NAT or firewall, no relay yet), ``relayed`` (behind one, reached through relays),
``unknown`` (not known yet, or listening on loopback only)."""
SERVED_KINDS = ("expert", "stage")


class StatusError(ValueError):
    """A status record breaks the schema; the publisher's fault."""


@dataclass(frozen=True, slots=True)
class RunStatus:
    """One training run, as one of its peers reports it."""

    run_id: str
    epoch: int
    """Global steps (outer steps with DiLoCo) this peer has taken part in."""
    samples: int
    """Samples this peer has processed in the run."""
    samples_per_second: float
    loss: float | None
    """This peer's latest training loss (``None`` before its first step)."""
    num_peers: int
    """Peers in the run's current epoch, as this peer last saw them."""
    num_rounds: int
    num_rounds_failed: int
    """Rounds that formed no group in time or did not end agreed."""


@dataclass(frozen=True, slots=True)
class ServedStatus:
    """A module a peer serves: an expert, or a pipeline stage."""

    kind: str
    """``"expert"`` or ``"stage"`` (:data:`SERVED_KINDS`)."""
    name: str
    """The expert's uid, or the pipeline's uid prefix."""
    stage: int
    """The stage index (0 for an expert)."""
    num_stages: int
    """Stages of the pipeline (0 for an expert)."""
    queued: int
    """Samples waiting in its queue."""
    num_batches: int
    """Batches processed (forward and backward) since it started."""


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """One peer's record."""

    agent: str
    reachability: str
    time: float
    """When it was published (``dht_time``)."""
    runs: tuple[RunStatus, ...] = ()
    served: tuple[ServedStatus, ...] = ()
    num_served: int = 0
    """How many modules it serves (``served`` lists at most :data:`MAX_STATUS_SERVED`)."""

    def to_value(self) -> dict[str, Any]:
        """The record's value, as :meth:`peers.dht.DHT.store` takes it; raises
        :class:`StatusError` if it breaks the schema (so a publisher finds out before
        the replicas refuse it)."""
        value = {
            "v": STATUS_VERSION,
            "agent": self.agent,
            "reach": self.reachability,
            "time": float(self.time),
            "runs": [
                [
                    r.run_id,
                    r.epoch,
                    r.samples,
                    float(r.samples_per_second),
                    r.loss,
                    r.num_peers,
                    r.num_rounds,
                    r.num_rounds_failed,
                ]
                for r in self.runs
            ],
            "served": [
                [s.kind, s.name, s.stage, s.num_stages, s.queued, s.num_batches]
                for s in self.served
            ],
            "num_served": self.num_served,
        }
        parse_status(pack(value))
        return value


def _refuse_ext(code: int, data: bytes) -> Any:
    raise StatusError("a status record holds no extension types")


def parse_status(data: bytes) -> PeerStatus:
    """Decode and check a record's value bytes (:func:`peers.serialization.pack` of a
    :meth:`PeerStatus.to_value`); raises :class:`StatusError` naming the first rule it
    breaks. Nothing but plain msgpack is decoded (no arrays, no extension types)."""
    if len(data) > MAX_STATUS_BYTES:
        raise StatusError(f"{len(data)} bytes, the limit is {MAX_STATUS_BYTES}")
    try:
        decoded = decode_uvarint(data)
    except VarintError as e:
        raise StatusError(f"bad head length: {e}") from e
    if decoded is None or decoded[0] + decoded[1] != len(data):
        raise StatusError("not one plain msgpack value")
    try:
        raw = msgpack.unpackb(
            data[decoded[1] :],
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_array_len=_MAX_ITEMS,
            max_map_len=_MAX_ITEMS,
        )
    except StatusError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise StatusError(f"not msgpack: {e}") from e
    return status_from_value(raw)


def status_from_value(raw: object) -> PeerStatus:
    """Check a decoded record (as :meth:`peers.dht.DHT.get` returns it); raises
    :class:`StatusError` naming the first rule it breaks."""
    if not isinstance(raw, dict) or set(raw) != _FIELDS:
        raise StatusError(f"the fields must be {sorted(_FIELDS)}")
    if type(raw["v"]) is not int or raw["v"] != STATUS_VERSION:
        raise StatusError(f"schema version {raw['v']!r}; this peer reads {STATUS_VERSION}")
    reach = _string(raw["reach"], "reach")
    if reach not in REACHABILITIES:
        raise StatusError(f"reachability {reach!r} is not one of {REACHABILITIES}")
    runs, served = raw["runs"], raw["served"]
    if not isinstance(runs, list) or len(runs) > MAX_STATUS_RUNS:
        raise StatusError(f"runs must be a list of at most {MAX_STATUS_RUNS}")
    if not isinstance(served, list) or len(served) > MAX_STATUS_SERVED:
        raise StatusError(f"served must be a list of at most {MAX_STATUS_SERVED}")
    num_served = _count(raw["num_served"], "num_served")
    if num_served < len(served):
        raise StatusError("num_served is smaller than the served list")
    return PeerStatus(
        agent=_string(raw["agent"], "agent"),
        reachability=reach,
        time=_number(raw["time"], "time"),
        runs=tuple(_run(r) for r in runs),
        served=tuple(_served(s) for s in served),
        num_served=num_served,
    )


#: Most elements in one container of a record: the longest list is ``served``.
_MAX_ITEMS = 64
_FIELDS = {"v", "agent", "reach", "time", "runs", "served", "num_served"}


def _string(value: object, name: str) -> str:
    if not isinstance(value, str) or len(value.encode()) > MAX_STATUS_STRING:
        raise StatusError(f"{name} must be a string of at most {MAX_STATUS_STRING} UTF-8 bytes")
    if not value.isprintable():
        raise StatusError(f"{name} holds a control character")
    return value


def fit(text: str) -> str:
    """``text`` made fit for a record: control characters escaped
    (:func:`peers.printable.printable`), cut to :data:`MAX_STATUS_STRING` UTF-8 bytes."""
    value = printable(text, MAX_STATUS_STRING)
    while len(value.encode()) > MAX_STATUS_STRING:
        value = value[:-1]
    return value


def _count(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise StatusError(f"{name} must be a count (an integer >= 0)")
    return value


def _number(value: object, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise StatusError(f"{name} must be a finite number")
    if value < 0:
        raise StatusError(f"{name} must not be negative")
    return float(value)


def _run(value: object) -> RunStatus:
    if not isinstance(value, list) or len(value) != 8:
        raise StatusError("a run must be a list of 8 fields")
    run_id, epoch, samples, rate, loss, num_peers, num_rounds, num_failed = value
    if not run_id:
        raise StatusError("a run needs an id")
    return RunStatus(
        run_id=_string(run_id, "run id"),
        epoch=_count(epoch, "epoch"),
        samples=_count(samples, "samples"),
        samples_per_second=_number(rate, "samples per second"),
        loss=None if loss is None else _number(loss, "loss"),
        num_peers=_count(num_peers, "num_peers"),
        num_rounds=_count(num_rounds, "num_rounds"),
        num_rounds_failed=_count(num_failed, "num_rounds_failed"),
    )


def _served(value: object) -> ServedStatus:
    if not isinstance(value, list) or len(value) != 6:
        raise StatusError("a served module must be a list of 6 fields")
    kind, name, stage, num_stages, queued, num_batches = value
    kind = _string(kind, "kind")
    if kind not in SERVED_KINDS:
        raise StatusError(f"kind {kind!r} is not one of {SERVED_KINDS}")
    if not name:
        raise StatusError("a served module needs a name")
    stage, num_stages = _count(stage, "stage"), _count(num_stages, "num_stages")
    if kind == "stage" and not stage < num_stages:
        raise StatusError(f"stage {stage} of {num_stages} stages")
    return ServedStatus(
        kind=kind,
        name=_string(name, "name"),
        stage=stage,
        num_stages=num_stages,
        queued=_count(queued, "queued"),
        num_batches=_count(num_batches, "num_batches"),
    )


def too_soon(held: bytes, incoming: bytes) -> bool:
    """Whether ``incoming`` replaces ``held`` (both valid) sooner than
    :data:`MIN_STATUS_INTERVAL_SECONDS` after it, by the records' own times."""
    return parse_status(incoming).time < parse_status(held).time + MIN_STATUS_INTERVAL_SECONDS
