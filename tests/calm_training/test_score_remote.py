"""``calm score URL``: a served model scored through the real command against a scripted
OpenAI-compatible server on loopback; the numbers are checked against the scripted
log-probabilities, with and without a served-model adapter."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import JSONHandler, loopback_server

from calm_runtime.cli.main import main
from calm_runtime.data.sets import MultipleChoiceRecord, OpenQARecord, write_jsonl
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity

RECORDS = [MultipleChoiceRecord(f"question {i}?", ("yes", "no", "maybe"), i % 3)
           for i in range(6)]
#: the question whose " C" is not among the returned alternatives (and echo is refused)
FLOORED = 5
OTHER = -3.0  # the log-probability of " the", the smallest returned alternative


def _top(i: int) -> dict[str, float]:
    top = {" A": -0.4 - i / 10, " B": -1.3 + i / 20, " C": -2.2 + i / 4, " the": OTHER}
    if i == FLOORED:
        del top[" C"]
    return top


def _letter_logprobs(i: int) -> np.ndarray:
    """What the scorer should read for question ``i``: the letters' log-probabilities, the
    floored letter at the smallest returned one."""
    top = _top(i)
    return np.array([top.get(letter, OTHER) for letter in (" A", " B", " C")])


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # the default report folder


@pytest.fixture
def server():
    seen: dict[str, list] = {"auth": [], "paths": []}

    class Handler(JSONHandler):
        def do_GET(self):
            seen["paths"].append(self.path)
            self.send_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        def do_POST(self):
            seen["paths"].append(self.path)
            seen["auth"].append(self.headers.get("Authorization"))
            body = self.json_body()
            if body.get("echo"):
                return self.send_json(400, {"error": {"message": "echo is not supported"}})
            prompt = body["prompt"]
            i = int(prompt.split("question ")[1].split("?")[0])
            top = _top(i)
            self.send_json(200, {"choices": [{"text": " A", "index": 0,
                                              "finish_reason": "length",
                                              "logprobs": {"tokens": [" A"],
                                                           "token_logprobs": [top[" A"]],
                                                           "top_logprobs": [top],
                                                           "text_offset": [len(prompt)]}}]})

    with loopback_server(Handler) as url:
        yield url, seen


@pytest.fixture
def data(tmp_path):
    return str(write_jsonl(tmp_path / "mc.jsonl", RECORDS))


def _score(url: str, data: str, out, *extra: str) -> int:
    return main(["-q", "score", url, "--data", data, "--part", "all", "--mode", "letter",
                 "--bins", "1", "--out", str(out), *extra])


def _adapter(path, endpoint: str, temperature: float, name: str = "tiny") -> str:
    adapter = CalibrationAdapter.identity(ModelIdentity.served_model(endpoint, name),
                                          temperature=temperature, kind="daca",
                                          method={"name": "daca", "mode": "letter",
                                                  "variant": None})
    adapter.save_pretrained(path)
    return str(path)


def _by_hand(temperature: float) -> tuple[np.ndarray, np.ndarray]:
    probs = np.stack([_softmax(_letter_logprobs(i) / temperature) for i in range(len(RECORDS))])
    labels = np.array([r.answer for r in RECORDS])
    return probs, labels


def test_letter_score_of_a_url_matches_the_scripted_logprobs(server, data, tmp_path, capsys,
                                                             monkeypatch):
    url, seen = server
    monkeypatch.setenv("TEST_KEY", "sk-test-0123456789")
    out = tmp_path / "r.json"
    assert _score(url, data, out, "--api-key-env", "TEST_KEY", "--concurrency", "2") == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    probs, labels = _by_hand(1.0)
    conf, correct = probs.max(axis=1), probs.argmax(axis=1) == labels
    acc = correct.mean()
    ece = abs(acc - conf.mean())  # one bin: |accuracy - mean confidence|
    assert 0 < acc < 1 and ece > 0.01
    assert report["metrics"]["accuracy"] == pytest.approx(acc)
    assert report["metrics"]["ece"] == pytest.approx(ece)
    assert report["metrics"]["nll"] == pytest.approx(-np.mean(np.log(probs[range(6), labels])))
    assert [p["confidence"] for p in report["predictions"]] == pytest.approx(conf.tolist())
    assert [p["prediction"] for p in report["predictions"]] == probs.argmax(axis=1).tolist()
    # the engine report's keys, plus the served model's
    assert {"kind", "mode", "variant", "answer_temperature", "n_options", "n_skipped",
            "metrics", "predictions", "engine", "data", "split", "backend"} <= set(report)
    assert report["kind"] == "multiple_choice" and report["engine"] == url
    assert report["floored"] == 1 and report["adapter"] is None
    assert "1 of 6 questions with an option letter at the floor" in printed
    assert f"| served model | {acc:.3f} | {ece:.3f} |" in printed
    assert set(seen["auth"]) == {"Bearer sk-test-0123456789"}  # the key from the variable only
    assert all(path.startswith("/v1/") for path in seen["paths"])


def test_a_served_adapter_applies_its_temperature(server, data, tmp_path, capsys):
    url, seen = server
    adapter = _adapter(tmp_path / "served-daca", url, 2.0)
    out = tmp_path / "r.json"
    assert _score(url, data, out, "--adapter", adapter) == 0
    report = json.loads(out.read_text())
    probs, labels = _by_hand(2.0)
    plain, _ = _by_hand(1.0)
    assert [p["confidence"] for p in report["predictions"]] == pytest.approx(
        probs.max(axis=1).tolist())
    assert (probs.max(axis=1) < plain.max(axis=1)).all()  # T = 2 softens every answer
    assert report["metrics"]["accuracy"] == pytest.approx(
        (probs.argmax(axis=1) == labels).mean())
    assert report["adapter"] == adapter and report["temperature"] == 2.0
    assert "| served model + adapter |" in capsys.readouterr().out
    # the requests of the first run were cached: the second run sends only the prompt-format
    # probe (does the endpoint serve chat completions? this scripted one does not) and the
    # echo retries
    posts = len(seen["auth"])
    assert _score(url, data, tmp_path / "again.json") == 0
    assert len(seen["auth"]) - posts <= 2


def test_an_adapter_of_another_endpoint_is_one_line(server, data, tmp_path, capsys):
    url, _ = server
    adapter = _adapter(tmp_path / "elsewhere", "http://other-box:8000/v1", 2.0)
    assert _score(url, data, tmp_path / "r.json", "--adapter", adapter) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ConfigError: ")
    assert "http://other-box:8000/v1" in lines[0] and url in lines[0]
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("flags", [["--backend", "torch"], ["--threads", "2"],
                                   ["--model", "models/local-copy"]])
def test_engine_options_with_a_url_are_one_line(data, tmp_path, capsys, flags):
    # no server: the command stops before any request
    assert _score("http://127.0.0.1:9/v1", data, tmp_path / "r.json", *flags) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ConfigError: {flags[0]} is for engines")


def test_open_qa_with_a_url_names_calm_eval(tmp_path, capsys):
    qa = write_jsonl(tmp_path / "qa.jsonl", [OpenQARecord("Capital of France?", ("Paris",)),
                                            OpenQARecord("2 + 2?", ("4", "four"))])
    assert main(["score", "http://127.0.0.1:9/v1", "--data", f"{qa}:all"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "calm eval --mode p_true --model http://127.0.0.1:9/v1" in lines[0]
