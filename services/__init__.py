"""specd services: the speculative engine (specd.services.engine) and, on top of it, the gRPC services."""
