"""Multiple choice and P(True) on the engine equal training's scoring and direct computations.

Training's scorers (``calm_training.scoring.local``) run the source model in torch with the
adapter's calibration applied to the logits; the engine has the calibration fused into its
head. Same prompts, same token ids, same numbers (within ``ATOL``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from calm_runtime import CalibratedLM  # noqa: E402
from calm_runtime.data.prompts import p_true_template  # noqa: E402
from calm_runtime.data.sets import MultipleChoiceRecord  # noqa: E402
from calm_runtime.modes import DEFAULT_CLOZE_VARIANT  # noqa: E402

#: |engine - torch| on option scores (summed log-probabilities of a few tokens, or logits)
#: and on probabilities; the engine's logits are within ~1e-5 of the reference here
ATOL = {"scores": 1e-3, "probabilities": 2e-4}

QUESTIONS = [
    ("What colour is the sky on a clear day?", ["blue", "green"]),
    ("Which number is prime?", ["4", "7", "9"]),
    ("Where do penguins mostly live?", ["the Arctic", "Antarctica", "the Sahara", "Paris"]),
]


@pytest.fixture(scope="module")
def lm(runtime_engine):
    return CalibratedLM.load(runtime_engine[2], threads=1)


@pytest.fixture(scope="module")
def hf_tokenizer(runtime_engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(runtime_engine[0]))


def _records():
    return [MultipleChoiceRecord(question=q, choices=tuple(o)) for q, o in QUESTIONS]


def _softmax(z):
    e = np.exp(z - np.max(z))
    return e / e.sum()


@pytest.mark.parametrize("variant", ["sum", "mean", "char"])
def test_cloze_equals_training_scoring(lm, runtime_reference_model, hf_tokenizer, variant):
    from calm_training.scoring.local import score_multiple_choice

    model, adapter = runtime_reference_model
    scores = score_multiple_choice(model, hf_tokenizer, _records(), mode="cloze",
                                   calibration=adapter, progress=False).scores(variant)
    choices = lm.choose_batch([q for q, _ in QUESTIONS], [o for _, o in QUESTIONS],
                              mode="cloze", variant=variant)
    temperature = adapter.answer_temperature
    assert lm.answer_temperature == pytest.approx(temperature)
    for row, choice in enumerate(choices):
        k = len(QUESTIONS[row][1])
        np.testing.assert_allclose(choice.scores, scores[row, :k], atol=ATOL["scores"])
        np.testing.assert_allclose(choice.probabilities, _softmax(scores[row, :k] / temperature),
                                   atol=ATOL["probabilities"])
        assert choice.prediction == int(np.argmax(choice.probabilities))
        assert choice.confidence == choice.probabilities.max()
        assert choice.mode == "cloze" and choice.variant == variant


def test_cloze_equals_a_direct_computation(lm, runtime_reference_model, hf_tokenizer):
    """Without the KV-cache sharing: the whole context + option run as one sequence."""
    model, adapter = runtime_reference_model
    question, options = QUESTIONS[2]
    context = hf_tokenizer(f"Question: {question}\nAnswer:")["input_ids"]
    want = []
    for option in options:
        cont = hf_tokenizer(f" {option}", add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([context + cont])).logits[0].float()
        logp = adapter.calibrate(logits).log_softmax(-1).double().numpy()
        want.append(sum(logp[len(context) - 1 + t, tok] for t, tok in enumerate(cont)))
    choice = lm.choose(question, options, variant="sum")
    np.testing.assert_allclose(choice.scores, want, atol=ATOL["scores"])


@pytest.mark.parametrize("chat", [None, False])
def test_letter_mode_equals_training_scoring(lm, runtime_reference_model, hf_tokenizer, chat):
    from calm_training.scoring.local import score_multiple_choice

    model, adapter = runtime_reference_model
    scores = score_multiple_choice(model, hf_tokenizer, _records(), mode="letter", chat=chat,
                                   calibration=adapter, progress=False).scores()
    choices = lm.choose_batch([q for q, _ in QUESTIONS], [o for _, o in QUESTIONS],
                              mode="letter", chat=chat)
    for row, choice in enumerate(choices):
        k = len(QUESTIONS[row][1])
        np.testing.assert_allclose(choice.scores, scores[row, :k], atol=ATOL["scores"])
        np.testing.assert_allclose(choice.probabilities, _softmax(scores[row, :k]),
                                   atol=ATOL["probabilities"])
        assert choice.answer_temperature == 1.0 and choice.variant is None


def test_batched_choices_equal_single_ones(lm):
    for mode in ("cloze", "letter"):
        batch = lm.choose_batch([q for q, _ in QUESTIONS], [o for _, o in QUESTIONS], mode,
                                batch_size=2)
        for (question, options), got in zip(QUESTIONS, batch, strict=True):
            alone = lm.choose(question, options, mode)
            np.testing.assert_allclose(got.probabilities, alone.probabilities, atol=1e-5)


def test_recorded_variant_is_the_default(runtime_engine, lm):
    manifest = dataclasses.replace(lm.manifest, export={**lm.manifest.export,
                                                        "cloze_variant": "char"})
    other = CalibratedLM(manifest, lm.backend, lm.tokenizer)
    # unrecorded: the one project-wide default (calm_runtime.modes.DEFAULT_CLOZE_VARIANT)
    assert lm.default_variant == DEFAULT_CLOZE_VARIANT == "mean"
    assert other.default_variant == "char"
    question, options = QUESTIONS[1]
    np.testing.assert_allclose(other.choose(question, options).scores,
                               lm.choose(question, options, variant="char").scores)
    np.testing.assert_allclose(lm.choose(question, options).scores,
                               lm.choose(question, options, variant="mean").scores)


@pytest.mark.parametrize(("template", "chat"), [(None, None), (None, False), ("yes-no", False)])
def test_p_true_equals_training_scoring(lm, runtime_reference_model, hf_tokenizer, chat,
                                        template):
    from calm_training.scoring.answers import score_p_true

    model, adapter = runtime_reference_model
    questions = ["What is the capital of France?", "Who wrote Hamlet?", "2 + 2 ="]
    answers = ["Paris", "Charles Dickens", "4"]
    chosen = p_true_template(template) if template else lm.manifest.p_true()
    two = score_p_true(model, hf_tokenizer, questions, answers, chosen, chat=chat,
                       calibration=adapter, progress=False)
    want = np.exp(two[:, 0]) / np.exp(two).sum(axis=1)
    got = lm.p_true_batch(questions, answers, template=template, chat=chat)
    np.testing.assert_allclose(got, want, atol=ATOL["probabilities"])
    assert lm.p_true(questions[1], answers[1], template=template, chat=chat) == pytest.approx(
        got[1], abs=1e-6)


def test_p_true_needs_single_token_answers(lm):
    from calm_runtime.errors import ConfigError

    # after the chat template the answer tokens lose their space: "Yes" is two tokens here
    with pytest.raises(ConfigError, match="'Yes' is 2 tokens"):
        lm.p_true("Is the sky blue?", "yes", template="yes-no", chat=True)


def test_scoring_in_the_smallest_steps_equals_one_pass(lm, monkeypatch):
    """Continuations in row chunks of 1 and position segments of 1 (a 1-byte budget), and
    prompt scoring in 1-token segments, give the same numbers as one pass; should_stop ends
    a call between steps."""
    from calm_runtime.inference import scoring_passes

    ctx = lm.tokenizer.encode("Question: what is red?\nAnswer:")
    conts = [lm.tokenizer.encode(f" option number {k} is long", add_bos=False)
             for k in range(5)]
    pad = lm.tokenizer.pad_token_id
    whole = scoring_passes.cloze_logprobs(lm.backend, [ctx], [conts], pad, 1)[0]
    steps = scoring_passes.cloze_logprobs(lm.backend, [ctx], [conts], pad, 1, budget_bytes=1,
                                    kv_bytes_per_token=lm.kv_bytes_per_token)[0]
    np.testing.assert_allclose(steps, whole, rtol=0, atol=1e-4)
    with pytest.raises(scoring_passes.ScoringStopped):
        scoring_passes.cloze_logprobs(lm.backend, [ctx], [conts], pad, 1, budget_bytes=1,
                                should_stop=lambda: True)

    prompt = "The quick brown fox jumps over the lazy dog, twice over."
    one = lm.prompt_logprobs(prompt, top=2)
    monkeypatch.setattr(scoring_passes, "SCORING_BUDGET_BYTES", 1)
    many = lm.prompt_logprobs(prompt, top=2)
    assert [t.id for t in many] == [t.id for t in one]
    np.testing.assert_allclose([t.logprob for t in many[1:]], [t.logprob for t in one[1:]],
                               atol=1e-4)
    assert [[a.id for a in t.top] for t in many[1:]] == [[a.id for a in t.top] for t in one[1:]]
    with pytest.raises(scoring_passes.ScoringStopped):
        lm.prompt_logprobs(prompt, should_stop=lambda: True)
