"""The ``symgraph`` command line. Commands only parse, validate and call the library (:mod:`symgraph.api`)."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import signal
import sys
import time
from pathlib import Path

import click

from .errors import OutputError, SymgraphError

MODEL_HELP = ("MODEL is a Hugging Face folder (config.json + weights), a config.json (with --config-only), or a "
              "'package.module:factory' / 'file.py:factory' returning a module or (module, args[, kwargs]).")


_FREE_OUTPUTS = click.option(
    "--free-outputs", is_flag=True,
    help="Base models and sentence encoders: outputs that are residual-stream reads (hidden states) may change "
         "basis by the residual stream's permutation or orthogonal map instead of pinning it; every check compares "
         "them after undoing that map. Other outputs (pooled, logits) stay pinned.")


@click.group(help=f"Find and use the parameter-space symmetries of PyTorch models.\n\n{MODEL_HELP}")
@click.option("--debug", is_flag=True, help="Show full tracebacks for unexpected errors.")
@click.pass_context
def cli(ctx, debug):
    ctx.obj = {"debug": debug}
    logging.getLogger("transformers").setLevel(logging.ERROR)


@cli.command(help=f"Report every symmetry group of MODEL.\n\n{MODEL_HELP}")
@click.argument("model")
@click.option("--config-only", is_flag=True, help="Build from config.json on the meta device (no weights read).")
@click.option("--format", "fmt", type=click.Choice(["json", "md", "html"]), default="md", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write here (default: stdout).")
@click.option("--full-depth", is_flag=True, help="Analyse every block even when they repeat (slower, same report).")
@_FREE_OUTPUTS
def report(model, config_only, fmt, output, full_depth, free_outputs):
    from .api import load
    from .render import render

    _check_file_output(output, [model])
    text = render(load(model, config_only=config_only, full_depth=full_depth, free_outputs=free_outputs).report,
                  fmt)
    _emit_text(text, output)


@cli.command(help="Write a functionally equivalent, randomly reparametrised copy of MODEL as a Hugging Face folder.")
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists (only once the new copy is complete).")
@_FREE_OUTPUTS
def transform(model, output, seed, overwrite, free_outputs):
    from .api import load, transformed
    from .io import save_model

    _check_model_output(output, overwrite, [model], written_from=[model])
    subject = load(model, free_outputs=free_outputs)
    state, outcome = transformed(subject, seed)
    save_model(state, output, config=subject.config, like=subject.path, overwrite=overwrite)
    click.echo(f"wrote {output} ({len(subject.report.groups)} groups applied, seed {seed}; "
               f"{_equality(outcome.relative_error, outcome.tolerance, state, outcome.rounded_exact)}"
               f"{_free_note(subject)})")


@cli.command(help="Fold every norm's weight (and a LayerNorm's bias) into the linear layers that read it; for "
                  "pre-LayerNorm models also centre everything written into the residual stream. Writes the same "
                  "architecture (norm weights 1, biases 0), checked in float64 to compute what MODEL computes; the "
                  "residual stream then has an orthogonal symmetry group.")
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write what was folded and centred.")
@click.option("--untie/--no-untie", default=None,
              help="Give tied weights (an embedding that is also the LM head) tensors of their own first, so the "
                   "final norm folds into the head; OUTPUT's config then says they are not tied (one more "
                   "vocabulary-sized matrix on disk). Default: where a tie keeps a norm from folding; --no-untie "
                   "refuses such a fold.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists (only once the new copy is complete).")
def fold(model, output, json_path, untie, overwrite):
    from .api import load
    from .fold import fold as run_fold
    from .io import save_model

    _check_distinct_outputs(**{"-o": output, "--json": json_path})
    _check_model_output(output, overwrite, [model], written_from=[model])
    _check_file_output(json_path, [model])
    subject = load(model)
    result = run_fold(subject, untie=untie)
    with _side_file(json_path, lambda: json.dumps(result.to_json(), indent=1)):
        save_model(result.state, output, config=result.config, like=subject.path, overwrite=overwrite)
    untied = f", tied weights untied: {', '.join(result.untied)}" if result.untied else ""
    click.echo(f"wrote {output}: {len(result.norms)} norms folded, {len(result.centred)} residual writers centred"
               f"{untied}; "
               f"outputs equal to the model's (relative error {result.verified_error:.1e}"
               f"{_rounded_note(result.verified_rounded)})")


_FOLD_HELP = ("Fold the norms of the models first (see `symgraph fold`): the residual stream then aligns by an "
              "orthogonal map instead of a permutation.")
_FOLD_OPTION = click.option("--fold/--no-fold", default=None,
                            help=f"{_FOLD_HELP} Default: fold whenever the norms can be folded (merge: when it "
                                 f"aligns; unaligned, it averages the weights as stored) (measured barriers fell on "
                                 f"the shipped pairs: examples/results/fold.json).")
_UNTIE_OPTION = click.option("--untie/--no-untie", default=None,
                             help="Where folding, give tied weights (an embedding that is also the LM head) tensors "
                                  "of their own first, so the final norm folds into the head (see `symgraph fold "
                                  "--untie`). Default: where a tie keeps a norm from folding (merge: when it "
                                  "aligns), which the output says; --no-untie keeps ties (tied models then stay "
                                  "unfolded).")


# without data, how a full alignment chooses between its candidates (align, barrier, and merge's first alignments)
_JUDGE_OPTIONS = [
    click.option("--judge-starts/--no-judge-starts", default=True, show_default=True,
                 help="Without data: choose between the two starts by the loss along the path on 64 synthetic "
                      "examples labelled by both models (classifiers and causal LMs); otherwise full mode keeps "
                      "the closer start and permutation mode the textbook one. Permutation mode stays no "
                      "farther than textbook weight matching either way."),
    click.option("--synthetic-activations/--no-synthetic-activations", default=True, show_default=True,
                 help="Full mode without data: also align the residual stream on activations of the judge's "
                      "synthetic examples and keep that alignment where its path loss on them is lower (the "
                      "wide ViT pair's barrier 2.35 -> 0.57; see README.md)."),
    click.option("--short-learning/--no-short-learning", default=True, show_default=True,
                 help="Full mode without --learn: where the path rises above its ends on the judged examples "
                      "(without --data the judge's synthetic ones, with it the batches of the activation costs), "
                      "tune the alignment by a short learned matching (50-300 steps, fewer the costlier a step) on "
                      "other examples (without --data synthetic ones; with it the data's other batches, and for "
                      "token data synthetic ones too) and "
                      "keep the one whose path loss on the judged examples is lowest (see README.md)."),
]


def _with_options(command, options):
    """``command`` with every click option of ``options``, listed in the order ``--help`` shows them."""
    for option in reversed(options):
        command = option(command)
    return command


def _judge_options(command):
    """:data:`_JUDGE_OPTIONS` on ``command`` (merge; align and barrier have them among :func:`_descent_options`)."""
    return _with_options(command, _JUDGE_OPTIONS)


def _descent_options(command):
    """The options of every alignment's descent, shared by ``align`` and ``barrier`` (see :func:`_descent`)."""
    options = [
        click.option("--no-rescale", is_flag=True, help="Ablation: no QK / rotary rescaling."),
        click.option("--refine-rounds", type=click.IntRange(min=0), default=None,
                     help="At most this many coordinate-descent rounds after the first pass (0: first pass only; "
                          "default 8, or 100 when the residual stream is orthogonal, as in a folded model)."),
        click.option("--tolerance", type=click.FloatRange(min=0), default=1e-4, show_default=True,
                     help="Stop descending once a round lowers the distance by less than this fraction."),
        click.option("--matching-start/--no-matching-start", default=True, show_default=True,
                     help="Full and permutation modes: descend also from weight matching of the permutations "
                          "(textbook, to convergence, in permutation mode; one round in full mode, skipped once "
                          "the first start removed 90% of the distance); without data, the start whose aligned "
                          "model has the lower loss along the path on synthetic data is kept (see "
                          "--judge-starts)."),
        *_JUDGE_OPTIONS,
        click.option("--general-linear", is_flag=True,
                     help="Full mode: align QK and VO pairs in GL(d_head) (their exact group) instead of its "
                          "orthogonal subgroup; never farther than the orthogonal solution, condition <= 100."),
        click.option("--balance-costs", "balance", is_flag=True,
                     help="Full mode: count each parameter's cost in units of the anchor's RMS of that parameter "
                          "(lower barriers on most folded pairs, higher on unfolded ones; see RESULTS.md)."),
        click.option("--residual-group", "residual", type=click.Choice(["auto", "orthogonal", "permutation"]),
                     default="auto", show_default=True,
                     help="Full mode on folded models: align the residual stream by an orthogonal map or by "
                          "permutations only. auto: permutations for a LayerNorm stream between independent "
                          "models (lower barriers on the ViT pairs), the orthogonal group otherwise (LLaMA pairs, "
                          "exact copies, --data); see RESULTS.md."),
    ]
    return _with_options(command, options)


