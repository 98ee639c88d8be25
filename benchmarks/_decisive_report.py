"""The decisive CALM experiment's report (benchmarks/calm_decisive.py): the result files and
docs/results.md's block, rendered from the part files."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
from _common import fill_chance, portable, rewrite_generated_block
from _decisive_design import (
    OOD,
    SHIPPED,
    eval_sets,
    plan,
    read_part,
    summary,
)
from _decisive_stats import (
    ROUND3_READINGS,
    claims,
)


def round_three_lines(payload: dict) -> list[str]:
    """Each reading of the `calm train` runs out of domain (mean over seeds), and the DACA
    temperature and hold-out readings each run wrote."""
    runs = {n: r for n, r in payload["runs"].items() if r.get("arm") == SHIPPED}
    if not runs:
        return []
    vanilla = payload["runs"].get("vanilla")
    lines = ["", f"## `calm train` as users run it ({SHIPPED}: every default)", "",
             "Out of domain, per set: mean over the seeds of each reading (ECE, 10 equal-width "
             "bins; accuracy; NLL). The claims above give the paired intervals.", "",
             "| reading | seeds | " + " | ".join(f"{s} acc / ECE / NLL" for s in OOD) + " |",
             "|---|---|" + "---|" * len(OOD)]
    for arm, variant, label in ROUND3_READINGS:
        found = [vanilla] if arm == "vanilla" and vanilla else \
            [r for r in runs.values() if variant in next(iter(r["sets"].values()))]
        if not found:
            continue
        cells = []
        for set_name in OOD:
            rows = [r["sets"][set_name][variant] for r in found]
            cells.append(" / ".join(format(float(np.mean([x[k] for x in rows])), ".3f")
                                    for k in ("accuracy", "ece", "nll")))
        lines.append(f"| {label} | {len(found)} | " + " | ".join(cells) + " |")
    lines += ["", "What each run wrote (the DACA temperature against the model before the LoRA, "
              "fitted on the 150 unlabeled calibration questions; the α gate; the parts on the "
              "held-out training questions, accuracy / ECE / NLL):", "",
              "| run | α written | answer T | head T | agreement | base | LoRA | LoRA + α | "
              "LoRA + α + T |", "|---|---|---|---|---|---|---|---|---|"]
    for name, run in sorted(runs.items()):
        daca_fit = run.get("daca") or {}
        parts = (run.get("holdout_parts") or {}).get("parts", {})

        def part(key, parts=parts):
            p = parts.get(key)
            return "-" if not p else f"{p['accuracy']:.3f} / {p['ece']:.3f} / {p['nll']:.3f}"
        fit = daca_fit.get("fit") or {}
        answer_t, head_t = daca_fit.get("answer_temperature"), daca_fit.get("temperature")
        lines.append(
            f"| {name} | {'yes' if (run.get('alpha_gate') or {}).get('kept') else 'no'} | "
            f"{'-' if answer_t is None else format(answer_t, '.3f')} | "
            f"{'-' if head_t is None else format(head_t, '.3f')} | "
            f"{'-' if fit.get('agreement_rate') is None else format(fit['agreement_rate'], '.3f')}"
            f" | {part('base')} | {part('lora')} | {part('lora+alpha')} | "
            f"{part('lora+alpha+T')} |")
    return lines


# ---------------------------------------------------------------------------- report
def load_parts(args) -> dict:
    """Every part by name; the gate's own pieces (``gate-*``) are read through ``gate``."""
    folder = Path(args.parts)
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))
            if not p.stem.startswith("gate-")}


