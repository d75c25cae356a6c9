"""Property: what fastzoo cannot take is refused by name. Config values just outside each declared
constraint (:func:`fuzzing.just_outside`: every bound, choice and type the config classes declare,
on top of a random valid config) raise ``ConfigError`` naming the field; bad forward inputs (wrong
dtype, rank or shape, ids / labels / positions out of range, malformed ``cu_seqlens``, masks that
are not 0/1) raise a ``ValueError`` naming the argument, and change nothing (train mode: no
BatchNorm statistic moved). NaN / inf images are the one input a convnet or ViT computes on:
each image is its own function, so a non-finite image gives non-finite logits for that image only
and leaves every other image's logits as a clean batch gives them (NaN where the clean batch's are).
A detector's padded images too, on each CPU backend that reads each image alone (all but varlen's
flex impl, one attention over the packed batch), the non-finite pixel in an image's padding
included (there a packed backend, which never reads padding, may keep that image finite).
"""
from __future__ import annotations


import pytest
import torch
from conftest import SPECS, backends
from fuzzing import fuzz_results  # noqa: F401 -- the results file's fixture
from fuzzing import configs, count, eval_anchors_free, examples, fail, image_sides, just_outside
from hypothesis import assume, given
from hypothesis import strategies as st

import fastzoo
from fastzoo.errors import BackendUnavailableError, ConfigError, FastzooError

FAMILIES = sorted(SPECS)


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _refused_by_name(prop, call, names: tuple[str, ...], *, kinds=(ValueError,)) -> str:
    """Run ``call``; it must raise one of ``kinds`` whose message names one of ``names``."""
    try:
        call()
    except kinds as e:
        if not any(n in str(e) for n in names):
            fail(prop, "bare_exceptions", f"{type(e).__name__} does not name {names}: {e}")
        return type(e).__name__
    except Exception as e:  # noqa: BLE001 -- any other exception is the failure this property looks for
        fail(prop, "bare_exceptions", f"bare {type(e).__name__} where a named refusal of {names} was due: {e}")
    fail(prop, "wrong_accepts", f"accepted; {names} should have been refused")


@pytest.mark.parametrize("family", FAMILIES)
@examples(ci=25, long=500)
@given(data=st.data())
def test_config_values_just_outside_a_constraint_are_refused_naming_the_field(family, data):
    spec = SPECS[family]
    field, bad = data.draw(st.sampled_from(just_outside(spec)), label="field, value")
    cfg = data.draw(configs(spec, small=True), label="valid config")
    name = spec.variants[0].name

    def call():
        fastzoo.create(name, device="meta", **{**cfg, field: bad})

    prop = f"invalid configs/{family}"
    try:
        call()
    except ConfigError as e:
        if field not in e.fields:
            fail(prop, "bare_exceptions", f"ConfigError names {e.fields}, not {field!r}: {e}")
    except Exception as e:  # noqa: BLE001
        fail(prop, "bare_exceptions", f"{field}={bad!r}: {type(e).__name__} where a ConfigError naming it was due: {e}")
    else:
        fail(prop, "wrong_accepts", f"{field}={bad!r} was accepted")
    count(f"invalid configs/{family}", examples=1, refused=1)


# -- bad inputs, per task --------------------------------------------------------------------------
def _image_bad(model, draw):
    cfg = model.config
    side = getattr(cfg, "img_size", None) or (32, 32)
    B = draw(st.integers(1, 3), label="batch")
    C = cfg.in_chans
    kinds = {
        "int images": lambda: torch.randint(0, 255, (B, C, *side)),
        "uint8 images": lambda: torch.randint(0, 255, (B, C, *side), dtype=torch.uint8),
        "bool images": lambda: torch.ones(B, C, *side, dtype=torch.bool),
        "complex images": lambda: torch.randn(B, C, *side, dtype=torch.complex64),
        "channels": lambda: torch.randn(B, C + draw(st.integers(1, 3)), *side),
        "rank 3": lambda: torch.randn(C, *side),
        "rank 5": lambda: torch.randn(1, B, C, *side),
        "not a tensor": lambda: torch.randn(B, C, *side).tolist(),
    }
    if getattr(cfg, "img_size", None) is not None:
        kinds["size"] = lambda: torch.randn(B, C, side[0] + draw(st.integers(1, 8)), side[1])
    kind = draw(st.sampled_from(sorted(kinds)), label="bad images")
    return kind, (lambda x=kinds[kind](): model(x)), ("images", "pixel_values", "input")


