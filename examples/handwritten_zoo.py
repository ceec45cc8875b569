"""Hand-written PyTorch models for examples/sweep_handwritten.py: patterns users write that no transformers model
type may show (torch.nn's own transformer layers, einsum attention, rotary written three ways, ALiBi, sinks,
shared layers, layer scale, GLUs with fused projections, patch stems, grouped linears, MoE written five ways).

Every entry is ``ZooEntry(name, build, inputs, expect)``: ``build()`` returns the module (parameters at their
initial values; the sweep adds noise), ``inputs(batch, length, pad)`` its keyword inputs at one shape (float32;
``pad``: a padding mask where the model takes one), and ``expect`` the motifs whose groups obviously exist.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

D, H, FF, V = 32, 4, 48, 64  # width, heads, FFN hidden units, vocabulary
DH = D // H
CLASSES = 3


@dataclass(frozen=True)
class ZooEntry:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int, bool], dict]
    expect: frozenset[str]


# -- inputs ------------------------------------------------------------------------------------------------------
def _generator(batch: int, length: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * batch + length)


def tokens(batch: int, length: int, pad: bool) -> dict:
    ids = torch.randint(0, V, (batch, length), generator=_generator(batch, length))
    if not pad:
        return {"ids": ids}
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length - length // 3:] = 0  # the first row's last third is padding
    return {"ids": ids, "mask": mask}


def tokens_only(batch: int, length: int, pad: bool) -> dict:
    return tokens(batch, length, False)


def tokens_and_memory(batch: int, length: int, pad: bool) -> dict:
    g = _generator(batch, length)
    return {**tokens(batch, length, False), "keys": torch.randn(batch, length + 2, 24, generator=g),
            "values": torch.randn(batch, length + 2, 20, generator=g)}


def image(batch: int, length: int, pad: bool) -> dict:
    """Images whose side grows with ``length`` (convolutional models take any size)."""
    side = 2 * length + 2
    return {"pixels": torch.randn(batch, 3, side, side, generator=_generator(batch, length))}


def fixed_image(batch: int, length: int, pad: bool) -> dict:
    """16 x 16 images (models with a fixed number of patches: only the batch varies)."""
    return {"pixels": torch.randn(batch, 3, 16, 16, generator=_generator(batch, length))}


def audio(batch: int, length: int, pad: bool) -> dict:
    return {"wave": torch.randn(batch, 1, 4 * length, generator=_generator(batch, length))}


# -- pieces ------------------------------------------------------------------------------------------------------
class RMSNormByHand(nn.Module):
    def __init__(self, dim: int = D, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind: str) -> nn.Module:
    return {"rms": RMSNormByHand, "ln": lambda: nn.LayerNorm(D),
            "ln_plain": lambda: nn.LayerNorm(D, elementwise_affine=False)}[kind]()


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)


def angles(n: int, dims: int, like: torch.Tensor) -> torch.Tensor:
    """(n, dims / 2) rotation angles, one frequency per pair."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dims, 2, dtype=like.dtype) / dims)
    return torch.arange(n, dtype=like.dtype)[:, None] * inv_freq[None]


def rope(x, kind: str):
    """Rotary embedding of (b, h, n, d) queries or keys, written the way ``kind`` names."""
    n = x.shape[-2]
    if kind == "half":
        a = angles(n, DH, x).repeat(1, 2)
        return x * a.cos() + rotate_half(x) * a.sin()
    if kind == "interleaved":  # GPT-J: pairs (2i, 2i + 1)
        a = angles(n, DH, x).repeat_interleave(2, -1)
        return x * a.cos() + rotate_every_two(x) * a.sin()
    if kind == "partial":  # rotary on the first half of each head, the rest passes
        r = DH // 2
        a = angles(n, r, x).repeat(1, 2)
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat((rot * a.cos() + rotate_half(rot) * a.sin(), rest), -1)
    if kind == "complex":  # Meta LLaMA: pairs as complex numbers
        a = angles(n, DH, x)
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(a), a)).flatten(-2)
    raise ValueError(kind)


def alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])


