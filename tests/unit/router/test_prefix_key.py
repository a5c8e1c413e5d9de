from __future__ import annotations

from engine.prefix_hash import hash_seed, prefix_block_hashes, short_prompt_key
from services.router.prefix_key import prefix_key, tenant_seed


def test_key_is_the_engine_chain_hash_of_the_first_k_blocks() -> None:
    tokens = list(range(100))
    seed = tenant_seed("model", "tenant-a")
    assert seed == hash_seed("model", "tenant-a")
    assert prefix_key(tokens, 16, 4, seed) == prefix_block_hashes(tokens, 16, seed)[3]
    # Tokens after the first K blocks do not change the key: same system prompt, same key.
    assert prefix_key([*tokens[:64], 7, 7, 7], 16, 4, seed) == prefix_key(tokens, 16, 4, seed)
    # Fewer than K full blocks: the last full block's hash.
    assert prefix_key(tokens[:40], 16, 4, seed) == prefix_block_hashes(tokens[:40], 16, seed)[-1]


def test_short_prompt_and_tenants() -> None:
    seed = tenant_seed("model", "")
    assert prefix_key([1, 2, 3], 16, 4, seed) == short_prompt_key([1, 2, 3], seed)
    tokens = list(range(64))
    keys = {prefix_key(tokens, 16, 4, tenant_seed("model", t)) for t in ("", "a", "b")}
    assert len(keys) == 3
