#include "engine/mtp_varlen.h"

#include <algorithm>
#include <string>

#include "engine/check.h"

namespace deepinfer {
namespace {

struct Draft {
  double survival;
  int request;
  int index;
};

// Every draft with its survival, best first (ties: lower request, then lower index, so a draft
// never precedes its predecessor even when a confidence is exactly 1).
std::vector<Draft> ranked_drafts(const std::vector<std::vector<double>>& conf) {
  std::vector<Draft> drafts;
  for (size_t r = 0; r < conf.size(); ++r) {
    double a = 1.0;
    for (size_t j = 0; j < conf[r].size(); ++j) {
      double c = conf[r][j];
      DI_REQUIRE(c >= 0.0 && c <= 1.0, "confidence of request " + std::to_string(r) + " draft " +
                                            std::to_string(j) + " is not in [0, 1]");
      a *= c;
      drafts.push_back({a, static_cast<int>(r), static_cast<int>(j)});
    }
  }
  std::stable_sort(drafts.begin(), drafts.end(), [](const Draft& x, const Draft& y) {
    if (x.survival != y.survival) return x.survival > y.survival;
    if (x.request != y.request) return x.request < y.request;
    return x.index < y.index;
  });
  return drafts;
}

}  // namespace

StepTimeCurve::StepTimeCurve(std::vector<double> tokens, std::vector<double> ms) {
  DI_REQUIRE(!tokens.empty() && tokens.size() == ms.size(), "step-time curve needs matching, non-empty points");
  std::vector<size_t> order(tokens.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tokens[a] < tokens[b]; });
  double running = 0.0;
  for (size_t i : order) {
    DI_REQUIRE(tokens[i] > 0 && ms[i] > 0, "step-time curve points must be positive");
    running = std::max(running, ms[i]);
    tokens_.push_back(tokens[i]);
    ms_.push_back(running);
  }
}

double StepTimeCurve::ms(double t) const {
  if (t <= tokens_.front() || tokens_.size() == 1) return ms_.front();
  size_t i = std::upper_bound(tokens_.begin(), tokens_.end(), t) - tokens_.begin();
  if (i == tokens_.size()) i = tokens_.size() - 1;
  double t0 = tokens_[i - 1], t1 = tokens_[i];
  return ms_[i - 1] + (ms_[i] - ms_[i - 1]) * (t - t0) / (t1 - t0);
}

int MTPVarlen::budget(const std::vector<std::vector<double>>& conf) const {
  const double requests = static_cast<double>(conf.size());
  double tau = requests, best = requests / curve_.ms(requests);
  int admitted = 0;
  for (const Draft& d : ranked_drafts(conf)) {
    double next = (tau + d.survival) / curve_.ms(requests + admitted + 1);
    if (next <= best) break;
    tau += d.survival;
    best = next;
    ++admitted;
  }
  return admitted;
}

std::vector<int> MTPVarlen::distribute(int budget, const std::vector<std::vector<double>>& conf) {
  std::vector<int> lens(conf.size(), 0);
  std::vector<Draft> drafts = ranked_drafts(conf);
  for (int i = 0; i < budget && i < static_cast<int>(drafts.size()); ++i) ++lens[drafts[i].request];
  return lens;
}

std::vector<int> MTPVarlen::schedule(const std::vector<std::vector<double>>& conf) const {
  return distribute(budget(conf), conf);
}

}  // namespace deepinfer