def report(args) -> int:
    parts = load_parts(args)
    gate, chosen = parts.pop("gate", None), parts.pop("default", None)
    if gate is None:
        print(f"no gate results in {args.parts}; run the plan first", file=sys.stderr)
        return 1
    default = chosen["arm"] if chosen else None
    diverged = {name: part["diverged"] for name, part in parts.items() if "diverged" in part}
    parts = {name: part for name, part in parts.items() if "diverged" not in part}
    every_set = functools.cache(lambda: eval_sets(args.eval_limit))  # read once, if at all

    def load(names):  # for parts made before chance was recorded
        return {name: every_set()[name] for name in names}

    for part in parts.values():
        fill_chance(part["sets"], load, lambda info: len(
            next(iter(info["variants"].values()))["questions"]["correct"]))
        for info in part["sets"].values():  # the summaries with today's interval (summary())
            for reading in info["variants"].values():
                reading["summary"] = summary(reading["questions"], info["k"], info["chance"],
                                             args.bins, args.bootstrap)
    results = claims(parts, default, args.decision_bootstrap, args.bins)
    runs = {}
    for name, part in parts.items():
        runs[name] = {k: v for k, v in part.items() if k not in ("sets", "curve")}
        eta = (part.get("settings") or {}).get("eta")
        lams = [r["lam"] for r in part.get("curve") or [] if r.get("lam") is not None]
        if eta is not None and lams:  # how far λ moved from η (the recorded curve's steps)
            runs[name]["lambda_minus_eta"] = float(np.median(np.abs(np.asarray(lams) - eta)))
        runs[name]["sets"] = {s: {v: d["summary"] for v, d in info["variants"].items()}
                              for s, info in part["sets"].items()}
    commits = ",".join(dict.fromkeys(p["commit"] for p in [gate, *parts.values()]))
    folder = Path(args.parts)
    letter_gates = {p.stem.removeprefix("gate-letter").lstrip("-") or "gate":
                    json.loads(p.read_text()) for p in sorted(folder.glob("gate-letter*.json"))}
    payload = {"command": args.command, "run_commands": sorted({p["command"] for p in
                                                                 [gate, *parts.values()]}),
               "commit": commits, "gate": gate, "letter_gates": letter_gates,
               "cft_lr": read_part(args, "gate-cft-lr"),
               "default": chosen, "claims": results,
               "runs": runs, "diverged": diverged,
               "planned": [f"{a}:{s}" for a, s in plan(default)],
               "decision_rule": args.design.split(
                   "**The decision rule**, fixed before the runs.")[1].split("Writes")[0].strip()}
    out = Path(args.out)
    (out / "calm_decisive.json").write_text(
        portable(json.dumps(payload, indent=1, default=str)) + "\n")
    (out / "calm_decisive.md").write_text(render(payload) + "\n")
    if args.readme:
        rewrite_generated_block(args.readme, README_START, README_END, readme_block(payload))
    print(render(payload))
    return 0


#: how the first round's entropy gate is read: it cannot see a reordering of the options
ENTROPY_GATE_WORDS = {True: "α moved the option entropy",
                      False: "α moved the option entropy by less than the gate asks (a "
                             "measure that does not see a reordering)"}
README_START = "<!-- generated by benchmarks/calm_decisive.py --report: start -->"
README_END = "<!-- generated by benchmarks/calm_decisive.py --report: end -->"


def _claim_line(c: dict) -> str:
    if c["verdict"] == "not run":
        why = c.get("why") or "a run it needs is not in the results yet"
        return f"| {c['claim']} | **not run** | - | {why} |"
    if c["verdict"].startswith("n/a"):
        return (f"| {c['claim']} | **{c['verdict']}** | - | {c['arm']} and {c['comparator']} "
                f"are the same readings (seeds {c['seeds'][0]} vs {c['seeds'][1]}, n={c['n']}) |")
    said = f"**{c['verdict']}**"
    if c["metric"] == "accuracy" and c["verdict"] == "holds" and c["ci"][1] < 0:
        said += " (a loss, within the 3-point margin)"
    detects = f", detects ±{c['detects']:.3f}" if c.get("detects") else ""
    return (f"| {c['claim']} | {said} | {c['delta']:+.3f} "
            f"[{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]{detects} | {c['arm']} − {c['comparator']}, "
            f"{c['metric']}, {'+'.join(c['sets'])}, seeds {c['seeds'][0]} vs {c['seeds'][1]}, "
            f"n={c['n']} |")


