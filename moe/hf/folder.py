"""What dbo reads from a checkpoint folder, checked before anything is built from it.

    config = read_config(path)        # transformers' config; the folder's Python never runs
    files = tensor_files(path)        # tensor name -> shard file, every file inside the folder

- config.json: a JSON object whose `model_type` is one transformers has classes of. Its
  `auto_map` (the folder's own modelling code) runs only with `trust_remote_code=True`;
  without it transformers' own class of that model type is built, and nothing prompts.
- model.safetensors.index.json (`weight_map`: tensor name -> file), or without one every
  *.safetensors file of the folder: each file named must lie inside the folder, symlinks
  resolved (no absolute path, no ".."; a hub cache snapshot's links into its repository's
  `blobs` folder are inside), be a readable safetensors file, and hold the
  tensors it is listed for; a tensor is in one file only.

Every refusal is a one-line ValueError naming the file, what is wrong and the fix.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Optional

from moe.hf.deps import require

__all__ = ["INDEX_FILE", "MAX_JSON_BYTES", "open_shard", "read_config",
           "read_generation_config", "tensor_files"]

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
MAX_JSON_BYTES = 64 << 20
"""The largest config.json or index read (64 MiB; a 1T-parameter model's index is a few
MB): a bigger one is refused rather than parsed into memory."""


def read_config(path: str | os.PathLike, *, trust_remote_code: bool = False,
                where: str = "moe.hf.load", code_fix: Optional[str] = None) -> Any:
    """The transformers config of checkpoint folder `path`, read from its config.json.

    The folder's own Python (config.json's `auto_map`) runs only if `trust_remote_code`;
    otherwise a model type transformers has classes of is built from them (with a
    warning that the folder's code was not run; refused instead, ending with `code_fix`,
    where one is given). Any other model type is refused before transformers sees it, so
    that nothing prompts on stdin. `where` starts each error.
    """
    folder = _folder(path, where)
    file = _inside(folder, CONFIG_FILE, where=where, source=repr(folder))
    if not os.path.isfile(file):
        raise ValueError(f"{where}: {folder!r} has no {CONFIG_FILE}: name a checkpoint folder "
                         f"that save_pretrained wrote")
    raw = _read_json(file, where=where)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {file}: must hold a JSON object (of a model config), "
                         f"found {type(raw).__name__}: re-save it with save_pretrained")
    model_type = raw.get("model_type")
    auto_map = raw.get("auto_map")
    code = _custom_code(auto_map)
    transformers = require("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        ran = (f"; its auto_map names the folder's own code ({code}), which was not run"
               if code else "")
        raise ValueError(f"{where}: {file}: the checkpoint is a {_short(model_type)} model, "
                         f"which transformers {transformers.__version__} has no classes of"
                         f"{ran}: moe.hf.load builds transformers' own models only; load it "
                         f"with the code that defines it and convert it, "
                         f"moe.hf.convert(model, group=ep_group)")
    if code and not trust_remote_code and code_fix is not None:
        raise ValueError(f"{where}: {file}: its auto_map names the folder's own code "
                         f"({code}), which was not run: {code_fix}")
    if code and not trust_remote_code:
        warnings.warn(f"{where}: {file}: its auto_map names the folder's own code ({code}); "
                      f"it was not run, transformers' own {model_type} is built instead "
                      f"(pass trust_remote_code=True to run the folder's code)", stacklevel=3)
    try:
        return transformers.AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{where}: {file}: transformers cannot read it as a {model_type} "
                         f"config ({_first_line(exc)}): fix the field it names, or re-save "
                         f"the config with save_pretrained") from exc


def read_generation_config(path: str | os.PathLike, *,
                           where: str = "moe.hf.load") -> Optional[Any]:
    """transformers' `GenerationConfig` from the folder's generation_config.json, or None
    where there is none; ValueError naming the file where it cannot be read."""
    folder = _folder(path, where)
    file = _inside(folder, GENERATION_FILE, where=where, source=repr(folder))
    if not os.path.exists(file):
        return None
    if not isinstance(_read_json(file, where=where), dict):
        raise ValueError(f"{where}: {file}: must hold a JSON object: re-save it with "
                         f"save_pretrained, or delete it to use the model's defaults")
    transformers = require("transformers")
    try:
        return transformers.GenerationConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{where}: {file}: transformers cannot read it ({_first_line(exc)}): "
                         f"re-save it with save_pretrained, or delete it to use the model's "
                         f"defaults") from exc


def tensor_files(path: str | os.PathLike, *, where: str = "moe.hf.load") -> dict[str, str]:
    """The shard file (a name relative to the folder) of every tensor of checkpoint folder
    `path`: from model.safetensors.index.json where there is one, else from the headers of
    the folder's *.safetensors files. Opens every shard named, headers only.

    Raises ValueError (one line: the file, what is wrong, the fix) for a malformed index, a
    file outside the folder (absolute, "..", or a symlink leading out), a missing or
    unreadable shard, a tensor its shard lacks, or a tensor in two shards.
    """
    folder = _folder(path, where)
    index = os.path.join(folder, INDEX_FILE)
    if os.path.lexists(index):
        return _files_from_index(folder, where=where)
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"{where}: {folder!r} holds no *.safetensors file: save the model "
                         f"with save_pretrained (safetensors is its default)")
    files: dict[str, str] = {}
    for shard in shards:
        with open_shard(folder, shard, where=where) as f:
            names = list(f.keys())
        for name in names:
            if name in files:
                raise ValueError(
                    f"{where}: tensor {_short(name)} is in two files of {folder!r}, "
                    f"{files[name]!r} and {shard!r}, and no {INDEX_FILE} says which holds "
                    f"it: remove the file that does not belong (e.g. a shard left from "
                    f"another save), or re-save the checkpoint into an empty folder")
            files[name] = shard
    return files


def open_shard(folder: str, file: str, *, where: str = "moe.hf.load",
               source: Optional[str] = None) -> Any:
    """`safetensors.safe_open` of shard `file` of `folder` (a context manager), the file
    checked to lie inside the folder; ValueError naming it where it is not a readable
    safetensors file. `source` says what named the file (for errors)."""
    source = source or repr(folder)
    real = _inside(folder, file, where=where, source=source)
    if not os.path.isfile(real):
        raise ValueError(f"{where}: {source}: shard {_short(file)} is not a file in the "
                         f"folder: the checkpoint is incomplete (copy the missing shard, or "
                         f"re-save the checkpoint)")
    safetensors = require("safetensors")
    try:
        return safetensors.safe_open(real, framework="pt")
    except Exception as exc:  # safetensors' SafetensorError is not a subclass of OSError
        raise ValueError(f"{where}: {folder!r}: {_short(file)} is not a readable safetensors file "
                         f"({_first_line(exc)}): the file is truncated or damaged; copy it "
                         f"again or re-save the checkpoint") from exc


# ---------------------------------------------------------------------------- internals
def _folder(path: str | os.PathLike, where: str) -> str:
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise ValueError(f"{where}: {folder!r} is not a directory: pass a checkpoint "
                         f"directory (config.json and *.safetensors, as save_pretrained "
                         f"writes)")
    return folder


def _inside(folder: str, name: str, *, where: str, source: str) -> str:
    """`folder`/`name`, refused unless it lies inside `folder` once symlinks are resolved
    (`source`: what named the file, for errors)."""
    only = "only files inside the checkpoint folder are read"
    if os.path.isabs(name):
        raise ValueError(f"{where}: {source}: {_short(name)} is an absolute path: {only}; "
                         f"name the files relative to it")
    if ".." in name.replace("\\", "/").split("/"):
        raise ValueError(f"{where}: {source}: {_short(name)} leads out of the folder through "
                         f"'..': {only}; move the file into the folder and name it relative "
                         f"to it")
    joined = os.path.join(folder, name)
    real = os.path.realpath(joined)
    if not any(os.path.commonpath([real, root]) == root for root in _roots(folder)):
        raise ValueError(f"{where}: {source}: {_short(name)} is a symlink leading outside the "
                         f"folder: {only}; copy the file itself into the folder")
    return joined


def _roots(folder: str) -> list[str]:
    """Where `folder`'s files may lie once symlinks are resolved: the folder itself, and
    for a Hugging Face hub cache snapshot (`<repo>/snapshots/<revision>`, whose files are
    symlinks to `<repo>/blobs/<hash>`) that repository's `blobs` folder."""
    root = os.path.realpath(folder)
    roots = [root]
    parent = os.path.dirname(root)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def _read_json(file: str, *, where: str, pairs_hook: Any = None) -> Any:
    size = os.path.getsize(file)
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{where}: {file}: {size} bytes, more than the {MAX_JSON_BYTES} "
                         f"this reads (moe.hf.folder.MAX_JSON_BYTES): it is not a config "
                         f"or index that save_pretrained wrote")
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=pairs_hook)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: {file}: not valid JSON ({exc.msg} at line {exc.lineno} "
                         f"column {exc.colno}): re-save it with save_pretrained") from exc
    except RecursionError as exc:
        raise ValueError(f"{where}: {file}: its JSON is nested too deeply to read: it is not "
                         f"one that save_pretrained wrote; re-save it") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: {file}: not UTF-8 text ({exc.reason}): re-save it with "
                         f"save_pretrained") from exc


