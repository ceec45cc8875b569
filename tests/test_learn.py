"""Learned matching (symgraph.learn): API, CLI, barrier and merge, bad input, NaN during learning."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import symgraph
import symgraph.learn
from symgraph import zoo
from symgraph.alignment import select_groups
from symgraph.connectivity import barrier
from symgraph.datasets import Batch, Dataset, evaluate, load_data
from symgraph.demo import shipped_pair
from symgraph.elements import apply, composed_matrices, sample
from symgraph.learn import LearnError, LearnOptions

from cli_runner import run, tree_digest

FEW = LearnOptions(steps=12, eval_batches=2)


@pytest.fixture(scope="module")
def vit_pair():
    """The shipped ViT pair (trained on digits, independent seeds): it has a barrier for learning to lower."""
    return tuple(str(p) for p in shipped_pair("vit-digits"))


def outputs(subject_or_path, state=None):
    subject = symgraph.load(subject_or_path)
    model = subject.model.eval()
    if state is not None:
        model.load_state_dict(state)
    pixels = load_data("digits", limit=16).batches[0].inputs["pixel_values"]
    with torch.no_grad():
        return model(pixel_values=pixels).logits


@pytest.mark.slow
@pytest.mark.parametrize("method", ["direct", "ste"])
def test_learning_lowers_the_path_loss_and_keeps_the_source_function(vit_pair, method):
    a, b = vit_pair
    start = symgraph.align(b, a)
    result = symgraph.align(b, a, data="digits", learn=replace(FEW, method=method))
    learned = result.learned
    assert learned["steps"] == 12 and learned["kept"]
    assert learned["end_path_loss"] < learned["start_path_loss"] - 0.1
    if method == "direct":  # QK and VO maps learned in GL(d_head) stay well conditioned
        assert 1.0 < learned["largest_condition_number"] < 10.0
    assert result.start == "learned" and result.verified_error is not None
    changed = max(float((result.state[k] - start.state[k]).abs().max()) for k in start.state
                  if start.state[k].is_floating_point())
    assert changed > 1e-3  # learning moved the alignment away from the weight-matched one ...
    assert torch.allclose(outputs(b, result.state), outputs(b), atol=1e-4)  # ... within the source's orbit


def test_a_learned_alignment_no_better_than_its_start_is_not_kept(vit_pair, monkeypatch):
    a, b = vit_pair
    monkeypatch.setattr(symgraph.learn._Run, "checked_loss", lambda self, state: 1.0)
    # with data, learning starts from the alignment data chose (no short learning: --learn replaces it)
    start = symgraph.align(b, a, data="digits", short_learning=False)
    result = symgraph.align(b, a, data="digits", learn=LearnOptions(steps=2, eval_batches=1))
    assert not result.learned["kept"] and result.start != "learned"
    assert all(torch.equal(result.state[k], start.state[k]) for k in start.state)


@pytest.mark.parametrize("options, match", [
    (LearnOptions(steps=0), "steps must be a whole number >= 1"),
    (LearnOptions(lr=math.nan), "learning rate must be a finite number > 0"),
    (LearnOptions(lr=-1.0), "learning rate must be a finite number > 0"),
    (LearnOptions(t="end"), "Unknown interpolation point"),
    (LearnOptions(t=0.0), "Unknown interpolation point"),  # an end of the path: the alignment changes nothing there
    (LearnOptions(t=1.5), "Unknown interpolation point"),
    (LearnOptions(t=math.nan), "Unknown interpolation point"),
    (LearnOptions(t=True), "Unknown interpolation point"),
    (LearnOptions(project_rounds=-1), "project_rounds must be a whole number >= 0"),
    (LearnOptions(method="sinkhorn"), "Unknown learning method"),
    (LearnOptions(general_linear="yes"), "general_linear must be True or False"),
    (LearnOptions(width_aware=1), "width_aware must be True or False"),
    (LearnOptions(backtracks=-1), "backtracks must be a whole number >= 0"),
    (LearnOptions(backtrack_margin=-0.1), "backtrack_margin must be a finite number >= 0"),
    (LearnOptions(backtrack_margin=math.inf), "backtrack_margin must be a finite number >= 0"),
    (LearnOptions(patience=-1), "patience must be a whole number >= 0"),
    (LearnOptions(tolerance=-0.1), "tolerance must be a finite number >= 0"),
    (LearnOptions(tolerance=math.inf), "tolerance must be a finite number >= 0"),
    (LearnOptions(seconds=0), "time cap of learning must be a finite number of seconds > 0"),
    (LearnOptions(max_condition=0.5), "condition number of learned maps must be a number >= 1"),
    (LearnOptions(max_condition=math.nan), "condition number of learned maps must be a number >= 1"),
    (LearnOptions(t_concentration=0), "t_concentration must be a finite number > 0"),
    (LearnOptions(t_concentration=math.inf), "t_concentration must be a finite number > 0"),
    (LearnOptions(t_concentration=math.nan), "t_concentration must be a finite number > 0"),
    (LearnOptions(t_concentration=True), "t_concentration must be a finite number > 0"),
    (LearnOptions(mixup=-0.5), "mixup must be a finite number >= 0"),
    (LearnOptions(mixup=math.nan), "mixup must be a finite number >= 0"),
    (LearnOptions(mixup=True), "mixup must be a finite number >= 0"),
    (LearnOptions(holdout="yes"), "holdout must be True or False"),
])
def test_bad_options_are_refused_before_any_work(options, match, vit_pair):
    a, b = vit_pair
    with pytest.raises(LearnError, match=match):
        symgraph.align(b, a, data="digits", learn=options)


def test_learning_needs_data(vit_pair):
    a, b = vit_pair
    with pytest.raises(LearnError, match="none was given"):
        symgraph.align(b, a, learn=True)
    with pytest.raises(LearnError, match="none was given"):
        symgraph.merge([a, b], learn=True, progress=False)
    with pytest.raises(symgraph.SymgraphError, match="--align none"):
        symgraph.merge([a, b], align="none", data="digits", learn=True, progress=False)


def test_cli_learn_without_data_is_refused_and_writes_nothing(vit_pair, tmp_path):
    a, b = vit_pair
    for command in (["align", b, a], ["merge", a, b]):
        code, _, stderr = run(*command, "-o", tmp_path / "out", "--learn")
        assert code == 2 and "none was given" in stderr and "--data SPEC" in stderr
        assert not (tmp_path / "out").exists()


def _poisoned(forward, calls):
    """``forward`` (the state a training step runs through), with NaN weights at the calls numbered in ``calls``
    (from 1; a range for "from then on")."""
    count = {"n": 0}

    def poisoned(*args):
        count["n"] += 1
        state = forward(*args)
        return {k: v * math.nan for k, v in state.items()} if count["n"] in calls else state

    return poisoned


@pytest.mark.parametrize("method, forward", [("direct", "_moved"), ("ste", "_straight_through")])
def test_nan_that_backtracking_cannot_cure_stops_and_writes_nothing(vit_pair, tmp_path, monkeypatch, method,
                                                                     forward):
    a, b = vit_pair
    monkeypatch.setattr(symgraph.learn, forward, _poisoned(getattr(symgraph.learn, forward), range(3, 99)))
    before = tree_digest(tmp_path)
    code, _, stderr = run("align", b, a, "-o", tmp_path / "out", "--data", "digits", "--learn", "--learn-steps", 8,
                          "--learn-method", method, "--stats", tmp_path / "stats.json")
    assert code == 2, stderr
    # steps 3 to 6 backtrack (the default 4 times), step 7 stops
    assert "stopped at step 7: the loss is nan (after 4 backtracks" in stderr, stderr
    assert "nothing was written" in stderr and "--learn-lr" in stderr
    assert tree_digest(tmp_path) == before and not (tmp_path / "out").exists()


def _singular(forward, calls):
    """``forward`` (the state a direct training step runs through), with every general linear map made singular
    (its first row zeroed) at the calls numbered in ``calls`` (from 1), as a large step with no condition bound
    can: on this pair at lr 1.0, max_condition inf and no backtracks, the float32 inverse of a map failed at
    step 3 (uncaught before)."""
    count = {"n": 0}

    def singular(start, elements):
        count["n"] += 1
        if count["n"] in calls:
            elements = [replace(e, matrices=e.matrices * _first_row_zeroed(e.matrices))
                        if e.group.kind == "general_linear" else e for e in elements]
        return forward(start, elements)

    return singular


def _first_row_zeroed(matrices):
    mask = torch.ones_like(matrices)
    mask[:, 0] = 0.0
    return mask


@pytest.mark.parametrize("calls", [{3}, range(3, 99)])
def test_a_step_that_makes_a_map_singular_backtracks_and_stops_once_backtracking_cannot_cure_it(
        vit_pair, tmp_path, monkeypatch, calls):
    """A singular map (its inverse fails) is a step too large, as a non-finite one: back to the best point at a
    lower learning rate; when that cannot cure it, learning stops, says why and what to try, and writes nothing."""
    a, b = vit_pair
    monkeypatch.setattr(symgraph.learn, "_moved", _singular(symgraph.learn._moved, calls))
    before = tree_digest(tmp_path)
    code, stdout, stderr = run("align", b, a, "-o", tmp_path / "out", "--learn", "--learn-data", "digits",
                               "--learn-steps", 8, "--learn-max-condition", "inf", "--stats", tmp_path / "stats.json")
    if calls == {3}:
        assert code == 0, stderr
        learned = json.loads((tmp_path / "stats.json").read_text())["learned"]
        assert learned["backtracks"] == [{"step": 3, "why": "a learned map became singular (linalg.inv)",
                                          "lr_factor": symgraph.learn.BACKTRACK}]
        assert torch.allclose(outputs(tmp_path / "out"), outputs(b), atol=1e-4)
        return
    assert code == 2, stderr
    # steps 3 to 6 backtrack (the default 4 times), step 7 stops
    assert "stopped at step 7: a learned map became singular (linalg.inv) (after 4 backtracks" in stderr, stderr
    assert "nothing was written" in stderr and "--learn-lr" in stderr and "--learn-max-condition" in stderr
    assert tree_digest(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("method, forward", [("direct", "_moved"), ("ste", "_straight_through")])
def test_a_non_finite_step_backtracks_to_the_best_point_at_a_lower_learning_rate(vit_pair, tmp_path, monkeypatch,
                                                                                 method, forward):
    a, b = vit_pair
    monkeypatch.setattr(symgraph.learn, forward, _poisoned(getattr(symgraph.learn, forward), {3}))
    code, stdout, stderr = run("align", b, a, "-o", tmp_path / "out", "--learn", "--learn-data", "digits",
                               "--learn-steps", 6, "--learn-method", method, "--stats", tmp_path / "stats.json")
    assert code == 0, stderr
    assert "learned over 6 steps" in stdout and "learning rate lowered 1 time," in stdout
    learned = json.loads((tmp_path / "stats.json").read_text())["learned"]
    assert learned["backtracks"] == [{"step": 3, "why": "the loss is nan", "lr_factor": symgraph.learn.BACKTRACK}]
    assert len(learned["checked_path_losses"]) == 5  # a check every step but step 3, which never moved
    assert all(math.isfinite(c) for c in learned["checked_path_losses"])
    assert torch.allclose(outputs(tmp_path / "out"), outputs(b), atol=1e-4)


@pytest.mark.parametrize("backtracks", [2, 0])
def test_a_worse_check_goes_back_to_the_best_elements(vit_pair, monkeypatch, backtracks):
    """Path losses start 1.0, then 0.8 (best), 0.95 (worse by 0.15, more than half the 0.2 gained: back to step 1's
    elements, lr x BACKTRACK), 0.7 (best), 1.0 (worse again), 0.6 (the last check: no backtrack could follow it);
    with backtracks=0 learning goes on from the worse point, as before backtracking."""
    _checked_losses(monkeypatch, [1.0, 0.8, 0.95, 0.7, 1.0, 0.6])
    seen = []
    moved = symgraph.learn._moved
    monkeypatch.setattr(symgraph.learn, "_moved", lambda start, elements: seen.append(
        [e.matrices.detach().clone() for e in elements if e.matrices is not None]) or moved(start, elements))
    a, b = vit_pair
    result = symgraph.align(b, a, learn=LearnOptions(steps=5, checks=5, eval_batches=1, backtracks=backtracks,
                                                     rate_trial=False),
                            learn_data="digits", judge_starts=False)  # no path loss checked before learning
    learned = result.learned
    assert learned["end_path_loss"] == 0.6 and learned["kept"]
    back_to_best = all(torch.equal(x, y) for x, y in zip(seen[1], seen[2]))  # step 3 starts where step 2 did
    if backtracks:
        assert [(e["step"], e["why"]) for e in learned["backtracks"]] == \
            [(2, "worse than the best checked by 0.15, more than 0.5 of the 0.2 gained"),
             (4, "worse than the best checked by 0.3, more than 0.5 of the 0.3 gained")]
        assert learned["backtracks"][1]["lr_factor"] == pytest.approx(symgraph.learn.BACKTRACK ** 2)
        assert back_to_best
    else:
        assert learned["backtracks"] == [] and not back_to_best


@pytest.mark.parametrize("margin, losses, backtracked", [
    (LearnOptions.backtrack_margin, [0.8, 0.81, 0.7, 0.6, 0.5], []),
    (0.0, [0.8, 0.81, 0.7, 0.6, 0.5], [(2, "worse than the best checked by 0.01, more than 0 of the 0.2 gained")]),
    (LearnOptions.backtrack_margin, [0.8, 0.81, 0.82, 0.6, 0.5],
     [(3, "no better than the best checked, twice in a row")]),
    (LearnOptions.backtrack_margin, [1.05, 0.9, 0.8, 0.7, 0.6], [(1, "no better than the best checked")]),
    (0.0, [0.8, 0.7, 0.6, 0.5, 0.51], []),  # the last check: the best is the result, no step follows
])
def test_one_check_a_little_worse_than_the_best_goes_on_at_full_rate(vit_pair, monkeypatch, margin, losses,
                                                                      backtracked):
    """From a path loss of 1.0: a check worse than the best by less than the margin times the gain (0.81 after
    0.8, of 0.2 gained) goes on at full rate, unless the margin is 0; a second check in a row no better than the
    best, or any worse check while nothing is gained, backtracks."""
    _checked_losses(monkeypatch, [1.0, *losses])
    a, b = vit_pair
    options = LearnOptions(steps=5, checks=5, eval_batches=1, backtrack_margin=margin, rate_trial=False)
    learned = symgraph.align(b, a, learn=options, learn_data="digits", judge_starts=False).learned
    assert [(e["step"], e["why"]) for e in learned["backtracks"]] == backtracked
    assert learned["end_path_loss"] == min(losses)


def _checked_losses(monkeypatch, losses):
    """The path losses checks find (what ``_Run.checked_loss`` scores): the start's, then ``losses`` in turn, then
    the last of them from then on."""
    losses = iter(losses)
    last = {}

    def checked(self, state):
        last["loss"] = next(losses, last.get("loss"))
        return last["loss"]

    monkeypatch.setattr(symgraph.learn._Run, "checked_loss", checked)


@pytest.mark.parametrize("patience, tolerance, losses, steps, stopped", [
    # three checks in a row no lower than 0.8: stop after the fourth check (step 4)
    (3, 0.0, [1.0, 0.8, 0.9, 0.85, 0.95], 4, "the last 3 checks found no lower path loss"),
    (0, 0.0, [1.0, 0.8, 0.9, 0.85, 0.95], 12, None),  # patience 0: every step
    (2, 0.0, [1.0, 0.8, 0.9, 0.7, 0.9], 5, "the last 2 checks found no lower path loss"),
    # gained 0.5 by the first check; the next three gain 0.02 together, no more than 0.1 of 0.52: stop
    (3, 0.1, [1.0, 0.5, 0.49, 0.485, 0.48, 0.3], 4,
     "the last 3 checks lowered the path loss by 0.02, no more than 0.1 of the 0.52 gained"),
    # tolerance 0: those checks did gain something; learning stops once three checks find nothing (after 0.3)
    (3, 0.0, [1.0, 0.5, 0.49, 0.485, 0.48, 0.3], 8, "the last 3 checks found no lower path loss"),
])
def test_learning_stops_when_the_checks_stop_finding_a_lower_path_loss(vit_pair, monkeypatch, patience, tolerance,
                                                                       losses, steps, stopped):
    _checked_losses(monkeypatch, losses)
    a, b = vit_pair
    options = LearnOptions(steps=12, checks=12, eval_batches=1, patience=patience, tolerance=tolerance,
                           rate_trial=False)
    learned = symgraph.align(b, a, learn=options, learn_data="digits", judge_starts=False).learned
    assert learned["steps"] == steps and learned["stopped"] == stopped
    assert learned["end_path_loss"] == min(losses[:steps + 1])


class _Clock:
    """A fake ``time`` module for symgraph.learn whose clock moves one second each time it is read."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_a_time_cap_ends_learning_on_a_checked_step_with_the_learning_rate_annealed(vit_pair, monkeypatch):
    """The fake clock reads one second later at each reading (one before learning, one before each step). Before
    step 4 (0-based 3) 4 s have passed at 4/3 s a step, and 2.5 s of the 6.5 s cap are left: one more step fits, so
    step 4 is the last, it is checked, and the schedule has annealed over the 4 steps that fit, not over 50."""
    monkeypatch.setattr(symgraph.learn, "time", _Clock())
    rates, descend = [], symgraph.learn._Run.descend

    def descend_and_keep_the_rate(self, loss, step):
        moved = descend(self, loss, step)
        rates.append(self.optimiser.param_groups[0]["lr"])
        return moved

    monkeypatch.setattr(symgraph.learn._Run, "descend", descend_and_keep_the_rate)
    a, b = vit_pair
    options = LearnOptions(steps=50, checks=50, eval_batches=1, seconds=6.5, patience=0, backtracks=0)
    learned = symgraph.align(b, a, learn=options, learn_data="digits").learned
    assert learned["stopped"] == "the time cap of 6.5 s" and learned["steps"] == 4
    assert len(learned["checked_path_losses"]) == 4
    first = learned["learning_rates"][next(iter(learned["learning_rates"]))]
    assert rates[0] == pytest.approx(first)  # step 0: cosine 1
    # step 3 of a horizon of 4: 0.5 (1 + cos(3 pi / 4)) = 0.15 (of 50 steps it would be 0.96)
    assert rates[-1] == pytest.approx(first * 0.5 * (1 + math.cos(3 * math.pi / 4)))


