"""The README and docs/ as an operator reads them: lines that fit a screen, links that lead somewhere."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "deploy/README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((n, line))
    return lines


def generated_flag_table(path: Path) -> set[int]:
    """Line numbers of the flag table made from the agent's flag definitions (a table's rows
    cannot wrap; `cargo test -p valet-agent flag_table` checks it against the flags)."""
    lines = path.read_text().splitlines()
    begin = next((n for n, line in enumerate(lines, 1) if line.startswith("<!-- flags: made by")), None)
    end = next((n for n, line in enumerate(lines, 1) if line.startswith("<!-- end of flags -->")), None)
    assert begin and end and begin < end, "README.md lost its generated flag table's markers"
    return set(range(begin, end + 1))


def test_readme_lines_fit_120_columns() -> None:
    table = generated_flag_table(ROOT / "README.md")
    wide = [
        f"README.md:{n}: {len(line)} characters"
        for n, line in prose(ROOT / "README.md")
        if len(line) > 120 and n not in table
    ]
    assert not wide, "\n".join(wide)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(page: Path) -> None:
    broken = []
    for n, line in prose(page):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "\n".join(broken)


def test_every_agent_setting_is_in_the_readme_flag_table() -> None:
    config = (ROOT / "agent/src/config.rs").read_text()
    envs = set(re.findall(r'env = "(VALET_[A-Z0-9_]+)"', config))
    assert len(envs) > 20, f"the agent's settings were not found in config.rs: {sorted(envs)}"
    table = [line for _, line in prose(ROOT / "README.md") if line.startswith("|")]
    rows = {m for line in table for m in re.findall(r"`(VALET_[A-Z0-9_]+)`", line)}
    missing = sorted(envs - rows)
    assert not missing, f"settings without a row in the README's flag table: {missing}"
