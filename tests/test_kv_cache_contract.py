"""The attention contract for decoding with a KV cache: causal with fewer queries than keys
is bottom-right aligned (query i sees keys j <= i + Sk - Sq), and a backend that cannot
serve it says so instead of running top-left causal attention."""
import pytest
import torch

import fastzoo
from fastzoo.attention import AttnContext, Capabilities, get_backend, register_attention
from fastzoo.attention.base import FLOATS, AttnRequest
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


@pytest.mark.parametrize("name", ["eager", "sdpa", "flex"])
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
