"""``export_engine``: resolve -> reference -> merge + fuse -> export -> validate -> write.

Nothing reaches the output directory before validation passes: the engine is built in a
temporary sibling folder (``calm_runtime.files.atomic_directory``) and renamed into place
last; with ``overwrite`` the old engine is replaced only then, so a failed export leaves
it intact.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from calm_runtime.data.models import (
    PACKAGED_MODELS,
    check_model_config,
    load_model_and_tokenizer,
    model_identity,
    resolve_model,
)
from calm_runtime.data.prompts import DEFAULT_P_TRUE_TEMPLATE
from calm_runtime.errors import ArtifactError, ConfigError
from calm_runtime.files import atomic_directory, check_creatable
from calm_runtime.formats.artifact import CalibrationAdapter, describe_calibrated_outputs
from calm_runtime.formats.engine import EngineManifest

from . import engine_writer, fuse, graphs, heads, recalibrate, validate
from .build_stages import build_tensorrt, build_variant, validate_graph
from .config import ExportConfig
from .gguf_file import gguf_origin
from .graphs import genai_builder
from .graphs.calm_graph import ONNX_FILE, KVCacheDecoder, decoder_shape

__all__ = ["ExportResult", "export_engine"]

logger = logging.getLogger(__name__)

STAGES = ("resolve", "load", "reference", "fuse", "export", "validate", "quantize", "tensorrt",
          "calibrate", "write")


@dataclass
class ExportResult:
    """What ``export_engine`` produced: where, the manifest, file sizes and stage timings.

    ``manifest`` is the engine's :class:`EngineManifest`, or for ``format="hf"`` the
    checkpoint's ``calm_checkpoint.json`` as a dict."""

    path: Path
    manifest: EngineManifest | dict
    file_sizes: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.file_sizes.values())


class _Stages:
    """Logs each stage and moves one tqdm bar (stderr, a terminal only) along; while a stage
    runs, a heartbeat shows its elapsed time every :data:`HEARTBEAT_S` seconds (on the bar in
    a terminal, as a log line otherwise), so a long stage is never silent."""

    def __init__(self, names, progress: bool) -> None:
        from tqdm.auto import tqdm

        self.names = list(names)
        self.progress = progress
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=len(self.names), desc="calm-export", unit="stage",
                        disable=not (progress and self.tty), leave=False)
        self.seconds: dict[str, float] = {}
        self._name, self._start = None, 0.0
        self._stop = threading.Event()
        self._beat = None
        if progress:
            self._beat = threading.Thread(target=self._heartbeat, name="calm-export-heartbeat",
                                          daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        interval = HEARTBEAT_S if not self.tty else 1.0
        last_log = time.perf_counter()
        while not self._stop.wait(interval):
            name, start = self._name, self._start
            if name is None:
                continue
            elapsed = time.perf_counter() - start
            if self.tty:
                self.bar.set_postfix_str(f"{name} {elapsed:.0f} s")
            elif time.perf_counter() - last_log >= HEARTBEAT_S:
                last_log = time.perf_counter()
                logger.info("stage %s: running for %.0f s", name, elapsed)

    def start(self, name: str) -> None:
        self.finish()
        self._name, self._start = name, time.perf_counter()
        self.bar.set_postfix_str(name)
        logger.info("stage %d/%d: %s", self.names.index(name) + 1, len(self.names), name)

    def finish(self) -> None:
        if self._name is not None:
            self.seconds[self._name] = round(time.perf_counter() - self._start, 3)
            self.bar.update(1)
            self._name = None

    def close(self) -> None:
        self.finish()
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2)
        self.bar.close()


#: seconds between the heartbeat's log lines while a stage runs (no terminal)
HEARTBEAT_S = 30.0


