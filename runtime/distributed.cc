#include "runtime/distributed.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "estimator/graph/family.h"
#include "runtime/family.h"
#include "runtime/model.h"
#include "runtime/optimizer_runner.h"
#include "runtime/rank.h"
#include "runtime/rank_exchange.h"
#include "runtime/zero_units.h"
#include "runtime/threads.h"

extern char** environ;

namespace memledger::runtime {
namespace {

using distributed_internal::Flat;
using distributed_internal::Piece;
using distributed_internal::ReadPiece;
using distributed_internal::RankFile;
using distributed_internal::SingleProcessConfig;
using distributed_internal::WithReference;

absl::Status ValidateDistributed(const ModelConfig& config, const ParallelSpec& parallel,
                                 const DistributedRequest& request) {
  if (absl::Status s =
          ValidateRun(config, request.attention, request.variants, request.optimizer).status();
      !s.ok()) {
    return s;
  }
  if (absl::Status s = RuntimeFamilyModelled(config); !s.ok()) return s;
  if (config.moe.Sparse() && config.moe.impl == ExpertsImpl::kEager) {
    // Each rank routes its own tokens, and the prediction takes one routing per layer.
    return absl::UnimplementedError(
        "the rank runtime runs the grouped_mm experts only: verify --experts_impl=eager "
        "in one process, or predict the ranks");
  }
  if (absl::Status s = ValidateParallel(config, parallel); !s.ok()) return s;
  if (parallel.fsdp.enabled) {
    // The ranks' FSDP2 (runtime/fsdp2_units.h) runs in the parameters' dtype; a
    // MixedPrecisionPolicy is measured against torch's own (verify
    // --witness=transformers, tests/fsdp2_witness_test.py).
    const FsdpOptions& fsdp = parallel.fsdp;
    if (fsdp.param_dtype.has_value() || fsdp.reduce_dtype.has_value()) {
      return absl::UnimplementedError(
          "the rank runtime runs FSDP2 without a MixedPrecisionPolicy: verify "
          "--mp_param_dtype with --witness=transformers measures torch's own");
    }
  }
  for (const Variant& v : request.variants) {
    if (v.kind == VariantKind::kCoreAttention) {
      return absl::UnimplementedError("the runtime has no core_attention recompute yet");
    }
  }
  if (!config.megatron && config.dropout.Any()) {
    // Each rank would draw its own masks from its own generator, so its gradients would
    // not compare with the single process's (megatron-gpt's dropout is rank-invariant).
    return absl::InvalidArgumentError(
        "the rank runtime needs GPT-2's dropouts at 0 (resid_pdrop, embd_pdrop, "
        "attn_pdrop in the config.json; predict answers with them)");
  }
  if (request.timeout_s < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank_timeout_s must be >= 1, got ", request.timeout_s));
  }
  if (!request.fault.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(request.fault, ':');
    int64_t rank = -1;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &rank) || rank < 0 ||
        rank >= WorldSize(parallel) ||
        (parts[1] != "exit" && parts[1] != "hang")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rank_fault must be RANK:exit or RANK:hang with RANK below the world size, got '",
          request.fault, "'"));
    }
  }
  if (WorldSize(parallel) > kMaxRanks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "verify runs at most ", kMaxRanks, " rank processes on this machine, --tp x --dp x --pp ",
        "asks for ", WorldSize(parallel), " (predict answers for any size)"));
  }
  return absl::OkStatus();
}

// ---- The parent ------------------------------------------------------------------------

std::string LastLine(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last.empty() ? "(no output)" : last;
}

// RankProcesses owns the rank processes: killed and reaped if still running when it
// goes out of scope.
class RankProcesses {
 public:
  // kSettle: how long after a rank's failure the others may take to fail with it.
  static constexpr std::chrono::seconds kSettle{1};

  ~RankProcesses() { KillAll(); }

