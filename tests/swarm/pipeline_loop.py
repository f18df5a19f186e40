"""A pipeline swarm on loopback in one process, for the pipeline tests: a bootstrap DHT
node, stage servers each on its own peer, and client nodes (port 0, bounded waits)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from peers import Peer, PeerConfig
from peers.dht import DHT, DHTConfig
from swarm.pipeline import StageServer, StageServerConfig

LISTEN = PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
#: Seconds a server or a move may take to show up on a loaded 2-core machine.
WAIT = 30.0


@dataclass
class Hosted:
    server: StageServer
    stop: asyncio.Event
    stack: contextlib.AsyncExitStack
    stages: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None

    async def next_stage(self) -> int | None:
        async with asyncio.timeout(WAIT):
            return await self.stages.get()


class Swarm:
    """A bootstrap DHT node, stage servers each on its own peer, and client nodes."""

    def __init__(self, stack: contextlib.AsyncExitStack, initial: str) -> None:
        self.stack = stack
        self.initial = initial
        self.hosted: list[Hosted] = []

    async def node(self, stack: contextlib.AsyncExitStack | None = None) -> DHT:
        stack = stack or self.stack
        peer = await stack.enter_async_context(Peer(LISTEN))
        config = DHTConfig(
            initial_peers=(self.initial,), rpc_timeout=2.0, maintenance_interval=3600
        )
        return await stack.enter_async_context(DHT(peer, config))

    async def serve(self, config: StageServerConfig) -> Hosted:
        stack = contextlib.AsyncExitStack()
        server = StageServer(await self.node(stack), config)
        hosted = Hosted(server, asyncio.Event(), stack)
        hosted.task = asyncio.create_task(
            server.run(hosted.stop, lambda s: hosted.stages.put_nowait(s.stage))
        )
        self.hosted.append(hosted)
        await hosted.next_stage()
        return hosted

    async def kill(self, hosted: Hosted) -> None:
        hosted.stop.set()
        assert hosted.task is not None
        await hosted.task
        await hosted.stack.aclose()  # its peer closes: its connections drop
        self.hosted.remove(hosted)

    async def close(self) -> None:
        for hosted in reversed(self.hosted):
            await self.kill(hosted)


@contextlib.asynccontextmanager
async def local_swarm() -> AsyncIterator[Swarm]:
    async with contextlib.AsyncExitStack() as stack:
        peer = await stack.enter_async_context(Peer(LISTEN))
        await stack.enter_async_context(DHT(peer, DHTConfig(maintenance_interval=3600)))
        swarm = Swarm(stack, str(peer.listen_addrs[0]))
        try:
            yield swarm
        finally:
            await swarm.close()


async def state_of(hosted: Hosted) -> dict[str, torch.Tensor]:
    """The module's state dict as the server holds it now."""
    worker = hosted.server.worker
    assert worker is not None
    module = worker.backend.module
    return await worker.exclusive(lambda: {k: v.clone() for k, v in module.state_dict().items()})
