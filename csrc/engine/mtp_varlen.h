#pragma once
// DSpark's verify-length greedy (MTPVarlen): how many of each request's drafts to verify so that
// expected tokens per millisecond is highest on the profiled step-time curve.
//
// For request r with draft confidences c[r][1..k], survival a[r][j] = c[r][1] * ... * c[r][j] is the
// chance draft j and every draft before it are accepted. All drafts of the batch are sorted by
// survival (ties: lower request, then lower j) and admitted one by one; a step with B query tokens
// (B = R + admitted) yields tau = R + sum of admitted survivals tokens in time(B). Admission stops at
// the first draft that does not raise tau / time(B): the next confidence depends on the token just
// drafted, so looking past a drop would rank drafts on information the step cannot have.
#include <cstdint>
#include <vector>

namespace deepinfer {

class StepTimeCurve {
 public:
  // points: (query tokens, ms per step). Sorted by tokens and forced non-decreasing in time, since a
  // step never gets faster by carrying more tokens (measurement noise can say otherwise).
  StepTimeCurve(std::vector<double> tokens, std::vector<double> ms);
  // Linear interpolation; flat beyond the first point, linear extrapolation of the last segment.
  double ms(double tokens) const;
  const std::vector<double>& tokens() const { return tokens_; }
  const std::vector<double>& times() const { return ms_; }

 private:
  std::vector<double> tokens_, ms_;
};

class MTPVarlen {
 public:
  explicit MTPVarlen(StepTimeCurve curve) : curve_(std::move(curve)) {}
  // confidences: R rows of k values in [0, 1]. Returns drafts to verify per request, [R].
  std::vector<int> schedule(const std::vector<std::vector<double>>& confidences) const;
  // Async scheduling: the CPU fixes the step's total draft budget from confidences one step old...
  int budget(const std::vector<std::vector<double>>& stale_confidences) const;
  // ...and the fresh confidences decide who gets it: the top `budget` survivals, as prefixes.
  static std::vector<int> distribute(int budget, const std::vector<std::vector<double>>& confidences);
  const StepTimeCurve& curve() const { return curve_; }

 private:
  StepTimeCurve curve_;
};

}  // namespace deepinfer
