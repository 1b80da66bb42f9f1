#include "verify/witness_runner.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "estimator/graph/family.h"
#include "estimator/request/model_presets.h"
#include "rapidjson/document.h"
#include "rapidjson/stringbuffer.h"
#include "rapidjson/writer.h"

namespace memledger {
namespace {

bool IsFile(const std::string& path) { return access(path.c_str(), R_OK) == 0; }

// ShellQuoted is `s` in single quotes for /bin/sh.
std::string ShellQuoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// CaseJson is one line of witness.py --cases: the variant's step of `config`, on ranks
// under `parallel`'s DDP or FSDP2 where given (witness_ranks.py's keys).
std::string CaseJson(const ModelConfig& config, const std::string& hf_config,
                     const Variant& variant, const OptimizerSpec& optimizer,
                     const ParallelSpec* parallel = nullptr) {
  rapidjson::Document doc(rapidjson::kObjectType);
  auto& a = doc.GetAllocator();
  auto text = [&](const char* key, const std::string& value) {
    doc.AddMember(rapidjson::StringRef(key), rapidjson::Value(value.c_str(), a), a);
  };
  doc.AddMember("batch", config.batch, a);
  doc.AddMember("seq", config.seq, a);
  if (!FamilyOf(config.family).decoder) {  // the study: no transformers model
    doc.AddMember("study", true, a);
    doc.AddMember("layers", config.layers, a);
    doc.AddMember("width", config.width, a);
    doc.AddMember("heads", config.heads, a);
  } else {
    rapidjson::Document hf;
    hf.Parse(hf_config.c_str());
    doc.AddMember("config", rapidjson::Value(hf, a), a);
  }
  text("dtype", std::string(ModelDTypeName(config.dtype)));
  text("amp", std::string(AmpName(config.amp)));
  text("variant", variant.Name());
  text("checkpoint_impl", std::string(CheckpointImplName(config.checkpoint_impl)));
  if (config.freeze.any()) {  // witness.py's freeze(): the parts' names
    rapidjson::Value parts(rapidjson::kArrayType);
    for (absl::string_view part : absl::StrSplit(FreezeName(config.freeze), ',')) {
      parts.PushBack(rapidjson::Value(part.data(), static_cast<rapidjson::SizeType>(part.size()), a), a);
    }
    doc.AddMember("freeze", parts, a);
  }
  if (config.lora.enabled()) {  // witness.py's lora(): peft's LoraConfig
    rapidjson::Value lora(rapidjson::kObjectType);
    lora.AddMember("r", config.lora.rank, a);
    lora.AddMember("alpha", config.lora.alpha, a);
    lora.AddMember("dropout", config.lora.dropout, a);
    if (config.lora.targets == std::vector<std::string>{"all-linear"}) {
      lora.AddMember("targets", "all-linear", a);
    } else {
      rapidjson::Value targets(rapidjson::kArrayType);
      for (const std::string& target : config.lora.targets) {
        targets.PushBack(rapidjson::Value(target.c_str(), a), a);
      }
      lora.AddMember("targets", targets, a);
    }
    doc.AddMember("lora", lora, a);
  }
  text("policy", SavePolicyName(variant.policy));
  text("optimizer", std::string(OptimizerName(optimizer.kind)));
  text("optimizer_impl", std::string(OptimizerImplName(optimizer.impl)));
  doc.AddMember("momentum", optimizer.momentum, a);
  // memledger predicts ATen's own gemm, as its runtime runs it (runtime/threads.h).
  doc.AddMember("mkldnn", false, a);
  if (parallel != nullptr && parallel->fsdp.enabled) {
    const FsdpOptions& fsdp = parallel->fsdp;
    doc.AddMember("fsdp", true, a);
    const int64_t ranks = fsdp.PostForwardRanks(parallel->dp);
    rapidjson::Value reshard;  // null: fully_shard's default, None
    if (fsdp.reshard_after_forward_auto) {
      reshard.SetNull();
    } else if (ranks == parallel->dp || ranks == 1) {
      reshard.SetBool(ranks == parallel->dp);
    } else {
      reshard.SetInt64(ranks);
    }
    doc.AddMember("reshard_after_forward", reshard, a);
    if (fsdp.param_dtype.has_value()) {
      text("mp_param_dtype", std::string(ModelDTypeName(*fsdp.param_dtype)));
      text("mp_reduce_dtype",
           std::string(ModelDTypeName(fsdp.reduce_dtype.value_or(*fsdp.param_dtype))));
    }
  } else if (parallel != nullptr) {
    rapidjson::Value ddp(rapidjson::kObjectType);
    rapidjson::Value cap;  // null: torch's default
    if (parallel->ddp.bucket_cap_mb.has_value()) cap.SetDouble(*parallel->ddp.bucket_cap_mb);
    ddp.AddMember("bucket_cap_mb", cap, a);
    ddp.AddMember("gradient_as_bucket_view", parallel->ddp.gradient_as_bucket_view, a);
    doc.AddMember("ddp", ddp, a);
  }
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> writer(buffer);
  doc.Accept(writer);
  return buffer.GetString();
}

}  // namespace

absl::StatusOr<WitnessCommand> FindWitness(const std::string& python, const std::string& argv0) {
  WitnessCommand command;
  if (!python.empty()) {
    command.python = python;
  } else {
    const char* interpreter = std::getenv("MEMLEDGER_REFERENCE_PYTHON");
    const char* stack = std::getenv("MEMLEDGER_TORCH_DIR");
    if (interpreter == nullptr || stack == nullptr) {
      return absl::FailedPreconditionError(
          "--witness=transformers needs the reference stack: run verify through ./bazelw "
          "(MEMLEDGER_REFERENCE_PYTHON and MEMLEDGER_TORCH_DIR are not set), or give "
          "--witness_python");
    }
    command.python = interpreter;
    command.python_path = stack;
  }
  for (const std::string& candidate :
       {std::string(std::getenv("BUILD_WORKSPACE_DIRECTORY") != nullptr
                        ? std::getenv("BUILD_WORKSPACE_DIRECTORY")
                        : "") +
            "/verify/witness.py",
        argv0 + ".runfiles/memledger/verify/witness.py", std::string("verify/witness.py")}) {
    if (IsFile(candidate)) {
      command.script = candidate;
      return command;
    }
  }
  return absl::FailedPreconditionError(
      "--witness=transformers: verify/witness.py not found (run verify with ./bazelw run)");
}

namespace {

// WitnessCases: a case per variant (CaseJson), or the refusal of what the real stack
// cannot run.
absl::StatusOr<std::string> WitnessCases(const ModelConfig& config,
                                         const std::vector<Variant>& variants,
                                         const OptimizerSpec& optimizer,
                                         const ParallelSpec* parallel) {
  if (optimizer.master_weights) {
    return absl::InvalidArgumentError(
        "--witness=transformers: torch.optim has no master weights (drop --master_weights)");
  }
  std::string hf_config;
  if (FamilyOf(config.family).decoder) {
    absl::StatusOr<std::string> json = HfConfigJson(config);
    if (!json.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--witness=transformers: ", json.status().message()));
    }
    hf_config = *json;
  }
  std::string cases;
  for (const Variant& variant : variants) {
    if (variant.kind == VariantKind::kPlan || variant.kind == VariantKind::kCoreAttention) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--witness=transformers: the real stack has no ", variant.Name(), " variant"));
    }
    cases += CaseJson(config, hf_config, variant, optimizer, parallel) + "\n";
  }
  return cases;
}

// RunScript runs a witness script (`script`, with `arguments`) on `cases` and returns its
// output's lines; Internal with the script's last error line when it fails.
absl::StatusOr<std::vector<std::string>> RunScript(const WitnessCommand& witness,
                                                   const std::string& script,
                                                   const std::string& arguments,
                                                   const std::string& cases) {
  char dir_template[] = "/tmp/memledger-witness-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("witness: no temp dir");
  const std::string dir = dir_template;
  const std::string cases_path = dir + "/cases.jsonl", errors_path = dir + "/stderr.txt";
  std::ofstream(cases_path) << cases;
  std::string command =
      (witness.python_path.empty() ? "" : "PYTHONPATH=" + ShellQuoted(witness.python_path) + " ") +
      ShellQuoted(witness.python) + " " + ShellQuoted(script) + arguments + " --cases=" +
      ShellQuoted(cases_path) + " 2>" + ShellQuoted(errors_path);
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("witness: could not start the reference Python");
  std::string output;
  char chunk[4096];
  while (size_t n = fread(chunk, 1, sizeof(chunk), pipe)) output.append(chunk, n);
  const int status = pclose(pipe);
  std::stringstream errors;
  errors << std::ifstream(errors_path).rdbuf();
  std::remove(cases_path.c_str());
  std::remove(errors_path.c_str());
  rmdir(dir.c_str());
  if (status != 0) {
    std::string last;
    for (absl::string_view line : absl::StrSplit(errors.str(), '\n', absl::SkipWhitespace())) {
      last = std::string(line);
    }
    return absl::InternalError(absl::StrCat("witness failed (exit ", WEXITSTATUS(status),
                                            "): ", last));
  }
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipWhitespace())) {
    lines.emplace_back(line);
  }
  return lines;
}

}  // namespace

