"""The packages' import structure, read from the source with ``ast`` (nothing is imported).

Every import counts, those inside functions too: a lazy import that closes a cycle still ties
the modules together, and so does one under ``if TYPE_CHECKING:`` (annotations only, never
executed, but a reader still goes round the circle). ``from package import name`` counts as
an import of the submodule ``package.name`` when there is one, else of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: import name -> folder in the checkout (pyproject.toml's package-dir)
PACKAGES = {"calm_runtime": "calm_runtime", "calm_export": "export", "calm_training": "training"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[:len(base) - node.level + 1]
                target = ".".join(stem + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(target)
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_modules():
    graph = _graph()
    assert len(graph) > 60  # the walk found the packages
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_imports_neither_training_nor_export():
    """``calm_runtime`` (what a server installs) finds the training and export commands
    through entry points, never by importing those packages."""
    graph = _graph()
    upward = {(name, target) for name, targets in graph.items()
              if name.split(".")[0] == "calm_runtime"
              for target in targets if target.split(".")[0] != "calm_runtime"}
    assert upward == set()


def test_no_two_packages_import_each_other():
    """Data flows one way: training may call export (the quickstart exports what it fits),
    export never imports training (the temperature fit a recalibration needs lives in
    ``calm_runtime.temperature``)."""
    graph = _graph()
    pairs = {(name.split(".")[0], target.split(".")[0]) for name, targets in graph.items()
             for target in targets if target.split(".")[0] in PACKAGES}
    pairs = {(a, b) for a, b in pairs if a != b}
    assert not {(a, b) for a, b in pairs if (b, a) in pairs}, sorted(pairs)
    assert ("calm_export", "calm_training") not in pairs


def test_the_optional_commands_are_entry_points():
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    commands = project["entry-points"]["calm.commands"]
    assert commands == {"train": "calm_training.cli:register",
                        "export": "calm_export.cli:register",
                        "score_served": "calm_training.served_score:score_served"}
    modules = _modules()
    for target in commands.values():
        module, _, attribute = target.partition(":")
        tree = ast.parse(modules[module].read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name == attribute for n in tree.body)


#: where a spec's kind (local model, engine, served model) may be told apart: the resolver,
#: and the runtime's ``calm score`` (an engine or a URL), which cannot import training
KIND_TESTS = {"is_engine": {"training/scoring/sources.py"},
              "is_endpoint": {"training/scoring/sources.py", "calm_runtime/cli/main.py"},
              "isinstance Endpoint": {"training/scoring/sources.py"}}


def _kind_tests(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", None))
        if name in ("is_engine", "is_endpoint"):
            found.add(name)
        elif name == "isinstance" and len(node.args) == 2 and "Endpoint" in ast.unparse(
                node.args[1]):
            found.add("isinstance Endpoint")
    return found


def test_the_model_kind_is_decided_in_the_resolver_only():
    where: dict[str, set[str]] = {name: set() for name in KIND_TESTS}
    for folder in PACKAGES.values():
        for path in (ROOT / folder).rglob("*.py"):
            for name in _kind_tests(ast.parse(path.read_text(encoding="utf-8"))):
                where[name].add(str(path.relative_to(ROOT)))
    assert where == KIND_TESTS


def test_the_kind_check_finds_a_kind_test():
    tree = ast.parse("if isinstance(model, remote.Endpoint) or is_engine(spec): pass")
    assert _kind_tests(tree) == {"isinstance Endpoint", "is_engine"}


#: a module a reader can hold in their head; split anything larger by what it does
MAX_MODULE_LINES = 500


def test_no_module_is_over_the_size_limit():
    sizes = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
             for folder in PACKAGES.values() for path in (ROOT / folder).rglob("*.py")}
    assert len(sizes) > 50
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


#: the longest a benchmark script or helper may grow: split by what its parts do (design,
#: runs, statistics, report), as calm_decisive and engines are
MAX_BENCHMARK_LINES = 600


def test_no_benchmark_file_is_over_its_size_limit():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines())
             for p in (ROOT / "benchmarks").glob("*.py")}
    assert len(sizes) > 10
    over = {name: n for name, n in sizes.items() if n > MAX_BENCHMARK_LINES}
    assert not over, f"benchmark files over {MAX_BENCHMARK_LINES} lines: {over}"


def test_no_benchmark_reaches_into_another_ones_private_names():
    """A benchmark uses what another benchmark module makes public (``from engines import
    paired``, ``engines.paired``), never an underscore name of it."""
    folder = ROOT / "benchmarks"
    stems = {p.stem for p in folder.glob("*.py")}
    found = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.asname or a.name for a in node.names if a.name in stems}
            elif isinstance(node, ast.ImportFrom) and node.module in stems:
                found += [f"{path.name}: from {node.module} import {a.name}"
                          for a in node.names if a.name.startswith("_")]
        found += [f"{path.name}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in imported and node.attr.startswith("_")]
    assert len(stems) > 10
    assert not found, f"private names of other benchmarks: {found}"


#: a fit's settings reach the functions that need them through the resolved plan; the walk
#: of ``config`` (tests/structure_walk.py: the functions it, the plan built from it, or one of
#: its fields is handed to, through every method a registry lookup can return) stays short
#: and in few files
MAX_FIT_WALK = (40, 12)  # stops, files


def test_a_fit_resolves_its_config_once():
    from structure_walk import walk

    found = walk(_modules(), "calm_training.fit", "fit_adapter", "config")
    stops = {f"{module}.{name}" for module, name in found.stops}
    assert "calm_training.posthoc.plan.FitPlan.resolve" in stops
    assert "calm_training.scoring.sources.resolve_source" in stops  # through the plan, once
    # the method's fit and write, each implementation of them (a dispatch is walked through)
    assert {"calm_training.methods.fit_method.FitMethod.fit",
            "calm_training.methods.fit_method.FitMethod.write",
            "calm_training.methods.vector.VectorMethod.write_fit",
            "calm_training.methods.threshold.ThresholdMethod.fit"} <= stops
    assert len(found.stops) <= MAX_FIT_WALK[0], found.stops
    assert len(found.files) <= MAX_FIT_WALK[1], found.files


@pytest.mark.parametrize("start", ["calm_export.pipeline:export_engine:config",
                                   "calm_runtime.server.routes:completions:request",
                                   "calm_training.methods.calm.trainer:train_calm:config"])
def test_an_export_a_training_and_a_completion_request_stay_within_the_room_bound(start):
    """The export's settings, a training's settings (into the trainer object that holds them)
    and a completion request walked as the fit's config is: at most MAX_FIT_WALK's rooms
    (files) each (async handlers included)."""
    from structure_walk import walk

    module, function, parameter = start.split(":")
    found = walk(_modules(), module, function, parameter)
    assert len(found.stops) >= 1 + (module == "calm_runtime.server.routes")  # it is walked
    assert len(found.files) <= MAX_FIT_WALK[1], found.files


def _package(tmp_path, files: dict[str, str]) -> dict[str, Path]:
    """A package ``pkg`` of the modules ``files`` (name -> source) under ``tmp_path``, as the
    walk takes it (module name -> path); a name may hold folders (``low/a``), and
    ``__init__`` is the package's own module."""
    package = tmp_path / "pkg"
    package.mkdir()
    modules = {}
    for name, text in files.items():
        path = package / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = ["pkg", *name.split("/")]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def test_the_walk_follows_a_value_through_calls_and_plans(tmp_path):
    from structure_walk import walk

    modules = _package(tmp_path, {
        "a": (
            "from .b import Plan, use\n"
            "def start(config):\n"
            "    plan = Plan.resolve(config)\n"
            "    size = len(config.name)\n"
            "    use(plan, size)\n"
            "    plan.run()\n"),
        "b": (
            "class Plan:\n"
            "    @classmethod\n"
            "    def resolve(cls, config):\n"
            "        return cls()\n"
            "    def run(self):\n"
            "        helper(self.config)\n"
            "def use(plan, size):\n"
            "    return plan\n"
            "def helper(config):\n"
            "    return unrelated(1)\n"
            "def unrelated(x):\n"
            "    return x\n"),
    })
    found = walk(modules, "pkg.a", "start", "config")
    assert [name for _, name in found.stops] == [
        "start", "Plan.resolve", "use", "Plan.run", "helper"]
    assert found.files == ["pkg.a", "pkg.b"] and found.returns == 0


