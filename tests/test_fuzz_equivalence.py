"""Property: for any valid small config and any valid input, fastzoo computes the original's
function on every CPU attention backend that accepts the request, and a backend that cannot
serve it refuses by name, at ``set_attention`` / ``create`` for what the model's config asks and
per call only for what the call adds (packed input, a KV cache, a backward), exactly where its
declared capabilities say it cannot.

Configs come from the spec's declarations (:mod:`fuzzing`), inputs from the family's task: images
of the config's size (any size for a convnet); token batches of lengths 1..S, padded on the left or
right or not at all, packed (sequences of length 1 included), or a prefix then the rest through
the KV cache (left padding, positions from the mask as ``generate`` makes them), with or without
``labels``, in eval or (the fused LM-head loss) train mode. Precision: fp32, or bf16 autocast
for fastzoo and, as the peers that set the tolerance, for the original on its reference kernels and
on its users' (``fastzoo.equivalence.rule``). Outputs, loss and
gradients are judged by ``fastzoo.equivalence``'s rule (fp32: 1e-4, or 3x the original's own fp32
error where larger, measured by its fp64 run and its runs on its users' kernels; bf16: 3x the original's own
bf16 error + floor), on weights drawn by ``fastzoo.equivalence.draw_`` (every bias, norm gain,
BatchNorm statistic and embedding: a library's init hides bugs), named in a failure's message. The
bf16 loss is compared too (``equivalence.compare_loss``: the original's own error on one number
can cancel by chance, so half a bf16 unit of the loss is added to the bound), and bf16 gradients of
every model, ReLU nets included. A non-finite reference value (output, loss or gradient) must be
the same kind (NaN, +inf, -inf) at the same place in fastzoo's, and every finite value is still
compared. A kernel is judged against the original only. A backend refusing at ``set_attention``
counts as a refusal where its declared capabilities say it cannot serve the model, else it fails.
With left padding the first real token's
label is -100: transformers scores it from the last pad's output, a fully masked attention row
whose value depends on the attention implementation (fastzoo never predicts across a sequence's
start, so its loss leaves that term out). Where the original's padded output is not finite (an
``rms_norm_eps`` that is 0 in fp32 makes a pad's hidden state NaN, and a masked key's NaN value
reaches the real tokens as 0 x NaN), a backend that never reads padding (packed: varlen, nested)
computes each sequence's own function: its outputs are then compared with the original run on
each sequence alone (at the same positions), and the original's non-finite loss is not compared.
Where a real token is itself non-finite in the original (that pad embedding's id inside a
sequence), a backend that attends over the whole packed row under a document mask (eager, sdpa,
flex, varlen's flex impl) carries it to the row's other sequences as 0 x NaN, as transformers'
own packed batches do (``fastzoo/attention/packing.py``); that case is counted, not compared.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import SPECS, backends
from fuzzing import fuzz_results  # noqa: F401 -- the results file's fixture
from fuzzing import count, examples, fail, non_default, undeclared_refusal
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

import fastzoo
from fastzoo import equivalence
from fastzoo.attention import get_backend
from fastzoo.attention.sdpa import on_math_kernel
from fastzoo.data import pack
from fastzoo.errors import BackendUnavailableError, CheckpointError
from fastzoo.layers.attention import UsesAttention
from fastzoo.weights import Source, find_converter

TASKS = ("image-classification", "causal-lm")
FAMILIES = [f for f, s in SPECS.items() if s.original is not None and s.task.name in TASKS]
CPU_BACKENDS = backends()  # every backend and declared variant that runs on this CPU, forward-only ones too
MAX_LEN = 24  # tokens per sequence (bounded by n_positions where the model has one)


# -- running one model ----------------------------------------------------------------------------
def _autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def _run(model, call, *, precision: str, grads: bool, seed: int):
    """``call(model)`` -> (rows [N, C] fp32 compared, scalar loss or None); with ``grads`` the
    parameter gradients of the loss (when there is one) or of a fixed random projection of the rows."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads), _autocast(precision):
        rows, loss = call(model)
    wide = lambda t: t.to(torch.promote_types(t.dtype, torch.float32))  # noqa: E731 -- fp64 runs keep their digits
    rows = None if rows is None else wide(rows)
    g = {}
    if grads:
        target = loss if loss is not None else (rows * torch.randn(rows.shape, generator=torch.Generator().manual_seed(seed),
                                                                  dtype=torch.float32).to(rows.dtype)).sum()
        wide(target).backward()
        g = {n: wide(p.grad.detach()) for n, p in model.named_parameters() if p.grad is not None}
    return (None if rows is None else rows.detach(), None if loss is None else wide(loss.detach()).reshape(1), g)


