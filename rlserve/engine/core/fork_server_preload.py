"""What the fork server that engine-core processes are forked from imports at its start (multiprocessing's
forkserver preload; see rlserve.engine.frontend.launcher): the engine, once for every core, and the fork server's
own signal manners. Imported there only."""

import signal
import time

import rlserve.engine.core.service  # noqa: F401  (the engine's modules, imported once for every core)
from rlserve.engine.wire.process import process_age_s
from rlserve.model.loader import import_config_classes

import_config_classes()

# What the imports took and when they ended: a core forked from here logs both in its start-up line, so that the
# start-up timeline shows whether a core waited for this preload or the preload for the front end's request.
IMPORTS_S = process_age_s()
IMPORTS_ENDED = time.time()

# The fork server reports the exit status of the cores it forked. A SIGTERM to the whole process group (a supervisor
# stopping `rlserve serve`, `kill -- -PGID`) must not end it before them, or a core's clean exit reads as "died (exit
# code 255)" in the front end. It exits by itself when the front end that started it goes (multiprocessing closes
# its pipe). A forked core sets its own SIGTERM handler first thing.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
