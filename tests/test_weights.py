"""Loading timm ViT weights from every source, exporting back, and refusing bad checkpoints.

The reference is randomised to O(1) scale (``fastzoo.equivalence.draw_``), so "same function" at
1e-4 on the logits (fastzoo.equivalence's rule, fp32 CPU) cannot hide an architecture deviation.
"""
import json
from functools import partial

import conftest
import pytest
import timm
import torch
from timm.layers import LayerNorm
from safetensors.torch import save_file

import fastzoo
from fastzoo.errors import CheckpointError, UnknownModelError
from fastzoo.equivalence import draw_

TINY = conftest.TINY["vit"]
ARCH = {k: TINY[k] for k in ("embed_dim", "depth", "num_heads", "patch_size")}  # what weights cannot tell
SIDE = TINY["img_size"]


@pytest.fixture
def ref():
    torch.manual_seed(0)
    return draw_(timm.create_model("vit_base_patch16_224", pretrained=False, **TINY), seed=1).eval()


def same_function(model, ref):
    x = torch.randn(2, 3, SIDE, SIDE)
    with torch.no_grad():
        return (model.eval()(x) - ref(x)).abs().max().item() <= 1e-4


def sources(ref, tmp_path):
    sd = ref.state_dict()
    save_file(sd, tmp_path / "model.safetensors")
    torch.save(sd, tmp_path / "pytorch_model.bin")
    torch.save({"state_dict": sd, "epoch": 3}, tmp_path / "train_ckpt.pth")  # timm train.py layout
    torch.save({f"module.{k}": v for k, v in sd.items()}, tmp_path / "ddp.pt")
    return {
        "live module": ref,
        "state dict": sd,
        "safetensors": tmp_path / "model.safetensors",
        "bin": str(tmp_path / "pytorch_model.bin"),
        "wrapped pth": tmp_path / "train_ckpt.pth",
        "ddp prefix pt": tmp_path / "ddp.pt",
    }


def test_every_source_loads_the_same_function(ref, tmp_path):
    for name, src in sources(ref, tmp_path).items():
        model = fastzoo.create("vit_b16", pretrained=src, **ARCH)
        assert model.config.num_classes == TINY["num_classes"], name  # read from the head
        assert same_function(model, ref), name


def test_save_pretrained_directory_defines_the_architecture(ref, tmp_path):
    model = fastzoo.create("vit_b16", pretrained=ref, **ARCH)
    model.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["embed_dim"] == 64 and cfg["fastzoo_model"] == "vit_base_patch16_224"  # the name vit_b16 is an alias of
    again = fastzoo.create("vit_b16", pretrained=tmp_path / "ckpt")  # no overrides needed
    assert same_function(again, ref)


def test_load_pretrained_into_a_built_model(ref):
    model = fastzoo.create("vit_b16", **TINY)
    assert not same_function(model, ref)
    fastzoo.load_pretrained(model, ref.state_dict())
    assert same_function(model, ref)


