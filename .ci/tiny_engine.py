"""Build the tests' tiny calibrated engine (random 2-layer Llama, LoRA, random adapter) in OUT.

    python .ci/tiny_engine.py OUT        # prints the engine directory

Used by .ci/run to check that the wheel, installed without torch, loads an engine and
generates from it. Needs the export extra (run it in the development environment).
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Folders:
    """The one method of pytest's tmp_path_factory that the fixtures use."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True)
        return path


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    spec = importlib.util.spec_from_file_location("calm_test_fixtures", ROOT / "tests" /
                                                  "conftest.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    _, _, engine = fixtures.runtime_engine_parts(_Folders(out))
    sys.stdout.write(f"{engine}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
