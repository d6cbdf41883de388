"""ServiceManager: registry, allocation, health (the `kspeed-manager` daemon)."""
