// tfclip core: the optimizer update rules, each written once as a per-element TFCLIP_HD body.
// Every pass (dense, sparse rows, CPU and CUDA) calls them through one per-element apply
// (csrc/core/apply_elem.h); each rule's op, inputs and Python name are one row of
// csrc/core/rule_table.h. No rule is written twice. Math is in float for half/bfloat16/float storage and double for double.
//
// Each rule mirrors TensorFlow's own training op / Keras 3 optimizer, operation for operation,
// so results agree to the last bit or two with the stock path. Update(c, g, gsq, var, slots)
// takes the gradient and "its square": g*g for a dense gradient; for a row of an IndexedSlices
// gradient with duplicate indices, g is the sum of the duplicates and gsq g*g or, with
// HParams::sum_of_squares, the sum of their squares (csrc/core/sparse.h). A rule with kScatter
// is instead applied once per duplicate, in order, as TF's scatter ops do.
//   SgdRule            ResourceApplyGradientDescent / keras SGD(momentum=0)
//   MomentumRule       ResourceApplyMomentum (tf.compat.v1.train.MomentumOptimizer)
//   KerasMomentumRule  ResourceApplyKerasMomentum / keras SGD(momentum>0)
//   AdamRule           ResourceApplyAdam / keras Adam, AdamW (decoupled weight decay), amsgrad
#pragma once

#include <cmath>

#include "csrc/core/hparams.h"
#include "csrc/core/types.h"

