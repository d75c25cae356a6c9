"""The mutation suite (fastzoo.equivalence.mutants): every mutant through the public checks, at 1 thread.

    OMP_NUM_THREADS=1 python benchmarks/mutants.py          # fast: every mutant once (CI runs it as a test)
    OMP_NUM_THREADS=1 python benchmarks/mutants.py --long   # the whole grid -> results/<device>/mutants.json

On a shared machine the long grid may run as shards (``--shard 0/2`` and ``--shard 1/2``, each
with ``--out``), joined by ``--merge a.json b.json``: verdicts do not depend on timing.
"""
import argparse
import dataclasses
import json
import sys
import time

import torch
from _common import RESULTS

from fastzoo import files
from fastzoo.equivalence import mutants
from fastzoo.machine import device_name, load_average


def _shard(text: str) -> tuple[str, ...]:
    k, n = (int(x) for x in text.split("/"))
    return tuple(m.name for i, m in enumerate(mutants.CATALOGUE) if i % n == k)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long", action="store_true", help="every model, fp32 and bf16, every CPU backend")
    p.add_argument("--shard", help="K/N: the mutants whose catalogue index is K mod N")
    p.add_argument("--merge", nargs="+", help="join the shards' JSON files into one")
    p.add_argument("--out", help="JSON path (default with --long or --merge: results/<device>/mutants.json)")
    args = p.parse_args()
    out = args.out or (RESULTS / device_name("cpu") / "mutants.json" if args.long or args.merge else None)
    if args.merge:
        parts = [json.loads(open(f).read()) for f in args.merge]
        rows = [mutants.Row(**r) for part in parts for r in part["rows"]]
        result = {**parts[0], "shards": [{k: v for k, v in part.items() if k != "rows" and k != "summary"} for part in parts],
                  "summary": mutants.summary(rows), "rows": [dataclasses.asdict(r) for r in rows]}
    else:
        torch.set_num_threads(1)
        before, t0 = load_average(), time.time()
        rows = mutants.run(args.long, progress=lambda line: print(line, file=sys.stderr, flush=True),
                           only=_shard(args.shard) if args.shard else None)
        result = {"profile": "long" if args.long else "fast", "torch": torch.__version__, "threads": 1,
                  "shard": args.shard, "load_average": [before, load_average()],
                  "minutes": round((time.time() - t0) / 60, 1), "summary": mutants.summary(rows),
                  "findings": {m.name: m.finding for m in mutants.CATALOGUE if m.finding},
                  "not_bugs": {m.name: m.why_survives for m in mutants.CATALOGUE if m.why_survives},
                  "catalogue": [{"name": m.name, "description": m.description, "models": m.models, "kernel": m.kernel}
                                for m in mutants.CATALOGUE],
                  "rows": [dataclasses.asdict(r) for r in rows]}
    if out:
        files.write_json(out, result)
    print(result["summary"])
