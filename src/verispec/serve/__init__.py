"""`verispec serve`: an OpenAI-compatible HTTP server with continuous batched speculative decoding."""
