"""Tests for symgraph.io: loading every kind of MODEL argument, atomic saving, and every error message."""
from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from symgraph import checkpoint, files
from symgraph import io as sio
from symgraph.errors import ModelLoadError, OutputError, SymgraphError

LLAMA_70B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def tiny_bert_config() -> BertConfig:
    return BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37, vocab_size=50)


def tiny_llama_config(**kw) -> LlamaConfig:
    base = dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=24,
        vocab_size=40, max_position_embeddings=32,
    )
    base.update(kw)
    return LlamaConfig(**base)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("models") / "tiny-bert"
    BertModel(tiny_bert_config()).eval().save_pretrained(folder)
    # tokenizer-ish files that save_model must carry over from `like`
    (folder / "vocab.txt").write_text("\n".join(f"tok{i}" for i in range(50)) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    return folder


def ids() -> torch.Tensor:
    return torch.tensor([[1, 5, 7, 3, 2, 9]])


def bert_out(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids()).last_hidden_state


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def copy_without_weights(src: Path, dst: Path) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ---------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------


def test_load_folder_and_round_trip(bert_dir, tmp_path):
    loaded = sio.load_model(bert_dir)
    assert isinstance(loaded.model, BertModel)
    assert not loaded.model.training
    assert loaded.path == bert_dir.resolve()
    assert loaded.name == "tiny-bert"
    assert isinstance(loaded.config, BertConfig) and loaded.config.hidden_size == 32
    assert not loaded.is_meta

    sd = sio.state_dict_of(loaded.model)
    out = sio.save_model(sd, tmp_path / "copy", like=bert_dir)
    assert out == (tmp_path / "copy").resolve()
    assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert (out / "vocab.txt").read_bytes() == (bert_dir / "vocab.txt").read_bytes()

    again = sio.load_model(str(out))
    assert_same_state(sd, sio.state_dict_of(again.model))
    torch.testing.assert_close(bert_out(loaded.model), bert_out(again.model), rtol=0, atol=0)
    # the stored keys are exactly the original checkpoint's keys
    assert set(safetensors.torch.load_file(out / "model.safetensors")) == set(
        safetensors.torch.load_file(bert_dir / "model.safetensors")
    )


def test_save_with_config_object_and_no_like(bert_dir, tmp_path):
    loaded = sio.load_model(bert_dir)
    out = sio.save_model(sio.state_dict_of(loaded.model), tmp_path / "cfg", config=loaded.config)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    again = sio.load_model(out)
    assert_same_state(sio.state_dict_of(loaded.model), sio.state_dict_of(again.model))


def test_save_with_config_dict(tmp_path, bert_dir):
    loaded = sio.load_model(bert_dir)
    state = sio.state_dict_of(loaded.model)
    out = sio.save_model(state, tmp_path / "d", config={**loaded.config.to_dict(), "x": 1})
    assert json.loads((out / "config.json").read_text())["x"] == 1
    assert sio.load_model(out).model.state_dict().keys() == state.keys()
    # a config that describes another model than the tensors: refused, nothing written
    with pytest.raises(OutputError, match="does not match BertModel") as info:
        sio.save_model({"w": torch.ones(2)}, tmp_path / "e", config={"model_type": "bert"})
    assert "not in the model 1: w" in str(info.value) and not (tmp_path / "e").exists()


def test_load_sharded_folder(bert_dir, tmp_path):
    model = sio.load_model(bert_dir).model
    shard_dir = tmp_path / "sharded"
    model.save_pretrained(shard_dir, max_shard_size="20KB")
    assert (shard_dir / "model.safetensors.index.json").is_file()
    assert len(list(shard_dir.glob("model-*-of-*.safetensors"))) > 1
    again = sio.load_model(shard_dir)
    assert_same_state(sio.state_dict_of(model), sio.state_dict_of(again.model))


def test_load_pytorch_bin(bert_dir, tmp_path):
    model = sio.load_model(bert_dir).model
    folder = copy_without_weights(bert_dir, tmp_path / "bin")
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    again = sio.load_model(folder)
    assert_same_state(sio.state_dict_of(model), sio.state_dict_of(again.model))


def test_dtype_is_passed(bert_dir):
    for dtype in (torch.float64, "float64"):
        loaded = sio.load_model(bert_dir, dtype=dtype)
        assert {p.dtype for p in loaded.model.parameters()} == {torch.float64}
    meta = sio.load_model(bert_dir, config_only=True, dtype=torch.bfloat16)
    assert {p.dtype for p in meta.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ModelLoadError, match="flaot32"):
        sio.load_model(bert_dir, dtype="flaot32")


def test_architecture_class_is_used_and_unknown_falls_back_to_automodel(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(tiny_llama_config(architectures=["LlamaForCausalLM"]).to_json_string())
    assert type(sio.load_model(folder, config_only=True).model) is LlamaForCausalLM

    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MyCustomLlamaThing"]
    (folder / "config.json").write_text(json.dumps(cfg))
    assert type(sio.load_model(folder, config_only=True).model) is transformers.LlamaModel


def test_tied_weights_saved_once_like_the_reference(tmp_path):
    torch.manual_seed(1)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True)).eval()
    ref = tmp_path / "ref"
    model.save_pretrained(ref)
    loaded = sio.load_model(ref)
    sd = sio.state_dict_of(loaded.model)
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()  # tied: shared storage

    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = loaded.model(input_ids=x, use_cache=False).logits

    like_out = sio.save_model(sd, tmp_path / "like", like=ref)
    assert "lm_head.weight" not in safetensors.torch.load_file(like_out / "model.safetensors")

    # the tie is read from the model the config describes, with or without `like`
    plain_out = sio.save_model(sd, tmp_path / "plain", config=loaded.config)
    assert "lm_head.weight" not in safetensors.torch.load_file(plain_out / "model.safetensors")

    for out in (like_out, plain_out):
        again = sio.load_model(out).model
        with torch.no_grad():
            torch.testing.assert_close(again(input_ids=x, use_cache=False).logits, expected, rtol=0, atol=0)


