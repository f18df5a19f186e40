"""The nftables rulesets of the lab, as text: a home router's NAT and firewall, and the
drop rules that cut a link. Pure functions: building a ruleset starts no process.

A home router here is Linux NAT as most home and CGN boxes behave (RFC 4787 terms):

* ``"endpoint-independent"``: plain ``masquerade``. Linux keeps the LAN host's source
  port when it is free on the WAN address and reuses that mapping for every
  destination, so one local port maps to one external port whoever it talks to: the
  mapping a rendezvous server observes is the one a peer can punch to.
* ``"symmetric"``: ``masquerade fully-random``. Every new connection (new destination)
  gets a random external port, so the port a rendezvous server observes is useless
  to any other peer: hole punching must fail, and a relay is needed.

Both filter inbound traffic the same way: on the WAN interface only packets of
connections the LAN opened (conntrack ``established``/``related``) pass; everything
else is dropped silently, in the input hook (packets for the router itself) and the
forward hook (packets routed towards the LAN). Dropping, not rejecting, is the point:
without the input drop the router's own TCP stack answers an early hole-punching SYN
with RST, and the peer's connect fails before its own SYN opens the mapping. The drop
rules count what they drop, so ``nft list ruleset`` in a router shows, for instance,
that a punch's first SYN was dropped there.
"""

from __future__ import annotations

from typing import Literal, get_args

#: How a home router maps LAN connections to its WAN address.
NatType = Literal["endpoint-independent", "symmetric"]
NAT_TYPES: tuple[NatType, ...] = get_args(NatType)

#: The nftables table holding a router's NAT and firewall.
ROUTER_TABLE = "netlab"
#: The nftables table holding a cut link's drop rules; deleting it restores the link.
CUT_TABLE = "netlab_cut"

_MASQUERADE: dict[NatType, str] = {
    "endpoint-independent": "masquerade",
    "symmetric": "masquerade fully-random",
}


def router_ruleset(nat: NatType, *, wan_interface: str) -> str:
    """The ruleset of a home router whose WAN side is ``wan_interface``."""
    if nat not in _MASQUERADE:
        raise ValueError(f"nat must be one of {NAT_TYPES}, not {nat!r}")
    wan = f'iifname "{wan_interface}"'
    return f"""\
table ip {ROUTER_TABLE} {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{wan_interface}" {_MASQUERADE[nat]}
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        {wan} ct state established,related accept
        {wan} counter drop
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        {wan} ct state established,related accept
        {wan} counter drop
    }}
}}
"""


def cut_ruleset(port: str) -> str:
    """Rules that drop every frame but ARP to or from bridge port ``port``, in the
    namespace holding the bridge: the node at the other end sees silence, as on a dead
    path, rather than the local send errors a drop in its own output hook would cause.

    ARP still passes because the lab's internet is one Ethernet segment only as an
    artifact of emulating it: on a real path the routers' neighbour caches do not care
    about a cut further on, whereas here neighbours that failed to resolve during the
    cut would delay the first packets after ``Lab.restore`` by up to a second.
    """
    keep = "ether type != arp"
    return f"""\
table bridge {CUT_TABLE}_{port} {{
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "{port}" {keep} counter drop
        oifname "{port}" {keep} counter drop
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "{port}" {keep} counter drop
    }}
    chain output {{
        type filter hook output priority filter; policy accept;
        oifname "{port}" {keep} counter drop
    }}
}}
"""


def cut_table(port: str) -> str:
    """The ``family name`` of the table :func:`cut_ruleset` makes for ``port``."""
    return f"bridge {CUT_TABLE}_{port}"
