"""Where the jobs of an N-model consensus run: in this process (``local``) or on a Ray cluster (``ray``).

A consensus round is one independent job per model: find the group elements that move the model towards its
target (:meth:`symgraph.consensus.AlignmentPlan.elements`). Jobs return only those elements (index arrays and
small matrices); the caller applies them, so both runners give the same states, bit for bit, when the arithmetic
runs with the same thread settings.

On Ray each job reads its model itself, from the folder it was loaded from (a model that exists only in memory,
or was changed after loading such as a folded one, is put into Ray's object store once instead), re-applies the
elements it received in earlier rounds, and solves. The cluster is the one ``ray.init`` finds (``RAY_ADDRESS``, or
a running ``ray start --head``); without one, a local cluster is started for the run and stopped after it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .elements import Element, apply
from .errors import SymgraphError

WORKERS = ("local", "ray")


@dataclass
class Job:
    """One model's move: ``index`` into the models, its current ``state``, the elements ``applied`` to its
    original weights so far (in order; ``state`` is those weights with them applied), and the ``target``."""

    index: int
    state: dict
    applied: list[Element]
    target: dict


@dataclass
class LocalWorkers:
    """Every job in this process, one after the other."""

    seconds: list[float] = field(default_factory=list)  # per job, as measured where it ran

    def run(self, plan, jobs):
        """Yield ``(job, elements)`` for each job of the iterable ``jobs`` (built lazily: one target at a time)."""
        for job in jobs:
            clock = time.perf_counter()
            elements = plan.elements(job.state, job.target)
            self.seconds.append(time.perf_counter() - clock)
            yield job, elements

    def close(self) -> None:
        pass


def check_workers(name: str) -> None:
    """Refuse an unknown runner, or ``ray`` where Ray is not installed, before any work is done."""
    if name not in WORKERS:
        raise SymgraphError(f"Unknown workers {name!r}.", hint=f"use one of: {', '.join(WORKERS)}.")
    if name == "ray":
        import_ray()


def workers_for(name: str, subjects) -> LocalWorkers | RayWorkers:
    """The runner called ``name`` (one of :data:`WORKERS`) for jobs on ``subjects``."""
    check_workers(name)
    return RayWorkers(subjects) if name == "ray" else LocalWorkers()


class RayWorkers(LocalWorkers):
    """Jobs as Ray tasks (one CPU each), each reading its model from its own folder (see the module docstring)."""

    def __init__(self, subjects):
        super().__init__()
        self.ray = import_ray()
        self._started = not self.ray.is_initialized()
        if self._started:
            self.ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        self._solve = self.ray.remote(num_cpus=1)(_solve_job)
        self.sources = [self._source(s) for s in subjects]
        self._plan: tuple[Any, Any] | None = None  # (plan, its object reference)

    def _source(self, subject) -> ModelSource:
        if subject.path is not None and getattr(subject, "weights_from_path", False):
            return ModelSource(path=Path(subject.path))
        return ModelSource(state=self.ray.put(subject.state_dict()))

    def run(self, plan, jobs):
        """Submit every job of ``jobs`` at once; yield ``(job, elements)`` in the jobs' order."""
        if self._plan is None or self._plan[0] is not plan:
            self._plan = (plan, self.ray.put(plan))
        jobs = list(jobs)
        futures = [self._solve.remote(self._plan[1], self.sources[j.index], j.applied, self.ray.put(j.target))
                   for j in jobs]
        for job, (elements, seconds) in zip(jobs, self.ray.get(futures)):
            self.seconds.append(seconds)
            yield job, plan.owned(elements)

    def close(self) -> None:
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()


@dataclass(frozen=True)
class ModelSource:
    """Where a job finds its model's original weights: a folder it reads itself, or an object in Ray's store."""

    path: Path | None = None
    state: Any = None  # an object reference (resolved by Ray before the job runs when passed at top level)

    def load(self) -> dict:
        if self.path is None:
            import ray

            return ray.get(self.state)
        from .io import load_model

        return {k: v.detach() for k, v in load_model(str(self.path)).model.state_dict().items()}


def _solve_job(plan, source: ModelSource, applied: list[Element], target: dict) -> tuple[list[Element], float]:
    """A Ray task: the model's current state from its source and the elements applied so far, then its move."""
    from .consensus import float64_state

    clock = time.perf_counter()
    state = apply(float64_state(source.load()), applied)
    return plan.elements(state, target), time.perf_counter() - clock


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise SymgraphError(f"--workers ray needs Ray, which is not installed ({exc}).",
                            hint="install the extra: pip install 'symgraph[ray]' (or pip install ray); "
                                 "--workers local runs the same jobs in this process.") from None
    return ray


@contextlib.contextmanager
def workers(name: str, subjects):
    """:func:`workers_for` as a context: a Ray cluster started for the run is stopped after it."""
    runner = workers_for(name, subjects)
    try:
        yield runner
    finally:
        runner.close()
