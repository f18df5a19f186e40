"""A delay line for one lab link: ``python -m peers.netlab.delay_line IF_A IF_B`` copies
every Ethernet frame that arrives on interface ``IF_A`` to ``IF_B`` and back, each
direction after its own one-way delay (with jitter, never reordering), dropping a
random share of them. Its settings are JSON lines on stdin (:class:`LineSettings`
fields); it prints ``ready`` once both sockets are open, ``applied`` for each settings
line it takes and ``refused: REASON`` for one it cannot (keeping its settings), and
runs until stdin closes.

Why in user space, at layer 2: this kernel has no ``netem``, and a proxy that
terminates TCP would change addresses and ports, which NAT and hole punching care about.
Frames pass untouched: each socket carries the kernel's virtio-net header
(``PACKET_VNET_HDR``), so a TCP segment the sender's stack left unsegmented (GSO, up to
64 KiB) crosses as one frame, which keeps the line's cost per byte low. Bandwidth stays
the kernel's (``tc tbf``, :mod:`peers.netlab.shaping`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import selectors
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from peers.netlab.commands import NetlabError
from peers.netlab.processes import OwnedProcesses

#: ``<linux/if_ether.h>``: every protocol.
ETH_P_ALL = 0x0003
#: ``<linux/if_packet.h>``.
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23
PACKET_VNET_HDR = 15
#: The largest frame a GSO skb makes (64 KiB of payload, headers, the 10-byte header).
MAX_FRAME_BYTES = 65_536 + 256
#: Seconds the line has to start, or to take new settings.
LINE_ANSWER_SECONDS = 10.0
#: Frames held per direction at most; past this a frame is dropped, as a router's full
#: queue would (at 1 Gbit/s and 200 ms that is 25,000 full-size frames).
MAX_HELD_FRAMES = 50_000


@dataclass(frozen=True)
class LineSettings:
    """One delay line's behaviour (every field in milliseconds or as a fraction)."""

    a_to_b_ms: float = 0.0
    """One-way delay of frames from interface A to B."""
    b_to_a_ms: float = 0.0
    """One-way delay of frames from B to A."""
    jitter_ms: float = 0.0
    """Each frame's delay gets a uniform extra of up to this, in both directions; frames
    still leave in the order they came (a later frame waits for an earlier one)."""
    loss: float = 0.0
    """Share of frames dropped in each direction, at random."""
    seed: int = 0
    """Seeds the jitter and loss draws."""

    def __post_init__(self) -> None:
        for name in ("a_to_b_ms", "b_to_a_ms", "jitter_ms"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value <= 10_000):
                raise ValueError(f"{name} must be in [0, 10000] ms, got {value!r}")
        if not (isinstance(self.loss, int | float) and 0 <= self.loss <= 1):
            raise ValueError(f"loss must be in [0, 1], got {self.loss!r}")


