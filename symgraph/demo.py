"""``symgraph demo``: the main job on the embedded model pair (symgraph/data/demo), end to end.

For each model of the pair: the symmetry report (JSON, Markdown, HTML), a randomly reparametrised copy checked
equal in float64, and an invariance fuzz of every group. Alignment and merging of the pair are added by the
alignment and fusion work (see the README's roadmap).
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from .errors import InvarianceError, OutputError


def demo_models() -> dict[str, Path]:
    """The embedded demo pair: name -> Hugging Face folder."""
    root = Path(str(resources.files("symgraph.data").joinpath("demo")))
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").exists()}


def run_demo(out_dir: Path, *, samples: int = 10, echo=print) -> dict:
    from .api import load, transform
    from .fuzz import fuzz
    from .io import save_model, write_text_atomic
    from .render import render

    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"Cannot create {out_dir}: {exc.strerror}.", hint="pass --out to a writable folder.") \
            from exc
    summary = {}
    for name, folder in demo_models().items():
        subject = load(folder)
        report = subject.report
        for fmt in ("json", "md", "html"):
            write_text_atomic(out_dir / f"{name}.report.{fmt}", render(report, fmt))
        state = transform(subject, seed=0)
        save_model(state, out_dir / f"{name}-transformed", config=subject.config, like=folder, overwrite=True)
        result = fuzz(subject, samples=samples)
        if not result.ok:
            raise InvarianceError(f"Fuzzing {name} found violations: "
                                  + "; ".join(v.counterexample for v in result.failures))
        kinds = report.summary()["by_motif_kind"]
        echo(f"{name}: {len(report.groups)} groups ({', '.join(f'{k} x{v}' for k, v in kinds.items())})")
        echo(f"  fuzz: every group invariant over {samples} hypothesis examples each "
             f"(max error {max(v.max_error for v in result.verdicts):.1e}, tolerance {result.tolerance:.0e})")
        summary[name] = {"groups": len(report.groups), "fuzz_ok": result.ok}
    echo(f"reports, HTML pages and reparametrised copies are in {out_dir}/")
    return summary
