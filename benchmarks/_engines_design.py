"""benchmarks/engines.py's fixed choices: the arms compared, the contexts read, the targets."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
STEM = "engines"
REFERENCE_ARM = "calm fp32"
LONG_CONTEXTS = (128, 1024, 2048)
LONG_ARMS = ("calm fp32", "calm fp32 own graph", "builder fp32")
LONG_NEW_TOKENS = 16
#: top-1 agreement with fp32 beside llama.cpp's: chunks of this many tokens of ARC-Easy's test
#: questions, every position of a chunk's second half but its last (llama-perplexity's)
AGREEMENT_CONTEXT, AGREEMENT_CHUNKS = 128, 48
#: (what, arm, against, metric): calm must be at most 1.00x
TARGETS = (("fp32 decode", "calm fp32", "builder fp32", "decode"),
           ("int4 decode", "calm int4", "builder int4", "decode"),
           ("fp32 decode, both run by genai", "calm fp32 run by genai", "builder fp32",
            "decode"),
           ("int4 decode, both run by genai", "calm int4 run by genai", "builder int4",
            "decode"),
           ("fp32 decode, calm's runtime vs genai's on the same graph", "calm fp32",
            "calm fp32 run by genai", "decode"),
           ("int4 decode, calm's runtime vs genai's on the same graph", "calm int4",
            "calm int4 run by genai", "decode"),
           ("prefill 64", "calm fp32", "builder fp32 pruned head", "prefill64"),
           ("prefill 512", "calm fp32", "builder fp32 pruned head", "prefill512"))
