"""C helper: software prefetch a fixed distance ahead, for kernels that stream large tensors once.

    SOURCE = STREAM_PREFETCH_C + my_kernels   # then prefetch_ahead(p) once per 64-byte line a loop reads at p

Found on the loss's gradient (``minigpt.native_loss``), which reads each bf16 logit and writes its gradient over
it: at Llama 3's vocabulary and 512 tokens (131 MB) one thread over 256 rows took 47.6 ms without prefetch and
11.9 ms with it 2 KiB ahead (12.7 at 1 KiB, 12.5 at 8 KiB; a prefetch for writing no faster than this one for
reading); the same loop into another tensor took 25.7 ms. The hardware's own prefetcher did not keep up, least of
all with a stream read and written in place. Medians of 15 to 61 calls with the caches flushed, Intel Xeon with
AMX in a Firecracker VM, 2 threads unless said, 2026-12-06, before → after:
- the loss (512 × 128,256 bf16): its gradient, in place 48.8 → 12.6 ms; its logsumexp 19.7 → 15.8 ms;
- SwiGLU (512 × 8,192, Llama-3.2-1B's MLP): forward 2.0-2.3 → 1.6 ms, backward 2.7-2.8 → 2.5 ms;
- GELU (1,024 × 2,048, the bench's GPT shape): the exact one's gradient 1.23-1.24 → 0.95-0.98 ms, the tanh
  form's forward 1.10-1.16 → 0.82-0.84 ms.
The fused residual add and norm (``minigpt.native_norm``, rows of 2,048 fp32) gained 2% at most, and lost 30%
in its backward with a prefetch for every line: not taken there.

A prefetch never faults, so reading ahead past a row's or the tensor's end is safe
(tests/minikernels/test_stream_prefetch.py runs the kernels on tensors that end at a page the process may not
touch).
"""

AHEAD_BYTES = 2048  # how far ahead prefetch_ahead reads (the C's #define)

STREAM_PREFETCH_C = r"""
#define STREAM_AHEAD_BYTES 2048
/* the 64-byte line STREAM_AHEAD_BYTES past p into every cache level (a hint: never faults; GCC's and Clang's
   builtin, prefetcht0 on x86, and valid C elsewhere) */
static inline void prefetch_ahead(const void* p) {
    __builtin_prefetch((const char*)p + STREAM_AHEAD_BYTES, 0, 3);
}
"""
