"""Whether a server can listen on a Unix domain socket path (--uds): checked by the launcher before anything starts,
and by the frontend when it binds (a restart meets what the launch did not)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path


def unix_socket_problem(path: str) -> str | None:
    """Why a server cannot listen on the Unix socket at `path`, or None: its directory is missing or not writable,
    a file that is not a socket is there, or a server already accepts on it (a socket file left by a server that
    ended is free to take: the listener replaces it)."""
    directory = Path(path).parent
    if not directory.is_dir():
        return f"its directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"its directory {directory} is not writable"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISSOCK(mode):
        return "a file that is not a socket is there"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return None  # nobody listening: free to take
    finally:
        probe.close()
    return "a server already listens on it"
