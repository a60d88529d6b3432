"""The capability table (runtime/paths.py): every path has a row, the path tuples and decode
forms follow from it, a forced path its row refuses raises the row's reason, and the per-call
plans and the compile-time rules (static_reason, explain's "runs" column) agree with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from twell_compile import config
from twell_compile.runtime import arch, paths, select
from twell_compile.runtime.arch import CpuPolicy, DecodeConfig, GpuPolicy
from twell_compile.runtime.paths import TABLE, Path

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
P = arch.cuda_default()


def test_every_path_has_a_row_for_at_least_one_op():
    assert set(TABLE) == set(Path)
    for path, row in TABLE.items():
        assert row.inference is not None or row.training is not None, path
        assert dataclasses.is_dataclass(row) and row.__dataclass_params__.frozen
    with pytest.raises(TypeError):
        TABLE[Path.AUTO] = TABLE[Path.DENSE]          # a read-only mapping


def test_the_path_tuples_and_decode_forms_follow_from_the_table():
    assert set(paths.INFER_PATHS) == {"auto", "dense", "twell", "decode", "decode-rows", "decode-tiles",
                                      "decode-list", "decode-pairs", "decode-union", "decode-union2", "cpu",
                                      "torch"}
    assert set(paths.TRAIN_PATHS) == {"auto", "dense", "compact", "twell"}
    assert paths.PATHS == tuple(dict.fromkeys(paths.INFER_PATHS + paths.TRAIN_PATHS))
    assert (config.INFER_PATHS, config.TRAIN_PATHS, config.PATHS) == (paths.INFER_PATHS, paths.TRAIN_PATHS,
                                                                      paths.PATHS)
    assert all(type(p) is str for p in paths.PATHS)   # error messages list plain strings
    assert paths.FORMS == ("rows", "tiles", "list", "pairs", "union", "union2")
    assert paths.DETERMINISTIC_FORMS == select.DETERMINISTIC_FORMS == ("list",)
    assert paths.DECODE_PATHS == ("decode",) + tuple(f"decode-{f}" for f in paths.FORMS)
    for form in paths.FORMS:
        assert paths.caps(paths.path_of(form), training=False).form == form
        for record in (arch.H100, arch.H200):        # each form the rule weighs has its cost constants
            assert (form in record.decode_forms) == (form not in ("union", "union2"))   # forced only
    assert set(select.decode_terms(P, 0.01, None, 1, 2048, 5632, 2048)) <= set(paths.FORMS)


def test_paths_are_strings_to_users():
    assert Path.DECODE_ROWS == "decode-rows" and f"{Path.DECODE_ROWS}" == "decode-rows"
    assert {"decode-rows": 1}[Path.DECODE_ROWS] == 1
    assert config.TwellConfig(path="decode-rows").path_for(False) == "decode-rows"
    assert config.TwellConfig(path=Path.COMPACT).path_for(True) == "compact"
    assert config.TwellConfig(path="compact").path_for(False) == "auto"
    with pytest.raises(ValueError, match="path must be one of"):
        config.TwellConfig(path="decode-fast")
    x = torch.randn(2, 16)
    assert select.plan_infer(x, 40, 16, True, "l", path=Path.TORCH).path == "torch"


def test_rows_name_fields_of_the_records_and_hold_no_measured_numbers():
    gpu = {f.name for f in dataclasses.fields(GpuPolicy)}
    cpu = {f.name for f in dataclasses.fields(CpuPolicy)}
    for path, row in TABLE.items():
        for c in (row.inference, row.training):
            if c is None:
                continue
            names = {c.min_width_from, *c.tokens_from, c.graphs_tokens_from} - {""}
            assert names <= (cpu if "cpu" in c.devices else gpu), (path, names)
            assert not c.max_m_from or c.max_m_from in DecodeConfig._fields
            assert isinstance(c.runs, str) and (c.runs or path == Path.AUTO)


@pytest.mark.parametrize("path, x, match", [
    ("dense", torch.randn(4, 16), "x is on cpu: a CUDA path"),
    ("decode-rows", torch.randn(4, 16), "x is on cpu: a CUDA path \\(the decode path\\)"),
    ("cpu", torch.randn(4, 16).half(), r"the C\+\+ CPU kernel takes float32/bf16 CPU tensors .*\(got torch.float16"),
])
def test_a_forced_path_its_row_refuses_raises_the_rows_reason(path, x, match):
    with pytest.raises(ValueError, match=f"path='{path}' cannot run this call: {match}"):
        select.plan_infer(x, 40, 16, True, "l", path=path)


def test_refusals_on_cuda_name_what_the_row_takes():
    """The CUDA rows' reasons, asked of the table directly (no GPU here)."""
    def why(path, dtype, m, k=64, n=256, k_out=64, training=False):
        return paths.refusal(paths.caps(path, training), CUDA, dtype, m, k, n, k_out, P)

    if paths.triton_available():
        assert why("twell", torch.bfloat16, 4096) is None
        assert why("decode", torch.float16, paths.MAX_M) is None
        assert "the per-row path takes bf16/fp16" in why("twell", torch.float32, 4096)
        assert f"N <= {paths.MAX_N}" in why("twell", torch.bfloat16, 4096, n=paths.MAX_N + 1)
        assert "decode path takes" in why("decode", torch.bfloat16, paths.MAX_M + 1)
        m = next(m for m in range(1, paths.MAX_M + 1) if m > P.decode_config(m, 64).vec_m)
        assert why("decode-tiles", torch.bfloat16, m) is None
        vec_m = P.decode_config(m, 64).vec_m
        assert f"the rows form takes up to {vec_m} tokens" in why("decode-rows", torch.bfloat16, m)
        assert "training kernels take" in why("dense", torch.float32, 4096, training=True)
    else:
        assert "Triton is not installed" in why("twell", torch.bfloat16, 4096)
    assert "a CPU path" in why("cpu", torch.float32, 4096)


