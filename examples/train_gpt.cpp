// train_gpt: trains a small GPT on a text file, byte by byte, and reads like a
// training loop should -- data, model, its parameters in flat units (a ShardedModel
// over a group of one: train_zero's code at N = 1), then per step: forward, backward,
// step (gradient norm and inf check, clip, AdamW), progress line.
//
//   build/examples/train_gpt --steps 200
//   build/examples/train_gpt --dtype bf16 --save run --save-every 50
//   build/examples/train_gpt --resume run --steps 300
//   build/examples/train_gpt --init-from-hf gpt2/model.safetensors --seq 128 --steps 100
//
// The last line is "final loss: X" so scripts can read it.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>

#include "dist/comm/fake_group.h"
#include "dist/zero/sharded_model.h"
#include "nn/gpt.h"
#include "nn/hf_gpt2.h"
#include "optim/grad_scaler.h"
#include "optim/schedule.h"
#include "training.h"
#include "zerograd.h"

using namespace zg;

namespace {

struct Flags : examples::TrainingFlags {
  std::optional<double> dropout;  // unset: 0, or the --init-from-hf file's
  std::string init_from_hf;
};

void usage() {
  std::cout << "usage: train_gpt [flags]\n"
               "  --batch B          sequences per step (default 8)\n"
               "  --dtype f32|bf16|f16   compute dtype; master weights and Adam state stay f32 (f16 adds a grad scaler)\n"
               "  --device cpu|cuda  where to train (default cpu)\n"
               "  --dropout P        dropout probability (default 0; with --init-from-hf, its config.json's)\n"
               "  --resume DIR       continue from a training checkpoint (train_zero's too, at any --ranks)\n"
               "  --init-from-hf F   fine-tune a Hugging Face GPT-2 (its model.safetensors; the shape is the file's,\n"
               "                     n_head from the config.json beside it, else --heads; a vocabulary of >= 256)\n"
            << Flags().common_help();
}

bool parse(int argc, char** argv, Flags& f) {
  examples::FlagReader flag("train_gpt", argc, argv);
  while (flag.next()) {
    const std::string& a = flag.name();
    if (a == "--help") return false;
    else if (f.read(flag)) continue;
    else if (a == "--dropout") f.dropout = flag.number();
    else if (a == "--init-from-hf") f.init_from_hf = flag.value();
    else flag.unknown();
  }
  f.check("train_gpt");
  return true;
}

std::string memory_line(Device device) {
  const MemoryStats s = memory_stats(device);
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  char line[160];
  std::snprintf(line, sizeof line, "param %.1f grad %.1f opt %.1f act(peak) %.1f MiB",
                mib(s[MemoryCategory::parameter]), mib(s[MemoryCategory::gradient]),
                mib(s[MemoryCategory::optimizer_state]), mib(s.peak_of(MemoryCategory::activation)));
  return line + examples::host_memory_part();
}

int run(const Flags& f) {
  const Device device(f.device);
  ZG_CHECK(device.type != DeviceType::meta, "train_gpt: --device meta holds no values to train; use cpu or cuda");
  const DType compute = f.dtype == "f32" ? DType::f32 : f.dtype == "bf16" ? DType::bf16 : f.dtype == "f16" ? DType::f16
                        : throw Error("train_gpt: --dtype must be f32, bf16 or f16, got " + f.dtype);
  dist::SingleRank one;
  const auto writer = f.claim_save("train_gpt", one, device);
  examples::TextData data("train_gpt", f.data, f.seq);
  manual_seed(f.seed);

  nn::GPTConfig config;
  config.n_layer = f.layers, config.n_head = f.heads, config.n_embd = f.embd;
  config.vocab_size = 256, config.block_size = f.seq;
  ZG_CHECK(f.init.empty() || f.init_from_hf.empty(), "train_gpt: --init and --init-from-hf both give the starting "
           "weights; pass one");
  if (!f.init_from_hf.empty()) {  // the file's shape; byte tokens are ids of its vocabulary
    const bool has_json = std::filesystem::is_regular_file(std::filesystem::path(f.init_from_hf).parent_path() / "config.json");
    config = nn::hf_gpt2_config(f.init_from_hf, has_json ? 0 : f.heads);
    ZG_CHECK(config.vocab_size >= 256, "train_gpt: --init-from-hf ", f.init_from_hf, " has a vocabulary of ",
             config.vocab_size, ", too few for byte tokens (256)");
    ZG_CHECK(f.seq <= config.block_size, "train_gpt: --seq ", f.seq, " is longer than the positions of ", f.init_from_hf,
             " (", config.block_size, ")");
  }
  config.dropout = f.dropout.value_or(config.dropout);
  config.activation_checkpointing = f.checkpointing;
  nn::GPT model(config, TensorOptions(DType::f32).device(device));
  if (!f.init.empty()) nn::load_state(model, f.init);
  if (!f.init_from_hf.empty()) nn::load_hf_gpt2(model, f.init_from_hf);
  // One device is a group of one: the parameters move into flat units (full, unsharded),
  // and clipping, loss scaling, AdamW and checkpoints are train_zero's code at N = 1.
  // Offload needs a stage that shards what it moves: the least ZeroConfig accepts (at
  // N = 1 every stage holds what DDP holds).
  dist::ZeroConfig zero{.compute_dtype = compute, .adamw = {0.9, 0.95, 1e-8, f.weight_decay},
                        .max_grad_norm = f.max_grad_norm, .offload = f.offloaded(), .offload_dir = f.offload_dir};
  while (zero.stage < 3 && !zero.problem(one.size()).empty()) ++zero.stage;
  const std::string wrong = zero.problem(one.size());
  ZG_CHECK(wrong.empty(), "train_gpt: ", wrong);
  f.cap_host_pool();
  dist::ShardedModel trainer(model, one, zero);
  optim::GradScaler scaler({65536.0, 2.0, 0.5, 2000, compute == DType::f16});
  const examples::RunRecord record(config.n_layer, config.n_head, config.n_embd, f.seq);
  int64_t first_step = 0;
  if (!f.resume.empty()) {
    const Metadata meta = trainer.load(f.resume, &scaler);
    first_step = record.resume("train_gpt", f.resume, meta, data).value_or(trainer.steps());
    ZG_CHECK(first_step >= trainer.steps(), "train_gpt: ", f.resume, ": train_step ", first_step,
             " is before the optimizer's step ", trainer.steps());
    ZG_CHECK(first_step < f.steps, "train_gpt: ", f.resume, " is at step ", first_step, ": --steps ", f.steps,
             " leaves nothing to train");
    std::printf("resumed from %s at step %lld\n", meta.at("path").c_str(), static_cast<long long>(first_step));
  }
  std::printf("GPT: %lld layers, %lld heads, n_embd %lld, %lld parameters; %s compute on %s; %zu bytes of text\n",
              static_cast<long long>(config.n_layer), static_cast<long long>(config.n_head),
              static_cast<long long>(config.n_embd),
              static_cast<long long>(model.num_parameters()), name(compute), device.str().c_str(), data.tokens.size());

  double loss_value = NAN;
  examples::RunTrace trace(f, one);
  for (int64_t step = first_step; step < f.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    Context::current().allocator(device)->reset_peaks();
    auto [inputs, targets] = data.next_batch(f.batch, f.seq, device);

    trainer.zero_grad();
    Tensor loss;
    {
      MemoryScope scope(MemoryCategory::activation);
      loss = model.forward(inputs, targets).loss;
      scaler.scale(loss).backward();
    }
    // One reduction gives the norm for clipping and tells whether f16 overflowed.
    const double lr = optim::warmup_cosine_lr(step, f.lr, f.min_lr, f.warmup, f.steps);
    const dist::StepResult result = trainer.step(lr, &scaler);  // norm, inf check, clip, AdamW
    const double norm = result.grad_norm;
    const bool take = result.stepped;
    loss_value = loss.item<double>();  // the step's one read-back for the progress line

    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("step %4lld/%lld | loss %.4f | norm %6.3f | %7.0f tok/s | lr %.2e | %s%s\n",
                static_cast<long long>(step + 1), static_cast<long long>(f.steps), loss_value, norm,
                static_cast<double>(f.batch * f.seq) / seconds, lr, memory_line(device).c_str(),
                take ? "" : " | skipped (inf/nan gradients)");
    std::fflush(stdout);
    f.save_after(step + 1, trainer, record.save(data, step + 1), &scaler);
  }
  trace.finish(device, "train_gpt: bytes by category, steps " + std::to_string(first_step + 1) + "-" +
                           std::to_string(f.steps));
  std::printf("final loss: %.4f\n", loss_value);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Flags flags;
    if (!parse(argc, argv, flags)) {
      usage();
      return 0;
    }
    // One rank: N copies of it would each train the whole model and write the same files.
    ZG_CHECK(dist::launched_world_size() == 1, "train_gpt trains on one rank, and mpirun started ",
             dist::launched_world_size(), " processes; examples/train_zero runs a process a rank (the same flags, "
             "--stage 0-3)");
    return run(flags);
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's (bad_alloc)
    std::cerr << e.what() << "\n";
    return 1;
  }
}
