"""The progress of ``calm-export``'s stages: one log line per stage, one tqdm bar (stderr, a
terminal only), and a heartbeat while a stage runs, so a long stage is never silent."""

from __future__ import annotations

import logging
import sys
import threading
import time

__all__ = ["HEARTBEAT_S", "StageProgress", "peak_rss_bytes", "reset_peak_rss"]

logger = logging.getLogger(__name__)

#: seconds between the heartbeat's log lines while a stage runs (no terminal)
HEARTBEAT_S = 30.0

def reset_peak_rss() -> bool:
    """Start a new peak-RSS window for this process (Linux: ``/proc/self/clear_refs``);
    ``False`` where it cannot, and the peak then counts from the process's start."""
    try:
        with open("/proc/self/clear_refs", "w") as sink:
            sink.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size since the last :func:`reset_peak_rss` (Linux:
    ``VmHWM``), else since it started (``getrusage``); ``None`` where neither is known."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return None


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
        #: each finished stage's peak resident set size, in MB (the process's, so a stage's
        #: peak includes what earlier stages still hold)
        self.peak_rss_mb: dict[str, float] = {}
        self._windows = True
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

    def skip(self, name: str) -> None:
        """``name`` will not run (decided once the model's settings are read)."""
        if name in self.names:
            self.names.remove(name)
            self.bar.total = len(self.names)

    def start(self, name: str) -> None:
        self.finish()
        self._windows = reset_peak_rss() and self._windows
        self._name, self._start = name, time.perf_counter()
        self.bar.set_postfix_str(name)
        logger.info("stage %d/%d: %s", self.names.index(name) + 1, len(self.names), name)

    def finish(self) -> None:
        if self._name is not None:
            name = self._name
            self.seconds[name] = round(time.perf_counter() - self._start, 3)
            peak = peak_rss_bytes()
            if peak is not None:
                self.peak_rss_mb[name] = round(peak / 1e6, 1)
                logger.info("stage %s: %.1f s, peak RSS %.0f MB", name, self.seconds[name],
                            peak / 1e6)
            self.bar.update(1)
            self._name = None

    def report(self) -> dict:
        """The stages' wall times and peak RSS so far (the manifest's ``export.stages``)."""
        return {"seconds": dict(self.seconds), "peak_rss_mb": dict(self.peak_rss_mb),
                "peak_rss_per_stage": self._windows}

    def close(self) -> None:
        self.finish()
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2)
        self.bar.close()
