"""The API key in the forms servers really echo it — hex, MIME-wrapped base64, ``\\u``
escapes, HTML character references, reversed, joined by zero-width characters, cut into
7-character pieces over consecutive fields — in none of calm's channels: errors (JSON, text
and HTTP 500 bodies), log records, the score cache, an adapter's manifest, ``calm score``'s
report and stdout. A key too short to be kept out of output is refused in one line before
any request."""

from __future__ import annotations

import base64
import html
import json
import logging
import re

import pytest
from conftest import JSONHandler, loopback_server

from calm_runtime.cli.main import main
from calm_runtime.data.sets import MultipleChoiceRecord, write_jsonl
from calm_runtime.errors import ConfigError
from calm_training.scoring import endpoint as http_endpoint
from calm_training.scoring.redaction import MIN_FRAGMENT, MIN_KEY_LENGTH, REDACTED, redact

SECRET = "sk-proj-Top/Secret+key-0123456789abcdefXYZ"
RECORDS = [MultipleChoiceRecord(f"question {i}?", ("yes", "no", "maybe"), i % 3)
           for i in range(3)]

FORMS = {
    "hex": lambda k: k.encode().hex(),
    "hex-upper": lambda k: k.encode().hex().upper(),
    # wrapped at 76 with the key across the line break
    "mime": lambda k: base64.encodebytes(("x" * 40 + k).encode()).decode(),
    "u-escaped": lambda k: "".join(f"\\u{ord(c):04x}" for c in k),
    "html-decimal": lambda k: "".join(f"&#{ord(c)};" for c in k),
    "html-hex": lambda k: "".join(f"&#x{ord(c):x};" for c in k),
    "reversed": lambda k: k[::-1],
    "zero-width-joined": lambda k: "\u200d".join(k),
}


def _plain(text: str) -> str:
    """``text`` as a reader decodes it: escapes undone, invisible characters and line
    breaks (real or escaped) dropped, lower-cased."""
    text = re.sub(r"\\+", lambda m: "\\", text)
    text = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)
    text = html.unescape(text)
    return re.sub(r"\\[nr]|\\x0[ad]|[\n\r\u200b-\u200f\u2060-\u2064]", "", text).lower()


def leaks(text: str, key: str = SECRET) -> list[str]:
    """What of ``key`` a reader could still recover from ``text``."""
    plain, width = _plain(text), MIN_FRAGMENT
    found = [f"run {i}" for i in range(len(key) - width + 1)
             if key[i:i + width].lower() in plain]
    found += [f"reversed run {i}" for i in range(len(key) - width + 1)
              if key[::-1][i:i + width].lower() in plain]
    found += [f"hex run {i}" for i in range(len(key) - width + 1)
              if key[i:i + width].encode().hex() in plain]
    wrapped = base64.b64encode(("x" * 40 + key).encode()).decode()[56:90]
    found += ["base64"] if wrapped.lower() in plain else []
    return found


@pytest.mark.parametrize("name", sorted(FORMS))
@pytest.mark.parametrize("as_json", [False, True])
def test_redact_removes_each_echoed_form(name, as_json):
    text = f"error: invalid key {FORMS[name](SECRET)}; try again"
    if as_json:  # as a cache line or a logged body holds it
        text = json.dumps({"message": text})
    assert leaks(text) != []  # the probe sees it
    shown = redact(text, SECRET)
    assert leaks(shown) == [] and REDACTED in shown, shown
    assert "error: invalid key " in shown and "; try again" in shown
    assert redact(shown, SECRET) == shown


def test_ordinary_text_with_escapes_is_untouched():
    text = ("sha256 9f86d081884c7d659a2feaa0c55ad015 &amp; &#65;&#x42; \\u0043 %20 a\u200db\n"
            "line two, aGVsbG8gd29ybGQ=\r\nsk-other-key-9876, the answer is B")
    assert redact(text, SECRET) == text


@pytest.fixture(autouse=True)
def private(tmp_path, monkeypatch):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TEST_KEY", SECRET)
    monkeypatch.chdir(tmp_path)


