"""How an engine's ONNX graph is built: one strategy per graph kind.

* :mod:`.builder`: onnxruntime-genai's model builder graph with the calibration in its head
  (``genai-builder``);
* :mod:`.fused`: calm's own graph (torch.export) with ONNX Runtime's fused RMSNorm ops
  (``ort-fused``);
* :mod:`.standard`: calm's own graph in standard ONNX ops only (``standard``).

The graphs themselves are written by :mod:`.calm_graph` (calm's own, torch.export) and
:mod:`.genai_builder` (the builder's, which :mod:`.genai_build` runs).

Each strategy says why it cannot build an engine for a model and settings
(``unsupported_because``; ``None``: it can) and builds the graph into the staging folder
(``build``). Eligibility is decided there and nowhere else: ``ExportConfig`` asks the
builder about the settings alone, :func:`build_graph` asks every candidate about the model
too. ``--graph`` names the candidates in order (:data:`CANDIDATES`); the first that can
build does, and where a fallible one (the builder: its graph is validated while the model
is still loaded) fails, the next one builds instead. When the last candidate cannot build
(``--graph builder`` on a model or settings the builder does not cover), that is a
one-line error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calm_runtime.errors import ConfigError, ExportValidationError

from .base import GraphStrategy
from .builder import BuilderGraph
from .fused import FusedGraph
from .standard import StandardGraph

__all__ = ["BUILDER", "CANDIDATES", "FUSED", "STANDARD", "GraphJob", "GraphStrategy",
           "build_graph"]

logger = logging.getLogger(__name__)

BUILDER, FUSED, STANDARD = BuilderGraph(), FusedGraph(), StandardGraph()
#: ``--graph`` -> the strategies tried, in order
CANDIDATES: dict[str, tuple[GraphStrategy, ...]] = {
    "auto": (BUILDER, FUSED, STANDARD),
    "builder": (BUILDER,),
    "fused": (FUSED, STANDARD),
    "standard": (STANDARD,),
}


@dataclass
class GraphJob:
    """What a strategy builds from: the merged, head-fused model and its settings.

    A strategy that needs the torch model only to write it out (the builder) takes it with
    :meth:`take_model`, which leaves this job (and ``release``'s owner) without a reference,
    so the weights are freed before the builder loads its own copy; a later candidate gets
    the model back from ``reload`` (the same load and fuse again)."""

    model: Any
    tokenizer: Any
    shape: Any  # calm_export.graphs.calm_graph.DecoderShape
    config: Any  # calm_export.config.ExportConfig
    #: the calibration applied after the head (soft-capping families, a kept tied head)
    affine: Any
    external: bool
    staging: Path
    #: drops the owner's reference to the model (called by take_model)
    release: Callable[[], None] = lambda: None
    #: the merged, head-fused model loaded again (after take_model)
    reload: Callable[[], Any] | None = None
    #: the model's config, kept for eligibility checks after the model is taken
    model_config: Any = None
    #: the precision of the checkpoint the model was loaded from (``None``: unknown)
    source_dtype: str | None = None
    #: the builder's precision (``-p``): "fp32", or "fp16" for a model loaded in float16
    builder_precision: str = "fp32"
    #: why no later candidate can take over when the builder fails (``None``: they can)
    no_fallback: str | None = None

    def __post_init__(self) -> None:
        if self.model_config is None and self.model is not None:
            self.model_config = self.model.config

    def take_model(self) -> list:
        """The model in a one-item list (pop it and drop the list to free it); the job and
        its owner keep no reference."""
        box = [self.model]
        self.model = None
        self.release()
        return box

    def ensure_model(self) -> None:
        if self.model is None:
            if self.reload is None:
                raise RuntimeError("the model was taken and cannot be reloaded")
            logger.info("loading the model again for calm's own graph")
            self.model = self.reload()


@dataclass
class BuiltGraph:
    facts: dict
    #: the validation's result when the strategy was validated while the model was loaded
    checked: Any = None
    #: calm's own graph: the fused torch decoder's largest difference from the reference
    fused_torch: float | None = None


def build_graph(job: GraphJob, *, validate: Callable[[], Any],
                check_torch: Callable[[Any], float],
                on_stage: Callable[[str], None] = lambda _name: None) -> BuiltGraph:
    """Build the graph ``--graph`` asks for (see the module's docstring). ``validate()``
    validates what is in the staging folder; ``check_torch(model)`` compares calm's fused
    torch decoder with the reference before calm's own graph is exported. The reason the
    builder was not used is recorded in ``facts["graph"]["builder_not_used"]`` under
    ``--graph auto``."""
    config = job.config
    not_used = None  # why the first candidate (the builder, under auto) was passed over
    candidates = CANDIDATES[config.graph]
    for strategy in candidates:
        last = strategy is candidates[-1]
        reason = strategy.unsupported_because(config, job.model_config)
        if reason is not None:
            if last:
                raise ConfigError(f"--graph {strategy.name} cannot build this engine: "
                                  f"{reason}; use --graph auto")
            not_used = not_used or reason
            continue
        if not strategy.fallible:
            if not_used is not None and config.graph == "auto":
                logger.info("graph: calm's own (%s)", not_used)
            job.ensure_model()
            fused_torch = check_torch(job.model)
            built = BuiltGraph(facts=strategy.build(job), fused_torch=fused_torch)
            break
        try:
            facts = strategy.build(job)
            on_stage("validate")
            built = BuiltGraph(facts=facts, checked=validate())
            break
        except strategy.failures as exc:
            if last:
                raise
            if job.no_fallback is not None:  # a graph that was built but is off says so alone
                if isinstance(exc, ExportValidationError):
                    raise
                raise type(exc)(f"{exc}; {job.no_fallback}") from None
            logger.warning("the %s graph is not used (%s); exporting calm's own graph",
                           strategy.name, exc)
            not_used = f"{strategy.name} failed: {exc}"
            for stale in job.staging.iterdir():
                if stale.is_file():
                    stale.unlink()
            on_stage("export")
    if not_used is not None and config.graph == "auto":
        built.facts["graph"]["builder_not_used"] = not_used
    return built
