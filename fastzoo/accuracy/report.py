"""What an accuracy-parity run found: per arm its curves and status (:class:`ArmResult`), the
run's :class:`AccuracyReport` (markdown table, JSON, PNG), and the table of every committed run
that the results README shows."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastzoo.accuracy.config import Arm, peers
from fastzoo.equivalence import LOW_FACTOR
from fastzoo.machine import device_name

@dataclass
class ArmResult:
    name: str
    # ok | drifts | disagrees | unavailable | control (a rounding control) | peer (the first arm in a low
    # precision) | unjudged (low precision without its peer); control and peer are reported, not judged
    status: str = "ok"
    note: str = ""
    train_loss: list = field(default_factory=list)
    eval_steps: list = field(default_factory=list)
    eval_loss: list = field(default_factory=list)
    eval_metric: list = field(default_factory=list)
    diff: dict = field(default_factory=dict)  # vs the first arm: max abs difference of each curve
    bound: dict = field(default_factory=dict)  # what each diff was judged against (the tolerance; low precision: the rule)
    first_over: int | None = None  # first step whose training loss is off the first arm's by more than the tolerance
    same_weights: dict = field(default_factory=dict)  # {"steps", "loss", "loss_diff", "grad_err"}: from the first arm's parameters
    seconds: float = 0.0

    @property
    def final_metric(self):
        return self.eval_metric[-1] if self.eval_metric else None


@dataclass
class AccuracyReport:
    config: dict
    metric: str
    device: str
    versions: dict
    arms: list
    threads: int = 1
    load: list = field(default_factory=list)  # 1-minute load average at the start and the end of the run
    pretrained: dict = field(default_factory=dict)  # the run file's pretrain: {"seconds", "accuracy" (its last batch)}

    @property
    def agree(self) -> bool:
        return all(a.status != "disagrees" for a in self.arms) and sum(a.status in ("ok", "drifts") for a in self.arms) >= 2

    def table(self) -> str:
        tol = self.config["tolerance"]
        goal = tol.get("metric_goal")
        lines = [f"| arm | status | final train loss | final held-out loss | held-out {self.metric} | "
                 f"max train-loss diff | max held-out loss diff | max {self.metric} diff | same weights: max loss / grad diff | time |",
                 "|---|" + "---|" * 9]
        for a in self.arms:
            if a.status == "unavailable":
                lines.append(f"| {a.name} | unavailable: {a.note} | - | - | - | - | - | - | - | - |")
                continue
            m = a.final_metric
            met = "" if goal is None or m is None else (" (goal met)" if m >= goal else f" (below the {100 * goal:.0f}% goal)")
            d = {key: _d(a, key, tol) for key in ("train_loss", "eval_loss", "eval_metric", "same_weights_loss", "same_weights_grad")}
            lines.append(f"| {a.name} | {a.status} | {a.train_loss[-1]:.4f} | {a.eval_loss[-1]:.4f} | "
                         f"{100 * m:.1f}%{met} | {d['train_loss']} | {d['eval_loss']} | {d['eval_metric']} | "
                         f"{d['same_weights_loss']} / {d['same_weights_grad']} | {a.seconds:.0f} s |")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        c, tol = self.config, self.config["tolerance"]
        sw = ("" if tol.get("same_weights_loss") is None and tol.get("same_weights_grad") is None else
              f"; from the first arm's weights (step 0 and every {c['eval_every']} steps): loss "
              f"{tol.get('same_weights_loss')}, gradients {tol.get('same_weights_grad')} (worst parameter, relative)")
        notes = "".join(f"\n- {a.name}: {a.status}: {a.note}" for a in self.arms if a.note)
        low = "" if not peers([Arm(**a) for a in c["arms"]]) else (
            f" An arm under autocast (amp) is held to {LOW_FACTOR:g}x the difference of its precision's peer (the first "
            f"arm's model in that precision) from the fp32 first arm, plus the fp32 tolerance (fastzoo.equivalence's rule).")
        return (f"### {c['name']}: {c['description']}\n\n"
                f"Device **{self.device}**, {self.threads} thread(s), load {' -> '.join(f'{x:.1f}' for x in self.load)}; "
                f"{c['steps']} steps, batch {c['optim']['batch_size']}, "
                f"AdamW lr {c['optim']['lr']}{_schedule(c['optim'])}, seed {c['seed']}; every arm from the same weights and batches. "
                f"Tolerance vs the first arm (max over the run): train loss {tol['train_loss']}, held-out loss "
                f"{tol['eval_loss']}, held-out {self.metric} {tol['eval_metric']}{sw}.{low}{self._pretrained()} "
                f"Agree: **{'yes' if self.agree else 'no'}**.\n\n{self.table()}\n{notes}\n")

    def _pretrained(self) -> str:
        p = self.config.get("pretrain")
        if not p or not self.pretrained:
            return ""
        return (f" The backbone was first trained here to classify single training digits on {p['img_size']}x"
                f"{p['img_size']} canvases ({p['steps']} steps, batch {p['batch_size']}, lr {p['lr']}: "
                f"{100 * self.pretrained['accuracy']:.0f}% on its last batch, {self.pretrained['seconds']:.0f} s), "
                f"then every arm started from it.")

    def to_dict(self) -> dict:
        return {"config": self.config, "metric": self.metric, "device": self.device, "threads": self.threads,
                "load": self.load, "pretrained": self.pretrained, "versions": self.versions, "agree": self.agree,
                "arms": [dataclasses.asdict(a) for a in self.arms]}

    def plot(self, path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax0, ax3, ax1, ax2) = plt.subplots(1, 4, figsize=(21, 3.8))
        ok = [a for a in self.arms if a.train_loss]
        for i, a in enumerate(ok):
            style = dict(lw=1.2, alpha=0.85, ls=["-", "--", ":", "-."][i % 4])
            ax0.plot(range(1, len(a.train_loss) + 1), a.train_loss, label=a.name, **style)
            ax3.plot(a.eval_steps, a.eval_loss, marker="o", ms=3, label=a.name, **style)
            ax1.plot(a.eval_steps, [100 * m for m in a.eval_metric], marker="o", ms=3, label=a.name, **style)
            if i:
                ref = ok[0]
                diff = [abs(x - y) for x, y in zip(a.train_loss, ref.train_loss)]
                ax2.semilogy(range(1, len(diff) + 1), [max(d, 1e-9) for d in diff], label=f"{a.name}: training loss", lw=1)
                steps = a.eval_steps[:len(ref.eval_steps)]
                for key, label in (("eval_loss", "held-out loss"), ("eval_metric", f"held-out {self.metric}")):
                    d = [max(abs(x - y), 1e-9) for x, y in zip(getattr(a, key), getattr(ref, key))]
                    ax2.semilogy(steps, d, marker="o", ms=3, lw=1, label=f"{a.name}: {label}")
                if a.same_weights:  # the same function: from the first arm's weights, the loss and the worst gradient
                    sw = a.same_weights
                    ax2.semilogy(sw["steps"], [max(d, 1e-9) for d in sw["loss_diff"]], marker="x", ls="none",
                                 label=f"{a.name}: same weights, loss")
                    ax2.semilogy(sw["steps"], [max(d, 1e-9) for d in sw["grad_err"]], marker="+", ls="none",
                                 label=f"{a.name}: same weights, worst gradient (relative)")
        ax2.axhline(self.config["tolerance"]["train_loss"], color="red", lw=1, ls="--", label="training-loss tolerance")
        ax0.set(xlabel="step", ylabel="training loss", yscale="log", title="training loss")
        ax3.set(xlabel="step", ylabel="held-out loss", yscale="log", title="held-out loss")
        ax1.set(xlabel="step", ylabel=f"held-out {self.metric} (%)", title=f"held-out {self.metric}")
        ax2.set(xlabel="step", ylabel=f"|arm - {ok[0].name if ok else 'first arm'}|",
                title="difference from the first arm")
        for ax in (ax0, ax3, ax1):
            ax.legend(fontsize=7)
        ax2.legend(fontsize=6, framealpha=0.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.suptitle(f"{self.config['name']} on {self.device}: same init, same batches, every arm", fontsize=10)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _schedule(o: dict) -> str:
    warm = f", {o['warmup_steps']} warm-up steps" if o.get("warmup_steps") else ""
    return (" cosine-decayed to 0" if o.get("schedule") == "cosine" else "") + warm


def _d(arm: ArmResult, key: str, tol: dict) -> str:
    """A diff cell; with its bound where that is not the file's tolerance (an arm in low precision)."""
    if key not in arm.diff:
        return "-"
    bound = arm.bound.get(key)
    return f"{arm.diff[key]:.1e}" + ("" if bound is None or bound == tol.get(key) else f" (<= {bound:.1e})")


