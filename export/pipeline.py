"""``export_engine``: one :class:`ExportJob`, run stage by stage: resolve -> load ->
reference -> fuse -> export -> validate -> quantize -> tensorrt -> calibrate -> write.

Each stage is one method of the job, reads what the stages before it put on the job and adds
its own products; :data:`STAGES` is their order. Nothing reaches the output directory before
validation passes: the engine is built in a temporary sibling folder
(``calm_runtime.files.atomic_directory``) and renamed into place last; with ``overwrite`` the
old engine is replaced only then, so a failed export leaves it intact.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calm_runtime.data.models import (
    PACKAGED_MODELS,
    check_model_config,
    load_model_and_tokenizer,
    model_identity,
    resolve_model,
)
from calm_runtime.errors import ArtifactError, ConfigError
from calm_runtime.files import atomic_directory, check_creatable
from calm_runtime.formats.artifact import CalibrationAdapter, describe_calibrated_outputs
from calm_runtime.formats.engine import EngineManifest
from calm_runtime.placement import checkpoint_dtype, return_free_memory

from . import engine_writer, fuse, graphs, heads, recalibrate, validate
from .build_stages import build_tensorrt, build_variant, validate_graph
from .config import ExportConfig
from .gguf_file import gguf_origin
from .graphs.calm_graph import ONNX_FILE, KVCacheDecoder, decoder_shape
from .progress import StageProgress

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
    #: each stage's peak resident set size in MB (export/progress.py)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.file_sizes.values())


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
    if not config.output.engine_folder:  # llama.cpp's file, not an engine folder
        raise ConfigError("export_engine builds engine folders; write a calibrated GGUF with "
                          "calm_export.gguf.export_gguf (calm-export --format gguf)")
    job = ExportJob(model_spec=model, out=Path(out), adapter_arg=adapter, config=config)
    try:
        return job.run()
    finally:
        job.stages.close()


@dataclass
class ExportJob:
    """One export: its inputs, then what each stage made (``None`` until it ran)."""

    model_spec: Any
    out: Path
    adapter_arg: Any
    config: ExportConfig
    stages: StageProgress = field(init=False)
    started: float = field(init=False)
    # resolve
    folder: Path | None = None
    identity: Any = None
    adapter: CalibrationAdapter | None = None
    adapter_dir: Path | None = None
    calibration: Any = None
    trt_facts: dict | None = None
    #: the builder builds the engine's precision itself, from weights loaded in it (fp16):
    #: no float32 model, graph or variant stage
    direct: bool = False
    # load
    model: Any = None
    tokenizer: Any = None
    shape: Any = None
    template: Any = None
    # reference
    was_tied: bool = False
    tied_scale: bool = False
    tokens: dict | None = None
    pad_id: int = 0
    cases: list | None = None
    post: Any = None
    references: list | None = None
    scale: float = 0.0
    tolerance: float = 0.0
    # fuse
    affine: Any = None
    # export, validate, quantize, tensorrt
    staging: Path | None = None
    facts: dict | None = None
    report: dict | None = None
    fp32_root: Path | None = None
    variant_facts: dict | None = None
    dtype: str = "float32"
    model_files: list | None = None
    model_file: str = ONNX_FILE
    kind: str = "onnx"
    trt_settings: dict | None = None
    checked: tuple | None = None
    # write
    tokenizer_files: dict | None = None
    chat_template: str | None = None
    export_settings: dict | None = None

    def __post_init__(self) -> None:
        config = self.config
        wanted = {"tensorrt": config.output.tensorrt_plan,
                  "quantize": config.precision.variant,
                  "calibrate": config.calibration_data is not None}
        self.stages = StageProgress([s for s in STAGES if wanted.get(s, True)], config.progress)
        self.started = time.perf_counter()

    def run(self) -> ExportResult:
        self.resolve()
        self.load()
        self.reference()
        self.fuse()
        if self.config.output.checkpoint:
            return self.write_checkpoint()
        with atomic_directory(self.out, overwrite=self.config.overwrite) as staging:
            self.staging = staging
            self.export_and_validate()
            self.quantize()
            self.tensorrt()
            self.export_settings = engine_writer.engine_files(self)
            updates = self.calibrate()
            sizes = self.write(updates)
        return self.finished(sizes)

    # ------------------------------------------------------------------ stages
    def resolve(self) -> None:
        """The output folder may be written, the model, adapter and data are what they must
        be: everything checked before a weight is loaded."""
        self.stages.start("resolve")
        out, config = self.out, self.config
        if out.exists() and not config.overwrite:
            raise ArtifactError(f"{out} already exists; choose another --out or pass "
                                "--overwrite to replace it (the old engine stays until the new "
                                "one is valid)")
        if out.exists() and not out.is_dir():
            raise ArtifactError(f"{out} exists and is not a folder; choose another --out")
        output = config.output
        if out.exists() and not (out / output.marker).is_file() and any(out.iterdir()):
            raise ArtifactError(f"{out} exists and is not a calm {output.what}; refusing to "
                                "replace it even with --overwrite, choose another --out")
        check_creatable(out)
        if output.tensorrt_plan:
            from .tensorrt import require_tensorrt

            self.trt_facts = require_tensorrt()
        self.folder = resolve_model(self.model_spec)
        check_model_config(self.folder)  # sizes, heads, rotary settings: before a weight is read
        self.identity = model_identity(
            self.folder, name=str(self.model_spec) if str(self.model_spec) in PACKAGED_MODELS
            else None)
        adapter, self.adapter_dir = engine_writer.load_adapter(self.adapter_arg)
        if adapter is None:
            adapter = CalibrationAdapter.identity(self.identity)
        else:  # vocabulary and tokenizer sha256, before anything heavy is loaded
            adapter.base_model.check_compatible(self.identity)
        self.adapter = adapter
        if output.checkpoint:  # what the checkpoint cannot hold fails before the weights load
            from .checkpoint import check_foldable

            check_foldable(self.folder, adapter)
        self.direct = self._builder_builds_precision()
        if self.direct:
            self.stages.skip("quantize")
        if config.calibration_data:  # read the data and settle the scoring mode now
            self.calibration = recalibrate.CalibrationRun(
                recalibrate.load_calibration_data(config.calibration_data,
                                                  config.calibration_limit),
                *recalibrate.scoring_settings(config, adapter))

    def _builder_builds_precision(self) -> bool:
        """Whether the first graph ``--graph`` tries is the builder's, it can build this model
        and it builds the engine's precision from weights in that precision (fp16): then the
        model is loaded in it, and nothing in float32 is ever held."""
        precision, candidates = self.config.precision, graphs.CANDIDATES[self.config.graph]
        if precision.builder in (None, "fp32") or candidates[0] is not graphs.BUILDER:
            return False
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(str(self.folder))
        return graphs.BUILDER.unsupported_because(self.config, model_config) is None

    @property
    def builds_variant(self) -> bool:
        """The engine's precision is built from the validated fp32 graph (quantised, or fp16
        converted from calm's own graph), not by the builder directly."""
        return self.config.precision.variant and not self.direct

    @property
    def load_dtype(self) -> str:
        """float32 (every graph calm builds itself, and the quantised ones, start from
        float32 weights; docs/formats.md), or the precision the builder builds directly."""
        return self.config.precision.load_dtype if self.direct else "float32"

    def load(self) -> None:
        """The model and tokenizer, and what the adapter says about itself."""
        self.stages.start("load")
        adapter = self.adapter
        # on the CPU: the reference is a few prompts, computed in float32 (validate.py)
        self.model, self.tokenizer, self.identity = load_model_and_tokenizer(
            self.model_spec, dtype=self.load_dtype, device="cpu")
        self.shape = shape = decoder_shape(self.model.config)
        self.template = engine_writer.p_true_template_for(self.config, adapter)
        logger.info("model %s: %d layers, vocab %d; adapter %s (T=%.4g, tau in [%.3g, %.3g])",
                    self.identity.name, shape.num_layers, shape.vocab_size, adapter.kind,
                    adapter.temperature, float(adapter.tau.min()), float(adapter.tau.max()))
        gate = adapter.method.get("alpha_gate")
        if isinstance(gate, dict) and gate.get("reason"):  # calm train's do-no-harm measurement
            logger.warning("adapter %s: %s", adapter.kind, gate["reason"])
        outputs = adapter.calibrated_outputs()
        if self.adapter_arg is not None and outputs["token_logprobs"] is None:
            logger.warning("the adapter %s folds nothing into the LM head: token "
                           "log-probabilities stay the model's own%s", adapter.kind,
                           "" if adapter.answer_temperature is None else
                           f"; its cloze answer temperature {adapter.answer_temperature:.4g} "
                           "calibrates option probabilities only"
                           + (" (the engine's runtime applies it; a --format hf checkpoint "
                              "cannot carry it)" if self.config.output.checkpoint else ""))

    def reference(self) -> None:
        """The unfused model (with its LoRA) and the calibration applied in torch: the
        logits every built engine must equal, on the validation cases."""
        self.stages.start("reference")
        model, adapter, config = self.model, self.adapter, self.config
        self.was_tied = fuse.head_is_tied(model)
        self.tied_scale = fuse.keeps_tied_head(model, adapter, config)  # scalar tau, builder
        self.model = self._with_lora(model)
        self.tokens = engine_writer.special_tokens(self.folder, model.config, self.tokenizer,
                                                   self.shape.vocab_size)
        pad = self.tokens["pad_token_id"]
        self.pad_id = pad if pad is not None else 0
        self.cases = validate.build_cases(self.tokenizer, validate.default_prompts(self.template),
                                          self.pad_id)
        self.post = heads.post_head(model)
        with validate.float32_compute(self.model):
            heads.check_post_head(model, self.post, self.cases[0].input_ids)
            self.references = validate.run_cases_together(
                validate.torch_reference_runner(self.model, adapter), self.cases,
                config.greedy_steps)
        return_free_memory()  # the reference pass's temporaries, before the model is fused
        self.scale = validate.reference_scale(self.references)
        self.tolerance = config.tolerance(
            self.scale, config.precision.tolerance if self.direct else "fp32")

    def _with_lora(self, model):
        """``model`` with its head untied (where the calibration goes into it) and the
        adapter's LoRA applied (not merged)."""
        if self.config.head_layout == "untied" and not self.tied_scale:
            fuse.untie_lm_head(model)
        if self.adapter.lora_path is not None:
            model = fuse.apply_lora(model, self.adapter.lora_path)
        return model

    def fuse(self) -> None:
        """The LoRA merged and the calibration in the head (or after it, as elementwise ops,
        where the family's post-head or a tied head keeps it out)."""
        self.stages.start("fuse")
        self.model = self._fused(self.model, log=True)

    def _fused(self, model, *, log: bool = False):
        adapter, post = self.adapter, self.post
        if adapter.lora_path is not None:
            model = fuse.merge_lora(model)
        if self.config.output.checkpoint:  # the checkpoint folds it itself
            return model
        if not post.linear or self.tied_scale:  # the calibration goes after the head
            self.affine = fuse.logits_affine(adapter, self.shape.vocab_size,
                                             post.head_multiplier)
            heads.neutralise(model, post)
            if log:
                logger.info("%s: the calibration is applied after it, as elementwise ops",
                            "the tied head" if post.linear else post.describe())
        else:
            fuse.fuse_into_lm_head(model, adapter, layout=self.config.head_layout,
                                   multiplier=post.value)
            heads.neutralise(model, post)
        return model

    def _release_model(self) -> None:
        self.model = None

    def _reload_model(self):
        """The merged, calibrated model loaded and fused again, as load, reference and fuse
        made it (a builder graph that failed took the first one)."""
        model, _, _ = load_model_and_tokenizer(self.folder, dtype="float32", device="cpu")
        return self._fused(self._with_lora(model))

    def _check_fused_torch(self, model) -> float:
        """calm's own graph: the fused torch decoder against the reference before the export
        (a builder graph is compared with the reference directly)."""
        decoder = KVCacheDecoder(model, self.shape.num_layers, self.affine).eval()
        fused = validate.run_cases(validate.torch_decoder_runner(decoder, self.shape),
                                   self.cases, self.config.greedy_steps, self.references)
        single, double = validate.compare_all(self.cases, self.references, fused,
                                              self.tolerance)
        validate.check("the fused torch model", single.merge(double), self.tolerance)
        return max(single.max_abs_diff, double.max_abs_diff)

    def _validate_staged(self):
        return validate_graph(self.staging, self.shape, self.config, self.tokenizer, self.pad_id,
                              self.cases, self.references, self.tolerance,
                              variant=self.builds_variant)

    def export_and_validate(self) -> None:
        """The graph (the first of ``--graph``'s candidates that can build it), then its
        validation against the reference."""
        config = self.config
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        external = config.external_data if config.external_data is not None else (
            weight_bytes > config.EXTERNAL_DATA_BYTES)
        self.stages.start("export")
        built = graphs.build_graph(
            graphs.GraphJob(model=self.model, tokenizer=self.tokenizer, shape=self.shape,
                            config=config, affine=self.affine, external=external,
                            staging=self.staging, release=self._release_model,
                            reload=None if self.direct else self._reload_model,
                            source_dtype=checkpoint_dtype(self.folder),
                            builder_precision=config.precision.builder if self.direct
                            else "fp32",
                            no_fallback=(f"the model was loaded in {self.load_dtype} for the "
                                         f"builder's {config.precision} graph; export with "
                                         "--graph fused (calm's own graph, converted from "
                                         "float32)") if self.direct else None),
            validate=self._validate_staged, check_torch=self._check_fused_torch,
            on_stage=self.stages.start)
        self.facts, checked, fused_torch = built.facts, built.checked, built.fused_torch
        if self.direct:
            self.dtype = config.precision.dtype
        self.model = None
        del built
        return_free_memory()
        if checked is None:
            self.stages.start("validate")
            checked = self._validate_staged()
        self.checked = checked
        got, _, _, single, double, _, runtime = checked
        fp16 = self.direct and config.precision.tolerance == "fp16"
        atol, rtol = (config.ATOL_FP16, config.RTOL_FP16) if fp16 else (config.ATOL_FP32,
                                                                        config.RTOL_FP32)
        self.report = validate.passed_report(
            single, double, self.tolerance, self.scale, config.greedy_steps, self.cases, runtime,
            "unfused model (+LoRA) with calm_runtime.calibration applied in torch"
            + (f", its {self.load_dtype} weights computed in float32" if self.direct else ""),
            atol=atol if config.atol is None else config.atol,
            rtol=rtol if config.atol is None else 0.0, fused_torch_max_abs_diff=fused_torch)

    def quantize(self) -> None:
        """The int8, int4 or fp16 variant built from the validated fp32 graph."""
        config = self.config
        if self.builds_variant:
            got, drift_cases, drift_base = self.checked[:3]
            self.stages.start("quantize")
            self.fp32_root, self.variant_facts, variant_report = build_variant(
                self.staging, self.shape, config, self.cases, self.references, got,
                drift_cases, drift_base, self.scale, self.facts["external_data"],
                self.facts["graph"], gguf_spec=gguf_origin(self.model_spec, self.folder))
            self.report.update(variant_report)
            self.facts["graph"] = self.variant_facts.pop("graph")
            self.dtype = config.precision.dtype
        self.model_files = sorted(p.name for p in self.staging.iterdir()
                                  if p.is_file() and p.name.startswith(ONNX_FILE))

    def tensorrt(self) -> None:
        """The TensorRT plan parsed from the graph, validated like it."""
        config = self.config
        if not config.output.tensorrt_plan:
            return
        self.stages.start("tensorrt")
        self.trt_settings, trt_report = build_tensorrt(self.staging, self.shape, config,
                                                       self.cases, self.references, self.scale,
                                                       self.trt_facts)
        self.report["tensorrt"] = trt_report
        self.model_files.append(self.trt_settings["plan"])
        self.model_file, self.kind = self.trt_settings["plan"], "tensorrt"
        self.dtype = "float16" if config.dtype == "fp16" else "float32"

    def manifest(self, calibration: dict | None = None) -> EngineManifest:
        """The engine's manifest from the job (``calibration``: what ``--recalibrate``
        changed)."""
        adapter = self.adapter
        built = engine_writer.build_manifest(self)
        merged = {**built.calibration, **(calibration or {})}
        if calibration:  # --recalibrate: what the outputs are calibrated by now
            merged["outputs"] = describe_calibrated_outputs(
                kind=f"{adapter.kind}+recalibrated", method=adapter.method,
                token=adapter.has_token_calibration() or merged["temperature"] != 1.0,
                temperature=merged["temperature"],
                answer_temperature=merged["answer_temperature"])
        return dataclasses.replace(built, calibration=merged)

    def calibrate(self) -> dict:
        """``--recalibrate``: the temperature refitted on the final engine's own scores."""
        config, updates = self.config, {}
        if config.calibration_data:
            self.stages.start("calibrate")
            precision = config.precision
            updates, self.export_settings["calibration_check"], cloze_variant = \
                recalibrate.check_calibration(
                    self.manifest(), config, self.calibration, fp32_root=self.fp32_root,
                    variant_name=precision.name,
                    external=self.facts["external_data"],
                    tolerance=lambda s: config.tolerance(s, precision.tolerance))
            if cloze_variant is not None:
                self.export_settings["cloze_variant"] = cloze_variant
        if self.fp32_root is not None:
            shutil.rmtree(self.fp32_root)
        return updates

    def write(self, updates: dict) -> dict[str, int]:
        """The manifest, written and read back with its hashes checked; the files' sizes."""
        self.stages.start("write")
        self.export_settings["stages"] = self.stages.report()
        self.manifest(updates).write(self.staging)
        EngineManifest.load(self.staging, verify_hashes=True)  # read back what was written
        return {p.name: p.stat().st_size for p in sorted(self.staging.iterdir()) if p.is_file()}

    def finished(self, sizes: dict[str, int]) -> ExportResult:
        stages = self.stages
        stages.finish()
        stages.seconds["total"] = round(time.perf_counter() - self.started, 3)
        final = EngineManifest.load(self.out, verify_hashes=False)
        logger.info("engine written to %s (%.1f MB, max |logit diff| %.3g, %.1f s)", self.out,
                    sum(sizes.values()) / 1e6, self.report["max_abs_diff"],
                    stages.seconds["total"])
        return ExportResult(path=self.out, manifest=final, file_sizes=sizes,
                            seconds=stages.seconds, peak_rss_mb=stages.peak_rss_mb)

    def write_checkpoint(self) -> ExportResult:
        """``--format hf``: fold into the head, save, reload with transformers, compare,
        rename (export/checkpoint.py)."""
        from .checkpoint import export_checkpoint

        return export_checkpoint(self, ExportResult)
