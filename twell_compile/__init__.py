"""twell-compile: ``torch.compile(model, backend="twell")`` runs sparse ReLU FFNs fast.

Importing this package initialises no device and builds nothing; the ``twell`` torch.library
ops are registered on first use of the backend (or ``import twell_compile.ops``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from twell_compile.config import TwellConfig, check_options
from twell_compile.report import Report
from twell_compile.stats import LayerStats, layer_stats, reset_stats
from twell_compile.explain import explain  # noqa: E402  (the function shadows the module name)
from twell_compile.export import export  # noqa: E402
from twell_compile.prepare import prepare, unprepare  # noqa: E402

__all__ = ["__version__", "TwellConfig", "check_options", "explain", "export", "prepare", "unprepare", "layer_stats", "reset_stats", "LayerStats", "Report"]
