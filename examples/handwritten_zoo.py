"""Hand-written PyTorch models for examples/sweep_handwritten.py: patterns users write that no transformers model
type may show (torch.nn's own transformer layers, einsum attention, rotary written three ways, ALiBi, sinks,
shared layers, layer scale, GLUs with fused projections, patch stems, grouped linears, MoE written five ways), and
architectures as their reference code writes them (nanoGPT with a fused c_attn and a tied head, timm's ViT with
LayerScale, minGPT with in-place ops, Perceiver latents, Conformer, a U-Net with GroupNorm, an SE net),
reparametrised linears (weight and spectral norm), attention without softmax (linear attention, retention),
RWKV token shift, soft-capping, recurrent layers, relative biases, cosine and gated attention, talking heads,
projections shared between roles or layers (shared QK or KV, value residuals, cross-layer KV), nn.RMSNorm.

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


class LayerNormByHand(nn.Module):
    """The Annotated Transformer's: unbiased standard deviation, eps outside the root."""

    def __init__(self, dim: int = D, eps: float = 1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        return self.weight * (x - mean) / (x.std(-1, keepdim=True) + self.eps) + self.bias


def make_norm(kind: str) -> nn.Module:
    return {"rms": RMSNormByHand, "ln_by_hand": LayerNormByHand, "ln": lambda: nn.LayerNorm(D),
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
        if kind in ("swiglu_fused", "geglu_fused", "glu"):
            self.gate_up = nn.Linear(D, 2 * FF)
        elif kind in ("reglu", "swiglu"):
            self.gate, self.up = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        else:
            self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)

    def forward(self, x):
        if self.kind == "glu":  # F.glu: the first half times the sigmoid of the second
            return self.down(F.glu(self.gate_up(x), -1))
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


def lm_with_attention(attention: Callable[[], nn.Module], mlp="gelu", norm="rms") -> Callable[[], nn.Module]:
    return lambda: LM(lambda: Block(attention(), MLP(mlp), norm=norm), norm=norm)


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


# -- more architectures: GPT and ViT as their reference code writes them, reparametrised linears, latents, linear
# attention, token shift, convolutional nets with squeeze-excitation, skips and group norms, recurrent layers -------
class NanoGPTBlock(nn.Module):
    """nanoGPT's block: one fused ``c_attn`` split into q, k, v by ``split(D, dim=2)``, causal SDPA, GELU (tanh)
    MLP named c_fc / c_proj, LayerNorms with biases."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.c_fc, self.mlp_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def attn(self, x):
        b, n, _ = x.shape
        q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (t.view(b, n, H, DH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, n, D))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class NanoGPT(nn.Module):
    """Token and learned position embeddings, blocks, final LayerNorm, an ``lm_head`` whose weight *is* the token
    embedding's (``wte.weight = lm_head.weight``: one parameter under two names)."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(32, D)
        self.h = nn.ModuleList(NanoGPTBlock() for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TimmAttention(nn.Module):
    """timm's ViT attention: ``qkv.reshape(B, N, 3, H, Dh).permute(2, 0, 3, 1, 4).unbind(0)``, optional per-head
    LayerNorm on q and k (``qk_norm``), SDPA, ``proj``."""

    def __init__(self, qk_norm: bool):
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.q_norm = nn.LayerNorm(DH) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(DH) if qk_norm else nn.Identity()

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, H, DH).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class LayerScale(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace, self.gamma = inplace, nn.Parameter(torch.full((D,), 1e-1))

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class TimmViT(nn.Module):
    """timm's VisionTransformer: Conv2d patch embedding, class token, learned positions, pre-norm blocks with
    LayerScale (``inplace``: ``x.mul_(gamma)``), GELU MLP, final norm, class-token head."""

    def __init__(self, qk_norm=False, inplace=False):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, D, 4, 4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, 17, D) * 0.02)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            norm1=nn.LayerNorm(D, eps=1e-6), attn=TimmAttention(qk_norm), ls1=LayerScale(inplace),
            norm2=nn.LayerNorm(D, eps=1e-6), mlp=nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D)),
            ls2=LayerScale(inplace))) for _ in range(2))
        self.norm = nn.LayerNorm(D, eps=1e-6)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, pixels):
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        for blk in self.blocks:
            x = x + blk["ls1"](blk["attn"](blk["norm1"](x)))
            x = x + blk["ls2"](blk["mlp"](blk["norm2"](x)))
        return self.head(self.norm(x)[:, 0])


