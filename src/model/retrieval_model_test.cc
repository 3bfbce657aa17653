// The built-in retrieval model solves token-level needle, multi-key and copy tasks with the
// full cache (dense, and paged with int8 KV), and fails a deep needle exactly when the sparse
// cache drops it (StreamingLLM with a small budget). The tasks are built here from
// RetrievalModelVocab(); the benchmark's own generators live in src/bench.
#include "kvsparse/retrieval_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/engine.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/sparse_prefill.h"
#include "support/retrieval_model_file.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

// One thread: the model is tiny, and on a loaded machine OpenMP barriers cost more than they save.
constexpr int kThreads = 1;

struct Task {
  std::vector<int32_t> prompt;
  std::vector<int32_t> answer;  // the tokens greedy decoding must produce, in order
};

int32_t Pick(const std::vector<int32_t>& ids, std::mt19937& rng) {
  return ids[std::uniform_int_distribution<size_t>(0, ids.size() - 1)(rng)];
}

std::vector<int32_t> Haystack(const TokenVocab& v, int n, std::mt19937& rng) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int32_t& t : out) t = Pick(v.filler, rng);
  return out;
}

// Filler with one key followed by n_values distinct values at a depth in [min_depth, max_depth];
// the key is asked last and the answer is the values in order.
Task NeedleTask(const TokenVocab& v, int length, int min_depth, int max_depth, std::mt19937& rng, int n_values = 1) {
  Task task{Haystack(v, length, rng), {}};
  const int depth = std::uniform_int_distribution<int>(min_depth, max_depth)(rng);
  const int32_t key = Pick(v.keys, rng);
  std::vector<int32_t> values = v.values;
  std::shuffle(values.begin(), values.end(), rng);
  values.resize(static_cast<size_t>(n_values));
  task.prompt[static_cast<size_t>(depth)] = key;
  std::copy(values.begin(), values.end(), task.prompt.begin() + depth + 1);
  task.prompt.back() = key;
  task.answer = values;
  return task;
}
Task NeedleTask(const TokenVocab& v, int length, std::mt19937& rng) {
  return NeedleTask(v, length, 0, length - 3, rng);
}

// n_pairs distinct keys with random values at distinct random slots; one key is asked.
Task MultiKeyTask(const TokenVocab& v, int length, int n_pairs, std::mt19937& rng) {
  Task task{Haystack(v, length, rng), {}};
  std::vector<int32_t> keys = v.keys;
  std::shuffle(keys.begin(), keys.end(), rng);
  // Slots of two tokens each, none touching the question at the end.
  std::vector<int> slots((length - 1) / 2);
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int>(2 * i);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int32_t> values;
  for (int p = 0; p < n_pairs; ++p) {
    values.push_back(Pick(v.values, rng));
    task.prompt[static_cast<size_t>(slots[p])] = keys[p];
    task.prompt[static_cast<size_t>(slots[p]) + 1] = values.back();
  }
  const int asked = std::uniform_int_distribution<int>(0, n_pairs - 1)(rng);
  task.prompt.back() = keys[asked];
  task.answer = {values[asked]};
  return task;
}

// A span of distinct key/value tokens somewhere in the filler; the prompt ends with the span's
// first token and the model must continue with the rest of it.
Task CopyTask(const TokenVocab& v, int length, int span, std::mt19937& rng) {
  std::vector<int32_t> pool = v.keys;
  pool.insert(pool.end(), v.values.begin(), v.values.end());
  std::shuffle(pool.begin(), pool.end(), rng);
  pool.resize(static_cast<size_t>(span));
  Task task{Haystack(v, length, rng), {}};
  const int depth = std::uniform_int_distribution<int>(0, length - span - 2)(rng);
  std::copy(pool.begin(), pool.end(), task.prompt.begin() + depth);
  task.prompt.back() = pool[0];
  task.answer.assign(pool.begin() + 1, pool.end());
  return task;
}

