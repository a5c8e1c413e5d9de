"""The routing key of a prompt: the engine's chained prefix hash over its first K blocks.

The router and the engine's prefix cache hash with the same function and seed (model
fingerprint + tenant salt + LoRA adapter digest), so the worker a key routes to is the
one whose cache holds that prefix, and the leading block hashes a placement looks up
in the workers' reports (`PromptKey.blocks`) are the ones their engines cached. Prompts
shorter than one block hash whatever tokens they have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.prefix_hash import hash_seed, prefix_block_hashes, short_prompt_key


def prefix_key(token_ids: Sequence[int], block_size: int, prefix_blocks: int, seed: int) -> int:
    """Chained hash of the first `prefix_blocks` full blocks, or of a short prompt."""
    hashes = prefix_block_hashes(token_ids, block_size, seed, max_blocks=prefix_blocks)
    return hashes[-1] if hashes else short_prompt_key(token_ids, seed)


@dataclass(frozen=True)
class PromptKey:
    """What placement needs of one prompt's tokens, hashed once."""

    key: int  # `prefix_key` of the prompt
    key_blocks: int  # full blocks the key covers (1 for a prompt shorter than a block)
    blocks: tuple[int, ...]  # chained hashes of its first `match_blocks` full blocks


def prompt_key(
    token_ids: Sequence[int], block_size: int, prefix_blocks: int, match_blocks: int, seed: int
) -> PromptKey:
    """The prompt's key and leading block hashes, from one pass over its tokens."""
    hashes = prefix_block_hashes(
        token_ids, block_size, seed, max_blocks=max(prefix_blocks, match_blocks)
    )
    covered = min(prefix_blocks, len(hashes))
    key = hashes[covered - 1] if covered else short_prompt_key(token_ids, seed)
    return PromptKey(key, max(1, covered), tuple(hashes[:match_blocks]))


def tenant_seed(model_fingerprint: str, tenant: str, adapter_digest: str = "") -> int:
    """Seed of one tenant's keys (of one LoRA adapter's requests, when it has a digest);
    the tenant is the salt and the adapter's digest folded in, as in the engine's cache."""
    return hash_seed(model_fingerprint, tenant, adapter_digest)