class _PathPoint(click.ParamType):
    """--learn-t: auto, midpoint, random, or a number strictly between 0 and 1 (a point of the path)."""

    name = "[auto|midpoint|random|T]"

    def convert(self, value, param, ctx):
        from .learn import T_CHOICES, is_path_point

        if not isinstance(value, str) or value in T_CHOICES:
            return value
        try:
            point = float(value)
        except ValueError:
            point = None
        if not is_path_point(point):
            self.fail(f"{value!r} is not one of {', '.join(T_CHOICES)} or a number strictly between 0 and 1.",
                      param, ctx)
        return point


def _learn_options(command, *, flag: bool = True):
    """Learned matching's options (:class:`symgraph.learn.LearnOptions`), shared by ``align``, ``merge`` and
    ``barrier`` (whose learned modes, e.g. ``full+learn``, take the place of the ``--learn`` flag)."""
    options = [
        click.option("--learn-steps", type=click.IntRange(min=1), default=lambda: _learn_default("steps"),
                     show_default="1000",
                     help="Optimiser steps of learned matching: the learning rate anneals over them, and learning "
                          "stops after them at the latest."),
        click.option("--learn-patience", type=click.IntRange(min=0), default=lambda: _learn_default("patience"),
                     show_default="3",
                     help="Stop learning early when this many checks of the path loss in a row together lowered it "
                          "by no more than --learn-tolerance of what learning has gained so far (0: never)."),
        click.option("--learn-tolerance", type=click.FloatRange(min=0), default=lambda: _learn_default("tolerance"),
                     show_default="0: stop only when the checks gained nothing",
                     help="See --learn-patience: a fraction of the path loss gained so far."),
        click.option("--learn-seconds", type=click.FloatRange(min=0, min_open=True),
                     default=lambda: _learn_default("seconds"), show_default="no cap",
                     help="A time cap of learning (each time it is learned): the learning rate anneals over the steps "
                          "that fit in it at the time per step so far, and learning stops there."),
        click.option("--learn-max-condition", type=click.FloatRange(min=1),
                     default=lambda: _learn_default("max_condition"), show_default="100, as the data-free solver",
                     help="Direct method: the largest condition number a general linear map (QK, VO) moving the "
                          "source may reach, the start's map and the learned one composed; a step beyond it is "
                          "projected back onto it (inf: no bound)."),
        click.option("--learn-lr", type=click.FloatRange(min=0, min_open=True), default=lambda: _learn_default("lr"),
                     show_default="0.01",
                     help="Learning rate (Adam, cosine-annealed) of learned matching, width-aware: the step of each "
                          "entry of a 64 x 64 generator and of every log-scale or angle; a generator of side n "
                          "steps lr * sqrt(64 / n), so the weights move about as far per step at every width. "
                          "Lowered (backtracking) when a check finds the path loss worse than the best so far "
                          "(see --learn-backtrack-margin)."),
        click.option("--learn-backtrack-margin", type=click.FloatRange(min=0),
                     default=lambda: _learn_default("backtrack_margin"), show_default="0.5",
                     help="A check of the path loss sends learning back to the best point so far at a lower "
                          "learning rate when it is worse than the best by more than this fraction of the path "
                          "loss gained so far, or is the second check in a row no better than the best (0: "
                          "whenever it is no better)."),
        click.option("--learn-batch-size", type=click.IntRange(min=1), default=lambda: _learn_default("batch_size"),
                     show_default="32", help="Training examples per step of learned matching."),
        click.option("--learn-synthetic-examples", type=click.IntRange(min=1),
                     default=lambda: _learn_default("synthetic_examples"), show_default="1600",
                     help="How many examples --learn-data synthetic makes from the models aligned (a "
                          "classifier's pixels inverted by 30 steps each, a causal LM's sampled): fewer cost "
                          "less and fit less."),
        click.option("--learn-t", type=_PathPoint(), default=lambda: _learn_default("t"), show_default="auto",
                     help="Where on the path the loss is taken: the midpoint, a number strictly between 0 and 1, "
                          "or a random point each step; auto: in a simple merge of two models the point the merged "
                          "model is (the other model's share of the weights: the midpoint for equal weights), "
                          "random points everywhere else. Candidates are checked there too: at that point, or at "
                          "t = 1/4, 1/2, 3/4."),
        click.option("--learn-t-concentration", type=click.FloatRange(min=0, min_open=True),
                     default=lambda: _learn_default("t_concentration"), show_default="4.0",
                     help="Random points (--learn-t random) are drawn from Beta(c, c) with this c: large values keep "
                          "them near the midpoint, where loss barriers peak; 1: uniform along the path."),
        click.option("--learn-mixup", type=click.FloatRange(min=0), default=lambda: _learn_default("mixup"),
                     show_default="1.0",
                     help="Classifiers whose inputs are all floating point (pixels, audio): weight of a second term "
                          "of each step's loss, on each example mixed with another of its batch, teaching the "
                          "interpolated model there the endpoints' probabilities mixed as the path mixes them (they "
                          "have memorised the training examples, not these; 0: none)."),
        click.option("--learn-eval-batches", type=click.IntRange(min=1),
                     default=lambda: _learn_default("eval_batches"), show_default="4",
                     help="Batches of the data each candidate alignment is checked on (the best one checked is the "
                          "result)."),
        click.option("--learn-holdout/--learn-no-holdout", default=lambda: _learn_default("holdout"),
                     show_default="no holdout",
                     help="Hold the checked batches out of the steps, where the data has at least twice as many "
                          "(learning fits the batches it steps on far better than unseen examples)."),
        click.option("--learn-rate-trial/--learn-no-rate-trial", default=lambda: _learn_default("rate_trial"),
                     show_default="trial",
                     help="Direct method: a first backtrack to the first check's point goes back to the start "
                          "instead, for one check's steps at the lowered rate, and learning goes on from whichever "
                          "point checked lower."),
        click.option("--learn-method", type=click.Choice(["direct", "ste"]), default=lambda: _learn_default("method"),
                     show_default="direct",
                     help="direct: gradient descent on the continuous group elements (exponential maps), "
                          "permutations kept from the start; ste: Git Re-Basin's straight-through estimator."),
    ]
    if flag:
        options.insert(0, click.option(
            "--learn", is_flag=True,
            help="Learned matching: tune the alignment on the loss of the interpolated model (points along the "
                 "path) on the training split of --data; the result is still an exact reparametrisation."))
    return _with_options(command, options)


