"""The backend interface (see the package docstring)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

__all__ = ["Backend", "BackendMemoryError", "TorchStateMixin", "is_allocation_failure"]


class BackendMemoryError(MemoryError):
    """A forward pass could not allocate its memory (ONNX Runtime's "Failed to allocate",
    ``std::bad_alloc``): that pass's call fails, the backend stays usable."""


_ALLOCATION_FAILURES = ("failed to allocate", "bad_alloc", "out of memory",
                        "cannot allocate memory", "memoryerror")


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (from a runtime that raises untyped errors) says memory ran out."""
    if isinstance(exc, MemoryError):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return any(marker in text for marker in _ALLOCATION_FAILURES)


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
    #: a pass holds its attention scores (rows x heads x new x (past + new) floats) at once
    #: (calm's own graph does; ONNX Runtime's GroupQueryAttention does not)
    materializes_attention: bool = True
    #: a multi-position pass with ``last_only`` projects only the last position: (a first
    #: pass, a pass on top of a cache)
    keeps_last_logits: tuple[bool, bool] = (False, False)
    #: the bound on passes over many positions, set by ``CalibratedLM`` from its
    #: ``max_prefill_tokens`` (a :class:`calm_runtime.inference.generation.PrefillBudget`;
    #: ``None``: unbounded)
    prefill_budget: Any = None

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

    def assemble(self, parts, batch: int, width: int) -> Any:
        """One state of ``batch`` rows from states prefilled apart: ``parts`` are
        ``(rows, state)`` pairs, row ``j`` of ``state`` becoming row ``rows[j]``, its cache
        left-padded with zeros to ``width`` positions (the rows' attention masks are 0 there).

        This default takes states that are lists of ``[b, heads, past, head_dim]`` arrays."""
        layers = len(parts[0][1])
        out = []
        for layer in range(layers):
            first = np.asarray(parts[0][1][layer])
            buffer = np.zeros((batch, first.shape[1], width, first.shape[3]), first.dtype)
            for rows, state in parts:
                value = np.asarray(state[layer])
                buffer[rows, :, width - value.shape[2]:] = value
            out.append(buffer)
        return out

    def compact(self, state: Any, order: np.ndarray) -> Any:
        """:meth:`select` of ``order`` for a caller that drops ``state`` afterwards (rows that
        leave a running batch): a backend may reuse ``state``'s buffers, moving only the rows
        that change place. ``order[i] >= i`` and no row twice (the rows that leave replaced
        by later ones)."""
        return self.select(state, order)

    def crop(self, state: Any, start: int) -> Any:
        """``state`` without its first ``start`` cache positions (columns every row pads: the
        attention masks are 0 there). This default takes states that are lists of
        ``[b, heads, past, head_dim]`` arrays."""
        if state is None or start <= 0:
            return state
        return [np.ascontiguousarray(np.asarray(v)[:, :, start:]) for v in state]

    def release(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Give memory cached between passes back to the system; the runtime calls it at
        the end of each generation and scoring call (after dropping its KV states)."""

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

    def crop(self, state, start):
        if state is None or start <= 0:
            return state
        return [t[:, :, start:].contiguous() for t in state]

    def assemble(self, parts, batch, width):
        torch = self._torch
        out = []
        for layer in range(len(parts[0][1])):
            first = parts[0][1][layer]
            buffer = torch.zeros((batch, first.shape[1], width, first.shape[3]),
                                 dtype=first.dtype, device=first.device)
            for rows, state in parts:
                value = state[layer]
                index = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=first.device)
                buffer[index, :, width - value.shape[2]:] = value
            out.append(buffer)
        return out
