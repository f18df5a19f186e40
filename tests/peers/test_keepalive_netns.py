"""A connection whose path dies without a word (a cut in the namespace lab: every packet
dropped, no reset) is found dead by its keepalive ping and closed, so the next call
dials afresh; without the ping, TCP keeps retransmitting into the cut for many minutes
and every call on the connection times out."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from typing import Any

import pytest

from peers.netlab import Lab, lab_available

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(120)]

#: Seconds a program may take to start a peer and report (a loaded 2-core machine).
REPORT_TIMEOUT = 30.0
#: The client's keepalive: ping after 1 s of silence, give up 1 s later.
KEEPALIVE = (1.0, 1.0)
#: Longest the test waits for the cut connection to be closed (a bound, not a timing:
#: without keepalive it stays open for as long as TCP retransmits, many minutes).
CLOSE_WAIT_SECONDS = 20.0

SERVER = """
import asyncio, json, sys
from peers import Peer, PeerConfig

async def main():
    config = PeerConfig(listen_addrs=("/ip4/0.0.0.0/tcp/7100",), reachability="public")
    async with Peer(config) as peer:
        addrs = [str(a) for a in peer.listen_addrs if "/198.18." in str(a)]
        print(json.dumps({"event": "ready", "addrs": addrs}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

asyncio.run(main())
"""

CLIENT = """
import asyncio, json, sys, time
from peers import Peer, PeerConfig

def say(**event):
    print(json.dumps(event), flush=True)

async def main(addr, interval, timeout, close_wait):
    config = PeerConfig(keepalive_interval=interval, keepalive_timeout=timeout)
    loop = asyncio.get_running_loop()
    async with Peer(config) as peer:
        remote = await peer.connect(addr)
        await peer.ping(remote)
        say(event="connected")
        await loop.run_in_executor(None, sys.stdin.readline)  # the path is cut now
        cut_at = time.monotonic()
        for _ in range(int(close_wait * 10)):  # bounded
            conn = peer.connection_to(remote)
            if conn is None or conn.is_closed:
                say(event="closed", seconds=round(time.monotonic() - cut_at, 2))
                break
            await asyncio.sleep(0.1)
        else:
            say(event="still open", seconds=close_wait)
        await loop.run_in_executor(None, sys.stdin.readline)  # the path is back
        try:
            await asyncio.wait_for(peer.ping(addr), 20)
            say(event="pinged")
        except Exception as e:
            say(event="ping failed", error=repr(e))

asyncio.run(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])))
"""


class _Program:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def report(self, timeout: float = REPORT_TIMEOUT) -> dict[str, Any]:
        try:
            return dict(json.loads(self.lines.get(timeout=timeout)))
        except queue.Empty:
            raise AssertionError(f"no report in {timeout} s") from None

    def tell(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


def _start(host: Any, script: str, *args: str) -> _Program:
    proc = host.popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return _Program(proc)


def test_a_connection_whose_path_died_silently_is_closed_and_the_next_call_redials() -> None:
    with Lab() as lab:
        server_host, client_host = lab.add_public_host("server"), lab.add_public_host("client")
        server = _start(server_host, SERVER)
        ready = server.report()
        assert ready["event"] == "ready", ready
        (addr,) = ready["addrs"]
        client = _start(client_host, CLIENT, addr, *map(str, KEEPALIVE), str(CLOSE_WAIT_SECONDS))
        assert client.report()["event"] == "connected"
        lab.cut(server_host)
        client.tell()
        closed = client.report(CLOSE_WAIT_SECONDS + REPORT_TIMEOUT)
        assert closed["event"] == "closed", closed
        lab.restore(server_host)
        client.tell()
        assert client.report(30.0)["event"] == "pinged"
        for program in (client, server):
            program.tell()
            program.proc.wait(10)
