"""gRPC generation service over the model repository (engine, scheduler, KV-cache manager)."""
