"""calm inside other programs' processes (a vLLM logits processor); each module imports the
program it plugs into, and nothing here is imported by the rest of calm."""
