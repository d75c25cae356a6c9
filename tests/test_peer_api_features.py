"""timm's pruning and feature-extraction API on fastzoo's ViT and ResNet, against timm's model
on the same weights: ``prune_intermediate_layers`` and every ``features_only`` wrapper class,
and what ``feature_info`` names (channels, reductions, modules a hook can find).

Same tiny models and tolerance as tests/test_peer_api.py (fp32 CPU: 1e-4, fastzoo.equivalence's rule).
"""
from __future__ import annotations

import copy

import pytest
import timm
import torch

import fastzoo
from tests.test_peer_api import NARROW, RESNET_TINY, TOL, VIT_TINY, images, max_diff, pair


# -- prune_intermediate_layers ---------------------------------------------------------------
VIT_PRUNES = [dict(indices=1), dict(indices=[0, 1]), dict(indices=[-2], prune_norm=True),
              dict(indices=2, prune_head=False), dict(indices=[1], prune_norm=True, prune_head=False)]
RESNET_PRUNES = [dict(indices=1), dict(indices=[0, 2]), dict(indices=[-3], prune_norm=True),
                 dict(indices=[1, 3], prune_head=False), dict(indices=[0])]


@pytest.mark.parametrize("kind, pool, kwargs", [("vit", pool, k) for k in VIT_PRUNES for pool in ("token", "avg")]
                         + [("resnet", "avg", k) for k in RESNET_PRUNES])
def test_prune_intermediate_layers_equals_timms(kind, pool, kwargs):
    """The kept indices, the parameters left, and forward / forward_intermediates of the pruned
    model are timm's pruned model's (timm 1.0.29's semantics: ViT drops blocks, ResNet turns
    later stages into identities; prune_head leaves no pooling and no classifier)."""
    ref, m = _avg_vit_pair() if kind == "vit" and pool == "avg" else pair(kind)
    taken = m.prune_intermediate_layers(**kwargs)
    assert taken == ref.prune_intermediate_layers(**kwargs)
    assert sorted(m.state_dict()) == sorted(ref.state_dict())
    x = images(kind)
    assert max_diff(m(x), ref(x)) <= TOL
    for kw in (dict(indices=taken), dict(indices=taken, stop_early=True, intermediates_only=True)):
        assert max_diff(m.forward_intermediates(x, **kw), ref.forward_intermediates(x, **kw)) <= TOL
    assert m.num_features == ref.num_features and m.num_classes == ref.num_classes
    for info in m.feature_info:  # every entry still names a module of the pruned model
        m.get_submodule(info["module"])


def _avg_vit_pair():
    from tests.test_peer_api import timm_vit

    ref = timm_vit(global_pool="avg", class_token=False)
    return ref, fastzoo.create("vit_s16", pretrained=ref, global_pool="avg", class_token=False).eval()


@pytest.mark.parametrize("kind", ["vit", "resnet"])
def test_pruned_model_trains_with_grad_checkpointing_as_timms(kind):
    """A pruned ResNet has identity stages: grad checkpointing must step over them (timm's does);
    gradients of the kept layers equal timm's."""
    ref, m = pair(kind)
    for model in (ref, m):
        model.prune_intermediate_layers([1], prune_head=True)
        model.set_grad_checkpointing(True)
        model.train()
    x = images(kind)
    torch.manual_seed(0)
    m.forward_intermediates(x, indices=[1], intermediates_only=True)[0].square().sum().backward()
    torch.manual_seed(0)
    ref.forward_intermediates(x, indices=[1], intermediates_only=True)[0].square().sum().backward()
    theirs = dict(ref.named_parameters())
    for k, p in m.named_parameters():
        if theirs[k].grad is None:
            assert p.grad is None, k
            continue
        scale = theirs[k].grad.abs().max().clamp_min(1e-12)
        assert ((p.grad - theirs[k].grad).abs().max() / scale).item() <= 1e-4, k  # relative, as test_peer_api


def test_pruned_vit_saves_and_loads_as_the_pruned_network(tmp_path):
    """config.depth follows the pruned blocks, so save_pretrained -> create is the pruned network."""
    _, m = pair("vit")
    m.prune_intermediate_layers([1])  # keeps blocks 0 and 1
    m.save_pretrained(tmp_path / "pruned")
    back = fastzoo.create("vit_s16", pretrained=tmp_path / "pruned").eval()
    x = images("vit")
    assert len(back.blocks) == 2 and back.num_classes == 0
    assert max_diff(back(x), m(x)) <= TOL