def test_cli_learning_options_stop_early_and_say_why(vit_pair, tmp_path, monkeypatch):
    """--learn-patience / --learn-tolerance / --learn-seconds reach the learning options of align and barrier,
    and the output line says why learning stopped."""
    _checked_losses(monkeypatch, [1.0, 0.5, 0.45, 0.44])  # the last 2 checks gain 0.06 of 0.56: stop (tolerance 0.5)
    a, b = vit_pair
    code, stdout, stderr = run("align", b, a, "-o", tmp_path / "out", "--learn", "--learn-data", "digits",
                               "--learn-steps", 8, "--learn-patience", 2, "--learn-tolerance", "0.5",
                               "--stats", tmp_path / "stats.json", "--quiet", "--no-judge-starts",
                               "--learn-no-rate-trial")
    assert code == 0, stderr
    why = "the last 2 checks lowered the path loss by 0.06, no more than 0.5 of the 0.56 gained"
    assert "learned over 3 steps" in stdout and f"stopped early ({why})" in stdout
    learned = json.loads((tmp_path / "stats.json").read_text())["learned"]
    assert learned["steps"] == 3 and learned["stopped"] == why
    assert torch.allclose(outputs(tmp_path / "out"), outputs(b), atol=1e-4)
    monkeypatch.setattr(symgraph.learn, "time", _Clock())
    code, stdout, stderr = run("barrier", a, b, "--data", "digits", "--limit", 32, "--steps", 3,
                               "--align", "full+learn", "--learn-steps", 40, "--learn-seconds", "3.5",
                               "--learn-patience", 0, "-o", tmp_path / "b.png", "--no-progress", "--no-judge-starts")
    assert code == 0, stderr
    # 2 s after step 1 (1 s a step and 1 s before learning): the 1.5 s left do not fit a step of 2 s
    assert "stopped early (the time cap of 3.5 s)" in stdout and "learned over 2 steps" in stdout


