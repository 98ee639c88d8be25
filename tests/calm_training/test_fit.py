"""The fit / compare / eval pipeline end to end on tiny random models and a JSONL file."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import write_mc_jsonl  # noqa: E402

from calm_runtime.errors import (  # noqa: E402
    ConfigError,
    DataError,
    IncompatibleModelError,
    ModelSourceError,
)
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity  # noqa: E402
from calm_training.fit import compare_methods, fit_adapter  # noqa: E402
from calm_training.posthoc.evaluate import evaluate_adapter, write_report  # noqa: E402
from calm_training.posthoc.fit_config import FitConfig  # noqa: E402
from calm_training.posthoc.fit_report import format_table  # noqa: E402
from calm_training.scoring import cache as score_cache  # noqa: E402


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def mc_file(tmp_path):
    return write_mc_jsonl(tmp_path / "mc.jsonl")


def _config(model, data, **kw):
    return FitConfig(model=str(model), data=str(data), bootstrap=20, **kw)


def test_daca_cloze_adapter_and_comparison(tiny_llama_tied, tiny_llama_untied, mc_file,
                                           tmp_path):
    config = _config(tiny_llama_tied, mc_file, reference=str(tiny_llama_untied), mode="cloze")
    adapter, report = fit_adapter(config, "daca", tmp_path / "daca", progress=False)
    loaded = CalibrationAdapter.from_pretrained(tmp_path / "daca")
    assert loaded.kind == "daca"
    assert loaded.answer_temperature == pytest.approx(report["fit"]["temperature"])
    # the two tiny models share a tokenizer: a token-level temperature is fitted too
    assert loaded.temperature == pytest.approx(report["token_fit"]["temperature"])
    assert (loaded.tau == 1).all() and (loaded.shift == 0).all()
    assert loaded.provenance["split"] == {"part": "calibration", "fraction": 0.3, "seed": 0,
                                          "n": 12}
    assert loaded.provenance["reference"]["vocab_size"] == 300
    comparison = compare_methods(config, progress=False)
    assert comparison["methods"]["daca"]["fit"]["temperature"] > 0
    assert comparison["n_test"] == 28
    assert "| daca |" in format_table(comparison)
    written = write_report(comparison, tmp_path / "reports", "cmp")
    assert json.loads(written["json"].read_text())["n_test"] == 28
    assert written["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scores_are_cached(tiny_llama_tied, mc_file, monkeypatch):
    config = _config(tiny_llama_tied, mc_file, mode="letter", chat=False)
    first = compare_methods(config, ("vanilla", "ts"), progress=False)

    def boom(*_a, **_k):
        raise AssertionError("scores must come from the cache")

    monkeypatch.setattr(score_cache, "score_multiple_choice", boom)
    second = compare_methods(config, ("vanilla", "ts"), progress=False)
    assert first["methods"]["ts"]["ece"] == second["methods"]["ts"]["ece"]


def test_a_method_that_cannot_fit_is_reported_not_fatal(tiny_llama_tied, mc_file, monkeypatch,
                                                        tmp_path):
    from calm_runtime.errors import FitError
    from calm_training.methods.vector import VectorMethod

    config = _config(tiny_llama_tied, mc_file, mode="letter", chat=False)

    def no_agreement(method, prep):  # the vector fits (ts-vector here) find no signal
        raise FitError("the PLM and PoLM agree on none of the 12 items")

    monkeypatch.setattr(VectorMethod, "fit_prepared", no_agreement)
    report = compare_methods(config, ("vanilla", "ts-vector", "ts"), progress=False)
    assert report["methods"]["ts-vector"] == {
        "error": "the PLM and PoLM agree on none of the 12 items"}
    assert "ece" in report["methods"]["ts"]
    table = format_table(report)
    assert "| ts-vector | - | fit failed: the PLM and PoLM agree on none" in table
    assert write_report(report, tmp_path / "reports", "cmp")["png"].exists()


def _relabel_by_model(config, path, tmp_path, mode="letter"):
    """A copy of the data whose answers follow the model's own choice (letter or cloze sum)
    80% of the time, so that fitted vector-scaling weights are positive (as on a real model)."""
    from calm_runtime.data.sets import load_dataset

    scores = score_cache.cached_option_scores(config.model, load_dataset(str(path)),
                                              mode=mode, chat=False, progress=False)
    rng = np.random.default_rng(1)
    out = tmp_path / "relabeled.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row, values in zip(rows, scores.values, strict=True):
        row["answer"] = int(np.argmax(values)) if rng.random() < 0.8 else int(rng.integers(4))
    out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return out


def test_letter_vector_scaling_is_exact_in_the_artifact(tiny_llama_tied, mc_file, tmp_path):
    """Vector scaling written onto tau/shift and applied to full-vocabulary logits gives the
    same option probabilities as the fit applied to the option logits (docs/methods.md §1)."""
    config = _config(tiny_llama_tied, mc_file, mode="letter", chat=False)
    config = _config(tiny_llama_tied, _relabel_by_model(config, mc_file, tmp_path),
                     mode="letter", chat=False)
    fit_adapter(config, "ts-vector", tmp_path / "vs", progress=False)
    adapter = CalibrationAdapter.from_pretrained(tmp_path / "vs")
    assert (adapter.tau != 1).sum() == 4 and (adapter.shift != 0).sum() >= 3
    # the weights sit at the token ids the letters were scored at, which the scores carry
    # (these come back from the score cache the fit filled)
    from calm_runtime.data.sets import load_dataset

    scores = score_cache.cached_option_scores(config.model, load_dataset(config.data),
                                              mode="letter", chat=False, progress=False)
    assert set(np.flatnonzero(adapter.tau != 1)) == set(scores.option_ids.tolist())
    report = evaluate_adapter(config, tmp_path / "vs", progress=False)
    comparison = compare_methods(config, ("ts-vector",), progress=False)
    assert report["methods"]["ts_vector"]["nll"] == pytest.approx(
        comparison["methods"]["ts-vector"]["nll"], abs=1e-5)
    assert report["methods"]["vanilla"]["nll"] != pytest.approx(
        report["methods"]["ts_vector"]["nll"], abs=1e-5)


def test_letter_temperature_composes_with_a_base_adapter(tiny_llama_tied, mc_file, tmp_path):
    config = _config(tiny_llama_tied, mc_file, mode="letter", chat=False)
    mc_file = _relabel_by_model(config, mc_file, tmp_path)
    config = _config(tiny_llama_tied, mc_file, mode="letter", chat=False)
    _, first = fit_adapter(config, "ts", tmp_path / "ts", progress=False)
    on_top = _config(tiny_llama_tied, mc_file, mode="letter", chat=False,
                     adapter=str(tmp_path / "ts"))
    adapter, second = fit_adapter(on_top, "ts", tmp_path / "ts2", progress=False)
    assert adapter.kind == "ts+ts"
    # the second fit runs on already calibrated logits: nothing left to correct
    assert second["fit"]["temperature"] == pytest.approx(1.0, abs=1e-3)
    assert adapter.temperature == pytest.approx(first["fit"]["temperature"], rel=1e-3)


def test_bad_input(tiny_llama_tied, mc_file, tmp_path):
    config = _config(tiny_llama_tied, mc_file, mode="cloze")
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "keep.txt").write_text("keep")
    with pytest.raises(ConfigError, match="already exists"):
        fit_adapter(config, "ts", tmp_path / "exists", progress=False)
    assert [p.name for p in (tmp_path / "exists").iterdir()] == ["keep.txt"]
    with pytest.raises(ConfigError, match="reference"):
        fit_adapter(config, "daca", tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()
    other = CalibrationAdapter.identity(ModelIdentity("other", 1000))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(IncompatibleModelError, match="vocabulary of 1000"):
        fit_adapter(_config(tiny_llama_tied, mc_file, adapter=str(tmp_path / "other")), "ts",
                    tmp_path / "y", progress=False)
    assert not (tmp_path / "y").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(mc_file.read_text().splitlines()[0] + "\n{\"question\": \"q\", "
                   "\"choices\": [\"a\", \"b\"], \"answer\": 5}\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2:"):
        compare_methods(_config(tiny_llama_tied, bad), ("vanilla",), progress=False)
    no_tokenizer = tmp_path / "no-tok"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((tiny_llama_tied / "config.json").read_text())
    with pytest.raises(ModelSourceError, match="no tokenizer"):
        compare_methods(_config(no_tokenizer, mc_file), ("vanilla",), progress=False)
    with pytest.raises(ConfigError, match="variant"):
        FitConfig(model="m", data="d", variant="median")


def test_eval_follows_the_variant_the_answer_temperature_was_fitted_on(
        tiny_llama_tied, mc_file, tmp_path, monkeypatch, capsys):
    """One policy (docs/cli.md): the recorded variant is the default, another one is a
    one-line error, never a silent switch."""
    from calm_runtime.cli.main import main

    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    data = _relabel_by_model(_config(tiny_llama_tied, mc_file), mc_file, tmp_path, "cloze")
    fitted = _config(tiny_llama_tied, data, mode="cloze", variant="sum")
    adapter, _ = fit_adapter(fitted, "ts", tmp_path / "ts-sum", progress=False)
    assert adapter.method["variant"] == "sum" and adapter.answer_temperature is not None
    asked = _config(tiny_llama_tied, data, mode="cloze", variant="mean")
    with pytest.raises(ConfigError, match="fitted on 'sum' cloze scores, not 'mean'"):
        evaluate_adapter(asked, tmp_path / "ts-sum", progress=False)
    report = evaluate_adapter(fitted, tmp_path / "ts-sum", progress=False)
    assert report["config"]["variant"] == "sum"
    common = ["eval", "--model", str(tiny_llama_tied), "--data", str(data), "--mode", "cloze",
              "--adapter", str(tmp_path / "ts-sum"), "--report-dir", str(tmp_path / "r"), "-q"]
    assert main(common) == 0  # no --variant: the recorded one
    written = json.loads(next((tmp_path / "r").glob("*.json")).read_text())
    assert written["config"]["variant"] == "sum"
    for name, row in report["methods"].items():  # the same scores as the API's call
        assert written["methods"][name]["ece"] == pytest.approx(row["ece"])
    capsys.readouterr()
    assert main([*common, "--variant", "char"]) == 1
    err = capsys.readouterr().err.strip()
    assert "fitted on 'sum' cloze scores, not 'char'" in err and len(err.splitlines()) == 1


RSS_WRAPPER = r'''
import json, resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"code": proc.returncode, "stderr": proc.stderr, "stdout": proc.stdout,
                  "max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
'''


def test_one_10mb_record_stops_in_one_line_with_bounded_memory(tiny_llama_tied, mc_file,
                                                              tmp_path):
    """40 good records and one ~10 MB question: `calm fit` stops with a one-line error naming
    the problem, and the process's peak RSS stays under 2 GB (it once reached 22.6 GB)."""
    import os
    import subprocess
    import sys

    data = tmp_path / "with-huge.jsonl"
    huge = {"question": "water " * 1_750_000, "choices": ["fire", "dog"], "answer": 0,
            "id": "huge"}
    data.write_text(mc_file.read_text() + json.dumps(huge) + "\n")
    command = [sys.executable, "-m", "calm_runtime.cli.main", "-q", "fit", "ts", "--model",
               str(tiny_llama_tied), "--data", str(data), "--out", str(tmp_path / "adapter")]
    env = dict(os.environ, CALM_CACHE=str(tmp_path / "cache"))
    result = json.loads(subprocess.run([sys.executable, "-c", RSS_WRAPPER, *command], env=env,
                                       capture_output=True, text=True, check=True,
                                       timeout=600).stdout)
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == 1 and len(lines) == 1, result["stderr"][-2000:]
    assert lines[0].startswith("DataError: ") and "huge" in lines[0], lines[0][:300]
    assert result["max_rss_kb"] < 2 * 1024 * 1024, f"peak RSS {result['max_rss_kb']} kB"
    assert not (tmp_path / "adapter").exists()


