// y = x W^T + b for bf16 and weight-only int8 and int4 weights on AVX2 CPUs, where oneDNN has no bf16 path (AMD Zen 3, pre-AVX-512
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kMaxRows = 7;  // 14 accumulators + 1 weight register: the 16 ymm registers

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                 // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // 2
  s = _mm_add_ss(s, _mm_movehdup_ps(s));         // 1
  return _mm_cvtss_f32(s);
}

// How each weight format turns kStep consecutive weights of row n, from column k, into fp32
// vectors (widen), one weight into a float (scalar, for the K % kStep tail), and a finished dot
// product into the output (finish: a per-row scale). bytes_per_row sizes the L2 tiles.

// bf16: one 32-byte load, each half-word moved to the top of a 32-bit lane by interleaving with
// zeros (two instructions for 16 weights); unpack works within 128-bit lanes, so the vectors hold
// weights [0-3, 8-11] and [4-7, 12-15], and x is laid out in that order once per call
// (permute_x_for_bf16).
struct Bf16Rows {
  static constexpr bool kPermuteX = true;
  const uint16_t* w;
  int64_t K;
  static constexpr int kStep = 16;
  int64_t bytes_per_row() const { return 2 * K; }
  void widen(int64_t n, int64_t k, __m256* wv) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * K + k));
    const __m256i z = _mm256_setzero_si256();
    wv[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    wv[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  }
  float scalar(int64_t n, int64_t k) const { return bf16_to_float(w[n * K + k]); }
  float finish(int64_t, float s) const { return s; }
};

// int8 with one fp32 scale per output row, applied once to the finished dot product.
struct Int8Rows {
  static constexpr bool kPermuteX = false;
  const int8_t* w;
  const float* scale;
  int64_t K;
  static constexpr int kStep = 16;
  int64_t bytes_per_row() const { return K; }
  static __m256 widen8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  void widen(int64_t n, int64_t k, __m256* wv) const {
    wv[0] = widen8(w + n * K + k);
    wv[1] = widen8(w + n * K + k + 8);
  }
  float scalar(int64_t n, int64_t k) const { return static_cast<float>(w[n * K + k]); }
  float finish(int64_t n, float s) const { return s * scale[n]; }
};

// Rows [0, R) of x (fp32, row stride K) against weight rows [n0, n1); out is fp32 [R, N].
// NR weight rows at a time: with few input rows, the FMA chains of one weight row alone are too few
// to hide their latency, so two rows are interleaved (each row's own accumulation order unchanged).
template <typename C, int R, int NR>
void block(const float* x, const C& c, const float* bias, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int V = C::kStep / 8;  // weight vectors per step; even ones go to a0, odd ones to a1
  const int64_t K16 = K - K % C::kStep;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 a0[NR][R], a1[NR][R];
    for (int j = 0; j < NR; ++j)
      for (int r = 0; r < R; ++r) a0[j][r] = a1[j][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += C::kStep) {
      for (int j = 0; j < NR; ++j) {
        __m256 wv[V];
        c.widen(n + j, k, wv);
        for (int v = 0; v < V; v += 2) {
          for (int r = 0; r < R; ++r)
            a0[j][r] = _mm256_fmadd_ps(wv[v], _mm256_loadu_ps(x + r * K + k + 8 * v), a0[j][r]);
          for (int r = 0; r < R; ++r)
            a1[j][r] = _mm256_fmadd_ps(wv[v + 1], _mm256_loadu_ps(x + r * K + k + 8 * v + 8), a1[j][r]);
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      for (int r = 0; r < R; ++r) {
        float s = hsum(_mm256_add_ps(a0[j][r], a1[j][r]));
        for (int64_t k = K16; k < K; ++k) s += c.scalar(n + j, k) * x[r * K + k];
        s = c.finish(n + j, s);
        out[r * N + n + j] = bias ? s + bias[n + j] : s;
      }
    }
  }
  if (n < n1) block<C, R, 1>(x, c, bias, out, K, N, n, n1);  // the odd row: same arithmetic per row
}

template <typename C>
using BlockFn = void (*)(const float*, const C&, const float*, float*, int64_t, int64_t, int64_t, int64_t);

template <typename C>
constexpr BlockFn<C> kBlocks[kMaxRows + 1] = {nullptr,          block<C, 1, 1>, block<C, 2, 2>, block<C, 3, 2>,
                                              block<C, 4, 1>, block<C, 5, 1>, block<C, 6, 1>, block<C, 7, 1>};

// ---------------------------------------------------------------------------------------- int4
// Weight-only int4, asymmetric, in groups of 32 along a row: w = nibble * scale + min, scale and min
// in fp16. Each weight row is one contiguous record of K / 2 + 4 * G bytes (G = K / 32 groups):
// the nibbles, then G scales, then G mins, so decoding reads one sequential stream per row (three
// separate arrays measured slower: short streams the prefetcher did not follow). Groups go in
// pairs: the 32 bytes of groups 2p and 2p + 1 hold group 2p's weights in their low nibbles and group
// 2p + 1's in their high ones (one load, a mask and a shift give both); an odd last group is 16
// bytes, byte j holding its weight j in the low nibble and weight j + 16 in the high one. Widening every weight to fp32 (as bf16 and int8 do)
// made this kernel compute bound at a third of the memory bandwidth, so it works in integers, as
// llama.cpp does: each input row is quantized once per call to int8 in groups of 32 (scale
// max|x| / 127), and a group's dot product is one u8 x s8 multiply-add (maddubs, exact: at most
// 2 * 15 * 127 per pair) and one pairwise add to int32, scaled once by scale_w * scale_x. The min
// term, sum over groups of min_w * scale_x * sum(x_q), is a short dot product per output.
// Batch invariance holds as for the other formats: a row's quantization and every accumulation
// order depend on that row alone.

struct QuantizedRows {  // activations, [M, K] -> int8 [M, K], per-group scale and scale * sum [M, G]
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum;
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  QuantizedRows out{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * 32;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      int8_t* qg = out.q.data() + m * K + g * 32;
      for (int i = 0; i < 32; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xg[i] * inv));
        qg[i] = static_cast<int8_t>(std::clamp(v, -127, 127));
        sum += qg[i];
      }
      out.scale[m * G + g] = scale;
      out.scaled_sum[m * G + g] = scale * static_cast<float>(sum);
    }
  }
  return out;
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

