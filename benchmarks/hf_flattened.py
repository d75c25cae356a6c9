"""fastzoo packed against Hugging Face's own packing, the peer an HF user who packs would pick:
``DataCollatorWithFlattening`` rows (one row, positions restarting per sequence) into the
original with its default attention (sdpa on a CPU) and ``use_cache=False`` (without it,
transformers 5.17 attends across the sequences: tests/test_hf_flattening.py). The training step
as users write it (``labels=``) for each decoder family (GPT-2, Llama, and Gemma 2 where fastzoo
has it), fp32 and bf16 autocast, timed interleaved in one run beside HF padded to the longest.

HF attends the flattened row as one masked ``[T, T]`` block; fastzoo (``varlen``) attends each
sequence alone. What remains between the two is that attention work: the FLOP ratio (block ÷
per sequence, the spec's FLOP count) is the bound, and each result is the speed-up over HF
flattened ÷ that bound. The GEMM peak of each precision is measured in the same run.

    python benchmarks/hf_flattened.py --threads 1 [--quick | --size tour] [--families gpt2 llama gemma2]
"""
import os

import torch
from _common import parser, recipes_for, save, setup, timing

from fastzoo import files
from fastzoo.bench import limits, run_suite
from fastzoo.bench.causal_lm import causal_lm_suite, flattened_vs_packed
from fastzoo.registry import get_entry
from fastzoo.text import markdown_table

FAMILIES = ("gpt2", "llama", "gemma2")


def packed_backends(entry, workload) -> list[str]:
    """fastzoo's kernel for packed sequences (``varlen``); where it cannot serve the model (a
    capability it lacks, e.g. soft-capping), the packed backends that can, so the row says which."""
    import fastzoo
    from fastzoo.errors import BackendUnavailableError

    out = []
    for b in ("varlen", "eager"):
        try:
            fastzoo.create(entry.name, attn=b, device="meta", **workload.config)
        except BackendUnavailableError:
            continue
        out.append(b)
        if b == "varlen":
            break
    return out


def fitted(entry, workload):
    """The workload's depth with the variant's per-layer attention kinds cut to it (Gemma's
    alternating sliding / global layers: the shared decoder workloads change only the depth)."""
    import dataclasses

    kinds, depth = entry.config.get("layer_types"), workload.config.get("num_hidden_layers")
    if kinds is None or depth is None or "layer_types" in workload.config:
        return workload
    return dataclasses.replace(workload, config={**workload.config, "layer_types": tuple(kinds[:depth])})


def run(device, out, *, quick, families=FAMILIES, size=None, note="", progress=True) -> dict:
    load = os.getloadavg()
    summary = {"device": str(device), "threads": torch.get_num_threads(), "load before": [round(x, 2) for x in load],
               "peer": "HF with DataCollatorWithFlattening, use_cache=False (its default attention: sdpa)",
               "bound": "FLOPs of HF's step (attention over the packed [T, T] block) ÷ fastzoo packed's (each sequence alone)",
               "families": {}, "skipped": {}}
    for name in families:
        try:
            entry = get_entry(name)
        except KeyError:
            summary["skipped"][name] = "not a fastzoo model in this checkout"
            continue
        tried = recipes_for(entry, quick, device, compile=False)
        workload = fitted(entry, entry.spec.bench.sizes[size or ("quick" if quick else "bench")])
        suite = causal_lm_suite(entry, workload, backends=packed_backends(entry, workload), modes=("train",),
                                recipes=tried, steps=("labels",), device=device)
        suite.limits = limits.measure(device, dtypes=tuple(r.dtype or torch.float32 for r in tried), quick=quick)
        report = save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True),
                      out, f"hf_flattened_{name}")
        packed = {r.group: r for r in report.rows if r.label.startswith("fastzoo packed")}
        summary["families"][name] = {
            "workload": suite.config["model"], "limits": report.limits,
            "comparisons": [{**c, "packed share of GEMM peak": packed[c["group"]].flop_share}
                            for c in flattened_vs_packed(report.rows)],
            "rows": {r.label + " | " + r.group: r.status for r in report.rows if r.status != "ok"}}
    summary["load after"] = [round(x, 2) for x in os.getloadavg()]
    files.write_json(out / "hf_flattened.json", summary)
    files.write_text(out / "hf_flattened.md", to_markdown(summary))
    print(to_markdown(summary))
    return summary


def to_markdown(s: dict) -> str:
    rows = [{"family": name, "setting": c["group"], "speed-up vs HF flattened": f"{c['speed-up']:.2f}x",
             "FLOP-ratio bound": f"{c['FLOP-ratio bound']:.2f}" if c["FLOP-ratio bound"] else "-",
             "speed-up ÷ bound": f"{c['vs bound']:.2f}" if c["vs bound"] else "-",
             "fastzoo packed, share of GEMM peak": f"{c['packed share of GEMM peak']:.0%}" if c["packed share of GEMM peak"] else "-"}
            for name, f in s["families"].items() for c in f["comparisons"]]
    lines = ["# fastzoo packed vs HF's own packing (DataCollatorWithFlattening)", "",
             f"Device {s['device']}, {s['threads']} thread(s), load average before {s['load before']}, after {s['load after']}.",
             f"Peer: {s['peer']}. Bound: {s['bound']}. Same-run limits (GEMM peak per precision) in hf_flattened.json "
             "and each family's hf_flattened_<family>.md.", "", markdown_table(rows) if rows else "(no rows)", ""]
    for name, f in s["families"].items():
        lines.append(f"- {name}: {f['workload']}" + (f"; not ok: {f['rows']}" if f["rows"] else ""))
    lines += [f"- {name}: skipped, {why}" for name, why in s["skipped"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--size", choices=("bench", "tour", "quick"), help="the spec's workload (default: bench; --quick: quick)")
    args = p.parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, families=args.families, size=args.size, note=args.note,
        progress=not args.no_progress)
