"""The README a user reads in ten minutes, and the generated parts of the docs staying in step
with the code that generates them.

- README.md: the two set-up commands, then "Use" with a Python block within the first 60 lines,
  at most 300 lines; `.ci/run` runs the README's test command as written.
- The capability matrix in the README is `fastzoo list --markdown`, the backends' own declarations.
- Every link from the README to a file of the repo (and to a heading of a results README) exists.
- `benchmarks/run_all.py` regenerates a results README's tables and keeps its hand-written notes.
- The README's "Use" and "Losses" blocks run as written (the other blocks run in the tests of
  their part: test_explain, test_gpt2_hf_api, test_peer_api, test_configs).
"""
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIRST_PYTHON_BEFORE = 60  # a user sees how to use the package on the first screenful or two
MAX_LINES = 300  # read in ten minutes; details live next to their numbers and in the docstrings
MATRIX_MARK = "<!-- capability matrix: `fastzoo list --markdown` -->"


def readme_lines() -> list[str]:
    return README.read_text().splitlines()


def test_readme_is_short_and_shows_use_first():
    lines = readme_lines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move details next to their numbers"
    first_python = next(i for i, line in enumerate(lines, 1) if line.startswith("```python"))
    assert first_python < FIRST_PYTHON_BEFORE, f"first ```python block at line {first_python}"
    use = lines.index("## Use")
    assert use < first_python, "the first Python block belongs to the Use section"


def test_ci_runs_the_readme_test_command():
    commands = [line for line in readme_lines() if line.startswith("python3 -m venv .venv")]
    assert len(commands) == 2, commands
    test_command = commands[1].split(" && ", 2)[2]  # after creating and activating the venv
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_capability_matrix_is_generated():
    """In a fresh interpreter: backends other tests register in this one are not fastzoo's."""
    import subprocess

    lines = readme_lines()
    start = lines.index(MATRIX_MARK) + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    run = subprocess.run([sys.executable, "-m", "fastzoo.cli", "list", "--markdown"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    generated = run.stdout.strip().splitlines()
    assert lines[start:end] == generated, "README's matrix is stale: replace it by `python -m fastzoo.cli list --markdown`"


FAMILIES_MARK = "<!-- model families: `fastzoo list --families` -->"


def test_model_families_table_is_generated_from_the_registry(capsys):
    from fastzoo.cli import main

    lines = readme_lines()
    start = lines.index(FAMILIES_MARK) + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert main(["list", "--families"]) == 0
    generated = capsys.readouterr().out.strip().splitlines()
    assert lines[start:end] == generated, "README's model table is stale: replace it by `python -m fastzoo.cli list --families`"


def python_block(heading: str) -> str:
    """The first ```python block after ``heading`` in the README."""
    lines = readme_lines()
    start = next(i for i in range(lines.index(heading), len(lines)) if lines[i].startswith("```python")) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[start:end])


def test_use_block_runs_as_written(tmp_path, monkeypatch):
    import timm

    monkeypatch.chdir(tmp_path)  # the block writes out/
    # timm's ViT-B/16 at a tiny size: the live module defines the architecture fastzoo builds
    tiny = TINY["vit"]
    timm_create = timm.create_model
    monkeypatch.setattr(timm, "create_model", lambda name, **kw: timm_create(name, **{**tiny, **kw}))
    ns = {}
    exec(python_block("## Use"), ns)
    m, ref = ns["m"].eval(), ns["ref"].eval()
    x = torch.randn(1, 3, tiny["img_size"], tiny["img_size"])
    with torch.no_grad():
        assert (m(x) - ref(x)).abs().max() <= 1e-4  # fastzoo.equivalence's fp32 rule
    assert ns["timm_sd"].keys() == ref.state_dict().keys()
    assert (tmp_path / "out" / "config.json").exists()


def test_losses_block_runs_as_written():
    import torchvision

    import fastzoo
    from fastzoo.data import pack

    g = torch.Generator().manual_seed(0)
    batch = pack([[1, 2, 3], [4, 5]])
    boxes = lambda n: torch.cat([torch.rand(n, 2, generator=g) * 0.5, 0.5 + torch.rand(n, 2, generator=g) * 0.5], -1)  # noqa: E731
    ns = {
        "fastzoo": fastzoo, "batch": batch, "logits": torch.randn(1, 5, 8, generator=g), "labels": batch.labels,
        "hidden_ND": torch.randn(6, 4, generator=g), "lm_head": torch.nn.Linear(4, 8, bias=False),
        "target_N": torch.randint(0, 8, (6,), generator=g), "pred": boxes(5), "target": boxes(5),
        "pred_BM4": boxes(6).view(2, 3, 4).requires_grad_(), "target_BM4": boxes(6).view(2, 3, 4),
        "mask_BM": torch.tensor([[True, True, False], [True, False, False]]),
        "torchvision_or_timm_resnet50_or_file": torchvision.models.resnet50(),
        "images": torch.rand(2, 3, 64, 64, generator=g), "targets": [boxes(2), boxes(0)],
    }
    exec(python_block("### Losses"), ns)
    assert ns["loss"].ndim == 0 and torch.isfinite(ns["loss"]) and ns["loss"].requires_grad


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, spaces to '-', punctuation dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local, "the README links its results"
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links {link}: no such file"
        if anchor:
            headings = [_anchor(h.lstrip("#")) for h in target.read_text().splitlines() if h.startswith("#")]
            assert anchor in headings, f"README links {link}: no such heading in {path}"


def test_run_all_keeps_the_hand_written_notes(tmp_path):
    spec = importlib.util.spec_from_file_location("run_all_under_test", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    saved_path = list(sys.path)
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))  # as `python benchmarks/run_all.py` finds its sibling scripts
        spec.loader.exec_module(run_all)
    finally:
        sys.path[:] = saved_path
    readme = tmp_path / "README.md"
    assert run_all.kept_notes(readme) == ""  # no README yet
    readme.write_text("# old tables\n| a |\n" + run_all.NOTES_MARKER + "\n## Why\nload average 7\n")
    assert run_all.kept_notes(readme) == "\n" + run_all.NOTES_MARKER + "\n## Why\nload average 7\n"
    readme.write_text("# tables only\n")
    assert run_all.kept_notes(readme) == ""
    committed = ROOT / "benchmarks" / "results" / "cpu-2core" / "README.md"
    assert run_all.NOTES_MARKER in committed.read_text(), "the CPU set's narrative sits below the marker"


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all_under_test", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    saved_path = list(sys.path)
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        spec.loader.exec_module(run_all)
    finally:
        sys.path[:] = saved_path
    return run_all


