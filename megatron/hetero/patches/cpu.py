"""Patches for a process without a GPU: megatron-core's hard-coded CUDA device mapped to the
CPU (megatron.hetero.cpu_device), in forward and in backward passes alike."""

from __future__ import annotations


def _no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def _apply_cpu_device() -> object:
    from megatron.hetero.cpu_device import enable_cpu_device

    return enable_cpu_device()


def _apply_cpu_device_in_backward() -> object:
    from torch.autograd.function import BackwardCFunction
    from torch.overrides import _get_current_function_mode_stack

    from megatron.hetero import cpu_device

    original = BackwardCFunction.apply

    def apply(self, *args):
        mode = cpu_device.active_mode()
        if mode is None or mode in _get_current_function_mode_stack():
            return original(self, *args)
        with mode:
            return original(self, *args)

    BackwardCFunction.apply = apply
    return apply
