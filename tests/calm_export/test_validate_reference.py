"""The export's reference rollouts: all cases in one batch equal each case on its own."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from calm_export import validate  # noqa: E402
from calm_runtime.data.models import load_model_and_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_the_cases_rolled_out_together_equal_each_case_alone(tiny_llama_untied):
    model, tokenizer, _ = load_model_and_tokenizer(tiny_llama_untied)
    cases = validate.build_cases(tokenizer, validate.default_prompts(), pad_id=0)
    run = validate.torch_reference_runner(model, None)
    alone = validate.run_cases(run, cases, steps=6)
    together = validate.run_cases_together(run, cases, steps=6)
    assert len(together) == len(cases) == 4
    for case, a, b in zip(cases, alone, together, strict=True):
        real = case.attention_mask.astype(bool)
        assert b.prefill.shape == a.prefill.shape
        np.testing.assert_allclose(b.prefill[real], a.prefill[real], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(b.next_logits, a.next_logits, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(b.tokens, a.tokens)