def export_engine(model: str | os.PathLike, out: str | os.PathLike, *,
                  adapter: str | os.PathLike | CalibrationAdapter | None = None,
                  config: ExportConfig | None = None) -> ExportResult:
    """Build a validated, calibrated inference engine for ``model`` in the directory ``out``.

    ``model`` is any spec :func:`calm_runtime.data.models.resolve_model` accepts; ``adapter`` is
    an adapter directory, a :class:`CalibrationAdapter`, or ``None`` (identity calibration).
    Raises a :class:`~calm_runtime.errors.CalmError` subclass on bad input or a failed
    validation; then nothing is written and an existing engine at ``out`` is untouched.
    """
    config = config or ExportConfig()
    out = Path(out)
    if not config.output.engine_folder:  # llama.cpp's file, not an engine folder
        raise ConfigError("export_engine builds engine folders; write a calibrated GGUF with "
                          "calm_export.gguf.export_gguf (calm-export --format gguf)")
    wanted = {"tensorrt": config.output.tensorrt_plan, "quantize": config.variant is not None,
              "calibrate": config.calibration_data is not None}
    stages = _Stages([s for s in STAGES if wanted.get(s, True)], config.progress)
    try:
        return _export(model, out, adapter, config, stages)
    finally:
        stages.close()


