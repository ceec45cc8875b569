"""Tiny random models, one per architecture family, for tests and hypothesis strategies.

Every Hugging Face family is a real ``transformers`` config (``AutoConfig.for_model``) shrunk to a few thousand
parameters, built with its natural task head so that outputs are logits. Weights are deterministic in ``seed``,
and every parameter gets independent noise after the library's own init, so no norm weight is exactly 1 and no
bias exactly 0 (a symmetry test would otherwise be fooled by weights that happen to be invariant).

Choices that matter for symmetry analysis:

* ``llama`` unties the LM head from the embeddings (``tie_word_embeddings=False``); ``llama-tied`` ties them,
  so the residual-stream rotation must act on one shared matrix from both sides.
* ``gptj`` rotates 8 of 16 head dims with interleaved pairs (2i, 2i+1); ``gpt-neox`` (``rotary_pct=0.5``) and
  ``phi`` (``partial_rotary_factor=0.5``) rotate half with rotate-half pairs (i, i+r/2): partial RoPE both ways.
* ``llama``, ``mistral``, ``qwen2``, ``qwen3`` use grouped-query attention (4 query heads, 2 key/value heads);
  ``qwen2`` has q/k/v biases, ``qwen3`` per-head RMSNorm on q and k.
* ``deberta-v2`` has relative attention with c2p and p2c terms and unshared position projections
  (``share_att_key=False``, so ``pos_key_proj`` / ``pos_query_proj`` exist).
* ``t5`` is T5 v1.0: ReLU FFN, relative attention bias in layer 0 of each stack, tied and rescaled LM head.
* ``mixtral``, ``qwen2-moe``, ``olmoe``, ``deepseek-v2`` and ``gpt-oss`` are mixtures of 4 experts with 2 per
  token (see :mod:`symgraph.moe`); ``qwen2-moe`` and ``deepseek-v2`` add a shared expert, ``deepseek-v2`` has
  one dense first layer and multi-head latent attention, ``olmoe`` full-width q/k norms, ``gpt-oss`` expert biases,
  a router bias, a clamped SwiGLU and attention sinks.
* ``clip`` uses ``eos_token_id=2``, so the text tower pools at the argmax token id (an ``argmax`` in the graph).
* ``torch-*`` families are plain ``torch.nn`` modules that take one float tensor of shape (batch, seq, 32).

Examples
--------
>>> model = build("llama")
>>> args, kwargs = example_inputs_for("llama", model)
>>> tuple(model(*args, **kwargs).logits.shape)
(2, 7, 100)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .errors import ModelLoadError
from .inputs import example_inputs, forward_kwargs
from .moe import DENSE, use_experts_implementation

__all__ = ["FAMILIES", "HF_FAMILIES", "TORCH_FAMILIES", "build", "example_inputs_for", "tiny_config"]

D_MODEL_TORCH = 32  # width of the plain torch families' inputs

_NOISE_MATRIX = 0.02  # std of the noise added to every parameter with 2+ dims (init std is 0.02 too)
_NOISE_VECTOR = 0.1  # std of the noise added to norm weights/biases and all biases


@dataclass(frozen=True)
class _HFFamily:
    model_type: str
    head: str  # name of the transformers Auto class that builds it
    config: dict[str, Any] = field(default_factory=dict)


_BASE = dict(vocab_size=100, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
_ENCODER = dict(_BASE, hidden_size=32, intermediate_size=64, num_labels=3)
_ROPE = dict(_BASE, hidden_size=64, intermediate_size=128)  # head dim 16: room for partial rotary
_GQA = dict(_ROPE, num_key_value_heads=2, tie_word_embeddings=False)
_MOE = dict(_GQA, intermediate_size=32, num_experts_per_tok=2)  # 4 experts of 32 units, 2 per token

_HF: dict[str, _HFFamily] = {
    "bert": _HFFamily("bert", "AutoModelForSequenceClassification", _ENCODER),
    "roberta": _HFFamily("roberta", "AutoModelForSequenceClassification", _ENCODER),
    "distilbert": _HFFamily("distilbert", "AutoModelForSequenceClassification", dict(
        vocab_size=100, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64, num_labels=3)),
    "deberta-v2": _HFFamily("deberta-v2", "AutoModelForSequenceClassification", dict(
        _ENCODER, relative_attention=True, pos_att_type=["c2p", "p2c"], position_buckets=8,
        max_relative_positions=-1, share_att_key=False)),
    "vit": _HFFamily("vit", "AutoModelForImageClassification", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=4, num_channels=3, num_labels=3)),
    "gpt2": _HFFamily("gpt2", "AutoModelForCausalLM", dict(
        vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64, bos_token_id=0, eos_token_id=0)),
    "gptj": _HFFamily("gptj", "AutoModelForCausalLM", dict(
        vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=64, rotary_dim=8,
        bos_token_id=0, eos_token_id=0)),
    "gpt-neox": _HFFamily("gpt_neox", "AutoModelForCausalLM", dict(_ROPE, rotary_pct=0.5)),
    "llama": _HFFamily("llama", "AutoModelForCausalLM", _GQA),
    "llama-tied": _HFFamily("llama", "AutoModelForCausalLM", dict(_GQA, tie_word_embeddings=True)),
    "mistral": _HFFamily("mistral", "AutoModelForCausalLM", _GQA),
    "qwen2": _HFFamily("qwen2", "AutoModelForCausalLM", _GQA),
    "qwen3": _HFFamily("qwen3", "AutoModelForCausalLM", dict(_GQA, head_dim=16)),
    "phi": _HFFamily("phi", "AutoModelForCausalLM", dict(_ROPE, partial_rotary_factor=0.5)),
    "t5": _HFFamily("t5", "AutoModelForSeq2SeqLM", dict(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0)),
    "bart": _HFFamily("bart", "AutoModelForSeq2SeqLM", dict(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
    "opt": _HFFamily("opt", "AutoModelForCausalLM", dict(
        vocab_size=100, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64)),
    "mixtral": _HFFamily("mixtral", "AutoModelForCausalLM", dict(_MOE, num_local_experts=4)),
    "qwen2-moe": _HFFamily("qwen2_moe", "AutoModelForCausalLM", dict(
        _MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True)),
    "olmoe": _HFFamily("olmoe", "AutoModelForCausalLM", dict(_MOE, num_experts=4, eos_token_id=2)),
    "deepseek-v2": _HFFamily("deepseek_v2", "AutoModelForCausalLM", dict(
        _MOE, num_key_value_heads=4, n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=16, topk_method="greedy")),
    "gpt-oss": _HFFamily("gpt_oss", "AutoModelForCausalLM", dict(
        _MOE, num_local_experts=4, head_dim=16, sliding_window=4,  # layer_types: sliding and full in turn
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=2.0, original_max_position_embeddings=32,
                             beta_fast=32.0, beta_slow=1.0, truncate=False))),
    "clip": _HFFamily("clip", "AutoModel", dict(
        projection_dim=16,
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4))),
}


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` used as self-attention on batch-first input."""

    def __init__(self, d_model: int = D_MODEL_TORCH, nhead: int = 4):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def _relu_mlp() -> nn.Module:
    d = D_MODEL_TORCH
    return nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, d))


