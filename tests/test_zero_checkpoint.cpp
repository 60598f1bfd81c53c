// ZeRO's sharded checkpoints: they reshard to any N, S and stage, export one file, keep
// the GradScaler's state and the buffers, and refuse another model's or a damaged save;
// a write that fails ends every rank with an error and leaves no folder.
#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "nn/serialize.h"
#include "zero_cases.h"
#include "zero_training.h"

#include <csignal>
#include <filesystem>
#include <functional>
#include <string>
#include <sys/resource.h>
#include <unistd.h>

namespace zg::test {

namespace {

// Steps [first, last) of the global batches on n ranks (f32) under `config`, loading the
// save in `dir` first (first > 0) and saving into it at the end if asked; rank 0's master
// weights after.
nn::NamedTensors checkpointed_run(const std::string& dir, int n, dist::ZeroConfig config, int first, int last,
                                  bool save_at_end) {
  config.compute_dtype = DType::f32, config.adamw = kAdamW;
  nn::NamedTensors result;
  dist::run_local(n, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, config);
    if (first > 0) sharded.load(dir);
    const int64_t rows = kBatch / n;
    for (int s = first; s < last; ++s) {
      const auto [x, y] = global_batch(s);
      sharded.zero_grad();
      model.forward(x.narrow(0, pg.rank() * rows, rows), y.narrow(0, pg.rank() * rows, rows)).loss.backward();
      sharded.step(1e-3);
    }
    if (save_at_end) sharded.save(dir, {{"data_position", std::to_string(last)}});
    keep_master(pg, sharded, 0, result);
  });
  return result;
}

}  // namespace