def exact_run(ref, call, grads: bool, seed: int):
    """The original's run in fp64 on its own weights (a copy), as ``_run``: its outputs, loss and gradients
    as the fp32 rule's measure of the original's own rounding; (None, None, None) where it cannot run in
    fp64 (nothing measured: nothing widened)."""
    exact = copy.deepcopy(ref).double()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # tensors an original makes in the default dtype (masks, positions)
    try:
        return _run(exact, call, precision="fp64", grads=grads, seed=seed)
    except Exception:  # noqa: BLE001 -- a layer without an fp64 kernel: the fixed fp32 tolerance alone
        return None, None, None
    finally:
        torch.set_default_dtype(default)


def _in_fastzoo_names(spec, ours, grads: dict) -> dict:
    own = {n for n, _ in ours.named_parameters()}
    conv = find_converter(spec, Source(grads, "the original's gradients"))
    return {k: v for k, v in conv.to_fastzoo(grads).items() if k in own}


def projected_grads(spec, ours, model, ids: torch.Tensor, *, precision: str = "fp32", seed: int = 7) -> dict:
    """The property's gradients of ``model`` (fastzoo's, or the original's in fastzoo's names): of a fixed random
    projection of its logits on ``ids``, in ``precision`` (fp64: the original's fp64 run, as ``exact_run``)."""
    call = lambda m: (m(ids).logits.flatten(0, 1), None)  # noqa: E731
    grads = (exact_run(model, call, True, seed) if precision == "fp64" else
             _run(model, call, precision=precision, grads=True, seed=seed))[2]
    return grads if model is ours else _in_fastzoo_names(spec, ours, grads)


# -- inputs per task --------------------------------------------------------------------------------
@st.composite
def image_case(draw, model, inputs: tuple[int, int]):
    """``inputs`` (a range) batches of images, each a case against the original (the models are built once)."""
    cfg = model.config
    cases = []
    for _ in range(draw(st.integers(*inputs), label="inputs")):
        side = getattr(cfg, "img_size", None)
        if side is None:  # a convnet takes any size
            # from 32 px: torch 2.14's CPU bf16 backward of a grouped stride-2 conv on a 1x1 map reads
            # uninitialised memory (weight gradients ~1e25 from the second call on; torchvision's too)
            side = (draw(st.integers(32, 48), label="height"), draw(st.integers(32, 48), label="width"))
        batch = draw(st.integers(1, 3), label="batch")
        seed = draw(st.integers(0, 2**16), label="input seed")
        x = torch.randn(batch, cfg.in_chans, *side, generator=torch.Generator().manual_seed(seed))

        def call(m, x=x, batch=batch):  # in the model's dtype: the original's fp64 run too
            return equivalence.logits_of(m(x.to(next(m.parameters()).dtype))).reshape(batch, -1), None

        cases.append(("images", call, call, {"grads": True}))
    return cases


def _lengths(draw, S, batch):
    return [draw(st.integers(1, S), label=f"length {i}") for i in range(batch)]


