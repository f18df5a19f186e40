"""Collaborative training of a digit classifier: two peers train one model together.

Each peer is a DHT node (``BlockingDHT``) plus a ``CollaborativeOptimizer`` wrapped
around a plain torch optimizer, and the training loop is the usual one: forward,
backward, step. The optimizer counts the samples every peer processes and, once the
swarm has a global batch of ``--batch-size`` samples, averages the peers' gradients
and steps them all together, so both peers hold the same model throughout.

Both peers run here, as threads of this process, so the example is self-contained. On
real machines each runs ``train_peer`` in its own process, and every peer after the
first passes the first one's address as ``initial_peers`` (``swarm join`` does this).

    python examples/collaborative_digits.py              # 320 global steps: ~97% accuracy, ~30 s
    python examples/collaborative_digits.py --steps 30   # a quick look
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from peers import PeerConfig
from peers.dht import BlockingDHT
from swarm.collaborative import CollaborativeConfig, CollaborativeOptimizer
from swarm.tasks import load_digits

NUM_PEERS = 2
LOOPBACK = PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))

# The bundled 8x8 digits: 1797 images, shuffled once; the last 360 are the test set.
images, labels = load_digits()
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
inputs = torch.tensor(images.reshape(-1, 64), dtype=torch.float32)[order] / 16
targets = torch.tensor(labels, dtype=torch.int64)[order]
train_x, train_y, test_x, test_y = inputs[:-360], targets[:-360], inputs[-360:], targets[-360:]


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every peer starts from the same weights
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def train_peer(rank: int, model: nn.Module, dht: BlockingDHT, args: argparse.Namespace) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = CollaborativeConfig(run_id="digits-example", target_batch_size=args.batch_size)
    local_batch = args.batch_size // NUM_PEERS
    shard_x, shard_y = train_x[rank::NUM_PEERS], train_y[rank::NUM_PEERS]  # my half
    generator = torch.Generator().manual_seed(rank)
    with CollaborativeOptimizer(optimizer, dht, config) as swarm_optimizer:
        # Peers that start together first wait to see each other (else each would take
        # its first steps alone); a peer joining a running swarm downloads its state.
        swarm_optimizer.wait_for_peers(NUM_PEERS, timeout=30)
        swarm_optimizer.load_state_from_peers()
        shown = 0
        while swarm_optimizer.epoch < args.steps:  # epoch: global steps the swarm took
            index = torch.randint(len(shard_y), (local_batch,), generator=generator)
            loss = F.cross_entropy(model(shard_x[index]), shard_y[index])
            loss.backward()
            swarm_optimizer.step(local_batch)  # accumulates; steps with the swarm when due
            if rank == 0 and swarm_optimizer.epoch >= shown + 50:
                shown = swarm_optimizer.epoch
                print(f"global step {shown:4d}  loss {loss.item():.3f}", flush=True)
        stats = swarm_optimizer.statistics()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(dim=1) == test_y).float().mean().item()
    print(
        f"peer {rank}: test accuracy {accuracy:.1%} after {stats.epoch} global steps "
        f"({stats.num_rounds} averaging rounds, {stats.bytes_sent / 1e6:.1f} MB sent)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=320, help="global steps (320)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (64)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two peers share this machine

    first = BlockingDHT(peer_config=LOOPBACK)  # the first peer starts the swarm
    address = str(first.peer.listen_addrs[0])
    second = BlockingDHT([address], peer_config=LOOPBACK)  # the next one joins through it
    models = [make_model() for _ in range(NUM_PEERS)]
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
