// Checkpoints: safetensors round trips, a file written by PyTorch, resumed
// training that continues the same curve (one device's: a ShardedModel over a group of
// one; at other world sizes, test_zero_checkpoint), and damaged files that must fail cleanly.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sys/stat.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <thread>

#include "dist/comm/local_group.h"
#include "legacy_checkpoint.h"
#include "nn/serialize.h"
#include "tensor/crc32c.h"
#include "tiny_gpt.h"

#ifndef ZG_TEST_FIXTURES
#define ZG_TEST_FIXTURES "tests/fixtures"
#endif

namespace zg::test {

namespace {

std::string temp_path(const std::string& name) {
  return "/tmp/zg_test_" + std::to_string(::getpid()) + "_" + name;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The one file of the one-rank save `dir` holds now.
std::string rank_file(const std::string& dir) {
  return dist::ShardedModel::current_save(dir) + "/rank-00000-of-00001.safetensors";
}

// Every tensor of a file, read, in file order.
std::vector<std::pair<std::string, Tensor>> tensors_of(const SafetensorsFile& file) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& name : file.names()) tensors.emplace_back(name, file.read(name));
  return tensors;
}

// A file with this header (length = its size unless given) followed by `data`.
std::string raw_file(const std::string& header, const std::string& data, uint64_t length = UINT64_MAX) {
  if (length == UINT64_MAX) length = header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out + header + data;
}

}  // namespace

TEST_CASE("safetensors round trip is bitwise exact for every dtype, views included") {
  manual_seed(4);
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"a.f64", randn({3, 2}, DType::f64)},
      {"b.f32.transposed", randn({4, 3}).t()},
      {"c.bf16", randn({5}, DType::bf16)},
      {"d.f16", randn({2, 2, 2}, DType::f16)},
      {"e.i64", arange(7)},
      {"f.i32", tensor<int32_t>({-5, 9})},
      {"g.bool", tensor<bool>({true, false, false})},
      {"h.scalar", tensor<double>({2.5}, {})},
      {"i.empty", zeros({0, 3})}};
  const std::string path = temp_path("roundtrip.safetensors");
  save_safetensors(path, tensors, {{"note", "hello"}});
  const SafetensorsFile file(path);
  CHECK(file.metadata().at("note") == "hello");
  CHECK(file.names().size() == tensors.size());
  for (const auto& [name, t] : tensors) {
    const std::string& tensor = name;  // INFO's lambda cannot capture a structured binding (Clang)
    INFO(tensor);
    const Tensor back = file.read(name);
    CHECK(back.dtype() == t.dtype());
    CHECK(back.shape() == t.shape());
    const Tensor original = t.contiguous();
    if (t.nbytes() > 0) CHECK(std::memcmp(back.data_ptr(), original.data_ptr(), static_cast<size_t>(t.nbytes())) == 0);
  }
  std::remove(path.c_str());
}

TEST_CASE("crc32c gives the published check values, at any alignment, in pieces or whole") {
  // RFC 3720 (iSCSI), appendix B.4, and the "123456789" check value of the CRC catalogue.
  std::string zeros32(32, '\0'), ones32(32, '\xff'), up(32, 0), down(32, 0);
  for (int i = 0; i < 32; ++i) up[i] = static_cast<char>(i), down[i] = static_cast<char>(31 - i);
  const std::vector<std::pair<std::string, uint32_t>> known = {
      {zeros32, 0x8A9136AA}, {ones32, 0x62A8AB43}, {up, 0x46DD794E}, {down, 0x113FDB5C}, {"123456789", 0xE3069283}, {"", 0}};
  for (const auto& [bytes, crc] : known) {
    CHECK(crc32c(bytes.data(), bytes.size()) == crc);
    CHECK(detail::crc32c_portable(bytes.data(), bytes.size()) == crc);
  }
  std::string random(1000, 0);
  for (size_t i = 0; i < random.size(); ++i) random[i] = static_cast<char>((i * 7919 + 13) % 251);
  for (size_t offset = 0; offset < 9; ++offset)
    for (size_t length : {0, 1, 7, 8, 9, 63, 500, 991}) {
      CAPTURE(offset);
      CAPTURE(length);
      const char* p = random.data() + offset;
      const uint32_t whole = crc32c(p, length);
      CHECK(whole == detail::crc32c_portable(p, length));
      CHECK(crc32c(p + length / 3, length - length / 3, crc32c(p, length / 3)) == whole);
    }
}

TEST_CASE("each tensor's checksum is saved and checked: a flipped bit is an error naming the tensor and its bytes") {
  const std::string path = temp_path("checksummed.safetensors");
  save_safetensors(path, {{"a", tensor<float>({1, 2, 3})}, {"b", tensor<float>({4, 5})}, {"empty", zeros({0})}},
                   {{"note", "kept"}});
  {
    const SafetensorsFile file(path);
    CHECK(file.metadata() == Metadata{{"note", "kept"}});  // the checksums are the reader's, not metadata
    CHECK(file.entry("b").crc32c.has_value());
    CHECK(file.read("b").to_vector<float>() == std::vector<float>{4, 5});
  }
  // Flip one bit of b's second value (the last 4 bytes of the file).
  std::string bytes = read_bytes(path);
  bytes[bytes.size() - 2] ^= 0x10;
  write_bytes(path, bytes);
  const SafetensorsFile file(path);
  const int64_t end = static_cast<int64_t>(bytes.size()), begin = end - 8;
  const std::string expected =
      "tensor 'b' (file bytes " + std::to_string(begin) + "-" + std::to_string(end) + ") fails its checksum";
  CHECK_THROWS_WITH_AS(file.read("b"), doctest::Contains(expected.c_str()), Error);
  CHECK(file.read("a").to_vector<float>() == std::vector<float>{1, 2, 3});  // the others still load
  CHECK(file.read("empty").numel() == 0);
  // The reader's key is refused as user metadata; malformed or dangling checksums are errors.
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{"a", zeros({1})}}, {{"crc32c/a", "00000000"}}),
                       doctest::Contains("metadata key 'crc32c/a' starts with 'crc32c/'"), Error);
  const std::string data4(4, '\0');
  const std::string entry = R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  write_bytes(path, raw_file(R"({"__metadata__":{"crc32c/a":"xyz"},)" + entry + "}", data4));
  CHECK_THROWS_WITH_AS(SafetensorsFile{path}, doctest::Contains("metadata 'crc32c/a' = 'xyz' is not a CRC-32C"), Error);
  write_bytes(path, raw_file(R"({"__metadata__":{"crc32c/z":"00000000"},)" + entry + "}", data4));
  CHECK_THROWS_WITH_AS(SafetensorsFile{path}, doctest::Contains("metadata 'crc32c/z' is the checksum of a tensor the file does not have"),
                       Error);
  std::remove(path.c_str());
}

