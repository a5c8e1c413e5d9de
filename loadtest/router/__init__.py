"""The router benchmark (`bench`): decision latency against Redis PING, and the prefix
hit ratio of each placement policy against an oracle."""
