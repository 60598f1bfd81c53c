#include "dist/comm/agreement.h"

#include <charconv>

namespace zg::dist {

namespace {

// The shortest decimal that reads back as x: values that differ show how.
std::string shortest(double x) {
  char text[32];
  return std::string(text, std::to_chars(text, text + sizeof text, x).ptr);
}

}  // namespace

void Hash53::mix_name_and_shape(const std::string& name, const Shape& shape) {
  mix(name.data(), name.size() + 1);  // with its terminating zero: "a" "bc" is not "ab" "c"
  const int64_t rank = static_cast<int64_t>(shape.size());
  mix(&rank, sizeof rank);
  mix(shape.data(), shape.size() * sizeof(int64_t));
}

Device agreement_device(const ProcessGroup& group, Device model_device) {
  const Device on = model_device.type == DeviceType::meta ? kCPU : model_device;
  return group.accepts(on) ? on : kCPU;
}

Agreement::Agreement(ProcessGroup& group, Device on, const std::vector<std::pair<std::string, double>>& values) {
  if (group.size() == 1) return;  // one rank agrees with itself: no collective, nothing read back
  std::vector<double> bounds;
  for (const auto& [name, value] : values) {
    names_.push_back(name);
    bounds.insert(bounds.end(), {value, -value});
  }
  bounds_ = tensor<double>(bounds).to(on);
  work_ = group.all_reduce_async(bounds_, ReduceKind::max);
}

void Agreement::check(const std::string& who) {
  if (!work_) return;
  work_->wait();
  const std::vector<double> extremes = bounds_.to_vector<double>();
  for (size_t i = 0; i < names_.size(); ++i)
    ZG_CHECK(extremes[2 * i] == -extremes[2 * i + 1], who, " a different ", names_[i], " on some ranks (from ",
             shortest(-extremes[2 * i + 1]), " to ", shortest(extremes[2 * i]), "); every rank must pass the same");
}

void all_or_none(ProcessGroup& group, Device device, const std::string& who, const std::string& consequence,
                 const std::function<void()>& fn) {
  std::string problem;
  try {
    fn();
  } catch (const std::exception& e) {  // a std::filesystem error too
    problem = e.what();
  }
  const Tensor failures =
      full({1}, problem.empty() ? 0.0 : 1.0, TensorOptions(DType::f64).device(agreement_device(group, device)));
  group.all_reduce(failures, ReduceKind::sum);
  if (!problem.empty()) throw Error(consequence.empty() ? problem : problem + " (" + consequence + ")");
  const double failed = failures.item<double>();
  ZG_CHECK(failed == 0, who, ": ", failed, " other rank(s) failed (their errors say why)",
           consequence.empty() ? "" : "; ", consequence);
}

}  // namespace zg::dist
