"""Sphinx configuration of the docs site (``scripts/nox -s docs`` builds it; CI too)."""

project = "mtp-hooks"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_heading_anchors = 3  # links such as benchmarks.md#megatron-lm-pretrain-... resolve
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" sections as fields, not as duplicate attribute entries
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
html_theme = "alabaster"
html_theme_options = {"fixed_sidebar": True}
# docs/benchmarks/ holds raw results (JSON, logs, plots) that the pages link to, not pages.
exclude_patterns = ["_build", "benchmarks/**"]
