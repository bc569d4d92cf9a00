"""The house rules of the code's layout (docs/architecture.md): no import circle of more than one
module in service/, engine/, grammar/, kernels/ or schemas/, and no module importing a private
name from another package.

Imports are read from the source (``ast``), at any depth (an import inside a function counts:
it is a circle all the same, only deferred); imports under ``if TYPE_CHECKING:`` do not run and
are left out. ``from pkg import mod`` is an edge to ``pkg.mod``, not to ``pkg``'s ``__init__``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "engine", "grammar", "kernels", "schemas")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = "stencil." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _runtime_nodes(tree: ast.AST):
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return [n for n in ast.walk(tree) if id(n) not in skip and isinstance(n, (ast.Import, ast.ImportFrom))]


def _graph(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for mod, path in mods.items():
        own_pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.level == 0 and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                targets = subs + ([node.module] if len(subs) < len(node.names) else [])
                target_pkg = node.module if (ROOT / node.module.removeprefix("stencil.").replace(".", "/")).is_dir() \
                    else node.module.rpartition(".")[0]
                private += [(mod, node.module, a.name) for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__") and target_pkg != own_pkg]
            else:
                continue
            for t in targets:
                o = owner(t)
                if o is not None and o != mod:
                    edges[mod].add(o)
    return edges, private


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_circle_finder_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(edges) == [["a", "b", "c"]]


def test_no_import_circles():
    edges, _ = _graph(_modules())
    assert _circles(edges) == []


def test_no_private_names_imported_across_packages():
    _, private = _graph(_modules())
    assert private == []


def test_the_engine_reaches_grammar_through_its_structured_output_manager_only():
    """``engine/structured_output.py`` is the engine's one door to ``grammar/`` (docs/architecture.md)."""
    edges, _ = _graph(_modules())
    doors = {m for m, targets in edges.items() if m.startswith("stencil.engine.")
             and any(t == "stencil.grammar" or t.startswith("stencil.grammar.") for t in targets)}
    assert doors == {"stencil.engine.structured_output"}


def _protocol_members(proto) -> list[str]:
    """A protocol's methods and properties (``__anext__`` and its kind included), and its annotated
    attributes."""
    import inspect

    return sorted({n for n, v in vars(proto).items()
                   if (not n.startswith("_") or n in ("__aiter__", "__anext__"))
                   and (inspect.isfunction(v) or isinstance(v, property))} | set(proto.__annotations__))


def test_both_engines_offer_every_member_of_the_engine_client():
    """The service's one door to an engine (``stencil.service.engine_client.EngineClient``): the local
    engine and the cluster's ingress both have every member, and so do the request streams they hand
    back (``RequestStream``: ``EngineStream``, ``ReplicaStream``). Attributes set in ``__init__`` are
    read off an instance built without running it, so the check needs no model."""
    import inspect

    from stencil.engine.async_engine import AsyncEngine, EngineStream
    from stencil.service.cluster.cluster_engine import ClusterEngine
    from stencil.service.cluster.stream import ReplicaStream
    from stencil.service.engine_client import EngineClient, RequestStream

    members = _protocol_members(EngineClient)
    assert {"submit", "abort_all", "replica_health", "stats", "vocab_size", "kernels", "tokenizer"} <= set(members)
    assert not {"generate", "compile_grammar", "check_request", "check_budget"} & set(members)  # behind submit
    stream_members = _protocol_members(RequestStream)
    assert {"admit", "started", "replica", "warnings", "grammar_ms", "grammar", "aclose", "__anext__"} <= set(
        stream_members)

    def declared(cls) -> set[str]:
        own = {n for k in cls.__mro__ for n in vars(k)}
        src = inspect.getsource(cls)
        return own | {n for n in members + stream_members if f"self.{n} =" in src or f"self.{n}:" in src}

    for cls in (AsyncEngine, ClusterEngine):
        assert [n for n in members if n not in declared(cls)] == [], cls
        assert inspect.signature(cls.submit).parameters.keys() == inspect.signature(
            EngineClient.submit).parameters.keys(), cls
    for cls in (EngineStream, ReplicaStream):
        assert [n for n in stream_members if n not in declared(cls)] == [], cls
        assert inspect.iscoroutinefunction(cls.admit) and inspect.iscoroutinefunction(cls.aclose), cls


