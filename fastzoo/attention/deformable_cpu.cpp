// Fused multi-scale deformable attention on CPU: forward and hand-written backward, registered as
// torch.ops.fastzoo_msda.{forward, backward} and called by the torch.library ops of
// deformable_op.py (which give them autograd and a fake implementation). Built on first use.
//
// Shapes are transformers' (fastzoo/attention/deformable.py): value [B, S, H, D] contiguous,
// spatial_shapes [L, 2] int64 (height, width), level_start_index [L] int64, sampling_locations
// [B, Q, H, L, P, 2] (x, y) in [0, 1], attention_weights [B, Q, H, L, P]; out [B, Q, H * D].
//
// Sampling is grid_sample's (bilinear, align_corners=False, zeros outside): the location becomes
// grid = 2 * loc - 1, then the pixel coordinate ((grid + 1) * W - 1) / 2, in grid_sample's order of
// operations, and each of the four neighbours inside the level adds its bilinear weight times its
// value row. Nothing of size [B, Q, H, L, P, ...] is materialised: the forward keeps one output row
// per (b, q, h); the backward recomputes the corners from the saved inputs.
//
// bf16 / fp16 inputs are computed in fp32 (at::opmath_type), fp64 in fp64; outputs and gradients are
// returned in the inputs' dtype (grad_value accumulates in the compute dtype first). The forward is
// parallel over (b, q) and the backward over (b, h), whose grad_value slices are disjoint, so no
// two threads add into one row.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

struct Level {
  int64_t h, w, start;
};

