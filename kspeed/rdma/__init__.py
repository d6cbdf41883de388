"""Data plane: the transport seam (:mod:`.base`) and its rails (shm, tcp, verbs), chosen by name from :mod:`.rails`."""
