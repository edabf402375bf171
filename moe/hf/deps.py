"""The optional dependencies of `moe.hf` (transformers, safetensors), imported on first use.

Nothing else in `moe` imports transformers: `import moe` never needs it.
"""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]

_INSTALL_HINT = 'pip install -e ".[hf]" (transformers>=5.17, safetensors)'


def require(name: str) -> ModuleType:
    """Import and return `name` ("transformers" or "safetensors"), or raise ImportError
    naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"moe.hf needs the {name!r} package, which is not installed: "
                          f"{_INSTALL_HINT}") from exc
