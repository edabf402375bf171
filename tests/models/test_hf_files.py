"""Layer 1 (CPU): what `moe.hf.load` and `dbo run --hf` read from a checkpoint folder
(`moe.hf.folder`). The folder's own Python (config.json's `auto_map`) never runs without
`trust_remote_code=True`, and no prompt reads stdin; the index and the shards name only
files inside the folder, each tensor in one file; a malformed config.json, index or
shard is refused in one line naming the file, what is wrong and the fix.
"""
from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import moe.hf  # noqa: E402
from dbo import cli  # noqa: E402
from tests.hf_utils import assert_logits_close, batch, logits, save, tiny_model  # noqa: E402

INDEX = "model.safetensors.index.json"

# The folder's own code: writes a marker file when Python imports it.
CUSTOM_CODE = """
open({marker!r}, "w").write("ran")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


class CustomConfig(Qwen3MoeConfig):
    pass


class CustomModel(Qwen3MoeForCausalLM):
    config_class = CustomConfig
"""


@pytest.fixture
def no_prompt(monkeypatch):
    """Every `input()` call is recorded and answered "y" (what piping `yes` would do)."""
    asked: list[str] = []

    def answer_yes(prompt: str = "") -> str:
        asked.append(prompt)
        return "y"

    monkeypatch.setattr(builtins, "input", answer_yes)
    return asked


def _with_custom_code(path, marker, *, model_type=None) -> str:
    """Add config.json's auto_map naming custom.py (which writes `marker` when run)."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["auto_map"] = {"AutoConfig": "custom.CustomConfig",
                          "AutoModelForCausalLM": "custom.CustomModel"}
    if model_type is not None:
        config["model_type"] = model_type
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "custom.py"), "w") as f:
        f.write(CUSTOM_CODE.format(marker=os.fspath(marker)))
    return path


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------- custom code (auto_map)
def test_custom_code_of_an_unknown_model_type_is_refused_without_a_prompt(tmp_path, no_prompt):
    marker = tmp_path / "marker"
    path = _with_custom_code(save(tiny_model("qwen3_moe"), tmp_path / "ckpt"), marker,
                             model_type="custom_moe")
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert "auto_map" in message and "custom.CustomConfig" in message and \
        "'custom_moe'" in message and "config.json" in message, message
    assert not marker.exists() and no_prompt == []
    with pytest.raises(ValueError) as exc:  # trusted or not: dbo cannot convert it
        moe.hf.load(path, trust_remote_code=True)
    assert "'custom_moe'" in _one_line(exc)
    assert not marker.exists() and no_prompt == []


def test_auto_map_of_a_supported_model_type_builds_transformers_own_model(tmp_path, no_prompt):
    marker = tmp_path / "marker"
    model = tiny_model("qwen3_moe")
    path = _with_custom_code(save(model, tmp_path / "ckpt"), marker)
    ids, mask = batch(2, 5, seed=1)
    with pytest.warns(UserWarning, match="auto_map.*trust_remote_code=True"):
        loaded = moe.hf.load(path)
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    assert not marker.exists() and no_prompt == []
    assert_logits_close(logits(loaded, ids, mask), logits(model, ids, mask))


def test_trust_remote_code_runs_the_folders_code(tmp_path, no_prompt):
    marker = tmp_path / "marker"
    path = _with_custom_code(save(tiny_model("qwen3_moe"), tmp_path / "ckpt_trusted"), marker)
    loaded = moe.hf.load(path, trust_remote_code=True)
    assert type(loaded).__name__ == "CustomModel"
    assert marker.read_text() == "ran" and no_prompt == []


def test_dbo_run_hf_refuses_custom_code_with_stdin_closed(tmp_path):
    marker = tmp_path / "marker"
    path = _with_custom_code(save(tiny_model("qwen3_moe"), tmp_path / "ckpt"), marker,
                             model_type="custom_moe")
    proc = subprocess.run([sys.executable, "-c", "import os, sys; os.close(0); "
                           "from dbo.cli import main; sys.exit(main(sys.argv[1:]))",
                           "run", "--hf", path, "--world-size", "1"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("dbo run: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "custom.CustomConfig" in proc.stderr and "was not run" in proc.stderr
    assert not marker.exists()


def test_dbo_run_hf_never_prompts(tmp_path, capsys, no_prompt, monkeypatch):
    import dbo.cli.run_job
    monkeypatch.setattr(dbo.cli.run_job, "launch", lambda *a, **k: pytest.fail("launched"))
    marker = tmp_path / "marker"
    path = _with_custom_code(save(tiny_model("qwen3_moe"), tmp_path / "ckpt"), marker,
                             model_type="custom_moe")
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--hf", path, "--world-size", "1"])
    assert info.value.code == 2
    assert "custom.CustomConfig" in capsys.readouterr().err
    assert not marker.exists() and no_prompt == []


def test_a_hub_cache_snapshot_reads_its_blobs_and_nothing_else(tmp_path):
    """The hub cache layout: `<repo>/snapshots/<rev>/<file>` links to `<repo>/blobs/<hash>`.
    Those links are followed; one into another repository's blobs is refused."""
    _, saved = _sharded(tmp_path)
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(sorted(os.listdir(saved))):
        shutil.move(saved / name, blobs / f"hash{i}")
        os.symlink(os.path.join("..", "..", "blobs", f"hash{i}"), snapshot / name)
    from moe.hf.folder import tensor_files
    assert len(set(tensor_files(snapshot).values())) > 1
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    with open(snapshot / INDEX) as f:
        _, shard = _first(json.load(f))
    target = os.path.realpath(snapshot / shard)
    os.remove(snapshot / shard)
    shutil.move(target, other / "stray")
    os.symlink(other / "stray", snapshot / shard)
    with pytest.raises(ValueError, match="is a symlink leading outside the folder"):
        tensor_files(snapshot)


