"""Every number the README and docs/results.md state comes from a committed result file.

docs/results.md and the README's results table are rendered from ``benchmarks/results/`` by
``benchmarks/render_results.py`` (the first test holds them to that rendering); the second
test reads every number in the prose and tables of both pages (not in code, not in link
targets) and finds it in a result file: written there, or the rounding of a value of its
JSON. A number typed by hand into either page fails it unless a result file has it.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", ROOT / "docs" / "results.md"]

# a number standing alone: not inside a name (gemma-3-270m, SmolLM2-135M, §3, v1), with
# thousands separators (1,570); a sign before it is dropped (intervals hold both signs)
NUMBER = re.compile(r"(?<![\w.§])(?<![A-Za-z_]-)(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)"
                    r"(?![\w]|\.\d|-[A-Za-z_])")
RAW_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def canonical(text: str) -> str:
    """``1,570`` -> ``1570``, ``0.50`` -> ``0.5``, ``007`` -> ``7``."""
    text = text.replace(",", "")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text.lstrip("0") or "0" if not text.startswith("0.") else text


def prose(text: str) -> str:
    """The text a reader reads as statements: without fenced and inline code, HTML comments
    and link targets."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def _json_values(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _json_values(item)
    elif isinstance(value, list):
        for item in value:
            yield from _json_values(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


@functools.lru_cache(maxsize=1)
def available_numbers() -> frozenset[str]:
    """Every number in the result files' text, and every JSON value rounded to 0-4 decimals
    (and, for a share, as a percentage). The per-run parts folders are left out: their
    summaries are in the result files beside them."""
    found: set[str] = set()
    for path in sorted(RESULTS.glob("*")):
        if path.suffix not in (".md", ".json") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        found.update(canonical(t) for t in RAW_NUMBER.findall(text))
        found.update(canonical(t) for t in re.findall(r"\d{1,3}(?:,\d{3})+", text))
        if path.suffix == ".json":
            for value in set(_json_values(json.loads(text))):
                if value != value or abs(value) == float("inf"):
                    continue
                value = abs(value)
                for digits in range(5):
                    found.add(canonical(f"{value:.{digits}f}"))
                    if value <= 1:  # a share quoted as a percentage
                        found.add(canonical(f"{100 * value:.{digits}f}"))
    return frozenset(found)


def stated_numbers(path: Path) -> list[str]:
    return [m.group(1) for m in NUMBER.finditer(prose(path.read_text(encoding="utf-8")))]


def test_the_number_scan_reads_what_it_should():
    text = ("DACA 0.041 [0.029, -0.076] on 1,570 questions of gemma-3-270m (SmolLM2-135M, §3), "
            "1.09 (0.92-1.15) and `calm --limit 100` in [a](https://x2.example) <!-- 77 -->")
    assert NUMBER.findall(prose(text)) == ["0.041", "0.029", "0.076", "1,570", "1.09", "0.92",
                                            "1.15"]


def test_pages_are_rendered_from_the_result_files():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for path, text in render_results.rendered().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(ROOT)} is stale; run python benchmarks/render_results.py")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_comes_from_a_result_file(page):
    available = available_numbers()
    stated = stated_numbers(page)
    assert len(stated) > 20  # the scan must not pass by finding nothing
    missing = sorted({n for n in stated if canonical(n) not in available})
    assert not missing, (f"{page.relative_to(ROOT)} states numbers no file in "
                         f"benchmarks/results/ holds: {missing}")
