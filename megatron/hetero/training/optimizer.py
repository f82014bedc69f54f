"""The optimizer and its learning-rate and weight-decay schedule, from Megatron-LM's flags."""

from __future__ import annotations

import argparse

import torch

from hetero.plan import Plan
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.timers import Timers
from megatron.hetero.arguments import config_from_flags


def build_optimizer(
    args: argparse.Namespace, plan: Plan, model_chunks: list, params_dtype: torch.dtype,
    timers: Timers | None = None
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    optimizer = get_megatron_optimizer(
        config_from_flags(  # every honoured OptimizerConfig flag, as Megatron-LM; these win
            OptimizerConfig, args,
            optimizer=args.optimizer,
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            fp16=args.fp16,
            bf16=args.bf16,
            params_dtype=params_dtype,
            loss_scale=args.loss_scale,
            initial_loss_scale=args.initial_loss_scale,
            min_loss_scale=args.min_loss_scale,
            loss_scale_window=args.loss_scale_window,
            hysteresis=args.hysteresis,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            sgd_momentum=args.sgd_momentum,
            use_distributed_optimizer=args.use_distributed_optimizer,
            clip_grad=args.clip_grad,
            log_num_zeros_in_grad=args.log_num_zeros_in_grad,
            decoupled_lr=args.decoupled_lr,
            decoupled_min_lr=args.decoupled_min_lr,
            timers=timers,
        ),
        model_chunks,
        # --dump-param-to-param-group-map: megatron-core writes each parameter's group there.
        dump_param_to_param_group_map=args.dump_param_to_param_group_map,
    )
    return optimizer, build_scheduler(args, plan, optimizer)


def scheduler_steps(args: argparse.Namespace, global_batch_size: int) -> dict:
    """Megatron-LM's schedule lengths, in samples: from --*-iters times the global batch, or
    the --*-samples flags as given."""
    if args.train_samples is None:
        decay = (args.lr_decay_iters or args.train_iters) * global_batch_size
        warmup = args.lr_warmup_iters * global_batch_size
        wsd = args.lr_wsd_decay_iters * global_batch_size if args.lr_wsd_decay_iters else None
        wd_incr = args.train_iters * global_batch_size
    else:
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_samples
        wsd = args.lr_wsd_decay_samples
        wd_incr = args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wsd_decay_steps": wsd,
            "wd_incr_steps": wd_incr}


def build_scheduler(args: argparse.Namespace, plan: Plan, optimizer) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_style=args.weight_decay_incr_style,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        # With --use-checkpoint-opt_param-scheduler Megatron-LM resumes the checkpoint's
        # schedule; without it, it stops on an assertion when the flags' schedule differs.
        # Here the checkpoint's schedule is resumed in both cases (no traceback), unless
        # --override-opt_param-scheduler: then the flags' schedule wins, as in Megatron-LM.
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        **scheduler_steps(args, plan.global_batch_size),
    )
