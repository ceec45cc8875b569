"""Experts kept as an ``nn.ModuleList`` and run by a loop over experts (examples/handwritten_zoo.py:
``moe_top1_softmax_loop``, ``moe_sigmoid_shared_expert_loop``): torch.export unrolls the loop into one branch per
expert, and permuting whole experts (every tensor of expert i moved to expert j's slot) with the router's rows is
exact when the branches are isomorphic and meet in a commutative sum (symgraph/analysis/parallel.py, experts.py).

Each positive form gets its census (an ``experts`` group moving the router rows and every expert tensor), a float64
fuzz of every group at two input shapes, a hand-written expert permutation checked without symgraph's element code,
and exact recovery by ``align_states``. Each negative form (branches that differ in an op or a shape, a branch that
reads another expert's weight, concatenation in expert order, a sequential chain, a router position read by two
branches, per-expert constants that differ) must give no expert group, and a float64 check shows that the naive
swap it would have meant changes the function.
"""
from __future__ import annotations

import copy
import functools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph
from symgraph.alignment import align_states
from symgraph.elements import apply, sample

from cli_runner import run
from group_checks import assert_fuzzed_at_two_shapes, census, noisy as generic_weights

D, E, HIDDEN, TOKENS = 8, 3, 6, 4


class Expert(nn.Module):
    def __init__(self, act=F.relu, hidden=HIDDEN, gated=False):
        super().__init__()
        self.act, self.gated = act, gated
        self.up, self.down = nn.Linear(D, hidden), nn.Linear(hidden, D)
        self.gate = nn.Linear(D, hidden, bias=False) if gated else None

    def forward(self, x):
        h = self.act(self.gate(x)) * self.up(x) if self.gated else self.act(self.up(x))
        return self.down(h)


class LoopMoE(nn.Module):
    """``inp -> x + moe(norm(x)) -> out`` with top-2 routing over a ModuleList of experts.

    ``form``: how each expert's result comes back: ``index_add`` (functional), ``index_add_`` (in place),
    ``index_put`` (``out[rows] += y``), ``dense`` (every expert on every token, ``sum_e w[:, e:e+1] * expert_e(x)``).
    The negative forms change one thing each (see the module docstring)."""

    def __init__(self, form="index_add", gated=False, experts=None, sigmoid=False, bias=False, pool=False):
        super().__init__()
        self.form, self.sigmoid, self.pool = form, sigmoid, pool
        self.inp, self.norm, self.out = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, 3)
        self.router = nn.Linear(D, E, bias=bias)
        self.experts = nn.ModuleList(experts or [Expert(gated=gated) for _ in range(E)])

    def routing(self, flat):
        logits = self.router(flat)
        scores = torch.sigmoid(logits) if self.sigmoid else logits.softmax(-1)
        top, index = scores.topk(2, -1)
        return torch.zeros_like(scores).scatter(-1, index, top / top.sum(-1, keepdim=True)), index

    def forward(self, x):
        h = self.inp(x)
        flat = self.norm(h).reshape(-1, D)
        weights, index = self.routing(flat)
        if self.form in ("dense", "cat", "chain"):
            out = getattr(self, self.form)(flat, weights)
        else:
            out = self.routed(flat, weights, index)
        y = self.out(h + out.view_as(h))
        return y.mean(1) if self.pool else y

    def position(self, e: int) -> int:
        """The router column expert ``e`` reads (its own; the negative ``reused`` form reads column 0 twice)."""
        return 0 if self.form == "reused" and e == 1 else e

    def routed(self, flat, weights, index):
        out = torch.zeros_like(flat)
        count = torch.zeros_like(flat[:1])
        seen = count[:, :]  # a view: it sees every later write into count
        for e, expert in enumerate(self.experts):
            p = self.position(e)
            rows = (index == p).any(-1).nonzero().squeeze(-1)
            picked = flat.index_select(0, rows)
            if self.form == "counted":  # each expert reads how many experts ran before it
                picked = picked + seen
                count.add_(1.0)
            if self.form == "crossed":  # expert e's down projection is expert e+1's
                y = self.experts[(e + 1) % E].down(F.relu(expert.up(picked)))
            elif self.form == "shared":  # expert e also reads expert e+1's down projection
                h = F.relu(expert.up(picked))
                y = expert.down(h) + self.experts[(e + 1) % E].down(h)
            else:
                y = expert(picked)
            y = y * weights.index_select(0, rows)[:, p:p + 1]
            if self.form == "scaled":  # a constant of its own per expert
                y = y * (1.0 + 0.5 * e)
            if self.form == "index_add_":
                out.index_add_(0, rows, y)
            elif self.form == "index_put":
                out = out.index_put((rows,), y, accumulate=True)
            else:
                out = out.index_add(0, rows, y)
        return out

    def dense(self, flat, weights):
        return sum(weights[:, e:e + 1] * expert(flat) for e, expert in enumerate(self.experts))

    def cat(self, flat, weights):  # concatenation in expert order, read by a linear
        return self.mix(torch.cat([weights[:, e:e + 1] * expert(flat) for e, expert in enumerate(self.experts)], -1))

    def chain(self, flat, weights):  # each expert reads the previous one's result
        for e, expert in enumerate(self.experts):
            flat = flat + weights[:, e:e + 1] * expert(flat)
        return flat


