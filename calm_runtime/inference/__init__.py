"""Running an engine: ``CalibratedLM`` (``lm``), the decode loop, sampling on calibrated
logits, scoring and judging passes, the results it returns, and one backend class per
runtime (``backends``)."""