TEST_CASE("a save leaves no temporary file, and removes those of killed saves to the same path") {
  // A save killed between writing its temporary file and renaming it left the file --
  // as large as the checkpoint -- for good. The next save to the path removes those no
  // writer holds locked, however recent (a quick restart on a nearly full disk must be
  // able to save); a live writer's and other paths' stay.
  const std::string dir = temp_path("temporaries");
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  auto leftover = [&](const std::string& name) {
    write_bytes(name, "partial");
    return name;
  };
  const std::vector<std::string> killed{leftover(path + ".tmp.node-1.cluster.4242.0"),
                                        leftover(path + ".tmp.other-host.77.3"),
                                        leftover(path + ".tmp.node-1.4243.0")};  // killed a moment ago
  const std::string locked = leftover(path + ".tmp.node-2.99.0");  // a live writer on another host
  const std::vector<std::string> kept{locked, leftover(dir + "/other.safetensors.tmp.node-1.4242.0"),
                                      leftover(path + ".tmp.notes"), leftover(path + ".tmp.a.b.c")};
  const int writer = ::open(locked.c_str(), O_RDONLY);
  REQUIRE(writer >= 0);
  REQUIRE(::flock(writer, LOCK_EX) == 0);
  save_safetensors(path, {{"x", ones({2})}});
  ::close(writer);
  for (const std::string& f : killed) CHECK_FALSE(std::filesystem::exists(f));
  for (const std::string& f : kept) CHECK(std::filesystem::exists(f));
  size_t files = 0;  // the save's own temporary is gone: it became the file
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++files;
  CHECK(files == 1 + kept.size());
  CHECK(SafetensorsFile(path).names() == std::vector<std::string>{"x"});
  // Saves racing to one path, each cleaning up as it starts, never remove each other's file.
  std::vector<std::thread> savers;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t)
    savers.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) try {
          save_safetensors(path, {{"x", full({2}, t)}});
        } catch (const Error&) {
          ++failures;
        }
    });
  for (auto& s : savers) s.join();
  CHECK(failures == 0);
  CHECK(SafetensorsFile(path).read("x").numel() == 2);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a SafetensorsWriter writes a tensor at a time, in any order; nothing is at the path until commit") {
  // What a sharded model's consolidated export needs: the whole model is never in
  // memory, so the file is laid out first and filled a unit at a time.
  const std::string dir = temp_path("writer");
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  save_safetensors(path, {{"old", ones({1})}});
  const auto files_in_dir = [&] {
    size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
    return n;
  };
  const Tensor a = arange(6, DType::f32).reshape({2, 3}), c = arange(4, DType::i64);
  {
    SafetensorsWriter file(path, {{"a", DType::f32, {2, 3}}, {"b", DType::bf16, {0}}, {"c", DType::i64, {4}}},
                           {{"written_by", "the test"}});
    file.write("c", c);
    file.write("a", a.t().contiguous().t());  // any layout of the values; written out contiguous
    CHECK_THROWS_WITH_AS(file.write("x", a), doctest::Contains(": 'x' is not in the file's layout"), Error);
    CHECK_THROWS_WITH_AS(file.write("a", a), doctest::Contains(": 'a' written twice"), Error);
    CHECK_THROWS_WITH_AS(file.write("b", zeros({0}, DType::f32)),
                         doctest::Contains(": 'b' was laid out as bf16[0], written as f32[0]"), Error);
    CHECK_THROWS_WITH_AS(file.commit(), doctest::Contains(": 'b' was laid out but never written"), Error);
    CHECK(SafetensorsFile(path).names() == std::vector<std::string>{"old"});  // not yet replaced
    CHECK(files_in_dir() == 2);                                                  // the file and the temporary
  }  // destroyed uncommitted: the temporary is gone, the old file stays
  CHECK(files_in_dir() == 1);
  CHECK(SafetensorsFile(path).names() == std::vector<std::string>{"old"});
  SafetensorsWriter file(path, {{"a", DType::f32, {2, 3}}, {"b", DType::bf16, {0}}, {"c", DType::i64, {4}}},
                         {{"written_by", "the test"}});
  file.write("b", zeros({0}, DType::bf16));
  file.write("c", c);
  file.write("a", a);
  file.commit();
  CHECK_THROWS_WITH_AS(file.commit(), doctest::Contains("was committed already"), Error);
  const SafetensorsFile written(path);
  CHECK(written.names() == std::vector<std::string>{"a", "b", "c"});  // the layout's order, not the writes'
  CHECK(written.metadata() == Metadata{{"written_by", "the test"}});
  CHECK(written.read("a").to_vector<float>() == a.to_vector<float>());  // (every read checks the checksum)
  CHECK(written.read("c").to_vector<int64_t>() == c.to_vector<int64_t>());
  CHECK(written.entry("a").crc32c == crc32c(a.data_ptr(), 24));
  CHECK(files_in_dir() == 1);
  // The same bytes as save_safetensors writes for those tensors.
  const std::string whole = dir + "/whole.safetensors";
  save_safetensors(whole, {{"a", a}, {"b", zeros({0}, DType::bf16)}, {"c", c}}, {{"written_by", "the test"}});
  CHECK(read_bytes(whole) == read_bytes(path));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a file written by PyTorch's safetensors loads with matching values") {
  const SafetensorsFile file(std::string(ZG_TEST_FIXTURES) + "/torch_small.safetensors");
  CHECK(file.metadata().at("written_by") == "safetensors.torch");
  const Tensor m = file.read("f32_matrix");
  CHECK(m.shape() == Shape{3, 4});
  CHECK(m.to_vector<float>()[5] == 5.0f / 4 - 1);
  CHECK(file.read("f64_vector").to_vector<double>() == std::vector<double>{1.5, -2.25, 1e-300, 3.0});
  const auto h = file.read("f16_values").to_vector<float>();
  CHECK(h[0] == static_cast<float>(Half(0.1f)));
  CHECK(h[1] == 65504.0f);
  CHECK(std::signbit(h[2]));
  CHECK(h[3] == static_cast<float>(Half(6e-8f)));
  const auto b = file.read("bf16_values").to_vector<float>();
  CHECK(b[1] == -3.140625f);
  CHECK(b[2] == static_cast<float>(BFloat16(1e30f)));
  CHECK(file.read("i64_ids").to_vector<int64_t>() == std::vector<int64_t>{0, -1, int64_t(1) << 40});
  CHECK(file.read("i32_scalar").item<int32_t>() == 7);
  CHECK(file.read("i32_scalar").dim() == 0);
  CHECK(file.read("bool_mask").to_vector<bool>() == std::vector<bool>{true, false, true});
  CHECK(file.read("empty").shape() == Shape{0, 5});
}