def test_the_walk_enters_a_constructor_and_the_methods_that_read_what_it_stored(tmp_path):
    """``Trainer(config)`` is entered at ``__init__``; ``self.config = config`` carries the value
    into every method of the class that reads ``self.config``, and on from there."""
    from structure_walk import walk

    modules = _package(tmp_path, {
        "a": (
            "from .t import Trainer\n"
            "def start(config):\n"
            "    return Trainer(config).run()\n"),
        "t": (
            "class Trainer:\n"
            "    def __init__(self, config):\n"
            "        self.config = config\n"
            "        self.other = 1\n"
            "    def run(self):\n"
            "        return steps(self.config.steps)\n"
            "    def idle(self):\n"
            "        return self.other\n"
            "def steps(n):\n"
            "    return n\n"),
    })
    found = walk(modules, "pkg.a", "start", "config")
    assert [name for _, name in found.stops] == [
        "start", "Trainer.__init__", "Trainer.run", "steps"]


def test_the_walk_follows_a_dispatch_into_every_implementation(tmp_path):
    """A method looked up by name (a function annotated to return a class) is walked into
    the class and each subclass that overrides the method called; ``self`` calls too."""
    from structure_walk import walk

    modules = _package(tmp_path, {
        "a": (
            "from .m import lookup\n"
            "def start(config, name):\n"
            "    method = lookup(name)\n"
            "    method.fit(config)\n"),
        "m": (
            "class Method:\n"
            "    def fit(self, config):\n"
            "        self.write(config)\n"
            "    def write(self, config):\n"
            "        return None\n"
            "class Vector(Method):\n"
            "    def write(self, config):\n"
            "        return None\n"
            "class Other(Vector):\n"
            "    def fit(self, config):\n"
            "        return None\n"
            "def lookup(name) -> Method:\n"
            "    return Method()\n"),
    })
    found = walk(modules, "pkg.a", "start", "config")
    assert [name for _, name in found.stops] == [
        "start", "Method.fit", "Method.write", "Vector.write", "Other.fit"]


