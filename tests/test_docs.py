"""The architecture page names only what a fresh clone has.

docs/architecture.md cites files (``engine/scheduler.py``) and dotted names
(``stencil.service.generation.start``); each must resolve in the repository itself, so the page cannot
silently go stale when a module moves. Pure text: nothing is imported.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "engine", "grammar", "kernels", "schemas", "stencil", "tests", "benchmarks", "docs",
            "examples")
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _module_file(parts: list[str]) -> Path | None:
    """The source file of the module ``parts`` names (a package's ``__init__.py``), or None."""
    path = ROOT.joinpath(*parts)
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _defines(source: str, name: str) -> bool:
    """Whether ``source`` defines ``name`` at some level: a def, a class or an assignment."""
    return re.search(rf"^\s*(?:async def|def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]",
                     source, re.M) is not None


def unresolved(text: str) -> list[str]:
    """Every backquoted repository path or dotted name of ``text`` that does not resolve."""
    missing = []
    for token in sorted(set(re.findall(r"`([^`\s]+)`", text))):
        token = token.rstrip("/")
        head = re.split(r"[./]", token)[0]
        if head not in PACKAGES:
            continue
        if "/" in token:
            if not (ROOT / token).exists():
                missing.append(token)
        elif re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", token):
            parts = token.split(".")
            for i in range(len(parts), 0, -1):
                module = _module_file(parts[:i])
                if module is not None:
                    break
            if module is None or (i < len(parts) and not _defines(module.read_text(), parts[-1])):
                missing.append(token)
    return missing


def test_the_checker_catches_a_stale_reference():
    text = "`engine/scheduler.py`, `stencil.engine.scheduler.Scheduler`, `engine/no_such.py`, `stencil.engine.scheduler.nothing`"
    assert unresolved(text) == ["stencil.engine.scheduler.nothing", "engine/no_such.py"]


def test_architecture_names_only_what_exists():
    assert unresolved(ARCHITECTURE.read_text()) == []


def test_readme_links_the_architecture():
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text()


def test_no_file_cites_a_document_the_repository_lacks():
    absent = "DESIGN" + ".md"  # spelled apart, so this file does not cite it either
    citing = [str(p.relative_to(ROOT)) for pkg in PACKAGES if (ROOT / pkg).is_dir()
              for p in (ROOT / pkg).rglob("*") if p.suffix in {".py", ".md", ".c"} and absent in p.read_text()]
    if absent in (ROOT / "README.md").read_text():
        citing.append("README.md")
    assert citing == []


def test_benchmarks_page_names_only_what_exists_and_each_figure_its_cpu():
    page = ROOT / "docs" / "benchmarks.md"
    text = page.read_text()
    assert unresolved(text) == []
    assert "(docs/benchmarks.md)" in (ROOT / "README.md").read_text()
    # every CPU section says which CPU its figures hold for, as lscpu names it
    sections = [s for s in text.split("\n## ")[1:]]
    assert sections and all("`lscpu`" in s.split("\n", 1)[0] or "lscpu" in s[:400] for s in sections)
