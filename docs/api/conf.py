"""Sphinx configuration of the API reference (``scripts/nox -s docs`` builds it; CI too)."""

project = "mtp-hooks"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" sections as fields, not as duplicate attribute entries
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
html_theme = "alabaster"
exclude_patterns = ["_build"]
