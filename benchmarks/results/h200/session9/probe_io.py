"""Session 9 probes' shared part: the repo root and benchmarks/ on sys.path, and emit(), which
prints a JSON line and rewrites the output file (argv[1]) with every result so far."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
out = sys.argv[1]
res = []


def emit(r):
    print(json.dumps(r), flush=True)
    res.append(r)
    Path(out).write_text(json.dumps(res, indent=1))
