"""What the frontend reports: Prometheus metrics, the live stats feed and the /dashboard page."""
