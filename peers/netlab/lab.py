"""The lab: an emulated internet of network namespaces, with home routers doing NAT.

Topology (every interface lives inside one of the lab's namespaces; none is in the
host's own namespace, so no packet can leave the lab, whatever the tests send)::

    internet namespace: bridge br0 (no address of its own)
      +-- p1 <-> eth0  public host      198.18.0.1/24
      +-- p2 <-> wan0  home router      198.18.0.2/24, NAT, ip_forward=1
      |                  bridge lan0    198.19.0.1/24
      |                    +-- l1 <-> eth0  LAN host  198.19.0.2/24, via 198.19.0.1
      +-- p3 <-> wan0  home router      198.18.0.3/24 ...
                         bridge lan0    198.19.0.1/24
                           +-- l1 <-> eth0  LAN host  198.19.0.2/24 (the same address)

Addresses come from 198.18.0.0/15, reserved for benchmarking networks (RFC 2544
appendix C, RFC 6890): never routed on the real internet, so even a leak could reach
no one.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Iterator, Mapping
from typing import TypeVar

from peers.closing import ClosesOnExit
from peers.netlab import namespaces, teardown
from peers.netlab.commands import DEFAULT_COMMAND_TIMEOUT, NetlabError, run_checked
from peers.netlab.delay_line import DelayLine, LineSettings
from peers.netlab.hosts import LanHost, Node, PublicHost, Router
from peers.netlab.nat import NAT_TYPES, NatType, cut_ruleset, cut_table, router_ruleset
from peers.netlab.processes import OwnedProcesses
from peers.netlab.shaping import tbf_args
from peers.processes import TERMINATE_GRACE_SECONDS

#: The internet's addresses: public hosts and routers' WAN sides.
INTERNET_NETWORK = ipaddress.IPv4Network("198.18.0.0/24")
#: Every LAN's addresses, the same on every LAN, as home networks all use 192.168.1.0/24.
LAN_NETWORK = ipaddress.IPv4Network("198.19.0.0/24")
#: Each router's LAN address, its LAN hosts' gateway; LAN hosts count up from the next.
LAN_GATEWAY = ipaddress.IPv4Address("198.19.0.1")
#: Interface names (at most 15 characters, IFNAMSIZ - 1). Each namespace has its own
#: interface names, so every node's can be the same short ones.
INTERNET_BRIDGE = "br0"
LAN_BRIDGE = "lan0"
HOST_UPLINK = "eth0"
ROUTER_UPLINK = "wan0"
_N = TypeVar("_N", bound=Node)


class Lab(ClosesOnExit):
    """An emulated internet with home routers; use as ``with Lab() as lab:``.

    Leaving the ``with`` block (normally or by an exception), interpreter exit, and
    SIGTERM of this process each stop the lab's processes and remove its namespaces.
    Constructing a lab first removes namespaces left by labs whose process died.
    Raises :class:`NetlabError` if a namespace or link cannot be set up (what was built
    is torn down first). Needs root; see :func:`~peers.netlab.lab_available`.
    """

    def __init__(
        self,
        *,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
        terminate_grace_seconds: float = TERMINATE_GRACE_SECONDS,
    ) -> None:
        if command_timeout <= 0 or terminate_grace_seconds < 0:
            raise ValueError("command_timeout must be positive, terminate_grace_seconds >= 0")
        self.command_timeout = command_timeout
        self.terminate_grace_seconds = terminate_grace_seconds
        self._processes = OwnedProcesses()
        self._namespaces: list[str] = []
        self._nodes: dict[str, Node] = {}
        self._cut: set[str] = set()
        self._lines: dict[str, DelayLine] = {}
        self._public_addresses: Iterator[ipaddress.IPv4Address] = INTERNET_NETWORK.hosts()
        self._internet_ports = itertools.count(1)
        self._lan_hosts: dict[str, Iterator[int]] = {}
        self._closed = False
        self.removed_stale = namespaces.remove_stale(timeout=command_timeout)
        """Namespaces of dead labs that constructing this one removed."""
        teardown.register(self)
        try:
            self.internet_namespace = self._new_namespace()
            self._ip(self.internet_namespace, "link", "add", INTERNET_BRIDGE, "type", "bridge")
            self._ip(self.internet_namespace, "link", "set", INTERNET_BRIDGE, "up")
        except Exception:
            self.close()
            raise

    # --- building -------------------------------------------------------------------

    def add_public_host(self, name: str, *, rate_mbit: float | None = None) -> PublicHost:
        """A host with a public address, reachable by every other node (routers' NAT
        permitting). ``rate_mbit`` caps its link both ways (see :meth:`shape`)."""
        namespace, port = self._begin_node(name)
        address = self._next_public_address()
        self._plug(namespace, HOST_UPLINK, self.internet_namespace, port, INTERNET_BRIDGE)
        self._address(namespace, HOST_UPLINK, address, INTERNET_NETWORK)
        host = PublicHost(
            name=name,
            namespace=namespace,
            address=str(address),
            uplink=HOST_UPLINK,
            upstream_namespace=self.internet_namespace,
            upstream_port=port,
            _processes=self._processes,
        )
        return self._finish_node(host, rate_mbit)

    def add_home_router(
        self, name: str, *, nat: NatType = "endpoint-independent", rate_mbit: float | None = None
    ) -> Router:
        """A home router: a WAN address on the internet and an empty LAN (add hosts with
        :meth:`add_lan_host`). ``nat`` is ``"endpoint-independent"`` (hole punching
        works) or ``"symmetric"`` (it does not); see :mod:`peers.netlab.nat`. Unsolicited
        inbound packets are dropped. ``rate_mbit`` caps its WAN link both ways."""
        if nat not in NAT_TYPES:
            raise ValueError(f"nat must be one of {NAT_TYPES}, not {nat!r}")
        namespace, port = self._begin_node(name)
        address = self._next_public_address()
        self._plug(namespace, ROUTER_UPLINK, self.internet_namespace, port, INTERNET_BRIDGE)
        self._address(namespace, ROUTER_UPLINK, address, INTERNET_NETWORK)
        self._ip(namespace, "link", "add", LAN_BRIDGE, "type", "bridge")
        self._address(namespace, LAN_BRIDGE, LAN_GATEWAY, LAN_NETWORK)
        self._run(["ip", "netns", "exec", namespace, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        self._nft(namespace, router_ruleset(nat, wan_interface=ROUTER_UPLINK))
        router = Router(
            name=name,
            namespace=namespace,
            address=str(address),
            uplink=ROUTER_UPLINK,
            upstream_namespace=self.internet_namespace,
            upstream_port=port,
            _processes=self._processes,
            nat=nat,
            lan_address=str(LAN_GATEWAY),
            lan_bridge=LAN_BRIDGE,
        )
        self._lan_hosts[namespace] = itertools.count(1)
        return self._finish_node(router, rate_mbit)

    def add_lan_host(self, router: Router, name: str, *, rate_mbit: float | None = None) -> LanHost:
        """A host on ``router``'s LAN. The first host of every LAN is 198.19.0.2, the
        next 198.19.0.3, and so on; its default route is the router. ``rate_mbit`` caps
        its link to the router both ways."""
        self._check_node(router)
        if not isinstance(router, Router):
            raise ValueError(f"{router.name!r} is not a router")
        self._check_new_name(name)
        index = next(self._lan_hosts[router.namespace])
        address = LAN_GATEWAY + index
        if address not in LAN_NETWORK or address == LAN_NETWORK.broadcast_address:
            raise NetlabError(f"router {router.name!r} has no LAN address left")
        namespace, _ = self._begin_node(name, internet_port=False)
        port = f"l{index}"
        self._plug(namespace, HOST_UPLINK, router.namespace, port, LAN_BRIDGE)
        self._address(namespace, HOST_UPLINK, address, LAN_NETWORK)
        self._ip(namespace, "route", "add", "default", "via", str(LAN_GATEWAY))
        host = LanHost(
            name=name,
            namespace=namespace,
            address=str(address),
            uplink=HOST_UPLINK,
            upstream_namespace=router.namespace,
            upstream_port=port,
            _processes=self._processes,
            router=router,
        )
        return self._finish_node(host, rate_mbit)

    # --- changing links -------------------------------------------------------------

    def shape(
        self,
        node: Node,
        *,
        rate_mbit: float | None = None,
        up_mbit: float | None = None,
        down_mbit: float | None = None,
    ) -> None:
        """Cap ``node``'s link: ``rate_mbit`` megabits per second in each direction, or
        ``up_mbit`` from it and ``down_mbit`` to it (an asymmetric home line); a
        direction not given keeps its cap. Up is its uplink's egress, down the egress
        of the port facing it upstream. Replaces an earlier cap. Raises ``ValueError``
        for a rate that is not positive, or for both kinds of argument at once."""
        self._check_node(node)
        if rate_mbit is not None:
            if up_mbit is not None or down_mbit is not None:
                raise ValueError("give rate_mbit, or up_mbit and down_mbit, not both")
            up_mbit = down_mbit = rate_mbit
        for namespace, interface, rate in (
            (node.namespace, node.uplink, up_mbit),
            (node.upstream_namespace, node.upstream_port, down_mbit),
        ):
            if rate is not None:
                self._run(["tc", "-n", namespace, *tbf_args(interface, rate)])

    def delay(
        self,
        node: Node,
        *,
        one_way_ms: float = 0.0,
        up_ms: float | None = None,
        down_ms: float | None = None,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        seed: int = 0,
    ) -> None:
        """Give ``node``'s link latency and loss: frames from it wait ``up_ms`` (default
        ``one_way_ms``), frames to it ``down_ms`` (the same), each plus a uniform
        jitter of up to ``jitter_ms`` (never reordered), and a ``loss`` share of them
        is dropped in each direction. A round trip between two delayed nodes costs
        both their delays, both ways. The first call puts a delay line
        (:mod:`peers.netlab.delay_line`, one process) into the link; later calls change
        its settings; all zeros leaves it in, passing frames at once. Raises
        ``ValueError`` for settings out of range, :class:`NetlabError` if the line
        does not start or stops."""
        self._check_node(node)
        settings = LineSettings(
            a_to_b_ms=one_way_ms if up_ms is None else up_ms,
            b_to_a_ms=one_way_ms if down_ms is None else down_ms,
            jitter_ms=jitter_ms,
            loss=loss,
            seed=seed,
        )
        line = self._lines.get(node.name)
        if line is None:
            line = self._lines[node.name] = self._start_line(node)
        line.apply(settings)

    def cut(self, node: Node) -> None:
        """Silently drop everything to and from ``node`` on its link, as a pulled cable
        or a dead path would: its peers see timeouts, not errors. Idempotent."""
        self._check_node(node)
        if node.name in self._cut:
            return
        self._nft(node.upstream_namespace, cut_ruleset(self._bridge_port(node)))
        self._cut.add(node.name)

    def restore(self, node: Node) -> None:
        """Undo :meth:`cut`; connections whose peers have not given up carry on."""
        self._check_node(node)
        if node.name not in self._cut:
            return
        self._drop_cut_table(node.upstream_namespace, self._bridge_port(node))
        self._cut.discard(node.name)

    # --- inspecting -----------------------------------------------------------------

    @property
    def nodes(self) -> Mapping[str, Node]:
        """Every node by name, in the order they were added."""
        return dict(self._nodes)

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace of the lab, the internet's first."""
        return tuple(self._namespaces)

    # --- tearing down ---------------------------------------------------------------

    def close(self) -> None:
        """Stop every process the lab started, then remove its namespaces. Idempotent.

        Tries every step even after one fails, then raises :class:`NetlabError` naming
        what could not be removed.
        """
        if self._closed:
            return
        self._closed = True
        teardown.unregister(self)
        failures: list[str] = []
        try:
            self._processes.stop_all(grace_seconds=self.terminate_grace_seconds)
        except Exception as e:
            failures.append(f"stopping processes: {e}")
        for namespace in reversed(self._namespaces):
            try:
                namespaces.delete(namespace, timeout=self.command_timeout)
            except Exception as e:
                failures.append(f"removing {namespace}: {e}")
        if failures:
            raise NetlabError("lab teardown incomplete: " + "; ".join(failures))

    # --- internals ------------------------------------------------------------------

    def _bridge_port(self, node: Node) -> str:
        """The bridge port ``node``'s frames enter its upstream bridge by: its veth's
        far end, or the delay line's once :meth:`delay` put one in."""
        line = self._lines.get(node.name)
        return node.upstream_port if line is None else line.bridge_port

    def _drop_cut_table(self, namespace: str, port: str) -> None:
        self._run(["nft", "delete", "table", *cut_table(port).split()], namespace=namespace)

    def _start_line(self, node: Node) -> DelayLine:
        """Put a delay line into ``node``'s link, upstream: its veth's far end leaves
        the bridge, a second veth pair takes its place, and the line copies frames
        between the two."""
        namespace, port = node.upstream_namespace, node.upstream_port
        inner, bridge_port = f"d{port}", f"q{port}"
        bridge = INTERNET_BRIDGE if namespace == self.internet_namespace else LAN_BRIDGE
        self._ip(namespace, "link", "add", inner, "type", "veth", "peer", "name", bridge_port)
        self._ip(namespace, "link", "set", bridge_port, "master", bridge, "up")
        self._ip(namespace, "link", "set", inner, "up")
        self._ip(namespace, "link", "set", port, "nomaster")
        if node.name in self._cut:  # the cut moves to the new bridge port with the link
            self._drop_cut_table(namespace, port)
            self._nft(namespace, cut_ruleset(bridge_port))
        return DelayLine.start(self._processes, namespace, port, inner, bridge_port)

    def _check_new_name(self, name: str) -> None:
        if self._closed:
            raise NetlabError("the lab is closed")
        if not name or name in self._nodes:
            raise ValueError(f"node names must be non-empty and unique, not {name!r}")

    def _begin_node(self, name: str, *, internet_port: bool = True) -> tuple[str, str]:
        self._check_new_name(name)
        port = f"p{next(self._internet_ports)}" if internet_port else ""
        return self._new_namespace(), port

    def _finish_node(self, node: _N, rate_mbit: float | None) -> _N:
        self._nodes[node.name] = node
        if rate_mbit is not None:
            self.shape(node, rate_mbit=rate_mbit)
        return node

    def _check_node(self, node: Node) -> None:
        if self._nodes.get(node.name) is not node:
            raise ValueError(f"{node.name!r} is not a node of this lab")

    def _new_namespace(self) -> str:
        name = namespaces.next_name()
        # Recorded before it exists, so a failure half-way through still removes it.
        self._namespaces.append(name)
        namespaces.create(name, timeout=self.command_timeout)
        return name

    def _next_public_address(self) -> ipaddress.IPv4Address:
        try:
            return next(self._public_addresses)
        except StopIteration:
            raise NetlabError(f"the internet {INTERNET_NETWORK} has no address left") from None

    def _plug(self, namespace: str, interface: str, upstream: str, port: str, bridge: str) -> None:
        """A veth pair from ``interface`` in ``namespace`` to ``port`` on ``bridge`` in
        ``upstream``; both ends are created directly in their namespaces."""
        veth = ["type", "veth", "peer", "name", port, "netns", upstream]
        self._run(["ip", "link", "add", interface, "netns", namespace, *veth])
        self._ip(upstream, "link", "set", port, "master", bridge, "up")

    def _address(
        self,
        namespace: str,
        interface: str,
        address: ipaddress.IPv4Address,
        network: ipaddress.IPv4Network,
    ) -> None:
        self._ip(namespace, "addr", "add", f"{address}/{network.prefixlen}", "dev", interface)
        self._ip(namespace, "link", "set", interface, "up")

    def _ip(self, namespace: str, *args: str) -> None:
        self._run(["ip", "-n", namespace, *args])

    def _nft(self, namespace: str, ruleset: str) -> None:
        self._run(["nft", "-f", "-"], namespace=namespace, input=ruleset)

    def _run(
        self, argv: list[str], *, namespace: str | None = None, input: str | None = None
    ) -> None:
        if namespace is not None:
            argv = ["ip", "netns", "exec", namespace, *argv]
        run_checked(argv, timeout=self.command_timeout, input=input)
