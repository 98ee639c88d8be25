"""torch backend: the reference, and a way to serve on GPUs without onnxruntime-gpu.

An engine directory holds the fused ONNX graph, not a torch model, so this backend loads
the source model (``model=``: any spec :func:`calm_runtime.data.models.resolve_model` takes;
default: the packaged model the manifest names, if installed) and the calibration
adapter (``adapter=``: a directory or a :class:`CalibrationAdapter`), merges the LoRA, and
applies the calibration to the logits with :func:`calm_runtime.calibration.apply_calibration`
— the one formula; nothing is fused here. The adapter and model are checked against the
manifest's recorded identities (vocabulary, tokenizer hash, adapter tensor hash,
calibration summary) so a mismatch is an error, not silently different confidences.

torch is imported when the backend is created, never by ``import calm_runtime``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from calm_runtime.calibration import apply_calibration
from calm_runtime.errors import BackendUnavailableError, ConfigError, IncompatibleModelError
from calm_runtime.files import sha256_file
from calm_runtime.formats.artifact import TENSORS_NAME, CalibrationAdapter, ModelIdentity
from calm_runtime.inference.backends._base import Backend, TorchStateMixin

__all__ = ["TorchBackend"]

logger = logging.getLogger(__name__)

#: relative tolerance when a CalibrationAdapter object is compared with the manifest's
#: summary (float32 values written through JSON round-trip exactly; this only absorbs
#: float32 -> float64 printing)
_SUMMARY_RTOL = 1e-6


def _import_torch():
    try:
        import torch
    except ImportError:
        raise BackendUnavailableError("torch is not installed; the torch backend needs it "
                                      "(pip install torch), or use backend='onnxruntime'") from None
    return torch


class TorchBackend(TorchStateMixin, Backend):
    """The merged transformers model with the calibration formula on its logits.

    Args:
        manifest: the engine's manifest (its recorded model and adapter are checked).
        model: model spec (folder, ``.gguf`` or packaged name); default: the manifest's
            source model name when it is an installed packaged model.
        adapter: the calibration adapter the engine was exported with (directory or object);
            required when the engine's calibration is not the identity.
        device: torch device, e.g. ``"cpu"`` or ``"cuda"``.
        dtype: ``"float32"`` (reference), ``"bfloat16"``/``"float16"``, or ``"auto"`` (the
            checkpoint's own); device and dtype are resolved as every command resolves them
            (calm_runtime/placement.py).
        threads: ``torch.set_num_threads`` (process-wide!) when given.
    """

    name = "torch"

    def __init__(self, manifest, *, model=None, adapter=None, device: str = "cpu",
                 dtype: str = "float32", threads: int | None = None):
        torch = _import_torch()
        from calm_runtime.data.models import PACKAGED_MODELS, load_model_and_tokenizer

        source = manifest.source
        if model is None:
            name = source["model"]["name"]
            if name not in PACKAGED_MODELS:
                raise ConfigError(f"the torch backend needs the source model: pass model=PATH "
                                  f"(the engine was exported from {name!r}, which is not a "
                                  "packaged model name)")
            model = name
        adapter = self._load_adapter(manifest, adapter)
        if threads is not None:
            torch.set_num_threads(int(threads))
        lora = adapter.lora_path if adapter is not None else None
        net, _tokenizer, identity = load_model_and_tokenizer(model, lora_path=lora, dtype=dtype,
                                                             device=device, move_io=False)
        self._check_identity(manifest, identity)
        if adapter is None:
            adapter = CalibrationAdapter.identity(identity)
        adapter.base_model.check_compatible(identity)
        placement = net.calm_placement
        device, dtype, torch_dtype = placement.device, placement.dtype, placement.torch_dtype()
        self._torch = torch
        self._model = net
        self._device = torch.device(device)
        self._tau = torch.as_tensor(adapter.tau, device=self._device)
        self._shift = torch.as_tensor(adapter.shift, device=self._device)
        self._temperature = adapter.temperature
        self._center = adapter.centered
        self._layers = manifest.num_layers
        self._kv = (manifest.model["num_kv_heads"], manifest.model["head_dim"])
        self._dtype = torch_dtype
        import inspect

        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        params = inspect.signature(net.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_keep = "logits_to_keep" in params
        self.keeps_last_logits = (self._has_keep, self._has_keep)
        self.device = str(self._device)
        self.description = f"torch {torch.__version__} {device} {dtype} ({identity.name})"

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _load_adapter(manifest, adapter) -> CalibrationAdapter | None:
        recorded = manifest.source["adapter"]
        calibration = manifest.calibration
        if adapter is None:
            identity = (calibration["temperature"] == 1.0 and calibration["tau_min"] == 1.0
                        and calibration["tau_max"] == 1.0 and calibration["shift_min"] == 0.0
                        and calibration["shift_max"] == 0.0)
            if recorded is not None or not identity:
                kind = recorded["kind"] if recorded else calibration["adapter_kind"]
                raise ConfigError(f"the engine was exported with a calibration adapter (kind "
                                  f"{kind!r}); pass adapter=PATH to the torch backend")
            return None
        if not isinstance(adapter, CalibrationAdapter):
            folder = Path(adapter)
            loaded = CalibrationAdapter.from_pretrained(folder)
            expected = recorded.get("tensors_sha256") if recorded else None
            if expected and sha256_file(folder / TENSORS_NAME) != expected:
                raise IncompatibleModelError(f"adapter {folder} is not the one the engine was "
                                             "exported with (calibration tensors differ); pass "
                                             "the adapter given to calm-export")
            adapter = loaded
        summary = adapter.summary()
        for key in ("temperature", "tau_min", "tau_max", "shift_min", "shift_max"):
            if not math.isclose(summary[key], calibration[key], rel_tol=_SUMMARY_RTOL,
                                abs_tol=1e-7):
                raise IncompatibleModelError(
                    f"adapter {key} {summary[key]:.6g} differs from the engine's "
                    f"{calibration[key]:.6g}; pass the adapter given to calm-export")
        return adapter

    @staticmethod
    def _check_identity(manifest, identity: ModelIdentity) -> None:
        recorded = manifest.source["model"]
        if identity.vocab_size != manifest.vocab_size:
            raise IncompatibleModelError(f"model {identity.name} has {identity.vocab_size} tokens "
                                         f"but the engine {manifest.vocab_size}; pass the model "
                                         "the engine was exported from")
        expected = recorded.get("tokenizer_sha256")
        if expected and identity.tokenizer_sha256 and expected != identity.tokenizer_sha256:
            raise IncompatibleModelError(f"model {identity.name}'s tokenizer differs from the "
                                         "engine's; pass the model the engine was exported from")

    # ------------------------------------------------------------------ running
    def run(self, input_ids, attention_mask, position_ids, state=None, *, last_only=False):
        torch = self._torch
        batch = input_ids.shape[0]
        if state is None:
            empty = torch.zeros(batch, self._kv[0], 0, self._kv[1], device=self._device,
                                dtype=self._dtype)
            state = [empty] * (2 * self._layers)
        cache = self._cache_cls(ddp_cache_data=[(state[2 * i], state[2 * i + 1])
                                             for i in range(self._layers)])
        extra = {"logits_to_keep": 1} if last_only and self._has_keep else {}
        with torch.inference_mode():
            out = self._model(input_ids=self._tensor(input_ids),
                              attention_mask=self._tensor(attention_mask),
                              position_ids=self._tensor(position_ids), use_cache=True,
                              **{self._cache_kw: cache}, **extra)
            logits = out.logits[:, -1:] if last_only else out.logits
            logits = apply_calibration(logits.float(), self._tau, self._shift,
                                       self._temperature, center=self._center)
            result = logits.cpu().numpy()
        new_cache = getattr(out, "cache", None) or out.past_key_values
        present = []
        for layer in new_cache.layers:
            present += [layer.keys, layer.values]
        return result, present

    def _tensor(self, array: np.ndarray):
        return self._torch.from_numpy(np.ascontiguousarray(array)).to(self._device)

    def close(self) -> None:
        self._model = None
