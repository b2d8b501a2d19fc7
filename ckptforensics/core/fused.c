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
#include <stdlib.h>
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

/* The same with the width and limits fixed (fp16's largest 65504, bf16's (2 - 2^-7) 2^127):
 * an output's row (width 6) and a gradient's (width 3). Three arguments: ctypes converts
 * each one on every call, and the probe's hooks call these some 50 times a step. */
void cf_probe_out_f32(const float *x, int64_t m, float *out) {
    cf_probe_one_f32(x, m, out, 6, 0x1.ffcp15f, 0x1.fep127f);
}

void cf_probe_grad_f32(const float *x, int64_t m, float *out) {
    cf_probe_one_f32(x, m, out, 3, 0x1.ffcp15f, 0x1.fep127f);
}

/* ---------------------------------------------------------------- causal attention
 * exp(x) for x in [-176, 0] (cf_exp_clamp puts it there), vectorisable (glibc's expf is
 * not, without -ffast-math), after Cephes' expf: n = round(x / ln 2) by adding 1.5 2^23,
 * r = x - n ln 2 in two parts (ln 2's high part has 9 bits: n times it is exact), e^r =
 * 1 + r + r^2 P(r) on |r| <= ln 2 / 2 with P of degree 4 (a minimax fit of (e^r - 1 -
 * r) / r^2 weighted to e^r's relative error: 3.3e-9 before rounding), then 2^n as the
 * product of 2^(n/2) and 2^(n - n/2), two powers of two made from the exponent bits, so
 * that a subnormal result rounds once. Against fp64 exp on every float in [-176, 0],
 * built with these flags: at most 0.98 ulp of the result (0.75 of the spacing where the
 * result is subnormal); 0 below -103.98, as exp rounds there; exp(0) = 1 exactly. At
 * -176 both powers of two are 0 (exponent field 0): a masked key's 0 is a product with 0,
 * no underflow (an underflowing product costs a microcode assist on x86: 1.5x the time
 * of the whole kernel when every masked key took one).
 */
static inline float cf_as_float(int32_t i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

static inline int32_t cf_as_int(float f) {
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i;
}

static inline float cf_exp_neg(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float fn = x * 1.44269504088896341f + magic;
    const int32_t n = cf_as_int(fn) - cf_as_int(magic), n1 = n >> 1, n2 = n - n1;
    const float nf = fn - magic;
    float r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    float p = 1.3813144760e-3f;
    p = p * r + 8.3694187924e-3f;
    p = p * r + 4.1668456048e-2f;
    p = p * r + 1.6666515172e-1f;
    p = p * r + 4.9999994040e-1f;
    const float y = p * (r * r) + r + 1.0f;
    return y * cf_as_float((n1 + 127) << 23) * cf_as_float((n2 + 127) << 23);
}

/* max(x, -176) for x in [-inf, 0]: on the bits, as unsigned integers (a float select
 * here would be made a branch by GCC, which then leaves the loop scalar without AVX-512) */
static inline float cf_exp_clamp(float x) {
    const uint32_t lo = 0xC3300000u; /* -176.0f */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = u < lo ? u : lo;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Causal attention's statistics of L calls' logits s [L, b, H, t, S] (fp32, contiguous)
 * with SDPA's top-left causal mask added as a 0 / -inf bias (query row i attends keys
 * j <= i; trusted: a key past that is read only for a NaN, or to skip it), per call l
 * and head h into out[l, h] = [top, ents, rows], as
 * attnstats._accumulate takes them in a dozen torch ops:
 *  - top: the max over (b, t, S), exact;
 *  - ents: the sum over (b, t) of w[i] H(row), w the row's weight (1 / log(keys); 0 for a
 *    row with one key, whose entropy is then not computed), H = -sum p log p over the
 *    row's softmax p, as H = log Z - T / Z with d = x - max (in fp32, as torch subtracts
 *    it), Z = sum e^d, T = sum e^d d: two sums of one sign (no cancellation), and Z =
 *    (keys at the max: a count, exact) + (the others' sum), so that log Z keeps its
 *    digits in a near one-hot row (torch's fp32 log Z is off by up to 6e-8, absolute,
 *    there). As torch's nansum of softmax * log_softmax: a key at -inf (masked, or a -inf
 *    logit) adds 0 (e^d = 0, and d is clamped to -176 first, so e^d d is 0, not NaN); a
 *    row holding +inf (softmax NaN throughout) or only -inf (nothing to attend) adds 0
 *    (its max is not finite: H is not computed);
 *  - rows: `rows` (the caller counts them from the mask).
 * CF_ROWS query rows are a vector's lanes: their keys up to the last one the last of them
 * may attend are copied transposed into xt [keys, CF_ROWS] (taking the rows' max and a
 * NaN check on the way), so that every loop after is vertical (no sum across lanes); the
 * masked keys past those are only checked for NaN.
 * Sums: e^d and e^d d in fp32 per lane over CF_KEYS keys (terms of one sign: relative
 * error <= CF_KEYS 2^-24 = 3.8e-6 at worst, ~5e-7 typically), then in fp64; T / Z and
 * the sums over rows in fp64; log Z as the log of the fp64 product of CF_LOGS batch rows'
 * Z (each <= S: no overflow), one log per CF_LOGS rows. Measured against torch's fp32
 * path: ~1e-7 relative on random logits, where each is as far from an fp64 computation.
 * Returns 0; 1 (out unspecified) where a logit is NaN (a masked NaN or +inf logit turns
 * NaN under the bias): the caller takes its masked_fill path, which sets those to -inf;
 * -1 where the scratch (CF_ROWS S floats, 3 t doubles) could not be allocated.
 */
