"""``calm serve`` under hostile or careless clients: each test pins one hardening fix.

A real uvicorn server on a free loopback port serves the tiny runtime engine. Slow-decode
tests wrap the engine's backend so that a step takes a fixed time and never ends the
sequence: a generation's length, and so its cost, is then exactly what the test asks for.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from calm_runtime.inference.lm import CalibratedLM  # noqa: E402
from calm_runtime.server import ServeConfig, create_app  # noqa: E402
from calm_runtime.server.app import PROMPT_CHARS_PER_TOKEN  # noqa: E402
from calm_runtime.server.background import serve_in_background as running  # noqa: E402

NAME = "tiny"
#: seconds per decode step of the slow engine; 200 steps then take 4 s
STEP_S = 0.02


class _SlowEndlessBackend:
    """The engine's backend, ``STEP_S`` slower per forward pass and never emitting EOS."""

    def __init__(self, backend, eos_ids) -> None:
        self._backend = backend
        self._eos = list(eos_ids)

    def run(self, *args, **kwargs):
        time.sleep(STEP_S)
        logits, state = self._backend.run(*args, **kwargs)
        logits = np.array(logits, copy=True)
        logits[..., self._eos] = -1e4
        return logits, state

    def __getattr__(self, name):
        return getattr(self._backend, name)


class _SlowTokenizer:
    """The engine's tokenizer whose ``encode`` takes ``delay`` seconds (GIL released)."""

    def __init__(self, tokenizer, delay: float) -> None:
        self._tokenizer = tokenizer
        self._delay = delay

    def encode(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def slow_served(runtime_engine_dir, runtime_lm):
    slow = CalibratedLM(runtime_lm.manifest,
                        _SlowEndlessBackend(runtime_lm.backend, runtime_lm.tokenizer.eos_token_ids),
                        runtime_lm.tokenizer)
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1,
                         max_tokens_limit=250, batch_window_ms=0)
    with running(create_app(config, slow)) as (url, _):
        yield url


def _metric(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def _shared_a_step(url: str) -> bool:
    """Some decode step ran more than one row (the rows-per-step histogram)."""
    one = _metric(url, 'calm_batch_size_bucket{le="1.0"}')
    return one is not None and one < _metric(url, "calm_batch_size_count")


def _wait_for_metric(url: str, name: str, value: float, timeout: float = 3.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        got = _metric(url, name)
        if (got is not None and got >= value) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def _timed_short_request(url: str) -> float:
    started = time.monotonic()
    response = httpx.post(url + "/v1/completions", timeout=30,
                          json={"model": NAME, "prompt": "Hi", "max_tokens": 1})
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1
    return elapsed


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---------------------------------------------------------------------- 1. cancellation
def test_disconnected_stream_stops_its_generation(slow_served):
    """A streaming client that leaves after 3 events frees the engine at once (it used to
    decode the remaining ~240 tokens, 4.8 s here, before serving anyone else)."""
    url = slow_served
    before = _metric(url, "calm_requests_cancelled_total") or 0.0
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 240, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
    assert _timed_short_request(url) < 1.5
    assert _wait_for_metric(url, "calm_requests_cancelled_total", before + 1) == before + 1


def test_abandoned_request_stops_its_generation(slow_served):
    """A non-streaming client that times out frees the engine at once (it used to wait
    for the whole 240-token generation)."""
    url = slow_served
    before = _metric(url, "calm_requests_cancelled_total") or 0.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", timeout=0.5,
                   json={"model": NAME, "prompt": "Hi", "max_tokens": 240})
    assert _timed_short_request(url) < 1.5
    assert _wait_for_metric(url, "calm_requests_cancelled_total", before + 1) == before + 1


def test_server_timeout_stops_its_generation(runtime_engine_dir, runtime_lm):
    """A request past ``request_timeout_s`` gets 504 and its decode stops too."""
    slow = CalibratedLM(runtime_lm.manifest,
                        _SlowEndlessBackend(runtime_lm.backend, runtime_lm.tokenizer.eos_token_ids),
                        runtime_lm.tokenizer)
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1,
                         max_tokens_limit=250, batch_window_ms=0, request_timeout_s=0.3)
    with running(create_app(config, slow)) as (url, _):
        response = httpx.post(url + "/v1/completions", timeout=30,
                              json={"model": NAME, "prompt": "Hi", "max_tokens": 240})
        assert _error(response, 504)["code"] == "timeout"
        assert _timed_short_request(url) < 1.0  # well under request_timeout_s * 3
        assert _metric(url, "calm_requests_cancelled_total") == 0  # a timeout, not a client


