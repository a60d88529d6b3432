"""Session 15: bench_e2e.py --train with the training kernels' launch configs of session 14
(CONFIG=old), the shipped ones (new), or one part of session 14's (fwd_old: train_fwd_kernel,
wg_old: the wgrad passes; state_new: the compact state at 1 pair / 2 warps, as runs 4-15 shipped
it), to A/B them on the whole model. Arguments
after the script name go to bench_e2e.py."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # benchmarks/
import bench_e2e  # noqa: E402
from twell_compile.kernels import cuda_train as ct  # noqa: E402

C = os.environ.get("CONFIG", "new")
if C in ("old", "fwd_old"):                                # train_fwd_kernel (Y=True)
    ct.FWD_PAIRS, ct.FWD_COLS_PER_WARP = 4, 512            # 4 pairs, 4 warps at K=2048
if C in ("old", "wg_old"):                                 # the wgrad passes
    ct.WG_DY_ENTRIES, ct.WG_DY_COLS_PER_WARP = 4, 512      # 4 entries, 4 warps
    ct.WG_X_ENTRIES, ct.WG_X_WARPS = 4, 4
if C == "state_new":                                       # the compact state as in runs 4-15
    ct.STATE_PAIRS, ct.STATE_COLS_PER_WARP = 1, 1024
print("config", C, ct.FWD_PAIRS, ct.FWD_COLS_PER_WARP, ct.STATE_PAIRS, ct.STATE_COLS_PER_WARP,
      ct.WG_DY_ENTRIES, ct.WG_DY_COLS_PER_WARP, ct.WG_X_ENTRIES, ct.WG_X_WARPS, flush=True)
bench_e2e.main(sys.argv[1:])
