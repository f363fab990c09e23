"""Model layer: lean architectures, KV cache, runner and loaders."""
