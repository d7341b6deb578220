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
//   AdagradRule, RmsPropRule, AdadeltaRule, AdamaxRule, LionRule, NadamRule, FtrlRule, LambRule: keras's
//                      optimizers of the same names (LambRule: a per-tensor trust ratio)
//   AdafactorRule      keras Adafactor (factored second moments: passes of its own, factored.h)
//   ScheduleFreeAdamWRule  keras ScheduleFreeAdamW (as it runs on the TensorFlow backend)
//   MuonMomentumRule, MuonUpdateRule  keras Muon's matrix step before and after its Newton–Schulz
//                      iterations (tfclip.keras.Muon)
// The rules of TF1's own training ops that no Keras optimizer has (TfRmsPropRule, ProximalSgdRule,
// ProximalAdagradRule, AdagradDaRule) are in csrc/core/rules_tf1.h.
#pragma once

#include <cmath>
#include <type_traits>

#include "csrc/core/hparams.h"
#include "csrc/core/rounding.h"
#include "csrc/core/types.h"

namespace tfclip {

constexpr int kMaxSlots = 3;  // Adam with amsgrad: m, v, vhat

// Per-step constants in the math type M, computed as Keras computes them (in the variable's
// dtype). Each rule has its own: Rule::Consts<M>, derived from StepBase<M> (what every rule's
// apply reads: the learning rate, decoupled weight decay, a sparse row's sum_of_squares) with
// the rule's own fields, and Rule::MakeConsts<M>(hp), which computes those alone (issue 44: a
// step of SGD no longer computes Nadam's powers). The expressions, their order and types are
// the ones the shared 50-field struct had, so the bits are too.
template <typename M>
struct StepBase {
  M lr, weight_decay;
  bool decay, sum_of_squares;
  RoundKey round;  // a bfloat16 variable's stochastic rounding (rounding.h; per tensor: WithTensor)
};

template <typename M>
TFCLIP_HD void MakeStepBase(const HParams& hp, StepBase<M>* c) {
  c->lr = static_cast<M>(hp.lr);
  c->weight_decay = static_cast<M>(hp.weight_decay);
  c->decay = hp.weight_decay != 0.0;
  c->sum_of_squares = hp.sum_of_squares;
  c->round = MakeRoundKey(hp.stochastic_rounding, hp.rounding_seed, hp.rounding_step, hp.rounding_tensor);
}

// A step's constants for the tensor at position `tensor` of the step: stochastic rounding's
// key names it (csrc/core/rounding.h), counted from the step's first (HParams::rounding_tensor).
// Every pass over a bfloat16 variable takes its constants through it.
template <typename C>
TFCLIP_HD C WithTensor(const C& c, int tensor) {
  C k = c;
  k.round.tensor = c.round.tensor + static_cast<uint32_t>(tensor);
  return k;
}

// A beta power given as it is (TF1's accumulators), else beta^t.
template <typename M>
TFCLIP_HD M BetaPower(double given, M beta, M t) {
  return given == given ? static_cast<M>(given) : std::pow(beta, t);
}

// The moment terms of Adam and Lamb, as Keras computes them: 1 - beta as the Python float,
// rounded once to M ((M(1) - M(beta)) would differ by an ulp, 0.1f vs 0.100000024f for beta 0.9,
// and drift over many steps), epsilon, and the bias corrections' beta^t (TF1's accumulators when
// given). A rule's Consts derive from it and MakeConsts fills it with MakeAdamMoments.
template <typename M>
struct AdamMoments {
  M one_minus_beta_1, one_minus_beta_2, epsilon;
  M beta_1_power, beta_2_power;  // beta^t
};

template <typename M>
TFCLIP_HD void MakeAdamMoments(const HParams& hp, AdamMoments<M>* a) {
  a->one_minus_beta_1 = static_cast<M>(1.0 - hp.beta_1);
  a->one_minus_beta_2 = static_cast<M>(1.0 - hp.beta_2);
  a->epsilon = static_cast<M>(hp.epsilon);
  const M t = static_cast<M>(hp.step);
  a->beta_1_power = BetaPower(hp.beta_1_power, static_cast<M>(hp.beta_1), t);
  a->beta_2_power = BetaPower(hp.beta_2_power, static_cast<M>(hp.beta_2), t);
}

// Keras applies decoupled weight decay as `var - var * wd * lr` before the rule.
template <typename M>
TFCLIP_HD M DecayVar(const StepBase<M>& c, M var) {
  return c.decay ? var - var * c.weight_decay * c.lr : var;
}

// The gradient's second input a rule reads (Update's g2): g*g for most. For an IndexedSlices row
// with duplicates Keras densifies after this transform (sum of the duplicates' squares; Adamax:
// of their |g|), so the sparse pass sums Second(g_j) over the duplicates (HParams::sum_of_squares).
//
// A rule with kTrustRatio (Lamb) scales its step per tensor by a ratio of norms, which needs
// every element's update before any variable is written: its Update advances the slots only
// (var untouched), Direction(c, slots) is the element's update u from the stored slots, and
// after the per-tensor sums of var^2 and u^2 (ApplyElem's return, csrc/core/apply_elem.h) Trust(c, ratio * lr, var,
// slots) writes the variable.
//
// Consts<M> and MakeConsts<M>(hp): the rule's step constants (above). RuleBase's are StepBase's
// alone, for a rule that reads nothing else (SGD); a rule with fields of its own declares both
// (one without the other does not compile: MakeConsts's type is not the one Update takes).
struct RuleBase {
  static constexpr bool kTrustRatio = false;
  static constexpr bool kFactored = false;  // Adafactor's passes (csrc/core/factored.h)
  // Bit k: slot k is never negative (a second moment, an accumulator of squares or of |g|):
  // stored with the unsigned code under int8 state (csrc/core/quant8.h), the others signed.
  static constexpr unsigned kUnsignedSlots = 0u;
  static constexpr bool kZeroGradKeeps = false;  // a zero gradient leaves var and slots as they are
  template <typename M>
  static TFCLIP_HD M Second(M g) { return g * g; }
  template <typename M>
  using Consts = StepBase<M>;
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    return c;
  }
};

