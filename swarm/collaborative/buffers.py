"""Where a collaborative optimizer keeps what it averages, for parameters on any device.

Averaging runs on the CPU (the network layer reads and writes host memory), so each
parameter has a host buffer: float32, in pinned memory when the parameter is on a CUDA
device (copies to and from it are faster). What accumulates between two global steps
(gradients times batch sizes, or DiLoCo's parameter change) accumulates on the
parameter's own device:

- a CPU parameter's accumulator *is* its host buffer: no copy at all;
- a device parameter's accumulator lives on its device; once per global step it is
  copied to the host buffer, averaged there, and the result copied back as the
  parameter's gradient. Local steps never cross the bus.

So the steady state copies one tensor each way per parameter and global step, the
least any CPU-side averaging can do. (Averaging on the device with device codecs would
save those two copies; not built.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _separate(param: torch.Tensor) -> bool:
    """Whether ``param`` needs an accumulator apart from its host buffer."""
    return param.device.type != "cpu"


class AveragingBuffers:
    """Per parameter: an accumulator on its device and a host buffer the averager reads
    and writes (the same tensor for CPU parameters)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.host: list[torch.Tensor] = []
        """float32 host buffers, one per parameter: what the averager averages."""
        self.accumulators: list[torch.Tensor] = []
        """float32, on each parameter's device."""
        for p in params:
            separate = _separate(p)
            pin = separate and p.device.type == "cuda" and torch.cuda.is_available()
            host = torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin)
            self.host.append(host)
            self.accumulators.append(
                torch.zeros(p.shape, dtype=torch.float32, device=p.device) if separate else host
            )

    def add_gradients(self, params: Sequence[torch.Tensor], weight: float) -> None:
        """Accumulate ``weight`` times each parameter's gradient (on its device)."""
        with torch.no_grad():
            for p, a in zip(params, self.accumulators, strict=True):
                if p.grad is not None:
                    a.add_(p.grad, alpha=weight)

    def set_difference(
        self, anchors: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
    ) -> None:
        """Accumulators := anchor - parameter (DiLoCo's outer gradient)."""
        with torch.no_grad():
            for a, anchor, p in zip(self.accumulators, anchors, params, strict=True):
                torch.sub(anchor, p.detach(), out=a)

    def to_host(self) -> None:
        """Bring what accumulated on devices to the host buffers (once per global step)."""
        with torch.no_grad():
            for a, h in zip(self.accumulators, self.host, strict=True):
                if a is not h:
                    h.copy_(a)

    def divide_host(self, denominator: float) -> None:
        with torch.no_grad():
            for h in self.host:
                h.div_(denominator)

    def host_finite(self) -> bool:
        return all(bool(torch.isfinite(h).all()) for h in self.host)

    def host_as_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Each parameter's gradient := its host buffer (the swarm's average), copied to
        the parameter's device and dtype."""
        with torch.no_grad():
            for p, h in zip(params, self.host, strict=True):
                p.grad = h.to(device=p.device, dtype=p.dtype, copy=True)

    def zero(self) -> None:
        with torch.no_grad():
            for a, h in zip(self.accumulators, self.host, strict=True):
                a.zero_()
                if a is not h:
                    h.zero_()
