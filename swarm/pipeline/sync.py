"""Synchronous stages: the servers of a stage step together, once per global batch.

In this mode a stage server does not step its optimizer on the backward passes it
serves: their gradients accumulate. The client ends its global step by asking every
server of every stage to end it (:data:`STEP_PROTOCOL`, :meth:`SyncStage.end_step`).
The servers of a stage then add up what they accumulated in one averaging round under
``{run_id}.{uid}`` (each brings its sum, with weight 1: the round's mean times the
number of members it averages, per part, is the sum), clip that sum if configured (each
caller's contribution was clipped on its own as it came, as on any server), and
step their optimizers with it. So the stage takes the step one process would take on the
whole global batch, whichever server computed which micro-batch: stochastic wiring
changes who computes, not what is computed (SWARM, Ryabinin et al. 2023). Replicas that
start equal stay equal, bit for bit: a butterfly round gives every member the same
average.

The round runs on the averager of the server's :class:`~swarm.pipeline.StageReplica`
(one averager per peer), whose parameter buffers a synchronous stage does not average.

A request names the step it ends (the number of steps the stage took before it), so a
retried request never steps twice, and a server that missed a step says so instead of
stepping out of turn. Requests for the same step that arrive together share one round.
A round that is not agreed (a member failed in it) steps nothing: the gradients stay,
and the client may ask again (``attempt`` names a new round).

A request also lists the backward passes its client had answered by the server in the
step (``passes``: each backward names its pass, :attr:`BackwardRequest.pass_id`). A
server whose gradients hold other passes of that client's, or some twice, steps nothing
(:class:`StageMiscounted`): it computed a pass after the client gave up on it (a timeout,
a cut connection) and the client had it redone elsewhere. The client then has it drop
the step's gradients (``drop``) and redoes the passes it had answered there, so each
sample counts once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch

from averaging import (
    AllReduceConfig,
    Averager,
    AveragingStep,
    MatchmakingConfig,
    MatchmakingError,
)
from peers.errors import IdentityError, PeersError
from peers.host import Peer
from peers.identity import PeerID
from swarm.experts.announce import ExpertLocation
from swarm.experts.backend import ModuleBackend
from swarm.experts.calls import learn_addresses
from swarm.experts.worker import ModuleWorker
from swarm.pipeline.errors import StageBehind, StageMiscounted, StageStepError

logger = logging.getLogger(__name__)

STEP_PROTOCOL = "/swarmtrain/pipeline/step/1.0.0"

#: Most servers of one stage that a step request may ask to sum their gradients.
MAX_STAGE_GROUP = 64
#: Most backward passes a step request may list for one server.
MAX_STEP_PASSES = 1 << 16


@dataclass(frozen=True, slots=True)
class StepRequest:
    uid: str
    """The stage (``stage.{i}``) whose step to end."""
    step: int
    """The step to end: the number of steps the stage took before it."""
    group_size: int = 1
    """Servers of the stage asked to end it (the round gathers as many)."""
    end: bool = True
    """False: only answer how many steps this server has taken."""
    attempt: int = 0
    """Retries of this step (each a round of its own)."""
    share: bool = False
    """Before answering, share the state as it is now, with its step (a newcomer or a
    server behind the stage is about to download it)."""
    members: list[bytes] = field(default_factory=list)
    """The servers of the stage asked (peer IDs): the step is taken only if the round's
    group is exactly them, so no server's gradients are left out unnoticed. Empty: any
    group of ``group_size``."""
    passes: list[int] | None = None
    """The backward passes (their ``pass_id``) the asking client had answered by this
    server in this step: the step is taken only if the server's gradients hold exactly
    these of that client's passes, each once. ``None``: not checked. With ``end=False``
    the check alone, before the round (StageMiscounted, or the answer)."""
    drop: bool = False
    """Before anything else, forget this server's gradients of the step (it counted a
    pass the client gave up on): the client redoes the passes it had answered here."""


@dataclass(frozen=True, slots=True)
class StepResponse:
    step: int
    """Steps this server's stage has taken, after the request."""
    samples: int
    """Backward samples this server accumulated into the step it last took."""
    group_size: int
    """Servers whose gradients that step summed (1: this one alone)."""


def _default_matchmaking() -> MatchmakingConfig:
    # The client names the group's size: it forms as soon as every server joined, and
    # gathering waits only for a server that is slow to hear the request. A server that
    # never comes (killed after the client listed it) costs the search timeout: then the
    # client redoes its part elsewhere and asks again.
    return MatchmakingConfig(
        target_group_size=MAX_STAGE_GROUP,
        min_group_size=2,
        search_timeout=5.0,
        gather_timeout=3.0,
        poll_interval_seconds=0.05,
        form_when_full=True,
    )


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """How the servers of a stage sum their gradients at the end of a step."""

    matchmaking: MatchmakingConfig = field(default_factory=_default_matchmaking)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    """Round timeouts, chunk size and codec (``none`` keeps replicas bitwise equal)."""