int32_t ArgMax(const std::vector<float>& x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

// Greedy decoding of task.answer.size() tokens; true when all match.
bool Solve(Engine& engine, const Task& task) {
  const int n_vocab = engine.model().config().n_vocab;
  std::vector<float> logits(static_cast<size_t>(n_vocab));
  const int32_t n = static_cast<int32_t>(task.prompt.size());
  EXPECT_TRUE(engine.Forward(0, task.prompt.data(), n, 0, logits.data()).ok());
  for (size_t i = 0; i < task.answer.size(); ++i) {
    int32_t token = ArgMax(logits);
    if (token != task.answer[i]) return false;
    if (i + 1 == task.answer.size()) break;
    EXPECT_TRUE(engine.Forward(0, &token, 1, n + static_cast<int32_t>(i), logits.data()).ok());
  }
  return true;
}

KvGeometry Geometry(const Model& m) {
  return KvGeometry{m.config().n_layers, m.config().n_kv_heads, m.config().head_dim};
}

// Fraction of tasks solved with a fresh dense f32 cache per task.
double DenseAccuracy(const Model& model, const std::vector<Task>& tasks) {
  int solved = 0;
  for (const Task& task : tasks) {
    ContiguousKvCache cache(Geometry(model), KvStorage::kF32, 1,
                            static_cast<int32_t>(task.prompt.size() + task.answer.size()));
    Engine engine(model, &cache, kThreads);
    solved += Solve(engine, task);
  }
  return static_cast<double>(solved) / static_cast<double>(tasks.size());
}

// The same through the paged cache and the sparsity controller, every layer configured alike
// (prefill: a --sparse-prefill spec for every layer, or dense).
double SparseAccuracy(const Model& model, const std::vector<Task>& tasks, const std::string& method,
                      const std::string& budget, const std::string& kv_type, const std::string& prefill = "") {
  auto config = KvSparsityConfigFromFlags(method, budget, kv_type, model.config().n_layers);
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  if (!prefill.empty()) {
    auto sparsity = ParsePrefillSparsity(prefill, "prefill");
    EXPECT_TRUE(sparsity.ok()) << sparsity.status().ToString();
    for (LayerKvConfig& layer : config->layers) layer.prefill = *sparsity;
  }
  int solved = 0;
  for (const Task& task : tasks) {
    auto setup = CreateSparseKv(Geometry(model), *config, 1,
                                static_cast<int32_t>(task.prompt.size() + task.answer.size()));
    EXPECT_TRUE(setup.ok()) << setup.status().ToString();
    Engine engine(model, setup->cache.get(), kThreads, setup->controller.get());
    solved += Solve(engine, task);
  }
  return static_cast<double>(solved) / static_cast<double>(tasks.size());
}

template <typename Make>
std::vector<Task> Tasks(int n, uint64_t seed, Make make) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<Task> tasks;
  for (int i = 0; i < n; ++i) tasks.push_back(make(rng));
  return tasks;
}

void Report(const std::string& what, double accuracy) {
  std::printf("[ accuracy ] %-52s %5.1f%%\n", what.c_str(), 100.0 * accuracy);
  ::testing::Test::RecordProperty(what, std::to_string(accuracy));
}

class RetrievalModelTest : public ::testing::Test {
 protected:
  // Two layers (the minimum, and the cheapest to run); the default's extra no-op layers are
  // checked separately.
  static void SetUpTestSuite() {
    model_ = testing::LoadRetrievalModel(2).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static const Model& model() { return *model_; }
  static inline Model* model_ = nullptr;
  const TokenVocab vocab_ = RetrievalModelVocab();
};

TEST_F(RetrievalModelTest, VocabIsDistinctAndInRange) {
  std::set<int32_t> all;
  for (const auto* ids : {&vocab_.filler, &vocab_.keys, &vocab_.values}) {
    EXPECT_FALSE(ids->empty());
    for (int32_t id : *ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, model().config().n_vocab);
      EXPECT_TRUE(all.insert(id).second) << "id " << id << " appears twice";
    }
  }
  EXPECT_EQ(model().config().arch, Arch::kLlama);
  EXPECT_EQ(model().config().n_layers, 2);
  EXPECT_GE(model().config().max_context, 32768);
}

