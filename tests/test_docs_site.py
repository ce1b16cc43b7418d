"""The documentation site (`make docs`): it builds offline with zero warnings, every page
of the manual exists and is reachable from the index, every internal link and anchor of
the built HTML resolves, the tutorials are the notebooks, and the
generated command-line reference is current.

The build (Sphinx with myst-nb and pdoc for the API) takes about a minute on 2 cores: it
runs once, for the module.
"""

from __future__ import annotations

import html.parser
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: The pages issue 44 asks for, by section: each must be built and reachable.
REQUIRED = {
    "getting-started",
    "tutorials/index",
    "tutorials/01_quickstart",
    "tutorials/02_client_drift",
    "tutorials/03_large_n_sweep",
    "tutorials/04_shakespeare",
    "tutorials/05_privacy",
    "how-to/sweeps-and-seeds",
    "how-to/resuming",
    "how-to/extending",
    "how-to/models",
    "how-to/natural-data",
    "how-to/devices-and-hosts",
    "how-to/privacy",
    "how-to/participation",
    "how-to/communication",
    "how-to/robustness",
    "how-to/performance",
    "explanation/design",
    "explanation/scaffold",
    "explanation/network",
    "explanation/comparison",
    "how-to/time",
    "reference/api",
    "reference/cli",
    "config",
    "bad_inputs",
    "reference/benchmarks",
    "reference/testing",
    "reference/results",
    "results/table3",
    "history",
}


#: The manual's own pages (the development log aside, which quotes history); the
#: benchmarks' README is the site's benchmarks page (included whole).
USER_PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"] + sorted(
    p for p in DOCS.rglob("*.md") if "_build" not in p.parts and p.name != "history.md"
)
#: An issue number: "issue 40", "issue-40", "issues #42".
ISSUE = re.compile(r"\bissues?[ -]?#?\d+", re.I)
#: A Markdown file a page links to or names as a document ("../how-to/time.md#deadlines",
#: "NETWORK.md"); an output file a command writes (summary.md) is not one.
CITED_MD = re.compile(r"\]\(([^)#\s]+\.md)|\b([\w./-]*[A-Z][A-Z_]+\.md)\b")


def _notebook_text(path: Path) -> str:
    import json

    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])


def test_no_user_page_carries_an_issue_number():
    """Issue numbers mean nothing to a reader of the manual: only docs/history.md has them
    (README, every page, the notebooks the tutorials render, the API's docstrings)."""
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in USER_PAGES}
    texts |= {str(p.relative_to(ROOT)): _notebook_text(p) for p in ROOT.glob("notebooks/*.ipynb")}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "src").rglob("*.py")}
    found = {name: ISSUE.findall(text) for name, text in texts.items() if ISSUE.search(text)}
    assert found == {}


def test_every_markdown_file_a_page_cites_is_in_the_repository():
    """A page that names a .md file (a link or prose) names one the reader can open: in
    the repository, relative to the page or to its root (the design notes the code was
    written from are not; their contents are the explanation pages)."""
    missing = []
    for page in USER_PAGES:
        for cited in (link or name for link, name in CITED_MD.findall(page.read_text())):
            if not ((page.parent / cited).exists() or (ROOT / cited).exists()):
                missing.append(f"{page.relative_to(ROOT)}: {cited}")
    for path in (ROOT / "src").rglob("*.py"):  # the API reference renders the docstrings
        for cited in re.findall(r"\b[A-Z]+\.md\b", path.read_text()):
            if not (ROOT / cited).exists():
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
    assert missing == []


def test_a_count_of_refused_inputs_or_a_tier_time_is_stated_on_one_page():
    """Figures that change with every release are stated once: the refused inputs on
    their page, the test tiers' counts and times on the testing page; the other pages
    link there."""
    for page in USER_PAGES:
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        if name != "docs/bad_inputs.md":
            assert not re.search(r"\b\d[\d,]* (kinds of )?bad inputs?\b", text), name
        if name != "docs/reference/testing.md":
            assert not re.search(r"test-min[^.]*\b\d+ ?(min|s)\b", text, re.S), name
            assert not re.search(r"make test` runs [\d,]+ tests", text), name


def test_rounds_to_a_target_say_their_evaluation_cadence():
    """The README's rounds to 70% are per-round evaluations; a run evaluating every 5
    rounds reports a multiple of 5, and the page says so beside the number."""
    readme = (ROOT / "README.md").read_text()
    sentence = readme[readme.index("in 17 rounds") :][:400]
    assert "evaluated every round" in sentence and "every 5 rounds" in sentence


def test_the_makefile_has_help_and_points_at_pages_that_exist():
    import subprocess

    makefile = (ROOT / "Makefile").read_text()
    targets = re.findall(r"^\.PHONY: (.*)$", makefile, re.M)[0].split()
    shown = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "help"], capture_output=True, text=True, check=True
    ).stdout
    assert all(f"make {t} " in shown for t in targets if t != "help"), shown
    for cited in re.findall(r"[\w/.-]+\.md", makefile):
        assert (ROOT / cited).exists(), cited