def test_no_private_name_crosses_a_module():
    """A name another module uses is public: no ``from x import _name``."""
    crossing = []
    for folder in PACKAGES.values():
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom):
                    crossing += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                                 for a in node.names
                                 if a.name.startswith("_") and not a.name.startswith("__")]
    assert not crossing, crossing


def test_an_underscore_module_is_imported_from_its_own_package_only():
    """``_name.py`` is private to its package: a module imported from another package has a
    public name."""
    graph, crossing = _graph(), []
    for name, targets in graph.items():
        for target in targets:
            package, _, last = target.rpartition(".")
            if last.startswith("_") and not (name == package or name.startswith(package + ".")):
                crossing.append(f"{name} imports {target}")
    assert not crossing, crossing


def _private_attribute_reads(tree: ast.AST, modules: set[str]) -> list[str]:
    """``module._name`` reads, where ``module`` is a name bound by importing one of calm's
    modules (another library's private names are that library's business)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name.split(".")[0]): a.name for a in node.names
                      if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module:
            bound |= {(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names
                      if f"{node.module}.{a.name}" in modules}
    return [f"{bound[n.value.id]}.{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id in bound and n.attr.startswith("_") and not n.attr.startswith("__")]


def test_no_private_attribute_is_read_across_modules():
    """``from calm_training.methods.calm import data as calm_data; calm_data._Encoder`` reads a
    private name as surely as ``from x import _name`` does."""
    modules, crossing = set(_modules()), []
    for folder in PACKAGES.values():
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            crossing += [f"{path.relative_to(ROOT)}: {read}"
                         for read in _private_attribute_reads(tree, modules)]
    assert not crossing, crossing


def test_the_attribute_check_finds_a_private_read():
    tree = ast.parse("from calm_training.methods.calm import data as calm_data\n"
                     "import numpy as np\nx = calm_data._Encoder(np._pyx)\n")
    found = _private_attribute_reads(tree, {"calm_training.methods.calm.data"})
    assert found == ["calm_training.methods.calm.data._Encoder"]


#: the scoring modes are decided by calm_runtime.modes.Mode; nothing compares their names
MODE_NAMES = ("cloze", "letter", "p_true")


def _compared_strings(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for part in [node.left, *node.comparators]:
                values = part.elts if isinstance(part, ast.Tuple | ast.Set | ast.List) else [part]
                found |= {v.value for v in values
                          if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return found


def test_modes_are_never_compared_by_name():
    where = {}
    for folder in PACKAGES.values():
        for path in (ROOT / folder).rglob("*.py"):
            hits = _compared_strings(ast.parse(path.read_text(encoding="utf-8"))) & set(
                MODE_NAMES)
            if hits:
                where[str(path.relative_to(ROOT))] = sorted(hits)
    assert not where, where
    assert _compared_strings(ast.parse('if m in ("cloze", "x") or k == "letter": pass')) == {
        "cloze", "x", "letter"}


#: calm-export's output formats are objects (export/formats.py); nothing compares their names
FORMAT_NAMES = ("onnx", "tensorrt", "hf", "gguf")


def test_export_formats_are_never_compared_by_name():
    where = {}
    for path in (ROOT / "export").rglob("*.py"):
        hits = _compared_strings(ast.parse(path.read_text(encoding="utf-8"))) & set(
            FORMAT_NAMES)
        if hits:
            where[str(path.relative_to(ROOT))] = sorted(hits)
    assert not where, where


def test_the_values_walk_follows_what_is_computed_from_the_value(tmp_path):
    from structure_walk import main, walk

    modules = _package(tmp_path, {
        "a": (
            "from .b import shout, count\n"
            "def start(config):\n"
            "    name = config.name.upper()\n"
            "    shout(name + '!')\n"
            "    count(3)\n"),
        "b": (
            "def shout(text):\n"
            "    return text\n"
            "def count(n):\n"
            "    return n\n"),
    })
    assert [name for _, name in walk(modules, "pkg.a", "start", "config").stops] == ["start"]
    assert [name for _, name in walk(modules, "pkg.a", "start", "config",
                                     values=True).stops] == ["start", "shout"]
    assert main(["--stops"]) == 0  # this checkout's fit walk, as the command prints it


def _architecture_names() -> set[str]:
    """Every name docs/architecture.md gives in backticks, split at separators, ``.py``
    dropped (code blocks left out)."""
    import re

    doc = re.sub(r"```.*?```", "", (ROOT / "docs" / "architecture.md").read_text(), flags=re.S)
    return {part for tick in re.findall(r"`([^`\n]+)`", doc)
            for part in re.split(r"[\s,/()]+", tick) if part}


def test_the_architecture_page_names_every_module_and_no_module_that_is_not():
    named = _architecture_names()
    stems = {p.stem for folder in [*PACKAGES.values(), "tests", "benchmarks"]
             for p in (ROOT / folder).rglob("*.py")}
    unnamed = [str(path.relative_to(ROOT)) for path in _modules().values()
               if path.name != "__init__.py" and path.stem not in
               {n.removesuffix(".py") for n in named}]
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"
    absent = sorted(n for n in named if n.endswith(".py") and n[:-3] not in stems)
    assert not absent, f"docs/architecture.md names modules that do not exist: {absent}"


#: the rooms of each package, lowest first (docs/architecture.md, "The order of the rooms"): a
#: room is a folder of the package, its top-level modules are one room named by the package,
#: and a module imports modules of its own room and of rooms before it only, never of a room
#: after it. A package's own ``__init__`` is its facade (``calm_runtime``'s re-exports
#: ``CalibratedLM`` and the adapter) and sits above every room.
ROOM_ORDER = {
    "calm_runtime": ["calm_runtime", "calm_runtime.formats", "calm_runtime.data",
                     "calm_runtime.inference", "calm_runtime.measure", "calm_runtime.server",
                     "calm_runtime.integrations", "calm_runtime.cli"],
    "calm_training": ["calm_training.scoring", "calm_training.posthoc", "calm_training.methods",
                      "calm_training"],
    "calm_export": ["calm_export.graphs", "calm_export"],
}


def _room(name: str, path: Path) -> str:
    """``calm_runtime.formats`` for ``calm_runtime.formats.artifact`` (and for the folder's
    ``__init__``), ``calm_runtime`` for a top-level module such as ``calm_runtime.errors``."""
    parts = name.split(".") + (["__init__"] if path.name == "__init__.py" else [])
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def _back_arrows(modules: dict[str, Path], order: list[str]) -> list[str]:
    """Every import (anywhere in a module: function bodies and ``TYPE_CHECKING`` blocks too)
    from a room of ``order`` into a room after it, as ``importer -> imported``."""
    rank = {room: i for i, room in enumerate(order)}
    found = []
    for name, path in modules.items():
        if "." not in name or _room(name, path) not in rank:  # a facade; another package
            continue
        for target in _imports(name, path, modules):
            there = rank.get(_room(target, modules[target]))
            if there is not None and there > rank[_room(name, path)]:
                found.append(f"{name} -> {target}")
    return sorted(found)


def test_every_room_is_in_the_order():
    rooms = {_room(name, path) for name, path in _modules().items()}
    assert rooms == {room for order in ROOM_ORDER.values() for room in order}


def test_no_arrow_back_up_between_rooms():
    """No room imports a room above it: a package's rooms form one order, lowest first."""
    modules = _modules()
    found = [arrow for order in ROOM_ORDER.values() for arrow in _back_arrows(modules, order)]
    assert not found, found