def _token_bad(model, draw):
    V, P = model.config.vocab_size, model.n_positions
    B, S = draw(st.integers(1, 3), label="batch"), draw(st.integers(1, min(P or 16, 16)), label="length")
    ids = torch.randint(0, V, (B, S))
    T = B * S
    cu = torch.tensor([0] + sorted(draw(st.lists(st.integers(1, T), min_size=0, max_size=3, unique=True)) + [T]))
    cu = torch.unique(cu).to(torch.int32)
    flat = ids.reshape(1, -1)
    kinds = {
        "ids past the vocabulary": (lambda: model(ids + V), "input_ids"),
        "negative ids": (lambda: model(ids - V - draw(st.integers(0, 5))), "input_ids"),
        "float ids": (lambda: model(ids.float()), "input_ids"),
        "bool ids": (lambda: model(ids > 0), "input_ids"),
        "ids of rank 1": (lambda: model(ids[0]), "input_ids"),
        "ids of rank 3": (lambda: model(ids[None]), "input_ids"),
        "mask of another shape": (lambda: model(ids, attention_mask=torch.ones(B, S + 1)), "attention_mask"),
        "mask of 2s": (lambda: model(ids, attention_mask=torch.full((B, S), 2)), "attention_mask"),
        "float mask of 0.5": (lambda: model(ids, attention_mask=torch.full((B, S), 0.5)), "attention_mask"),
        "labels of another shape": (lambda: model(ids, labels=ids[:, :-1] if S > 1 else ids[:, :0]), "labels"),
        "float labels": (lambda: model(ids, labels=ids.float()), "labels"),
        "labels past the vocabulary": (lambda: model(ids, labels=ids + V), "labels"),
        "negative labels other than -100": (lambda: model(ids, labels=ids - V - 1), "labels"),
        "positions of another shape": (lambda: model(ids, position_ids=torch.arange(S + 1)[None]), "position_ids"),
        "negative positions": (lambda: model(ids, position_ids=-1 - torch.arange(S)[None]), "position_ids"),
        "cu_seqlens int64": (lambda: model(flat, cu_seqlens=cu.long()), "cu_seqlens"),
        "cu_seqlens not ending at T": (lambda: model(flat, cu_seqlens=torch.cat([cu[:-1], cu[-1:] + 1])), "cu_seqlens"),
        "cu_seqlens decreasing": (lambda: model(flat, cu_seqlens=cu.flip(0)), "cu_seqlens"),
        "cu_seqlens not from 0": (lambda: model(flat, cu_seqlens=cu + 1), "cu_seqlens"),
        "cu_seqlens with a mask": (lambda: model(flat, cu_seqlens=cu, attention_mask=torch.ones_like(flat)), "attention_mask"),
        "max_seqlen too short": (lambda: model(flat, cu_seqlens=cu, max_seqlen=0), "max_seqlen"),
        "max_seqlen without cu_seqlens": (lambda: model(ids, max_seqlen=S), "max_seqlen"),
    }
    if P is not None:
        kinds["longer than n_positions"] = (lambda: model(torch.zeros(1, P + 1, dtype=torch.long)), "n_positions")
        kinds["positions past n_positions"] = (lambda: model(ids, position_ids=torch.arange(S)[None] + P), "position_ids")
    if S < 2:  # a one-token row's label is never read (it would be the second token's target)
        kinds = {k: v for k, v in kinds.items() if v[1] != "labels"}
    kind = draw(st.sampled_from(sorted(kinds)), label="bad input")
    call, name = kinds[kind]
    return kind, call, (name,)


