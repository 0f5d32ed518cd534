// Linear layers y = x W^T + b over raw pointers, for bf16, fp32, weight-only int8 and int4 weights on AVX2
// CPUs (bf16's, int8's and int4's blocks in 512-bit registers where the CPU has AVX-512, bit for bit the
// same; for the fused decoder, with bits of their own, bf16 on the AMX tile unit where the CPU has one,
// "bf16 on AMX", and int8 packed for VNNI where it has AVX-512 VNNI, "int8 packed for VNNI"), shared by
// the torch ops (linear_ops.cpp) and the fused decoder forward (decoder.cpp).
//
// Decoding reads every weight once per step, so each kernel is built around that stream: a weight row
// is read once per block of input rows, and the input rows' dot products are accumulated from it.
//
// Batch invariance, which lossless speculation relies on: row m's result depends only on x[m] and W,
// never on how many rows are in the batch or how the work is split over threads. Every output element
// is accumulated in the same fixed order whatever the block it falls in, so verifying k+1 tokens gives
// bit for bit the outputs of decoding them one at a time.
#pragma once

#ifndef SPECD_KERNEL_BENCH  // a standalone micro-benchmark supplies its own at::parallel_for
#include <ATen/Parallel.h>
#endif
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace specd {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN kept a quiet NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);           // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));  // 2
  s = _mm_add_ss(s, _mm_movehdup_ps(s));   // 1
  return _mm_cvtss_f32(s);
}

// The largest of start and v's lanes, taken in lane order with std::max (max is exact; a NaN lane
// after the first value is passed over, as a scalar loop does).
inline float hmax(__m256 v, float start) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (float x : lanes) start = std::max(start, x);
  return start;
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// Whether the environment variable `name` is set to `value` (the kernels' A/B switches).
inline bool env_is(const char* name, const char* value) {
  const char* env = std::getenv(name);
  return env != nullptr && std::string(env) == value;
}

// Every kernel streams its weights with a software prefetch a fixed distance ahead of its loads, into
// L1 or L2: a policy per kind of kernel, chosen once per process for the CPU.
// - 4 KB ahead into L1 by default. On the 2-core Zen 3 VM this was written on, the hardware
//   prefetchers alone left bf16 target-only decoding of the 1.5B model at 7.2-10.4 tok/s (22-32 GB/s
//   of weights); 4 KB ahead into L1 took it to 10.0-13.7 tok/s in interleaved runs (1 KB was too little).
// - The bf16 and fp32 kernels, 16 KB ahead into L2 on AMD CPUs with AVX-512 (Zen 4 and later). On a
//   2-core Zen 4 VM (2026-12-06) the 4 KB L1 prefetch held one decoding row of a 17920 x 1536 bf16 layer
//   to 20-21 GB/s on two threads (10-12 on one) where a plain read streamed 33-34 (0.56-0.70 of it);
//   into L2 8-32 KB ahead, 0.85-0.98 (a standalone harness, runs alternated; 4 KB into L2 0.75-0.86,
//   none 0.5). The 1.5B model's bf16 target alone 7.2-7.7 -> 9.3-10.8 tok/s. Its int4 target went the
//   other way (L2 4-16 KB ahead 18-21 tok/s against 23-27 into L1) and its int8 target moved within
//   noise (medians of six alternated pairs 18.9 against 18.8): the int8 and int4 kernels, which do
//   more work per byte, keep the default.
// SPECD_PREFETCH (the bf16 and fp32 kernels) and SPECD_PREFETCH_QUANT (int8 and int4) = l1:BYTES or
// l2:BYTES override them, for A/B runs. A prefetch past the end of a buffer never faults.
struct PrefetchPolicy {
  int64_t bytes;
  bool to_l2;
};

// "l1:BYTES" or "l2:BYTES", BYTES a whole number; anything else keeps the fallback (a typo such as
// "l2:16k" must not silently become a prefetch 0 bytes ahead).
inline PrefetchPolicy prefetch_policy(const char* env_name, PrefetchPolicy fallback) {
  if (const char* env = std::getenv(env_name)) {
    const std::string s(env);
    const bool digits = s.size() > 3 && s.size() <= 12 && s.find_first_not_of("0123456789", 3) == std::string::npos;
    if (digits && (s.compare(0, 3, "l1:") == 0 || s.compare(0, 3, "l2:") == 0))
      return {std::atoll(s.c_str() + 3), s[1] == '2'};
  }
  return fallback;
}

// AMD with AVX-512 (Zen 4 and later), where the float kernels stream differently (above, and
// kBf16OneRowWeightRows below). Called while the library's constants are initialised, which may come
// before libgcc's own CPU detection has run: hence __builtin_cpu_init.
inline bool amd_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f");
}

inline const PrefetchPolicy kFloatPrefetch =
    prefetch_policy("SPECD_PREFETCH", amd_avx512() ? PrefetchPolicy{16384, true} : PrefetchPolicy{4096, false});
inline const PrefetchPolicy kQuantPrefetch = prefetch_policy("SPECD_PREFETCH_QUANT", {4096, false});

inline void prefetch_ahead(const void* p, const PrefetchPolicy& policy) {
  const char* ahead = static_cast<const char*>(p) + policy.bytes;
  if (policy.to_l2)
    _mm_prefetch(ahead, _MM_HINT_T1);
  else
    _mm_prefetch(ahead, _MM_HINT_T0);
}

// ------------------------------------------------------------------------------- bf16 and int8
// How each format turns kStep consecutive weights of row n, from column k, into fp32 vectors
// (widen), one weight into a float (scalar, for the K % kStep tail), and a finished dot product into
// the output (finish: a per-row scale). bytes_per_row sizes the L2 tiles.

// bf16: one 32-byte load, each half-word moved to the top of a 32-bit lane by interleaving with zeros
// (two instructions for 16 weights); unpack works within 128-bit lanes, so the vectors hold weights
// [0-3, 8-11] and [4-7, 12-15], and x is laid out in that order once per call (permute_rows_bf16).
struct Bf16Rows {
  static constexpr bool kPermuteX = true;
  static constexpr int kStep = 16;
  static constexpr int kWeightsPerLine = 32;  // of a 64-byte cache line
  const uint16_t* w;
  int64_t K;
  int64_t bytes_per_row() const { return 2 * K; }
  void widen(int64_t n, int64_t k, __m256* wv) const {
    const __m256i v = _mm256_loadu_si256(static_cast<const __m256i*>(at(n, k)));
    const __m256i z = _mm256_setzero_si256();
    wv[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    wv[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  }
  float scalar(int64_t n, int64_t k) const { return bf16_to_float(w[n * K + k]); }
  const void* at(int64_t n, int64_t k) const { return w + n * K + k; }
  float finish(int64_t, float s) const { return s; }
};

// fp32: the weights as they are, two plain loads per 16. x needs no reordering.
struct F32Rows {
  static constexpr bool kPermuteX = false;
  static constexpr int kStep = 16;
  static constexpr int kWeightsPerLine = 16;
  const float* w;
  int64_t K;
  int64_t bytes_per_row() const { return 4 * K; }
  void widen(int64_t n, int64_t k, __m256* wv) const {
    wv[0] = _mm256_loadu_ps(w + n * K + k);
    wv[1] = _mm256_loadu_ps(w + n * K + k + 8);
  }
  float scalar(int64_t n, int64_t k) const { return w[n * K + k]; }
  const void* at(int64_t n, int64_t k) const { return w + n * K + k; }
  float finish(int64_t, float s) const { return s; }
};

// How every bf16/fp32 block ends an output (so that all of them end it the same way, bit for bit):
// hsum(a0 + a1), then the K % kStep tail, the format's finish and the bias.
template <typename C, int R, int NR>
inline void finish_outputs(const __m256 (&a0)[NR][R], const __m256 (&a1)[NR][R], const float* x, const C& c,
                           const float* bias, float* out, int64_t ldo, int64_t n) {
  const int64_t K = c.K, K16 = K - K % C::kStep;
  for (int j = 0; j < NR; ++j) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(_mm256_add_ps(a0[j][r], a1[j][r]));
      for (int64_t k = K16; k < K; ++k) s += c.scalar(n + j, k) * x[r * K + k];
      s = c.finish(n + j, s);
      out[r * ldo + n + j] = bias ? s + bias[n + j] : s;
    }
  }
}

constexpr int64_t kMaxRows = 7;  // 14 accumulators + 1 weight register: the 16 ymm registers

// Rows [0, R) of x (fp32, row stride K) against weight rows [n0, n1); out is fp32 with row stride ldo.
// NR weight rows at a time: with few input rows, the FMA chains of one weight row alone are too few to
// hide their latency, so weight rows are interleaved (each row's own accumulation order unchanged).
template <typename C, int R, int NR>
void block(const float* x, const C& c, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int V = C::kStep / 8;  // weight vectors per step; even ones go to a0, odd ones to a1
  const int64_t K = c.K, K16 = K - K % C::kStep;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 a0[NR][R], a1[NR][R];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a0[j][r] = a1[j][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += C::kStep) {
      if (k % C::kWeightsPerLine == 0)  // one prefetch per row and 64-byte line
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) prefetch_ahead(c.at(n + j, k), kFloatPrefetch);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        __m256 wv[V];
        c.widen(n + j, k, wv);
#pragma GCC unroll 2
        for (int v = 0; v < V; v += 2) {
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            a0[j][r] = _mm256_fmadd_ps(wv[v], _mm256_loadu_ps(x + r * K + k + 8 * v), a0[j][r]);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            a1[j][r] = _mm256_fmadd_ps(wv[v + 1], _mm256_loadu_ps(x + r * K + k + 8 * v + 8), a1[j][r]);
        }
      }
    }
    finish_outputs<C, R, NR>(a0, a1, x, c, bias, out, ldo, n);
  }
  if (n < n1) block<C, R, 1>(x, c, bias, out, ldo, n, n1);  // the odd row: same arithmetic per row
}

// Prefill-sized batches: block<C, R, NR>'s arithmetic for every output (the a0 chain over the even
// 8-lane half of each step, the a1 chain over the odd half, then hsum(a0 + a1)), with the two
// chains run one after the other over the weight rows, so half the accumulators are live at once:
// 3 input rows x 4 weight rows fit the 16 registers, each weight vector widened feeds 3 rows and
// each x vector 4 weight rows (block<C, 7, 1> loads an x vector per FMA, and decoding's blocks are
// built for streaming weights, not for reuse). The weights are read twice, the second time from
// cache (4 rows; linear_rows' tile is in L2). Bit-identical to block<C, R, NR>, so batch invariance
// is kept.
constexpr int kHalvesRows = 3, kHalvesWeightRows = 4;
// Below these rows the decoding blocks (memory-bound) are as fast or faster: from 8 rows when a
// weight row is long, from 20 when it is short (K < 1024, the demo pair's and the 0.5B's layers:
// there each 4-row block's fixed work, two chains and 12 sums, is a larger share, and at 8-16 rows
// block_halves took 5-30% longer on weights streamed from memory; measured with a throwaway harness).
constexpr int64_t kHalvesMinRows = 8, kHalvesMinRowsShortK = 20, kHalvesShortK = 1024;

inline int64_t halves_min_rows(int64_t K) { return K < kHalvesShortK ? kHalvesMinRowsShortK : kHalvesMinRows; }

