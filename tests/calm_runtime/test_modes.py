"""The scoring modes' decisions (calm_runtime.modes) and the one option softmax."""

from __future__ import annotations

import numpy as np
import pytest

from calm_runtime import modes
from calm_runtime.data.prompts import CHOICE_MODES
from calm_runtime.errors import ConfigError


def test_each_mode_decides():
    cloze, letter, p_true = (modes.mode(n) for n in ("cloze", "letter", "p_true"))
    assert [m.name for m in (cloze, letter, p_true)] == ["cloze", "letter", "p_true"]
    assert (cloze.choice, letter.choice, p_true.choice) == (True, True, False)
    # cloze: option scores of the asked variant, an answer temperature, text prompts
    assert not cloze.token_level and not cloze.chat_prompts and cloze.fitted_on is None
    assert cloze.score_variant("char") == "char" and cloze.recorded_variant("mean") == "mean"
    assert cloze.answer_temperature(2.5) == 2.5 and cloze.answer_temperature(None) == 1.0
    # letter and P(True): next-token logits, a token-level (fusable) temperature
    for m in (letter, p_true):
        assert m.token_level and m.chat_prompts
        assert m.score_variant("char") == "sum" and m.recorded_variant("mean") is None
        assert m.answer_temperature(2.5) == 1.0
    assert letter.fitted_on == "the option letters' logits"
    assert p_true.fitted_on == "P(True)'s two letters"
    assert modes.MODE_NAMES == ("cloze", "letter", "p_true")
    assert modes.CHOICE_MODES == CHOICE_MODES == ("cloze", "letter")


@pytest.mark.parametrize("name, choice, allowed", [("essay", False, "cloze, letter, p_true"),
                                                   ("p_true", True, "cloze, letter"),
                                                   (None, False, "cloze, letter, p_true")])
def test_unknown_mode_is_one_line(name, choice, allowed):
    with pytest.raises(ConfigError) as info:
        modes.mode(name, choice=choice)
    message = str(info.value)
    assert message == f"unknown mode {name!r}; choose one of {allowed}"
    assert "\n" not in message


def _reference(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_option_probabilities_is_the_softmax():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(5, 4)) * 3
    for t in (1.0, 0.5, 2.0):
        np.testing.assert_allclose(modes.option_probabilities(scores, t), _reference(scores / t),
                                   rtol=1e-12)
        np.testing.assert_allclose(modes.option_probabilities(scores + 123.0, t),
                                   modes.option_probabilities(scores, t), atol=1e-12)
    row = modes.option_probabilities(scores[0])  # one question: a [K] row
    np.testing.assert_allclose(row, _reference(scores[0]), rtol=1e-12)
    assert modes.option_probabilities(scores).dtype == np.float64
    padded = np.array([[1.0, 2.0, -np.inf]])  # an absent option gets probability 0
    probs = modes.option_probabilities(padded)
    assert probs[0, 2] == 0.0 and probs.sum() == pytest.approx(1.0)


def test_a_resolved_mode_travels_as_the_object():
    from calm_runtime import modes
    from calm_runtime.errors import ConfigError

    cloze = modes.mode("cloze")
    assert modes.mode(cloze) is cloze and modes.mode(cloze, choice=True) is cloze
    with pytest.raises(ConfigError, match="is not one of cloze, letter"):
        modes.mode(modes.mode("p_true"), choice=True)
