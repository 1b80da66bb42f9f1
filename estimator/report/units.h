// Human-readable byte counts for tables ("48.69 MiB", "3.21 GiB", "512 B") and budgets
// given in GiB.
#ifndef ESTIMATOR_REPORT_UNITS_H_
#define ESTIMATOR_REPORT_UNITS_H_

#include <cstdint>
#include <optional>
#include <string>

namespace memledger {

// HumanBytes uses binary units (KiB = 1024 B) with two decimals; plain bytes below 1 KiB.
std::string HumanBytes(int64_t bytes);

// RoundTo4 rounds like the study's Python round(x, 4), for ratios in JSON.
double RoundTo4(double x);

}  // namespace memledger

#endif  // ESTIMATOR_REPORT_UNITS_H_