class Attention(nn.Module):
    """Self-attention with the options users combine: how q, k, v are projected and split, GQA, rotary, the
    logit bias or mask, and the attention core (SDPA, einsum, softmax with a sink logit)."""

    def __init__(self, qkv="separate", kv_heads=H, gqa="sdpa", rotary=None, mask="causal", core="sdpa",
                 qk_norm=None, bias=True):
        super().__init__()
        self.qkv, self.kv_heads, self.gqa, self.rotary, self.mask, self.core = qkv, kv_heads, gqa, rotary, mask, core
        kv = kv_heads * DH
        if qkv == "separate":
            self.q, self.k, self.v = nn.Linear(D, D, bias=bias), nn.Linear(D, kv, bias=bias), nn.Linear(D, kv, bias=bias)
        else:
            self.qkv_proj = nn.Linear(D, D + 2 * kv, bias=bias)
        self.o = nn.Linear(D, D, bias=bias)
        self.qk_norm = qk_norm
        if qk_norm == "head":  # per-head RMSNorm, one weight shared by the heads (Qwen3, OLMoE)
            self.q_norm, self.k_norm = RMSNormByHand(DH), RMSNormByHand(DH)
        elif qk_norm == "width":  # LayerNorm over the whole projection before the split (OLMo2-like)
            self.q_norm, self.k_norm = nn.LayerNorm(D), nn.LayerNorm(kv)
        if core == "sinks":
            self.sinks = nn.Parameter(torch.zeros(H))
        if mask == "alibi":
            self.register_buffer("slopes", alibi_slopes(H))

    def project(self, x):
        b, n, _ = x.shape
        kv = self.kv_heads * DH
        if self.qkv == "separate":
            q, k, v = self.q(x), self.k(x), self.v(x)
        elif self.qkv == "chunk":
            q, k, v = self.qkv_proj(x).split([D, kv, kv], -1)
        else:  # "unbind": one (b, n, 3, h, d) view, equal head counts only
            q, k, v = self.qkv_proj(x).view(b, n, 3, H, DH).permute(2, 0, 3, 1, 4).unbind(0)
            return self.normed(q, k) + (v,)
        if self.qk_norm == "width":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, n, H, DH).transpose(1, 2)
        k, v = (t.view(b, n, self.kv_heads, DH).transpose(1, 2) for t in (k, v))
        return self.normed(q, k) + (v,)

    def normed(self, q, k):
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q, k = rope(q, self.rotary), rope(k, self.rotary)
        return q, k

    def bias(self, n: int, like: torch.Tensor, pad):
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None]
        keep = j <= i if self.mask != "none" else torch.ones(n, n, dtype=torch.bool)
        if self.mask == "window":
            keep = keep & (i - j < 4)
        if pad is not None:
            keep = keep & pad[:, None, None, :].bool()
        bias = torch.zeros(keep.shape, dtype=like.dtype).masked_fill(~keep, float("-inf"))
        if self.mask == "alibi":
            bias = bias + self.slopes.view(-1, 1, 1) * (j - i).to(like.dtype)
        return bias

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = self.project(x)
        if self.kv_heads != H and (self.gqa == "repeat" or self.core != "sdpa"):
            k, v = (t.repeat_interleave(H // self.kv_heads, 1) for t in (k, v))
        if self.core == "sdpa":
            if self.mask == "causal" and pad is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != H)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias(n, x, pad),
                                                     enable_gqa=self.kv_heads != H)
        else:
            scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(DH) + self.bias(n, x, pad)
            if self.core == "sinks":  # gpt-oss: one learned logit per head competes in the softmax, then is dropped
                sink = self.sinks.view(1, H, 1, 1).expand(b, H, n, 1)
                weights = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
            else:
                weights = scores.softmax(-1)
            out = torch.einsum("bhij,bhjd->bhid", weights, v)
        return self.o(out.transpose(1, 2).reshape(b, n, D))


