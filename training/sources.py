"""Where ``--model`` / ``--reference`` point, decided here: a packaged name or transformers
folder, an exported engine, or a served endpoint. The fit reads a source's identity and
prompt format through these functions, not by testing the spec itself."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from calm_runtime.artifact import ModelIdentity
from calm_runtime.models import model_identity, resolve_model

from .engine_model import engine_identity, is_engine
from .remote import Endpoint

if TYPE_CHECKING:
    from .fit_config import FitConfig

__all__ = ["model_source", "prompt_format"]


def model_source(config: FitConfig, role: str):
    """``config.model`` / ``config.reference`` as scoring takes it: the spec of a local model,
    or a connected :class:`~calm_training.remote.Endpoint` for an http(s) URL."""
    spec = getattr(config, role)
    from .remote import connect, is_endpoint

    if not is_endpoint(spec):
        return spec
    return connect(spec, model_name=getattr(config, f"{role}_name"),
                   api_key_env=config.api_key_env, concurrency=config.concurrency)


def prompt_format(config: FitConfig) -> str:
    """``"chat"`` or ``"plain"``: how the fit's prompts reach the model. Cloze prompts are
    always text; letter and P(True) prompts follow ``config.chat`` (``None``: the chat
    template when the model has one; a served model has one when it answers chat
    completions), the same rule for a local, exported or served model."""
    if config.mode == "cloze":
        return "plain"
    source = model_source(config, "model")
    if isinstance(source, Endpoint):
        from .remote import resolve_chat

        chat = resolve_chat(source, config.chat)
    else:
        folder = Path(config.model) if is_engine(config.model) else resolve_model(config.model)
        has = (folder / "chat_template.jinja").is_file() or bool(
            _json_field(folder / "tokenizer_config.json", "chat_template"))
        chat = has if config.chat is None else bool(config.chat)
    return "chat" if chat else "plain"


def _json_field(path: Path, key: str):
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _identity(config: FitConfig, role: str) -> ModelIdentity:
    """The identity an adapter records for ``config.model`` / ``config.reference``: a local
    model's (vocabulary, tokenizer hash) or a served model's (endpoint, served name)."""
    source = model_source(config, role)
    if isinstance(source, Endpoint):
        return ModelIdentity.served_model(source.base_url, source.model)
    spec = getattr(config, role)
    if is_engine(spec):
        return engine_identity(spec)
    return model_identity(resolve_model(spec), name=spec if not Path(spec).exists() else None)
