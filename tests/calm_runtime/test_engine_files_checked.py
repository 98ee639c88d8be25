"""Issue 38, item 4: the files an engine's hashes cannot vouch for are checked at load.

* ``genai_config.json`` (onnxruntime-genai runs the folder by it) must be a JSON object whose
  KV heads, head size, layers, vocabulary and context agree with the manifest's model
  section (context at most the model's), with no negative or absurd numbers;
* ``model.onnx`` must read its external data from exactly the data files the manifest lists
  and hashes: a graph naming an unlisted file inside the folder is refused (read from the
  graph's protobuf, without the ``onnx`` package and without loading the data).

The tampered files are re-hashed into the manifest, as an attacker (or a careless edit)
would, so that the content reaches the checks. The synthetic engine needs neither torch
nor onnx; the last tests tamper with a real exported engine.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import synthetic_engine_manifest, synthetic_genai_config, synthetic_onnx_graph

from calm_runtime.errors import ArtifactError
from calm_runtime.files import sha256_file
from calm_runtime.formats._engine_files import onnx_external_locations
from calm_runtime.formats.engine import ENGINE_MANIFEST_NAME, EngineManifest

# ---------------------------------------------------------------------- a synthetic engine


def _tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "A": 4, "B": 5, "hello": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))


@pytest.fixture
def engine(tmp_path: Path) -> Path:
    """A synthetic engine whose graph reads ``model.onnx.data`` (listed and hashed)."""
    root = tmp_path / "engine"
    root.mkdir()
    (root / "model.onnx").write_bytes(synthetic_onnx_graph("model.onnx.data"))
    (root / "model.onnx.data").write_bytes(b"\0" * 16)
    _tokenizer_json(root / "tokenizer.json")
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (root / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (root / "genai_config.json").write_text(synthetic_genai_config())
    manifest = synthetic_engine_manifest(root, model_files=("model.onnx", "model.onnx.data"))
    (root / ENGINE_MANIFEST_NAME).write_text(json.dumps(manifest))
    return root


def _rehash(root: Path) -> None:
    """Record the files' current sha256 in the manifest (the hashes then vouch for them)."""
    manifest = json.loads((root / ENGINE_MANIFEST_NAME).read_text())
    files = manifest["model"]["files"]
    for name in files:
        files[name] = sha256_file(root / name)
    manifest["export"]["genai_config"]["sha256"] = sha256_file(root / "genai_config.json")
    (root / ENGINE_MANIFEST_NAME).write_text(json.dumps(manifest))


def _refused(root: Path, *, verify_hashes: bool = True) -> str:
    with pytest.raises(ArtifactError) as info:
        EngineManifest.load(root, verify_hashes=verify_hashes)
    assert type(info.value) is ArtifactError
    message = str(info.value)
    assert message and "\n" not in message and "\r" not in message, message
    return message


def _edit_genai(root: Path, edit) -> None:
    config = json.loads((root / "genai_config.json").read_text())
    edit(config)
    (root / "genai_config.json").write_text(json.dumps(config))
    _rehash(root)


def test_the_synthetic_engine_loads(engine):
    manifest = EngineManifest.load(engine)
    assert manifest.model["num_kv_heads"] == 1
    EngineManifest.load(engine, verify_hashes=False)


# ---------------------------------------------------------------------- genai_config.json
def _set(*path_and_value):
    *path, value = path_and_value

    def edit(config):
        section = config
        for key in path[:-1]:
            section = section[key]
        section[path[-1]] = value
    return edit


