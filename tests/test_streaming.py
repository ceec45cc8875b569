"""Streamed checkpoints: sharded safetensors written tensor by tensor (atomic, a full disk leaves nothing),
read lazily in the stored dtype, the streamed simple merge (CLI and API), and the 7B pair generator at tiny sizes."""
from __future__ import annotations

import builtins
import copy
import errno
import json
import sys
from pathlib import Path

import pytest
import torch

import symgraph
from symgraph import shards, zoo
from symgraph.errors import MismatchError, ModelLoadError, OutputError
from symgraph.io import model_config, save_model
from symgraph.lazy_state import LazyState
from symgraph.merging import merge, merge_streamed
from symgraph.shards import TensorInfo, infos_of, write_checkpoint
from symgraph.streamed_verify import streamed_outputs, verify_streamed

from cli_runner import run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import make_llama_7b_pair  # noqa: E402

SMALL_SHARDS = 40_000  # bytes: the tiny LLaMA (about 170 KB in float32) gets several shards


def write_sharded(model: torch.nn.Module, out: Path, dtype=None) -> Path:
    state = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v
             for k, v in model.state_dict().items()}
    return write_checkpoint(out, infos_of(state), state.__getitem__, shard_bytes=SMALL_SHARDS,
                            config=model_config(model))


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """Two independently initialised tiny LLaMAs written sharded, and their models."""
    root = tmp_path_factory.mktemp("pair")
    models = [zoo.build("llama", seed=seed) for seed in (0, 1)]
    return [write_sharded(m, root / f"m{i}") for i, m in enumerate(models)], models


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


# -- writing and reading ---------------------------------------------------------------------------------------------
def test_sharded_checkpoint_loads_back_whole_with_transformers(llama_pair):
    (folder, _), (model, _) = llama_pair
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 2 and all((folder / f).is_file() for f in shard_files)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in model.state_dict().values())
    loaded = symgraph.load(folder).model.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key


def test_lazy_state_reads_each_tensor_in_its_stored_dtype(tmp_path):
    model = zoo.build("llama", seed=3)
    folder = write_sharded(model, tmp_path / "bf16", dtype=torch.bfloat16)
    state = LazyState(folder)
    assert set(state) == set(model.state_dict()) and len(state.files) > 2
    key = "model.layers.0.mlp.down_proj.weight"
    assert state.info(key) == TensorInfo(key, tuple(model.state_dict()[key].shape), torch.bfloat16)
    assert state[key].dtype == torch.bfloat16
    assert torch.equal(state[key], model.state_dict()[key].to(torch.bfloat16))
    assert state.nbytes == sum(v.numel() * 2 for v in model.state_dict().values())


def test_a_shard_missing_from_the_index_is_named(tmp_path, llama_pair):
    (folder, _), _ = llama_pair
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in folder.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    shard = sorted(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())[-1]
    (broken / shard).unlink()
    with pytest.raises(ModelLoadError, match=shard) as info:
        LazyState(broken)
    assert "missing" in str(info.value) and "What to try" in str(info.value)
    code, _, err = run("merge", broken, folder, "--stream", "--align", "none", "-o", tmp_path / "out")
    assert code != 0 and shard in err and not (tmp_path / "out").exists()


def test_a_produced_tensor_that_differs_from_the_plan_is_refused(tmp_path):
    infos = [TensorInfo("w", (2, 2), torch.float32)]
    with pytest.raises(OutputError, match="plan says"):
        write_checkpoint(tmp_path / "out", infos, lambda name: torch.zeros(2, 3))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


class _FillingFile:
    """A file whose disk fills after ``room`` bytes: the next write raises ENOSPC, as a real full disk does."""

    def __init__(self, file, room: list):
        self.file, self.room = file, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room[0] -= size
        return self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


@pytest.mark.parametrize("existing", [False, True])
def test_a_disk_that_fills_while_shards_are_written_leaves_nothing(tmp_path, monkeypatch, existing):
    model = zoo.build("llama", seed=0)
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "config.json").write_text('{"model_type": "llama"}')  # an earlier model output (--overwrite
        # replaces model folders only)
    room = [3 * SMALL_SHARDS]  # the first shards fit, a later one does not
    monkeypatch.setattr(shards, "open", lambda path, mode: _FillingFile(builtins.open(path, mode), room),
                        raising=False)
    state = model.state_dict()
    with pytest.raises(OutputError, match="No space left on device") as info:
        write_checkpoint(out, infos_of(state), state.__getitem__, shard_bytes=SMALL_SHARDS, overwrite=existing)
    assert "partly written files were removed" in str(info.value) and "free disk space" in str(info.value)
    assert room[0] < SMALL_SHARDS  # shards were really written before the disk filled
    assert leftovers(tmp_path) == []
    assert (sorted(p.name for p in out.iterdir()) == ["config.json"]) if existing else not out.exists()


