"""``calm-export``: build a calibrated ONNX (or TensorRT) engine from a model and an adapter."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence

from calm_runtime.cli.common import (
    HelpFormatter,
    install_named,
    missing_extra_message,
    run_command,
)
from calm_runtime.data.models import MODEL_FORMS
from calm_runtime.errors import ConfigError
from calm_runtime.extras import missing
from calm_runtime.modes import CHOICE_MODES, CLOZE_VARIANTS, DEFAULT_CLOZE_VARIANT
from calm_runtime.placement import check_device

from .config import (  # torch-free, like this module
    DTYPES,
    FORMATS,
    GRAPHS,
    HEAD_LAYOUTS,
    INT4_BLOCKS,
    INT8_SCHEMES,
    QUANTIZE,
    ExportConfig,
)

#: the options' defaults are ExportConfig's fields (one place for both; tested)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ExportConfig)}

__all__ = ["main", "build_parser", "register", "run"]

EPILOG = """examples:
  calm-export --model smollm2-135m-instruct --adapter adapters/daca-smollm2 --out engines/daca
  calm-export --model smollm2-135m-instruct --quantize int8 \\
      --recalibrate arc-easy:calibration --out engines/daca-int8
  calm-export --model smollm2-135m-instruct --adapter adapters/daca-smollm2 --format hf \\
      --out checkpoints/smol-calibrated     # a transformers folder vLLM & co. serve
  calm-export --model smollm2-135m-instruct --adapter adapters/daca-smollm2 --format gguf \\
      --out smol-calibrated.gguf            # the GGUF with a calibrated head, for llama.cpp