class MLP(nn.Module):
    def __init__(self, kind="gelu"):
        super().__init__()
        self.kind = kind
        if kind in ("swiglu_fused", "geglu_fused"):
            self.gate_up = nn.Linear(D, 2 * FF)
        elif kind in ("reglu", "swiglu"):
            self.gate, self.up = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        else:
            self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)

    def forward(self, x):
        if self.kind in ("swiglu_fused", "geglu_fused"):
            gate, up = self.gate_up(x).chunk(2, -1)
            act = F.silu if self.kind == "swiglu_fused" else F.gelu
            return self.down(act(gate) * up)
        if self.kind in ("reglu", "swiglu"):
            act = F.relu if self.kind == "reglu" else F.silu
            return self.down(act(self.gate(x)) * self.up(x))
        return self.down({"gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh}[self.kind](self.up(x)))


class Block(nn.Module):
    """A pre-norm block; ``parallel``: attention and MLP read one norm and add together (GPT-J, Falcon);
    ``residual_scale``: "layer_scale" (per-channel gamma, CaiT) or "tanh_gate" (a learned scalar gate)."""

    def __init__(self, attn=None, mlp=None, norm="rms", parallel=False, residual_scale=None):
        super().__init__()
        self.attn, self.mlp = attn or Attention(), mlp or MLP()
        self.norm1 = make_norm(norm)
        self.norm2 = None if parallel else make_norm(norm)
        self.residual_scale = residual_scale
        if residual_scale == "layer_scale":
            self.gamma1, self.gamma2 = nn.Parameter(torch.full((D,), 0.1)), nn.Parameter(torch.full((D,), 0.1))
        elif residual_scale == "tanh_gate":
            self.alpha1, self.alpha2 = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(0.5))

    def scaled(self, y, which: int):
        if self.residual_scale == "layer_scale":
            return y * (self.gamma1 if which == 1 else self.gamma2)
        if self.residual_scale == "tanh_gate":
            return torch.tanh(self.alpha1 if which == 1 else self.alpha2) * y
        return y

    def forward(self, x, pad=None):
        if self.norm2 is None:
            h = self.norm1(x)
            return x + self.attn(h, pad) + self.mlp(h)
        x = x + self.scaled(self.attn(self.norm1(x), pad), 1)
        return x + self.scaled(self.mlp(self.norm2(x)), 2)


class LM(nn.Module):
    """Embedding, blocks, final norm, output head (``tied``: the embedding matrix; ``shared``: one block run
    ``depth`` times)."""

    def __init__(self, block: Callable[[], nn.Module], depth=2, norm="rms", tied=False, shared=False):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([block()] if shared else [block() for _ in range(depth)])
        self.depth = depth
        self.norm = make_norm(norm)
        self.tied = tied
        if not tied:
            self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids, mask=None):
        x = self.embed(ids)
        for i in range(self.depth):
            x = self.blocks[i % len(self.blocks)](x, mask)
        x = self.norm(x)
        return F.linear(x, self.embed.weight) if self.tied else self.head(x)


def lm(**block) -> Callable[[], nn.Module]:
    return lambda: LM(lambda: Block(**block), norm=block.get("norm", "rms"))


def lm_with(attention: dict, mlp="gelu", **block) -> Callable[[], nn.Module]:
    return lambda: LM(lambda: Block(Attention(**attention), MLP(mlp), **block), norm=block.get("norm", "rms"))


class Classifier(nn.Module):
    """A bidirectional encoder with a classification head over pooled tokens (mean over unpadded tokens, the
    first token through a tanh pooler, or the last token)."""

    def __init__(self, pool: str):
        super().__init__()
        self.pool = pool
        self.embed, self.pos = nn.Embedding(V, D), nn.Embedding(32, D)
        self.blocks = nn.ModuleList(Block(Attention(mask="none"), MLP("gelu"), norm="ln") for _ in range(2))
        self.norm = nn.LayerNorm(D)
        if pool == "first":
            self.pooler = nn.Linear(D, D)
        self.classify = nn.Linear(D, CLASSES)

    def forward(self, ids, mask=None):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        if self.pool == "mean":
            keep = torch.ones(ids.shape, dtype=x.dtype) if mask is None else mask.to(x.dtype)
            pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        elif self.pool == "first":
            pooled = torch.tanh(self.pooler(x[:, 0]))
        else:
            pooled = x[:, -1]
        return self.classify(pooled)


