"""A run key (:mod:`averaging.state.signing`): a newcomer that trusts the run's operator
key loads the state the operator's peer signed, from that one donor, and nothing a
quorum of other donors offers; tampered, replayed and foreign signatures are refused
and cost only their donor. Real peers on loopback, in one loop."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from averaging.state.donor import StateServer, StateServerConfig
from averaging.state.manifest import (
    MANIFEST_PROTOCOL,
    Manifest,
    ManifestRequest,
    StateSyncError,
    build_snapshot,
)
from averaging.state.records import StateSyncConfig
from averaging.state.signing import check_signed, sign_manifest
from averaging.state.sync import load_state_from_peers
from peers.dht import DHT, DHTConfig
from peers.host import Peer
from peers.identity import KeyPair
from peers.rpc import CallContext
from tests.averaging.test_state_sync import (
    CHUNK,
    FAST,
    assert_same_state,
    make_state,
    run_with_stack,
)

PREFIX = "run"


async def _donor(
    stack: contextlib.AsyncExitStack,
    state: dict[str, torch.Tensor],
    version: int,
    signer: KeyPair | None,
) -> Peer:
    """A peer serving ``state`` as ``version``, signed with ``signer`` if given."""
    peer = await stack.enter_async_context(Peer())
    dht = await stack.enter_async_context(DHT(peer, DHTConfig()))
    server = await stack.enter_async_context(
        StateServer(
            peer, dht=dht, prefix=PREFIX, config=StateServerConfig(chunk_bytes=CHUNK), signer=signer
        )
    )
    await server.set_state(version, state, {"epoch": version})
    return peer


async def _serving_manifest(stack: contextlib.AsyncExitStack, manifest: Manifest) -> Peer:
    """A hostile peer whose manifest handler answers ``manifest``, whatever it is."""
    peer = await stack.enter_async_context(Peer())

    async def handler(request: ManifestRequest, context: CallContext) -> Manifest:
        return manifest

    peer.add_unary_handler(MANIFEST_PROTOCOL, handler, ManifestRequest)
    return peer


def _trusting(operator: KeyPair) -> StateSyncConfig:
    return dataclasses.replace(FAST, trusted_signers=frozenset({operator.peer_id}))


def test_sign_and_check_a_manifest() -> None:
    operator, other = KeyPair.generate(), KeyPair.generate()
    manifest = build_snapshot(3, make_state(), {"epoch": 3}, chunk_bytes=CHUNK).manifest
    signed = sign_manifest(operator, PREFIX, manifest)
    trusted = frozenset({operator.peer_id})
    assert check_signed(PREFIX, signed, trusted) == operator.peer_id
    cases = [
        (manifest, trusted, "not signed"),
        (signed, frozenset({other.peer_id}), "not by a run key we trust"),
        (dataclasses.replace(signed, version=4), trusted, "does not verify"),
        (dataclasses.replace(signed, metadata=b"\x80"), trusted, "does not verify"),
        (dataclasses.replace(signed, signature=bytes(64)), trusted, "does not verify"),
        (dataclasses.replace(signed, signer=b"\x00\x05abc"), trusted, "not a peer ID"),
    ]
    for candidate, keys, message in cases:
        with pytest.raises(StateSyncError, match=message):
            check_signed(PREFIX, candidate, keys)
    with pytest.raises(StateSyncError, match="does not verify"):
        check_signed("another-run", signed, trusted)  # a replay in another run


@pytest.mark.timeout(60)
def test_a_signed_state_loads_from_one_donor_and_a_quorum_of_others_does_not() -> None:
    """The operator's peer serves epoch 5, signed. Three donors on loopback offer a newer
    state (what a quorum of Sybils on several networks would offer), unsigned or signed
    with another key: a newcomer that trusts the run key loads epoch 5 from the one
    signed donor, even asked for a quorum of 2, and says why each other was dropped."""
    operator, stranger = KeyPair.generate(), KeyPair.generate()
    state, poison = make_state(1), make_state(2)

    async def test(stack: contextlib.AsyncExitStack) -> None:
        honest = await _donor(stack, state, 5, operator)
        sybils = [await _donor(stack, poison, 10**6, None) for _ in range(2)]
        forged = await _donor(stack, poison, 10**6, stranger)
        donors = [p.peer_id for p in (*sybils, forged, honest)]
        newcomer = await stack.enter_async_context(Peer())
        for p in (*sybils, forged, honest):
            await newcomer.connect(p.listen_addrs[0])
        loaded = await load_state_from_peers(
            newcomer,
            donors=donors,
            prefix=PREFIX,
            quorum=2,
            config=_trusting(operator),
            timeout=30,
        )
        assert loaded.version == 5 and loaded.metadata == {"epoch": 5}
        assert_same_state(loaded.tensors, state)
        assert loaded.report.donors_used == (honest.peer_id,)
        failures = {d.peer_id: d.failure for d in loaded.report.donors}
        for sybil in sybils:
            assert "not signed" in str(failures[sybil.peer_id])
        assert "not by a run key we trust" in str(failures[forged.peer_id])
        # Without the run key, the newer state of the Sybils wins: what the key prevents.
        unguarded = await load_state_from_peers(newcomer, donors=donors, timeout=30)
        assert unguarded.version == 10**6

    run_with_stack(test)


@pytest.mark.timeout(60)
def test_a_tampered_or_replayed_signed_manifest_costs_only_its_donor() -> None:
    """A hostile donor relays the operator's signed manifest with its version raised,
    another replays one the operator signed for another run: both are dropped, and with
    no honest donor left the newcomer gets a clear error, not their state."""
    operator = KeyPair.generate()
    manifest = build_snapshot(5, make_state(1), {"epoch": 5}, chunk_bytes=CHUNK).manifest
    raised = dataclasses.replace(sign_manifest(operator, PREFIX, manifest), version=6)
    replayed = sign_manifest(operator, "another-run", manifest)

    async def test(stack: contextlib.AsyncExitStack) -> None:
        hostile = [await _serving_manifest(stack, m) for m in (raised, replayed)]
        newcomer = await stack.enter_async_context(Peer())
        for p in hostile:
            await newcomer.connect(p.listen_addrs[0])
        with pytest.raises(StateSyncError, match="does not verify") as caught:
            await load_state_from_peers(
                newcomer,
                donors=[p.peer_id for p in hostile],
                prefix=PREFIX,
                config=_trusting(operator),
                timeout=30,
            )
        assert str(caught.value).count("does not verify") == 2
        honest = await _donor(stack, make_state(1), 5, operator)
        await newcomer.connect(honest.listen_addrs[0])
        loaded = await load_state_from_peers(
            newcomer,
            donors=[*(p.peer_id for p in hostile), honest.peer_id],
            prefix=PREFIX,
            config=_trusting(operator),
            timeout=30,
        )
        assert loaded.version == 5 and loaded.report.donors_used == (honest.peer_id,)

    run_with_stack(test)


def test_run_key_settings_check_themselves() -> None:
    with pytest.raises(ValueError, match="trusted_signers"):
        StateSyncConfig(trusted_signers={KeyPair.generate().peer_id})  # type: ignore[arg-type]

    async def main() -> None:
        async with Peer() as peer:
            with pytest.raises(ValueError, match="give the prefix"):
                await load_state_from_peers(
                    peer, donors=[], config=_trusting(KeyPair.generate()), timeout=1
                )
            with pytest.raises(ValueError, match="signs states for a prefix"):
                StateServer(peer, signer=KeyPair.generate())

    from peers.runtime import run

    run(main())
