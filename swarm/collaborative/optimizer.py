"""Collaborative training: a wrapper around any torch optimizer that steps with the swarm.

Gradient mode (hivemind.Optimizer's model): every peer accumulates gradients of the
samples it processes; when the swarm's published progress reaches
``target_batch_size`` samples, peers average their accumulated gradients (weighted by
samples) and all apply the same optimizer step. An epoch is one such global step, so
it counts global samples, and schedulers keyed on it stay right as peers come and go.

DiLoCo mode: the wrapped optimizer steps locally every batch; every ``inner_steps``
local steps peers average their parameter change (compressed) and apply an outer
Nesterov step to it.

Joining late or falling behind: a peer whose epoch is older than the swarm's downloads
parameters and optimizer state from its peers (several donors at once, verified) and
continues from there. Every peer serves its state after each step.

This module is the blocking face of :class:`~swarm.collaborative.driver.CollaborativeDriver`
(which carries out :mod:`swarm.collaborative.machine`'s decisions on the DHT's loop,
and which async code and in-memory tests use directly). The training loop stays
synchronous: a batch that needs nothing of the swarm costs no trip to the loop; one
that does (a wait, a round, a state download) waits for the driver, and does the
driver's tensor work (:mod:`swarm.collaborative.updates`) in its own thread meanwhile,
so the network loop keeps serving.
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import torch

from peers.dht import BlockingDHT
from peers.identity import PeerID
from swarm.collaborative.config import CollaborativeConfig, OptimizerError, OptimizerStatistics
from swarm.collaborative.driver import CollaborativeDriver
from swarm.collaborative.face import SchedulerFactory, TorchOptimizerFace
from swarm.collaborative.machine import Train
from swarm.collaborative.progress import SwarmProgress

T = TypeVar("T")
#: Seconds :meth:`CollaborativeOptimizer.close` waits for the driver to leave the swarm.
CLOSE_TIMEOUT_SECONDS = 10.0


class CollaborativeOptimizer(TorchOptimizerFace):
    """Steps ``optimizer`` together with the swarm of ``config.run_id`` found through
    ``dht``. Call :meth:`step` after each local ``loss.backward()`` (with the batch
    size, or set ``config.batch_size_per_step``); call :meth:`close` (or use ``with``)
    when done. It is a ``torch.optim.Optimizer`` to the training loop
    (:mod:`swarm.collaborative.face`): ``zero_grad``, ``param_groups``, ``state_dict``,
    and ``scheduler``, a function that builds a learning-rate scheduler for
    ``optimizer``, stepped once per global step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dht: BlockingDHT,
        config: CollaborativeConfig,
        *,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        self.dht = dht
        self.config = config
        self._work = _CallerThread()
        self._driver = CollaborativeDriver(
            optimizer, dht.node, config, executor=self._work, on_epoch=self._follow_epoch
        )
        self.optimizer = optimizer
        self.params = self._driver.params
        self._init_face(scheduler)
        self.buffers = self._driver.averaged.host
        self._closed = False
        dht.peer.run(self._driver.__aenter__())

    @property
    def driver(self) -> CollaborativeDriver[Any]:
        """The async driver (its coroutines run on the DHT's loop)."""
        return self._driver

    @property
    def epoch(self) -> int:
        """Global steps (DiLoCo: outer steps) this peer has taken part in."""
        return self._driver.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._driver.machine.epoch = value

    # --- the training loop's side ------------------------------------------------------

    def step(  # type: ignore[override]
        self, batch_size: int | None = None, closure: Callable[[], Any] | None = None
    ) -> Any:
        """Account for a local batch of ``batch_size`` samples (default
        ``config.batch_size_per_step``) whose gradients are in the parameters' ``.grad``;
        take a swarm step when the swarm is ready. Gradients are consumed (zeroed).
        Blocks during averaging and state downloads. ``closure``, as a torch optimizer
        takes it (also as the only argument, ``step(closure)``), is called first, with
        gradients on, and its value returned."""
        if callable(batch_size) and closure is None:
            batch_size, closure = None, batch_size
        if batch_size is None:
            batch_size = self.config.batch_size_per_step
            if not batch_size:
                raise OptimizerError(
                    "step needs the local batch size: step(batch_size), or set "
                    "CollaborativeConfig.batch_size_per_step"
                )
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise OptimizerError(f"batch_size must be a positive int, got {batch_size!r}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(batch_size)
        return loss

    def wait(self) -> None:
        """Nothing new to add (this peer did its part of the global batch): wait, at most
        ``max_wait_seconds``, for the swarm's step and take it if it comes. Gradient mode;
        in DiLoCo mode it returns at once."""
        self._step(0)

    def _step(self, batch_size: int) -> None:
        driver = self._driver
        if driver.round_due(batch_size):
            self._run(driver.take_in_round(training=True))
        decision = driver.batch(batch_size)  # tensor work here, in the training thread
        if not isinstance(decision, Train):
            self._run(driver.carry_out(decision))

    def finish(self, timeout: float | None = None) -> bool:
        """Call after the run's last step: until every live peer of the run reached this
        epoch on one branch, keep publishing progress and serving this peer's state, so
        that a peer whose last round failed loads the final state instead of stepping
        alone, and follow the majority if the last epoch split. At most ``timeout``
        seconds (default: a search, a round and a state download). True when the
        swarm settled on this peer's state, False at the timeout."""
        return self._run(self._driver.finish(timeout))

    def finish_round(self) -> None:
        """``DiLoCoConfig.overlap``: wait for the round in flight, if any, and apply its
        outer step (or resync); :meth:`finish` and ``state_dict`` do this first. Nothing
        to do otherwise."""
        if self._closed:
            raise OptimizerError("the optimizer is closed")
        if self._driver.in_flight:
            self._run(self._driver.take_in_round())

    def wait_for_peers(self, num_peers: int, timeout: float) -> int:
        """Wait until ``num_peers`` peers (this one included) publish progress, or
        ``timeout`` seconds; returns how many were seen
        (:meth:`CollaborativeDriver.wait_for_peers`)."""
        return self._run(self._driver.wait_for_peers(num_peers, timeout))

    def load_state_from_peers(self) -> bool:
        """Join a running swarm: download its state now if it is ahead of us. True if
        state was loaded."""
        return self._run(self._driver.load_state_from_peers())

    def share_state(self) -> None:
        """Publish progress and serve this peer's state of its epoch now (done after
        every global step; a peer restored from a checkpoint may do it before its
        first)."""
        self._run(self._driver.share_state())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise OptimizerError("the optimizer is closed")
        return self._work.wait_for(self.dht.peer.submit(coro))

    # --- the swarm as this peer sees it -------------------------------------------------

    def swarm_progress(self) -> SwarmProgress:
        """The run's progress as this peer sees it now: the swarm's epoch, its live peers,
        the samples toward the next step (each claim capped), throughput and ETA."""
        return self._driver.swarm_progress()

    def members(self) -> list[PeerID]:
        """Who shares the next global batch (:meth:`StepMachine.members`)."""
        return self._driver.members()

    def delivered(self) -> set[PeerID]:
        """Members whose records show them adding samples to this peer's epoch or a
        later one (:meth:`StepMachine.delivered`)."""
        return self._driver.delivered()

    def working(self, within: float) -> set[PeerID]:
        """Members publishing within ``within`` seconds (:meth:`StepMachine.working`)."""
        return self._driver.working(within)

    @property
    def accumulated(self) -> int:
        """Samples this peer added toward the step that ends its epoch."""
        return self._driver.accumulated

    @property
    def phase(self) -> int:
        """The epoch this peer's samples count toward now: :attr:`epoch`, or with
        ``DiLoCoConfig.overlap`` the next one while the round that ends ``epoch`` is in
        flight. A training loop that runs a fixed number of outer steps stops when this
        reaches it, and :meth:`finish` takes the last round in."""
        return self._driver.phase

    @property
    def inner_step(self) -> int:
        """DiLoCo: local steps taken since the last outer step (0 in gradient mode)."""
        return self._driver.inner_step

    # --- state_dict (swarm.collaborative.face) -----------------------------------------

    def _extra_state(self) -> dict[str, Any]:
        if self.config.diloco is None:
            return {}
        self.finish_round()  # the anchor is to be saved with its round in
        diloco = self._driver.diloco
        return {
            "outer": diloco.outer.state_dict(),
            "anchor": [a.detach().clone() for a in diloco.anchor],
        }

    def _check_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        if self.config.diloco is None:
            if "outer" in state_dict:
                raise OptimizerError("a DiLoCo optimizer's state_dict; this one averages gradients")
            return
        anchor = state_dict.get("anchor")
        if "outer" not in state_dict or not isinstance(anchor, list):
            raise OptimizerError("not a DiLoCo optimizer's state_dict (no outer optimizer)")
        own = self._driver.diloco.anchor
        if len(anchor) != len(own) or any(
            not isinstance(t, torch.Tensor) or t.shape != a.shape
            for t, a in zip(anchor, own, strict=False)
        ):
            raise OptimizerError("the state_dict's DiLoCo anchor does not fit these parameters")

    def _load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        if self.config.diloco is None:
            return
        diloco = self._driver.diloco
        diloco.outer.load_state_dict(state_dict["outer"])
        with torch.no_grad():
            for a, saved in zip(diloco.anchor, state_dict["anchor"], strict=True):
                a.copy_(saved)

    def _restarted(self) -> None:
        self._run(self._driver.restarted(self.epoch))

    # --- lifecycle --------------------------------------------------------------------

    def statistics(self) -> OptimizerStatistics:
        return self._driver.statistics()

    def close(self) -> None:
        """Stop publishing progress and leave the swarm (the DHT stays open)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.dht.peer.run(self._driver.aclose(), timeout=CLOSE_TIMEOUT_SECONDS)
        except Exception:  # the DHT's peer closed first, or the loop is stuck: nothing to end
            pass

    def __enter__(self) -> CollaborativeOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _CallerThread(concurrent.futures.Executor):
    """An executor whose work runs in the thread that waits on the driver: the driver
    hands its tensor work here, and the training thread, blocked on a driver call
    anyway, does it (its CUDA streams and autograd settings, and no copy of the model's
    work in a pool thread)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | object] = queue.SimpleQueue()

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return  # its awaiter was cancelled meanwhile
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)

        self._queue.put(work)
        return future

    def wait_for(self, done: concurrent.futures.Future[T]) -> T:
        """Do the work handed here until ``done`` is; its result."""
        ended = object()  # this call's own: one left by an interrupted call is skipped
        done.add_done_callback(lambda _: self._queue.put(ended))
        try:
            while (work := self._queue.get()) is not ended:
                if callable(work):
                    work()
        except BaseException:  # KeyboardInterrupt: the driver's call ends too
            done.cancel()
            raise
        return done.result()
