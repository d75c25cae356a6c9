"""benchmarks/peer_suites: the runner that runs the peers' own tests against fastzoo needs a
checkout of the peer (not available in CI); here its pieces are checked without one: the
command line, the verdict rules, and that each swap builds the fastzoo model a user would get
from the same arguments (values compared with the peer's model on the same weights)."""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import SPECS, TINY

import fastzoo

SUITES = Path(__file__).resolve().parents[1] / "benchmarks" / "peer_suites"
sys.path.insert(0, str(SUITES))

import run  # noqa: E402
import swap_hf_gpt2  # noqa: E402
import swap_hf_vision  # noqa: E402
import swap_hf_llama  # noqa: E402
from fastzoo.models.decoder.convert import LLAMA_LAYOUTS  # noqa: E402
import swap_timm  # noqa: E402
import swap_hf_detectors  # noqa: E402
from fastzoo.equivalence.rule import compare_outputs  # noqa: E402
from fastzoo.equivalence.weights import draw_  # noqa: E402


def test_help_runs_and_a_missing_checkout_is_one_line_exit_2(tmp_path):
    assert subprocess.run([sys.executable, str(SUITES / "run.py"), "--help"], capture_output=True).returncode == 0
    bad = subprocess.run([sys.executable, str(SUITES / "run.py"), "timm", "--checkout", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--checkout" in bad.stderr and "Traceback" not in bad.stderr


def test_verdicts_baseline_first_then_refusal_then_table_else_unclassified():
    table = {"test_a": (run.REFUSED, "why")}
    failed = {"outcome": "failed", "message": "x"}
    assert run.classify("t.py::C::test_ok", {"outcome": "passed", "message": ""}, None, table) is None
    assert run.classify("t.py::C::test_b", failed, {"t.py::C::test_b": {"outcome": "failed", "message": "m"}}, table) \
        == (run.ORIGINAL_TOO, "m")
    refused = {"outcome": "failed", "message": "swap.NotProvidedByFastzoo: no GPT2Model"}
    assert run.classify("t.py::C::test_b", refused, {}, table) == (run.NOT_APPLICABLE, "no GPT2Model")
    assert run.classify("t.py::C::test_a_3_fp32", failed, {}, table) == (run.REFUSED, "why")  # parameters stripped
    assert run.classify("t.py::test_a[1-resnet50]", failed, {}, table) == (run.REFUSED, "why")
    assert run.classify("t.py::C::test_c", failed, {}, table) == (run.UNCLASSIFIED, "x")


def test_hf_swap_builds_fastzoo_gpt2_computing_hfs_function():
    cfg = transformers.GPT2Config(**TINY["gpt2"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    m = swap_hf_gpt2.FastzooGPT2LMHeadModel(cfg)
    assert isinstance(m, fastzoo.models.decoder.GPT2LMHeadModel)
    assert m.config.n_embd == cfg.n_embd and m.config.vocab_size == cfg.vocab_size
    m.load_state_dict(fastzoo.create("gpt2", pretrained=hf).state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    assert (m.eval()(ids).logits - hf(ids).logits).abs().max() <= 1e-4
    assert swap_hf_gpt2.FastzooGPT2LMHeadModel.__name__ == "GPT2LMHeadModel"
    assert swap_hf_gpt2.FastzooGPT2LMHeadModel.can_generate()  # class look-ups are fastzoo's class's
    with pytest.raises(swap_hf_gpt2.NotProvidedByFastzoo, match="add_cross_attention"):
        swap_hf_gpt2.FastzooGPT2LMHeadModel(transformers.GPT2Config(add_cross_attention=True))


def test_hf_vision_swap_builds_fastzoo_models_computing_transformers_function():
    vit = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                                 image_size=30, patch_size=2, num_labels=10, attn_implementation="eager")
    resnet = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[32, 64], depths=[1, 1], layer_type="bottleneck")
    for arch, cfg, x in (("ViTForImageClassification", vit, torch.randn(2, 3, 30, 30)),
                         ("ResNetModel", resnet, torch.randn(2, 3, 64, 64))):
        torch.manual_seed(0)
        hf = getattr(transformers, arch)(cfg).eval()
        m = swap_hf_vision.build(arch)(cfg)
        assert type(m).__name__ == ("VisionTransformer" if arch.startswith("ViT") else "ResNet")
        m.load_state_dict(fastzoo.create(pretrained=hf).state_dict())
        want, got = hf(pixel_values=x), m.eval()(pixel_values=x)
        assert type(got) is type(want)
        key = "logits" if arch.startswith("ViT") else "pooler_output"
        assert (got[key] - want[key]).abs().max() <= 1e-4
    odd = transformers.ResNetConfig(hidden_sizes=[10, 20], depths=[1, 1], downsample_in_bottleneck=True)
    with pytest.raises(swap_hf_vision.NotProvidedByFastzoo, match="downsample_in_bottleneck"):
        swap_hf_vision.build("ResNetModel")(odd)


@pytest.mark.parametrize("layout", [t for t in swap_hf_llama.LAYOUTS if t in LLAMA_LAYOUTS])
def test_hf_swap_builds_each_llama_layout_with_the_configs_attention(layout):
    """The swapped ``<Layout>ForCausalLM(config)`` is fastzoo's model of that layout, on the backend
    ``config._attn_implementation`` names, computing transformers' function on the same weights;
    the class answers transformers' flags as fastzoo declares them (what HF's tests read)."""
    cfg = transformers.AutoConfig.for_model(layout, vocab_size=64, hidden_size=32, intermediate_size=40,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            pad_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    cls = swap_hf_llama.swapped_class(layout)
    m = cls(cfg)
    assert m.config.model_type == layout and m.attn_name == "eager" and m.config._attn_implementation == "eager"
    m.load_state_dict(fastzoo.create(layout, pretrained=hf).state_dict())
    ids = torch.randint(0, 64, (2, 7))
    assert (m.eval()(ids).logits - hf(ids).logits).abs().max() <= 1e-4
    assert cls.__name__ == type(hf).__name__ and cls._supports_sdpa and cls._can_set_attn_implementation()


def test_timm_swap_builds_fastzoo_with_timms_keywords():
    import timm

    m = swap_timm.fastzoo_create_model("resnet50.a1_in1k", pretrained=False, num_classes=3)
    assert isinstance(m, fastzoo.models.resnet.ResNet) and m.num_classes == 3
    ref = timm.create_model("resnet50", pretrained=False, num_classes=3).eval()
    fastzoo.load_pretrained(m, ref)
    m.eval()
    x = torch.randn(1, 3, 64, 64)
    assert (m(x) - ref(x)).abs().max() <= 1e-4
    with pytest.raises(swap_timm.NotProvidedByFastzoo, match="pretrained=True"):
        swap_timm.fastzoo_create_model("resnet50", pretrained=True)
    with pytest.raises(swap_timm.NotProvidedByFastzoo, match="no convnext"):
        swap_timm.fastzoo_create_model("convnext_tiny")


@pytest.mark.parametrize("version", ["rt_detr", "rt_detr_v2"])
def test_hf_rt_detr_swap_builds_fastzoo_rt_detr_of_the_configs_version(version):
    """The swapped ``RTDetr[V2]ForObjectDetection(config)`` on transformers' test config (its ResNet-vd of
    widths 10..40, three maps) is fastzoo's RT-DETR of that version, computing transformers' function on the
    same drawn weights; a backbone fastzoo does not build (transformers' plain ResNet) is refused by name."""
    v2 = version == "rt_detr_v2"
    backbone = transformers.RTDetrResNetConfig(embeddings_size=10, hidden_sizes=[10, 20, 30, 40], depths=[1, 1, 2, 1],
                                               out_features=["stage2", "stage3", "stage4"], out_indices=[2, 3, 4])
    config_class = transformers.RTDetrV2Config if v2 else transformers.RTDetrConfig
    cfg = config_class(backbone_config=backbone, encoder_hidden_dim=32, encoder_in_channels=[20, 30, 40],
                       encoder_ffn_dim=64, encoder_attention_heads=2, d_model=32, num_queries=30, decoder_ffn_dim=64,
                       decoder_in_channels=[32, 32, 32], decoder_layers=2, decoder_attention_heads=2, num_denoising=0,
                       num_labels=10, disable_custom_kernels=True)
    torch.manual_seed(0)
    hf = draw_((transformers.RTDetrV2ForObjectDetection if v2 else transformers.RTDetrForObjectDetection)(cfg)).eval()
    cls = swap_hf_detectors.STAND_INS["RTDetrV2" if v2 else "RTDetr"]
    m = cls(cfg)
    assert isinstance(m, fastzoo.models.rt_detr.RTDetrForObjectDetection) and m.config.model_type == version
    assert cls.__name__ == type(hf).__name__ and not cls.can_generate()  # class look-ups are fastzoo's class's
    m.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (m.eval()(pixel_values=x).logits - hf(pixel_values=x).logits).abs().max() <= 1e-4  # the fp32 rule
    plain_resnet = config_class(backbone_config=transformers.ResNetConfig(out_features=["stage2", "stage3", "stage4"]))
    with pytest.raises(swap_hf_detectors.NotProvidedByFastzoo, match="model_type='resnet'.*ResNet-vd"):
        cls(plain_resnet)


@pytest.mark.parametrize("module", sorted(m for m, f in swap_hf_detectors.FAMILIES.items() if f.package != "rt_detr"))
def test_hf_detector_swap_builds_fastzoo_detector_from_the_transformers_config(module):
    """The swapped ``DFineForObjectDetection(config)`` / ``RfDetrForObjectDetection(config)`` on a transformers config
    (the family's tiny one) is fastzoo's detector computing transformers' function on the same drawn weights (eval
    logits, the fp32 rule with transformers' own fp32 error from its fp64 run: RF-DETR's drawn box deltas amplify
    rounding, tests/test_rf_detr.py); a backbone fastzoo does not build is refused by name."""
    family = swap_hf_detectors.FAMILIES[module]
    spec = SPECS[family.package]
    torch.manual_seed(0)
    hf = draw_(spec.original.build(dict(spec.tiny))).eval()
    cls = swap_hf_detectors.STAND_INS[family.prefix]
    m = cls(hf.config)
    assert isinstance(m, swap_hf_detectors.detector_class(family)) and cls.__name__ == type(hf).__name__
    fastzoo.load_pretrained(m, hf)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        got, want = m.eval()(pixel_values=x).logits, hf(pixel_values=x).logits
        exact = copy.deepcopy(hf).double()(pixel_values=x.double()).logits
    c = compare_outputs("logits", got, want, exact=exact)
    assert c.passed, (c.err, c.bound)
    unbuilt, named = {"d_fine": ({"model_type": "resnet"}, "model_type='resnet'"),
                      "rf_detr": ({"use_swiglu_ffn": True}, "use_swiglu_ffn=True")}[family.package]
    bad = hf.config.to_dict()
    bad["backbone_config"] = {**bad["backbone_config"], **unbuilt}
    with pytest.raises(swap_hf_detectors.NotProvidedByFastzoo, match=named):
        cls(type(hf.config).from_dict(bad))


def test_recorded_peer_suites_are_the_verdict_tables_and_the_detectors_leave_no_gap():
    """Each recorded run (``<suite>.json`` beside run.py's default ``--out``) classified again by run.py's
    rules and tables gives its recorded verdicts, reasons reworded or not (``--reclassify`` keeps them in step;
    a baseline failure whose original run was not kept stays "fails on the original too"), and the detection
    family's suites (DETR, Deformable DETR, RT-DETR, RT-DETRv2, D-FINE, RF-DETR) leave no real gap and nothing
    unclassified."""
    import json

    recorded = {key: run.DEFAULT_OUT / f"{key}.json" for key in run.SUITES}
    recorded = {key: f for key, f in recorded.items() if f.is_file()}
    detectors = ("hf-detr", "hf-deformable-detr", "hf-rt-detr", "hf-rt-detr-v2", "hf-d-fine", "hf-rf-detr")
    assert set(detectors) <= set(recorded)
    for key, f in recorded.items():
        tests = json.loads(f.read_text())["tests"]
        kept = run.DEFAULT_OUT / f"{key}-original.json"
        baseline = json.loads(kept.read_text())["tests"] if kept.is_file() else None
        for nodeid, t in tests.items():
            got = run.classify(nodeid, t, baseline, run.SUITES[key]["verdicts"])
            if baseline is None and t.get("verdict") == run.ORIGINAL_TOO:
                continue
            assert (got and got[0]) == t.get("verdict"), (key, nodeid)
        if key in detectors:
            open_gaps = {n: t["verdict"] for n, t in tests.items() if t.get("verdict") in (run.REAL_GAP, run.UNCLASSIFIED)}
            assert not open_gaps, (key, open_gaps)


# -- a peer's own training script (train_script.py) ---------------------------------------------
import train_script  # noqa: E402

_LOG = """Epoch: [0]  [0/6]  eta: 0:00:05  lr: 0.01  img/s: 4.1  loss: 1.3573 (1.3573)  acc1: 25.0 (25.0)
Epoch: [0]  [1/6]  eta: 0:00:03  lr: 0.01  img/s: 5.0  loss: 1.3573 (1.8541)  acc1: 0.0 (12.5)
Test:   Acc@1 16.667 Acc@5 83.333
"""


def test_train_script_help_runs_and_a_missing_checkout_is_one_line_exit_2(tmp_path):
    script = SUITES / "train_script.py"
    assert subprocess.run([sys.executable, str(script), "--help"], capture_output=True).returncode == 0
    bad = subprocess.run([sys.executable, str(script), "torchvision", "--checkout", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--checkout" in bad.stderr and "Traceback" not in bad.stderr


def test_train_script_data_is_an_image_folder_with_enough_classes_for_top5(tmp_path):
    import torchvision

    root = train_script.make_image_folder(tmp_path)
    train = torchvision.datasets.ImageFolder(root / "train")
    val = torchvision.datasets.ImageFolder(root / "val")
    assert len(train.classes) == len(val.classes) == train_script.CLASSES >= 5  # the script's Acc@5 needs 5
    assert len(train) == 4 * train_script.CLASSES and len(val) == 2 * train_script.CLASSES


def test_train_script_reads_the_logged_losses_and_tells_a_difference():
    steps = [{"step": int(m[1]), "loss": m[2], "loss_mean": m[3]} for m in train_script.STEP.finditer(_LOG)]
    assert steps == [{"step": 0, "loss": "1.3573", "loss_mean": "1.3573"},
                     {"step": 1, "loss": "1.3573", "loss_mean": "1.8541"}]
    run = {"steps": steps, "acc1": "16.667"}
    assert train_script.compare(run, run)["printed_digits_identical"]
    other = {"steps": [steps[0], {**steps[1], "loss_mean": "1.8542"}], "acc1": "16.667"}
    c = train_script.compare(run, other)
    assert not c["printed_digits_identical"] and c["max_loss_mean_diff"] == pytest.approx(1e-4)
