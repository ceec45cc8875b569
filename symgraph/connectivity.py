"""Loss barriers along the linear path between two models, without and with each kind of alignment.

For each alignment mode, ``B'`` is B aligned to A (same function as B), and the loss is measured at
``theta(t) = (1 - t) A + t B'`` for evenly spaced ``t`` in [0, 1]. The barrier height is how far the loss rises
above the straight line between the end points, ``max_t [L(t) - ((1 - t) L(0) + t L(1))]``; for accuracy it is
how far accuracy falls below that line. A low barrier after alignment says the models sit in one basin once
their symmetries are undone: the precondition for merging them by averaging.

Examples
--------
>>> barrier_height([0.0, 0.5, 1.0], [1.0, 3.0, 2.0])
1.5
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .api import Subject, align, folded_pair, load
from .alignment import relative_distance
from .activations import DATA_MODE
from .consensus import ALIGN_MODES, shared_float_names
from .errors import OutputError, SymgraphError
from .progress import progress_bar
from .module_state import copied_module

LEARNED = "+learn"  # suffix of a learned mode: the base mode's alignment, then learned matching
BARRIER_MODES = (*ALIGN_MODES[::-1], DATA_MODE,
                 *(m + LEARNED for m in (*ALIGN_MODES[::-1], DATA_MODE) if m != "none"))

__all__ = ["BARRIER_MODES", "BarrierCurve", "BarrierResult", "barrier", "barrier_figure", "barrier_height", "check_plot_path",
           "plot_barrier"]

State = dict[str, torch.Tensor]


@dataclass
class BarrierCurve:
    """Loss (and accuracy) along the path for one alignment mode, the barrier heights, and ``||B' - A|| / ||A||``."""

    mode: str
    losses: list[float]
    accuracies: list[float] | None
    loss_barrier: float
    accuracy_barrier: float | None
    distance: float
    align_seconds: float
    alignment: dict = field(default_factory=dict)  # how the alignment was reached (alignment_summary)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def alignment_summary(result) -> dict:
    """What a barrier's JSON keeps of an :class:`~symgraph.alignment.AlignResult`: the descent start kept, the
    residual group, the candidates' path losses and which cost each group took (with data), the learning record
    (with learning)."""
    if result is None:
        return {}
    return {"start": result.start, "distance_before": result.distance_before,
            **({"residual_group": result.residual} if result.residual else {}),
            **({"path_losses": result.path_losses} if result.path_losses else {}),
            **({"costs": {c: list(result.costs.values()).count(c) for c in dict.fromkeys(result.costs.values())},
                "cost_data": result.cost_data, "judged_on": result.judged_on} if result.costs else {}),
            **({"learned": result.learned} if result.learned else {})}


@dataclass
class BarrierResult:
    """Barrier curves by alignment mode, on one dataset, at the interpolation points ``ts``."""

    models: tuple[str, str]
    data: str
    task: str
    ts: list[float]
    curves: dict[str, BarrierCurve]
    seconds: float = 0.0
    fold_note: str = ""  # fold None, not folded after all: why (the norms cannot be folded); or the ties undone

    def to_json(self) -> dict:
        return {"models": list(self.models), "data": self.data, "task": self.task, "ts": self.ts,
                "seconds": self.seconds, "modes": {m: c.to_json() for m, c in self.curves.items()},
                **({"fold_note": self.fold_note} if self.fold_note else {})}

    def plot(self, path) -> Path:
        """Write the figure (format from the suffix: png, pdf, svg, ...); see :func:`plot_barrier`."""
        return plot_barrier(self, path)


