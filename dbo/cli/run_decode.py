"""`dbo run --decode-steps N`: decode steps over KV caches after the prefill, DBO off and on.

Each rank prefills two KV caches (`moe.models.kv_cache.KVCache`) with its batch, one
through the model (DBO off) and one through a `DBORunner` whose split gives each ubatch
the caches of its requests (`with_cache_split`, the job's thresholds), then runs N decode
steps of one token per request in both, feeding both the same tokens (the greedy choice
of the DBO-off logits). Every step's logits are compared as the prefill's are (near-ties
of the routing left out, `moe.routing_log`) and timed; the summary gets a `decode`
entry. Decode steps run eagerly: a cache's lengths are read on the host every step.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from dbo import DBORunner
from moe import record_routing, routing_ties
from moe.models import KVCache, with_cache_split


@dataclass(frozen=True)
class DecodeResult:
    """One rank's decode steps: the largest checked difference, its tolerance, the tokens
    left out at routing near-ties, median step seconds, and the last DBO decision."""

    max_abs_diff: float
    tolerance: float
    routing_ties: int
    step_s_off: float
    step_s_on: float
    split: bool
    reason: str
    requests: int


def run_decode_steps(model: Any, runner: DBORunner, args: tuple, kwargs: dict, *,
                     steps: int, device: torch.device) -> DecodeResult:
    """Prefill and `steps` decode steps with DBO off and on (every rank calls this)."""
    input_ids_T, positions_T = args
    seq_lens = list(kwargs["seq_lens"])
    num_requests = len(seq_lens)
    decoder = DBORunner(model, with_cache_split(runner.config), group=runner.group)
    caches = {mode: KVCache.empty(model.config, num_requests=num_requests,
                                  capacity=max(seq_lens) + steps, device=device)
              for mode in ("off", "on")}
    call: dict[str, Callable[..., Any]] = {"off": model, "on": decoder}
    rel = 1e-4 if model.config.dtype == torch.float32 else 2e-2
    ends = torch.tensor(seq_lens, device=device).cumsum(0) - 1
    with torch.no_grad():
        prefill = {mode: call[mode](input_ids_T, positions_T, seq_lens=seq_lens,
                                    cache=caches[mode]) for mode in call}
        next_B = prefill["off"][ends].argmax(dim=-1)
        worst, tol, ties, times = 0.0, rel, 0, {"off": [], "on": []}
        for _ in range(steps):
            positions_B = caches["off"].next_positions()
            out, routed = {}, {}
            for mode in ("off", "on"):
                with record_routing(model) as routed[mode]:
                    out[mode], seconds = timed_step(lambda: call[mode](
                        next_B, positions_B, seq_lens=[1] * num_requests,
                        cache=caches[mode]), device)
                times[mode].append(seconds)
            scale = out["off"].float().abs().max().item() if out["off"].numel() else 0.0
            step_tol = rel * max(1.0, scale)
            ties_B = routing_ties(routed["off"], routed["on"], num_tokens=num_requests,
                                  logit_atol=rel * max(1.0, routed["off"].logit_scale()))
            diff_B = (out["on"].float() - out["off"].float()).abs().amax(dim=-1).cpu()
            checked = diff_B[~ties_B]
            worst = max(worst, checked.max().item() if checked.numel() else 0.0)
            tol, ties = max(tol, step_tol), ties + int(ties_B.sum())
            next_B = out["off"].argmax(dim=-1)
    decision = decoder.last_decision
    assert decision is not None
    return DecodeResult(worst, tol, ties, statistics.median(times["off"]),
                        statistics.median(times["on"]), decision.split, decision.reason,
                        num_requests)


def decode_summary(mine: DecodeResult, steps: int) -> dict[str, Any]:
    """The `decode` entry of the summary from every rank's results (a collective)."""
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, mine)
    step_off = max(r.step_s_off for r in results)
    step_on = max(r.step_s_on for r in results)
    total = sum(r.requests for r in results)
    return {"steps": steps, "requests_per_rank": [r.requests for r in results],
            "split": mine.split, "reason": mine.reason,
            "outputs_match": all(r.max_abs_diff <= r.tolerance for r in results),
            "max_abs_diff": [r.max_abs_diff for r in results],
            "tolerance": [r.tolerance for r in results],
            "routing_ties": [r.routing_ties for r in results],
            "step_ms": {"dbo_off": step_off * 1e3, "dbo_on": step_on * 1e3},
            "tokens_per_s": {"dbo_off": total / step_off, "dbo_on": total / step_on}}


def print_decode(d: dict[str, Any]) -> None:
    """The decode lines of `dbo run`'s report."""
    verdict = "match" if d["outputs_match"] else "DIFFER"
    print(f"\ndecode: {d['steps']} steps of one token per request over KV caches, requests "
          f"per rank {d['requests_per_rank']}")
    print(f"  split: {d['split']} ({d['reason']})")
    print(f"  outputs DBO on vs off: {verdict} (max |diff| per rank "
          f"{['%.2e' % v for v in d['max_abs_diff']]}, tolerance "
          f"{['%.1e' % t for t in d['tolerance']]})")
    if any(d["routing_ties"]):
        print(f"  not compared: tokens per rank routed to other experts at a near-tie: "
              f"{d['routing_ties']}")
    for mode in ("dbo_off", "dbo_on"):
        print(f"  {mode:<10} {d['step_ms'][mode]:>10.3f} ms/step (median, slowest rank) "
              f"{d['tokens_per_s'][mode]:>12.0f} tokens/s")


def timed_step(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """`fn()` and its seconds (CUDA events on GPU, perf_counter on CPU); ranks in step."""
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - begin
