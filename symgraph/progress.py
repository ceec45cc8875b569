"""Progress bars for long loops: tqdm on stderr, silent when stderr is not a terminal or when asked to be.

Examples
--------
>>> sum(progress_bar(range(3), desc="demo", enabled=False))
3
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from tqdm import tqdm


def progress_bar(iterable: Iterable | None = None, *, desc: str, total: int | None = None,
                 enabled: bool = True) -> tqdm:
    """A tqdm bar that stays quiet in pipes, logs and tests (no tty), and when ``enabled`` is False."""
    shown = enabled and sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, disable=not shown, leave=False, file=sys.stderr,
                dynamic_ncols=True)


class StageBars:
    """A bar per alignment stage, fed by the ``progress(stage, group, done, total)`` callback alignment calls
    (:func:`progress_bar`: on stderr, only on a terminal); a context manager that closes the last bar."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bar, self.stage = None, None

    def update(self, stage, group, done, total) -> None:
        if stage != self.stage:
            self.close()
            self.bar, self.stage = progress_bar(desc=stage, total=total, enabled=self.enabled), stage
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def stage_callback(progress, bars: StageBars) -> Callable | None:
    """What alignment calls after each solve, from what a caller passed as ``progress``: a callback of
    ``(stage, group, done, total)`` as is, True for ``bars`` (shown only on a terminal), None or False for
    nothing; anything else is refused with a TypeError that says what is accepted."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return bars.update
    if callable(progress):
        return progress
    raise TypeError(f"progress must be True (bars on a terminal), False or None (no bars), or a callback "
                    f"progress(stage, group, done, total), not {progress!r}.")
