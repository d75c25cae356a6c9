"""The op-level check's bounds, measured: every attention backend and pinned kernel this machine runs
on CPU, on the check's draws of every case it serves (seeds apart from the check's), bf16 and fp16;
each one's worst largest and rms error (units of the dtype's rounding) is written to
fastzoo/equivalence/oplevel_bounds.json, which ``fastzoo.equivalence.oplevel.bounds`` reads.

    OMP_NUM_THREADS=1 python benchmarks/oplevel_bounds.py --draws 40
"""
import argparse
import json

import torch

from fastzoo import files
from fastzoo.equivalence import oplevel
from fastzoo.machine import load_average
from fastzoo.text import dtype_name

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=oplevel.MEASURE_DRAWS, help="draws of each case per backend")
    args = p.parse_args()
    torch.set_num_threads(1)
    before = load_average()
    units = {dtype_name(dt): oplevel.measure(dt, args.draws) for dt in oplevel.UNIT_ROUNDOFF}
    files.write_json(oplevel.BOUNDS_FILE, {"draws": args.draws, "torch": torch.__version__, "threads": 1,
                                           "load_average": [before, load_average()], "units": units})
    print(json.dumps(units, indent=1))
