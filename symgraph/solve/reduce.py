"""Float64 sums over large working tensors, read in chunks.

The working copies are float32 (for fp32/bf16/fp16 models); the distances and per-coordinate statistics the
solvers compare are float64. Converting a whole member (a 32000 x 2048 LM head) to float64 first allocates and
page-faults a new buffer twice its size at every solve, which cost more than the arithmetic. Here each chunk of
at most :data:`CHUNK` elements is promoted, reduced and dropped: the same float64 products, no large copy.
"""
from __future__ import annotations

import numpy as np
import torch

CHUNK = 1 << 21  # elements promoted to float64 at a time (16 MiB)


def squared_distance(x: torch.Tensor, y: torch.Tensor | None = None) -> float:
    """``sum((x - y)^2)`` (``sum(x^2)`` without ``y``) in float64."""
    fx = x.detach().reshape(-1)
    fy = None if y is None else y.detach().reshape(-1)
    total = 0.0
    for lo in range(0, fx.numel(), CHUNK):
        d = fx[lo:lo + CHUNK].to(torch.float64, copy=True)
        if fy is not None:
            d -= fy[lo:lo + CHUNK]
        total += float(torch.dot(d, d))
    return total


def row_sums(x: torch.Tensor, y: torch.Tensor | None = None, *, minus: bool = False) -> np.ndarray:
    """Per row of ``x`` (shape ``(..., rows, features)``): ``sum(x * y)`` over the features (``sum(x^2)``
    without ``y``; with ``minus``, ``sum((x - y)^2)``), float64, as a numpy array of shape ``(..., rows)``."""
    lead, features = x.shape[:-1], x.shape[-1]
    fx = x.detach().reshape(-1, features)
    fy = None if y is None else y.detach().reshape(-1, features)
    out = np.empty(fx.shape[0])
    step = max(1, CHUNK // max(features, 1))
    for lo in range(0, fx.shape[0], step):
        a = fx[lo:lo + step].to(torch.float64, copy=True)
        b = a if fy is None else fy[lo:lo + step].to(torch.float64)
        if minus:
            a -= b
            b = a
        out[lo:lo + step] = torch.einsum("rf,rf->r", a, b).cpu().numpy()
    return out.reshape(tuple(lead))
