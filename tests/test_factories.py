"""fastzoo's image classifiers through timm's ``create_model`` and torchvision's ``get_model``:
registered as ``fastzoo_<name>`` when the user imports those libraries, never imported by
``import fastzoo`` itself; timm's keyword arguments and its ``pretrained_cfg_overlay=dict(file=...)``
work as on timm's own models."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastzoo
from fastzoo.factories import PREFIX, names
from fastzoo.models.resnet.model import ResNet
from fastzoo.models.vit.model import VisionTransformer
from fastzoo.tasks import IMAGE_CLASSIFICATION

timm = pytest.importorskip("timm")
ROOT = Path(__file__).resolve().parents[1]
SAME_WEIGHTS_ATOL = 1e-5  # one checkpoint in three models of the same function, fp32: only reassociation differs


def _python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_import_fastzoo_imports_neither_library_and_registers_when_the_user_does():
    out = _python(
        "import sys, fastzoo\n"
        "print(sorted(m for m in ('timm', 'torchvision') if m in sys.modules))\n"
        "import torchvision\n"
        "print(len(torchvision.models.list_models(include='fastzoo_*')))\n"
        "import timm\n"
        "print(len(timm.list_models('fastzoo_*')))\n"
    )
    imported, in_torchvision, in_timm = out.split("\n")[:3]
    assert imported == "[]"
    assert int(in_torchvision) == int(in_timm) == len(names()) > 0


def test_a_library_imported_before_fastzoo_is_registered_with_at_once():
    out = _python("import timm, fastzoo\nprint(timm.is_model('fastzoo_resnet50'), timm.is_model('fastzoo_vit_b16'))")
    assert out.split() == ["True", "True"]


def test_a_library_looked_up_before_it_is_imported_is_still_registered_with():
    """transformers asks ``importlib.util.find_spec("timm")`` whether timm is installed, which finds
    without importing: the import that follows must still register fastzoo's names."""
    out = _python("import importlib.util, fastzoo\nassert importlib.util.find_spec('timm') is not None\n"
                  "import timm\nprint(timm.is_model('fastzoo_resnet50'), timm.is_model('fastzoo_vit_b16'))")
    assert out.split() == ["True", "True"]


@pytest.mark.parametrize("family", sorted(p.name for p in (ROOT / "fastzoo" / "models").iterdir()
                                           if (p / "__init__.py").exists()))
def test_a_family_imported_first_still_registers_with_both_libraries_without_a_warning(family):
    """A model module imported before torchvision and timm (a script's ``from fastzoo.models.X import ...``):
    its own imports (transformers pulls in torchvision) register fastzoo's names, which imports every
    family, and must not find this one half-initialised."""
    out = _python(f"import warnings\nwarnings.simplefilter('error')\nimport fastzoo.models.{family}\n"
                  "import torchvision, timm\n"
                  "print(len(torchvision.models.list_models(include='fastzoo_*')), len(timm.list_models('fastzoo_*')))")
    assert out.split() == [str(len(set(timm.list_models("fastzoo_*"))))] * 2


def test_every_image_classifier_name_is_in_both_factories():
    from torchvision.models import list_models

    expected = {PREFIX + n for n in fastzoo.list_models() if fastzoo.registry.get_entry(n).spec.task is IMAGE_CLASSIFICATION}
    assert "fastzoo_vit_base_patch16_224" in expected and "fastzoo_resnet50" in expected and "fastzoo_gpt2" not in expected
    assert set(timm.list_models("fastzoo_*")) == expected
    assert set(list_models(include="fastzoo_*")) == expected


def test_timm_create_model_takes_timms_keyword_arguments():
    model = timm.create_model("fastzoo_vit_small_patch16_224", pretrained=False, num_classes=10, drop_path_rate=0.1,
                              depth=2, in_chans=3)
    assert isinstance(model, VisionTransformer)
    assert (model.num_classes, len(model.blocks), model.config.drop_path_rate) == (10, 2, 0.1)
    assert model.pretrained_cfg == timm.models.resolve_pretrained_cfg("vit_small_patch16_224").to_dict()
    resnet = timm.create_model("fastzoo_resnet50", num_classes=3)
    assert isinstance(resnet, ResNet) and resnet.num_classes == 3


def test_pretrained_cfg_overlay_file_round_trip_through_save_pretrained(tmp_path):
    shrink = dict(depth=1, num_classes=5)
    saved = fastzoo.create("vit_small_patch16_224", **shrink).eval()
    saved.save_pretrained(tmp_path)
    file = str(next(tmp_path.glob("*.safetensors")))
    # timm keeps the file's head only where the config's num_classes is the model's; the default
    # tag's weights are a JAX .npz that timm reads its own way (custom_load)
    overlay = dict(file=file, num_classes=shrink["num_classes"], custom_load=False)
    ours = timm.create_model("fastzoo_vit_small_patch16_224", pretrained=True, pretrained_cfg_overlay=overlay,
                             **shrink).eval()
    theirs = timm.create_model("vit_small_patch16_224", pretrained=True, pretrained_cfg_overlay=overlay, **shrink).eval()
    assert isinstance(ours, VisionTransformer) and ours.pretrained_cfg["file"] == file
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = saved(x)
        assert (ours(x) - want).abs().max() <= SAME_WEIGHTS_ATOL
        assert (theirs(x) - want).abs().max() <= SAME_WEIGHTS_ATOL


def test_timm_pretrained_without_a_local_file_is_refused_naming_the_overlay():
    with pytest.raises(ValueError, match=r"pretrained_cfg_overlay=dict\(file="):
        timm.create_model("fastzoo_resnet50", pretrained=True)


def test_torchvision_get_model_builds_fastzoo_models():
    from torchvision.models import get_model

    model = get_model("fastzoo_resnet50", weights=None, num_classes=7)
    assert isinstance(model, ResNet) and model.fc.out_features == 7
    with pytest.raises(ValueError, match="weights='DEFAULT'.*weights=None"):
        get_model("fastzoo_resnet50", weights="DEFAULT")
