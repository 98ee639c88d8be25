"""benchmarks/engines.py: the paired ratios and the report of several models' sections."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def engines():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import engines as module

        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("engines", None)


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
    pair = engines._paired([2.0, 3.0, 8.0], [1.0, 3.0, 4.0])
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


def test_llama_cpp_binaries_are_named_when_missing(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _llama_cpp

        with pytest.raises(SystemExit, match="no llama-bench there"):
            _llama_cpp.binaries(tmp_path)
        for name in ("llama-bench", "llama-server"):
            (tmp_path / "bin").mkdir(exist_ok=True)
            (tmp_path / "bin" / name).write_text("")
        assert _llama_cpp.binaries(tmp_path)["server"] == tmp_path / "bin" / "llama-server"
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("_llama_cpp", None)


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
