#include "runtime/rank_exchange.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace memledger::runtime::distributed_internal {

ModelConfig WholeBatch(const ModelConfig& config, const ParallelSpec& parallel) {
  ModelConfig whole = config;
  whole.batch = config.batch * parallel.dp * parallel.micro_batches;
  whole.use_cache = false;  // ranks keep no DynamicCache (estimator/predict/ranks.cc, PredictRanks)
  return whole;
}

ModelConfig SingleProcessConfig(const ModelConfig& config, const ParallelSpec& parallel) {
  ModelConfig whole = WholeBatch(config, parallel);
  whole.shard.tp = 1;
  return whole;
}

std::vector<Variant> WithReference(const std::vector<Variant>& variants) {
  std::vector<Variant> all = {Variant()};
  for (const Variant& v : variants) {
    if (v.kind != VariantKind::kNone) all.push_back(v);
  }
  return all;
}

std::string RankFile(const std::string& dir, int64_t rank, absl::string_view what) {
  return absl::StrCat(dir, "/rank", rank, ".", what);
}

Piece WritePiece(const std::string& path, const at::Tensor& values, int64_t offset,
                 int64_t n_params) {
  Piece piece{offset, std::max<int64_t>(0, std::min(values.numel(), n_params - offset))};
  at::Tensor fp32 = values.detach().narrow(0, 0, piece.length).to(at::kFloat).contiguous();
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(fp32.data_ptr()),
            static_cast<std::streamsize>(piece.length * sizeof(float)));
  TORCH_CHECK(out.good(), "cannot write ", path);
  return piece;
}

at::Tensor ReadPiece(const std::string& path, int64_t length) {
  at::Tensor values = at::empty({length}, at::kFloat);
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(values.data_ptr()),
          static_cast<std::streamsize>(length * sizeof(float)));
  TORCH_CHECK(in.good(), "cannot read ", length, " floats from ", path);
  return values;
}

}  // namespace memledger::runtime::distributed_internal
