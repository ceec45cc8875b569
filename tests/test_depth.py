"""Analysis that does not grow with depth (symgraph.depth): the shallow-copy report must equal the full-depth one."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

import symgraph
from symgraph import depth, zoo

from cli_runner import run

# families whose config has no top-level num_hidden_layers (clip), or whose blocks repeat with a period too long
# to save work at this depth (gpt-oss alternates sliding and full attention: 3 periods are 6 > 5 blocks): these are
# analysed at full depth. A graph with unknown ops is too (their pins are not replicated); deepseek-v2 had them
# (copy_, new_empty) until those got specs, and now takes the fast path. (ViT and DeBERTa-v2 read their inputs'
# device while tracing: their shallow meta-device copies trace since the example inputs are moved to the meta
# device with them.)
FULL_DEPTH_ONLY = {"clip", "gpt-oss"}
DEPTH = 5  # shortened to 3 blocks (first, middle, last), or 4 where block 0 differs (T5)


def _reports(model, inputs):
    fast = symgraph.load(model, inputs)
    used = depth.analyse_by_repeats(fast) is not None
    slow = symgraph.load(model, inputs, full_depth=True)
    return fast.report, slow.report, used


@pytest.mark.slow
@pytest.mark.parametrize("family", zoo.HF_FAMILIES)
def test_shallow_report_equals_full_depth_report(family):
    model = zoo.build(family, num_hidden_layers=DEPTH)
    fast, slow, used = _reports(model, zoo.example_inputs_for(family, model))
    assert used == (family not in FULL_DEPTH_ONLY)
    assert fast.to_json() == slow.to_json()
    assert fast.parameters == slow.parameters and list(fast.parameters) == list(slow.parameters)


@pytest.mark.slow
def test_alternating_sliding_window_layers_repeat_with_period_two():
    types = ["sliding_attention", "full_attention"] * 5
    model = zoo.build("qwen2", num_hidden_layers=10, layer_types=types, use_sliding_window=True, sliding_window=4)
    _, plan = depth.shallow_copy(model, model.config)
    assert plan.period == 2 and plan.reduced == 6
    assert all(types[j] == types[s] for j, s in enumerate(plan.source))  # no block stands for another type
    fast, slow, used = _reports(model, zoo.example_inputs_for("qwen2", model))
    assert used and fast.to_json() == slow.to_json()


def test_a_block_with_its_own_buffer_is_not_replicated():
    model = zoo.build("llama", num_hidden_layers=6)
    model.model.layers[3].self_attn.register_buffer("bias_table", torch.ones(4))
    model.model.layers[4].self_attn.register_buffer("bias_table", torch.zeros(4))
    prints = depth.fingerprints(model.model.layers, model.config)
    assert prints[3] != prints[4]
    with pytest.raises(depth.NotReplicable, match="do not repeat"):
        depth.shallow_copy(model, model.config)


def test_uniform_norm_weights_reach_the_shallow_copy_and_keep_its_orthogonal_stream():
    # the analysis reads whether a vector holds one number (a folded norm weight): the meta-device copy's vector is
    # given such a value where every block it stands for has one (the values may differ: 1 here, 0.5 there)
    model = zoo.build("llama", num_hidden_layers=6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.5 if ".3." in name else 1.0)
    inputs = zoo.example_inputs_for("llama", model)
    fast, slow, used = _reports(model, inputs)
    assert used and fast.to_json() == slow.to_json()
    assert any(g.motif == "residual" and g.kind == "orthogonal" for g in fast.groups)
    with torch.no_grad():  # one middle block's norm no longer uniform: that block differs from the others
        model.model.layers[3].input_layernorm.weight[0] = 2.0
    with pytest.raises(depth.NotReplicable, match="do not repeat"):
        depth.shallow_copy(model, model.config)
    fast, slow, used = _reports(model, inputs)
    assert not used and fast.to_json() == slow.to_json()
    assert not any(g.motif == "residual" and g.kind == "orthogonal" for g in fast.groups)


def test_layer_index_attributes_do_not_split_blocks_but_other_differences_do():
    model = zoo.build("llama", num_hidden_layers=6)
    prints = depth.fingerprints(model.model.layers, model.config)
    assert len(set(prints[1:])) == 1  # layer_idx differs in every block and counts as the index
    model.model.layers[2].self_attn.scaling = 0.5
    assert depth.fingerprints(model.model.layers, model.config)[2] != prints[2]


def test_changes_a_rebuilt_copy_would_miss_send_the_model_to_full_depth():
    model = zoo.build("llama", num_hidden_layers=6)
    model.model.norm.variance_epsilon = 0.5  # outside the blocks, not in the config
    with pytest.raises(depth.NotReplicable, match="outside the block list"):
        depth.shallow_copy(model, model.config)
    hooked = zoo.build("llama", num_hidden_layers=6)
    hooked.model.layers[4].mlp.register_forward_hook(lambda module, args, out: 2 * out)
    with pytest.raises(depth.NotReplicable, match="hooks"):
        depth.shallow_copy(hooked, hooked.config)


def test_shallow_models_and_plain_modules_take_the_full_depth_path():
    shallow = zoo.build("llama", num_hidden_layers=4)
    with pytest.raises(depth.NotReplicable, match="num_hidden_layers"):
        depth.shallow_copy(shallow, shallow.config)
    mlp = zoo.build("torch-relu-mlp")
    assert depth.analyse_by_repeats(symgraph.load(mlp, zoo.example_inputs_for("torch-relu-mlp", mlp))) is None


@pytest.mark.slow
def test_cli_config_only_report_is_the_same_with_and_without_full_depth(tmp_path):
    # a base model (no LM head): its output is the residual stream, pinned across every block
    config = zoo.tiny_config("llama", num_hidden_layers=6, architectures=["LlamaModel"])
    config.save_pretrained(tmp_path)
    outputs = {}
    for flag in ((), ("--full-depth",)):
        out = tmp_path / f"report{len(flag)}.json"
        res = run("report", tmp_path / "config.json", "--config-only", "--format", "json", "-o", out, *flag)
        assert res.returncode == 0, res.stderr
        outputs[flag] = json.loads(out.read_text())
    assert outputs[()] == outputs[("--full-depth",)]
    pinned = [p for p in outputs[()]["pinned"] if p["reason"] == "observable model output"]
    assert any("layers.5.mlp.down_proj.weight" in p["params"] for p in pinned)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_replicated_groups_keep_the_function(family):
    """Random elements of every replicated group leave the outputs unchanged (checked in float64)."""
    from symgraph.elements import apply
    from symgraph.verify import Evaluator

    model = zoo.build(family, num_hidden_layers=DEPTH)
    subject = symgraph.load(model, zoo.example_inputs_for(family, model))
    assert depth.analyse_by_repeats(subject) is not None
    # block 3 is not in the 3-block copy (it stands for blocks 1-3): its groups were replicated
    assert any(".3." in m.param for g in subject.report.groups for m in g.members)
    elements = symgraph.sample_elements(subject.report, seed=1)
    outcome = Evaluator(model, subject.args, subject.kwargs).check(apply(subject.state_dict(), elements))
    assert outcome.ok, outcome.relative_error


# -- blocks that look alike but run differently by index ---------------------------------------------------------
class _IndexedConfig(PretrainedConfig):
    model_type = "symgraph_test_indexed_blocks"

    def __init__(self, num_hidden_layers=6, special_from=4, where="block", **kwargs):
        self.num_hidden_layers, self.special_from, self.where = num_hidden_layers, special_from, where
        super().__init__(**kwargs)


class _IndexedBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, sort=False):
        h = torch.nn.functional.gelu(self.up(self.norm(x)))
        # the block decides by its index and a config number: every block's attributes look the same
        if sort or (self.config.where == "block" and self.layer_idx >= self.config.special_from):
            h = h.sort(-1).values
        return x + self.down(h)


class _IndexedModel(PreTrainedModel):
    config_class = _IndexedConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(_IndexedBlock(config, i) for i in range(config.num_hidden_layers))
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):  # or the parent's loop treats one index apart
            x = layer(x, sort=self.config.where == "parent" and i == self.config.special_from)
        return self.head(x)


@pytest.mark.parametrize("where", ["block", "parent"])
def test_blocks_that_run_differently_by_index_are_analysed_at_full_depth(where):
    """A sort of the FFN's hidden units at layer 4 only (decided at run time, so no fingerprint differs) pins that
    layer's FFN permutation; the 3-block copy never reaches index 4 and would replicate layer 1's group onto it."""
    from symgraph.elements import apply
    from symgraph.verify import Evaluator

    torch.manual_seed(0)
    model = _IndexedModel(_IndexedConfig(where=where)).eval()
    inputs = (torch.randint(0, 50, (2, 7)),)
    assert depth.shallow_copy(model, model.config)[1].reduced == 3  # the blocks do look alike
    fast, slow, used = _reports(model, inputs)
    assert not used and fast.to_json() == slow.to_json()
    ffn = {g.id for g in fast.groups if g.motif == "ffn"}
    assert "ffn:layers.3:down+up" in ffn and "ffn:layers.4:down+up" not in ffn
    subject = symgraph.load(model, inputs)
    elements = symgraph.sample_elements(subject.report, seed=1)
    for shape in ((2, 7), (3, 5)):
        ids = torch.randint(0, 50, shape)
        outcome = Evaluator(model, (ids,), {}).check(apply(subject.state_dict(), elements))
        assert outcome.ok, outcome.relative_error


def test_blocks_that_run_alike_by_index_keep_the_shallow_path():
    torch.manual_seed(0)
    model = _IndexedModel(_IndexedConfig(special_from=99)).eval()  # no block reaches the index
    fast, slow, used = _reports(model, (torch.randint(0, 50, (2, 7)),))
    assert used and fast.to_json() == slow.to_json()


def test_a_group_named_after_a_block_takes_the_full_depth():
    """Doge scales its residual by a parameter held by the block itself (``layers.0.input_residual``): the
    residual group's name lists ``0``, ``1``, ``2`` from the 3-block copy and ``3`` too at full depth."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("doge", hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # trained residual scales differ from one (a uniform one leaves the stream orthogonal)
        for block in model.model.layers:
            block.input_residual.add_(0.1 * torch.randn(32))
    fast, slow, used = _reports(model, (torch.randint(0, 64, (2, 7)),))
    assert not used and fast.to_json() == slow.to_json()
    assert any(g.motif == "residual" and ":0+1+2+3+" in g.id for g in fast.groups)


def test_sizes_computed_from_data_do_not_break_the_comparison(monkeypatch):
    """JetMoE's router counts tokens per expert with ``.item()``: traced by its own code (not the dense form
    capture gives it, specs/experts.yaml ``sorted_tokens``), the shapes hold symbols, which the full-depth
    comparison must take without failing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setattr("symgraph.moe.sorted_tokens_modules", lambda model: [])

    config = AutoConfig.for_model("jetmoe", hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                  num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
                                  vocab_size=64, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    fast, slow, _ = _reports(model, (torch.randint(0, 64, (2, 7)),))
    assert fast.to_json() == slow.to_json()
