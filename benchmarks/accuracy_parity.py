#!/usr/bin/env python
"""Accuracy parity on real data: ``python benchmarks/accuracy_parity.py --config configs/accuracy_<run>.yaml``.
See :mod:`fastzoo.accuracy.runs`."""
import sys

from fastzoo.accuracy.cli import main

if __name__ == "__main__":
    sys.exit(main())
