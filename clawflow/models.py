"""Old path of `clawflow.base_model`, kept only for bench/learning.py (which this refactor may not edit):
the same module object, not a copy. Import `clawflow.base_model` instead; delete this file once bench/learning.py does."""

import sys

import clawflow.base_model

sys.modules[__name__] = clawflow.base_model
