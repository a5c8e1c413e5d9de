"""A worker process: its config, its gRPC server and its registration with the router."""
