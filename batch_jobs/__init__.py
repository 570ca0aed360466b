"""The ZeroMQ batch client library (BatchClient, AsyncBatchClient) and `shuttle batch` for OpenAI batch files."""