@pytest.mark.parametrize("kind", ["vit", "resnet"])
def test_prune_rejects_indices_out_of_range(kind):
    _, m = pair(kind)
    n = len(m.feature_info)
    with pytest.raises(ValueError, match="indices"):
        m.prune_intermediate_layers([n])
    with pytest.raises(ValueError, match="indices"):
        m.prune_intermediate_layers(n + 1)
    classes = (VIT_TINY if kind == "vit" else RESNET_TINY)["num_classes"]
    assert len(m.feature_info) == n and m.num_classes == classes  # nothing pruned


# -- feature_info and features_only ----------------------------------------------------------
def _timm_features(kind: str, feature_cls: str, out_indices, ref):
    """timm.create_model(..., features_only=True) with ``ref``'s weights (its wrappers prefix the keys)."""
    name, kw = ("resnet50", {**RESNET_TINY, **NARROW}) if kind == "resnet" else ("vit_small_patch16_224", VIT_TINY)
    theirs = timm.create_model(name, pretrained=False, features_only=True, feature_cls=feature_cls, out_indices=out_indices, **kw)
    src = ref.state_dict()
    state = {}
    for k in theirs.state_dict():
        parts = k.split(".")
        key = next(".".join(parts[i:]) for i in range(len(parts)) if ".".join(parts[i:]) in src)
        state[k] = src[key]
    theirs.load_state_dict(state)
    return theirs.eval()


@pytest.mark.parametrize("feature_cls", ["list", "dict", "hook", "fx", "getter"])
@pytest.mark.parametrize("out_indices", [(0, 1, 2, 3, 4), (0, 3)])
def test_resnet_features_only_every_feature_cls_equals_timms(feature_cls, out_indices):
    """Each of timm's wrapper classes ('hook' and 'fx' find modules by feature_info's names)
    gives timm's feature maps, channels and reductions on the same weights."""
    ref, _ = pair("resnet")
    theirs = _timm_features("resnet", feature_cls, out_indices, ref)
    ours = fastzoo.create("resnet50", pretrained=ref, features_only=True, feature_cls=feature_cls,
                          out_indices=out_indices).eval()
    assert type(ours) is type(theirs)
    for attr in ("channels", "reduction"):
        assert getattr(ours.feature_info, attr)() == getattr(theirs.feature_info, attr)()
    x = images("resnet")
    a, b = ours(x), theirs(x)
    if isinstance(a, dict):
        assert len(a) == len(b)
        a, b = list(a.values()), list(b.values())
    assert max_diff(a, b) <= TOL


def test_resnet_feature_info_names_modules_that_compute_timms_features():
    """Code that hooks ``model.get_submodule(info.module_name()[i])`` (timm's FeatureHooks, user
    code) finds a real module of fastzoo's ResNet (the stem activation keeps torchvision's name
    ``relu`` where timm says ``act1``: the module names are torchvision's, see models/resnet.py),
    and that module outputs timm's feature map there."""
    ref, m = pair("resnet")
    ours_info = timm.models.FeatureInfo(m.feature_info, range(len(m.feature_info)))
    theirs_info = timm.models.FeatureInfo(ref.feature_info, range(len(ref.feature_info)))
    assert ours_info.channels() == theirs_info.channels()
    assert ours_info.reduction() == theirs_info.reduction()
    got = {}
    for name, model in (("ours", m), ("theirs", ref)):
        info = ours_info if name == "ours" else theirs_info
        for i, module_name in enumerate(info.module_name()):
            model.get_submodule(module_name).register_forward_hook(lambda mod, inp, out, i=i, n=name: got.setdefault((n, i), out))
        model(images("resnet"))
    for i in range(len(m.feature_info)):
        assert max_diff(got[("ours", i)], got[("theirs", i)]) <= TOL


def test_vit_feature_info_names_real_blocks():
    """ViT's feature_info lists one entry per block (timm's), each a module of the model."""
    ref, m = pair("vit")
    assert [d["module"] for d in m.feature_info] == [d["module"] for d in ref.feature_info]
    assert [(d["num_chs"], d["reduction"]) for d in m.feature_info] == [(d["num_chs"], d["reduction"]) for d in ref.feature_info]
    for d in m.feature_info:
        m.get_submodule(d["module"])
    hooked = _timm_features("vit", "getter", (0, 2), ref)
    ours = fastzoo.create("vit_s16", pretrained=ref, features_only=True, feature_cls="getter", out_indices=(0, 2)).eval()
    assert max_diff(ours(images("vit")), hooked(images("vit"))) <= TOL
    deep = copy.deepcopy(ours)  # EMA helpers deep-copy the wrapper too
    assert max_diff(deep(images("vit")), ours(images("vit"))) <= TOL