def test_reports_carry_selective_metrics_and_the_per_question_arrays(tiny_llama_tied, mc_file,
                                                                     tmp_path):
    """Every figure of a report can be recomputed from it; a risk-coverage plot sits next to
    the reliability diagram."""
    from calm_runtime.measure import metrics
    from calm_training.posthoc.fit_report import format_selective_table

    config = _config(tiny_llama_tied, mc_file, mode="cloze")
    report = compare_methods(config, ("vanilla", "ts"), progress=False)
    for name, row in report["methods"].items():
        conf, correct = np.array(row["confidence"]), np.array(row["correct"], dtype=float)
        assert conf.size == report["n_test"] == correct.size
        assert row["ece"] == pytest.approx(metrics.ece(conf, correct, config.n_bins))
        expected = metrics.auroc(conf, correct)
        assert (row["auroc"] is None) if np.isnan(expected) else \
            row["auroc"] == pytest.approx(expected)
        assert row["aurc"] == pytest.approx(metrics.aurc(conf, correct))
        assert [r["threshold"] for r in row["selective"]][:2] == [0.5, 0.55]
        assert len(row["auroc_ci"]) == 2, name
    assert "| ts |" in format_selective_table(report)
    written = write_report(report, tmp_path, "r")
    assert written["png"].is_file() and written["risk_coverage_png"].is_file()
    assert json.loads(written["json"].read_text())["methods"]["ts"]["confidence"] == \
        report["methods"]["ts"]["confidence"]