TEST_F(RetrievalModelTest, RejectsBadOptions) {
  RetrievalModelOptions one_layer;
  one_layer.n_layers = 1;
  const Status s = WriteRetrievalModel(one_layer, testing::TempPath("bad.gguf"));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("n_layers"), std::string::npos) << s.message();
  RetrievalModelOptions q4;
  q4.weight_type = DType::kQ4_0;
  EXPECT_EQ(WriteRetrievalModel(q4, testing::TempPath("bad.gguf")).code(), StatusCode::kInvalidArgument);
}

TEST_F(RetrievalModelTest, NeedleWithFullCache) {
  for (int length : {256, 1024}) {
    const double acc = DenseAccuracy(model(), Tasks(20, length, [&](std::mt19937& rng) {
                                       return NeedleTask(vocab_, length, rng);
                                     }));
    Report("needle, dense f32, length " + std::to_string(length) + " (20 seeds)", acc);
    EXPECT_GE(acc, 0.95);
  }
  const double acc = DenseAccuracy(model(), Tasks(3, 4096, [&](std::mt19937& rng) {
                                     return NeedleTask(vocab_, 4096, rng);
                                   }));
  Report("needle, dense f32, length 4096 (3 seeds)", acc);
  EXPECT_GE(acc, 0.95);
}

// The first token attends to itself in layer 0, so a key there also looks like its own
// successor; the own-token penalty must still make the value win.
TEST_F(RetrievalModelTest, NeedleAtTheEdges) {
  for (int depth : {0, 1, 253}) {  // 253: the value sits right before the question
    const double acc = DenseAccuracy(model(), Tasks(5, depth + 7, [&](std::mt19937& rng) {
                                       return NeedleTask(vocab_, 256, depth, depth, rng);
                                     }));
    EXPECT_EQ(acc, 1.0) << "needle at depth " << depth;
  }
}

TEST_F(RetrievalModelTest, MultiKey) {
  const double acc = DenseAccuracy(model(), Tasks(20, 11, [&](std::mt19937& rng) {
                                     return MultiKeyTask(vocab_, 1024, 8, rng);
                                   }));
  Report("multi-key (8 pairs, 1 asked), dense f32, length 1024", acc);
  EXPECT_GE(acc, 0.95);
}

TEST_F(RetrievalModelTest, CopyContinuesASpan) {
  const double acc = DenseAccuracy(model(), Tasks(10, 12, [&](std::mt19937& rng) {
                                     return CopyTask(vocab_, 1024, 16, rng);
                                   }));
  Report("copy (16-token span, all correct), dense f32, length 1024", acc);
  EXPECT_GE(acc, 0.95);
}

// The engine evicts after each prompt chunk's attention (chunks of 512 by default), so the
// question's own chunk is always seen in full: a needle only counts as evicted when it lies in
// an earlier chunk, and the answer's first token comes from the prompt pass itself.
TEST_F(RetrievalModelTest, PagedFullPassesAndStreamingLlmFailsADeepNeedle) {
  // The needle lies in the first of two chunks, outside StreamingLLM's 4 sinks + 60 recent tokens.
  const auto tasks = Tasks(20, 13, [&](std::mt19937& rng) { return NeedleTask(vocab_, 1024, 16, 400, rng); });
  const double full = SparseAccuracy(model(), tasks, "full", "", "f32");
  const double full_int8 = SparseAccuracy(model(), tasks, "full", "", "int8");
  const double streaming = SparseAccuracy(model(), tasks, "streaming_llm", "64", "f32");
  Report("deep needle, paged full f32, length 1024", full);
  Report("deep needle, paged full int8, length 1024", full_int8);
  Report("deep needle, paged streaming_llm budget 64, length 1024", streaming);
  EXPECT_GE(full, 0.95);
  EXPECT_GE(full_int8, 0.95);
  EXPECT_EQ(streaming, 0.0);
  // A needle inside the recent window survives StreamingLLM.
  const double recent = SparseAccuracy(model(), Tasks(10, 14, [&](std::mt19937& rng) {
                                         return NeedleTask(vocab_, 1024, 1024 - 40, 1024 - 3, rng);
                                       }),
                                       "streaming_llm", "64", "f32");
  Report("recent needle, paged streaming_llm budget 64, length 1024", recent);
  EXPECT_GE(recent, 0.95);
}

