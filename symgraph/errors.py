"""One root exception with a few subclasses, each carrying what the user must change.

Every message is a short paragraph: what is wrong, where (file, graph node, user source line), and what to try.
The CLI prints ``str(error)`` and exits non-zero; it never shows a traceback for these.
"""
from __future__ import annotations


class SymgraphError(Exception):
    """Root of every error symgraph raises on purpose."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  What to try: {hint}")


class ModelLoadError(SymgraphError):
    """A MODEL argument could not be turned into a model: missing/corrupt files, unknown model_type, bad factory."""


class CaptureError(SymgraphError):
    """torch.export could not trace the model."""


class SpecError(SymgraphError):
    """A file under specs/ is malformed or names an unknown rule."""


class AnalysisError(SymgraphError):
    """The graph contains something the analysis cannot reason about safely."""


class InvarianceError(SymgraphError):
    """A transformation that should preserve the model's function did not."""

    exit_code = 1


class UnverifiableError(SymgraphError):
    """The model's function cannot be checked in float64 (it does not run there, or gives no finite output), so no
    transformation of it can be verified. Not a violation: exit status 2, like other input it cannot take."""


class MismatchError(SymgraphError):
    """Two models that must share an architecture (or shapes, or groups) do not."""


class OutputError(SymgraphError):
    """An output location cannot be written (exists, read-only, disk full)."""


class DataError(SymgraphError):
    """A ``--data`` argument could not be turned into batches, or its batches do not fit the model."""
