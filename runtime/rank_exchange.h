// What the rank processes and the verifying parent share: the whole batch's model
// (every rank draws the single process's parameters and data), the variants run, and
// the result files through which ranks report.
#ifndef RUNTIME_RANK_EXCHANGE_H_
#define RUNTIME_RANK_EXCHANGE_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "estimator/spec/config.h"
#include "estimator/request/parallel_spec.h"

namespace memledger::runtime::distributed_internal {

// WholeBatch: the whole batch every rank draws, dp x micro_batches x batch sequences, so
// that the parameters (drawn first) and the data are the single-process reference's.
ModelConfig WholeBatch(const ModelConfig& config, const ParallelSpec& parallel);
// SingleProcessConfig: the single-process model of the whole batch, whose parameters
// every tensor-parallel shard is cut from.
ModelConfig SingleProcessConfig(const ModelConfig& config, const ParallelSpec& parallel);
// WithReference: `none` (the gradient reference) first, then the other variants.
std::vector<Variant> WithReference(const std::vector<Variant>& variants);

// RankFile is rank `rank`'s result file `what` in `dir`.
std::string RankFile(const std::string& dir, int64_t rank, absl::string_view what);

// Piece is a piece of a stage's flat buffer, as fp32 on disk.
struct Piece {
  int64_t offset = 0;
  int64_t length = 0;  // within the stage's n_params (padding excluded)
};
// WritePiece writes values[0, min(numel, n_params - offset)) as fp32 to `path`.
Piece WritePiece(const std::string& path, const at::Tensor& values, int64_t offset,
                 int64_t n_params);
// ReadPiece reads `length` fp32 values back.
at::Tensor ReadPiece(const std::string& path, int64_t length);

}  // namespace memledger::runtime::distributed_internal

#endif  // RUNTIME_RANK_EXCHANGE_H_