def test_a_batch_mate_that_leaves_does_not_disturb_the_others(runtime_engine_dir, runtime_lm):
    """Two streams decode as one batch; the one whose client leaves is dropped from it, the
    other streams on to exactly what it gets alone."""
    slow = CalibratedLM(runtime_lm.manifest,
                        _SlowEndlessBackend(runtime_lm.backend, runtime_lm.tokenizer.eos_token_ids),
                        runtime_lm.tokenizer)
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1,
                         max_tokens_limit=250, batch_window_ms=300)
    want = slow.generate("The cat", max_new_tokens=30)
    with running(create_app(config, slow)) as (url, _):
        def leaver():
            body = {"model": NAME, "prompt": "Hi", "max_tokens": 200, "temperature": 0,
                    "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                events = 0
                for line in r.iter_lines():
                    events += line.startswith("data: ")
                    if events == 3:
                        return

        worker = threading.Thread(target=leaver)
        worker.start()
        started = time.monotonic()
        stayer = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": NAME, "prompt": "The cat", "max_tokens": 30, "temperature": 0})
        elapsed = time.monotonic() - started
        worker.join()
        assert stayer.status_code == 200
        assert stayer.json()["choices"][0]["text"] == want.text
        assert elapsed < 0.3 + 30 * STEP_S + 1.5  # the leaver's 200 steps were not waited for
        assert _shared_a_step(url)  # they did share the batch
        assert _wait_for_metric(url, "calm_requests_cancelled_total", 1) == 1


def test_p_true_refused_for_one_row_leaves_its_batch_mates_alone(runtime_engine_dir, runtime_lm):
    """A row whose P(True) prompt overflows the context gets a 400 naming it; the request
    batched with it is answered as usual (it used to get the same 400)."""
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1,
                         batch_window_ms=300)
    long_prompt = "a" * 240  # fits with 4 new tokens; the P(True) prompt around it does not
    with running(create_app(config, runtime_lm)) as (url, _):
        out = {}

        def send(name, body):
            out[name] = httpx.post(url + "/v1/completions", json=body, timeout=30)

        workers = [threading.Thread(target=send, args=("p_true", {
            "model": NAME, "prompt": long_prompt, "max_tokens": 4, "temperature": 0,
            "calm": {"p_true": True}})), threading.Thread(target=send, args=("plain", {
                "model": NAME, "prompt": "The cat", "max_tokens": 4, "temperature": 0}))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert _shared_a_step(url)
    assert "P(True) prompt" in _error(out["p_true"], 400)["message"]
    assert out["plain"].status_code == 200
    assert out["plain"].json()["choices"][0]["text"] == runtime_lm.generate(
        "The cat", max_new_tokens=4).text


# ---------------------------------------------------------------------- 2. body size
def test_chunked_body_over_the_limit_is_refused_while_it_arrives(runtime_engine_dir, runtime_lm):
    """A chunked body 1000 times the limit is answered 413 after reading about the limit
    (it used to be buffered whole before the size check)."""
    limit, chunk, chunks = 64_000, 32_768, 2_000  # 64 MB offered
    consumed = 0

    def body():
        nonlocal consumed
        for _ in range(chunks):
            consumed += 1
            yield b" " * chunk

    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1,
                         max_body_bytes=limit)
    with running(create_app(config, runtime_lm)) as (url, _):
        response = httpx.post(url + "/v1/completions", content=body(), timeout=30,
                              headers={"content-type": "application/json"})
        assert _error(response, 413)["code"] == "request_too_large"
        # what the client got to write is the limit plus the sockets' buffers, far from all
        assert consumed * chunk < 16_000_000, consumed
        assert httpx.get(url + "/health").status_code == 200
        small = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "Hi",
                                                          "max_tokens": 2})
        assert small.status_code == 200
        counted = httpx.get(url + "/metrics").text
        assert 'calm_requests_total{code="413",endpoint="/v1/completions"} 1.0' in counted


