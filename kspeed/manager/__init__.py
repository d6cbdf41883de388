"""ServiceManager: membership, allocation, health (the `kspeed-manager` daemon)."""
