"""Self-tuning of a rank's preprocessing split (``offload="auto"``): measure, decide, re-decide."""