def test_body_over_the_limit_by_content_length_is_refused_unread(runtime_engine_dir, runtime_lm):
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1,
                         max_body_bytes=1_000)
    with running(create_app(config, runtime_lm)) as (url, _):
        response = httpx.post(url + "/v1/chat/completions", content=b"{" + b" " * 5_000 + b"}")
        assert _error(response, 413)["code"] == "request_too_large"
        assert response.headers["connection"] == "close"  # the unread body is not drained
        exact = json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 2}).encode()
        assert httpx.post(url + "/v1/completions", content=exact.ljust(1_000)).status_code == 200


# ---------------------------------------------------------------------- 3. prompt length
def test_huge_prompt_is_refused_before_tokenising(runtime_served):
    """990,000 characters: a 400 at once, and /health stays responsive meanwhile (the
    prompt used to be tokenised on the event loop first: 1.6 s, /health stalled)."""
    prompt = "a" * 990_000
    result = {}

    def send():
        started = time.monotonic()
        result["response"] = httpx.post(runtime_served + "/v1/completions", timeout=30,
                                        json={"model": NAME, "prompt": prompt, "max_tokens": 2})
        result["elapsed"] = time.monotonic() - started

    worker = threading.Thread(target=send)
    worker.start()
    health = []
    while worker.is_alive():
        started = time.monotonic()
        assert httpx.get(runtime_served + "/health", timeout=10).status_code == 200
        health.append(time.monotonic() - started)
    worker.join()
    error = _error(result["response"], 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "990000 characters" in error["message"]
    # tokenising it took ~1.4 s here, /health stalled as long; now ~0.2 s and ~0.1 s (the
    # client's JSON encoding, in this process, included)
    assert result["elapsed"] < 1.0
    assert max(health) < 0.75
    chat = httpx.post(runtime_served + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": prompt[:300_000]}]})
    assert _error(chat, 400)["code"] == "context_length_exceeded"


def test_prompt_character_cap_is_derived_from_the_token_cap(runtime_served, runtime_lm):
    cap = (runtime_lm.max_context - 1) * PROMPT_CHARS_PER_TOKEN
    over = httpx.post(runtime_served + "/v1/completions",
                      json={"model": NAME, "prompt": "a" * (cap + 1), "max_tokens": 2})
    assert f"at most {cap} characters" in _error(over, 400)["message"]
    # at the cap the prompt is tokenised and refused by its token count instead
    at = httpx.post(runtime_served + "/v1/completions",
                    json={"model": NAME, "prompt": "a" * cap, "max_tokens": 2})
    assert "tokens" in _error(at, 400)["message"]


def test_tokenising_runs_off_the_event_loop(runtime_engine_dir, runtime_lm):
    slow = CalibratedLM(runtime_lm.manifest, runtime_lm.backend,
                        _SlowTokenizer(runtime_lm.tokenizer, 1.0))
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1)
    with running(create_app(config, slow)) as (url, _):
        result = {}
        worker = threading.Thread(target=lambda: result.update(response=httpx.post(
            url + "/v1/completions", timeout=30,
            json={"model": NAME, "prompt": "Hi", "max_tokens": 2})))
        worker.start()
        time.sleep(0.2)  # the request is now being tokenised
        started = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - started < 0.4
        worker.join()
        assert result["response"].status_code == 200


# ---------------------------------------------------------------------- 4. malformed JSON text
def _post_twice_on_one_connection(url: str, path: str, body: bytes) -> tuple:
    """Status and JSON of ``body`` POSTed, then of a GET /health on the same connection
    (keep-alive must survive a refused request)."""
    where = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    try:
        connection.request("POST", path, body=body,
                           headers={"Content-Type": "application/json"})
        first = connection.getresponse()
        payload = json.loads(first.read())
        connection.request("GET", "/health")
        second = connection.getresponse()
        second.read()
        return first.status, payload, second.status
    finally:
        connection.close()


@pytest.mark.parametrize("path, body, fragment, param", [
    ("/v1/completions",
     b'{"model": "tiny", "prompt": "hi", "logit_bias": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
     "nested", None),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": ' + b"[" * 50_000 + b"]" * 50_000
     + b"}", "nested", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}',
     "surrogate", "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}',
     "surrogate", "prompt.1"),
    ("/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "surrogate", "messages.0.content"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "x\\uDBFF"}]}]}', "surrogate", "messages.0.content.0.text"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "\\udc00": 1}', "surrogate", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\xed\xa0\x80b"}', "UTF-8", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "JSON", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "seed": 1' + b"0" * 5_000 + b"}",
     "JSON", None),
])
def test_malformed_text_is_a_400_and_keeps_the_connection(runtime_served, path, body, fragment,
                                                          param):
    status, payload, after = _post_twice_on_one_connection(runtime_served, path, body)
    assert status == 400, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert fragment in payload["error"]["message"]
    assert payload["error"]["param"] == param
    assert after == 200


