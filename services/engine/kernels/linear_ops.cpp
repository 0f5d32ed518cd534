// The linear kernels of linear.h as torch ops: specd_kernels::bf16_linear, f32_linear, int8_linear, int4_linear,
// for the Python forward (services/engine/llama.py) when the fused decoder (decoder.cpp) is not used.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "huge_pages.h"
#include "linear.h"

namespace {

using specd::Format;
using specd::LinearWeights;

at::Tensor run(const at::Tensor& x, const LinearWeights& lw) {
  TORCH_CHECK(x.size(-1) == lw.K, "x has ", x.size(-1), " features, the weight ", lw.K);
  auto lead = x.sizes().vec();
  lead.pop_back();
  const at::Tensor xf = x.reshape({-1, lw.K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor out = at::empty({M, lw.N}, xf.options());
  specd::linear_any(lw, xf.data_ptr<float>(), M, out.data_ptr<float>(), lw.N);
  lead.push_back(lw.N);
  return out.to(x.scalar_type()).reshape(lead);
}

const float* bias_ptr(const c10::optional<at::Tensor>& bias, at::Tensor& holder, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == N, "bias must have one entry per weight row");
  holder = bias->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

// Weight-only int8 weights [N, K] and their row scales [N], as the int8 ops take them.
void check_int8(const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D int8 tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0) && scale.is_contiguous(),
              "scale must be a contiguous fp32 tensor with one entry per weight row");
}

// Unquantized weights [N, K] of one dtype, read as they are.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        at::ScalarType dtype, Format format, const char* name) {
  TORCH_CHECK(weight.scalar_type() == dtype && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D ", name, " tensor");
  at::Tensor b;
  const LinearWeights lw{format, weight.data_ptr(), nullptr, bias_ptr(bias, b, weight.size(0)), weight.size(0),
                         weight.size(1)};
  return run(x, lw);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return dense_linear(x, weight, bias, at::kBFloat16, Format::kBf16, "bf16");
}

// bf16 weights packed in chunks of `chunk` weights for the dot products (linear.h, kDotChunkWeights),
// packed at each call: for tests (the fused decoder packs its long-row layers once).
at::Tensor bf16_dot_chunked_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                   int64_t chunk) {
  TORCH_CHECK(specd::use_bf16_dot(), "the bf16 dot products are off in this process");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK(chunk > 0 && chunk % 64 == 0 && weight.size(1) % chunk == 0,
              "chunk must be a multiple of 64 that divides the rows' width");
  const at::Tensor packed = at::empty_like(weight);
  specd::dot_chunk_pack(static_cast<const uint16_t*>(weight.data_ptr()), weight.size(0), weight.size(1), chunk,
                        static_cast<uint16_t*>(packed.data_ptr()));
  at::Tensor b;
  LinearWeights lw{Format::kBf16DotChunked, packed.data_ptr(), nullptr, bias_ptr(bias, b, weight.size(0)),
                   weight.size(0), weight.size(1)};
  lw.chunk = chunk;
  return run(x, lw);
}

// Several bf16 weights [N_i, K] against one input in one pass of the threads (linear.h, bf16_dot_parts),
// as the fused decoder runs q, k and v (an empty bias: none): [.., sum N_i]. For tests.
at::Tensor bf16_dot_parts_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                 const std::vector<at::Tensor>& biases) {
  TORCH_CHECK(specd::use_bf16_dot(), "the bf16 dot products are off in this process");
  TORCH_CHECK(!weights.empty() && weights.size() == biases.size(), "one bias (or an empty tensor) per weight");
  const int64_t K = x.size(-1);
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  int64_t N = 0;
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.size(1) == K,
                "every weight must be a contiguous 2-D bf16 tensor as wide as x");
    N += w.size(0);
  }
  at::Tensor out = at::empty({xf.size(0), N}, xf.options());
  std::vector<at::Tensor> held(weights.size());
  std::vector<specd::DotPart> parts;
  int64_t offset = 0;
  for (size_t i = 0; i < weights.size(); offset += weights[i].size(0), ++i)
    parts.push_back({static_cast<const uint16_t*>(weights[i].data_ptr()), weights[i].size(0),
                     biases[i].numel() ? bias_ptr(biases[i], held[i], weights[i].size(0)) : nullptr,
                     out.data_ptr<float>() + offset});
  specd::bf16_dot_parts(xf.data_ptr<float>(), xf.size(0), K, parts.data(), static_cast<int>(parts.size()), N);
  auto lead = x.sizes().vec();
  lead.back() = N;
  return out.reshape(lead);
}