#define CF_ROWS 16
#define CF_KEYS 64
#define CF_LOGS 16

/* One key's terms for the lanes r0.. of CF_ROWS rows: y its logits, mm the rows' max. */
static inline void cf_attn_terms(const float *restrict y, const float *restrict mm, int64_t r0,
                                 int32_t *restrict ones, float *restrict zf,
                                 float *restrict tf) {
    _Pragma("omp simd")
    for (int64_t r = r0; r < CF_ROWS; r++) {
        const float d = cf_exp_clamp(y[r] - mm[r]), e = cf_exp_neg(d);
        ones[r] += d == 0.0f;
        zf[r] += d < 0.0f ? e : 0.0f;
        tf[r] += e * d;
    }
}

int64_t cf_attn_causal_f32(const float *s, int64_t nl, int64_t b, int64_t nh, int64_t t,
                           int64_t sk, const float *w, float rows, float *out) {
    float *xt = malloc(sizeof(float) * CF_ROWS * (size_t)(sk > 0 ? sk : 1));
    double *pz = malloc(sizeof(double) * 3 * (size_t)(t > 0 ? t : 1)), *q = pz + t, *lz = q + t;
    int64_t ret = 0;
    if (!xt || !pz) {
        ret = -1;
        goto done;
    }
    for (int64_t l = 0; l < nl; l++) {
        for (int64_t h = 0; h < nh; h++) {
            float top = -INFINITY;
            for (int64_t i = 0; i < t; i++)
                pz[i] = 1.0, q[i] = 0.0, lz[i] = 0.0;
            for (int64_t bi = 0; bi < b; bi++) {
                const float *blk = s + ((l * b + bi) * nh + h) * t * sk;
                for (int64_t i0 = 0; i0 < t; i0 += CF_ROWS) {
                    const int64_t nr = t - i0 < CF_ROWS ? t - i0 : CF_ROWS;
                    const int64_t ke = i0 + CF_ROWS < sk ? i0 + CF_ROWS : sk;
                    float m[CF_ROWS], mm[CF_ROWS], zf[CF_ROWS], tf[CF_ROWS];
                    double zd[CF_ROWS], td[CF_ROWS];
                    int32_t bad[CF_ROWS], fin[CF_ROWS], ones[CF_ROWS], nan = 0, odd = 0;
                    for (int64_t r = 0; r < nr; r++) {
                        const float *restrict x = blk + (i0 + r) * sk;
                        for (int64_t j = ke; j < sk; j++) /* (an omp simd reduction: slower) */
                            nan |= x[j] != x[j];
                    }
                    _Pragma("omp simd")
                    for (int64_t r = 0; r < CF_ROWS; r++)
                        m[r] = -INFINITY, bad[r] = 0, ones[r] = 0, zd[r] = 0, td[r] = 0;
                    for (int64_t j = 0; j < ke; j++) {
                        float *restrict y = xt + j * CF_ROWS;
                        if (nr == CF_ROWS) {
                            _Pragma("omp simd")
                            for (int64_t r = 0; r < CF_ROWS; r++)
                                y[r] = blk[(i0 + r) * sk + j];
                        } else {
                            for (int64_t r = 0; r < CF_ROWS; r++)
                                y[r] = r < nr ? blk[(i0 + r) * sk + j] : -INFINITY;
                        }
                        _Pragma("omp simd")
                        for (int64_t r = 0; r < CF_ROWS; r++) {
                            const float v = y[r];
                            m[r] = v > m[r] ? v : m[r];
                            bad[r] |= v != v;
                        }
                    }
                    for (int64_t r = 0; r < CF_ROWS; r++) {
                        nan |= bad[r];
                        top = m[r] > top ? m[r] : top;
                        fin[r] = fabsf(m[r]) <= FLT_MAX;
                        mm[r] = fin[r] ? m[r] : 0.0f;
                        odd |= !fin[r];
                    }
                    if (nan) {
                        ret = 1;
                        goto done;
                    }
                    if (odd) { /* a row whose max is not finite (or a lane past t): -inf
                                * throughout, so that its lanes stay in exp's domain */
                        for (int64_t j = 0; j < ke; j++)
                            for (int64_t r = 0; r < CF_ROWS; r++)
                                if (!fin[r])
                                    xt[j * CF_ROWS + r] = -INFINITY;
                    }
                    for (int64_t j0 = 0; j0 < ke; j0 += CF_KEYS) {
                        const int64_t je = j0 + CF_KEYS < ke ? j0 + CF_KEYS : ke;
                        _Pragma("omp simd")
                        for (int64_t r = 0; r < CF_ROWS; r++)
                            zf[r] = 0, tf[r] = 0;
                        for (int64_t j = j0; j < je; j++) {
                            /* from key i0 + CF_ROWS / 2 on, the first half of the rows
                             * attends none: those lanes would add 0 */
                            if (j < i0 + CF_ROWS / 2)
                                cf_attn_terms(xt + j * CF_ROWS, mm, 0, ones, zf, tf);
                            else
                                cf_attn_terms(xt + j * CF_ROWS, mm, CF_ROWS / 2, ones, zf, tf);
                        }
                        _Pragma("omp simd")
                        for (int64_t r = 0; r < CF_ROWS; r++)
                            zd[r] += (double)zf[r], td[r] += (double)tf[r];
                    }
                    _Pragma("omp simd")
                    for (int64_t r = 0; r < nr; r++) {
                        const int use = w[i0 + r] != 0.0f && fin[r];
                        const double z = zd[r] + (double)ones[r];
                        pz[i0 + r] *= use ? z : 1.0;
                        q[i0 + r] += use ? td[r] / z : 0.0;
                    }
                }
                if (bi % CF_LOGS == CF_LOGS - 1 || bi == b - 1) {
                    for (int64_t i = 0; i < t; i++) {
                        lz[i] += pz[i] != 1.0 ? log(pz[i]) : 0.0;
                        pz[i] = 1.0;
                    }
                }
            }
            double ents = 0;
            for (int64_t i = 0; i < t; i++)
                ents += (double)w[i] * (lz[i] - q[i]);
            float *o = out + 3 * (l * nh + h);
            o[0] = top;
            o[1] = (float)ents;
            o[2] = rows;
        }
    }
done:
    free(xt);
    free(pz);
    return ret;
}

