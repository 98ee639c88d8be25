"""How long the README's Quickstart takes, and what it prints.

    python benchmarks/quickstart.py --limit 100     # the README's quicker variant
    python benchmarks/quickstart.py                 # the whole job (570 ARC-Easy questions)
    python benchmarks/quickstart.py --render        # rewrite the .md from the .json

Runs ``calm quickstart [--limit N]`` as a child process in a fresh ``$CALM_CACHE`` whose
``models`` and ``data`` folders link to the current cache's (so nothing is downloaded, and
no score is cached: every question is scored as on a first run), in a temporary output
folder. Records the wall time, the child's CPU time (user + system, from ``getrusage``), the
machine (logical cores, CPU model, memory), the load average before and after (a shared
machine slows the wall time, less the CPU time) and everything the command printed on
stdout. Writes ``results/quickstart.{json,md}``, naming the command and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import command_line, git_commit, machine

HERE = Path(__file__).resolve().parent
STEM = "quickstart"
#: the job's stages, each named by the start of the line it prints when it ends
STAGES = (("install and fit DACA", "1. fit:"), ("compare the methods", "   wrote "),
          ("export the engine", "2. export:"), ("generate", "3. runtime"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=None,
                        help="passed to calm quickstart --limit")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--render", action="store_true", help="only rewrite the .md")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.render:
        (out / f"{STEM}.md").write_text(render(json.loads((out / f"{STEM}.json").read_text())))
        return 0
    from calm_runtime.paths import cache_dir

    # the calm of this interpreter's environment (an activated one puts it on PATH too)
    here = Path(sys.executable).with_name("calm")
    calm = str(here) if here.is_file() else "calm"
    job = [calm, "quickstart"] + (["--limit", str(args.limit)] if args.limit else [])
    source = Path(cache_dir())
    with tempfile.TemporaryDirectory(prefix="calm-quickstart-") as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        for name in ("models", "data"):
            if (source / name).is_dir():
                (cache / name).symlink_to(source / name)
        env = {**os.environ, "CALM_CACHE": str(cache)}
        load_before = os.getloadavg()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.time()
        lines, stages = [], []
        errors = Path(tmp) / "stderr.txt"  # a file: a full pipe would stall the child
        with errors.open("w") as sink, subprocess.Popen(
                [*job, "--out-dir", str(Path(tmp) / "calm-out"), "-q"], cwd=tmp,
                env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=sink,
                text=True) as done:
            for line in done.stdout:  # each stage's line is printed as the stage ends
                lines.append(line)
                stage = next((name for name, start in STAGES if line.startswith(start)), None)
                if stage and stage not in (s["stage"] for s in stages):
                    stages.append({"stage": stage, "ended_s": round(time.time() - started, 1)})
        wall = time.time() - started
        stderr = errors.read_text()
        stages.append({"stage": "score the engine", "ended_s": round(wall, 1)})
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        load_after = os.getloadavg()
    stdout = "".join(lines).replace(tmp, "TMP")
    if done.returncode:
        sys.stderr.write(stderr)
        print(f"calm quickstart failed with exit code {done.returncode}", file=sys.stderr)
        return 1
    result = {"command": command_line("quickstart.py", argv), "commit": git_commit(),
              "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "job": " ".join(["calm", *job[1:]]), "wall_s": round(wall, 1),
              "cpu_s": round((after.ru_utime - before.ru_utime)
                             + (after.ru_stime - before.ru_stime), 1),
              "machine": machine(), "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in load_after],
              "stages": _durations(stages), "stdout": stdout}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{STEM}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{STEM}.md").write_text(render(result))
    print(render(result))
    return 0


def _durations(stages: list[dict]) -> list[dict]:
    """Each stage's own seconds from the times its closing lines appeared."""
    previous, out = 0.0, []
    for stage in stages:
        out.append({**stage, "seconds": round(stage["ended_s"] - previous, 1)})
        previous = stage["ended_s"]
    return out


def minutes(seconds: float) -> str:
    """Whole minutes and seconds, as the README quotes them."""
    return f"{int(seconds // 60)} min {int(round(seconds % 60)):02d} s"


def render(result: dict) -> str:
    m = result["machine"]
    return "\n".join([
        "# Quickstart: time and output", "",
        f"Generated by `{result['command']}` at commit {result['commit']} on "
        f"{result['created']}; do not edit by hand.", "",
        f"`{result['job']}` from an empty score cache (models and data already installed) on "
        f"{m['cores']} logical cores ({m['cpu']}, {m['memory_gib']} GiB, {m['system']}).", "",
        "| wall time | CPU time (user + system) | load average before / after (1 min) |",
        "|---|---|---|",
        f"| {minutes(result['wall_s'])} ({result['wall_s']} s) | {minutes(result['cpu_s'])} "
        f"({result['cpu_s']} s) | {result['load_before'][0]} / {result['load_after'][0]} |", "",
        "A load average above the core count means other work shared the machine: the wall "
        "time is then longer than on an idle machine; the CPU time is the job's own.", "",
        *_stage_table(result.get("stages") or []),
        "What it printed (stdout; TMP: the temporary folder):", "",
        "```text", result["stdout"].rstrip(), "```", ""])


def _stage_table(stages: list[dict]) -> list[str]:
    if not stages:
        return []
    total = sum(s["seconds"] for s in stages) or 1.0
    longest = max(stages, key=lambda s: s["seconds"])
    return ["| stage | wall time | share |", "|---|---|---|",
            *(f"| {s['stage']} | {minutes(s['seconds'])} | {s['seconds'] / total:.0%} |"
              for s in stages), "",
            f"The stage that dominates: {longest['stage']} "
            f"({longest['seconds'] / total:.0%} of the wall time).", ""]


if __name__ == "__main__":
    sys.exit(main())
