#include "dist/comm/agreement.h"

#include <algorithm>
#include <charconv>
#include <cstring>

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

Agreement::Agreement(ProcessGroup& group, Device on, const std::vector<AgreedValue>& values) : values_(values) {
  if (group.size() == 1) return;  // one rank agrees with itself: no collective, nothing read back
  std::vector<double> bounds;
  for (const AgreedValue& v : values) bounds.insert(bounds.end(), {v.value, -v.value});
  bounds_ = tensor<double>(bounds).to(on);
  work_ = group.all_reduce_async(bounds_, ReduceKind::max);
}

void Agreement::check(const std::string& who) {
  if (!work_) return;
  work_->wait();
  const std::vector<double> extremes = bounds_.to_vector<double>();
  for (size_t i = 0; i < values_.size(); ++i) {
    const auto show = values_[i].show ? values_[i].show : shortest;
    ZG_CHECK(extremes[2 * i] == -extremes[2 * i + 1], who, " a different ", values_[i].name, " on some ranks (from ",
             show(-extremes[2 * i + 1]), " to ", show(extremes[2 * i]), "); every rank must pass the same");
  }
}

// The first failing rank's message travels to the others in a broadcast of this many
// bytes (longer messages are cut): every rank then throws with the reason, not only the thrower.
constexpr int64_t kMessageBytes = 2048;

void all_or_none(ProcessGroup& group, Device device, const std::string& who, const std::string& consequence,
                 const std::function<void()>& fn) {
  std::string problem;
  try {
    fn();
  } catch (const std::exception& e) {  // a std::filesystem error too
    problem = e.what();
  }
  const auto with_consequence = [&](const std::string& text) {
    return consequence.empty() ? text : text + " (" + consequence + ")";
  };
  if (group.size() == 1) {
    if (!problem.empty()) throw Error(with_consequence(problem));
    return;
  }
  // failed[q] = 1 where rank q threw: every rank learns how many did and which first.
  const Device on = agreement_device(group, device);
  std::vector<double> mine(static_cast<size_t>(group.size()), 0.0);
  mine[static_cast<size_t>(group.rank())] = problem.empty() ? 0.0 : 1.0;
  const Tensor failed = tensor<double>(mine).to(on);
  group.all_reduce(failed, ReduceKind::sum);
  const std::vector<double> failures = failed.to_vector<double>();
  const auto threw = [](double x) { return x > 0; };  // (a fake group's sum is N times this rank's)
  const auto first = std::find_if(failures.begin(), failures.end(), threw);
  if (first == failures.end()) return;
  const int thrower = static_cast<int>(first - failures.begin());
  const int64_t count = std::count_if(failures.begin(), failures.end(), threw);
  // The first thrower's message, as bytes in an i64 buffer (a broadcast moves bytes).
  std::vector<int64_t> words(kMessageBytes / sizeof(int64_t), 0);
  if (group.rank() == thrower)
    std::memcpy(words.data(), problem.data(), std::min<size_t>(problem.size(), kMessageBytes - 1));
  const Tensor message = tensor<int64_t>(words).to(on);
  group.broadcast(message, thrower);
  if (!problem.empty()) throw Error(with_consequence(problem));
  const std::vector<int64_t> received = message.to_vector<int64_t>();
  const char* text = reinterpret_cast<const char*>(received.data());
  const std::string reason(text, strnlen(text, kMessageBytes - 1));
  fail(who, ": rank ", thrower, count > 1 ? " (and " + std::to_string(count - 1) + " other)" : "", " failed: ", reason,
       consequence.empty() ? "" : "; ", consequence);
}

}  // namespace zg::dist
