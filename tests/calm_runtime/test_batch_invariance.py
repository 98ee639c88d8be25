"""Continuous batching changes no answer: rows that join and leave a running batch at random
steps get the tokens and confidences they get alone, on both engine graphs (the builder's
packed cache and calm's own left-padded one).

A replay admits each request at its own arrival step into one
:class:`~calm_runtime.inference.continuous.DecodeBatch` (several at once, or into a batch
mid-decode), drops the rows it cancels, and compares every row with the same request decoded
by itself (``CalibratedLM.generate``): greedy rows token for token, seeded sampled rows too
(their generator is their own), confidences and log-probabilities within the engine's own
tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from calm_runtime.inference.continuous import DecodeBatch  # noqa: E402
from calm_runtime.inference.lm import CalibratedLM  # noqa: E402
from calm_runtime.inference.sampling import DecodeOptions  # noqa: E402

#: float32 graphs run the same arithmetic on rows of different batch widths: confidences
#: agree to rounding (the conformance tests' tolerance)
ATOL = 1e-4

PROMPTS = ["The cat", "Hello there, how are", "A", "Once upon a time in a land far away",
           "1 2 3 4", "Why is the sky", "ok", "The quick brown fox jumps over the lazy"]


@pytest.fixture(scope="module")
def fused_lm(runtime_engine, tmp_path_factory):
    """calm's own graph (left-padded cache, explicit positions) of the runtime engine's
    model and adapter."""
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine

    model_dir, adapter_dir, _ = runtime_engine
    out = tmp_path_factory.mktemp("invariance") / "fused"
    export_engine(model_dir, out, adapter=adapter_dir,
                  config=ExportConfig(graph="fused", greedy_steps=4, progress=False))
    lm = CalibratedLM.load(out, threads=1)
    assert not lm.manifest.packed
    return lm


@pytest.fixture(scope="module")
def builder_lm(runtime_engine):
    lm = CalibratedLM.load(runtime_engine[2], threads=1)
    assert lm.manifest.packed
    return lm


requests = st.lists(
    st.tuples(st.sampled_from(range(len(PROMPTS))),  # prompt
              st.integers(1, 12),  # max new tokens
              st.integers(0, 6),  # arrival step
              st.sampled_from([None, 0.8]),  # temperature (None: greedy)
              st.integers(0, 3),  # seed
              st.sampled_from([None, 3])),  # cancelled after this many tokens
    min_size=1, max_size=7)


def _alone(lm, prompt, limit, temperature, seed):
    options = {} if temperature is None else {"temperature": temperature, "seed": seed}
    return lm.generate(prompt, max_new_tokens=limit, **options)


def _replay(lm, plan):
    """Tokens per request when each joins at its arrival step (and leaves when cancelled)."""
    batch = DecodeBatch(lm.backend, lm.tokenizer)
    tokens = {i: [] for i in range(len(plan))}
    finished = {}
    step = 0
    while len(finished) < len(plan):
        arriving = [i for i, r in enumerate(plan) if r[2] == step and i not in finished]
        if not len(batch) and not arriving:
            arriving = [i for i, r in enumerate(plan) if r[2] > step and i not in finished]
            arriving = [i for i in arriving if plan[i][2] == min(plan[j][2] for j in arriving)]
            step = plan[arriving[0]][2]
        specs = []
        for i in arriving:
            prompt, limit, _, temperature, seed, _ = plan[i]
            decode = (DecodeOptions() if temperature is None
                      else DecodeOptions(temperature=temperature, seed=seed))
            ids = lm.encode_prompt(PROMPTS[prompt])
            specs.append(lm.generation_run([ids], limit, decode=decode).row_specs()[0])
        batch.admit(specs, arriving)
        events, done = batch.choose()
        for i, token in events:
            tokens[i].append(token)
        finished.update(done)
        finished.update(batch.drop(lambda i: plan[i][5] is not None
                                   and len(tokens[i]) >= plan[i][5]))
        batch.advance()
        step += 1
    return tokens, finished


def _check(lm, plan):
    tokens, finished = _replay(lm, plan)
    for i, (prompt, limit, _, temperature, seed, cancel_at) in enumerate(plan):
        want = _alone(lm, PROMPTS[prompt], limit, temperature, seed)
        got = tokens[i]
        n = len(got)
        if cancel_at is not None and n < len(want.tokens):
            assert finished[i].finish_reason == "cancelled"
            assert n == cancel_at
        else:
            assert finished[i].finish_reason == want.finish_reason
            assert finished[i].text == want.text
        assert [t.id for t in got] == [t.id for t in want.tokens[:n]]
        np.testing.assert_allclose([t.confidence for t in got],
                                   [t.confidence for t in want.tokens[:n]], atol=ATOL)
        np.testing.assert_allclose([t.logprob for t in got],
                                   [t.logprob for t in want.tokens[:n]], atol=ATOL, rtol=1e-4)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=requests)
def test_rows_joining_and_leaving_the_builder_graphs_batch_decode_as_alone(builder_lm, plan):
    _check(builder_lm, plan)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=requests)
def test_rows_joining_and_leaving_calm_graphs_batch_decode_as_alone(fused_lm, plan):
    _check(fused_lm, plan)


def test_a_batch_that_never_empties_keeps_its_cache_as_wide_as_its_rows(fused_lm):
    """Rows arriving one after another keep the batch busy for ever; the padded cache is
    cropped when the row that held its width leaves, so it stays as wide as the widest row
    (prompt + tokens so far), not the batch's age."""
    lm = fused_lm
    batch = DecodeBatch(lm.backend, lm.tokenizer)
    ids = lm.encode_prompt(PROMPTS[0])
    decode = DecodeOptions(ignore_eos=True)
    widths = []
    for step in range(60):
        if step % 3 == 0:
            batch.admit(lm.generation_run([ids], 6, decode=decode).row_specs(), [step])
        batch.choose()
        batch.advance()
        widths.append(batch.width)
    assert max(widths[20:]) <= len(ids) + 6
