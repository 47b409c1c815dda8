"""The README and docs/ as an operator reads them: lines that fit a screen, links that lead somewhere."""

import re
import subprocess
from pathlib import Path

import pytest
from conftest import prose

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


ARCH_ROW = re.compile(r"^\| architecture \| ([a-z0-9, ]+?)(?: \(one image\))? \|", re.M)
KERNEL_FLOOR = re.compile(r"kernel\W{1,5}(\d+\.\d+) or later")


def architectures(text: str) -> set[str]:
    rows = ARCH_ROW.findall(text)
    assert len(rows) == 1, f"one architecture row, found {rows}"
    return {a.strip() for a in rows[0].split(",")}


def test_one_set_of_architectures_everywhere() -> None:
    """docs/compatibility.md, docs/dev/portability.md, the DaemonSet's affinity, `cargo xtask image` and the
    Dockerfile name the same architectures."""
    import yaml

    image = re.search(r"pub(?:\(crate\))? const ARCHITECTURES: \[&str; \d+\] = \[([^\]]*)\];",
                      (ROOT / "xtask/src/image.rs").read_text())
    assert image, "xtask/src/image.rs names no ARCHITECTURES"
    built = set(re.findall(r'"([^"]+)"', image.group(1)))
    readme = (ROOT / "docs/compatibility.md").read_text()
    portability = (ROOT / "docs/dev/portability.md").read_text()
    ds = next(d for d in yaml.safe_load_all((ROOT / "deploy/base/daemonset.yaml").read_text())
              if d and d.get("kind") == "DaemonSet")
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    selected = {v for t in terms for e in t["matchExpressions"] if e["key"] == "kubernetes.io/arch"
                for v in e["values"]}
    dockerfile = (ROOT / "Dockerfile").read_text()
    docker = set(re.findall(r"^\s+([a-z0-9]+)\) triple=", dockerfile, re.M))
    assert "ARG TARGETARCH" in dockerfile and "FROM --platform=$BUILDPLATFORM" in dockerfile
    found = {"docs/compatibility.md": architectures(readme), "docs/dev/portability.md": architectures(portability),
             "the DaemonSet's affinity": selected, "cargo xtask image": built, "Dockerfile": docker}
    assert all(v == {"amd64", "arm64"} for v in found.values()), found
    assert not re.search(r"amd64 (only|today)", readme + portability), "a page says amd64 alone"


def test_one_kernel_floor_everywhere() -> None:
    """docs/compatibility.md, docs/dev/portability.md and the DaemonSet state one minimum kernel, the oldest the
    kernel tests run (`cargo xtask kernels`)."""
    found = {}
    for name in ("docs/compatibility.md", "docs/dev/portability.md", "deploy/base/daemonset.yaml"):
        found[name] = set(KERNEL_FLOOR.findall((ROOT / name).read_text()))
        assert found[name], f"{name} states no minimum kernel"
    assert set.union(*found.values()) == {"5.10"}, found
    kernels = (ROOT / "xtask/src/kernels.rs").read_text()
    assert '"5.10"' in kernels, "the floor is a kernel `cargo xtask kernels` runs"