@st.composite
def token_case(draw, model, train: bool):
    cfg = model.config
    S = min(MAX_LEN, model.n_positions or MAX_LEN)
    batch = draw(st.integers(1, 3), label="batch")
    form = draw(st.sampled_from(["padded", "full", "packed"] + (["cache"] if S >= 2 else [])), label="form")
    labels = draw(st.booleans(), label="labels") if form != "cache" else False
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16), label="input seed"))
    if train and form != "cache":
        labels = True  # train mode: the fused LM-head loss
    if form == "full":
        lengths = [S] * batch
    else:
        lengths = _lengths(draw, S, batch)
    if form == "cache":
        lengths = [max(n, 2) for n in lengths]
    left = form == "cache" or (form == "padded" and draw(st.booleans(), label="left padding"))
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    width = max(lengths) if form != "full" else S
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, span], mask[i, span] = s, 1
    keep = mask.bool().reshape(-1)
    lab = ids.masked_fill(mask == 0, -100)
    if left:  # transformers scores a left-padded row's first token from the last pad's output (see the docstring)
        lab[torch.arange(batch), width - torch.tensor(lengths)] = -100
    if form == "padded" and not left and draw(st.booleans(), label="labels at padding too"):
        lab = ids.clone()  # transformers then also scores pad -> pad; fastzoo's pads predict nothing
        lab[:, 1:][mask[:, :-1] == 0] = -100  # ... so the original is given those targets as ignored
    mask_arg = None if form == "full" else mask
    positions = None
    if left and draw(st.booleans(), label="positions from the mask"):
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # transformers' generate

    def alone_call(m, pos=None):  # each sequence without its padding, at the positions the batch gives it
        at = pos if pos is not None else positions if positions is not None else torch.arange(width).expand(batch, width)
        rows = [m(ids[i][mask[i].bool()][None], position_ids=at[i][mask[i].bool()][None]).logits[0] for i in range(batch)]
        return torch.cat(rows), None

    def padded_call(m):
        kw = dict(attention_mask=mask_arg, position_ids=positions)
        if labels:
            kw["labels"] = lab
        out = m(ids, **kw)
        logits = out.logits
        rows = None if logits is None else logits.reshape(-1, logits.shape[-1])[keep]
        return rows, out.loss if labels else None

    if form in ("padded", "full"):
        return [(form + (" left" if left else ""), padded_call, padded_call,
                 {"grads": True, "mask": form == "padded", "alone": alone_call if form == "padded" else None})]
    if form == "packed":
        packed = pack(seqs)

        def packed_call(m):
            out = m(packed.input_ids, position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens,
                    max_seqlen=packed.max_seqlen, **({"labels": packed.input_ids} if labels else {}))
            logits = out.logits
            return (None if logits is None else logits.reshape(-1, logits.shape[-1])), out.loss if labels else None

        return [("packed", packed_call, padded_call, {"grads": True, "packed": True, "alone": alone_call})]
    # cache: a prefix, then the rest of the tokens through the KV cache
    k = draw(st.integers(1, width - 1), label="prefix") if width > 1 else 1
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)

    def cache_call(m):
        first = m(ids[:, :k], attention_mask=mask[:, :k], position_ids=pos[:, :k], use_cache=True)
        second = m(ids[:, k:], attention_mask=mask, position_ids=pos[:, k:], past_key_values=first.past_key_values,
                   use_cache=True)
        logits = torch.cat([first.logits, second.logits], dim=1)
        return logits.reshape(-1, logits.shape[-1])[keep], None

    def whole_call(m):  # the reference: the whole batch in one call, no cache
        logits = m(ids, attention_mask=mask, position_ids=pos).logits
        return logits.reshape(-1, logits.shape[-1])[keep], None

    return [("cache", cache_call, whole_call, {"grads": False, "cache": True, "mask": True,
                                               "alone": lambda m: alone_call(m, pos)})]


def kinds_are_rounding(ref: tuple, peers: list[tuple]) -> bool:
    """Whether the original's own low-precision runs ``peers`` (rows, loss, gradients) give NaN, +inf or
    -inf at other places than its fp32 run ``ref``: which values overflow, and to which infinity, is then
    the rounding of values near 0 or near the dtype's largest (Granite's ``logits_scaling`` of 1e-40:
    a logit within bf16's rounding of 0 becomes +inf in fp32 and -inf in bf16), and another kernel's
    rounding flips others (flex's, where transformers' eager and SDPA agree). The original does not
    compute such a case stably in the dtype: it is counted, not compared."""
    from fastzoo.equivalence import nonfinite_difference

    def differ(a, b):
        return a is not None and b is not None and a.shape == b.shape and bool(nonfinite_difference(a, b))

    rows, loss, grads = ref
    return any(differ(q_rows, rows) or differ(q_loss, loss) or any(differ(q_grads.get(n), g) for n, g in grads.items())
               for q_rows, q_loss, q_grads in peers)


# the backends whose packed rows are attended sequence by sequence (every other one runs one dense attention over
# the packed row under a document mask: a non-finite value of one sequence reaches the others as 0 x NaN)
READS_EACH_SEQUENCE_ALONE = {("varlen", None), ("varlen", "cpu"), ("nested", None)}


def _allowed(caps, needs: dict, grads: bool) -> tuple[bool, str]:
    """Whether the backend's declared capabilities say it serves this call; why not."""
    if needs.get("packed") and not caps.varlen:
        return False, "no varlen"
    if needs.get("mask") and not (caps.padding_mask or caps.varlen):
        return False, "no padding mask"
    if needs.get("cache") and not caps.kv_cache:
        return False, "no kv cache"
    if grads and "cpu" not in caps.backward:
        return False, "no backward on cpu"
    return True, ""