def barrier(a: Any, b: Any, data: Any, *, steps: int = 21, aligns: Sequence[str] = ALIGN_MODES[::-1],
            batch_size: int = 32, limit: int | None = None, split: str = "test",
            align_options: Mapping[str, Any] | None = None, fold: bool | None = None, untie: bool | None = None,
            learn: Any = None, learn_data: Any = None, progress: bool = True, device="cpu",
            dtype=None) -> BarrierResult:
    """Measure the loss barrier between ``a`` and ``b`` for each alignment mode in ``aligns``.

    Parameters
    ----------
    a, b
        Models of one architecture (anything :func:`symgraph.load` accepts).
    data
        A data SPEC or :class:`symgraph.datasets.Dataset` (see :func:`symgraph.datasets.load_data`).
    steps
        Points on the path, end points included (at least 3).
    aligns
        Alignment modes, from ``none``, ``permutation``, ``paper``, ``full``; ``full+data``: full mode with
        activation costs (:mod:`symgraph.activations`) on the train split of ``data`` (or on ``align_data``); and
        the learned ones ``full+learn``, ``permutation+learn``, ``paper+learn``, ``full+data+learn``: that mode's
        alignment (weight-matched, or activation-matched for ``full+data+learn``) tuned on the loss of the
        interpolated model on the training split of ``data`` (``full+data+learn``: of the alignment data)
        (:mod:`symgraph.learn`).
    batch_size, limit, split
        How a data SPEC is loaded.
    align_options
        Passed to every :func:`symgraph.align` call: ``only``, ``rescale``, ``layers``, ``refine_rounds``,
        ``tolerance``, ``matching_start``, ``judge_starts``, ``synthetic_activations``, ``short_learning``,
        ``general_linear``, ``balance`` (the ablations, the descent's length, the choice of start, full mode's
        alignment on activations of synthetic examples, its short learning (without data on synthetic examples,
        in ``full+data`` on the alignment data's other batches, and synthetic ones for token data), GL heads, costs
        in units of each tensor's scale),
        and to ``full+data`` ``align_data`` (default: the ``data`` SPEC, train split), ``data_batches``,
        ``data_batch_size`` and ``data_groups``.
    fold
        Fold both models first (:func:`symgraph.fold`): the path then runs between the folded models (the same
        functions at its ends), and every mode aligns within the folded model's groups. ``None``: where it pays
        off (:func:`symgraph.fold.pays_off`); the models' names then end in "(folded)". Models whose norms cannot
        be folded after all are compared unfolded, and ``result.fold_note`` says why.
    untie
        Where folding, give tied weights tensors of their own first (:func:`symgraph.fold.untied`): where the tie
        keeps a norm from folding (None, the default; ``result.fold_note`` then says so), always (True), never
        (False: tied models are compared unfolded).
    learn
        The :class:`symgraph.learn.LearnOptions` of the learned modes (None: the defaults). ``limit`` and
        ``split`` apply to the evaluation only.
    learn_data
        What the learned modes learn on (its training split, for a SPEC); default ``data``. Pass the SPEC here
        when ``data`` is an evaluation :class:`~symgraph.datasets.Dataset`, which would be learned on as it is.
    progress
        Show progress bars (only ever on a terminal).
    device, dtype
        Where and in what every alignment computes (``cpu``, the default, ``cuda`` or ``cuda:N``; ``float32`` or
        ``float64``): :func:`symgraph.alignment.align_states`. The path is evaluated on the CPU. A device this
        machine lacks, or another dtype, is refused before any model is read.

    Examples
    --------
    >>> from symgraph import zoo
    >>> from symgraph.datasets import load_data
    >>> data = load_data("digits", limit=8)
    >>> a, b = (zoo.build("vit", seed=s, image_size=8, num_channels=1, num_labels=10) for s in (0, 1))
    >>> result = barrier(a, b, data, steps=3, aligns=("none", "full"), progress=False)
    >>> result.curves["full"].distance < result.curves["none"].distance
    True
    """
    _check_options(steps, aligns, align_options or {})
    start = time.perf_counter()
    from .alignment import check_same_architecture, compute_device, compute_dtype
    from .datasets import load_data

    compute = {"device": compute_device(device), "dtype": compute_dtype(dtype)}

    first, second = load(a), load(b)
    dataset = load_data(data, model=first, batch_size=batch_size, limit=limit, split=split)
    options = _with_alignment_data({**(align_options or {}), **compute}, aligns, data, first)
    second, first, _, fold_note = folded_pair(second, first, fold, check_same_architecture, untie)  # after the data
    ts = np.linspace(0.0, 1.0, steps).tolist()
    path = _Path(first, dataset, ts, progress)
    learning = {"data": data if learn_data is None else learn_data, "learn": learn or True, "progress": progress}
    curves = {mode: _curve(mode, first, second, path, options, learning) for mode in aligns}
    return BarrierResult((first.name, second.name), dataset.name, dataset.task, ts, curves,
                         time.perf_counter() - start, fold_note)


def barrier_height(ts: Sequence[float], values: Sequence[float]) -> float:
    """``max_t [v(t) - ((1 - t) v(0) + t v(1))]``: how far ``values`` rise above the chord between the ends.

    Examples
    --------
    >>> barrier_height([0.0, 0.5, 1.0], [2.0, 1.0, 2.0])  # convex: no barrier
    0.0
    """
    t, v = np.asarray(ts, dtype=np.float64), np.asarray(values, dtype=np.float64)
    return float(np.max(v - ((1 - t) * v[0] + t * v[-1])))


