"""The speculative core: plain tensors and dataclasses, no gRPC or HTTP."""
