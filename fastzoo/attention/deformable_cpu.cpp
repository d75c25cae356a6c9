// Fused multi-scale deformable attention on CPU: forward and hand-written backward, registered as
// torch.ops.fastzoo_msda.{forward, backward} and called by the torch.library ops of
// deformable_op.py (which give them autograd and a fake implementation). Built on first use.
//
// Shapes are transformers' (fastzoo/attention/deformable.py) with the levels' points flattened, as
// RT-DETRv2 / D-FINE pass them: value [B, S, H, D] contiguous, spatial_shapes [L, 2] int64 (height,
// width), level_start_index [L] int64, points_per_level [L] int64 (P_l), sampling_locations
// [B, Q, H, K, 2] (x, y) in [0, 1] with K = sum P_l (level 0's points first), attention_weights
// [B, Q, H, K]; out [B, Q, H * D].
//
// Sampling is grid_sample's (bilinear, align_corners=False, zeros outside): the location becomes
// grid = 2 * loc - 1, then the pixel coordinate ((grid + 1) * W - 1) / 2, in grid_sample's order of
// operations, and each of the four neighbours inside the level adds its bilinear weight times its
// value row. Nothing of size [B, Q, H, K, ...] is materialised: the forward keeps one output row
// per (b, q, h); the backward recomputes the corners from the saved inputs.
//
// bf16 / fp16 inputs are computed in fp32 (at::opmath_type), fp64 in fp64; outputs and gradients are
// returned in the inputs' dtype (grad_value accumulates in the compute dtype first). The forward is
// parallel over (b, q) and the backward over (b, h), whose grad_value slices are disjoint, so no
// two threads add into one row. The loops over the head width are compiled for width 32 (d_model 256,
// 8 heads) and for any width, each for AVX-512, AVX2 and baseline x86-64 (target_clones, picked
// per machine when loaded).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#if defined(__GNUC__)
#define FZ_ALWAYS_INLINE inline __attribute__((always_inline))
#define FZ_LAMBDA_INLINE __attribute__((always_inline))  // a lambda in a cloned function: inlined, so cloned too
#else
#define FZ_ALWAYS_INLINE inline
#define FZ_LAMBDA_INLINE
#endif
// GCC clones templates for several instruction sets; clang's target_clones takes no templates.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FZ_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FZ_SIMD_CLONES
#endif

namespace {

struct Level {
  int64_t h, w, start;  // size, first token in S
  int64_t points, first_point;  // P_l, and where its points start among a (b, q, h)'s K
};

std::vector<Level> read_levels(const at::Tensor& shapes, const at::Tensor& start, const at::Tensor& points) {
  TORCH_CHECK(shapes.dim() == 2 && shapes.size(1) == 2, "spatial_shapes must be [L, 2]");
  TORCH_CHECK(start.numel() == shapes.size(0) && points.numel() == shapes.size(0),
              "level_start_index and points_per_level must have one entry per level");
  auto s = shapes.to(at::kLong).contiguous();
  auto st = start.to(at::kLong).contiguous();
  auto pt = points.to(at::kLong).contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* stp = st.data_ptr<int64_t>();
  const int64_t* ptp = pt.data_ptr<int64_t>();
  std::vector<Level> levels(s.size(0));
  int64_t first = 0;
  for (int64_t l = 0; l < s.size(0); ++l) {
    levels[l] = {sp[2 * l], sp[2 * l + 1], stp[l], ptp[l], first};
    first += ptp[l];
  }
  return levels;
}

// The four neighbours of one sampling point and their bilinear weights (grid_sample's formulas).
template <typename acc_t>
struct Corners {
  int64_t x0, y0;             // north-west pixel
  acc_t ix, iy;               // the point in pixel coordinates
  acc_t nw, ne, sw, se;       // bilinear weights
  bool in_nw, in_ne, in_sw, in_se;
};

template <typename acc_t>
FZ_ALWAYS_INLINE Corners<acc_t> corners(acc_t x, acc_t y, int64_t W, int64_t H) {
  Corners<acc_t> c;
  const acc_t gx = acc_t(2) * x - acc_t(1), gy = acc_t(2) * y - acc_t(1);
  c.ix = ((gx + acc_t(1)) * acc_t(W) - acc_t(1)) / acc_t(2);
  c.iy = ((gy + acc_t(1)) * acc_t(H) - acc_t(1)) / acc_t(2);
  const acc_t fx = std::floor(c.ix), fy = std::floor(c.iy);
  const acc_t x1 = fx + acc_t(1), y1 = fy + acc_t(1);
  c.nw = (x1 - c.ix) * (y1 - c.iy);
  c.ne = (c.ix - fx) * (y1 - c.iy);
  c.sw = (x1 - c.ix) * (c.iy - fy);
  c.se = (c.ix - fx) * (c.iy - fy);
  // Far-away points (or NaN) fall outside: compare in floating point before converting.
  const bool xin0 = fx >= acc_t(0) && fx < acc_t(W), xin1 = x1 >= acc_t(0) && x1 < acc_t(W);
  const bool yin0 = fy >= acc_t(0) && fy < acc_t(H), yin1 = y1 >= acc_t(0) && y1 < acc_t(H);
  c.in_nw = xin0 && yin0;
  c.in_ne = xin1 && yin0;
  c.in_sw = xin0 && yin1;
  c.in_se = xin1 && yin1;
  c.x0 = (xin0 || xin1) ? static_cast<int64_t>(fx) : 0;
  c.y0 = (yin0 || yin1) ? static_cast<int64_t>(fy) : 0;
  return c;
}

// kD: the head width when known at compile time (the common 32 of d_model 256 / 8 heads: a loop the
// compiler unrolls into a few vector instructions), 0 for any other width (read from D).
template <int kD, typename scalar_t, typename acc_t>
FZ_ALWAYS_INLINE void axpy(acc_t a, const scalar_t* v, acc_t* out, int64_t D) {
  const int64_t n = kD ? kD : D;
  for (int64_t d = 0; d < n; ++d) out[d] += a * static_cast<acc_t>(v[d]);
}

template <int kD, typename scalar_t, typename acc_t>
FZ_ALWAYS_INLINE acc_t dot(const acc_t* g, const scalar_t* v, int64_t D) {
  const int64_t n = kD ? kD : D;
  acc_t s = 0;
  for (int64_t d = 0; d < n; ++d) s += g[d] * static_cast<acc_t>(v[d]);
  return s;
}

// The inputs of one call, read once.
template <typename scalar_t>
struct Call {
  const scalar_t* value;
  const scalar_t* loc;
  const scalar_t* w;
  const std::vector<Level>* levels;
  int64_t B, S, H, D, Q, K;  // K: points per (b, q, h), every level's
};

// Rows [begin, end) of (b, q): out[b, q, h, :] for every head. Compiled for AVX-512, AVX2 and baseline
// x86-64; the loader picks one per machine.
template <int kD, typename scalar_t>
FZ_SIMD_CLONES void forward_rows(const Call<scalar_t>& c, scalar_t* out, int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t S = c.S, H = c.H, D = c.D, Q = c.Q, K = c.K;
  std::vector<acc_t> acc(D);
  for (int64_t bq = begin; bq < end; ++bq) {
    const int64_t b = bq / Q;
    for (int64_t h = 0; h < H; ++h) {
      std::fill(acc.begin(), acc.end(), acc_t(0));
      const int64_t row = (bq * H + h) * K;  // index of (b, q, h, 0) in w
      for (const Level& lv : *c.levels) {
        const scalar_t* base = c.value + ((b * S + lv.start) * H + h) * D;  // level l's first pixel, head h
        for (int64_t p = 0; p < lv.points; ++p) {
          const int64_t i = row + lv.first_point + p;
          const auto k = corners<acc_t>(static_cast<acc_t>(c.loc[2 * i]), static_cast<acc_t>(c.loc[2 * i + 1]), lv.w, lv.h);
          const acc_t a = static_cast<acc_t>(c.w[i]);
          auto px = [&](int64_t y, int64_t x) FZ_LAMBDA_INLINE { return base + (y * lv.w + x) * H * D; };
          if (k.in_nw) axpy<kD>(a * k.nw, px(k.y0, k.x0), acc.data(), D);
          if (k.in_ne) axpy<kD>(a * k.ne, px(k.y0, k.x0 + 1), acc.data(), D);
          if (k.in_sw) axpy<kD>(a * k.sw, px(k.y0 + 1, k.x0), acc.data(), D);
          if (k.in_se) axpy<kD>(a * k.se, px(k.y0 + 1, k.x0 + 1), acc.data(), D);
        }
      }
      scalar_t* o = out + (bq * H + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[d]);
    }
  }
}

// Pairs [begin, end) of (b, h): the gradients of every query's points of head h in image b, and their
// value gradient, which only this pair's rows receive.
template <int kD, typename scalar_t>
FZ_SIMD_CLONES void backward_rows(const Call<scalar_t>& c, const at::opmath_type<scalar_t>* grad,
                                  at::opmath_type<scalar_t>* grad_value, scalar_t* grad_loc, scalar_t* grad_w,
                                  int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t S = c.S, H = c.H, D = c.D, Q = c.Q, K = c.K;
  // Queries outer, heads inner, as the forward: a query's heads sample neighbouring pixels, whose rows
  // of all heads lie side by side (heads outer would visit each pixel's cache lines once per head).
  for (int64_t b = begin / H; b * H < end; ++b) {
    const int64_t h_lo = std::max(begin, b * H) - b * H, h_hi = std::min(end, (b + 1) * H) - b * H;
    for (int64_t q = 0; q < Q; ++q)
    for (int64_t h = h_lo; h < h_hi; ++h) {
      const acc_t* g = grad + ((b * Q + q) * H + h) * D;
      const int64_t row = ((b * Q + q) * H + h) * K;
      for (const Level& lv : *c.levels) {
        const int64_t first = ((b * S + lv.start) * H + h) * D;  // level l's first pixel, head h
        for (int64_t p = 0; p < lv.points; ++p) {
          const int64_t i = row + lv.first_point + p;
          const auto k = corners<acc_t>(static_cast<acc_t>(c.loc[2 * i]), static_cast<acc_t>(c.loc[2 * i + 1]), lv.w, lv.h);
          const acc_t a = static_cast<acc_t>(c.w[i]);
          const acc_t x1 = std::floor(k.ix) + acc_t(1), y1 = std::floor(k.iy) + acc_t(1);
          const acc_t x0 = x1 - acc_t(1), y0 = y1 - acc_t(1);
          acc_t sampled = 0, gix = 0, giy = 0;  // g . bilinear(value); d/dix and d/diy of it
          auto visit = [&](bool in, int64_t y, int64_t x, acc_t cw, acc_t dcw_dx, acc_t dcw_dy) FZ_LAMBDA_INLINE {
            if (!in) return;
            const int64_t at = first + (y * lv.w + x) * H * D;
            const acc_t gv = dot<kD>(g, c.value + at, D);
            sampled += cw * gv;
            gix += dcw_dx * gv;
            giy += dcw_dy * gv;
            axpy<kD>(a * cw, g, grad_value + at, D);
          };
          visit(k.in_nw, k.y0, k.x0, k.nw, -(y1 - k.iy), -(x1 - k.ix));
          visit(k.in_ne, k.y0, k.x0 + 1, k.ne, (y1 - k.iy), -(k.ix - x0));
          visit(k.in_sw, k.y0 + 1, k.x0, k.sw, -(k.iy - y0), (x1 - k.ix));
          visit(k.in_se, k.y0 + 1, k.x0 + 1, k.se, (k.iy - y0), (k.ix - x0));
          grad_w[i] = static_cast<scalar_t>(sampled);
          // d ix / d loc_x = W (ix = ((2 x - 1 + 1) W - 1) / 2), as grid_sample's grad times 2.
          grad_loc[2 * i] = static_cast<scalar_t>(a * gix * (acc_t(lv.w) / acc_t(2)) * acc_t(2));
          grad_loc[2 * i + 1] = static_cast<scalar_t>(a * giy * (acc_t(lv.h) / acc_t(2)) * acc_t(2));
        }
      }
    }
  }
}

constexpr int kCommonD = 32;  // d_model 256 over 8 heads: Deformable DETR, RT-DETR, D-FINE

// The forward's and the backward's inputs, checked and made contiguous once.
struct Inputs {
  at::Tensor value, loc, w;
  std::vector<Level> levels;
  int64_t B, S, H, D, Q, K;