// bf16 weights on the tile unit (linear.h, "bf16 on AMX"), packed at each call: for tests and
// microbenchmarks (the fused decoder packs its layers once).
at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(specd::use_amx(), "this CPU (or kernel, or SPECD_AMX=0) does not run AMX tiles");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK(specd::amx_shape_ok(weight.size(0), weight.size(1)), "AMX needs N % 32 == 0 and K % 32 == 0");
  const at::Tensor packed = at::empty_like(weight);
  specd::amx_pack_bf16(static_cast<const uint16_t*>(weight.data_ptr()), weight.size(0), weight.size(1),
                       static_cast<uint16_t*>(packed.data_ptr()));
  at::Tensor b;
  const LinearWeights lw{Format::kBf16Amx, packed.data_ptr(), nullptr, bias_ptr(bias, b, weight.size(0)),
                         weight.size(0), weight.size(1)};
  return run(x, lw);
}

bool amx_usable() { return specd::use_amx(); }

// int8 weights packed for VNNI (linear.h, "int8 packed for VNNI"), packed at each call: for tests and
// microbenchmarks (the fused decoder packs its layers once).
at::Tensor int8_vnni_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(specd::use_avx512_vnni(), "this CPU (or SPECD_AVX512=0) does not run AVX-512 VNNI");
  check_int8(weight, scale);
  TORCH_CHECK(specd::vnni_shape_ok(weight.size(0), weight.size(1)), "VNNI packing needs N % 16 == 0 and K % 32 == 0");
  const at::Tensor packed = at::empty({specd::vnni_packed_bytes(weight.size(0), weight.size(1))}, weight.options());
  specd::int8_pack_vnni(weight.data_ptr<int8_t>(), weight.size(0), weight.size(1), packed.data_ptr<int8_t>());
  at::Tensor b;
  const LinearWeights lw{Format::kInt8Vnni, packed.data_ptr(), scale.data_ptr<float>(),
                         bias_ptr(bias, b, weight.size(0)), weight.size(0), weight.size(1)};
  return run(x, lw);
}

// fp32 weights: where torch's fp32 matmul streams weights slowly at decoding's few rows (MKL's sgemm on
// AMD CPUs: 4-16 GB/s of weights at 1-8 rows on a Zen 3 reading 26-48 GB/s), and batch invariant.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return dense_linear(x, weight, bias, at::kFloat, Format::kF32, "fp32");
}

// Weight-only int8 with one fp32 scale per output row: w[n, k] ~= weight[n, k] * scale[n].
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  check_int8(weight, scale);
  at::Tensor b;
  const LinearWeights lw{Format::kInt8, weight.data_ptr(), scale.data_ptr<float>(), bias_ptr(bias, b, weight.size(0)),
                         weight.size(0), weight.size(1)};
  return run(x, lw);
}

// Weight-only int4 (see linear.h): packed [N, int4_row_bytes(K)] bytes, one record per row; K is x's width.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be a contiguous 2-D uint8 tensor");
  const int64_t N = packed.size(0), K = x.size(-1);
  TORCH_CHECK(K % 32 == 0 && specd::int4_row_bytes(K) == packed.size(1), "int4 records of ", packed.size(1),
              " bytes do not hold rows of ", K, " weights (K must be a multiple of 32)");
  at::Tensor b;
  const LinearWeights lw{Format::kInt4, packed.data_ptr(), nullptr, bias_ptr(bias, b, N), N, K};
  return run(x, lw);
}


