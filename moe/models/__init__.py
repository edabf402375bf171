"""Models layer: the reference transformer (`moe.models.transformer`) and its presets
(`moe.models.presets`), built on the `moe` runtime; the runtime never imports them.
The Hugging Face adapters (`moe.hf`) are in this layer too. The tools import the models
from this package only (`__all__`, tests/test_layers.py)."""
from moe.models.kv_cache import KVCache, with_cache_split
from moe.models.presets import PRESETS, ModelConfig, estimate_param_bytes, get_preset
from moe.models.transformer import MoETransformer, make_batch

__all__ = ["KVCache", "ModelConfig", "MoETransformer", "PRESETS", "estimate_param_bytes",
           "get_preset", "make_batch", "with_cache_split"]