An ONNX or TensorRT engine is validated before it is written (logits and greedy KV-cache
tokens against the unfused model with the calibration applied in torch); a failed
validation writes nothing and leaves an existing engine in place. --format gguf runs no
model: it copies the source's tensors byte for byte, folds the calibration into the head,
and reads the written file back to check both before it replaces anything."""


DESCRIPTION = ("Fuse a calibration adapter into a model and export a validated inference "
               "engine (ONNX with KV cache, or TensorRT).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="calm-export", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter, allow_abbrev=False)
    add_arguments(parser)
    return parser


def register(sub) -> None:
    """``calm export``: the same options as ``calm-export``, under the one ``calm`` command."""
    p = sub.add_parser("export", help="build a calibrated, validated ONNX/TensorRT engine",
                       description=DESCRIPTION, epilog=EPILOG.replace("calm-export", "calm export"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, quiet=False)
    p.set_defaults(handler=run)


def add_arguments(parser: argparse.ArgumentParser, *, quiet: bool = True) -> None:
    """The export options; ``quiet=False`` where the parent parser already has ``--quiet``."""
    parser.add_argument("--model", required=True, help=f"the model to export: {MODEL_FORMS}")
    parser.add_argument("--adapter", default=None,
                        help="calibration adapter directory (default: identity calibration)")
    parser.add_argument("--out", required=True,
                        help="engine directory to create (--format gguf: the .gguf file)")
    parser.add_argument("--format", choices=FORMATS, default=_DEFAULTS["format"],
                        help="onnx: ONNX engine with KV cache (default); tensorrt: a TensorRT "
                        "plan (GPU); hf: a transformers checkpoint whose LM head computes the "
                        "calibrated logits, for vLLM, SGLang and other servers (a per-token "
                        "shift needs a family with a head bias; see docs/formats.md); gguf: "
                        "the source GGUF with tau and T folded into its head, every other "
                        "tensor copied byte for byte, for llama.cpp and Ollama")
    parser.add_argument("--drop-shift", action="store_true",
                        help="with --format gguf: fold tau and T only, dropping a per-token "
                        "shift the architecture's llama.cpp graph cannot add (recorded in the "
                        "file's calm.shift)")
    parser.add_argument("--dtype", type=_engine_dtype, default=_DEFAULTS["dtype"],
                        metavar="{fp32,fp16}",
                        help="engine precision (fp16: for GPU providers / TensorRT; with the "
                        "default graph the weights are loaded in float16 and no float32 copy "
                        "is held; float32 and float16 are accepted too)")
    parser.add_argument("--device", type=check_device, default=_DEFAULTS["device"],
                        metavar="{auto,cpu,cuda,cuda:N}",
                        help="where the engine is validated: cpu (ONNX Runtime's CPU "
                        "provider), cuda (its CUDA provider; onnxruntime-gpu) or auto (default: "
                        "CUDA when onnxruntime offers it)")
    parser.add_argument("--quantize", choices=QUANTIZE, default=_DEFAULTS["quantize"],
                        help="int8 or int4 weights (blockwise MatMulNBits, every MatMul); the "
                        "drift from fp32 is "
                        "measured and recorded in the manifest")
    parser.add_argument("--calibration-data", metavar="DATA", default=None,
                        help="multiple-choice data (e.g. arc-easy:calibration) to report the "
                        "engine's ECE on, before and after quantisation")
    parser.add_argument("--recalibrate", metavar="DATA", default=None,
                        help="refit the temperature on the final engine's own scores of DATA "
                        "(implies --calibration-data DATA)")
    parser.add_argument("--calibration-mode", choices=CHOICE_MODES, default=None,
                        help="how DATA is scored (default: the adapter's fit mode, else cloze)")
    parser.add_argument("--calibration-variant", choices=CLOZE_VARIANTS, default=None,
                        help="cloze score variant for DATA (default: the adapter's recorded "
                        f"one, else {DEFAULT_CLOZE_VARIANT}; another one needs --recalibrate)")
    parser.add_argument("--int8-scheme", choices=INT8_SCHEMES, default=_DEFAULTS["int8_scheme"],
                        help="with --quantize int8: blockwise (MatMulNBits) or dynamic "
                        "(default blockwise)")
    parser.add_argument("--int8-exclude", metavar="MODULES", default=None,
                        help="with --quantize int8: comma-separated modules kept fp32 (a path, "
                        "a suffix such as mlp.down_proj, or a glob; default: the scheme's "
                        "measured choice)")
    parser.add_argument("--int4-blocks", choices=INT4_BLOCKS, default=_DEFAULTS["int4_blocks"],
                        help="with --quantize int4: auto (default) keeps a GGUF model's own "
                        "quantisation blocks where the weights are the GGUF's; requantize "
                        "quantises every MatMul anew (docs/formats.md)")
    parser.add_argument("--head-layout", choices=HEAD_LAYOUTS, default=_DEFAULTS["head_layout"],
                        help="untied: the head holds W/(tau T) and a bias (default); "
                        "tied-scale: the tied head followed by a scale and a shift")
    parser.add_argument("--graph", choices=GRAPHS, default=_DEFAULTS["graph"],
                        help="auto (default): onnxruntime-genai's builder graph, calibrated, "
                        "for the families it builds (GroupQueryAttention, an in-place KV "
                        "cache), else fused; builder: that graph or an error; fused: calm's "
                        "own graph with RMSNorm as ONNX Runtime's fused ops; standard: calm's "
                        "graph in standard ONNX ops only (TensorRT engines always are)")
    parser.add_argument("--opset", type=int, default=_DEFAULTS["opset"],
                        help=f"ONNX opset (default {_DEFAULTS['opset']})")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing engine once the new one has passed validation")
    if quiet:  # the same -q/-v as `calm` (whose own parser holds them for `calm export`)
        parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
        parser.add_argument("-q", "--quiet", action="store_true",
                            help="warnings only, no progress bar or stage log")


def _engine_dtype(value: str) -> str:
    """``--dtype``: fp32 or fp16 (float32/float16 too); bfloat16 is one line."""
    name = {"float32": "fp32", "float16": "fp16", "half": "fp16"}.get(value.lower(),
                                                                      value.lower())
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"{value!r}: an engine is fp32 or fp16 (ONNX Runtime "
                                         "has no bfloat16 CPU kernels); pass --dtype fp16 for "
                                         "GPUs")
    return name


def main(argv: Sequence[str] | None = None) -> int:
    if missing("export"):  # before argparse, so that --help gives the same one line
        print(f"BackendUnavailableError: {missing_extra_message('export', 'calm-export')}",
              file=sys.stderr)
        return 1
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.quiet:  # stage log for calm only; the exporters' own INFO chatter stays off
        for name in ("calm_export", "calm_runtime"):
            logging.getLogger(name).setLevel(logging.INFO)

    def call() -> int:
        install_named([args.model], [args.calibration_data, args.recalibrate])
        return run(args)

    return run_command(call)


def run(args: argparse.Namespace) -> int:
    """Export with the parsed options and print the summary; raises :class:`CalmError`."""
    from calm_export.config import ExportConfig

    data = args.recalibrate or args.calibration_data
    if args.recalibrate and args.calibration_data not in (None, args.recalibrate):
        raise ConfigError("--calibration-data and --recalibrate name different data; pass "
                          "one of them")
    config = ExportConfig(format=args.format, dtype=args.dtype, quantize=args.quantize,
                          graph=args.graph, device=args.device,
                          opset=args.opset, overwrite=args.overwrite,
                          progress=not args.quiet, calibration_data=data,
                          recalibrate=args.recalibrate is not None,
                          calibration_mode=args.calibration_mode,
                          calibration_variant=args.calibration_variant,
                          int8_scheme=args.int8_scheme, int4_blocks=args.int4_blocks,
                          head_layout=args.head_layout,
                          drop_shift=args.drop_shift,
                          int8_exclude=None if args.int8_exclude is None else tuple(
                              m.strip() for m in args.int8_exclude.split(",") if m.strip()))
    if config.output.gguf_file:  # llama.cpp's file: no torch, no validation graph
        from calm_export.gguf import export_gguf

        print(export_gguf(args.model, args.out, adapter=args.adapter, config=config).summary())
        return 0
    config.output.preflight()  # fail at once, before loading anything heavy
    from tqdm.contrib.logging import logging_redirect_tqdm

    if args.quiet or not sys.stderr.isatty():  # transformers' own weight-loading and
        from huggingface_hub import utils as hub_utils  # shard-writing bars too: no
        from transformers.utils import logging as hf_logging  # carriage returns in a log

        hf_logging.disable_progress_bar()
        hub_utils.disable_progress_bars()

    from calm_export.pipeline import export_engine

    with logging_redirect_tqdm():  # log lines above the progress bar, not through it
        result = export_engine(args.model, args.out, adapter=args.adapter, config=config)
    print(summary(result))
    return 0


def summary(result) -> str:
    """A one-screen summary: files and sizes, parity numbers, time per stage."""
    if isinstance(result.manifest, dict):
        return _checkpoint_summary(result)
    manifest = result.manifest
    report = manifest.validation
    graph = (manifest.export.get("graph") or {}).get("kind", "standard")
    lines = [f"engine: {result.path} ({manifest.kind}, {manifest.model['dtype']}, "
             f"opset {manifest.model['opset']}, exporter {manifest.export['exporter_used']}, "
             f"graph {graph})"]
    for name, size in result.file_sizes.items():
        lines.append(f"  {name:<28} {size / 1e6:10.2f} MB")
    lines.append(f"  {'total':<28} {result.total_bytes / 1e6:10.2f} MB")
    fused_torch = report.get("fused_torch_max_abs_diff")  # calm's own graph only
    lines.append(f"parity: max |logit diff| {report['max_abs_diff']:.3g} (batch 2: "
                 f"{report['batch2_max_abs_diff']:.3g}"
                 + ("" if fused_torch is None else f"; fused torch: {fused_torch:.3g}")
                 + f"), tolerance "
                 f"{report['tolerance']:.3g}; greedy {report['greedy_steps']} steps match "
                 f"({report['greedy_ties']} ties)")
    calibration = manifest.calibration
    lines.append(f"calibration: T={calibration['temperature']:.4g}, tau in "
                 f"[{calibration['tau_min']:.3g}, {calibration['tau_max']:.3g}], shift in "
                 f"[{calibration['shift_min']:.3g}, {calibration['shift_max']:.3g}]")
    lines += _outputs_lines(manifest.calibrated_outputs)
    lines += _variant_lines(manifest)
    lines += _cost_lines(result)
    return "\n".join(lines)


def _cost_lines(result) -> list[str]:
    """The export's time per stage and, where measured, its peak memory per stage."""
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items() if k != "total")
    lines = [f"time: {result.seconds.get('total', 0.0):.1f} s ({stages})"]
    if result.peak_rss_mb:
        name, peak = max(result.peak_rss_mb.items(), key=lambda item: item[1])
        lines.append(f"peak RSS: {peak:.0f} MB (in {name}; "
                     + ", ".join(f"{k} {v:.0f}" for k, v in result.peak_rss_mb.items()) + ")")
    return lines


