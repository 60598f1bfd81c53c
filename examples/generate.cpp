// generate: prints text from a GPT that train_gpt trained and saved, byte by byte.
//
//   build/examples/train_gpt --steps 300 --save run
//   build/examples/generate --load run --prompt "The gradient" --tokens 200 --seed 1
//
// The model's shape flags (--layers, --heads, --embd, --seq) are train_gpt's, with its
// defaults; a checkpoint of another shape is refused with the flag to pass. The prompt's
// bytes fill a KV cache, then each new byte is one forward of one position, drawn with
// --temperature, --top-k and --top-p from the generator --seed sets: a seed gives the same
// text every time.
#include <cstdio>
#include <iostream>
#include <string>

#include "dist/comm/fake_group.h"
#include "dist/zero/sharded_model.h"
#include "nn/generate.h"
#include "training.h"
#include "zerograd.h"

using namespace zg;

namespace {

struct Flags {
  std::string load, prompt = "The gradient", device = "cpu";
  int64_t tokens = 200, layers = 4, heads = 4, embd = 128, seq = 64;
  uint64_t seed = 1;
  nn::SamplingOptions sampling{.temperature = 0.8, .top_k = 0, .top_p = 0.95};
};

void usage() {
  std::cout << "usage: generate --load DIR [flags]\n"
               "  --load DIR          a checkpoint folder train_gpt --save wrote\n"
               "  --prompt TEXT       the text to continue (default \"The gradient\")\n"
               "  --tokens N          bytes to generate (default 200); past --seq, on a window of the last --seq\n"
               "  --temperature X     softmax temperature; 0 is greedy (default 0.8)\n"
               "  --top-k K           sample among the K most likely bytes only (default 0: all)\n"
               "  --top-p P           sample among the fewest bytes holding probability P (default 0.95)\n"
               "  --seed S            the generator's seed (default 1)\n"
               "  --device cpu|cuda   where to run (default cpu)\n"
               "  --layers L --heads H --embd C --seq T   the model's shape, as train_gpt was given it\n"
               "                      (defaults 4, 4, 128, 64: train_gpt's)\n";
}

bool parse(int argc, char** argv, Flags& f) {
  examples::FlagReader flag("generate", argc, argv);
  while (flag.next()) {
    const std::string& a = flag.name();
    if (a == "--help") return false;
    else if (a == "--load") f.load = flag.value();
    else if (a == "--prompt") f.prompt = flag.value();
    else if (a == "--tokens") f.tokens = flag.count(0);
    else if (a == "--temperature") f.sampling.temperature = flag.number();
    else if (a == "--top-k") f.sampling.top_k = flag.count(0);
    else if (a == "--top-p") f.sampling.top_p = flag.number();
    else if (a == "--seed") f.seed = flag.count<uint64_t>(0);
    else if (a == "--device") f.device = flag.value();
    else if (a == "--layers") f.layers = flag.count(1);
    else if (a == "--heads") f.heads = flag.count(1);
    else if (a == "--embd") f.embd = flag.count(1);
    else if (a == "--seq") f.seq = flag.count(2);
    else flag.unknown();
  }
  ZG_CHECK(!f.load.empty(), "generate: --load DIR is required (a folder train_gpt --save wrote)");
  ZG_CHECK(!f.prompt.empty(), "generate: --prompt must not be empty");
  return true;
}

int run(const Flags& f) {
  const Device device(f.device);
  nn::GPTConfig config;
  config.n_layer = f.layers, config.n_head = f.heads, config.n_embd = f.embd;
  config.vocab_size = 256, config.block_size = f.seq;
  nn::GPT model(config, TensorOptions(DType::f32).device(device));
  // The checkpoint's master weights, through the same flat units train_gpt saved from.
  dist::SingleRank one;
  dist::ShardedModel holder(model, one, {.compute_dtype = DType::f32});
  Metadata meta;
  try {
    meta = holder.load(f.load);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + "\n(generate builds the GPT from --layers, --heads, --embd and --seq: pass the "
                "values train_gpt was given)");
  }
  for (const auto& [key, flag, value] : {std::tuple{"n_layer", "--layers", f.layers}, std::tuple{"n_head", "--heads", f.heads},
                                        std::tuple{"n_embd", "--embd", f.embd}, std::tuple{"seq", "--seq", f.seq}}) {
    const auto saved = meta.find(key);
    ZG_CHECK(saved == meta.end() || saved->second == std::to_string(value), "generate: ", f.load,
             " holds a GPT with ", key, " ", saved->second, "; pass ", flag, " ", saved->second);
  }
  std::vector<int64_t> bytes;
  for (unsigned char c : f.prompt) bytes.push_back(c);
  const Tensor prompt = tensor<int64_t>(bytes, {1, static_cast<int64_t>(bytes.size())}).to(device);
  manual_seed(f.seed);
  const std::vector<int64_t> text = nn::generate(model, prompt, f.tokens, f.sampling).to(kCPU).to_vector<int64_t>();
  std::string out;
  for (int64_t b : text) out.push_back(static_cast<char>(b));
  std::printf("%s\n", out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  try {
    if (!parse(argc, argv, f)) {
      usage();
      return 0;
    }
    return run(f);
  } catch (const std::exception& e) {  // a zg::Error, or the standard library's
    std::cerr << e.what() << "\n";
    return 1;
  }
}
