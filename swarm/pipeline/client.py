"""The async core of a pipeline client: micro-batches through stages, rerouted on failure.

A micro-batch's forward goes stage by stage; at each stage a server is drawn by the
stage's :class:`~swarm.pipeline.wiring.Wiring` (stochastic wiring) and called with
:func:`swarm.experts.call_forward`, asking it to keep its graph. The backward goes back
through the same servers, each given its forward's token (no recomputation). A server
that fails a call is banned for a while and the call retried on another server of the
stage, up to ``max_attempts`` times: a forward with the same inputs; a backward on
another replica with the inputs that stage got in the forward, so that replica
recomputes the forward itself and backpropagates through its own parameters (SWARM
does the same; retrying the whole micro-batch instead would redo every stage and, for
stages already backpropagated, train them twice). When a stage has no live server the
call re-reads the DHT for up to ``server_wait_timeout`` seconds (a new server may be
joining) and then raises :class:`StageUnavailable`.

Server listings come from the DHT (``stage.{i}`` announcements with load and throughput,
see :mod:`swarm.experts.announce`), re-read at most every ``refresh_seconds`` by the
micro-batch that finds them stale. Synchronous stages: when steps are short, a step's
first forward also starts a read in the background, for the step's end to use
(:meth:`PipelineClient.end_step` awaits it; it never raises).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from peers.dht import DHT
from peers.errors import PeersError, RemoteError
from peers.identity import PeerID
from peers.traffic import CallLatency, LatencyHistogram
from swarm.experts.announce import ExpertLocation, find_experts
from swarm.experts.calls import ExpertCallConfig, call_backward, call_forward
from swarm.experts.uids import check_name
from swarm.pipeline.errors import StageFailed, StageStepError, StageUnavailable
from swarm.pipeline.stages import MAX_STAGES
from swarm.pipeline.sync import StepRequest, StepResponse, call_step
from swarm.pipeline.wiring import ServerRecord, Wiring, WiringConfig

logger = logging.getLogger(__name__)
R = TypeVar("R")

#: Most attempts of one stage call: each failed attempt bans a server, so more than
#: this many failures in a row means the stage is failing, not one server.
MAX_ATTEMPTS = 16
#: Tries of one synchronous step: each after redoing the work of the servers that died.
MAX_STEP_ATTEMPTS = 3
#: Seconds between re-reads of the DHT while a stage has no live server.
WAIT_POLL_SECONDS = 0.5
#: A listing of the stages' servers read during a step (from its first forward on), at
#: most this old, serves the step's end; an older one is read again there.
STEP_LISTING_SECONDS = 1.0
#: A server's refusals of a backward made before computing it: it holds nothing of the
#: pass (any other failure may have come after the server counted it).
REFUSED_UNCOUNTED = frozenset({"ServerBusy", "StageBehind", "StageStepError", "TrainingNotAllowed"})

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: A synchronous step's answer from one server, or why there is none.
_Answer = StepResponse | PeersError | TimeoutError | OSError
#: A backward pass a server served: its pass id, the stage's inputs and the outputs'
#: gradients.
_Served = tuple[int, list[torch.Tensor], list[torch.Tensor]]
#: A server holding gradients of the step: where it is, and the passes it served.
_Held = tuple[ExpertLocation, list[_Served]]


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Which stages a client calls, and how it picks and retries their servers."""

    num_stages: int
    """Stages of the model: uids ``{uid_prefix}.0`` to ``{uid_prefix}.{num_stages-1}``."""
    uid_prefix: str = "stage"
    """Name part of the stages' uids."""
    calls: ExpertCallConfig = field(default_factory=ExpertCallConfig)
    """Deadlines of each stage call, and the codec of activations and gradients
    (``float16``, ``uint8``, ``blockwise8``: both directions)."""
    wiring: WiringConfig = field(default_factory=WiringConfig)
    """Bans and throughput smoothing of the stochastic wiring."""
    max_attempts: int = 4
    """Servers one stage call tries before :class:`StageFailed`."""
    refresh_seconds: float = 5.0
    """Seconds between re-reads of the stages' server listings in the DHT."""
    server_wait_timeout: float = 30.0
    """Seconds a call waits for a stage with no live server to get one."""
    seed: int | None = None
    """Seeds the wiring's random choices (``None``: from the OS)."""
    synchronous: bool = True
    """The stages step only when the client ends its step (:meth:`PipelineClient.end_step`),
    all their servers together, as one model would on the whole batch; their servers
    must be synchronous too (:mod:`swarm.pipeline.sync`). False: every server steps on
    each backward it serves."""
    step_timeout: float = 60.0
    """Seconds the stages' servers have to end a step (their gradients' round included)."""

    def __post_init__(self) -> None:
        check_name(self.uid_prefix)
        if not 1 <= self.num_stages <= MAX_STAGES:
            raise ValueError(f"num_stages must be in [1, {MAX_STAGES}], got {self.num_stages}")
        if not 1 <= self.max_attempts <= MAX_ATTEMPTS:
            raise ValueError(f"max_attempts must be in [1, {MAX_ATTEMPTS}]")
        if not (math.isfinite(self.refresh_seconds) and self.refresh_seconds > 0):
            raise ValueError("refresh_seconds must be finite and positive")
        if not (math.isfinite(self.server_wait_timeout) and self.server_wait_timeout >= 0):
            raise ValueError("server_wait_timeout must be finite and >= 0")
        if not (math.isfinite(self.step_timeout) and self.step_timeout > 0):
            raise ValueError("step_timeout must be finite and positive")

    @property
    def uids(self) -> list[str]:
        return [f"{self.uid_prefix}.{i}" for i in range(self.num_stages)]


