"""Flow-control benchmarks on a local cluster: overload at a multiple of capacity
(`overload_bench`) and the noisy neighbour (`fairness_bench`), with the phases, traffic,
records, refusals and metrics they share."""
