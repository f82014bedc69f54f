"""Every change Megatron-Hetero makes to the installed megatron-core, in one place.

Run ``python -m megatron.hetero.patches`` to list them. Each patch is small, named, says
why it exists and which megatron-core releases it is written for (``versions``), and is
applied only by ``apply_patches`` after the version check (core_version.py).

What needs no patch, and why:
- the plan's rank order: the process that the plan puts at logical rank i joins the
  default process group as rank i (``megatron.hetero.distributed``), so megatron-core's
  own group construction already follows the plan;
- uneven stages: megatron-core's ``pipeline_model_parallel_layout`` takes any split;
- replicas with unequal micro-batch counts: each replica calls the 1F1B schedule with its
  own count and ``calculate_per_token_loss`` weights gradients by tokens globally.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable

from hetero.errors import HeteroError
from megatron.hetero.core_version import (
    ALLOW_UNTESTED_FLAG,
    TESTED_MEGATRON_CORE,
    check_megatron_core_version,
    patches_release,
)


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    needed: Callable[[], bool]
    apply: Callable[[], object]
    # The megatron-core releases (of TESTED_MEGATRON_CORE) it is written for and tested with;
    # under another tested release it is not applied.
    versions: tuple[str, ...]


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


def _torch_adam_fallback() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _fresh_adam_states(optimizer) -> None:
    """The per-parameter state torch's Adam/AdamW creates lazily at the first step."""
    import torch

    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _apply_distributed_optimizer_load() -> object:
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        if is_loading and not self.optimizer.state:
            # torch's Adam creates per-parameter state at its first step; give it some
            # (the way megatron-core does for its FSDP path), to be overwritten by the load.
            self._init_optimizer_states_with_dummy_values()
        elif not is_loading and not self.optimizer.state:
            # Saved before any step was taken (fp16 skips its first steps while the loss
            # scale comes down): megatron-core reads each state's "step". Give every
            # parameter the state torch's Adam would create at its first step (zeros,
            # step 0), so the saved and the continuing run are the ones without the save.
            _fresh_adam_states(self.optimizer)
        return original(self, model_sharded_state_dict or {}, is_loading=is_loading, **kwargs)

    copy_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        # A re-shardable checkpoint keeps torch Adam's "step" in the param groups (restored by
        # load_state_dict); copying per-parameter states must leave the live "step" alone.
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        live = self.optimizer.state[main_param]
        if "step" in live and "step" not in tensors:
            tensors = {**tensors, "step": live["step"]}
        return copy_states(self, model_param, tensors)

    load_state_dict = DistributedOptimizer.load_state_dict

    def load_state_dict_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        # It hands every parameter the same "step" tensor, which torch's Adam then increments
        # in place once per parameter: one tensor per parameter, as Adam keeps it.
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict_with_own_steps
    return sharded_state_dict


def _apply_reshardable_offsets() -> object:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_param_state_fully_reshardable

    def unpadded_index_map(buffer) -> dict:
        """param -> (start, end, bucket) in the gathered state's coordinates, which leave out
        the padding between buckets."""
        removed, shift = 0, []
        for bucket in buffer.buckets:
            shift.append(bucket.offset - removed)
            removed += bucket.numel_unpadded
        return {param: (start - shift[b], end - shift[b], b)
                for param, (start, end, b) in buffer.param_index_map.items()}

    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        padded = [buffer.param_index_map for buffer in self.buffers]
        try:
            for buffer in self.buffers:
                buffer.param_index_map = unpadded_index_map(buffer)
            return original(self, *args, **kwargs)
        finally:
            for buffer, index_map in zip(self.buffers, padded):
                buffer.param_index_map = index_map

    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable
    return sharded_param_state_fully_reshardable


