"""lm-evaluation-harness sample logs as a score source (calm_training.scoring.lm_eval_logs):
a fit and a comparison from the logs equal the same from calm's own scoring of the same
questions, without running either model; a log calm cannot use is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from conftest import write_mc_jsonl  # noqa: E402

from calm_runtime.data.prompts import cloze_context, cloze_continuation  # noqa: E402
from calm_runtime.data.sets import load_dataset  # noqa: E402
from calm_runtime.errors import CalmError, DataError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.fit import compare_methods, fit_adapter  # noqa: E402
from calm_training.posthoc.fit_config import FitConfig  # noqa: E402
from calm_training.scoring.lm_eval_logs import read_samples  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")


def write_log(path, records, sums):
    """A samples_*.jsonl as lm_eval --log_samples writes it for a multiple_choice task."""
    lines = []
    for i, (record, row) in enumerate(zip(records, sums, strict=True)):
        context = cloze_context(record.question)
        arguments = {f"gen_args_{k}": {"arg_0": context, "arg_1": cloze_continuation(option)}
                     for k, option in enumerate(record.choices)}
        values = row[:len(record.choices)]
        lines.append(json.dumps({
            "doc_id": i, "doc": {"question": record.question, "choices": list(record.choices),
                                 "answer": record.answer},
            "target": str(record.answer), "arguments": arguments,
            "resps": [[[repr(float(v)), "False"]] for v in values],
            "filtered_resps": [[repr(float(v)), "False"] for v in values],
            "filter": "none", "metrics": ["acc", "acc_norm"], "doc_hash": f"h{i}",
            "acc": float(int(np.argmax(values)) == record.answer)}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def logs(tmp_path_factory, tiny_llama_tied, tiny_llama_untied):
    """The same questions scored by calm (cloze sums) and written as the harness's logs of
    the two models."""
    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_training.scoring.local import score_multiple_choice

    root = tmp_path_factory.mktemp("lm-eval")
    data = write_mc_jsonl(root / "mc.jsonl", n=60, options=(4, 3, 5))
    records = load_dataset(str(data))
    out = {"data": data}
    for role, folder in (("model", tiny_llama_tied), ("reference", tiny_llama_untied)):
        model, tokenizer, _ = load_model_and_tokenizer(folder)
        scores = score_multiple_choice(model, tokenizer, records, mode="cloze", progress=False)
        out[role] = write_log(root / f"samples_mc_{role}.jsonl", records, scores.values)
    return out


@pytest.mark.parametrize("variant", ["sum", "mean", "char"])
def test_a_comparison_from_the_logs_equals_calm_own_scoring(logs, tiny_llama_tied,
                                                           tiny_llama_untied, variant):
    own = FitConfig(model=str(tiny_llama_tied), reference=str(tiny_llama_untied),
                    data=str(logs["data"]), variant=variant, bootstrap=0)
    from_logs = FitConfig(model=str(tiny_llama_tied), reference=str(tiny_llama_untied),
                          data=f"lm-eval:{logs['model']}", variant=variant, bootstrap=0,
                          model_scores=f"lm-eval:{logs['model']}",
                          reference_scores=f"lm-eval:{logs['reference']}")
    a = compare_methods(own, ("vanilla", "naive", "daca", "ts"), progress=False)
    b = compare_methods(from_logs, ("vanilla", "naive", "daca", "ts"), progress=False)
    assert a["n_calibration"] == b["n_calibration"] and a["n_test"] == b["n_test"]
    for method in ("naive", "daca", "ts"):
        ta, tb = a["methods"][method]["fit"]["temperature"], b["methods"][method]["fit"][
            "temperature"]
        assert tb == pytest.approx(ta, abs=1e-3), (method, ta, tb)
        for metric in ("accuracy", "ece", "nll"):
            assert b["methods"][method][metric] == pytest.approx(a["methods"][method][metric],
                                                                 abs=1e-6)


def test_a_fit_from_the_logs_runs_no_model_and_records_the_logs(logs, tiny_llama_tied,
                                                              tiny_llama_untied, tmp_path,
                                                              monkeypatch):
    from calm_training.scoring import sources

    def no_model(*_a, **_k):
        raise AssertionError("a fit from logs must not load a model")

    monkeypatch.setattr(sources.LocalModel, "load", no_model)
    config = FitConfig(model=str(tiny_llama_tied), reference=str(tiny_llama_untied),
                       data=f"lm-eval:{logs['model']}", variant="sum", bootstrap=0,
                       model_scores=f"lm-eval:{logs['model']}",
                       reference_scores=f"lm-eval:{logs['reference']}")
    adapter, report = fit_adapter(config, "daca", tmp_path / "daca", progress=False)
    saved = CalibrationAdapter.from_pretrained(tmp_path / "daca")
    assert saved.answer_temperature == pytest.approx(report["fit"]["temperature"])
    assert saved.temperature == 1.0  # no token distributions in a log: no head temperature
    assert saved.method["token_fit"]["fitted"] is False
    logged = saved.provenance["score_logs"]
    assert logged["model"]["sha256"] == read_samples(logs["model"]).sha256
    assert logged["reference"]["file"] == logs["reference"].name


def _broken(tmp_path, case):
    good = [json.loads(x) for x in
            write_log(tmp_path / "g.jsonl", load_dataset(
                str(write_mc_jsonl(tmp_path / "d.jsonl", n=6))),
                np.full((6, 4), -2.0)).read_text().splitlines()]
    if case == "generate_until":
        good[2]["arguments"] = {"gen_args_0": {"arg_0": "Q", "arg_1": {"until": ["\n"]}}}
        good[2]["filtered_resps"] = ["an answer"]
    elif case == "loglikelihood_rolling":
        good[2]["arguments"] = {"gen_args_0": {"arg_0": "a whole text"}}
    elif case == "nan":
        good[2]["filtered_resps"][1] = ["nan", "False"]
    elif case == "text":
        good[2]["filtered_resps"][1] = ["high", "False"]
    elif case == "target":
        good[2]["target"] = "7"
    elif case == "not-json":
        path = tmp_path / "bad.jsonl"
        path.write_text("\n".join(json.dumps(g) for g in good[:2]) + "\n{not json\n")
        return path
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(g) for g in good) + "\n")
    return path


@pytest.mark.parametrize("case, match", [
    ("generate_until", "generate_until"), ("loglikelihood_rolling", "loglikelihood_rolling"),
    ("nan", "not a finite"), ("text", "not a log-likelihood"), ("target", "outside"),
    ("not-json", "not JSON")])
def test_a_log_calm_cannot_use_is_one_line(tmp_path, case, match):
    with pytest.raises(DataError, match=match) as info:
        read_samples(_broken(tmp_path, case))
    assert "\n" not in str(info.value)


def test_logs_of_different_documents_and_oversized_files_are_refused(tmp_path, logs,
                                                                    monkeypatch):
    from calm_training.scoring import lm_eval_logs

    lines = logs["reference"].read_text().splitlines()
    shorter = tmp_path / "shorter.jsonl"
    shorter.write_text("\n".join(lines[:-3]) + "\n")
    with pytest.raises(DataError, match="score different documents"):
        lm_eval_logs.paired(read_samples(logs["model"]), read_samples(shorter))
    monkeypatch.setattr(lm_eval_logs, "MAX_LOG_BYTES", 100)
    with pytest.raises(DataError, match="more than the 100"):
        read_samples(logs["model"])


def test_the_command_line_takes_the_logs(logs, tiny_llama_tied, tiny_llama_untied, tmp_path,
                                         capsys, monkeypatch):
    from calm_runtime.cli.main import main

    monkeypatch.chdir(tmp_path)
    code = main(["-q", "fit", "daca", "--model", str(tiny_llama_tied), "--reference",
                 str(tiny_llama_untied), "--model-scores", f"lm-eval:{logs['model']}",
                 "--reference-scores", f"lm-eval:{logs['reference']}", "--variant", "sum",
                 "--out", str(tmp_path / "a")])
    assert code == 0, capsys.readouterr().err
    code = main(["-q", "eval", "--model", str(tiny_llama_tied), "--model-scores",
                 f"lm-eval:{logs['model']}", "--reference", str(tiny_llama_untied),
                 "--reference-scores", f"lm-eval:{logs['reference']}", "--compare"])
    assert code == 0, capsys.readouterr().err
    # the reference's scores must come from a log too: one line, before anything runs
    code = main(["-q", "fit", "daca", "--model", str(tiny_llama_tied), "--reference",
                 str(tiny_llama_untied), "--model-scores", f"lm-eval:{logs['model']}",
                 "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "--reference-scores" in err[0], err
    with pytest.raises(CalmError):
        FitConfig(model="m", data="d", model_scores="samples.jsonl")  # no lm-eval: prefix
