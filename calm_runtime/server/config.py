"""``ServeConfig`` (defined in :mod:`calm_runtime.serve_config`, importable without FastAPI)."""

from ..serve_config import ServeConfig

__all__ = ["ServeConfig"]
