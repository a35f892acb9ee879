"""Probes and metrics, independent of the model (docs/probes.md, §9, §10).

- ``probes``: linear object-ID classifier and position regressor on frozen codes.
- ``disentanglement``: MIG and DCI from ground-truth factors.
- ``factor_latents``: the latents that carry each factor (position on the digits).
- ``continual``: Table 1 columns, the R matrix, average forgetting and backward transfer.
- ``plots``: probe-curve and atypicality figures as RGB arrays.

``vase.probing.ProbeSuite`` runs the probes during training. The protocol is in docs/probes.md.
"""
from vase.metrics.continual import (
    ProbeCurve,
    average_forgetting,
    backward_transfer,
    format_table1_row,
    mean_std_over_seeds,
    probe_matrix,
    table1_header,
    table1_stats,
    to_table1_units,
)
from vase.metrics.disentanglement import dci, mig
from vase.metrics.probes import object_id_accuracy, position_mse

__all__ = [
    "ProbeCurve",
    "average_forgetting",
    "backward_transfer",
    "dci",
    "format_table1_row",
    "mean_std_over_seeds",
    "mig",
    "object_id_accuracy",
    "position_mse",
    "probe_matrix",
    "table1_header",
    "table1_stats",
    "to_table1_units",
]
