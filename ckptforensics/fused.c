/* The diff's per-element statistics in one pass over each chunk (see fused.py).
 *
 * Each element of a tensor pair is loaded once and every sum, maximum and count the diff
 * needs is taken from it in registers: no temporaries, no second pass. Built by fused.py
 * with -O3 -ffp-contract=off (no silent fused multiply-adds: every rounding is the one
 * written here) and -fno-math-errno (lets sqrtf vectorise; it changes no value).
 *
 * Semantics mirror diffstats.py's torch code element for element:
 *  - maxima and counts are exact (order-free);
 *  - sums add exact fp64 products/values into one fp64 accumulator per vector lane (VL of
 *    them: 4 with AVX2, 8 with AVX-512), each summing n / VL terms, then lane by lane:
 *    error <= (n / VL + VL) 2^-53 sum |term| (1.5e-11 relative for a chunk of 2^19 on
 *    AVX2), where torch's fp32 dot over the same chunk is off by up to 1e-4 (measured);
 *  - the bound checks count exactly the elements torch's predicate flags; the caller
 *    reruns that predicate in torch only on a chunk where the count is not 0, to keep
 *    the first elements as evidence.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define LOAD_F32(p, i) (((const float *)(p))[i])
#define LOAD_BF16(p, i) bf16_to_f32(((const uint16_t *)(p))[i])
#ifdef __FLT16_MAX__ /* _Float16: GCC 12+ and clang on x86-64 and aarch64 */
#define LOAD_F16(p, i) ((float)((const _Float16 *)(p))[i])
#endif

/* ---------------------------------------------------------------- weights
 * dsum: [sum a^2, sum d^2, sum |d|, sum |a|]   (d = b - a in fp32, as torch computes it)
 * fmax: [max |d|, max |b|]
 * Non-finite values: the fp64 sums of squares cannot overflow on fp32 inputs, so they are
 * finite exactly when every a and every d is; otherwise the caller recomputes the chunk
 * with masks (non-finite values are rare, and data).
 */
#define WEIGHTS(NAME, LOAD)                                                                 \
    void NAME(const void *restrict a, const void *restrict b, int64_t n, double *dsum,      \
              float *fmax_) {                                                               \
        double s_a2 = 0, s_d2 = 0, s_ad = 0, s_aa = 0;                                      \
        float m_d = 0, m_b = 0;                                                             \
        _Pragma("omp simd reduction(+:s_a2,s_d2,s_ad,s_aa) reduction(max:m_d,m_b)")          \
        for (int64_t i = 0; i < n; i++) {                                                   \
            float x = LOAD(a, i), y = LOAD(b, i);                                           \
            float d = y - x, ad = fabsf(d), ax = fabsf(x), ay = fabsf(y);                   \
            s_a2 += (double)x * (double)x;                                                  \
            s_d2 += (double)d * (double)d;                                                  \
            s_ad += (double)ad;                                                             \
            s_aa += (double)ax;                                                             \
            m_d = ad > m_d ? ad : m_d;                                                      \
            m_b = ay > m_b ? ay : m_b;                                                      \
        }                                                                                   \
        dsum[0] = s_a2, dsum[1] = s_d2, dsum[2] = s_ad, dsum[3] = s_aa;                     \
        fmax_[0] = m_d, fmax_[1] = m_b;                                                     \
    }

WEIGHTS(cf_weights_f32, LOAD_F32)
WEIGHTS(cf_weights_bf16, LOAD_BF16)
#ifdef LOAD_F16
WEIGHTS(cf_weights_f16, LOAD_F16)
#endif

/* ---------------------------------------------------------------- Adam moments
 * Inputs: m_A, m_B, v_A, v_B of one chunk (n < 2^31: the counts are int32 lanes, which
 * vectorise with fp32 ones); the share sample is the chunk positions
 * i with (i & smask) == 0 (smask = stride - 1, stride a power of two).
 * par (float): [thr, fl(thr eps), fl(100 eps^2), fl(floor_k), fl(c)], each Python scalar
 * rounded to fp32 as torch rounds one it multiplies or compares an fp32 tensor with.
 * dsum: [sum v_A, sum v_B]
 * fmax: [max |m_B|, max v_B]
 * cnt:  [non-finite m_B, v_A, v_B, rho_A, rho_B, vanished_A, vanished_B, sampled,
 *        v_A > 0, v_B < fl(v_A floor_k), |m_B| > fl(fl(sqrt v_B) c)]
 * Every count is a predicate that rounds the same on any ALU, so the torch fallback
 * (diffstats) counts the same elements: rho is |m| - thr sqrt(v) > thr eps in fp64, where
 * thr sqrt(v) (two fp32 values) is exact and only the difference rounds, once, fused or
 * not (in fp32, a fused multiply-add and a multiply then add round differently, and
 * which one torch runs depends on its build and the tensor's strides); the v floor and
 * the m bound are one IEEE multiply each (and a correctly rounded square root).
 */