def _data_options(command):
    """Options of activation-based costs (symgraph.activations), shared by align and barrier."""
    options = [
        click.option("--data-batches", default=4, show_default=True, type=click.IntRange(min=1),
                     help="Batches of the alignment data run through both models."),
        click.option("--data-batch-size", default=16, show_default=True, type=click.IntRange(min=1),
                     help="Examples per batch of the alignment data."),
        click.option("--data-groups", type=click.Choice(["residual", "all"]), default="residual",
                     show_default=True,
                     help="Groups matched on activations (the others, after them, on weights): the residual "
                          "stream, or every group whose coordinates some activation carries."),
    ]
    return _with_options(command, options)


def _compute_options(where: str, default_dtype: str):
    """--device and --dtype (symgraph.alignment.compute_device / compute_dtype), shared by align, merge, barrier."""
    def decorate(command):
        command = click.option("--dtype", type=click.Choice(["float32", "float64"]),
                               help=f"Compute dtype (default: {default_dtype}).")(command)
        return click.option("--device", default="cpu", show_default=True,
                            help=f"Where {where}: cpu, cuda or cuda:N.")(command)
    return decorate


def _learn_default(name: str):
    from .learn import LearnOptions

    return getattr(LearnOptions, name)


def _learning(learn_steps, learn_lr, learn_batch_size, learn_t, learn_t_concentration, learn_method, learn_patience,
              learn_tolerance, learn_seconds, learn_max_condition, learn_backtrack_margin, learn_eval_batches,
              learn_holdout, learn_mixup, learn_rate_trial, learn_synthetic_examples):
    """The :class:`symgraph.learn.LearnOptions` of :func:`_learn_options` (a command takes them as ``**learning``)."""
    from .learn import LearnOptions

    return LearnOptions(steps=learn_steps, lr=learn_lr, batch_size=learn_batch_size, t=learn_t,
                        t_concentration=learn_t_concentration, method=learn_method,
                        patience=learn_patience, tolerance=learn_tolerance, seconds=learn_seconds,
                        max_condition=learn_max_condition, backtrack_margin=learn_backtrack_margin,
                        eval_batches=learn_eval_batches, holdout=learn_holdout, mixup=learn_mixup,
                        rate_trial=learn_rate_trial, synthetic_examples=learn_synthetic_examples)


def _descent(no_rescale, refine_rounds, tolerance, matching_start, judge_starts, synthetic_activations,
             short_learning, general_linear, balance, residual) -> dict:
    """The :func:`symgraph.align` keywords of :func:`_descent_options`."""
    return dict(rescale=not no_rescale, refine_rounds=refine_rounds, tolerance=tolerance,
                matching_start=matching_start, judge_starts=judge_starts,
                synthetic_activations=synthetic_activations, short_learning=short_learning,
                general_linear=general_linear, balance=balance,
                residual=residual)


@cli.command(help="Align SOURCE to ANCHOR within SOURCE's symmetry groups; write the result as a Hugging Face folder "
                  "that computes exactly what SOURCE computes (checked before anything is written).")
@click.argument("source")
@click.argument("anchor")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--mode", type=click.Choice(["full", "paper", "permutation"]), default="full", show_default=True,
              help="full: every group, best solver each; paper: the paper's algorithm; permutation: weight matching.")
@click.option("--only", type=click.Choice(["attention", "ffn", "residual"]), help="Ablation: one family of groups.")
@click.option("--layers", help="Only groups of these layers, e.g. 0-5 (the paper's layer-subset study).")
@_descent_options
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write per-group and total distances and the time per stage as JSON.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists (only once the new copy is complete).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--fold/--no-fold", default=False, show_default=True,
              help=f"{_FOLD_HELP} OUT is then folded too: compare or merge it with the folded ANCHOR.")
@_UNTIE_OPTION
@click.option("--data", "data_spec", help="Match groups on activations of this data (its train split; e.g. digits, "
                                          "pydoc-chars, FILE.txt, FILE.jsonl, FILE.parquet, FILE.npz, MEDIA_DIR) "
                                          "instead of on weights; with --learn, also what learned matching learns on.")
