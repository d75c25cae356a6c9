"""Accuracy parity: does a fast kernel, layout or precision change what a model learns? Training
runs compared arm by arm (:mod:`fastzoo.accuracy.runs`), judged by :mod:`fastzoo.equivalence`'s rule."""
