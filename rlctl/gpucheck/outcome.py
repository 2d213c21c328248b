"""What a GPU-check part returns or raises: its figures, ``Skip`` or ``CheckFailed``.

Shared by every part and by ``report`` (which runs them), so the parts never import the runner.
"""

from __future__ import annotations

from typing import Any

Figures = dict[str, Any]


class Skip(Exception):
    """A part's requirement is missing on this machine; the message is the reason."""


class CheckFailed(Exception):
    """A part ran and a value was out of range; the message says which, ``figures`` what the part
    measured (the report keeps them beside the error)."""

    def __init__(self, message: str, figures: Figures | None = None) -> None:
        super().__init__(message)
        self.figures: Figures = dict(figures or {})
