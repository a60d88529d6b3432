"""Session 15: bench_e2e.py --train with the training kernels' launch configs of session 14
(CONFIG=old) or the shipped ones (CONFIG=new), to A/B them on the whole model. Arguments
after the script name go to bench_e2e.py."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # benchmarks/
import bench_e2e  # noqa: E402
from twell_compile.kernels import cuda_infer, cuda_train as ct  # noqa: E402

if os.environ.get("CONFIG") == "old":
    ct.FWD_PAIRS, ct.FWD_COLS_PER_WARP = 4, 512            # 4 pairs, 4 warps at K=2048
    ct.WG_DY_ENTRIES, ct.WG_DY_COLS_PER_WARP = 4, 512      # 4 entries, 4 warps
    ct.WG_X_ENTRIES, ct.WG_X_WARPS = 4, 4
    cuda_infer.ROW_PAIRS, cuda_infer.ROW_COLS_PER_WARP = 4, 512
print("config", os.environ.get("CONFIG", "new"), ct.FWD_PAIRS, ct.FWD_COLS_PER_WARP, ct.WG_DY_ENTRIES,
      ct.WG_DY_COLS_PER_WARP, ct.WG_X_ENTRIES, ct.WG_X_WARPS, flush=True)
bench_e2e.main(sys.argv[1:])
