"""Write a LLaMA-architecture 7B model A and two partners, streamed tensor by tensor; print JSON.

    python examples/make_llama_7b_pair.py [--out /work/big7b]

Writes three Hugging Face folders (sharded bf16 safetensors with the index, config.json) under OUT:

``A``   LLaMA-2-7B sizes (d 4096, 32 layers, GQA 32/8 heads, SwiGLU 11008, vocab 32000), random weights: linears
        and embeddings N(0, 0.02) (transformers' ``initializer_range``), RMSNorm weights 1.
``B1``  A moved by a random element of its own symmetry group, then 1% noise (per tensor, Gaussian with 1% of the
        tensor's RMS): residual stream rotated by a dense orthogonal Q (a random permutation, random signs and
        the Kronecker product of two random 64 x 64 orthogonal matrices: O(128 d) per row, where a dense Haar Q
        would cost ~50 TFLOP here); KV groups permuted, query heads permuted within their group; per KV group a
        rotation of each RoPE frequency pair on Q and K, and an orthogonal map on V with its inverse on O's
        columns; FFN units permuted. These are orthogonal and permutation elements of the groups the design lists
        for LLaMA (the residual rotation needs the norm weights to be 1, as a folded model has them; no scales).
        Without noise, B1 computes what A computes (tests check it in float64 at tiny sizes).
``B2``  an independent initialisation.

Every tensor is generated from its own seed, so A's tensors are regenerated for B1 instead of being held: the
peak memory is a few tensors. When all three folders are complete, OUT/READY (JSON) says what they are.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import resource
import time
import zlib
from pathlib import Path

import torch

from symgraph.files import write_text_atomic
from symgraph.shards import TensorInfo, write_checkpoint

INIT_STD = 0.02
LLAMA_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=11008, vocab_size=32000)
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


def llama_config(sizes: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "initializer_range": INIT_STD, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
            **sizes}


def tensor_infos(sizes: dict, dtype: torch.dtype) -> list[TensorInfo]:
    """The checkpoint's tensors in transformers' order (names and shapes of LlamaForCausalLM)."""
    d, inter, vocab = sizes["hidden_size"], sizes["intermediate_size"], sizes["vocab_size"]
    head = d // sizes["num_attention_heads"]
    kv = sizes["num_key_value_heads"] * head
    infos = [TensorInfo("model.embed_tokens.weight", (vocab, d), dtype)]
    for i in range(sizes["num_hidden_layers"]):
        p = f"model.layers.{i}."
        infos += [TensorInfo(p + "self_attn.q_proj.weight", (d, d), dtype),
                  TensorInfo(p + "self_attn.k_proj.weight", (kv, d), dtype),
                  TensorInfo(p + "self_attn.v_proj.weight", (kv, d), dtype),
                  TensorInfo(p + "self_attn.o_proj.weight", (d, d), dtype),
                  TensorInfo(p + "mlp.gate_proj.weight", (inter, d), dtype),
                  TensorInfo(p + "mlp.up_proj.weight", (inter, d), dtype),
                  TensorInfo(p + "mlp.down_proj.weight", (d, inter), dtype),
                  TensorInfo(p + "input_layernorm.weight", (d,), dtype),
                  TensorInfo(p + "post_attention_layernorm.weight", (d,), dtype)]
    return infos + [TensorInfo("model.norm.weight", (d,), dtype), TensorInfo("lm_head.weight", (vocab, d), dtype)]


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def initial(seed: int, info: TensorInfo) -> torch.Tensor:
    """A's (or B2's) tensor in float32 (float64 for a float64 checkpoint, so B1 is exact there): norms 1,
    everything else N(0, INIT_STD), from the tensor's own seed."""
    work = torch.float64 if info.dtype == torch.float64 else torch.float32
    if info.name.endswith("norm.weight"):
        return torch.ones(info.shape, dtype=work)
    return (torch.randn(info.shape, generator=_generator(seed, info.name)) * INIT_STD).to(work)


