"""The RFC's named operators: declarations (``specs``), backends, and dispatch (``registry``).

Importing this package registers every operator and backend.
"""

from drifttool.ops import specs  # noqa: F401  (declarations first)
from drifttool.ops import strict  # noqa: F401
from drifttool.ops.registry import call, implementation, spec, specs as all_specs  # noqa: F401
