"""Errors of the ``peers`` package.

One base class, and a split by whose fault it is
(CONTRIBUTING.md, "Errors say whose fault it is"): ``LocalProtocolError`` when we
misuse a protocol, ``RemoteProtocolError`` when the remote peer breaks it,
``LimitExceeded`` when the remote breaks one of our bounds, ``RemoteError`` when a
remote handler raised.
"""

from __future__ import annotations

import copy

from peers.printable import printable


class PeersError(Exception):
    """Base class of every error raised by ``peers``."""


class IdentityError(PeersError):
    """A key or key file is malformed, of an unsupported type, or unreadable."""


class AddressError(PeersError):
    """A multiaddr is malformed or cannot be used for what was asked."""


class LocalProtocolError(PeersError):
    """We tried to do something the protocol does not allow (our bug or misuse)."""


class RemoteProtocolError(PeersError):
    """The remote peer sent something the protocol does not allow."""


class HandshakeError(RemoteProtocolError):
    """The connection upgrade (multistream-select, Noise) failed."""


class PeerIDMismatch(HandshakeError):
    """The remote authenticated as a different PeerID than the one we dialed."""


class PeerNotAllowed(HandshakeError):
    """The remote authenticated as a PeerID outside our allow-list
    (``PeerConfig.allowed_peers``), or we were asked to dial one."""


class ProtocolNotSupported(PeersError):
    """The remote peer does not serve the protocol id we asked for."""


class LimitExceeded(RemoteProtocolError):
    """The remote broke one of our bounds (frame size, streams, connections, buffered bytes)."""


class ConnectionClosed(PeersError):
    """The connection or stream is closed; ``by_us`` says which side closed it."""

    def __init__(self, message: str, *, by_us: bool = False) -> None:
        super().__init__(message)
        self.by_us = by_us

    def fresh(self) -> ConnectionClosed:
        """A copy to raise. A stream or connection keeps its closing error and raises it
        on every later call; raising the kept instance would attach each raiser's frames
        to it, a reference cycle (error -> traceback -> frame -> stream -> error) that
        keeps whatever those frames hold (an all-reduce round's tensors) alive until the
        cyclic garbage collector runs."""
        return type(self)(str(self), by_us=self.by_us)


class StreamReset(ConnectionClosed):
    """The remote reset the stream (or the connection under it went away)."""


class DialError(PeersError):
    """We could not connect to any address of the peer."""


class RemoteError(PeersError):
    """A remote handler raised; carries the remote exception's type name and message."""

    def __init__(self, remote_type: str, message: str) -> None:
        # The remote chose both: escaped, so printing or logging the error is safe.
        super().__init__(f"{printable(remote_type, 80)}: {printable(message)}")
        self.remote_type = remote_type
        self.remote_message = message


def raisable_copy(error: BaseException) -> BaseException:
    """A copy of ``error`` (same type, arguments and attributes, no traceback) to raise
    where ``error`` itself is kept by something else (a future, a task): raising the kept
    instance attaches the raiser's frames to it, a reference cycle that keeps whatever
    those frames hold alive until the cyclic garbage collector runs."""
    try:
        return copy.copy(error)
    except Exception:  # an exception type that cannot be rebuilt from its arguments
        return PeersError(f"{type(error).__name__}: {error}")
