"""benchmarks/calm_train_ood.py's statistics on made-up parts: the regime is the sets where
the LoRA is more over-confident than vanilla, the claims read only those sets, and the
verdicts follow their intervals."""

from __future__ import annotations

import json

import numpy as np
import pytest


def _reading(rng, n, accuracy, confidence):
    # the same answers on every reading of a set (seeded by accuracy): calibration keeps them
    correct = (np.random.default_rng(int(accuracy * 1000)).random(n) < accuracy).astype(int)
    conf = np.clip(rng.normal(confidence, 0.05, n), 0.26, 1.0)
    return {"conf": conf.round(6).tolist(), "correct": correct.tolist(),
            "nll": (-np.log(conf)).round(6).tolist()}


def _parts(bench, rng, n=300):
    # "arc-easy": the LoRA is over-confident there (vanilla is not); "piqa": neither is;
    # "mmlu": the LoRA is over-confident, but vanilla answers near chance (0.27 of 4 options)
    sets_v, seeds = {}, {}
    for s in ("arc-easy", "piqa", "mmlu"):
        acc = 0.27 if s == "mmlu" else 0.6
        sets_v[s] = {"k": 4, "chance": 0.25, "in_domain": False, "readings": {
            "vanilla": _reading(rng, n, acc, acc), "vanilla+ts": _reading(rng, n, acc, acc)}}
    for seed in bench.SEEDS:
        sets = {}
        for s in ("arc-easy", "piqa", "mmlu"):
            over = 0.9 if s in ("arc-easy", "mmlu") else 0.6
            shipped = 0.62 if s == "arc-easy" else 0.6
            sets[s] = {"k": 4, "in_domain": False, "readings": {
                "lora": _reading(rng, n, 0.6, over), "lora+ts": _reading(rng, n, 0.6, 0.65),
                "shipped": _reading(rng, n, 0.6, shipped),
                "T-base": _reading(rng, n, 0.6, 0.75),
                "T-gemma-3-270m": _reading(rng, n, 0.6, 0.62)}}
        seeds[seed] = {"sets": sets, "alpha_gate": {"reason": "alpha dropped"},
                       "references": {"base": {"answer_temperature": 1.1}},
                       "temperature": {}, "temperature_gate": "T kept"}
    return {"vanilla": {"sets": sets_v}, "seeds": seeds}


def test_chance_is_the_mean_of_one_over_k_and_old_parts_get_it_from_their_records(
        benchmark_scripts):
    from types import SimpleNamespace

    with benchmark_scripts("calm_train_ood") as bench:
        from _common import chance_accuracy, fill_chance

        # ARC's mix: mostly 4 options, a few 3 and 5; 1/max K (0.2) would set chance too low
        records = [SimpleNamespace(choices=[0] * k) for k in [4] * 8 + [3, 5]]
        chance = chance_accuracy(records)
        assert chance == pytest.approx((8 / 4 + 1 / 3 + 1 / 5) / 10)
        vanilla = {"correct": [1] * 28 + [0] * 72}  # 0.28: near a 0.25 chance, not a 0.2 one
        entry = {"k": 5, "readings": {"vanilla": vanilla}}
        sets = {"arc-challenge": entry}
        fill_chance(sets, lambda names: {n: records * 10 for n in names},
                    lambda e: len(e["readings"]["vanilla"]["correct"]))
        assert entry["chance"] == pytest.approx(chance) and bench.near_chance(entry)
        assert not bench.near_chance({**entry, "chance": 0.2})
        fill_chance(sets, lambda names: pytest.fail("a recorded chance is kept"), len)
        with pytest.raises(SystemExit, match="holds 100 questions, the set 10; remake"):
            fill_chance({"arc-challenge": {"readings": {"vanilla": vanilla}}},
                        lambda names: {n: records for n in names},
                        lambda e: len(e["readings"]["vanilla"]["correct"]))


