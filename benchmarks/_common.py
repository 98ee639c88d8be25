"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import subprocess
from pathlib import Path

import numpy as np

from calm_runtime.data.prompts import CHOICE_MODES

HERE = Path(__file__).resolve().parent


def rewrite_generated_block(readme: str | Path, start: str, end: str, block: str) -> bool:
    """Replace what lies between the ``start`` and ``end`` markers of ``readme`` with
    ``block``; False (nothing written) when the file or a marker is missing."""
    path = Path(readme)
    if not path.is_file():
        return False
    text = path.read_text()
    if start not in text or end not in text:
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(head + start + "\n" + block + "\n" + end + tail)
    return True


def write_model_section(out: Path, stem: str, model: str, section: dict, render) -> str:
    """Add (or replace) ``model``'s section of the JSON results named ``stem`` in the folder
    ``out``, rewrite their Markdown beside them with ``render`` and return that text: the
    results of the benchmarks run once per model."""
    path = Path(out) / f"{stem}.json"
    models = (json.loads(path.read_text()) if path.is_file() else {}).get("models", {})
    models[model] = section
    result = {"models": models}
    path.write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    (Path(out) / f"{stem}.md").write_text(text)
    return text


def chance_accuracy(records) -> float:
    """A uniform guess's expected accuracy on ``records``: the mean of 1/K over the questions
    (ARC's sets hold a few 3- and 5-option questions, where 1/max K would set chance too low)."""
    return float(np.mean([1.0 / len(r.choices) for r in records]))


def fill_chance(sets: dict, load, n_of) -> None:
    """Give each set entry of a part made before chance was recorded its ``chance`` from the
    records it was read on: ``load(names)`` -> ``{name: records}``, ``n_of(entry)`` the
    number of questions the entry holds (a set that no longer matches is an error)."""
    missing = [name for name, entry in sets.items() if "chance" not in entry]
    if not missing:
        return
    for name, records in load(missing).items():
        if len(records) != n_of(sets[name]):
            raise SystemExit(f"{name}: the part holds {n_of(sets[name])} questions, the set "
                             f"{len(records)}; remake the part")
        sets[name]["chance"] = chance_accuracy(records)


def git_commit() -> str:
    """The short commit hash the benchmark ran on (named in every result file), with
    ``+uncommitted`` when tracked files other than result files differ from it: a number
    measured on code no commit holds says so."""
    try:
        commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(HERE), "status", "--porcelain", "--untracked-files=no", "--",
             ":/", ":(exclude,top)benchmarks/results", ":(exclude,top)research/results"],
            capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}+uncommitted" if changed else commit


#: an absolute path of the machine that ran a benchmark (its home, temporary and work
#: folders): what a result file must not name
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:tmp|var/tmp|root|work|opt|mnt|srv|"
                          r"home/[^/\s'\"`]+|Users/[^/\s'\"`]+)(?:/[^\s'\"`,;|)]*)?")


def portable(text: str) -> str:
    """``text`` with every machine path named by its last part (``/work/adapters/lora-60``
    -> ``lora-60``; a folder the reader has of their own), so that a command a result file
    quotes names no folder of the machine that ran it."""
    def last(match: re.Match) -> str:
        parts = [p for p in match.group(0).split("/") if p]
        return parts[-1] if parts else "DIR"
    return MACHINE_PATH.sub(last, text)


def command_line(script: str, argv) -> str:
    """The command a result file names: ``python benchmarks/SCRIPT ARGS``, its machine paths
    named by their last part (:func:`portable`)."""
    import shlex
    import sys

    args = argv if argv is not None else sys.argv[1:]
    # quoted: runnable as is, with the reader's own folders of those names
    return portable(f"python benchmarks/{script} {shlex.join(args)}".strip())


