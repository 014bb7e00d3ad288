// fuzz_labeled: labeled classification data (core/data/labeled.h): the input read as each GLUE
// task's TSV file and as labeled JSONL, then its labels turned into class names, ids and scores.
// Any input must parse or fail with weft::Error.
#include <cstdint>
#include <string>

#include "core/data/labeled.h"
#include "core/util/error.h"
#include "fuzz/scratch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = weft::fuzz::write_file("labeled/input", data, size);
  for (const auto& name : weft::glue_task_names()) {
    try {
      int64_t skipped = 0;
      const auto examples = weft::read_glue_tsv(path, weft::glue_task(name), &skipped);
      const auto& task = weft::glue_task(name);
      if (task.regression) (void)weft::label_values(examples);
      else (void)weft::label_ids(examples, task.labels);
    } catch (const weft::Error&) {
    }
  }
  try {
    const auto examples = weft::read_labeled_jsonl(path);
    try {
      (void)weft::label_ids(examples, weft::label_names(examples));
    } catch (const weft::Error&) {
    }
    (void)weft::label_values(examples);
  } catch (const weft::Error&) {
  }
  return 0;
}
