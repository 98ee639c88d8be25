"""The ``calm`` command: the entry point and its subcommands (``main``), what ``calm`` and
``calm-export`` share (``common``) and ``calm serve``'s parser (``serve``; its settings are
``calm_runtime.server.config``, importable without the server's dependencies)."""
