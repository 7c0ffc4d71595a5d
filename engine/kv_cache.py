"""A preallocated KV cache with one row per batch slot and a committed length per row.

Rows of different lengths decode together: each new token writes its slot (usually the row's
length) and attends to slots at or before it. A verify step writes tentative entries past the
committed length; `commit_path` moves the accepted ones into place and the rest are simply
overwritten later. Rows finish at different times: `move_row` compacts the active rows into the
first slots so the work shrinks with the batch. Knows nothing about models or sampling.

Shapes: L layers, N slot capacity (max batch), Hkv heads, M max length, D head dim.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, max_batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, N, Hkv, M, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)  # [N] committed
        self.max_batch, self.max_len = max_batch, max_len

    @classmethod
    def for_model(cls, cfg, max_batch: int, max_len: int, dtype: torch.dtype, device="cpu") -> KVCache:
        return cls(cfg.num_hidden_layers, max_batch, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype, device)

    def write(
        self,
        layer: int,
        k: torch.Tensor,  # [B, T, Hkv, D] new keys for rows 0..B-1
        v: torch.Tensor,
        slots: torch.Tensor,  # [B, T] slot of each new token
        visible: int,  # S: how many slots attention reads
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B = k.shape[0]
        rows = torch.arange(B, device=k.device).unsqueeze(1)  # [B, 1]
        self.k[layer][rows, :, slots] = k  # indexed view is [B, T, Hkv, D]
        self.v[layer][rows, :, slots] = v
        return self.k[layer, :B, :, :visible], self.v[layer, :B, :, :visible]  # [B, Hkv, S, D]

    def commit_path(self, src_slots: torch.Tensor, count: torch.Tensor) -> None:
        """Per row b, copy slots src_slots[b, :count[b]] to lengths[b] + (0..count[b]-1), then extend.

        src_slots [B, P] (P >= max count; entries past count are ignored); count [B].
        """
        B, P = src_slots.shape
        if P == 0:
            return
        dst = self.lengths[:B].unsqueeze(1) + torch.arange(P, device=src_slots.device)  # [B, P]
        keep = torch.arange(P, device=src_slots.device) < count.unsqueeze(1)
        # Where not kept, copy a slot onto itself: a no-op that keeps the gather rectangular.
        src = torch.where(keep, src_slots, dst).clamp(max=self.max_len - 1)
        dst = dst.clamp(max=self.max_len - 1)
        if bool((src == dst).all()):  # a chain's accepted prefix is already in place
            self.lengths[:B] += count
            return
        rows = torch.arange(B, device=src_slots.device).unsqueeze(1)
        for t in (self.k, self.v):
            moved = t[:, rows, :, src]  # [B, P, L, Hkv, D]
            t[:, rows, :, dst] = moved
        self.lengths[:B] += count

    def rows(self, start: int, stop: int) -> KVCache:
        """A view of slots start..stop-1 as a cache of its own (writes go to this cache)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.lengths = self.lengths[start:stop]
        view.max_batch, view.max_len = stop - start, self.max_len
        return view

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot rows src [R] onto dst [R] (compacting the active batch), up to their lengths."""
        n = int(self.lengths[src].max())
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = self.lengths[src]

