"""Which transformers MoE model types dbo converts, measured: their discovery, a tiny random
model of each, the recorded result and the supported-models page.

    python -m moe.hf.coverage --markdown     # docs/hf_models.md from docs/hf_models.json
    python -m moe.hf.coverage --list         # the MoE model types of this transformers

Shape legend: E experts, K top-k, H hidden size, I expert width.

`discover()` reads the modeling files of the installed transformers (text only, nothing
imported): a model family (a `transformers.models.<name>` package) is an MoE family when
its modeling file decorates an experts class with `use_experts_implementation`, or
defines a class named like ``*MoE*`` / ``*Moe*`` / ``*Experts*``. Each family is checked
through the model type whose config its package defines (the family's own name, else its
text model's). `tiny_model(model_type)` builds it small: the config class's defaults, its
sizes shrunk by field name (`SIZES`), and a few per-type fixes (`OVERRIDES`) where a
default does not shrink by name. tests/models/test_hf_coverage.py runs the checks and
writes the result here (`Result`, `save`); `markdown` renders it.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from moe.hf.deps import require

__all__ = ["MoEFamily", "OVERRIDES", "Result", "SIZES", "discover", "load", "markdown", "save",
           "tiny_config", "tiny_model"]

#: The committed record and page (relative to the repository root, which holds `moe/`).
JSON_PATH = os.path.join("docs", "hf_models.json")
MARKDOWN_PATH = os.path.join("docs", "hf_models.md")

#: Config fields shrunk by name wherever a config has them (and they are not None).
SIZES: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=64, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    shared_intermediate_size=32, shared_experts_intermediate_size=32,
    dense_intermediate_size=64, vocab_size=128, max_position_embeddings=256,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_k=2, moe_topk=2, top_k_experts=2,
    n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    n_group=2, topk_group=1, first_k_dense_replace=1, initializer_range=0.1,
    unpadded_vocab_size=128, moe_hidden_size=32, sliding_window=32, sliding_window_size=32,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, num_dense_layers=1,
    linear_head_dim=16, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, linear_num_heads=2,
    mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=16, mamba_num_heads=4,
    mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16, index_n_heads=2,
    index_head_dim=16,
    # the names older and encoder-decoder configs give the same sizes
    num_layers=2, n_layers=2, d_model=64, n_heads=4, num_heads=4, d_kv=16, d_ff=64,
    ffn_hidden_size=64, expert_ffn_hidden_size=32, max_seq_len=256, encoder_layers=2,
    decoder_layers=2, num_decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
    encoder_attention_heads=4, decoder_attention_heads=4, zero_expert_num=2,
)
#: Of `SIZES`, the fields set even where the default is None (a config whose expert count
#: or top-k defaults to None builds no MoE block otherwise).
ALWAYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
          "num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts", "moe_intermediate_size")
#: Of `SIZES`, the fields set as given (not shrunk to the smaller of the two): expert
#: counts (a default of 1 expert, or 0 for no MoE block, gives nothing to shard).
GROW = ("initializer_range", "num_experts", "num_local_experts", "n_routed_experts",
        "moe_num_experts")
#: Token-id fields moved inside the shrunk vocabulary.
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")

#: Per model type: fields the generic shrink gets wrong (what a default holds that does not
#: shrink by name), applied last.
OVERRIDES: dict[str, dict[str, Any]] = {
    # no rope_theta default; clip_qkv=None fails transformers' own clamp (checkpoints: 8)
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    "deepseek_ocr2": dict(mlp_layer_types=["dense", "sparse"]),  # None by default
    "dots1": dict(n_shared_experts=1),  # None by default: no shared-expert width
    "ernie4_5_vl_moe": dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0,
                                                 mrope_section=[3, 3, 2])),
    "gemma4": dict(enable_moe_block=True, global_head_dim=16),  # dense by default
    "glm4v_moe": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                           partial_rotary_factor=0.5, mrope_section=[2, 1, 1])),
    # all Mamba by default: no attention layer, whose cache transformers' generate needs
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "hunyuan_v1_moe": dict(head_dim=16),  # None by default, read as a number
    "jamba": dict(attn_layer_period=2, attn_layer_offset=0),  # its first attention: layer 4
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # None by default
    # input-scaled experts, top-1 in every checkpoint (`moe.hf.input_scaled`)
    "llama4": dict(num_experts_per_tok=1),
    "nllb-moe": dict(encoder_sparse_step=1, decoder_sparse_step=1),  # every 4th layer
    "switch_transformers": dict(num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
    "vitpose_backbone": dict(part_features=16, out_indices=[2]),  # of 768 hidden, 12 layers
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,  # None
                      indexer_budget=16, indexer_compress_ratio=4),  # by default
    "step3p7": dict(sliding_window=32),  # None by default, its sliding layers need one
}

#: Statuses of a result, best first.
STATUSES = ("ok", "refused", "not built", "failed")


@dataclass(frozen=True)
class MoEFamily:
    """One MoE model family of the installed transformers."""

    family: str
    """The `transformers.models.<family>` package."""
    model_type: Optional[str]
    """The config model type checked (None: the package defines none)."""
    interface: bool
    """Its experts go through transformers' experts interface."""