template <typename C, int R, int NR>
void block_halves(const float* x, const C& c, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t K = c.K, K16 = K - K % C::kStep;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 a0[NR][R], a1[NR][R];
    // One chain: acc accumulates half H of every step (H = 0: a0, H = 1: a1), as block does.
    auto chain = [&](auto half, __m256 (&acc)[NR][R]) {
      constexpr int H = decltype(half)::value;
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K16; k += C::kStep) {
        if (H == 0 && k % C::kWeightsPerLine == 0)
#pragma GCC unroll 4
          for (int j = 0; j < NR; ++j) prefetch_ahead(c.at(n + j, k), kFloatPrefetch);
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
          __m256 wv[C::kStep / 8];
          c.widen(n + j, k, wv);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            acc[j][r] = _mm256_fmadd_ps(wv[H], _mm256_loadu_ps(x + r * K + k + 8 * H), acc[j][r]);
        }
      }
    };
    chain(std::integral_constant<int, 0>{}, a0);
    chain(std::integral_constant<int, 1>{}, a1);
    finish_outputs<C, R, NR>(a0, a1, x, c, bias, out, ldo, n);
  }
  if (n < n1) block<C, R, 1>(x, c, bias, out, ldo, n, n1);  // the last rows: same arithmetic per row
}

template <typename C>
using BlockFn = void (*)(const float*, const C&, const float*, float*, int64_t, int64_t, int64_t);

// One input row takes two weight rows at a time (4 FMA chains): with one (2 chains) decoding is latency
// bound. On a 2-core Intel VM (2026-12-05), bf16 target-only decoding of the 1.5B model went from
// 6.9 to 7.5 tok/s (three interleaved pairs of runs). On the Zen 3 VM this was first written on, two
// rows read weights from memory no faster than one (docs/models.md); not remeasured there.
template <typename C>
constexpr BlockFn<C> kBlocks[kMaxRows + 1] = {nullptr,          block<C, 1, 2>, block<C, 2, 2>, block<C, 3, 2>,
                                              block<C, 4, 1>, block<C, 5, 1>, block<C, 6, 1>, block<C, 7, 1>};

// R input rows against bf16 weights on AVX-512 (where the CPU has it, see use_avx512; decoding's
// blocks of up to kMaxRows rows, and prefill's of kPrefillRows512): the same arithmetic as
// block<Bf16Rows, R, NR> (and block_halves, which is bit-identical to it), lane for lane, so the same
// bits. A 512-bit accumulator holds that block's a0 in its low half and a1 in its high half; one
// masked word permute widens 16 weights straight into the permuted order both halves expect (x is
// permuted as for the AVX2 block), and one FMA per input row does the work of the two, with one x
// load instead of two. With 32 registers decoding's blocks take two weight rows at a time. Measured on a
// 2-core Intel VM with AVX-512 (2026-12-05), `specd generate`, runs alternated with the AVX2 blocks:
// bf16 target-only decoding of the 1.5B model 3% faster (one-row blocks only, six pairs, faster in
// every pair), the real pair at draft k = 4 (verifying 5 rows) 15.3 against 14.4 tok/s (four pairs),
// the demo pair 4% faster target-only and 11% at draft k = 4 (four pairs): fewer instructions per
// weight let the core keep more loads in flight.
#define SPECD_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

template <int R, int NR>
SPECD_AVX512 void bf16_block_avx512(const float* x, const Bf16Rows& c, const float* bias, float* out, int64_t ldo,
                                    int64_t n0, int64_t n1) {
  const int64_t K = c.K, K16 = K - K % 16;
  // Word 2i + 1 of the result takes the weight of lane i (a0's lanes [0-3, 8-11], then a1's [4-7, 12-15]);
  // the even words are zeroed by the mask, so each 32-bit lane holds its weight widened to fp32.
  alignas(64) static constexpr uint16_t kIndex[32] = {0, 0, 0, 1, 0, 2, 0, 3, 0, 8,  0, 9,  0, 10, 0, 11,
                                                       0, 4, 0, 5, 0, 6, 0, 7, 0, 12, 0, 13, 0, 14, 0, 15};
  const __m512i index = _mm512_load_si512(kIndex);
  constexpr __mmask32 kOdd = 0xAAAAAAAAu;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m512 acc[NR][R];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
      if (k % Bf16Rows::kWeightsPerLine == 0)
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) prefetch_ahead(c.at(n + j, k), kFloatPrefetch);
      __m512 xv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m256i v = _mm256_loadu_si256(static_cast<const __m256i*>(c.at(n + j, k)));
        const __m512 w = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kOdd, index, _mm512_castsi256_si512(v)));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[j][r] = _mm512_fmadd_ps(w, xv[r], acc[j][r]);
      }
    }
    __m256 a0[NR][R], a1[NR][R];
    for (int j = 0; j < NR; ++j)
      for (int r = 0; r < R; ++r) {
        a0[j][r] = _mm512_castps512_ps256(acc[j][r]);
        a1[j][r] = _mm512_extractf32x8_ps(acc[j][r], 1);
      }
    finish_outputs<Bf16Rows, R, NR>(a0, a1, x, c, bias, out, ldo, n);
  }
  if (n < n1) block<Bf16Rows, R, 1>(x, c, bias, out, ldo, n, n1);  // the odd row: same arithmetic per row
}

constexpr BlockFn<Bf16Rows> kBlocksAvx512[kMaxRows + 1] = {
    nullptr,                     bf16_block_avx512<1, 2>, bf16_block_avx512<2, 2>, bf16_block_avx512<3, 2>,
    bf16_block_avx512<4, 2>,     bf16_block_avx512<5, 2>, bf16_block_avx512<6, 2>, bf16_block_avx512<7, 2>};

// Weight rows a one-input-row block takes at a time on AVX-512 (each row's arithmetic is the same
// either way, so the bits are too). Two by default (measured on the Intel VM, above). One on AMD with
// AVX-512: on the 2-core Zen 4 VM (2026-12-06, with the L2 prefetch above) the 1.5B model's bf16
// target alone decoded at 14.4 tok/s (13.5-15.1) against 12.3 (10.9-12.8) with two, faster in all 8
// alternated rounds in one process, and level in the hours when that VM read memory at half speed;
// verifying 4 and 6 rows was slower with one (16.5-17.0 against 17.5-17.8 tok/s at draft k = 3,
// 13.7-15.5 against 17.0-19.1 at k = 5), so blocks of several input rows keep two.
// SPECD_BF16_ONE_ROW_WEIGHT_ROWS=1 or 2 overrides it (A/B runs).
inline int bf16_one_row_weight_rows() {
  if (env_is("SPECD_BF16_ONE_ROW_WEIGHT_ROWS", "1")) return 1;
  if (env_is("SPECD_BF16_ONE_ROW_WEIGHT_ROWS", "2")) return 2;
  return amd_avx512() ? 1 : 2;
}
inline const int kBf16OneRowWeightRows = bf16_one_row_weight_rows();

// Prefill-sized batches on AVX-512: 4 input rows against 4 weight rows, 16 of the 32 registers
// accumulating (block_halves' two passes over each weight row are not needed with them). Microbenchmark
// on the 2-core Intel VM (2026-12-05, weights streamed, medians of 20, two runs): 64 rows of a
// 1376 x 512 layer 703-723 -> 487-511 us, 512 x 1376 631-645 -> 482-494, 8960 x 1536 11.8-12.9 ->
// 9.8-10.1 ms; 8 rows of the last 2.6-2.8 -> 2.2 ms.
constexpr int64_t kPrefillRows512 = 4, kPrefillWeightRows512 = 4;

// Whether this CPU runs the 512-bit blocks; SPECD_AVX512=0 keeps the AVX2 ones (for A/B runs, and for
// the test that compares the two bit for bit).
inline bool use_avx512() {
  static const bool yes = [] {
    if (env_is("SPECD_AVX512", "0")) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return yes;
}

// Whether threads that finish their share of a layer's weight rows early take tiles from the back of
// the others' shares (for_each_weight_tile). SPECD_WORK_STEALING=0 keeps the plain static split (A/B).
inline bool use_work_stealing() {
  static const bool yes = !env_is("SPECD_WORK_STEALING", "0");
  return yes;
}

// Weight rows [0, N) split over the threads, each thread's share taken in tiles of at most `tile`
// rows, shorter near a share's end (fn(t0, t1) per tile, each row in exactly one tile), so that a
// tile stays in L2 while every block of input rows meets it.
//
// Each thread walks its own contiguous share from the front: one sequential stream per thread.
// Handing out interleaved tiles from one counter instead made the 1.5B target decode 7% slower on
// the Zen 4 VM (the same in-process A/B as below), so the shares stay whole, and a thread that is
// done takes tiles from the back of another's share. Why: decoding one row, the two threads' halves
// of a layer finished 11-13% of the layer's time apart (mean |difference|, both threads slower about
// equally often: random, the memory's or the host's), and the early thread idled in the barrier.
// Stealing, the 1.5B target alone decoded 1.02x, 1.06x and 1.02x faster (in-process A/B runs of
// 24, 24 and 30 alternated rounds, faster in 17, 19 and 22) and with `auto` 1.05x (20 rounds, 13);
// the demo pair was level. Which thread computes a row does not change its bits.
template <typename Fn>
void for_each_weight_tile(int64_t N, int64_t tile, const Fn& fn) {
  const int threads = at::get_num_threads();
  constexpr int kMaxThreads = 256;
  const int64_t per = (N + threads - 1) / threads;
  // A share of one tile leaves nothing to take but the whole share, and a small layer's call is
  // then dearer by its threads' start-up (at::parallel_for keeps up to 16 rows on the caller).
  if (!use_work_stealing() || threads < 2 || threads > kMaxThreads || per < 2 * tile || N >= (int64_t(1) << 31) ||
      at::in_parallel_region()) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t t0 = n0; t0 < n1; t0 += tile) fn(t0, std::min(n1, t0 + tile));
    });
    return;
  }
  // Each share's unclaimed rows [lo, hi) as one word, lo << 32 | hi: the owner claims from lo, the
  // others from hi, and a compare-and-swap settles a race for the last tile.
  struct alignas(64) Share {
    std::atomic<uint64_t> rows;
  };
  std::vector<Share> shares(threads);
  for (int t = 0; t < threads; ++t) {
    const uint64_t lo = std::min<int64_t>(N, t * per), hi = std::min<int64_t>(N, (t + 1) * per);
    shares[t].rows.store(lo << 32 | hi, std::memory_order_relaxed);
  }
  // Claims `take(lo, hi)` -> [a, b) of a share's unclaimed rows and runs fn on them, until none are left.
  auto drain = [&](Share& share, auto take) {
    uint64_t cur = share.rows.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(cur >> 32), hi = static_cast<int64_t>(cur & 0xffffffffu);
      if (lo >= hi) return;
      const auto [a, b] = take(lo, hi);
      const uint64_t rest = a == lo ? uint64_t(b) << 32 | uint64_t(hi) : uint64_t(lo) << 32 | uint64_t(a);
      if (share.rows.compare_exchange_weak(cur, rest, std::memory_order_relaxed)) {
        fn(a, b);
        cur = share.rows.load(std::memory_order_relaxed);
      }
    }
  };
  const int64_t steal = std::max<int64_t>(16, tile / 16 * 16);
  // Claims shrink as a share runs out (guided): at most half of what is left, down to kMinClaim
  // rows, so the last claims, which the other thread can no longer take, are short. Whole tiles to
  // the end, the thread done first waited for the other's last tile: in an instrumented build
  // (the 1.5B target decoding alone, 2026-12-07) about 50 us per down projection (tiles of 256
  // rows of 17.5 KB), 30 per gate/up and 14 per q/k/v and o, about 3 ms of a thread per token.
  // Guided, the target alone decoded 1.019x faster (two in-process A/B runs of 30 alternated
  // rounds, faster in 22 and 22; ~1.03x in the VM's fast minutes, level in its slow ones, when one
  // thread alone nearly fills the read); `auto` and the demo target level (0.996x, 1.009x).
  static constexpr int64_t kMinClaim = 16;
  auto claim = [](int64_t most, int64_t lo, int64_t hi) { return std::min(most, std::max(kMinClaim, (hi - lo) / 2)); };
  // One index per thread; a thread that gets several (fewer threads than asked) owns them all.
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t me = b; me < e; ++me) {
      drain(shares[me], [&](int64_t lo, int64_t hi) {
        return std::pair<int64_t, int64_t>(lo, std::min(hi, lo + claim(tile, lo, hi)));
      });
      for (int64_t i = 1; i < threads; ++i)
        drain(shares[(me + i) % threads], [&](int64_t lo, int64_t hi) {
          return std::pair<int64_t, int64_t>(std::max(lo, hi - claim(steal, lo, hi)), hi);
        });
    }
  });
}

