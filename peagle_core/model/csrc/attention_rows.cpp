// The CPU attention backward's elementwise work per query chunk, one pass each, between its matmuls
// (peagle_core/model/attention.py, `_matmul_backward`; it is their reference and tests compare both).
// A chunk is `rows` query rows of `g` stacked heads each (c = rows * g score rows per KV head) against
// `span` keys starting at key k0; query row r sees keys [lo[r], hi[r]] (a contiguous range, maybe empty).
//
// Built by TorchInductor's C++ loader (peagle_core/model/cpp_kernels.py); ATTN_PROBS or ATTN_DSOFTMAX
// names the `kernel` each build exports.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

namespace attention_rows {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// The visible columns [first, last) of query row r within the chunk's keys.
inline std::pair<int64_t, int64_t> visible(const int64_t* lo, const int64_t* hi, int64_t r, int64_t k0,
                                           int64_t span) {
  const int64_t first = std::clamp(lo[r] - k0, int64_t{0}, span);
  const int64_t last = std::clamp(hi[r] + 1 - k0, first, span);
  return {first, last};
}

// For every score row of a chunk ([hkv, c, span] at `scores`), in parallel: zero the columns outside the
// row's visible keys, then fn(h, i, row, first, last) for score row i of head h and its visible columns.
template <typename F>
void for_each_row(float* scores, int64_t hkv, int64_t rows, int64_t g, int64_t span, const int64_t* lo,
                  const int64_t* hi, int64_t k0, F fn) {
  const int64_t c = rows * g;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t i = 0; i < c; ++i) {
      float* row = scores + (h * c + i) * span;
      auto [first, last] = visible(lo, hi, i / g, k0, span);
      std::fill(row, row + first, 0.f);
      std::fill(row + last, row + span, 0.f);
      fn(h, i, row, first, last);
    }
  }
}

}  // namespace attention_rows

#ifdef ATTN_PROBS
// s [hkv, c, span] (scores q k^T, fp32) -> p = exp(s * scale - lse) on visible keys, 0 elsewhere, in place.
// lse: row i of head h at lse[h * head_stride + i].
extern "C" void kernel(float* s, const float* lse, const int64_t* lo, const int64_t* hi, int64_t hkv,
                       int64_t rows, int64_t g, int64_t span, int64_t head_stride, int64_t k0, float scale) {
  using namespace attention_rows;
  const Vec vscale(scale);
  auto probs = [&](int64_t h, int64_t i, float* row, int64_t first, int64_t last) {
    const float l = lse[h * head_stride + i];
    const Vec vl(l);
    int64_t j = first;
    for (; j + kLanes <= last; j += kLanes) {
      at::vec::fmsub(Vec::loadu(row + j), vscale, vl).exp_u20().store(row + j);
    }
    for (; j < last; ++j) row[j] = std::exp(row[j] * scale - l);
  };
  for_each_row(s, hkv, rows, g, span, lo, hi, k0, probs);
}
#endif

#ifdef ATTN_DSOFTMAX
// ds [hkv, c, span] (dO v^T, fp32) -> (ds - delta) * p on visible keys, 0 elsewhere, in place.
// delta: row i of head h at delta[h * head_stride + i].
extern "C" void kernel(float* ds, const float* p, const float* delta, const int64_t* lo, const int64_t* hi,
                       int64_t hkv, int64_t rows, int64_t g, int64_t span, int64_t head_stride, int64_t k0) {
  using namespace attention_rows;
  auto dsoftmax = [&](int64_t h, int64_t i, float* row, int64_t first, int64_t last) {
    const float* prow = p + (row - ds);
    const float d = delta[h * head_stride + i];
    const Vec vd(d);
    int64_t j = first;
    for (; j + kLanes <= last; j += kLanes) {
      ((Vec::loadu(row + j) - vd) * Vec::loadu(prow + j)).store(row + j);
    }
    for (; j < last; ++j) row[j] = (row[j] - d) * prow[j];
  };
  for_each_row(ds, hkv, rows, g, span, lo, hi, k0, dsoftmax);
}
#endif