// Each rule: kScatter (IndexedSlices duplicates applied one by one, as TF's scatter ops, rather
// than summed), kMinSlots..kMaxSlots and NumSlots(hp) (the slot count a step uses), its step
// constants (Consts, MakeConsts; RuleBase's for SGD), Update.
struct SgdRule : RuleBase {
  static constexpr bool kScatter = true;  // keras SGD on IndexedSlices: scatter_sub(g * lr)
  static constexpr bool kZeroGradKeeps = true;
  static constexpr int kMinSlots = 0, kMaxSlots = 0;
  static TFCLIP_HD int NumSlots(const HParams&) { return 0; }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M /*gsq*/, M& var, M* /*slots*/) {
    var = var - g * c.lr;
  }
};

struct MomentumRule : RuleBase {
  // accum = accum * momentum + grad; var -= lr * accum  (nesterov: var -= grad*lr + accum*momentum*lr)
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 1;
  static TFCLIP_HD int NumSlots(const HParams&) { return 1; }
  template <typename M>
  struct Consts : StepBase<M> {
    M momentum;
    bool nesterov;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    c.momentum = static_cast<M>(hp.momentum);
    c.nesterov = hp.nesterov;
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M /*gsq*/, M& var, M* s) {
    M accum = s[0] * c.momentum + g;
    s[0] = accum;
    if (c.nesterov) {
      var = var - (g * c.lr + accum * c.momentum * c.lr);
    } else {
      var = var - accum * c.lr;
    }
  }
};

struct KerasMomentumRule : RuleBase {
  // m = -grad*lr + m*momentum; var += m  (nesterov: var += -grad*lr + m*momentum)
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 1;
  static TFCLIP_HD int NumSlots(const HParams&) { return 1; }
  template <typename M>
  using Consts = MomentumRule::Consts<M>;  // the same constants as MomentumRule's
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    return MomentumRule::MakeConsts<M>(hp);
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M /*gsq*/, M& var, M* s) {
    const M neg_g_lr = -g * c.lr;
    const M m = neg_g_lr + s[0] * c.momentum;
    s[0] = m;
    var = c.nesterov ? var + (neg_g_lr + m * c.momentum) : var + m;
  }
};

