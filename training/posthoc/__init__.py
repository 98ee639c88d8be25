"""What the post-hoc methods (:mod:`calm_training.methods`) fit on: a run resolved once
(``plan``), the option scores a fit reads (``option_fit``), the temperature and vector-scaling
mathematics the methods share (``daca``, ``daca_vector``, ``token_fit``), P(True)'s fits and
comparison (``p_true``), the held-out comparison of an adapter (``evaluate``) and the report's
tables. A method's own mathematics (the abstention threshold, Platt scaling) lives in its
module of :mod:`calm_training.methods`."""
