"""Property: a damaged checkpoint is refused with ``CheckpointError`` or loads exactly what was
written, and the model it was loaded into is never half-loaded.

Each family's model (a random valid small config) is saved as one ``.safetensors`` file and as a
``save_pretrained`` directory; then the file (or one file of the directory: the weights, the
config.json) is cut at a random byte or has random bytes flipped. Loading it into a model of the
same config must either raise ``CheckpointError`` with the model's every tensor unchanged, or
succeed with every tensor equal to the saved one except where a flipped byte lies inside that
tensor's data (the bytes as written: safetensors stores no checksum, so a flip in the data is
data; read in fastzoo's names through the file's format, a model standing in for a transformers
class being saved in transformers' names). ``fastzoo.create(pretrained=...)`` from the damaged source must likewise refuse by name.
"""
from __future__ import annotations

import struct

import pytest
import torch
from conftest import SPECS
from fuzzing import fuzz_results  # noqa: F401 -- the results file's fixture
from fuzzing import configs, count, examples, fail
from hypothesis import given
from hypothesis import strategies as st

import fastzoo
from fastzoo.errors import CheckpointError, FastzooError

FAMILIES = sorted(SPECS)


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a flipped byte may make a NaN, which equals nothing)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _data_start(raw: bytes) -> int:
    """Where a safetensors file's tensor data begins (after the 8-byte header length and the JSON header)."""
    return 8 + struct.unpack("<Q", raw[:8])[0]


def _held(spec, path) -> dict[str, torch.Tensor]:
    """What a safetensors file holds, in fastzoo's names and layout (through its format's converter: a
    save_pretrained directory of a model standing in for transformers' class holds transformers' names)."""
    from safetensors.torch import load_file

    from fastzoo.weights import Source, find_converter

    state = load_file(str(path))
    return find_converter(spec, Source(state, str(path))).to_fastzoo(state)


def _damage(draw, raw: bytes) -> tuple[bytes, list[int]]:
    how = draw(st.sampled_from(["truncate", "flip"]), label="damage")
    if how == "truncate" or len(raw) < 2:
        cut = draw(st.integers(0, max(0, len(raw) - 1)), label="cut at")
        return raw[:cut], []
    where = sorted(set(draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4), label="flipped bytes")))
    out = bytearray(raw)
    for i in where:
        out[i] ^= draw(st.integers(1, 255), label="xor")
    return bytes(out), where


@pytest.mark.parametrize("family", FAMILIES)
@examples(ci=10, long=500)
@given(data=st.data())
def test_a_damaged_checkpoint_is_refused_or_loaded_as_written_never_half(family, data, tmp_path_factory):
    spec = SPECS[family]
    cfg = data.draw(configs(spec, small=True), label="config")
    name = spec.variants[0].name
    torch.manual_seed(0)
    saved = fastzoo.create(name, **cfg)
    form = data.draw(st.sampled_from(["safetensors", "directory weights", "directory config"]), label="form")
    root = tmp_path_factory.mktemp("ckpt")
    if form == "safetensors":
        from safetensors.torch import save_file

        from fastzoo.weights import untied

        path = root / "model.safetensors"
        save_file(untied({k: v.contiguous() for k, v in saved.state_dict().items()}), str(path))
        target, source = path, path
    else:
        saved.save_pretrained(root)
        target = root / ("config.json" if form == "directory config" else "model.safetensors")
        source = root
        if not target.is_file():  # a family whose save_pretrained writes another layout
            target = next(p for p in sorted(root.iterdir()) if p.suffix in (".safetensors", ".json"))
    raw = target.read_bytes()
    damaged, flipped = _damage(data.draw, raw)
    target.write_bytes(damaged)
    written = _state(saved)

    prop = f"damaged checkpoints/{family}"
    torch.manual_seed(1)
    model = fastzoo.create(name, **cfg)
    before = _state(model)
    try:
        fastzoo.load_pretrained(model, source)
    except CheckpointError:
        after = model.state_dict()
        half = [k for k, v in before.items() if not _same_bits(after[k], v)]
        if half:
            fail(prop, "half_loads", f"refused, but {len(half)} tensors changed (half-loaded): {half[:4]}")
        outcome = "refused"
    except Exception as e:  # noqa: BLE001 -- anything but CheckpointError is the failure looked for
        fail(prop, "bare_exceptions", f"{form}, {'cut' if not flipped else 'flipped'}: bare {type(e).__name__}: {e}")
    else:
        after = model.state_dict()
        held = {}  # flips in the tensor data only: the flipped tensors as the file now holds them
        if flipped and target.suffix == ".safetensors" and min(flipped) >= _data_start(damaged):
            held = _held(spec, target)
        wrong = [k for k, v in written.items() if not _same_bits(after[k], held.get(k, v))]
        if wrong:
            fail(prop, "mismatches", f"loaded a damaged file with {len(wrong)} tensors not as it holds them: {wrong[:4]}")
        outcome = "loaded as written"
    # building from the damaged source refuses by name too, or builds what was written
    try:
        fastzoo.create(name, pretrained=source, **({} if form != "safetensors" else cfg))
    except (CheckpointError, FastzooError, ValueError):
        pass
    except Exception as e:  # noqa: BLE001
        fail(prop, "bare_exceptions", f"create(pretrained=damaged {form}): bare {type(e).__name__}: {e}")
    count(prop, examples=1, **{outcome.replace(" ", "_"): 1})
