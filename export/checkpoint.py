"""``--format hf``: a transformers checkpoint whose LM head computes the calibrated logits.

Any server that loads a transformers folder (vLLM, SGLang, TensorRT-LLM's converter,
llama.cpp's converter, transformers itself) then serves calibrated logits with no calm
code. What folds (docs/methods.md §1, docs/formats.md "Calibrated checkpoint"):

* tau and T: always, into the head's rows ``W' = W / (tau T)``; the head is untied from
  the embedding first (``tie_word_embeddings`` becomes false).
* the shift l: as the head's bias ``b' = (b / tau + l) / T``, only where the family's
  transformers class has a head bias (it would be dropped on load otherwise). Where it
  has none and l != 0: a one-line error (fit tau and T only, or export ONNX).
* a family's logit scaling (Granite, Cohere): folded, the config's factor set to 1.
* soft-capping (Gemma-2): only a single tau and l = 0, by rescaling the cap
  (export/heads.py); otherwise a one-line error.

``answer_temperature`` (the cloze option temperature) acts on option scores, which other
servers do not compute: it is recorded in the manifest, not folded.

The checkpoint is validated like an engine: reloaded with ``AutoModelForCausalLM`` from the
staging folder, its logits and greedy KV-cache tokens compared with the unfused reference,
and only then renamed into place.
"""

from __future__ import annotations

import datetime as _dt
import logging
from pathlib import Path

import numpy as np
import torch

from calm_runtime import __version__
from calm_runtime.calibration import fused_head
from calm_runtime.errors import ArtifactError, IncompatibleModelError
from calm_runtime.files import sha256_file
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_runtime.formats.manifest import write_json
from calm_runtime.inference.post_head import model_configs

from .formats import CHECKPOINT_MANIFEST
from .heads import PostHead

