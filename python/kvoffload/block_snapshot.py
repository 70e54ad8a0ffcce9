"""A published block's KV-event snapshot, packed, to announce the block again later.

Routers forget every block of an engine when it publishes ``AllBlocksCleared`` (an event
without a medium): on a reset of vLLM's GPU pool, and of the CPU tier. The tiers keep
serving what they hold, so the CPU event log (:mod:`kvoffload.events`) and the disk's
(:mod:`kvoffload.disk_events`) keep, for each block they announced, what its
``BlockStored`` said, and announce it again after the clear. A CPU tier holds hundreds of
thousands of blocks and a disk millions: the snapshot keeps the hash objects as they are
and the tokens as 4-byte integers, in a tuple (a third of what a ``BlockMeta`` costs; see
``tests/test_disk_events.py`` and ``tests/test_kv_events.py``). A block on CPU and on disk
shares one snapshot: the CPU log hands its own to the disk's when it publishes the block.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from kvoffload.vllm_adapter import BlockMeta


class PackedBlock(NamedTuple):
    """An announced block's snapshot: a tuple (no per-object dict), its KV-cache group, the
    hashes as vLLM publishes them (bytes or int: the same objects, so they round-trip
    exactly), the tokens as native 4-byte integers (a ``tuple`` in the unlikely case one
    does not fit), the rarely set LoRA and extra keys together or ``None``."""

    group: int
    block_hash: Any
    parent_block_hash: Any
    token_ids: bytes | tuple[int, ...]
    lora_extra: tuple[int | None, str | None, tuple[Any, ...] | None] | None

    @classmethod
    def pack(cls, group: int, meta: BlockMeta) -> PackedBlock:
        # Done for every block the CPU tier publishes: a precompiled struct packs a
        # block's tokens in a third of the time an array takes, and the tuple is built
        # without the named tuple's keyword-handling constructor.
        tokens: bytes | tuple[int, ...]
        try:
            tokens = _tokens_struct(len(meta.token_ids)).pack(*meta.token_ids)
        except struct.error:
            tokens = tuple(meta.token_ids)
        if meta.lora_id is None and meta.lora_name is None and meta.extra_keys is None:
            rest = None
        else:
            rest = (meta.lora_id, meta.lora_name, meta.extra_keys)
        return tuple.__new__(cls, (group, meta.block_hash, meta.parent_block_hash, tokens, rest))

    def meta(self) -> BlockMeta:
        tokens = self.token_ids
        lora_id, lora_name, extra_keys = self.lora_extra or (None, None, None)
        return BlockMeta(
            block_hash=self.block_hash,
            parent_block_hash=self.parent_block_hash,
            token_ids=list(tokens)
            if isinstance(tokens, tuple)
            else list(_tokens_struct(len(tokens) // 4).unpack(tokens)),
            lora_id=lora_id,
            lora_name=lora_name,
            extra_keys=extra_keys,
        )


#: Packs and unpacks a block's tokens, by token count: 4-byte integers, native order.
_TOKEN_STRUCTS: dict[int, struct.Struct] = {}


def _tokens_struct(count: int) -> struct.Struct:
    packer = _TOKEN_STRUCTS.get(count)
    if packer is None:
        packer = _TOKEN_STRUCTS[count] = struct.Struct(f"={count}i")
    return packer