struct AdamRule : RuleBase {
  // m += (g - m)(1 - b1); v += (gsq - v)(1 - b2); [vhat = max(vhat, v)]; var -= m*alpha/(sqrt(v)+eps)
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 3;
  static constexpr unsigned kUnsignedSlots = 0b110u;
  static TFCLIP_HD int NumSlots(const HParams& hp) { return hp.amsgrad ? 3 : 2; }
  template <typename M>
  struct Consts : StepBase<M>, AdamMoments<M> {
    M alpha;  // lr sqrt(1 - b2^t) / (1 - b1^t)
    bool amsgrad;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    MakeAdamMoments<M>(hp, &c);
    c.alpha = c.lr * std::sqrt(M(1) - c.beta_2_power) / (M(1) - c.beta_1_power);
    c.amsgrad = hp.amsgrad;
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
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

struct AdagradRule : RuleBase {
  // accum += g^2; var -= lr*g / sqrt(accum + eps) (keras 3 Adagrad); with eps_outside
  // var -= lr*g / (sqrt(accum) + eps) (ResourceApplyAdagradV2, tf_keras's legacy Adagrad).
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 1;
  static constexpr unsigned kUnsignedSlots = 0b1u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 1; }
  template <typename M>
  struct Consts : StepBase<M> {
    // epsilon inside the square root (eps_in; eps_out 0), or, eps_outside, added to it (eps_out;
    // eps_in 0): one sqrt either way, and x + 0 is x, so each form keeps its own rounding and
    // the loop has no branch.
    M eps_in, eps_out;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    const M epsilon = static_cast<M>(hp.epsilon);
    c.eps_in = hp.eps_outside ? M(0) : epsilon;
    c.eps_out = hp.eps_outside ? epsilon : M(0);
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
    const M accum = s[0] + gsq;
    s[0] = accum;
    var = var - (c.lr * g) / (std::sqrt(accum + c.eps_in) + c.eps_out);
  }
};

struct RmsPropRule : RuleBase {
  // keras RMSprop: v = rho*v + (1-rho)*g^2; [centered: a = rho*a + (1-rho)*g; den = v - a^2 + eps,
  // else den = v + eps]; inc = lr*g / sqrt(den); [momentum: m = momentum*m + inc; var -= m,
  // else var -= inc]. eps_outside (tf_keras's legacy RMSprop without momentum): epsilon added to
  // the square root instead, inc = lr*g / (sqrt(den - eps) + eps). Slots, in this order: velocity, momentum (has_momentum; the op input
  // momentum_slot, as `momentum` is the hyper-parameter), average_gradient (centered); the op's
  // inputs of the slots left out are empty.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 3;
  static constexpr unsigned kUnsignedSlots = 0b001u;
  static TFCLIP_HD int NumSlots(const HParams& hp) {
    return 1 + (hp.has_momentum ? 1 : 0) + (hp.centered ? 1 : 0);
  }
  template <typename M>
  struct Consts : StepBase<M> {
    M rho, one_minus_rho, momentum;
    M eps_in, eps_out;  // as AdagradRule's
    bool centered, has_momentum;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    c.momentum = static_cast<M>(hp.momentum);
    const M epsilon = static_cast<M>(hp.epsilon);
    c.rho = static_cast<M>(hp.rho);
    c.one_minus_rho = static_cast<M>(1.0 - hp.rho);
    c.centered = hp.centered;
    c.has_momentum = hp.has_momentum;
    c.eps_in = hp.eps_outside ? M(0) : epsilon;
    c.eps_out = hp.eps_outside ? epsilon : M(0);
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
    // Written as selects on the (uniform) flags, no branch and no run-time slot index, so the
    // CPU loop vectorizes: with branches, 2.8x (plain) and 2.1x (centered, momentum) the floor
    // (benchmarks/NOTES.md, R1). What a flag turns off is computed and dropped.
    const M v = c.rho * s[0] + c.one_minus_rho * gsq;
    s[0] = v;
    const M avg = c.rho * (c.has_momentum ? s[2] : s[1]) + c.one_minus_rho * g;
    const M den = c.centered ? (v - avg * avg) + c.eps_in : v + c.eps_in;
    const M inc = (c.lr * g) / (std::sqrt(den) + c.eps_out);
    const M m = c.momentum * s[1] + inc;
    // The store of a slot the flags leave out is never written back (ApplyElem stores the
    // NumSlots first): s[1] is the momentum, else (centered) the average; s[2] the average.
    s[1] = c.has_momentum ? m : avg;
    s[2] = avg;
    var = var - (c.has_momentum ? m : inc);
  }
};

struct AdadeltaRule : RuleBase {
  // keras Adadelta: ag = rho*ag + (1-rho)*g^2; d = -(sqrt(adv + eps)*g / sqrt(ag + eps));
  // adv = rho*adv + (1-rho)*d^2; var += lr*d. Slots: accumulated_grad, accumulated_delta_var.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static constexpr unsigned kUnsignedSlots = 0b11u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 2; }
  template <typename M>
  struct Consts : StepBase<M> {
    M rho, one_minus_rho, epsilon;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    c.epsilon = static_cast<M>(hp.epsilon);
    c.rho = static_cast<M>(hp.rho);
    c.one_minus_rho = static_cast<M>(1.0 - hp.rho);
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
    const M ag = c.rho * s[0] + c.one_minus_rho * gsq;
    s[0] = ag;
    const M rms_delta = std::sqrt(s[1] + c.epsilon), rms_grad = std::sqrt(ag + c.epsilon);
    const M d = -((rms_delta * g) / rms_grad);
    // d^2. A duplicated IndexedSlices row: Keras squares each duplicate's d_j and sums them, which
    // is (rms_delta / rms_grad)^2 times the duplicates' sum of squares gsq. A dense element (or
    // a row of one slice), gsq == g*g: d*d, the same math in stock Keras's rounding.
    const M r = rms_delta / rms_grad;
    const M d2 = gsq == g * g ? d * d : (r * r) * gsq;
    s[1] = c.rho * s[1] + c.one_minus_rho * d2;
    var = var + c.lr * d;
  }
};

struct AdamaxRule : RuleBase {
  // keras Adamax: m += (g - m)*(1 - b1); u = max(b2*u, |g|); var -= lr*m / ((1 - b1^t)*(u + eps)).
  // Slots: m, u.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static constexpr unsigned kUnsignedSlots = 0b10u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 2; }
  template <typename M>
  struct Consts : StepBase<M> {
    M one_minus_beta_1, beta_2, epsilon;
    M one_minus_beta_1_power;  // 1 - beta_1^t
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    const M b1 = static_cast<M>(hp.beta_1), b2 = static_cast<M>(hp.beta_2);
    c.one_minus_beta_1 = static_cast<M>(1.0 - hp.beta_1);
    c.epsilon = static_cast<M>(hp.epsilon);
    const M t = static_cast<M>(hp.step);
    const M b1p = BetaPower(hp.beta_1_power, b1, t);
    c.beta_2 = b2;
    c.one_minus_beta_1_power = M(1) - b1p;
    return c;
  }
  template <typename M>
  static TFCLIP_HD M Second(M g) { return g < M(0) ? -g : g; }  // |g| (a duplicated row: their sum)
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M ag, M& var, M* s) {
    const M m = s[0] + (g - s[0]) * c.one_minus_beta_1;
    s[0] = m;
    const M bu = c.beta_2 * s[1];
    const M u = (bu != bu || bu > ag) ? bu : ag;  // max, NaN from either side, as tf.maximum
    s[1] = u;
    var = var - (c.lr * m) / (c.one_minus_beta_1_power * (u + c.epsilon));
  }
};

