"""The KV transfer benchmark (`bench`): NIXL and TCP between two processes against a
memcpy of the same bytes, with its exporter process, links, measurements and report."""