@_data_options
@_learn_options
@click.option("--learn-data", "learn_data_spec",
              help="With --learn: learn on this data (its train split) instead of --data; without --data, learning "
                   "then starts from the weight-matched alignment. 'synthetic': no data, inputs the models make "
                   "(a causal LM's samples) or their config describes, labelled by both models together.")
@_FREE_OUTPUTS
@_compute_options("the alignment computes its costs and applies its moves",
                  "float64 for float64 models, float32 otherwise; OUT keeps SOURCE's")
@click.option("--stream", is_flag=True,
              help="Block by block, reading and writing as it goes (7B models and up): safetensors inputs, sharded "
                   "output, verified in float64 block by block. The residual stream is solved once from the "
                   "embeddings and head; descent stays inside each block (see symgraph.streamed_align).")
@click.option("--shard-size", default="5GB", show_default=True,
              help="With --stream: the largest output shard (e.g. 2GB, 500MB).")
def align(source, anchor, output, mode, only, layers, no_rescale, refine_rounds, tolerance, matching_start,
          judge_starts, synthetic_activations, short_learning, general_linear, balance, residual, stats_path,
          overwrite, quiet, fold,
          untie, data_spec, data_batches, data_batch_size, data_groups, learn, learn_data_spec, free_outputs, device,
          dtype,
          stream, shard_size,
          **learning):
    from .alignment import compute_device
    from .api import align as run_align, load
    from .connectivity import alignment_summary
    from .io import save_model

    compute_device(device)  # before the models are read
    _check_distinct_outputs(**{"-o": output, "--stats": stats_path})
    _check_data_not_written({"-o": output, "--stats": stats_path}, [data_spec, learn_data_spec])
    _check_model_output(output, overwrite, [source, anchor], written_from=[source])
    _check_file_output(stats_path, [source, anchor])
    span = _parse_layers(layers)
    if untie and not fold:
        raise click.UsageError("--untie serves only a fold: pass --fold with it (align does not fold by default).")
    if stream:
        given = [flag for flag, on in (("--only", only), ("--no-matching-start", not matching_start),
                                       ("--general-linear", general_linear), ("--data", data_spec),
                                       ("--residual-group", residual != "auto"),
                                       ("--learn", learn), ("--learn-data", learn_data_spec),
                                       ("--free-outputs", free_outputs)) if on]
        if given:
            raise click.UsageError(f"--stream cannot be combined with {', '.join(given)} yet. Leave those out, or "
                                   "align in memory (without --stream).")
        _align_streamed(source, anchor, output, mode, span, no_rescale, refine_rounds, tolerance, fold, untie,
                        _parse_size(shard_size), overwrite, stats_path, quiet, device, dtype)
        return
    clock = time.perf_counter()
    subject, anchor_subject = load(source, free_outputs=free_outputs), load(anchor, free_outputs=free_outputs)
    loading = time.perf_counter() - clock
    result = run_align(subject, anchor_subject, mode=mode, only=only, layers=span, progress=not quiet,
                       fold=fold, untie=untie, data=data_spec, data_batches=data_batches,
                       data_batch_size=data_batch_size,
                       data_groups=data_groups, device=device, dtype=dtype,
                       learn=learn and _learning(**learning),
                       learn_data=learn_data_spec,
                       **_descent(no_rescale, refine_rounds, tolerance, matching_start, judge_starts,
                                  synthetic_activations, short_learning, general_linear, balance, residual))
    result.timings["load"] = loading
    clock = time.perf_counter()
    with _side_file(stats_path, lambda: json.dumps(result.to_json(), indent=1)):
        save_model(result.state, output, config=result.config or subject.config, like=subject.path,
                   overwrite=overwrite)
        result.timings["write"] = time.perf_counter() - clock
    untied = f", tied weights untied: {', '.join(result.untied)}" if result.untied else ""
    click.echo(f"wrote {output}: distance to anchor {result.distance_before:.4g} -> {result.distance_after:.4g} "
               f"(mode {mode}{', folded' if result.folded else ''}{untied}"
               f"{', residual stream by permutations' if result.residual == 'permutation' else ''}"
               f"{_cost_summary(alignment_summary(result))}"
               f"{_learned_note(result.learned)}, "
               f"{len(result.group_distances())} groups; "
               f"{_equality(result.verified_error, result.verified_tolerance, result.state, result.verified_rounded)}"
               f"{_free_note(subject)})")


def _align_streamed(source, anchor, output, mode, span, no_rescale, refine_rounds, tolerance, fold, untie,
                    shard_bytes, overwrite, stats_path, quiet, device, dtype) -> None:
    from .progress import StageBars
    from .streamed_align import align_streamed

    done = {}
    with _side_file(stats_path, lambda: json.dumps(done["result"].to_json() if done else {}, indent=1)), \
            StageBars(enabled=not quiet) as bar:
        done["result"] = result = align_streamed(source, anchor, output, mode=mode, rescale=not no_rescale,
                                                 layers=span, rounds=refine_rounds, tolerance=tolerance,
                                                 fold=fold, untie=untie, shard_bytes=shard_bytes,
                                                 overwrite=overwrite, progress=bar.update, device=device,
                                                 dtype=dtype)
    groups = len({s.group for s in result.stats})
    untied = f", tied weights untied: {', '.join(result.untied)}" if result.untied else ""
    click.echo(f"wrote {output}: distance to anchor {result.distance_before:.4g} -> {result.distance_after:.4g} "
               f"(mode {mode}{', folded' if fold else ''}{untied}, streamed block by block, {groups} groups"
               f"{f', {len(result.unsolved)} spanning groups left at the identity' if result.unsolved else ''}; "
               f"outputs checked against the source in float64 block by block (a whole float64 copy is not made): "
               f"relative error {result.verified_error:.1e}, tolerance {result.verified_tolerance:.0e}"
               f"{_rounded_note(result.verified_rounded)})")