def _server_dies_with_rank(rank_pid: int) -> None:
    """Runs first in the checkpoint Manager's server process: it goes when its rank goes.

    A Manager's server outlives a killed parent: the ranks of a lost node or a stopped
    attempt would each leave one behind, holding the rank's inherited signal handlers and
    ignoring SIGTERM."""
    import signal

    _die_with_parent(rank_pid)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _apply_checkpoint_queue_dies_with_rank() -> object:
    from multiprocessing.managers import SyncManager

    from torch import multiprocessing as mp
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # megatron-core 0.17+ names it get_write_results_queue(mp_mode="spawn") (0.16: _get_...).
    name = ("get_write_results_queue" if hasattr(filesystem_async, "get_write_results_queue")
            else "_get_write_results_queue")

    def write_results_queue(*args, **kwargs):
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=mp.get_context("fork" if _no_gpu() else "spawn"))
            manager.start(_server_dies_with_rank, (os.getpid(),))
            filesystem_async._results_queue = manager.Queue()
            filesystem_async._results_queue_manager = manager  # keeps the server alive
        return filesystem_async._results_queue

    setattr(filesystem_async, name, write_results_queue)
    return write_results_queue


def _die_with_parent(parent_pid: int) -> None:
    """PR_SET_PDEATHSIG: this forked helper gets SIGKILL when the thread that forked it ends
    (a rank's main thread: the rank); if the rank is already gone, it goes now."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


_writer_parent_pid: int | None = None  # set in the rank just before it forks its writers


def _checkpoint_writers_are_processes() -> bool:
    """megatron-core 0.16 forks a writer process per write bucket; 0.17+ writes with threads
    of the process that saves (write_preloaded_data_multithread), which go with it."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    return hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc")


def _apply_checkpoint_writers_die_with_rank() -> object:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    fork_writers = FileSystemWriterAsync.write_preloaded_data_multiproc
    write = FileSystemWriterAsync.write_preloaded_data

    @functools.wraps(fork_writers)
    def write_preloaded_data_multiproc(*args, **kwargs):
        global _writer_parent_pid
        _writer_parent_pid = os.getpid()  # the forked writers inherit it
        return fork_writers(*args, **kwargs)

    @functools.wraps(write)  # megatron-core reads its signature
    def write_preloaded_data(*args, **kwargs):
        if _writer_parent_pid is not None:
            _die_with_parent(_writer_parent_pid)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_preloaded_data_multiproc)
    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)
    return write_preloaded_data


def _moe_router_without_te() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def _apply_moe_router_without_te() -> object:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # the name its fallback branch tests for
    return moe_utils.te_general_gemm


def _torch_norm_lacks_zero_centered_gamma() -> bool:
    from megatron.core.transformer import torch_norm

    return torch_norm.WrappedTorchNorm is not None


def _apply_zero_centered_torch_norm() -> object:
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class ZeroCenteredNorm(torch.nn.Module):
        """LayerNorm / RMSNorm with the scale stored as gamma - 1 (zeros at start), as
        Megatron-LM's --apply-layernorm-1p: weight decay pulls gamma towards 1, not 0."""

        def __init__(self, normalization: str, hidden_size: int, eps: float):
            super().__init__()
            self.normalization, self.shape, self.eps = normalization, (hidden_size,), eps
            self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
            self.bias = (torch.nn.Parameter(torch.zeros(hidden_size))
                         if normalization == "LayerNorm" else None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.normalization == "LayerNorm":
                return F.layer_norm(x, self.shape, self.weight + 1, self.bias, self.eps)
            return F.rms_norm(x, self.shape, self.weight + 1, self.eps)

    original = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        if config.layernorm_zero_centered_gamma and config.normalization in ("LayerNorm", "RMSNorm"):
            return ZeroCenteredNorm(config.normalization, hidden_size, eps)
        return original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                        normalization)

    WrappedTorchNorm.__new__ = staticmethod(new)
    return new


def _torch_norm_in_use() -> bool:
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return gpt_layer_specs.LNImpl is WrappedTorchNorm


def _apply_sequence_parallel_torch_norm() -> object:
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        # A norm acts on each token alone, so a sequence shard is normalised as the whole
        # would be; what sequence parallelism needs is that the weights' gradients (from
        # each rank's shard) are summed over the tensor-parallel group, which
        # finalize_model_grads does for parameters marked sequence_parallel (as apex's and
        # transformer-engine's norms mark theirs).
        unsharded = copy.copy(config)  # no __post_init__: only the flag differs
        unsharded.sequence_parallel = False
        norm = original(cls, unsharded, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", True)
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)
    return __new__


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
    return not _no_gpu() and not _JIT_FUSER["disabled"]


