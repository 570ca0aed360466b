"""`python -m shuttle.frontend --config JSON`: the HTTP frontend process (started by the launcher)."""

import logging
import sys

import uvloop
import zmq

from shuttle.common.process import child_main_args, report_ready
from shuttle.frontend.app import serve


def main() -> None:
    config = child_main_args("frontend")
    try:
        uvloop.run(serve(config, lambda url, batch: report_ready(config, "frontend", url=url, batch_endpoint=batch)))
    except (OSError, zmq.ZMQError) as exc:  # e.g. a port taken since the launcher checked it (launcher/ports.py):
        # one line naming both listening addresses, not a traceback
        http = f"the Unix socket {config.api.uds} (--uds)" if config.api.uds else \
            f"{config.host}:{config.port} (--host, --port)"
        logging.getLogger("shuttle.frontend").error("cannot serve HTTP on %s with the batch endpoint %s "
                                                    "(--batch-endpoint): %s", http, config.batch_endpoint or "off", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
