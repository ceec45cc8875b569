"""Written models lose nothing of their inputs: every stored tensor comes back (or the command refuses, saying
which and why), in its stored dtype, and checkpoints transformers would load otherwise than stored are refused."""
from __future__ import annotations

import json
import re

import pytest
import safetensors.torch
import torch
import transformers

from cli_runner import run
from symgraph import zoo


def _stored(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in safetensors.torch.load_file(f).items()}


def _llama(folder, seed: int, dtype: torch.dtype, norms: torch.dtype | None = None):
    """A llama checkpoint saved by transformers in ``dtype``, its norm weights (away from 1) in ``norms``."""
    model = zoo.build("llama", seed=seed, dtype=dtype)
    if norms is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.data = (1 + 0.3 * torch.randn(param.shape)).to(norms)
    model.save_pretrained(folder)
    return folder


def test_a_merge_of_a_mixed_dtype_checkpoint_with_a_float32_one(tmp_path):
    """bfloat16 weights beside float32 norms are held in float32 and judged run in it (they were run as stored,
    float32 activations meeting bfloat16 weights: an internal error); each tensor is written in the widest dtype
    the models store it in."""
    mixed = _llama(tmp_path / "mixed", 0, torch.bfloat16, norms=torch.float32)
    wide = _llama(tmp_path / "wide", 1, torch.float32)
    code, out, err = run("merge", mixed, wide, "-o", tmp_path / "out")
    assert code == 0, err
    assert "path loss on synthetic" in out  # the frames were judged on synthetic examples
    assert {v.dtype for v in _stored(tmp_path / "out").values()} == {torch.float32}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


def _tied_stored_twice(folder, seed: int, shift: float):
    """A tied llama checkpoint storing its LM head beside the embedding, ``shift`` added to the head."""
    zoo.build("llama-tied", seed=seed).save_pretrained(folder)
    file = folder / "model.safetensors"
    stored = safetensors.torch.load_file(file)
    stored["lm_head.weight"] = stored["model.embed_tokens.weight"] + shift
    safetensors.torch.save_file(stored, file, metadata={"format": "pt"})
    return folder


def test_tied_copies_stored_with_different_values_are_refused(tmp_path):
    """transformers loads them untied, with a warning: the model is not the one config.json describes (it was
    analysed untied, then refused when written, as if symgraph had moved the tie apart)."""
    folder = _tied_stored_twice(tmp_path / "m", 0, 1.0)
    anchor = _tied_stored_twice(tmp_path / "anchor", 1, 0.0)
    for args in (["transform", folder], ["align", folder, anchor, "--stream", "--quiet"]):
        code, _, err = run(*args, "-o", tmp_path / "out")
        assert code == 2 and "stores both with different values" in err and "tie_word_embeddings" in err, err
        assert not (tmp_path / "out").exists()
    code, _, err = run("transform", anchor, "-o", tmp_path / "out")  # equal copies: one tie, as transformers loads
    assert code == 0, err


