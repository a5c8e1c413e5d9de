"""The OpenAI-compatible HTTP front door: the aiohttp app and the serving routes beside
it, OpenAI bodies in (schema, sampling, tools) and out (answers and SSE chunks). It
speaks to the gateway only through `GatewayService`, as gRPC does."""