class CatMoE(LoopMoE):
    def __init__(self):
        super().__init__("cat")
        self.mix = nn.Linear(E * D, D)


noisy = functools.partial(generic_weights, scale=0.3)


def _load(model):
    return symgraph.load(noisy(model), (torch.randn(2, TOKENS, D),))


def experts_of(subject):
    return [g for g in subject.report.groups if g.motif == "experts"]


def swapped(state: dict, i: int, j: int, with_router: bool = True) -> dict:
    """Experts ``i`` and ``j`` exchanged by hand: every ``experts.i.*`` tensor renamed ``experts.j.*`` and back,
    and the router's rows ``i`` and ``j`` exchanged (no symgraph code involved)."""
    out = dict(state)
    for name, t in state.items():
        for a, b in ((i, j), (j, i)):
            if name.startswith(f"experts.{a}."):
                out[f"experts.{b}." + name[len(f"experts.{a}."):]] = t
    if with_router:
        for name in ("router.weight", "router.bias"):
            if name in state:
                rows = state[name].clone()
                rows[[i, j]] = rows[[j, i]]
                out[name] = rows
    return out


def outputs(model: nn.Module, state: dict, x: torch.Tensor) -> torch.Tensor:
    twin = copy.deepcopy(model).double()
    twin.load_state_dict({k: v.double() for k, v in state.items()})
    with torch.no_grad():
        return twin(x.double())


def relative_change(model, state, other, x) -> float:
    a, b = outputs(model, state, x), outputs(model, other, x)
    return float((a - b).norm() / a.norm())


INPUTS = [torch.randn(1, 5, D, generator=torch.Generator().manual_seed(1)),
          torch.randn(3, 11, D, generator=torch.Generator().manual_seed(2))]


# -- positive forms ----------------------------------------------------------------------------------------------------
POSITIVE = {
    "index_add": lambda: LoopMoE("index_add"),
    "index_add_": lambda: LoopMoE("index_add_"),
    "index_put": lambda: LoopMoE("index_put"),
    "dense": lambda: LoopMoE("dense"),
    "gated_sigmoid_bias": lambda: LoopMoE("index_add", gated=True, sigmoid=True, bias=True),
}


@pytest.mark.parametrize("form", list(POSITIVE))
def test_modulelist_experts_move_whole_with_their_router_rows(form):
    subject = _load(POSITIVE[form]())
    experts = experts_of(subject)
    assert [(g.kind, g.size, g.copies) for g in experts] == [("permutation", E, 1)], census(subject)
    g = experts[0]
    router = {m.param for m in g.members if hasattr(m, "param")}
    assert router == ({"router.weight", "router.bias"} if "bias" in form else {"router.weight"})
    assert set(g.params) - router == {k for k in subject.state_dict() if k.startswith("experts.")}
    units = sorted(h.layer for h in subject.report.groups if h.motif == "ffn" and h.kind == "permutation")
    assert units == [f"experts.{e}" for e in range(E)], census(subject)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("form", ["index_add", "dense"])