# -- torch.nn's own transformer modules -------------------------------------------------------------------------
class TorchEncoder(nn.Module):
    def __init__(self, batch_first: bool, norm_first: bool, activation="relu"):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=activation, batch_first=batch_first,
                                           norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)

    def forward(self, ids, mask=None):
        x = self.embed(ids)
        pad = None if mask is None else mask == 0
        if not self.batch_first:
            x = x.transpose(0, 1)
        x = self.encoder(x, src_key_padding_mask=pad)
        if not self.batch_first:
            x = x.transpose(0, 1)
        return self.head(x)


class TorchSeq2Seq(nn.Module):
    """nn.Transformer (encoder and decoder, causal target mask), or a decoder alone over an embedded memory.
    ``say_causal``: pass ``tgt_is_causal=True`` with the mask (without it torch compares the mask with a causal
    one, a data-dependent branch torch.export cannot trace)."""

    def __init__(self, batch_first: bool, norm_first: bool, decoder_only: bool, say_causal: bool = True):
        super().__init__()
        self.batch_first, self.say_causal = batch_first, say_causal
        self.embed, self.memory_embed = nn.Embedding(V, D), nn.Embedding(V, D)
        if decoder_only:
            layer = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
            self.net = nn.TransformerDecoder(layer, 2)
        else:
            self.net = nn.Transformer(D, H, 1, 1, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        tgt, memory = self.embed(ids), self.memory_embed(ids.flip(1))
        if not self.batch_first:
            tgt, memory = tgt.transpose(0, 1), memory.transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=tgt.dtype)
        hint = {"tgt_is_causal": True} if self.say_causal else {}
        if isinstance(self.net, nn.Transformer):
            out = self.net(memory, tgt, tgt_mask=causal, **hint)
        else:
            out = self.net(tgt, memory, tgt_mask=causal, **hint)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out)


class TorchMHA(nn.Module):
    """nn.MultiheadAttention blocks: self-attention (``bias_kv``/``zero_attn`` options) or cross-attention to
    keys and values of other widths (kdim, vdim)."""

    def __init__(self, cross=False, bias_kv=False, zero_attn=False, batch_first=True):
        super().__init__()
        self.cross, self.batch_first = cross, batch_first
        self.embed = nn.Embedding(V, D)
        self.attn = nn.MultiheadAttention(D, H, add_bias_kv=bias_kv, add_zero_attn=zero_attn, batch_first=batch_first,
                                          kdim=24 if cross else None, vdim=20 if cross else None)
        self.norm = nn.LayerNorm(D)
        self.mlp = MLP("relu")
        self.head = nn.Linear(D, V)

    def forward(self, ids, mask=None, keys=None, values=None):
        x = self.embed(ids)
        q = self.norm(x)
        k, v = (keys, values) if self.cross else (q, q)
        pad = None if mask is None or self.cross else mask == 0
        if not self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        a = self.attn(q, k, v, key_padding_mask=pad, need_weights=False)[0]
        x = x + (a if self.batch_first else a.transpose(0, 1))
        return self.head(x + self.mlp(x))


# -- vision and audio stems ---------------------------------------------------------------------------------------
class PatchViT(nn.Module):
    """Conv2d patch stem, class token, learned positions, blocks, first-token head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, D, 4, 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.pos = nn.Parameter(torch.zeros(1, 17, D))
        self.blocks = nn.ModuleList(Block(Attention(mask="none"), MLP("gelu"), norm="ln") for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.classify = nn.Linear(D, CLASSES)

    def forward(self, pixels):
        x = self.stem(pixels).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), 1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.classify(self.norm(x)[:, 0])


class Mixer(nn.Module):
    """MLP-Mixer: token-mixing MLPs across the 16 patches, channel-mixing MLPs, mean pooling."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, D, 4, 4)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(4))
        self.token_mlps = nn.ModuleList(nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16)) for _ in range(2))
        self.channel_mlps = nn.ModuleList(MLP("gelu") for _ in range(2))
        self.classify = nn.Linear(D, CLASSES)

    def forward(self, pixels):
        x = self.stem(pixels).flatten(2).transpose(1, 2)  # (b, 16 patches, D)
        for i in range(2):
            x = x + self.token_mlps[i](self.norms[2 * i](x).transpose(1, 2)).transpose(1, 2)
            x = x + self.channel_mlps[i](self.norms[2 * i + 1](x))
        return self.classify(x.mean(1))


class ConvNeXtBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(D, D, 7, padding=3, groups=D)
        self.norm = nn.LayerNorm(D)
        self.mlp = MLP("gelu")
        self.gamma = nn.Parameter(torch.full((D,), 0.1))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)  # channels last for the norm and the pointwise MLP
        return x + (self.gamma * self.mlp(self.norm(y))).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """Patch stem, depthwise 7x7 convolutions, channels-last LayerNorm, pointwise MLP, layer scale, mean pool."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, D, 2, 2)
        self.blocks = nn.Sequential(ConvNeXtBlock(), ConvNeXtBlock())
        self.norm = nn.LayerNorm(D)
        self.classify = nn.Linear(D, CLASSES)

    def forward(self, pixels):
        return self.classify(self.norm(self.blocks(self.stem(pixels)).mean((2, 3))))


class AudioEncoder(nn.Module):
    """Conv1d patch stem (kernel = stride = 4), a GELU conv, blocks with ALiBi-free bidirectional attention,
    mean pooling."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(1, D, 4, 4)
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.blocks = nn.ModuleList(Block(Attention(mask="none", rotary="half"), MLP("swiglu"), norm="rms")
                                    for _ in range(2))
        self.classify = nn.Linear(D, CLASSES)

    def forward(self, wave):
        x = F.gelu(self.conv(F.gelu(self.stem(wave)))).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.classify(x.mean(1))


class GroupedMLP(nn.Module):
    """Block-diagonal linears: two groups, written as an einsum over a (groups, out, in) weight and as a grouped
    Conv1d."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.w1 = nn.Parameter(torch.randn(2, FF // 2, D // 2) / 4)
        self.w2 = nn.Parameter(torch.randn(2, D // 2, FF // 2) / 5)
        self.conv1 = nn.Conv1d(D, FF, 1, groups=2)
        self.conv2 = nn.Conv1d(FF, D, 1, groups=2)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.embed(ids)
        b, n, _ = x.shape
        h = F.relu(torch.einsum("bngi,goi->bngo", x.view(b, n, 2, D // 2), self.w1))
        x = x + torch.einsum("bngi,goi->bngo", h, self.w2).reshape(b, n, D)
        x = x + self.conv2(torch.tanh(self.conv1(x.transpose(1, 2)))).transpose(1, 2)
        return self.head(x)


class ShapeBranches(nn.Module):
    """Python control flow on the input's shape: sequences longer than 8 go through an extra MLP that shorter
    ones never touch (a trace at length 7 does not see it); the number of blocks run is a Python loop."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(Attention(), MLP("relu")) for _ in range(2))
        self.long_mlp = MLP("relu")
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.embed(ids)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        if ids.shape[1] > 8:
            x = x + self.long_mlp(outputs[0])
        return self.head(x)