def test_run_all_runs_the_set_loss_suite_and_states_its_targets():
    """benchmarks/set_loss.py is one of run_all's suites (its three reports: B=8, B=32, the DETR step),
    and the targets section reads them: here from the committed CPU results."""
    import json

    from fastzoo.bench.report import Report, Row

    run_all = _run_all()
    assert run_all.SUITES["set_loss"] is sys.modules["set_loss"].run
    folder = ROOT / "benchmarks" / "results" / "cpu-2core"
    reports = {}
    for stem in ("set_loss", "set_loss_b32", "detr_step"):
        d = json.loads((folder / f"{stem}.json").read_text())
        reports[stem] = Report(**{**d, "rows": [Row(**r) for r in d["rows"]]})
    lines = run_all.detr_targets(reports)
    assert len(lines) == 3, lines
    rows = reports["set_loss"].rows
    ratio = next(r for r in rows if r.peer).median_s / min(r.median_s for r in rows if not r.peer)
    assert f"{ratio:.2f}x" in lines[0] and "target >= 4x" in lines[0] and "'transformers': 31" in lines[0]
    assert "target >= 15x" in lines[1] and "target >= 1.5x" in lines[2]


def test_gpt2_block_and_its_trainer_run_after_readme_command_1(tmp_path, monkeypatch):
    """README "GPT-2 and packed sequences", as written, at tiny size: what README command 1
    installs (the ``[bench]`` extra) carries what the block needs (transformers' Trainer needs
    accelerate), and the Trainer it builds trains. The line forcing a GPU kernel runs where that
    kernel is, else refuses by name."""
    import tomllib

    import transformers

    import fastzoo
    from fastzoo.errors import BackendUnavailableError

    bench = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    assert any(re.match(r"accelerate\b", req) for req in bench), "Trainer needs accelerate: add it to [bench]"
    monkeypatch.chdir(tmp_path)  # the block writes out/
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**TINY["gpt2"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf_dir")
    g = torch.Generator().manual_seed(0)
    seq = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    ns = {
        "fastzoo": fastzoo, "torch": torch, "transformers": transformers,
        "DataCollatorWithFlattening": transformers.DataCollatorWithFlattening,
        "input_ids": torch.randint(0, cfg.vocab_size, (2, 7), generator=g), "mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1]] + [[1] * 7]),
        "args": transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                                               report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True),
        "ds": [{"input_ids": seq(n)} for n in (5, 9, 3, 7)],
        "ids_a": seq(5), "ids_b": seq(3), "ids_c": seq(8),
    }
    lines = python_block("### GPT-2 and packed sequences").splitlines()
    forced = [i for i, line in enumerate(lines) if 'set_attention("varlen", impl="flash")' in line]
    assert len(forced) == 1
    exec("\n".join(lines[:forced[0]] + lines[forced[0] + 1:]), ns)
    ns["trainer"].train()
    losses = [h["loss"] for h in ns["trainer"].state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(x)) for x in losses)
    assert (tmp_path / "out" / "config.json").exists()
    if "varlen" in fastzoo.list_attention(available_only=True) and not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="flash"):
            exec(lines[forced[0]], ns)
    else:
        exec(lines[forced[0]], ns)
