"""The README's layout table names every module of the package."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_layout_table_names_every_module():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout") :].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `mtp_hooks/")]
    missing = []
    for path in sorted((ROOT / "mtp_hooks").rglob("*.py")):
        folder = path.parent.relative_to(ROOT).as_posix()
        if not any(f"`{folder}/" in row and f"{path.name}`" in row for row in rows):
            missing.append(path.relative_to(ROOT).as_posix())
    assert missing == []


def test_the_readme_shows_the_drafter_loop_example_in_full():
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "keep_the_drafter_fresh.py").read_text()
    code = example[example.index("import torch") :]
    assert f"```python\n{code}```" in readme
