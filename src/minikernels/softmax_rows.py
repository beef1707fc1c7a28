"""C for one row of causal attention's softmax and of its gradient, shared by the kernels that hold scores.

    SOURCE = BF16_EXP_C + SOFTMAX_ROWS_C + my_kernels   # then softmax_row, softmax_grad_row, visible

A row is one query's bf16 scores over a span of keys [c0, c1) that covers the keys it sees (``visible``: causal,
at most `window` back where window > 0); ``softmax_row`` writes P = softmax(s·scale) over them in bf16, 0 at the
span's other keys, with its logsumexp (or P = exp(s·scale - lse) from a given one, the backward's recomputation);
``softmax_grad_row`` writes dS = P ∘ (dP - D)·scale with D = Σ P ∘ dP in fp32. exp and the bf16 roundings are
``minikernels.bf16_exp``'s. ``minigpt.native_attention`` runs them over whole rows of S (the span every key),
``minigpt.fused_attention`` over each block of 32 queries' scores (the span the block's keys).
"""

SOFTMAX_ROWS_C = r"""
/* the keys [*lo, *hi) that query t sees: causal, and at most `window` back (itself included) when window > 0 */
static inline void visible(int64_t t, int64_t window, int64_t* lo, int64_t* hi) {
    *hi = t + 1;
    *lo = window > 0 && t + 1 > window ? t + 1 - window : 0;
}

/* a row whose scores hold a NaN or an inf: NaN over the keys it sees, 0 elsewhere (no NaN reaches other queries'
   keys through the backward's products); row[0] is key c0, and it holds the keys [c0, c1) */
static void fill_nan(uint16_t* row, int64_t c0, int64_t c1, int64_t lo, int64_t hi) {
    for (int64_t j = c0; j < c1; j++) row[j - c0] = j >= lo && j < hi ? 0x7FC0 : 0;
}

#ifdef __AVX512F__
/* the n < 16 bf16 values at src in lanes [0, n) as fp32, 0 in the others: a masked load where the CPU has
   AVX512-BW (a copy into TAIL16's zero-padded block, read back at once, stalls on store forwarding) */
static inline __m512 load_tail16(const uint16_t* src, int64_t n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    TAIL16(n, src, block);
    return load16(block);
#endif
}

/* lanes [0, n) of v to bf16 at dst, rounded as store16 rounds; the others not written */
static inline void store_tail16(uint16_t* dst, int64_t n, __m512 v) {
    uint16_t block[16];
    store16(block, v);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    _mm256_mask_storeu_epi16(dst, (__mmask16)((1u << n) - 1u), _mm256_loadu_si256((const __m256i*)block));
#else
    memcpy(dst, block, (size_t)n * 2);
#endif
}

/* scores j..j + 15 of a row: its bf16 values (f NULL), or its fp32 sums f rounded to bf16 on the way (the same
   values); the tail's n < 16 likewise */
static inline __m512 scores16(const uint16_t* v, const float* f, int64_t j) {
    return f ? round16(_mm512_loadu_ps(f + j)) : load16(v + j);
}
static inline __m512 scores_tail16(const uint16_t* v, const float* f, int64_t j, int64_t n) {
    return f ? round16(_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), f + j)) : load_tail16(v + j, n);
}
#endif
static inline float score1(const uint16_t* v, const float* f, int64_t j) {
    return f ? f32_from_bf16(bf16_from_f32(f[j])) : f32_from_bf16(v[j]);
}

/* One row of scores: query t's over the keys [c0, c1) (row[0] is key c0; c0 at or before the first key t sees,
   c1 after its last), overwritten with P = softmax(s·scale) over the keys it sees, 0 at the others, in bf16; with
   src (not NULL), the scores are src's fp32 sums (src[0] key c0) rounded to bf16, and row is only written.
   have_lse = 0: compute the row's logsumexp (of s·scale) into *lse; 1: take *lse as given (the backward's
   recomputation). On AVX-512 a row's last n < 16 visible keys go through the 16-lane code too (load_tail16): a
   causal row is on average half a vector longer than a multiple of 16, and at 128 keys the scalar remainder took
   about a third of the time. */
static void softmax_row(uint16_t* row, const float* src, int64_t c0, int64_t c1, int64_t t, int64_t window,
                        float scale, float* lse, int have_lse) {
    int64_t lo, hi;
    visible(t, window, &lo, &hi);
    uint16_t* v = row + (lo - c0);  /* the n scores query t sees (or their sums at f) */
    const float* f = src ? src + (lo - c0) : NULL;
    int64_t n = hi - lo, j = 0;
#ifdef __AVX512F__
    int64_t tail = n % 16;
    __mmask16 tm = (__mmask16)((1u << tail) - 1u);  /* the tail's lanes */
    __m512 sb = _mm512_set1_ps(scale);
#endif
    if (!have_lse) {
        float m = -INFINITY;
        int bad = 0;
#ifdef __AVX512F__
        __m512 mv = _mm512_set1_ps(-INFINITY);
        __mmask16 odd = 0;  /* lanes that saw NaN or inf */
        for (; j + 16 <= n; j += 16) {
            __m512 x = _mm512_mul_ps(scores16(v, f, j), sb);
            odd |= _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_NEQ_UQ);
            mv = _mm512_max_ps(mv, x);
        }
        if (tail) {
            __m512 x = _mm512_mul_ps(scores_tail16(v, f, j, tail), sb);
            odd |= _mm512_mask_cmp_ps_mask(tm, _mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_NEQ_UQ);
            mv = _mm512_mask_max_ps(mv, tm, mv, x);
        }
        m = _mm512_reduce_max_ps(mv);
        bad = odd != 0;
        j = n;
#endif
        for (; j < n; j++) {
            float x = score1(v, f, j) * scale;
            if (!isfinite(x)) bad = 1;
            if (x > m) m = x;
        }
        if (bad) { fill_nan(row, c0, c1, lo, hi); *lse = NAN; return; }
        /* exp(x - m) once per key into e, summed; then P = e / Σ, rounded to bf16 */
        float e[n + 16], sum = 0.0f;
        j = 0;
#ifdef __AVX512F__
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, mb = _mm512_set1_ps(m);
        for (; j + 32 <= n; j += 32) {
            __m512 e0 = exp16(_mm512_sub_ps(_mm512_mul_ps(scores16(v, f, j), sb), mb));
            __m512 e1 = exp16(_mm512_sub_ps(_mm512_mul_ps(scores16(v, f, j + 16), sb), mb));
            _mm512_storeu_ps(e + j, e0); _mm512_storeu_ps(e + j + 16, e1);
            s0 = _mm512_add_ps(s0, e0); s1 = _mm512_add_ps(s1, e1);
        }
        for (; j + 16 <= n; j += 16) {
            __m512 e0 = exp16(_mm512_sub_ps(_mm512_mul_ps(scores16(v, f, j), sb), mb));
            _mm512_storeu_ps(e + j, e0);
            s0 = _mm512_add_ps(s0, e0);
        }
        if (tail) {  /* (the padding lanes' exp is neither summed nor stored into P) */
            __m512 e0 = exp16(_mm512_sub_ps(_mm512_mul_ps(scores_tail16(v, f, j, tail), sb), mb));
            _mm512_storeu_ps(e + j, e0);
            s1 = _mm512_mask_add_ps(s1, tm, s1, e0);
        }
        sum = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
        j = n;
#endif
        for (; j < n; j++) { e[j] = exp_nonpos(score1(v, f, j) * scale - m); sum += e[j]; }
        *lse = m + logf(sum);
        float inv = 1.0f / sum;
        memset(row, 0, (size_t)(lo - c0) * 2);
        j = 0;
#ifdef __AVX512F__
        __m512 ib = _mm512_set1_ps(inv);
        for (; j + 16 <= n; j += 16) store16(v + j, _mm512_mul_ps(_mm512_loadu_ps(e + j), ib));
        if (tail) store_tail16(v + j, tail, _mm512_mul_ps(_mm512_loadu_ps(e + j), ib));
        j = n;
#endif
        for (; j < n; j++) v[j] = bf16_from_f32(e[j] * inv);
        memset(row + (hi - c0), 0, (size_t)(c1 - hi) * 2);
        return;
    }
    /* P = exp(x - lse) from the saved logsumexp (the backward's recomputation) */
    float l = *lse;
    if (!isfinite(l)) { fill_nan(row, c0, c1, lo, hi); return; }
    memset(row, 0, (size_t)(lo - c0) * 2);
#ifdef __AVX512F__
    __m512 lb = _mm512_set1_ps(l), zero = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16)
        store16(v + j, exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_mul_ps(scores16(v, f, j), sb), lb), zero)));
    if (tail)
        store_tail16(v + j, tail,
                     exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_mul_ps(scores_tail16(v, f, j, tail), sb), lb), zero)));
    j = n;
#endif
    for (; j < n; j++) {
        float x = score1(v, f, j) * scale - l;
        v[j] = bf16_from_f32(exp_nonpos(x < 0.0f ? x : 0.0f));
    }
    memset(row + (hi - c0), 0, (size_t)(c1 - hi) * 2);
}

/* One row of softmax's gradient: query t's P and dP over the keys [c0, c1) (as softmax_row holds them):
   dp[j] = p[j]·(dp[j] - D)·scale over the keys it sees, 0 at the others (bf16, in place), with D = Σ_j p[j]·dp[j]
   over the same keys in fp32 (each row of dS sums to 0); the last n < 16 keys through the 16-lane code. With src
   (not NULL), dP is src's fp32 sums rounded to bf16, and g is only written. */
static void softmax_grad_row(const uint16_t* p, uint16_t* g, const float* src, int64_t c0, int64_t c1, int64_t t,
                             int64_t window, float scale) {
    int64_t lo, hi;
    visible(t, window, &lo, &hi);
    const uint16_t* pv = p + (lo - c0);
    uint16_t* gv = g + (lo - c0);
    const float* f = src ? src + (lo - c0) : NULL;
    int64_t n = hi - lo, j = 0;
    float d = 0.0f;
#ifdef __AVX512F__
    int64_t tail = n % 16;
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) acc = _mm512_add_ps(acc, _mm512_mul_ps(load16(pv + j), scores16(gv, f, j)));
    if (tail)
        acc = _mm512_mask_add_ps(acc, (__mmask16)((1u << tail) - 1u), acc,
                                 _mm512_mul_ps(load_tail16(pv + j, tail), scores_tail16(gv, f, j, tail)));
    d = _mm512_reduce_add_ps(acc);
    j = n;
#endif
    for (; j < n; j++) d += f32_from_bf16(pv[j]) * score1(gv, f, j);
    memset(g, 0, (size_t)(lo - c0) * 2);
    j = 0;
#ifdef __AVX512F__
    __m512 db = _mm512_set1_ps(d), sb = _mm512_set1_ps(scale);
    for (; j + 16 <= n; j += 16)
        store16(gv + j, _mm512_mul_ps(_mm512_mul_ps(load16(pv + j), _mm512_sub_ps(scores16(gv, f, j), db)), sb));
    if (tail) {
        __m512 pt = load_tail16(pv + j, tail), gt = scores_tail16(gv, f, j, tail);
        store_tail16(gv + j, tail, _mm512_mul_ps(_mm512_mul_ps(pt, _mm512_sub_ps(gt, db)), sb));
    }
    j = n;
#endif
    for (; j < n; j++)
        gv[j] = bf16_from_f32((f32_from_bf16(pv[j]) * (score1(gv, f, j) - d)) * scale);
    memset(g + (hi - c0), 0, (size_t)(c1 - hi) * 2);
}
"""