#define RHO(am, sq) ((double)(am) - (double)thr * (double)(sq))
#define MOMENTS(NAME, LOAD)                                                                 \
    void NAME(const void *restrict ma, const void *restrict mb, const void *restrict va,    \
              const void *restrict vb, int64_t n, int64_t smask, const float *par,          \
              double *dsum, float *fmax_, int64_t *cnt) {                                   \
        const float thr = par[0], rho_t = par[1], van_t = par[2], fk = par[3], c = par[4];  \
        double s_va = 0, s_vb = 0;                                                          \
        float m_m = 0, m_v = -INFINITY;                                                     \
        int32_t nf_m = 0, nf_va = 0, nf_vb = 0, r_a = 0, r_b = 0, z_a = 0, z_b = 0;         \
        int32_t smp = 0, pos = 0, low = 0, big = 0;                                         \
        _Pragma("omp simd reduction(+:s_va,s_vb,nf_m,nf_va,nf_vb,r_a,r_b,z_a,z_b,smp,pos,low,big) reduction(max:m_m,m_v)") \
        for (int64_t i = 0; i < n; i++) {                                                   \
            float xa = LOAD(ma, i), xb = LOAD(mb, i), ya = LOAD(va, i), yb = LOAD(vb, i);   \
            float amb = fabsf(xb), sqb = sqrtf(yb);                                         \
            int s = (i & smask) == 0;                                                       \
            s_va += (double)ya;                                                             \
            s_vb += (double)yb;                                                             \
            m_m = amb > m_m ? amb : m_m;                                                    \
            m_v = yb > m_v ? yb : m_v;                                                      \
            nf_m += !(amb <= FLT_MAX);                                                      \
            nf_va += !(fabsf(ya) <= FLT_MAX);                                               \
            nf_vb += !(fabsf(yb) <= FLT_MAX);                                               \
            r_a += s & (RHO(fabsf(xa), sqrtf(ya)) > (double)rho_t);                        \
            r_b += s & (RHO(amb, sqb) > (double)rho_t);                                     \
            z_a += s & (ya < van_t);                                                        \
            z_b += s & (yb < van_t);                                                        \
            smp += s;                                                                       \
            pos += ya > 0.0f;                                                               \
            low += yb < ya * fk;                                                            \
            big += amb > sqb * c;                                                           \
        }                                                                                   \
        dsum[0] = s_va, dsum[1] = s_vb;                                                     \
        fmax_[0] = m_m, fmax_[1] = m_v;                                                     \
        cnt[0] = nf_m, cnt[1] = nf_va, cnt[2] = nf_vb, cnt[3] = r_a, cnt[4] = r_b;          \
        cnt[5] = z_a, cnt[6] = z_b, cnt[7] = smp, cnt[8] = pos, cnt[9] = low, cnt[10] = big; \
    }

MOMENTS(cf_moments_f32, LOAD_F32)
MOMENTS(cf_moments_bf16, LOAD_BF16)
#ifdef LOAD_F16
MOMENTS(cf_moments_f16, LOAD_F16)
#endif

/* ---------------------------------------------------------------- replay probe rows
 * The module probe's table rows of n fp32 tensors (contiguous), each in one pass, written
 * to out + width * rows[k] in order (a row given twice keeps its last; the probe calls it
 * for one tensor at a time, cf_probe_one_f32, from the tensor's hook):
 *   width 6 (outputs):   [max |x|, RMS, non-finite, over fp16's max, over bf16's max, 0]
 *   width 3 (gradients): [L2 norm, max |x|, non-finite]
 * as probes._derive derives them from torch's norm and aminmax: max |x| is NaN where an
 * element is (a NaN makes the square sum NaN; an inf only makes it inf), and the flags
 * follow from it. Squares add in fp32 vector lanes over blocks of PROBE_BLOCK elements
 * (each lane a few hundred terms: torch's fp32 norm is as far off), blocks in fp64;
 * fp64 lanes throughout cost 1.35x the time at 64 wide.
 */