TEST_CASE("sharded checkpoints reshard: save at N=4 stage 3, resume at N=2 stage 1 and N=1; export one file") {
  const std::string dir = "/tmp/zg_test_sharded_" + std::to_string(::getpid());
  // Train 3 steps at N=4, stage 3, save, and (the reference) go on for 2 more steps.
  auto train = [&](int n, int stage, int first_step, int last_step, bool save_at_end) {
    return checkpointed_run(dir, n, {.stage = stage}, first_step, last_step, save_at_end);
  };
  train(4, 3, 0, 3, true);
  const nn::NamedTensors uninterrupted = train(4, 3, 0, 5, false);
  CHECK(max_difference(train(2, 1, 3, 5, false), uninterrupted) <= 1e-5);
  CHECK(max_difference(train(1, 0, 3, 5, false), uninterrupted) <= 1e-5);
  CHECK(max_difference(train(4, 2, 3, 5, false), uninterrupted) <= 1e-5);

  // A consolidated export loads as a plain module state.
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, {.stage = 1, .compute_dtype = DType::f32, .adamw = kAdamW});
    sharded.load(dir);
    sharded.export_consolidated(dir + "/consolidated.safetensors");
  });
  manual_seed(7);
  nn::GPT fresh(zero_config());
  nn::load_state(fresh, dir + "/consolidated.safetensors");
  const Tensor wte = fresh.wte->weight;
  const std::string save = dist::ShardedModel::current_save(dir);  // dir/step-00000003-<id>
  const std::vector<float> saved_wte = SafetensorsFile(save + "/rank-00000-of-00004.safetensors")
                                           .read("master/transformer.wte.weight/0")
                                           .to_vector<float>();
  CHECK(std::equal(saved_wte.begin(), saved_wte.end(), wte.view({-1}).to_vector<float>().begin()));

  // A save of another world size is missing a file: a clear error, not a partial load.
  std::filesystem::remove(save + "/rank-00002-of-00004.safetensors");
  CHECK_THROWS_WITH_AS(train(2, 1, 3, 4, false), doctest::Contains("rank-00002-of-00004.safetensors is missing"),
                       Error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a hybrid-sharded checkpoint holds one copy of each shard and loads at any N, S and stage") {
  const std::string dir = "/tmp/zg_test_hsdp_" + std::to_string(::getpid());
  auto train = [&](int n, int shard, int stage, int first_step, int last_step, bool save_at_end) {
    return checkpointed_run(dir, n, {.stage = stage, .shard_group_size = shard}, first_step, last_step, save_at_end);
  };
  train(4, 2, 3, 0, 3, true);
  const std::string save = dist::ShardedModel::current_save(dir);
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(save)) files.push_back(entry.path().filename());
  std::sort(files.begin(), files.end());
  CHECK(files == std::vector<std::string>{"rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"});
  const nn::NamedTensors uninterrupted = train(4, 2, 3, 0, 5, false);
  CHECK(max_difference(train(4, 2, 3, 3, 5, false), uninterrupted) <= 1e-5);
  CHECK(max_difference(train(1, 0, 0, 3, 5, false), uninterrupted) <= 1e-5);
  CHECK(max_difference(train(4, 0, 2, 3, 5, false), uninterrupted) <= 1e-5);
  train(4, 0, 3, 3, 4, true);  // and back: a save at N = 4 without replicas, loaded hybrid
  CHECK(max_difference(train(4, 2, 2, 4, 5, false), uninterrupted) <= 1e-5);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a sharded checkpoint of another model, or a damaged one, is refused before anything changes") {
  // Before (found by fuzzing): a checkpoint of a bigger vocabulary loaded without a word,
  // i64 pieces were converted, overlapping pieces counted twice, files of two saves mixed,
  // bad names gave "stoll", and a bad step threw after the weights had been overwritten.
  const std::string dir = "/tmp/zg_test_bad_sharded_" + std::to_string(::getpid());
  const auto config = [](int64_t vocab) {
    nn::GPTConfig c = zero_config();
    c.vocab_size = vocab;
    return c;
  };
  const int64_t vocab = zero_config().vocab_size;
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(config(vocab));
    dist::ShardedModel sharded(model, pg, {.stage = 1, .compute_dtype = DType::f32});
    sharded.save(dir);
  });
  const std::string save = dist::ShardedModel::current_save(dir);
  const std::string file0 = save + "/rank-00000-of-00002.safetensors", file1 = save + "/rank-00001-of-00002.safetensors";
  // Rewrites one file of the save: its tensors through `tensors`, its metadata through `meta`.
  const auto rewrite = [](const std::string& path, auto tensors, auto meta) {
    const SafetensorsFile file(path);
    std::vector<std::pair<std::string, Tensor>> content;
    for (const std::string& name : file.names()) content.emplace_back(name, file.read(name));
    Metadata metadata = file.metadata();
    tensors(content);
    meta(metadata);
    save_safetensors(path, content, metadata);
  };
  const auto same = [](auto&) {};
  const auto attempt = [&](int64_t model_vocab) {
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(9);
      nn::GPT model(config(model_vocab));
      // Stage 1: each rank checks only its own slice's coverage; either all load or none.
      dist::ShardedModel sharded(model, pg, {.stage = 1, .compute_dtype = DType::f32});
      nn::NamedTensors before;
      for (const auto& [name, p] : sharded.gathered_master()) before.emplace_back(name, p.clone());
      std::string error;
      try {
        sharded.load(dir);
      } catch (const Error& e) {
        error = e.what();
      }
      const double changed = max_difference(sharded.gathered_master(), before);  // a collective: every rank
      if (error.empty()) return;
      CHECK(changed == 0);  // refused: on every rank, nothing changed
      throw Error(error);
    });
  };
  CHECK_THROWS_WITH_AS(attempt(vocab - 2), doctest::Contains("a checkpoint of another model"), Error);
  // Only rank 0's slice misses the extra rows: rank 1 agrees not to load either, and
  // run_local reports whichever error came first.
  CHECK_THROWS_WITH_AS(attempt(vocab + 2), doctest::Contains("nothing was loaded, on any rank"), Error);
  attempt(vocab);  // the undamaged save loads

  const std::string backup = dir + "/backup";
  std::filesystem::copy_file(file0, backup);
  const auto restore = [&] { std::filesystem::copy_file(backup, file0, std::filesystem::copy_options::overwrite_existing); };
  struct Damage {
    std::string what;
    std::function<void(std::vector<std::pair<std::string, Tensor>>&)> tensors;
    std::function<void(Metadata&)> meta;
    std::string message;
  };
  const std::vector<Damage> damages = {
      {"another save's step", same, [](Metadata& m) { m["step"] = "7"; }, "the files come from different saves"},
      // Two saves at one step (a rank's save that failed part-way, say) loaded as one.
      {"another save's id", same, [](Metadata& m) { m["save_id"] = "1"; }, "has 1: the files come from different saves"},
      {"a step that is not a number", same, [](Metadata& m) { m["step"] = "x"; }, "metadata 'step' = 'x' is not an integer"},
      {"a negative seed", same, [](Metadata& m) { m["rng_seed"] = "-1"; }, "is not a non-negative integer"},
      {"the wrong rank", same, [](Metadata& m) { m["rank"] = "1"; }, "says it is rank 1 of 2"},
      // Pieces are flat: a parameter of another shape with as many elements loaded scrambled.
      {"a parameter of another shape", same,
       [](Metadata& m) { m["shape/transformer.wte.weight"] = "[32, 64]"; },
       "is a piece of a parameter of shape [32, 64]; the model's 'transformer.wte.weight' has shape [64, 32]: a "
       "checkpoint of another model"},
      {"no shape recorded", same, [](Metadata& m) { m.erase("shape/transformer.wte.weight"); },
       "is a piece of a parameter of shape (not recorded)"},
      {"an unknown format", same, [](Metadata& m) { m["format"] = "zerograd-sharded-checkpoint-6"; },
       "is not a zerograd sharded checkpoint"},
      {"an unknown parameter", [](auto& t) { t.front().first = "master/no.such.weight/0"; }, [](Metadata&) {},
       "the model has no parameter 'no.such.weight'"},
      {"a frozen piece of a trained parameter", [](auto& t) { t.front().first = "frozen/transformer.wte.weight/0"; },
       [](Metadata&) {}, "holds 'frozen/transformer.wte.weight/0' but the model has no frozen parameter 'transformer.wte.weight' (it "
       "trains it: the save has no Adam state for it)"},
      {"a name without an offset", [](auto& t) { t.front().first = "master/transformer.wte.weight/x"; }, [](Metadata&) {},
       "is not named <role>/<parameter>/<first element>"},
      {"an integer piece", [](auto& t) { t.front().second = t.front().second.to(DType::i64); }, [](Metadata&) {},
       "expected a 1-D floating piece"},
      {"an overlapping copy", [](auto& t) { t.push_back({t.front().first.substr(0, t.front().first.rfind('/')) + "/1", t.front().second.narrow(0, 0, 1).clone()}); },
       [](Metadata&) {}, "overlap"},
  };
  for (const Damage& d : damages) {
    INFO(d.what);
    rewrite(file0, d.tensors, d.meta);
    CHECK_THROWS_WITH_AS(attempt(vocab), doctest::Contains(d.message.c_str()), Error);
    restore();
  }
  // Saves of format 4 (before cuts across tensor-parallel ranks) and 1 (which recorded no
  // shapes) still load.
  for (const std::string& file : {file0, file1})
    rewrite(file, same, [](Metadata& m) { m["format"] = "zerograd-sharded-checkpoint-4"; });
  CHECK_NOTHROW(attempt(vocab));
  for (const std::string& file : {file0, file1})
    rewrite(file, same, [](Metadata& m) {
      m["format"] = "zerograd-sharded-checkpoint-1";
      std::erase_if(m, [](const auto& entry) { return entry.first.starts_with("shape/"); });
    });
  CHECK_NOTHROW(attempt(vocab));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a sharded checkpoint keeps the GradScaler's state and replaces an earlier save of another world size") {
  // Before (found by fuzzing): the scale was not saved, so a resumed f16 run started again
  // at its initial scale and skipped steps the uninterrupted run took; and a save at N = 2
  // into a directory holding one at N = 4 returned normally but left it unloadable.
  const std::string dir = "/tmp/zg_test_sharded_scaler_" + std::to_string(::getpid());
  // The current save's files; and that dir holds `latest`, that save's folder and the
  // writer's lock only.
  const auto rank_files = [&] {
    const std::string save = dist::ShardedModel::current_save(dir);
    std::vector<std::string> names, entries;
    for (const auto& entry : std::filesystem::directory_iterator(save)) names.push_back(entry.path().filename());
    for (const auto& entry : std::filesystem::directory_iterator(dir)) entries.push_back(entry.path().filename());
    std::sort(names.begin(), names.end());
    std::sort(entries.begin(), entries.end());
    CHECK(entries == std::vector<std::string>{"latest", std::filesystem::path(save).filename().string(), "writer.lock"});
    return names;
  };
  const auto run = [&](int n, const std::function<void(dist::ShardedModel&)>& fn) {
    dist::run_local(n, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(zero_config());
      dist::ShardedModel sharded(model, pg, {.stage = 2, .compute_dtype = DType::f16});
      fn(sharded);
    });
  };
  run(4, [&](dist::ShardedModel& sharded) { sharded.save(dir); });
  CHECK(rank_files().size() == 4);
  run(2, [&](dist::ShardedModel& sharded) {
    optim::GradScaler scaler;
    scaler.set_scale(1234.0, 3);
    sharded.save(dir, {}, &scaler);
  });
  CHECK(rank_files() == std::vector<std::string>{"rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"});
  run(2, [&](dist::ShardedModel& sharded) {
    optim::GradScaler scaler({.init_scale = 8.0}), disabled({.enabled = false});
    sharded.load(dir, &scaler);
    CHECK(scaler.scale_factor() == 1234.0);
    CHECK(scaler.good_steps() == 3);
    sharded.load(dir, &disabled);  // a disabled scaler has no state to load
    CHECK(disabled.scale_factor() == 1.0);
  });
  run(4, [&](dist::ShardedModel& sharded) {  // saved without a scaler: an enabled one keeps its own
    sharded.save(dir);
    optim::GradScaler scaler({.init_scale = 8.0});
    sharded.load(dir, &scaler);
    CHECK(scaler.scale_factor() == 8.0);
  });
  CHECK(rank_files().size() == 4);
  std::filesystem::remove_all(dir);
}