class _ListedTwice(ValueError):
    pass


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; _ListedTwice where one key has two values."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out and out[key] != value:
            raise _ListedTwice(key, out[key], value)
        out[key] = value
    return out


def _files_from_index(folder: str, *, where: str) -> dict[str, str]:
    index = _inside(folder, INDEX_FILE, where=where, source=repr(folder))
    try:
        raw = _read_json(index, where=where, pairs_hook=_no_repeats)
    except _ListedTwice as exc:
        name, first, second = exc.args
        if isinstance(first, str) and isinstance(second, str):
            raise ValueError(f"{where}: {index}: tensor {_short(name)} is listed twice, in "
                             f"{_short(first)} and {_short(second)}: keep the entry of the "
                             f"file that holds it") from None
        raise ValueError(f"{where}: {index}: key {_short(name)} appears twice with different "
                         f"values: re-save the checkpoint with save_pretrained") from None
    fix = "re-save the checkpoint with save_pretrained"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {index}: must hold a JSON object with a \"weight_map\", "
                         f"found {type(raw).__name__}: {fix}")
    if "weight_map" not in raw:
        raise ValueError(f"{where}: {index}: has no \"weight_map\" (tensor name -> file): "
                         f"{fix}")
    weight_map = raw["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(f"{where}: {index}: \"weight_map\" must be a JSON object (tensor name "
                         f"-> file), found {type(weight_map).__name__}: {fix}")
    if not weight_map:
        raise ValueError(f"{where}: {index}: its \"weight_map\" lists no tensor: {fix}")
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if isinstance(file, str):  # where it leads first: "/etc/passwd" is refused as such
            _inside(folder, file, where=where, source=f"{index} (tensor {_short(name)})")
        if not isinstance(file, str) or not file.endswith(".safetensors"):
            what = "not a .safetensors file" if isinstance(file, str) else "not a file name"
            raise ValueError(f"{where}: {index}: tensor {_short(name)} maps to {_short(file)}, "
                             f"{what}: {fix}")
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        source = f"{index} (tensor {_short(names[0])})"
        with open_shard(folder, file, where=where, source=source) as f:
            held = set(f.keys())
        lacking = [n for n in names if n not in held]
        if lacking:
            more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
            raise ValueError(f"{where}: {index}: lists tensor {_short(lacking[0])}{more} in "
                             f"{_short(file)}, which does not hold it: the index is for other "
                             f"files; {fix}")
    return dict(weight_map)


def _custom_code(auto_map: Any) -> str:
    """The classes config.json's `auto_map` names, comma-separated ("" for none)."""
    if not auto_map:
        return ""
    values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    names: list[str] = []
    for value in values:
        for item in (value if isinstance(value, (list, tuple)) else [value]):
            if item is not None and str(item) not in names:
                names.append(str(item))
    return ", ".join(names) or repr(auto_map)


def _short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (values from a file may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