@dataclass(frozen=True, kw_only=True)
class Result:
    """The check of one family."""

    family: str
    model_type: Optional[str]
    status: str
    """One of `STATUSES`: "ok" (every check passed), "refused" (`moe.hf.convert` refuses,
    naming what is missing), "not built" (no tiny model of it here), "failed" (converted,
    but a check differs: a dbo bug)."""
    reason: str = ""
    """Why not "ok"; for "ok", what was not checked, if anything."""
    conversion: str = ""
    """`model.dbo_conversion_summary` of the converted model."""
    load: Optional[str] = None
    """`moe.hf.load` of the checkpoint the converted model's `save_pretrained` wrote: "ok"
    (its outputs are the unconverted model's), else its one-line refusal; None where not
    checked (a family that is not "ok")."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Result.status={self.status!r}: use one of {STATUSES}")


# ---------------------------------------------------------------------- discovery
_INTERFACE = re.compile(r"^@use_experts_implementation\b", re.M)
_MOE_CLASS = re.compile(r"^class \w*(?:MoE|Moe|Experts)\w*\(", re.M)


def discover() -> list[MoEFamily]:
    """The MoE families of the installed transformers (module doc), sorted by name."""
    transformers = require("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    families = []
    for family in sorted(os.listdir(root)):
        folder = os.path.join(root, family)
        if not os.path.isdir(folder):
            continue
        sources = [_read(os.path.join(folder, f)) for f in sorted(os.listdir(folder))
                   if f.startswith("modeling_") and f.endswith(".py")]
        interface = any(_INTERFACE.search(src) for src in sources)
        if not interface and not any(_MOE_CLASS.search(src) for src in sources):
            continue
        families.append(MoEFamily(family=family, model_type=_family_type(family, folder,
                                                                        CONFIG_MAPPING_NAMES),
                                  interface=interface))
    return families


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _family_type(family: str, folder: str, names: dict[str, str]) -> Optional[str]:
    """The family's own model type, else the one of its text model, else any it defines."""
    classes = set()
    for file in os.listdir(folder):
        if file.startswith("configuration_") and file.endswith(".py"):
            classes |= set(re.findall(r"^class (\w+)\(", _read(os.path.join(folder, file)), re.M))
    own = [t for t, cls in names.items() if cls in classes]
    if family in own:
        return family
    text = [t for t in own if t.endswith("_text")]
    return (text or sorted(own) or [None])[0]


