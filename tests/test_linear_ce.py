"""fastzoo.losses.linear_cross_entropy equals F.cross_entropy(hidden @ weight.T, target) in value
and gradient, for every impl, reduction, ignore pattern and autocast dtype."""
import pytest
import torch
import torch.nn.functional as F

from fastzoo.losses import linear_cross_entropy
from fastzoo.losses.linear_ce import logits_block

N, D, V = 300, 32, 1000  # logits_block(300, 1000, 32) = (64, 512): 5 x 2 blocks, the last of each partial
IMPLS = ["fused", "torch", "reference", "auto"]


def case(seed=0, n=N, d=D, v=V, ignore=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (0.5 * torch.randn(v, d, generator=g)).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    if ignore:
        t[::3] = -100
        t[64:128] = -100  # one whole chunk ignored
    return h, w, t


def value_and_grads(fn, h, w, t, reduction, seed=1):
    out = fn(h, w, t, reduction)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return (out, *torch.autograd.grad(out, (h, w), g))


REF = lambda h, w, t, r: F.cross_entropy(h @ w.T, t, reduction=r)  # noqa: E731
TWO_PASS = V * 4  # block_bytes with room for one token x the vocabulary: under 256 tokens, the two-pass path


def test_default_takes_one_pass_with_a_block_as_large_as_the_weight():
    """The default rule: chunks of ``width`` tokens (at least 256), spread evenly; at GPT-2's head 6
    chunks of 683 tokens, a [683, 50257] block no larger than the weight; at a 128k vocabulary and a
    256-wide head, 4 chunks of 256: the block (128 MiB in fp32) and the weight's gradient under a
    quarter of the three [1024, 128256] fp32 tensors a loss on materialised logits holds (1,503 MiB)."""
    from fastzoo.losses.linear_ce import one_pass_rows

    assert one_pass_rows(N, V, D, torch.float32, None) == 150  # 300 tokens, chunks of at least 256: two of 150
    rows = one_pass_rows(4096, 50257, 768, torch.float32, None)
    assert rows == 683 and rows <= 768
    rows = one_pass_rows(1024, 128256, 256, torch.float32, None)
    assert rows == 256 and (rows + 256) * 128256 * 4 <= 3 * 1024 * 128256 * 4 / 4


def test_case_spans_several_blocks_with_an_all_ignored_one():
    assert logits_block(N, V, D) == (64, 512) and N % 64 and V % 512


def test_block_holds_no_more_than_the_hidden_states_at_gpt2_size():
    """The memory rule at the benchmark's size: one [4096, 512] fp32 block (8 MiB) beside the grads."""
    rows, cols = logits_block(4096, 50257, 768)
    assert (rows, cols) == (4096, 512) and rows * cols <= 4096 * 768


def test_first_pass_block_fills_the_gradients_room_and_no_more():
    """Before the gradients exist the first pass may hold as many logits as they will take: at
    GPT-2's head 4096 x 9728 fp32 (152 MiB) against 159 MiB of gradients, 6 vocabulary blocks, not 99."""
    from fastzoo.losses.linear_ce import lse_block

    room = (50257 + 4096) * 768
    rows, cols = lse_block(4096, 50257, 768, room)
    assert (rows, cols) == (4096, 9728) and rows * cols <= room
    assert lse_block(300, 5000, 32, 300 * 32) == logits_block(300, 5000, 32)  # no room: the second pass's block


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_wide_first_pass_matches_cross_entropy_of_the_logits(reduction):
    """V = 5000: the first pass's [64, 2560] blocks (the last partial) and the second pass's [64, 512]."""
    h, w, t = case(v=5000)
    ref = value_and_grads(REF, h, w, t, reduction)
    out = value_and_grads(lambda *a: linear_cross_entropy(*a[:3], reduction=a[3], impl="fused", block_bytes=TWO_PASS),
                          h, w, t, reduction)
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)  # fp32, as below


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_value_and_grads_match_cross_entropy_of_the_logits(impl, reduction):
    h, w, t = case()
    ref = value_and_grads(REF, h, w, t, reduction)
    out = value_and_grads(lambda *a: linear_cross_entropy(*a[:3], reduction=a[3], impl=impl), h, w, t, reduction)
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), out, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # fp32, summation order differs: 1e-5 relative to the largest value (a "sum" loss is ~2e3)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)


ONE_PASS = 256 * V * 4  # room for 256 tokens x the vocabulary in fp32: the one-pass path


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_one_pass_budget_matches_cross_entropy_of_the_logits(reduction):
    """block_bytes with room for 256 x V takes one pass over token chunks ("none" keeps two)."""
    from fastzoo.losses.linear_ce import one_pass_rows

    assert one_pass_rows(N, V, D, torch.float32, ONE_PASS) == 150  # 300 tokens in two even chunks
    assert one_pass_rows(N, V, D, torch.float32, ONE_PASS - 1) is None
    h, w, t = case()
    ref = value_and_grads(REF, h, w, t, reduction)
    out = value_and_grads(lambda *a: linear_cross_entropy(*a[:3], reduction=a[3], impl="fused", block_bytes=ONE_PASS),
                          h, w, t, reduction)
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)  # fp32, as above


