"""The attention contract for decoding with a KV cache: causal with fewer queries than keys
is bottom-right aligned (query i sees keys j <= i + Sk - Sq), and a backend that cannot
serve it says so instead of running top-left causal attention. Packed sequences carry the
keys' own offsets (ctx.cu_seqlens_k): the same rule per sequence, never across sequences."""
import pytest
import torch

import fastzoo
from fastzoo.attention import AttnContext, Capabilities, get_backend, register_attention
from fastzoo.attention.base import FLOATS, AttnRequest, unavailable
from fastzoo.errors import BackendUnavailableError

TOL = 1e-5  # fp32 CPU, same arithmetic up to summation order


def reference(q, k, v, valid_BK=None):
    """Dense bottom-right causal attention, written out independently of fastzoo.masks."""
    Sq, Sk = q.shape[-2], k.shape[-2]
    allowed = torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + (Sk - Sq)
    allowed = allowed[None, None].expand(q.shape[0], 1, Sq, Sk)
    if valid_BK is not None:
        allowed = allowed & valid_BK[:, None, None, :]
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("name", ["eager", "sdpa", "flex", "varlen", "nested"])  # varlen/nested: B sequences
@pytest.mark.parametrize("Sq", [1, 3])
def test_fewer_queries_than_keys_is_bottom_right_causal(name, Sq):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, Sq, 8, generator=g)
    k, v = (torch.randn(2, 2, 7, 8, generator=g) for _ in range(2))
    out = get_backend(name)(q, k, v, AttnContext(causal=True))
    assert (out - reference(q, k, v)).abs().max() <= TOL


@pytest.mark.parametrize("name", ["eager", "sdpa", "flex"])
def test_kv_cache_with_left_padding_masks_padded_keys(name):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 1, 8, generator=g)
    k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(2))
    valid = torch.tensor([[False, False, True, True, True], [True] * 5])
    out = get_backend(name)(q, k, v, AttnContext(causal=True, key_padding_mask=valid))
    assert (out - reference(q, k, v, valid)).abs().max() <= TOL


@pytest.fixture
def scratch_registry(monkeypatch):
    """Backends registered by a test disappear after it."""
    import fastzoo.attention as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_backend_without_kv_cache_refuses_a_cached_call(scratch_registry):
    register_attention("no_cache_test", lambda q, k, v, ctx: q, overwrite=True,
                       capabilities=Capabilities(devices={"cpu": FLOATS}, kv_cache=False))
    q, k = torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 3, 4)
    with pytest.raises(BackendUnavailableError, match="KV cache"):
        get_backend("no_cache_test")(q, k, k, AttnContext(causal=True))


def test_kv_cache_request_is_checked_against_capabilities(scratch_registry):
    req = AttnRequest(head_dim=8, causal=True, kv_cache=True)
    get_backend("sdpa").check(req)
    register_attention("no_cache_test2", lambda q, k, v, ctx: q, overwrite=True,
                       capabilities=Capabilities(devices={"cpu": FLOATS}))
    with pytest.raises(BackendUnavailableError, match="KV cache"):
        get_backend("no_cache_test2").check(req)


def test_capability_matrix_has_a_kv_cache_column():
    rows = {r["backend"]: r for r in fastzoo.attention.capability_matrix()}
    assert rows["sdpa"]["kv cache"] == "yes" and rows["eager"]["kv cache"] == "yes"


# -- packed queries and keys with their own offsets (cu_seqlens / cu_seqlens_k) ---------------------
PACKED = [("eager", {}), ("sdpa", {}), ("flex", {}), ("varlen", {"impl": "cpu"}), ("varlen", {"impl": "flex"}), ("nested", {})]
CU_Q, CU_K = [0, 1, 4, 6, 7], [0, 4, 7, 13, 14]  # per sequence: (1 query, 4 keys) (3, 3) (2, 6) (1, 1)


def packed_case(cu_q=CU_Q, cu_k=CU_K, seed=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, cu_q[-1], 8, generator=g)
    k, v = (torch.randn(1, 2, cu_k[-1], 8, generator=g) for _ in range(2))
    return q, k, v


def packed_ctx(causal, cu_q=CU_Q, cu_k=CU_K):
    lengths = lambda cu: max(b - a for a, b in zip(cu[:-1], cu[1:]))  # noqa: E731
    return AttnContext(causal=causal, cu_seqlens=torch.tensor(cu_q, dtype=torch.int32), max_seqlen=lengths(cu_q),
                       cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), max_seqlen_k=lengths(cu_k))