def test_static_reason_and_the_runs_column_follow_the_rows_token_bounds():
    """static_reason and static_path (explain's "runs" column) read the bounds a row names: move
    the record's field and both follow."""
    decode_max = paths.token_range(paths.caps(Path.DECODE, False), P)[1]
    rows_min = paths.token_range(paths.caps(Path.TWELL, False), P)[0]
    assert (decode_max, rows_min) == (P.decode_max_m, P.min_tokens)
    with select.compile_rules_for("cuda", torch.bfloat16):
        for m, runs in ((decode_max, "CUDA decode or dense"), (rows_min, "CUDA TwELL or dense")):
            assert select.static_path(CUDA, torch.bfloat16, m, 2048, 5632, 2048).startswith(runs)
        assert "tokens: above the decode path's" in select.static_reason(CUDA, torch.bfloat16, decode_max + 1,
                                                                         2048, 5632, 2048)
        assert select.static_reason(CUDA, torch.bfloat16, rows_min, 2048, 5632, 2048) is None
        with arch.patched(min_tokens=decode_max + 1, graphs_min_tokens=0):
            assert select.static_reason(CUDA, torch.bfloat16, decode_max + 1, 2048, 5632, 2048) is None
        # inside CUDA graphs the record's bound for graphs, where set
        with arch.patched(min_tokens=4096, graphs_min_tokens=2048):
            graphs_min = paths.token_range(paths.caps(Path.TWELL, False), arch.cuda_default(), graphs=True)[0]
            assert graphs_min == 2048
            assert select.static_reason(CUDA, torch.bfloat16, 2048, 2048, 5632, 2048, cudagraphs=True) is None
            assert "below the per-row path's 4096" in select.static_reason(CUDA, torch.bfloat16, 2048, 2048, 5632,
                                                                          2048, cudagraphs=False)
            assert "below the per-row path's 2048" in select.static_reason(CUDA, torch.bfloat16, 2047, 2048, 5632,
                                                                          2048, cudagraphs=True)
        with arch.patched(decode_max_m=decode_max + 4):
            assert select.static_path(CUDA, torch.bfloat16, decode_max + 4, 2048, 5632, 2048).startswith(
                "CUDA decode or dense")
        narrow = paths.min_width(paths.caps(Path.TWELL, False), P) // 2
        assert f"K={narrow}" in select.static_reason(CUDA, torch.bfloat16, rows_min, narrow, 4 * narrow, narrow)
        wide = paths.MAX_WIDTH + 1
        assert "wide" in select.static_reason(CUDA, torch.bfloat16, rows_min, wide, 64, 64)
        train = paths.caps(Path.TWELL, True)
        few = paths.token_range(train, P)[0] - 1
        assert f"{few} tokens" in select.static_reason(CUDA, torch.bfloat16, few, 2048, 5632, 2048, training=True)
        assert select.static_path(CUDA, torch.bfloat16, few, 2048, 5632, 2048, training=True).startswith(
            "CUDA sparse training kernels")
    cpu = paths.caps(Path.CPU, False)
    narrow = paths.min_width(cpu, arch.CPU) - 1
    assert f"K={narrow}" in select.static_reason(CPU, torch.float32, 4096, narrow, 4 * narrow, narrow)
    assert select.static_path(CPU, torch.float32, 4096, narrow, 4 * narrow, narrow) == "plain PyTorch"
    assert "float16" in select.static_reason(CPU, torch.float16, 4096, 1024, 2816, 1024)