@pytest.mark.parametrize("room, rows", [(300, 300), (256, 150)], ids=["one chunk", "two chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_chunks_match_cross_entropy_of_the_logits(dtype, room, rows, monkeypatch):
    """The one-pass path with every token in one chunk (the weight's gradient written once, in the
    matmuls' dtype) and in two (accumulated in fp32), in fp32 and under bf16 autocast (its softmax
    in an fp32 scratch a few rows at a time, the last step partial)."""
    import fastzoo.losses.linear_ce as lce

    monkeypatch.setattr(lce, "l2_cache_bytes", lambda: 64 * V * 4)  # 64 rows: 300 tokens in 5 steps
    budget = room * V * dtype.itemsize  # room for 256 rows: two even chunks of 150
    assert lce.one_pass_rows(N, V, D, dtype, budget) == rows
    assert lce.scratch_rows(V, torch.float32, torch.device("cpu")) == 64 and N % 64
    h, w, t = case()
    fp32 = value_and_grads(REF, h, w, t, "mean")
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        ref = value_and_grads(REF, h, w, t, "mean")
        out = value_and_grads(lambda *a: linear_cross_entropy(*a[:3], impl="fused", block_bytes=budget), h, w, t, "mean")
    for name, a, b, f in zip(("loss", "grad hidden", "grad weight"), out, ref, fp32):
        if dtype == torch.float32:  # summation order differs: 1e-5 relative to the largest value
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)
        else:  # flash-attn's rule, as test_autocast_matches_the_reference_under_autocast
            assert (a - f).abs().max() <= 3 * (b - f).abs().max() + 1e-3 * f.abs().max().item(), name


def test_custom_ignore_index_and_leading_dims():
    h, w, t = case(ignore=False)
    t[5:40] = 7  # class 7 is a real class for the reference too, but ignored here
    h_BSD, t_BS = h.reshape(3, 100, D), t.reshape(3, 100)
    ref = value_and_grads(lambda h, w, t, r: F.cross_entropy(h @ w.T, t, ignore_index=7, reduction=r), h, w, t, "mean")
    out = value_and_grads(lambda h, w, t, r: linear_cross_entropy(h.reshape(3, 100, D), w, t.reshape(3, 100),
                                                                  ignore_index=7), h, w, t, "mean")
    assert h_BSD.shape[:-1] == t_BS.shape
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fp32


@pytest.mark.parametrize("impl, block_bytes", [("fused", TWO_PASS), ("fused", ONE_PASS), ("fused", None), ("reference", None)])
def test_all_targets_ignored_gives_nan_mean_and_zero_grads_like_cross_entropy(impl, block_bytes):
    h, w, _ = case()
    t = torch.full((N,), -100)
    loss = linear_cross_entropy(h, w, t, impl=impl, block_bytes=block_bytes)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert torch.isnan(loss)
    assert gh.abs().max() == 0 and gw.abs().max() == 0


def test_tied_weight_gets_both_gradients():
    """GPT-2 ties the LM head to the token embedding: both uses add into one gradient."""
    h, w, t = case()
    ids = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))

    def tied(impl):
        x = h + w[ids]  # the embedding lookup
        loss = F.cross_entropy(x @ w.T, t) if impl == "ref" else linear_cross_entropy(x, w, t, impl=impl)
        return torch.autograd.grad(loss, (h, w))

    for a, b in zip(tied("fused"), tied("ref")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fp32


def test_frozen_weight_and_no_grad():
    h, w, t = case()
    w = w.detach()
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w, t, impl="fused"), (h,))
    torch.testing.assert_close(gh, torch.autograd.grad(REF(h, w, t, "mean"), (h,))[0], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, impl="fused")
    assert not loss.requires_grad
    torch.testing.assert_close(loss, REF(h, w, t, "mean").detach(), rtol=1e-6, atol=1e-6)  # fp32