  absl::Status Start(const std::vector<std::string>& argv, const std::string& log) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid = 0;
    const int error = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (error != 0) {
      return absl::InternalError(absl::StrCat("cannot start a rank process: ", strerror(error)));
    }
    pids_.push_back(pid);
    return absl::OkStatus();
  }

  // Wait returns when every rank exited 0, or the first rank that failed, or the
  // ranks still running at the deadline (then killed).
  absl::Status Wait(std::chrono::seconds timeout, const std::string& dir) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<bool> done(pids_.size(), false);
    size_t finished = 0;
    // Failed ranks, first seen first. A rank that dies takes the ranks waiting on it in
    // collectives down with it (Gloo sees the connection close): the others that fail
    // within a second are reported too, after it.
    std::vector<std::string> failures;
    std::optional<std::chrono::steady_clock::time_point> first_failure;
    while (finished < pids_.size()) {
      for (size_t r = 0; r < pids_.size(); ++r) {
        if (done[r]) continue;
        int status = 0;
        if (waitpid(pids_[r], &status, WNOHANG) != pids_[r]) continue;
        done[r] = true;
        pids_[r] = 0;
        ++finished;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
          const std::string how = WIFEXITED(status)
                                      ? absl::StrCat("exited with status ", WEXITSTATUS(status))
                                      : absl::StrCat("was killed by signal ", WTERMSIG(status));
          failures.push_back(
              absl::StrCat("rank ", r, " ", how, ": ", LastLine(RankFile(dir, r, "log"))));
          if (!first_failure) first_failure = std::chrono::steady_clock::now();
        }
      }
      const auto now = std::chrono::steady_clock::now();
      if (first_failure && (finished == pids_.size() || now - *first_failure > kSettle)) {
        return absl::InternalError(absl::StrCat(failures.size(), " of ", pids_.size(),
                                                " ranks failed: ", absl::StrJoin(failures, "; ")));
      }
      if (finished == pids_.size()) break;
      if (now > deadline) {
        // Each unfinished rank with the last thing it said: a rank waiting in a
        // collective for a hung one hangs too, and the logs tell them apart.
        std::vector<std::string> running;
        for (size_t r = 0; r < pids_.size(); ++r) {
          if (!done[r]) {
            running.push_back(absl::StrCat(r, " (\"", LastLine(RankFile(dir, r, "log")), "\")"));
          }
        }
        return absl::DeadlineExceededError(
            absl::StrCat("killed after ", timeout.count(), " s (--rank_timeout_s): rank",
                         running.size() == 1 ? " " : "s ", absl::StrJoin(running, ", "), " of ",
                         pids_.size(), " did not finish"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return absl::OkStatus();
  }

 private:
  void KillAll() {
    for (pid_t pid : pids_) {
      if (pid <= 0) continue;
      kill(pid, SIGKILL);
      int status = 0;
      waitpid(pid, &status, 0);
    }
    pids_.clear();
  }

  std::vector<pid_t> pids_;
};

// TempDir is a private directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    if (base == nullptr) base = std::getenv("TMPDIR");
    std::string pattern = absl::StrCat(base != nullptr ? base : "/tmp", "/memledger-ranks-XXXXXX");
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// RankResult is a rank's result file, parsed.
struct RankResult {
  RankMeasurement measurement;
  std::vector<Piece> grads;  // per variant, `none` first
  Piece params;
  std::vector<std::string> owned;
};

absl::StatusOr<RankResult> ReadRankResult(const std::string& path, size_t variants) {
  std::ifstream in(path);
  if (!in) return absl::InternalError(absl::StrCat("a rank wrote no result: ", path));
  RankResult result;
  RankMeasurement& m = result.measurement;
  std::map<std::string, int64_t*> scalars = {{"n_params", &m.n_params},
                                             {"param_bytes", &m.param_bytes},
                                             {"grad_bytes", &m.grad_bytes},
                                             {"optimizer_state_bytes", &m.optimizer_state_bytes},
                                             {"adamw_state_bytes", &m.adamw_state_bytes}};
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    bool ok = f.size() >= 2;
    if (ok && f[0] == "variant" && f.size() == 6) {
      RankVariantMeasurement v;
      Piece piece;
      ok = absl::SimpleAtoi(f[2], &v.held_bytes) && absl::SimpleAtoi(f[3], &v.in_flight) &&
           absl::SimpleAtoi(f[4], &piece.offset) && absl::SimpleAtoi(f[5], &piece.length);
      m.variants.push_back(v);
      result.grads.push_back(piece);
    } else if (ok && f[0] == "peak" && f.size() >= 4) {
      // peak V BYTES PHASE OP..., the op's name may have spaces.
      size_t v = 0;
      int64_t bytes = 0;
      ok = absl::SimpleAtoi(f[1], &v) && v < m.variants.size() && absl::SimpleAtoi(f[2], &bytes);
      if (ok) {
        m.variants[v].peak_bytes = bytes;
        m.variants[v].peak_phase = f[3];
        m.variants[v].peak_op = absl::StrJoin(f.begin() + 4, f.end(), " ");
      }
    } else if (ok && f[0] == "unit_grad_diff" && f.size() == 3) {
      size_t v = 0;
      ok = absl::SimpleAtoi(f[1], &v) && v < m.variants.size() &&
           absl::SimpleAtod(f[2], &m.variants[v].unit_grad_diff);
    } else if (ok && f[0] == "params" && f.size() == 3) {
      ok = absl::SimpleAtoi(f[1], &result.params.offset) &&
           absl::SimpleAtoi(f[2], &result.params.length);
    } else if (ok && f[0] == "owned") {
      result.owned.push_back(f[1]);
    } else if (ok && scalars.count(f[0]) == 1) {
      ok = absl::SimpleAtoi(f[1], scalars[f[0]]);
    } else {
      ok = false;
    }
    if (!ok) return absl::InternalError(absl::StrCat("bad line in ", path, ": ", line));
  }
  if (m.variants.size() != variants) {
    return absl::InternalError(
        absl::StrCat(path, " has ", m.variants.size(), " variants, expected ", variants));
  }
  return result;
}

