// Fused GIoU loss on CPU, registered as the CPU kernels of the torch.library ops defined in
// giou_op.py and built on first use (torch.utils.cpp_extension):
//
//   giou_loss_fwd / giou_loss_bwd        elementwise loss of [N, 4] pairs, hand-written backward;
//   giou_loss_masked / _masked_bwd       padded [..., 4] pairs, validity from a mask or from the
//                                        target (an inverted box marks padding), the masked
//                                        sum / mean fused in, no gather and no host sync;
//   giou_valid_rows                      which slots of a padded target are real pairs;
//   first_bad_box                        the box check of fastzoo.losses.giou in one pass.
//
// The math is giou_op.py's closed form, element by element, in torchvision's op order. pred and
// target may have different dtypes (bf16 predictions under autocast, fp32 targets): each is read
// in its own dtype and the math runs in fp32 (fp64 if either is fp64); the loss is returned in
// that compute dtype and each gradient in its input's dtype. Sums accumulate in fp64, as the
// Triton kernel's do (triton_giou.py), so both devices reduce alike.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

// Below this many boxes one thread does the whole loop (thread start-up costs more).
constexpr int64_t kGrain = 16384;
enum Reduction : int64_t { kNone = 0, kSum = 1, kMean = 2 };

template <typename T>
inline T tie(T a, T b) {  // d max(a, b) / da under autograd's rule: 1, 1/2 at a tie, 0
  return a > b ? T(1) : (a == b ? T(0.5) : T(0));
}

template <typename acc_t>
struct Box {
  acc_t x1, y1, x2, y2;
  template <typename scalar_t>
  static Box load(const scalar_t* p) {
    return {static_cast<acc_t>(p[0]), static_cast<acc_t>(p[1]), static_cast<acc_t>(p[2]), static_cast<acc_t>(p[3])};
  }
  bool inverted() const { return x2 < x1 || y2 < y1; }  // the padding sentinel (NaN is not padding)
};

template <typename acc_t>
inline acc_t giou_loss_one(const Box<acc_t>& a, const Box<acc_t>& b, acc_t e) {
  const acc_t iw = std::min(a.x2, b.x2) - std::max(a.x1, b.x1);
  const acc_t ih = std::min(a.y2, b.y2) - std::max(a.y1, b.y1);
  const acc_t inter = (iw > 0 && ih > 0) ? iw * ih : acc_t(0);
  const acc_t uni = (a.x2 - a.x1) * (a.y2 - a.y1) + (b.x2 - b.x1) * (b.y2 - b.y1) - inter;
  const acc_t area_c = (std::max(a.x2, b.x2) - std::min(a.x1, b.x1)) * (std::max(a.y2, b.y2) - std::min(a.y1, b.y1));
  return acc_t(1) - (inter / (uni + e) - (area_c - uni) / (area_c + e));
}

// Gradients of g * loss(a, b) with respect to a's and b's four coordinates.
template <typename acc_t>
inline void giou_grad_one(const Box<acc_t>& a, const Box<acc_t>& b, acc_t g, acc_t e, acc_t* ga, acc_t* gb) {
  const acc_t w1 = a.x2 - a.x1, h1 = a.y2 - a.y1, w2 = b.x2 - b.x1, h2 = b.y2 - b.y1;
  const acc_t iw = std::min(a.x2, b.x2) - std::max(a.x1, b.x1);
  const acc_t ih = std::min(a.y2, b.y2) - std::max(a.y1, b.y1);
  const bool overlap = iw > 0 && ih > 0;  // touching boxes: no intersection, no gradient
  const acc_t inter = overlap ? iw * ih : acc_t(0);
  const acc_t uni = w1 * h1 + w2 * h2 - inter;
  const acc_t cw = std::max(a.x2, b.x2) - std::min(a.x1, b.x1);
  const acc_t ch = std::max(a.y2, b.y2) - std::min(a.y1, b.y1);
  const acc_t u = uni + e, c = cw * ch + e;
  const acc_t g_union = g * inter / (u * u) - g / c;
  const acc_t g_inter = overlap ? -g / u - g_union : acc_t(0);
  const acc_t g_area_c = g * (uni + e) / (c * c);
  const acc_t g_iw = g_inter * ih, g_ih = g_inter * iw;
  const acc_t g_cw = g_area_c * ch, g_ch = g_area_c * cw;
  // share of max(x1, x1g) going to x1, of min(x2, x2g) going to x2; same in y
  const acc_t tx1 = tie(a.x1, b.x1), ty1 = tie(a.y1, b.y1), tx2 = tie(b.x2, a.x2), ty2 = tie(b.y2, a.y2);
  ga[0] = -g_iw * tx1 - g_cw * (1 - tx1) - g_union * h1;
  ga[1] = -g_ih * ty1 - g_ch * (1 - ty1) - g_union * w1;
  ga[2] = g_iw * tx2 + g_cw * (1 - tx2) + g_union * h1;
  ga[3] = g_ih * ty2 + g_ch * (1 - ty2) + g_union * w1;
  gb[0] = -g_iw * (1 - tx1) - g_cw * tx1 - g_union * h2;
  gb[1] = -g_ih * (1 - ty1) - g_ch * ty1 - g_union * w2;
  gb[2] = g_iw * (1 - tx2) + g_cw * tx2 + g_union * h2;
  gb[3] = g_ih * (1 - ty2) + g_ch * ty2 + g_union * w2;
}

