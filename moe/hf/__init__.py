"""moe.hf: Hugging Face transformers MoE models under dbo.

    model = moe.hf.convert(model, group=ep_group)          # a loaded transformers model
    model = moe.hf.load(path, group=ep_group)              # a checkpoint dir, experts sharded
    tokens = moe.hf.generate(DBORunner(model, group=ep_group), ids, attention_mask=mask,
                             max_new_tokens=16)            # greedy, one KV cache per ubatch

Every MoE block becomes an `HFMoEBlock` running a dbo `MoELayer` (dbo routing with the
model's settings, dispatch/combine over the EP group, this rank's experts, shared experts
overlapped with the combine). The architectures dbo knows are in `moe.hf.arch`.
transformers and safetensors are imported on first use (`pip install -e ".[hf]"`).
"""
from moe.hf.arch import ARCHITECTURES, ArchSpec
from moe.hf.block import HFMoEBlock, expert_bytes
from moe.hf.convert import convert
from moe.hf.generate import generate
from moe.hf.load import load

__all__ = ["ARCHITECTURES", "ArchSpec", "HFMoEBlock", "convert", "expert_bytes", "generate",
           "load"]