# -- the streamed merge ------------------------------------------------------------------------------------------------
def test_streamed_merge_equals_the_in_memory_simple_merge(tmp_path, llama_pair):
    folders, models = llama_pair
    result = merge_streamed(folders, tmp_path / "streamed", weights=[1, 3], shard_bytes=SMALL_SHARDS)
    expected = merge(models, method="simple", align="none", weights=[1, 3], fold=False, progress=False).state
    streamed = LazyState(result.path)
    assert len(streamed.files) > 2 and set(streamed) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(streamed[key], value, rtol=1e-6, atol=1e-7)
    assert result.weights == (0.25, 0.75) and result.bytes_read == 2 * result.bytes_written
    reloaded = symgraph.load(result.path)  # config copied from the first model: a loadable folder
    assert type(reloaded.model) is type(models[0])


def test_streamed_merge_on_the_command_line_keeps_bf16_and_writes_its_summary(tmp_path):
    folders = [write_sharded(zoo.build("llama", seed=s), tmp_path / f"m{s}", dtype=torch.bfloat16) for s in (0, 1)]
    out, summary = tmp_path / "merged", tmp_path / "merge.json"
    code, stdout, err = run("merge", *folders, "--stream", "--align", "none", "--shard-size", "50KB", "-o", out,
                            "--json", summary)
    assert code == 0, err
    assert "streamed" in stdout and json.loads(summary.read_text())["streamed"] is True
    merged, a, b = LazyState(out), LazyState(folders[0]), LazyState(folders[1])
    key = "model.layers.1.self_attn.q_proj.weight"
    assert merged[key].dtype == torch.bfloat16
    assert torch.equal(merged[key], ((a[key].float() + b[key].float()) / 2).to(torch.bfloat16))
    assert len(merged.files) > 1 and leftovers(tmp_path) == []


@pytest.mark.parametrize("options, named", [
    (["--align", "full"], "--align full"), (["--method", "fisher", "--align", "none"], "--method fisher"),
    (["--align", "none", "--fold"], "--fold")])
def test_streamed_merge_refuses_options_it_cannot_honour(tmp_path, llama_pair, options, named):
    folders, _ = llama_pair
    code, _, err = run("merge", *folders, "--stream", *options, "-o", tmp_path / "out")
    assert code != 0 and named in err and "--stream" in err and not (tmp_path / "out").exists()


def test_streamed_merge_refuses_checkpoints_of_different_sizes(tmp_path, llama_pair):
    folders, _ = llama_pair
    other = write_sharded(zoo.build("llama", seed=0, hidden_size=48), tmp_path / "wide")
    with pytest.raises(MismatchError, match="differ in shape"):
        merge_streamed([folders[0], other], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_streamed_merge_names_a_non_finite_tensor(tmp_path, llama_pair):
    folders, models = llama_pair
    state = dict(models[1].state_dict())
    state["model.norm.weight"] = state["model.norm.weight"].clone()
    state["model.norm.weight"][0] = float("nan")
    bad = save_model(state, tmp_path / "nan", config=model_config(models[1]))
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        merge_streamed([folders[0], bad], tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# -- the 7B pair generator, at tiny sizes -----------------------------------------------------------------------------
TINY = ["--hidden-size", "64", "--num-hidden-layers", "2", "--num-attention-heads", "8", "--num-key-value-heads", "2",
        "--intermediate-size", "96", "--vocab-size", "50", "--shard-gb", "0.00005"]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "pair"
    summary = make_llama_7b_pair.main(["--out", str(out), "--dtype", "float64", "--noise", "0", *TINY])
    return out, summary


def logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    return symgraph.load(folder).model.to(torch.float64)(input_ids=ids).logits


def test_generated_partner_computes_what_a_computes_and_the_independent_one_does_not(tiny_pair):
    out, summary = tiny_pair
    assert json.loads((out / "READY").read_text())["models"].keys() == {"A", "B1", "B2"}
    assert len(LazyState(out / "A").files) > 2  # sharded, with the index
    for shape in ((1, 5), (3, 11)):  # two input shapes; HF's RMSNorm computes in float32: 1e-7 is its floor
        ids = torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(shape[1]))
        a, b1, b2 = (logits(out / name, ids) for name in ("A", "B1", "B2"))
        assert (a - b1).norm() / a.norm() < 1e-5
        assert (a - b2).norm() / a.norm() > 0.1
    a, b1 = LazyState(out / "A"), LazyState(out / "B1")
    moved = [k for k in a if "norm" not in k and (a[k] - b1[k]).norm() > 0.5 * a[k].norm()]
    assert len(moved) == len([k for k in a if "norm" not in k])  # every matrix is moved by the element


def test_generated_noise_is_one_percent_of_each_tensor(tmp_path, tiny_pair):
    out, _ = tiny_pair
    make_llama_7b_pair.main(["--out", str(tmp_path / "noisy"), "--dtype", "float64", "--noise", "0.01", *TINY])
    exact, noisy = LazyState(out / "B1"), LazyState(tmp_path / "noisy" / "B1")
    for key in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        ratio = float((noisy[key] - exact[key]).norm() / exact[key].norm())
        assert 0.008 < ratio < 0.012, (key, ratio)


# -- float64 verification block by block -----------------------------------------------------------------------------
@pytest.mark.slow
def test_block_by_block_verification_accepts_a_transform_and_refuses_another_model(tmp_path, llama_pair, monkeypatch):
    folders, models = llama_pair
    moved = write_checkpoint(tmp_path / "moved", infos_of(models[0].state_dict()),
                             symgraph.transform(models[0], seed=4).__getitem__, shard_bytes=SMALL_SHARDS,
                             config=model_config(models[0]))
    for shape in ((1, 6), (2, 13)):
        ids = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(shape[1]))
        same = verify_streamed(folders[0], moved, {"input_ids": ids})
        assert same.ok and same.relative_error < 1e-5
    other = verify_streamed(folders[0], folders[1], {"input_ids": ids})
    assert not other.ok and other.relative_error > 0.1
    reads = []
    monkeypatch.setattr(LazyState, "__getitem__", lambda self, k, read=LazyState.__getitem__: reads.append(k)
                        or read(self, k))
    streamed_outputs(moved, {"input_ids": ids})
    assert sorted(reads) == sorted(LazyState(moved))  # every tensor read once
    blocks = [int(k.split(".")[2]) for k in reads if k.startswith("model.layers.")]
    assert blocks == sorted(blocks) and len(set(blocks)) > 1  # block by block, in order


