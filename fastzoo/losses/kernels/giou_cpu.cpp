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
//
// Speed: the loops run on the calling thread (the extension is built without OpenMP, so
// at::parallel_for would too): a detection batch is a few thousand real pairs, microseconds of
// work, less than waking a thread pool. Boxes go through the math kLanes at a time, one array per
// coordinate (Lanes) and branch-free (every lane computes every value, then selects; built with
// -fno-trapping-math so that a division under a select may too), so that the compiler computes a
// block in a few vector instructions; the block functions are
// compiled for AVX-512, AVX2 and baseline x86-64 and the loader picks one per machine
// (target_clones). Every lane computes the scalar formula's operations in the same order, and
// -ffp-contract=off keeps multiplies and adds apart, so every instruction set gives the same
// bits. A padded block with no real pair is skipped (its mask read as two words); padding inside
// a block is computed and discarded. Outputs are written whole, padding included, in one pass.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#if defined(__GNUC__)
#define FZ_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define FZ_ALWAYS_INLINE inline
#endif
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define FZ_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef FZ_SIMD_CLONES
#define FZ_SIMD_CLONES
#endif

namespace {

enum Reduction : int64_t { kNone = 0, kSum = 1, kMean = 2 };
constexpr int kLanes = 16;  // boxes per block: one AVX-512 register of fp32 per coordinate

template <typename T>
FZ_ALWAYS_INLINE T tie(T a, T b) {  // d max(a, b) / da under autograd's rule: 1, 1/2 at a tie, 0
  return T(a > b) + T(0.5) * T(a == b);  // branch-free: exactly 1, 0.5 or 0
}

template <typename acc_t>
struct Box {
  acc_t x1, y1, x2, y2;
};

template <typename acc_t>
FZ_ALWAYS_INLINE acc_t giou_loss_one(const Box<acc_t>& a, const Box<acc_t>& b, acc_t e) {
  const acc_t iw = std::min(a.x2, b.x2) - std::max(a.x1, b.x1);
  const acc_t ih = std::min(a.y2, b.y2) - std::max(a.y1, b.y1);
  const acc_t iwh = iw * ih;  // computed in every lane, then selected: no branch in the block loops
  const acc_t inter = ((iw > 0) & (ih > 0)) ? iwh : acc_t(0);
  const acc_t uni = (a.x2 - a.x1) * (a.y2 - a.y1) + (b.x2 - b.x1) * (b.y2 - b.y1) - inter;
  const acc_t area_c = (std::max(a.x2, b.x2) - std::min(a.x1, b.x1)) * (std::max(a.y2, b.y2) - std::min(a.y1, b.y1));
  return acc_t(1) - (inter / (uni + e) - (area_c - uni) / (area_c + e));
}

// Gradients of g * loss(a, b) with respect to a's and b's four coordinates.
template <typename acc_t>
FZ_ALWAYS_INLINE void giou_grad_one(const Box<acc_t>& a, const Box<acc_t>& b, acc_t g, acc_t e, Box<acc_t>& ga,
                                    Box<acc_t>& gb) {
  const acc_t w1 = a.x2 - a.x1, h1 = a.y2 - a.y1, w2 = b.x2 - b.x1, h2 = b.y2 - b.y1;
  const acc_t iw = std::min(a.x2, b.x2) - std::max(a.x1, b.x1);
  const acc_t ih = std::min(a.y2, b.y2) - std::max(a.y1, b.y1);
  const bool overlap = (iw > 0) & (ih > 0);  // touching boxes: no intersection, no gradient
  const acc_t iwh = iw * ih;  // computed in every lane, then selected: no branch in the block loops
  const acc_t inter = overlap ? iwh : acc_t(0);
  const acc_t uni = w1 * h1 + w2 * h2 - inter;
  const acc_t cw = std::max(a.x2, b.x2) - std::min(a.x1, b.x1);
  const acc_t ch = std::max(a.y2, b.y2) - std::min(a.y1, b.y1);
  const acc_t u = uni + e, c = cw * ch + e;
  const acc_t g_union = g * inter / (u * u) - g / c;
  const acc_t g_inter_if = -g / u - g_union;
  const acc_t g_inter = overlap ? g_inter_if : acc_t(0);
  const acc_t g_area_c = g * (uni + e) / (c * c);
  const acc_t g_iw = g_inter * ih, g_ih = g_inter * iw;
  const acc_t g_cw = g_area_c * ch, g_ch = g_area_c * cw;
  // share of max(x1, x1g) going to x1, of min(x2, x2g) going to x2; same in y
  const acc_t tx1 = tie(a.x1, b.x1), ty1 = tie(a.y1, b.y1), tx2 = tie(b.x2, a.x2), ty2 = tie(b.y2, a.y2);
  ga.x1 = -g_iw * tx1 - g_cw * (1 - tx1) - g_union * h1;
  ga.y1 = -g_ih * ty1 - g_ch * (1 - ty1) - g_union * w1;
  ga.x2 = g_iw * tx2 + g_cw * (1 - tx2) + g_union * h1;
  ga.y2 = g_ih * ty2 + g_ch * (1 - ty2) + g_union * w1;
  gb.x1 = -g_iw * (1 - tx1) - g_cw * tx1 - g_union * h2;
  gb.y1 = -g_ih * (1 - ty1) - g_ch * ty1 - g_union * w2;
  gb.x2 = g_iw * (1 - tx2) + g_cw * tx2 + g_union * h2;
  gb.y2 = g_ih * (1 - ty2) + g_ch * ty2 + g_union * w2;
}

// A block's kLanes boxes coordinate by coordinate (x1 of every box, then y1, ...): the layout in
// which each operation of the math is one vector instruction over the block. load / store
// transpose from and to the [kLanes, 4] rows of the tensors.
template <typename acc_t>
struct Lanes {
  acc_t x1[kLanes], y1[kLanes], x2[kLanes], y2[kLanes];
  FZ_ALWAYS_INLINE void load(const acc_t* __restrict p_K4) {
    for (int k = 0; k < kLanes; ++k) x1[k] = p_K4[4 * k], y1[k] = p_K4[4 * k + 1], x2[k] = p_K4[4 * k + 2], y2[k] = p_K4[4 * k + 3];
  }
  FZ_ALWAYS_INLINE void store(acc_t* __restrict p_K4) const {
    for (int k = 0; k < kLanes; ++k) p_K4[4 * k] = x1[k], p_K4[4 * k + 1] = y1[k], p_K4[4 * k + 2] = x2[k], p_K4[4 * k + 3] = y2[k];
  }
  FZ_ALWAYS_INLINE Box<acc_t> box(int k) const { return {x1[k], y1[k], x2[k], y2[k]}; }
  FZ_ALWAYS_INLINE void set(int k, bool on, const Box<acc_t>& d) {  // d, or 0 where the lane is padding
    x1[k] = on ? d.x1 : acc_t(0), y1[k] = on ? d.y1 : acc_t(0), x2[k] = on ? d.x2 : acc_t(0), y2[k] = on ? d.y2 : acc_t(0);
  }
};

// keep_K as 1 / 0 in the compute dtype: a lane select the vectoriser takes (a bool load it does not)
template <typename acc_t>
FZ_ALWAYS_INLINE void lanes_on(const bool* __restrict keep_K, acc_t* __restrict on_K) {
  for (int k = 0; k < kLanes; ++k) on_K[k] = keep_K[k] ? acc_t(1) : acc_t(0);
}

// The block functions, one compiled copy per instruction set (FZ_SIMD_CLONES); overloads for the
// two compute dtypes, as a function template cannot carry target_clones. A block is kLanes boxes
// [kLanes, 4] (a_K4, b_K4) in the compute dtype; keep_K says which are real pairs: the others
// get loss 0 and gradient 0, whatever they hold.
#define FZ_BLOCK_FUNCTIONS(acc_t)                                                                              \
  FZ_SIMD_CLONES void loss_block(const acc_t* __restrict a_K4, const acc_t* __restrict b_K4,                   \
                                 const bool* __restrict keep_K, acc_t e, acc_t* __restrict loss_K) {           \
    Lanes<acc_t> a, b;                                                                                         \
    acc_t on_K[kLanes];                                                                                        \
    a.load(a_K4), b.load(b_K4), lanes_on(keep_K, on_K);                                                        \
    for (int k = 0; k < kLanes; ++k) {                                                                         \
      const acc_t loss = giou_loss_one(a.box(k), b.box(k), e);                                                 \
      loss_K[k] = on_K[k] != acc_t(0) ? loss : acc_t(0);                                                       \
    }                                                                                                          \
  }                                                                                                            \
  FZ_SIMD_CLONES void grad_block(const acc_t* __restrict a_K4, const acc_t* __restrict b_K4,                   \
                                 const bool* __restrict keep_K, const acc_t* __restrict g_K, acc_t e,          \
                                 acc_t* __restrict ga_K4, acc_t* __restrict gb_K4) {                           \
    Lanes<acc_t> a, b, ga, gb;                                                                                 \
    acc_t on_K[kLanes];                                                                                        \
    a.load(a_K4), b.load(b_K4), lanes_on(keep_K, on_K);                                                        \
    for (int k = 0; k < kLanes; ++k) {                                                                         \
      Box<acc_t> da, db;                                                                                       \
      giou_grad_one(a.box(k), b.box(k), g_K[k], e, da, db);                                                   \
      const bool on = on_K[k] != acc_t(0);                                                                     \
      ga.set(k, on, da), gb.set(k, on, db);                                                                    \
    }                                                                                                          \
    ga.store(ga_K4), gb.store(gb_K4);                                                                          \
  }
FZ_BLOCK_FUNCTIONS(float)
FZ_BLOCK_FUNCTIONS(double)
#undef FZ_BLOCK_FUNCTIONS

// Boxes [i, i + count) of an [N, 4] array as one block in the compute dtype: the array itself
// where it already is one (a full block in that dtype), else converted into buf, the lanes past
// count holding the unit box.
template <typename acc_t, typename scalar_t>
FZ_ALWAYS_INLINE const acc_t* block_of(const scalar_t* p, int count, acc_t* buf) {
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    if (count == kLanes) return p;
  }
  for (int j = 0; j < 4 * count; ++j) buf[j] = static_cast<acc_t>(p[j]);
  for (int k = count; k < kLanes; ++k) buf[4 * k] = buf[4 * k + 1] = acc_t(0), buf[4 * k + 2] = buf[4 * k + 3] = acc_t(1);
  return buf;
}

