"""specd on Ray: actors for the services, a detached controller, and the `specd ray` commands."""
