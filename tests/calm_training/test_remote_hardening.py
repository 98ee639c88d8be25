"""The endpoint client cannot be turned against its user: no key across redirects, a total
deadline per request, bounded answers, credentials never recorded or printed, control
characters escaped, an unresolvable host not retried, a key variable with a line break refused
in one line. Each against a scripted server on loopback."""

from __future__ import annotations

import socket
import time
from http.server import BaseHTTPRequestHandler

import pytest
from conftest import JSONHandler, loopback_server

from calm_runtime.errors import ConfigError
from calm_training.scoring import endpoint as http_endpoint
from calm_training.scoring import served as remote

SECRET = "sk-top-secret-123"


@pytest.fixture(autouse=True)
def key(monkeypatch, tmp_path):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)


def test_the_key_never_follows_a_redirect():
    seen = []

    class Other(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_a):
            pass

    with loopback_server(Other) as other:
        class Redirecting(JSONHandler):
            def do_GET(self):
                self.send_response(307)
                self.send_header("Location", other + "/models?token=abc")
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET

        with loopback_server(Redirecting) as url:
            with pytest.raises(remote.RemoteError, match="redirect.*does not follow") as info:
                remote.connect(url, retries=0)
            endpoint = remote.Endpoint(url, "m", retries=0)
            with pytest.raises(remote.RemoteError, match="HTTP 307"):
                endpoint.request("POST", "/completions", {"prompt": "x"})
    assert seen == []  # the other origin never heard from us
    assert "token=abc" not in str(info.value) and SECRET not in str(info.value)


def test_a_trickling_server_is_cut_at_the_deadline():
    class Trickle(BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(40):  # one byte every 0.2 s: each read succeeds
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)

        def log_message(self, *_a):
            pass

    with loopback_server(Trickle) as url:
        endpoint = remote.Endpoint(url, "m", timeout=1.5, retries=0)
        started = time.monotonic()
        with pytest.raises(remote.RemoteError, match="within 1.5 s"):
            endpoint.request("POST", "/completions", {"prompt": "x"})
        assert time.monotonic() - started < 5


def test_an_answer_larger_than_the_bound_is_refused(monkeypatch):
    monkeypatch.setattr(http_endpoint, "MAX_RESPONSE_BYTES", 1 << 16)

    class Huge(BaseHTTPRequestHandler):
        def do_POST(self):
            # read the request first: a handler that leaves it unread resets the connection
            # on close, and the client then sees a reset instead of the oversized answer
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.end_headers()  # no Content-Length: read until the bound
            try:
                self.wfile.write(b"[" + b"1," * (1 << 17) + b"1]")
            except OSError:
                pass

        def log_message(self, *_a):
            pass

    with loopback_server(Huge) as url:
        with pytest.raises(remote.RemoteError, match="more than 65,536 bytes"):
            remote.Endpoint(url, "m", retries=0).request("POST", "/completions", {})


def test_endpoint_error_text_is_escaped():
    class Evil(JSONHandler):
        def do_POST(self):
            self.send_json(400, {"error": {"message": "bad \x1b[2J\x1b]0;owned\x07 request"}})

    with loopback_server(Evil) as url:
        with pytest.raises(remote.RemoteError) as info:
            remote.Endpoint(url, "m", retries=0).request("POST", "/completions", {})
    message = str(info.value)
    assert "\x1b" not in message and "\x07" not in message
    assert "\\x1b[2J" in message


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/v1?api_key=" + SECRET,
                                 f"http://user:{SECRET}@127.0.0.1:9/v1",
                                 "http://127.0.0.1:9/v1#" + SECRET])
def test_credentials_in_the_url_are_refused_and_never_shown(url):
    with pytest.raises(ConfigError, match="credentials or a query") as info:
        remote.connect(url, retries=0)
    assert SECRET not in str(info.value)


def test_an_unresolvable_host_is_not_retried(monkeypatch):
    calls = []

    def no_dns(*args, **kwargs):
        calls.append(args)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    endpoint = remote.Endpoint("http://no-such-host.invalid/v1", "m", retries=6,
                               sleep=lambda _s: None)
    with pytest.raises(remote.RemoteError, match="cannot resolve the host"):
        endpoint.request("GET", "/models")
    assert len(calls) == 1


def test_a_key_with_a_line_break_is_one_line(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET + "\r\nX-Evil: 1")
    endpoint = remote.Endpoint("http://127.0.0.1:9/v1", "m", retries=0)
    with pytest.raises(ConfigError, match="OPENAI_API_KEY holds spaces or control") as info:
        endpoint.request("GET", "/models")
    assert SECRET not in str(info.value)


# ------------------------------------------------------------------ terminal control in messages
CONTROL = "x\x1b[2J\x1b]0;owned\x07y\nz\u202ew\u2028v"


def _one_clean_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert not any(c in lines[0] for c in "\x1b\x07\r\u202e\u2028"), lines[0]
    return lines[0]


@pytest.mark.parametrize("where", ["data", "adapter"])
def test_a_file_name_with_terminal_control_is_one_escaped_line(where, tmp_path, capsys):
    from calm_runtime.cli.main import main
    from calm_runtime.data.sets import MultipleChoiceRecord, write_jsonl

    data = str(write_jsonl(tmp_path / "mc.jsonl",
                           [MultipleChoiceRecord("q?", ("yes", "no"), 0)]))
    named = str(tmp_path / CONTROL)
    argv = (["--data", named + ".jsonl"] if where == "data"
            else ["--data", data, "--part", "all", "--adapter", named])
    rc = main(["-q", "score", "http://127.0.0.1:9/v1", *argv, "--out", str(tmp_path / "r")])
    line = _one_clean_line(capsys.readouterr().err)
    assert rc == 1 and "x\\x1b[2J\\x1b]0;owned\\x07y\\nz\\u202ew\\u2028v" in line, line


@pytest.mark.parametrize("error", [ConfigError(f"bad {CONTROL}"),
                                   FileNotFoundError(2, "No such file", CONTROL)])
def test_the_error_printer_writes_one_escaped_line(error, capsys):
    from calm_runtime.cli.common import run_command

    def fail():
        raise error

    assert run_command(fail) == 1
    assert "\\x1b[2J" in _one_clean_line(capsys.readouterr().err)


def test_server_text_with_line_breaks_stays_one_line():
    class Evil(JSONHandler):
        def do_POST(self):
            self.send_json(400, {"error": {"message": f"bad {CONTROL} request"}})

    with loopback_server(Evil) as url:
        with pytest.raises(remote.RemoteError) as info:
            remote.Endpoint(url, "m", retries=0).request("POST", "/completions", {})
    assert "\\nz" in _one_clean_line(str(info.value))
