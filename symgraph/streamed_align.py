"""Alignment of checkpoints too large to hold twice (7B and up): block by block, read and written as it goes.

:func:`symgraph.alignment.align_states` keeps working copies of both whole models (56 GB in fp32 at 7B). Here
both models stay on disk as :class:`~symgraph.lazy_state.LazyState` mappings (memory-mapped, stored dtype) and
the work is cut along the block list (the ``ModuleList`` of ``num_hidden_layers`` blocks):

1. groups: the source's architecture is captured on the meta device; only its vectors (norm weights) are read,
   so a folded model (norm weights exactly 1) gets its orthogonal residual group as the in-memory analysis gives.
2. groups spanning several blocks (the residual stream) are solved first from their members outside the blocks
   (embeddings, LM head): the first pass of the in-memory aligner solves them from the same members, since every
   in-block member still waits for the block's own groups then. Their elements are then fixed.
3. each block, when the writer reaches its tensors: both models' block tensors are read in fp32 (fp64 for fp64
   checkpoints), the fixed elements applied to the source's, and the block's groups aligned by the in-memory
   :class:`~symgraph.alignment.Aligner` (first pass; then, except in ``paper`` mode, coordinate descent inside
   the block); the aligned tensors go to :func:`symgraph.shards.write_checkpoint` in the stored dtype and the
   block is dropped. Peak memory: one block of each model in fp32 plus the solver's cost matrices.

With ``fold`` both models are read folded (:class:`FoldedState`: each RMSNorm weight multiplied into the
columns of the linears that read it as the tensor is read, the norm weight read as 1; :mod:`symgraph.fold` finds
the norms in the graph), so the residual stream has its orthogonal group; OUT is then the folded source, as with
``symgraph align --fold``. LayerNorm models (whose folding centres every residual writer) are not streamed yet.
A tied checkpoint (the LM head is the embedding, stored once) is aligned under the name it stores the tie by; with
``fold``, where the tie keeps the final norm from folding, the head is untied first (:class:`Analysed`, as
:func:`symgraph.fold.fold` unties) and written as a tensor of its own. Tensors stored otherwise than the model
names them (renamed, experts stored one by one, a projection stored fused) are read by the model's names and
written in the source's layout (:class:`~symgraph.lazy_state.ConvertedState`).

What this does not do (yet): coordinate descent between the residual stream and the blocks (the residual is
solved once, from the outside members; exact for a reparametrised copy, thin evidence between independent
models), the second (weight-matching) start, and groups spanning blocks with no member outside them, which stay
at the identity (listed in ``unsolved``). ``paper`` mode has no such groups and equals the in-memory result.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .alignment import (DEFAULT_ROUNDS, Aligner, GroupStat, check_same_config, compute_device, compute_dtype,
                        select_groups)
from .elements import Element, apply_in_place
from .errors import InvarianceError, MismatchError
from .groups import Group
from .lazy_state import ConvertedState, LazyState, ReadThrough, UntiedState
from .solve.reduce import squared_distance
from .verify import RoundedExact

__all__ = ["StreamedAlignment", "align_streamed", "streamed_groups"]

_log = logging.getLogger(__name__)


@dataclass
class StreamedAlignment:
    """What :func:`align_streamed` wrote and found."""

    path: Path
    mode: str
    distance_before: float
    distance_after: float
    elements: list[Element]
    stats: list[GroupStat]
    timings: dict[str, float]
    unsolved: list[str] = field(default_factory=list)  # groups spanning blocks with no member outside them
    folded: bool = False  # both models were read folded: OUT is the folded source
    untied: list[str] = field(default_factory=list)  # tied names given tensors of their own so a norm folds
    verified_error: float | None = None
    verified_tolerance: float | None = None
    verified_rounded: RoundedExact | None = None  # past the tolerance: judged as an exact result rounded
    bytes_read: int = 0
    bytes_written: int = 0

    def to_json(self) -> dict:
        return {"streamed": True, "path": str(self.path), "mode": self.mode, "folded": self.folded,
                "untied": self.untied,
                "distance_before": self.distance_before, "distance_after": self.distance_after,
                "verified_relative_error": self.verified_error, "verified_tolerance": self.verified_tolerance,
                **({"verified_rounded_exact": asdict(self.verified_rounded)} if self.verified_rounded else {}),
                "verification": "float64, block by block (symgraph.streamed_verify)"
                if self.verified_error is not None else None,
                "unsolved": self.unsolved, "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "timings_s": self.timings, "solves": [s.__dict__ for s in self.stats]}


def align_streamed(source, anchor, out, *, mode: str = "full", rescale: bool = True,
                   layers: tuple[int, int] | None = None, rounds: int | None = None, tolerance: float = 1e-4,
                   fold: bool = False, untie: bool | None = None, shard_bytes: int | None = None,
                   overwrite: bool = False,
                   verify: bool = True, progress: Callable | None = None, device="cpu",
                   dtype=None) -> StreamedAlignment:
    """Align the safetensors checkpoint ``source`` to ``anchor`` (Hugging Face folders of one architecture) block
    by block (see the module docstring) and write the result to ``out`` as sharded safetensors with the index.

    ``mode``, ``rescale``, ``layers``, ``tolerance`` and ``progress`` are as for
    :func:`symgraph.alignment.align_states`; ``rounds`` (default 8) bounds the descent inside each block;
    ``fold`` reads both models folded (see the module docstring), untied first where tied weights (an embedding
    that is also the LM head) keep a norm from folding, as :func:`symgraph.fold.fold` does (``untie``: None, the
    default; True: always; False: refused); OUT then stores the untied tensors and says ``tie_word_embeddings``
    false. ``device`` and ``dtype`` are where and in what
    each block's working copies are solved (as for :func:`symgraph.alignment.align_states`); blocks are read and
    written on the CPU in their stored dtype either way. With ``verify`` the written model is run against
    ``source`` in float64 block by block (:func:`symgraph.streamed_verify.verify_streamed`: a whole float64 copy
    would not fit) before it is moved to ``out``; a mismatch raises :class:`~symgraph.errors.InvarianceError` and
    leaves nothing there.
    Atomic: nothing at ``out`` until every shard, the index and the config are complete. Inputs are only read.

    Examples
    --------
    >>> import tempfile, symgraph
    >>> from symgraph import zoo
    >>> from symgraph.io import model_config, save_model
    >>> a, b = zoo.build("llama", seed=0), zoo.build("llama", seed=1)
    >>> folders = [save_model(m.state_dict(), tempfile.mkdtemp() + "/m", config=model_config(m)) for m in (a, b)]
    >>> result = align_streamed(folders[1], folders[0], tempfile.mkdtemp() + "/out", mode="paper")
    >>> result.distance_after < result.distance_before, result.verified_error < result.verified_tolerance
    (True, True)
    """
    from .api import _check_layers
    from .files import refuse_overlap
    from .merging import _streamed_plan
    from .shards import DEFAULT_SHARD_BYTES, write_checkpoint

    refuse_overlap(out, [source, anchor])
    if untie and not fold:
        from .fold import FoldError

        raise FoldError("untie=True serves only a fold, and this alignment does not fold.",
                        hint="leave out untie (--untie), or fold (fold=True, --fold).")
    device, dtype = compute_device(device), compute_dtype(dtype)  # before anything is read
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    src, anc = LazyState(source, finite=True), LazyState(anchor, finite=True)
    _streamed_plan([src, anc], [source, anchor])  # same tensors, same shapes
    model, config, groups, norms, untied, layout = streamed_groups(source, src, fold=fold, untie=untie)
    src, anc = ConvertedState(src, layout), ConvertedState(anc, layout)  # the model's names and layout
    _refuse_not_loaded(src, model)
    _refuse_mixed_units(src)
    stored = src  # model tensors <-> stored tensors, for writing in the checkpoint's layout
    if untied:
        src, anc = UntiedState(src, untied), UntiedState(anc, untied)
    if fold:
        src, anc = FoldedState(src, norms), FoldedState(anc, norms)
    check_same_config(_config(source) if untied else config, _config(anchor))  # as stored, before untying
    _check_same_vectors(src, anc, source, anchor)
    _check_layers(layers, groups)
    groups = select_groups(groups, mode, rescale=rescale, layers=layers)
    rounds = DEFAULT_ROUNDS if rounds is None else rounds  # the residual is not in the descent: no 100 rounds
    timings["analyse"] = time.perf_counter() - clock

    from .streamed_verify import _block_list

    prefixes = list(_block_list(model, config))
    job = _Job(src, anc, groups, prefixes, mode, rescale, rounds, tolerance, progress, device, dtype)
    job.warn_if_short_of_memory()
    clock = time.perf_counter()
    job.solve_spanning()
    timings["residual"] = time.perf_counter() - clock

    outcome = {}

    def check(staged: Path) -> None:
        from .streamed_verify import verify_streamed

        clock = time.perf_counter()
        exact = ExactResult(UntiedState(ConvertedState(LazyState(source), layout), untied), job.elements, prefixes,
                            norms if fold else None)
        outcome["verify"] = result = verify_streamed(source, staged, exact=exact, untied=untied)
        timings["verify"] = time.perf_counter() - clock
        if not result.ok:
            raise InvarianceError(f"The aligned model computes something else than '{source}' ("
                                  f"{result.describe()}; float64 block by block); nothing was written.",
                                  hint="this is a symgraph bug: report it with both checkpoints' config.json.")

    clock = time.perf_counter()
    infos = stored.stored_infos(src)
    path = write_checkpoint(out, infos, stored.stored_producer(job.produce),
                            shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES,
                            like=src.folder, config=config if untied else None, overwrite=overwrite,
                            check=check if verify else None)
    timings["blocks_and_write"] = time.perf_counter() - clock - timings.get("verify", 0.0)
    timings.update(job.timings)
    before, after, anchor_sq = job.parts
    verified = outcome.get("verify")
    return StreamedAlignment(path, mode, float(np.sqrt(before / max(anchor_sq, 1e-300))),
                             float(np.sqrt(after / max(anchor_sq, 1e-300))), job.elements, job.stats, timings,
                             unsolved=job.unsolved, folded=fold, untied=sorted(untied),
                             verified_error=verified and verified.relative_error,
                             verified_tolerance=verified and verified.tolerance,
                             verified_rounded=verified and verified.rounded_exact,
                             bytes_read=src.nbytes + anc.nbytes, bytes_written=sum(i.nbytes for i in infos))


class Analysed(NamedTuple):
    """What :func:`streamed_groups` finds in a checkpoint without reading its matrices."""

    model: torch.nn.Module  # the architecture on the meta device (untied where ``untied`` says)
    config: object
    groups: list[Group]  # under the model's names; a tie under the one of its names the checkpoint stores
    norms: list  # the norms folded (:class:`symgraph.fold.NormSite`; empty without ``fold``)
    untied: dict[str, str]  # tied name given a tensor of its own to fold -> the stored name it reads (empty: none)
    layout: object = None  # how the checkpoint stores the model's tensors (symgraph.checkpoint.StoredLayout)


def streamed_groups(folder, state: LazyState | None = None, *, fold: bool = False,
                    untie: bool | None = None) -> Analysed:
    """The architecture of the checkpoint at ``folder`` and its symmetry groups, without reading its matrices:
    the architecture is captured on the meta device and analysed at full depth with the stored vectors (norm
    weights, biases) in place, so norm weights stored as exactly 1 give the groups a folded model has. With
    ``fold``, those of the model read through :class:`FoldedState` (the norms it folds are returned); where tied
    weights keep a norm from folding, the model is untied first (``untie`` None or True, as
    :func:`symgraph.fold.fold` does; False: refused), and the tied names it does not store then read the stored
    tensor they tie to (:class:`~symgraph.lazy_state.UntiedState`)."""
    from .api import Subject, _inputs_for
    from .checkpoint import StoredLayout
    from .fold import TiedFoldError, untied
    from .io import load_model
    from .verify import _aliases

    state = state or LazyState(folder)
    loaded = load_model(Path(folder), config_only=True)
    args, kwargs = _inputs_for(loaded.model, loaded.config, None)
    subject = Subject(loaded.model, loaded.name, args, kwargs, loaded.config, loaded.path, config_only=True,
                      inputs_from_config=True, full_depth=True)
    layout = StoredLayout(loaded.model)
    state = ConvertedState(state, layout)
    ties = _aliases(loaded.model)
    try:
        analysed = _analysed(*(untied(subject) if fold and untie else (subject, [])), state, fold, ties)
    except TiedFoldError:
        if untie is not None:
            raise
        analysed = _analysed(*untied(subject), state, fold, ties)
    return analysed._replace(layout=layout)


def _analysed(subject, untied: list[str], state, fold: bool, ties: list[list[str]]) -> Analysed:
    """:func:`streamed_groups` for ``subject``: the checkpoint's model, or its copy with the tied names ``untied``
    given tensors of their own, which read the stored tensor they tie to where the checkpoint does not store
    them."""
    from .analysis import analyse_capture
    from .fold import find_norms

    stored = _stored_names(ties, state)
    if untied:
        untied = {name: stored.get(name, name) for name in untied}
        state = UntiedState(state, untied)
    norms = []
    if fold:
        norms = find_norms(subject.capture)
        state = FoldedState(state, norms)
    program_state = subject.capture.program.state_dict
    for name, value in list(program_state.items()):
        if value.dim() <= 1 and name in state:  # the analysis reads vector values (a norm weight of exactly 1)
            program_state[name] = state[name]
    groups = analyse_capture(subject.capture).groups
    if untied:
        return Analysed(subject.model, subject.config, groups, norms, untied)
    _refuse_ties_stored_twice(ties, state, groups)
    return Analysed(subject.model, subject.config, [g.renamed(stored) for g in groups], norms, {})


def _stored_names(ties: list[list[str]], state) -> dict[str, str]:
    """Each tied name ``state`` does not store -> the name of the tie it does store (ties stored once). The graph
    reads a tie under one of its names, not always the stored one: a tied LLaMA's reads ``lm_head.weight``, its
    checkpoint holds ``model.embed_tokens.weight``."""
    names = {}
    for tie in ties:
        stored = [n for n in tie if n in state]
        if len(stored) == 1:
            names.update({n: stored[0] for n in tie if n != stored[0]})
    return names


def _refuse_not_loaded(state: ConvertedState, model) -> None:
    """Stored tensors the model does not hold are refused as loading refuses them: those its class does not skip
    (another architecture's), and those it skips that a written model cannot carry
    (:func:`~symgraph.checkpoint.refuse_unloaded`); copies of buffers and the like are written as stored."""
    from .checkpoint import _skipped_on_load, refuse_unloaded
    from .io import _check_loading_info, _weights_in

    own = set(model.state_dict())
    foreign = [n for n in state if n not in own]
    unexpected = set(foreign) - _skipped_on_load(model, foreign)
    _check_loading_info({"unexpected_keys": unexpected}, model, state.folder,
                        _weights_in(state.folder) or state.state.files[0])
    refuse_unloaded(model, foreign, f"The weights in '{state.folder}'")


def _refuse_mixed_units(state: ConvertedState) -> None:
    """Stored tensors of different dtypes that transformers loads into one parameter (experts stored one by one)
    are refused, as loading refuses them: written back from that parameter, in one dtype, some would change."""
    from .io import mixed_dtypes_error

    for unit in dict.fromkeys(state.unit_of_stored.values()):
        dtypes = {n: state.state.info(n).dtype for n in unit.stored if n in state.state}
        if len(set(dtypes.values())) > 1:
            raise mixed_dtypes_error(state.folder, unit.model[0], dtypes)


def _refuse_ties_stored_twice(ties: list[list[str]], state, groups) -> None:
    """A tie stored under several names with different values (transformers loads them untied), or which a group
    moves: streamed, the copies would be written differently, and a model loading them keeps one."""
    from .io import tied_copies_differ

    moved = {p for g in groups for p in g.params}
    for tie in ties:
        stored = [n for n in tie if n in state]
        differ = next((n for n in stored[1:] if not torch.equal(state[n], state[stored[0]])), None)
        if differ is not None:
            raise tied_copies_differ(state.folder, differ, stored[0])
        if len(stored) > 1 and moved & set(tie):
            raise MismatchError(f"The checkpoint '{state.folder}' stores the tied tensors {' and '.join(stored)} "
                                f"separately, and a symmetry group moves {sorted(moved & set(tie))[0]}: streamed, "
                                "the copies would be written differently.",
                                hint="align it in memory (without --stream), or re-save it with one copy of the tie "
                                     "(save_pretrained does).")


class FoldedState(ReadThrough):
    """``state`` read folded (:mod:`symgraph.fold`): each linear that reads a norm gets the norm's weight multiplied
    into its columns as it is read (the same numbers ``symgraph fold`` writes), and the norm weight reads as what
    makes the norm multiply by 1 (1, or 0 for a ``1 + w`` norm). RMSNorm only: a LayerNorm's folding also centres
    every residual writer, which is not done tensor by tensor here. ``exact``: the products unrounded (what the
    written checkpoint's tensors are the rounding of), in float32 where that holds them exactly, else float64."""

    def __init__(self, state: LazyState, norms, exact: bool = False):
        from .fold import FoldError

        centring = [n for n in norms if n.centres]
        if centring:
            raise FoldError(f"Streamed folding handles RMSNorm only, but {centring[0].describe()} is a LayerNorm, "
                            "whose folding centres every residual writer.",
                            hint="align without --fold, or fold in memory (symgraph fold) and stream the result.")
        if not norms:
            raise FoldError("No norm on the residual stream was found in the graph: there is nothing to fold.",
                            hint="align without --fold.")
        self.state, self.exact = state, exact
        self.norm_of = {n.weight: n for n in norms if n.weight}
        self.reader_of = {r.weight: replace(n, readers=(r,)) for n in norms if n.weight for r in n.readers}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.norm_of:
            info = self.state.info(name)
            return self.norm_of[name].folded_weight(torch.empty(info.shape, dtype=info.dtype))
        site = self.reader_of.get(name)
        if site is None:
            return self.state[name]
        # symgraph.fold multiplies in float64 and rounds once. Two bf16/fp16 numbers multiply exactly in fp32: the
        # same numbers at half the memory (a 7B LM head is 1 GB in float64). Others, and 1 + g (no longer one
        # such number): float64.
        w, g = self.state[name], self.state[site.weight]
        single = w.dtype == g.dtype and w.dtype in (torch.bfloat16, torch.float16) and not site.offset
        work = torch.float32 if single else torch.float64
        product = site.readers[0].absorb(w.to(work), site.scale(g.to(work)))
        return product if self.exact else product.to(w.dtype)


class ExactResult(ReadThrough):
    """What a streamed alignment's written tensors are the rounding of: the source's tensors (read folded by
    ``norms`` when folding) moved by ``elements`` in float64, nothing rounded, anew from the elements, as nothing
    the writer computed is trusted. Not float32: at width 4096 an element applied in float32 (its matrices' inverses
    too) changed a 7B-wide LLaMA's outputs by 4.5e-5, past float32's 2e-5. Computed a part at a time (one block of
    ``prefixes``, or everything outside them), as streamed verification reads them; the last part is kept (the
    float64 tensors the verification's model runs: it reads them without a copy)."""

    def __init__(self, state: LazyState, elements: list[Element], prefixes: list[str], norms=None):
        self.state = FoldedState(state, norms, exact=True) if norms is not None else state
        self.elements, self.prefixes = elements, prefixes
        self._part, self._tensors = object(), {}

    def part_of(self, name: str) -> int:
        """The index of the block holding ``name`` (-1 outside every block)."""
        return next((i for i, p in enumerate(self.prefixes) if name.startswith(p + ".")), -1)

    def __getitem__(self, name: str) -> torch.Tensor:
        part = self.part_of(name)
        if part != self._part:
            self._tensors = {}  # the previous part's tensors go before the next part's are read
            tensors = {k: self.state[k] for k in self.state if self.part_of(k) == part}
            tensors = {k: v.to(torch.float64, copy=True) if v.is_floating_point() else v for k, v in tensors.items()}
            apply_in_place(tensors, [e for e in (_restricted(e, tensors) for e in self.elements) if e is not None],
                           inverses={})
            self._part, self._tensors = part, tensors
        return self._tensors[name]


class _Job:
    """The state of one streamed alignment: the fixed elements of groups spanning blocks, and each block's
    aligned tensors from when the writer first asks for one of them until it has taken them all."""

    def __init__(self, src: LazyState, anc: LazyState, groups, prefixes, mode, rescale, rounds, tolerance,
                 progress, device, dtype):
        self.src, self.anc, self.mode, self.rescale = src, anc, mode, rescale
        self.device, self.dtype = device, dtype
        self.rounds, self.tolerance, self.progress = rounds, tolerance, progress
        self.prefixes = prefixes
        self.blocks: dict[str, list[Group]] = {p: [] for p in prefixes}
        self.spanning: list[Group] = []
        for g in groups:
            where = {self.block_of(p) for p in g.params}
            if len(where) == 1 and None not in where:
                self.blocks[where.pop()].append(g)
            else:
                self.spanning.append(g)
        missing = sorted({p for g in groups for p in g.params} - set(src))[:3]
        if missing:
            raise MismatchError(f"The checkpoint '{src.folder}' has no tensor {missing[0]}, which a symmetry group "
                                "moves (nor does transformers' conversion on loading make it from the tensors "
                                "stored).",
                                hint="align it in memory (without --stream), or re-save it with save_pretrained.")
        self.fixed: list[Element] = []  # elements of the spanning groups, solved first
        self.elements: list[Element] = []
        self.stats: list[GroupStat] = []
        self.unsolved: list[str] = []
        self.parts = np.zeros(3)  # squared distance before, after, squared anchor norm (float64)
        self.timings = {"blocks": 0.0}
        self._ready: dict[str, dict[str, torch.Tensor]] = {}  # block -> aligned tensors not yet written
        self._outside: dict[str, torch.Tensor] = {}
        self._inverses: dict = {}  # the fixed elements' inverse transposes, for their dual members in every block

    def warn_if_short_of_memory(self) -> None:
        """Warn before any block is read when the largest block's copies cannot fit in the memory available: a
        mixture of experts with hundreds of experts a layer holds tens of GB a block, and running out hours later
        (killed by the system) helps no one. A lower bound: each tensor's working copy, and its anchor's and its
        output's tensors in their stored dtypes."""
        if self.device.type != "cpu" or not self.prefixes:
            return
        available = available_memory()
        sizes = {p: 0 for p in self.prefixes}
        for name in self.src:
            block = self.block_of(name)
            if block is not None:
                info = self.src.info(name)
                work = 8 if info.dtype == torch.float64 else 4
                sizes[block] += math.prod(info.shape) * (work + self.anc.info(name).dtype.itemsize
                                                         + info.dtype.itemsize)
        block, need = max(sizes.items(), key=lambda item: item[1])
        if available is not None and need > available:
            _log.warning("The largest block, %s, needs at least %.2f GB while it is aligned (working copies of its "
                         "tensors, its anchor's and its output's), and this machine has %.2f GB available: the "
                         "alignment will most likely run out of memory. Use a machine with more memory, or --device "
                         "cuda (the working copies on the GPU).", block, need / 1e9, available / 1e9)

    def block_of(self, name: str) -> str | None:
        return next((p for p in self.prefixes if name.startswith(p + ".")), None)

    def solve_spanning(self) -> None:
        """The groups that span blocks, from their members outside the blocks (see the module docstring)."""
        restricted = []
        for g in self.spanning:
            outside = tuple(m for m in g.members if all(self.block_of(p) is None for p in m.params))
            if outside:
                restricted.append(replace(g, members=outside))
            else:
                self.unsolved.append(g.id)
        if not restricted:
            return
        names = list(dict.fromkeys(p for g in restricted for p in g.params))
        aligner = Aligner(restricted, {k: self.src[k] for k in names}, {k: self.anc[k] for k in names},
                          mode=self.mode, rescale=self.rescale, device=self.device, dtype=self.dtype)
        aligner.first_pass(self.progress)
        full = {g.id: g for g in self.spanning}
        self.fixed = [replace_group(e, full[e.group.id]) for e in aligner.elements]
        self.elements += self.fixed
        self.stats += aligner.stats
        self._outside = {k: aligner.src[k].to(device="cpu", dtype=self.src.info(k).dtype) for k in names}

    def produce(self, name: str) -> torch.Tensor:
        """The aligned tensor ``name`` in its stored dtype (the writer's ``produce``)."""
        block = self.block_of(name)
        if block is None:
            out = self._outside.pop(name, None)
            if out is None:
                out = self._moved({name: self.src[name]})[name]
            self._add_distance(self.anc[name], before=self.src[name], after=out)
            return out
        if block not in self._ready:
            self._ready[block] = self._align_block(block)
        ready = self._ready[block]
        out = ready.pop(name)
        if not ready:
            del self._ready[block]
        return out

    def _align_block(self, prefix: str) -> dict[str, torch.Tensor]:
        clock = time.perf_counter()
        names = [k for k in self.src if k.startswith(prefix + ".")]
        dtypes = {k: self.src.info(k).dtype for k in names}
        groups = self.blocks[prefix]
        grouped = {p for g in groups for p in g.params}
        block, anchor = {k: self.src[k] for k in names}, {k: self.anc[k] for k in names}
        for k in names:
            self._add_distance(anchor[k], before=block[k])
        rest = {k: block[k] for k in names if k not in grouped}  # the tensors no group of the block moves
        work: dict[str, torch.Tensor] = {}
        if groups:
            aligner = Aligner(groups, block, anchor, mode=self.mode, rescale=self.rescale, device=self.device,
                              dtype=self.dtype)
            del block, anchor  # from here the aligner's working copy is the one copy of the source block kept
            self.src.forget()
            self._apply_fixed(aligner.src)
            aligner.first_pass(self.progress)
            if self.mode != "paper":
                aligner.refine(self.rounds, self.tolerance, self.progress)
            self.elements += aligner.elements
            self.stats += aligner.stats
            work = aligner.src
            del aligner
        work.update(self._moved(rest, work=True))
        del rest
        out = {k: work.pop(k).to(device="cpu", dtype=dtypes[k]) for k in names}
        for k in names:
            self._add_distance(self.anc[k], after=out[k])
        self.anc.forget()
        self.timings["blocks"] += time.perf_counter() - clock
        return out

    def _moved(self, tensors: dict[str, torch.Tensor], work: bool = False) -> dict[str, torch.Tensor]:
        """``tensors`` moved by the fixed elements (computed in fp32, or fp64 for fp64 tensors): in the compute
        dtype with ``work``, else back in each tensor's own dtype."""
        if not work and not any(p in tensors for e in self.fixed for p in e.group.params):
            return dict(tensors)
        moved = {k: v.to(_compute_dtype(v.dtype), copy=True) for k, v in tensors.items()}
        self._apply_fixed(moved)
        return moved if work else {k: v.to(tensors[k].dtype) for k, v in moved.items()}

    def _apply_fixed(self, tensors: dict[str, torch.Tensor]) -> None:
        """Move ``tensors`` (working copies) in place by the fixed elements of the groups spanning blocks."""
        apply_in_place(tensors, [e for e in (_restricted(e, tensors) for e in self.fixed) if e is not None],
                       inverses=self._inverses)

    def _add_distance(self, anchor: torch.Tensor, *, before=None, after=None) -> None:
        """Add a tensor's squared distances to ``anchor`` before and after aligning (with ``before``, also the
        anchor's squared norm)."""
        if not anchor.is_floating_point():
            return
        # float64 a chunk at a time: whole-tensor differences are several GB for a 7B MoE layer's experts
        if before is not None:
            self.parts[0] += squared_distance(before, anchor)
            self.parts[2] += squared_distance(anchor)
        if after is not None:
            self.parts[1] += squared_distance(after, anchor)


def replace_group(e: Element, group: Group) -> Element:
    """``e`` acting on ``group`` (the same coordinates, other members)."""
    return Element(group, matrices=e.matrices, perm=e.perm, diag=e.diag)


def _restricted(e: Element, tensors) -> Element | None:
    """``e`` acting only on its members among ``tensors`` (None when it touches none); a member moving whole
    tensors between slots acts on all of its tensors at once, or on none."""
    members = tuple(m for m in e.group.members if set(m.params) <= set(tensors))
    if any(set(m.params) & set(tensors) and not set(m.params) <= set(tensors) for m in e.group.members):
        raise MismatchError(f"Group {e.group.id} moves whole tensors between slots that lie in different blocks, "
                            "which cannot be streamed block by block.", hint="align the model in memory (without "
                                                                             "--stream).")
    return replace_group(e, replace(e.group, members=members)) if members else None


def available_memory() -> int | None:
    """Bytes of memory this machine can give without swapping (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _config(folder):
    from .io import load_model

    return load_model(Path(folder), config_only=True).config


def _check_same_vectors(src: LazyState, anc: LazyState, source, anchor) -> None:
    """A vector holding one number throughout (a folded norm weight: 1, or 0 where the model multiplies by 1 + w)
    in one model and not in the other gives the two different groups (the in-memory alignment compares whole
    reports; this is the part a meta-device capture can differ in)."""
    from .analysis.walk import uniform_value

    def uniform(vector) -> bool:
        return uniform_value(vector) is not None

    differ = [k for k in src if len(src.info(k).shape) == 1 and uniform(src[k]) != uniform(anc[k])]
    if differ:
        raise MismatchError(f"'{differ[0]}' holds one number throughout in one of '{source}' and '{anchor}' but "
                            f"not in the other ({len(differ)} vectors differ): the models have different symmetry "
                            "groups.",
                            hint="fold both models (symgraph fold) or neither.")