absl::StatusOr<WitnessBuckets> RunWitness(const WitnessCommand& witness,
                                          const ModelConfig& config,
                                          const std::vector<Variant>& variants,
                                          const OptimizerSpec& optimizer) {
  absl::StatusOr<std::string> cases = WitnessCases(config, variants, optimizer, nullptr);
  if (!cases.ok()) return cases.status();
  absl::StatusOr<std::vector<std::string>> lines =
      RunScript(witness, witness.script, "", *cases);
  if (!lines.ok()) return lines.status();
  WitnessBuckets buckets;
  size_t index = 0;
  for (const std::string& line : *lines) {
    rapidjson::Document doc;
    doc.Parse(line.data(), line.size());
    if (doc.HasParseError() || !doc.IsObject() || index >= variants.size()) {
      return absl::InternalError(absl::StrCat("witness: unexpected output: ", line));
    }
    const std::string v = variants[index++].Name();
    buckets["param_bytes"] = doc["param_bytes"].GetInt64();
    buckets["grad_bytes"] = doc["grad_bytes"].GetInt64();
    buckets["buffer_bytes"] = doc["buffer_bytes"].GetInt64();
    buckets["optimizer_state_bytes"] = doc["optimizer_state_bytes"].GetInt64();
    buckets["saved_bytes." + v] = doc["saved_bytes"].GetInt64();
    buckets["held_after_forward_bytes." + v] = doc["held_after_forward"].GetInt64();
    buckets["peak_bytes." + v] = doc["peak_bytes"].GetInt64();
  }
  if (index != variants.size()) {
    return absl::InternalError(absl::StrCat("witness: ", index, " results for ",
                                            variants.size(), " variants"));
  }
  return buckets;
}

