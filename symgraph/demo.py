"""``symgraph demo``: the main job on the shipped model pairs, end to end.

Each shipped pair (symgraph/data/models: one model trained twice, ``-a`` seed 0 and ``-b`` seed 1) goes through
the whole pipeline: the symmetry report (JSON, Markdown, HTML); B aligned to A in every mode (``permutation``,
``paper``, ``full``) with per-group statistics, and the ``full`` result written as a Hugging Face folder; A and B
merged after ``full`` alignment (simple, Fisher, RegMean); the loss barrier along the linear path for every
mode, plotted. A summary of the numbers is printed, and written as ``summary.json``.

The embedded pair in symgraph/data/demo (two tiny random LLaMAs, :func:`demo_models`) stays as a fast fixture
for tests and examples.
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .errors import OutputError
from .module_state import copied_module

__all__ = ["SHIPPED_PAIRS", "demo_models", "run_demo", "shipped_pair"]

#: Shipped pairs and the dataset each was trained on (its test split scores them).
SHIPPED_PAIRS = {"llama-chars": "pydoc-chars", "vit-digits": "digits", "bert-topics": "pydoc-topics"}
BARRIER_MODES = ("none", "permutation", "paper", "full")


@dataclass(frozen=True)
class DemoPlan:
    """How much of the job to run: which pairs, how much data, how many points on the path."""

    pairs: tuple[str, ...]
    methods: tuple[str, ...]
    steps: int
    test_limit: int | None  # None: the whole test split
    stats_limit: int  # train examples for Fisher / RegMean statistics


FULL_PLAN = DemoPlan(tuple(SHIPPED_PAIRS), ("simple", "fisher", "regmean"), steps=11, test_limit=None,
                     stats_limit=256)
QUICK_PLAN = DemoPlan(("llama-chars",), ("simple",), steps=3, test_limit=8, stats_limit=8)


def demo_models() -> dict[str, Path]:
    """The embedded pair of tiny random LLaMAs: name -> Hugging Face folder.

    Examples
    --------
    >>> sorted(demo_models())
    ['llama-a', 'llama-b']
    """
    root = Path(str(resources.files("symgraph.data").joinpath("demo")))
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").exists()}


def shipped_pair(name: str, root: Path | None = None) -> tuple[Path, Path]:
    """The folders of shipped pair ``name`` (a key of :data:`SHIPPED_PAIRS`): model A, then model B.

    ``root`` replaces the shipped models folder (a retrained copy laid out the same way).

    Examples
    --------
    >>> [p.name for p in shipped_pair("vit-digits")]
    ['vit-digits-a', 'vit-digits-b']
    """
    if name not in SHIPPED_PAIRS:
        raise KeyError(f"no shipped pair {name!r}; choose from {', '.join(SHIPPED_PAIRS)}")
    base = Path(root) if root is not None else Path(str(resources.files("symgraph.data").joinpath("models")))
    return base / f"{name}-a", base / f"{name}-b"


def run_demo(out_dir, *, quick: bool = False, overwrite: bool = False,
             echo: Callable[[str], None] = print) -> dict:
    """Run the main job on the shipped pairs (``quick``: the LLaMA pair only, tiny data); write everything
    under ``out_dir`` and return the summary (also written as ``out_dir/summary.json``). Each step is announced
    through ``echo`` as it starts.

    Raises :class:`~symgraph.errors.OutputError` before any work when ``out_dir`` cannot be written, or holds
    files already and ``overwrite`` is false (with it, the demo's own files there are replaced). Runs on one
    torch thread (restored afterwards).

    Examples
    --------
    Not run as a doctest: tests/test_demo.py runs this quick demo once for all its checks (one to two minutes).

    >>> import tempfile
    >>> summary = run_demo(Path(tempfile.mkdtemp()) / "demo", quick=True, echo=lambda line: None)  # doctest: +SKIP
    >>> barrier = summary["llama-chars"]["barrier"]  # doctest: +SKIP
    >>> barrier["full"]["distance"] < barrier["none"]["distance"]  # doctest: +SKIP
    True
    """
    from .io import write_text_atomic

    out_dir = _writable_folder(out_dir, overwrite)
    plan = QUICK_PLAN if quick else FULL_PLAN
    echo(f"symgraph demo: {len(plan.pairs)} shipped pair(s) ({', '.join(plan.pairs)}) into {out_dir}/"
         + ("" if quick else f" (about {len(plan.pairs)} x 2-6 minutes on one CPU thread)"))
    with _one_thread():
        summary = {name: _run_pair(name, out_dir / name, plan, echo) for name in plan.pairs}
    write_text_atomic(out_dir / "summary.json", json.dumps(summary, indent=1))
    echo(f"everything is in {out_dir}/ (numbers: {out_dir / 'summary.json'})")
    return summary


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Models this small gain nothing from intra-op threads, and on a busy machine their spinning costs several
    times the run (measured: 65 s on one thread, 259 s on two, with the 2 cores shared)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _writable_folder(path, overwrite: bool) -> Path:
    """Create ``path`` if needed and prove it writable with a probe file, before any work is done."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"Cannot write the demo into '{path}': it is a file, not a folder.",
                          hint="pass --out a folder path (it is created if missing).")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputError(f"The demo's output folder '{path}' already holds files (an earlier run?).",
                          hint="pass --overwrite to replace the demo's files there, or choose another --out.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise OutputError(f"Cannot write the demo into '{path}': {exc.strerror or exc}.",
                          hint="pass --out a folder you can write to.") from exc
    return path


