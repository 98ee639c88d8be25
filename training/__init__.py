"""calm_training: fitting calibration (label-free DACA temperature, temperature and vector
scaling baselines, CALM bilevel training).

Installed under the prefixed import name ``calm_training`` (the folder is ``training/``).
Importing the package is cheap: torch and the heavy training stack are imported lazily by
the submodules that need them.
"""
