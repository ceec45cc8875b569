"""The user's whole flow over Hugging Face model types, end to end. Prints one JSON object.

Where ``examples/sweep_architectures.py`` checks the engine (each reported group, one model), this sweep checks
what a user runs on two models: for each model type two tiny models are built from the same shrunk config
(``sweep_architectures.tiny_config``, first Auto class of ``HEADS`` that builds it) but initialised independently
(seeds 0 and 1), each with ``perturb``'s noise and noise of its own (so their norms differ too), in float32. Then,
each a *stage* timed and caught on its own:

* ``fold``: ``symgraph.fold(B)``; the folded state, loaded into a copy of B (untied where the config written
  with it says so), must compute B's function;
* ``align``: ``symgraph.align(B, A)``; the aligned state must compute B's function and, where weight matching was
  kept, must not end farther from A than B began (``alignment.relative_distance``);
* ``merge``: ``symgraph.merge([A, B])``; the merged state must have A's keys, shapes and dtypes, leave integer
  tensors as they were, and give finite outputs (two independent models have no function to keep);
* ``self_merge``: ``symgraph.merge([A, copy of A])`` must compute A's function;
* with ``--learn`` instead: ``merge`` and ``align`` with learned matching on synthetic data (``data="synthetic"``,
  a few steps of :class:`symgraph.learn.LearnOptions`): the learned merge checked as ``merge``, the learned
  alignment as ``align`` but for the distance (learning lowers the loss along the path, not the distance: it may
  end farther from A, as examples/RESULTS.md's ``full+learn (synthetic)`` column shows);
* with ``--data`` instead: what a user with data runs, on ``DATA_EXAMPLES`` examples that
  :func:`symgraph.synthetic.synthetic_data` makes for the pair (the models' own samples, labelled by both): ``align``
  on activations of them (checked as ``align`` but for the distance: activation costs do not aim at it), and Fisher
  and RegMean merges with them as statistics (every frame also aligned by weights and on activations of the data,
  the data choosing), each checked as ``merge``. A type synthetic data cannot be made for (an encoder-decoder, a
  base model) is skipped;
* with ``--disk`` instead: what a user runs on files. Both models are saved by ``save_pretrained``, the commands
  ``symgraph fold B``, ``symgraph align B A`` and ``symgraph merge A B`` run on the folders (in this process, as
  the console runs them), and each output is loaded by transformers from disk with the pair's class: fold and
  align checked as ``align`` (without the distance), merge as ``merge``, and any tensor transformers reports
  missing, unexpected or of another shape on loading (re-initialised or dropped) is ``wrong``;
* with ``--stream`` instead: the same for ``symgraph align B A --stream`` and ``--stream --fold`` (block by block,
  7B and up; a refused streamed fold is no failure, as for ``fold``).

A function is checked *independently of symgraph's own verification*, with ``sweep_architectures.Checker``: the
state is loaded into a copy of the model with ``load_state_dict`` (so tied weights hold what loading left in them),
run in float64 at the checker's shapes (none the traced one) and compared with the original's outputs. The
tolerance is 100 times the model's float32 floor (the relative output change one float32 rounding of every state
entry makes), at least 1e-6 (1e-5 for the self-merge). Neither input model may change in place.

Each type runs in its own subprocess with a time limit. A stage's class is ``ok``, ``wrong`` (a check above
failed: ``max_rel_err`` over ``tol``, or ``problems`` listed), ``refused`` (symgraph stopped with its own
:class:`symgraph.errors.SymgraphError`) or ``crash`` (any other exception; the last frames are kept). A type's
class is its worst stage's (``wrong`` < ``crash`` < ``refused`` < ``ok``), where fold refusing is no failure
(most norms cannot be folded: a bias, an offset, a centring that does not pay); besides ``timeout`` (over the
limit) and ``skipped`` (transformers could not build or run the tiny model). Rows are keyed by ``name``: the type,
``TYPE+learn`` with ``--learn``, ``TYPE+data`` with ``--data``, ``TYPE+disk`` with ``--disk``, ``TYPE+stream`` with
``--stream`` (``--types`` takes such names too). Run in chunks under load; rows accumulate in ``--jsonl`` (the
last line per name wins)::

    python examples/sweep_pipeline.py --types gpt_neo,deit --timeout 300 --jsonl /tmp/pipeline.jsonl
    python examples/sweep_pipeline.py --types qwen3_moe --learn --jsonl /tmp/pipeline.jsonl
    python examples/sweep_pipeline.py --summarize --jsonl /tmp/pipeline.jsonl -o examples/results/sweep_pipeline.json

``--variants`` runs the flow on config variants instead (``sweep_architectures.VARIANTS``: the shrunk default config
with options flipped, built with the variant's heads, its floating buffers given that sweep's noise too); rows are
keyed by the variant's name (``NAME+learn`` with ``--learn``). Bare, it takes every variant (of ``--types``' types
where given); followed by names, those (quoted: names hold spaces)::

    python examples/sweep_pipeline.py --variants --types llama,qwen3 --jsonl /tmp/variants.jsonl
    python examples/sweep_pipeline.py --variants --skip-done --jsonl /tmp/variants.jsonl
    python examples/sweep_pipeline.py --variants "llama tie_word_embeddings=true" --learn --jsonl /tmp/variants.jsonl
    python examples/sweep_pipeline.py --summarize --jsonl /tmp/variants.jsonl \
        -o examples/results/sweep_pipeline_variants.json
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
import traceback
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from symgraph.errors import SymgraphError  # noqa: E402
from sweep_architectures import (HEADS, NAMED, TYPES, VARIANT_BY_NAME, Checker, build, first_line,  # noqa: E402
                                 perturb_buffers, report_summary, run_all, run_script_isolated, tied_names,
                                 variant_heads)

# Where the shared shrink leaves a type too large to sweep in time (flaubert keeps emb_dim 2048: a 300 s timeout;
# xlnet keeps d_inner 4096 beside d_model 64: its --data merges solved 56 assignments of side 4096, 63 s of 149 s
# of a Fisher merge, and the type timed out at 300 s)
OVERRIDES = {"flaubert": dict(emb_dim=64), "xlnet": dict(d_inner=256)}
SEEDS = (0, 1)  # model A, model B
OWN_NOISE = 0.01  # each model's own noise on matrices (vectors: 0.1), after perturb's shared seed
FUNCTION_TOL = 1e-6  # the least tolerance of a kept function (relative, float64 run of a float32 state)
SELF_MERGE_TOL = 1e-5
FLOOR_FACTOR = 100  # tolerance: this many float32 floors
LEARN = dict(steps=5, checks=2, batch_size=8, eval_batches=1, synthetic_examples=64)
DATA_EXAMPLES, DATA_BATCH = 16, 8  # --data: the synthetic examples of the data stages
ORDER = ("wrong", "crash", "refused", "ok")  # a type's class is its worst stage's


# -- the two models ------------------------------------------------------------------------------------------
def recipe(subject: str) -> tuple[str, dict, tuple[str, ...]]:
    """The model type, config overrides and Auto classes of ``subject``: a model type, or the name of a variant
    (an entry of ``sweep_architectures.VARIANTS``)."""
    variant = VARIANT_BY_NAME.get(subject)
    model_type = variant[0] if variant else subject
    overrides = {**OVERRIDES.get(model_type, {}), **(variant[1] if variant else {})}
    return model_type, overrides, variant_heads(variant) if variant else HEADS


def build_seeded(subject: str, seed: int):
    """The tiny model of ``subject`` initialised from ``seed``: perturb's noise (a variant's floating buffers get
    the variants sweep's noise too), then noise of its own."""
    model, head = build(*recipe(subject), seed=seed)
    if subject in VARIANT_BY_NAME:
        perturb_buffers(model)
    own_noise(model, seed)
    return model.float().eval(), head