def test_surrogate_pairs_are_valid_text(runtime_served, runtime_lm):
    body = {"model": NAME, "prompt": "smile \U0001F600", "max_tokens": 3, "temperature": 0}
    response = httpx.post(runtime_served + "/v1/completions",
                          content=json.dumps(body, ensure_ascii=True))  # "\ud83d\ude00"
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == runtime_lm.generate(
        "smile \U0001F600", max_new_tokens=3).text


# ---------------------------------------------------------------------- 5. strict types
@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "max_tokens", "3"),
    ("/v1/completions", "max_tokens", True),
    ("/v1/completions", "max_tokens", 2.5),
    ("/v1/completions", "n", 1.5),
    ("/v1/completions", "n", True),
    ("/v1/completions", "logprobs", True),
    ("/v1/completions", "logprobs", "2"),
    ("/v1/completions", "seed", "7"),
    ("/v1/completions", "seed", 7.25),
    ("/v1/completions", "top_k", 5.5),
    ("/v1/completions", "stream", 1),
    ("/v1/completions", "stream", "true"),
    ("/v1/completions", "echo", 0),
    ("/v1/completions", "temperature", "0.5"),
    ("/v1/completions", "temperature", True),
    ("/v1/completions", "top_p", False),
    ("/v1/completions", "presence_penalty", "0"),
    ("/v1/completions", "stop", 5),
    ("/v1/completions", "stream_options", {"include_usage": 1}),
    ("/v1/completions", "calm", {"p_true": "yes"}),
    ("/v1/chat/completions", "logprobs", 1),
    ("/v1/chat/completions", "top_logprobs", 2.5),
    ("/v1/chat/completions", "top_logprobs", "2"),
    ("/v1/chat/completions", "max_completion_tokens", "4"),
    ("/v1/chat/completions", "max_tokens", True),
    ("/v1/chat/completions", "messages", [{"role": "user", "content": 5}]),
])
def test_parameters_are_strictly_typed(runtime_served, path, field, value):
    """Wrong JSON types are refused by name; an integral float for an integer is that integer
    (JSON Schema's ``integer`` takes ``2.0``), a fractional one is refused."""
    body = {"model": NAME, "max_tokens": 2}
    body.update({"prompt": "Hi"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True})
    if isinstance(value, list):
        body[field] = value
        field = f"{field}.0.content"
    elif isinstance(value, dict):
        body[field] = value
        field = f"{field}.{next(iter(value))}"
    else:
        body[field] = value
    error = _error(httpx.post(runtime_served + path, json=body), 400)
    assert error["param"] == field, error
    assert field in error["message"]


def test_integral_numbers_are_accepted_where_openai_takes_numbers(runtime_served):
    response = httpx.post(runtime_served + "/v1/completions", json={
        "model": NAME, "prompt": "Hi", "max_tokens": 2, "temperature": 0, "top_p": 1,
        "presence_penalty": 0, "frequency_penalty": 0})
    assert response.status_code == 200, response.text


def test_integral_floats_are_integers(runtime_served):
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2.0, "seed": 7.0, "top_k": 5.0}
    assert httpx.post(runtime_served + "/v1/completions", json=body).status_code == 200
