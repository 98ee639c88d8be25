"""Post-hoc calibration (``calm fit``, ``calm eval``): a run resolved once (``plan``), the
fits (``daca``, ``daca_vector``, ``platt``, ``token_fit``, ``threshold``, ``p_true``), the
adapter they write (``fit``), the held-out comparison (``evaluate``) and its report."""
