// y[M, N] = x[M, K] . w[N, K]^T in fp32 for few rows M (decode steps, verify passes, drafter passes)
// as an XLA:CPU FFI custom call. Built on first use by dspark_jax/models/cpu_kernels.py with
// -O3 -march=native.
//
// Why: XLA:CPU's dot (and every library it calls) costs about twice a matrix-vector product once
// M is 2-8 (it packs the weights per call), which made a speculative verify pass cost 2x a decode
// step. This kernel streams every weight row once for all M rows: a block of NB weight rows is held
// in registers while MB rows of x are folded into NB x MB vector accumulators, and the next rows of
// x reuse the block from L1.
//
// Each output y[m, n] is reduced in the same order whatever M is, however many rows share its block
// and whichever thread computes it, so a row gets bit-identical results in a 1-row decode step and in
// an 8-row verify pass.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__)
typedef __m512 vf;
constexpr int VW = 16, NB = 4, MB = 4;  // 16 accumulators + 4 weight vectors + 1 of x: 21 of 32 registers
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
constexpr int VW = 8, NB = 2, MB = 4;  // 8 + 2 + 1 of 16 registers
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
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

// Rows m0..m0+MR of y for weight rows n0..n0+NB.
template <int MR>
static inline void block(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t K,
                         int64_t N, int64_t n0, int64_t m0) {
  vf acc[NB][MR];
#pragma GCC unroll 16
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[j][i] = vzero();
  const float* wr = w + n0 * K;
  const float* xr = x + m0 * K;
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    vf wv[NB];
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + j * K + k + 256), _MM_HINT_T0);  // 1 KiB ahead per row
      wv[j] = vload(wr + j * K + k);
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      vf xv = vload(xr + i * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) acc[j][i] = vfma(wv[j], xv, acc[j][i]);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MR; ++i) {
      float s = vsum(acc[j][i]);
      for (int64_t t = k; t < K; ++t) s += wr[j * K + t] * xr[i * K + t];
      y[(m0 + i) * N + n0 + j] = s;
    }
}

// Weight rows [lo, hi) for all M rows of x.
static void rows_range(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t lo,
                       int64_t hi) {
  int64_t n0 = lo;
  for (; n0 + NB <= hi; n0 += NB) {
    int64_t m0 = 0;
    for (; m0 + MB <= M; m0 += MB) block<MB>(x, w, y, K, N, n0, m0);
    switch (M - m0) {
      case 1: block<1>(x, w, y, K, N, n0, m0); break;
      case 2: block<2>(x, w, y, K, N, n0, m0); break;
      case 3: block<3>(x, w, y, K, N, n0, m0); break;
      default: break;
    }
  }
  for (int64_t n = n0; n < hi; ++n)  // fewer than NB rows left (only at the very end of w)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t t = 0; t < K; ++t) s += w[n * K + t] * x[m * K + t];
      y[m * N + n] = s;
    }
}

// Work shared through an atomic chunk counter: the calling thread works too, and a pool task that
// starts late finds nothing left (it owns a reference, so it never touches a finished call's stack).
struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      rows_range(x, w, y, M, K, N, c * chunk, std::min(N, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) return ffi::Error::InvalidArgument("x [M, K], w [N, K]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->M = M, work->K = K, work->N = N;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // ~4 chunks per thread (balance), each at least 64 KiB of weights (a task's cost over its scheduling).
  const int64_t min_rows = std::max<int64_t>(NB, (int64_t{16384} / std::max<int64_t>(K, 1) + NB - 1) / NB * NB);
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = std::max(min_rows, (chunk + NB - 1) / NB * NB);
  work->chunk = chunk;
  work->chunks = (N + chunk - 1) / chunk;
  for (int64_t t = 1; t < std::min(threads, work->chunks); ++t) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) _mm_pause();
  return ffi::Error::Success();
}

#else  // no vector unit we know: never called (dspark_matmul_vector_width() == 0), defined for the symbol

static ffi::Error Matmul(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Unimplemented("dspark_matmul_f32 was built without AVX2/AVX-512");
}

#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(dspark_matmul_f32, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
