"""What the ``swarm`` command says when its user asked for something it cannot do.

One mechanism (issue 24, item 6): a mistake on the command line (a bad multiaddr, an
identity file that cannot be used, torch missing, a module factory that returns the
wrong thing) raises :class:`UsageError` before any banner is printed; ``main`` prints it
as one line, ``swarm: error: ...``, naming the fix, and exits 2. argparse's own errors
take the same form through :class:`OneLineParser`. Nothing here starts I/O but reading
or creating the identity file.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path
from typing import NoReturn

from peers import IdentityError, KeyPair, PeerID, PeersError, parse_multiaddr, split_peer_id
from peers.addresses import tcp_target
from peers.pnet import SwarmKeyError, load_swarm_key
from swarm.errors import SwarmError

USAGE_EXIT_CODE = 2
"""The exit code of a bad command line, as argparse (and POSIX utilities) use it."""

TORCH_INSTALL = "pip install torch==2.13.0"
"""The install line the README documents (the CPU wheel); other builds suit GPUs."""

EXAMPLE_PEER_MADDR = "/ip4/192.0.2.10/tcp/31337/p2p/12D3KooW..."
EXAMPLE_LISTEN_MADDR = "/ip4/0.0.0.0/tcp/31337"


class UsageError(SwarmError):
    """The command line asks for something that cannot work; the message says what to
    change. ``main`` prints it as one line and exits with :data:`USAGE_EXIT_CODE`."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line that says where help is, not the
    usage block followed by the error; subcommand parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT_CODE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def package_version() -> str:
    """The installed swarmtrain's version (``swarm --version``)."""
    try:
        return importlib.metadata.version("swarmtrain")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def multiaddr_arg(text: str) -> str:
    """argparse type of a peer's address: a multiaddr whose ``/p2p`` part, if any, is a
    peer ID. Raises :class:`argparse.ArgumentTypeError` saying what is wrong."""
    try:
        split_peer_id(parse_multiaddr(text))
    except PeersError as e:
        raise argparse.ArgumentTypeError(
            _why_not_a_multiaddr(text, e, f"e.g. {EXAMPLE_PEER_MADDR}")
        ) from None
    return text


def initial_peer_arg(text: str) -> str:
    """argparse type of an initial peer: a multiaddr ending in the peer's ``/p2p/ID``
    (a peer is dialed by address and checked by identity, so it needs both)."""
    multiaddr_arg(text)
    if split_peer_id(parse_multiaddr(text))[1] is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} lacks the peer's /p2p/ID part: give the whole address the peer"
            f" printed, e.g. {EXAMPLE_PEER_MADDR}"
        )
    return text


def listen_arg(text: str) -> str:
    """argparse type of a listen address: ``/ip4|ip6/HOST/tcp/PORT``."""
    return _tcp_arg(text, f"listen on e.g. {EXAMPLE_LISTEN_MADDR}")


def announce_arg(text: str) -> str:
    """argparse type of an address others can dial: ``/ip4|ip6|dns/HOST/tcp/PORT``."""
    return _tcp_arg(text, "announce e.g. /ip4/HOST/tcp/PORT")


def _tcp_arg(text: str, hint: str) -> str:
    try:
        addr = parse_multiaddr(text)
    except PeersError as e:
        raise argparse.ArgumentTypeError(_why_not_a_multiaddr(text, e, hint)) from None
    try:
        tcp_target(addr)
    except PeersError as e:
        if isinstance(e, IdentityError):
            raise argparse.ArgumentTypeError(_why_not_a_multiaddr(text, e, hint)) from None
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP address; {hint}") from None
    return text


def _why_not_a_multiaddr(text: str, error: PeersError, hint: str) -> str:
    reason: BaseException = error
    while reason.__cause__ is not None:  # the multiaddr library's innermost reason
        reason = reason.__cause__
    # the library says "Invalid CID" of a bad /p2p part; users know it as a peer ID
    if isinstance(error, IdentityError) or "CID" in str(reason):
        tail = text.rpartition("/p2p/")[2]
        return f"{text!r} ends in /p2p/{tail}, which is not a peer ID; {hint}"
    return f"{text!r} is not a multiaddr ({reason}); {hint}"


def peer_id_arg(text: str) -> str:
    """argparse type of a peer ID (base58, e.g. ``12D3KooW...``)."""
    try:
        PeerID.from_base58(text)
    except PeersError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a peer ID ({e}); a peer prints its own at start, and "
            "`swarm bootstrap --identity KEY` keeps one across restarts"
        ) from None
    return text


def allowed_peers(
    allow: list[str] | None, allow_file: str | None, *, file_option: str = "--allow-file"
) -> frozenset[PeerID] | None:
    """The allow-list ``--allow`` and ``--allow-file`` give (``None`` if neither): peer
    IDs, one per line in the file, ``#`` starting a comment. Raises
    :class:`UsageError` for a file that cannot be read or holds something else, naming
    it as ``file_option`` (another list read the same way, as ``--allow-trainer-file``)."""
    texts = list(allow or [])
    if allow_file is not None:
        try:
            lines = Path(allow_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise UsageError(f"{file_option} {allow_file}: {reason}") from e
        for number, line in enumerate(lines, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                peer_id_arg(text)
            except argparse.ArgumentTypeError as e:
                raise UsageError(f"{file_option} {allow_file}, line {number}: {e}") from None
            texts.append(text)
    if allow is None and allow_file is None:
        return None
    return frozenset(PeerID.from_base58(t) for t in texts)


def load_identity(path: str, *, option: str = "--identity") -> KeyPair:
    """The key pair in ``path``, created there (mode 0600) if there is none. Raises
    :class:`UsageError`, naming ``option``, when the directory is missing or the file
    cannot be read, written or parsed."""
    directory = Path(path).absolute().parent
    if not directory.is_dir():
        raise UsageError(
            f"{option} {path}: directory {directory} does not exist; create it or give another path"
        )
    try:
        return KeyPair.load_or_create(path)
    except (PeersError, OSError) as e:
        detail = str(e) if isinstance(e, PeersError) else f"{path}: {e.strerror or e}"
        raise UsageError(
            f"{option}: {detail}; give a valid key file this user can read, or a path "
            "where none exists to create one"
        ) from e


def swarm_key_arg(path: str | None) -> bytes | None:
    """The key in ``--swarm-key``'s file (None without one); :class:`UsageError` for a
    file that cannot be read or is not a swarm key."""
    if path is None:
        return None
    try:
        return load_swarm_key(path)
    except SwarmKeyError as e:
        raise UsageError(
            f"--swarm-key: {e}; `swarm swarm-key PATH` makes a new key, to share with every "
            "peer of the swarm"
        ) from e


def require_torch(command: str) -> None:
    """Raises :class:`UsageError` with the install command if torch cannot be imported."""
    try:
        import torch  # noqa: F401  (imported to see that it can be)
    except ImportError as e:
        raise UsageError(
            f"swarm {command} needs PyTorch, which cannot be imported here ({e}); install "
            f"it with: {TORCH_INSTALL}  (or the build for your GPU from pytorch.org)"
        ) from e


def exit_usage(error: UsageError, command: str) -> int:
    """Print ``error`` of ``swarm command`` as the one line users see, as argparse
    would; returns the exit code."""
    message = " ".join(str(error).split())  # one line, whatever the message held
    print(f"swarm {command}: error: {message}", file=sys.stderr)
    return USAGE_EXIT_CODE
