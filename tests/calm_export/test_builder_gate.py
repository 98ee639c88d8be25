"""onnxruntime-genai's model builder behind a version gate (issue 40, item 4).

calm drives the builder through its internal Python API (``parse_extra_options`` with
0.15+'s signature, ``hf_details``, ``windowed_kv_cache``), so only the tested releases are
used: pyproject.toml pins the range the gate checks; under ``--graph builder`` another
release is a one-line error naming it and the range, under ``--graph auto`` the recorded
reason why calm's own graph was taken. The builder graph's manifest names the release
(``export.graph.builder_version``). ``_flatten_rope`` is applied only where the installed
builder still reads flat rotary settings; the tests below pin why it does.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("onnxruntime_genai")
transformers = pytest.importorskip("transformers")

from calm_export import graphs  # noqa: E402
from calm_export.config import ExportConfig  # noqa: E402
from calm_export.graphs import genai_build, genai_builder  # noqa: E402

OLD = "0.8.0"  # the release pyproject.toml used to allow, below the tested range
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _llama_config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, architectures=["LlamaForCausalLM"])


def _gemma3_config():
    """transformers 5's Gemma-3 text config: rotary settings nested per layer type, no
    ``rope_local_base_freq``."""
    return transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        architectures=["Gemma3ForCausalLM"])


# ------------------------------------------------------------------------- the range
def test_the_installed_builder_is_in_the_tested_range():
    assert genai_build.version_problem() is None, genai_build.installed_version()
    import onnxruntime_genai

    assert genai_build.installed_version() == onnxruntime_genai.__version__


def test_pyproject_pins_the_range_the_gate_checks():
    """The ``genai`` extra and the gate agree: what pip installs is what calm drives."""
    extra = re.search(r'^genai = \["([^"]+)"\]', PYPROJECT.read_text(), re.MULTILINE)
    assert extra is not None
    assert extra[1] == f"onnxruntime-genai{genai_build.builder_range()}" \
        == "onnxruntime-genai>=0.18,<0.19"


@pytest.mark.parametrize(("version", "inside"), [
    ("0.18.0", True), ("0.18.3", True), ("0.18.0.dev20260101", True), ("0.17.9", False),
    ("0.19.0", False), ("0.19.0rc1", False), ("1.0.0", False), (OLD, False),
    ("nightly", False)])
def test_the_gate(version, inside):
    problem = genai_build.version_problem(version)
    if inside:
        assert problem is None
    else:
        assert problem == (f"onnxruntime-genai {version} is installed, but calm drives its "
                           "model builder only within the tested range >=0.18,<0.19 (pip "
                           "install 'onnxruntime-genai>=0.18,<0.19')")


# ------------------------------------------------------------------------- --graph auto
def test_graph_auto_records_why_an_untested_builder_is_not_used(monkeypatch):
    config = ExportConfig(progress=False)
    assert graphs.BUILDER.unsupported_because(config, _llama_config()) is None
    monkeypatch.setattr(genai_build, "installed_version", lambda: OLD)
    reason = graphs.BUILDER.unsupported_because(config, _llama_config())
    assert reason == genai_build.version_problem(OLD) and "\n" not in reason
    # the reasons that come first still do (the model's family, the settings)
    assert "does not build" in graphs.BUILDER.unsupported_because(
        config, transformers.GPTNeoXConfig())
    assert "TensorRT" in graphs.BUILDER.unsupported_because(
        ExportConfig(progress=False, format="tensorrt"), _llama_config())


def test_graph_builder_with_settings_it_cannot_build_is_refused_by_the_config():
    from calm_runtime.errors import ConfigError

    for settings in ({"head_layout": "tied-scale"}, {"exporter": "dynamo"}, {"format": "hf"}):
        with pytest.raises(ConfigError, match="--graph builder cannot build this engine: "):
            ExportConfig(progress=False, graph="builder", **settings)
    # the builder builds fp16 itself (tests/calm_export/test_fp16_builder.py)
    assert ExportConfig(progress=False, graph="builder", dtype="fp16").precision.builder == "fp16"


def test_graph_builder_with_an_untested_builder_is_one_line(tmp_path, tiny_llama_untied,
                                                            monkeypatch):
    """The error comes before anything is built or written (no export runs)."""
    from calm_export.pipeline import export_engine
    from calm_runtime.errors import ConfigError

    monkeypatch.setattr(genai_build, "installed_version", lambda: OLD)

    def never(*args, **kwargs):
        raise AssertionError("the builder ran")
    monkeypatch.setattr(genai_builder, "build_graph", never)
    monkeypatch.setattr(genai_builder, "_run_builder", never)
    with pytest.raises(ConfigError) as info:
        export_engine(tiny_llama_untied, tmp_path / "engine",
                      config=ExportConfig(progress=False, greedy_steps=2, graph="builder"))
    assert str(info.value) == (
        "--graph builder cannot build this engine: onnxruntime-genai 0.8.0 is installed, but "
        "calm drives its model builder only within the tested range >=0.18,<0.19 (pip "
        "install 'onnxruntime-genai>=0.18,<0.19'); use --graph auto")
    assert not (tmp_path / "engine").exists()
    assert not list(tmp_path.glob(".engine*"))


def test_the_module_refuses_an_untested_builder(monkeypatch):
    """``python -m calm_export.graphs.genai_build`` (the benchmarks' builder arms) checks too,
    before it touches the builder's API."""
    monkeypatch.setattr(genai_build, "installed_version", lambda: OLD)
    with pytest.raises(genai_build.BuilderVersionError, match="0.8.0 is installed"):
        genai_build.main(["src", "out", "cache"])


# ------------------------------------------------------------------------- the manifest
def test_the_builder_graph_records_the_builder_version(tmp_path, monkeypatch):
    """``build_graph``'s facts (the manifest's ``export``) carry ``graph.builder_version``,
    the release whose builder made the graph (a stand-in builder writes a one-MatMul graph
    here; test_export_engine.py runs the real one)."""
    import numpy as np
    import onnx
    import onnxruntime_genai
    from onnx import TensorProto, helper, numpy_helper

    vocab, hidden = 12, 4

    def builder(source, output, cache, log, precision="fp32"):
        output.mkdir(parents=True)
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["hidden", "lm_head"], ["logits"])], "g",
            [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", "s", hidden])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])],
            [numpy_helper.from_array(np.ones((hidden, vocab), np.float32), "lm_head")])
        onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                        str(output / "model.onnx"))
    monkeypatch.setattr(genai_builder, "_run_builder", builder)
    model = SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(bias=None),
                            save_pretrained=lambda path: None)
    tokenizer = SimpleNamespace(save_pretrained=lambda path: None)
    facts = genai_builder.build_graph([model], tokenizer, tmp_path, vocab)
    version = onnxruntime_genai.__version__
    assert facts["graph"]["builder_version"] == version
    assert facts["graph"]["kind"] == "genai-builder"
    assert facts["exporter"] == f"onnxruntime-genai {version} model builder"


