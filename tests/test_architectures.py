"""One end-to-end test per architecture family: the expected groups (motif, kind, size x copies, count), the
structural facts of DESIGN section 3, and invariance of every group in float64.

The table below was reviewed against DESIGN.md section 3 (see each family's comment); a change to it is a change
of what symgraph claims about that architecture and needs the same review.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

from symgraph import zoo
from symgraph.fuzz import fuzz

# Notes on the less obvious entries:
# - post-LN encoders (bert, roberta, distilbert, deberta-v2) and pre-LN LayerNorm models: residual permutations
#   with one global sign (LayerNorm centering commutes only with Q 1 = +-1); pre-RMSNorm models: signed perms.
# - bert/roberta "ffn signed_permutation 32x1" is the tanh pooler; distilbert "ffn permutation/positive 32" is its
#   ReLU pre-classifier.
# - qk "scale/nonzero 1xH" is the paper's per-head rescale; RoPE models get "rotary" instead (it contains it).
# - llama-family GQA: qk/vo copies = KV heads (2), heads "2x1" permutes KV groups, "2x2" query heads within.
# - qwen3: the per-head QK-norm weight is shared by all heads and RoPE pairs coordinates, leaving +-1 per pair.
# - t5, bart, clip: no residual group, because the encoder's last hidden state is a model output and the
#   embeddings are shared with the decoder; t5's heads are shared across each stack (relative-bias table).
#   The pinned residual still leaves each pre-norm weight its scale_free trade with the linears that read it
#   (t5: 4 encoder + 6 decoder norms; clip: 2 per layer in both towers, and post_layernorm with the projection).
EXPECTED = {
    "bert": {
        "ffn permutation 64x1": 2,
        "ffn signed_permutation 32x1": 1,
        "heads permutation 4x1": 2,
        "qk orthogonal 8x4": 2,
        "qk scale/nonzero 1x4": 2,
        "residual permutation/global_sign 32x1": 1,
        "scale_free scale/nonzero 32x1": 1,
        "vo orthogonal 8x4": 2,
    },
    "roberta": {
        "ffn permutation 64x1": 2,
        "ffn signed_permutation 32x1": 1,
        "heads permutation 4x1": 2,
        "qk orthogonal 8x4": 2,
        "qk scale/nonzero 1x4": 2,
        "residual permutation/global_sign 32x1": 1,
        "scale_free scale/nonzero 32x1": 1,
        "vo orthogonal 8x4": 2,
    },
    "distilbert": {
        "ffn permutation 64x1": 2,
        "ffn permutation/positive 32x1": 1,
        "heads permutation 4x1": 2,
        "qk orthogonal 8x4": 2,
        "qk scale/nonzero 1x4": 2,
        "residual permutation/global_sign 32x1": 1,
        "scale_free scale/nonzero 32x1": 1,
        "vo orthogonal 8x4": 2,
    },
    "deberta-v2": {
        "ffn permutation 32x1": 1,
        "ffn permutation 64x1": 2,
        "heads permutation 4x1": 2,
        "other general_linear 32x1": 1,
        "qk orthogonal 8x4": 2,
        "qk scale/nonzero 1x4": 2,
        "residual permutation/global_sign 32x1": 1,
        "scale_free scale/nonzero 32x1": 1,
        "vo orthogonal 8x4": 2,
    },
    "vit": {
        "ffn permutation 64x1": 2,
        "heads permutation 4x1": 2,
        "qk orthogonal 8x4": 2,
        "qk scale/nonzero 1x4": 2,
        "residual permutation/global_sign 32x1": 1,
        "scale_free scale/nonzero 32x1": 5,
        "vo orthogonal 8x4": 2,
    },
    "gpt2": {
        "ffn permutation 64x1": 2,
        "heads permutation 4x1": 2,
        "qk orthogonal 8x4": 2,
        "qk scale/nonzero 1x4": 2,
        "residual permutation/global_sign 32x1": 1,
        "scale_free scale/nonzero 32x1": 4,
        "vo orthogonal 8x4": 2,
    },
    "gptj": {
        "ffn permutation 128x1": 2,
        "heads permutation 4x1": 2,
        "qk rotary/positive 16x4": 2,
        "residual permutation/global_sign 64x1": 1,
        "scale_free scale/nonzero 64x1": 3,
        "vo orthogonal 16x4": 2,
    },
    "gpt-neox": {
        "ffn permutation 128x1": 2,
        "heads permutation 4x1": 2,
        "qk rotary/positive 16x4": 2,
        "residual permutation/global_sign 64x1": 1,
        "scale_free scale/nonzero 64x1": 5,
        "vo orthogonal 16x4": 2,
    },
    "llama": {
        "ffn permutation 128x1": 2,
        "ffn scale/nonzero 128x1": 2,
        "heads permutation 2x1": 2,
        "heads permutation 2x2": 2,
        "qk rotary/positive 16x2": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 64x1": 5,
        "vo orthogonal 16x2": 2,
    },
    "llama-tied": {
        "ffn permutation 128x1": 2,
        "ffn scale/nonzero 128x1": 2,
        "heads permutation 2x1": 2,
        "heads permutation 2x2": 2,
        "qk rotary/positive 16x2": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 64x1": 4,
        "vo orthogonal 16x2": 2,
    },
    "mistral": {
        "ffn permutation 128x1": 2,
        "ffn scale/nonzero 128x1": 2,
        "heads permutation 2x1": 2,
        "heads permutation 2x2": 2,
        "qk rotary/positive 16x2": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 64x1": 5,
        "vo orthogonal 16x2": 2,
    },
    "qwen2": {
        "ffn permutation 128x1": 2,
        "ffn scale/nonzero 128x1": 2,
        "heads permutation 2x1": 2,
        "heads permutation 2x2": 2,
        "qk rotary/positive 16x2": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 64x1": 5,
        "vo orthogonal 16x2": 2,
    },
    "qwen3": {
        "ffn permutation 128x1": 2,
        "ffn scale/nonzero 128x1": 2,
        "heads permutation 2x1": 2,
        "heads permutation 2x2": 2,
        "qk scale/sign 8x1": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 64x1": 5,
        "vo orthogonal 16x2": 2,
    },
    "phi": {
        "ffn permutation 128x1": 2,
        "heads permutation 4x1": 2,
        "qk rotary/positive 16x4": 2,
        "residual permutation/global_sign 64x1": 1,
        "scale_free scale/nonzero 64x1": 3,
        "vo orthogonal 16x4": 2,
    },
    "t5": {
        "ffn permutation/positive 64x1": 4,
        "heads permutation 4x1": 4,
        "qk orthogonal 8x4": 6,
        "qk scale/nonzero 1x4": 6,
        "scale_free scale/nonzero 32x1": 10,
        "vo orthogonal 8x4": 6,
    },
    "bart": {
        "ffn permutation 64x1": 4,
        "heads permutation 4x1": 6,
        "qk orthogonal 8x4": 6,
        "qk scale/nonzero 1x4": 6,
        "vo orthogonal 8x4": 6,
    },
    "opt": {
        "ffn permutation/positive 64x1": 2,
        "heads permutation 4x1": 2,
        "qk orthogonal 8x4": 2,
        "qk scale/nonzero 1x4": 2,
        "residual permutation/global_sign 32x1": 1,
        "scale_free scale/nonzero 32x1": 4,
        "vo orthogonal 8x4": 2,
    },
    "clip": {
        "ffn permutation 64x1": 4,
        "heads permutation 4x1": 4,
        "qk orthogonal 8x4": 4,
        "qk scale/nonzero 1x4": 4,
        "scale_free scale/nonzero 32x1": 9,
        "vo orthogonal 8x4": 4,
    },
    # Mixtures of experts (symgraph.moe): "experts permutation 4x1" moves whole experts with their router rows;
    # "ffn permutation 32x1" is one unit permutation shared by every expert of a layer (a subgroup: each expert's
    # units may permute on their own, which a parameter-axis member cannot express); fused gate_up rows get no
    # up/down scale yet. Shared experts are ordinary SwiGLU FFNs (permutation + up/down scale).
    "mixtral": {
        "experts permutation 4x1": 2,
        "ffn permutation 32x1": 2,
        "ffn scale/nonzero 32x1": 2,
        "heads permutation 2x1": 2,
        "heads permutation 2x2": 2,
        "qk rotary/positive 16x2": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 64x1": 5,
        "vo orthogonal 16x2": 2,
    },
    # qwen2-moe: sigmoid(shared_expert_gate(x)) is one scalar per token: it scales the shared expert's output
    # without varying along the residual stream, which keeps its signed permutation.
    "qwen2-moe": {
        "experts permutation 4x1": 2,
        "ffn permutation 32x1": 2,
        "ffn scale/nonzero 32x1": 2,
        "ffn permutation 48x1": 2,
        "ffn scale/nonzero 48x1": 2,
        "heads permutation 2x1": 2,
        "heads permutation 2x2": 2,
        "qk rotary/positive 16x2": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 64x1": 5,
        "vo orthogonal 16x2": 2,
    },
    # olmoe: full-width q/k RMSNorm before the head split leaves one sign per coordinate pair of QK.
    "olmoe": {
        "experts permutation 4x1": 2,
        "ffn permutation 32x1": 2,
        "ffn scale/nonzero 32x1": 2,
        "heads permutation 2x1": 2,
        "heads permutation 2x2": 2,
        "qk scale/sign 8x2": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 64x1": 5,
        "vo orthogonal 16x2": 2,
    },
    # deepseek-v2: layer 0 is dense (FFN 32 with up/down scale), layer 1 routed experts plus a shared expert;
    # its keys are written piece by piece into a new_empty buffer with copy_ (a concatenation: values and whole
    # heads keep their groups). Every query head's rotary half meets the one shared rotary key: those classes form
    # one rotary block, and each head's non-rotary query/key dims its own (orthogonal, with a scale).
    "deepseek-v2": {
        "experts permutation 4x1": 1,
        "ffn permutation 32x1": 3,
        "ffn scale/nonzero 32x1": 3,
        "heads permutation 4x1": 2,
        "qk orthogonal 8x4": 2,
        "qk rotary/positive 8x1": 2,
        "qk scale/nonzero 1x4": 2,
        "vo orthogonal 16x4": 2,
        "other signed_permutation 16x1": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 16x1": 2,
        "scale_free scale/nonzero 64x1": 5,
    },
    # gpt-oss: expert and router biases move with the experts; the attention sinks (one logit per head, joined to
    # the scores before their row max) move with their heads.
    "gpt-oss": {
        "experts permutation 4x1": 2,
        "ffn permutation 32x1": 2,
        "heads permutation 2x1": 2,
        "heads permutation 2x2": 2,
        "qk rotary/positive 16x2": 2,
        "residual signed_permutation 64x1": 1,
        "scale_free scale/nonzero 64x1": 5,
        "vo orthogonal 16x2": 2,
    },
    "torch-encoder-layer": {
        "ffn permutation/positive 64x1": 1,
        "heads permutation 4x1": 1,
        "qk orthogonal 8x4": 1,
        "qk scale/nonzero 1x4": 1,
        "vo orthogonal 8x4": 1,
    },
    "torch-mha": {
        "heads permutation 4x1": 1,
        "qk orthogonal 8x4": 1,
        "qk scale/nonzero 1x4": 1,
        "vo orthogonal 8x4": 1,
    },
    "torch-relu-mlp": {
        "ffn permutation/positive 48x1": 1,
        "ffn permutation/positive 64x1": 1,
    },
}


# Ops no spec describes yet: they pin what they touch (sound), and the table above reflects that.
PINNED_BY_UNKNOWN_OPS: dict[str, set[str]] = {}  # none left (gpt-oss's attention-sink max.dim has a spec now)


def signature(group) -> str:
    attr = group.scale or ("global_sign" if group.global_sign else "")
    return f"{group.motif} {group.kind}{'/' + attr if attr else ''} {group.size}x{group.copies}"


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_expected_groups_and_fuzzing(family, zoo_subject):
    subject = zoo_subject(family)
    report = subject.report
    assert dict(collections.Counter(signature(g) for g in report.groups)) == EXPECTED[family]
    assert set(report.unknown_ops) == PINNED_BY_UNKNOWN_OPS.get(family, set())
    result = fuzz(subject, samples=2, seed=1)
    assert result.ok, [v.counterexample for v in result.failures] or result.joint_error
    assert len(result.verdicts) == len(report.groups)


ROPE = ("gptj", "gpt-neox", "llama", "llama-tied", "mistral", "qwen2", "qwen3", "phi")


@pytest.mark.parametrize("family", ROPE)
def test_rope_models_get_no_generic_rotation(family, zoo_subject):
    for g in zoo_subject(family).report.groups:
        if g.motif == "qk":
            assert g.kind in ("rotary", "scale"), g.id


@pytest.mark.parametrize("family,layout", [("gptj", "interleaved"), ("gpt-neox", "rotate_half"),
                                           ("llama", "rotate_half"), ("phi", "rotate_half")])
def test_rotary_pair_layout_is_read_from_the_graph(family, layout, zoo_subject):
    group = next(g for g in zoo_subject(family).report.groups if g.kind == "rotary")
    pairs = np.array(group.rotary_pairs)
    rotated = 2 * len(pairs)
    if layout == "interleaved":
        assert (pairs[:, 1] - pairs[:, 0] == 1).all() and (pairs[:, 0] % 2 == 0).all()
    else:
        assert (pairs[:, 1] - pairs[:, 0] == rotated // 2).all()
    config = zoo_subject(family).config
    head_dim = config.hidden_size // config.num_attention_heads
    assert rotated + len(group.passthrough) == head_dim


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_gqa_shares_one_transform_per_kv_group(family, zoo_subject):
    subject = zoo_subject(family)
    kv = subject.config.num_key_value_heads
    rep = subject.config.num_attention_heads // kv
    qk = [g for g in subject.report.groups if g.motif == "qk"]
    assert qk and all(g.copies == kv for g in qk)
    for g in qk:
        q = next(m for m in g.members if m.param.endswith("q_proj.weight"))
        assert q.index.shape[2] == rep  # each KV group's transform acts on all of its query heads


def test_t5_heads_are_shared_across_a_stack(zoo_subject):
    heads = [g for g in zoo_subject("t5").report.groups if g.motif == "heads"]
    shared = [g for g in heads if any("relative_attention_bias" in m.param for m in g.members)]
    assert len(shared) == 2  # encoder and decoder self-attention
    for g in shared:
        layers = {m.param.split(".block.")[1].split(".")[0] for m in g.members if ".block." in m.param}
        assert len(layers) == 2


def test_tied_embeddings_restrict_the_residual_to_orthogonal_kinds(zoo_subject):
    untied = next(g for g in zoo_subject("llama").report.groups if g.motif == "residual")
    tied = next(g for g in zoo_subject("llama-tied").report.groups if g.motif == "residual")
    assert untied.kind == tied.kind == "signed_permutation"
    assert any(m.param == "lm_head.weight" for m in tied.members)
