"""llama.cpp's llama-server as a source (issue 40, item 3). Its ``/v1/completions`` answers
logprobs in the chat shape (``logprobs.content[]``) and does not echo the prompt's
log-probabilities. The one parser reads both shapes of ``/v1/completions`` (fixtures of each
below); against a scripted server on loopback that answers as llama-server does, letter mode
scores and ``calm fit daca`` writes an adapter, and cloze mode is one line naming the missing
prompt log-probabilities and ``--mode letter``.

The fixtures are the shapes of the two APIs' answers, written from their sources (OpenAI's
legacy completions object; llama.cpp's server ``probs_to_json``: ``id``, ``token``, ``bytes``,
``logprob``, ``top_logprobs``, and ``logprobs: null`` when it computed none), not captured
from a live server.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import JSONHandler, loopback_server, write_mc_jsonl

from calm_runtime.cli.main import main
from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_training.scoring import served as remote

# ------------------------------------------------------------------ recorded-shape fixtures
TOP = {" A": -0.31, " B": -1.6, " C": -2.9}

#: OpenAI's legacy completions shape (OpenAI, vLLM, SGLang, calm serve), ``logprobs: 3``
OPENAI_COMPLETION = {
    "id": "cmpl-8f2", "object": "text_completion", "created": 1750000000, "model": "tiny",
    "choices": [{"index": 0, "text": " A", "finish_reason": "length", "stop_reason": None,
                 "logprobs": {"text_offset": [40], "token_logprobs": [-0.31],
                              "tokens": [" A"], "top_logprobs": [dict(TOP)]}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}


def _entry(token: str, logprob: float, top: dict[str, float] | None = None) -> dict:
    item = {"id": 300 + ord(token[-1]), "token": token,
            "bytes": list(token.encode()), "logprob": logprob}
    if top is not None:
        item["top_logprobs"] = [_entry(t, v) for t, v in top.items()]
    return item


#: llama-server's answer to the same request (``logprobs: 3``): the chat shape
LLAMA_SERVER_COMPLETION = {
    "choices": [{"text": " A", "index": 0, "finish_reason": "length",
                 "logprobs": {"content": [_entry(" A", -0.31, TOP)]}}],
    "created": 1750000000, "model": "tiny", "system_fingerprint": "b6000-1a2b3c4d",
    "object": "text_completion", "id": "chatcmpl-Qx1",
    "usage": {"completion_tokens": 1, "prompt_tokens": 12, "total_tokens": 13},
    "timings": {"prompt_n": 12, "prompt_ms": 4.1, "predicted_n": 1, "predicted_ms": 6.3}}

#: OpenAI's answer to an echo request (``echo: true``, ``max_tokens: 0``, ``logprobs: 0``)
OPENAI_ECHO = {
    "object": "text_completion", "model": "tiny",
    "choices": [{"index": 0, "text": "Question: x?\nAnswer: yes", "finish_reason": "length",
                 "logprobs": {"tokens": ["Question", ":", " x", "?", "\n", "Answer", ":",
                                         " yes"],
                              "token_logprobs": [None, -1.0, -5.0, -2.0, -0.5, -3.0, -0.1,
                                                 -1.25],
                              "top_logprobs": [None, {":": -1.0}, {" x": -5.0}, {"?": -2.0},
                                               {"\n": -0.5}, {"Answer": -3.0}, {":": -0.1},
                                               {" yes": -1.25}],
                              "text_offset": [0, 8, 9, 11, 12, 13, 19, 20]}}]}

#: llama-server's answer to that request when it does not refuse echo: nothing computed
LLAMA_SERVER_ECHO = {
    "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
    "object": "text_completion", "model": "tiny", "id": "chatcmpl-Qx2",
    "usage": {"completion_tokens": 0, "prompt_tokens": 8, "total_tokens": 8}}


def test_both_shapes_parse_to_the_same_logprobs():
    legacy = remote.completion_logprobs(OPENAI_COMPLETION)
    chat = remote.completion_logprobs(LLAMA_SERVER_COMPLETION)
    assert (legacy.shape, chat.shape) == ("completions", "chat")
    for parsed in (legacy, chat):
        assert parsed.tokens == [" A"] and parsed.values == [-0.31] and parsed.top == [TOP]
    assert legacy.offsets == [40] and chat.offsets is None
    assert remote.top_alternatives(OPENAI_COMPLETION) == remote.top_alternatives(
        LLAMA_SERVER_COMPLETION) == TOP


def test_an_echo_answer_is_read_from_the_openai_shape_only():
    body = {"prompt": "Question: x?\nAnswer: yes"}
    fields = remote.echo_fields(OPENAI_ECHO, body)
    assert remote.echoed_continuation(fields, len("Question: x?\nAnswer:")) == [-1.25]
    with pytest.raises(remote.NoPromptLogprobs, match="answered no logprobs"):
        remote.echo_fields(LLAMA_SERVER_ECHO, body)
    with pytest.raises(remote.NoPromptLogprobs, match="chat shape, of generated tokens only"):
        remote.echo_fields(LLAMA_SERVER_COMPLETION, body)


@pytest.mark.parametrize(("logprobs", "words"), [
    ({"content": [{"logprob": -1.0}]}, "malformed logprobs entry"),
    ({"content": [{"token": " A", "logprob": -1.0, "top_logprobs": [{"logprob": -1.0}]}]},
     "malformed top_logprobs entry"),
    ({"content": [{"token": " A", "logprob": "high"}]}, "non-numeric logprob 'high'"),
    ({"top_logprobs": [{" A": None}]}, "non-numeric logprob None"),
    ({"top_logprobs": ["A"]}, "malformed top_logprobs entry"),
    ({"something": "else"}, "in neither shape calm reads"),
    (None, "carries no logprobs")])
def test_malformed_logprobs_are_one_line(logprobs, words):
    with pytest.raises(remote.RemoteError, match=words) as info:
        remote.completion_logprobs({"choices": [{"text": " A", "logprobs": logprobs}]})
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ a scripted llama-server
N = 40
#: questions whose " D" is not among the top alternatives (scored by the floor: no echo)
OUTSIDE = {5, 11}


def _letter_top(i: int, sharpness: float) -> dict[str, float]:
    """The letters' log-probabilities after question ``i``'s letter prompt: a fixed ranking
    sharpened by ``sharpness`` (the model is sharper than its reference; both agree)."""
    rng = np.random.default_rng(i)
    logits = rng.normal(size=4) * sharpness
    logits[i % 4] += 2.0 * sharpness
    values = logits - np.log(np.exp(logits).sum() + np.exp(-4.0))
    top = {f" {c}": float(v) for c, v in zip("ABCD", values, strict=True)}
    top[" the"] = float(np.min(values) - 1.0)
    if i in OUTSIDE:
        del top[" D"]
    return top


class LlamaServer:
    """What a llama-server answers: the chat shape of logprobs on /v1/completions, and for
    echo either nothing (``ignore``: ``logprobs: null``) or HTTP 500 "Only no echo is
    supported" (``refuse``, llama.cpp's current source)."""

    def __init__(self, name: str, sharpness: float, echo: str = "ignore") -> None:
        self.name, self.sharpness, self.echo = name, sharpness, echo
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def handler(self):
        server = self

        class Handler(JSONHandler):
            def do_GET(self):
                self.send_json(200, {"object": "list", "data": [
                    {"id": server.name, "object": "model", "owned_by": "llamacpp",
                     "meta": {"n_vocab": 49152, "n_ctx_train": 8192}}]})

            def do_POST(self):
                body = self.json_body()
                with server.lock:
                    server.requests.append({"path": self.path, **body})
                if self.path.endswith("/chat/completions"):
                    return self.send_json(200, {"choices": [{
                        "index": 0, "finish_reason": "length",
                        "message": {"role": "assistant", "content": "A"},
                        "logprobs": {"content": [_entry("A", -0.1, {"A": -0.1})]}}]})
                if body.get("echo") and server.echo == "refuse":
                    return self.send_json(500, {"error": {
                        "code": 500, "message": "Only no echo is supported",
                        "type": "server_error"}})
                self.send_json(200, server.answer(body))

        return Handler

    def answer(self, body: dict) -> dict:
        prompt, n_probs = body["prompt"], int(body.get("logprobs") or 0)
        if body.get("max_tokens", 16) == 0 or "number " not in prompt:
            return {**LLAMA_SERVER_ECHO, "model": self.name}  # nothing generated
        i = int(prompt.split("number ")[1].split("?")[0])
        top = _letter_top(i, self.sharpness)
        best = max(top, key=top.get)
        ranked = dict(sorted(top.items(), key=lambda kv: -kv[1])[:n_probs])
        logprobs = {"content": [_entry(best, top[best], ranked)]} if n_probs else None
        return {**LLAMA_SERVER_COMPLETION, "model": self.name, "choices": [
            {"text": best, "index": 0, "finish_reason": "length", "logprobs": logprobs}]}

    def echo_requests(self) -> list[dict]:
        return [r for r in self.requests if r.get("echo")]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def data(tmp_path):
    return str(write_mc_jsonl(tmp_path / "mc.jsonl", n=N))