def test_learned_general_linear_maps_stay_within_the_condition_bound(vit_pair, monkeypatch):
    """The same 4 steps from the same start learn QK / VO maps of condition above 1.5 without a bound and stay
    within a bound of 1.5 with it (projected back many times); the result is still the source's function."""
    _checked_losses(monkeypatch, [1.0, 0.9, 0.8, 0.7])  # every check better: the learned maps are kept
    a, b = vit_pair
    options = LearnOptions(steps=4, checks=2, eval_batches=1, lr=0.05, rate_trial=False)
    free = symgraph.align(b, a, learn_data="digits", learn=replace(options, max_condition=math.inf), progress=None)
    bound = 1.5
    _checked_losses(monkeypatch, [1.0, 0.9, 0.8, 0.7])
    result = symgraph.align(b, a, learn_data="digits", learn=replace(options, max_condition=bound), progress=None)
    assert free.learned["kept"] and result.learned["kept"]
    assert free.learned["largest_condition_number"] > bound * 1.1 and free.learned["condition_projections"] == 0
    assert free.learned["condition_bound"] is None
    learned = result.learned
    assert 1.0 < learned["largest_condition_number"] <= bound and learned["condition_bound"] == bound
    assert learned["condition_projections"] > 0
    assert result.start == "learned" and result.verified_error is not None
    assert torch.allclose(outputs(b, result.state), outputs(b), atol=1e-4)


