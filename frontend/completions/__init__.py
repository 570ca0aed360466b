"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models and /tokenize: routes and response shapes."""