class Reparametrised(nn.Module):
    """An MLP language model whose linears are reparametrised by torch.nn.utils.parametrizations:
    ``weight_norm`` (W = g v / ||v||, per output row) or ``spectral_norm`` (W / sigma, sigma from the stored
    power-iteration vectors u, v in eval mode)."""

    def __init__(self, how: str):
        super().__init__()
        wrap = {"weight_norm": nn.utils.parametrizations.weight_norm,
                "spectral_norm": nn.utils.parametrizations.spectral_norm}[how]
        self.embed = nn.Embedding(V, D)
        self.up, self.down = wrap(nn.Linear(D, FF)), wrap(nn.Linear(FF, D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.down(F.relu(self.up(x)))
        return self.head(self.norm(x))


class CrossAttention(nn.Module):
    """Queries from one stream, keys and values from another of another width, einsum attention."""

    def __init__(self, kv_width: int = D):
        super().__init__()
        self.q, self.o = nn.Linear(D, D), nn.Linear(D, D)
        self.k, self.v = nn.Linear(kv_width, D), nn.Linear(kv_width, D)

    def forward(self, x, memory):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, H, DH).transpose(1, 2)
        k, v = (p(memory).view(b, memory.shape[1], H, DH).transpose(1, 2) for p in (self.k, self.v))
        w = (torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(DH)).softmax(-1)
        return self.o(torch.einsum("bhij,bhjd->bhid", w, v).transpose(1, 2).reshape(b, n, D))


class Perceiver(nn.Module):
    """Perceiver-style: 6 learned latents cross-attend to the embedded inputs (another width), then attend among
    themselves; a classifier reads the mean latent."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, 24)
        self.latents = nn.Parameter(torch.randn(6, D))
        self.cross_norm, self.input_norm = nn.LayerNorm(D), nn.LayerNorm(24)
        self.cross = CrossAttention(24)
        self.blocks = nn.ModuleList(Block(Attention(mask="none"), MLP("gelu"), norm="ln") for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.classify = nn.Linear(D, CLASSES)

    def forward(self, ids):
        inputs = self.input_norm(self.embed(ids))
        x = self.latents.expand(ids.shape[0], -1, -1)
        x = x + self.cross(self.cross_norm(x), inputs)
        for block in self.blocks:
            x = block(x)
        return self.classify(self.norm(x).mean(1))


class LinearAttention(nn.Module):
    """Attention without softmax. ``feature``: "elu" (Katharopoulos: phi = elu + 1 on q and k, causal through
    cumulative sums, normalised by phi(q) . sum phi(k)); "retention" (RetNet: q k^T times a per-head decay mask
    gamma^(i - j), no normalisation, a GroupNorm-free output)."""

    def __init__(self, feature: str):
        super().__init__()
        self.feature = feature
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.register_buffer("gammas", 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float)))

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, H, DH).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.feature == "elu":
            q, k = F.elu(q) + 1, F.elu(k) + 1
            kv = torch.einsum("bhjd,bhje->bhjde", k, v).cumsum(2)  # causal running sums of k v^T
            num = torch.einsum("bhid,bhide->bhie", q, kv)
            den = torch.einsum("bhid,bhid->bhi", q, k.cumsum(2))[..., None]
            out = num / den
        else:
            i, j = torch.arange(n)[:, None], torch.arange(n)[None]
            decay = self.gammas.view(H, 1, 1) ** (i - j).clamp_min(0) * (j <= i)
            out = (q @ k.transpose(-1, -2) / math.sqrt(DH) * decay) @ v
        return self.o(out.transpose(1, 2).reshape(b, n, D))


class TokenShiftMix(nn.Module):
    """RWKV-style channel mixing: each token is interpolated with the previous one per channel
    (``x mu + shift(x) (1 - mu)``), a squared-ReLU key, a sigmoid receptance gate."""

    def __init__(self):
        super().__init__()
        self.mu_k, self.mu_r = nn.Parameter(torch.full((D,), 0.5)), nn.Parameter(torch.full((D,), 0.5))
        self.key, self.value = nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)
        self.receptance = nn.Linear(D, D, bias=False)

    def forward(self, x, pad=None):
        shifted = F.pad(x, (0, 0, 1, -1))  # token t sees token t - 1 (zeros before the first)
        xk = x * self.mu_k + shifted * (1 - self.mu_k)
        xr = x * self.mu_r + shifted * (1 - self.mu_r)
        return torch.sigmoid(self.receptance(xr)) * self.value(torch.relu(self.key(xk)) ** 2)


class SEBlock(nn.Module):
    """A residual conv block with BatchNorm and squeeze-and-excitation (global average, FC, ReLU, FC, sigmoid,
    channel-wise product)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.fc1, self.fc2 = nn.Conv2d(channels, channels // 4, 1), nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x):
        h = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(h, 1)))))
        return F.relu(x + h * s)


class SENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.blocks = nn.Sequential(SEBlock(16), SEBlock(16))
        self.classify = nn.Linear(16, CLASSES)

    def forward(self, pixels):
        x = self.blocks(F.relu(self.bn(self.stem(pixels))))
        return self.classify(x.mean((2, 3)))


class UNet(nn.Module):
    """A two-level U-Net: conv blocks with GroupNorm and SiLU, max-pool down, ConvTranspose2d up, the skip
    concatenated on the channel axis, a 1x1 conv out (a per-pixel map)."""

    def __init__(self):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())

        self.down1, self.down2 = block(3, 8), block(8, 16)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec = block(16, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, pixels):
        s = self.down1(pixels)
        x = self.down2(F.max_pool2d(s, 2))
        return self.out(self.dec(torch.cat((self.up(x), s), 1)))


class TiedSeq2Seq(nn.Module):
    """An encoder-decoder with one embedding for source, target and output, scaled by sqrt(d) on the way in
    (Vaswani et al.); post-LN blocks, decoder cross-attention, final projection with the embedding matrix."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.pos = nn.Embedding(32, D)
        self.enc = nn.ModuleList(nn.ModuleDict(dict(attn=Attention(mask="none"), n1=nn.LayerNorm(D), mlp=MLP("relu"),
                                                    n2=nn.LayerNorm(D))) for _ in range(2))
        self.dec = nn.ModuleList(nn.ModuleDict(dict(attn=Attention(), n1=nn.LayerNorm(D), cross=CrossAttention(),
                                                    n2=nn.LayerNorm(D), mlp=MLP("relu"), n3=nn.LayerNorm(D)))
                                 for _ in range(2))

    def embedded(self, ids):
        return self.embed(ids) * math.sqrt(D) + self.pos(torch.arange(ids.shape[1]))

    def forward(self, ids):
        memory = self.embedded(ids.flip(1))
        for layer in self.enc:
            memory = layer["n1"](memory + layer["attn"](memory))
            memory = layer["n2"](memory + layer["mlp"](memory))
        x = self.embedded(ids)
        for layer in self.dec:
            x = layer["n1"](x + layer["attn"](x))
            x = layer["n2"](x + layer["cross"](x, memory))
            x = layer["n3"](x + layer["mlp"](x))
        return F.linear(x, self.embed.weight)


class SoftcapAttention(Attention):
    """Einsum attention whose logits are soft-capped (``c tanh(s / c)``, Gemma 2) before the causal mask."""

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = self.project(x)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(DH)
        scores = 30.0 * torch.tanh(scores / 30.0) + self.bias(n, x, pad)
        out = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)
        return self.o(out.transpose(1, 2).reshape(b, n, D))


class SoftcapLM(LM):
    """Soft-capped attention logits and soft-capped output logits."""

    def __init__(self):
        super().__init__(lambda: Block(SoftcapAttention(rotary="half"), MLP("swiglu")))

    def forward(self, ids, mask=None):
        return 10.0 * torch.tanh(super().forward(ids, mask) / 10.0)


class Recurrent(nn.Module):
    """nn.GRU or nn.LSTM (batch first, two layers) between an embedding and a head."""

    def __init__(self, cell: str):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[cell](D, D, num_layers=2, batch_first=True)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


class RelativeBiasAttention(Attention):
    """Einsum attention plus a learned bias per head and relative distance (a (2 * 16 - 1, heads) table indexed
    by the clamped distance j - i, Swin/T5 style without buckets), causal mask."""

    def __init__(self):
        super().__init__(core="einsum")
        self.table = nn.Parameter(torch.randn(31, H) * 0.1)

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = self.project(x)
        rel = (torch.arange(n)[None] - torch.arange(n)[:, None]).clamp(-15, 15) + 15
        bias = self.table[rel].permute(2, 0, 1)  # (heads, n, n)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(DH) + bias + self.bias(n, x, pad)
        out = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)
        return self.o(out.transpose(1, 2).reshape(b, n, D))


class CosineAttention(Attention):
    """Swin-v2 attention: queries and keys L2-normalised per head, a learned log-scale per head
    (``exp(min(s, log 100))``) multiplies the cosine logits."""

    def __init__(self):
        super().__init__(core="einsum", mask="none")
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(H, 1, 1)))

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = self.project(x)
        cos = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        scores = cos * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        out = scores.softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, n, D))


class GatedAttention(Attention):
    """SDPA whose per-head output is multiplied by a sigmoid gate from the block input (Qwen3-Next style)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, D)

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = self.project(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, D)
        return self.o(out * torch.sigmoid(self.gate(x)))


