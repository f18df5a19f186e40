"""Built-in training tasks with bundled data, found by name.

- ``digits``: an MLP on the 8x8 handwritten digits that ship in ``swarm/data``.
- ``charlm``: a tiny transformer language model on the interpreter's own standard
  library source.

Both need no download. This package imports torch; ``import swarm`` does not import it.
"""

from __future__ import annotations

from collections.abc import Callable

from swarm.errors import TaskError
from swarm.tasks.base import Batch, Recipe, SampleStream, Task, peer_positions
from swarm.tasks.charlm import CharLMConfig, CharLMTask, TinyTransformerLM
from swarm.tasks.corpus import Corpus, stdlib_corpus
from swarm.tasks.digits import DigitsConfig, DigitsTask, load_digits

TASKS: dict[str, Callable[[], Task]] = {
    DigitsTask.name: DigitsTask,
    CharLMTask.name: CharLMTask,
}
"""Task factories by name (default configuration)."""


def get_task(name: str) -> Task:
    """A new instance of the built-in task ``name``; :class:`TaskError` if unknown."""
    factory = TASKS.get(name)
    if factory is None:
        raise TaskError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return factory()


__all__ = [
    "TASKS",
    "Batch",
    "CharLMConfig",
    "CharLMTask",
    "Corpus",
    "DigitsConfig",
    "DigitsTask",
    "Recipe",
    "SampleStream",
    "Task",
    "TaskError",
    "TinyTransformerLM",
    "get_task",
    "load_digits",
    "peer_positions",
    "stdlib_corpus",
]