// The int4 records of a float/bf16 weight [N, K] (K % 32 == 0), exactly as llama.quantize_int4
// computes them (which is the reference the tests compare against), in a fraction of the time.
at::Tensor quantize_int4(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % 32 == 0, "int4 needs a 2-D weight with K % 32 == 0");
  const int64_t N = weight.size(0), K = weight.size(1), G = K / 32, S = (K + 255) / 256;
  const int64_t row_bytes = specd::int4_row_bytes(K);
  at::Tensor out = at::empty({N, row_bytes}, at::kByte);
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    const at::Tensor rows = weight.narrow(0, n0, n1 - n0).to(at::kFloat).contiguous();
    const float* wp = rows.data_ptr<float>();
    std::vector<float> scale(G), neg_min(G);
    std::vector<uint8_t> q(K);
    for (int64_t n = n0; n < n1; ++n) {
      const float* w = wp + (n - n0) * K;
      uint8_t* rec = op + n * row_bytes;
      for (int64_t g = 0; g < G; ++g) {
        float lo = w[g * 32], hi = w[g * 32];
        for (int i = 1; i < 32; ++i) lo = std::min(lo, w[g * 32 + i]), hi = std::max(hi, w[g * 32 + i]);
        lo = std::min(lo, 0.0f);
        scale[g] = (hi - lo) / 15.0f;
        neg_min[g] = -lo;
      }
      uint16_t* dd = reinterpret_cast<uint16_t*>(rec + K / 2 + 2 * G);
      for (int64_t s = 0; s < S; ++s) {
        const int64_t g0 = s * 8, g1 = std::min(G, g0 + 8);
        float smax = 0.0f, mmax = 0.0f;
        for (int64_t g = g0; g < g1; ++g) smax = std::max(smax, scale[g]), mmax = std::max(mmax, neg_min[g]);
        const uint16_t dh = _cvtss_sh(smax / 255.0f, 0), mh = _cvtss_sh(mmax / 255.0f, 0);
        dd[s] = dh, dd[S + s] = mh;
        const float d = specd::half_to_float(dh), dmin = specd::half_to_float(mh);
        for (int64_t g = g0; g < g1; ++g) {
          const float sc = d > 0.0f ? std::clamp(std::nearbyint(scale[g] / d), 0.0f, 255.0f) : 0.0f;
          const float m = dmin > 0.0f ? std::clamp(std::nearbyint(neg_min[g] / dmin), 0.0f, 255.0f) : 0.0f;
          rec[K / 2 + g] = static_cast<uint8_t>(sc);
          rec[K / 2 + G + g] = static_cast<uint8_t>(m);
          const float step = d * sc, offset = dmin * m;
          if (step > 0.0f) {  // 8 at a time: the same IEEE add, division and rounding as one at a time
            const __m256 vo = _mm256_set1_ps(offset), vstep = _mm256_set1_ps(step), top = _mm256_set1_ps(15.0f);
            for (int i = 0; i < 32; i += 8) {
              const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_add_ps(_mm256_loadu_ps(w + g * 32 + i), vo), vstep),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
              alignas(32) int32_t v[8];
              _mm256_store_si256(reinterpret_cast<__m256i*>(v),
                                 _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, _mm256_setzero_ps()), top)));
              for (int j = 0; j < 8; ++j) q[g * 32 + i + j] = static_cast<uint8_t>(v[j]);
            }
          } else {
            std::fill(q.begin() + g * 32, q.begin() + g * 32 + 32, 0);
          }
        }
      }
      const int64_t even = G - G % 2;
      for (int64_t p = 0; p < even / 2; ++p)
        for (int j = 0; j < 32; ++j) rec[p * 32 + j] = q[64 * p + j] | (q[64 * p + 32 + j] << 4);
      if (G % 2)
        for (int j = 0; j < 16; ++j) rec[even * 16 + j] = q[even * 32 + j] | (q[even * 32 + 16 + j] << 4);
    }
  });
  return out;
}

