"""The experiments of Zhang et al. (ICML 2025) on symgraph's shipped model pairs, written up as a Markdown report.

    python examples/paper_experiments.py                                  # -> examples/RESULTS.md (+ results/)
    python examples/paper_experiments.py --quick --out /tmp/q/RESULTS.md  # smoke run: tiny data, 3 path points
    python examples/paper_experiments.py --wide                           # also the wide pairs (trained, cached)
    python examples/paper_experiments.py --pairs vit-digits-wide          # one wide pair only

For each shipped pair (two independent trainings of one model, ``-a`` seed 0 and ``-b`` seed 1; see
symgraph/data/models/README.md) B is aligned to A with the public API and measured on the pair's fixed test split:

- parameter distance ``||B' - A|| / ||A||`` per alignment mode (paper Fig. 4), with textbook weight matching
  (Git Re-Basin) as a reference column;
- loss and accuracy barriers along the linear path from A to B' per mode, one PNG per pair (Fig. 5);
- merged test loss/accuracy for {none, permutation, paper, full} x {simple, fisher, regmean} (Tables 1-2), with
  Fisher and RegMean statistics from the first examples of the train split;
- alignment restricted to attention, FFN or residual groups (Fig. 3);
- alignment of one layer only, and of the last k layers only (Fig. 6).

Everything is deterministic (fixed splits, no sampling, one CPU thread); only the timings change between runs.
Next to the report go ``results/<pair>.png`` and ``results/results.json`` (every number in the report).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import symgraph
from symgraph.alignment import (check_same_architecture, free_cost_members, relative_distance, select_groups,
                                weight_matching)
from symgraph.api import folded_pair, tie_aliases
from symgraph.consensus import shared_float_names
from symgraph.datasets import Dataset, evaluate, load_data
from symgraph.demo import SHIPPED_PAIRS, shipped_pair
from symgraph.files import write_text_atomic
from symgraph.fold import pays_off
from symgraph.learn import LearnOptions
# examples/: the wide pairs are trained, not shipped
from train_models import WIDE_CACHE, WIDE_PAIRS, WIDE_VERSION, wide_pair

PAIRS = {**SHIPPED_PAIRS, **WIDE_PAIRS}  # pair -> the dataset it was trained on

MODES = ("none", "permutation", "paper", "full")
TEXTBOOK = "textbook"  # reference column: Git Re-Basin weight matching (symgraph.alignment.weight_matching)
DATA_MODE = "full+data"  # full mode, costs from activations on the train examples (symgraph.activations)
LEARNED = "full+learn"  # full alignment tuned on the interpolated loss on the train split (symgraph.learn)
# full+learn on synthetic data (symgraph.synthetic): no data at all, the models' own samples or random inputs
SYNTHETIC = "full+learn (synthetic)"
COLUMNS = ("none", TEXTBOOK, "permutation", "paper", "full", SYNTHETIC, DATA_MODE, LEARNED)
METHODS = ("simple", "fisher", "regmean")
ABLATIONS = {"attention only": {"only": "attention"}, "FFN only": {"only": "ffn"},
             "residual only": {"only": "residual"}, "everything (full)": {}}
# The issue's remedies for a full-mode barrier no lower than permutation's, each run on every pair: the same
# barrier (test split, permutation vs full) with one thing changed.
ATTEMPTS = {
    "without the weight-matching start (`matching_start=False`)": {"align_options": {"matching_start": False}},
    "longer descent (up to 100 rounds, until a round changes nothing)":
        {"align_options": {"refine_rounds": 100, "tolerance": 0.0}},
    "no QK / rotary rescaling": {"align_options": {"rescale": False}},
    "other direction (A aligned to B)": {"reverse": True},
    "GL(d_head) QK and VO maps (`general_linear=True`)": {"align_options": {"general_linear": True}},
    "not folded (`fold=False`: permutations on the residual stream)": {"fold": False},
    "train split instead of test": {"split": "train"},
}
FULL_ONLY_OPTIONS = {"rescale", "general_linear"}  # permutation mode ignores these: its default curve stands


@dataclass(frozen=True)
class Settings:
    """How much data and how many path points a run uses."""

    steps: int  # points on the linear path, end points included
    test_limit: int | None  # test examples evaluated (None: the whole test split)
    stats_limit: int  # train examples for Fisher / RegMean statistics
    learn_steps: int  # optimiser steps of learned matching (full+learn)
    batch_size: int = 64
    # train examples full+data is given (None: the whole split, as `barrier --align full+data` takes it: costs on
    # the first 4 batches of 16, the short learning on the others); a quick run gives too few to learn on
    data_mode_limit: int | None = None


FULL = Settings(steps=21, test_limit=None, stats_limit=256, learn_steps=LearnOptions.steps)
QUICK = Settings(steps=3, test_limit=32, stats_limit=32, learn_steps=3, data_mode_limit=32)
# The wide pairs get the barrier in every mode, not the whole study: one alignment of a 3M-parameter pair takes
# tens of seconds; the ViT (the issue's merge bar) also one merge. Both learn the default 1000 steps (about 0.3 s a
# step on the wide ViT on an idle machine, one thread). The LLaMA reads 128-character windows (about 1 s a step), so
# it evaluates fewer test windows at fewer points.
WIDE = {"vit-digits-wide": Settings(steps=11, test_limit=None, stats_limit=256, learn_steps=LearnOptions.steps),
        "llama-chars-wide": Settings(steps=7, test_limit=64, stats_limit=64, learn_steps=LearnOptions.steps)}
WIDE_MERGED = ("vit-digits-wide",)
WIDE_BAR = {"full": 0.35, "with data": 0.10, "merge": 1.20}  # issue 9: barrier / unaligned; merged / endpoint loss
_START = time.perf_counter()


@dataclass
class Pair:
    """One shipped pair, loaded: A is the anchor, B is aligned to it."""

    name: str
    data: str
    a: symgraph.Subject
    b: symgraph.Subject
    test: Dataset
    train: Dataset  # Fisher / RegMean statistics
    train_eval: Dataset  # as many train examples as the test split has: barriers on training data

    @property
    def layers(self) -> int:
        return int(self.a.config.num_hidden_layers)


def log(message: str) -> None:
    """Progress on stderr, stamped with seconds since the script started."""
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


# -- loading and measuring -------------------------------------------------------------------------------------------
def load_pair(name: str, settings: Settings, root: Path | None, wide_root: Path | None = None) -> Pair:
    """A shipped pair (from ``root``, default the shipped models) or a wide one (from ``wide_root``, default
    :data:`WIDE_CACHE`; trained there first when missing)."""
    folder_a, folder_b = wide_pair(name, wide_root) if name in WIDE_PAIRS else shipped_pair(name, root)
    a, b = symgraph.load(folder_a), symgraph.load(folder_b)
    data = PAIRS[name]
    test = load_data(data, model=a, split="test", limit=settings.test_limit, batch_size=settings.batch_size)
    train = load_data(data, model=a, split="train", limit=settings.stats_limit, batch_size=settings.batch_size)
    train_eval = load_data(data, model=a, split="train", limit=len(test), batch_size=settings.batch_size)
    return Pair(name, data, a, b, test, train, train_eval)


def metrics_of(pair: Pair, state: dict) -> dict:
    """Test loss and accuracy of A's architecture carrying ``state``."""
    model = copy.deepcopy(pair.a.model)
    model.load_state_dict(state)
    m = evaluate(model, pair.test)
    return {"loss": m.loss, "accuracy": m.accuracy}


def distance_to_anchor(pair: Pair, state: dict) -> float:
    """Relative L2 distance of ``state`` to A over every floating-point entry (what the barrier reports too)."""
    anchor = pair.a.state_dict()
    return relative_distance(state, anchor, shared_float_names(anchor, frozenset()))


def with_state(subject: symgraph.Subject, state: dict, name: str) -> symgraph.Subject:
    """A copy of ``subject`` carrying ``state`` (an aligned, functionally equal parametrisation)."""
    model = copy.deepcopy(subject.model)
    model.load_state_dict(state)
    return symgraph.Subject(model, name, subject.args, subject.kwargs, subject.config, subject.path)


def aligned_and_merged(pair: Pair, **options) -> dict:
    """Align B to A with ``options`` (the API's ablations), then merge simply: distance and merged metrics.

    ``merge`` has no ablation options, so the aligned B goes in as it is (``align="none"``), folded as an aligning
    merge folds (an unaligned one averages the weights as stored)."""
    state = symgraph.align(pair.b, pair.a, **options).state
    merged = symgraph.merge([pair.a, with_state(pair.b, state, f"{pair.b.name} aligned")], method="simple",
                            align="none", fold=pays_off(pair.a), progress=False)
    return {"distance": distance_to_anchor(pair, state), **metrics_of(pair, merged.state)}


# -- the experiments -------------------------------------------------------------------------------------------------
def barrier_experiment(pair: Pair, settings: Settings, figure: Path) -> dict:
    """Figs. 4 and 5: distance and loss/accuracy along the linear path, per alignment mode; the plot."""
    align_data = load_data(pair.data, model=pair.a, split="train", limit=settings.data_mode_limit, batch_size=16)
    result = symgraph.barrier(pair.a, pair.b, pair.test, steps=settings.steps, aligns=(*MODES, DATA_MODE, LEARNED),
                              align_options={"align_data": align_data}, learn_data=pair.data,
                              learn=LearnOptions(steps=settings.learn_steps), progress=False)
    result.plot(figure)
    modes = {mode: curve.to_json() for mode, curve in result.curves.items()}
    synthetic = symgraph.barrier(pair.a, pair.b, pair.test, steps=settings.steps, aligns=(LEARNED,),
                                 learn_data="synthetic", learn=LearnOptions(steps=settings.learn_steps),
                                 progress=False).curves[LEARNED].to_json()
    return {"ts": result.ts, "modes": {**modes, SYNTHETIC: synthetic, TEXTBOOK: textbook_curve(pair, settings)}}


def textbook_curve(pair: Pair, settings: Settings) -> dict:
    """The reference: B weight-matched to A the textbook way (every permutation group, all its members, from the
    identity in a random order until nothing changes), on the costs permutation mode uses (the free key bias
    left out), then measured along the path like the modes. The models are folded first where ``barrier`` folds
    them, so the textbook matches the very models permutation mode matches (like with like)."""
    b, a, _, _ = folded_pair(pair.b, pair.a, None, check_same_architecture)
    groups = select_groups(b.report.groups, "permutation")
    free = free_cost_members(b, groups, "permutation")
    clock = time.perf_counter()
    state = weight_matching(groups, b.state_dict(), a.state_dict(), cost_excluded=free).state
    seconds = time.perf_counter() - clock
    matched = with_state(b, tie_aliases(b.model, state), f"{pair.b.name} weight-matched")
    curve = symgraph.barrier(a, matched, pair.test, steps=settings.steps, aligns=("none",), fold=False,
                             progress=False).curves["none"]
    return {**curve.to_json(), "mode": TEXTBOOK, "align_seconds": seconds}


def attempts_experiment(pair: Pair, settings: Settings, baseline: dict) -> dict:
    """Loss barriers of permutation and full alignment with one remedy each (:data:`ATTEMPTS`). Where a remedy
    only changes options permutation mode ignores, its permutation entry is the ``baseline`` barrier's."""
    out = {}
    for label, attempt in ATTEMPTS.items():
        first, second = (pair.b, pair.a) if attempt.get("reverse") else (pair.a, pair.b)
        data = pair.train_eval if attempt.get("split") == "train" else pair.test
        options = attempt.get("align_options") or {}
        full_only = bool(options) and set(options) <= FULL_ONLY_OPTIONS and len(attempt) == 1
        result = symgraph.barrier(first, second, data, steps=settings.steps,
                                  aligns=("full",) if full_only else ("permutation", "full"), align_options=options,
                                  fold=attempt.get("fold"), progress=False)
        curves = {mode: {"loss_barrier": c.loss_barrier, "distance": c.distance, "losses": c.losses}
                  for mode, c in result.curves.items()}
        if full_only:
            curves = {"permutation": baseline["modes"]["permutation"], **curves}
        out[label] = {mode: {"loss_barrier": c["loss_barrier"], "distance": c["distance"],
                             "mean_loss": sum(c["losses"]) / len(c["losses"])} for mode, c in curves.items()}
    return out


def merge_experiment(pair: Pair) -> dict:
    """Tables 1-2: every alignment mode x every merge method, scored on the test split. ``reference`` is the
    model the merge aligned the other one to (``merge`` picks it from the weights, not from the argument order)."""
    table = {}
    for mode in MODES:
        for method in METHODS:
            clock = time.perf_counter()
            data = None if method == "simple" else pair.train
            merged = symgraph.merge([pair.a, pair.b], method=method, align=mode, data=data, progress=False)
            table.setdefault(mode, {})[method] = {**metrics_of(pair, merged.state),
                                                  "reference": "AB"[merged.consensus.reference],
                                                  "frame": merged.frame, "frame_note": merged.frame_note,
                                                  "seconds": time.perf_counter() - clock}
    return table


def ablation_experiment(pair: Pair) -> dict:
    """Fig. 3: alignment restricted to one family of groups (full mode otherwise)."""
    return {label: aligned_and_merged(pair, mode="full", **options) for label, options in ABLATIONS.items()}


def layer_experiment(pair: Pair) -> dict:
    """Fig. 6: only layer i aligned, for every i; only the last k layers aligned, for every k."""
    last = pair.layers - 1
    single = {f"layer {i}": aligned_and_merged(pair, mode="full", layers=(i, i)) for i in range(pair.layers)}
    tail = {f"last {k}": aligned_and_merged(pair, mode="full", layers=(last - k + 1, last))
            for k in range(1, pair.layers + 1)}
    return {"single": single, "tail": tail}


def run_pair(name: str, settings: Settings, root: Path | None, figures: Path) -> dict:
    clock = time.perf_counter()
    pair = load_pair(name, settings, root)
    log(f"{name}: {len(pair.a.report.groups)} groups, {len(pair.test)} test / {len(pair.train)} train examples")
    out = {"data": pair.data, "models": [pair.a.name, pair.b.name], "groups": len(pair.a.report.groups),
           "layers": pair.layers, "test_examples": len(pair.test), "stats_examples": len(pair.train),
           "endpoints": {"A": metrics_of(pair, pair.a.state_dict()), "B": metrics_of(pair, pair.b.state_dict())}}
    out["barrier"] = barrier_experiment(pair, settings, figures / f"{name}.png")
    out["attempts"] = attempts_experiment(pair, settings, out["barrier"])
    log(f"{name}: barriers and remedies done")
    out["merges"] = merge_experiment(pair)
    log(f"{name}: merges done")
    out["ablation"] = ablation_experiment(pair)
    out["layer_study"] = layer_experiment(pair)
    out["seconds"] = time.perf_counter() - clock
    log(f"{name}: ablations and layer study done ({out['seconds']:.0f} s for the pair)")
    return out


def run_wide_pair(name: str, settings: Settings, figures: Path, wide_root: Path | None) -> dict:
    """A wide pair: the barrier in every mode (with the textbook reference), then for :data:`WIDE_MERGED` pairs
    `merge --method simple` after the alignment with the lowest barrier."""
    clock = time.perf_counter()
    pair = load_pair(name, settings, None, wide_root)
    log(f"{name}: {len(pair.a.report.groups)} groups, {len(pair.test)} test / {len(pair.train)} train examples")
    out = {"data": pair.data, "models": [pair.a.name, pair.b.name], "settings": asdict(settings),
           "training": training_records(pair), "test_examples": len(pair.test),
           "endpoints": {"A": metrics_of(pair, pair.a.state_dict()), "B": metrics_of(pair, pair.b.state_dict())}}
    out["barrier"] = barrier_experiment(pair, settings, figures / f"{name}.png")
    log(f"{name}: barriers done")
    if name in WIDE_MERGED:
        out["merge"] = best_alignment_merge(pair, out, settings)
    out["seconds"] = time.perf_counter() - clock
    log(f"{name}: done ({out['seconds']:.0f} s for the pair)")
    return out


def training_records(pair: Pair) -> dict:
    """What examples/train_models.py recorded for the pair's two models (seed, steps, test metrics, time)."""
    folders = [Path(pair.a.path), Path(pair.b.path)]  # where the models were read from, links followed
    found = {}
    for folder in folders:
        record = folder.parent / "training.json"
        models = json.loads(record.read_text())["models"] if record.is_file() else {}
        if folder.name not in models:
            sys.exit(f"{record} has no record of {folder.name}: a wide model is read with the training.json that "
                     f"examples/train_models.py wrote beside it (through links, beside where they point); train "
                     f"the pair with --wide-models FOLDER, or copy that record there")
        found[folder.name] = models[folder.name]
    return found


