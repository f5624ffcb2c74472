// XLA:CPU FFI custom calls for decode steps, verify passes and drafter passes in fp32, built on first
// use by dspark_jax/models/cpu_kernels.py with -O3 -march=native:
// * dspark_matmul_f32: y[M, N] = x[M, K] . w[N, K]^T for few rows M, and dspark_matmul_bf16w: the
//   same with w stored as bf16 (widened to fp32 exactly as it is loaded, x and y fp32): half the bytes
//   streamed, the same reduction order;
// * dspark_decode_attention_f32: a few new tokens' attention over the KV cache (further below).
// Both for AVX-512 (16 lanes) and AVX2 + FMA (8 lanes), through the small vector layer just below.
//
// Why the product: XLA:CPU's dot (and every library it calls) costs about twice a matrix-vector product once
// M is 2-8 (it packs the weights per call), which made a speculative verify pass cost 2x a decode
// step. This kernel streams every weight row once for all M rows: a block of weight rows is held in
// registers while rows of x are folded into one vector accumulator per (weight row, x row), and the
// next rows of x reuse the block from L1. Up to 4 rows: 4 weight rows x 4; more: 2 weight rows x 8,
// so that a verify pass's 8 rows ride on one read of the weights (2-core Zen 4, SmolLM2-135M: an
// 8-token pass 1.8x -> 1.3x a 1-token step), with prefetches far enough ahead to keep the stream
// from memory going under those FMAs.
//
// Each output y[m, n] is reduced in the same order whatever M is, however many rows share its block
// and whichever thread computes it, so a row gets bit-identical results in a 1-row decode step and in
// an 8-row verify pass.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__)
typedef __m512 vf;
// Up to MB rows: blocks of NB weight rows x MB rows of x (16 accumulators + 4 weight vectors + 1 of
// x: 21 of 32 registers). More rows (a verify pass, a batch): NB_WIDE x MB_WIDE, each weight vector
// loaded once for 8 rows, so the FMAs of 8 rows hide under the weight stream instead of a second
// pass over the same weights.
constexpr int VW = 16, NB = 4, MB = 4, NB_WIDE = 2, MB_WIDE = 8;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
// The lanes summed in pairs (j, j+8), (j, j+4), (j, j+2), (j, j+1): written out, not left to the
// compiler's reduce intrinsic, because sums16 below must add in exactly this order.
static inline float vsum(vf v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
static inline vf vload(const uint16_t* p) {  // VW bf16 -> fp32: the bits shifted into the high half
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// s[a] = vsum(v[a]) for 16 vectors at once, by the same pairs of lanes (so the same bits): a
// transposing reduction, 15 adds instead of 16 x 4 plus their shuffles. Level by level, each
// output holds one input's partial sums: (j, j+8) across the 256-bit halves, (j, j+4) across
// 128-bit quarters, then (j, j+2) and (j, j+1) within quarters; lane 4q + r ends with input 4r + q.
static inline void sums16(const vf* v, float* s) {
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // input (4i') order: quarter q of the result is input 4r + q
    const vf lo = v[(2 * i) % 4 * 4 + (2 * i) / 4], hi = v[(2 * i + 1) % 4 * 4 + (2 * i + 1) / 4];
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x44), _mm512_shuffle_f32x4(lo, hi, 0xEE));
  }
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  _mm512_storeu_ps(s, _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD)));
}
#define DSPARK_SUMS16
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
constexpr int VW = 8, NB = 2, MB = 4, NB_WIDE = 2, MB_WIDE = 4;  // 8 + 2 + 1 of 16 registers
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vload(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define DSPARK_NO_VECTOR_KERNEL
#endif

extern "C" int dspark_matmul_vector_width() {
#ifdef DSPARK_NO_VECTOR_KERNEL
  return 0;
#else
  return VW;
#endif
}

#ifndef DSPARK_NO_VECTOR_KERNEL

static inline float widen(float v) { return v; }
static inline float widen(uint16_t bits) {
  uint32_t u = uint32_t{bits} << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// How far ahead of its reads a block asks for weights: several blocks' worth, so that the stream from
// memory keeps up while the FMAs of 8 rows run (1 KiB ahead left a 1-row step ~10% and an 8-row pass
// ~35% slower on a 2-core Zen 4).
constexpr int64_t PREFETCH_BYTES = 8192;

// Rows m0..m0+MR of y for weight rows n0..n0+NBK; W: float, or uint16_t holding bf16 bits.
template <int NBK, int MR, class W>
static inline void block(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t K,
                         int64_t N, int64_t n0, int64_t m0) {
  vf acc[NBK][MR];
#pragma GCC unroll 16
  for (int j = 0; j < NBK; ++j)
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[j][i] = vzero();
  const W* wr = w + n0 * K;
  const float* xr = x + m0 * K;
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    vf wv[NBK];
#pragma GCC unroll 16
    for (int j = 0; j < NBK; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + j * K + k) + PREFETCH_BYTES, _MM_HINT_T0);
      wv[j] = vload(wr + j * K + k);
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      vf xv = vload(xr + i * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < NBK; ++j) acc[j][i] = vfma(wv[j], xv, acc[j][i]);
    }
  }
  float sum[NBK * MR];
  int a = 0;
