// PyTorch binding of the paged-attention launcher: checks the tensors, fills the launcher's
// arguments, and queues the kernel on the current CUDA stream. paged_attention.py checks the
// inputs with friendlier messages first; these checks guard anyone who calls forward() directly.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "paged_attention.h"

namespace {

KvDtype kv_dtype(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat16) return KvDtype::kFloat16;
  if (t.scalar_type() == torch::kBFloat16) return KvDtype::kBFloat16;
  TORCH_CHECK(t.scalar_type() == torch::kFloat32,
              "paged_attention: dtype must be float32, float16 or bfloat16, got ", t.scalar_type());
  return KvDtype::kFloat32;
}

// An fp8 or int8 cache holds L12's one-byte codes; any other dtype must be q's (checked in forward).
KvCacheFormat cache_format(const torch::Tensor& cache) {
  if (cache.scalar_type() == c10::kFloat8_e4m3fn) return KvCacheFormat::kFp8E4m3;
  if (cache.scalar_type() == torch::kInt8) return KvCacheFormat::kInt8;
  return KvCacheFormat::kSameAsQuery;
}

void check_tensor(const torch::Tensor& t, const char* name, const torch::Tensor& q, int64_t dim) {
  TORCH_CHECK(t.device() == q.device(), "paged_attention: ", name, " must be on ", q.device(),
              ", got ", t.device());
  TORCH_CHECK(t.dim() == dim, "paged_attention: ", name, " must have ", dim, " dimensions, got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), "paged_attention: ", name, " must be contiguous");
}

}  // namespace

// q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads,
// head_dim]; block_tables int32 [num_seqs, max_blocks_per_seq]; context_lens int32 [num_seqs].
// partition_size: 0 for the single-pass kernel, else split-K with partitions of that many positions.
// k_cache, v_cache in q's dtype, or both fp8 e4m3 / int8 codes (L12) with k_scales, v_scales
// float32 [num_kv_heads]. window_starts: int32 [num_seqs], sequence s attending to positions
// [window_starts[s], context_lens[s]) only (L13). Returns out [num_seqs, num_heads, head_dim] in q's dtype.
torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                      const torch::Tensor& context_lens, double scale, int64_t partition_size,
                      const c10::optional<torch::Tensor>& k_scales, const c10::optional<torch::Tensor>& v_scales,
                      const c10::optional<torch::Tensor>& window_starts) {
  TORCH_CHECK(q.is_cuda(), "paged_attention: q must be a CUDA tensor, got ", q.device());
  check_tensor(q, "q", q, 3);
  check_tensor(k_cache, "k_cache", q, 4);
  check_tensor(v_cache, "v_cache", q, 4);
  check_tensor(block_tables, "block_tables", q, 2);
  check_tensor(context_lens, "context_lens", q, 1);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention: k_cache ", k_cache.sizes(),
              " and v_cache ", v_cache.sizes(), " differ in shape");
  const KvCacheFormat format = cache_format(k_cache);
  if (format == KvCacheFormat::kSameAsQuery) {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                "paged_attention: q, k_cache and v_cache must share one dtype (or the caches hold fp8/int8 codes)");
    TORCH_CHECK(!k_scales.has_value() && !v_scales.has_value(),
                "paged_attention: k_scales and v_scales are for fp8 or int8 caches only");
  } else {
    TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "paged_attention: v_cache must have k_cache's dtype ",
                k_cache.scalar_type(), ", got ", v_cache.scalar_type());
    for (const auto* scales : {&k_scales, &v_scales}) {
      TORCH_CHECK(scales->has_value(), "paged_attention: an fp8 or int8 cache needs k_scales and v_scales");
      check_tensor(**scales, "k_scales and v_scales", q, 1);
      TORCH_CHECK((*scales)->scalar_type() == torch::kFloat32 && (*scales)->size(0) == k_cache.size(2),
                  "paged_attention: k_scales and v_scales must be float32 [num_kv_heads=", k_cache.size(2), "]");
    }
  }
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 &&
                  context_lens.scalar_type() == torch::kInt32,
              "paged_attention: block_tables and context_lens must be int32");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "paged_attention: head_dim of q and k_cache differ");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_attention: block_tables and context_lens need one row per sequence of q");

  if (window_starts.has_value()) {
    check_tensor(*window_starts, "window_starts", q, 1);
    TORCH_CHECK(window_starts->scalar_type() == torch::kInt32 && window_starts->size(0) == q.size(0),
                "paged_attention: window_starts must be int32 [num_seqs]");
  }

  const c10::cuda::CUDAGuard guard(q.device());
  torch::Tensor out = torch::empty_like(q);
  PagedAttentionArgs args{};
  args.out = out.data_ptr();
  args.q = q.data_ptr();
  args.k_cache = k_cache.data_ptr();
  args.v_cache = v_cache.data_ptr();
  args.block_tables = block_tables.data_ptr<int32_t>();
  args.context_lens = context_lens.data_ptr<int32_t>();
  args.num_seqs = static_cast<int>(q.size(0));
  args.num_heads = static_cast<int>(q.size(1));
  args.num_kv_heads = static_cast<int>(k_cache.size(2));
  args.head_dim = static_cast<int>(q.size(2));
  args.block_size = static_cast<int>(k_cache.size(1));
  args.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  args.scale = static_cast<float>(scale);
  args.dtype = kv_dtype(q);
  args.cache_format = format;
  if (format != KvCacheFormat::kSameAsQuery) {
    args.k_scales = k_scales->data_ptr<float>();
    args.v_scales = v_scales->data_ptr<float>();
  }
  args.window_starts = window_starts.has_value() ? window_starts->data_ptr<int32_t>() : nullptr;
  args.partition_size = static_cast<int>(partition_size);
  torch::Tensor partial_ml, partial_acc;  // split-K's partial states, float32
  if (partition_size > 0) {
    const int64_t capacity = int64_t(args.max_blocks_per_seq) * args.block_size;
    const int64_t max_partitions = (capacity + partition_size - 1) / partition_size;
    const auto options = q.options().dtype(torch::kFloat32);
    partial_ml = torch::empty({q.size(0), q.size(1), max_partitions, 2}, options);
    partial_acc = torch::empty({q.size(0), q.size(1), max_partitions, q.size(2)}, options);
    args.partial_ml = partial_ml.data_ptr<float>();
    args.partial_acc = partial_acc.data_ptr<float>();
  }
  const char* error = paged_attention_launch(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(error == nullptr, error);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "Paged-attention decode over a block-tensor KV pool (see paged_attention.h)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_tables"), pybind11::arg("context_lens"), pybind11::arg("scale"),
        pybind11::arg("partition_size"), pybind11::arg("k_scales") = pybind11::none(),
        pybind11::arg("v_scales") = pybind11::none(), pybind11::arg("window_starts") = pybind11::none());
}