# ---------------------------------------------------------------------- tiny models
def tiny_config(model_type: str) -> Any:
    """The text config of `model_type`, shrunk (module doc); raises what transformers raises
    for a config it cannot build."""
    require("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    top = CONFIG_MAPPING[model_type]()
    text = top.get_text_config()
    cls = type(text)
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    # The instance's own values (its post-init ones), read past the per-layer attribute
    # guard of heterogeneous configs (gemma4): the shrunk value replaces them all.
    values = vars(text)
    kwargs: dict[str, Any] = {}
    # A config may keep a field under another name (`attribute_map`, e.g. n_group stored
    # as num_expert_group): the keyword is the field, the default is read where it is kept.
    aliases = getattr(cls, "attribute_map", {}) or {}
    for alias, value in SIZES.items():
        stored = aliases.get(alias, alias)
        name = alias if names is None or alias in names else stored
        if names is not None and name not in names:
            continue
        default = values.get(stored, values.get(alias))
        if isinstance(default, (list, dict)):
            continue
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            # Shrink only: a size that is 0 (no rope part, no dense layer) stays so.
            kwargs[name] = value if alias in GROW else min(default, value)
        elif default is None and alias in ALWAYS:
            kwargs[name] = value
    if "kv_lora_rank" in kwargs:  # MLA: head_dim is the rope part, a key per query head
        if "head_dim" in kwargs and "qk_rope_head_dim" in kwargs:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    vocab = kwargs.get("vocab_size", values.get("vocab_size"))
    for offset, name in enumerate(TOKEN_IDS):
        if isinstance(vocab, int) and _out_of_vocab(values.get(name), vocab):
            kwargs[name] = offset
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        rotary = int(kwargs.get("head_dim", SIZES["head_dim"])
                     * rope.get("partial_rotary_factor", 1.0))
        kwargs["rope_parameters"] = {**rope, "mrope_section": _shrunk_sections(
            rope["mrope_section"], rotary // 2)}
    n = kwargs.get("num_hidden_layers", values.get("num_hidden_layers"))
    only = values.get("mlp_only_layers")
    if isinstance(only, list) and isinstance(n, int):
        kwargs["mlp_only_layers"] = [i for i in only if i < n - 1]  # the last layer sparse
    overrides = OVERRIDES.get(model_type, {})
    kwargs.update(overrides)
    config = cls(**kwargs)
    # A per-layer schedule derived for 2 layers may lack a sparse MLP or a softmax attention
    # layer the full model has (all of them after layer 2): the last layer takes one (an
    # MoE block to convert; a KV cache for generate).
    changed = False
    for name, tiny in vars(config).items():
        full = values.get(name)
        if not (name.endswith("layer_types") and name not in overrides
                and isinstance(tiny, list) and isinstance(full, list) and tiny):
            continue
        for wanted in (_SPARSE, _SOFTMAX_ATTENTION):
            kinds = [k for k in dict.fromkeys(full) if isinstance(k, str) and wanted(k)]
            if kinds and not any(isinstance(k, str) and wanted(k) for k in tiny):
                kwargs[name] = [*tiny[:-1], kinds[0]]
                changed = True
    if changed:
        config = cls(**kwargs)
    return config


def _SPARSE(kind: str) -> bool:
    return kind in ("sparse", "moe")


def _SOFTMAX_ATTENTION(kind: str) -> bool:
    return "attention" in kind and "linear" not in kind


def _out_of_vocab(value: Any, vocab: int) -> bool:
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, int) and v >= vocab for v in values)


def _shrunk_sections(sections: list[int], total: int) -> list[int]:
    """Multimodal rotary sections scaled to sum to `total` (the rotary half of head_dim)."""
    scaled = [max(1, s * total // sum(sections)) for s in sections]
    scaled[0] += total - sum(scaled)
    return scaled


def tiny_model(model_type: str, *, seed: int = 0, max_params: int = 2_000_000) -> nn.Module:
    """A float32 model of `tiny_config(model_type)` in eval mode on the CPU, the same weights
    for the same seed in every process: the causal LM where transformers has one for the
    text config, else the text config's base model. ValueError (before building it) for a
    model of more than `max_params` parameters (a default that did not shrink)."""
    config = tiny_config(model_type)
    cls = model_class(config)
    with torch.device("meta"):
        skeleton = cls._from_config(config)
    count = sum(p.numel() for p in skeleton.parameters())
    if count > max_params:
        raise ValueError(f"the tiny {config.model_type} model still has {count:,} parameters "
                         f"(its defaults did not shrink: add an OVERRIDES entry)")
    torch.manual_seed(seed)
    model = cls._from_config(config)
    with torch.no_grad():
        for module in model.modules():  # drawn, so that it changes the routing
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor) and bias.is_floating_point():
                bias.normal_(0.0, 0.1)
    return model.eval()


def model_class(config: Any) -> type:
    """The causal LM class of `config` (or, without one, its base model class)."""
    require("transformers")
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_MAPPING)
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING):
        try:
            return mapping[type(config)]
        except KeyError:
            continue
    module = importlib.import_module(
        type(config).__module__.replace(".configuration_", ".modeling_"))
    found = [obj for obj in vars(module).values()
             if isinstance(obj, type) and issubclass(obj, nn.Module)
             and getattr(obj, "config_class", None) is type(config)
             and not obj.__name__.endswith("PreTrainedModel")]
    for suffix in ("ForCausalLM", "Model", "Backbone"):
        for cls in found:
            if cls.__name__.endswith(suffix):
                return cls
    raise ValueError(f"transformers has no model class for a {type(config).__name__}")


