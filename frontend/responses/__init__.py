"""POST /v1/responses, OpenAI's Responses API, on the chat machinery."""
