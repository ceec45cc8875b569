"""Float64 sums over large working tensors, read in chunks.

The working copies are float32 (for fp32/bf16/fp16 models); the distances and per-coordinate statistics the
solvers compare are float64. Converting a whole member (a 32000 x 2048 LM head) to float64 first allocates and
page-faults a new buffer twice its size at every solve, which cost more than the arithmetic. Here each chunk of
at most :data:`CHUNK` elements is promoted, reduced and dropped: the same float64 products, no large copy.
On the CPU the promotion happens inside numpy (a ufunc or ``einsum`` with ``dtype=float64`` casts its float32
inputs buffer by buffer, into one reused chunk): 2-4x less time than torch's convert-then-reduce, which was a
quarter of an alignment's CPU time at 1B (examples/bench_align_speed.py).
"""
from __future__ import annotations

import numpy as np
import torch

CHUNK = 1 << 21  # elements promoted to float64 at a time (16 MiB)
_NUMPY_DTYPES = (torch.float32, torch.float64)  # read by numpy without a conversion (bf16 has no numpy dtype)


def squared_distance(x: torch.Tensor, y: torch.Tensor | None = None) -> float:
    """``sum((x - y)^2)`` (``sum(x^2)`` without ``y``) in float64."""
    fx = x.detach().reshape(-1)
    fy = None if y is None else y.detach().reshape(-1)
    if fx.device.type != "cpu":
        return _squared_distance_on_device(fx, fy)
    buffer = np.empty(min(CHUNK, fx.numel()))
    total = 0.0
    for lo in range(0, fx.numel(), CHUNK):
        d = _difference(fx, fy, lo, lo + CHUNK, buffer)
        total += float(np.dot(d, d))
    return total


def row_sums(x: torch.Tensor, y: torch.Tensor | None = None, *, minus: bool = False) -> np.ndarray:
    """Per row of ``x`` (shape ``(..., rows, features)``): ``sum(x * y)`` over the features (``sum(x^2)``
    without ``y``; with ``minus``, ``sum((x - y)^2)``), float64, as a numpy array of shape ``(..., rows)``."""
    lead, features = x.shape[:-1], x.shape[-1]
    fx = x.detach().reshape(-1, features)
    fy = None if y is None else y.detach().reshape(-1, features)
    if fx.device.type != "cpu":
        return _row_sums_on_device(fx, fy, minus).reshape(tuple(lead))
    out = np.empty(fx.shape[0])
    if not minus and fx.dtype in _NUMPY_DTYPES and (fy is None or fy.dtype in _NUMPY_DTYPES):
        a = fx.numpy()
        np.einsum("rf,rf->r", a, a if fy is None else fy.numpy(), dtype=np.float64, out=out)
        return out.reshape(tuple(lead))
    step = max(1, CHUNK // max(features, 1))
    buffer = np.empty((min(step, fx.shape[0]), features))
    for lo in range(0, fx.shape[0], step):
        a = _difference(fx, fy if minus else None, lo, lo + step, buffer)
        b = a if fy is None or minus else _difference(fy, None, lo, lo + step, np.empty_like(a))
        out[lo:lo + step] = np.einsum("rf,rf->r", a, b)
    return out.reshape(tuple(lead))


def _difference(x: torch.Tensor, y: torch.Tensor | None, lo: int, hi: int, buffer: np.ndarray) -> np.ndarray:
    """``x[lo:hi] - y[lo:hi]`` (``x[lo:hi]`` without ``y``) in float64, written into ``buffer``'s first rows."""
    a = _readable(x[lo:hi])
    out = buffer[:a.shape[0]]
    if y is None:
        out[...] = a
        return out
    return np.subtract(a, _readable(y[lo:hi]), out=out, dtype=np.float64)


def _readable(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy: itself for float32/float64, else converted exactly (bf16 and fp16 fit in float32)."""
    return x.numpy() if x.dtype in _NUMPY_DTYPES else x.to(torch.float32).numpy()


def _squared_distance_on_device(fx: torch.Tensor, fy: torch.Tensor | None) -> float:
    total = 0.0
    for lo in range(0, fx.numel(), CHUNK):
        d = fx[lo:lo + CHUNK].to(torch.float64, copy=True)
        if fy is not None:
            d -= fy[lo:lo + CHUNK]
        total += float(torch.dot(d, d))
    return total


def _row_sums_on_device(fx: torch.Tensor, fy: torch.Tensor | None, minus: bool) -> np.ndarray:
    out = np.empty(fx.shape[0])
    step = max(1, CHUNK // max(fx.shape[1], 1))
    for lo in range(0, fx.shape[0], step):
        a = fx[lo:lo + step].to(torch.float64, copy=True)
        b = a if fy is None else fy[lo:lo + step].to(torch.float64)
        if minus:
            a -= b
            b = a
        out[lo:lo + step] = torch.einsum("rf,rf->r", a, b).cpu().numpy()
    return out
