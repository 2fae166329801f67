"""How many entries each layer and each KV head keeps (S5, S6, S8).

The budgets and the top-k under them, re-exported here, are in
:mod:`probkv.budgets.allocation`; the exact solvers of KVEviction for tiny inputs in
:mod:`probkv.budgets.hardness`.
"""

from probkv.budgets.allocation import (
    adakv_allocation,
    pyramid_budgets,
    retained_attention_mass,
    topk_per_head,
    uniform_budget,
)

__all__ = [
    "adakv_allocation",
    "pyramid_budgets",
    "retained_attention_mass",
    "topk_per_head",
    "uniform_budget",
]