constexpr int64_t kMaxGroups = 2048;  // K up to 65,536 (the widest MLPs of open models are ~53k)

// Input rows [0, R) against weight rows [n0, n1), NR weight rows interleaved (more independent
// accumulators when R is small); out is fp32 [R, N].
template <int R, int NR>
void q4_block(const QuantizedRows& xq, int64_t m0, const uint8_t* w, const float* bias, float* out, int64_t K,
              int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / 32, row_bytes = K / 2 + 4 * G;
  const int8_t* xqp = xq.q.data() + m0 * K;
  const float* xs = xq.scale.data() + m0 * G;
  const float* xss = xq.scaled_sum.data() + m0 * G;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // Group g of input row r against weights wv (32 nibbles as bytes) scaled by sw.
  auto group = [&](__m256& acc, int r, int64_t g, __m256i wv, __m256 sw) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqp + r * K + g * 32));
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
    acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(sw, _mm256_broadcast_ss(xs + r * G + g)), acc);
  };
  alignas(32) float scales[NR][kMaxGroups];  // each weight row's scales in fp32, converted once
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 acc[NR][R];
    for (int j = 0; j < NR; ++j) {
      for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
      const uint16_t* sh = reinterpret_cast<const uint16_t*>(w + (n + j) * row_bytes + K / 2);
      int64_t g = 0;
      for (; g + 8 <= G; g += 8)
        _mm256_store_ps(scales[j] + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sh + g))));
      for (; g < G; ++g) scales[j][g] = half_to_float(sh[g]);
    }
    for (int64_t g = 0; g + 2 <= G; g += 2) {  // two groups per 32-byte load: low nibbles g, high g + 1
      for (int j = 0; j < NR; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n + j) * row_bytes + g * 16));
        const __m256i wa = _mm256_and_si256(v, low4), wb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        const __m256 sa = _mm256_broadcast_ss(scales[j] + g), sb = _mm256_broadcast_ss(scales[j] + g + 1);
        for (int r = 0; r < R; ++r) group(acc[j][r], r, g, wa, sa);
        for (int r = 0; r < R; ++r) group(acc[j][r], r, g + 1, wb, sb);
      }
    }
    if (G % 2) {  // an odd last group: 16 bytes, low nibbles its first 16 weights, high its last 16
      const int64_t g = G - 1;
      for (int j = 0; j < NR; ++j) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + j) * row_bytes + g * 16));
        const __m128i l4 = _mm256_castsi256_si128(low4);
        const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), l4), _mm_and_si128(b, l4));
        const __m256 sw = _mm256_broadcast_ss(scales[j] + g);
        for (int r = 0; r < R; ++r) group(acc[j][r], r, g, wv, sw);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const uint16_t* mrow = reinterpret_cast<const uint16_t*>(w + (n + j) * row_bytes + K / 2) + G;
      for (int r = 0; r < R; ++r) {
        __m256 mins = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= G; g += 8) {
          const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mrow + g)));
          mins = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xss + r * G + g), mins);
        }
        float s = hsum(acc[j][r]) + hsum(mins);
        for (; g < G; ++g) s += half_to_float(mrow[g]) * xss[r * G + g];
        out[r * N + n + j] = bias ? s + bias[n + j] : s;
      }
    }
  }
  if (n < n1) q4_block<R, 1>(xq, m0, w, bias, out, K, N, n, n1);
}

