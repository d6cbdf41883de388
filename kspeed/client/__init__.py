"""KSpeedClient: the training-side library (epoch plans, receive ring, delivery)."""