def _records() -> list[MultipleChoiceRecord]:
    return [MultipleChoiceRecord(f"which is x number {i}?", ("a", "b", "c", "d"), i % 4)
            for i in range(N)]


@pytest.mark.parametrize("echo", ["ignore", "refuse"])
def test_letter_scores_through_the_chat_shape(echo):
    """Letter mode reads the chat-shaped top alternatives of /v1/completions; a letter
    outside them gets the floor, the endpoint's echo (ignored or refused) tried once."""
    server = LlamaServer("tiny", 1.5, echo)
    with loopback_server(server.handler()) as url:
        endpoint = remote.connect(url)
        scores, stats = remote.remote_option_scores(endpoint, _records(), mode="letter",
                                                    progress=False)
    for i, row in enumerate(scores.values):
        top = _letter_top(i, 1.5)
        want = [top.get(f" {c}", min(top.values())) for c in "ABCD"]
        np.testing.assert_allclose(row, want)
    assert stats.floored == len(OUTSIDE)
    _each_once(server.echo_requests())


def _each_once(echoes: list[dict]) -> None:
    """Echo requests were sent, none of them twice (a refusal of echo is not retried)."""
    prompts = [r["prompt"] for r in echoes]
    assert prompts and len(set(prompts)) == len(prompts), prompts