constexpr int64_t kMaxRowsQ4 = 8;
using Q4BlockFn = void (*)(const QuantizedRows&, int64_t, const uint8_t*, const float*, float*, int64_t, int64_t,
                           int64_t, int64_t);
constexpr Q4BlockFn kQ4Blocks[kMaxRowsQ4 + 1] = {nullptr,          q4_block<1, 2>, q4_block<2, 2>,
                                                 q4_block<3, 2>, q4_block<4, 1>, q4_block<5, 1>,
                                                 q4_block<6, 1>, q4_block<7, 1>, q4_block<8, 1>};

// x [M, K] in fp32, each 16-wide chunk reordered to [0-3, 8-11, 4-7, 12-15] as Bf16Rows::widen reads bf16.
at::Tensor permute_x_for_bf16(const at::Tensor& xf) {
  const int64_t M = xf.size(0), K = xf.size(1), K16 = K - K % 16;
  at::Tensor out = xf.clone();
  if (K16) {
    out.narrow(1, 0, K16).copy_(
        xf.narrow(1, 0, K16).reshape({M, K16 / 16, 2, 2, 4}).transpose(2, 3).reshape({M, K16}));
  }
  return out;
}

template <typename C>
at::Tensor linear(const at::Tensor& x, const C& c, int64_t N, const c10::optional<at::Tensor>& bias) {
  const int64_t K = c.K;
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  auto lead = x.sizes().vec();
  lead.pop_back();
  at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  if constexpr (C::kPermuteX) xf = permute_x_for_bf16(xf);
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
  const int64_t tile = std::max<int64_t>(4, (256 * 1024) / c.bytes_per_row());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t R = std::min(kMaxRows, M - m0);
        kBlocks<C>[R](xp + m0 * K, c, bp, op + m0 * N, K, N, t0, t1);
      }
    }
  });
  lead.push_back(N);
  return out.to(x.scalar_type()).reshape(lead);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D bf16 tensor");
  const Bf16Rows c{reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), weight.size(1)};
  return linear(x, c, weight.size(0), bias);
}

// Weight-only int8 with one fp32 scale per output row: w[n, k] ~= weight[n, k] * scale[n].
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D int8 tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0) && scale.is_contiguous(),
              "scale must be a contiguous fp32 tensor with one entry per weight row");
  const Int8Rows c{weight.data_ptr<int8_t>(), scale.data_ptr<float>(), weight.size(1)};
  return linear(x, c, weight.size(0), bias);
}

// Weight-only int4 (see q4_block): packed [N, K / 2 + K / 8] bytes, one record per row.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be a contiguous 2-D uint8 tensor");
  const int64_t N = packed.size(0), K = packed.size(1) * 8 / 5;
  TORCH_CHECK(K % 32 == 0 && K / 2 + K / 8 == packed.size(1), "int4 rows must be K / 2 + K / 8 bytes with K % 32 == 0");
  TORCH_CHECK(K / 32 <= kMaxGroups, "int4 weights support up to ", 32 * kMaxGroups, " input features, got ", K);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  auto lead = x.sizes().vec();
  lead.pop_back();
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  const QuantizedRows xq = quantize_rows(xf.data_ptr<float>(), M, K);
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, xf.options());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const auto* wp = packed.data_ptr<uint8_t>();
  const int64_t tile = std::max<int64_t>(4, (256 * 1024) / packed.size(1));  // as in linear(): W tiles stay in L2
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsQ4) {
        const int64_t R = std::min(kMaxRowsQ4, M - m0);
        kQ4Blocks[R](xq, m0, wp, bp, op + m0 * N, K, N, t0, t1);
      }
    }
  });
  lead.push_back(N);
  return out.to(x.scalar_type()).reshape(lead);
}

}  // namespace

TORCH_LIBRARY(specd_kernels, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(specd_kernels, CPU, m) {
  m.impl("bf16_linear", bf16_linear);
  m.impl("int8_linear", int8_linear);
  m.impl("int4_linear", int4_linear);
}