def _with_extra(folder, family: str, extra: dict[str, torch.Tensor], **overrides):
    """``family``'s checkpoint saved by transformers, with ``extra`` tensors added to it."""
    zoo.build(family, **overrides).save_pretrained(folder)
    file = folder / "model.safetensors"
    safetensors.torch.save_file({**safetensors.torch.load_file(file), **extra}, file, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("family, extra", [
    ("llama", {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(8) for i in range(2)}),
    ("bert", {"bert.embeddings.position_ids": torch.arange(64)[None]}),
    ("gpt2", {f"transformer.h.{i}.attn.bias": torch.ones(1, 1, 64, 64).tril() for i in range(2)}),
])
def test_stored_copies_of_buffers_are_written_as_stored(tmp_path, family, extra):
    """Older checkpoints store buffers the model now computes itself or no longer has (GPT-2's causal mask);
    transformers skips them on loading, and written models dropped them."""
    folder = _with_extra(tmp_path / "m", family, extra)
    for args in (["transform", folder], ["align", folder, folder, "--quiet"]):
        code, _, err = run(*args, "-o", tmp_path / args[0])
        assert code == 0, err
        written = _stored(tmp_path / args[0])
        assert written.keys() == _stored(folder).keys()
        assert all(written[k].dtype == v.dtype and torch.equal(written[k], v) for k, v in extra.items())


def _deepseek_v3_with_mtp(folder, seed: int):
    """A DeepSeek-V3 checkpoint with a multi-token-prediction layer, stored as model.layers.61 (its class skips
    those keys on loading; transformers' MtpModel reads them beside the model)."""
    config = transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    file = folder / "model.safetensors"
    mtp = {"model.layers.61.eh_proj.weight": torch.randn(32, 64), "model.layers.61.enorm.weight": torch.ones(32)}
    safetensors.torch.save_file({**safetensors.torch.load_file(file), **mtp}, file, metadata={"format": "pt"})
    return folder


def test_tensors_the_model_skips_on_loading_are_refused(tmp_path):
    """A written model lost them (in memory) or held them unmoved beside a moved residual stream (streamed)."""
    folder, anchor = _deepseek_v3_with_mtp(tmp_path / "m", 0), _deepseek_v3_with_mtp(tmp_path / "anchor", 1)
    for args in (["transform", folder], ["align", folder, anchor, "--stream", "--quiet"]):
        code, _, err = run(*args, "-o", tmp_path / "out")
        assert code == 2 and "model.layers.61.eh_proj.weight" in err and "does not load" in err, err
        assert not (tmp_path / "out").exists()


def _mixtral(folder, seed: int, dtype_of):
    """A Mixtral checkpoint (experts stored one by one, fused on loading) whose tensors ``dtype_of(name)`` stores."""
    zoo.build("mixtral", seed=seed).save_pretrained(folder)
    file = folder / "model.safetensors"
    stored = safetensors.torch.load_file(file)
    safetensors.torch.save_file({k: v.to(dtype_of(k)) for k, v in stored.items()}, file, metadata={"format": "pt"})
    return folder


def test_experts_stored_in_different_dtypes_are_refused(tmp_path):
    """transformers loads every expert's w1 and w3 into one fused parameter, written back in one dtype: expert 0's
    bfloat16 tensors came back float32 (in memory) or stopped the write with an error blaming symgraph
    (streamed)."""
    def dtype_of(name):
        return torch.bfloat16 if ".experts.0." in name else torch.float32

    folder, anchor = _mixtral(tmp_path / "m", 0, dtype_of), _mixtral(tmp_path / "anchor", 1, dtype_of)
    for args in (["transform", folder], ["align", folder, anchor, "--stream", "--quiet"]):
        code, _, err = run(*args, "-o", tmp_path / "out")
        pair = r"experts\.0\.(w\d)\.weight bfloat16, \S+experts\.1\.\1\.weight float32"  # one of each dtype
        assert code == 2 and re.search(pair, err), err
        assert not (tmp_path / "out").exists()


def test_experts_stored_narrower_than_the_rest_keep_their_dtype(tmp_path):
    """bfloat16 experts beside a float32 router and norms (config dtype bfloat16), and the reverse."""
    for experts, rest in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        def dtype_of(name):
            return experts if ".experts." in name else rest

        folder = _mixtral(tmp_path / f"m-{experts}", 0, dtype_of)
        anchor = _mixtral(tmp_path / f"anchor-{experts}", 1, dtype_of)
        for args in (["transform", folder], ["align", folder, anchor, "--quiet"],
                     ["align", folder, anchor, "--stream", "--quiet"]):
            out = tmp_path / f"out-{experts}-{len(args)}"
            code, _, err = run(*args, "-o", out)
            assert code == 0, err
            assert {k: v.dtype for k, v in _stored(out).items()} == {k: v.dtype for k, v in _stored(folder).items()}


def test_a_streamed_alignment_of_incomplete_checkpoints_names_no_merge(tmp_path):
    """align --stream checks completeness as merge --stream does; its message spoke of a merge."""
    folders = []
    for seed in (0, 1):
        folder = _llama(tmp_path / f"m{seed}", seed, torch.float32)
        stored = safetensors.torch.load_file(folder / "model.safetensors")
        del stored["model.norm.weight"]
        safetensors.torch.save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
        folders.append(folder)
    code, _, err = run("align", *folders, "--stream", "--quiet", "-o", tmp_path / "out")
    assert code == 2 and "model.norm.weight" in err and "at random" in err and "merge" not in err, err


def test_tensors_a_class_builds_itself_need_not_be_stored(tmp_path):
    """Marian never saves its sinusoidal position embeddings (parameters it builds itself and lists as keys it may
    go without): its checkpoints load, and written ones leave them out as save_pretrained does."""
    config = transformers.MarianConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
        decoder_start_token_id=0)
    torch.manual_seed(0)
    transformers.MarianMTModel(config).eval().save_pretrained(tmp_path / "m")
    code, _, err = run("transform", tmp_path / "m", "-o", tmp_path / "out")
    assert code == 0, err
    assert _stored(tmp_path / "out").keys() == _stored(tmp_path / "m").keys()


