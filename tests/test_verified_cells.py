"""Every "verified on <GPU>" cell of README's backend table has committed result rows behind it:
for each model and dtype the cell names, a passing parity JSON of that backend (and pinned kernel or
impl) in ``benchmarks/results/<GPU>/parity-*``."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {"ViT-B/16": "vit_b16", "GPT-2": "gpt2"}
DTYPES = ("bf16", "fp16", "fp32")
GPU_CLAIM = re.compile(r"(H100|H200)[^:;]*:\s*([^;]+)")
MODEL_OR_DTYPES = re.compile(r"ViT-B/16|GPT-2|(?:bf16|fp16|fp32)(?:/(?:bf16|fp16|fp32))*")


def backend_rows() -> dict[str, str]:
    """README's backend table: backend -> its "verified" cell."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| backend | devices"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[header.index("verified")]
    return rows


def claims(cell: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(GPU, model, dtypes) the cell claims; a model takes the dtypes written after it (after the
    next model when it has none of its own: "ViT-B/16 and GPT-2 bf16/fp16"); none at all: any dtype."""
    out = []
    for gpu, text in GPU_CLAIM.findall(cell):
        tokens = MODEL_OR_DTYPES.findall(text)
        waiting = []
        for tok in tokens:
            if tok in MODELS:
                waiting.append(tok)
            else:
                out += [(gpu, MODELS[m], tuple(tok.split("/"))) for m in waiting]
                waiting = []
        out += [(gpu, MODELS[m], ()) for m in waiting]
    return out


def passing(path: Path, option: tuple[str, str] | None) -> bool:
    if not path.is_file():
        return False
    results = json.loads(path.read_text())["results"]
    if option is not None:  # the pinned kernel's result: options {"sdpa_backend": "'flash'"}
        results = [r for r in results if option[0] in str(r["options"]) and f"'{option[1]}'" in str(r["options"])]
    return bool(results) and all(str(r["passed"]) == "True" for r in results)


def backed(backend: str, gpu: str, model: str, dtypes: tuple[str, ...]) -> list[str]:
    """The (model, dtype) pairs of a claim that no committed passing parity row backs."""
    pinned = re.fullmatch(r"(\w+) \((sdpa_backend|impl)=(\w+)\)", backend)
    name = pinned.group(1) if pinned else backend
    missing = []
    for dtype in dtypes or DTYPES:
        ok = False
        for folder in RESULTS.glob(f"*{gpu}*/parity-{name}"):
            if pinned is None:
                ok |= passing(folder / f"parity_{name}_{model}_{dtype}.json", None)
            else:
                option = (pinned.group(2), pinned.group(3))
                stem = "sdpa_pinned" if name == "sdpa" else f"{name}_impls"
                ok |= passing(folder / f"parity_{stem}_{model}_{dtype}.json", option)
                # the automatic choice, where its kernel table says it ran this impl
                log = folder / "logs" / f"{name}_{model}_{dtype}.log"
                ok |= (passing(folder / f"parity_{name}_{model}_{dtype}.json", None) and log.is_file()
                       and f"best here -> {option[1]}" in log.read_text())
        if not ok:
            missing.append(f"{model} {dtype}")
        elif not dtypes:
            return []  # any dtype: one is enough
    return missing


def test_claims_are_read_from_the_cell_as_written():
    assert claims("CPU fp32 (torch 2.14.1); H100 (torch 2.11): ViT-B/16 and GPT-2 bf16/fp16") == [
        ("H100", "vit_b16", ("bf16", "fp16")), ("H100", "gpt2", ("bf16", "fp16"))]
    assert claims("H100 (torch 2.11): GPT-2 bf16 packed, ViT-B/16 (dense: no padding)") == [
        ("H100", "gpt2", ("bf16",)), ("H100", "vit_b16", ())]
    assert claims("CPU fp32 (torch 2.14.1)") == []


@pytest.mark.parametrize("backend, cell", sorted(backend_rows().items()))
def test_every_gpu_verified_cell_has_a_committed_result_row(backend, cell):
    missing = [f"{gpu} {m}" for gpu, model, dtypes in claims(cell) for m in backed(backend, gpu, model, dtypes)]
    assert not missing, (f"README's backend table says {backend!r} was verified on a GPU for {', '.join(missing)}, "
                         "but benchmarks/results has no passing parity row for it")
