"""Learned matching: tune an alignment on the loss of the interpolated model, not on weight distance.

Both methods start from the start solution (the weight-matched alignment, or any
:class:`~symgraph.alignment.AlignResult` handed in, such as an activation-matched one, applied to the source:
``B'``) and minimise the loss of ``(1 - t) A + t B'`` on batches of training data, at a random ``t`` each step,
drawn from Beta(c, c) (``LearnOptions.t_concentration``: most draws near the midpoint, where barriers peak; 1 is
uniform in [0, 1]), or at one point (``LearnOptions.t``: a merge's), with Adam (cosine-annealed learning rate).

``direct`` (the default): the continuous part of every group (orthogonal maps as exponentials of skew matrices,
general linear maps as exponentials, rotary angles and scales, positive scales as exponentials of log-scales:
:mod:`symgraph.continuous`) is a tensor of parameters, zero at the start; ``B'`` is the start moved by those
elements, exactly in the source's orbit at every step, so the gradient is that of the loss along the orbit.
QK and VO maps are learned in their full group GL(d_head) (``general_linear``). Permutations and signs stay
where the start put them. The result is the start followed by the learned elements, applied in float64.

``ste``: Git Re-Basin's straight-through estimator (Ainsworth et al., ICLR 2023; used for transformers by Theus
et al., NeurIPS 2025), carried over to every group symgraph finds. A *proxy* state ``P`` starts at ``B'``; each
step the source is *projected* onto ``P`` within its groups by the ordinary solvers (Procrustes, Hungarian,
least squares, closed forms), warm-started with a few descent rounds, and the loss of
``(1 - t) A + t (B' + P - stopgrad(P))`` moves ``P``. Its group elements are found by aligning the source to the
projection kept (an exact recovery, as for any reparametrised copy).

Either way the candidate is checked at evenly spaced steps by its mean loss where learning aims
(:func:`checked_points`: ``t`` = 1/4, 1/2, 3/4 for the whole path, that point alone when learning one point, as a
merge does) on a few training batches, held out of the steps with ``LearnOptions.holdout`` (:func:`held_out`),
plus with distillation on mixed inputs (``LearnOptions.mixup``) that term on those batches, mixed alike for every
candidate (the objective the steps descend: :meth:`_Run.checked_loss`); the best one checked is the result, and
only if it is below the start's. A
check worse than the best so far by more than ``LearnOptions.backtrack_margin`` times the path loss learning has
gained (any worse check while nothing is gained), a second check in a row no better than the best (one within the
margin may be the noise of stochastic steps), all before the last step and with the direct method (the estimator's
projections jump, so a worse one is no sign of a step too large), or a step whose loss or parameters stop being
finite, is taken as a step too large: learning goes back to the best point checked, with fresh Adam moments, at
``BACKTRACK`` times the learning rate (*backtracking*, at most ``LearnOptions.backtracks`` times; after that a
worse check is kept going from, and a non-finite step stops the run with a :class:`LearnError`). A step that makes
a map singular (an inverse, solve or SVD fails: with no condition bound and a large learning rate) counts as a
non-finite one. The caller applies the elements in float64 and verifies the function as for every alignment.
With the direct method, the first backtrack to the first check's point (the full rate gained once, then went
wrong) goes back to the start instead: a *trial* of the lower rate from there for one check's steps, after which
learning goes on at the lower rate from whichever point checked lower, the trial's or the full rate's
(``LearnOptions.rate_trial``).
Learning stops early when checks stop finding a better point (``LearnOptions.patience``) or at a time cap
(``LearnOptions.seconds``); the record says why (``LearnRecord.stopped``). Measured on the shipped pairs:
examples/RESULTS.md (remedies) and examples/results/learn.json.

The direct method's learning rate is *width-aware* (``LearnOptions.width_aware``): a generator of side ``n``
steps ``lr * sqrt(64 / n)`` per entry, so the weights move about as far per step at every width
(:meth:`symgraph.continuous.ContinuousElements.learning_rates`); ``lr`` is the step at side 64 (the shipped
LLaMA's width) and of every vector parameter (log-scales, rotary angles).

Examples
--------
>>> LearnOptions(steps=10).checked().steps
10
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .alignment import AlignResult, align_states
from .elements import apply
from .errors import SymgraphError
from .progress import progress_bar
from .solve.kernels import MAX_CONDITION
from .synthetic import LENGTH as SYNTHETIC_LENGTH
from .module_state import copied_module

__all__ = ["LearnError", "LearnOptions", "check_learnable", "held_out", "learn_alignment", "path_loss",
           "training_data"]

State = dict[str, torch.Tensor]
T_CHOICES = ("auto", "midpoint", "random")
METHODS = ("direct", "ste")
CHECKED_T = (0.25, 0.5, 0.75)  # where the path loss of a candidate alignment is checked (learning the whole path)
BACKTRACK = 0.3  # the learning rate after a backtrack, relative to before it
# Classifiers memorise small training sets, and their interpolated model then fits them too (the wide ViT's midpoint:
# 0.002) whatever the alignment, so the task loss stops telling alignments apart; on mixed inputs the endpoints are
# unsure, and their mixed probabilities keep teaching (:class:`_MixedDistillation`). Wide ViT, merged at the
# midpoint, test loss over seeds 0-4: 1.36x the endpoints' mean on average without, 1.03x with weight 1
# (examples/results/wide_merge_seeds.json); vit-digits' path barrier 0.016 against 0.015 over three seeds. Checks
# score the term too (_Run.checked_loss): the task loss they scored alone is the one that stopped telling apart.
MIXUP = 1.0
# Learning the whole path draws t from Beta(c, c): barriers peak inside the path, and its ends are low already.
# Barriers after 1000 steps (test split, seeds 0 / 1; examples/RESULTS.md): c = 1 (uniform) llama-chars 0.478 /
# 0.476, vit-digits 0.062 / 0.062; c = 4 0.424 / 0.420, 0.004 / 0.016; c = 16 0.385 / 0.367, 0.107 / 0.243 (the
# small ViT's barrier then moves off the middle); the midpoint alone 0.503 on llama-chars.
T_CONCENTRATION = 4.0

# Full mode without data ends with a short learned matching on synthetic examples (:func:`symgraph.align`), where
# the judge's examples show the path rising above its ends by more than SHORT_LEARNING_RISE of their loss. Its
# examples are drawn with seed 1, the judge's with seed 0. Where the path rises little, the judge's synthetic
# examples hold little barrier to lower, and learning fits their distribution instead: the wide ViT (rise 0.043 of
# its ends' loss after data-free full alignment) learned there raised its test barrier from 0.622 to 1.560 (0.997
# learning from the activations' alignment) while the judge's path loss fell (2.153 -> 1.799). Where learning
# helps, the path rises far: llama-chars 0.68 (test barrier 1.572 -> 0.716), vit-digits 0.81 (2.878 -> 0.986),
# the wide LLaMA 0.42; random twins and bert-topics below 0.005. The bound sits between, about 3x from
# each side (0.05 until stop 54, just above the wide ViT).
SHORT_LEARNING_CHECKS, SYNTHETIC_LEARNING_EXAMPLES = 2, 256
SYNTHETIC_LEARNING_LENGTH = 64  # tokens per sampled sequence (the judge's have 128)
SHORT_LEARNING_RISE = 0.15
# Its steps: as many as SHORT_LEARNING_ELEMENTS tensor elements written by forward passes over batches of the
# judged examples allow (:func:`short_learning_steps`), within SHORT_LEARNING_STEPS. 50 steps (the default until stop
# 57) left twins the defaults were never measured on far above 0.35x of their unaligned barrier; test barriers with
# 50 / 150 / 300 steps (examples/study_heldout_pairs.py, examples/RESULTS.md): a ViT of width 64 and 4 layers 0.52x /
# 0.38x / 0.24x, a tied GPT-2 0.57x / 0.47x / 0.44x, llama-chars 0.23x / 0.18x / 0.17x, vit-digits 0.30x / 0.28x /
# 0.27x. The budget gives the narrow pairs the 300 steps and the wide LLaMA (a step writes 5x llama-chars') about 70;
# a model at the judge's bound keeps the 50 steps it had, and their cost.
SHORT_LEARNING_STEPS = (50, 300)  # fewest, most
SHORT_LEARNING_ELEMENTS = 1.2e10


def short_learning_steps(per_example: int | None, batch_size: int) -> int:
    """The short learning's steps for a model whose forward pass writes ``per_example`` tensor elements per judged
    example (None: uncountable, the fewest), on batches of ``batch_size``."""
    fewest, most = SHORT_LEARNING_STEPS
    if not per_example:
        return fewest
    return int(min(most, max(fewest, SHORT_LEARNING_ELEMENTS // (per_example * batch_size))))


class LearnError(SymgraphError):
    """Learned matching could not start (nothing in the groups to learn) or finish (the loss, the proxy weights or
    the elements stopped being finite)."""


@dataclass(frozen=True)
class LearnOptions:
    """How the alignment is learned.

    ``steps`` optimiser steps of Adam at learning rate ``lr`` (cosine-annealed to 0) on batches of ``batch_size``
    training examples, the interpolation point ``t`` (``random``, drawn each step from Beta(c, c) with c the
    ``t_concentration``, 1: uniform in [0, 1]; ``midpoint``; a
    number strictly between 0 and 1, that point; ``auto``, the default: in a simple merge of two models the point
    of the path the merged model is, the source's share of the weights, and ``random`` everywhere else,
    :func:`resolved_t`),
    the ``method`` (``direct`` or ``ste``: module docstring), for ``direct`` whether QK/VO maps are learned in
    GL(d_head) (``general_linear``), for ``ste`` the ``project_rounds`` coordinate-descent rounds per
    projection, ``checks`` evenly spaced evaluations of the candidate's path loss on ``eval_batches`` batches of the
    data (the best one, if better than the start, is the result), held out of the steps with ``holdout`` where the
    data has batches enough (:func:`held_out`), and the ``seed`` of batch order
    and ``t``. ``width_aware`` (direct method): ``lr`` is the per-entry step of a generator of side 64, and a
    generator of side ``n`` steps ``lr * sqrt(64 / n)`` (module docstring); False: every parameter steps ``lr``.
    ``backtracks``: how many times a check worse than the best so far by more than ``backtrack_margin`` times the
    path loss gained, a second check in a row no better than the best, or a non-finite step sends learning back to
    the best point checked at ``BACKTRACK`` times the learning rate (0: never; a non-finite step then stops the
    run). The margin lets learning ride out the ups and downs of stochastic steps at full rate: one check a little
    worse than the best is not a step too large (0: every check no better than the best backtracks). Learning ends
    before ``steps`` when the last ``patience`` checks (0: not on this ground) together lowered the best path loss by
    no more than ``tolerance`` times what learning has gained so far, or when ``seconds`` (a time cap; None: none)
    would be passed: with a cap, the learning rate anneals over the steps that fit in it at the time per step so
    far. ``max_condition`` (direct method): the largest condition number a general linear map moving the source
    may reach (QK and VO maps, a rotary group's pass-through block: the start's map and the learned one composed);
    a step beyond it is projected back (:class:`symgraph.continuous.ContinuousElements`; ``math.inf``: no bound;
    the default is the data-free solver's bound). ``mixup``: for classifiers whose inputs are all floating point
    (pixels, audio) on data without soft targets (not synthetic), the weight of a second term of each step's loss:
    each example mixed with another of its batch
    (a share drawn uniformly), the interpolated model taught there the endpoints' probabilities mixed as the path
    mixes them (:class:`_MixedDistillation`; 0: none). ``rate_trial`` (direct method): the first backtrack to the
    first check's point goes back to the start instead, for one check's steps at the lower rate, then on from
    whichever point checked lower (:meth:`_DirectRun.try_lower_rate_from_start`). ``synthetic_examples``: how many
    examples learning on the data SPEC ``synthetic`` makes (:mod:`symgraph.synthetic`). Defaults: measured on the
    shipped pairs and the wide ViT (examples/RESULTS.md), a few minutes per shipped pair on one CPU core.
    """

    steps: int = 1000
    lr: float = 1e-2
    batch_size: int = 32
    t: str | float = "auto"
    project_rounds: int = 2
    eval_batches: int = 4
    checks: int = 10
    seed: int = 0
    method: str = "direct"
    general_linear: bool = True
    width_aware: bool = True
    backtracks: int = 4
    backtrack_margin: float = 0.5
    patience: int = 3
    tolerance: float = 0.0
    seconds: float | None = None
    max_condition: float = MAX_CONDITION
    synthetic_examples: int = 1600
    synthetic_length: int = SYNTHETIC_LENGTH
    t_concentration: float = T_CONCENTRATION
    holdout: bool = False
    mixup: float = MIXUP
    rate_trial: bool = True

    def checked(self) -> LearnOptions:
        """``self``, or a :class:`LearnError` naming the first option out of range."""
        for name in ("steps", "batch_size", "eval_batches", "checks", "synthetic_examples", "synthetic_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LearnError(f"Learning option {name} must be a whole number >= 1, not {value!r}.",
                                 hint=f"e.g. {name}={getattr(LearnOptions, name)} (the default).")
        for name in ("project_rounds", "backtracks", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LearnError(f"Learning option {name} must be a whole number >= 0, not {value!r}.",
                                 hint=f"e.g. {name}={getattr(LearnOptions, name)} (the default).")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise LearnError(f"The learning rate must be a finite number > 0, not {self.lr!r}.",
                             hint=f"e.g. lr={LearnOptions.lr} (the default).")
        if not (isinstance(self.backtrack_margin, (int, float)) and 0 <= self.backtrack_margin < math.inf):
            raise LearnError(f"Learning option backtrack_margin must be a finite number >= 0, not "
                             f"{self.backtrack_margin!r}.",
                             hint=f"e.g. backtrack_margin={LearnOptions.backtrack_margin} (the default: a check "
                                  "worse than the best by more than this fraction of the gain backtracks).")
        if not (isinstance(self.mixup, (int, float)) and not isinstance(self.mixup, bool)
                and 0 <= self.mixup < math.inf):
            raise LearnError(f"Learning option mixup must be a finite number >= 0, not {self.mixup!r}.",
                             hint=f"e.g. mixup={MIXUP:g} (the default; 0: no distillation on mixed inputs).")
        if not (isinstance(self.tolerance, (int, float)) and 0 <= self.tolerance < math.inf):
            raise LearnError(f"Learning option tolerance must be a finite number >= 0, not {self.tolerance!r}.",
                             hint=f"e.g. tolerance={LearnOptions.tolerance} (the default: stop only when a "
                                  "stretch of checks gains nothing).")
        if not (isinstance(self.t_concentration, (int, float)) and not isinstance(self.t_concentration, bool)
                and 0 < self.t_concentration < math.inf):
            raise LearnError(f"Learning option t_concentration must be a finite number > 0, not "
                             f"{self.t_concentration!r}.",
                             hint=f"e.g. t_concentration={T_CONCENTRATION:g} (the default; 1: t uniform in [0, 1]).")
        if self.seconds is not None and not (isinstance(self.seconds, (int, float)) and 0 < self.seconds < math.inf):
            raise LearnError(f"The time cap of learning must be a finite number of seconds > 0, not "
                             f"{self.seconds!r}.", hint="e.g. seconds=300, or None (no time cap, the default).")
        if not (isinstance(self.max_condition, (int, float)) and not isinstance(self.max_condition, bool)
                and self.max_condition >= 1):
            raise LearnError(f"The bound on the condition number of learned maps must be a number >= 1 (inf: none), "
                             f"not {self.max_condition!r}.",
                             hint=f"e.g. max_condition={MAX_CONDITION:g} (the default).")
        for name in ("general_linear", "width_aware", "holdout", "rate_trial"):
            if not isinstance(getattr(self, name), bool):
                raise LearnError(f"Learning option {name} must be True or False, not {getattr(self, name)!r}.")
        if self.method not in METHODS:
            raise LearnError(f"Unknown learning method {self.method!r}.", hint=f"choose one of {', '.join(METHODS)}.")
        if not (self.t in T_CHOICES or is_path_point(self.t)):
            raise LearnError(f"Unknown interpolation point {self.t!r}.",
                             hint=f"choose one of {', '.join(T_CHOICES)}, or a number strictly between 0 and 1.")
        return self


def is_path_point(t) -> bool:
    """Whether ``t`` is a number strictly between 0 and 1, a point learning can aim at (at an end of the path the
    alignment changes nothing)."""
    return isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1


def resolved_t(options: LearnOptions, *, merged_at: float | None = None) -> LearnOptions:
    """``options`` with ``t="auto"`` made concrete: ``merged_at`` where the result is used at that point of the
    path only (a simple merge of two models: the source's share of the weights, 1/2 for equal weights), ``random``
    otherwise (alignment and barriers use the whole path). Measured (examples/RESULTS.md): on the converged wide ViT
    a simple merge after 300 learned steps scores 0.105 learned at the midpoint against 0.216 learned at random
    points; merges of the shipped pairs with weights 1:3 or 2:1 come 3-22% closer to their endpoints' loss learned at
    their point."""
    if options.t != "auto":
        return options
    return replace(options, t="random" if merged_at is None else float(merged_at))


def held_out(batches: Sequence, options: LearnOptions) -> tuple[tuple, tuple, bool]:
    """``(batches stepped on, batches checked, whether those are held out)``: with ``options.holdout``, and where
    at least as many batches stay to step on, ``eval_batches`` batches spread evenly over the data (text is cut in
    order: neighbouring windows are alike) are checked and never stepped on; otherwise the first ``eval_batches``
    are checked and every batch is stepped on. Why: learning fits the batches it steps on far below what the
    interpolated model scores on examples it has not seen (the wide ViT's midpoint: 0.002 on them, 0.07-0.12 on the
    test split). Why not by default: on the shipped pairs 8 held-out batches cost more in training data than they
    gave in choice (test barriers after 1000 steps, without -> with: vit-digits 0.004 -> 0.041, bert-topics 0.000
    -> 0.089, llama-chars 0.424 -> 0.416), and on the wide ViT 256 held-out images are too few to rank candidates
    whose test losses differ by 0.01-0.03 (examples/RESULTS.md)."""
    batches, k = tuple(batches), options.eval_batches
    if not options.holdout or len(batches) < 2 * k:
        return batches, batches[:k], False
    picked = set(np.linspace(0, len(batches) - 1, k).round().astype(int).tolist())
    return (tuple(b for i, b in enumerate(batches) if i not in picked),
            tuple(b for i, b in enumerate(batches) if i in picked), True)


def learned_point(options: LearnOptions) -> float | None:
    """The one point of the path learning aims at (``midpoint``: 1/2; a number: itself), None for the whole path
    (``random``)."""
    if options.t == "random":
        return None
    return 0.5 if options.t == "midpoint" else float(options.t)


def checked_points(options: LearnOptions) -> tuple[float, ...]:
    """Where a candidate is scored: where learning aims. That point alone when it learns one point (a simple
    merge's: checking its neighbours too rejected the midpoint's gains, since they rise as it falls), the interior
    points ``CHECKED_T`` when it learns the whole path. Measured on the wide ViT (examples/RESULTS.md)."""
    point = learned_point(options)
    return CHECKED_T if point is None else (point,)


@dataclass
class LearnRecord:
    """What the optimisation did: the loss per step, the path loss (at :func:`checked_points`, ``checked_t``; with
    ``mixup``, plus that weight times the distillation on the checked batches mixed: :meth:`_Run.checked_loss`) on
    the checked batches (``held_out``: whether learning never stepped on them, :func:`held_out`) at the start, at
    each check and of the result, whether a learned alignment was kept (it
    must beat the start), each backtrack (the step, why, and the learning rate after it: a fraction of
    ``LearnOptions.lr``), the learning rate of each group of parameters at the start (direct method, before the
    cosine schedule), and (direct method) the largest condition number of a general linear map in the result (the
    start's and the learned map composed, as the bound covers them), the bound it was kept within and how many
    times a map (one head's, one step) was projected back within it."""

    losses: list[float] = field(default_factory=list)
    checks: list[float] = field(default_factory=list)
    start_loss: float = math.nan
    end_loss: float = math.nan
    kept: bool = False
    seconds: float = 0.0
    condition: float | None = None  # the largest condition number of a bounded general linear map (direct)
    condition_bound: float | None = None  # LearnOptions.max_condition (direct; None: no bound)
    projections: int = 0  # general linear maps projected back within condition_bound, summed over steps (direct)
    backtracks: list[dict] = field(default_factory=list)
    learning_rates: dict[str, float] = field(default_factory=dict)
    stopped: str | None = None  # why learning ended before the last step (None: it ran them all)
    checked_t: tuple[float, ...] = CHECKED_T  # where the path loss is checked (checked_points)
    held_out: bool = False  # the checked batches were held out of the steps (held_out)
    mixup: float = 0.0  # the weight of distillation on mixed inputs in the steps' loss (0: none; _MixedDistillation)
    rate_trial: dict | None = None  # the trial of the lower rate from the start (direct), when it ran

    def to_json(self) -> dict:
        return {"steps": len(self.losses), "first_loss": self.losses[0] if self.losses else None,
                "last_loss": self.losses[-1] if self.losses else None, "start_path_loss": self.start_loss,
                "checked_path_losses": self.checks, "end_path_loss": self.end_loss, "kept": self.kept,
                "seconds": self.seconds, "largest_condition_number": self.condition,
                "condition_bound": self.condition_bound, "condition_projections": self.projections,
                "backtracks": self.backtracks, "learning_rates": self.learning_rates, "stopped": self.stopped,
                "checked_t": list(self.checked_t), "checked_on_held_out": self.held_out, "mixup": self.mixup,
                "rate_trial": self.rate_trial}


def training_data(spec, model, options: LearnOptions, endpoints: Sequence[State]):
    """The data learning runs on: a SPEC's training split (a ``:split`` suffix on the name wins), a
    :class:`~symgraph.datasets.Dataset` as it is, or for the SPEC ``synthetic``, ``options.synthetic_examples``
    examples made from ``model`` carrying each of ``endpoints`` (the source and anchor states;
    :mod:`symgraph.synthetic`). ``model``: a :class:`symgraph.Subject` or a module."""
    from .datasets import load_data
    from .synthetic import is_synthetic, synthetic_data

    if is_synthetic(spec):
        return synthetic_data(getattr(model, "model", model), endpoints, examples=options.synthetic_examples,
                              batch_size=options.batch_size, seed=options.seed, length=options.synthetic_length)
    return load_data(spec, model=model, batch_size=options.batch_size, split="train")


def written_by(groups) -> frozenset[str]:
    """The names the elements of ``groups`` write. A state they moved holds, of a tie (an embedding that is also
    the LM head), the moved value under the name the graph reads and the old one under its aliases until
    :func:`symgraph.verify.tie_aliases`: what scores such a state must read that name (a GPT-2 read through its
    stale embedding scored 5.1 where it computes 1.7)."""
    return frozenset(p for g in groups for p in g.params)


def path_loss(model: torch.nn.Module, anchor: State, other: State, names: Sequence[str], data,
              batches: int, written: frozenset[str] = frozenset()) -> float:
    """The mean loss of ``(1 - t) anchor + t other`` at ``t`` = 1/4, 1/2, 3/4 on the first ``batches`` batches
    of ``data`` (a :class:`~symgraph.datasets.Dataset`): how learned matching scores its candidates, and how
    alignment on data chooses between its own (lower is better). ``names`` are the entries interpolated;
    ``written``: the names the elements that moved ``other`` write (:func:`written_by`)."""
    return _InterpolatedLoss(model, anchor, names, data.task, written).evaluate(other, data.batches[:batches])


def path_and_end_losses(model: torch.nn.Module, anchor: State, other: State, names: Sequence[str],
                        data, along: float | None = None,
                        written: frozenset[str] = frozenset()) -> tuple[float, float]:
    """The path loss (:func:`path_loss`, every batch of ``data``; ``along``: that loss, measured already) and the
    mean loss of the path's ends (the mean of the straight line between them at ``CHECKED_T``): how far the first
    lies above the second is what learning could lower."""
    loss_at = _InterpolatedLoss(model, anchor, names, data.task, written)
    along = loss_at.evaluate(other, data.batches) if along is None else along
    return along, loss_at.evaluate(other, data.batches, points=(0.0, 1.0))


def check_learnable(groups, options: LearnOptions) -> None:
    """Refuse, before any data is made, groups in which the direct method has nothing to move: it learns the
    continuous parts (rotations, general linear maps, scales), and permutations and signs stay where the start put
    them. The straight-through method moves proxy weights and projects them onto every group: it always runs."""
    from .continuous import has_continuous_part

    if options.method != "direct" or any(map(has_continuous_part, groups)):
        return
    kinds = sorted({g.kind for g in groups})
    raise LearnError(f"Learned matching (direct method) has nothing to learn in the {len(groups)} groups aligned "
                     f"(kinds: {', '.join(kinds) or 'none'}): it moves continuous group elements, and these have "
                     f"none.",
                     hint="align more groups (drop --only or --layers), or learn permutations with --learn-method "
                          "ste.")


def learn_alignment(groups, source: State, anchor: State, start: AlignResult, *, model: torch.nn.Module, data,
                    names: Sequence[str], options: LearnOptions = LearnOptions(), cost_excluded=(),
                    progress: bool = True) -> tuple[AlignResult, LearnRecord]:
    """Learn an alignment of ``source`` to ``anchor`` (state dicts of ``model``'s architecture) within ``groups``,
    starting from ``start`` (see the module docstring). ``names`` are the entries interpolated (the others are
    taken from ``anchor``); ``data`` is a :class:`~symgraph.datasets.Dataset`. Returns the alignment (elements
    acting on ``source``, and the state they give) and a :class:`LearnRecord`. Neither input is modified; a loss
    or proxy that stops being finite is backtracked from (module docstring), and raises :class:`LearnError` once
    ``options.backtracks`` are spent.
    """
    options = resolved_t(options.checked())  # ``auto`` left to here: the whole path
    check_learnable(groups, options)
    clock = time.perf_counter()
    loss_at = _InterpolatedLoss(model, anchor, names, data.task, written_by(groups))
    run = (_DirectRun(groups, start, loss_at, data, options) if options.method == "direct" else
           _SteRun(groups, start.state, loss_at, data, options, cost_excluded))
    bar = progress_bar(range(options.steps), desc="learning the alignment", enabled=progress)
    for step in bar:
        run.fit_horizon(step, time.perf_counter() - clock)
        check = run.check_due(step)
        run.guarded_step(step, check)
        bar.set_postfix(loss=f"{run.record.losses[-1]:.4f}",
                        best=f"{run.record.end_loss:.4f}", lr=f"{run.lr_factor * options.lr:.2g}",
                        backtracks=len(run.record.backtracks))
        if run.stopped or step + 1 >= run.horizon:
            break
    bar.close()
    record = run.record
    record.stopped = run.stopped
    record.kept = run.best is not start.state
    if record.kept and options.method == "direct":
        result = _composed(start, run.best_elements, source, anchor)
        record.condition = run.elements.condition(run.best_elements)
    elif record.kept:
        result = _recovered(groups, source, anchor, run.best, cost_excluded)
    else:
        result = start
    record.seconds = time.perf_counter() - clock
    return result, record


class _Run:
    """What both methods share: Adam (cosine-annealed, one learning rate per tensor of ``parameters``) on the
    batch and ``t`` of each step, the evenly spaced checks on the probe batches, the best state checked (the
    result), and backtracking to it (module docstring). A method supplies ``step``, ``finite``, ``restore``,
    ``what_moves`` and ``backtrack_when_worse``, and may add a ``remedy`` to the advice of a run that stops."""

    remedy = ""  # what to try, besides a lower learning rate, when learning stops on a step too large

    def try_lower_rate_from_start(self, step: int) -> bool:
        """At a backtrack on a worse check: a method may go back to the start instead of the best point (True;
        :meth:`_DirectRun.try_lower_rate_from_start`)."""
        return False

    def trial_ended(self, checked: float, better: bool) -> bool:
        """At a check: True when it ended a trial of the lower rate, which then decided where learning goes on."""
        return False

    def __init__(self, start: State, loss_at: "_InterpolatedLoss", data, options: LearnOptions, parameters,
                 learning_rates: Sequence[float]):
        self.loss_at, self.options = loss_at, options
        self.rng = np.random.default_rng(options.seed)
        self.origin = self.current = self.best = start
        self.parameters, self.learning_rates, self.lr_factor = list(parameters), list(learning_rates), 1.0
        self.optimiser = self._adam()
        self.stepped, self.probe, held = held_out(data.batches, options)
        self.point, self.checked_t = learned_point(options), checked_points(options)
        self.check_every = max(1, options.steps // options.checks)
        self.horizon = options.steps  # the steps the cosine schedule anneals over (fewer with a time cap)
        self.stopped: str | None = None  # why learning ended before options.steps (no progress, time cap)
        self.best_at_checks: list[float] = []  # the best path loss so far, after each check
        self.forgiven = False  # the last check was no better than the best, within the backtracking margin
        self.distill = _MixedDistillation.of(loss_at, data, options)
        self.record = LearnRecord(checked_t=self.checked_t, held_out=held, mixup=options.mixup if self.distill else 0.0)
        self.record.start_loss = self.checked_loss(start)
        if not math.isfinite(self.record.start_loss):
            raise LearnError(f"The path loss of the start is {self.record.start_loss} on the "
                             f"{len(self.probe)} checked training batches; nothing was written.",
                             hint="check that the data gives finite losses on both models.")
        self.record.end_loss = self.record.start_loss

    def _adam(self) -> torch.optim.Adam:
        return torch.optim.Adam([{"params": [p], "lr": lr} for p, lr in zip(self.parameters, self.learning_rates)])

    def guarded_step(self, step: int, check: bool) -> None:
        """``self.step``; a map that became singular on the way (a ``LinAlgError`` from an inverse, a solve or an
        SVD: in the forward pass, the check or a projection) is a step too large, as a non-finite one is."""
        try:
            self.step(step, check)
        except (torch.linalg.LinAlgError, np.linalg.LinAlgError) as error:
            if len(self.record.losses) == step:  # it failed before its loss was known
                self.record.losses.append(math.nan)
            self.backtrack(step, f"a learned map became singular ({str(error).split(':')[0]})")

    def sample(self):
        """This step's interpolation point and training batch."""
        c = self.options.t_concentration
        t = self.point if self.point is not None else float(self.rng.beta(c, c))
        return t, self.stepped[int(self.rng.integers(len(self.stepped)))]

    def step_loss(self, other: State, t: float, batch) -> torch.Tensor:
        """The loss a step descends: the interpolated model's task loss on ``batch``, plus with distillation
        (``options.mixup``) that on mixed inputs."""
        loss = self.loss_at(other, t, batch)
        return loss if self.distill is None else loss + self.options.mixup * self.distill(other, t, batch)

    def checked_loss(self, state: State) -> float:
        """What a check scores: the path loss on the probe batches, plus with distillation that on the probe
        batches mixed the same way for every candidate (:meth:`_MixedDistillation.evaluate`): the objective the
        steps descend, where the task loss alone is spent once the training examples are fitted."""
        loss = self.loss_at.evaluate(state, self.probe, self.checked_t)
        if self.distill is None:
            return loss
        return loss + self.options.mixup * self.distill.evaluate(state, self.probe, self.checked_t)

    def descend(self, loss: torch.Tensor, step: int) -> bool:
        """One Adam step at this step's learning rates (cosine-annealed from the start's, times the backtracking
        factor); False, after backtracking, when the loss or the parameters stopped being finite."""
        self.record.losses.append(float(loss.detach()))
        if not torch.isfinite(loss):
            self.backtrack(step, f"the loss is {float(loss.detach())}")
            return False
        cosine = 0.5 * (1 + math.cos(math.pi * min(step / self.horizon, 1.0)))
        for group, lr in zip(self.optimiser.param_groups, self.learning_rates):
            group["lr"] = lr * self.lr_factor * cosine
        self.optimiser.zero_grad()
        loss.backward()
        self.optimiser.step()
        if not self.finite():
            self.backtrack(step, f"{self.what_moves} are not finite")
            return False
        return True

    def check_due(self, step: int) -> bool:
        return (step + 1) % self.check_every == 0 or step + 1 >= self.horizon

    def fit_horizon(self, step: int, seconds: float) -> None:
        """With a time cap, before ``step``: the horizon becomes the steps that fit in the cap at the mean time per
        step so far (at least this one), so the cosine schedule still anneals to its end."""
        cap = self.options.seconds
        if cap is None or step == 0:
            return
        fit = step + int(max(cap - seconds, 0.0) / (seconds / step))
        self.horizon = max(step + 1, min(self.options.steps, fit))
        if self.horizon < self.options.steps and step + 1 == self.horizon:
            self.stopped = f"the time cap of {cap:g} s"

    def stalled(self) -> None:
        """Stop (``self.stopped``) when the last ``patience`` checks together lowered the best path loss by no more
        than ``tolerance`` times what learning has gained so far."""
        best, patience = self.best_at_checks, self.options.patience
        if patience and len(best) > patience:
            recent, gained = best[-1 - patience] - best[-1], self.record.start_loss - best[-1]
            if recent <= self.options.tolerance * gained:
                self.stopped = (f"the last {patience} checks found no lower path loss" if recent <= 0 else
                                f"the last {patience} checks lowered the path loss by {recent:.3g}, no more than "
                                f"{self.options.tolerance:g} of the {gained:.3g} gained")

    def checked_better(self, state: State, step: int) -> bool:
        """Check ``state`` on the probe batches; True (and kept as the best) if it beats every state checked, else
        backtrack when it is a step too large (module docstring); stop when learning has stalled."""
        checked = self.checked_loss(state)
        self.record.checks.append(checked)
        best, forgiven, self.forgiven = self.record.end_loss, self.forgiven, False
        better = checked < best
        if better:
            self.best, self.record.end_loss = state, checked
        self.best_at_checks.append(self.record.end_loss)
        self.stalled()
        if self.trial_ended(checked, better) or better:
            return better
        if not math.isfinite(checked):
            self.backtrack(step, f"the checked path loss is {checked}")
        elif self.backtrack_when_worse and step + 1 < self.horizon:  # after the last step the best is the result
            gained, margin = self.record.start_loss - best, self.options.backtrack_margin
            if gained <= 0:
                self.backtrack(step, "no better than the best checked", finite=True)
            elif checked - best > margin * gained:
                self.backtrack(step, f"worse than the best checked by {checked - best:.3g}, more than {margin:g} "
                                     f"of the {gained:.3g} gained", finite=True)
            elif forgiven:
                self.backtrack(step, "no better than the best checked, twice in a row", finite=True)
            else:  # one check a little worse may be the noise of stochastic steps
                self.forgiven = True
        return False

    def backtrack(self, step: int, why: str, *, finite: bool = False) -> None:
        """Back to the best point checked with fresh moments at ``BACKTRACK`` times the learning rate; once
        ``options.backtracks`` are spent, go on from here (from a point that is not ``finite``: stop with a
        :class:`LearnError`)."""
        if len(self.record.backtracks) >= self.options.backtracks:
            if finite:
                return
            raise LearnError(f"Learned matching stopped at step {step + 1}: {why}"
                             f"{self._after_backtracks()}; nothing was written.",
                             hint=f"lower the learning rate (--learn-lr){self.remedy}, and check that the data "
                                  "gives finite losses on both models.")
        self.lr_factor *= BACKTRACK
        if not (finite and self.try_lower_rate_from_start(step)):
            self.restart()
        self.record.backtracks.append({"step": step + 1, "why": why, "lr_factor": self.lr_factor})

    def restart(self, at_start: bool = False) -> None:
        """Fresh Adam moments at the best point (a backtrack, or the end of a trial the lower rate lost), or with
        ``at_start`` at the start (the beginning of a trial of the lower rate)."""
        self.restore(at_start)
        self.optimiser = self._adam()

    def _after_backtracks(self) -> str:
        n = len(self.record.backtracks)
        return f" (after {n} backtrack{'s' * (n != 1)} to lower learning rates)" if n else ""


class _SteRun(_Run):
    """The straight-through estimator: the proxy and its optimiser, the current projection, the best one checked."""

    what_moves = "the proxy weights"
    backtrack_when_worse = False  # the projection checked jumps between orbit points: worse is not a step too large

    def __init__(self, groups, start: State, loss_at: "_InterpolatedLoss", data, options: LearnOptions,
                 cost_excluded):
        self.groups, self.cost_excluded = groups, cost_excluded
        self.proxy = {k: start[k].detach().to(torch.float32).clone().requires_grad_(True) for k in loss_at.names}
        super().__init__(start, loss_at, data, options, list(self.proxy.values()), [options.lr] * len(self.proxy))

    def step(self, step: int, check: bool) -> None:
        """Project, take the straight-through loss on one batch, move the proxy; check the projection now and
        then (the best one checked is the result)."""
        target = {**self.current, **{k: p.detach().to(self.current[k].dtype) for k, p in self.proxy.items()}}
        self.current = align_states(self.groups, self.current, target, rounds=self.options.project_rounds,
                                    matching_start=False, cost_excluded=self.cost_excluded).state
        t, batch = self.sample()
        loss = self.step_loss(_straight_through(self.current, self.proxy), t, batch)
        if self.descend(loss, step) and check:
            self.checked_better(self.current, step)

    def finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.proxy.values())

    @torch.no_grad()
    def restore(self, at_start: bool = False) -> None:
        """The proxy and the projection back at the best point checked, or at the start."""
        point = self.origin if at_start else self.best
        for k, p in self.proxy.items():
            p.copy_(point[k].to(p.dtype))
        self.current = point


class _DirectRun(_Run):
    """The direct method: Adam on the continuous group elements (:class:`symgraph.continuous.ContinuousElements`)
    applied on top of the start; the forward pass runs through the exactly transformed start, so the gradient is
    that of the interpolated loss along the orbit. Permutations and signs stay where the start put them."""

    what_moves = "the group elements' parameters"
    backtrack_when_worse = True

    @property
    def remedy(self) -> str:
        return "" if math.isfinite(self.options.max_condition) else (
            f", or keep learned maps within a condition bound (--learn-max-condition, {MAX_CONDITION:g} by default)")

    def __init__(self, groups, start: AlignResult, loss_at: "_InterpolatedLoss", data, options: LearnOptions):
        from .alignment import general_linear_heads
        from .continuous import ContinuousElements

        self.start = {k: v.detach().to(torch.float32) if v.is_floating_point() else v for k, v in start.state.items()}
        self.elements = ContinuousElements(general_linear_heads(groups) if options.general_linear else groups,
                                           max_condition=options.max_condition, after=start.elements)
        self.best_elements, self.best_values = self.elements.exact(), self.elements.values()
        self.start_values = self.best_values  # the start: where a trial of the lower rate begins
        self.trial: dict | None = None  # while the lower rate is tried: its record so far (LearnRecord.rate_trial)
        rates = (self.elements.learning_rates(options.lr) if options.width_aware
                 else [options.lr] * len(self.elements.parameters))
        super().__init__(start.state, loss_at, data, options, self.elements.parameters, rates)
        self.record.learning_rates = {g.id: lr for g, lr in zip(self.elements.groups, rates)}
        self.record.condition_bound = options.max_condition if math.isfinite(options.max_condition) else None

    def step(self, step: int, check: bool) -> None:
        """One Adam step on the interpolated loss of one batch; check the elements now and then (the best one
        checked is the result)."""
        t, batch = self.sample()
        loss = self.step_loss(_moved(self.start, self.elements.elements()), t, batch)
        if not self.descend(loss, step):
            return
        self.record.projections += self.elements.absorb()
        if check:
            exact = self.elements.exact()
            self.current = apply(self.start, exact, dtype=torch.float64)
            if self.checked_better(self.current, step):
                self.best_elements, self.best_values = exact, self.elements.values()

    def finite(self) -> bool:
        return self.elements.finite()

    def try_lower_rate_from_start(self, step: int) -> bool:
        """The trial of the lower rate (``LearnOptions.rate_trial``), at the first backtrack when the best point is
        the first check's (the full rate gained once, then went wrong): learning goes back to the start, not to
        that point, with fresh moments at the lowered rate, which the first backtrack has set; the point stays the
        best checked, so the trial's check (:meth:`trial_ended`) keeps whichever is lower. Why: a rate too large
        for a model can still beat the start at the first check, from a point worse than a smaller rate reaches
        from the start, and backtracking returns to that point (the wide ViT's merge, seeds 0 and 4: 1.16x and
        1.26x the endpoints' test loss at rate 0.01, 0.84x and 0.77x at 0.003: examples/RESULTS.md, the wide
        pairs' notes). Pairs where the full rate keeps gaining past its first check never backtrack there and
        keep it."""
        checks, options = self.best_at_checks, self.options
        first_point_best = checks[0] == self.record.end_loss < self.record.start_loss
        if not (options.rate_trial and not self.record.backtracks and first_point_best
                and step + 1 + self.check_every < self.horizon):
            return False
        self.trial = {"steps": [step + 1], "rates": [options.lr, self.lr_factor * options.lr],
                      "checked": [self.record.end_loss]}
        self.restart(at_start=True)
        self.forgiven = False
        return True

    def trial_ended(self, checked: float, better: bool) -> bool:
        """The trial's check: it records the trial (``LearnRecord.rate_trial``: the steps it began and ended at,
        the two rates, the full rate's best check and the trial's, and the rate whose point learning goes on
        from) and, when the trial checked no lower, goes back to the full rate's point (at the lower rate, fresh
        moments: the backtrack the trial stood in for)."""
        if self.trial is None:
            return False
        trial, self.trial = self.trial, None
        trial["steps"].append(len(self.record.losses))
        trial["checked"].append(checked)
        trial["kept"] = trial["rates"][1] if better else trial["rates"][0]
        self.record.rate_trial = trial
        if not better:
            self.restart()
        return True

    def restore(self, at_start: bool = False) -> None:
        """The elements back at the best point checked, or at the start (all zero)."""
        self.elements.load(self.start_values if at_start else self.best_values)


class _InterpolatedLoss:
    """The loss of ``(1 - t) anchor + t other`` on a batch, differentiable in ``other`` (torch.func.functional_call
    on a private copy of the model; the anchor's entries outside ``names`` are used as they are). ``written``: the
    names group elements write, so that of tied names the one they moved is the one passed (:func:`written_by`)."""

    def __init__(self, model: torch.nn.Module, anchor: State, names: Sequence[str], task: str,
                 written: frozenset[str] = frozenset()):
        from .verify import tied_copies

        self.module = _Functional(copied_module(model).eval())
        self.anchor, self.names, self.task = anchor, list(names), task
        # tied names share one tensor in the module: passing one of them is enough, the one the elements moved
        self.skip = tied_copies(model, written)

    def __call__(self, other: State, t: float, batch) -> torch.Tensor:
        from .datasets import batch_loss

        return batch_loss(self.at(other, t), batch, self.task)

    def logits(self, other: State, t: float, batch) -> torch.Tensor:
        from .datasets import batch_logits

        return batch_logits(self.at(other, t), batch)

    def at(self, other: State, t: float) -> "_Functional":
        """The module, computing ``(1 - t) anchor + t other``."""
        state = {k: v for k, v in self.anchor.items() if k not in self.skip}
        for k in self.names:
            if k not in self.skip:
                state[k] = (1 - t) * self.anchor[k].to(torch.float32) + t * other[k].to(torch.float32)
        self.module.state = state
        return self.module

    @torch.no_grad()
    def evaluate(self, other: State, batches, points: Sequence[float] = CHECKED_T) -> float:
        """Mean loss over ``batches`` at the interpolation ``points`` (by default the interior points
        ``CHECKED_T``, for a whole path: a midpoint alone is the wrong target there, as learning at t = 1/2 only
        lowers the midpoint and raises its neighbours)."""
        return float(np.mean([float(self(other, t, b)) for t in points for b in batches]))


def mixes_inputs(data) -> bool:
    """Whether learning on ``data`` distils the endpoints on mixed inputs (:class:`_MixedDistillation`, with
    ``LearnOptions.mixup`` > 0): a classifier whose inputs are all floating point (token ids cannot be mixed), on
    data without soft targets of its own."""
    return data.task == "classification" and all(
        b.targets is None and all(v.is_floating_point() for v in b.inputs.values()) for b in data.batches)


class _MixedDistillation:
    """Distillation on mixed inputs (mixup, Zhang et al., ICLR 2018, used here without labels): each example of a
    batch mixed with another of the same batch, ``lam x + (1 - lam) x'`` with ``lam`` uniform in [0, 1] per example,
    and the cross-entropy of the model at ``t`` against ``(1 - t) p_A + t p_B`` there, the endpoints' probabilities
    (``B`` computes the source's function wherever it lies in its orbit). The endpoints have not memorised these
    inputs, so the term keeps teaching after the task loss on the training examples is spent (:data:`MIXUP`)."""

    def __init__(self, loss_at: "_InterpolatedLoss", seed: int):
        self.loss_at, self.seed = loss_at, seed
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def of(cls, loss_at: "_InterpolatedLoss", data, options: LearnOptions) -> "_MixedDistillation | None":
        """The distillation ``options.mixup`` asks for, where it applies: a classifier whose inputs are all
        floating point (token ids cannot be mixed), on data without soft targets (synthetic data,
        :mod:`symgraph.synthetic`, is the endpoints' own distillation already); else None."""
        return cls(loss_at, options.seed) if options.mixup > 0 and mixes_inputs(data) else None

    def __call__(self, other: State, t: float, batch, generator: torch.Generator | None = None) -> torch.Tensor:
        """The term on ``batch`` mixed by ``generator`` (by default the run's, a new mix each step)."""
        from .datasets import Batch

        generator = self.generator if generator is None else generator
        size = next(iter(batch.inputs.values())).shape[0]
        share = torch.rand(size, generator=generator)
        partner = torch.randperm(size, generator=generator)
        mixed = Batch({k: _mixed(v, share, partner) for k, v in batch.inputs.items()})
        with torch.no_grad():
            target = ((1 - t) * self.loss_at.logits(other, 0.0, mixed).softmax(-1)
                      + t * self.loss_at.logits(other, 1.0, mixed).softmax(-1))
        return -(target * self.loss_at.logits(other, t, mixed).log_softmax(-1)).sum(-1).mean()

    @torch.no_grad()
    def evaluate(self, other: State, batches, points: Sequence[float]) -> float:
        """The mean term over ``batches`` at ``points``, each batch mixed as at every other call (a generator
        seeded afresh per batch), so that checks compare candidates on the same inputs."""
        return float(np.mean([float(self(other, t, b, torch.Generator().manual_seed(self.seed + 1 + i)))
                              for t in points for i, b in enumerate(batches)]))


def _mixed(x: torch.Tensor, share: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` mixed with row ``partner`` at ``share`` of its own."""
    share = share.to(x.dtype).reshape(-1, *[1] * (x.dim() - 1))
    return share * x + (1 - share) * x[partner]


class _Functional(torch.nn.Module):
    """``model`` run with the state dict in ``self.state`` (so :func:`symgraph.datasets.batch_loss` can call it)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.config = getattr(model, "config", None)
        self.state: State = {}

    def forward(self, **inputs):
        return torch.func.functional_call(self.model, self.state, (), inputs, strict=False)


def _moved(start: State, elements) -> State:
    """``start`` moved by ``elements`` (differentiable in them)."""
    return apply(start, elements, dtype=torch.float32)


def _straight_through(projected: State, proxy: State) -> State:
    """Forward values of ``projected``, gradients to ``proxy``."""
    return {k: projected[k].to(p.dtype) + p - p.detach() for k, p in proxy.items()}


def _composed(start: AlignResult, learned: list, source: State, anchor: State) -> AlignResult:
    """``start`` followed by the learned elements, applied in float64 to the start's state."""
    from .alignment import relative_distance

    state = apply(start.state, learned, dtype=torch.float64)
    return replace(start, state=state, elements=start.elements + learned,
                   distance_before=relative_distance(source, anchor), distance_after=relative_distance(state, anchor),
                   start="learned", path_loss=None)  # the start's loss is not the learned state's


def _recovered(groups, source: State, anchor: State, learned: State, cost_excluded) -> AlignResult:
    """The learned point as elements acting on ``source``: the source aligned to its own reparametrisation
    (exact recovery), with distances measured to ``anchor``."""
    from .alignment import relative_distance

    result = align_states(groups, source, learned, matching_start=False, cost_excluded=cost_excluded)
    result.distance_before = relative_distance(source, anchor)
    result.distance_after = relative_distance(result.state, anchor)
    result.start = "learned"
    return result