def test_a_hand_written_expert_swap_is_exact_and_is_what_the_element_does(form):
    """Exchanging experts 0 and 2 by renaming their tensors and swapping two router rows leaves the float64
    outputs unchanged, at two input shapes; the group's element for that transposition writes the same state."""
    model = noisy(POSITIVE[form]())
    subject = symgraph.load(model, (torch.randn(2, TOKENS, D),))
    state = subject.state_dict()
    by_hand = swapped(state, 0, 2)
    for x in INPUTS:
        assert relative_change(model, state, by_hand, x) < 1e-12
        assert relative_change(model, state, swapped(state, 0, 2, with_router=False), x) > 1e-3  # the rows matter
    from symgraph.elements import Element

    g = experts_of(subject)[0]
    element = Element(g, perm=np.array([[2, 1, 0]]), diag=np.ones((1, E)))
    moved = apply(state, [element])
    assert all(torch.equal(moved[k].double(), by_hand[k].double()) for k in state)


@pytest.mark.parametrize("form", ["index_add", "gated_sigmoid_bias"])
def test_align_states_undoes_a_random_element_exactly(form):
    model = noisy(POSITIVE[form]()).double()
    subject = symgraph.load(model, (torch.randn(2, TOKENS, D, dtype=torch.float64),))
    groups = subject.report.groups
    state = subject.state_dict()
    rng = np.random.default_rng(5)
    elements = [sample(g, rng) for g in groups]
    assert not next(e for e in elements if e.group.motif == "experts").is_identity()
    moved = apply(state, elements)
    result = align_states(groups, moved, state, mode="full")
    assert result.distance_before > 0.3
    assert result.distance_after < 1e-9, result.group_distances()


def test_permutation_mode_undoes_permutations_of_experts_and_units():
    model = noisy(LoopMoE()).double()
    subject = symgraph.load(model, (torch.randn(2, TOKENS, D, dtype=torch.float64),))
    groups = [g for g in subject.report.groups if g.kind == "permutation"]
    state = subject.state_dict()
    rng = np.random.default_rng(2)
    moved = apply(state, [sample(g, rng, spread=0.0) for g in groups])
    result = align_states(subject.report.groups, moved, state, mode="permutation")
    assert result.distance_after < 1e-9 < 0.3 < result.distance_before


def test_tensors_move_by_the_role_each_branch_gives_them_not_by_name():
    """Expert e computes with its own up projection and expert e+1's down projection, which no other expert reads:
    each branch still owns its tensors, so slot e is (up_e, down_e+1) and the group moves those together. Renaming
    experts.i.* to experts.j.* changes the function; the group's element does not."""
    model = noisy(LoopMoE("crossed"))
    subject = symgraph.load(model, (torch.randn(2, TOKENS, D),))
    (g,) = experts_of(subject)
    slots = [set(names) for names in zip(*(m.slots[0] for m in g.members if hasattr(m, "slots")))]
    assert slots[0] == {"experts.0.up.weight", "experts.0.up.bias", "experts.1.down.weight", "experts.1.down.bias"}
    state = subject.state_dict()
    from symgraph.elements import Element

    element = Element(g, perm=np.array([[1, 0, 2]]), diag=np.ones((1, E)))
    for x in INPUTS:
        assert relative_change(model, state, apply(state, [element]), x) < 1e-12
        assert relative_change(model, state, swapped(state, 0, 1), x) > 1e-3
    assert_fuzzed_at_two_shapes(subject)


def test_merging_a_model_with_its_reparametrisation_keeps_it():
    """The twin (a random element of every group, the expert permutation included) aligns back exactly, so the
    average of the two is the model itself."""
    from symgraph.merging import merge

    model = noisy(LoopMoE(gated=True)).double()
    subject = symgraph.load(model, (torch.randn(2, TOKENS, D, dtype=torch.float64),))
    twin = copy.deepcopy(model)
    twin.load_state_dict(symgraph.transform(subject, seed=3))
    merged = merge([subject, symgraph.load(twin, (torch.randn(2, TOKENS, D, dtype=torch.float64),))],
                   method="simple", progress=False)
    assert max(merged.distances) < 1e-9 < 0.3 < min(merged.distances_before)
    assert max(float((merged.state[k] - v).abs().max()) for k, v in subject.state_dict().items()) < 1e-9


def _classifiers_and_data(seeds=(1, 2)):
    from symgraph.datasets import Batch, Dataset

    def make(seed):
        torch.manual_seed(seed)
        return symgraph.load(noisy(LoopMoE(gated=True, pool=True)), (torch.randn(2, TOKENS, D),))

    generator = torch.Generator().manual_seed(0)
    batches = tuple(Batch({"x": torch.randn(8, TOKENS, D, generator=generator)},
                          torch.randint(0, 3, (8,), generator=generator)) for _ in range(4))
    return [make(s) for s in seeds], Dataset("noise", "classification", batches)