  template <typename scalar_t>
  Call<scalar_t> call() const {
    return {value.data_ptr<scalar_t>(), loc.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), &levels, B, S, H, D, Q, K};
  }
};

Inputs read_inputs(const at::Tensor& value, const at::Tensor& shapes, const at::Tensor& start, const at::Tensor& points,
                   const at::Tensor& loc, const at::Tensor& w) {
  TORCH_CHECK(value.dim() == 4 && loc.dim() == 5 && w.dim() == 4, "msda: value [B,S,H,D], loc [B,Q,H,K,2], w [B,Q,H,K]");
  TORCH_CHECK(value.scalar_type() == loc.scalar_type() && value.scalar_type() == w.scalar_type(),
              "msda: value, sampling_locations and attention_weights must share one dtype");
  Inputs in{value.contiguous(), loc.contiguous(), w.contiguous(), read_levels(shapes, start, points),
            value.size(0), value.size(1), value.size(2), value.size(3), loc.size(1), loc.size(3)};
  TORCH_CHECK(in.levels.empty() || in.levels.back().first_point + in.levels.back().points == in.K,
              "msda: points_per_level does not sum to sampling_locations' ", in.K, " points");
  return in;
}

at::Tensor msda_forward(const at::Tensor& value_in, const at::Tensor& shapes, const at::Tensor& start,
                        const at::Tensor& points, const at::Tensor& loc_in, const at::Tensor& w_in) {
  const Inputs in = read_inputs(value_in, shapes, start, points, loc_in, w_in);
  const int64_t B = in.B, H = in.H, D = in.D, Q = in.Q;
  auto out = at::empty({B, Q, H * D}, in.value.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.value.scalar_type(), "msda_forward", [&] {
    const Call<scalar_t> c = in.call<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * Q, 1, [&](int64_t begin, int64_t end) {
      if (D == kCommonD) forward_rows<kCommonD>(c, op, begin, end);
      else forward_rows<0>(c, op, begin, end);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> msda_backward(const at::Tensor& grad_in, const at::Tensor& value_in,
                                                             const at::Tensor& shapes, const at::Tensor& start,
                                                             const at::Tensor& points, const at::Tensor& loc_in,
                                                             const at::Tensor& w_in) {
  const Inputs in = read_inputs(value_in, shapes, start, points, loc_in, w_in);
  const int64_t B = in.B, H = in.H, D = in.D;
  const auto acc_type = at::toOpMathType(in.value.scalar_type());
  const auto grad = grad_in.to(acc_type).contiguous();  // [B, Q, H * D]
  auto grad_value = at::zeros(in.value.sizes(), in.value.options().dtype(acc_type));
  auto grad_loc = at::empty(in.loc.sizes(), in.loc.options());
  auto grad_w = at::empty(in.w.sizes(), in.w.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.value.scalar_type(), "msda_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Call<scalar_t> c = in.call<scalar_t>();
    const acc_t* gp = grad.data_ptr<acc_t>();
    acc_t* gvp = grad_value.data_ptr<acc_t>();
    scalar_t* glp = grad_loc.data_ptr<scalar_t>();
    scalar_t* gwp = grad_w.data_ptr<scalar_t>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      if (D == kCommonD) backward_rows<kCommonD>(c, gp, gvp, glp, gwp, begin, end);
      else backward_rows<0>(c, gp, gvp, glp, gwp, begin, end);
    });
  });
  return {grad_value.to(in.value.scalar_type()), grad_loc, grad_w};
}

}  // namespace

TORCH_LIBRARY(fastzoo_msda, m) {
  m.def("forward(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor points_per_level, "
        "Tensor sampling_locations, Tensor attention_weights) -> Tensor");
  m.def("backward(Tensor grad, Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
        "Tensor points_per_level, Tensor sampling_locations, Tensor attention_weights) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastzoo_msda, CPU, m) {
  m.impl("forward", &msda_forward);
  m.impl("backward", &msda_backward);
}