#define PROBE_BLOCK 4096
void cf_probe_f32(int64_t n, const int64_t *ptrs, const int64_t *numels, const int64_t *rows,
                  float *out, int64_t width, float fp16_max, float bf16_max) {
    for (int64_t k = 0; k < n; k++) {
        const float *restrict x = (const float *)(intptr_t)ptrs[k];
        const int64_t m = numels[k];
        double s = 0;
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t j = 0; j < m; j += PROBE_BLOCK) {
            const int64_t e = j + PROBE_BLOCK < m ? j + PROBE_BLOCK : m;
            float b = 0;
            _Pragma("omp simd reduction(+:b) reduction(min:lo) reduction(max:hi)")
            for (int64_t i = j; i < e; i++) {
                float v = x[i];
                b += v * v;
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            s += (double)b;
        }
        float top = isnan(s) ? NAN : (-lo > hi ? -lo : hi);
        float l2 = (float)sqrt(s);
        float nonfinite = isfinite(top) ? 0.0f : 1.0f;
        float *o = out + width * rows[k];
        if (width == 6) {
            o[0] = top;
            o[1] = l2 / (float)sqrt((double)(m > 1 ? m : 1));
            o[2] = nonfinite;
            o[3] = top > fp16_max ? 1.0f : 0.0f;
            o[4] = top > bf16_max ? 1.0f : 0.0f;
            o[5] = 0.0f;
        } else {
            o[0] = l2;
            o[1] = top;
            o[2] = nonfinite;
        }
    }
}

/* ---------------------------------------------------------------- replay parameter sums
 * Per parameter k, its gradient g (fp32, contiguous, n[k] elements) and Adam's second
 * moment v (fp32, contiguous; vp[k] = 0: no Adam state): out[4k .. 4k + 3] =
 * [sum g^2, sum r, spikes, finite] with r = g^2 / (v + e[k]) in fp32 (e: eps^2 / c, rounded
 * to fp32 as torch rounds the scalar it adds), spikes = elements with r > 5000 (a NaN r
 * not counted, an inf counted), finite = 1 when the fp64 sum of g is finite; sums in fp64
 * of the fp32 terms. Without v: sum r = NaN, spikes 0. What paramstats._block_sums takes
 * in a dozen torch ops per block, in one pass per parameter.
 */
void cf_params_f32(int64_t n, const int64_t *gp, const int64_t *vp, const int64_t *numels,
                   const float *e, double *out) {
    for (int64_t k = 0; k < n; k++) {
        const float *restrict g = (const float *)(intptr_t)gp[k];
        const float *restrict v = (const float *)(intptr_t)vp[k];
        const int64_t m = numels[k];
        const float ek = e[k];
        double sq = 0, rs = 0, fs = 0;
        int64_t sp = 0;
        if (v) {
            _Pragma("omp simd reduction(+:sq,rs,fs,sp)")
            for (int64_t i = 0; i < m; i++) {
                float x = g[i], g2 = x * x, r = g2 / (v[i] + ek);
                sq += (double)g2;
                rs += (double)r;
                fs += (double)x;
                sp += r > 5000.0f;
            }
        } else {
            _Pragma("omp simd reduction(+:sq,fs)")
            for (int64_t i = 0; i < m; i++) {
                float x = g[i];
                sq += (double)(x * x);
                fs += (double)x;
            }
            rs = NAN;
        }
        out[4 * k] = sq;
        out[4 * k + 1] = rs;
        out[4 * k + 2] = (double)sp;
        out[4 * k + 3] = isfinite(fs) ? 1.0 : 0.0;
    }
}

/* ---------------------------------------------------------------- per-sample products
 * A fused linear's per-sample weight gradients p [B, N] (fp32, contiguous): norms[b] =
 * sqrt(sum_i p[b, i]^2) (fp64 sum) and sum[i] = p[0, i] + p[1, i] + ... in fp32, in that
 * order (torch's sum over dim 0 of a contiguous [B, N] adds the same terms in the same
 * order), in one pass instead of two torch reductions; with `accumulate`, added to what
 * sum holds (a gradient already there: a tied weight, a second call), in the same pass.
 */
void cf_persample_f32(const float *restrict p, int64_t b, int64_t n, float *restrict norms,
                      float *restrict sum, int64_t accumulate) {
    for (int64_t k = 0; k < b; k++) {
        const float *restrict row = p + k * n;
        double s = 0;
        if (k == 0 && !accumulate) {
            _Pragma("omp simd reduction(+:s)")
            for (int64_t i = 0; i < n; i++) {
                float v = row[i];
                s += (double)v * (double)v;
                sum[i] = v;
            }
        } else {
            _Pragma("omp simd reduction(+:s)")
            for (int64_t i = 0; i < n; i++) {
                float v = row[i];
                s += (double)v * (double)v;
                sum[i] += v;
            }
        }
        norms[k] = (float)sqrt(s);
    }
}

/* One tensor's probe row (cf_probe_f32 for n = 1, without the arrays): called from the
 * probe's hook while the tensor is still in cache. */
void cf_probe_one_f32(const float *x, int64_t m, float *out, int64_t width, float fp16_max,
                      float bf16_max) {
    const int64_t row = 0;
    const int64_t ptr = (int64_t)(intptr_t)x;
    cf_probe_f32(1, &ptr, &m, &row, out, width, fp16_max, bf16_max);
}
