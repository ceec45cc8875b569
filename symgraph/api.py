"""The Python API behind every CLI command: load, analyse, sample, transform.

Examples
--------
>>> import symgraph, torch
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
>>> report = symgraph.analyze(mlp, inputs=(torch.randn(2, 4),))
>>> [(g.motif, g.kind, g.size, g.scale) for g in report.groups]
[('ffn', 'permutation', 8, 'positive')]
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from .analysis import analyse_capture
from .capture import Capture, added_inputs_note, capture, lengthened_note, unread_note
from .elements import Element, apply, sample
from .errors import CaptureError, InvarianceError, ModelLoadError, SymgraphError
from .inputs import in_some_form
from .report import Report
from .verify import tie_aliases

_log = logging.getLogger(__name__)
# full mode's synthetic activations are left out where the graph at the examples' shape has more than this many
# times the nodes of the model's own capture (transformers: the same; RecurrentGemma 377 -> 2070 at 128 tokens)
GROWN_GRAPH = 2
# with data that teaches learning no soft targets (token ids: :func:`symgraph.learn.mixes_inputs`), full mode's
# short learning also learns on synthetic examples, kept where the data judges it better: the causal LMs learned
# more from their own samples with both models' soft targets than from the text's next characters (test barriers,
# 11 points, data's batches / synthetic: llama-chars 0.796 / 0.716, the wide LLaMA 0.405 / 0.327). The ViTs, whose
# digits are mixed and distilled on, learned more from them (vit-digits 0.722 / 0.986, judged 0.39 / 0.49; the
# wide ViT judged 0.36 / 0.93 after 60 s of inverting images): no synthetic candidate there.
SYNTHETIC_LEARNED = "learned (synthetic)"

Inputs = tuple | dict | None


@dataclass
class Subject:
    """A model ready for analysis: the module, where it came from, and the example inputs it is traced with."""

    model: torch.nn.Module
    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    config: Any = None
    path: Path | None = None
    config_only: bool = False
    inputs_from_config: bool = False  # the example inputs were built by symgraph (inputs.example_inputs)
    full_depth: bool = False  # analyse every block even when the blocks repeat (see symgraph.depth)
    free_outputs: bool = False  # residual-read outputs move with the residual stream (see symgraph.outputs)
    weights_from_path: bool = False  # ``path`` holds exactly these weights (a job may read them from there)
    # parameters stored narrower than the model holds them (a checkpoint of mixed dtypes, loaded in the widest)
    stored_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    _capture: Capture | None = None
    _report: Report | None = None

    @property
    def capture(self) -> Capture:
        if self._capture is None:
            # inputs built from the config may need a form no config states (an attention mask for LongT5, an
            # axis of choices for a multiple-choice head: symgraph.inputs.other_forms)
            self._capture, _ = in_some_form(self.kwargs, lambda kwargs: capture(self.model, self.args, kwargs),
                                            others=self.inputs_from_config, failing=CaptureError)
            self.kwargs = self._capture.kwargs  # checks run where the groups were found (optional inputs added)
        return self._capture

    @property
    def report(self) -> Report:
        if self._report is None:
            from .depth import analyse_by_repeats
            from .fold import residual_note

            notes = ("captured with meta parameters: no weight memory was allocated",) if self.config_only else ()
            if not self.config_only:  # meta weights cannot run; a config's model has no shape branches we know of
                from .branches import check_traced_paths
                from .probes import every_probe

                check_traced_paths(self.capture, every_probe(self.model, self.args, self.kwargs))
            repeats = None if self.full_depth else analyse_by_repeats(self)
            analysis = repeats or analyse_capture(self.capture, free_outputs=self.free_outputs)
            why = residual_note(None if self.config_only else self.capture, analysis.groups, self.config_only)
            notes += (why,) if why else ()
            if self._capture is not None:
                notes += tuple(n for n in (added_inputs_note(self._capture), lengthened_note(self._capture),
                                          unread_note(self._capture)) if n)
            self._report = Report.from_analysis(self.name, analysis, notes,
                                                free_outputs=self.free_outputs)
        return self._report

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's tensors, each in the dtype its checkpoint stores it in (results are written in it)."""
        return {k: v.detach().to(self.stored_dtypes.get(k, v.dtype)) for k, v in self.model.state_dict().items()}


