// y = x W^T + b for bf16 weights on AVX2 CPUs, where oneDNN has no bf16 path (AMD Zen 3, pre-AVX-512
// Intel). Decoding reads every weight once per step, so the kernel is built around that stream:
// each weight row is read once per block of up to 7 input rows and widened to fp32 in registers
// (a bf16 is the top half of an fp32), with every row's dot product accumulated in fp32.
//
// Batch invariance, which lossless speculation relies on: row m's result depends only on x[m] and
// W, never on how many rows are in the batch or how the work is split over threads. Every output
// element is accumulated in the same fixed order (two 8-lane partial sums over k, a fixed final
// reduction), so verifying k+1 tokens gives bit-for-bit the logits of decoding them one at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kMaxRows = 7;  // 14 accumulators + 1 weight register: the 16 ymm registers

inline __m256 widen_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                 // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // 2
  s = _mm_add_ss(s, _mm_movehdup_ps(s));         // 1
  return _mm_cvtss_f32(s);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows [0, R) of x (fp32, row stride K) against weight rows [n0, n1); out is fp32 [R, N].
template <int R>
void block(const float* x, const uint16_t* w, const float* bias, float* out, int64_t K, int64_t N, int64_t n0,
           int64_t n1) {
  const int64_t K16 = K - K % 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
      __m256 w0 = widen_bf16(wr + k);
      for (int r = 0; r < R; ++r) a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), a0[r]);
      __m256 w1 = widen_bf16(wr + k + 8);
      for (int r = 0; r < R; ++r) a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), a1[r]);
    }
    for (int r = 0; r < R; ++r) {
      float s = hsum(_mm256_add_ps(a0[r], a1[r]));
      for (int64_t k = K16; k < K; ++k) s += bf16_to_float(wr[k]) * x[r * K + k];
      out[r * N + n] = bias ? s + bias[n] : s;
    }
  }
}

using BlockFn = void (*)(const float*, const uint16_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr BlockFn kBlocks[kMaxRows + 1] = {nullptr,   block<1>, block<2>, block<3>,
                                           block<4>, block<5>, block<6>, block<7>};

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D bf16 tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  auto lead = x.sizes().vec();
  lead.pop_back();
  at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Threads split the weight rows. Within a thread, a tile of weight rows (~256 KB, so it stays in
  // L2) meets every block of input rows before the next tile is read: decoding (M <= 7) streams W
  // from memory once, and a prefill of many rows reads it from memory once too, not once per block.
  const int64_t tile = std::max<int64_t>(4, (256 * 1024) / (K * 2));
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t R = std::min(kMaxRows, M - m0);
        kBlocks[R](xp + m0 * K, wp, bp, op + m0 * N, K, N, t0, t1);
      }
    }
  });
  lead.push_back(N);
  return out.to(x.scalar_type()).reshape(lead);
}

}  // namespace

TORCH_LIBRARY(specd_kernels, m) { m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(specd_kernels, CPU, m) { m.impl("bf16_linear", bf16_linear); }
