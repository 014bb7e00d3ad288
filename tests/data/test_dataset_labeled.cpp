// Labeled classification data: GLUE's TSV files in each task's real layout, JSONL, and turning
// labels into class names, ids and regression values.
#include <gtest/gtest.h>

#include "core/data/labeled.h"
#include "core/util/error.h"
#include "test_dataset_util.h"

namespace weft {
namespace {

using dataset_test::expect_error;
using dataset_test::TempDir;
using Names = std::vector<std::string>;

// Lines of a TSV file: fields joined by tabs, each line ended by "\n".
std::string tsv_lines(const std::vector<std::vector<std::string>>& rows) {
  std::string text;
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) text += (i ? "\t" : "") + row[i];
    text += "\n";
  }
  return text;
}

std::vector<LabeledExample> examples_with_labels(const Names& labels) {
  std::vector<LabeledExample> examples;
  for (const auto& label : labels) examples.push_back({"some text", "", false, label});
  return examples;
}

const Names kMnliHeader = {"index", "promptID", "pairID", "genre", "sentence1_binary_parse",
                           "sentence2_binary_parse", "sentence1_parse", "sentence2_parse",
                           "sentence1", "sentence2"};

Names append_fields(Names a, const Names& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// ---- the task table ----

TEST(LabeledDataGlueTasks, TableFollowsHfGlueProcessors) {
  EXPECT_EQ(glue_task_names(),
            (Names{"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}));
  for (const char* name : {"cola", "sst2", "mrpc", "qqp", "wnli"}) {
    EXPECT_EQ(glue_task(name).labels, (Names{"0", "1"})) << name;
    EXPECT_FALSE(glue_task(name).regression) << name;
  }
  EXPECT_EQ(glue_task("mnli").labels, (Names{"contradiction", "entailment", "neutral"}));
  EXPECT_EQ(glue_task("qnli").labels, (Names{"entailment", "not_entailment"}));
  EXPECT_EQ(glue_task("rte").labels, (Names{"entailment", "not_entailment"}));
  EXPECT_TRUE(glue_task("stsb").regression);
  EXPECT_TRUE(glue_task("stsb").labels.empty());
  EXPECT_FALSE(glue_task("cola").has_pair);
  EXPECT_FALSE(glue_task("sst2").has_pair);
  for (const char* name : {"mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}) {
    EXPECT_TRUE(glue_task(name).has_pair) << name;
  }
  EXPECT_EQ(glue_task("mnli").eval_files, (Names{"dev_matched.tsv", "dev_mismatched.tsv"}));
  EXPECT_EQ(glue_task("rte").eval_files, (Names{"dev.tsv"}));
  for (const auto& name : glue_task_names()) EXPECT_EQ(glue_task(name).name, name);
}

TEST(LabeledDataGlueTasks, AcceptsHfSpellingsAndRefusesUnknownNames) {
  EXPECT_EQ(glue_task("sst-2").name, "sst2");
  EXPECT_EQ(glue_task("STS-B").name, "stsb");
  EXPECT_EQ(glue_task("MNLI").name, "mnli");
  expect_error([] { glue_task("squad"); },
               "unknown GLUE task 'squad' (use one of cola, sst2, mrpc, qqp, stsb, mnli, qnli, "
               "rte, wnli)");
}

// ---- GLUE TSV, each task in its real layout ----

TEST(LabeledDataGlueTsv, ColaHasNoHeaderAndReadsLabelAndSentenceColumns) {
  TempDir dir;
  const auto path = dir.write(
      "CoLA/train.tsv",
      "gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.\n"
      "gj04\t0\t*\tThey drank the pub.\n"
      "clc95\t1\t\tHe said \"hello\" twice.\r\n");
  int64_t skipped = -1;
  const auto examples = read_glue_tsv(path, glue_task("cola"), &skipped);
  ASSERT_EQ(examples.size(), 3u);
  EXPECT_EQ(examples[0].text, "Our friends won't buy this analysis, let alone the next one we propose.");
  EXPECT_EQ(examples[0].label, "1");
  EXPECT_FALSE(examples[0].has_pair);
  EXPECT_EQ(examples[0].text_pair, "");
  EXPECT_EQ(examples[1].text, "They drank the pub.");
  EXPECT_EQ(examples[1].label, "0");
  EXPECT_EQ(examples[2].text, "He said \"hello\" twice.");  // quotes are text; '\r' dropped
  EXPECT_EQ(skipped, 0);
  EXPECT_EQ(label_ids(examples, glue_task("cola").labels), (std::vector<int64_t>{1, 0, 1}));
}

TEST(LabeledDataGlueTsv, Sst2SkipsTheHeader) {
  TempDir dir;
  const auto path = dir.write("SST-2/dev.tsv",
                              "sentence\tlabel\n"
                              "it 's a charming and often affecting journey . \t1\n"
                              "unflinchingly bleak and desperate \t0\n");
  const auto examples = read_glue_tsv(path, glue_task("sst2"));
  ASSERT_EQ(examples.size(), 2u);
  EXPECT_EQ(examples[0].text, "it 's a charming and often affecting journey . ");
  EXPECT_EQ(examples[0].label, "1");
  EXPECT_FALSE(examples[0].has_pair);
  EXPECT_EQ(examples[1].text, "unflinchingly bleak and desperate ");
  EXPECT_EQ(examples[1].label, "0");
}

TEST(LabeledDataGlueTsv, MrpcReadsLabelFirstAndStringsThreeAndFourWithBomAndCrlf) {
  TempDir dir;
  const auto path = dir.write(
      "MRPC/train.tsv",
      "\xEF\xBB\xBFQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\r\n"
      "1\t702876\t702977\tAmrozi accused his brother , whom he called \" the witness \" , of "
      "deliberately distorting his evidence .\tReferring to him as only \" the witness \" , Amrozi "
      "accused his brother of deliberately distorting his evidence .\r\n"
      "0\t2108705\t2108831\tYucaipa owned Dominick 's before selling the chain to Safeway in 1998 "
      "for $ 2.5 billion .\tYucaipa bought Dominick 's in 1995 for $ 693 million and sold it to "
      "Safeway for $ 1.8 billion in 1998 .\r\n");
  const auto examples = read_glue_tsv(path, glue_task("mrpc"));
  ASSERT_EQ(examples.size(), 2u);
  EXPECT_EQ(examples[0].label, "1");
  EXPECT_EQ(examples[0].text,
            "Amrozi accused his brother , whom he called \" the witness \" , of deliberately "
            "distorting his evidence .");
  EXPECT_TRUE(examples[0].has_pair);
  EXPECT_EQ(examples[0].text_pair,
            "Referring to him as only \" the witness \" , Amrozi accused his brother of "
            "deliberately distorting his evidence .");
  EXPECT_EQ(examples[1].label, "0");
  EXPECT_EQ(examples[1].text_pair,
            "Yucaipa bought Dominick 's in 1995 for $ 693 million and sold it to Safeway for $ 1.8 "
            "billion in 1998 .");
}

TEST(LabeledDataGlueTsv, QqpReadsQuestionsAndSkipsAndCountsMalformedLines) {
  TempDir dir;
  const auto path = dir.write(
      "QQP/train.tsv",
      tsv_lines({{"id", "qid1", "qid2", "question1", "question2", "is_duplicate"},
           {"133273", "213221", "213222",
            "How is the life of a math student? Could you describe your own experiences?",
            "Which level of prepration is enough for the exam jlpt5?", "0"},
           {"360472", "364011", "490273", "What causes stool color to change to yellow?"},
           {"402555", "536040", "536041", "How do I control my horny emotions?",
            "How do you control your horniness?", "1"},
           {"x"}}));
  int64_t skipped = -1;
  const auto examples = read_glue_tsv(path, glue_task("qqp"), &skipped);
  EXPECT_EQ(skipped, 2);
  ASSERT_EQ(examples.size(), 2u);
  EXPECT_EQ(examples[0].text,
            "How is the life of a math student? Could you describe your own experiences?");
  EXPECT_EQ(examples[0].text_pair, "Which level of prepration is enough for the exam jlpt5?");
  EXPECT_EQ(examples[0].label, "0");
  EXPECT_EQ(examples[1].text, "How do I control my horny emotions?");
  EXPECT_EQ(examples[1].text_pair, "How do you control your horniness?");
  EXPECT_EQ(examples[1].label, "1");
  EXPECT_NO_THROW(read_glue_tsv(path, glue_task("qqp")));  // the count is optional

  const auto all_bad = dir.write("QQP/bad.tsv", tsv_lines({{"id", "qid1", "qid2", "question1",
                                                      "question2", "is_duplicate"},
                                                     {"1", "2", "3", "only one question"}}));
  expect_error([&] { read_glue_tsv(all_bad, glue_task("qqp")); },
               "has no examples (1 malformed lines skipped)");
}

TEST(LabeledDataGlueTsv, StsbReadsSentencesSevenAndEightAndTheLastColumnAsScore) {
  TempDir dir;
  const Names header = {"index",      "genre",   "filename",  "year",      "old_index",
                        "source1",    "source2", "sentence1", "sentence2", "score"};
  const auto path = dir.write(
      "STS-B/train.tsv",
      tsv_lines({header,
           {"0", "main-captions", "MSRvid", "2012test", "0001", "none", "none",
            "A plane is taking off.", "An air plane is taking off.", "5.000"},
           {"1", "main-captions", "MSRvid", "2012test", "0004", "none", "none",
            "A man is playing a large flute.", "A man is playing a flute.", "3.800"}}));
  const auto examples = read_glue_tsv(path, glue_task("stsb"));
  ASSERT_EQ(examples.size(), 2u);
  EXPECT_EQ(examples[0].text, "A plane is taking off.");
  EXPECT_EQ(examples[0].text_pair, "An air plane is taking off.");
  EXPECT_TRUE(examples[0].has_pair);
  EXPECT_EQ(examples[0].label, "5.000");
  EXPECT_EQ(examples[1].label, "3.800");
  EXPECT_EQ(label_values(examples), (std::vector<double>{5.0, 3.8}));

  const auto bad = dir.write(
      "STS-B/dev.tsv", tsv_lines({header,
                            {"0", "main-captions", "MSRvid", "2012test", "0001", "none", "none",
                             "A plane is taking off.", "An air plane is taking off.", "high"}}));
  expect_error([&] { read_glue_tsv(bad, glue_task("stsb")); },
               "dev.tsv:2: the GLUE stsb score 'high' is not a finite number");
}

TEST(LabeledDataGlueTsv, MnliReadsTrainAndDevLayoutsAndNumbersLabelsInHfOrder) {
  TempDir dir;
  const Names parses = {"( ( Conceptually ( cream skimming ) ) ... )", "( ( Product and ) ... )",
                        "(ROOT (S (NP (JJ Conceptually) ...)))", "(ROOT (S (NP (NN Product) ...)))"};
  // train.tsv: ... sentence1 sentence2 label1 gold_label (12 columns).
  const auto train = dir.write(
      "MNLI/train.tsv",
      tsv_lines({append_fields(kMnliHeader, {"label1", "gold_label"}),
           append_fields(append_fields({"0", "31193", "31193n", "government"}, parses),
                  {"Conceptually cream skimming has two basic dimensions - product and geography.",
                   "Product and geography are what make cream skimming work. ", "neutral",
                   "neutral"}),
           append_fields(append_fields({"1", "101457", "101457e", "telephone"}, parses),
                  {"you know during the season and i guess at at your level uh you lose them to "
                   "the next level",
                   "You lose the things to the following level if the people recall.",
                   "entailment", "entailment"})}));
  // dev_matched.tsv: ... sentence1 sentence2 label1 .. label5 gold_label (16 columns).
  const auto dev = dir.write(
      "MNLI/dev_matched.tsv",
      tsv_lines({append_fields(kMnliHeader, {"label1", "label2", "label3", "label4", "label5", "gold_label"}),
           append_fields(append_fields({"0", "63735", "63735n", "slate"}, parses),
                  {"The new rights are nice enough", "Everyone really likes the newest benefits ",
                   "neutral", "entailment", "neutral", "neutral", "neutral", "neutral"}),
           append_fields(append_fields({"1", "91383", "91383c", "government"}, parses),
                  {"This site includes a list of all award winners.",
                   "The Government Executive articles housed on the website are not able to be "
                   "searched.",
                   "contradiction", "contradiction", "contradiction", "contradiction",
                   "contradiction", "contradiction"})}));
  const GlueTask& mnli = glue_task("mnli");
  const auto train_examples = read_glue_tsv(train, mnli);
  ASSERT_EQ(train_examples.size(), 2u);
  EXPECT_EQ(train_examples[0].text,
            "Conceptually cream skimming has two basic dimensions - product and geography.");
  EXPECT_EQ(train_examples[0].text_pair, "Product and geography are what make cream skimming work. ");
  EXPECT_EQ(train_examples[0].label, "neutral");
  EXPECT_EQ(train_examples[1].label, "entailment");

  const auto dev_examples = read_glue_tsv(dev, mnli);
  ASSERT_EQ(dev_examples.size(), 2u);
  EXPECT_EQ(dev_examples[0].text, "The new rights are nice enough");
  EXPECT_EQ(dev_examples[0].label, "neutral");  // gold_label, the last column
  EXPECT_EQ(dev_examples[1].label, "contradiction");
  // HF's MnliProcessor.get_labels(): contradiction, entailment, neutral.
  EXPECT_EQ(label_ids(train_examples, mnli.labels), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(label_ids(dev_examples, mnli.labels), (std::vector<int64_t>{2, 0}));
}

TEST(LabeledDataGlueTsv, QnliRteWnliReadColumnsOneTwoAndTheLastAsLabel) {
  TempDir dir;
  const auto qnli = dir.write(
      "QNLI/dev.tsv",
      tsv_lines({{"index", "question", "sentence", "label"},
           {"0", "What came into force after the new constitution was herald?",
            "As of that day, the new constitution heralding the Second Republic came into force.",
            "entailment"},
           {"1", "What is the first major city in the stream of the Rhine?",
            "The most important tributaries in this area are the Ill below of Strasbourg.",
            "not_entailment"}}));
  const auto q = read_glue_tsv(qnli, glue_task("qnli"));
  ASSERT_EQ(q.size(), 2u);
  EXPECT_EQ(q[0].text, "What came into force after the new constitution was herald?");
  EXPECT_EQ(q[0].text_pair,
            "As of that day, the new constitution heralding the Second Republic came into force.");
  EXPECT_EQ(label_ids(q, glue_task("qnli").labels), (std::vector<int64_t>{0, 1}));

  const auto rte = dir.write(
      "RTE/train.tsv",
      tsv_lines({{"index", "sentence1", "sentence2", "label"},
           {"0", "No Weapons of Mass Destruction Found in Iraq Yet.",
            "Weapons of Mass Destruction Found in Iraq.", "not_entailment"},
           {"1", "A place of sorrow, after Pope John Paul II died, became a place of celebration.",
            "Pope Benedict XVI is the new leader of the Roman Catholic Church.", "entailment"}}));
  const auto r = read_glue_tsv(rte, glue_task("rte"));
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].text, "No Weapons of Mass Destruction Found in Iraq Yet.");
  EXPECT_EQ(r[0].text_pair, "Weapons of Mass Destruction Found in Iraq.");
  EXPECT_EQ(r[0].label, "not_entailment");
  EXPECT_EQ(r[1].label, "entailment");

  const auto wnli = dir.write(
      "WNLI/train.tsv",
      tsv_lines({{"index", "sentence1", "sentence2", "label"},
           {"0", "I stuck a pin through a carrot. When I pulled the pin out, it had a hole.",
            "The carrot had a hole.", "1"},
           {"1", "John couldn't see the stage with Billy in front of him because he is so short.",
            "John is so short.", "1"},
           {"2", "The police arrested all of the gang members.", "The police were trying to stop "
            "the gang members.", "0"}}));
  const auto w = read_glue_tsv(wnli, glue_task("wnli"));
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[2].text, "The police arrested all of the gang members.");
  EXPECT_EQ(w[2].text_pair, "The police were trying to stop the gang members.");
  EXPECT_EQ(w[2].label, "0");
}

TEST(LabeledDataGlueTsv, SkipsEmptyLinesAndCountsPhysicalLines) {
  TempDir dir;
  const auto path = dir.write("RTE/dev.tsv",
                              "index\tsentence1\tsentence2\tlabel\n\n0\ta\tb\tentailment\n\r\n"
                              "1\tc\td\tmaybe\n");
  expect_error([&] { read_glue_tsv(path, glue_task("rte")); },
               "dev.tsv:5: 'maybe' is not a GLUE rte label (valid: 'entailment', 'not_entailment')");
}

// ---- GLUE TSV errors ----

TEST(LabeledDataGlueTsvErrors, MissingColumnNamesFileLineAndExpectedCount) {
  TempDir dir;
  const auto rte = dir.write("RTE/train.tsv", tsv_lines({{"index", "sentence1", "sentence2", "label"},
                                                   {"0", "a", "b", "entailment"},
                                                   {"1", "only one sentence", "entailment"}}));
  expect_error([&] { read_glue_tsv(rte, glue_task("rte")); },
               "train.tsv:3: expected at least 4 tab-separated columns for GLUE rte, got 3");
  const auto cola = dir.write("CoLA/dev.tsv", "gj04\t1\t\tFine.\ngj04\t1\tNo sentence.\n");
  expect_error([&] { read_glue_tsv(cola, glue_task("cola")); },
               "dev.tsv:2: expected at least 4 tab-separated columns for GLUE cola, got 3");
}

TEST(LabeledDataGlueTsvErrors, UnknownLabelNamesFileLineAndValidLabels) {
  TempDir dir;
  const auto sst2 = dir.write("SST-2/train.tsv", "sentence\tlabel\ngood \t1\nmeh \t2\n");
  expect_error([&] { read_glue_tsv(sst2, glue_task("sst2")); },
               "train.tsv:3: '2' is not a GLUE sst2 label (valid: '0', '1')");
  const auto mnli = dir.write(
      "MNLI/train.tsv",
      tsv_lines({append_fields(kMnliHeader, {"label1", "gold_label"}),
           append_fields(kMnliHeader, {"-", "-"})}));  // any text in the first ten columns
  expect_error([&] { read_glue_tsv(mnli, glue_task("mnli")); },
               "train.tsv:2: '-' is not a GLUE mnli label (valid: 'contradiction', 'entailment', "
               "'neutral')");
}

TEST(LabeledDataGlueTsvErrors, TestFilesAreRefusedForCarryingNoLabels) {
  TempDir dir;
  const auto sst2 = dir.write("SST-2/test.tsv",
                              "index\tsentence\n0\tuneasy mishmash of styles and genres .\n");
  expect_error([&] { read_glue_tsv(sst2, glue_task("sst2")); }, "test files carry no labels");
  expect_error([&] { read_glue_tsv(sst2, glue_task("sst2")); },
               "test.tsv:1: the header 'index sentence' (tab-separated) has no 'label' column");
  const auto cola = dir.write("CoLA/test.tsv", "index\tsentence\n0\tBill whistled past the house.\n");
  expect_error([&] { read_glue_tsv(cola, glue_task("cola")); },
               "test.tsv:1: the header 'index<TAB>sentence' marks GLUE's CoLA test file, and test "
               "files carry no labels");
  const auto qqp = dir.write("QQP/test.tsv", "id\tquestion1\tquestion2\n0\tWhy?\tHow?\n");
  expect_error([&] { read_glue_tsv(qqp, glue_task("qqp")); }, "test files carry no labels");
  const auto mnli = dir.write("MNLI/test_matched.tsv", tsv_lines({kMnliHeader, kMnliHeader}));
  expect_error([&] { read_glue_tsv(mnli, glue_task("mnli")); },
               "no 'gold_label' column where GLUE mnli keeps its label: this looks like a GLUE "
               "test file, and test files carry no labels (read train.tsv or dev_matched.tsv or "
               "dev_mismatched.tsv)");
  const auto mrpc = dir.write("MRPC/test.tsv",
                              "\xEF\xBB\xBFindex\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                              "0\t1089874\t1089925\tPCCW 's chief .\tCurrent Chief .\n");
  expect_error([&] { read_glue_tsv(mrpc, glue_task("mrpc")); }, "test files carry no labels");
}

TEST(LabeledDataGlueTsvErrors, EmptyOrHeaderOnlyFilesHaveNoExamples) {
  TempDir dir;
  const auto empty = dir.write("CoLA/train.tsv", "");
  expect_error([&] { read_glue_tsv(empty, glue_task("cola")); },
               "GLUE cola file '" + empty + "' has no examples");
  const auto header = dir.write("SST-2/train.tsv", "sentence\tlabel\n");
  expect_error([&] { read_glue_tsv(header, glue_task("sst2")); }, "has no examples");
  expect_error([&] { read_glue_tsv(dir.path("missing.tsv"), glue_task("sst2")); },
               "missing.tsv");
}

// ---- JSONL ----

TEST(LabeledDataJsonl, ReadsTextPairAndLabelsOfEveryType) {
  TempDir dir;
  const auto path = dir.write(
      "d.jsonl",
      "\xEF\xBB\xBF{\"text\": \"great movie\", \"label\": \"positive\", \"id\": 7}\n"
      "\n  \n"
      "{\"text\": \"q?\", \"text_pair\": \"a.\", \"label\": 1}\r\n"
      "{\"text\": \"x\", \"text_pair\": null, \"label\": 3.8}\n"
      "{\"label\": -2, \"text\": \"w\\u00f6rld\", \"text_pair\": \"\"}");
  const auto examples = read_labeled_jsonl(path);
  ASSERT_EQ(examples.size(), 4u);
  EXPECT_EQ(examples[0].text, "great movie");
  EXPECT_FALSE(examples[0].has_pair);
  EXPECT_EQ(examples[0].label, "positive");
  EXPECT_EQ(examples[1].text, "q?");
  EXPECT_TRUE(examples[1].has_pair);
  EXPECT_EQ(examples[1].text_pair, "a.");
  EXPECT_EQ(examples[1].label, "1");
  EXPECT_FALSE(examples[2].has_pair);  // null pair: none
  EXPECT_EQ(examples[2].label, "3.8");
  EXPECT_EQ(examples[3].text, "w\xc3\xb6rld");
  EXPECT_TRUE(examples[3].has_pair);  // an empty pair is still a pair
  EXPECT_EQ(examples[3].label, "-2");
}

TEST(LabeledDataJsonl, UsesTheGivenFieldNames) {
  TempDir dir;
  const auto path = dir.write("d.jsonl",
                              "{\"premise\": \"p\", \"hypothesis\": \"h\", \"gold\": \"neutral\", "
                              "\"text\": 5}\n");
  const auto examples = read_labeled_jsonl(path, "premise", "hypothesis", "gold");
  ASSERT_EQ(examples.size(), 1u);
  EXPECT_EQ(examples[0].text, "p");
  EXPECT_EQ(examples[0].text_pair, "h");
  EXPECT_EQ(examples[0].label, "neutral");
}

TEST(LabeledDataJsonl, ErrorsNameFileLineAndProblem) {
  TempDir dir;
  const std::string good = "{\"text\": \"ok\", \"label\": 0}\n";
  auto expect_line_error = [&](const std::string& content, const std::string& needle) {
    const auto path = dir.write("e.jsonl", content);
    expect_error([&] { read_labeled_jsonl(path); }, needle);
  };
  expect_line_error(good + "{\"text\": \"a\", \"label\": 1\n", "e.jsonl:2: invalid JSON");
  expect_line_error(good + "[\"a\", 1]\n", "e.jsonl:2: expected a JSON object, got array");
  expect_line_error(good + good + "{\"txt\": \"a\", \"label\": 1}\n",
                    "e.jsonl:3: object has no field 'text'");
  expect_line_error("{\"text\": 5, \"label\": 1}\n",
                    "e.jsonl:1: field 'text' is number, expected a string");
  expect_line_error(good + "{\"text\": \"a\"}\n", "e.jsonl:2: object has no field 'label'");
  expect_line_error(good + "{\"text\": \"a\", \"label\": true}\n",
                    "e.jsonl:2: field 'label' is boolean, expected a string, an integer or a "
                    "number");
  expect_line_error("{\"text\": \"a\", \"label\": null}\n", "e.jsonl:1: field 'label' is null");
  expect_line_error("{\"text\": \"a\", \"label\": [1]}\n", "e.jsonl:1: field 'label' is array");
  expect_line_error("{\"text\": \"a\", \"label\": \"\"}\n",
                    "e.jsonl:1: field 'label' is an empty string");
  expect_line_error("{\"text\": \"a\", \"text_pair\": 3, \"label\": 1}\n",
                    "e.jsonl:1: field 'text_pair' is number, expected a string (or null)");
  expect_line_error("\n \n", "labeled JSONL file '" + dir.path("e.jsonl") + "' has no examples");
}

// ---- label names, ids, values ----

TEST(LabeledDataLabels, DeclaredNamesAreUsedAsIsAndEveryLabelMustBeOne) {
  const auto examples = examples_with_labels({"neg", "pos", "neg"});
  EXPECT_EQ(label_names(examples, {"pos", "neg", "neutral"}), (Names{"pos", "neg", "neutral"}));
  EXPECT_EQ(label_ids(examples, {"pos", "neg", "neutral"}), (std::vector<int64_t>{1, 0, 1}));
  expect_error([&] { label_names(examples_with_labels({"pos", "neg", "mixed", "bad"}), {"pos", "neg"}); },
               "example 2 has the label 'mixed', which is not one of the declared labels ('pos', "
               "'neg')");
  expect_error([&] { label_names(examples, {"pos", "neg", "pos"}); },
               "the declared label list names the class 'pos' twice");
  expect_error([&] { label_names(examples, {"pos", ""}); }, "has an empty class name");
}

TEST(LabeledDataLabels, PlainIntegersNumberZeroToTheLargest) {
  EXPECT_EQ(label_names(examples_with_labels({"2", "0", "2"})), (Names{"0", "1", "2"}));
  EXPECT_EQ(label_names(examples_with_labels({"3"})), (Names{"0", "1", "2", "3"}));
  EXPECT_EQ(label_ids(examples_with_labels({"2", "0", "2"}), label_names(examples_with_labels({"2", "0", "2"}))),
            (std::vector<int64_t>{2, 0, 2}));
  EXPECT_EQ(label_names(examples_with_labels({"99999"})).size(), 100000u);
  expect_error([] { label_names(examples_with_labels({"1", "100000"})); },
               "example 1 has the integer label 100000, more than 100000 classes: declare the "
               "class names instead");
  EXPECT_TRUE(label_names({}).empty());
}

TEST(LabeledDataLabels, OtherwiseDistinctLabelsSortedByBytes) {
  EXPECT_EQ(label_names(examples_with_labels({"b", "a", "10", "B", "a", "2"})),
            (Names{"10", "2", "B", "a", "b"}));
  // Not plain integers: a sign, a leading zero, a decimal point.
  EXPECT_EQ(label_names(examples_with_labels({"1", "-1"})), (Names{"-1", "1"}));
  EXPECT_EQ(label_names(examples_with_labels({"01", "1"})), (Names{"01", "1"}));
  EXPECT_EQ(label_names(examples_with_labels({"1.0", "0"})), (Names{"0", "1.0"}));
  EXPECT_EQ(label_names(examples_with_labels({"\xc3\xa9t\xc3\xa9", "z"})), (Names{"z", "\xc3\xa9t\xc3\xa9"}));
}

TEST(LabeledDataLabels, IdsRefuseUnknownLabelsAndDuplicateNames) {
  expect_error([] { label_ids(examples_with_labels({"a", "c"}), {"a", "b"}); },
               "example 1 has the label 'c', which is not a class ('a', 'b')");
  expect_error([] { label_ids(examples_with_labels({"a"}), {"a", "a"}); }, "names the class 'a' twice");
  EXPECT_TRUE(label_ids({}, {"a"}).empty());
}

TEST(LabeledDataLabels, ValuesParseFiniteNumbers) {
  EXPECT_EQ(label_values(examples_with_labels({"3.8", "5.000", "0", "-1", "+2e-1", "1E2"})),
            (std::vector<double>{3.8, 5.0, 0.0, -1.0, 0.2, 100.0}));
  expect_error([] { label_values(examples_with_labels({"1", "high"})); },
               "example 1 has the label 'high', which is not a finite number");
  expect_error([] { label_values(examples_with_labels({"nan"})); }, "example 0 has the label 'nan'");
  expect_error([] { label_values(examples_with_labels({"inf"})); }, "label 'inf', which is not a finite");
  expect_error([] { label_values(examples_with_labels({"1e999"})); }, "label '1e999'");
  expect_error([] { label_values(examples_with_labels({"3.8 "})); }, "label '3.8 '");
  expect_error([] { label_values(examples_with_labels({""})); }, "label ''");
  expect_error([] { label_values(examples_with_labels({"+-1"})); }, "label '+-1'");
}

}  // namespace
}  // namespace weft