// Sparse prefill must find the needle for the question: a needle in the first of four prompt
// chunks, the question in the last, which is attended sparsely (so are chunks 2 and 3).
// Vertical-Slash scores the chunk's last 64 queries one by one, so the question's column is
// found. The block estimators dilute a needle that one query alone attends to: Block-Sparse's
// pooled query averages it with 63 others, XAttention's strided antidiagonals see the pair only
// when the two align in their tile. They are reported, not required.
TEST_F(RetrievalModelTest, SparsePrefillFindsADeepNeedle) {
  const auto tasks = Tasks(8, 16, [&](std::mt19937& rng) { return NeedleTask(vocab_, 2048, 16, 400, rng); });
  const double dense = SparseAccuracy(model(), tasks, "full", "", "f32");
  const double vertical_slash = SparseAccuracy(model(), tasks, "full", "", "f32", "vertical_slash:vertical=64:slash=8");
  const double block_sparse = SparseAccuracy(model(), tasks, "full", "", "f32", "block_sparse:top_blocks=4");
  const double xattention = SparseAccuracy(model(), tasks, "full", "", "f32", "xattention");
  Report("deep needle, dense prefill, length 2048", dense);
  Report("deep needle, vertical_slash prefill, length 2048", vertical_slash);
  Report("deep needle, block_sparse prefill (4 blocks), length 2048", block_sparse);
  Report("deep needle, xattention prefill, length 2048", xattention);
  EXPECT_GE(dense, 0.95);
  EXPECT_GE(vertical_slash, dense);
}

