"""How calibration is measured: ECE, MCE, AECE, Brier and NLL (``metrics``, docs/methods.md
§5), reliability diagrams (``plot``) and ``calm score`` (``score``)."""
