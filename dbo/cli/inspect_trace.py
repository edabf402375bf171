"""`dbo inspect FILE`: busy, overlapped and exposed comm time per device of a trace
(`traces.analyze`), its output paths checked first.

    dbo inspect dbo_out/run/trace.json --png dbo_out/run/    # writes .../timeline.png
    dbo inspect trace.sqlite --png timeline.png --json report.json

`--png` and `--json` name a file, or an existing folder (or one ending in "/") to write
`timeline.png` / `trace_analysis.json` in, as `dbo plan --out DIR` writes `plan.png` in
DIR; the path printed is the one written. A --png not ending in .png is refused
(matplotlib would add the suffix, or write another format).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from dbo.cli import Parser, check_out_file

#: (option, the file written in a folder, the suffix a file must have).
OUTPUTS = (("--png", "timeline.png", ".png"), ("--json", "trace_analysis.json", ".json"))


def output_path(option: str, text: str, *, name: str, suffix: str) -> str:
    """The file an output option writes: `text`, or `name` inside it where it is a folder
    (existing, or written with a trailing "/"). ValueError (with the fix) for a file
    without `suffix`, or one that cannot be written."""
    path = Path(text)
    if text.endswith(("/", "\\")) or path.is_dir():
        path = path / name
    elif path.suffix.lower() != suffix:
        raise ValueError(f"{option}={text}: name a {suffix} file, or a folder to write {name} "
                         f"in (end it with / if it does not exist yet)")
    if path.parent.exists():
        check_out_file(option, str(path))
    return str(path)


def main(argv: Optional[list[str]] = None) -> int:
    """Check --png and --json, then run `traces.analyze` with the files they name."""
    from traces.analyze import main as analyze

    argv = sys.argv[1:] if argv is None else list(argv)
    outputs = Parser("dbo inspect", add_help=False, allow_abbrev=False)
    for option, _, _ in OUTPUTS:
        outputs.add_argument(option, default=None)
    known, rest = outputs.parse_known_args(argv)
    try:
        for option, name, suffix in OUTPUTS:
            text = getattr(known, option[2:])
            if text is not None:
                rest += [option, output_path(option, text, name=name, suffix=suffix)]
    except ValueError as exc:
        outputs.error(str(exc))
    return analyze(rest)


if __name__ == "__main__":
    sys.exit(main())
