"""moe.hf: Hugging Face transformers MoE models under dbo.

    model = moe.hf.convert(model, group=ep_group)          # a loaded transformers model
    model = moe.hf.load(path, group=ep_group)              # a checkpoint dir, experts sharded
    model.save_pretrained(path)                            # every EP rank: rank 0 writes
    tokens = moe.hf.generate(DBORunner(model, group=ep_group), ids, attention_mask=mask,
                             max_new_tokens=16)            # greedy, one KV cache per ubatch
    mask = moe.hf.batch_attention_mask(model, ids, mask)   # [B, 1, S, S], built once per step

Every MoE block of an architecture in `moe.hf.arch` becomes an `HFMoEBlock` running a dbo
`MoELayer` (dbo routing with the model's settings, dispatch/combine over the EP group,
this rank's experts, shared experts overlapped with the combine). Every other MoE block
whose experts go through transformers' experts interface keeps its own router and has
its experts module replaced by an `HFExperts` (`moe.hf.generic`): dispatch/combine over
the EP group and this rank's experts on the block's routing. `model.dbo_conversion_summary`
says which block took which path; docs/hf_models.md lists the model types checked.
transformers and safetensors are imported on first use (`pip install -e ".[hf]"`).
The tools import the adapters from this package only (`__all__`, tests/test_layers.py).
"""
from moe.hf.arch import ARCHITECTURES, ArchSpec, spec_for
from moe.hf.block import HFMoEBlock, converted_experts, expert_bytes
from moe.hf.convert import convert, ubatch_capacity
from moe.hf.deps import require
from moe.hf.folder import read_config, tensor_files
from moe.hf.generic import HFExperts
from moe.hf.generate import generate
from moe.hf.kv import cache_keyword
from moe.hf.load import load
from moe.hf.mask import batch_attention_mask
from moe.hf.named import REAL_SHAPES, expert_sizes, is_named, named_config, unknown_name
from moe.hf.tiny import TINY_SIZES, tiny_config, tiny_model

__all__ = ["ARCHITECTURES", "ArchSpec", "HFExperts", "HFMoEBlock", "REAL_SHAPES", "TINY_SIZES",
           "batch_attention_mask", "cache_keyword", "convert", "converted_experts",
           "expert_bytes", "expert_sizes", "generate", "is_named", "load", "named_config",
           "read_config", "require", "spec_for", "tensor_files", "tiny_config", "tiny_model",
           "ubatch_capacity", "unknown_name"]
