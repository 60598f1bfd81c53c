// What the training examples (train_gpt, train_zero) share: the text they learn, their
// flags, and what their checkpoints record beside the weights.
#pragma once

#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zerograd.h"

#ifndef ZG_SOURCE_DIR
#define ZG_SOURCE_DIR "."
#endif

namespace zg::examples {

// A text file as byte-level tokens (vocabulary 256), read in windows of seq + 1 bytes:
// batch row b of a step starts at position + b * seq.
struct TextData {
  std::vector<int64_t> tokens;
  int64_t position = 0;
  int64_t windows = 0;  // start positions of a window of seq + 1 bytes

  TextData(const std::string& who, const std::string& path, int64_t seq) {
    ZG_CHECK(std::filesystem::is_regular_file(path), who, ": --data ", path, " is not a readable file");
    std::ifstream in(path, std::ios::binary);
    ZG_CHECK(in.good(), who, ": cannot read ", path);
    for (char c; in.get(c);) tokens.push_back(static_cast<unsigned char>(c));
    windows = static_cast<int64_t>(tokens.size()) - seq - 1;
    ZG_CHECK(windows > 0, who, ": the text has ", tokens.size(), " bytes, fewer than --seq + 2");
  }

  // inputs [B, T] and targets [B, T] (the next byte of each input byte)
  std::pair<Tensor, Tensor> next_batch(int64_t batch, int64_t seq, Device device) {
    std::vector<int64_t> x, y;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t start = (position + b * seq) % windows;
      x.insert(x.end(), tokens.begin() + start, tokens.begin() + start + seq);
      y.insert(y.end(), tokens.begin() + start + 1, tokens.begin() + start + seq + 1);
    }
    position = (position + batch * seq) % windows;
    const TensorOptions ids = TensorOptions(DType::i64).device(device);
    return {tensor(x, {batch, seq}, ids), tensor(y, {batch, seq}, ids)};
  }
};

// Command-line flags, one at a time: `while (flags.next())` then compare flags.name()
// and read its value as text, a real number or a whole number in range.
class FlagReader {
 public:
  FlagReader(std::string who, int argc, char** argv) : who_(std::move(who)), argc_(argc), argv_(argv) {}
  bool next() {
    if (++i_ >= argc_) return false;
    name_ = argv_[i_];
    return true;
  }
  const std::string& name() const { return name_; }
  std::string value() {
    ZG_CHECK(i_ + 1 < argc_, who_, ": ", name_, " needs a value");
    return argv_[++i_];
  }
  double number() {  // a real number: --lr, --dropout
    const std::string v = value();
    double x = 0;
    ZG_CHECK(parse_number(v, x), who_, ": ", name_, " expects a number, got '", v, "'");
    return x;
  }
  template <class T = int64_t>
  T count(std::type_identity_t<T> least) {  // a whole number >= least: sizes, steps, seeds
    const std::string v = value();
    T n = 0;
    ZG_CHECK(parse_number(v, n) && n >= least, who_, ": ", name_, " expects a whole number >= ", least, ", got '", v,
             "'");
    return n;
  }
  [[noreturn]] void unknown() { fail(who_, ": unknown flag ", name_, " (see --help)"); }

 private:
  std::string who_;
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string name_;
};

// " | host grad G opt O MiB": this rank's host-pool bytes (offload), or "" when it holds none.
inline std::string host_memory_part() {
  const MemoryStats h = host_memory_stats();
  if (h.allocated_total == 0) return "";
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  char part[120];
  std::snprintf(part, sizeof part, " | host param %.2f grad %.2f opt %.2f MiB", mib(h[MemoryCategory::parameter]),
                mib(h[MemoryCategory::gradient]), mib(h[MemoryCategory::optimizer_state]));
  return part;
}