GENAI_TAMPERING = {
    # the four: kv heads 3, a context of 2**62, a negative value, not JSON
    "kv_heads_3": (_set("model", "decoder", "num_key_value_heads", 3),
                   r"model\.decoder\.num_key_value_heads is 3, but calm_engine\.json states "
                   r"num_kv_heads 1; the engine's files disagree"),
    "context_2_62": (_set("model", "context_length", 2 ** 62),
                     r"model\.context_length must be an integer in \[1, 16,777,216\], got "
                     r"4611686018427387904"),
    "negative_head_size": (_set("model", "decoder", "head_size", -4),
                           r"model\.decoder\.head_size must be an integer in \[1, .*got -4"),
    "negative_pad": (_set("model", "pad_token_id", -7),
                     r"model\.pad_token_id must be a token id in \[0, 300\), got -7"),
    "negative_max_length": (_set("search", "max_length", -1),
                            r"search\.max_length must be an integer in \[1, .*got -1"),
    # and the rest of what the file states about the graph
    "context_above_the_model": (_set("model", "context_length", 65),
                                r"model\.context_length 65 is longer than the model's "
                                r"max_position_embeddings 64"),
    "layers": (_set("model", "decoder", "num_hidden_layers", 2),
               r"model\.decoder\.num_hidden_layers is 2, but .* num_layers 1"),
    "head_size": (_set("model", "decoder", "head_size", 8),
                  r"model\.decoder\.head_size is 8, but .* head_dim 4"),
    "vocabulary": (_set("model", "vocab_size", 301),
                   r"model\.vocab_size is 301, but .* vocab_size 300"),
    "query_heads": (_set("model", "decoder", "num_attention_heads", 4),
                    r"num_attention_heads is 4, but .* num_attention_heads 2"),
    "hidden_size": (_set("model", "decoder", "hidden_size", 16),
                    r"hidden_size is 16, but .* hidden_size 8"),
    "kv_heads_a_string": (_set("model", "decoder", "num_key_value_heads", "1"),
                          r"num_key_value_heads must be an integer .* got '1'"),
    "kv_heads_true": (_set("model", "decoder", "num_key_value_heads", True),
                      r"num_key_value_heads must be an integer .* got True"),
    "another_graph": (_set("model", "decoder", "filename", "other.onnx"),
                      r"model\.decoder\.filename 'other\.onnx' is not the engine's graph"),
    "eos_out_of_vocabulary": (_set("model", "eos_token_id", [2, 300]),
                              r"model\.eos_token_id must be a token id in \[0, 300\)"),
    "max_length_above_context": (_set("search", "max_length", 65),
                                 r"search\.max_length 65 is longer than model\.context_length"),
    "negative_top_k": (_set("search", "top_k", -1), r"search\.top_k must be an integer"),
    "top_p_above_one": (_set("search", "top_p", 1.5), r"search\.top_p must be a number in"),
    "no_decoder": (lambda c: c["model"].pop("decoder"), r"lacks model\.decoder"),
    "model_not_an_object": (_set("model", []), r"model must be an object"),
    "window_layer_out_of_range": (
        _set("model", "decoder", "sliding_window", {"window_size": 8, "layers": [0, 5]}),
        r"sliding_window\.layers must list layer indices in \[0, 1\)"),
}


@pytest.mark.parametrize("case", sorted(GENAI_TAMPERING))
def test_a_tampered_genai_config_is_refused_at_load(engine, case):
    edit, match = GENAI_TAMPERING[case]
    _edit_genai(engine, edit)
    for verify_hashes in (True, False):
        message = _refused(engine, verify_hashes=verify_hashes)
        assert message.startswith(str(engine / "genai_config.json")), message
        assert re.search(match, message), (match, message)
        assert "re-export the engine" in message


@pytest.mark.parametrize(("text", "match"), [
    ("{not json", r"genai_config\.json is not valid JSON"),
    ("[1, 2]", r"genai_config\.json must hold a JSON object, got list"),
    ('{"model": {"context_length": NaN}}', r"genai_config\.json is not valid JSON"),
    ("", r"genai_config\.json is not valid JSON"),
])
def test_a_genai_config_that_is_not_a_json_object_is_refused(engine, text, match):
    (engine / "genai_config.json").write_text(text)
    _rehash(engine)
    message = _refused(engine)
    assert re.search(match, message) and "re-export the engine" in message, message


def test_a_genai_config_that_states_the_engine_loads(engine):
    # a shorter context than the model's and a pad id of -1 ("none", as the builder copies
    # it) are fine; so are keys calm does not know
    _edit_genai(engine, lambda c: (c["model"].update(context_length=32, pad_token_id=-1,
                                                     future_key={"x": 1}),
                                   c["search"].update(max_length=32)))
    EngineManifest.load(engine)


# ---------------------------------------------------------------------- external data
def _graph(root: Path, *locations: str) -> None:
    (root / "model.onnx").write_bytes(synthetic_onnx_graph(*locations))
    _rehash(root)


def test_a_graph_reading_an_unlisted_file_in_the_folder_is_refused(engine):
    (engine / "weights.bin").write_bytes((engine / "model.onnx.data").read_bytes())
    _graph(engine, "weights.bin")
    message = _refused(engine)
    assert re.search(r"model\.onnx reads external data from weights\.bin, which "
                     r"calm_engine\.json does not list in model\.files", message), message
    assert "re-export the engine" in message
    assert _refused(engine, verify_hashes=False) == message


def test_a_graph_reading_a_listed_and_an_unlisted_file_is_refused(engine):
    (engine / "extra.bin").write_bytes(b"\0" * 16)
    _graph(engine, "model.onnx.data", "extra.bin")
    assert "reads external data from extra.bin" in _refused(engine)


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/hostname", "calm_engine.json",
                                      "tokenizer.json", "model.onnx", "./model.onnx.data"])
def test_a_graph_reading_any_other_file_is_refused(engine, location):
    _graph(engine, location)
    assert "reads external data from" in _refused(engine)