TEST_CASE("module state round trip, dtype conversion on load, and mismatches") {
  manual_seed(8);
  nn::GPT a(tiny_config());
  const std::string path = temp_path("module.safetensors");
  nn::save_state(a, path);
  manual_seed(9);
  nn::GPT b(tiny_config());
  nn::load_state(b, path);
  for (size_t i = 0; i < a.parameters().size(); ++i)
    CHECK(a.parameters()[i].to_vector<float>() == b.parameters()[i].to_vector<float>());
  b.to(DType::bf16);
  nn::load_state(b, path);  // f32 file into a bf16 model
  CHECK(b.wte->weight.dtype() == DType::bf16);

  nn::GPTConfig other = tiny_config();
  other.n_embd = 16;
  nn::GPT c(other);
  CHECK_THROWS_WITH_AS(nn::load_state(c, path),
                       doctest::Contains("tensor 'transformer.wte.weight' has shape [64, 32], expected [64, 16]"), Error);
  // A mismatch further down (the position table) leaves every tensor as it was; before,
  // wte was already overwritten when wpe was found not to fit.
  nn::GPTConfig shorter = tiny_config();
  shorter.block_size /= 2;
  manual_seed(10);
  nn::GPT d(shorter);
  const std::vector<float> wte_before = d.wte->weight.view({-1}).to_vector<float>();
  CHECK_THROWS_WITH_AS(nn::load_state(d, path), doctest::Contains("tensor 'transformer.wpe.weight' has shape"), Error);
  CHECK(d.wte->weight.view({-1}).to_vector<float>() == wte_before);
  nn::Linear lin(2, 2);
  CHECK_THROWS_WITH_AS(nn::load_state(lin, path), doctest::Contains("has no tensor 'weight'"), Error);
  // Not strict: what the file lacks keeps its value, what the module lacks is skipped;
  // both are listed. (Was: every name of the module had to be in the file.)
  nn::Module part;
  const auto wte = part.register_module("transformer", std::make_shared<nn::Module>())
                       ->register_module("wte", std::make_shared<nn::Embedding>(64, 32));
  const auto extra = part.register_module("extra", std::make_shared<nn::Linear>(2, 2));
  const std::vector<float> extra_before = extra->weight.view({-1}).to_vector<float>();
  const nn::LoadedState partial = nn::load_state(part, path, /*strict=*/false);
  CHECK(partial.missing == std::vector<std::string>{"extra.weight", "extra.bias"});
  CHECK(partial.unexpected.size() == a.named_parameters().size() - 1);  // all but transformer.wte.weight
  CHECK(wte->weight.view({-1}).to_vector<float>() == a.wte->weight.view({-1}).to_vector<float>());
  CHECK(extra->weight.view({-1}).to_vector<float>() == extra_before);
  CHECK_THROWS_WITH_AS(nn::load_state(part, path), doctest::Contains("has no tensor 'extra.weight'"), Error);
  // Into f16, a value past 65504 loaded as inf without a word; refused before anything changes.
  nn::Linear wide(2, 2), half(2, 2);
  {
    NoGradGuard no_grad;
    wide.bias.copy_(tensor<float>({1e30f, 1.0f}));
  }
  nn::save_state(wide, path);
  half.to(DType::f16);
  const std::vector<float> weight_before = half.weight.to(DType::f32).view({-1}).to_vector<float>();
  CHECK_THROWS_WITH_AS(nn::load_state(half, path),
                       doctest::Contains("tensor 'bias' (F32) holds values beyond the range of F16, which would load as inf"),
                       Error);
  CHECK(half.weight.to(DType::f32).view({-1}).to_vector<float>() == weight_before);
  // A destination copy_ refuses (a broadcast buffer) was found only when its turn came,
  // after the tensors before it were overwritten.
  nn::Module with_buffers, broadcast;
  with_buffers.register_buffer("x", tensor<float>({1, 2}));
  with_buffers.register_buffer("y", tensor<float>({3, 4}));
  nn::save_state(with_buffers, path);
  const Tensor x = zeros({2});
  broadcast.register_buffer("x", x);
  broadcast.register_buffer("y", zeros({1}).expand({2}));
  CHECK_THROWS_WITH_AS(nn::load_state(broadcast, path),
                       doctest::Contains("loading 'y' into: the destination f32[2] on cpu has broadcast (stride 0) dims"),
                       Error);
  CHECK(x.to_vector<float>() == std::vector<float>{0, 0});
  std::remove(path.c_str());
}

