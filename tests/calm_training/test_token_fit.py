"""Token-level temperatures for cloze fits (docs/methods.md §3, "Token level"): the solver on
synthetic logits with a known temperature, and `calm fit` writing a token temperature into the
fusable part of the adapter only where a signal exists, with the option-level temperature
fitted on the token-calibrated scores the runtime reads."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from calm_runtime.temperature import (
    fit_temperature_scaling,
    solve_inverse_temperature,
    solve_inverse_temperature_scores,
)
from calm_training.methods.daca import fit_daca_temperature, fit_token_daca_temperature
from calm_training.methods.ts import fit_token_temperature_scaling

# ------------------------------------------------------------------ the solver (numpy only)


def test_token_daca_recovers_a_known_temperature():
    rng = np.random.default_rng(0)
    reference = rng.normal(0.0, 3.0, (300, 500)).astype(np.float32)
    model = reference * 2.5  # over-confident by exactly T = 2.5; same argmax everywhere
    fit = fit_token_daca_temperature(model, reference)
    assert fit.method == "daca_token"
    assert fit.temperature == pytest.approx(2.5, rel=1e-6)
    assert fit.n_used == 300 and fit.agreement_rate == 1.0
    assert fit.objective == pytest.approx(0.0, abs=1e-8)  # KL 0 at the true temperature


def test_token_daca_masks_disagreeing_positions():
    rng = np.random.default_rng(1)
    reference = rng.normal(0.0, 3.0, (200, 50))
    model = reference * 0.5
    flipped = reference.copy()
    flipped[:50] = -flipped[:50]  # the reference's argmax moves on 50 positions
    fit = fit_token_daca_temperature(model, flipped)
    assert fit.n_used == 150 and fit.agreement_rate == pytest.approx(0.75)
    assert fit.temperature == pytest.approx(0.5, rel=1e-6)  # only the agreeing rows count
    naive = fit_token_daca_temperature(model, flipped, mask=False)
    assert naive.method == "naive_token" and naive.n_used == 200
    assert naive.temperature > fit.temperature  # pulled up by the disagreements


def test_token_temperature_scaling_with_labels():
    rng = np.random.default_rng(2)
    true = rng.normal(0.0, 2.0, (4000, 40))
    p = np.exp(true - true.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    targets = np.array([rng.choice(40, p=row) for row in p])
    fit = fit_token_temperature_scaling((true * 3.0).astype(np.float32), targets)
    assert fit.method == "ts_token"
    assert fit.temperature == pytest.approx(3.0, rel=0.05)


def test_chunked_solver_equals_the_dense_one():
    rng = np.random.default_rng(3)
    g = rng.normal(0.0, 2.0, (150, 7))
    p = rng.dirichlet(np.ones(7), 150)
    dense, _ = solve_inverse_temperature(g, p)
    scores, _ = solve_inverse_temperature_scores(g.astype(np.float32),
                                                      np.einsum("nk,nk->n", p, g))
    assert scores == pytest.approx(dense, rel=1e-6)


# ------------------------------------------------------------------ calm fit on tiny models

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import write_mc_jsonl  # noqa: E402

from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.fit import fit_adapter  # noqa: E402
from calm_training.posthoc.fit_config import FitConfig  # noqa: E402
from calm_training.posthoc.plan import FitPlan  # noqa: E402
from calm_training.scoring import cache as score_cache  # noqa: E402


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def mc_file(tmp_path):
    return write_mc_jsonl(tmp_path / "mc.jsonl")


def _greedy_answers(model_dir, path, tmp_path):
    """A copy of the data whose correct option is the model's greedy continuation of the
    question (two tokens), so that its answer tokens are predictable at token level."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calm_runtime.data.prompts import cloze_context

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        ids = tok(cloze_context(row["question"]))["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False,
                                 pad_token_id=3)
        text = tok.decode(out[0, len(ids):]).strip() or "x"
        row["choices"][row["answer"]] = text
    out = tmp_path / "greedy.jsonl"
    out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return out


def _config(model, data, **kw):
    return FitConfig(model=str(model), data=str(data), bootstrap=0, mode="cloze", **kw)


@pytest.mark.parametrize("method", ["daca", "ts"])
def test_cloze_fit_writes_a_token_temperature_and_refits_the_options(
        method, tiny_llama_tied, tiny_llama_untied, mc_file, tmp_path):
    # the two tiny models share one tokenizer: a label-free token-level signal exists
    if method == "ts":  # answers the model's own greedy continuations: a labeled signal
        mc_file = _greedy_answers(tiny_llama_tied, mc_file, tmp_path)
    config = _config(tiny_llama_tied, mc_file, reference=str(tiny_llama_untied))
    adapter, report = fit_adapter(config, method, tmp_path / "a", progress=False)
    token = report["token_fit"]
    assert token["fitted"] and token["positions"] > 0
    assert token["method"] == {"daca": "daca_token", "ts": "ts_token"}[method]
    loaded = CalibrationAdapter.from_pretrained(tmp_path / "a")
    assert loaded.temperature == pytest.approx(token["temperature"], rel=1e-6)
    assert loaded.temperature != pytest.approx(1.0, abs=1e-3)
    assert loaded.method["token_fit"]["temperature"] == pytest.approx(loaded.temperature)
    outputs = loaded.calibrated_outputs()
    assert outputs["token_logprobs"].startswith(token["method"])
    assert "on token-calibrated scores" in outputs["option_probabilities"]
    manifest = json.loads((tmp_path / "a" / "calm_adapter.json").read_text())
    assert manifest["summary"]["calibrated_outputs"] == outputs
    # the option temperature is the fit on the scores the runtime reads: those of the model
    # with the token temperature applied
    from calm_runtime.data.sets import load_dataset, split_indices

    records = load_dataset(str(mc_file))
    scores = score_cache.cached_option_scores(str(tiny_llama_tied), records, mode="cloze",
                                              adapter_dir=tmp_path / "a", progress=False)
    cal, _ = split_indices(len(records), 0.3, 0)
    variant = FitPlan.resolve(config).variant()
    g = scores.scores(variant)[cal]
    if method == "ts":
        refit = fit_temperature_scaling(g, scores.labels[cal])
    else:
        plm = score_cache.cached_option_scores(str(tiny_llama_untied), records, mode="cloze",
                                               progress=False)
        refit = fit_daca_temperature(plm.scores(variant)[cal], g)
    assert loaded.answer_temperature == pytest.approx(refit.temperature, rel=1e-6)