// Offload nvme: this rank's file tier -- the state it holds, the bytes read and written and
// their rates over the time I/O was in flight -- and the host pool's peak; "" without one.
inline std::string file_tier_line(const dist::ShardedModel& sharded) {
  const FileTierStats t = sharded.file_tier_stats();
  if (t.paged_bytes == 0) return "";
  auto mib = [](double b) { return b / (1 << 20); };
  auto rate = [](int64_t bytes, double s) { return s > 0 ? static_cast<double>(bytes) / s / 1e6 : 0.0; };
  char line[300];
  std::snprintf(line, sizeof line, "file tier: %.2f MiB of state (%s), read %.2f MiB at %.0f MB/s, written %.2f MiB "
                "at %.0f MB/s; host pool peak %.2f MiB\n", mib(static_cast<double>(t.paged_bytes)),
                t.direct ? "O_DIRECT" : "buffered", mib(static_cast<double>(t.bytes_read)), rate(t.bytes_read, t.read_seconds),
                mib(static_cast<double>(t.bytes_written)), rate(t.bytes_written, t.write_seconds),
                mib(static_cast<double>(host_memory_stats().peak_total)));
  return line;
}

// The flags both examples take, with their defaults: the data, the model's shape, the
// schedule, dtype and device, checkpoints, the seed.
struct TrainingFlags {
  std::string data = std::string(ZG_SOURCE_DIR) + "/examples/data/gradients.txt";
  int64_t steps = 200, batch = 8, seq = 64, layers = 4, heads = 4, embd = 128, warmup = 20;
  double lr = 3e-3, min_lr = 3e-4, max_grad_norm = 1.0, weight_decay = 0.1;
  std::string dtype = "f32", device = "cpu", save, resume, export_path, init, offload = "none", trace, offload_dir;
  double host_budget_mib = 0;  // 0: no cap
  int64_t save_every = 0;
  bool checkpointing = false;
  uint64_t seed = 1337;