TEST_CASE("load_state takes a shared parameter under any of its names, and refuses two different values") {
  // As Hugging Face's GPT-2 ties lm_head.weight to transformer.wte.weight; torch's
  // state_dict() lists the tied weight under both names. Such a file was refused ("a
  // tensor 'lm_head.weight' the module does not have"), as was one with the head's only.
  struct TiedLM : nn::Module {
    std::shared_ptr<nn::Embedding> wte;
    std::shared_ptr<nn::Module> lm_head;
    TiedLM() {
      wte = register_module("wte", std::make_shared<nn::Embedding>(3, 2));
      lm_head = register_module("lm_head", std::make_shared<nn::Module>());
      lm_head->register_parameter("weight", wte->weight);
    }
  };
  const std::string path = temp_path("tied.safetensors");
  const Tensor values = tensor<float>({1, 2, 3, 4, 5, 6}).view({3, 2});
  const auto load = [&](const nn::NamedTensors& tensors) {
    save_safetensors(path, tensors);
    TiedLM model;
    REQUIRE(model.named_parameters(/*remove_duplicates=*/false).size() == 2);
    nn::load_state(model, path);
    CHECK(model.lm_head->named_parameters()[0].second.is_same(model.wte->weight));  // still one tensor
    return model.wte->weight.view({-1}).to_vector<float>();
  };
  const std::vector<float> expected{1, 2, 3, 4, 5, 6};
  CHECK(load({{"wte.weight", values}, {"lm_head.weight", values.clone()}}) == expected);
  CHECK(load({{"lm_head.weight", values}}) == expected);
  CHECK(load({{"wte.weight", values}}) == expected);

  TiedLM model;
  const std::vector<float> before = model.wte->weight.view({-1}).to_vector<float>();
  save_safetensors(path, {{"wte.weight", values}, {"lm_head.weight", values * 2.0}});
  CHECK_THROWS_WITH_AS(nn::load_state(model, path),
                       doctest::Contains("has different values for 'wte.weight' and 'lm_head.weight', two names of "
                                         "one shared parameter"),
                       Error);
  CHECK(model.wte->weight.view({-1}).to_vector<float>() == before);
  // Under neither name it is missing, under its first name.
  save_safetensors(path, {{"other", values}});
  CHECK_THROWS_WITH_AS(nn::load_state(model, path), doctest::Contains("has no tensor 'wte.weight'"), Error);
  const nn::LoadedState partial = nn::load_state(model, path, /*strict=*/false);
  CHECK(partial.missing == std::vector<std::string>{"wte.weight"});
  CHECK(partial.unexpected == std::vector<std::string>{"other"});
  CHECK(model.wte->weight.view({-1}).to_vector<float>() == before);
  std::remove(path.c_str());
}

TEST_CASE("a disabled GradScaler has no state: it saves none and loads none") {
  // An f32 run's checkpoint (scale 1) set an f16 run's scaler to 1 on resume.
  nn::Linear model(2, 2);
  dist::SingleRank one;
  dist::ShardedModel trainer(model, one, {.compute_dtype = DType::f32});
  const std::string dir = temp_path("scaler");
  optim::GradScaler disabled({.enabled = false}), enabled;
  trainer.save(dir, {}, &disabled);
  CHECK(SafetensorsFile(rank_file(dir)).metadata().count("loss_scale") == 0);
  trainer.load(dir, &enabled);
  CHECK(enabled.scale_factor() == 65536);
  enabled.update(true);  // 32768
  trainer.save(dir, {}, &enabled);
  CHECK(SafetensorsFile(rank_file(dir)).metadata().at("loss_scale") == "32768");
  trainer.load(dir, &disabled);  // a disabled scaler took the file's scale
  CHECK(disabled.scale_factor() == 1);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a training checkpoint round trip is bitwise exact and resumed training continues the same curve") {
  // On every device: a GPU run saves and resumes through the host, and its kernels
  // (fixed reduction trees, no atomics) repeat the same curve bit for bit.
  for (Device device : devices()) {
    INFO("on " << device.str());
    const Sequence s = fixed_sequence();
    const std::string dir = temp_path("train"), again = temp_path("train_again");
    std::vector<double> uninterrupted;
    {
      Context rank;
      ContextGuard guard(rank);
      TinyTrainer t(DType::bf16, false, 1, 0.1, device);
      for (int i = 0; i < 10; ++i) uninterrupted.push_back(t.step(s, 3e-3));
    }
    std::vector<double> resumed;
    std::vector<float> compute;
    {
      Context rank;
      ContextGuard guard(rank);
      TinyTrainer t(DType::bf16, false, 1, 0.1, device);
      for (int i = 0; i < 5; ++i) t.step(s, 3e-3);
      t.trainer->save(dir, {{"data_position", "5"}});
      compute = flat_values(t.model->named_parameters());
    }
    {
      Context rank;
      ContextGuard guard(rank);
      TinyTrainer t(DType::bf16, false, 77, 0.1, device);  // different initial weights and RNG state
      const Metadata meta = t.trainer->load(dir);
      CHECK(meta.at("data_position") == "5");
      CHECK(t.trainer->steps() == 5);
      CHECK(flat_values(t.model->named_parameters()) == compute);
      // Master weights, m and v, saved again: every tensor as the first save holds it.
      t.trainer->save(again);
      const SafetensorsFile first(rank_file(dir)), second(rank_file(again));
      REQUIRE(first.names() == second.names());
      for (const std::string& name : first.names()) check_identical(second.read(name), first.read(name), name);
      for (int i = 0; i < 5; ++i) resumed.push_back(t.step(s, 3e-3));
    }
    for (int i = 0; i < 5; ++i) CHECK(resumed[i] == uninterrupted[5 + i]);
    std::filesystem::remove_all(dir);
    std::filesystem::remove_all(again);
  }
}

TEST_CASE("a file of the former single-file training checkpoint resumes training exactly, at any world size") {
  // optim::save_checkpoint's files (before one device trained through a ShardedModel)
  // load as they are: master weights, m, v, the step, the generator and the loss scale.
  const Sequence s = fixed_sequence();
  const std::string path = temp_path("single_file.safetensors");
  const optim::GradScalerOptions scaling{.init_scale = 1024.0, .growth_interval = 3};
  std::vector<double> uninterrupted;
  double saved_scale = 0;
  {
    Context rank;
    ContextGuard guard(rank);
    TinyTrainer t(DType::bf16, false, 1, 0.1);
    optim::GradScaler scaler(scaling);
    for (int i = 0; i < 10; ++i) {
      uninterrupted.push_back(t.step(s, 3e-3, &scaler));
      if (i != 3) continue;
      save_single_file_checkpoint(path, *t.trainer, *t.model, &scaler, {{"data_position", "4"}});
      saved_scale = scaler.scale_factor();
    }
  }
  REQUIRE(saved_scale == scaling.init_scale * scaling.growth_factor);  // grown once: not its initial state
  std::vector<double> resumed;
  nn::NamedTensors loaded;
  {
    Context rank;
    ContextGuard guard(rank);
    TinyTrainer t(DType::bf16, false, 77, 0.1);  // other weights, another generator state
    optim::GradScaler scaler(scaling);
    const Metadata meta = t.trainer->load(path, &scaler);
    CHECK(meta.at("data_position") == "4");
    CHECK(t.trainer->steps() == 4);
    CHECK(scaler.scale_factor() == saved_scale);
    CHECK(scaler.good_steps() == 1);
    loaded = t.trainer->gathered_master();
    for (int i = 4; i < 10; ++i) resumed.push_back(t.step(s, 3e-3, &scaler));
  }
  for (int i = 0; i < 6; ++i) CHECK(resumed[i] == uninterrupted[4 + i]);
  // At N = 2, stage 3, each rank reads the slices it holds of the same whole tensors.
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    nn::GPT model(tiny_config());
    dist::ShardedModel sharded(model, pg, {.stage = 3, .compute_dtype = DType::bf16});
    sharded.load(path);
    CHECK(sharded.steps() == 4);
    const nn::NamedTensors master = sharded.gathered_master();
    REQUIRE(master.size() == loaded.size());
    for (size_t i = 0; i < master.size(); ++i) check_identical(master[i].second, loaded[i].second, master[i].first);
  });
  std::remove(path.c_str());
}

