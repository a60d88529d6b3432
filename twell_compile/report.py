"""What the twell rewrite did to a graph: rewrites and rejections, printable as a table."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("twell_compile")

# The layer name of an FFN that has no module path of its own: the model given to explain,
# prepare, export or torch.compile is itself the FFN (its forward holds the projections), or a
# plain function holds it. ``layer_stats()`` uses the same name.
ROOT_LAYER = "root"


@dataclass(frozen=True)
class RewriteEntry:
    """One FFN replaced by a twell op (a row of ``Report.rewrites``).

    layer: module path of the FFN relative to the model given to explain/prepare/torch.compile,
        e.g. "model.layers.0.mlp" (the same name ``layer_stats()`` uses); "root" (``ROOT_LAYER``)
        when the model itself is the FFN. A second FFN of the same name gets "#2", "#3", ...
    gated: True for ``down(relu(gate(x)) * up(x))``, False for ``down(relu(up(x)))``.
    op: "twell::ffn" (inference: no gradient needed), "twell::ffn_train" (training, with the
        twell backward), or "prepared" (``prepare``: the op is chosen per call by grad mode).
    tokens_shape: x's shape without the feature dim, e.g. "[2, 5]" (tokens = the product);
        symbolic sizes show as s0, s1, ... (``export``: the Dim's name); "any" for prepared FFNs.
    k: input features of the FFN (the model width), elements.
    n: hidden units (the FFN width: ReLU outputs per token), elements.
    k_out: output features, elements (usually = k).
    dtype: the FFN's compute dtype ("float32", "bfloat16", ...).
    graph: which graph held it: "" (or explain's compile index "0", "1", ...) for a top-level
        graph, else the subgraph's attribute name after the index ("0:subgraph_0").
    via: "graph" (found in a Dynamo graph by the backend) or "prepare" (made one op by
        ``twell_compile.prepare``).
    runs: what the op will run, from the compile-time facts (e.g. "C++ CPU kernel", "plain
        PyTorch", "CUDA TwELL or dense, by measured density"); "" where not known (prepare).
    act: the activation, the op's ``act``: "relu", "relu2" (squared ReLU: relu(.)^2 in place of
        relu), "drelu" (relu(gate(x)) * relu(up(x))). The table's kind names it unless "relu".
    experts: for a mixture-of-experts block's experts made one ``twell::experts`` op, how many
        experts it holds (each runs the FFN on the tokens routed to it; ``tokens_shape`` then
        counts routed (token, expert) rows and k/n/k_out are one expert's); 0 for one FFN.
    """

    layer: str
    gated: bool
    op: str
    tokens_shape: str
    k: int
    n: int
    k_out: int
    dtype: str
    graph: str
    via: str = "graph"
    runs: str = ""
    act: str = "relu"
    experts: int = 0


@dataclass(frozen=True)
class RejectionEntry:
    """An FFN-like block left to Inductor (or, from ``prepare``, left as it is).

    layer: module path, as in ``RewriteEntry.layer``.
    reason: why, in words (e.g. "activation is SiLU, not ReLU").
    graph: as in ``RewriteEntry.graph``.
    """

    layer: str
    reason: str
    graph: str


_MODE_LINES = {
    "training": "mode: training (grad mode on: FFNs whose weights or input require grad get twell::ffn_train; "
                "call explain under torch.no_grad() to see the inference op twell::ffn)",
    "inference": "mode: inference (called under torch.no_grad() or torch.inference_mode(): FFNs get twell::ffn; "
                 "call with grad enabled and parameters with requires_grad=True to see the training op "
                 "twell::ffn_train)",
}


@dataclass
class Report:
    """What the twell rewrite did; ``print(report)`` shows it as a table.

    rewrites: the FFNs replaced by a twell op, one ``RewriteEntry`` each, in graph order.
    rejections: FFN-like blocks left to Inductor (``prepare``: left as they are), one
        ``RejectionEntry`` each, with the reason.
    graphs: number of graphs Dynamo handed the backend during ``explain`` (1 for a model
        captured whole; each graph break or DDP bucket split adds one); 0 from ``prepare`` and
        ``export``.
    rank: ``torch.distributed`` rank of the process that made the report, None when not
        distributed.
    by_prepare: True when made by ``prepare`` (rejections are modules left as they are).
    mode: the mode ``explain`` assumed from the grad mode of its call: "training" (grad
        enabled: FFNs needing a gradient get ``twell::ffn_train``) or "inference"
        (``torch.no_grad()``/``torch.inference_mode()``: ``twell::ffn``); "" from ``prepare``
        and ``export``. Printed with how to get the other one.
    """

    rewrites: list[RewriteEntry] = field(default_factory=list)
    rejections: list[RejectionEntry] = field(default_factory=list)
    graphs: int = 0
    rank: Optional[int] = None
    by_prepare: bool = False
    mode: str = ""

    def extend(self, other: "Report") -> None:
        self.rewrites.extend(other.rewrites)
        self.rejections.extend(other.rejections)

    def add_rewrite(self, entry: RewriteEntry) -> None:
        self.rewrites.append(entry)
        log.info("twell: rewrote %s (%s, %s, N=%d, K=%d, %s) -> %s%s%s", entry.layer, _kind(entry), entry.dtype, entry.n, entry.k,
                 entry.tokens_shape, entry.op, " (prepared)" if entry.via == "prepare" else "",
                 f": {entry.runs}" if entry.runs else "")

    def add_rejection(self, entry: RejectionEntry) -> None:
        self.rejections.append(entry)
        log.info("twell: left %s to Inductor: %s", entry.layer, entry.reason)

    def __str__(self) -> str:
        prepared = sum(r.via == "prepare" for r in self.rewrites)
        where = f" in {self.graphs} graph(s)" if self.graphs > 1 else ""
        where += f" on rank {self.rank}" if self.rank is not None else ""
        if self.by_prepare:
            lines = [f"twell prepare: {len(self.rewrites)} FFN module(s) prepared, {len(self.rejections)} left as they are"]
        else:
            lines = [f"twell: {len(self.rewrites)} FFN(s) rewritten" + (f" ({prepared} prepared)" if prepared else "")
                     + f", {len(self.rejections)} left to Inductor{where}"]
        if self.mode:
            lines.append(_MODE_LINES[self.mode])
        many = len({r.graph for r in self.rewrites} | {r.graph for r in self.rejections}) > 1
        if self.rewrites:
            runs = any(r.runs for r in self.rewrites)
            rows = [("layer", "kind", "op", "tokens", "K", "N", "K_out", "dtype") + (("graph",) if many else ())
                    + (("runs",) if runs else ())]
            rows += [(r.layer, _kind(r) + (", prepared" if r.via == "prepare" else ""),
                      r.op, r.tokens_shape, str(r.k), str(r.n), str(r.k_out), r.dtype) + ((r.graph,) if many else ())
                     + ((r.runs or "-",) if runs else ()) for r in self.rewrites]
            lines += table(rows)
        if self.rejections:
            lines.append("")
            lines += table([("not prepared" if self.by_prepare else "left to Inductor", "reason") + (("graph",) if many else ())]
                            + [(r.layer, r.reason) + ((r.graph,) if many else ()) for r in self.rejections])
        return "\n".join(lines)

    __repr__ = __str__


def _kind(r: RewriteEntry) -> str:
    return (("gated" if r.gated else "non-gated") + ("" if r.act == "relu" else f" {r.act}")
            + (f", {r.experts} experts" if r.experts else ""))


def table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(rows[0]), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows[1:]]
