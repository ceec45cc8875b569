"""The scripts under examples/ (not a package), imported by the tests that check them."""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@contextlib.contextmanager
def example_module(name: str):
    """The module ``examples/<name>.py``, with examples/ on ``sys.path`` only while it is in use (the scripts import
    each other by name)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def one_row(script: str, name: str, timeout: float = 120) -> dict:
    """The JSON row ``examples/<script>.py --one <name>`` prints, run in its own process on one thread; the run must
    exit 0 (its stderr's end is the failure message otherwise)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{script}.py"), "--one", name], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])
