"""OpenAI-compatible HTTP gateway (FastAPI). Built on the engine by the services issue."""