def test_the_condition_bound_holds_for_the_start_and_the_learned_maps_composed(vit_pair, monkeypatch):
    """A copy of the shipped ViT moved by general linear head maps (condition 2.7 to 4.5), aligned back with
    general linear head maps as the start, then learned within a bound of 2: the maps that move the source (the
    start's and the learned ones composed) stay within 2, and the record reports them (bounding the learned maps
    alone left the composed ones at 3.4 to 5.3). The result is still the source's function."""
    _checked_losses(monkeypatch, [1.0, 0.9, 0.8, 0.7])  # every check better: the learned maps are kept
    anchor = symgraph.load(vit_pair[0])
    groups = [g for g in select_groups(anchor.report.groups, "full", general_linear=True)
              if g.kind == "general_linear"]
    rng = np.random.default_rng(0)
    moved = [sample(g, rng) for g in groups]
    assert min(np.linalg.cond(e.matrices).max() for e in moved) > 2.5
    model = copy.deepcopy(anchor.model)
    model.load_state_dict(apply(anchor.state_dict(), moved))
    source = symgraph.load(model)
    bound = 2.0
    result = symgraph.align(source, anchor, general_linear=True, learn_data="digits", progress=None,
                            learn=LearnOptions(steps=4, checks=2, eval_batches=1, lr=0.05, max_condition=bound))
    assert result.learned["kept"] and result.learned["condition_bound"] == bound
    composed = [float(np.linalg.cond(composed_matrices(result.elements, g)).max()) for g in groups]
    assert max(composed) <= bound * (1 + 1e-9)
    assert result.learned["largest_condition_number"] == pytest.approx(max(composed), rel=1e-9)
    assert result.verified_error is not None
    assert torch.allclose(outputs(vit_pair[0], result.state), outputs(source), atol=1e-4)


def test_the_largest_condition_covers_rotary_pass_through_blocks(monkeypatch):
    """Partial RoPE (phi): the dimensions RoPE leaves alone have a general linear map, bounded like the QK and VO
    maps; with those maps learned in their orthogonal groups (general_linear=False) they are the only ones the
    bound covers, and the record reports their condition (it reported none)."""
    _checked_losses(monkeypatch, [1.0, 0.9, 0.8, 0.7])
    a, b = (symgraph.load(zoo.build("phi", seed=seed)) for seed in (0, 1))
    assert any(g.kind == "rotary" and g.passthrough for g in a.report.groups)
    tokens = torch.randint(0, 100, (3, 4, 12), generator=torch.Generator().manual_seed(0))
    data = Dataset("tokens", "causal_lm", tuple(Batch({"input_ids": ids}, ids) for ids in tokens))
    result = symgraph.align(b, a, learn_data=data, progress=None, learn=LearnOptions(
        steps=4, checks=2, eval_batches=1, batch_size=4, lr=0.2, general_linear=False, max_condition=1.2))
    learned = result.learned
    assert learned["kept"] and learned["condition_projections"] > 0
    assert 1.0 < learned["largest_condition_number"] <= 1.2 * (1 + 1e-9)
    assert result.verified_error is not None


def test_cli_learn_max_condition_reaches_the_learning_options_and_the_record(vit_pair, tmp_path, monkeypatch):
    _checked_losses(monkeypatch, [1.0, 0.9, 0.8, 0.7])  # every check better: the learned maps are kept
    a, b = vit_pair
    code, stdout, stderr = run("align", b, a, "-o", tmp_path / "out", "--learn", "--learn-data", "digits",
                               "--learn-steps", 4, "--learn-lr", "0.2", "--learn-max-condition", "1.2",
                               "--stats", tmp_path / "stats.json", "--quiet")
    assert code == 0, stderr
    learned = json.loads((tmp_path / "stats.json").read_text())["learned"]
    assert learned["kept"] and learned["condition_bound"] == 1.2
    assert 1.0 < learned["largest_condition_number"] <= 1.2
    assert f"projected back to condition 1.2 {learned['condition_projections']} times" in stdout
    assert torch.allclose(outputs(tmp_path / "out"), outputs(b), atol=1e-4)
    code, _, stderr = run("barrier", a, b, "--data", "digits", "--align", "full+learn", "--learn-max-condition",
                          "0.5", "-o", tmp_path / "b.png")
    assert code == 2 and "0.5" in stderr and not (tmp_path / "b.png").exists()


@pytest.mark.parametrize("margin, lowered", [(None, 0), ("0", 1)])
def test_cli_learn_backtrack_margin_reaches_the_learning_options(vit_pair, tmp_path, monkeypatch, margin, lowered):
    _checked_losses(monkeypatch, [1.0, 0.8, 0.81, 0.7])  # 0.81: worse by 0.01, within half the 0.2 gained
    a, b = vit_pair
    code, stdout, stderr = run("align", b, a, "-o", tmp_path / "out", "--learn", "--learn-data", "digits",
                               "--learn-steps", 4, "--stats", tmp_path / "stats.json", "--quiet",
                               "--no-judge-starts",  # the judge would read the first path losses
                               "--learn-no-rate-trial",
                               *(("--learn-backtrack-margin", margin) if margin else ()))
    assert code == 0, stderr
    learned = json.loads((tmp_path / "stats.json").read_text())["learned"]
    assert len(learned["backtracks"]) == lowered, learned
    assert ("learning rate lowered 1 time" in stdout) == bool(lowered), stdout


@pytest.mark.slow
def test_cli_align_learn_writes_a_verified_model_and_its_record(vit_pair, tmp_path):
    a, b = vit_pair
    code, stdout, stderr = run("align", b, a, "-o", tmp_path / "out", "--data", "digits", "--learn",
                               "--learn-steps", 8, "--learn-lr", "0.003", "--stats", tmp_path / "stats.json")
    assert code == 0, stderr
    assert "learned over 8 steps" in stdout and "outputs checked" in stdout
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["learned"]["steps"] == 8 and stats["timings_s"]["learn"] > 0
    assert torch.allclose(outputs(tmp_path / "out"), outputs(b), atol=1e-4)


@pytest.mark.slow
def test_cli_align_learn_data_learns_from_the_weight_matched_start(vit_pair, tmp_path):
    a, b = vit_pair
    code, stdout, stderr = run("align", b, a, "-o", tmp_path / "out", "--learn", "--learn-data", "digits",
                               "--learn-steps", 2, "--quiet")
    assert code == 0, stderr
    assert "learned over 2 steps" in stdout and "costs:" not in stdout  # no group matched on activations
    assert torch.allclose(outputs(tmp_path / "out"), outputs(b), atol=1e-4)
    code, _, stderr = run("align", b, a, "-o", tmp_path / "other", "--learn-data", "digits")
    assert code == 2 and "learning was not asked for" in stderr and not (tmp_path / "other").exists()


