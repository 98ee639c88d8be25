"""Reliability diagrams as PNG files (docs/methods.md §5).

matplotlib is an optional dependency (the ``plot`` extra) and is imported only when a
diagram is written. The figure is drawn with the Agg canvas directly, without pyplot, so
no global backend is switched and no window is ever opened.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from calm_runtime.errors import BackendUnavailableError, ConfigError
from calm_runtime.measure.metrics import (
    ReliabilityBins,
    aurc,
    auroc,
    reliability_bins,
    risk_coverage,
)

__all__ = ["write_reliability_diagram", "write_risk_coverage"]

logger = logging.getLogger(__name__)

PANEL_SIZE_INCHES = 4.0
DPI = 120


def write_reliability_diagram(path: str | os.PathLike, panels: Mapping[str, tuple[Any, Any]],
                              n_bins: int = 10, title: str | None = None) -> Path:
    """Draw one reliability diagram per panel, side by side, into a PNG at ``path``.

    ``panels`` maps a name (e.g. ``"vanilla"``, ``"DACA"``) to ``(confidences, correct)``:
    ``[N]`` confidences in [0, 1] and ``[N]`` 0/1 correctness flags. Each panel shows the
    per-bin accuracy as bars over ``n_bins`` equal-width bins, the gap to the bin's mean
    confidence, the diagonal of perfect calibration, the example count above each bar, and
    the ECE in its title. The file is written atomically (temporary sibling, then rename).
    Returns the path written.

    Raises:
        ConfigError: no panels, a malformed panel, or invalid confidences/labels.
        BackendUnavailableError: matplotlib is not installed.
    """
    if not panels:
        raise ConfigError("panels is empty; pass a mapping name -> (confidences, correct)")
    binned: dict[str, ReliabilityBins] = {}
    for name, panel in panels.items():
        try:
            confidences, correct = panel
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"panel {name!r} must be a pair (confidences, correct), got "
                              f"{type(panel).__name__}; pass two arrays per panel") from exc
        binned[str(name)] = reliability_bins(confidences, correct, n_bins, "uniform")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise BackendUnavailableError("matplotlib is not installed; install the plot extra: "
                                      "pip install 'calm-llm[plot]'") from exc

    figure = Figure(figsize=(PANEL_SIZE_INCHES * len(binned), PANEL_SIZE_INCHES + 0.6),
                    layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(binned), squeeze=False)[0]
    for axis, (name, bins) in zip(axes, binned.items(), strict=True):
        _draw_panel(axis, name, bins)
    if title:
        figure.suptitle(title)

    target = Path(path)
    _save_png_atomically(figure, target)
    logger.info("wrote reliability diagram %s (%d panels, %d bins)", target, len(binned), n_bins)
    return target


def write_risk_coverage(path: str | os.PathLike, panels: Mapping[str, tuple[Any, Any]],
                        title: str | None = None) -> Path:
    """The risk–coverage curves of every panel on one axis (lower is better), with each
    method's AURC and AUROC in the legend; same panels as :func:`write_reliability_diagram`."""
    if not panels:
        raise ConfigError("panels is empty; pass a mapping name -> (confidences, correct)")
    curves = {}
    for name, (confidences, correct) in panels.items():
        coverage, risk = risk_coverage(confidences, correct)
        curves[str(name)] = (coverage, risk, aurc(confidences, correct),
                             auroc(confidences, correct))
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise BackendUnavailableError("matplotlib is not installed; install the plot extra: "
                                      "pip install 'calm-llm[plot]'") from exc
    figure = Figure(figsize=(PANEL_SIZE_INCHES * 1.4, PANEL_SIZE_INCHES), layout="constrained")
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    for name, (coverage, risk, area, roc) in curves.items():
        axis.plot(coverage, risk, linewidth=1.2,
                  label=f"{name} (AURC {area:.3f}, AUROC {roc:.3f})")
    axis.set_xlim(0.0, 1.0)
    axis.set_ylim(bottom=0.0)
    axis.set_xlabel("coverage (share of answers kept, most confident first)")
    axis.set_ylabel("risk (share of kept answers that are wrong)")
    axis.legend(fontsize=7)
    if title:
        axis.set_title(title, fontsize=10)
    target = Path(path)
    _save_png_atomically(figure, target)
    logger.info("wrote risk-coverage plot %s (%d methods)", target, len(curves))
    return target


def _draw_panel(axis: Any, name: str, bins: ReliabilityBins) -> None:
    """Accuracy bars, gap-to-confidence bars, the diagonal and per-bin counts on one axis."""
    filled = bins.count > 0
    left = bins.lower[filled]
    width = (bins.upper - bins.lower)[filled]
    acc = bins.accuracy[filled]
    conf = bins.confidence[filled]
    axis.bar(left, acc, width=width, align="edge", color="tab:blue", edgecolor="black",
             linewidth=0.6, label="accuracy")
    axis.bar(left, conf - acc, bottom=acc, width=width, align="edge", color="tab:red",
             alpha=0.25, edgecolor="tab:red", linewidth=0.6, label="gap to mean confidence")
    axis.plot([0.0, 1.0], [0.0, 1.0], linestyle="--", color="gray", linewidth=1.0,
              label="perfect calibration")
    for x, w, y, count in zip(left, width, acc, bins.count[filled], strict=True):
        axis.text(x + w / 2.0, min(y + 0.02, 1.02), str(int(count)), ha="center",
                  va="bottom", fontsize=7)
    axis.set_xlim(0.0, 1.0)
    axis.set_ylim(0.0, 1.1)
    axis.set_xlabel("confidence")
    axis.set_ylabel("accuracy")
    axis.set_title(f"{name}\nECE {bins.ece:.4f} (N={bins.n}, {bins.n_bins} bins)", fontsize=10)
    axis.legend(loc="upper left", fontsize=7)


def _save_png_atomically(figure: Any, target: Path) -> None:
    """Render to a temporary sibling file, then rename it over ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(staging, "xb") as handle:
            figure.savefig(handle, format="png", dpi=DPI)
        os.replace(staging, target)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
