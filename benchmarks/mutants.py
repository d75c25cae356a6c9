"""The mutation suite (fastzoo.equivalence.mutants): every mutant through the public checks, at 1 thread.

    OMP_NUM_THREADS=1 python benchmarks/mutants.py          # fast: every mutant once (CI runs it as a test)
    OMP_NUM_THREADS=1 python benchmarks/mutants.py --long   # the whole grid -> results/<device>/mutants.json
"""
import argparse
import dataclasses
import sys
import time

import torch
from _common import RESULTS

from fastzoo import files
from fastzoo.equivalence import mutants
from fastzoo.machine import device_name, load_average

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long", action="store_true", help="every model, fp32 and bf16, every CPU backend")
    p.add_argument("--out", help="JSON path (default with --long: results/<device>/mutants.json)")
    args = p.parse_args()
    torch.set_num_threads(1)
    before, t0 = load_average(), time.time()
    rows = mutants.run(args.long, progress=lambda line: print(line, file=sys.stderr, flush=True))
    result = {"profile": "long" if args.long else "fast", "torch": torch.__version__, "threads": 1,
              "load_average": [before, load_average()], "minutes": round((time.time() - t0) / 60, 1),
              "summary": mutants.summary(rows),
              "not_bugs": {m.name: m.why_survives for m in mutants.CATALOGUE if m.why_survives},
              "rows": [dataclasses.asdict(r) for r in rows]}
    out = args.out or (RESULTS / device_name("cpu") / "mutants.json" if args.long else None)
    if out:
        files.write_json(out, result)
    print(result["summary"])
