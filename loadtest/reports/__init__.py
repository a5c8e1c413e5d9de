"""Result files and what is made of them: provenance, the one JSON writer, plots, the
generated page docs/benchmarks.md (`results`, `sections`) and the stale results it
marks (`stale`)."""