TEST_CASE("damaged files each give a zg::Error") {
  const std::string ok_header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\1');
  struct Damage {
    std::string what, bytes, message;
  };
  const std::vector<Damage> cases = {
      {"empty file", "", "shorter than its 8-byte header length"},
      {"5 bytes", "\x05\0\0\0\0", "shorter than its 8-byte header length"},
      {"huge header length", raw_file("{}", "", 0x7fffffffffffffffull), "over the 100 MiB limit"},
      {"header length past the end", raw_file("{}", "", 1000), "runs past the end of the file"},
      {"header not JSON", raw_file("{not json", ""), "is not valid JSON"},
      {"header an array", raw_file("[1,2]", ""), "is not a JSON object"},
      {"nested a million deep",
       raw_file(R"({"a":{"dtype":)" + std::string(1000000, '[') + std::string(1000000, ']') +
                    R"(,"shape":[2],"data_offsets":[0,8]}})",
                data8),
       "nests deeper than 4 levels"},
      {"entry not an object", raw_file(R"({"a":5})", ""), "expected exactly dtype, shape and data_offsets"},
      {"missing data_offsets", raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", data8), "expected exactly dtype"},
      {"extra field", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", data8),
       "expected exactly dtype"},
      {"unknown dtype", raw_file(R"({"a":{"dtype":"F8","shape":[2],"data_offsets":[0,8]}})", data8),
       "unsupported dtype \"F8\""},
      {"negative size", raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8),
       "non-integer or negative size"},
      {"fractional size", raw_file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", data8),
       "non-integer or negative size"},
      {"shape not an array", raw_file(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", data8),
       "shape is not an array"},
      {"shape overflows", raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", data8),
       "is too large"},
      // Empty, but its other sizes overflow: accepted at open, it failed on read with a
      // message naming neither file nor tensor.
      {"empty shape that overflows", raw_file(R"({"a":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data8),
       "is too large"},
      {"offsets reversed", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data8),
       "do not lie within"},
      {"offsets past the end", raw_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data8),
       "do not lie within the 8-byte data section"},
      {"three offsets", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})", data8),
       "is not a pair"},
      {"size mismatch", raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
       "needs 12 bytes but data_offsets [0, 8] hold 8"},
      {"overlapping ranges",
       raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                std::string(12, '\0')),
       "overlap"},
      {"a hole", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                          std::string(12, '\0')),
       "belong to no tensor"},
      {"trailing bytes", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", data8),
       "4 bytes after the last tensor"},
      {"duplicate name", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                  data8),
       "names 'a' twice"},
      {"metadata not an object", raw_file(R"({"__metadata__":[1]})", ""), "__metadata__ is not an object"},
      {"metadata value not a string", raw_file(R"({"__metadata__":{"k":1}})", ""), "value of 'k' is not a string"},
      {"truncated data", raw_file(ok_header, data8).substr(0, 8 + ok_header.size() + 5), "do not lie within"},
      {"truncated header", raw_file(ok_header, data8).substr(0, 30), "runs past the end of the file"},
  };
  CHECK(cases.size() >= 20);
  const std::string path = temp_path("damaged.safetensors");
  for (const Damage& d : cases) {
    INFO(d.what);
    write_bytes(path, d.bytes);
    CHECK_THROWS_WITH_AS(SafetensorsFile{path}, doctest::Contains(d.message.c_str()), Error);
  }
  write_bytes(path, raw_file(ok_header, data8));  // and the undamaged one loads
  CHECK(SafetensorsFile(path).read("a").numel() == 2);
  {
    // A save that renames a new file over the path: each read reopened the path, and read
    // the new file's bytes at the old offsets, or mixed values of two saves in one load.
    // Now a file replaced before the first read is refused; after it, reads keep to the
    // file that read opened.
    const std::string renamed = temp_path("renamed.safetensors");
    const auto save_first = [&] { save_safetensors(renamed, {{"a", tensor<float>({1, 2})}, {"b", tensor<float>({3, 4})}}); };
    const auto save_second = [&] {
      save_safetensors(renamed, {{"b", tensor<float>({5, 6, 7})}, {"a", tensor<float>({8})}}, {{"note", "another"}});
    };
    save_first();
    const SafetensorsFile replaced(renamed);
    save_second();
    CHECK_THROWS_WITH_AS(replaced.read("a"), doctest::Contains("the file changed after its header was read"), Error);
    save_first();
    const SafetensorsFile open(renamed);
    CHECK(open.read("a").to_vector<float>() == std::vector<float>{1, 2});
    save_second();
    CHECK(open.read("b").to_vector<float>() == std::vector<float>{3, 4});
    std::remove(renamed.c_str());
  }
  CHECK_THROWS_WITH_AS(SafetensorsFile(path).read("b"), doctest::Contains("no tensor named 'b'"), Error);
  CHECK_THROWS_WITH_AS(SafetensorsFile("/nonexistent/x.safetensors"), doctest::Contains("cannot open the file"), Error);
  // Not a regular file: a directory gave a bogus header length, a FIFO blocked for ever.
  CHECK_THROWS_WITH_AS(SafetensorsFile("/tmp"), doctest::Contains("not a regular file (a directory)"), Error);
  const std::string fifo = temp_path("fifo.safetensors");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(SafetensorsFile{fifo}, doctest::Contains("not a regular file (a FIFO, socket or device)"), Error);
  // A save replaces only a regular file: the FIFO (or a device node, a directory, a
  // symlink) was swapped for a plain file.
  CHECK_THROWS_WITH_AS(save_safetensors(fifo, {{"a", zeros({1})}}),
                       doctest::Contains((fifo + " exists and is not a regular file (a FIFO, socket or device); it "
                                                 "is not replaced").c_str()),
                       Error);
  CHECK_THROWS_WITH_AS(save_safetensors("/tmp", {{"a", zeros({1})}}), doctest::Contains("(a directory)"), Error);
  std::remove(fifo.c_str());
  // A name that is not UTF-8 cannot go into the JSON header: a zg::Error (was a json exception).
  CHECK_THROWS_WITH_AS(save_safetensors(path, {{std::string("bad\xff"), zeros({1})}}),
                       doctest::Contains("is not valid UTF-8"), Error);
  // A BOOL byte other than 0 or 1 is found when the tensor is read, by its file offset.
  const std::string bool_header = R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})";
  write_bytes(path, raw_file(bool_header, std::string("\0\1\2", 3)));
  const std::string offset = std::to_string(8 + bool_header.size() + 2);
  CHECK_THROWS_WITH_AS(SafetensorsFile(path).read("m"),
                       doctest::Contains(("the byte at file offset " + offset + " is 2").c_str()), Error);
  write_bytes(path, raw_file(bool_header, std::string("\0\1\1", 3)));
  CHECK(SafetensorsFile(path).read("m").to_vector<bool>() == std::vector<bool>{false, true, true});
  std::remove(path.c_str());
}

