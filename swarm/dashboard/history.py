"""What the dashboard remembers between reads of the swarm (pure: views and ``now`` in).

Each read of the status records is a :class:`swarm.status_view.SwarmView`. A view says
how things are; the dashboard also shows how they went: each run's samples, throughput
and loss over time, and recent events (a peer appeared or left, a run's rounds
completed or failed, a pipeline stage lost its last server). Rounds and failures are the
increases of a run's ``num_rounds`` and ``num_rounds_failed`` between two reads.

Everything kept is bounded, whatever the peers publish: a dashboard left open for a week
uses the memory it used after an hour, and state about runs, peers and pipelines that
left the view is dropped with them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from swarm.status_view import RunRow, SwarmView

#: Points kept per run: an hour at the default refresh of 2 s (older ones drop off);
#: the page's charts are 320 pixels wide, so more would not show more.
MAX_POINTS = 1800
#: Runs charted at once: a swarm trains a handful, and every charted run costs
#: ``MAX_POINTS`` points in each ``/api/view`` answer. When more runs are seen, the runs
#: no read has reported for longest, then those with fewest peers, lose their chart, so
#: runs a peer publishes once and abandons cannot take the real runs' places.
MAX_RUNS = 8
#: Recent events kept (the page shows them all, newest first).
MAX_EVENTS = 200
#: Rounds of one run within this many seconds make one event that grows ("run demo:
#: 540 rounds"), not one event per read: a steady run would otherwise push every peer
#: that joined or left out of the list within minutes.
ROUNDS_EVENT_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Point:
    time: float
    samples: int
    samples_per_second: float
    loss: float | None
    epoch: int


@dataclass(frozen=True, slots=True)
class Event:
    time: float
    """The newest read it covers."""
    kind: str
    """``joined``, ``left``, ``rounds``, ``failed`` or ``uncovered``."""
    text: str
    run_id: str = ""
    count: int = 0
    since: float = 0.0
    """The first read it covers (a ``rounds`` event grows for up to
    :data:`ROUNDS_EVENT_SECONDS`)."""


class History:
    """The series and events of successive views; :meth:`update` with each new view."""

    def __init__(self) -> None:
        self.series: dict[str, deque[Point]] = {}
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._peers: set[str] | None = None
        # Both hold only what the latest view holds (bounded by it): a run or pipeline
        # that comes back after a gap is compared with what it said before the gap only
        # through its series, so the gap costs at most one event's accuracy.
        self._rounds: dict[str, tuple[int, int]] = {}
        self._missing: dict[str, tuple[int, ...]] = {}

    def update(self, view: SwarmView, now: float) -> None:
        """Add ``view``, read at ``now`` (seconds, the clock of :attr:`Event.time`)."""
        self._peer_events(view, now)
        rounds: dict[str, tuple[int, int]] = {}
        for run in view.runs:
            self._add_point(run, now)
            before, failed_before = self._rounds.get(
                run.run_id, (run.num_rounds, run.num_rounds_failed)
            )
            if run.num_rounds > before:
                self._rounds_event(now, run.run_id, run.num_rounds - before, run.epoch)
            if run.num_rounds_failed > failed_before:
                failed = run.num_rounds_failed - failed_before
                self._event(now, "failed", f"run {run.run_id}: {_rounds(failed)} failed")
            rounds[run.run_id] = (run.num_rounds, run.num_rounds_failed)
        self._rounds = rounds
        self._evict_series({run.run_id: run.num_peers for run in view.runs})
        missing: dict[str, tuple[int, ...]] = {}
        for pipe in view.pipelines:
            before_missing = self._missing.get(pipe.uid_prefix, ())
            lost = [s for s in pipe.missing if s not in before_missing]
            if lost:
                stages = ", ".join(map(str, lost))
                text = f"pipeline {pipe.uid_prefix}: no server for stage {stages}"
                self._event(now, "uncovered", text)
            missing[pipe.uid_prefix] = pipe.missing
        self._missing = missing

    def _add_point(self, run: RunRow, now: float) -> None:
        series = self.series.get(run.run_id)
        if series is None:
            series = self.series[run.run_id] = deque(maxlen=MAX_POINTS)
        series.append(Point(now, run.samples, run.samples_per_second, run.loss, run.epoch))

    def _evict_series(self, num_peers: dict[str, int]) -> None:
        """Drop charts past :data:`MAX_RUNS`: first runs this read did not report (the
        longest unreported first), then the runs with fewest peers."""
        while len(self.series) > MAX_RUNS:
            victim = min(
                self.series,
                key=lambda run_id: (
                    self.series[run_id][-1].time,
                    num_peers.get(run_id, 0),
                    run_id,
                ),
            )
            del self.series[victim]

    def _peer_events(self, view: SwarmView, now: float) -> None:
        peers = {p.peer_id for p in view.peers}
        if self._peers is not None:
            for peer_id in sorted(peers - self._peers):
                self._event(now, "joined", f"peer {peer_id} appeared")
            for peer_id in sorted(self._peers - peers):
                self._event(now, "left", f"peer {peer_id} left")
        self._peers = peers

    def _rounds_event(self, now: float, run_id: str, num_rounds: int, epoch: int) -> None:
        """Rounds that went well, merged with the newest event if that is about the same
        run's rounds and began less than :data:`ROUNDS_EVENT_SECONDS` ago."""
        since = now
        last = self.events[-1] if self.events else None
        if (
            last is not None
            and last.kind == "rounds"
            and last.run_id == run_id
            and now - last.since < ROUNDS_EVENT_SECONDS
        ):
            num_rounds += last.count
            since = last.since
            self.events.pop()
        text = f"run {run_id}: {_rounds(num_rounds)} (epoch {epoch})"
        self.events.append(Event(now, "rounds", text, run_id, num_rounds, since))

    def _event(self, now: float, kind: str, text: str) -> None:
        self.events.append(Event(now, kind, text, since=now))

    def to_json(self) -> dict[str, object]:
        """Series by run (parallel lists, oldest first) and events, newest first."""
        return {
            "series": {
                run_id: {
                    "time": [p.time for p in points],
                    "samples": [p.samples for p in points],
                    "samples_per_second": [p.samples_per_second for p in points],
                    "loss": [p.loss for p in points],
                    "epoch": [p.epoch for p in points],
                }
                for run_id, points in self.series.items()
            },
            "events": [
                {"time": e.time, "since": e.since, "kind": e.kind, "text": e.text}
                for e in reversed(self.events)
            ],
        }


def _rounds(count: int) -> str:
    return f"{count} round" if count == 1 else f"{count} rounds"
