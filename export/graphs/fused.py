"""calm's own graph with its RMSNorms as ONNX Runtime's fused normalisation ops
(``--graph fused``, ``ort-fused``; calm_graph.py ``fuse_graph``)."""

from __future__ import annotations

from calm_runtime.placement import return_free_memory

from .base import GraphStrategy
from .standard import StandardGraph


class FusedGraph(GraphStrategy):
    name = "fused"

    def unsupported_because(self, config, model_config=None) -> str | None:
        if not config.output.onnx_engine:  # a TensorRT plan is parsed from the graph
            return "TensorRT's parser reads standard ONNX ops only"
        if config.precision.variant:
            # the quantisers and the fp16 converter read standard ops: a variant is built
            # from the standard graph and fused after it
            return f"the {config.precision} variant is built from the standard graph"
        return None

    def build(self, job) -> dict:
        from .calm_graph import ONNX_FILE, fuse_graph

        facts = StandardGraph().build(job)
        # the graph is on disk: the torch model is not needed past here, and the optimizer
        # loads the graph with its weights
        job.take_model().clear()
        return_free_memory()
        facts["graph"] = fuse_graph(job.staging / ONNX_FILE, job.shape, external=job.external)
        return facts
