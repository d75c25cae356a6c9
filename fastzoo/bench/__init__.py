"""Speed and parity suite: which attention kernel (or loss implementation) should I use?

:mod:`fastzoo.bench.harness` times and parity-gates cases; one module per task builds a
model's cases from its family's spec (``image_classification``, ``causal_lm``), one per loss
(``giou``, ``linear_ce``, ``matcher``); :mod:`fastzoo.bench.limits` measures the machine's
peak in the same run; :mod:`fastzoo.bench.cli` is ``fastzoo bench`` (``--parity-train``:
:mod:`fastzoo.accuracy.backends`).
"""
from fastzoo.bench.harness import Case, Group, Report, Row, Stats, Step, Suite, Unavailable, measure, run_suite, speedup, summarize

__all__ = ["Case", "Group", "Report", "Row", "Stats", "Step", "Suite", "Unavailable", "measure", "run_suite", "speedup", "summarize"]
