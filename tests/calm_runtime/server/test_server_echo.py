"""Prompt scoring: ``CalibratedLM.prompt_logprobs`` and ``echo`` with ``max_tokens`` 0 in
``calm serve``, checked against the runtime's own cloze scores."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from calm_runtime.data.prompts import cloze_context, cloze_continuation  # noqa: E402

NAME = "tiny"
QUESTIONS = [("what is red?", ("fire", "the blue sun", "dog")),
             ("which cat is blue?", ("A dog", "moon"))]


def test_prompt_logprobs_give_the_cloze_scores(runtime_lm):
    for question, options in QUESTIONS:
        context = cloze_context(question)
        want = runtime_lm.choose(question, options, variant="sum").scores
        got = []
        for option in options:
            prompt = context + cloze_continuation(option)
            tokens = runtime_lm.prompt_logprobs(prompt)
            assert "".join(t.text for t in tokens) == prompt
            assert tokens[0].logprob is None and all(t.logprob < 0 for t in tokens[1:])
            got.append(sum(t.logprob for t in tokens if t.offset >= len(context)))
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_prompt_logprobs_alternatives(runtime_lm):
    tokens = runtime_lm.prompt_logprobs("The cat sat on the", top=4)
    for token in tokens[1:]:
        probs = [a.confidence for a in token.top]
        assert len(probs) == 4 and probs == sorted(probs, reverse=True)
        assert np.log(probs[0]) >= token.logprob - 1e-6


def test_echo_returns_the_prompt_log_probabilities(runtime_openai, runtime_lm):
    prompt = cloze_context("what is red?") + cloze_continuation("the blue sun")
    out = runtime_openai.completions.create(model=NAME, prompt=[prompt, "The cat sat"],
                                            max_tokens=0, echo=True, logprobs=5,
                                            temperature=0)
    assert [c.text for c in out.choices] == [prompt, "The cat sat"]
    assert out.usage.completion_tokens == 0
    logprobs = out.choices[0].logprobs
    want = runtime_lm.prompt_logprobs(prompt, top=5)
    assert logprobs.tokens == [t.text for t in want]
    assert logprobs.text_offset == [t.offset for t in want]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(logprobs.token_logprobs[1:], [t.logprob for t in want[1:]],
                               atol=1e-5)
    assert all(len(top) <= 5 for top in logprobs.top_logprobs[1:])


@pytest.mark.parametrize(("body", "words"), [
    ({"echo": True, "max_tokens": 3}, "echo is supported for prompt scoring"),
    ({"max_tokens": 0}, "max_tokens 0 generates nothing"),
    ({"echo": True, "max_tokens": 0, "stream": True}, "echo with stream"),
])
def test_echo_misuse_is_a_400(runtime_openai, body, words):
    with pytest.raises(openai.BadRequestError, match=words):
        runtime_openai.completions.create(model=NAME, prompt="The cat", **body)


def test_the_remote_scorer_against_calm_serve_equals_the_engine(runtime_openai, runtime_lm,
                                                                tmp_path, monkeypatch):
    """calm's own client for served models, in cloze and letter mode, reads the same numbers
    the engine gives locally."""
    from calm_runtime.data.sets import MultipleChoiceRecord
    from calm_training.scoring import served as remote

    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    records = [MultipleChoiceRecord(q, o, 0) for q, o in QUESTIONS]
    endpoint = remote.connect(str(runtime_openai.base_url).rstrip("/"), concurrency=2)
    cloze, _ = remote.remote_option_scores(endpoint, records, mode="cloze", progress=False)
    for row, (question, options) in enumerate(QUESTIONS):
        np.testing.assert_allclose(cloze.values[row, :len(options)],
                                   runtime_lm.choose(question, options, variant="sum").scores,
                                   atol=1e-4)
        want_mean = runtime_lm.choose(question, options, variant="mean").scores
        np.testing.assert_allclose(cloze.scores("mean")[row, :len(options)], want_mean,
                                   atol=1e-4)
    # letter mode: each letter's value is its full-vocabulary log-probability after the
    # prompt: read from the 20 alternatives when it is among them, else scored by echo
    from calm_runtime.data.prompts import letter_prompt, letter_tokens

    letter, stats = remote.remote_option_scores(endpoint, records, mode="letter",
                                                progress=False)
    assert stats.floored == 0
    for row, (question, options) in enumerate(QUESTIONS):
        prompt = letter_prompt(question, options)
        for k, token in enumerate(letter_tokens(len(options), chat=False)):
            scored = runtime_lm.prompt_logprobs(prompt + token)
            assert scored[-1].offset == len(prompt) and scored[-1].text == token
            assert letter.values[row, k] == pytest.approx(scored[-1].logprob, abs=1e-4)