def own_noise(model, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                scale = OWN_NOISE if p.dim() >= 2 else 0.1
                p.add_(scale * torch.randn(p.shape, generator=generator).to(p.dtype))


class Pair:
    """Models A and B, their float64 checkers, states as built, and the tolerance of each one's function."""

    def __init__(self, subject: str):
        (self.a, self.head), (self.b, _) = (build_seeded(subject, seed) for seed in SEEDS)
        self.checker_a, self.checker_b = Checker(self.a), Checker(self.b)
        self.state_a, self.state_b = snapshot(self.a), snapshot(self.b)
        self.floor_b = float32_floor(self.checker_b) if self.checker_b.inputs else None

    def tolerance(self, checker, least: float = FUNCTION_TOL) -> float:
        floor = self.floor_b if checker is self.checker_b else float32_floor(checker)
        return max(least, FLOOR_FACTOR * floor)

    @functools.cached_property
    def data(self):
        """The data stages' examples (:data:`DATA_EXAMPLES`), made once: A's samples and B's, labelled by both."""
        from symgraph.synthetic import synthetic_data

        return synthetic_data(self.a, [self.state_a, self.state_b], examples=DATA_EXAMPLES, batch_size=DATA_BATCH)

    def untouched(self) -> bool:
        return same(self.a, self.state_a) and same(self.b, self.state_b)


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(model, state: dict) -> bool:
    import torch

    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def float32_floor(checker) -> float:
    """The relative output change (float64 run) when every floating state entry gets one float32 rounding."""
    import torch

    generator = torch.Generator().manual_seed(7)
    state = {k: torch.where(v.isfinite(), v * (1 + 2.0 ** -24 * torch.randn(
        v.shape, generator=generator, dtype=v.dtype)), v) if v.is_floating_point() else v
             for k, v in checker.state.items()}
    return checker.error(state)


# -- the checks ----------------------------------------------------------------------------------------------
def loaded(model, state):
    """A copy of ``model`` with ``state`` loaded strictly, as a user would load a saved result."""
    out = copy.deepcopy(model)
    out.load_state_dict(state, strict=True)
    return out


def error_of(checker, model) -> float:
    """The worst relative output change of ``model``'s state (float64, the checker's code and shapes) from the
    checker's reference outputs."""
    import torch

    state = {k: v.detach().to(torch.float64) if v.is_floating_point() else v.detach()
             for k, v in model.state_dict(keep_vars=True).items()}
    return max(float((checker.run(state, kw) - ref).norm() / ref.norm().clamp_min(1e-30))
               for (_, _, _, kw), ref in zip(checker.inputs, checker.refs))


def key_problems(reference: dict, state: dict) -> list[str]:
    """What ``state`` gets wrong against ``reference``: missing or extra keys, shapes, dtypes, non-finite
    entries, integer tensors changed."""
    problems = [f"extra keys {sorted(set(state) - set(reference))[:5]}"] if set(state) - set(reference) else []
    for key, ref in reference.items():
        problems += [f"{p} {key}" for p in tensor_problems(ref, state[key])] if key in state else [f"missing {key}"]
    return problems


def tensor_problems(ref, new) -> list[str]:
    import torch

    if tuple(new.shape) != tuple(ref.shape):
        return [f"shape {tuple(ref.shape)}->{tuple(new.shape)}"]
    problems = [f"dtype {ref.dtype}->{new.dtype}"] if new.dtype != ref.dtype else []
    if new.is_floating_point() and not bool(new.isfinite().all()):
        problems.append("non-finite")
    if not ref.is_floating_point() and not torch.equal(new, ref):
        problems.append("integer tensor changed")
    return problems


def untied(model, state: dict) -> list[str]:
    """The tied names of ``model`` that ``state`` gives different values."""
    import torch

    return [",".join(names) for names in tied_names(model)
            if any(not torch.equal(state[names[0]], state[n]) for n in names[1:] if n in state)]


def as_written(model, config):
    """``model``, or its untied copy where ``config`` (written with a result) unties what ``model`` ties: the model
    a user builds from that config (fold, align --fold and merge untie tied weights to fold the norm they read)."""
    if getattr(config, "tie_word_embeddings", None) is not False or not tied_names(model):
        return model
    import symgraph
    from symgraph.fold import untied as untied_copy

    return untied_copy(symgraph.load(model))[0].model


def function_kept(out: dict, state: dict, model, checker, tol: float, config=None) -> dict:
    """``out`` with the function check of ``state`` loaded into ``model`` (as written with ``config``,
    :func:`as_written`): its error, tolerance and class."""
    written = as_written(model, config)
    if written is not model:
        out["untied"] = True
        model, checker = written, Checker(written)
    problems = key_problems(model.state_dict(), state)
    out.update(max_rel_err=error_of(checker, loaded(model, state)), tol=tol)
    if untied_names := untied(model, state):
        out["tied_inconsistent"] = untied_names
    if problems or not out["max_rel_err"] <= tol:
        out.update({"class": "wrong"}, **({"problems": problems[:10]} if problems else {}))
    return out


def merged_sound(out: dict, state: dict, pair: Pair) -> dict:
    """``out`` with the checks a merge of two independent models allows: A's keys, finite outputs."""
    import torch

    problems = key_problems(pair.a.state_dict(), state)
    model = loaded(pair.a, state)
    state64 = {k: v.double() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    outputs = pair.checker_a.run(state64, pair.checker_a.inputs[0][3])
    out["outputs_finite"] = bool(torch.isfinite(outputs).all())
    if problems or not out["outputs_finite"]:
        out.update({"class": "wrong"}, **({"problems": problems[:10]} if problems else {}))
    return out


# -- the stages ----------------------------------------------------------------------------------------------
def fold_stage(pair: Pair) -> dict:
    import symgraph

    result = symgraph.fold(pair.b)
    out = {"norms": len(result.norms), "centred": len(result.centred), "verified_error": result.verified_error}
    return function_kept(out, result.state, pair.b, pair.checker_b, pair.tolerance(pair.checker_b), result.config)


def align_stage(pair: Pair, **options) -> dict:
    """B aligned to A with ``options`` (align's data and learning arguments) and checked; without data, where
    weight matching was kept, also no farther from A (learning lowers the loss along the path and activation costs
    match activations, neither the distance: either may end farther from A, and full mode keeps them for their
    path loss)."""
    import symgraph
    from symgraph.alignment import relative_distance

    result = symgraph.align(pair.b, pair.a, **options)
    out = {"distance_before": result.distance_before, "distance_after": result.distance_after,
           "verified_error": result.verified_error, "folded": result.folded, "start": result.start}
    if result.fold_note:
        out["fold_note"] = result.fold_note[:300]
    out = function_kept(out, result.state, pair.b, pair.checker_b, pair.tolerance(pair.checker_b), result.config)
    before, after = relative_distance(pair.state_b, pair.state_a), relative_distance(result.state, pair.state_a)
    out.update(my_before=before, my_after=after)
    by_path_loss = result.start == "learned" or "activations" in (result.costs or {}).values()
    if after > before * (1 + 1e-9) and "data" not in options and not by_path_loss:
        out.update({"class": "wrong"}, problems=out.get("problems", []) + ["farther from A after alignment"])
    return out


def merge_stage(pair: Pair, **options) -> dict:
    """A and B merged with ``options`` (merge's method, data and learning arguments) and checked."""
    import symgraph

    result = symgraph.merge([pair.a, pair.b], progress=False, **options)
    out = {"frame": result.frame, "distances": result.distances, "distances_before": result.distances_before}
    if "data" in options:
        out["frames"] = result.frames
    if result.fold_note:
        out["fold_note"] = result.fold_note[:300]
    if options.get("learn"):
        out["learned"] = [bool(x) for x in result.learned]
    return merged_sound(out, result.state, pair)


def self_merge_stage(pair: Pair) -> dict:
    import symgraph

    result = symgraph.merge([pair.a, copy.deepcopy(pair.a)], progress=False)
    out = {"frame": result.frame, "distances": result.distances}
    return function_kept(out, result.state, pair.a, pair.checker_a, pair.tolerance(pair.checker_a, SELF_MERGE_TOL),
                         result.config)


def learn_options():
    from symgraph.learn import LearnOptions

    return LearnOptions(**LEARN)


# -- through the files a user has: --disk ---------------------------------------------------------------------
def cli(*args) -> str:
    """``symgraph --debug ARGS`` in this process, as a user runs it: its output; a refusal (symgraph's own message
    and exit code) as :class:`Refused`; a bug raises its own exception (``--debug``), for its frames."""
    import contextlib
    import io

    from symgraph.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["--debug", *map(str, args)])
        except SystemExit as exc:
            if exc.code:
                raise Refused(f"symgraph {args[0]} exited {exc.code}: {err.getvalue()[-600:]}") from None
    return out.getvalue()


class Refused(SymgraphError):
    """A command refused its input, with its own message (what the user sees)."""


def from_disk(pair: Pair, folder: Path):
    """The model at ``folder`` as transformers loads it with the pair's class, and what loading reported (keys
    missing from the files, unexpected, or of another shape: each a tensor re-initialised or dropped)."""
    model, info = type(pair.b).from_pretrained(folder, output_loading_info=True)
    lost = {k: sorted(v)[:5] for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                                  "mismatched_keys") and v}
    return model.float().eval(), lost


