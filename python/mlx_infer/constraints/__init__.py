"""Structured output: constrain generated text to a JSON Schema, JSON object, regex, choice or grammar.

The constraint is the sampler's first stage: before processors and filters, every token the
grammar does not allow gets -inf (:func:`apply_bitmask`, on the device). Matching is
llguidance's (a maintained Rust matcher: JSON Schema, regex, Lark/GBNF, forced tokens,
rollback), imported only when a constraint is used (``pip install 'mlx-infer[structured]'``).

Usage::

    from mlx_infer.constraints import Constraint
    generate(loaded, prompt, constraint=Constraint.json_schema({"type": "object", ...}))
"""

from .mask import apply_bitmask, bitmask_to_allowed
from .matcher import ConstraintState, bitmask_words, constraint_tokenizer, fill_bitmasks
from .spec import KINDS, Constraint, ConstraintError

__all__ = [
    "KINDS",
    "Constraint",
    "ConstraintError",
    "ConstraintState",
    "apply_bitmask",
    "bitmask_to_allowed",
    "bitmask_words",
    "constraint_tokenizer",
    "fill_bitmasks",
]
