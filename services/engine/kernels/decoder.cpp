// The whole forward pass of a Llama-family decoder (Llama, Mistral, Qwen2) in one call, on CPUs with
// AVX2: embedding, every layer (RMSNorm, fused QKV, RoPE, the KV cache write, grouped-query attention,
// output projection, RMSNorm, fused gate/up, SiLU, down projection) and the output head.
//
// Why: decoding a small batch is bound by reading the weights, and what is left around the matmuls
// (~30 small torch ops per layer, each a dispatch, an allocation and often a dtype copy) cost 14% of a
// bf16 1.5B step and 30-40% of a quantized or draft-sized one. Here that glue is a few loops over
// a handful of rows.
//
// Batch invariance, end to end: every row's result depends only on its own token, its position and
// the cache contents before it, never on the other rows of the batch or the thread split. The linear
// kernels are batch invariant (linear.h), RMSNorm, RoPE and SiLU are per row, and attention is
// computed per (row, KV head) with a fixed accumulation order over the cached positions. So verifying
// k+1 tokens gives bit for bit the logits of decoding them one at a time, in bf16 too, and greedy
// speculation is token-identical to the same model decoding alone.
//
// Activations and the residual stream are fp32; the KV cache is bf16 (the model's dtype), written
// before attention reads it, so a row attends to the rows before it in the same pass through the cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "huge_pages.h"
#include "linear.h"

namespace {

using specd::Format;
using specd::LinearWeights;

// exp(x) for 8 lanes (Cephes' polynomial, as in most SIMD math libraries): relative error ~1e-7,
// deterministic, and x below -87 gives 0 (softmax's masked tail).
inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.0f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 fx = _mm256_round_ps(_mm256_fmadd_ps(x, log2e, _mm256_set1_ps(0.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, c1, x);
  x = _mm256_fnmadd_ps(fx, c2, x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(below, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float exp1(float x) {
  alignas(32) float v[8] = {x, x, x, x, x, x, x, x};
  _mm256_store_ps(v, exp256(_mm256_load_ps(v)));
  return v[0];
}

inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline void store_bf16x8(uint16_t* p, __m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) p[i] = specd::float_to_bf16(f[i]);
}

// Sum of squares of n floats, 8 lanes then a fixed reduction (the same order for every row).
inline float sum_squares(const float* x, int64_t n) {
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    a = _mm256_fmadd_ps(v, v, a);
  }
  float s = specd::hsum(a);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// A linear layer as one or more row blocks whose outputs sit side by side (a layer's q, k and v, or
// gate and up, kept as separate weights, each in its own format).
struct LinearSet {
  std::vector<LinearWeights> parts;
  int64_t N = 0, K = 0;
  // y[M, N] (row stride ldo) = x[M, K] W^T + b: parts that are all bf16 dot products in place in one
  // pass of the threads (bf16_dot_parts), any others part by part.
  void apply(const float* x, int64_t M, float* out, int64_t ldo) const {
    if (parts.size() > 1 && parts.size() <= kMaxDotParts && specd::use_bf16_dot() &&
        std::all_of(parts.begin(), parts.end(), [](const LinearWeights& p) { return p.format == Format::kBf16; })) {
      specd::DotPart dot[kMaxDotParts];
      int64_t offset = 0;
      for (size_t i = 0; i < parts.size(); offset += parts[i].N, ++i)
        dot[i] = {static_cast<const uint16_t*>(parts[i].w), parts[i].N, parts[i].bias, out + offset};
      specd::bf16_dot_parts(x, M, K, dot, static_cast<int>(parts.size()), ldo);
      return;
    }
    int64_t offset = 0;
    for (const LinearWeights& p : parts) {
      specd::linear_any(p, x, M, out + offset, ldo);
      offset += p.N;
    }
  }
  static constexpr size_t kMaxDotParts = 4;
};

struct Layer {
  at::Tensor attn_norm, mlp_norm;  // fp32 [d]
  LinearSet qkv, o, gate_up, down;
};

// Uninitialised memory advised for huge pages before anything is written to it, so that fresh pages
// fault in 2 MB at a time (and reused heap pages are folded into huge ones).
at::Tensor huge_page_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  specd::advise_huge_pages(t.data_ptr(), t.nbytes());
  return t;
}

// A bf16 layer that fits the tile unit's shapes is packed for it where the CPU has one (linear.h,
// "bf16 on AMX"), one with long rows in chunks where bf16 layers take dot products (linear.h,
// kDotChunkWeights), an int8 layer for VNNI where the CPU has AVX-512 VNNI (linear.h, "int8 packed
// for VNNI"): a copy, kept in ``packed``, as the per-op forward still reads the weights as they are.
// Whatever the decoder streams, the copy or the weights in place, sits in huge pages (huge_pages.h).
LinearWeights linear_of(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& bias,
                        std::vector<at::Tensor>& packed) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "linear weights must be contiguous 2-D tensors");
  LinearWeights lw{Format::kBf16, w.data_ptr(), nullptr, nullptr, w.size(0), w.size(1)};
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.numel() == w.size(0) && scale.scalar_type() == at::kFloat, "int8 weights need fp32 row scales");
    lw.format = Format::kInt8;
    lw.scale = scale.data_ptr<float>();
    if (specd::use_avx512_vnni() && specd::vnni_shape_ok(lw.N, lw.K)) {
      packed.push_back(huge_page_empty({specd::vnni_packed_bytes(lw.N, lw.K)}, w.options()));
      specd::int8_pack_vnni(w.data_ptr<int8_t>(), lw.N, lw.K, packed.back().data_ptr<int8_t>());
      lw.format = Format::kInt8Vnni;
      lw.w = packed.back().data_ptr();
    }
  } else if (w.scalar_type() == at::kByte) {
    lw.format = Format::kInt4;
    lw.K = specd::int4_k_of(w.size(1));
    TORCH_CHECK(lw.K > 0, "int4 records of ", w.size(1), " bytes do not hold a whole number of 32-weight groups");
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "linear weights must be bf16, int8 or int4");
    if (specd::use_amx() && specd::amx_shape_ok(lw.N, lw.K)) {
      packed.push_back(huge_page_empty(w.sizes(), w.options()));
      specd::amx_pack_bf16(static_cast<const uint16_t*>(w.data_ptr()), lw.N, lw.K,
                           static_cast<uint16_t*>(packed.back().data_ptr()));
      lw.format = Format::kBf16Amx;
      lw.w = packed.back().data_ptr();
    } else if (const int64_t chunk = specd::use_bf16_dot() ? specd::dot_chunk_of(lw.K) : 0; chunk > 0) {
      lw.chunk = chunk;
      packed.push_back(huge_page_empty(w.sizes(), w.options()));
      specd::dot_chunk_pack(static_cast<const uint16_t*>(w.data_ptr()), lw.N, lw.K, lw.chunk,
                            static_cast<uint16_t*>(packed.back().data_ptr()));
      lw.format = Format::kBf16DotChunked;
      lw.w = packed.back().data_ptr();
    }
  }
  if (lw.w == w.data_ptr()) specd::advise_huge_pages(w.data_ptr(), w.nbytes());
  if (bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == w.size(0), "bias must be fp32, one per row");
    lw.bias = bias.data_ptr<float>();
  }
  return lw;
}