class RepeatKVAttention(Attention):
    """GQA through Hugging Face's ``repeat_kv`` (``expand`` of a new axis, then ``reshape``), einsum core."""

    def __init__(self):
        super().__init__(kv_heads=2, core="einsum", rotary="half")

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = self.project(x)
        rep = H // self.kv_heads
        k, v = (t[:, :, None].expand(b, self.kv_heads, rep, n, DH).reshape(b, H, n, DH) for t in (k, v))
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(DH) + self.bias(n, x, pad)
        out = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)
        return self.o(out.transpose(1, 2).reshape(b, n, D))


class ConformerConv(nn.Module):
    """Conformer's convolution module: pointwise conv to 2D, GLU, depthwise conv, BatchNorm, SiLU, pointwise."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.pw1 = nn.Conv1d(D, 2 * D, 1)
        self.dw = nn.Conv1d(D, D, 5, padding=2, groups=D)
        self.bn = nn.BatchNorm1d(D)
        self.pw2 = nn.Conv1d(D, D, 1)

    def forward(self, x):
        h = F.glu(self.pw1(self.norm(x).transpose(1, 2)), dim=1)
        return self.pw2(F.silu(self.bn(self.dw(h)))).transpose(1, 2)


class Conformer(nn.Module):
    """Conformer blocks: half-step (macaron) FFNs around self-attention and the depthwise conv module, a final
    LayerNorm per block; a Conv1d stem over audio, mean pooling."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(1, D, 4, 4)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ff1=nn.Sequential(nn.LayerNorm(D), nn.Linear(D, FF), nn.SiLU(), nn.Linear(FF, D)),
            attn_norm=nn.LayerNorm(D), attn=Attention(mask="none"), conv=ConformerConv(),
            ff2=nn.Sequential(nn.LayerNorm(D), nn.Linear(D, FF), nn.SiLU(), nn.Linear(FF, D)),
            out=nn.LayerNorm(D))) for _ in range(2))
        self.classify = nn.Linear(D, CLASSES)

    def forward(self, wave):
        x = self.stem(wave).transpose(1, 2)
        for blk in self.blocks:
            x = x + 0.5 * blk["ff1"](x)
            x = x + blk["attn"](blk["attn_norm"](x))
            x = x + blk["conv"](x)
            x = blk["out"](x + 0.5 * blk["ff2"](x))
        return self.classify(x.mean(1))


class TorchRMSNormLM(LM):
    """A LLaMA-like model with torch's own ``nn.RMSNorm`` (one ``aten.rms_norm`` node) everywhere."""

    def __init__(self):
        super().__init__(lambda: Block(Attention(rotary="half", bias=False), MLP("swiglu")))
        for module in [self] + list(self.blocks):
            for name in ("norm", "norm1", "norm2"):
                if isinstance(getattr(module, name, None), nn.Module):
                    setattr(module, name, nn.RMSNorm(D, eps=1e-6))