TEST_CASE("a plain state file, or a checkpoint of another model, does not load as a training checkpoint") {
  Context rank;
  ContextGuard guard(rank);
  TinyTrainer t;
  const std::string path = temp_path("not_training.safetensors"), dir = temp_path("not_training");
  const std::vector<float> master = flat_values(t.trainer->gathered_master());
  nn::save_state(*t.model, path);
  CHECK_THROWS_WITH_AS(t.trainer->load(path),
                       doctest::Contains((path + " is a file, not a checkpoint directory; pass the directory "
                                                 "ShardedModel::save wrote (the one file load() takes is an "
                                                 "earlier version's training checkpoint, format "
                                                 "zerograd-training-checkpoint-1, and this is not one)").c_str()),
                       Error);
  std::filesystem::create_directories(dir);
  CHECK_THROWS_WITH_AS(t.trainer->load(dir),
                       doctest::Contains((dir + " has no checkpoint: no latest file and no rank-R-of-N.safetensors files").c_str()),
                       Error);
  const std::string rank0 = dir + "/rank-00000-of-00001.safetensors";
  std::filesystem::copy_file(path, rank0);
  CHECK_THROWS_WITH_AS(t.trainer->load(dir), doctest::Contains((rank0 + " is not a zerograd sharded checkpoint").c_str()),
                       Error);
  // A single-file checkpoint with a tensor these parameters lack (a larger model's)
  // loaded its matching part and dropped the rest without a word; one whose tensor has
  // another shape would load a different model.
  save_single_file_checkpoint(path, *t.trainer, *t.model);
  const SafetensorsFile file(path);
  const auto rewritten = [&](const std::string& name,
                             const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& change) {
    std::vector<std::pair<std::string, Tensor>> tensors = tensors_of(file);
    change(tensors);
    const std::string other = temp_path(name + ".safetensors");
    save_safetensors(other, tensors, file.metadata());
    return other;
  };
  const std::string larger = rewritten("larger_model", [](auto& tensors) {
    tensors.emplace_back("optimizer.exp_avg.transformer.h.9.ln_1.weight", ones({8}));
  });
  CHECK_THROWS_WITH_AS(t.trainer->load(larger),
                       doctest::Contains("holds 'optimizer.exp_avg.transformer.h.9.ln_1.weight' but the model has no "
                                         "parameter 'transformer.h.9.ln_1.weight'"),
                       Error);
  const std::string reshaped = rewritten("reshaped_model", [](auto& tensors) {
    for (auto& [name, t] : tensors)
      if (name == "transformer.wte.weight") t = t.reshape({32, 64});
  });
  CHECK_THROWS_WITH_AS(t.trainer->load(reshaped),
                       doctest::Contains("tensor 'transformer.wte.weight' has shape [32, 64]; the model's "
                                         "'transformer.wte.weight' has shape [64, 32]: a checkpoint of another model"),
                       Error);
  const std::string missing = rewritten("missing_tensor", [](auto& tensors) {
    std::erase_if(tensors, [](const auto& named) { return named.first == "optimizer.exp_avg_sq.transformer.wpe.weight"; });
  });
  CHECK_THROWS_WITH_AS(t.trainer->load(missing), doctest::Contains("does not cover exp_avg_sq/transformer.wpe.weight"),
                       Error);
  CHECK(t.trainer->steps() == 0);
  CHECK(flat_values(t.trainer->gathered_master()) == master);  // refused before anything changed
  std::filesystem::remove_all(dir);
  for (const std::string& f : {path, larger, reshaped, missing}) std::remove(f.c_str());
}