# ---------------------------------------------------------------------- the record
def save(results: list[Result], path: str = JSON_PATH) -> bool:
    """Write `results` as JSON (sorted, no timings: the same results give the same
    bytes); return whether the file changed."""
    text = json.dumps({"transformers": require("transformers").__version__,
                       "results": [dataclasses.asdict(r) for r in
                                   sorted(results, key=lambda r: r.family)]},
                      indent=1) + "\n"
    if os.path.exists(path) and _read(path) == text:
        return False
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return True


def load(path: str = JSON_PATH) -> tuple[str, list[Result]]:
    """(transformers version, results) of a record written by `save`."""
    data = json.loads(_read(path))
    return data["transformers"], [Result(**r) for r in data["results"]]


def markdown(version: str, results: list[Result]) -> str:
    """The supported-models page of a record."""
    ok = [r for r in results if r.status == "ok"]
    loads = [r for r in ok if r.load == "ok"]
    lines = [
        "# Hugging Face MoE models under dbo",
        "",
        "Generated by `python -m moe.hf.coverage --markdown` from `docs/hf_models.json`, which",
        "`tests/models/test_hf_coverage.py` writes: it finds the MoE model families of the",
        "installed transformers, builds a tiny random model of each (2 layers, hidden 64, 4",
        "experts), converts it with `moe.hf.convert` and checks, in float32 on the CPU, the",
        "logits against the unconverted model with DBO off and on, in one process and on two",
        "expert-parallel gloo ranks (one of them sending no token through an MoE block), 8",
        "greedy tokens of `moe.hf.generate` against the unconverted model's `generate`, and",
        "the converted model's `save_pretrained` read back by transformers' `from_pretrained`",
        "and (column load) by `moe.hf.load`.",
        "",
        f"transformers {version}: **{len(ok)} of {len(results)}** MoE model families convert "
        f"and pass ({100 * len(ok) / max(1, len(results)):.1f}%); **{len(loads)}** of them "
        f"load with `moe.hf.load`.",
        "",
        "| family | model type | status | load | path taken / reason |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (STATUSES.index(r.status), r.family)):
        text = r.conversion.removeprefix("moe.hf.convert: ") if r.status == "ok" else r.reason
        if r.status == "ok" and r.reason:
            text += f" ({r.reason})"
        lines.append(f"| {r.family} | {r.model_type or '-'} | {r.status} | "
                     f"{_cell(_load_cell(r.load))} | {_cell(text)} |")
    return "\n".join(lines) + "\n"


def _load_cell(load: Optional[str]) -> str:
    """"ok", "-" (not checked), or what `moe.hf.load` refuses, without its fix."""
    if load is None or load == "ok":
        return "-" if load is None else "ok"
    what = load.removeprefix("moe.hf.load: ")
    return "refused: " + what.rpartition(": ")[0] if ": " in what else "refused: " + what


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe.hf.coverage", description=(
        "The Hugging Face MoE model types dbo converts: the page from the recorded result "
        "(tests/models/test_hf_coverage.py writes it), or the types this transformers has."))
    parser.add_argument("--markdown", action="store_true",
                        help=f"write {MARKDOWN_PATH} from {JSON_PATH}")
    parser.add_argument("--list", action="store_true",
                        help="print the MoE model families of the installed transformers")
    args = parser.parse_args(argv)
    if args.list:
        for family in discover():
            print(f"{family.family}\t{family.model_type}\t"
                  f"{'experts interface' if family.interface else 'own experts'}")
    if args.markdown:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        version, results = load(os.path.join(root, JSON_PATH))
        with open(os.path.join(root, MARKDOWN_PATH), "w", encoding="utf-8") as f:
            f.write(markdown(version, results))
        print(f"wrote {MARKDOWN_PATH} ({len(results)} families)")
    if not (args.list or args.markdown):
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
