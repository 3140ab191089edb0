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
# Code blocks are written to the project's line length (100 columns, as ruff checks the code):
# alabaster's default 940 px page leaves 720 px for them, about 80 columns, and cut the rest.
html_theme_options = {
    "fixed_sidebar": True,
    "page_width": "1180px",
    "body_max_width": "none",
    "sidebar_width": "220px",
    "code_font_size": "0.8em",
}
# docs/benchmarks/ holds raw results (JSON, logs, plots) that the pages link to, not pages.
exclude_patterns = ["_build", "benchmarks/**"]


def _parseable_factory_defaults(app, what, name, obj, options, signature, return_annotation):
    """A dataclass field with a default factory shows ``= <factory>`` in its signature, which
    Sphinx's Python domain cannot parse: it then prints the whole signature as raw text, with
    private module paths (``~mtp_hooks._phases.Phase``) and no links. ``...`` parses."""
    if signature and "<factory>" in signature:
        return signature.replace("<factory>", "..."), return_annotation
    return None


def setup(app):
    app.connect("autodoc-process-signature", _parseable_factory_defaults)