at::ScalarType compute_type(const at::Tensor& pred, const at::Tensor& target) {
  return (pred.scalar_type() == at::kDouble || target.scalar_type() == at::kDouble) ? at::kDouble : at::kFloat;
}

// Calls f.template operator()<pred_t, target_t, acc_t>() for the two tensors' dtypes.
template <typename F>
void dispatch_pair(const at::Tensor& pred, const at::Tensor& target, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pred.scalar_type(), "giou_loss (pred)", [&] {
    using pred_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target.scalar_type(), "giou_loss (target)", [&] {
      using target_t = scalar_t;
      if (compute_type(pred, target) == at::kDouble) {
        f.template operator()<pred_t, target_t, double>();
      } else {
        f.template operator()<pred_t, target_t, float>();
      }
    });
  });
}

void check_pair(const at::Tensor& pred, const at::Tensor& target, const char* name) {
  TORCH_CHECK(pred.size(-1) == 4 && pred.sizes() == target.sizes(), name, ": pred and target must have the same shape [..., 4], got ",
              pred.sizes(), " and ", target.sizes());
}

// -- elementwise [N, 4] ---------------------------------------------------------------------
at::Tensor giou_loss_fwd_cpu(const at::Tensor& pred_in, const at::Tensor& target_in, double eps) {
  check_pair(pred_in, target_in, "giou_loss");
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  const int64_t n = pred.numel() / 4;
  at::Tensor loss = at::empty(pred.sizes().slice(0, pred.dim() - 1), pred.options().dtype(compute_type(pred, target)));
  dispatch_pair(pred, target, [&]<typename P, typename T, typename A>() {
    const P* p = pred.const_data_ptr<P>();
    const T* t = target.const_data_ptr<T>();
    A* out = loss.mutable_data_ptr<A>();
    const A e = static_cast<A>(eps);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = giou_loss_one(Box<A>::load(p + 4 * i), Box<A>::load(t + 4 * i), e);
    });
  });
  return loss;
}

std::tuple<at::Tensor, at::Tensor> giou_loss_bwd_cpu(const at::Tensor& grad_in, const at::Tensor& pred_in,
                                                     const at::Tensor& target_in, double eps) {
  check_pair(pred_in, target_in, "giou_loss_bwd");
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  const int64_t n = pred.numel() / 4;
  TORCH_CHECK(grad_in.numel() == n, "giou_loss_bwd: grad has ", grad_in.numel(), " elements for ", n, " boxes");
  const at::Tensor grad = grad_in.to(compute_type(pred, target)).contiguous();
  at::Tensor grad_pred = at::empty_like(pred), grad_target = at::empty_like(target);
  dispatch_pair(pred, target, [&]<typename P, typename T, typename A>() {
    const P* p = pred.const_data_ptr<P>();
    const T* t = target.const_data_ptr<T>();
    const A* go = grad.const_data_ptr<A>();
    P* gp = grad_pred.mutable_data_ptr<P>();
    T* gt = grad_target.mutable_data_ptr<T>();
    const A e = static_cast<A>(eps);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      A ga[4], gb[4];
      for (int64_t i = begin; i < end; ++i) {
        giou_grad_one(Box<A>::load(p + 4 * i), Box<A>::load(t + 4 * i), go[i], e, ga, gb);
        for (int k = 0; k < 4; ++k) gp[4 * i + k] = static_cast<P>(ga[k]), gt[4 * i + k] = static_cast<T>(gb[k]);
      }
    });
  });
  return {grad_pred, grad_target};
}

