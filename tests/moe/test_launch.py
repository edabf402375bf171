"""Layer 3 (Triton interpreter on CPU; GPU-marked on CUDA): `moe.kernels.launch` --
launching Triton kernels through their compiled handles.

On CPU (the interpreter) the launchers must take Triton's own path and give its results;
on CUDA (GPU-marked) the compiled-handle path must give the same results as
`kernel[grid](...)`, compile once per argument specialization, and follow the autotuner's
pick.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from moe.kernels import launch
from moe.kernels.launch import AutotunedLauncher, FastLauncher

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a * x + y, mask=mask)


def axpy(launcher, x, y, a, block=64):
    out = torch.empty_like(x)
    launcher((triton.cdiv(x.numel(), block),), x, y, out, a, x.numel(), BLOCK=block)
    return out


def plain(x, y, a, block=64):
    """The same launch through Triton's own `kernel[grid](...)`: the bits to match (the
    compiled kernel fuses a * x + y into one rounding, torch's ops round twice)."""
    return axpy(lambda grid, *args, **kw: axpy_kernel[grid](*args, **kw), x, y, a, block)


def test_cpu_tensors_take_tritons_own_path():
    launcher = FastLauncher(axpy_kernel)
    x = torch.arange(100, dtype=torch.float32, device=DEVICE)
    y = torch.ones(100, dtype=torch.float32, device=DEVICE)
    torch.testing.assert_close(axpy(launcher, x, y, 2.0), 2 * x + 1)
    if DEVICE.type == "cpu":
        assert launcher.num_compiled == 0  # nothing cached for the interpreter


def test_fast_path_is_refused_where_it_cannot_stand_in(monkeypatch):
    cuda_like = torch.empty(1, device="meta")  # not CUDA: refused like a CPU tensor
    assert not launch._fast_path_allowed((cuda_like,), True)
    assert not launch._fast_path_allowed((1, 2), True)  # no tensor at all
    monkeypatch.setattr(launch, "_is_cuda", lambda t: True)
    assert launch._fast_path_allowed((cuda_like,), True)
    # A profiler's hook must see every launch: a plain callable (older Triton) or a
    # non-empty HookChain turns the fast path off.
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert not launch._fast_path_allowed((cuda_like,), True)
    chain = knobs.HookChain()
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", chain)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert launch._fast_path_allowed((cuda_like,), True)
    chain.add(lambda *a: None)
    assert not launch._fast_path_allowed((cuda_like,), True)
    chain.calls.clear()
    assert launch._fast_path_allowed((cuda_like,), True)
    assert not launch._fast_path_allowed((cuda_like,), False), "the caller's policy says no"


@pytest.mark.gpu
def test_gpu_fast_path_matches_and_compiles_once_per_specialization():
    launcher = FastLauncher(axpy_kernel)
    x = torch.randn(1024, device="cuda")
    y = torch.randn(1024, device="cuda")
    for a in (2.0, 3.0, -1.5):  # the first call compiles, the others hit the cache
        assert torch.equal(axpy(launcher, x, y, a), plain(x, y, a))
    assert launcher.num_compiled == 1
    # n not divisible by 16 (1000), and a pointer off 16-byte alignment, are other
    # specializations: each gets its own compiled kernel, with the right result.
    assert torch.equal(axpy(launcher, x[:1000], y[:1000], 3.0), plain(x[:1000], y[:1000], 3.0))
    assert torch.equal(axpy(launcher, x[1:], y[1:], 3.0), plain(x[1:], y[1:], 3.0))
    assert launcher.num_compiled == 3
    assert torch.equal(axpy(launcher, x, y, 3.0, block=128), plain(x, y, 3.0, block=128))
    assert launcher.num_compiled == 4  # another constexpr


@pytest.mark.gpu
def test_gpu_fast_path_runs_on_the_current_stream():
    launcher = FastLauncher(axpy_kernel)
    x = torch.randn(1 << 20, device="cuda")
    y = torch.randn(1 << 20, device="cuda")
    axpy(launcher, x, y, 1.0)  # compile on the default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = axpy(launcher, x, y, 4.0)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, plain(x, y, 4.0))


@pytest.mark.gpu
def test_gpu_autotuned_launcher_uses_the_autotuners_pick():
    configs = [triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 256})]
    tuned = triton.autotune(configs=configs, key=["n"])(axpy_kernel)
    launcher = AutotunedLauncher(tuned)
    x = torch.randn(5000, device="cuda")
    y = torch.randn(5000, device="cuda")

    def run(a):
        out = torch.empty_like(x)
        launcher(("n", 5000), lambda meta: (triton.cdiv(5000, meta["BLOCK"]),),
                 x, y, out, a, 5000)
        return out

    assert torch.equal(run(2.0), plain(x, y, 2.0))  # tunes
    assert list(launcher.configs()) == [str(("n", 5000))]
    assert launcher.configs()[str(("n", 5000))] == str(tuned.best_config)
    assert torch.equal(run(-3.0), plain(x, y, -3.0))  # the cached pick
    assert launcher.launcher.num_compiled == 1


def test_bench_host_cli(capsys):
    """`python -m moe.bench.host` at a toy shape: a table of both launch modes, then JSON."""
    import json

    from moe.bench import host as bench_host

    if DEVICE.type == "cpu":  # 2 tokens: fewer tiles for the interpreter, the same table
        argv = ["--device", "cpu", "--shape", "tiny", "--tokens", "2", "--reps", "1"]
    else:
        argv = ["--shape", "tiny", "--tokens", "64", "--reps", "3"]
    assert bench_host.main(argv + ["--rounds", "2"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    record = json.loads(lines[-1])
    assert set(record["host_us"]) == {"fast", "triton"} and record["rounds"] == 2
    for mode, steps in record["host_us"].items():
        assert set(steps) == set(bench_host.STEPS) and all(us > 0 for us in steps.values())
        for step, us in steps.items():  # the median of its two rounds
            assert us == pytest.approx(sum(record["rounds_us"][mode][step]) / 2)
    # The modes alternate within each round (progress lines, in order).
    order = [line.split()[2] for line in captured.err.splitlines() if line.startswith("round")]
    assert order[:4] == ["fast", "triton", "fast", "triton"] and len(order) == 16
    assert any(line.startswith("fused_moe") for line in lines)


def test_host_cdiv_and_next_power_of_2_match_tritons() -> None:
    """The plain-Python grid helpers give Triton's answers (they replace its constexpr
    functions on the host, which cost a JIT call each)."""
    import triton

    from moe.kernels.launch import cdiv, next_power_of_2
    for n in range(0, 1100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