// ------------------------------------------------------------------------------- bf16 dot products
// On CPUs with AVX512-BF16 and no AMX tile unit (AMD Zen 4 and later), bf16 layers round each input
// row to bf16 once per call (round to nearest even, as `vcvtne2ps2bf16` does) and multiply with
// `vdpbf16ps`, 32 weights of a row by 32 of an input row per instruction, accumulated in fp32. Half
// the arithmetic of the fp32-input blocks above, whose every weight costs one FMA lane per input row,
// which bounds verifying several rows there: on the 2-core Zen 4 VM (2026-12-06, a 1 GB 1536-wide
// matrix, fast minutes, processes alternated) 1, 4 and 7 input rows streamed 66, 52 and 32 GB/s here
// against 60, 27 and 17 on those blocks; `auto` on the real pair 1.15x, a 1,500-token prefill 1.3x
// (docs/models.md, "bf16 dot products").
// Not bit-identical to the fp32-input blocks: the activations lose their low 16 bits at every
// layer's input, as a bf16 model's do in `transformers` and llama.cpp (which rounds them to its bf16
// weights' dot type). Batch invariant among themselves: each output is one fixed sequence per
// (input row, weight row), two accumulators (even and odd 64-weight blocks; a last 32-block to the
// first, the K % 32 tail, zero-padded, to the second) summed at the end, whatever the rows around it.
// So speculation stays token-identical to the same process decoding alone.
// SPECD_BF16_DOT=0 keeps the fp32-input blocks (=1 uses the dot products on an AMX host too, where
// the tiles keep near-fp32 inputs and stay the default); SPECD_AVX512=0 keeps the AVX2 blocks, so
// no dot products either.
#define SPECD_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

inline bool use_bf16_dot() {
  static const bool yes = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16") || !use_avx512() || env_is("SPECD_BF16_DOT", "0")) return false;
    return env_is("SPECD_BF16_DOT", "1") || !__builtin_cpu_supports("amx-tile");
  }();
  return yes;
}

constexpr int64_t kDotRows = 7;
// One input row streams best with a prefetch 2 KB ahead into L2, several rows with the 16 KB prefetch
// into L2 (kFloatPrefetch). On the Zen 4 VM (2026-12-06) a non-temporal prefetch 512 bytes ahead had
// beaten 4 KB into L2 for the whole 1.5B target (1.05x median over 60 alternated rounds in one
// process), the down projection's 8960-wide rows being its weak shape: an input row and a weight row,
// 17.5 KB each, overfill the 32 KB L1 (docs/benchmarks.md, nineteenth session). Those rows are now
// packed in chunks (below), and for the rows left in place (1536 wide on the real pair) 2 KB into
// L2 beat the non-temporal 512 bytes: 1.032x and 1.036x median (the 1.5B target alone, 40 greedy
// tokens a round, in one process, 20 and 16 alternated rounds, faster in 15 and 13; 4 KB into L2
// 1.018x, 1 KB 1.032x in the second run). A prefetch changes no arithmetic, so no bits.

// Rows longer than this many weights (the down projection's 8960, say) are packed in chunks of at most
// as many (a multiple of 64 that divides K, at least half the limit; else the rows stay whole), chunk by
// chunk: every weight row's first chunk, then every row's second, ... ([K / KC][N][KC]). The one-row
// block then streams rows of KC weights against KC inputs, the shape that streams at full speed: on the
// Zen 4 VM (2026-12-06, one input row against 28 matrices of 1536 x 8960, rounds alternated with a 1 GB
// read in one process, 1,755 rounds) 60.1 GB/s against 42.5 in place in its fast minutes (the read
// 59.9), 35.4 against 32.6 in its slow ones (the read 35.2). Each output keeps its two accumulators
// from chunk to chunk (in a per-thread buffer between chunks), so the products are the same sequence
// of dot products as the rows in place: the same bits, which the tests check. A copy, as the tile
// unit's and VNNI's packs are: the per-op forward still reads the weights as they are.
// SPECD_DOT_CHUNK = a number of weights (at least 64) sets the limit, 0 keeps every row whole.
constexpr int64_t kDotChunkWeights = 4480;
// The one-row block's prefetch, chunked or not: for chunked rows its measured best (60.1 GB/s above,
// 56.0 with a non-temporal prefetch 512 bytes ahead, 44.0 with 8 KB into L2).
constexpr PrefetchPolicy kDotOneRowPrefetch{2048, true};
// Weight rows per tile while decoding or verifying (one block of input rows): each chunk of a tile is
// one sequential stream of 256 * KC weights (2.2 MB at KC = 4480), and its accumulators (128 bytes per
// weight row and input row) stay in L2.
constexpr int64_t kDotChunkTileRows = 256;

inline int64_t dot_chunk_limit() {
  static const int64_t limit = [] {
    const char* env = std::getenv("SPECD_DOT_CHUNK");
    if (env != nullptr) {
      const std::string s(env);
      if (!s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string::npos) {
        const int64_t v = std::atoll(s.c_str());
        if (v == 0 || v >= 64) return v;
      }
    }
    return kDotChunkWeights;
  }();
  return limit;
}

// The chunk a bf16 dot-product layer with rows of K weights is packed in, or 0 (rows kept whole).
inline int64_t dot_chunk_of(int64_t K, int64_t limit = dot_chunk_limit()) {
  if (limit < 64 || K <= limit || K % 64) return 0;
  for (int64_t c = limit / 64 * 64; c >= 64 && 2 * c >= limit; c -= 64)
    if (K % c == 0) return c;
  return 0;
}

// w [N, K] -> out [K / KC][N][KC].
inline void dot_chunk_pack(const uint16_t* w, int64_t N, int64_t K, int64_t KC, uint16_t* out) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t c = 0; c < K / KC; ++c)
      for (int64_t n = n0; n < n1; ++n) std::memcpy(out + (c * N + n) * KC, w + n * K + c * KC, 2 * KC);
  });
}

// Input rows [0, R) (bf16, row stride Kp, zero-padded past K) against weight rows [n0, n1) (row n at
// w + n * K). Chunked: K is one chunk's width (a multiple of 64), the accumulators start from acc_in
// (null: zero) and, unless acc_out is null, go there instead of being summed: [n - n0][r][32] floats.
template <int R, bool Chunked = false>
SPECD_BF16_DOT void bf16_dot_block(const uint16_t* xb, int64_t Kp, const uint16_t* w, int64_t K, const float* bias,
                                   float* out, int64_t ldo, int64_t n0, int64_t n1, const float* acc_in = nullptr,
                                   float* acc_out = nullptr) {
  const int64_t K32 = K - K % 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K % 32)) - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m512 a0[R], a1[R];
    if (Chunked && acc_in != nullptr) {
      const float* a = acc_in + (n - n0) * R * 32;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a0[r] = _mm512_loadu_ps(a + r * 32), a1[r] = _mm512_loadu_ps(a + r * 32 + 16);
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 64 <= K32; k += 64) {
      if constexpr (R == 1) {
        prefetch_ahead(wr + k, kDotOneRowPrefetch);
        prefetch_ahead(wr + k + 32, kDotOneRowPrefetch);
      } else {
        prefetch_ahead(wr + k, kFloatPrefetch);
        prefetch_ahead(wr + k + 32, kFloatPrefetch);
      }
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm512_dpbf16_ps(a0[r], w0, (__m512bh)_mm512_loadu_si512(xb + r * Kp + k));
        a1[r] = _mm512_dpbf16_ps(a1[r], w1, (__m512bh)_mm512_loadu_si512(xb + r * Kp + k + 32));
      }
    }
    if constexpr (Chunked) {
      if (acc_out != nullptr) {
        float* a = acc_out + (n - n0) * R * 32;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(a + r * 32, a0[r]), _mm512_storeu_ps(a + r * 32 + 16, a1[r]);
        continue;
      }
    } else {
      if (k < K32) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          a0[r] = _mm512_dpbf16_ps(a0[r], w0, (__m512bh)_mm512_loadu_si512(xb + r * Kp + k));
        k += 32;
      }
      if (K % 32) {
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          a1[r] = _mm512_dpbf16_ps(a1[r], w0, (__m512bh)_mm512_loadu_si512(xb + r * Kp + k));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float s = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
      out[r * ldo + n] = bias ? s + bias[n] : s;
    }
  }
}

using DotBlockFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, float*, int64_t, int64_t,
                            int64_t, const float*, float*);
// The blocks by input rows (1..kDotRows), for rows in place or packed in chunks.
template <bool Chunked>
constexpr DotBlockFn kDotBlocks[kDotRows + 1] = {
    nullptr,                    bf16_dot_block<1, Chunked>, bf16_dot_block<2, Chunked>, bf16_dot_block<3, Chunked>,
    bf16_dot_block<4, Chunked>, bf16_dot_block<5, Chunked>, bf16_dot_block<6, Chunked>, bf16_dot_block<7, Chunked>};