def _export(model_spec, out: Path, adapter_arg, config: ExportConfig,
            stages: _Stages) -> ExportResult:
    started = time.perf_counter()
    stages.start("resolve")
    if out.exists() and not config.overwrite:
        raise ArtifactError(f"{out} already exists; choose another --out or pass --overwrite "
                            "to replace it (the old engine stays until the new one is valid)")
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a folder; choose another --out")
    output = config.output
    if out.exists() and not (out / output.marker).is_file() and any(out.iterdir()):
        raise ArtifactError(f"{out} exists and is not a calm {output.what}; refusing to "
                            "replace it even with --overwrite, choose another --out")
    check_creatable(out)
    trt_facts = None
    if output.tensorrt_plan:
        from .tensorrt import require_tensorrt

        trt_facts = require_tensorrt()
    folder = resolve_model(model_spec)
    check_model_config(folder)  # sizes, heads, rotary settings: before a weight is read
    identity = model_identity(folder, name=str(model_spec) if str(model_spec) in PACKAGED_MODELS
                              else None)
    adapter, adapter_dir = _load_adapter(adapter_arg)
    if adapter is None:
        adapter = CalibrationAdapter.identity(identity)
    else:  # vocabulary and tokenizer sha256, before anything heavy is loaded
        adapter.base_model.check_compatible(identity)
    if output.checkpoint:  # what the checkpoint cannot hold fails before the weights load
        from .checkpoint import check_foldable

        check_foldable(folder, adapter)
    calibration = None  # read the data and settle the scoring mode before the heavy work
    if config.calibration_data:
        calibration = recalibrate.CalibrationRun(
            recalibrate.load_calibration_data(config.calibration_data,
                                              config.calibration_limit),
            *recalibrate.scoring_settings(config, adapter))

    stages.start("load")
    model, tokenizer, identity = load_model_and_tokenizer(model_spec)
    shape = decoder_shape(model.config)
    template = _template(config, adapter)
    logger.info("model %s: %d layers, vocab %d; adapter %s (T=%.4g, tau in [%.3g, %.3g])",
                identity.name, shape.num_layers, shape.vocab_size, adapter.kind,
                adapter.temperature, float(adapter.tau.min()), float(adapter.tau.max()))
    gate = adapter.method.get("alpha_gate")
    if isinstance(gate, dict) and gate.get("reason"):  # calm train's do-no-harm measurement
        logger.warning("adapter %s: %s", adapter.kind, gate["reason"])
    outputs = adapter.calibrated_outputs()
    if adapter_arg is not None and outputs["token_logprobs"] is None:
        logger.warning("the adapter %s folds nothing into the LM head: token log-probabilities "
                       "stay the model's own%s", adapter.kind,
                       "" if adapter.answer_temperature is None else
                       f"; its cloze answer temperature {adapter.answer_temperature:.4g} "
                       "calibrates option probabilities only"
                       + (" (the engine's runtime applies it; a --format hf checkpoint "
                          "cannot carry it)" if output.checkpoint else ""))

    stages.start("reference")
    was_tied = fuse.head_is_tied(model)
    tied_scale = fuse.keeps_tied_head(model, adapter, config)  # scalar tau on the builder
    if config.head_layout == "untied" and not tied_scale:
        fuse.untie_lm_head(model)
    reference_model = model
    if adapter.lora_path is not None:
        reference_model = fuse.apply_lora(model, adapter.lora_path)
    tokens = engine_writer.special_tokens(folder, model.config, tokenizer, shape.vocab_size)
    pad_id = tokens["pad_token_id"] if tokens["pad_token_id"] is not None else 0
    cases = validate.build_cases(tokenizer, validate.default_prompts(template), pad_id)
    post = heads.post_head(model)
    heads.check_post_head(model, post, cases[0].input_ids)
    references = validate.run_cases(validate.torch_reference_runner(reference_model, adapter),
                                     cases, config.greedy_steps)
    scale = validate.reference_scale(references)
    tolerance = config.tolerance(scale)

    stages.start("fuse")
    if adapter.lora_path is not None:
        model = fuse.merge_lora(reference_model)
    del reference_model
    if output.checkpoint:
        return _export_checkpoint(model, tokenizer, out, folder, identity, adapter, adapter_arg,
                                  adapter_dir, post, cases, references, tolerance, scale,
                                  config, stages, started)
    affine = None
    if not post.linear or tied_scale:  # the calibration goes after the head
        affine = fuse.logits_affine(adapter, shape.vocab_size, post.head_multiplier)
        heads.neutralise(model, post)
        logger.info("%s: the calibration is applied after it, as elementwise ops",
                    "the tied head" if post.linear else post.describe())
    else:
        fuse.fuse_into_lm_head(model, adapter, layout=config.head_layout,
                               multiplier=post.value)
        heads.neutralise(model, post)

    def check_fused_torch(model) -> float:
        """calm's own graph: the fused torch decoder against the reference before the export
        (a builder graph is compared with the reference directly)."""
        decoder = KVCacheDecoder(model, shape.num_layers, affine).eval()
        fused = validate.run_cases(validate.torch_decoder_runner(decoder, shape), cases,
                                   config.greedy_steps, references)
        single, double = validate.compare_all(cases, references, fused, tolerance)
        validate.check("the fused torch model", single.merge(double), tolerance)
        return max(single.max_abs_diff, double.max_abs_diff)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    external = config.external_data if config.external_data is not None else (
        weight_bytes > config.EXTERNAL_DATA_BYTES)

    with atomic_directory(out, overwrite=config.overwrite) as staging:
        stages.start("export")

        def validate_staged():
            return validate_graph(staging, shape, config, tokenizer, pad_id, cases, references,
                                  tolerance)
        built = graphs.build_graph(
            graphs.GraphJob(model=model, tokenizer=tokenizer, shape=shape, config=config,
                            affine=affine, external=external, staging=staging),
            validate=validate_staged, check_torch=check_fused_torch, on_stage=stages.start)
        facts, checked, fused_torch = built.facts, built.checked, built.fused_torch
        del model, built
        gc.collect()
        if checked is None:
            stages.start("validate")
            checked = validate_staged()
        got, drift_cases, drift_base, single, double, overall, runtime = checked
        report = {
            "passed": True, "max_abs_diff": overall.max_abs_diff, "worst_at": overall.where,
            "batch1_max_abs_diff": single.max_abs_diff, "tolerance": tolerance,
            "atol": config.ATOL_FP32 if config.atol is None else config.atol,
            "rtol": config.RTOL_FP32 if config.atol is None else 0.0,
            "reference_scale": scale, "greedy_steps": config.greedy_steps,
            "greedy_match": True, "greedy_ties": single.greedy_ties + double.greedy_ties,
            "batch2_max_abs_diff": double.max_abs_diff,
            "fused_torch_max_abs_diff": fused_torch,
            "cases": [c.name for c in cases], "runtime": runtime,
            "reference": "unfused model (+LoRA) with calm_runtime.calibration applied in torch",
        }
        external = facts["external_data"]
        fp32_root, variant_facts, dtype = None, None, "float32"
        if config.variant:
            stages.start("quantize")
            fp32_root, variant_facts, variant_report = build_variant(
                staging, shape, config, cases, references, got, drift_cases, drift_base,
                scale, external, facts["graph"], gguf_spec=gguf_origin(model_spec, folder))
            report.update(variant_report)
            facts["graph"] = variant_facts.pop("graph")
            dtype = "float16" if config.variant == "fp16" else "float32"
        model_files = sorted(p.name for p in staging.iterdir()
                             if p.is_file() and p.name.startswith(ONNX_FILE))
        model_file, kind = ONNX_FILE, "onnx"
        trt_settings = None
        if output.tensorrt_plan:
            stages.start("tensorrt")
            trt_settings, trt_report = build_tensorrt(staging, shape, config, cases,
                                                       references, scale, trt_facts)
            report["tensorrt"] = trt_report
            model_files.append(trt_settings["plan"])
            model_file, kind = trt_settings["plan"], "tensorrt"
            dtype = "float16" if config.dtype == "fp16" else "float32"

        tokenizer_files, chat_template = engine_writer.copy_tokenizer(folder, tokenizer, staging)
        if facts["graph"]["kind"] == genai_builder.GRAPH_KIND:
            genai = engine_writer.genai_config_entry(staging)
        else:
            genai = engine_writer.write_genai_config(staging, shape, tokens)
        export_settings = {**config.to_dict(), **engine_writer.tool_versions(),
                           "exporter_used": facts["exporter"], "external_data": external,
                           # "genai-builder" (onnxruntime-genai's builder graph), "ort-fused"
                           # (calm's, RMSNorm as ONNX Runtime contrib ops) or "standard"
                           "graph": facts["graph"],
                           "source_head_tied": was_tied, "genai_config": genai,
                           # what the family does after its head (export/heads.py)
                           "post_head": post.to_dict(),
                           # optional graph input: project only the last positions
                           "logits_to_keep": facts["logits_to_keep"],
                           "tensorrt": trt_settings,
                           # the cloze score answer_temperature was fitted on (runtime reads it)
                           "cloze_variant": adapter.cloze_variant,
                           # the mode (cloze/letter) the calibration was fitted on: the
                           # server's default for constrained choices
                           "choice_mode": adapter.choice_mode,
                           # chat or plain: the prompt format the calibration was fitted on
                           # (calm serve says when chat traffic differs)
                           "prompt_format": (adapter.provenance or {}).get("prompt_format"),
                           # calm fit threshold: the runtime marks answers below it abstained
                           "abstention": adapter.abstention}
        if config.variant:  # "int8" / "fp16": scheme, excluded nodes, sizes, drift
            export_settings[config.variant] = variant_facts

        def manifest_now(calibration: dict | None = None) -> EngineManifest:
            built = engine_writer.build_manifest(
                kind=kind, staging=staging, identity=identity,
                weights_sha=engine_writer.weights_sha256(folder), adapter=adapter,
                adapter_info=engine_writer.adapter_source(
                    adapter if adapter_arg is not None else None, adapter_dir),
                shape=shape, model_file=model_file, model_files=model_files,
                opset=facts["opset"], tokens=tokens, tokenizer_files=tokenizer_files,
                chat_template=chat_template,
                options=engine_writer.option_tokens(tokenizer, shape.vocab_size),
                template=template, dtype=dtype, export=export_settings, validation=report)
            merged = {**built.calibration, **(calibration or {})}
            if calibration:  # --recalibrate: what the outputs are calibrated by now
                merged["outputs"] = describe_calibrated_outputs(
                    kind=f"{adapter.kind}+recalibrated", method=adapter.method,
                    token=adapter.has_token_calibration() or merged["temperature"] != 1.0,
                    temperature=merged["temperature"],
                    answer_temperature=merged["answer_temperature"])
            return dataclasses.replace(built, calibration=merged)

        updates = {}
        if config.calibration_data:
            stages.start("calibrate")
            precision = "fp16" if config.variant == "fp16" else "fp32"
            updates, export_settings["calibration_check"], cloze_variant = \
                recalibrate.check_calibration(
                    manifest_now(), config, calibration, fp32_root=fp32_root,
                    variant_name=config.variant or "fp32", external=external,
                    tolerance=lambda s: config.tolerance(s, precision))
            if cloze_variant is not None:
                export_settings["cloze_variant"] = cloze_variant
        if fp32_root is not None:
            shutil.rmtree(fp32_root)

        stages.start("write")
        manifest = manifest_now(updates)
        manifest.write(staging)
        EngineManifest.load(staging, verify_hashes=True)  # read back what was written
        sizes = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
    stages.finish()
    stages.seconds["total"] = round(time.perf_counter() - started, 3)
    final = EngineManifest.load(out, verify_hashes=False)
    logger.info("engine written to %s (%.1f MB, max |logit diff| %.3g, %.1f s)", out,
                sum(sizes.values()) / 1e6, report["max_abs_diff"], stages.seconds["total"])
    return ExportResult(path=out, manifest=final, file_sizes=sizes, seconds=stages.seconds)