def _server(echoed: str, behaviour: str, seen: list | None = None):
    class Echo(JSONHandler):
        def do_GET(self):
            if seen is not None:
                seen.append(self.path)
            names = [f"model-{echoed}"] if behaviour == "listing" else ["tiny"]
            self.send_json(200, {"object": "list",
                                 "data": [{"id": n, "object": "model"} for n in names]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if seen is not None:
                seen.append(self.path)
            said = f"invalid key {echoed}"
            if behaviour == "401":
                return self.send_json(401, {"error": {"message": said}})
            if behaviour == "not-json":  # an HTML page where JSON belongs
                return self.send_json(200, f"<p>{said}</p>".encode(), "text/html")
            if behaviour == "500":
                return self.send_json(500, {"error": {"message": said}})
            top = {" A": -0.5, " B": -1.5, " C": -2.5}
            if behaviour == "pieces":  # the key as 7-character tokens, one after another
                top.update({SECRET[i:i + 7]: -5.0 - i / 100 for i in range(0, len(SECRET), 7)})
            else:
                top[echoed] = -3.0
            self.send_json(200, {"choices": [{"text": " A", "index": 0,
                                              "logprobs": {"tokens": [" A"],
                                                           "token_logprobs": [-0.5],
                                                           "top_logprobs": [top],
                                                           "text_offset": [0]}}]})

    return loopback_server(Echo)


def _channels(tmp_path, printed, caplog) -> dict[str, str]:
    out = {"stdout": printed.out, "stderr": printed.err,
           "log": "\n".join(r.getMessage() for r in caplog.records)}
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.name != "mc.jsonl":
            out[str(path.relative_to(tmp_path))] = path.read_text(errors="replace")
    return out


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize(("behaviour", "code"), [("401", 1), ("not-json", 1), ("500", 1),
                                                 ("listing", 1), ("200", 0)])
def test_calm_score_keeps_each_form_out_of_every_channel(form, behaviour, code, tmp_path,
                                                         capsys, caplog):
    caplog.set_level(logging.DEBUG)
    data = str(write_jsonl(tmp_path / "mc.jsonl", RECORDS))
    with _server(FORMS[form](SECRET), behaviour) as url:
        rc = main(["-q", "score", url, "--data", data, "--part", "all", "--mode", "letter",
                   "--no-chat", "--api-key-env", "TEST_KEY", "--max-retries", "0", "--out",
                   str(tmp_path / "report.json")])
    printed = capsys.readouterr()
    assert rc == code, printed.err
    if code:
        lines = printed.err.strip().splitlines()
        assert len(lines) == 1, lines
        if behaviour == "listing":
            assert "holds the API key" in lines[0]
    else:
        assert json.loads((tmp_path / "report.json").read_text())["served_model"] == "tiny"
    for channel, text in _channels(tmp_path, printed, caplog).items():
        assert leaks(text) == [], (channel, text)


def test_a_key_in_pieces_over_consecutive_tokens_stays_out_of_the_cache(tmp_path, capsys):
    data = str(write_jsonl(tmp_path / "mc.jsonl", RECORDS))
    with _server("", "pieces") as url:
        rc = main(["-q", "score", url, "--data", data, "--part", "all", "--mode", "letter",
                   "--no-chat", "--api-key-env", "TEST_KEY", "--out",
                   str(tmp_path / "report.json")])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    assert [p["prediction"] for p in report["predictions"]] == [0, 0, 0]  # the letters stay
    cached = list((tmp_path / "cache").rglob("*.jsonl"))
    assert cached
    for path in cached:
        for line in path.read_text().splitlines():
            tokens = "".join(json.loads(line)["value"])  # the tokens, one after another
            assert leaks(tokens) == [], tokens


@pytest.mark.parametrize("form", ["hex", "mime", "zero-width-joined"])
def test_a_served_model_id_carrying_the_key_writes_no_adapter(form, tmp_path, capsys):
    data = str(write_jsonl(tmp_path / "mc.jsonl", RECORDS * 10))
    with _server(FORMS[form](SECRET), "listing") as url:
        rc = main(["-q", "fit", "ts", "--model", url, "--data", data, "--mode", "letter",
                   "--no-chat", "--api-key-env", "TEST_KEY", "--out", str(tmp_path / "ad")])
    printed = capsys.readouterr()
    lines = printed.err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "holds the API key" in lines[0], lines
    assert not (tmp_path / "ad").exists()
    assert leaks(printed.out + printed.err) == []


@pytest.mark.parametrize("key", ["A", "EMPTY", "sk-" + "x" * (MIN_KEY_LENGTH - 4)])
def test_a_key_too_short_to_keep_out_is_refused_before_any_request(key, tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.setenv("TEST_KEY", key)
    data = str(write_jsonl(tmp_path / "mc.jsonl", RECORDS))
    seen: list = []
    with _server("", "200", seen) as url:
        rc = main(["-q", "score", url, "--data", data, "--part", "all", "--mode", "letter",
                   "--api-key-env", "TEST_KEY", "--out", str(tmp_path / "report.json")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, lines
    assert "a key this short cannot be kept out of output" in lines[0]
    assert f"at least {MIN_KEY_LENGTH} characters" in lines[0] and "TEST_KEY" in lines[0]
    assert seen == [] and not (tmp_path / "report.json").exists()
    with pytest.raises(ConfigError, match="this short"):
        http_endpoint.Endpoint(url, "m", api_key_env="TEST_KEY").request("GET", "/models")


def test_a_key_of_the_shortest_length_scores_and_mangles_nothing(tmp_path, capsys,
                                                                 monkeypatch):
    key = "token-abc123"
    assert len(key) == MIN_KEY_LENGTH
    monkeypatch.setenv("TEST_KEY", key)
    data = str(write_jsonl(tmp_path / "mc.jsonl", RECORDS))
    with _server("", "200") as url:
        rc = main(["-q", "score", url, "--data", data, "--part", "all", "--mode", "letter",
                   "--no-chat", "--api-key-env", "TEST_KEY", "--out",
                   str(tmp_path / "report.json")])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "report.json").read_text())["served_model"] == "tiny"