def disk_stage(pair: Pair, command: str) -> dict:
    """``symgraph COMMAND`` on the pair saved by ``save_pretrained`` (as users have them), its output loaded by
    transformers from disk: for ``fold`` and ``align`` it must compute B's function, for ``merge`` load every
    tensor (nothing re-initialised) and give finite outputs."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        for name, model in (("a", pair.a), ("b", pair.b)):
            model.save_pretrained(root / name)
        args = {"fold": ("fold", root / "b"), "align": ("align", root / "b", root / "a"),
                "merge": ("merge", root / "a", root / "b", "--no-progress"),
                "stream_align": ("align", root / "b", root / "a", "--stream", "--quiet"),
                "stream_fold": ("align", root / "b", root / "a", "--stream", "--fold", "--quiet")}[command]
        cli(*args, "-o", root / "out")
        model, lost = from_disk(pair, root / "out")
        out = {"lost_on_loading": lost} if lost else {}
        state = model.state_dict()
        if command == "merge":
            out = merged_sound(out, state, pair)
        else:
            out = function_kept(out, state, pair.b, pair.checker_b, pair.tolerance(pair.checker_b), model.config)
        if lost:
            out.update({"class": "wrong"}, problems=out.get("problems", []) + [f"loading lost {lost}"])
        return out


STAGES = {
    "base": {"fold": fold_stage, "align": align_stage, "merge": merge_stage, "self_merge": self_merge_stage},
    "disk": {f"disk_{c}": functools.partial(disk_stage, command=c) for c in ("fold", "align", "merge")},
    "stream": {c: functools.partial(disk_stage, command=c) for c in ("stream_align", "stream_fold")},
    "learn": {"learn_merge": lambda pair: merge_stage(pair, data="synthetic", learn=learn_options()),
              "learn_align": lambda pair: align_stage(pair, data="synthetic", learn=learn_options())},
    "data": {"data_align": lambda pair: align_stage(pair, data=pair.data),
             "data_fisher": lambda pair: merge_stage(pair, method="fisher", data=pair.data),
             "data_regmean": lambda pair: merge_stage(pair, method="regmean", data=pair.data)},
}


def stage(pair: Pair, run) -> dict:
    """``run(pair)``'s fields, timed, with class ``ok`` unless a check set it; symgraph's own error ``refused``,
    any other ``crash``."""
    from symgraph.errors import SymgraphError

    clock = time.perf_counter()
    try:
        out = {"class": "ok", **run(pair)}
    except SymgraphError as exc:
        out = {"class": "refused", "error": type(exc).__name__, "message": str(exc)[:600]}
    except Exception as exc:  # noqa: BLE001
        out = {"class": "crash", "error": first_line(exc), "frames": frames(exc)}
    return {**out, "seconds": round(time.perf_counter() - clock, 1)}


def frames(exc: BaseException) -> list[str]:
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(exc.__traceback__)[-6:]]


FOLDS = ("fold", "disk_fold", "stream_fold")  # stages whose refusal is no failure (most norms cannot be folded)


def type_class(stages: dict) -> str:
    """The worst class of ``stages`` (``ORDER``), fold's refusal left out: most norms cannot be folded."""
    classes = [s["class"] for name, s in stages.items() if not (name in FOLDS and s["class"] == "refused")]
    return min(classes, key=ORDER.index) if classes else "ok"