@dataclass(frozen=True, slots=True)
class StageCall:
    """One stage of a micro-batch's forward: who computed it (``None``: nobody kept its
    graph, as for a backward redone elsewhere), on what."""

    location: ExpertLocation | None
    inputs: list[torch.Tensor]
    forward_token: int


@dataclass(frozen=True, slots=True)
class Trace:
    """A micro-batch's forward, stage by stage: what its backward needs."""

    calls: tuple[StageCall, ...]


@dataclass(frozen=True, slots=True)
class PipelineStatistics:
    num_forwards: int
    num_backwards: int
    num_failed_calls: int
    """Stage calls that failed and were retried elsewhere (or gave up)."""
    num_refreshes: int
    servers: tuple[tuple[ServerRecord, ...], ...]
    """Per stage, its servers as the wiring sees them."""
    call_latency: Mapping[tuple[int, str], CallLatency] = field(default_factory=dict)
    """Stage calls by ``(stage, "forward" or "backward")``: each attempt's duration, a
    failed one (then retried elsewhere) counted as a failure."""
    num_steps: int = 0
    """Synchronous stages: steps this client ended (:meth:`PipelineClient.end_step`)."""
    num_redone_backwards: int = 0
    """Synchronous stages: backward passes redone on another server of their stage
    because the server that had served them died before the step, or redone after it
    dropped its gradients of the step (it had counted a pass this client gave up on)."""
    num_step_retries: int = 0
    """Synchronous stages: attempts to end a step past the first of each (a server lost
    or refusing in the step's rounds)."""