def results_dir(device) -> Path:
    return Path("benchmarks") / "results" / device_name(torch.device(device)) / "accuracy"


# -- the results README's table -------------------------------------------------------------------
SUMMARY_BEGIN = "<!-- accuracy: generated from accuracy/*.json by benchmarks/accuracy_parity.py -->"
SUMMARY_END = "<!-- /accuracy -->"


def summary_table(folder) -> str:
    """One row per committed run (``<folder>/*.json``): steps, threads and load, each arm's status
    and final held-out metric, whether the arms agree. The results README shows it."""
    from fastzoo.text import markdown_table

    rows = []
    for path in sorted(Path(folder).glob("*.json")):
        r = json.loads(path.read_text())
        c, arms = r["config"], r["arms"]
        metric = lambda a: "-" if not a["eval_metric"] else f"{100 * a['eval_metric'][-1]:.2f}%"  # noqa: E731
        rows.append({
            "run": f"[{c['description']}]({Path(folder).name}/{path.stem}.md)",
            "steps": c["steps"],
            "threads, load": (f"{r['threads']}, {' -> '.join(f'{x:.1f}' for x in r['load'])}" if "load" in r
                              else "1, not recorded"),
            "arm: status": "; ".join(f"{a['name']}: {a['status']}" for a in arms),
            "final held-out metric": "; ".join(f"{a['name']} {metric(a)}" for a in arms if a["status"] != "unavailable"),
            "agree": "yes" if r["agree"] else "**no**",
        })
    return markdown_table(rows)


def update_summary(readme, folder) -> bool:
    """Rewrite the table between :data:`SUMMARY_BEGIN` and :data:`SUMMARY_END` in ``readme`` from
    ``folder``'s runs; False (nothing written) where the README has no such block."""
    from fastzoo import files

    readme = Path(readme)
    text = readme.read_text() if readme.exists() else ""
    if SUMMARY_BEGIN not in text or SUMMARY_END not in text:
        return False
    head, rest = text.split(SUMMARY_BEGIN, 1)
    files.write_text(readme, f"{head}{SUMMARY_BEGIN}\n{summary_table(folder)}\n{SUMMARY_END}{rest.split(SUMMARY_END, 1)[1]}")
    return True