TEST_CASE("buffers are rank 0's on every rank, and sharded checkpoints and the consolidated export hold them") {
  // Before, each rank kept its own buffers, and no checkpoint held them: a resume lost
  // them, and a strict load_state of the export refused a model that has some.
  const std::string dir = "/tmp/zg_test_sharded_buffers_" + std::to_string(::getpid());
  struct WithBuffers : TwoLayers {
    Tensor scale = register_buffer("scale", zeros({2, 3}, DType::f32));
    Tensor count = b->register_buffer("count", zeros({1}, DType::i64));
  };
  const auto run = [](int n, int stage, const std::function<void(dist::ProcessGroup&, WithBuffers&, dist::ShardedModel&)>& fn,
                      const std::function<void(WithBuffers&)>& before = [](WithBuffers&) {}) {
    dist::run_local(n, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      WithBuffers model;
      model.scale.fill_(10.0 + pg.rank());
      model.count.fill_(100 + pg.rank());
      before(model);
      dist::ShardedModel sharded(model, {.units = {"a", "b"}}, pg, {.stage = stage, .compute_dtype = DType::f64});
      fn(pg, model, sharded);
    });
  };
  run(2, 3, [&](dist::ProcessGroup&, WithBuffers& model, dist::ShardedModel& sharded) {
    CHECK(model.scale.to_vector<float>() == std::vector<float>(6, 10.0f));  // rank 0's, on rank 1 too
    CHECK(model.count.item<int64_t>() == 100);
    model.scale.fill_(2.5);
    model.count.fill_(7);
    sharded.save(dir);
    sharded.export_consolidated(dir + "/consolidated.safetensors");
  });
  const std::string save = dist::ShardedModel::current_save(dir);
  CHECK(SafetensorsFile(save + "/rank-00000-of-00002.safetensors").contains("buffer/b.count"));
  CHECK_FALSE(SafetensorsFile(save + "/rank-00001-of-00002.safetensors").contains("buffer/b.count"));
  for (int stage : {0, 1}) {
    INFO("loaded at N=1, stage " << stage);
    run(1, stage, [&](dist::ProcessGroup&, WithBuffers& model, dist::ShardedModel& sharded) {
      sharded.load(dir);
      CHECK(model.scale.to_vector<float>() == std::vector<float>(6, 2.5f));
      CHECK(model.count.item<int64_t>() == 7);
    });
  }
  WithBuffers exported;
  nn::load_state(exported, dir + "/consolidated.safetensors");  // strict: every parameter and buffer
  CHECK(exported.count.item<int64_t>() == 7);
  // Buffers that differ between the checkpoint and the model, and between ranks.
  CHECK_THROWS_WITH_AS(run(1, 0, [&](dist::ProcessGroup&, WithBuffers&, dist::ShardedModel& sharded) { sharded.load(dir); },
                           [](WithBuffers& model) { model.register_buffer("extra", zeros({1})); }),
                       doctest::Contains("has no 'buffer/extra', which the model has"), Error);
  struct Fewer : TwoLayers {
    Tensor scale = register_buffer("scale", zeros({2, 3}, DType::f32));
  };
  CHECK_THROWS_WITH_AS(dist::run_local(1,
                                       [&](dist::ProcessGroup& pg) {
                                         Fewer model;
                                         dist::ShardedModel sharded(model, {.units = {"a", "b"}}, pg,
                                                                    {.compute_dtype = DType::f64});
                                         sharded.load(dir);
                                       }),
                       doctest::Contains("holds 'buffer/b.count' but the model has no such buffer"), Error);
  CHECK_THROWS_WITH_AS(run(2, 0, [](dist::ProcessGroup&, WithBuffers&, dist::ShardedModel&) {},
                           [](WithBuffers& model) {
                             if (model.count.item<int64_t>() == 101) model.register_buffer("extra", zeros({1}));
                           }),
                       doctest::Contains("a different number of frozen parameters and buffers on some ranks (from 2 to 3)"), Error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a write that fails on rank 0 mid-export or mid-save ends every rank with an error, leaving no file") {
  // Rank 0 writes each unit as the ranks gather it: had its error been thrown at once, the
  // other ranks would wait for it in the next unit's gather. (A file size limit makes
  // rank 0's writes fail part-way, after the header: EFBIG, with SIGXFSZ ignored.)
  const std::string dir = "/tmp/zg_test_failed_write_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  for (const bool save : {false, true}) {
    INFO(std::string(save ? "save" : "export"));
    std::vector<std::string> errors(2);
    rlimit old_limit{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = old_limit;
    limit.rlim_cur = 16384;  // the tiny GPT's blocks are 50 KB each in f32
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &limit) == 0);
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(zero_config());
      dist::ShardedModel sharded(model, pg, {.stage = 3, .compute_dtype = DType::f32});
      try {
        if (save)
          sharded.save(dir + "/checkpoint");
        else
          sharded.export_consolidated(dir + "/consolidated.safetensors");
      } catch (const Error& e) {
        errors[pg.rank()] = e.what();
      }
    });
    ::setrlimit(RLIMIT_FSIZE, &old_limit);
    std::signal(SIGXFSZ, old_handler);
    CHECK_MESSAGE(errors[0].find("File too large") != std::string::npos, errors[0]);
    // (A save's rank 1 writes a file of its own, as large: it fails by itself; an export's
    // rank 1 gives rank 0's reason.)
    CHECK_MESSAGE(errors[1].find(save ? "File too large" : "rank 0 failed: save_safetensors: writing") != std::string::npos,
                  errors[1]);
    size_t files = 0;  // nothing written, no temporary left behind (the folder's writer.lock aside)
    for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
      files += e.is_regular_file() && e.path().filename() != "writer.lock";
    CHECK(files == 0);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a save that fails on one rank after another wrote its file leaves no folder; the previous save stays") {
  // A disk that fills up: the smaller rank file is written whole, the larger is not (a file
  // size limit between the two sizes, EFBIG). The folder, with the finished file, stayed
  // until the next good save.
  const std::string dir = "/tmp/zg_test_failed_save_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  checkpointed_run(dir, 2, {.stage = 1}, 0, 1, true);
  const std::string good = dist::ShardedModel::current_save(dir);
  const uintmax_t sizes[2] = {std::filesystem::file_size(good + "/rank-00000-of-00002.safetensors"),
                              std::filesystem::file_size(good + "/rank-00001-of-00002.safetensors")};
  REQUIRE(sizes[0] != sizes[1]);
  rlimit old_limit{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limit = old_limit;
  limit.rlim_cur = (sizes[0] + sizes[1]) / 2;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &limit) == 0);
  std::vector<std::string> errors(2);
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, {.stage = 1, .compute_dtype = DType::f32});
    try {
      sharded.save(dir);
    } catch (const Error& e) {
      errors[pg.rank()] = e.what();
    }
  });
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  const int larger = sizes[0] > sizes[1] ? 0 : 1;
  CHECK_MESSAGE(errors[larger].find("File too large") != std::string::npos, errors[larger]);
  CHECK_MESSAGE(errors[1 - larger].find("failed: ") != std::string::npos, errors[1 - larger]);
  CHECK(errors[1 - larger].find("failed and is removed; load() reads the previous one") != std::string::npos);
  int saves = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    saves += e.path().filename().string().starts_with("step-");
  CHECK(saves == 1);
  CHECK(dist::ShardedModel::current_save(dir) == good);
  std::filesystem::remove_all(dir);
}

}  // namespace zg::test