def _learned_note(learned: dict | None) -> str:
    """What learned matching did, for the one-line summary."""
    if learned is None:
        return ""
    verdict = "kept" if learned["kept"] else "not kept: no better than the start"
    backtracks = len(learned["backtracks"])
    lowered = f", learning rate lowered {backtracks} time{'s' * (backtracks != 1)}" if backtracks else ""
    stopped = f", stopped early ({learned['stopped']})" if learned["stopped"] else ""
    trial = learned.get("rate_trial")
    tried = ""
    if trial:  # the first backtrack's trial of the lower rate from the start
        full, lower = trial["rates"]
        whose = "its" if trial["kept"] == lower else f"rate {full:.2g}'s"
        tried = (f", the first backtrack tried rate {lower:.2g} from the start and went on from {whose} point "
                 f"(checked {trial['checked'][1]:.4g} against {trial['checked'][0]:.4g})")
    projected = learned["condition_projections"]
    bounded = (f", general linear maps projected back to condition {learned['condition_bound']:g} {projected} "
               f"time{'s' * (projected != 1)}" if projected else "")
    points = ", ".join(f"{t:g}" for t in learned["checked_t"])
    distilled = f" plus {learned['mixup']:g} x distillation on mixed inputs" if learned.get("mixup") else ""
    return (f", learned over {learned['steps']} steps: path loss (t = {points}){distilled} "
            f"{learned['start_path_loss']:.4g} -> {learned['end_path_loss']:.4g} on training batches, {verdict}"
            f"{tried}{lowered}{bounded}{stopped}")


def _cost_summary(summary: dict) -> str:
    """How many groups took which cost, and the candidates' path losses the data (or, without it, the synthetic
    examples) chose between, then whether full mode's short learning was kept; ``summary`` is
    :func:`symgraph.connectivity.alignment_summary`'s."""
    counts, losses = summary.get("costs"), summary.get("path_losses", {})
    # full mode's own, not --learn's: each tuned alignment judged against the alignment before it
    learned = {name: loss for name, loss in losses.items() if name.startswith("learned")}
    short_learning = bool(learned)
    text = ""
    if counts:
        costs = {name: loss for name, loss in losses.items() if name in ("activations", "weights")}
        # a kept short learning started from the weights' alignment, whatever the costs' comparison chose
        why = ("the start of the short learning" if short_learning and summary.get("learned") else
               "kept for its lower path loss")
        chosen = (f" ({why}; path loss on {summary.get('judged_on') or 'the data'}, t = 1/4, 1/2, 3/4: "
                  f"{', '.join(f'{name} {loss:.4g}' for name, loss in costs.items())})" if costs else "")
        text = "; costs: " + ", ".join(f"{n} group{'s' * (n != 1)} from {c}" for c, n in counts.items()) + chosen
    if short_learning:  # the record is there only when a learned alignment was kept
        kept = summary.get("learned")
        verdict = f"kept (learned on {kept.get('data', 'its data')})" if kept else "not kept"
        text += (f"; tuned by a short learning, {verdict} (path loss on {summary.get('judged_on')}: "
                 f"{losses['aligned']:.4g} before, "
                 f"{', '.join(f'{loss:.4g} {name}' for name, loss in learned.items())})")
    return text


def _equality(error: float, tolerance: float, state, rounded=None) -> str:
    """What the check before writing compared, and how closely: weights stored in fp16/bf16 (or float32) are
    rounded once from float64 arithmetic, so outputs match the source's to that precision, not bit for bit.
    ``rounded`` (a :class:`~symgraph.verify.RoundedExact`): how a bf16/fp16 result past the tolerance passed."""
    dtypes = "/".join(sorted({str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}))
    return (f"outputs checked on the example inputs, both models run in float64: relative error {error:.1e} to the "
            f"source's, tolerance {tolerance:.0e} for {dtypes} weights rounded once{_rounded_note(rounded)}")


def _rounded_note(rounded) -> str:
    """How a bf16/fp16 result past its fixed tolerance passed (a :class:`~symgraph.verify.RoundedExact`), if it did."""
    return f"; past the fixed tolerance, but {rounded.describe()}" if rounded is not None else ""


def _free_note(subject) -> str:
    """How free outputs were compared (``--free-outputs``), for the one-line summaries."""
    free = subject.report.free_outputs if subject.free_outputs else ()
    if not free:
        return ""
    return (f"; free outputs {', '.join(f.name for f in free)} compared after undoing the residual stream's "
            f"element, so the written model returns them in a moved basis")


def _parse_layers(text):
    if text is None:
        return None
    try:
        lo, _, hi = text.partition("-")
        span = int(lo), int(hi or lo)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a layer range like 0-5 or 3", param_hint="--layers") from None
    if span[0] > span[1]:
        raise click.BadParameter(f"{text!r} is reversed: give FIRST-LAST with FIRST <= LAST", param_hint="--layers")
    return span


@cli.command(help="Fuzz every symmetry group of MODEL for invariance (float64); exit 1 on any violation.")
@click.argument("model")
@click.option("--samples", default=20, show_default=True, type=int, help="Hypothesis examples per group.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write results.")
@_FREE_OUTPUTS
def fuzz(model, samples, seed, json_path, free_outputs):
    from .fuzz import fuzz as run_fuzz

    if samples < 1:
        raise click.BadParameter("must be at least 1", param_hint="--samples")
    _check_file_output(json_path, [model])
    result = run_fuzz(model, samples=samples, seed=seed, progress=_print_verdict, free_outputs=free_outputs)
    if json_path is not None:
        _emit_text(json.dumps(result.to_json(), indent=1), json_path)
    status = "all groups invariant" if result.ok else f"{len(result.failures)} group(s) VIOLATE invariance"
    click.echo(f"{result.model}: {status} (tolerance {result.tolerance:.0e}; all groups together: "
               f"{result.joint_error:.2e}; input shapes: {' | '.join(result.shapes)})")
    if not result.ok:
        sys.exit(1)


@cli.command(help="Do MODEL_A and MODEL_B (safetensors folders of one architecture) compute the same function? "
                  "Both run in float64 on example inputs built from the config, block by block with each block's "
                  "weights read just before it runs (a 7B model needs a few GB, not a 56 GB float64 copy); exit 1 "
                  "when the relative difference of their outputs exceeds the tolerance of the precision involved.")
@click.argument("model_a")
@click.argument("model_b")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write the result.")
def compare(model_a, model_b, json_path):
    from .alignment import config_differences
    from .io import load_model
    from .streamed_verify import verify_streamed

    _check_file_output(json_path, [model_a, model_b])
    outcome = verify_streamed(model_a, model_b, untied=_untied_between(model_a, model_b))
    result = {"model_a": model_a, "model_b": model_b, "relative_error": outcome.relative_error,
              "tolerance": outcome.tolerance, "same_function": outcome.ok, "float64": "block by block"}
    if json_path is not None:
        _emit_text(json.dumps(result, indent=1), json_path)
    verdict = "the same function" if outcome.ok else "DIFFERENT functions"
    configs = config_differences(*(load_model(Path(m), config_only=True).config for m in (model_a, model_b)))
    click.echo(f"{model_a} and {model_b}: {verdict} (relative error {outcome.relative_error:.2e}, tolerance "
               f"{outcome.tolerance:.0e}; float64, block by block)"
               + (f"; their configurations differ: {configs}" if configs else ""))
    if not outcome.ok:
        sys.exit(1)


