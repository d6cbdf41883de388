"""Where batches land: the receive ring in host memory, and delivery into GPU memory from it (or
straight into a device ring exported for GPUDirect RDMA).

Runs in the training process.
"""