// x [M, K] fp32 -> [M, Kp] bf16, rounded to nearest even, zeros past K.
SPECD_BF16_DOT inline void round_rows_bf16(const float* x, int64_t M, int64_t K, int64_t Kp, uint16_t* xb) {
  for (int64_t m = 0; m < M; ++m) {
    const float* s = x + m * K;
    uint16_t* d = xb + m * Kp;
    for (int64_t k = 0; k < Kp; k += 32) {
      const int64_t lo = std::clamp<int64_t>(K - k, 0, 16), hi = std::clamp<int64_t>(K - k - 16, 0, 16);
      const __m512 a = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lo) - 1), s + k);
      const __m512 b = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << hi) - 1), s + k + 16);
      _mm512_storeu_si512(d + k, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// A bf16 weight matrix in place and where its outputs go: one layer's, or one of several that read the
// same input (q, k and v; gate and up).
struct DotPart {
  const uint16_t* w;  // [N, K]
  int64_t N;
  const float* bias;  // [N] or null
  float* out;         // its first output column (row stride ldo)
};

// y = x W^T + b with bf16 dot products for one or several weight matrices in place (bf16_dot_rows for
// one): their rows are one range that the threads split and take L2-sized tiles of
// (for_each_weight_tile), each tile meeting every block of up to kDotRows input rows, so a layer
// stored as three matrices costs the threads one start and one wait instead of three. Each output row
// is the same block over the same weights whatever the parts around it, so the same bits.
inline void bf16_dot_parts(const float* x, int64_t M, int64_t K, const DotPart* parts, int n_parts, int64_t ldo) {
  const int64_t Kp = (K + 31) / 32 * 32;
  std::vector<uint16_t> xb(M * Kp);
  round_rows_bf16(x, M, K, Kp, xb.data());
  int64_t N = 0;
  for (int i = 0; i < n_parts; ++i) N += parts[i].N;
  const int64_t tile = std::max<int64_t>(1, (256 * 1024) / (2 * K));
  for_each_weight_tile(N, tile, [&](int64_t t0, int64_t t1) {
    int64_t base = 0;
    for (int i = 0; i < n_parts && base < t1; base += parts[i].N, ++i) {
      const DotPart& p = parts[i];
      const int64_t a = std::max(t0, base) - base, b = std::min(t1, base + p.N) - base;
      for (int64_t m0 = 0; a < b && m0 < M; m0 += kDotRows)
        kDotBlocks<false>[std::min(kDotRows, M - m0)](xb.data() + m0 * Kp, Kp, p.w, K, p.bias, p.out + m0 * ldo, ldo,
                                                       a, b, nullptr, nullptr);
    }
  });
}

// y[M, N] (row stride ldo) = x[M, K] W^T + b with bf16 dot products, threads splitting the weight rows
// and each thread's rows taken in L2-sized tiles that every block of up to kDotRows input rows meets.
// W is [N, K] in place, or with KC > 0 packed by dot_chunk_pack in chunks of KC: the same products,
// bit for bit (the blocks carry each output's accumulators from chunk to chunk).
inline void bf16_dot_rows(const float* x, int64_t M, const uint16_t* w, int64_t K, int64_t N, const float* bias,
                          float* out, int64_t ldo, int64_t KC = 0) {
  if (KC == 0) {
    const DotPart whole{w, N, bias, out};
    return bf16_dot_parts(x, M, K, &whole, 1, ldo);
  }
  std::vector<uint16_t> xb(M * K);  // K % 64 == 0: no padding
  round_rows_bf16(x, M, K, K, xb.data());
  const int64_t chunks = K / KC;
  // Chunked rows, decoding or verifying (one block of input rows), take long tiles: each chunk of a
  // tile is then one long sequential stream (kDotChunkTileRows).
  const int64_t tile = M <= kDotRows ? kDotChunkTileRows : std::max<int64_t>(1, (256 * 1024) / (2 * K));
  for_each_weight_tile(N, tile, [&](int64_t t0, int64_t t1) {
    float* acc = nullptr;
    if (chunks > 1) {
      // Kept per thread and grown only: with a fresh vector per tile the 1.5B target decoded no faster
      // than with its rows in place (four pairs of processes, alternated), with this one 1.07x (the
      // cause not traced; a freed 32 KB block is presumably handed back and faulted in again).
      thread_local std::vector<float> buffer;
      buffer.resize(std::max<size_t>(buffer.size(), (t1 - t0) * std::min(M, kDotRows) * 32));
      acc = buffer.data();
    }
    for (int64_t m0 = 0; m0 < M; m0 += kDotRows) {
      const int64_t R = std::min(kDotRows, M - m0);
      for (int64_t c = 0; c < chunks; ++c)
        kDotBlocks<true>[R](xb.data() + m0 * K + c * KC, K, w + c * N * KC, KC, bias, out + m0 * ldo, ldo, t0, t1,
                            c > 0 ? acc : nullptr, c + 1 < chunks ? acc : nullptr);
    }
  });
}

// x [M, K] fp32 -> each 16-wide chunk reordered to [0-3, 8-11, 4-7, 12-15], as Bf16Rows::widen reads bf16.
inline void permute_rows_bf16(const float* x, float* out, int64_t M, int64_t K) {
  const int64_t K16 = K - K % 16;
  for (int64_t m = 0; m < M; ++m) {
    const float* s = x + m * K;
    float* d = out + m * K;
    for (int64_t k = 0; k < K16; k += 16) {
      std::memcpy(d + k, s + k, 16);
      std::memcpy(d + k + 4, s + k + 8, 16);
      std::memcpy(d + k + 8, s + k + 4, 16);
      std::memcpy(d + k + 12, s + k + 12, 16);
    }
    std::memcpy(d + K16, s + K16, 4 * (K - K16));
  }
}

// y[M, N] (row stride ldo) = x[M, K] W^T + b, threads splitting the weight rows. Within a thread, a tile
// of weight rows (~256 KB, so it stays in L2) meets every block of input rows before the next tile is
// read: decoding (M <= 7) streams W from memory once, and a prefill of many rows reads it once too.
template <typename C>
void linear_rows(const float* x, int64_t M, const C& c, int64_t N, const float* bias, float* out, int64_t ldo) {
  const int64_t K = c.K;
  if constexpr (std::is_same_v<C, Bf16Rows>)
    if (use_bf16_dot()) return bf16_dot_rows(x, M, c.w, K, N, bias, out, ldo);
  std::vector<float> permuted;
  if constexpr (C::kPermuteX) {
    permuted.resize(M * K);
    permute_rows_bf16(x, permuted.data(), M, K);
    x = permuted.data();
  }
  // A whole number of block_halves' weight rows (else each tile's last rows take the slow path).
  const int64_t tile_rows = (256 * 1024) / c.bytes_per_row();
  const int64_t tile = std::max<int64_t>(kHalvesWeightRows, tile_rows / kHalvesWeightRows * kHalvesWeightRows);
  for_each_weight_tile(N, tile, [&](int64_t t0, int64_t t1) {
    int64_t m0 = 0;
    if constexpr (std::is_same_v<C, Bf16Rows>)
      if (use_avx512() && M >= halves_min_rows(K))  // block_halves' job, 4 x 4 in 512-bit registers
        for (; m0 + kPrefillRows512 <= M; m0 += kPrefillRows512)
          bf16_block_avx512<kPrefillRows512, kPrefillWeightRows512>(x + m0 * K, c, bias, out + m0 * ldo, ldo, t0, t1);
    if (M >= halves_min_rows(K))
      for (; m0 + kHalvesRows <= M; m0 += kHalvesRows)
        block_halves<C, kHalvesRows, kHalvesWeightRows>(x + m0 * K, c, bias, out + m0 * ldo, ldo, t0, t1);
    for (; m0 < M; m0 += kMaxRows) {
      const int64_t R = std::min(kMaxRows, M - m0);
      BlockFn<C> fn = kBlocks<C>[R];
      if constexpr (std::is_same_v<C, Bf16Rows>)
        if (use_avx512()) fn = R == 1 && kBf16OneRowWeightRows == 1 ? bf16_block_avx512<1, 1> : kBlocksAvx512[R];
      fn(x + m0 * K, c, bias, out + m0 * ldo, ldo, t0, t1);
    }
  });
}

// ---------------------------------------------------------------------------------------- int4
// Weight-only int4 in llama.cpp's Q4_K arrangement, with 8-bit sub-block scales: a row is cut into
// super-blocks of up to 256 weights (8 groups of 32; the last one may be shorter), and weight i of
// group g in super-block s is
//     w = d[s] * sc[g] * q - dmin[s] * m[g],   q a nibble, sc and m uint8, d and dmin fp16.
// A Q4_K block of a GGUF file (6-bit sc and m) is this exactly, so its weights load unchanged.
//
// Each row is one record, read as one sequential stream: K / 2 bytes of nibbles, G = K / 32 bytes of
// sc, G of m, S = ceil(K / 256) fp16 d, S fp16 dmin. Nibbles go as Q4_K's: the 32 bytes of groups
// 2p and 2p + 1 hold group 2p's weights in their low nibbles and group 2p + 1's in their high ones;
// an odd last group takes 16 bytes, byte j holding its weight j (low) and j + 16 (high).
//
// The arithmetic is in integers, as llama.cpp's Q4_K x Q8_K: each input row is quantized once per call
// to int8, one scale per super-block (max|x| / 127), and a group's dot product is one u8 x s8
// multiply-add (maddubs, exact: at most 2 * 15 * 127 per pair) times its scale sc in int32 (madd).
// The super-block's groups are summed in int32 and converted once, scaled by d * d_x; the min term is
// dmin * d_x * sum over groups of m * sum(x_q), also in integers. Int32 sums are exact, so the order
// that matters is the float one, a fixed order per row: the kernel is batch invariant.

constexpr int64_t kQ4Super = 256;  // weights per super-block (8 groups of 32)

inline int64_t int4_row_bytes(int64_t K) { return K / 2 + 2 * (K / 32) + 4 * ((K + kQ4Super - 1) / kQ4Super); }

// K of an int4 record of row_bytes bytes, or -1 when no multiple of 32 gives that size.
inline int64_t int4_k_of(int64_t row_bytes) {
  for (int64_t K = (row_bytes * 16 / 9) / 32 * 32; K >= 32; K -= 32)
    if (int4_row_bytes(K) == row_bytes) return K;
  return -1;
}

struct Q8Rows {  // activations [M, K] -> int8 [M, K], a scale per super-block [M, S], sums per group [M, G]
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int16_t> sums;
  // q with each super-block's groups in the order 0, 2, 1, 3, 4, 6, 5, 7 (q4_block_avx512's loads);
  // empty where the AVX2 blocks run.
  std::vector<int8_t> q_pairs;
};

// 32 floats times inv, rounded to the nearest integer (ties to even, as nearbyint in the default mode),
// clamped to +-127, stored as int8; returns their sum.
inline int32_t quantize32(const float* x, __m256 inv, int8_t* q) {
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i i[4];
  for (int j = 0; j < 4; ++j)
    i[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), inv)), lo), hi);
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), packed);
  return hsum_i32(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
}

inline Q8Rows quantize_rows_q8(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / 32, S = (K + kQ4Super - 1) / kQ4Super;
  Q8Rows out{std::vector<int8_t>(M * K), std::vector<float>(M * S), std::vector<int16_t>(M * G)};
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* q = out.q.data() + m * K;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t k0 = s * kQ4Super, k1 = std::min(K, k0 + kQ4Super), k8 = k0 + (k1 - k0) / 8 * 8;
      __m256 vmax = _mm256_setzero_ps();
      for (int64_t k = k0; k < k8; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(xr + k), abs_mask));
      float amax = hmax(vmax, 0.0f);
      for (int64_t k = k8; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      out.scale[m * S + s] = amax / 127.0f;
      const __m256 vinv = _mm256_set1_ps(inv);
      int64_t k = k0;
      for (; k + 32 <= k1; k += 32) out.sums[m * G + k / 32] = static_cast<int16_t>(quantize32(xr + k, vinv, q + k));
      for (; k < k1; ++k)  // a K that is not a multiple of 32 (int8 only): no group sum needed
        q[k] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(std::nearbyint(xr[k] * inv)), -127, 127));
    }
  }
  return out;
}

// Byte masks for _mm256_shuffle_epi8 that broadcast 16-bit lane g of each 128-bit half.
inline __m256i word_broadcast_mask(int g) {
  return _mm256_set1_epi16(static_cast<int16_t>((2 * g) | ((2 * g + 1) << 8)));
}

// One int4 record (a weight row of K): K / 2 bytes of nibbles, G = K / 32 bytes of sc and G of m,
// then per super-block its fp16 d (dd[s]) and, after all of them, its fp16 dmin (dd[S + s]).
struct Q4Record {
  const uint8_t* nib;
  const uint8_t* sc;
  const uint8_t* mn;
  const uint16_t* dd;
};

inline Q4Record q4_record(const uint8_t* w, int64_t n, int64_t K) {
  const uint8_t* nib = w + n * int4_row_bytes(K);
  const uint8_t* sc = nib + K / 2;
  const uint8_t* mn = sc + K / 32;
  return {nib, sc, mn, reinterpret_cast<const uint16_t*>(mn + K / 32)};
}

// Super-block s (all 8 groups) of one weight row for R input rows, once its int32 sums isum[r] are
// done: acc[r] += isum * d * d_x, accm[r] += (m . group sums of x_q) * dmin * d_x. Every int4 block
// ends a full super-block with this, so they all give the same bits.
template <int R>
inline void q4_scale_superblock(const Q4Record& rec, int64_t s, int64_t S, int64_t G, const float* xs,
                                const int16_t* xsum, const __m256i* isum, __m256* acc, __m128* accm) {
  const int64_t g0 = s * 8;
  const __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec.mn + g0)));
  const float d = half_to_float(rec.dd[s]), dmin = half_to_float(rec.dd[S + s]);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float dx = xs[r * S + s];
    const __m128i xs16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xsum + r * G + g0));
    accm[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(m16, xs16)), _mm_set1_ps(dmin * dx), accm[r]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * dx), acc[r]);
  }
}

