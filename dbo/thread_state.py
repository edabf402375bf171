"""Per-thread PyTorch state that every greenlet of a thread shares, switched per ubatch.

PyTorch keeps much of its mode state per OS thread, so a ubatch that enters
`torch.inference_mode()` or `torch.device("meta")` and yields inside it would hand that
state to the other ubatch, and the caller would get it back after the step. The
scheduler therefore reads a cheap snapshot of this state on every hand-off, stores it on
the ubatch leaving, and re-applies the resumed ubatch's snapshot, calling into PyTorch
for more than the reads only when something differs.

Switched per ubatch (and restored for the caller when `run` returns or raises):
- grad mode (`torch.is_grad_enabled`);
- inference mode (`torch.is_inference_mode_enabled`). PyTorch can set it only through the
  `torch._C._InferenceMode` guard, which also rewrites grad mode, forward-AD grad mode,
  autograd multithreading, view replay and the autograd keys of the thread's dispatch
  key set, and puts them all back when the guard exits. `ThreadStateSwitch` holds the
  guards of one step; the first, taken when the step starts, restores the caller's
  autograd state and dispatch key set exactly when the step ends;
- autocast of the scheduler's device type and of CPU: enabled, dtype, and the (per
  thread, not per device) weight-cache flag;
- the torch-function mode stack, where `with torch.device(...)`, `set_default_device`
  and user `TorchFunctionMode`s live;
- the torch-dispatch mode stack (user `TorchDispatchMode`s, fake/proxy/functional modes);
- the current CUDA device (`torch.cuda.set_device`, `with torch.cuda.device(i)`), for a
  scheduler on a CUDA device.
The current CUDA stream is switched by the scheduler itself (`streams.CurrentStream`,
each ubatch's stream), and restored unconditionally when the step ends.

Checked and deliberately not switched:
- saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, `save_on_cpu`,
  non-reentrant checkpointing): PyTorch exposes only the top of the stack (a tuple
  built per read, about two of the reads above on every hand-off), and they matter only
  when training through a yield. A yield inside such a region hands the hooks to the
  other ubatch;
- the disabled-torch-function state (`torch._C.DisableTorchFunction*`): torch enters it
  around its own internals, never across a model's yield;
- the pre-dispatch mode stack and functorch's transform stack (export and `torch.func`
  tracing, which do not run a DBO step);
- forward-AD dual levels: process-global in PyTorch, not per thread;
- the autocast nesting counter (`torch.autocast_increment_nesting`): it only decides
  when the autocast cache is cleared;
- `torch.utils._device.CURRENT_DEVICE`: a process global that only dynamo's guards read.
Dispatch-key bits other than autocast, autograd and Python follow whichever guard last
set them: exact for the caller, approximate inside the step.

A snapshot (`ThreadState`) is a plain tuple, built on every hand-off (a dataclass would
cost ~1 us more each time):
    (grad, inference, autocast, function_modes, dispatch_modes, cuda_device)
Each of the last four is a falsy int in the common case (autocast off, empty stacks, not
on CUDA) and is read in full only when its cheap test says there is something to read:
autocast a tuple `(cache_enabled, (enabled, dtype) per device type)`, a stack its one
mode or a tuple of modes, the device an index.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

ThreadState = tuple[bool, bool, Any, Any, Any, int]

_C = torch._C
is_grad_enabled = torch.is_grad_enabled
is_inference_mode_enabled = torch.is_inference_mode_enabled
len_function_modes = _C._len_torch_function_stack
function_mode_at = _C._get_function_stack_at
len_dispatch_modes = _C._len_torch_dispatch_stack
# One call, no argument to parse: the cheap test for the usual case (no autocast).
is_any_autocast_enabled: Callable[[], bool] = getattr(
    _C, "_is_any_autocast_enabled", lambda: True)
cuda_current_device: Callable[[], int] = getattr(_C, "_cuda_getDevice", lambda: 0)


def autocast_device_types(device_type: str) -> tuple[str, ...]:
    """The device types whose autocast state a scheduler on `device_type` switches."""
    return ("cpu",) if device_type == "cpu" else (device_type, "cpu")


def read_autocast(device_types: tuple[str, ...]) -> tuple:
    """`(cache_enabled, (enabled, dtype) per device type)`, read only while autocast is on."""
    return (torch.is_autocast_cache_enabled(),
            tuple((torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                  for t in device_types))


def read_function_modes() -> Any:
    """The torch-function mode stack: its one mode (`torch.device(...)`, the usual case)
    or a tuple of modes, bottom first."""
    n = len_function_modes()
    return function_mode_at(0) if n == 1 else tuple(function_mode_at(i) for i in range(n))


def read_dispatch_modes() -> tuple:
    """The torch-dispatch mode stack, bottom first."""
    return tuple(_C._get_dispatch_stack_at(i) for i in range(len_dispatch_modes()))


class ThreadStateSwitch:
    """Switches the thread's state between the ubatches of one step, and gives the
    caller its state back at the end (`restore_caller`).

    PyTorch sets inference mode only through `torch._C._InferenceMode` guards. A guard
    records the thread's autograd state and dispatch key set when created and force-sets
    them back when it exits, whatever happened in between. The first guard is taken
    here, before any ubatch runs, so exiting every guard, newest first, gives the caller
    exactly its own autograd state and key set back.

    Args:
        device_type: the scheduler's device type (its autocast state and CPU's are switched).
        is_cuda: whether the current CUDA device is switched.
    """

    __slots__ = ("device_types", "is_cuda", "caller", "_guards")

    def __init__(self, device_type: str, *, is_cuda: bool) -> None:
        self.device_types = autocast_device_types(device_type)
        self.is_cuda = is_cuda
        self.caller = self.capture()
        grad, inference = self.caller[0], self.caller[1]
        fw_grad = _C._is_fwd_grad_enabled()
        multithreading = _C._is_multithreading_enabled()
        view_replay = _C._is_view_replay_enabled()
        # (guard, the inference flag its exit restores)
        self._guards: list[tuple[Any, bool]] = [(_C._InferenceMode(inference), inference)]
        # The guard keeps the flag but resets these; put the caller's values back.
        _set_autograd_flags(grad, fw_grad, multithreading, view_replay)

    def capture(self) -> ThreadState:
        """The thread's state now (the scheduler inlines the same expression)."""
        return (is_grad_enabled(), is_inference_mode_enabled(),
                is_any_autocast_enabled() and read_autocast(self.device_types),
                len_function_modes() and read_function_modes(),
                len_dispatch_modes() and read_dispatch_modes(),
                cuda_current_device() if self.is_cuda else 0)

    def apply(self, state: ThreadState, now: ThreadState) -> None:
        """Make `state` the thread's state, given that `now` is the state now."""
        if state[1] != now[1]:
            self._set_inference(state[1])
            # The guard rewrote grad mode and the key set (autocast and Python keys).
            _sync_python_keys()
            now = self.capture()
        if state[0] != now[0]:
            torch.set_grad_enabled(state[0])
        if state[2] != now[2]:
            _apply_autocast(state[2], self.device_types)
        if state[3] != now[3]:
            _set_function_modes(state[3])
        if state[4] != now[4]:
            _set_dispatch_modes(state[4])
        if state[5] != now[5]:
            torch.cuda.set_device(state[5])

    def restore_caller(self) -> None:
        """Give the caller its state back exactly (after the step, also after a failure)."""
        guards = self._guards
        while guards:
            guards.pop()[0].__exit__(None, None, None)
        now = self.capture()
        if now != self.caller:
            self.apply(self.caller, now)

    def _set_inference(self, enabled: bool) -> None:
        """Switch inference mode to `enabled` (it is `not enabled` now).

        Exits the newest guard if its exit restores `enabled` (the usual back-and-forth
        between two ubatches), so the list stays short; never the caller's guard mid-step.
        """
        guards = self._guards
        if len(guards) > 1 and guards[-1][1] == enabled:
            guards.pop()[0].__exit__(None, None, None)
        else:
            guards.append((_C._InferenceMode(enabled), not enabled))