def test_module_source_wrapped_with_its_own_tensors():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    net.train()
    loaded = sio.load_model(net)
    assert loaded.model[0].weight is net[0].weight and not loaded.model.training and net.training
    assert loaded.config is None and loaded.path is None and loaded.name == "Sequential"

    bert = BertModel(tiny_bert_config())
    config = sio.load_model(bert).config  # names the class, so a saved folder loads back as this class
    assert config.architectures == ["BertModel"] and config.hidden_size == bert.config.hidden_size
    assert not bert.config.architectures  # the model's own config is left alone


# ---------------------------------------------------------------------------------------------------------------
# config-only
# ---------------------------------------------------------------------------------------------------------------


def all_meta(model: torch.nn.Module) -> bool:
    """Every parameter on meta; buffers (rotary tables, position ids) may be real but must stay tiny."""
    params = list(model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers() if b.device.type != "meta")
    return bool(params) and all(p.device.type == "meta" for p in params) and buffer_bytes < 2**20


def test_config_only_folder_and_file(bert_dir, tmp_path):
    folder = copy_without_weights(bert_dir, tmp_path / "cfg-only")
    for source in (folder, folder / "config.json", str(folder / "config.json"), bert_dir):
        loaded = sio.load_model(source, config_only=True)
        assert all_meta(loaded.model), source
        assert loaded.is_meta
        assert not loaded.model.training
        assert isinstance(loaded.config, BertConfig)
    # shapes are the real ones
    real = sio.state_dict_of(sio.load_model(bert_dir).model)
    meta = sio.state_dict_of(sio.load_model(folder, config_only=True).model)
    assert {k: v.shape for k, v in real.items()} == {k: v.shape for k, v in meta.items()}


def test_config_only_llama_70b_allocates_nothing(tmp_path):
    """Every parameter of a 70B config-only model is on the meta device. Its time is a benchmark's (the 70B config
    report, issue 11), not a unit test's: a 5 s bound here failed at 128 s on a loaded 2-core machine."""
    config_file = tmp_path / "llama-70b.json"
    config_file.write_text(json.dumps(LLAMA_70B))
    loaded = sio.load_model(config_file, config_only=True)
    assert type(loaded.model) is LlamaForCausalLM
    assert all_meta(loaded.model)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    assert 69e9 < n_params < 72e9
    assert loaded.name == "llama-70b"
    assert loaded.path == tmp_path.resolve()