def load(source, inputs: Inputs = None, *, config_only: bool = False, full_depth: bool = False,
         free_outputs: bool = False) -> Subject:
    """Turn a model, a Hugging Face folder, a config.json or a ``module:factory`` string into a :class:`Subject`.

    A factory may return a module, or ``(module, args)`` / ``(module, args, kwargs)`` with its example inputs.
    A model whose blocks repeat is analysed from a shallow copy and its groups replicated
    (:mod:`symgraph.depth`; same report, time independent of depth); ``full_depth`` analyses every block instead.
    With ``free_outputs`` (base models, sentence encoders), outputs that are residual-stream reads (hidden states)
    may change basis by the residual stream's element instead of pinning it (:mod:`symgraph.outputs`); every
    check then compares them after undoing that element. A :class:`Subject` given as ``source`` is returned as
    it is, unless ``free_outputs`` asks for more than it has (then a copy that frees them).
    """
    if isinstance(source, Subject):
        if free_outputs and not source.free_outputs:
            return dataclasses.replace(source, free_outputs=True, _report=None)
        return source
    from .io import load_model

    loaded = load_model(source, config_only=config_only)
    given = inputs if inputs is not None else loaded.inputs
    args, kwargs = _inputs_for(loaded.model, loaded.config, given)
    return Subject(loaded.model, loaded.name, args, kwargs, loaded.config, loaded.path, config_only,
                   inputs_from_config=given is None, full_depth=full_depth, free_outputs=free_outputs,
                   weights_from_path=loaded.path is not None and not config_only, stored_dtypes=loaded.stored_dtypes)


def analyze(source, inputs: Inputs = None, *, config_only: bool = False, full_depth: bool = False,
            free_outputs: bool = False) -> Report:
    """Find every symmetry group of ``source`` (see :func:`load` for what it may be and for ``free_outputs``).

    Examples
    --------
    >>> import symgraph, transformers
    >>> from symgraph import zoo
    >>> encoder = transformers.AutoModel.from_config(zoo.tiny_config("bert"))  # outputs: hidden states, pooled
    >>> [g.kind for g in symgraph.analyze(encoder).by_motif("residual")]  # the hidden states pin the stream
    []
    >>> report = symgraph.analyze(encoder, free_outputs=True)
    >>> [(f.name, f.group == report.by_motif("residual")[0].id) for f in report.free_outputs]
    [('last_hidden_state', True)]
    """
    return load(source, inputs, config_only=config_only, full_depth=full_depth, free_outputs=free_outputs).report


def sample_elements(report: Report, seed: int = 0, spread: float = 0.3) -> list[Element]:
    """One random element of every group in ``report``."""
    rng = np.random.default_rng(seed)
    return [sample(g, rng, spread) for g in report.groups]


def transform(source, *, seed: int = 0, inputs: Inputs = None, verify: bool = True,
              free_outputs: bool = False) -> dict[str, torch.Tensor]:
    """A functionally equivalent, randomly reparametrised copy of the model's state dict.

    The copy is checked in float64 on the example inputs before it is returned; a violation raises
    :class:`~symgraph.errors.InvarianceError` naming the groups involved. With ``free_outputs`` (see
    :func:`load`) the copy's free outputs are those of the original moved by the residual stream's element.
    """
    return transformed(load(source, inputs, free_outputs=free_outputs), seed, verify)[0]


def transformed(subject: Subject, seed: int = 0, verify: bool = True):
    """``(state, outcome)``: :func:`transform`'s state dict, and its check's outcome (None without ``verify``)."""
    state = subject.state_dict()
    elements = sample_elements(subject.report, seed)
    new = tie_aliases(subject.model, apply(state, elements))  # float64 arithmetic, one rounding to each dtype
    return new, (check_transformed(subject, new, elements) if verify else None)


def check_transformed(subject: Subject, state: dict[str, torch.Tensor], elements=()):
    """Run ``subject``'s model with ``state`` and with its own weights, both in float64, on its example inputs;
    return the :class:`~symgraph.verify.Outcome` (relative error, and a tolerance that allows the rounding of
    weights stored in float32/fp16/bf16), or raise :class:`~symgraph.errors.InvarianceError` when it is exceeded.
    ``elements`` (those that gave ``state``) are undone on free outputs before the comparison."""
    from .verify import Evaluator

    outcome = Evaluator.of(subject).check(state, elements, rounding_floor=True)
    if not outcome.ok:
        raise InvarianceError(
            f"The transformed model differs from the original ({outcome.describe()}); nothing was written.",
            hint="run `symgraph fuzz` on the model to find the group at fault, and report it as a bug.")
    return outcome


