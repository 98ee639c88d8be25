"""CALM's data encoding cuts long records to max_length (its documented truncation) without
tokenising more text than that can hold."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from calm_runtime.data.sets import MultipleChoiceRecord  # noqa: E402
from calm_training.methods.calm import data as calm_data  # noqa: E402
from calm_training.scoring import local as scoring  # noqa: E402


@pytest.mark.parametrize("entropy", ["options", "vocab"])
def test_a_huge_record_is_cut_before_it_is_tokenised(monkeypatch, entropy):
    from conftest import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    seen = []
    real = scoring.encode_text
    monkeypatch.setattr(calm_data, "encode_text", lambda t, text, **k: seen.append(len(text))
                        or real(t, text, **k))
    record = MultipleChoiceRecord("word " * 2_000_000 + "end?", ("yes " * 500_000, "no"), 1)
    labeled = calm_data.encode_training([record], tokenizer, mode="cloze", chat=False,
                                        max_length=64)
    unlabeled = calm_data.encode_calibration([record], tokenizer, mode="cloze", chat=False,
                                             max_length=64, entropy=entropy)
    for example in (*labeled, *unlabeled):
        assert all(len(s) <= 64 for s in example.sequences)
    cap = 64 * scoring.max_token_chars(tokenizer) * scoring.CHARS_PER_TOKEN_MARGIN
    assert seen and max(seen) <= cap + len("Question: \nAnswer: ")
    # the kept context is the end of the question, where the answer follows
    assert tokenizer.decode(labeled[0].sequences[0]).count("end?") == 1
