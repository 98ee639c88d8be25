"""Where ``--model`` / ``--reference`` point: a local model spec or a served endpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .fit_config import FitConfig

__all__ = ["model_source"]


def model_source(config: FitConfig, role: str):
    """``config.model`` / ``config.reference`` as scoring takes it: the spec of a local model,
    or a connected :class:`~calm_training.remote.Endpoint` for an http(s) URL."""
    spec = getattr(config, role)
    from .remote import connect, is_endpoint

    if not is_endpoint(spec):
        return spec
    return connect(spec, model_name=getattr(config, f"{role}_name"),
                   api_key_env=config.api_key_env, concurrency=config.concurrency)
