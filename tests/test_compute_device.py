"""Where and in what the alignment computes (``device``, ``dtype``): float32 and float64 find the same
permutations, CUDA works where there is a GPU and is refused clearly where there is none, other dtypes refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import align_states, select_groups
from symgraph.errors import SymgraphError

from cli_runner import run
from test_cli import DEMO


@pytest.fixture(scope="module")
def pair():
    a, b = zoo.build("llama", seed=0, dtype=torch.float64), zoo.build("llama", seed=1, dtype=torch.float64)
    groups = symgraph.load(a, zoo.example_inputs_for("llama", a)).report.groups
    return select_groups(groups, "permutation"), b.state_dict(), a.state_dict()


def test_float32_and_float64_find_the_same_permutations(pair):
    groups, source, anchor = pair
    wide = align_states(groups, source, anchor, mode="permutation", dtype="float64")
    narrow = align_states(groups, source, anchor, mode="permutation", dtype=torch.float32)
    assert wide.distance_after < wide.distance_before
    assert [e.group.id for e in narrow.elements] == [e.group.id for e in wide.elements]
    for e32, e64 in zip(narrow.elements, wide.elements):
        np.testing.assert_array_equal(e32.perm, e64.perm)
        np.testing.assert_array_equal(e32.diag, e64.diag)
    assert narrow.distance_after == pytest.approx(wide.distance_after, rel=1e-5)
    assert all(narrow.state[k].dtype == source[k].dtype for k in source)  # written back in the source's dtype


@pytest.mark.parametrize("dtype", ["float16", torch.bfloat16, "int8"])
def test_a_dtype_the_solvers_cannot_compute_in_is_refused(pair, dtype):
    groups, source, anchor = pair
    with pytest.raises(SymgraphError, match="float32 or float64"):
        align_states(groups, source, anchor, mode="permutation", dtype=dtype)


def test_cuda_aligns_where_there_is_a_gpu_and_is_refused_clearly_where_there_is_none(pair):
    groups, source, anchor = pair
    if not torch.cuda.is_available():
        with pytest.raises(SymgraphError, match="sees no CUDA GPU") as info:
            align_states(groups, source, anchor, mode="permutation", device="cuda")
        assert "--device cpu" in info.value.hint
        return
    on_gpu = align_states(groups, source, anchor, mode="permutation", device="cuda")
    on_cpu = align_states(groups, source, anchor, mode="permutation")
    assert on_gpu.distance_after == pytest.approx(on_cpu.distance_after, rel=1e-9)
    assert all(t.device.type == "cpu" for t in on_gpu.state.values())


def test_unknown_device_is_refused(pair):
    groups, source, anchor = pair
    with pytest.raises(SymgraphError, match="Unknown compute device"):
        align_states(groups, source, anchor, device="tpu")


def test_cli_align_device_and_dtype(tmp_path):
    out = tmp_path / "out"
    code, stdout, stderr = run("align", DEMO, DEMO, "-o", out, "--mode", "permutation", "--dtype", "float32",
                               "--device", "cpu", "--quiet")
    assert code == 0, stderr
    assert (out / "config.json").exists()
    if not torch.cuda.is_available():
        refused = tmp_path / "refused"
        code, _, stderr = run("align", DEMO, DEMO, "-o", refused, "--device", "cuda", "--quiet")
        assert code != 0 and "sees no CUDA GPU" in stderr and "--device cpu" in stderr
        assert not refused.exists()
    code, _, stderr = run("align", DEMO, DEMO, "-o", tmp_path / "x", "--dtype", "float16", "--quiet")
    assert code != 0 and "float16" in stderr
