"""A blocking Averager for scripts that are not async.

```
dht = BlockingDHT(initial_peers=[...])
averager = BlockingAverager(dht, {"w": model.weight.data}, AveragerConfig(prefix="run"))
step = averager.step(round_key=epoch, weight=num_samples)   # blocks; tensors updated
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from averaging.averager import Averager, AveragerConfig, AveragingStep
from averaging.state.records import LoadedState
from peers.closing import ClosesOnExit
from peers.dht import BlockingDHT


class BlockingAverager(ClosesOnExit):
    """An :class:`Averager` running on a :class:`BlockingDHT`'s event loop; every call
    blocks until done (and raises what the async call raises)."""

    def __init__(
        self, dht: BlockingDHT, tensors: Mapping[str, torch.Tensor], config: AveragerConfig
    ) -> None:
        self.dht = dht
        self.averager = Averager(dht.node, tensors, config)
        dht.peer.run(self.averager.__aenter__())
        self._closed = False

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.averager.tensors

    def step(
        self,
        round_key: str | int,
        *,
        weight: float = 1.0,
        timeout: float | None = None,
        target_group_size: int | None = None,
    ) -> AveragingStep:
        """See :meth:`Averager.step`; do not touch the tensors until it returns."""
        return self.dht.peer.run(
            self.averager.step(
                round_key, weight=weight, timeout=timeout, target_group_size=target_group_size
            )
        )

    def share_state(
        self,
        version: int,
        metadata: Mapping[str, Any] | None = None,
        extra: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """See :meth:`Averager.share_state`."""
        self.dht.peer.run(self.averager.share_state(version, metadata, extra))

    def load_state_from_peers(self, *, timeout: float | None = None) -> LoadedState:
        """See :meth:`Averager.load_state_from_peers`."""
        return self.dht.peer.run(self.averager.load_state_from_peers(timeout=timeout))

    def close(self) -> None:
        """Leave (the DHT stays open)."""
        if not self._closed:
            self._closed = True
            self.dht.peer.run(self.averager.__aexit__(None, None, None))
