"""Small C kernels for the packages above: compiled on first use with the system compiler, cached, run on threads.

minigpt (the bf16 loss, ``minigpt.native_loss``) and miniquant (NF4, ``miniquant.native``) both build theirs
with ``minikernels.build``; this package imports nothing of ours.
"""
