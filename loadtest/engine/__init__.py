"""Benchmarks of one engine in-process, no cluster: decode throughput against
transformers (`bench`), roofline, the accuracy gate, 8-bit KV and offload, speculative
decoding, multi-LoRA, structured output."""
