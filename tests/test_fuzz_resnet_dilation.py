"""Property: a dilated ResNet (``output_stride`` 16 or 8) of any block kind, depth, grouping, width,
classifier and pooling computes its original's function (torchvision's ``replace_stride_with_dilation``
for bottlenecks, timm's ``output_stride`` for basic blocks, which torchvision cannot dilate), logits
and every gradient, in eval and train mode, on images of any size.

The family's general property (``test_fuzz_equivalence.py``) draws ``output_stride`` with every other
field, where small widths send most draws to transformers' ResNet, which has no dilation; here the
stage widths and input channels are the originals' and the rest is drawn.
"""
from __future__ import annotations

import torch
from conftest import SPECS
from fuzzing import configs, count, examples, fail, fuzz_results  # noqa: F401 -- the results file's fixture
from hypothesis import assume, given
from hypothesis import strategies as st

import fastzoo
from fastzoo import equivalence
from fastzoo.errors import CheckpointError

ORIGINALS = dict(channels=(64, 128, 256, 512), in_chans=3, stem_width=None, out_channels=None, hf_config=None)


@examples(ci=6, long=200)
@given(data=st.data())
def test_dilated_resnet_equals_the_original_for_any_config(data):
    spec = SPECS["resnet"]
    output_stride = data.draw(st.sampled_from([16, 8]), label="output_stride")
    # two blocks a stage at most: a dilated stage's first block keeps the previous dilation, the next do not
    cfg = data.draw(configs(spec, base=dict(layers=(2, 2, 2, 2)), fixed=dict(ORIGINALS, output_stride=output_stride)),
                    label="config")
    try:
        ref = spec.original.build(cfg)
    except ValueError:  # torchvision's bottleneck ResNet has no headless form (num_classes=0)
        count("equivalence/resnet dilated", original_refused=1)
        assume(False)
    weights_seed = data.draw(st.integers(0, 2**16), label="weights seed")
    equivalence.draw_(ref, seed=weights_seed)
    try:
        ours = fastzoo.create("resnet50", pretrained=ref)
    except CheckpointError as e:  # refused by name (timm's unpooled head, global_pool='', is not read): no comparison
        assert "global_pool" in str(e), e
        count("equivalence/resnet dilated", create_refused=1)
        assume(False)
    if ours.config.output_stride != output_stride:
        fail("equivalence/resnet dilated", "mismatches", f"read output_stride={ours.config.output_stride} from the "
             f"original of output_stride={output_stride}")
    train = data.draw(st.booleans(), label="train mode")
    ref.train(train), ours.train(train)
    B, H, W = data.draw(st.integers(1, 3), label="batch"), data.draw(st.integers(24, 72)), data.draw(st.integers(24, 72))
    x = torch.randn(B, 3, H, W, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    if train and B == 1:
        assume(False)  # train-mode BatchNorm of one value a channel (a 1x1 map of one image): torch refuses it
    r, o = ref(x), ours(x)
    case = f"config {cfg}, {equivalence.describe(weights_seed)}"
    c = equivalence.compare_outputs("logits", o, r)
    if not c.passed:
        fail("equivalence/resnet dilated", "mismatches", f"{case}: logits {c.err:.3g} apart > {c.bound:.3g}")
    w = torch.randn(r.shape, generator=torch.Generator().manual_seed(1))
    (r * w).sum().backward()
    (o * w).sum().backward()
    # the same names (torchvision's); a gradient on one side only is a failure (compare_grads: inf)
    theirs = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    mine = {k: p.grad for k, p in ours.named_parameters() if p.grad is not None}
    c = equivalence.compare_grads("grads", mine, theirs)
    if not c.passed:
        fail("equivalence/resnet dilated", "mismatches", f"{case}: {c.worst} gradient {c.err:.3g} apart (relative)")
    count("equivalence/resnet dilated", examples=1, cases=1)
