"""Constrained choices and echo inside the server's limits: a request shaped like the probe
that drove `calm serve` to 16 GB (64 choices of 1,000 characters after a 3,000-character
prompt, a 4,096-token engine) keeps the server under 2 GB, and such requests obey
--max-queue, --request-timeout and a client that goes away. A real `calm serve` process, so
that its own peak memory is what is measured."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("fastapi")

from conftest import tiny_llama_dir  # noqa: E402

#: a vocabulary large enough that 64 x 1,000 positions of logits at once are gigabytes
VOCAB = 8192


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    """A tiny Llama with a 4,096-token context and an 8,192-token vocabulary, exported."""
    import json as _json

    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine

    model_dir = tiny_llama_dir(tmp_path_factory, tied=True, seed=31, vocab_size=VOCAB,
                               name="long-llama")
    config = _json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (model_dir / "config.json").write_text(_json.dumps(config))
    engine = tmp_path_factory.mktemp("long-engine") / "engine"
    export_engine(model_dir, engine, config=ExportConfig(greedy_steps=2, progress=False,
                                                         exporter="torchscript"))
    return engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, engine, *options: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "calm_runtime.cli.main", "-q", "serve", str(engine), "--port",
             str(self.port), "--threads", "2", "--model-name", "long", *options],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                assert self.proc.poll() is None, self.proc.stderr.read()
                assert time.monotonic() < deadline, "calm serve did not start"
                time.sleep(0.25)

    def post(self, body: dict, timeout: float = 300) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + "/v1/completions", method="POST",
                                     data=json.dumps({"model": "long", **body}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def peak_rss_bytes(self) -> int:
        for line in open(f"/proc/{self.proc.pid}/status", encoding="ascii"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _big_choice(rng) -> dict:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    prompt = "".join(rng.choice(letters, 3000))
    choices = ["".join(rng.choice(letters, 998)) + f"{i:02d}" for i in range(64)]
    return {"prompt": prompt, "max_tokens": 4, "guided_choice": choices}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for peak RSS")
def test_a_huge_constrained_choice_stays_under_2_gb(long_engine):
    server = Server(long_engine)
    try:
        status, body = server.post(_big_choice(np.random.default_rng(0)))
        peak = server.peak_rss_bytes()
    finally:
        server.stop()
    print(f"\n64 choices x 1,000 characters after 3,000: HTTP {status}, server peak RSS "
          f"{peak / 2**30:.2f} GB")
    assert status == 200, body["error"]["message"] if "error" in body else body
    assert len(body["choices"][0]["calm"]["option_probabilities"]) == 64
    assert peak < 2 << 30, f"server peak RSS {peak / 2**30:.2f} GB"


def test_scoring_requests_obey_the_queue_and_the_timeout(long_engine):
    server = Server(long_engine, "--max-queue", "1", "--request-timeout", "1")
    rng = np.random.default_rng(1)
    bodies = [_big_choice(rng) for _ in range(6)]
    try:
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            statuses = [s for s, _ in pool.map(server.post, bodies)]
        elapsed = time.monotonic() - started
        echo = {"prompt": "".join(rng.choice(list("abcdefgh "), 3900)), "max_tokens": 0,
                "echo": True, "logprobs": 5}
        echo_status, _ = server.post(echo)
    finally:
        server.stop()
    print(f"\nsix concurrent choices, --max-queue 1 --request-timeout 1: {sorted(statuses)} in "
          f"{elapsed:.1f} s; a 3,900-character echo: HTTP {echo_status}")
    assert 429 in statuses  # at most one waits behind the one running
    assert set(statuses) <= {429, 504, 200}
    assert 504 in statuses or 200 in statuses
    assert elapsed < 30, f"six requests under a 1 s timeout took {elapsed:.1f} s"
    assert echo_status in (200, 504)


def test_an_echo_answer_is_bounded(long_engine):
    """64 prompts of ~3,900 tokens with 20 alternatives each would be millions of entries
    (hundreds of MB of JSON): refused before any work, naming the limit."""
    server = Server(long_engine)
    rng = np.random.default_rng(2)
    prompts = ["".join(rng.choice(list("abcdefgh "), 3900)) for _ in range(64)]
    try:
        started = time.monotonic()
        status, body = server.post({"prompt": prompts, "max_tokens": 0, "echo": True,
                                    "logprobs": 20})
        elapsed = time.monotonic() - started
        health = urllib.request.urlopen(server.url + "/health", timeout=5).status
    finally:
        server.stop()
    assert status == 400 and "log-probabilities" in body["error"]["message"], body
    assert elapsed < 10 and health == 200


def test_a_client_that_goes_away_stops_its_scoring(long_engine):
    """A constrained choice whose client disconnects is stopped between its steps: the
    server counts it cancelled and the next request is answered at once."""
    import http.client
    import json as _json

    server = Server(long_engine)
    try:
        body = _json.dumps({"model": "long", **_big_choice(np.random.default_rng(3))})
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
        time.sleep(1.0)  # the scoring is under way
        conn.sock.close()  # the client goes away without reading the answer
        conn.close()
        started = time.monotonic()
        # another scoring request: it waits for the engine's scoring slot, which the
        # abandoned one would hold for tens of seconds had it not stopped
        status, _ = server.post({"prompt": "Hi", "max_tokens": 2,
                                 "guided_choice": ["yes", "no"]}, timeout=60)
        waited = time.monotonic() - started
        metrics = urllib.request.urlopen(server.url + "/metrics", timeout=5).read().decode()
    finally:
        server.stop()
    print(f"\nafter a client left mid-choice: the next choice answered in {waited:.2f} s")
    assert status == 200 and waited < 10, waited
    cancelled = [line for line in metrics.splitlines()
                 if line.startswith("calm_requests_cancelled_total")]
    assert cancelled and float(cancelled[0].split()[-1]) >= 1, cancelled