def test_no_token_fit_fits_the_answer_temperature_of_the_model_as_it_is(
        tiny_llama_tied, mc_file, tmp_path):
    """--no-token-fit: the head keeps T = 1 and the answer temperature is TS on the model's
    own option scores (what a fit from lm-eval logs computes)."""
    from calm_runtime.data.sets import load_dataset, split_indices

    mc_file = _greedy_answers(tiny_llama_tied, mc_file, tmp_path)
    config = _config(tiny_llama_tied, mc_file, token_fit=False)
    _, report = fit_adapter(config, "ts", tmp_path / "a", progress=False)
    assert report["token_fit"]["fitted"] is False
    assert "--no-token-fit" in report["token_fit"]["reason"]
    loaded = CalibrationAdapter.from_pretrained(tmp_path / "a")
    assert loaded.temperature == pytest.approx(1.0)
    records = load_dataset(str(mc_file))
    scores = score_cache.cached_option_scores(str(tiny_llama_tied), records, mode="cloze",
                                              progress=False)
    cal, _ = split_indices(len(records), 0.3, 0)
    g = scores.scores(FitPlan.resolve(config).variant())[cal]
    refit = fit_temperature_scaling(g, scores.labels[cal])
    assert loaded.answer_temperature == pytest.approx(refit.temperature, rel=1e-6)
    with pytest.raises(Exception, match="token_fit must be true or false"):
        _config(tiny_llama_tied, mc_file, token_fit="no")


def test_cross_tokenizer_reference_fits_option_level_only(tiny_llama_tied, tiny_llama_untied,
                                                          mc_file, tmp_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_llama_untied, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    (other / "tokenizer.json").write_text(json.dumps(tok, indent=1))  # same ids, another file
    config = _config(tiny_llama_tied, mc_file, reference=str(other))
    adapter, report = fit_adapter(config, "daca", tmp_path / "a", progress=False)
    assert report["token_fit"]["fitted"] is False
    assert "tokenizer" in report["token_fit"]["reason"]
    assert adapter.temperature == 1.0 and adapter.answer_temperature is not None
    outputs = adapter.calibrated_outputs()
    assert outputs["token_logprobs"] is None and outputs["p_true"] is None
    assert outputs["option_probabilities"].startswith("daca: cloze answer temperature")


def test_the_answer_positions_keep_whole_questions_within_the_memory_budget(
        tiny_llama_tied, tiny_llama_untied, mc_file, monkeypatch):
    # a large calibration set's full-vocabulary rows outgrow memory: the first questions
    # that fit are read, whole, the reference reads the same ones, and the record says so
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calm_runtime.data.sets import load_dataset
    from calm_training.methods import FIT_METHODS
    from calm_training.posthoc import token_fit

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_tied)).eval()
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_untied)).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_tied))
    records = load_dataset(mc_file)
    options = np.array([r.answer for r in records])
    full = token_fit.answer_positions(model, tok, records, options, max_bytes=None)
    assert full.n_questions == len(records) and len(full.targets) > len(records)
    row_bytes = 4 * full.logits.shape[1]
    counts = np.bincount(full.question, minlength=len(records))
    budget = int(counts[:3].sum())  # exactly the first three questions' rows
    part = token_fit.answer_positions(model, tok, records, options,
                                      max_bytes=budget * row_bytes + row_bytes - 1)
    assert part.n_questions == 3 and len(part.targets) == budget
    assert set(part.question) == {0, 1, 2}
    for q in range(3):  # the same rows as the uncapped pass, in whole
        np.testing.assert_allclose(part.logits[part.question == q],
                                   full.logits[full.question == q], atol=1e-5)
    monkeypatch.setattr(token_fit, "POSITION_BYTES", budget * row_bytes)
    agree = np.ones(len(records), dtype=bool)
    fit, record = token_fit.token_level_fit(
        FIT_METHODS["daca"], model=model, tokenizer=tok, records=records, chosen=options,
        reference=reference, reference_tokenizer=tok, same_tokenizer=True, agree=agree)
    assert fit is not None and record["questions"] == 3
    assert record["positions"] == budget
    assert record["capped"].startswith(f"the first 3 of {len(records)} questions")
