"""The models one gateway serves: the catalog by name, each model's versions (backends:
placement and admission on the version's pool), its LoRA adapters, and the rollouts that
split requests between versions (the follower every gateway runs, the admin RPC's side)."""
