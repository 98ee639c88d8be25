"""benchmarks/engines.py: the paired ratios and the report of several models' sections."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture()
def engines(benchmark_scripts):
    with benchmark_scripts("engines") as module:
        yield module


def _section(model: str, calm_ms: float) -> dict:
    ratio = {"ratio_median": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "median_ms": calm_ms}
    return {"command": f"python benchmarks/engines.py --model {model}", "commit": "abc1234",
            "created": "2026-12-01 00:00 UTC", "rounds": 3, "long_rounds": 2,
            "new_tokens": 64, "scores": {}, "score_data": "",
            "rows": [{"arm": "calm fp32", "graph": {"kind": "genai-builder"},
                      "build_seconds": 30.0, "bytes": 6e8, "decode": ratio,
                      "prefill64": ratio, "prefill512": ratio}],
            "long_context": {"new_tokens": 16,
                             "decode_ms": {"calm fp32": {"128": 30.0, "2048": 45.0}},
                             "growth": {"calm fp32": 1.5}},
            "targets": [{"target": "fp32 decode", "arm": "calm fp32", "against": "builder fp32",
                         "ratio_median": 1.09, "ratio_min": 0.92, "ratio_max": 1.15,
                         "met": False}]}


def test_paired_ratios_are_per_round(engines):
    pair = engines.paired([2.0, 3.0, 8.0], [1.0, 3.0, 4.0])
    assert pair == {"ratio_median": 2.0, "ratio_min": 1.0, "ratio_max": 2.0}


def test_the_report_has_a_section_per_model_with_its_targets(engines):
    text = engines.render({"models": {"smol": _section("smol", 31.9),
                                      "gemma": _section("gemma", 63.0)}})
    assert text.count("## smol") == 1 and text.count("## gemma") == 1
    assert "| fp32 decode | calm fp32 | builder fp32 | 1.09 (0.92-1.15) | no |" in text
    assert "| calm fp32 | 30.0 | 45.0 | 1.50 |" in text
    assert "do not edit by hand" in text


def test_the_quality_and_server_tables(engines):
    section = _section("smol", 31.9)
    section["score_data"] = "arc-easy:test"
    section["scores"] = {
        "calm fp32": {"accuracy": 0.474, "ece": 0.149, "nll": 1.2, "brier": 0.6, "n": 570,
                      "top1_agreement": 1.0, "mean_total_variation": 0.0, "positions": 90},
        "builder int4": {"accuracy": 0.45, "ece": 0.15, "nll": 1.3, "brier": 0.6, "n": 570,
                         "top1_agreement": 0.8, "mean_total_variation": 0.21, "positions": 90}}
    run = {"tokens": 768, "seconds": 10.0, "tokens_per_s": 76.8, "requests_per_s": 4.8,
           "clients": 8, "requests": 48, "max_tokens": 16}
    section["servers"] = {"calm serve (calm int4)": [{**run, "seconds": 8.0}],
                          "llama-server (Q4_1 GGUF)": [run],
                          "llama-server (calibrated GGUF)": [{**run, "seconds": 12.0}]}
    section["targets"] += engines._server_targets(section["servers"])
    section["two_threads"] = {"threads": 2, "against": "llama.cpp Q4_1 GGUF",
                              "decode_ms": {"calm int4": 9.84, "llama.cpp Q4_1 GGUF": 10.21},
                              "pair": {"ratio_median": 0.96, "ratio_min": 0.9,
                                       "ratio_max": 1.01}}
    text = engines.render({"models": {"smol": section}})
    assert ("Decode on 2 threads (3 alternated rounds, ms/token, median): calm int4 9.8, "
            "llama.cpp Q4_1 GGUF 10.2.") in text
    assert "| builder int4 | 0.450 | 0.150 | 1.300 | 0.800 | 0.2100 |" in text
    assert "| llama-server (Q4_1 GGUF) | 8 | 16 | 48 | 768 | 10.0 | 4.80 | 76.8 |" in text
    # calm serve against the model's own GGUF, not the calibrated one
    assert ("| served, 8 clients x 16 tokens (wall time) | calm serve (calm int4) | "
            "llama-server (Q4_1 GGUF) | 0.80 (0.80-0.80) | yes |") in text


def test_llama_cpp_binaries_are_named_when_missing(benchmark_scripts, tmp_path):
    with benchmark_scripts("_llama_cpp") as llama_cpp:
        with pytest.raises(SystemExit, match="no llama-bench there"):
            llama_cpp.binaries(tmp_path)
        for name in ("llama-bench", "llama-server"):
            (tmp_path / "bin").mkdir(exist_ok=True)
            (tmp_path / "bin" / name).write_text("")
        assert llama_cpp.binaries(tmp_path)["server"] == tmp_path / "bin" / "llama-server"


def test_the_agreement_beside_llama_cpp_and_the_operator_profile(engines):
    section = _section("smol", 31.9)
    section["agreement"] = {
        "text": "arc-easy:test questions and choices", "context": 128, "chunks": 48,
        "calm int4": {"agreement": 0.9643, "positions": 3024, "interval": [0.957, 0.970]},
        "llama.cpp Q4_1 GGUF": {"agreement": 0.9630, "positions": 3024, "mean_kld": 0.0036,
                                "interval": [0.9556, 0.9691]}}
    section["op_profile"] = {
        "calm int4": {"MatMulNBits": [9966.0, 151.0], "MatMul": [2214.0, 150.0],
                      "(model_run)": [20961.0, 1.0]},
        "calm int4 requantised": {"MatMulNBits": [8800.0, 151.0],
                                  "(model_run)": [11455.0, 1.0]}}
    text = engines.render({"models": {"smol": section}})
    assert "| calm int4 | 0.964 | 0.957-0.970 | 3024 |" in text
    assert "| llama.cpp Q4_1 GGUF | 0.963 | 0.956-0.969 | 3024 |" in text
    assert "| operator | calm int4 | calm int4 requantised |" in text
    assert "| (model_run) | 20961 | 11455 |" in text
    # an operator one engine does not run reads "-", and the slowest operators come first
    assert "| MatMul | 2214 (150) | - |" in text
    assert text.index("| MatMulNBits |") < text.index("| MatMul |")


def test_step_weight_bytes_counts_what_a_decode_step_streams(engines, tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    f32 = np.float32
    inits = [numpy_helper.from_array(np.zeros((10, 8), f32), "embedding"),  # Gather: one row
             numpy_helper.from_array(np.zeros((8, 6), f32), "w"),  # 192 bytes
             numpy_helper.from_array(np.zeros((6, 1, 16), np.uint8), "codes"),  # 96
             numpy_helper.from_array(np.zeros(6, np.float16), "scales16"),  # 24 as float32
             numpy_helper.from_array(np.zeros((1, 6), f32), "minima"),  # 24
             numpy_helper.from_array(np.zeros(8, f32), "norm")]  # not a matrix product's
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["x"]),
             helper.make_node("Mul", ["x", "norm"], ["xn"]),
             helper.make_node("MatMul", ["xn", "w"], ["a"]),
             helper.make_node("MatMul", ["xn", "w"], ["a2"]),  # the same weight, read once
             helper.make_node("Cast", ["scales16"], ["scales"], to=TensorProto.FLOAT),
             helper.make_node("MatMulNBits", ["xn", "codes", "scales"], ["b"],
                              domain="com.microsoft", K=8, N=6, bits=4, block_size=32),
             helper.make_node("ReduceSum", ["xn"], ["s"], keepdims=1),
             helper.make_node("MatMul", ["s", "minima"], ["m"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "a2", "b",
                                                                           "m")], inits)
    onnx.save(helper.make_model(graph), str(tmp_path / "model.onnx"))
    assert engines.step_weight_bytes(tmp_path) == 192 + 96 + 24 + 24
    assert engines.step_weight_bytes(tmp_path / "elsewhere") is None


def test_gguf_step_bytes_reads_the_embedding_only_as_the_head(engines, tmp_path):
    import gguf
    import numpy as np

    def write(name, tensors):
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        for key, values in tensors.items():
            writer.add_tensor(key, values)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / name

    layers = {"token_embd.weight": np.zeros((16, 32), np.float32),  # 2048 bytes
              "blk.0.attn_norm.weight": np.zeros(32, np.float32),  # a vector: not a matrix
              "blk.0.ffn_up.weight": np.zeros((64, 32), np.float32)}  # 8192
    assert engines.gguf_step_bytes(write("tied.gguf", layers)) == 2048 + 8192
    untied = {**layers, "output.weight": np.zeros((16, 32), np.float16)}  # 1024
    assert engines.gguf_step_bytes(write("untied.gguf", untied)) == 1024 + 8192


def test_the_table_gives_the_bytes_read_per_token_and_their_rate(engines):
    section = _section("smol", 31.9)
    section["rows"][0]["step_bytes"] = 537.9e6  # at the row's 31.9 ms: 16.9 GB/s
    section["rows"].append({**section["rows"][0], "arm": "transformers generate()",
                            "step_bytes": None})
    text = engines.render({"models": {"smol": section}})
    assert "| MB read/token | GB/s |" in text
    assert "| 30 | 600 | 537.9 | 16.9 |" in text
    assert "| 30 | 600 | - | - |" in text


def test_the_bare_onnxruntime_loop_decodes_calms_greedy_tokens(engines, runtime_engine):
    """runtime_ab's third arm times a real decode: on the builder's graph it chooses the
    tokens calm's runtime chooses greedily, call after call."""
    from calm_runtime import CalibratedLM
    from calm_runtime.inference.generation import DecodeSettings, GenerationRun
    from calm_runtime.inference.sampling import SamplingParams

    lm = CalibratedLM.load(runtime_engine[2], backend="onnxruntime", threads=1)
    assert lm.manifest.packed
    prompt = lm.encode_prompt("Question: What is the capital of France?\nAnswer:")
    settings = DecodeSettings(max_new_tokens=(8,), sampling=SamplingParams(), stop=(),
                              top_alternatives=0, eos_ids=frozenset())
    run = GenerationRun(lm.backend, lm.tokenizer, [prompt], settings)
    for _ in run:
        pass
    (calm,) = run.results
    worker = sys.modules["_engines_worker"]  # imported by engines (the fixture's)
    bare = worker.ort_runner(Path(runtime_engine[2]), 1)
    for _ in range(2):  # fresh buffers each call
        decode, prefill = bare(list(prompt), 8)
        assert bare.tokens == list(calm.token_ids)
        assert decode > 0 and prefill > 0