# -- mixtures of experts --------------------------------------------------------------------------------------------
class MoELayer(nn.Module):
    """Routed experts written the ways users write them.

    ``router``: "softmax" (probabilities, then top-k, renormalised for k > 1) or "sigmoid" (scores, top-k,
    normalised; DeepSeek-V3); ``form``: "loop" (ModuleList, index_select over the routed tokens, index_add back),
    "dense" (a 3-D weight for all experts, einsum over every expert, routing weights scattered to a dense matrix),
    "bmm" (soft routing: every expert sees every token through bmm, weights from the softmax), "choice" (expert
    choice: each expert takes its top tokens, gather and scatter_add)."""

    def __init__(self, router="softmax", k=2, form="loop", shared=False, experts=4):
        super().__init__()
        self.router_kind, self.k, self.form, self.experts = router, k, form, experts
        self.router = nn.Linear(D, experts, bias=False)
        hidden = FF // 2
        if form == "loop":
            self.expert_mlps = nn.ModuleList(MLP("swiglu") for _ in range(experts))
        else:
            self.w_in = nn.Parameter(torch.randn(experts, D, hidden) / math.sqrt(D))
            self.w_out = nn.Parameter(torch.randn(experts, hidden, D) / math.sqrt(hidden))
        self.shared = MLP("gelu") if shared else None

    def weights(self, x):
        """(tokens, experts) routing weights, zero where an expert is not routed."""
        logits = self.router(x)
        scores = logits.softmax(-1) if self.router_kind == "softmax" else torch.sigmoid(logits)
        top, index = scores.topk(self.k, -1)
        if self.k > 1 or self.router_kind == "sigmoid":
            top = top / top.sum(-1, keepdim=True)
        return torch.zeros_like(scores).scatter(-1, index, top), index

    def forward(self, x):
        b, n, _ = x.shape
        flat = x.reshape(-1, D)
        if self.form == "loop":
            out = self.loop(flat)
        elif self.form == "dense":
            w, _ = self.weights(flat)
            h = F.relu(torch.einsum("td,edh->eth", flat, self.w_in))
            out = torch.einsum("eth,ehd,te->td", h, self.w_out, w)
        elif self.form == "bmm":
            w = self.router(flat).softmax(-1)
            h = F.gelu(torch.bmm(flat.expand(self.experts, -1, -1), self.w_in))
            out = (torch.bmm(h, self.w_out) * w.t()[..., None]).sum(0)
        else:
            out = self.choice(flat)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(b, n, D)

    def loop(self, flat):
        w, index = self.weights(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.expert_mlps):
            rows = (index == e).any(-1).nonzero().squeeze(-1)
            picked = expert(flat.index_select(0, rows)) * w.index_select(0, rows)[:, e:e + 1]
            out = out.index_add(0, rows, picked)
        return out

    def choice(self, flat):
        probs = self.router(flat).softmax(-1)  # (tokens, experts)
        capacity = max(1, flat.shape[0] // 2)
        gate, rows = probs.t().topk(capacity, -1)  # each expert's top tokens
        picked = flat[rows]  # (experts, capacity, D)
        h = F.relu(torch.einsum("ecd,edh->ech", picked, self.w_in))
        y = torch.einsum("ech,ehd->ecd", h, self.w_out) * gate[..., None]
        return torch.zeros_like(flat).index_add(0, rows.reshape(-1), y.reshape(-1, D))


class MoEBlock(Block):
    def __init__(self, **moe):
        super().__init__(Attention(), MoELayer(**moe))


def moe_lm(**moe) -> Callable[[], nn.Module]:
    return lambda: LM(lambda: MoEBlock(**moe))


# -- the zoo --------------------------------------------------------------------------------------------------------
def _entry(name, build, inputs=tokens, expect=("qk", "vo", "heads", "ffn", "residual")):
    return ZooEntry(name, build, inputs, frozenset(expect))


ATTN = ("qk", "vo", "heads")
ZOO = [
    _entry("torch_encoder_postln_batch_first", lambda: TorchEncoder(True, False)),
    _entry("torch_encoder_preln_seq_first", lambda: TorchEncoder(False, True, "gelu")),
    _entry("torch_decoder_preln_batch_first", lambda: TorchSeq2Seq(True, True, True), tokens_only),
    _entry("torch_transformer_postln_seq_first", lambda: TorchSeq2Seq(False, False, False), tokens_only),
    _entry("torch_decoder_mask_without_is_causal", lambda: TorchSeq2Seq(True, False, True, say_causal=False),
           tokens_only),
    _entry("mha_self_batch_first", lambda: TorchMHA()),
    _entry("mha_cross_kdim_vdim", lambda: TorchMHA(cross=True), tokens_and_memory),
    _entry("mha_bias_kv_zero_attn_seq_first", lambda: TorchMHA(bias_kv=True, zero_attn=True, batch_first=False)),
    _entry("sdpa_gqa_causal", lm_with(dict(kv_heads=2), "swiglu")),
    _entry("gqa_repeat_interleave_einsum", lm_with(dict(kv_heads=2, core="einsum"), "swiglu")),
    _entry("einsum_attention_layernorm", lm_with(dict(core="einsum"), "gelu", norm="ln")),
    _entry("fused_qkv_split_half_rotary", lm_with(dict(qkv="chunk", rotary="half"), "swiglu")),
    _entry("fused_qkv_unbind_interleaved_rotary", lm_with(dict(qkv="unbind", rotary="interleaved"), "swiglu")),
    _entry("complex_rotary_meta_llama", lm_with(dict(rotary="complex", bias=False), "swiglu")),
    _entry("partial_rotary", lm_with(dict(rotary="partial"), "gelu")),
    _entry("alibi", lm_with(dict(mask="alibi"), "gelu", norm="ln"), expect=("qk", "vo", "ffn", "residual")),
    _entry("sliding_window_mask", lm_with(dict(mask="window", rotary="half"), "swiglu")),
    _entry("attention_sinks", lm_with(dict(core="sinks", rotary="half"), "swiglu")),
    _entry("qk_norm_per_head", lm_with(dict(qk_norm="head", rotary="half"), "swiglu"),
           expect=("heads", "ffn", "residual")),
    _entry("qk_norm_full_width", lm_with(dict(qk_norm="width"), "swiglu"), expect=("vo", "ffn")),
    _entry("parallel_attention_mlp", lm_with(dict(rotary="interleaved"), "gelu", parallel=True, norm="ln")),
    _entry("shared_block_twice", lambda: LM(lambda: Block(), depth=3, shared=True)),
    _entry("layer_scale", lm_with(dict(), "gelu", residual_scale="layer_scale")),
    _entry("tanh_gated_residual", lm_with(dict(), "gelu", residual_scale="tanh_gate")),
    _entry("layernorm_without_affine", lm_with(dict(), "relu", norm="ln_plain")),
    _entry("geglu_fused_gate_up", lm_with(dict(), "geglu_fused")),
    _entry("reglu", lm_with(dict(), "reglu")),
    _entry("swiglu_fused_gate_up", lm_with(dict(), "swiglu_fused")),
    _entry("tied_embeddings", lambda: LM(lambda: Block(), tied=True)),
    _entry("classifier_mean_pool", lambda: Classifier("mean")),
    _entry("classifier_first_token_pooler", lambda: Classifier("first")),
    _entry("classifier_last_token", lambda: Classifier("last")),
    _entry("vit_conv2d_patch_stem", PatchViT, fixed_image, expect=ATTN + ("ffn", "residual")),
    _entry("mlp_mixer", Mixer, fixed_image, expect=("ffn", "residual")),
    _entry("convnext_depthwise", ConvNeXt, image, expect=("ffn", "residual")),
    _entry("conv1d_audio_stem", AudioEncoder, audio, expect=ATTN + ("ffn",)),
    _entry("grouped_linears", GroupedMLP, tokens_only, expect=("ffn",)),
    _entry("python_shape_branches", ShapeBranches, tokens_only),
    _entry("moe_top1_softmax_loop", moe_lm(k=1), tokens_only, expect=ATTN + ("experts", "ffn", "residual")),
    _entry("moe_top2_softmax_dense_einsum", moe_lm(form="dense"), tokens_only,
           expect=ATTN + ("experts", "ffn", "residual")),
    _entry("moe_sigmoid_shared_expert_loop", moe_lm(router="sigmoid", shared=True), tokens_only,
           expect=ATTN + ("experts", "ffn", "residual")),
    _entry("moe_soft_bmm", moe_lm(form="bmm"), tokens_only, expect=ATTN + ("experts", "ffn", "residual")),
    _entry("moe_expert_choice", moe_lm(form="choice"), tokens_only, expect=ATTN + ("experts", "ffn", "residual")),
]
BY_NAME = {e.name: e for e in ZOO}