def _untied_between(model_a, model_b) -> dict[str, str]:
    """The names ``model_b`` stores that ``model_a`` ties to a tensor it stores under another name (an LM head that
    ``fold`` untied): name -> that stored name, for :func:`symgraph.streamed_verify.verify_streamed`."""
    from .io import load_model
    from .lazy_state import LazyState
    from .module_state import parameter_names

    stored_a, stored_b = set(LazyState(model_a)), set(LazyState(model_b))
    extra = stored_b - stored_a
    if not extra:
        return {}
    untied = {}
    for names in parameter_names(load_model(Path(model_a), config_only=True).model).values():
        kept = sorted(names & stored_a)
        untied.update({n: kept[0] for n in names & extra if kept})
    return untied


@cli.command(help="Run the main job on the shipped model pairs (two trainings of one model each): symmetry report, "
                  "alignment in every mode, merges, loss barriers; print a summary and write everything to OUT.")
@click.option("--out", "out_dir", default=Path("out/demo"), show_default=True,
              type=click.Path(path_type=Path), help="Folder for every file (created if missing).")
@click.option("--quick", is_flag=True, help="The LLaMA pair only, on a few examples (a smoke run, one to two minutes).")
@click.option("--overwrite", is_flag=True, help="Replace the demo's files in an OUT that holds files already.")
def demo(out_dir, quick, overwrite):
    from .demo import run_demo

    run_demo(out_dir, quick=quick, overwrite=overwrite, echo=click.echo)


@cli.command(help="Merge two or more MODELs of one architecture (aligned into one frame first); write the result "
                   "as a Hugging Face folder.\n\nMethods: simple (weighted average), fisher (diagonal Fisher-"
                   "weighted, needs --data), regmean (per linear layer, from input Gram matrices, needs --data). "
                   "Statistics are taken on the aligned models.")
@click.argument("models", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--method", type=click.Choice(["simple", "fisher", "regmean"]), default="simple", show_default=True)
@click.option("--align", "align_mode", type=click.Choice(["full", "paper", "permutation", "none", "full+data"]),
              default="full", show_default=True,
              help="Groups used to bring the models into one frame before merging; full+data: full mode with "
                   "costs from activations on --data (each model after the first aligned to it).")
@click.option("--data", "data_specs", multiple=True,
              help="Statistics data for fisher/regmean (e.g. digits, pydoc-chars, FILE.txt, FILE.jsonl, "
                   "FILE.parquet, FILE.npz, MEDIA_DIR): once for every model, or once per model in the models' order.")
@click.option("--split", default="train", show_default=True, help="Split of a shipped dataset.")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--limit", type=click.IntRange(min=1), help="Use only the first N examples.")
@click.option("--weights", help="One weight per model, comma-separated (e.g. 0.7,0.3); normalised to sum to 1.")
@click.option("--head-from", type=int, help="Copy the head from MODEL number I (1 = the first) instead of merging.")
@click.option("--head", "head_patterns", multiple=True,
              help="fnmatch pattern naming head parameters (e.g. 'classifier.*'); needed for non-HF models.")
@click.option("--alpha", default=0.9, show_default=True, type=click.FloatRange(0.0, 1.0),
              help="RegMean: scale of off-diagonal Gram entries.")
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(min=0),
              help="Most consensus rounds (three or more models, or the common frame).")
@click.option("--frame", type=click.Choice(["best", "reference", "common"]), default="best", show_default=True,
              help="Frame of the merge: onto the reference model; a common frame (every model aligned to their "
                   "mean); or best: every model's frame and the common one tried, the merge with the lowest loss "
                   "on --data kept (without data: on 64 synthetic examples labelled by the models together, or "
                   "where none can be made, the aligned models closest to their mean). With --data, each frame is "
                   "also tried with its first alignments by weights alone (see --judge-starts), and each model's "
                   "frame on activations of the data (as --align full+data).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write a summary.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists (only once the merge is complete).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--stream", is_flag=True,
              help="Read and write one tensor at a time (7B models and up): safetensors inputs, sharded output. "
                   "Only with --method simple --align none; nothing is folded.")
@click.option("--shard-size", default="5GB", show_default=True,
              help="With --stream: the largest output shard (e.g. 2GB, 500MB).")
@_FOLD_OPTION
@_UNTIE_OPTION
@_learn_options
@_FREE_OUTPUTS
@_judge_options
@click.option("--workers", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where the alignment jobs (one per model per round) run: this process, or a Ray cluster "
                   "(RAY_ADDRESS or a running `ray start --head`; else a local one for this run). Needs the "
                   "symgraph[ray] extra. Same result either way.")
