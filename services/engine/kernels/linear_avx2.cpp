// y = x W^T + b for bf16 (and weight-only int8) weights on AVX2 CPUs, where oneDNN has no bf16 path (AMD Zen 3, pre-AVX-512
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
#include <type_traits>

namespace {

constexpr int64_t kMaxRows = 7;  // 14 accumulators + 1 weight register: the 16 ymm registers

inline __m256 widen_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 int8 weights, widened to fp32 (the row's scale is applied once, to the finished dot product).
inline __m256 widen_i8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// 16 weights as two fp32 vectors. bf16: one 32-byte load, each half-word moved to the top of a
// 32-bit lane by interleaving with zeros (two instructions for 16 weights); unpack works within
// 128-bit lanes, so the vectors hold weights [0-3, 8-11] and [4-7, 12-15], and x is laid out in
// that order once per call (permute_x_for_bf16). int8: sign-extended and converted, in order.
inline void widen16(const uint16_t* p, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_setzero_si256();
  w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
  w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}
inline void widen16(const int8_t* p, __m256& w0, __m256& w1) {
  w0 = widen_i8(p);
  w1 = widen_i8(p + 8);
}
inline float scalar(uint16_t h);
inline float scalar(int8_t v) { return static_cast<float>(v); }

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                 // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // 2
  s = _mm_add_ss(s, _mm_movehdup_ps(s));         // 1
  return _mm_cvtss_f32(s);
}

inline float scalar(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows [0, R) of x (fp32, row stride K) against weight rows [n0, n1) of type W (bf16 bits or int8
// with a per-row scale); out is fp32 [R, N].
// NR weight rows at a time: with few input rows, the FMA chains of one weight row alone are too few
// to hide their latency, so two rows are interleaved (each row's own accumulation order unchanged).
template <typename W, int R, int NR>
void block(const float* x, const W* w, const float* scale, const float* bias, float* out, int64_t K, int64_t N,
           int64_t n0, int64_t n1) {
  const int64_t K16 = K - K % 16;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 a0[NR][R], a1[NR][R];
    for (int j = 0; j < NR; ++j)
      for (int r = 0; r < R; ++r) a0[j][r] = a1[j][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
      for (int j = 0; j < NR; ++j) {
        __m256 w0, w1;
        widen16(w + (n + j) * K + k, w0, w1);
        for (int r = 0; r < R; ++r) a0[j][r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), a0[j][r]);
        for (int r = 0; r < R; ++r) a1[j][r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), a1[j][r]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const W* wr = w + (n + j) * K;
      for (int r = 0; r < R; ++r) {
        float s = hsum(_mm256_add_ps(a0[j][r], a1[j][r]));
        for (int64_t k = K16; k < K; ++k) s += scalar(wr[k]) * x[r * K + k];
        if (scale) s *= scale[n + j];
        out[r * N + n + j] = bias ? s + bias[n + j] : s;
      }
    }
  }
  if (n < n1) block<W, R, 1>(x, w, scale, bias, out, K, N, n, n1);  // the odd row: same arithmetic per row
}

template <typename W>
using BlockFn = void (*)(const float*, const W*, const float*, const float*, float*, int64_t, int64_t, int64_t,
                         int64_t);

template <typename W>
constexpr BlockFn<W> kBlocks[kMaxRows + 1] = {nullptr,          block<W, 1, 1>, block<W, 2, 2>, block<W, 3, 2>,
                                              block<W, 4, 1>, block<W, 5, 1>, block<W, 6, 1>, block<W, 7, 1>};

// x [M, K] in fp32, each 16-wide chunk reordered to [0-3, 8-11, 4-7, 12-15] as widen16 reads bf16.
at::Tensor permute_x_for_bf16(const at::Tensor& xf) {
  const int64_t M = xf.size(0), K = xf.size(1), K16 = K - K % 16;
  at::Tensor out = xf.clone();
  if (K16) {
    out.narrow(1, 0, K16).copy_(
        xf.narrow(1, 0, K16).reshape({M, K16 / 16, 2, 2, 4}).transpose(2, 3).reshape({M, K16}));
  }
  return out;
}

template <typename W>
at::Tensor linear(const at::Tensor& x, const W* wp, int64_t N, int64_t K, const float* scale,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  auto lead = x.sizes().vec();
  lead.pop_back();
  at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  if constexpr (std::is_same_v<W, uint16_t>) xf = permute_x_for_bf16(xf);
  const int64_t M = xf.size(0);
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Threads split the weight rows. Within a thread, a tile of weight rows (~256 KB, so it stays in
  // L2) meets every block of input rows before the next tile is read: decoding (M <= 7) streams W
  // from memory once, and a prefill of many rows reads it from memory once too, not once per block.
  const int64_t tile = std::max<int64_t>(4, (256 * 1024) / (K * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t R = std::min(kMaxRows, M - m0);
        kBlocks<W>[R](xp + m0 * K, wp, scale, bp, op + m0 * N, K, N, t0, t1);
      }
    }
  });
  lead.push_back(N);
  return out.to(x.scalar_type()).reshape(lead);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D bf16 tensor");
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  return linear<uint16_t>(x, wp, weight.size(0), weight.size(1), nullptr, bias);
}

// Weight-only int8 with one fp32 scale per output row: w[n, k] ~= weight[n, k] * scale[n].
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D int8 tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0) && scale.is_contiguous(),
              "scale must be a contiguous fp32 tensor with one entry per weight row");
  return linear<int8_t>(x, weight.data_ptr<int8_t>(), weight.size(0), weight.size(1), scale.data_ptr<float>(), bias);
}

}  // namespace

TORCH_LIBRARY(specd_kernels, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(specd_kernels, CPU, m) {
  m.impl("bf16_linear", bf16_linear);
  m.impl("int8_linear", int8_linear);
}