# -- one pair --------------------------------------------------------------------------------------------------------
def _run_pair(name: str, folder: Path, plan: DemoPlan, echo) -> dict:
    from .api import load
    from .datasets import load_data

    folder.mkdir(exist_ok=True)
    path_a, path_b = shipped_pair(name)
    echo(f"{name}: capturing both models and reading the data ({SHIPPED_PAIRS[name]})")
    a, b = load(path_a), load(path_b)
    data = SHIPPED_PAIRS[name]
    test = load_data(data, model=a, split="test", limit=plan.test_limit)
    train = load_data(data, model=a, split="train", limit=plan.stats_limit)
    echo(f"{name}: symmetry report ({len(a.report.groups)} groups)")
    files = {"reports": _write_reports(a, folder)}
    echo(f"{name}: aligning B onto A in every mode")
    alignments, files["alignment stats"], files["aligned B (full)"] = _align_all(a, b, folder)
    echo(f"{name}: merging after full alignment ({', '.join(plan.methods)})")
    merges, files["merged"] = _merge_all(a, b, train, test, plan.methods, folder)
    echo(f"{name}: loss barrier, {plan.steps} points per mode ({', '.join(BARRIER_MODES)})")
    curves, files["barrier plot"] = _barrier(a, b, test, plan.steps, folder)
    summary = {"data": data, "test_examples": len(test), "groups": _group_counts(a),
               "endpoints": {"A": _metrics(a, a.state_dict(), test), "B": _metrics(a, b.state_dict(), test)},
               "alignments": alignments, "merged_after_full_alignment": merges, "barrier": curves,
               "files": {k: str(v) for k, v in files.items()}}
    _echo_pair(name, summary, echo)
    return summary


def _write_reports(subject, folder: Path) -> str:
    """The symmetry report of model A (B has the same architecture, hence the same groups)."""
    from .io import write_text_atomic
    from .render import render

    for fmt in ("json", "md", "html"):
        write_text_atomic(folder / f"report.{fmt}", render(subject.report, fmt))
    return _variants(folder, "report.", ("json", "md", "html"))


def _align_all(a, b, folder: Path) -> tuple[dict, str, Path]:
    """B aligned to A in every mode: per-mode statistics as JSON; the ``full`` result as a model folder."""
    from .alignment import MODES
    from .api import align
    from .io import save_model, write_text_atomic

    out = {}
    for mode in MODES:
        result = align(b, a, mode=mode)
        write_text_atomic(folder / f"align-{mode}.json", json.dumps(result.to_json(), indent=1))
        out[mode] = {"groups_aligned": len(result.group_distances()), "verified_error": result.verified_error,
                     "seconds": sum(result.timings.values())}
        if mode == "full":
            save_model(result.state, folder / "aligned-full", config=b.config, like=b.path, overwrite=True)
    return out, _variants(folder, "align-", MODES, ".json"), folder / "aligned-full"


