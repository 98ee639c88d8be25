"""Bad input is a one-line typed CalmError, and the engine keeps working afterwards."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("onnxruntime")

from calm_runtime import CalibratedLM  # noqa: E402
from calm_runtime.errors import ArtifactError, CalmError, ConfigError  # noqa: E402

PROMPT = "Question: What is the capital of France?\nAnswer:"


@pytest.fixture(scope="module")
def lm(runtime_engine):
    return CalibratedLM.load(runtime_engine[2], threads=1)


def _one_line(info, kind=CalmError) -> str:
    assert isinstance(info.value, kind), type(info.value)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


@pytest.mark.parametrize(("call", "kind", "match"), [
    (lambda lm: lm.generate(""), ConfigError, "prompt is empty"),
    (lambda lm: lm.generate([]), ConfigError, "no prompts"),
    (lambda lm: lm.generate(["ok", ""]), ConfigError, "prompt is empty"),
    (lambda lm: lm.generate("word " * 400), ConfigError, "context is 256"),
    (lambda lm: lm.generate("a" * 255), ConfigError, "fills the model's context"),
    (lambda lm: lm.generate(PROMPT, max_new_tokens=0), ConfigError, "max_new_tokens"),
    (lambda lm: lm.generate(PROMPT, temperature=-1), ConfigError, "temperature"),
    (lambda lm: lm.generate(PROMPT, temperature=1, top_p=0), ConfigError, "top_p"),
    (lambda lm: lm.generate(PROMPT, stop=[""]), ConfigError, "stop strings"),
    (lambda lm: lm.generate(PROMPT, top_alternatives=-1), ConfigError, "top_alternatives"),
    (lambda lm: lm.stream(PROMPT, temperature=-2), ConfigError, "temperature"),
    (lambda lm: lm.stream(PROMPT, beams=2), ConfigError, "unknown generation option"),
    (lambda lm: lm.stream([PROMPT]), ConfigError, "one prompt string"),
    (lambda lm: lm.choose("Pick one", ["only"]), ConfigError, "2 to 26 options"),
    (lambda lm: lm.choose("Pick one", []), ConfigError, "2 to 26 options"),
    (lambda lm: lm.choose("Pick one", "ab"), ConfigError, "list of strings"),
    (lambda lm: lm.choose("Pick one", ["a", " "]), ConfigError, "non-empty string"),
    (lambda lm: lm.choose("", ["a", "b"]), ConfigError, "non-empty string"),
    (lambda lm: lm.choose("q", ["a", "b"], mode="essay"), ConfigError, "unknown mode"),
    (lambda lm: lm.choose("q", ["a", "b"], variant="max"), ConfigError, "unknown cloze variant"),
    (lambda lm: lm.choose("q", list("ABCDEFGHIJK"), mode="letter", chat=False), ConfigError,
     "' K' is not a single token"),
    (lambda lm: lm.choose("word " * 400, ["a", "b"]), ConfigError, "context is 256"),
    (lambda lm: lm.choose_batch(["q"], [["a", "b"], ["c", "d"]]), ConfigError, "option lists"),
    (lambda lm: lm.p_true_batch(["q"], []), ConfigError, "one answer per question"),
    (lambda lm: lm.p_true("q", "a", template="no-such-template"), ConfigError,
     "unknown P(True) template"),
])
def test_bad_input_is_one_typed_line_and_the_engine_keeps_working(lm, call, kind, match):
    before = lm.generate(PROMPT, max_new_tokens=4)
    with pytest.raises(kind) as info:
        call(lm)
    assert match in _one_line(info, kind)
    after = lm.generate(PROMPT, max_new_tokens=4)
    assert after.token_ids == before.token_ids and after.text == before.text


@pytest.fixture
def engine_copy(runtime_engine, tmp_path):
    target = tmp_path / "engine"
    shutil.copytree(runtime_engine[2], target)
    return target


def test_missing_file(engine_copy):
    (engine_copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError) as info:
        CalibratedLM.load(engine_copy)
    assert "tokenizer.json is missing" in _one_line(info)


def test_wrong_hash(engine_copy):
    path = engine_copy / "genai_config.json"
    path.write_text(path.read_text() + "\n")  # still valid JSON, another sha256
    with pytest.raises(ArtifactError) as info:
        CalibratedLM.load(engine_copy)
    assert "genai_config.json does not match its sha256" in _one_line(info)


def test_truncated_model(engine_copy):
    path = engine_copy / "model.onnx"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ArtifactError) as info:
        CalibratedLM.load(engine_copy)
    assert "model.onnx does not match its sha256" in _one_line(info)
    # without hashing, the graph's external-data check (which reads the protobuf) or
    # onnxruntime's own load failure is still one typed line
    with pytest.raises(ArtifactError) as info:
        CalibratedLM.load(engine_copy, verify_hashes=False)
    message = _one_line(info)
    assert "model.onnx is not a readable ONNX graph" in message \
        or "onnxruntime cannot load" in message


def test_not_an_engine(tmp_path):
    with pytest.raises(ArtifactError) as info:
        CalibratedLM.load(tmp_path / "nowhere")
    assert "does not exist" in _one_line(info)
    with pytest.raises(ArtifactError) as info:
        CalibratedLM.load(tmp_path)
    assert "calm_engine.json is missing" in _one_line(info)


def test_bad_backend_arguments(runtime_engine):
    with pytest.raises(ConfigError) as info:
        CalibratedLM.load(runtime_engine[2], threads=0)
    assert "threads" in _one_line(info)
    with pytest.raises(ConfigError) as info:
        CalibratedLM.load(runtime_engine[2], providers=[])
    assert "providers is empty" in _one_line(info)


def test_a_10mb_text_is_refused_before_tokenising(runtime_lm):
    """Text that cannot fit the context by its length is refused before the tokenizer sees it,
    naming the input: choose (cloze and letter), generate, P(True), prompt scoring."""
    huge = "water " * 1_750_000
    with pytest.raises(ConfigError, match=r"question 2 of 2 with its longest option is "
                       r"10,500,003 characters, more than the model's \d+-token context"):
        runtime_lm.choose_batch(["ok?", huge], [["yes", "no"], ["yes", "no"]])
    for call in (lambda: runtime_lm.choose(huge, ["a", "b"], mode="letter", chat=False),
                 lambda: runtime_lm.generate(huge, max_new_tokens=1),
                 lambda: runtime_lm.p_true(huge, "4"),
                 lambda: runtime_lm.prompt_logprobs(huge)):
        with pytest.raises(ConfigError, match="characters, more than the model's"):
            call()
    assert runtime_lm.choose("ok?", ["yes", "no"]).probabilities.sum() == pytest.approx(1)


def test_calm_score_on_a_10mb_record_stops_in_one_line_with_bounded_memory(runtime_engine,
                                                                          tmp_path):
    """`calm score ENGINE` on 40 good records and one ~10 MB question: one line naming the
    question, peak RSS under 2 GB (it reached 2.5 GB when the runtime tokenised it first)."""
    import json
    import os
    import subprocess
    import sys

    rss = ("import json, resource, subprocess, sys\n"
           "proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
           "print(json.dumps({'code': proc.returncode, 'stderr': proc.stderr,\n"
           "    'max_rss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n")
    records = [{"question": f"Question {i}?", "choices": ["fire", "dog"], "answer": i % 2}
               for i in range(40)]
    records.append({"question": "water " * 1_750_000, "choices": ["fire", "dog"], "answer": 0,
                    "id": "huge"})
    data = tmp_path / "with-huge.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    command = [sys.executable, "-m", "calm_runtime.cli.main", "-q", "score", str(runtime_engine[2]),
               "--data", str(data), "--part", "all", "--out", str(tmp_path / "score.json")]
    env = dict(os.environ, CALM_CACHE=str(tmp_path / "cache"))
    result = json.loads(subprocess.run([sys.executable, "-c", rss, *command], env=env,
                                       capture_output=True, text=True, check=True,
                                       timeout=600).stdout)
    # the test engine's own warning (no recorded cloze variant) aside, one line
    lines = [line for line in result["stderr"].strip().splitlines()
             if not line.startswith("WARNING ")]
    assert result["code"] == 1 and len(lines) == 1, result["stderr"][-2000:]
    assert lines[0].startswith("ConfigError: question 41 of 41") and "characters" in lines[0]
    assert result["max_rss_kb"] < 2 * 1024 * 1024, f"peak RSS {result['max_rss_kb']} kB"
    assert not (tmp_path / "score.json").exists()
