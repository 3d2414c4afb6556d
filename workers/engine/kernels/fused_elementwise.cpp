// Fused per-token elementwise work of a Llama-family decoder layer (CPU).
//
// A decode step of a small model is many tiny ops per layer (RMSNorm alone is six torch
// ops, rotary twelve, the residual adds two), each a dispatch, an allocation and, with
// several threads, a barrier. These do each group in one pass over the rows, in float32
// whatever the tensor dtype, rows spread over threads (at::parallel_for, OpenMP) when there are enough.
// (SiLU·mul stays in torch, in place: a scalar exp here was slower than torch's vectorised
// one on 256 rows and more, benchmarks/engine_step_profile.py.)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int64_t kRowsPerTask = 16;  // below this many rows per thread, one thread does all

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, int64_t x_stride, scalar_t* residual, int64_t residual_stride,
                   const scalar_t* weight, scalar_t* out, int64_t out_stride, int64_t rows, int64_t dim,
                   double eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> sum_row(dim);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * x_stride;
      float* s = sum_row.data();
      float squares = 0.f;
      if (residual != nullptr) {  // residual += x, then normalise the sum (written back as the new residual)
        scalar_t* rr = residual + r * residual_stride;
        for (int64_t d = 0; d < dim; ++d) {
          const scalar_t summed = static_cast<scalar_t>(static_cast<float>(xr[d]) + static_cast<float>(rr[d]));
          rr[d] = summed;
          s[d] = static_cast<float>(summed);
        }
      } else {
        for (int64_t d = 0; d < dim; ++d) s[d] = static_cast<float>(xr[d]);
      }
      for (int64_t d = 0; d < dim; ++d) squares += s[d] * s[d];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
      scalar_t* o = out + r * out_stride;
      for (int64_t d = 0; d < dim; ++d) {
        // As the reference: normalise in float32, round to the dtype, then scale by the weight.
        o[d] = static_cast<scalar_t>(static_cast<float>(weight[d]) *
                                     static_cast<float>(static_cast<scalar_t>(s[d] * inv)));
      }
    }
  });
}

}  // namespace

// RMSNorm of x [rows, dim] (rows may be strided, dim contiguous) by weight [dim]; with a
// residual [rows, dim], residual += x first (in place) and the sum is normalised: the
// "add, then norm" of two consecutive decoder sub-layers in one pass. Returns a new tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x [rows, dim] with dim contiguous");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && (!residual.has_value() || residual->device().is_cpu()),
              "CPU tensors only");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight [dim]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "one dtype");
  weight = weight.contiguous();
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (residual.has_value()) {
    // Rows written in place must not overlap (a stride-0 or broadcast residual would race).
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                (residual->size(0) <= 1 || residual->stride(0) >= residual->size(1)) &&
                residual->scalar_type() == x.scalar_type(), "residual like x, rows not overlapping");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0),
                            residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                            residual.has_value() ? residual->stride(0) : 0, weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), out.stride(0), x.size(0), x.size(1), eps);
  });
  return out;
}

// Rotary embedding, the rotate-half (GPT-NeoX) form, in place on q [T, H, D] and k [T, KVH, D]
// (any token and head strides, D contiguous) with cos, sin [T, D] (both halves equal, as the
// tables hold them): x[i] = x[i] cos[i] - x[i + D/2] sin[i]; x[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2].
void rotary_inplace(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "q, k [T, heads, D], D contiguous");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0, "q and k disagree");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "CPU tensors only");
  if (q.size(0) == 0) return;  // an empty step: nothing to rotate
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "one dtype");
  cos = cos.reshape({cos.size(0), -1}).contiguous();
  sin = sin.reshape({sin.size(0), -1}).contiguous();
  TORCH_CHECK(cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && sin.sizes() == cos.sizes(), "cos, sin [T, D]");
  const int64_t tokens = q.size(0), dim = q.size(2), half = dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "rotary", [&] {
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    auto rotate = [&](torch::Tensor& x, int64_t t) {
      scalar_t* base = x.data_ptr<scalar_t>() + t * x.stride(0);
      const scalar_t* ct = c + t * dim;
      const scalar_t* st = s + t * dim;
      for (int64_t h = 0; h < x.size(1); ++h) {
        scalar_t* row = base + h * x.stride(1);
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(row[i]), x2 = static_cast<float>(row[i + half]);
          // As torch: each product rounded to the dtype, then the sum.
          const scalar_t a = static_cast<scalar_t>(x1 * static_cast<float>(ct[i]));
          const scalar_t b = static_cast<scalar_t>(-x2 * static_cast<float>(st[i]));
          const scalar_t a2 = static_cast<scalar_t>(x2 * static_cast<float>(ct[i + half]));
          const scalar_t b2 = static_cast<scalar_t>(x1 * static_cast<float>(st[i + half]));
          row[i] = static_cast<scalar_t>(static_cast<float>(a) + static_cast<float>(b));
          row[i + half] = static_cast<scalar_t>(static_cast<float>(a2) + static_cast<float>(b2));
        }
      }
    };
    at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate(q, t);
        rotate(k, t);
      }
    });
  });
}
