"""The walk of one value through the project's own functions, read from the source.

``walk(modules, "calm_training.fit", "fit_adapter", "config")`` starts at a function and a
parameter and follows the value: into every project function a call hands it to (as an
argument, positionally or by keyword), into the methods called on it, and on through the
names that hold it (``x = value``; ``plan = FitPlan.resolve(config)``: an object a project class
builds from it carries it; ``config = plan.config`` reads it back; what a function computes
from it does not). A project class called with it is entered at its ``__init__``, and a value
stored on the object (``self.config = config``) is carried into every method of that class
that reads it (``self.config.steps``). Each function reached is a stop
(once); the walk's files are the files of its stops, in visiting order, and a return is a
step back to a file the walk had already left. Calls are resolved through each module's
imports and its own top-level names; a method call on a carried value is resolved by the
class names of the module the value's constructor came from. A method called on an object
whose class is known without running anything (``self``, or a name bound to what a project
function annotated ``-> SomeClass`` returns, e.g. a method looked up in a registry) is
followed into that class and into every project subclass that overrides it: a dispatch
is walked through all its implementations, not lost. This is what the tests need here, not
a type checker.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Walk:
    stops: list[tuple[str, str]] = field(default_factory=list)  # (module, qualified name)

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(module for module, _ in self.stops))

    @property
    def returns(self) -> int:
        seen, last, count = set(), None, 0
        for module, _ in self.stops:
            if module != last and module in seen:
                count += 1
            seen.add(module)
            last = module
        return count


class _Module:
    def __init__(self, name: str, path: Path, modules: dict[str, Path]) -> None:
        self.name = name
        self.tree = ast.parse(path.read_text(encoding="utf-8"))
        self.functions: dict[str, ast.FunctionDef] = {}
        self.classes: dict[str, dict[str, ast.FunctionDef]] = {}
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = {n.name: n for n in node.body
                                           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        package = name.rsplit(".", 1)[0]
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom):
                base = (package if node.level == 1 else "") + (
                    ("." if node.level and node.module else "") + (node.module or ""))
                base = base.lstrip(".")
                for alias in node.names:
                    if base in modules:
                        self.imported[alias.asname or alias.name] = (base, alias.name)
                    elif f"{base}.{alias.name}" in modules:
                        self.imported[alias.asname or alias.name] = (f"{base}.{alias.name}", "")


def walk(modules: dict[str, Path], module: str, function: str, parameter: str, *,
         values: bool = False, objects: bool = True, typed: bool = True) -> Walk:
    """The walk of ``parameter`` from ``module.function`` (see the module's docstring).

    ``values``: follow every value computed from it too (``x = f(config.a) + 1`` carries,
    and a call is followed when any name in an argument carries), not only the value itself,
    the objects built from it and its fields: every function a run's settings reach.
    ``objects=False``: do not follow a method called on a carried object (a drawing that
    does not track which class a value has); ``typed=False``: do not follow a dispatch
    (``self`` calls, names bound to what an annotated function returns) either."""
    loaded: dict[str, _Module] = {}

    def get(name: str) -> _Module:
        if name not in loaded:
            loaded[name] = _Module(name, modules[name], modules)
        return loaded[name]

    def lookup(module: _Module, name: str):
        """``(module, qualified name, node)`` of a top-level function or class method."""
        if name in module.functions:
            return module.name, name, module.functions[name]
        if name in module.imported:
            target, attr = module.imported[name]
            if attr:
                return lookup(get(target), attr)
        return None

    def callee(module: _Module, call: ast.Call, carried: dict[str, str | None]):
        func = call.func
        if isinstance(func, ast.Name):
            cls = _class_of(module, func.id, get)  # a constructor: its __init__
            if cls is not None:
                init = cls[2].get("__init__")
                return None if init is None else (cls[0], f"{cls[1]}.__init__", init)
            return lookup(module, func.id)
        owner = _name_of(func.value) if isinstance(func, ast.Attribute) else None
        if owner is not None:
            if objects and owner in carried and carried[owner]:  # a method on a carried object
                mod, cls = carried[owner].split(":")
                methods = get(mod).classes.get(cls, {})
                if func.attr in methods:
                    return mod, f"{cls}.{func.attr}", methods[func.attr]
            target = _class_of(module, owner, get)
            if target and func.attr in target[2]:
                return target[0], f"{target[1]}.{func.attr}", target[2][func.attr]
            if owner in module.imported and not module.imported[owner][1]:
                return lookup(get(module.imported[owner][0]), func.attr)
        return None

    result = Walk()
    visited: set[tuple[str, str]] = set()
    #: (module, class) -> the attributes of its objects that carry the value (``self.name``)
    stored: dict[tuple[str, str], dict[str, str | None]] = {}

    def visit(mod_name: str, qualname: str, node: ast.FunctionDef, names: dict) -> None:
        key = (mod_name, qualname)
        if key in visited:
            return
        visited.add(key)
        result.stops.append(key)
        module = get(mod_name)
        owner = qualname.split(".")[0] if "." in qualname else None
        carried = {**stored.get((mod_name, owner), {}), **names}
        typed_names = _typed_names(module, qualname, node, lookup, get) if typed else {}
        for stmt in ast.walk(node):
            if isinstance(stmt, ast.Assign | ast.AnnAssign):
                value = stmt.value
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                kind = _carries(value, carried, module, get, parameter, values)
                if kind is not False:
                    for target in targets:
                        key = _name_of(target)
                        if key is not None:
                            carried[key] = kind
                        if key and key.startswith("self.") and owner in module.classes:
                            stored.setdefault((mod_name, owner), {})[key] = kind
        for call in [n for n in ast.walk(node) if isinstance(n, ast.Call)]:
            args = [(i, a) for i, a in enumerate(call.args)] + [
                (k.arg, k.value) for k in call.keywords]
            handed = [(slot, _name_of(a)) for slot, a in args if _name_of(a) in carried]
            if values:  # an argument computed from a carried value hands it on
                handed = [(slot, name) for slot, a in args
                          for name in [_carried_name(a, carried)] if name is not None]
            on_carried = (isinstance(call.func, ast.Attribute)
                          and _name_of(call.func.value) in carried)
            read = any(isinstance(a, ast.Attribute) and _name_of(a.value) in carried
                       for _, a in args)
            if not handed and not on_carried and not read:
                continue
            func = call.func
            if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                    and func.value.id in typed_names and not carried.get(func.value.id)):
                found = _implementations(typed_names[func.value.id], func.attr, modules, get)
            else:
                found = [f for f in [callee(module, call, carried)] if f is not None]
            for target_mod, target_name, target_node in found:
                params = [a.arg for a in target_node.args.args + target_node.args.kwonlyargs]
                offset = 1 if params[:1] in (["self"], ["cls"]) else 0
                inner = {}
                for slot, name in handed:
                    param = (params[slot + offset] if isinstance(slot, int)
                             and slot + offset < len(params) else slot)
                    if isinstance(param, str):
                        inner[param] = carried[name]
                if on_carried and offset:
                    inner[params[0]] = carried[_name_of(call.func.value)]
                visit(target_mod, target_name, target_node, inner)
        # the object holds the value now: every method of its class that reads it
        for key in dict(stored.get((mod_name, owner), {})) if owner else ():
            attr = key.split(".", 1)[1]
            for name, method in module.classes[owner].items():
                if any(isinstance(n, ast.Attribute) and n.attr == attr
                       and _name_of(n) == key for n in ast.walk(method)):
                    visit(mod_name, f"{owner}.{name}", method, {})

    mod = get(module)
    visit(module, function, mod.functions[function], {parameter: None})
    return result


def _typed_names(module: _Module, qualname: str, node: ast.FunctionDef, lookup, get) -> dict:
    """The names of ``node`` whose class is known: ``self`` in a method, and each name bound to
    the call of a project function annotated to return a project class."""
    typed = {}
    owner = qualname.split(".")[0]
    if "." in qualname and owner in module.classes:
        typed["self"] = (module.name, owner, module.classes[owner])
    for stmt in ast.walk(node):
        if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value.func, ast.Name)):
            continue
        found = lookup(module, stmt.value.func.id)
        if found is not None and isinstance(found[2].returns, ast.Name):
            cls = _class_of(get(found[0]), found[2].returns.id, get)
            if cls is not None:
                typed[stmt.targets[0].id] = cls
    return typed


def _implementations(cls, attr: str, modules: dict[str, Path], get) -> list:
    """``attr`` of the class ``cls`` (``(module, class, methods)``) and of every project class
    that derives from it (directly or not) and overrides it."""
    found, family = [], {cls[1]}
    if attr in cls[2]:
        found.append((cls[0], f"{cls[1]}.{attr}", cls[2][attr]))
    grew = True
    while grew:
        grew = False
        for name in modules:
            module = get(name)
            for node in module.tree.body:
                if (isinstance(node, ast.ClassDef) and node.name not in family
                        and any(isinstance(b, ast.Name) and b.id in family for b in node.bases)):
                    family.add(node.name)
                    grew = True
                    if attr in module.classes[node.name]:
                        found.append((name, f"{node.name}.{attr}",
                                      module.classes[node.name][attr]))
    return found


def _class_of(module: _Module, name: str, get):
    """``(module, class, methods)`` when ``name`` is a project class seen from ``module``."""
    if name in module.classes:
        return module.name, name, module.classes[name]
    if name in module.imported:
        target, attr = module.imported[name]
        if attr and attr in get(target).classes:
            return target, attr, get(target).classes[attr]
    return None


def _name_of(node) -> str | None:
    """``x`` for the name ``x``, ``self.x`` for an attribute of ``self``; else None."""
    if isinstance(node, ast.Name):
        return node.id
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self"):
        return f"self.{node.attr}"
    return None


def _carried_name(node, carried: dict) -> str | None:
    """The first carried name (or ``self.x``) in the expression ``node``, or None."""
    return next((key for n in ast.walk(node) for key in [_name_of(n)] if key in carried), None)


def _carries(value, carried: dict, module: _Module, get, parameter: str, values: bool = False):
    """``False`` when ``value`` does not carry a carried value; else its class (``"module:
    Class"``) when it is built by a project class's constructor or class method, or None
    (``values``: anything computed from a carried value carries)."""
    names = {_name_of(n) for n in ast.walk(value)}
    if not names & set(carried):
        return False
    if _name_of(value) in carried:
        return carried[_name_of(value)]
    if isinstance(value, ast.Call):
        func = value.func
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(
            func.value, ast.Name) else func.id if isinstance(func, ast.Name) else None
        if owner is not None:
            cls = _class_of(module, owner, get)
            if cls is not None:
                return f"{cls[0]}:{cls[1]}"
        return None if values else False
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) \
            and value.value.id in carried and value.attr == parameter:
        return None  # plan.config: the value read back
    return None if values else False


def main(argv: list[str] | None = None) -> int:
    """``python tests/structure_walk.py [--values] [--no-objects] [--untyped] [--stops]
    [--root DIR] [--start M:F:P]``:
    the walk of ``calm_training.fit:fit_adapter:config`` (or ``--start``) in this checkout
    (or ``--root``): its stops, files and returns."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--start", default="calm_training.fit:fit_adapter:config")
    parser.add_argument("--values", action="store_true",
                        help="follow every value computed from it too")
    parser.add_argument("--no-objects", dest="objects", action="store_false",
                        help="do not follow methods called on carried objects")
    parser.add_argument("--untyped", dest="typed", action="store_false",
                        help="do not follow a dispatch (self, registry lookups) either")
    parser.add_argument("--stops", action="store_true", help="list the stops")
    args = parser.parse_args(argv)
    folders = {"calm_runtime": "calm_runtime", "calm_export": "export",
               "calm_training": "training"}
    modules = {}
    for package, folder in folders.items():
        for path in sorted((args.root / folder).rglob("*.py")):
            parts = [package, *path.relative_to(args.root / folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    module, function, parameter = args.start.split(":")
    found = walk(modules, module, function, parameter, values=args.values,
                 objects=args.objects, typed=args.typed)
    print(f"{len(found.stops)} stops in {len(found.files)} files, {found.returns} returns")
    for stop in found.stops if args.stops else ():
        print("  " + ".".join(stop))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