@_compute_options("the alignment's costs, SVDs and moves and RegMean's solves run", "float64")
def merge(models, output, method, align_mode, data_specs, split, batch_size, limit, weights, head_from,
          head_patterns, alpha, rounds, frame, json_path, overwrite, no_progress, stream, shard_size, fold, untie,
          learn, free_outputs, workers, device, dtype, judge_starts, synthetic_activations, short_learning,
          **learning):
    from .alignment import compute_device
    from .merging import merge as run_merge

    compute_device(device)  # before the models are read
    if method != "regmean" and _given("alpha"):
        raise click.UsageError(f"--alpha is RegMean's shrinkage; --method {method} has none, so it would be ignored. "
                               "Leave --alpha out, or use --method regmean.")
    _check_distinct_outputs(**{"-o": output, "--json": json_path})
    _check_data_not_written({"-o": output, "--json": json_path}, [*data_specs, learning.get("learn_data_spec")])
    # --stream averages every stored tensor, those the model does not load too
    _check_model_output(output, overwrite, models, written_from=() if stream else models)
    _check_file_output(json_path, models)
    if stream:
        _check_streamed_merge(method, align_mode, data_specs, head_from, head_patterns, fold, untie, learn)
        _merge_streamed(models, output, weights, _parse_size(shard_size), overwrite, json_path)
        return
    if head_from is not None and not 1 <= head_from <= len(models):
        raise click.BadParameter(f"{head_from} is not a model number (1 to {len(models)})", param_hint="--head-from")
    data = None if not data_specs else data_specs[0] if len(data_specs) == 1 else list(data_specs)
    result = run_merge(list(models), method=method, align=align_mode, data=data, weights=_parse_weights(weights),
                       head_from=None if head_from is None else head_from - 1, head=head_patterns or None,
                       alpha=alpha, rounds=rounds, batch_size=batch_size, limit=limit, split=split,
                       fold=fold, untie=untie, progress=not no_progress, frame=frame, free_outputs=free_outputs,
                       workers=workers,
                       learn=learn and _learning(**learning), device=device, dtype=dtype,
                       judge_starts=judge_starts, synthetic_activations=synthetic_activations,
                       short_learning=short_learning)
    with _side_file(json_path, lambda: json.dumps(result.to_json(), indent=1)):
        result.save(output, overwrite=overwrite)
    distances = ", ".join(f"{d:.3g}" for d in result.distances)
    folded = ", norms folded first" if any(n.endswith("(folded)") for n in result.models) else ""
    folded += ", learned matching" if learn else ""
    where = "" if align_mode == "none" else f"; frame: {result.frame} ({result.frame_note})"
    click.echo(f"wrote {output}: {method} merge of {len(models)} models (align {align_mode}{folded}); distance of "
               f"each model to the merge: {distances}{where}")
    if result.fold_note:
        click.echo(f"  {result.fold_note}")
    for i, learned in enumerate(result.learned):
        if learned is not None:  # the reference does not move
            click.echo(f"model {i + 1} ({result.models[i]}){_learned_note(learned)}")
    for i, summary in enumerate(result.alignments):
        if summary and (kept := _cost_summary(summary)):  # the reference does not move
            click.echo(f"model {i + 1} ({result.models[i]}), first aligned onto the reference{kept}")


@cli.command(help="Loss barrier along the linear path from MODEL_A to MODEL_B, with MODEL_B aligned to MODEL_A in "
                  "each mode (none, permutation, paper, full); plot it (loss, and accuracy when the data has "
                  "labels) and optionally write the numbers as JSON.")
@click.argument("model_a")
@click.argument("model_b")
@click.option("--data", required=True,
              help="Evaluation data (e.g. digits, pydoc-chars, FILE.txt, FILE.jsonl, FILE.parquet, FILE.npz, "
                   "MEDIA_DIR).")
@click.option("--split", default="test", show_default=True, help="Split of a shipped dataset.")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--limit", type=click.IntRange(min=1), help="Use only the first N examples.")
@click.option("--steps", default=21, show_default=True, type=click.IntRange(min=3), help="Points on the path.")
@click.option("--align", "aligns", default="none,permutation,paper,full", show_default=True,
              help="Comma-separated alignment modes to compare; full+data: full mode with activation costs; add "
                   "+learn to a mode (e.g. full+learn) for learned matching on the training split of --data.")
@_descent_options
@click.option("--align-data", help="Data for full+data's activation costs (default: --data, train split).")
@click.option("--learn-data", "learn_data_spec",
              help="What the learned modes (e.g. full+learn) learn on (its train split; default --data); "
                   "'synthetic': no data, inputs the models make or their config describes, labelled by both.")
@_data_options
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Plot file (.png, .pdf, .svg, ...); replaced atomically.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write the numbers.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@_FOLD_OPTION
@_UNTIE_OPTION
@functools.partial(_learn_options, flag=False)
@_compute_options("every alignment computes its costs and applies its moves",
                  "float64 for float64 models, float32 otherwise")
def barrier(model_a, model_b, data, split, batch_size, limit, steps, aligns, no_rescale, refine_rounds, tolerance,
            matching_start, judge_starts, synthetic_activations, short_learning, general_linear, balance, residual,
            align_data,
            learn_data_spec, data_batches, data_batch_size, data_groups, output, json_path, no_progress, fold, untie,
            device, dtype, **learning):
    from .alignment import compute_device
    from .connectivity import barrier as run_barrier, check_plot_path

    compute_device(device)  # before the models are read
    check_plot_path(output)
    _check_distinct_outputs(**{"-o": output, "--json": json_path})
    _check_data_not_written({"-o": output, "--json": json_path}, [data, align_data, learn_data_spec])
    _check_file_output(output, [model_a, model_b])
    _check_file_output(json_path, [model_a, model_b])
    modes = [m.strip() for m in aligns.split(",") if m.strip()]
    result = run_barrier(model_a, model_b, data, steps=steps, aligns=modes, batch_size=batch_size, limit=limit,
                         split=split, progress=not no_progress, fold=fold, untie=untie, device=device, dtype=dtype,
                         learn=_learning(**learning), learn_data=learn_data_spec,
                         align_options={**_descent(no_rescale, refine_rounds, tolerance, matching_start, judge_starts,
                                                   synthetic_activations, short_learning, general_linear,
                                                   balance, residual),
                                        **({"align_data": align_data} if align_data else {}),
                                        **(dict(data_batches=data_batches, data_batch_size=data_batch_size,
                                                data_groups=data_groups) if "full+data" in aligns else {})})
    with _side_file(json_path, lambda: json.dumps(result.to_json(), indent=1)):
        result.plot(output)
    if any(n.endswith("(folded)") for n in result.models):
        click.echo("  both models were folded first (symgraph fold); --no-fold compares them as trained")
    if result.fold_note:
        click.echo(f"  {result.fold_note}")
    for mode, curve in result.curves.items():
        accuracy = "" if curve.accuracy_barrier is None else f", accuracy drop {curve.accuracy_barrier:.3g}"
        click.echo(f"  {mode:<12} loss barrier {curve.loss_barrier:.4g}{accuracy}, distance {curve.distance:.3g}"
                   f"{_learned_note(curve.alignment.get('learned'))}")
    click.echo(f"wrote {output}")


def _given(name: str) -> bool:
    """Whether the option ``name`` of the running command was set on the command line (not left at its default)."""
    return click.get_current_context().get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def _check_streamed_merge(method, align_mode, data_specs, head_from, head_patterns, fold, untie, learn) -> None:
    given = [f"--method {method}" if method != "simple" else "", f"--align {align_mode}" if align_mode != "none" else "",
             "--data" if data_specs else "", "--head-from" if head_from is not None else "",
             "--head" if head_patterns else "", "--fold" if fold else "", "--untie" if untie else "",
             "--learn" if learn else ""]
    given = [g for g in given if g]
    if given:
        raise click.UsageError(
            f"--stream averages the stored tensors one at a time, so it cannot be combined with {', '.join(given)}. "
            "Run it as `symgraph merge A B --stream --method simple --align none` (align the models beforehand for "
            "an aligned merge), or leave out --stream.")


