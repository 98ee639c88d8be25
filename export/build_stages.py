"""The stages of calm-export after the graph is written: validating the fp32 graph against
the reference, building a quantised or fp16 variant (with its drift report), and the
TensorRT engine. Each proves what it built matches the reference or raises."""

from __future__ import annotations

import logging
from pathlib import Path

from calm_runtime.errors import ConfigError, ExportValidationError

from . import quantize, validate
from .config import ExportConfig
from .graphs import genai_builder
from .graphs.calm_graph import ONNX_FILE, fuse_graph

__all__ = ["build_tensorrt", "build_variant", "validate_graph"]

logger = logging.getLogger("calm_export.pipeline")


def validate_graph(staging: Path, shape, config: ExportConfig, tokenizer, pad_id: int, cases,
                    references, tolerance: float, *, variant: bool | None = None):
    """Run the graph in staging through calm's runtime backend against the reference; raises
    :class:`ExportValidationError` when it is off. Also rolls out the drift prompts a
    variant (``variant``; default: the precision's) is measured on."""
    if variant is None:
        variant = config.precision.variant
    runner, runtime = validate.onnx_runner(staging / ONNX_FILE, shape, config.providers)
    got = validate.run_cases(runner, cases, config.greedy_steps, references)
    # each drift prompt and its greedy steps within the model's positions (a small model's
    # context can be shorter than the passages)
    room = max(1, shape.max_position_embeddings - config.greedy_steps)
    drift_cases = validate.build_cases(tokenizer, quantize.DRIFT_PROMPTS, pad_id,
                                       max_tokens=room) if variant else []
    drift_base = validate.run_cases(runner, drift_cases, config.greedy_steps)
    del runner
    single, double = validate.compare_all(cases, references, got, tolerance)
    overall = single.merge(double)
    validate.check(f"the exported {config.precision} ONNX engine" if not variant and
                   config.precision.variant else "the exported ONNX engine", overall, tolerance)
    return got, drift_cases, drift_base, single, double, overall, runtime


def build_variant(staging: Path, shape, config: ExportConfig, cases, references, got,
                   drift_cases, drift_base, scale: float, external: bool, base_graph: dict,
                   gguf_spec=None):
    """Build the int8 or fp16 graph from the validated fp32 one and measure its drift.

    The fp32 graph moves to ``staging/.fp32`` (removed before the manifest is written).
    fp16 is validated against the reference like fp32, with the fp16 tolerance; int8 must
    keep the fp32 top token at ``int8_min_agreement`` of the drift positions.
    """
    precision = config.precision
    fp32_root = quantize.stash_fp32(staging)
    source, target = fp32_root / ONNX_FILE, staging / ONNX_FILE
    facts = precision.build(source, target, config, external=external, gguf_spec=gguf_spec)
    if base_graph["kind"] == genai_builder.GRAPH_KIND:  # its MatMuls quantised, nothing else
        facts["graph"] = dict(base_graph)
    else:
        facts["graph"] = {"kind": "standard", "fused_ops": {}}
    if config.graph in ("fused", "auto") and base_graph["kind"] != genai_builder.GRAPH_KIND:
        # the drift and the fp16 check below measure the fused graph
        facts["graph"] = fuse_graph(target, shape, external=external)
        facts["bytes"] = sum(p.stat().st_size for p in staging.glob(f"{ONNX_FILE}*"))
    runner, _ = validate.onnx_runner(target, shape, config.providers)
    mine = validate.run_cases(runner, cases, config.greedy_steps, references)
    mine_drift = validate.run_cases(runner, drift_cases, config.greedy_steps, drift_base)
    del runner
    drift = quantize.measure_drift([*cases, *drift_cases], [*got, *drift_base],
                                   [*mine, *mine_drift])
    if facts.get("blocks", {}).get("path") == "gguf-blocks":
        drift["compared_with"] += (f"; its weights are {facts['blocks']['gguf_file']}'s own, "
                                   "dequantised")
    facts["drift"] = drift
    logger.info("%s drift vs fp32 over %d positions: top-1 agreement %.3f, mean total "
                "variation %.4f, max |dp| %.3g", precision, drift["positions"],
                drift["greedy_agreement"], drift["mean_total_variation"],
                drift["max_prob_change"])
    if precision.quantized:
        minimum = precision.min_agreement(config)
        if drift["greedy_agreement"] < minimum:
            raise ExportValidationError(
                f"the {precision} engine keeps the fp32 top token at "
                f"{drift['greedy_agreement']:.1%} of {drift['positions']} positions (minimum "
                f"{minimum:.0%}); {precision.advice}; no engine was written")
        return fp32_root, facts, {f"{precision}_min_agreement": minimum}
    tolerance = config.tolerance(scale, precision.tolerance)
    single, double = validate.compare_all(cases, references, mine, tolerance)
    overall = single.merge(double)
    validate.check(f"the {precision} ONNX engine", overall, tolerance)
    return fp32_root, facts, {precision.name: {
        "max_abs_diff": overall.max_abs_diff, "worst_at": overall.where, "tolerance": tolerance,
        "batch2_max_abs_diff": double.max_abs_diff, "greedy_match": True,
        "greedy_ties": single.greedy_ties + double.greedy_ties,
        "runtime": "onnxruntime CPUExecutionProvider (ops without fp16 CPU kernels run in fp32 "
                   "between casts; GPU providers were not part of this validation)"}}


def build_tensorrt(staging: Path, shape, config: ExportConfig, cases, references, scale,
                    facts: dict):
    from .tensorrt import PLAN_FILE, build_plan, tensorrt_runner

    fp16 = config.dtype == "fp16"
    if config.max_sequence_length > shape.max_position_embeddings:
        raise ConfigError(f"max_sequence_length {config.max_sequence_length} exceeds the model's "
                          f"{shape.max_position_embeddings} positions; lower it")
    settings = build_plan(staging / ONNX_FILE, staging / PLAN_FILE, shape, fp16=fp16,
                          max_batch=config.max_batch_size, max_total=config.max_sequence_length)
    settings.update(facts)
    tolerance = config.tolerance(scale, "fp16" if fp16 else "fp32")
    got = validate.run_cases(tensorrt_runner(staging / PLAN_FILE, shape), cases,
                             config.greedy_steps, references)
    single, double = validate.compare_all(cases, references, got, tolerance)
    validate.check("the TensorRT engine", single.merge(double), tolerance)
    return settings, {"max_abs_diff": single.merge(double).max_abs_diff, "tolerance": tolerance,
                      "batch2_max_abs_diff": double.max_abs_diff, "greedy_match": True,
                      "greedy_ties": single.greedy_ties + double.greedy_ties}
