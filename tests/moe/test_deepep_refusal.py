"""Layer 1 (CPU): the DeepEP backends (`deepep_ht`, `deepep_ll`, `deepep_v2`) are
registered by name, importing them never imports `deep_ep`, and constructing a layer
with one refuses in one line saying what is missing and how to get it: no `deep_ep`,
a `deep_ep` without `ElasticBuffer` (v2), and no CUDA (`deepep_v2`'s further refusals are
in tests/moe/test_deepep_v2.py). A fake `deep_ep` module stands in for the real one.
"""
from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from moe import MoEConfig, MoELayer
from moe.backends.registry import BACKENDS, UNTESTED_BACKENDS

DEEPEP = ["deepep_ht", "deepep_ll", "deepep_v2"]


def make_layer(backend: str) -> MoELayer:
    return MoELayer(MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                              backend=backend))


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


@pytest.fixture
def no_deep_ep(monkeypatch):
    """`deep_ep` is not found, even where it is installed (a None in sys.modules reads
    as absent to `importlib.util.find_spec` and `import`)."""
    monkeypatch.setitem(sys.modules, "deep_ep", None)


def fake_deep_ep(monkeypatch, *names: str) -> None:
    module = types.ModuleType("deep_ep")
    module.__spec__ = types.SimpleNamespace(name="deep_ep")  # find_spec reads sys.modules
    for name in names:
        setattr(module, name, type(name, (), {}))
    monkeypatch.setitem(sys.modules, "deep_ep", module)


def test_registered_and_v2_marked_untested():
    assert set(DEEPEP) <= set(BACKENDS)
    assert "deepep_v2" in UNTESTED_BACKENDS and set(UNTESTED_BACKENDS) <= set(BACKENDS)


@pytest.mark.parametrize("backend,cls", [("deepep_ht", "Buffer"), ("deepep_ll", "Buffer"),
                                         ("deepep_v2", "ElasticBuffer")])
def test_without_deep_ep_refuses_saying_how_to_get_it(no_deep_ep, backend, cls):
    with pytest.raises(ImportError) as exc:
        make_layer(backend)
    message = one_line(exc)
    assert f"backend {backend!r} needs DeepEP (deep_ep.{cls}), which is not installed" in message
    assert "github.com/deepseek-ai/DeepEP" in message and "use backend 'a2a'" in message


def test_v2_refuses_a_deep_ep_without_elastic_buffer(monkeypatch):
    fake_deep_ep(monkeypatch, "Buffer")
    with pytest.raises(ImportError) as exc:
        make_layer("deepep_v2")
    assert "needs deep_ep.ElasticBuffer, which the installed deep_ep lacks" in one_line(exc)
    assert "NCCL >= 2.30.4" in str(exc.value)


@pytest.mark.parametrize("backend", DEEPEP)
def test_without_cuda_refuses(monkeypatch, backend):
    fake_deep_ep(monkeypatch, "Buffer", "ElasticBuffer")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as exc:
        make_layer(backend)
    assert "this process has no CUDA device" in one_line(exc)


def test_importing_the_backends_never_imports_deep_ep():
    """A finder that records every lookup of `deep_ep` sees none while the backend
    modules (and moe) import."""
    code = (
        "import sys\n"
        "seen = []\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'deep_ep': seen.append(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import moe, moe.backends.deepep_ht, moe.backends.deepep_ll, moe.backends.deepep_v2\n"
        "assert not seen, seen\n")
    subprocess.run([sys.executable, "-c", code], check=True)
