"""specd services: the speculative engine (services.engine) and, on top of it, the gRPC services."""
