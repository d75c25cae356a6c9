"""Loading timm ViT weights from every source, exporting back, and refusing bad checkpoints."""
import json

import pytest
import timm
import torch
from safetensors.torch import save_file

import fastzoo
from fastzoo.errors import CheckpointError, UnknownModelError

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
ARCH = dict(embed_dim=64, depth=2, num_heads=4, patch_size=8)  # what weights cannot tell


@pytest.fixture
def ref():
    torch.manual_seed(0)
    return timm.create_model("vit_base_patch16_224", pretrained=False, **TINY).eval()


def same_function(model, ref):
    x = torch.randn(2, 3, 32, 32)
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
        assert model.config.num_classes == 10, name  # read from the head
        assert same_function(model, ref), name


def test_save_pretrained_directory_defines_the_architecture(ref, tmp_path):
    model = fastzoo.create("vit_b16", pretrained=ref, **ARCH)
    model.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["embed_dim"] == 64 and cfg["fastzoo_model"] == "vit_b16"
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
    with pytest.raises(ValueError, match="format='hf'"):
        fastzoo.export_state_dict(model, "hf")


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
    with pytest.raises(ValueError, match="img_size=\\(30, 30\\) is not divisible by patch_size=8"):
        fastzoo.create("vit_b16", img_size=30, patch_size=8, embed_dim=64, depth=1, num_heads=4)
    with pytest.raises(ValueError, match="global_pool='max'"):
        fastzoo.create("vit_b16", global_pool="max")


def test_wrong_image_shape_is_named():
    model = fastzoo.create("vit_b16", **TINY)
    with pytest.raises(ValueError, match="images are 48x48, the model was built for img_size=\\(32, 32\\)"):
        model(torch.randn(1, 3, 48, 48))
    with pytest.raises(ValueError, match="images must be \\[B, C, H, W\\]"):
        model(torch.randn(3, 32, 32))