# -- the engine door has no side doors (issue 48) ------------------------------------------------------

_ENGINE_OBJECT = re.compile(r"engine|\ba?eng\b|_agen|compiled|stream", re.IGNORECASE)


def _engine_probes(source: str) -> list[str]:
    """Every ``getattr(x, ...)`` / ``hasattr(x, ...)`` in ``source`` whose ``x`` reads as an engine
    object: an engine (``engine``, ``eng``, ``aeng``), a request's stream (``stream``, ``_agen``) or a
    grammar it compiled (``compiled``). The engine's ``tokenizer`` is a Hugging Face object the door
    types as ``Any``, so probing it (``chat_template``) is not probing the engine."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and node.args):
            target = node.args[0]
            if isinstance(target, ast.Attribute) and target.attr == "tokenizer":
                continue
            if _ENGINE_OBJECT.search(ast.unparse(target)):
                found.append(ast.unparse(node))
    return found


def test_the_probe_finder_finds_the_old_side_doors():
    old = '''
if spec is not None and hasattr(state.engine, "grammar_future"): pass
submit = getattr(st.engine, "submit", None)
admit = getattr(self._agen, "admit", None)
warnings = getattr(self.compiled, "warnings", None) or ()
compiled = getattr(stream.compiled, "warnings", None) or ()
replica_health = getattr(eng, "replica_health", None)
more = getattr(aeng, "replica_health", None)
abort_all = getattr(getattr(state, "engine", None), "abort_all", None)
'''
    assert len(_engine_probes(old)) == 8
    assert _engine_probes('getattr(data, name)\ngetattr(svc.engine.tokenizer, "chat_template", None)\n'
                          'getattr(exc, "field", None)\ngetattr(self, "_engineer", None)') == []


def test_the_service_probes_no_engine_object():
    """``stencil.service`` uses an engine, its request streams and the grammars they compiled only
    through ``stencil.service.engine_client`` (``EngineClient``, ``RequestStream``): a member it needs
    is declared there and implemented by every engine, never probed for."""
    probes = {str(p.relative_to(ROOT)): found for p in sorted((ROOT / "service").rglob("*.py"))
              if (found := _engine_probes(p.read_text()))}
    assert probes == {}


# -- grammar's ground floor (issue 48) ------------------------------------------------------------------

GRAMMAR_FLOOR = ("stencil.grammar.program", "stencil.grammar.charclass", "stencil.grammar.charset")
"""``grammar/``'s ground floor (docs/architecture.md), top to bottom: the program format, the
character classes as backends read them, the code-point sets and their regex text."""


def test_grammars_ground_floor_imports_nothing_above_it():
    """Each floor module imports, of Stencil, only the floor modules below it: no other grammar
    module (``charclass`` once imported ``json_schema.charset``), nothing of another package."""
    edges, _ = _graph(_modules())
    assert {mod: sorted(edges[mod] - set(GRAMMAR_FLOOR[i + 1:])) for i, mod in enumerate(GRAMMAR_FLOOR)} == {
        mod: [] for mod in GRAMMAR_FLOOR}
    assert edges["stencil.grammar.charset"] == set()


# -- the model registry (issue 48) -------------------------------------------------------------------

_ARCH_VALUES = ("model_type", "architecture", "arch")  # what holds an architecture's name
_ARCH_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text")  # names once compared in engine/


def _architecture_compares(source: str) -> list[str]:
    """``==`` / ``!=`` / ``in`` / ``not in`` comparisons of an architecture's name: one side a
    ``model_type`` / ``architecture`` / ``arch`` (a name or an attribute), or a literal
    architecture name (or a tuple, list or set holding one)."""
    def named(node) -> bool:
        return ((isinstance(node, ast.Name) and node.id in _ARCH_VALUES)
                or (isinstance(node, ast.Attribute) and node.attr in _ARCH_VALUES))

    def literal(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(literal(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in _ARCH_NAMES

    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare)
            and all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
            and any(named(side) or literal(side) for side in (node.left, *node.comparators))]


def test_the_architecture_compare_finder_finds_the_old_if_chains():
    old = '''
if model_type not in SUPPORTED_MODEL_TYPES: pass
qwen2 = model_type == "qwen2"
if getattr(hf_config, "model_type", None) == "gemma3_text": pass
gemma = spec.model_type == "gemma3"
permute = gguf.architecture == "llama"
spec = _gemma3_spec(gguf) if arch == "gemma3" else _llama_spec(gguf)
table = {**_LAYER, **(_GEMMA if kind in ("gemma3", "x") else _LLAMA)}
'''
    assert len(_architecture_compares(old)) == 7
    assert _architecture_compares('kind == "linear"\nname in ("auto", "eager")\nx.model == y\n'
                                  'spec.sandwich_norms is True') == []


def test_no_architecture_name_is_compared_outside_the_registry():
    """What differs by architecture is asked of its ``stencil.engine.models.registry`` entry or its
    spec (``spec.sandwich_norms``, ``spec.activation``, ...), never decided by comparing names."""
    registry = ROOT / "engine" / "models" / "registry.py"
    found = {str(p.relative_to(ROOT)): hits for pkg in ("engine", "service", "kernels")
             for p in sorted((ROOT / pkg).rglob("*.py"))
             if p != registry and (hits := _architecture_compares(p.read_text()))}
    assert found == {}


def test_every_registry_entry_has_all_its_parts():
    """Each entry's spec reads a tiny transformers config of its kind and has a GGUF reader; its
    model (built on meta) gets every parameter from transformers' names with the shape it needs
    and names every parameter's GGUF tensors; names are unique across entries."""
    import torch
    from transformers import AutoModelForCausalLM

    from gguf_testing import HF_TYPE, hf_config
    from stencil.engine.models import registry
    from stencil.engine.models.gguf_weights import gguf_names

    seen = [n for a in registry.ARCHITECTURES for n in {a.name, *a.hf_model_types}]
    assert len(seen) == len(set(seen)), seen
    assert set(HF_TYPE) == set(registry.names())  # the tiny configs the model tests use cover every entry
    for arch in registry.ARCHITECTURES:
        config = hf_config(arch.name)
        assert registry.for_hf_config(config) is arch and registry.for_gguf(arch.name) is arch
        spec = arch.spec_from_hf(config)
        assert callable(type(spec).from_gguf) and registry.for_spec(spec) is arch
        assert isinstance(spec.activation, str) and isinstance(spec.sandwich_norms, bool)
        model = arch.build(spec, dtype=torch.float32, device="meta")
        assert isinstance(model, torch.nn.Module) and model.spec is spec
        with torch.device("meta"):
            ref = AutoModelForCausalLM.from_config(config).state_dict()
        for name, param in model.named_parameters(remove_duplicate=False):
            if name == "lm_head.weight" and spec.tie_word_embeddings:
                continue
            assert arch.hf_tensor(name, ref.__getitem__).shape == param.shape, (arch.name, name)
            assert all(t.startswith(("blk.", "token_embd", "output")) for t in gguf_names(name, arch.gguf_norms))