def model_pair_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the options of a model-and-reference run on one data set: ``--model``,
    ``--reference``, ``--data`` and ``--mode`` (the project's small models on ARC-Easy)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--reference", default="gemma-3-270m")
    parser.add_argument("--data", default="arc-easy")
    parser.add_argument("--mode", default="cloze", choices=list(CHOICE_MODES))
    return parser


# ---------------------------------------------------------------- clustered resampling
#
# A benchmark whose items come in clusters (the answer positions of one question, the
# questions of one training seed) must resample the clusters: positions of one question are
# not independent draws, so an interval over positions is too narrow. The functions below
# draw whole clusters with replacement (percentile bootstrap, deterministic for a seed).


def cluster_resamples(clusters, n_clusters: int | None = None, *, n_resamples: int = 1000,
                      seed: int = 0):
    """Yield ``n_resamples`` weight vectors over the rows: row ``i`` gets the number of times
    its cluster ``clusters[i]`` was drawn when ``n_clusters`` clusters (default: one more than
    the largest id; clusters without rows count, they are drawn and contribute nothing) are
    resampled with replacement."""
    import numpy as np

    ids = np.asarray(clusters, dtype=np.int64).reshape(-1)
    if ids.size and ids.min() < 0:
        raise ValueError("cluster ids must be non-negative")
    total = int(ids.max()) + 1 if n_clusters is None else int(n_clusters)
    if total <= 0:
        raise ValueError("no clusters to resample")
    if ids.size and ids.max() >= total:
        raise ValueError(f"cluster id {int(ids.max())} outside the {total} clusters")
    rng = np.random.default_rng(seed)
    for _ in range(n_resamples):
        counts = np.bincount(rng.integers(0, total, size=total), minlength=total)
        yield counts[ids]


def cluster_bootstrap_interval(metric_fn, clusters, *arrays, n_clusters: int | None = None,
                               n_resamples: int = 1000, confidence: float = 0.95,
                               seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``metric_fn(*arrays)`` when whole clusters are resampled: each
    resample repeats every row as often as its cluster was drawn (paired across ``arrays``).
    Resamples with no row, or where the metric is not finite, drop out."""
    import numpy as np

    data = [np.asarray(a) for a in arrays]
    if not data or len({len(a) for a in data} | {len(np.asarray(clusters))}) != 1:
        raise ValueError("one cluster id per row of every array")
    stats = []
    for weights in cluster_resamples(clusters, n_clusters, n_resamples=n_resamples, seed=seed):
        if not weights.any():
            continue
        idx = np.repeat(np.arange(len(weights)), weights)
        stats.append(float(metric_fn(*(a[idx] for a in data))))
    stats = np.asarray(stats)
    stats = stats[np.isfinite(stats)]
    if stats.size == 0:
        return float("nan"), float("nan")
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(stats, [tail, 100.0 - tail])
    return float(low), float(high)


def temperature_interval(logits, target_scores, clusters, *, temperature: float,
                         n_clusters: int | None = None, n_resamples: int = 1000,
                         confidence: float = 0.95, seed: int = 0, span: float = 4.0,
                         points: int = 81, chunk_rows: int = 32) -> dict:
    """Bootstrap interval of a fitted temperature over its clusters (questions).

    The scalar fits (``calm_runtime.temperature``) minimise ``mean_i[-b t_i + logsumexp(b z_i)]``
    over ``b = 1/T`` (``t_i = target_scores[i]``: the target's logit for temperature
    scaling, ``p_ref . z_i`` for DACA). Its derivative is ``mean_i[E_{softmax(b z_i)} z_i -
    t_i]``, increasing in ``b``. Each row's term is evaluated once on a grid of ``b`` from
    ``1/(span T)`` to ``span/T`` (``points`` log-spaced values); a resample's optimum is the
    root of the weighted sum of those curves (its rows weighted by how often their cluster was
    drawn), linearly interpolated between grid points, so the 1,000 refits cost one pass over
    the logits per grid point. A root beyond the grid is reported at the grid's end and
    counted in ``beyond_grid``; ``refit`` is the all-ones weighting (the point estimate on the
    grid, a check against ``temperature``)."""
    import numpy as np

    z = np.asarray(logits)
    t = np.asarray(target_scores, dtype=np.float64).reshape(-1)
    if z.ndim != 2 or z.shape[0] != t.shape[0] or z.shape[0] != len(np.asarray(clusters)):
        raise ValueError("one target score and one cluster id per logit row")
    if not (np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"the fitted temperature must be finite and positive, got {temperature}")
    betas = np.exp(np.linspace(np.log(1.0 / (span * temperature)),
                               np.log(span / temperature), points))
    curves = np.empty((z.shape[0], points))  # d/db of each row's term at each grid point
    for start in range(0, z.shape[0], chunk_rows):
        rows = np.asarray(z[start:start + chunk_rows], dtype=np.float64)
        for g, b in enumerate(betas):
            e = b * rows
            e = np.exp(e - e.max(axis=1, keepdims=True))
            curves[start:start + len(rows), g] = (e * rows).sum(axis=1) / e.sum(axis=1)
    curves -= t[:, None]

    def root(weights) -> tuple[float, bool]:
        d = weights @ curves
        if d[0] >= 0.0:
            return float(1.0 / betas[0]), True
        if d[-1] <= 0.0:
            return float(1.0 / betas[-1]), True
        k = int(np.flatnonzero(d > 0.0)[0])
        b = betas[k - 1] + (betas[k] - betas[k - 1]) * (-d[k - 1]) / (d[k] - d[k - 1])
        return float(1.0 / b), False

    refit, _ = root(np.ones(z.shape[0]))
    temps, beyond = [], 0
    for weights in cluster_resamples(clusters, n_clusters, n_resamples=n_resamples, seed=seed):
        if not weights.any():
            continue
        value, outside = root(weights.astype(np.float64))
        temps.append(value)
        beyond += outside
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(np.asarray(temps), [tail, 100.0 - tail])
    return {"ci95": [float(low), float(high)], "refit": refit, "resamples": len(temps),
            "beyond_grid": int(beyond), "grid": [float(1.0 / betas[-1]), float(1.0 / betas[0])]}


def trained_adapter(config, out: str | Path, *, retrain: bool = False, progress: bool = True):
    """The `calm train` adapter in ``out`` if it was trained with ``config``'s settings (a
    ``CalmConfig``), else one trained now (``retrain``: always)."""
    from calm_runtime.errors import CalmError
    from calm_runtime.formats.artifact import MANIFEST_NAME, CalibrationAdapter
    from calm_training.methods.calm import latest_checkpoint, train_calm

    out = Path(out)
    resume = False
    if not retrain and (out / MANIFEST_NAME).is_file():
        try:
            adapter = CalibrationAdapter.from_pretrained(out)
        except CalmError as exc:
            logging.getLogger(__name__).warning("training again: %s", exc)
        else:
            same = adapter.method.get("settings") == json.loads(json.dumps(config.to_dict()))
            # finished: T's record written (a run stopped before it left none, or "pending")
            if same and not (adapter.method.get("daca") or {"pending": True}).get("pending"):
                logging.getLogger(__name__).warning("reusing %s (trained with these settings)",
                                                    out)
                return adapter
            resume = same and latest_checkpoint(out.with_name(out.name + ".checkpoints")) \
                is not None
            if resume:  # trained, stopped before T: finish it from the final checkpoint
                logging.getLogger(__name__).warning("finishing %s from its checkpoint", out)
    train_calm(config, out, resume=resume, overwrite=True, progress=progress)
    return CalibrationAdapter.from_pretrained(out)


def machine() -> dict:
    """The machine a benchmark ran on: cores, CPU model, memory (GiB) and system."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory = round(pages * size / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {"cores": os.cpu_count(), "cpu": model, "memory_gib": memory,
            "system": f"{platform.system()} {platform.machine()}"}
