"""Synthetic data: learned matching without a dataset.

Learned matching (:mod:`symgraph.learn`) lowers the loss of the interpolated model on data. With no data at hand,
the path can still be taught to compute what its two endpoints compute together: on inputs the models make
themselves (a causal LM's own samples, half drawn from each endpoint, from a random first token) or, for a model
that cannot generate, on random inputs of the shapes its config describes (:func:`symgraph.inputs.example_inputs`):
a classifier's pixels (or audio) are inverted, moved by a few steps of Adam until the endpoints together assign
each to a class drawn for it; token ids stay uniform. Each example's soft target is the endpoints' mean predicted
distribution (its :data:`TOP` likeliest classes; the likeliest is the label). The data SPEC ``synthetic`` asks for
it; it serves learned matching only, since its labels come from the very models being aligned (evaluation,
activation costs and Fisher/RegMean statistics need real data).

Measured (loss barrier on the real test split, 11 points, 300 steps): llama-chars, data-free full mode 1.930,
reaches 0.539 on the models' own samples with soft targets, 0.746 with the top token alone, and 1.298 (1000 steps)
on uniform random tokens; vit-digits, full mode 3.262, reaches 0.887 on inverted images and 1.385 on the Gaussian
noise they start from. examples/RESULTS.md has every pair.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .datasets import Batch, Dataset, logits_of
from .errors import DataError
from .inputs import longest_tokens, model_example_inputs
from .moe import REFERENCE, experts_implementation, use_experts_implementation
from .module_state import copied_module

__all__ = ["SPEC", "PathJudge", "is_synthetic", "learning_only", "merge_examples", "synthetic_data"]

SPEC = "synthetic"
LENGTH = 128  # tokens per sampled sequence (fewer where the model's positions run out)
TASK_LENGTH = 8  # tokens the task is found at
# what a model raises at a length it cannot take (a position table too short, a shape check): it makes no data there
CANNOT_RUN = (IndexError, RuntimeError, ValueError)
SAMPLED_TOGETHER = 128  # sequences one generate() call samples (their key-value caches are held together)
# examples inverted together: a small classifier's steps cost little more for 128 than for 32 (vit-digits, one
# thread: 0.75 s per 32 examples inverted 32 at a time, 0.35 s 128 at a time; the wide ViT's cost grows with them),
# more than a batch only while one forward over them writes at most INVERTED_ELEMENTS tensor elements (memory:
# both endpoints' passes are held for the backward; the wide ViT writes some 1e8 over 128)
INVERTED_TOGETHER, INVERTED_ELEMENTS = 128, 1e8
TOP = 64  # classes (tokens) per soft target: a large vocabulary's tail is left out (memory)
JUDGE_EXAMPLES = 64  # synthetic examples a judge scores candidate alignments or merges on
# the largest model a judge makes examples for, refused without running it (one of 58M parameters, vocabulary
# 32000, judged its starts in 274 s against 36 s of alignment)
JUDGE_MAX_PARAMETERS = 50_000_000
# the most tensor elements one forward pass over a judge's examples may write (:func:`elements_written`): a judge
# runs some 15 such passes (a classifier's inverted examples some 80), far more than the alignment's solves cost on
# models past it, which then decide without it. One thread, a pass of 64 examples: the wide LLaMA writes 3.6e8 in
# 1.8 s; a LLaMA of 7M parameters, vocabulary 8000, 4.9e8 in 2.4 s (it judged its starts in 52 s against 4 s of
# alignment); one of 58M, vocabulary 32000, 1.9e9 in 11.3 s (274 s against 36 s); a tiny inkling_text of 2.9M
# parameters with 64 heads of 128 in its sliding-window attention 1.8e9 in 8.8 s (a merge past 800 s)
JUDGE_MAX_ELEMENTS = 1e9
# model inversion of a classifier's random pixels (or audio): steps, Adam's rate, the weight of the L2 prior
INVERSION_STEPS, INVERSION_LR, INVERSION_PRIOR = 30, 0.1, 1e-3

State = dict[str, torch.Tensor]
_log = logging.getLogger(__name__)


def is_synthetic(spec) -> bool:
    """True for the data SPEC that asks for synthetic data (or a sequence of SPECs holding it)."""
    if isinstance(spec, (list, tuple)):
        return any(map(is_synthetic, spec))
    return isinstance(spec, str) and spec.strip() == SPEC


def learning_only() -> DataError:
    """The error for synthetic data asked for anything but learned matching."""
    return DataError("Synthetic data is made from the models being aligned and labelled by them: it serves "
                     "learned matching only (symgraph.synthetic).",
                     hint="use it as the data of --learn (--data synthetic --learn, or --learn-data synthetic); "
                          "evaluation, activation costs and Fisher/RegMean statistics need real data.")


def synthetic_data(model: torch.nn.Module, endpoints: Sequence[State], *, examples: int, batch_size: int,
                   seed: int = 0, invert: bool = True, max_elements: float | None = None,
                   length: int = LENGTH) -> Dataset:
    """``examples`` synthetic training examples (module docstring) in batches of ``batch_size``, labelled by the
    mean prediction of ``model`` carrying each state of ``endpoints`` (the source and the anchor of a learned
    alignment: one architecture, ``model``'s); a classifier's inputs inverted unless ``invert`` is False. ``seed``
    fixes every draw; the global random state is left as it was. With ``max_elements``, examples whose one forward
    pass would write more tensor elements than that (:func:`elements_written`) are refused before any is made.
    Sequences are ``length`` tokens (frames) long at most."""
    config = getattr(model, "config", None)
    if config is None:
        raise DataError(f"Synthetic data needs the model's Hugging Face config to know its inputs, and "
                        f"{type(model).__name__} has none.",
                        hint="pass real data (--data SPEC) to learned matching for this model.")
    from .verify import tied_copies

    tied = tied_copies(model)  # a functional call takes one name of each tie: the others are dropped once, here
    endpoints = [{k: v for k, v in state.items() if k not in tied} for state in endpoints]
    sizes = [min(batch_size, examples - start) for start in range(0, examples, batch_size)]
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        # the states may be float64 (a consensus's): experts run transformers' reference loop, which has its kernels
        with experts_implementation(model, REFERENCE):
            task = _task(model, endpoints[0], config, seed)  # before copying: a refused model costs no copy
        # one private copy: the endpoints' states are swapped into it
        twin = use_experts_implementation(copied_module(model), REFERENCE).eval()
        twin.requires_grad_(False)  # inversion differentiates the inputs only
        length = _length(twin, endpoints[0], config, seed, length)
        if max_elements is not None:
            _check_cost(twin, endpoints[0], config, length, examples, seed, max_elements)
        sampled = _samples(twin, task)
        if sampled:
            inputs, kind = _sampled_inputs(twin, endpoints, config, sizes, length, seed), "sampled"
        else:
            inputs = [model_example_inputs(twin, config, batch=size, seq=length, seed=seed + index)
                      for index, size in enumerate(sizes)]
            kind = "inverted" if invert and _invertible(task, inputs[0]) else "random"
            if kind == "inverted":
                inputs = _inverted_together(twin, endpoints, inputs)
        batches = tuple(_labelled(twin, endpoints, batch, task) for batch in inputs)
    return Dataset(f"{SPEC} ({examples} examples, {kind} inputs)", task, batches)


def _invertible(task: str, inputs: dict[str, torch.Tensor]) -> bool:
    """Whether inversion moves these inputs: a classifier's floating-point ones (pixels, audio), not token ids."""
    return task == "classification" and any(map(torch.is_floating_point, inputs.values()))


def _run(model: torch.nn.Module, state: State, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of ``model`` carrying ``state`` (one name of each tie; entries missing from it as the model has
    them), run in the widest floating dtype ``state`` holds: a checkpoint's stored dtypes (bfloat16 weights beside
    float32 norms) would meet float32 activations with bfloat16 weights."""
    from .shards import widest_dtype

    wide = widest_dtype(v.dtype for v in state.values() if v.is_floating_point())
    state = {k: v.to(wide) if v.is_floating_point() else v for k, v in state.items()}
    return logits_of(torch.func.functional_call(model, state, (), inputs, strict=False))


def _task(model: torch.nn.Module, state: State, config, seed: int) -> str:
    """``causal_lm`` for a model reading token ids that predicts a distribution per position, ``classification``
    for one that predicts one per example; anything else is refused."""
    inputs = model_example_inputs(model, config, batch=2, seq=TASK_LENGTH, seed=seed)
    try:
        logits = _run(model, state, inputs)
    except Exception as error:  # noqa: BLE001 - a model that does not run on its config's inputs makes no data
        _log.debug("%s does not run on synthetic inputs: %s: %s", type(model).__name__, type(error).__name__, error)
        logits = None
    ids = inputs.get("input_ids")
    # a causal LM reads token ids alone (an encoder-decoder's decoder ids would need their own samples)
    if (logits is not None and logits.dim() == 3 and set(inputs) == {"input_ids"} and logits.shape[:2] == ids.shape
            and logits.shape[-1] == _vocabulary(config)):
        return "causal_lm"
    if logits is not None and logits.dim() == 2 and logits.shape[0] == 2:
        return "classification"
    found = "no logits" if logits is None else f"logits of shape {tuple(logits.shape)}"
    raise DataError(f"Synthetic data is made for classifiers and causal language models; {type(model).__name__} "
                    f"returns {found} on inputs {_shapes(inputs)}.",
                    hint="pass real data (--data SPEC) to learned matching for this model.")


def _shapes(inputs: dict, per_example: bool = False) -> dict:
    """The shapes of ``inputs``' tensors (without the batch axis: ``per_example``); other entries as they are
    (Mistral 3's image sizes, Python ints)."""
    return {k: tuple(v.shape[1:] if per_example else v.shape) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}


def _vocabulary(config) -> int | None:
    """The vocabulary size of ``config``'s text model (a vision-language config keeps it in its text config)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return getattr(text, "vocab_size", None)


def _samples(model: torch.nn.Module, task: str) -> bool:
    """Whether the inputs are the models' own samples (a causal LM that can generate)."""
    can_generate = getattr(model, "can_generate", None)
    return task == "causal_lm" and callable(can_generate) and bool(can_generate())


def _sampled_inputs(model: torch.nn.Module, endpoints: Sequence[State], config, sizes: list[int], length: int,
                    seed: int) -> list[dict[str, torch.Tensor]]:
    """Batches of ``sizes`` sequences of ``length`` tokens, each sampled from one endpoint in turn (even rows from
    the first, odd ones from the second...: inputs the models themselves find likely) after a random first
    token. Each endpoint samples its rows of every batch together, :data:`SAMPLED_TOGETHER` at most per call: a
    small model's step costs little more for 128 sequences than for 16 (256 labelled examples of llama-chars, one
    thread: 7.8 s one batch at a time, 2.9 s together)."""
    count = len(endpoints)
    firsts = [model_example_inputs(model, config, batch=size, seq=1, seed=seed + index)["input_ids"]
              for index, size in enumerate(sizes)]
    parts = []
    for which, state in enumerate(endpoints):  # one endpoint's state at a time in the private copy
        model.load_state_dict(state, strict=False)
        mine = [first[which::count] for first in firsts]
        rows = torch.cat(mine)
        sampled = torch.cat([_sampled(model, chunk, length, config) for chunk in rows.split(SAMPLED_TOGETHER)])
        parts.append(sampled.split([len(m) for m in mine]))
    batches = []
    for index, size in enumerate(sizes):
        order = torch.argsort(torch.cat([torch.arange(which, size, count) for which in range(count)]))
        batches.append({"input_ids": torch.cat([part[index] for part in parts])[order]})
    return batches


def _inverted_together(model: torch.nn.Module, endpoints: Sequence[State], batches: list[dict[str, torch.Tensor]]
                       ) -> list[dict[str, torch.Tensor]]:
    """``batches`` inverted (:func:`_inverted`) up to :data:`INVERTED_TOGETHER` examples at a time across batches
    (more than the first batch holds only within :data:`INVERTED_ELEMENTS`), where every input leads with the
    examples' axis (each batch alone otherwise); each example is moved by its own loss (the steps' mean loss over
    the examples, Adam's steps per entry), so the chunks change the draws of the classes, not the method."""
    sizes = [len(next(iter(batch.values()))) for batch in batches]
    if not all(v.dim() and len(v) == size for batch, size in zip(batches, sizes) for v in batch.values()):
        return [_inverted(model, endpoints, batch) for batch in batches]
    whole = {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}
    one = max(1, elements_written(model, endpoints[0], {key: v[:1] for key, v in whole.items()}))
    together = min(INVERTED_TOGETHER, max(sizes[0], int(INVERTED_ELEMENTS // one)))
    chunks = [_inverted(model, endpoints, {key: v[start:start + together] for key, v in whole.items()})
              for start in range(0, sum(sizes), together)]
    moved = {key: torch.cat([chunk[key] for chunk in chunks]).split(sizes) for key in whole}
    return [{key: moved[key][index] for key in whole} for index in range(len(batches))]


def _inverted(model: torch.nn.Module, endpoints: Sequence[State], inputs: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
    """``inputs`` with their floating-point tensors (pixels, audio) moved by :data:`INVERSION_STEPS` steps of Adam
    towards examples the endpoints together assign to a class drawn at random for each (model inversion, with a
    small L2 prior): random inputs a classifier is sure of, not noise it is indifferent to. Token ids stay as
    they are."""
    moving = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if v.is_floating_point()}
    wanted = None  # a class per example, drawn once the first step's logits show how many classes there are
    with torch.enable_grad():
        optimiser = torch.optim.Adam(moving.values(), lr=INVERSION_LR)
        for _ in range(INVERSION_STEPS):
            current = {**inputs, **moving}
            log_mean = torch.stack([_run(model, state, current).float().log_softmax(-1) for state in endpoints])
            log_mean = log_mean.logsumexp(0) - math.log(len(endpoints))  # log of the mean probability
            if wanted is None:
                wanted = torch.randint(log_mean.shape[-1], log_mean.shape[:1])
            prior = sum(v.pow(2).mean() for v in moving.values())
            loss = torch.nn.functional.nll_loss(log_mean, wanted) + INVERSION_PRIOR * prior
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return {**inputs, **{k: v.detach() for k, v in moving.items()}}


def _length(model: torch.nn.Module, state: State, config, seed: int, longest: int = LENGTH) -> int:
    """The longest sequence, up to ``longest`` and the config's position count, that ``model`` carrying
    ``state`` runs on (bisected down from there to :data:`TASK_LENGTH`, which :func:`_task` ran): a position
    table may hold fewer usable rows than its size (RoBERTa's positions start after the padding index)."""
    high = longest_tokens(config, longest)
    low = min(TASK_LENGTH, high)
    if _runs_at(model, state, config, high, seed):
        return high
    while high - low > 1:  # it runs at low, not at high
        middle = (low + high) // 2
        low, high = (middle, high) if _runs_at(model, state, config, middle, seed) else (low, middle)
    return low


def _check_cost(model: torch.nn.Module, state: State, config, length: int, examples: int, seed: int,
                limit: float) -> None:
    """Refuse examples whose one forward pass over all ``examples`` would write more than ``limit`` elements."""
    one = model_example_inputs(model, config, batch=1, seq=length, seed=seed)
    try:
        written = examples * elements_written(model, state, one)
    except Exception as error:  # noqa: BLE001 - an operator the count cannot follow: no budget to keep, so none made
        raise DataError(f"The cost of a forward pass of {type(model).__name__} could not be counted "
                        f"({type(error).__name__}: {error}).") from error
    if written > limit:
        raise DataError(f"One forward pass of {type(model).__name__} over {examples} examples of its inputs "
                        f"{_shapes(one, per_example=True)} writes {written:,} tensor elements, "
                        f"more than the {limit:,.0f} these examples may cost.")


def parameters_over(model: torch.nn.Module, limit: int) -> int | None:
    """The parameters of ``model`` where they are more than ``limit`` (a judge's bound); None within it."""
    size = sum(p.numel() for p in model.parameters())
    return size if size > limit else None


def elements_per_example(model: torch.nn.Module, state: State, data: Dataset) -> int | None:
    """The tensor elements one forward pass of ``model`` carrying ``state`` writes per example of ``data``
    (:func:`elements_written` of its first example); None where the count cannot be made (inputs that do not lead
    with the examples' axis, an operator the count cannot follow). What a forward pass over data given costs: the
    judge's bound on it, and the short learning's steps (:func:`symgraph.learn.short_learning_steps`)."""
    from .verify import tied_copies

    tied = tied_copies(model)
    first = data.batches[0].inputs
    try:
        return elements_written(model, {k: v for k, v in state.items() if k not in tied},
                                {key: v[:1] for key, v in first.items()})
    except Exception:  # noqa: BLE001 - uncountable: no bound to keep
        return None


def elements_written(model: torch.nn.Module, state: State, inputs: dict[str, torch.Tensor]) -> int:
    """The tensor elements the operators of one forward of ``model`` carrying ``state`` on ``inputs`` write. A
    forward's time on a CPU follows it where FLOPs do not (one thread, 64 examples of 64-128 tokens or images, 14
    architectures from recurrent scans to 64-head attention: 1.6-6.2 ns an element, against 1.1-12.6 GFLOP/s; tiny
    vision models, whose time is mostly per operator, up to 9 ns)."""
    written = 0

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal written
            out = func(*args, **(kwargs or {}))
            if not func.is_view:  # a view writes nothing
                written += sum(v.numel() for v in tree_leaves(out) if isinstance(v, torch.Tensor))
            return out

    with torch.no_grad(), Count():
        _run(model, state, inputs)
    return written


def _runs_at(model: torch.nn.Module, state: State, config, length: int, seed: int) -> bool:
    """Whether ``model`` carrying ``state`` runs on one example of ``length`` tokens (frames)."""
    try:
        _run(model, state, model_example_inputs(model, config, batch=1, seq=length, seed=seed))
    except CANNOT_RUN as error:
        _log.debug("%s does not run at length %d: %s", type(model).__name__, length, error)
        return False
    return True


def _sampled(model: torch.nn.Module, first: torch.Tensor, length: int, config) -> torch.Tensor:
    """Sequences of ``length`` tokens sampled from ``model`` (temperature 1, no truncation) after ``first``."""
    if not len(first):
        return first.new_zeros((0, length))
    pad = next((v for v in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None))
                if isinstance(v, int)), 0)
    try:
        return model.generate(first, attention_mask=torch.ones_like(first), do_sample=True, max_length=length,
                              min_length=length, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=pad)[:, :length]
    except CANNOT_RUN as error:
        raise DataError(f"Synthetic data cannot be sampled from {type(model).__name__}: its generate() fails on "
                        f"{length} tokens ({type(error).__name__}: {error}).",
                        hint="pass real data (--data SPEC) to learned matching for this model.") from error


def _labelled(model: torch.nn.Module, endpoints: Sequence[State], inputs: dict[str, torch.Tensor],
              task: str) -> Batch:
    """``inputs`` with the endpoints' mean predicted distribution as soft targets (its :data:`TOP` likeliest
    classes, renormalised) and its top class (next token) as labels."""
    mean = sum(_run(model, state, inputs).float().softmax(-1) for state in endpoints) / len(endpoints)
    probabilities, ids = mean.topk(min(TOP, mean.shape[-1]), dim=-1)
    targets = (probabilities / probabilities.sum(-1, keepdim=True), ids)
    top = ids[..., 0]
    if task == "classification":
        return Batch(inputs, top, targets)
    tokens = inputs["input_ids"]
    # causal LM labels are the ids the loss shifts by one: position t + 1 holds the guess made at position t
    return Batch(inputs, torch.cat([tokens[:, :1], top[:, :-1]], dim=1), targets)


class _JudgeExamples:
    """The synthetic examples a judge scores on, made on the first call from ``model`` carrying each of
    ``endpoints`` (a classifier's inputs as drawn: judging starts on them needs no inversion, which would cost more
    than what is judged); None when synthetic data cannot be made for ``model`` (no config, neither a classifier
    nor a causal LM, a generate() that fails), it has more than :data:`JUDGE_MAX_PARAMETERS` parameters, or a
    forward pass over them would write more than :data:`JUDGE_MAX_ELEMENTS` tensor elements, said once in the
    log. :meth:`inverted` gives them inverted."""

    def __init__(self, model: torch.nn.Module, endpoints: Sequence[State], examples: int, judged: str):
        self.model, self.endpoints, self.examples, self.judged = model, endpoints, examples, judged
        self.made: dict[bool, Dataset | None] = {}

    def __call__(self, invert: bool = False) -> Dataset | None:
        if invert not in self.made:
            self.made[invert] = self._make(invert)
        return self.made[invert]

    def _make(self, invert: bool) -> Dataset | None:
        size = parameters_over(self.model, JUDGE_MAX_PARAMETERS)
        if size is not None:
            _log.info("%s are not judged on synthetic data: %s has %s parameters, more than the %s a judge makes "
                      "examples for", self.judged, type(self.model).__name__, f"{size:,}", f"{JUDGE_MAX_PARAMETERS:,}")
            return None
        try:
            return synthetic_data(self.model, self.endpoints, examples=self.examples, batch_size=32, invert=invert,
                                  max_elements=JUDGE_MAX_ELEMENTS)
        except DataError as error:  # no data this model can make: no judge, and say why once
            _log.info("%s are not judged on synthetic data: %s", self.judged, error)
            return None

    def inverted(self) -> Dataset | None:
        """The examples with a classifier's pixels (or audio) inverted (:func:`synthetic_data`); the examples as
        drawn where there is nothing to invert (token ids, a causal LM's samples). What activations of random
        pixels align is judged on these: the random ones ranked the wide ViT's candidates the wrong way round
        (path loss 2.90 against 2.64 for test barriers of 0.57 and 2.35), inverted ones the right way (2.00
        against 2.27; vit-digits alike)."""
        drawn = self()
        return self(invert=True) if drawn is not None and _invertible(drawn.task, drawn.batches[0].inputs) else drawn


class PathJudge:
    """A judge of alignments of ``source`` to ``anchor`` (:func:`symgraph.alignment.align_states`): called on an
    aligned source, it returns the loss along the path (t = 1/4, 1/2, 3/4; :func:`symgraph.learn.path_loss`) from
    ``anchor`` to it on ``examples`` synthetic examples made on the first call (:class:`_JudgeExamples`; the inputs
    as drawn ranked the trained pairs' starts right, examples/RESULTS.md), or None when synthetic data cannot be
    made for ``model``: the caller then decides without it. :attr:`examples` gives those examples (or None), which
    full mode also records activations on (:func:`symgraph.align`). ``written``: the names the elements that
    move the source write (:func:`symgraph.learn.written_by`)."""

    def __init__(self, model: torch.nn.Module, source: State, anchor: State, *, examples: int = JUDGE_EXAMPLES,
                 written: frozenset[str] = frozenset()):
        self.model, self.anchor, self.written = model, anchor, written
        self.examples = _JudgeExamples(model, (source, anchor), examples, "the starts")

    def __call__(self, aligned: State) -> float | None:
        from .consensus import shared_float_names
        from .learn import path_loss

        made = self.examples()
        return None if made is None else path_loss(self.model, self.anchor, aligned,
                                                   shared_float_names(self.anchor, frozenset()), made,
                                                   len(made.batches), self.written)


def merge_examples(model: torch.nn.Module, states: Sequence[State], *,
                   examples: int = JUDGE_EXAMPLES) -> Dataset | None:
    """The examples merges of ``states`` (models of ``model``'s architecture) made without data are scored on:
    ``examples`` synthetic examples labelled by the models' mean prediction, a classifier's pixels inverted
    (:meth:`_JudgeExamples.inverted`); None when synthetic data cannot be made for ``model``. The models' distance
    to their mean, the rule they replace, ranks merges poorly. Simple merges after full alignment (as ``align``
    aligns), test loss onto B / onto A / common frame: vit-digits 3.111 / 3.028 / 2.575, judged on random pixels
    2.863 / 2.992 / 4.779 (B's frame kept), on inverted ones 2.310 / 2.251 / 3.418 (A's frame kept: 0.08 lower); the
    wide ViT kept the same frame either way. Neither ranks vit-digits' common frame, and aligned by weights alone
    (``judge_starts=False``; 3.712 / 3.334 / 3.563) inverted pixels kept B's frame where random ones kept A's: 64
    examples are a noisy judge of merges this close (README.md, the frame of a merge;
    examples/study_merge_frames.py, examples/results/merge_frames*.json)."""
    return _JudgeExamples(model, states, examples, "the merges").inverted()
