"""The soak model and its per-step inputs: seeded by (seed, step, rank)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dbo.cli.soak.config import SoakConfig, ZERO_EVERY
from dbo.cli.soak.padding import capture_sweep_tokens
from moe import MoEConfig, MoELayer, SharedExperts, init_moe_weights


# ------------------------------------------------------------------------------ model
class SoakModel(nn.Module):
    """x [T, H] -> (out_TH [T, H], hidden_TLH [T, L, H], logits_TLE [T, L, E]), all in
    --dtype: per layer `x = gelu(dense(x + moe(x)))`; hidden_TLH[:, l] is layer l's input
    and logits_TLE[:, l] its router's logits (what `dbo.cli.soak.reference` checks each
    layer with). Every output is row-major, so a DBO step concatenates them.

    The MoE layers dispatch/combine over `group` and yield there under DBO; the dense
    Linear + GELU between them calls nothing DBO-specific. `backend` overrides
    --backend (tests run "local" on one process).
    """

    def __init__(self, job: SoakConfig, *, group: Optional[dist.ProcessGroup],
                 experts: str, device: torch.device, backend: Optional[str] = None) -> None:
        super().__init__()
        dtype = job.torch_dtype
        self.moe_config = MoEConfig(num_experts=job.num_experts, top_k=job.top_k,
                                    hidden_size=job.hidden, intermediate_size=job.intermediate,
                                    num_shared_experts=1, dtype=dtype,
                                    max_tokens_per_rank=job.max_tokens,
                                    backend=backend or job.backend, experts=experts)
        self.moe = nn.ModuleList(
            MoELayer(self.moe_config, group=group, layer_id=i,
                     last_layer=i == job.layers - 1, device=device)
            for i in range(job.layers))
        self.dense = nn.ModuleList(
            nn.Linear(job.hidden, job.hidden, device=device, dtype=dtype)
            for _ in range(job.layers))

    @staticmethod
    def expert_seed(seed: int, layer: int) -> int:
        """The seed of layer `layer`'s routed experts and router (`init_moe_weights`)."""
        return seed * 1000 + layer

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded weights drawn on the CPU: the same on every rank (each keeps its experts)."""
        for i, (moe, dense) in enumerate(zip(self.moe, self.dense)):
            moe.load_weights(init_moe_weights(self.moe_config, seed=self.expert_seed(seed, i)))
            shared = SharedExperts.from_config(self.moe_config, seed=seed * 1000 + 500 + i)
            moe.shared_experts.load_state_dict(shared.state_dict())
            gen = torch.Generator().manual_seed(seed * 1000 + 900 + i)
            dense.weight.copy_(torch.randn(dense.weight.shape, generator=gen)
                               / dense.weight.shape[1] ** 0.5)
            dense.bias.copy_(0.1 * torch.randn(dense.bias.shape, generator=gen))

    def forward(self, x_TH: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden, logits = [], []
        for moe, dense in zip(self.moe, self.dense):
            hidden.append(x_TH)
            # The router's own call on the same rows: the logits the layer routes with.
            logits.append(moe.router(x_TH))
            x_TH = F.gelu(dense(x_TH + moe(x_TH)))
        return x_TH, torch.stack(hidden, dim=1), torch.stack(logits, dim=1)

    def dbo_check_inputs(self, x_TH: Tensor) -> None:
        """The runner's check before the vote (`dbo.agreement`): rows of --hidden values.
        A rank whose rows are not votes "not ok", so every rank stops the step there."""
        hidden = self.moe_config.hidden_size
        if x_TH.dim() != 2 or x_TH.shape[1] != hidden:
            raise ValueError(f"SoakModel: x has shape {tuple(x_TH.shape)}, expected "
                             f"[T, hidden={hidden}]")

    def dbo_can_split_inside_request(self) -> bool:
        """True: every row is computed on its own (`dbo.split`), so any cut is exact."""
        return True

    def workspace_bytes(self) -> int:
        """Bytes held by the MoE layers' per-ubatch scratch workspaces (grow-only)."""
        # A MoELayer keeps one ModularKernel per input device, each with its WorkspaceSets.
        return sum(kernel.workspaces.nbytes for moe in self.moe
                   for kernel in moe._kernels.values())


# ------------------------------------------------------------------------------ inputs
def step_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit generator seed from (seed, step, rank) (splitmix64; stable across processes)."""
    mask = (1 << 64) - 1
    h = 0x9E3779B97F4A7C15
    for part in (seed, step, rank):
        h = ((h ^ (part & mask)) * 0xBF58476D1CE4E5B9) & mask
        h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & mask
        h ^= h >> 29
    return h >> 1


def draw_step_input(job: SoakConfig, step: int, rank: int, gen: torch.Generator) -> Tensor:
    """This rank's input x [T, hidden] fp32 (CPU) at `step`; T is forced to 0 on this
    rank's zero steps, --max-tokens at step 0, else uniform in [0, --max-tokens]. Padded
    runs first sweep the capture sizes, largest first, on every rank at once
    (`dbo.cli.soak.padding.capture_sweep_tokens`)."""
    gen.manual_seed(step_seed(job.seed, step, rank))
    every = ZERO_EVERY[rank % len(ZERO_EVERY)]
    sweep = capture_sweep_tokens(step, job.capture_sizes) if job.padded else None
    if sweep is not None:
        num_tokens = sweep
    elif step % every == every - 1:
        num_tokens = 0
    elif step == 0:
        num_tokens = job.max_tokens
    else:
        num_tokens = int(torch.randint(0, job.max_tokens + 1, (1,), generator=gen).item())
    return torch.randn(num_tokens, job.hidden, generator=gen)


def bad_input_rank(job: SoakConfig, step: int, world_size: int) -> Optional[int]:
    """The rank whose input is rejected at `step` (`SoakConfig.bad_every`), or None: every
    --bad-every-th step (never step 0), ranks 0, 1, ... in turn; the same on every rank."""
    every = job.bad_every
    if not every or step % every != every - 1:
        return None
    return (step // every) % world_size


def widen(x_TH: Tensor) -> Tensor:
    """`x_TH` with a column of zeros more: rows the model's input check rejects."""
    return torch.cat([x_TH, x_TH.new_zeros(x_TH.shape[0], 1)], dim=1)
