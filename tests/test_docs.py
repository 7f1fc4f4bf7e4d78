"""The documentation holds together: every relative link in README.md and docs/*.md names a file of the
repository, code and tests cite only files of the repository (docs/design.md, never an outside design
note or an issue number), and the README stays a door, not a manual."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = ("jet", "workers", "queues", "trainer", "tests")
README_MAX_LINES = 320

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
# An outside design note (upper-case DESIGN dot md, a file the repository does not have), or an issue
# number, plain, plural or wrapped onto the next line. Spelt in pieces so this file does not cite either.
OUTSIDE_NOTE = "DESIGN" + ".md"
CITATION = re.compile(re.escape(OUTSIDE_NOTE) + r"|\b[Ii]ssues?\s+#?\d")


def relative_links(page: Path) -> list[str]:
    """Link targets of `page` that point into the repository (no URL scheme; `#anchor` alone is the
    page itself), outside fenced code blocks."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def anchors(page: Path) -> set[str]:
    """The #anchors GitHub makes of a page's headings: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    heads = re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def dead_links(page: Path) -> list[str]:
    """Relative links whose file is missing, or whose #anchor names no heading of a Markdown file."""
    dead = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = page.parent / path if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            dead.append(target)
    return dead


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_names_a_file(page):
    assert dead_links(page) == []


CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A repository path as the pages cite one: a top-level folder of the repository, then a file with a suffix
# (`queues/consumer.py`, `tests/queues/test_faults.py::test_x`, `jet/study/builtin/staleness.yaml`).
CITED = re.compile(r"(?<![\w/.~-])((?:jet|workers|queues|trainer|tests|docs|configs|scripts|\.ci)/"
                   r"(?:[\w.-]+/)*[\w.-]+\.(?:py|md|yaml|yml|sh|json|toml|png|js|html|css))\b")


def cited_paths(page: Path) -> list[str]:
    """The repository paths `page` cites in code spans (`jet/runs.py`, `tests/test_docs.py::test_x`)."""
    return [p for span in CODE_SPAN.findall(page.read_text()) for p in CITED.findall(span)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_path_exists(page):
    """A page that cites `jet/queues/blobs.py` (the installed module's name) instead of the file,
    `queues/blobs.py`, or a file that moved, sends a reader nowhere."""
    assert [p for p in cited_paths(page) if not (ROOT / p).exists()] == []


def test_the_path_check_finds_a_cited_path_that_is_gone(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`jet/runs.py` and `tests/test_docs.py::test_every_cited_path_exists`, `jet/queues/blobs.py`,\n"
                    "`runs/demo/trainer/tiny/metrics.jsonl` (a run's file), `jet.queues.blobs` (a module), "
                    "`workers/inference/gone.py:12`\n")
    cited = cited_paths(page)
    assert cited == ["jet/runs.py", "tests/test_docs.py", "jet/queues/blobs.py", "workers/inference/gone.py"]
    assert [p for p in cited if not (ROOT / p).exists()] == ["jet/queues/blobs.py", "workers/inference/gone.py"]


def test_the_link_check_finds_a_dead_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.png").write_bytes(b"")
    page.write_text("# A `page`: here\n[ok](there.png) ![ok](there.png#x) [web](https://example.com) [top](#a-page-here) [nowhere](#top)\n"
                    "[gone](missing.md#part) [self](page.md#a-page-here) [no heading](page.md#elsewhere)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert dead_links(page) == ["#top", "missing.md#part", "page.md#elsewhere"]


def citations(text: str) -> list[str]:
    return [m.group(0) for m in CITATION.finditer(text)]


def test_code_cites_only_files_of_the_repository():
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            found += [f"{path.relative_to(ROOT)}: {c!r}" for c in citations(path.read_text())]
    assert found == []


def test_the_citation_check_finds_wrapped_and_plain_ones():
    issue = "issue"
    text = f"see {OUTSIDE_NOTE}, rule 4; ({issue} 6); {issue}\n11, item 7; {issue}s 10-15"
    assert citations(text) == [OUTSIDE_NOTE, f"{issue} 6", f"{issue}\n1", f"{issue}s 1"]
    assert citations("docs/design.md, rule 4; the gateway's issues with tool_choice") == []


def test_the_design_page_exists_and_holds_every_rule_the_code_cites():
    design = (ROOT / "docs" / "design.md").read_text()
    cited = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            cited |= {int(n) for n in re.findall(r"docs/design\.md, rules? (\d+)", path.read_text())}
            cited |= {int(n) for n in re.findall(r"def test_rule(\d+)_", path.read_text())}
    assert cited, "nothing cites a delivery rule: the check would pass vacuously"
    missing = [n for n in sorted(cited) if f"### Rule {n}:" not in design]
    assert missing == []


def test_the_readme_is_a_door():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"
