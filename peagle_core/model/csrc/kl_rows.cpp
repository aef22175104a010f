// The distillation loss's row kernels for CPU: one pass per row for the teacher and one for the drafter,
// the row kept in cache, one exp per logit. Same contract as `teacher_stats` and `draft_stats` in
// peagle_core/model/loss.py (their reference; tests compare both, forward and gradient).
//
// Built by TorchInductor's C++ loader (peagle_core/model/cpp_kernels.py): its compiler, vector-ISA flags,
// OpenMP and on-disk cache. Each kernel is compiled alone as `kernel` (KL_ROWS_TEACHER or KL_ROWS_DRAFT).
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace kl_rows {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int kAllLanes = (1 << kLanes) - 1;  // zero_mask() of a comparison no lane passed

inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Row `x` of V logits in `T` -> fp32 in `out`; returns the row's max and the first index holding it.
template <typename T>
std::pair<float, int64_t> load_row_max(const T* x, float* out, int64_t V) {
  Vec vmax(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    Vec v;
    if constexpr (std::is_same_v<T, float>) {
      v = Vec::loadu(x + i);
    } else {
      at::vec::load_fp32_from_bf16(x + i, v);
    }
    v.store(out + i);
    vmax = at::vec::maximum(vmax, v);
  }
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; i < V; ++i) {
    out[i] = static_cast<float>(x[i]);
    m = std::max(m, out[i]);
  }
  // torch.argmax's tie rule: the first index holding the max.
  for (int64_t j = 0; j < V; j += kLanes) {
    int64_t n = std::min(kLanes, V - j);
    if (n == kLanes && (Vec::loadu(out + j) == Vec(m)).zero_mask() == kAllLanes) continue;
    for (int64_t k = j; k < j + n; ++k) {
      if (out[k] == m) {
        return {m, k};
      }
    }
  }
  return {m, 0};  // only a NaN row gets here
}

// out = w (e * inv - p) in `G`, e and p fp32.
template <typename G>
void store_grad_row(const float* e, const float* p, float inv, float w, G* out, int64_t V) {
  const Vec vinv(inv), vw(w);
  auto grad = [&](int64_t i) { return (Vec::loadu(e + i) * vinv - Vec::loadu(p + i)) * vw; };
  int64_t i = 0;
  if constexpr (std::is_same_v<G, float>) {
    for (; i + kLanes <= V; i += kLanes) grad(i).store(out + i);
  } else {
    for (; i + 2 * kLanes <= V; i += 2 * kLanes) {
      at::vec::convert_float_bfloat16(grad(i), grad(i + kLanes)).store(out + i);
    }
  }
  for (; i < V; ++i) out[i] = static_cast<G>((e[i] * inv - p[i]) * w);
}

// Teacher rows [u, V] -> (p fp32 [u, V], sum_v p log p [u], argmax [u]).
template <typename T>
void teacher_rows(const T* logits, int64_t u, int64_t V, float* p, float* neg_entropy, int64_t* argmax) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < u; ++r) {
    float* pr = p + r * V;
    auto [m, arg] = load_row_max(logits + r * V, pr, V);
    // e = exp(x - m) over the row in place; sum e and sum e * x on the way.
    Vec vs(0.f), vdot(0.f);
    int64_t i = 0;
    for (; i + kLanes <= V; i += kLanes) {
      Vec x = Vec::loadu(pr + i);
      Vec e = (x - Vec(m)).exp_u20();
      e.store(pr + i);
      vs = vs + e;
      vdot = at::vec::fmadd(e, x, vdot);
    }
    float s = reduce_sum(vs), dot = reduce_sum(vdot);
    for (; i < V; ++i) {
      float x = pr[i];
      float e = std::exp(x - m);
      pr[i] = e;
      s += e;
      dot += e * x;
    }
    const float inv = 1.f / s;
    at::vec::map([inv](Vec x) { return x * Vec(inv); }, pr, pr, V);
    // sum p log p = sum p (x - m - log s) = dot / s - m - log s
    neg_entropy[r] = dot * inv - m - std::log(s);
    argmax[r] = arg;
  }
}

// Drafter rows [c, V] against teacher rows p[inverse] -> (KL per row, argmax, weighted dKL/dlogits).
template <typename T, typename G>
void draft_rows(const T* logits, const float* p, const float* neg_entropy, const int64_t* inverse,
                const float* row_weight, int64_t c, int64_t V, float* loss, int64_t* argmax, G* grad) {
#pragma omp parallel
  {
    std::vector<float> buf(V);
    float* q = buf.data();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < c; ++r) {
      const float* pe = p + inverse[r] * V;
      auto [m, arg] = load_row_max(logits + r * V, q, V);
      // sum_v p_v log q_v = sum p z - (m + log s) sum p, s = sum exp(z - m)
      Vec vs(0.f), vdot(0.f), vpsum(0.f);
      int64_t i = 0;
      for (; i + kLanes <= V; i += kLanes) {
        Vec z = Vec::loadu(q + i);
        Vec pv = Vec::loadu(pe + i);
        Vec e = (z - Vec(m)).exp_u20();
        e.store(q + i);
        vs = vs + e;
        vdot = at::vec::fmadd(pv, z, vdot);
        vpsum = vpsum + pv;
      }
      float s = reduce_sum(vs), dot = reduce_sum(vdot), psum = reduce_sum(vpsum);
      for (; i < V; ++i) {
        float z = q[i];
        float e = std::exp(z - m);
        q[i] = e;
        s += e;
        dot += pe[i] * z;
        psum += pe[i];
      }
      // grad = w (q - p), q = e / s, written straight to the output row
      store_grad_row(q, pe, 1.f / s, row_weight[r], grad + r * V, V);
      loss[r] = neg_entropy[inverse[r]] - (dot - (m + std::log(s)) * psum);
      argmax[r] = arg;
    }
  }
}

}  // namespace kl_rows

#ifdef KL_ROWS_TEACHER
// logits [u, V] (bf16 when logits_bf16, else fp32) -> p, neg_entropy, argmax (preallocated).
extern "C" void kernel(const void* logits, int64_t logits_bf16, float* p, float* neg_entropy, int64_t* argmax,
                       int64_t u, int64_t V) {
  if (logits_bf16) {
    kl_rows::teacher_rows(static_cast<const c10::BFloat16*>(logits), u, V, p, neg_entropy, argmax);
  } else {
    kl_rows::teacher_rows(static_cast<const float*>(logits), u, V, p, neg_entropy, argmax);
  }
}
#endif

#ifdef KL_ROWS_DRAFT
// logits [c, V], p [u, V], neg_entropy [u], inverse [c], row_weight [c] -> loss [c], argmax [c], grad [c, V]
// (bf16 where the flags say so, else fp32).
extern "C" void kernel(const void* logits, int64_t logits_bf16, const float* p, const float* neg_entropy,
                       const int64_t* inverse, const float* row_weight, float* loss, int64_t* argmax,
                       void* grad, int64_t grad_bf16, int64_t c, int64_t V) {
  auto run = [&](auto* z) {
    if (grad_bf16) {
      kl_rows::draft_rows(z, p, neg_entropy, inverse, row_weight, c, V, loss, argmax,
                          static_cast<c10::BFloat16*>(grad));
    } else {
      kl_rows::draft_rows(z, p, neg_entropy, inverse, row_weight, c, V, loss, argmax,
                          static_cast<float*>(grad));
    }
  };
  if (logits_bf16) {
    run(static_cast<const c10::BFloat16*>(logits));
  } else {
    run(static_cast<const float*>(logits));
  }
}
#endif
