"""The interface of a graph strategy (see :mod:`calm_export.graphs`)."""

from __future__ import annotations

from typing import ClassVar


class GraphStrategy:
    #: the ``--graph`` value that names it
    name: ClassVar[str]
    #: validated while the model is still loaded, so that a failure (one of
    #: :attr:`failures`) can fall back to the next candidate under ``--graph auto``
    fallible: ClassVar[bool] = False
    failures: ClassVar[tuple[type[BaseException], ...]] = ()

    def unsupported_because(self, config, model_config=None) -> str | None:
        """Why it cannot build an engine with the export settings ``config`` (and, when
        given, for the model whose transformers config is ``model_config``); ``None``: it
        can."""
        raise NotImplementedError

    def build(self, job) -> dict:
        """Write the graph into ``job.staging``; returns the export facts (``graph``,
        ``exporter``, ``opset``, ``external_data``, ``logits_to_keep``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name