def _checkpoint_summary(result) -> str:
    manifest, report = result.manifest, result.manifest["validation"]
    folded = manifest["calibration"]["folded"]
    lines = [f"calibrated checkpoint: {result.path} (transformers, float32)"]
    for name, size in result.file_sizes.items():
        lines.append(f"  {name:<28} {size / 1e6:10.2f} MB")
    lines.append(f"  {'total':<28} {result.total_bytes / 1e6:10.2f} MB")
    lines.append(f"folded into the LM head: tau {folded['tau']}, T={folded['temperature']:.4g}, "
                 f"shift {folded['shift']}; post-head {folded['post_head']['kind']}")
    lines += _outputs_lines(manifest["calibration"]["outputs"])
    lines.append(f"parity (reloaded with transformers): max |logit diff| "
                 f"{report['max_abs_diff']:.3g} (batch 2: {report['batch2_max_abs_diff']:.3g}), "
                 f"tolerance {report['tolerance']:.3g}; greedy {report['greedy_steps']} steps "
                 f"match ({report['greedy_ties']} ties)")
    lines += _cost_lines(result)
    return "\n".join(lines)


UNCALIBRATED = "uncalibrated (the model's own)"


def _outputs_lines(outputs: dict) -> list[str]:
    """Which outputs are calibrated, and by which fit (``uncalibrated`` otherwise)."""
    names = {"token_logprobs": "token log-probabilities", "option_probabilities":
             "option probabilities", "p_true": "P(True)"}
    return ["calibrated outputs: " + "; ".join(
        f"{label}: {outputs.get(key) or UNCALIBRATED}"
        for key, label in names.items())]