struct LionRule : RuleBase {
  // keras Lion: var -= lr * sign(m*b1 + g*(1 - b1)); m = m*b2 + g*(1 - b2), the 1 - b in the
  // variable's dtype. Slot: m.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 1, kMaxSlots = 1;
  static TFCLIP_HD int NumSlots(const HParams&) { return 1; }
  template <typename M>
  struct Consts : StepBase<M> {
    M beta_1, beta_2;
    M one_minus_beta_1_m, one_minus_beta_2_m;  // M(1) - M(beta), computed in the dtype
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    const M b1 = static_cast<M>(hp.beta_1), b2 = static_cast<M>(hp.beta_2);
    c.beta_1 = b1;
    c.beta_2 = b2;
    c.one_minus_beta_1_m = M(1) - b1;
    c.one_minus_beta_2_m = M(1) - b2;
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M, M& var, M* s) {
    const M x = s[0] * c.beta_1 + g * c.one_minus_beta_1_m;
    // sign(x): 1, -1, +0 for +-0, x itself for NaN (as tf.sign), written as flat selects: the
    // nested ?: did not vectorize, and Lion's float32 CPU step ran at 10x SGD momentum's time.
    const M pos = x > M(0) ? M(1) : M(0);
    const M neg = x < M(0) ? M(1) : M(0);
    const M sign = x != x ? x : pos - neg;
    var = var - c.lr * sign;
    s[0] = s[0] * c.beta_2 + g * c.one_minus_beta_2_m;
  }
};