@pytest.mark.parametrize("block_bytes", [TWO_PASS, ONE_PASS, None], ids=["two-pass", "one-pass", "default"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_matches_the_reference_under_autocast(dtype, block_bytes):
    """Every loss path runs under autocast and matches fp32 within the dtype's
    tolerance. The matmuls run in the low dtype (as the reference's), softmax in fp32."""
    h, w, t = case()
    fp32 = value_and_grads(REF, h, w, t, "mean")
    with torch.autocast("cpu", dtype=dtype):
        ref = value_and_grads(REF, h, w, t, "mean")
        out = value_and_grads(lambda *a: linear_cross_entropy(*a[:3], impl="fused", block_bytes=block_bytes), h, w, t, "mean")
    for name, a, b, f in zip(("loss", "grad hidden", "grad weight"), out, ref, fp32):
        assert a.dtype == b.dtype == f.dtype == torch.float32, name
        # flash-attn's rule: no further from fp32 than 3x the reference's own low-precision error (+ floor)
        floor = 1e-3 * f.abs().max().item()
        assert (a - f).abs().max() <= 3 * (b - f).abs().max() + floor, name


@pytest.mark.parametrize("block_bytes", [TWO_PASS, ONE_PASS, None], ids=["two-pass", "one-pass", "default"])
def test_bf16_gradients_round_softmax_minus_onehot_once_as_the_reference(block_bytes):
    """Under autocast the reference's backward forms ``softmax - onehot`` (times the upstream gradient)
    in fp32 and rounds it once to bf16; so does the fused path. Rounding the softmax first and
    subtracting the onehot after leaves ``p - 1`` as the difference of two rounded terms of size 1: a
    loss constant in the weights (one class) gets gradients that are not 0, and confident tokens
    (p ~ 0.86 here) 2.4x (two passes) to 6x (one pass) the reference's own distance from the exact
    gradients of the bf16 logits."""
    h, w, t = case(ignore=False)
    w = (6 * w).detach().requires_grad_()
    t = (h @ w.T).argmax(1)  # confident: each token's target is its largest logit
    one = (w[:1].detach().requires_grad_(), torch.zeros_like(t))  # one class: the loss is log(1) = 0
    fused = lambda *a: linear_cross_entropy(*a[:3], impl="fused", block_bytes=block_bytes)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(not g.any() for g in value_and_grads(fused, h, *one, "mean")[1:])  # exactly 0, as the reference's
        ref = value_and_grads(REF, h, w, t, "mean")
        out = value_and_grads(fused, h, w, t, "mean")
    # the exact (fp64) gradients of the loss of the bf16 logits, times value_and_grads' upstream gradient
    hb, wb = (x.detach().bfloat16().double() for x in (h, w))
    d = torch.softmax((hb @ wb.T).bfloat16().double(), 1) - F.one_hot(t, V)
    d *= torch.randn((), generator=torch.Generator().manual_seed(1)).item() / N
    for name, a, b, exact in zip(("grad hidden", "grad weight"), out[1:], ref[1:], (d @ wb, d.T @ hb)):
        # bf16 rounds the same terms in another order: within twice the reference's own rounding
        assert (a - exact).abs().max() <= 2 * (b - exact).abs().max(), name


def test_low_precision_inputs_without_autocast_return_their_dtype():
    h, w, t = case()
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ref, out = REF(hb, wb, t, "mean"), linear_cross_entropy(hb, wb, t, impl="fused")
    assert out.dtype == ref.dtype == torch.bfloat16
    assert abs(out.item() - REF(h, w, t, "mean").item()) <= 2e-2 * abs(out.item())  # bf16: 8 bits of mantissa
    assert torch.autograd.grad(out, hb)[0].dtype == torch.bfloat16


def test_second_backward_is_refused_not_wrong():
    h, w, t = case()
    loss = linear_cross_entropy(h, w, t, impl="fused")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


@pytest.mark.parametrize("bad, match", [
    (dict(impl="liger"), "impl="),
    (dict(block_bytes=0), "block_bytes="),
    (dict(reduction="avg"), "reduction="),
    (dict(target_N=torch.zeros(N)), "target_N must hold integer"),
    (dict(target_N=torch.zeros(N + 1, dtype=torch.long)), "target_N must have shape"),
    (dict(target_N=torch.full((N,), V)), r"target_N\[0\] = 1000"),
    (dict(weight_VD=torch.zeros(V, D + 1)), "weight_VD must be"),
    (dict(weight_VD=torch.zeros(V, D, dtype=torch.float64)), "hidden_ND is torch.float32 but weight_VD"),
])
def test_bad_inputs_name_the_argument(bad, match):
    h, w, t = case()
    kw = dict(hidden_ND=h, weight_VD=w, target_N=t) | bad
    args = [kw.pop(k) for k in ("hidden_ND", "weight_VD", "target_N")]
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(*args, **kw)


def test_compiles_fullgraph():
    """torch.compile(fullgraph=True) traces the fused path (no graph break, so no host sync);
    aot_eager runs the traced graph without C++ codegen."""
    h, w, t = case()
    f = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t, impl="fused"), fullgraph=True, backend="aot_eager")
    out = value_and_grads(lambda h, w, t, r: f(h, w, t), h, w, t, "mean")
    ref = value_and_grads(REF, h, w, t, "mean")
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fp32


def test_no_tokens_gives_a_zero_sum_and_zero_gradients_like_cross_entropy():
    """The one-pass path with no chunk to run still returns the weight's gradient, zeros."""
    h, w = torch.randn(0, D, requires_grad=True), torch.randn(V, D, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.long), reduction="sum", impl="fused")
    loss.backward()
    assert loss.item() == 0 and w.grad.abs().max() == 0 and h.grad.shape == (0, D)
