"""The ``symgraph`` command line. Commands only parse, validate and call the library (:mod:`symgraph.api`)."""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import click

from .errors import OutputError, SymgraphError

MODEL_HELP = ("MODEL is a Hugging Face folder (config.json + weights), a config.json (with --config-only), or a "
              "'package.module:factory' / 'file.py:factory' returning a module or (module, args[, kwargs]).")


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
def report(model, config_only, fmt, output):
    from .api import load
    from .render import render

    text = render(load(model, config_only=config_only).report, fmt)
    _emit_text(text, output)


@cli.command(help="Write a functionally equivalent, randomly reparametrised copy of MODEL as a Hugging Face folder.")
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists (only once the new copy is complete).")
def transform(model, output, seed, overwrite):
    from .api import load, transform as transform_state
    from .io import save_model

    subject = load(model)
    _refuse_existing(output, overwrite)
    state = transform_state(subject, seed=seed)
    save_model(state, output, config=subject.config, like=subject.path, overwrite=overwrite)
    click.echo(f"wrote {output} ({len(subject.report.groups)} groups applied, seed {seed}; outputs checked equal "
               f"in float64)")


@cli.command(help="Align SOURCE to ANCHOR within SOURCE's symmetry groups; write the result as a Hugging Face folder.")
@click.argument("source")
@click.argument("anchor")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--mode", type=click.Choice(["full", "paper", "permutation"]), default="full", show_default=True)
@click.option("--only", type=click.Choice(["attention", "ffn", "residual"]), help="Ablation: one family of groups.")
@click.option("--no-rescale", is_flag=True, help="Ablation: no QK / rotary rescaling.")
@click.option("--layers", help="Only groups of these layers, e.g. 0-5 (the paper's layer-subset study).")
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write per-group and total distances and timings as JSON.")
@click.option("--overwrite", is_flag=True)
def align(source, anchor, output, mode, only, no_rescale, layers, stats_path, overwrite):
    from .api import align as run_align, load
    from .io import save_model

    _refuse_existing(output, overwrite)
    span = _parse_layers(layers)
    result = run_align(source, anchor, mode=mode, only=only, rescale=not no_rescale, layers=span)
    subject = load(source)
    save_model(result.state, output, config=subject.config, like=subject.path, overwrite=overwrite)
    if stats_path is not None:
        _emit_text(json.dumps(result.to_json(), indent=1), stats_path)
    click.echo(f"wrote {output}: distance to anchor {result.distance_before:.4g} -> {result.distance_after:.4g} "
               f"({len(result.stats)} group solves, mode {mode}; outputs checked equal to the source)")


def _parse_layers(text):
    if text is None:
        return None
    try:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a layer range like 0-5 or 3", param_hint="--layers") from None


@cli.command(help="Fuzz every symmetry group of MODEL for invariance (float64); exit 1 on any violation.")
@click.argument("model")
@click.option("--samples", default=20, show_default=True, type=int, help="Hypothesis examples per group.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write results.")
def fuzz(model, samples, seed, json_path):
    from .fuzz import fuzz as run_fuzz

    if samples < 1:
        raise click.BadParameter("must be at least 1", param_hint="--samples")
    result = run_fuzz(model, samples=samples, seed=seed, progress=_print_verdict)
    if json_path is not None:
        _emit_text(json.dumps(result.to_json(), indent=1), json_path)
    status = "all groups invariant" if result.ok else f"{len(result.failures)} group(s) VIOLATE invariance"
    click.echo(f"{result.model}: {status} (tolerance {result.tolerance:.0e}; all groups together: "
               f"{result.joint_error:.2e})")
    if not result.ok:
        sys.exit(1)


@cli.command(help="Run the main job on the embedded demo model pair: report, transform, fuzz.")
@click.option("--out", "out_dir", default=Path("out/demo"), show_default=True,
              type=click.Path(file_okay=False, path_type=Path))
@click.option("--samples", default=10, show_default=True, type=int)
def demo(out_dir, samples):
    from .demo import run_demo

    run_demo(out_dir, samples=samples, echo=click.echo)


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


def _refuse_existing(output: Path, overwrite: bool) -> None:
    if output.exists() and not overwrite:
        raise OutputError(f"{output} already exists.", hint="pass --overwrite, or choose another output folder.")


def main(argv=None) -> None:
    """Console entry point: symgraph errors become a one-paragraph message and a non-zero exit."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    start = time.perf_counter()
    try:
        cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SymgraphError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except Exception as exc:  # a bug, not bad input: say so, and how to see more
        if debug:
            raise
        click.echo(f"internal error: {type(exc).__name__}: {exc}\n  This is a symgraph bug; rerun with --debug "
                   f"for the traceback and report it.", err=True)
        sys.exit(3)
    del start
