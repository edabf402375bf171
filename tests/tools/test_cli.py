"""Layers 1-2 (CPU): the `dbo` command. In-process (layer 1): every command's --help
(its name, defaults, choices), bad arguments refused with one line and exit code 2
before any rank starts, `launch.resolve_world_size`, the printed summary. Spawning gloo
ranks (layer 2, marked distributed): `dbo run` end to end on the tiny preset, its
--decode-steps included, and `dbo inspect` of its trace (`dbo trace` end to end:
tests/traces/test_trace_alignment.py)."""
from __future__ import annotations

import importlib.util
import json
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dbo import cli
from tests.tools.fd_output import Printed, printed


@pytest.fixture(scope="module")
def run_out(tmp_path_factory) -> tuple[Path, int, Printed]:
    """`dbo run` on two gloo ranks through cli.main in this process (the ranks it spawns
    import torch, this process has; `python -m dbo.cli` itself: test_python_m_runs_the_command):
    its folder, exit code and output, the ranks' included."""
    out = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as env, printed() as output:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KINETO_LOG_LEVEL"):
            env.delenv(name, raising=False)  # a fresh shell's: no torchrun, Kineto's default
        code = cli.main(["run", "--tokens", "96", "--requests", "6", "--steps", "1",
                         "--num-experts", "4", "--decode-steps", "2", "--out", str(out)])
    return out, code, output


