"""The HTTP server: aiohttp's listener with hardened edges, middleware (errors, auth, CORS, content coding), bodies
decoded off the event loop, and /openapi.json."""
