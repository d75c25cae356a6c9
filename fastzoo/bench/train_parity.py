"""Accuracy parity: fine-tune one initialisation with every backend and compare.

Speed is worthless if a kernel changes what a model learns. From identical weights, data
and data order, a small ViT is trained for a few hundred steps on a synthetic task that
it can learn (which quadrant of a noisy image is brighter), once per attention
backend: fp32 on CPU, bf16 on GPU. Reported: the loss curves side by side (PNG) and the
final held-out accuracy. Backends agree if, against eager:

- final held-out accuracy within ``ACC_TOL`` (2 points fp32, 3 points bf16: a few
  held-out images flipping near the decision boundary), and
- final loss (mean of the last 10% of steps) within ``LOSS_TOL`` (0.05 fp32, 0.1 bf16):
  rounding differences compound over the run, but must not change where it ends.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import fastzoo
from fastzoo import files
from fastzoo.bench.harness import device_name, versions
from fastzoo.errors import BackendUnavailableError

ACC_TOL = {torch.float32: 0.02, torch.bfloat16: 0.03}
LOSS_TOL = {torch.float32: 0.05, torch.bfloat16: 0.1}
# Small enough to train a few hundred steps on a 2-core CPU in well under a minute.
SMALL_VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=4, global_pool="avg",
                 class_token=False)


def quadrant_task(n: int, g: torch.Generator, img_size: int = 32):
    """Noisy images (unit Gaussian) with one quadrant brightened by 1; the label is the quadrant.
    Needs the position embedding and attention across patches, and a small ViT learns it in ~300 steps."""
    labels = torch.randint(0, 4, (n,), generator=g)
    images = torch.randn(n, 3, img_size, img_size, generator=g)
    half = img_size // 2
    for i, q in enumerate(labels.tolist()):
        r0, c0 = (q // 2) * half, (q % 2) * half
        images[i, :, r0:r0 + half, c0:c0 + half] += 1.0
    return images, labels


@dataclass
class Run:
    backend: str
    status: str  # "ok" | "unavailable" | "disagrees"
    note: str = ""
    losses: list[float] = field(default_factory=list)
    accuracy: float | None = None
    final_loss: float | None = None


@dataclass
class TrainParityReport:
    model: str
    device: str
    dtype: str
    steps: int
    tolerance: str
    versions: dict
    runs: list[Run]

    @property
    def agree(self) -> bool:
        return all(r.status != "disagrees" for r in self.runs)

    def table(self) -> str:
        lines = ["| backend | status | final loss | held-out accuracy | note |", "|---|---|---|---|---|"]
        for r in self.runs:
            loss = f"{r.final_loss:.4f}" if r.final_loss is not None else "-"
            acc = f"{100 * r.accuracy:.1f}%" if r.accuracy is not None else "-"
            lines.append(f"| {r.backend} | {r.status} | {loss} | {acc} | {r.note} |")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        return (f"## Accuracy parity: {self.model}\n\nDevice **{self.device}**, {self.dtype}, {self.steps} steps from one "
                f"initialisation per backend. Tolerance vs eager: {self.tolerance}.\n\n{self.table()}\n")

    def write_json(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return files.write_json(path, {**asdict(self), "agree": self.agree})

    def plot(self, path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in self.runs:
            if r.losses:
                ax.plot(r.losses, label=f"{r.backend} (acc {100 * r.accuracy:.1f}%)", alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"{self.model}: one initialisation, every backend ({self.device}, {self.dtype})", fontsize=9)
        fig.tight_layout()
        files.save_figure(fig, path, dpi=110)
        plt.close(fig)
        return Path(path)


MODEL = "vit_s16"  # the family --parity-train fine-tunes (its small config: SMALL_VIT)


def check_model(name: str) -> None:
    """A UsageError unless ``name`` is of the family this fine-tune runs."""
    from fastzoo.errors import UsageError
    from fastzoo.registry import get_entry

    if get_entry(name).spec is not get_entry(MODEL).spec:
        raise UsageError(f"--parity-train is implemented for the ViT family; {name!r} is not a ViT")


def train_parity(
    backends: list[str],
    *,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 1e-3,
    device="cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    held_out: int = 512,
    progress: bool = True,
) -> TrainParityReport:
    """Fine-tune the small ViT with each backend from one initialisation (eager first: the reference)."""
    from tqdm.auto import tqdm

    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if dtype not in ACC_TOL:
        raise ValueError(f"dtype={dtype}: --parity-train runs in fp32 or bf16")
    if steps < 1:
        raise ValueError(f"steps={steps}: train at least one step")
    backends = ["eager"] + [b for b in backends if b != "eager"]
    g = torch.Generator().manual_seed(seed)
    train_x, train_y = quadrant_task(steps * batch_size, g)
    test_x, test_y = quadrant_task(held_out, g)
    torch.manual_seed(seed)
    init = fastzoo.create(MODEL, attn="eager", **SMALL_VIT).state_dict()
    runs = []
    for b in tqdm(backends, desc="parity-train", disable=not progress, leave=False):
        model = fastzoo.create(MODEL, attn="eager", **SMALL_VIT)
        model.load_state_dict(copy.deepcopy(init))
        try:  # a backend without a backward here fails at its first training forward
            model.set_attention(b, device=device, dtype=dtype)
            runs.append(_train(b, model.to(device), train_x, train_y, test_x, test_y, steps, batch_size, lr, device, dtype))
        except BackendUnavailableError as e:
            runs.append(Run(b, "unavailable", str(e).split(". Available on this machine")[0]))
    tail = max(1, steps // 10)
    ref = runs[0]
    for r in runs[1:]:
        if r.status != "ok":
            continue
        d_acc, d_loss = abs(r.accuracy - ref.accuracy), abs(r.final_loss - ref.final_loss)
        r.note = f"vs eager: accuracy {100 * d_acc:+.1f} points, final loss {d_loss:.2g}"
        if d_acc > ACC_TOL[dtype] or d_loss > LOSS_TOL[dtype]:
            r.status = "disagrees"
    tol = (f"held-out accuracy within {100 * ACC_TOL[dtype]:.0f} points, final loss (mean of last {tail} steps) "
           f"within {LOSS_TOL[dtype]}")
    return TrainParityReport("ViT " + ", ".join(f"{k}={v}" for k, v in SMALL_VIT.items()) + " on the quadrant task",
                             device_name(device), str(dtype).replace("torch.", ""), steps, tol, versions(), runs)


def _train(name, model, train_x, train_y, test_x, test_y, steps, batch_size, lr, device, dtype) -> Run:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    losses = []
    model.train()
    for i in range(steps):
        x = train_x[i * batch_size:(i + 1) * batch_size].to(device)
        y = train_y[i * batch_size:(i + 1) * batch_size].to(device)
        with autocast:
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad(), autocast:
        pred = torch.cat([model(test_x[j:j + 256].to(device)).argmax(-1).cpu() for j in range(0, len(test_x), 256)])
    tail = max(1, steps // 10)
    return Run(name, "ok", losses=losses, accuracy=(pred == test_y).float().mean().item(),
               final_loss=sum(losses[-tail:]) / tail)