@pytest.mark.slow
def test_barrier_full_learn_is_lower_than_full_on_the_shipped_vit(vit_pair):
    a, b = vit_pair
    data = load_data("digits", split="test", limit=96)
    # full mode without its own short learning on synthetic data: the alignment full+learn starts from
    result = barrier(a, b, data, steps=5, aligns=("full", "full+learn"), progress=False,
                     align_options={"short_learning": False},
                     learn=LearnOptions(steps=25, patience=0))  # all 25 steps: checks every 2 would stop it
    full, learned = result.curves["full"], result.curves["full+learn"]
    assert learned.loss_barrier < full.loss_barrier - 0.2
    assert learned.losses[0] == full.losses[0]  # same anchor end
    record = learned.to_json()["alignment"]["learned"]  # the learning record travels with the curve
    assert record["steps"] == 25 and record["kept"] and "learned" not in full.alignment


@pytest.mark.slow
def test_full_learn_starts_from_weights_and_full_data_learn_from_activations(vit_pair, monkeypatch):
    """Each learned mode starts from its base mode's alignment: full+learn's is weight-matched (the data is
    learned on, not matched on), full+data+learn's activation-matched; align(learn_data=...) is the API."""
    import symgraph.activations

    calls = []
    matched = symgraph.activations.align_on_activations
    monkeypatch.setattr(symgraph.activations, "align_on_activations",
                        lambda *args, **kwargs: calls.append(1) or matched(*args, **kwargs))
    a, b = vit_pair
    few = LearnOptions(steps=2, eval_batches=1)
    modes = ("full+learn", "full+data+learn")
    result = barrier(a, b, load_data("digits", split="test", limit=32), steps=3, aligns=modes, learn=few,
                     learn_data="digits", progress=False)
    assert set(result.curves) == set(modes) and len(calls) == 1  # full+data+learn's start only
    calls.clear()
    result = symgraph.align(b, a, learn=few, learn_data="digits")
    assert not calls and result.learned["steps"] == 2 and result.verified_error is not None


def test_barrier_refuses_unknown_learned_modes(vit_pair):
    a, b = vit_pair
    with pytest.raises(symgraph.SymgraphError, match="full\\+learn"):
        barrier(a, b, "digits", aligns=("none", "rotation+learn"), progress=False)


@pytest.mark.parametrize("method, weights, learn, t", [
    ("simple", None, True, {0.5}),  # the merged model is the path's midpoint: learned there
    ("simple", [1, 3], True, {0.25, 0.75}),  # in each frame the other model's share of the weights
    ("fisher", None, True, {"random"}),  # no point of the path at all
    ("simple", None, LearnOptions(t="random"), {"random"}),  # a point asked for is kept
    ("simple", [1, 3], LearnOptions(t=0.4), {0.4}),
])
def test_merge_learns_where_its_result_lies_on_the_path(vit_pair, monkeypatch, method, weights, learn, t):
    import symgraph.api

    seen = []
    monkeypatch.setattr(symgraph.api, "learned", lambda subject, groups, state, anchor, start, data, options, *rest:
                        seen.append(options.t) or start)  # the alignment left as it started
    symgraph.merge(list(vit_pair), method=method, weights=weights, data="digits", limit=16, learn=learn,
                   progress=False)
    assert seen and set(seen) == t


@pytest.mark.parametrize("extra, t", [((), 0.5), (("--learn-t", "random"), "random"), (("--learn-t", "0.3"), 0.3)])
def test_cli_merge_learns_at_the_midpoint_unless_told_otherwise(vit_pair, tmp_path, monkeypatch, extra, t):
    import symgraph.api

    seen = []
    monkeypatch.setattr(symgraph.api, "learned", lambda subject, groups, state, anchor, start, data, options, *rest:
                        seen.append(options.t) or start)
    code, _, stderr = run("merge", *vit_pair, "-o", tmp_path / "merged", "--data", "digits", "--limit", 16,
                          "--learn", "--no-progress", *extra)
    assert code == 0, stderr
    assert seen and set(seen) == {t}


@pytest.mark.parametrize("t, points", [("midpoint", (0.5,)), ("0.3", (0.3,)), ("random", symgraph.learn.CHECKED_T)])
def test_checks_score_the_candidates_where_learning_aims(vit_pair, tmp_path, monkeypatch, t, points):
    """Learning the midpoint (a simple merge's point) is checked at the midpoint alone: checked at t = 1/4 and 3/4
    too, the candidates were judged by neighbours that rise as the midpoint falls (wide ViT merge 1.35x -> 1.03x
    the endpoints' loss). The record and the summary say where."""
    seen, evaluate = [], symgraph.learn._InterpolatedLoss.evaluate

    def spied(self, other, batches, points=symgraph.learn.CHECKED_T):
        seen.append(tuple(points))
        return evaluate(self, other, batches, points)

    monkeypatch.setattr(symgraph.learn._InterpolatedLoss, "evaluate", spied)
    code, stdout, stderr = run("align", *reversed(vit_pair), "-o", tmp_path / "out", "--data", "digits",
                               "--learn", "--learn-steps", 2, "--learn-t", t,
                               "--stats", tmp_path / "stats.json")
    assert code == 0, stderr
    checks = [p for p in seen if p != symgraph.learn.CHECKED_T or t == "random"]
    assert len(checks) >= 3 and set(checks) == {points}  # the start, and a check at each of the 2 steps
    learned = json.loads((tmp_path / "stats.json").read_text())["learned"]
    assert learned["checked_t"] == list(points)
    assert f"path loss (t = {', '.join(f'{p:g}' for p in points)})" in stdout


def test_merge_reports_what_learning_did_for_each_model_in_the_frame_kept(vit_pair, tmp_path):
    code, stdout, stderr = run("merge", *vit_pair, "-o", tmp_path / "merged", "--data", "digits", "--limit", 16,
                               "--learn", "--learn-steps", 2, "--no-progress", "--json", tmp_path / "merge.json")
    assert code == 0, stderr
    report = json.loads((tmp_path / "merge.json").read_text())
    reference, learned = report["consensus"]["reference"], report["learned"]
    assert len(report["frames"]) == 2 and len(learned) == 2  # both frames learned; the kept one's records
    assert learned[reference] is None  # the reference does not move
    moved = learned[1 - reference]
    assert moved["steps"] == 2 and moved["checked_t"] == [0.5] and math.isfinite(moved["end_path_loss"])
    line = next(x for x in stdout.splitlines() if x.startswith(f"model {2 - reference} ("))
    assert "learned over 2 steps: path loss (t = 0.5) plus 1 x distillation on mixed inputs" in line
    without = symgraph.merge(list(vit_pair), align="full", progress=False)
    assert without.learned == () and without.to_json()["learned"] == []


