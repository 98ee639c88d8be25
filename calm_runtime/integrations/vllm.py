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


def _requested(params) -> str | None:
    extra = getattr(params, "extra_args", None) or {}
    return extra.get(REQUEST_KEY, os.environ.get(DEFAULT_ENV) or None)


class CalibrationLogitsProcessor(LogitsProcessor):
    """Applies the adapter each request names to that request's row of the logits."""

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
            raise ValueError(f"unknown calibration adapter {name!r}; this server has "
                             f"{sorted(known) or 'none'} (set {ADAPTERS_ENV} at its start)")

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        vocab = vllm_config.model_config.get_vocab_size()
        self.device = device
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
            self.adapters[name] = adapter
        default = os.environ.get(DEFAULT_ENV)
        if default and default not in self.adapters:
            raise ConfigError(f"{DEFAULT_ENV}={default!r} is not one of {ADAPTERS_ENV}'s "
                              f"adapters {sorted(self.adapters)}")
        self.rows: dict[int, str] = {}  # persistent-batch index -> adapter name
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

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        by_adapter: dict[str, list[int]] = {}
        for index, name in self.rows.items():
            if index < logits.shape[0]:
                by_adapter.setdefault(name, []).append(index)
        for name, indices in by_adapter.items():
            rows = torch.tensor(sorted(indices), device=logits.device)
            calibrated = self.adapters[name].calibrate(logits[rows].float())
            logits[rows] = calibrated.to(logits.dtype)
        return logits