// A block's gradient into an [N, 4] array: written in place where it is a full block in the
// compute dtype, else into buf and copied (converted) from there once computed.
template <typename acc_t, typename scalar_t>
struct GradOut {
  scalar_t* dst;  // nullptr: not asked for
  int count;
  acc_t buf[4 * kLanes];
  bool in_place() const {
    if constexpr (std::is_same_v<acc_t, scalar_t>) return count == kLanes;
    return false;
  }
  acc_t* target() {
    if constexpr (std::is_same_v<acc_t, scalar_t>) {
      if (in_place()) return dst;
    }
    return buf;
  }
  void finish() {
    if (in_place()) return;
    for (int j = 0; j < 4 * count; ++j) dst[j] = static_cast<scalar_t>(buf[j]);
  }
};

constexpr bool kAllReal[kLanes] = {true, true, true, true, true, true, true, true,
                                   true, true, true, true, true, true, true, true};

// Whether any of m[0, kLanes) is set, eight bytes at a time: padded batches are mostly padding.
inline bool any_set(const bool* m) {
  uint64_t lo, hi;
  std::memcpy(&lo, m, 8);
  std::memcpy(&hi, m + 8, 8);
  return (lo | hi) != 0;
}

// Calls block(i, count, keep) for each block [i, i + count) of kLanes slots (count < kLanes only
// for the last) holding at least one real pair, keep = which of them are (m == nullptr: all),
// and padding(i, count) once for each run of blocks with none.
template <typename Block, typename Padding>
inline void for_each_block(int64_t n, const bool* m, Block&& block, Padding&& padding) {
  int64_t run = 0;  // start of the current run of padding
  int64_t i = 0;
  for (; i < n; i += kLanes) {
    const int count = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    bool keep_tail[kLanes] = {};
    const bool* keep = m == nullptr ? kAllReal : m + i;
    if (m != nullptr && count < kLanes) {
      std::copy(m + i, m + n, keep_tail);
      keep = keep_tail;
    }
    if (m != nullptr && !any_set(keep)) continue;
    if (run < i) padding(run, i - run);
    block(i, count, keep);
    run = i + count;
  }
  if (run < n) padding(run, n - run);
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

// The loss of every pair (mask == nullptr) or of the real ones, block by block. Reduction kNone
// writes out[N] (0 in padding); kSum / kMean return (sum in fp64, count of real pairs), the pairs
// added in slot order.
template <typename P, typename T, typename A>
std::pair<double, int64_t> loss_pass(const P* p, const T* t, const bool* m, int64_t n, A e, A* out) {
  double sum = 0.0;
  int64_t count = 0;
  for_each_block(
      n, m,
      [&](int64_t i, int k_end, const bool* keep) {
        A a_buf[4 * kLanes], b_buf[4 * kLanes], loss[kLanes];
        loss_block(block_of(p + 4 * i, k_end, a_buf), block_of(t + 4 * i, k_end, b_buf), keep, e, loss);
        if (out != nullptr) {
          std::copy(loss, loss + k_end, out + i);
          return;
        }
        // padding's loss is +0.0: adding it leaves the fp64 sum as the real pairs alone make it
        for (int k = 0; k < k_end; ++k) sum += static_cast<double>(loss[k]);
        for (int k = 0; k < k_end; ++k) count += keep[k];
      },
      [&](int64_t i, int64_t len) {
        if (out != nullptr) std::fill(out + i, out + i + len, A(0));
      });
  return {sum, count};
}

// Gradients of sum_i g_i * loss_i for every pair, written whole: 0 in padding, so the outputs
// need no zero-fill first. g is g_all for every pair, or g_per[i]; gp / gt may be nullptr.
template <typename P, typename T, typename A>
void grad_pass(const P* p, const T* t, const bool* m, int64_t n, const A* g_per, A g_all, A e, P* gp, T* gt) {
  for_each_block(
      n, m,
      [&](int64_t i, int k_end, const bool* keep) {
        A a_buf[4 * kLanes], b_buf[4 * kLanes], g[kLanes], unused_a[4 * kLanes], unused_b[4 * kLanes];
        for (int k = 0; k < kLanes; ++k) g[k] = g_per == nullptr ? g_all : (k < k_end ? g_per[i + k] : A(0));
        GradOut<A, P> ga{gp == nullptr ? nullptr : gp + 4 * i, k_end};
        GradOut<A, T> gb{gt == nullptr ? nullptr : gt + 4 * i, k_end};
        A* ga_to = gp == nullptr ? unused_a : ga.target();
        A* gb_to = gt == nullptr ? unused_b : gb.target();
        grad_block(block_of(p + 4 * i, k_end, a_buf), block_of(t + 4 * i, k_end, b_buf), keep, g, e, ga_to,
                   gb_to);
        if (gp != nullptr) ga.finish();
        if (gt != nullptr) gb.finish();
      },
      [&](int64_t i, int64_t len) {
        if (gp != nullptr) std::fill(gp + 4 * i, gp + 4 * (i + len), P(0));
        if (gt != nullptr) std::fill(gt + 4 * i, gt + 4 * (i + len), T(0));
      });
}

// -- elementwise [N, 4] ---------------------------------------------------------------------
at::Tensor giou_loss_fwd_cpu(const at::Tensor& pred_in, const at::Tensor& target_in, double eps) {
  check_pair(pred_in, target_in, "giou_loss");
  const at::Tensor pred = pred_in.contiguous(), target = target_in.contiguous();
  const int64_t n = pred.numel() / 4;
  at::Tensor loss = at::empty(pred.sizes().slice(0, pred.dim() - 1), pred.options().dtype(compute_type(pred, target)));
  dispatch_pair(pred, target, [&]<typename P, typename T, typename A>() {
    loss_pass(pred.const_data_ptr<P>(), target.const_data_ptr<T>(), nullptr, n, static_cast<A>(eps),
              loss.mutable_data_ptr<A>());
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
    grad_pass(pred.const_data_ptr<P>(), target.const_data_ptr<T>(), nullptr, n, grad.const_data_ptr<A>(), A(0),
              static_cast<A>(eps), grad_pred.mutable_data_ptr<P>(), grad_target.mutable_data_ptr<T>());
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
// branch-free pass over the target into a bool [...] mask, so that both directions then read
// 1 byte per slot instead of a 16-byte box.
at::Tensor valid_from_target(const at::Tensor& target_in) {
  const at::Tensor target = target_in.contiguous();
  const int64_t n = target.numel() / 4;
  at::Tensor valid = at::empty(target.sizes().slice(0, target.dim() - 1), target.options().dtype(at::kBool));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target.scalar_type(), "giou valid_from_target", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* t = target.const_data_ptr<scalar_t>();
    bool* v = valid.mutable_data_ptr<bool>();
    for (int64_t i = 0; i < n; ++i) {  // not inverted (x2 < x1 or y2 < y1); NaN is not padding
      const acc_t x1 = t[4 * i], y1 = t[4 * i + 1], x2 = t[4 * i + 2], y2 = t[4 * i + 3];
      v[i] = !(x2 < x1) & !(y2 < y1);
    }
  });
  return valid;
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
    const auto [sum, count] = loss_pass(pred.const_data_ptr<P>(), target.const_data_ptr<T>(), valid.const_data_ptr<bool>(),
                                        n, static_cast<A>(eps), reduction == kNone ? out.mutable_data_ptr<A>() : nullptr);
    if (reduction == kNone) return;
    // mean over no pairs is 0, as torchvision's mean of an empty loss
    const double value = reduction == kSum ? sum : (count ? sum / count : 0.0);
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
  // every slot is written (0 in padding): no zero-fill first
  at::Tensor grad_pred = need_pred ? at::empty_like(pred) : at::empty({0}, pred.options());
  at::Tensor grad_target = need_target ? at::empty_like(target) : at::empty({0}, target.options());
  // no pairs: nothing to write, and grad may hold no element to read (nor memory behind its pointer)
  if ((!need_pred && !need_target) || n == 0) return {grad_pred, grad_target};
  dispatch_pair(pred, target, [&]<typename P, typename T, typename A>() {
    const bool* m = valid.const_data_ptr<bool>();
    const A* go = grad.const_data_ptr<A>();
    A scale = go[0];
    if (reduction == kMean) {
      int64_t count = 0;
      for (int64_t i = 0; i < n; ++i) count += m[i];
      scale = count ? static_cast<A>(static_cast<double>(go[0]) / count) : A(0);
    }
    grad_pass(pred.const_data_ptr<P>(), target.const_data_ptr<T>(), m, n, reduction == kNone ? go : nullptr, scale,
              static_cast<A>(eps), need_pred ? grad_pred.mutable_data_ptr<P>() : nullptr,
              need_target ? grad_target.mutable_data_ptr<T>() : nullptr);
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
