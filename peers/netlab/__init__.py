"""A namespace lab: a small emulated internet, for tests of NAT traversal and of
software on internet links.

One "internet" namespace holds a bridge; public hosts and home routers plug into it;
LAN hosts sit behind routers that do endpoint-independent or symmetric NAT with
nftables, all sharing one private address as laptops at two homes do. Each node's link
takes a bandwidth cap each way (tc tbf) and latency, jitter and loss (a delay line,
:mod:`peers.netlab.delay_line`). Needs Linux,
root, ``ip``, ``nft``, ``tc`` and ``sysctl``; :func:`lab_available` says whether a lab
can be built here. See docs/netlab.md.
"""

from peers.netlab.available import lab_available
from peers.netlab.commands import CommandError, CommandTimeout, NetlabError
from peers.netlab.hosts import LanHost, Node, PublicHost, Router
from peers.netlab.lab import Lab
from peers.netlab.namespaces import enter as enter_namespace
from peers.netlab.nat import NatType

__all__ = [
    "CommandError",
    "CommandTimeout",
    "Lab",
    "LanHost",
    "NatType",
    "NetlabError",
    "Node",
    "PublicHost",
    "Router",
    "enter_namespace",
    "lab_available",
]
