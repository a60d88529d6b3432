"""Writes a cost-model fit (tune_decode.py --fit-from ... --policy-out FIT.json) into
twell_compile/kernels/cuda_policy.py: each ``NAME = value`` line of the fit's names.

    python3 benchmarks/results/h200/session14/apply_fit.py FIT.json
"""
import json
import re
import sys
from pathlib import Path

path = Path(__file__).resolve().parents[4] / "twell_compile" / "kernels" / "cuda_policy.py"
src = path.read_text()
for name, value in json.loads(Path(sys.argv[1]).read_text()).items():
    src, n = re.subn(rf"^{name} = [-+0-9.e]+$", f"{name} = {value}", src, flags=re.M)
    assert n == 1, name
path.write_text(src)
print("applied", sys.argv[1])
