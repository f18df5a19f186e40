"""Errors of remote experts, split by whose fault it is
(CONTRIBUTING.md, "Errors say whose fault it is").

On a server, :class:`BadExpertRequest`, :class:`ServerBusy` and
:class:`TrainingNotAllowed` are raised by handlers and reach the caller as
:class:`peers.RemoteError` with that type name and message. A caller sees
:class:`ExpertInputError` for its own inputs (checked before anything is sent),
:class:`ExpertProtocolError` for a reply that breaks the protocol, and
:class:`NotEnoughExperts` when a mixture could not reach its quorum.
"""

from __future__ import annotations

from peers.errors import RemoteProtocolError
from swarm.errors import SwarmError


class ExpertError(SwarmError):
    """Base class of the errors raised by ``swarm.experts``."""


class ModuleFactoryError(ExpertError, ValueError):
    """A module factory (``ServeConfig.module``) returned something other than
    ``(torch.nn.Module, [TensorSpec, ...])``; the message says what it returned."""


class BadExpertRequest(ExpertError, ValueError):
    """A request does not fit the hosted module (unknown uid, wrong number of tensors,
    shape, dtype, batch size, codec, non-finite values): the caller's fault. Raised on
    the server, before any compute; the server goes on serving others."""


class ServerBusy(ExpertError):
    """The module's queue, or the caller's share of it, is full; the caller may retry
    elsewhere or later."""


class TrainingNotAllowed(ExpertError, PermissionError):
    """A backward (training) call from a peer the server does not let train
    (``ServerConfig.allowed_trainers``): refused before any compute. The caller may
    still call forward."""


class ExpertInputError(ExpertError, ValueError):
    """Our own inputs do not match the expert's declared schema (checked before sending)."""


class ExpertProtocolError(ExpertError, RemoteProtocolError):
    """A server's reply breaks the protocol (wrong count, shape or dtype of tensors)."""


class NotEnoughExperts(ExpertError):
    """A mixture-of-experts call got fewer answers than its quorum needs.

    ``failed`` holds the uids of the experts that failed or did not answer in time, so
    the caller can avoid them on a retry.
    """

    def __init__(self, message: str, failed: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.failed = failed
