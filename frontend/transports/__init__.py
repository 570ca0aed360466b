"""Transports beside HTTP/SSE: WebSocket token streaming and the ZeroMQ endpoint for batch jobs."""
