"""Built-in training tasks with bundled data, found by name.

- ``digits``: an MLP on the 8x8 handwritten digits that ship in ``swarm/data``.
- ``charlm``: a tiny transformer language model on the interpreter's own standard
  library source.

Both need no download. Your own task is a :class:`Task` named ``package.module:factory``
(``examples/custom_task.py``). This package imports torch; ``import swarm`` does not
import it.
"""

from __future__ import annotations

from collections.abc import Callable

from swarm.errors import TaskError
from swarm.named import find_named
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
    """A new instance of the task ``name``: a built-in name (:data:`TASKS`), or
    ``package.module:factory``, where ``factory`` is a :class:`Task` subclass or a
    function that returns a :class:`Task`, called with no arguments. The module is
    looked up on the Python path, then in the current directory.

    Raises :class:`TaskError`, saying why, if the name is neither, the module cannot be
    imported, or the factory raises or returns something else."""
    factory = _find_factory(name)
    try:
        task = factory()
    except Exception as e:  # the user's factory may raise anything
        raise TaskError(f"task factory {name!r} raised {e!r}") from e
    if not isinstance(task, Task):
        raise TaskError(
            f"task factory {name!r} returned a {type(task).__name__}, not a swarm.tasks.Task"
        )
    return task


def check_task_name(name: str) -> None:
    """Check that ``name`` names a task (importing a user's module, not calling its
    factory); :class:`TaskError` saying why not."""
    _find_factory(name)


def _find_factory(name: str) -> Callable[[], object]:
    if not isinstance(name, str):
        raise TaskError(f"a task is named by a string, got {name!r}")
    if name not in TASKS and ":" not in name:
        raise TaskError(
            f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}; "
            "or your own as MODULE:FACTORY"
        )
    try:
        factory = find_named(name, TASKS, "task")
    except ValueError as e:
        raise TaskError(str(e)) from e
    if not callable(factory):
        raise TaskError(
            f"task {name!r} is not callable (a {type(factory).__name__}): name a Task subclass "
            "or a function that returns a Task"
        )
    return factory


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
    "check_task_name",
    "get_task",
    "load_digits",
    "peer_positions",
    "stdlib_corpus",
]
