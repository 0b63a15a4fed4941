"""Old path of `clawflow.local_stack`, kept only for bench/learning.py (which this refactor may not edit):
the same module object, not a copy. Import `clawflow.local_stack` instead; delete this file once bench/learning.py does."""

import sys

import clawflow.local_stack

sys.modules[__name__] = clawflow.local_stack