absl::StatusOr<std::vector<WitnessBuckets>> RunRanksWitness(const WitnessCommand& witness,
                                                            const ModelConfig& config,
                                                            const ParallelSpec& parallel,
                                                            const std::vector<Variant>& variants,
                                                            const OptimizerSpec& optimizer) {
  // witness_ranks.py runs transformers' model whole on each rank, under torch's DDP or
  // FSDP2.
  if (config.shard.tp > 1 || parallel.pp > 1 || parallel.zero > 0 || config.shard.ep > 1 ||
      parallel.micro_batches > 1 || parallel.dp < 2) {
    return absl::InvalidArgumentError(
        "--witness=transformers on ranks runs torch's DDP and FSDP2: --dp without --tp, "
        "--pp, --zero, --ep or --micro_batches");
  }
  if (!FamilyOf(config.family).decoder) {
    return absl::InvalidArgumentError(
        "--witness=transformers on ranks runs transformers' models, not the study's blocks");
  }
  absl::StatusOr<std::string> cases = WitnessCases(config, variants, optimizer, &parallel);
  if (!cases.ok()) return cases.status();
  const std::string script =
      witness.script.substr(0, witness.script.rfind('/') + 1) + "witness_ranks.py";
  absl::StatusOr<std::vector<std::string>> lines = RunScript(
      witness, script, absl::StrCat(" --ep=1 --dp=", parallel.dp), *cases);
  if (!lines.ok()) return lines.status();
  if (lines->size() != variants.size()) {
    return absl::InternalError(absl::StrCat("witness: ", lines->size(), " results for ",
                                            variants.size(), " variants"));
  }
  std::vector<WitnessBuckets> ranks(static_cast<size_t>(parallel.dp));
  for (size_t v = 0; v < variants.size(); ++v) {
    rapidjson::Document doc;
    doc.Parse((*lines)[v].c_str());
    if (doc.HasParseError() || !doc.IsObject() || !doc.HasMember("ranks") ||
        !doc["ranks"].IsArray() || doc["ranks"].Size() != ranks.size()) {
      return absl::InternalError(absl::StrCat("witness: unexpected output: ", (*lines)[v]));
    }
    for (size_t r = 0; r < ranks.size(); ++r) {
      const rapidjson::Value& m = doc["ranks"][static_cast<rapidjson::SizeType>(r)];
      WitnessBuckets& buckets = ranks[r];
      buckets["param_bytes"] = m["param_bytes"].GetInt64();
      buckets["grad_bytes"] = m["grad_bytes"].GetInt64();
      buckets["optimizer_state_bytes"] = m["optimizer_state_bytes"].GetInt64();
      buckets["communication_bytes"] =
          m.HasMember("reducer_bytes") ? m["reducer_bytes"].GetInt64() : 0;
      buckets["peak_bytes." + variants[v].Name()] = m["peak_bytes"].GetInt64();
    }
  }
  return ranks;
}

}  // namespace memledger