def disable_jit_fuser() -> None:
    """--disable-jit-fuser, as Megatron-LM's megatron.core.jit.disable_jit_fuser: the fused
    functions run eagerly, those decorated while megatron-core was imported included (they
    are compiled at their first call, which then compiles nothing)."""
    import megatron.core.jit as jit

    _JIT_FUSER["disabled"] = True
    jit.disable_jit_fuser()


def _apply_schedule_trace() -> object:
    from megatron.hetero.tracing import wrap_schedule_functions

    return wrap_schedule_functions()


def _apply_plan_rank_generator() -> object:
    from megatron.core import parallel_state

    from megatron.hetero.stage_tensor_parallel import plan_rank_generator

    parallel_state.RankGenerator = plan_rank_generator(parallel_state.RankGenerator)
    return parallel_state.RankGenerator


def _apply_grad_stats_agree_across_templates() -> object:
    from megatron.core.optimizer import optimizer

    from megatron.hetero.template_reduction import agreed_across_templates

    optimizer.get_grad_norm_fp32 = agreed_across_templates(optimizer.get_grad_norm_fp32)
    optimizer.count_zeros_fp32 = agreed_across_templates(optimizer.count_zeros_fp32)
    return optimizer.get_grad_norm_fp32


def _apply_host_split_sizes() -> object:
    from megatron.core.transformer.moe import token_dispatcher

    from megatron.hetero.moe import host_split_sizes

    token_dispatcher.maybe_move_tensor_to_cpu = host_split_sizes(token_dispatcher.maybe_move_tensor_to_cpu)
    return token_dispatcher.maybe_move_tensor_to_cpu


def _apply_resharding_p2p() -> object:
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    from megatron.hetero.stage_tensor_parallel import resharding_communicator

    resharding = resharding_communicator(p2p_communication.P2PCommunicator)
    p2p_communication.P2PCommunicator = schedules.P2PCommunicator = resharding
    return resharding


def _apply_local_attention_context_parallel() -> object:
    from megatron.hetero.context_parallel import apply_local_attention_context_parallel

    return apply_local_attention_context_parallel()


