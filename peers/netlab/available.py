"""Whether a namespace lab can be built on this machine, and if not, why."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys

from peers.netlab import namespaces
from peers.netlab.commands import DEFAULT_COMMAND_TIMEOUT, NetlabError, run_checked
from peers.netlab.nat import cut_ruleset, router_ruleset
from peers.netlab.shaping import tbf_args

#: Tools the lab runs.
REQUIRED_TOOLS = ("ip", "nft", "tc", "sysctl")


@functools.cache
def lab_available() -> tuple[bool, str]:
    """Whether a :class:`Lab` can be built here, and if not, why (for ``pytest.skip``).

    Checks Linux, root, the tools on PATH, and that a namespace with a bridge, a veth
    pair and a NAT ruleset can really be made (a container may forbid it, a kernel may
    lack nf_tables). The answer is computed once per process.
    """
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "the namespace lab needs root"
    for tool in REQUIRED_TOOLS:
        if shutil.which(tool) is None:
            return False, f"the namespace lab needs `{tool}` on PATH"
    name = namespaces.next_name()
    try:
        namespaces.create(name, timeout=DEFAULT_COMMAND_TIMEOUT)
        for argv in (
            ["ip", "-n", name, "link", "add", "b0", "type", "bridge"],
            ["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
            ["tc", "-n", name, *tbf_args("v0", 1.0)],
        ):
            run_checked(argv, timeout=DEFAULT_COMMAND_TIMEOUT)
        run_checked(
            ["ip", "netns", "exec", name, "nft", "-f", "-"],
            timeout=DEFAULT_COMMAND_TIMEOUT,
            input=router_ruleset("symmetric", wan_interface="v0") + cut_ruleset("v1"),
        )
    except NetlabError as e:
        return False, f"cannot build a namespace lab here: {e}"
    finally:
        with contextlib.suppress(NetlabError):
            namespaces.delete(name, timeout=DEFAULT_COMMAND_TIMEOUT)
    return True, "namespace lab available"
