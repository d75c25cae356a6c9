"""The README a user reads in ten minutes, and the generated parts of the docs staying in step
with the code that generates them.

- README.md: the two set-up commands, then "Use" with a Python block within the first 60 lines,
  at most 300 lines; `.ci/run` runs the README's test command as written.
- The capability matrix in the README is `fastzoo list --markdown`, the backends' own declarations.
- Every link from the README to a file of the repo (and to a heading of a results README) exists.
- `benchmarks/run_all.py` regenerates a results README's tables and keeps its hand-written notes.
"""
import importlib.util
import re
import sys
from pathlib import Path

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


def test_capability_matrix_is_generated(capsys):
    from fastzoo.cli import main

    lines = readme_lines()
    start = lines.index(MATRIX_MARK) + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert main(["list", "--markdown"]) == 0
    generated = capsys.readouterr().out.strip().splitlines()
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