@pytest.mark.parametrize("text, problem", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "nested"),
    ('{"model_type": ["qwen3_moe"]}', "the checkpoint is a ['qwen3_moe'] model"),
], ids=["not-json", "a-list", "deep", "model-type-list"])
def test_a_malformed_config_json_is_named(tmp_path, text, problem):
    path = save(tiny_model("qwen3_moe"), tmp_path)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(text)
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert "config.json" in message and problem in message, message


# ------------------------------------------------------------- the index and the shards
def _sharded(tmp_path):
    """A qwen2_moe checkpoint in several shards with its index; (model, path)."""
    model = tiny_model("qwen2_moe")
    path = tmp_path / "ckpt"
    model.save_pretrained(path, max_shard_size="40KB")
    return model, path


def _edit_index(path, edit) -> None:
    with open(path / INDEX) as f:
        index = json.load(f)
    edit(index)
    with open(path / INDEX, "w") as f:
        json.dump(index, f)


def _first(index: dict) -> tuple[str, str]:
    name = sorted(index["weight_map"])[0]
    return name, index["weight_map"][name]


def test_an_index_entry_outside_the_folder_is_refused(tmp_path):
    _, path = _sharded(tmp_path)
    with open(path / INDEX) as f:
        name, shard = _first(json.load(f))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(path / shard, elsewhere / shard)  # a valid shard: only its place is wrong
    _edit_index(path, lambda i: i["weight_map"].__setitem__(name, f"../elsewhere/{shard}"))
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert INDEX in message and f"'../elsewhere/{shard}'" in message and name in message \
        and "leads out of the folder through '..'" in message, message


def test_an_absolute_index_entry_is_refused(tmp_path):
    _, path = _sharded(tmp_path)
    with open(path / INDEX) as f:
        name, _ = _first(json.load(f))
    _edit_index(path, lambda i: i["weight_map"].__setitem__(name, "/etc/passwd"))
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert INDEX in message and "'/etc/passwd' is an absolute path" in message, message


def test_a_shard_symlinked_outside_the_folder_is_refused(tmp_path):
    _, path = _sharded(tmp_path)
    with open(path / INDEX) as f:
        _, shard = _first(json.load(f))
    outside = tmp_path / "outside.safetensors"
    shutil.move(path / shard, outside)
    os.symlink(outside, path / shard)
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert f"'{shard}'" in message and "is a symlink leading outside the folder" in message, \
        message
    os.remove(path / shard)  # a symlink inside the folder is followed
    os.mkdir(path / "real")
    shutil.move(outside, path / "real" / shard)
    os.symlink(os.path.join("real", shard), path / shard)
    from moe.hf.folder import tensor_files
    assert shard in tensor_files(path).values()


@pytest.mark.parametrize("text, problem", [
    ("{not json", "not valid JSON"),
    ('{"metadata": {}}', "has no \"weight_map\""),
    ('{"weight_map": ["a.safetensors"]}', "\"weight_map\" must be a JSON object"),
    ('{"weight_map": {"lm_head.weight": 3}}', "tensor 'lm_head.weight' maps to 3"),
    ('{"weight_map": {}}', "lists no tensor"),
    ('{"weight_map": {"lm_head.weight": "missing.safetensors"}}', "'missing.safetensors'"),
    ('{"weight_map": {"lm_head.weight": "config.json"}}', "not a .safetensors file"),
    ('{"weight_map": {"x": "a.safetensors", "x": "b.safetensors"}}',
     "tensor 'x' is listed twice"),
    ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
], ids=["not-json", "no-weight-map", "weight-map-list", "file-not-str", "empty", "missing-file",
        "not-safetensors", "listed-twice", "deep"])
def test_a_malformed_index_is_named(tmp_path, text, problem):
    _, path = _sharded(tmp_path)
    (path / INDEX).write_text(text)
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert INDEX in message and problem in message, message


def test_an_index_naming_a_tensor_its_shard_lacks_is_named(tmp_path):
    _, path = _sharded(tmp_path)
    with open(path / INDEX) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in sorted(index["weight_map"].items()) if f == shards[0])
    _edit_index(path, lambda i: i["weight_map"].__setitem__(name, shards[1]))
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert f"'{name}'" in message and f"'{shards[1]}'" in message and \
        "does not hold it" in message, message


def test_a_truncated_shard_is_named(tmp_path):
    path = save(tiny_model("mixtral"), tmp_path)
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert "'model.safetensors'" in message and "not a readable safetensors file" in message


def test_a_tensor_in_two_shards_without_an_index_is_refused(tmp_path):
    model = tiny_model("mixtral")
    path = save(model, tmp_path)
    name = "lm_head.weight"
    safetensors_torch.save_file({name: model.state_dict()[name].contiguous() * 0},
                                os.path.join(path, "stray.safetensors"))
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert f"'{name}'" in message and "'model.safetensors'" in message and \
        "'stray.safetensors'" in message, message


def test_sharded_checkpoint_still_loads(tmp_path):
    model, path = _sharded(tmp_path)
    ids, mask = batch(2, 5, seed=3)
    from moe.hf.folder import tensor_files
    files = tensor_files(path)
    assert set(files.values()) == {f for f in os.listdir(path) if f.endswith(".safetensors")}
    assert_logits_close(logits(moe.hf.load(path), ids, mask), logits(model, ids, mask))