// MInference estimates once per prompt from its last queries: the question. Two-pass
// Vertical-Slash keeps the column the question reads (the needle's value, in the induction
// layer) in the pattern every chunk of the second pass assembles from; a per-chunk estimate
// of a chunk before the question ranks only what that chunk's own fillers read. The fork of
// pass 1 is released, and the answer is right.
TEST_F(RetrievalModelTest, TwoPassVerticalSlashKeepsTheQuestionsColumnInEveryChunk) {
  std::mt19937 rng(41);
  const Task task = NeedleTask(vocab_, 2048, 16, 400, rng);
  const int32_t key_position = static_cast<int32_t>(
      std::find(task.prompt.begin(), task.prompt.end(), task.prompt.back()) - task.prompt.begin());
  auto config = KvSparsityConfigFromFlags("full", "", "f32", model().config().n_layers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto sparsity = ParsePrefillSparsity("vertical_slash:vertical=30:slash=50:sink_columns=4:local_diagonals=8:two_pass=1",
                                       "prefill");
  ASSERT_TRUE(sparsity.ok()) << sparsity.status().ToString();
  for (LayerKvConfig& layer : config->layers) layer.prefill = *sparsity;
  auto setup = CreateSparseKv(Geometry(model()), *config, 1, 2048 + 1);
  ASSERT_TRUE(setup.ok()) << setup.status().ToString();
  Engine engine(model(), setup->cache.get(), kThreads, setup->controller.get());
  EXPECT_TRUE(Solve(engine, task));
  EXPECT_EQ(setup->controller->n_active_sequences(), 1);  // pass 1's fork is gone
  const int induction_layer = model().config().n_layers - 1;
  const std::vector<VerticalSlashPattern>& patterns = engine.PromptPatterns(induction_layer);
  ASSERT_EQ(patterns.size(), 1u);  // one head
  const std::vector<int64_t>& columns = patterns[0].columns;
  EXPECT_EQ(columns.size(), 30u);
  EXPECT_TRUE(std::find(columns.begin(), columns.end(), key_position + 1) != columns.end())
      << "the value at position " << key_position + 1 << " is not among the estimated columns";
  EXPECT_EQ(patterns[0].diagonals.size(), 50u);
  // The chunks past the first (1024 tokens of context, min_context) attended sparsely, in each pass.
  EXPECT_EQ(setup->controller->layer_stats()[induction_layer].sparse_prefill_chunks, 2 * (2048 / 512 - 1));

  // The column is the question's: the same prompt ending in filler (queries like those of every
  // chunk before the question) leaves it out.
  std::vector<int32_t> no_question = task.prompt;
  no_question.back() = vocab_.filler[0];
  auto fresh = CreateSparseKv(Geometry(model()), *config, 1, 2048);
  ASSERT_TRUE(fresh.ok());
  Engine filler_engine(model(), fresh->cache.get(), kThreads, fresh->controller.get());
  std::vector<float> logits(static_cast<size_t>(model().config().n_vocab));
  ASSERT_TRUE(filler_engine.Forward(0, no_question.data(), 2048, 0, logits.data()).ok());
  const std::vector<int64_t>& filler_columns = filler_engine.PromptPatterns(induction_layer).at(0).columns;
  EXPECT_TRUE(std::find(filler_columns.begin(), filler_columns.end(), key_position + 1) == filler_columns.end());
}

// With a pattern that covers every key, both passes compute dense attention: a two-pass prompt
// after a prefix (on the fork's shared pages) gives dense logits and leaves the sequence's
// tokens as a one-pass prefill does.
TEST_F(RetrievalModelTest, TwoPassVerticalSlashAfterAPrefixMatchesDense) {
  std::mt19937 rng(43);
  const std::vector<int32_t> tokens = Haystack(vocab_, 1800, rng);
  const int n_vocab = model().config().n_vocab;
  auto last_logits = [&](const std::string& prefill) {
    auto config = KvSparsityConfigFromFlags("full", "", "f32", model().config().n_layers);
    EXPECT_TRUE(config.ok());
    if (!prefill.empty()) {
      for (LayerKvConfig& layer : config->layers) layer.prefill = *ParsePrefillSparsity(prefill, "prefill");
    }
    auto setup = CreateSparseKv(Geometry(model()), *config, 1, 1800);
    EXPECT_TRUE(setup.ok());
    Engine engine(model(), setup->cache.get(), kThreads, setup->controller.get());
    std::vector<float> logits(static_cast<size_t>(n_vocab));
    EXPECT_TRUE(engine.Forward(0, tokens.data(), 300, 0, logits.data()).ok());
    EXPECT_TRUE(engine.Forward(0, tokens.data() + 300, 1500, 300, logits.data()).ok());
    for (int layer = 0; layer < model().config().n_layers; ++layer) {
      EXPECT_EQ(setup->cache->NumTokens(0, layer), 1800) << prefill;
    }
    EXPECT_EQ(setup->controller->n_active_sequences(), 1);
    return logits;
  };
  const std::vector<float> dense = last_logits("");
  const std::vector<float> two_pass = last_logits("vertical_slash:vertical=4096:slash=4096:min_context=1:two_pass=1");
  for (int i = 0; i < n_vocab; ++i) EXPECT_NEAR(two_pass[i], dense[i], 1e-4f * (1.f + std::fabs(dense[i]))) << i;
}

// One prompt chunk with the question last and a three-token answer: the first token comes from
// the full prompt pass, the next two must be retrieved from the compressed cache. SnapKV's
// observation window holds the question, which votes for the first value, and its pooling
// keeps the neighbours that the rest of the answer needs; StreamingLLM keeps neither.
TEST_F(RetrievalModelTest, SnapKvKeepsTheNeedleTheQuestionPointsAt) {
  const auto tasks = Tasks(20, 15, [&](std::mt19937& rng) { return NeedleTask(vocab_, 512, 16, 400, rng, 3); });
  const double snapkv = SparseAccuracy(model(), tasks, "snapkv", "64", "f32");
  const double streaming = SparseAccuracy(model(), tasks, "streaming_llm", "64", "f32");
  Report("3-token needle, one chunk, snapkv budget 64, length 512", snapkv);
  Report("3-token needle, one chunk, streaming_llm budget 64, length 512", streaming);
  EXPECT_GE(snapkv, 0.95);
  EXPECT_EQ(streaming, 0.0);
}

TEST(RetrievalModelDefaultTest, DefaultLayersAndF16Weights) {
  RetrievalModelOptions options;  // 4 layers, two of them no-ops
  options.weight_type = DType::kF16;
  const std::string path = testing::TempPath("retrieval-default-f16.gguf");
  ASSERT_TRUE(WriteRetrievalModel(options, path).ok());
  auto model = Model::Load(path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ((*model)->config().n_layers, 4);
  const TokenVocab vocab = RetrievalModelVocab();
  const double acc = DenseAccuracy(**model, Tasks(10, 21, [&](std::mt19937& rng) {
                                     return NeedleTask(vocab, 1024, rng);
                                   }));
  Report("needle, 4 layers f16 weights, dense f32, length 1024", acc);
  EXPECT_GE(acc, 0.95);
}

// The multi-head variant runs the same circuit in two of its 16 KV heads: it solves the tasks
// with the full cache, and razor_test checks what its heads attend to (through the probe).
TEST(RetrievalModelMultiHeadTest, SolvesTheTasksWithTheFullCache) {
  auto model = testing::LoadRetrievalModel(4, RetrievalShape::kMultiHead);
  EXPECT_EQ(model->config().n_heads, 8);
  EXPECT_EQ(model->config().n_kv_heads, 4);
  EXPECT_EQ(model->config().head_dim, 128);
  const TokenVocab vocab = RetrievalModelVocab();
  const double needle = DenseAccuracy(*model, Tasks(3, 31, [&](std::mt19937& rng) {
                                        return NeedleTask(vocab, 512, 0, 500, rng, 3);
                                      }));
  const double copy = DenseAccuracy(*model, Tasks(2, 32, [&](std::mt19937& rng) {
                                      return CopyTask(vocab, 512, 12, rng);
                                    }));
  Report("multi-head: 3-token needle, dense f32, length 512", needle);
  Report("multi-head: copy (12-token span), dense f32, length 512", copy);
  EXPECT_EQ(needle, 1.0);
  EXPECT_EQ(copy, 1.0);
  const std::vector<RetrievalHead> circuit = RetrievalCircuitHeads(RetrievalShape::kMultiHead, 4);
  ASSERT_EQ(circuit.size(), 2u);
  EXPECT_EQ(circuit[0].layer, 0);
  EXPECT_EQ(circuit[1].layer, 3);
}

TEST(RetrievalModelDefaultTest, BuiltinPathIsWrittenOnceAndReused) {
  const std::string dir = testing::TempPath("cache");
  std::filesystem::remove_all(dir);
  ASSERT_EQ(setenv("KVSPARSE_CACHE", dir.c_str(), 1), 0);
  auto first = BuiltinRetrievalModelPath();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  const auto written = std::filesystem::last_write_time(*first);
  auto second = BuiltinRetrievalModelPath();
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(*first, *second);
  EXPECT_EQ(std::filesystem::last_write_time(*second), written);
  // Only the model remains: no temp files left behind.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) files += entry.is_regular_file();
  EXPECT_EQ(files, 1);
  auto model = Model::Load(*first);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ((*model)->config().n_layers, RetrievalModelOptions{}.n_layers);
  unsetenv("KVSPARSE_CACHE");
}

}  // namespace
}  // namespace kvsparse
