"""Running the console entry point in-process, for the command-line tests of every module."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path
from typing import NamedTuple

from symgraph.cli import main


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def run(*args) -> Result:
    """``main`` turns errors into messages and exit codes; unpacks as ``code, stdout, stderr``."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code or 0
    return Result(code, out.getvalue(), err.getvalue())


def report_json(target) -> dict:
    """``symgraph report TARGET --format json`` (a factory ``file.py:function``), which must succeed, parsed."""
    res = run("report", target, "--format", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def assert_fuzzed(target, tmp_path: Path, samples: int = 3) -> None:
    """``symgraph fuzz TARGET --json``: exit 0 and every group invariant."""
    out = tmp_path / "fuzz.json"
    res = run("fuzz", target, "--samples", samples, "--json", out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(out.read_text())["ok"]


def tree_digest(folder: Path) -> str:
    """A hash of every file under ``folder`` (names and bytes): proof that nothing in it changed."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()