#ifdef DSPARK_SUMS16
  for (; a + 16 <= NBK * MR; a += 16) sums16(&acc[0][0] + a, sum + a);
#endif
  for (; a < NBK * MR; ++a) sum[a] = vsum((&acc[0][0])[a]);
  for (int j = 0; j < NBK; ++j)
    for (int i = 0; i < MR; ++i) {
      float v = sum[j * MR + i];
      // An explicit fma: left to the compiler, the tail was contracted in some block shapes and not
      // in others (bf16 weights, AVX2 build), and a row's bits then depended on the row count.
      for (int64_t t = k; t < K; ++t) v = std::fma(widen(wr[j * K + t]), xr[i * K + t], v);
      y[(m0 + i) * N + n0 + j] = v;
    }
}

// Weight rows from lo, NBK at a time, for all M rows of x, MBK rows at a time; returns the first
// weight row not done (fewer than NBK were left before hi).
template <int NBK, int MBK, class W>
static int64_t blocks(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t lo, int64_t hi) {
  int64_t n0 = lo;
  for (; n0 + NBK <= hi; n0 += NBK) {
    int64_t m0 = 0;
    for (; m0 + MBK <= M; m0 += MBK) block<NBK, MBK>(x, w, y, K, N, n0, m0);
    switch (M - m0) {
#define DSPARK_REST(r) case r: if constexpr (r < MBK) block<NBK, r>(x, w, y, K, N, n0, m0); break;
      DSPARK_REST(1) DSPARK_REST(2) DSPARK_REST(3) DSPARK_REST(4) DSPARK_REST(5) DSPARK_REST(6) DSPARK_REST(7)
#undef DSPARK_REST
      default: break;
    }
  }
  return n0;
}

// Weight rows [lo, hi) for all M rows of x. Every output is reduced the same way (VW lanes along K,
// vsum's order, then the scalar tail) whichever block shape or thread computes it: the last few
// weight rows too, one at a time.
template <class W>
static void rows_range(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t lo,
                       int64_t hi) {
  const int64_t n = M > MB ? blocks<NB_WIDE, MB_WIDE>(x, w, y, M, K, N, lo, hi) : blocks<NB, MB>(x, w, y, M, K, N, lo, hi);
  blocks<1, MB>(x, w, y, M, K, N, n, hi);
}

// fn(0) ... fn(tasks - 1) on the calling thread and up to (pool threads - 1) pool tasks, shared out
// through an atomic counter. A pool task that starts late finds nothing left; it holds a reference
// to the shared state, so it never touches a finished call's stack.
template <class F>
static void parallel_for(ffi::ThreadPool& pool, int64_t tasks, F fn) {
  struct Shared {
    F fn;
    int64_t tasks;
    std::atomic<int64_t> next{0}, done{0};
    Shared(F f, int64_t n) : fn(std::move(f)), tasks(n) {}
    void run() {
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
        fn(c);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(fn), tasks);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t t = 1; t < std::min(threads, tasks); ++t) pool.Schedule([shared] { shared->run(); });
  shared->run();
  while (shared->done.load(std::memory_order_acquire) < tasks) _mm_pause();
}

template <ffi::DataType WT>
static ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) return ffi::Error::InvalidArgument("x [M, K], w [N, K]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  const float* xp = x.typed_data();
  const auto* wp = w.typed_data();  // float, or uint16_t (bf16 bits)
  float* yp = y->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // ~4 chunks per thread (balance), each at least 64 KiB of weights (a task's cost over its scheduling).
  const int64_t min_rows = std::max<int64_t>(
      NB, (int64_t{65536} / int64_t(sizeof *wp) / std::max<int64_t>(K, 1) + NB - 1) / NB * NB);
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = std::max(min_rows, (chunk + NB - 1) / NB * NB);
  parallel_for(pool, (N + chunk - 1) / chunk,
               [=](int64_t c) { rows_range(xp, wp, yp, M, K, N, c * chunk, std::min(N, (c + 1) * chunk)); });
  return ffi::Error::Success();
}

