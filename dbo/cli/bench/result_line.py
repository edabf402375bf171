"""How a one-shot bench tool ends (`compiled`, `hf_generate`): its table for people, its
result as one JSON line on stdout, and the same line in `<out_dir>/<file_name>` when an
output folder was given (made where missing)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

__all__ = ["print_result"]


def print_result(table: str, result: dict[str, Any], *, out_dir: Optional[str],
                 file_name: str) -> None:
    """Print `table`, write the JSON line into `out_dir` (if given), then print the line."""
    print(table)
    line = json.dumps(result)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, file_name).write_text(line + "\n")
    print(line)
