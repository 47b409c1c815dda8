"""The README and docs/ as an operator reads them: lines that fit a screen, links that lead somewhere."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    ROOT / "SECURITY.md",
    ROOT / "CHANGELOG.md",
    ROOT / "deploy/README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs/dev").glob("*.md")),
]
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


OPERATOR_PAGES = [
    "README.md",
    "CHANGELOG.md",
    *(f"docs/{p}.md" for p in ("install", "observe", "opt-in", "upgrade", "uninstall", "troubleshoot")),
]


@pytest.mark.parametrize("page", OPERATOR_PAGES)
def test_operator_pages_fit_120_columns(page: str) -> None:
    wide = [f"{page}:{n}: {len(line)} characters" for n, line in prose(ROOT / page) if len(line) > 120]
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


def test_every_agent_setting_is_in_the_flag_table() -> None:
    config = (ROOT / "agent/src/config.rs").read_text()
    envs = set(re.findall(r'env = "(VALET_[A-Z0-9_]+)"', config))
    assert len(envs) > 20, f"the agent's settings were not found in config.rs: {sorted(envs)}"
    table = [line for _, line in prose(ROOT / "docs/configure.md") if line.startswith("|")]
    rows = {m for line in table for m in re.findall(r"`(VALET_[A-Z0-9_]+)`", line)}
    missing = sorted(envs - rows)
    assert not missing, f"settings without a row in docs/configure.md's flag table: {missing}"


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.split()]


def test_every_docs_path_named_anywhere_exists() -> None:
    """Source comments, manifests and scripts that name a page of docs/ name one that is there."""
    mention = re.compile(r"(?<![\w/.])(docs/[\w/-]+\.md)")
    missing = []
    for path in tracked_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for page in mention.findall(line):
                if not (ROOT / page).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {page}")
    assert not missing, "\n".join(missing)
