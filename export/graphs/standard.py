"""calm's own graph in standard ONNX ops (``--graph standard``; what TensorRT's parser reads
and what the quantisers and the fp16 converter start from)."""

from __future__ import annotations

from .base import GraphStrategy


class StandardGraph(GraphStrategy):
    name = "standard"

    def unsupported_because(self, config, model_config=None) -> str | None:
        return None

    def build(self, job) -> dict:
        from .calm_graph import export_onnx

        config = job.config
        facts = export_onnx(job.model, job.shape, job.staging, opset=config.opset,
                            exporter=config.exporter, external_data=job.external,
                            logits_affine=job.affine)
        facts["graph"] = {"kind": "standard", "fused_ops": {}}
        return facts
