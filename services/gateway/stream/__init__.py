"""One request's life through the cluster once admitted: its record (what it holds, its
one cleanup), the relay through prefill and decode with its recovery policy, the text it
streams, the buffer to its client, its telemetry, and the worker connections it uses."""
