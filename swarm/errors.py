"""Errors of the ``swarm`` package.

One base class (CONTRIBUTING.md, "Errors say whose fault it is"); each subsystem adds
its own subclass next to its code's callers: :class:`TaskError` for a task that cannot
be built or used as asked, :class:`CheckpointError` for a checkpoint that cannot be
written or read.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class of every error raised by ``swarm``."""


class TaskError(SwarmError, ValueError):
    """A training task was misused (unknown name, bad argument) or its data is unusable."""


class CheckpointError(SwarmError):
    """A checkpoint cannot be written, or a file is not a valid checkpoint.

    On write, the previous checkpoint at the same path is left intact. On read, the
    message says what is wrong: not a checkpoint at all (foreign file), an unsupported
    format version, truncated, corrupt (checksum mismatch), or malformed.
    """
