"""``calm serve``: an OpenAI-compatible HTTP server with calibrated confidences.

Needs the ``serve`` extra (``pip install 'calm-llm[serve]'``: FastAPI, uvicorn,
prometheus-client; Ray Serve for scale-out). The rest of ``calm_runtime`` never imports
this package.

    calm serve engine/ --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="engine", prompt="Question: ...", max_tokens=16)
"""

from __future__ import annotations

from calm_runtime.server.config import ServeConfig

__all__ = ["create_app", "ServeConfig"]


def __getattr__(name: str):
    # the app needs the serve extra; its settings (``ServeConfig``, ``server.config``) do
    # not, so that ``calm serve --help`` and a config check work without FastAPI
    if name == "create_app":
        from calm_runtime.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