class Direction:
    """The frames of one direction in flight: each leaves at ``arrival + delay +
    jitter``, but never before the frame ahead of it. Pure: the caller gives the time."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._held: collections.deque[tuple[float, bytes]] = collections.deque()
        self._last_due = 0.0
        self.delay = 0.0
        self.jitter = 0.0
        self.loss = 0.0
        self.num_dropped = 0

    def arrive(self, frame: bytes, now: float) -> None:
        if self.loss and self._rng.random() < self.loss:
            self.num_dropped += 1
            return
        if len(self._held) >= MAX_HELD_FRAMES:
            self.num_dropped += 1
            return
        due = now + self.delay + (self._rng.uniform(0.0, self.jitter) if self.jitter else 0.0)
        self._last_due = max(due, self._last_due)
        self._held.append((self._last_due, frame))

    def due(self, now: float) -> list[bytes]:
        """The frames whose time has come, in order."""
        out = []
        while self._held and self._held[0][0] <= now:
            out.append(self._held.popleft()[1])
        return out

    def next_due(self) -> float | None:
        return self._held[0][0] if self._held else None


@dataclass
class DelayLine:
    """The lab's handle on one running delay line."""

    popen: subprocess.Popen[str]
    bridge_port: str
    """The bridge port the line's far side enters the bridge by."""

    @classmethod
    def start(
        cls,
        processes: OwnedProcesses,
        namespace: str,
        interface_a: str,
        interface_b: str,
        bridge_port: str,
    ) -> DelayLine:
        """Start a line between the two interfaces of ``namespace``, passing frames
        at once until :meth:`apply` says otherwise."""
        argv = [sys.executable, "-m", "peers.netlab.delay_line", interface_a, interface_b]
        popen = processes.start(
            namespace,
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = cls(popen, bridge_port)
        line._expect("ready")
        return line

    def apply(self, settings: LineSettings) -> None:
        """Change the line's settings; returns once it runs with them."""
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(json.dumps(dataclasses.asdict(settings)) + "\n")
            self.popen.stdin.flush()
        except OSError as e:
            raise NetlabError(f"the delay line has stopped: {self._stderr()}") from e
        self._expect("applied")

    def _expect(self, word: str) -> None:
        stdout = self.popen.stdout
        assert stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            ready = selector.select(LINE_ANSWER_SECONDS)
        answer = stdout.readline().strip() if ready else ""
        if answer != word:
            raise NetlabError(f"the delay line said {answer!r}, not {word!r}: {self._stderr()}")

    def _stderr(self) -> str:
        if self.popen.poll() is None or self.popen.stderr is None:
            return "(still running)"
        return self.popen.stderr.read().strip()[-2000:] or f"exit status {self.popen.returncode}"


def _open(interface: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)  # not the frames we send
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    sock.bind((interface, 0))
    sock.setblocking(False)
    return sock


def _apply(settings: LineSettings, a_to_b: Direction, b_to_a: Direction) -> None:
    a_to_b.delay, b_to_a.delay = settings.a_to_b_ms / 1000, settings.b_to_a_ms / 1000
    for direction in (a_to_b, b_to_a):
        direction.jitter = settings.jitter_ms / 1000
        direction.loss = settings.loss


def run(interface_a: str, interface_b: str) -> None:
    """Copy frames between the two interfaces until stdin closes."""
    a, b = _open(interface_a), _open(interface_b)
    rng = random.Random(0)
    a_to_b, b_to_a = Direction(rng), Direction(rng)
    arriving = {a.fileno(): a_to_b, b.fileno(): b_to_a}  # frames read on a go to b
    selector = selectors.DefaultSelector()
    selector.register(a, selectors.EVENT_READ)
    selector.register(b, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    print("ready", flush=True)
    buffer = bytearray(MAX_FRAME_BYTES)
    while True:
        now = time.monotonic()
        for direction, out in (a_to_b, b), (b_to_a, a):
            for frame in direction.due(now):
                try:
                    out.send(frame)
                except (BlockingIOError, OSError):  # a full queue or a link going down: lost
                    direction.num_dropped += 1
        dues = [d for d in (a_to_b.next_due(), b_to_a.next_due()) if d is not None]
        timeout = max(min(dues) - time.monotonic(), 0.0) if dues else None
        for key, _ in selector.select(timeout):
            if key.fd == sys.stdin.fileno():
                line = sys.stdin.readline()
                if not line:
                    return
                try:
                    settings = LineSettings(**json.loads(line))
                except (ValueError, TypeError) as e:  # the line keeps its settings
                    print(f"refused: {' '.join(str(e).split())}", flush=True)
                    continue
                rng.seed(settings.seed)
                _apply(settings, a_to_b, b_to_a)
                print("applied", flush=True)
                continue
            direction = arriving[key.fd]
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            arrived = time.monotonic()
            for _ in range(64):  # what is queued now, then the timers again
                try:
                    size = sock.recv_into(buffer)
                except BlockingIOError:
                    break
                direction.arrive(bytes(buffer[:size]), arrived)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m peers.netlab.delay_line IF_A IF_B", file=sys.stderr)
        return 2
    run(args[0], args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