def test_the_compile_time_twins_take_one_argument_order():
    """static_reason and static_path both take (m, k, n, k_out): a layer too wide in N only
    reads as too wide to both."""
    with select.compile_rules_for("cuda", torch.bfloat16):
        args = (CUDA, torch.bfloat16, P.min_tokens, 64, paths.MAX_N + 1, 64)
        assert "wide" in select.static_reason(*args)
        assert select.static_path(*args[:3], 2048, 5632, 1024, training=True).startswith("CUDA sparse")
        assert select.static_path(*args, training=True).startswith("plain PyTorch")


def test_auto_plans_follow_the_rows_on_the_cpu():
    """The CPU row's token and width bounds decide "auto" between the C++ kernel and PyTorch."""
    x = torch.randn(8, 16)
    cpu = paths.caps(Path.CPU, False)
    assert not paths.auto_ok(cpu, arch.CPU, x.dtype, 8, 16, 40, 16) or paths.min_width(cpu, arch.CPU) <= 16
    assert select.plan_infer(x, 40, 16, True, "l").path == "torch"       # K=16: under min_width
    assert select.plan_infer(x.half(), 40, 16, True, "l").path == "torch"


@pytest.mark.parametrize("tokens, k, n", [(4096, 1024, 64), (8, 16, 40)])
def test_explains_runs_column_is_the_tables_answer(tokens, k, n):
    """explain's "runs" column for a rewritten CPU FFN is static_path's answer from the CPU row:
    the C++ kernel where the row's bounds take the layer, plain PyTorch otherwise."""
    import twell_compile
    from twell_compile.testing import PlainMLP

    model = PlainMLP(k, n, bias=True)
    x = torch.randn(1, tokens, k)
    with torch.no_grad():
        report = twell_compile.explain(model, x, options={"twell.skip_dense": False})
    (entry,) = report.rewrites
    assert entry.runs == select.static_path(CPU, torch.float32, tokens, k, n, k)
    cpu = paths.caps(Path.CPU, False)
    kernel = paths.auto_ok(cpu, arch.CPU, torch.float32, tokens, k, n, k)
    assert entry.runs == ("C++ CPU kernel" if kernel else "plain PyTorch")


def test_list_slots_bound_the_sparse_training_path_only():
    """The sparse backward codes an entry as row * pow2(W) + slot in 32 bits: M x pow2(W) stays
    under MAX_LIST_SLOTS on the sparse training path; the other paths keep no such lists."""
    c = paths.caps("twell", training=True)
    assert paths.lists_fit(c, 2 ** 23 - 1, 256) and not paths.lists_fit(c, 2 ** 23, 256)
    assert not paths.lists_fit(c, 2 ** 23, 129)          # the width to a power of 2: 256
    assert paths.lists_fit(c, 2 ** 24 - 1, 128) and paths.lists_fit(c, 2 ** 31 - 1, 1)
    for other in (paths.caps("dense", training=True), paths.caps("compact", training=True),
                  paths.caps("twell", training=False)):
        assert paths.lists_fit(other, 2 ** 40, 256)