def _given_inputs(inputs) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of the example inputs a caller gave (None: none given)."""
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict) \
            and isinstance(inputs[0], tuple):
        return inputs[0], dict(inputs[1])
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    return None


def _inputs_for(model, config, inputs) -> tuple[tuple, dict]:
    given = _given_inputs(inputs)
    if given is not None:  # a cache would be returned beside the outputs, and torch.export cannot trace it
        args, kwargs = given
        takes = inspect.signature(model.forward).parameters
        if config is not None and "use_cache" in takes and "use_cache" not in kwargs:
            from .inputs import without_cache

            kwargs = {**kwargs, **without_cache(config)}
        return args, kwargs
    if config is not None:
        from .inputs import forward_kwargs, model_example_inputs

        return (), {**model_example_inputs(model, config), **forward_kwargs(config)}
    raise ModelLoadError(f"No example inputs for {type(model).__name__}: it has no Hugging Face config to build "
                         f"them from.", hint="pass inputs=(tensor, ...) in Python, or make the factory return "
                                             "(module, args).")


def align(source, anchor, *, mode: str = "full", only: str | None = None, rescale: bool = True,
          layers: tuple[int, int] | None = None, refine_rounds: int | None = None, tolerance: float = 1e-4,
          matching_start: bool = True, fold: bool | None = False, general_linear: bool = False,
          inputs: Inputs = None, verify: bool = True, progress=None, data=None, data_batches: int = 4,
          data_batch_size: int = 16, data_groups: str = "residual", learn=False, learn_data=None,
          free_outputs: bool = False, device="cpu", dtype=None, balance: bool = False, residual: str = "auto",
          judge_starts: bool = True, synthetic_activations: bool = True, short_learning: bool = True,
          untie: bool | None = None):
    """Move ``source`` inside its symmetry groups as close to ``anchor`` as they allow.

    ``source`` and ``anchor`` are anything :func:`load` accepts. ``mode`` is ``full`` (every detected group,
    the best solver for each, coordinate descent until nothing improves), ``paper`` (the paper's algorithm:
    per-head QK/VO rotations with heads in fixed order, the scalar rescale, one Hungarian per FFN) or
    ``permutation`` (permutations only, weight matching). ``only``, ``rescale`` and ``layers`` are the ablations.
    After the first pass, coordinate descent runs at most ``refine_rounds`` rounds (default 8, or 100 when the
    residual stream is orthogonal: :func:`symgraph.alignment.default_rounds`) and stops once a round lowers
    the distance by less than ``tolerance`` of itself (``paper`` mode never refines). With ``matching_start``
    (the default; full and permutation modes), unless the first pass recovers the source exactly, a second
    descent starts from textbook weight matching of the permutations. Without ``data``, and with
    ``judge_starts`` (the default), the start whose aligned source has the lower loss along the path on a little
    synthetic data (:class:`symgraph.synthetic.PathJudge`; classifiers and causal LMs with a Hugging Face config)
    is kept, in permutation mode among the starts no farther than the textbook; otherwise full mode keeps the closer
    result and permutation mode the weight-matched one (:func:`symgraph.alignment.align_states`;
    ``result.path_losses`` holds each judged start's loss). Without ``data``, and with ``synthetic_activations``
    (the default) as well, full mode also aligns on activations of those synthetic examples (as with ``data``,
    below) and keeps that alignment where its path loss on them is lower (``result.costs``, ``cost_data`` and
    ``path_losses`` say so; not where the weights removed most of the distance, a reparametrised source, nor
    before learning, which starts from the weight-matched alignment). Without ``data``, and with
    ``short_learning`` (the default) as well, where the path still rises above its ends on those examples,
    full mode then tunes the weight-matched alignment by a short learned matching (:mod:`symgraph.learn`, 50-300 steps)
    on other synthetic examples and keeps it where its path loss on the judge's examples is lower
    (``result.learned`` holds its record, ``path_losses`` its loss as ``learned``; test barriers of the shipped
    pairs: examples/RESULTS.md). Without ``data``, full mode's weight matching never returns a source farther
    from the anchor than it was (where every start ends farther, the source is returned unmoved, and
    ``result.start`` is then ``none``); only an alignment kept for its lower path loss may end farther.
    With ``fold`` both models are first folded (:func:`symgraph.fold`): the residual stream then has an
    orthogonal group, and the result is the folded source moved within it (same architecture and function).
    Off by default: the result is then in the folded frame and must be compared with (or merged into) the
    folded anchor, as :func:`symgraph.merge` and :func:`symgraph.barrier` do (they fold by default where it pays
    off); ``None`` folds where it pays off (:func:`symgraph.fold.pays_off`), and where the norms cannot be folded
    after all leaves both models unfolded; ``result.folded`` says what was done, ``result.fold_note`` why not.
    Where folding, tied weights (an embedding that is also the LM head) first get tensors of their own
    (:func:`symgraph.fold.untied`) where the tie keeps the final norm from folding into the head (``untie`` None),
    always (True) or never (False: such a fold is refused, or skipped with ``fold`` None); ``result.untied`` names
    them and ``result.config`` is then the untied model's config (save the result with it).
    With ``general_linear`` (full mode) QK and VO groups whose exact group is GL(d_head) are aligned in it
    (least squares from either side or Procrustes, whichever is closest, maps worse conditioned than 100 refused)
    instead of in its orthogonal subgroup. With ``balance`` (full mode) each parameter's cost is counted in units
    of its anchor's RMS (:func:`symgraph.alignment.balanced_weights`: lower barriers on folded pairs but one,
    higher on unfolded ones). ``residual`` (full mode, folded models) is the group an orthogonal residual stream is
    aligned in: ``orthogonal``, ``permutation`` (its permutations), or ``auto``, the default: without ``data``,
    permutations for a LayerNorm stream between independent models, the whole group otherwise
    (:func:`symgraph.alignment.residual_group`; ``result.residual`` says which); with ``data``, the whole group.
    With ``free_outputs`` (see :func:`load`; base models and sentence encoders) the residual stream is aligned too,
    and the result's free outputs are the source's moved by the residual element it applied (``result.elements``).
    ``device`` (``cpu`` or ``cuda``) and ``dtype`` (``float32`` or ``float64``) say where and in what the alignment
    computes (:func:`symgraph.alignment.align_states`); a device this machine lacks or another dtype is refused
    before anything is loaded.
    ``progress``: True shows a bar per stage (and one for learning) on stderr, only on a terminal; None (the
    default) or False, none; a callable is called as ``progress(stage, group, done, total)`` after every solve.

    With ``data`` (a data SPEC, train split unless it names one, or a :class:`~symgraph.datasets.Dataset`),
    costs come from activations (:mod:`symgraph.activations`): ``data_batches`` batches of ``data_batch_size``
    examples run through both models, and the groups ``data_groups`` names (``residual``: the residual stream,
    the default; ``all``: every group) are matched on the activations that carry their coordinates, first; the
    other groups, and those no activation carries, then on weights (``result.costs`` says which). The data-free
    alignment is computed too, and the one whose interpolated model has the lower loss on those batches is kept
    (:func:`lowest_path_loss`; ``result.path_losses`` holds both). In full mode, with ``short_learning`` (the
    default) and without ``learn``, the weight-matched alignment is then tuned by the same short learned matching
    as without data, on the data's other batches and, for data learning cannot mix (token ids), also on synthetic
    examples (:mod:`symgraph.synthetic`, where they can be made; :data:`SYNTHETIC_LEARNED`), and a tuned one is
    kept where its path loss on the costs' batches is lower (test barriers, 11 points, with it and without:
    llama-chars 0.716 and 1.645, vit-digits 0.722 and 1.507, the wide ViT 0.661 and 0.758, the wide LLaMA 0.327
    and 1.104). Models past a judge's bounds learn nothing (:data:`symgraph.synthetic.JUDGE_MAX_PARAMETERS`).

    With ``learn`` (True, or a :class:`symgraph.learn.LearnOptions`) that alignment is then tuned on the loss of
    the interpolated model on the training split of ``data`` (required): :mod:`symgraph.learn`.
    ``result.learned`` says what it did. ``learn_data`` (a SPEC or a Dataset) is learned on instead of ``data``;
    without ``data`` learning then starts from the weight-matched alignment, which ends lower on some pairs
    (examples/results/learn.json).

    Returns :class:`symgraph.alignment.AlignResult`: the aligned state dict in the source's dtype, every element
    applied, per-group distances and the time per stage. With ``verify`` the aligned model is first checked to
    compute what the source computes; otherwise :class:`~symgraph.errors.InvarianceError` names the group at
    fault and nothing is returned. Neither model is modified.

    Examples
    --------
    >>> import symgraph, torch
    >>> from symgraph import zoo
    >>> a, b = zoo.build("bert", seed=0), zoo.build("bert", seed=1)
    >>> inputs = zoo.example_inputs_for("bert", a)
    >>> result = symgraph.align(symgraph.load(b, inputs), symgraph.load(a, inputs))
    >>> result.distance_after < result.distance_before
    True
    """
    from .alignment import (align_states, check_same_architecture, compute_device, compute_dtype,
                            free_cost_members, relative_distance, select_groups)
    from .datasets import Dataset
    from .fold import untied_by_fold
    from .learn import mixes_inputs, written_by
    from .progress import StageBars, stage_callback
    from .synthetic import SPEC, PathJudge
    from .verify import Evaluator

    if learn_data is not None and not learn:
        from .learn import LearnError

        raise LearnError("learn_data is what learned matching learns on, and learning was not asked for.",
                         hint="pass --learn (learn=True) with --learn-data, or leave --learn-data out.")
    bars = StageBars()
    report = stage_callback(progress, bars)
    learn_data = data if learn_data is None else learn_data
    check_learn(learn, learn_data)
    device, dtype = compute_device(device), compute_dtype(dtype)
    timings = {}
    clock = time.perf_counter()
    src, anc = load(source, inputs, free_outputs=free_outputs), load(anchor, inputs, free_outputs=free_outputs)
    dataset = _alignment_data(data, src, data_batch_size, learn)
    timings["load"] = time.perf_counter() - clock
    clock = time.perf_counter()
    # reads both reports: capture and analysis (and folding, if asked) happen here
    loaded = src
    src, anc, folded, fold_note = folded_pair(src, anc, fold, check_same_architecture, untie)
    timings["analyse"] = time.perf_counter() - clock
    clock = time.perf_counter()
    _check_layers(layers, src.report.groups)
    groups = select_groups(src.report.groups, mode, only=only, rescale=rescale, layers=layers,
                           general_linear=general_linear)
    state = src.state_dict()
    evaluator = Evaluator.of(src) if verify or mode != "paper" else None  # one float64 copy
    free = free_cost_members(src, groups, mode, evaluator)
    timings["free_parameters"] = time.perf_counter() - clock
    anchor_state = anc.state_dict()
    moved = written_by(groups)  # of tied names, the one the elements write is the one a path loss reads
    with bars:
        options = dict(mode=mode, rescale=rescale, rounds=refine_rounds, tolerance=tolerance,
                       matching_start=matching_start, progress=report, cost_excluded=free, device=device, dtype=dtype,
                       balance=balance, residual=residual)
        if dataset is None:  # the starts are judged by their path loss on synthetic data where it can be made
            judge = PathJudge(src.model, state, anchor_state, written=moved) if judge_starts else None
            result = align_states(groups, state, anchor_state, **options, judge=judge)
            # learning starts from the weight-matched alignment: from activations it ended higher on llama-chars
            on_weights = result
            if judge is not None and mode == "full" and not learn:
                if synthetic_activations:
                    result = _or_synthetic_activations(result, judge, src, anc, groups, state, anchor_state,
                                                       data_groups, options, timings)
                if short_learning:  # result.path_loss: measured on the judge's examples inverted, if judged
                    result = _or_short_learning(result, on_weights, judge.examples.inverted, {"learned": SPEC},
                                                src, groups, state, anchor_state, free, bool(report), timings,
                                                result.path_loss, without_data=True)
        else:
            on_activations = _on_activations(src, anc, groups, state, anchor_state, dataset, data_batches,
                                             data_groups, options, timings)
            clock = time.perf_counter()
            on_weights = align_states(groups, state, anchor_state, **options)
            on_weights.costs = {g.id: "weights" for g in groups}
            timings["align_on_weights"] = time.perf_counter() - clock
            result = lowest_path_loss({"activations": on_activations, "weights": on_weights}, src.model, anchor_state,
                                      dataset, data_batches, written=moved)
            if mode == "full" and short_learning and not learn:  # judged where the costs were, learned on the rest
                judged = Dataset(dataset.name, dataset.task, dataset.batches[:data_batches])
                rest = Dataset(f"{dataset.name} (after the {len(judged.batches)} batches of its costs)", dataset.task,
                               dataset.batches[data_batches:])
                learn_on = {"learned": rest if rest.batches else None,
                            SYNTHETIC_LEARNED: None if mixes_inputs(judged) else SPEC}
                if not rest.batches:
                    _log.info("full mode learns %s: the data has no batches besides those its costs were computed on",
                              "nothing" if learn_on[SYNTHETIC_LEARNED] is None else "on synthetic examples only")
                result = _or_short_learning(result, on_weights, lambda: judged, learn_on, src, groups, state,
                                            anchor_state, free, bool(report), timings,
                                            result.path_loss)  # measured on those batches just above
        if learn:
            clock = time.perf_counter()
            result = learned(src, groups, state, anchor_state, result, learn_data, learn, free, bool(report))
            timings["learn"] = time.perf_counter() - clock
    result.state = tie_aliases(src.model, result.state)
    result.distance_after = relative_distance(result.state, anchor_state)  # tied copies now follow
    result.free = [m.param for m in free]
    result.folded, result.fold_note = folded, fold_note
    result.config, result.untied = src.config, untied_by_fold(loaded.model, src.model) if folded else []
    if verify:
        clock = time.perf_counter()
        _verify_alignment(evaluator, state, result)
        timings["verify"] = time.perf_counter() - clock
    result.timings = {**timings, **result.timings}
    return result


def _on_activations(src: Subject, anc: Subject, groups, state, anchor_state, data, batches: int, data_groups: str,
                    options: dict, timings: dict, max_nodes: int | None = None):
    """``state`` aligned to ``anchor_state`` with activation costs on ``batches`` batches of ``data``
    (:func:`symgraph.activations.align_on_activations`; an orthogonal residual stream in its whole group)."""
    from .activations import align_on_activations, data_cost_groups, record

    clock = time.perf_counter()
    recording = record(src, anc, groups, data, batches=batches,
                       use={g.id for g in data_cost_groups(groups, data_groups)}, max_nodes=max_nodes)
    timings["record_activations"] = time.perf_counter() - clock
    clock = time.perf_counter()
    residual = "orthogonal" if options["residual"] == "auto" else options["residual"]
    result = align_on_activations(groups, state, anchor_state, recording, data_groups=data_groups,
                                  **{**options, "residual": residual})
    timings["align_on_activations"] = time.perf_counter() - clock
    result.cost_data = data.name
    return result


def _or_synthetic_activations(on_weights, judge, src: Subject, anc: Subject, groups, state, anchor_state,
                              data_groups: str, options: dict, timings: dict):
    """Full mode without data: ``on_weights``, or the alignment with activation costs on the judge's synthetic
    examples (the models' own samples, or random inputs of the config's shapes) where its path loss is lower on
    them (inverted, for a classifier's pixels: :meth:`symgraph.synthetic._JudgeExamples.inverted`) and it is no
    farther from the anchor than the source began (full mode's promise). Skipped where the weights found the
    reparametrisation the source is (most of its distance removed) or no synthetic data can be made. Measured on
    the trained pairs (test split, 11 points; examples/RESULTS.md): the wide ViT 2.354 -> 0.571 (real data gave
    0.588), llama-chars 1.930 -> 1.583, vit-digits 3.262 -> 2.888."""
    from .alignment import found_share, recovered
    from .learn import written_by

    if recovered(on_weights.distance_after, on_weights.distance_before, found_share("full")):
        return on_weights
    examples = judge.examples()
    if examples is None:
        return on_weights
    try:
        # a candidate only: a graph that grows with the examples' length costs its analysis again, at that length
        own = src._capture  # the capture the report came from, when it was made (not made again for this)
        on_activations = _on_activations(src, anc, groups, state, anchor_state, examples, len(examples.batches),
                                         data_groups, options, timings,
                                         None if own is None else GROWN_GRAPH * len(own.graph.nodes))
    except (SymgraphError, RuntimeError, ValueError) as error:  # a candidate only: its failure costs the default
        _log.info("full mode keeps the weight-matched alignment: activations of %s could not be aligned on "
                  "(%s: %s)", examples.name, type(error).__name__, error)
        return on_weights
    if on_activations.distance_after > on_weights.distance_before:
        return on_weights
    on_weights.costs, on_weights.cost_data = {g.id: "weights" for g in groups}, examples.name
    clock = time.perf_counter()
    judged = judge.examples.inverted()
    starts = on_weights.path_losses
    result = lowest_path_loss({"weights": on_weights, "activations": on_activations}, src.model, anchor_state,
                              judged, len(judged.batches), written=written_by(groups))
    result.path_losses = {**starts, **result.path_losses}
    timings["judge_costs"] = time.perf_counter() - clock
    return result


def _or_short_learning(aligned, on_weights, judged_examples, learn_on: dict, src: Subject, groups, state, anchor_state,
                       free, progress: bool, timings: dict, along: float | None = None, without_data: bool = False):
    """Full mode's last step: ``aligned`` (the alignment kept so far), or ``on_weights`` (the weight-matched one)
    tuned by a short learned matching (steps and checks: :data:`symgraph.learn.SHORT_LEARNING_STEPS` and the rest)
    on each data of ``learn_on`` (candidate name -> data; None: none there), whichever has the lowest path loss on
    the examples ``judged_examples()`` gives (None: no judge, no learning). Without data, those are the judge's
    synthetic examples and ``learn_on`` holds other synthetic examples (the models' own samples, or a classifier's
    inverted inputs, the endpoints' mean prediction as soft targets); with data, the batches the activation costs
    were computed on, and ``learn_on`` the data's other batches and, for token data, synthetic examples, which
    taught the causal LMs more (the data judged which to keep; :data:`SYNTHETIC_LEARNED`). Skipped where
    the weights found the reparametrisation the source is, where the groups aligned have no continuous part to learn
    (``only``, ``layers``), where the model has more parameters than a judge makes examples for
    (:data:`symgraph.synthetic.JUDGE_MAX_PARAMETERS`), or with data whose forward pass over the judged batches
    writes more tensor elements than a judge's examples may (:data:`~symgraph.synthetic.JUDGE_MAX_ELEMENTS`): its
    steps with a backward pass cost far more than aligning it, and where the path of ``aligned`` on the judged
    examples rises above the line between its ends by no more than :data:`~symgraph.learn.SHORT_LEARNING_RISE` of
    their loss: no barrier for learning to lower (fine-tunes, random twins), or one the synthetic examples hardly
    show (:mod:`symgraph.learn`); ``along``: the path loss of ``aligned`` on those examples, where the caller has
    measured it there (None: measured here). ``without_data``: the judged examples are a judge's own, bounded when
    made. A learned alignment is kept for its path loss, wherever it ends: held to end no farther from the anchor
    than the source began, a held-out ViT pair (width 64, 4 layers) kept its activations' alignment, test barrier
    1.718, where the learned one (0.6887 from A against 0.6772) gave 1.409, and vit-digits aligned in its attention
    groups only lost its learning (merged loss 1.813 -> 2.616). ``result.learned`` holds the record where one is
    kept.
    Learned from the activations' alignment instead, the judge ranked the two starts' outcomes as their test
    barriers did (llama-chars 0.626 against 0.695 from weights, vit-digits 1.300 against 0.986; sequences of 128
    tokens): from the weights, both pairs meet 0.35x of their unaligned barrier, and one learning costs half of two."""
    from .alignment import found_share, recovered
    from .consensus import shared_float_names
    from .learn import (SHORT_LEARNING_CHECKS, SHORT_LEARNING_RISE, SHORT_LEARNING_STEPS, SYNTHETIC_LEARNING_EXAMPLES,
                        SYNTHETIC_LEARNING_LENGTH, LearnError, LearnOptions, check_learnable, path_and_end_losses,
                        short_learning_steps, written_by)
    from .synthetic import JUDGE_MAX_ELEMENTS, JUDGE_MAX_PARAMETERS, elements_per_example, parameters_over

    if recovered(on_weights.distance_after, on_weights.distance_before, found_share("full")):
        return aligned
    options = LearnOptions(steps=SHORT_LEARNING_STEPS[0], checks=SHORT_LEARNING_CHECKS,
                           synthetic_examples=SYNTHETIC_LEARNING_EXAMPLES, synthetic_length=SYNTHETIC_LEARNING_LENGTH,
                           seed=1)
    try:
        check_learnable(groups, options)
    except LearnError as error:  # groups chosen with --only or --layers may hold no continuous part
        _log.info("full mode learns nothing: %s", error)
        return aligned
    size = parameters_over(src.model, JUDGE_MAX_PARAMETERS)
    if size is not None:
        _log.info("full mode learns nothing: %s has %s parameters, more than the %s a short learning runs on",
                  type(src.model).__name__, f"{size:,}", f"{JUDGE_MAX_PARAMETERS:,}")
        return aligned
    learn_on = {name: data for name, data in learn_on.items() if data is not None}
    if not learn_on:
        return aligned
    judged = judged_examples()
    if judged is None:
        return aligned
    per_example = elements_per_example(src.model, state, judged)
    # without data the judge's examples were bounded when made; data given is bounded here, as they were
    cost = None if without_data or per_example is None else per_example * len(judged)
    if cost is not None and cost > JUDGE_MAX_ELEMENTS:
        _log.info("full mode learns nothing: one forward pass of %s over %s writes %s tensor elements, more than the "
                  "%s a judge's examples may cost", type(src.model).__name__, judged.name, f"{cost:,}",
                  f"{JUDGE_MAX_ELEMENTS:,.0f}")
        return aligned
    clock = time.perf_counter()
    moved = written_by(groups)
    along, ends = path_and_end_losses(src.model, anchor_state, aligned.state,
                                      shared_float_names(anchor_state, frozenset()), judged, along=along,
                                      written=moved)
    timings["judge_rise"] = time.perf_counter() - clock
    rise = along - ends
    if not rise > SHORT_LEARNING_RISE * abs(ends):
        _log.info("full mode learns nothing: its path rises %.3g above its ends' loss %.3g on %s", rise, ends,
                  judged.name)
        return aligned
    clock = time.perf_counter()
    options = dataclasses.replace(options, steps=short_learning_steps(per_example, options.batch_size))
    candidates = {}
    for name, data in learn_on.items():
        try:
            tuned = learned(src, groups, state, anchor_state, on_weights, data, options, free, progress)
        except (SymgraphError, RuntimeError, ValueError) as error:  # a candidate only: its failure costs nothing
            _log.info("full mode does not keep the alignment %s: learning on %s failed (%s: %s)", name,
                      getattr(data, "name", f"{data} data"), type(error).__name__, error)
            continue
        candidates[name] = tuned
    timings["short_learning"] = time.perf_counter() - clock
    if not candidates:
        return aligned
    earlier = aligned.path_losses
    result = lowest_path_loss({"aligned": aligned, **candidates}, src.model, anchor_state, judged,
                              len(judged.batches), known={"aligned": along}, written=moved)
    result.path_losses = {**earlier, **result.path_losses}
    return result


def lowest_path_loss(candidates: dict, model, anchor_state, data, batches: int, known: dict | None = None,
                     written: frozenset[str] = frozenset()):
    """The candidate alignment (name -> AlignResult) whose interpolated model has the lowest mean loss at t = 1/4,
    1/2, 3/4 on the first ``batches`` batches of ``data`` (:func:`symgraph.learn.path_loss`; ``known``: name ->
    that loss, already measured there, not measured again; ``written``: the names the candidates' elements write,
    :func:`symgraph.learn.written_by`), every candidate's loss in its ``path_losses``.
    Activation costs and weight costs each win on some pairs (examples/RESULTS.md: activations on vit-digits and
    llama-chars, weights on bert-topics and vit-digits-wide), and distance does not rank barriers, so with data at
    hand the data decides; the first candidate wins a tie (and any non-finite loss)."""
    from .alignment import tied_lowest
    from .consensus import shared_float_names
    from .learn import path_loss

    names = shared_float_names(anchor_state, frozenset())
    try:
        losses = {name: known[name] if name in (known or {}) else
                  path_loss(model, anchor_state, c.state, names, data, batches, written)
                  for name, c in candidates.items()}
    except (ValueError, RuntimeError) as err:  # e.g. a base model's hidden states against next-token labels
        first = next(iter(candidates))
        warnings.warn(f"The data gives no {data.task} loss on this model ({err}); the {first} alignment is kept "
                      f"without comparing it with the others ({', '.join(list(candidates)[1:])}).", stacklevel=2)
        return candidates[first]
    kept = tied_lowest(losses)[0]  # a later one must be lower by more than rounding (equal merges)
    result = candidates[kept]
    result.path_losses, result.judged_on, result.path_loss = losses, data.name, losses[kept]
    return result


def learned(subject: Subject, groups, state, anchor_state, start, data, learn, free, progress: bool,
            exclude: frozenset[str] = frozenset()):
    """``start`` (an alignment of ``state`` to ``anchor_state`` within ``groups``) tuned by learned matching on the
    training split of ``data`` (:func:`symgraph.learn.learn_alignment`); ``learn`` is True or the options."""
    from .consensus import shared_float_names
    from .learn import LearnOptions, check_learnable, learn_alignment, training_data

    options = (learn if isinstance(learn, LearnOptions) else LearnOptions()).checked()
    check_learnable(groups, options)  # before the data is made
    dataset = training_data(data, subject, options, (state, anchor_state))
    result, record = learn_alignment(groups, state, anchor_state, start, model=subject.model, data=dataset,
                                     names=shared_float_names(anchor_state, exclude), options=options,
                                     cost_excluded=free, progress=progress)
    result.learned = {**record.to_json(), "data": dataset.name}
    return result


def check_learn(learn, data) -> None:
    """Learned matching needs data, and its options must be in range (checked before any work)."""
    from .learn import LearnError, LearnOptions

    if learn is False or learn is None:
        return
    if data is None:
        raise LearnError("Learned matching optimises the loss of the interpolated model on data, and none was given.",
                         hint="pass --data SPEC (e.g. digits, pydoc-chars, FILE.txt) with --learn; its training "
                              "split is used.")
    if isinstance(learn, LearnOptions):
        learn.checked()
    elif learn is not True:
        raise LearnError(f"learn must be True, False or a LearnOptions, not {learn!r}.")


def _alignment_data(data, subject: Subject, batch_size: int, learn=False):
    """The data activation costs are computed on (None without data): shipped specs default to their train split,
    so alignment never sees the examples a barrier is measured on. Synthetic data serves learning only: with
    ``learn`` it is left to it (None here); without, loading it says so."""
    from .datasets import load_data
    from .synthetic import is_synthetic

    if data is None or (learn and is_synthetic(data)):
        return None

    return load_data(data, model=subject, batch_size=batch_size, split="train")


def folded_pair(first: Subject, second: Subject, fold: bool | None,
                check, untie: bool | None = None) -> tuple[Subject, Subject, bool, str]:
    """Both subjects folded (untied first as ``untie`` says: :func:`symgraph.fold.fold`) when ``fold`` is True, or
    None and folding pays off; the note says why not when None fell back, or which tied weights were untied
    (:func:`symgraph.fold.folded_where_asked`). ``check(first, second, groups=...)`` refuses models that do not
    match."""
    from .fold import folded_where_asked

    (first, second), folded, note = folded_where_asked([first, second], fold,
                                                       lambda pair, groups: check(*pair, groups=groups), untie)
    return first, second, folded, note


def _check_layers(layers: tuple[int, int] | None, groups) -> None:
    """A layer range must be ordered and lie within the model's layers (else it would silently select nothing)."""
    from .alignment import layer_number
    from .errors import SymgraphError

    if layers is None:
        return
    numbers = sorted({n for n in map(layer_number, groups) if n is not None})
    lo, hi = layers
    span = f"{numbers[0]}-{numbers[-1]}" if numbers else "none"
    if lo > hi or not numbers or lo < numbers[0] or hi > numbers[-1]:
        raise SymgraphError(
            f"Layer range {lo}-{hi} is {'reversed' if lo > hi else 'outside the model'}: the model's groups lie "
            f"in layers {span}.",
            hint=f"give FIRST-LAST with FIRST <= LAST inside {span}, e.g. --layers {span}.")


def _verify_alignment(evaluator, state, result) -> None:
    """The aligned state must compute what the source computes; if not, name the first group whose own
    elements already change the function."""
    from .elements import apply

    outcome = evaluator.check(result.state, result.elements, rounding_floor=True)
    if outcome.ok:
        result.verified_error, result.verified_tolerance = outcome.relative_error, outcome.tolerance
        result.verified_rounded = outcome.rounded_exact
        return
    culprits = []
    for gid in dict.fromkeys(e.group.id for e in result.elements):
        mine = [e for e in result.elements if e.group.id == gid]
        alone = evaluator.check(apply(state, mine), mine, rounding_floor=True)
        if not alone.ok:
            culprits.append(f"{gid} (error {alone.relative_error:.1e})")
    raise InvarianceError(
        f"The aligned model differs from the source ({outcome.describe()}); nothing was written. "
        + (f"Group(s) at fault: {', '.join(culprits[:4])}." if culprits else
           "No single group changes the function alone: their composition does."),
        hint="run `symgraph fuzz` on the source model and report the failing group as a bug.")
