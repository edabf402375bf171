"""Soak run: many DBO steps with random token counts per rank; outputs and memory checked.

    python -m dbo.cli.soak                                        # CPU: 2 gloo ranks, 2000 steps
    python -m dbo.cli.soak --steps 500 --backend a2a_ll --layers 1 --world-size 2
    python -m dbo.cli.soak --steps 2000 --bad-every 50   # CPU: a rank's bad input every 50
    python -m dbo.cli.soak --steps 20000 --max-tokens 512        # GPUs: one rank per GPU, NCCL
    torchrun --nproc_per_node=2 -m dbo.cli.soak --steps 20000
    python -m dbo.cli.soak --backend deepep_ll --cuda-graph --dtype bfloat16 --hidden 7168 \
        --intermediate 256 --max-tokens 256 --experts triton    # GPUs: graphed DeepEP LL

Every rank builds the same small fp32 model (`--layers` `MoELayer`s with a shared expert,
experts split over all ranks, a Linear + GELU after each) and runs `--steps` steps. At
each step every rank draws its own token count in [0, --max-tokens] and its input from a
generator seeded by (seed, step, rank), so counts differ across ranks. Rank r is forced
to 0 tokens on every step s with s % n == n - 1, n = ZERO_EVERY[r] (rank 1: every 7th;
ranks 0 and 1 together: every 77th); step 0 gives every rank --max-tokens, so buffers
sized by the token count reach their high-water mark during warmup. The model runs
directly (the no-DBO reference) and through a `DBORunner(split="tokens")` on the same
input, and the two must agree within --atol at every step. Every rank calls the runner
every step, with 0 tokens too: the split vote is a collective.

--dtype bfloat16 checks every MoE layer of every step on its own against a float32 dense
reference from the same bf16 inputs, weights and routing, to a bound derived from bf16
rounding (`dbo.cli.soak.reference`), and reports the largest relative error.
--cuda-graph (GPUs; a graph-safe backend, not a2a) runs the DBO steps as CUDA graph
replays (`dbo.graphs.GraphedRunner`): each step's tokens are padded with zero rows up to
the next of --graph-sizes (default: powers of two from 2, then --max-tokens) and only
the real rows are checked (`dbo.cli.soak.padding`); the first steps sweep the sizes on
every rank, so each rank captures one graph per size during warmup and none after; the
captures are counted and held to sizes x splits.

Memory: the baseline is taken after --warmup steps, a sample every --report-every steps
(each after `gc.collect()`, with no step's tensors alive). Asserted, each on every rank:
- CPU `tracemalloc`: the Python-heap bytes allocated after warmup and still alive
  <= --bound-kib. It sees Python objects only (a leaked tensor's Python object, a
  growing list), not tensor storage, which torch's CPU allocator takes from malloc
  without statistics in this torch build. Tracing makes Python ~1.5x slower, so
  --trace-window W traces only the W steps before each sample (each window from zero)
  and holds every window to the same rate, --bound-kib * W / (measured steps); a leak
  that happens only on untraced steps escapes tracemalloc (not the object counts).
- Tensor storage: on GPU `torch.cuda.memory_allocated()`, on CPU the bytes of the
  distinct storages of the tensors reachable from Python (`gc`), each less the growth of
  the MoE layers' scratch workspaces (grow-only buffers, bounded by --max-tokens and the
  routing; logged separately) <= --bound-kib.
- Object counts: gc-tracked Python objects <= MAX_OBJECT_GROWTH over the later half of
  the run (from the middle sample, where at least five were taken: lazily filled caches
  rise once after warmup and stop, a leak keeps adding one object per step), tensors
  reachable from Python <= MAX_TENSOR_GROWTH from the baseline.
- The process RSS (/proc/self/statm), on CPU where at least five samples were taken:
  <= --bound-kib over the later half of the run, as the object count (malloc keeps the
  pages it takes while the run's sizes first spread, so the growth from the baseline is
  reported, not asserted). On GPUs reported only.
Growth is taken at the smaller of the last two samples (a sample can catch the tensors of
the last collective before the communication thread lets go of them; a leak raises both).

--bad-every N: every N-th step one rank in turn gets rows one value too wide, which the
model's `dbo_check_inputs` rejects before the vote. Every rank must stop that step at the
vote (that rank raising its own ValueError, the others `PeerInputError`, each marked as
stopped together) and the next step reuses the group; the stopped steps are counted and
must be those scheduled, on every rank.

Prints a progress line every --report-every steps (rank 0, stderr), a table per rank,
then one JSON line. Exit code 1 when a step mismatched, a scheduled stop did not happen
as it must, or memory grew past a bound.
"""

from dbo.cli.soak.config import MAX_OBJECT_GROWTH, MAX_TENSOR_GROWTH, SoakConfig
from dbo.cli.soak.memory import MemoryTracker
from dbo.cli.soak.run import main, run_rank, run_soak

__all__ = ["MAX_OBJECT_GROWTH", "MAX_TENSOR_GROWTH", "MemoryTracker", "SoakConfig", "main",
           "run_rank", "run_soak"]