// Symmetric int8 with one fp32 scale per row, exactly as llama.quantize_int8_reference computes it:
// scale = max(max(w), -min(w)) / 127 (at least 1e-12), q = round(w / scale) clamped to +-127.
std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "int8 needs a 2-D weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor q = at::empty({N, K}, at::kChar), scale = at::empty({N}, at::kFloat);
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    const at::Tensor rows = weight.narrow(0, n0, n1 - n0).to(at::kFloat).contiguous();
    const float* wp = rows.data_ptr<float>();
    for (int64_t n = n0; n < n1; ++n) {
      const float* w = wp + (n - n0) * K;
      float hi = w[0], lo = w[0];
      for (int64_t k = 1; k < K; ++k) hi = std::max(hi, w[k]), lo = std::min(lo, w[k]);
      const float s = std::max(std::max(hi, -lo) / 127.0f, 1e-12f);
      sp[n] = s;
      // Vector division and rounding: the same IEEE results as the scalar reference, 8 at a time.
      const __m256 vs = _mm256_set1_ps(s), vlo = _mm256_set1_ps(-127.0f), vhi = _mm256_set1_ps(127.0f);
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(w + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m128i i = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, vlo), vhi)), _mm256_setzero_si256()), _mm256_setzero_si256()),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(qp + n * K + k), i);
      }
      for (; k < K; ++k) qp[n * K + k] = static_cast<int8_t>(std::clamp(std::nearbyint(w[k] / s), -127.0f, 127.0f));
    }
  });
  return {q, scale};
}

// Reads every whole 64-byte line of buffer once, 32 bytes a load with the float kernels' prefetch, split
// over torch's threads, and returns the XOR of all their 32-bit words (so the reads cannot be optimised
// away, and the result is the same whatever the split): one of the readers benchmarks/bandwidth.py
// takes the best of. Not always the fastest: on the 2-core Zen 4 VM in its fast minutes it read 39-44
// GB/s where torch.sum read 65-72 (2026-12-06), so there the bound is torch.sum's.
int64_t stream_read(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.is_contiguous(), "buffer must be contiguous");
  const auto* p = static_cast<const uint8_t*>(buffer.data_ptr());
  const int64_t n = buffer.numel() * buffer.element_size() / 64;
  std::vector<uint32_t> partial(at::get_num_threads(), 0);
  at::parallel_for(0, n, 4096, [&](int64_t i0, int64_t i1) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* line = p + 64 * i;
      specd::prefetch_ahead(line, specd::kFloatPrefetch);
      a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
      b = _mm256_xor_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32)));
    }
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(a, b));
    for (uint32_t v : lanes) partial[at::get_thread_num()] ^= v;
  });
  uint32_t folded = 0;
  for (uint32_t v : partial) folded ^= v;
  return static_cast<int64_t>(folded);
}

bool advise_huge_pages(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "huge pages are for CPU memory");
  return specd::advise_huge_pages(t.data_ptr(), t.nbytes());
}

// Bytes [offset, offset + length) of a CPU tensor's data into huge pages where it is read from a private
// file mapping (huge_pages.h, move_to_huge_pages); returns the bytes moved. A piece at a time, so the
// caller can stop between pieces (weight_pages.py).
int64_t move_to_huge_pages(const at::Tensor& t, int64_t offset, int64_t length) {
  TORCH_CHECK(t.device().is_cpu(), "huge pages are for CPU memory");
  TORCH_CHECK(offset >= 0 && length >= 0 && offset + length <= static_cast<int64_t>(t.nbytes()),
              "the range must lie inside the tensor's data");
  return static_cast<int64_t>(specd::move_to_huge_pages(static_cast<char*>(t.data_ptr()) + offset, length));
}

