"""Run a peer library's own model tests against fastzoo, as a new user would, and classify
every failure.

    python benchmarks/peer_suites/run.py hf-gpt2 --checkout ~/src/transformers
    python benchmarks/peer_suites/run.py timm --checkout ~/src/pytorch-image-models
    python benchmarks/peer_suites/run.py torchvision --checkout ~/src/vision

``--checkout`` is a checkout (or unpacked sdist) of the peer whose tests match the installed
version: transformers' ``tests/models/gpt2/test_modeling_gpt2.py`` with what it imports,
timm's ``tests/test_models.py`` or torchvision's ``test/test_backbone_utils.py``. Nothing is downloaded and nothing of the peer's code is kept
here. Each suite runs twice in fresh pytest processes: on the peer's own model (the baseline:
what fails there is the suite against this library version, not fastzoo) and with the swap
plugin (``swap_hf_gpt2.py`` / ``swap_timm.py`` / ``swap_torchvision.py``: the models replaced by
fastzoo's, test bodies untouched). Every test that does not pass with the swap gets a verdict:

- ``refused on purpose``: fastzoo declines it by design (the reason is its documented refusal);
- ``not applicable``: the test is about a class or feature fastzoo does not provide at all;
- ``fails on the original too``: the baseline fails or skips it the same way;
- ``real gap``: fastzoo should pass and does not;
- ``unclassified``: none of the above is known (a new failure: look at it).

Writes ``<suite>.json`` (every test: outcome, first error line, verdict) and ``<suite>.md``
under ``--out`` (default ``benchmarks/results/cpu-2core/peer_suites``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the swap plugins beside this file name the layouts

import swap_hf_llama  # noqa: E402
ROOT = HERE.parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cpu-2core" / "peer_suites"

REFUSED, NOT_APPLICABLE, ORIGINAL_TOO, REAL_GAP, UNCLASSIFIED = (
    "refused on purpose", "not applicable", "fails on the original too", "real gap", "unclassified")


# -- suites ------------------------------------------------------------------------------------
# Verdicts for the tests that do not pass with the swap, by test name (parameter suffix
# stripped) -> (verdict, reason). Read from the recorded runs; a test not listed here whose
# failure is not explained by the rules in `classify` comes out "unclassified".
_ATTENTIONS = (REFUSED, "output_attentions: fastzoo's attention kernels return no weights; refused by name "
                         "(the decoders' forward, models/decoder/causal_lm.py), none returned for config.output_attentions")
_LOADING = (REFUSED, "transformers' loading options / loading info (output_loading_info, from_pretrained(None, "
                     "state_dict=)): fastzoo loads with create(pretrained=...), all or nothing, so there is no "
                     "partial-load report")
_HF_INTERNALS = (NOT_APPLICABLE, "reads transformers' PreTrainedModel internals (GradientCheckpointingLayer modules, "
                                 "_keep_in_fp32_modules, init_weights/post_init, base_model, base_model_prefix): "
                                 "fastzoo's decoders are not PreTrainedModels by design (models/decoder/generation.py "
                                 "says why); the behaviour behind them is tested in tests/test_gpt2_hf_api.py and "
                                 "tests/test_llama.py")
# the verdicts every transformers causal-LM suite shares (GPT-2's, Llama's)
HF_DECODER_VERDICTS: dict[str, tuple[str, str]] = {
    "test_attention_outputs": _ATTENTIONS,
    "test_model_outputs_equivalence": _ATTENTIONS,
    "test_retain_grad_hidden_states_attentions": _ATTENTIONS,
    "test_greedy_generate_dict_outputs": _ATTENTIONS,
    "test_greedy_generate_dict_outputs_use_cache": _ATTENTIONS,
    "test_sample_generate_dict_output": _ATTENTIONS,
    "test_beam_search_generate_dict_output": _ATTENTIONS,
    "test_beam_search_generate_dict_outputs_use_cache": _ATTENTIONS,
    "test_beam_sample_generate_dict_output": _ATTENTIONS,
    "test_can_use_safetensors": _LOADING,
    "test_load_save_without_tied_weights": _LOADING,
    "test_from_pretrained_no_checkpoint": _LOADING,
    "test_model_weights_reload_no_missing_tied_weights": (
        REFUSED, "the test writes a safetensors file of foreign keys and expects a partial load; fastzoo refuses a "
                 "checkpoint it cannot read whole (all-or-nothing loading)"),
    "test_cannot_load_with_meta_device_context_manager": (
        REFUSED, "pretrained= inside a torch.device('meta') context is refused with fastzoo's own ValueError naming "
                 "it; the test expects transformers' RuntimeError text"),
    "test_inherits_generation_mixin": (
        REFUSED, "the class is not a GenerationMixin subclass: generate is transformers' GenerationMixin bound to "
                 "the model on each call (models/decoder/generation.py), by design"),
    "test_sliding_window_mask": _ATTENTIONS,
    "test_eager_matches_sdpa_inference_24_fp32_pad_left_output_attentions": _ATTENTIONS,
    "test_can_init_all_missing_weights": _LOADING,
    "test_custom_4d_attention_mask": (
        REFUSED, "a 4-D attention_mask (custom attention pattern) is refused by name (layers/sequence.py): fastzoo's "
                 "decoders take the 2-D padding mask, packed sequences (cu_seqlens / restarting position_ids) and "
                 "flex's mask_mod"),
    "test_generate_compile_model_forward_fullgraph": (
        REFUSED, "generate(compile_config=...): fastzoo refuses generate's automatic compilation by name (its static "
                 "cache path reads the keys written so far, a shape that changes every step); torch.compile(model) "
                 "compiles the forward, without graph breaks"),
    "test_generate_compilation_all_outputs": (
        REFUSED, "generate with compile_config (refused by name, as test_generate_compile_model_forward_fullgraph) and "
                 "output_attentions=True (no attention weights)"),
    "test_gradient_checkpointing_enable_disable": _HF_INTERNALS,
    "test_training_gradient_checkpointing": _HF_INTERNALS,
    "test_training_gradient_checkpointing_use_reentrant_false": _HF_INTERNALS,
    "test_training_gradient_checkpointing_use_reentrant_true": _HF_INTERNALS,
    "test_keep_in_fp32_modules": _HF_INTERNALS,
    "test_keep_in_fp32_modules_exist": _HF_INTERNALS,
    "test_all_tensors_are_parameter_or_buffer": _HF_INTERNALS,
    "test_init_weights_can_init_buffers": _HF_INTERNALS,
    "test_resize_embeddings_untied_no_reinit_on_post_init": _HF_INTERNALS,
    "test_correct_missing_keys": _HF_INTERNALS,
}
HF_GPT2_VERDICTS: dict[str, tuple[str, str]] = {
    **HF_DECODER_VERDICTS,
    "test_gpt2_scale_attn_by_inverse_layer_idx": (
        REFUSED, "labels in train mode: the loss is fused with the LM head and .logits is None (documented in "
                 "GPT2LMHeadModel.forward); the test reads .logits.shape of a training forward"),
    "test_gpt2_reorder_and_upcast_attn": (
        REFUSED, "as test_gpt2_scale_attn_by_inverse_layer_idx: fused train-mode loss, .logits is None (the test's "
                 "config does not actually set reorder_and_upcast_attn: its prepare_config_and_inputs returns the "
                 "config built before the flag)"),
    "test_gpt2_sdpa_matches_eager_with_scaling_configs": (
        REFUSED, "model.set_attn_implementation: transformers' switch; fastzoo's is model.set_attention(name)"),
    "test_model_base_model_prefix": (NOT_APPLICABLE, "model.base_model is transformers' GPT2Model, which fastzoo does "
                                                     "not provide"),
}

HF_LLAMA_VERDICTS: dict[str, tuple[str, str]] = {
    **HF_DECODER_VERDICTS,
    "test_model_base_model_prefix": (NOT_APPLICABLE, "model.base_model is transformers' LlamaModel, which fastzoo does "
                                                     "not provide"),
    "test_tp_plan_matches_params": (NOT_APPLICABLE, "model.tp_plan: transformers' tensor-parallel plan; fastzoo's "
                                                    "distributed training is DDP / FSDP (fastzoo.train.distributed)"),
    **dict.fromkeys(("test_tp_forward", "test_tp_backward", "test_tp_generation"), (
        NOT_APPLICABLE, "transformers' tensor parallelism (from_pretrained(tp_plan='auto') in spawned processes, "
                        "which pickle the class by its transformers name); fastzoo's distributed training is DDP / "
                        "FSDP (fastzoo.train.distributed)")),
}

_DETR_ATTENTIONS = (REFUSED, "output_attentions / output_hidden_states: fastzoo's DETR runs attention through kernels "
                             "that return no weights and keeps no per-layer states; refused by name in its forward "
                             "(models/detr/model.py), none returned for the config's flags")
_DETR_INTERNALS = (NOT_APPLICABLE, "reads transformers' PreTrainedModel internals (init_weights, _keep_in_fp32_modules, "
                                   "_can_set_attn_implementation, token-embedding resizing, GenerationMixin, "
                                   "base_model_prefix): fastzoo's DETR is a FastzooModel with transformers' call, output, "
                                   "save_pretrained and Trainer conventions (tests/test_detr.py), not a PreTrainedModel")
HF_DETR_VERDICTS: dict[str, tuple[str, str]] = {
    **{k: v for k, v in HF_DECODER_VERDICTS.items() if v in (_LOADING,) or k in (
        "test_model_weights_reload_no_missing_tied_weights", "test_cannot_load_with_meta_device_context_manager")},
    **dict.fromkeys(("test_attention_outputs", "test_hidden_states_output", "test_retain_grad_hidden_states_attentions"),
                    _DETR_ATTENTIONS),
    **dict.fromkeys(("test_all_tensors_are_parameter_or_buffer", "test_init_weights_can_init_buffers",
                     "test_keep_in_fp32_modules", "test_keep_in_fp32_modules_exist", "test_can_set_attention_dynamically",
                     "test_can_set_attention_dynamically_composite_model", "test_generation_tester_mixin_inheritance",
                     "test_model_base_model_prefix", "test_resize_embeddings_untied",
                     "test_resize_embeddings_untied_no_reinit_on_post_init"), _DETR_INTERNALS),
    "test_detr_model": (NOT_APPLICABLE, "DetrModel (the bare encoder-decoder): fastzoo provides DetrForObjectDetection"),
}

_DEFORMABLE_ATTENTIONS = (REFUSED, "output_attentions / output_hidden_states: fastzoo's Deformable DETR runs its "
                                  "attention through kernels that return no weights (the deformable seam's fused "
                                  "kernels, SDPA) and keeps no per-layer states; refused by name in its forward "
                                  "(models/deformable_detr/model.py)")
_DEFORMABLE_INTERNALS = (NOT_APPLICABLE, _DETR_INTERNALS[1].replace("fastzoo's DETR", "fastzoo's Deformable DETR")
                         .replace("tests/test_detr.py", "tests/test_deformable_detr.py"))
HF_DEFORMABLE_DETR_VERDICTS: dict[str, tuple[str, str]] = {
    **{k: v for k, v in HF_DETR_VERDICTS.items() if v not in (_DETR_ATTENTIONS, _DETR_INTERNALS) and k != "test_detr_model"},
    **{k: _DEFORMABLE_ATTENTIONS for k, v in HF_DETR_VERDICTS.items() if v == _DETR_ATTENTIONS},
    **{k: _DEFORMABLE_INTERNALS for k, v in HF_DETR_VERDICTS.items() if v == _DETR_INTERNALS},
    "test_model_outputs_equivalence": _DEFORMABLE_ATTENTIONS,  # its tuple-vs-dict check asks for both flags
    "test_deformable_detr_model": (NOT_APPLICABLE, "DeformableDetrModel (the bare encoder-decoder): fastzoo provides "
                                                   "DeformableDetrForObjectDetection"),
}

_RT_DETR_ATTENTIONS = (REFUSED, _DEFORMABLE_ATTENTIONS[1].replace("Deformable DETR", "RT-DETR")
                       .replace("deformable_detr/model.py", "rt_detr/model.py"))
_RT_DETR_INTERNALS = (NOT_APPLICABLE, _DETR_INTERNALS[1].replace("fastzoo's DETR", "fastzoo's RT-DETR")
                      .replace("tests/test_detr.py", "tests/test_rt_detr.py"))
HF_RT_DETR_VERDICTS: dict[str, tuple[str, str]] = {
    **{k: v for k, v in HF_DEFORMABLE_DETR_VERDICTS.items() if v not in (_DEFORMABLE_ATTENTIONS, _DEFORMABLE_INTERNALS)
       and k != "test_deformable_detr_model"},
    **{k: _RT_DETR_ATTENTIONS for k, v in HF_DEFORMABLE_DETR_VERDICTS.items() if v == _DEFORMABLE_ATTENTIONS},
    **{k: _RT_DETR_INTERNALS for k, v in HF_DEFORMABLE_DETR_VERDICTS.items() if v == _DEFORMABLE_INTERNALS},
    "test_correct_missing_keys": _RT_DETR_INTERNALS,  # base_model_prefix (RT-DETRv2's file switches the test off)
}

_D_FINE_ATTENTIONS = (REFUSED, _RT_DETR_ATTENTIONS[1].replace("RT-DETR", "D-FINE").replace("rt_detr/model.py", "d_fine/model.py"))
_D_FINE_INTERNALS = (NOT_APPLICABLE, _RT_DETR_INTERNALS[1].replace("RT-DETR", "D-FINE").replace("test_rt_detr.py", "test_d_fine.py"))
HF_D_FINE_VERDICTS: dict[str, tuple[str, str]] = {
    **{k: v for k, v in HF_RT_DETR_VERDICTS.items() if v not in (_RT_DETR_ATTENTIONS, _RT_DETR_INTERNALS)},
    **{k: _D_FINE_ATTENTIONS for k, v in HF_RT_DETR_VERDICTS.items() if v == _RT_DETR_ATTENTIONS},
    **{k: _D_FINE_INTERNALS for k, v in HF_RT_DETR_VERDICTS.items() if v == _RT_DETR_INTERNALS},
}
_RF_DETR_ATTENTIONS = (REFUSED, _RT_DETR_ATTENTIONS[1].replace("RT-DETR", "RF-DETR").replace("rt_detr/model.py", "rf_detr/model.py"))
_RF_DETR_INTERNALS = (NOT_APPLICABLE, _RT_DETR_INTERNALS[1].replace("RT-DETR", "RF-DETR").replace("test_rt_detr.py", "test_rf_detr.py"))
HF_RF_DETR_VERDICTS: dict[str, tuple[str, str]] = {
    **{k: v for k, v in HF_RT_DETR_VERDICTS.items() if v not in (_RT_DETR_ATTENTIONS, _RT_DETR_INTERNALS)},
    **{k: _RF_DETR_ATTENTIONS for k, v in HF_RT_DETR_VERDICTS.items() if v == _RT_DETR_ATTENTIONS},
    **{k: _RF_DETR_INTERNALS for k, v in HF_RT_DETR_VERDICTS.items() if v == _RT_DETR_INTERNALS},
    **dict.fromkeys(("test_training_gradient_checkpointing", "test_training_gradient_checkpointing_use_reentrant_false",
                     "test_training_gradient_checkpointing_use_reentrant_true"), (
        ORIGINAL_TOO, "transformers' RfDetrForObjectDetection declares supports_gradient_checkpointing=False, so on it "
                      "the test returns before its checks; fastzoo's checkpointing recomputes the same gradients "
                      "(tests/test_rf_detr.py), and the last check, every parameter has a gradient, fails on what "
                      "detection never reads: the DINOv2's mask_token and its block after the last output block, "
                      "which transformers' model leaves without gradients too (the same 15 parameters, measured "
                      "on this test's config)")),
}

# soft-capping layouts (Gemma 2 / 3): fastzoo's sdpa has no soft-capping and refuses to drop it
SOFTCAP_VERDICTS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("test_generate_with_static_cache", "test_generate_from_inputs_embeds_with_static_cache"), (
        REFUSED, "a static cache with sliding-window layers on a packed-only backend (varlen: fastzoo's default for a "
                 "soft-capping layout, sdpa having no soft-capping) is refused by name: it reads every key; with eager "
                 "the static cache generates transformers' tokens (tests/test_decoder_transformers_flags.py)")),
    **dict.fromkeys(("test_eager_matches_sdpa_inference", "test_sdpa_padding_matches_padding_free_with_position_ids",
                     "test_can_set_attention_dynamically", "test_sdpa_can_dispatch_non_composite_models"), (
        REFUSED, "attn_implementation='sdpa' on a soft-capping layout: fastzoo's sdpa backend has no attention-logit "
                 "soft-capping and refuses at create rather than drop it (transformers' sdpa_attention_forward takes no "
                 "softcap: it drops Gemma's soft-capping silently); eager, flex and varlen serve it")),
}

TIMM_VERDICTS: dict[str, tuple[str, str]] = {
    "test_model_forward_torchscript": (
        REFUSED, "torch.jit.script: TorchScript is deprecated in PyTorch and fastzoo's swappable attention "
                 "backends are plain Python objects (tests/test_peer_api.py)"),
    "test_model_forward_fx_torchscript": (
        REFUSED, "torch.jit.script of the FX feature extractor: TorchScript, as test_model_forward_torchscript"),
    "test_jit_forward_backward": (
        REFUSED, "torch.jit.script of the feature extractor: TorchScript, as timm's torchscript tests"),
}

# transformers' vision suites (ViT, ResNet), from the recorded runs
_VISION_ATTENTIONS = (REFUSED, "output_attentions: fastzoo's attention kernels return no weights; refused by name "
                               "(models/hf_outputs.py)")
_VISION_LOADING = (REFUSED, "transformers' loading options (output_loading_info, from_pretrained(num_labels=, "
                            "ignore_mismatched_sizes=), from_pretrained(None, state_dict=)) and partial loads: fastzoo "
                            "loads all or nothing with create(name, pretrained=...), a new head by num_classes=N")
_VISION_INTERNALS = (NOT_APPLICABLE, "reads transformers' PreTrainedModel internals (init_weights, base_model_prefix, "
                                     "_keep_in_fp32_modules, GradientCheckpointingLayer modules / is_gradient_checkpointing, "
                                     "enable_input_require_grads, _can_set_attn_implementation): fastzoo's image models are timm-API modules, not "
                                     "PreTrainedModels; gradient_checkpointing_enable() and the Trainer recipe are tested in "
                                     "tests/test_hf_vision.py")
_POSITIONAL = (REFUSED, "a positional model(pixel_values) is timm's call on the same model (the logits or pooled "
                        "features tensor; forward's first parameter is timm's images); transformers' convention is by "
                        "keyword, model(pixel_values=..., labels=...), which every ModelTesterMixin test uses")
HF_VISION_VERDICTS: dict[str, tuple[str, str]] = {
    "test_attention_outputs": _VISION_ATTENTIONS,
    "test_model_outputs_equivalence": _VISION_ATTENTIONS,
    "test_retain_grad_hidden_states_attentions": _VISION_ATTENTIONS,
    "test_can_use_safetensors": _VISION_LOADING,
    "test_load_save_without_tied_weights": _VISION_LOADING,
    "test_from_pretrained_no_checkpoint": _VISION_LOADING,
    "test_model_weights_reload_no_missing_tied_weights": _VISION_LOADING,
    "test_can_load_ignoring_mismatched_shapes": _VISION_LOADING,
    "test_cannot_load_with_meta_device_context_manager": (
        REFUSED, "pretrained= inside a torch.device('meta') context is refused with fastzoo's own ValueError naming "
                 "it; the test expects transformers' RuntimeError text"),
    **{name: _VISION_INTERNALS for name in (
        "test_all_tensors_are_parameter_or_buffer", "test_correct_missing_keys", "test_init_weights_can_init_buffers",
        "test_keep_in_fp32_modules", "test_keep_in_fp32_modules_exist", "test_enable_input_require_grads",
        "test_gradient_checkpointing_backward_compatibility", "test_gradient_checkpointing_enable_disable",
        "test_peft_gradient_checkpointing_enable_disable", "test_training_gradient_checkpointing",
        "test_training_gradient_checkpointing_use_reentrant_false", "test_training_gradient_checkpointing_use_reentrant_true",
        "test_can_set_attention_dynamically", "test_can_set_attention_dynamically_composite_model",
        "test_enable_input_require_grads_with_gradient_checkpointing")},
    "test_forward_signature": _POSITIONAL,
    "test_model": _POSITIONAL,
    "test_for_image_classification": _POSITIONAL,
    "test_model_main_input_name": _POSITIONAL,
}

SUITES = {
    "hf-gpt2": {
        "title": "transformers' tests/models/gpt2/test_modeling_gpt2.py against fastzoo's GPT-2",
        "target": "tests/models/gpt2/test_modeling_gpt2.py",
        "plugin": "swap_hf_gpt2",
        # the checkout's root conftest registers transformers' CI-only plugins (xdist network
        # logging) and TF32 flags; nothing in it selects or changes a model test
        "pytest_args": ["--noconftest"],
        "verdicts": HF_GPT2_VERDICTS,
    },
    **{f"hf-{folder}": {
        "title": f"transformers' tests/models/{folder}/test_modeling_{folder}.py against fastzoo's {model_type}",
        "target": f"tests/models/{folder}/test_modeling_{folder}.py",
        "plugin": "swap_hf_llama",
        # Gemma 3's file also tests the multimodal Gemma3ForConditionalGeneration: only its text model is fastzoo's
        "pytest_args": ["--noconftest"] + (["-k", "not Vision2Text"] if folder == "gemma3" else []),
        "verdicts": {**HF_LLAMA_VERDICTS, **(SOFTCAP_VERDICTS if folder.startswith("gemma") else {})},
    } for model_type, (folder, _, _) in swap_hf_llama.LAYOUTS.items()},
    "hf-vit": {
        "title": "transformers' tests/models/vit/test_modeling_vit.py against fastzoo's ViT",
        "target": "tests/models/vit/test_modeling_vit.py",
        "plugin": "swap_hf_vision",
        "pytest_args": ["--noconftest"],
        "verdicts": HF_VISION_VERDICTS,
    },
    "hf-resnet": {
        "title": "transformers' tests/models/resnet/test_modeling_resnet.py against fastzoo's ResNet",
        "target": "tests/models/resnet/test_modeling_resnet.py",
        "plugin": "swap_hf_vision",
        "pytest_args": ["--noconftest"],
        "verdicts": HF_VISION_VERDICTS,
    },
    "hf-detr": {
        "title": "transformers' tests/models/detr/test_modeling_detr.py against fastzoo's DETR",
        "target": "tests/models/detr/test_modeling_detr.py",
        "plugin": "swap_hf_detr",
        "pytest_args": ["--noconftest"],
        "verdicts": HF_DETR_VERDICTS,
    },
    "hf-deformable-detr": {
        "title": "transformers' tests/models/deformable_detr/test_modeling_deformable_detr.py against fastzoo's "
                 "Deformable DETR",
        "target": "tests/models/deformable_detr/test_modeling_deformable_detr.py",
        "plugin": "swap_hf_deformable_detr",
        "pytest_args": ["--noconftest"],
        "verdicts": HF_DEFORMABLE_DETR_VERDICTS,
    },
    **{f"hf-{key}": {
        "title": f"transformers' tests/models/{folder}/test_modeling_{folder}.py against fastzoo's {what}",
        "target": f"tests/models/{folder}/test_modeling_{folder}.py",
        "plugin": "swap_hf_detectors",
        "pytest_args": ["--noconftest"],
        "verdicts": verdicts,
    } for key, folder, what, verdicts in (("rt-detr", "rt_detr", "RT-DETR", HF_RT_DETR_VERDICTS),
                                          ("rt-detr-v2", "rt_detr_v2", "RT-DETRv2", HF_RT_DETR_VERDICTS),
                                          ("d-fine", "d_fine", "D-FINE", HF_D_FINE_VERDICTS),
                                          ("rf-detr", "rf_detr", "RF-DETR", HF_RF_DETR_VERDICTS))},
    "timm": {
        "title": "timm's tests/test_models.py against fastzoo's vit_b16 and resnet50",
        "target": "tests/test_models.py",
        "plugin": "swap_timm",
        "pytest_args": [],
        "verdicts": TIMM_VERDICTS,
    },
    "torchvision": {
        "title": "torchvision's test/test_backbone_utils.py (feature extraction, FPN backbone) against fastzoo's resnet50",
        "target": "test/test_backbone_utils.py",
        "plugin": "swap_torchvision",
        "pytest_args": [],
        "verdicts": TIMM_VERDICTS,
    },
}


def run_pytest(suite: dict, checkout: Path, swap: bool, extra: list[str], log: Path) -> tuple[dict, float]:
    """One pytest process in the checkout; returns {"tests": {nodeid: {outcome, message}},
    "deselected": n} and seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "record.json"
        env = {**os.environ, "PEER_SUITE_RECORD": str(record), "PEER_SUITE_SWAP": "1" if swap else "0"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(ROOT), env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "record",
               *suite["pytest_args"], "-p", suite["plugin"], suite["target"], *extra]
        start = time.perf_counter()
        with open(log, "w") as f:
            subprocess.run(cmd, cwd=checkout, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
        seconds = time.perf_counter() - start
        if not record.exists():
            raise SystemExit(f"pytest wrote no results (see {log}): is --checkout a checkout with {suite['target']}?")
        return json.loads(record.read_text()), seconds


def test_name(nodeid: str) -> str:
    """``...::Class::test_foo_3_fp32`` / ``test_foo[vit]`` -> ``test_foo`` (parameters stripped)."""
    name = nodeid.split("::")[-1].split("[")[0]
    return re.sub(r"(_\d+(_[a-z0-9]+)*)$", "", name)


def classify(nodeid: str, result: dict, baseline: dict | None, verdicts: dict) -> tuple[str, str] | None:
    if result["outcome"] in ("passed", "skipped"):
        return None
    message = result["message"]
    if baseline is not None and baseline.get(nodeid, {}).get("outcome") in ("failed", "error"):
        return ORIGINAL_TOO, baseline[nodeid]["message"]
    if "NotProvidedByFastzoo" in message:
        return NOT_APPLICABLE, message.split("NotProvidedByFastzoo:", 1)[-1].strip()
    for key in (nodeid.split("::")[-1], test_name(nodeid)):
        if key in verdicts:
            return verdicts[key]
    return UNCLASSIFIED, message


def counts(results: dict) -> dict:
    out = {"tests": len(results), "passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for r in results.values():
        out[r["outcome"]] += 1
    return out


def versions() -> dict:
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "timm", "torchvision"):
        try:
            v[name] = __import__(name).__version__
        except ImportError:
            pass
    return v


def write(out: Path, key: str, suite: dict, results: dict, baseline: dict | None, deselected: int,
          seconds: dict, load: str, source: str) -> None:
    tests = {}
    for nodeid, r in sorted(results.items()):
        verdict = classify(nodeid, r, baseline, suite["verdicts"])
        tests[nodeid] = {**r, **({"verdict": verdict[0], "reason": verdict[1]} if verdict else {}),
                         **({"baseline": baseline[nodeid]["outcome"]} if baseline and nodeid in baseline else {})}
    by_verdict: dict[str, int] = {}
    for t in tests.values():
        if "verdict" in t:
            by_verdict[t["verdict"]] = by_verdict.get(t["verdict"], 0) + 1
    summary = {"suite": suite["title"], "source": source, "versions": versions(), "load": load,
               "seconds": {k: round(v, 1) for k, v in seconds.items()}, "deselected": deselected, "fastzoo": counts(results), "verdicts": by_verdict,
               "original": counts(baseline) if baseline is not None else None}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{key}.json").write_text(json.dumps({"summary": summary, "tests": tests}, indent=1) + "\n")

    c, b = summary["fastzoo"], summary["original"]
    lines = [f"# {suite['title']}", "",
             f"Produced by `python benchmarks/peer_suites/run.py {key} --checkout <checkout>`; tests from: {source}.",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()) + f". Load before the run: {load}.",
             f"Deselected (not about a model fastzoo has): {deselected} tests.",
             "", "| run | tests | passed | failed | errors | skipped |", "|---|---|---|---|---|---|",
             f"| fastzoo swapped in | {c['tests']} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} |"]
    if b:
        lines.append(f"| the original's own model (baseline) | {b['tests']} | {b['passed']} | {b['failed']} | {b['error']} | {b['skipped']} |")
    lines += ["", "Not passing with fastzoo, by verdict: "
              + (", ".join(f"{k}: {v}" for k, v in sorted(by_verdict.items())) or "none") + ".", ""]
    for verdict in (REAL_GAP, UNCLASSIFIED, REFUSED, NOT_APPLICABLE, ORIGINAL_TOO):
        rows = [(n, t) for n, t in tests.items() if t.get("verdict") == verdict]
        if not rows:
            continue
        lines += [f"## {verdict} ({len(rows)})", "", "| test | outcome | reason |", "|---|---|---|"]
        for nodeid, t in rows:
            reason = t["reason"].replace("|", "\\|")[:300]
            lines.append(f"| `{nodeid.split('::', 1)[-1]}` | {t['outcome']} | {reason} |")
        lines.append("")
    skipped = [(n, t) for n, t in tests.items() if t["outcome"] == "skipped"]
    if skipped:
        lines += [f"## skipped with the swap ({len(skipped)})", "", "| test | reason |", "|---|---|"]
        lines += [f"| `{n.split('::', 1)[-1]}` | {t['message'].replace('|', '/')[:200]} |" for n, t in skipped]
        lines.append("")
    (out / f"{key}.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--checkout", type=Path, required=True, help="the peer's checkout (its tests/ folder inside)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--source", default="", help="where the checkout's tests came from (a line in the results)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run on the peer's own model")
    p.add_argument("--reclassify", action="store_true",
                   help="no pytest: the verdicts of this file applied again to --out's recorded <suite>.json")
    p.add_argument("--reuse-baseline", action="store_true",
                   help="take the run on the peer's own model from --out's <suite>-original.json (written by a full run)")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k forward")
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    if not (args.checkout / suite["target"]).is_file():
        p.error(f"--checkout: {args.checkout / suite['target']} does not exist")
    load = " ".join(os.getloadavg().__repr__().strip("()").split())
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reclassify:
        recorded = json.loads((args.out / f"{args.suite}.json").read_text())
        kept = args.out / f"{args.suite}-original.json"
        baseline = json.loads(kept.read_text())["tests"] if kept.is_file() else None
        old = recorded["summary"]
        results = {k: {"outcome": t["outcome"], "message": t["message"]} for k, t in recorded["tests"].items()}
        write(args.out, args.suite, suite, results, baseline, old["deselected"], old["seconds"], old["load"], old["source"])
        return 0
    seconds = {}
    baseline = None
    with tempfile.TemporaryDirectory() as logs:
        kept = args.out / f"{args.suite}-original.json"
        if args.reuse_baseline:
            if not kept.is_file():
                p.error(f"--reuse-baseline: {kept} does not exist (run once without it)")
            baseline = json.loads(kept.read_text())["tests"]
        elif not args.no_baseline:
            base, seconds["original"] = run_pytest(suite, args.checkout, False, args.pytest_args, Path(logs) / "base.log")
            baseline = base["tests"]
            kept.write_text(json.dumps(base, indent=1, sort_keys=True) + "\n")
        swapped, seconds["fastzoo"] = run_pytest(suite, args.checkout, True, args.pytest_args, Path(logs) / "swap.log")
    results = swapped["tests"]
    write(args.out, args.suite, suite, results, baseline, swapped["deselected"], seconds, load,
          args.source or str(args.checkout))
    c = counts(results)
    print(f"{args.suite}: {c['tests']} tests, {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
          f"{c['skipped']} skipped -> {args.out / (args.suite + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