struct NadamRule : RuleBase {
  // keras Nadam: m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2) (1 - b in the dtype);
  // m_hat = u_{t+1} m / (1 - u_product_{t+1}) + (1 - u_t) g / (1 - u_product_t);
  // var -= m_hat lr / (sqrt(v / (1 - b2^t)) + eps). Slots: m, v.
  // legacy_nadam (tf_keras legacy Nadam, OptimizerV2, in its own order): m = b1 m + (1 - b1) g;
  // v = b2 v + (1 - b2) g^2; m_bar = (1 - u_t) (g / (1 - u_product_t)) + u_{t+1} (m / (1 -
  // u_product_{t+1})); var -= lr m_bar / (sqrt(v / (1 - b2^t)) + eps) (its m_t, m_schedule_new,
  // v_t_prime_denominator are u_t, u_product_t, 1 - b2^t here), with schedule_decay 0.004.
  // One body for both forms, with no select and no branch: each form is the other's
  // operations with factors of 1 (exact: x * 1 is x, inf and NaN included) or 0 where the form
  // has no such operation (nadam_keep_*, nadam_sub, nadam_pre_*, nadam_post_*; MakeConsts).
  // Written as selects on the flag, or as two branches, the Keras 3 loop ran at 6-7x its former
  // time on the CPU (81 and 122 vs 12-18 ms for 2e7 elements, tfclip._core.clip_apply, avx512):
  // this way it costs six multiplies more, never a division. The legacy form's g - 0*s is g,
  // but for an infinite slot (0*inf is NaN: its m then NaN where stock's is inf; its variable
  // is NaN either way).
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static constexpr unsigned kUnsignedSlots = 0b10u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 2; }
  template <typename M>
  struct Consts : StepBase<M> {
    M one_minus_beta_1_m, one_minus_beta_2_m, epsilon;  // M(1) - M(beta), in the dtype
    // 1 - u_product_{t+1}, 1 - u_product_t, 1 - beta_2^t (all in M)
    M one_minus_u_product_next, one_minus_u_product, one_minus_beta_2_power;
    // The form factors: keras 1, 1, 1, u_{t+1}, 1, 1 - u_t, 1; legacy_nadam beta_1, beta_2, 0,
    // 1, u_{t+1}, 1, 1 - u_t.
    M nadam_keep_m, nadam_keep_v, nadam_sub, nadam_pre_m, nadam_post_m, nadam_pre_g, nadam_post_g;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    const M b1 = static_cast<M>(hp.beta_1), b2 = static_cast<M>(hp.beta_2);
    c.epsilon = static_cast<M>(hp.epsilon);
    const M t = static_cast<M>(hp.step);
    const M b2p = BetaPower(hp.beta_2_power, b2, t);
    c.one_minus_beta_1_m = M(1) - b1;
    c.one_minus_beta_2_m = M(1) - b2;
    // As keras computes it in the variable's dtype: u_t = beta_1 * (1 - 0.5 * 0.96^t); the
    // running product u_product (through step t) is carried across steps by the caller. With
    // schedule_decay given (tf_keras legacy Nadam's, 0.004): 0.96^(schedule_decay * t), the
    // product schedule_decay * t in the dtype as stock's `self._initial_decay * local_step`.
    // legacy_nadam: stock's base tf.cast(0.96, dtype) converts the Python float to a float32
    // tensor first (float64 variables get float32's 0.96, widened).
    const M decay = hp.legacy_nadam ? static_cast<M>(0.96f) : static_cast<M>(0.96);
    const bool scaled = hp.schedule_decay == hp.schedule_decay;
    const M sd = static_cast<M>(scaled ? hp.schedule_decay : 1.0);
    const M t_next = static_cast<M>(hp.step + 1.0);
    const M u_t = b1 * (M(1) - M(0.5) * std::pow(decay, scaled ? sd * t : t));
    const M u_next = b1 * (M(1) - M(0.5) * std::pow(decay, scaled ? sd * t_next : t_next));
    const M u_product = static_cast<M>(hp.u_product);
    c.one_minus_u_product_next = M(1) - u_product * u_next;
    const M one_minus_u_t = M(1) - u_t;
    c.one_minus_u_product = M(1) - u_product;
    c.one_minus_beta_2_power = M(1) - b2p;
    const bool L = hp.legacy_nadam;
    c.nadam_keep_m = L ? b1 : M(1);
    c.nadam_keep_v = L ? b2 : M(1);
    c.nadam_sub = L ? M(0) : M(1);
    c.nadam_pre_m = L ? M(1) : u_next;
    c.nadam_post_m = L ? u_next : M(1);
    c.nadam_pre_g = L ? M(1) : one_minus_u_t;
    c.nadam_post_g = L ? one_minus_u_t : M(1);
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
    // keras: s + (x - s)(1 - b); legacy: b s + (1 - b) x (a sum and a product commute exactly).
    const M m = c.nadam_keep_m * s[0] + (g - c.nadam_sub * s[0]) * c.one_minus_beta_1_m;
    const M v = c.nadam_keep_v * s[1] + (gsq - c.nadam_sub * s[1]) * c.one_minus_beta_2_m;
    s[0] = m;
    s[1] = v;
    // keras: (u m) / d; legacy: u (m / d).
    const M m_hat = ((c.nadam_pre_m * m) / c.one_minus_u_product_next) * c.nadam_post_m +
                    ((c.nadam_pre_g * g) / c.one_minus_u_product) * c.nadam_post_g;
    const M v_hat = v / c.one_minus_beta_2_power;
    var = var - (m_hat * c.lr) / (std::sqrt(v_hat) + c.epsilon);
  }
};