def test_block_by_block_outputs_equal_the_whole_model_in_float64(llama_pair):
    (folder, _), (model, _) = llama_pair
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    whole = copy.deepcopy(model).to(torch.float64)(input_ids=ids).logits.reshape(-1)
    torch.testing.assert_close(streamed_outputs(folder, {"input_ids": ids}), whole, rtol=1e-12, atol=1e-12)


def test_compare_on_the_command_line(tmp_path, llama_pair):
    folders, _ = llama_pair
    code, stdout, _ = run("compare", folders[0], folders[0], "--json", tmp_path / "same.json")
    assert code == 0 and "the same function" in stdout
    assert json.loads((tmp_path / "same.json").read_text())["relative_error"] == 0.0
    code, stdout, _ = run("compare", folders[0], folders[1])
    assert code == 1 and "DIFFERENT" in stdout


def test_a_model_whose_code_builds_constants_in_the_default_dtype_compares_in_float64(tmp_path):
    """XGLM builds torch.full((), finfo(float64).min) in the default dtype: block by block in float64 it overflowed
    float32 and crashed compare and every streamed alignment's check, as the in-memory check would without its
    float64 default."""
    from transformers import XGLMConfig, XGLMForCausalLM

    torch.manual_seed(0)
    model = XGLMForCausalLM(XGLMConfig(vocab_size=64, d_model=32, ffn_dim=48, num_layers=2, attention_heads=4,
                                       max_position_embeddings=64)).eval()
    model.save_pretrained(tmp_path / "x")
    code, stdout, stderr = run("compare", tmp_path / "x", tmp_path / "x")
    assert code == 0 and "the same function" in stdout, stderr
    assert torch.get_default_dtype() == torch.float32


def test_a_mixture_of_experts_compares_in_float64_by_the_reference_loop(tmp_path):
    """transformers runs experts by grouped_mm by default, which has no float64 kernel: block by block, compare and
    every streamed check run them by its reference loop, as the in-memory check does."""
    from symgraph.io import model_config, save_model

    model = zoo.build("gpt-oss", seed=0)  # its checkpoints store the experts as the model holds them
    folder = save_model(model.state_dict(), tmp_path / "m", config=model_config(model))
    code, stdout, stderr = run("compare", folder, folder)
    assert code == 0 and "the same function" in stdout, stderr


def test_a_model_that_calls_its_blocks_forward_itself_compares_block_by_block(tmp_path):
    """SqueezeBERT's encoder calls layer.forward(...) directly, past any forward hook: each block's weights must
    still be read before it runs (it ran on the meta device: an internal error)."""
    from transformers import SqueezeBertConfig, SqueezeBertModel

    torch.manual_seed(0)
    model = SqueezeBertModel(SqueezeBertConfig(vocab_size=64, hidden_size=32, embedding_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=48,
                                               max_position_embeddings=64)).eval()
    model.save_pretrained(tmp_path / "s")
    code, stdout, stderr = run("compare", tmp_path / "s", tmp_path / "s")
    assert code == 0 and "the same function" in stdout, stderr


def test_writing_to_a_read_tensor_never_reaches_the_checkpoint(llama_pair):
    (folder, _), (model, _) = llama_pair
    key = "model.embed_tokens.weight"
    LazyState(folder)[key].mul_(0)
    assert torch.equal(LazyState(folder)[key], model.state_dict()[key])