  // Reads the reader's current flag if it is one of these, else returns false.
  bool read(FlagReader& flag) {
    const std::string& a = flag.name();
    if (a == "--data") data = flag.value();
    else if (a == "--steps") steps = flag.count(1);
    else if (a == "--batch") batch = flag.count(1);
    else if (a == "--seq") seq = flag.count(2);
    else if (a == "--layers") layers = flag.count(1);
    else if (a == "--heads") heads = flag.count(1);
    else if (a == "--embd") embd = flag.count(1);
    else if (a == "--lr") lr = flag.number(), min_lr = lr / 10;
    else if (a == "--dtype") dtype = flag.value();
    else if (a == "--device") device = flag.value();
    else if (a == "--checkpointing") checkpointing = true;
    else if (a == "--save") save = flag.value();
    else if (a == "--resume") resume = flag.value();
    else if (a == "--save-every") save_every = flag.count(0);
    else if (a == "--export") export_path = flag.value();
    else if (a == "--init") init = flag.value();
    else if (a == "--seed") seed = flag.count<uint64_t>(0);
    else if (a == "--offload") offload = flag.value();
    else if (a == "--offload-dir") offload_dir = flag.value();
    else if (a == "--host-budget") host_budget_mib = flag.number();
    else if (a == "--max-grad-norm") max_grad_norm = flag.number();
    else if (a == "--trace") trace = flag.value();
    else return false;
    return true;
  }
  // The help lines of the flags that mean the same in every example, with this object's
  // defaults (--batch, --dtype, --device and --resume each example describes itself).
  std::string common_help() const {
    std::ostringstream out;
    out << "  --data PATH        text file to learn, byte-level tokens (default: examples/data/gradients.txt)\n"
        << "  --steps N          training steps (default " << steps << ")\n"
        << "  --seq T            tokens per sequence (default " << seq << ")\n"
        << "  --layers N --heads N --embd N   model size (default " << layers << ", " << heads << ", " << embd << ")\n"
        << "  --lr X             peak learning rate (default " << lr << "), warmup " << warmup
        << " steps then cosine to lr/10\n"
        << "  --checkpointing    recompute each block's activations in backward (less activation memory)\n"
        << "  --save DIR         write a training checkpoint at the end: DIR/latest names the newest save,\n"
        << "                     a folder of safetensors (one per rank); a save replaces the one before it.\n"
        << "                     The run holds DIR from its start (DIR/writer.lock): a second run on DIR, or a\n"
        << "                     DIR that cannot be written, is refused before the first step\n"
        << "  --save-every N     ... and every N steps\n"
        << "  --export FILE      the model's weights in one safetensors file (PyTorch, Hugging Face), written\n"
        << "                     with each save and at the end\n"
        << "  --init FILE        start from the weights in a safetensors file (an --export's, or any state of\n"
        << "                     this GPT's shape)\n"
        << "  --offload O        none, optimizer (master weights, Adam state and the gradient shard in host\n"
        << "                     memory, updated by the CPU AdamW; stages 1-3) or optimizer+params (stage 3:\n"
        << "                     the parameter shards too) or nvme (ZeRO-Infinity: all of them in a file in\n"
        << "                     --offload-dir, a few units in host memory at a time); the same results,\n"
        << "                     host bytes shown apart\n"
        << "  --offload-dir DIR  the folder of --offload nvme's file (a fast local disk)\n"
        << "  --host-budget MIB  cap each rank's host pool (where offload's bytes live) at MIB MiB\n"
        << "  --max-grad-norm X  clip the global gradient norm to X (default " << max_grad_norm << "; 0: no clipping)\n"
        << "  --trace FILE       every allocation and range of the training loop, all ranks of this process:\n"
        << "                     a trace for ui.perfetto.dev in FILE, a figure of each rank's bytes by\n"
        << "                     category in FILE with .svg for its extension\n"
        << "  --seed N           initialisation and data seed (default " << seed << ")\n"
        << "  --help             this text\n";
    return out.str();
  }
  // Once every flag is read: what they allow together.
  void check(const std::string& who) const {
    dist::parse_offload(offload);  // a bad name is refused before training
    ZG_CHECK(host_budget_mib >= 0, who, ": --host-budget must be >= 0 MiB, got ", host_budget_mib);
    ZG_CHECK(max_grad_norm >= 0, who, ": --max-grad-norm must be >= 0 (0: no clipping), got ", max_grad_norm);
    ZG_CHECK(batch <= (int64_t{1} << 40) / seq, who, ": --batch ", batch, " x --seq ", seq,
             " tokens a step is more than 2^40");
    // Found out before training, not after it: an export writes a file in a folder that
    // must exist (--save's folder is claimed, and so made, at the start: claim_save).
    for (const auto& [flag, path] : {std::pair{"--export", export_path}, std::pair{"--trace", trace}}) {
      if (path.empty()) continue;
      const std::filesystem::path folder = std::filesystem::absolute(path).parent_path();
      ZG_CHECK(std::filesystem::is_directory(folder), who, ": ", flag, " ", path, ": ", folder.string(),
               " is not a directory");
    }
  }

  dist::Offload offloaded() const { return dist::parse_offload(offload); }
  // --host-budget: this rank's host pool capped (the library's own budget), before the model is built.
  void cap_host_pool() const {
    if (host_budget_mib > 0) Context::current().host_allocator()->set_cap(static_cast<int64_t>(host_budget_mib * (1 << 20)));
  }

  // --save's folder, claimed for the run's life before its first step (every rank calls
  // it): a folder another job writes, or one that cannot be written, ends every rank now.
  std::optional<dist::CheckpointWriterLock> claim_save(const std::string& who, dist::ProcessGroup& group,
                                                       Device device) const {
    std::optional<dist::CheckpointWriterLock> writer;
    if (!save.empty()) writer.emplace(group, device, save, who + ": --save");
    return writer;
  }

  // After `steps_done` steps (every --save-every, and at the end): the checkpoint (--save,
  // with `record`) and the weights (--export). Collectives: every rank calls it.
  void save_after(int64_t steps_done, dist::ShardedModel& model, const Metadata& record,
                  const optim::GradScaler* scaler = nullptr) const {
    if (steps_done != steps && (save_every == 0 || steps_done % save_every != 0)) return;
    if (!save.empty()) model.save(save, record, scaler);
    if (!export_path.empty()) model.export_consolidated(export_path);
  }
};