def test_loading_refuses_an_unknown_architecture_naming_the_registrys(tmp_path):
    import gguf
    import pytest

    from stencil.engine.models import registry
    from stencil.engine.models.gguf_config import UnsupportedModelError, read_gguf_info
    from stencil.engine.models.loader import spec_from_hf_config

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError) as e:
        read_gguf_info(path)
    assert str(e.value) == (f"unsupported GGUF architecture 'mamba' in mamba.gguf; supported: "
                            f"{', '.join(registry.names())} (Mistral and SmolLM files are llama)")
    with pytest.raises(ValueError) as e:
        spec_from_hf_config(type("Config", (), {"model_type": "mamba"})())
    assert str(e.value) == f"unsupported model_type 'mamba'; supported: {list(registry.hf_model_types())}"
    assert registry.names() == ("llama", "qwen2", "qwen3", "gemma3")


def test_the_docs_name_every_architecture_of_the_registry():
    """Each ``Architectures:`` line of the README and docs/ (what a user may serve) names every registry
    entry, so an entry added is an entry documented."""
    from stencil.engine.models import registry

    lines = {f"{doc.name}:{i}": line for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for i, line in enumerate(doc.read_text().splitlines(), 1) if "Architectures: `" in line}
    assert "models.md" in " ".join(lines)
    assert {at: [n for n in registry.names() if f"`{n}`" not in line] for at, line in lines.items()} == {
        at: [] for at in lines}


# -- the engine imports nothing above it, not even for types (issue 48) ----------------------------

