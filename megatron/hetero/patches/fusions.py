"""megatron-core's JIT-fused helpers: imported with their torch.compile deferred to the first
call (patch jit-fusions-compiled-on-first-call), eager without a GPU or under
--disable-jit-fuser."""

from __future__ import annotations

import functools
import sys


def import_megatron_core() -> None:
    """Imports megatron-core with its import-time torch.compile calls deferred.

    The import-time half of patch jit-fusions-compiled-on-first-call. Every module of ours
    that imports megatron-core at its top calls it first, and so does ``apply_patches``;
    importing the megatron.hetero package itself imports nothing of megatron-core.
    """
    if "megatron.core" in sys.modules:
        return
    import torch

    compile_now = torch.compile

    def compile_on_first_call(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return functools.partial(compile_on_first_call, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options) if compiles_fusions() else model
            return compiled(*args, **kwargs)

        return call

    torch.compile = compile_on_first_call
    try:
        import megatron.core  # noqa: F401  (its package import runs every jit_fuser decorator)
        import megatron.core.jit  # noqa: F401
    finally:
        torch.compile = compile_now


def _apply_jit_fusions_compiled_on_first_call() -> object:
    import torch

    import megatron.core.jit as jit

    # Modules megatron-core imports later read jit_fuser at their import: they get the
    # same treatment (eager without a GPU, torch.compile with one).
    jit.jit_fuser = torch.compile if compiles_fusions() else jit.noop_decorator
    return jit.jit_fuser


_JIT_FUSER = {"disabled": False}


def compiles_fusions() -> bool:
    """Whether megatron-core's JIT-fused functions are compiled: on a GPU, unless
    --disable-jit-fuser."""
    from megatron.hetero import patches  # its _no_gpu, which a test replaces to stand in a GPU

    return not patches._no_gpu() and not _JIT_FUSER["disabled"]


def disable_jit_fuser() -> None:
    """--disable-jit-fuser, as Megatron-LM's megatron.core.jit.disable_jit_fuser: the fused
    functions run eagerly, those decorated while megatron-core was imported included (they
    are compiled at their first call, which then compiles nothing)."""
    import megatron.core.jit as jit

    _JIT_FUSER["disabled"] = True
    jit.disable_jit_fuser()
