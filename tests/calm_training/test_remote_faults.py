"""The remote scorer against a scripted OpenAI-compatible server on loopback: faults give a
successful retry or a one-line error, never a wrong number, and the cache keeps what was
scored before the failure."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
from conftest import JSONHandler, loopback_server

from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import CalmError, ConfigError
from calm_training.scoring import endpoint as http_endpoint
from calm_training.scoring import served as remote

RECORDS = [MultipleChoiceRecord(f"question {i}?", ("yes", "no", "maybe"), i % 3)
           for i in range(6)]


def _letter_answer(prompt: str) -> dict:
    i = int(prompt.split("question ")[1].split("?")[0])
    top = {" A": -0.5 - i / 10, " B": -1.5, " C": -2.5 + i / 10, " the": -3.0}
    return {"choices": [{"text": " A", "index": 0, "finish_reason": "length",
                         "logprobs": {"tokens": [" A"], "token_logprobs": [top[" A"]],
                                      "top_logprobs": [top], "text_offset": [len(prompt)]}}]}


class Script:
    """What the server does next: a list of behaviours consumed per completion request."""

    def __init__(self) -> None:
        self.plan: list[str] = []
        self.served = ["tiny"]
        self.calls = 0
        self.lock = threading.Lock()

    def next(self) -> str:
        with self.lock:
            self.calls += 1
            return self.plan.pop(0) if self.plan else "ok"


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    script = Script()

    class Handler(JSONHandler):
        def do_GET(self):
            data = [{"id": name, "object": "model"} for name in script.served]
            self.send_json(200, {"object": "list", "data": data})

        def do_POST(self):
            body = self.json_body()
            action = script.next()
            if action == "429":
                return self.send_json(429, {"error": {"message": "slow down"}})
            if action == "500":
                return self.send_json(500, {"error": {"message": "boom"}})
            if action == "garbage":
                return self.send_json(200, b"<html>not json</html>", "text/html")
            if action == "no-logprobs":
                return self.send_json(200, {"choices": [{"text": " A"}]})
            if action == "unknown-model":
                return self.send_json(404, {"error": {"message": "model not found"}})
            if action == "capped":  # vLLM started with --max-logprobs 5
                return self.send_json(400, {"error": {"message": (
                    "Requested sample logprobs of 20, which is greater than max allowed: 5"),
                    "type": "BadRequestError", "param": "logprobs", "code": 400}})
            if action == "echo-refused":
                return self.send_json(400, {"error": {"message": "echo is not supported"}})
            if action == "echo-ignored":  # a completion's logprobs, after the prompt
                prompt = body["prompt"]
                return self.send_json(200, {"choices": [{"text": " x", "logprobs": {
                    "tokens": [" x"], "token_logprobs": [-1.0],
                    "text_offset": [len(prompt)]}}]})
            self.send_json(200, _letter_answer(body["prompt"]))

    with loopback_server(Handler) as url:
        yield url, script


def _endpoint(url, **kwargs):
    endpoint = remote.connect(url, **kwargs)
    # no real waiting between retries in tests; the delays are still computed
    return remote.Endpoint(**{**endpoint.__dict__, "sleep": lambda s: None, "backoff": 0.01})


def test_letter_scores_are_the_returned_logprobs(server):
    url, _ = server
    scores, stats = remote.remote_option_scores(_endpoint(url), RECORDS, mode="letter",
                                                progress=False)
    for i, row in enumerate(scores.values):
        np.testing.assert_allclose(row, [-0.5 - i / 10, -1.5, -2.5 + i / 10])
    assert stats.floored == 0 and scores.labels.tolist() == [0, 1, 2, 0, 1, 2]


def test_429_storm_and_5xx_are_retried(server):
    url, script = server
    script.plan = ["429", "429", "500", "429"]
    scores, _ = remote.remote_option_scores(_endpoint(url, concurrency=1), RECORDS,
                                            mode="letter", progress=False)
    assert np.isfinite(scores.values).all() and script.calls == len(RECORDS) + 4


def test_retry_budget_then_one_line_error_and_the_cache_keeps_the_rest(server):
    url, script = server
    endpoint = _endpoint(url, concurrency=1, retries=2)
    remote.remote_option_scores(endpoint, RECORDS[:3], mode="letter", progress=False)
    script.calls = 0
    script.plan = ["429"] * 50
    with pytest.raises(remote.RemoteError) as info:
        remote.remote_option_scores(endpoint, RECORDS, mode="letter", progress=False)
    message = str(info.value)
    assert "failed 3 times (last: HTTP 429 (slow down))" in message and "\n" not in message
    # the first three questions came from the cache; the fourth failed 3 times (a fifth may
    # have been in flight when it did)
    assert script.calls in (3, 6)
    script.plan, script.calls = [], 0
    scores, _ = remote.remote_option_scores(endpoint, RECORDS, mode="letter", progress=False)
    assert script.calls == 3 and np.isfinite(scores.values).all()


@pytest.mark.parametrize(("action", "words"), [
    ("garbage", "not JSON"), ("no-logprobs", "carries no logprobs"),
    ("unknown-model", r"HTTP 404 \(model not found\)"),
    ("capped", r"HTTP 400 \(Requested sample logprobs of 20.*max allowed: 5\); the server "
     r"returns at most 5 log-probabilities per token and calm asks for 20; start it with "
     r"--max-logprobs 20 \(vLLM\) or more")])
def test_protocol_faults_are_one_line_errors(server, action, words):
    url, script = server
    script.plan = [action]
    with pytest.raises(remote.RemoteError, match=words) as info:
        remote.remote_option_scores(_endpoint(url, concurrency=1), RECORDS, mode="letter",
                                    progress=False)
    assert "\n" not in str(info.value)


def test_server_down_is_one_line_after_the_retries(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = remote.Endpoint(f"http://127.0.0.1:{port}/v1", "m", retries=1, backoff=0.0,
                               sleep=lambda s: None, timeout=2)
    with pytest.raises(remote.RemoteError, match="failed 2 times .*ConnectionRefusedError"):
        endpoint.request("GET", "/models")


def test_timeouts_are_retried_then_reported(server, monkeypatch):
    url, _ = server
    calls = []

    def slow(*args, **kwargs):
        calls.append(1)
        raise TimeoutError("timed out")

    monkeypatch.setattr(http_endpoint, "_exchange", slow)
    endpoint = remote.Endpoint(url, "tiny", retries=2, sleep=lambda s: None)
    with pytest.raises(remote.RemoteError, match="failed 3 times .*TimeoutError"):
        endpoint.request("POST", "/completions", {"prompt": "x"})
    assert len(calls) == 3


def test_served_model_name(server):
    url, script = server
    assert remote.connect(url).model == "tiny"
    script.served = ["a", "b"]
    with pytest.raises(ConfigError, match="serves 2 models .*--model-name"):
        remote.connect(url)
    with pytest.raises(ConfigError, match="does not serve 'c'"):
        remote.connect(url, model_name="c")
    assert remote.connect(url, model_name="b").model == "b"


def test_a_letter_outside_the_top_alternatives_gets_the_floor(server, monkeypatch):
    url, _ = server
    records = [MultipleChoiceRecord("question 1?", ("a", "b", "c", "d"), 0)]
    scores, stats = remote.remote_option_scores(_endpoint(url), records, mode="letter",
                                                progress=False)
    assert stats.floored == 1 and stats.floored_share == 1.0
    assert scores.values[0, 3] == -3.0 == min(scores.values[0])  # " D" floored to " the"
    assert not any(math.isnan(v) for v in scores.values[0])


def test_errors_are_calm_errors():
    assert issubclass(remote.RemoteError, CalmError)
    with pytest.raises(ConfigError, match="not an http"):
        remote.connect("ftp://x")


@pytest.mark.parametrize(("action", "words"), [
    ("echo-refused", r"HTTP 400 \(echo is not supported\).*does not seem to score prompts.*"
                     r"use --mode letter"),
    ("echo-ignored", r"do not cover the prompt.*ignored echo or max_tokens 0 — use --mode "
                     r"letter")])
def test_cloze_without_prompt_scoring_names_letter_mode(server, action, words):
    """An endpoint that refuses echo, or answers as if it were not asked, stops cloze scoring
    with one line naming letter mode, and nothing wrong is cached or returned."""
    url, script = server
    script.plan = [action] * 50
    endpoint = _endpoint(url, concurrency=1)
    with pytest.raises(remote.RemoteError, match=words) as info:
        remote.remote_option_scores(endpoint, RECORDS[:2], mode="cloze", progress=False)
    assert "\n" not in str(info.value)
    assert not any(remote._Cache(endpoint).values)


def test_served_letter_floor_is_reported_and_vector_scaling_is_not_fitted(server, tmp_path):
    """A served model scored in letter mode: the report says how many questions had an
    option letter at the floor, and vector scaling (not shift-invariant, while an endpoint
    returns log-probabilities, not logits) is a reasoned row, not a fit."""
    from calm_training.fit import compare_methods
    from calm_training.posthoc.fit_config import FitConfig

    url, _ = server
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": f"question {i}?", "choices": list("abcd"),
                                        "answer": i % 4}) + "\n" for i in range(20)))
    config = FitConfig(model=url, data=str(data), mode="letter", chat=False, bootstrap=0,
                       calibration_fraction=0.5)
    report = compare_methods(config, ("ts", "ts-vector"), progress=False)
    assert report["served_floor"] == {"model": {"floored": 20, "n": 20, "share": 1.0}}
    assert "not fitted for a served model" in report["methods"]["ts-vector"]["error"]
    assert "error" not in report["methods"]["ts"], report["methods"]["ts"]
    from calm_training.posthoc.fit_report import format_table

    table = format_table(report)
    assert "served model: 20 of 20 questions with a token at the floor" in table
    assert "| ts-vector | - | not fitted for a served model" in table