def test_the_install_lines_and_extras_have_what_the_pages_use():
    """The README's install line has the extra its own DP example needs; the notebooks'
    tooling (jupyter nbconvert) is in an extra."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the package depends on tomli there
        import tomli as tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(d.startswith("nbconvert") for d in extras["notebooks"])
    readme = (ROOT / "README.md").read_text()
    install = re.search(r'pip install -e "\.\[([\w,]+)\]"', readme).group(1).split(",")
    assert "--dp-epsilon" in readme and "privacy" in install


class _Links(html.parser.HTMLParser):
    """The ids and the links (href, src) of one HTML page."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        for key in ("href", "src"):
            if attrs.get(key) and not (
                tag == "link" and key == "href" and "stylesheet" not in (attrs.get("rel") or "")
            ):
                self.links.append(attrs[key])


def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(errors="replace"))
    return parser


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from scaffold_jax import docs

    out = tmp_path_factory.mktemp("site")
    warnings = docs.build_site(out)
    return out, warnings


@pytest.mark.slow  # the Sphinx build: ~22 s of the quick tier
def test_the_site_builds_with_zero_warnings(site):
    _, warnings = site
    assert warnings == []


@pytest.mark.slow  # the Sphinx build: ~22 s of the quick tier
def test_every_page_of_the_manual_is_built_and_reachable_from_the_index(site):
    out, _ = site
    reached, todo = set(), [out / "index.html"]
    while todo:
        page = todo.pop()
        if page in reached or not page.exists() or page.suffix != ".html":
            continue
        reached.add(page)
        if out / "api" in page.parents:  # pdoc's pages: their own link test (test_docs.py)
            continue
        for link in _parse(page).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or not parts.path:
                continue
            todo.append((page.parent / unquote(parts.path)).resolve())
    pages = {str(p.relative_to(out).with_suffix("")) for p in reached}
    assert sorted(REQUIRED - pages) == []
    assert "api/index" in pages  # the API reference is linked from the site
    # Every page Sphinx built is reachable (an orphan would be a page no one finds).
    built = {
        str(p.relative_to(out).with_suffix(""))
        for p in out.rglob("*.html")
        if not ({"_static", "_sources", "api", "_modules"} & set(p.relative_to(out).parts))
    }
    assert sorted(built - pages - {"genindex", "search"}) == []


@pytest.mark.slow  # the Sphinx build: ~22 s of the quick tier
def test_every_internal_link_and_anchor_resolves(site):
    out, _ = site
    # pdoc's pages have their own test (test_docs.py); _static holds the theme's templates.
    pages = [
        p for p in out.rglob("*.html") if p.relative_to(out).parts[0] not in ("api", "_static")
    ]
    parsed = {p.resolve(): _parse(p) for p in pages}
    broken = []
    for page, links in parsed.items():
        for link in links.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if not target.exists():
                broken.append(f"{page.relative_to(out.resolve())}: {link}")
            elif parts.fragment and target.suffix == ".html" and target in parsed:
                if unquote(parts.fragment) not in parsed[target].ids:
                    broken.append(f"{page.relative_to(out.resolve())}: {link} (no such anchor)")
    assert broken == []


@pytest.mark.slow  # the Sphinx build: ~22 s of the quick tier
def test_the_tutorials_are_the_notebooks(site, tmp_path):
    """The site's tutorials are the notebooks (copied in by the build, not committed): the
    same cells; an executed copy is kept until its notebook changes, then replaced."""
    nbformat = pytest.importorskip("nbformat")
    from scaffold_jax import docs

    sources = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in sources:
        copy = nbformat.read(DOCS / "tutorials" / path.name, as_version=4)
        source = nbformat.read(path, as_version=4)
        assert [c.source for c in copy.cells] == [c.source for c in source.cells], path.name
    # An executed copy (outputs) is kept; one whose cells differ is replaced.
    dest = tmp_path / "tutorials"
    assert len(docs.sync_notebooks(ROOT / "notebooks", dest)) == len(sources)
    first = dest / sources[0].name
    nb = nbformat.read(first, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", text="ran\n")]
    nbformat.write(nb, first)
    assert docs.sync_notebooks(ROOT / "notebooks", dest) == []
    code.source += "\n# edited"
    nbformat.write(nb, first)
    assert docs.sync_notebooks(ROOT / "notebooks", dest) == [first]
    assert first.read_bytes() == sources[0].read_bytes()


def test_the_command_line_reference_is_current():
    from scaffold_jax import docs

    assert (DOCS / "reference" / "cli.md").read_text() == docs.cli_markdown(), (
        "docs/reference/cli.md is stale: run `make docs`"
    )


def test_the_cli_reference_holds_every_commands_help():
    from scaffold_jax import cli, docs

    text = docs.cli_markdown()
    _, commands = cli._build_parsers()
    for name in commands:
        assert f"## `scaffold-jax {name}`" in text
    assert re.search(r"--algorithm", text) and "--dp-epsilon" in text and "--resume" in text
