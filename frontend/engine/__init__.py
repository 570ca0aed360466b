"""The frontend's side of the engine: its one declared interface, the client of one serving group, the router over
several, and Retry-After."""
