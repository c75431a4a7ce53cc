"""The RFC's named operators: declarations (``specs``), backends, and dispatch (``registry``).

Importing this package registers every operator and both backends.
"""

from drifttool.ops import specs  # noqa: F401  (declarations first)
from drifttool.ops import production, scheduler, strict  # noqa: F401  (backends)
from drifttool.ops.registry import call, implementation, spec  # noqa: F401
from drifttool.ops.registry import specs as all_specs  # noqa: F401
