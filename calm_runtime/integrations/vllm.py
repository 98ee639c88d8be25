"""A vLLM logits processor that applies calm calibration adapters inside ``vllm serve``.

What a ``calm-export --format hf`` checkpoint cannot hold (a per-token shift ``l`` in a head
without a bias, several adapters over one base model) is applied here, to the logits vLLM
samples from, with the one calibration formula (docs/methods.md §1)::

    CALM_VLLM_ADAPTERS="daca=adapters/daca,calm=adapters/calm" \\
    vllm serve MODEL_FOLDER \\
        --logits-processors calm_runtime.integrations.vllm:CalibrationLogitsProcessor \\
        --logprobs-mode processed_logprobs

A request picks an adapter by name with vLLM's per-request extra arguments
(``"vllm_xargs": {"calm_adapter": "daca"}`` in an OpenAI request body);
``CALM_VLLM_DEFAULT_ADAPTER=NAME`` applies one to requests that name none. With
``--logprobs-mode processed_logprobs`` the token log-probabilities vLLM returns are the
calibrated ones. vLLM computes prompt log-probabilities from the model's own logits, before
any logits processor: they stay uncalibrated here (a ``--format hf`` checkpoint calibrates
them too). An adapter with a LoRA changes the model, not only its logits: export it with
``--format hf`` instead. The answer-level temperature of a cloze fit acts on option scores,
not on tokens, and is left to calm's scoring. Not installed as an entry point on purpose:
vLLM would load it into every server and refuse speculative decoding there.

This module runs inside vLLM's environment (vLLM and torch), never in calm's runtime.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from calm_runtime.errors import ConfigError
from calm_runtime.formats.artifact import CalibrationAdapter

try:
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
except ImportError as exc:  # pragma: no cover - only imported by vLLM
    raise ImportError("calm_runtime.integrations.vllm is loaded by vLLM (pip install vllm); "
                      f"it cannot be used without it ({exc})") from exc
try:  # Model Runner V2's interface (vLLM 0.32+, its default wherever Triton runs: CUDA)
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor
except ImportError:  # an older vLLM: the V1 interface only
    V2LogitsProcessor = None

__all__ = ["ADAPTERS_ENV", "DEFAULT_ENV", "REQUEST_KEY", "CalibrationLogitsProcessor",
           "adapter_paths"]

logger = logging.getLogger(__name__)

#: ``NAME=PATH[,NAME=PATH...]``: the adapters a server can apply, loaded at its start
ADAPTERS_ENV = "CALM_VLLM_ADAPTERS"
#: the adapter applied to requests that name none (unset: those are left as they are)
DEFAULT_ENV = "CALM_VLLM_DEFAULT_ADAPTER"
#: the key of vLLM's per-request extra arguments (``vllm_xargs``) that names an adapter
REQUEST_KEY = "calm_adapter"


def adapter_paths(spec: str | None = None) -> dict[str, Path]:
    """``{name: folder}`` from ``CALM_VLLM_ADAPTERS`` (or ``spec``); one-line errors."""
    spec = os.environ.get(ADAPTERS_ENV, "") if spec is None else spec
    paths: dict[str, Path] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"{ADAPTERS_ENV} entry {item!r} is not NAME=PATH; write "
                              f"{ADAPTERS_ENV}=daca=adapters/daca[,NAME=PATH...]")
        if name.strip() in paths:
            raise ConfigError(f"{ADAPTERS_ENV} names the adapter {name.strip()!r} twice; give "
                              "each adapter one name")
        paths[name.strip()] = Path(path.strip())
    return paths


#: how much of a name an error message repeats
_NAME_CHARS = 60


def _requested(params) -> str | None:
    extra = getattr(params, "extra_args", None) or {}
    return extra.get(REQUEST_KEY, os.environ.get(DEFAULT_ENV) or None)


def _clip(name: str) -> str:
    return repr(name if len(name) <= _NAME_CHARS else name[:_NAME_CHARS] + "...")


def served_tokenizer_sha256(model_config) -> str | None:
    """sha256 of the served model's ``tokenizer.json`` (vLLM's tokenizer path, else its
    model path: a local folder, or a hub id already in the Hugging Face cache); ``None``
    when there is no such file to read."""
    from calm_runtime.formats.tokenizer_file import tokenizer_sha256

    for source in (getattr(model_config, "tokenizer", None), getattr(model_config, "model", None)):
        if not source:
            continue
        folder = Path(str(source))
        if (folder / "tokenizer.json").is_file():
            return tokenizer_sha256(folder)
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(source), "tokenizer.json",
                                            revision=getattr(model_config, "tokenizer_revision",
                                                             None))
        except Exception:  # noqa: BLE001 - not a hub id: nothing cached to read
            cached = None
        if isinstance(cached, str) and Path(cached).is_file():
            return tokenizer_sha256(Path(cached).parent)
    return None


_BASES = (LogitsProcessor,) if V2LogitsProcessor is None else (LogitsProcessor,
                                                               V2LogitsProcessor)


class CalibrationLogitsProcessor(*_BASES):
    """Applies the adapter each request names to that request's row of the logits.

    One class for both of vLLM's model runners: V1's interface (``update_state`` with the
    persistent batch's added, removed and moved rows; ``apply(logits)``) and Model Runner
    V2's (``add_request`` per request slot; ``apply(logits, ctx)`` with the rows' slots in
    ``ctx.expanded_idx_mapping``), so ``--logits-processors`` names the same class on
    either. An adapter is applied only to the model it was fitted for: the served model's
    tokenizer must be the one the adapter records (its sha256), else the server refuses to
    start."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        name = _requested(sampling_params)
        if name is None:
            return
        if not isinstance(name, str):
            raise ValueError(f"vllm_xargs.{REQUEST_KEY} must be an adapter's name (a string), "
                             f"got {type(name).__name__}")
        known = adapter_paths()
        if name not in known:
            raise ValueError(f"unknown calibration adapter {_clip(name)}; this server has "
                             f"{sorted(known) or 'none'} (set {ADAPTERS_ENV} at its start)")

    def __init__(self, vllm_config, *args) -> None:
        """V1: ``(vllm_config, device, is_pin_memory)``; V2: ``(vllm_config, req_states)``."""
        model_config = vllm_config.model_config
        vocab = model_config.get_vocab_size()
        served_sha = None
        self.adapters: dict[str, CalibrationAdapter] = {}
        for name, path in adapter_paths().items():
            adapter = CalibrationAdapter.from_pretrained(path)
            if adapter.lora_path is not None:
                raise ConfigError(f"adapter {name!r} ({path}) carries a LoRA, which changes the "
                                  "model, not only its logits; export it with calm-export "
                                  "--format hf and serve that checkpoint")
            if adapter.base_model.served is None and adapter.base_model.vocab_size != vocab:
                expected = adapter.base_model.vocab_size
                raise ConfigError(f"adapter {name!r} ({path}) is for a {expected}-token "
                                  f"vocabulary, the served model has {vocab}; use the adapter "
                                  "fitted for this model")
            recorded = adapter.base_model.tokenizer_sha256
            if adapter.base_model.served is None and recorded is not None:
                if served_sha is None:
                    served_sha = served_tokenizer_sha256(model_config) or ""
                if not served_sha:
                    raise ConfigError(f"adapter {name!r} ({path}) is for the model "
                                      f"{adapter.base_model.name!r}; the served model's "
                                      "tokenizer.json cannot be read to check that it is that "
                                      "model; serve a local model folder")
                if served_sha != recorded:
                    raise ConfigError(f"adapter {name!r} ({path}) was fitted for "
                                      f"{adapter.base_model.name!r}, whose tokenizer differs "
                                      f"from the served model's (sha256 {recorded[:12]} vs "
                                      f"{served_sha[:12]}); use the adapter fitted for this "
                                      "model")
            self.adapters[name] = adapter
        default = os.environ.get(DEFAULT_ENV)
        if default and default not in self.adapters:
            raise ConfigError(f"{DEFAULT_ENV}={default!r} is not one of {ADAPTERS_ENV}'s "
                              f"adapters {sorted(self.adapters)}")
        self.rows: dict[int, str] = {}  # V1: persistent-batch index -> adapter name
        self.slots: dict[int, str] = {}  # V2: request slot -> adapter name
        logger.info("calm calibration adapters: %s", ", ".join(
            f"{n} (T={a.temperature:.4g})" for n, a in self.adapters.items()) or "none")

    def is_argmax_invariant(self) -> bool:
        return False  # a per-token tau or shift can change which token wins

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, _output in batch_update.added:
            name = _requested(params)
            if name is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = name
        for source, target, direction in batch_update.moved:
            a, b = self.rows.pop(source, None), self.rows.pop(target, None)
            if a is not None:
                self.rows[target] = a
            if direction == MoveDirectionality.SWAP and b is not None:
                self.rows[source] = b

    # ------------------------------------------------------------------ V2's interface
    def add_request(self, req_idx: int, sampling_params) -> bool:
        """A request enters slot ``req_idx`` (a recycled slot's old entry is overwritten);
        whether this processor changes its logits."""
        name = _requested(sampling_params)
        if name is None:
            self.slots.pop(req_idx, None)
            return False
        self.slots[req_idx] = name
        return True

    def apply_staged_writes(self) -> None:
        pass  # nothing is staged on the device: the slots live on the host

    # ------------------------------------------------------------------ both
    def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:
        """V1: rows are persistent-batch indices (``update_state``); V2: ``ctx`` maps each
        logits row to its request slot (``add_request``)."""
        by_adapter: dict[str, list[int]] = {}
        if ctx is None:
            for index, name in self.rows.items():
                if index < logits.shape[0]:
                    by_adapter.setdefault(name, []).append(index)
        elif self.slots:
            for row, slot in enumerate(ctx.expanded_idx_mapping.tolist()):
                name = self.slots.get(int(slot))
                if name is not None:
                    by_adapter.setdefault(name, []).append(row)
        for name, indices in by_adapter.items():
            rows = torch.tensor(sorted(indices), device=logits.device)
            calibrated = self.adapters[name].calibrate(logits[rows].float())
            logits[rows] = calibrated.to(logits.dtype)
        return logits
