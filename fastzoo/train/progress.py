"""Progress display: a tqdm bar with live loss and throughput, refreshed at log intervals,
and a ``log.jsonl`` line per interval (the machine-readable record tests and plots use).
When stderr is not a terminal the bar is off and each interval prints one plain line."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from fastzoo import files


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) and abs(v) >= 1e-3 else f"{v:.3e}"
    return str(v)


class Progress:
    def __init__(self, total_steps: int, start_step: int, log_path: Path | None, unit: str, enabled: bool = True):
        self.unit = unit
        self.enabled = enabled
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=None if enabled else True, file=sys.stderr)
        self.plain = enabled and self.bar.disable
        self.log_file = open(log_path, "a") if enabled and log_path is not None else None
        self._last_step = start_step
        self._last_time = time.perf_counter()

    def log(self, step: int, values: dict, items: float | None = None) -> dict:
        """Record the interval ending at ``step``; ``items`` processed give the throughput."""
        now = time.perf_counter()
        record = {"step": step, **values}
        if items is not None and now > self._last_time:
            record[f"{self.unit}_per_s"] = items / (now - self._last_time)
        if self.enabled:
            self.bar.update(step - self._last_step)
            shown = {k: _fmt(v) for k, v in record.items() if k != "step"}
            self.bar.set_postfix(shown, refresh=True)
            if self.plain:
                print(f"step {step}: " + "  ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
            self.write_record(record)
        self._last_step, self._last_time = step, now
        return record

    def write_record(self, record: dict) -> None:
        if self.log_file is not None:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text, file=sys.stderr if not self.plain else sys.stdout)

    def close(self) -> None:
        self.bar.close()
        if self.log_file is not None:
            self.log_file.close()


def trim_log(path: Path, last_step: int) -> int:
    """Drop the records of ``log.jsonl`` after step ``last_step`` (a run resumed from that
    step's checkpoint logs them again) and a last line cut off by a kill; rewritten
    atomically. Returns how many records were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record.get("step", 0)) <= last_step
        except (ValueError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        files.write_text(path, "".join(line + "\n" for line in kept))
    return dropped
