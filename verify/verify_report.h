// Renders a VerifyReport: the study's JSON schema with measured values plus the exact
// prediction and per-bucket ratios, or a table that shows the same at a glance.
#ifndef VERIFY_VERIFY_REPORT_H_
#define VERIFY_VERIFY_REPORT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "rapidjson/document.h"
#include "verify/verify.h"

namespace memledger {

// VerifyJson: the study's keys (config, n_params, param_bytes, grad_bytes,
// adamw_state_bytes, saved_bytes, saved_ratio_vs_none, time_s, max_grad_diff,
// predicted_saved_bytes_none, measured_over_predicted — Korthikanti's, as the study
// defines it) with measured values, plus `predicted` (the exact estimator), `ratio`
// (measured / predicted per bucket), `max_grad_diff_per_variant`, `passed`, `failures`.
rapidjson::Document VerifyJson(const VerifyReport& report);

// AddVerdictJson ends a report object: grad_tolerance, passed (no failures), failures.
void AddVerdictJson(double grad_tolerance, const std::vector<std::string>& failures,
                    rapidjson::Document& doc);

// VerifyTimelineSvg: the predicted step's timeline per variant with the measured live
// bytes drawn over it (estimator/report/timeline_svg.h). FailedPrecondition if the report has no
// predicted timeline (verified without VerifyOptions::timeline) or no measured step;
// Unimplemented, with the reason, where the step simulation does not model the config.
absl::StatusOr<std::string> VerifyTimelineSvg(const VerifyReport& report);

// VerifyTable: predicted, measured and ratio per bucket; Korthikanti; gradients; times;
// the verdict.
std::string VerifyTable(const VerifyReport& report);

}  // namespace memledger

#endif  // VERIFY_VERIFY_REPORT_H_