def _apply_local_attention_separate_value_head() -> object:
    """DotProductAttention takes MLA's k_channels/v_channels (see the patch's why)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original_init = DotProductAttention.__init__

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args,
                 k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        original_init(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs)
        heads_per_partition = self.num_attention_heads_per_partition
        if k_channels is not None:
            # Only the default softmax scale reads it; MLA passes its own (yarn mscale included).
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            # The context [sq, b, np, v_channels] is flattened to this width after attention.
            self.hidden_size_per_partition = v_channels * heads_per_partition

    DotProductAttention.__init__ = __init__
    return __init__


def _apply_yarn_rope_on_cpu() -> object:
    """YarnRotaryEmbedding builds its tables on the CPU when there is no GPU (see the why)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    original_init = YarnRotaryEmbedding.__init__

    def __init__(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        original_init(self, *args, **kwargs)

    YarnRotaryEmbedding.__init__ = __init__
    return __init__


def _transformer_engine_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is None


def _apply_mla_knows_transformer_engine_missing() -> object:
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False
    return multi_latent_attention


class _HeldSend:
    """A pipeline send's Work, held until it is waited once (gloo's Work blocks on a second
    wait, and it reports itself completed only once waited)."""

    def __init__(self, work) -> None:
        self.work, self.waited = work, False

    def wait(self, *args, **kwargs):
        if self.waited:
            return True
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def _apply_overlapped_sends_kept() -> object:
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    # gloo cancels a send whose Work is freed before the receiver has posted its receive
    # (NCCL's sends live on in their stream), so every overlapped send is held until waited.
    in_flight: list[_HeldSend] = []
    p2p_ops = p2p_communication._p2p_ops

    def p2p_ops_holding_sends(*args, **kwargs):
        requests = p2p_ops(*args, **kwargs)
        in_flight[:] = [send for send in in_flight if not send.waited]
        for key in [key for key in requests if key.startswith("send")]:
            requests[key] = _HeldSend(requests[key])
            in_flight.append(requests[key])
        return requests

    interleaved = schedules.forward_backward_pipelining_with_interleaving

    @functools.wraps(interleaved)
    def interleaved_with_sends_finished(*args, **kwargs):
        result = interleaved(*args, **kwargs)
        # Its receivers post their receives within this same call: finishing the sends here
        # cannot wait on anything this rank has still to do.
        while in_flight:
            in_flight.pop(0).wait()
        return result

    p2p_communication._p2p_ops = p2p_ops_holding_sends
    schedules.forward_backward_pipelining_with_interleaving = interleaved_with_sends_finished
    return interleaved_with_sends_finished


def _apply_mtp_stage_without_output_weight() -> object:
    from megatron.core.models.gpt.gpt_model import GPTModel

    original = GPTModel.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        output = getattr(self, "output_layer", None)
        if (getattr(self, "mtp_process", False) and not self.pre_process and output is not None
                and self.share_embeddings_and_output_weights and output.weight is not None):
            output.weight = None  # the tied logits read the stage's copy of the word embeddings

    GPTModel.__init__ = __init__
    return __init__


def _apply_uneven_sequence_gather_on_gloo() -> object:
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        # Every rank's rows padded to the longest, gathered equal, the padding dropped.
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:rows] for piece, rows in zip(pieces, output_split_sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        # The same sums, all of them, then this rank's rows.
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start: start + input_split_sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
    return gather_along_first_dim



_SNAPSHOT = {"taking": False}


def snapshot_in_progress():
    """A context in which the distributed optimizer's sharded state dict is built for an
    in-memory snapshot (restart.py): patch ``optimizer-state-for-snapshots``."""
    import contextlib

    @contextlib.contextmanager
    def taking():
        _SNAPSHOT["taking"] = True
        try:
            yield
        finally:
            _SNAPSHOT["taking"] = False

    return taking()


def _apply_optimizer_state_for_snapshots() -> object:
    import gc

    from megatron.core.optimizer import distrib_optimizer

    class _Collector:
        """distrib_optimizer's ``gc``: its full collection, but a young one while a snapshot
        is taken (every iteration: a full one costs ~0.2 s with megatron-core loaded)."""

        def __getattr__(self, name):
            return getattr(gc, name)

        @staticmethod
        def collect(generation: int = 2) -> int:
            return gc.collect(0 if _SNAPSHOT["taking"] else generation)

    distrib_optimizer.gc = _Collector()
    return distrib_optimizer.gc


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cuda-as-cpu",
        why=(
            "megatron-core hard-codes the CUDA device (~130 sites in schedules, p2p, DDP, "
            "optimizer, RNG tracker); on a process without a GPU, 'cuda' is mapped to the CPU"
        ),
        needed=_no_gpu,
        apply=_apply_cpu_device,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="cuda-as-cpu-in-backward",
        why=(
            "the autograd engine runs custom backward functions without the caller's torch "
            "function modes, so megatron-core's backward passes that allocate on "
            "torch.cuda.current_device() (sequence parallelism's reduce-scatter, recomputation's "
            "re-run forward) escaped the cuda-as-cpu mapping; it is entered again around them"
        ),
        needed=_no_gpu,
        apply=_apply_cpu_device_in_backward,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="distributed-optimizer-load-without-apex",
        why=(
            "without apex/transformer-engine the distributed optimizer wraps torch's Adam, and "
            "loading a re-shardable checkpoint goes wrong three ways: Adam has no per-parameter "
            "state before its first step (filled first, as megatron-core does for FSDP); the "
            "per-parameter copy expects a 'step' the format keeps in the param groups; and the "
            "restored 'step' is one tensor shared by all parameters, which Adam increments once "
            "per parameter (each gets its own). Saving before Adam's first step (fp16 skips "
            "its first steps while the loss scale comes down) fails megatron-core's read of "
            "each state's 'step': the states Adam would create (zeros, step 0) are filled first"
        ),
        needed=_torch_adam_fallback,
        apply=_apply_distributed_optimizer_load,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="distributed-optimizer-reshardable-offsets",
        why=(
            "the distributed optimizer's re-shardable checkpoint gathers each buffer's state "
            "without the padding between buckets, then slices it with offsets that include "
            "it: every parameter past the first bucket (any model above the 40M-parameter "
            "bucket size, or a tied embedding split across stages) is saved and restored from "
            "the wrong place; the slicing is given the gathered layout's offsets"
        ),
        needed=lambda: True,
        apply=_apply_reshardable_offsets,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="checkpoint-results-queue-dies-with-rank",
        why=(
            "megatron-core's checkpoint writer collects its results through a multiprocessing "
            "Manager, whose server process outlives a killed rank (a lost node, a stopped "
            "attempt) and ignores SIGTERM: the job would leave processes behind. The server is "
            "started to die with its rank. Without a GPU it is also forked instead of spawned "
            "(a new interpreter importing torch: ~10 s of the first save on 2 cores)"
        ),
        needed=lambda: True,
        apply=_apply_checkpoint_queue_dies_with_rank,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="checkpoint-writers-die-with-rank",
        why=(
            "megatron-core forks one writer process per checkpoint write bucket; a rank stopped "
            "mid-save (a lost peer, SIGTERM) left its writers blocked forever on the results "
            "queue's lock, holding the rank's memory (seen after the fault tests). Each writer "
            "now gets SIGKILL when its rank ends (PR_SET_PDEATHSIG), or exits if it already has. "
            "Not needed from megatron-core 0.17 on, whose writers are threads"
        ),
        needed=_checkpoint_writers_are_processes,
        apply=_apply_checkpoint_writers_die_with_rank,
        versions=("0.16.1",),
    ),
    Patch(
        name="moe-router-without-te",
        why=(
            "the MoE router's gating GEMM tests `te_general_gemm is not None`, a name megatron-core "
            "only defines when transformer-engine imports; without it every MoE forward raises "
            "NameError. The name is defined as None, which selects megatron-core's own torch.mm path"
        ),
        needed=_moe_router_without_te,
        apply=_apply_moe_router_without_te,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="zero-centered-gamma-torch-norm",
        why=(
            "--apply-layernorm-1p (layernorm_zero_centered_gamma) exists in megatron-core only "
            "in transformer-engine's and apex's norms; its torch fallback (WrappedTorchNorm, used "
            "on the CPU and without apex) asserts. With it set, the fallback builds the same "
            "LayerNorm/RMSNorm with its scale stored as gamma - 1"
        ),
        needed=_torch_norm_lacks_zero_centered_gamma,
        apply=_apply_zero_centered_torch_norm,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="sequence-parallel-torch-norm",
        why=(
            "without apex/transformer-engine megatron-core's local layers use torch's norms, "
            "whose wrapper refuses --sequence-parallel only because it does not mark its "
            "weights for the tensor-parallel gradient sum; the norm is built as usual and its "
            "weights marked sequence_parallel, as apex's FusedLayerNorm and TE's norms do"
        ),
        needed=_torch_norm_in_use,
        apply=_apply_sequence_parallel_torch_norm,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="jit-fusions-compiled-on-first-call",
        why=(
            "megatron-core's fused helpers (bias-GeLU/SwiGLU, RMSNorm, cross-entropy, ...) are "
            "torch.compile'd by decorators run at import, which imports TorchDynamo and "
            "Inductor into every process (~2 s and ~60 MB on 2 cores) before any of them runs. "
            "Applied while megatron.hetero imports megatron-core: each is compiled at its first "
            "call instead; without a GPU it runs eagerly (the same arithmetic: compiling it to "
            "C++ took ~2 minutes of the first iteration on 2 cores for no kernel a CPU lacks)"
        ),
        needed=lambda: True,
        apply=_apply_jit_fusions_compiled_on_first_call,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="schedule-step-timing",
        why=(
            "times each forward and backward micro-batch step of the pipeline schedule (two "
            "clock reads a step): the measured iteration timeline (tracing.py) and the stage "
            "times --hetero-adapt balances"
        ),
        needed=lambda: True,
        apply=_apply_schedule_trace,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="parallel-state-groups-from-per-stage-grid",
        why=(
            "megatron-core builds every process group from one TP x DP x PP grid; a plan whose "
            "stages differ in tensor-parallel degree has none. RankGenerator.get_ranks answers "
            "from the plan's grid instead (stage_tensor_parallel.rank_groups), so "
            "initialize_model_parallel builds the TP, DP, pipeline, model-parallel and embedding "
            "groups of each stage itself; under several replica templates, each template's groups "
            "side by side. Inert unless such a plan is installed"
        ),
        needed=lambda: True,
        apply=_apply_plan_rank_generator,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="p2p-reshards-between-stage-degrees",
        why=(
            "megatron-core's P2PCommunicator sends a stage's whole activation to one rank of the "
            "next stage; between stages of different tensor-parallel degree each receiving rank "
            "needs its own slice (sequence parallel) or a copy from one sending rank. Its "
            "_communicate moves those pieces under a per-stage plan (stage_tensor_parallel.py), "
            "and is megatron-core's own otherwise"
        ),
        needed=lambda: True,
        apply=_apply_resharding_p2p,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="grad-stats-agree-across-templates",
        why=(
            "under a plan of several replica templates each template's optimizer computes the "
            "gradient norm (and zero count) over its own ranks: the same sum in another order, "
            "which may round differently, so the templates would clip by different factors and "
            "their copies of the weights drift apart. The value template 0 computes is given to "
            "every rank (template_reduction.agreed_across_templates). Inert under one template"
        ),
        needed=lambda: True,
        apply=_apply_grad_stats_agree_across_templates,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="alltoall-split-sizes-on-cpu",
        why=(
            "the alltoall token dispatcher of expert parallelism turns its per-rank split sizes "
            "into host numbers only when they live on a GPU; on the CPU they stayed tensors, "
            "which torch's all_to_all_single refuses. They are converted on the CPU as well"
        ),
        needed=_no_gpu,
        apply=_apply_host_split_sizes,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="overlapped-pipeline-sends-finished",
        why=(
            "the interleaved schedule with --overlap-p2p-communication-warmup-flush leaves the "
            "last forward send of a forward-only pass (evaluation) unwaited and drops its "
            "handle; NCCL still delivers it, but gloo (CPU processes) cancels a send whose "
            "handle is freed before the receiver posts its receive, and the next stage waited "
            "forever. Overlapped pipeline sends are held until done and finished before the "
            "schedule returns"
        ),
        needed=_no_gpu,
        apply=_apply_overlapped_sends_kept,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="local-attention-separate-value-head",
        why=(
            "multi-latent attention (--multi-latent-attention) builds its core attention with a "
            "key head size (qk_head_dim + qk_pos_emb_head_dim) different from its value head size "
            "(v_head_dim), which transformer-engine's attention takes and megatron-core's local "
            "DotProductAttention refused (no k_channels/v_channels arguments; its output width "
            "is kv_channels x heads). The local class takes both: scores Q K^T use the key size "
            "under MLA's own softmax scale, and the output is heads x v_head_dim wide. Inert "
            "when neither is given"
        ),
        needed=lambda: True,
        apply=_apply_local_attention_separate_value_head,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="yarn-rope-tables-on-cpu",
        why=(
            "multi-latent attention builds its YarnRotaryEmbedding (--rope-type yarn, MLA's "
            "default) without the config's use_cpu_initialization, so it opens "
            "torch.device(torch.cuda.current_device()), which fails without a GPU. Without one "
            "the tables are built on the CPU, where every tensor lives anyway"
        ),
        needed=_no_gpu,
        apply=_apply_yarn_rope_on_cpu,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="mla-knows-transformer-engine-missing",
        why=(
            "megatron-core's multi_latent_attention imports its transformer-engine classes "
            "through megatron-core's extensions module, which without transformer-engine "
            "hands back placeholder objects instead of failing; MLA then believes "
            "transformer-engine present (HAVE_TE) and isinstance() against the placeholder "
            "TELinear raises while building every MLA layer. Without transformer-engine its "
            "HAVE_TE says so"
        ),
        needed=_transformer_engine_missing,
        apply=_apply_mla_knows_transformer_engine_missing,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="uneven-sequence-gather-on-gloo",
        why=(
            "with expert tensor parallelism (--expert-tensor-parallel-size > 1) the all-to-all "
            "dispatcher gathers each expert tensor rank's routed tokens, a different count on "
            "each, with torch.distributed.all_gather of unequal tensors (and reduce-scatters them "
            "back unequally); NCCL takes that, gloo (CPU processes) refuses unequal sizes, and the "
            "run crashed. Without a GPU the rows are padded to the longest, gathered, and the "
            "padding dropped; the way back all-reduces the whole tensor and keeps this rank's rows "
            "(the same sums)"
        ),
        needed=_no_gpu,
        apply=_apply_uneven_sequence_gather_on_gloo,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="mtp-stage-without-output-weight",
        why=(
            "with tied embeddings, a pipeline stage that runs multi-token-prediction layers but "
            "not the embedding (the last one) computes its logits, the main loss's and the MTP "
            "layers', with its copy of the word embeddings, kept in step with the first stage's; "
            "megatron-core still allocates an output-layer weight there, which nothing reads. "
            "It is counted in the params norm (one process has no such weight) and breaks the "
            "checkpoint (megatron-core's sharded_state_dict asserts the stage has no output "
            "weight). The stage's output layer gets no weight of its own, as megatron-core's "
            "comments describe"
        ),
        needed=lambda: True,
        apply=_apply_mtp_stage_without_output_weight,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="local-attention-context-parallel",
        why=(
            "megatron-core's local DotProductAttention asserts --context-parallel-size 1 (its "
            "context parallelism lives in transformer-engine's attention only). Each layer of a "
            "CP > 1 run all-gathers the keys and values over the context-parallel group (gradients "
            "reduce-scattered back), puts them in sequence order and masks them causally by the "
            "true positions of this rank's load-balanced chunks (context_parallel.py): exactly "
            "full attention. Inert at CP 1"
        ),
        needed=lambda: True,
        apply=_apply_local_attention_context_parallel,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="optimizer-state-for-snapshots",
        why=(
            "the distributed optimizer's fully reshardable state dict ends with a full garbage "
            "collection (for runs with the collector disabled), ~0.2 s with megatron-core loaded: "
            "most of an in-memory snapshot's cost when one is taken every iteration "
            "(--inprocess-restart). While a snapshot is taken it collects the youngest generation "
            "only; checkpoints keep the full collection"
        ),
        needed=lambda: True,
        apply=_apply_optimizer_state_for_snapshots,
        versions=("0.16.1", "0.19.2"),
    ),
)

