"""KSpeed: disaggregated data provisioning for deep-learning training.

Servers on spare nodes pool their memory, preload a dataset from backend storage and push ready
samples straight into the training process's buffers; a manager allocates and watches them.
"""

from kspeed._version import PROTOCOL_VERSIONS, __version__
from kspeed.errors import KSpeedError

__all__ = ["PROTOCOL_VERSIONS", "KSpeedError", "__version__"]