def plot_barrier(result: BarrierResult, path) -> Path:
    """Plot loss (and accuracy, when the data has labels) along the path, one line per alignment mode, with the
    barrier heights in the legend; write it atomically (temporary sibling, then rename).

    Examples
    --------
    >>> import tempfile
    >>> curve = BarrierCurve("none", [1.0, 2.0, 1.0], None, 1.0, None, 0.5, 0.0)
    >>> result = BarrierResult(("a", "b"), "toy", "causal_lm", [0.0, 0.5, 1.0], {"none": curve})
    >>> plot_barrier(result, Path(tempfile.mkdtemp()) / "barrier.png").name
    'barrier.png'
    """
    return _save_figure(barrier_figure(result), Path(path))


def barrier_figure(result: BarrierResult):
    """The figure :func:`plot_barrier` writes: a matplotlib ``Figure`` (Agg canvas, no pyplot state).

    Examples
    --------
    >>> curve = BarrierCurve("none", [1.0, 2.0, 1.0], None, 1.0, None, 0.5, 0.0)
    >>> figure = barrier_figure(BarrierResult(("a", "b"), "toy", "causal_lm", [0.0, 0.5, 1.0], {"none": curve}))
    >>> figure.axes[0].get_ylabel()
    'cross-entropy loss (nats per predicted token)'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with_accuracy = all(c.accuracies is not None for c in result.curves.values())
    figure = Figure(figsize=(11 if with_accuracy else 6, 5.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2 if with_accuracy else 1, squeeze=False)[0]
    _draw(axes[0], result, "losses", "loss_barrier", "barrier")
    if with_accuracy:
        _draw(axes[1], result, "accuracies", "accuracy_barrier", "drop")
    figure.suptitle(f"A: {result.models[0]}    B: {result.models[1]}    data: {result.data}", fontsize=10)
    return figure


# -- the path --------------------------------------------------------------------------------------------------------
class _Path:
    """Evaluates ``(1 - t) A + t B'`` on the data in one working copy of A's model; ``t = 0`` is evaluated once."""

    def __init__(self, anchor: Subject, data, ts: list[float], progress: bool):
        self.model = copied_module(anchor.model).eval()
        self.anchor = anchor.state_dict()
        self.names = shared_float_names(self.anchor, frozenset())
        self.data, self.ts, self.progress = data, ts, progress
        self.start = self._evaluate(self.anchor)

    def metrics(self, other: State, mode: str) -> list:
        out = [self.start]
        for t in progress_bar(self.ts[1:], desc=f"barrier ({mode})", enabled=self.progress):
            out.append(self._evaluate(self._between(other, t)))
        return out

    def _between(self, other: State, t: float) -> State:
        state = dict(self.anchor)
        for k in self.names:
            mixed = (1 - t) * self.anchor[k].to(torch.float64) + t * other[k].to(torch.float64)
            state[k] = mixed.to(self.anchor[k].dtype)
        return state

    def _evaluate(self, state: State):
        from .datasets import evaluate
        from .statistics import data_must_fit

        self.model.load_state_dict(state)
        with data_must_fit(self.data, "model A"):
            return evaluate(self.model, self.data)


def _curve(mode: str, anchor: Subject, source: Subject, path: _Path, options: Mapping[str, Any],
           learning: Mapping[str, Any]) -> BarrierCurve:
    start = time.perf_counter()
    result = _aligned(mode, anchor, source, options, learning)
    aligned = source.state_dict() if result is None else result.state
    seconds = time.perf_counter() - start
    metrics = path.metrics(aligned, mode)
    losses = [m.loss for m in metrics]
    accuracies = [m.accuracy for m in metrics] if all(m.accuracy is not None for m in metrics) else None
    drop = None if accuracies is None else barrier_height(path.ts, [-x for x in accuracies])
    return BarrierCurve(mode, losses, accuracies, barrier_height(path.ts, losses), drop,
                        relative_distance(aligned, path.anchor, path.names), seconds, alignment_summary(result))


def _with_alignment_data(options: dict, aligns, data, model: Subject) -> dict:
    """``options`` with ``align_data`` loaded (its train split, by the unfolded model, whose folder has the
    tokenizer) when ``full+data`` is asked for: the path is measured on ``data``'s own split."""
    if not any(m.startswith(DATA_MODE) for m in aligns):
        return options
    from .datasets import load_data

    batch_size = options.pop("data_batch_size", 16)
    options["align_data"] = load_data(options.get("align_data", data), model=model, batch_size=batch_size,
                                      split="train")
    return options


