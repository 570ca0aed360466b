"""The worker process: model weights, paged KV cache, one packed forward and sampling per step."""
