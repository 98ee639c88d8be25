"""Serving needs numpy, onnxruntime and tokenizers only: torch (and transformers) blocked.

A fresh interpreter installs a ``sys.meta_path`` finder that refuses ``torch`` (and, in the
second case, ``onnxruntime`` too) before anything from calm is imported, then loads the
test engine and generates / scores on the ONNX Runtime backend.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("onnxruntime")

CHILD = r'''
import importlib.abc
import json
import sys

BLOCKED = tuple(sys.argv[2].split(","))
ATTEMPTS = []


class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in BLOCKED:
            ATTEMPTS.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


sys.meta_path.insert(0, Block())

import calm_runtime
from calm_runtime import BackendUnavailableError, CalibratedLM

report = {"import_attempts": list(ATTEMPTS)}
try:
    lm = CalibratedLM.load(sys.argv[1])
except BackendUnavailableError as exc:
    report["load_error"] = str(exc)
else:
    out = lm.generate("Question: What is 2 + 2?\nAnswer:", max_new_tokens=5, top_alternatives=2)
    sampled = lm.generate(["Hi", "Hello there"], max_new_tokens=4, temperature=0.8, seed=1)
    report["tokens"] = out.token_ids
    report["confidence"] = out.sequence_confidence
    report["stream"] = [t.id for t in lm.stream("Question: What is 2 + 2?\nAnswer:",
                                                max_new_tokens=5)]
    report["sampled"] = [g.token_ids for g in sampled]
    report["choice"] = lm.choose("Which is prime?", ["4", "7", "9"]).probabilities.tolist()
    report["letter"] = lm.choose("Which is prime?", ["4", "7"], mode="letter").confidence
    report["p_true"] = lm.p_true("What is 2 + 2?", "4")
report["blocked_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
report["transformers_loaded"] = "transformers" in sys.modules
print(json.dumps(report))
'''


def _child(engine, blocked: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(engine), blocked],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_generation_and_scoring_without_torch(runtime_engine):
    from calm_runtime import CalibratedLM

    report = _child(runtime_engine[2], "torch")
    assert report["import_attempts"] == [], report["import_attempts"]
    assert report["blocked_loaded"] == [] and report["transformers_loaded"] is False
    lm = CalibratedLM.load(runtime_engine[2])  # the same calls in this (torch) process
    out = lm.generate("Question: What is 2 + 2?\nAnswer:", max_new_tokens=5)
    assert report["tokens"] == out.token_ids == report["stream"]
    assert report["confidence"] == pytest.approx(out.sequence_confidence, rel=1e-6)
    sampled = lm.generate(["Hi", "Hello there"], max_new_tokens=4, temperature=0.8, seed=1)
    assert report["sampled"] == [g.token_ids for g in sampled]
    assert report["choice"] == pytest.approx(
        lm.choose("Which is prime?", ["4", "7", "9"]).probabilities.tolist(), abs=1e-7)
    assert report["p_true"] == pytest.approx(lm.p_true("What is 2 + 2?", "4"), abs=1e-7)


def test_import_without_onnxruntime_then_a_clear_error(runtime_engine):
    report = _child(runtime_engine[2], "torch,onnxruntime")
    assert report["import_attempts"] == []
    assert report["load_error"].startswith("onnxruntime is not installed")
    assert "\n" not in report["load_error"]


def test_server_package_without_the_serve_extra_names_it():
    """Without FastAPI the server's settings still import (``calm serve --help``, a config
    check); the app itself is one line naming the extra to install."""
    child = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, fullname, path=None, target=None):\n"
        "        if fullname.split('.')[0] == 'fastapi':\n"
        "            raise ModuleNotFoundError(fullname, name=fullname)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from calm_runtime import BackendUnavailableError\n"
        "from calm_runtime.server import ServeConfig\n"
        "assert ServeConfig(engine='e').served_name\n"
        "try:\n"
        "    from calm_runtime.server import create_app\n"
        "except BackendUnavailableError as exc:\n"
        "    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("calm_runtime.server needs the serve extra (fastapi not "
                                   "installed); install it with pip install 'calm-llm[serve]' "
                                   "(from a checkout: pip install -e '.[serve]')")
