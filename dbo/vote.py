"""The cross-rank vote: the ranks of a group split a step only if all of them want to.

    tally = cast_ballot(Ballot(inputs_ok=True, want_split=plan.split,
                               num_tokens=plan.total_tokens, fingerprint=fp), group)
    split = vote_split(plan.split, group)        # the split alone (one tiny all-reduce)

Under expert or data parallelism every rank's MoE layers issue collectives together, so
either every rank runs the step as two ubatches or none does. Each rank must call the
vote on every step — also with 0 tokens, also when it does not want to split, also
with DBO disabled (a disabled runner votes too) — or the group's collective sequence
diverges and the ranks hang.

A runner's step votes once, with a `Ballot`: one all-reduce (MIN) of 9 int64s that
carries, besides the split wish and the token counts, whether this rank accepted its
inputs, a fingerprint of the configuration that must agree across ranks
(`dbo.agreement`, `dbo.step_vote`), and whether it holds a CUDA graph for each split of
the step (`dbo.graphs`). Every rank reads the same `Tally`, so every rank stops together (before
any collective of the model) when one rejected its inputs or the fingerprints differ.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from dbo.failures import note_collective, vote_failure
from dbo.groups import side_group
from dbo.split import SplitPlan
from streams.stream_set import new_comm_stream

# Backends whose collectives need device tensors, and the device type they use. Any
# other backend (gloo, mpi, and "cpu:gloo,cuda:nccl" style mixes) votes on the CPU.
_DEVICE_BACKENDS = {"nccl": "cuda", "xccl": "xpu"}
# A ballot's "inputs ok" value; a rank that rejected its inputs sends its group rank
# instead, so the minimum names the lowest rejecting rank.
INPUTS_OK = 1 << 62
# The device vote's side stream, per device.
_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def vote_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device the vote's tensor lives on for `group`'s backend."""
    backend = str(dist.get_backend(group)).lower()
    device_type = _DEVICE_BACKENDS.get(backend)
    if device_type is None:
        return torch.device("cpu")
    module = getattr(torch, device_type)
    return torch.device(device_type, module.current_device())


def _device_vote(values: list[int], group: Optional[dist.ProcessGroup]) -> list[int]:
    """All-reduce (MIN) `values` over a device group, waiting for nothing else.

    On a side stream and communicator (`dbo.groups.side_group`), from and back to pinned
    host memory: the host waits for this all-reduce alone, not for work queued on the
    compute stream or transfers queued on the EP group. Measured on 2x H200 (scale-out emulated,
    4096 tokens per rank, layer mode, alternating in one process), from a DBO step's
    start to ubatch 0's first op: a2a 0.55-0.58 ms with this vote, 0.96-0.98 ms with the
    all-reduce on a gloo twin of the group (the vote before), 0.23 ms with no vote;
    a2a_ll 0.86-0.93, 1.05-1.09 and 0.33-0.40 ms.
    """
    device = vote_device(group)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the DBO vote ran inside a CUDA graph capture: the ranks' vote is read on the "
            "host, which a graph cannot do. Capture DBO steps with dbo.graphs.GraphedRunner "
            "(it votes outside the graph on every call)")
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = new_comm_stream(device)
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    with torch.cuda.stream(stream):
        on_device = host.to(device, non_blocking=True)
        note_collective("all_reduce", group)
        side = side_group(group if group is not None else dist.group.WORLD)
        with vote_failure(group):
            dist.all_reduce(on_device, op=dist.ReduceOp.MIN, group=side)
        host.copy_(on_device, non_blocking=True)  # after the upload, in stream order
        done = torch.cuda.Event()
        done.record(stream)
    with vote_failure(group):
        done.synchronize()
    return host.tolist()


def vote_split(want_split: bool, group: Optional[dist.ProcessGroup] = None, *,
               device: Union[torch.device, str, None] = None) -> bool:
    """True when every rank of `group` wants to split this step (see `vote_step`)."""
    return vote_step(want_split, 0, group, device=device)[0]


def vote_step(want_split: bool, num_tokens: int, group: Optional[dist.ProcessGroup] = None,
              *, device: Union[torch.device, str, None] = None) -> tuple[bool, int]:
    """(every rank of `group` wants to split, the largest token count of any rank).

    Args:
        want_split: this rank's own decision.
        num_tokens: this rank's tokens this step (lets every rank see the same maximum,
            e.g. to agree on a capacity overflow instead of one rank raising alone).
        group: the process group that must agree (the EP/DP group); None: the default
            group, or no vote at all when torch.distributed is not initialised.
        device: where the 0/1 tensor lives, on the current stream. None: on the CPU for
            gloo groups; for NCCL groups on the device, on a side stream and
            communicator (`_device_vote`).

    With one rank, or without an initialised process group, no collective is issued and
    this rank's values are returned. Otherwise one all-reduce (MIN) of [want, -tokens]
    (int64); its result is read on the host (a sync when it runs on CUDA: the split must be
    known there).
    """
    if not isinstance(want_split, bool):
        raise TypeError(f"want_split must be a bool, got {want_split!r}")
    agreed, neg_max = vote_min([1 if want_split else 0, -num_tokens], group, device=device)
    return bool(agreed), -neg_max


