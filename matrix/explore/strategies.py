"""hypothesis strategies over the variants (matrix/grid/variants.py) a model kind can be built and
fed with, for one engine.

Every draw is valid for the kind by construction (check_variant never rejects one), so a
failure found is never an invalid combination. Each strategy shrinks towards the
exploration's base variant (base_variant below): one unpadded row of the shortest length, no
padding mask, the grid's sizes, the precision's own loop. matrix/explore/exploration.py then reverts
what hypothesis' shrinking left, setting by setting, so a finding differs from the base
only in settings it needs.

What is drawn, per field (a field the kind does not read is never drawn):
  batch          1-4 rows; seq_len 1-16 (3-16 for causal LMs); padding none, right or left;
                 per-row pad counts from 0 up to seq_len - 1 (a row padded down to one token)
  sizes          num_heads from 1, 2, 3, 4, 8 with a head size that makes hidden_size (>= 4);
                 num_kv_heads any divisor grouping of num_heads; 1-3 layers; FFN width
  gemma          head_dim independent of hidden_size; sliding_window from 2 up to seq_len + 4
  cache          use_cache_in_eval on or off
  dropout        0 or 0.1
  LoRA           rank 1-16, any non-empty set of target projections
  loop           grad_accumulation 1-3 (engines that implement it); eval under no_grad or
                 inference_mode
"""

from __future__ import annotations

from hypothesis import strategies as st

from matrix.engines.base import Engine
from matrix.grid.variants import LORA_MODULES, MIN_HIDDEN_SIZE, PADDINGS, Variant
from matrix.models.base import ModelKind

MAX_ROWS = 4
MAX_SEQ_LEN = 16


def _grid_first(grid_value, others):
    """sampled_from with the grid's value first: hypothesis shrinks towards it."""
    return st.sampled_from((grid_value, *[v for v in others if v != grid_value]))


def explored_fields(kind: ModelKind, engine: Engine) -> tuple[str, ...]:
    return tuple(f for f in kind.variant_fields if f not in engine.fixed_variant_fields)


def min_seq_len(kind: ModelKind) -> int:
    """Causal LMs: three tokens, so that some position attends to more than itself. With two,
    the only position with a label sees one key: softmax of one score is 1 whatever the query
    and key, q_proj/k_proj get exactly zero gradient, and the training check that every
    trainable tensor moves cannot hold even in fp32 (seen for LoRA's zero-initialised B)."""
    return 3 if "num_kv_heads" in kind.variant_fields else 1


def base_variant(kind: ModelKind, engine: Engine) -> Variant:
    """What every search shrinks towards, and what findings are compared with."""
    grid = kind.grid_variant
    seq_len = min_seq_len(kind)
    return grid.replace(
        seq_len=seq_len,
        padding="none",
        pad_counts=(0,),
        sliding_window=seq_len,
        grad_accumulation=None,
        eval_grad_mode=None,
    )


def _head_sizes(kind: ModelKind) -> tuple[int, ...]:
    # RoPE (the causal LMs) needs an even head size; the torch encoder takes any
    grid = kind.grid_variant.hidden_size // kind.grid_variant.num_heads
    return (grid, 2, 4, 16) if kind.name != "tiny-transformer" else (grid, 1, 3, 5, 16)


@st.composite
def variants(draw, kind: ModelKind, engine: Engine) -> Variant:
    """A valid variant of `kind` for `engine`."""
    fields = set(explored_fields(kind, engine))
    grid = kind.grid_variant
    drawn: dict = {}
    seq_len = drawn["seq_len"] = draw(st.integers(min_seq_len(kind), MAX_SEQ_LEN))
    rows = draw(st.integers(1, MAX_ROWS))
    padding = drawn["padding"] = draw(st.sampled_from(PADDINGS))  # "none" first
    if padding == "none":
        drawn["pad_counts"] = (0,) * rows
    else:
        others = draw(st.lists(st.integers(0, seq_len - 1), min_size=rows - 1, max_size=rows - 1))
        drawn["pad_counts"] = (0, *others)  # the longest row sets the width, as a collator pads
    if "num_heads" in fields:
        heads = drawn["num_heads"] = draw(_grid_first(grid.num_heads, (1, 2, 3, 4, 8)))
        sizes = [size for size in _head_sizes(kind) if heads * size >= MIN_HIDDEN_SIZE]
        drawn["hidden_size"] = heads * draw(st.sampled_from(sizes))
        drawn["num_layers"] = draw(_grid_first(grid.num_layers, (1, 2, 3)))
        drawn["intermediate_size"] = draw(_grid_first(grid.intermediate_size, (16, 64, 96)))
    if "num_kv_heads" in fields:
        groups = [g for g in (grid.num_heads // grid.num_kv_heads, 1, 2, 3, 4, 8) if heads % g == 0]
        drawn["num_kv_heads"] = heads // draw(st.sampled_from(list(dict.fromkeys(groups))))
    if "head_dim" in fields:
        drawn["head_dim"] = draw(_grid_first(grid.head_dim, (2, 4, 8, 16)))
    if "sliding_window" in fields:
        # shrinks to a window exactly as long as the batch; below it the sliding mask cuts
        drawn["sliding_window"] = seq_len + draw(st.integers(-(seq_len - 2), 4))
    if "use_cache_in_eval" in fields:
        drawn["use_cache_in_eval"] = draw(_grid_first(grid.use_cache_in_eval, (False, True)))
    if "dropout" in fields:
        drawn["dropout"] = draw(_grid_first(grid.dropout, (0.0, 0.1)))
    if "lora_rank" in fields:
        drawn["lora_rank"] = draw(_grid_first(grid.lora_rank, (1, 2, 4, 8, 16)))
        drawn["lora_targets"] = draw(
            st.one_of(
                st.just(grid.lora_targets),
                st.lists(st.sampled_from(LORA_MODULES), min_size=1, max_size=len(LORA_MODULES), unique=True).map(
                    lambda chosen: tuple(m for m in LORA_MODULES if m in chosen)
                ),
            )
        )
    if "grad_accumulation" in fields:
        drawn["grad_accumulation"] = draw(st.sampled_from((None, 2, 3)))  # None: the precision's own
    if "eval_grad_mode" in fields:
        drawn["eval_grad_mode"] = draw(st.sampled_from((None, "no_grad", "inference_mode")))  # None: engine's
    variant = grid.replace(**drawn)
    kind.check_variant(variant)  # raises if this strategy ever draws an invalid combination
    return variant
