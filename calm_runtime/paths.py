"""Where calm keeps converted models, data sets and cached scores."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]

CACHE_ENV = "CALM_CACHE"


def cache_dir(*parts: str) -> Path:
    """``$CALM_CACHE`` or ``$XDG_CACHE_HOME/calm`` (default ``~/.cache/calm``), plus ``parts``.

    The directory is created on first use. Nothing is ever cached inside the repository.
    """
    root = os.environ.get(CACHE_ENV)
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "calm"
    path = base.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
