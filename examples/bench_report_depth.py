"""Config-only report of a LLaMA-70B-size config at 8 and 80 layers: time per stage and peak RSS; prints JSON.

The config is LLaMA-2/3-70B's shape (hidden 8192, 64 query / 8 KV heads, SwiGLU 28672, vocab 128256, untied
head, ``LlamaForCausalLM``). Each depth runs in a child process of its own, so its peak RSS (``ru_maxrss``) is
its own. Stages: ``load`` (build on the meta device from config.json), ``analyse`` (capture and analysis; with
repeated blocks only a shallow copy is analysed, see :mod:`symgraph.depth`), ``render_json`` (the report as
JSON, what ``symgraph report --format json`` writes), ``render_markdown`` and ``render_html`` (the other formats,
whose pictures draw each distinct block once). ``--full-depth`` also times the full-depth analysis
(``symgraph report --full-depth``) at the smallest depth, for comparison, and checks that both reports are
byte-identical (``full_depth_report_identical``).

The bar (issue 11): total <= 30 s, peak RSS < 2 GB, 80-layer time <= 2x the 8-layer time.

Examples::

    OMP_NUM_THREADS=1 python examples/bench_report_depth.py
    OMP_NUM_THREADS=1 python examples/bench_report_depth.py --depths 8 80 --full-depth --out depth.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def measure(depth: int, full_depth: bool) -> dict:
    """One config-only report in this process (the child's side)."""
    import resource

    from transformers import LlamaConfig

    import symgraph
    from symgraph.render import render

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama-70b"  # the report names the model after its folder: the same in every run
        LlamaConfig(num_hidden_layers=depth, **LLAMA_70B).save_pretrained(folder)
        clock = time.perf_counter()
        subject = symgraph.load(str(folder / "config.json"), config_only=True, full_depth=full_depth)
        loaded = time.perf_counter()
        report = subject.report
        analysed = time.perf_counter()
        text = render(report, "json")
        done = time.perf_counter()
        render(report, "md")
        as_markdown = time.perf_counter()
        render(report, "html")
        as_html = time.perf_counter()
    return {"layers": depth, "full_depth": full_depth, "load_s": round(loaded - clock, 2),
            "analyse_s": round(analysed - loaded, 2), "render_json_s": round(done - analysed, 2),
            "render_markdown_s": round(as_markdown - done, 2), "render_html_s": round(as_html - as_markdown, 2),
            "total_s": round(done - clock, 2), "groups": len(report.groups), "json_bytes": len(text),
            "json_sha1": hashlib.sha1(text.encode()).hexdigest(),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def run_child(depth: int, full_depth: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", str(depth)] + (["--full-depth"] if full_depth else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the {depth}-layer run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 80])
    parser.add_argument("--full-depth", action="store_true", help="also time the full-depth analysis at the "
                                                                  "smallest depth")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.child, args.full_depth)))
        return
    clock = time.perf_counter()
    runs = [run_child(d, False) for d in sorted(args.depths)]
    if args.full_depth:
        runs.append(run_child(min(args.depths), True))
    by_depth = {r["layers"]: r for r in runs if not r["full_depth"]}
    shallow, deep = by_depth[min(by_depth)], by_depth[max(by_depth)]
    result = {
        "config": {**LLAMA_70B, "layers": sorted(args.depths)},
        "runs": runs,
        "deep_over_shallow_time": round(deep["total_s"] / shallow["total_s"], 2),
        "full_depth_report_identical": next((r["json_sha1"] == by_depth[r["layers"]]["json_sha1"] for r in runs
                                             if r["full_depth"]), None),
        "bar": {"deepest_total_s_max": 30, "peak_rss_mb_max": 2048, "deep_over_shallow_max": 2.0},
        "meets_bar": bool(deep["total_s"] <= 30 and max(r["peak_rss_mb"] for r in runs if not r["full_depth"])
                          < 2048 and deep["total_s"] <= 2 * shallow["total_s"]),
        "wall_s": round(time.perf_counter() - clock, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        from symgraph.files import write_text_atomic  # late: symgraph is imported where it is used
        write_text_atomic(args.out, text + "\n")


if __name__ == "__main__":
    main()
