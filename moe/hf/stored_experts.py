"""Experts modules that hold the experts interface's tensors in another layout, on the
experts path of `moe.hf.convert` (`moe.hf.generic`): per experts class (name), which of
the module's tensors make the interface's ``gate_up_proj`` [E, 2I, H] and ``down_proj``
[E, H, I], and which callable is its activation.

Shape legend: E routed experts, n = stop - first of them, H hidden, I one expert's width,
M probe rows.

Such a module is called as the interface's (``experts(hidden_states, top_k_index,
top_k_weights)``: its block routes), so it converts as any other; only its tensors are
read through its `StoredExperts` entry (`STORED`):

- planning (`interface_stand_ins`): [E, 2I, H] / [E, H, I] stand-ins of the stored
  tensors' dtype and device for the checks, no copy made;
- the conversion and `moe.hf.load` (`moe.hf.rows`): this rank's rows of each stored
  tensor, experts [first, stop) = rows [first * I, stop * I), joined into dbo's
  w13 [n, 2I, H] / w2 [n, H, I] (`to_interface`); `moe.hf.load` reads only those rows;
- `save_pretrained` (`moe.hf.save`): the gathered w13 [E, 2I, H] / w2 [E, H, I] back in
  the stored layout (`gate_up_to_stored`, `down_to_stored`): the unconverted model's
  checkpoint, tensor for tensor;
- the form: the module's activation run on a probe as ``act(gate) * up``
  (`moe.hf.experts_form.identify_form`); a named activation only (an activation callable
  none of dbo's names computes is refused in one line).

DBRX (transformers 5.x): its ``DbrxExperts`` keeps the experts in ``mlp``
(``DbrxExpertGLU``), stacked along the rows of each tensor:

=====================  =============================================================
``mlp.w1`` [E * I, H]  gate rows: ``gate_up_proj[e, :I] = w1.view(E, I, H)[e]``
``mlp.v1`` [E * I, H]  up rows: ``gate_up_proj[e, I:] = v1.view(E, I, H)[e]``
``mlp.w2`` [E * I, H]  ``down_proj[e] = w2.view(E, I, H)[e].T``
``mlp.activation_fn``  act of act(x w1_e^T) * (x v1_e^T): ``ACT2FN[ffn_act_fn["name"]]``
``num_experts``        E
=====================  =============================================================
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from torch import Tensor, nn

from moe.experts.form import ExpertForm
from moe.hf.experts_form import identify_form

__all__ = ["STORED", "StoredExperts", "stored_layout"]

#: The interface options a stored layout serves (gated, gate rows then up rows, not
#: transposed, no bias, no post-expert norm), as `moe.hf.generic.KNOWN_OPTIONS` names them.
_OPTIONS = {"is_concatenated": True, "is_transposed": False, "has_bias": False,
            "has_gate": True, "has_post_expert_norm": False}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoredExperts:
    """Where an experts module of one class keeps its experts: three 2-D tensors [E * I, H],
    expert e's rows [e I, (e+1) I) of each (dotted names in the module)."""

    gate: str
    """Expert e's gate projection [I, H] (out x in) at rows [e I, (e+1) I)."""
    up: str
    """Expert e's up projection [I, H] (out x in)."""
    down: str
    """Expert e's down projection transposed, [I, H] (in x out): ``down_proj[e]`` is its .T."""
    activation: str
    """The module's activation (a child module): act of ``act(gate) * up``."""
    num_experts: str = "num_experts"
    """The module's attribute holding E (I = rows // E)."""

    @property
    def names(self) -> tuple[str, str, str]:
        """The stored tensors, in the order `to_interface` takes their rows."""
        return (self.gate, self.up, self.down)

    def describe(self) -> str:
        """e.g. "mlp.w1, mlp.v1, mlp.w2 [E * I, H]"."""
        return f"{', '.join(self.names)} [E * I, H]"

    def interface_stand_ins(self, module: nn.Module, *,
                            refuse: Callable[[str], ValueError]) -> tuple[Tensor, Tensor]:
        """([E, 2I, H], [E, H, I]): tensors of the stored tensors' dtype and device (meta
        where they are) shaped as the interface's `gate_up_proj` / `down_proj`, holding no
        copy (one element, expanded): for the sizes, dtype and device checks only, never
        read. ValueError naming what the module lacks or shapes otherwise."""
        tensors = []
        for name in self.names:
            try:
                tensors.append(module.get_parameter(name))
            except AttributeError:
                raise refuse(f"no tensor experts.{name}, which {type(module).__name__} "
                             f"stores its experts in ({self.describe()})") from None
        experts = getattr(module, self.num_experts, None)
        shapes = {tuple(t.shape) for t in tensors}
        rows, hidden = next(iter(shapes)) if len(shapes) == 1 and tensors[0].dim() == 2 \
            else (0, 0)
        if not (isinstance(experts, int) and experts > 0 and rows > 0 and rows % experts == 0):
            raise refuse(f"experts.{', experts.'.join(self.names)} have shapes "
                         f"{[list(t.shape) for t in tensors]} for {self.num_experts}="
                         f"{experts!r}: expected three [E * I, H] tensors of E experts")
        if len({t.dtype for t in tensors}) != 1:
            raise refuse(f"experts.{', experts.'.join(self.names)} differ in dtype "
                         f"({[str(t.dtype) for t in tensors]}): load the model in one dtype")
        width = rows // experts
        one = tensors[0].new_empty(())
        return one.expand(experts, 2 * width, hidden), one.expand(experts, hidden, width)

    def check_options(self, options: dict[str, bool], *,
                      refuse: Callable[[str], ValueError]) -> None:
        """ValueError for interface options other than the layout's (`_OPTIONS`)."""
        other = {k: v for k, v in options.items() if _OPTIONS.get(k, v) != v}
        if other:
            raise refuse(f"experts-interface options {other} on experts stored as "
                         f"{self.describe()}, which hold gated, unbiased experts only")

    def form(self, module: nn.Module, options: dict[str, bool], *, up_EJH: Tensor,
             refuse: Callable[[str], ValueError]) -> ExpertForm:
        """What each expert of `module` computes: its activation run on a probe as
        act(gate) * up (`identify_form`; `up_EJH` from `interface_stand_ins`). ValueError
        for an activation none of dbo's names computes."""
        try:
            act = module.get_submodule(self.activation)
        except AttributeError:
            raise refuse(f"no activation module experts.{self.activation}") from None
        width = up_EJH.shape[1] // 2

        def gate(h_MJ: Tensor) -> Tensor:  # [M, 2I] (gate columns, then up) -> [M, I]
            return act(h_MJ[..., :width]) * h_MJ[..., width:]

        form, custom = identify_form(module, options, refuse=refuse, up=up_EJH, gate_fn=gate)
        if custom is not None:
            raise refuse(f"its activation experts.{self.activation} is none of dbo's named "
                         f"activations, which experts stored as {self.describe()} need")
        return form

    def to_interface(self, rows: dict[str, Tensor], *, width: int) -> tuple[Tensor, Tensor]:
        """`rows`: `names` -> [n * I, H], experts [first, stop) of each stored tensor ->
        (w13 [n, 2I, H] gate rows then up rows, w2 [n, H, I]), new tensors."""
        gate, up, down = (rows[name] for name in self.names)
        hidden = gate.shape[-1]
        gate_nIH, up_nIH = gate.reshape(-1, width, hidden), up.reshape(-1, width, hidden)
        w13 = gate_nIH.new_empty((gate_nIH.shape[0], 2 * width, hidden))
        w13[:, :width], w13[:, width:] = gate_nIH, up_nIH
        return w13, down.reshape(-1, width, hidden).transpose(1, 2).contiguous()

    def gate_up_to_stored(self, w13_EJH: Tensor) -> tuple[Tensor, Tensor]:
        """w13 [E, 2I, H] -> (gate, up) as stored, each [E * I, H]."""
        width, hidden = w13_EJH.shape[1] // 2, w13_EJH.shape[2]
        return (w13_EJH[:, :width].reshape(-1, hidden).contiguous(),
                w13_EJH[:, width:].reshape(-1, hidden).contiguous())

    def down_to_stored(self, w2_EHI: Tensor) -> Tensor:
        """w2 [E, H, I] -> down as stored, [E * I, H]."""
        return w2_EHI.transpose(1, 2).reshape(-1, w2_EHI.shape[1]).contiguous()


#: Per experts class (name): its stored layout (the module doc's table).
STORED: dict[str, StoredExperts] = {
    "DbrxExperts": StoredExperts(gate="mlp.w1", up="mlp.v1", down="mlp.w2",
                                 activation="mlp.activation_fn"),
}


def stored_layout(module: object) -> Optional[StoredExperts]:
    """The stored layout of experts `module`'s class (`STORED`), or None: the interface's."""
    return STORED.get(type(module).__name__) if isinstance(module, nn.Module) else None
