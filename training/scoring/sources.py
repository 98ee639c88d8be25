"""Where ``--model`` / ``--reference`` point, decided once, here.

A spec is a packaged name or transformers folder (:class:`LocalModel`), an exported engine
folder (:class:`EngineSource`) or an http(s) URL of a served model (:class:`ServedModel`).
:func:`resolve_source` makes that decision; everything below it asks the source what it can
do (its identity, score-cache fingerprint, prompt format, loaded model, whether an adapter
can be applied on top of it) and never tests the spec again.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import ClassVar

from calm_runtime.data.models import DEFAULT_API_KEY_ENV, is_endpoint
from calm_runtime.errors import ConfigError
from calm_runtime.formats.artifact import ModelIdentity
from calm_runtime.formats.engine import ENGINE_MANIFEST_NAME
from calm_training.scoring.endpoint import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT, Endpoint, connect

__all__ = ["ModelSource", "LocalModel", "EngineSource", "ServedModel", "resolve_source",
           "as_source", "is_engine"]


def is_engine(spec: object) -> bool:
    """Whether ``spec`` is a folder holding an engine manifest (``calm_engine.json``)."""
    if not isinstance(spec, (str, os.PathLike)) or isinstance(spec, bytes):
        return False
    return (Path(spec) / ENGINE_MANIFEST_NAME).is_file()


class ModelSource:
    """What scores: one interface over a local model, an engine and a served model."""

    #: ``"model"``, ``"engine"`` or ``"served"``
    kind: ClassVar[str]
    #: how the source is named in messages ("an engine", ...)
    described: ClassVar[str]
    #: whether it hands out full next-token distributions (token-level fits, vector weights)
    full_logits: ClassVar[bool] = False
    served: ClassVar[bool] = False

    def __init__(self, spec: str) -> None:
        self.spec = str(spec)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def identity(self) -> ModelIdentity:
        """What an adapter fitted on this source records as its base model."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """The score-cache key of what scores (local sources)."""
        raise NotImplementedError

    def tokenizer(self):
        """The model's tokenizer alone (nothing else is loaded): a local model's or an
        engine's folder holds it."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.folder()))

    def folder(self) -> Path:
        """The folder holding the tokenizer files (local sources)."""
        raise ConfigError(f"{self.spec} is served: its files are not on this machine; pass "
                          "the model's folder")

    def load(self, lora_path: str | os.PathLike | None = None):
        """``(model, tokenizer, identity)`` ready to score (local sources)."""
        raise NotImplementedError

    def chat(self, chat: bool | None) -> bool:
        """Whether letter and P(True) prompts go through the chat template: ``chat`` as
        given, or (``None``) whether the model has one (a ``chat_template.jinja`` file or a
        ``chat_template`` in ``tokenizer_config.json``: where a transformers tokenizer reads
        it from); the same rule for every source."""
        folder = self.folder()
        has = (folder / "chat_template.jinja").is_file() or bool(
            _json_field(folder / "tokenizer_config.json", "chat_template"))
        return has if chat is None else bool(chat)

    def check_adapter(self, adapter_dir) -> None:
        """A one-line error when an adapter (``--adapter``) cannot be applied on top."""

    def require_uncalibrated(self, what: str) -> None:
        """A one-line error when the source's scores already carry a calibration that
        ``what`` would be fitted on top of."""


class LocalModel(ModelSource):
    """A packaged model name or a transformers folder, loaded with torch at ``placement``
    (``(dtype, device)``, calm_runtime/placement.py; resolved once, on first use)."""

    kind = "model"
    described = "a transformers model"
    full_logits = True

    def __init__(self, spec: str, *, placement: tuple[str, str] = ("auto", "auto")) -> None:
        super().__init__(spec)
        self._asked = placement

    @cached_property
    def placement(self):
        """The resolved :class:`~calm_runtime.placement.Placement`."""
        from calm_runtime.placement import Placement

        return Placement(*self._asked).resolve(self.folder())

    def folder(self) -> Path:
        from calm_runtime.data.models import resolve_model

        return resolve_model(self.spec)

    def identity(self) -> ModelIdentity:
        from calm_runtime.data.models import model_identity

        return model_identity(self.folder(),
                              name=self.spec if not Path(self.spec).exists() else None)

    def fingerprint(self) -> str:
        from calm_runtime.data.models import model_fingerprint

        # float32 on the CPU keeps the key it always had; other placements score differently
        return model_fingerprint(self.folder()) + self.placement.cache_suffix()

    def load(self, lora_path=None):
        from calm_runtime.data.models import load_model_and_tokenizer

        placement = self.placement
        return load_model_and_tokenizer(self.folder(), lora_path=lora_path,
                                        dtype=placement.dtype, device=placement.device)