// -- padded [..., 4] with the masked reduction fused in ----------------------------------------
void check_masked(const at::Tensor& pred, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                  int64_t reduction) {
  check_pair(pred, target, "giou_loss_masked");
  TORCH_CHECK(reduction == kNone || reduction == kSum || reduction == kMean, "giou_loss_masked: reduction code ",
              reduction, " is not 0 (none), 1 (sum) or 2 (mean)");
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->sizes() == pred.sizes().slice(0, pred.dim() - 1),
                "giou_loss_masked: mask must be bool of shape ", pred.sizes().slice(0, pred.dim() - 1), ", got ",
                mask->scalar_type(), " ", mask->sizes());
  }
}

// Which rows are real pairs when no mask is given: the target is not an inverted box. One
// branch-free pass over the target (the compiler vectorises it) into a bool [...] mask, so that
// both directions then read 1 byte per slot instead of a 16-byte box.
at::Tensor valid_from_target(const at::Tensor& target_in) {
  const at::Tensor target = target_in.contiguous();
  const int64_t n = target.numel() / 4;
  at::Tensor valid = at::empty(target.sizes().slice(0, target.dim() - 1), target.options().dtype(at::kBool));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target.scalar_type(), "giou valid_from_target", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* t = target.const_data_ptr<scalar_t>();
    bool* v = valid.mutable_data_ptr<bool>();
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {  // Box::inverted, negated: NaN is not padding
        const acc_t x1 = t[4 * i], y1 = t[4 * i + 1], x2 = t[4 * i + 2], y2 = t[4 * i + 3];
        v[i] = !(x2 < x1) & !(y2 < y1);
      }
    });
  });
  return valid;
}

// Calls f(i) for every i in [begin, end) with m[i] set, eight slots at a time: padded batches are
// mostly padding (a few real boxes among hundreds of slots), and a zero word skips eight of them.
template <typename F>
inline void for_each_valid(const bool* m, int64_t begin, int64_t end, F&& f) {
  int64_t i = begin;
  for (; i < end && (i & 7); ++i)
    if (m[i]) f(i);
  for (; i + 8 <= end; i += 8) {
    uint64_t word;
    std::memcpy(&word, m + i, 8);
    if (!word) continue;
    for (int64_t k = i; k < i + 8; ++k)
      if (m[k]) f(k);
  }
  for (; i < end; ++i)
    if (m[i]) f(i);
}

// The mask the loops read: the given one, or the target's (valid_from_target).
at::Tensor valid_rows(const at::Tensor& target, const std::optional<at::Tensor>& mask) {
  return mask.has_value() ? mask->contiguous() : valid_from_target(target);
}

at::Tensor giou_loss_masked_cpu(const at::Tensor& pred_in, const at::Tensor& target_in,
                                const std::optional<at::Tensor>& mask_in, double eps, int64_t reduction) {
  check_masked(pred_in, target_in, mask_in, reduction);
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  const at::Tensor valid = valid_rows(target, mask_in);
  const int64_t n = pred.numel() / 4;
  const auto ct = compute_type(pred, target);
  at::Tensor out = reduction == kNone ? at::empty(pred.sizes().slice(0, pred.dim() - 1), pred.options().dtype(ct))
                                      : at::empty({}, pred.options().dtype(ct));
  dispatch_pair(pred, target, [&]<typename P, typename T, typename A>() {
    const P* p = pred.const_data_ptr<P>();
    const T* t = target.const_data_ptr<T>();
    const bool* m = valid.const_data_ptr<bool>();
    const A e = static_cast<A>(eps);
    if (reduction == kNone) {
      A* o = out.mutable_data_ptr<A>();
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        std::fill(o + begin, o + end, A(0));
        for_each_valid(m, begin, end, [&](int64_t i) {
          o[i] = giou_loss_one(Box<A>::load(p + 4 * i), Box<A>::load(t + 4 * i), e);
        });
      });
      return;
    }
    // (sum, count) over the real pairs, in fp64
    using SumCount = std::pair<double, int64_t>;
    const SumCount total = at::parallel_reduce(
        0, n, kGrain, SumCount{0.0, 0},
        [&](int64_t begin, int64_t end, SumCount acc) {
          for_each_valid(m, begin, end, [&](int64_t i) {
            acc.first += static_cast<double>(giou_loss_one(Box<A>::load(p + 4 * i), Box<A>::load(t + 4 * i), e));
            acc.second += 1;
          });
          return acc;
        },
        [](SumCount a, SumCount b) { return SumCount{a.first + b.first, a.second + b.second}; });
    // mean over no pairs is 0, as torchvision's mean of an empty loss
    const double value = reduction == kSum ? total.first : (total.second ? total.first / total.second : 0.0);
    *out.mutable_data_ptr<A>() = static_cast<A>(value);
  });
  return out;
}