// The sum of accm's 4 lanes, in the order every int4 block uses.
inline float q4_min_total(__m128 accm) {
  const __m128 t = _mm_add_ps(accm, _mm_movehl_ps(accm, accm));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Input rows [0, R) (of Q8Rows xq from row m0) against weight rows [n0, n1), NR weight rows interleaved
// (independent work for the out-of-order core when R is small; each row's arithmetic is unchanged);
// out has row stride ldo.
template <int R, int NR>
void q4_block(const Q8Rows& xq, int64_t m0, const uint8_t* w, const float* bias, float* out, int64_t K, int64_t ldo,
              int64_t n0, int64_t n1) {
  const int64_t G = K / 32, S = (K + kQ4Super - 1) / kQ4Super;
  const int64_t S_full = G / 8;  // super-blocks of all 8 groups; a shorter last one takes the general path
  const int8_t* xqp = xq.q.data() + m0 * K;
  const float* xs = xq.scale.data() + m0 * S;
  const int16_t* xsum = xq.sums.data() + m0 * G;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i bmask[8];
  for (int g = 0; g < 8; ++g) bmask[g] = word_broadcast_mask(g);
  // Groups g, g + 1 (one 32-byte load of nibbles) of every input row into isum, scales from sc16.
  auto pair = [&](const uint8_t* nib, int64_t g, int gi, __m256i sc16, __m256i* isum) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + g * 16));
    const __m256i wa = _mm256_and_si256(v, low4), wb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256i sa = _mm256_shuffle_epi8(sc16, bmask[gi]), sb = _mm256_shuffle_epi8(sc16, bmask[gi + 1]);
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xqp + r * K + g * 32;
      const __m256i pa = _mm256_maddubs_epi16(wa, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr)));
      const __m256i pb = _mm256_maddubs_epi16(wb, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32)));
      isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(pa, sa), _mm256_madd_epi16(pb, sb)));
      // Keep the sum running in a register: left free, GCC reassociates these exact integer adds
      // into a tree over every product of the super-block, spilling them all to the stack
      // (verifying 3-5 rows took 12-15% longer; q8_block does not gain from the same).
      __asm__("" : "+x"(isum[r]));
    }
  };
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    Q4Record rec[NR];
    __m256 acc[NR][R];
    __m128 accm[NR][R];  // the min terms, 4 lanes
    for (int j = 0; j < NR; ++j) {
      rec[j] = q4_record(w, n + j, K);
      for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps(), accm[j][r] = _mm_setzero_ps();
    }
    for (int64_t s = 0; s < S_full; ++s) {
      const int64_t g0 = s * 8;
      __m256i sc16[NR], isum[NR][R];
      for (int j = 0; j < NR; ++j) {
        sc16[j] = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec[j].sc + g0))));
        for (int r = 0; r < R; ++r) isum[j][r] = _mm256_setzero_si256();
      }
      for (int gi = 0; gi < 8; gi += 2) {
        if (gi % 4 == 0)  // 64 bytes of nibbles per row every two pairs of groups
          for (int j = 0; j < NR; ++j) prefetch_ahead(rec[j].nib + (g0 + gi) * 16, kQuantPrefetch);
        for (int j = 0; j < NR; ++j) pair(rec[j].nib, g0 + gi, gi, sc16[j], isum[j]);
      }
      for (int j = 0; j < NR; ++j) q4_scale_superblock<R>(rec[j], s, S, G, xs, xsum, isum[j], acc[j], accm[j]);
    }
    for (int j = 0; j < NR; ++j) {
      float mins[R];
      for (int r = 0; r < R; ++r) mins[r] = q4_min_total(accm[j][r]);
      if (S_full < S) {  // the last, shorter super-block
        const int64_t s = S_full, g0 = s * 8;
        alignas(16) uint8_t sc_last[16] = {0};
        std::memcpy(sc_last, rec[j].sc + g0, G - g0);
        const __m256i sc16 = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc_last))));
        __m256i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
        int64_t g = g0;
        for (; g + 2 <= G; g += 2) pair(rec[j].nib, g, static_cast<int>(g - g0), sc16, isum);
        if (g < G) {  // an odd last group: 16 bytes, low nibbles its weights 0-15, high 16-31
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[j].nib + g * 16));
          const __m128i l4 = _mm256_castsi256_si128(low4);
          const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), l4), _mm_and_si128(b, l4));
          const __m256i sv = _mm256_shuffle_epi8(sc16, bmask[g - g0]);
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqp + r * K + g * 32));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), sv));
          }
        }
        const float d = half_to_float(rec[j].dd[s]), dmin = half_to_float(rec[j].dd[S + s]);
        for (int r = 0; r < R; ++r) {
          int32_t msum = 0;
          for (int64_t h = g0; h < G; ++h) msum += static_cast<int32_t>(rec[j].mn[h]) * xsum[r * G + h];
          const float dx = xs[r * S + s];
          acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * dx), acc[j][r]);
          mins[r] += dmin * dx * static_cast<float>(msum);
        }
      }
      for (int r = 0; r < R; ++r) {
        const float y = hsum(acc[j][r]) - mins[r];
        out[r * ldo + n + j] = bias ? y + bias[n + j] : y;
      }
    }
  }
  if (n < n1) q4_block<R, 1>(xq, m0, w, bias, out, K, ldo, n, n1);
}

constexpr int64_t kMaxRowsQ4 = 8;
using Q4BlockFn = void (*)(const Q8Rows&, int64_t, const uint8_t*, const float*, float*, int64_t, int64_t, int64_t,
                           int64_t);
#ifndef SPECD_Q4_NR1
#define SPECD_Q4_NR1 1
#endif
constexpr Q4BlockFn kQ4Blocks[kMaxRowsQ4 + 1] = {nullptr,        q4_block<1, SPECD_Q4_NR1>, q4_block<2, 1>,
                                                 q4_block<3, 1>, q4_block<4, 1>,            q4_block<5, 1>,
                                                 q4_block<6, 1>, q4_block<7, 1>,            q4_block<8, 1>};

// q4_block on AVX-512 with VNNI, for rows of whole super-blocks (K a multiple of 256; see
// use_avx512_vnni): the same int32 sums lane for lane and the same float work after them, so the
// same bits. One 64-byte load of nibbles holds two of q4_block's pairs of groups (g, g + 1 and g + 2,
// g + 3): its low half is q4_block's vector for the first pair, its high half the one for the
// second, and the activations come pair ordered (Q8Rows::q_pairs) so that one load meets each half
// with its groups' x. Per input row one vpdpwssd does madd's multiply by the group scale and the
// add into the running sum. Each 32-bit lane sums exactly the products the AVX2 lane sums (integers,
// so the order inside does not matter), and the two halves are added once per super-block.
#define SPECD_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

template <int R, int NR>
SPECD_AVX512_VNNI void q4_block_avx512(const Q8Rows& xq, int64_t m0, const uint8_t* w, const float* bias, float* out,
                                       int64_t K, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t G = K / 32, S = K / kQ4Super;
  const int8_t* xpairs = xq.q_pairs.data() + m0 * K;
  const float* xs = xq.scale.data() + m0 * S;
  const int16_t* xsum = xq.sums.data() + m0 * G;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // smask[q][h]: the scale of group 4q + h in the low half, of group 4q + 2 + h in the high half.
  __m512i smask[2][2];
  for (int q = 0; q < 2; ++q)
    for (int h = 0; h < 2; ++h)
      smask[q][h] = _mm512_inserti64x4(_mm512_castsi256_si512(word_broadcast_mask(4 * q + h)),
                                       word_broadcast_mask(4 * q + 2 + h), 1);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    Q4Record rec[NR];
    __m256 acc[NR][R];
    __m128 accm[NR][R];
    for (int j = 0; j < NR; ++j) {
      rec[j] = q4_record(w, n + j, K);
      for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps(), accm[j][r] = _mm_setzero_ps();
    }
    for (int64_t s = 0; s < S; ++s) {
      const int64_t g0 = s * 8;
      __m512i sc16[NR], isum[NR][R];
      for (int j = 0; j < NR; ++j) {
        sc16[j] =
            _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec[j].sc + g0))));
        for (int r = 0; r < R; ++r) isum[j][r] = _mm512_setzero_si512();
      }
      for (int q = 0; q < 2; ++q) {
        for (int j = 0; j < NR; ++j) prefetch_ahead(rec[j].nib + (g0 + 4 * q) * 16, kQuantPrefetch);
        for (int j = 0; j < NR; ++j) {
          const __m512i v = _mm512_loadu_si512(rec[j].nib + (g0 + 4 * q) * 16);
          const __m512i wa = _mm512_and_si512(v, low4), wb = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          const __m512i sa = _mm512_shuffle_epi8(sc16[j], smask[q][0]);
          const __m512i sb = _mm512_shuffle_epi8(sc16[j], smask[q][1]);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = xpairs + r * K + (g0 + 4 * q) * 32;
            const __m512i pa = _mm512_maddubs_epi16(wa, _mm512_loadu_si512(xr));
            const __m512i pb = _mm512_maddubs_epi16(wb, _mm512_loadu_si512(xr + 64));
            isum[j][r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum[j][r], pa, sa), pb, sb);
          }
        }
      }
      for (int j = 0; j < NR; ++j) {
        __m256i i32[R];  // the two halves' sums: q4_block's 8 lanes
        for (int r = 0; r < R; ++r)
          i32[r] = _mm256_add_epi32(_mm512_castsi512_si256(isum[j][r]), _mm512_extracti64x4_epi64(isum[j][r], 1));
        q4_scale_superblock<R>(rec[j], s, S, G, xs, xsum, i32, acc[j], accm[j]);
      }
    }
    for (int j = 0; j < NR; ++j)  // q4_block's ending
      for (int r = 0; r < R; ++r) {
        const float y = hsum(acc[j][r]) - q4_min_total(accm[j][r]);
        out[r * ldo + n + j] = bias ? y + bias[n + j] : y;
      }
  }
  if (n < n1) q4_block_avx512<R, 1>(xq, m0, w, bias, out, K, ldo, n, n1);
}

constexpr Q4BlockFn kQ4BlocksAvx512[kMaxRowsQ4 + 1] = {
    nullptr,                  q4_block_avx512<1, 1>, q4_block_avx512<2, 1>, q4_block_avx512<3, 1>, q4_block_avx512<4, 1>,
    q4_block_avx512<5, 1>,    q4_block_avx512<6, 1>, q4_block_avx512<7, 1>, q4_block_avx512<8, 1>};

// Whether the int4 blocks run in 512-bit registers (q4_block_avx512, for rows of whole super-blocks);
// SPECD_AVX512=0 keeps the AVX2 ones here too.
inline bool use_avx512_vnni() {
  static const bool yes = use_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
}

// Q8Rows::q_pairs of xq (rows of K; a shorter last super-block, if any, keeps its order).
inline void pair_order_q8(Q8Rows& xq, int64_t M, int64_t K) {
  static constexpr int kOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  const int64_t S_full = K / 32 / 8;
  xq.q_pairs = xq.q;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < S_full; ++s)
      for (int i = 0; i < 8; ++i)
        std::memcpy(xq.q_pairs.data() + m * K + s * kQ4Super + i * 32, xq.q.data() + m * K + s * kQ4Super + kOrder[i] * 32,
                    32);
}

