// Fused GIoU loss on CPU: one loop for the forward, one for the hand-written backward, and the
// box check of fastzoo.losses.giou.first_bad_box in one pass. Built on first use by
// giou_cpu.py (torch.utils.cpp_extension) and registered as the CPU kernels of the
// torch.library ops defined in giou_op.py; the math is giou_op.py's closed form, element by
// element, in torchvision's op order (fp16/bf16 boxes computed in fp32, fp64 in fp64).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>

namespace {

// Below this many boxes one thread does the whole loop (thread start-up costs more).
constexpr int64_t kGrain = 16384;

template <typename T>
inline T tie(T a, T b) {  // d max(a, b) / da under autograd's rule: 1, 1/2 at a tie, 0
  return a > b ? T(1) : (a == b ? T(0.5) : T(0));
}

void check_inputs(const at::Tensor& pred, const at::Tensor& target) {
  TORCH_CHECK(pred.dim() == 2 && pred.size(1) == 4 && pred.sizes() == target.sizes(),
              "giou_loss: pred and target must both be [N, 4], got ", pred.sizes(), " and ", target.sizes());
  TORCH_CHECK(pred.scalar_type() == target.scalar_type(), "giou_loss: pred is ", pred.scalar_type(),
              " but target is ", target.scalar_type());
}

at::Tensor giou_loss_fwd_cpu(const at::Tensor& pred_in, const at::Tensor& target_in, double eps) {
  check_inputs(pred_in, target_in);
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  const int64_t n = pred.size(0);
  const auto out_type = pred.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor loss = at::empty({n}, pred.options().dtype(out_type));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pred.scalar_type(), "giou_loss_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* p = pred.const_data_ptr<scalar_t>();
    const scalar_t* t = target.const_data_ptr<scalar_t>();
    acc_t* out = loss.mutable_data_ptr<acc_t>();
    const acc_t e = static_cast<acc_t>(eps);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const acc_t x1 = p[4 * i], y1 = p[4 * i + 1], x2 = p[4 * i + 2], y2 = p[4 * i + 3];
        const acc_t x1g = t[4 * i], y1g = t[4 * i + 1], x2g = t[4 * i + 2], y2g = t[4 * i + 3];
        const acc_t iw = std::min(x2, x2g) - std::max(x1, x1g);
        const acc_t ih = std::min(y2, y2g) - std::max(y1, y1g);
        const acc_t inter = (iw > 0 && ih > 0) ? iw * ih : acc_t(0);
        const acc_t uni = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter;
        const acc_t area_c = (std::max(x2, x2g) - std::min(x1, x1g)) * (std::max(y2, y2g) - std::min(y1, y1g));
        out[i] = acc_t(1) - (inter / (uni + e) - (area_c - uni) / (area_c + e));
      }
    });
  });
  return loss;
}

std::tuple<at::Tensor, at::Tensor> giou_loss_bwd_cpu(const at::Tensor& grad_in, const at::Tensor& pred_in,
                                                     const at::Tensor& target_in, double eps) {
  check_inputs(pred_in, target_in);
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  const int64_t n = pred.size(0);
  TORCH_CHECK(grad_in.numel() == n, "giou_loss_bwd: grad has ", grad_in.numel(), " elements for ", n, " boxes");
  const auto acc_type = pred.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor grad = grad_in.to(acc_type).contiguous();
  at::Tensor grad_pred = at::empty_like(pred), grad_target = at::empty_like(target);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pred.scalar_type(), "giou_loss_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* p = pred.const_data_ptr<scalar_t>();
    const scalar_t* t = target.const_data_ptr<scalar_t>();
    const acc_t* go = grad.const_data_ptr<acc_t>();
    scalar_t* gp = grad_pred.mutable_data_ptr<scalar_t>();
    scalar_t* gt = grad_target.mutable_data_ptr<scalar_t>();
    const acc_t e = static_cast<acc_t>(eps);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const acc_t x1 = p[4 * i], y1 = p[4 * i + 1], x2 = p[4 * i + 2], y2 = p[4 * i + 3];
        const acc_t x1g = t[4 * i], y1g = t[4 * i + 1], x2g = t[4 * i + 2], y2g = t[4 * i + 3];
        const acc_t g = go[i];
        const acc_t w1 = x2 - x1, h1 = y2 - y1, w2 = x2g - x1g, h2 = y2g - y1g;
        const acc_t iw = std::min(x2, x2g) - std::max(x1, x1g);
        const acc_t ih = std::min(y2, y2g) - std::max(y1, y1g);
        const bool overlap = iw > 0 && ih > 0;  // touching boxes: no intersection, no gradient
        const acc_t inter = overlap ? iw * ih : acc_t(0);
        const acc_t uni = w1 * h1 + w2 * h2 - inter;
        const acc_t cw = std::max(x2, x2g) - std::min(x1, x1g);
        const acc_t ch = std::max(y2, y2g) - std::min(y1, y1g);
        const acc_t u = uni + e, c = cw * ch + e;
        const acc_t g_union = g * inter / (u * u) - g / c;
        const acc_t g_inter = overlap ? -g / u - g_union : acc_t(0);
        const acc_t g_area_c = g * (uni + e) / (c * c);
        const acc_t g_iw = g_inter * ih, g_ih = g_inter * iw;
        const acc_t g_cw = g_area_c * ch, g_ch = g_area_c * cw;
        // share of max(x1, x1g) going to x1, of min(x2, x2g) going to x2; same in y
        const acc_t tx1 = tie(x1, x1g), ty1 = tie(y1, y1g), tx2 = tie(x2g, x2), ty2 = tie(y2g, y2);
        gp[4 * i] = -g_iw * tx1 - g_cw * (1 - tx1) - g_union * h1;
        gp[4 * i + 1] = -g_ih * ty1 - g_ch * (1 - ty1) - g_union * w1;
        gp[4 * i + 2] = g_iw * tx2 + g_cw * (1 - tx2) + g_union * h1;
        gp[4 * i + 3] = g_ih * ty2 + g_ch * (1 - ty2) + g_union * w1;
        gt[4 * i] = -g_iw * (1 - tx1) - g_cw * tx1 - g_union * h2;
        gt[4 * i + 1] = -g_ih * (1 - ty1) - g_ch * ty1 - g_union * w2;
        gt[4 * i + 2] = g_iw * (1 - tx2) + g_cw * tx2 + g_union * h2;
        gt[4 * i + 3] = g_ih * (1 - ty2) + g_ch * ty2 + g_union * w2;
      }
    });
  });
  return {grad_pred, grad_target};
}

// The autograd rule in C++ (as torchvision does for its C++ ops), so an eager CPU call is one
// dispatcher call with no Python in between; CUDA and the vectorised fallback keep the Python
// rule of giou_op.py (register_autograd), and torch.compile traces either one.
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
    return {grad_pred, grad_target, at::Tensor()};
  }
};

at::Tensor giou_loss_fwd_autograd(const at::Tensor& pred, const at::Tensor& target, double eps) {
  return GiouLossFunction::apply(pred, target, eps);
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
  m.impl("first_bad_box", first_bad_box_cpu);
}

TORCH_LIBRARY_IMPL(fastzoo, AutogradCPU, m) {
  m.impl("giou_loss_fwd", giou_loss_fwd_autograd);
}