# -- the group element ------------------------------------------------------------------------------------------
class Element:
    """One random element of the 7B model's symmetry group (see the module docstring), sampled per layer from
    ``seed`` so that any tensor can be transformed on its own."""

    def __init__(self, sizes: dict, seed: int):
        self.sizes, self.seed = sizes, seed
        d = sizes["hidden_size"]
        a = max(k for k in range(1, math.isqrt(d) + 1) if d % k == 0)
        g = torch.Generator().manual_seed(seed)
        self.perm, self.signs = torch.randperm(d, generator=g), torch.randint(0, 2, (d,), generator=g) * 2.0 - 1
        self.left, self.right = _haar(a, g), _haar(d // a, g)

    def residual(self, rows: torch.Tensor) -> torch.Tensor:
        """Q x for every row x of ``rows`` (rows indexed by the residual stream's coordinates): a permutation,
        random signs, then the Kronecker product of two random orthogonal a x a and b x b matrices (d = a b): dense,
        orthogonal, and applied as two large matrix products, O(d (a + b)) per row."""
        (n, d), a, b = rows.shape, self.left.shape[0], self.right.shape[0]
        x = (rows[:, self.perm] * self.signs.to(rows.dtype)).reshape(n * a, b) @ self.right.T.to(rows.dtype)
        x = self.left.to(rows.dtype) @ x.view(n, a, b).transpose(0, 1).reshape(a, n * b)
        return x.view(a, n, b).transpose(0, 1).reshape(n, d)

    def layer(self, index: int) -> dict:
        s = self.sizes
        kv, rep = s["num_key_value_heads"], s["num_attention_heads"] // s["num_key_value_heads"]
        head = s["hidden_size"] // s["num_attention_heads"]
        g = torch.Generator().manual_seed(self.seed * 7919 + index + 1)
        groups = torch.randperm(kv, generator=g)
        within = torch.stack([torch.randperm(rep, generator=g) for _ in range(kv)])
        angles = torch.rand(kv, head // 2, generator=g, dtype=torch.float64) * 2 * math.pi
        vo = torch.stack([_haar(head, g) for _ in range(kv)])
        ffn = torch.randperm(s["intermediate_size"], generator=g)
        return {"heads": groups[:, None] * rep + within, "groups": groups, "qk": _rope_rotations(angles), "vo": vo,
                "ffn": ffn}


def _haar(n: int, g: torch.Generator) -> torch.Tensor:
    """A Haar-random n x n orthogonal matrix (QR of a Gaussian matrix, signs fixed by R's diagonal)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def _rope_rotations(angles: torch.Tensor) -> torch.Tensor:
    """Per KV group, the head_dim x head_dim rotation turning each rotate_half pair (i, i + head_dim/2) by its angle
    (it commutes with RoPE, which turns the same pairs)."""
    kv, half = angles.shape
    r = torch.zeros(kv, 2 * half, 2 * half, dtype=angles.dtype)
    idx = torch.arange(half)
    cos, sin = torch.cos(angles), torch.sin(angles)
    r[:, idx, idx], r[:, idx + half, idx + half] = cos, cos
    r[:, idx, idx + half], r[:, idx + half, idx] = -sin, sin
    return r


def transformed(element: Element, name: str, w: torch.Tensor, layers: dict) -> torch.Tensor:
    """The float32 tensor ``w`` of A, stored under ``name``, as the transformed model stores it."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return element.residual(w)
    if name == "model.norm.weight":
        return w
    match = _LAYER.fullmatch(name)
    if match is None:
        raise SystemExit(f"no rule for tensor {name}")
    index, role = int(match.group(1)), match.group(2)
    if index not in layers:
        layers.clear()  # tensors come layer by layer: keep one layer's element
        layers[index] = element.layer(index)
    e, head = layers[index], element.sizes["hidden_size"] // element.sizes["num_attention_heads"]
    rows_per_head = lambda m: m.view(-1, head, m.shape[-1])  # noqa: E731
    if role == "self_attn.q_proj":
        kv = e["qk"].shape[0]
        heads = rows_per_head(w)[e["heads"].reshape(-1)].view(kv, -1, head, w.shape[1])
        return element.residual((e["qk"][:, None].to(w.dtype) @ heads).reshape(w.shape))
    if role in ("self_attn.k_proj", "self_attn.v_proj"):
        maps = e["qk"] if role == "self_attn.k_proj" else e["vo"]
        return element.residual((maps.to(w.dtype) @ rows_per_head(w)[e["groups"]]).reshape(w.shape))
    if role == "self_attn.o_proj":
        kv = e["vo"].shape[0]
        cols = rows_per_head(w.T.contiguous())[e["heads"].reshape(-1)].view(kv, -1, head, w.shape[0])
        return element.residual((e["vo"][:, None].to(w.dtype) @ cols).reshape(w.shape[1], w.shape[0])).T
    if role in ("mlp.gate_proj", "mlp.up_proj"):
        return element.residual(w[e["ffn"]])
    if role == "mlp.down_proj":
        return element.residual(w[:, e["ffn"]].T.contiguous()).T
    if role.endswith("layernorm"):
        return w
    raise SystemExit(f"no rule for tensor {name}")


def noisy(w: torch.Tensor, noise: float, seed: int, name: str) -> torch.Tensor:
    if noise == 0:
        return w
    scale = noise * float(w.pow(2).mean().sqrt())
    return w + torch.randn(w.shape, generator=_generator(seed + 1, name)).to(w.dtype) * scale


# -- writing -------------------------------------------------------------------------------------------------------
def write_model(out: Path, infos: list[TensorInfo], make, config: dict, shard_bytes: int) -> dict:
    start = time.perf_counter()
    by_name = {info.name: info for info in infos}
    write_checkpoint(out, infos, lambda name: make(by_name[name]).to(by_name[name].dtype), shard_bytes=shard_bytes,
                     config=config, overwrite=True)
    return {"path": str(out), "seconds": round(time.perf_counter() - start, 1),
            "bytes": sum(p.stat().st_size for p in out.iterdir())}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/work/big7b"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.01, help="B1's noise, relative to each tensor's RMS")
    parser.add_argument("--shard-gb", type=float, default=4.0, help="largest shard, in GB (1e9 bytes)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    parser.add_argument("--models", default="A,B1,B2",
                        help="which folders to write (comma-separated; separate processes may write them side by "
                        "side with the same options: READY appears once all three are complete)")
    for key, value in LLAMA_7B.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    args = parser.parse_args(argv)
    sizes = {key: getattr(args, key) for key in LLAMA_7B}
    dtype, shard_bytes = getattr(torch, args.dtype), int(args.shard_gb * 1e9)
    config = {**llama_config(sizes), "torch_dtype": args.dtype}
    infos = tensor_infos(sizes, dtype)
    element, layers = Element(sizes, args.seed + 100), {}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "READY").unlink(missing_ok=True)
    makers = {"A": lambda i: initial(args.seed, i),
              "B1": lambda i: noisy(transformed(element, i.name, initial(args.seed, i), layers), args.noise,
                                    args.seed, i.name),
              "B2": lambda i: initial(args.seed + 1, i)}
    with torch.no_grad():
        written = {name: write_model(args.out / name, infos, makers[name], config, shard_bytes)
                   for name in args.models.split(",")}
    summary = {"config": sizes, "dtype": args.dtype, "parameters": sum(math.prod(i.shape) for i in infos),
               "noise": args.noise, "seed": args.seed,
               "models": {name: str(args.out / name) for name in makers},
               "B1": "A moved by a random element of its symmetry group, plus noise",
               "B2": "an independent initialisation"}
    if all((args.out / name / "config.json").is_file() for name in makers):  # folders appear only when complete
        write_text_atomic(args.out / "READY", json.dumps(summary, indent=1) + "\n")
    summary.update(written=written, peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    return summary


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
