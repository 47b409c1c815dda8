"""Every measured figure an operator page cites is stated once, in docs/figures.md, and checked
against the text of its source; other pages link to it with its value as the link's text."""

import re
from pathlib import Path

import pytest
from conftest import prose

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "docs/figures.md"
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]*figures\.md)#([\w.-]+)\)")
# Pages an operator reads (docs/dev/ is the engineers' evidence, with dated figures of its own).
OPERATOR_PAGES = [
    "README.md",
    "CHANGELOG.md",
    "SECURITY.md",
    "deploy/README.md",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")) if p != FIGURES),
]
# A number with a unit of measure, outside code spans: in an operator page it is a figure (linked
# to docs/figures.md) unless it is written as a setting or bound, in backticks.
MEASURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|µs|MiB|KiB|millicores)(?!\w)")


def rows() -> dict[str, tuple[str, str, str]]:
    """id → (value, source path, the source's words)."""
    out = {}
    for line in FIGURES.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) != 5 or not cells[0].startswith("<a id="):
            continue
        fid = re.search(r'id="([^"]+)"', cells[0]).group(1)
        source = re.search(r"\]\(([^)#]+)", cells[3]).group(1)
        words = cells[4].strip("`").replace("\\|", "|").replace("\\`", "`")
        out[fid] = (cells[2], source, words)
    return out


def test_the_figures_page_has_figures() -> None:
    assert len(rows()) >= 5, rows()


@pytest.mark.parametrize("fid", sorted(rows()))
def test_each_figure_is_its_sources_words(fid: str) -> None:
    value, source, words = rows()[fid]
    assert value in words, f"{fid}: the value {value!r} is not in the quoted words {words!r}"
    text = (FIGURES.parent / source).read_text()
    assert words in text, f"{fid}: {source} no longer says {words!r} (the figure changed: update docs/figures.md)"


@pytest.mark.parametrize("page", OPERATOR_PAGES)
def test_pages_cite_figures_by_link_with_the_same_value(page: str) -> None:
    known = rows()
    wrong = []
    for n, line in prose(ROOT / page):
        for text, _, fid in LINK.findall(line):
            if fid not in known:
                wrong.append(f"{page}:{n}: #{fid} is no figure of docs/figures.md")
            elif text != known[fid][0]:
                wrong.append(f"{page}:{n}: {text!r}, but docs/figures.md#{fid} says {known[fid][0]!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", OPERATOR_PAGES)
def test_pages_state_no_figure_of_their_own(page: str) -> None:
    stated = []
    for n, line in prose(ROOT / page):
        bare = LINK.sub("", re.sub(r"`[^`]*`", "", line))
        stated += [f"{page}:{n}: {m.group(0)}" for m in MEASURE.finditer(bare)]
    assert not stated, "a measured figure outside docs/figures.md (link to it), or a setting not in backticks:\n" + "\n".join(stated)
