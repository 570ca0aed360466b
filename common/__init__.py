"""Pieces every shuttle process shares: configuration, wire messages, sockets, errors."""
