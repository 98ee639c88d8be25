"""An engine as ``--model``/``--reference`` of ``calm fit``/``calm eval``: its ONNX Runtime
scores equal the torch scores of its source model with its calibration (1e-4), the
answers equal torch greedy answers, and what it cannot do is a one-line error."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from calm_runtime.data.prompts import p_true_template  # noqa: E402
from calm_runtime.data.sets import MultipleChoiceRecord, OpenQARecord, write_jsonl  # noqa: E402
from calm_runtime.errors import ConfigError  # noqa: E402
from calm_training.fit import compare_methods, fit_adapter  # noqa: E402
from calm_training.posthoc.fit_config import FitConfig  # noqa: E402
from calm_training.scoring.answers import generate_answers, score_p_true  # noqa: E402
from calm_training.scoring.cache import cached_option_scores  # noqa: E402
from calm_training.scoring.engine import (  # noqa: E402
    engine_fingerprint,
    engine_identity,
    load_engine,
)
from calm_training.scoring.local import score_multiple_choice  # noqa: E402
from calm_training.scoring.sources import EngineSource, LocalModel, is_engine, resolve_source  # noqa: E402

QUESTIONS = ["Which number is prime?", "Where do penguins live?", "What colour is the sky?",
             "Which animal barks?", "What is two plus two?", "Which planet is red?"]
CHOICES = [["4", "7", "9"], ["the Arctic", "Antarctica", "the Sahara"],
           ["blue", "green", "a very long and unlikely option"], ["a cat", "a dog", "a fish"],
           ["three", "four", "five"], ["Mars", "Venus", "the Moon"]]


def _records(n: int = 6) -> list[MultipleChoiceRecord]:
    return [MultipleChoiceRecord(question=QUESTIONS[i % 6], choices=tuple(CHOICES[i % 6]),
                                 answer=i % 3, id=f"q{i}") for i in range(n)]


@pytest.fixture(scope="module")
def engine(runtime_engine):
    return load_engine(runtime_engine[2], threads=1)


@pytest.fixture(scope="module")
def reference(runtime_engine, runtime_reference_model):
    from transformers import AutoTokenizer

    model, adapter = runtime_reference_model
    return model, AutoTokenizer.from_pretrained(str(runtime_engine[0])), adapter


@pytest.mark.parametrize("mode", ["cloze", "letter"])
def test_engine_option_scores_equal_torch(engine, reference, mode, torch_single_thread):
    model, tokenizer, adapter = reference
    records = _records()
    want = score_multiple_choice(model, tokenizer, records, mode=mode, batch_size=4,
                                 calibration=adapter, progress=False, chat=False)
    got = score_multiple_choice(engine[0], engine[1], records, mode=mode, batch_size=4,
                                progress=False, chat=False)
    assert np.isfinite(got.values).all()
    np.testing.assert_allclose(got.values, want.values, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got.n_tokens, want.n_tokens)
    np.testing.assert_array_equal(got.n_chars, want.n_chars)


def test_engine_p_true_and_answers_equal_torch(engine, reference, torch_single_thread):
    model, tokenizer, adapter = reference
    template = p_true_template("kadavath")
    answers = ["Paris", "seven", "blue sky"]
    want = score_p_true(model, tokenizer, QUESTIONS[:3], answers, template, chat=False,
                        calibration=adapter, progress=False)
    got = score_p_true(engine[0], engine[1], QUESTIONS[:3], answers, template, chat=False,
                       progress=False)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_cache_and_identity(runtime_engine, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    engine_dir = runtime_engine[2]
    assert is_engine(engine_dir) and not is_engine(runtime_engine[0])
    assert not is_engine("gemma-3-270m") and not is_engine(None)
    source = resolve_source(engine_dir)
    assert isinstance(source, EngineSource) and not source.full_logits
    assert source.identity() == engine_identity(engine_dir)
    assert source.fingerprint() == engine_fingerprint(engine_dir)
    assert isinstance(resolve_source(runtime_engine[0]), LocalModel)
    assert engine_fingerprint(engine_dir).startswith("engine:")
    assert engine_identity(engine_dir).vocab_size == engine[0].manifest.vocab_size
    records = _records()
    first = cached_option_scores(str(engine_dir), records, mode="cloze", progress=False)
    assert list((tmp_path / "cache" / "scores").glob("cloze-*.safetensors"))
    again = cached_option_scores(str(engine_dir), records, mode="cloze", progress=False)
    np.testing.assert_array_equal(first.values, again.values)
    with pytest.raises(ConfigError, match="is an engine.*--adapter"):
        cached_option_scores(str(engine_dir), records, mode="cloze", progress=False,
                             adapter_dir=runtime_engine[1])


def test_fit_and_eval_through_engines(runtime_engine, tmp_path, monkeypatch):
    """``calm eval`` with an engine as model and reference; ``calm fit`` writes an adapter
    from an uncalibrated engine and refuses a calibrated one."""
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine

    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    model_dir, _, engine_dir = runtime_engine
    data = tmp_path / "mc.jsonl"
    write_jsonl(data, _records(24))
    config = FitConfig(model=str(engine_dir), reference=str(engine_dir), data=str(data),
                       mode="cloze", bootstrap=0)
    report = compare_methods(config, ["vanilla", "daca", "ts"], progress=False)
    assert report["n_records"] == 24 and report["agreement_rate"] == 1.0
    with pytest.raises(ConfigError, match="fused with a .* calibration.*without --adapter"):
        fit_adapter(config, "daca", tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()

    plain = tmp_path / "plain-engine"
    export_engine(model_dir, plain, config=ExportConfig(greedy_steps=2, progress=False,
                                                        exporter="torchscript"))
    fitted = FitConfig(model=str(plain), reference=str(engine_dir), data=str(data),
                       mode="letter", bootstrap=0, chat=False)
    adapter, _ = fit_adapter(fitted, "daca", tmp_path / "adapter", progress=False)
    assert adapter.base_model.name == engine_identity(plain).name
    assert adapter.temperature > 0 and (tmp_path / "adapter").is_dir()

    # greedy answers through the uncalibrated engine equal torch greedy on its source model
    from calm_runtime.data.models import load_model_and_tokenizer

    source, tokenizer, _ = load_model_and_tokenizer(model_dir)
    want = generate_answers(source, tokenizer, QUESTIONS, max_new_tokens=6, progress=False)
    got = generate_answers(*load_engine(plain, threads=1)[:2], QUESTIONS, max_new_tokens=6,
                           batch_size=4, progress=False)
    assert got == want
    qa = tmp_path / "qa.jsonl"
    write_jsonl(qa, [OpenQARecord(question=q, answers=("x",)) for q in QUESTIONS])
    p_true = FitConfig(model=str(plain), reference=str(engine_dir), data=str(qa),
                       mode="p_true", bootstrap=0, chat=False)
    assert "vanilla" in compare_methods(p_true, ["vanilla", "naive"], progress=False)["methods"]