/* ---------------------------------------------------------------- replay logit figures
 * The logits x [rows, v] (fp32, contiguous) of a replayed step: out = [max |x|, sum over
 * rows of log Z (fp64), rows], log Z = logsumexp of a row as torch.logsumexp takes it: NaN
 * for a row holding a NaN, +inf for one holding +inf, -inf for a row of -inf, else
 * m + log(sum exp(x - m)) with m the row's max (exp as cf_exp_neg: <= 0.98 ulp; terms in
 * fp32 lanes over blocks of PROBE_BLOCK keys, blocks in fp64). max |x| is NaN where an
 * element is (torch.aminmax propagates it). What session.py's logit figures take in six
 * torch ops, in one pass per row while the row is in cache.
 */
void cf_logits_f32(const float *x, int64_t rows, int64_t v, double *out) {
    float top = 0.0f;
    int32_t nan = 0;
    double sum = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict y = x + r * v;
        float m = -INFINITY, a = 0.0f;
        int32_t bad = 0;
        _Pragma("omp simd reduction(max:m, a) reduction(|:bad)")
        for (int64_t j = 0; j < v; j++) {
            const float u = y[j];
            m = u > m ? u : m;
            const float au = fabsf(u);
            a = au > a ? au : a;
            bad |= u != u;
        }
        nan |= bad;
        top = a > top ? a : top;
        if (bad) {
            sum += NAN;
        } else if (m == INFINITY || m == -INFINITY) {
            sum += (double)m;
        } else {
            double s = 0.0;
            for (int64_t j0 = 0; j0 < v; j0 += PROBE_BLOCK) {
                const int64_t e = j0 + PROBE_BLOCK < v ? j0 + PROBE_BLOCK : v;
                float b = 0.0f;
                _Pragma("omp simd reduction(+:b)")
                for (int64_t j = j0; j < e; j++)
                    b += cf_exp_neg(cf_exp_clamp(y[j] - m));
                s += (double)b;
            }
            sum += (double)m + log(s);
        }
    }
    out[0] = nan ? NAN : (double)top;
    out[1] = sum;
    out[2] = (double)rows;
}


