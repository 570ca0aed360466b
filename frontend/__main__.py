"""`python -m frontend --config JSON`: the HTTP frontend process (started by the launcher)."""

import logging
import sys

import uvloop
import zmq

from common.process import child_main_args, report_ready
from frontend.app import serve


def main() -> None:
    config = child_main_args("frontend")
    try:
        uvloop.run(serve(config, lambda url, batch: report_ready(config, "frontend", url=url, batch_endpoint=batch)))
    except (OSError, zmq.ZMQError) as exc:  # e.g. the port or batch endpoint is taken: one line, not a traceback
        logging.getLogger("shuttle.frontend").error("cannot serve on %s:%d: %s", config.host, config.port, exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
