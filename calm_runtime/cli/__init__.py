"""The ``calm`` command: the entry point and its subcommands (``main``), what ``calm`` and
``calm-export`` share (``common``), ``calm serve``'s parser (``serve``) and settings
(``serve_config``, importable without the server's dependencies)."""
