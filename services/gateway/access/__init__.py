"""Who may call and how much they may use: API keys and the principal they name
(`auth`), per-tenant token quotas in Redis (`quota`), and the gate joining both
(`gate.Access`) that each front door and each request record goes through."""
