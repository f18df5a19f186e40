"""The status record's schema, as every DHT replica checks it (pure: no network)."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

from peers import KeyPair
from peers.dht.records import (
    MAX_CLOCK_SKEW_SECONDS,
    Record,
    RecordError,
    RecordErrorReason,
    owner_marker,
    validate,
)
from peers.dht.status import (
    MAX_STATUS_BYTES,
    MAX_STATUS_RUNS,
    MAX_STATUS_SERVED,
    MAX_STATUS_STRING,
    MIN_STATUS_INTERVAL_SECONDS,
    STATUS_KEY,
    PeerStatus,
    RunStatus,
    ServedStatus,
    StatusError,
    fit,
    parse_status,
    status_from_value,
)
from peers.dht.storage import RecordStore, StoreResult
from peers.serialization import pack

NOW = 1_000_000.0


def status(time: float = NOW, **changes: Any) -> PeerStatus:
    fields: dict[str, Any] = {
        "agent": "swarmtrain/0.1.0",
        "reachability": "relayed",
        "time": time,
        "runs": (RunStatus("demo", 3, 1024, 250.5, 0.42, 4, 3, 1),),
        "served": (ServedStatus("stage", "charlm", 1, 3, 16, 200),),
        "num_served": 1,
    }
    return PeerStatus(**{**fields, **changes})


def record(owner: KeyPair, value: object, expires: float = NOW + 60) -> Record:
    data = value if isinstance(value, bytes) else pack(value)
    return Record(STATUS_KEY, owner_marker(owner.peer_id), data, expires).sign(owner)


def test_a_record_round_trips() -> None:
    original = status()
    assert parse_status(pack(original.to_value())) == original
    assert status_from_value(original.to_value()) == original
    assert status(runs=(RunStatus("x", 0, 0, 0.0, None, 1, 0, 0),)).runs[0].loss is None


def good_value() -> dict[str, Any]:
    return status().to_value()


def changed(**fields: Any) -> dict[str, Any]:
    return {**good_value(), **fields}


BROKEN: dict[str, object] = {
    "not a map": [1, 2, 3],
    "a missing field": {k: v for k, v in good_value().items() if k != "reach"},
    "an extra field": changed(extra=1),
    "a newer schema": changed(v=2),
    "a bool for the version": changed(v=True),
    "an unknown reachability": changed(reach="everywhere"),
    "a control character": changed(agent="evil\x1b[2J"),
    "a long string": changed(agent="a" * 65),
    "a NaN time": changed(time=math.nan),
    "a negative time": changed(time=-1.0),
    "an infinite loss": changed(runs=[["demo", 1, 1, 1.0, math.inf, 1, 0, 0]]),
    "a negative count": changed(runs=[["demo", -1, 1, 1.0, 0.5, 1, 0, 0]]),
    "a bool for a count": changed(runs=[["demo", True, 1, 1.0, 0.5, 1, 0, 0]]),
    "a short run": changed(runs=[["demo", 1, 1]]),
    "a run without an id": changed(runs=[["", 1, 1, 1.0, 0.5, 1, 0, 0]]),
    "too many runs": changed(runs=[["r", 1, 1, 1.0, 0.5, 1, 0, 0]] * (MAX_STATUS_RUNS + 1)),
    "an unknown kind": changed(served=[["oracle", "x", 0, 0, 0, 0]], num_served=1),
    "a stage past the last": changed(served=[["stage", "x", 3, 3, 0, 0]], num_served=1),
    "num_served below the list": changed(num_served=0),
    "a tensor": changed(agent=__import__("numpy").zeros(3, dtype="float32")),
}


@pytest.mark.parametrize("why", sorted(BROKEN))
def test_a_broken_record_is_refused_by_every_replica(why: str) -> None:
    owner = KeyPair.generate()
    with pytest.raises(StatusError):
        parse_status(pack(BROKEN[why]))
    with pytest.raises(RecordError) as e:
        validate(record(owner, BROKEN[why]), NOW)
    assert e.value.reason is RecordErrorReason.MALFORMED
    store = RecordStore()
    with pytest.raises(RecordError):
        store.store(record(owner, BROKEN[why]), source="attacker", now=NOW)
    assert len(store) == 0
    assert store.statistics().num_rejected_invalid == 1


def test_bytes_that_are_not_one_plain_value_are_refused() -> None:
    plain = pack(good_value())
    for data in (b"", b"\xff" * 10, plain + b"x", plain[:-1], b"\x05" + msgpack.packb([1])):
        with pytest.raises(StatusError):
            parse_status(data)


def test_the_largest_valid_record_fits_under_the_cap() -> None:
    big, longest = 2**63 - 1, "\U0001f600" * (MAX_STATUS_STRING // 4)
    largest = PeerStatus(
        agent=longest,
        reachability="relayed",
        time=1e300,
        runs=(RunStatus(longest, big, big, 1e300, 1e300, big, big, big),) * MAX_STATUS_RUNS,
        served=(ServedStatus("expert", longest, big, big, big, big),) * MAX_STATUS_SERVED,
        num_served=big,
    )
    assert len(pack(largest.to_value())) < MAX_STATUS_BYTES
    assert fit("\U0001f600" * 100) == longest
    assert fit("a\nb") == "a\\x0ab"


def test_an_oversized_record_is_refused_as_too_large() -> None:
    owner = KeyPair.generate()
    data = pack(changed(agent="a" * MAX_STATUS_BYTES))
    with pytest.raises(RecordError) as e:
        validate(record(owner, data), NOW)
    assert e.value.reason is RecordErrorReason.TOO_LARGE


def test_a_status_record_must_sit_under_its_owner() -> None:
    owner = KeyPair.generate()
    unowned = Record(STATUS_KEY, b"anyone", pack(good_value()), NOW + 60)
    with pytest.raises(RecordError) as e:
        validate(unowned, NOW)
    assert e.value.reason is RecordErrorReason.MALFORMED
    plain = Record(STATUS_KEY, None, pack(good_value()), NOW + 60)
    with pytest.raises(RecordError):
        validate(plain, NOW)
    forged = Record(STATUS_KEY, owner_marker(owner.peer_id), pack(good_value()), NOW + 60)
    with pytest.raises(RecordError) as e:
        validate(forged.sign(KeyPair.generate()), NOW)
    assert e.value.reason is RecordErrorReason.BAD_SIGNATURE


def test_a_record_from_the_future_is_refused() -> None:
    owner = KeyPair.generate()
    ahead = status(time=NOW + MAX_CLOCK_SKEW_SECONDS + 1).to_value()
    with pytest.raises(RecordError) as e:
        validate(record(owner, ahead), NOW)
    assert e.value.reason is RecordErrorReason.TOO_FAR_IN_FUTURE


def test_replicas_refuse_updates_sooner_than_the_minimum_interval() -> None:
    owner = KeyPair.generate()
    store = RecordStore()
    first = record(owner, status(time=NOW).to_value(), NOW + 60)
    assert store.store(first, source="owner", now=NOW) is StoreResult.ACCEPTED
    assert store.store(first, source="owner", now=NOW + 1) is StoreResult.ACCEPTED  # a resend
    soon = record(owner, status(time=NOW + 0.5).to_value(), NOW + 61)
    assert store.store(soon, source="owner", now=NOW + 1) is StoreResult.REJECTED_TOO_SOON
    assert store.statistics().num_rejected_too_soon == 1
    later_time = NOW + MIN_STATUS_INTERVAL_SECONDS
    later = record(owner, status(time=later_time).to_value(), NOW + 62)
    assert store.store(later, source="owner", now=later_time) is StoreResult.ACCEPTED
    held = store.get_record(STATUS_KEY, owner_marker(owner.peer_id), later_time)
    assert held is not None and parse_status(held.value).time == later_time


def test_a_publisher_finds_a_broken_record_before_sending_it() -> None:
    with pytest.raises(StatusError):
        status(agent="line\nbreak").to_value()
