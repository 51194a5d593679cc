"""KV cache groups: the layers that can share one block table, and what a window lets a group free.

A hybrid model mixes layer kinds. Layers of one kind read the same positions at every step, so
they can share one block table per request; layers of different kinds cannot (a sliding layer
stops reading old positions long before a full one does). A group is a run of layers of one kind,
and every group has the same number of layers, so that one block of the shared pool holds the K/V
of exactly one group's layers, whichever group owns it:

    layer_types  S F S F S F S F S F S F          (S: sliding, window W; F: full attention)
    groups       0: S layers 0 2 4 6 8 10          1: F layers 1 3 5 7 9 11
    pool tensor  j holds the j-th layer of the group that owns each block

With kinds of unequal sizes (Gemma 3: five sliding layers to one full) each kind is cut into
groups of gcd(sizes) layers: 30 sliding + 6 full layers are five sliding groups and one full
group of 6 layers each. A request then holds one table per group.

    block_size 4, W = 6, a request at cur_len 14 (its next token, position 14, reads 9..14):
    full group     [ 3][ 5][ 8][11]                 positions 0..15: every block
    sliding group  [ -][ -][ 9][12]                 blocks 0, 1 (positions 0..7) freed: NULL_BLOCK

A sliding group's table keeps its length (entry i still means positions 4i..4i+3), so a position
finds its block the same way in every group; the freed entries are NULL_BLOCK and never read.
"""

from __future__ import annotations

from dataclasses import dataclass

from l1_contiguous import Qwen3Config
from l2_paged import blocks_needed

NULL_BLOCK = -1  # a table entry behind the window: its block went back to the pool


@dataclass(frozen=True)
class KvCacheGroup:
    layers: tuple[int, ...]  # model layer indices, ascending
    window: int | None  # every layer of the group reads the last `window` positions; None: all

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


def kv_cache_groups(cfg: Qwen3Config) -> list[KvCacheGroup]:
    """The model's layers as groups of one kind each, full-attention groups first; none has more
    than `group_size(...)` layers, and a block holds that many layers' K/V whichever group owns it."""
    kinds: dict[int | None, list[int]] = {}
    for layer in range(cfg.num_hidden_layers):
        kinds.setdefault(cfg.window_of(layer), []).append(layer)
    size = group_size([len(layers) for layers in kinds.values()])
    groups = []
    for window, layers in sorted(kinds.items(), key=lambda kind: kind[0] is not None):  # stable: full first
        count = -(-len(layers) // size)
        groups += [KvCacheGroup(tuple(layers[i::count]), window) for i in range(count)]  # strided, as vLLM
    return groups


def group_size(layers_per_kind: list[int]) -> int:
    """Layers per group: the smallest kind's count, so the group count stays small (a Gemma-3-like
    52 sliding + 10 full make 7 groups, not gcd's 31), or the largest kind's when it is under 1.5
    times the smallest (one group per kind). A kind whose count is not a multiple of it gets short
    groups: their missing layers are padding, slots a block has and nobody writes."""
    smallest, largest = min(layers_per_kind), max(layers_per_kind)
    return largest if largest < 1.5 * smallest else smallest


def layer_slots(groups: list[KvCacheGroup]) -> int:
    """Layers' K/V one block holds: the largest group's layer count (a shorter group pads)."""
    return max(len(g.layers) for g in groups)


def first_needed_position(window: int | None, position: int) -> int:
    """The oldest position a token at `position` reads through `window` (0 for full attention)."""
    return 0 if window is None else max(0, position - window + 1)


def window_block_bound(window: int, block_size: int, new_tokens: int = 1) -> int:
    """The most blocks a sliding group holds for one request during a step computing `new_tokens`:
    positions start - W + 1 .. start + new_tokens - 1 are W - 1 + new_tokens of them, and a run of
    that many positions touches at most ceil(run / block_size) + 1 blocks (it need not start at a
    block's edge). A decode (1 new token) gives the bound ceil(W / block_size) + 1."""
    return blocks_needed(window - 1 + new_tokens, block_size) + 1


def blocks_at_peak(groups: list[KvCacheGroup], num_positions: int, block_size: int, step_tokens: int) -> int:
    """Blocks one request holds at most over its life, writing `num_positions` positions of K/V in
    steps of at most `step_tokens` new tokens: a full group all of them, a sliding group its window's."""
    whole = blocks_needed(num_positions, block_size)
    return sum(whole if not g.is_sliding else min(whole, window_block_bound(g.window, block_size, step_tokens))
               for g in groups)

