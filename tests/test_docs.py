"""The README and docs/ as a reader walks them: every relative link and image points to a file that
exists, every #anchor to a heading or an <a id> of its file, the README stays a front door (at most
15 KB), results/ holds only the files the docs cite, and every before/after table is its files'."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 15_000

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_ID = re.compile(r"""<a\s+(?:[^>]*\s)?(?:id|name)=["']([^"']+)["']""")


def prose(text: str) -> str:
    """The text with fenced code blocks dropped and code spans blanked: links inside code are not links."""
    return _CODE_SPAN.sub("code", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Targets of the inline links and images outside code, in order."""
    return _LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page offers: its headings' slugs (repeats numbered as GitHub does) and explicit ids."""
    found, seen = set(_ID.findall(text)), {}
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """'target: why' for each relative link or image of page that leads nowhere (or out of root)."""
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif not dest.is_relative_to(root):
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no anchor #{anchor} in {dest.relative_to(root)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_leads_somewhere(page):
    assert links(page.read_text()), f"{page.name} links nowhere: the pages should link each other"
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: {len(broken)} broken link(s):\n" + "\n".join(broken)


def test_readme_is_a_front_door():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes, over {README_MAX_BYTES}: "
                                      "move the detail into docs/ and link it")


def test_results_holds_only_files_the_docs_cite():
    cited = "\n".join(page.read_text() for page in PAGES)
    stray = [p.name for p in sorted((ROOT / "results").glob("*")) if p.is_file() and p.name not in cited]
    assert not stray, (f"results/ holds files no page cites: {stray}; cite them (bench.py readme) "
                       "or leave them in git history")


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "a.md").write_text('# A page\n\n<a id="v01"></a>\n\n## v01 - naive `x`\n')
    (tmp_path / "x.md").write_text("# outside the repository\n")
    page = root / "docs" / "b.md"
    page.write_text("[ok](a.md#v01) [ok](a.md#v01---naive-x) [ok](#b) ![gone](missing.png) "
                    "[gone](a.md#v99) `[code](nowhere.md)` [web](https://example.com) [out](../../x.md)\n\n# B\n")
    broken = broken_links(page, root=root)
    assert [b.split(":")[0] for b in broken] == ["missing.png", "a.md#v99", "../../x.md"], broken


@pytest.mark.parametrize("page", [p for p in PAGES if "<!-- bench:compare-" in p.read_text()],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_before_after_table_is_what_its_files_say(page):
    """A page's bench.py compare tables are the command's output on the files it names, as they are now:
    a number typed by hand, or a file changed since, fails (bench.py readme rewrites them)."""
    from benchmarks.compare import rewrite_compare_sections
    from benchmarks.readme import find_sections, replace_sections

    text = page.read_text()
    spans = find_sections(text)
    assert replace_sections(text, spans, rewrite_compare_sections(text, spans, page.parent)) == text
