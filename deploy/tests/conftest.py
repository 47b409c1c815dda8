"""Shared fixtures: every kustomization under deploy/, rendered once per session.

Renders (the `renders` fixture, name -> Render):
  base              deploy/ (the agent and the node-scoped-writes policy, Kubernetes >= 1.30)
  before-1.30       deploy/before-1.30/ (the agent alone, for older clusters)
  base+<component>  deploy/ with one component from deploy/components/ (an overlay made in
                    a temporary directory: a Component cannot be built on its own)
  base+components   deploy/ with every component
  example           deploy/examples/

New components are picked up from the directory listing, so they are covered by every test
without editing this file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1]
COMPONENTS = sorted(p.parent for p in (DEPLOY / "components").glob("*/kustomization.yaml"))
EXAMPLES = DEPLOY / "examples"
BEFORE_130 = DEPLOY / "before-1.30"


@dataclass
class Render:
    name: str
    text: str
    docs: list[dict] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d.get("kind") == kind]

    def one(self, kind: str, name: str) -> dict:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind}/{name}, found {len(found)}"
        return found[0]


def kubectl() -> str:
    exe = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not exe:
        pytest.fail("kubectl not found (needed for `kubectl kustomize`); set KUBECTL or PATH")
    return exe


def kustomize(directory: Path) -> str:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    return proc.stdout


def overlay(tmp: Path, name: str, components: list[Path]) -> Path:
    """A throwaway overlay: the base plus `components`. kustomize wants relative paths."""
    d = tmp / name
    d.mkdir(parents=True)
    rel = lambda p: os.path.relpath(p, d)  # noqa: E731
    (d / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [rel(DEPLOY)],
                "components": [rel(c) for c in components],
            }
        )
    )
    return d


def render_targets(tmp: Path) -> dict[str, Path]:
    targets = {"base": DEPLOY, "before-1.30": BEFORE_130}
    for c in COMPONENTS:
        targets[f"base+{c.name}"] = overlay(tmp, f"base+{c.name}", [c])
    if COMPONENTS:
        targets["base+components"] = overlay(tmp, "base+components", COMPONENTS)
    targets["example"] = EXAMPLES
    return targets


@pytest.fixture(scope="session")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Render]:
    tmp = tmp_path_factory.mktemp("overlays")
    out = {}
    for name, directory in render_targets(tmp).items():
        text = kustomize(directory)
        docs = [d for d in yaml.safe_load_all(text) if d]
        out[name] = Render(name, text, docs)
    return out


@pytest.fixture(scope="session")
def all_docs(renders: dict[str, Render]) -> list[tuple[str, dict]]:
    return [(r.name, d) for r in renders.values() for d in r.docs]


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
