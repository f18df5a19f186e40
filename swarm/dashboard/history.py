"""What the dashboard remembers between reads of the swarm (pure: views and ``now`` in).

Each read of the status records is a :class:`swarm.status_view.SwarmView`. A view says
how things are; the dashboard also shows how they went: each run's samples, throughput
and loss over time, and recent events (a peer appeared or left, a run's rounds
completed or failed, a pipeline stage lost its last server). Everything kept is bounded,
so a dashboard left open for a week uses the memory it used after an hour.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from swarm.status_view import SwarmView

#: Points kept per run: an hour at the default refresh of 2 s (older ones drop off).
MAX_POINTS = 1800
#: Runs followed: a swarm trains a handful; more is someone publishing noise.
MAX_RUNS = 32
#: Recent events kept (the page shows the newest first).
MAX_EVENTS = 200


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
    kind: str
    """``joined``, ``left``, ``rounds``, ``failed`` or ``uncovered``."""
    text: str
    run_id: str = ""
    count: int = 0


class History:
    """The series and events of successive views; :meth:`update` with each new view."""

    def __init__(self) -> None:
        self.series: dict[str, deque[Point]] = {}
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._peers: set[str] | None = None
        self._rounds: dict[str, tuple[int, int]] = {}
        self._missing: dict[str, tuple[int, ...]] = {}

    def update(self, view: SwarmView, now: float) -> None:
        self._peer_events(view, now)
        for run in view.runs:
            series = self.series.get(run.run_id)
            if series is None:
                if len(self.series) >= MAX_RUNS:
                    continue
                series = self.series[run.run_id] = deque(maxlen=MAX_POINTS)
            series.append(Point(now, run.samples, run.samples_per_second, run.loss, run.epoch))
            rounds, failed = self._rounds.get(run.run_id, (run.num_rounds, run.num_rounds_failed))
            if run.num_rounds > rounds:
                self._rounds_event(now, run.run_id, run.num_rounds - rounds, run.epoch)
            if run.num_rounds_failed > failed:
                self._event(
                    now,
                    "failed",
                    f"run {run.run_id}: {run.num_rounds_failed - failed} rounds failed",
                )
            self._rounds[run.run_id] = (run.num_rounds, run.num_rounds_failed)
        for pipe in view.pipelines:
            before = self._missing.get(pipe.uid_prefix, ())
            lost = [s for s in pipe.missing if s not in before]
            if lost:
                stages = ", ".join(map(str, lost))
                self._event(
                    now, "uncovered", f"pipeline {pipe.uid_prefix}: no server for stage {stages}"
                )
            self._missing[pipe.uid_prefix] = pipe.missing

    def _peer_events(self, view: SwarmView, now: float) -> None:
        peers = {p.peer_id for p in view.peers}
        if self._peers is not None:
            for peer_id in sorted(peers - self._peers):
                self._event(now, "joined", f"peer {peer_id} appeared")
            for peer_id in sorted(self._peers - peers):
                self._event(now, "left", f"peer {peer_id} left")
        self._peers = peers

    def _rounds_event(self, now: float, run_id: str, num_rounds: int, epoch: int) -> None:
        """Rounds that went well, merged with the newest event if that says the same of
        the same run: a steady run is one line that grows, not a line every read."""
        last = self.events[-1] if self.events else None
        if last is not None and last.kind == "rounds" and last.run_id == run_id:
            num_rounds += last.count
            self.events.pop()
        self.events.append(
            Event(
                now,
                "rounds",
                f"run {run_id}: {num_rounds} rounds (epoch {epoch})",
                run_id,
                num_rounds,
            )
        )

    def _event(self, now: float, kind: str, text: str) -> None:
        self.events.append(Event(now, kind, text))

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
                {"time": e.time, "kind": e.kind, "text": e.text} for e in reversed(self.events)
            ],
        }
