"""The scheduler process: queues, KV block tables, and one step plan at a time."""