std::vector<Level> read_levels(const at::Tensor& shapes, const at::Tensor& start) {
  TORCH_CHECK(shapes.dim() == 2 && shapes.size(1) == 2, "spatial_shapes must be [L, 2]");
  auto s = shapes.to(at::kLong).contiguous();
  auto st = start.to(at::kLong).contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* stp = st.data_ptr<int64_t>();
  std::vector<Level> levels(s.size(0));
  for (int64_t l = 0; l < s.size(0); ++l) levels[l] = {sp[2 * l], sp[2 * l + 1], stp[l]};
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
inline Corners<acc_t> corners(acc_t x, acc_t y, int64_t W, int64_t H) {
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

template <typename scalar_t, typename acc_t>
inline void axpy(acc_t a, const scalar_t* v, acc_t* out, int64_t D) {
  for (int64_t d = 0; d < D; ++d) out[d] += a * static_cast<acc_t>(v[d]);
}

template <typename scalar_t, typename acc_t>
inline acc_t dot(const acc_t* g, const scalar_t* v, int64_t D) {
  acc_t s = 0;
  for (int64_t d = 0; d < D; ++d) s += g[d] * static_cast<acc_t>(v[d]);
  return s;
}

void check(const at::Tensor& value, const at::Tensor& loc, const at::Tensor& w) {
  TORCH_CHECK(value.dim() == 4 && loc.dim() == 6 && w.dim() == 5, "msda: value [B,S,H,D], loc [B,Q,H,L,P,2], w [B,Q,H,L,P]");
  TORCH_CHECK(value.scalar_type() == loc.scalar_type() && value.scalar_type() == w.scalar_type(),
              "msda: value, sampling_locations and attention_weights must share one dtype");
}

at::Tensor msda_forward(const at::Tensor& value_in, const at::Tensor& shapes, const at::Tensor& start,
                        const at::Tensor& loc_in, const at::Tensor& w_in) {
  check(value_in, loc_in, w_in);
  const auto value = value_in.contiguous(), loc = loc_in.contiguous(), w = w_in.contiguous();
  const auto levels = read_levels(shapes, start);
  const int64_t B = value.size(0), S = value.size(1), H = value.size(2), D = value.size(3);
  const int64_t Q = loc.size(1), L = loc.size(3), P = loc.size(4);
  TORCH_CHECK(static_cast<int64_t>(levels.size()) == L, "msda: spatial_shapes has ", levels.size(), " levels, loc ", L);
  auto out = at::empty({B, Q, H * D}, value.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, value.scalar_type(), "msda_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* vp = value.data_ptr<scalar_t>();
    const scalar_t* lp = loc.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * Q, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(D);
      for (int64_t bq = begin; bq < end; ++bq) {
        const int64_t b = bq / Q;
        for (int64_t h = 0; h < H; ++h) {
          std::fill(acc.begin(), acc.end(), acc_t(0));
          const int64_t row = (bq * H + h) * L * P;  // index of (b, q, h, 0, 0) in w
          for (int64_t l = 0; l < L; ++l) {
            const Level& lv = levels[l];
            for (int64_t p = 0; p < P; ++p) {
              const int64_t i = row + l * P + p;
              const auto c = corners<acc_t>(static_cast<acc_t>(lp[2 * i]), static_cast<acc_t>(lp[2 * i + 1]), lv.w, lv.h);
              const acc_t a = static_cast<acc_t>(wp[i]);
              auto at_px = [&](int64_t y, int64_t x) { return vp + ((b * S + lv.start + y * lv.w + x) * H + h) * D; };
              if (c.in_nw) axpy(a * c.nw, at_px(c.y0, c.x0), acc.data(), D);
              if (c.in_ne) axpy(a * c.ne, at_px(c.y0, c.x0 + 1), acc.data(), D);
              if (c.in_sw) axpy(a * c.sw, at_px(c.y0 + 1, c.x0), acc.data(), D);
              if (c.in_se) axpy(a * c.se, at_px(c.y0 + 1, c.x0 + 1), acc.data(), D);
            }
          }
          scalar_t* o = op + (bq * H + h) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[d]);
        }
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> msda_backward(const at::Tensor& grad_in, const at::Tensor& value_in,
                                                             const at::Tensor& shapes, const at::Tensor& start,
                                                             const at::Tensor& loc_in, const at::Tensor& w_in) {
  check(value_in, loc_in, w_in);
  const auto value = value_in.contiguous(), loc = loc_in.contiguous(), w = w_in.contiguous();
  const auto levels = read_levels(shapes, start);
  const int64_t B = value.size(0), S = value.size(1), H = value.size(2), D = value.size(3);
  const int64_t Q = loc.size(1), L = loc.size(3), P = loc.size(4);
  const auto acc_type = at::toOpMathType(value.scalar_type());
  const auto grad = grad_in.to(acc_type).contiguous();  // [B, Q, H * D]
  auto grad_value = at::zeros({B, S, H, D}, value.options().dtype(acc_type));
  auto grad_loc = at::empty(loc.sizes(), loc.options());
  auto grad_w = at::empty(w.sizes(), w.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, value.scalar_type(), "msda_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* vp = value.data_ptr<scalar_t>();
    const scalar_t* lp = loc.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const acc_t* gp = grad.data_ptr<acc_t>();
    acc_t* gvp = grad_value.data_ptr<acc_t>();
    scalar_t* glp = grad_loc.data_ptr<scalar_t>();
    scalar_t* gwp = grad_w.data_ptr<scalar_t>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        for (int64_t q = 0; q < Q; ++q) {
          const acc_t* g = gp + ((b * Q + q) * H + h) * D;
          const int64_t row = ((b * Q + q) * H + h) * L * P;
          for (int64_t l = 0; l < L; ++l) {
            const Level& lv = levels[l];
            for (int64_t p = 0; p < P; ++p) {
              const int64_t i = row + l * P + p;
              const auto c = corners<acc_t>(static_cast<acc_t>(lp[2 * i]), static_cast<acc_t>(lp[2 * i + 1]), lv.w, lv.h);
              const acc_t a = static_cast<acc_t>(wp[i]);
              const acc_t x1 = std::floor(c.ix) + acc_t(1), y1 = std::floor(c.iy) + acc_t(1);
              const acc_t x0 = x1 - acc_t(1), y0 = y1 - acc_t(1);
              acc_t sampled = 0, gix = 0, giy = 0;  // g . bilinear(value); d/dix and d/diy of it
              auto visit = [&](bool in, int64_t y, int64_t x, acc_t cw, acc_t dcw_dx, acc_t dcw_dy) {
                if (!in) return;
                const int64_t tok = b * S + lv.start + y * lv.w + x;
                const acc_t gv = dot(g, vp + (tok * H + h) * D, D);
                sampled += cw * gv;
                gix += dcw_dx * gv;
                giy += dcw_dy * gv;
                axpy(a * cw, g, gvp + (tok * H + h) * D, D);
              };
              visit(c.in_nw, c.y0, c.x0, c.nw, -(y1 - c.iy), -(x1 - c.ix));
              visit(c.in_ne, c.y0, c.x0 + 1, c.ne, (y1 - c.iy), -(c.ix - x0));
              visit(c.in_sw, c.y0 + 1, c.x0, c.sw, -(c.iy - y0), (x1 - c.ix));
              visit(c.in_se, c.y0 + 1, c.x0 + 1, c.se, (c.iy - y0), (c.ix - x0));
              gwp[i] = static_cast<scalar_t>(sampled);
              // d ix / d loc_x = W (ix = ((2 x - 1 + 1) W - 1) / 2), as grid_sample's grad times 2.
              glp[2 * i] = static_cast<scalar_t>(a * gix * (acc_t(lv.w) / acc_t(2)) * acc_t(2));
              glp[2 * i + 1] = static_cast<scalar_t>(a * giy * (acc_t(lv.h) / acc_t(2)) * acc_t(2));
            }
          }
        }
      }
    });
  });
  return {grad_value.to(value.scalar_type()), grad_loc, grad_w};
}

}  // namespace

TORCH_LIBRARY(fastzoo_msda, m) {
  m.def("forward(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, "
        "Tensor attention_weights) -> Tensor");
  m.def("backward(Tensor grad, Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
        "Tensor sampling_locations, Tensor attention_weights) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastzoo_msda, CPU, m) {
  m.impl("forward", &msda_forward);
  m.impl("backward", &msda_backward);
}
