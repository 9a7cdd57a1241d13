"""Which target hidden states an EAGLE-3 draft reads, and the two ways the field numbers them.

The field's top silent bug is an off-by-one between two conventions for the same tensors:

- ``hidden_states`` (vLLM, SGLang, MAX, EAGLE): id i is HF ``output_hidden_states[i]``, the *input* of decoder
  layer i (0 = the embeddings; i = L is the last layer's output before the final norm).
  Defaults: (2, L // 2, L - 3).
- ``layer_output`` (Model Optimizer): id i is the *output* of 0-based decoder layer i, i.e. ``hidden_states``
  id i + 1. Defaults: sorted({1, L // 2 - 1, L - 4}), the same tensors as above written one lower.

Inside eyas every id is a ``hidden_states`` index; conversions happen only here.
"""

from __future__ import annotations

from enum import Enum


class AuxConvention(str, Enum):
    HIDDEN_STATES = "hidden_states"
    LAYER_OUTPUT = "layer_output"


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The standard early/middle/late choice, as ``hidden_states`` indices."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) != 3 or min(ids) < 1:
        raise ValueError(f"a target with {num_layers} layers has no three distinct default aux layers "
                         f"(got {ids}); pass the ids explicitly")
    return ids


def to_hidden_state_ids(ids: list[int] | tuple[int, ...], convention: AuxConvention | str,
                        num_layers: int) -> tuple[int, ...]:
    """Convert ids written in ``convention`` to ``hidden_states`` indices, checked against the target depth."""
    convention = AuxConvention(convention)
    shift = 1 if convention is AuxConvention.LAYER_OUTPUT else 0
    out = tuple(int(i) + shift for i in ids)
    if len(set(out)) != len(out):
        raise ValueError(f"aux layer ids {list(ids)} repeat a layer; each must be distinct")
    for original, index in zip(ids, out):
        if not 0 <= index <= num_layers:
            raise ValueError(f"aux layer id {original} ({convention.value} convention) is outside a "
                             f"{num_layers}-layer target (hidden_states indices run 0..{num_layers})")
    return out


def from_hidden_state_ids(ids: tuple[int, ...], convention: AuxConvention | str) -> list[int]:
    shift = 1 if AuxConvention(convention) is AuxConvention.LAYER_OUTPUT else 0
    return [i - shift for i in ids]
