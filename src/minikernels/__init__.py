"""Small C kernels for the packages above: compiled on first use with the system compiler, cached, run on threads.

minigpt (the bf16 loss and attention, ``minigpt.native_loss`` and ``minigpt.native_attention``) and miniquant
(NF4, ``miniquant.native``) build theirs with ``minikernels.build``; ``minikernels.bf16_exp`` holds the C helpers
the bf16 kernels share (bf16 conversions, exp), ``minikernels.stream_prefetch`` the read-ahead of those that
stream large tensors. This package imports nothing of ours.
"""
