"""The mutation suite (fastzoo.equivalence.mutants): every mutant through the public checks, at 1 thread.

    OMP_NUM_THREADS=1 python benchmarks/mutants.py          # fast: every mutant once (CI runs it as a test)
    OMP_NUM_THREADS=1 python benchmarks/mutants.py --long   # the whole grid -> results/<device>/mutants.json

On a shared machine the long grid may run as shards (``--shard 0/2`` and ``--shard 1/2``, each
with ``--out``; ``--only NAMES`` for a part of a shard), joined by ``--merge a.json b.json``
(a row two parts ran is kept once; a part's progress log, ``.log``, stands for a part stopped before
it wrote its JSON): verdicts do not depend on timing.
"""
import argparse
import dataclasses
import json
import re
import sys
import time

import torch
from _common import RESULTS

from fastzoo import files
from fastzoo.equivalence import mutants
from fastzoo.machine import device_name, load_average


PROGRESS = re.compile(r"^(\S+) (\S+) (fp32|bf16|fp16) (\S+) (check train|check forward|op-level): "
                      r"(killed|SURVIVED|not judged) margin=(\S+) ?(.*)$")


def _from_log(path: str) -> dict:
    """A shard stopped before it wrote its JSON: its rows from the progress lines (without the worst
    comparison's name and the seconds, which the lines do not give)."""
    rows = []
    for line in open(path):
        m = PROGRESS.match(line.rstrip("\n"))
        if m:
            mut, fam, dt, be, chk, verdict, margin, note = m.groups()
            rows.append(dataclasses.asdict(mutants.Row(
                mut, fam, dt, be, chk, {"killed": True, "SURVIVED": False}.get(verdict),
                None if margin == "None" else float(margin), "", note)))
    return {"from_log": path, "rows": rows}


def _shard(text: str) -> tuple[str, ...]:
    k, n = (int(x) for x in text.split("/"))
    return tuple(m.name for i, m in enumerate(mutants.CATALOGUE) if i % n == k)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long", action="store_true", help="every model, fp32 and bf16, every CPU backend")
    p.add_argument("--shard", help="K/N: the mutants whose catalogue index is K mod N")
    p.add_argument("--only", nargs="+", help="these mutants (by name)")
    p.add_argument("--merge", nargs="+", help="join the shards' JSON files into one")
    p.add_argument("--out", help="JSON path (default with --long or --merge: results/<device>/mutants.json)")
    args = p.parse_args()
    out = args.out or (RESULTS / device_name("cpu") / "mutants.json" if args.long or args.merge else None)
    if args.merge:
        parts = [_from_log(f) if f.endswith(".log") else json.loads(open(f).read()) for f in args.merge]
        seen, rows, catalogue = set(), [], {m.name: m for m in mutants.CATALOGUE}
        for r in (mutants.Row(**r) for part in parts for r in part["rows"]):  # a row two shards ran: the first
            key = (r.mutant, r.family, r.dtype, r.backend, r.check)
            if r.killed is False:  # a survivor's explanation as the catalogue gives it now
                r.note = mutants.survivor_note(catalogue[r.mutant], r.family, r.dtype) or r.note
            if key not in seen:
                seen.add(key)
                rows.append(r)
        result = {**next(p for p in parts if "profile" in p),
                  "equivalent": {m.name: m.equivalent for m in mutants.CATALOGUE if m.equivalent},
                  "shards": [{k: v for k, v in part.items() if k not in ("rows", "summary", "equivalent", "catalogue")}
                             for part in parts],
                  "summary": mutants.summary(rows), "rows": [dataclasses.asdict(r) for r in rows]}
    else:
        torch.set_num_threads(1)
        before, t0 = load_average(), time.time()
        rows = mutants.run(args.long, progress=lambda line: print(line, file=sys.stderr, flush=True),
                           only=_shard(args.shard) if args.shard else tuple(args.only) if args.only else None)
        result = {"profile": "long" if args.long else "fast", "torch": torch.__version__, "threads": 1,
                  "shard": args.shard, "load_average": [before, load_average()],
                  "minutes": round((time.time() - t0) / 60, 1), "summary": mutants.summary(rows),
                  "equivalent": {m.name: m.equivalent for m in mutants.CATALOGUE if m.equivalent},
                  "catalogue": [{"name": m.name, "description": m.description, "models": m.models, "kernel": m.kernel}
                                for m in mutants.CATALOGUE],
                  "rows": [dataclasses.asdict(r) for r in rows]}
    if out:
        files.write_json(out, result)
    print(result["summary"])