class SharedProjectionAttention(Attention):
    """Einsum attention with one projection serving two roles: ``shared="qk"`` (Reformer: keys are the queries),
    ``shared="kv"`` (values are the keys)."""

    def __init__(self, shared: str):
        super().__init__(core="einsum")
        self.shared = shared

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = self.project(x)
        if self.shared == "qk":
            k = q
        else:
            v = k
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(DH) + self.bias(n, x, pad)
        out = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)
        return self.o(out.transpose(1, 2).reshape(b, n, D))


class TalkingHeadsAttention(Attention):
    """Talking-heads attention (Shazeer et al.): learned head-mixing matrices before and after the softmax, a
    per-head temperature dividing the logits, and an output projection stored as a (heads, head dim, width)
    tensor contracted by einsum."""

    def __init__(self):
        super().__init__(core="einsum")
        self.pre, self.post = nn.Parameter(torch.eye(H) + 0.1), nn.Parameter(torch.eye(H) + 0.1)
        self.temperature = nn.Parameter(torch.ones(H))
        self.o_heads = nn.Parameter(torch.randn(H, DH, D) / math.sqrt(D))

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = self.project(x)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / self.temperature.view(1, H, 1, 1)
        scores = torch.einsum("bhij,hg->bgij", scores, self.pre) + self.bias(n, x, pad)
        weights = torch.einsum("bhij,hg->bgij", scores.softmax(-1), self.post)
        return torch.einsum("bhid,hde->bie", torch.einsum("bhij,bhjd->bhid", weights, v), self.o_heads)


class CachedRotaryAttention(Attention):
    """GPT-NeoX-style rotary from cos/sin tables cached as buffers (32 positions) and sliced to the length;
    causal SDPA with an explicit scale."""

    def __init__(self):
        super().__init__(bias=False)
        a = angles(32, DH, torch.ones(1)).repeat(1, 2)
        self.register_buffer("cos_cached", a.cos())
        self.register_buffer("sin_cached", a.sin())

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q, k, v = self.project(x)
        cos, sin = self.cos_cached[:n], self.sin_cached[:n]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        return self.o(out.transpose(1, 2).reshape(b, n, D))


class HeadGridNormAttention(Attention):
    """Queries and keys layer-normed over (heads, head dim) together after the head split, then SDPA."""

    def __init__(self):
        super().__init__()
        self.q_norm, self.k_norm = nn.LayerNorm((H, DH)), nn.LayerNorm((H, DH))

    def forward(self, x, pad=None):
        b, n, _ = x.shape
        q = self.q_norm(self.q(x).view(b, n, H, DH)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, n, H, DH)).transpose(1, 2)
        v = self.v(x).view(b, n, H, DH).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, n, D))


class TiedAutoencoder(nn.Module):
    """A tied-weight autoencoder on embeddings: encode with W, a ReLU, decode with W transposed, then a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.w = nn.Parameter(torch.randn(FF, D) / math.sqrt(D))
        self.b = nn.Parameter(torch.zeros(FF))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.embed(ids)
        h = F.relu(F.linear(x, self.w, self.b))
        return self.head(x + h @ self.w)


class LearnedSwish(nn.Module):
    """An MLP whose activation is swish with a learned slope per hidden unit: h * sigmoid(beta * h)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, FF), nn.Linear(FF, D)
        self.beta = nn.Parameter(torch.ones(FF))

    def forward(self, x):
        h = self.up(x)
        return self.down(h * torch.sigmoid(self.beta * h))


