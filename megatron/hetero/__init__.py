"""Megatron-Hetero's runtime: executes a plan with the installed megatron-core.

Entry point: ``pretrain.main`` (called by pretrain_gpt.py). Every change made to
megatron-core itself is in ``patches``. This package is ``megatron.hetero`` inside the
``megatron`` namespace that megatron-core also uses; there is no megatron/__init__.py.
"""

from megatron.hetero.patches import import_megatron_core

import_megatron_core()