def _aligned(mode: str, anchor: Subject, source: Subject, options: Mapping[str, Any],
             learning: Mapping[str, Any]):
    """``source`` aligned to ``anchor`` in ``mode`` (an AlignResult; ``none``: None), checked to compute what it
    computed;
    a ``+learn`` mode learns on ``learning["data"]``'s training split (``full+data+learn``: on the alignment
    data)."""
    if mode == "none":
        return None
    data_options = {k: options[k] for k in DATA_OPTIONS if k in options}
    options = {k: v for k, v in options.items() if k not in DATA_OPTIONS}
    base, learned = mode.removesuffix(LEARNED), mode.endswith(LEARNED)
    if base == DATA_MODE:
        base, options = "full", {**options, "data": data_options.pop("align_data"), **data_options}
    if learned:  # from the base mode's alignment (full: weight-matched); full+data+learn learns on its data
        options = {**options, "learn_data": options.get("data", learning["data"]), "learn": learning["learn"],
                   "progress": (lambda *_: None) if learning["progress"] else None}
    return align(source, anchor, mode=base, verify=True, fold=False, **options)  # folded (or not) already


# -- plotting ----------------------------------------------------------------------------------------------------
_COLOURS = {"none": "#7f7f7f", "permutation": "#1f77b4", "paper": "#ff7f0e", "full": "#2ca02c",
            "full+data": "#9467bd", "full+learn": "#d62728", "permutation+learn": "#17becf",
            "paper+learn": "#8c564b", "full+data+learn": "#e377c2"}


# what the loss averages over (datasets.evaluate): next-token predictions for causal LM, examples otherwise
_LOSS_UNITS = {"causal_lm": "nats per predicted token", "classification": "nats per example"}


def _x_label(result: BarrierResult) -> str:
    """Name the end point B honestly: the ``none`` curve ends at B as trained, the others at B aligned to A."""
    aligned = [m for m in result.curves if m != "none"]
    ends = (["B as trained (none)"] if "none" in result.curves else []) + \
        ([f"B aligned to A ({', '.join(aligned)})"] if aligned else [])
    return f"t   (0: model A;  1: {' or '.join(ends)})"


def _y_label(result: BarrierResult, field: str) -> str:
    if field == "accuracies":
        return "accuracy (fraction correct)"
    return f"cross-entropy loss ({_LOSS_UNITS.get(result.task, 'nats')})"


def _draw(ax, result: BarrierResult, field: str, height: str, height_name: str) -> None:
    for mode, curve in result.curves.items():
        ax.plot(result.ts, getattr(curve, field), marker="o", markersize=3, color=_COLOURS.get(mode),
                label=f"{mode} ({height_name} {getattr(curve, height):.3g}, distance {curve.distance:.3g})")
    ax.set_xlabel(_x_label(result), fontsize=8)
    ax.set_ylabel(_y_label(result, field))
    ax.grid(alpha=0.3)
    # below the axes, never over the curves: the curves fill the whole box on some pairs
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1, frameon=False)


def check_plot_path(path) -> Path:
    """Refuse a plot path whose suffix is not an image format matplotlib writes, or whose folder is missing.

    Examples
    --------
    >>> check_plot_path("barrier.svg").suffix
    '.svg'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise OutputError(f"Cannot write a plot to '{path}': unknown image format '{path.suffix}'.",
                          hint=f"use one of: {', '.join('.' + f for f in sorted(formats))}.")
    if not path.parent.is_dir():
        raise OutputError(f"Cannot write '{path}': folder '{path.parent}' does not exist.",
                          hint="create the folder first, or choose another output path.")
    return path


def _save_figure(figure, path: Path) -> Path:
    from .io import write_atomic

    suffix = check_plot_path(path).suffix.lstrip(".").lower()
    return write_atomic(path, lambda tmp: figure.savefig(tmp, format=suffix, dpi=120))


DATA_OPTIONS = ("align_data", "data_batches", "data_batch_size", "data_groups")  # for full+data only
ALIGN_OPTIONS = ("only", "rescale", "layers", "refine_rounds", "tolerance", "matching_start", "judge_starts",
                 "synthetic_activations", "short_learning", "general_linear", "balance", "residual",
                 *DATA_OPTIONS)


def _check_options(steps: int, aligns: Sequence[str], align_options: Mapping[str, Any]) -> None:
    unknown_options = sorted(set(align_options) - set(ALIGN_OPTIONS))
    if unknown_options:
        raise SymgraphError(f"Unknown alignment option(s) {', '.join(unknown_options)}.",
                            hint=f"barrier passes only {', '.join(ALIGN_OPTIONS)} on to symgraph.align.")
    if steps < 3:
        raise SymgraphError(f"steps must be at least 3 (both ends and one point between), got {steps}.")
    choices = ", ".join(BARRIER_MODES)
    unknown = [m for m in aligns if m not in BARRIER_MODES]
    if unknown or not aligns:
        raise SymgraphError(f"Unknown alignment mode(s): {', '.join(unknown) or 'none given'}.",
                            hint=f"choose from {choices} (comma-separated on the command line).")
    if len(set(aligns)) != len(aligns):
        raise SymgraphError(f"Alignment modes {list(aligns)} name a mode twice.",
                            hint="list each mode once (distinct).")
