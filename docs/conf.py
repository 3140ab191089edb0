"""Sphinx configuration of the docs site (``scripts/nox -s docs`` builds it; CI too)."""

import pathlib
import tomllib

# The project's metadata, from pyproject.toml: one place for the name, version and authors.
_meta = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
project = _meta["name"]
release = _meta["version"]
version = ".".join(release.split(".")[:2])
author = ", ".join(a["name"] for a in _meta["authors"])
copyright = f"2026, {author}"  # noqa: A001  (Sphinx reads this name)
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_heading_anchors = 3  # links such as benchmarks.md#megatron-lm-pretrain-... resolve
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" sections as fields, not as duplicate attribute entries
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Signatures name documented types as users import them (Phase, not mtp_hooks._phases.Phase).
python_use_unqualified_type_names = True
html_theme = "alabaster"
html_theme_options = {"fixed_sidebar": True}
# docs/benchmarks/ holds raw results (JSON, logs, plots) that the pages link to, not pages.
exclude_patterns = ["_build", "benchmarks/**"]
