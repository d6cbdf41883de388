"""Data plane: the transport seam and its rails (shm, tcp; verbs later)."""