/* ---------------------------------------------------------------- CRC-32
 * The zip format's CRC-32 (zlib's crc32: the reflected polynomial 0xEDB88320) of n bytes,
 * continuing `crc` (0 to start): a torch.save member streamed in chunks is checked over the
 * bytes the diff reads anyway, while they are in cache (formats/integrity.py). Where the CPU
 * has carry-less multiplies (x86-64 PCLMULQDQ, and VPCLMULQDQ on AVX-512 for four at once)
 * the bulk is folded (Gopal et al., "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ", Intel 2009: the constants are its bit-reflected (x^(d+-32) mod P) << 1 for a
 * fold over d bits, k5 = (x^64 mod P) << 1, and Barrett's mu and P); the ends, and CPUs
 * without it, go a byte at a time through a table: slower than zlib's crc32, so a caller
 * asks cf_crc32_folds() first.
 */
static uint32_t cf_crc_table[256];

__attribute__((constructor)) static void cf_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        cf_crc_table[i] = c;
    }
}

static uint32_t cf_crc_bytes(uint32_t c, const uint8_t *p, int64_t n) {
    while (n-- > 0)
        c = cf_crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CF_CRC_FOLD 1
#define CF_K(hi, lo) _mm_set_epi64x((long long)(hi), (long long)(lo))

/* x folded 16 bytes on (k3, k4) and the next 16 bytes y added */
__attribute__((target("pclmul,sse4.1"))) static inline __m128i cf_fold16(__m128i x, __m128i y) {
    const __m128i k3k4 = CF_K(0x00ccaa009e, 0x01751997d0);
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k3k4, 0x11), y),
                         _mm_clmulepi64_si128(x, k3k4, 0x00));
}

/* Four lanes of 128 bits (the last 64 bytes folded so far) and the n < 64 bytes left (a
 * multiple of 16) -> the running register. */
__attribute__((target("pclmul,sse4.1"))) static inline uint32_t
cf_crc_finish(__m128i x1, __m128i x2, __m128i x3, __m128i x4, const uint8_t *p, int64_t n) {
    const __m128i k3k4 = CF_K(0x00ccaa009e, 0x01751997d0);
    const __m128i k5 = CF_K(0, 0x0163cd6124);
    const __m128i poly = CF_K(0x01f7011641, 0x01db710641); /* mu, P */
    const __m128i lo32 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = cf_fold16(cf_fold16(cf_fold16(x1, x2), x3), x4);
    for (; n >= 16; p += 16, n -= 16)
        x1 = cf_fold16(x1, _mm_loadu_si128((const __m128i *)p));
    /* 128 bits to 64, then 64 to 32 by Barrett's reduction */
    __m128i x2_ = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2_);
    x2_ = _mm_srli_si128(x1, 4);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, lo32), k5, 0x00), x2_);
    x2_ = _mm_clmulepi64_si128(_mm_and_si128(x1, lo32), poly, 0x10);
    x2_ = _mm_clmulepi64_si128(_mm_and_si128(x2_, lo32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x1, x2_), 1);
}