_TORCH: dict[str, Callable[[], nn.Module]] = {
    "torch-encoder-layer": lambda: nn.TransformerEncoderLayer(
        D_MODEL_TORCH, 4, dim_feedforward=64, dropout=0.0, batch_first=True),
    "torch-mha": SelfAttention,
    "torch-relu-mlp": _relu_mlp,
}

HF_FAMILIES: tuple[str, ...] = tuple(_HF)
TORCH_FAMILIES: tuple[str, ...] = tuple(_TORCH)
FAMILIES: tuple[str, ...] = HF_FAMILIES + TORCH_FAMILIES


def tiny_config(family: str, **overrides: Any):
    """The tiny ``transformers.PretrainedConfig`` of a Hugging Face family; ``overrides`` replace its fields.

    Examples
    --------
    >>> cfg = tiny_config("llama", num_hidden_layers=1)
    >>> (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers)
    (64, 4, 2, 1)
    """
    from transformers import AutoConfig

    spec = _hf_family(family)
    return AutoConfig.for_model(spec.model_type, **{**spec.config, **overrides})


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> nn.Module:
    """A tiny model of ``family`` in eval mode, with weights fixed by ``seed``.

    ``overrides`` go to :func:`tiny_config` (Hugging Face families only). Weights are drawn in float32 and then
    cast to ``dtype``, so one seed gives the same function in every dtype.

    Examples
    --------
    >>> a, b = build("torch-relu-mlp", seed=1), build("torch-relu-mlp", seed=1)
    >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    True
    """
    if family in _TORCH and overrides:
        raise ModelLoadError(f"Family {family!r} is a plain torch module and takes no config overrides "
                             f"(got {sorted(overrides)}).")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _TORCH[family]() if family in _TORCH else _build_hf(family, **overrides)
        _perturb(model, torch.Generator().manual_seed(seed + 1))
    # experts in dense form: exportable by plain torch.export and runnable in float64 (transformers' default
    # grouped_mm has no float64 kernel); symgraph itself picks the routine it needs whatever the model uses
    return use_experts_implementation(model, DENSE).to(dtype).eval()


def example_inputs_for(family: str, model: nn.Module, batch: int = 2, seq: int = 7,
                       seed: int = 0) -> tuple[tuple, dict]:
    """``(args, kwargs)`` to call (or export) ``model``, a model of ``family``; float inputs follow its dtype.

    Examples
    --------
    >>> args, kwargs = example_inputs_for("torch-mha", build("torch-mha"))
    >>> tuple(args[0].shape), kwargs
    ((2, 7, 32), {})
    """
    param = next(model.parameters())
    if family in _TORCH:
        x = torch.randn(batch, seq, D_MODEL_TORCH, generator=torch.Generator().manual_seed(seed))
        return (x.to(device=param.device, dtype=param.dtype),), {}
    _hf_family(family)
    config = model.config
    tensors = example_inputs(config, batch=batch, seq=seq, seed=seed, device=param.device, dtype=param.dtype)
    return (), {**tensors, **forward_kwargs(config)}


def _hf_family(family: str) -> _HFFamily:
    if family not in _HF:
        kind = "a plain torch module without a config" if family in _TORCH else "not a zoo family"
        raise ModelLoadError(f"{family!r} is {kind}.", hint=f"use one of: {', '.join(HF_FAMILIES)}.")
    return _HF[family]


def _build_hf(family: str, **overrides: Any) -> nn.Module:
    import transformers

    auto = getattr(transformers, _HF[family].head)
    config = tiny_config(family, **overrides)
    try:
        return auto.from_config(config, attn_implementation="sdpa")
    except ValueError:  # the architecture has no SDPA path (e.g. GPT-J): use its eager attention
        return auto.from_config(config, attn_implementation="eager")


@torch.no_grad()
def _perturb(model: nn.Module, generator: torch.Generator) -> None:
    for param in model.parameters():
        std = _NOISE_MATRIX if param.dim() >= 2 else _NOISE_VECTOR
        param.add_(std * torch.randn(param.shape, generator=generator, dtype=param.dtype))
