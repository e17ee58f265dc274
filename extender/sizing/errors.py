"""The one exception type of the sizing package: a one-line message naming what was wrong."""

from __future__ import annotations

__all__ = ["SizingError"]


class SizingError(ValueError):
    """Bad input to the estimator (unknown model, config.json missing fields, a context longer
    than the model supports, ...). The message is one line, fit for a CLI error or an admission
    warning, and names the offending value."""
