"""Benchmark of the symgraph engine (capture + analysis) at real model sizes; prints one JSON object to stdout.

What is measured, and why
-------------------------
Unit tests check what the engine finds; they do not time it, because a timing assertion in a test suite is either
so loose it never fires or so tight it flakes on a busy machine. The figures live here instead: run this script
on the machine you care about and read the numbers. Where a figure only means something relative to another one
(is the analysis cheap next to reading the weights?), both are measured in the same run, on the same machine,
back to back, and the ratio is reported.

Two parts (``--part bert|llama70b-config|all``, default ``all``):

``bert``
    ``transformers.BertConfig()`` defaults (hidden 768, 12 layers, 12 heads, intermediate 3072, vocab 30522) built
    with random weights by ``AutoModelForSequenceClassification.from_config`` (``num_labels=2``). Timed
    separately: building the model (not symgraph's cost, reported for scale only), ``symgraph.load`` (example
    inputs), ``subject.capture`` (torch.export) and ``subject.report`` (the analysis). Memory: the growth of the
    process's peak RSS (``ru_maxrss``) over capture + analysis, and the tracemalloc peak of the analysis alone
    (measured in a second, separate analysis of the same capture, because tracemalloc slows Python down and would
    distort the timing; tracemalloc sees Python and NumPy allocations, not torch's tensor storage). Baseline: the
    state dict is saved to a temporary ``model.safetensors`` and ``safetensors.torch.load_file`` is timed (best
    of several reads; the file was just written, so the page cache is warm, which makes this baseline a lower
    bound on the cost of reading weights from disk). ``ratio_*`` = symgraph time / weight-read time.

``llama70b-config``
    A LLaMA-70B-sized ``LlamaConfig`` (hidden 8192, intermediate 28672, 80 layers, 64 heads, 8 KV heads, vocab
    128256) written as ``config.json`` and loaded with ``symgraph.load(path, config_only=True)``: every parameter
    lives on the meta device, so nothing near the 140 GB the fp16 weights would take is ever allocated. Timed:
    load, capture, analysis. Memory: the process's absolute peak RSS at each stage. This part always runs in a
    process of its own (``--part all`` starts one child process per part), so its peak RSS is not inflated by the
    BERT part. It asserts that no parameter has real storage and that the peak RSS is far below the fp16 weights.

Options: ``--layers N`` overrides the layer count of both models (``--layers 1`` or ``2`` for a smoke run),
``--out FILE`` also writes the JSON to FILE, ``--profile N`` runs the analysis step under cProfile and prints its
top N lines (by cumulative time) to stderr, also when the analysis fails (its time then includes the profiler's
overhead, and the JSON says ``analysis_profiled``), e.g.::

    python examples/bench_engine.py --part llama70b-config --layers 4 --profile 25

Progress goes to stderr; stdout carries exactly one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

PARTS = ("bert", "llama70b-config")
LLAMA70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096)
MB = 1024 * 1024


def log(msg: str) -> None:
    print(f"[bench_engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (``ru_maxrss``: kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def mb(n: float) -> float:
    return round(n / MB, 1)


@contextmanager
def timed(label: str, into: dict, key: str):
    log(f"{label} ...")
    into["stage"] = key.removesuffix("_s")
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        into[f"{key.removesuffix('_s')}_failed_after_s"] = round(time.perf_counter() - t0, 3)
        raise
    into[key] = round(time.perf_counter() - t0, 3)
    log(f"{label}: {into[key]:.2f} s")


@contextmanager
def profiled(top: int, into: dict):
    """With ``top`` > 0: cProfile the block and print its ``top`` lines by cumulative time to stderr, also when
    the block fails (a profile of a run that ran out of memory still shows where the memory went)."""
    if not top:
        yield
        return
    import cProfile
    import io
    import pstats

    into["analysis_profiled"] = True  # the analysis time then includes cProfile's overhead
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
        print(buf.getvalue(), file=sys.stderr, flush=True)


def env_info() -> dict:
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        commit = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": commit,
    }


# --------------------------------------------------------------------------------------------------------------
# part 1: BERT-base with random weights
# --------------------------------------------------------------------------------------------------------------


def bench_bert(out: dict, layers: int | None, profile: int = 0, weight_reads: int = 3) -> dict:
    """Fill ``out`` as the stages complete (a failure leaves the figures measured so far in it)."""
    import safetensors.torch
    import torch
    import transformers

    import symgraph

    cfg = transformers.BertConfig(num_labels=2)
    if layers is not None:
        cfg.num_hidden_layers = layers
    out["config"] = {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "intermediate_size", "vocab_size")}
    out["rss_at_start_mb"] = mb(peak_rss_bytes())

    torch.manual_seed(0)
    with timed("bert: build model (random weights; not symgraph's cost)", out, "build_model_s"):
        model = transformers.AutoModelForSequenceClassification.from_config(cfg)
    out["parameter_count"] = sum(p.numel() for p in model.parameters())
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())

    gc.collect()
    rss0 = peak_rss_bytes()
    with timed("bert: symgraph.load (example inputs)", out, "load_s"):
        subject = symgraph.load(model)
    with timed("bert: capture (torch.export)", out, "capture_s"):
        subject.capture
    rss_capture = peak_rss_bytes()
    out["peak_rss_before_capture_mb"] = mb(rss0)
    out["peak_rss_after_capture_mb"] = mb(rss_capture)
    with timed("bert: analysis (subject.report)", out, "analysis_s"), profiled(profile, out):
        report = subject.report
    rss1 = peak_rss_bytes()
    out["capture_plus_analysis_s"] = round(out["capture_s"] + out["analysis_s"], 3)
    summary = report.summary()
    out["groups"] = summary["groups"]
    out["by_motif_kind"] = summary["by_motif_kind"]
    out["summary"] = summary
    out["peak_rss_after_analysis_mb"] = mb(rss1)
    out["peak_rss_delta_capture_mb"] = mb(rss_capture - rss0)
    out["peak_rss_delta_analysis_mb"] = mb(rss1 - rss_capture)
    out["peak_rss_delta_capture_plus_analysis_mb"] = mb(rss1 - rss0)

    # tracemalloc peak of the analysis alone: a second analysis of the same capture (tracemalloc slows it down).
    again = dataclasses.replace(subject, _report=None)
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    with timed("bert: analysis again under tracemalloc", out, "analysis_under_tracemalloc_s"):
        report2 = again.report
    out["tracemalloc_peak_analysis_mb"] = mb(tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
    out["analysis_deterministic"] = report2.summary() == summary
    del again, report2

    # baseline: read the same weights from a safetensors file
    with tempfile.TemporaryDirectory(prefix="bench_engine_bert_") as tmp:
        file = Path(tmp) / "model.safetensors"
        seen: dict = {}
        state = {}
        for k, v in model.state_dict().items():  # safetensors refuses shared storage: clone the aliases
            v = v.detach()
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
            state[k] = v.clone().contiguous() if key in seen else v.contiguous()
            seen[key] = k
        log(f"bert: writing {len(state)} tensors to {file.name} (baseline)")
        safetensors.torch.save_file(state, str(file))
        del state
        out["weights_file_mb"] = mb(file.stat().st_size)
        loads, reads = [], []
        for _ in range(weight_reads):
            gc.collect()
            t0 = time.perf_counter()
            loaded = safetensors.torch.load_file(str(file))
            t1 = time.perf_counter()
            for t in loaded.values():  # make sure every byte is really in memory, not just mapped
                t.sum()
            t2 = time.perf_counter()
            loads.append(round(t1 - t0, 4))
            reads.append(round(t2 - t0, 4))
            del loaded
        log(f"bert: safetensors.torch.load_file: {loads} s; + touching every tensor: {reads} s")
    best = min(reads)
    out["weights_read"] = {
        "method": f"safetensors.torch.load_file, then sum() of every tensor; warm page cache; best of "
                  f"{weight_reads}",
        "load_file_times_s": loads,
        "load_and_touch_times_s": reads,
        "load_file_best_s": min(loads),
        "best_s": best,
        "throughput_gb_s": round(out["weights_file_mb"] / 1024 / best, 2),
    }
    out["ratio_analysis_to_weights_read"] = round(out["analysis_s"] / best, 2)
    out["ratio_capture_to_weights_read"] = round(out["capture_s"] / best, 2)
    out["ratio_capture_plus_analysis_to_weights_read"] = round(out["capture_plus_analysis_s"] / best, 2)
    return out


# --------------------------------------------------------------------------------------------------------------
# part 2: LLaMA-70B-sized config, meta parameters only
# --------------------------------------------------------------------------------------------------------------


def bench_llama70b_config(out: dict, layers: int | None, profile: int = 0) -> dict:
    """Fill ``out`` as the stages complete (a failure leaves the figures measured so far in it)."""
    import transformers

    import symgraph

    params = dict(LLAMA70B)
    if layers is not None:
        params["num_hidden_layers"] = layers
    out["config"] = params
    out["peak_rss_at_start_mb"] = mb(peak_rss_bytes())  # interpreter + torch + transformers + symgraph imports

    with tempfile.TemporaryDirectory(prefix="bench_engine_llama70b_") as tmp:
        cfg = transformers.LlamaConfig(**params)
        cfg.architectures = ["LlamaForCausalLM"]  # as in a real checkpoint: the LM head is part of the model
        path = Path(tmp) / "config.json"
        cfg.to_json_file(str(path))
        gc.collect()
        rss0 = peak_rss_bytes()
        with timed("llama70b-config: symgraph.load(config_only=True)", out, "load_s"):
            subject = symgraph.load(path, config_only=True)
        rss_load = peak_rss_bytes()
        out["peak_rss_before_load_mb"] = mb(rss0)
        out["peak_rss_after_load_mb"] = mb(rss_load)

    model = subject.model
    out["model_class"] = type(model).__name__
    named = list(model.named_parameters())
    real = [n for n, p in named if p.device.type != "meta"]
    real_buffers = {n: b.numel() * b.element_size() for n, b in model.named_buffers() if b.device.type != "meta"}
    n_params = sum(p.numel() for _, p in named)
    out["parameter_count"] = n_params
    out["parameters"] = len(named)
    out["parameters_not_on_meta"] = len(real)
    out["all_parameters_on_meta"] = not real
    out["non_meta_buffer_bytes"] = sum(real_buffers.values())
    out["fp16_weights_gb"] = round(n_params * 2 / 1e9, 1)
    assert not real, f"parameters with real storage in a config-only load: {real[:5]}"

    with timed("llama70b-config: capture (torch.export)", out, "capture_s"):
        subject.capture
    rss_capture = peak_rss_bytes()
    out["peak_rss_after_capture_mb"] = mb(rss_capture)
    with timed("llama70b-config: analysis (subject.report)", out, "analysis_s"), profiled(profile, out):
        report = subject.report
    rss1 = peak_rss_bytes()
    out["load_plus_capture_plus_analysis_s"] = round(out["load_s"] + out["capture_s"] + out["analysis_s"], 3)
    still_real = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    assert not still_real, f"capture/analysis materialised parameters: {still_real[:5]}"

    summary = report.summary()
    out["groups"] = summary["groups"]
    out["by_motif_kind"] = summary["by_motif_kind"]
    out["summary"] = summary
    out["notes"] = list(report.notes)
    out["peak_rss_mb"] = mb(rss1)
    out["peak_rss_delta_load_capture_analysis_mb"] = mb(rss1 - rss0)
    out["peak_rss_fraction_of_fp16_weights"] = round(rss1 / (n_params * 2), 5)
    # "far below": at least 20x less than the fp16 weights (checked at full size; tiny --layers runs are exempt)
    if n_params > 10e9:
        assert rss1 * 20 < n_params * 2, f"peak RSS {mb(rss1)} MB is not far below {out['fp16_weights_gb']} GB"
    return out


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------


def mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def limit_address_space(gb: float | None) -> float | None:
    """Cap this process's address space so that a runaway allocation raises MemoryError here instead of waking
    the kernel's OOM killer (which may pick another process on a shared machine). Default: half the RAM."""
    if gb is None:
        total = mem_total_bytes()
        if total is None:
            return None
        gb = 0.5 * total / 1024**3
    if gb <= 0:
        return None
    limit = int(gb * 1024**3)
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError, AttributeError):
        return None
    return round(limit / 1024**3, 1)


