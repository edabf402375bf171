"""Launch Triton kernels through their compiled handles, skipping most of the per-call
Python work of `kernel[grid](...)`.

`kernel[grid](...)` repeats identical work on every call (option parsing, a string cache
key, checking globals, launch metadata, the autotuner's key and dicts) beside binding
the arguments and the launch itself. In a DBO step that host time is on the critical
path: the GPU waits for the host where one ubatch's experts start (figures in
`moe/kernels/fused_moe/KERNELS.md`).

`FastLauncher(kernel)(grid, *args, **kwargs)` binds the arguments with Triton's own
binder (so the specialization — dtypes, 16-byte alignment, integers equal to 1 or
divisible by 16, constexpr values — is exactly Triton's), keys its own cache on that
specialization, and launches the compiled kernel found there. The first call for a
specialization goes through `kernel[grid](...)`, which compiles (or finds) the kernel
and launches it. `AutotunedLauncher` keeps the autotuner's pick per tuning key and
launches it the same way; a key it has not seen goes through the autotuner once.

The plain `kernel[grid](...)` path is used instead where the fast one cannot stand in:
on CPU tensors (the interpreter), when a Triton launch hook is installed (a profiler
such as Proton), and where the caller passes `compiled=False`
(`KernelPolicy.compiled_launches`: `moe.bench.host` compares the two).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import torch
from triton import knobs
from triton.runtime import driver

Grid = Sequence[int]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, on the host. `triton.cdiv` is a constexpr function in recent
    Triton: called outside a kernel it goes through Triton's JIT call machinery, about
    2-3 us a call against 0.03 us here, on every launch's grid."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for 0), on the host: `triton.next_power_of_2`
    without its JIT call cost (`cdiv`)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


class FastLauncher:
    """Launches one `@triton.jit` kernel; see the module doc.

    Args:
        kernel: the `triton.jit` function (not an autotuner).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[Hashable, Any] = {}

    def __call__(self, grid: Grid, *args: Any, compiled: bool = True, **kwargs: Any) -> None:
        """`kernel[grid](*args, **kwargs)` on the current stream (`compiled`: through the
        compiled handle where allowed)."""
        if not _fast_path_allowed(args, compiled):
            self.kernel[grid](*args, **kwargs)
            return
        self.launch_compiled(grid, *args, **kwargs)

    def launch_compiled(self, grid: Grid, *args: Any, **kwargs: Any) -> None:
        """The fast path alone, for callers that have checked `_fast_path_allowed`."""
        device = torch.cuda.current_device()
        binder = self.kernel.device_caches[device][4]
        bound, specialization, options = binder(*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            self._compiled[key] = compiled
            return
        grid = tuple(grid) + (1, 1)
        stream = _current_stream(device)
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *bound.values())

    @property
    def num_compiled(self) -> int:
        """Specializations launched so far through the compiled-handle cache."""
        return len(self._compiled)


class AutotunedLauncher:
    """Launches a `triton.autotune`d kernel with the config the autotuner picked for the
    caller's tuning key (`tune_key`, which must determine the autotuner's own key).

    Args:
        autotuner: the `triton.autotune(...)(kernel)` object.
    """

    def __init__(self, autotuner: Any) -> None:
        self.autotuner = autotuner
        self.launcher = FastLauncher(autotuner.fn)
        self._configs: dict[Hashable, Any] = {}

    def __call__(self, tune_key: Hashable, grid: Callable[[dict[str, Any]], Grid], *args: Any,
                 compiled: bool = True, **kwargs: Any) -> None:
        """Launch with the tuned config; `grid(meta)` maps the config's kwargs to a grid
        (`compiled`: through the compiled handle where allowed)."""
        fast = _fast_path_allowed(args, compiled)
        config = self._configs.get(tune_key) if fast else None
        if config is None:
            self.autotuner[grid](*args, **kwargs)
            if fast:
                self._configs[tune_key] = self.autotuner.best_config
            return
        meta = config.all_kwargs()
        self.launcher.launch_compiled(grid(meta), *args, **kwargs, **meta)

    def configs(self) -> dict[str, str]:
        """tuning key -> the config launched for it."""
        return {str(key): str(config) for key, config in self._configs.items()}


def _fast_path_allowed(args: Sequence[Any], compiled: bool) -> bool:
    if not compiled:
        return False
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or not _is_cuda(first):
        return False
    return _unhooked(knobs.runtime.launch_enter_hook) and _unhooked(knobs.runtime.launch_exit_hook)


def _unhooked(hook: Any) -> bool:
    """No launch hook installed: None, or an empty `HookChain` (Triton >= 3.5 keeps one)."""
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


def _is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _current_stream(device: int) -> int:
    return driver.active.get_current_stream(device)
