"""The task that runs one hosted module: queue, batch, compute, reply, then step.

Handlers ``submit`` a request, as its caller's, and await its share of a batch. The
worker asks its :class:`Batcher` what to run (each caller within its share of the queue,
callers round-robin), joins the requests of a batch along the batch dimension, computes,
and splits the results (forwards that must run one by one, such as a synchronous
stage's that keep their graphs, are answered each as soon as it is computed, so a
pipeline's next stage need not wait for the rest of the batch). A backward batch
runs caller by caller, and each caller's
gradients are clipped on their own before the step (:meth:`ModuleBackend.end_contribution`),
so one caller's huge gradient cannot drown out the others'. On a module that steps on
every backward, a batch that fails leaves no gradient behind for the next step; on one
that its owner steps (a synchronous stage), each backward is answered as soon as its
gradients are in (a backward adds them all or none), and a batch that fails costs only
the requests it had not answered. Work expected to take more than
``INLINE_COMPUTE_SECONDS`` (judged by the measured time per sample of its kind, forward
or backward: a backward costs about twice a forward) runs in a thread of the loop's
default executor (the event loop keeps moving bytes and enforcing deadlines while torch
works, and torch releases the GIL in its kernels); smaller work runs inline, saving two
thread switches per request. After a backward batch, the replies go out
first and the optimizer step follows, before the module's next batch: a backward that
ran in a thread hands its results to the loop and steps in that same thread at once,
so the step is under way before the loop, sending the replies, wants the GIL (started
from the loop after the replies, the step waited for the GIL after every backward:
docs/benchmarks.md, "Figures behind constants"). One worker per module, so a forward
never reads parameters a step is writing; code outside that reads or changes the
parameters (replica averaging) goes through :meth:`ModuleWorker.exclusive` for the same
reason. Work in a thread is awaited to its end even by a cancelled worker. A caller that
gives up leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from peers.errors import raisable_copy
from swarm.experts.backend import KeptForward, ModuleBackend
from swarm.experts.batching import Batch, Batcher, Kind
from swarm.experts.kept import KeptStore

logger = logging.getLogger(__name__)
R = TypeVar("R")

#: Weight of the newest batch in the smoothed throughput (samples/s) a server announces.
THROUGHPUT_SMOOTHING = 0.2
#: Expected compute below which a batch runs on the event loop instead of a thread: the
#: loop stalls at most this long, and a small request saves two thread switches.
INLINE_COMPUTE_SECONDS = 0.002

Tensors = list[torch.Tensor]
Result = list[torch.Tensor | None]


@dataclass(slots=True)
class _Job:
    parts: tuple[Tensors, ...]  # forward: (inputs,); backward: (inputs, grad_outputs)
    future: asyncio.Future[tuple[Result, KeptForward | None]]
    keep: bool
    kept: KeptForward | None
    caller: Hashable
    tag: Hashable | None  # a backward's: names its pass in the module's counted ones


class ModuleWorker:
    """Owns one module's queue; :meth:`run` is its task (started by the server)."""

    def __init__(
        self, backend: ModuleBackend, batcher: Batcher[int], kept: KeptStore[KeptForward]
    ) -> None:
        self.backend = backend
        self.batcher = batcher
        self.kept = kept
        """Forward graphs kept for their callers' backward passes."""
        self.throughput = 0.0
        """Samples per second of compute, smoothed over batches (0 before the first)."""
        self._seconds_per_sample: dict[Kind, float] = {}  # smoothed, per kind
        self._jobs: dict[int, _Job] = {}
        self._tickets = itertools.count()
        self._wake = asyncio.Event()
        self._exclusive = asyncio.Lock()  # held by each batch (and its step), or by exclusive()

    async def submit(
        self,
        kind: Kind,
        parts: tuple[Tensors, ...],
        num_samples: int,
        *,
        keep: bool = False,
        kept: KeptForward | None = None,
        caller: Hashable = None,
        tag: Hashable | None = None,
    ) -> tuple[Result, KeptForward | None]:
        """This request's results once its batch has run (and a forward's graph if
        ``keep`` and it ran alone). ``caller`` (the remote peer) gets its share of the
        queue and its own clipped contribution to the step (:mod:`swarm.experts.batching`,
        :meth:`ModuleBackend.end_contribution`). Raises ``ServerBusy`` if the queue, or
        the caller's share of it, is full, or what the module raised. A backward's
        ``tag`` joins :attr:`ModuleBackend.counted` once its gradients are in. Cancelling it (the
        caller's deadline) takes the request out of the queue if it has not started."""
        loop = asyncio.get_running_loop()
        ticket = next(self._tickets)
        self.batcher.submit(ticket, kind, num_samples, loop.time(), caller=caller)
        job = _Job(parts, loop.create_future(), keep, kept, caller, tag)
        self._jobs[ticket] = job
        self._wake.set()
        try:
            return await job.future
        finally:
            if self.batcher.cancel(ticket):
                del self._jobs[ticket]

    async def run(self) -> None:
        """Serve the queue until cancelled; work in a thread (a batch, an optimizer step)
        then finishes first (it may be changing the parameters, and a half-known state
        would be worse)."""
        await self._serve()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            decision = self.batcher.next_batch(loop.time())
            if isinstance(decision, Batch):
                jobs = [self._jobs.pop(t) for t in decision.tickets]
                async with self._exclusive:
                    await self._run_batch(decision, jobs)
                await asyncio.sleep(0)  # after inline work: let replies out and requests in
                continue
            self._wake.clear()
            delay = None if decision is None else max(0.0, decision - loop.time())
            try:
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def exclusive(self, fn: Callable[[], R]) -> R:
        """``fn()``, run in a thread while no batch or optimizer step of this module
        runs (requests keep queueing meanwhile): how outside code reads or changes the
        parameters. Raises what ``fn`` raises. A cancelled caller still holds the module
        until ``fn`` has finished (a half-written parameter must not be computed with)."""
        async with self._exclusive:
            return await _finish(_in_thread(fn))

    def _inline(self, kind: Kind, num_samples: int) -> bool:
        """Whether work of this kind and size is expected to be cheap enough for the loop."""
        per_sample = self._seconds_per_sample.get(kind)
        return per_sample is not None and num_samples * per_sample < INLINE_COMPUTE_SECONDS

    def _timed(self, fn: Callable[[], R]) -> tuple[R, float]:
        """``fn()`` and the seconds it computed: only its own, not the hand-over to and
        from a thread (which, counted in, would make small work look big enough for a
        thread and keep it there)."""
        started = time.perf_counter()
        try:
            return fn(), time.perf_counter() - started
        finally:
            self.backend.add_compute_seconds(time.perf_counter() - started)

    async def _run_batch(self, batch: Batch[int], jobs: list[_Job]) -> None:
        """Compute, hand each caller its share (or the module's error), and after a
        backward step the optimizer. Work in a thread is awaited to its end even by a
        cancelled worker, so the module is never released mid-computation."""
        loop = asyncio.get_running_loop()
        threaded = not self._inline(batch.kind, batch.num_samples)
        steps = batch.kind == "backward" and self.backend.step_on_backward
        step_here = steps and threaded

        def hand(fn: Callable[..., None], *args: Any) -> None:
            if threaded:  # to the loop, which owns the callers' futures
                loop.call_soon_threadsafe(fn, *args)
            else:
                fn(*args)

        def ready(job: _Job, result: tuple[Result, KeptForward | None]) -> None:
            hand(_settle, job, result)

        def work() -> bool:
            """Compute and hand over; in a backward's thread, then step at once."""
            try:
                results, seconds = self._timed(lambda: self._compute(batch.kind, jobs, ready))
            except Exception as e:  # the module's own failure: every caller hears it
                if self.backend.step_on_backward:
                    self.backend.discard_gradients()  # none of the batch's may reach a step
                else:
                    # Stepped by its owner (a synchronous stage): the gradients are the
                    # step's so far, and those of the requests answered already; a failed
                    # backward added nothing. Its caller's are closed as its contribution.
                    self.backend.end_contribution()
                hand(self._fail, batch, jobs, e)
                return False
            hand(self._deliver, batch, jobs, results, seconds)
            if step_here:
                self._step()
            return True

        if not threaded:
            computed = work()
        else:
            computed = await _finish(_in_thread(work))
        if computed and steps and not step_here:
            await _finish(asyncio.ensure_future(self._step_after_replies()))

    def _step(self) -> None:
        try:
            self.backend.step()
        except Exception as e:  # the callers have their gradients; the step is ours
            logger.warning("%s optimizer step failed: %r", self.backend.uid, e)

    def _fail(self, batch: Batch[int], jobs: list[_Job], error: BaseException) -> None:
        logger.info("%s %s failed: %r", self.backend.uid, batch.kind, error)
        for job in jobs:
            if not job.future.done():  # each its own copy: no shared traceback cycles
                job.future.set_exception(raisable_copy(error))

    def _deliver(
        self,
        batch: Batch[int],
        jobs: list[_Job],
        results: list[tuple[Result, KeptForward | None]],
        seconds: float,
    ) -> None:
        """Hand each caller its share, and learn the batch's speed. A fault of ours here
        fails the callers rather than leave them waiting for their deadlines."""
        try:
            rate = batch.num_samples / max(seconds, 1e-9)
            weight = THROUGHPUT_SMOOTHING if self.throughput else 1.0
            self.throughput += weight * (rate - self.throughput)
            per_sample = seconds / batch.num_samples
            before = self._seconds_per_sample.get(batch.kind, per_sample)
            smoothed = before + THROUGHPUT_SMOOTHING * (per_sample - before)
            self._seconds_per_sample[batch.kind] = smoothed
            for job, result in zip(jobs, results, strict=True):
                _settle(job, result)
        except Exception as e:
            self._fail(batch, jobs, e)

    async def _step_after_replies(self) -> None:
        # after an inline backward: the callers' handlers first, so they encode and send
        # the gradients in their next turn on the loop. A future of its own, awaited to
        # its end: a worker cancelled meanwhile still steps.
        await asyncio.sleep(0)
        await _finish(_in_thread(self._step))

    def _compute(
        self,
        kind: Kind,
        jobs: Sequence[_Job],
        ready: Callable[[_Job, tuple[Result, KeptForward | None]], None] | None = None,
    ) -> list[tuple[Result, KeptForward | None]]:
        """Join, compute, split. A forward keeps its graph if it ran alone; on a module
        that steps only when its owner says (a synchronous stage: graphs stay fresh
        until the step), a forward asked to keep its graph always runs on its own, so
        its backward skips the recomputation (a third of a forward and backward's
        compute). A backward runs caller by caller, each caller's gradients closed as
        its own contribution to the step; within a caller, a request with a kept graph
        runs on its own, the others together. Each forward that runs on its own is
        handed to ``ready`` as soon as it is computed, before the batch's others: in a
        pipeline, the next stage starts on it meanwhile. So is each backward on a module
        that steps only when its owner says, whose failures cost nothing but the
        requests that failed (see :meth:`_run_batch`)."""
        if kind == "forward":
            done: dict[int, tuple[Result, KeptForward | None]] = {}
            separate = len(jobs) == 1 or not self.backend.step_on_backward
            keepers = {i for i, j in enumerate(jobs) if j.keep} if separate else set()
            joint = [i for i in range(len(jobs)) if i not in keepers]
            for i, job in enumerate(jobs):
                if i in keepers:
                    outputs, kept = self.backend.forward(job.parts[0], keep=True)
                    done[i] = (list(outputs), kept)
                    if ready is not None and len(jobs) > 1:
                        ready(job, done[i])
            if joint:
                outputs, _ = self.backend.forward(_join([jobs[i].parts[0] for i in joint]))
                split = _split(outputs, [_size(jobs[i]) for i in joint])
                done.update((i, (r, None)) for i, r in zip(joint, split, strict=True))
            return [done[i] for i in range(len(jobs))]
        # A module that steps only when its owner says answers each backward once its
        # gradients are in: a later one's failure costs only the requests not yet
        # answered (a backward is all or nothing), and the others' gradients stay.
        early = ready is not None and len(jobs) > 1 and not self.backend.step_on_backward
        by_caller: dict[Hashable, list[int]] = {}
        for i, job in enumerate(jobs):
            by_caller.setdefault(job.caller, []).append(i)
        results: dict[int, Result] = {}
        for indices in by_caller.values():
            rest = []
            for i in indices:
                job = jobs[i]
                if job.kept is not None and self.backend.is_fresh(job.kept):
                    results[i] = self.backend.backward(
                        job.parts[0], job.parts[1], job.kept, _tags([job])
                    )
                    if ready is not None and early:
                        ready(job, (results[i], None))
                else:
                    rest.append(i)
            if rest:
                inputs = _join([jobs[i].parts[0] for i in rest])
                grads = _join([jobs[i].parts[1] for i in rest])
                sizes = [_size(jobs[i]) for i in rest]
                tags = _tags([jobs[i] for i in rest])
                split = _split(self.backend.backward(inputs, grads, tags=tags), sizes)
                results.update(zip(rest, split, strict=True))
                if ready is not None and early:
                    for i in rest:
                        ready(jobs[i], (results[i], None))
            self.backend.end_contribution()
        return [(results[i], None) for i in range(len(jobs))]