ENGINE_LEAF_TYPES = ("stencil.engine.request", "stencil.engine.outputs")


def _imports(path: Path, *, types: bool) -> set[str]:
    """Absolute module names ``path`` imports at any depth (``from a import b``: ``a`` and ``a.b``),
    those under ``if TYPE_CHECKING:`` too when ``types``."""
    tree = ast.parse(path.read_text())
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if types \
        else _runtime_nodes(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_upward_import_in_the_engine_even_for_types():
    """The rule: no module of ``engine/`` imports ``service/`` or ``benchmarks/`` (the layers above
    it), at any depth and under ``TYPE_CHECKING`` too. And the engine's leaf types, the data every
    layer passes around (``engine/request.py``: ``SamplingParams``, ``Request``; ``engine/outputs.py``:
    ``RequestOutput``), import (types included) no engine module that reaches ``grammar/``, through
    everything importing it runs (parent packages' ``__init__`` included): a type is never a door to
    the grammar compiler, and no type circle runs through it."""
    mods = _modules()
    upward = sorted((m, t) for m, path in mods.items() if m.startswith("stencil.engine")
                    for t in _imports(path, types=True) if t.startswith(("stencil.service", "stencil.benchmarks")))
    assert upward == []

    def loaded(name: str) -> set[str]:
        """The modules of ours that importing ``name`` runs: it and its parent packages."""
        parts = name.split(".")
        return {m for m in (".".join(parts[:i]) for i in range(2, len(parts) + 1)) if m in mods}

    def reaches_grammar(start: str) -> list[str]:
        """The chain of run-time imports from ``start`` to ``grammar/``, or ``[]``."""
        seen, stack = {start}, [(start, [start])]
        while stack:
            mod, chain = stack.pop()
            for target in sorted(_imports(mods[mod], types=False)):
                if target.startswith("stencil.grammar"):
                    return chain + [target]
                for m in sorted(loaded(target) - seen):
                    seen.add(m)
                    stack.append((m, chain + [m]))
        return []

    for leaf in ENGINE_LEAF_TYPES:
        for target in sorted(_imports(mods[leaf], types=True)):
            for m in sorted(loaded(target)):
                assert reaches_grammar(m) == [], (leaf, target)


# -- One import name (docs/architecture.md, "One import name") -----------------------------------

FOLDERS = ("engine", "service", "grammar", "kernels", "schemas", "benchmarks")


def _bare_imports(path: Path, root: Path = ROOT) -> list[str]:
    """``import engine...`` / ``from service... import`` in ``path``: a root folder by its bare name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                 else [])
        found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    return found


def test_the_bare_import_finder_finds_one(tmp_path):
    (tmp_path / "x.py").write_text("import stencil.engine\nfrom engine.request import SamplingParams\n"
                                   "def f():\n    import kernels.cpu\n")
    assert _bare_imports(tmp_path / "x.py", tmp_path) == ["x.py:2: engine.request", "x.py:4: kernels.cpu"]


def test_every_module_imports_stencils_folders_by_the_stencil_name():
    """A bare ``import engine`` would load a second copy of a module (two registries, two locks)
    where the repository root is on sys.path, and fails in an installed wheel."""
    paths = [p for folder in (*FOLDERS, "stencil", "tests", "examples") for p in (ROOT / folder).rglob("*.py")]
    assert len(paths) > 200
    assert [hit for p in paths for hit in _bare_imports(p)] == []


def test_the_wheel_claims_only_the_stencil_import_name(stencil_wheel):
    import zipfile

    names = zipfile.ZipFile(stencil_wheel).namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"stencil"} and len(dist_info) == 1, top
    # Every root folder's modules are under stencil/, with the data the code reads at run time.
    for folder in FOLDERS:
        expected = {f"stencil/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / folder).rglob("*.py")
                    if "__pycache__" not in p.parts}
        assert expected and expected <= set(names), sorted(expected - set(names))[:5]
    assert {f"stencil/kernels/csrc/{p.name}" for p in (ROOT / "kernels" / "csrc").glob("*.c")} <= set(names)
    assert any(n.startswith("stencil/benchmarks/data/") for n in names)
    entry_points = zipfile.ZipFile(stencil_wheel).read(f"{dist_info.pop()}/entry_points.txt").decode()
    assert "stencil = stencil.service.cli:main" in entry_points
