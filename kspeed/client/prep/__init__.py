"""Client-side preprocessing: the stages of a pipeline that run on the training node (worker
processes for CPU stages, the GPU for ``gpu`` stages) and the split of a folder dataset's
transforms between servers and client.

Runs in the training process and its preprocessing worker processes.
"""
