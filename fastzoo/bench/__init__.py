"""Speed and parity suite: which attention kernel (or loss implementation) should I use?

:mod:`fastzoo.bench.harness` times and parity-gates cases; one module per model family
builds its cases (``vit``, ``gpt2``, ``giou``, ``resnet``); :mod:`fastzoo.bench.cli` is
``fastzoo bench`` (``--parity-train``: :mod:`fastzoo.accuracy.backends`).
"""
from fastzoo.bench.harness import Case, Group, Report, Row, Stats, Step, Suite, Unavailable, measure, run_suite, speedup, summarize

__all__ = ["Case", "Group", "Report", "Row", "Stats", "Step", "Suite", "Unavailable", "measure", "run_suite", "speedup", "summarize"]
