"""The progress of ``calm-export``'s stages: one log line per stage, one tqdm bar (stderr, a
terminal only), and a heartbeat while a stage runs, so a long stage is never silent."""

from __future__ import annotations

import logging
import sys
import threading
import time

__all__ = ["HEARTBEAT_S", "StageProgress"]

logger = logging.getLogger(__name__)

#: seconds between the heartbeat's log lines while a stage runs (no terminal)
HEARTBEAT_S = 30.0

class StageProgress:
    """Logs each stage and moves one tqdm bar (stderr, a terminal only) along; while a stage
    runs, a heartbeat shows its elapsed time every :data:`HEARTBEAT_S` seconds (on the bar in
    a terminal, as a log line otherwise), so a long stage is never silent."""

    def __init__(self, names, progress: bool) -> None:
        from tqdm.auto import tqdm

        self.names = list(names)
        self.progress = progress
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=len(self.names), desc="calm-export", unit="stage",
                        disable=not (progress and self.tty), leave=False)
        self.seconds: dict[str, float] = {}
        self._name, self._start = None, 0.0
        self._stop = threading.Event()
        self._beat = None
        if progress:
            self._beat = threading.Thread(target=self._heartbeat, name="calm-export-heartbeat",
                                          daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        interval = HEARTBEAT_S if not self.tty else 1.0
        last_log = time.perf_counter()
        while not self._stop.wait(interval):
            name, start = self._name, self._start
            if name is None:
                continue
            elapsed = time.perf_counter() - start
            if self.tty:
                self.bar.set_postfix_str(f"{name} {elapsed:.0f} s")
            elif time.perf_counter() - last_log >= HEARTBEAT_S:
                last_log = time.perf_counter()
                logger.info("stage %s: running for %.0f s", name, elapsed)

    def start(self, name: str) -> None:
        self.finish()
        self._name, self._start = name, time.perf_counter()
        self.bar.set_postfix_str(name)
        logger.info("stage %d/%d: %s", self.names.index(name) + 1, len(self.names), name)

    def finish(self) -> None:
        if self._name is not None:
            self.seconds[self._name] = round(time.perf_counter() - self._start, 3)
            self.bar.update(1)
            self._name = None

    def close(self) -> None:
        self.finish()
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2)
        self.bar.close()