def test_merge_refuses_learning_in_the_common_frame_before_any_work(vit_pair, tmp_path, monkeypatch):
    """Learning tunes alignments to the reference; the common frame's rounds would undo it (with learning they were
    skipped, and the merge was labelled common while made onto the reference)."""
    monkeypatch.setattr(symgraph.merging, "load", lambda *a, **k: pytest.fail("a model was read"))
    with pytest.raises(symgraph.errors.SymgraphError, match="cannot merge in the common frame"):
        symgraph.merge(list(vit_pair), data="digits", learn=True, frame="common", progress=False)
    code, _, stderr = run("merge", *vit_pair, "-o", tmp_path / "merged", "--data", "digits", "--learn", "--frame",
                          "common", "--no-progress")
    assert code != 0 and "cannot merge in the common frame" in stderr and not (tmp_path / "merged").exists()


def test_auto_t_learns_along_the_whole_path_outside_merges():
    assert symgraph.learn.resolved_t(LearnOptions()).t == "random" and LearnOptions().t == "auto"
    assert symgraph.learn.resolved_t(LearnOptions(), merged_at=0.25).t == 0.25
    assert symgraph.learn.resolved_t(LearnOptions(t="random"), merged_at=0.5).t == "random"
    assert symgraph.learn.resolved_t(LearnOptions(t="midpoint"), merged_at=0.25).t == "midpoint"


@pytest.mark.parametrize("value", ["1.5", "0", "1", "nan", "end"])
def test_cli_learn_t_outside_the_open_path_is_refused(vit_pair, tmp_path, value):
    code, _, stderr = run("align", *reversed(vit_pair), "-o", tmp_path / "out", "--data", "digits", "--learn",
                          "--learn-t", value)
    assert code == 2 and "strictly between 0 and 1" in stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_barrier_and_merge_take_learned_matching(vit_pair, tmp_path):
    a, b = vit_pair
    code, stdout, stderr = run("barrier", a, b, "--data", "digits", "--limit", 64, "--steps", 3,
                               "--align", "none,full+learn", "--learn-steps", 4, "-o", tmp_path / "b.png",
                               "--json", tmp_path / "b.json")
    assert code == 0, stderr
    assert set(json.loads((tmp_path / "b.json").read_text())["modes"]) == {"none", "full+learn"}
    assert "full+learn" in stdout
    code, stdout, stderr = run("merge", a, b, "-o", tmp_path / "merged", "--data", "digits", "--learn",
                               "--learn-steps", 4, "--no-progress")
    assert code == 0, stderr
    assert "learned matching" in stdout
    data = load_data("digits", limit=64)
    assert math.isfinite(evaluate(symgraph.load(str(tmp_path / "merged")).model, data).loss)


@pytest.mark.parametrize("command", ["align", "merge", "barrier"])
def test_cli_learning_defaults_shown_in_help_are_the_options_defaults(command):
    """Each --learn-* option whose help shows a plain value shows LearnOptions' own default (the help text is
    written by hand, the default read lazily: the two must not drift apart, as when the steps went 300 -> 1000)."""
    from symgraph.cli import cli

    shown = {}
    for param in cli.commands[command].params:
        name = param.name.removeprefix("learn_")
        if param.name.startswith("learn_") and isinstance(param.show_default, str) and hasattr(LearnOptions, name):
            shown[name] = param.show_default
    assert {"steps", "lr", "batch_size", "patience", "t"} <= set(shown)
    for name, text in shown.items():
        value = getattr(LearnOptions, name)
        if isinstance(value, str) or text.replace(".", "", 1).isdigit():
            assert text == str(value), f"--learn-{name.replace('_', '-')} shows {text}, LearnOptions has {value}"


@pytest.mark.parametrize("concentration, spread", [(None, (0.1, 0.22)), ("16", (0.03, 0.14)), ("1", (0.24, 0.4))])
def test_random_points_gather_near_the_midpoint_as_concentrated(vit_pair, tmp_path, monkeypatch, concentration,
                                                                spread):
    """Learning the whole path draws t from Beta(c, c): the default c keeps most points near the midpoint, where
    barriers peak (llama-chars 0.478 -> 0.424 at 1000 steps); --learn-t-concentration 1 draws them uniformly."""
    drawn, sample = [], symgraph.learn._Run.sample

    def spied(self):
        t, batch = sample(self)
        drawn.append(t)
        return t, batch

    monkeypatch.setattr(symgraph.learn._Run, "sample", spied)
    code, _, stderr = run("align", *reversed(vit_pair), "-o", tmp_path / "out", "--learn", "--learn-data", "digits",
                          "--learn-steps", 40, "--learn-patience", 0, "--no-judge-starts", "--quiet",
                          *(("--learn-t-concentration", concentration) if concentration else ()))
    assert code == 0, stderr
    assert len(drawn) == 40 and all(0 < t < 1 for t in drawn)
    assert spread[0] < float(np.std(drawn)) < spread[1]  # Beta(4, 4): 0.167; Beta(16, 16): 0.087; uniform: 0.289


def test_checked_batches_are_held_out_spread_over_the_data_where_it_has_enough():
    held_out = symgraph.learn.held_out
    batches = tuple(range(20))
    stepped, checked, held = held_out(batches, LearnOptions(eval_batches=4, holdout=True))
    assert held and checked == (0, 6, 13, 19)  # spread: neighbouring text windows are alike
    assert sorted(stepped + checked) == list(batches) and not set(stepped) & set(checked)
    stepped, checked, held = held_out(batches[:7], LearnOptions(eval_batches=4, holdout=True))  # too few
    assert not held and stepped == batches[:7] and checked == batches[:4]
    stepped, checked, held = held_out(batches, LearnOptions(eval_batches=4))  # the default: no holdout
    assert not held and stepped == batches and checked == batches[:4]


@pytest.mark.parametrize("flag, held", [(("--learn-holdout",), True), ((), False)])
def test_learning_with_holdout_never_steps_on_the_batches_it_checks(vit_pair, tmp_path, monkeypatch, flag, held):
    """Learning fits the batches it steps on (the wide ViT's midpoint: 0.002 there, 0.08 on the test split); with
    --learn-holdout candidates are scored on batches held out of the steps."""
    stepped, checked = [], []
    sample, evaluate_ = symgraph.learn._Run.sample, symgraph.learn._InterpolatedLoss.evaluate

    def spied_sample(self):
        t, batch = sample(self)
        stepped.append(id(batch))
        return t, batch

    def spied_evaluate(self, other, batches, *points):
        checked.extend(id(b) for b in batches)
        return evaluate_(self, other, batches, *points)

    monkeypatch.setattr(symgraph.learn._Run, "sample", spied_sample)
    monkeypatch.setattr(symgraph.learn._InterpolatedLoss, "evaluate", spied_evaluate)
    code, _, stderr = run("align", *reversed(vit_pair), "-o", tmp_path / "out", "--learn", "--learn-data", "digits",
                          "--learn-steps", 30, "--learn-eval-batches", 3, "--learn-patience", 0, "--no-judge-starts",
                          "--quiet", "--stats", tmp_path / "stats.json", *flag)
    assert code == 0, stderr
    assert len(stepped) == 30 and len(set(checked)) == 3
    if held:
        assert not set(stepped) & set(checked)
    assert json.loads((tmp_path / "stats.json").read_text())["learned"]["checked_on_held_out"] is held


@pytest.mark.parametrize("holdout, mixup, why", [(True, 0.0, "batches learning held out"),
                                                 (False, 1.0, "distillation on mixed training inputs"),
                                                 (False, 0.0, "lowest merged loss on digits")])
