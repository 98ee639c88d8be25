"""calm_runtime works where torch is not installed (torch is a lazy, optional backend).

A fresh interpreter blocks ``torch`` and ``torch.*`` with a ``sys.meta_path`` finder that is
installed before anything from calm is imported, then imports the runtime modules, runs an
adapter save/load round trip and the metrics, and reports back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import importlib.abc
import json
import sys

ATTEMPTS = []


class BlockTorch(importlib.abc.MetaPathFinder):
    """Behave as if torch were not installed, and record who asked for it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch" or fullname.startswith("torch."):
            ATTEMPTS.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


assert "torch" not in sys.modules and "calm_runtime" not in sys.modules
sys.meta_path.insert(0, BlockTorch())

import numpy as np

import calm_runtime
import calm_runtime.data.sets
import calm_runtime.measure.metrics
import calm_runtime.data.models
import calm_runtime.data.prompts
from calm_runtime import CalibrationAdapter, ModelIdentity

report = {"import_attempts": list(ATTEMPTS)}

# adapter round trip (numpy and safetensors only)
out = sys.argv[1]
vocab = 8
tau = np.linspace(0.5, 2.0, vocab, dtype=np.float32)
shift = np.linspace(-1.0, 1.0, vocab, dtype=np.float32)
adapter = CalibrationAdapter(base_model=ModelIdentity("m", vocab, None), tau=tau, shift=shift,
                             temperature=1.5, kind="daca", metrics={"ece": 0.1})
adapter.save_pretrained(out)
loaded = CalibrationAdapter.from_pretrained(out)
logits = np.arange(2 * vocab, dtype=np.float32).reshape(2, vocab)
report["round_trip"] = bool(np.array_equal(loaded.tau, tau)
                            and np.array_equal(loaded.shift, shift)
                            and loaded.temperature == 1.5 and loaded.metrics == {"ece": 0.1}
                            and np.array_equal(loaded.calibrate(logits),
                                               adapter.calibrate(logits)))
weight = np.ones((vocab, 3), np.float32)
new_w, new_b = loaded.fused_head(weight)
report["fused_head"] = bool(isinstance(new_w, np.ndarray) and new_b.shape == (vocab,))

# metrics
conf = np.array([0.0, 0.2, 0.25, 0.6, 0.8, 1.0, 1.0, 0.9])
correct = np.array([0, 0, 1, 1, 1, 1, 0, 1])
report["ece"] = calm_runtime.measure.metrics.ece(conf, correct, n_bins=4)
probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
report["calibration_report"] = calm_runtime.measure.metrics.calibration_report(probs,
                                                                       np.array([0, 1, 0]))

report["attempts_before_models_call"] = list(ATTEMPTS)
try:
    calm_runtime.data.models._import_torch_transformers()
except BaseException as exc:  # any type is reported; the parent wants ModelSourceError
    report["models_error"] = [type(exc).__name__, str(exc)]
else:
    report["models_error"] = None

report["torch_modules"] = sorted(m for m in sys.modules
                                 if m == "torch" or m.startswith("torch."))
report["transformers_loaded"] = "transformers" in sys.modules
print(json.dumps(report))
'''

HAND_ECE = 0.20625  # the hand-computed 4-bin case in test_metrics.py


def _run_without_torch(tmp_path: Path) -> dict:
    env = dict(os.environ, CALM_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "adapter")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_runtime_works_without_torch(tmp_path: Path):
    report = _run_without_torch(tmp_path)
    assert report["import_attempts"] == [], (
        f"importing calm_runtime tried to import {report['import_attempts']}")
    assert report["round_trip"] is True
    assert report["fused_head"] is True
    assert abs(report["ece"] - HAND_ECE) < 1e-12
    assert report["calibration_report"]["n"] == 3
    assert abs(report["calibration_report"]["accuracy"] - 2 / 3) < 1e-12
    assert report["attempts_before_models_call"] == []
    assert report["torch_modules"] == []
    assert report["transformers_loaded"] is False
    assert (tmp_path / "adapter" / "calm_adapter.json").is_file()

    name, message = report["models_error"]
    assert name == "ModelSourceError", f"expected ModelSourceError, got {name}: {message}"
    assert "torch is not installed" in message
    assert "train extra" in message and "calm-llm[train]" in message
    assert "\n" not in message
