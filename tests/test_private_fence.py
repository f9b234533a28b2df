"""The fence: a private name of another package (``_x`` that lightning_shardplus does not define itself: Lightning's,
torch's, torchmetrics', jsonargparse's, argparse's) is used only in ``_lightning.py`` or ``_torch.py``, where a canary
test (tests/test_lightning_private.py) fails when a release moves it. The benchmark (``bench/``) is included: it
ships to users as ``python -m lightning_shardplus.bench``."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_shardplus"
FENCE = {"_lightning.py", "_torch.py"}
ALLOWED = {"_getframe"}  # sys._getframe: CPython's documented frame access, not another package's internals

def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _names(tree: ast.AST) -> tuple[set[str], dict[str, int]]:
    """Names ``tree`` defines, and the attribute and imported names it uses (with a line)."""
    defined, used = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            defined.add(node.attr)
        if isinstance(node, ast.Attribute):
            used.setdefault(node.attr, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not node.module.startswith("lightning_shardplus"):
            for alias in node.names:
                used.setdefault(alias.name, node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                used.setdefault(node.args[1].value, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                for part in alias.name.split(".")[1:]:
                    used.setdefault(part, node.lineno)
    return defined, used


def private_names_outside_the_fence() -> dict[str, list[str]]:
    """Foreign private name -> the places (``module:line``) outside the fence that use it."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    defined = set().union(*(_names(tree)[0] for tree in trees.values()))
    found: dict[str, list[str]] = {}
    for path, tree in trees.items():
        if path.name in FENCE and path.parent == PACKAGE:
            continue
        for name, line in _names(tree)[1].items():
            if name.startswith("_") and not name.startswith("__") and name not in defined | ALLOWED:
                found.setdefault(name, []).append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return found


def test_no_private_name_outside_the_fence():
    found = private_names_outside_the_fence()
    assert not found, f"private names of other packages outside _lightning.py/_torch.py: {found}"


def test_the_fence_sees_a_private_attribute_and_a_private_import(tmp_path):
    tree = ast.parse(
        "from torch.distributed import _secret\nimport torch\ntorch.nn._hidden\ngetattr(torch, '_by_name', 0)\n"
        "metric._written = True\nself._own = 1\n"
    )
    defined, used = _names(tree)
    assert {"_secret", "_hidden", "_by_name", "_written"} <= set(used) and "_written" not in defined
    assert "_own" in defined