def _gate_lines(gate: dict) -> list[str]:
    letter = gate["letter"]
    lines = [f"- Letter mode after LoRA: accuracy {letter['accuracy']:.3f} on {letter['n']} "
             f"validation questions, one-sided binomial p = {letter['p_value']:.3g} against "
             f"chance: the regime is **{gate['mode']}** (α tokens: {gate['alpha_tokens']}).",
             f"- α probes (warm start + {gate['probe_steps']} BOME steps; base model + learned α, "
             f"mean option entropy on the validation split, base {gate['base_entropy']:.4f} "
             f"nats; gate {gate['entropy_gate']} nats):"]
    for p in gate["probes"]:
        if "diverged" in p:
            lines.append(f"  - α lr {p['alpha_lr']:g}: diverged ({p['diverged']})")
            continue
        lines.append(f"  - α lr {p['alpha_lr']:g}: entropy change {p['entropy_change']:+.4f}, "
                     f"τ ∈ [{p['tau_range'][0]:.3f}, {p['tau_range'][1]:.3f}], "
                     f"l ∈ [{p['shift_range'][0]:.4f}, {p['shift_range'][1]:.4f}]")
    lines.append(f"- α {'moves' if gate['alpha_moves'] else 'stays inert (no probe passed)'}; "
                 f"α learning rate used: {gate['alpha_lr']:g}.")
    return lines


def _letter_gate_lines(payload: dict) -> list[str]:
    """The letter regime on each packaged model tried (the paper's class-wise α is the letter
    regime): accuracy, the binomial test, and which letters the LoRA answered; a pass would
    add letter-mode arms on that model."""
    lines = []
    for name, g in (payload.get("letter_gates") or {}).items():
        model = g.get("model", name)
        verdict = ("above chance: letter-mode CALM arms on it are the next runs"
                   if g["p_value"] < 0.05 else "not above chance: no letter regime for it")
        if g.get("tuned") and g["p_value"] < 0.05:  # a second attempt on the same model
            verdict = ("above chance by the gate's test, though not once corrected for the "
                       "two attempts on this model (p < 0.025): the letter regime is not "
                       "ruled out; no letter-mode arm was run")
        how = (f"the tuned attempt ({g['settings']['steps']} steps at rate "
               f"{g['settings']['outer_lr']:g})" if g.get("tuned") else
               f"a {g['settings']['steps']}-step LoRA at rate {g['settings']['outer_lr']:g}")
        letters = ""
        if g.get("predicted_letters"):
            def hist(counts):
                return ", ".join(f"{chr(65 + i)} {c}" for i, c in enumerate(counts))
            letters = (f"; letters answered: {hist(g['predicted_letters'])} (right letters: "
                       f"{hist(g['label_letters'])})")
        flag = "--letter-tuned " if g.get("tuned") else ""
        lines.append(f"- Letter mode after {how} on {model}: accuracy {g['accuracy']:.3f} on "
                     f"{g['n']} validation questions, one-sided binomial p = "
                     f"{g['p_value']:.3g}{letters}: {verdict} "
                     f"(`--letter-gate {model} {flag}`).".replace(" `)", "`)"))
    return lines


def _cft_lr_lines(payload: dict) -> list[str]:
    """CFT's learning rate chosen on the validation split, and whether its runs used it."""
    chosen = payload.get("cft_lr")
    if not chosen:
        return []
    lines = []
    for arm, c in chosen["arms"].items():
        grid = ", ".join(f"{lr}: {nll:.4f}" if nll is not None else f"{lr}: diverged"
                         for lr, nll in c["validation_nll"].items())
        used = sorted({r["settings"].get("outer_lr") for name, r in payload["runs"].items()
                       if name.startswith(f"{arm}-s")}, key=str)
        state = ("no runs yet." if not used else "its runs use it." if used == [c["outer_lr"]]
                 else f"its runs used {', '.join(map(str, used))}: they are to be rerun at "
                      "the chosen rate.")
        lines.append(f"- {arm}: validation NLL by learning rate ({grid}); chosen "
                     f"{c['outer_lr']:g}; {state}")
    return lines


def _cft_lines(runs: dict) -> list[str]:
    """What each CFT run trained against and how large its two loss terms were at the end."""
    rows = [(name, run) for name, run in runs.items() if run.get("cft_bins")]
    if not rows:
        return []
    lines = ["", "## CFT runs", "",
             "Bins estimated before training on the training split (accuracy/size per "
             "equal-width confidence bin, empty bins left out), and the last step's "
             "cross-entropy and L_cal with their weighted shares of the loss, "
             "(1 − w)·CE and w·c·L_cal.", "",
             "| run | w | c | bins (acc/size) | CE last | L_cal last | (1 − w)·CE | w·c·L_cal |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run in rows:
        w, c = run["settings"]["cft_weight"], run["settings"]["cft_scale"]
        b, last = run["cft_bins"], run.get("last") or {}
        bins = ", ".join(f"{k / len(b['count']):.1f}: {a:.2f}/{n}" for k, (a, n) in
                         enumerate(zip(b["accuracy"], b["count"], strict=True)) if n)
        ce, cal = last.get("cft_ce"), last.get("cft_l_cal")
        lines.append(f"| {name} | {w:g} | {c:g} | {bins} | {ce:.4g} | {cal:.4g} | "
                     f"{(1 - w) * ce:.4g} | {w * c * cal:.3g} |" if ce is not None else
                     f"| {name} | {w:g} | {c:g} | {bins} | - | - | - | - |")
    return lines


def _round_two_lines(runs: dict) -> list[str]:
    """The α gate's measures (held-out training questions) and the coupling diagnostics."""
    rows = [(name, run) for name, run in runs.items() if run.get("alpha_gate")]
    if not rows:
        return []
    lines = ["", "## The α gate and the coupling", "",
             "The gate: the trained θ on held-out training questions with α as trained against "
             "without α (second-round runs: α kept if the NLL drops; `calm-train` runs: only "
             "if it drops by more than its paired 95% interval's half-width and accuracy falls "
             "by at most 0.03). The coupling: share of BOME steps with λ > η (λ > η exactly "
             "when cos(∇f, ∇q) < 0, λ < η when it is > 0: at cos ≈ 0 this share is a coin "
             "flip), median |λ − η| over the recorded curve, median ‖∇_α q‖/‖∇_α f‖ and "
             "median ‖θ~ − θ‖/‖θ‖.", "",
             "| run | α written | held-out n | NLL without → with α | answers changed | TV | "
             "KL | ΔH | λ > η | median abs(λ − η) | ‖∇_α q‖/‖∇_α f‖ | inner move |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in rows:
        gate, c = run["alpha_gate"], run.get("coupling") or {}
        share = gate.get("share") or {}

        def num(v, fmt=".3g"):
            return "-" if v is None else format(v, fmt)
        lines.append(
            f"| {name} | {'yes' if gate['kept'] else 'no (identity)'} | {num(share.get('n'))} | "
            f"{num(share.get('nll_without'), '.4f')} → {num(share.get('nll_alpha'), '.4f')} | "
            f"{num(share.get('flips'))} | {num(share.get('total_variation'), '.4f')} | "
            f"{num(share.get('kl_without_to_alpha'), '.4f')} | "
            f"{num(share.get('entropy_change'), '+.4f')} | "
            f"{num(c.get('share_lambda_above_eta'), '.2f')} | "
            f"{num(run.get('lambda_minus_eta'), '.2g')} | "
            f"{num(c.get('median_alpha_q_to_f'))} | {num(c.get('median_inner_move'))} |")
    return lines


#: what the claims' intervals are and are not (printed above the claims)
MULTIPLICITY = ("Each verdict rests on its own 95% interval; the claims are not corrected for "
                "multiplicity (with this many, a few verdicts at the edge of their margin may "
                "be chance): read them as exploratory, the `calm-train` rows as the measurement "
                "of what `calm train` ships. An ECE claim 'holds' only when its interval lies "
                "below 0 and not wholly inside ±0.01; 'n/a' marks two identical readings "
                "(nothing to compare).")


def render(payload: dict) -> str:
    gate, default = payload["gate"], payload["default"]
    done = set(payload["runs"])
    done |= set(payload.get("diverged", {}))
    missing = [r for r in payload["planned"]
               if (r.split(":")[0] if r.startswith("vanilla") else
                   "{}-s{}".format(*r.split(":"))) not in done]
    lines = [f"Generated by `{payload['command']}` from the runs of "
             f"{'; '.join(f'`{c}`' for c in payload['run_commands'])} at {payload['commit']}.",
             "", "## The gate", "", *_gate_lines(gate), *_letter_gate_lines(payload),
             *_cft_lr_lines(payload), "",
             "## Default arm", "",
             (f"**{default['arm']}** ({default['rule']}; NLL "
              + ", ".join(f"{a} {v:.4f}" for a, v in default["validation_nll"].items()) + ")"
              if default else "not chosen yet (its seed-0 candidates are missing)"), "",
             "## Claims", "", MULTIPLICITY, "",
             "| claim | verdict | Δ [95% percentile bootstrap CI] | what |", "|---|---|---|---|",
             *[_claim_line(c) for c in payload["claims"]], "",
             f"Runs not yet made: {', '.join(missing) if missing else 'none'}.", "",
             *[f"Diverged (no results; its verdicts are not run): {name}: {why}" for name, why
               in payload.get("diverged", {}).items()], "",
             "## Runs", "",
             "| run | set | variant | acc | ECE [95% CI] | NLL | Brier | mean conf | τ range |"
             " base+α ΔH | λ last | cos(∇f,∇q) last |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in payload["runs"].items():
        last = run.get("last") or {}
        tau = run.get("tau_range")
        tau_text = f"[{tau[0]:.3f}, {tau[1]:.3f}]" if tau else "-"
        dh = run.get("base_alpha_entropy_change")
        for set_name, variants in run["sets"].items():
            for variant, s in variants.items():
                chance = " *" if s["near_chance"] else ""

                def num(v, fmt=".3g"):
                    return "-" if v is None else format(v, fmt)
                lines.append(
                    f"| {name} | {set_name} | {variant} | {s['accuracy']:.3f}{chance} | "
                    f"{s['ece']:.3f} [{s['ece_ci'][0]:.3f}, {s['ece_ci'][1]:.3f}] | "
                    f"{s['nll']:.3f} | {s['brier']:.3f} | {s['mean_confidence']:.3f} | "
                    f"{tau_text} | {num(dh, '+.4f')} | {num(last.get('lam'))} | "
                    f"{num(last.get('cos_f_q'))} |")
    lines += _cft_lines(payload["runs"])
    lines += _round_two_lines(payload["runs"])
    lines += round_three_lines(payload)
    lines += ["", "`*`: accuracy within 5 points of chance (the mean of 1/K); left out of the "
              "decisions.",
              "", "## Decision rule (fixed before the runs)", "", payload["decision_rule"]]
    return "\n".join(lines)


def _seeds_per_arm(runs: dict) -> str:
    counts: dict[str, int] = {}
    for run in runs.values():
        if run.get("arm") and run["arm"] != "vanilla":
            counts[run["arm"]] = counts.get(run["arm"], 0) + 1
    return ", ".join(f"{arm} {n}" for arm, n in sorted(counts.items()))


def readme_block(payload: dict) -> str:
    gate, default = payload["gate"], payload["default"]
    lines = [f"Generated by `python benchmarks/calm_decisive.py --report` from "
             f"`benchmarks/results/calm_decisive.json` (commit {payload['commit']}): "
             f"SmolLM2-135M-Instruct trained on SciQ, out of domain ARC-Easy and PIQA, "
             f"{gate['mode']} mode. Default arm (the first round's BOME arm chosen on the "
             f"validation split; not `calm train`'s defaults, which are the `{SHIPPED}` arm): "
             f"**{default['arm'] if default else 'not chosen yet'}**. "
             f"{ENTROPY_GATE_WORDS[bool(gate['alpha_moves'])]} in the gate (α learning rate "
             f"{gate['alpha_lr']:g}). Seeds per arm: {_seeds_per_arm(payload['runs'])}.", "",
             MULTIPLICITY, "",
             "| claim | verdict | Δ [95% percentile bootstrap CI] | what |", "|---|---|---|---|",
             *[_claim_line(c) for c in payload["claims"]], *round_three_lines(payload)]
    return "\n".join(lines)
