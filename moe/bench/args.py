"""Command-line helpers shared by the expert benchmarks (`moe.bench.experts`,
`moe.bench.tune`): comma lists of names and of integers, checked."""
from __future__ import annotations

import argparse
import sys
from typing import Callable


def split_names(text: str, valid: object, flag: str) -> list[str]:
    """A comma list of names from `valid`; exits 2 naming the unknown ones."""
    items = [s for s in text.split(",") if s]
    bad = [s for s in items if s not in valid]
    if bad or not items:
        print(f"error: {flag} {text!r}: unknown {bad}; use a comma list of {', '.join(valid)}",
              file=sys.stderr)
        raise SystemExit(2)
    return items


def split_ints(parser: argparse.ArgumentParser, text: str, option: str, *, example: str,
               valid: Callable[[int], bool], need: str) -> list[int]:
    """A comma list of integers that are all `valid` (a parser error naming `need` otherwise)."""
    try:
        values = [int(t) for t in text.split(",") if t]
    except ValueError:
        parser.error(f"{option} {text!r}: give comma-separated integers, e.g. {example}")
    if not values or not all(map(valid, values)):
        parser.error(f"{option} {values}: give {need}")
    return values


def split_tokens(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """`--tokens`: a comma list of positive integers (a parser error otherwise)."""
    return split_ints(parser, text, "--tokens", example="64,4096", valid=lambda t: t >= 1,
                      need="positive integers")
