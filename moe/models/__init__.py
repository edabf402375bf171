"""Models layer: the reference transformer (`moe.models.transformer`) and its presets
(`moe.models.presets`), built on the `moe` runtime; the runtime never imports them.
The Hugging Face adapters (`moe.hf`) are in this layer too."""
from moe.models.kv_cache import KVCache, with_cache_split
from moe.models.presets import PRESETS, get_preset
from moe.models.transformer import MoETransformer, make_batch

__all__ = ["KVCache", "MoETransformer", "PRESETS", "get_preset", "make_batch",
           "with_cache_split"]
