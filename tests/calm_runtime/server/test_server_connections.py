"""Connections cannot hold the server (calm_runtime/server/connections.py): half-open,
idle and trickling connections are closed by their deadlines or evicted by the caps, while
``/health`` and normal requests are answered; every refusal of the HTTP layer is the
server's JSON error object."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

pytest.importorskip("fastapi")

from calm_runtime.server import ServeConfig, create_app  # noqa: E402
from calm_runtime.server.background import serve_in_background  # noqa: E402


@pytest.fixture(scope="module")
def served(runtime_engine, runtime_lm):
    config = ServeConfig(engine=str(runtime_engine[2]), model_name="tiny", threads=1,
                         header_timeout_s=1.0, body_timeout_s=1.0,
                         max_connections_per_client=64)
    with serve_in_background(create_app(config, runtime_lm)) as (url, _):
        parts = urllib.parse.urlsplit(url)
        yield url, (parts.hostname, parts.port)


def _connect(address, payload: bytes = b"") -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    if payload:
        sock.sendall(payload)
    return sock


def _read_all(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (seconds)."""
    sock.settimeout(timeout)
    start, data = time.monotonic(), b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def _json_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert b"application/json" in head.lower(), raw[:300]
    return status, json.loads(body)


def _timed_get(url: str) -> float:
    start = time.monotonic()
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
    return time.monotonic() - start


def _complete(url: str) -> dict:
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2,
                       "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def _room_for(sockets: int) -> int:
    """Raise this process's file-descriptor limit for ``sockets`` client sockets and the
    server's side of them (same process); how many fit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * sockets + 256
    if soft < want and (hard == resource.RLIM_INFINITY or hard >= want):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return min(sockets, (soft - 256) // 2)


def test_a_flood_of_half_open_connections_leaves_the_server_answering(served):
    url, address = served
    n = _room_for(1200)
    assert n >= 600, f"a file-descriptor limit too low to open {n} connections"
    flood = [_connect(address, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
             for _ in range(n)]
    try:
        assert _timed_get(url + "/health") < 1.0
        start = time.monotonic()
        assert _complete(url)["choices"][0]["text"] is not None
        assert time.monotonic() - start < 1.0
        open_now = 0
        for sock in flood:
            sock.setblocking(False)
            try:
                open_now += sock.recv(1) != b""
            except BlockingIOError:
                open_now += 1  # nothing to read: the server still holds it
            except OSError:
                pass
        assert open_now <= 64, open_now  # the per-client cap evicted the rest
    finally:
        for sock in flood:
            sock.close()


def test_idle_and_trickling_connections_are_closed_at_the_header_deadline(served):
    _, address = served
    idle = _connect(address)
    data, closed_after = _read_all(idle, timeout=5)
    assert data == b"" and closed_after < 2.0  # nothing sent: closed, nothing to say
    trickle = _connect(address)
    start = time.monotonic()
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    try:
        for byte in request:  # one byte every 0.2 s: each arrival resets nothing
            trickle.sendall(bytes([byte]))
            time.sleep(0.2)
    except OSError:
        pass  # closed under us: what the deadline is for
    data, _ = _read_all(trickle, timeout=5)
    assert time.monotonic() - start < 2.5
    status, error = _json_error(data)
    assert status == 408 and error["error"]["code"] == "request_timeout"


def test_a_slow_body_gets_408_in_json(served):
    _, address = served
    sock = _connect(address, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    data, closed_after = _read_all(sock, timeout=5)
    status, error = _json_error(data)
    assert status == 408 and "--body-timeout" in error["error"]["message"]
    assert closed_after < 2.0


@pytest.mark.parametrize("request_bytes,status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
     + str(10 ** 20).encode() + b"\r\n\r\n", 413),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
    # headers past h11's bound before their end arrived
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000, 431),
])
def test_what_the_http_layer_refuses_is_a_json_error(served, request_bytes, status):
    _, address = served
    sock = _connect(address, request_bytes)
    data, _ = _read_all(sock, timeout=5)
    got, error = _json_error(data)
    assert got == status, data[:300]
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert len(data) < 1024


def test_a_non_ascii_api_key_is_refused_at_start(monkeypatch, runtime_engine):
    from calm_runtime.errors import ConfigError

    monkeypatch.setenv("CALM_TEST_KEY", "clé-ünï-7")
    config = ServeConfig(engine=str(runtime_engine[2]), api_key_env="CALM_TEST_KEY")
    with pytest.raises(ConfigError, match="printable ASCII"):
        config.api_key()


# ---------------------------------------------------------------- one deadline per request
@pytest.fixture()
def slow_scoring_server(runtime_engine, monkeypatch):
    """A server with a 1 s request timeout whose prompt scoring takes 0.6 s a prompt, or
    3 s in one step that never looks at should_stop (``slow["step"]``)."""
    from calm_runtime.inference.lm import CalibratedLM

    lm = CalibratedLM.load(runtime_engine[2], threads=1)
    real = lm.prompt_logprobs
    slow = {"step": 0.6}

    def slowly(prompt, **kwargs):
        time.sleep(slow["step"])
        return real(prompt, **kwargs)

    monkeypatch.setattr(lm, "prompt_logprobs", slowly)
    config = ServeConfig(engine=str(runtime_engine[2]), model_name="tiny", threads=1,
                         request_timeout_s=1.0)
    with serve_in_background(create_app(config, lm)) as (url, _):
        yield url, slow
    lm.close()


def _post(url: str, body: dict) -> tuple[int, dict, float]:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read()), time.monotonic() - start
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), time.monotonic() - start


def test_every_prompt_of_an_echo_shares_the_request_deadline(slow_scoring_server):
    """Three prompts at 0.6 s each: 1.8 s of scoring for a 1 s request: 504 at the deadline
    (each prompt used to get a deadline of its own, and the request an answer at 1.8 s)."""
    url, _ = slow_scoring_server
    status, body, took = _post(url, {"model": "tiny", "prompt": ["a b", "c d", "e f"],
                                     "echo": True, "max_tokens": 0, "logprobs": 1})
    assert status == 504 and body["error"]["code"] == "timeout", body
    assert took < 1.5, took


def test_the_answer_does_not_wait_for_a_running_step(slow_scoring_server):
    """A step that runs 3 s without looking at should_stop: the 504 comes at the deadline,
    not when the step ends; the next request is served once the engine is free."""
    url, slow = slow_scoring_server
    slow["step"] = 3.0
    status, _, took = _post(url, {"model": "tiny", "prompt": "a b", "echo": True,
                                  "max_tokens": 0})
    assert status == 504 and took < 1.5, (status, took)
    slow["step"] = 0.0
    time.sleep(2.5)  # the 3 s step ends; the gate passes to the next call
    status, body, _ = _post(url, {"model": "tiny", "prompt": "a b", "echo": True,
                                  "max_tokens": 0})
    assert status == 200, body


def test_no_error_body_exceeds_one_kilobyte(served):
    """A long model name (or any long value) echoed into an error is cut short."""
    url, _ = served
    for name in ("x" * 500_000, "é\x00" * 5000):
        status, body, _ = _post(url, {"model": name, "prompt": "a", "max_tokens": 1})
        assert status in (404, 413), body
        assert len(json.dumps(body, ensure_ascii=False).encode()) <= 1024