def _interval(drift: dict) -> str:
    low, high = drift.get("greedy_agreement_interval") or (None, None)
    return "" if low is None else f" (95% interval {low:.1%}-{high:.1%})"


def _blocks_line(facts: dict, blocks: dict) -> str:
    """What a GGUF-blocks engine carried and its size against the GGUF it came from."""
    tables = []
    for table in blocks.get("embeddings", []):
        if "reason" in table:
            tables.append(f"embedding float32 ({table['reason']})")
        else:
            tables.append(f"embedding {'+'.join(table['types'])} blocks"
                          + (", shared with the head" if table["shares_head"] else
                             ", its own copy (the head holds other weights)"))
    return (f"GGUF blocks from {blocks['gguf_file']}: {blocks['carried_nodes']} MatMuls carried"
            + "".join(f"; {t}" for t in tables)
            + f"; weights {facts['bytes'] / blocks['gguf_bytes']:.2f}x the GGUF's "
            f"{blocks['gguf_bytes'] / 1e6:.1f} MB")


def _variant_lines(manifest) -> list[str]:
    export, lines = manifest.export, []
    for name in ("int8", "int4", "fp16"):
        facts = export.get(name)
        if not facts:
            continue
        drift = facts["drift"]
        how = (f"{facts['scheme']}" + (f" {facts['block_size']}" if "block_size" in facts else "")
               + f", {facts['quantized_nodes']}/{facts['linear_nodes']} MatMuls"
               if name in ("int8", "int4") else "float16 weights and KV cache")
        lines.append(f"{name} ({how}): {facts['bytes'] / 1e6:.1f} MB (fp32 "
                     f"{facts['fp32_bytes'] / 1e6:.1f} MB); vs fp32 over {drift['positions']} "
                     f"positions: top-1 agreement {drift['greedy_agreement']:.1%}"
                     + _interval(drift) + ", mean TV "
                     f"{drift['mean_total_variation']:.4f}, max |dp| "
                     f"{drift['max_prob_change']:.3g}")
        blocks = facts.get("blocks") or {}
        if blocks.get("gguf_bytes"):
            lines.append(_blocks_line(facts, blocks))
    check = export.get("calibration_check")
    if check:
        steps = [f"{key} {check[key]['ece']:.4f}" for key in ("fp32", "int8", "int4", "fp16",
                                                               "recalibrated") if key in check]
        lines.append(f"ECE on {check['data']} ({check['mode']}"
                     + (f", {check['variant']}" if check["variant"] else "")
                     + f", n={check['n']}, {check['n_bins']} bins): " + " -> ".join(steps))
        if "recalibration" in check:
            lines.append(f"recalibrated: {check['recalibration']['note']}")
    return lines
