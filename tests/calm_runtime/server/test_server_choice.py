"""Calibrated constrained choices in ``calm serve`` (vLLM's ``structured_outputs.choice`` and
``guided_choice``), through the official ``openai`` runtime_openai, against the runtime."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from calm_runtime.data.prompts import cloze_context  # noqa: E402

NAME = "tiny"
QUESTION, OPTIONS = "what is red?", ["fire", "the blue sun", "dog"]


@pytest.mark.parametrize("parameter", ["structured_outputs", "guided_choice"])
def test_cloze_choice_equals_choose(runtime_openai, runtime_lm, parameter):
    choices = [" " + o for o in OPTIONS]  # choose() scores " option" after the context
    body = ({"structured_outputs": {"choice": choices}} if parameter == "structured_outputs"
            else {"guided_choice": choices})
    out = runtime_openai.completions.create(model=NAME, prompt=cloze_context(QUESTION),
                                            max_tokens=8, extra_body=body)
    calm = out.choices[0].model_extra["calm"]
    probs = np.array(calm["option_probabilities"])
    want = runtime_lm.choose(QUESTION, OPTIONS)
    assert abs(probs.sum() - 1) < 1e-6
    np.testing.assert_allclose(probs, want.probabilities, atol=1e-4)
    assert out.choices[0].text == choices[int(np.argmax(probs))]
    assert calm["confidence"] == pytest.approx(want.confidence, abs=1e-4)
    assert "abstained" not in calm


def test_letter_choice_and_abstention(runtime_openai, runtime_lm):
    body = {"guided_choice": OPTIONS, "calm": {"choice_mode": "letter", "abstain_below": 0.99}}
    out = runtime_openai.completions.create(model=NAME, prompt=QUESTION, max_tokens=4,
                                    extra_body=body)
    calm = out.choices[0].model_extra["calm"]
    want = runtime_lm.choose(QUESTION, OPTIONS, mode="letter", chat=False)
    np.testing.assert_allclose(calm["option_probabilities"], want.probabilities, atol=1e-4)
    assert calm["abstained"] is True and calm["choice_mode"] == "letter"
    assert out.choices[0].text == OPTIONS[want.prediction]  # the answer is still given
    body["calm"]["abstain_below"] = 0.0
    out = runtime_openai.completions.create(model=NAME, prompt=QUESTION, max_tokens=4,
                                    extra_body=body)
    assert out.choices[0].model_extra["calm"]["abstained"] is False


def test_chat_choice(runtime_openai, runtime_lm):
    out = runtime_openai.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTION}],
        extra_body={"structured_outputs": {"choice": OPTIONS}})
    calm = out.choices[0].model_extra["calm"]
    ids = runtime_lm.tokenizer.encode(runtime_lm.tokenizer.render_chat(QUESTION), add_bos=False)
    want = runtime_lm.choose_continuation(ids, OPTIONS)
    np.testing.assert_allclose(calm["option_probabilities"], want.probabilities, atol=1e-4)
    assert out.choices[0].message.content == OPTIONS[want.prediction]


@pytest.mark.parametrize(("choices", "words"), [
    ([], "2 to 64 choices"), (["only"], "2 to 64 choices"), (["a", "a"], "distinct"),
    ([f"c{i}" for i in range(1000)], "2 to 64 choices"), (["a", "b" * 5000], "at most 1000"),
    (["a", " "], "non-empty"),
])
def test_bad_choices_are_400(runtime_openai, choices, words):
    with pytest.raises(openai.BadRequestError, match=words):
        runtime_openai.completions.create(model=NAME, prompt="The cat", max_tokens=4,
                                  extra_body={"guided_choice": choices})


def test_other_structured_outputs_and_stream_are_400(runtime_openai):
    with pytest.raises(openai.BadRequestError, match="only 'choice'"):
        runtime_openai.completions.create(model=NAME, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {}})
    with pytest.raises(openai.BadRequestError, match="answered whole"):
        runtime_openai.completions.create(model=NAME, prompt="x", max_tokens=4, stream=True,
                                  extra_body={"guided_choice": ["a", "b"]})


def test_more_choices_than_letters(runtime_openai, runtime_lm):
    """Cloze choices need no letters: 40 choices (more than A..Z) are scored."""
    choices = [f" word{i}" for i in range(40)]
    out = runtime_openai.completions.create(model=NAME, prompt="The cat", max_tokens=4,
                                            extra_body={"guided_choice": choices})
    probs = out.choices[0].model_extra["calm"]["option_probabilities"]
    ids = runtime_lm.tokenizer.encode("The cat")
    np.testing.assert_allclose(probs, runtime_lm.choose_continuation(ids, choices).probabilities,
                               atol=1e-4)


def test_engine_recorded_mode_and_threshold_are_the_defaults(runtime_engine, runtime_lm,
                                                            tmp_path):
    """An engine whose manifest records a letter-mode threshold: a request that names neither
    mode nor threshold gets letter scoring and the engine's threshold; a request's own
    settings still win."""
    import json
    import shutil

    from calm_runtime.server import ServeConfig, create_app
    from calm_runtime.server.background import serve_in_background

    engine = tmp_path / "engine"
    shutil.copytree(runtime_engine[2], engine)
    path = engine / "calm_engine.json"
    manifest = json.loads(path.read_text())
    manifest["export"]["choice_mode"] = "letter"
    manifest["export"]["abstention"] = {"threshold": 0.99, "mode": "letter"}
    path.write_text(json.dumps(manifest))
    config = ServeConfig(engine=str(engine), model_name=NAME, threads=1)
    with serve_in_background(create_app(config)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=NAME, prompt=QUESTION, max_tokens=4,
                                        extra_body={"guided_choice": OPTIONS})
        calm = out.choices[0].model_extra["calm"]
        want = runtime_lm.choose(QUESTION, OPTIONS, mode="letter", chat=False)
        assert calm["choice_mode"] == "letter" and calm["abstain_below"] == 0.99
        np.testing.assert_allclose(calm["option_probabilities"], want.probabilities, atol=1e-4)
        assert calm["abstained"] is (want.confidence < 0.99)
        out = client.completions.create(
            model=NAME, prompt=cloze_context(QUESTION), max_tokens=4,
            extra_body={"guided_choice": [" " + o for o in OPTIONS],
                        "calm": {"choice_mode": "cloze", "abstain_below": 0.0}})
        calm = out.choices[0].model_extra["calm"]
        assert calm["choice_mode"] == "cloze" and calm["abstained"] is False
        np.testing.assert_allclose(calm["option_probabilities"],
                                   runtime_lm.choose(QUESTION, OPTIONS).probabilities, atol=1e-4)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"logprobs": 1}, "logprobs"),
    ({"stop": ["\n"]}, "stop"),
    ({"extra_body": {"ignore_eos": True}}, "ignore_eos"),
    ({"extra_body": {"calm": {"p_true": True}}}, "calm.p_true"),
    ({"echo": True, "max_tokens": 0}, "echo"),
    ({"max_tokens": 10**9}, "max_tokens"),
])
def test_fields_a_choice_cannot_honour_are_400_naming_them(runtime_openai, kwargs, field):
    """A constrained choice refuses what it would otherwise ignore silently."""
    extra = {"guided_choice": ["a", "b"], **kwargs.pop("extra_body", {})}
    body = {"max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError, match=field.replace(".", r"\.")) as caught:
        runtime_openai.completions.create(model=NAME, prompt="x", extra_body=extra, **body)
    assert caught.value.body["param"] == field


def test_chat_choice_with_logprobs_is_400(runtime_openai):
    with pytest.raises(openai.BadRequestError, match="logprobs is not supported"):
        runtime_openai.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], logprobs=True,
            extra_body={"guided_choice": ["a", "b"]})