// kSqrt: the default learning_rate_power -0.5, n^0.5 as sqrt (the correctly rounded pow(n, 0.5)
// for n >= 0, which an accumulator is), which vectorizes; the general power calls std::pow per
// element, which does not (13x the floor on BERT-base, benchmarks/NOTES.md, R1). Two rows of the
// table (`ftrl_sqrt`, `ftrl`); the Python layer picks one by learning_rate_power.
template <bool kSqrt>
struct FtrlRule : RuleBase {
  // keras Ftrl (ResourceApplyFtrlV2's algebra): gs = g + 2*l2_shrinkage*var; n' = n + g^2;
  // linear += gs - (n'^-p - n^-p)/lr * var; q = n'^-p/lr + 2*(l2 + beta/(2*lr));
  // var = (clip(linear, -l1, l1) - linear)/q; n = n'. Slots: accumulator, linear.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static constexpr unsigned kUnsignedSlots = 0b01u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 2; }
  template <typename M>
  struct Consts : StepBase<M> {
    M l1, two_l2_shrinkage, neg_lr_power, two_l2_reg;  // l1, 2*l2_shrinkage, -lr_power, 2*(l2 + beta/(2*lr))
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    // As keras: l2 + beta / (2 * lr) in the dtype; the Python-side products exactly.
    c.l1 = static_cast<M>(hp.l1);
    c.two_l2_shrinkage = static_cast<M>(2.0 * hp.l2_shrinkage);
    c.neg_lr_power = static_cast<M>(-hp.lr_power);
    c.two_l2_reg = M(2) * (static_cast<M>(hp.l2) + static_cast<M>(hp.beta) / (M(2) * c.lr));
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
    const M gs = g + c.two_l2_shrinkage * var;
    const M n = s[0];
    const M n_new = n + gsq;
    M p_new, p_old;
    if constexpr (kSqrt) {
      p_new = std::sqrt(n_new);
      p_old = std::sqrt(n);
    } else if constexpr (std::is_same_v<M, float>) {
      // float math (float variables, the 16-bit ones too): pow in double, rounded once. CUDA's
      // powf is off by up to 4 ulp and glibc's by under 1, so a GPU and the CPU gave other bits,
      // which FTRL's cancellation (linear against the l1 clip) grew to ~30 ulp of the variables
      // (an H100, 2026-11-26); in double both round to the same float but for a ~2^-28-rare tie.
      p_new = static_cast<float>(std::pow(static_cast<double>(n_new), static_cast<double>(c.neg_lr_power)));
      p_old = static_cast<float>(std::pow(static_cast<double>(n), static_cast<double>(c.neg_lr_power)));
    } else {
      p_new = std::pow(n_new, c.neg_lr_power);
      p_old = std::pow(n, c.neg_lr_power);
    }
    const M linear = s[1] + (gs - ((p_new - p_old) / c.lr) * var);
    const M quadratic = p_new / c.lr + c.two_l2_reg;
    M clipped = linear < c.l1 ? linear : c.l1;  // tf.clip_by_value: min with hi, then max with lo
    clipped = clipped > -c.l1 ? clipped : -c.l1;
    var = (clipped - linear) / quadratic;
    s[0] = n_new;
    s[1] = linear;
  }
};

using FtrlPowRule = FtrlRule<false>;

struct LambRule : RuleBase {
  // keras Lamb: m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2) (1 - b the Python float);
  // u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps); per tensor, ratio = |w| / |u| (1 when
  // either is 0); var -= ratio * lr * u. |w| is the norm of the variable after weight decay.
  // Slots: m, v.
  static constexpr bool kScatter = false;
  static constexpr bool kTrustRatio = true;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static constexpr unsigned kUnsignedSlots = 0b10u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 2; }
  template <typename M>
  struct Consts : StepBase<M>, AdamMoments<M> {
    M one_minus_beta_1_power, one_minus_beta_2_power;  // 1 - beta^t
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    MakeAdamMoments<M>(hp, &c);
    c.one_minus_beta_1_power = M(1) - c.beta_1_power;
    c.one_minus_beta_2_power = M(1) - c.beta_2_power;
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& /*var*/, M* s) {
    s[0] = s[0] + (g - s[0]) * c.one_minus_beta_1;
    s[1] = s[1] + (gsq - s[1]) * c.one_minus_beta_2;
  }
  template <typename M>
  static TFCLIP_HD M Direction(const Consts<M>& c, const M* s) {
    return (s[0] / c.one_minus_beta_1_power) /
           (std::sqrt(s[1] / c.one_minus_beta_2_power) + c.epsilon);
  }
  template <typename M>
  static TFCLIP_HD void Trust(const Consts<M>& c, M ratio_lr, M& var, const M* s) {
    var = var - ratio_lr * Direction(c, s);
  }
};
using FtrlSqrtRule = FtrlRule<true>;

