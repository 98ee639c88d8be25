"""``ServeConfig`` (defined in :mod:`calm_runtime.cli.serve_config`, importable without FastAPI)."""

from calm_runtime.cli.serve_config import ServeConfig

__all__ = ["ServeConfig"]
