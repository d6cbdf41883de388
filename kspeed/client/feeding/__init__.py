"""The data plane from the client's side: the feed that grants ring ranges to the servers and takes
in their completions, paced or not, the pump that turns completions into batches, the links to
the servers, failover to another server, and the builder that puts a feed together.

Runs in the training process (the pacing thread beside the training thread).
"""
