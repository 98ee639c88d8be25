"""What the post-hoc methods (:mod:`calm_training.methods`) fit on: a run resolved once
(``plan``), the option scores a fit reads (``option_fit``), the fits' mathematics (``daca``,
``daca_vector``, ``platt``, ``token_fit``, ``threshold``, ``p_true``), the held-out comparison
of an adapter (``evaluate``) and the report's tables."""