namespace tfclip {

constexpr int kMaxSlots = 3;  // Adam with amsgrad: m, v, vhat

// Per-step constants in the math type M, computed as Keras computes them (in the variable's
// dtype): alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t).
template <typename M>
struct StepConsts {
  M lr, momentum, one_minus_beta_1, one_minus_beta_2, epsilon, alpha;
  M weight_decay;
  M beta_1, beta_2;                  // in M (Lion, Adamax)
  M one_minus_beta_1_m, one_minus_beta_2_m;  // M(1) - M(beta): Lion's, computed in the dtype
  M one_minus_beta_1_power;          // 1 - beta_1^t (Adamax)
  M rho, one_minus_rho;              // RMSprop, Adadelta
  bool nesterov, amsgrad, decay, sum_of_squares, centered, has_momentum;
};

template <typename M>
TFCLIP_HD StepConsts<M> MakeStepConsts(const HParams& hp) {
  StepConsts<M> c;
  c.lr = static_cast<M>(hp.lr);
  c.momentum = static_cast<M>(hp.momentum);
  const M b1 = static_cast<M>(hp.beta_1), b2 = static_cast<M>(hp.beta_2);
  // Keras multiplies by the Python float `1 - beta`, rounded once to M; (M(1) - M(beta)) would
  // differ by an ulp (0.1f vs 0.100000024f for beta 0.9) and drift over many steps.
  c.one_minus_beta_1 = static_cast<M>(1.0 - hp.beta_1);
  c.one_minus_beta_2 = static_cast<M>(1.0 - hp.beta_2);
  c.epsilon = static_cast<M>(hp.epsilon);
  const M t = static_cast<M>(hp.step);
  // A beta power given as it is (TF1's accumulators), else beta^t.
  const M b1p = hp.beta_1_power == hp.beta_1_power ? static_cast<M>(hp.beta_1_power) : std::pow(b1, t);
  const M b2p = hp.beta_2_power == hp.beta_2_power ? static_cast<M>(hp.beta_2_power) : std::pow(b2, t);
  c.alpha = c.lr * std::sqrt(M(1) - b2p) / (M(1) - b1p);
  c.beta_1 = b1;
  c.beta_2 = b2;
  c.one_minus_beta_1_m = M(1) - b1;
  c.one_minus_beta_2_m = M(1) - b2;
  c.one_minus_beta_1_power = M(1) - b1p;
  c.rho = static_cast<M>(hp.rho);
  c.one_minus_rho = static_cast<M>(1.0 - hp.rho);
  c.weight_decay = static_cast<M>(hp.weight_decay);
  c.decay = hp.weight_decay != 0.0;
  c.nesterov = hp.nesterov;
  c.amsgrad = hp.amsgrad;
  c.sum_of_squares = hp.sum_of_squares;
  c.centered = hp.centered;
  c.has_momentum = hp.has_momentum;
  return c;
}

// Keras applies decoupled weight decay as `var - var * wd * lr` before the rule.
template <typename M>
TFCLIP_HD M DecayVar(const StepConsts<M>& c, M var) {
  return c.decay ? var - var * c.weight_decay * c.lr : var;
}

// Each rule: kScatter (IndexedSlices duplicates applied one by one, as TF's scatter ops, rather
// than summed), kMinSlots..kMaxSlots and NumSlots(hp) (the slot count a step uses), Update.
struct SgdRule {
  static constexpr bool kScatter = true;  // keras SGD on IndexedSlices: scatter_sub(g * lr)
  static constexpr int kMinSlots = 0, kMaxSlots = 0;
  static TFCLIP_HD int NumSlots(const HParams&) { return 0; }
  template <typename M>
  static TFCLIP_HD void Update(const StepConsts<M>& c, M g, M /*gsq*/, M& var, M* /*slots*/) {
    var = var - g * c.lr;
  }
};

struct MomentumRule {
  // accum = accum * momentum + grad; var -= lr * accum  (nesterov: var -= grad*lr + accum*momentum*lr)
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 1;
  static TFCLIP_HD int NumSlots(const HParams&) { return 1; }
  template <typename M>
  static TFCLIP_HD void Update(const StepConsts<M>& c, M g, M /*gsq*/, M& var, M* s) {
    M accum = s[0] * c.momentum + g;
    s[0] = accum;
    if (c.nesterov) {
      var = var - (g * c.lr + accum * c.momentum * c.lr);
    } else {
      var = var - accum * c.lr;
    }
  }
};

struct KerasMomentumRule {
  // m = -grad*lr + m*momentum; var += m  (nesterov: var += -grad*lr + m*momentum)
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 1;
  static TFCLIP_HD int NumSlots(const HParams&) { return 1; }
  template <typename M>
  static TFCLIP_HD void Update(const StepConsts<M>& c, M g, M /*gsq*/, M& var, M* s) {
    const M neg_g_lr = -g * c.lr;
    const M m = neg_g_lr + s[0] * c.momentum;
    s[0] = m;
    var = c.nesterov ? var + (neg_g_lr + m * c.momentum) : var + m;
  }
};

struct AdamRule {
  // m += (g - m)(1 - b1); v += (gsq - v)(1 - b2); [vhat = max(vhat, v)]; var -= m*alpha/(sqrt(v)+eps)
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 3;
  static TFCLIP_HD int NumSlots(const HParams& hp) { return hp.amsgrad ? 3 : 2; }
  template <typename M>
  static TFCLIP_HD void Update(const StepConsts<M>& c, M g, M gsq, M& var, M* s) {
    const M m = s[0] + (g - s[0]) * c.one_minus_beta_1;
    M v = s[1] + (gsq - s[1]) * c.one_minus_beta_2;
    s[0] = m;
    s[1] = v;
    if (c.amsgrad) {
      const M vhat = s[2] > v ? s[2] : v;
      s[2] = vhat;
      v = vhat;
    }
    var = var - (m * c.alpha) / (std::sqrt(v) + c.epsilon);
  }
};

struct AdagradRule {
  // accum += g^2; var -= lr*g / sqrt(accum + eps)  (keras Adagrad; ResourceApplyAdagradV2)
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 1;
  static TFCLIP_HD int NumSlots(const HParams&) { return 1; }
  template <typename M>
  static TFCLIP_HD void Update(const StepConsts<M>& c, M g, M gsq, M& var, M* s) {
    const M accum = s[0] + gsq;
    s[0] = accum;
    var = var - (c.lr * g) / std::sqrt(accum + c.epsilon);
  }
};

struct RmsPropRule {
  // keras RMSprop: v = rho*v + (1-rho)*g^2; [centered: a = rho*a + (1-rho)*g; den = v - a^2 + eps,
  // else den = v + eps]; inc = lr*g / sqrt(den); [momentum: m = momentum*m + inc; var -= m,
  // else var -= inc]. Slots, in this order: velocity, momentum (has_momentum; the op input
  // momentum_slot, as `momentum` is the hyper-parameter), average_gradient (centered); the op's
  // inputs of the slots left out are empty.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 3;
  static TFCLIP_HD int NumSlots(const HParams& hp) {
    return 1 + (hp.has_momentum ? 1 : 0) + (hp.centered ? 1 : 0);
  }
  template <typename M>
  static TFCLIP_HD void Update(const StepConsts<M>& c, M g, M gsq, M& var, M* s) {
    const M v = c.rho * s[0] + c.one_minus_rho * gsq;
    s[0] = v;
    M den;
    if (c.centered) {
      M& avg = s[c.has_momentum ? 2 : 1];
      avg = c.rho * avg + c.one_minus_rho * g;
      den = (v - avg * avg) + c.epsilon;
    } else {
      den = v + c.epsilon;
    }
    const M inc = (c.lr * g) / std::sqrt(den);
    if (c.has_momentum) {
      const M m = c.momentum * s[1] + inc;
      s[1] = m;
      var = var - m;
    } else {
      var = var - inc;
    }
  }
};

struct AdadeltaRule {
  // keras Adadelta: ag = rho*ag + (1-rho)*g^2; d = -(sqrt(adv + eps)*g / sqrt(ag + eps));
  // adv = rho*adv + (1-rho)*d^2; var += lr*d. Slots: accumulated_grad, accumulated_delta_var.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static TFCLIP_HD int NumSlots(const HParams&) { return 2; }
  template <typename M>
  static TFCLIP_HD void Update(const StepConsts<M>& c, M g, M gsq, M& var, M* s) {
    const M ag = c.rho * s[0] + c.one_minus_rho * gsq;
    s[0] = ag;
    const M d = -((std::sqrt(s[1] + c.epsilon) * g) / std::sqrt(ag + c.epsilon));
    s[1] = c.rho * s[1] + c.one_minus_rho * (d * d);
    var = var + c.lr * d;
  }
};

struct AdamaxRule {
  // keras Adamax: m += (g - m)*(1 - b1); u = max(b2*u, |g|); var -= lr*m / ((1 - b1^t)*(u + eps)).
  // Slots: m, u.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static TFCLIP_HD int NumSlots(const HParams&) { return 2; }
  template <typename M>
  static TFCLIP_HD void Update(const StepConsts<M>& c, M g, M, M& var, M* s) {
    const M m = s[0] + (g - s[0]) * c.one_minus_beta_1;
    s[0] = m;
    const M bu = c.beta_2 * s[1];
    const M ag = g < M(0) ? -g : g;
    const M u = (bu != bu || bu > ag) ? bu : ag;  // max, NaN from either side, as tf.maximum
    s[1] = u;
    var = var - (c.lr * m) / (c.one_minus_beta_1_power * (u + c.epsilon));
  }
};

struct LionRule {
  // keras Lion: var -= lr * sign(m*b1 + g*(1 - b1)); m = m*b2 + g*(1 - b2), the 1 - b in the
  // variable's dtype. Slot: m.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 1;
  static TFCLIP_HD int NumSlots(const HParams&) { return 1; }
  template <typename M>
  static TFCLIP_HD void Update(const StepConsts<M>& c, M g, M, M& var, M* s) {
    const M x = s[0] * c.beta_1 + g * c.one_minus_beta_1_m;
    const M sign = x > M(0) ? M(1) : (x < M(0) ? M(-1) : (x != x ? x : M(0)));
    var = var - c.lr * sign;
    s[0] = s[0] * c.beta_2 + g * c.one_minus_beta_2_m;
  }
};

}  // namespace tfclip
