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
    assert "pytest -q" in ci