inline void int4_rows(const float* x, int64_t M, const uint8_t* packed, int64_t N, int64_t K, const float* bias,
                      float* out, int64_t ldo) {
  Q8Rows xq = quantize_rows_q8(x, M, K);
  const bool wide = use_avx512_vnni() && K % kQ4Super == 0;
  if (wide) pair_order_q8(xq, M, K);
  const Q4BlockFn* blocks = wide ? kQ4BlocksAvx512 : kQ4Blocks;
  const int64_t tile = std::max<int64_t>(4, (256 * 1024) / int4_row_bytes(K));
  for_each_weight_tile(N, tile, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsQ4) {
      const int64_t R = std::min(kMaxRowsQ4, M - m0);
      blocks[R](xq, m0, packed, bias, out + m0 * ldo, K, ldo, t0, t1);
    }
  });
}

// ---------------------------------------------------------------------------------------- int8
// Weight-only int8 with one fp32 scale per output row: w[n, k] = q[n, k] * scale[n]. Multiplied in
// integers against the activations quantized as for int4 (Q8Rows: int8, one scale per 256), like
// llama.cpp's Q8_0: a u8 x s8 multiply-add of |w| and x carrying w's sign (exact: at most
// 2 * 127 * 127 per pair) and a pairwise add to int32, summed over the super-block, converted once and
// scaled by its activation scale; the row scale is applied once at the end. A K that is not a
// multiple of 32 ends in a scalar integer tail. Batch invariant for the same reasons as int4.

// NR weight rows at a time (each row's arithmetic unchanged, so batch invariant): one input row takes
// two. On the 2-core Intel VM (2026-12-05) the 0.5B draft decoding alone as an int8 target (`specd
// generate --target <0.5B folder> --quantize int8 --method none --max-tokens 64`) went from 31.2 /
// 34.1 / 35.2 / 33.6 to 36.4 / 38.9 / 39.1 / 40.0 tok/s (runs alternated), and the real pair at
// draft k = 4 from 17.2 / 16.8 / 16.7 to 17.8 / 17.3 / 17.5.
//
// The loops over rows are unrolled and the scalar tail is skipped when there is none so that the
// sums and accumulators stay in registers: written plainly, GCC kept them on the stack and reloaded
// them every 32 weights (on the Intel VM, five rows of a 1024 x 1536 layer in L2 took 188-198 us
// against 139-140 after, one thread; the same bits).
// The end of one of q8_block's super-blocks, for one weight row and input row: its eight int32 lane
// sums converted once and scaled by the activation scale dx into acc, and the scalar tail of a K that
// is not a multiple of 32 into tail.
__attribute__((always_inline)) inline void q8_superblock_end(__m256i i32, float dx, const int8_t* wr, const int8_t* xr,
                                                             int64_t k32, int64_t k1, __m256& acc, float& tail) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_set1_ps(dx), acc);
  if (k32 < k1) {
    int32_t t = 0;
    for (int64_t k = k32; k < k1; ++k) t += static_cast<int32_t>(wr[k]) * xr[k];
    tail += dx * static_cast<float>(t);
  }
}

// q8_block's per-output accumulators, zeroed before a group of weight rows.
template <int R, int NR>
__attribute__((always_inline)) inline void q8_clear(__m256 (&acc)[NR][R], float (&tail)[NR][R]) {
#pragma GCC unroll 2
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps(), tail[j][r] = 0.0f;
}

// q8_block's outputs for weight rows n..n+NR-1: the lanes' sum and the tail, times the row scale, plus bias.
template <int R, int NR>
__attribute__((always_inline)) inline void q8_store(const __m256 (&acc)[NR][R], const float (&tail)[NR][R],
                                                    const float* scale, const float* bias, float* out, int64_t ldo,
                                                    int64_t n) {
#pragma GCC unroll 2
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float y = (hsum(acc[j][r]) + tail[j][r]) * scale[n + j];
      out[r * ldo + n + j] = bias ? y + bias[n + j] : y;
    }
}

template <int R, int NR = 1>
void q8_block(const Q8Rows& xq, int64_t m0, const int8_t* w, const float* scale, const float* bias, float* out,
              int64_t K, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t S = (K + kQ4Super - 1) / kQ4Super;
  const int8_t* xqp = xq.q.data() + m0 * K;
  const float* xs = xq.scale.data() + m0 * S;
  const __m256i ones = _mm256_set1_epi16(1);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 acc[NR][R];
    float tail[NR][R];
    q8_clear<R, NR>(acc, tail);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t k0 = s * kQ4Super, k1 = std::min(K, k0 + kQ4Super), k32 = k0 + (k1 - k0) / 32 * 32;
      __m256i isum[NR][R];
#pragma GCC unroll 2
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[j][r] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k32; k += 32) {
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
          const int8_t* wr = w + (n + j) * K;
          if (k % 64 == 0) prefetch_ahead(wr + k, kQuantPrefetch);
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k));
          const __m256i wa = _mm256_abs_epi8(wv);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqp + r * K + k));
            const __m256i p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv));
            isum[j][r] = _mm256_add_epi32(isum[j][r], _mm256_madd_epi16(p, ones));
          }
        }
      }
#pragma GCC unroll 2
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          q8_superblock_end(isum[j][r], xs[r * S + s], w + (n + j) * K, xqp + r * K, k32, k1, acc[j][r], tail[j][r]);
    }
    q8_store<R, NR>(acc, tail, scale, bias, out, ldo, n);
  }
  if (n < n1) q8_block<R, 1>(xq, m0, w, scale, bias, out, K, ldo, n, n1);
}

using Q8BlockFn = void (*)(const Q8Rows&, int64_t, const int8_t*, const float*, const float*, float*, int64_t, int64_t,
                           int64_t, int64_t);
constexpr Q8BlockFn kQ8Blocks[kMaxRowsQ4 + 1] = {nullptr,     q8_block<1, 2>, q8_block<2>, q8_block<3>, q8_block<4>,
                                                 q8_block<5>, q8_block<6>, q8_block<7>, q8_block<8>};

// q8_block on AVX-512 with VNNI: 64 weights of a row per load and one vpdpbusd per input row (|w|
// as u8 times x carrying w's sign, four products summed into each int32 lane), where q8_block takes
// 32 and three instructions. Lane i of the low half sums bytes 4i..4i+3 of the even 32-byte steps,
// of the high half those of the odd ones; their sum is q8_block's lane i exactly (integers), and the
// float work after it is q8_block's, so the same bits. A super-block's odd 32-byte step, if any, runs
// at 256 bits. From a few rows on q8_block is bound by its multiply-adds: the int8_linear op on one
// thread of the Intel VM (2026-12-05, one run each, SPECD_AVX512=0 against the default), the 0.5B's
// 4864 x 896 layer at 5 / 8 / 16 rows 0.40 / 0.73 / 1.41 -> 0.31 / 0.48 / 0.95 ms, its 151936 x 896
// head 14.9 / 23.0 / 44.6 -> 12.1 / 17.3 / 32.1 ms; one row the same (bound by reading the weights).
// The demo draft's tiny layers (K = 128) gained little: there the per-output ending dominates.
template <int R, int NR = 1>
SPECD_AVX512_VNNI void q8_block_avx512(const Q8Rows& xq, int64_t m0, const int8_t* w, const float* scale,
                                       const float* bias, float* out, int64_t K, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t S = (K + kQ4Super - 1) / kQ4Super;
  const int8_t* xqp = xq.q.data() + m0 * K;
  const float* xs = xq.scale.data() + m0 * S;
  const __m512i zero = _mm512_setzero_si512();
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 acc[NR][R];
    float tail[NR][R];
    q8_clear<R, NR>(acc, tail);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t k0 = s * kQ4Super, k1 = std::min(K, k0 + kQ4Super), k32 = k0 + (k1 - k0) / 32 * 32;
      const int64_t k64 = k0 + (k32 - k0) / 64 * 64;
      __m512i isum[NR][R];
#pragma GCC unroll 2
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[j][r] = _mm512_setzero_si512();
      for (int64_t k = k0; k < k64; k += 64) {
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
          const int8_t* wr = w + (n + j) * K;
          prefetch_ahead(wr + k, kQuantPrefetch);
          const __m512i wv = _mm512_loadu_si512(wr + k);
          const __m512i wa = _mm512_abs_epi8(wv);
          const __mmask64 neg = _mm512_movepi8_mask(wv);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512i xv = _mm512_loadu_si512(xqp + r * K + k);
            isum[j][r] = _mm512_dpbusd_epi32(isum[j][r], wa, _mm512_mask_sub_epi8(xv, neg, zero, xv));
          }
        }
      }
#pragma GCC unroll 2
      for (int j = 0; j < NR; ++j) {
        const int8_t* wr = w + (n + j) * K;
        __m256i odd = _mm256_setzero_si256();
        const bool has_odd = k64 < k32;  // one 32-byte step left in this super-block
        const __m256i wv = has_odd ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k64)) : odd;
        const __m256i wa = _mm256_abs_epi8(wv);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          __m256i i32 = _mm256_add_epi32(_mm512_castsi512_si256(isum[j][r]), _mm512_extracti64x4_epi64(isum[j][r], 1));
          if (has_odd) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqp + r * K + k64));
            i32 = _mm256_dpbusd_epi32(i32, wa, _mm256_sign_epi8(xv, wv));
          }
          q8_superblock_end(i32, xs[r * S + s], wr, xqp + r * K, k32, k1, acc[j][r], tail[j][r]);
        }
      }
    }
    q8_store<R, NR>(acc, tail, scale, bias, out, ldo, n);
  }
  if (n < n1) q8_block_avx512<R, 1>(xq, m0, w, scale, bias, out, K, ldo, n, n1);
}

constexpr Q8BlockFn kQ8BlocksAvx512[kMaxRowsQ4 + 1] = {
    nullptr,                  q8_block_avx512<1, 2>, q8_block_avx512<2>, q8_block_avx512<3>, q8_block_avx512<4>,
    q8_block_avx512<5>,       q8_block_avx512<6>,    q8_block_avx512<7>, q8_block_avx512<8>};

inline void int8_rows(const float* x, int64_t M, const int8_t* w, const float* scale, int64_t N, int64_t K,
                      const float* bias, float* out, int64_t ldo) {
  const Q8Rows xq = quantize_rows_q8(x, M, K);
  const Q8BlockFn* blocks = use_avx512_vnni() ? kQ8BlocksAvx512 : kQ8Blocks;
  const int64_t tile = std::max<int64_t>(4, (256 * 1024) / K);
  for_each_weight_tile(N, tile, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsQ4) {
      const int64_t R = std::min(kMaxRowsQ4, M - m0);
      blocks[R](xq, m0, w, scale, bias, out + m0 * ldo, K, ldo, t0, t1);
    }
  });
}

// ----------------------------------------------------------------------------- int8 packed for VNNI
// Where the CPU has AVX-512 VNNI the fused decoder packs each int8 layer (N % 16 == 0, K % 32 == 0)
// once, at load, so that one 64-byte load holds four consecutive weights of sixteen output rows
// (row i's w[4q..4q+3] at bytes 4i..4i+3 of group q) and one vpdpbusd per input row adds their dot
// products with x's four values there, broadcast, into sixteen int32 lanes, one per output: no
// horizontal sums, whatever K. q8_block sums 32 weights of one row per lane group and ends every
// output with a horizontal sum, which at the demo draft's K = 128 cost more than the products.
// vpdpbusd multiplies u8 by s8, so x goes in as x + 128 (its int8 quantization, Q8Rows, with the
// sign bit flipped) and 128 times the weights' sum over the super-block, kept in the packing, comes
// off: exact in int32, so each super-block's dot product is the exact integer, converted once and
// scaled by its activation scale. A different float order than q8_block's (one sum per super-block,
// not eight lanes), so other bits, more exact ones; batch invariant, as every row is computed alone.
constexpr int64_t kVnniRows = 16;

