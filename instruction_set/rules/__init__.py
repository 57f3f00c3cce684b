"""Sharding rules per ATen op (registry.py: the `Rule` type, the registry and its helpers; one
module per op family registers its rules). Importing the package loads every family."""

from hetsynth.instruction_set.rules import (  # noqa: F401  (imports register the families)
    attention, contraction, conv, elementwise, embedding, moe, norm, reduction, replicated_only, state, views,
)
from hetsynth.instruction_set.rules.registry import (
    SHAPE_ARG, Rule, RuleFn, arg, is_supported, norm_dim, product_rule, register, register_tag,
    registered_targets, replicated, rules_for,
)

__all__ = ["SHAPE_ARG", "Rule", "RuleFn", "arg", "is_supported", "norm_dim", "product_rule", "register",
           "register_tag", "registered_targets", "replicated", "rules_for"]
