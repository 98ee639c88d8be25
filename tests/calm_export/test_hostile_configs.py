"""Issue 38, item 3: ``calm-export`` checks a model's ``config.json`` before any weight loads.

The four hostile configs of the probe (``vocab_size`` 2**31: an 8 GiB numpy allocation;
``num_hidden_layers`` 0: an IndexError after the export ran; ``rope_scaling: "junk"``:
transformers' StrictDataclassFieldValidationError; ``num_key_value_heads`` 3 with 4 query
heads: a RuntimeError) each give one ``ModelSourceError`` line on stderr and exit 1, with
no traceback and nothing written; the check is transformers' own config validation plus
calm's bounds (calm_runtime.data.models.check_model_config), and real families' configs pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from calm_export import pipeline  # noqa: E402
from calm_export.cli import main  # noqa: E402
from calm_runtime.data.models import check_model_config, load_model_and_tokenizer  # noqa: E402
from calm_runtime.errors import ModelSourceError  # noqa: E402
from calm_runtime.formats import model_config

#: the probe's four configs: (the change to config.json, what the one line must say)
HOSTILE = {
    "vocab_2_31": ({"vocab_size": 2 ** 31},
                   "vocab_size 2147483648 is beyond any real model (at most 2,097,152); "
                   "fix vocab_size"),
    "no_layers": ({"num_hidden_layers": 0},
                  "num_hidden_layers 0 must be at least 1; fix num_hidden_layers"),
    "rope_junk": ({"rope_scaling": "junk"},
                  "rope_scaling 'junk' is refused by transformers (Field 'rope_parameters' "
                  "with value 'junk' doesn't match any type; expected an object such as"),
    "kv_heads_3": ({"num_key_value_heads": 3},
                   "num_key_value_heads 3 does not divide num_attention_heads 4 (each key/value "
                   "head serves a whole group of query heads); set num_key_value_heads to one "
                   "of [1, 2, 4]"),
}


def _model(tmp_path: Path, source: Path, change: dict, name: str = "model") -> Path:
    """A copy of the tiny model with ``change`` applied to its config.json."""
    folder = tmp_path / name
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _refusal(folder: Path) -> str:
    with pytest.raises(ModelSourceError) as info:
        check_model_config(folder)
    message = str(info.value)
    assert message.startswith(f"{folder / 'config.json'}: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_config_is_one_line_and_exit_1(tmp_path, tiny_llama_untied, capfd,
                                                 monkeypatch, case):
    change, expected = HOSTILE[case]
    folder = _model(tmp_path, tiny_llama_untied, change)

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before config.json was checked")
    monkeypatch.setattr(pipeline, "load_model_and_tokenizer", refuse)
    out = tmp_path / "engine"
    assert main(["--model", str(folder), "--out", str(out), "--quiet"]) == 1
    captured = capfd.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"ModelSourceError: {folder / 'config.json'}: "), lines[0]
    assert expected in lines[0], lines[0]
    assert lines[0].endswith("or use the model's original config.json")
    assert captured.out == ""
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".engine")]


def test_the_calm_export_command_gives_the_same_line(tmp_path, tiny_llama_untied):
    folder = _model(tmp_path, tiny_llama_untied, {"vocab_size": 2 ** 31})
    out = tmp_path / "engine"
    command = [sys.executable, "-c", "import sys; from calm_export.cli import main; "
               "sys.exit(main())", "--model", str(folder), "--out", str(out), "--quiet"]
    env = {**os.environ, "CALM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"ModelSourceError: {folder / 'config.json'}: {HOSTILE['vocab_2_31'][1]}, or use the "
        "model's original config.json"]
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".engine")]


@pytest.mark.parametrize(("change", "expected"), [
    ({"hidden_size": -64}, "hidden_size -64 must be at least 1"),
    ({"hidden_size": 1 << 17}, "hidden_size 131072 is beyond any real model (at most 65,536)"),
    ({"intermediate_size": 10 ** 9}, "intermediate_size 1000000000 is beyond any real model"),
    ({"max_position_embeddings": 2 ** 62}, "max_position_embeddings 4611686018427387904 is "
                                           "beyond any real model (at most 16,777,216)"),
    ({"num_attention_heads": 2048, "num_key_value_heads": 2048, "hidden_size": 4096},
     "num_attention_heads 2048 is beyond any real model (at most 1,024)"),
    ({"head_dim": 0}, "head_dim 0 must be at least 1"),
    ({"num_key_value_heads": 8}, "num_key_value_heads 8 does not divide num_attention_heads 4"),
    ({"hidden_size": "64"}, "hidden_size '64' is refused by transformers"),
    ({"num_hidden_layers": None}, "num_hidden_layers None is refused by transformers"),
    ({"num_attention_heads": 5}, "LlamaConfig refuses it (The hidden size (64) is not a "
                                 "multiple of the number of attention heads (5).)"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
     "rope_parameters {'rope_type': 'yarn', 'rope_theta': 10000.0} is refused by transformers "
     "(Missing required keys"),
    ({"rope_parameters": {"rope_type": "linear", "factor": -2, "rope_theta": 1e4}},
     "is refused by transformers' rotary validation (`rope_parameters`'s factor field must be"),
    ({"rope_parameters": {"rope_type": "no-such-type", "rope_theta": 1e4}},
     "rotary validation (Missing validation function"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "x"}},
     "rope_theta 'x' in the rotary settings must be a positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 2.0}},
     "partial_rotary_factor 2.0 in the rotary settings must be a positive number up to 1"),
    ({"model_type": "no_such_family"}, "model_type 'no_such_family' is not a family this "
                                       "transformers knows"),
    ({"model_type": "evil", "auto_map": {"AutoConfig": "evil.Config"}},
     "auto_map {'AutoConfig': 'evil.Config'} asks for the model's own Python code, which calm "
     "never runs"),
    ({"model_type": "gpt_neox", "hidden_size": 66, "head_dim": None},
     "GPTNeoXConfig refuses it (The hidden size is not divisible"),
])
def test_every_config_problem_names_the_field_and_value(tmp_path, tiny_llama_untied, change,
                                                        expected):
    assert expected in _refusal(_model(tmp_path, tiny_llama_untied, change))


@pytest.mark.parametrize(("text", "expected"), [
    ("{not json", "is not valid JSON (Expecting property name enclosed in double quotes)"),
    ("[1]", "must hold a JSON object, got list"),
    ("[" * 100_000, "is not valid JSON"),
])
def test_a_config_that_is_not_a_json_object(tmp_path, tiny_llama_untied, text, expected):
    folder = _model(tmp_path, tiny_llama_untied, {})
    (folder / "config.json").write_text(text)
    with pytest.raises(ModelSourceError) as info:
        check_model_config(folder)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_the_families_and_real_rotary_settings_pass(tmp_path):
    """No false refusals: every family of the conformance matrix, and the rotary settings of
    released models (Llama-3.1's llama3, Qwen2.5's yarn, Phi-3's longrope whose advisory
    warning about original_max_position_embeddings is not a failure)."""
    import transformers
    from conftest import FAMILIES

    for family in FAMILIES:
        folder = tmp_path / family.model_type
        getattr(transformers, family.config_class)(**family.tiny_config()).save_pretrained(folder)
        check_model_config(folder)
    released = {
        "llama": {"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192,
                                   "rope_type": "llama3"},
                  "rope_theta": 500000.0, "max_position_embeddings": 131072},
        "qwen2": {"rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768,
                                   "type": "yarn"}, "max_position_embeddings": 32768},
        "phi3": {"rope_scaling": {"long_factor": [1.0] * 8, "short_factor": [1.0] * 8,
                                  "type": "longrope"},
                 "original_max_position_embeddings": 4096, "max_position_embeddings": 131072},
    }
    for model_type, settings in released.items():
        folder = tmp_path / f"released-{model_type}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(
            {"model_type": model_type, "vocab_size": 300, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, **settings}))
        check_model_config(folder)


def test_weights_that_do_not_fit_the_config_are_one_line(tmp_path, tiny_llama_untied):
    # a config that is valid by itself (2 key/value heads -> 1) but not for these weights:
    # transformers' RuntimeError about mismatched sizes becomes a ModelSourceError
    folder = _model(tmp_path, tiny_llama_untied, {"num_key_value_heads": 1})
    check_model_config(folder)
    with pytest.raises(ModelSourceError) as info:
        load_model_and_tokenizer(folder)
    assert "do not have the sizes its config.json states" in str(info.value)


def test_the_bounds_fit_inside_the_engine_manifests_own_limit():
    from calm_runtime.formats.engine import MODEL_NUMBER_LIMIT

    for name in ("VOCAB_SIZE", "HIDDEN_SIZE", "INTERMEDIATE_SIZE", "LAYERS", "HEADS",
                 "HEAD_DIM", "CONTEXT"):
        assert 1 < getattr(model_config, f"MAX_CONFIG_{name}") <= MODEL_NUMBER_LIMIT
