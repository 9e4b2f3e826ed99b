"""``striped-sp bench train``: end-to-end training throughput of each layout, the paper's metric.

Striped Attention (arXiv 2311.09431) reports the training step of a whole model against Ring
Attention (our ``contiguous``).  This mode trains real models on spawned ranks (gloo on CPU, NCCL on
CUDA, chosen automatically) and times whole steps: forward, backward, the gradient reduction, the
optimizer step:

* ``megatron``: a megatron-core ``GPTModel`` (GQA, RoPE) built by the plugin's route
  (:func:`striped_sp.megatron.install` + :func:`~striped_sp.megatron.patch_layer_spec`,
  :mod:`.train_megatron`); peer ``native`` (Megatron's own CP, Transformer Engine) where TE exists;
* ``hf``: a Hugging Face Llama (Mistral with a sliding window for the window row) through
  :func:`striped_sp.deepspeed.initialize` (:mod:`.train_hf`); peer ``ulysses`` (DeepSpeed's ALST).

Rows (:mod:`.train_data`): dense rows at each ``--seq-lens`` length, packed web-mix rows
(``--packed-lens``, ``--docs``), a window model (``--window-lens``, ``--window``).  Columns: the
``--layouts`` (``striped:auto`` is the striped layout's ``auto`` configuration for the row and model,
:func:`striped_sp.megatron.algo_of` of ``--striped-stripe-size auto``) and the ``--peers``.

Every column of a row gets its own model from the same seed and its own optimizer, and the same
batches: ``--warmup`` untimed steps (the first one measures the peak memory, with ``--memory`` on
the CPU, where the count runs ``torch.profiler``, and always on CUDA), then ``--rounds``
interleaved rounds (each round steps every column once, the starting column rotating, so load from
other processes hits all alike).  A step's time is the slowest rank's; the record is the median.
Every column trains on the same data from the same weights, so the losses of a round must agree
(``loss_rel_diff``: the largest relative difference to the first column over the rounds).  Every
column holds its own model and optimizer state at once (memory: columns x (model + optimizer) +
one step's activations): where that does not fit, run fewer ``--layouts`` or ``--layers``.
"""

from __future__ import annotations

# the parts, one job a module; every name importable from here before the split stays importable from here
from .train_cli import _columns, _main, _presets_help, config_of, register
from .train_run import (_NEEDS, AUTO, PEERS, PRESETS, TrainConfig, _check, _device_type, _init, _paths, _resolve,
                        _row_records, _worker_body, missing, train)

__all__ = ["TrainConfig", "PRESETS", "train", "register", "config_of", "missing"]