def failed_stages(stages: dict) -> list[str]:
    return [name for name, s in stages.items() if s["class"] != "ok" and not (name in FOLDS and
                                                                              s["class"] == "refused")]


# -- one type ------------------------------------------------------------------------------------------------
def name_of(subject: str, mode: str) -> str:
    return subject if mode == "base" else f"{subject}+{mode}"


def parse_name(name: str) -> tuple[str, str]:
    """The subject (a model type or a variant's name) and the mode of a row's name."""
    subject, _, mode = name.partition("+")
    return subject, mode or "base"


def identity(name: str) -> dict:
    """The fields that say what a row is: its name, type, mode, and its variant's name and overrides if any."""
    subject, mode = parse_name(name)
    model_type = recipe(subject)[0]
    row = {"name": name, "type": model_type, "mode": mode, "named": model_type in NAMED}
    if subject in VARIANT_BY_NAME:
        row.update(variant=subject, overrides=VARIANT_BY_NAME[subject][1])
    return row


def sweep_one(name: str) -> dict:
    """One row: the stages of ``name``'s mode on its subject's pair of tiny models, and the subject's class."""
    subject, mode = parse_name(name)
    row = {**identity(name), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    clock = time.perf_counter()
    try:
        pair = Pair(subject)
    except Exception as exc:  # noqa: BLE001 -- transformers could not build or run the tiny model
        return {**row, "class": "skipped", "reason": first_line(exc)}
    if not pair.checker_b.inputs or not pair.checker_a.inputs:
        return {**row, "class": "skipped", "reason": "runs at no sweep shape: " + "; ".join(pair.checker_b.rejected)}
    if mode == "data":
        from symgraph.errors import DataError

        try:
            pair.data  # noqa: B018 -- made here, so a model it cannot be made for is skipped, not refused
        except DataError as exc:  # an encoder-decoder, a base model: no examples to run the stages on
            return {**row, "class": "skipped", "reason": f"no synthetic data: {first_line(exc)}"}
    row.update(head=pair.head, params=sum(p.numel() for p in pair.a.parameters()), float32_floor_b=pair.floor_b,
               shapes=[f"{b}x{n}{' padded' if p else ''}" for b, n, p, _ in pair.checker_b.inputs],
               float64_casts=pair.checker_b.forced, **({"learn_options": LEARN} if mode == "learn" else {}),
               **({"data_examples": DATA_EXAMPLES} if mode == "data" else {}))
    stages = {name: stage(pair, run) for name, run in STAGES[mode].items()}
    if not pair.untouched():
        stages["inputs"] = {"class": "wrong", "problems": ["A or B changed in place"]}
    return {**row, "class": type_class(stages), "failed": failed_stages(stages), "stages": stages,
            "seconds": round(time.perf_counter() - clock, 1)}


# -- driver --------------------------------------------------------------------------------------------------
def run_isolated(name: str, timeout: float) -> dict:
    clock = time.perf_counter()
    row = run_script_isolated(__file__, name, timeout, identity(name))
    return {**row, "wall": round(time.perf_counter() - clock, 1)}


def summarize(rows: list[dict]) -> dict:
    """Counts of type classes and of each stage's classes, every row not ok with its failed stages' errors, and
    the rows (the last per name)."""
    rows = sorted({r["name"]: r for r in rows}.values(), key=lambda r: r["name"])
    stage_counts: dict[str, Counter] = {}
    for row in rows:
        for name, s in row.get("stages", {}).items():
            stage_counts.setdefault(name, Counter())[s["class"]] += 1
    return {
        "function_tolerance": f"max({FUNCTION_TOL:g}, {FLOOR_FACTOR} x the model's float32 floor); self-merge "
                              f"at least {SELF_MERGE_TOL:g}",
        "learn_options": LEARN, "data_examples": DATA_EXAMPLES,
        "names": len(rows), "counts": dict(Counter(r["class"] for r in rows)),
        "stage_counts": {name: dict(c) for name, c in stage_counts.items()},
        "classes": {r["name"]: r["class"] for r in rows},
        "seconds": round(sum(r.get("wall", r.get("seconds", 0)) for r in rows), 1),
        "failures": {r["name"]: failure(r) for r in rows if r["class"] not in ("ok",)},
        "rows": rows,
    }


def failure(row: dict) -> dict:
    """What a row that is not ok says: its reason, or its failed stages' errors, problems and errors."""
    if "stages" not in row:
        return {"class": row["class"], "reason": row.get("reason")}
    keys = ("class", "error", "message", "problems", "max_rel_err", "tol", "frames")
    return {name: {k: s[k] for k in keys if k in s} for name, s in row["stages"].items() if name in row["failed"]}


def names_of(args) -> list[str]:
    """The names to run: ``--variants``' (those named, else every variant of ``--types``' types), else
    ``--types``' (else every type), in ``--learn``'s or ``--data``'s mode where a name gives none."""
    types = args.types.split(",") if args.types else None
    if args.variants is not None:
        subjects = args.variants or [n for n, v in VARIANT_BY_NAME.items() if types is None or v[0] in types]
    else:
        subjects = types or TYPES
    mode = ("learn" if args.learn else "data" if args.data else "disk" if args.disk else "stream" if args.stream
            else "base")
    return [s if "+" in s else name_of(s, mode) for s in subjects]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="run one name (TYPE, TYPE+learn, TYPE+data) in this process, print its JSON")
    parser.add_argument("--types", help="comma-separated model types, or names TYPE+learn (default: "
                                        "sweep_architectures' whole list)")
    parser.add_argument("--variants", nargs="*", metavar="NAME",
                        help="sweep config variants (sweep_architectures' VARIANTS) instead of default configs: "
                             "those NAMEs (variant names, or NAME+learn), else every variant of --types' types, "
                             "else all")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--learn", action="store_true", help="run the learned stages (synthetic data) instead")
    modes.add_argument("--data", action="store_true",
                       help="run the stages with data instead (alignment on activations, Fisher and RegMean merges)")
    modes.add_argument("--disk", action="store_true",
                       help="run the commands (fold, align, merge) on the pair saved by save_pretrained instead, their "
                            "outputs loaded by transformers from disk")
    modes.add_argument("--stream", action="store_true",
                       help="run the streamed commands (align --stream, with and without --fold) on the pair saved by "
                            "save_pretrained instead, their outputs loaded by transformers from disk")
    parser.add_argument("--skip-done", action="store_true", help="leave out names already in --jsonl")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per type")
    parser.add_argument("--jsonl", type=Path, help="append one line per type here (accumulates across chunks)")
    parser.add_argument("--summarize", action="store_true", help="only summarize --jsonl")
    parser.add_argument("-o", "--output", type=Path, help="also write the summary JSON here (atomically)")
    args = parser.parse_args(argv)
    if args.one:
        import warnings

        warnings.filterwarnings("ignore")
        print(json.dumps(sweep_one(args.one), default=str))
        return
    rows = [json.loads(ln) for ln in args.jsonl.read_text().splitlines()] if args.jsonl and args.jsonl.exists() else []
    unknown = [n for n in args.variants or [] if parse_name(n)[0] not in VARIANT_BY_NAME]
    if unknown:
        parser.error(f"not a variant of sweep_architectures.VARIANTS: {unknown}")
    if not args.summarize:
        done = {r["name"] for r in rows} if args.skip_done else set()
        rows += run_all([n for n in names_of(args) if n not in done], lambda n: run_isolated(n, args.timeout),
                        ("name", "class", "failed", "reason", "wall"), args.jsonl)
    command = " ".join(["python", *(sys.argv if argv is None else [__file__, *argv])])
    run = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    report_summary(rows, lambda rs: {**run, **summarize(rs)}, "name", [], args.output)


if __name__ == "__main__":
    main()
