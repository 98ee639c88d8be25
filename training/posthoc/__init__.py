"""What the post-hoc methods (:mod:`calm_training.methods`) fit on: a run resolved once
(``plan``), the settings of a fit (``fit_config``), the option scores a fit reads
(``option_fit``), the answer positions a token-level fit reads (``token_fit``), the P(True)
comparison (``p_true``), the held-out comparison of an adapter (``evaluate``) and the
report's tables (``fit_report``). A method's own mathematics (DACA's, temperature and vector
scaling's, the abstention threshold's, Platt scaling's) lives in its module of
:mod:`calm_training.methods`; the temperature solver they share is
:mod:`calm_runtime.temperature`'s."""
