"""Progress bars for long loops: tqdm on stderr, silent when stderr is not a terminal or when asked to be.

Examples
--------
>>> sum(progress_bar(range(3), desc="demo", enabled=False))
3
"""
from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm


def progress_bar(iterable: Iterable | None = None, *, desc: str, total: int | None = None,
                 enabled: bool = True) -> tqdm:
    """A tqdm bar that stays quiet in pipes, logs and tests (no tty), and when ``enabled`` is False."""
    shown = enabled and sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, disable=not shown, leave=False, file=sys.stderr,
                dynamic_ncols=True)
