"""Run onnxruntime-genai's model builder on a folder (``python -m calm_export._genai_build``).

    python -m calm_export._genai_build SOURCE OUTPUT CACHE [PRECISION] [KEY=VALUE ...]

Builds the CPU graph (PRECISION fp32 by default, or int4, ...) of the transformers folder
SOURCE into OUTPUT, as ``python -m onnxruntime_genai.models.builder`` would. One adjustment is
made to the config the builder reads: transformers 5 nests Gemma-3's rotary settings per
layer type (``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``),
which the builder's generic reader does not understand (KeyError 'rope_type'); the global
settings become the top-level ones and the local theta ``rope_local_base_freq``, which is
what its Gemma-3 code reads. calm-export calls :func:`main` in its own process (its prints
go to a log); the benchmarks run this module to build the builder's own arms.
"""

from __future__ import annotations

import sys


def _flatten_rope(config) -> None:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_type" not in params and "full_attention" in params:
        config.rope_parameters = dict(params["full_attention"])
        local = params.get("sliding_attention") or params["full_attention"]
        config.rope_local_base_freq = local["rope_theta"]


def main(argv: list[str]) -> int:
    from onnxruntime_genai.models import builder

    source, output, cache, *extra = argv
    precision = extra.pop(0) if extra and "=" not in extra[0] else "fp32"
    options = builder.parse_extra_options(None, source, output, precision, "cpu", cache, extra)
    _flatten_rope(options["hf_details"]["hf_config"])
    builder.create_model(None, source, output, precision, "cpu", cache, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