TEST_CASE("a checkpoint whose step or loss scale is out of range is refused before anything changes") {
  Context rank;
  ContextGuard guard(rank);
  TinyTrainer t;
  optim::GradScaler scaler;
  // A one-rank save, and the same state in the former single-file format.
  const std::string dir = temp_path("range_ckpt"), single = temp_path("range_ckpt.safetensors");
  t.trainer->save(dir, {}, &scaler);
  save_single_file_checkpoint(single, *t.trainer, *t.model, &scaler);
  const std::vector<float> master = flat_values(t.trainer->gathered_master());
  for (const auto& [loaded, file] : {std::pair{dir, rank_file(dir)}, std::pair{single, single}}) {
    const SafetensorsFile good(file);
    const std::vector<std::pair<std::string, Tensor>> tensors = tensors_of(good);
    const Metadata metadata = good.metadata();
    for (const auto& [key, value, message] :
         {std::tuple{"step", "-3", "'step' = -3 is not a count"},
          std::tuple{"step", "9223372036854775807", "is not a count of updates that can go on"},
          std::tuple{"step", "12abc", "metadata 'step' = '12abc' is not an integer"},
          std::tuple{"rng_seed", "-1", "metadata 'rng_seed' = '-1' is not a non-negative integer"},
          std::tuple{"loss_scale", "1e-320", "loss_scale = 9.99989e-321"}, std::tuple{"loss_scale", "0", "loss_scale = 0"},
          std::tuple{"loss_scale", "nan", "metadata 'loss_scale' = 'nan' is not a finite number"},
          std::tuple{"loss_scale", "1e999", "'1e999' is not a finite number"},
          std::tuple{"loss_scale", " 5", "' 5' is not a finite number"},  // was read as 5
          std::tuple{"loss_scale_good_steps", "-1", "= -1"}}) {
      const std::string damage = loaded + ": " + key + " = " + value;  // INFO cannot capture bindings (Clang)
      INFO(damage);
      Metadata meta = metadata;
      meta[key] = value;
      save_safetensors(file, tensors, meta);
      CHECK_THROWS_WITH_AS(t.trainer->load(loaded, &scaler), doctest::Contains(message), Error);
      CHECK(t.trainer->steps() == 0);
      CHECK(scaler.scale_factor() == 65536.0);
      CHECK(flat_values(t.trainer->gathered_master()) == master);
    }
  }
  std::filesystem::remove_all(dir);
  std::remove(single.c_str());
}

namespace {

// Flips every bit of the byte at `offset` from the end of `path` (1: the last byte).
void flip_byte_from_end(const std::string& path, int64_t offset = 1) {
  std::string bytes = read_bytes(path);
  REQUIRE(static_cast<int64_t>(bytes.size()) >= offset);
  bytes[bytes.size() - static_cast<size_t>(offset)] ^= 0xff;
  write_bytes(path, bytes);
}

// Every tensor of every rank file of the save `dir` holds now, by file and name: the
// master weights, Adam m and v, frozen weights and buffers, as saved.
std::map<std::string, std::string> saved_bytes(const std::string& dir) {
  std::map<std::string, std::string> bytes;
  const std::string save = dist::ShardedModel::current_save(dir);
  for (const auto& entry : std::filesystem::directory_iterator(save)) {
    const SafetensorsFile file(entry.path());
    for (const std::string& name : file.names()) {
      const Tensor t = file.read(name);
      bytes[entry.path().filename().string() + ":" + name] =
          std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.nbytes()));
    }
  }
  return bytes;
}

// A tiny GPT's ShardedModel on each of N local ranks at `stage`, after one step from its
// own initial weights (`seed`): its Adam state is not zero.
void with_trained_ranks(int n, int stage, uint64_t seed,
                        const std::function<void(dist::ProcessGroup&, nn::GPT&, dist::ShardedModel&)>& fn) {
  const Sequence s = fixed_sequence();
  dist::run_local(n, [&](dist::ProcessGroup& pg) {
    manual_seed(seed);
    nn::GPT model(tiny_config());
    dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::f32, .adamw = {0.9, 0.95, 1e-8, 0.1}});
    sharded.zero_grad();
    model.forward(s.inputs, s.targets).loss.backward();  // every rank the same batch: the same update
    sharded.step(1e-2);
    fn(pg, model, sharded);
  });
}

}  // namespace

TEST_CASE("one damaged byte in the last tensor of a single file leaves every parameter and optimizer value unchanged") {
  // Before: checksums were checked as each tensor was read, so a damaged last tensor
  // threw after the others had been written (nn::load_state changed 10 of 28 tensors,
  // the single-file training checkpoint the master weights).
  Context rank;
  ContextGuard guard(rank);
  TinyTrainer saved(DType::f32, false, /*seed=*/1), target(DType::f32, false, /*seed=*/2);
  const Sequence s = fixed_sequence();
  saved.step(s, 1e-2);
  target.step(s, 1e-2);
  const std::string state = temp_path("damaged_state.safetensors"), single = temp_path("damaged_single.safetensors"),
                    before = temp_path("damaged_before"), after = temp_path("damaged_after");
  // nn::load_state of a module state file, into a plain module.
  nn::save_state(*saved.model, state);
  flip_byte_from_end(state);
  manual_seed(3);
  nn::GPT plain(tiny_config());
  const std::vector<float> plain_values = flat_values(plain.named_parameters());
  CHECK_THROWS_WITH_AS(nn::load_state(plain, state), doctest::Contains("fails its checksum"), Error);
  CHECK(flat_values(plain.named_parameters()) == plain_values);
  // ShardedModel::load of the single-file training checkpoint: master, m, v and the step.
  save_single_file_checkpoint(single, *saved.trainer, *saved.model);
  flip_byte_from_end(single);
  target.trainer->save(before);
  const std::vector<float> weights = flat_values(target.model->named_parameters());
  CHECK_THROWS_WITH_AS(target.trainer->load(single), doctest::Contains("fails its checksum"), Error);
  target.trainer->save(after);
  CHECK(saved_bytes(after) == saved_bytes(before));
  CHECK(flat_values(target.model->named_parameters()) == weights);
  CHECK(target.trainer->steps() == 1);
  for (const std::string& path : {before, after}) std::filesystem::remove_all(path);
  for (const std::string& path : {state, single}) std::remove(path.c_str());
}