def _set_autograd_flags(grad: bool, fw_grad: bool, multithreading: bool,
                        view_replay: bool) -> None:
    if is_grad_enabled() != grad:
        torch.set_grad_enabled(grad)
    if _C._is_fwd_grad_enabled() != fw_grad:
        _C._set_fwd_grad_enabled(fw_grad)
    if _C._is_multithreading_enabled() != multithreading:
        _C._set_multithreading_enabled(multithreading)
    if _C._is_view_replay_enabled() != view_replay:
        _C._set_view_replay_enabled(view_replay)


def _apply_autocast(autocast: Any, device_types: tuple[str, ...]) -> None:
    if not autocast:  # off everywhere we switch; dtype and cache matter only when on
        for t in device_types:
            torch.set_autocast_enabled(t, False)
        return
    cache_enabled, per_type = autocast
    torch.set_autocast_cache_enabled(cache_enabled)
    for t, (enabled, dtype) in zip(device_types, per_type):
        torch.set_autocast_enabled(t, enabled)
        torch.set_autocast_dtype(t, dtype)


def _as_modes(part: Any) -> tuple:
    if not part:
        return ()
    return part if type(part) is tuple else (part,)


def _set_function_modes(part: Any) -> None:
    for _ in range(len_function_modes()):
        _C._pop_torch_function_stack()
    for mode in _as_modes(part):
        _C._push_on_torch_function_stack(mode)


def _set_dispatch_modes(part: Any) -> None:
    # Pushing and popping keep the Python dispatch keys in step with the stack.
    for _ in range(len_dispatch_modes()):
        _C._pop_torch_dispatch_stack(None)
    for mode in _as_modes(part):
        _C._push_on_torch_dispatch_stack(mode)


def _sync_python_keys() -> None:
    """After a guard force-set the dispatch key set: the Python keys must say whether
    the dispatch mode stack (which no guard touches) is empty."""
    on = len_dispatch_modes() > 0
    for key in (_C.DispatchKey.Python, _C.DispatchKey.PythonTLSSnapshot):
        if _C._dispatch_tls_is_dispatch_key_included(key) != on:
            _C._dispatch_tls_set_dispatch_key_included(key, on)
