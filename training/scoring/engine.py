"""An exported engine in the place of a torch model, for scoring in ``calm fit`` / ``calm eval``.

``--model`` and ``--reference`` may name an engine directory (written by ``calm-export``):
its graph is scored with ONNX Runtime through the runtime's scoring passes (each cloze
context runs once and its KV cache is shared by the options; letters and P(True) project
the last position only), on the same token ids as the torch path, so the scores equal the
torch scores of the engine's source model with the calibration it was exported with (to
export parity). The engine's calibration is part of the scores: an engine fused with an
adapter is the source model with that adapter, which is why ``calm fit`` writes adapters
only from uncalibrated engines (an adapter applies to the source model's own logits).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from calm_runtime.errors import ConfigError
from calm_runtime.files import sha256_bytes
from calm_runtime.formats.artifact import ModelIdentity
from calm_runtime.formats.engine import EngineManifest

__all__ = ["EngineModel", "load_engine", "engine_fingerprint", "engine_identity",
           "require_uncalibrated"]


class EngineModel:
    """The engine's backend with the few attributes the scoring code reads from a model.

    ``config.max_position_embeddings`` bounds the scored sequences as the model's own
    context does; ``eval``/``train`` are no-ops (an engine has no training mode).
    """

    training = False

    def __init__(self, lm) -> None:
        self.lm = lm
        self.backend = lm.backend
        self.manifest: EngineManifest = lm.manifest
        self.config = SimpleNamespace(
            max_position_embeddings=lm.manifest.model["max_position_embeddings"])

    def eval(self) -> EngineModel:
        return self

    def train(self, mode: bool = True) -> EngineModel:  # noqa: ARG002 - torch's signature
        return self

    def __repr__(self) -> str:
        return f"EngineModel({self.manifest.root}, {self.backend.description})"


def load_engine(spec: str | os.PathLike, *, threads: int | None = None):
    """``(EngineModel, tokenizer, identity)`` for an engine folder; the tokenizer is the
    transformers tokenizer of the files the engine carries (the source model's)."""
    from transformers import AutoTokenizer

    from calm_runtime import CalibratedLM

    lm = CalibratedLM.load(spec, backend="onnxruntime", threads=threads)
    tokenizer = AutoTokenizer.from_pretrained(str(spec))
    return EngineModel(lm), tokenizer, engine_identity(spec, lm.manifest)


def _manifest(spec) -> EngineManifest:
    return EngineManifest.load(spec, verify_hashes=False)


def engine_fingerprint(spec: str | os.PathLike) -> str:
    """A score-cache key for an engine: the sha256 of its graph, weights and tokenizer files
    as its manifest records them (the files are checked against them when it is loaded)."""
    files = _manifest(spec).listed_files()
    return "engine:" + sha256_bytes("\n".join(f"{name}:{files[name]}"
                                              for name in sorted(files)).encode())


def engine_identity(spec: str | os.PathLike, manifest: EngineManifest | None = None
                    ) -> ModelIdentity:
    """The source model's identity, as the engine's manifest records it."""
    source = (manifest or _manifest(spec)).source["model"]
    return ModelIdentity(name=source["name"], vocab_size=int(source["vocab_size"]),
                         tokenizer_sha256=source.get("tokenizer_sha256"))


def require_uncalibrated(spec: str | os.PathLike, what: str) -> None:
    """A one-line :class:`ConfigError` when the engine carries a calibration: ``what``
    (an adapter fitted on its scores) would not apply to the source model's logits."""
    calibration = _manifest(spec).calibration
    if calibration.get("adapter_kind", "identity") != "identity":
        raise ConfigError(f"{spec} is fused with a {calibration['adapter_kind']} calibration; "
                          f"{what} needs the source model's own logits: pass an engine "
                          "exported without --adapter, or the source model itself")