// The choices this process made for its CPU (linear.h), so that tests can check the A/B switches: the
// float and the quantized kernels' prefetch (bytes ahead, 1 if into L2 else 0), the weight rows a
// one-input-row bf16 block takes at a time, 1 if bf16 layers take the dot products (use_bf16_dot),
// then the row length past which they are packed in chunks (dot_chunk_limit; 0 without them or never),
// and 1 if threads take each other's weight tiles (use_work_stealing).
std::vector<int64_t> kernel_tuning() {
  return {specd::kFloatPrefetch.bytes, specd::kFloatPrefetch.to_l2, specd::kQuantPrefetch.bytes,
          specd::kQuantPrefetch.to_l2, specd::kBf16OneRowWeightRows, specd::use_bf16_dot(),
          specd::use_bf16_dot() ? specd::dot_chunk_limit() : 0, specd::use_work_stealing()};
}

// For the tests of for_each_weight_tile: the tiles it hands out over N rows, [tiles, 3] (first row, end,
// the thread that ran it), in the order they finished. With hold_first_share, thread 0's first tile
// waits (up to 2 s) until another thread has taken a tile from the back of thread 0's share, so that
// stealing is seen whatever the machine's timing.
at::Tensor weight_tiles(int64_t N, int64_t tile, bool hold_first_share) {
  TORCH_CHECK(N >= 0 && tile >= 1, "N must be >= 0 and tile >= 1");
  std::mutex mu;
  std::vector<int64_t> seen;
  std::atomic<bool> stolen{false}, held{false};
  const int64_t threads = at::get_num_threads(), first_share = (N + threads - 1) / threads;
  specd::for_each_weight_tile(N, tile, [&](int64_t t0, int64_t t1) {
    const int64_t thread = at::get_thread_num();
    if (thread != 0 && t1 <= first_share) stolen = true;
    if (hold_first_share && thread == 0 && !held.exchange(true)) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (!stolen && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }
    std::lock_guard<std::mutex> lock(mu);
    seen.insert(seen.end(), {t0, t1, thread});
  });
  return at::tensor(seen, at::kLong).reshape({-1, 3});
}

}  // namespace

TORCH_LIBRARY(specd_kernels, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("bf16_dot_chunked_linear(Tensor x, Tensor weight, Tensor? bias, int chunk) -> Tensor");
  m.def("amx_bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("amx_usable() -> bool", &amx_usable);
  m.def("int8_vnni_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("quantize_int4(Tensor weight) -> Tensor");
  m.def("quantize_int8(Tensor weight) -> (Tensor, Tensor)");
  m.def("stream_read(Tensor buffer) -> int");
  m.def("advise_huge_pages(Tensor t) -> bool", &advise_huge_pages);
  m.def("bf16_dot_parts_linear(Tensor x, Tensor[] weights, Tensor[] biases) -> Tensor", &bf16_dot_parts_linear);
  m.def("move_to_huge_pages(Tensor t, int offset, int length) -> int", &move_to_huge_pages);
  m.def("kernel_tuning() -> int[]", &kernel_tuning);
  m.def("weight_tiles(int N, int tile, bool hold_first_share) -> Tensor", &weight_tiles);
}
TORCH_LIBRARY_IMPL(specd_kernels, CPU, m) {
  m.impl("bf16_linear", bf16_linear);
  m.impl("f32_linear", f32_linear);
  m.impl("bf16_dot_chunked_linear", bf16_dot_chunked_linear);
  m.impl("amx_bf16_linear", amx_bf16_linear);
  m.impl("int8_vnni_linear", int8_vnni_linear);
  m.impl("int8_linear", int8_linear);
  m.impl("int4_linear", int4_linear);
  m.impl("quantize_int4", quantize_int4);
  m.impl("quantize_int8", quantize_int8);
  m.impl("stream_read", stream_read);
}