struct AdafactorRule : RuleBase {
  // keras Adafactor (Shazeer & Stern 2018) as keras 3 computes it, in the variable's dtype, with
  // t = iterations + 1:
  //   rho = min(lr, 1/sqrt(t)); alpha = max(epsilon_2, rms(w)) * rho; b = 1 - t^beta_2_decay;
  //   q = g^2 + epsilon_1;
  //   rank >= 2 (the last two axes M x N factored): r = b r + (1 - b) mean(q, axis=-1);
  //     c = b c + (1 - b) mean(q, axis=-2); v = (r / mean(r, axis=-1)) c  (written, not kept);
  //   rank < 2: v = b v + (1 - b) q;
  //   u = g / sqrt(v); var -= alpha * (u / max(1, rms(u) / clip_threshold)).
  // w is the variable after decoupled weight decay (keras decays before update_step). keras's
  // relative_step (lr = min(lr, 1/sqrt(t)) for a constant lr) changes nothing: rho takes that
  // minimum anyway. The means and rms are reductions: the passes of csrc/core/factored.h take
  // them in float64 in a fixed order; these are the per-element parts. Slots: r, c, v.
  static constexpr bool kScatter = false;
  static constexpr bool kFactored = true;
  static constexpr int kMinSlots = 3, kMaxSlots = 3;
  static constexpr unsigned kUnsignedSlots = 0b111u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 3; }
  template <typename M>
  struct Consts : StepBase<M> {
    M rho, beta_2_t, one_minus_beta_2_t, epsilon_1, epsilon_2, clip_threshold;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    const M t = static_cast<M>(hp.step);
    const M inv_sqrt_t = M(1) / std::sqrt(t);
    c.rho = c.lr < inv_sqrt_t ? c.lr : inv_sqrt_t;
    // t^beta_2_decay in double, rounded once: CUDA's powf and glibc's differ by ulps (FtrlRule).
    c.beta_2_t = M(1) - static_cast<M>(std::pow(static_cast<double>(t), static_cast<double>(static_cast<M>(hp.beta_2_decay))));
    c.one_minus_beta_2_t = M(1) - c.beta_2_t;
    c.epsilon_1 = static_cast<M>(hp.epsilon_1);
    c.epsilon_2 = static_cast<M>(hp.epsilon_2);
    c.clip_threshold = static_cast<M>(hp.clip_threshold);
    return c;
  }
  // q, the element's regulated square.
  template <typename M>
  static TFCLIP_HD M Square(const Consts<M>& c, M g) { return g * g + c.epsilon_1; }
  // A second-moment statistic's moving average: r, c or an unfactored v, from its old value and
  // the new mean of q (a single q for an unfactored v).
  template <typename M>
  static TFCLIP_HD M Average(const Consts<M>& c, M old, M mean_q) {
    return c.beta_2_t * old + c.one_minus_beta_2_t * mean_q;
  }
  // A factored variable's v: its row's scale r / mean(r) (the mean over its matrix's rows),
  // times its column's c.
  template <typename M>
  static TFCLIP_HD M RowScale(M r, M r_mean) { return r / r_mean; }
  template <typename M>
  static TFCLIP_HD M FactoredV(M row_scale, M col) { return row_scale * col; }
  template <typename M>
  static TFCLIP_HD M Direction(M g, M v) { return g / std::sqrt(v); }
  // alpha and the update clip's denominator, from the tensor's rms(w) and rms(u).
  template <typename M>
  static TFCLIP_HD M Alpha(const Consts<M>& c, M rms_w) {
    return (c.epsilon_2 > rms_w ? c.epsilon_2 : rms_w) * c.rho;
  }
  template <typename M>
  static TFCLIP_HD M Denominator(const Consts<M>& c, M rms_u) {
    const M q = rms_u / c.clip_threshold;
    return M(1) > q ? M(1) : q;
  }
  // The variable (after weight decay) stepped by alpha * (u / denominator).
  template <typename M>
  static TFCLIP_HD void Step(M alpha, M denominator, M u, M& var) { var = var - alpha * (u / denominator); }
};

