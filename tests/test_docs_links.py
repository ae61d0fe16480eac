"""Every relative link of README.md and docs/*.md reaches something: the file (or folder) it names exists, and a
``#anchor`` names a heading of that page, spelled as GitHub spells heading anchors."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = ("http://", "https://", "mailto:")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a ``#`` there is a comment, a ``[x](y)`` is code)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(text):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))      # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(text: str) -> list[str]:
    found = []
    for line in _prose(text):
        line = re.sub(r"``.+?``|`[^`]*`", "", line)                  # code spans are not links
        found += [t for t in LINK.findall(line) if not t.startswith(EXTERNAL)]
    return found


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    problems = []
    for target in links(page.read_text()):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.relative_to(root)}: {target}: {path} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{page.relative_to(root)}: {target}: no heading #{anchor} in {dest.relative_to(root)}")
    return problems


def test_anchor_spelling_follows_github():
    text = "# A `code` title: with (parens), dots 1.3B & more\n## Again\n## Again\n```sh\n# not a heading\n```\n"
    assert anchors(text) == {"a-code-title-with-parens-dots-13b--more", "again", "again-1"}
    assert links("[a](b.md#c) `[x](y)` [w](https://e.org) ![i](images/p.png)\n```\n[z](q)\n```\n") == \
        ["b.md#c", "images/p.png"]


def test_every_relative_link_points_to_a_file_that_exists():
    assert len(PAGES) > 5
    problems = [p for page in PAGES for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# Here it is\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#here-it-is) [gone](missing.md) [bad anchor](there.md#elsewhere) [self](#nowhere)\n")
    found = broken_links(page, root=tmp_path)
    assert len(found) == 3 and "missing.md" in found[0] and "#elsewhere" in found[1] and "#nowhere" in found[2]


def test_the_readme_docs_index_links_every_page():
    readme = (REPO / "README.md").read_text()
    index = readme.split("\n## Docs\n", 1)[1].split("\n## ", 1)[0]
    listed = {t.partition("#")[0] for t in links(index)}
    pages = {f"docs/{p.name}" for p in PAGES[1:]}
    assert pages <= listed, f"add to the README's Docs index: {sorted(pages - listed)}"


def test_the_readme_floors_picture_matches_the_code():
    """The README's picture of the floors (## Design) puts each folder on the floor tests/test_architecture.py
    enforces, and every folder and module it names exists."""
    from tests.test_architecture import FLOORS

    block = (REPO / "README.md").read_text().split("\n## Design\n", 1)[1].split("```", 2)[1]
    placed, floor = {}, None
    for line in block.splitlines():
        m = re.match(r"\s+(?:floor (\d)\s+)?((?:[\w.]+/? )+?)\s{2,}", line + "  ")
        if not m or not re.search(r"/|\.py", m.group(2)):
            continue
        floor = int(m.group(1)) if m.group(1) else floor
        for name in m.group(2).split():
            placed[name] = floor
    assert {"cache/": 0, "kernels/": 1, "model/": 2, "sampling/": 3, "app/": 5, "nodes/": 6} .items() <= placed.items()
    for name, at in placed.items():
        assert (REPO / name).exists(), f"the README's floors name {name}, which does not exist"
        key = name.rstrip("/").removesuffix(".py")
        if key in FLOORS and key != "__init__":
            assert FLOORS[key] == at, f"the README puts {name} on floor {at}, tests/test_architecture.py on {FLOORS[key]}"
    modules = {p.name for p in REPO.rglob("*.py") if ".venv" not in p.parts}
    for named in set(re.findall(r"\b(\w+\.py)\b", block)):
        assert named in modules, f"the README's floors name {named}, which no module of the pack is called"