/* crc: the running register; n: a multiple of 16, at least 64. Four lanes of 128 bits
 * folded 64 bytes on at a time. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t cf_crc_fold(uint32_t crc,
                                                                      const uint8_t *p,
                                                                      int64_t n) {
    const __m128i k1k2 = CF_K(0x01c6e41596, 0x0154442bd4);
    __m128i x[4];
    for (int i = 0; i < 4; i++)
        x[i] = _mm_loadu_si128((const __m128i *)(p + 16 * i));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)crc));
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64)
        for (int i = 0; i < 4; i++)
            x[i] = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x[i], k1k2, 0x11),
                                               _mm_loadu_si128((const __m128i *)(p + 16 * i))),
                                 _mm_clmulepi64_si128(x[i], k1k2, 0x00));
    return cf_crc_finish(x[0], x[1], x[2], x[3], p, n);
}

/* The same with AVX-512's VPCLMULQDQ: four registers of four lanes folded 256 bytes on at
 * a time (n: a multiple of 16, at least 256). */
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1"))) static uint32_t
cf_crc_fold512(uint32_t crc, const uint8_t *p, int64_t n) {
    const __m512i k16 = _mm512_broadcast_i32x4(CF_K(0x01322d1430, 0x011542778a));
    const __m512i k4 = _mm512_broadcast_i32x4(CF_K(0x01c6e41596, 0x0154442bd4));
    __m512i z[4];
    for (int i = 0; i < 4; i++)
        z[i] = _mm512_loadu_si512((const void *)(p + 64 * i));
    z[0] = _mm512_xor_si512(z[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)crc)));
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256)
        for (int i = 0; i < 4; i++)
            z[i] = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(z[i], k16, 0x11),
                                             _mm512_clmulepi64_epi128(z[i], k16, 0x00),
                                             _mm512_loadu_si512((const void *)(p + 64 * i)),
                                             0x96); /* a ^ b ^ c */
    /* the four registers into one, 64 bytes on at a time, then what is left of 64 */
    __m512i y = z[0];
    for (int i = 1; i < 4; i++)
        y = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(y, k4, 0x11),
                                      _mm512_clmulepi64_epi128(y, k4, 0x00), z[i], 0x96);
    for (; n >= 64; p += 64, n -= 64)
        y = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(y, k4, 0x11),
                                      _mm512_clmulepi64_epi128(y, k4, 0x00),
                                      _mm512_loadu_si512((const void *)p), 0x96);
    return cf_crc_finish(_mm512_extracti32x4_epi32(y, 0), _mm512_extracti32x4_epi32(y, 1),
                         _mm512_extracti32x4_epi32(y, 2), _mm512_extracti32x4_epi32(y, 3), p, n);
}

/* 2: VPCLMULQDQ on AVX-512, 1: PCLMULQDQ, 0: neither (a byte at a time) */
static int cf_crc_level(void) {
    static int level = -1;
    if (level < 0) {
        __builtin_cpu_init();
        int fold = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
        int wide = fold && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq");
        level = wide ? 2 : fold;
    }
    return level;
}
#endif

int64_t cf_crc32_folds(void) {
#ifdef CF_CRC_FOLD
    return cf_crc_level();
#else
    return 0;
#endif
}

/* most: the widest fold to use (2, 1, 0: a byte at a time), for tests of each path */
int64_t cf_crc32(const void *buf, int64_t n, int64_t crc, int64_t most) {
    const uint8_t *p = (const uint8_t *)buf;
    uint32_t c = ~(uint32_t)crc;
#ifdef CF_CRC_FOLD
    const int level = cf_crc_level() < most ? cf_crc_level() : (int)most;
    if (n >= 64 && level > 0) {
        const int64_t m = n & ~(int64_t)15;
        c = level == 2 && m >= 256 ? cf_crc_fold512(c, p, m) : cf_crc_fold(c, p, m);
        p += m, n -= m;
    }
#else
    (void)most;
#endif
    return (int64_t)(uint32_t)~cf_crc_bytes(c, p, n);
}