class PipelineClient:
    """Calls the stages announced in ``dht``; see the module docstring."""

    def __init__(self, dht: DHT, config: PipelineConfig) -> None:
        self.dht = dht
        self.peer = dht.peer
        self.config = config
        self.wirings = [Wiring(config.wiring) for _ in range(config.num_stages)]
        self._rng = random.Random(config.seed)
        self._refreshed_at = -math.inf
        self._refresh_lock = asyncio.Lock()
        self._counters: Counter[str] = Counter()
        self._latency: dict[tuple[int, str], LatencyHistogram] = {}
        self._step: int | None = None  # synchronous: the step under way (None: unknown)
        self._learn_lock = asyncio.Lock()  # one look at where the stages are at a time
        # synchronous: per stage, per server, the backward passes it served in the step
        # (the stage's inputs and output gradients): redone elsewhere if it dies
        self._served: list[dict[PeerID, _Held]] = [{} for _ in range(config.num_stages)]
        # synchronous: per stage, servers told to drop their gradients of the step: they
        # are still asked to its round (with nothing, or what was redone there since)
        self._dropped: list[dict[PeerID, ExpertLocation]] = [{} for _ in range(config.num_stages)]
        self._pass_ids = itertools.count(1)  # names each backward pass (with its retries)
        # synchronous: per stage, servers a backward of the step failed at unanswered
        # (timed out, cut off, cancelled): they may have counted it all the same
        self._suspects: list[dict[PeerID, ExpertLocation]] = [{} for _ in range(config.num_stages)]
        # synchronous: the listing read from the step's first forward on, for its end;
        # the step that began (its first forward), when, and how long the last one took
        self._listing: asyncio.Future[None] | None = None
        self._begun: int | None = None
        self._step_began = 0.0
        self._last_step_seconds = 0.0

    async def refresh(self) -> None:
        """Re-read every stage's servers from the DHT now."""
        async with self._refresh_lock:
            found = await find_experts(self.dht, self.config.uids)
            now = time.monotonic()
            for uid, wiring in zip(self.config.uids, self.wirings, strict=True):
                wiring.update(found[uid], now)
            self._refreshed_at = now
            self._counters["refreshes"] += 1

    async def _fresh(self) -> None:
        if time.monotonic() - self._refreshed_at >= self.config.refresh_seconds:
            if not self._refresh_lock.locked():
                await self.refresh()
            else:  # another micro-batch is refreshing: use its result
                async with self._refresh_lock:
                    pass

    async def _choose(self, stage: int, num_samples: int) -> ExpertLocation:
        wiring = self.wirings[stage]
        deadline = time.monotonic() + self.config.server_wait_timeout
        while True:
            location = wiring.choose(num_samples, time.monotonic(), self._rng)
            if location is not None:
                return location
            if time.monotonic() >= deadline:
                uid = self.config.uids[stage]
                why = (
                    f"{wiring.num_listed} listed in the DHT, all banned after failures"
                    if wiring.num_listed
                    else "none announced in the DHT: is anyone serving it?"
                )
                raise StageUnavailable(
                    f"stage {stage} ({uid}) has no live server after waiting "
                    f"{self.config.server_wait_timeout:.0f} s ({why})",
                    stage,
                )
            await asyncio.sleep(min(WAIT_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
            await self.refresh()

    async def _call(
        self,
        stage: int,
        num_samples: int,
        call: Callable[[ExpertLocation], Awaitable[R]],
        *,
        first: ExpertLocation | None = None,
        measure: bool = True,
        direction: str = "forward",
    ) -> tuple[ExpertLocation, R]:
        """``call`` on a server of ``stage`` (``first`` if it is not banned), retried on
        others. Raises StageFailed after ``max_attempts``, StageUnavailable (above)."""
        wiring = self.wirings[stage]
        latency = self._latency.setdefault((stage, direction), LatencyHistogram())
        errors: list[str] = []
        for attempt in range(self.config.max_attempts):
            now = time.monotonic()
            if attempt == 0 and first is not None and not wiring.is_banned(first.peer_id, now):
                location = first
            else:
                location = await self._choose(stage, num_samples)
            wiring.on_start(location.peer_id, num_samples)
            settled = False
            try:
                result = await call(location)
                settled = True
                latency.record(time.monotonic() - now)
                seconds = time.monotonic() - now if measure else None
                wiring.on_success(location.peer_id, num_samples, seconds, time.monotonic())
                return location, result
            except (PeersError, TimeoutError, OSError) as e:  # the server's failure (or gone)
                settled = True
                latency.record(time.monotonic() - now, failed=True)
                busy = isinstance(e, RemoteError) and e.remote_type == "ServerBusy"
                wiring.on_failure(location.peer_id, num_samples, time.monotonic(), busy=busy)
                self._counters["failed_calls"] += 1
                errors.append(f"{location.peer_id}: {type(e).__name__}: {e}")
                logger.info("stage %d at %s failed: %r; rerouting", stage, location.peer_id, e)
            finally:
                if not settled:  # cancelled: no verdict on the server
                    wiring.on_success(location.peer_id, num_samples, None, time.monotonic())
        uid = self.config.uids[stage]
        raise StageFailed(
            f"stage {stage} ({uid}): {self.config.max_attempts} attempts failed; last: "
            + "; ".join(errors[-3:]),
            stage,
        )

    async def _forward_stage(
        self, stage: int, inputs: list[torch.Tensor], keep: bool
    ) -> tuple[StageCall, list[torch.Tensor]]:
        step = self._call_step()

        async def attempt(location: ExpertLocation) -> tuple[list[torch.Tensor], int]:
            done = await call_forward(
                self.peer, location, inputs, config=self.config.calls, keep=keep, step=step
            )
            return done.outputs, done.forward_token

        location, (outputs, token) = await self._call(stage, inputs[0].shape[0], attempt)
        return StageCall(location, inputs, token), outputs

    async def forward(
        self, inputs: Sequence[torch.Tensor], *, keep: bool = False
    ) -> tuple[list[torch.Tensor], Trace]:
        """The last stage's outputs for ``inputs`` (batch-first), and the trace a
        :meth:`backward` needs. With ``keep`` servers keep their graphs for it."""
        if self.config.synchronous and self._step is None:  # the step the calls name
            await self._learn_step()
        if keep and self.config.synchronous:
            self._begin_step()
        current = [t.detach().cpu() for t in inputs]
        calls = []
        for stage in range(self.config.num_stages):
            await self._fresh()
            call, current = await self._forward_stage(stage, current, keep)
            calls.append(call)
        self._counters["forwards"] += 1
        return current, Trace(tuple(calls))

    async def _backward_stage(
        self, stage: int, done: StageCall, grads: list[torch.Tensor], pass_id: int = 0
    ) -> list[torch.Tensor | None]:
        """The backward of ``stage`` for ``done``'s forward. Synchronous: it is a pass
        of the step, ``pass_id`` (a new one if 0), that the server counts once."""
        step = self._call_step()
        if self.config.synchronous and not pass_id:
            pass_id = next(self._pass_ids)

        async def attempt(location: ExpertLocation) -> list[torch.Tensor | None]:
            token = done.forward_token if location == done.location else 0
            try:
                return await call_backward(
                    self.peer,
                    location,
                    done.inputs,
                    grads,
                    config=self.config.calls,
                    forward_token=token,
                    step=step,
                    pass_id=pass_id,
                )
            except BaseException as e:
                # not refused before computing: the server may count the pass all the same
                if pass_id and getattr(e, "remote_type", None) not in REFUSED_UNCOUNTED:
                    self._suspects[stage][location.peer_id] = location
                raise

        n = done.inputs[0].shape[0]
        location, got = await self._call(
            stage, n, attempt, first=done.location, measure=False, direction="backward"
        )
        if self.config.synchronous:  # what it holds for the step, should it die before
            held = self._served[stage].setdefault(location.peer_id, (location, []))
            held[1].append((pass_id, done.inputs, grads))
        return got

    async def backward(
        self, trace: Trace, grad_outputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Gradients of the first stage's inputs (``None`` for integer ones); every
        stage's server trains on the way (asynchronous: its optimizer steps;
        synchronous: it accumulates the step's gradient). Synchronous: if it fails, the
        passes it made count nowhere (the servers that hold them drop the step's
        gradients at its end, and the rest of what they hold is redone), so retrying
        the micro-batch counts it once."""
        grads = [g.detach().cpu() for g in grad_outputs]
        got: list[torch.Tensor | None] = list(grads)
        made: list[tuple[int, int]] = []  # (stage, pass id) of the passes answered
        try:
            for stage in reversed(range(len(trace.calls))):
                done = trace.calls[stage]
                pass_id = next(self._pass_ids) if self.config.synchronous else 0
                got = await self._backward_stage(stage, done, grads, pass_id)
                made.append((stage, pass_id))
                grads = [
                    torch.zeros_like(x) if g is None else g
                    for g, x in zip(got, done.inputs, strict=True)
                ]
        except BaseException:
            for stage, pass_id in made:
                self._void(stage, {pass_id}.__contains__)
            raise
        self._counters["backwards"] += 1
        return got

    def _void(self, stage: int, which: Callable[[int], bool]) -> None:
        """The passes of ``stage`` whose id ``which`` picks no longer count: they leave
        this client's records of the step, and their servers are checked at its end
        (they hold them, so they drop the step's gradients and what else they answered
        is redone)."""
        for peer_id, (location, passes) in self._served[stage].items():
            kept = [served for served in passes if not which(served[0])]
            if len(kept) < len(passes):
                passes[:] = kept  # (held, if empty, so that it is checked and dropped)
                self._suspects[stage][peer_id] = location

    async def train_micro_batch(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, scale: float = 1.0
    ) -> float:
        """Forward ``inputs``, ``loss_fn(outputs, targets)`` here, backward through the
        servers that did the forward (they train, on the loss times ``scale``). Returns
        the loss."""
        outputs, trace = await self.forward([inputs], keep=True)
        with torch.enable_grad():
            out = outputs[0].requires_grad_(True)
            loss = loss_fn(out, targets)
            (grad,) = torch.autograd.grad(loss * scale, out)
        await self.backward(trace, [grad])
        return float(loss.detach())

    async def train(
        self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn
    ) -> list[float]:
        """:meth:`train_micro_batch` for each ``(inputs, targets)``, all in flight at
        once (so different stages work on different micro-batches); their losses. If
        one fails, the others are cancelled and its error raised.

        Synchronous (``config.synchronous``): the micro-batches are one global batch.
        Each micro-batch's loss (a mean over its samples) is weighted by its share of
        the batch, so the gradients the servers accumulate add up to the gradient of the
        batch's mean loss, and the step is ended (:meth:`end_step`) once all are back.
        If one fails, none of the batch's passes count (see :meth:`backward`): calling
        it again with the same batch trains on it once."""
        total = sum(x.shape[0] for x, _ in micro_batches)
        sync = self.config.synchronous
        first = next(self._pass_ids)  # this batch's passes are those from here on
        try:
            async with asyncio.TaskGroup() as group:  # one fails: the others are cancelled
                tasks = [
                    group.create_task(
                        self.train_micro_batch(
                            x, y, loss_fn, x.shape[0] / total if sync and total else 1.0
                        )
                    )
                    for x, y in micro_batches
                ]
        except ExceptionGroup as e:
            if sync:  # the micro-batches that came back do not count either
                for stage in range(self.config.num_stages):
                    self._void(stage, lambda p: p >= first)
            raise e.exceptions[0] from None  # the caller sees StageFailed, not a group
        if sync:
            await self.end_step()
        return [task.result() for task in tasks]

    async def end_step(self) -> int:
        """Synchronous stages: every stage's servers sum the gradients they accumulated
        and step, together (:mod:`swarm.pipeline.sync`); returns the steps the stages
        have taken. The servers asked are those the DHT lists (read during the step, from
        its first forward on, or afresh if that is older than ``STEP_LISTING_SECONDS``)
        and every server that served one of the step's passes; each stage steps only
        with all of them.
        A server that cannot be reached (killed, cut off) takes its part of the step
        with it: its backward passes of the step are redone on the stage's other
        servers, which are asked again, so no sample is lost and none counted twice.
        Each server is told which passes it answered; one that counted others (a pass
        it computed after this client gave up on it and had it redone elsewhere) is told
        to drop the step's gradients, and the passes it had answered are redone.
        Raises StageStepError naming the stages that could not step after
        ``MAX_STEP_ATTEMPTS`` tries, or whose servers disagree on the step."""
        if self._step is None:  # a new client: where the stages are
            await self._learn_step()
        assert self._step is not None
        step, left = self._step, set(range(self.config.num_stages))
        errors: list[str] = []
        for attempt in range(MAX_STEP_ATTEMPTS):
            if attempt:
                self._counters["step_retries"] += 1
            await self._check_suspects(step)
            await self._listing_for_step(attempt)
            now = time.monotonic()
            servers = {stage: self._holders(stage, now) for stage in left}
            for stage, listed in servers.items():
                if not listed:
                    raise StageUnavailable(f"stage {stage} has no live server to step", stage)
            answers = await self._ask_step(servers, step, attempt)
            errors = []
            for stage, got in answers.items():
                stepped = [a for a in got.values() if isinstance(a, StepResponse)]
                if any(a.step > step + 1 for a in stepped):
                    self._step = None
                    self._forget_step()  # its passes are not the stages' step's
                    raise StageStepError(
                        f"stage {stage}: asked to end step {step}, a server was past it: "
                        "this client's view of the step was stale; it reads it again next time"
                    )
                if stepped:  # a round of all the servers asked: every gradient was in it
                    left.discard(stage)
                    continue
                errors.extend(f"stage {stage} at {p}: {a}" for p, a in got.items())
                behind = {  # it refused this step's calls: nothing of it to redo
                    p
                    for p, a in got.items()
                    if isinstance(a, RemoteError) and a.remote_type == "StageBehind"
                }
                for peer_id in behind:  # not asked again in this step
                    self.wirings[stage].on_failure(peer_id, 0, now, busy=False)
                    self._dropped[stage].pop(peer_id, None)
                await self._recover(stage, step, servers[stage], got, now)
            if not left:
                break
        else:
            raise StageStepError(
                f"step {step}: stages {sorted(left)} could not step in {MAX_STEP_ATTEMPTS} "
                f"attempts; last: " + "; ".join(errors[:6])
            )
        self._forget_step()
        if self._begun == step:
            self._last_step_seconds = time.monotonic() - self._step_began
        self._step = step + 1
        self._counters["steps"] += 1
        return self._step

    def _forget_step(self) -> None:
        """The step's records (who served which pass, who dropped, who may hold a pass
        given up on): it ended, or was not the stages' step."""
        for served in self._served:
            served.clear()
        for dropped in self._dropped:
            dropped.clear()
        for suspects in self._suspects:
            suspects.clear()

    def _begin_step(self) -> None:
        """At a step's first forward: note when it began and, if the last step took at
        most ``STEP_LISTING_SECONDS``, read the listing meanwhile, for the step's end
        (so a server announced before the step began is in its round); longer steps
        read it at their end."""
        if self._begun == self._step:
            return
        now = time.monotonic()
        self._begun, self._step_began, self._listing = self._step, now, None
        if self._last_step_seconds <= STEP_LISTING_SECONDS:
            self._listing = asyncio.ensure_future(self._read_listing(now))

    async def _read_listing(self, began: float) -> None:
        """Read the listing unless a micro-batch read it since ``began`` (or is reading
        it now: then that read serves)."""
        try:
            if self._refresh_lock.locked():
                async with self._refresh_lock:
                    pass
            if self._refreshed_at < began:
                await self.refresh()
        except Exception as e:  # nobody awaits it but the step's end, which reads again
            logger.info("reading the stages' servers failed: %r", e)

    async def _listing_for_step(self, attempt: int) -> None:
        """The stages' servers for an attempt to end the step: the first uses the
        listing read before or during the step if it is at most
        ``STEP_LISTING_SECONDS`` old (a server announced since misses the step and
        catches up, as one announced just after any read would); later ones read it
        again."""
        listing, self._listing = self._listing, None
        if listing is not None:
            await listing
        if attempt or time.monotonic() - self._refreshed_at > STEP_LISTING_SECONDS:
            await self.refresh()

    def _holders(self, stage: int, now: float) -> list[ExpertLocation]:
        """Who is asked to end ``stage``'s step: its live servers, and every server that
        served one of the step's backward passes even if the wiring has banned it since
        (slow, busy): it holds gradients of the step, which must be in the round."""
        listed = {location.peer_id: location for location in self.wirings[stage].live(now)}
        for peer_id, (location, _) in self._served[stage].items():
            listed.setdefault(peer_id, location)
        for peer_id, location in self._dropped[stage].items():
            listed.setdefault(peer_id, location)
        return list(listed.values())

    def _call_step(self) -> int:
        """The step a synchronous stage call names (-1: none)."""
        if not self.config.synchronous or self._step is None:
            return -1
        return self._step

    async def _learn_step(self) -> None:
        """Where the stages are (a new client, or one told its step was stale)."""
        async with self._learn_lock:
            if self._step is not None:
                return
            await self.refresh()
            await self._ask_where()

    async def _ask_where(self) -> None:
        now = time.monotonic()
        listed = {stage: wiring.live(now) for stage, wiring in enumerate(self.wirings)}
        answers = await self._ask_step(listed, -1, 0, end=False)
        got = [a for stage in answers.values() for a in stage.values()]
        steps = [a.step for a in got if isinstance(a, StepResponse)]
        if not steps:
            reasons = "; ".join(str(a) for a in got[:3]) or "no server listed"
            raise StageStepError(
                "no stage server says which step it is at (are they asynchronous, "
                f"`swarm serve-stage --asynchronous`, while this client is not?): {reasons}"
            )
        # the stages' step: a server behind it (it missed a step) refuses calls until it
        # has loaded the stage's state
        self._step = max(steps)

    async def _redo(self, stage: int, gone: set[PeerID], now: float) -> None:
        """The backward passes the ``gone`` servers of ``stage`` served in this step,
        again on the stage's other servers (their gradients died with them)."""
        wiring = self.wirings[stage]
        for peer_id in gone:
            wiring.on_failure(peer_id, 0, now, busy=False)  # banned: not asked again
            self._dropped[stage].pop(peer_id, None)
        for peer_id in gone:
            await self._redo_passes(stage, peer_id)

    async def _check_suspects(self, step: int) -> None:
        """Before a round of the step, ask each server that a backward failed at
        without a refusal, and that holds passes of the step for this client (or was
        told to drop them), whether it holds exactly the passes it answered: one that
        holds more (it computed the pass after all) drops the step's gradients and its
        answered passes are redone, one that cannot be reached is lost, so the round does
        not wait for a server that would refuse it. Other such servers are not in the
        round: what they hold is void once they catch up."""
        suspects = {
            stage: [
                location
                for peer_id, location in found.items()
                if peer_id in self._served[stage] or peer_id in self._dropped[stage]
            ]
            for stage, found in enumerate(self._suspects)
        }
        suspects = {stage: found for stage, found in suspects.items() if found}
        for found in self._suspects:
            found.clear()
        if not suspects:
            return
        answers = await self._ask_step(suspects, step, 0, end=False, check=True)
        now = time.monotonic()
        for stage, got in answers.items():
            await self._recover(stage, step, suspects[stage], got, now)

    async def _recover(
        self,
        stage: int,
        step: int,
        asked: Sequence[ExpertLocation],
        got: Mapping[PeerID, _Answer],
        now: float,
    ) -> None:
        """After ``asked`` servers of ``stage`` answered ``got``: the passes of those
        that could not be reached are redone elsewhere; those that hold other passes
        than they answered (StageMiscounted) are told to drop the step's gradients and
        their answered passes are redone."""
        gone = {p for p, a in got.items() if not isinstance(a, (StepResponse, RemoteError))}
        miscounted = [
            location
            for location in asked
            if isinstance(a := got[location.peer_id], RemoteError)
            and a.remote_type == "StageMiscounted"
        ]
        gone |= await self._drop(stage, step, miscounted)
        await self._redo(stage, gone, now)
        await self._redo_dropped(stage, {loc.peer_id for loc in miscounted} - gone)

    async def _drop(self, stage: int, step: int, servers: Sequence[ExpertLocation]) -> set[PeerID]:
        """Tell ``servers`` of ``stage`` (they counted passes this client gave up on) to
        drop their gradients of ``step``; those that could not be told."""
        failed = set()
        for location in servers:
            request = StepRequest(location.uid, step, end=False, drop=True)
            answer = await call_step(self.peer, location, request, self.config.step_timeout)
            if isinstance(answer, StepResponse):
                self._dropped[stage][location.peer_id] = location
            else:
                logger.info("stage %d at %s: drop failed: %r", stage, location.peer_id, answer)
                failed.add(location.peer_id)
        return failed

    async def _redo_dropped(self, stage: int, dropped: set[PeerID]) -> None:
        """The passes the ``dropped`` servers of ``stage`` had answered, again (on any
        server of the stage, those included: their gradients of the step are gone)."""
        for peer_id in dropped:
            await self._redo_passes(stage, peer_id)

    async def _redo_passes(self, stage: int, peer_id: PeerID) -> None:
        """The passes ``peer_id`` had answered in the step, on the stage's servers
        (each then held where it lands). If one fails, it and those after it stay the
        server's, so the step's next attempt finds them missing and redoes them."""
        held = self._served[stage].pop(peer_id, None)
        if held is None:
            return
        location, passes = held
        for done, (pass_id, inputs, grads) in enumerate(passes):
            try:
                await self._backward_stage(stage, StageCall(None, inputs, 0), grads, pass_id)
            except BaseException:
                again = self._served[stage].setdefault(peer_id, (location, []))
                again[1][:0] = passes[done:]
                raise
            self._counters["redone_backwards"] += 1

    async def _ask_step(
        self,
        servers: Mapping[int, Sequence[ExpertLocation]],
        step: int,
        attempt: int,
        *,
        end: bool = True,
        check: bool = False,
    ) -> dict[int, dict[PeerID, _Answer]]:
        """Ask every listed server of each stage to end ``step`` (all of a stage's
        servers named as the round's members), or with ``end=False`` where it is (and
        with ``check`` whether it holds the passes it answered); the answers, or why
        there is none, by stage and server."""
        timeout = self.config.step_timeout

        async def ask(stage: int, location: ExpertLocation, members: list[bytes]) -> _Answer:
            passes = None
            if end or check:  # the passes it answered this step: it must hold exactly those
                _, served = self._served[stage].get(location.peer_id, (location, []))
                passes = [pass_id for pass_id, _, _ in served]
            request = StepRequest(
                location.uid, step, len(members), end, attempt, members=members, passes=passes
            )
            return await call_step(self.peer, location, request, timeout)

        asked = [
            (stage, location, [p.peer_id.to_bytes() for p in listed])
            for stage, listed in servers.items()
            for location in listed
        ]
        got = await asyncio.gather(*(ask(*a) for a in asked))
        answers: dict[int, dict[PeerID, _Answer]] = {stage: {} for stage in servers}
        for (stage, location, _), answer in zip(asked, got, strict=True):
            answers[stage][location.peer_id] = answer
        return answers

    def statistics(self) -> PipelineStatistics:
        now = time.monotonic()
        return PipelineStatistics(
            num_forwards=self._counters["forwards"],
            num_backwards=self._counters["backwards"],
            num_failed_calls=self._counters["failed_calls"],
            num_refreshes=self._counters["refreshes"],
            servers=tuple(w.statistics(now) for w in self.wirings),
            call_latency={key: h.snapshot() for key, h in sorted(self._latency.items())},
            num_steps=self._counters["steps"],
            num_redone_backwards=self._counters["redone_backwards"],
            num_step_retries=self._counters["step_retries"],
        )
