"""Checkpoints: model and optimizer state plus metadata, written atomically, read safely.

Why not ``torch.save``/``torch.load``: a torch checkpoint is a pickle, and unpickling
runs whatever code the file names. A swarm's checkpoints move between machines and
people, so reading one must never execute anything
(CONTRIBUTING.md, "Wire messages are typed and decoded at the edge"). Our format has a
msgpack header that describes the state, and the tensors' raw bytes after it:

====================  ========================================================
bytes                 content
====================  ========================================================
0..8                  magic ``b"SWARMCKP"``
8..12                 format version, uint32 little-endian (:data:`FORMAT_VERSION`)
12..20                header length ``H``, uint64 little-endian
20..52                SHA-256 of the header
52..52+H              header (msgpack map, below)
52+H..end             payload: every tensor's bytes (little-endian), back to back
====================  ========================================================

The header holds ``tensors`` (one descriptor per tensor: ``name`` (its path in the
state, for messages), ``dtype``, ``shape``, ``offset`` and ``nbytes`` within the
payload), ``payload_bytes``, ``payload_sha256`` and ``tree``: the state itself with
every tensor replaced by a reference to its descriptor (msgpack extension type 1) and
tuples kept as tuples (extension type 2), so an optimizer's ``state_dict`` (nested
dicts with int keys, lists, tuples, numbers, strings, ``None`` and tensors) comes back
equal, types included. Anything else in a state is refused on save.

Reading checks the magic, the version, the header's hash, every descriptor, the file's
exact size and the payload's hash, and raises :class:`CheckpointError` saying which
failed. Writing goes to a temporary file in the same directory, is flushed and
fsynced, then renamed over the target (``os.replace``, atomic on POSIX and Windows),
and the directory is fsynced: a crash or a full disk leaves the previous checkpoint
as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from swarm.checkpoint_format import (
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    decode_state,
    encode_state,
)
from swarm.errors import CheckpointError
from swarm.optim_spec import load_optimizer_state

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "Checkpoint",
    "CheckpointError",
    "load_checkpoint",
    "read_state",
    "save_checkpoint",
    "write_state",
]


def _write_chunk(file: BinaryIO, data: bytes | memoryview) -> None:
    file.write(data)


def _fsync_directory(directory: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # Windows: directories cannot be opened to fsync
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A temporary file next to ``path`` that replaces it on success, vanishes on failure."""
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    replaced = False
    try:
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
        replaced = True
        # Makes the rename durable. Some file systems refuse to fsync a directory; the
        # new checkpoint is in place all the same, so that is no reason to fail.
        with contextlib.suppress(OSError):
            _fsync_directory(path.parent)
    finally:
        if not replaced:
            with contextlib.suppress(OSError):
                os.unlink(temp_name)


def write_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Write ``state`` (a tree of dicts, lists, tuples, numbers, strings, tensors) to ``path``.

    Atomic: ``path`` is either its old content or the complete new one, whatever happens.
    Tensors are read while writing: do not modify them from another thread meanwhile.
    The file is created with mode 0600 (``tempfile.mkstemp``).
    Raises :class:`CheckpointError` for a value that cannot be stored, or when writing
    fails (full disk, no permission, ...; the previous file is intact and no temporary
    file is left). Cancellation (KeyboardInterrupt) also leaves no temporary file.
    """
    target = Path(path)
    head, buffers = encode_state(state)
    try:
        with _atomic_file(target) as file:
            _write_chunk(file, head)
            for buffer in buffers:
                _write_chunk(file, buffer)
    except OSError as e:
        reason = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise CheckpointError(
            f"cannot write checkpoint {target}: {reason}; any previous checkpoint there is intact"
        ) from e


def read_state(path: str | os.PathLike[str]) -> Any:
    """The state stored at ``path`` by :func:`write_state`, without unpickling anything.

    Raises :class:`CheckpointError` if the file cannot be opened or read, is not a
    checkpoint, has an unsupported version, is truncated, corrupt or malformed.
    """
    try:
        with open(path, "rb") as file:
            return decode_state(file, os.fstat(file.fileno()).st_size)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from e


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`load_checkpoint` returns."""

    model: dict[str, torch.Tensor]
    """The model's ``state_dict``."""
    optimizer: dict[str, Any] | None
    """The optimizer's ``state_dict``, if one was saved."""
    metadata: dict[str, Any]
    """Whatever the writer put there (step, samples seen, task, optimizer spec, ...)."""

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load the state into ``model`` (strictly) and ``optimizer``.

        Raises :class:`CheckpointError` if an optimizer is given and none was saved
        (nothing is loaded then), or if the state does not fit them (the model may be
        loaded already when the optimizer's state is found not to fit).
        """
        if optimizer is not None and self.optimizer is None:
            raise CheckpointError("the checkpoint has no optimizer state")
        try:
            model.load_state_dict(self.model)
            if optimizer is not None and self.optimizer is not None:
                load_optimizer_state(optimizer, self.optimizer)
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"the checkpoint does not fit: {e}") from e


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Save a model (or its ``state_dict``), optionally an optimizer, and metadata.

    Atomic, like :func:`write_state`, and raises :class:`CheckpointError` as it does.
    """
    model_state = model.state_dict() if isinstance(model, nn.Module) else model
    optimizer_state = (
        optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    )
    state = {"model": model_state, "optimizer": optimizer_state, "metadata": metadata or {}}
    write_state(path, state)


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`; :class:`CheckpointError` if
    the file is unusable (see :func:`read_state`) or holds some other state."""
    state = read_state(path)
    if (
        not isinstance(state, dict)
        or set(state) != {"model", "optimizer", "metadata"}
        or not isinstance(state["model"], dict)
        or not all(isinstance(v, torch.Tensor) for v in state["model"].values())
        or not isinstance(state["optimizer"], dict | None)
        or not isinstance(state["metadata"], dict)
    ):
        raise CheckpointError(f"{path} is a swarmtrain state file but not a model checkpoint")
    return Checkpoint(
        model=state["model"], optimizer=state["optimizer"], metadata=state["metadata"]
    )