def test_merge_with_learning_keeps_the_frame_by_what_learning_checked(vit_pair, holdout, mixup, why):
    """On the batches learning stepped on every frame's merge fits alike: held-out checks, or checks that add the
    distillation on mixed inputs, tell them apart and score the frames. With neither the merged models are scored on
    the data, as every merge with data is."""
    result = symgraph.merge(list(vit_pair), data="digits", limit=16,
                            learn=LearnOptions(steps=3, eval_batches=2, holdout=holdout, mixup=mixup), progress=False)
    moved = result.learned[1 - result.consensus.reference]
    assert moved["checked_on_held_out"] is holdout
    assert result.frames[result.frame] == min(result.frames.values())
    assert why in result.frame_note
    if holdout or mixup:
        assert result.frames[result.frame] == moved["end_path_loss"]
    else:
        assert result.frames[result.frame] != moved["end_path_loss"]


def test_distillation_on_mixed_inputs_teaches_the_endpoints_mixed_probabilities():
    """The term's target is ``(1 - t) p_A + t p_B`` on inputs mixed within the batch: with B = A it is p_A, and the
    loss is then p_A's entropy on those inputs (recomputed here from the same mixing draws)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 5))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = Batch({"input": torch.randn(6, 1, 4, 4)}, torch.arange(6) % 5)
    data = Dataset("tiny", "classification", (batch,))
    loss_at = symgraph.learn._InterpolatedLoss(model, state, list(state), "classification")
    distill = symgraph.learn._MixedDistillation.of(loss_at, data, LearnOptions(seed=3))
    got = distill(state, 0.3, batch)
    draws = torch.Generator().manual_seed(3)
    share, partner = torch.rand(6, generator=draws), torch.randperm(6, generator=draws)
    x = batch.inputs["input"]
    mixed = share.reshape(-1, 1, 1, 1) * x + (1 - share.reshape(-1, 1, 1, 1)) * x[partner]
    p = model(mixed).softmax(-1)
    assert torch.allclose(got, -(p * p.log()).sum(-1).mean(), atol=1e-6)
    other = {k: v + 0.1 * torch.randn_like(v) for k, v in state.items()}  # another model: the target moves with t
    assert not torch.allclose(distill(other, 0.0, batch), distill(other, 1.0, batch))


def test_distillation_on_mixed_inputs_only_where_inputs_can_be_mixed():
    """Pixels mix; token ids do not (a causal LM, a token classifier), and synthetic data, soft targets from the
    endpoints, is their distillation already: there learning takes the task loss alone (the record says which)."""
    tokens = Batch({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, torch.zeros(2, dtype=torch.long))
    pixels = Batch({"input": torch.zeros(2, 1, 4, 4)}, torch.zeros(2, dtype=torch.long))
    of = symgraph.learn._MixedDistillation.of
    assert of(None, Dataset("p", "classification", (pixels,)), LearnOptions()) is not None
    assert of(None, Dataset("p", "classification", (pixels,)), LearnOptions(mixup=0)) is None
    assert of(None, Dataset("t", "classification", (tokens,)), LearnOptions()) is None
    assert of(None, Dataset("t", "causal_lm", (tokens,)), LearnOptions()) is None
    soft = Batch(pixels.inputs, targets=(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long)))
    assert of(None, Dataset("synthetic", "classification", (pixels, soft)), LearnOptions()) is None


def test_distillation_checks_mix_every_candidates_batches_alike():
    """A check compares candidates on the same mixed inputs whatever the steps drew in between: the generator is
    seeded afresh per batch (seed + 1 + the batch's index)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 5))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = tuple(Batch({"input": torch.randn(6, 1, 4, 4)}, torch.arange(6) % 5) for _ in range(2))
    loss_at = symgraph.learn._InterpolatedLoss(model, state, list(state), "classification")
    distill = symgraph.learn._MixedDistillation.of(loss_at, Dataset("tiny", "classification", batches),
                                                   LearnOptions(seed=3))
    other = {k: v + 0.1 * torch.randn_like(v) for k, v in state.items()}
    first = distill.evaluate(other, batches, (0.5,))
    distill(other, 0.5, batches[0])  # a step's draw moves the run's generator, not the checks'
    assert distill.evaluate(other, batches, (0.5,)) == first
    expected = np.mean([float(distill(other, 0.5, b, torch.Generator().manual_seed(3 + 1 + i)))
                        for i, b in enumerate(batches)])
    assert first == pytest.approx(expected, rel=1e-6)
    assert first != pytest.approx(float(distill(other, 0.5, batches[0])), rel=1e-3)


def test_checks_score_the_task_loss_plus_the_weighted_distillation(vit_pair):
    """With mixup the start's path loss (and every check) is the task loss plus ``mixup`` times the distillation
    on the checked batches, mixed alike: linear in the weight, the task loss alone at 0."""
    def start(mixup):
        result = symgraph.align(vit_pair[1], vit_pair[0], data="digits",
                                learn=LearnOptions(steps=1, checks=1, eval_batches=2, mixup=mixup), progress=False)
        return result.learned["start_path_loss"]

    task, half, one = start(0.0), start(0.5), start(1.0)
    assert one - task > 0.01
    assert half - task == pytest.approx((one - task) / 2, rel=1e-4)


@pytest.mark.parametrize("mixup, recorded", [(None, 1.0), ("0", 0.0)])
def test_cli_learn_mixup_reaches_the_steps_and_the_record(vit_pair, tmp_path, monkeypatch, mixup, recorded):
    calls = []
    call = symgraph.learn._MixedDistillation.__call__
    monkeypatch.setattr(symgraph.learn._MixedDistillation, "__call__",  # the steps' calls: a new mix each
                        lambda self, other, t, batch, generator=None: (generator is None and calls.append(1))
                        or call(self, other, t, batch, generator))
    code, _, stderr = run("align", *reversed(vit_pair), "-o", tmp_path / "out", "--learn", "--learn-data", "digits",
                          "--learn-steps", 3, "--no-judge-starts", "--quiet", "--stats", tmp_path / "stats.json",
                          *(("--learn-mixup", mixup) if mixup else ()))
    assert code == 0, stderr
    assert json.loads((tmp_path / "stats.json").read_text())["learned"]["mixup"] == recorded
    assert len(calls) == (3 if recorded else 0)


def _scripted_checks(monkeypatch, losses):
    """The checks find ``losses`` (:func:`_checked_losses`); after each, record the learning rate factor, the
    elements' values (what the next steps start from), the best point's and the start's, and the trial running."""
    _checked_losses(monkeypatch, losses)
    seen, original = [], symgraph.learn._Run.checked_better

    def spied(self, state, step):
        better = original(self, state, step)
        seen.append({"step": step + 1, "lr_factor": self.lr_factor, "values": self.elements.values(),
                     "best": self.best_values, "start": self.start_values, "trial": self.trial})
        return better

    monkeypatch.setattr(symgraph.learn._Run, "checked_better", spied)
    return seen


def _same_values(a, b) -> bool:
    return all(torch.equal(p, q) and (c is None or torch.equal(c, d)) for (p, c), (q, d) in zip(a, b))


@pytest.mark.parametrize("trial_check, kept", [(6.0, 1.0), (4.0, 0.3)])
def test_first_backtrack_to_the_first_point_tries_the_lower_rate_from_the_start(vit_pair, monkeypatch, trial_check,
                                                                                 kept):
    """The first check beats the start and the second is clearly worse: learning goes back to the start (not to
    the first check's point) at 0.3x the rate for one check's steps, then goes on at that rate from whichever
    point checked lower: the trial's, or the first check's with fresh moments."""
    seen = _scripted_checks(monkeypatch, [10.0, 5.0, 9.0, trial_check, 2.0])  # the start, then 4 checks
    result = symgraph.align(vit_pair[1], vit_pair[0], data="digits",
                            learn=LearnOptions(steps=12, checks=4, eval_batches=1), progress=False)
    assert result.learned["rate_trial"] == {"steps": [6, 9], "rates": [0.01, pytest.approx(0.003)],
                                            "checked": [5.0, trial_check], "kept": pytest.approx(0.01 * kept)}
    assert [b["step"] for b in result.learned["backtracks"]] == [6]
    backtracked, tried = seen[1], seen[2]
    assert backtracked["trial"] is not None and backtracked["lr_factor"] == pytest.approx(0.3)
    assert _same_values(backtracked["values"], backtracked["start"])
    assert not _same_values(backtracked["best"], backtracked["start"])  # the first check's point stays the best
    assert tried["trial"] is None and tried["lr_factor"] == pytest.approx(0.3)
    assert _same_values(tried["values"], tried["best"]) is (kept == 1.0)  # back at the first check's point
    assert result.learned["end_path_loss"] == 2.0 and result.learned["kept"]  # the last of the 4 checks


@pytest.mark.parametrize("losses, options", [
    ([10.0, 12.0, 9.0, 8.0, 7.0, 6.0], {}),  # the first check does not beat the start: back there anyway
    ([10.0, 5.0, 4.0, 9.0, 3.0, 2.0], {}),  # the full rate gained twice before the backtrack
    ([10.0, 5.0, 9.0, 4.0, 3.0, 2.0], {"rate_trial": False}),
])
def test_no_rate_trial_unless_the_first_backtrack_returns_to_the_first_point(vit_pair, monkeypatch, losses,
                                                                             options):
    seen = _scripted_checks(monkeypatch, losses)
    result = symgraph.align(vit_pair[1], vit_pair[0], data="digits",
                            learn=LearnOptions(steps=15, checks=5, eval_batches=1, **options), progress=False)
    assert result.learned["rate_trial"] is None and all(s["trial"] is None for s in seen)
    assert len(result.learned["backtracks"]) == 1
    backtracked = next(s for s in seen if s["lr_factor"] < 1)
    assert _same_values(backtracked["values"], backtracked["best"])  # back to the best point, as any backtrack


def test_no_rate_trial_when_the_full_rate_keeps_gaining(vit_pair, monkeypatch):
    seen = _scripted_checks(monkeypatch, [10.0, 5.0, 4.0, 3.0, 2.0])
    result = symgraph.align(vit_pair[1], vit_pair[0], data="digits",
                            learn=LearnOptions(steps=12, checks=4, eval_batches=1), progress=False)
    assert result.learned["rate_trial"] is None and not result.learned["backtracks"]
    assert [s["lr_factor"] for s in seen] == [1.0] * 4


def test_cli_learn_no_rate_trial_reaches_the_record(vit_pair, tmp_path, monkeypatch):
    checks = [10.0, 5.0, 9.0, *np.linspace(3, 1, 12)]  # the start, then a check per step (12 steps, 10 checks)
    _scripted_checks(monkeypatch, checks)
    for flag, trial in (("--learn-rate-trial", True), ("--learn-no-rate-trial", False)):
        code, stdout, stderr = run("align", *reversed(vit_pair), "-o", tmp_path / flag, "--data", "digits",
                                   "--learn", "--learn-steps", 12, "--stats", tmp_path / "stats.json", flag)
        assert code == 0, stderr
        learned = json.loads((tmp_path / "stats.json").read_text())["learned"]
        assert (learned["rate_trial"] is not None) is trial
        assert ("the first backtrack tried rate 0.003 from the start and went on from its point (checked 3 "
                "against 5)" in stdout) is trial
        _scripted_checks(monkeypatch, checks)



@pytest.mark.parametrize("family", ["gpt2", "llama-tied"])
def test_a_tied_head_moved_by_group_elements_is_scored_through_the_name_they_wrote(family):
    """Elements write the name of a tie the graph reads (here the LM head, not the embedding registered first), and
    its alias keeps the old value until tie_aliases: the path loss and the judge must read the written name. Read
    through the stale embedding, a held-out GPT-2 pair's aligned end scored 5.1 where it computes 1.7, and full mode
    judged its candidates and skipped its learning on that."""
    from symgraph.consensus import shared_float_names
    from symgraph.learn import path_and_end_losses, written_by
    from symgraph.synthetic import PathJudge, synthetic_data
    from symgraph.verify import tie_aliases

    model = zoo.build(family, seed=0)
    subject = symgraph.load(model, zoo.example_inputs_for(family, model))
    state = subject.state_dict()
    moved = apply(state, symgraph.sample_elements(subject.report, seed=3), dtype=torch.float32)  # untied: as aligned
    head, embedding = "lm_head.weight", next(n for n in state if n.endswith("embed_tokens.weight") or
                                             n.endswith("wte.weight"))
    assert not torch.equal(moved[head], moved[embedding])  # the state the bug met: the alias is stale
    written = written_by(subject.report.groups)
    data = synthetic_data(model, [state, state], examples=8, batch_size=8)
    names = shared_float_names(state, frozenset())
    _, own = path_and_end_losses(model, state, state, names, data)
    _, ends = path_and_end_losses(model, state, moved, names, data, written=written)
    _, stale = path_and_end_losses(model, state, moved, names, data)
    assert ends == pytest.approx(own, rel=1e-4)  # g.A computes A's function: its end loses what A's does
    assert abs(stale - own) > 1e-2  # read through the stale embedding it computes something else
    judge = PathJudge(model, state, state, written=written, examples=8)
    assert judge(moved) == pytest.approx(judge(tie_aliases(model, moved)), rel=1e-4)


def test_the_short_learning_takes_fewer_steps_the_more_a_step_writes_within_its_bounds():
    from symgraph.learn import SHORT_LEARNING_ELEMENTS, SHORT_LEARNING_STEPS, short_learning_steps

    fewest, most = SHORT_LEARNING_STEPS
    assert short_learning_steps(None, 32) == fewest  # uncountable: the cost it always had
    assert short_learning_steps(10, 32) == most
    assert short_learning_steps(10**12, 32) == fewest
    middle = int(SHORT_LEARNING_ELEMENTS // (32 * (fewest + most) // 2)) + 1
    steps = [short_learning_steps(n, 32) for n in (middle // 2, middle, 2 * middle)]
    assert fewest < steps[-1] < steps[1] < steps[0] <= most
    assert short_learning_steps(middle, 16) > steps[1]  # smaller batches: more of them
