"""KSpeedServer: memory pool, sample index, preload and feeding (the `kspeed-server` daemon)."""
