"""Held-out twins: pairs no default was measured on, to see whether the shipped pairs' figures generalise. Prints JSON.

Every default of full mode (the judge, the rise that starts the short learning, its steps, ...) was chosen on the
shipped and wide pairs. This study trains twins of architectures and recipes outside them, the way
``examples/train_models.py`` trains its pairs (AdamW, warm-up and cosine decay, one thread, deterministic), with
seeds 11 and 12, into a cache (``$SYMGRAPH_HELDOUT_MODELS``, default ``~/.cache/symgraph/heldout-v4``; a few
minutes a model on one thread), then measures the loss barrier of every mode asked for on the test split (B
aligned to A, folded as ``barrier`` folds)::

    python examples/study_heldout_pairs.py --pairs gpt2-chars,vit4-digits --modes none,permutation,full
    python examples/study_heldout_pairs.py --pairs gpt2-chars,llama-mha-chars,phi-chars,vit4-digits \
        --out examples/results/heldout_pairs.json
    python examples/study_heldout_pairs.py --pairs mixtral-chars,qwen2-chars,distilbert-topics,gemma2-chars,neox-chars \
        --out examples/results/heldout_pairs_2.json
    python examples/study_heldout_pairs.py --pairs opt-chars,falcon-chars,bloom-chars,olmo2-chars \
        --out examples/results/heldout_pairs_3.json
    python examples/study_heldout_pairs.py --pairs swin-digits,deberta-topics,granite-chars,stablelm-chars \
        --out examples/results/heldout_pairs_4.json

Pairs: ``gpt2-chars`` (GPT-2: pre-LayerNorm, learned positions, Conv1D, tied LM head), ``llama-mha-chars`` (LLaMA of
width 96, 2 layers, 6 heads without grouping, tied LM head), ``phi-chars`` (Phi: parallel attention and MLP, half
the head rotary, LayerNorm), ``vit4-digits`` (ViT of width 64, 4 layers, 2 heads, no query/key/value bias).
Second round, kinds none of the defaults was tuned on: ``mixtral-chars`` (Mixtral: 4 experts, top-2 router, so
expert permutations between models trained apart), ``qwen2-chars`` (Qwen2: 4 query heads sharing 2 key/value
heads, query/key/value biases), ``distilbert-topics`` (DistilBERT classifier: post-LayerNorm, so nothing folds, and
a ReLU pre-classifier), ``gemma2-chars`` (Gemma 2: norms that scale by 1 + weight, a norm after each sublayer as well
as before, attention and final logit soft-capping, scaled and tied embeddings), ``neox-chars`` (GPT-NeoX: one
fused query/key/value projection with heads interleaved, parallel attention and MLP with a LayerNorm each, a quarter
of each head rotary). Third round: ``opt-chars`` (OPT: ReLU FFN, learned positions read at an offset of 2, biases
everywhere, a final LayerNorm), ``falcon-chars`` (Falcon: multi-query attention, one fused query/key/value
projection, attention and MLP in parallel from one LayerNorm, no biases), ``bloom-chars`` (BLOOM: ALiBi instead of
positions, a LayerNorm on the embeddings, fused query/key/value with heads interleaved, GELU), ``olmo2-chars``
(OLMo 2: RMSNorms on queries and keys across all heads, norms after each sublayer and none before). Fourth round:
``swin-digits`` (Swin: attention within 2x2 windows, shifted every other block, a relative position bias table per
head, patch merging between stages), ``deberta-topics`` (DeBERTa-v2 classifier: post-LayerNorm, disentangled attention
through relative position embeddings shared by all layers and projected by each layer's query and key projections, no
absolute positions), ``granite-chars`` (Granite: embedding, residual and attention multipliers, logits divided by a
scale), ``stablelm-chars`` (StableLM: a LayerNorm per head on queries and keys, a quarter of each head rotary,
query/key/value biases).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_models  # noqa: E402  (the shipped pairs' training loop, reused)

from symgraph.datasets import TOPIC_CLASSES, char_vocabulary, load_data  # noqa: E402
from symgraph.io import write_text_atomic  # noqa: E402

SEEDS = {"a": 11, "b": 12}
TEXTBOOK = "textbook"  # a mode of --modes: textbook weight matching (paper_experiments.textbook_curve)
CACHE = Path(os.environ.get("SYMGRAPH_HELDOUT_MODELS", Path.home() / ".cache" / "symgraph" / "heldout-v4"))
# v4: the fourth round's kinds joined; the earlier rounds' train as in v1-v3 (same recipes, deterministic)
CHARS = dict(vocab_size=len(char_vocabulary()), max_position_embeddings=train_models.WINDOW, pad_token_id=0,
             bos_token_id=None, eos_token_id=None)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=CHARS["vocab_size"], n_positions=train_models.WINDOW, n_embd=64,
                                      n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0))


def _llama_mha():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=6, tie_word_embeddings=True,
                                        **CHARS))


def _phi():
    from transformers import PhiConfig, PhiForCausalLM

    return PhiForCausalLM(PhiConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                                    partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                    **CHARS))


def _vit4():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=256, qkv_bias=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=10, id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)}))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, tie_word_embeddings=False, **CHARS))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                        **CHARS))


def _distilbert():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    return DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=CHARS["vocab_size"], dim=64, n_layers=3, n_heads=4, hidden_dim=128, max_position_embeddings=160,
        dropout=0.1, attention_dropout=0.0, seq_classif_dropout=0.1, pad_token_id=0,
        num_labels=len(TOPIC_CLASSES), id2label=dict(enumerate(TOPIC_CLASSES)),
        label2id={c: i for i, c in enumerate(TOPIC_CLASSES)}))


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          query_pre_attn_scalar=16, sliding_window=train_models.WINDOW,
                                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                          tie_word_embeddings=True, **CHARS))


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                            num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=True,
                                            hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
                                            **CHARS))


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                                    word_embed_proj_dim=64, do_layer_norm_before=True, activation_function="relu",
                                    dropout=0.0, attention_dropout=0.0, layerdrop=0.0, tie_word_embeddings=False,
                                    **CHARS))


def _falcon():
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                                          bias=False, alibi=False, hidden_dropout=0.0, attention_dropout=0.0,
                                          tie_word_embeddings=False, **CHARS))


def _bloom():
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0,
                                        attention_dropout=0.0, tie_word_embeddings=False, **CHARS))


def _olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                                        **CHARS))


def _swin():
    from transformers import SwinConfig, SwinForImageClassification

    return SwinForImageClassification(SwinConfig(
        image_size=8, patch_size=2, num_channels=1, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=2,
        mlp_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=10,
        id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)}))


def _deberta():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    return DebertaV2ForSequenceClassification(DebertaV2Config(
        vocab_size=CHARS["vocab_size"], hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=160, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0,
        pad_token_id=0, relative_attention=True, position_buckets=32, max_relative_positions=-1,
        pos_att_type=["p2c", "c2p"], position_biased_input=False, share_att_key=True, norm_rel_ebd="layer_norm",
        type_vocab_size=0, num_labels=len(TOPIC_CLASSES), id2label=dict(enumerate(TOPIC_CLASSES)),
        label2id={c: i for i, c in enumerate(TOPIC_CLASSES)}))


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    return GraniteForCausalLM(GraniteConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=4.0,
                                            residual_multiplier=0.5, attention_multiplier=0.0625, logits_scaling=2.0,
                                            tie_word_embeddings=False, **CHARS))


def _stablelm():
    from transformers import StableLmConfig, StableLmForCausalLM

    return StableLmForCausalLM(StableLmConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=4, partial_rotary_factor=0.25,
                                              qk_layernorm=True, use_qkv_bias=True, hidden_dropout=0.0,
                                              attention_dropout=0.0, tie_word_embeddings=False, **CHARS))


# pair -> (builder, the training loop's family: data, steps, learning rate, batch)
PAIRS = {
    "gpt2-chars": (_gpt2, train_models.Family("gpt2-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "llama-mha-chars": (_llama_mha, train_models.Family("llama-mha-chars", "pydoc-chars", steps=1000, lr=2e-3,
                                                        batch=32)),
    "phi-chars": (_phi, train_models.Family("phi-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "vit4-digits": (_vit4, train_models.Family("vit4-digits", "digits", steps=2000, lr=1e-3, batch=64)),
    "mixtral-chars": (_mixtral, train_models.Family("mixtral-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "qwen2-chars": (_qwen2, train_models.Family("qwen2-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    # at the shipped BERT's recipe (400 steps at 2e-3) seed 11 learned nothing (test accuracy 0.30, loss 1.35);
    # at 1e-3 for 600 steps both seeds reach 0.50 (loss 1.10 / 1.09)
    "distilbert-topics": (_distilbert, train_models.Family("distilbert-topics", "pydoc-topics", steps=600, lr=1e-3,
                                                           batch=32, weight_decay=0.1)),
    "gemma2-chars": (_gemma2, train_models.Family("gemma2-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "neox-chars": (_neox, train_models.Family("neox-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "opt-chars": (_opt, train_models.Family("opt-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "falcon-chars": (_falcon, train_models.Family("falcon-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "bloom-chars": (_bloom, train_models.Family("bloom-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "olmo2-chars": (_olmo2, train_models.Family("olmo2-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "swin-digits": (_swin, train_models.Family("swin-digits", "digits", steps=2000, lr=1e-3, batch=64)),
    "deberta-topics": (_deberta, train_models.Family("deberta-topics", "pydoc-topics", steps=600, lr=1e-3, batch=32,
                                                     weight_decay=0.1)),
    "granite-chars": (_granite, train_models.Family("granite-chars", "pydoc-chars", steps=1200, lr=3e-3, batch=32)),
    "stablelm-chars": (_stablelm, train_models.Family("stablelm-chars", "pydoc-chars", steps=1200, lr=3e-3,
                                                      batch=32)),
}
for _name, (_build, _family) in PAIRS.items():  # the training loop finds a family's builder, batches and task
    train_models.BUILDERS[_name] = _build
    train_models.SAMPLERS[_name] = {"digits": train_models._digit_batches, "pydoc-chars": train_models._char_windows,
                                    "pydoc-topics": train_models._topic_batches}[_family.data]
    train_models.TASKS[_name] = "causal_lm" if _family.data == "pydoc-chars" else "classification"


def trained(pair: str, root: Path) -> tuple[Path, Path]:
    """The pair's folders under ``root``, trained there first where missing (deterministic)."""
    _, family = PAIRS[pair]
    folders = tuple(root / f"{pair}-{suffix}" for suffix in SEEDS)
    torch.set_num_threads(1)
    for folder, seed in zip(folders, SEEDS.values()):
        if (folder / "config.json").is_file():
            continue
        print(f"training {folder.name} (seed {seed})", file=sys.stderr, flush=True)
        torch.use_deterministic_algorithms(True)
        model = train_models.train(family, seed)
        train_models.save(model, folder, char_tokenizer=family.data != "digits")
    return folders