class EngineSource(ModelSource):
    """An exported engine folder, scored with onnxruntime."""

    kind = "engine"
    described = "an engine"

    def folder(self) -> Path:
        return Path(self.spec)

    def identity(self) -> ModelIdentity:
        from calm_training.scoring.engine import engine_identity

        return engine_identity(self.spec)

    def fingerprint(self) -> str:
        from calm_training.scoring.engine import engine_fingerprint

        return engine_fingerprint(self.spec)

    def load(self, lora_path=None):
        from calm_training.scoring.engine import load_engine

        if lora_path is not None:
            raise ConfigError(f"{self.spec} is an engine: a LoRA is merged at export; export "
                              "the engine with that adapter")
        return load_engine(self.spec)

    def check_adapter(self, adapter_dir) -> None:
        if adapter_dir is not None:
            raise ConfigError(f"{self.spec} is an engine: it scores with the calibration it was "
                              "exported with; pass the source model with --adapter, or export "
                              "the engine with that adapter")

    def require_uncalibrated(self, what: str) -> None:
        from calm_training.scoring.engine import require_uncalibrated

        require_uncalibrated(self.spec, what)


class ServedModel(ModelSource):
    """An OpenAI-compatible endpoint; connected (``GET /models``) on first use."""

    kind = "served"
    described = "served"
    served = True

    def __init__(self, spec: str, *, model_name: str | None = None,
                 api_key_env: str = DEFAULT_API_KEY_ENV, concurrency: int = 8,
                 timeout: float = DEFAULT_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                 endpoint: Endpoint | None = None) -> None:
        super().__init__(spec)
        self._connect = dict(model_name=model_name, api_key_env=api_key_env,
                             concurrency=concurrency, timeout=timeout, retries=max_retries)
        if endpoint is not None:
            self.__dict__["endpoint"] = endpoint

    @cached_property
    def endpoint(self) -> Endpoint:
        return connect(self.spec, **self._connect)

    def identity(self) -> ModelIdentity:
        return ModelIdentity.served_model(self.endpoint.base_url, self.endpoint.model)

    def chat(self, chat: bool | None) -> bool:
        from calm_training.scoring.served import resolve_chat

        return resolve_chat(self.endpoint, chat)

    def check_adapter(self, adapter_dir) -> None:
        if adapter_dir is not None:
            raise ConfigError("a served model is scored as it is served; fitting on top of an "
                              "adapter (--adapter) needs the model locally")


def resolve_source(spec: str | os.PathLike, *, model_name: str | None = None,
                   placement: tuple[str, str] = ("auto", "auto"),
                   api_key_env: str = DEFAULT_API_KEY_ENV, concurrency: int = 8,
                   timeout: float = DEFAULT_TIMEOUT,
                   max_retries: int = DEFAULT_MAX_RETRIES) -> ModelSource:
    """The one place a ``--model`` / ``--reference`` spec is told apart (``timeout`` and
    ``max_retries``: a served model's, per call; ``placement``: a local model's
    ``(dtype, device)``)."""
    if is_endpoint(spec):
        return ServedModel(str(spec), model_name=model_name, api_key_env=api_key_env,
                           concurrency=concurrency, timeout=timeout, max_retries=max_retries)
    if is_engine(spec):
        return EngineSource(str(spec))
    return LocalModel(str(spec), placement=placement)


def as_source(model) -> ModelSource:
    """``model`` as a :class:`ModelSource`: a source as it is, a connected
    :class:`~calm_training.scoring.endpoint.Endpoint`, or a spec to resolve."""
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, Endpoint):
        return ServedModel(model.base_url, endpoint=model)
    return resolve_source(model)


def _json_field(path: Path, key: str):
    try:
        return json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