// Gradients of the padded loss; padding gets exactly 0. A gradient nobody asked for (the target
// usually needs none) is not computed: an empty tensor stands in for it.
std::tuple<at::Tensor, at::Tensor> giou_loss_masked_bwd_cpu(const at::Tensor& grad_in, const at::Tensor& pred_in,
                                                            const at::Tensor& target_in,
                                                            const std::optional<at::Tensor>& mask_in, double eps,
                                                            int64_t reduction, bool need_pred, bool need_target) {
  check_masked(pred_in, target_in, mask_in, reduction);
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  const at::Tensor valid = valid_rows(target, mask_in);
  const int64_t n = pred.numel() / 4;
  const at::Tensor grad = grad_in.to(compute_type(pred, target)).contiguous();
  TORCH_CHECK(grad.numel() == (reduction == kNone ? n : 1), "giou_loss_masked_bwd: grad has ", grad.numel(), " elements");
  // zero-filled (a memset): the loop below writes the real rows only
  at::Tensor grad_pred = need_pred ? at::zeros_like(pred) : at::empty({0}, pred.options());
  at::Tensor grad_target = need_target ? at::zeros_like(target) : at::empty({0}, target.options());
  dispatch_pair(pred, target, [&]<typename P, typename T, typename A>() {
    const P* p = pred.const_data_ptr<P>();
    const T* t = target.const_data_ptr<T>();
    const bool* m = valid.const_data_ptr<bool>();
    const A* go = grad.const_data_ptr<A>();
    P* gp = need_pred ? grad_pred.mutable_data_ptr<P>() : nullptr;
    T* gt = need_target ? grad_target.mutable_data_ptr<T>() : nullptr;
    const A e = static_cast<A>(eps);
    A scale = go[0];
    if (reduction == kMean) {
      const int64_t count = at::parallel_reduce(
          0, n, kGrain, int64_t(0),
          [&](int64_t begin, int64_t end, int64_t c) {
            for_each_valid(m, begin, end, [&](int64_t) { ++c; });
            return c;
          },
          std::plus<int64_t>());
      scale = count ? static_cast<A>(static_cast<double>(go[0]) / count) : A(0);
    }
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      A ga[4], gb[4];
      for_each_valid(m, begin, end, [&](int64_t i) {  // padding, whatever it holds: no gradient
        giou_grad_one(Box<A>::load(p + 4 * i), Box<A>::load(t + 4 * i), reduction == kNone ? go[i] : scale, e, ga, gb);
        if (gp) for (int k = 0; k < 4; ++k) gp[4 * i + k] = static_cast<P>(ga[k]);
        if (gt) for (int k = 0; k < 4; ++k) gt[4 * i + k] = static_cast<T>(gb[k]);
      });
    });
  });
  return {grad_pred, grad_target};
}

