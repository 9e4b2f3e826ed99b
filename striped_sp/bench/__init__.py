"""Benchmarks of the layouts and the peers: ``striped-sp bench balance|sim|run``.

* :mod:`.work`   the work model: attention score entries per rank and ring step (no kernels)
* :mod:`.sim`    N ranks simulated on one device with the real kernels
* :mod:`.run`    real multi-process runs (gloo on CPU, NCCL on CUDA), with the peers of :mod:`.peers`
* :mod:`.report` plain tables, JSON and PNG plots
"""

from .work import balance_records, critical_path_over_ideal, score_entries, step_entries

__all__ = ["balance_records", "critical_path_over_ideal", "score_entries", "step_entries"]
