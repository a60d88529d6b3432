"""Model tests reuse the rewrite-test helpers in tests/passes (PassBackend, check_close)."""

import sys
from pathlib import Path

_PASSES_TESTS = str(Path(__file__).resolve().parent.parent / "passes")
if _PASSES_TESTS not in sys.path:
    sys.path.append(_PASSES_TESTS)