// -- autograd in C++ (as torchvision does for its C++ ops): an eager CPU call is one dispatcher
// call with no Python in between; CUDA and the vectorised fallback keep the Python rules of
// giou_op.py (register_autograd), and torch.compile traces either one.
class GiouLossFunction : public torch::autograd::Function<GiouLossFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& pred, const at::Tensor& target,
                            double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fastzoo::giou_loss_fwd", "").typed<decltype(giou_loss_fwd_cpu)>();
    ctx->save_for_backward({pred, target});
    ctx->saved_data["eps"] = eps;
    return op.call(pred, target, eps);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fastzoo::giou_loss_bwd", "").typed<decltype(giou_loss_bwd_cpu)>();
    const auto saved = ctx->get_saved_variables();
    auto [grad_pred, grad_target] = op.call(grads[0], saved[0], saved[1], ctx->saved_data["eps"].toDouble());
    return {ctx->needs_input_grad(0) ? grad_pred : at::Tensor(), ctx->needs_input_grad(1) ? grad_target : at::Tensor(),
            at::Tensor()};
  }
};

class GiouMaskedFunction : public torch::autograd::Function<GiouMaskedFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& pred, const at::Tensor& target,
                            const std::optional<at::Tensor>& mask, double eps, int64_t reduction) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fastzoo::giou_loss_masked", "").typed<decltype(giou_loss_masked_cpu)>();
    // validity from the target: read the boxes once here, both directions then read the mask
    static auto valid_op = c10::Dispatcher::singleton().findSchemaOrThrow("fastzoo::giou_valid_rows", "").typed<decltype(valid_from_target)>();
    const at::Tensor valid = mask.has_value() ? *mask : valid_op.call(target);  // an op: fake tensors trace it
    ctx->save_for_backward({pred, target, valid});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["reduction"] = reduction;
    return op.call(pred, target, valid, eps, reduction);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fastzoo::giou_loss_masked_bwd", "").typed<decltype(giou_loss_masked_bwd_cpu)>();
    const auto saved = ctx->get_saved_variables();
    auto [grad_pred, grad_target] = op.call(grads[0], saved[0], saved[1], saved[2], ctx->saved_data["eps"].toDouble(),
                                            ctx->saved_data["reduction"].toInt(), ctx->needs_input_grad(0),
                                            ctx->needs_input_grad(1));
    return {ctx->needs_input_grad(0) ? grad_pred : at::Tensor(), ctx->needs_input_grad(1) ? grad_target : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor giou_loss_fwd_autograd(const at::Tensor& pred, const at::Tensor& target, double eps) {
  return GiouLossFunction::apply(pred, target, eps);
}

at::Tensor giou_loss_masked_autograd(const at::Tensor& pred, const at::Tensor& target,
                                     const std::optional<at::Tensor>& mask, double eps, int64_t reduction) {
  return GiouMaskedFunction::apply(pred, target, mask, eps, reduction);
}

// Flattened row of the first box that is not finite or has x2 < x1 or y2 < y1, or -1.
int64_t first_bad_box_cpu(const at::Tensor& boxes_in) {
  TORCH_CHECK(boxes_in.size(-1) == 4, "first_bad_box: boxes must be [..., 4], got ", boxes_in.sizes());
  const at::Tensor boxes = boxes_in.contiguous();
  const int64_t n = boxes.numel() / 4;
  int64_t bad = -1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), "first_bad_box_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* b = boxes.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < n && bad < 0; ++i) {
      const acc_t x1 = b[4 * i], y1 = b[4 * i + 1], x2 = b[4 * i + 2], y2 = b[4 * i + 3];
      const bool finite = std::isfinite(x1) && std::isfinite(y1) && std::isfinite(x2) && std::isfinite(y2);
      if (!finite || x2 < x1 || y2 < y1) bad = i;
    }
  });
  return bad;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastzoo, m) {
  m.def("first_bad_box(Tensor boxes) -> int");
}

TORCH_LIBRARY_IMPL(fastzoo, CPU, m) {
  m.impl("giou_loss_fwd", giou_loss_fwd_cpu);
  m.impl("giou_loss_bwd", giou_loss_bwd_cpu);
  m.impl("giou_loss_masked", giou_loss_masked_cpu);
  m.impl("giou_loss_masked_bwd", giou_loss_masked_bwd_cpu);
  m.impl("first_bad_box", first_bad_box_cpu);
  m.impl("giou_valid_rows", valid_from_target);
}

TORCH_LIBRARY_IMPL(fastzoo, AutogradCPU, m) {
  m.impl("giou_loss_fwd", giou_loss_fwd_autograd);
  m.impl("giou_loss_masked", giou_loss_masked_autograd);
}