def _export_checkpoint(model, tokenizer, out: Path, folder: Path, identity, adapter,
                       adapter_arg, adapter_dir, post, cases, references, tolerance: float,
                       scale: float, config: ExportConfig, stages: _Stages,
                       started: float) -> ExportResult:
    """``--format hf``: fold into the head, save, reload with transformers, compare, rename."""
    from . import checkpoint

    folded = checkpoint.fold_into_checkpoint(model, adapter, post)
    folded["lora_merged"] = adapter.lora_path is not None
    with atomic_directory(out, overwrite=config.overwrite) as staging:
        stages.start("export")
        checkpoint.write_checkpoint(model, staging)
        engine_writer.copy_tokenizer(folder, tokenizer, staging)
        del model
        gc.collect()

        stages.start("validate")
        got = validate.run_cases(checkpoint.reload_runner(staging), cases, config.greedy_steps,
                                 references)
        single, double = validate.compare_all(cases, references, got, tolerance)
        overall = single.merge(double)
        validate.check("the transformers checkpoint reloaded from disk", overall, tolerance)
        report = {
            "passed": True, "max_abs_diff": overall.max_abs_diff, "worst_at": overall.where,
            "batch1_max_abs_diff": single.max_abs_diff,
            "batch2_max_abs_diff": double.max_abs_diff, "tolerance": tolerance,
            "reference_scale": scale, "greedy_steps": config.greedy_steps, "greedy_match": True,
            "greedy_ties": single.greedy_ties + double.greedy_ties,
            "cases": [c.name for c in cases],
            "runtime": "transformers AutoModelForCausalLM.from_pretrained (float32, CPU)",
            "reference": "unfused model (+LoRA) with calm_runtime.calibration applied in torch",
        }
        stages.start("write")
        source = {"name": identity.name, "vocab_size": identity.vocab_size,
                  "tokenizer_sha256": identity.tokenizer_sha256,
                  "weights_sha256": engine_writer.weights_sha256(folder)}
        settings = {"format": "hf", "greedy_steps": config.greedy_steps,
                    **engine_writer.tool_versions()}
        manifest = checkpoint.write_manifest(
            staging, source=source,
            adapter_info=engine_writer.adapter_source(
                adapter if adapter_arg is not None else None, adapter_dir),
            adapter=adapter, folded=folded, validation=report, settings=settings)
        sizes = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
    stages.finish()
    stages.seconds["total"] = round(time.perf_counter() - started, 3)
    logger.info("calibrated checkpoint written to %s (%.1f MB, max |logit diff| %.3g, %.1f s)",
                out, sum(sizes.values()) / 1e6, report["max_abs_diff"], stages.seconds["total"])
    return ExportResult(path=out, manifest=manifest, file_sizes=sizes, seconds=stages.seconds)


def _load_adapter(adapter_arg) -> tuple[CalibrationAdapter | None, Path | None]:
    if adapter_arg is None:
        return None, None
    if isinstance(adapter_arg, CalibrationAdapter):
        adapter_arg.validate()
        return adapter_arg, None
    path = Path(adapter_arg)
    return CalibrationAdapter.from_pretrained(path), path


def _template(config: ExportConfig, adapter: CalibrationAdapter):
    recorded = adapter.p_true_template
    if config.p_true_template is None:
        return recorded if recorded is not None else DEFAULT_P_TRUE_TEMPLATE
    if recorded is not None:
        from calm_runtime.data.prompts import p_true_template

        if p_true_template(recorded).to_dict() != p_true_template(config.p_true_template).to_dict():
            logger.warning("the adapter was fitted with another P(True) template; the engine "
                           "records the one passed to calm-export")
    return config.p_true_template
