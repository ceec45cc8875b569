"""Merge models of one architecture: align them into one frame, then average them, simply or weighted by data.

Methods
-------
``simple``
    The weighted average ``sum_i w_i theta_i`` (weights normalised to sum to 1).
``fisher``
    Per parameter, ``sum_i w_i F_i theta_i / sum_i w_i F_i`` with ``F_i`` the diagonal empirical Fisher of model
    ``i`` (squared batch-loss gradients averaged over batches). A floor of ``1e-6`` times the mean Fisher is added
    to every ``F_i``, so coordinates no data reaches fall back to the weighted average.
``regmean``
    Per linear layer (``nn.Linear``, and Hugging Face ``Conv1D`` whose weight is stored transposed), the weight
    that best reproduces every model's outputs on its own inputs:
    ``W = (sum_i w_i G_i)^-1 sum_i w_i G_i W_i`` with ``G_i`` the Gram matrix of the layer's inputs (the bias is
    part of the regression through an input column of ones). Off-diagonal Gram entries are scaled by ``alpha``
    (RegMean's shrinkage; ``alpha = 0`` weights each input feature by its energy alone). The system is solved by
    Cholesky; when it is singular or badly conditioned a small ridge is added, pulling the directions no data
    reaches towards the weighted average rather than towards zero. Every other parameter is averaged simply.

Statistics are always taken on the *aligned* models (see :mod:`symgraph.consensus` for how models are aligned
into one frame without depending on the argument order). Heads that cannot be merged (classifiers of different
tasks) can be copied from one model with ``head_from``.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .api import Subject, align as align_pair, load, tie_aliases
from .alignment import compute_device, compute_dtype
from .consensus import ALIGN_MODES, Consensus, align_to_consensus, merge_order, shared_float_names, weighted_mean
from .workers import check_workers
from .errors import DataError, MismatchError, ModelLoadError, SymgraphError
from .activations import DATA_MODE as DATA_ALIGN
from .io import check_finite
from .shards import widest_dtype
from .statistics import LinearLayer, fisher_diagonal, input_grams, linear_layers
from .datasets import Dataset
from .synthetic import is_synthetic, learning_only, merge_examples
from .module_state import copied_module

__all__ = ["METHODS", "MergeResult", "merge", "fisher_average", "regmean_solution", "head_parameters",
           "StreamedMerge", "merge_streamed"]

METHODS = ("simple", "fisher", "regmean")
_log = logging.getLogger(__name__)
FISHER_FLOOR = 1e-6  # relative to the mean Fisher value
_CONDITION_LIMIT = 1e-12  # smallest accepted (min/max) ratio of the Cholesky factor's diagonal, squared
_RIDGES = (0.0, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 1.0)  # relative to the mean diagonal of the system

State = dict[str, torch.Tensor]


@dataclass
class MergeResult:
    """A merged state dict (in the models' dtype) and how it came about.

    ``distances`` are each model's relative L2 distance to the consensus (the weighted mean of the aligned
    models) and ``distances_before`` the same before alignment; ``simple_averaged`` lists parameters the method had no
    statistics for (non-linear parameters for RegMean; buffers), which were averaged simply. With learned matching,
    ``learned`` holds per model, in the frame kept, what learning did (:class:`symgraph.learn.LearnRecord` as JSON;
    None for the reference, which does not move).
    """

    state: State
    method: str
    align: str
    models: tuple[str, ...]
    weights: tuple[float, ...]
    consensus: Consensus = field(repr=False)
    head_from: int | None = None
    head: tuple[str, ...] = ()
    simple_averaged: tuple[str, ...] = ()
    data: tuple[str, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)
    config: Any = field(default=None, repr=False)
    like: Path | None = None
    frame: str = ""  # the frame the models were merged in (see merge's ``frame``)
    frame_note: str = ""  # ... and why that one
    frames: dict[str, float] = field(default_factory=dict)  # the score of every frame tried (lower is better)
    inputs: tuple[Path, ...] = ()  # the folders the models were read from: save never writes over one
    learned: tuple[dict | None, ...] = ()  # per model, what learned matching did in the frame kept (with learn)
    fold_note: str = ""  # fold None, not folded after all: why (the norms cannot be folded); or the ties undone
    # per model, what its first alignment onto the reference kept (starts, costs, path losses: the JSON of
    # symgraph.connectivity.alignment_summary; None for the reference), where merge made it as align does (or on
    # activations of the data)
    alignments: tuple[dict | None, ...] = ()

    @property
    def distances(self) -> list[float]:
        return self.consensus.distances

    @property
    def distances_before(self) -> list[float]:
        return self.consensus.distances_before

    def to_json(self) -> dict:
        return {"method": self.method, "align": self.align, "models": list(self.models),
                "weights": list(self.weights), "data": list(self.data), "head_from": self.head_from,
                "head": list(self.head), "simple_averaged": len(self.simple_averaged),
                "consensus": self.consensus.to_json(), "frame": self.frame, "frame_note": self.frame_note,
                "frames": self.frames, "learned": list(self.learned), "alignments": list(self.alignments),
                "timings_s": self.timings,
                **({"fold_note": self.fold_note} if self.fold_note else {})}

    def save(self, path, *, overwrite: bool = False) -> Path:
        """Write the merge as a Hugging Face folder (config and tokenizer from the model the head came from,
        else from the reference model, whose frame the merge lives in; the safetensors metadata entries every input
        folder agrees on), atomically: see :func:`symgraph.io.save_model`."""
        from .checkpoint import carried_metadata, refuse_unloaded_inputs, warn_side_files_differ
        from .files import refuse_overlap
        from .io import save_model

        refuse_overlap(Path(path).expanduser(), self.inputs)
        refuse_unloaded_inputs(self.inputs)  # any model's, not only the one whose config is written
        warn_side_files_differ(self.inputs, self.like)
        return save_model(self.state, path, config=self.config, like=self.like, overwrite=overwrite,
                          metadata=carried_metadata(self.inputs))


def merge(models: Sequence[Any], *, method: str = "simple", align: str = "full", data: Any = None,
          weights: Sequence[float] | None = None, head_from: int | None = None,
          head: Sequence[str] | None = None, alpha: float = 0.9, rounds: int = 5, batch_size: int = 32,
          limit: int | None = None, split: str = "train", fold: bool | None = None, untie: bool | None = None,
          learn=False,
          frame: str = "best", progress: bool = True, free_outputs: bool = False,
          workers: str = "local", device="cpu", dtype=None, judge_starts: bool = True,
          synthetic_activations: bool = True, short_learning: bool = True) -> MergeResult:
    """Merge two or more models of one architecture.

    Parameters
    ----------
    models
        Anything :func:`symgraph.load` accepts (Hugging Face folders, ``module:factory`` strings, Subjects).
    method
        ``"simple"``, ``"fisher"`` or ``"regmean"`` (see the module docstring).
    align
        ``"full"``, ``"paper"``, ``"permutation"`` or ``"none"``: the groups used to bring the models into one
        frame before merging; ``"full+data"``: every model after the first aligned to it in full mode with
        activation costs (:mod:`symgraph.activations`) on its ``data`` (needed then).
    data
        Fisher and RegMean statistics data: a data SPEC or :class:`symgraph.datasets.Dataset`, or a sequence
        with one per model (each model's statistics on its own data).
    weights
        One non-negative weight per model (normalised to sum to 1); it scales each model's statistics.
    head_from
        Index (0-based) of the model whose head is copied instead of merged. The head is everything outside
        the Hugging Face ``base_model_prefix`` submodule, or the parameters matching ``head``.
    head
        fnmatch patterns over parameter names (``"classifier.*"``) naming the head; needed for plain modules.
    alpha
        RegMean's scale for off-diagonal Gram entries, in [0, 1].
    rounds
        Most consensus rounds after the first alignment pass (three or more models).
    batch_size, limit, split
        How a data SPEC is loaded (see :func:`symgraph.datasets.load_data`).
    fold
        Fold every model first (:func:`symgraph.fold`): alignment then uses the orthogonal residual group, and
        the merge averages folded weights (norm weights folded into the linears that read them). ``None``: where
        it pays off (:func:`symgraph.fold.pays_off`) and ``align`` is not "none" (unaligned, the weights are averaged
        as stored); the models' names then end in "(folded)". Models whose
        norms cannot be folded after all are merged unfolded, and ``result.fold_note`` says why.
    untie
        Where folding, give tied weights tensors of their own first (:func:`symgraph.fold.untied`), so a final norm
        read by a tied LM head folds too: where the tie keeps a norm from folding and ``align`` is not "none"
        (None, the default; ``result.fold_note`` then says so), always (True), never (False: tied models are
        merged unfolded). The merge's config then says the weights are not tied.
    learn
        True, or a :class:`symgraph.learn.LearnOptions`: each model's alignment to the reference is tuned by
        learned matching on the training split of ``data`` (the first, if one per model); needs ``data``. In a
        simple merge of two models it learns, by default, at the point of the path the merged model is.
    frame
        Which frame the models are merged in. ``reference``: every model aligned onto the reference (the model
        with the largest weight; :func:`symgraph.consensus.reference_index`). ``common``: then every model,
        the reference too, aligned to their weighted mean (:func:`symgraph.consensus.align_to_consensus`; not
        with ``learn``, which tunes alignments to the reference).
        ``best`` (the default): each model's frame in turn and the common one (not with ``learn``), keeping the
        merge with the lowest loss on ``data`` when there is data (with ``learn``: the learned alignments' loss
        on the batches learning held out of its steps), else the lowest loss on 64 synthetic examples labelled by
        the models together (:func:`symgraph.synthetic.merge_examples`), else (no synthetic data for the model, or
        heads of their own: ``head_from``) the one whose aligned models lie closest to their mean;
        ``result.frame`` and ``result.frame_note`` say which and why. Aligning B onto A and A onto B give different
        merges; ``best`` costs one alignment and one merge per frame tried.
    progress
        Show progress bars (only ever on a terminal).
    free_outputs
        Base models and sentence encoders: hidden-state outputs move with the residual stream, which is then
        aligned too (see :func:`symgraph.load`); the merge's outputs are in the reference model's basis.
    workers
        Where the consensus alignment jobs run: ``"local"`` or ``"ray"`` (a Ray cluster; the ``symgraph[ray]``
        extra), one job per model per round, each reading its model from its folder (:mod:`symgraph.workers`);
        the first alignments made as ``align`` makes them (``judge_starts``) run in this process, which has the models.
    device, dtype
        Where and in what the heavy linear algebra computes: ``cpu`` (the default), ``cuda`` or ``cuda:N``, and
        ``float32`` or ``float64`` (default float64): the alignment's costs, SVDs and moves
        (:func:`symgraph.alignment.align_states`) and RegMean's solves. Statistics, means and the result stay
        float64 on the CPU. A device this machine lacks, or another dtype, is refused before any model is read.
    judge_starts, synthetic_activations, short_learning
        ``align="full"`` without learning or heads of their own: each model's first alignment onto the reference is
        made as :func:`symgraph.align` makes it without data (with ``judge_starts``, its descent starts judged by
        their path loss on synthetic examples; with ``synthetic_activations`` too, the alignment on activations of
        those examples kept where its path loss is lower; with ``short_learning``, that alignment tuned by a
        short learned matching on other synthetic examples where the path rises above its ends, and kept where its
        path loss is lower), in this process; ``result.alignments`` says what each
        kept. Otherwise, and in the rounds of three or more models and of the common frame, by weights alone. With
        ``data``, each frame is also tried with its first alignments by weights alone, and each model's frame with
        them on activations of the data (as ``"full+data"``, with its short learning on the data's other batches
        and, for token data, synthetic examples unless ``short_learning`` is False or the merge learns), the merge
        with the lowest loss on the data kept (the frame's label then ends in "aligned by weights" or "aligned on
        activations of the data").

    Examples
    --------
    >>> import copy, symgraph
    >>> from symgraph import zoo
    >>> model = zoo.build("bert", seed=0)
    >>> twin = copy.deepcopy(model)
    >>> _ = twin.load_state_dict(symgraph.transform(symgraph.load(model), seed=1))  # same function
    >>> result = merge([model, twin], method="simple", align="full", progress=False)
    >>> max(result.distances) < 1e-6
    True
    """
    _check_options(len(models), method, align, data, alpha, rounds, head_from, head, learn, frame)
    check_workers(workers)
    device, dtype = compute_device(device), compute_dtype(dtype)
    if learn and workers != "local":
        raise SymgraphError("Learned matching runs in this process: it cannot run on --workers ray yet.",
                            hint="leave out --workers ray, or --learn.")
    w = normalized_weights(weights, len(models))
    clock = _Clock()
    subjects = [load(m, free_outputs=free_outputs) for m in models]
    check_distinct([s.path or s.model for s in subjects], [s.path or s.name for s in subjects])
    _check_fixed_tensors([s.state_dict() for s in subjects], [s.name for s in subjects])
    inputs = tuple(s.path for s in subjects if s.path is not None)  # before folding, which makes new subjects
    exclude = head_parameters(subjects[head_from], head) if head_from is not None else frozenset()
    on_data = align == DATA_ALIGN
    # synthetic data serves learning alone (checked in _check_options): statistics and frames go without data
    datasets = _datasets_for(data, subjects, batch_size, limit, split) if data is not None and not is_synthetic(
        data) else []
    # without alignment a fold's larger groups serve nothing and it would change what is averaged (W diag(g), not W
    # and g apart): an unaligned merge averages the weights as stored, as merge_streamed does; a merge of tied
    # fine-tunes keeps its size
    if align == "none":
        fold = False if fold is None else fold
        untie = False if untie is None else untie
    subjects, fold_note = _folded(subjects, fold, exclude, groups=align != "none", untie=untie)  # after the data
    clock.lap("load")
    order = merge_order(subjects, w, exclude)
    tried, frames = [], _frames(frame, order, subjects, align, bool(learn) or on_data)
    # merges made without data are scored on synthetic data where it can be made (learned ones by what they checked),
    # made from the models in an order the argument order does not change (its samples are drawn model by model);
    # models with heads of their own (``exclude``) predict different things, which no mean prediction labels
    judged = merge_examples(subjects[0].model, [subjects[i].state_dict() for i in order]) if (
        len(frames) > 1 and not datasets and not learn and not exclude) else None
    scored_on = datasets or ([judged] if judged is not None else [])
    first_pass = _FirstAlignments(subjects, synthetic_activations, short_learning, device, dtype) if (
        align == "full" and judge_starts and not learn and not exclude) else None
    for label, reference, common, passing, activations in _candidates(frames, first_pass, bool(datasets), on_data):
        records: list[dict] = []  # what learning did, model by model, in this frame
        learner = _learner(subjects[0], data, _merge_learning(learn, method, w, reference), exclude, progress,
                           records) if learn else None
        try:
            moved, kept_on_activations = _aligned_on_activations(
                subjects, datasets, reference, device, dtype, short_learning and not learn) if activations else (
                subjects, ())
        except (SymgraphError, RuntimeError, ValueError) as error:
            if on_data:  # asked for: its failure is the merge's
                raise
            _log.info("merge leaves out the frame %s: %s: %s", label, type(error).__name__, error)
            continue  # one candidate among others: its failure costs only itself
        consensus = align_to_consensus(moved, w, mode="none" if activations else align, exclude=exclude,
                                       rounds=rounds, progress=progress, learner=learner, reference=reference,
                                       common=common, workers=workers, device=device, dtype=dtype, first_pass=passing)
        summaries = passing.summaries(reference) if passing is not None else kept_on_activations  # made just now
        names = shared_float_names(consensus.states[0], exclude)
        merged, averaged = _combine(method, moved, consensus.states, w, datasets, names, exclude, alpha, progress,
                                    (device, dtype or torch.float64))
        state = _finished_state(merged, moved, consensus, head_from, exclude)
        tried.append((label, consensus, state, averaged, _frame_score(state, moved, consensus, w, scored_on,
                                                                      head_from, records), records, summaries))
    clock.lap("align_and_combine")
    label, consensus, state, averaged, _, records, alignments = _best_frame(tried)
    source = subjects[head_from if head_from is not None else consensus.reference]
    return MergeResult(state, method, align, tuple(s.name for s in subjects), tuple(map(float, w)), consensus,
                       head_from, tuple(sorted(exclude)), averaged, tuple(d.name for d in datasets),
                       clock.laps(), source.config, source.path, label, _frame_note(tried, datasets, judged),
                       {t[0]: t[4] for t in tried}, inputs, _per_model(records, len(subjects), consensus.reference),
                       fold_note, alignments)


FRAMES = ("best", "reference", "common")
_FRAME_TIE = 1e-5  # relative: scores closer than this are equal (equivalent merges differ by float rounding)


def _frames(frame: str, order: list[int], subjects, align: str, learned: bool) -> list[tuple[str, int, bool]]:
    """The frames to try, as (label, reference model, common frame?), in the subjects' ``order``
    (:func:`symgraph.consensus.merge_order`): the default reference's frame first, so a tie keeps it."""
    default = order[0]
    onto = [(f"onto {'the reference, ' if i == default else ''}model {i + 1} ({subjects[i].name})", i, False)
            for i in order]
    if align == "none" or frame == "reference":
        return onto[:1]
    common = [("common (every model aligned to the mean)", default, True)]
    if frame == "common":
        return common
    return onto + ([] if learned else common)


def _candidates(frames: list, first_pass, with_data: bool, activations: bool) -> list[tuple]:
    """``frames`` as (label, reference, common, first pass, aligned on activations?): each with ``first_pass``
    (None: by weights), or every one on activations (``activations``: ``align="full+data"``). With data to score
    the merges on (``with_data``) and a first pass, each frame is also tried by weights alone, and each model's
    frame on activations of the data too (:func:`_aligned_on_activations`): the first alignments `align` makes
    without data are judged on simple interpolation of synthetic examples, which ranks neither Fisher and RegMean
    merges nor the data's task.
    Shipped pairs, test loss of the merge kept, the first pass alone -> with both (examples/results/
    merge_frames_{fisher,regmean}.json): vit-digits Fisher 3.262 -> 2.687, RegMean 2.990 -> 2.290; llama-chars
    Fisher 3.003 -> 2.968, RegMean 2.920 kept; bert-topics 0.008-0.009 worse (its training examples, which score
    the merges, rank its frames a little wrong). It costs 2-2.6x the time of the first pass alone."""
    if activations:
        return [(label, reference, common, None, True) for label, reference, common in frames]
    ways = [("", first_pass, False)]
    if first_pass is not None and with_data:
        ways += [(", aligned by weights", None, False), (", aligned on activations of the data", None, True)]
    return [(label + how, reference, common, passing, on_activations) for label, reference, common in frames
            for how, passing, on_activations in ways if not (common and on_activations)]


def _frame_score(state, subjects, consensus, w, datasets, head_from, learned: list[dict]) -> float:
    """Lower is better: where learning scored its candidates on more than the task loss of the batches it stepped
    on (``learned``: its records; :func:`_learned_objective`), the mean of what it kept scored there (in a simple
    merge of two models, the merged model's), since on those batches learning fits every frame alike; otherwise the
    merged model's mean loss on ``datasets`` (without data given: the synthetic examples of
    :func:`symgraph.synthetic.merge_examples`), or where there are none the weighted mean distance of the aligned
    models to their mean (which ranks merges poorly: :func:`symgraph.synthetic.merge_examples`)."""
    if _learned_objective(learned):
        return float(np.mean([r["end_path_loss"] for r in learned]))
    if not datasets:
        return float(np.dot(consensus.distances, w) / np.sum(w))
    from .datasets import evaluate

    model = _model_with(subjects[head_from if head_from is not None else consensus.reference], state)
    return float(np.mean([evaluate(model, d).loss for d in datasets]))


def _learned_objective(learned: list) -> str | None:
    """What every learning record of a frame checked its candidates on, when that ranks frames better than the
    merged loss on the training split: batches held out of its steps (:func:`symgraph.learn.held_out`), or the
    task loss plus distillation on mixed inputs (``mixup``: the endpoints have not memorised those); else None.
    Wide ViT, where both endpoints fit the training split: the merged training loss kept the frame whose test loss
    was 1.50x the endpoints' (examples/results/wide_merge_seeds.json)."""
    if not learned or any(r is None for r in learned):
        return None
    if all(r.get("checked_on_held_out") for r in learned):
        return "loss of the learned alignments on the batches learning held out"
    if all(r.get("mixup") for r in learned):
        return "loss plus distillation on mixed training inputs of the learned alignments"
    return None


def _best_frame(tried: list) -> tuple:
    """The lowest score; one within :data:`_FRAME_TIE` of an earlier one does not replace it."""
    best = tried[0]
    for candidate in tried[1:]:
        if candidate[4] < best[4] - _FRAME_TIE * abs(best[4]):
            best = candidate
    return best


def _frame_note(tried: list, datasets, judged: Dataset | None) -> str:
    """Which frame the merge was made in, and why (:func:`_frame_score`)."""
    if len(tried) == 1:
        return "the frame asked for"
    objective = _learned_objective(tried[0][5])
    if objective:
        what = f"lowest {objective}"
    elif datasets:
        what = f"lowest merged loss on {', '.join(dict.fromkeys(d.name for d in datasets))}"
    elif judged is not None:
        what = f"lowest merged loss on {judged.name} labelled by the models together (no data given)"
    else:
        what = "smallest mean distance of the aligned models to their merge (no data to score the merges on)"
    scores = ", ".join(f"{t[0]}: {t[4]:.4g}" for t in tried)
    return f"chosen for the {what}: {scores}"


def _folded(subjects: list, fold: bool | None, exclude: frozenset[str], *, groups: bool,
            untie: bool | None = None) -> tuple[list, str]:
    """``(subjects, note)``: every subject folded when ``fold``, or when None and it pays off, checked to match
    (:func:`check_compatible`, their groups too with ``groups``); the note says why not when None fell back
    (:func:`symgraph.fold.folded_where_asked`)."""
    from .fold import folded_where_asked

    def check(models, groups_now):
        check_compatible(models, exclude, groups=groups and groups_now)

    subjects, _, note = folded_where_asked(subjects, fold, check, untie)
    return subjects, note



@dataclass(frozen=True)
class StreamedMerge:
    """What :func:`merge_streamed` wrote: the folder, the models and their weights, and its size and timings."""

    path: Path
    models: tuple[str, ...]
    weights: tuple[float, ...]
    tensors: int
    bytes_read: int
    bytes_written: int
    seconds: float

    def to_json(self) -> dict:
        return {"method": "simple", "align": "none", "streamed": True, "path": str(self.path),
                "models": list(self.models), "weights": list(self.weights), "tensors": self.tensors,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "seconds": self.seconds}


def merge_streamed(models: Sequence[Any], out, *, weights: Sequence[float] | None = None,
                   shard_bytes: int | None = None, overwrite: bool = False) -> StreamedMerge:
    """The weighted average of safetensors checkpoints, read and written one tensor at a time (7B and up).

    Each tensor is read from every model (memory-mapped, in its stored dtype), averaged in float32 (float64 when
    any model stores it so), and written in the widest stored dtype to sharded safetensors with the index
    (:func:`symgraph.shards.write_checkpoint`: atomic, nothing at ``out`` until complete). Integer and boolean
    tensors must be equal in every model (0-d counters aside) and are written as stored. The models must share
    their config.json, and store every weight its architecture needs. Config and tokenizer files are copied from
    the first model, with the safetensors metadata entries every model agrees on. The models are neither aligned
    nor folded: align them first (``symgraph align``) for an aligned merge. Peak memory is a few tensors.

    Examples
    --------
    >>> import tempfile, symgraph
    >>> from symgraph import zoo
    >>> from symgraph.io import model_config
    >>> folders = [symgraph.io.save_model(m.state_dict(), tempfile.mkdtemp() + "/m", config=model_config(m))
    ...            for m in (zoo.build("llama", seed=0), zoo.build("llama", seed=1))]
    >>> merge_streamed(folders, tempfile.mkdtemp() + "/merged", shard_bytes=10**5).tensors
    21
    """
    from .checkpoint import carried_index_metadata, carried_metadata, warn_side_files_differ
    from .files import refuse_overlap
    from .lazy_state import LazyState
    from .shards import DEFAULT_SHARD_BYTES, write_checkpoint

    if len(models) < 2:
        raise SymgraphError(f"Merging needs at least two models, got {len(models)}.", hint="pass two or more models.")
    w = normalized_weights(weights, len(models))
    check_distinct([Path(m).expanduser() for m in models], models)
    refuse_overlap(out, models)
    start = time.perf_counter()
    states = [LazyState(m) for m in models]
    infos = _streamed_plan(states, models)
    warn_side_files_differ([s.folder for s in states], states[0].folder)
    path = write_checkpoint(out, infos, lambda name: _streamed_average(states, w, name, models),
                            shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES, like=states[0].folder,
                            overwrite=overwrite, metadata=carried_metadata([s.folder for s in states]),
                            index_metadata=carried_index_metadata([s.folder for s in states]))
    return StreamedMerge(path, tuple(map(str, models)), tuple(map(float, w)), len(infos),
                         sum(s.nbytes for s in states), sum(i.nbytes for i in infos),
                         time.perf_counter() - start)


def _streamed_plan(states, models) -> list:
    """The output's tensors (the first model's order, widest stored dtype), after checking the models match."""
    from .alignment import check_same_config
    from .checkpoint import _config_of
    from .lazy_state import check_same_tensors
    from .shards import TensorInfo

    first = states[0]
    _check_configs_present(states, models)
    for position, other in enumerate(states[1:], start=2):
        check_same_tensors(first, other, f"Model 1 ({models[0]}) and model {position} ({models[position - 1]})",
                           hint="pass checkpoints of one architecture and configuration.")
        check_same_config(_config_of(first.folder), _config_of(other.folder))
    _check_complete(first, models[0])
    return [TensorInfo(k, first.info(k).shape, widest_dtype(s.info(k).dtype for s in states)) for k in first]


def _check_configs_present(states, models) -> None:
    """Bare checkpoints (no config.json) average as they are, but one beside model folders is refused: configs are
    compared only where both models have one, and the merge is written with the first model's config."""
    bare = [i for i, s in enumerate(states) if not (s.folder / "config.json").is_file()]
    if bare and len(bare) < len(states):
        other = next(i for i in range(len(states)) if i not in bare)
        raise MismatchError(
            f"Model {bare[0] + 1} ({models[bare[0]]}) has no config.json, but model {other + 1} "
            f"({models[other]}) has one: the checkpoints cannot be checked to be of one architecture, and the merge "
            f"would be written {'without a config' if bare[0] == 0 else 'with the config of model 1'}.",
            hint="pass model folders that all hold their config.json (or none, to average bare checkpoints).")


def _check_fixed_tensors(states: Sequence[State], models: Sequence[str]) -> None:
    """Refuse models whose integer or boolean tensors differ (see :func:`_fixed_tensor`)."""
    for name, value in states[0].items():
        if not value.is_floating_point() and all(name in s for s in states):
            _fixed_tensor(name, [s[name] for s in states], models)


def _fixed_tensor(name: str, tensors: Sequence[torch.Tensor], models: Sequence[Any]) -> torch.Tensor:
    """An integer or boolean tensor cannot be averaged: the models must agree on it (a mask or an index table that
    differs would make the merge compute with one model's). A 0-d one is a counter (BatchNorm's
    num_batches_tracked): not compared, kept from one model."""
    if tensors[0].dim() > 0:
        differs = next((i for i, t in enumerate(tensors[1:], start=1)
                        if t.shape != tensors[0].shape or not torch.equal(t, tensors[0])), None)
        if differs is not None:
            raise MismatchError(
                f"The {str(tensors[0].dtype).removeprefix('torch.')} tensor '{name}' differs between model 1 "
                f"({models[0]}) and model {differs + 1} ({models[differs]}); integer and boolean tensors (masks, "
                "index tables) cannot be averaged.",
                hint="merge models that share these tensors (the same masks and tables), or make them equal first.")
    return tensors[0]


def _check_complete(state, model) -> None:
    """Refuse a checkpoint that lacks weights its config's architecture needs: the merge (or alignment) would be
    written without them, and loading it would fill them in at random."""
    from .checkpoint import _config_of, _declared_ties, _meta_model, stored_weight_names
    from .io import _some

    config = _config_of(state.folder)
    needed = stored_weight_names(config)
    missing = sorted(needed - set(state)) if needed is not None else []
    if missing:  # a tie is stored under either of its names (transformers loads the other from it)
        stored_as = {source: tied for tied, source in _declared_ties(_meta_model(config)).items() if tied in state}
        missing = [name for name in missing if name not in stored_as]
    if missing:
        raise ModelLoadError(
            f"The checkpoint '{model}' lacks {len(missing)} tensor(s) that the architecture in its config.json "
            f"needs: {_some(missing)}. Every input stores the same tensors, so the model written would lack them "
            "too, and loading it would initialise them at random.",
            hint="pass complete checkpoints (re-save them with save_pretrained), or check that config.json "
                 "describes these weights.")


def _streamed_average(states, w, name: str, models) -> torch.Tensor:
    """One output tensor: the weighted sum accumulated in place (the other models' tensors are promoted on the
    fly, not copied), checked for NaN/Inf once at the end (a non-finite input makes the sum non-finite)."""
    tensors = [s[name] for s in states]
    out_dtype = widest_dtype(t.dtype for t in tensors)
    if not out_dtype.is_floating_point:
        return _fixed_tensor(name, tensors, models)
    total = tensors[0].to(torch.promote_types(out_dtype, torch.float32)).mul_(float(w[0]))
    for weight, tensor in zip(w[1:], tensors[1:]):
        total.add_(tensor, alpha=float(weight))
    if not torch.isfinite(total).all():
        from .io import nonfinite_error

        bad = next((i for i, t in enumerate(tensors) if not torch.isfinite(t).all()), 0)
        raise nonfinite_error(f"model {bad + 1} ({models[bad]})", [name])
    return total.to(out_dtype)


# -- methods ---------------------------------------------------------------------------------------------------------
def fisher_average(states: Sequence[State], fishers: Sequence[State], weights: Sequence[float],
                   names: Sequence[str], floor: float = FISHER_FLOOR) -> State:
    """``sum_i w_i (F_i + eps) theta_i / sum_i w_i (F_i + eps)`` per entry, ``eps = floor * mean(w-weighted F)``.

    Examples
    --------
    >>> a, b = {"x": torch.tensor([1.0, 1.0])}, {"x": torch.tensor([3.0, 3.0])}
    >>> fa, fb = {"x": torch.tensor([1.0, 0.0])}, {"x": torch.tensor([3.0, 0.0])}
    >>> fisher_average([a, b], [fa, fb], [0.5, 0.5], ["x"])
    {'x': tensor([2.5000, 2.0000], dtype=torch.float64)}
    """
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    fisher = {k: sum(float(wi) * f[k].to(torch.float64) for wi, f in zip(w, fishers)) for k in names}
    count = sum(fisher[k].numel() for k in names)
    eps = floor * float(sum(f.sum() for f in fisher.values())) / max(count, 1)
    eps = eps if eps > 0 else 1.0  # no data reached any parameter: the plain weighted average
    out = {}
    for k in names:
        num = sum(float(wi) * (f[k].to(torch.float64) + eps) * s[k].to(torch.float64)
                  for wi, f, s in zip(w, fishers, states))
        out[k] = num / (fisher[k] + eps)
    return out


def regmean_solution(weights: Sequence[torch.Tensor], grams: Sequence[torch.Tensor], scales: Sequence[float],
                     alpha: float = 0.9, compute=("cpu", torch.float64)) -> torch.Tensor:
    """The RegMean weight ``(sum_i s_i G~_i)^-1 sum_i s_i G~_i W_i^T`` (returned as ``(out, in)``, float64).

    ``weights[i]`` is ``(out, in)``, ``grams[i]`` the ``(in, in)`` Gram matrix of model ``i``'s inputs to the
    layer, and ``G~`` keeps the diagonal of ``G`` and scales the rest by ``alpha``. ``compute`` is the
    (device, dtype) the sums and the solve run in; the result comes back float64 on the CPU.

    Examples
    --------
    >>> w1, w2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    >>> g1, g2 = torch.diag(torch.tensor([1.0, 0.0])), torch.diag(torch.tensor([0.0, 1.0]))
    >>> regmean_solution([w1, w2], [g1, g2], [0.5, 0.5]).round(decimals=6)  # each trusted where it saw data
    tensor([[1., 1.]], dtype=torch.float64)
    """
    sums = _RegMeanSums(compute)
    for w, g, s in zip(weights, grams, scales):
        sums.add(w, g, float(s), alpha)
    return sums.solve()


class _RegMeanSums:
    """Running ``A = sum s_i G~_i``, ``B = sum s_i G~_i W_i^T`` and the weighted average ``W`` (the ridge prior)."""

    def __init__(self, compute=("cpu", torch.float64)):
        self.a = self.b = self.prior = 0
        self.total = 0.0
        self.device, self.dtype = compute

    def add(self, weight: torch.Tensor, gram: torch.Tensor, scale: float, alpha: float) -> None:
        w = weight.to(device=self.device, dtype=self.dtype)
        g = gram.to(device=self.device, dtype=self.dtype)
        shrunk = alpha * g + (1 - alpha) * torch.diag(torch.diagonal(g))
        self.a = self.a + scale * shrunk
        self.b = self.b + scale * shrunk @ w.T
        self.prior = self.prior + scale * w
        self.total += scale

    def solve(self) -> torch.Tensor:
        prior = self.prior / self.total
        return _solve_towards(self.a, self.b, prior.T).T.to(device="cpu", dtype=torch.float64)


def _solve_towards(a: torch.Tensor, b: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """Solve ``a x = b`` for symmetric PSD ``a``; if it is singular or ill-conditioned, solve
    ``(a + r I) x = b + r prior`` with the smallest relative ridge ``r`` that is well-conditioned."""
    scale = float(torch.diagonal(a).mean()) if a.numel() else 0.0
    if not scale > 0:
        return prior.clone()
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    for ridge in _RIDGES:
        r = ridge * scale
        factor, info = torch.linalg.cholesky_ex(a + r * eye)
        diag = torch.diagonal(factor)
        if int(info) == 0 and float((diag.min() / diag.max()) ** 2) > _CONDITION_LIMIT:
            return torch.cholesky_solve(b + r * prior, factor)
    return prior.clone()  # unreachable for finite input: ridge 1.0 makes any PSD matrix well-conditioned


def _combine(method, subjects, states, w, datasets, names, exclude, alpha, progress,
             compute=("cpu", torch.float64)) -> tuple[State, tuple]:
    """Merged float64 tensors for ``names``, and the names the method had no statistics for; RegMean solves in
    ``compute`` (device, dtype)."""
    merged = weighted_mean(states, w, names)
    if method == "simple":
        return merged, ()
    models = [_model_with(s, state) for s, state in zip(subjects, states)]
    labels = [f"model {i + 1}" for i in range(len(models))]
    if method == "fisher":
        fishers = [fisher_diagonal(m, d, progress=progress, label=lab)
                   for m, d, lab in zip(models, datasets, labels)]
        weighed = [k for k in names if k in fishers[0]]  # parameters: float buffers have no Fisher information
        merged.update(fisher_average(states, fishers, w, weighed))
        return merged, tuple(k for k in names if k not in fishers[0])
    layers = _regmean_layers(subjects[0].model, exclude)
    solved = _regmean_merge(states, layers, w, alpha, compute,
                            lambda i: input_grams(models[i], datasets[i], layers=layers, progress=progress,
                                                  label=labels[i]))
    unseen = sorted(name for name, layer in layers.items() if layer.weight not in solved)
    if unseen:
        _log.warning("RegMean: %d linear layer(s) never ran as modules on the data (e.g. %s) and were averaged "
                     "simply.", len(unseen), unseen[0] or "the model itself")
    merged.update(solved)
    return merged, tuple(k for k in names if k not in solved)


def _regmean_merge(states, layers: dict[str, LinearLayer], w, alpha, compute,
                   grams_of: Callable[[int], dict[str, torch.Tensor]]) -> State:
    """RegMean for every layer that saw data in every model; Gram matrices are folded in one model at a time."""
    sums = {name: _RegMeanSums(compute) for name in layers}
    for i, state in enumerate(states):
        grams = grams_of(i)
        sums = {name: acc for name, acc in sums.items() if name in grams}  # never called: simple average
        for name, acc in sums.items():
            acc.add(_augmented(state, layers[name]), grams[name], float(w[i]), alpha)
    out = {}
    for name, acc in sums.items():
        out.update(_split_augmented(acc.solve(), layers[name]))
    return out


def _regmean_layers(model: torch.nn.Module, exclude: frozenset[str]) -> dict[str, LinearLayer]:
    """Linear layers RegMean may replace: not in the copied head, and no weight shared with another name."""
    from .verify import _aliases

    tied = {n for names in _aliases(model) for n in names}
    return {name: layer for name, layer in linear_layers(model).items()
            if not (set(layer.params) & (exclude | tied))}


def _augmented(state: State, layer: LinearLayer) -> torch.Tensor:
    """The layer's ``[W | b]`` as ``(out, in [+ 1])``."""
    weight = state[layer.weight].to(torch.float64)
    weight = weight.T if layer.transposed else weight
    if layer.bias is None:
        return weight
    return torch.cat([weight, state[layer.bias].to(torch.float64)[:, None]], 1)


def _split_augmented(merged: torch.Tensor, layer: LinearLayer) -> State:
    weight = merged[:, :-1] if layer.bias is not None else merged
    out = {layer.weight: weight.T.contiguous() if layer.transposed else weight.contiguous()}
    if layer.bias is not None:
        out[layer.bias] = merged[:, -1].contiguous()
    return out


# -- validation ----------------------------------------------------------------------------------------------------
def check_distinct(sources: Sequence[Any], names: Sequence[Any]) -> None:
    """Refuse a model given twice (one folder, however spelt or linked, or one module object): merged with itself
    it only weighs more, which ``weights`` says openly; given twice by mistake, the merge would silently lack the
    model meant."""
    seen: dict[Any, int] = {}
    for i, source in enumerate(sources):
        key = _identity(source)
        if key in seen:
            first = seen[key]
            raise SymgraphError(
                f"Model {i + 1} ({names[i]}) is model {first + 1} ({names[first]}) again: a merge takes each model "
                "once.", hint="pass each model once (to weigh one model more, use --weights / weights=), or check "
                "the model paths for a repeated one.")
        seen[key] = i


def _identity(source) -> Any:
    """What makes two model sources one model: the folder a path resolves to, or a module's weight memory (a
    module loaded twice is two module trees over the same tensors)."""
    if isinstance(source, torch.nn.Module):
        first = next(iter(source.state_dict().values()), None)
        return id(source) if first is None else ("weights", first.data_ptr())
    return Path(os.path.realpath(source))


def normalized_weights(weights: Sequence[float] | None, count: int) -> np.ndarray:
    """Weights that sum to 1 (equal when ``weights`` is None); refuse a wrong count, negatives, a zero sum.

    Examples
    --------
    >>> normalized_weights([1, 3], 2).tolist()
    [0.25, 0.75]
    >>> normalized_weights([1e308, 1e308], 2).tolist()
    [0.5, 0.5]
    """
    if weights is None:
        return np.full(count, 1.0 / count)
    w = np.asarray(list(weights), dtype=np.float64)
    if w.shape != (count,):
        raise SymgraphError(f"Got {w.size} weights for {count} models.", hint="give one weight per model.")
    if not np.isfinite(w).all() or (w < 0).any() or not w.max() > 0:
        raise SymgraphError(f"Weights {w.tolist()} must be finite, non-negative, and sum to a positive number.",
                            hint="e.g. --weights 0.7,0.3 (they are normalised to sum to 1).")
    w = w / w.max()  # first: the sum of weights near the largest float would overflow (1e308,1e308 gave NaNs)
    return w / w.sum()


def head_parameters(subject: Subject, patterns: Sequence[str] | None = None) -> frozenset[str]:
    """The head's parameter names: those matching ``patterns``, or else everything outside the Hugging Face
    ``base_model_prefix`` submodule. Names tied to a head parameter (a tied LM head's embedding) belong to it.

    Examples
    --------
    >>> import symgraph
    >>> from symgraph import zoo
    >>> sorted(head_parameters(symgraph.load(zoo.build("bert"))))
    ['classifier.bias', 'classifier.weight']
    """
    names = list(subject.state_dict())
    if patterns:
        chosen = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
        if not chosen:
            raise MismatchError(f"No parameter of {subject.name} matches the head pattern(s) {list(patterns)}.",
                                hint=f"patterns are fnmatch globs over names such as {names[-1]!r}.")
    else:
        prefix = getattr(subject.model, "base_model_prefix", "")
        if not prefix or not isinstance(getattr(subject.model, prefix, None), torch.nn.Module):
            raise MismatchError(f"Cannot tell which parameters of {subject.name} form its head: it is not a Hugging "
                                f"Face model with a base model inside.",
                                hint="name the head with --head PATTERN (fnmatch, e.g. 'fc_out.*').")
        chosen = {n for n in names if not n.startswith(prefix + ".")}
        if not chosen:
            raise MismatchError(f"{subject.name} has no head outside its base model '{prefix}'.",
                                hint="leave out --head-from, or name the head with --head PATTERN.")
    return frozenset(_with_aliases(subject.model, chosen))


def check_compatible(subjects: Sequence[Subject], exclude: frozenset[str], *, groups: bool) -> None:
    """Refuse models that differ in class, parameter names, shapes outside ``exclude``, configuration, finiteness,
    or (with ``groups``) symmetry groups outside ``exclude``: raise :class:`~symgraph.errors.MismatchError`."""
    from .alignment import check_same_config, different_groups

    first = subjects[0]
    for position, other in enumerate(subjects[1:], start=2):
        where = f"model 1 ({first.name}) and model {position} ({other.name})"
        _check_same_parameters(first, other, exclude, where)
        check_same_config(first.config, other.config)  # label names may differ: they are cosmetic
        if groups and _group_keys(first, exclude) != _group_keys(other, exclude):
            raise different_groups(where, first.report.groups, other.report.groups,
                                   (f"model 1 ({first.name})", f"model {position} ({other.name})"))
    for position, subject in enumerate(subjects, start=1):
        check_finite(subject.model, f"model {position} ({subject.name})")


def _check_same_parameters(first: Subject, other: Subject, exclude: frozenset[str], where: str) -> None:
    if type(first.model) is not type(other.model):
        raise MismatchError(f"{where.capitalize()} are different model classes ({type(first.model).__name__} vs "
                            f"{type(other.model).__name__}).", hint="merge models of one architecture.")
    a, b = first.state_dict(), other.state_dict()
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b))[:3], sorted(set(b) - set(a))[:3]
        raise MismatchError(f"{where.capitalize()} have different parameters (only in the first: {only_a}; only in "
                            f"the second: {only_b}).", hint="merge models of one architecture and configuration.")
    differ = [k for k in a if k not in exclude and a[k].shape != b[k].shape]
    if differ:
        k = differ[0]
        hint = ("the heads differ (different numbers of labels?): copy one with --head-from I"
                if not exclude and _outside_base(first.model, differ) else
                "both models must use the same configuration sizes.")
        raise MismatchError(f"{where.capitalize()} differ in shape: {k} is {tuple(a[k].shape)} vs "
                            f"{tuple(b[k].shape)} ({len(differ)} parameters differ).", hint=hint)


def _outside_base(model: torch.nn.Module, names: Sequence[str]) -> bool:
    prefix = getattr(model, "base_model_prefix", "")
    return bool(prefix) and not any(n.startswith(prefix + ".") for n in names)


def _group_keys(subject: Subject, exclude: frozenset[str]) -> list:
    keys = []
    for g in subject.report.groups:
        data = g.to_json()
        data["members"] = [m for m in data["members"] if not _json_member_params(m) & exclude]
        keys.append(data)
    return keys


def _json_member_params(member: dict) -> set[str]:
    """The tensors a member of a report's JSON names (a tensor member: every slot's)."""
    return {p for row in member["tensors"] for p in row} if "tensors" in member else {member["param"]}


def _merge_learning(learn, method: str, weights, reference: int) -> LearnOptions:
    """The options learned matching runs with in this merge, in the frame of ``reference``: ``t="auto"`` is, for a
    simple merge of two models, the point of the path from the reference to the other model that the merged model
    is (the other's share of the weights: 1/2 for equal weights), and the whole path otherwise."""
    from .learn import LearnOptions, resolved_t

    options = learn if isinstance(learn, LearnOptions) else LearnOptions()
    point = float(weights[1 - reference] / np.sum(weights)) if method == "simple" and len(weights) == 2 else None
    return resolved_t(options, merged_at=point)


def _learner(subject: Subject, data, learn, exclude: frozenset[str], progress: bool, records: list):
    """Learned matching (:func:`symgraph.api.learned`) of one model's alignment to the reference, as an
    :attr:`symgraph.consensus.AlignmentPlan.learner`; each run's record is appended to ``records``."""
    from .api import learned

    spec = data[0] if isinstance(data, (list, tuple)) else data

    def learner(groups, source, target, start, free):
        result = learned(subject, groups, source, target, start, spec, learn, free, progress, exclude)
        records.append(result.learned)
        return result
    return learner


def _per_model(records: list, count: int, reference: int) -> tuple[dict | None, ...]:
    """Learning records in model order, None for the reference. With a learner the consensus runs one job per
    other model, in model order, and no rounds (:func:`symgraph.consensus.align_to_consensus`)."""
    from .consensus import _others  # the order the consensus runs its jobs in

    if not records:
        return ()
    others = _others(count, reference)
    if len(records) != len(others):
        raise AssertionError(f"{len(records)} learning records for {len(others)} aligned models")
    by_model = dict(zip(others, records))
    return tuple(by_model.get(i) for i in range(count))


def _check_options(count, method, align, data, alpha, rounds, head_from, head, learn, frame) -> None:
    from .api import check_learn

    check_learn(learn, data)
    if is_synthetic(data) and (not learn or method != "simple" or align == DATA_ALIGN):
        raise learning_only()
    if frame not in FRAMES:
        raise SymgraphError(f"Unknown frame {frame!r}.", hint=f"choose one of {', '.join(FRAMES)}.")
    if learn and align == "none":
        raise SymgraphError("Learned matching tunes an alignment, and --align none asks for none.",
                            hint="use --align full (or permutation, paper) with --learn.")
    if learn and frame == "common":  # the common frame's rounds align by distance and would undo what was learned
        raise SymgraphError("Learned matching tunes each model's alignment to the reference model, so it cannot "
                            "merge in the common frame.",
                            hint="use --frame best (every model's frame tried) or --frame reference with --learn.")
    if count < 2:
        raise SymgraphError(f"Merging needs at least two models, got {count}.", hint="pass two or more models.")
    if method not in METHODS:
        raise SymgraphError(f"Unknown merge method {method!r}.", hint=f"choose one of {', '.join(METHODS)}.")
    if align not in (*ALIGN_MODES, DATA_ALIGN):
        raise SymgraphError(f"Unknown alignment {align!r}.",
                            hint=f"choose one of {', '.join((*ALIGN_MODES, DATA_ALIGN))}.")
    if align == DATA_ALIGN and learn:
        raise SymgraphError("Learned matching in merge starts from weight matching, not from full+data.",
                            hint="use --align full with --learn (or `symgraph align --data --learn` first).")
    if align == DATA_ALIGN and data is None:
        raise DataError("Alignment on activations (full+data) runs data through the models, and none was given.",
                        hint="pass --data SPEC (e.g. digits, pydoc-chars, FILE.txt), or use --align full.")
    if method != "simple" and data is None:
        raise DataError(f"The {method} merge estimates statistics on data, and none was given.",
                        hint="pass --data SPEC (e.g. digits, pydoc-chars, FILE.txt), or use --method simple.")
    if not 0.0 <= alpha <= 1.0:
        raise SymgraphError(f"alpha must lie in [0, 1], got {alpha}.", hint="RegMean's default is 0.9.")
    if rounds < 0:
        raise SymgraphError(f"rounds must be >= 0, got {rounds}.")
    if head_from is not None and not 0 <= head_from < count:
        raise SymgraphError(f"head_from={head_from} names no model (there are {count}).",
                            hint=f"on the command line --head-from counts from 1 to {count}.")
    if head and head_from is None:
        raise SymgraphError("A head pattern was given without saying which model the head comes from.",
                            hint="add --head-from I (the model whose head is copied).")


# -- data and states ------------------------------------------------------------------------------------------------
def _aligned_on_activations(subjects: list[Subject], datasets: list, reference: int, device="cpu",
                            dtype=None, short_learning: bool = True) -> tuple[list[Subject], tuple[dict | None, ...]]:
    """The reference model, and every other aligned to it in full mode with activation costs on its own data
    (checked to compute what it computed; with ``short_learning``, tuned on the data's other batches (and
    synthetic examples) as :func:`symgraph.align` tunes it); and per model what its alignment kept (None for the
    reference)."""
    from .connectivity import alignment_summary

    out, summaries = list(subjects), [None] * len(subjects)
    for i, (subject, data) in enumerate(zip(subjects, datasets)):
        if i == reference:
            continue
        result = align_pair(subject, subjects[reference], mode="full", data=data, fold=False, device=device,
                            dtype=dtype, short_learning=short_learning)
        model = copied_module(subject.model)
        model.load_state_dict(result.state)
        out[i] = dataclasses.replace(subject, model=model, weights_from_path=False, _capture=None, _report=None)
        summaries[i] = alignment_summary(result)
    return out, tuple(summaries)


class _FirstAlignments:
    """Each model's first alignment onto a reference, made as :func:`symgraph.align` makes it without data
    (:attr:`symgraph.consensus.align_to_consensus`'s ``first_pass``), once per pair (frames share them): on the
    shipped and wide pairs its judged starts and activations of synthetic examples lowered barriers and merged
    losses where weights alone did not (README.md, merges align as align does; the wide ViT's merge 2.10 -> 0.65).
    Only the elements and what was kept are held, not the aligned states."""

    def __init__(self, subjects: list[Subject], synthetic_activations: bool, short_learning: bool, device, dtype):
        self.subjects, self.synthetic_activations = subjects, synthetic_activations
        self.short_learning = short_learning
        self.device, self.dtype = device, dtype
        self.made: dict[tuple[int, int], tuple[list, dict]] = {}  # (model, reference) -> (elements, summary)

    def __call__(self, index: int, reference: int) -> list:
        from .connectivity import alignment_summary

        if (index, reference) not in self.made:  # checked with the consensus, at its end
            result = align_pair(self.subjects[index], self.subjects[reference], mode="full", fold=False,
                                verify=False, progress=False, synthetic_activations=self.synthetic_activations,
                                short_learning=self.short_learning,
                                device=self.device, dtype=self.dtype)
            self.made[index, reference] = result.elements, alignment_summary(result)
        return self.made[index, reference][0]

    def summaries(self, reference: int) -> tuple[dict | None, ...]:
        """Per model, what its alignment onto ``reference`` kept (None for the reference, and any not made)."""
        return tuple(self.made[i, reference][1] if (i, reference) in self.made else None
                     for i in range(len(self.subjects)))


def _datasets_for(data, subjects, batch_size, limit, split) -> list:
    """One dataset per model: a single SPEC or Dataset serves every model; a sequence gives each its own."""
    from .datasets import load_data

    specs = list(data) if isinstance(data, (list, tuple)) else [data] * len(subjects)
    if len(specs) != len(subjects):
        raise DataError(f"Got {len(specs)} data specs for {len(subjects)} models.",
                        hint="give one --data for all models, or one per model in the models' order.")
    return [load_data(spec, model=s, batch_size=batch_size, limit=limit, split=split)
            for spec, s in zip(specs, subjects)]


def _model_with(subject: Subject, state: State) -> torch.nn.Module:
    """A private copy of the subject's model holding ``state``, in at least float32 (statistics need the range)."""
    model = copied_module(subject.model)
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    model.to(dtype).load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})
    return model


def _finished_state(merged: State, subjects, consensus: Consensus, head_from, exclude) -> State:
    """Merged body, head copied from ``head_from``'s aligned state, non-float entries from the reference; every
    tensor in the widest dtype the models store it in."""
    reference = consensus.states[consensus.reference]
    head_state = consensus.states[head_from] if head_from is not None else reference
    originals = [s.state_dict() for s in subjects]
    out = {}
    for k, v in reference.items():
        if k in exclude:
            out[k] = head_state[k].to(originals[head_from][k].dtype)
        elif k in merged:
            out[k] = merged[k].to(widest_dtype(o[k].dtype for o in originals))
        else:
            out[k] = v
    owner = subjects[head_from if head_from is not None else consensus.reference]
    return tie_aliases(owner.model, out)


def _with_aliases(model: torch.nn.Module, names: set[str]) -> set[str]:
    from .verify import _aliases

    out = set(names)
    for group in _aliases(model):
        if out & set(group):
            out |= set(group)
    return out


class _Clock:
    """Wall-clock laps, in seconds, for a result's ``timings``."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.times: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = now - self.last
        self.last = now

    def laps(self) -> dict[str, float]:
        return {**self.times, "total": time.perf_counter() - self.start}
