"""Where and in what the alignment computes (``device``, ``dtype``): float32 and float64 find the same
permutations, CUDA works where there is a GPU and is refused clearly where there is none, other dtypes refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import align_states, select_groups
from symgraph.demo import demo_models
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


# -- merge and barrier: the same device and dtype options ----------------------------------------------------------
@pytest.fixture(scope="module")
def twin_models():
    """Two independent tiny llamas (float32): what merge and barrier align."""
    return [zoo.build("llama", seed=s) for s in (0, 1)]


@pytest.mark.slow
def test_merge_in_float32_and_float64_finds_the_same_alignment(twin_models):
    from symgraph.merging import merge

    runs = {dtype: merge(twin_models, align="permutation", frame="reference", dtype=dtype, progress=False)
            for dtype in ("float32", "float64")}
    wide, narrow = runs["float64"], runs["float32"]
    assert wide.distances_before != pytest.approx(wide.distances, rel=1e-3)  # alignment moved the second model
    for k in wide.state:  # another permutation would move whole rows: differences of the weights' own size
        torch.testing.assert_close(narrow.state[k], wide.state[k], rtol=1e-4, atol=1e-5)


def test_regmean_solves_in_the_asked_dtype_and_returns_float64():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    grams = [(x.T @ x) for x in (torch.randn(9, 4, generator=g, dtype=torch.float64) for _ in range(2))]
    from symgraph.merging import regmean_solution

    wide = regmean_solution(weights, grams, [0.5, 0.5])
    narrow = regmean_solution(weights, grams, [0.5, 0.5], compute=("cpu", torch.float32))
    assert wide.dtype == narrow.dtype == torch.float64
    assert not torch.equal(narrow, wide)  # it really ran in float32
    torch.testing.assert_close(narrow, wide, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_barrier_in_float32_and_float64_gives_the_same_curves(twin_models):
    from symgraph.connectivity import barrier
    from test_barrier import tokens

    data = tokens()
    runs = {dtype: barrier(*twin_models, data, steps=3, aligns=("permutation",), dtype=dtype, progress=False)
            for dtype in ("float32", "float64")}
    wide, narrow = runs["float64"].curves["permutation"], runs["float32"].curves["permutation"]
    assert narrow.distance == pytest.approx(wide.distance, rel=1e-5)
    assert narrow.losses == pytest.approx(wide.losses, rel=1e-5)


@pytest.mark.parametrize("command", ["merge", "barrier"])
def test_api_refuses_a_missing_gpu_and_other_dtypes_before_reading_models(command, tmp_path):
    from symgraph.connectivity import barrier
    from symgraph.merging import merge

    missing = [str(tmp_path / "no-such-model-a"), str(tmp_path / "no-such-model-b")]

    def call(**compute):
        if command == "merge":
            return merge(missing, progress=False, **compute)
        return barrier(*missing, "digits", progress=False, **compute)

    if not torch.cuda.is_available():
        with pytest.raises(SymgraphError, match="sees no CUDA GPU") as info:
            call(device="cuda")
        assert "--device cpu" in info.value.hint
    with pytest.raises(SymgraphError, match="float32 or float64"):
        call(dtype=torch.bfloat16)
    with pytest.raises(SymgraphError, match="Unknown compute device"):
        call(device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_merge_and_barrier_refuse_cuda_without_a_gpu(tmp_path):
    out = tmp_path / "merged"
    code, _, stderr = run("merge", DEMO, DEMO, "-o", out, "--device", "cuda", "--no-progress")
    assert code != 0 and "sees no CUDA GPU" in stderr and "--device cpu" in stderr
    assert not out.exists()
    plot = tmp_path / "barrier.png"
    code, _, stderr = run("barrier", DEMO, DEMO, "--data", "digits", "-o", plot, "--device", "cuda",
                          "--no-progress")
    assert code != 0 and "sees no CUDA GPU" in stderr and "--device cpu" in stderr
    assert not plot.exists()
    code, _, stderr = run("merge", DEMO, DEMO, "-o", out, "--dtype", "bfloat16", "--no-progress")
    assert code != 0 and "bfloat16" in stderr


@pytest.mark.slow
def test_cli_merge_with_device_and_dtype(tmp_path):
    out = tmp_path / "merged"
    code, stdout, stderr = run("merge", DEMO, demo_models()["llama-b"], "-o", out, "--align", "permutation",
                               "--frame", "reference", "--device", "cpu", "--dtype", "float32", "--no-progress")
    assert code == 0, stderr
    assert (out / "config.json").exists() and "distance of each model to the merge" in stdout
