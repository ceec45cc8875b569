"""Bring several models of one architecture into one parameter frame, so that averaging them is meaningful.

First every model is aligned to a *reference*: the model with the largest weight, ties broken by a fingerprint
of the weights (their float64 sum of squares), so the argument order never changes the result. For two models
that is all (the second round would align the other model to the reference again).

More models: rounds of simultaneous (Jacobi) updates follow. In each round every model but the reference is
aligned to the weighted mean of the *other* models' current states (leave-one-out: a model that is part of its
own target would be pulled towards staying where it is), and each keeps its new state only if it got closer to
its target. Rounds stop when the weighted mean distance to the consensus (the weighted mean of all aligned
models) stops falling. The reference never moves: it fixes the frame, and with weights
``(1, 0, ...)`` the merge returns model 1 itself, parameter for parameter.

Alignment never changes what a model computes: every final state is checked in float64 against its model.

The jobs of each pass (one per model) run in this process or on a Ray cluster (``workers="ray"``,
:mod:`symgraph.workers`); they return the elements of their move, which are applied here, so the result is the
same either way.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .alignment import align_states, free_cost_members, relative_distance, select_groups
from .api import Subject, tie_aliases
from .elements import Element, apply
from .errors import InvarianceError
from .groups import Group
from .progress import progress_bar
from .workers import Job, workers as workers_context

#: Alignment modes a merge or a barrier accepts: the modes of :func:`symgraph.alignment.select_groups`, or none.
ALIGN_MODES = ("full", "paper", "permutation", "none")

State = dict[str, torch.Tensor]


@dataclass
class Consensus:
    """Models moved into one frame: their states (float64), and how close they came to their weighted mean."""

    states: list[State]
    reference: int
    distances_before: list[float]  # each model's distance to the weighted mean before alignment
    distances: list[float]  # ... and after
    rounds: int
    history: list[float]  # weighted mean distance to the consensus after each round (round 0: the first pass)
    seconds: float
    workers: str = "local"
    job_seconds: list[float] = dataclasses.field(default_factory=list)  # each alignment job, where it ran

    def to_json(self) -> dict:
        return {"reference": self.reference, "rounds": self.rounds, "distances_before": self.distances_before,
                "distances": self.distances, "history": self.history, "seconds": self.seconds,
                "workers": self.workers, "job_seconds": self.job_seconds}


def align_to_consensus(subjects: Sequence[Subject], weights: Sequence[float], *, mode: str = "full",
                       exclude: frozenset[str] = frozenset(), rounds: int = 5, tol: float = 1e-4,
                       progress: bool = True, learner: Callable | None = None, reference: int | None = None,
                       common: bool = False, workers: str = "local", device="cpu", dtype=None,
                       first_pass: Callable[[int, int], Sequence[Element]] | None = None) -> Consensus:
    """Align every model to a common frame (see the module docstring); distances are relative L2 distances.

    ``exclude`` names parameters left out of every cost and every mean (classifier heads of different tasks,
    which may differ in shape); they are still transformed with their model, so each model keeps its function.
    A ``learner`` (:attr:`AlignmentPlan.learner`) tunes each model's alignment to the reference; the rounds that
    follow align by distance and would undo it, so there are none. ``reference`` names the model whose frame is
    kept (default: :func:`reference_index`). With ``common`` the frame is then given up for a common one: rounds in
    which *every* model, the reference too, is aligned to the weighted mean of all (generalised Procrustes
    analysis), kept model by model where it comes closer to that mean, while the mean distance keeps falling.
    ``workers`` is where the alignment jobs run: ``local`` (this process) or ``ray`` (:mod:`symgraph.workers`;
    needs the ``symgraph[ray]`` extra), with the same result. ``device`` and ``dtype`` are where and in what each
    alignment computes (:func:`symgraph.alignment.align_states`; the states stay float64 on the CPU).
    ``first_pass(model, reference)``, where given, makes each model's first move onto the reference instead of the
    plan, in this process (it aligns the models themselves, not states: :func:`symgraph.merging.merge` judges its
    candidates on the models' outputs); its elements, on groups of the models' reports, act in the plan's groups.

    Examples
    --------
    >>> import copy, symgraph
    >>> from symgraph import zoo
    >>> model = zoo.build("llama", seed=0)
    >>> a, twin = symgraph.load(model), copy.deepcopy(model)
    >>> _ = twin.load_state_dict(symgraph.transform(a, seed=3))  # same function, other parameters
    >>> result = align_to_consensus([a, symgraph.load(twin)], [0.5, 0.5], progress=False)
    >>> result.distances_before[0] > 0.1 and max(result.distances) < 1e-6
    True
    """
    start = time.perf_counter()
    states = [float64_state(s.state_dict()) for s in subjects]
    names = shared_float_names(states[0], exclude)
    w = np.asarray(weights, dtype=np.float64)
    reference = reference_index(states, w, names) if reference is None else reference
    before = distances_to_mean(states, w, names)
    if mode == "none":
        return Consensus(states, reference, before, before, 0, [_weighted(before, w)], time.perf_counter() - start)

    plan = AlignmentPlan.of(subjects[0], mode, exclude, learner, device=device, dtype=dtype)
    rounds = 0 if learner is not None else rounds
    applied: list[list[Element]] = [[] for _ in states]  # per model, every element applied, in order
    with workers_context(workers, subjects) as runner:
        bar = progress_bar(desc=f"aligning ({mode})", total=len(states) - 1, enabled=progress)
        jobs = (Job(i, states[i], [], states[reference]) for i in _others(len(states), reference))
        moves = (runner.run(plan, jobs) if first_pass is None
                 else _first_moves(plan, first_pass, jobs, reference, runner.seconds))
        for job, elements in moves:
            states[job.index], applied[job.index] = apply(job.state, elements), list(elements)
            bar.update()
        bar.close()
        history = [_weighted(distances_to_mean(states, w, names), w)]
        if len(states) > 2:  # two models: the first pass is the consensus
            states, history = _rounds(
                lambda now: _jacobi_round(plan, runner, now, applied, w, names, reference, progress),
                states, applied, w, names, rounds, tol, history)
        if common:
            states, history = _rounds(lambda now: _common_round(plan, runner, now, applied, w, names, progress),
                                      states, applied, w, names, rounds, tol, history)
    states = [_verified(s, state, moves) for s, state, moves in zip(subjects, states, applied)]
    return Consensus(states, reference, before, distances_to_mean(states, w, names), len(history) - 1, history,
                     time.perf_counter() - start, workers, runner.seconds)


@dataclass(frozen=True)
class AlignmentPlan:
    """How to move one model of an architecture towards a target state dict.

    ``solve`` holds the groups ``mode`` aligns with the excluded parameters' members dropped, ``full`` the
    complete groups by id (elements are applied with every member, so excluded parameters move along and the
    function is kept), and ``free`` the slices the model ignores (plain-softmax key biases), which move but never
    enter a cost, as in :func:`symgraph.api.align`.
    """

    solve: tuple[Group, ...]
    full: dict[str, Group]
    free: tuple
    mode: str
    learner: Callable | None = None  # learner(solve, source, target, result) -> result: learned matching
    device: str = "cpu"  # where each alignment computes (symgraph.alignment.compute_device)
    dtype: str | None = None  # what in: float32 or float64 (None: the states' float64)

    @classmethod
    def of(cls, subject: Subject, mode: str, exclude: frozenset[str] = frozenset(),
           learner: Callable | None = None, device="cpu", dtype=None) -> AlignmentPlan:
        chosen = select_groups(subject.report.groups, mode)
        solve = []
        for g in chosen:
            members = tuple(m for m in g.members if not set(m.params) & exclude)
            if members:
                solve.append(dataclasses.replace(g, members=members))
        free = free_cost_members(subject, solve, mode)
        return cls(tuple(solve), {g.id: g for g in chosen}, tuple(free), mode, learner, device, dtype)

    def elements(self, source: State, target: State) -> list[Element]:
        """The elements, in order, that move ``source`` within its groups as close to ``target`` as they allow
        (same function), tuned by the learner when there is one: each acts with every member of its group,
        excluded parameters included."""
        result = align_states(list(self.solve), source, target, mode=self.mode, cost_excluded=self.free,
                              device=self.device, dtype=self.dtype)
        if self.learner is not None:
            result = self.learner(list(self.solve), source, target, result, self.free)
        return self.owned(result.elements)

    def owned(self, elements: Sequence[Element]) -> list[Element]:
        """``elements`` acting on this plan's complete groups (with every member, excluded parameters included),
        as fresh arrays (an element from elsewhere, e.g. Ray's object store, may hold read-only views)."""
        def fresh(array):
            return None if array is None else np.array(array)
        return [Element(self.full[e.group.id], fresh(e.matrices), fresh(e.perm), fresh(e.diag)) for e in elements]


def merge_order(subjects: Sequence[Subject], weights: Sequence[float], exclude: frozenset[str]) -> list[int]:
    """The subjects' indices, the model whose frame a merge keeps by default first (:func:`reference_index` of their
    states) and the others in the same order after it: an order the argument order never changes."""
    states = [float64_state(s.state_dict()) for s in subjects]
    return _ranked(states, np.asarray(weights, dtype=np.float64), shared_float_names(states[0], exclude))


def reference_index(states: Sequence[State], weights: np.ndarray, names: Sequence[str]) -> int:
    """The model with the largest weight; ties go to the larger sum of squares, never to the argument order."""
    return _ranked(states, weights, names)[0]


def _ranked(states: Sequence[State], weights: np.ndarray, names: Sequence[str]) -> list[int]:
    """Indices by decreasing weight, ties by decreasing sum of squares (a stable sort: equal keys keep their order)."""
    keys = [(float(w), _sum_of_squares(s, names)) for w, s in zip(weights, states)]
    return sorted(range(len(keys)), key=keys.__getitem__, reverse=True)


def weighted_mean(states: Sequence[State], weights: np.ndarray, names: Sequence[str]) -> State:
    """``sum_i w_i state_i / sum_i w_i`` over ``names``, in float64."""
    total = float(np.sum(weights))
    return {k: sum(float(w) * s[k].to(torch.float64) for w, s in zip(weights, states)) / total for k in names}


def distances_to_mean(states: Sequence[State], weights: np.ndarray, names: Sequence[str]) -> list[float]:
    """Each model's relative distance to the weighted mean of all of them."""
    mean = weighted_mean(states, weights, names)
    return [relative_distance(s, mean, names) for s in states]


def shared_float_names(state: State, exclude: frozenset[str]) -> list[str]:
    """Floating-point entries of ``state`` outside ``exclude``: what means and distances run over."""
    return [k for k, v in state.items() if v.is_floating_point() and k not in exclude]


# -- helpers ---------------------------------------------------------------------------------------------------
def _first_moves(plan: AlignmentPlan, first_pass: Callable, jobs, reference: int, seconds: list[float]):
    """``(job, elements)`` for each job, its elements made by ``first_pass(job.index, reference)``; the time of
    each is appended to ``seconds``."""
    for job in jobs:
        clock = time.perf_counter()
        elements = plan.owned(first_pass(job.index, reference))
        seconds.append(time.perf_counter() - clock)
        yield job, elements


def _rounds(propose, states, applied, w, names, rounds, tol, history) -> tuple[list[State], list[float]]:
    """At most ``rounds`` rounds of ``propose(states) -> (candidate, moves)`` while the weighted mean distance to
    the consensus keeps falling (by more than ``tol`` of itself); a round that does not lower it is discarded.
    ``history`` holds the scores so far; ``applied`` (per model, the elements applied so far) is extended in
    place with each kept move."""
    for _ in range(rounds):
        candidate, moves = propose(states)
        score = _weighted(distances_to_mean(candidate, w, names), w)
        if score >= history[-1]:
            break
        states = candidate
        for done, new in zip(applied, moves):
            done.extend(new)
        history = history + [score]
        if score > history[-2] * (1 - tol):
            break
    return states, history


def _jacobi_round(plan: AlignmentPlan, runner, states, applied, w, names, reference, progress
                  ) -> tuple[list[State], list[list[Element]]]:
    """Every model but the reference aligned to the weighted mean of the others (all from the same old states)."""
    def job(i: int) -> Job:
        keep = [j for j in range(len(states)) if j != i]
        return Job(i, states[i], applied[i], weighted_mean([states[j] for j in keep], w[keep], names))

    bar = progress_bar(desc=f"consensus ({plan.mode})", total=len(states) - 1, enabled=progress)
    return _closer_moves(plan, runner, states, map(job, _others(len(states), reference)), names, bar)


def _common_round(plan: AlignmentPlan, runner, states, applied, w, names, progress
                  ) -> tuple[list[State], list[list[Element]]]:
    """Every model, the reference too, aligned to the weighted mean of all of them (a frame no model owns)."""
    target = weighted_mean(states, w, names)
    bar = progress_bar(desc=f"common frame ({plan.mode})", total=len(states), enabled=progress)
    jobs = (Job(i, states[i], applied[i], target) for i in range(len(states)))
    return _closer_moves(plan, runner, states, jobs, names, bar)


def _closer_moves(plan: AlignmentPlan, runner, states, jobs, names, bar) -> tuple[list[State], list[list[Element]]]:
    """Run ``jobs``; the new states (a model moves only where its move brings it closer to its job's target), and
    per model the elements of the move it kept (none if it stayed)."""
    out, moves = list(states), [[] for _ in states]
    for done, elements in runner.run(plan, jobs):
        moved = apply(done.state, elements)
        if relative_distance(moved, done.target, names) < relative_distance(done.state, done.target, names):
            out[done.index], moves[done.index] = moved, elements
        bar.update()
    bar.close()
    return out, moves


def _verified(subject: Subject, state: State, elements: Sequence[Element] = ()) -> State:
    """``state`` with tied names agreeing; raise unless it computes what ``subject`` computes (free outputs:
    after undoing ``elements``, those applied to get ``state``)."""
    from .verify import Evaluator

    state = tie_aliases(subject.model, state)
    outcome = Evaluator.of(subject).check(state, elements, rounding_floor=True)
    if not outcome.ok:
        raise InvarianceError(
            f"Aligning {subject.name} changed its outputs ({outcome.describe()}); nothing was written.",
            hint="run `symgraph fuzz` on the model to find the group at fault and report it as a bug; "
                 "--align none merges without alignment meanwhile.")
    return state


def float64_state(state: State) -> State:
    return {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state.items()}


def _sum_of_squares(state: State, names: Sequence[str]) -> float:
    return sum(float(state[k].pow(2).sum()) for k in names)


def _weighted(values: Sequence[float], w: np.ndarray) -> float:
    return float(np.dot(values, w) / np.sum(w))


def _others(n: int, reference: int) -> list[int]:
    return [i for i in range(n) if i != reference]
