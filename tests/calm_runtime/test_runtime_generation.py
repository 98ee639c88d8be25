"""Generation on the ONNX Runtime backend against an independent torch reference.

The reference runs the engine's source model (LoRA merged) on the whole sequence at every
step — no KV cache, no padding — applies the calibration with the formula module
(``CalibrationAdapter.calibrate``), computes probabilities and entropy in float64 with
``softmax`` directly, and samples by the documented rule with a full sort of the
vocabulary (see ``calm_runtime.inference.sampling``). Tolerances: see ``TOLERANCE``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import tiny_tokenizer  # noqa: E402

from calm_runtime import CalibratedLM  # noqa: E402
from calm_runtime.errors import ConfigError  # noqa: E402
from calm_runtime.inference.generation import DecodeSettings, GenerationRun  # noqa: E402
from calm_runtime.inference.sampling import SamplingParams  # noqa: E402

#: |runtime - reference| allowed. The engine matches the reference's calibrated logits to
#: ~1e-5 here (validated by calm-export to 1e-4 + 1e-4 * scale); probabilities move by at
#: most about that, log-probabilities and entropies by about twice the logit error.
TOLERANCE = {"confidence": 2e-4, "logprob": 2e-3, "entropy": 2e-3}

PROMPTS = ["Question: What is the capital of France?\nAnswer:",
           "Hi",
           "Question: Which planet is known as the red planet, and why is it red?\nAnswer:"]


@pytest.fixture(scope="module")
def lm(runtime_engine):
    return CalibratedLM.load(runtime_engine[2], backend="onnxruntime", threads=1)


@pytest.fixture(scope="module")
def hf_tokenizer(runtime_engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(runtime_engine[0]))


def reference_step(model, adapter, ids):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    z = adapter.calibrate(logits).double().numpy()
    p = np.exp(z - z.max())
    p /= p.sum()
    return z, p


def reference_pick(z, temperature, top_k, top_p, u):
    """The documented sampling rule, written with a full stable sort."""
    weights = np.exp((z - z.max()) / temperature)
    order = np.lexsort((np.arange(z.size), -weights))
    if top_k:
        order = order[:top_k]
    if top_p < 1.0:
        mass = weights[order]
        before = np.cumsum(mass) - mass
        order = order[:max(1, int(np.count_nonzero(before < top_p * mass.sum())))]
    candidates = np.sort(order)
    cumulative = np.cumsum(weights[candidates])
    return int(candidates[min(np.searchsorted(cumulative, u * cumulative[-1], side="right"),
                              candidates.size - 1)])


def reference_generate(model, adapter, prompt_ids, max_new, *, eos=(), temperature=0.0,
                       top_k=0, top_p=1.0, seed=None, row=0, rows=1, valid=None):
    """The documented rule step by step; ``valid`` (default the tiny tokenizer's size, below
    the tiny model's 300 rows): ids past it are never chosen, their probability stays."""
    if valid is None:
        valid = len(tiny_tokenizer())
    generator = None
    if temperature:
        child = np.random.SeedSequence(seed).spawn(rows)[row]
        generator = np.random.Generator(np.random.PCG64(child))
    ids, out = list(prompt_ids), []
    for _ in range(max_new):
        z, p = reference_step(model, adapter, ids)
        token = (int(np.argmax(z[:valid])) if not temperature else
                 reference_pick(z[:valid], temperature, top_k, top_p, generator.random()))
        entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
        out.append((token, float(p[token]), float(np.log(p[token])), entropy))
        ids.append(token)
        if token in eos:
            break
    return out


def assert_matches(generation, reference, what):
    got = [t.id for t in generation.tokens]
    want = [r[0] for r in reference]
    assert got == want, f"{what}: tokens {got} != reference {want}"
    for name, index in (("confidence", 1), ("logprob", 2), ("entropy", 3)):
        values = np.array([getattr(t, name) for t in generation.tokens])
        expected = np.array([r[index] for r in reference])
        diff = float(np.max(np.abs(values - expected)))
        assert diff <= TOLERANCE[name], f"{what}: max |{name} diff| {diff:.3g}"


def test_greedy_batch_of_one_matches_the_reference(lm, runtime_reference_model, hf_tokenizer):
    model, adapter = runtime_reference_model
    out = lm.generate(PROMPTS[0], max_new_tokens=12)
    prompt_ids = hf_tokenizer(PROMPTS[0])["input_ids"]
    assert out.prompt_tokens == len(prompt_ids)
    assert_matches(out, reference_generate(model, adapter, prompt_ids, 12), "greedy")
    assert out.finish_reason == "length" and len(out.tokens) == 12
    joint = float(np.prod([t.confidence for t in out.tokens]))
    assert out.joint_confidence == pytest.approx(joint, rel=1e-9)
    assert out.sequence_confidence == pytest.approx(joint ** (1 / 12), rel=1e-9)
    assert out.timing.prefill_s > 0 and out.timing.decode_steps == 11


def test_greedy_batch_of_three_matches_each_prompt_alone(lm, runtime_reference_model,
                                                          hf_tokenizer):
    model, adapter = runtime_reference_model
    outs = lm.generate(PROMPTS, max_new_tokens=10)
    assert len({len(hf_tokenizer(p)["input_ids"]) for p in PROMPTS}) == 3  # really padded
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = hf_tokenizer(prompt)["input_ids"]
        assert_matches(out, reference_generate(model, adapter, ids, 10), f"batch row {prompt!r}")


@pytest.mark.parametrize("settings", [
    {"temperature": 1.0, "seed": 3},
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7},
    {"temperature": 1.3, "top_p": 0.5, "seed": 11},
])
def test_seeded_sampling_matches_the_reference(lm, runtime_reference_model, hf_tokenizer,
                                               settings):
    model, adapter = runtime_reference_model
    outs = lm.generate(PROMPTS, max_new_tokens=8, **settings)
    for row, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        ids = hf_tokenizer(prompt)["input_ids"]
        want = reference_generate(model, adapter, ids, 8, row=row, rows=3, **settings)
        assert_matches(out, want, f"sampling {settings} row {row}")
    # a prompt alone samples what it sampled as row 0 of the batch
    alone = lm.generate(PROMPTS[0], max_new_tokens=8, **settings)
    assert alone.token_ids == outs[0].token_ids