def test_the_regime_and_the_claims_follow_the_data(benchmark_scripts):
    with benchmark_scripts("calm_train_ood") as bench:
        payload = bench.build(_parts(bench, np.random.default_rng(0)), n_boot=200)
        assert payload["regime"]["arc-easy"]["in_regime"]
        assert not payload["regime"]["piqa"]["in_regime"]
        mmlu = payload["regime"]["mmlu"]
        assert mmlu["ci"][0] > 0 and mmlu["near_chance"] and not mmlu["in_regime"]
        assert payload["regime_sets"] == ["arc-easy"]
        claims = {(c["metric"], c["b"]): c for c in payload["claims"]}
        assert claims[("ece", "lora")]["verdict"] == "holds"  # 0.9 -> 0.62 at accuracy 0.6
        assert claims[("ece", "lora")]["delta"] < -0.15
        assert claims[("accuracy", "vanilla")]["verdict"] == "holds"  # same accuracy
        for c in payload["claims"]:
            lo, hi = c["ci"]
            assert lo <= c["delta"] <= hi and c["detects"] >= 0 and c["n"] == 300
            assert c["seeds"] == len(bench.SEEDS)
        # the pre-trained reference's T (0.62 at accuracy 0.6) against the base's (0.75)
        assert payload["reference"]["verdict"] == "holds"
        assert payload["reference"]["sets"] == ["arc-easy", "mmlu", "piqa"]  # OOD order
        # T ungated (0.75 at accuracy 0.6) against the LoRA alone (0.9), on the regime's set
        assert payload["ungated_T"]["sets"] == ["arc-easy"]
        assert payload["ungated_T"]["delta"] < 0 and payload["ungated_T"]["verdict"] == "holds"
        text = bench.render({**payload, "command": "c", "commit": "x", "run_commands": ["c"]})
        assert "| arc-easy |" in text and "**holds**" in text
        assert "no (vanilla near chance)" in text


@pytest.mark.parametrize(("metric", "lo", "hi", "expected"), [
    ("ece", -0.05, -0.02, "holds"), ("ece", -0.005, 0.004, "refuted"),
    ("ece", 0.001, 0.02, "refuted"), ("ece", -0.03, 0.01, "inconclusive"),
    ("accuracy", -0.02, 0.01, "holds"), ("accuracy", -0.06, -0.04, "refuted"),
    ("accuracy", -0.05, 0.0, "inconclusive")])
def test_verdicts(benchmark_scripts, metric, lo, hi, expected):
    with benchmark_scripts("calm_train_ood") as bench:
        assert bench.verdict(metric, lo, hi) == expected


def test_a_part_made_before_a_set_was_added_is_extended_in_place(benchmark_scripts, tmp_path):
    with benchmark_scripts("calm_train_ood") as bench:
        args = bench.parse_args(["--out", str(tmp_path)])
        made = {"sets": {bench.DOMAIN: {"k": 4, "readings": {}}}, "ts_temperature": {}}
        bench.write_part(args, "vanilla", made)
        before = json.loads((tmp_path / "calm_train_ood.parts" / "vanilla.json").read_text())
        asked = []

        def read(part, only):
            asked.append(only)
            return {"sets": {s: {"k": 2, "readings": {}} for s in only}}

        args.command, args.commit = "later command", "later"
        bench.extend(args, "vanilla", read)
        after = json.loads((tmp_path / "calm_train_ood.parts" / "vanilla.json").read_text())
        assert asked == [list(bench.OOD)]  # only what the part lacked
        assert list(after["sets"]) == [bench.DOMAIN, *bench.OOD]
        assert after["sets"][bench.DOMAIN] == before["sets"][bench.DOMAIN]
        assert {k: after[k] for k in ("command", "commit", "date")} == \
            {k: before[k] for k in ("command", "commit", "date")}
        assert after["extended"] == [{"sets": list(bench.OOD), "command": "later command",
                                      "commit": "later"}]
        bench.extend(args, "vanilla", read)  # nothing left to add: nothing read
        assert len(asked) == 1


def test_a_set_not_read_for_every_seed_is_left_out_of_the_report(benchmark_scripts, tmp_path):
    with benchmark_scripts("calm_train_ood") as bench:
        args = bench.parse_args(["--out", str(tmp_path)])
        bench.write_part(args, "vanilla", {"sets": {"sciq": {"chance": 0.25},
                                                    "copa": {"chance": 0.5}}})
        bench.write_part(args, "seed-0", {"sets": {"sciq": {}, "copa": {}}})
        bench.write_part(args, "seed-1", {"sets": {"sciq": {}}})  # not extended yet
        parts = bench.load_parts(args)
        assert parts["left_out"] == ["copa"]
        assert all(list(p["sets"]) == ["sciq"]
                   for p in [parts["vanilla"], *parts["seeds"].values()])
