"""Imported first by every Python process a test starts (helpers.env() puts this folder on
PYTHONPATH): the garbage collector's work on the objects that importing torch and torchvision
leaves, which is most of a short process's CPU time and none of what a test checks.

Measured on 2 cores (torch 2.14.1, torchvision 0.29.1, CPython 3.11): such a process holds
~330,000 objects that the collector tracks; it traverses them at each full collection while the
modules import (~0.5 CPU-s) and three times more at exit, as the interpreter tears the modules
down (~1.0 CPU-s). A run that stops at a bad option takes ~4.5 CPU-s, of which these ~1.5; over
the suite, about a quarter of its CPU time.

Here collections are rarer, and at exit, after every other exit handler, the objects left are
frozen, so that the interpreter's collections at exit skip them (a full collection before the
freeze cost ~0.2 CPU-s per process and found ~100 objects in a training run). So cyclic garbage
still alive at exit is not collected and its finalizers do not run, which Python does not promise
either; the scripts close their files and process groups before they exit. A process's output,
exit status and files are unchanged. The snippets' tests start their programs without this
folder (helpers.env(plain=True)), so that their exit is exactly a user's.
"""

import atexit
import gc

gc.set_threshold(50_000, 20, 100)
atexit.register(gc.freeze)  # the first registered: the last to run
