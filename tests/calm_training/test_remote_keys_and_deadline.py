"""Issue 38, items 2 and 5, against scripted servers on loopback.

* The API key never leaves the process: a server that echoes the Authorization header (in a
  401, a 500, a body that is not JSON, a model listing, even a successful answer) gets it
  into no raised message, log record, printed line or written file.
* One total deadline per endpoint call (``--timeout``), retries and backoff included: an
  HTTP/1.0 answer without Content-Length that trickles a byte every 0.5 s and never closes
  is cut there, not once per attempt.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from http.server import BaseHTTPRequestHandler

import pytest
from conftest import JSONHandler, loopback_server

from calm_runtime.cli.main import SERVED_MAX_RETRIES, SERVED_TIMEOUT, build_parser, main
from calm_runtime.data.sets import MultipleChoiceRecord, write_jsonl
from calm_runtime.errors import ConfigError
from calm_training.scoring import endpoint as http_endpoint
from calm_training.scoring import served as remote
from calm_training.scoring.redaction import REDACTED, redact

SECRET = "sk-top-secret-123"
OTHER = "sk-someone-else-456"  # a key that is not ours, echoed as "Bearer ..."
RECORDS = [MultipleChoiceRecord(f"question {i}?", ("yes", "no", "maybe"), i % 3)
           for i in range(3)]


@pytest.fixture(autouse=True)
def private(tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TEST_KEY", SECRET)
    monkeypatch.chdir(tmp_path)  # the default report folder


# ------------------------------------------------------------------ the redaction itself
@pytest.mark.parametrize(("text", "shown"), [
    (f"bad key: got header 'Bearer {SECRET}'", f"bad key: got header 'Bearer {REDACTED}'"),
    (f"the key {SECRET} is wrong", f"the key {REDACTED} is wrong"),
    (f"expected Bearer {OTHER}", f"expected Bearer {REDACTED}"),
    ("Authorization: Basic dXNlcjpwYXNz\r\nHost: x", f"Authorization: {REDACTED}\r\nHost: x"),
    ('{"authorization": "Bearer abc", "n": 1}', f'{{"authorization": "{REDACTED}", "n": 1}}'),
    ("{'Authorization': 'Token abc'}", f"{{'Authorization': '{REDACTED}'}}"),
    # prose stays prose
    ("the bearer of the ring", "the bearer of the ring"),
    ("authorization is needed", "authorization is needed"),
])
def test_redact(text, shown):
    assert redact(text, SECRET) == shown
    assert redact(shown, SECRET) == shown  # idempotent


# ------------------------------------------------------------------ item 2: the key
def _echoing_server(behaviour: str):
    class Echo(JSONHandler):
        def _auth(self) -> str:
            return self.headers.get("Authorization") or "none"

        def do_GET(self):
            if behaviour == "listing":  # the key as a served model's name
                names = ["tiny", f"echo {self._auth()}"]
            else:
                names = ["tiny"]
            self.send_json(200, {"object": "list",
                                 "data": [{"id": n, "object": "model"} for n in names]})

        def do_POST(self):
            auth = self._auth()
            self.rfile.read(int(self.headers["Content-Length"]))
            said = f"bad key: got header '{auth}' (expected 'Bearer {OTHER}')"
            if behaviour in ("401", "500"):
                return self.send_json(int(behaviour), {"error": {"message": said}})
            if behaviour == "500-text":
                headers = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
                return self.send_json(500, headers.encode(), "text/plain")
            if behaviour == "200-text":
                return self.send_json(200, f"<html>{said}</html>".encode(), "text/html")
            # "200-json": a well-formed answer whose tokens carry the key
            top = {" A": -0.5, " B": -1.5, " C": -2.5, f" {auth}": -3.0, SECRET: -4.0}
            self.send_json(200, {"choices": [{"text": f" {auth}", "index": 0,
                                              "logprobs": {"tokens": [" A"],
                                                           "token_logprobs": [-0.5],
                                                           "top_logprobs": [top],
                                                           "text_offset": [0]}}]})

    return loopback_server(Echo)


def _files_hold_the_key(root) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


@pytest.mark.parametrize(("behaviour", "code"), [
    ("401", 1), ("500", 1), ("500-text", 1), ("200-text", 1), ("listing", 0), ("200-json", 0)])
def test_an_echoed_key_is_never_raised_logged_printed_or_written(behaviour, code, tmp_path,
                                                                  capsys, caplog):
    caplog.set_level(logging.DEBUG)
    data = str(write_jsonl(tmp_path / "mc.jsonl", RECORDS))
    extra = ["--model-name", "tiny"] if behaviour == "listing" else []
    with _echoing_server(behaviour) as url:
        rc = main(["score", url, "--data", data, "--part", "all", "--mode", "letter",
                   "--api-key-env", "TEST_KEY", "--max-retries", "1", "--out",
                   str(tmp_path / "report.json"), *extra])
    printed = capsys.readouterr()
    assert rc == code, printed.err
    if behaviour in ("401", "500", "200-text"):  # what was echoed is shown, redacted
        assert REDACTED in printed.err
    assert SECRET not in printed.out and SECRET not in printed.err
    for record in caplog.records:
        assert SECRET not in record.getMessage()
        assert OTHER not in record.getMessage()
    assert OTHER not in printed.err
    assert _files_hold_the_key(tmp_path) == []


@pytest.mark.parametrize("behaviour", ["401", "500", "500-text", "200-text"])
def test_the_raised_error_holds_no_key(behaviour, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    with _echoing_server(behaviour) as url:
        endpoint = remote.Endpoint(url, "tiny", retries=1, sleep=lambda _s: None)
        with pytest.raises(remote.RemoteError) as info:
            endpoint.request("POST", "/completions", {"prompt": "x"})
    message = str(info.value)
    assert SECRET not in message and OTHER not in message and "\n" not in message
    assert (REDACTED in message) == (behaviour != "500-text")  # a text error body is not shown


def test_a_listing_that_names_the_key_is_redacted_in_the_refusal(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    with _echoing_server("listing") as url:
        with pytest.raises(ConfigError, match="does not serve 'nope'") as info:
            remote.connect(url, model_name="nope")
    assert SECRET not in str(info.value) and REDACTED in str(info.value)


# ------------------------------------------------------------------ item 5: the deadline
class Trickle(BaseHTTPRequestHandler):
    """HTTP/1.0, no Content-Length, a byte every 0.5 s, never closing (until the client
    goes, or a minute has passed: the test must not leave a thread behind for long)."""

    protocol_version = "HTTP/1.0"

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        for _ in range(120):
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.5)

    def log_message(self, *_a):
        pass


def test_a_trickling_answer_is_cut_at_the_total_deadline_retries_included():
    with loopback_server(Trickle) as url:
        endpoint = remote.Endpoint(url, "tiny", timeout=3, retries=2)  # real backoff
        started = time.monotonic()
        with pytest.raises(remote.RemoteError) as info:
            endpoint.request("POST", "/completions", {"prompt": "x"})
        took = time.monotonic() - started
    message = str(info.value)
    assert "no complete answer within 3 s" in message and "--timeout" in message
    assert "\n" not in message
    assert 2.9 <= took < 5, took


def test_calm_score_takes_the_deadline_from_its_flags(tmp_path, capsys):
    # 6 cloze requests, all in flight at once (--concurrency 8): the command ends at the
    # deadline (a request still queued when the first one fails would start then, and
    # take up to one more deadline)
    data = str(write_jsonl(tmp_path / "mc.jsonl", RECORDS[:2]))
    with loopback_server(Trickle) as url:
        started = time.monotonic()
        rc = main(["-q", "score", url, "--data", data, "--part", "all", "--mode", "cloze",
                   "--timeout", "3", "--max-retries", "2", "--out", str(tmp_path / "r.json")])
        took = time.monotonic() - started
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(lines) == 1
    assert lines[0].startswith("RemoteError: ") and "within 3 s" in lines[0]
    assert 2.9 <= took < 5, took


def test_backoff_never_sleeps_past_the_deadline():
    class Failing(JSONHandler):
        def do_POST(self):
            self.send_json(500, {"error": {"message": "boom"}})

    with loopback_server(Failing) as url:
        endpoint = remote.Endpoint(url, "tiny", timeout=1.0, retries=4)  # real backoff
        started = time.monotonic()
        with pytest.raises(remote.RemoteError, match=r"within 1 s.*last: HTTP 500 \(boom\)"):
            endpoint.request("POST", "/completions", {"prompt": "x"})
        assert time.monotonic() - started < 1.0


def test_each_attempt_gets_what_is_left_of_the_deadline(monkeypatch):
    given = []

    def slow(method, url, data, headers, timeout):
        given.append(timeout)
        time.sleep(0.3)
        raise TimeoutError("timed out")

    monkeypatch.setattr(http_endpoint, "_exchange", slow)
    endpoint = remote.Endpoint("http://127.0.0.1:9/v1", "m", timeout=2.0, retries=3,
                               backoff=0.0, sleep=lambda _s: None)
    with pytest.raises(remote.RemoteError, match="failed 4 times"):
        endpoint.request("GET", "/models")
    assert given[0] == pytest.approx(2.0, abs=0.05)
    for before, after in zip(given, given[1:], strict=False):
        assert after == pytest.approx(before - 0.3, abs=0.1)


# ------------------------------------------------------------------ the settings
def test_the_flags_reach_the_endpoint_and_their_defaults_are_one():
    from calm_training.posthoc.fit_config import FitConfig
    from calm_training.posthoc.plan import FitPlan

    assert (SERVED_TIMEOUT, SERVED_MAX_RETRIES) == (http_endpoint.DEFAULT_TIMEOUT,
                                                    http_endpoint.DEFAULT_MAX_RETRIES)
    assert (FitConfig.timeout, FitConfig.max_retries) == (SERVED_TIMEOUT, SERVED_MAX_RETRIES)
    config = FitConfig(model="http://127.0.0.1:9/v1", data="d", timeout=7.5, max_retries=1)
    source = FitPlan.resolve(config).model
    assert source._connect["timeout"] == 7.5 and source._connect["retries"] == 1
    parser = build_parser()
    commands = next(a for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    fit = next(a for a in commands["fit"]._actions
               if isinstance(a, argparse._SubParsersAction)).choices
    for parser in (commands["score"], fit["daca"], fit["ts"], commands["eval"]):
        text = parser.format_help()
        assert "--timeout SECONDS" in text and "--max-retries N" in text
        assert "the worst case of a request (default 120)" in " ".join(text.split())


@pytest.mark.parametrize(("field", "value"), [("timeout", 0), ("timeout", -1.0),
                                              ("max_retries", -1)])
def test_a_bad_setting_is_one_line(field, value):
    from calm_training.posthoc.fit_config import FitConfig

    with pytest.raises(ConfigError, match=field):
        FitConfig(model="http://127.0.0.1:9/v1", data="d", **{field: value})
    with pytest.raises(ConfigError, match=field.replace("_", "-")):
        remote.connect("http://127.0.0.1:9/v1",
                       **{"timeout" if field == "timeout" else "retries": value})