#else  // no vector unit we know: never called (dspark_matmul_vector_width() == 0), defined for the symbols

template <ffi::DataType WT>
static ffi::Error Matmul(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<WT>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "dspark_matmul was built without AVX2/AVX-512");
}

#endif

// y fp32 = x fp32 . w^T, w of type WT: one handler symbol per weight type.
#define DSPARK_MATMUL_HANDLER(name, WT)                                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, Matmul<WT>,                                                        \
                                ffi::Ffi::Bind()                                                         \
                                    .Ctx<ffi::ThreadPool>()                                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                        \
                                    .Arg<ffi::Buffer<WT>>()                                              \
                                    .Ret<ffi::Buffer<ffi::F32>>());

DSPARK_MATMUL_HANDLER(dspark_matmul_f32, ffi::F32)
DSPARK_MATMUL_HANDLER(dspark_matmul_bf16w, ffi::BF16)

// ---------------------------------------------------------------------------------------------
// Attention of a few new tokens per row over a KV cache (decode steps and verify passes):
// q [B, T, H, D], keys cached transposed k_t [B, Hkv, D, S], values v [B, Hkv, S, D], query
// positions [B, T], window [] -> out [B, T, H * D]. A key at position s is visible to a query at
// position p iff p - window < s <= p. Each (row, kv head) reads only the keys its queries can see
// (XLA:CPU reads the whole cache, or slices chunks of it at a cost of their own), in one task.
// Written once over the vector layer below (AVX-512: 16 lanes, 32 registers; AVX2 + FMA: 8 lanes,
// 16 registers). Without AVX2 dspark_attention_available() is 0 and XLA's attention runs. The AVX2
// build matters most for batched decoding (datagen at 32 rows): there XLA's masked pass reads the
// whole padded cache of every row, 0.16 -> 0.5 s a SmolLM2 step from a 128- to a 1,024-key cache.

extern "C" int dspark_attention_available() {
#ifdef DSPARK_NO_VECTOR_KERNEL
  return 0;
#else
  return 1;
#endif
}

#ifndef DSPARK_NO_VECTOR_KERNEL

#if defined(__AVX512F__)
// Scores: SC vectors of keys per block for up to 6 query rows (24 accumulators + 4 keys of 32
// registers); values: up to ACC accumulators, at most CV vectors of a value row at a time.
constexpr int SC = 4, ACC = 24, CV = 16;
typedef __mmask16 vmask;
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline float vmax_all(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vmax_where(vmask k, vf m, vf x) { return _mm512_mask_max_ps(m, k, m, x); }  // k ? max(m, x) : m
static inline vf vzero_unless(vmask k, vf x) { return _mm512_maskz_mov_ps(k, x); }
static inline vmask in_range(int64_t s, int64_t lo, int64_t hi) {  // lanes s..s+15 within [lo, hi)
  const __m512i lane = _mm512_add_epi32(_mm512_set1_epi32(int32_t(s)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(int32_t(lo))) &
         _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(int32_t(hi)));
}
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
static inline vf vclamp(vf x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset1(lo)), vset1(hi)); }
static inline vf vtimes_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
#else  // AVX2 + FMA
constexpr int SC = 2, ACC = 12, CV = 8;  // scores: 6 x 2 accumulators + 2 keys + 1 of 16 registers
typedef __m256 vmask;  // all-ones lanes
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline float vmax_all(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline vf vmax_where(vmask k, vf m, vf x) { return _mm256_blendv_ps(m, _mm256_max_ps(m, x), k); }
static inline vf vzero_unless(vmask k, vf x) { return _mm256_and_ps(k, x); }
static inline vmask in_range(int64_t s, int64_t lo, int64_t hi) {  // lanes s..s+7 within [lo, hi)
  const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(int32_t(s)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(int32_t(lo - 1))),
                                              _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(hi)), lane)));
}
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vclamp(vf x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset1(lo)), vset1(hi)); }
static inline vf vtimes_pow2(vf p, vf n) {  // p * 2^n for integral n in [-126, 0]: n written into an exponent
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                                  _mm256_set1_epi32(127)), 23)));
}
#endif

