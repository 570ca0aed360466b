"""A request body's preparation: the OpenAI request Structs and their validation, integral floats, the chat template,
special-token text."""