def best_alignment_merge(pair: Pair, result: dict, settings: Settings) -> dict:
    """`merge --method simple` after the mode with the lowest loss barrier (``merge`` aligns and folds as its
    defaults say; ``+learn`` and ``+data`` modes learn or take activations on the pair's train split, and every
    mode gets that split to choose its frame by the merged loss: without data the frame closest to the models'
    mean was kept, which on vit-digits-wide was the common frame at 3.26x the endpoints' loss)."""
    aligned = {m: c for m, c in result["barrier"]["modes"].items() if m not in ("none", TEXTBOOK)}
    best = min(aligned, key=lambda m: aligned[m]["loss_barrier"])
    base, learn = best.removesuffix("+learn"), best.endswith("+learn")
    clock = time.perf_counter()
    merged = symgraph.merge([pair.a, pair.b], method="simple", align=base,
                            data=pair.data,
                            learn=LearnOptions(steps=settings.learn_steps) if learn else False, progress=False)
    ends = [e["loss"] for e in result["endpoints"].values()]
    metrics = metrics_of(pair, merged.state)
    losses = aligned[best]["losses"]
    return {"align": best, **metrics, "frame": merged.frame, "mean_endpoint_loss": sum(ends) / 2,
            "ratio": metrics["loss"] / (sum(ends) / 2), "path_midpoint_loss": losses[len(losses) // 2],
            "seconds": time.perf_counter() - clock}


# -- the report ------------------------------------------------------------------------------------------------------
TIE = 1e-4  # barrier heights closer than this count as equal


def fmt(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def metric_cell(entry: dict) -> str:
    return f"{fmt(entry['loss'])} / {fmt(entry['accuracy'], 3)}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def curve(r: dict, mode: str, field: str) -> float | None:
    return r["barrier"]["modes"][mode][field]


def section_distance(results: dict) -> str:
    rows = [[name, *(fmt(curve(r, m, "distance")) for m in COLUMNS)] for name, r in results.items()]
    lines = [table(["pair", *COLUMNS], rows), ""]
    for name, r in results.items():
        d = {m: curve(r, m, "distance") for m in MODES}
        best = min(MODES, key=d.get)
        lines.append(f"- **{name}**: {fmt(d['none'])} unaligned; permutation {fmt(d['permutation'])}, paper "
                     f"{fmt(d['paper'])}, full {fmt(d['full'])}; the closest is `{best}`, "
                     f"{100 * (1 - d[best] / d['none']):.1f}% below none.")
    return "\n".join(lines + ["", permutation_versus_textbook(results)])


def permutation_versus_textbook(results: dict) -> str:
    """The issue's floor: permutation mode never ends farther from A than textbook weight matching."""
    verdicts = [(curve(r, "permutation", "distance") <= curve(r, TEXTBOOK, "distance") * (1 + 1e-9),
                 f"{name}: {fmt(curve(r, 'permutation', 'distance'))} vs {fmt(curve(r, TEXTBOOK, 'distance'))}")
                for name, r in results.items()]
    return ("**Is `permutation` never farther from A than textbook weight matching?** "
            f"{'Yes' if all(ok for ok, _ in verdicts) else 'No'} (" + "; ".join(t for _, t in verdicts) + ").")


def section_barrier(results: dict) -> str:
    loss = [[name, *(fmt(curve(r, m, "loss_barrier")) for m in COLUMNS)] for name, r in results.items()]
    drop = [[name, *(fmt(curve(r, m, "accuracy_barrier"), 3) for m in COLUMNS)] for name, r in results.items()]
    mean = [[name, *(fmt(path_mean(r, m)) for m in COLUMNS)] for name, r in results.items()]
    lines = ["Loss barrier:", "", table(["pair", *COLUMNS], loss), "", "Accuracy drop:", "",
             table(["pair", *COLUMNS], drop), "", "Mean test loss along the path (end points included):", "",
             table(["pair", *COLUMNS], mean), "", full_versus_permutation(results), ""]
    lines += [f"![{name}: loss and accuracy along the linear path](results/{name}.png)\n" for name in results]
    return "\n".join(lines)


def full_versus_permutation(results: dict) -> str:
    """The issue's bar: full alignment must give a lower loss barrier than permutation on every pair. Equal
    barriers (both flat paths) are told apart by the mean loss along the path."""
    verdicts = []
    for name, r in results.items():
        full, perm = curve(r, "full", "loss_barrier"), curve(r, "permutation", "loss_barrier")
        if abs(full - perm) > TIE:
            verdicts.append((full < perm, f"{name}: {'yes' if full < perm else 'no'}, {fmt(full)} vs {fmt(perm)}"))
            continue
        full_mean, perm_mean = path_mean(r, "full"), path_mean(r, "permutation")
        verdicts.append((False, f"{name}: tie at {fmt(full)}; mean loss along the path {fmt(full_mean)} vs "
                                f"{fmt(perm_mean)}, {'lower' if full_mean < perm_mean else 'not lower'} for full"))
    every = all(ok for ok, _ in verdicts)
    return (f"**Does `full` give a lower loss barrier than `permutation` on every pair?** {'Yes' if every else 'No'}"
            " (" + "; ".join(text for _, text in verdicts) + ").")


def section_attempts(results: dict) -> str:
    """What each remedy of the issue did to the permutation and full barriers, pair by pair."""
    parts = []
    for name, r in results.items():
        rows = [["as above (test split, 8 rounds, B aligned to A)", *barrier_cells(
            {m: {"loss_barrier": curve(r, m, "loss_barrier"), "mean_loss": path_mean(r, m)}
             for m in ("permutation", "full")})]]
        rows += [[label, *barrier_cells(entry)] for label, entry in r["attempts"].items()]
        parts += [f"**{name}**", "", table(["remedy", "permutation", "full", "full lower?"], rows), ""]
    return "\n".join(parts)


def barrier_cells(entry: dict) -> list[str]:
    """Loss barrier (mean loss along the path) of permutation and full, and whether full's barrier is lower."""
    perm, full = entry["permutation"], entry["full"]
    cells = [f"{fmt(e['loss_barrier'])} ({fmt(e['mean_loss'], 3)})" for e in (perm, full)]
    if abs(full["loss_barrier"] - perm["loss_barrier"]) <= TIE:
        return cells + ["tie"]
    return cells + ["yes" if full["loss_barrier"] < perm["loss_barrier"] else "**no**"]


def path_mean(r: dict, mode: str) -> float:
    losses = curve(r, mode, "losses")
    return sum(losses) / len(losses)


def simple_merge_rule(merges: dict) -> str:
    """How this run's simple merges, made without data, chose their frame: read off the notes ``merge`` wrote
    (runs from before the notes were kept chose by distance, as ``merge`` did then)."""
    if any("synthetic" in row["simple"].get("frame_note", "") for row in merges.values()):
        return ("the lowest merged loss on 64 synthetic examples labelled by both models together "
                "(`symgraph.synthetic.merge_examples`)")
    return "the aligned models closest to their mean"


def section_merge(results: dict) -> str:
    parts = []
    for name, r in results.items():
        ends = r["endpoints"]
        rows = [[mode, *(metric_cell(r["merges"][mode][m]) for m in METHODS)] for mode in MODES]
        frames = sorted({e["frame"].split(" (")[0] for row in r["merges"].values() for e in row.values()})
        seconds = [[mode, *(f"{r['merges'][mode][m]['seconds']:.1f}" for m in METHODS)] for mode in MODES]
        parts += [f"**{name}** (test loss / accuracy on `{r['data']}`). Endpoints: A {metric_cell(ends['A'])}, "
                  f"B {metric_cell(ends['B'])}. Frames of the merges (`merge --frame best`: both directions and a "
                  f"common frame tried; kept: the lowest merged loss on the statistics examples, or for simple "
                  f"merges, which get no data, {simple_merge_rule(r['merges'])}; model 1 is A): "
                  f"{'; '.join(frames)}.", "", table(["alignment", *METHODS], rows), "",
                  "Seconds per merge (alignment, statistics on the train examples, and the merge itself):", "",
                  table(["alignment", *METHODS], seconds), ""]
    return "\n".join(parts)


def section_ablation(results: dict) -> str:
    parts = []
    for name, r in results.items():
        rows = [["none", fmt(curve(r, "none", "distance")), metric_cell(r["merges"]["none"]["simple"])]]
        rows += [[label, fmt(e["distance"]), metric_cell(e)] for label, e in r["ablation"].items()]
        parts += [f"**{name}**", "", table(["aligned groups", "distance", "simple merge loss / acc."], rows), ""]
    return "\n".join(parts)


def section_layers(results: dict) -> str:
    parts = []
    for name, r in results.items():
        study = {**r["layer_study"]["single"], **r["layer_study"]["tail"]}
        rows = [[label, fmt(e["distance"]), metric_cell(e)] for label, e in study.items()]
        parts += [f"**{name}** ({r['layers']} layers)", "",
                  table(["aligned layers", "distance", "simple merge loss / acc."], rows), ""]
    return "\n".join(parts)


def observations(results: dict) -> str:
    """Findings read off the numbers of this run (so they stay true when the script is re-run)."""
    lines = [f"- {full_versus_permutation(results).replace('**', '')}"]
    for name, r in results.items():
        none = curve(r, "none", "loss_barrier")
        worse = [f"{m} {fmt(curve(r, m, 'loss_barrier'))}" for m in MODES[1:]
                 if curve(r, m, "loss_barrier") > none + TIE]
        if worse:
            lines.append(f"- {name}: alignment *raises* the loss barrier above no alignment ({fmt(none)}): "
                         f"{', '.join(worse)}.")
        if curve(r, "paper", "distance") > curve(r, "none", "distance"):
            lines.append(f"- {name}: paper alignment ends farther from A than no alignment.")
        lines += [merge_finding(name, r), direction_finding(name, r), ablation_finding(name, r),
                  layer_finding(name, r)]
    return "\n".join(lines)


def merge_finding(name: str, r: dict) -> str:
    cells = {(mode, method): e for mode, row in r["merges"].items() for method, e in row.items()}
    (mode, method), best = min(cells.items(), key=lambda kv: kv[1]["loss"])
    best_end = min(e["loss"] for e in r["endpoints"].values())
    verdict = ("beats both endpoints" if best["loss"] < best_end
               else f"stays above the better endpoint ({fmt(best_end)})")
    return (f"- {name}: the best merge is `{mode}` + `{method}` (loss {fmt(best['loss'])}), which {verdict}; the "
            f"unaligned simple average scores {fmt(r['merges']['none']['simple']['loss'])}.")


def direction_finding(name: str, r: dict) -> str:
    """``merge`` aligns the non-reference model to the reference; the ablations align B to A. Alignment is not
    symmetric, so the same mode can merge to different models."""
    merged, ablation = r["merges"]["full"]["simple"], r["ablation"]["everything (full)"]
    return (f"- {name}: simple merge after full alignment scores {fmt(merged['loss'])} through `merge` (reference "
            f"{merged['reference']}) and {fmt(ablation['loss'])} with B aligned to A: the direction of alignment "
            f"{'matters' if abs(merged['loss'] - ablation['loss']) > 1e-3 else 'does not matter here'}.")


def ablation_finding(name: str, r: dict) -> str:
    families = {k: e for k, e in r["ablation"].items() if k != "everything (full)"}
    best = min(families, key=lambda k: families[k]["loss"])
    none, full = r["merges"]["none"]["simple"]["loss"], r["ablation"]["everything (full)"]["loss"]
    return (f"- {name}: of the single families, `{best}` gives the lowest simple-merge loss "
            f"({fmt(families[best]['loss'])}; none {fmt(none)}, everything {fmt(full)}).")


def layer_finding(name: str, r: dict) -> str:
    single = r["layer_study"]["single"]
    best = min(single, key=lambda k: single[k]["loss"])
    none = r["merges"]["none"]["simple"]["loss"]
    worse = [k for k, e in {**single, **r["layer_study"]["tail"]}.items() if e["loss"] > none]
    return (f"- {name}: the best single layer to align is `{best}` (simple merge {fmt(single[best]['loss'])}, "
            f"unaligned {fmt(none)}); " + (f"worse than no alignment: {', '.join(worse)}." if worse
                                           else "every layer subset improves on no alignment."))


def environment() -> dict:
    """Where the run happens, recorded with its numbers (a report rendered later from the JSON says where they were
    measured, not where it was rendered)."""
    return {"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def render(results: dict, settings: Settings, command: str, seconds: float, wide: dict | None = None,
           where: dict | None = None) -> str:
    where = where or environment()
    per_pair = ", ".join(f"{n} {r['seconds']:.0f} s" for n, r in results.items())
    test = "all of it" if settings.test_limit is None else f"its first {settings.test_limit} examples"
    paragraphs = [
        f"Generated by `{command}` in {seconds:.0f} s ({per_pair}) on {where['machine']}, Python "
        f"{where['python']}, torch {where['torch']}, {where['threads']} CPU thread. Every "
        "number and figure below comes from that one run; `results/results.json` holds them all (only timings "
        "change between runs).",
        "**Set-up.** Each pair is one model trained twice, differing only in the seed (`-a`, seed 0, is the anchor "
        "A; `-b`, seed 1, is B; see symgraph/data/models/README.md). B is aligned to A with `symgraph.align` in "
        "each mode: `none`; `permutation` (weight matching: heads, FFN units, residual stream); `paper` (Zhang et "
        "al.: per-head QK/VO rotations with heads in fixed order, the QK rescale, one Hungarian per FFN); `full` "
        "(every detected group, the best solver for each, coordinate descent). `full` descends from two starts, "
        "the exact-member first pass and weight matching, and keeps the one whose aligned B has the lower loss "
        "along the path on 64 synthetic examples labelled by A and B together (the models' own samples for the "
        "LLaMA, random inputs of the config's shapes for the others; `symgraph.synthetic.PathJudge`: no data), "
        "then also aligns the residual stream on those examples' activations and keeps that alignment where its "
        "path loss is lower (on the same examples, inverted for the ViTs' pixels; `--synthetic-activations`), "
        "and where the path still rises above its ends on them, tunes the weight-matched alignment by 50 steps of "
        "learned matching on 256 other synthetic examples and keeps it where its path loss is lower "
        "(`--short-learning`); `permutation` chooses the same way among the starts no farther than textbook weight matching. Where a "
        "pair's norms can be folded (`symgraph fold`: llama-chars, vit-digits), `barrier` and `merge` fold both "
        "models first, as they do by default, so those pairs' barriers, path distances and merges are the folded "
        "pair's, and full mode aligns their residual stream by an orthogonal map (llama-chars) or by its "
        "permutations (vit-digits, a LayerNorm stream: `--residual-group auto`); bert-topics (post-LN) cannot be "
        "folded. The "
        "`textbook` column is a reference, not a mode: Git Re-Basin weight matching (every permutation group "
        "solved by a Hungarian with all its members, from the identity, in a random order (seed 0) until a round "
        "changes nothing; `symgraph.alignment.weight_matching`). `full+data` is what `barrier --align full+data` "
        "does by default: it aligns on activations of the train split's first 4 batches of 16 examples (the "
        "residual stream; `symgraph.activations`) and keeps the weight-matched alignment instead where its loss "
        "along the path on those batches is lower, then tunes the weight-matched alignment by full mode's short "
        "learning (50 steps) on the split's other batches and keeps it where its loss on the first 4 is lower; "
        "`full+learn` tunes the weight-matched alignment by "
        "learned matching on the train split (`symgraph.learn`, "
        f"{settings.learn_steps} steps), and `full+learn (synthetic)` the "
        "same on 1600 synthetic examples instead (`--learn-data synthetic`, `symgraph.synthetic`: the models' "
        "mean prediction as soft targets; no data at all). Evaluation uses each dataset's "
        f"fixed test split ({test}); Fisher and RegMean statistics use the first {settings.stats_limit} examples "
        f"of the train split. Barriers use {settings.steps} evenly spaced points on the path (both ends "
        "included), so a barrier peaking between two points is under-estimated. Distances are "
        "`||B'-A||/||A||` over every floating-point parameter and buffer. Data, seeds and evaluation are "
        "deterministic: nothing is sampled. Losses are cross-entropy per example (classification) or nats per "
        "predicted character (`pydoc-chars`).",
    ]
    header = "# symgraph: the paper's experiments on the shipped model pairs\n\n" + "\n\n".join(
        textwrap.fill(p, width=115, break_on_hyphens=False) for p in paragraphs) + "\n"
    return "\n".join([
        header,
        "## Parameter distance after alignment (paper Fig. 4)\n", section_distance(results), "",
        "## Loss barrier along the linear path (Fig. 5)\n",
        "The barrier is the largest rise of the loss above the straight line between the two ends; the accuracy "
        "drop is the largest fall of accuracy below it.\n", section_barrier(results),
        "## Remedies tried for the barrier (the issue's bar)\n",
        REMEDIES_INTRO,
        section_attempts(results),
        DATAFREE_ROUND3,
        LEARNED_REMEDIES,
        "## Merging (Tables 1-2)\n",
        "`symgraph.merge([A, B], method=..., align=...)`: the aligned models averaged simply, weighted by their "
        "diagonal Fisher, or combined per linear layer by RegMean (alpha 0.9).\n", section_merge(results),
        "## Which groups matter (Fig. 3)\n",
        "B aligned to A (`mode=\"full\"`) with `only=\"attention\"` (QK, VO, head permutations), `only=\"ffn\"` or "
        "`only=\"residual\"` (residual stream and norm scales), then merged simply (`merge` has no ablation "
        "options, so the aligned B goes in with `align=\"none\"`).\n", section_ablation(results),
        "## Aligning some layers only (Fig. 6)\n",
        "`layer i` aligns the groups of layer i only (`layers=(i, i)`); `last k` aligns layers L-k to L-1. Groups "
        "outside the numbered layers (residual stream, embeddings) stay unaligned in this study.\n",
        section_layers(results),
        "## Observations\n", observations(results), "",
        *(["## The wide pairs (issue 9)\n", section_wide(wide), ""] if wide else []),
    ])


def section_wide(wide: dict) -> str:
    """The wide pairs: how they were trained, the barrier of every mode against the bar, the merge."""
    results = wide["pairs"]
    runs = "; ".join(f"{n} by `{r['command']}` in {r['seconds']:.0f} s" for n, r in results.items())
    lines = [textwrap.fill(
        f"Generated {runs}, one CPU thread. The pairs are not "
        "shipped but trained by `python examples/train_models.py --wide` (deterministic, one CPU thread, cached in "
        f"~/.cache/symgraph/wide-v{WIDE_VERSION} or $SYMGRAPH_WIDE_MODELS; the folder's README.md and training.json "
        "hold the record): the ViT at width 256 with 6 layers and the LLaMA at width 256 with 4 layers; as for the "
        "shipped pairs `-a` is seed 0 (the anchor A) and `-b` seed 1. Only the barrier in every mode and one merge "
        "are run (one alignment takes minutes); `results/wide.json` holds every number.", width=115,
        break_on_hyphens=False), "", table(
        ["model", "seed", "steps x batch", "lr", "train s", "test loss", "test accuracy"],
        [[n, str(t["seed"]), f"{t['steps']} x {t['batch']}", str(t["lr"]), f"{t['train_seconds']:.0f}",
          fmt(t["test_loss"]), fmt(t["test_accuracy"], 3)]
         for r in results.values() for n, t in r["training"].items()]), ""]
    header = ["pair", *COLUMNS]
    rows = [[f"{name} ({r['settings']['steps']} points, {r['test_examples']} test examples)",
             *(wide_cell(r, m) for m in COLUMNS)] for name, r in results.items()]
    lines += ["Loss barrier (in brackets: times the unaligned barrier) and seconds of alignment:", "",
              table(header, rows), ""]
    lines += [wide_verdict(name, r) for name, r in results.items()]
    return "\n".join(lines + ["", WIDE_NOTES] + [f"![{name}: loss and accuracy along the linear path]"
                                                 f"(results/{name}.png)\n" for name in results])


def wide_cell(r: dict, mode: str) -> str:
    c, none = r["barrier"]["modes"][mode], r["barrier"]["modes"]["none"]["loss_barrier"]
    ratio = "" if mode == "none" or none <= 0 else f" ({c['loss_barrier'] / none:.2f}x)"
    return f"{fmt(c['loss_barrier'], 3)}{ratio}, {c['align_seconds']:.0f} s"


def wide_verdict(name: str, r: dict) -> str:
    """The issue's bar on one wide pair, read off this run's numbers."""
    modes = r["barrier"]["modes"]
    none = modes["none"]["loss_barrier"]
    ratio = {m: modes[m]["loss_barrier"] / none if none > 0 else float("inf") for m in modes}
    data = min((DATA_MODE, LEARNED), key=ratio.get)
    ends = r["endpoints"]
    return (f"- **{name}**: endpoints A {metric_cell(ends['A'])}, B {metric_cell(ends['B'])}. Data-free `full` "
            f"{ratio['full']:.2f}x unaligned (bar {WIDE_BAR['full']}x: {passed(ratio['full'] <= WIDE_BAR['full'])}; "
            f"`permutation` {ratio['permutation']:.2f}x, `textbook` {ratio[TEXTBOOK]:.2f}x; full "
            f"{'not above' if ratio['full'] <= ratio['permutation'] else '**above**'} permutation); without data "
            f"but learned on synthetic data `{SYNTHETIC}` {ratio[SYNTHETIC]:.2f}x "
            f"({passed(ratio[SYNTHETIC] <= WIDE_BAR['full'])} against the data-free bar); with data the best is "
            f"`{data}`, {ratio[data]:.2f}x (bar {WIDE_BAR['with data']}x: "
            f"{passed(ratio[data] <= WIDE_BAR['with data'])}).{merge_verdict(r)}")


def merge_verdict(r: dict) -> str:
    if "merge" not in r:
        return ""
    m = r["merge"]
    return (f" `merge --method simple` after the lowest-barrier alignment (`{m['align']}`, frame "
            f"{m['frame'].split(' (')[0]}): loss {fmt(m['loss'])}, accuracy {fmt(m['accuracy'], 3)}, "
            f"{m['ratio']:.2f}x the mean endpoint loss {fmt(m['mean_endpoint_loss'])} (bar {WIDE_BAR['merge']}x: "
            f"{passed(m['ratio'] <= WIDE_BAR['merge'])}; the path's midpoint after B aligned to A: "
            f"{fmt(m['path_midpoint_loss'])}); {m['seconds']:.0f} s.")


WIDE_NOTES = """\
**What was measured about the wide pairs (issue 9; hand-written, figures from the runs named).**

- **Training (version 4 of the cache).** The ViT of version 3 was undertrained (1000 steps of 64 at 1.5e-3: test
  accuracy 0.744 / 0.731). 3000 steps of 64 at 5e-4 with 200 warm-up steps bring it to 0.986 / 0.978 (test loss
  0.051 / 0.071), 700 s a model on one thread. The LLaMA keeps version 3's recipe: 1200 steps of 32 memorised the
  175k training characters (training loss 0.89 by step 500 against a test loss of 1.35).
- **The start is judged on synthetic data (this round).** Full and permutation modes descend from two starts, the
  exact-member first pass and weight matching; they are local optima of one objective with nearly equal distances,
  and distance did not rank their barriers (the closer start had the higher barrier on the wide ViT in both modes).
  Each start's aligned B is now scored by its loss along the path on 64 synthetic examples labelled by A and B
  together (`symgraph.synthetic.PathJudge`, a few seconds), and the lower kept; permutation mode only among the
  starts no farther than the textbook. Measured at 11 points on the four trained pairs, it kept the start with the
  lower barrier in both modes all eight times. Against last round: full mode on the wide ViT 2.780 -> 2.083
  (0.84x -> 0.63x), now below permutation (2.402), so **full is no longer above permutation on any pair**;
  permutation mode on both LLaMA pairs keeps the first start, below the textbook (llama-chars 2.084 against 2.134;
  llama-chars-wide 1.762 against 2.199, which was above no alignment, 1.927); the ViTs keep the textbook.
- **Learning takes 1000 steps by default (last round; 300 before).** The wide ViT's learning record showed why it
  stopped at 0.337 (0.10x) last round: two early checks came out worse than the first (0.619, then 1.076 and 0.654),
  each backtrack multiplied the rate by 0.3, and at 0.09 of it the 300 steps ended with the path loss still falling
  (train split barrier 0.310 against 0.337 on the test split: under-optimised, not over-fitted). A sweep on a 16-core
  machine (one thread a run, barrier on the test split): the wide ViT at the default rate 0.01 with 300 steps 0.337,
  1000 steps 0.040 (0.012x); rate 0.003 with 300 steps 0.169, without backtracks 0.150, with 1000 steps and no
  backtracks 0.030; rate 0.01 without backtracks diverged (1.128). The shipped pairs want the default rate (rate
  0.003: vit-digits 0.301 against 0.169, llama-chars 0.674 against 0.570), so the rate stays and the steps grow: the
  wide ViT's `full+learn` 0.039 (0.012x, 386 s), vit-digits 0.044 (0.012x), llama-chars 0.522 (0.17x, 125 s); the
  wide LLaMA, then learning 300 steps, 0.276 (0.14x, 365 s; 0.454 with 100 steps). Learning on real text flattens
  near 0.15x on the LLaMA pairs: llama-chars with lr 0.03 0.524, with the straight-through method 1.374, from the
  activation-matched start 0.683.
- **Backtracking only on a clearly worse check (this round).** Until now every check no better than the best so far
  sent learning back to the best point at 0.3x the rate. The learning records of last round's tables showed the
  check at step 200 a little worse than the one at step 100 on four of the five pairs (llama-chars 1.634 against
  1.603, down from 2.350; vit-digits 0.910 against 0.427, down from 2.469), so 800 of the 1000 steps ran at 0.3x
  the rate or less; runs without backtracks did better on the LLaMAs (llama-chars 0.478 against 0.522, the wide
  LLaMA on synthetic data 0.162 against 0.205), but the wide ViT diverged without them (its first check, 1.848, is
  worse than its start, 0.950). A check now backtracks when worse than the best by more than half of the path loss
  learning has gained (`LearnOptions.backtrack_margin`, `--learn-backtrack-margin`, 0.5; any worse check while
  nothing is gained; 0 restores the old rule), or when it is the second check in a row no better than the best; never
  after the last check. Scratch runs with the margin alone (test split, the points of the tables, one thread each),
  margin 0.1 / 0.5 against the old rule: llama-chars 0.478 / 0.478 against 0.522 (synthetic data 0.461 / 0.461
  against 0.492), vit-digits 0.044 / 0.034 against 0.044 (synthetic 1.015 / 0.946 against 1.218), the wide ViT 0.030
  / 0.030 against 0.039, bert-topics 0 / 0; the merge 0.0828 (1.35x) at both. The margin alone let short runs stop
  early: a 25-step run checked every 2 steps went on at full rate past checks within the margin and patience stopped
  it at step 12 (barrier 2.50 against 2.27 with the old rule), hence the second-check rule (2.34 at step 24, where
  patience stopped it). With both rules (the tables above): llama-chars and its synthetic column as with the margin
  alone (no check was the second in a row), vit-digits 0.062 (0.017x; its check at step 300, 0.480, was the second
  above 0.427 and backtracked: the one pair left worse than by the old rule), synthetic 0.946. The wide pairs were
  run with the margin alone; replaying their recorded checks under both rules gives the same decisions (the wide ViT
  would add a backtrack after its last check, which the rule skips), so their figures stand. The wide LLaMA now
  learns the default 1000 steps: 0.180 (0.093x, 1574 s) on real text and 0.162 (0.084x, 1402 s) on synthetic data,
  against 0.276 and 0.231 with 300 steps (times on one thread beside two other runs and the test suite, on 2 cores).
- **Learned matching without data** (`full+learn (synthetic)`): the models' own samples for the LLaMA (half from each,
  1600 sequences), inverted images for the ViT (1600 Gaussian images moved by 30 Adam steps towards a class drawn for
  each, as both models together see it), the two models' mean prediction as soft targets (`symgraph.synthetic`). At
  1000 steps it meets the 0.35x data-free bar on all five pairs: the wide ViT 0.842 (0.25x; 1.240 with 300 steps),
  llama-chars 0.461 (0.15x, below 0.478 on the real text), llama-chars-wide 0.162 (0.084x; 0.231 with 300
  steps), bert-topics 0.026x, and vit-digits 0.946 (0.26x), where 300 steps gave 0.837 (0.23x) and 1000 steps before
  the backtracking margin 1.218 (0.34x): on the small ViT more steps fit the synthetic images better (their path loss
  1.709 -> 0.533) and the real ones worse. Not for want of examples: 6400 inverted images instead of 1600 gave 1.193
  (last round). Plain Gaussian noise (the first version) gave 1.385 on
  vit-digits and 1.677 on the wide ViT at 300 steps; soft targets on the *real* training inputs of llama-chars 0.563
  against 0.570 for its labels (300 steps): the gain is the samples with soft targets together.
- **The merge: checked where it lies (this round).** `merge --method simple` after full+learn (the default 1000
  steps, learned at the midpoint; the frame chosen by the merged loss on the training split, onto A): loss 0.0632,
  accuracy 0.986, **1.03x the mean endpoint loss 0.061 (bar 1.20x: met at the default)**, 887 s for both frames on
  one thread beside the test suite (650 s in a scratch run). The pair's barriers above are last round's: they learn
  along the whole path, whose checks did not change, so only this merge was rerun (`best_alignment_merge`). Until
  this round the candidates of midpoint learning were checked, like those of the whole path, at t = 1/4, 1/2, 3/4,
  whose losses rise as the midpoint's falls: the checks judged the merge by points it never uses, and the default
  stopped at 0.0828 (1.35x). They are now checked at the midpoint alone (`symgraph.learn.checked_points`; the
  record's `checked_t`). Scratch runs of each frame alone (1000 steps, one thread, test split): onto A 1.35x ->
  1.03x, onto B 2.57x -> 1.84x; with the old checks a learning rate of 0.02 gave 1.21x onto A and 1.13x onto B,
  0.03 gave 2.19x onto B, and 2000 steps (last round) 0.89x onto B. On the shipped pairs the same merge with
  learning (`merge --learn`, not in the tables) moves little: vit-digits 1.025x -> 1.014x, llama-chars 1.273x ->
  1.264x, bert-topics 0.988x -> 0.989x (scratch runs of the same call, one thread each, test split). An earlier
  round had measured midpoint checks at 300 steps: 0.113 (1.84x), which is also what onto B alone gives now; the
  frame matters as much as the checks, and `--frame best` learns both. **Weighted merges learn at their own point
  (this round).** A simple merge of two models with weights w_A, w_B is the point t = w_B of the path from A to B'
  (in the frame of A), but `auto` learned such merges along the whole path. It now learns and checks at that point
  (`--learn-t` also takes a number). Merged test loss over the endpoints' weighted mean loss, `--frame reference`,
  the default 1000 steps, whole path -> the merge's point (scratch runs; the committed code gives the vit-digits
  figures to every digit): vit-digits 1:3 0.801x -> 0.749x and 2:1 1.056x -> 0.827x, llama-chars 1:3 1.113x ->
  1.047x, bert-topics 1:3 1.016x -> 0.982x.
- **Permutations learned by the loss do not lower llama-chars (this round).** Its barrier flattens near 0.15x
  (0.478) where the wide LLaMA reaches 0.093x; the direct method cannot move the start's FFN and head permutations.
  Learned on top of full+learn with a Sinkhorn relaxation (each layer's 176 FFN units mixed by a doubly stochastic
  matrix of learned logits, 30 log-domain iterations, the interpolated loss at random t, Adam on the logits for 300
  steps, then rounded by the Hungarian method; the result is an exact reparametrisation): from logits 5 I at rate
  0.5, 73 units moved over the 3 layers and the barrier rose to 0.571; from 10 I at rate 1.0, with the head
  permutations too, 2 units moved and it stayed at 0.479 (test split, 11 points, from 0.4776; `python
  examples/learn_permutations_sinkhorn.py llama-chars --steps 300 --lr 0.5 --init 5`, and `--lr 1.0 --init 10
  --kinds ffn,heads`, 190 s each; the loss at t = 1 is unchanged to 1e-7). With an earlier round's straight-through
  permutations (every move raised the barrier) this says the start's permutations are not what holds the small
  LLaMA up.
- **Random points near the middle (after the tables).** Learning the whole path drew t uniformly; the barrier is
  the path's highest point above the chord, inside the path, and its ends are low from the start. It now draws t
  from Beta(4, 4) (`LearnOptions.t_concentration`, `--learn-t-concentration`; 1 restores uniform; checks still at
  1/4, 1/2, 3/4). `full+learn` barriers, default 1000 steps, test split, B aligned to A, one thread each on the
  shared 2-core machine (`SYMGRAPH_T_BETA=c python examples/bench_learn.py --pairs PAIR --aligns full+learn
  --points 11 [--seed 1]` on a scratch copy drawing Beta(c, c); the wide pairs at the settings of their table),
  uniform -> Beta(4, 4): llama-chars 0.478 -> 0.424 (seed 1: 0.476 -> 0.420; 0.135x of unaligned, still above
  the 0.10x bar), vit-digits 0.062 -> 0.004 (seed 1: 0.062 -> 0.016), bert-topics 0 -> 0, the wide ViT 0.030 ->
  0.018, the wide LLaMA 0.180 -> 0.116 (0.060x; 7 points, first 64 test windows, 847 s of learning). Other
  concentrations on llama-chars: 2 0.448, 8 0.404, 16 0.385 (seed 1: 0.367), 64 0.424, the midpoint alone 0.503;
  but 16 moves the small ViT's barrier off the middle (vit-digits 0.107, seed 1 0.243) where 4 lowers it, and on
  the wide ViT 16 gave 0.0076.
- **The tables rerun with Beta(4, 4) (stop 32).** The shipped pairs' tables and the wide ViT's row are this
  round's run (`python examples/paper_experiments.py`, 986 s, and `--pairs vit-digits-wide`, 1437 s, one thread each
  on the shared 2-core machine): `full+learn` llama-chars 0.424 (0.135x; uniform 0.478), vit-digits 0.0045 (0.001x;
  0.062), bert-topics 0, the wide ViT 0.018 (0.005x; 0.030). The synthetic column, which learns the same way:
  llama-chars 0.402 (0.128x; 0.461), bert-topics 0 (0.0054), the wide ViT 0.769 (0.23x; 0.842), but vit-digits
  1.217 (0.338x; 0.946): the small ViT on inverted images is the one pair that learns worse near the middle, still
  inside the 0.35x bar. The wide LLaMA's row is last round's (uniform points): its rerun did not fit beside the
  other work this round; drawn from Beta(4, 4) it gave 0.116 (0.060x) in the scratch run above.
- **The wide ViT's merge is not robust (this round).** Its rerun gave 2.23x the endpoints' loss (0.137, onto A)
  where the last round's gave 1.03x (0.063) from the same code path: the draw of t does not touch it (a merge
  learns at its own point), the plain full alignments of both directions are the same to every digit at the last
  round's commit (eb7bc75) and now, and a 30-step learned merge agrees to 1e-6. Onto B alone (scratch, 1000 steps,
  one thread each, side by side): 0.113 (1.84x) at eb7bc75, 0.133 (2.16x) now. So 1000 steps of learning at the
  midpoint amplify differences of rounding into merges 1.0x-2.2x the endpoints' loss: the 1.20x bar was met once,
  not reliably, and is **missed** in this run. Longer learning (2000 steps gave 0.89x onto B last round) or
  several seeds with the best kept on the training split are the next things to try.
- **Why the wide ViT's merge swings (this round).** `python examples/study_wide_merge.py --seeds S` learns B's
  alignment onto A (folded) at the midpoint for 1000 steps, as `merge` does, and scores every checked candidate on the
  test split too (one thread, two runs side by side; `examples/results/wide_merge_seeds.json`). The endpoints fit the
  training images to losses of 0.0015 and 0.0029 (test 0.051 and 0.071; their ensemble, mean probabilities, 0.038),
  and every learned midpoint fits them as well (0.002 on the checked batches) while its test loss lands anywhere from
  0.07 to 0.12: once the labels are fitted the task loss no longer tells alignments apart, and which of many
  train-perfect midpoints learning stops at decides the merge. Midpoint test losses, seeds 0-4: 0.072 / 0.079 / 0.101
  / 0.094 / 0.071 without more (bar: 0.074; 1.36x the endpoints' mean on average, 2 of 5 within it). Tried in scratch
  runs (20 checks, seeds 0 / 1 or 0 / 1 / 2): orthogonal head maps only 0.070 / 0.112 / 0.103; checks on 8 batches
  held out of the steps (`--learn-holdout`) 0.121 / 0.078, as 256 held-out images rank candidates no better (one run's
  best held-out check, 0.036, scored 0.126 on the test split; on the shipped pairs holdout costs more than it gives:
  vit-digits 0.004 -> 0.041, bert-topics 0 -> 0.089, llama-chars 0.424 -> 0.416,
  `examples/results/learn_holdout.json`); distillation to the endpoints' probabilities on the training images 0.126 /
  0.105 (one-hot there, it adds nothing); the whole path (Beta(4, 4)) 0.101 at the midpoint. Kept, on by default for
  classifiers with float inputs: distillation on mixed inputs (`--learn-mixup 1`), where the endpoints are unsure and
  keep teaching: seeds 0-4 0.086 / 0.054 / 0.063 / 0.060 / 0.053 (1.03x on average, 4 of 5 within the bar, at 1.7x the
  time per run; scratch, 20 checks: 0.063 / 0.061). `merge --data digits --learn` itself (both frames learned, the
  lower merged loss on the training split kept: onto A, 0.030 against 0.034 there) gave 0.092 (1.50x). On vit-digits
  the barrier is unchanged on average (seeds 0 / 1 / 2: 0.004 / 0.016 / 0.025 without, 0.015 / 0.015 / 0.017 with;
  `python examples/bench_learn.py --pairs vit-digits --aligns full+learn --points 11 --seed S --mixup M`); token
  inputs (llama-chars, bert-topics) cannot be mixed and are untouched. So the bar is met on average and by 4 seeds of
  5, not by every run: seed 0, the one `merge` and this report use, ends at 1.41x (its check at step 200 backtracked,
  and the other 800 steps ran at 0.3x the rate), and the bar stays **missed** as measured. Several seeds, kept by a
  held-out loss on enough examples to rank them, are the next thing to try.
- **What more learning buys llama-chars (this round).** A sweep on a 16-core machine lent for the round (one thread
  a run, `python examples/bench_learn.py --pairs llama-chars --aligns none,full+learn --points 11` with the options
  named; torch 2.11 there, and the default run gave 0.424 to three digits, as here): 2000 steps 0.388; 2000 steps
  at rate 0.02 0.373; Beta(8, 8) with 2000 steps 0.367; Beta(16, 16) with 2000 steps **0.357 (0.113x)**, the lowest;
  batches of 64 0.410; rate 0.02 0.405; orthogonal head maps only 0.436; the old backtracking rule (margin 0) 0.445;
  20 checks without patience 0.445; Beta(8, 8), seed 1, 0.393. The worst of three points per step (3x the passes)
  0.394, their mean 0.428, the worst of three uniform points 0.417. On vit-digits 2000 steps gave 0.014 and
  Beta(8, 8) 0.069 (seed 1: 0.101) against 0.0045 at the default; bert-topics stays at 0. So llama-chars keeps
  falling with steps and concentration, about 0.035 per doubling of the steps, and the 0.10x bar (0.315) would
  need several times the default's learning; the default stays, as the other pairs do not need it (every run:
  `examples/results/learn_sweep.json`).
- **Checks score what the steps descend; a trial of the lower rate (stop 34).** With distillation on mixed inputs
  the steps descend the task loss plus that term, but candidates were checked on the task loss alone, which is spent
  once the training images are fitted; checks now add the term on the checked batches, mixed alike for every
  candidate, and `merge --frame best` with learning keeps the frame whose learned alignments score lowest on it
  (the merged training loss, 0.030 against 0.034, had kept the frame at 1.50x). On the wide ViT (B onto A at the
  midpoint, `examples/study_wide_merge.py`, seeds 0-4) this alone gave 0.071 / 0.054 / 0.062 / 0.060 / 0.077
  (1.05x on average, against 1.03x; the worst seed 1.26x against 1.41x); vit-digits is unchanged (0.0152 at seed 0,
  `bench_learn.py --pairs vit-digits --aligns full+learn --points 11 --no-rate-trial`). Every seed that ended above
  the bar had backtracked at step 200 to its step-100 point, reached at a rate too large for this model (checks of
  1.2-3.2 there, against 0.5-0.6 at rate 0.003): at 0.003 throughout seeds 0 and 4 gave 0.051 and 0.047 (0.84x,
  0.77x), with no backtracks. The shipped pairs want 0.01 (last rounds), so the rate is not lowered; instead a first
  check that beats the start is followed by a trial of 0.3x the rate from the start for as many steps, and learning
  goes on from whichever checked lower (`--learn-no-rate-trial` turns it off): the wide ViT seeds 0 / 1 / 2 / 4 0.055 /
  0.054 / 0.057 / 0.072 (0.89x / 0.88x / 0.93x / 1.18x; seed 3 not rerun), and in this round's table run
  `merge --learn` on the wide pair **0.057 (0.93x): the bar is met**, kept onto B by the new frame score; the
  wide ViT's `full+learn` barrier 0.0185 (0.0181 before). The cost: a short
  trial favours the smoother lower rate, and on vit-digits it keeps 0.003 (checked 0.839 against 1.319 at step 100)
  where 0.01 ends lower, so its `full+learn` barrier is 0.103 (0.028x, inside the 0.10x bar) against 0.0152 without
  the trial; llama-chars (token inputs: the trial is its one change) 0.4375 against 0.424 (0.139x against 0.135x);
  bert-topics stays at 0. The shipped tables and the wide ViT's row are this stop's run (`python
  examples/paper_experiments.py`, 1183 s, and `--pairs vit-digits-wide`, 2179 s, one thread each, side by side on
  the shared 2-core machine); the wide LLaMA's row is still the one of two rounds ago.
- **The trial waits for a backtrack (stop 35).** The trial now runs only where the failure it guards against shows:
  at the first backtrack, when the best point is still the first check's (the full rate gained once, then went
  wrong), learning goes back to the start at 0.3x the rate instead of to that point, and after one check's steps
  goes on at 0.3x from whichever point checked lower (`rate_trial` in the record: its steps, rates, checks and
  the rate whose point was kept). Pairs where 0.01 keeps gaining never backtrack there: the shipped tables above
  (this stop's run) have vit-digits' `full+learn` back at **0.0152** (0.004x; 0.103 with last stop's trial) and
  llama-chars at 0.424 (0.135x; 0.4375), the synthetic column 1.218 and 0.402; on bert-topics the trial ran (step
  200 to 300, 0.003's point kept, 1.080 against 1.135) and the barrier stays 0. The wide ViT pair had to be
  retrained on this session's machine (`examples/train_models.py --only vit-wide`, 2258 s a model, one thread, two
  side by side): the same deterministic recipe gave other models on this CPU (test loss 0.0755 and 0.0968 against
  0.0514 and 0.0712 last round), so the wide figures of earlier rounds are not comparable to this one's. On it
  the merge study (`python examples/study_wide_merge.py --seeds S`) gave seeds 0 and 4 **0.066 and 0.058 (0.77x and
  0.67x the endpoints' mean 0.0861)**: their first check did not beat the start, so they went back there at 0.3x
  and no trial ran. The shipped tables also moved where nothing changed: vit-digits' `full+data` 1.856 -> 1.880,
  from endpoint losses that differ in the 8th digit on this machine's CPU, which the activation statistics'
  discrete choices amplify.
- **The wide ViT's row on the retrained pair (stop 36).** The wide ViT's row above is this stop's run on the pair
  retrained last stop (`python examples/paper_experiments.py --pairs vit-digits-wide`, 4682 s, one thread beside
  other runs): none 2.665, data-free `full` 2.354 (0.88x), `full+learn (synthetic)` 0.913 (0.34x), `full+data`
  0.588 (0.22x), `full+learn` 0.000; the table's `merge --learn` 0.0802, **0.93x the endpoints' mean 0.0861**
  (onto A; bar 1.20x). Tried on llama-chars for the 0.10x bar (learning on the train split, 11 points, test
  barrier; 0.424 at the default): 3000 steps 0.393 (0.125x; `python examples/bench_learn.py --pairs llama-chars
  --steps 3000 --aligns full+learn`); scratch runs, not kept: the train split and 1600 synthetic samples in
  alternate batches 0.399, soft targets (the endpoints' mean prediction) on the real inputs 0.426, and half the
  steps' t drawn within 0.125 of the checked point highest above the straight line 0.401 (on vit-digits 0.174
  against 0.015: not kept). Every remedy tried lands at 0.39-0.43 (0.12-0.14x): steps, data and where t is drawn
  are not what holds the narrow LLaMA above the bar; the wide LLaMA reaches 0.09x with the same method.
- **Data-free full mode aligns on synthetic activations too (stop 37).** Activation costs need no real data: the
  judge's 64 synthetic examples (the models' own samples; random inputs of the config's shapes) serve, and full
  mode without data now also aligns the residual stream on their activations and keeps that alignment where its
  path loss is lower (for pixels on the same examples inverted) and it is no farther from A than B began. The
  shipped tables above are this stop's run; the wide rows predate it. Measured with `symgraph.barrier` (B aligned
  to A, folded, 11 points; the wide LLaMA 7 points on 64 test windows), weights alone -> the new default:
  vit-digits 3.262 -> 2.888 (0.87x of none), llama-chars 1.930 -> 1.583 (0.50x), bert-topics 0 -> 0, the wide ViT
  2.354 -> **0.571 (0.21x: the 0.35x data-free bar met there; activations of real digits, `full+data`, gave
  0.588)**, the wide LLaMA (retrained on this machine for the measurement: none 2.293, permutation 1.654) 1.322 ->
  1.193 (0.52x). The judge matters: on the wide ViT the path loss on the random examples ranked the two
  alignments the wrong way round (activations 2.90 against weights 2.64, for test barriers 0.57 and 2.35), on
  the same examples inverted the right way (2.00 against 2.27, two draws; vit-digits 1.37 against 1.63), so
  pixels are judged inverted. What the examples are matters too: recorded on inverted images the small ViT's
  activation-matched alignment gave 3.43, on random ones 2.47-2.89 (three draws of 64) and 3.20-3.32 (256), on
  the wide ViT 0.57 and 0.62 (two draws of 64); the llama's samples gave 1.48-1.58 (real text 1.643). It costs
  an activation recording and a second alignment: the wide ViT's full mode took 129 s against 45 s (one thread,
  the machine loaded), so the time bar (data-free full within 2x permutation) is further off there. Still short
  of 0.35x: vit-digits, llama-chars and the wide LLaMA. In this stop's tables (21 points) `full` is llama-chars
  1.583 (0.50x; 1.930 before), below `full+data` on the real text (1.643), vit-digits 2.983 (0.83x; 3.298),
  bert-topics 0. The merge tables did not move: `merge` aligns through its own plan (`symgraph.consensus`), which
  neither judges starts nor tries synthetic activations; bringing both to merges is the next step.
- **Merges align as `align` does (stop 38).** Without data, `merge --align full` now makes each model's first
  alignment onto the reference with `symgraph.align` (starts judged on synthetic examples, activations of them
  tried; the consensus's `first_pass`, once per pair, shared by the frames), and frames are judged on a
  classifier's pixels inverted. The shipped tables above are this stop's run (`python examples/paper_experiments.py`,
  3354 s, one thread beside the test suite); their barriers did not move (full llama-chars 1.583, vit-digits 2.983,
  bert-topics 0), their full merges did, before -> now: llama-chars simple 3.266 -> 2.919, fisher 3.236 -> 3.003,
  regmean 3.056 -> 2.920; vit-digits simple 3.334 -> 3.028, **fisher 2.981 -> 3.262 and regmean 2.743 -> 2.990
  (worse)**; bert-topics simple 1.123 -> 1.122, fisher 1.123 -> 1.109, regmean 1.144 -> 1.160. The alignment is
  chosen by the path loss of simple interpolation, which is not what Fisher and RegMean merges average; with their
  data at hand the weight-matched alignment could be tried as a further frame and the data decide (not done). Off
  the tables (`python examples/study_merge_frames.py --pairs ...`, README.md): the wide ViT's data-free simple merge
  2.097 -> 0.649 (7.5x the endpoints' mean; learned matching's merge is the one under the 1.20x bar), the wide
  LLaMA's 2.494 -> 2.421 on 64 test windows. Merges of two models take about 2-4x longer (two judged alignments
  instead of three by weights): llama-chars' full simple merge 21 s -> 72 s in this run.
- **With data, the data chooses the merge's alignment too (stop 39).** With `--data`, `merge --align full` now also
  tries each frame with its first alignments by weights alone, and each model's frame with them on activations of
  the data (as `full+data`), keeping the lowest merged loss on the data (`symgraph.merging._candidates`). The
  tables above are stop 38's run; the full row's Fisher and RegMean merges now give, before -> now (`python
  examples/study_merge_frames.py --method fisher` and `--method regmean`, the same 256 training examples in batches
  of 64, one thread, two runs side by side; `results/merge_frames_{fisher,regmean}.json`, every frame's score and
  test loss): vit-digits fisher 3.262 -> 2.687, regmean 2.990 -> 2.290 (fisher in model 1's frame, regmean in
  model 2's, both on activations of the data); llama-chars fisher 3.003 -> 2.968, regmean 2.920 (unchanged: the
  judged frame still scores lowest); bert-topics fisher 1.109 -> 1.117 and regmean 1.160 -> 1.168, a little
  worse: its training examples rank the frames on activations first (1.0076 against 1.0117 for fisher) where the
  test split does not. The choice is made on training data: vit-digits' regmean kept 2.290 where model 1's frame
  on activations gives 2.105 on test. It costs 2-2.6x the time (the three fisher merges, one thread, stop 38's
  code then this one, back to back): llama-chars 44 s -> 102 s, vit-digits 20 s -> 40 s, bert-topics 22 s -> 58 s.
- **Tried and not kept (stop 40).** Scoring a merge's candidates on a batch held out of the statistics (the first
  192 of the 256 training examples for Fisher/RegMean and the activation alignment, the last 64 to score; scratch,
  test loss of the merge kept, held-out choice against the choice on the 192): bert-topics the same frame for both
  methods (1.115, 1.169), vit-digits fisher better (2.082 against 2.467), regmean worse (2.475 against 2.394),
  llama-chars worse for both (3.011 against 2.979, 2.935 against 2.879): one batch of 64 ranks these merges no
  better than the examples the statistics saw. The inverted examples that judge full mode's two candidates on a
  classifier cost 30 s of the wide ViT's 78 s alignment (one thread); fewer of them or fewer inversion steps
  ranked the candidates as 64 and 30 do on both ViT pairs at 64/15 and 32/15 (two draws each), not at 32/8 (the
  wide ViT) or 16/30 (vit-digits), and left the default as is: the saving (about 15 s) does not bring the wide
  ViT's full mode within 2x permutation (13 s), whose weight-matched part alone is about twice that. The time
  bar holds on the shipped pairs (`BENCH_THREADS=1 python examples/bench_align.py --pair vit-digits`, `--pair
  llama-chars`, every stage from loading to verification: full 1.56x and 1.14x permutation).
- **A short learning on synthetic data (stop 42).** The data-free bar is missed on the narrow pairs by weight
  matching, and learning on synthetic data meets it, but at the default 1000 steps on 1600 examples it takes minutes.
  100 steps on 256 examples (`symgraph barrier A B --data SPEC:test --steps 11 --align MODE --learn-data synthetic
  --learn-steps 100 --learn-synthetic-examples 256`, one thread, the other core running a sweep; whole command
  times): vit-digits permutation 4.071 (24 s), full 2.878 (30 s), short learning **0.754 (0.23x of 3.329; 47 s)**,
  50 steps 0.899 (47 s), 100 steps on the judge's 64 examples 1.469 (32 s: too few, they are fitted); llama-chars
  2.084 (45 s), 1.583 (51 s), **0.582 (0.18x of 3.148; 95 s)**. So the 0.35x bar is reached without data at about
  twice permutation mode's time on both narrow pairs, most of it making the examples (inverting 256 images, sampling
  256 sequences). Simple merges after it (`merge A B --align full --data synthetic --learn --learn-steps 100
  --learn-synthetic-examples 256`): vit-digits 1.167 (81 s), llama-chars 1.868 (145 s), against 3.028 and 2.920
  data-free. Not made the default of `full`: learning stays opt-in (`--learn` without data is refused, as the issue
  asks), the recipe is in README.md. Fine-tunes need none of this: two fine-tunes of vit-digits-a (300 steps at
  1e-3, seeds 1 and 2) have no barrier unaligned, and every mode leaves them where they are (distance 0.0581 ->
  0.0579 in full mode, barrier 0).

- **Data-free full mode learns briefly on synthetic data (stop 52): the 0.35x data-free bar is met on every
  pair.** Weight matching, judged starts and synthetic activations left the narrow pairs and the wide LLaMA at
  0.50-0.87x, and only learning on synthetic data (stop 42) brought them under 0.35x. `full` mode without data
  now ends with it where there is something to learn: where the path of the alignment kept so far rises above its
  ends on the judge's 64 synthetic examples by more than 5% of their loss, it tunes the weight-matched alignment by
  50 steps of learned matching (2 checks) on 256 other synthetic examples (a causal LM's 64 tokens long, the
  judge's 128) and keeps the learned alignment where
  its path loss on the judge's examples is lower (`--short-learning`, on by default; README.md). The rise
  after data-free full alignment, measured on the judge's examples: vit-digits 0.87 and llama-chars 0.71 of the
  ends' loss, the wide ViT 0.043 (its ends' loss on inverted images is 2.06: the two models disagree there), random
  twins (vit, llama, bert, gpt2 of the zoo) under 0.005, bert-topics -0.017; so the wide ViT, random twins and
  bert-topics skip it. Loss barriers (test split, B aligned to A, folded as `barrier` folds; 11 points, the wide
  LLaMA 7 points on 64 test windows; one thread; scratch scripts calling `symgraph.connectivity.barrier` with
  `align_options={"short_learning": False}` for the previous default):

  | pair | none | permutation | full, previous default | full, now | full / none |
  |---|---|---|---|---|---|
  | vit-digits | 3.329 | 4.071 | 2.878 | 0.986 | 0.30x |
  | llama-chars | 3.148 | 2.084 | 1.583 | 0.716 | 0.23x |
  | bert-topics | 0.210 | 0.127 | 0 | 0 (skipped) | 0x |
  | vit-digits-wide (retrained this stop) | 2.892 | 2.474 | 0.622 | 0.622 (skipped) | 0.22x |
  | llama-chars-wide (retrained this stop) | 2.148 | 1.726 | 1.152 | 0.323 | 0.15x |

  Sampled sequences of 128 tokens, as the judge's, gave llama-chars 0.695 and the wide LLaMA 0.304 at about twice
  the learning time (llama-chars, one process, one thread: 10.2 s against 4.5-5.6 s). Learned from the
  activations' alignment instead of the weight-matched one (128 tokens), llama-chars gave 0.626 and vit-digits
  1.300 (over the bar); the judge's path losses ranked each pair's two outcomes as the test barriers did (llama
  1.885 against 1.928, vit 0.881 against 0.775), but learning both costs twice the time, so it learns from the
  weights as `--learn` does. Shorter runs of the stop-42 recipe (`--learn-data synthetic`, 11 points, from the
  weight-matched start): 50 steps with 2 checks on 256 examples vit-digits 0.899, llama-chars 0.672; 40 steps on
  192 examples in batches of 16 1.377 and 0.739; 100 steps with 10 checks 0.754 and 0.582. The wide pairs were
  retrained on this machine (`examples/train_models.py --only vit-wide --model a/b`, test loss 0.0655 / 0.0694,
  1434 s a model; the LLaMA 1.3481 / 1.3577, about 430 s); the wide table's LLaMA row is theirs since stop 53, its
  ViT row is not.
  With data, learning on the training text (`full+learn`, 1000 steps) from this short synthetic learning instead
  of from the weight-matched alignment gave llama-chars 0.4155 (0.132x) against 0.424 (0.135x): not what holds the
  0.10x bar (scratch script chaining the two learnings, 11 points, 257 s).
  **Simple merges without data** (`python examples/study_merge_frames.py --pairs vit-digits` and `--pairs
  llama-chars`, one thread; merged test loss of the frame kept): vit-digits 3.028 -> 1.546 (onto A it would be
  1.061; endpoints 0.14), llama-chars 2.920 -> 2.044 (endpoints 1.33), 33 s and 34 s.
  **The time bar is missed further** (`BENCH_THREADS=1 python examples/bench_align.py --pair PAIR --modes
  full,permutation`, every stage from loading to verification, one thread, idle machine; full / permutation,
  seconds, of which learning): llama-chars 13.6 / 5.2 (2.6x; 4.4 s learning), vit-digits 10.4 / 3.7 (2.8x; 5.2
  s), the wide LLaMA 78.6 / 15.1 (5.2x; 41.2 s), peak RSS 2716 against 701 MB there. With `--pair trained` on a
  partly loaded machine (and 128-token sequences): bert-topics 5.9 / 3.4 (1.8x; skipped), the wide ViT 28.2 / 7.5
  (3.7x; skipped: its judged starts and activations already cost that). Models past the judge's limits (50M
  parameters, 1e9 elements a pass: BERT-base and up) make no synthetic data, so their time is unchanged;
  `--no-short-learning` restores the previous cost. The quality bar is the product's reason to exist, so the
  learning stays on by default; fewer examples per step for large models, or a step count that shrinks with the
  model's forward cost, are the next things to try for the time bar.

- **The tables rerun with the short synthetic learning (stop 53).** The shipped tables above are this stop's run
  (`python examples/paper_experiments.py`, 1975 s, one thread beside the wide LLaMA's run), and so is the wide
  LLaMA's row (`--pairs llama-chars-wide`, 3090 s, on the pair retrained in stop 52). Data-free `full`:
  llama-chars 0.7162 (0.23x of 3.148; was 1.5832), vit-digits 0.9858 (0.27x of 3.600; was 2.9831), bert-topics 0
  (it learns nothing: its path does not rise), the wide LLaMA 0.323 (0.15x of 2.148). So the 0.35x data-free bar
  is met on every pair in the tables but the wide ViT's row, which is still stop 36's run on the pair of then
  (0.88x there); on the pair retrained in stop 52 the current code gives 0.622 (0.22x, stop 52's bullet), and its
  rerun (some 80 minutes) did not fit this stop. The learned alignment is kept for its path loss, not its
  distance: full mode now ends farther from A than permutation mode on the narrow pairs (llama-chars 1.0614
  against 1.0588, vit-digits 0.8933 against 0.8318), and the simple merges after it gain (llama-chars 2.9195 ->
  2.0525, vit-digits 3.0284 -> 1.5451 onto A). With data the picture is unchanged: `full+learn` llama-chars 0.4241
  (0.135x, the one pair above the 0.10x bar), the wide LLaMA 0.104 (0.05x). One ablation moved far: bert-topics
  aligned in its attention groups only (`only="attention"`) now learns (its path rises there, where the whole
  group leaves none), and 50 steps take its general linear head maps to condition 98 (the bound is 100) and its
  distance to A from 0.71 to 2.39; its merged loss falls (1.3187 -> 1.2063), and the output is checked as every
  alignment is.
- **A crash the rerun found (stop 53).** The first attempt at these tables stopped in the ablations: full mode with
  `only="ffn"` on vit-digits (GELU pins the FFN's scales: its groups are permutations alone) started the short
  learning on groups with nothing continuous to learn, and torch's Adam refused an empty parameter list
  (`ValueError`).
  Learned matching now refuses such groups before any data is made (`symgraph.learn.check_learnable`: the direct
  method needs a continuous part, the straight-through one a permutation), and full mode skips its short learning
  there; a test covers both through `align`. To look for more of the kind, the short learning was forced on every
  path (`SHORT_LEARNING_RISE = -1`) for random twins of the zoo's 26 families and 9 more Hugging Face families
  (phi3, albert, gemma, falcon, bloom, gpt_bigcode, electra, gemma2, helium): none failed; t5, bart, clip and the
  plain torch modules make no synthetic data and skip it.
- **Inverting 128 images at a time (stop 53).** A classifier's synthetic inputs are inverted across batches, 128
  examples at a time while one forward over them writes at most 1e8 tensor elements (each example still moves by
  its own loss; `symgraph.synthetic.INVERTED_TOGETHER`). One thread: vit-digits 0.75 s per 32 examples inverted 32
  at a time, 0.35 s 128 at a time, so its short learning (256 inverted images) takes 4.2 s instead of 5.2 s; the
  wide ViT's inversion costs the same either way (its steps are compute-bound). The class draws are the same
  sequence, and the barriers of this stop's tables are those of stop 52's scratch runs. The time bar stays missed
  (`SYMGRAPH_WIDE_MODELS=... BENCH_THREADS=1 python examples/bench_align.py --pair trained --modes
  full,permutation`, one thread, one other run on the machine; full / permutation, seconds): llama-chars 15.2 /
  6.2 (2.4x; 4.6 s learning), vit-digits 9.7 / 3.8 (2.5x; 4.2 s), bert-topics 6.1 / 3.8 (1.6x), the wide ViT 31.3 /
  9.5 (3.3x; it learns nothing: its judge's 64 inverted images cost some 13 s), the wide LLaMA 93.0 / 15.3 (6.1x;
  43.3 s learning; peak RSS 2707 against 696 MB).
- **More learning does not reach 0.10x on llama-chars (stop 53).** 6000 steps drawing t from Beta(16, 16) (`python
  examples/bench_learn.py --pairs llama-chars --steps 6000 --t-concentration 16 --aligns full+learn --points 11`,
  one thread beside other runs): 0.477, above the default's 0.424. Its checks every 600 steps found the best path
  loss at the first (1.468 on the training batches), then 1.470, 1.484, 1.504 at the full rate, and patience
  stopped it at step 2400 (466 s). The 2000-step run of Beta(16, 16) that gave 0.357 gained in its annealed half;
  a long run at the full rate only wanders. Checking an exponential moving average of the iterates instead of the
  iterate (a scratch patch: the element parameters and bases averaged after every step, orthogonal bases projected
  back by SVD, the average reset on a backtrack) did not break through either: 1000 steps at the defaults 0.418
  (decay 0.99; 0.424 without), Beta(16, 16) with 2000 steps 0.364 (0.99) and with 3000 steps 0.376 (0.995). Both
  long runs' checks flattened near 1.434-1.438 on the training batches and patience stopped them at steps 1600 and
  1800 (211 s and 238 s).
- **The short learning needs a path that rises by 15% (stop 54; 5% before).** Forced on the wide ViT
  (`SHORT_LEARNING_RISE = -1`), whose path rises by 0.043 of its ends' loss after data-free full alignment,
  the short learning lowered the judge's path loss and raised the test barrier. Each candidate of full mode
  without data, with the test barrier (11 points) and the path loss on the judge's 64 inverted and raw synthetic
  examples (scratch script wrapping `symgraph.connectivity.barrier`; llama-chars' examples are sampled, so the two
  judges are one there):

  | candidate | wide ViT: test / inverted / raw | vit-digits | llama-chars: test / judge |
  |---|---|---|---|
  | weights | 2.043 / 2.359 / 2.633 | 3.262 / 1.751 / 3.486 | 1.930 / 2.600 |
  | activations | **0.622** / 2.153 / 2.800 | 2.878 / 1.618 / 2.654 | 1.572 / 2.451 |
  | learned from the activations' alignment | 0.997 / 1.583 / 2.020 | 1.300 / 0.881 / 1.995 | **0.652** / 1.894 |
  | learned from the weights' (the default) | 1.560 / 1.799 / 2.151 | **0.986** / 0.775 / 1.924 | 0.716 / 1.933 |

  The judge ranks the learned candidates first on all three pairs, and the wide ViT's test barrier ranks them
  last: learning fits the inverted images' distribution, which the judge shares, and where the path barely rises
  on them there is little barrier to lower. The rises of the pairs where it helps: vit-digits 0.81, llama-chars
  0.68, the wide LLaMA 0.42; random twins and bert-topics under 0.005. 0.05 sat just above the wide ViT; 0.15
  sits about 3x from each side. No pair's main rows change: each is on the same side of both bounds. The
  bert-topics ablations do: aligned in its attention groups alone, or in some of its layers, its path rises by
  between 5% and 15%, and stop 53's tables learned there; now they do not. Their simple merges lose what learning
  gave (attention only 1.2063 -> 1.3187, layer 0 1.2633 -> 1.3316, last 3 layers 1.2063 -> 1.3192; unaligned
  1.3373, every group 1.1216), and their distances to A fall back (2.389 -> 0.675 attention only).
- **The wide ViT's row rerun (stop 54).** The wide table's ViT row is now this code's run on the pair retrained in
  stop 52 (`python examples/paper_experiments.py --pairs vit-digits-wide --wide-models DIR`, 2661 s, one thread
  beside other runs; stop 36's run on the pair of then before). Data-free `full` 0.622 (0.22x of 2.892; stop 36:
  2.354, 0.88x), so the 0.35x data-free bar is met on every pair of the tables. The short learning is skipped there
  (its path rises by 0.043): the activations of the judge's inverted images carry it. `full+learn (synthetic)`
  0.962 (0.33x), `full+data` 0.666 (0.23x), `full+learn` 0.008; the simple merge after the best alignment 1.05x
  the endpoints' mean loss (bar 1.20x).
- **With data, full mode ends with the same short learning (stop 54).** `full+data` stopped at the better of its
  activation- and weight-matched alignments, and so ended above data-free `full` on every trained pair (llama-chars
  1.643 against 0.716, vit-digits 1.856 against 0.986, the wide LLaMA 1.140 against 0.323): giving data made the
  alignment worse. It now tunes the weight-matched alignment by the same 50 steps on the train split's batches the
  activation costs did not use, judged on the 4 batches they did. Each candidate (test barrier, 11 points, whole
  test split / path loss on the judged batches; scratch script wrapping `symgraph.connectivity.barrier` with
  `aligns=("full+data",)`, 16-example batches, one thread beside other runs; learning's seconds):

  | candidate | llama-chars | vit-digits | vit-digits-wide | llama-chars-wide |
  |---|---|---|---|---|
  | weights | 1.930 / 2.397 | 3.262 / 2.318 | 2.552 / 1.015 | 1.334 / 2.014 |
  | activations | 1.645 / 2.232 | 1.507 / 0.862 | 0.758 / 0.461 | 1.104 / 1.795 |
  | learned (kept) | **0.796** / 1.734, 4.6 s | **0.722** / 0.395, 2.8 s | **0.661** / 0.360, 22.6 s | **0.405** / 1.418, 40.1 s |

  The judge ranks the candidates as the test barriers do on all four. On llama-chars the short learning on
  synthetic samples (0.716) still beats it on the real text (0.796): soft targets from both models carry more
  than the next character. Not the 0.10x bar, which `full+learn` (1000 steps) is for.
- **Where full mode's time goes, and why the time bar is still missed (stop 55).** Two costs that measured something
  twice are gone, with results unchanged (same distances to every digit on the five pairs): the activations of each
  site, compressed into a basis of their rows, are now projected through the rows' Gram matrix rather than a QR of the
  positions (half the time; `symgraph.activations._compressed`, each inner product to its rows' precision as before),
  and the short learning measures the path's rise from the path loss that had just chosen the alignment (the wide
  LLaMA's `judge_rise` 4.7 -> 1.5 s). Activations stay in the model's dtype until thinned. Without data, a learned
  alignment that ends farther from A than B began is no longer kept (the promise the activations' candidate already
  kept; none of the trained pairs comes near it). One run on an idle machine (`SYMGRAPH_WIDE_MODELS=...
  BENCH_THREADS=1 python examples/bench_align.py --pair trained --modes full,permutation`,
  `results/bench_align_trained.json`; full / permutation seconds, every stage from loading to verification):
  llama-chars 13.6 / 6.7 (2.02x; learning 4.8 s), vit-digits 11.4 / 4.2 (2.72x; 4.7 s), bert-topics 5.6 / 3.5 (1.59x;
  no learning), the wide ViT 28.1 / 7.6 (3.70x; no learning, its judge's 64 inverted images 13.7 s), the wide LLaMA
  79.3 / 16.4 (4.83x; learning 46.4 s, activations 7.3 s; peak RSS 2164 against 702 MB). BERT-base size, 4 layers, two
  random initialisations (`--pair bert-base --layers 4 --kinds independent --modes full,paper,permutation`,
  `results/bench_align_bert_base_4layers.json`, one other job on the machine): full 22.7 s, paper 12.3 s, permutation
  27.0 s (1.84x paper, 0.84x permutation; past the judge's limits it makes no synthetic data). The bars conflict where
  learning runs: without its short learning vit-digits' data-free barrier is 2.878 (0.86x of no alignment's 3.329, 11
  points; bar 0.35x), and with it the learning alone (4.7 s, mostly inverting its 256 images) costs more than the
  whole permutation run (4.2 s); the wide LLaMA without learning would still be about 2x (its activations' candidate
  and their judging). The quality bar is the product's reason to exist, so the learning and the activations stay on by
  default (`--no-short-learning`, `--no-synthetic-activations` where a user wants the time). Fewer inversion steps
  (stop 56; `INVERSION_STEPS` 30 -> 15 -> 10, vit-digits, test barrier 11 points / `align`'s seconds beside a sweep)
  gave 0.986 / 6.9 s, 1.027 / 4.1 s and 2.888 / 5.3 s (at 10 steps the judge's images no longer showed the path's
  rise, and nothing was learned): the steps stay. Forced to learn on every path (`SHORT_LEARNING_RISE = -1`) with
  `--data` (one batch for the costs, one to learn on), the pipeline sweep's 44 data types (`examples/sweep_pipeline.py
  --data` on a scratch copy) all passed: the learned alignment was kept on 38 and computed B's function on all.
- **With text, the short learning also learns on synthetic examples (stop 56).** The tables' `full+data` column is now
  what `barrier --align full+data` does by default: the train split in batches of 16, activation costs on the first 4,
  the short learning on the others (this script used to give it 256 examples in 4 batches, all taken by the costs, so
  the column showed no learning; the stop-54 figures above came from a scratch run). Learning on the text's next
  characters left the LLaMAs above their data-free results. What the short learning learns on, with data (scratch
  script wrapping `symgraph.connectivity.barrier`, `aligns=("full+data",)`; test barrier, 11 points / path loss on the
  4 judged batches):

  | learned on | llama-chars | vit-digits | vit-digits-wide | llama-chars-wide |
  |---|---|---|---|---|
  | the data's other batches | 0.796 / 1.734 | **0.722** / 0.395 | **0.661** / 0.360 | 0.405 / 1.418 |
  | the same inputs, both models' soft targets | 0.772 / 1.711 | 0.725 / 0.463 | | |
  | 256 synthetic examples | **0.716** / 1.639 | 0.986 / 0.494 | not measured / 0.928 | **0.327** / 1.360 |

  The judged batches rank the two learnings as the test barriers do wherever both were measured. Text teaches no soft
  targets (token ids cannot be mixed; images are, and learning distils the endpoints on them:
  `symgraph.learn.mixes_inputs`), so for such data the short learning now runs on both the data's other batches and
  synthetic examples, and the judged batches keep the lower path loss (`path_losses` `learned` and `learned
  (synthetic)`; the output line names the data the kept one learned on); images learn on the data alone (the synthetic
  candidate cost the wide ViT 60 s of inverting images and lost). So `full+data` is no longer above data-free `full`
  on a LLaMA: llama-chars 0.796 -> 0.716, the wide LLaMA 0.405 -> 0.327 (same scratch script). The short learning also
  runs only on models a judge makes examples for (at most 50M parameters, and a forward pass over the judged examples
  writing at most 1e9 tensor elements), with data as without: with data it had no bound, and 50 steps with a backward
  pass cost far more than the alignment past it. The user's whole flow (`examples/sweep_pipeline.py`: fold, align,
  merge and a self-merge of two independently initialised tiny models, each result checked in float64 by an
  independent checker) passed on 105 of 109 types of the sweep's 241 (every third of its list and 28 others, this
  stop's code; `results/sweep_pipeline_recheck.json`); the other 4 do not run at the sweep's shapes and were skipped,
  as before. This stop's rerun of the shipped tables: `full+data` llama-chars 0.716 (was 1.643 with nothing learned),
  vit-digits 0.722 (1.856), bert-topics 0.008 (0.020). Two vit-digits studies moved with stop 55's promise that full
  mode without data ends no farther from A than B began: aligned within a family or a layer only, its short learning
  ended farther (attention only 1.007 against B's 0.896) and is no longer kept, so those merges lost what it gave them
  (attention only 1.813 -> 2.616, layer 0 2.416 -> 3.443). The RegMean merge after full alignment also moved (2.234 ->
  2.291; not traced). The full alignments of every table are unchanged.
- **Held-out twins, a tied-head fault and a longer short learning (stop 57).** Every default of full mode was chosen
  on the shipped and wide pairs. `python examples/study_heldout_pairs.py` trains twins of four other kinds (seeds 11
  and 12; a GPT-2 and a LLaMA of width 96 with tied heads, a Phi, a ViT of width 64 with 4 layers) and measures them
  (`results/heldout_pairs.json`). Before this stop none of them met the 0.35x data-free bar (the GPT-2 0.83x, the ViT
  0.64x), for three reasons, all fixed: path losses read a tied head through its stale alias (group elements write
  `lm_head.weight`, the name the graph reads, and every judge and learning passed the embedding, registered first:
  the GPT-2's aligned end scored 5.1 where it computes 1.7); full mode without data dropped a learned alignment that
  ended farther from A than B began (the ViT's, at 0.689 against 0.677: 1.718 instead of 1.409); and 50 steps were
  too few. The short learning now takes 50-300 steps, as many as 1.2e10 tensor elements written by forward passes
  over batches of the judged examples allow (`symgraph.learn.short_learning_steps`): 300 on the narrow and held-out
  pairs, about 70 on the wide LLaMA, 50 at the judge's bound. Data-free full, test split, 11 points, 50 / 150 / 300
  steps (scratch runs): the held-out ViT 0.52x / 0.38x / 0.24x, the GPT-2 0.57x / 0.47x / 0.44x, llama-chars 0.23x /
  0.18x / 0.17x, vit-digits 0.30x / 0.28x / 0.27x. The held-out twins with this stop's code: the GPT-2 0.44x, the
  LLaMA 0.30x, the Phi 0.20x, the ViT 0.24x (permutation 0.71x-0.98x); the GPT-2's tied head keeps its final
  LayerNorm from folding, and folded after `--untie` it reached 0.31x with 150 steps. The shipped tables above are
  this stop's run (`python examples/paper_experiments.py`, 2792 s, one thread beside other runs): data-free `full`
  llama-chars 0.716 -> 0.520 (0.165x), vit-digits 0.986 -> 0.915 (0.254x), bert-topics 0; `full+data` vit-digits
  0.722 -> 0.150 (0.042x), llama-chars 0.716 -> 0.520 (its synthetic learning kept, as without data). The wide rows
  are earlier runs: the wide LLaMA now learns about 70 steps instead of 50 there, and its row was not rerun. It costs
  time: `BENCH_THREADS=1 python examples/bench_align.py --pair llama-chars --modes full,permutation` (one other run on
  the machine) took 26.9 s against 5.4 s (4.96x; 19.0 s of learning), where stop 56 measured 12.2 s against 5.2 s.
- Stop 58: tied LMs are untied where the tie keeps a norm from folding, by default (`--untie/--no-untie`; the output
  names the weights untied and a written config says `tie_word_embeddings: false`), so `merge` and `barrier` fold
  them too. Held-out tied twins, rerun (`python examples/study_heldout_pairs.py`, `results/heldout_pairs.json`),
  data-free full tied -> untied and folded: the GPT-2 0.901 (0.44x) -> 0.569 (0.28x of its unaligned 2.034 as
  trained; 0.27x of the folded pair's 2.126), the LLaMA of width 96 0.836 (0.30x) -> 0.400 (0.14x); permutation
  mode 1.996 -> 1.931 and 2.012 -> 2.079. All four held-out pairs now meet 0.35x without data. A cheaper short
  learning does not keep it: batches of 16 / 8 sequences instead of 32 (300 steps, scratch runs, one thread each)
  gave llama-chars 0.538 / 0.558 against 0.520 (align 16.8 s / 13.6 s against 22.1 s), the held-out ViT 1.129 /
  0.977 against 0.640, the GPT-2 0.600 (16) against 0.569, vit-digits 0.912 (16) against 0.911; so full mode's time
  stays about 5x permutation mode's on llama-chars.
- Stop 59: is llama-chars' `full+learn` (0.424, 0.135x; bar 0.315) held up by Adam's noisy steps? A scratch run
  polished the default's result (1000 steps) by full-batch L-BFGS (strong Wolfe line search, history 20) on the
  fixed objective: every one of the 43 training batches at t = 1/4, 1/2, 3/4, 6 rounds of 15 iterations with the
  generators absorbed between rounds (`symgraph.learn`'s `_DirectRun` elements, 1992 s on one thread beside two other
  jobs). The objective fell 1.4510 -> 1.4252 and the checked path loss 1.4070 -> 1.3938, and the test barrier (11
  points) 0.424 -> 0.418 (0.133x). Adam ends near a minimum of the objective it descends: the optimiser is not what
  holds the bar up; the objective's minimum on this narrow pair (width 64, 3 layers) is above 0.10x.
"""


def passed(ok: bool) -> str:
    return "met" if ok else "**missed**"


REMEDIES_INTRO = """\
The first version of this report (commit b2f2a26) failed the bar on bert-topics: permutation and full alignment
both had a loss barrier of exactly 0. What was found and changed is below; the tables then show, pair by pair, the
loss barrier of permutation-only and full alignment (mean loss along the path in brackets) with one thing changed
at a time.

- **The BERT pair had overfit.** It was trained for 1200 steps (11 epochs): train loss 0.77, test loss 1.19 and
  1.125. Moving from either end towards the other model *lowered* the test loss, so every aligned path stayed
  under the chord and the barrier was 0 whatever the alignment; on the training split full alignment did beat
  permutation there (0.160 against 0.265, 11 points, all training lines). The pair is now trained for 400 steps
  (symgraph/data/models/README.md), with lower test losses (1.132 and 1.122).
- **Full mode's first pass can start descent in a worse optimum than weight matching.** The first pass solves each
  group from the members no unsolved group still moves, which recovers a reparametrised copy exactly; between
  independent models that evidence can be thin (the post-LN residual permutation sees only embeddings and
  norms). On the retrained BERT pair full alignment ended farther from A than permutation followed by the
  attention rotations (0.590 against 0.580), and its training-split barrier was 0.298 against permutation's
  0.069 (11 points, 800 training lines). Full and permutation modes now also descend, by default, from
  weight matching of the permutations and keep the closer result (`matching_start`, skipped when the first
  pass recovers the source exactly). Permutation mode starts from textbook weight matching run to
  convergence, so it is never farther from A than the `textbook` column; full mode starts from one round of
  it (its descent re-solves every permutation anyway) and skips it once the first start removed 90% of the
  distance. It costs time: on a 4-layer BERT-base pair of random initialisations full mode took 2.15x the paper
  mode's time (README, bench_align.py), against about 1.5x with the first start alone.
- **What the two starts did to the barriers** (the rows without the weight-matching start are the previous
  default). Full mode: bert-topics 0.0104 -> 0.0000 on the test split and 0.298 -> 0.154 on the training split;
  llama-chars and vit-digits keep their first start, unchanged. Permutation mode ends closer to A on bert-topics
  (0.6492 against 0.6523) but its barrier rises there (0.109 -> 0.127 test, 0.069 -> 0.219 train): the closer
  weight match is not the lower barrier. A aligned to B on llama-chars: full mode's weight-matching start ends
  closer but its barrier is higher than the first start's was (2.559 against 2.239 in the previous report),
  and `merge` (which aligns A to B there) scores 3.777 instead of 3.482 after full alignment; on bert-topics
  it scores 1.123 instead of 1.136. The start is chosen by distance, and distance does not rank barriers.

**The 0.35x bar (issue 9, wide round).** Data-free `full` alignment must bring the barrier to 0.35x of the
unaligned one on every pair, never above `permutation`. It does not, on any pair. Loss barriers below were
measured with `symgraph.barrier(A, B, test split, steps=11)` (B aligned to A; 11 points, so the unaligned barriers
differ a little from the 21-point tables; llama-chars-wide at 3 points, the midpoint only, for time), one thing
changed per column:

| pair | none | permutation | full (folded) | full / none | full, unfolded | permutation, unfolded | full, GL heads |
|---|---|---|---|---|---|---|---|
| vit-digits | 3.329 | 4.567 | 3.193 | 0.96x | 3.414 | 4.653 | 3.327 |
| llama-chars | 3.148 | 2.084 | 1.930 | 0.61x | 2.502 | 2.134 | 1.930 |
| vit-digits-wide | 0.862 | 0.872 | 1.069 | 1.24x | 0.826 | 0.869 | not run |
| llama-chars-wide (3 points) | 1.417 | 1.141 | 1.119 | 0.79x | 1.569 | 1.210 | not run |

- **Where the barrier comes from** (`python examples/barrier_sources.py vit-digits --mode full`: the midpoint
  loss with one family of parameters mixed, every other one A's). After full alignment of vit-digits the
  midpoint loss is 3.19 above A's 0.14. Mixing only layer 0's attention raises it by 4.21, more than mixing
  everything; mixing everything *but* layer 0's attention raises it by 1.64; every other family alone adds at most
  0.78 (the embeddings; 5.66 unaligned). Within layer 0 (`--split vit.layers.0`): the key projection alone adds
  2.01, the query 0.60, and leaving only the query projection at A's value cuts the midpoint from 3.33 to 2.04.
  Unaligned, layer 0's attention alone adds 4.26: alignment fixes the embeddings' share of the barrier but none of
  the first attention layer's. A likely reason (not measured): the per-head maps leave each head's bilinear form
  Wq^T Wk unchanged, so two trainings whose first-layer heads attend differently stay different, and their
  average attends like neither.
- **Only some groups aligned** (vit-digits, full, `only=`): attention 3.707, FFN 3.736, residual stream 3.778;
  each alone is *worse* than no alignment (3.329), all together 3.193. The groups only pay off jointly.
- **Folding** (`fold=False` columns) lowers full mode's barrier on vit-digits (3.414 -> 3.193), llama-chars
  (2.502 -> 1.930) and llama-chars-wide (1.569 -> 1.119; unfolded, full mode is above no alignment there) but
  raises it on vit-digits-wide (0.826 -> 1.069), where folded full mode then ends above permutation (0.872).
  `barrier` and `merge` keep folding by default (three foldable pairs of four gain); the wide ViT is the
  exception, and it is undertrained (below).
- **GL(d_head) heads** (`general_linear=True`): no gain (vit-digits 3.193 -> 3.327; llama-chars unchanged at
  1.930).
- **Start choice.** Full mode now decides between its two descent starts (first pass, weight matching) after 2
  rounds of descent (`PROBE_ROUNDS`) and descends only the closer one on; the choice and the results are the same
  as descending both to the end on all three shipped pairs (distances 0.6533, 0.9072, 0.5879), and the second
  start's time (`result.timings["matching_start"]`, wall, loaded machine) fell from 8.5 to 2.8 s on vit-digits,
  7.8 to 2.6 s on llama-chars, 2.8 to 1.9 s on bert-topics. The start is still chosen by distance, and distance
  does not rank barriers (above).
- **The wide pairs are short-trained** (version 1 of them, in the table above; the ViT is now trained longer:
  see the wide pairs' section at the end). On a 2-core machine shared by eight jobs the ViT (600 steps, batch 32)
  reached test accuracy 0.64 / 0.65 (loss 1.05 / 1.03) and the LLaMA (300 steps, batch 16) 1.578 / 1.675 nats per
  character (the shipped narrow LLaMA: 1.33); each took 33-50 minutes of wall time at about 5% of a core. Far from
  converged, the wide ViTs barely moved from their random initialisations: weight matching finds little to match
  (permutation 0.872 against none 0.862), and the barrier is small in absolute terms. They are not yet the regime
  of Theus et al. (converged width-256-512 models), where 0.17-0.36x was reported.
- **Time** (`BENCH_THREADS=1 python examples/bench_align.py --pair vit-digits` and `--pair llama-chars`, one
  process per mode; the machine ran about 20 jobs on 2 cores, so wall times are inflated and noisy). Whole
  alignments (load, fold and analysis, alignment, verification): vit-digits full 104.7 s, permutation 67.4 s, paper
  82.9 s (full 1.55x permutation, 1.26x paper); llama-chars 84.9 s, 116.8 s, 69.9 s (0.73x, 1.21x). Loading and
  analysing dominate those totals. The alignment stages alone are far from the 2x bar: vit-digits full 22.3 s
  (first pass 1.0, descent 19.1 over 34 rounds, second start 2.2) against permutation 1.3 s; llama-chars 4.4 s
  against 1.6 s. In the barrier runs above (alignment seconds, same load) vit-digits-wide took 242.8 s folded and
  94.7 s unfolded in full mode against 24.6 s in permutation mode, llama-chars-wide 52.3 s against 15.3 s. Full
  mode's cost on folded pairs is its descent: each round re-solves every head permutation and QK rotation +
  rescale after the residual rotation has moved them. On a quieter machine (load 8), `--pair llama-chars-wide`:
  totals full 47.9 s, permutation 32.4 s, paper 29.2 s (1.47x, 1.64x), alignment stages 19.6 / 5.1 / 1.0 s;
  `--pair vit-digits-wide`: totals 93.5 / 13.1 / 23.3 s (7.1x, 4.0x), alignment stages 69.2 s (descent 56.8) /
  2.0 / 0.9 s; full mode's peak RSS 586 and 835 MB.
  BERT-base size (`--pair bert-base --layers 4 --kinds independent`: two random initialisations, 4 layers):
  full 321.2 s against paper 133.4 s, 2.41x under this load (2.15x before, on a quieter machine); peak RSS
  2216 MB against 2062 MB. Full mode's second start is 132.6 s of it (a round of weight matching, with a
  3072-unit Hungarian per FFN, then a first pass of the other groups), its descent only 10.1 s: deciding the
  start after 2 rounds saves descent rounds, which BERT-base hardly has, so the bar is still missed there.

**Data-free round 2 (issue 9: never above permutation, 0.35x, BERT-base time).** Loss barriers on the test split,
11 points (llama-chars-wide 5), B aligned to A, folded as `barrier` folds unless a row says otherwise; each row
changes one thing in full mode (`symgraph barrier A B --data DATA --align none,permutation,full --steps 11
[--balance-costs]`; vit-digits with `--balance-costs` re-run so: 2.416):

| full mode, remedy | vit-digits | llama-chars | vit-digits-wide | llama-chars-wide |
|---|---|---|---|---|
| none (no alignment) | 3.329 | 3.148 | 0.862 | 1.417 |
| permutation | 4.567 | 2.084 | 0.872 | 1.141 |
| full (default) | 3.193 (0.96x) | 1.930 (0.61x) | 1.069 (1.24x) | 1.119 (0.79x) |
| per-tensor relative costs (scratch hook, not kept) | 2.542 (0.76x) | 1.727 (0.55x) | 1.674 (1.94x) | 1.023 (0.72x) |
| `--balance-costs` (costs in RMS units) | 2.416 (0.73x) | 1.904 (0.60x) | 1.125 (1.30x) | 1.114 (0.79x) |
| `--balance-costs`, unfolded | 3.939 | not run | 1.553 | not run |

- **Costs that weigh tensors by their size, not their scale** (`balance`): the folded weights differ in scale by
  orders of magnitude between tensors (a folded norm weight multiplies a whole matrix), and the plain cost is
  dominated by the largest. Measuring each tensor in units of its own RMS lowers full mode's barrier on three
  folded pairs of four (vit-digits 3.19 -> 2.42, the largest single gain of any data-free remedy so far) but raises
  it on vit-digits-wide (1.07 -> 1.12), on unfolded models (vit-digits 3.41 -> 3.94; bert-topics 0.000 -> 0.008,
  permutation 0.127; their norm-scale groups let the balanced cost trade scale between tensors) and it leaves
  vit-digits-wide above permutation. It is an option, not the default. Costs relative to each tensor's norm
  (every tensor counting equally) go further on three pairs (vit-digits 2.54, llama-chars 1.73, llama-chars-wide
  1.02) but badly up on vit-digits-wide (1.67).
- **Choosing between candidates without data.** The per-tensor relative distance (the cost of the previous row)
  ranks the barriers of {permutation, full, full per-tensor} in the right order on vit-digits, llama-chars and
  llama-chars-wide, and in reverse order on vit-digits-wide (it prefers the per-tensor solution, barrier 1.67,
  over permutation, 0.87). The KL divergence between the midpoint model and the endpoints on random probe inputs
  (`symgraph.inputs.example_inputs`, 32 examples) ranks vit-digits-wide right but puts full last on vit-digits
  and permutation below none on llama-chars. Plain distance puts full closer than permutation on every pair
  (full's descent lowers it from the permutation start). No data-free criterion measured here would pick permutation on
  vit-digits-wide while keeping full elsewhere, so "never above permutation" still fails there (1.069 against
  0.872): the pair is undertrained (above) and its unfolded full alignment (0.826) is the only one below none.
- **BERT-base time.** Full mode's second start re-solved every group in its first descent round, although the
  weight-matching round had just solved them: a fresh aligner knew nothing of those solves. It now hands over the
  groups whose parameters nothing moved since their last solve (`Aligner.fresh`, `mark_solved`), so the 3072-unit
  FFN Hungarians are not repeated; distances and the start chosen are unchanged (1.18852 on the pair below, and
  on the shipped pairs). Measured in one process (`/tmp` scratch profile, 1 thread, load about 15): the second
  start's descent 74.9 s -> 5.5 s, the second start 158.8 s -> 59.7 s. `BENCH_THREADS=1 python
  examples/bench_align.py --pair bert-base --layers 4 --kinds independent --modes full,paper`
  (`results/bench_align_bert_base_4layers.json`, load about 15 on 2 cores): full 144.5 s against paper 88.5 s,
  1.63x (2.41x in the previous report); full's alignment stages are first pass 44.3 s, descent 4.1 s, second start
  50.2 s (one round of weight matching, 4 FFN Hungarians of 3072 units, is most of it); peak RSS 2503 against
  2208 MB. Ordering that round coarse-first (residual stream, heads, FFN) would leave every FFN solve standing on
  every architecture, but moved bert-topics slightly (distance 0.58788 -> 0.58802, barrier 0.000 -> 0.002), so the
  textbook random order stays.

Rows: without the weight-matching start (the first pass alone, the previous default); a longer coordinate descent
(the default stops once a round gains less than 1e-4); no QK / rotary rescaling; the other direction of alignment
(A aligned to B); GL(d_head) maps on QK and VO instead of rotations; both models left unfolded (pairs that cannot
be folded repeat their default); the training split instead of the test split (as many examples as the test split
has). Permutation mode ignores the rescaling and the GL maps, so those rows repeat its default barrier.
"""


DATAFREE_ROUND3 = """\
**Data-free round 3 (issue 9: never above permutation).** Full mode now aligns a folded LayerNorm residual stream
({Q : Q 1 = +-1}) by its permutations between independent models and keeps the orthogonal group for RMSNorm
streams and for reparametrised copies (`--residual-group auto`, the default; `orthogonal` and `permutation` force
one; `symgraph.alignment.residual_group`). Loss barriers on the test split, B aligned to A, folded, 11 points
(llama-chars-wide: 5 points on the first 64 test lines, and 3 points on all 349), one change per row (scratch
harness calling `align_states` with the groups named; the new default's rows re-measured through `symgraph barrier
A B --data digits --align full --steps 11`: vit-digits-wide 0.8197, vit-digits 3.262):

| full mode, variant | vit-digits | llama-chars | vit-digits-wide | llama-chars-wide (64 / 349 lines) |
|---|---|---|---|---|
| none (no alignment) | 3.329 | 3.148 | 0.943 | 1.482 / 1.417 |
| permutation | 4.567 | 2.084 | 0.941 | 1.176 / 1.141 |
| full, orthogonal residual (previous default) | 3.193 | 1.930 | 1.862 | 1.223 / 1.119 |
| **full, residual by permutations (new default for LayerNorm)** | **3.262 (0.98x)** | 2.177 | **0.820 (0.87x)** | 1.260 / 1.169 |
| permutations + orthogonal residual, no in-head maps | not run | not run | 1.239 | 1.407 / not run |
| orthogonal residual, no QK rescale | not run | not run | 1.896 | not run |
| new default, GL(d_head) heads (`--general-linear`) | 3.275 | (1.930, round 2) | 0.826 | not run |
| new default, up to 100 rounds until nothing changes | 3.262 (1 round) | not run | 0.820 (3 rounds) | not run |
| orthogonal residual, costs balanced per layer (each layer's tensors count equally) | not run | not run | 1.212 | not run |
| orthogonal residual, descent from the weight-matching start only | not run | not run | not run | 1.298 / not run |
| `--balance-costs` with the new default | 2.922 | (1.904, round 2) | 0.888 | 1.204 / 1.114 |
| unfolded: permutation, full | 4.653, 3.414 | 2.134, 2.510 | 1.010, 1.096 | not run |

- **Why full lost on vit-digits-wide: the orthogonal residual map.** Keeping the heads' rotations and the QK
  rescale but aligning the stream by permutations takes the barrier from 1.862 to 0.820, below permutation mode
  (0.941) and no alignment (0.943); the residual rotation with permutations elsewhere (no in-head maps) gives
  1.239. Mixing one family of parameters at the midpoint (every other one A's; A's loss 0.795) locates the damage:
  after permutation mode the embeddings alone give 1.174 and layer 0's attention 1.280, after full mode 2.175 and
  1.951 (the whole midpoint 1.744 against 2.664). The rotation is fitted by the layers' large matrices and moves
  B's embeddings towards A's (cosine of the patch projection 0.39 against about 0 after permutation mode), yet
  their average is worse for A's first layer than an unrelated one: a likely reading (not proven) is that a map
  that aligns the stream only partly puts B's mismatch into the directions A's layers read, where a permutation
  leaves it spread over directions they mostly ignore. The same narrowing costs a little on vit-digits (3.193 ->
  3.262, still far below permutation's 4.567) and clearly on both LLaMA pairs (llama-chars 1.930 -> 2.177,
  llama-chars-wide 1.119 -> 1.169 on all lines), so RMSNorm streams keep the orthogonal group: the choice follows
  the norm family, as measured here, and the issue's held-out pre-LN ViT pointed the same way (folding made
  permutation matching worse there). A reparametrised copy still comes back exactly: `auto` first runs the first
  pass in the whole group and keeps it when that pass removes 90% of the distance.
- **Time.** `BENCH_THREADS=1 python examples/bench_align.py --pair vit-digits-wide --modes
  full,permutation,paper` (load about 12 on 2 cores): totals full 61.5 s, permutation 62.7 s, paper 43.9 s
  (loading and analysis dominate); full's alignment stages 24.2 s (the group choice's first pass 7.3, first pass
  3.9, descent 4.9, second start 8.1) against permutation's 8.5 s, where the orthogonal residual took 69.2 s
  against 2.0 s (round 2); peak RSS 660 against 588 MB. Post-LN and RMSNorm models never run the group choice
  (no LayerNorm-constrained orthogonal stream), so BERT-base's time is unchanged.
- **llama-chars-wide is not above permutation on its whole test split.** The wide table measures it on the
  first 64 test lines for time, where full (1.223) is above permutation (1.176); on all 349 lines (3 points, the
  midpoint) full is below (1.119 against 1.141), as the earlier round found (1.119 against 1.141). The 64-line
  figure is within the noise of the subset. Descending only from the weight-matching start makes it worse (1.298),
  so the start choice by distance is right there.
- **Data-free criteria that would pick permutation on vit-digits-wide: none found.** Every weight-space measure
  tried ranks full's orthogonal solution closer than permutation mode's on vit-digits-wide (where it has twice
  the barrier): the plain distance (0.742 against 0.908), the mean per-layer relative distance (0.722 against
  0.885), the distance between the per-head QK and OV circuits W_q^T W_k and W_o W_v (invariant to the in-head
  maps; 1.497 against 1.716 for QK) and their interpolation defect at the midpoint (0.245 against 0.425), and
  the distance between every residual reader-writer product R W (the composition the next layer sees; 1.394
  against 1.542, defect 0.280 against 0.405). A significance test, full's distance gain over permutation mode
  against the gain the same alignment reaches towards A with each tensor's entries shuffled, does not separate
  the pairs either (vit-digits 1.39, llama-chars 1.65, bert-topics 1.62, llama-chars-wide 1.66). The group
  choice above is therefore a rule by norm family from measured barriers, not a criterion.
- **The 0.35x bar is still missed** on every pair but bert-topics (full / none: vit-digits 0.98x, llama-chars
  0.61x, vit-digits-wide 0.87x, llama-chars-wide 0.79x on all lines). `--balance-costs` with the new default
  lowers three folded pairs of four (vit-digits 3.262 -> 2.922, 0.88x; llama-chars 1.930 -> 1.904;
  llama-chars-wide 1.119 -> 1.114 on all lines) and stays below permutation on all four, but raises
  vit-digits-wide (0.820 -> 0.888) and unfolded bert-topics (0.000 -> 0.008, round 2); it stays an option. With
  the orthogonal residual it gave vit-digits 2.416 (0.73x, round 2), the lowest data-free figure there.
  Between these pairs the weight-space optimum is not a low-barrier one: QK circuits of A and B' differ by more
  than their own size on vit-digits-wide even after full alignment (relative distance 1.50).
- **The wide ViT merge bar is still missed.** The midpoint of the new full path (B aligned to A, the simple
  average) scores 1.540 on vit-digits-wide, 1.92x the mean endpoint loss 0.803 (bar 1.20x; permutation mode's
  midpoint 1.744, 2.17x).
"""


LEARNED_REMEDIES = """\
**The 0.10x bar with data (issue 9, learned-matching round).** Learned matching (`full+learn`) must bring the
barrier to 0.10x of the unaligned one. The previous method, Git Re-Basin's straight-through estimator (a proxy
state projected onto the orbit by the weight solvers, trained at the midpoint), plateaued: 600 steps on
vit-digits gave 0.603 against 0.619 at 300. Two causes were found. (1) **Training at t = 1/2 only lowers the
midpoint** (measured): with the direct method at the midpoint (lr 0.003, 300 steps) the test loss at t = 0.5 fell
to 0.26 while t = 0.6 and 0.7 stayed at 0.51 and 0.78, so the barrier moved off the midpoint instead of
shrinking, and 300 steps ended worse than 100 (0.637 against 0.536); a uniform random t per step, and choosing
the candidate by its loss at t = 1/4, 1/2, 3/4 (the midpoint rows below were still chosen at t = 1/2 alone),
fixed that. (2) **The estimator moves a proxy, not the orbit**: the projection snaps the proxy back to the orbit
each step; at the old settings the direct method did no better (0.637 against 0.619), so this alone is not what
held the barrier up; at the new settings (random t, lr 0.01) the estimator got worse (0.714) and the direct
method reached 0.318, and it is several times faster per step (no solver runs: vit-digits 300 steps in 201 s
against 81 s, llama-chars 1140 s against 527 s, loaded machine). The new default (`--learn-method direct`,
`symgraph/continuous.py`) optimises the continuous group elements themselves (exponentials of skew / general
matrices, rotary angles and scales, log-scales), applied exactly to the start at every step; QK and VO maps are
learned in their full group GL(d_head). Permutations stay at the start's. Loss barriers (test split, 11 points,
B aligned to A, folded; `python examples/bench_learn.py --aligns full+learn` with the options named, e.g.
`--method ste --t midpoint --lr 0.003`; none: vit-digits 3.329, llama-chars 3.148), one change per row:

| learned matching | vit-digits | llama-chars |
|---|---|---|
| ste, midpoint, lr 0.003, 300 steps (previous default) | 0.619 (0.19x) | 1.086 (0.34x) |
| ste, 600 steps | 0.603 (0.18x) | not run |
| ste, random t, lr 0.01 (the new default's settings) | 0.714 (0.21x) | not run |
| direct, midpoint, lr 0.003, 100 steps | 0.536 (0.16x) | not run |
| direct, midpoint, lr 0.003, 300 steps | 0.637 | not run |
| direct, midpoint, lr 0.01 | 0.597 | not run |
| direct, random t, lr 0.003 | 0.383 | not run |
| **direct, random t, lr 0.01, 300 steps, GL heads (new default)** | **0.318 (0.096x)** | **0.565 (0.18x)** |
| default, QK/VO kept orthogonal (`general_linear=False`) | 0.338 | not run |
| default, lr 0.03 | not run | 0.604 |
| default, batch 64 | 0.214 (0.064x) | 0.558 (0.18x) |
| default, 600 steps | 0.122 (0.037x) | 0.509 (0.16x) |
| default, from the activation-matched start (`full+data+learn`) | 0.259 (0.078x) | 0.595 (0.19x) |
| 3 rounds of steps/3, permutations re-matched on weights between rounds | 0.082 (600 steps) | 0.700 (300 steps) |
| 3 rounds of steps/3, restarts only (no re-matching) | 0.073 (600 steps) | 0.597 (300 steps) |

The round rows come from `python examples/learn_rounds.py PAIR 3 STEPS [--restarts-only]`, which starts from
`align_states(groups, B, A, mode="full")` without leaving the functionally free key bias out of the costs
(vit-digits start 3.706 instead of 3.193). bert-topics with the
default: none 0.210, full 0.000, full+learn 0.007 (0.035x; learned on the training split, measured on the test
split, where full alignment already reaches 0). Learning time with the default then (300 steps): vit-digits about
40 s, llama-chars about 170 s, bert-topics about 190 s (wall, loaded machine; the STE took 490, 1140 and 910 s).

**Correction (next round):** the rows above marked as the direct method's default were, through `barrier`, learned from
the *activation-matched* start: `barrier --align full+learn` passed its learning data to `align` as `data`, which
also switches on activation costs. `full+learn` now learns from the weight-matched start (`full+data+learn` from
the activation-matched one); the main table above is measured that way (vit-digits 0.176, llama-chars 0.597,
bert-topics 0.000 at 11 points in `examples/results/learn.json`, `start_of_full_learn`). `align --learn --learn-data
SPEC` learns on SPEC from the weight-matched start. Tried on llama-chars in that round and removed: permutations
learned by the straight-through estimator alternated with the direct method (every permutation move raised the
barrier: 0.92-1.02 against 0.597), 3 values of t per step (0.649), the residual rotation's learning rate x3 or
x0.3 (0.639, 0.645), the permutation-mode start (0.822); the training-split barrier is 0.95, so it is not
overfitting.

What holds llama-chars at 0.16-0.19x: more steps, larger batches and restarts each help a little and then
flatten, while re-matching its permutations on weights between rounds *raises* the barrier (1.93 -> 0.74 after
the first round, 1.21 after re-matching, 0.70 at the end): the learned continuous elements and the weight-matched
FFN and head permutations disagree. The direct method cannot move a permutation; the llama's SwiGLU FFN (176 units
a layer) and its 2 KV heads keep the start's matching. Learning permutations by the loss (Sinkhorn relaxations,
or the estimator for permutations only, alternating with the direct method) is the next step; not tried here.

**Learned matching at every width (next round).** Adam moves each entry of a generator by about the learning rate,
so one rate turns an n x n map by about lr * sqrt(n): right at width 48-64, too much at 256 (the wide ViT never beat
its start at lr 0.01). The direct method now steps a generator of side n by lr * sqrt(64 / n) per entry (vector
parameters by lr; `LearnOptions.width_aware`), and a check no better than the best so far sends it back to the
best point at 0.3x the rate, with fresh Adam moments (`LearnOptions.backtracks`, 4 at most; a non-finite step
backtracks too instead of stopping at once). Both defaults in one run (`python examples/bench_learn.py --pairs
vit-digits,llama-chars --baseline`; `--pairs vit-digits-wide --wide-steps 80 --baseline`;
`examples/results/bench_learn.json`; test split, 11 points): vit-digits 0.233 -> 0.218, llama-chars 0.597 -> 0.576,
vit-digits-wide 0.820 (not kept) -> 0.518 in 80 steps; the time per step is unchanged (0.050 s on vit-digits,
back to back). The learned head maps are less well conditioned on the shipped pairs (largest condition number
8.96 against 4.27 on vit-digits), still under 10. The main tables above use the new default.

**Learned GL maps bounded (issue 9).** Learned QK/VO maps are projected back to condition <= 100 after each step
(`LearnOptions.max_condition`, `--learn-max-condition`; the data-free solver's constant). Measured with
`examples/bench_learn.py` (one thread, load 1.8-4.5 on the shared 2-core machine; every command and load in
`examples/results/learn_condition.json`), test split, 11 points, 2400 steps, patience 0:
vit-digits (unaligned 3.329) barrier 0.0577 with the bound (largest condition 74.9, 1167 projections over
24 maps x 2400 steps, 110 s of learning) against 0.0578 without it (condition 435, 105 s), same run. Tighter bounds,
seed 0: 30 -> 0.0263, 10 -> 0.0247, 3 -> 0.0241; but with seed 1 bound 10 gave 0.0170 and no bound 0.0065
(condition 53, so 100 would not have acted): the differences between bounds are within the seed-to-seed spread,
and the bound neither raises nor lowers the barrier measurably. llama-chars (600 steps, no cap): learned maps stay
under 10 unbounded (7.8), so the default never acts; even a bound of 3 (2162 projections) gives 0.554 against
0.551. Under a 150 s cap (same first run) llama-chars 0.483 bounded (832 steps) and 0.500 unbounded (601 steps):
the step count differs with load, not the bound (no projection). A soft penalty was not added: the hard bound
costs nothing measurable. Unbounded, a learning rate of 1.0 made a map singular in float32 and learning crashed
with a LinAlgError; with the bound the same run ends normally (not kept).

**Alignment on data chooses by the data (next round).** `full+data` kept the activation-matched alignment always,
though weight costs gave the lower barrier on bert-topics and vit-digits-wide (1.063 against 0.820 there). With
data, `align` now computes both and keeps the one whose interpolated model has the lower loss at t = 1/4, 1/2, 3/4
on its training batches (`symgraph.api.lowest_path_loss`; `result.path_losses`, and the `align` summary, say
which). On the wide ViT that picks the weight-matched one (0.820); on bert-topics the training batches still prefer
the activation-matched one (test barrier 0.020 against full's 0.000: both tiny, and the choice is made on training
data, not on the test split).

**Learned matching: steps, cheaper steps, stopping (issue 9, this round; hand-written).** The barrier keeps falling
with steps (`python examples/bench_learn.py --pairs PAIR --steps N --aligns none,full+learn`; test split, 11 points,
one thread, the machine shared): vit-digits 300 steps 0.218 (0.065x of unaligned), 1200 steps 0.042 (0.013x, 706 s
of learning), 2400 steps 0.009 (0.003x, 2200 s); llama-chars 1200 steps 0.486 (0.154x, 3690 s, under heavy load).
Learning is limited by steps, and at width 64 a step is mostly the model's forward and backward passes: timed by
parts (40 steps, main and this branch alternating three times, load 2.5-3), a vit-digits step took 57-72 ms on
main and 43-50 ms here, a llama-chars step 205-272 ms on both, 90% of it the model's passes.
- *Cheaper steps.* Matrix elements are now evaluated as B(I + X) at X = 0 on a float64 base B that absorbs every
  step (B <- B exp(X)): the same value and gradient as B exp(X) there (tested against autograd through the
  exponential), with no backward pass through `matrix_exp`; `apply` moves a contiguous member as a slice and inverts
  each element's matrices once per call. Learning seconds, main (f501516) over this branch (`python examples/bench_learn_step.py
  --base MAIN --pairs vit-digits,llama-chars --steps 60 --rounds 3` and `--pairs
  untrained:vit-wide,untrained:llama-wide --steps 12 --checks 2 --rounds 2`: alternating fresh processes, one
  thread, load about 3 on the shared 2-core machine; `examples/results/bench_learn_step.json`): vit-digits 0.81x
  (4.8 s against 5.9 s here, one run of 7.6 s among them), llama-chars 1.03x, an untrained ViT of the wide
  architecture (width 256, 6 layers) 1.43x (14.3 s against 10.0 s for 12 steps), the untrained wide LLaMA 0.93x
  (36.5 s against 39.4 s; timed by parts its step is 1.55-2.2 s on main and 1.56-1.75 s here, 90% the model's
  passes). So the shipped pairs learn no faster: their steps are the model's forward and backward passes. Barriers
  after the same 60 steps agree within noise (`bench_learn.py --steps 60`: vit-digits 0.835 on main, 0.840 here;
  llama-chars 0.839, 0.831); after the then-default 300 steps (`bench_learn.py --steps 300 --aligns none,full+learn`,
  main then this branch, load 1.5-3.4) vit-digits 0.218 on main, 0.159 here (22.5 s and 19.4 s of learning),
  llama-chars 0.576 and 0.570 (89 s and 156 s: a test run shared the machine with the second).
- *Stopping.* `--learn-patience` (3) / `--learn-tolerance` (0) / `--learn-seconds` (`LearnOptions.patience`,
  `tolerance`, `seconds`) end learning when the checks stop finding lower path losses or at a time cap (the cosine
  schedule then anneals over the steps that fit). Replayed on the check sequences of the 300-2400-step runs above,
  patience 3 at tolerance 0 stops none of them early, and tolerance 0.01 stops them at 80-90% of the steps with the
  path loss up to 5% higher (vit-digits 1200 steps: 0.0934 against 0.0886): with a cosine schedule the checks keep
  improving to the end, so the default step count is unchanged (a longer default is 4-7x the time on llama-chars).
  The time cap is the way to more steps: `symgraph barrier A B --data DATA --steps 11 --align none,full+learn
  --learn-steps 2400 --learn-seconds 150 --learn-patience 0` (one thread, load about 2 on the shared 2-core
  machine; `examples/results/learn_time_cap.json`) learned vit-digits for 2244 steps: barrier 0.047 (0.014x of
  3.329; 173 s wall for the whole command), and llama-chars for 539 steps: 0.509 (0.162x of 3.148; 195 s). The
  0.10x bar is met on vit-digits within three minutes, still not on llama-chars. A cap is not the default: the
  steps it allows, and so the result, depend on the machine.
- *Alternation* (learn 200 steps, re-match the permutations of the learned B' to A on activations, keep the
  re-match only if the checked path loss falls, 3 rounds; vit-digits): every re-match raised the path loss (0.254 ->
  0.413, barrier 0.388 -> 0.598) and was rejected; the three restarted rounds end at 0.307, above 600 steps in one
  run (0.122). Not kept.
"""


# -- entry point -----------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="report path (default: examples/RESULTS.md, or "
                                                 "out/paper-quick/RESULTS.md with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny data, 3 path points")
    parser.add_argument("--pairs", default=",".join(SHIPPED_PAIRS),
                        help=f"comma-separated pairs: shipped ({', '.join(SHIPPED_PAIRS)}) or wide "
                             f"({', '.join(WIDE_PAIRS)})")
    parser.add_argument("--wide", action="store_true", help="add the wide pairs to --pairs")
    parser.add_argument("--models", type=Path, help="folder holding the shipped pairs (default: the shipped models)")
    parser.add_argument("--wide-models", type=Path,
                        help=f"folder caching the wide pairs, trained there when missing (default {WIDE_CACHE})")
    args = parser.parse_args(argv)
    args.out = args.out or Path("out/paper-quick/RESULTS.md" if args.quick else "examples/RESULTS.md")
    args.pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    args.pairs += [p for p in WIDE_PAIRS if args.wide and p not in args.pairs]
    unknown = [p for p in args.pairs if p not in PAIRS]
    if unknown:
        parser.error(f"unknown pair(s) {', '.join(unknown)}; choose from {', '.join(PAIRS)}")
    return args


def main(argv=None) -> None:
    torch.set_num_threads(1)  # deterministic, and fair to whatever else shares the machine
    torch.manual_seed(0)
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    figures = args.out.parent / "results"
    figures.mkdir(parents=True, exist_ok=True)
    command = "python examples/paper_experiments.py" + (" --quick" if args.quick else "") + (
        f" --pairs {','.join(args.pairs)}" if args.pairs != list(SHIPPED_PAIRS) else "")
    shipped, wide = [p for p in args.pairs if p not in WIDE_PAIRS], [p for p in args.pairs if p in WIDE_PAIRS]
    if shipped:
        start = time.perf_counter()
        results = {name: run_pair(name, settings, args.models, figures) for name in shipped}
        write_json(figures / "results.json", {"command": command, "environment": environment(),
                                              "settings": asdict(settings),
                                              "seconds": time.perf_counter() - start, "pairs": results})
    for name in wide:  # each pair's entry in wide.json replaced as soon as it is done
        result = {"command": command, **run_wide_pair(name, QUICK if args.quick else WIDE[name], figures,
                                                      args.wide_models)}
        file = figures / "wide.json"
        earlier = json.loads(file.read_text())["pairs"] if file.is_file() else {}
        write_json(file, {"pairs": {**earlier, name: result}})
    write_report(args.out, figures)


def write_json(path: Path, content: dict) -> None:
    write_text_atomic(path, json.dumps(content, indent=1))
    log(f"wrote {path}")


def write_report(out: Path, figures: Path) -> None:
    """The report from the JSON beside it: the shipped pairs' ``results.json`` and, when there, ``wide.json`` (so a
    run of the wide pairs alone adds their section to the last run of the shipped ones). Without ``results.json``
    the wide section goes alone into ``wide.md`` there."""
    wide = json.loads((figures / "wide.json").read_text()) if (figures / "wide.json").is_file() else None
    if not (figures / "results.json").is_file():
        write_text_atomic(figures / "wide.md", section_wide(wide) + "\n")
        log(f"no {figures / 'results.json'} to report on: wrote the wide pairs' section to {figures / 'wide.md'}")
        return
    shipped = json.loads((figures / "results.json").read_text())
    command = shipped.get("command", "python examples/paper_experiments.py")  # written before the key existed
    write_text_atomic(out, render(shipped["pairs"], Settings(**shipped["settings"]), command, shipped["seconds"], wide,
                          shipped.get("environment")))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
