"""calm_export: merge, fuse and export a calibrated model into a validated inference engine.

    from calm_export import ExportConfig, export_engine
    result = export_engine("smollm2-135m-instruct", "engine/", adapter="adapter/")

The engine directory's format is defined by :mod:`calm_runtime.engine` (the runtime reads
it through the same module). Needs the ``export`` extra (torch, transformers, peft, onnx).
"""

from .config import ExportConfig
from .pipeline import ExportResult, export_engine

__all__ = ["ExportConfig", "ExportResult", "export_engine"]
