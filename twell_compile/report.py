"""What the twell rewrite did to a graph: rewrites and rejections, printable as a table."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("twell_compile")


@dataclass(frozen=True)
class RewriteEntry:
    layer: str          # module path of the FFN, e.g. "model.layers.0.mlp"
    gated: bool
    op: str             # "twell::ffn" (inference) or "twell::ffn_train"
    tokens_shape: str   # x's shape without the feature dim, symbolic sizes as s0, s1, ...
    k: int
    n: int
    k_out: int
    dtype: str
    graph: str          # which (sub)graph: "" for the top level, else its attribute name
    via: str = "graph"  # "graph": found by the backend; "prepare": made one op by twell_compile.prepare


@dataclass(frozen=True)
class RejectionEntry:
    layer: str
    reason: str
    graph: str


@dataclass
class Report:
    rewrites: list[RewriteEntry] = field(default_factory=list)
    rejections: list[RejectionEntry] = field(default_factory=list)
    graphs: int = 0                 # graphs compiled (explain counts them; DDP splits one into several)
    rank: Optional[int] = None      # torch.distributed rank of the process that made the report
    by_prepare: bool = False        # made by twell_compile.prepare: rejections are modules left as they are

    def extend(self, other: "Report") -> None:
        self.rewrites.extend(other.rewrites)
        self.rejections.extend(other.rejections)

    def add_rewrite(self, entry: RewriteEntry) -> None:
        self.rewrites.append(entry)
        log.info("twell: rewrote %s (%s, %s, N=%d, K=%d, %s) -> %s%s", entry.layer or "<ffn>",
                 "gated" if entry.gated else "non-gated", entry.dtype, entry.n, entry.k,
                 entry.tokens_shape, entry.op, " (prepared)" if entry.via == "prepare" else "")

    def add_rejection(self, entry: RejectionEntry) -> None:
        self.rejections.append(entry)
        log.info("twell: left %s to Inductor: %s", entry.layer or "<ffn-like block>", entry.reason)

    def __str__(self) -> str:
        prepared = sum(r.via == "prepare" for r in self.rewrites)
        where = f" in {self.graphs} graph(s)" if self.graphs > 1 else ""
        where += f" on rank {self.rank}" if self.rank is not None else ""
        if self.by_prepare:
            lines = [f"twell prepare: {len(self.rewrites)} FFN module(s) prepared, {len(self.rejections)} left as they are"]
        else:
            lines = [f"twell: {len(self.rewrites)} FFN(s) rewritten" + (f" ({prepared} prepared)" if prepared else "")
                     + f", {len(self.rejections)} left to Inductor{where}"]
        many = len({r.graph for r in self.rewrites} | {r.graph for r in self.rejections}) > 1
        if self.rewrites:
            rows = [("layer", "kind", "op", "tokens", "K", "N", "K_out", "dtype") + (("graph",) if many else ())]
            rows += [(r.layer or "-", ("gated" if r.gated else "non-gated") + (", prepared" if r.via == "prepare" else ""),
                      r.op, r.tokens_shape, str(r.k), str(r.n), str(r.k_out), r.dtype) + ((r.graph,) if many else ())
                     for r in self.rewrites]
            lines += _table(rows)
        if self.rejections:
            lines.append("")
            lines += _table([("not prepared" if self.by_prepare else "left to Inductor", "reason") + (("graph",) if many else ())]
                            + [(r.layer or "-", r.reason) + ((r.graph,) if many else ()) for r in self.rejections])
        return "\n".join(lines)

    __repr__ = __str__


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(rows[0]), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows[1:]]
