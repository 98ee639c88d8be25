"""``calm generate`` and ``calm score`` on the test engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from calm_runtime import CalibratedLM
from calm_runtime.cli.main import main  # noqa: E402
from calm_runtime.data.sets import MultipleChoiceRecord, OpenQARecord, write_jsonl  # noqa: E402
from calm_runtime.measure import metrics

PROMPT = "Question: What is the capital of France?\nAnswer:"
MC = [MultipleChoiceRecord("Which is prime?", ("4", "7", "9"), answer=1),
      MultipleChoiceRecord("Where do penguins live?", ("the Arctic", "Antarctica", "Paris"),
                           answer=1),
      MultipleChoiceRecord("What colour is grass?", ("green", "red", "blue"), answer=0),
      MultipleChoiceRecord("2 + 2 =", ("3", "4", "22"), answer=1)]
QA = [OpenQARecord("Who wrote Hamlet?", ("Shakespeare", "William Shakespeare")),
      OpenQARecord("What is the capital of France?", ("Paris",)),
      OpenQARecord("What is 2 + 2?", ("4", "four"))]


@pytest.fixture(scope="module")
def lm(runtime_engine):
    return CalibratedLM.load(runtime_engine[2])


def test_generate_prints_tokens_with_confidences(runtime_engine, lm, capsys):
    assert main(["-q", "generate", str(runtime_engine[2]), PROMPT, "--max-new-tokens", "5",
                 "--temperature", "1", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    want = lm.generate(PROMPT, max_new_tokens=5, temperature=1.0, seed=3)
    assert out.startswith(want.text + "\n")
    assert "tokens [calibrated probability; test]:" in out
    assert f"{want.tokens[0].confidence:.0%}]" in out
    assert f"sequence confidence {want.sequence_confidence:.3f}" in out


def test_generate_json(runtime_engine, lm, capsys):
    assert main(["-q", "generate", str(runtime_engine[2]), PROMPT, "--max-new-tokens", "4",
                 "--top", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = lm.generate(PROMPT, max_new_tokens=4, top_alternatives=2)
    assert [t["id"] for t in data["tokens"]] == want.token_ids
    assert data["sequence_confidence"] == pytest.approx(want.sequence_confidence)
    assert len(data["tokens"][0]["top"]) == 2 and data["finish_reason"] == "length"


@pytest.mark.parametrize("mode", ["cloze", "letter"])
def test_score_multiple_choice(runtime_engine, lm, tmp_path, capsys, mode):
    data = write_jsonl(tmp_path / "mc.jsonl", MC)
    report_path = tmp_path / "report.json"
    assert main(["-q", "score", str(runtime_engine[2]), "--data", str(data), "--part", "all",
                 "--mode", mode, "--bins", "5", "--out", str(report_path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    choices = lm.choose_batch([r.question for r in MC], [r.choices for r in MC], mode)
    want = metrics.calibration_report(np.stack([c.probabilities for c in choices]),
                                      np.array([r.answer for r in MC]), n_bins=5)
    assert report["metrics"] == pytest.approx(want)
    assert report["kind"] == "multiple_choice" and report["mode"] == mode
    assert f"| calibrated engine | {want['accuracy']:.3f} | {want['ece']:.3f} |" in printed
    assert f"wrote {report_path}" in printed


def test_score_open_qa_with_p_true(runtime_engine, lm, tmp_path, capsys):
    data = write_jsonl(tmp_path / "qa.jsonl", QA)
    report_path = tmp_path / "qa.json"
    assert main(["-q", "score", str(runtime_engine[2]), "--data", f"{data}:all",
                 "--max-new-tokens", "4", "--out", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["kind"] == "open_qa" and report["split"] == "all"
    answers = [p["answer"] for p in report["predictions"]]
    p_true = lm.p_true_batch([r.question for r in QA], answers)
    np.testing.assert_allclose([p["p_true"] for p in report["predictions"]], p_true, atol=1e-9)
    assert set(report["metrics"]) == {"p_true", "sequence_confidence"}
    assert "| P(True) |" in capsys.readouterr().out


def test_score_and_generate_errors_are_one_line(runtime_engine, tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ArtifactError: ") and "\n" not in err
    assert main(["generate", str(runtime_engine[2]), ""]) == 1
    assert capsys.readouterr().err.strip().startswith("ConfigError: the prompt is empty")
    unlabeled = write_jsonl(tmp_path / "u.jsonl", [MultipleChoiceRecord("q?", ("a", "b")),
                                                   MultipleChoiceRecord("r?", ("c", "d"))])
    assert main(["score", str(runtime_engine[2]), "--data", str(unlabeled), "--part",
                 "all"]) == 1
    assert capsys.readouterr().err.strip().startswith("DataError: 2 of 2 records have no answer")


@pytest.mark.parametrize("sub", ["generate", "score"])
def test_help_has_an_example(sub, capsys):
    with pytest.raises(SystemExit) as info:
        main([sub, "--help"])
    assert info.value.code == 0 and "example" in capsys.readouterr().out


def test_generate_on_the_torch_backend(runtime_engine, lm, capsys):
    pytest.importorskip("torch")
    model_dir, adapter_dir, engine_dir = runtime_engine
    assert main(["-q", "generate", str(engine_dir), PROMPT, "--max-new-tokens", "4", "--json",
                 "--backend", "torch", "--model", str(model_dir), "--adapter",
                 str(adapter_dir)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [t["id"] for t in data["tokens"]] == lm.generate(PROMPT, max_new_tokens=4).token_ids
    assert main(["generate", str(engine_dir), PROMPT, "--model", str(model_dir)]) == 1
    assert "--backend torch only" in capsys.readouterr().err


def test_sigterm_during_an_import_is_delivered_after_it(tmp_path, monkeypatch):
    """A SIGTERM that lands while a module is being imported (where an exception inside a C
    extension's initialisation can crash the interpreter) lets the import finish and raises
    Terminated right after."""
    import importlib
    import time

    from calm_runtime.cli.common import Terminated, signals_as_exceptions

    (tmp_path / "calm_sigterm_probe.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "for _ in range(200):\n"
        "    time.sleep(0.001)  # the handler runs here, inside the import\n"
        "DONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reached = []
    with pytest.raises(Terminated), signals_as_exceptions():
        module = importlib.import_module("calm_sigterm_probe")
        reached.append(module.DONE)
        time.sleep(5)  # the signal, sent again, arrives here
    assert reached == [True]