// exp(x) for softmax arguments (x <= 0; larger lanes, which the caller zeroes, are clamped to 0 so
// that they stay finite), Cephes' polynomial, relative error ~1e-7.
static inline vf vexp(vf x) {
  x = vclamp(x, -87.0f, 0.0f);
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfnma(n, vset1(0.693359375f), x);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vtimes_pow2(p, n);
}

struct Attention {
  const float *q, *k, *v;
  const int32_t* pos;
  int64_t window;
  float scale;
  float* out;
  int64_t B, T, H, Hkv, D, S;

  // scores[r][s - a] = scale * q_r . k_s for rows r0..r0+RN, keys a..e (SC vectors of keys at a time;
  // e - a is a multiple of 16, so of VW).
  template <int RN>
  void scores(const float* const* qr, const float* K, float* sc, int64_t span, int64_t a, int64_t e) const {
    int64_t s = a;
    for (; s + SC * VW <= e; s += SC * VW) {
      vf acc[RN][SC];
      for (int i = 0; i < RN; ++i) for (int c = 0; c < SC; ++c) acc[i][c] = vzero();
      for (int64_t d = 0; d < D; ++d) {
        vf kv[SC];
        for (int c = 0; c < SC; ++c) kv[c] = vload(K + d * S + s + VW * c);
        for (int i = 0; i < RN; ++i) {
          const vf qd = vset1(qr[i][d]);
          for (int c = 0; c < SC; ++c) acc[i][c] = vfma(qd, kv[c], acc[i][c]);
        }
      }
      for (int i = 0; i < RN; ++i)
        for (int c = 0; c < SC; ++c) vstore(sc + i * span + (s - a) + VW * c, vmul(acc[i][c], vset1(scale)));
    }
    for (; s < e; s += VW) {
      vf acc[RN];
      for (int i = 0; i < RN; ++i) acc[i] = vzero();
      for (int64_t d = 0; d < D; ++d) {
        const vf kv = vload(K + d * S + s);
        for (int i = 0; i < RN; ++i) acc[i] = vfma(vset1(qr[i][d]), kv, acc[i]);
      }
      for (int i = 0; i < RN; ++i) vstore(sc + i * span + (s - a), vmul(acc[i], vset1(scale)));
    }
  }

