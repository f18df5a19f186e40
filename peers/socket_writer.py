"""Writing to a connection's socket without holding the GIL in the system call.

uvloop's ``transport.write`` tries the socket at once, from C code that keeps the GIL
through the ``send``. On loopback or a LAN that call wakes the receiving process, which
the kernel may run at once on the sender's CPU: the sender then sits descheduled inside
the call with the GIL, and every other thread of the process waits too. An expert server
steps its optimizer in a thread while its loop sends the gradients; at batch 1 the step
started late that way on every call (docs/benchmarks.md, "Figures behind constants").

:class:`SocketWriter` makes the same first attempt with ``os.writev``, which releases
the GIL, and hands what the socket did not take to the transport, which buffers it and
waits for the socket as before. It writes directly only while the transport has nothing
buffered, so bytes never overtake bytes queued before them, and only while the
transport is open (a closed transport's descriptor may already name another file).
Elsewhere (no ``os.writev``, no descriptor under the transport) it is the transport's
``writelines``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview


def _iov_max() -> int:
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 16  # POSIX's floor
    return limit if limit > 0 else 16


#: Most buffers one ``writev`` takes (1024 on Linux); the rest of a longer list goes to
#: the transport.
IOV_MAX = _iov_max()


def _as_bytes(buffer: Buffer) -> bytes | bytearray | memoryview:
    """``buffer`` counted in bytes (a memoryview of wider items, cast to bytes)."""
    if isinstance(buffer, memoryview) and buffer.format != "B":
        return buffer.cast("B")
    return buffer


def unsent(buffers: Sequence[Buffer], sent: int) -> list[Buffer]:
    """What is left of ``buffers`` (contiguous) after their first ``sent`` bytes."""
    left: list[Buffer] = []
    for i, buffer in enumerate(buffers):
        size = buffer.nbytes if isinstance(buffer, memoryview) else len(buffer)
        if sent < size:  # no view is made on the way: this runs on every flush
            left.append(_as_bytes(memoryview(buffer))[sent:] if sent else buffer)
            left.extend(buffers[i + 1 :])
            break
        sent -= size
    return left


class SocketWriter:
    """``writelines`` for ``writer``'s connection, trying the socket first (see above).
    Not for a writer that has called ``write_eof``: the transport refuses writes after
    it, and the socket might still take them."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        sock = writer.get_extra_info("socket")
        fileno = getattr(sock, "fileno", None)
        self._fileno = fileno if callable(fileno) and hasattr(os, "writev") else None
        self.num_direct_bytes = 0
        """Bytes the socket took directly (the rest went through the transport)."""

    @property
    def direct(self) -> bool:
        """Whether this writer tries the socket itself."""
        return self._fileno is not None

    def writelines(self, buffers: Sequence[Buffer]) -> None:
        """Send ``buffers`` (contiguous) in order, after what was written before.
        Errors of the socket are left to the transport, which meets them on its own
        write and closes the connection; it may name them differently (a reset that
        ``writev`` took first then shows as a broken pipe)."""
        transport = self.writer.transport
        if (
            self._fileno is not None
            and buffers
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0
        ):
            fd = self._fileno()  # asked each time: -1 once the socket is closed
            if fd >= 0:
                head = [_as_bytes(b) for b in buffers[:IOV_MAX]]
                try:
                    sent = os.writev(fd, head)
                except OSError:  # EAGAIN and EINTR: nothing went; others: the transport's
                    sent = 0
                self.num_direct_bytes += sent
                buffers = [*unsent(head, sent), *buffers[IOV_MAX:]]
                if not buffers:
                    return
        self.writer.writelines(buffers)
