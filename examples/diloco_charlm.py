"""DiLoCo: two peers train a small transformer language model, talking rarely.

DiLoCo (Douillard et al. 2023) suits slow links: each peer takes ``--inner-steps``
ordinary optimizer steps on its own data (here AdamW), then the peers average how far
their parameters moved (sent as float16) and apply one outer Nesterov step to it. The
training loop is the same as for gradient averaging; only the config differs.

The model is ``charlm``'s tiny transformer (2 layers, d=64) predicting the next
character of Python's own standard-library source, which ships with Python, so nothing
is downloaded. Both peers run as threads of this process; on real machines each runs
``train_peer`` in its own process (see examples/collaborative_digits.py).

    python examples/diloco_charlm.py                    # 8 outer steps of 50: ~2.9 bits/char, ~30 s
    python examples/diloco_charlm.py --outer-steps 2 --inner-steps 5
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import torch

from peers import PeerConfig
from peers.dht import BlockingDHT
from swarm.collaborative import CollaborativeConfig, CollaborativeOptimizer, DiLoCoConfig
from swarm.tasks import CharLMTask

NUM_PEERS = 2
LOOPBACK = PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
task = CharLMTask()  # data, model, loss and evaluation of the built-in `charlm` task


def train_peer(
    rank: int, model: torch.nn.Module, dht: BlockingDHT, args: argparse.Namespace
) -> dict[str, float]:
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)  # one kernel per step
    config = CollaborativeConfig(
        run_id="charlm-diloco",
        target_batch_size=args.batch_size * NUM_PEERS,  # unused by DiLoCo; required
        diloco=DiLoCoConfig(inner_steps=args.inner_steps, outer_lr=0.7, outer_momentum=0.9),
    )
    batches = task.batches(rank, NUM_PEERS, args.batch_size, seed=0)  # my shard of the text
    with CollaborativeOptimizer(inner, dht, config) as swarm_optimizer:
        swarm_optimizer.wait_for_peers(NUM_PEERS, timeout=30)  # start together
        while swarm_optimizer.epoch < args.outer_steps:  # epoch: outer steps taken
            loss = task.loss(model, next(batches))
            loss.backward()
            swarm_optimizer.step(args.batch_size)  # an inner step; every H, an outer one
            stats = swarm_optimizer.statistics()
            if rank == 0 and stats.local_steps % args.inner_steps == 0:
                print(f"outer step {stats.epoch}  training loss {loss.item():.3f} nats", flush=True)
        stats = swarm_optimizer.statistics()
    metrics = task.evaluate(model)
    print(
        f"peer {rank}: test {metrics['bits_per_char']:.2f} bits/char after {stats.epoch} outer "
        f"steps of {args.inner_steps}; sent {stats.bytes_sent / 1e6:.2f} MB",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outer-steps", type=int, default=8, help="synchronisations (8)")
    parser.add_argument("--inner-steps", type=int, default=50, help="H: local steps (50)")
    parser.add_argument("--batch-size", type=int, default=16, help="per peer per step (16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW lr (3e-3)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two peers share this machine

    untrained = task.evaluate(task.make_model(seed=0))["bits_per_char"]
    print(f"before training: {untrained:.2f} bits/char")
    first = BlockingDHT(peer_config=LOOPBACK)
    second = BlockingDHT([str(first.peer.listen_addrs[0])], peer_config=LOOPBACK)
    # the same initial weights on every peer (built here: seeding is global to a process)
    models = [task.make_model(seed=0) for _ in range(NUM_PEERS)]
    with ThreadPoolExecutor(NUM_PEERS) as pool:
        peers = [
            pool.submit(train_peer, rank, models[rank], dht, args)
            for rank, dht in enumerate((first, second))
        ]
        for peer in peers:
            peer.result()  # re-raises a peer's error here
    for dht in (second, first):
        dht.close()
    same = all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models), strict=True))
    print(f"both peers hold the same model: {same}")


if __name__ == "__main__":
    main()
