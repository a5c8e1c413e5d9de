"""The gateway: the cluster's front door, in rooms that import only downward.

From the top: the process (`server`; `client`, the async Python client, beside it), the
OpenAI HTTP front door (`openai`), the gRPC service both front doors share (`service`),
the served models and their versions (`models`), one request's life through the cluster
(`stream`), flow control (`flow`) beside who may call and how much (`access`), and the
settings (`config`) beside the gRPC wire guard (`wire`). `lint-imports` holds the order
(pyproject.toml, "The gateway's rooms").
"""