def _merge_all(a, b, train, test, methods, folder: Path) -> tuple[dict, str]:
    """A and B merged with each method after ``full`` alignment, each saved and scored on the test split."""
    from .merging import merge

    out = {}
    for method in methods:
        merged = merge([a, b], method=method, align="full", data=None if method == "simple" else train,
                       progress=False)
        merged.save(folder / f"merged-{method}", overwrite=True)
        out[method] = _metrics(a, merged.state, test)
    return out, _variants(folder, "merged-", methods)


def _barrier(a, b, test, steps: int, folder: Path) -> tuple[dict, Path]:
    from .connectivity import barrier

    result = barrier(a, b, test, steps=steps, aligns=BARRIER_MODES, progress=False)
    result.plot(folder / "barrier.png")
    curves = {m: {"distance": c.distance, "loss_barrier": c.loss_barrier, "accuracy_drop": c.accuracy_barrier}
              for m, c in result.curves.items()}
    return curves, folder / "barrier.png"


def _metrics(subject, state, data) -> dict:
    """Test loss and accuracy of ``subject``'s architecture carrying ``state``."""
    from .datasets import evaluate

    model = copied_module(subject.model)
    model.load_state_dict(state)
    m = evaluate(model, data)
    return {"loss": m.loss, "accuracy": m.accuracy}


def _variants(folder: Path, stem: str, variants, suffix: str = "") -> str:
    """Shell-brace notation for sibling files: ``folder/merged-{simple,fisher}``."""
    middle = variants[0] if len(variants) == 1 else "{" + ",".join(variants) + "}"
    return f"{folder / stem}{middle}{suffix}"


def _group_counts(subject) -> dict:
    return {"total": len(subject.report.groups), **subject.report.summary()["by_motif_kind"]}


# -- the printed summary ---------------------------------------------------------------------------------------------
def _echo_pair(name: str, s: dict, echo) -> None:
    kinds = ", ".join(f"{k} x{v}" for k, v in s["groups"].items() if k != "total")
    echo(f"{name} (data {s['data']}, {s['test_examples']} test examples): {s['groups']['total']} groups ({kinds})")
    echo("  distance |B'-A|/|A|  " + _by_mode(s["barrier"], "distance"))
    echo("  loss barrier         " + _by_mode(s["barrier"], "loss_barrier"))
    if all(c["accuracy_drop"] is not None for c in s["barrier"].values()):
        echo("  accuracy drop        " + _by_mode(s["barrier"], "accuracy_drop"))
    cells = {**{f"endpoint {k}": v for k, v in s["endpoints"].items()},
             **{f"merged {k}": v for k, v in s["merged_after_full_alignment"].items()}}
    worst = max(a["verified_error"] for a in s["alignments"].values())
    echo(f"  aligned B            computes what B computes in every mode (float64 check, relative error "
         f"<= {worst:.0e})")
    echo("  test loss / acc.     " + "   ".join(f"{k} {_pair_of(v)}" for k, v in cells.items())
         + "   (merges after full alignment)")
    if _merges_lose(s):
        echo("  why the merges lose  " + _WHY_MERGES_LOSE.format(none=s["barrier"]["none"]["loss_barrier"],
                                                                 full=s["barrier"]["full"]["loss_barrier"]))
    for what, where in s["files"].items():
        echo(f"  {what:<20} {where}")


_WHY_MERGES_LOSE = "\n                       ".join((
    "A and B were trained from scratch, from different random initialisations (seeds 0 and 1):",
    "they found different solutions, not one solution in two parameter orders. Alignment undoes",
    "the symmetries (loss barrier {none:.3g} unaligned, {full:.3g} after full alignment), not what the",
    "two learned differently, so their average lies between two basins. Merging is meant for models",
    "that share a training history (fine-tunes of one pretrained model). More: examples/RESULTS.md."))


def _merges_lose(s: dict) -> bool:
    """Every merge scores a worse test loss than the worse endpoint."""
    worst_endpoint = max(m["loss"] for m in s["endpoints"].values())
    return all(m["loss"] > worst_endpoint for m in s["merged_after_full_alignment"].values())


def _by_mode(curves: dict, field: str) -> str:
    return "   ".join(f"{mode} {curves[mode][field]:.4g}" for mode in BARRIER_MODES)


def _pair_of(metrics: dict) -> str:
    accuracy = "" if metrics["accuracy"] is None else f"/{metrics['accuracy']:.3f}"
    return f"{metrics['loss']:.4f}{accuracy}"