_applied: list[str] = []


def patches_for(version: str) -> tuple[Patch, ...]:
    """The patches written for ``version``'s tested release (core_version.patches_release)."""
    release = patches_release(version)
    return tuple(patch for patch in PATCHES if release in patch.versions)


def apply_patches(allow_untested: bool = False) -> list[str]:
    """Checks the installed megatron-core's release (core_version), then applies the patches
    written for it that this process needs, once; returns their names. ``allow_untested``:
    the user's --hetero-allow-untested-megatron-core."""
    if not _applied:
        import_megatron_core()  # the version check imports it: its compiles deferred first
        version = check_megatron_core_version(allow_untested)
        for patch in patches_for(version):
            if not patch.needed():
                continue
            try:
                patch.apply()
            except (AttributeError, ImportError) as err:  # what it replaces moved or is gone
                raise HeteroError(
                    f"the patch {patch.name} does not apply to megatron-core {version} ({err}); it is "
                    f"written for megatron-core {', '.join(patch.versions)}: install one of those"
                ) from err
            _applied.append(patch.name)
    return list(_applied)


def describe(allow_untested: bool = False) -> str:
    import_megatron_core()
    version = check_megatron_core_version(allow_untested)
    mine = patches_for(version)
    lines = [f"megatron-core {version} (tested: {', '.join(TESTED_MEGATRON_CORE)}): patches applied by "
             "megatron.hetero.patches.apply_patches()"]
    for patch in PATCHES:
        if patch not in mine:
            state = f"for megatron-core {', '.join(patch.versions)} only"
        else:
            state = "applies here" if patch.needed() else "not needed here"
        lines.append(f"- {patch.name} ({state}): {patch.why}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe(allow_untested=ALLOW_UNTESTED_FLAG in sys.argv[1:]))
