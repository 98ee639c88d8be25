"""lm-evaluation-harness sample logs mutated field by field (wrong type, wrong shape,
out-of-range number, missing key, extra key): ``calm fit daca --model-scores lm-eval:PATH``
exits 1 with exactly one line on stderr naming the line and doc id, no traceback, nothing
written. Also the named caps on options per document and on the scores table (checked before
anything is allocated), and a fit the data degenerates refused at the fit, in the data's
terms."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

pytest.importorskip("torch")

from calm_runtime.cli.main import main  # noqa: E402
from calm_runtime.errors import DataError  # noqa: E402
from calm_training.scoring import lm_eval_logs  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")
N_DOCS, K = 40, 4
BAD_LINE = 3  # the document every mutation changes (line 4 of the file)


def _doc(i: int, values, target: int) -> dict:
    """One line as ``lm_eval --log_samples`` writes it for a multiple_choice task."""
    context = f"Question: which is number {i}?\nAnswer:"
    return {"doc_id": i, "doc": {"question": f"which is number {i}?"},
            "target": str(target),
            "arguments": {f"gen_args_{k}": {"arg_0": context, "arg_1": f" option {k}"}
                          for k in range(len(values))},
            "resps": [[[repr(float(v)), "False"]] for v in values],
            "filtered_resps": [[repr(float(v)), "False"] for v in values],
            "filter": "none", "metrics": ["acc"], "doc_hash": f"h{i}", "acc": 1.0}


def _docs(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [_doc(i, -rng.uniform(0.2, 6.0, K), i % K) for i in range(N_DOCS)]


def _write(path, lines) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines))
    return str(path)


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def mutate(doc):
        target = doc
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return mutate


def _drop(*keys):
    def mutate(doc):
        target = doc
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
    return mutate


ONE = {"arg_0": "Question: which is number 3?\nAnswer:", "arg_1": " option 1"}
#: field -> mutation of one document; every one must be refused in one line
MUTATIONS = {
    # arguments: keys, values, shape
    "arguments key of 5,000 digits": _set("arguments", "gen_args_" + "9" * 5000, dict(ONE)),
    "arguments key a superscript digit": _set("arguments", "gen_args_\u00b2", dict(ONE)),
    "arguments key out of range": _set("arguments", "gen_args_99999", dict(ONE)),
    "arguments key not gen_args": _set("arguments", "extra", dict(ONE)),
    "argument value an int": _set("arguments", "gen_args_1", 5),
    "argument value null": _set("arguments", "gen_args_1", None),
    "argument value a list": _set("arguments", "gen_args_1", ["a", "b"]),
    "argument continuation an int": _set("arguments", "gen_args_1", "arg_1", 7),
    "argument extra key": _set("arguments", "gen_args_1", "arg_2", "x"),
    "argument odd key": _set("arguments", "gen_args_1", "arg_x", "x"),
    "argument missing continuation": _drop("arguments", "gen_args_1", "arg_1"),
    "arguments missing": _drop("arguments"),
    "arguments a string": _set("arguments", "text"),
    "arguments empty": _set("arguments", {}),
    # responses: structure and number ranges
    "response a huge integer": _set("filtered_resps", 1, ["__HUGE__", "False"]),
    "response an integer of 5,000 digits": _set("filtered_resps", 1, ["__HUGER__", "False"]),
    "response null": _set("filtered_resps", 1, [None, "False"]),
    "response a dict": _set("filtered_resps", 1, {"ll": -1.0}),
    "response positive": _set("filtered_resps", 1, ["3.5", "False"]),
    "response infinite": _set("filtered_resps", 1, ["-inf", "False"]),
    "response 1e999": _set("filtered_resps", 1, ["-1e999", "False"]),
    "response fullwidth digits": _set("filtered_resps", 1, ["-\uff11.5", "False"]),
    "response extra entry": _set("filtered_resps", 1, ["-1.0", "False", "extra"]),
    "response empty": _set("filtered_resps", 1, []),
    "response is_greedy a number": _set("filtered_resps", 1, ["-1.0", 7]),
    "responses one short": lambda doc: doc["filtered_resps"].pop(),
    "responses one extra": lambda doc: doc["filtered_resps"].append(["-1.0", "False"]),
    "responses missing": _drop("filtered_resps"),
    "responses a string": _set("filtered_resps", "-1.0"),
    # the rest of a document
    "target out of range": _set("target", "4"),
    "target of 5,000 digits": _set("target", "9" * 5000),
    "target a superscript digit": _set("target", "\u00b2"),
    "target a list": _set("target", [0]),
    "target missing": _drop("target"),
    "doc_id a string": _set("doc_id", "three"),
    "doc_id negative": _set("doc_id", -1),
    "doc_id missing": _drop("doc_id"),
    "doc_hash a number": _set("doc_hash", 17),
}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval-hardening")
    return {"root": root, "model": _docs(0),
            "reference": _write(root / "samples_reference.jsonl", _docs(1))}


def _fit(models, model_log, reference_log, out) -> int:
    tied, untied = models
    return main(["-q", "fit", "daca", "--model", str(tied), "--reference", str(untied),
                 "--model-scores", f"lm-eval:{model_log}", "--reference-scores",
                 f"lm-eval:{reference_log}", "--variant", "sum", "--out", str(out)])


@pytest.fixture(scope="module")
def models(tiny_llama_tied, tiny_llama_untied):
    return tiny_llama_tied, tiny_llama_untied


def _one_line(capsys, *needles: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1, captured.err
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


def test_the_valid_log_fits(logs, models, tmp_path, capsys):
    model = _write(tmp_path / "samples_model.jsonl", logs["model"])
    assert _fit(models, model, logs["reference"], tmp_path / "out") == 0, capsys.readouterr()
    assert (tmp_path / "out").is_dir()


@pytest.mark.parametrize("field", sorted(MUTATIONS))
def test_a_mutated_field_is_one_line_and_nothing_is_written(logs, models, tmp_path, capsys,
                                                            field):
    docs = copy.deepcopy(logs["model"])
    MUTATIONS[field](docs[BAD_LINE])
    text = json.dumps(docs[BAD_LINE]).replace('"__HUGE__"', "-" + "9" * 400)
    text = text.replace('"__HUGER__"', "-" + "9" * 5000)
    model = _write(tmp_path / "samples_model.jsonl", [*docs[:BAD_LINE], text,
                                                      *docs[BAD_LINE + 1:]])
    assert _fit(models, model, logs["reference"], tmp_path / "out") == 1
    line = _one_line(capsys, "DataError: ", f"line {BAD_LINE + 1}")
    assert "doc_id" in line
    assert not (tmp_path / "out").exists()


def test_options_per_document_are_capped_before_anything_is_allocated(tmp_path):
    many = lm_eval_logs.MAX_OPTIONS + 1
    wide = {"doc_id": 1, "target": "0", "arguments": [["Q", f" o{k}"] for k in range(many)],
            "filtered_resps": [-1.0] * many}
    path = _write(tmp_path / "wide.jsonl", [_doc(0, [-1.0, -2.0], 0), wide])
    with pytest.raises(DataError, match=f"{many:,} options, more than the") as info:
        lm_eval_logs.read_samples(path)
    assert "line 2 (doc_id 1)" in str(info.value)


def test_the_scores_table_is_capped_before_it_is_allocated(tmp_path, monkeypatch):
    # 150 documents of 2 options and one of 100: the table would be 151 x 100
    docs = [_doc(i, [-1.0, -2.0], 0) for i in range(150)]
    docs.append(_doc(150, [-1.0] * 100, 0))
    path = _write(tmp_path / "ragged.jsonl", docs)
    monkeypatch.setattr(lm_eval_logs, "MAX_SCORE_CELLS", 151 * 100 - 1)
    allocated = []
    monkeypatch.setattr(lm_eval_logs.np, "full", lambda *a, **k: allocated.append(a))
    with pytest.raises(DataError, match="make a table of 15,100 scores, more than"):
        lm_eval_logs.read_samples(path)
    assert allocated == []


@pytest.mark.parametrize("case, needles", [
    ("tiny spread", ("answer temperature at", "outside the [0.0001, 10000]",
                     "differ by a median of 6.1e-294", "filtered_resps")),
    ("no spread", ("the same for every option", "filtered_resps"))])
def test_a_fit_the_data_degenerates_is_refused_at_the_fit(models, tmp_path, capsys, case,
                                                          needles):
    values = [0.0, -6.1e-294, -6.1e-294, -6.1e-294] if case == "tiny spread" else [-1.0] * K
    path = _write(tmp_path / "samples.jsonl", [_doc(i, values, 0) for i in range(N_DOCS)])
    assert _fit(models, path, path, tmp_path / "out") == 1
    line = _one_line(capsys, "FitError: ", *needles)
    assert "re-fit" not in line
    assert not (tmp_path / "out").exists()
