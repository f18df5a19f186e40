"""Strings from strangers, made safe to print (peers.printable), and where it is used."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from peers.errors import RemoteError
from peers.printable import MAX_PRINTABLE_CHARS, printable


def test_terminal_escapes_newlines_and_bidi_overrides_are_escaped() -> None:
    assert printable("evil\x1b[2J\x07") == "evil\\x1b[2J\\x07"
    assert printable("line\nforged: ok\r") == "line\\x0aforged: ok\\x0d"
    assert printable("abc\u202edef") == "abc\\u202edef"  # right-to-left override
    assert printable("swarmtrain/0.1.0 (ünïcode ok)") == "swarmtrain/0.1.0 (ünïcode ok)"
    assert printable("x" * 1000) == "x" * MAX_PRINTABLE_CHARS + "..."


@given(st.text())
def test_nothing_unprintable_is_left(text: str) -> None:
    out = printable(text, limit=10_000)
    assert out.isprintable()


def test_a_remote_error_escapes_what_the_remote_wrote() -> None:
    error = RemoteError("Boom\x1b]0;pwned\x07", "bad\n\x1b[31mthing")
    assert "\x1b" not in str(error) and "\n" not in str(error)
    assert error.remote_message == "bad\n\x1b[31mthing"  # the raw text stays available


HOSTILE = r"""
import asyncio
from peers import Peer, PeerConfig

async def main():
    agent = "evil\x1b[2J\x1b]0;owned\x07\nforged line"
    async with Peer(PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), agent_version=agent)) as p:
        print(p.listen_addrs[0], flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


def test_swarm_ping_prints_a_hostile_agent_string_escaped() -> None:
    peer = subprocess.Popen(
        [sys.executable, "-c", HOSTILE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert peer.stdout is not None
        addr = peer.stdout.readline().strip()  # bounded by the pytest timeout
        out = subprocess.run(
            [sys.executable, "-m", "swarm.cli", "ping", addr, "--count", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        peer.kill()
        peer.communicate(timeout=10)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    assert "agent:     evil\\x1b[2J\\x1b]0;owned\\x07\\x0aforged line" in out.stdout
    assert "forged line" not in out.stdout.replace("\\x0aforged line", "")