// MaxDiff is max |a - b| (0 where they are equal, infinities too); NaN if either has a
// NaN the other lacks. With `nan_equal`, NaN in both at one position counts as equal (a
// pure fp16 AdamW step makes NaN and inf where g^2 underflows, sharded or not).
double MaxDiff(const at::Tensor& a, const at::Tensor& b, bool nan_equal = false) {
  if (a.numel() == 0) return 0;
  at::Tensor same = a == b;
  if (nan_equal) same = same | (a.isnan() & b.isnan());
  at::Tensor diff = (a - b).abs().masked_fill(same, 0);
  return diff.max().item<double>();
}

absl::StatusOr<DistributedMeasurement> MeasureOrThrow(const ModelConfig& config,
                                                      const ParallelSpec& parallel,
                                                      const DistributedRequest& request,
                                                      const std::vector<std::string>& command) {
  TempDir dir;
  if (dir.path().empty()) return absl::InternalError("cannot create a directory for the ranks");
  const int64_t world = WorldSize(parallel);
  {
    RankProcesses processes;
    for (int64_t r = 0; r < world; ++r) {
      std::vector<std::string> argv = command;
      argv.push_back(absl::StrCat(kRankWorkerFlag, dir.path(), ":", r));
      if (absl::Status s = processes.Start(argv, RankFile(dir.path(), r, "log")); !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = processes.Wait(std::chrono::seconds(request.timeout_s), dir.path());
        !s.ok()) {
      return s;
    }
  }

  // The single-process reference: the whole batch's gradients, and the parameters
  // before the step.
  ConfigureThreads();
  UseNativeKernels();
  ModelAndInput built = BuildModel(SingleProcessConfig(config, parallel), request.seed);
  ForwardWithVariant(*built.model, built.input, request.attention, Variant()).loss.backward();
  std::map<std::string, at::Tensor> initial_params, reference_grads;
  for (const auto& item : built.model->named_parameters()) {
    reference_grads[item.key()] = item.value().grad().to(at::kFloat);
    initial_params[item.key()] = item.value().detach();
  }

  const std::vector<Variant> variants = WithReference(request.variants);
  std::vector<RankResult> results;
  for (int64_t r = 0; r < world; ++r) {
    absl::StatusOr<RankResult> result =
        ReadRankResult(RankFile(dir.path(), r, "txt"), variants.size());
    if (!result.ok()) return result.status();
    for (const std::string& name : result->owned) {
      if (reference_grads.count(name) == 0) {
        return absl::InternalError(absl::StrCat("rank ", r, " owns an unknown parameter ", name));
      }
    }
    results.push_back(*std::move(result));
  }

  // Per stage, the unsharded step: the stage's parameters stepped on the gradients its
  // ranks reduced, gathered from their pieces. Each rank's updated parameters must match
  // its piece of it: ZeRO's sharded step and all-gather change nothing. (Against the
  // single process's own step instead, AdamW's first update, about lr x g / |g|, would
  // magnify rounding in the near-zero gradients.)
  // By (stage, tp rank): the ranks that hold the same parameters. The flat updated
  // parameters, fp32.
  std::map<std::pair<int64_t, int64_t>, at::Tensor> stepped;
  auto shard_of = [&](const RankPosition& p) { return std::make_pair(p.stage, p.tp_rank); };
  for (int64_t r = 0; r < world; ++r) {
    const auto stage = shard_of(PositionOf(r, parallel));
    const RankResult& result = results[r];
    const int64_t n = result.measurement.n_params;
    if (stepped.count(stage) == 0) stepped[stage] = at::zeros({n}, at::kFloat);
    // Reuse the slot for the gathered gradients until the stage's step below.
    const Piece& piece = result.grads[0];
    stepped[stage]
        .narrow(0, piece.offset, piece.length)
        .copy_(ReadPiece(RankFile(dir.path(), r, "grad0"), piece.length));
  }
  for (auto& [stage, flat] : stepped) {
    // dp rank 0 of them: rank = tp_rank + tp x dp x stage.
    const RankResult& any = results[stage.second + parallel.tp * parallel.dp * stage.first];
    std::vector<at::Tensor> params;
    int64_t offset = 0;
    for (const std::string& name : any.owned) {
      at::Tensor p = TakeShard(initial_params[name], ShardOf(config, name, stage.second))
                         .clone()
                         .requires_grad_(true);
      p.mutable_grad() = flat.narrow(0, offset, p.numel()).view(p.sizes()).to(p.scalar_type());
      offset += p.numel();
      params.push_back(p);
    }
    OptimizerRunner optimizer(request.optimizer, params);
    optimizer.Step();
    flat = Flat(params, 0).to(at::kFloat);
  }

  DistributedMeasurement measurement;
  measurement.parallel = parallel;
  for (int64_t r = 0; r < world; ++r) {
    RankResult& result = results[r];
    RankMeasurement& m = result.measurement;
    m.position = PositionOf(r, parallel);
    std::vector<at::Tensor> grads;
    for (const std::string& name : result.owned) {
      grads.push_back(TakeShard(reference_grads[name], ShardOf(config, name, m.position.tp_rank)));
    }
    const at::Tensor flat_grads = Flat(grads, 0);
    for (size_t v = 0; v < variants.size(); ++v) {
      const Piece& piece = result.grads[v];
      m.variants[v].variant = variants[v];
      m.variants[v].max_grad_diff =
          MaxDiff(ReadPiece(RankFile(dir.path(), r, absl::StrCat("grad", v)), piece.length),
                  flat_grads.narrow(0, piece.offset, piece.length));
    }
    m.max_param_diff =
        MaxDiff(ReadPiece(RankFile(dir.path(), r, "params"), result.params.length),
                stepped[shard_of(m.position)].narrow(0, result.params.offset, result.params.length),
                /*nan_equal=*/true);
    measurement.ranks.push_back(std::move(m));
  }
  return measurement;
}

}  // namespace

