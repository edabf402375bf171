"""The expert benchmark's results: one `Point` per (shape, tokens, path), what is derived
from the points of one shape (the share of the dense chain, the error against the
ground truth), and the table for people."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Point:
    """One measured (shape, tokens, path)."""

    shape: str
    tokens: int
    path: str
    ms: float | None
    tflops: float | None
    peak_gb: float | None
    min_gb: float
    err: float | None = None
    note: str = ""
    vs_dense: float | None = None  # this path's TFLOP/s over the dense chain's, same point
    sm_mhz: float | None = None  # median SM clock while the timed calls ran
    capped: str = ""  # "k/n": samples that found the clock held back by the power limit


def attach_dense_share(points: list[Point]) -> list[Point]:
    """Set `vs_dense` (TFLOP/s over the dense chain's, same point) where both were timed."""
    dense = next((p for p in points if p.path == "dense" and p.tflops), None)
    if dense is None:
        return points
    return [replace(p, vs_dense=p.tflops / dense.tflops) if p.tflops and p is not dense else p
            for p in points]


def attach_error(points: list[Point], outputs: dict[str, torch.Tensor]) -> None:
    """Set `err` on the last triton point: max |triton - truth| / max |truth|."""
    vs = "reference" if "reference" in outputs else "grouped"
    if "triton" not in outputs or vs not in outputs:
        return
    truth = outputs[vs].float()
    diff = (outputs["triton"].float() - truth).abs().max().item()
    err = diff / (truth.abs().max().item() or 1.0)
    for i in range(len(points) - 1, -1, -1):
        if points[i].path == "triton":
            points[i] = replace(points[i], err=err, note=f"err vs {vs}")
            return


def format_table(points: list[Point]) -> str:
    header = (f"{'shape':<10} {'T':>6} {'path':<10} {'ms':>10} {'TFLOP/s':>8} {'of dense':>8} "
              f"{'SM MHz':>6} {'capped':>6} {'peak GB':>8} {'min GB':>7} {'err':>8}  note")
    lines = [header, "-" * len(header)]
    for p in points:
        ms = f"{p.ms:10.3f}" if p.ms is not None else f"{'-':>10}"
        rate = f"{p.tflops:8.1f}" if p.tflops is not None else f"{'-':>8}"
        peak = f"{p.peak_gb:8.2f}" if p.peak_gb is not None else f"{'-':>8}"
        err = f"{p.err:8.1e}" if p.err is not None else f"{'-':>8}"
        share = f"{p.vs_dense:8.1%}" if p.vs_dense is not None else f"{'-':>8}"
        clock = f"{p.sm_mhz:6.0f}" if p.sm_mhz is not None else f"{'-':>6}"
        lines.append(f"{p.shape:<10} {p.tokens:>6} {p.path:<10} {ms} {rate} {share} {clock} "
                     f"{p.capped or '-':>6} {peak} {p.min_gb:7.2f} {err}  {p.note}")
    return "\n".join(lines)
