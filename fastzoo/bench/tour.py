"""``fastzoo tour``: what fastzoo is for, measured on this machine in a few minutes.

For each of the four models, the tour builds the original (timm ``VisionTransformer``, Hugging
Face ``GPT2LMHeadModel``, ``torchvision.models.resnet50``, ``torchvision.ops``' GIoU loss)
with random weights (no hub), builds fastzoo from it, and runs one training step (forward +
backward) through :func:`fastzoo.bench.harness.run_suite`:

1. parity: every fastzoo path against the original in fp32 on identical weights and inputs
   (max |diff| of the logits / loss, and the worst parameter's relative gradient error; the
   rule of ``fastzoo check``); a path that fails is reported and not timed;
2. speed: each fastzoo path that passed, timed in the same run as what a user of the
   original writes (timm with its fused SDPA attention, HF padded to the longest sequence,
   torchvision, torchvision's GIoU on the concatenated real pairs);
3. the recommendation: per model, the fastest path that passed parity, as the
   ``attn=`` / ``loss=`` to pass here.

On CUDA the same suites run in bf16 (parity: 3x the original's own bf16 error, flash-attn's
rule) with every backend installed there. Sizes: ``full`` (the default; a 2-core CPU in
about two minutes) and ``tiny`` (seconds; what the tests run).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fastzoo import files
from fastzoo.bench.gpt2 import GPT2Setting
from fastzoo.bench.giou import GIoUSetting
from fastzoo.bench.harness import Case, Group, Report, Row, Suite, device_name, run_suite, versions
from fastzoo.bench.vit import ViTSetting


@dataclass(frozen=True)
class TourSize:
    vit: ViTSetting
    vit_batch: int
    gpt2: GPT2Setting
    resnet_img: int
    resnet_batch: int
    giou: GIoUSetting
    warmup: int
    iters: int


SIZES = {
    # Layer shapes of the real models, truncated in depth (step time is linear in depth, so
    # the ratios carry over); GPT-2 keeps its 50257-token vocabulary (its LM head is most of the
    # step). Small batches, sequences of at most 128 tokens and 160-pixel ResNet images keep the
    # whole tour under 3 minutes on a shared 2-core CPU.
    "full": TourSize(vit=ViTSetting("ViT-S/16 224, 4 of 12 layers", 224, 16, 384, 4, 6), vit_batch=4,
                     gpt2=GPT2Setting("GPT-2 4x256, 8 seqs of 1-128 tokens", 4, 256, 4, 8, 128),
                     resnet_img=160, resnet_batch=4, giou=GIoUSetting("256 images x 256 slots", 256, 256, 4),
                     warmup=1, iters=3),
    "tiny": TourSize(vit=ViTSetting("tiny ViT", 32, 8, 64, 1, 4, num_classes=10), vit_batch=4,
                     gpt2=GPT2Setting("tiny GPT-2", 1, 64, 4, 4, 32, vocab_size=256),
                     resnet_img=64, resnet_batch=2, giou=GIoUSetting("16 images x 16 slots", 16, 16, 4),
                     warmup=0, iters=1),
}


@dataclass
class Entry:
    """One model of the tour: its suite, which row is the original, which rows are fastzoo paths
    (label -> the code a user writes for it), and the group that decides the recommendation."""

    model: str
    original: str
    suite: Suite
    paths: dict[str, str]
    decisive_group: str


@dataclass
class Recommendation:
    model: str
    use: str  # the code to write, e.g. 'fastzoo.create("gpt2", attn="varlen") + fastzoo.data.pack(seqs)'
    row: Row | None
    peer: Row | None

    def line(self) -> str:
        if self.row is None:
            return f"{self.model}: no fastzoo path passed parity and ran here; see the table"
        r, p = self.row, self.peer
        vs = f"{r.speedup:.2f}x {p.label}" if r.speedup is not None and p is not None else "no timed original"
        grads = f", grads {r.grad_err:.0e}" if r.grad_err is not None else ""
        return f"{self.model}: {self.use}  ({vs}; parity: logits {r.max_err:.0e}{grads})"


# -- the four suites, configured for the tour ----------------------------------------------------
def _train_backends(device: torch.device) -> list[str]:
    """Attention backends that run and train on this device (eager, the reference, is never the answer)."""
    from fastzoo.attention import backend_class, list_attention

    return [b for b in list_attention(available_only=True)
            if b != "eager" and device.type in backend_class(b).capabilities.backward]


def _against_original(group: Group, fp32_group: Group, original: str) -> Group:
    """Parity against the original library's model in fp32 (not fastzoo's eager reference):
    the original, built by the same suite in fp32 from the same seed, is the reference; in the
    run dtype it is also the low-precision peer."""
    fp32_case = next(c for c in fp32_group.cases if c.label == original)
    cases = [replace(c, reference=c.label == original) for c in group.cases]
    return replace(group, cases=cases, reference=lambda: fp32_case.build().outputs())


def _vit(size: TourSize, device, dtype) -> Entry:
    from fastzoo.bench.vit import vit_suite

    backends = _train_backends(device)
    original = "timm (sdpa)"

    def suite(dt):
        return vit_suite([size.vit], backends=backends, modes=("train",), batch_size=size.vit_batch, device=device,
                         dtype=dt, masks=False)

    s, ref = suite(dtype), suite(torch.float32)
    keep = {original} | {f"fastzoo {b}" for b in backends}
    groups = [_against_original(replace(g, cases=[c for c in g.cases if c.label in keep]), rg, original)
              for g, rg in zip(s.groups, ref.groups) if any(c.label == original for c in rg.cases)]
    paths = {f"fastzoo {b}": f'fastzoo.create("vit_b16", attn="{b}", pretrained=timm_model)' for b in backends}
    return Entry("vit", original, replace(s, groups=groups), paths, groups[0].name)


def _gpt2(size: TourSize, device, dtype) -> Entry:
    from fastzoo.attention import backend_class
    from fastzoo.bench.gpt2 import gpt2_suite

    backends = _train_backends(device)
    original = "HF padded to longest (sdpa)"

    def suite(dt):
        return gpt2_suite(size.gpt2, backends=backends, modes=("train",), device=device, dtype=dt)

    s, ref = suite(dtype), suite(torch.float32)
    if s.skipped:
        return Entry("gpt2", original, s, {}, "")
    paths = {}
    for b in backends:
        caps = backend_class(b).capabilities
        if b == "nested":
            paths["fastzoo nested"] = 'fastzoo.create("gpt2", attn="nested") on fastzoo.data.nested(seqs)'
            continue
        if caps.varlen:
            paths[f"fastzoo packed ({b})"] = f'fastzoo.create("gpt2", attn="{b}") on fastzoo.data.pack(seqs)'
        if caps.padding_mask:
            paths[f"fastzoo padded to longest ({b})"] = (f'fastzoo.create("gpt2", attn="{b}") on '
                                                        'fastzoo.data.pad_to_longest(seqs)')
    keep = {original, *paths}
    groups = [_against_original(replace(g, cases=[c for c in g.cases if c.label in keep]), rg, original)
              for g, rg in zip(s.groups, ref.groups) if any(c.label == original for c in rg.cases)]
    return Entry("gpt2", original, replace(s, groups=groups), paths, groups[0].name)


def _resnet(size: TourSize, device, dtype) -> Entry:
    from fastzoo.bench.resnet import resnet_suite

    low = dtype != torch.float32
    # On CUDA both sides run channels_last + bf16 autocast (how CNNs train there); on CPU plain fp32.
    s = resnet_suite(modes=("train",), channels_last=(device.type == "cuda",), bf16=(low,),
                     batch_size=size.resnet_batch, img_size=size.resnet_img, device=device)
    use = 'fastzoo.create("resnet50", pretrained=torchvision_model' + (", channels_last=True)" if device.type == "cuda" else ")")
    return Entry("resnet50", "torchvision", s, {"fastzoo": use}, s.groups[0].name if s.groups else "")


def _giou(size: TourSize, device, dtype) -> Entry:
    from fastzoo.bench.giou import giou_suite

    s = giou_suite(size.giou, device=device, dtype=dtype)
    modes = {"fastzoo per-sample loop": "per_sample", "fastzoo concat": "concat", "fastzoo padded": "padded",
             "fastzoo padded kernel (validity from target)": "kernel"}
    paths = {label: f'fastzoo.create("boxdet_r50", loss="{m}")' for label, m in modes.items()}
    paths["fastzoo kernel"] = 'fastzoo.losses.giou_loss_kernel(pred[mask], target[mask])'
    paths["fastzoo padded kernel (mask)"] = 'fastzoo.losses.giou_loss_padded(pred, target, mask)'
    paths["fastzoo kernel (pairs given)"] = 'fastzoo.losses.giou_loss(pred, target, impl="kernel")'
    return Entry("boxdet_r50 (GIoU loss)", "torchvision on concatenated real pairs", s, paths, s.groups[0].name)


# -- running and reporting ----------------------------------------------------------------------
@dataclass
class TourResult:
    report: Report
    entries: list[Entry]
    recommendations: list[Recommendation]
    date: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.report.ok and not any(r.status == "failed parity" for r in self.report.rows)

    def summary_rows(self) -> list[dict]:
        out = []
        for e, rec in zip(self.entries, self.recommendations):
            r, p = rec.row, rec.peer
            out.append({
                "model": e.model,
                "original (what its users run)": e.original,
                "fastzoo here": rec.use if r is not None else "-",
                "logits max abs diff": f"{r.max_err:.1e}" if r is not None and r.max_err is not None else "-",
                "grads (max rel. diff)": f"{r.grad_err:.1e}" if r is not None and r.grad_err is not None else "-",
                "original step": _ms(p),
                "fastzoo step": _ms(r),
                "speed-up": f"**{r.speedup:.2f}x**" if r is not None and r.speedup is not None else "-",
            })
        return out

    def header(self) -> str:
        rep = self.report
        return (f"fastzoo tour on **{rep.device}** ({rep.threads} torch threads), {rep.dtype}, {self.date}; "
                f"one training step (forward + backward), median of {rep.iters} after {rep.warmup} warm-up; "
                f"torch {rep.versions.get('torch')}; {self.seconds:.0f} s in all.")

    def summary_table(self) -> str:
        from fastzoo.text import markdown_table

        return markdown_table(self.summary_rows())

    def to_markdown(self) -> str:
        lines = ["## fastzoo tour", "", self.header(), "", self.summary_table(), "", "Use here:", ""]
        lines += [f"- `{rec.line()}`" for rec in self.recommendations]
        lines += ["", "### Every path measured", "", self.report.table(), "",
                  "Configs: " + "; ".join(f"{k}: {v}" for k, v in self.report.config.items()), ""]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"date": self.date, "seconds": self.seconds, **self.report.to_dict(),
                "recommendations": [{"model": r.model, "use": r.use, "label": r.row.label if r.row else None,
                                     "speedup": r.row.speedup if r.row else None, "line": r.line()}
                                    for r in self.recommendations]}


def _ms(r: Row | None) -> str:
    return f"{r.median_s * 1e3:.3g} ms" if r is not None and r.median_s is not None else "-"


def recommend(entry: Entry, rows: list[Row]) -> Recommendation:
    """The fastest fastzoo path of the decisive setting that passed parity (and was timed)."""
    rows = [r for r in rows if r.group == entry.decisive_group]
    peer = next((r for r in rows if r.peer), None)
    ok = [r for r in rows if r.label in entry.paths and r.status == "ok" and r.median_s is not None]
    best = min(ok, key=lambda r: r.median_s, default=None)
    return Recommendation(entry.model, entry.paths[best.label] if best else "-", best, peer)


def build_entries(size: str = "full", device="cpu", dtype: torch.dtype | None = None) -> list[Entry]:
    if size not in SIZES:
        raise ValueError(f"size={size!r}: choose one of {', '.join(SIZES)}")
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    s = SIZES[size]
    return [_vit(s, device, dtype), _gpt2(s, device, dtype), _resnet(s, device, dtype), _giou(s, device, dtype)]


def run_tour(size: str = "full", *, device="cpu", dtype: torch.dtype | None = None, progress: bool = True) -> TourResult:
    import time
    import warnings

    from tqdm.auto import tqdm

    # The table says what ran; PyTorch's multi-line warning about uncompiled flex would bury the bar.
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype")
    t0 = time.perf_counter()
    device = torch.device(device)
    entries = build_entries(size, device, dtype)
    s = SIZES[size]
    total = sum(len(g.cases) for e in entries for g in e.suite.groups)
    reports = []
    with tqdm(total=total, desc="fastzoo tour", disable=not progress, dynamic_ncols=True, leave=False) as bar:
        for e in entries:
            bar.set_description(f"fastzoo tour: {e.model}")
            reports.append(run_suite(e.suite, warmup=s.warmup, iters=s.iters, bar=bar, interleave=device.type == "cpu"))
    first = reports[0]
    config = {f"{e.model}": "; ".join(f"{k} {v}" for k, v in rep.config.items()) for e, rep in zip(entries, reports)}
    skipped = [f"{e.model}: {rep.skipped}" for e, rep in zip(entries, reports) if rep.skipped]
    report = Report("fastzoo tour", first.device, first.dtype, config, s.warmup, s.iters, versions(), torch.get_num_threads(),
                    [r for rep in reports for r in rep.rows], "; ".join(skipped) or None)
    recs = [recommend(e, rep.rows) for e, rep in zip(entries, reports)]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return TourResult(report, entries, recs, date, time.perf_counter() - t0)


def write(result: TourResult, out_dir) -> dict[str, Path]:
    """``tour.md``, ``tour.json`` and the chart ``tour.png`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "tour.md", "json": out / "tour.json", "chart": out / "tour.png"}
    files.write_text(paths["markdown"], result.to_markdown())
    files.write_json(paths["json"], result.to_dict())
    result.report.plot(paths["chart"])
    return paths


def default_out_dir(device) -> Path:
    return Path("fastzoo-tour") / device_name(device)


# -- command line -------------------------------------------------------------------------------
def add_args(p) -> None:
    p.description = "Parity and speed of all four models against their originals on this machine, in minutes."
    p.add_argument("--size", choices=tuple(SIZES), default="full", help="full: the real layer shapes, truncated in depth; "
                   "tiny: seconds, for a smoke test")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", help="folder for tour.md, tour.json and the chart tour.png (default: fastzoo-tour/<device>)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_tour(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_tour(args.size, device=device, progress=not args.no_progress)
    paths = write(result, args.out or default_out_dir(device))
    print(result.header() + "\n")
    print(result.summary_table() + "\n")
    for rec in result.recommendations:
        print(rec.line())
    print(f"\nchart: {paths['chart']}   every row: {paths['markdown']}   data: {paths['json']}")
    return 0 if result.ok else 1