def test_activation_costs_leave_out_the_values_of_routed_tokens():
    """Inside an expert's branch the rows are the tokens routed to it, a number known only at run time and
    different in the two models: such values are no activation site (on main, recording them failed with
    mismatched row counts)."""
    (source, anchor), data = _classifiers_and_data()
    result = symgraph.align(source, anchor, data=data, data_batches=2, progress=None)
    assert result.verified_error < 1e-5 and set(result.path_losses) == {"activations", "weights"}
    assert "activations" in result.costs.values()


def test_learned_matching_keeps_the_expert_permutation_and_the_function():
    """Learned matching tunes continuous elements only: the expert permutation stays where weight matching put
    it, and the result is still an exact reparametrisation of the source (checked by align before returning)."""
    from symgraph.learn import LearnOptions

    (source, anchor), data = _classifiers_and_data()
    learned = symgraph.align(source, anchor, data=data,
                             learn=LearnOptions(steps=6, checks=2, eval_batches=1, batch_size=8), progress=None)
    assert learned.learned is not None and learned.verified_error < 1e-5
    start = [e for e in learned.elements if e.group.motif == "experts"]
    assert start and all(e.matrices is None for e in start)


def test_a_streamed_block_never_splits_the_tensors_of_one_member():
    from symgraph.elements import Element
    from symgraph.errors import MismatchError
    from symgraph.streamed_align import _restricted

    g = experts_of(_load(LoopMoE()))[0]
    element = Element(g, perm=np.array([[1, 0, 2]]), diag=np.ones((1, E)))
    assert _restricted(element, set(g.params)) is not None
    assert _restricted(element, {"inp.weight"}) is None
    with pytest.raises(MismatchError, match="whole tensors"):
        _restricted(element, {"router.weight", "experts.0.up.weight"})


def test_reports_name_the_whole_tensor_members():
    from symgraph.render import to_html, to_markdown

    report = _load(LoopMoE(gated=True)).report
    assert "`experts.*.up.weight (whole tensors, 3 slots) swap`" in to_markdown(report)
    html = to_html(report)
    assert "swatch swap" in html and "the whole tensor moves with its slot" in html


def test_the_repeated_block_fast_path_moves_whole_tensor_members_with_their_block():
    from symgraph.depth import NotReplicable, _moved_member

    g = experts_of(_load(LoopMoE()))[0]
    member = next(m for m in g.members if hasattr(m, "slots"))
    moved = _moved_member(member, lambda name: "model.layers.7." + name)
    assert moved.slots[0] == tuple("model.layers.7." + name for name in member.slots[0])
    assert NotReplicable  # a group moving whole tensors of several blocks is refused (depth._spread_group)


def test_vitpose_backbone_experts_chosen_by_the_dataset_index_stay_apart():
    """transformers' VitPose backbone keeps its experts in an nn.ModuleList and picks one per sample by the
    dataset index it is given (``indices == i``): an input, not a router, so no permutation of the experts is
    exact (swapping two changes the output) and none is emitted."""
    import transformers

    config = transformers.VitPoseBackboneConfig(image_size=[32, 32], patch_size=[8, 8], hidden_size=32,
                                                num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
                                                num_experts=3, part_features=8, out_indices=[2])
    torch.manual_seed(0)
    model = noisy(transformers.VitPoseBackbone(config))
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32), "dataset_index": torch.tensor([0, 2])}
    subject = symgraph.load(model, ((), inputs))
    assert experts_of(subject) == [] and any(g.motif == "heads" for g in subject.report.groups), census(subject)
    state = subject.state_dict()
    moved = dict(state)
    for key in [k for k in state if ".experts.0." in k]:
        other = key.replace(".experts.0.", ".experts.2.")
        moved[key], moved[other] = state[other], state[key]
    twin = copy.deepcopy(model)
    twin.load_state_dict(moved)
    with torch.no_grad():
        a, b = model(**inputs).feature_maps[0], twin(**inputs).feature_maps[0]
    assert float((a - b).norm() / a.norm()) > 1e-3
    assert_fuzzed_at_two_shapes(subject)


