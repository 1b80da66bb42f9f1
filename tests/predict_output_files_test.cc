// predict's output files as a user meets them: --json_out, --timeline_svg and
// --snapshot_out written whole or not at all, only over regular files, never over another
// output or an input, with the mode a shell would give them; output that cannot be
// written (a closed pipe) is an error (predict_cli_test has the rest of the command line).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "rapidjson/document.h"
#include "tests/subprocess.h"

namespace {

using memledger::testing::CommandResult;

CommandResult Predict(const std::string& args) {
  return memledger::testing::RunCommand("estimator/predict " + args);
}

TEST(PredictOutputFilesTest, JsonOutWritesTheSameJson) {
  const std::string path = std::string(getenv("TEST_TMPDIR")) + "/prediction.json";
  CommandResult r = Predict("--json_out=" + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream file(path);
  std::stringstream contents;
  contents << file.rdbuf();
  EXPECT_EQ(contents.str(), r.output);
  // A directory that does not exist: bad input, exit 2, nothing written.
  CommandResult bad = Predict("--json_out=/nonexistent-dir/p.json");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--json_out=/nonexistent-dir/p.json: cannot create a temporary "
                            "file beside it"),
            std::string::npos)
      << bad.output;
}

// FileKind: what `path` is, without following a link ("regular", "fifo", "symlink", ...).
std::string FileKind(const std::string& path) {
  namespace fs = std::filesystem;
  switch (fs::symlink_status(path).type()) {
    case fs::file_type::regular: return "regular";
    case fs::file_type::fifo: return "fifo";
    case fs::file_type::symlink: return "symlink";
    case fs::file_type::character: return "character";
    case fs::file_type::not_found: return "none";
    default: return "other";
  }
}

std::string Contents(const std::string& path) {
  std::ifstream file(path);
  std::stringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

TEST(PredictOutputFilesTest, OutputsReplaceOnlyRegularFilesAllOrNone) {
  namespace fs = std::filesystem;
  const std::string dir = std::string(getenv("TEST_TMPDIR")) + "/outputs";
  fs::remove_all(dir);
  fs::create_directories(dir);
  // A FIFO is refused and stays a FIFO (nothing opens it: the run does not hang).
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  CommandResult r = Predict("--model=tiny-llama --json_out=" + fifo);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--json_out=" + fifo + ": is a FIFO, not a regular file"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(FileKind(fifo), "fifo");
  // A character device: /dev/null, refused before anything touches it.
  r = Predict("--model=tiny-llama --json_out=/dev/null");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("is a character device, not a regular file"), std::string::npos)
      << r.output;
  EXPECT_EQ(FileKind("/dev/null"), "character");
  // A symbolic link is written through: the link stays, its target gets the JSON.
  const std::string target = dir + "/target.json", link = dir + "/link.json";
  std::ofstream(target) << "old";
  fs::create_symlink(target, link);
  r = memledger::testing::RunCommand("estimator/predict --model=tiny-llama --json_out=" + link,
                                     /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(FileKind(link), "symlink");
  EXPECT_EQ(Contents(target), r.output);
  // A dangling link is refused; nothing appears where it points.
  const std::string dangling = dir + "/dangling.json";
  fs::create_symlink(dir + "/nowhere.json", dangling);
  r = Predict("--model=tiny-llama --json_out=" + dangling);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("a symbolic link whose target cannot be resolved"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir + "/nowhere.json"));
  // One bad output path: none of the run's files is written.
  const std::string svg = dir + "/ok.svg";
  r = Predict("--model=tiny-llama --timeline_svg=" + svg + " --json_out=" + dir +
              "/missing/x.json");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_FALSE(fs::exists(svg));
  // Standard output on a full disk: exit 2, and --json_out is not written either.
  if (fs::exists("/dev/full")) {
    const std::string json = dir + "/full.json";
    r = memledger::testing::RunCommand(
        "estimator/predict --model=tiny-llama --json_out=" + json + " 2>&1 >/dev/full",
        /*merge_stderr=*/false);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("cannot write to standard output: No space left on device"),
              std::string::npos)
        << r.output;
    EXPECT_FALSE(fs::exists(json));
  }
  // A full disk, as a file-size limit gives it (ulimit -f 1: 1 KiB): the write fails
  // with EFBIG instead of SIGXFSZ killing the run; exit 2, nothing written.
  const std::string limited = dir + "/limited.json";
  r = memledger::testing::RunCommand(
      "(ulimit -f 1 && estimator/predict --model=tiny-llama --json_out=" + limited +
      " > /dev/null)");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--json_out=" + limited + ": cannot write it: File too large"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(limited));
  // A name of 255 bytes, the longest ext4 and tmpfs take: written (the temporary file's
  // name is cut to fit .tmp.XXXXXX; it was refused). One byte more is refused, exit 2.
  const std::string long_name = dir + "/" + std::string(250, 'n') + ".json";
  r = memledger::testing::RunCommand("estimator/predict --model=tiny-llama --json_out=" +
                                         long_name,
                                     /*merge_stderr=*/false);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(Contents(long_name), r.output);
  const std::string too_long = dir + "/" + std::string(251, 'n') + ".json";
  r = Predict("--model=tiny-llama --json_out=" + too_long);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("File name too long"), std::string::npos) << r.output;
  std::error_code no_such_file;  // ENAMETOOLONG: it cannot even be looked up
  EXPECT_FALSE(fs::exists(too_long, no_such_file));
  // A read-only directory (root writes anyway: only checked for another user).
  if (geteuid() != 0) {
    const std::string read_only = dir + "/read_only";
    fs::create_directories(read_only);
    fs::permissions(read_only, fs::perms::owner_read | fs::perms::owner_exec);
    r = Predict("--model=tiny-llama --json_out=" + read_only + "/x.json");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("Permission denied"), std::string::npos) << r.output;
    fs::permissions(read_only, fs::perms::owner_all);
  }
  // Nothing the runs staged is left beside the targets.
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << entry.path();
  }
}

