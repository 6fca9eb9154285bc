"""One rank of `python -m hybrid.train` under torchrun (run by
tests/test_checkpoint_multiprocess.py), killed with SIGKILL (`kill -9`) when asked.

With KILL_RANK and KILL_STEP set, that rank kills itself right after the asynchronous save
of step KILL_STEP has started (its shards copied to the host, the files being written by
Orbax's background threads on every rank): a crash in the middle of an asynchronous save.
Arguments: those of `python -m hybrid.train`.
"""

import os
import signal
import sys

from hybrid.checkpoint import _sharded
from hybrid.train import main

if os.environ.get("KILL_RANK") == os.environ.get("RANK"):
    start = _sharded.AsyncCheckpointer.save

    def save_then_die(self, directory, *, step, **kwargs):
        path = start(self, directory, step=step, **kwargs)
        if step == int(os.environ["KILL_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    _sharded.AsyncCheckpointer.save = save_then_die

sys.exit(main(sys.argv[1:]))
