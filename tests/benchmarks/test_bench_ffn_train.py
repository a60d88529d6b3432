"""bench_ffn_train.py on the CPU: --act runs the training step of squared ReLU and dReLU in every
column (eager, the op, the fp32 reference) and records it in the rows."""

import json

import pytest

from benchmarks import bench_ffn_train


@pytest.mark.parametrize("act", ["relu2", "drelu"])
def test_quick_act_rows(tmp_path, act, monkeypatch):
    seen = []
    real = bench_ffn_train.torch.ops.twell.ffn_train

    class Spy:                       # the op as the benchmark calls it, recording its act
        def __call__(self, *a, **kw):
            seen.append(kw.get("act"))
            return real(*a, **kw)

    monkeypatch.setattr(bench_ffn_train.torch.ops.twell, "ffn_train", Spy())
    out = tmp_path / "rows.json"
    assert bench_ffn_train.main(["--quick", "--act", act, "--M", "64", "--density", "0.05", "--tail", "0",
                                 "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text().replace("NaN", "null"))
    assert row["act"] == act and set(seen) == {act}
    # the op and eager bf16 against the same fp32 reference of this activation (the 2x rule)
    assert row["grad_rel_err"] <= 2 * row["dense_grad_rel_err"], row


def test_act_rejects_an_unknown_activation_and_the_relu_only_reference(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_ffn_train.main(["--quick", "--act", "gelu"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_ffn_train.main(["--act", "drelu", "--reference", str(tmp_path)])
    assert "ReLU-gated only" in capsys.readouterr().err
