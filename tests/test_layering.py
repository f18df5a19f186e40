"""Layers import one way: peers <- averaging <- swarm; peers never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "peers": {"peers"},
    "averaging": {"peers", "averaging"},
    "swarm": {"peers", "averaging", "swarm"},
}
LAYERS = set(ALLOWED)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = (_imports(path) & LAYERS) - ALLOWED[package]
        assert not bad, (
            f"{path.relative_to(ROOT)} imports {bad}: layers import peers <- averaging <- swarm"
        )


def test_peers_source_never_imports_torch() -> None:
    for path in sorted((ROOT / "peers").rglob("*.py")):
        assert "torch" not in _imports(path) or path.name == "serialization.py", path
    # serialization.py imports torch only inside the decoder of a torch-tensor extension


def test_import_peers_does_not_load_torch() -> None:
    # the optimizer's decisions are pure: no torch in the state machine or its records
    code = (
        "import sys, peers, peers.testing, peers.echo, swarm.cli, swarm.collaborative.machine;"
        " print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


def _modules(path: Path) -> set[str]:
    """Every module ``path`` imports from, in full (``peers.host``), under TYPE_CHECKING
    too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ["rpc", "identify", "ping", "service"])
def test_the_protocols_under_the_peer_do_not_depend_on_it(module: str) -> None:
    """rpc, identify and ping run on a stream host (peers/stream_api.py, or identify's own
    IdentifyHost): the Peer is built on them, not they on it; so is the service
    skeleton every service (the Peer included) derives from."""
    assert "peers.host" not in _modules(ROOT / "peers" / f"{module}.py")
