// bench's user:data.jsonl files: one JSON object per line (context, question, answers, task).
#include "fuzz_target.h"
#include "kvsparse/bench_tasks.h"

namespace kvsparse::fuzz {

int FuzzUserTasks(const uint8_t* data, size_t size) {
  auto records = ParseUserTasks(AsText(data, size), "fuzz.jsonl", "fuzz");
  (void)records;
  return 0;
}

}  // namespace kvsparse::fuzz