def _tied_stored_as_head(folder, seed: int):
    """A tied llama checkpoint storing the tie under lm_head.weight (transformers loads the embedding from it)."""
    zoo.build("llama-tied", seed=seed).save_pretrained(folder)
    file = folder / "model.safetensors"
    stored = safetensors.torch.load_file(file)
    stored["lm_head.weight"] = stored.pop("model.embed_tokens.weight")
    safetensors.torch.save_file(stored, file, metadata={"format": "pt"})
    return folder


def test_a_tie_stored_under_its_other_name_keeps_that_name(tmp_path):
    """Written in memory, the tie was renamed to model.embed_tokens.weight (compare then refused the pair);
    streamed, the checkpoint was refused as lacking the embedding, 'initialised at random'."""
    folder, anchor = _tied_stored_as_head(tmp_path / "m", 0), _tied_stored_as_head(tmp_path / "anchor", 1)
    for args in (["transform", folder], ["align", folder, anchor, "--stream", "--quiet"],
                 ["merge", folder, anchor, "--stream", "--align", "none"]):
        out = tmp_path / args[0]
        code, _, err = run(*args, "-o", out)
        assert code == 0, err
        assert _stored(out).keys() == _stored(folder).keys()
    code, out, err = run("compare", folder, tmp_path / "transform")
    assert code == 0 and "the same function" in out, out + err


def test_a_tie_stored_twice_is_written_twice(tmp_path):
    """Both copies equal (transformers ties them on loading): the written model stores both, equal; lm_head.weight
    was dropped."""
    folder = _tied_stored_twice(tmp_path / "m", 0, 0.0)
    for command in ("transform", "fold"):
        code, _, err = run(command, folder, "-o", tmp_path / command)
        assert code == 0, err
        written = _stored(tmp_path / command)
        assert written.keys() == _stored(folder).keys()
    written = _stored(tmp_path / "transform")
    assert torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])


def test_a_submodule_the_config_leaves_out_is_written_as_stored(tmp_path):
    """DeBERTa checkpoints store position embeddings that a model without position_biased_input has no module
    for and never reads (its class skips them on loading)."""
    config = transformers.DebertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=64, position_biased_input=False,
                                        relative_attention=True, pos_att_type=["c2p", "p2c"], num_labels=3)
    torch.manual_seed(0)
    transformers.DebertaForSequenceClassification(config).eval().save_pretrained(tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    extra = {"deberta.embeddings.position_embeddings.weight": torch.randn(64, 32)}
    safetensors.torch.save_file({**safetensors.torch.load_file(file), **extra}, file, metadata={"format": "pt"})
    code, _, err = run("transform", tmp_path / "m", "-o", tmp_path / "out")
    assert code == 0, err
    written = _stored(tmp_path / "out")
    assert written.keys() == _stored(tmp_path / "m").keys()
    assert torch.equal(written["deberta.embeddings.position_embeddings.weight"], extra[next(iter(extra))])
