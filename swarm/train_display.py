"""What ``swarm train`` shows while it trains and when it is done.

Three forms of one stream of events: a progress bar for people (:mod:`swarm.progress_bar`:
redrawn on a terminal, plain lines elsewhere), and JSON lines for programs (``swarm
demo`` runs its peers as ``swarm train --progress json`` and reads them):

- ``{"event": "message", "text"}``: what people read as lines (the command that joins
  a new swarm, how this peer is connected);
- ``{"event": "progress", "epoch", "samples", "total_samples", "loss", "peers",
  "samples_per_second", "local_samples"}`` at each new epoch, and within an epoch at
  most every ``JSON_INTERVAL_SECONDS``;
- ``{"event": "eval", "epoch", "train_seconds", "metrics"}`` with ``--eval-every``: the
  model's test metrics after that many epochs and at the end (a loss curve; in lines
  and bar modes, a line);
- ``{"event": "result", "metrics", "epochs", "global_samples", "seconds", "train_seconds",
  "eval_seconds", "final_loss", "statistics"}`` once at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from typing import Any, Literal, TextIO

from swarm.collaborative.config import OptimizerStatistics
from swarm.progress_bar import ProgressBar, human_bytes
from swarm.trainer import Evaluation, RunPlan, TrainResult

ProgressMode = Literal["auto", "bar", "lines", "json", "none"]
PROGRESS_MODES: tuple[ProgressMode, ...] = ("auto", "bar", "lines", "json", "none")

#: Seconds between two JSON progress lines of one epoch: often enough for a smooth
#: display in the demo, rare enough that a peer taking 20 local steps a second does not
#: flood its pipe. A new epoch is always shown, so a program reading the lines sees
#: when each global step ended (the NAT benchmark times steps that way).
JSON_INTERVAL_SECONDS = 0.25


def progress_fields(
    samples: int, total: int, loss: float, peers: int, samples_per_second: float
) -> list[tuple[str, str]]:
    """The bar's fields, shared by ``swarm train`` and ``swarm demo``."""
    return [
        ("samples", f"{samples:,}/{total:,}"),
        ("loss", "-" if math.isnan(loss) else f"{loss:.3f}"),
        ("peers", str(peers)),
        ("samples/s", f"{samples_per_second:,.0f}"),
    ]


class TrainDisplay:
    """Turns a trainer's ``on_step`` callbacks and its result into output on ``stream``."""

    def __init__(self, plan: RunPlan, mode: ProgressMode, stream: TextIO | None = None) -> None:
        self.plan = plan
        self.stream = stream if stream is not None else sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self.total = plan.total_epochs * plan.samples_per_epoch
        self._bar = (
            ProgressBar(self.total, stream=self.stream, tty=mode == "bar")
            if mode in ("bar", "lines")
            else None
        )
        self._last_json = -math.inf
        self._last_json_epoch = -1
        self._last: tuple[OptimizerStatistics, float] | None = None

    def on_step(self, stats: OptimizerStatistics, loss: float) -> None:
        """The trainer's progress callback."""
        self._last = (stats, loss)
        samples = min(stats.epoch * self.plan.samples_per_epoch, self.total)
        if self._bar is not None:
            self._bar.update(samples, self._fields(stats, loss))
        elif self.mode == "json":
            now = time.monotonic()
            if (
                stats.epoch != self._last_json_epoch
                or now - self._last_json >= JSON_INTERVAL_SECONDS
            ):
                self._last_json, self._last_json_epoch = now, stats.epoch
                self._json(
                    {
                        "event": "progress",
                        "epoch": stats.epoch,
                        "samples": samples,
                        "total_samples": self.total,
                        "loss": None if math.isnan(loss) else loss,
                        "peers": stats.num_peers,
                        "samples_per_second": stats.samples_per_second,
                        "local_samples": stats.local_samples,
                    }
                )

    def message(self, text: str) -> None:
        """A line for people (in JSON mode, a ``message`` event)."""
        if self.mode == "json":
            self._json({"event": "message", "text": text})
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def on_eval(self, point: Evaluation) -> None:
        """The trainer's evaluation callback (``TrainerConfig.eval_every``)."""
        if self.mode == "json":
            self._json(
                {
                    "event": "eval",
                    "epoch": point.epoch,
                    "train_seconds": point.train_seconds,
                    "metrics": point.metrics,
                }
            )
        elif self.mode != "none":
            self.message(
                f"epoch {point.epoch} ({point.train_seconds:.1f} s of training): test "
                f"{format_metrics(point.metrics)}"
            )

    def finish(self, result: TrainResult) -> None:
        """Close the bar and print the summary (or the ``result`` JSON line)."""
        if self._bar is not None:
            last = self._last
            stats = result.statistics if last is None else last[0]
            self._bar.close(
                min(result.epochs * self.plan.samples_per_epoch, self.total),
                self._fields(stats, result.final_loss),
            )
        if self.mode == "json":
            self._json(result_record(result))
        else:  # "none" hides progress, not the outcome
            self.stream.write(format_summary(result) + "\n")
            self.stream.flush()

    def _fields(self, stats: OptimizerStatistics, loss: float) -> list[tuple[str, str]]:
        samples = min(stats.epoch * self.plan.samples_per_epoch, self.total)
        return progress_fields(samples, self.total, loss, stats.num_peers, stats.samples_per_second)

    def _json(self, record: dict[str, Any]) -> None:
        self.stream.write(json.dumps(record) + "\n")
        self.stream.flush()


def result_record(result: TrainResult) -> dict[str, Any]:
    """``result`` as the JSON ``result`` event."""
    return {
        "event": "result",
        "metrics": result.metrics,
        "epochs": result.epochs,
        "global_samples": result.global_samples,
        "seconds": result.seconds,
        "train_seconds": result.train_seconds,
        "eval_seconds": result.eval_seconds,
        "final_loss": None if math.isnan(result.final_loss) else result.final_loss,
        "statistics": dataclasses.asdict(result.statistics),
    }


def format_metrics(metrics: dict[str, float]) -> str:
    """``loss 0.0712, accuracy 97.5%`` (accuracy as a percentage, the rest as numbers)."""
    return ", ".join(
        f"{name} {value:.1%}" if name == "accuracy" else f"{name} {value:.4g}"
        for name, value in metrics.items()
    )


def format_summary(result: TrainResult) -> str:
    """The summary ``swarm train`` prints at the end."""
    s = result.statistics
    return "\n".join(
        [
            f"done: {result.epochs} epochs, {result.global_samples:,} global samples "
            f"({s.local_samples:,} by this peer) in {result.seconds:.1f} s",
            f"  averaging rounds {s.num_rounds} ({s.num_rounds_alone} alone), "
            f"state loads {s.num_state_loads}, sent {human_bytes(s.bytes_sent)}",
            f"  test metrics: {format_metrics(result.metrics)}",
        ]
    )
