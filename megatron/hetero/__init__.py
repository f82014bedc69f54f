"""Megatron-Hetero's runtime: executes a plan with the installed megatron-core.

Entry point: ``pretrain.main`` (called by pretrain_gpt.py); the start-up it runs, from the
command line to the built model, is ``startup``. Every change made to megatron-core itself is
in ``patches``. This package is ``megatron.hetero`` inside the ``megatron`` namespace that
megatron-core also uses; there is no megatron/__init__.py.

Importing this package does nothing else: megatron-core is imported (its import-time
torch.compile calls deferred: ``patches.import_megatron_core``) by the modules that need it,
and patched only when the runtime starts (``startup.start_megatron_core``). Import the
submodules explicitly.
"""
