"""calm_export: merge, fuse and export a calibrated model into a validated inference engine.

    from calm_export import ExportConfig, export_engine
    result = export_engine("smollm2-135m-instruct", "engine/", adapter="adapter/")

The engine directory's format is defined by :mod:`calm_runtime.formats.engine` (the runtime reads
it through the same module). Needs the ``export`` extra (torch, transformers, peft, onnx);
importing the package and its CLI module does not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["ExportConfig", "ExportResult", "export_engine"]

if TYPE_CHECKING:
    from .config import ExportConfig
    from .pipeline import ExportResult, export_engine

_WHERE = {"ExportConfig": ".config", "ExportResult": ".pipeline", "export_engine": ".pipeline"}


def __getattr__(name: str):
    # Imported on first use, so that ``calm_export.cli`` (and ``calm-export --help``) load
    # without torch; the pipeline needs the export extra.
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
