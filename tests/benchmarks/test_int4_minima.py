"""benchmarks/int4_minima.py's report (its graph rewrite is tested beside the carried blocks,
tests/calm_export/test_gguf_blocks.py)."""

from __future__ import annotations

import pytest


@pytest.fixture()
def int4_minima(benchmark_scripts):
    with benchmark_scripts("int4_minima") as module:
        yield module


def test_the_report_names_command_commit_what_was_taken_out_and_the_ratios(int4_minima):
    exported, bound, llama = int4_minima.EXPORTED, int4_minima.BOUND, "llama.cpp Q4_1 GGUF"
    times = {exported: [12.0, 13.0, 12.5], bound: [9.0, 10.0, 9.5], llama: [12.0, 12.0, 12.5]}
    pairs = {name: {"ratio_median": v[0] / times[llama][0], "ratio_min": 0.5, "ratio_max": 1.5}
             for name, v in times.items()}
    section = {"command": "python benchmarks/int4_minima.py --model smol --rounds 3",
               "commit": "abc1234", "created": "2026-12-04 06:00 UTC", "rounds": 3,
               "new_tokens": 64, "onnxruntime": "1.32.0",
               "removed_nodes": {"Add": 150, "MatMul": 150, "ReduceSum": 121, "Reshape": 121},
               "minima_mb": 16.9,
               "runs": [{"threads": 1, "ms_per_token": times, "against": llama,
                         "pairs": pairs}],
               "single_node": {"K": 576, "N": 1536,
                               "us": {"none": 26.0, "integer": 26.5, "float": 1430.0}}}
    text = int4_minima.render({"models": {"smol": section}})
    assert ("`python benchmarks/int4_minima.py --model smol --rounds 3` at commit abc1234 on "
            "2026-12-04 06:00 UTC: 3 rounds of 64 tokens, onnxruntime 1.32.0.") in text
    assert ("150 Add, 150 MatMul, 121 ReduceSum, 121 Reshape nodes and 16.9 MB of float32 "
            "minima. Reference arm: llama.cpp Q4_1 GGUF.") in text
    assert f"| 1 | {bound} | 9.50 | 0.750 | 0.500-1.500 |" in text
    assert "| float (a block minimum exactly) | 1430.0 | 55.00 |" in text
    assert "do not edit by hand" in text