@pytest.mark.parametrize("echo", ["ignore", "refuse"])
def test_cloze_is_one_line_naming_prompt_logprobs_and_letter_mode(data, tmp_path, capsys,
                                                                   echo):
    model, reference = LlamaServer("tiny", 1.5, echo), LlamaServer("ref", 1.0, echo)
    with loopback_server(model.handler()) as url, \
            loopback_server(reference.handler()) as ref_url:
        rc = main(["-q", "fit", "daca", "--model", url, "--reference", ref_url, "--data",
                   data, "--mode", "cloze", "--out", str(tmp_path / "adapter")])
    assert rc == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    reason = ("asked to echo the prompt with logprobs, it answered no logprobs"
              if echo == "ignore" else
              "asked to echo the prompt, it answered HTTP 500 'Only no echo is supported'")
    assert lines[0] == (f"RemoteError: {url} does not return prompt log-probabilities "
                        f"(echo), which cloze mode needs ({reason}); use --mode letter")
    # at its first answer: the requests then in flight (8 at once) end, the rest of the
    # 4 N are dropped
    echoes = model.echo_requests() + reference.echo_requests()
    _each_once(echoes)
    assert len(echoes) < N
    assert not (tmp_path / "adapter").exists()


def test_calm_fit_daca_in_letter_mode_writes_an_adapter(data, tmp_path, capsys):
    model, reference = LlamaServer("tiny", 1.8), LlamaServer("ref", 1.0)
    out = tmp_path / "adapter"
    with loopback_server(model.handler()) as url, \
            loopback_server(reference.handler()) as ref_url:
        rc = main(["-q", "fit", "daca", "--model", url, "--reference", ref_url, "--data",
                   data, "--mode", "letter", "--no-chat", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    adapter = CalibrationAdapter.from_pretrained(out)
    assert adapter.base_model.served == {"endpoint": url, "served_model": "tiny"}
    assert adapter.temperature == pytest.approx(1.8, rel=0.05)  # sharper than its reference
    letters = [r for r in model.requests if r["path"] == "/v1/completions" and not r.get("echo")]
    assert letters and all(r["logprobs"] == remote.TOP_LOGPROBS for r in letters)
