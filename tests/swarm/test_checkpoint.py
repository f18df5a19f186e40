"""Checkpoints: exact round trips, clear errors for bad files, atomic writes."""

from __future__ import annotations

import errno
import hashlib
import math
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from torch import nn

from swarm import checkpoint
from swarm.checkpoint import (
    FORMAT_VERSION,
    MAGIC,
    CheckpointError,
    load_checkpoint,
    read_state,
    save_checkpoint,
    write_state,
)
from swarm.optim_spec import OptimizerSpec

PREFIX = struct.Struct("<8sIQ32s")


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal values of equal types, tensors bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        bits_a = a.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, b.contiguous().reshape(-1).view(torch.uint8)), path
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}/{key}")
        return
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def _trained(spec: OptimizerSpec, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = spec.build(model.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
    return model, optimizer


SPECS = [
    OptimizerSpec(kind="sgd", lr=0.1, momentum=0.9),
    OptimizerSpec(kind="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    OptimizerSpec(kind="adam", lr=1e-3),
    OptimizerSpec(kind="adamw", lr=1e-3, weight_decay=0.01),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.nesterov}")
def test_round_trip_is_exact_and_training_continues_identically(
    spec: OptimizerSpec, tmp_path: Path
) -> None:
    model, optimizer = _trained(spec)
    path = tmp_path / "run.ckpt"
    metadata = {"step": 3, "task": "digits", "optimizer": spec.to_dict(), "loss": 0.25}
    save_checkpoint(path, model, optimizer, metadata=metadata)

    loaded = load_checkpoint(path)
    _assert_same(dict(model.state_dict()), loaded.model)
    _assert_same(optimizer.state_dict(), loaded.optimizer)
    _assert_same(metadata, loaded.metadata)

    fresh, fresh_optimizer = _trained(spec, seed=1)  # different weights and state
    loaded.restore(fresh, fresh_optimizer)
    batch = torch.randn(4, 6)
    for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
        o.zero_grad()
        m(batch).square().mean().backward()
        o.step()
    _assert_same(dict(model.state_dict()), dict(fresh.state_dict()))
    _assert_same(optimizer.state_dict(), fresh_optimizer.state_dict())


@pytest.mark.parametrize("saved_fused", [False, True])
def test_a_restored_optimizer_keeps_its_own_implementation(
    saved_fused: bool, tmp_path: Path
) -> None:
    """Adam state saved by the plain implementation restores into a fused Adam that
    stays fused, and the other way round; both then take the same step."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=saved_fused)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
    save_checkpoint(tmp_path / "run.ckpt", model, optimizer)
    loaded = load_checkpoint(tmp_path / "run.ckpt")
    fresh = nn.Linear(6, 3)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2, fused=not saved_fused)
    loaded.restore(fresh, fresh_optimizer)
    assert bool(fresh_optimizer.param_groups[0]["fused"]) is not saved_fused
    batch = torch.randn(4, 6)
    for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
        o.zero_grad()
        m(batch).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_supported_value_round_trips(tmp_path: Path) -> None:
    state = {
        "tensors": [
            torch.randn(3, 4).t(),  # not contiguous
            torch.tensor(7.5),  # 0-dim
            torch.empty(0, 5),
            torch.randn(2, 3).to(torch.bfloat16),
            torch.randn(5).half(),
            torch.randn(2, dtype=torch.float64),
            torch.randn(2, dtype=torch.complex64),
            torch.tensor([True, False, True]),
            torch.arange(6, dtype=torch.int64).reshape(2, 3),
            torch.tensor([-3, 4], dtype=torch.int8),
            torch.tensor([255, 0], dtype=torch.uint8),
        ],
        "numbers": {
            0: 1,
            -1: 2**64 - 1,
            7: -(2**63),
            "f": 1e-300,
            "nan": math.nan,
            "-inf": -math.inf,
        },
        "tuple": (1, (2.0, "three"), [None, True, b"\x00bytes"]),
        "empty": {"list": [], "tuple": (), "dict": {}},
    }
    path = tmp_path / "state.bin"
    write_state(path, state)
    expected = dict(state)
    expected["tensors"] = [t.contiguous() for t in state["tensors"]]
    _assert_same(expected, read_state(path))


@pytest.mark.parametrize(
    "bad",
    [object(), {1, 2}, 2**64, {(1, 2): 3}, {True: 1}, torch.zeros(3).to_sparse(), "\ud800"],
    ids=["object", "set", "bigint", "tuple-key", "bool-key", "sparse", "surrogate"],
)
def test_values_that_cannot_be_stored_are_refused_and_nothing_is_written(
    bad: Any, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError):
        write_state(tmp_path / "x.ckpt", {"value": bad})
    assert os.listdir(tmp_path) == []


# -- files that are not good checkpoints ------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, optimizer = _trained(SPECS[2])
    path = tmp_path / "good.ckpt"
    save_checkpoint(path, model, optimizer, metadata={"step": 3})
    return path


def _header_bounds(data: bytes) -> tuple[int, int]:
    _, _, header_len, _ = PREFIX.unpack_from(data)
    return PREFIX.size, PREFIX.size + header_len


@pytest.mark.parametrize("where", ["prefix-version", "header", "payload-start", "payload-end"])
def test_a_flipped_byte_anywhere_is_caught(saved: Path, where: str) -> None:
    data = bytearray(saved.read_bytes())
    header_start, payload_start = _header_bounds(data)
    index = {
        "prefix-version": 8,
        "header": (header_start + payload_start) // 2,
        "payload-start": payload_start,
        "payload-end": len(data) - 1,
    }[where]
    data[index] ^= 0x40
    saved.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum|version"):
        load_checkpoint(saved)


def test_every_truncation_is_caught(saved: Path) -> None:
    data = saved.read_bytes()
    header_start, payload_start = _header_bounds(data)
    cuts = {0, 3, 8, 20, header_start, payload_start - 1, payload_start, len(data) - 1}
    cuts |= set(range(payload_start, len(data), max(1, (len(data) - payload_start) // 17)))
    for cut in sorted(cuts):
        saved.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            load_checkpoint(saved)


def test_trailing_bytes_are_caught(saved: Path) -> None:
    saved.write_bytes(saved.read_bytes() + b"\x00")
    with pytest.raises(CheckpointError, match="unexpected bytes"):
        load_checkpoint(saved)


def test_a_torch_save_file_is_refused_without_being_unpickled(tmp_path: Path) -> None:
    model, _ = _trained(SPECS[0])
    path = tmp_path / "torch.pt"
    torch.save(model.state_dict(), path)
    with pytest.raises(CheckpointError, match=r"not a swarmtrain checkpoint.*zip"):
        load_checkpoint(path)


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo should never run",))


@pytest.mark.parametrize(
    "content",
    [b"hello, world\n" * 10, pickle.dumps(_Boom()), bytes(range(256)), MAGIC[:5]],
    ids=["text", "pickle", "binary", "magic-prefix"],
)
def test_foreign_files_are_refused(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "foreign"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"not a swarmtrain checkpoint|truncated"):
        load_checkpoint(path)


def test_missing_file_and_directory_give_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "absent.ckpt")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path)


def _rewrite(path: Path, version: int = FORMAT_VERSION, edit: Any = None) -> None:
    """Re-save ``path`` with another version or an edited header, hashes made consistent."""
    data = path.read_bytes()
    header_start, payload_start = _header_bounds(data)
    header = msgpack.unpackb(data[header_start:payload_start], strict_map_key=False)
    if edit is not None:
        edit(header)
    raw = msgpack.packb(header)
    prefix = PREFIX.pack(MAGIC, version, len(raw), hashlib.sha256(raw).digest())
    path.write_bytes(prefix + raw + data[payload_start:])


def test_a_newer_format_version_is_refused(saved: Path) -> None:
    _rewrite(saved, version=FORMAT_VERSION + 1)
    with pytest.raises(CheckpointError, match=r"unsupported .* version .*newer"):
        load_checkpoint(saved)


def _set(*keys: Any, value: Any) -> Any:
    def edit(header: Any) -> None:
        target = header
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


@pytest.mark.parametrize(
    "edit",
    [
        _set("tensors", 0, "dtype", value="float128"),
        _set("tensors", 0, "shape", value=[-1, 2]),
        _set("tensors", 0, "shape", value=[99, 99]),
        _set("tensors", 0, "nbytes", value=4.0),
        _set("tensors", 1, "offset", value=0),
        _set("tensors", 0, value="not a descriptor"),
        _set("payload_bytes", value=10**12),
        _set("payload_sha256", value=None),
        _set("extra", value=1),
        _set("tree", "model", "0.weight", value=msgpack.ExtType(1, struct.pack("<Q", 10**6))),
        _set("tree", "model", "0.weight", value=msgpack.ExtType(9, b"")),
        _set("tree", "metadata", value=msgpack.ExtType(2, b"\xc1")),
        _set("tree", "metadata", value={None: 1}),
        _set("tree", "metadata", value=msgpack.Timestamp(0)),
    ],
)
def test_malformed_headers_with_valid_checksums_are_refused(saved: Path, edit: Any) -> None:
    _rewrite(saved, edit=edit)
    with pytest.raises(CheckpointError, match=r"malformed|truncated|not a model checkpoint"):
        load_checkpoint(saved)


def test_a_state_file_that_is_not_a_checkpoint_and_a_misfit_are_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.bin"
    write_state(path, {"something": "else"})
    with pytest.raises(CheckpointError, match="not a model checkpoint"):
        load_checkpoint(path)

    model, optimizer = _trained(SPECS[0])
    save_checkpoint(path, model)  # no optimizer
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(path).restore(model, optimizer)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_checkpoint(path).restore(nn.Linear(6, 3))
    # Optimizer state for other parameter groups: refused, the optimizer left as it was.
    save_checkpoint(path, model, optimizer)
    layers = list(model.children())
    split = torch.optim.SGD(
        [{"params": layers[0].parameters()}, {"params": layers[2].parameters()}], lr=0.1
    )
    with pytest.raises(CheckpointError, match="does not fit"):
        load_checkpoint(path).restore(model, split)
    assert len(split.param_groups) == 2 and not split.state


# -- atomicity ----------------------------------------------------------------------------


def _failing_after(calls: int, error: BaseException) -> Any:
    count = 0
    original = checkpoint._write_chunk

    def write_chunk(file: Any, data: Any) -> None:
        nonlocal count
        count += 1
        if count > calls:
            raise error
        original(file, data)

    return write_chunk


@pytest.mark.parametrize("failing", ["mid-payload", "fsync"])
def test_a_full_disk_leaves_the_previous_checkpoint_intact_and_no_temp_file(
    saved: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    before = saved.read_bytes()
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if failing == "fsync":

        def fsync(fd: int) -> None:
            raise full

        monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    else:
        monkeypatch.setattr(checkpoint, "_write_chunk", _failing_after(3, full))
    model, optimizer = _trained(SPECS[2], seed=5)
    with pytest.raises(CheckpointError, match=r"disk is full.*previous checkpoint.*intact"):
        save_checkpoint(saved, model, optimizer, metadata={"step": 6})
    monkeypatch.undo()
    assert os.listdir(saved.parent) == [saved.name]
    assert saved.read_bytes() == before
    assert load_checkpoint(saved).metadata == {"step": 3}


def test_an_interrupt_mid_write_leaves_no_temp_file(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = saved.read_bytes()
    monkeypatch.setattr(checkpoint, "_write_chunk", _failing_after(2, KeyboardInterrupt()))
    model, optimizer = _trained(SPECS[2], seed=5)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(saved, model, optimizer)
    assert os.listdir(saved.parent) == [saved.name]
    assert saved.read_bytes() == before


def test_writing_into_a_missing_directory_is_a_checkpoint_error(tmp_path: Path) -> None:
    model, _ = _trained(SPECS[0])
    with pytest.raises(CheckpointError, match="cannot write"):
        save_checkpoint(tmp_path / "no" / "such" / "dir.ckpt", model)


def test_overwriting_replaces_the_checkpoint(saved: Path) -> None:
    model, optimizer = _trained(SPECS[2], seed=9)
    save_checkpoint(saved, model, optimizer, metadata={"step": 9})
    assert load_checkpoint(saved).metadata == {"step": 9}
    assert os.listdir(saved.parent) == [saved.name]