def test_a_listed_data_file_the_graph_does_not_read_is_refused(engine):
    _graph(engine)  # no external data at all, yet the manifest lists model.onnx.data
    message = _refused(engine)
    assert "lists model.onnx.data in model.files, but" in message
    assert "reads no external data from it" in message


@pytest.mark.parametrize("graph", [b"graph" * 10, synthetic_onnx_graph("model.onnx.data")[:-3],
                                   b"\x3a\xff\xff\xff\xff\x0f"])
def test_a_graph_that_is_not_a_protobuf_is_refused(engine, graph):
    (engine / "model.onnx").write_bytes(graph)
    _rehash(engine)
    assert "model.onnx is not a readable ONNX graph (protobuf:" in _refused(engine)


def test_an_external_tensor_naming_no_file_is_refused(engine):
    graph = synthetic_onnx_graph("model.onnx.data").replace(b"location", b"lOcation")
    (engine / "model.onnx").write_bytes(graph)
    _rehash(engine)
    assert "a tensor stored as external data names no location" in _refused(engine)


def test_the_protobuf_walk_finds_every_tensor_onnx_knows():
    """Initializers, Constant attributes, sparse initializers and tensors in subgraphs: the
    walk's locations are exactly those of onnx's own external-data helper."""
    pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import _get_all_tensors, set_external_data

    def tensor(name, location):
        t = numpy_helper.from_array(np.ones(2, np.float32), name)
        set_external_data(t, location)
        t.ClearField("raw_data")
        return t

    then = helper.make_graph([helper.make_node("Identity", ["inner"], ["y"])], "then", [],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                             initializer=[tensor("inner", "in-subgraph.bin")])
    constant = helper.make_node("Constant", [], ["c"], value=tensor("c", "in-constant.bin"))
    branch = helper.make_node("If", ["cond"], ["out"], then_branch=then, else_branch=then)
    sparse = helper.make_sparse_tensor(tensor("sv", "sparse-values.bin"),
                                       numpy_helper.from_array(np.array([0], np.int64), "si"),
                                       [2])
    graph = helper.make_graph(
        [constant, branch], "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])],
        initializer=[tensor("w", "model.onnx.data"), tensor("v", "model.onnx.data")],
        sparse_initializer=[sparse])
    model = helper.make_model(graph)
    expected = {entry.value for t in _get_all_tensors(model) for entry in t.external_data
                if entry.key == "location"}
    expected |= {"sparse-values.bin"}  # onnx's helper skips sparse tensors; ORT does not
    assert onnx_external_locations(model.SerializeToString()) == expected == {
        "model.onnx.data", "in-constant.bin", "in-subgraph.bin", "sparse-values.bin"}
    assert onnx_external_locations(b"") == set()


# ---------------------------------------------------------------------- a real engine
@pytest.fixture
def engine_copy(runtime_engine, tmp_path):
    pytest.importorskip("onnxruntime")
    target = tmp_path / "engine"
    shutil.copytree(runtime_engine[2], target)
    return target


def test_a_real_engine_with_a_tampered_genai_config_is_not_served(engine_copy):
    from calm_runtime import CalibratedLM

    config = json.loads((engine_copy / "genai_config.json").read_text())
    config["model"]["decoder"]["num_key_value_heads"] = 3
    (engine_copy / "genai_config.json").write_text(json.dumps(config))
    _rehash(engine_copy)
    with pytest.raises(ArtifactError) as info:
        CalibratedLM.load(engine_copy, threads=1)
    assert "model.decoder.num_key_value_heads is 3, but calm_engine.json states num_kv_heads 2" \
        in str(info.value)


def test_a_real_engine_whose_graph_reads_an_unlisted_file_is_not_served(engine_copy):
    onnx = pytest.importorskip("onnx")
    from calm_runtime import CalibratedLM

    shutil.copyfile(engine_copy / "model.onnx.data", engine_copy / "weights.bin")
    model = onnx.load(str(engine_copy / "model.onnx"), load_external_data=False)
    moved = 0
    for initializer in model.graph.initializer:
        for entry in initializer.external_data:
            if entry.key == "location":
                entry.value, moved = "weights.bin", moved + 1
    assert moved
    onnx.save_model(model, str(engine_copy / "model.onnx"))
    _rehash(engine_copy)  # model.onnx.data stays listed and hashed; weights.bin is not
    with pytest.raises(ArtifactError) as info:
        CalibratedLM.load(engine_copy, threads=1)
    assert "model.onnx reads external data from weights.bin, which calm_engine.json does not " \
           "list in model.files" in str(info.value)


def test_the_real_engine_loads(runtime_engine):
    manifest = EngineManifest.load(runtime_engine[2])
    assert set(manifest.model["files"]) == {"model.onnx", "model.onnx.data"}