struct ScheduleFreeAdamWRule : RuleBase {
  // keras ScheduleFreeAdamW (Defazio et al. 2024), the 1 - b in the dtype. The variable is y,
  // slot m is z (a copy of the variable at build), slot v Adam's second moment:
  //   v += (g^2 - v)(1 - b2); z = m - warm_lr*g / (sqrt(v / (1 - b2^t)) + eps);
  //   x = (y - (1 - b1) z) / b1; x' = (1 - 1/t) x + (1/t) z; y = (1 - b1) z + b1 x'.
  // x is recovered from the NEW z, not the old one the paper (and keras's comment) uses: on the
  // TensorFlow backend keras's `momentum_old = momentum.value` is the variable itself, read
  // after `assign_sub`, so stock Keras computes this; a drop-in follows its trajectory
  // (tests/test_rules_schedule_free.py checks both that stock does and that this matches it).
  // Slots: momentum (z), velocity (v).
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static constexpr unsigned kUnsignedSlots = 0b10u;
  static TFCLIP_HD int NumSlots(const HParams&) { return 2; }
  template <typename M>
  struct Consts : StepBase<M> {
    M beta_1, one_minus_beta_1_m, one_minus_beta_2_m, epsilon;  // 1 - b: M(1) - M(beta)
    M one_minus_beta_2_power;  // 1 - beta_2^t
    // lr * min(t / warmup_steps, 1) (lr when warmup_steps <= 0), 1/t, 1 - 1/t
    M warm_lr, inv_step, one_minus_inv_step;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    const M b1 = static_cast<M>(hp.beta_1), b2 = static_cast<M>(hp.beta_2);
    c.epsilon = static_cast<M>(hp.epsilon);
    const M t = static_cast<M>(hp.step);
    const M b2p = BetaPower(hp.beta_2_power, b2, t);
    c.beta_1 = b1;
    c.one_minus_beta_1_m = M(1) - b1;
    c.one_minus_beta_2_m = M(1) - b2;
    c.one_minus_beta_2_power = M(1) - b2p;
    // As keras in the dtype: lr * minimum(t / warmup_steps, 1.0) when warmup_steps > 0 (a
    // Python test there: a value <= 0 is no warmup); weight = 1.0 / t.
    c.warm_lr = c.lr;
    if (hp.warmup_steps > 0.0) {
      const M f = t / static_cast<M>(hp.warmup_steps);
      c.warm_lr = c.lr * (f < M(1) ? f : M(1));
    }
    c.inv_step = M(1) / t;
    c.one_minus_inv_step = M(1) - c.inv_step;
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M gsq, M& var, M* s) {
    const M v = s[1] + (gsq - s[1]) * c.one_minus_beta_2_m;
    s[1] = v;
    const M denom = std::sqrt(v / c.one_minus_beta_2_power) + c.epsilon;
    const M z = s[0] - (c.warm_lr * g) / denom;
    s[0] = z;
    const M x = (var - c.one_minus_beta_1_m * z) / c.beta_1;
    const M x_new = c.one_minus_inv_step * x + c.inv_step * z;
    var = c.one_minus_beta_1_m * z + c.beta_1 * x_new;
  }
};

// Keras Muon's element-wise halves, around the Newton–Schulz iterations (TF matrix products,
// tfclip/keras/_muon.py) that no element-wise pass can run: tfclip.keras.Muon runs MuonMomentumRule's
// op on every matrix before them and MuonUpdateRule's after.
struct MuonMomentumRule : RuleBase {
  // The momentum slot as the op's variable (no slots of its own): m <- m + (g + m (momentum - 1)),
  // keras's `assign_add(m, g + m * (momentum - 1))`, momentum - 1 the Python float rounded once.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 0, kMaxSlots = 0;
  static TFCLIP_HD int NumSlots(const HParams&) { return 0; }
  template <typename M>
  struct Consts : StepBase<M> {
    M momentum_minus_1;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    c.momentum_minus_1 = static_cast<M>(hp.momentum - 1.0);
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M g, M /*gsq*/, M& m, M* /*slots*/) {
    m = m + (g + m * c.momentum_minus_1);
  }
};

struct MuonUpdateRule : RuleBase {
  // The matrix after decoupled weight decay, stepped by its orthogonalized update o (the op's
  // gradient input): var -= ((lr * o) * shape_scale) * rms_rate, keras's
  // `assign_sub(var, lr_adjust(lr * o))` with Moonlight's scale, shape_scale = sqrt(max(rows,
  // cols)) in float32 as keras computes it (1 and 1 for rms_rate=None: exact). No slots.
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 0, kMaxSlots = 0;
  static TFCLIP_HD int NumSlots(const HParams&) { return 0; }
  template <typename M>
  struct Consts : StepBase<M> {
    M shape_scale, rms_rate;
  };
  template <typename M>
  static TFCLIP_HD Consts<M> MakeConsts(const HParams& hp) {
    Consts<M> c;
    MakeStepBase<M>(hp, &c);
    c.shape_scale = static_cast<M>(hp.shape_scale);
    c.rms_rate = static_cast<M>(hp.rms_rate);
    return c;
  }
  template <typename M>
  static TFCLIP_HD void Update(const Consts<M>& c, M o, M /*gsq*/, M& var, M* /*slots*/) {
    var = var - ((c.lr * o) * c.shape_scale) * c.rms_rate;
  }
};

}  // namespace tfclip