@pytest.mark.parametrize("mode", ["cloze", "letter"])
def test_calm_eval_adapter_writes_its_report(mode, tiny_llama_tied, tiny_llama_untied, mc_file,
                                             tmp_path, capsys):
    """`calm eval --adapter` (a README command) prints its table and writes its report."""
    from calm_runtime.cli.main import main

    common = ["--model", str(tiny_llama_tied), "--data", str(mc_file), "--mode", mode, "-q"]
    if mode == "letter":
        common.append("--no-chat")
    assert main(["fit", "daca", *common, "--reference", str(tiny_llama_untied),
                 "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "calibrated outputs:" in out
    assert main(["eval", *common, "--adapter", str(tmp_path / "a"),
                 "--report-dir", str(tmp_path / "r")]) == 0
    table = capsys.readouterr().out
    assert "| vanilla |" in table and "fit n=12" in table
    report = json.loads(next((tmp_path / "r").glob("*.json")).read_text())
    assert report["n_calibration"] == 12 and report["n_test"] == 28
    # the adapter's row shows the temperature it applies, never vanilla's 1
    adapter = CalibrationAdapter.from_pretrained(tmp_path / "a")
    applied = (adapter.answer_temperature if mode == "cloze" and
               adapter.answer_temperature is not None else adapter.temperature)
    assert applied != 1
    row = next(line for line in table.splitlines() if line.startswith(f"| {adapter.kind} |"))
    assert row.split("|")[2].strip() == f"{applied:.3f}", row
    assert report["methods"][adapter.kind]["fit"]["temperature"] == pytest.approx(applied)
    assert set(report["calibrated_outputs"]) == {"token_logprobs", "option_probabilities",
                                                 "p_true"}


def test_arguments_are_checked_before_any_scoring(tiny_llama_tied, mc_file, tmp_path,
                                                  monkeypatch):
    """A label-free method without --reference, an --out that exists or cannot be created:
    refused before a single question is scored."""
    from calm_training.scoring import cache

    def no_scoring(*_a, **_k):
        raise AssertionError("scored before the arguments were checked")

    monkeypatch.setattr(cache, "cached_option_scores", no_scoring)
    config = _config(tiny_llama_tied, mc_file, mode="cloze")
    with pytest.raises(ConfigError, match="need a reference"):
        fit_adapter(config, "daca", tmp_path / "a", progress=False)
    with pytest.raises(ConfigError, match="need a reference"):
        compare_methods(config, ("vanilla", "daca"), progress=False)
    (tmp_path / "file").write_text("x")
    from calm_runtime.errors import ArtifactError

    with pytest.raises(ArtifactError, match="not a folder"):
        fit_adapter(config, "ts", tmp_path / "file" / "adapter", progress=False)


def test_an_adapter_that_changes_no_score_shares_the_models_cached_scores(
        tiny_llama_tied, mc_file, tmp_path, monkeypatch):
    """An adapter with an identity head and no LoRA (a cloze answer temperature alone)
    scores as the model does: no second scoring pass, the model's cache entry serves it; an
    adapter with a head temperature is scored (and cached) apart."""
    from calm_runtime.data.models import model_identity
    from calm_runtime.data.sets import load_dataset

    records = load_dataset(str(mc_file))
    identity = model_identity(tiny_llama_tied)
    vocab = identity.vocab_size
    answer_only = CalibrationAdapter(base_model=identity, tau=np.ones(vocab, np.float32),
                                     shift=np.zeros(vocab, np.float32), temperature=1.0,
                                     answer_temperature=1.7, kind="daca",
                                     method={"mode": "cloze"})
    answer_only.save_pretrained(tmp_path / "answer-only")
    head = CalibrationAdapter.identity(identity, temperature=2.0)
    head.save_pretrained(tmp_path / "head")
    vanilla = score_cache.cached_option_scores(str(tiny_llama_tied), records, mode="cloze",
                                               progress=False)
    calls = []
    real = score_cache.score_multiple_choice
    monkeypatch.setattr(score_cache, "score_multiple_choice",
                        lambda *a, **k: calls.append(k.get("calibration")) or real(*a, **k))
    same = score_cache.cached_option_scores(str(tiny_llama_tied), records, mode="cloze",
                                            adapter_dir=tmp_path / "answer-only",
                                            progress=False)
    assert calls == [] and np.array_equal(same.values, vanilla.values)
    scaled = score_cache.cached_option_scores(str(tiny_llama_tied), records, mode="cloze",
                                              adapter_dir=tmp_path / "head", progress=False)
    assert len(calls) == 1 and calls[0] is not None
    assert not np.array_equal(scaled.values, vanilla.values)