__all__ = ["CHECKPOINT_MANIFEST", "SCHEMA_VERSION", "check_foldable", "fold_into_checkpoint",
           "export_checkpoint", "head_loads_bias",
           "reload_runner", "write_checkpoint", "write_manifest"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


def head_loads_bias(model) -> bool:
    """Whether the model's transformers class builds its LM head with a bias (so a saved
    ``lm_head.bias`` is loaded, not dropped)."""
    with torch.device("meta"):
        fresh = type(model)(model.config)
    head = fresh.get_output_embeddings()
    return getattr(head, "bias", None) is not None


def check_foldable(model_dir: Path, adapter: CalibrationAdapter) -> None:
    """Refuse at once, before the weights are loaded, an adapter the family's checkpoint
    cannot hold (the same rules as :func:`fold_into_checkpoint`, on an empty model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from calm_runtime.inference.post_head import post_head

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config)
    _refuse_unfoldable(empty, adapter, post_head(empty))


def _refuse_unfoldable(model, adapter: CalibrationAdapter, post: PostHead) -> None:
    tau = np.asarray(adapter.tau)
    has_shift = bool(np.any(np.asarray(adapter.shift) != 0))
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if not post.linear:
        if has_shift or not bool(np.all(tau == tau[0])):
            raise IncompatibleModelError(
                f"{model_type} soft-caps its logits ({post.describe()}): a transformers "
                "checkpoint can hold one temperature there, not a per-token tau or a shift; "
                "export --format onnx (which applies them after the cap) or fit a temperature "
                "only (calm fit daca / ts)")
        return
    head = model.get_output_embeddings()
    if (has_shift or getattr(head, "bias", None) is not None) and not head_loads_bias(model):
        raise IncompatibleModelError(
            f"the adapter has a per-token shift l, but {model_type}'s LM head has no bias in "
            "transformers (a saved bias would be dropped on load), so the checkpoint cannot "
            "hold it; export --format onnx, or use an adapter without a shift (tau and T fold "
            "exactly)")


def fold_into_checkpoint(model, adapter: CalibrationAdapter, post: PostHead) -> dict:
    """Fold the calibration into ``model``'s (untied) head in place; returns what was folded.

    Raises :class:`IncompatibleModelError` (one line, nothing changed) where the family's
    checkpoint cannot hold it.
    """
    from .fuse import head_is_tied

    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ArtifactError(f"the model's LM head is a {type(head).__name__}, not a Linear "
                            "layer; --format hf can only fold into a linear head")
    if head_is_tied(model):
        raise ArtifactError("the LM head is still tied to the embedding; untie it first")
    tau = np.asarray(adapter.tau, dtype=np.float32)
    shift = np.asarray(adapter.shift, dtype=np.float32)
    has_shift = bool(np.any(shift != 0))
    scalar_tau = bool(np.all(tau == tau[0]))
    weight = head.weight.detach()
    bias = None if head.bias is None else head.bias.detach()
    folded = {"tau": "scalar" if scalar_tau else "per-vocabulary",
              "tau_value": float(tau[0]) if scalar_tau else None,
              "temperature": float(adapter.temperature), "shift": "none",
              "post_head": post.to_dict(), "head_untied": True,
              # a scalar tau on centred logits is the same distribution as on raw ones
              "centered": adapter.centered and not scalar_tau}

    _refuse_unfoldable(model, adapter, post)
    if not post.linear:
        k = float(tau[0]) * float(adapter.temperature)
        with torch.no_grad():
            head.weight = torch.nn.Parameter((weight / k).contiguous(), requires_grad=False)
            if bias is not None:
                head.bias = torch.nn.Parameter((bias / k).contiguous(), requires_grad=False)
        cap = post.value / k
        for config in model_configs(model):
            if hasattr(config, post.field):
                setattr(config, post.field, cap)
        folded["post_head_after"] = {"kind": post.kind, "value": cap, "field": post.field}
        logger.info("folded 1/(tau T) = %.6g into the head and the soft cap (%g -> %g)",
                    1 / k, post.value, cap)
        return folded

    multiplier = post.head_multiplier
    scaled_bias = None if bias is None else bias * multiplier
    new_weight, new_bias = fused_head(
        weight * multiplier, scaled_bias, torch.from_numpy(tau).to(weight.dtype),
        torch.from_numpy(shift).to(weight.dtype) if has_shift else None,
        float(adapter.temperature), center=adapter.centered and not scalar_tau)
    with torch.no_grad():
        head.weight = torch.nn.Parameter(new_weight.contiguous(), requires_grad=False)
        if new_bias is not None:
            head.bias = torch.nn.Parameter(new_bias.contiguous(), requires_grad=False)
    if has_shift:
        folded["shift"] = "head bias"
    if post.folded_away:
        from .heads import neutralise

        neutralise(model, post)
        folded["post_head_after"] = {"kind": post.kind, "value": 1.0, "field": post.field}
    return folded


def write_checkpoint(model, staging: Path) -> None:
    """Save the folded model (config, safetensors weights, generation config) in ``staging``."""
    model.save_pretrained(staging)
    generation = getattr(model, "generation_config", None)
    if generation is not None and not (staging / "generation_config.json").is_file():
        generation.save_pretrained(staging)
    for path in staging.iterdir():  # the weights come out 0600 from a temporary file
        if path.is_file() and not path.is_symlink():
            path.chmod(0o644)


def reload_runner(staging: Path):
    """The checkpoint as another server would load it: ``AutoModelForCausalLM`` from the
    folder, float32, no calm code; a validation runner over its raw logits."""
    from transformers import AutoModelForCausalLM

    from .validate import torch_reference_runner

    reloaded = AutoModelForCausalLM.from_pretrained(str(staging), dtype=torch.float32).eval()
    return torch_reference_runner(reloaded, None)


def write_manifest(staging: Path, *, source: dict, adapter_info: dict | None,
                   adapter: CalibrationAdapter, folded: dict, validation: dict,
                   settings: dict) -> dict:
    """``calm_checkpoint.json``: where the checkpoint came from, what was folded, its parity,
    and the sha256 of every file next to it."""
    files = {p.name: sha256_file(p) for p in sorted(staging.iterdir())
             if p.is_file() and p.name != CHECKPOINT_MANIFEST}
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "kind": "hf-checkpoint",
        "created_by": f"calm-export {__version__}",
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": {"model": source, "adapter": adapter_info},
        "calibration": {"adapter_kind": adapter.kind, "folded": folded,
                        "not_folded": {"answer_temperature": adapter.answer_temperature},
                        # served logprobs are calibrated only where token_logprobs says so
                        "outputs": {**adapter.calibrated_outputs(),
                                    # option scores and P(True) need calm's runtime
                                    "option_probabilities": None, "p_true": None},
                        **{k: v for k, v in adapter.summary().items()
                           if k in ("tau_min", "tau_max", "shift_min", "shift_max")}},
        "export": settings,
        "validation": validation,
        "files": files,
    }
    write_json(staging / CHECKPOINT_MANIFEST, manifest)
    return manifest


def export_checkpoint(job, result_type):
    """``--format hf`` for an export job (export/pipeline.py) whose model is loaded, its
    reference computed and its LoRA merged: fold into the head, save, reload with
    transformers, compare with the reference, rename into place; a ``result_type``
    (``ExportResult``)."""
    import gc
    import time

    from calm_runtime.files import atomic_directory

    from . import engine_writer, validate

    config, adapter, stages = job.config, job.adapter, job.stages
    model, job.model = job.model, None
    folded = fold_into_checkpoint(model, adapter, job.post)
    folded["lora_merged"] = adapter.lora_path is not None
    with atomic_directory(job.out, overwrite=config.overwrite) as staging:
        stages.start("export")
        write_checkpoint(model, staging)
        engine_writer.copy_tokenizer(job.folder, job.tokenizer, staging)
        del model
        gc.collect()

        stages.start("validate")
        got = validate.run_cases(reload_runner(staging), job.cases, config.greedy_steps,
                                 job.references)
        single, double = validate.compare_all(job.cases, job.references, got, job.tolerance)
        validate.check("the transformers checkpoint reloaded from disk", single.merge(double),
                       job.tolerance)
        report = validate.passed_report(
            single, double, job.tolerance, job.scale, config.greedy_steps, job.cases,
            "transformers AutoModelForCausalLM.from_pretrained (float32, CPU)",
            "unfused model (+LoRA) with calm_runtime.calibration applied in torch")
        stages.start("write")
        identity = job.identity
        source = {"name": identity.name, "vocab_size": identity.vocab_size,
                  "tokenizer_sha256": identity.tokenizer_sha256,
                  "weights_sha256": engine_writer.weights_sha256(job.folder)}
        settings = {"format": "hf", "greedy_steps": config.greedy_steps,
                    **engine_writer.tool_versions()}
        manifest = write_manifest(
            staging, source=source,
            adapter_info=engine_writer.adapter_source(
                adapter if job.adapter_arg is not None else None, job.adapter_dir),
            adapter=adapter, folded=folded, validation=report, settings=settings)
        sizes = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
    stages.finish()
    stages.seconds["total"] = round(time.perf_counter() - job.started, 3)
    logger.info("calibrated checkpoint written to %s (%.1f MB, max |logit diff| %.3g, %.1f s)",
                job.out, sum(sizes.values()) / 1e6, report["max_abs_diff"],
                stages.seconds["total"])
    return result_type(path=job.out, manifest=manifest, file_sizes=sizes,
                       seconds=stages.seconds, peak_rss_mb=stages.peak_rss_mb)
