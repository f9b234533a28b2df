"""Both Lightning namespaces from one source tree, as Lightning's own build makes ``pytorch_lightning`` from
``lightning.pytorch``: our modules served with their imports rewritten, as ``lightning_shardplus.pytorch_lightning``
(and as ``lightning_shardplus`` itself where only ``pytorch_lightning`` is installed); the strategy names registered
in each namespace's registry, ``pytorch_lightning``'s when it is imported. The story: docs/compatibility.md."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE = "lightning_shardplus"
MIRROR = f"{PACKAGE}.pytorch_lightning"
LIGHTNING = "lightning.pytorch"
PYTORCH_LIGHTNING = "pytorch_lightning"
_ROOT = Path(__file__).parents[1]  # the package's folder

_TO_PYTORCH_LIGHTNING = [
    (re.compile(r"(?<![\w.])lightning\.pytorch\b"), "pytorch_lightning"),
    (re.compile(r"(?<![\w.])lightning\.fabric\b"), "lightning_fabric"),
]
# our package where code names it (imports, dotted names, "lightning_shardplus.X" strings); not a bare word or a path:
# both sides share ~/.cache/lightning_shardplus/
_TO_MIRROR = [(
    re.compile(rf"(?<![\w./])(?:{PACKAGE}(?=\.(?!pytorch_lightning\b)[A-Za-z_])|(?<=import ){PACKAGE}\b(?![./\w])|"
               rf"{PACKAGE}(?= import ))"),
    MIRROR,
)]  # fmt: skip


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # a module in sys.modules without a spec
        return name in sys.modules


def primary_namespace() -> str:
    """The namespace of ``lightning_shardplus`` itself: ``lightning.pytorch`` where ``lightning`` is installed,
    unless ``SHARDPLUS_NAMESPACE=pytorch_lightning`` asks for the other; else ``pytorch_lightning``."""
    chosen = os.environ.get("SHARDPLUS_NAMESPACE", "")
    if chosen not in ("", LIGHTNING, "lightning", PYTORCH_LIGHTNING):
        raise ImportError(f"SHARDPLUS_NAMESPACE={chosen!r} is not valid: 'lightning' or 'pytorch_lightning'")
    if chosen != PYTORCH_LIGHTNING and _installed("lightning"):
        return LIGHTNING
    if _installed(PYTORCH_LIGHTNING):
        return PYTORCH_LIGHTNING
    raise ImportError(
        "lightning-shardplus needs Lightning: `pip install lightning-shardplus[lightning]` (lightning.pytorch) or "
        "`pip install lightning-shardplus[pytorch-lightning]` (pytorch_lightning), releases 2.4 or newer"
    )


PRIMARY = primary_namespace()


def namespace_of(module_name: str) -> str:
    """The Lightning namespace a module of ours is written for."""
    return PYTORCH_LIGHTNING if module_name.partition(".pytorch_lightning")[1] else PRIMARY


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Loads one of our source files with its names rewritten, compiled under the source file's own name: the
    rewriting keeps every line where it is, so a breakpoint set on a line of the real file (pdb, an IDE) fires when
    this side runs it, and tracebacks point at the real file and line. ``get_source`` gives the rewritten text. No
    ``__pycache__``: the bytecode there is the unrewritten file's."""

    def __init__(self, fullname: str, path: str, rules: list[tuple[re.Pattern[str], str]]) -> None:
        super().__init__(fullname, path)
        self.rules = rules

    def get_source(self, fullname: str) -> str:
        source = importlib.util.decode_source(self.get_data(self.path))
        for pattern, replacement in self.rules:
            source = pattern.sub(replacement, source)
        return source

    def get_code(self, fullname: str) -> Any:
        return compile(self.get_source(fullname), self.path, "exec", dont_inherit=True)


class _AliasLoader(importlib.abc.InspectLoader):
    """Gives the module already imported under another name (the mirror where the package is itself for
    ``pytorch_lightning``, and our one ``_namespace``): one set of classes, two names; its code and source for
    ``python -m`` and debuggers are the target's."""

    def __init__(self, target: str) -> None:
        self.target = target

    def _loader(self) -> Any:
        return importlib.util.find_spec(self.target).loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self.spec  # the import system stamped the alias's spec on it

    def is_package(self, fullname: str) -> bool:
        return self._loader().is_package(self.target)

    def get_filename(self, fullname: str) -> str:
        return self._loader().get_filename(self.target)

    def get_source(self, fullname: str) -> str | None:
        return self._loader().get_source(self.target)

    def get_code(self, fullname: str) -> Any:
        return self._loader().get_code(self.target)


class _Finder(importlib.abc.MetaPathFinder):
    """Serves ``lightning_shardplus.pytorch_lightning[.x]`` and, where the package is for ``pytorch_lightning``,
    ``lightning_shardplus.x``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == MIRROR or fullname.startswith(MIRROR + "."):
            original = PACKAGE + fullname[len(MIRROR) :]
            if PRIMARY == PYTORCH_LIGHTNING or original == __name__:  # this module: one finder per process
                return importlib.util.spec_from_loader(fullname, _AliasLoader(original))
            return _source_spec(fullname, original, _TO_PYTORCH_LIGHTNING + _TO_MIRROR)
        if PRIMARY == PYTORCH_LIGHTNING and fullname.startswith(PACKAGE + ".") and fullname != __name__:
            return _source_spec(fullname, fullname, _TO_PYTORCH_LIGHTNING)
        return None


def _source_spec(fullname: str, original: str, rules: list) -> importlib.machinery.ModuleSpec | None:
    base = _ROOT.joinpath(*original.split(".")[1:])
    package = base / "__init__.py"
    path, is_package = (package, True) if package.is_file() else (base.with_suffix(".py"), False)
    if not path.is_file():
        return None
    return importlib.util.spec_from_file_location(
        fullname,
        path,
        loader=_RewritingLoader(fullname, str(path), rules),
        submodule_search_locations=[str(base)] if is_package else None,
    )


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def register(strategy_class: type, names: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """Register ``names`` in the registry of ``strategy_class``'s namespace; from the primary package, also in
    ``pytorch_lightning``'s (when it is imported) with a factory that imports the mirror on first use."""
    namespace = namespace_of(strategy_class.__module__)
    strategy_class.register_strategies(importlib.import_module(f"{namespace}.strategies").StrategyRegistry)
    if namespace == LIGHTNING and _installed(PYTORCH_LIGHTNING):
        _after_import(PYTORCH_LIGHTNING, lambda: _register_mirror(strategy_class.__name__, names))


def _register_mirror(class_name: str, names: dict[str, tuple[str, dict[str, Any]]]) -> None:
    registry = importlib.import_module(f"{PYTORCH_LIGHTNING}.strategies").StrategyRegistry
    for name, (description, init_params) in names.items():
        if name not in registry:  # importing the mirror registers its class in its place
            factory = functools.partial(_mirror_strategy, class_name)
            registry.register(name, factory, description=description, **init_params)


def _mirror_strategy(class_name: str, **init_params: Any) -> Any:
    """``pytorch_lightning``'s registry entry until the mirror is imported: imports it, builds its strategy."""
    return getattr(importlib.import_module(MIRROR), class_name)(**init_params)


def _after_import(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` now if module ``name`` is imported, else right after it is."""
    if name in sys.modules:
        callback()
    elif not any(isinstance(finder, _AfterImport) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders and makes its loader call ``callback`` once the module has run."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_call(module: Any) -> None:
                exec_module(module)
                self.callback()

            spec.loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec
