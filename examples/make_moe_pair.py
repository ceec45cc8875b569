"""Write two independently initialised mixture-of-experts decoders at a large model's widths; print JSON.

    python examples/make_moe_pair.py [--out /work/bigmoe] [--model-type qwen3_moe] [--layers 2]

Writes ``A`` (seed 0) and ``B`` (seed 1) under OUT as transformers saves them (``save_pretrained``: bf16 sharded
safetensors, each expert's matrices stored apart, as the hub's MoE checkpoints are), for streamed-alignment
benchmarks (``examples/bench_7b_align.py OUT/B OUT/A``). The default sizes are Qwen3-30B-A3B's (d 2048, 32 query
and 4 KV heads of 128, 128 experts of 768 hidden units, 8 routed per token, vocab 151936) at ``--layers`` of its
48 layers: about 1.5B parameters at 2 layers. Weights are transformers' own initialisation (N(0, 0.02)) of a model
built in bf16, one model in memory at a time. When both are written, OUT/READY (JSON) says what they are.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from symgraph.files import write_text_atomic

QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                     vocab_size=151936, decoder_sparse_step=1, tie_word_embeddings=False)


def main(argv=None) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/work/bigmoe"))
    parser.add_argument("--model-type", default="qwen3_moe")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shard-size", default="2GB")
    parser.add_argument("--sizes", type=json.loads, default=QWEN3_30B_A3B,
                        help="config values as JSON (default: Qwen3-30B-A3B's)")
    args = parser.parse_args(argv)
    config = AutoConfig.for_model(args.model_type, num_hidden_layers=args.layers, **args.sizes)
    report = {"model_type": args.model_type, "layers": args.layers, "sizes": args.sizes, "models": {}}
    for name, seed in (("A", 0), ("B", 1)):
        clock = time.perf_counter()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(args.out / name, max_shard_size=args.shard_size)
        report["models"][name] = {"seed": seed, "parameters": sum(p.numel() for p in model.parameters()),
                                  "seconds": round(time.perf_counter() - clock, 1)}
        del model
    write_text_atomic(args.out / "READY", json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
