"""One frozen configuration object for the twell backend.

Users pass options through ``torch.compile(..., options={"twell.l1": 2e-5, ...})``. Keys that
start with ``twell.`` are ours; every other key is handed to Inductor untouched. An unknown
``twell.*`` key raises ``ValueError`` naming it with the closest known key ("did you mean"), a
value of the wrong type or range ``TypeError``/``ValueError`` naming the option.
``check_options`` runs the backend's whole validation (ours and Inductor's keys) up front.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Optional

from twell_compile.runtime.paths import INFER_PATHS, PATHS, TRAIN_PATHS

PREFIX = "twell."
# The paths ``twell.path`` (and the ops' ``path`` argument) can force: runtime/paths.py's Path,
# each op's from its rows of the capability table; runtime/select.py says what each runs.


@dataclass(frozen=True)
class TwellConfig:
    """Options of the twell backend (defaults in brackets).

    enabled [True]: rewrite FFNs at all; False compiles with plain Inductor.
    rewrite_inference [True]: emit the inference op where no gradient is needed.
    rewrite_training [True]: emit the training op (our own backward) where a gradient is needed.
    l1 [0.0]: coefficient of the paper's activation penalty, added to the gradient inside our
        backward as if the loss had ``l1 * mean(|h|)`` over tokens, hidden units and the FFN
        layers of the compiled graph. No change to the user's loss. 2e-5 is the paper's value
        for 10-40B tokens of pretraining at 0.5-2B parameters; short runs and small models need
        far more (the recipe uses 3.0 for 300 steps at N=384: docs/training.md "Choosing L1"),
        and too much kills neurons (35% of hidden units dead at 3.0 there). Added per call and
        not scaled with the loss: k accumulated micro-batches apply it k times, and a GradScaler's
        unscaling divides it by the scale (docs/training.md "Per call, not per loss").
    l1_layers [0]: number of FFN layers the mean runs over; 0 counts the FFNs rewritten in
        the graph (give the model's layer count when graph breaks split it into several graphs).
    target_density [None]: ask for a density instead of a coefficient: the fraction of hidden
        units active per token (e.g. 0.005 for 0.5%), in (0, 1), one number for every FFN or a
        dict {layer name: density} (layers it does not name get no penalty). Each layer's L1
        coefficient (in ``l1``'s units) is then adapted once per optimizer step, on the device,
        to reach and hold the target (``twell_compile.control``: a bounded multiplicative
        step on log(density / target), ranks all-reduce the statistic). Excludes ``l1``.
    target_steps [0]: with ``target_density``: move each layer's target geometrically from
        its first measured density to ``target_density`` over this many optimizer steps (0:
        the target from the start).
    target_l1_init [0.0]: with ``target_density``: each layer's starting coefficient, in
        ``l1``'s units (0: control.COEF_INIT = 0.5). From a model already near the target give
        about the ``l1`` that holds it, else the first tens of steps drift while it ramps up.
    ell_width [256]: hybrid format (training): non-zeros per row kept in the compact ELL part
        (256: 1.8% of rows over it at density 0.005 with the long tail 0.2 of anchors.md, all
        within the backup; 64 left 27% over it and most of them to the slow recompute).
    backup_rows [16]: hybrid format: rows per 1 dense backup row, i.e. the dense backup holds
        ceil(M / backup_rows) rows busier than ``ell_width``. Rows beyond it are recomputed
        exactly in the backward: never dropped.
    stats [True]: keep per-layer statistics on the device (see ``twell_compile.layer_stats``).
    mode [""]: a torch.compile mode ("reduce-overhead", "max-autotune", ...) to apply together
        with twell options: torch.compile refuses ``mode=`` and ``options=`` in one call.
    skip_dense [True]: leave an FFN to Inductor when its compile-time shapes, dtype and device
        mean our op would surely run a path slower than Inductor's (CUDA: fp32, a static token
        count under the sparse kernels' threshold, too wide); ``explain`` gives the reason.
        Training FFNs are always rewritten when ``l1`` is set (the penalty lives in our
        backward).
    path ["auto"]: force one path for every rewritten FFN instead of the measured rules
        (runtime/select.py): "dense", "twell", "decode", "decode-rows", "decode-tiles",
        "decode-list", "decode-pairs", "decode-union", "decode-union2", "cpu", "torch" for inference;
        "dense", "compact", "twell" for training. For tests and benchmarks: FFNs are then always rewritten, and a
        call the forced path cannot run (e.g. "decode" at 1000 tokens) raises ``ValueError``.
        A path one op lacks ("cpu", "torch", "decode*" for training, "compact" for inference)
        leaves that op on "auto" (and its FFNs to the usual rules).
    cudagraphs [""]: whether the compiled graph is replayed in CUDA graphs: "" reads it from
        the compile mode and Inductor's ``triton.cudagraphs`` (reduce-overhead: on); "on" when
        you capture CUDA graphs around the compiled model yourself; "off". Without CUDA graphs a
        static decode-sized CUDA FFN (<= 64 tokens) is left to Inductor under ``skip_dense``:
        rewritten, its host-bound launches held generate() in the default mode to 0.63x of
        Inductor's tokens/s at batch 1 (docs/design-notes/decode.md).
    """

    enabled: bool = True
    rewrite_inference: bool = True
    rewrite_training: bool = True
    l1: float = 0.0
    l1_layers: int = 0
    target_density: Any = None
    target_steps: int = 0
    target_l1_init: float = 0.0
    ell_width: int = 256
    backup_rows: int = 16
    stats: bool = True
    skip_dense: bool = True
    mode: str = ""
    cudagraphs: str = ""
    path: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_density", _check_target(self.target_density))
        for f in fields(self):
            if f.name == "target_density":
                continue
            value = getattr(self, f.name)
            want = f.type if isinstance(f.type, type) else {"bool": bool, "int": int, "float": float, "str": str}[f.type]
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                continue
            if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
                raise TypeError(f"twell option {PREFIX}{f.name} must be {want.__name__}, got {value!r}")
        if not math.isfinite(self.l1) or self.l1 < 0:
            raise ValueError(f"twell option {PREFIX}l1 must be a finite number >= 0, got {self.l1}")
        if self.l1_layers < 0:
            raise ValueError(f"twell option {PREFIX}l1_layers must be >= 0, got {self.l1_layers}")
        if self.l1 and self.target_density is not None:
            raise ValueError(f"twell options {PREFIX}l1 and {PREFIX}target_density were both given: give "
                             f"{PREFIX}l1 for a fixed penalty coefficient, or {PREFIX}target_density for a "
                             "coefficient adapted to reach that density, not both")
        if self.target_steps < 0:
            raise ValueError(f"twell option {PREFIX}target_steps must be >= 0, got {self.target_steps}")
        if not math.isfinite(self.target_l1_init) or self.target_l1_init < 0:
            raise ValueError(f"twell option {PREFIX}target_l1_init must be a finite number >= 0, got "
                             f"{self.target_l1_init}")
        if self.target_l1_init and self.target_density is None:
            raise ValueError(f"twell option {PREFIX}target_l1_init={self.target_l1_init} needs "
                             f"{PREFIX}target_density (the coefficient it starts is the controller's)")
        if self.target_steps and self.target_density is None:
            raise ValueError(f"twell option {PREFIX}target_steps={self.target_steps} needs "
                             f"{PREFIX}target_density (the density it moves to)")
        if self.ell_width < 1:
            raise ValueError(f"twell option {PREFIX}ell_width must be >= 1, got {self.ell_width}")
        if self.backup_rows < 1:
            raise ValueError(f"twell option {PREFIX}backup_rows must be >= 1, got {self.backup_rows}")
        if self.cudagraphs not in ("", "on", "off"):
            raise ValueError(f"twell option {PREFIX}cudagraphs must be '', 'on' or 'off', got {self.cudagraphs!r}")
        if self.path not in PATHS:
            raise ValueError(f"twell option {PREFIX}path must be one of {PATHS}, got {self.path!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> tuple["TwellConfig", dict[str, Any]]:
        """Split torch.compile options into our config and the rest (for Inductor)."""
        if options is None:
            return cls(), {}
        if not isinstance(options, Mapping):
            raise TypeError(f"options must be a dict, got {type(options).__name__}")
        ours: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        known = {f.name for f in fields(cls)}
        for key, value in options.items():
            if isinstance(key, str) and key.startswith(PREFIX):
                name = key[len(PREFIX):]
                if name not in known:
                    raise ValueError(f"unknown twell option {key!r}{did_you_mean(key, (PREFIX + k for k in known))}; "
                                     f"known: {', '.join(PREFIX + k for k in sorted(known))}")
                ours[name] = value
            else:
                rest[key] = value
        return cls(**ours), rest

    def replace(self, **changes: Any) -> "TwellConfig":
        return dataclasses.replace(self, **changes)

    def path_for(self, training: bool) -> str:
        """The forced path for the training or the inference op ("auto" where it has none)."""
        return path_for(self.path, training)

    def target_for(self, layer: str) -> Optional[float]:
        """The density ``target_density`` asks of ``layer`` (a rewritten FFN's name, as
        ``explain`` reports it), or None: no target (no option, or a dict not naming it)."""
        t = self.target_density
        if t is None or isinstance(t, float):
            return t
        return dict(t).get(layer)

    @property
    def in_cudagraphs(self) -> bool:
        """Whether the compiled graph may run inside CUDA graphs: ``cudagraphs`` not "off" (""
        before the backend resolves it counts as on, as the compile-time rules read it)."""
        return self.cudagraphs != "off"

    @property
    def penalized(self) -> bool:
        """Whether training FFNs carry an L1 penalty (``l1`` or ``target_density``)."""
        return bool(self.l1) or self.target_density is not None

    def l1_scale(self, ffns: int) -> float:
        """The penalty coefficient each training op adds to its backward: l1 over the number of
        FFN layers the mean runs over (``l1_layers``, else the ``ffns`` found), as the paper's
        l1 x mean over tokens, hidden units and layers of |h| (the op divides by its own tokens
        and hidden units)."""
        return float(self.l1 / (self.l1_layers or max(ffns, 1)))

    def layer_scale(self, ffns: int) -> float:
        """1 / the number of layers the mean runs over: a controlled layer's backward adds its
        coefficient (in ``l1``'s units, a device tensor) times this."""
        return float(1.0 / (self.l1_layers or max(ffns, 1)))

    def cache_tag(self) -> str:
        """A string that changes whenever an option that shapes the compiled code changes."""
        return ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


def _check_density(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"twell option {PREFIX}target_density{where} must be a number in (0, 1) (the fraction "
                        f"of hidden units active per token, e.g. 0.005), got {value!r}")
    value = float(value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"twell option {PREFIX}target_density{where} must be in (0, 1) (the fraction of hidden "
                         f"units active per token, e.g. 0.005 for 0.5%; not a percentage), got {value!r}")
    return value


def _check_target(value: Any) -> Any:
    """``target_density`` normalised: None, a float in (0, 1), or a sorted tuple of (layer,
    density) pairs (hashable, so the config stays a frozen value)."""
    if value is None:
        return None
    if isinstance(value, Mapping) or (isinstance(value, tuple) and value and all(
            isinstance(p, tuple) and len(p) == 2 for p in value)):
        pairs = dict(value)
        if not pairs:
            raise ValueError(f"twell option {PREFIX}target_density is an empty dict: name at least one layer "
                             "({'model.layers.0.mlp': 0.005}), or give one number for every layer")
        for name in pairs:
            if not isinstance(name, str):
                raise TypeError(f"twell option {PREFIX}target_density: keys must be layer names (str, as "
                                f"explain reports them), got {name!r}")
        return tuple(sorted((name, _check_density(d, f"[{name!r}]")) for name, d in pairs.items()))
    return _check_density(value, "")


def check_target_layers(config: "TwellConfig", layers: Iterable[str], where: str) -> None:
    """Raise ``ValueError`` when a per-layer ``target_density`` dict names none of ``layers``
    (the FFNs found ``where``), with the closest names."""
    t = config.target_density
    if t is None or isinstance(t, float):
        return
    layers = list(layers)
    names = [name for name, _ in t]
    if not layers or any(name in layers for name in names):
        return
    hint = did_you_mean(names[0], layers)
    raise ValueError(f"twell option {PREFIX}target_density names no FFN of {where}: {names}{hint}; its FFNs: "
                     f"{layers[:8]}{' ...' if len(layers) > 8 else ''}. Keys are layer names as "
                     "twell_compile.explain reports them; where graph breaks split the model into several "
                     "graphs, give the targets to twell_compile.prepare(model, options=...), which sees every FFN")


def path_for(path: str, training: bool) -> str:
    """``path`` for the training or the inference op, "auto" where that op has no such path."""
    return path if path in (TRAIN_PATHS if training else INFER_PATHS) else "auto"


def did_you_mean(key: str, candidates: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the candidate closest to ``key`` (difflib ratio >= 0.6,
    case-insensitive), else ``""``. The one spelling-hint rule of every option check."""
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(str(key).lower(), list(by_lower), n=1)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def check_options(options: Mapping[str, Any] | None, model: Any = None) -> TwellConfig:
    """Validate torch.compile options for ``backend="twell"`` now, not at the first call.

    Runs exactly the backend's checks: ``twell.*`` keys and values (``TwellConfig.from_options``)
    and every other key against Inductor's config, ``twell.mode`` against torch.compile's modes
    (``inductor_patches``). An unknown key raises ``ValueError`` with the closest known
    key ("did you mean 'twell.l1'?"); a bad value ``TypeError``/``ValueError`` naming the option.
    Returns the ``TwellConfig`` the backend will use (``cudagraphs`` not yet resolved from the
    mode). At compile time the backend raises the same message inside Dynamo's
    ``BackendCompilerFailed``. With ``model`` (an ``nn.Module``), every layer a per-layer
    ``twell.target_density`` dict names must be a module of it (its path from ``model``, as
    ``explain`` reports it): a name that is not raises ``ValueError`` with the closest.
    """
    config, rest = TwellConfig.from_options(options)
    inductor_patches(config.mode or None, rest)
    if model is not None and isinstance(config.target_density, tuple):
        modules = [name for name, _ in model.named_modules() if name]
        for name, _ in config.target_density:
            if name not in modules:
                raise ValueError(f"twell option {PREFIX}target_density names {name!r}, which is no module of the "
                                 f"model{did_you_mean(name, modules)}: keys are module paths from the model "
                                 "compiled, as twell_compile.explain reports its FFNs")
    return config


def inductor_patches(mode: Optional[str], options: Mapping[str, Any]) -> dict[str, Any]:
    """Inductor config patches for torch.compile's ``mode`` plus the user's non-twell options
    (an unknown key raises ``ValueError`` with the closest of ours and Inductor's)."""
    from torch._inductor import config as inductor_config, list_mode_options

    patches: dict[str, Any] = {}
    if mode and mode != "default":
        try:
            patches.update(list_mode_options(mode))
        except (KeyError, RuntimeError) as e:  # torch versions differ in which they raise
            raise ValueError(f"unknown torch.compile mode {mode!r}: {e}") from None
    known = inductor_config.get_config_copy()
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name not in known:
            ours = [PREFIX + f.name for f in dataclasses.fields(TwellConfig)]
            # A bare twell name ("l1") is ours; else the closest of ours and Inductor's keys.
            hint = (did_you_mean(PREFIX + name, ours) if PREFIX + name in ours
                    else did_you_mean(name, ours + list(known)))
            raise ValueError(f"unknown option {key!r}: neither a twell.* option nor an Inductor config key{hint}")
        patches[name] = value
    return patches
