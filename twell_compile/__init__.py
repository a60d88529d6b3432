"""twell-compile: ``torch.compile(model, backend="twell")`` runs sparse ReLU FFNs fast.

Importing this package registers the ``twell`` torch.library ops (``twell_compile.ops``) and
initialises no device and builds nothing: CUDA, Triton, Inductor and the C++ CPU kernel are
touched on first use. The data path: FX graph -> match (passes/match_ffn.py) -> fuse
(passes/fuse_ffn.py) -> op (ops.py) -> select (runtime/select.py) -> kernel (runtime/ launchers,
kernels/ device code); docs/architecture.md follows it file by file.
"""

from __future__ import annotations

__version__ = "0.1.0"

from twell_compile.config import TwellConfig, check_options
from twell_compile.report import Report
from twell_compile.stats import LayerStats, layer_stats, reset_stats
from twell_compile.control import (load_state_dict as load_controller_state_dict, reset as reset_controller,
                                   state_dict as controller_state_dict, step as controller_step)
from twell_compile.explain import explain  # noqa: E402  (the function shadows the module name)
from twell_compile.export import export  # noqa: E402
from twell_compile.prepare import prepare, unprepare  # noqa: E402

__all__ = ["__version__", "TwellConfig", "check_options", "explain", "export", "prepare", "unprepare", "layer_stats",
           "reset_stats", "LayerStats", "Report", "controller_state_dict", "load_controller_state_dict",
           "reset_controller", "controller_step"]