# -- the property -----------------------------------------------------------------------------------
def _deterministic(spec) -> dict:
    """Config fields that make a training step deterministic (dropout 0)."""
    fields = dict(spec.bench.deterministic) if spec.bench is not None else {}
    if spec.original.attn_dropout_field:
        fields[spec.original.attn_dropout_field] = 0.0
    return fields


def check_equivalence(family: str, data) -> None:
    try:
        _check_equivalence(family, data)
    except AssertionError:
        raise
    except HypothesisException:
        raise
    except Exception as e:  # noqa: BLE001 -- an exception fastzoo did not mean is the failure looked for
        fail(f"equivalence/{family}", "bare_exceptions", f"{type(e).__name__}: {e}")


def _check_equivalence(family: str, data) -> None:
    spec = SPECS[family]
    train = spec.task.name == "causal-lm" and data.draw(st.booleans(), label="train mode")
    from fuzzing import configs

    # small sizes three times in four: e.g. a ResNet of any widths (transformers' original); else the defaults (torchvision's)
    small = data.draw(st.sampled_from([True, True, True, False]), label="small sizes")
    cfg = data.draw(configs(spec, fixed=_deterministic(spec) if train else None, small=small),
                    label="config")
    precision = data.draw(st.sampled_from(["fp32", "bf16"]), label="precision")
    weights_seed = data.draw(st.integers(0, 2**16), label="weights seed")
    torch.manual_seed(weights_seed)
    try:
        ref = spec.original.build(non_default(spec, cfg))
    except Exception:  # noqa: BLE001 -- the original cannot build it (torchvision's fixed stage widths,
        # transformers' pad_token_id inside the vocabulary, timm's fields of its own): nothing to compare
        count(f"equivalence/{family}", original_refused=1)
        assume(False)
    equivalence.draw_(ref, seed=weights_seed)
    try:
        ours = fastzoo.create(spec.variants[0].name, pretrained=ref, attn="eager")
    except CheckpointError as e:  # an original fastzoo says, by name, that it does not reproduce
        assert "does not implement" in str(e) or "not reproduce" in str(e), e
        count(f"equivalence/{family}", create_refused=1)
        assume(False)
    with_attention = any(isinstance(m, UsesAttention) for m in ours.modules())
    ref.train(train)
    ours.train(train)
    peers = []  # bf16: the original on its reference kernels and on its users' (fastzoo.equivalence.rule)
    if precision == "bf16":
        peers = [copy.deepcopy(ref), spec.as_users_run_it(copy.deepcopy(ref))]
    # fp32: the original on its users' kernels, a measure of its own rounding (as equivalence.check takes it)
    users = spec.as_users_run_it(copy.deepcopy(ref)) if precision == "fp32" and spec.original.users else None
    # a model without attention runs on one backend: more inputs per built pair (cases cost less than builds)
    cases = (image_case(ours, (1, 3) if with_attention else (2, 4)) if spec.task.name == "image-classification"
             else token_case(ours, train))
    failures, compared, refused, spread = [], 0, 0, 0
    for form, call, ref_call, needs in data.draw(cases, label="inputs"):
        seed = 7
        try:
            r_rows, r_loss, r_grads = _run(ref, ref_call, precision="fp32", grads=needs["grads"], seed=seed)
        except Exception:  # noqa: BLE001 -- the original cannot run it (transformers' gemma2 without a sliding_window)
            count(f"equivalence/{family}", original_refused=1)
            assume(False)
        r_grads = _in_fastzoo_names(spec, ours, r_grads) if r_grads else {}
        # fp32: the original's own rounding of this function, its fp32 run against its fp64 run (the rule's
        # conditioning measure: a function that is rounding noise, e.g. a LayerNorm over one feature)
        e_rows, e_loss, e_grads = exact_run(ref, ref_call, needs["grads"], seed) if precision == "fp32" else (None,) * 3
        e_grads = _in_fastzoo_names(spec, ours, e_grads) if e_grads else None
        # ... and its runs on its users' kernels: SDPA as PyTorch picks it, and SDPA's math kernel (where flash does
        # not serve); the SDPA backends round as those do, not as the original's eager
        k = [] if users is None else [_run(users, ref_call, precision="fp32", grads=needs["grads"], seed=seed)]
        if k:
            with on_math_kernel():
                k.append(_run(users, ref_call, precision="fp32", grads=needs["grads"], seed=seed))
        k_grads = [_in_fastzoo_names(spec, ours, q[2]) for q in k if q[2]] or None
        p = [_run(peer, ref_call, precision="bf16", grads=needs["grads"], seed=seed) for peer in peers]
        p_grads = [_in_fastzoo_names(spec, ours, q[2]) for q in p if q[2]] or None
        if p and kinds_are_rounding((r_rows, r_loss, r_grads), [(q[0], q[1], g) for q, g in zip(p, p_grads or [{}] * len(p))]):
            count(f"equivalence/{family}", original_unstable=1)  # see kinds_are_rounding
            continue
        alone = None  # the original on each sequence alone, run when its padded output is not finite
        for name, options in CPU_BACKENDS if with_attention else [("eager", {})]:
            label = name + "".join(f"[{k}={v}]" for k, v in options.items())
            try:
                ours.set_attention(name, **options)
            except BackendUnavailableError as e:
                undeclared = undeclared_refusal(ours, name, options, e)
                refused += not undeclared
                failures += [undeclared] if undeclared else []
                continue
            caps = get_backend(name, **options).capabilities
            ok, why = _allowed(caps, needs, grads=needs["grads"])
            grads = needs["grads"]
            if not ok and why == "no backward on cpu":
                # forward-only here: the call with a backward must be refused by name, the forward must match
                try:
                    _run(ours, call, precision=precision, grads=True, seed=seed)
                    failures.append(f"{label} {form}: ran a backward that its capabilities say it has not on cpu")
                except BackendUnavailableError:
                    pass
                ok, grads = _allowed(caps, needs, grads=False)[0], False
            if not ok:
                try:
                    _run(ours, call, precision=precision, grads=grads, seed=seed)
                    failures.append(f"{label} {form}: ran although its capabilities say {why}")
                except (BackendUnavailableError, ValueError):
                    refused += 1
                continue
            rows, loss, g = _run(ours, call, precision=precision, grads=grads, seed=seed)
            comps, through_padding = [], False
            if rows is not None:
                c = equivalence.compare_outputs_where_finite("outputs", rows, r_rows, [q[0] for q in p] or None,
                                                             exact=e_rows, kernels=[q[0] for q in k] or None)
                if (not c.passed and needs.get("packed") and not torch.isfinite(r_rows).all()
                        and (name, options.get("impl")) not in READS_EACH_SEQUENCE_ALONE):
                    spread += 1  # the declared limit of one dense attention over the packed row (module docstring)
                    continue
                if not c.passed and needs.get("alone") and not torch.isfinite(r_rows).all():
                    if alone is None:  # the original on each sequence without its padding (see the module docstring)
                        alone = [_run(m, needs["alone"], precision=pr, grads=False, seed=seed)[0]
                                 for m, pr in [(ref, "fp32")] + [(peer, "bf16") for peer in peers]]
                    c2 = equivalence.compare_outputs_where_finite("outputs (each sequence alone)", rows, alone[0],
                                                                  alone[1:] or None)
                    c, through_padding = (c2, True) if c2.passed else (c, False)
                comps.append(c)
            if loss is not None and not (through_padding and not torch.isfinite(r_loss).all()):
                comps.append(equivalence.compare_loss("loss", loss, r_loss, [q[1] for q in p] or None,
                                                      dtype=torch.bfloat16 if p else torch.float32, exact=e_loss,
                                                      kernels=[q[1] for q in k if q[1] is not None] or None))
            if grads:
                comps.append(equivalence.compare_grads_where_finite("grads", g, r_grads, p_grads, exact=e_grads,
                                                                    kernels=k_grads))
            compared += 1
            failures += [f"{label} {form} {precision}: {c.name} err {c.err:.3g} > bound {c.bound:.3g}"
                         + (f" (worst {c.worst})" if c.worst else "") for c in comps if not c.passed]
    count(f"equivalence/{family}", examples=1, cases=compared, refused=refused, mismatches=len(failures),
          non_finite_spread=spread)
    assert not failures, f"config {cfg}, {equivalence.describe(weights_seed)}: " + "; ".join(failures)


@pytest.mark.parametrize("family", FAMILIES)
@examples(ci=6, long=380)
@given(data=st.data())
def test_fastzoo_equals_the_original_for_any_config_and_input(family, data):
    check_equivalence(family, data)