# ------------------------------------------------------------------------- _flatten_rope
def test_the_installed_builder_still_needs_flat_rope_settings_for_gemma3():
    """Why the flattening is there, pinned on the installed builder's source: its Gemma-3
    class inherits the base rotary reader, which reads ``rope_parameters["rope_type"]``
    (KeyError on transformers 5's nested settings), and reads ``rope_local_base_freq``,
    which transformers 5 no longer sets. A builder that reads the nested form fails here:
    then ``rope_needs_flattening`` says no, and this test is to be revised."""
    from onnxruntime_genai.models import builders

    config = _gemma3_config()
    assert set(config.rope_parameters) == {"full_attention", "sliding_attention"}
    assert not hasattr(config, "rope_local_base_freq")
    assert builders.Gemma3Model.make_rope_init is builders.Model.make_rope_init
    with pytest.raises(KeyError, match="rope_type"):
        builders.Model.make_rope_init(SimpleNamespace(rope_attrs={}), config)
    assert genai_build.rope_needs_flattening(config)
    genai_build._flatten_rope(config)
    builders.Model.make_rope_init(SimpleNamespace(rope_attrs={}), config)  # reads it now
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1_000_000.0}
    assert config.rope_local_base_freq == 10_000.0
    assert not genai_build.rope_needs_flattening(config)  # flat now: nothing left to do


def test_flat_settings_and_a_builder_that_reads_nested_ones_are_left_alone():
    assert not genai_build.rope_needs_flattening(_llama_config())

    class Model:
        def make_rope_init(self, config):
            pass

    class Gemma3Model(Model):
        def make_rope_init(self, config):  # reads the nested settings itself
            pass

    reads_nested = SimpleNamespace(Model=Model, Gemma3Model=Gemma3Model)
    inherits = SimpleNamespace(Model=Model, Gemma3Model=type("Gemma3Model", (Model,), {}))
    assert not genai_build.rope_needs_flattening(_gemma3_config(), reads_nested)
    assert genai_build.rope_needs_flattening(_gemma3_config(), inherits)


@pytest.mark.parametrize("needed", [True, False])
def test_main_flattens_only_where_needed(monkeypatch, needed):
    from onnxruntime_genai.models import builder

    config = _gemma3_config()
    nested = dict(config.rope_parameters)
    built = {}
    monkeypatch.setattr(builder, "parse_extra_options",
                        lambda *args: {"hf_details": {"hf_config": config}})
    monkeypatch.setattr(builder, "create_model",
                        lambda *args, **options: built.update(args=args, options=options))
    monkeypatch.setattr(genai_build, "rope_needs_flattening", lambda c: needed)
    assert genai_build.main(["src", "out", "cache", "fp32", "windowed_kv_cache=false"]) == 0
    assert built["args"] == (None, "src", "out", "fp32", "cpu", "cache")
    assert built["options"]["hf_details"]["hf_config"] is config
    if needed:
        assert config.rope_parameters == nested["full_attention"]
    else:
        assert config.rope_parameters == nested and not hasattr(config, "rope_local_base_freq")
