"""The backend interface (see the package docstring)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

__all__ = ["Backend", "TorchStateMixin"]


class Backend(ABC):
    """Runs decoder steps with a KV cache; every method is safe to call from many threads.

    The KV ``state`` is an opaque per-call value (``None`` means an empty cache): the
    backend never keeps per-call state on ``self``.
    """

    #: the name ``CalibratedLM.load(backend=...)`` takes
    name: ClassVar[str] = ""
    #: most rows a forward pass may have (``None``: no limit)
    max_batch: int | None = None
    #: a past cache may be followed by more than one new token in a forward pass
    multi_token_with_past: bool = True
    #: what runs the graph, for reports (e.g. "onnxruntime 1.32.0 CPUExecutionProvider")
    description: str = ""

    @abstractmethod
    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            state: Any = None, *, last_only: bool = False) -> tuple[np.ndarray, Any]:
        """Logits ``[B, S, V]`` (``[B, 1, V]`` with ``last_only``) float32, and the new state.

        ``input_ids`` and ``position_ids`` are ``[B, S]`` int64, ``attention_mask``
        ``[B, past + S]`` int64 (0 on left padding).
        """

    @abstractmethod
    def select(self, state: Any, rows: np.ndarray) -> Any:
        """A new state holding the given batch rows of ``state`` (repeats allowed)."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release the session or model (the backend is unusable afterwards)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description})"


class TorchStateMixin:
    """``select`` for backends whose KV state is a list of torch tensors on ``_device``."""

    _torch: Any
    _device: Any

    def select(self, state, rows):
        if state is None:
            return None
        index = self._torch.as_tensor(np.asarray(rows, dtype=np.int64), device=self._device)
        return [t.index_select(0, index) for t in state]