async def call_step(
    peer: Peer, location: ExpertLocation, request: StepRequest, timeout: float
) -> StepResponse | PeersError | TimeoutError | OSError:
    """``request`` to ``location``'s server: its answer, or why there is none (returned,
    not raised: a step asks many servers at once and judges the answers together)."""
    learn_addresses(peer, location)
    try:
        return await peer.call_unary(
            location.peer_id, STEP_PROTOCOL, request, StepResponse, timeout=timeout
        )
    except (PeersError, TimeoutError, OSError) as e:
        return e


def _members(raw: list[bytes]) -> set[PeerID]:
    try:
        return {PeerID(b) for b in raw}
    except (TypeError, IdentityError) as e:
        raise StageStepError(f"members: not peer IDs ({e})") from None


def part_counts(
    step: AveragingStep, buffers: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Per element of each buffer (in the averager's order), how many members' values
    its average holds: a part some member failed to deliver averages fewer, a part left
    at our own value counts 1."""
    flat = torch.ones(sum(b.numel() for b in buffers.values()))
    for part in step.outcome.result.report.parts:
        if part.averaged and part.contributors:
            flat[part.start : part.end] = len(part.contributors)
    counts, offset = {}, 0
    for key, buffer in buffers.items():
        counts[key] = flat[offset : offset + buffer.numel()].view_as(buffer)
        offset += buffer.numel()
    return counts


class SyncStage:
    """The synchronous step of one served stage (see the module docstring)."""

    def __init__(
        self,
        backend: ModuleBackend,
        averager: Averager,
        buffers: Mapping[str, torch.Tensor],
        *,
        clip_grad_norm: float | None,
        step: int = 0,
        on_step: Callable[[ModuleWorker, Callable[[], int]], Awaitable[None]] | None = None,
        catch_up: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``averager`` averages ``buffers`` (a float32 CPU tensor per parameter of the
        backend's module, by name), and nothing else while this stage uses it.
        ``on_step(worker, steps)`` shares the state when a request asks (``steps()``
        read while the module is held is the step count its parameters are at).
        ``catch_up()`` runs when a call shows this server behind the stage: it loads
        the stage's state (then :meth:`caught_up`)."""
        self._on_step = on_step
        self._catch_up = catch_up
        self._catching: asyncio.Future[None] | None = None
        self.seen = step
        """The latest step a caller named: a server behind loads the state until it is
        there."""
        self._share_lock = asyncio.Lock()
        self._shared = -1  # the step last shared
        if backend.step_on_backward:
            raise ValueError("a synchronous stage's backend must not step on backward")
        if backend.clip_grad_norm != clip_grad_norm:
            raise ValueError("clip each caller's contribution with the step's own bound")
        self.backend = backend
        self.averager = averager
        self.clip_grad_norm = clip_grad_norm
        self.step = step
        """Steps the stage has taken (the same at all its servers)."""
        self.params = dict(backend.module.named_parameters())
        if set(buffers) != set(self.params):
            raise ValueError("give one buffer per parameter of the module")
        self.buffers = dict(buffers)
        # the step's gradients taken from the module so far (kept across failed attempts)
        self._pending = {name: torch.zeros_like(b) for name, b in self.buffers.items()}
        # the passes those gradients hold: (caller, step, pass_id), as the server tags them
        self._pending_passes: Counter[Hashable] = Counter()
        self._ending: asyncio.Future[StepResponse] | None = None
        self._samples_before = 0  # backward samples served before the step under way
        self._last = StepResponse(step, 0, 1)

    def start_at(self, step: object) -> None:
        """Take ``step`` (from a downloaded state's metadata) as the steps taken; a value
        that is not a step count leaves it as it is (logged)."""
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**62:
            self.step = step
            self._last = StepResponse(step, 0, 1)
        else:
            logger.warning("%s: downloaded state names step %r: ignored", self.backend.uid, step)

    def check_step(self, step: int, kind: str = "forward") -> None:
        """Refuse a forward or backward computed for another step than this stage's
        (StageStepError): a server behind the stage (it missed a step, or downloaded
        the state just before one) would compute on old parameters, and it starts to
        catch up (``catch_up``); a client behind is told so. A call naming no step
        (``-1``) is an asynchronous client's: its forwards are served (inference), its
        backward refused, since nobody would ever step on its gradients."""
        if step == self.step:
            return
        if step < 0:
            if kind == "backward":
                raise StageStepError(
                    f"{self.backend.uid} is a synchronous stage: a backward must name the "
                    "client's step (PipelineConfig(synchronous=True)); an asynchronous "
                    "client's gradients would accumulate here and never be stepped"
                )
            return
        if step > self.step:
            self._start_catching_up(step)
            raise StageBehind(
                f"{self.backend.uid}: this server is at step {self.step}, behind the "
                f"caller's {step}: it is loading the stage's state; try another server"
            )
        raise StageStepError(
            f"{self.backend.uid}: the caller computes for step {step}, this stage is at "
            f"{self.step}: ask the stages where they are"
        )

    def _start_catching_up(self, seen: int) -> None:
        self.seen = max(self.seen, seen)
        if self._catch_up is not None and (self._catching is None or self._catching.done()):
            self._catching = asyncio.ensure_future(self._catch_up())

    def caught_up(self, step: object) -> None:
        """The state of ``step`` was loaded (the module holds it): the gradients of the
        old step are void."""
        self._forget()
        self.start_at(step)

    def _forget(self) -> None:
        """Drop the gradients of the step (run where no batch runs)."""
        self.backend.take_gradients()
        for pending in self._pending.values():
            pending.zero_()
        self._pending_passes.clear()
        self._samples_before = self.backend.statistics().num_backward_samples

    def steps(self) -> int:
        """Steps taken (a callable for :meth:`StageReplica.share`)."""
        return self.step

    def close(self) -> None:
        """Stop a step or a share under way (the server stops serving the stage)."""
        for task in (self._ending, self._catching):
            if task is not None:
                task.cancel()

    async def end_step(
        self, worker: ModuleWorker, request: StepRequest, caller: Hashable = None
    ) -> StepResponse:
        """Answer ``request`` from ``caller`` (see :class:`StepRequest`): end the step it
        names if it is this server's current one. Raises StageStepError if it names a
        later step, if this server's gradients hold other passes of the caller's than it
        lists (StageMiscounted), or if the round found no group or was not agreed
        (nothing stepped)."""
        if request.passes is not None and len(request.passes) > MAX_STEP_PASSES:
            raise StageStepError(f"passes: at most {MAX_STEP_PASSES} per server")
        if request.share:
            await self._share_now(worker)
        # a drop for another step than this server's has nothing to drop: answered as is
        if request.drop and request.step == self.step:
            if self._ending is not None:
                raise StageStepError(f"{self.backend.uid}: a step is under way: not dropped")
            await worker.exclusive(self._forget)
        if not request.end and request.passes is not None and request.step == self.step:
            await self._check_now(worker, request, caller)
        if not request.end or request.step < self.step:
            return self._last
        if request.step > self.step:
            self._start_catching_up(request.step)
            raise StageBehind(
                f"{self.backend.uid}: asked to end step {request.step}, but this server has "
                f"taken {self.step} steps (it joined late or missed a step): catching up"
            )
        if not 1 <= request.group_size <= MAX_STAGE_GROUP or len(request.members) > MAX_STAGE_GROUP:
            raise StageStepError(f"group_size and members must be at most {MAX_STAGE_GROUP}")
        _members(request.members)  # garbage is refused before it costs a round
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._end(worker, request, caller))
            self._ending.add_done_callback(self._ended)
        # shielded: a caller that gives up does not cancel the others' step
        return await asyncio.shield(self._ending)

    async def _check_now(
        self, worker: ModuleWorker, request: StepRequest, caller: Hashable
    ) -> None:
        """The passes check of :meth:`_end`, alone (a client that gave up on a backward
        here asks it before the round, which would otherwise wait for this server in
        vain if it refused)."""
        passes = request.passes
        assert passes is not None
        if self._ending is not None:
            raise StageStepError(f"{self.backend.uid}: a step is under way: not checked")

        def check() -> None:  # where no batch runs, and only if still at that step
            if self.step == request.step:
                self._snapshot()
                self._check_passes(request.step, passes, caller)

        await worker.exclusive(check)

    def _ended(self, future: asyncio.Future[StepResponse]) -> None:
        if self._ending is future:
            self._ending = None

    async def _end(
        self, worker: ModuleWorker, request: StepRequest, caller: Hashable
    ) -> StepResponse:
        samples = await worker.exclusive(self._snapshot)
        if request.passes is not None:
            self._check_passes(request.step, request.passes, caller)
        group = 1
        if request.group_size > 1:
            averaged = await self._sum(request)
            group = averaged.num_peers
            counts = part_counts(averaged, self.buffers)
            for name, buffer in self.buffers.items():
                buffer.mul_(counts[name])
        await worker.exclusive(self._apply)  # counts the step
        self._samples_before += samples
        self._last = StepResponse(self.step, samples, group)
        return self._last

    async def _share_now(self, worker: ModuleWorker) -> None:
        """``on_step`` for the current step, unless it was shared already (one share at
        a time: a request during another waits for it, then shares if still behind)."""
        if self._on_step is None:
            return
        async with self._share_lock:
            if self._shared == self.step:
                return
            step = self.step
            try:
                await self._on_step(worker, self.steps)
            except (PeersError, TimeoutError, ValueError) as e:
                raise StageStepError(f"{self.backend.uid}: sharing step {step}: {e!r}") from e
            self._shared = step

    async def _sum(self, request: StepRequest) -> AveragingStep:
        key = f"{request.step}.{request.attempt}"
        try:
            averaged = await self.averager.step(key, target_group_size=request.group_size)
        except (MatchmakingError, PeersError, TimeoutError) as e:
            raise StageStepError(
                f"{self.backend.uid}: step {request.step}: no round with the stage's other "
                f"servers ({e}); nothing stepped, the gradients are kept"
            ) from e
        expected = _members(request.members)
        if expected and set(averaged.group.members) != expected:
            missing = sorted(str(p) for p in expected - set(averaged.group.members))
            raise StageStepError(
                f"{self.backend.uid}: step {request.step}: the round's group is not the "
                f"servers asked (missing {missing[:4]}); nothing stepped, the gradients "
                "are kept"
            )
        report = averaged.outcome.result.report
        if not averaged.outcome.transfer.agreed or report.fraction_averaged < 1.0:
            raise StageStepError(
                f"{self.backend.uid}: step {request.step}: the round with "
                f"{averaged.num_peers - 1} other servers was not agreed ({report.failed}); "
                "nothing stepped, the gradients are kept: ask again"
            )
        return averaged

    def _check_passes(self, step: int, passes: list[int], caller: Hashable) -> None:
        """StageMiscounted unless the step's gradients hold exactly ``passes`` of
        ``caller``'s, each once, and no pass computed for another step (whoever sent
        it: it was computed after its step ended, on parameters since stepped). Other
        callers' passes of this step are not checked: one client drives the steps."""
        expected: Counter[Hashable] = Counter((caller, step, p) for p in passes)
        held: Counter[Hashable] = Counter(
            {t: n for t, n in self._pending_passes.items() if _is_checked(t, caller, step)}
        )
        if held == expected:
            return
        extra, missing = held - expected, expected - held
        raise StageMiscounted(
            f"{self.backend.uid}: step {step}: this server holds {extra.total()} passes "
            f"it was not listed (or one twice; e.g. {_pass_ids(extra)}) and lacks "
            f"{missing.total()} it was (e.g. {_pass_ids(missing)}): nothing stepped; drop "
            "the step's gradients (StepRequest.drop) and redo the passes answered here"
        )

    def _snapshot(self) -> int:
        """This server's gradients of the step (taken from the module: each caller's
        contribution clipped, if configured; added to those of a failed attempt) into
        the round's buffers; the backward samples they hold."""
        self._pending_passes.update(self.backend.counted)
        taken = self.backend.take_gradients()
        with torch.no_grad():
            for name, p in self.params.items():
                grad = taken.get(p)
                if grad is not None:
                    self._pending[name].add_(grad.detach().to("cpu", torch.float32))
                self.buffers[name].copy_(self._pending[name])
        served = self.backend.statistics().num_backward_samples
        return served - self._samples_before

    def _apply(self) -> None:
        """Step on the stage's summed gradient (clipped as a whole, if configured)."""
        for pending in self._pending.values():
            pending.zero_()
        self._pending_passes.clear()
        grads = {p: self.buffers[name] for name, p in self.params.items()}
        if not self.backend.step_with(grads):
            logger.warning("%s: the step's gradient is not finite: dropped", self.backend.uid)
        self.step += 1


def _is_checked(tag: Hashable, caller: Hashable, step: int) -> bool:
    """Whether a counted pass (the server tags it ``(caller, step, pass_id)``) is one
    the step's check looks at: ``caller``'s, or any computed for another step."""
    if not (isinstance(tag, tuple) and len(tag) == 3):
        return True  # not a pass tag (the module's overflow mark): never expected
    return bool(tag[0] == caller or tag[1] != step)


def _pass_ids(passes: Counter[Hashable], most: int = 4) -> list[object]:
    """Up to ``most`` pass ids of ``passes`` (for a message)."""
    return [t[2] if isinstance(t, tuple) and len(t) == 3 else t for t in list(passes)[:most]]
