// Decode attention read in place from the paged KV cache (CPU).
//
// One query token per sequence attends to its sequence's keys, found through its block
// table, without first gathering them into a dense tensor: the torch path copies every
// decode's K and V (padded to the longest context) in every layer, which was a quarter of
// a decode step on SmolLM2 (benchmarks/engine_step_profile.py). Each sequence is one task;
// every key and value row it loads serves the G = H / KVH query heads of its KV head.
// Scores, softmax and the weighted sum accumulate in float32 whatever the cache dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// A row of head_dim values as float: the row itself for float caches, else converted into `buffer`.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < n; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

template <typename scalar_t>
void decode_attention_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                             torch::Tensor& out, double scale, int64_t sliding_window) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t qs = q.stride(0), qh = q.stride(1), os = out.stride(0), oh = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Sequences dealt round-robin to the threads: contexts differ, and contiguous halves of
  // the batch (parallel_for's static split) left one thread idle for part of each layer.
  // (at::parallel_for uses threads only in code built with OpenMP: the extension is, -fopenmp.)
  const int64_t lanes = std::min<int64_t>(at::get_num_threads(), batch);
  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    std::vector<float> query(num_heads * head_dim), acc(num_heads * head_dim), buffer(head_dim);
    std::vector<float> scores(num_heads * block_size), peak(num_heads), total(num_heads);
    for (int64_t lane = lane_begin; lane < lane_end; ++lane) {
      for (int64_t b = lane; b < batch; b += lanes) {
        const int64_t len = lens[b];
        const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
        const int64_t* table = tables + b * max_blocks;
        for (int64_t h = 0; h < num_heads; ++h) {
          const scalar_t* src = q_ptr + b * qs + h * qh;
          for (int64_t d = 0; d < head_dim; ++d) query[h * head_dim + d] = static_cast<float>(src[d]) * fscale;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(peak.begin(), peak.end(), neg_inf);
        std::fill(total.begin(), total.end(), 0.f);
        // One block at a time, its keys then its values (adjacent in the block-major cache), with
        // the running maximum and sum of an online softmax (flash-decoding): one pass over the KV.
        for (int64_t start = first; start < len;) {
          const int64_t block = table[start / block_size];
          const int64_t offset = start % block_size;
          const int64_t n = std::min(block_size - offset, len - start);
          const scalar_t* keys = k_ptr + block * kb + offset * kt;
          const scalar_t* values = v_ptr + block * vb + offset * vt;
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t h = 0; h < num_kv_heads; ++h) {
              const float* key = as_float(keys + i * kt + h * kh, head_dim, buffer.data());
              for (int64_t g = 0; g < group; ++g) {
                const int64_t head = h * group + g;
                const float* qg = query.data() + head * head_dim;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * key[d];
                scores[head * block_size + i] = dot;
              }
            }
          }
          for (int64_t head = 0; head < num_heads; ++head) {
            float* s = scores.data() + head * block_size;
            float block_peak = peak[head];
            for (int64_t i = 0; i < n; ++i) block_peak = std::max(block_peak, s[i]);
            const float rescale = std::exp(peak[head] - block_peak);  // 0 on the first block
            float sum = 0.f;
            for (int64_t i = 0; i < n; ++i) {
              s[i] = std::exp(s[i] - block_peak);
              sum += s[i];
            }
            total[head] = total[head] * rescale + sum;
            peak[head] = block_peak;
            if (rescale != 1.f) {
              float* a = acc.data() + head * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] *= rescale;
            }
          }
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t h = 0; h < num_kv_heads; ++h) {
              const float* value = as_float(values + i * vt + h * vh, head_dim, buffer.data());
              for (int64_t g = 0; g < group; ++g) {
                const int64_t head = h * group + g;
                const float p = scores[head * block_size + i];
                float* a = acc.data() + head * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * value[d];
              }
            }
          }
          start += n;
        }
        for (int64_t h = 0; h < num_heads; ++h) {
          const float inv = total[h] > 0.f ? 1.f / total[h] : 0.f;
          scalar_t* dst = out_ptr + b * os + h * oh;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
        }
      }
    }
  });
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] (any strides, D contiguous);
// block_tables [B, max_blocks] int64; context_lens [B] int64 (keys per sequence, this
// step's included, already written); sliding_window 0 for none. Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [B,H,D], caches [blocks,bs,KVH,D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), "one dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous in the caches");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head shapes disagree");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block_tables and context_lens are int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one table and length per query");
  {  // every key read must lie in the cache: the tables come over the wire in KV transfers
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t width = block_tables.size(1), bs = k_cache.size(1), blocks = k_cache.size(0);
    for (int64_t b = 0; b < q.size(0); ++b) {
      TORCH_CHECK(lens[b] >= 0 && lens[b] <= width * bs, "context length ", lens[b], " exceeds its block table");
      for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i) {
        const int64_t block = tables[b * width + i];
        TORCH_CHECK(block >= 0 && block < blocks && block < v_cache.size(0), "block id ", block, " outside the cache");
      }
    }
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(),
                                  "paged_decode_attention", [&] {
    decode_attention_kernel<scalar_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale, sliding_window);
  });
  return out;
}

// fused_elementwise.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, c10::optional<torch::Tensor> residual);
void rotary_inplace(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally of residual += x (CPU)", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def("rotary_inplace", &rotary_inplace, "rotate-half rotary embedding of q and k, in place (CPU)");
}
