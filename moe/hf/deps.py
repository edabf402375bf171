"""The optional dependencies of `moe.hf` (transformers, safetensors), imported on first use.

Nothing else in `moe` imports transformers: `import moe` never needs it.
"""
from __future__ import annotations

import importlib
import re
from types import ModuleType

__all__ = ["MIN_TRANSFORMERS", "check_transformers_version", "require"]

#: The oldest transformers `moe.hf` runs on: 5.x holds a block's experts as fused tensors
#: (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) that 4.x lacks, and
#: 5.17 is the oldest 5.x it was checked on (pyproject's `hf` extra).
MIN_TRANSFORMERS = (5, 17)

_INSTALL_HINT = 'pip install -e ".[hf]" (transformers>=5.17, safetensors)'


def require(name: str) -> ModuleType:
    """Import and return `name` ("transformers" or "safetensors"), or raise ImportError
    naming the extra that installs it (transformers: also where it is older than
    `MIN_TRANSFORMERS`, `check_transformers_version`)."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"moe.hf needs the {name!r} package, which is not installed: "
                          f"{_INSTALL_HINT}") from exc
    if name == "transformers":
        check_transformers_version(getattr(module, "__version__", ""))
    return module


def check_transformers_version(version: str) -> None:
    """Raise ImportError, in one line, where transformers `version` (e.g. "4.57.1") is
    older than `MIN_TRANSFORMERS`, naming both and the install command. A version that
    does not start with major.minor is let through."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) >= MIN_TRANSFORMERS:
        return
    needed = ".".join(map(str, MIN_TRANSFORMERS))
    raise ImportError(f"moe.hf needs transformers >= {needed} (MoE experts held as fused "
                      f"gate_up_proj / down_proj tensors), but transformers {version} is "
                      f"installed: {_INSTALL_HINT}")