def vote_min(values: Sequence[int], group: Optional[dist.ProcessGroup] = None, *,
             device: Union[torch.device, str, None] = None) -> list[int]:
    """The minimum over the ranks of `group` of each of `values` (ints), read on the host.

    The vote's one collective, for callers that agree on more than the split (e.g.
    `dbo.graphs.GraphedRunner`: whether every rank has a graph for this step). With one
    rank, or without an initialised process group, no collective is issued. `device`:
    as in `vote_step`.
    """
    values = [int(v) for v in values]
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError(f"the DBO vote got group={group!r} but torch.distributed is "
                               f"not initialised: call dist.init_process_group first")
        return values
    if dist.get_world_size(group) == 1:
        return values
    if device is None and vote_device(group).type == "cuda":
        return _device_vote(values, group)
    tensor = torch.tensor(values, dtype=torch.int64,
                          device=device if device is not None else vote_device(group))
    note_collective("all_reduce", group)
    with vote_failure(group):  # one line naming the vote, the group and the likely cause
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in tensor.tolist()]


def apply_vote(plan: SplitPlan, group: Optional[dist.ProcessGroup] = None, *,
               device: Union[torch.device, str, None] = None) -> SplitPlan:
    """Vote on `plan.split` across `group`; return `plan` or its unsplit, vetoed form,
    with `group_max_tokens` set."""
    agreed, max_tokens = vote_step(plan.split, plan.total_tokens, group, device=device)
    return plan_after_vote(plan, agreed, max_tokens)


def plan_after_vote(plan: SplitPlan, agreed: bool, max_tokens: int,
                    all_decode: Optional[bool] = None) -> SplitPlan:
    """`plan` as the vote left it: `group_max_tokens` (and `group_decode`, where the vote
    carried it) set, and unsplit (vetoed, with the reason) where this rank wanted to split
    but a peer did not."""
    plan = dataclasses.replace(plan, group_max_tokens=max_tokens, group_decode=all_decode)
    if agreed or not plan.split:
        return plan
    return dataclasses.replace(
        plan, split=False, vetoed=True, ubatches=(), num_tokens=(plan.total_tokens,),
        reason=f"peer rank vetoed the split (this rank would have split: {plan.reason})")


class Ballot(NamedTuple):
    """One rank's side of a step's vote (`cast_ballot`). A named tuple, not a frozen
    dataclass: built on every step, where a frozen dataclass's init costs microseconds."""

    inputs_ok: bool
    """False: this rank rejected its inputs to the step (every rank then stops)."""
    want_split: bool = False
    """This rank's own split decision."""
    num_tokens: int = 0
    """This rank's tokens this step (every rank learns the largest, e.g. for capacity)."""
    fingerprint: int = 0
    """Hash of the configuration that must agree across ranks, in [0, 2**62)."""
    have_graphs: tuple[bool, bool] = (True, True)
    """Whether this rank holds a CUDA graph for the (split, unsplit) step; eager: both."""
    max_ubatch_tokens: int = 0
    """This rank's largest ubatch when it wants to split (what one model call carries)."""
    decode: bool = False
    """This rank's step is decode-shaped (`SplitPlan.is_decode`)."""


class Tally(NamedTuple):
    """What the group decided; the same on every rank (a named tuple, as `Ballot`)."""

    rejected_by: Optional[int]
    """The lowest rank of the group that rejected its inputs; None when none did."""
    configs_agree: bool
    """Every rank sent the same fingerprint."""
    split: bool
    """Every rank wants to split."""
    max_tokens: int
    """The largest token count of any rank."""
    have_graphs: tuple[bool, bool]
    """Every rank holds a graph for the (split, unsplit) step."""
    all_decode: bool = False
    """Every rank's step is decode-shaped: the group's step is a decode step, for choices
    that every rank must make alike (the predicted overlap, `dbo.predicted_overlap`)."""
    max_ubatch_tokens: int = 0
    """The largest ubatch of any rank: the most tokens one model call carries when the
    step is split (every rank wanted to)."""

    @property
    def stops(self) -> bool:
        """Every rank must stop before running the step (`dbo.agreement.stop_step`)."""
        return self.rejected_by is not None or not self.configs_agree


def cast_ballot(ballot: Ballot, group: Optional[dist.ProcessGroup] = None, *,
                device: Union[torch.device, str, None] = None) -> Tally:
    """Vote `ballot` across `group` in one all-reduce (MIN) of 9 int64s (`vote_min`):
    [ok or this rank, want, -tokens, fingerprint, -fingerprint, have split, have unsplit,
    -largest ubatch, decode].
    The fingerprints agree when their minimum equals their maximum."""
    if not 0 <= ballot.fingerprint < 1 << 62:
        raise ValueError(f"Ballot.fingerprint={ballot.fingerprint!r}: an int in [0, 2**62)")
    ok = INPUTS_OK if ballot.inputs_ok else group_rank(group)
    fp = ballot.fingerprint
    have_split, have_unsplit = ballot.have_graphs
    values = [ok, int(ballot.want_split), -ballot.num_tokens, fp, -fp, int(have_split),
              int(have_unsplit), -ballot.max_ubatch_tokens, int(ballot.decode)]
    (ok, agreed, neg_max, low_fp, neg_high_fp, have_split, have_unsplit, neg_ubatch,
     all_decode) = vote_min(values, group, device=device)
    return Tally(rejected_by=None if ok == INPUTS_OK else ok,
                 configs_agree=low_fp == -neg_high_fp, split=bool(agreed),
                 max_tokens=-neg_max, have_graphs=(bool(have_split), bool(have_unsplit)),
                 max_ubatch_tokens=-neg_ubatch, all_decode=bool(all_decode))


def group_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """This process's rank in `group` (0 without an initialised process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)
