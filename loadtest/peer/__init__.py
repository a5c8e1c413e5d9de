"""The peer benchmark: pdserve against llama.cpp's `llama-server` on the same host, same
weights, same client and workload (`build` makes the server and the GGUF, `bench` runs
the comparison). An optional benchmark: never part of `make test`."""