inline bool vnni_shape_ok(int64_t N, int64_t K) { return N % kVnniRows == 0 && K % 32 == 0; }

// Bytes of a layer packed by int8_pack_vnni: per block of 16 rows its 16 * K weights, then one int32
// per row and super-block (the rows' weight sums).
inline int64_t vnni_block_bytes(int64_t K) { return kVnniRows * K + 4 * kVnniRows * ((K + kQ4Super - 1) / kQ4Super); }
inline int64_t vnni_packed_bytes(int64_t N, int64_t K) { return N / kVnniRows * vnni_block_bytes(K); }

inline void int8_pack_vnni(const int8_t* w, int64_t N, int64_t K, int8_t* out) {
  const int64_t S = (K + kQ4Super - 1) / kQ4Super, block = vnni_block_bytes(K);
  at::parallel_for(0, N / kVnniRows, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int8_t* o = out + b * block;
      const int8_t* rows = w + b * kVnniRows * K;
      for (int64_t q = 0; q < K / 4; ++q)
        for (int64_t i = 0; i < kVnniRows; ++i) std::memcpy(o + q * 64 + i * 4, rows + i * K + 4 * q, 4);
      int32_t sums[kVnniRows];
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t i = 0; i < kVnniRows; ++i) {
          int32_t t = 0;
          for (int64_t k = s * kQ4Super; k < std::min(K, (s + 1) * kQ4Super); ++k) t += rows[i * K + k];
          sums[i] = t;
        }
        std::memcpy(o + kVnniRows * K + s * 4 * kVnniRows, sums, sizeof(sums));
      }
    }
  });
}

// R input rows (x + 128 as u8 [R, K], scales [R, S]) times the 16-row blocks b0..b1.
template <int R>
SPECD_AVX512_VNNI void q8_vnni_block(const uint8_t* xu, const float* xs, const int8_t* packed, const float* scale,
                                     const float* bias, float* out, int64_t K, int64_t ldo, int64_t b0, int64_t b1) {
  const int64_t S = (K + kQ4Super - 1) / kQ4Super, block = vnni_block_bytes(K);
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* wb = packed + b * block;
    __m512 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      const int64_t q0 = s * (kQ4Super / 4), q1 = std::min(K, (s + 1) * kQ4Super) / 4;
      __m512i isum[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      for (int64_t q = q0; q < q1; ++q) {
        prefetch_ahead(wb + q * 64, kQuantPrefetch);
        const __m512i wv = _mm512_loadu_si512(wb + q * 64);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, xu + r * K + 4 * q, 4);
          isum[r] = _mm512_dpbusd_epi32(isum[r], _mm512_set1_epi32(x4), wv);
        }
      }
      const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(wb + kVnniRows * K + s * 4 * kVnniRows), 7);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r], off)), _mm512_set1_ps(xs[r * S + s]),
                                 acc[r]);
    }
    const __m512 sc = _mm512_loadu_ps(scale + b * kVnniRows);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 y = _mm512_mul_ps(acc[r], sc);
      if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + b * kVnniRows));
      _mm512_storeu_ps(out + r * ldo + b * kVnniRows, y);
    }
  }
}

using Q8VnniBlockFn = void (*)(const uint8_t*, const float*, const int8_t*, const float*, const float*, float*, int64_t,
                               int64_t, int64_t, int64_t);
constexpr Q8VnniBlockFn kQ8VnniBlocks[kMaxRowsQ4 + 1] = {
    nullptr,          q8_vnni_block<1>, q8_vnni_block<2>, q8_vnni_block<3>, q8_vnni_block<4>,
    q8_vnni_block<5>, q8_vnni_block<6>, q8_vnni_block<7>, q8_vnni_block<8>};

// y[M, N] (row stride ldo) = x[M, K] W^T + b, W packed by int8_pack_vnni with row scales [N].
inline void int8_vnni_rows(const float* x, int64_t M, const int8_t* packed, const float* scale, int64_t N, int64_t K,
                           const float* bias, float* out, int64_t ldo) {
  const Q8Rows xq = quantize_rows_q8(x, M, K);
  const int64_t S = (K + kQ4Super - 1) / kQ4Super;
  std::vector<uint8_t> xu(M * K);
  for (int64_t i = 0; i < M * K; ++i) xu[i] = static_cast<uint8_t>(xq.q[i]) ^ 0x80;  // x + 128
  const int64_t tile = std::max<int64_t>(1, (256 * 1024) / (kVnniRows * K));  // blocks of ~256 KB
  at::parallel_for(0, N / kVnniRows, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t t0 = b0; t0 < b1; t0 += tile) {
      const int64_t t1 = std::min(b1, t0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsQ4) {
        const int64_t R = std::min(kMaxRowsQ4, M - m0);
        kQ8VnniBlocks[R](xu.data() + m0 * K, xq.scale.data() + m0 * S, packed, scale, bias, out + m0 * ldo, K, ldo,
                         t0, t1);
      }
    }
  });
}

// ------------------------------------------------------------------------------------ bf16 on AMX
// On CPUs with AMX (Intel Sapphire Rapids and later) a bf16 layer runs on the tile unit: one
// tdpbf16ps multiplies up to 16 input rows by 32 x 16 weights. The vector blocks above are bound by
// their multiply-adds from a few rows on; the tiles are not. The demo target's fused forward on one
// thread of the Intel VM (2026-12-05, alternated runs): 5 tokens 5.8-6.3 -> 4.5-4.7 ms, 16 tokens
// 18.4-19.6 -> 8.2-9.2 ms, but 1 token 2.7 -> 3.3-3.5 ms: the tiles read the weights (held in L3
// there) at ~22 GB/s to the vector blocks' ~28, whatever the prefetching tried. The real pair's bf16
// target, `specd generate`, 2 threads, weights from memory: alone 8.8-9.1 -> 8.3-8.4 tok/s, with the
// 0.5B drafting k = 4 18.9-20.4 -> 22.8-23.2. Verifying is where speculation spends its time, so the
// tiles are the default; SPECD_AMX=0 keeps the vector blocks. One input row runs on the vector units
// instead, with the tiles' bits (amx_row_span, below).
//
// The tile unit multiplies bf16 by bf16, so x (fp32) goes in as two bf16 terms, hi = bf16(x) and
// lo = bf16(x - hi): 16 of fp32's 24 significant bits, relative error at most 2^-17 per input (max
// |error| / sum |terms| 4-9e-7 against an fp64 sum, the vector blocks' 4-5e-8: far below the bf16
// weights' own rounding). A different order of summation than the vector blocks', so other bits: a
// layer runs here for every batch size or for none (weights are packed for it once, when the fused
// decoder is built), and each output is the same fixed sequence of tile operations whatever the
// batch: rows are independent in tdpbf16ps, so the kernel stays batch invariant.
//
// Packed weights (N % 32 == 0, K % 32 == 0): the tile operand B for 16 weight rows n and 32 inputs k
// is 16 lines of 64 bytes, line j holding, for each n, the pair (w[n][2j], w[n][2j + 1]). Two such
// blocks (32 rows) are stored side by side for each k-step, so a pair of row groups is one stream.

#define SPECD_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,amx-tile,amx-bf16")))

constexpr int64_t kAmxRows = 16;      // input rows per tile
constexpr int64_t kAmxK = 32;         // inputs per tile step
constexpr int64_t kAmxWeightRows = 32;  // weight rows per step: two 16-row tiles
// Without software prefetching the tile loads waited on the weights (the demo target: 4.9 ms a
// token); 1-2 KB ahead did best in a sweep of 0.25-16 KB (to L1; to L2 was slower).
constexpr int64_t kAmxPrefetchBytes = 2048;
// One row on the vector units (amx_row_span) prefetches into L2 4 KB ahead (2-16 KB measured within noise).
constexpr int64_t kAmxRowPrefetchBytes = 4096;

// Whether a layer of N outputs and K inputs can be packed for the tile unit.
inline bool amx_shape_ok(int64_t N, int64_t K) { return N % kAmxWeightRows == 0 && K % kAmxK == 0; }

// Whether this CPU runs bf16 layers on AMX: it has the tile unit, SPECD_AMX is not "0" (for A/B
// runs), and Linux grants this process the tile state (arch_prctl, once; kernels before 5.16 do not).
inline bool use_amx() {
  static const bool yes = [] {
    if (env_is("SPECD_AMX", "0")) return false;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bw"))
      return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return yes;
}

// w bf16 [N, K] -> the packed layout above, N * K values. A block is the 16 x 16 transpose of its rows'
// 32-bit pairs; threads split the row pairs (a quarter of the real pair's bf16 target's 8.6 s load, the rest
// faulting in its weights and the new pages).
// dst (16 x 16 uint32, rows of 64 bytes) = the transpose of 16 rows of 16 uint32 at src, src_stride
// uint16 apart (AMX hosts have AVX-512).
__attribute__((target("avx512f"))) inline void transpose16x16_u32(const uint16_t* src, int64_t src_stride,
                                                                  uint16_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 32, r[i]);
}

inline void amx_pack_bf16(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  const int64_t steps = K / kAmxK;
  // Each 1 KB of the output is a 16 x 16 transpose of 32-bit pairs, written in order: scattering
  // each weight row's pairs 64 bytes apart instead made packing the real pair's 1.5B target add ~1.9 s
  // to a cold start.
  at::parallel_for(0, N / kAmxWeightRows, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t h = 0; h < 2; ++h) {
          const uint16_t* src = w + (p * kAmxWeightRows + h * 16) * K + s * kAmxK;  // 16 rows, K apart
          uint16_t* dst = out + ((p * steps + s) * 2 + h) * (kAmxK * 16);
          transpose16x16_u32(src, K, dst);
        }
  });
}

