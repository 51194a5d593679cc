// PyTorch binding of the paged-prefill launcher: checks shapes, fills the arguments, queues the
// kernel on the current CUDA stream. varlen.py checks the inputs (and, unless told not to, the
// table values) with friendlier messages first.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cuda_runtime.h>

#include "paged_prefill.h"

const char* paged_prefill_launch(const PagedPrefillArgs& args, cudaStream_t stream);

namespace {

PrefillDtype prefill_dtype(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat16) return PrefillDtype::kFloat16;
  if (t.scalar_type() == torch::kBFloat16) return PrefillDtype::kBFloat16;
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, "paged_prefill: dtype must be float32, float16 or bfloat16");
  return PrefillDtype::kFloat32;
}

void check_tensor(const torch::Tensor& t, const char* name, const torch::Tensor& q, int64_t dim) {
  TORCH_CHECK(t.device() == q.device(), "paged_prefill: ", name, " must be on ", q.device());
  TORCH_CHECK(t.dim() == dim, "paged_prefill: ", name, " must have ", dim, " dimensions, got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "paged_prefill: ", name, " must be contiguous");
}

}  // namespace

// Returns (out [num_tokens, num_heads, head_dim] in q's dtype, lse float32 [num_tokens, num_heads]).
std::vector<torch::Tensor> forward(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                   const torch::Tensor& cu_seqlens_q, const torch::Tensor& context_lens,
                                   const torch::Tensor& block_tables, int64_t max_query_len, double scale,
                                   int64_t window, int64_t key_begin, bool causal) {
  TORCH_CHECK(q.is_cuda(), "paged_prefill: q must be a CUDA tensor");
  check_tensor(q, "q", q, 3);
  check_tensor(k_cache, "k_cache", q, 4);
  check_tensor(v_cache, "v_cache", q, 4);
  check_tensor(cu_seqlens_q, "cu_seqlens_q", q, 1);
  check_tensor(context_lens, "context_lens", q, 1);
  check_tensor(block_tables, "block_tables", q, 2);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "paged_prefill: k_cache and v_cache must have one shape and q's dtype");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32 &&
                  block_tables.scalar_type() == torch::kInt32,
              "paged_prefill: cu_seqlens_q, context_lens and block_tables must be int32");
  TORCH_CHECK(cu_seqlens_q.size(0) == context_lens.size(0) + 1 && block_tables.size(0) == context_lens.size(0),
              "paged_prefill: one context length and one table row per request, one more cu_seqlens_q entry");

  const c10::cuda::CUDAGuard guard(q.device());
  torch::Tensor out = torch::empty_like(q);
  torch::Tensor lse = torch::empty({q.size(0), q.size(1)}, q.options().dtype(torch::kFloat32));
  const PagedPrefillArgs args{
      out.data_ptr(), lse.data_ptr<float>(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
      cu_seqlens_q.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
      static_cast<int>(context_lens.size(0)), static_cast<int>(q.size(0)), static_cast<int>(q.size(1)),
      static_cast<int>(k_cache.size(2)), static_cast<int>(q.size(2)), static_cast<int>(k_cache.size(1)),
      static_cast<int>(block_tables.size(1)), static_cast<int>(k_cache.size(0)), static_cast<int>(max_query_len),
      static_cast<float>(scale), static_cast<int>(window), static_cast<int>(key_begin), causal ? 1 : 0,
      prefill_dtype(q)};
  const char* error = paged_prefill_launch(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(error == nullptr, error);
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "Paged attention for a ragged batch of queries (see paged_prefill.h)");
}
