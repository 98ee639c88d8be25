"""research/'s scripts are not a package: their tests import them from the folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
