"""``lightning_shardplus.ray`` without Ray installed: an ImportError that names the extra to install (this test runs
where Ray is absent too; tests/test_ray.py runs the strategies on Ray)."""

import importlib
import sys

import pytest


def test_importing_the_ray_front_without_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray...` raises ModuleNotFoundError, as where absent
    monkeypatch.delitem(sys.modules, "lightning_shardplus.ray", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'lightning-shardplus\[ray\]'"):
        importlib.import_module("lightning_shardplus.ray")