def _detection_bad(model, draw):
    cfg = model.config
    B, C = draw(st.integers(1, 3), label="batch"), cfg.num_channels
    # big enough for a multi-scale detector's every level to keep two positions (GroupNorm cannot normalise one)
    m = getattr(model, "image_side_multiple", None) or 1  # a side the model takes (RF-DETR: its windows split it)
    side = -(-max(64, getattr(model, "min_image_side", 0)) // m) * m
    x, mask = torch.randn(B, C, side, side), torch.ones(B, side, side, dtype=torch.long)
    n = draw(st.integers(1, 4), label="boxes")
    i, j = draw(st.integers(0, B - 1), label="image"), draw(st.integers(0, n - 1), label="box")
    labels = [{"class_labels": torch.randint(0, cfg.num_labels, (n,)), "boxes": torch.rand(n, 4) * 0.5 + 0.25}
              for _ in range(B)]

    def box(value, coord=None):  # one coordinate of one box set to ``value``
        c = draw(st.integers(0, 3), label="coordinate") if coord is None else coord
        labels[i]["boxes"][j, c] = value
        return labels

    def with_(**t):
        labels[i] = {**labels[i], **t}
        return labels

    kinds = {
        "labels not a list": lambda: labels[0],
        "one label dict too few": lambda: labels[1:] if B > 1 else [],
        "one label dict too many": lambda: labels + labels[:1],
        "no boxes key": lambda: [dict(class_labels=t["class_labels"]) for t in labels],
        "'labels' for 'class_labels'": lambda: [dict(labels=t["class_labels"], boxes=t["boxes"]) for t in labels],
        "boxes of 3 coordinates": lambda: with_(boxes=labels[i]["boxes"][:, :3]),
        "boxes of rank 1": lambda: with_(boxes=labels[i]["boxes"].reshape(-1)),
        "int boxes": lambda: with_(boxes=labels[i]["boxes"].long()),
        "boxes not a tensor": lambda: with_(boxes=labels[i]["boxes"].tolist()),
        "box past 1": lambda: box(1.0 + draw(st.floats(1e-3, 10), label="by")),
        "negative box coordinate": lambda: box(-draw(st.floats(1e-3, 10), label="by")),
        "NaN box": lambda: box(float("nan")),
        "infinite box": lambda: box(draw(st.sampled_from([float("inf"), -float("inf")]))),
        "class id = num_labels": lambda: with_(class_labels=labels[i]["class_labels"].index_fill(0, torch.tensor([j]),
                                                                                                  cfg.num_labels)),
        "negative class id": lambda: with_(class_labels=labels[i]["class_labels"].index_fill(0, torch.tensor([j]), -1)),
        "float class ids": lambda: with_(class_labels=labels[i]["class_labels"].float()),
        "one class id too few": lambda: with_(class_labels=labels[i]["class_labels"][1:]),
    }
    masks = {
        "mask of another height": torch.ones(B, side - 1, side, dtype=torch.long),
        "mask of another batch": torch.ones(B + 1, side, side, dtype=torch.long),
        "mask of rank 4": mask[:, None],
    }
    kind = draw(st.sampled_from(sorted(kinds) + sorted(masks)), label="bad input")
    if kind in masks:
        return kind, (lambda: model(pixel_values=x, pixel_mask=masks[kind], labels=labels)), ("pixel_mask",)
    bad = kinds[kind]()
    return kind, (lambda: model(pixel_values=x, pixel_mask=mask, labels=bad)), ("labels",)


BAD_INPUTS = {"image-classification": _image_bad, "causal-lm": _token_bad, "detection": _detection_bad}
# a detector without an original has no transformers call convention to be fed through
INPUT_FAMILIES = [f for f in FAMILIES if SPECS[f].task.name in BAD_INPUTS
                  and (SPECS[f].task.name != "detection" or SPECS[f].original is not None)]


@pytest.mark.parametrize("family", INPUT_FAMILIES)
@examples(ci=25, long=500)
@given(data=st.data())
def test_bad_inputs_are_refused_naming_the_argument_and_change_nothing(family, data):
    spec = SPECS[family]
    cfg = data.draw(configs(spec, small=True), label="config")
    attn = data.draw(st.sampled_from(["eager", "sdpa"]), label="attn")
    try:
        model = fastzoo.create(spec.variants[0].name, attn=attn, **cfg)
    except BackendUnavailableError:  # refused by name at create (sdpa for soft-capped scores): eager serves every config
        model = fastzoo.create(spec.variants[0].name, attn="eager", **cfg)
    model.train()
    before = _state(model)
    kind, call, names = BAD_INPUTS[spec.task.name](model, data.draw)
    prop = f"invalid inputs/{family}"
    _refused_by_name(prop, call, names, kinds=(ValueError, FastzooError))
    after = model.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(after[k], v)]
    if changed:
        fail(prop, "half_loads", f"{kind}: a refused call changed {changed[:4]}")
    count(f"invalid inputs/{family}", examples=1, refused=1)