def _merge_streamed(models, output, weights, shard_bytes, overwrite, json_path) -> None:
    from .merging import merge_streamed

    done = {}
    with _side_file(json_path, lambda: json.dumps(done["result"].to_json() if done else {}, indent=1)):
        done["result"] = result = merge_streamed(list(models), output, weights=_parse_weights(weights),
                                                 shard_bytes=shard_bytes, overwrite=overwrite)
    click.echo(f"wrote {output}: simple merge of {len(models)} models, streamed ({result.tensors} tensors, "
               f"{result.bytes_written / 1e9:.2f} GB in {result.seconds:.1f} s)")


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _parse_size(text: str) -> int:
    """A byte count written as transformers writes max_shard_size: 5GB, 500MB, 2GiB, or a number of bytes."""
    number = text.strip().upper().rstrip("BIKMG")
    unit = text.strip().upper()[len(number):]
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except (ValueError, KeyError):
        size = 0
    if size <= 0:
        raise click.BadParameter(f"{text!r} is not a size such as 5GB, 500MB or 2GiB", param_hint="--shard-size")
    return size


def _parse_weights(text):
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of numbers", param_hint="--weights") \
            from None


def _print_verdict(verdict) -> None:
    mark = "ok  " if verdict.ok else "FAIL"
    line = f"  {mark} {verdict.group_id}  ({verdict.kind}, {verdict.examples} examples, max error {verdict.max_error:.1e})"
    click.echo(line)
    if not verdict.ok:
        click.echo(f"       counterexample: {verdict.counterexample}")


def _emit_text(text: str, output: Path | None) -> None:
    if output is None:
        click.echo(text)
        return
    from .io import write_text_atomic

    write_text_atomic(output, text)
    click.echo(f"wrote {output}", err=True)


def _check_model_output(output: Path, overwrite: bool, inputs, *, written_from) -> None:
    """Before any work: the output folder is named, is no input, and exists only with --overwrite (leftovers of
    interrupted runs to it are cleaned up on the way); the inputs it is ``written_from`` (moved, or merged after
    loading) store no tensor the model does not load (:func:`symgraph.checkpoint.refuse_unloaded`; a streamed
    plain merge averages every stored tensor)."""
    from .checkpoint import refuse_unloaded_inputs
    from .files import prepare_output, refuse_overlap

    if not str(output).strip() or not output.name:
        raise OutputError(f"The output path {str(output)!r} names no folder.", hint="give a name, e.g. -o out/model.")
    refuse_overlap(output, inputs)
    prepare_output(output.absolute(), overwrite=overwrite, folder=True)
    refuse_unloaded_inputs(written_from)


def _check_distinct_outputs(**outputs: Path | None) -> None:
    """Two outputs of one command (``-o`` and ``--json``, say) may not be one path: the second written would
    replace the first, or fail once the first is in place."""
    import os

    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        key = os.path.realpath(path.expanduser())
        if key in seen:
            raise OutputError(f"{seen[key]} and {option} name the same path '{path}': one output would replace the "
                              "other.", hint=f"give {option} a path of its own.")
        seen[key] = option


def _check_data_not_written(outputs: dict[str, Path | None], specs) -> None:
    """No output (``-o``, ``--json``, ``--stats``) may be a data file given as ``--data`` (or ``--learn-data``,
    ``--align-data``), lie inside a data folder, or hold one: the run would replace what it reads. Specs that name
    no existing path (``digits``, ``synthetic``) are no files; a ``:split`` suffix is read off."""
    import os

    paths = []
    for spec in filter(None, specs):
        for candidate in (str(spec), str(spec).rpartition(":")[0]):
            if candidate and Path(candidate).expanduser().exists():
                paths.append((spec, Path(os.path.realpath(Path(candidate).expanduser()))))
                break
    for option, output in outputs.items():
        if output is None:
            continue
        out = Path(os.path.realpath(output.expanduser()))
        for spec, data in paths:
            if out == data or data in out.parents or out in data.parents:
                relation = "is" if out == data else "lies inside" if data in out.parents else "contains"
                raise OutputError(f"The output {option} '{output}' {relation} the data '{spec}': writing it would "
                                  "replace data the run reads.", hint=f"give {option} a path of its own.")


def _check_file_output(output: Path | None, inputs) -> None:
    """A report, plot or JSON output must not overwrite an input's file."""
    from .files import refuse_overlap

    if output is None:
        return
    if not output.absolute().parent.is_dir():  # say so before the work, not after it
        raise OutputError(f"Cannot write '{output}': folder '{output.parent}' does not exist"
                          f"{' (it is a file)' if output.parent.exists() else ''}.",
                          hint="create the folder first, or choose another output path.")
    refuse_overlap(output, inputs, folder=False)


@contextlib.contextmanager
def _side_file(path: Path | None, text):
    """Stage the side file ``path`` (``--stats``, ``--json``) with ``text()`` before the main output is written and
    put it in place after, with ``text()`` as it reads then (timings of the write included): a side file that
    cannot be written stops the run before anything is in place."""
    if path is None:
        yield
        return
    from .files import StagedText

    staged = StagedText(path, lambda tmp: tmp.write_text(text()))
    try:
        yield
    except BaseException:
        staged.discard()
        raise
    staged.commit(text())
    click.echo(f"wrote {path}", err=True)


@contextlib.contextmanager
def _signals_unwind():
    """Turn SIGTERM and SIGHUP into an exit that unwinds the stack, so that the temporary files of an interrupted
    write are removed on the way out (SIGINT already raises KeyboardInterrupt). Main thread only."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    wanted = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    previous = {sig: signal.signal(sig, unwind) for sig in wanted}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv=None) -> None:
    """Console entry point: symgraph errors become a one-paragraph message and a non-zero exit."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    start = time.perf_counter()
    try:
        with _signals_unwind():
            cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, EOFError):  # click turns every EOFError into Abort; no command reads stdin
            _internal_error(exc.__cause__, debug)
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SymgraphError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except Exception as exc:  # a bug, not bad input: say so, and how to see more
        _internal_error(exc, debug)
    del start


def _internal_error(exc: BaseException, debug: bool) -> None:
    if debug:
        raise exc
    click.echo(f"internal error: {type(exc).__name__}: {exc}\n  This is a symgraph bug; rerun as `symgraph --debug "
               f"COMMAND ...` (the flag goes before the command) for the traceback, and report it.", err=True)
    sys.exit(3)
