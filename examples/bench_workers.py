"""N-model consensus alignment in this process and on Ray (``--workers ray``): per-job time, totals, the Ray
overhead, and whether both give the same states; prints JSON.

The models are independent random initialisations of one LLaMA-style config (``--hidden``, ``--layers``; FFN
width 2.75 x hidden, vocabulary 4096, untied head), written as Hugging Face folders, so each Ray job reads its
model from its own folder as it would on a cluster. The Ray cluster is a local one started for the run (or the
one ``RAY_ADDRESS`` names); the Ray consensus runs twice, cold (worker processes start) and warm. ``job_seconds`` are measured where each job ran: in process, the solve only; on Ray,
reading the model from its folder, re-applying earlier rounds' elements and solving.

Examples::

    python examples/bench_workers.py --models 3 --hidden 128 --layers 2      # smoke run
    python examples/bench_workers.py --models 4 --hidden 512 --layers 4 --mode permutation
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build(folder: Path, models: int, hidden: int, layers: int) -> list[Path]:
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=int(2.75 * hidden) // 8 * 8,
                                      num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 2),
                                      num_key_value_heads=max(hidden // 256, 1), vocab_size=4096,
                                      tie_word_embeddings=False)
    paths = []
    for seed in range(models):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():  # norm weights away from 1, as in a trained model (no fold, no orthogonal stream)
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(folder / f"m{seed}")
        paths.append(folder / f"m{seed}")
    return paths


def run(paths: list[Path], mode: str, workers: str) -> dict:
    import symgraph
    from symgraph.consensus import align_to_consensus

    clock = time.perf_counter()
    subjects = [symgraph.load(str(p)) for p in paths]
    plan_clock = time.perf_counter()
    subjects[0].report  # analysis: once, in this process, in both runs
    analyse = time.perf_counter() - plan_clock
    result = align_to_consensus(subjects, [1.0] * len(subjects), mode=mode, progress=False, workers=workers)
    jobs = result.job_seconds
    print(f"{workers}: {result.seconds:.1f} s, {len(jobs)} jobs", file=sys.stderr, flush=True)
    return {"workers": workers, "load_and_analyse_s": round(plan_clock - clock + analyse, 2),
            "consensus_s": round(result.seconds, 2), "rounds": result.rounds, "jobs": len(jobs),
            "job_seconds": [round(s, 3) for s in jobs],
            "job_median_s": round(statistics.median(jobs), 3) if jobs else None,
            "distance_before": result.distances_before, "distance_after": result.distances,
            "_states": result.states}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mode", default="permutation", choices=["full", "paper", "permutation"])
    parser.add_argument("--out", type=Path, help="Also write the JSON here.")
    args = parser.parse_args(argv)
    import torch

    import ray

    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp), args.models, args.hidden, args.layers)
        params = sum(t.numel() for t in symgraph_state(paths[0]).values())
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)  # kept for both Ray runs
        runs = [run(paths, args.mode, w) for w in ("local", "ray", "ray")]  # the second Ray run: warm workers
        ray.shutdown()
    runs[1]["note"], runs[2]["note"] = "cold: worker processes start and import torch", "warm workers"
    same = all(torch.equal(a[k], b[k]) for r in runs[1:]
               for a, b in zip(runs[0]["_states"], r["_states"]) for k in a)
    for r in runs:
        del r["_states"]
    out = {"models": args.models, "hidden": args.hidden, "layers": args.layers, "parameters_per_model": params,
           "mode": args.mode, "torch_threads": torch.get_num_threads(), "identical_states": same, "runs": runs}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        from symgraph.files import write_text_atomic  # late: symgraph is imported where it is used
        write_text_atomic(args.out, text + "\n")


def symgraph_state(path: Path) -> dict:
    import symgraph

    return symgraph.load(str(path)).state_dict()


if __name__ == "__main__":
    sys.exit(main())
