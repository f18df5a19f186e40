"""Writing to a connection's socket without holding the GIL in the system call.

uvloop's ``transport.write`` tries the socket at once, from C code that keeps the GIL
through the ``send``. On loopback or a LAN that call wakes the receiving process, which
the kernel may run at once on the sender's CPU: the sender then sits descheduled inside
the call with the GIL, and every other thread of the process waits too. An expert
server steps its optimizer in a thread while its loop sends the gradients; at batch 1
the step started 0.3-0.7 ms late that way, on every backward.

:class:`SocketWriter` makes the same first attempt with ``os.writev``, which releases
the GIL, and hands what the socket did not take to the transport, which buffers it and
waits for the socket as before. It writes directly only while the transport has nothing
buffered, so bytes never overtake bytes queued before them, and only while the
transport is open (a closed transport's descriptor may already name another file).
Elsewhere (no ``os.writev``, no socket under the transport) it is the transport's
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


#: Most buffers one ``writev`` takes (1024 on Linux); a longer list goes to the transport.
IOV_MAX = _iov_max()


def unsent(buffers: Sequence[Buffer], sent: int) -> list[Buffer]:
    """What is left of ``buffers`` after the first ``sent`` bytes went out."""
    left: list[Buffer] = []
    for i, buffer in enumerate(buffers):
        size = len(buffer)
        if sent < size:
            left.append(memoryview(buffer)[sent:] if sent else buffer)
            left.extend(buffers[i + 1 :])
            break
        sent -= size
    return left


class SocketWriter:
    """``writelines`` for ``writer``'s connection, trying the socket first (see above)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        sock = writer.get_extra_info("socket")
        fileno = getattr(sock, "fileno", None)
        self._fd = fileno() if callable(fileno) and hasattr(os, "writev") else -1
        self.num_direct_bytes = 0
        """Bytes the socket took directly (the rest went through the transport)."""

    @property
    def direct(self) -> bool:
        """Whether this writer tries the socket itself."""
        return self._fd >= 0

    def writelines(self, buffers: Sequence[Buffer]) -> None:
        """Send ``buffers`` in order, after what was written before. Errors of the socket
        (reset, broken pipe) are left to the transport, which meets them on its own
        write and closes the connection as it always did."""
        transport = self.writer.transport
        if (
            self._fd >= 0
            and 0 < len(buffers) <= IOV_MAX
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0
        ):
            try:
                sent = os.writev(self._fd, buffers)
            except OSError:  # EAGAIN and EINTR: nothing went; others: the transport's to find
                sent = 0
            self.num_direct_bytes += sent
            buffers = unsent(buffers, sent)
            if not buffers:
                return
        self.writer.writelines(buffers)