def test_streaming_equals_generate(lm):
    for options in ({}, {"temperature": 0.9, "top_k": 30, "seed": 5}):
        out = lm.generate(PROMPTS[2], max_new_tokens=9, top_alternatives=3, **options)
        streamed = list(lm.stream(PROMPTS[2], max_new_tokens=9, top_alternatives=3, **options))
        assert tuple(streamed) == out.tokens
        assert "".join(t.text for t in streamed) == out.text


def test_stop_string_cuts_the_text(lm):
    sampled = {"temperature": 1.0, "seed": 3}  # varied text (greedy repeats one token)
    full = lm.generate(PROMPTS[0], max_new_tokens=16, **sampled)
    text = full.text
    k = next(i for i in range(len(text) // 2, len(text) - 1) if text.find(text[i:i + 2]) == i)
    stop = text[k:k + 2]
    out = lm.generate(PROMPTS[0], max_new_tokens=16, stop=["never-there", stop], **sampled)
    assert out.finish_reason == "stop"
    assert out.text == text[:k]
    assert out.token_ids == full.token_ids[:len(out.tokens)]
    assert "".join(t.text for t in out.tokens).startswith(text[:k] + stop)


def test_eos_and_length_finish(lm):
    full = lm.generate(PROMPTS[1], max_new_tokens=6)
    eos = full.token_ids[2]
    first = full.token_ids.index(eos)
    settings = DecodeSettings(max_new_tokens=(6,), sampling=SamplingParams(), stop=(),
                              top_alternatives=0, eos_ids=frozenset({eos}))
    run = GenerationRun(lm.backend, lm.tokenizer, [lm.encode_prompt(PROMPTS[1])], settings)
    streamed = [token for _, token in run]
    (result,) = run.results
    assert result.finish_reason == "eos" and result.token_ids == full.token_ids[:first + 1]
    assert [t.id for t in streamed] == result.token_ids
    one = lm.generate(PROMPTS[1], max_new_tokens=1)
    assert one.finish_reason == "length" and one.token_ids == full.token_ids[:1]


def test_ignore_eos_decodes_past_the_end_token(lm, monkeypatch):
    """``ignore_eos=True`` runs to ``max_new_tokens`` through a token that would end it,
    with the tokens of a run that never met it."""
    full = lm.generate(PROMPTS[1], max_new_tokens=6)
    eos = full.token_ids[2]
    first = full.token_ids.index(eos)  # at most 2: the run ends early unless told not to
    monkeypatch.setattr(lm.tokenizer, "eos_token_ids", (eos,))
    ended = lm.generate(PROMPTS[1], max_new_tokens=6)
    assert ended.finish_reason == "eos" and ended.token_ids == full.token_ids[:first + 1]
    kept = lm.generate(PROMPTS[1], max_new_tokens=6, ignore_eos=True)
    assert kept.finish_reason == "length" and kept.token_ids == full.token_ids
    assert [t.confidence for t in kept.tokens] == [t.confidence for t in full.tokens]


def test_tokens_and_confidences_equal_onnxruntime_genais(runtime_engine, lm):
    """On the builder's graph, calm's runtime chooses onnxruntime-genai's greedy tokens and
    each token's confidence is the softmax of the logits genai's own generator computed
    (float64 here), to float32 rounding: the decode loop, its KV cache and its IO binding
    change nothing the graph computes."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    assert lm.manifest.packed  # the default graph is the builder's
    prompt = lm.encode_prompt(PROMPTS[0])
    new = 12
    model = og.Model(str(runtime_engine[2]))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt], dtype=np.int32))
    tokens, confidences = [], []
    while not generator.is_done():
        generator.generate_next_token()  # runs the last token (if any), then chooses
        logits = np.asarray(generator.get_output("logits"), dtype=np.float64)[0, -1]
        token = int(generator.get_next_tokens()[0])
        p = np.exp(logits - logits.max())
        tokens.append(token)
        confidences.append(p[token] / p.sum())
    settings = DecodeSettings(max_new_tokens=(new,), sampling=SamplingParams(), stop=(),
                              top_alternatives=0, eos_ids=frozenset())
    run = GenerationRun(lm.backend, lm.tokenizer, [prompt], settings)
    for _ in run:
        pass
    (got,) = run.results
    assert len(tokens) == new and got.token_ids == tokens
    np.testing.assert_allclose([t.confidence for t in got.tokens], confidences, rtol=1e-5,
                               atol=1e-7)


def test_top_alternatives_are_the_most_probable_tokens(lm, runtime_reference_model,
                                                       hf_tokenizer):
    model, adapter = runtime_reference_model
    out = lm.generate(PROMPTS[0], max_new_tokens=3, top_alternatives=5)
    ids = hf_tokenizer(PROMPTS[0])["input_ids"]
    _, p = reference_step(model, adapter, ids)
    first = out.tokens[0]
    assert [a.id for a in first.top] == list(np.argsort(-p, kind="stable")[:5])
    assert first.top[0].id == first.id and first.top[0].confidence == first.confidence
    np.testing.assert_allclose([a.confidence for a in first.top], np.sort(p)[::-1][:5],
                               atol=TOLERANCE["confidence"])
    assert lm.generate(PROMPTS[0], max_new_tokens=2).tokens[0].top is None


def test_chat_template_renders_like_transformers(lm, hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 2?"}]
    for add in (True, False):
        want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add,
                                                tokenize=False)
        assert lm.tokenizer.render_chat(messages, add_generation_prompt=add) == want
    rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                add_generation_prompt=True, tokenize=False)
    assert lm.encode_prompt("Hi", chat=True) == hf_tokenizer(
        rendered, add_special_tokens=False)["input_ids"]
    assert lm.generate("Hi", max_new_tokens=3, chat=True).prompt_tokens == len(
        hf_tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_incremental_token_text_rebuilds_multibyte_text(lm):
    from calm_runtime.inference.tokenization import IncrementalDecoder

    text = " naïve café — 東京 😀 done"
    ids = lm.tokenizer.encode(text, add_bos=False)
    decoder = IncrementalDecoder(lm.tokenizer, lm.tokenizer.encode("Say:"))
    pieces = [decoder.step(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert "" in pieces  # some tokens end inside a character; their text comes later


def test_long_prompts_are_prefilled_in_chunks(runtime_engine, lm):
    chunked = CalibratedLM.load(runtime_engine[2], threads=1)
    chunked.backend.max_logits_bytes = 4 * chunked.manifest.vocab_size * 3 * 7  # 7 positions
    want = lm.generate(PROMPTS, max_new_tokens=5)
    for got, ref in zip(chunked.generate(PROMPTS, max_new_tokens=5), want, strict=True):
        assert got.token_ids == ref.token_ids
        np.testing.assert_allclose([t.confidence for t in got.tokens],
                                   [t.confidence for t in ref.tokens], atol=1e-5)
    np.testing.assert_allclose(chunked.p_true_batch(PROMPTS, ["a", "b", "c"]),
                               lm.p_true_batch(PROMPTS, ["a", "b", "c"]), atol=1e-5)


def test_generation_run_takes_a_limit_per_row(lm):
    prompts = ["Question: what is red?\nAnswer:", "The cat", "One two three"]
    limits = [3, 9, 5]
    run = lm.generation_run([lm.encode_prompt(p) for p in prompts], limits)
    events = list(run)
    for row, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        alone = lm.generate(prompt, max_new_tokens=limit)
        got = run.results[row]
        assert got.token_ids == alone.token_ids and got.text == alone.text
        assert len(got.tokens) <= limit
        np.testing.assert_allclose([t.confidence for t in got.tokens],
                                   [t.confidence for t in alone.tokens], atol=1e-5)
        assert [t.id for r, t in events if r == row] == got.token_ids
    with pytest.raises(ConfigError, match="3 max_new_tokens for 2 prompts"):
        lm.generation_run([[1, 5], [1, 6]], [1, 2, 3])
    with pytest.raises(ConfigError, match="max_new_tokens must be a positive integer"):
        lm.generation_run([[1, 5]], [0])


# ---------------------------------------------------------------------- cancellation
def test_generation_run_drops_cancelled_rows_and_keeps_the_others(lm):
    """A row cancelled mid-run stops at once (``finish_reason="cancelled"``) and leaves the
    batch; the other rows decode exactly as alone."""
    prompts = ["Question: what is red?\nAnswer:", "The cat", "One two three"]
    alone = [lm.generate(p, max_new_tokens=12) for p in prompts]
    assert len(alone[1].tokens) > 3  # the row to cancel would run past the cut
    cancelled = set()
    run = lm.generation_run([lm.encode_prompt(p) for p in prompts], 12,
                            cancelled=lambda row: row in cancelled)
    seen = [0, 0, 0]
    for row, _ in run:
        seen[row] += 1
        if row == 1 and seen[1] == 2:
            cancelled.add(1)
    assert run.results[1].finish_reason == "cancelled"
    assert len(run.results[1].tokens) == 2
    assert run.results[1].token_ids == alone[1].token_ids[:2]
    for row in (0, 2):
        assert run.results[row].token_ids == alone[row].token_ids
        assert run.results[row].finish_reason == alone[row].finish_reason


def test_generation_run_ends_when_every_row_is_cancelled(lm):
    calls = []

    class Counting:
        def __init__(self, backend):
            self._backend = backend

        def run(self, *args, **kwargs):
            calls.append(1)
            return self._backend.run(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._backend, name)

    counted = CalibratedLM(lm.manifest, Counting(lm.backend), lm.tokenizer)
    run = counted.generation_run([lm.encode_prompt("The cat"), lm.encode_prompt("The dog")],
                                 50, cancelled=lambda row: True)
    events = list(run)
    assert len(events) == 2 and len(calls) == 1  # the prefill's tokens, then no decode step
    assert [g.finish_reason for g in run.results] == ["cancelled", "cancelled"]
    # prompts of different lengths take a pass each on a packed engine: asked before the
    # first, every row gone, nothing runs
    calls.clear()
    run = counted.generation_run([lm.encode_prompt("The cat"), lm.encode_prompt("Hi")], 50,
                                 cancelled=lambda row: True)
    events = list(run)
    assert len(events) <= 2 and len(calls) <= 1
    assert [g.finish_reason for g in run.results] == ["cancelled", "cancelled"]


def test_a_temperature_below_float32s_range_samples_the_best_token(lm):
    """``temperature=1e-300`` is greedy's limit; it used to divide by float32(0) = NaN."""
    import warnings

    greedy = lm.generate(PROMPTS[0], max_new_tokens=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for temperature in (1e-300, 1e-42):
            tiny = lm.generate(PROMPTS[0], max_new_tokens=6, temperature=temperature, seed=3)
            assert tiny.token_ids == greedy.token_ids, temperature


# ---------------------------------------------------------------------- context length
class _CountingBackend:
    """The engine's backend, counting forward passes (no input may reach it unchecked)."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.calls = 0

    def run(self, *args, **kwargs):
        self.calls += 1
        return self._backend.run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


LONG = "word " * 300  # 1500 byte tokens: far past the tiny model's 256-token context


@pytest.mark.parametrize("call, message", [
    (lambda lm: lm.generate(["Hi", LONG]),
     r"^prompt 2 of 2 is \d+ tokens but the model's context is 256; shorten the prompt$"),
    (lambda lm: lm.generate("a" * 255),
     r"^the prompt is 256 tokens and fills the model's context of 256; shorten it"),
    (lambda lm: lm.generation_run([[1, 5], [1] * 256], 4),
     r"^prompt 2 of 2 is 256 tokens and fills the model's context of 256"),
    (lambda lm: lm.generation_run([[1, 5], []], 4), r"^prompt 2 of 2 has no token ids"),
    (lambda lm: lm.generation_run([[1, 10 ** 6]], 4),
     r"^the prompt has token id 1000000, outside this model's vocabulary of \d+"),
    (lambda lm: lm.stream(LONG), r"^the prompt is \d+ tokens but the model's context is 256"),
    (lambda lm: lm.choose_batch(["q", LONG], [["a", "b"], ["c", "d"]]),
     r"^question 2 of 2 with option \d \(question and option\) is \d+ tokens but the "
     r"model's context is 256; shorten the question or options$"),
    (lambda lm: lm.choose("Pick one", ["a", LONG]),
     r"^the question with option 2 \(question and option\) is \d+ tokens but the model's "
     "context is 256"),
    (lambda lm: lm.choose_batch(["q", LONG], [["a", "b"], ["c", "d"]], mode="letter",
                                chat=False),
     r"^question 2 of 2 as a letter-mode prompt is \d+ tokens but the model's context is 256"),
    (lambda lm: lm.p_true_batch(["q", "q"], ["a", LONG]),
     r"^the P\(True\) prompt of question 2 of 2 is \d+ tokens but the model's context is "
     r"256; shorten the question or the answer$"),
    (lambda lm: lm.p_true(LONG, "a"), r"^the P\(True\) prompt of the question is \d+ tokens"),
])
def test_every_input_is_checked_against_the_context_before_running(lm, call, message):
    """Each over-long input raises a one-line ConfigError naming it, its token count and the
    limit, before a single forward pass (nothing is padded or allocated by its size)."""
    import re

    counting = _CountingBackend(lm.backend)
    guarded = CalibratedLM(lm.manifest, counting, lm.tokenizer)
    with pytest.raises(ConfigError) as info:
        result = call(guarded)
        if hasattr(result, "__iter__") and not isinstance(result, list):
            list(result)  # a run or stream raises before its first step
    text = str(info.value)
    assert "\n" not in text and re.search(message, text), text
    assert counting.calls == 0


@pytest.mark.parametrize("call", [
    lambda lm: lm.generate("a\ud800"),
    lambda lm: lm.generate(["ok", "\udfffb"]),
    lambda lm: lm.choose("q\udc00", ["a", "b"]),
    lambda lm: lm.choose("q", ["a", "b\ud800"], mode="letter"),
    lambda lm: lm.p_true("q", "\ud800"),
])
def test_lone_surrogates_are_a_config_error(lm, call):
    """Text the tokenizer cannot take is refused with a ConfigError (it was a TypeError)."""
    with pytest.raises(ConfigError, match="lone UTF-16 surrogate"):
        call(lm)
