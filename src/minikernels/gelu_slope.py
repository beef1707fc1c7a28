"""C helpers for GELU's gradient, shared by the bf16 kernels that apply it: dx = dy · slope(x), 16 lanes.

    SOURCE = BF16_EXP_C + BF16_SIGMOID_C + GELU_SLOPE_C + my_kernels   # (minikernels.build)

``gelu_tanh_slope16`` is the derivative of GPT-2's tanh form, ``gelu_erf_slope16`` the exact GELU's (Φ(x) + x·φ(x));
``minigpt.native_gelu`` documents both (their formulas, accuracy, NaN and inf). Its backward kernels multiply dy by
them, and ``miniquant.nf4_matmul`` multiplies its bf16-rounded input gradient by them before its one store (GELU's
gradient fused into the product that makes dy): the same operations, so the same bits.
"""

GELU_SLOPE_C = r"""
#define K_BETA 0.7978845608028654f   /* √(2/π) */
#define K_KAPPA 0.044715f
#define INV_SQRT2 0.70710678118654752f
#define INV_SQRT_2PI 0.39894228040143268f

#ifdef __AVX512F__
/* d/dx of x·σ(2u), u = K_BETA·(x + K_KAPPA·x³): s + 2·x·s·(1 - s)·K_BETA·(1 + 3·K_KAPPA·x²), s = σ(2u) */
static inline __m512 gelu_tanh_slope16(__m512 v) {
    __m512 two_beta = _mm512_set1_ps(2.0f * K_BETA), one = _mm512_set1_ps(1.0f);
    __m512 v2 = _mm512_mul_ps(v, v);
    __m512 s = sigmoid16(_mm512_mul_ps(two_beta, _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(K_KAPPA),
                                                                                _mm512_mul_ps(v, v2)))));
    __m512 slope = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(v, s), _mm512_sub_ps(one, s)),
                                 _mm512_mul_ps(two_beta, _mm512_add_ps(one, _mm512_mul_ps(_mm512_set1_ps(3.0f * K_KAPPA),
                                                                                          v2))));
    return _mm512_add_ps(s, slope);
}

/* Φ(x) + x·φ(x), Φ and φ the normal CDF and density. Φ(x) = 1 - h for x > 0 and h below, h = Φ(-|x|) = erfc(z)/2,
   z = |x|/√2, erfc(z) = t·P(t)·e^(-z²) with t = 1/(1 + p·z) (Abramowitz and Stegun 7.1.26, within 1.5e-7:
   PyTorch's erf is this formula); h is kept as it is, not formed as 1 + erf(-z), PyTorch's form, which cancels
   where Φ is small. φ(x) = e^(-z²)/√(2π): one exp serves both, where PyTorch computes erf and exp apart. At ±inf
   t and e^(-z²) are 0 and x·φ is NaN, as PyTorch's */
static inline __m512 gelu_erf_slope16(__m512 v) {
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 z = _mm512_mul_ps(_mm512_abs_ps(v), _mm512_set1_ps(INV_SQRT2));
    __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(z, _mm512_set1_ps(0.3275911f), one));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    __m512 e = exp16_short(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, z)));  /* e^(-z²) */
    __m512 h = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), t), _mm512_mul_ps(p, e));  /* erfc(z)/2 */
    __m512 cdf = _mm512_mask_sub_ps(h, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ), one, h);
    return _mm512_fmadd_ps(v, _mm512_mul_ps(e, _mm512_set1_ps(INV_SQRT_2PI)), cdf);
}
#endif
"""