def _settle(job: _Job, result: tuple[Result, KeptForward | None]) -> None:
    """One request's result, unless it has one (answered ahead of its batch) or its
    caller gave up meanwhile."""
    if not job.future.done():
        job.future.set_result(result)


def _tags(jobs: Sequence[_Job]) -> list[Hashable]:
    return [job.tag for job in jobs if job.tag is not None]


def _size(job: _Job) -> int:
    return int(job.parts[0][0].shape[0])


def _join(per_request: Sequence[Tensors]) -> Tensors:
    if len(per_request) == 1:
        return per_request[0]
    return [torch.cat(column) for column in zip(*per_request, strict=True)]


def _split(outputs: Sequence[torch.Tensor | None], sizes: list[int]) -> list[Result]:
    if len(sizes) == 1:
        return [list(outputs)]
    pieces = [[None] * len(sizes) if t is None else list(torch.split(t, sizes)) for t in outputs]
    return [[column[i] for column in pieces] for i in range(len(sizes))]


def _in_thread(fn: Callable[[], R]) -> asyncio.Future[R]:
    """``fn()`` submitted to the loop's default executor at once (``asyncio.to_thread``
    would first start a task for it, one more turn of the loop on the critical path)."""
    return asyncio.get_running_loop().run_in_executor(None, fn)


async def _finish(future: asyncio.Future[R]) -> R:
    """What ``future`` gives, awaited to its end even if the caller is cancelled meanwhile
    (work in a thread cannot be stopped, and the module must stay held until it ends,
    however many times the caller is cancelled); a cancelled caller then gets
    CancelledError."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not future.cancelled():
            future.exception()  # retrieved; the work hands its own failures over
        raise asyncio.CancelledError
    return future.result()