def test_round_trip_to_timm_is_exact(ref):
    model = fastzoo.create("vit_b16", pretrained=ref, **ARCH)
    exported = fastzoo.export_state_dict(model, "timm")
    back = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY)
    back.load_state_dict(exported, strict=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    with pytest.raises(ValueError, match="format='torchvision'"):
        fastzoo.export_state_dict(model, "torchvision")


def test_missing_unexpected_and_misshaped_keys_are_named_and_nothing_loads(ref):
    model = fastzoo.create("vit_b16", **TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = dict(ref.state_dict())
    sd.pop("blocks.1.mlp.fc2.bias")
    sd["blocks.0.attn.extra"] = torch.zeros(1)
    sd["blocks.0.norm1.weight"] = torch.zeros(65)
    with pytest.raises(CheckpointError) as e:
        fastzoo.load_pretrained(model, sd)
    msg = str(e.value)
    assert "missing keys (1): blocks.1.mlp.fc2.bias" in msg
    assert "unexpected keys (1): blocks.0.attn.extra" in msg
    assert "blocks.0.norm1.weight: checkpoint (65,) vs model (64,)" in msg
    assert "nothing was loaded" in msg
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed despite the refused load"


def test_wrong_architecture_is_refused_with_shapes(ref):
    with pytest.raises(CheckpointError, match=r"shape mismatches .*blocks.0.attn.qkv.weight: checkpoint \(192, 64\)"):
        fastzoo.create("vit_s16", pretrained=ref.state_dict())  # vit_s16 is 384 wide; the keys cannot say 64


def test_truncated_file_is_a_checkpoint_error_naming_it(ref, tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(ref.state_dict(), path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read"):
        fastzoo.create("vit_b16", pretrained=path, **ARCH)
    bin_path = tmp_path / "model.bin"
    torch.save(ref.state_dict(), bin_path)
    bin_path.write_bytes(bin_path.read_bytes()[:500])
    with pytest.raises(CheckpointError, match="model.bin"):
        fastzoo.create("vit_b16", pretrained=bin_path, **ARCH)


class Payload:
    def __reduce__(self):
        return (print, ("pickled code ran",))


def test_pickled_code_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "payload": Payload()}, path)
    with pytest.raises(CheckpointError, match="refused, it needs arbitrary pickled code"):
        fastzoo.create("vit_b16", pretrained=path, **ARCH)
    assert "pickled code ran" not in capsys.readouterr().out


def test_not_a_vit_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a vit checkpoint .* first keys are: conv1.weight"):
        fastzoo.create("vit_b16", pretrained={"conv1.weight": torch.zeros(1), "fc.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="no such file or directory"):
        fastzoo.create("vit_b16", pretrained=tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no weights found"):
        fastzoo.create("vit_b16", pretrained=tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="unknown checkpoint extension '.txt'"):
        fastzoo.create("vit_b16", pretrained=tmp_path / "notes.txt")


def test_unknown_model_and_override_names_suggest():
    with pytest.raises(UnknownModelError, match="Did you mean 'vit_b16'") as e:
        fastzoo.create("vit_b61")
    assert isinstance(e.value, KeyError)
    with pytest.raises(TypeError, match="unknown override 'num_class'.*Did you mean 'num_classes'"):
        fastzoo.create("vit_b16", num_class=10)
    with pytest.raises(ValueError, match=f"img_size=30 is not divisible by patch_size={ARCH['patch_size']}"):
        fastzoo.create("vit_b16", **{**ARCH, "img_size": 30})
    with pytest.raises(ValueError, match="global_pool='max'"):
        fastzoo.create("vit_b16", global_pool="max")


def test_wrong_image_shape_is_named():
    model = fastzoo.create("vit_b16", **TINY)
    with pytest.raises(ValueError, match=f"images are 48x48, the model was built for img_size=\\({SIDE}, {SIDE}\\)"):
        model(torch.randn(1, 3, 48, 48))
    with pytest.raises(ValueError, match="images must be \\[B, C, H, W\\]"):
        model(torch.randn(3, SIDE, SIDE))


def test_bare_state_dict_with_arch_overrides_still_loads(ref):
    model = fastzoo.create("vit_b16", pretrained=ref.state_dict(), **ARCH)
    assert same_function(model, ref)


def test_live_fastzoo_model_defines_the_architecture(ref):
    model = fastzoo.create("vit_b16", pretrained=ref)
    again = fastzoo.create("vit_b16", pretrained=model)  # the live fastzoo model's config, no overrides
    assert again.config == model.config and same_function(again, ref)
    with pytest.raises(CheckpointError, match="a vit checkpoint, not a gpt2 one"):
        fastzoo.create("gpt2", pretrained=model)


# -- load_pretrained compares the config a source states ----------------------------------
def test_load_pretrained_refuses_a_live_module_of_another_function(ref):
    torch.manual_seed(0)
    clip_like = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY, act_layer="quick_gelu",
                                  norm_layer=partial(LayerNorm, eps=1e-5))  # same keys and shapes as `ref`
    model = fastzoo.create("vit_b16", **TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        fastzoo.load_pretrained(model, clip_like)
    msg = str(e.value)
    assert "act_layer: checkpoint 'quick_gelu' vs model 'gelu'" in msg
    assert "norm_eps: checkpoint 1e-05 vs model 1e-06" in msg
    assert "fastzoo.create(name, pretrained=...)" in msg and "nothing was loaded" in msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    fastzoo.load_pretrained(model, ref)  # the same architecture loads
    assert same_function(model, ref)


def test_load_pretrained_ignores_training_only_fields(ref):
    torch.manual_seed(0)
    dropped = draw_(timm.create_model("vit_base_patch16_224", pretrained=False, **TINY, drop_rate=0.3,
                                           drop_path_rate=0.2, attn_drop_rate=0.1)).eval()
    model = fastzoo.create("vit_b16", **TINY)  # no dropout: a legitimate choice for the same function
    fastzoo.load_pretrained(model, dropped)
    assert same_function(model, dropped)


def test_load_pretrained_refuses_a_save_pretrained_dir_of_another_function(ref, tmp_path):
    fastzoo.create("vit_b16", pretrained=ref, global_pool="avg", fc_norm=False, class_token=True).save_pretrained(
        tmp_path / "avg")
    model = fastzoo.create("vit_b16", **TINY)  # token pooling: same keys, another function
    with pytest.raises(CheckpointError, match="global_pool: checkpoint 'avg' vs model 'token'"):
        fastzoo.load_pretrained(model, tmp_path / "avg")


GPT2_TINY = conftest.TINY["gpt2"]


def test_load_pretrained_refuses_an_hf_gpt2_dir_of_another_function(tmp_path):
    import transformers
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        **GPT2_TINY, scale_attn_by_inverse_layer_idx=True, layer_norm_epsilon=1e-3, resid_pdrop=0.0))
    hf.save_pretrained(tmp_path)
    model = fastzoo.create("gpt2", **GPT2_TINY)  # default config: resid_pdrop 0.1 is free to differ
    with pytest.raises(CheckpointError) as e:
        fastzoo.load_pretrained(model, tmp_path)
    msg = str(e.value)
    assert "scale_attn_by_inverse_layer_idx: checkpoint True vs model False" in msg
    assert "layer_norm_epsilon: checkpoint 0.001 vs model 1e-05" in msg
    assert "pdrop" not in msg
    built = fastzoo.create("gpt2", attn="eager", pretrained=tmp_path)  # the way the error points to
    ids = torch.randint(0, GPT2_TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (built.eval()(ids).logits - hf.eval()(ids).logits).abs().max() <= 1e-4  # fp32 CPU, fastzoo.equivalence's rule


def test_gpt2_state_dict_that_does_not_fit_the_variant_says_what_to_pass():
    import transformers
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_TINY))
    width, heads = GPT2_TINY["n_embd"], GPT2_TINY["n_head"]
    assert width % 12  # the gpt2 YAML's n_head=12 must not divide the tiny width
    with pytest.raises(CheckpointError, match=rf"n_embd={width}.*not divisible by n_head=12.*pass n_head= to fastzoo.create"):
        fastzoo.create("gpt2", pretrained=hf.state_dict())  # the gpt2 YAML has n_head=12
    assert fastzoo.create("gpt2", pretrained=hf.state_dict(), n_head=heads).config.n_embd == width


# -- wrapped live modules --------------------------------------------------------------
class FakeDDP(torch.nn.Module):
    """Holds the model as ``.module``, as DistributedDataParallel does (its state dict keys
    get a ``module.`` prefix); used for the nesting cases beside the real DDP test below."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_compiled_and_wrapped_live_modules_load(ref):
    wrapped = {
        "compiled": torch.compile(ref),
        "ddp-like(compiled)": FakeDDP(torch.compile(ref)),
        "compiled(ddp-like)": torch.compile(FakeDDP(ref)),
    }
    for name, module in wrapped.items():
        model = fastzoo.create("vit_b16", pretrained=module)  # no overrides: read from the inner timm module
        assert model.config.embed_dim == 64, name
        assert same_function(model, ref), name


def test_real_ddp_wrapped_live_module_loads(ref, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(ref)
        model = fastzoo.create("vit_b16", pretrained=ddp)
    finally:
        dist.destroy_process_group()
    assert same_function(model, ref)


def test_nested_wrapper_prefixes_are_stripped_in_state_dicts(ref):
    sd = ref.state_dict()
    for prefix in ("module._orig_mod.", "_orig_mod.module.", "module.module."):
        model = fastzoo.create("vit_b16", pretrained={prefix + k: v for k, v in sd.items()}, **ARCH)
        assert same_function(model, ref), prefix


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_unavailable_device_is_named():
    with pytest.raises(ValueError, match="device='cuda' is not available on this machine"):
        fastzoo.create("vit_b16", **TINY, device="cuda")


def test_convert_cli_round_trips_to_timm_and_fastzoo(ref, tmp_path):
    from safetensors.torch import load_file

    from fastzoo.cli import main

    src = tmp_path / "timm.pth"
    torch.save(ref.state_dict(), src)
    sets = ["--set", *conftest.model_kwargs(ARCH, *ARCH)]
    assert main(["convert", "vit_b16", str(src), str(tmp_path / "fz"), *sets]) == 0
    assert same_function(fastzoo.create("vit_b16", pretrained=tmp_path / "fz"), ref)
    assert main(["convert", "vit_b16", str(tmp_path / "fz"), str(tmp_path / "back.safetensors"), "--to", "timm"]) == 0
    back = load_file(tmp_path / "back.safetensors")
    assert back.keys() == ref.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())
    # a checkpoint that does not fit: a one-line error naming the problem, exit status 2
    assert main(["convert", "vit_s16", str(src), str(tmp_path / "bad")]) == 2
