"""``calm serve`` over HTTP, driven by the official ``openai`` client.

A real uvicorn server on a free loopback port serves the tiny runtime engine; every answer
is compared with direct :class:`CalibratedLM` calls on the same prompts.
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from calm_runtime.server import ServeConfig, create_app  # noqa: E402
from calm_runtime.server.background import serve_in_background as running  # noqa: E402

PROMPTS = ["Question: what is red?\nAnswer:", "The cat sat on", "One two three four",
           "Sun moon water fire earth", "Answer: A B C"]
NAME = "tiny"


@pytest.fixture(scope="module")
def client(runtime_served):
    return openai.OpenAI(base_url=runtime_served + "/v1", api_key="unused", max_retries=0)


def _close(a, b, tol=1e-4):
    np.testing.assert_allclose(np.asarray(a, float), np.asarray(b, float), rtol=0, atol=tol)


# ---------------------------------------------------------------------- answers equal direct calls
def test_ignore_eos_is_served_as_the_direct_call(client, runtime_lm):
    """``ignore_eos`` (vLLM's and llama-server's extension) reaches the decode loop: the
    served answer is the direct call's with the same option, and it differs from one
    without it only when that one ended at an end-of-sequence token."""
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24,
                                    temperature=0, extra_body={"ignore_eos": True})
    ref = runtime_lm.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True)
    assert out.choices[0].text == ref.text and ref.finish_reason == "length"
    assert out.usage.completion_tokens == 24
    plain = runtime_lm.generate(PROMPTS[0], max_new_tokens=24)
    assert plain.finish_reason == "eos" or plain.token_ids == ref.token_ids


def test_completion_matches_direct_call(client, runtime_lm):
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    logprobs=3)
    ref = runtime_lm.generate(PROMPTS[0], max_new_tokens=12, top_alternatives=3)
    choice = out.choices[0]
    assert choice.text == ref.text
    assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[
        ref.finish_reason]
    assert choice.logprobs.tokens == [t.text for t in ref.tokens]
    _close(choice.logprobs.token_logprobs, [t.logprob for t in ref.tokens])
    for got, token in zip(choice.logprobs.top_logprobs, ref.tokens, strict=True):
        want = {a.text: float(np.log(a.confidence)) for a in token.top}  # OpenAI's dict shape
        assert sorted(got) == sorted(want)
        _close([got[k] for k in sorted(got)], [want[k] for k in sorted(want)])
    calm = choice.model_extra["calm"]
    _close(calm["token_confidences"], [t.confidence for t in ref.tokens])
    _close(calm["sequence_confidence"], ref.sequence_confidence)
    assert "p_true" not in calm  # computed only when asked for
    assert out.usage.completion_tokens == len(ref.tokens)
    assert out.usage.prompt_tokens == ref.prompt_tokens
    assert out.system_fingerprint.startswith("calm-")
    assert out.model_extra["calm"]["engine"] == NAME
    assert out.model_extra["calm"]["calibration"]["fused"] is True


def test_chat_matches_direct_call_with_logprobs(client, runtime_lm):
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Name a color."}], max_tokens=10,
        temperature=0, logprobs=True, top_logprobs=2)
    ref = runtime_lm.generate("Name a color.", max_new_tokens=10, chat=True, top_alternatives=2)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert [c.token for c in choice.logprobs.content] == [t.text for t in ref.tokens]
    _close([c.logprob for c in choice.logprobs.content], [t.logprob for t in ref.tokens])
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
    _close(choice.model_extra["calm"]["token_confidences"], [t.confidence for t in ref.tokens])


def test_p_true_on_request(client, runtime_lm):
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                    extra_body={"calm": {"p_true": True}})
    text = out.choices[0].text
    _close(out.choices[0].model_extra["calm"]["p_true"], runtime_lm.p_true(PROMPTS[0], text))
    chat = client.chat.completions.create(model=NAME, max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "Say yes."}],
                                          extra_body={"calm": {"p_true": True}})
    answer = chat.choices[0].message.content
    _close(chat.choices[0].model_extra["calm"]["p_true"], runtime_lm.p_true("Say yes.", answer))


def test_streaming_equals_non_streaming(client, runtime_lm):
    for stop in (None, ["e"], [" t", "xyz"]):
        ref = runtime_lm.generate(PROMPTS[1], max_new_tokens=20, stop=stop or ())
        chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=20,
                                                temperature=0, stop=stop, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == ref.text, stop
        per_token = [c.choices[0].model_extra["calm"]["token_confidence"] for c in chunks
                     if c.choices and c.choices[0].finish_reason is None]
        _close(per_token, [t.confidence for t in ref.tokens])
        final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
        _close(final.choices[0].model_extra["calm"]["sequence_confidence"],
               ref.sequence_confidence)
        assert chunks[-1].usage.completion_tokens == len(ref.tokens)


def test_chat_streaming(client, runtime_lm):
    ref = runtime_lm.generate("Tell me about the sun.", max_new_tokens=15, chat=True)
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Tell me about the sun."}],
        max_tokens=15, temperature=0, stream=True, logprobs=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    logprobs = [c.choices[0].logprobs.content[0].logprob for c in chunks
                if c.choices[0].logprobs is not None]
    _close(logprobs, [t.logprob for t in ref.tokens])


def test_seeded_sampling_matches_direct_call(client, runtime_lm):
    out = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=12,
                                    temperature=0.9, top_p=0.95, seed=7)
    ref = runtime_lm.generate(PROMPTS[2], max_new_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    assert out.choices[0].text == ref.text


def test_models_and_health(client, runtime_served):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    health = httpx.get(runtime_served + "/health").json()
    assert health["status"] == "ok" and health["model"] == NAME


def test_metrics_are_prometheus_text(client, runtime_served):
    client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=4, temperature=0)
    response = httpx.get(runtime_served + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    body = response.text
    for name in ("calm_requests_total", "calm_queue_depth", "calm_batch_size_bucket",
                 "calm_generated_tokens_total", "calm_request_latency_seconds_bucket",
                 "calm_token_confidence_bucket", "calm_sequence_confidence_count",
                 "calm_p_true_bucket"):
        assert name in body, name
    line = [x for x in body.splitlines() if x.startswith('calm_requests_total{code="200",'
                                                         'endpoint="/v1/completions"}')]
    assert line and float(line[0].split()[-1]) >= 1


# ---------------------------------------------------------------------- bad requests
@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "tiny"}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 65}', 400, "limit of 64"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "n": 2}', 400, "n not supported"),
    (b'{"model": "tiny", "prompt": "hi", "echo": true}', 400, "echo is supported for"),
    (b'{"model": "tiny", "prompt": "hi", "bogus": 1}', 400, "bogus"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": ""}', 400, "empty"),
    (b'{"model": "other", "prompt": "hi"}', 404, "not served here"),
])
def test_bad_requests_get_openai_errors(runtime_served, body, status, fragment):
    response = httpx.post(runtime_served + "/v1/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_too_long_prompt_and_body(client, runtime_served, runtime_lm):
    with pytest.raises(openai.BadRequestError, match="shorten the prompt"):
        client.completions.create(model=NAME, prompt="word " * 400, max_tokens=4)
    fills_context = "a" * 255  # BOS + 255 byte tokens: the whole context, no room to generate
    assert len(runtime_lm.encode_prompt(fills_context)) == runtime_lm.max_context
    with pytest.raises(openai.BadRequestError, match="at most 255") as caught:
        client.completions.create(model=NAME, prompt=fills_context, max_tokens=4)
    assert caught.value.code == "context_length_exceeded"
    response = httpx.post(runtime_served + "/v1/completions", content=b"x" * 1_000_001)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[])
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_unknown_path_is_an_openai_404(runtime_served):
    response = httpx.get(runtime_served + "/v1/engines/../../etc/passwd")
    assert response.status_code == 404
    assert "error" in response.json()


# ---------------------------------------------------------------------- auth
def test_api_key(runtime_engine_dir, monkeypatch, runtime_lm):
    monkeypatch.setenv("CALM_TEST_KEY", "s3cret")
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1,
                         api_key_env="CALM_TEST_KEY")
    with running(create_app(config, runtime_lm)) as (url, _):
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=NAME, prompt="hi", max_tokens=2).choices


def test_unset_key_variable_is_refused(runtime_engine_dir, runtime_lm, monkeypatch):
    monkeypatch.delenv("CALM_TEST_NO_KEY", raising=False)
    from calm_runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="CALM_TEST_NO_KEY"):
        create_app(ServeConfig(engine=str(runtime_engine_dir), api_key_env="CALM_TEST_NO_KEY"),
                   runtime_lm)


# ---------------------------------------------------------------------- load
def _serial(runtime_lm, prompts, max_tokens):
    return {p: runtime_lm.generate(p, max_new_tokens=max_tokens) for p in set(prompts)}


def _hammer(url, prompts, clients: int, per_client: int, max_tokens: int):
    """``clients`` threads each sending ``per_client`` completions; returns (results, errors)."""
    def worker(c):
        cli = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out, errors = [], []
        for i in range(per_client):
            prompt = prompts[(c + i) % len(prompts)]
            try:
                r = cli.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0)
                out.append((prompt, r.choices[0]))
            except openai.APIError as exc:
                errors.append(exc)
        return out, errors

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        parts = list(pool.map(worker, range(clients)))
    return [x for p in parts for x in p[0]], [e for p in parts for e in p[1]]


def test_load_is_batched_error_free_and_equal_to_serial(runtime_engine_dir, runtime_lm):
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1,
                         max_batch_size=8, batch_window_ms=20)
    refs = _serial(runtime_lm, PROMPTS, 16)
    with running(create_app(config)) as (url, _):
        results, errors = _hammer(url, PROMPTS, clients=16, per_client=5, max_tokens=16)
        metrics = httpx.get(url + "/metrics").text
    assert errors == []
    assert len(results) == 80
    for prompt, choice in results:
        assert choice.text == refs[prompt].text
        _close(choice.model_extra["calm"]["token_confidences"],
               [t.confidence for t in refs[prompt].tokens])
    def read(name):
        return float(next(x for x in metrics.splitlines() if x.startswith(name)).split()[-1])
    # concurrent requests shared decode steps: more than one row per step on average
    assert read("calm_batch_size_sum") / read("calm_batch_size_count") > 1.5


def test_overload_gives_429_and_recovers(runtime_engine_dir, runtime_lm):
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1,
                         max_batch_size=1,
                         max_queue=2, batch_window_ms=0)
    with running(create_app(config, runtime_lm)) as (url, _):
        results, errors = _hammer(url, PROMPTS, clients=12, per_client=2, max_tokens=64)
        assert errors, "a queue of 2 rows should overflow under 12 concurrent clients"
        assert all(isinstance(e, openai.RateLimitError) for e in errors)
        assert results  # the queued ones were served
        cli = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        again = cli.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4,
                                       temperature=0)
        assert again.choices[0].text == runtime_lm.generate(PROMPTS[0], max_new_tokens=4).text


def test_timeout_gives_504(runtime_engine_dir, runtime_lm):
    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, request_timeout_s=0.001)
    with running(create_app(config, runtime_lm)) as (url, _):
        response = httpx.post(url + "/v1/completions", json={
            "model": NAME, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0})
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "timeout"


def test_graceful_shutdown_finishes_in_flight_requests(runtime_engine_dir, runtime_lm):
    import json

    config = ServeConfig(engine=str(runtime_engine_dir), model_name=NAME, threads=1)
    ref = runtime_lm.generate(PROMPTS[4], max_new_tokens=64)
    with running(create_app(config, runtime_lm)) as (url, server):
        body = {"model": NAME, "prompt": PROMPTS[4], "max_tokens": 64, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            server.should_exit = True  # what SIGTERM does, with the request surely in flight
            events += [line for line in lines if line.startswith("data: ")]
    assert response.status_code == 200
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text


SERVER_CHILD = r'''
import importlib.abc, json, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None

sys.meta_path.insert(0, Block())
from fastapi.testclient import TestClient
from calm_runtime.server import ServeConfig, create_app

with TestClient(create_app(ServeConfig(engine=sys.argv[1], model_name="tiny"))) as client:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
print(json.dumps({"status": r.status_code,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in
                                   ("torch", "transformers"))}))
'''


def test_server_is_torch_free(runtime_engine_dir):
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SERVER_CHILD, str(runtime_engine_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"status": 200, "loaded": []}


def test_cli_serves_with_two_workers_and_stops_on_sigterm(runtime_engine_dir, runtime_lm):
    """`calm serve ENGINE --workers 2` as a user runs it: two processes, SIGTERM stops it."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "calm_runtime.cli.main", "-q", "serve", str(runtime_engine_dir),
         "--port",
         str(port), "--workers", "2", "--model-name", NAME, "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, process.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "calm serve did not come up"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        cli = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for prompt in PROMPTS[:3]:
            out = cli.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
            assert out.choices[0].text == runtime_lm.generate(prompt, max_new_tokens=8).text
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    assert code == 0