TEST(PredictOutputFilesTest, TimelineSvgWritesTheChartOrNothing) {
  const std::string path = std::string(getenv("TEST_TMPDIR")) + "/timeline.svg";
  CommandResult r = Predict("--variants=none,full --timeline_svg=" + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\"peak_bytes\""), std::string::npos) << r.output;
  std::ifstream file(path);
  std::stringstream contents;
  contents << file.rdbuf();
  EXPECT_EQ(contents.str().rfind("<svg ", 0), 0u);
  EXPECT_NE(contents.str().find(">full</text>"), std::string::npos);
  // Megatron's core-attention recompute is not simulated yet: exit 3 with the reason, no
  // file.
  const std::string math = std::string(getenv("TEST_TMPDIR")) + "/megatron.svg";
  CommandResult unmodelled = Predict(
      "--model=megatron-gpt --layers=2 --width=64 --heads=4 --seq=16 --batch=1 --vocab=128 "
      "--attention=math --variants=core_attention --timeline_svg=" + math);
  EXPECT_EQ(unmodelled.exit_code, 3) << unmodelled.output;
  EXPECT_NE(unmodelled.output.find("core_attention"), std::string::npos) << unmodelled.output;
  EXPECT_FALSE(std::ifstream(math).good());
  // With --dp or --pp: the most loaded rank's step, its schedule and reduction; a
  // tensor-parallel rank's is not simulated (exit 3, no file).
  const std::string rank = std::string(getenv("TEST_TMPDIR")) + "/rank.svg";
  CommandResult ranks = Predict(
      "--model=tiny-llama --batch=2 --seq=8 --pp=2 --micro_batches=2 --dp=2 --zero=1 "
      "--variants=none,full --timeline_svg=" + rank);
  ASSERT_EQ(ranks.exit_code, 0) << ranks.output;
  std::ifstream rank_file(rank);
  std::stringstream rank_svg;
  rank_svg << rank_file.rdbuf();
  EXPECT_EQ(rank_svg.str().rfind("<svg ", 0), 0u);
  // The drawn rank is the JSON's first, the most loaded by its peak.
  rapidjson::Document rank_json;
  rank_json.Parse(ranks.output.c_str());
  ASSERT_FALSE(rank_json.HasParseError()) << ranks.output;
  EXPECT_NE(rank_svg.str().find("the most loaded rank's step, predicted (stage " +
                                std::to_string(rank_json["ranks"][0]["stage"].GetInt64())),
            std::string::npos);
  const std::string zero3 = std::string(getenv("TEST_TMPDIR")) + "/zero3.svg";
  CommandResult sharded_parameters =
      Predict("--model=tiny-gpt2 --dp=2 --zero=3 --pp=2 --micro_batches=2 --timeline_svg=" +
              zero3);
  EXPECT_EQ(sharded_parameters.exit_code, 3) << sharded_parameters.output;
  EXPECT_NE(sharded_parameters.output.find("tied embedding over pipeline stages"),
            std::string::npos)
      << sharded_parameters.output;
  EXPECT_FALSE(std::ifstream(zero3).good());
  // One message per option, the same from the C ABI and Python (api_test,
  // python_module_test).
  CommandResult threads = Predict("--cpu_threads=0");
  EXPECT_EQ(threads.exit_code, 2) << threads.output;
  EXPECT_NE(threads.output.find("error: --cpu_threads must be between 1 and 1024, got 0"),
            std::string::npos)
      << threads.output;
  CommandResult budget = Predict("--sweep=batch:1..2 --budget_gib=-1");
  EXPECT_EQ(budget.exit_code, 2) << budget.output;
  EXPECT_NE(budget.output.find("error: --budget_gib must be 0 (no budget) or a positive "
                               "number of GiB below 2^33, got -1"),
            std::string::npos)
      << budget.output;
}