RankPosition PositionOf(int64_t rank, const ParallelSpec& parallel) {
  const int64_t outer = rank / parallel.tp;  // dp_rank + dp x stage
  return RankPosition{rank, rank % parallel.tp, outer % parallel.dp, outer / parallel.dp};
}

int64_t WorldSize(const ParallelSpec& parallel) {
  return parallel.tp * parallel.dp * parallel.pp;
}

absl::StatusOr<DistributedMeasurement> MeasureDistributed(const ModelConfig& config,
                                                          const ParallelSpec& parallel,
                                                          const DistributedRequest& request,
                                                          const std::vector<std::string>& command) {
  if (absl::Status s = ValidateDistributed(config, parallel, request); !s.ok()) return s;
  try {
    return MeasureOrThrow(config, parallel, request, command);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("runtime: ", e.what()));
  }
}

int RunRankWorker(const ModelConfig& config, const ParallelSpec& parallel,
                  const DistributedRequest& request, absl::string_view worker) {
  const size_t colon = worker.rfind(':');
  int64_t rank = -1;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(worker.substr(colon + 1), &rank) ||
      rank < 0 || rank >= WorldSize(parallel)) {
    std::cerr << "memledger rank: bad " << kRankWorkerFlag << worker << "\n";
    return 2;
  }
  // A rank dies with the verify that started it (killed, or interrupted by the user)
  // rather than wait in a collective for ranks that are gone.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (absl::Status s = ValidateDistributed(config, parallel, request); !s.ok()) {
    std::cerr << "memledger rank " << rank << ": " << s.message() << "\n";
    return 2;
  }
  try {
    distributed_internal::RunRank(config, parallel, request, std::string(worker.substr(0, colon)), rank);
  } catch (const c10::Error& e) {
    std::cerr << "memledger rank " << rank << ": LibTorch: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "memledger rank " << rank << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace memledger::runtime
