"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from calm_runtime.prompts import CHOICE_MODES

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


def git_commit() -> str:
    """The short commit hash the benchmark ran on (named in every result file)."""
    try:
        return subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line(script: str, argv) -> str:
    """The command a result file names: ``python benchmarks/SCRIPT ARGS``."""
    import shlex
    import sys

    args = argv if argv is not None else sys.argv[1:]
    return f"python benchmarks/{script} {shlex.join(args)}".strip()  # quoted: runnable as is


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