// An output that is another output, or a file the run reads, is refused before the run
// (it was written twice, the last rename winning, or replaced the config it read).
TEST(PredictOutputFilesTest, AnOutputThatIsAnotherOutputOrAnInputIsRefused) {
  namespace fs = std::filesystem;
  const std::string dir = std::string(getenv("TEST_TMPDIR")) + "/same_file";
  fs::remove_all(dir);
  fs::create_directories(dir + "/real");
  fs::create_directory_symlink(dir + "/real", dir + "/linked");
  const std::string config = dir + "/config.json";
  fs::copy_file("tests/testdata/olmo3-window8.config.json", config);
  const std::string config_text = Contents(config);
  const std::string existing = dir + "/existing.json";
  std::ofstream(existing) << "old";
  fs::create_symlink(existing, dir + "/existing_link.json");
  for (const auto& [args, message] : std::initializer_list<std::pair<std::string, std::string>>{
           {"--json_out=" + dir + "/a.json --timeline_svg=" + dir + "/a.json",
            "--timeline_svg=" + dir + "/a.json: is the same file as --json_out=" + dir +
                "/a.json"},
           // Another spelling of a file not there yet: the directory's real path decides.
           {"--json_out=" + dir + "/a.json --timeline_svg=" + dir + "/./a.json",
            "--timeline_svg=" + dir + "/./a.json: is the same file as --json_out="},
           {"--json_out=" + dir + "/real/b.json --timeline_svg=" + dir + "/linked/b.json",
            "--timeline_svg=" + dir + "/linked/b.json: is the same file as --json_out=" + dir +
                "/real/b.json"},
           // A file that is there, through a link: one (device, inode).
           {"--json_out=" + existing + " --timeline_svg=" + dir + "/existing_link.json",
            "--timeline_svg=" + dir + "/existing_link.json: is the same file as --json_out="},
           {"--json_out=" + existing + " --snapshot_out=" + existing + " --variants=none",
            "--snapshot_out=" + existing + ": is the same file as --json_out=" + existing},
           // The config.json --model reads.
           {"--model=" + config + " --json_out=" + config,
            "--json_out=" + config + ": is the same file as --model=" + config +
                ", which the run reads"},
           {"--model=" + config + " --config_keys --json_out=" + dir + "/../same_file/config.json",
            "is the same file as --model=" + config},
           // --routing's and --plan's files.
           {"--model=tiny-qwen3-moe --experts_impl=eager --routing=" + existing +
                " --json_out=" + existing,
            "--json_out=" + existing + ": is the same file as --routing=" + existing},
           {"--plan=" + existing + " --timeline_svg=" + existing,
            "--timeline_svg=" + existing + ": is the same file as --plan=" + existing},
       }) {
    CommandResult r = Predict(args.rfind("--model", 0) == 0 ? args : "--model=tiny-llama " + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << args << r.output;
  }
  EXPECT_EQ(Contents(config), config_text);
  EXPECT_EQ(Contents(existing), "old");
  EXPECT_FALSE(fs::exists(dir + "/a.json"));
  EXPECT_FALSE(fs::exists(dir + "/real/b.json"));
  // Two different files are fine, a link's and another's too.
  CommandResult r = Predict("--model=tiny-llama --json_out=" + dir + "/a.json --timeline_svg=" +
                            dir + "/linked/a.svg");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/real/a.svg"));
}

// FileMode: the permission bits of `path`.
unsigned FileMode(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? st.st_mode & 07777 : 0;
}

// An output keeps what a shell's `>` keeps: an existing file's mode (a private 0600 file
// stayed private only until the rename made it 0644), and 0666 less the umask for a new one.
TEST(PredictOutputFilesTest, OutputsKeepTheModeAShellWouldGiveThem) {
  namespace fs = std::filesystem;
  const std::string dir = std::string(getenv("TEST_TMPDIR")) + "/modes";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string secret = dir + "/secret.json";
  std::ofstream(secret) << "old";
  ASSERT_EQ(chmod(secret.c_str(), 0600), 0);
  CommandResult r = Predict("--model=tiny-llama --json_out=" + secret);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(Contents(secret), "old");
  EXPECT_EQ(FileMode(secret), 0600u);
  for (const auto& [umask, mode] : {std::pair<const char*, unsigned>{"027", 0640},
                                    {"022", 0644}, {"077", 0600}, {"002", 0664}}) {
    const std::string path = dir + "/new_" + umask + ".json";
    r = memledger::testing::RunCommand(std::string("umask ") + umask +
                                       " && estimator/predict --model=tiny-llama --json_out=" +
                                       path + " > /dev/null");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(FileMode(path), mode) << "umask " << umask;
  }
}

// A reader that closed the pipe (`predict | head -c 1` after head exits): the write
// fails (EPIPE) instead of SIGPIPE killing the run with exit 141 between staging its
// files and renaming them, which left *.tmp.* beside them. Exit 2, one line, no file.
TEST(PredictOutputFilesTest, AClosedPipeIsAnErrorAndLeavesNoFile) {
  namespace fs = std::filesystem;
  const std::string dir = std::string(getenv("TEST_TMPDIR")) + "/closed_pipe";
  fs::remove_all(dir);
  fs::create_directories(dir);
  CommandResult r = memledger::testing::RunWithClosedStdout(
      "estimator/predict --model=tiny-llama --json_out=" + dir + "/a.json" +
          " --timeline_svg=" + dir + "/a.svg",
      dir);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output, "error: cannot write to standard output: Broken pipe\n");
  EXPECT_FALSE(fs::exists(dir + "/a.json"));
  EXPECT_FALSE(fs::exists(dir + "/a.svg"));
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << entry.path();
  }
}

// --help and --version on a full disk exited 0 with nothing written.
TEST(PredictOutputFilesTest, HelpAndVersionThatCannotBeWrittenAreErrors) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  for (const char* flag : {"--help", "--version", "--helpfull"}) {
    CommandResult r = memledger::testing::RunCommand(
        std::string("estimator/predict ") + flag + " 2>&1 >/dev/full", /*merge_stderr=*/false);
    EXPECT_EQ(r.exit_code, 2) << flag << ": " << r.output;
    EXPECT_EQ(r.output.rfind("error: cannot write to standard output", 0), 0u)
        << flag << ": " << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << flag << r.output;
  }
  for (const char* flag : {"--help", "--version"}) {
    CommandResult r = memledger::testing::RunCommand(
        std::string("estimator/predict ") + flag + " 2>&1 >/dev/full", /*merge_stderr=*/false);
    EXPECT_EQ(r.output, "error: cannot write to standard output: No space left on device\n")
        << flag;
  }
  CommandResult version = Predict("--version");
  EXPECT_EQ(version.exit_code, 0) << version.output;
}

}  // namespace
