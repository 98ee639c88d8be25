"""One CalibratedLM shared by 8 threads: 20 mixed calls each give the serial results."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from calm_runtime import CalibratedLM  # noqa: E402
from calm_runtime.errors import ConfigError  # noqa: E402

THREADS = 8
PROMPTS = ["Question: What is the capital of France?\nAnswer:", "Hi there",
           "Question: Which planet is red?\nAnswer:"]
QUESTION, OPTIONS = "Where do penguins live?", ["the Arctic", "Antarctica", "Paris"]

CALLS = [
    lambda lm: lm.generate(PROMPTS[0], max_new_tokens=6),
    lambda lm: lm.generate(PROMPTS[1], max_new_tokens=5, temperature=0.9, seed=1),
    lambda lm: lm.generate(PROMPTS, max_new_tokens=4),
    lambda lm: lm.generate(PROMPTS, max_new_tokens=4, temperature=1.2, top_p=0.8, seed=2),
    lambda lm: lm.generate(PROMPTS[2], max_new_tokens=5, top_alternatives=3),
    lambda lm: tuple(lm.stream(PROMPTS[0], max_new_tokens=5, temperature=0.7, seed=3)),
    lambda lm: lm.generate(PROMPTS[1], max_new_tokens=3, chat=True),
    lambda lm: lm.choose(QUESTION, OPTIONS),
    lambda lm: lm.choose(QUESTION, OPTIONS, mode="letter"),
    lambda lm: lm.choose(QUESTION, OPTIONS, variant="mean"),
    lambda lm: lm.choose_batch([QUESTION, "Which is prime?"], [OPTIONS, ["4", "7"]]),
    lambda lm: lm.choose_batch([QUESTION, "Which is prime?"], [OPTIONS, ["4", "7"]], "letter"),
    lambda lm: lm.p_true("What is 2 + 2?", "4"),
    lambda lm: lm.p_true("Who wrote Hamlet?", "Dickens", template="yes-no", chat=False),
    lambda lm: lm.p_true_batch(["a?", "b?", "c?"], ["x", "y", "z"]),
    lambda lm: lm.generate(PROMPTS[2], max_new_tokens=7, temperature=1.0, top_k=5, seed=9),
    lambda lm: _error(lm.generate, ""),  # errors in one thread leave the others alone
    lambda lm: _error(lm.choose, QUESTION, ["one"]),
    lambda lm: lm.generate([PROMPTS[0], PROMPTS[0]], max_new_tokens=5, temperature=1, seed=4),
    lambda lm: lm.generate(PROMPTS[1], max_new_tokens=8, stop=" "),
]


def _error(fn, *args):
    try:
        fn(*args)
    except ConfigError as exc:
        return f"ConfigError: {exc}"
    raise AssertionError("expected a ConfigError")


def _plain(result):
    """A comparable form: token ids, texts and confidences; option probabilities."""
    if isinstance(result, (list, tuple)):
        return [_plain(r) for r in result]
    if hasattr(result, "tokens"):
        return (result.text, result.finish_reason, _plain(list(result.tokens)))
    if hasattr(result, "probabilities"):
        return ("choice", result.prediction, np.round(result.probabilities, 6).tolist())
    if hasattr(result, "entropy"):
        top = None if result.top is None else [(a.id, round(a.confidence, 6)) for a in result.top]
        return (result.id, result.text, round(result.confidence, 6), top)
    if isinstance(result, np.ndarray):
        return np.round(result, 6).tolist()
    if isinstance(result, float):
        return round(result, 6)
    return result


def test_threads_give_the_serial_results(runtime_engine):
    lm = CalibratedLM.load(runtime_engine[2], threads=2)
    assert len(CALLS) == 20
    serial = [_plain(call(lm)) for call in CALLS]
    barrier = threading.Barrier(THREADS)

    def worker(seed: int):
        order = np.random.default_rng(seed).permutation(len(CALLS))
        barrier.wait()
        return {int(i): _plain(CALLS[i](lm)) for i in order}

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(worker, range(THREADS)))
    for thread, got in enumerate(results):
        for i, value in got.items():
            assert value == serial[i], f"thread {thread}, call {i} differs from the serial call"
