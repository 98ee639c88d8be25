"""The README's code blocks run, and its two set-up-and-run commands are the ones CI uses."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
CI = Path(__file__).resolve().parents[1] / ".ci" / "run"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks("python")
    assert blocks
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "__readme__"})


def test_two_commands_match_ci():
    commands = [b.strip() for b in _blocks("bash") if b.strip().startswith("python3 -m venv")]
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert main_job.endswith("calm quickstart") and tests.endswith("pytest -q")
    ci = CI.read_text()
    assert "torch==2.13.0" in main_job and "torch==2.13.0" in tests and "torch==2.13.0" in ci
    extras = re.search(r'-e "\.\[([^\]]+)\]"', tests).group(1)
    assert f'-e ".[{extras}]"' in ci, "CI must install the extras the README's test command does"
    main_extras = re.search(r'-e "\.\[([^\]]+)\]"', main_job).group(1)
    assert f'-e ".[{main_extras}]"' in ci, \
        "CI must install exactly the extras of the README's main command (and run it there)"
    assert ci.index(f'-e ".[{main_extras}]"') < ci.index("calm quickstart") \
        < ci.index(f'-e ".[{extras}]"'), "the quickstart runs before the test extras arrive"
    assert "pytest -q" in ci


def test_readme_is_short_with_install_and_quickstart_first():
    """A newcomer reads it in five minutes: at most 200 lines, Install and the Quickstart
    within the first 60; everything else lives in docs/ (docs/index.md maps it)."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"
    headings = {line: i + 1 for i, line in enumerate(lines) if line.startswith("## ")}
    install = headings.get("## Install")
    quickstart = next((n for h, n in headings.items() if h.startswith("## Quickstart")), None)
    assert install is not None and quickstart is not None, sorted(headings)
    assert install < quickstart <= 60, (install, quickstart)
    order = [h for h in headings if h in ("## Install", "## Using it", "## Results",
                                          "## Documentation") or h.startswith("## Quickstart")]
    assert order[0] == "## Install" and order[1].startswith("## Quickstart"), order
    assert order[2:] == ["## Using it", "## Results", "## Documentation"], order
    assert "docs/index.md" in README.read_text()


def test_readme_sets_no_method_apart():
    """No bolded number: where two intervals overlap the data do not separate the methods."""
    text = README.read_text()
    assert not re.search(r"\*\*[^*\n]*\d\.\d+[^*\n]*\*\*", text)
