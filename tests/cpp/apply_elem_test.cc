// Header-level checks of the core's per-element apply and dispatch (csrc/core/apply_elem.h,
// rule_table.h), with rules that exist only here: a rule with two slots, one with two or three.
// Built and run by tests/test_core_headers.py. Exit status 0: every check held.
#include <cstdio>
#include <cstdlib>

#include "csrc/core/apply_elem.h"
#include "csrc/core/rule_table.h"
#include "csrc/core/sparse.h"

namespace {
int failures = 0;
#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                    \
    }                                                                \
  } while (0)

using tfclip::DenseGrad;
using tfclip::HParams;

// s[k] += (k + 1) * g for every slot; var -= g. Two slots.
struct TwoSlotRule : tfclip::RuleBase {
  static constexpr bool kScatter = false;
  static constexpr int kMinSlots = 2, kMaxSlots = 2;
  static int NumSlots(const HParams&) { return 2; }
  template <typename M>
  static void Update(const Consts<M>&, M g, M gsq, M& var, M* s) {
    for (int k = 0; k < 2; ++k) s[k] += M(k + 1) * g;
    var -= g + gsq * M(0);
  }
};
// Two or three slots; the third counts the updates.
struct TwoOrThreeSlotRule : tfclip::RuleBase {
  static constexpr bool kScatter = true;
  static constexpr int kMinSlots = 2, kMaxSlots = 3;
  static int NumSlots(const HParams& hp) { return hp.amsgrad ? 3 : 2; }
  template <typename M>
  static void Update(const Consts<M>&, M g, M, M& var, M* s) {
    s[0] += g;
    s[1] += g * g;
    s[2] += M(1);  // unused with two slots: ApplyElem neither loads nor stores it
    var -= g;
  }
};

template <typename Rule>
int Dispatched(int n) {
  int got = -1;
  const bool ok = tfclip::DispatchSlots<Rule>(n, [&](auto k) { got = decltype(k)::value; });
  return ok ? got : -2;
}
}  // namespace

int main() {
  // The slot count is the rule's own: never a fallback to one slot.
  CHECK(Dispatched<TwoSlotRule>(2) == 2);
  CHECK(Dispatched<TwoSlotRule>(1) == -2);
  CHECK(Dispatched<TwoSlotRule>(0) == -2);
  CHECK(Dispatched<TwoOrThreeSlotRule>(2) == 2);
  CHECK(Dispatched<TwoOrThreeSlotRule>(3) == 3);
  CHECK(Dispatched<TwoOrThreeSlotRule>(1) == -2);
  CHECK(Dispatched<tfclip::SgdRule>(0) == 0);
  CHECK(Dispatched<tfclip::SgdRule>(1) == -2);
  CHECK(Dispatched<tfclip::AdamRule>(3) == 3);

  // Every table rule's NumSlots, with either flag value, is in its own range.
  for (const tfclip::RuleInfo& r : tfclip::AllRules()) {
    for (bool flag : {false, true}) {
      HParams hp;
      hp.amsgrad = hp.nesterov = flag;
      const int n = tfclip::NumSlots(r.kind, hp);
      CHECK(n >= r.min_slots && n <= r.max_slots);
      tfclip::DispatchRule(r.kind, [&](auto rule) {
        CHECK(Dispatched<decltype(rule)>(n) == n);
      });
    }
  }

  // ApplyElem updates every slot of a multi-slot rule, and only the slots the count says.
  // RuleBase's constants (StepBase), as both test rules take.
  const tfclip::StepBase<float> c = tfclip::RuleBase::MakeConsts<float>(HParams{});
  float var[1] = {10.0f}, s0[1] = {0.0f}, s1[1] = {0.0f}, s2[1] = {0.0f};
  tfclip::DispatchSlots<TwoSlotRule>(2, [&](auto k) {
    tfclip::ApplyElem<TwoSlotRule, decltype(k)::value>(c, DenseGrad<float>{1.5f}, var, s0, s1,
                                                       static_cast<float*>(nullptr), 0);
  });
  CHECK(var[0] == 8.5f && s0[0] == 1.5f && s1[0] == 3.0f);
  var[0] = 10.0f, s0[0] = s1[0] = s2[0] = 0.0f;
  tfclip::ApplyElem<TwoOrThreeSlotRule, 3>(c, DenseGrad<float>{2.0f}, var, s0, s1, s2, 0);
  CHECK(var[0] == 8.0f && s0[0] == 2.0f && s1[0] == 4.0f && s2[0] == 1.0f);
  s2[0] = 7.0f;
  tfclip::ApplyElem<TwoOrThreeSlotRule, 2>(c, DenseGrad<float>{1.0f}, var, s0, s1, s2, 0);
  CHECK(s2[0] == 7.0f && s0[0] == 3.0f);

  // A row with duplicates: a scatter rule is fed once per duplicate, the others the sum.
  const float values[3] = {1.0f, 2.0f, 4.0f};
  const int64_t order[3] = {0, 1, 2};
  tfclip::ClipFactor f;
  const tfclip::GradReader<float, float> grad(values, tfclip::DType::kFloat, f);
  const tfclip::RowGrads<float, tfclip::GradReader<float, float>> row{grad, 1, 0, order, 0, 3};
  var[0] = 0.0f, s0[0] = s1[0] = s2[0] = 0.0f;
  tfclip::ApplyElem<TwoOrThreeSlotRule, 3>(c, row, var, s0, s1, s2, 0);
  CHECK(var[0] == -7.0f && s1[0] == 21.0f && s2[0] == 3.0f);  // 1 + 4 + 16, three updates
  var[0] = 0.0f, s0[0] = s1[0] = 0.0f;
  tfclip::ApplyElem<TwoSlotRule, 2>(c, row, var, s0, s1, static_cast<float*>(nullptr), 0);
  CHECK(var[0] == -7.0f && s0[0] == 7.0f && s1[0] == 14.0f);  // once, with the sum

  if (failures == 0) std::printf("apply_elem_test: all checks held\n");
  return failures == 0 ? 0 : 1;
}
