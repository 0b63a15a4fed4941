"""Old path of `clawflow.policy.registry`, kept only for bench/learning.py (which this refactor may not edit):
the same module object, not a copy. Import `clawflow.policy.registry` instead; delete this file once bench/learning.py does."""

import sys

import clawflow.policy.registry

sys.modules[__name__] = clawflow.policy.registry