TEST_CASE("one damaged byte in the last tensor of any rank's file: every rank throws its reason, nothing changes, at every stage") {
  // Before: ranks agreed on the headers only; the rank that met the damaged tensor threw
  // alone (at stage 3 rank 0 returned normally while rank 1 threw), and at stages 0-2 the
  // parameters had already changed.
  const std::string dir = temp_path("damaged_sharded"), before = temp_path("damaged_sharded_before"),
                    after = temp_path("damaged_sharded_after");
  with_trained_ranks(2, 1, /*seed=*/1, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& sharded) { sharded.save(dir); });
  const std::string save = dist::ShardedModel::current_save(dir);
  for (int damaged = 0; damaged < 2; ++damaged) {
    const std::string file = save + "/rank-0000" + std::to_string(damaged) + "-of-00002.safetensors";
    const std::string good = read_bytes(file);
    flip_byte_from_end(file);
    for (int stage = 0; stage <= 3; ++stage) {
      INFO("rank " << damaged << "'s file damaged, loaded at stage " << stage);
      std::vector<std::string> errors(2);
      std::vector<std::vector<float>> weights_before(2), weights_after(2);
      with_trained_ranks(2, stage, /*seed=*/2, [&](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& sharded) {
        const auto weights = [&] {
          const auto full = sharded.summon_full_params();  // (ZeRO-3: each rank holds a shard)
          return flat_values(model.named_parameters());
        };
        sharded.save(before);
        weights_before[pg.rank()] = weights();
        try {
          sharded.load(dir);
        } catch (const Error& e) {
          errors[pg.rank()] = e.what();
        }
        sharded.save(after);
        weights_after[pg.rank()] = weights();
        CHECK(sharded.steps() == 1);
      });
      for (int r = 0; r < 2; ++r) {
        CHECK_MESSAGE(errors[r].find("fails its checksum") != std::string::npos, errors[r]);
        CHECK_MESSAGE(errors[r].find("nothing was loaded, on any rank") != std::string::npos, errors[r]);
        CHECK(weights_after[r] == weights_before[r]);
      }
      CHECK(saved_bytes(after) == saved_bytes(before));
    }
    write_bytes(file, good);
  }
  for (const std::string& path : {dir, before, after}) std::filesystem::remove_all(path);
}

TEST_CASE("a sharded save becomes current only once every rank's file is durable; the next save clears what a kill left") {
  // Before: each rank renamed its own file into place and an earlier save of another world
  // size was removed afterwards; a kill in between left a directory that loaded neither.
  const std::string dir = temp_path("atomic_saves");
  const auto entries = [&] {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  };
  const auto latest = [&] { return read_bytes(dir + "/latest"); };
  const auto name_of = [](const std::string& save) { return std::filesystem::path(save).filename().string(); };
  std::string first, second;
  with_trained_ranks(2, 2, 1, [&](dist::ProcessGroup& pg, nn::GPT&, dist::ShardedModel& sharded) {
    sharded.save(dir);
    if (pg.rank() == 0) first = dist::ShardedModel::current_save(dir);
  });
  CHECK(name_of(first).starts_with("step-00000001-"));
  CHECK(latest() == name_of(first) + "\n");
  // What kills leave: a save folder with one rank's file and a temporary (killed while
  // writing), and one complete but never made current (killed before `latest` was renamed).
  const std::string killed = dir + "/step-00000002-0badf00d", unnamed = dir + "/step-00000002-00c0ffee";
  std::filesystem::create_directories(killed);
  std::filesystem::copy_file(first + "/rank-00000-of-00002.safetensors", killed + "/rank-00000-of-00002.safetensors");
  write_bytes(killed + "/rank-00001-of-00002.safetensors.tmp.host.123.0", "partial");
  std::filesystem::copy(first, unnamed);
  with_trained_ranks(3, 3, 2, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& sharded) {
    // The previous save loads, and says which it is.
    CHECK(sharded.load(dir).at("path") == first);
    sharded.save(dir, {}, nullptr, /*keep=*/2);
  });
  second = dist::ShardedModel::current_save(dir);
  CHECK(name_of(second) != name_of(first));
  // The new save is current; the kept older one stays, what the kills left is gone.
  CHECK(latest() == name_of(second) + "\n" + name_of(first) + "\n");
  std::vector<std::string> expected{"latest", name_of(first), name_of(second), "writer.lock"};
  std::sort(expected.begin(), expected.end());
  CHECK(entries() == expected);
  // An older save loads by its folder.
  with_trained_ranks(1, 0, 3, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& sharded) {
    CHECK(sharded.load(first).at("world_size") == "2");
    CHECK(sharded.load(dir).at("world_size") == "3");
    sharded.save(dir, {}, nullptr, /*keep=*/1);  // keeps the newest only
  });
  CHECK(entries().size() == 3);  // latest, the save, writer.lock
  CHECK_FALSE(std::filesystem::exists(first));
  CHECK_FALSE(std::filesystem::exists(second));

  // A damaged `latest`, or one naming a removed save: a clear error; the next save replaces it.
  const std::string current = dist::ShardedModel::current_save(dir);
  write_bytes(dir + "/latest", "step-x\n");
  with_trained_ranks(1, 0, 3, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& sharded) {
    CHECK_THROWS_WITH_AS(sharded.load(dir), doctest::Contains("names 'step-x', which is not a save folder"), Error);
    write_bytes(dir + "/latest", "step-00000009-12345678\n");
    CHECK_THROWS_WITH_AS(sharded.load(dir), doctest::Contains("names the save step-00000009-12345678, but"), Error);
    sharded.save(dir);
    CHECK(sharded.load(dir).at("path") == dist::ShardedModel::current_save(dir));
  });
  CHECK_FALSE(std::filesystem::exists(current));
  // A directory whose only save never finished has no checkpoint to load.
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(killed);
  with_trained_ranks(1, 0, 3, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& sharded) {
    CHECK_THROWS_WITH_AS(sharded.load(dir),
                         doctest::Contains("holds no complete save: step-00000002-0badf00d never finished"), Error);
  });
  std::filesystem::remove_all(dir);
}

TEST_CASE("a checkpoint directory of an earlier version (rank files directly in it) loads; a save converts it") {
  const std::string dir = temp_path("flat_layout");
  with_trained_ranks(2, 1, 1, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& sharded) { sharded.save(dir); });
  const std::string save = dist::ShardedModel::current_save(dir);
  for (const auto& entry : std::filesystem::directory_iterator(save))
    std::filesystem::rename(entry.path(), dir + "/" + entry.path().filename().string());
  std::filesystem::remove(save);
  std::filesystem::remove(dir + "/latest");
  write_bytes(dir + "/rank-00001-of-00002.safetensors.tmp.host.1.0", "a killed save's");
  with_trained_ranks(2, 3, 2, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& sharded) {
    CHECK(sharded.load(dir).at("path") == dir);
    sharded.save(dir);
  });
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename());
  CHECK(names.size() == 3);  // latest, the new save's folder and writer.lock: the flat files and the temporary are gone
  CHECK(std::filesystem::exists(dir + "/latest"));
  std::filesystem::remove_all(dir);
}

}  // namespace zg::test
