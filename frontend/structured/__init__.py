"""Structured outputs: a request's output constraint and what the grammar engine keeps of a schema or regex."""
