"""benchmarks/runtime_ab.py: the median's interval and the report."""

from __future__ import annotations

import pytest


@pytest.fixture()
def runtime_ab(benchmark_scripts):
    with benchmark_scripts("runtime_ab") as module:
        yield module


def test_the_median_interval_is_the_order_statistics_of_its_coverage(runtime_ab):
    values = [float(v) for v in range(1, 17)]  # 16 rounds
    # binomial(16, 1/2): (x_(4), x_(13)) covers 0.979, (x_(5), x_(12)) only 0.923 < 0.95
    assert runtime_ab.median_interval(values) == [4.0, 13.0]
    # too few rounds for 95%: the whole range
    assert runtime_ab.median_interval([1.0, 2.0, 3.0]) == [1.0, 3.0]
    # the order of the rounds does not matter
    assert runtime_ab.median_interval(values[::-1]) == [4.0, 13.0]


def test_the_report_names_command_commit_and_verdict(runtime_ab):
    section = {"command": "python benchmarks/runtime_ab.py --model smol --rounds 4",
               "commit": "abc1234", "rounds": 4, "arm": "calm fp32",
               "against": "calm fp32 run by genai",
               "ms_per_step": {"calm fp32": [30.0, 31.0, 32.0, 33.0],
                               "calm fp32 run by genai": [31.0, 31.0, 31.0, 31.0]},
               "ratio_median": 1.0, "ratio_interval": [0.968, 1.065],
               "calm_faster_rounds": 1}
    text = runtime_ab.render({"models": {"smol": section}})
    assert ("| smol | `python benchmarks/runtime_ab.py --model smol --rounds 4` | abc1234 | 4 | "
            "31.5 | 31.0 | 1.000 | 0.968-1.065 | 1 of 4 |") in text
    assert "do not edit by hand" in text


def test_the_third_arm_splits_the_difference(runtime_ab):
    times = {"calm fp32": [33.0, 34.0, 36.0, 35.0],
             "calm fp32 run by genai": [31.0, 31.0, 31.0, 31.0],
             "bare onnxruntime loop": [32.0, 33.0, 35.0, 30.0]}
    pair = runtime_ab._pair(times, "calm fp32", "bare onnxruntime loop")
    # per-round ratios 1.031, 1.030, 1.029, 1.167: median 1.031, calm never below the loop
    assert round(pair["ratio_median"], 3) == 1.031 and pair["below_one"] == 0
    # four rounds are too few for 95%: the interval is the whole range
    assert pair["ratio_interval"] == [36.0 / 35.0, 35.0 / 30.0]
    section = {"command": "python benchmarks/runtime_ab.py --model smol --rounds 4",
               "commit": "abc1234", "rounds": 4, "arm": "calm fp32",
               "against": "calm fp32 run by genai", "ms_per_step": times,
               "ratio_median": 1.1, "ratio_interval": [1.06, 1.16], "calm_faster_rounds": 0,
               "pairs": [pair, runtime_ab._pair(times, "bare onnxruntime loop",
                                                "calm fp32 run by genai")]}
    text = runtime_ab.render({"models": {"smol": section}})
    assert "| smol | calm fp32 | bare onnxruntime loop | 34.5 | 1.031 | " in text
    assert "| smol | bare onnxruntime loop | calm fp32 run by genai | 32.5 | 1.048 | " in text
    # a section measured before the third arm has no split
    del section["pairs"]
    assert "Where the difference lies" not in runtime_ab.render({"models": {"smol": section}})


def test_huge_pages_join_the_callers_tunables(runtime_ab):
    assert runtime_ab.huge_page_tunables(None) == "glibc.malloc.hugetlb=1"
    assert (runtime_ab.huge_page_tunables("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0")
            == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
