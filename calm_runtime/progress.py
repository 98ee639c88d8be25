"""Progress of long work: a bar on a terminal, log lines elsewhere.

A command run from a script, a CI job or ``nohup`` writes to a file, where a progress bar is
a stream of carriage returns and nothing at all is worse: a user who scored 500 questions
for five minutes saw no sign of life. :func:`progress` gives a ``tqdm`` bar when asked for
one and stderr is a terminal, and otherwise an object with the same ``update``/``close``
interface that logs one INFO line each time another tenth of the work is done (``-q`` sets
the log level to WARNING, which hides them).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator

__all__ = ["LoggedProgress", "progress"]

logger = logging.getLogger("calm_runtime.progress")

#: a line each time this share of the work is done
STEP = 0.1


class LoggedProgress:
    """``tqdm``'s ``update``/``close`` interface writing INFO log lines: one per tenth of
    ``total`` (rounded to whole units) and one at the end, each with the elapsed time."""

    def __init__(self, total: int, desc: str, unit: str, iterable: Iterable | None = None):
        self.total, self.desc, self.unit = int(total), desc, unit
        self.iterable = iterable
        self.n = 0
        self._start = time.monotonic()
        self._next = self._step()
        self._closed = False

    def _step(self) -> int:
        return self.n + max(1, round(self.total * STEP))

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self._next and self.n < self.total:
            self._log()
            self._next = self._step()

    def _log(self) -> None:
        share = f" ({self.n / self.total:.0%})" if self.total else ""
        logger.info("%s: %d of %d %s%s, %.0f s", self.desc, self.n, self.total,
                    self.unit if self.total == 1 else _plural(self.unit), share,
                    time.monotonic() - self._start)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.total and self.n >= self.total:
                self._log()

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()


def _plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("ch", "sh", "s", "x")) else "s")


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str,
             unit: str = "item", bar: bool = True):
    """A progress bar (``bar`` and stderr a terminal) or log lines (otherwise) over
    ``iterable`` or ``total`` units; use ``update(n)`` and ``close()`` as with ``tqdm``."""
    if total is None:
        total = len(iterable)  # type: ignore[arg-type]
    if bar and sys.stderr.isatty():
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not total)
    return LoggedProgress(total, desc, unit, iterable)