class FusedDecoder : public torch::CustomClassHolder {
 public:
  // tensors: embed (bf16 [V, d]), final norm, inv_freq (fp32 [D / 2]), the head's parts, then per
  // layer: attn_norm, mlp_norm, and the parts of qkv, o, gate_up, down. A part is (weight, scale,
  // bias), an absent scale or bias an empty tensor; parts_per_linear counts them for the head and
  // then each layer's four linears. dims: hidden, layers, heads, kv_heads, head_dim.
  FusedDecoder(std::vector<at::Tensor> tensors, std::vector<int64_t> parts_per_linear, std::vector<int64_t> dims,
               double eps, double rope_scaling)
      : keep_(std::move(tensors)), eps_(static_cast<float>(eps)), rope_scaling_(static_cast<float>(rope_scaling)) {
    TORCH_CHECK(dims.size() == 5, "dims: hidden, layers, heads, kv_heads, head_dim");
    d_ = dims[0], L_ = dims[1], H_ = dims[2], Hkv_ = dims[3], D_ = dims[4];
    TORCH_CHECK(static_cast<int64_t>(parts_per_linear.size()) == 1 + 4 * L_, "parts_per_linear: head + 4 per layer");
    TORCH_CHECK(D_ % 16 == 0 && H_ % Hkv_ == 0 && d_ % 8 == 0, "unsupported head geometry");
    size_t at = 0, lin = 0;
    auto next = [&]() -> const at::Tensor& {
      TORCH_CHECK(at < keep_.size(), "too few tensors for the layout");
      return keep_[at++];
    };
    auto linear_set = [&](int64_t K_expected) {
      LinearSet set;
      for (int64_t i = 0; i < parts_per_linear[lin]; ++i) {
        const at::Tensor& w = next();
        const at::Tensor& sc = next();
        const at::Tensor& b = next();
        set.parts.push_back(linear_of(w, sc, b, packed_));
        if (set.parts.back().w == w.data_ptr()) in_place_.push_back(w);
        set.N += set.parts.back().N;
        TORCH_CHECK(K_expected < 0 || set.parts.back().K == K_expected, "a linear part has ", set.parts.back().K,
                    " input features, expected ", K_expected);
        set.K = set.parts.back().K;
      }
      ++lin;
      return set;
    };
    embed_ = next();
    TORCH_CHECK(embed_.scalar_type() == at::kBFloat16 && embed_.is_contiguous() && embed_.size(1) == d_);
    final_norm_ = next().to(at::kFloat).contiguous();
    inv_freq_ = next().to(at::kFloat).contiguous();
    TORCH_CHECK(inv_freq_.numel() == D_ / 2, "inv_freq must have head_dim / 2 entries");
    head_ = linear_set(d_);
    for (int64_t l = 0; l < L_; ++l) {
      Layer layer;
      layer.attn_norm = next().to(at::kFloat).contiguous();
      layer.mlp_norm = next().to(at::kFloat).contiguous();
      layer.qkv = linear_set(d_);
      TORCH_CHECK(layer.qkv.N == (H_ + 2 * Hkv_) * D_, "qkv has ", layer.qkv.N, " outputs");
      layer.o = linear_set(H_ * D_);
      layer.gate_up = linear_set(d_);
      F_ = layer.gate_up.N / 2;
      layer.down = linear_set(F_);
      TORCH_CHECK(layer.o.N == d_ && layer.down.N == d_, "o and down must map back to the hidden size");
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(at == keep_.size(), "more tensors than the layout describes");
  }

  // ids [B, T] int64; starts [B] int64 (first position of each row); table [B, W] int64 (each row's
  // cache blocks); block_size positions per block; k_cache, v_cache bf16 [layers, rows, Hkv, D] where
  // position p of batch row b lives at cache row table[b, p / block_size] * block_size + p % block_size.
  // logits: 0 none (prefill), 1 last position of each row [B, 1, V], 2 all [B, T, V] (fp32).
  // lengths: empty (every row holds T tokens) or int64 [B] in 1..T: row b holds its first lengths[b]
  // tokens and the rest is padding, neither computed nor stored in the cache; its logits are zeros
  // ("last" takes each row's last real token). A round whose rows verify different numbers of
  // guesses then costs the tokens it verifies, not B times the widest row's.
  c10::optional<at::Tensor> forward(const at::Tensor& ids, const at::Tensor& starts, const at::Tensor& table,
                                    int64_t block_size, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    int64_t logits, const at::Tensor& lengths) {
    TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, "ids must be int64 [B, T]");
    const int64_t B = ids.size(0), T = ids.size(1), W = table.size(1);
    TORCH_CHECK(starts.numel() == B && table.size(0) == B && table.scalar_type() == at::kLong);
    TORCH_CHECK(lengths.numel() == 0 || (lengths.numel() == B && lengths.scalar_type() == at::kLong),
                "lengths must be empty or int64 [B]");
    // Packed rows: row b's tokens are rows off[b] .. off[b + 1] - 1 of every activation buffer.
    std::vector<int64_t> off(B + 1, 0);
    {
      const at::Tensor len_c = lengths.contiguous();
      const int64_t* lp = lengths.numel() ? len_c.data_ptr<int64_t>() : nullptr;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = lp ? lp[b] : T;
        TORCH_CHECK(n >= 1 && n <= T, "row ", b, " holds ", n, " tokens, not 1..", T);
        off[b + 1] = off[b] + n;
      }
    }
    const int64_t R = off[B];
    const bool padded = R < B * T;
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                    k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == L_ &&
                    k_cache.size(2) == Hkv_ && k_cache.size(3) == D_,
                "caches must be contiguous bf16 [layers, rows, kv_heads, head_dim]");
    const at::Tensor ids_c = ids.contiguous(), starts_c = starts.contiguous(), table_c = table.contiguous();
    const int64_t* idp = ids_c.data_ptr<int64_t>();
    const int64_t* sp = starts_c.data_ptr<int64_t>();
    const int64_t* tp = table_c.data_ptr<int64_t>();
    const int64_t cache_rows = k_cache.size(1);

    // Each row's position and cache row; RoPE's cos and sin at that position.
    std::vector<int64_t> pos(R), crow(R);
    const int64_t half = D_ / 2;
    std::vector<float> cs(R * half), sn(R * half);
    const float* inv = inv_freq_.data_ptr<float>();
    std::vector<int64_t> token(R);  // each packed row's index into ids [B * T]
    for (int64_t b = 0; b < B; ++b)
      for (int64_t r = off[b]; r < off[b + 1]; ++r) {
        const int64_t t = r - off[b], p = sp[b] + t;
        token[r] = b * T + t;
        pos[r] = p;
        crow[r] = cache_row(tp + b * W, W, block_size, p);
        TORCH_CHECK(crow[r] >= 0 && crow[r] < cache_rows, "position ", p, " maps outside the cache");
        for (int64_t i = 0; i < half; ++i) {
          const float f = static_cast<float>(p) * inv[i];
          cs[r * half + i] = std::cos(f) * rope_scaling_;
          sn[r * half + i] = std::sin(f) * rope_scaling_;
        }
      }

    const int64_t QKV = (H_ + 2 * Hkv_) * D_;
    std::vector<float> x(R * d_), h(R * d_), qkv(R * QKV), attn(R * H_ * D_), tmp(R * std::max(d_, 2 * F_)),
        act(R * F_);
    const uint16_t* emb = reinterpret_cast<const uint16_t*>(embed_.data_ptr<at::BFloat16>());
    const int64_t V = embed_.size(0);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t id = idp[token[r]];
      TORCH_CHECK(id >= 0 && id < V, "token id ", id, " outside the vocabulary");
      for (int64_t i = 0; i < d_; ++i) x[r * d_ + i] = specd::bf16_to_float(emb[id * d_ + i]);
    }

    auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>());
    auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>());
    const int64_t layer_stride = cache_rows * Hkv_ * D_;
    for (int64_t l = 0; l < L_; ++l) {
      const Layer& ly = layers_[l];
      rms_norm(x.data(), ly.attn_norm.data_ptr<float>(), h.data(), R);
      ly.qkv.apply(h.data(), R, qkv.data(), QKV);
      rope_and_store(qkv.data(), cs.data(), sn.data(), crow.data(), R, kc + l * layer_stride, vc + l * layer_stride);
      attention(qkv.data(), pos.data(), tp, W, block_size, T, off, kc + l * layer_stride, vc + l * layer_stride,
                attn.data());
      ly.o.apply(attn.data(), R, tmp.data(), d_);
      add_into(x.data(), tmp.data(), R * d_);
      rms_norm(x.data(), ly.mlp_norm.data_ptr<float>(), h.data(), R);
      ly.gate_up.apply(h.data(), R, tmp.data(), 2 * F_);
      silu_mul(tmp.data(), act.data(), R);
      ly.down.apply(act.data(), R, tmp.data(), d_);
      add_into(x.data(), tmp.data(), R * d_);
    }
    if (logits == 0) return c10::nullopt;
    const int64_t N = head_.N;
    if (logits == 1) {
      std::vector<float> rows(B * d_);
      for (int64_t b = 0; b < B; ++b) std::memcpy(rows.data() + b * d_, x.data() + (off[b + 1] - 1) * d_, 4 * d_);
      rms_norm(rows.data(), final_norm_.data_ptr<float>(), h.data(), B);
      at::Tensor out = at::empty({B, 1, N}, at::kFloat);
      head_.apply(h.data(), B, out.data_ptr<float>(), N);
      return out;
    }
    rms_norm(x.data(), final_norm_.data_ptr<float>(), h.data(), R);
    at::Tensor out = at::empty({B, T, N}, at::kFloat);
    if (!padded) {
      head_.apply(h.data(), R, out.data_ptr<float>(), N);
      return out;
    }
    // The head over the packed rows at once (its weights read once), then each row's logits moved to
    // its place in [B, T, V] and the padding zeroed: the verifier reads every position, and never
    // past a row's guesses, but uninitialised memory could hold NaN.
    at::Tensor packed = at::empty({R, N}, at::kFloat);
    head_.apply(h.data(), R, packed.data_ptr<float>(), N);
    const float* src = packed.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = off[b + 1] - off[b];
        std::memcpy(dst + b * T * N, src + off[b] * N, 4 * n * N);
        std::memset(dst + (b * T + n) * N, 0, 4 * (T - n) * N);
      }
    });
    return out;
  }

 private:
  static int64_t cache_row(const int64_t* table_row, int64_t W, int64_t bs, int64_t p) {
    // Past the table (a padded row's spare positions) is the last column: the scratch block.
    return table_row[std::min(p / bs, W - 1)] * bs + p % bs;
  }

  void rms_norm(const float* x, const float* w, float* out, int64_t R) const {
    at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = x + r * d_;
        const float inv = 1.0f / std::sqrt(sum_squares(xr, d_) / static_cast<float>(d_) + eps_);
        for (int64_t i = 0; i < d_; ++i) out[r * d_ + i] = xr[i] * inv * w[i];
      }
    });
  }

  // RoPE on every query and key head (rotate-half form), then K and V into the cache as bf16.
  void rope_and_store(float* qkv, const float* cs, const float* sn, const int64_t* crow, int64_t R, uint16_t* kc,
                      uint16_t* vc) const {
    const int64_t QKV = (H_ + 2 * Hkv_) * D_, half = D_ / 2;
    for (int64_t r = 0; r < R; ++r) {
      float* row = qkv + r * QKV;
      const float* c = cs + r * half;
      const float* s = sn + r * half;
      for (int64_t hd = 0; hd < H_ + Hkv_; ++hd) {
        float* v = row + hd * D_;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i] + a * s[i];
        }
      }
      uint16_t* kd = kc + crow[r] * Hkv_ * D_;
      uint16_t* vd = vc + crow[r] * Hkv_ * D_;
      const float* k = row + H_ * D_;
      const float* vv = row + (H_ + Hkv_) * D_;
      for (int64_t i = 0; i < Hkv_ * D_; i += 8) {
        store_bf16x8(kd + i, _mm256_loadu_ps(k + i));
        store_bf16x8(vd + i, _mm256_loadu_ps(vv + i));
      }
    }
  }

  // out[r, h * D:(h + 1) * D] = softmax(q_h . K[0..p] / sqrt(D)) V[0..p], for every row r at position p.
  // Work items are (sequence, KV head, up to 32 consecutive rows), each with its G query heads. One
  // row reads K and V straight from the bf16 cache; several rows (verification, prefill) first widen
  // the positions they share to fp32 once. Widening is exact, and each row's dot products, softmax and
  // weighted sum run in the same order either way, so the result is the same bit for bit.
  // Batch row b's tokens are packed rows off[b] .. off[b + 1] - 1 (at most T of them).
  void attention(const float* qkv, const int64_t* pos, const int64_t* table, int64_t W, int64_t bs, int64_t T,
                 const std::vector<int64_t>& off, const uint16_t* kc, const uint16_t* vc, float* out) const {
    const int64_t G = H_ / Hkv_, chunks = (T + 31) / 32;
    const int64_t B = static_cast<int64_t>(off.size()) - 1;
    at::parallel_for(0, B * Hkv_ * chunks, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scores, kbuf, vbuf;
      std::vector<int64_t> rows;
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t b = item / (Hkv_ * chunks), g = item / chunks % Hkv_, c = item % chunks;
        const int64_t r0 = off[b] + 32 * c, r1 = std::min(off[b + 1], r0 + 32);
        if (r0 >= r1) continue;  // a chunk past a short row's tokens
        const int64_t n_max = pos[r1 - 1] + 1;
        rows.resize(n_max);
        for (int64_t j = 0; j < n_max; ++j) rows[j] = cache_row(table + b * W, W, bs, j);
        if (r1 - r0 == 1) {
          // The values are read only once every score is known, in passes over the positions whose
          // rows lie 512 bytes apart (real pair): fetched into L2 now, while the scores are computed,
          // instead of missed position by position later. At 1,500 positions a decoding step's
          // attention took ~250 us a layer (6 GB/s of cache read), 7% of the 1.5B target's step;
          // with this the step was 1.024x and 1.027x faster (in-process A/B runs of 20 and 10
          // rounds, docs/benchmarks.md), level at a short prompt (1.010x). No arithmetic changes.
          // At most kValuePrefetchBytes of them: past about half of L2 (1-2 MB a core on the CPUs
          // measured) the first rows would be evicted by the last, and the keys with them.
          const int64_t ahead = std::min(n_max, kValuePrefetchBytes / (2 * D_));
          for (int64_t j = 0; j < ahead; ++j) prefetch_row(vc + (rows[j] * Hkv_ + g) * D_, D_, true);
          auto k_at = [&](int64_t j) { return KeyBf16{kc + (rows[j] * Hkv_ + g) * D_}; };
          auto v_at = [&](int64_t j) { return KeyBf16{vc + (rows[j] * Hkv_ + g) * D_}; };
          attend(qkv, r0, g, pos[r0] + 1, k_at, v_at, scores, out);
          continue;
        }
        const int64_t D = D_;
        kbuf.resize(n_max * D), vbuf.resize(n_max * D);
        float* kb = kbuf.data();
        float* vb = vbuf.data();
        for (int64_t j = 0; j < n_max; ++j) {
          if (j + kPrefetch < n_max) {
            prefetch_row(kc + (rows[j + kPrefetch] * Hkv_ + g) * D, D);
            prefetch_row(vc + (rows[j + kPrefetch] * Hkv_ + g) * D, D);
          }
          const uint16_t* kp = kc + (rows[j] * Hkv_ + g) * D;
          const uint16_t* vp = vc + (rows[j] * Hkv_ + g) * D;
          for (int64_t i = 0; i < D; i += 8) {
            _mm256_storeu_ps(kb + j * D + i, load_bf16x8(kp + i));
            _mm256_storeu_ps(vb + j * D + i, load_bf16x8(vp + i));
          }
        }
        auto k_at = [&](int64_t j) { return KeyF32{kb + j * D}; };
        auto v_at = [&](int64_t j) { return KeyF32{vb + j * D}; };
        for (int64_t r = r0; r < r1; ++r) attend(qkv, r, g, pos[r] + 1, k_at, v_at, scores, out);
      }
    });
  }

  // A cache row of one KV head is D bf16 values, and consecutive positions are Hkv * D apart (further
  // across a block boundary): too far apart for the hardware's prefetcher to follow within a page.
  // Positions are fetched this far ahead.
  static constexpr int64_t kPrefetch = 8;
  // The most of one KV head's values a one-row step prefetches into L2 before scoring (attention):
  // 2,048 positions of a 128-wide head, more than the 1,500 it was measured at.
  static constexpr int64_t kValuePrefetchBytes = 512 * 1024;

  // A cache row's D bf16 values into L1, or into L2 (to_l2: rows wanted later than the next few).
  static void prefetch_row(const uint16_t* p, int64_t D, bool to_l2 = false) {
    for (int64_t i = 0; i < D; i += 32) {
      const char* line = reinterpret_cast<const char*>(p + i);
      if (to_l2)
        _mm_prefetch(line, _MM_HINT_T1);
      else
        _mm_prefetch(line, _MM_HINT_T0);
    }
  }

  struct KeyBf16 {  // 8 lanes of a bf16 cache row, widened
    const uint16_t* p;
    __m256 at(int64_t i) const { return load_bf16x8(p + i); }
    void prefetch(int64_t D) const { prefetch_row(p, D); }
  };
  struct KeyF32 {  // 8 lanes of a row already widened (in cache: the pass just wrote it)
    const float* p;
    __m256 at(int64_t i) const { return _mm256_loadu_ps(p + i); }
    void prefetch(int64_t) const {}
  };

  // Row r's G query heads of KV head g against positions [0, n).
  //
  // Each lane's arithmetic is fixed, whatever the loops around it: a score is two FMA chains over the
  // head's lanes (i and i + 8 of every 16) and one hsum; an output lane is one FMA chain over the
  // positions in order. The loops only interleave independent chains (four positions' scores; up to
  // eight accumulators of outputs kept in registers), so the core overlaps them instead of waiting on
  // each FMA's latency and on stores to a memory accumulator: attention was half of a 5-row pass of
  // the demo target at 600 positions.
  template <typename KAt, typename VAt>
  void attend(const float* qkv, int64_t r, int64_t g, int64_t n, const KAt& k_at, const VAt& v_at,
              std::vector<float>& scores, float* out) const {
    const int64_t QKV = (H_ + 2 * Hkv_) * D_, G = H_ / Hkv_, D = D_;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    scores.resize(G * n);
    const float* q = qkv + r * QKV + g * G * D;
    for (int64_t hq = 0; hq < G; ++hq) score_head(q + hq * D, n, scale, k_at, scores.data() + hq * n);
    float total[64];
    TORCH_CHECK(G <= 64, "more than 64 query heads per KV head");
    for (int64_t hq = 0; hq < G; ++hq) {
      float* s = scores.data() + hq * n;
      const float m = max_of(s, n);
      const __m256 mv = _mm256_set1_ps(m);
      __m256 sum8 = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        sum8 = _mm256_add_ps(sum8, e);
      }
      float sum = specd::hsum(sum8);
      for (; j < n; ++j) {
        s[j] = exp1(s[j] - m);
        sum += s[j];
      }
      total[hq] = 1.0f / sum;
    }
    float* o = out + r * H_ * D + g * G * D;
    const int64_t vectors = D / 8;
    for (int64_t h0 = 0; h0 < G; h0 += 8) {
      const int64_t heads = std::min<int64_t>(8, G - h0);
      const float* s = scores.data() + h0 * n;
      float* oh = o + h0 * D;
      switch (heads) {  // lanes per pass: as many vectors as fit eight accumulators and divide the head
        case 1:
          if (vectors % 8 == 0) weigh<1, 8>(s, n, v_at, vectors, total + h0, oh);
          else if (vectors % 4 == 0) weigh<1, 4>(s, n, v_at, vectors, total + h0, oh);
          else if (vectors % 2 == 0) weigh<1, 2>(s, n, v_at, vectors, total + h0, oh);
          else weigh<1, 1>(s, n, v_at, vectors, total + h0, oh);
          break;
        case 2:
          if (vectors % 4 == 0) weigh<2, 4>(s, n, v_at, vectors, total + h0, oh);
          else if (vectors % 2 == 0) weigh<2, 2>(s, n, v_at, vectors, total + h0, oh);
          else weigh<2, 1>(s, n, v_at, vectors, total + h0, oh);
          break;
        case 3: weigh<3, 1>(s, n, v_at, vectors, total + h0, oh); break;
        case 4:
          if (vectors % 2 == 0) weigh<4, 2>(s, n, v_at, vectors, total + h0, oh);
          else weigh<4, 1>(s, n, v_at, vectors, total + h0, oh);
          break;
        case 5: weigh<5, 1>(s, n, v_at, vectors, total + h0, oh); break;
        case 6: weigh<6, 1>(s, n, v_at, vectors, total + h0, oh); break;
        case 7: weigh<7, 1>(s, n, v_at, vectors, total + h0, oh); break;
        default: weigh<8, 1>(s, n, v_at, vectors, total + h0, oh); break;
      }
    }
  }

  // The largest of s[0..n), n >= 1, eight lanes at a time (max is exact: any order gives the same value).
  static float max_of(const float* s, int64_t n) {
    float m = s[0];
    int64_t j = 0;
    if (n >= 8) {
      __m256 m8 = _mm256_loadu_ps(s);
      for (j = 8; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
      m = specd::hmax(m8, m);
    }
    for (; j < n; ++j) m = std::max(m, s[j]);
    return m;
  }

  // s[j] = (q . K[j]) * scale for j < n, four positions at a time.
  template <typename KAt>
  void score_head(const float* qh, int64_t n, float scale, const KAt& k_at, float* s) const {
    const int64_t D = D_;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      for (int64_t f = j + kPrefetch; f < std::min(n, j + kPrefetch + 4); ++f) k_at(f).prefetch(D);
      const auto k0 = k_at(j), k1 = k_at(j + 1), k2 = k_at(j + 2), k3 = k_at(j + 3);
      __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
      for (int64_t i = 0; i < D; i += 16) {
        const __m256 x = _mm256_loadu_ps(qh + i), y = _mm256_loadu_ps(qh + i + 8);
        a0 = _mm256_fmadd_ps(x, k0.at(i), a0), b0 = _mm256_fmadd_ps(y, k0.at(i + 8), b0);
        a1 = _mm256_fmadd_ps(x, k1.at(i), a1), b1 = _mm256_fmadd_ps(y, k1.at(i + 8), b1);
        a2 = _mm256_fmadd_ps(x, k2.at(i), a2), b2 = _mm256_fmadd_ps(y, k2.at(i + 8), b2);
        a3 = _mm256_fmadd_ps(x, k3.at(i), a3), b3 = _mm256_fmadd_ps(y, k3.at(i + 8), b3);
      }
      s[j] = specd::hsum(_mm256_add_ps(a0, b0)) * scale;
      s[j + 1] = specd::hsum(_mm256_add_ps(a1, b1)) * scale;
      s[j + 2] = specd::hsum(_mm256_add_ps(a2, b2)) * scale;
      s[j + 3] = specd::hsum(_mm256_add_ps(a3, b3)) * scale;
    }
    for (; j < n; ++j) {
      const auto k = k_at(j);
      __m256 a = _mm256_setzero_ps(), b = a;
      for (int64_t i = 0; i < D; i += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), k.at(i), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i + 8), k.at(i + 8), b);
      }
      s[j] = specd::hsum(_mm256_add_ps(a, b)) * scale;
    }
  }

  // o[h * D + lane] = inv[h] * sum_j p[h * n + j] V[j][lane] for HEADS heads, NB 8-lane vectors of a
  // head per pass over the positions (HEADS * NB accumulators in registers).
  template <int HEADS, int NB, typename VAt>
  void weigh(const float* p, int64_t n, const VAt& v_at, int64_t vectors, const float* inv, float* o) const {
    const int64_t D = D_;
    for (int64_t v0 = 0; v0 < vectors; v0 += NB) {
      __m256 acc[HEADS][NB];
      for (int h = 0; h < HEADS; ++h)
        for (int t = 0; t < NB; ++t) acc[h][t] = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        if (v0 == 0 && j + kPrefetch < n) v_at(j + kPrefetch).prefetch(D);
        const auto v = v_at(j);
        __m256 vv[NB];
        for (int t = 0; t < NB; ++t) vv[t] = v.at((v0 + t) * 8);
        for (int h = 0; h < HEADS; ++h) {
          const __m256 w = _mm256_set1_ps(p[h * n + j]);
          for (int t = 0; t < NB; ++t) acc[h][t] = _mm256_fmadd_ps(w, vv[t], acc[h][t]);
        }
      }
      for (int h = 0; h < HEADS; ++h) {
        const __m256 iv = _mm256_set1_ps(inv[h]);
        for (int t = 0; t < NB; ++t) _mm256_storeu_ps(o + h * D + (v0 + t) * 8, _mm256_mul_ps(acc[h][t], iv));
      }
    }
  }

  static void add_into(float* x, const float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  }

  // act[r, i] = silu(gu[r, i]) * gu[r, F + i]
  void silu_mul(const float* gu, float* act, int64_t R) const {
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (int64_t r = r0; r < r1; ++r) {
        const float* g = gu + r * 2 * F_;
        const float* u = g + F_;
        float* a = act + r * F_;
        int64_t i = 0;
        for (; i + 8 <= F_; i += 8) {
          const __m256 gv = _mm256_loadu_ps(g + i);
          const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
          _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < F_; ++i) a[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
      }
    });
  }

 public:
  // Each linear part's format (linear.h, Format), the head's first, then each layer's qkv, o, gate_up
  // and down: what the decoder streams, for tests and diagnostics.
  std::vector<int64_t> formats() const {
    std::vector<int64_t> out;
    auto add = [&](const LinearSet& set) {
      for (const LinearWeights& p : set.parts) out.push_back(static_cast<int64_t>(p.format));
    };
    add(head_);
    for (const Layer& layer : layers_)
      for (const LinearSet* set : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) add(*set);
    return out;
  }

  // The weights streamed where they are (not a packed copy): the ones a checkpoint's memory map may
  // hold in 4 KB pages (weight_pages.py moves them into huge pages).
  std::vector<at::Tensor> in_place_weights() const { return in_place_; }

 private:
  std::vector<at::Tensor> keep_;
  std::vector<at::Tensor> in_place_;
  std::vector<at::Tensor> packed_;  // weights packed for AMX, VNNI or chunked dot products (linear_of)
  at::Tensor embed_, final_norm_, inv_freq_;
  LinearSet head_;
  std::vector<Layer> layers_;
  int64_t d_, L_, H_, Hkv_, D_, F_ = 0;
  float eps_, rope_scaling_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd_kernels, m) {
  m.class_<FusedDecoder>("FusedDecoder")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, double, double>())
      .def("forward", &FusedDecoder::forward)
      .def("formats", &FusedDecoder::formats)
      .def("in_place_weights", &FusedDecoder::in_place_weights);
}