# ---------------------------------------------------------------------------------------------------------------
# factories
# ---------------------------------------------------------------------------------------------------------------

FACTORY_SOURCE = textwrap.dedent(
    """
    import torch

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).train()

    class Builders:
        @staticmethod
        def small():
            return torch.nn.Linear(2, 2)

    def not_a_module():
        return {"weight": torch.zeros(2)}

    def broken():
        raise RuntimeError("boom in factory")

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text(FACTORY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_factories.py"


def test_factory_module_string(factory_module):
    loaded = sio.load_model("my_factories:make")
    assert isinstance(loaded.model, torch.nn.Sequential) and not loaded.model.training
    assert loaded.name == "my_factories:make" and loaded.path is None
    assert isinstance(sio.load_model("my_factories:Builders.small").model, torch.nn.Linear)
    assert sio.load_model("my_factories:make", dtype=torch.float64).model[0].weight.dtype == torch.float64


def test_factory_file_string(tmp_path):
    file = tmp_path / "sub" / "build_model.py"
    file.parent.mkdir()
    (file.parent / "helper_mod_for_io_test.py").write_text("WIDTH = 5\n")
    file.write_text(
        "import torch\nfrom helper_mod_for_io_test import WIDTH\n\n"
        "def build():\n    return torch.nn.Linear(WIDTH, 3)\n"
    )
    loaded = sio.load_model(f"{file}:build")
    assert isinstance(loaded.model, torch.nn.Linear) and loaded.model.in_features == 5
    assert not loaded.model.training


# ---------------------------------------------------------------------------------------------------------------
# load errors: each is a ModelLoadError naming the offending path or string
# ---------------------------------------------------------------------------------------------------------------


def load_error(*args, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as info:
        sio.load_model(*args, **kwargs)
    assert isinstance(info.value, SymgraphError)
    return str(info.value)


def test_error_missing_path(tmp_path):
    missing = tmp_path / "nope"
    assert str(missing) in load_error(missing)
    msg = load_error(str(missing))
    assert str(missing) in msg and "does not exist" in msg


def test_error_folder_without_config(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    msg = load_error(folder)
    assert str(folder) in msg and "config.json" in msg


def test_error_invalid_json_reports_line_and_column(tmp_path):
    folder = tmp_path / "badjson"
    folder.mkdir()
    (folder / "config.json").write_text('{\n  "model_type": "bert",\n  "hidden_size": ,\n}\n')
    msg = load_error(folder, config_only=True)
    assert str(folder / "config.json") in msg
    assert "line 3" in msg and "column 18" in msg


def test_error_unknown_model_type_suggests_close_ones(tmp_path):
    folder = tmp_path / "typo"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "lamma", "hidden_size": 8}))
    msg = load_error(folder, config_only=True)
    assert "'lamma'" in msg and str(folder / "config.json") in msg
    assert "llama" in msg and transformers.__version__ in msg

    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))  # no model_type, no architectures
    assert "model_type" in load_error(folder, config_only=True)

    (folder / "config.json").write_text(json.dumps({"model_type": "zzzqqq"}))
    assert "llama" in load_error(folder, config_only=True)  # no close match: a few common ones are listed


def test_error_truncated_and_garbage_safetensors(bert_dir, tmp_path):
    data = (bert_dir / "model.safetensors").read_bytes()
    for name, payload in (("trunc", data[: len(data) // 2]), ("garbage", b"not a safetensors file" * 4)):
        folder = copy_without_weights(bert_dir, tmp_path / name)
        (folder / "model.safetensors").write_bytes(payload)
        msg = load_error(folder)
        assert str(folder / "model.safetensors") in msg
        assert "corrupt or truncated" in msg


def test_error_missing_shard(bert_dir, tmp_path):
    shard_dir = tmp_path / "sharded"
    sio.load_model(bert_dir).model.save_pretrained(shard_dir, max_shard_size="20KB")
    victim = sorted(shard_dir.glob("model-*-of-*.safetensors"))[-1]
    victim.unlink()
    msg = load_error(shard_dir)
    assert victim.name in msg and "missing" in msg


def test_a_tensor_in_two_shards_must_hold_one_value(bert_dir, tmp_path):
    """transformers loads a duplicated tensor from the later shard whatever the index names: two different copies
    leave the model undefined, so loading and streaming refuse them, naming both shards; equal copies load."""
    from symgraph.lazy_state import LazyState

    shard_dir = tmp_path / "sharded"
    sio.load_model(bert_dir).model.save_pretrained(shard_dir, max_shard_size="20KB")
    first, *_, last = sorted(shard_dir.glob("model-*-of-*.safetensors"))
    name, value = next(iter(safetensors.torch.load_file(first).items()))
    tensors = safetensors.torch.load_file(last)
    safetensors.torch.save_file({**tensors, name: value.clone()}, last, metadata={"format": "pt"})
    assert len(LazyState(shard_dir)) == len(sio.load_model(shard_dir).model.state_dict())  # equal copies: fine

    safetensors.torch.save_file({**tensors, name: value + 1}, last, metadata={"format": "pt"})
    msg = load_error(shard_dir)
    assert name in msg and first.name in msg and last.name in msg and "different values" in msg
    with pytest.raises(ModelLoadError, match="two shards with different values"):
        LazyState(shard_dir)


def test_error_no_weights_says_config_only(bert_dir, tmp_path):
    folder = copy_without_weights(bert_dir, tmp_path / "noweights")
    msg = load_error(folder)
    assert str(folder / "config.json") in msg and "--config-only" in msg
    assert "--config-only" in load_error(folder / "config.json")


def test_error_mismatched_weights_are_wrapped(bert_dir, tmp_path):
    folder = copy_without_weights(bert_dir, tmp_path / "mismatch")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_size"] = 64
    cfg["intermediate_size"] = 40
    (folder / "config.json").write_text(json.dumps(cfg))
    shutil.copy(bert_dir / "model.safetensors", folder / "model.safetensors")
    msg = load_error(folder)
    assert str(folder) in msg
    assert "file (32,) vs config (64,)" in msg  # the shapes are spelled out, not left in a log


def test_error_unimportable_factory_names_all_three_interpretations(factory_module):
    msg = load_error("no_such_pkg_xyz.models:make")
    assert "no_such_pkg_xyz.models:make" in msg
    assert "not a folder" in msg and "not a config file" in msg and "not an importable factory" in msg
    assert "ModuleNotFoundError" in msg

    msg = load_error("my_factories:missing_fn")
    assert "my_factories" in msg and "missing_fn" in msg
    assert "NOT_CALLABLE" in load_error("my_factories:NOT_CALLABLE")
    assert "does not exist" in load_error("just-a-name-without-colon")


def test_error_factory_returns_non_module_or_raises(factory_module):
    msg = load_error("my_factories:not_a_module")
    assert "my_factories:not_a_module" in msg and "dict" in msg and "nn.Module" in msg
    msg = load_error("my_factories:broken")
    assert "my_factories:broken" in msg and "boom in factory" in msg
    msg = load_error(f"{factory_module}:not_a_module")
    assert str(factory_module) in msg


def test_error_factory_file_problems(tmp_path):
    missing = tmp_path / "missing.py"
    msg = load_error(f"{missing}:build")
    assert str(missing) in msg and "does not exist" in msg

    bad = tmp_path / "bad_import.py"
    bad.write_text("raise ValueError('module-level failure')\n")
    msg = load_error(f"{bad}:build")
    assert str(bad) in msg and "module-level failure" in msg

    assert "function_name" in load_error(bad)  # a .py path without ':function'


def test_error_wrong_source_type():
    assert "int" in load_error(42)


# ---------------------------------------------------------------------------------------------------------------
# saving: atomicity, overwrite, failures, inputs untouched
# ---------------------------------------------------------------------------------------------------------------


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_save_refuses_existing_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    with pytest.raises(OutputError) as info:
        sio.save_model({"w": torch.zeros(2)}, out)
    assert str(out) in str(info.value) and "--overwrite" in str(info.value)
    assert listing(out) == {"keep.txt": b"keep"}

    file_out = tmp_path / "a_file"
    file_out.write_text("x")
    with pytest.raises(OutputError, match="exists and is a file"):
        sio.save_model({"w": torch.zeros(2)}, file_out, overwrite=True)
    assert file_out.read_text() == "x"


def test_save_overwrite_replaces_folder(tmp_path):
    out = tmp_path / "out"
    sio.save_model({"w": torch.zeros(2)}, out)
    (out / "pytorch_model.bin").write_text("old")  # a stale model file: the folder is replaced whole
    sio.save_model({"w": torch.ones(3)}, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert torch.equal(safetensors.torch.load_file(out / "model.safetensors")["w"], torch.ones(3))
    assert leftovers(tmp_path) == []
    assert (out.stat().st_mode & 0o777) == 0o755


def test_save_overwrite_keeps_a_folder_holding_other_things(tmp_path):
    """A file a written model does not carry (notes, a model card) is not deleted: the overwrite is refused."""
    out = tmp_path / "out"
    sio.save_model({"w": torch.zeros(2)}, out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt"):
        sio.save_model({"w": torch.ones(3)}, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert torch.equal(safetensors.torch.load_file(out / "model.safetensors")["w"], torch.zeros(2))


def test_save_failure_mid_write_leaves_nothing(tmp_path, monkeypatch, bert_dir):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    out = tmp_path / "out"
    with pytest.raises(OutputError) as info:
        sio.save_model(sio.state_dict_of(sio.load_model(bert_dir).model), out, like=bert_dir)
    assert str(out) in str(info.value) and "No space left on device" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_a_failed_copy_of_a_side_file_names_the_file(tmp_path, monkeypatch, bert_dir):
    """A tokenizer or config file that cannot be copied is named, with where it was copied to."""
    import shutil

    def unreadable(src, dst, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(src), None, str(dst))

    monkeypatch.setattr(shutil, "copy2", unreadable)
    out = tmp_path / "out"
    with pytest.raises(OutputError) as info:
        sio.save_model(sio.state_dict_of(sio.load_model(bert_dir).model), out, like=bert_dir, config=None)
    assert "Permission denied" in str(info.value) and str(bert_dir) in str(info.value), info.value
    assert not out.exists() and leftovers(tmp_path) == []


def test_save_failure_keeps_existing_folder_untouched(tmp_path, monkeypatch):
    out = tmp_path / "out"
    sio.save_model({"w": torch.zeros(2)}, out)
    before = listing(out)

    def permission_denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(safetensors.torch, "save_file", permission_denied)
    with pytest.raises(OutputError, match="Permission denied"):
        sio.save_model({"w": torch.ones(2)}, out, overwrite=True)
    assert listing(out) == before
    assert leftovers(tmp_path) == []


def test_save_failure_during_swap_restores_old_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)  # a system without renameat2: two renames
    out = tmp_path / "out"
    sio.save_model({"w": torch.zeros(2)}, out)
    before = listing(out)
    real_rename = os.rename
    calls = []

    def flaky_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # 1: old folder aside, 2: new folder in -> fails
            raise OSError(5, "Input/output error")
        return real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", flaky_rename)
    with pytest.raises(OutputError, match="Input/output error"):
        sio.save_model({"w": torch.ones(2)}, out, overwrite=True)
    assert listing(out) == before
    assert leftovers(tmp_path) == []


def test_save_unwritable_parent(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint, "temp_sibling", refuse)
    out = tmp_path / "ro" / "out"
    with pytest.raises(OutputError) as info:
        sio.save_model({"w": torch.zeros(2)}, out)
    assert str(out) in str(info.value)


def test_save_rejects_meta_and_non_tensor_entries(tmp_path):
    with pytest.raises(OutputError, match="meta"):
        sio.save_model({"w": torch.empty(2, device="meta")}, tmp_path / "m")
    with pytest.raises(OutputError, match="'n'"):
        sio.save_model({"n": 3}, tmp_path / "n")
    with pytest.raises(OutputError, match="nope"):
        sio.save_model({"w": torch.zeros(1)}, tmp_path / "l", like=tmp_path / "nope")
    assert not any(tmp_path.iterdir())


def test_save_does_not_modify_inputs(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    param = torch.nn.Parameter(torch.randn(3, 3))
    sd = {
        "base": base,
        "tied": base,  # same tensor twice
        "view_t": base.t(),  # non-contiguous view of the same storage
        "slice": base[1:3],  # contiguous view, offset into the storage
        "param": param,  # requires grad
        "int_buf": torch.tensor([1, 2, 3]),
    }
    snapshot = {k: (v.detach().clone(), v.data_ptr(), v.stride(), v.requires_grad) for k, v in sd.items()}
    keys_before = list(sd)

    out = sio.save_model(sd, tmp_path / "out")
    assert list(sd) == keys_before
    for k, v in sd.items():
        value, ptr, stride, grad = snapshot[k]
        assert torch.equal(v.detach(), value) and v.data_ptr() == ptr and v.stride() == stride
        assert v.requires_grad == grad
    assert base.untyped_storage().data_ptr() == sd["view_t"].untyped_storage().data_ptr()

    saved = safetensors.torch.load_file(out / "model.safetensors")
    assert saved.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(saved[k], v.detach()), k


def test_state_dict_of_includes_persistent_buffers_only():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("kept", torch.ones(2))
            self.register_buffer("scratch", torch.zeros(2), persistent=False)

    net = Net()
    sd = sio.state_dict_of(net)
    assert set(sd) == {"lin.weight", "lin.bias", "kept"}
    assert all(not v.requires_grad for v in sd.values())
    assert sd["lin.weight"].data_ptr() == net.lin.weight.data_ptr()  # no copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_all_finite_finds_every_nan_and_inf(dtype):
    """symgraph.io.all_finite (one aminmax pass) says what isfinite(t).all() says, wherever the bad value sits."""
    from symgraph.io import all_finite

    base = torch.randn(7, 9).to(dtype)
    assert all_finite(base) and all_finite(base[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in [(0, 0), (3, 4), (6, 8)]:
            t = base.clone()
            t[where] = bad
            assert not all_finite(t) and not torch.isfinite(t).all()


@pytest.mark.slow
def test_a_config_holding_infinity_loads_as_transformers_writes_it(tmp_path):
    """transformers writes floats JSON has no number for as objects ({"__float__": "Infinity"}: Mamba2's
    time_step_limit); such a checkpoint must load, be aligned and merged, and what is written must load again."""
    import symgraph
    from cli_runner import run

    config = transformers.AutoConfig.for_model(
        "mamba2", num_heads=8, head_dim=16, vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=2,
        n_groups=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    assert config.time_step_limit[1] == float("inf")
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(tmp_path / f"m{seed}")
        folders.append(tmp_path / f"m{seed}")
    assert "__float__" in (folders[0] / "config.json").read_text()
    loaded = sio.load_model(folders[0])
    assert loaded.config.time_step_limit[1] == float("inf")
    assert symgraph.analyze(symgraph.load(folders[0], config_only=True)).groups
    code, _, err = run("merge", folders[0], folders[1], "-o", tmp_path / "merged", "--no-progress", "--align",
                       "permutation")
    assert code == 0, err
    assert transformers.AutoConfig.from_pretrained(tmp_path / "merged").time_step_limit[1] == float("inf")
    assert sio.load_model(tmp_path / "merged").config.time_step_limit[1] == float("inf")


def test_a_model_type_that_reuses_another_types_classes_loads_and_saves_with_its_head(tmp_path):
    """InternLM3's causal LM is LlamaForCausalLM (whose own config class is LlamaConfig): its architectures names
    it, transformers' Auto classes build it for InternLM3Config, and so must loading and saving, head included
    (the bare LlamaModel had refused the lm_head in the file, and every write)."""
    import symgraph
    from cli_runner import run

    config = transformers.AutoConfig.for_model("internlm3", hidden_size=32, intermediate_size=48,
                                               num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                               vocab_size=64, head_dim=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model) is LlamaForCausalLM and type(model.config).__name__ == "InternLM3Config"
    model.save_pretrained(tmp_path / "m")
    loaded = sio.load_model(tmp_path / "m")
    assert type(loaded.model) is LlamaForCausalLM
    assert torch.equal(loaded.model.lm_head.weight, model.lm_head.weight)
    code, _, err = run("fold", tmp_path / "m", "-o", tmp_path / "folded")
    assert code == 0, err
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folded")
    x = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.allclose(folded(x).logits, model(x).logits, atol=1e-5)
    assert symgraph.analyze(symgraph.load(tmp_path / "m", config_only=True)).groups