@pytest.mark.distributed
def test_dbo_run_end_to_end(run_out):
    out, code, output = run_out
    assert code == 0, output.err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "a2a"
    assert summary["num_experts"] == 4  # --num-experts, not the preset's 8
    assert summary["split"] is True and summary["outputs_match"] is True
    assert summary["tokens_per_rank"] == [96, 84]
    assert summary["routing_ties"] == [0, 0]  # fp32: every token compared
    assert summary["step_ms"]["dbo_on"] > 0 and summary["step_ms"]["dbo_off"] > 0
    # The two ubatches interleave: ubatch 1 starts its attention before ubatch 0 receives.
    order = summary["phase_order"]
    assert order.index("ub1 attention") < order.index("ub0 dispatch_recv")
    assert order.index("ub0 combine_send") < order.index("ub1 combine_send")
    for name in ("trace.json", "trace_analysis.json", "trace_timeline.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "rank1" / "trace.json").exists()
    last = json.loads(output.out.strip().splitlines()[-1])
    assert last["outputs_match"] is True
    assert "order in which the ubatches issued the phases" in output.out
    # CPU times are a functional check: labelled so, and no speedup is derived from them.
    assert summary["timings"] == "functional" and summary["speedup"] is None
    assert last["timings"] == "functional" and last["speedup"] is None
    text = output.out.strip().rsplit("\n", 1)[0]
    assert "not a performance figure" in text and "speedup" not in text
    # Kineto's "USDT ... profiler_start/stop" lines are quieted (KINETO_LOG_LEVEL).
    assert "USDT" not in output.err and "profiler_start" not in output.err


@pytest.mark.distributed
def test_dbo_run_decode_steps_end_to_end(run_out):
    # --decode-steps 2 of the same run: after the prefill, two decode steps compared DBO
    # off and on, reported in the table, summary and JSON line.
    out, code, output = run_out
    assert code == 0, output.err[-3000:]
    final = json.loads(output.out.strip().splitlines()[-1])
    decode = final["decode"]
    assert decode["steps"] == 2 and decode["requests_per_rank"] == [6, 6]
    assert decode["split"] is True and "SplitWithCache" in decode["reason"]
    assert decode["outputs_match"] is True
    assert all(d < 1e-4 for d in decode["max_abs_diff"]), decode
    assert decode["step_ms"]["dbo_off"] > 0 and decode["step_ms"]["dbo_on"] > 0
    assert "decode: 2 steps of one token per request over KV caches" in output.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["decode"]["outputs_match"] is True


@pytest.mark.distributed
def test_dbo_run_joined_experts_end_to_end(capsys):
    # --joined-experts: the DBO step runs each MoE layer's experts once for both ubatches;
    # its outputs match DBO off and the summary names the mode.
    with pytest.MonkeyPatch.context() as env:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.delenv(name, raising=False)
        code = cli.main(["run", "--tokens", "48", "--requests", "4", "--steps", "1",
                         "--num-experts", "4", "--no-trace", "--joined-experts"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    last = json.loads(out.strip().splitlines()[-1])
    assert last["split"] is True and last["mode"] == "joined" and last["outputs_match"]
    assert "split: True with joined experts" in out


@pytest.mark.distributed
def test_dbo_inspect_reads_the_run_trace(run_out, capsys):
    # The trace a 2-rank run wrote, read back.
    out, _, _ = run_out
    assert cli.main(["inspect", str(out / "trace.json")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["devices"], report


# A default each command's --help must show: (option, its default).
HELP_DEFAULTS = {"run": ("--warmup", "1"), "trace": ("--steps", "2"), "bench": ("--mode", "layer"),
                 "bench-switch": ("--repeats", "5"), "soak": ("--warmup", "50"), "inspect": None}


@pytest.mark.parametrize("command", HELP_DEFAULTS)
def test_help_names_the_command_and_shows_defaults(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dbo {command} ")
    if HELP_DEFAULTS[command] is not None:
        option, default = HELP_DEFAULTS[command]
        entry = out.split(f"\n  {option} ", 1)[1].split("\n  -", 1)[0].split("\n\n", 1)[0]
        entry = " ".join(entry.split())
        assert entry.endswith(f"(default: {default})"), entry


@pytest.mark.parametrize("command", [c for c in cli.COMMANDS if c != "trace"])
def test_every_command_describes_itself_to_a_user_in_a_few_lines(command, capsys):
    # The text between the usage block and the options: what the command does, for
    # someone running it (not a module's docstring: no dbo.* module names, no source
    # layout). `dbo trace` passes its own module docstring (dbo/cli/trace_job.py).
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n", 1)[1].split("\npositional arguments:", 1)[0]
    description = description.split("\noptions:", 1)[0].strip()
    lines = description.splitlines()
    assert 1 <= len(lines) <= 7 and max(map(len, lines)) <= 92, description
    assert "dbo.cli" not in description and "`dbo." not in description, description
    assert "One rank's" not in description and "Modules:" not in description


@pytest.mark.parametrize("module, usage", [
    ("dbo.cli", "usage: dbo COMMAND"), ("dbo.cli.bench", "usage: dbo bench "),
    ("dbo.cli.bench_comm", "usage: dbo bench-comm "), ("dbo.cli.soak", "usage: dbo soak "),
])
def test_python_m_runs_the_command(module, usage, monkeypatch, capsys):
    # `python -m MODULE --help` as python -m runs it (runpy, as __main__), in this process:
    # the module's main block reaches the command. The end-to-end tests call main().
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules": imported
        with pytest.raises(SystemExit) as exc:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_help_lists_the_choices_from_the_registries(capsys):
    from moe.backends import BACKENDS
    from moe.experts import EXPERTS
    from moe.models.presets import PRESETS
    from moe.backends.registry import UNTESTED_BACKENDS

    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    assert "--preset {" + ",".join(PRESETS) + "}" in out
    assert "--experts {" + ",".join(["auto", *EXPERTS]) + "}" in out
    runnable = [name for name in BACKENDS if name not in UNTESTED_BACKENDS]
    assert "--backend {" + ",".join(["auto", *runnable]) + "}" in out
    entry = " ".join(out.split("\n  --tokens TOKENS", 1)[1].split("\n  --", 1)[0].split())
    assert entry.endswith("(default: 4096 on CUDA GPUs, 256 on CPU)"), entry
    for command in ("bench", "soak"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert "--experts {" + ",".join(["auto", *EXPERTS]) + "}" in capsys.readouterr().out


def test_trace_has_no_switch_to_skip_the_trace(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["trace", "--no-trace"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-trace" in capsys.readouterr().err


@pytest.fixture
def no_launch(monkeypatch):
    """Starting ranks fails the test: bad arguments must be refused before."""
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    import dbo.cli.run_job
    import dbo.cli.trace_job

    for module in (dbo.cli.run_job, dbo.cli.trace_job):
        monkeypatch.setattr(module, "launch", refuse)
    import dbo.cli.bench.launch
    monkeypatch.setattr(dbo.cli.bench.launch, "spawn_ranks", refuse)
    import dbo.cli.bench_comm
    import dbo.cli.soak.run
    for module in (dbo.cli.bench_comm, dbo.cli.soak.run):
        monkeypatch.setattr(module, "launch", refuse)


NO_DEEP_EP = pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None,
                                reason="deep_ep is installed")
NEEDS_DEEP_EP = "needs DeepEP (deep_ep.Buffer), which is not installed: build DeepEP v1"
HUGE = "99999999999999"  # tokens no machine holds the activations of


@pytest.mark.parametrize("args, message", [
    (("run", "--tokens", "0"), "--tokens=0: must be >= 1"),
    (("run", "--tokens", "-5"), "--tokens=-5: must be >= 1"),
    (("run", "--preset", "nope"), "invalid choice: 'nope'"),
    (("run", "--experts", "nope"), "invalid choice: 'nope'"),
    (("run", "--backend", "nope"), "invalid choice: 'nope'"),
    (("run", "--world-size", "3"), "8 routed experts (tiny) do not split over 3 ranks"),
    (("run", "--num-experts", "5"), "5 routed experts (tiny) do not split over 2 ranks"),
    (("run", "--num-experts", "1", "--world-size", "1"), "top_k=2 exceeds num_experts=1"),
    (("run", "--world-size", "0"), "--world-size=0: must be >= 1"),
    (("run", "--out", "FILE"), "that is an existing file"),
    (("trace", "--out", "FILE"), "that is an existing file"),
    (("trace", "--world-size", "3"), "do not split over 3 ranks"),
    (("nope",), "unknown command 'nope'"),
    (("run", "--cuda-graph", "--backend", "a2a"), "--backend=a2a: that backend reads device values"),
    (("run", "--cuda-graph", "--experts", "reference"), "--cuda-graph with --experts=reference"),
    pytest.param(("run", "--cuda-graph"), "--cuda-graph needs CUDA GPUs",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    pytest.param(("run", "--backend", "symm_mem"), "backend 'symm_mem' runs NVSHMEM kernels "
                 "on CUDA GPUs and this process has no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    pytest.param(("bench", "--backends", "symm_mem"), "backend 'symm_mem' runs NVSHMEM "
                 "kernels on CUDA GPUs",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    (("run", "--backend", "local"), "backend 'local' needs an EP group of size 1, got 2 "
                                    "ranks: use backend='a2a', 'a2a_ll' or 'naive'"),
    pytest.param(("run", "--backend", "deepep_ll"), "backend 'deepep_ll' " + NEEDS_DEEP_EP,
                 marks=NO_DEEP_EP),
    pytest.param(("run", "--backend", "deepep_ht"), "backend 'deepep_ht' " + NEEDS_DEEP_EP,
                 marks=NO_DEEP_EP),
    pytest.param(("bench", "--backends", "a2a,deepep_ht"), "backend 'deepep_ht' " + NEEDS_DEEP_EP,
                 marks=NO_DEEP_EP),
    pytest.param(("bench-comm", "--backends", "deepep_raw_ll"),
                 "backend 'deepep_raw_ll' " + NEEDS_DEEP_EP, marks=NO_DEEP_EP),
    (("bench-comm", "--backends", "a2a,naive_mono"), "backend 'naive_mono' dispatches router "
                                                     "logits (the monolithic form), not top-k "
                                                     "ids: not timed here"),
    pytest.param(("bench-comm", "--backends", "deepep_v2"), "backend 'deepep_v2' needs DeepEP "
                 "(deep_ep.ElasticBuffer), which is not installed", marks=NO_DEEP_EP),
    pytest.param(("soak", "--backend", "deepep_ht", "--dtype", "bfloat16"),
                 "backend 'deepep_ht' " + NEEDS_DEEP_EP, marks=NO_DEEP_EP),
    (("run", "--tokens", HUGE), f"--tokens={HUGE}: preset tiny (3 layers, 8 experts over 2 "
                                f"ranks) would need about"),
    (("trace", "--tokens", HUGE), f"--tokens={HUGE}: preset tiny"),
    (("run", "--hf-config", "qwen3_moe", "--tokens", HUGE),
     f"--tokens={HUGE}: hf-config qwen3_moe would need about"),
    (("run", "--decode-steps", HUGE), f"--decode-steps={HUGE}: preset tiny"),
    (("run", "--layers", "99999999"), "preset tiny (99999999 layers, 8 experts over 2 ranks) "
                                      "would need about"),
    (("bench", "--tokens", HUGE), f"--tokens={HUGE}: --mode layer of preset tiny"),
    (("bench", "--mode", "decode", "--context", HUGE), "--mode decode of preset tiny (4 "
                                                       "layers, 8 experts over 2 ranks) would "
                                                       "need about"),
    (("bench-comm", "--tokens", HUGE), f"--tokens={HUGE}: the exchange of --hidden 7168"),
    (("soak", "--max-tokens", HUGE), f"--max-tokens={HUGE}: the soak model"),
    (("run", "--requests", "50", "--tokens", "10"), "--requests=50 exceeds --tokens=10: each "
                                                   "request holds at least one token; use "
                                                   "--requests <= 10, or --tokens >= 50"),
    (("bench", "--context", "512"), "--context 512 applies to decode steps: add --mode decode, "
                                    "or drop --context"),
    pytest.param(("run", "--world-size", "100000", "--num-experts", "100000"),
                 "100000 ranks on this machine's", marks=pytest.mark.skipif(
                     torch.cuda.is_available(), reason="has CUDA: one GPU per rank")),
    (("run", "--out", "FILE/run"), "existing.txt is a file, so no folder can be made under "
                                   "it: name a folder elsewhere"),
    (("bench", "--out", "FILE/bench"), "existing.txt is a file, so no folder can be made"),
    (("run", "--seed", "-1"), "--seed=-1: must be an int >= 0"),
    (("soak", "--seed", str(2**64)), f"--seed={2**64}: at most 4294967295 (the seeds derived "
                                     f"from it must fit torch's 64-bit generator seeds)"),
    (("bench", "--seed", str(2**32)), f"--seed={2**32}: at most 4294967295"),
    (("bench-comm", "--seed", "-3"), "--seed=-3: must be an int >= 0"),
    # One check (dbo.cli.job_base.ModelJob), each command's own words.
    (("run", "--num-experts", "0"), "--num-experts=0: must be >= 1"),
    (("bench", "--num-experts", "0"), "num_experts=0 must be a positive int (or unset)"),
    (("bench", "--hf", "qwen3_moe", "--num-experts", "-2"),
     "num_experts=-2 must be a positive int (or unset)"),
    (("trace", "--profiler", "nope"), "invalid choice: 'nope'"),
    pytest.param(("trace", "--profiler", "nsys"), "--profiler=nsys needs CUDA GPUs",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
])
def test_bad_arguments_fail_fast(args, message, tmp_path, capsys, no_launch):
    existing = tmp_path / "existing.txt"
    existing.write_text("not a folder")
    argv = [a.replace("FILE", str(existing)) for a in args]
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    if args != ("nope",):  # one line, the fix in it: no usage block, no traceback
        assert err.count("\n") == 1 and err.startswith(f"dbo {args[0]}: "), err


def test_cuda_graph_backend_refusals_share_one_check(monkeypatch):
    # dbo run, dbo soak and dbo bench --hf refuse a backend that --cuda-graph cannot
    # capture through dbo.cli.check_graph_backends, each with its own list.
    import dbo.cli.bench.hf_config
    import dbo.cli.run_config
    import dbo.cli.soak.config
    from dbo.cli.bench.config import NVLINK_REGIME
    from dbo.cli.bench.hf_config import HFBenchConfig
    from dbo.cli.run_config import RunConfig
    from dbo.cli.soak import SoakConfig

    checked = []

    def check(backends, capturable, **kwargs):
        checked.append(tuple(backends))
        cli.check_graph_backends(backends, capturable, **kwargs)

    for module in (dbo.cli.run_config, dbo.cli.soak.config, dbo.cli.bench.hf_config):
        monkeypatch.setattr(module, "check_graph_backends", check)
    reads = "that backend reads device values on the host, which a CUDA graph cannot; use one of"
    with pytest.raises(ValueError) as run:
        RunConfig(backend="a2a", cuda_graph=True)
    assert str(run.value) == (f"--cuda-graph with --backend=a2a: {reads} auto, local, naive, "
                              f"naive_mono, a2a_ll, symm_mem, deepep_ll (auto picks a2a_ll "
                              f"on several ranks)")
    with pytest.raises(ValueError) as soak:
        SoakConfig(backend="deepep_ht", cuda_graph=True)
    assert str(soak.value) == (f"--cuda-graph with --backend=deepep_ht: {reads} naive, "
                               f"naive_mono, a2a_ll, symm_mem, deepep_ll")
    with pytest.raises(ValueError) as hf:
        HFBenchConfig(arch="qwen3_moe", backends=("a2a_ll", "a2a", "deepep_ht"),
                      device="cuda", regime=NVLINK_REGIME, cuda_graph=True)
    assert str(hf.value) == (f"--cuda-graph with --backends a2a: {reads} a2a_ll, symm_mem, "
                             f"deepep_ll")
    assert checked == [("a2a",), ("deepep_ht",), ("a2a_ll", "a2a", "deepep_ht")]
    assert RunConfig(backend="local", cuda_graph=True).backend == "local"


def test_resolve_world_size(monkeypatch):
    from dbo.cli.launch import resolve_world_size

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    default = torch.cuda.device_count() if torch.cuda.is_available() else 2
    assert resolve_world_size() == default and resolve_world_size(1) == 1
    with pytest.raises(ValueError, match="--world-size=0: must be >= 1"):
        resolve_world_size(0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_world_size() == 4 and resolve_world_size(4) == 4
    with pytest.raises(ValueError, match="torchrun started 4 ranks"):
        resolve_world_size(2)


PROFILE_ONCE = """
import sys
if sys.argv[1] == "quiet":
    from dbo.cli import quiet_profiler_logs
    quiet_profiler_logs()
import torch
from torch.profiler import profile
with profile():
    torch.ones(2) + 1
"""


def test_profiler_start_and_stop_print_no_usdt_lines():
    import os

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    # Both processes at once (each spends seconds importing torch): then read each.
    procs = [subprocess.Popen([sys.executable, "-c", PROFILE_ONCE, mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in ("loud", "quiet")]
    (_, loud_err), (_, quiet_err) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], quiet_err[-2000:] + loud_err[-2000:]
    if "profiler_start" not in loud_err:
        pytest.skip("this torch build's profiler prints no USDT lines")
    assert "USDT" not in quiet_err and "profiler_start" not in quiet_err, quiet_err


def fake_deep_ep_on_cuda(monkeypatch, *, classes=("Buffer",)) -> None:
    """As on a GPU machine with DeepEP installed (a stand-in module holding `classes`)."""
    import types

    fake = types.ModuleType("deep_ep")
    fake.__spec__ = types.SimpleNamespace(name="deep_ep")
    for name in classes:
        setattr(fake, name, object)
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_backend_checks_before_ranks_are_the_backends_own(monkeypatch, capsys, no_launch):
    # dbo.cli.check_backend_runs asks the backend class (PrepareFinalize.check_runs): the
    # group sizes and shapes its constructor would refuse, refused before any rank.
    from moe.models.presets import get_preset

    with pytest.raises(ValueError, match="backend 'local' needs an EP group of size 1, got 2"):
        cli.check_backend_runs("local", 2)
    cli.check_backend_runs("local", 1)
    cli.check_backend_runs("auto", 2)  # a2a: runs anywhere torch does
    fake_deep_ep_on_cuda(monkeypatch)
    cli.check_backend_runs("deepep_ht", 2)
    with pytest.raises(ValueError, match=r"an EP group of 3 rank\(s\) is not supported"):
        cli.check_backend_runs("deepep_ht", 3)
    with pytest.raises(ValueError, match="needs an EP group of at least 2 ranks"):
        cli.check_backend_runs("deepep_ll", 1)
    with pytest.raises(ValueError, match="MoEConfig.hidden_size=64 is not supported"):
        cli.check_backend_runs("deepep_ll", 2, get_preset("tiny").moe)
    with pytest.raises(ValueError, match="MoEConfig.dtype=torch.float32 is not supported"):
        cli.check_backend_runs("deepep_ht", 2, get_preset("tiny").moe)
    cli.check_backend_runs("deepep_ll", 2, get_preset("deepseek-v3-like").moe)
    with pytest.raises(ImportError, match="needs deep_ep.ElasticBuffer, which the installed "
                                          "deep_ep lacks"):
        cli.check_backend_runs("deepep_v2", 2)
    # dbo run checks the backend against its preset's shapes before any rank starts.
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--backend", "deepep_ll", "--preset", "tiny", "--tokens", "256"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dbo run: backend 'deepep_ll': MoEConfig.hidden_size=64 is not "
                          "supported") and err.count("\n") == 1, err


def test_memory_bound_refuses_exactly_what_does_not_fit(monkeypatch):
    monkeypatch.setattr(cli, "rank_memory", lambda *args: (1000, "a test budget"))

    def check(value: int, *, fixed: int = 100) -> None:
        cli.check_fits_memory("--tokens", value, unit="token", per_unit_bytes=9,
                              fixed_bytes=fixed, model="the model", shape_fix="shrink it",
                              world_size=2)

    check(100)  # 100 + 100 * 9 = 1000 bytes: fits
    with pytest.raises(ValueError) as exc:
        check(101)
    assert str(exc.value) == ("--tokens=101: the model would need about 1009 B per rank (9 B "
                              "per token + 100 B of weights), more than the 1000 B a rank "
                              "has here (a test budget): use --tokens <= 100")
    with pytest.raises(ValueError) as exc:
        check(1, fixed=995)  # not even one token fits beside the weights
    assert str(exc.value) == ("the model would need about 1004 B per rank at a single token "
                              "(9 B per token + 995 B of weights), more than the 1000 B a "
                              "rank has here (a test budget): shrink it")


@pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA: a GPU's memory per rank")
def test_rank_memory_on_cpu_is_the_machines_shared_by_its_ranks(monkeypatch):
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1 << 20}  # 4 GiB
    monkeypatch.setattr(cli.os, "sysconf", lambda name: pages[name])
    monkeypatch.setattr(cli, "process_bytes", lambda: 256 << 20)  # each rank's Python, torch
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    less = "less 256.0 MiB for Python and torch"
    assert cli.rank_memory(2) == ((2 << 30) - (256 << 20),
                                  f"this machine's 4.0 GiB over 2 ranks, {less}")
    assert cli.rank_memory(1) == ((4 << 30) - (256 << 20), f"this machine's 4.0 GiB, {less}")
    # Ranks that would not even hold their Python and torch: too many.
    with pytest.raises(ValueError, match=r"16 ranks on this machine's 4.0 GiB would get "
                                         r"256.0 MiB each, no more than the 256.0 MiB a "
                                         r"process of Python and torch takes here: start at "
                                         r"most 15 \(--world-size\)"):
        cli.rank_memory(16)
    # Under torchrun only this node's ranks share its memory.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cli.rank_memory(16) == ((1 << 30) - (256 << 20),
                                   f"this machine's 4.0 GiB over 4 ranks, {less}")
    assert cli.process_bytes() > 0  # this process, read from /proc on Linux


def test_run_memory_bound_counts_the_weights_over_the_ranks(monkeypatch):
    from dbo.cli.run_config import RunConfig, check_run_memory, model_config, step_bytes_per_token
    from moe.models.presets import estimate_param_bytes

    job = RunConfig(preset="deepseek-v3-like", tokens=4096)
    config = model_config(job, 8)
    weights = estimate_param_bytes(config, ep_size=8)
    need = weights + 4096 * step_bytes_per_token(config)
    monkeypatch.setattr(cli, "rank_memory", lambda *args: (need, "a test budget"))
    check_run_memory(job, config, 8)  # exactly fits
    with pytest.raises(ValueError, match=r"--tokens=4097: preset deepseek-v3-like \(4 layers, "
                                         r"256 experts over 8 ranks\) would need .* use "
                                         r"--tokens <= 4096$"):
        check_run_memory(RunConfig(preset="deepseek-v3-like", tokens=4097), config, 8)
    # One rank holds every expert: 8x the expert weights, over the budget on their own.
    with pytest.raises(ValueError, match=r"over 1 rank\) would need .* at a single token"):
        check_run_memory(job, model_config(job, 1), 1)


def test_plain_run_defaults_depend_on_the_device(monkeypatch):
    # CPU: the tiny fp32 preset, a functional check (unchanged). CUDA: DeepSeek-V3's layer
    # shapes in bf16 at 4096 tokens per rank, whose weights fit one H200 (141 GB).
    from dbo.cli.run_config import RunConfig, model_config, run_defaults
    from moe.models.presets import estimate_param_bytes

    assert run_defaults("cpu") == RunConfig()
    assert (RunConfig().preset, RunConfig().tokens) == ("tiny", 256)
    cuda = run_defaults("cuda")
    assert (cuda.preset, cuda.tokens) == ("deepseek-v3-like", 4096)
    assert cuda.tokens >= 4096 and cuda.requests <= cuda.tokens
    config = model_config(cuda, 1)
    assert config.dtype == torch.bfloat16 and config.num_moe_layers >= 2
    assert estimate_param_bytes(config, ep_size=1) < 100e9  # with room for activations
    with pytest.raises(ValueError, match="device type 'mps'"):
        run_defaults("mps")
    # parse_job takes them from the device the ranks compute on, unless the model is named.
    from dbo.cli.run_job import build_parser, parse_job

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    job, _ = parse_job(build_parser(), ["--no-trace"])
    assert (job.preset, job.tokens) == ("tiny", 256)
    job, _ = parse_job(build_parser(), ["--hf-config", "qwen3_moe"])
    assert (job.preset, job.hf_config) == ("tiny", "qwen3_moe")
    job, _ = parse_job(build_parser(), ["--preset", "qwen3-moe-like", "--tokens", "64"])
    assert (job.preset, job.tokens) == ("qwen3-moe-like", 64)


