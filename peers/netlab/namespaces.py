"""Naming, creating and removing the lab's network namespaces, and finding stale ones.

A namespace is named ``stl<pid>-<n>``: ``stl`` marks it as ours (swarmtrain lab), the
PID is the process that owns it, ``n`` counts namespaces within that process. The
owner's PID in the name is what lets a later lab recognise the leftovers of a lab whose
process died (SIGKILL, a crash, a power cut of the CI job) and remove them, while never
touching a live lab's, even one started by another user's concurrent test run.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import signal
from pathlib import Path

from peers.netlab.commands import CommandError, run_checked

#: Marks a namespace as one of ours. Short, because ``<prefix><pid>-<n>`` should stay
#: readable in ``ip netns list``; specific enough that no other tool picks it.
PREFIX = "stl"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)$")
#: Where ``ip netns`` keeps its named namespaces (bind mounts of /proc/PID/ns/net).
NETNS_DIR = Path("/run/netns")

_counter = itertools.count()


def next_name(pid: int | None = None) -> str:
    """A namespace name unique within this process (and so, with the PID, on the host)."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}-{next(_counter)}"


def owner_pid(name: str) -> int | None:
    """The PID encoded in one of our namespace names; ``None`` for any other name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (a zombie counts as dead: it owns nothing).

    A reused PID reads as alive, so a stale namespace is then kept, never a live one
    removed: the safe way to be wrong.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the parenthesised command name, which may itself hold spaces.
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def list_namespaces() -> list[str]:
    """Names of every namespace ``ip netns`` knows (ours and others')."""
    try:
        return sorted(entry.name for entry in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def stale_namespaces(names: list[str]) -> list[str]:
    """Those of ``names`` that are ours and whose owning process is gone."""
    stale = []
    for name in names:
        pid = owner_pid(name)
        if pid is not None and pid != os.getpid() and not pid_alive(pid):
            stale.append(name)
    return stale


#: Settings of every new namespace, before any interface is added to it. Forwarding
#: off, whatever the machine's own (with ``devconf_inherit_init_net`` a namespace copies
#: a Docker host's ``ip_forward=1``): only routers, which turn it on, forward. IPv6 off
#: on interfaces made from now on: the lab's internet is IPv4 only, so hosts on one
#: bridge cannot bypass a NAT over IPv6 link-local addresses, and peers see only the
#: addresses the lab gave them. Loopback keeps ``::1``, so dual-stack servers still bind.
NAMESPACE_SYSCTLS = ("net.ipv4.ip_forward=0", "net.ipv6.conf.default.disable_ipv6=1")


def create(name: str, *, timeout: float) -> None:
    """Add the namespace, apply :data:`NAMESPACE_SYSCTLS`, and bring its loopback up
    (servers may bind 127.0.0.1)."""
    run_checked(["ip", "netns", "add", name], timeout=timeout)
    run_checked(["ip", "netns", "exec", name, "sysctl", "-qw", *NAMESPACE_SYSCTLS], timeout=timeout)
    run_checked(["ip", "-n", name, "link", "set", "lo", "up"], timeout=timeout)


def pids_inside(name: str, *, timeout: float) -> list[int]:
    """PIDs of processes whose network namespace is ``name``."""
    out = run_checked(["ip", "netns", "pids", name], timeout=timeout).stdout
    return [int(word) for word in out.split() if word.isdigit()]


def kill_inside(name: str, *, timeout: float) -> None:
    """SIGKILL every process still inside ``name``: a namespace lives on, with its
    interfaces, while any process is in it. Only processes a lab started (or their
    children) are ever inside one of our namespaces."""
    for pid in pids_inside(name, timeout=timeout):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def delete(name: str, *, timeout: float) -> None:
    """Kill what is left inside ``name`` and remove it; a missing one is not an error."""
    if not (NETNS_DIR / name).exists():
        return
    kill_inside(name, timeout=timeout)
    run_checked(["ip", "netns", "delete", name], timeout=timeout)


#: ``setns(2)``'s flag for a network namespace.
CLONE_NEWNET = 0x40000000


def enter(name: str) -> None:
    """Move the calling thread into the network namespace ``name``: sockets it opens
    from then on (and processes it starts) live there. For a process that cannot be
    started with ``ip netns exec`` (a ``multiprocessing`` child): call it first, before
    any thread starts. Raises ``OSError`` if ``name`` does not exist or we may not
    enter it (it needs ``CAP_SYS_ADMIN``)."""
    try:
        fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise FileNotFoundError(e.errno, f"no network namespace {name} in {NETNS_DIR}") from e
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot enter network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def remove_stale(*, timeout: float) -> list[str]:
    """Remove every namespace left by a lab whose process is gone; returns their names.

    Two labs starting at once may race to remove the same leftover; one that vanished
    meanwhile is not an error. Raises :class:`~peers.netlab.CommandError` otherwise.
    """
    removed = []
    for name in stale_namespaces(list_namespaces()):
        try:
            delete(name, timeout=timeout)
        except CommandError:
            if (NETNS_DIR / name).exists():
                raise
        removed.append(name)
    return removed
