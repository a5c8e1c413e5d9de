"""What a worker's RPC handlers share, below them and the worker process: the thread
that steps the engine (`loop`), and the worker's telemetry (`telemetry`, `metrics`)."""