class ShortConvMixer(nn.Module):
    """Hyena/Mamba-style short causal depthwise conv over time with a SiLU gate, in place of attention."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(D, 2 * D)
        self.conv = nn.Conv1d(D, D, 4, groups=D, padding=3)
        self.out_proj = nn.Linear(D, D)

    def forward(self, x, pad=None):
        u, gate = self.in_proj(x).chunk(2, -1)
        u = self.conv(u.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        return self.out_proj(F.silu(u) * torch.sigmoid(gate))


class SharedValueLM(nn.Module):
    """Values shared across layers: ``mode="value_residual"`` (ResFormer: every later layer's values averaged with
    the first layer's) or ``mode="cross_layer_kv"`` (later layers attend to the first layer's keys and values)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(Attention(core="einsum"), MLP("gelu")) for _ in range(3))
        self.norm, self.head = RMSNormByHand(), nn.Linear(D, V)

    def forward(self, ids, mask=None):
        x = self.embed(ids)
        b, n, _ = x.shape
        first = None
        for blk in self.blocks:
            q, k, v = blk.attn.project(blk.norm1(x))
            if first is None:
                first = (k, v)
            elif self.mode == "value_residual":
                v = 0.5 * (v + first[1])
            else:
                k, v = first
            scores = q @ k.transpose(-1, -2) / math.sqrt(DH) + blk.attn.bias(n, q, mask)
            x = x + blk.attn.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, D))
            x = x + blk.mlp(blk.norm2(x))
        return self.head(self.norm(x))