def run_part(part: str, args: argparse.Namespace) -> dict:
    """Run one part in this process; a failure (MemoryError included) is reported in the figures, not raised."""
    bench = bench_bert if part == "bert" else bench_llama70b_config
    out: dict = {"address_space_limit_gb": limit_address_space(args.mem_limit_gb)}
    try:
        bench(out, args.layers, args.profile)
    except Exception as exc:
        import traceback

        traceback.print_exc(file=sys.stderr)
        out["ok"] = False
        out["failed_stage"] = out.pop("stage", None)
        out["error"] = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        out["peak_rss_at_failure_mb"] = mb(peak_rss_bytes())
        log(f"{part}: FAILED in stage {out['failed_stage']}: {out['error'][:200]}")
    else:
        out.pop("stage", None)
        out["ok"] = True
    return out


def run_child(part: str, args: argparse.Namespace) -> dict:
    """Run one part in a fresh interpreter so that its peak RSS is its own."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    if args.profile:
        cmd += ["--profile", str(args.profile)]
    if args.mem_limit_gb is not None:
        cmd += ["--mem-limit-gb", str(args.mem_limit_gb)]
    log(f"starting child process: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr (progress) passes through
    wall = round(time.perf_counter() - t0, 3)
    try:
        out = json.loads(proc.stdout)[key_of(part)]
    except (json.JSONDecodeError, KeyError, TypeError):
        why = (f"killed by signal {-proc.returncode}" + (" (SIGKILL: probably the OOM killer)"
                                                         if proc.returncode == -9 else "")
               if proc.returncode < 0 else f"exit status {proc.returncode}")
        out = {"ok": False, "error": f"child process {why}, no JSON on stdout"}
        log(f"{part}: FAILED: {out['error']}")
    out["process_wall_s"] = wall
    return out


def key_of(part: str) -> str:
    return part.replace("-", "_")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=(*PARTS, "all"), default="all")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (quick runs)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the top N lines of a cProfile of the analysis step to stderr")
    ap.add_argument("--mem-limit-gb", type=float, default=None, metavar="GB",
                    help="address-space cap of each part's process (default: half the RAM; 0: none)")
    args = ap.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be at least 1")

    t0 = time.perf_counter()
    result: dict = {"benchmark": "symgraph engine: capture + analysis", "part": args.part,
                    "layers_override": args.layers}
    parts = PARTS if args.part == "all" else (args.part,)
    for part in parts:
        result[key_of(part)] = run_child(part, args) if args.part == "all" else run_part(part, args)
    result["ok"] = all(result[key_of(p)].get("ok") for p in parts)
    result["env"] = env_info()
    result["total_wall_s"] = round(time.perf_counter() - t0, 3)

    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        from symgraph.files import write_text_atomic  # late: symgraph is imported where it is used
        write_text_atomic(args.out, text + "\n")
    print(text, flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
