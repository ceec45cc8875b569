"""Render HTML symmetry reports and look at them as a browser does: headless Chromium screenshots, page widths.

    python examples/screenshot_reports.py --out /tmp/shots                      # shipped models + zoo t5, clip
    python examples/screenshot_reports.py symgraph/data/models/llama-chars-a zoo:qwen3 --out /tmp/shots

Each MODEL is a folder (or anything ``symgraph.load`` accepts) or ``zoo:FAMILY`` (a tiny model from
``symgraph.zoo``). For each, writes ``NAME.html`` and ``NAME.png`` (a ``--width`` x ``--height`` screenshot) into
``--out`` (a new folder) and prints one JSON line: the files, the page's scroll width in the browser, and whether
the page fits the window without horizontal scrolling. Needs ``chromium`` (Debian: ``apt-get install chromium``).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import symgraph
from symgraph import zoo
from symgraph.render import to_html

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = [*(str(p) for p in sorted((ROOT / "symgraph" / "data" / "models").iterdir()) if p.is_dir()),
                  "zoo:t5", "zoo:clip"]
# a measuring script added to a copy of the page only: the report itself stays script-free
_MEASURE = "<script>document.title = 'scrollWidth=' + document.documentElement.scrollWidth;</script>"


def report_of(model: str) -> symgraph.Report:
    if model.startswith("zoo:"):
        family = model[4:]
        built = zoo.build(family)
        args, kwargs = zoo.example_inputs_for(family, built)
        return symgraph.analyze(built, inputs=args or kwargs)
    return symgraph.analyze(model)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    raise SystemExit("No chromium on PATH: install it (Debian: apt-get install chromium).")


def _browser(*args: str) -> str:
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def scroll_width(page: Path, width: int, height: int) -> int:
    """The page's ``scrollWidth`` in a ``width`` x ``height`` window (more than ``width``: it scrolls sideways)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.html"
        probe.write_text(page.read_text().replace("</body>", _MEASURE + "</body>"))
        dom = _browser(f"--window-size={width},{height}", "--dump-dom", probe.as_uri())
    return int(re.search(r"scrollWidth=(\d+)", dom).group(1))


def shoot(model: str, out: Path, width: int, height: int) -> dict:
    name = Path(model[4:] if model.startswith("zoo:") else model).name
    page, png = out / f"{name}.html", out / f"{name}.png"
    page.write_text(to_html(report_of(model)))
    _browser(f"--window-size={width},{height}", f"--screenshot={png}", page.as_uri())
    scrolled = scroll_width(page, width, height)
    return {"model": model, "html": str(page), "png": str(png), "scroll_width": scrolled, "fits": scrolled <= width}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS, help="folders or zoo:FAMILY")
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the pages and screenshots")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} already exists: choose a new folder.")
    chromium()
    args.out.mkdir(parents=True)
    results = [shoot(model, args.out, args.width, args.height) for model in args.models]
    for result in results:
        print(json.dumps(result), flush=True)
    return 0 if all(r["fits"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
