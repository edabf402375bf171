"""``python -m traces FILE [options]``: the trace analyzer (same as ``python -m traces.analyze``)."""
from __future__ import annotations

from traces.analyze import main

if __name__ == "__main__":
    raise SystemExit(main())
