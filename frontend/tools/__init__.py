"""Tool calling: the request's tools and tool_choice, and the parsers that read calls out of the model's text."""
