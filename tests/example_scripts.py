"""The scripts under examples/ (not a package), imported by the tests that check them."""
from __future__ import annotations

import contextlib
import importlib
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
