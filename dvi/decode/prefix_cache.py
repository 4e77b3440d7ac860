"""`PrefixCache`: the target's keys and values of prompts' leading tokens, kept after their prefill so that a later
prompt that starts alike (a chat template's system prompt, a GRPO group's samples of one prompt, a retried request)
copies them instead of computing them again.

Blocks of `BLOCK` tokens in one pool allocated up front, each found by its parent block and its own tokens (compared
exactly: no hash collision can hand a prompt another's keys). Evicted least recently used; a block goes with every
block after it (they were reached through it). Used only where a position's keys and values are the same bits
whatever forward computed them (`LeanTarget.contract`'s batched "bitwise": dvi's kernels compute every position
alone), so a prompt served from here decodes exactly as from a cold prefill.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["BLOCK", "PrefixCache"]

BLOCK = 8
"""Tokens a block holds: a prompt reuses the whole blocks it shares with an earlier one."""


class PrefixCache:
    """Up to `tokens` (rounded down to whole blocks) cached positions of [layers, 2, kv_heads, head_dim] each."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 tokens: int):
        blocks = max(0, int(tokens)) // BLOCK
        if blocks < 1:
            raise ValueError(f"a prefix cache holds at least one block of {BLOCK} tokens, got {tokens}")
        with torch.inference_mode(False), torch.no_grad():
            self.pool = torch.zeros(layers, blocks, BLOCK, 2, kv_heads, head_dim, dtype=dtype, device=device)
        self._block: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent block or -1, its tokens) -> block
        self._key: list[tuple[int, tuple[int, ...]] | None] = [None] * blocks
        self._children: list[set[int]] = [set() for _ in range(blocks)]
        self._lru: OrderedDict[int, None] = OrderedDict()  # blocks in use, least recently used first
        self._free = list(range(blocks - 1, -1, -1))
        self.queried_tokens = self.hits = self.reused_tokens = 0  # prompt tokens looked up; prompts and tokens reused

    @property
    def blocks(self) -> int:
        return self.pool.shape[1]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def stats(self) -> dict[str, int]:
        """What /health and /metrics show: capacity, blocks held, prompt tokens looked up and reused, prompts that
        reused some."""
        return {"tokens": self.blocks * BLOCK, "held_tokens": len(self._lru) * BLOCK, "queried_tokens":
                self.queried_tokens, "reused_tokens": self.reused_tokens, "hits": self.hits}

    def clear(self) -> None:
        """Forget every block (new target weights: the cached keys and values are the old weights')."""
        self._block.clear()
        self._key = [None] * self.blocks
        self._children = [set() for _ in range(self.blocks)]
        self._lru.clear()
        self._free = list(range(self.blocks - 1, -1, -1))

    def _chain(self, ctx: list[int]) -> list[int]:
        """The cached blocks `ctx` starts with, in order."""
        chain, parent = [], -1
        for at in range(0, len(ctx) - BLOCK + 1, BLOCK):
            b = self._block.get((parent, tuple(ctx[at : at + BLOCK])))
            if b is None:
                break
            chain.append(b)
            parent = b
        return chain

    def _touch(self, chain: list[int]) -> None:
        for b in reversed(chain):  # the first block most recent: a chain is evicted from its end, not its root
            self._lru.move_to_end(b)

    def copy_into(self, ctx: list[int], row: torch.Tensor) -> int:
        """The keys and values of the longest run of cached blocks `ctx` starts with, copied into `row` [layers,
        columns, 2, kv_heads, head_dim] (a slot of the `SlotCache`) at columns 0..; the tokens copied."""
        self.queried_tokens += len(ctx)
        chain = self._chain(ctx)
        if not chain:
            return 0
        n = len(chain) * BLOCK
        idx = torch.tensor(chain, dtype=torch.long, device=self.pool.device)
        row[:, :n].copy_(self.pool.index_select(1, idx).flatten(1, 2))
        self._touch(chain)
        self.hits += 1
        self.reused_tokens += n
        return n

    def count_shared(self, tokens: int, hit: bool) -> None:
        """A prompt that copies `tokens` more leading positions from another joining beside it (`LeanTarget`); a hit
        where the cache gave it none."""
        self.hits += hit
        self.reused_tokens += tokens

    def keep(self, ctx: list[int], row: torch.Tensor) -> None:
        """The whole blocks of `ctx` whose keys and values `row` now holds (after its prefill), cached where they are
        not yet, evicting the least recently used blocks for them."""
        chain = self._chain(ctx)
        parent = chain[-1] if chain else -1
        for at in range(len(chain) * BLOCK, len(ctx) - BLOCK + 1, BLOCK):
            b = self._take(exclude=chain)
            if b is None:
                break
            key = (parent, tuple(ctx[at : at + BLOCK]))
            self._block[key], self._key[b] = b, key
            if parent >= 0:
                self._children[parent].add(b)
            self.pool[:, b].copy_(row[:, at : at + BLOCK])
            self._lru[b] = None
            chain.append(b)
            parent = b
        self._touch(chain)

    def _take(self, exclude: list[int]) -> int | None:
        """A free block, evicting the least recently used one (and the blocks after it) where none is; None where
        only `exclude` (the chain being extended) is left."""
        if not self._free:
            keep = set(exclude)
            victim = next((b for b in self._lru if b not in keep), None)
            if victim is None:
                return None
            self._evict(victim)
        return self._free.pop()

    def _evict(self, b: int) -> None:
        """Block b and every block after it (a loop, not recursion: chains run thousands of blocks deep)."""
        key = self._key[b]
        if key is not None and key[0] >= 0:
            self._children[key[0]].discard(b)
        gone = [b]
        while gone:
            x = gone.pop()
            gone.extend(self._children[x])
            self._children[x] = set()
            del self._block[self._key[x]]
            self._key[x] = None
            self._lru.pop(x, None)
            self._free.append(x)