def test_answers_are_the_documented_response_models(runtime_served, runtime_engine_dir,
                                                    runtime_lm):
    """Every non-streaming answer parses as its response model (protocol.py), and the
    OpenAPI document names those models for the 200s."""
    from calm_runtime.server.protocol import ChatCompletionResponse, CompletionResponse

    bodies = {
        CompletionResponse: [
            {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 3, "logprobs": 2},
            {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 0, "echo": True, "logprobs": 1},
            {"model": NAME, "prompt": PROMPTS[0], "guided_choice": ["red", "blue"]}],
        ChatCompletionResponse: [
            {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
             "logprobs": True, "top_logprobs": 1},
            {"model": NAME, "messages": [{"role": "user", "content": "Red or blue?"}],
             "guided_choice": ["red", "blue"]}]}
    for model, requests in bodies.items():
        path = "/v1/completions" if model is CompletionResponse else "/v1/chat/completions"
        for body in requests:
            response = httpx.post(runtime_served + path, json=body, timeout=60)
            assert response.status_code == 200, response.text
            parsed = model.model_validate(response.json())
            assert parsed.model_dump() == response.json()  # nothing outside the model
            assert parsed.calm["engine"] == NAME
    schema = create_app(ServeConfig(engine=str(runtime_engine_dir), model_name=NAME),
                        runtime_lm).openapi()
    for path, model in (("/v1/completions", CompletionResponse),
                        ("/v1/chat/completions", ChatCompletionResponse)):
        ok = schema["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]
        assert ok["schema"]["$ref"].endswith("/" + model.__name__)
