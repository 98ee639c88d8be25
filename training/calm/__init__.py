"""CALM training (``calm train``, docs/methods.md §4): the run (``trainer``), its settings
(``config``), the model side (LoRA θ and α, ``model``), the data (``data``), BOME's outer
step (``bilevel``), the reference's target (``reference``), the CFT baseline (``cft``), the
do-no-harm gate on α (``alpha_gate``), checkpoints and the option evaluator."""
