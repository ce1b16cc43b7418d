"""Sphinx configuration of the scaffold_jax documentation site (``make docs``).

Markdown pages (myst-parser), the notebooks rendered from the executed copies in
``tutorials/`` (myst-nb, never executed here: ``scaffold_jax.docs.build_site`` copies the
clean notebooks in, and ``make docs-notebooks`` executes them there for their outputs;
the folder is not committed), sphinx-book-theme. ``scaffold_jax.docs.build_site`` runs it and then
writes the pdoc API reference into ``api/`` beside the pages; built offline, and the
tests require zero warnings.
"""

import scaffold_jax

project = "scaffold_jax"
author = "the scaffold_jax developers"
copyright = "2026, the scaffold_jax developers"  # noqa: A001 (Sphinx's name)
release = scaffold_jax.__version__

extensions = ["myst_nb"]  # myst_nb brings myst_parser with it
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "api", "Thumbs.db", ".DS_Store"]
# Links to headings of other pages (`page.md#a-heading`) resolve, and are checked.
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]
nb_execution_mode = "off"  # the outputs docs/tutorials/*.ipynb hold, if executed
nb_merge_streams = True

html_theme = "sphinx_book_theme"
html_title = "scaffold_jax"
html_theme_options = {
    "repository_url": scaffold_jax.REPOSITORY,
    "use_repository_button": True,
    "show_toc_level": 2,
}