def packed_reference(q, k, v, causal, cu_q=CU_Q, cu_k=CU_K):
    """Each sequence alone through the dense reference above (its queries are its last positions)."""
    outs = []
    for n in range(len(cu_q) - 1):
        qn, kn, vn = q[:, :, cu_q[n]:cu_q[n + 1]], k[:, :, cu_k[n]:cu_k[n + 1]], v[:, :, cu_k[n]:cu_k[n + 1]]
        if causal:
            outs.append(reference(qn, kn, vn))
        else:
            outs.append(((qn @ kn.transpose(-2, -1)) * qn.shape[-1] ** -0.5).softmax(-1) @ vn)
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("name,opts", PACKED, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_keys_with_their_own_offsets_equal_each_sequence_alone(name, opts, causal):
    q, k, v = packed_case()
    out = get_backend(name, **opts)(q, k, v, packed_ctx(causal))
    assert (out - packed_reference(q, k, v, causal)).abs().max() <= TOL


@pytest.mark.parametrize("name", ["nested", "varlen", "eager"])
def test_one_query_per_sequence_sees_every_key_of_its_sequence(name):
    """The decoding step: one new token per sequence (on CUDA nested runs jagged SDPA without a mask here)."""
    cu_q, cu_k = [0, 1, 2, 3], [0, 4, 7, 13]
    q, k, v = packed_case(cu_q, cu_k)
    out = get_backend(name)(q, k, v, packed_ctx(True, cu_q, cu_k))
    assert (out - packed_reference(q, k, v, True, cu_q, cu_k)).abs().max() <= TOL


@pytest.mark.parametrize("name,opts", [("eager", {}), ("varlen", {"impl": "cpu"}), ("nested", {})], ids=str)
def test_packed_keys_gradients_equal_the_reference(name, opts):
    q, k, v = (x.requires_grad_() for x in packed_case())
    get_backend(name, **opts)(q, k, v, packed_ctx(True)).square().sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    packed_reference(q, k, v, True).square().sum().backward()
    for g, x in zip(got, (q, k, v)):
        assert (g - x.grad).abs().max() <= TOL * max(1.0, x.grad.abs().max().item())


@pytest.mark.parametrize("name,opts", PACKED, ids=str)
def test_packed_keys_never_reach_another_sequence(name, opts):
    """Changing sequence 2's keys and values changes sequence 2's outputs only."""
    q, k, v = packed_case()
    backend = get_backend(name, **opts)
    before = backend(q, k, v, packed_ctx(True))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, CU_K[2]:CU_K[3]] += 3.0
    v2[:, :, CU_K[2]:CU_K[3]] -= 5.0
    after = backend(q, k2, v2, packed_ctx(True))
    others = torch.ones(CU_Q[-1], dtype=torch.bool)
    others[CU_Q[2]:CU_Q[3]] = False
    assert (after - before)[:, :, others].abs().max() <= 1e-6  # float noise at most
    assert (after - before)[:, :, ~others].abs().max() > 0.1


@pytest.mark.parametrize("cu_k,why", [
    ([0, 4, 7, 13], "like cu_seqlens"),  # one sequence short
    ([0, 4, 5, 13, 14], "at least as many keys as queries"),  # sequence 1: 3 queries, 1 key
    ([0, 4, 7, 13, 15], "must end at 14 \\(the number of keys\\)"),
    ([1, 4, 7, 13, 14], "must start at 0"),
    ([0, 4, 4, 13, 14], "strictly increasing"),
])
@pytest.mark.parametrize("name,opts", PACKED, ids=str)
def test_bad_key_offsets_are_refused_naming_cu_seqlens_k(name, opts, cu_k, why):
    q, k, v = packed_case()
    ctx = packed_ctx(True)
    ctx.cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"cu_seqlens_k.*{why}"):
        get_backend(name, **opts)(q, k, v, ctx)


def test_key_offsets_without_query_offsets_are_refused():
    q, k, v = packed_case()
    ctx = AttnContext(causal=True, cu_seqlens_k=torch.tensor(CU_K, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k.*cu_seqlens"):
        get_backend("eager")(q, k, v, ctx)


@pytest.mark.parametrize("name", ["eager", "varlen", "nested"])
def test_fewer_packed_queries_than_keys_without_key_offsets_are_refused(name):
    q, k, v = packed_case()
    ctx = AttnContext(causal=True, cu_seqlens=torch.tensor(CU_Q, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        get_backend(name)(q, k, v, ctx)


def test_packed_backend_without_kv_cache_refuses_key_offsets(scratch_registry):
    register_attention("packed_no_cache_test", lambda q, k, v, ctx: q, overwrite=True,
                       capabilities=Capabilities(devices={"cpu": FLOATS}, varlen=True, padding_mask=False))
    q, k, v = packed_case()
    with pytest.raises(BackendUnavailableError, match="cu_seqlens_k"):
        get_backend("packed_no_cache_test")(q, k, v, packed_ctx(True))


@pytest.mark.gpu
@pytest.mark.parametrize("name,opts", [("fa2", {}), ("fa3", {}), ("te", {}), ("xformers", {}), ("varlen", {"impl": "torch"}),
                                       ("varlen", {"impl": "flash"}), ("varlen", {"impl": "xformers"}), ("nested", {})], ids=str)
def test_gpu_packed_keys_with_their_own_offsets_are_bottom_right_like_eager(name, opts):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none")
    backend = get_backend(name, **opts)
    reason = unavailable(backend.capabilities)
    if reason:
        pytest.skip(f"{name} {opts} unavailable here: {reason}")
    q, k, v = (x.cuda().to(torch.bfloat16).repeat(1, 1, 1, 8) for x in packed_case())  # head dim 64
    ctx = packed_ctx(True)
    with torch.no_grad():
        out = backend(q, k, v, ctx).float()
    ref = packed_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), True).cuda()
    peer = packed_reference(q.cpu(), k.cpu(), v.cpu(), True).cuda().float()
    # flash-attn's rule: within 3x the reference's own bf16 error (+ a small floor)
    assert (out - ref).abs().max() <= 3 * (peer - ref).abs().max() + 1e-5
