"""The API key in any form a server could echo it — base64 (standard, URL-safe, HTTP Basic
``user:key``), percent-encoded, case-folded, JSON-escaped twice, cut short — is kept out of
everything calm raises, logs, prints, caches or writes (training/scoring/redaction.py);
``--timeout`` and ``--max-retries`` are bounded with named limits."""

from __future__ import annotations

import base64
import json
import logging
import urllib.parse

import pytest
from conftest import JSONHandler, loopback_server

from calm_runtime.cli.main import main
from calm_runtime.data.sets import MultipleChoiceRecord, write_jsonl
from calm_runtime.errors import ConfigError
from calm_training.scoring import endpoint as http_endpoint
from calm_training.scoring.redaction import REDACTED, redact

SECRET = "sk-Top/Secret+key-0123456789abcdef"
RECORDS = [MultipleChoiceRecord(f"question {i}?", ("yes", "no", "maybe"), i % 3)
           for i in range(3)]

ENCODINGS = {
    "exact": lambda k: k,
    "base64": lambda k: base64.b64encode(k.encode()).decode(),
    "base64-url": lambda k: base64.urlsafe_b64encode(k.encode()).decode().rstrip("="),
    "basic": lambda k: "Basic " + base64.b64encode(f"alice:{k}".encode()).decode(),
    "base64-inside": lambda k: base64.b64encode(f"x{k}yz".encode()).decode(),
    "percent": lambda k: urllib.parse.quote(k, safe=""),
    "percent-lower": lambda k: urllib.parse.quote(k, safe="").lower(),
    "plus": lambda k: urllib.parse.quote_plus(k),
    "upper": lambda k: k.upper(),
    "lower": lambda k: k.lower(),
    "all-but-3": lambda k: k[:-3],
    "json-twice": lambda k: json.dumps(json.dumps(k)),
    "middle": lambda k: k[5:20],
}


def leaks(text: str, key: str = SECRET) -> list[str]:
    """Every encoding of ``key`` (and every 8-character run of it) still in ``text``."""
    found = [name for name, encode in ENCODINGS.items()
             if name != "basic" and encode(key) and encode(key).lower() in text.lower()]
    found += [f"run {key[i:i + 8]!r}" for i in range(len(key) - 7)
              if key[i:i + 8].lower() in text.lower()]
    basic = ENCODINGS["basic"](key).split()[1]
    return found + (["basic"] if basic in text else [])


@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_redact_removes_every_form(name):
    text = f"error: the header said {ENCODINGS[name](SECRET)}; try again"
    shown = redact(text, SECRET)
    assert leaks(shown) == [] and REDACTED in shown, shown
    assert shown.startswith("error: the header said ") and shown.endswith("; try again")
    assert redact(shown, SECRET) == shown


def test_ordinary_text_is_untouched():
    text = ("The answer is B; base64 aGVsbG8gd29ybGQ= and 100% sure, sk-other-key, "
            "Basic arithmetic, the bearer of news")
    assert redact(text, SECRET) == text


@pytest.fixture(autouse=True)
def private(tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TEST_KEY", SECRET)
    monkeypatch.chdir(tmp_path)


def _server(encoding: str, behaviour: str):
    echoed = ENCODINGS[encoding](SECRET)

    class Echo(JSONHandler):
        def do_GET(self):
            names = [echoed] if behaviour == "listing" else ["tiny"]
            self.send_json(200, {"object": "list",
                                 "data": [{"id": n, "object": "model"} for n in names]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if behaviour == "401":
                return self.send_json(401, {"error": {"message": f"bad key {echoed}"}})
            top = {" A": -0.5, " B": -1.5, " C": -2.5, echoed: -3.0}
            self.send_json(200, {"choices": [{"text": " A", "index": 0,
                                              "logprobs": {"tokens": [" A"],
                                                           "token_logprobs": [-0.5],
                                                           "top_logprobs": [top],
                                                           "text_offset": [0]}}]})

    return loopback_server(Echo)


@pytest.mark.parametrize("encoding", ["base64", "basic", "percent", "upper", "all-but-3",
                                      "json-twice"])
@pytest.mark.parametrize(("behaviour", "code"), [("401", 1), ("listing", 1), ("200-json", 0)])
def test_an_echoed_encoding_reaches_no_output_and_no_file(encoding, behaviour, code, tmp_path,
                                                          capsys, caplog):
    caplog.set_level(logging.DEBUG)
    data = str(write_jsonl(tmp_path / "mc.jsonl", RECORDS))
    with _server(encoding, behaviour) as url:
        rc = main(["score", url, "--data", data, "--part", "all", "--mode", "letter",
                   "--api-key-env", "TEST_KEY", "--max-retries", "1", "--out",
                   str(tmp_path / "report.json")])
    printed = capsys.readouterr()
    assert rc == code, printed.err
    if behaviour == "listing":
        assert "holds the API key" in printed.err
    assert leaks(printed.out) == [] and leaks(printed.err) == []
    for record in caplog.records:
        assert leaks(record.getMessage()) == []
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.name != "mc.jsonl":
            assert leaks(path.read_text(errors="replace")) == [], path


@pytest.mark.parametrize(("timeout", "retries", "match"), [
    (1e12, 1, "at most 86400 seconds"), (float("inf"), 1, "timeout"), (0, 1, "timeout"),
    (10, 10 ** 6, "from 0 to 100"), (10, -1, "max_retries")])
def test_the_deadline_is_bounded_with_named_limits(timeout, retries, match):
    with pytest.raises(ConfigError, match=match):
        http_endpoint.connect("http://127.0.0.1:9/v1", timeout=timeout, retries=retries)


def test_a_huge_timeout_on_the_command_line_is_one_line(tmp_path, capsys):
    data = str(write_jsonl(tmp_path / "mc.jsonl", RECORDS))
    rc = main(["score", "http://127.0.0.1:9/v1", "--data", data, "--timeout", "1e12",
               "--out", str(tmp_path / "r.json")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("ConfigError: "), lines
    assert str(http_endpoint.MAX_TIMEOUT).rstrip("0").rstrip(".") in lines[0]
