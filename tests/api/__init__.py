"""The HTTP, WebSocket and ZeroMQ APIs in process: the real aiohttp application over a scripted engine
(tests/fake_engine.py), no model."""
