"""``calm serve``: an OpenAI-compatible HTTP server with calibrated confidences.

Needs the ``serve`` extra (``pip install 'calm-llm[serve]'``: FastAPI, uvicorn,
prometheus-client; Ray Serve for scale-out). The rest of ``calm_runtime`` never imports
this package.

    calm serve engine/ --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="engine", prompt="Question: ...", max_tokens=16)
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
except ImportError as err:  # one clear line instead of a missing-module error deep inside
    from calm_runtime.cli.common import missing_extra_message
    from calm_runtime.errors import BackendUnavailableError

    raise BackendUnavailableError(missing_extra_message("serve", "calm_runtime.server")) from err

from calm_runtime.cli.serve_config import ServeConfig
from calm_runtime.server.app import create_app

__all__ = ["create_app", "ServeConfig"]