// --trace: one recording of the training loop for every rank of this process (ranks may
// be threads: rank 0 starts and ends it, between barriers; under mpirun, rank 0's process
// records its own rank).
class RunTrace {
 public:
  RunTrace(const TrainingFlags& flags, dist::ProcessGroup& group) : path_(flags.trace), group_(group) {
    if (path_.empty()) return;
    group_.barrier();
    if (group_.rank() == 0) shared().recording.emplace(shared().timeline);
    group_.barrier();
  }
  // After the last step: the trace in FILE, every rank's bytes on `device` in FILE.svg.
  void finish(Device device, const std::string& title) {
    if (path_.empty()) return;
    group_.barrier();
    if (group_.rank() != 0) return;
    Shared& s = shared();
    s.recording.reset();
    std::set<int> ranks;
    for (const TimelineEvent& e : s.timeline.events()) ranks.insert(e.rank);
    std::vector<MemoryPanel> panels;
    for (int rank : ranks)
      if (MemorySeries series = memory_series(s.timeline, rank, device); !series.x.empty())
        panels.push_back({"rank " + std::to_string(rank), std::move(series), {}, false});
    const auto write = [](const std::string& file, const std::string& text) {
      std::ofstream out(file, std::ios::binary);
      out << text;
      ZG_CHECK(out.flush().good(), "--trace: could not write ", file);
    };
    write(path_, chrome_trace_json(s.timeline));
    std::filesystem::path figure = path_;
    figure.replace_extension(".svg");
    if (!panels.empty()) write(figure.string(), memory_figure_svg(panels, title));
    std::printf("trace: %s (ui.perfetto.dev), figure: %s%s\n", path_.c_str(), figure.c_str(),
                s.timeline.dropped() ? (" -- " + std::to_string(s.timeline.dropped()) +
                                        " events past the timeline's capacity were not kept").c_str() : "");
  }

 private:
  struct Shared {
    MemoryTimeline timeline;
    std::optional<MemoryTimelineRecording> recording;
  };
  static Shared& shared() {
    static Shared s;
    return s;
  }
  std::string path_;
  dist::ProcessGroup& group_;
};

// A run's checkpoint records, beside the weights: the model's shape (a resume with
// another --heads would load the same tensors into a different model, silently), where
// the data stream is, and the training step -- which counts steps skipped for inf/NaN
// gradients too, unlike AdamW's count of updates -- so the schedule and the end of the
// run continue where they were.
struct RunRecord {
  Metadata shape;  // n_layer, n_head, n_embd, seq

  RunRecord(int64_t layers, int64_t heads, int64_t embd, int64_t seq)
      : shape{{"n_layer", std::to_string(layers)}, {"n_head", std::to_string(heads)},
              {"n_embd", std::to_string(embd)}, {"seq", std::to_string(seq)}} {}

  Metadata save(const TextData& data, int64_t steps_done) const {
    Metadata meta = shape;
    meta["data_position"] = std::to_string(data.position);
    meta["train_step"] = std::to_string(steps_done);
    return meta;
  }
  // Checks a checkpoint's record against this run, moves `data` to where it was, and
  // returns its training step, if it recorded one.
  std::optional<int64_t> resume(const std::string& who, const std::string& path, const Metadata& meta, TextData& data) const {
    for (const auto& [key, value] : shape) {
      const auto saved = meta.find(key);
      ZG_CHECK(saved == meta.end() || saved->second == value, who, ": ", path, " is a checkpoint of a GPT with ", key,
               " ", saved->second, "; this run has ", value);
    }
    if (meta.count("data_position")) data.position = metadata_number<int64_t>(meta, "data_position", path, who.c_str());
    ZG_CHECK(data.position >= 0 && data.position < data.windows, who, ": ", path, ": data_position ", data.position,
             " is not a window of this text (0 to ", data.windows - 1, ")");
    if (!meta.count("train_step")) return std::nullopt;
    const int64_t step = metadata_number<int64_t>(meta, "train_step", path, who.c_str());
    ZG_CHECK(step >= 0, who, ": ", path, ": train_step ", step, " is not a step");
    return step;
  }
};

}  // namespace zg::examples
