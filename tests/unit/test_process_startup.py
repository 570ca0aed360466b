"""Start-up shared by the child processes (common/process.py), without processes."""

import gc

from shuttle.common.process import freeze_startup_heap


def test_startup_heap_leaves_the_collectors_generations():
    """What is alive when start-up ends (report_ready) is out of every generation the collector walks while
    serving; what is made afterwards is walked as usual."""
    gc.unfreeze()
    built_at_startup = [object()]
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is built_at_startup for o in gc.get_objects())
        made_while_serving = [object()]
        assert any(o is made_while_serving for o in gc.get_objects())
    finally:
        gc.unfreeze()
