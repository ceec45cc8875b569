"""Write the embedded demo pair: two independently initialised tiny LLaMA-style models (RoPE, GQA, SwiGLU,
RMSNorm), saved as Hugging Face folders under symgraph/data/demo. Deterministic: same files every run.

    python examples/make_demo_models.py
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

OUT = Path(__file__).resolve().parent.parent / "symgraph" / "data" / "demo"
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=128, tie_word_embeddings=False)


def main() -> None:
    for name, seed in (("llama-a", 1), ("llama-b", 2)):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
        with torch.no_grad():  # norm weights away from exactly 1, so they are real parameters in the demo
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.mul_(1 + 0.1 * torch.randn_like(p))
        model.save_pretrained(OUT / name)
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
