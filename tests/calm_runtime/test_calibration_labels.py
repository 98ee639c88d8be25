"""Every output that names calibration says what the engine applies, from its manifest: an
adapter that folds nothing into the head (a cloze answer temperature alone) exports an engine
whose ``fused`` is false; its cloze choices are labelled by the answer temperature, its
letter choices (token log-probabilities, which it leaves alone) as uncalibrated, in the
Python API and in every ``calm serve`` response; its token log-probabilities too."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from calm_runtime.data.models import model_identity  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter, outputs_in_mode  # noqa: E402

QUESTION, OPTIONS = "Which is a colour?", ["red", "seven", "under"]


@pytest.fixture(scope="module")
def cloze_only_engine(tmp_path_factory, tiny_llama_tied):
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine

    root = tmp_path_factory.mktemp("cloze-only")
    identity = model_identity(tiny_llama_tied)
    vocab = identity.vocab_size
    adapter = CalibrationAdapter(base_model=identity, tau=np.ones(vocab, np.float32),
                                 shift=np.zeros(vocab, np.float32), temperature=1.0,
                                 answer_temperature=1.7, kind="daca",
                                 method={"mode": "cloze", "variant": "mean"})
    adapter.save_pretrained(root / "adapter")
    export_engine(tiny_llama_tied, root / "engine", adapter=root / "adapter",
                  config=ExportConfig(greedy_steps=2, progress=False))
    return root / "engine"


def test_the_manifest_says_the_head_carries_nothing(cloze_only_engine):
    from calm_runtime.formats.engine import EngineManifest

    manifest = EngineManifest.load(cloze_only_engine)
    assert manifest.calibration["fused"] is False and not manifest.head_calibrated
    outputs = manifest.calibrated_outputs
    assert outputs["token_logprobs"] is None and outputs["p_true"] is None
    assert outputs["option_probabilities"] == "daca: cloze answer temperature 1.7"


def test_choices_are_labelled_by_what_their_mode_applies(cloze_only_engine):
    from calm_runtime.inference.lm import CalibratedLM

    lm = CalibratedLM.load(cloze_only_engine, threads=1)
    try:
        cloze = lm.choose(QUESTION, OPTIONS, mode="cloze")
        letter = lm.choose(QUESTION, OPTIONS, mode="letter", chat=False)
    finally:
        lm.close()
    assert cloze.answer_temperature == pytest.approx(1.7)
    assert cloze.calibrated_by == "daca: cloze answer temperature 1.7"
    assert letter.answer_temperature == 1.0 and letter.calibrated_by is None
    assert letter.to_dict()["calibrated_by"] is None


def test_served_responses_say_the_same(cloze_only_engine):
    pytest.importorskip("fastapi")
    from calm_runtime.server import ServeConfig, create_app
    from calm_runtime.server.background import serve_in_background

    def post(url, body):
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())

    config = ServeConfig(engine=str(cloze_only_engine), model_name="tiny", threads=1)
    with serve_in_background(create_app(config)) as (url, _):
        answer = post(url, {"model": "tiny", "prompt": QUESTION, "max_tokens": 3,
                            "temperature": 0, "logprobs": 1})
        generated = answer["choices"][0]["calm"]
        with urllib.request.urlopen(url + "/v1/models", timeout=60) as listed:
            models = json.loads(listed.read())
        choices = {mode: post(url, {"model": "tiny", "prompt": QUESTION,
                                    "guided_choice": OPTIONS,
                                    "calm": {"choice_mode": mode}})["choices"][0]["calm"]
                   for mode in ("cloze", "letter")}
    assert answer["calm"]["calibration"]["fused"] is False  # the response's engine identity
    assert models["data"][0]["calm"]["calibration"]["fused"] is False
    assert generated["calibrated"]["token_logprobs"] is None
    assert choices["cloze"]["calibrated"]["option_probabilities"].startswith("daca: cloze")
    assert choices["letter"]["calibrated"]["option_probabilities"] is None
    assert choices["letter"]["answer_temperature"] == 1.0


def test_a_token_level_fit_labels_letter_choices_by_itself():
    outputs = {"token_logprobs": "daca: temperature 1.5 fitted on the option letters' logits",
               "option_probabilities": "daca: cloze answer temperature 1.2 on token-calibrated "
                                       "scores", "p_true": None}
    assert outputs_in_mode(outputs, "cloze") == outputs
    assert outputs_in_mode(outputs, "letter")["option_probabilities"] == \
        outputs["token_logprobs"]


def test_calm_score_names_an_uncalibrated_row_so(cloze_only_engine):
    """`calm score` in letter mode on an engine whose only calibration is a cloze answer
    temperature: the row says the engine is uncalibrated there; in cloze mode, calibrated."""
    from calm_runtime.data.sets import MultipleChoiceRecord
    from calm_runtime.inference.lm import CalibratedLM
    from calm_runtime.measure.score import format_report, score_records

    records = [MultipleChoiceRecord(question=f"Question {i}: which is a colour?",
                                    choices=OPTIONS, answer=i % 3) for i in range(6)]
    lm = CalibratedLM.load(cloze_only_engine, threads=1)
    try:
        rows = {}
        for mode in ("cloze", "letter"):
            report = score_records(lm, records, mode=mode, chat=False)
            report.update(engine="e", data="d", split="test", backend="b")
            rows[mode] = format_report(report)
    finally:
        lm.close()
    assert "| calibrated engine |" in rows["cloze"]
    assert "| engine (uncalibrated) |" in rows["letter"]
