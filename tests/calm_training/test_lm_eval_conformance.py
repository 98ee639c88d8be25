"""calm's cloze scores equal lm-evaluation-harness's, measured by running the real harness
offline on a local task file whose prompt is calm's cloze prompt; and a comparison fitted
from the harness's sample logs equals the one fitted from calm's own scoring.

Needs the harness (the ``lmeval`` extra): the ``lm_eval`` command on PATH, or its path in
``CALM_LM_EVAL`` (CI installs it in a virtual environment of its own). Skipped without it.
The tiny-model test runs wherever the harness is; the real-model one (SmolLM2 on the first
200 ARC-Easy questions, with 4 and 5 options; the benchmark ``lm_eval_logs`` compares all
570) is marked ``real_model``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

pytest.importorskip("torch")

from conftest import write_mc_jsonl  # noqa: E402

from calm_runtime.data.sets import load_dataset  # noqa: E402
from calm_training.fit import compare_methods  # noqa: E402
from calm_training.posthoc.fit_config import FitConfig  # noqa: E402
from calm_training.scoring.lm_eval_logs import cloze_task, read_samples  # noqa: E402

LM_EVAL = os.environ.get("CALM_LM_EVAL") or shutil.which("lm_eval")
pytestmark = [pytest.mark.usefixtures("private_calm_cache"),
              pytest.mark.skipif(LM_EVAL is None, reason="lm-evaluation-harness is not "
                                 "installed (the lmeval extra, or CALM_LM_EVAL=path/to/lm_eval)")]
#: calm's cloze scores and the harness's log-likelihoods agree to float32 rounding
TOLERANCE = 1e-4
#: the real-model test's questions: the first 200 of ARC-Easy's validation split
REAL_QUESTIONS = 200


def harness_log(model_dir, data, root, name="calm_mc", limit=None):
    """Run ``lm_eval --log_samples`` offline on ``data`` (calm's JSONL) with ``model_dir``;
    return the samples file it wrote."""
    tasks = root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / f"{name}.yaml").write_text(cloze_task(name, data))
    out = root / "out"
    command = [LM_EVAL, "--model", "hf", "--model_args",
               f"pretrained={model_dir},dtype=float32", "--tasks", name, "--include_path",
               str(tasks), "--device", "cpu", "--batch_size", "8", "--log_samples",
               "--output_path", str(out)]
    if limit:
        command += ["--limit", str(limit)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = sorted(out.rglob(f"samples_{name}_*.jsonl"))
    assert len(found) == 1, found
    return found[0]


def _calm_scores(model_dir, records):
    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_training.scoring.local import score_multiple_choice

    model, tokenizer, _ = load_model_and_tokenizer(model_dir)
    return score_multiple_choice(model, tokenizer, records, mode="cloze", progress=False)


def test_the_harness_scores_what_calm_scores(tmp_path, tiny_llama_tied, tiny_llama_untied):
    data = write_mc_jsonl(tmp_path / "mc.jsonl", n=40, options=(4, 3, 5))
    records = load_dataset(str(data))
    logs = {}
    for role, folder in (("model", tiny_llama_tied), ("reference", tiny_llama_untied)):
        logs[role] = harness_log(folder, data, tmp_path / role)
        harness = read_samples(logs[role])
        ours = _calm_scores(folder, records)
        assert [r.answer for r in harness.records] == [r.answer for r in records]
        diff = float(np.nanmax(np.abs(harness.sums - ours.values)))
        assert diff < TOLERANCE, f"{role}: max |calm - harness| = {diff:.2e}"
        rows = json.loads(logs[role].read_text().splitlines()[0])
        assert rows["target"] == str(records[0].answer)
    own = FitConfig(model=str(tiny_llama_tied), reference=str(tiny_llama_untied), data=str(data),
                    variant="sum", bootstrap=0)
    from_logs = FitConfig(model=str(tiny_llama_tied), reference=str(tiny_llama_untied),
                          data=f"lm-eval:{logs['model']}", variant="sum", bootstrap=0,
                          model_scores=f"lm-eval:{logs['model']}",
                          reference_scores=f"lm-eval:{logs['reference']}")
    a = compare_methods(own, ("vanilla", "naive", "daca", "ts"), progress=False)
    b = compare_methods(from_logs, ("vanilla", "naive", "daca", "ts"), progress=False)
    for method in ("naive", "daca", "ts"):
        assert b["methods"][method]["fit"]["temperature"] == pytest.approx(
            a["methods"][method]["fit"]["temperature"], abs=1e-3), method


@pytest.mark.real_model
def test_the_harness_scores_what_calm_scores_on_smollm2_and_arc_easy(tmp_path):
    from calm_runtime.data.models import install_model
    from calm_runtime.data.sets import install_dataset

    folder = install_model("smollm2-135m-instruct")
    data = install_dataset("arc-easy")
    log = read_samples(harness_log(folder, data, tmp_path, "calm_arc", limit=REAL_QUESTIONS))
    records = load_dataset("arc-easy")[:REAL_QUESTIONS]
    assert {len(r.choices) for r in records} == {4, 5}  # options of two counts, padded
    ours = _calm_scores(folder, records)
    diff = float(np.nanmax(np.abs(log.sums - ours.values)))
    assert diff < TOLERANCE, f"max |calm - harness| = {diff:.2e} on {len(log.records)} questions"