  // out_r[c0 : c0 + DV * VW] = sum_s p_r[s] v_s[c0 : ...] / denom_r for rows r0..r0+RN (p is zero
  // outside a row's keys).
  template <int DV, int RN>
  void values(const float* sc, int64_t span, int64_t a, int64_t lo, int64_t hi, const float* V, int64_t c0,
              const float* inv, float* const* outr) const {
    vf acc[RN][DV];
    for (int i = 0; i < RN; ++i) for (int j = 0; j < DV; ++j) acc[i][j] = vzero();
    for (int64_t s = lo; s < hi; ++s) {
      vf vv[DV];
      for (int j = 0; j < DV; ++j) vv[j] = vload(V + s * D + c0 + VW * j);
      for (int i = 0; i < RN; ++i) {
        const vf p = vset1(sc[i * span + (s - a)]);
        for (int j = 0; j < DV; ++j) acc[i][j] = vfma(p, vv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < RN; ++i)
      for (int j = 0; j < DV; ++j) vstore(outr[i] + c0 + VW * j, vmul(acc[i][j], vset1(inv[i])));
  }

  // Every row's values, DV vectors of columns at a time, RG rows at a time (RG x DV accumulators).
  template <int DV>
  void values_rows(const float* sc, int64_t span, int64_t a, const int64_t* lo, const int64_t* hi, const float* V,
                   const float* inv, float* const* outr, int64_t R) const {
    constexpr int RG = DV >= ACC ? 1 : std::min(6, ACC / DV);
    for (int64_t c0 = 0; c0 < D; c0 += DV * VW) {
      for (int64_t r0 = 0; r0 < R; r0 += RG) {
        const int64_t rn = std::min<int64_t>(RG, R - r0);
        int64_t l = lo[r0], h = hi[r0];
        for (int64_t i = 1; i < rn; ++i) l = std::min(l, lo[r0 + i]), h = std::max(h, hi[r0 + i]);
        const float* scr = sc + r0 * span;
        switch (rn) {
#define DSPARK_ROWS(n) case n: if constexpr (n <= RG) values<DV, n>(scr, span, a, l, h, V, c0, inv + r0, outr + r0); break;
          DSPARK_ROWS(1) DSPARK_ROWS(2) DSPARK_ROWS(3) DSPARK_ROWS(4) DSPARK_ROWS(5) DSPARK_ROWS(6)
#undef DSPARK_ROWS
          default: break;
        }
      }
    }
  }

  void task(int64_t b, int64_t h) const {
    const int64_t G = H / Hkv, R = T * G;
    std::vector<int64_t> lo(R), hi(R);
    std::vector<const float*> qr(R);
    std::vector<float*> outr(R);
    int64_t slo = S, shi = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pos[b * T + t];
      const int64_t l = std::max<int64_t>(0, p - window + 1), u = std::max<int64_t>(std::min<int64_t>(p, S - 1) + 1, l + 1);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = t * G + g;
        lo[r] = std::min(l, S - 1), hi[r] = std::min(u, S);
        qr[r] = q + ((b * T + t) * H + h * G + g) * D;
        outr[r] = out + ((b * T + t) * H + h * G + g) * D;
        slo = std::min(slo, lo[r]), shi = std::max(shi, hi[r]);
      }
    }
    const int64_t a = slo / 16 * 16, e = (shi + 15) / 16 * 16, span = e - a;
    std::vector<float> sc(R * span);
    const float* K = k + (b * Hkv + h) * D * S;
    const float* V = v + (b * Hkv + h) * S * D;
    for (int64_t r0 = 0; r0 < R; r0 += 6) {
      const int64_t rn = std::min<int64_t>(6, R - r0);
      switch (rn) {
#define DSPARK_ROWS(n) case n: scores<n>(qr.data() + r0, K, sc.data() + r0 * span, span, a, e); break;
        DSPARK_ROWS(1) DSPARK_ROWS(2) DSPARK_ROWS(3) DSPARK_ROWS(4) DSPARK_ROWS(5) DSPARK_ROWS(6)
#undef DSPARK_ROWS
        default: break;
      }
    }
    std::vector<float> inv(R);
    for (int64_t r = 0; r < R; ++r) {  // softmax over the row's own keys; zero elsewhere
      float* row = sc.data() + r * span;
      vf m = vset1(-INFINITY);
      for (int64_t s = a; s < e; s += VW) m = vmax_where(in_range(s, lo[r], hi[r]), m, vload(row + (s - a)));
      const vf mx = vset1(vmax_all(m));
      vf sum = vzero();
      for (int64_t s = a; s < e; s += VW) {
        const vf pr = vzero_unless(in_range(s, lo[r], hi[r]), vexp(vsub(vload(row + (s - a)), mx)));
        vstore(row + (s - a), pr);
        sum = vadd(sum, pr);
      }
      inv[r] = 1.0f / vsum(sum);
    }
    switch (std::min<int64_t>(D / VW, CV)) {
      case 4: values_rows<4>(sc.data(), span, a, lo.data(), hi.data(), V, inv.data(), outr.data(), R); break;
      case 8: values_rows<8>(sc.data(), span, a, lo.data(), hi.data(), V, inv.data(), outr.data(), R); break;
      case 16: values_rows<16>(sc.data(), span, a, lo.data(), hi.data(), V, inv.data(), outr.data(), R); break;
      default: break;
    }
  }
};

static ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_t,
                                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> window,
                                  ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions();
  auto kd = k_t.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[3] % 16 != 0 || kd[3] % 16 != 0 || !(qd[3] == 64 || qd[3] == 128 || qd[3] == 256))
    return ffi::Error::InvalidArgument("q [B, T, H, D], k_t [B, Hkv, D, S]: D in {64, 128, 256}, S a multiple of 16");
  const Attention attn{q.typed_data(), k_t.typed_data(), v.typed_data(), positions.typed_data(),
                       int64_t(window.typed_data()[0]), scale, out->typed_data(), qd[0], qd[1], qd[2], kd[1], qd[3], kd[3]};
  parallel_for(pool, qd[0] * kd[1], [attn](int64_t c) { attn.task(c / attn.Hkv, c % attn.Hkv); });
  return ffi::Error::Success();
}

#else

static ffi::Error DecodeAttention(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                                  ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::F32>, float) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "dspark_decode_attention_f32 needs AVX2 or AVX-512");
}

#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(dspark_decode_attention_f32, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

