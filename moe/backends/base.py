"""Prepare/finalize backends: how tokens reach their experts' ranks and come back.

Shape legend: T tokens on this rank, H hidden, K top-k, R rows received for this
rank's experts, E_loc local experts, W ranks in the expert-parallel group.

A backend has two asynchronous halves. Both are called on the compute stream and
return a `Pending(hook, receiver)`:

    prepare_async(x_TH, topk_weights_TK, topk_ids_TK)  ->  Pending -> Dispatched
    finalize_async(expert_out_RH, dispatched)          ->  Pending -> out_TH

`hook` (or None) launches a receive half that must wait until the other ubatch has
queued its compute (it is handed over with `dbo_register_recv_hook`); `receiver()` waits
for the data and returns the result on the compute stream. The caller (the modular
kernel) yields between the two halves. Per-call state lives in the frozen `Dispatched`
handle that the calling ubatch owns, never in backend attributes, so the two ubatches
cannot overwrite each other's state. The synchronous `prepare` / `finalize` are the
async path followed by its wait.

A split combine (`own_rows`, `OwnRows`): the rows a rank sent itself come back by a local
copy, not over the network. A backend that can say which rows those are lets the caller
send the other ranks' outputs first and compute its own rows while that combine is in
flight, handing their outputs over before it receives.

A combine by expert group (`combine_groups` > 1, `finalize_grouped_async`, single-batch
overlap only): the backend runs one group of its experts at a time over every received
row and queues that group's partial combine before the next group's experts, so each
expert's weights are read once while the combine overlaps the GEMMs.

A chunked combine (`chunks_combine`, `finalize_chunked_async`, single-batch overlap only):
the backend runs the experts itself, through a callable, on one chunk of rows at a time
and queues each chunk's combine before the next chunk's experts, so the transfer of one
overlaps the GEMMs of the next.

This is also the one module of helpers the backends share (`check_capacity`); the row
layout they and their kernels share is `moe.row_layout`.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generic, Mapping, NamedTuple, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from moe.backend_options import BackendOptions, NoOptions
from moe.config import MoEConfig
from moe.row_layout import RowLayout
from moe.workspace import Workspace

R = TypeVar("R")

#: The experts over some rows of a `Dispatched`: (x_NH, topk_ids_NK, topk_weights_NK) ->
#: out_NH, the weighted outputs in x's dtype, on the compute stream.
RunExperts = Callable[[Tensor, Tensor, Tensor], Tensor]


class Pending(NamedTuple, Generic[R]):
    """An operation in flight: run `hook` (if any) once, then `receiver()` for the result."""

    hook: Optional[Callable[[], None]]
    receiver: Callable[[], R]

    def wait(self) -> R:
        if self.hook is not None:
            self.hook()
        return self.receiver()


@dataclass(frozen=True)
class Dispatched:
    """Tokens as the experts of this rank see them, plus what combine needs to return them.

    x_RH: [R, H] rows for this rank's experts (x's dtype); topk_ids_RK: int64 local
    expert ids, -1 where the expert lives elsewhere (or the row is padding);
    topk_weights_RK: float32. `handle` is the backend's own frozen record of the call.
    All valid on the compute stream once the receiver has returned.
    """

    x_RH: Tensor
    topk_ids_RK: Tensor
    topk_weights_RK: Tensor
    handle: Any


@dataclass
class OwnRows:
    """The expert outputs of the rows this rank sent itself, delivered after the combine's
    send. `rows`: those rows of `Dispatched.x_RH` (from `PrepareFinalize.own_rows`);
    `out_NH`: their outputs, set by the caller on the compute stream before the
    combine's receiver runs (the receiver raises if it is still None)."""

    rows: slice
    out_NH: Optional[Tensor] = None

    def take(self) -> Tensor:
        if self.out_NH is None:
            raise RuntimeError("split combine: the own rows' expert outputs were not handed "
                               "over (OwnRows.out_NH) before the combine's receiver ran")
        return self.out_NH


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts this rank holds: the E_loc consecutive ones from `first_expert`."""

    rank: int
    world_size: int
    num_experts: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def first_expert(self) -> int:
        return self.rank * self.num_local_experts

    def expert_map(self, device: torch.device | str = "cpu") -> Tensor:
        """[E] int64: global expert id -> local id on this rank, -1 elsewhere."""
        emap = torch.full((self.num_experts,), -1, dtype=torch.int64, device=device)
        first, n = self.first_expert, self.num_local_experts
        emap[first:first + n] = torch.arange(n, dtype=torch.int64, device=device)
        return emap


class PrepareFinalize(ABC):
    """Base of the dispatch/combine backends (one subclass per file, registered by name)."""

    name: ClassVar[str]
    #: Whether a step through this backend can be captured in a CUDA graph: nothing it
    #: does reads a device value on the host (`dbo.graphs`). Backends where that depends
    #: on the config override it with a property.
    graph_safe: bool = False
    #: The monolithic form: the router logits travel with the tokens and the backend
    #: routes the rows it receives (`prepare_logits_async`), so the layer does not route
    #: before the dispatch and `prepare_async` is not used.
    routes_gathered_logits: ClassVar[bool] = False
    #: Whether every byte this backend exchanges goes through the torch.distributed
    #: collectives `dbo bench`'s ceiling probe records and replays (`all_to_all_single`,
    #: `all_gather_into_tensor`, `reduce_scatter_tensor`, `all_reduce`;
    #: `dbo.cli.bench.ceiling.RECORDED_COLLECTIVES`). False for an exchange of the
    #: backend's own kernels (DeepEP, NVSHMEM): the probe sees none of its traffic, so
    #: the bench reports no ceiling or phase times for it. False unless declared.
    comm_recordable: ClassVar[bool] = False
    #: Whether the backend needs `MoEConfig.max_tokens_per_rank` (its buffers or padded
    #: slots are sized by it) and refuses a config without one. False unless declared.
    needs_capacity: ClassVar[bool] = False
    #: Whether, in its default form (`MoEConfig` defaults) and without
    #: `max_tokens_per_rank`, the exchange reads token counts (or their maximum) on the
    #: host, so that a CUDA graph cannot capture it. The trait tables
    #: (`moe.backends.traits`) read the declared class values, never a built backend.
    reads_counts_on_host: ClassVar[bool] = False
    #: Whether a step can be captured in a CUDA graph once `max_tokens_per_rank` is set,
    #: in its default form (as `dbo run` and `dbo soak` configure it).
    graph_safe_with_capacity: ClassVar[bool] = False
    #: Whether its work grows with the capacity, not with the routed rows (padded slots of
    #: the whole capacity travel or reach the experts).
    pads_to_capacity: ClassVar[bool] = False
    #: Whether it needs more than torch and its collectives (NVSHMEM, DeepEP, ...): never
    #: what "auto" picks, and a `dbo bench` sweep runs it only when named.
    opt_in: ClassVar[bool] = False
    #: Whether it runs on an EP group of one rank only (it exchanges nothing).
    single_rank: ClassVar[bool] = False
    #: Whether its options take a capacity per DBO ubatch (`max_tokens_per_ubatch`): DBO's
    #: ubatches get a capacity of their own, so each sends its own slots, not the whole
    #: capacity again.
    takes_ubatch_capacity: ClassVar[bool] = False
    #: Its options dataclass (`MoEConfig.backend_options`; a frozen keyword-only
    #: `BackendOptions` defined in the backend's file); `NoOptions` where it has none.
    options_type: ClassVar[type[BackendOptions]] = NoOptions
    #: Its requirements on the rows it moves, known without importing any library (the
    #: `dbo` commands refuse other options up front): the element types its kernels
    #: move (None: any of `moe.config.SUPPORTED_DTYPES`), the hidden sizes they are
    #: compiled for (None: any), and how a refusal names the library and those kernels.
    row_dtypes: ClassVar[Optional[tuple[torch.dtype, ...]]] = None
    hidden_sizes: ClassVar[Optional[tuple[int, ...]]] = None
    library: ClassVar[str] = "torch"
    kernels: ClassVar[str] = "torch's collectives"
    #: What `agreement_fields` puts before each option's name ("deepep_" makes DeepEP's
    #: `worst_case_dispatch` the field "deepep_worst_case_dispatch").
    agreement_prefix: ClassVar[str] = ""

    @classmethod
    def agreement_fields(cls, config: MoEConfig) -> dict[str, object]:
        """What this backend adds to the fields every rank of the EP group must share
        (`MoEConfig.agreement_fields` has the rest; `make_backend` and
        `MoELayer.dbo_agreement` ask for both): each field of `config.options`, named
        `agreement_prefix` + the field, since every option of a backend changes its
        collectives or its math."""
        options = config.options
        return {cls.agreement_prefix + f.name: getattr(options, f.name)
                for f in dataclasses.fields(options)}

    @classmethod
    def check_runs(cls, world_size: int, config: Optional[MoEConfig] = None) -> None:
        """Raise, in one line with the fix, where this backend cannot run on an EP group
        of `world_size` ranks in this process: ImportError for a library it needs and
        cannot import, ValueError for no CUDA device or a group size it does not take;
        with `config`, also for shapes or a dtype its kernels do not take. What is known
        before any layer is built (the `dbo` commands call it before starting ranks);
        the constructor refuses the same. Nothing by default."""

    @classmethod
    def check_shape(cls, hidden_size: int, dtype: torch.dtype, world_size: int) -> None:
        """Raise ValueError, in one line with the fix, where this backend's kernels cannot
        move rows of `hidden_size` `dtype` values over `world_size` ranks (`check_runs`
        with a config asks it too). Nothing by default."""

    @classmethod
    def check_max_tokens(cls, max_tokens: int, world_size: int, *, option: str,
                         backend_option: str, env: Mapping[str, str]) -> None:
        """Raise ValueError where `max_tokens` tokens per rank (the command's `option`,
        e.g. "--tokens", with this backend named as `backend_option`) cannot run on
        `world_size` ranks in the environment `env` (a library's limit read from its
        variables, e.g. NVSHMEM's queue depth), naming the largest that can. The `dbo`
        commands call it before starting ranks, passing their environment (only the CLI
        reads it). Nothing by default."""

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> None:
        self.config = config
        #: `config.backend_options`, or this backend's defaults.
        self.options = config.options
        self.group = group
        if group is None:
            self.placement = ExpertPlacement(0, 1, config.num_experts)
        else:
            self.placement = ExpertPlacement(dist.get_rank(group), dist.get_world_size(group),
                                             config.num_experts)
        self._expert_maps: dict[torch.device, Tensor] = {}

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    def local_ids(self, topk_ids_NK: Tensor) -> Tensor:
        """Global ids -> local ids of this rank (-1 elsewhere); -1 stays -1. Ids must be in
        [-1, E) (not checked: that would sync)."""
        emap_E1 = self._expert_maps.get(topk_ids_NK.device)
        if emap_E1 is None:
            # [E + 1]: the last entry, -1, is where index -1 lands (tensor indexing counts
            # negative indices from the end), so the map is one gather kernel.
            emap = self.placement.expert_map(topk_ids_NK.device)
            emap_E1 = torch.cat([emap, emap.new_full((1,), -1)])
            self._expert_maps[topk_ids_NK.device] = emap_E1
        return emap_E1[topk_ids_NK]

    def dispatched_from_rows(self, layout: RowLayout, rows_RB: Tensor, handle: Any) -> Dispatched:
        """Unpack received rows (views, no copy) and map their ids to this rank's."""
        ids_RK, weights_RK, x_RH = layout.unpack(rows_RB)
        return Dispatched(x_RH, self.local_ids(ids_RK), weights_RK, handle)

    @abstractmethod
    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        """Start sending each token to the ranks of its experts (global ids in)."""

    @abstractmethod
    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        """Start returning the weighted expert outputs; the receiver gives out_TH, the
        sum over each token's experts, in x's dtype on the compute stream.

        With `own` (only where `own_rows` gave its rows), expert_out_RH's rows
        `own.rows` are not read: their outputs arrive later, in `own.out_NH`."""

    def prepare_logits_async(self, x_TH: Tensor, logits_TE: Tensor, *,
                             correction_bias_E: Optional[Tensor],
                             workspace: Workspace) -> Pending[Dispatched]:
        """The monolithic form's dispatch (only where `routes_gathered_logits`): send the
        tokens with their router logits [T, E]; the receiver routes what arrives."""
        raise TypeError(f"backend {self.name!r} dispatches top-k ids, not router logits: "
                        f"call prepare_async")

    def own_rows(self, dispatched: Dispatched) -> Optional[slice]:
        """The rows of `dispatched.x_RH` that this rank sent itself, when the combine can
        take their outputs after its send (`finalize_async(own=...)`); None (this
        default) where the backend cannot split its combine."""
        return None

    @property
    def chunks_combine(self) -> bool:
        """Whether `finalize_chunked_async` runs here; False (this default) where the
        backend's combine cannot be sent in chunks."""
        return False

    @property
    def combine_chunks(self) -> int:
        """The chunks a single-batch-overlap step sends its combine in (its options'
        `combine_chunks` where `chunks_combine`); 1 (this default): the combine whole."""
        return 1

    @property
    def combine_groups(self) -> int:
        """The expert groups a single-batch-overlap step runs and sends its combine in
        (from its options, where `finalize_grouped_async` runs); 1 (this default): the
        experts whole, then the combine, and `finalize_grouped_async` is never called."""
        return 1

    @property
    def max_tokens_per_ubatch(self) -> Optional[int]:
        """The most tokens one rank may send in one ubatch of a DBO step, where the
        backend takes a capacity of its own per ubatch (`takes_ubatch_capacity`, from its
        options); None (this default): the step's capacity."""
        return None

    def finalize_chunked_async(self, run_experts: RunExperts, dispatched: Dispatched, *,
                               num_chunks: int, workspace: Workspace) -> Pending[Tensor]:
        """Experts and combine interleaved (only where `chunks_combine`): `run_experts` on
        one chunk of `dispatched`'s rows, that chunk's combine queued on the comm stream,
        the next chunk's experts under it, ...; the receiver gives out_TH as
        `finalize_async` does. Every row goes through `run_experts` exactly once."""
        raise TypeError(f"backend {self.name!r} cannot send its combine in chunks "
                        f"(chunks_combine is False): call finalize_async")

    def finalize_grouped_async(self, run_experts: RunExperts, dispatched: Dispatched, *,
                               num_groups: int, workspace: Workspace) -> Pending[Tensor]:
        """Experts and combine interleaved by expert group (only where `combine_groups` > 1):
        `run_experts` on every row of `dispatched` with only group 0's experts (the other
        ids -1), group 0's partial combine queued on the comm stream, group 1's experts
        under it, ...: each expert's weights are read once; the receiver gives out_TH as
        `finalize_async` does, each token's sum over the groups' partial outputs."""
        raise TypeError(f"backend {self.name!r} cannot send its combine by expert group "
                        f"(its combine_groups is 1): call finalize_async")

    def refuse_split(self, own: Optional[OwnRows]) -> None:
        """For backends without a split combine: `own` must be None."""
        if own is not None:
            raise ValueError(f"backend {self.name!r} cannot split its combine (its own_rows "
                             f"is None): call finalize_async without own=")

    def prepare(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                workspace: Workspace) -> Dispatched:
        return self.prepare_async(x_TH, topk_weights_TK, topk_ids_TK,
                                  workspace=workspace).wait()

    def finalize(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                 workspace: Workspace) -> Tensor:
        return self.finalize_async(expert_out_RH, dispatched, workspace=workspace).wait()


def check_process_group(group: Optional[dist.ProcessGroup], backend: str) -> None:
    """Raise ValueError where a backend that exchanges tokens through torch.distributed
    would issue its first collective with no group to issue it on: `group` None and no
    default process group (`init_process_group` never called). Called before the
    backend's first collective of a call, after its own checks of the call."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"backend {backend!r} exchanges tokens between ranks through torch.distributed, "
            f"but no process group is initialized: call torch.distributed."
            f"init_process_group(...) on every rank and build the model with the EP group "
            f"(group=...), or use backend 'local' for one process")


def check_capacity(num_tokens: int, capacity: int, backend: str) -> None:
    """Raise ValueError when this rank has more tokens than a fixed-capacity backend holds."""
    if num_tokens > capacity:
        raise ValueError(
            f"backend {backend!r}: {num_tokens} tokens on this rank exceed "
            f"MoEConfig.max_tokens_per_rank={capacity}: raise the capacity, or split the "
            f"batch (no token is ever dropped)")
