"""Fixed texts and seeded workloads the benchmarks draw from: prompt text, the parity
prompts and reference text of the accuracy gate, the multi-tenant prefix workload."""
