"""The README and the docs site say what the code does: short README, links that resolve, a
layout table that names every module, and examples that run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import mtp_hooks

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_the_readme_stays_short_and_carries_no_dates_or_timings():
    assert len(README.splitlines()) <= 250
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", README) == []
    assert re.findall(r"\b\d+ s\b|\bCI machine\b", README) == []


def test_the_readme_gives_the_two_commands():
    (commands,) = [block for block in code_blocks(README, "bash") if "scripts/nox" in block]
    assert "scripts/nox -s demo" in commands and "\nscripts/nox " in commands


def test_every_link_of_the_readme_and_the_docs_resolves_to_a_file():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")) and not (
                (page.parent / target).exists()
            ):
                missing.append(f"{page.name}: {target}")
    assert missing == []


def test_every_python_example_of_the_readme_parses():
    blocks = code_blocks(README, "python")
    assert len(blocks) >= 3
    for block in blocks:
        ast.parse(block)


def test_the_readme_plugin_example_votes_as_it_says(tmp_path, monkeypatch):
    (plugin,) = [block for block in code_blocks(README, "python") if "@hookimpl" in block]
    (tmp_path / "my_framework_mtp.py").write_text(plugin)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_framework_mtp

    mtp_hooks.plugins.register(my_framework_mtp, name="my-framework")
    reference = type("Model", (), {})()
    mtp_hooks.set_role(reference, "reference")
    assert mtp_hooks.decide(None, "train").decided_by == "my-framework"
    assert mtp_hooks.decide(None, "eval").decided_by == "default"  # abstains
    assert mtp_hooks.decide(reference, "train").run is False


def test_the_readme_policy_example_is_a_valid_policy():
    (example,) = [block for block in code_blocks(README, "python") if "+mask:labels" in block]
    policy = "".join(re.findall(r'^\s+"([^"]*)"', example, flags=re.M))
    mtp_hooks.configure(policy)
    decision = mtp_hooks.decide(None, "train")
    assert (decision.options.loss_scale, decision.options.detach, decision.options.mask) == (
        0.3,
        True,
        "labels",
    )


def test_the_layout_table_names_every_module():
    page = (ROOT / "docs" / "contributing.md").read_text()
    table = page[page.index("## Layout") :].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `mtp_hooks/")]
    missing = []
    for path in sorted((ROOT / "mtp_hooks").rglob("*.py")):
        folder = path.parent.relative_to(ROOT).as_posix()
        if not any(f"`{folder}/" in row and f"{path.name}`" in row for row in rows):
            missing.append(path.relative_to(ROOT).as_posix())
    assert missing == []


def test_the_user_guide_shows_the_drafter_loop_example_in_full():
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    example = (ROOT / "examples" / "keep_the_drafter_fresh.py").read_text()
    code = example[example.index("import torch") :]
    assert f"```python\n{code}```" in guide


def test_every_docs_page_is_in_the_sites_table_of_contents():
    index = (ROOT / "docs" / "index.md").read_text()
    pages = {path.stem for path in (ROOT / "docs").glob("*.md")} - {"index"}
    listed = set(re.findall(r"^([a-z-]+)$", index, flags=re.M))
    assert pages <= listed


def test_every_code_line_of_the_docs_fits_the_column_the_site_gives_it():
    """Headless Chromium at 1280 px, with conf.py's theme options, fits 102 columns of code in
    the body's column (13.6 px monospace, 960 px body); alabaster's defaults fit about 80, and
    cut the rest of each line. The code keeps to 100 columns, as ruff checks it."""
    conf = ast.parse((ROOT / "docs" / "conf.py").read_text())
    (options,) = [
        ast.literal_eval(node.value)
        for node in conf.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "html_theme_options"
    ]
    assert options["page_width"] == "1180px" and options["body_max_width"] == "none"
    assert options["code_font_size"] == "0.8em"
    too_long = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        # {eval-rst} blocks are directives for Sphinx, not code shown on the page
        for block in re.findall(r"```(?!\{eval-rst\})[^\n]*\n(.*?)```", page.read_text(), re.S):
            too_long += [f"{page.name}: {line}" for line in block.splitlines() if len(line) > 100]
    assert too_long == []


def test_the_docs_site_takes_its_name_version_and_copyright_holder_from_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as the docs session has
    import runpy

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    conf = runpy.run_path(str(ROOT / "docs" / "conf.py"))
    assert conf["project"] == meta["name"] and conf["release"] == meta["version"]
    holder = meta["authors"][0]["name"]
    assert holder and conf["author"] == holder and conf["copyright"].endswith(holder)


def test_no_install_line_names_a_distribution_the_package_index_does_not_have():
    """mtp-hooks is not on the index: ``pip install mtp-hooks`` would find nothing (or, one day,
    someone else's package). Install lines install from a checkout."""
    pages = [README, *(p.read_text() for p in (ROOT / "docs").glob("*.md"))]
    pages += [p.read_text() for p in (ROOT / "plugins").glob("*/README.md")]
    by_name = re.compile(r"pip install [\"']?mtp-hooks")
    assert not [m.group(0) for page in pages for m in by_name.finditer(page)]