# -- negative forms ----------------------------------------------------------------------------------------------------
ALL_PAIRS = [(0, 1), (0, 2), (1, 2)]
NEGATIVE = {  # name: (model, the swaps of experts i and j (with their router rows) that must change the function)
    "an op differs": (lambda: LoopMoE(experts=[Expert(), Expert(act=F.gelu), Expert()]), [(0, 1), (1, 2)]),
    "a shape differs": (lambda: LoopMoE(experts=[Expert(), Expert(hidden=HIDDEN - 1), Expert()]), [(0, 1)]),
    "reads another expert's weight": (lambda: LoopMoE("shared"), ALL_PAIRS),
    "concatenated in expert order": (CatMoE, ALL_PAIRS),
    "a sequential chain": (lambda: LoopMoE("chain"), ALL_PAIRS),
    "a router column read twice": (lambda: LoopMoE("reused"), ALL_PAIRS),
    "per-expert constants differ": (lambda: LoopMoE("scaled"), ALL_PAIRS),
    "each reads a tensor changed in place between experts": (lambda: LoopMoE("counted"), ALL_PAIRS),
}


@pytest.mark.parametrize("form", list(NEGATIVE))
def test_no_expert_group_where_the_naive_swap_changes_the_function(form):
    """(Experts 0 and 2 of the first two forms are alike, and exchanging them is exact; the analysis does not
    offer it, since expert 1 reads the router's middle row in its own way: sound, short of the exact group.)"""
    build, pairs = NEGATIVE[form]
    model = noisy(build())
    subject = symgraph.load(model, (torch.randn(2, TOKENS, D),))
    assert experts_of(subject) == [], census(subject)
    state = subject.state_dict()
    for i, j in pairs:
        if state[f"experts.{i}.up.weight"].shape != state[f"experts.{j}.up.weight"].shape:
            with pytest.raises(RuntimeError, match="size mismatch"):  # not even a state of this model
                outputs(model, swapped(state, i, j), INPUTS[1])
        else:
            assert relative_change(model, state, swapped(state, i, j), INPUTS[1]) > 1e-5, (i, j)
    assert_fuzzed_at_two_shapes(subject)


# -- command line ------------------------------------------------------------------------------------------------------
def make_loop_moe():
    torch.manual_seed(1)
    return noisy(LoopMoE("index_add", gated=True)), (torch.randn(2, TOKENS, D),)


def make_loop_moe_permuted():
    """make_loop_moe with experts 0 -> 1 -> 2 -> 0 moved by hand and each expert's units reversed."""
    model, inputs = make_loop_moe()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # load_state_dict below writes the originals
    moved = swapped(swapped(state, 0, 1), 1, 2)
    for e in range(E):
        for name in ("up.weight", "up.bias", "gate.weight"):
            key = f"experts.{e}.{name}"
            if key in moved:
                moved[key] = moved[key].flip(0)
        moved[f"experts.{e}.down.weight"] = moved[f"experts.{e}.down.weight"].flip(1)
    model.load_state_dict(moved)
    return model, inputs


def test_command_line_report_fuzz_transform_and_align(tmp_path):
    factory = f"{__file__}:make_loop_moe"
    reported = run("report", factory, "--format", "json")
    assert reported.returncode == 0, reported.stderr
    groups = json.loads(reported.stdout)["groups"]
    (experts,) = [g for g in groups if g["motif"] == "experts"]
    assert experts["solver"] == "expert_matching"
    swaps = {tuple(m["tensors"][0]) for m in experts["members"] if m["action"] == "swap"}
    assert tuple(f"experts.{e}.up.weight" for e in range(E)) in swaps and len(swaps) == 5  # gate, up (2), down (2)
    fuzzed = run("fuzz", factory, "--samples", "3", "--json", tmp_path / "fuzz.json")
    assert fuzzed.returncode == 0, fuzzed.stdout + fuzzed.stderr
    assert json.loads((tmp_path / "fuzz.json").read_text())["ok"]
    moved = run("transform", factory, "-o", tmp_path / "moved", "--seed", "1")
    assert moved.returncode == 0, moved.stderr
    aligned = run("align", f"{__file__}:make_loop_moe_permuted", factory, "-o", tmp_path / "aligned",
                  "--stats", tmp_path / "stats.json", "--quiet")
    assert aligned.returncode == 0, aligned.stderr
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["distance_before"] > 0.3 and stats["distance_after"] < 1e-6, stats["distance_after"]
