"""Which optional parts of calm are installed, found without importing anything heavy.

The distribution is ``calm-llm``; its extras (``pyproject.toml``) bring the stacks that the
runtime core does without. :func:`missing` answers with :func:`importlib.util.find_spec`, so
asking never imports torch.
"""

from __future__ import annotations

import importlib.util

__all__ = ["DISTRIBUTION", "EXTRA_MODULES", "install_hint", "missing"]

#: The name on the package index (``calm`` there is an unrelated project).
DISTRIBUTION = "calm-llm"

#: The top-level modules each extra provides that calm's commands need at once.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "train": ("torch", "transformers", "peft"),
    "export": ("torch", "transformers", "peft", "onnx", "onnxscript"),
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be found (empty when it is installed)."""
    out = []
    for module in EXTRA_MODULES[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-removed installation
            found = False
        if not found:
            out.append(module)
    return out


def install_hint(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"
