"""The frontend process: HTTP (OpenAI API), SSE and WebSocket streaming, tokenization and detokenization."""
