"""What a layer of the request path costs on a local cluster: the gateway's overhead over
a direct Prefill call (`gateway_bench`) and tracing on against off (`tracing_bench`)."""
