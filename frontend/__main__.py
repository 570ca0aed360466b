"""`python -m frontend --config JSON`: the HTTP frontend process (started by the launcher)."""

import uvloop

from common.process import child_main_args, report_ready
from frontend.app import serve


def main() -> None:
    config = child_main_args("frontend")
    uvloop.run(serve(config, lambda url, batch: report_ready(config, "frontend", url=url, batch_endpoint=batch)))


if __name__ == "__main__":
    main()
