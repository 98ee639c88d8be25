"""benchmarks/gpu_check.sh on a machine without a GPU: every GPU step is skipped with one
line saying why, the CPU steps run, and the result file records them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_mc_jsonl

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_its_cpu_steps_and_skips_the_gpu_ones(tiny_llama_untied,
                                                                 tiny_llama_tied, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script runs its GPU steps for real")
    data = write_mc_jsonl(tmp_path / "mc.jsonl")
    env = dict(os.environ, CALM_GPU_CHECK_OUT=str(tmp_path / "out"),
               CALM_GPU_CHECK_MODEL=str(tiny_llama_untied), CALM_GPU_CHECK_DATA=str(data),
               CALM_GPU_CHECK_REFERENCE=str(tiny_llama_tied), CALM_GPU_CHECK_LIMIT="40",
               CALM_GPU_CHECK_INSTALL="0", CALM_GPU_CHECK_PYTHON=sys.executable,
               CALM_CACHE=str(tmp_path / "cache"))
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    steps = {s["step"]: s for s in result["steps"]}
    for name in ("fit-cuda-bf16", "export-fp16-cuda", "export-tensorrt", "decode-cuda",
                 "install-gpu-packages"):
        assert steps[name]["status"] == "skipped", steps[name]
        assert steps[name]["detail"] and "\n" not in steps[name]["detail"]
    assert steps["fit-cpu-fp32"]["status"] == "ok", steps["fit-cpu-fp32"]
    placement = result["fits"]["adapter-cpu"]["placement"]
    assert placement["model"] == {"dtype": "float32", "device": "cpu"}
    assert result["command"] == "bash benchmarks/gpu_check.sh"