class InPlaceBlock(nn.Module):
    """minGPT-style block written with in-place ops: ``x += attn(ln(x))``, scores divided and masked in place
    (``masked_fill_`` with a causal ``tril`` buffer), ``nn.ReLU(inplace=True)``, ``h *= sigmoid(gate)``."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention(core="einsum")
        self.register_buffer("tril", torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32))
        self.up, self.gate, self.down = nn.Linear(D, FF), nn.Linear(D, FF), nn.Linear(FF, D)
        self.act = nn.ReLU(inplace=True)

    def attend(self, x):
        b, n, _ = x.shape
        q, k, v = self.attn.project(x)
        att = q @ k.transpose(-2, -1)
        att.div_(math.sqrt(DH))
        att.masked_fill_(self.tril[:, :, :n, :n] == 0, float("-inf"))
        return self.attn.o((att.softmax(-1) @ v).transpose(1, 2).contiguous().view(b, n, D))

    def forward(self, x, pad=None):
        x = x.clone()
        x += self.attend(self.ln1(x))
        h = self.ln2(x)
        u = self.act(self.up(h))
        u *= torch.sigmoid(self.gate(h))
        x += self.down(u)
        return x


class StyleNet(nn.Module):
    """A style-transfer net (Johnson et al.): reflection-padded convs with InstanceNorm2d, a residual block, a
    nearest-neighbour upsample, an image out."""

    def __init__(self):
        super().__init__()

        def conv(cin, cout, k, stride=1):
            return nn.Sequential(nn.ReflectionPad2d(k // 2), nn.Conv2d(cin, cout, k, stride))

        self.c1, self.n1 = conv(3, 8, 3), nn.InstanceNorm2d(8, affine=True)
        self.c2, self.n2 = conv(8, 16, 3, 2), nn.InstanceNorm2d(16, affine=True)
        self.r1, self.rn1 = conv(16, 16, 3), nn.InstanceNorm2d(16, affine=True)
        self.r2, self.rn2 = conv(16, 16, 3), nn.InstanceNorm2d(16, affine=True)
        self.c3, self.n3 = conv(16, 8, 3), nn.InstanceNorm2d(8, affine=True)
        self.out = conv(8, 3, 3)

    def forward(self, pixels):
        x = F.relu(self.n1(self.c1(pixels)))
        x = F.relu(self.n2(self.c2(x)))
        x = x + self.rn2(self.r2(F.relu(self.rn1(self.r1(x)))))
        x = F.relu(self.n3(self.c3(F.interpolate(x, scale_factor=2, mode="nearest"))))
        return self.out(x)


class DualFfnLM(nn.Module):
    """HiggsAudio's dual FFN: tokens below ``V // 4`` (audio tokens there) take their own norm and MLP, picked by a
    boolean mask built from the ids (a count torch.export knows only at run time) and written back in place."""

    def __init__(self, depth=2):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.attn = nn.ModuleList(Attention() for _ in range(depth))
        self.norms = nn.ModuleList(make_norm("rms") for _ in range(3 * depth))
        self.text = nn.ModuleList(MLP("swiglu") for _ in range(depth))
        self.special = nn.ModuleList(MLP("swiglu") for _ in range(depth))
        self.norm, self.head = make_norm("rms"), nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x, special = self.embed(ids), ids < V // 4
        for i, (attn, text, other) in enumerate(zip(self.attn, self.text, self.special)):
            x = x + attn(self.norms[3 * i](x))
            x = x.clone()
            x[~special] += text(self.norms[3 * i + 1](x[~special]))
            x[special] += other(self.norms[3 * i + 2](x[special]))
        return self.head(self.norm(x))

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
    _entry("nanogpt_fused_c_attn_tied_head", NanoGPT, tokens_only),
    _entry("timm_vit_layerscale", TimmViT, fixed_image),
    _entry("timm_vit_qk_norm_inplace_layerscale", lambda: TimmViT(qk_norm=True, inplace=True), fixed_image,
           expect=("heads", "vo", "ffn", "residual")),
    _entry("weight_norm_linears", lambda: Reparametrised("weight_norm"), tokens_only, expect=("ffn", "residual")),
    _entry("spectral_norm_linears", lambda: Reparametrised("spectral_norm"), tokens_only, expect=("residual",)),
    _entry("perceiver_latents", Perceiver, tokens_only),
    _entry("linear_attention_elu", lm_with_attention(lambda: LinearAttention("elu")), expect=("vo", "ffn")),
    _entry("retention_decay", lm_with_attention(lambda: LinearAttention("retention")), tokens_only,
           expect=("qk", "vo", "ffn", "residual")),  # the decay rates differ per head (a buffer): heads stay
    _entry("rwkv_token_shift_mix", lambda: LM(lambda: Block(Attention(), TokenShiftMix(), norm="ln"), norm="ln"),
           tokens_only),
    _entry("squeeze_excitation_convnet", SENet, image, expect=("ffn", "residual")),
    _entry("unet_skip_concat_groupnorm", UNet, image, expect=("ffn",)),
    _entry("seq2seq_tied_scaled_embeddings", TiedSeq2Seq, tokens_only),
    _entry("logit_softcap", SoftcapLM),
    _entry("gru", lambda: Recurrent("gru"), tokens_only, expect=("ffn",)),
    _entry("lstm", lambda: Recurrent("lstm"), tokens_only, expect=("ffn",)),
    _entry("layernorm_by_hand_std", lm_with_attention(Attention, norm="ln_by_hand")),
    _entry("glu_mlp", lm_with_attention(Attention, mlp="glu")),
    _entry("relative_bias_per_head", lm_with_attention(RelativeBiasAttention)),
    _entry("cosine_attention_logit_scale", lm_with_attention(CosineAttention, norm="ln")),
    _entry("gated_attention_output", lm_with_attention(GatedAttention)),
    _entry("gqa_repeat_kv_expand", lm_with_attention(RepeatKVAttention, mlp="swiglu")),
    _entry("conformer_conv_module", Conformer, audio),
    _entry("torch_rmsnorm", TorchRMSNormLM),
    _entry("shared_qk_projection", lm_with_attention(lambda: SharedProjectionAttention("qk"))),
    _entry("shared_kv_projection", lm_with_attention(lambda: SharedProjectionAttention("kv"))),
    _entry("talking_heads_temperature", lm_with_attention(TalkingHeadsAttention), expect=("qk", "vo", "ffn")),
    _entry("rotary_cached_buffers", lm_with_attention(CachedRotaryAttention, mlp="swiglu")),
    _entry("qk_layernorm_over_heads_grid", lm_with_attention(HeadGridNormAttention), expect=("vo", "ffn")),
    _entry("tied_autoencoder_transpose", TiedAutoencoder, tokens_only, expect=("ffn",)),
    _entry("learned_swish_slope", lambda: LM(lambda: Block(Attention(), LearnedSwish()))),
    _entry("mingpt_in_place_ops", lambda: LM(InPlaceBlock, norm="ln"), tokens_only),
    _entry("instance_norm_style_net", StyleNet, image, expect=("ffn",)),
    _entry("value_residual", lambda: SharedValueLM("value_residual")),
    _entry("cross_layer_kv_sharing", lambda: SharedValueLM("cross_layer_kv")),
    _entry("dual_ffn_by_token_mask", DualFfnLM, tokens_only, expect=ATTN + ("ffn",)),
    _entry("short_conv_mixer", lambda: LM(lambda: Block(ShortConvMixer(), MLP("gelu"))), tokens_only,
           expect=("ffn", "residual")),
]
BY_NAME = {e.name: e for e in ZOO}
