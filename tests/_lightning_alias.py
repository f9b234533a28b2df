"""Where only ``pytorch_lightning`` is installed (the compatibility stage's run), the tests' ``lightning.pytorch``
and ``lightning.fabric`` imports give ``pytorch_lightning`` and ``lightning_fabric``: the same tests, the other
namespace (the package itself is then for ``pytorch_lightning``: ``lightning_shardplus._compat.namespace``)."""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

TARGETS = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric"}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        for prefix, replacement in TARGETS.items():
            if fullname == prefix or fullname.startswith(prefix + "."):
                return importlib.util.spec_from_loader(fullname, _Alias(replacement + fullname[len(prefix) :]))
        return None


def install() -> None:
    parent = types.ModuleType("lightning")  # a bare package: its `pytorch` and `fabric` come from the finder
    parent.__path__ = []
    parent.__spec__ = importlib.machinery.ModuleSpec("lightning", None, is_package=True)
    sys.modules["lightning"] = parent
    sys.meta_path.insert(0, _Finder())