def test_the_room_check_finds_an_arrow_back_up(tmp_path):
    """A lazy import in a function and an annotation-only one under ``TYPE_CHECKING`` from a
    lower room into a higher one are both found; imports downward and the facade are not."""
    modules = _package(tmp_path, {
        "__init__": "from pkg.high.b import thing\n",
        "core": "x = 1\n",
        "low/a": (
            "from pkg import core\n"
            "def f():\n"
            "    from pkg.high import b\n"
            "    return b, core\n"),
        "low/c": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from ..high.b import thing\n"),
        "high/b": (
            "from pkg.low import a\n"
            "from .. import core\n"
            "thing = 1\n"),
    })
    order = ["pkg", "pkg.low", "pkg.high"]
    assert _back_arrows(modules, order) == ["pkg.low.a -> pkg.high.b", "pkg.low.c -> pkg.high.b"]
    assert _back_arrows(modules, ["pkg", "pkg.high", "pkg.low"]) == ["pkg.high.b -> pkg.low.a"]


def test_the_server_imports_no_command_line_module():
    """The CLI sits above the server (``calm serve`` calls it); the server's settings live in
    ``calm_runtime.server.config``, so no server module reaches back up into ``cli``."""
    graph = _graph()
    back = sorted(f"{name} -> {target}" for name, targets in graph.items()
                  if name.startswith("calm_runtime.server") for target in targets
                  if target.startswith("calm_runtime.cli"))
    assert not back, back


def test_the_server_never_compares_an_endpoint_by_name():
    """Each endpoint's answers have their shape (completions.py, chat.py);
    the writer asks the shape, never ``kind == "chat"``."""
    where = {}
    for path in (ROOT / "calm_runtime" / "server").rglob("*.py"):
        hits = _compared_strings(ast.parse(path.read_text(encoding="utf-8"))) & {
            "completion", "chat", "text_completion", "chat.completion"}
        if hits:
            where[str(path.relative_to(ROOT))] = sorted(hits)
    assert not where, where


#: the training methods' folder: its modules are its own (the package's names are the way in)
CALM_FOLDER = "calm_training.methods.calm"


def _benchmark_modules() -> dict[str, Path]:
    return {f"benchmarks.{p.stem}": p for p in sorted((ROOT / "benchmarks").glob("*.py"))}


def test_no_module_outside_the_training_methods_folder_imports_its_modules():
    """calm_training/methods/calm/ is entered through its package's names (``from
    calm_training.methods.calm import CalmConfig, train_calm``); the registry alone reads its
    ``method`` module, which lists the methods. Benchmarks count too."""
    modules = _modules()
    inside = {name for name in modules if name.startswith(CALM_FOLDER + ".")}
    found = []
    for name, path in {**modules, **_benchmark_modules()}.items():
        if name == CALM_FOLDER or name in inside:
            continue
        for target in _imports(name, path, modules):
            if target in inside and (name, target) != ("calm_training.methods",
                                                       f"{CALM_FOLDER}.method"):
                found.append(f"{name} -> {target}")
    assert not found, found
    assert inside >= {f"{CALM_FOLDER}.{m}" for m in ("trainer", "bilevel", "config", "model",
                                                     "gate", "finish", "cft", "method")}


def test_every_training_method_lives_in_its_folder():
    """Each training method's object is defined in calm_training/methods/calm/method.py; no
    module of the registry's room beside the folder defines one."""
    defined = []
    for name, path in _modules().items():
        if not name.startswith("calm_training.methods") or name.startswith(CALM_FOLDER + "."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined += [f"{name}:{node.lineno}" for node in ast.walk(tree)
                    if isinstance(node, ast.Call) and getattr(node.func, "id", "") in
                    ("TrainMethod", "UpperObjective")]
    assert not defined, defined
