"""The architecture families calm's export is tested on: the conformance matrix (a test
table, not part of the package).

Each :class:`Family` names a transformers config class, what makes the family different
from Llama (the part of the graph that could break the export), the projections its LoRA
targets, and a tiny configuration. ``tests/calm_export/test_conformance.py`` builds a random
2-layer model of every family from that configuration (no downloads), gives it a random
adapter (per-vocabulary tau, a shift, a temperature and a LoRA on the listed projections)
and checks the whole path: engine parity, the runtime against the torch reference,
onnxruntime-genai, ``calm fit daca``, ``calm train`` and ``--format hf``.
``docs/architectures.md`` is generated from this table (``python docs/render_families.py``).

Nothing here imports torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FAMILIES", "Family", "family"]

#: Shared sizes of every tiny model: 2 layers, 4 query heads over 2 KV heads, 64 wide, and
#: the test tokenizer's 300-token vocabulary (ids 1/2/3: BOS, EOS, padding).
_TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


@dataclass(frozen=True)
class Family:
    """One architecture family of the conformance matrix."""

    #: The family's name as users know it ("Gemma-2").
    name: str
    #: transformers' ``model_type`` (the ``config.json`` field that selects the family).
    model_type: str
    #: transformers' config and causal-LM class names.
    config_class: str
    model_class: str
    #: What the export has to get right for this family (docs/architectures.md).
    features: str
    #: Module names a LoRA of this family targets (the attention projections).
    lora_targets: tuple[str, ...]
    #: The tiny configuration's fields on top of the shared sizes.
    config: dict = field(default_factory=dict)
    #: Whether onnxruntime-genai's generic decoder runs the engine (its KV cache layout).
    genai: bool = True

    def tiny_config(self) -> dict:
        """The tiny random model's config fields (shared sizes + the family's own)."""
        return {**_TINY, **self.config}


FAMILIES: tuple[Family, ...] = (
    Family("Llama", "llama", "LlamaConfig", "LlamaForCausalLM",
           "the reference decoder (RMSNorm, rotary, grouped-query attention, SwiGLU)",
           ("q_proj", "v_proj"), {"tie_word_embeddings": True}),
    Family("Mistral", "mistral", "MistralConfig", "MistralForCausalLM",
           "sliding-window attention (window 8, prompts longer than it)",
           ("q_proj", "v_proj"), {"sliding_window": 8}),
    Family("Qwen2", "qwen2", "Qwen2Config", "Qwen2ForCausalLM",
           "bias on the q/k/v projections", ("q_proj", "v_proj"),
           {"tie_word_embeddings": True}),
    Family("Qwen3", "qwen3", "Qwen3Config", "Qwen3ForCausalLM",
           "RMSNorm on queries and keys, explicit head dimension", ("q_proj", "v_proj"),
           {"head_dim": 32}),
    Family("Gemma-2", "gemma2", "Gemma2Config", "Gemma2ForCausalLM",
           "tanh soft-capping of the logits (and of the attention scores), sliding window, "
           "tied head", ("q_proj", "v_proj"),
           {"head_dim": 16, "sliding_window": 8, "final_logit_softcapping": 5.0,
            "attn_logit_softcapping": 20.0, "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True, "layer_types": ["sliding_attention", "full_attention"]}),
    Family("Gemma-3", "gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM",
           "sliding-window layers (window 8, prompts longer than it), q/k norm, scaled "
           "embedding, tied head", ("q_proj", "v_proj"),
           {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True, "layer_types": ["sliding_attention", "full_attention"]}),
    Family("Phi-3", "phi3", "Phi3Config", "Phi3ForCausalLM",
           "fused q/k/v and gate/up projections", ("qkv_proj",),
           {"original_max_position_embeddings": 256}),
    Family("OLMo-2", "olmo2", "Olmo2Config", "Olmo2ForCausalLM",
           "norms after attention and MLP, q/k norm over all heads", ("q_proj", "v_proj")),
    Family("Granite", "granite", "GraniteConfig", "GraniteForCausalLM",
           "logits divided by logits_scaling; embedding, residual and attention multipliers",
           ("q_proj", "v_proj"),
           {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
            "attention_multiplier": 0.125, "tie_word_embeddings": True}),
    Family("Cohere", "cohere", "CohereConfig", "CohereForCausalLM",
           "logits multiplied by logit_scale; parallel attention and MLP, LayerNorm",
           ("q_proj", "v_proj"), {"logit_scale": 0.25, "tie_word_embeddings": True}),
    Family("GPT-NeoX", "gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
           "partial rotary (a quarter of each head), parallel attention and MLP, fused q/k/v, "
           "LayerNorm", ("query_key_value",),
           {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25},
            "use_parallel_residual": True, "num_key_value_heads": 4}),
)


def family(name: str) -> Family:
    """The family called ``name`` (its ``name`` or ``model_type``)."""
    for entry in FAMILIES:
        if name in (entry.name, entry.model_type):
            return entry
    raise KeyError(f"no family {name!r} in the conformance matrix")