// float_to_bf16 on 16 lanes (the same bits).
SPECD_AMX inline __m256i bf16x16(__m512i u) {
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

// x [M, K] fp32 -> hi, lo bf16 [M, K] with x ~= hi + lo (K % 16 == 0).
SPECD_AMX inline void split_bf16(const float* x, int64_t M, int64_t K, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < M * K; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256i h = bf16x16(_mm512_castps_si512(v));
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), bf16x16(_mm512_castps_si512(_mm512_sub_ps(v, hf))));
  }
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0, 1: outputs [rows, 16] fp32; 2, 3: x's hi and lo [rows, 32] bf16; 4-7: weights, two k-steps
// of a pair of row groups loaded together (one k-step at a time: 64-69 us a 1376 x 512 layer held in
// L3 at one row, two: 61-63).
SPECD_AMX inline void amx_configure(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  for (int t = 4; t < 8; ++t) cfg.rows[t] = kAmxK / 2, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// Weight-row pairs [p0, p1) of amx_bf16_rows, on the calling thread (its own tile configuration).
SPECD_AMX inline void amx_span(const uint16_t* hi, const uint16_t* lo, int64_t M, const uint16_t* packed, int64_t K,
                               const float* bias, float* out, int64_t ldo, int64_t p0, int64_t p1) {
  const int64_t steps = K / kAmxK;
  const int64_t tile = std::max<int64_t>(1, (256 * 1024) / (kAmxWeightRows * 2 * K));
  int64_t configured = 0;
  for (int64_t t0 = p0; t0 < p1; t0 += tile) {
    const int64_t t1 = std::min(p1, t0 + tile);
    for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
      const int64_t rows = std::min(kAmxRows, M - m0);
      if (rows != configured) amx_configure(rows), configured = rows;
      const uint16_t* xh = hi + m0 * K;
      const uint16_t* xl = lo + m0 * K;
      for (int64_t p = t0; p < t1; ++p) {
        const uint16_t* w = packed + p * steps * 2 * (kAmxK * 16);
        float* y = out + m0 * ldo + p * kAmxWeightRows;
        _tile_zero(0);
        _tile_zero(1);
        int64_t s = 0;
        for (; s + 2 <= steps; s += 2) {
          const char* ahead = reinterpret_cast<const char*>(w + s * 2 * (kAmxK * 16)) + kAmxPrefetchBytes;
          for (int line = 0; line < 64; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
          _tile_loadd(4, w + s * 2 * (kAmxK * 16), 64);
          _tile_loadd(5, w + (s * 2 + 1) * (kAmxK * 16), 64);
          _tile_loadd(6, w + (s * 2 + 2) * (kAmxK * 16), 64);
          _tile_loadd(7, w + (s * 2 + 3) * (kAmxK * 16), 64);
          _tile_loadd(2, xh + s * kAmxK, 2 * K);
          _tile_loadd(3, xl + s * kAmxK, 2 * K);
          _tile_dpbf16ps(0, 2, 4);
          _tile_dpbf16ps(1, 2, 5);
          _tile_dpbf16ps(0, 3, 4);
          _tile_dpbf16ps(1, 3, 5);
          _tile_loadd(2, xh + (s + 1) * kAmxK, 2 * K);
          _tile_loadd(3, xl + (s + 1) * kAmxK, 2 * K);
          _tile_dpbf16ps(0, 2, 6);
          _tile_dpbf16ps(1, 2, 7);
          _tile_dpbf16ps(0, 3, 6);
          _tile_dpbf16ps(1, 3, 7);
        }
        for (; s < steps; ++s) {
          _tile_loadd(4, w + s * 2 * (kAmxK * 16), 64);
          _tile_loadd(5, w + (s * 2 + 1) * (kAmxK * 16), 64);
          _tile_loadd(2, xh + s * kAmxK, 2 * K);
          _tile_loadd(3, xl + s * kAmxK, 2 * K);
          _tile_dpbf16ps(0, 2, 4);
          _tile_dpbf16ps(1, 2, 5);
          _tile_dpbf16ps(0, 3, 4);
          _tile_dpbf16ps(1, 3, 5);
        }
        _tile_stored(0, y, 4 * ldo);
        _tile_stored(1, y + 16, 4 * ldo);
        if (bias != nullptr)
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < kAmxWeightRows; ++j) y[r * ldo + j] += bias[p * kAmxWeightRows + j];
      }
    }
  }
  if (configured) _tile_release();
}

// One input row on the vector units, bit for bit the tile unit's result. What tdpbf16ps computes (the
// SDM's pseudo-code; checked on the Intel VM against the tile unit, 4800 of 4800 outputs over random
// data, one to four k-steps, with and without a prior sum): per output, the even and the odd elements of
// its 16 pairs in two fp32 FMA chains of their own, each from 0 and in pair order, then
// dst + (even + odd), with denormal inputs read as 0 and denormal results flushed to 0 (DAZ, FTZ).
// (One chain over all 32 products, as the intrinsics guide's pseudo-code reads, is not it: an
// earlier emulation found 15% of outputs differing, a throwaway check here 64%.) A packed line j
// holds, per output, the pair (w[n][2j], w[n][2j + 1]) as one dword: its low half is the even
// weight, its high half the odd one. So one row reads the packed weights as they lie, in 512-bit
// registers, as fast as the vector blocks read theirs, where the tiles are slower at one row (see
// above). SPECD_AMX_ONE_ROW=tiles keeps one row on the tiles (for A/B runs).
inline bool amx_row_on_vectors() {
  static const bool yes = !env_is("SPECD_AMX_ONE_ROW", "tiles");
  return yes;
}

// Weight-row pairs [p0, p1) for one input row into out[0, N); hi and lo are amx_bf16_rows' two bf16 terms
// of x, widened to fp32 (exact).
SPECD_AMX inline void amx_row_span(const float* hi, const float* lo, const uint16_t* packed, int64_t K, float* out,
                                   int64_t p0, int64_t p1) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // FTZ and DAZ, as the tile unit works
  const int64_t steps = K / kAmxK;
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* w = packed + p * steps * 2 * (kAmxK * 16);
    __m512 c0 = _mm512_setzero_ps(), c1 = c0;
    for (int64_t s = 0; s < steps; ++s) {
      const uint16_t* w0 = w + s * 2 * (kAmxK * 16);  // rows 0-15 of the pair: 16 lines of 64 bytes
      const uint16_t* w1 = w0 + kAmxK * 16;            // rows 16-31
      const char* ahead = reinterpret_cast<const char*>(w0) + kAmxRowPrefetchBytes;
      const float* xh = hi + s * kAmxK;
      const float* xl = lo + s * kAmxK;
      __m512 he0 = _mm512_setzero_ps(), ho0 = he0, le0 = he0, lo0 = he0, he1 = he0, ho1 = he0, le1 = he0, lo1 = he0;
      for (int j = 0; j < 16; ++j) {
        // A line ahead per line read, into L2: into L1 the prefetches stalled on the line fill buffers
        // (6.6-7.0 tok/s of the real pair's target alone against 7.4-7.7; none at all, 5.3).
        _mm_prefetch(ahead + 64 * j, _MM_HINT_T1);
        _mm_prefetch(ahead + 1024 + 64 * j, _MM_HINT_T1);
        const __m512i l0 = _mm512_loadu_si512(w0 + 32 * j), l1 = _mm512_loadu_si512(w1 + 32 * j);
        const __m512 we0 = _mm512_castsi512_ps(_mm512_slli_epi32(l0, 16));
        const __m512 wo0 = _mm512_castsi512_ps(_mm512_and_si512(l0, odd_mask));
        const __m512 we1 = _mm512_castsi512_ps(_mm512_slli_epi32(l1, 16));
        const __m512 wo1 = _mm512_castsi512_ps(_mm512_and_si512(l1, odd_mask));
        const __m512 xhe = _mm512_set1_ps(xh[2 * j]), xho = _mm512_set1_ps(xh[2 * j + 1]);
        const __m512 xle = _mm512_set1_ps(xl[2 * j]), xlo = _mm512_set1_ps(xl[2 * j + 1]);
        he0 = _mm512_fmadd_ps(xhe, we0, he0), ho0 = _mm512_fmadd_ps(xho, wo0, ho0);
        he1 = _mm512_fmadd_ps(xhe, we1, he1), ho1 = _mm512_fmadd_ps(xho, wo1, ho1);
        le0 = _mm512_fmadd_ps(xle, we0, le0), lo0 = _mm512_fmadd_ps(xlo, wo0, lo0);
        le1 = _mm512_fmadd_ps(xle, we1, le1), lo1 = _mm512_fmadd_ps(xlo, wo1, lo1);
      }
      // The tile kernel's order: hi's product into each output tile, then lo's.
      c0 = _mm512_add_ps(c0, _mm512_add_ps(he0, ho0));
      c1 = _mm512_add_ps(c1, _mm512_add_ps(he1, ho1));
      c0 = _mm512_add_ps(c0, _mm512_add_ps(le0, lo0));
      c1 = _mm512_add_ps(c1, _mm512_add_ps(le1, lo1));
    }
    _mm512_storeu_ps(out + p * kAmxWeightRows, c0);
    _mm512_storeu_ps(out + p * kAmxWeightRows + 16, c1);
  }
  _mm_setcsr(csr);
}

// y[M, N] (row stride ldo) = x[M, K] W^T + b, W packed by amx_pack_bf16. Threads split the weight rows;
// within a thread, a ~256 KB tile of them meets every 16 input rows before the next is read, as in
// linear_rows.
inline void amx_bf16_rows(const float* x, int64_t M, const uint16_t* packed, int64_t N, int64_t K,
                          const float* bias, float* out, int64_t ldo) {
  // hi and lo from a 64-byte boundary (K % 32 == 0, so every row of them starts on one): a tile row
  // is 64 bytes, one cache line when aligned and two when not. A vector's 16-byte alignment made
  // every x tile load split lines, and each 16 rows past the first cost 1.4-1.7x as much (a
  // 2752 x 512 layer at 64 rows, weights in L2, 62 -> 44 cycles per tile product).
  std::vector<uint16_t> buffer(2 * M * K + 32);
  const auto base = reinterpret_cast<std::uintptr_t>(buffer.data());
  uint16_t* hi = reinterpret_cast<uint16_t*>((base + 63) & ~static_cast<std::uintptr_t>(63));
  uint16_t* lo = hi + M * K;
  split_bf16(x, M, K, hi, lo);
  if (M == 1 && amx_row_on_vectors()) {
    std::vector<float> widened(2 * K);
    for (int64_t k = 0; k < K; ++k) widened[k] = bf16_to_float(hi[k]), widened[K + k] = bf16_to_float(lo[k]);
    at::parallel_for(0, N / kAmxWeightRows, 1, [&](int64_t p0, int64_t p1) {
      amx_row_span(widened.data(), widened.data() + K, packed, K, out, p0, p1);
      if (bias != nullptr)  // after the sums, as amx_span adds it (outside the tile unit's flushing)
        for (int64_t n = p0 * kAmxWeightRows; n < p1 * kAmxWeightRows; ++n) out[n] += bias[n];
    });
    return;
  }
  at::parallel_for(0, N / kAmxWeightRows, 1, [&](int64_t p0, int64_t p1) {
    amx_span(hi, lo, M, packed, K, bias, out, ldo, p0, p1);
  });
}

// ------------------------------------------------------------------------------- one interface
// A linear layer's weights in whichever format, as the fused decoder holds them.
enum class Format : int64_t {
  kBf16 = 0,
  kInt8 = 1,
  kInt4 = 2,
  kF32 = 3,
  kBf16Amx = 4,
  kInt8Vnni = 5,
  kBf16DotChunked = 6
};

struct LinearWeights {
  Format format;
  const void* w;        // bf16 [N, K] (kBf16Amx: packed by amx_pack_bf16, kBf16DotChunked: by dot_chunk_pack),
                        // int8 [N, K] (kInt8Vnni: packed by int8_pack_vnni), int4 records
                        // [N, int4_row_bytes(K)], or fp32 [N, K]
  const float* scale;   // int8: [N]; else null
  const float* bias;    // fp32 [N] or null
  int64_t N, K;
  int64_t chunk = 0;  // kBf16DotChunked: weights per chunk
};

// y[M, N] (row stride ldo) = x[M, K] (fp32, contiguous) W^T + b.
inline void linear_any(const LinearWeights& lw, const float* x, int64_t M, float* out, int64_t ldo) {
  switch (lw.format) {
    case Format::kBf16:
      linear_rows(x, M, Bf16Rows{static_cast<const uint16_t*>(lw.w), lw.K}, lw.N, lw.bias, out, ldo);
      break;
    case Format::kInt8:
      int8_rows(x, M, static_cast<const int8_t*>(lw.w), lw.scale, lw.N, lw.K, lw.bias, out, ldo);
      break;
    case Format::kInt4:
      int4_rows(x, M, static_cast<const uint8_t*>(lw.w), lw.N, lw.K, lw.bias, out, ldo);
      break;
    case Format::kF32:
      linear_rows(x, M, F32Rows{static_cast<const float*>(lw.w), lw.K}, lw.N, lw.bias, out, ldo);
      break;
    case Format::kBf16Amx:
      amx_bf16_rows(x, M, static_cast<const uint16_t*>(lw.w), lw.N, lw.K, lw.bias, out, ldo);
      break;
    case Format::kInt8Vnni:
      int8_vnni_rows(x, M, static_cast<const int8_t*>(lw.w), lw.scale, lw.N, lw.K, lw.bias, out, ldo);
      break;
    case Format::kBf16DotChunked:
      bf16_dot_rows(x, M, static_cast<const uint16_t*>(lw.w), lw.K, lw.N, lw.bias, out, ldo, lw.chunk);
      break;
  }
}

}  // namespace specd
