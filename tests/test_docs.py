"""The documents and the module docstrings name only what a fresh clone has.

docs/*.md and README.md cite files (``engine/scheduler.py``) and dotted names
(``stencil.service.generation.start``); so do the module docstrings of every package. Each must resolve in
the repository itself, so no text silently goes stale when a module moves. The folders at the repository root
import as ``stencil.<folder>`` (setup.py's package map), so a dotted name is written that way: a bare
``engine.scheduler`` names nothing a user can import. Pure text: nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "engine", "grammar", "kernels", "schemas", "stencil", "tests", "benchmarks", "docs",
            "examples")
# The folders setup.py maps under the import name ``stencil`` (``stencil.engine`` is engine/).
MAPPED = ("engine", "service", "grammar", "kernels", "schemas", "benchmarks")
# The packages whose module docstrings are checked.
CODE = ("engine", "service", "grammar", "kernels", "schemas", "benchmarks", "stencil")
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# A dotted word ending so is a file's name (``stencil.json``, a converted model's notes), not a module.
DATA_FILES = ("json", "gguf", "safetensors", "txt", "yaml", "toml")
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+"


def _module_file(parts: list[str]) -> Path | None:
    """The source file of the module ``parts`` names (a package's ``__init__.py``), or None.

    ``stencil.<folder>...`` is looked up in the root folder setup.py maps it from."""
    if len(parts) > 1 and parts[0] == "stencil" and parts[1] in MAPPED:
        parts = parts[1:]
    path = ROOT.joinpath(*parts)
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _defines(source: str, name: str) -> bool:
    """Whether ``source`` defines ``name`` at some level: a def, a class or an assignment."""
    return re.search(rf"^\s*(?:async def|def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]",
                     source, re.M) is not None


def _resolves(token: str) -> bool:
    """Whether the repository path or dotted name ``token`` exists (a bare mapped folder never does)."""
    if "/" in token:
        return (ROOT / token).exists()
    parts = token.split(".")
    if parts[0] in MAPPED:
        return False  # imported as stencil.<folder>: the bare name is not importable
    for i in range(len(parts), 0, -1):
        module = _module_file(parts[:i])
        if module is not None:
            break
    return module is not None and (i == len(parts) or _defines(module.read_text(), parts[-1]))


def _checked(token: str) -> bool:
    """Whether ``token`` is a path or dotted name under one of the repository's folders."""
    token = token.rstrip("/")
    if re.split(r"[./]", token)[0] not in PACKAGES or token.rsplit(".", 1)[-1] in DATA_FILES:
        return False
    if "<" in token:  # a template (`engine/models/<name>.py`), not a name
        return False
    return "/" in token or re.fullmatch(_DOTTED, token) is not None


def unresolved(text: str) -> list[str]:
    """Every backquoted repository path or dotted name of ``text`` that does not resolve, sorted."""
    tokens = {t.rstrip("/") for t in re.findall(r"`([^`\s]+)`", text)}
    return sorted(t for t in tokens if _checked(t) and not _resolves(t))


def docstring_unresolved(text: str) -> list[str]:
    """``unresolved`` for a docstring, which also names things outside backquotes: every ``stencil.x.y``
    and every ``folder/file.ext`` counts wherever it stands."""
    loose = {t for t in re.findall(r"(?<![\w.])stencil(?:\.[A-Za-z_]\w*){2,}", text) if _checked(t)}
    loose |= set(re.findall(r"(?<![\w./-])(?:%s)/[\w./-]*\.(?:py|md|c|h|sh|yaml|toml)\b" % "|".join(PACKAGES),
                            text))
    return sorted(set(unresolved(text)) | {t for t in loose if not _resolves(t)})


def module_docstrings() -> dict[str, str]:
    """Every module docstring of the packages in CODE, by the module's repository path."""
    docs = {}
    for pkg in CODE:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
            if doc:
                docs[str(path.relative_to(ROOT))] = doc
    return docs


def test_the_checker_catches_a_stale_reference():
    text = ("`engine/scheduler.py`, `stencil.engine.scheduler.Scheduler`, `engine/no_such.py`, "
            "`stencil.engine.scheduler.nothing`, `engine.scheduler.Scheduler`, `stencil.cluster.app`, "
            "`service.json_scan`")
    assert unresolved(text) == ["engine.scheduler.Scheduler", "engine/no_such.py", "service.json_scan",
                                "stencil.engine.scheduler.nothing"]


def test_the_docstring_checker_reads_names_outside_backquotes():
    text = ("Called by stencil.engine.scheduler.Scheduler and stencil.engine.no_such.thing; see\n"
            "engine/scheduler.py and engine/gone.py. (A variable's ``grammar.matcher()`` is no module.)")
    assert docstring_unresolved(text) == ["engine/gone.py", "stencil.engine.no_such.thing"]


def test_documents_name_only_what_exists():
    missing = {str(doc.relative_to(ROOT)): unresolved(doc.read_text()) for doc in DOCS}
    assert {doc: names for doc, names in missing.items() if names} == {}


def test_module_docstrings_name_only_what_exists():
    docs = module_docstrings()
    assert len(docs) > 100  # the scan found the packages
    missing = {path: docstring_unresolved(doc) for path, doc in docs.items()}
    assert {path: names for path, names in missing.items() if names} == {}


def test_readme_links_the_architecture():
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text()


def test_no_file_cites_a_document_the_repository_lacks():
    absent = "DESIGN" + ".md"  # spelled apart, so this file does not cite it either
    citing = [str(p.relative_to(ROOT)) for pkg in PACKAGES if (ROOT / pkg).is_dir()
              for p in (ROOT / pkg).rglob("*") if p.suffix in {".py", ".md", ".c"} and absent in p.read_text()]
    if absent in (ROOT / "README.md").read_text():
        citing.append("README.md")
    assert citing == []


def test_benchmarks_page_says_for_each_figure_its_command_and_cpu():
    """docs/benchmarks.md is organised by what is measured: each section has the command that measures it, and
    its figures come in one subsection per CPU whose heading names the CPU as `lscpu` does (or says it was not
    recorded)."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "(docs/benchmarks.md)" in (ROOT / "README.md").read_text()
    sections = text.split("\n## ")[1:]
    assert len(sections) >= 5
    for section in sections:
        title = section.split("\n", 1)[0]
        assert "stencil bench " in section, title
        cpus = [sub.split("\n", 1)[0] for sub in section.split("\n### ")[1:]]
        assert cpus and all("`lscpu`" in cpu or "CPU not recorded" in cpu for cpu in cpus), title


def test_readme_links_lead_to_pages_that_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert {"docs/api.md", "docs/architecture.md", "docs/benchmarks.md"} <= set(links)
    assert [link for link in links if "://" not in link and not (ROOT / link).exists()] == []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            assert "://" in link or (doc.parent / link).exists(), (doc.name, link)


def test_section_pointers_in_the_code_name_a_section_that_exists():
    """A pointer from code to a page's section, written as docs/api.md, "The typed client" (or with single
    quotes inside a help string), names a heading of that page, so moving a section cannot strand it."""
    pointer = re.compile(r"""(README|docs/\w+\.md), ["']([^"'\n]+)["']""")
    stale = []
    for pkg in CODE + ("tests",):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for page, heading in pointer.findall(path.read_text()):
                doc = ROOT / ("README.md" if page == "README" else page)
                if not doc.is_file() or heading not in re.findall(r"^#+ (.+)$", doc.read_text(), re.M):
                    stale.append(f"{path.relative_to(ROOT)}: {page}, {heading!r}")
    assert stale == []
