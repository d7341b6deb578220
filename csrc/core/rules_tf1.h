// tfclip core: the update rules of TF1's own training ops that no Keras optimizer has
// (tf.compat.v1.train: RMSPropOptimizer's kernel order, the proximal optimizers, AdagradDA), each
// a per-element TFCLIP_HD body as in csrc/core/rules.h, whose RuleBase, StepBase and
// conventions they share. Their rows are in csrc/core/rule_table.h.
//   TfRmsPropRule      ResourceApplyRMSProp / ResourceApplyCenteredRMSProp
//   ProximalSgdRule    ResourceApplyProximalGradientDescent
//   ProximalAdagradRule  ResourceApplyProximalAdagrad
//   AdagradDaRule      ResourceApplyAdagradDA
#pragma once

#include <cmath>

#include "csrc/core/rules.h"

namespace tfclip {

struct TfRmsPropRule : RuleBase {
  // TF's ResourceApplyRMSProp / ResourceApplyCenteredRMSProp (tf.compat.v1 RMSPropOptimizer),
  // in the kernel's own order, which rounds differently from keras's (with a small epsilon the
  // centered denominator ms - mg^2 cancels, so the order shows): ms += (g^2 - ms)(1 - rho);
  // [mg += (g - mg)(1 - rho); den = ms - mg^2 + eps, else den = ms + eps];
  // mom = mom*momentum + g*lr/sqrt(den); var -= mom. Slots: rms, mom (the TF1 slot `momentum`;
  // that name is the hyper-parameter input), mg (centered).
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 3;
  static constexpr unsigned kUnsignedSlots = 0b001u;
  static TFCLIP_HD int NumSlots(const HParams& hp) { return hp.centered ? 3 : 2; }
  template <typename M>
  struct Consts : StepBase<M> {
    M rho, momentum, epsilon;
    bool centered;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    c.momentum = static_cast<M>(hp.momentum);
    c.epsilon = static_cast<M>(hp.epsilon);
    c.rho = static_cast<M>(hp.rho);
    c.centered = hp.centered;
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
    const M one_minus_rho = M(1) - c.rho;
    const M ms = s[0] + (gsq - s[0]) * one_minus_rho;
    s[0] = ms;
    M den;
    if (c.centered) {
      const M mg = s[2] + (g - s[2]) * one_minus_rho;
      s[2] = mg;
      den = (ms - mg * mg) + c.epsilon;
    } else {
      den = ms + c.epsilon;
    }
    const M mom = s[1] * c.momentum + (g * c.lr) / std::sqrt(den);
    s[1] = mom;
    var = var - mom;
  }
};

// The l1 shrinkage of TF's proximal kernels, sign(x) * max(|x| - k, 0), with their NaN: a NaN x
// (or k) stays NaN, as Eigen's sign(NaN) * max(NaN, 0) does.
template <typename M>
TFCLIP_HD M Shrink(M x, M k) {
  const M sign = x > M(0) ? M(1) : (x < M(0) ? M(-1) : M(0));
  const M a = (x < M(0) ? -x : x) - k;
  return sign * (a != a || a > M(0) ? a : M(0));
}

// TF1's ProximalGradientDescentOptimizer (ResourceApplyProximalGradientDescent, FOBOS):
// p = var - g*lr; var = [l1 > 0: sign(p) * max(|p| - lr*l1, 0), else p] / (1 + l2*lr).
// IndexedSlices: the touched rows, a row's duplicates summed first (TF1's optimizer sums them
// before its sparse kernel runs; its loop over the slices then meets each row once).
struct ProximalSgdRule : RuleBase {
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 0, kMaxSlots = 0;
  static TFCLIP_HD int NumSlots(const HParams&) { return 0; }
  template <typename M>
  struct Consts : StepBase<M> {
    M lr_l1, one_plus_l2_lr;  // as TF's kernel, in the dtype: lr*l1, 1 + l2*lr
    bool l1_on;               // l1 > 0: the kernel's branch to the l1 shrinkage
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    const M l1 = static_cast<M>(hp.l1);
    const M l2 = static_cast<M>(hp.l2);
    c.lr_l1 = c.lr * l1;
    c.one_plus_l2_lr = M(1) + l2 * c.lr;
    c.l1_on = l1 > M(0);
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M /*gsq*/, M& var, M* /*slots*/) {
    const M p = var - g * c.lr;
    var = (c.l1_on ? Shrink(p, c.lr_l1) : p) / c.one_plus_l2_lr;
  }
};

// TF1's ProximalAdagradOptimizer (ResourceApplyProximalAdagrad): accum += g^2;
// a = lr * rsqrt(accum); p = var - g*a; var = [l1 > 0: sign(p) * max(|p| - a*l1, 0), else p]
// / (1 + l2*a). Slot: accumulator. IndexedSlices: as ProximalSgdRule.
struct ProximalAdagradRule : RuleBase {
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 1;
  static constexpr unsigned kUnsignedSlots = 0b1u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 1; }
  template <typename M>
  struct Consts : StepBase<M> {
    M l1, l2;
    bool l1_on;  // l1 > 0: the kernel's branch to the l1 shrinkage
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    c.l1 = static_cast<M>(hp.l1);
    c.l2 = static_cast<M>(hp.l2);
    c.l1_on = c.l1 > M(0);
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
    const M accum = s[0] + gsq;
    s[0] = accum;
    const M a = c.lr * (M(1) / std::sqrt(accum));
    const M p = var - g * a;
    var = (c.l1_on ? Shrink(p, a * c.l1) : p) / (M(1) + c.l2 * a);
  }
};

// TF1's AdagradDAOptimizer (ResourceApplyAdagradDA, dual averaging): ga += g; gga += g^2;
// var = -lr * [l1 > 0: sign(ga) * max(|ga| - t*l1, 0), else ga] / (l2*(t*lr) + sqrt(gga)), t the
// global step the op is given. The variable is recomputed from the slots, not stepped. Slots:
// gradient_accumulator, gradient_squared_accumulator. IndexedSlices: as ProximalSgdRule.
struct AdagradDaRule : RuleBase {
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static constexpr unsigned kUnsignedSlots = 0b10u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 2; }
  template <typename M>
  struct Consts : StepBase<M> {
    // The global step t as TF's kernel has it (its static_cast<float>, then the dtype): t*l1,
    // l2*(t*lr).
    M da_t_l1, da_l2_t_lr;
    bool l1_on;  // l1 > 0: the kernel's branch to the l1 shrinkage
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    const M l1 = static_cast<M>(hp.l1);
    const M l2 = static_cast<M>(hp.l2);
    const M da_t = static_cast<M>(static_cast<float>(hp.global_step));
    c.da_t_l1 = da_t * l1;
    c.da_l2_t_lr = l2 * (da_t * c.lr);
    c.l1_on = l1 > M(0);
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
    const M ga = s[0] + g;
    const M gga = s[1] + gsq;
    s[0] = ga;
    s[1] = gga;
    const M den = c.da_l2_t_lr + std::sqrt(gga);
    // TF's order: (lr * -1) * sign(ga) * max(..) / den, and (lr * ga) * -1 / den.
    var = c.l1_on ? (-c.lr * Shrink(ga, c.da_t_l1)) / den : -(c.lr * ga) / den;
  }
};

}  // namespace tfclip
