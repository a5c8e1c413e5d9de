"""The load generator and what every benchmark shares: requests and their traffic, the
runner that sends them and times every token, metrics, targets, the capacity search, the
benchmark command line (`bench_main`) and `pdserve-bench` itself (`cli`, `bench`)."""
