"""The nodes of a lab: public hosts, home routers and the LAN hosts behind them. Each is
a network namespace with a name, an address, and a way to run programs inside it."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from peers.netlab.commands import run_checked
from peers.netlab.nat import NatType
from peers.netlab.processes import OwnedProcesses, netns_exec_argv

#: Seconds ``Node.run`` lets a command run unless told otherwise.
DEFAULT_RUN_TIMEOUT = 30.0


@dataclass(eq=False, kw_only=True)
class Node:
    """One namespace of the lab. Made by :class:`~peers.netlab.Lab`, not by hand."""

    name: str
    """The label the test gave it (``"alice"``)."""
    namespace: str
    """Its network namespace (``stl<pid>-<n>``), for ``ip netns exec``."""
    address: str
    """Its own IPv4 address (a router's is its WAN address)."""
    uplink: str = field(repr=False)
    """Its interface towards the upstream namespace."""
    upstream_namespace: str = field(repr=False)
    """The namespace holding the bridge its uplink plugs into."""
    upstream_port: str = field(repr=False)
    """The bridge port, in ``upstream_namespace``, facing its uplink."""
    _processes: OwnedProcesses = field(repr=False)

    def popen(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this node (``popen_kwargs`` go to ``subprocess.Popen``).

        The lab records the process and, at teardown, SIGTERMs it, then SIGKILLs it if
        it has not exited within a grace period. Raises ``OSError`` if it cannot start.
        """
        return self._processes.start(self.namespace, argv, **popen_kwargs)

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_RUN_TIMEOUT,
        input: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this node to completion; its output is captured as text.

        Raises :class:`~peers.netlab.CommandError` if it exits non-zero (unless
        ``check`` is false), and :class:`~peers.netlab.CommandTimeout` (after killing
        it) past ``timeout`` seconds.
        """
        argv = netns_exec_argv(self.namespace, argv)
        return run_checked(argv, timeout=timeout, input=input, check=check)


@dataclass(eq=False, kw_only=True)
class PublicHost(Node):
    """A host with a public address on the lab's internet (198.18.0.0/24)."""


@dataclass(eq=False, kw_only=True)
class Router(Node):
    """A home router: a WAN address on the internet, NAT, and a LAN behind it."""

    nat: NatType
    """How it maps LAN connections to its WAN address (see :mod:`peers.netlab.nat`)."""
    lan_address: str
    """Its address on its LAN, the LAN hosts' default gateway."""
    lan_bridge: str = field(repr=False)
    """The bridge its LAN hosts plug into."""

    @property
    def wan_address(self) -> str:
        """Its public address: what every peer on the internet sees LAN hosts as."""
        return self.address


@dataclass(eq=False, kw_only=True)
class LanHost(Node):
    """A host on a home router's LAN, with a private address shared with the first host
    of every other LAN, as two laptops at two homes both have 192.168.1.2."""

    router: Router
    """The router it sits behind."""
