"""Array plumbing shared by the kernels: numpy <-> torch float64, and giving results back in the caller's type."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

Array = Any  # numpy.ndarray or torch.Tensor (always float64 inside the kernels)


def as_tensor(x: Array) -> torch.Tensor:
    """``x`` as a float64 CPU-or-same-device torch tensor (no copy when it already is one)."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))


def as_numpy(x: Array) -> np.ndarray:
    """``x`` as a float64 numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def like(result: torch.Tensor | np.ndarray, template: Array) -> Array:
    """``result`` in the array type of ``template`` (torch in, torch out; anything else, numpy out)."""
    if isinstance(template, torch.Tensor):
        if isinstance(result, torch.Tensor):
            return result.to(device=template.device)
        return torch.from_numpy(np.asarray(result)).to(device=template.device)
    return result.detach().cpu().numpy() if isinstance(result, torch.Tensor) else np.asarray(result)