def measure(pair: str, modes: tuple[str, ...], points: int, root: Path) -> dict:
    import symgraph
    from symgraph.connectivity import barrier

    folders = trained(pair, root)
    a, b = (symgraph.load(f) for f in folders)
    _, family = PAIRS[pair]
    test = load_data(family.data, model=a, split="test", batch_size=64)
    clock = time.perf_counter()
    result = barrier(a, b, test, steps=points, aligns=tuple(m for m in modes if m != TEXTBOOK), progress=False,
                     align_options={"align_data": family.data})
    if TEXTBOOK in modes:  # the floor of permutation mode's distance, measured as paper_experiments measures it
        from paper_experiments import textbook_curve

        textbook = textbook_curve(SimpleNamespace(a=a, b=b, test=test), SimpleNamespace(steps=points))
        result.curves[TEXTBOOK] = SimpleNamespace(loss_barrier=textbook["loss_barrier"], distance=textbook["distance"],
                                                  align_seconds=textbook["align_seconds"], alignment=None)
    none = result.curves["none"].loss_barrier if "none" in result.curves else None
    rows = {}
    for mode, curve in result.curves.items():
        alignment = curve.alignment or {}
        rows[mode] = {"barrier": round(curve.loss_barrier, 4),
                      "of_unaligned": None if not none else round(curve.loss_barrier / none, 3),
                      "align_seconds": round(curve.align_seconds, 1), "distance": round(curve.distance, 4),
                      "start": alignment.get("start"), "path_losses": alignment.get("path_losses"),
                      "learned_on": (alignment.get("learned") or {}).get("data")}
    first = next(iter(result.curves.values())).losses
    return {"data": family.data, "endpoint_losses": [round(first[0], 4), round(first[-1], 4)], "modes": rows,
            "seconds": round(time.perf_counter() - clock, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {', '.join(PAIRS)}")
    parser.add_argument("--modes", default="none,permutation,full,full+data,textbook",
                        help="barrier modes (symgraph barrier --align, and textbook), comma-separated")
    parser.add_argument("--points", type=int, default=11, help="points along the path")
    parser.add_argument("--root", type=Path, default=CACHE, help=f"model cache (default {CACHE})")
    parser.add_argument("--out", type=Path, help="also write the JSON here (atomically)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pairs = args.pairs.split(",")
    unknown = sorted(set(pairs) - set(PAIRS))
    if unknown:
        parser.error(f"unknown pairs {unknown}; choose from {', '.join(PAIRS)}")
    out = {"seeds": SEEDS, "modes": args.modes.split(","), "points": args.points,
           "pairs": {pair: measure(pair, tuple(args.modes.split(",")), args.points, args.root) for pair in pairs}}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        write_text_atomic(args.out, text + "\n")


if __name__ == "__main__":
    main()
