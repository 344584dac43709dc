"""Imports go down the layers (DESIGN.md, "Layers"): executors and serving never import services,
and the client never imports the server. Read from the source with ``ast`` (imports inside
functions and under ``TYPE_CHECKING`` count too), so a wrong-way import fails here before it runs.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import gpuport

ROOT = Path(gpuport.__file__).parent

# (the package whose modules are checked, the package they must not import)
RULES = [
    ("gpuport.server.executors", "gpuport.server.services"),
    ("gpuport.server.serving", "gpuport.server.services"),
    ("gpuport.client", "gpuport.server"),
]


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, with its line: ``from a.b import c`` gives ``a.b`` and
    ``a.b.c`` (c may be a module); relative imports are resolved against ``path``'s package."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def wrong_way(package: str, forbidden: str) -> list[str]:
    folder = ROOT.parent.joinpath(*package.split("."))
    found = {}
    for path in sorted(folder.rglob("*.py")):
        for line, name in imported(path):
            if name == forbidden or name.startswith(forbidden + "."):
                found.setdefault((str(path.relative_to(ROOT.parent)), line), name)
    return [f"{path}:{line} imports {name}" for (path, line), name in found.items()]


@pytest.mark.parametrize(("package", "forbidden"), RULES)
def test_no_import_goes_up(package: str, forbidden: str) -> None:
    found = wrong_way(package, forbidden)
    assert not found, f"{package} must not import {forbidden} (move what it needs lower):\n" + "\n".join(found)


def test_the_check_sees_every_form_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: each way of writing an import that goes up is caught, one going down is not."""
    fake = tmp_path / "gpuport"
    (fake / "server" / "executors").mkdir(parents=True)
    (fake / "server" / "services").mkdir()
    for init in ("", "server", "server/executors", "server/services"):
        (fake / init / "__init__.py").write_text("")
    (fake / "server" / "executors" / "up.py").write_text(
        "import gpuport.server.services.jobs\n"
        "from gpuport.server.services import blobs\n"
        "from ..services.sessions import Staged\n"
        "def f():\n"
        "    from gpuport.server import services\n"
        "from gpuport.server import store\n"  # down: allowed
        "from . import base\n"  # beside: allowed
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    found = wrong_way("gpuport.server.executors", "gpuport.server.services")
    assert [f.split(":")[1].split()[0] for f in found] == ["1", "2", "3", "5"]