IMAGE_FAMILIES = [f for f in FAMILIES if SPECS[f].task.name in ("image-classification", "detection")]


def _per_image(model, x, mask):
    """What the model says of each image: its logits (a detector: class logits and boxes, side by side)."""
    if mask is None:
        return model(x)
    out = model(pixel_values=x, pixel_mask=mask)
    return torch.cat([out.logits, out.pred_boxes], -1)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
@examples(ci=8, long=200)
@given(data=st.data())
def test_a_non_finite_image_spoils_its_own_logits_only(family, data):
    spec = SPECS[family]
    detector = spec.task.name == "detection"
    cfg = data.draw(configs(spec, small=True), label="config")
    cfg = eval_anchors_free(cfg)
    model = fastzoo.create(spec.variants[0].name, **cfg).eval()
    if detector:  # padded images, and the non-finite pixel may be padding: each backend's own path
        # varlen's flex impl attends over the whole packed batch under a document mask: another image's NaN
        # reaches this one as 0 x NaN (fastzoo/attention/varlen.py says so); every other backend reads each image alone
        name, options = data.draw(st.sampled_from([b for b in backends(dtype=torch.float32) if b[1].get("impl") != "flex"]),
                                  label="attn")
        try:
            model.set_attention(name, **options)
        except BackendUnavailableError:
            assume(False)
    side = data.draw(image_sides(model), label="height, width") if detector else (
        getattr(model.config, "img_size", None) or (32, 32))
    B = data.draw(st.integers(2, 3), label="batch")
    x = torch.randn(B, getattr(model.config, "in_chans", None) or model.config.num_channels, *side,
                    generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    mask = None
    if detector:
        mask = torch.zeros(B, *side, dtype=torch.long)
        for i in range(B):
            mask[i, :data.draw(st.integers(1, side[0])), :data.draw(st.integers(1, side[1]))] = 1
    bad_image = data.draw(st.integers(0, B - 1), label="image")
    value = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]), label="value")
    where = tuple(data.draw(st.integers(0, n - 1)) for n in x.shape[1:])
    with torch.no_grad():
        clean = _per_image(model, x, mask)
        x[(bad_image, *where)] = value
        try:
            out = _per_image(model, x, mask)
        except ValueError as e:  # refusing is the other good answer, if it names the argument
            assert any(n in str(e) for n in ("images", "pixel_values")), e
            count(f"non-finite images/{family}", examples=1, refused=1)
            return
    others = [i for i in range(B) if i != bad_image]
    prop = f"non-finite images/{family}"
    if out.shape[-1] and torch.isfinite(out[bad_image]).all() and not detector:
        fail(prop, "mismatches", "a non-finite pixel gave finite logits")
    # equal_nan: a config can make every logit NaN, the clean batch's too (test_fuzz_found.py keeps one)
    if not torch.allclose(out[others], clean[others], atol=1e-5, rtol=0, equal_nan=True):
        fail(prop, "mismatches", "a non-finite image changed another image's logits")
    count(f"non-finite images/{family}", examples=1, isolated=1)
